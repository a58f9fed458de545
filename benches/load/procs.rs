//! The child processes of a run: the mock upstream, the proxy, `redis-server`, nginx and
//! PostgreSQL.
//!
//! Each one is killed when its handle is dropped, also while unwinding from a panic. Everything
//! listens on 127.0.0.1 only; each process writes its log into the run's temporary directory.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, PoisonError, mpsc};
use std::time::{Duration, Instant};

/// How long a child may take to start listening.
const START_TIMEOUT: Duration = Duration::from_secs(10);
/// How long nginx gets to stop its workers after SIGTERM before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(3);

/// Every running child (pid, the signal that stops it first, if not SIGKILL), for [`kill_all`].
static RUNNING: Mutex<Vec<(u32, Option<&'static str>)>> = Mutex::new(Vec::new());

/// Kills every running child at once: for a bench interrupted by a signal, whose handles will
/// not be dropped.
pub(crate) fn kill_all() {
    let running = RUNNING
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    for (pid, stop_signal) in running {
        let signal = stop_signal.unwrap_or("-KILL");
        let _ = Command::new("kill")
            .args([signal, &pid.to_string()])
            .status();
    }
}

/// Adds a process started elsewhere (the harness's PostgreSQL) to those [`kill_all`] stops,
/// with the signal that stops it first.
pub(crate) fn track(pid: u32, stop_signal: Option<&'static str>) {
    RUNNING
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push((pid, stop_signal));
}

/// Takes a process [`track`] added out of those [`kill_all`] stops.
pub(crate) fn untrack(pid: u32) {
    RUNNING
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .retain(|(p, _)| *p != pid);
}

/// A running child process with its log file; killed on drop.
pub(crate) struct ChildProcess {
    name: String,
    child: Child,
    log: PathBuf,
    /// The signal to stop it with before SIGKILL (nginx: `-TERM`, as SIGKILL on the master
    /// would orphan its workers; PostgreSQL: `-QUIT`, which takes its backends down at once).
    stop_signal: Option<&'static str>,
}

impl ChildProcess {
    /// Spawns `command` with stdin closed and stderr into `log`. Stdout is the caller's choice.
    pub(crate) fn spawn(
        name: String,
        command: &mut Command,
        log: PathBuf,
        stop_signal: Option<&'static str>,
    ) -> Result<Self, String> {
        let file = File::create(&log).map_err(|e| format!("create {}: {e}", log.display()))?;
        let child = command
            .stdin(Stdio::null())
            .stderr(file)
            .spawn()
            .map_err(|e| format!("start {name}: {e}"))?;
        track(child.id(), stop_signal);
        Ok(ChildProcess {
            name,
            child,
            log,
            stop_signal,
        })
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// An error, with the end of its log, if the process has exited.
    pub(crate) fn ensure_running(&mut self) -> Result<(), String> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => {
                let lines = self.log_lines();
                let tail = lines[lines.len().saturating_sub(15)..].join("\n");
                Err(format!(
                    "{} exited ({status}); the end of {}:\n{tail}",
                    self.name,
                    self.log.display()
                ))
            }
            Err(e) => Err(format!("{}: {e}", self.name)),
        }
    }

    /// The lines of its log so far.
    pub(crate) fn log_lines(&self) -> Vec<String> {
        std::fs::read_to_string(&self.log)
            .map(|text| text.lines().map(str::to_owned).collect())
            .unwrap_or_default()
    }

    /// Waits until `addr` accepts connections, failing early if the process exits.
    pub(crate) fn wait_listening(&mut self, addr: SocketAddr) -> Result<(), String> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            self.ensure_running()?;
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("{} did not listen on {addr} in time", self.name));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        self.stop();
        untrack(self.child.id());
    }
}

impl ChildProcess {
    pub(crate) fn stop(&mut self) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        if let Some(signal) = self.stop_signal {
            let pid = self.child.id().to_string();
            let _ = Command::new("kill").args([signal, &pid]).status();
            let deadline = Instant::now() + STOP_GRACE;
            while Instant::now() < deadline {
                if matches!(self.child.try_wait(), Ok(Some(_))) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A loopback port that was free a moment ago (never 6379, the default Redis port).
pub(crate) fn free_port() -> Result<u16, String> {
    loop {
        let listener =
            TcpListener::bind("127.0.0.1:0").map_err(|e| format!("bind 127.0.0.1:0: {e}"))?;
        let port = listener
            .local_addr()
            .map_err(|e| format!("local_addr: {e}"))?
            .port();
        if port != 6379 {
            return Ok(port);
        }
    }
}

/// The binary `env_var` names (empty or `none`: treat it as not installed), else `name` on
/// `PATH` or in the sbin directories (nginx lives in /usr/sbin).
pub(crate) fn find_binary(name: &str, env_var: &str) -> Option<PathBuf> {
    if let Some(value) = std::env::var_os(env_var) {
        let none = value.is_empty() || value == "none";
        return (!none).then(|| PathBuf::from(value));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/local/sbin", "/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// `/proc` counts in USER_HZ, 100 on Linux whatever the kernel's own tick.
const TICKS_PER_SECOND: u64 = 100;

pub(crate) fn ticks_to_duration(ticks: u64) -> Duration {
    Duration::from_millis(ticks * 1000 / TICKS_PER_SECOND)
}

/// The fields of a `/proc/*/stat` line after the parenthesised command name: state, ppid, ...,
/// utime (11th), stime (12th), cutime (13th), cstime (14th).
fn stat_fields(stat: &str) -> Option<Vec<u64>> {
    let (_, rest) = stat.rsplit_once(')')?;
    // The state is a letter: a 0 keeps the indexes of the numbers after it.
    Some(
        rest.split_whitespace()
            .map(|f| f.parse().unwrap_or(0))
            .collect(),
    )
}

/// The CPU time (user + system, every thread) used so far by the process `pid` and by its
/// children (nginx's workers, PostgreSQL's backends), from `/proc/*/stat`, including the
/// children it has already reaped (a PostgreSQL backend whose connection closed): their time
/// moves into its own `cutime`/`cstime` then, so the sum never goes backwards. `None` where
/// `/proc` cannot be read.
pub(crate) fn cpu_time(pid: u32) -> Option<Duration> {
    let mut ticks = 0;
    let mut found = false;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(Ok(this)) = entry.file_name().to_str().map(str::parse::<u32>) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let Some(fields) = stat_fields(&stat) else {
            continue;
        };
        let ppid = fields.get(1).and_then(|f| u32::try_from(*f).ok());
        if this != pid && ppid != Some(pid) {
            continue;
        }
        if let (Some(user), Some(system)) = (fields.get(11), fields.get(12)) {
            ticks += user + system;
            found |= this == pid;
        }
        if this == pid
            && let (Some(user), Some(system)) = (fields.get(13), fields.get(14))
        {
            ticks += user + system;
        }
    }
    found.then(|| ticks_to_duration(ticks))
}

/// This process's own CPU time (every thread: the load generator; not its running children),
/// and that of the children it has reaped (pgbench, once its `output()` returned), from
/// `/proc/self/stat`.
pub(crate) fn own_cpu_time() -> Option<(Duration, Duration)> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let fields = stat_fields(&stat)?;
    let sum = |a: usize, b: usize| Some(ticks_to_duration(fields.get(a)? + fields.get(b)?));
    Some((sum(11, 12)?, sum(13, 14)?))
}

/// The CPU time a process (and its children) uses over a stretch of load, per request.
pub(crate) struct CpuMeter {
    pid: u32,
    before: Option<Duration>,
}

impl CpuMeter {
    pub(crate) fn start(pid: u32) -> CpuMeter {
        CpuMeter {
            pid,
            before: cpu_time(pid),
        }
    }

    /// CPU time since the start over `requests` (`None` if `/proc` could not be read).
    pub(crate) fn per_request(&self, requests: u64) -> Option<Duration> {
        let used = cpu_time(self.pid)?.checked_sub(self.before?)?;
        let n = u32::try_from(requests).ok().filter(|n| *n > 0)?;
        Some(used / n)
    }
}

/// The resident set size of a process, from `/proc/PID/status` (`VmRSS`), in bytes.
pub(crate) fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The `mock-upstream` binary, on a port it picked itself.
pub(crate) struct Mock {
    process: ChildProcess,
    pub addr: SocketAddr,
}

impl Mock {
    pub(crate) fn pid(&self) -> u32 {
        self.process.pid()
    }
}

impl Mock {
    pub(crate) fn start(bin: &Path, dir: &Path) -> Result<Mock, String> {
        let mut process = ChildProcess::spawn(
            "mock-upstream".to_owned(),
            Command::new(bin)
                .args(["--listen", "127.0.0.1:0"])
                .env("RUST_LOG", "warn")
                .stdout(Stdio::piped()),
            dir.join("mock-upstream.log"),
            None,
        )?;
        let stdout = process
            .child
            .stdout
            .take()
            .ok_or("mock-upstream: no stdout")?;
        // The first stdout line names the address: `mock-upstream listening on http://ADDR`.
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let read = BufReader::new(stdout).read_line(&mut line).map(|_| line);
            let _ = tx.send(read);
        });
        let line = rx
            .recv_timeout(START_TIMEOUT)
            .map_err(|_| "mock-upstream did not print its address in time".to_owned())?
            .map_err(|e| format!("mock-upstream stdout: {e}"))?;
        let addr = line
            .trim()
            .strip_prefix("mock-upstream listening on http://")
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| format!("mock-upstream printed {line:?}, not its address"))?;
        process.wait_listening(addr)?;
        Ok(Mock { process, addr })
    }
}

/// The store a proxy process is configured with.
pub(crate) enum StoreConfig {
    Memory {
        max_entries: u64,
    },
    Redis {
        url: String,
    },
    Sqlite {
        path: PathBuf,
        /// `normal` or `full`.
        sync: &'static str,
        /// `store.sweep_interval`, when not the default.
        sweep_interval: Option<&'static str>,
    },
    Postgres {
        url: String,
        schema: String,
        pool_size: usize,
        sweep_interval: Option<&'static str>,
    },
}

/// Paths the proxy routes: the idempotent route, the observed route and the pass-through
/// route. All are mock echo paths of the same length, so the upstream does the same work for
/// each.
pub(crate) const IDEMPOTENT_PATH: &str = "/echo/idem";
pub(crate) const OBSERVED_PATH: &str = "/echo/obsv";
pub(crate) const PASSTHROUGH_PATH: &str = "/echo/pass";
/// The webhook route's path: a mock echo path of the same length, so the upstream does the
/// same work for a delivery as for a new key.
pub(crate) const WEBHOOK_PATH: &str = "/echo/hook";
/// The JSON-RPC route's path: the mock's MCP server, whose `echo` tool does the echo paths'
/// work.
pub(crate) const JSONRPC_PATH: &str = "/mcp";
/// The gRPC rows' method: the mock ledger's unary `Transfer`, over HTTP/2.
pub(crate) const GRPC_PATH: &str = "/ledger.v1.Ledger/Transfer";
/// The resolve route's path: the mock books there (`POST /reservations` books as `/bookings`
/// does), and its lookup by reference finds the booking.
pub(crate) const RESOLVE_PATH: &str = "/reservations";

/// The resolve route's settings, written into its configuration here and read by the
/// `resolve` scenario (its counters' label, the cost of each lost answer).
pub(crate) mod resolve_route {
    /// The route's name, as its counters are labelled.
    pub(crate) const NAME: &str = "resolve";
    /// The `timeout` of the route's upstream: what each lost answer costs.
    pub(crate) const UPSTREAM_TIMEOUT: &str = "250ms";
    /// The route's `resolve:` timings. A lookup that finds the booking settles it whenever it
    /// is sent; `settle_after` only matters for a lookup that finds nothing.
    pub(crate) const SETTLE_AFTER: &str = "2s";
    pub(crate) const INTERVAL: &str = "200ms";
    pub(crate) const GIVE_UP_AFTER: &str = "10s";
}

/// The routes of a proxy: the three every proxy has, and those a scenario adds before the
/// pass-through route.
#[derive(Clone, Copy)]
pub(crate) struct Routes<'a> {
    /// `ttl` of the idempotent routes.
    pub ttl: &'a str,
    /// A Standard Webhooks route at [`WEBHOOK_PATH`], its secrets in this file.
    pub webhook_secrets: Option<&'a Path>,
    /// A route at [`RESOLVE_PATH`] under `on_unknown_outcome: resolve` (see `resolve`), and an
    /// admin listener for its counters.
    pub resolve: bool,
    /// A JSON-RPC route at [`JSONRPC_PATH`] claiming `tools/call`, the key in `_meta`.
    pub jsonrpc: bool,
    /// A route at [`GRPC_PATH`] on an `h2c` upstream (the mock again): a `grpc:` route
    /// (`Some(true)`) or a pass-through one (`Some(false)`).
    pub grpc: Option<bool>,
    /// A `tracing:` section (whole lines), for the rows that measure what traces cost.
    pub tracing: Option<&'a str>,
}

impl Routes<'_> {
    /// The three routes every proxy has, with this `ttl`.
    pub(crate) fn plain(ttl: &str) -> Routes<'_> {
        Routes {
            ttl,
            webhook_secrets: None,
            resolve: false,
            jsonrpc: false,
            grpc: None,
            tracing: None,
        }
    }
}

/// An `idemproxy` process in front of the mock.
pub(crate) struct Proxy {
    pub process: ChildProcess,
    pub addr: SocketAddr,
    /// The admin listener (`/metrics`), when its routes need one.
    pub admin: Option<SocketAddr>,
}

impl Proxy {
    /// Starts the proxy binary with its config written to `DIR/proxy-LABEL.yaml`. The proxy
    /// logs its address only at `info`, so the port is picked here (bind port 0, drop) and the
    /// start retried on another port if it was taken meanwhile.
    pub(crate) fn start(
        bin: &Path,
        dir: &Path,
        label: &str,
        store: &StoreConfig,
        upstream: SocketAddr,
        routes: &Routes<'_>,
        rust_log: &str,
    ) -> Result<Proxy, String> {
        let file_label = label.replace('/', "-");
        let config = dir.join(format!("proxy-{file_label}.yaml"));
        let mut last_error = String::new();
        for _attempt in 0..3 {
            let addr = SocketAddr::from(([127, 0, 0, 1], free_port()?));
            let admin = match routes.resolve {
                true => Some(SocketAddr::from(([127, 0, 0, 1], free_port()?))),
                false => None,
            };
            let listen = Listen { addr, admin };
            let yaml = proxy_yaml(listen, store, upstream, routes);
            std::fs::write(&config, yaml)
                .map_err(|e| format!("write {}: {e}", config.display()))?;
            let mut process = ChildProcess::spawn(
                format!("idemproxy ({label})"),
                Command::new(bin)
                    .arg("--config")
                    .arg(&config)
                    .env("RUST_LOG", rust_log)
                    .stdout(Stdio::null()),
                dir.join(format!("proxy-{file_label}.log")),
                None,
            )?;
            let listening = process
                .wait_listening(addr)
                .and_then(|()| admin.map_or(Ok(()), |a| process.wait_listening(a)));
            match listening {
                Ok(()) => {
                    return Ok(Proxy {
                        process,
                        addr,
                        admin,
                    });
                }
                Err(e) => last_error = e,
            }
        }
        Err(last_error)
    }
}

/// Where a proxy listens: its main listener, and its admin listener if it has one.
struct Listen {
    addr: SocketAddr,
    admin: Option<SocketAddr>,
}

fn proxy_yaml(
    listen: Listen,
    store: &StoreConfig,
    upstream: SocketAddr,
    routes: &Routes<'_>,
) -> String {
    let store = match store {
        StoreConfig::Memory { max_entries } => {
            format!("  backend: memory\n  max_entries: {max_entries}\n")
        }
        StoreConfig::Redis { url } => format!("  backend: redis\n  url: {url}\n"),
        StoreConfig::Sqlite {
            path,
            sync,
            sweep_interval,
        } => format!(
            "  backend: sqlite\n  path: {}\n  sync: {sync}\n{}",
            path.display(),
            sweep_line(*sweep_interval)
        ),
        StoreConfig::Postgres {
            url,
            schema,
            pool_size,
            sweep_interval,
        } => format!(
            "  backend: postgres\n  url: {url}\n  schema: {schema}\n  pool_size: {pool_size}\n{}",
            sweep_line(*sweep_interval)
        ),
    };
    let admin = listen
        .admin
        .map_or(String::new(), |a| format!("admin_listen: {a}\n"));
    let (extra_upstreams, extra_routes) = extra_routes(upstream, routes);
    let (listen, ttl) = (listen.addr, routes.ttl);
    let tracing = routes.tracing.unwrap_or_default();
    format!(
        "listen: {listen}
{admin}{tracing}shutdown_timeout: 1s
store:
{store}  key_prefix: \"idemproxy-load:\"
upstreams:
  mock:
    url: http://{upstream}
{extra_upstreams}routes:
  - name: idempotent
    methods: [POST]
    path: {IDEMPOTENT_PATH}
    upstream: mock
    idempotency:
      ttl: {ttl}
      lock_ttl: 10s
      max_response_body: 1MiB
  - name: observed
    methods: [POST]
    path: {OBSERVED_PATH}
    upstream: mock
    idempotency:
      ttl: {ttl}
      lock_ttl: 10s
      max_response_body: 1MiB
      mode: observe
{extra_routes}  - name: pass-through
    path: /*
    upstream: mock
"
    )
}

/// The upstream entries and routes a scenario adds: the webhook route (the idempotent route's
/// settings, so that the two compare), the resolve route and its upstream with a short
/// `timeout` (see `resolve`).
fn extra_routes(upstream: SocketAddr, routes: &Routes<'_>) -> (String, String) {
    let (mut upstreams, mut lines) = (String::new(), String::new());
    let ttl = routes.ttl;
    if let Some(secrets) = routes.webhook_secrets {
        lines.push_str(&format!(
            "  - name: webhook
    methods: [POST]
    path: {WEBHOOK_PATH}
    upstream: mock
    webhook:
      provider: standard
      secrets_file: {}
    idempotency:
      ttl: {ttl}
      lock_ttl: 10s
      max_response_body: 1MiB
",
            secrets.display()
        ));
    }
    if let Some(claimed) = routes.grpc {
        upstreams.push_str(&format!(
            "  mock-h2:
    url: http://{upstream}
    protocol: h2c
"
        ));
        let kind = if claimed {
            format!("    grpc: {{}}\n    idempotency:\n      ttl: {ttl}\n      lock_ttl: 10s\n")
        } else {
            String::new()
        };
        lines.push_str(&format!(
            "  - name: grpc
    path: {GRPC_PATH}
    upstream: mock-h2
{kind}"
        ));
    }
    if routes.jsonrpc {
        lines.push_str(&format!(
            "  - name: jsonrpc
    methods: [POST]
    path: {JSONRPC_PATH}
    upstream: mock
    jsonrpc:
      methods: [tools/call]
    idempotency:
      key_from: [\"json:/params/_meta/idempotency-key\"]
      ttl: {ttl}
      lock_ttl: 10s
      max_response_body: 1MiB
"
        ));
    }
    if routes.resolve {
        upstreams.push_str(&format!(
            "  mock-short:
    url: http://{upstream}
    connect_timeout: 100ms
    timeout: {}
",
            resolve_route::UPSTREAM_TIMEOUT
        ));
        lines.push_str(&format!(
            "  - name: {}
    methods: [POST]
    path: {RESOLVE_PATH}
    upstream: mock-short
    idempotency:
      ttl: {ttl}
      lock_ttl: 10s
      on_unknown_outcome: resolve
      resolve:
        request: GET /bookings/by-reference/{{json:/reference}}
        settle_after: {}
        interval: {}
        give_up_after: {}
",
            resolve_route::NAME,
            resolve_route::SETTLE_AFTER,
            resolve_route::INTERVAL,
            resolve_route::GIVE_UP_AFTER
        ));
    }
    (upstreams, lines)
}

fn sweep_line(sweep_interval: Option<&str>) -> String {
    sweep_interval.map_or(String::new(), |every| {
        format!("  sweep_interval: {every}\n")
    })
}

/// A `redis-server` of the run's own: a free loopback port, no persistence.
pub(crate) struct Redis {
    process: ChildProcess,
    port: u16,
}

impl Redis {
    pub(crate) fn start(bin: &Path, dir: &Path) -> Result<Redis, String> {
        let port = free_port()?;
        let port_text = port.to_string();
        let mut process = ChildProcess::spawn(
            "redis-server".to_owned(),
            Command::new(bin)
                .args(["--port", &port_text, "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
                .args(["--loglevel", "warning"])
                .stdout(Stdio::null()),
            dir.join("redis-server.log"),
            None,
        )?;
        process.wait_listening(SocketAddr::from(([127, 0, 0, 1], port)))?;
        let redis = Redis { process, port };
        redis.command("PING")?;
        Ok(redis)
    }

    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    pub(crate) fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Empties it, so each scenario starts from nothing.
    pub(crate) fn flush(&self) -> Result<(), String> {
        self.command("FLUSHALL")
    }

    fn command(&self, name: &str) -> Result<(), String> {
        let client = redis::Client::open(self.url()).map_err(|e| format!("redis: {e}"))?;
        let mut connection = client
            .get_connection_with_timeout(Duration::from_secs(2))
            .map_err(|e| format!("redis: connect: {e}"))?;
        redis::cmd(name)
            .query::<()>(&mut connection)
            .map_err(|e| format!("redis: {name}: {e}"))
    }
}

/// What an nginx of the run serves.
#[derive(Clone, Copy, Debug)]
pub(crate) enum NginxSite {
    /// `proxy_pass` to this upstream over a keep-alive pool: the reference reverse proxy.
    Proxy(SocketAddr),
    /// `return 200` with [`NGINX_BODY`] on every path, whatever the method: the cheapest
    /// upstream there is (`--upstream nginx`).
    Fixed,
}

/// The answer of the [`NginxSite::Fixed`] nginx: small, JSON, the same on every path. No `'`
/// (it is quoted with them in the config) and no `$` (nginx would read a variable).
pub(crate) const NGINX_BODY: &str =
    r#"{"booking":"fixed","status":"confirmed","from":"DEL","to":"BOM"}"#;

/// An nginx of the run's own: the reference proxy, or the fixed upstream.
pub(crate) struct Nginx {
    process: ChildProcess,
    pub addr: SocketAddr,
}

impl Nginx {
    /// Runs `nginx -p DIR/NAME -c nginx.conf` in the foreground (`daemon off`), every temp path
    /// under its own prefix, so two of them can run side by side.
    pub(crate) fn start(
        bin: &Path,
        dir: &Path,
        name: &str,
        site: NginxSite,
    ) -> Result<Nginx, String> {
        let prefix = dir.join(name);
        std::fs::create_dir_all(&prefix)
            .map_err(|e| format!("create {}: {e}", prefix.display()))?;
        let addr = SocketAddr::from(([127, 0, 0, 1], free_port()?));
        let conf = prefix.join("nginx.conf");
        let text = nginx_conf(&prefix, addr, site, &missing_modules(bin));
        std::fs::write(&conf, text).map_err(|e| format!("write {}: {e}", conf.display()))?;
        let mut process = ChildProcess::spawn(
            name.to_owned(),
            Command::new(bin)
                .arg("-p")
                .arg(&prefix)
                .arg("-c")
                .arg(&conf)
                .arg("-e")
                .arg(prefix.join("error.log"))
                .stdout(Stdio::null()),
            dir.join(format!("{name}.stderr.log")),
            Some("-TERM"),
        )?;
        process.wait_listening(addr)?;
        Ok(Nginx { process, addr })
    }

    /// The master's pid; its workers are its children (see [`cpu_time`]).
    pub(crate) fn pid(&self) -> u32 {
        self.process.pid()
    }
}

/// The `--without-http_*_module` flags nginx was built with (their directives are unknown).
fn missing_modules(bin: &Path) -> String {
    Command::new(bin)
        .arg("-V")
        .output()
        .map(|out| String::from_utf8_lossy(&out.stderr).into_owned())
        .unwrap_or_default()
}

fn nginx_conf(prefix: &Path, listen: SocketAddr, site: NginxSite, build: &str) -> String {
    let p = prefix.display();
    let mut temp_paths =
        format!("    client_body_temp_path {p}/client_body;\n    proxy_temp_path {p}/proxy;\n");
    for module in ["fastcgi", "uwsgi", "scgi"] {
        if !build.contains(&format!("--without-http_{module}_module")) {
            temp_paths.push_str(&format!("    {module}_temp_path {p}/{module};\n"));
        }
    }
    let site = match site {
        NginxSite::Proxy(upstream) => format!(
            "    upstream mock {{
        server {upstream};
        keepalive 64;
        keepalive_requests 1000000;
    }}
    server {{
        listen {listen};
        location / {{
            proxy_pass http://mock;
            proxy_http_version 1.1;
            proxy_set_header Connection \"\";
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_set_header X-Forwarded-Proto $scheme;
            proxy_buffer_size 16k;
            proxy_buffers 8 16k;
            proxy_max_temp_file_size 0;
        }}
    }}
"
        ),
        // `return` answers before any body is read; nginx discards the request body itself.
        NginxSite::Fixed => format!(
            "    server {{
        listen {listen};
        default_type application/json;
        location / {{
            return 200 '{NGINX_BODY}';
        }}
    }}
"
        ),
    };
    format!(
        "worker_processes auto;
daemon off;
pid {p}/nginx.pid;
error_log {p}/error.log warn;
events {{
    worker_connections 4096;
}}
http {{
    access_log off;
{temp_paths}    keepalive_requests 1000000;
    keepalive_timeout 75s;
{site}}}
"
    )
}
