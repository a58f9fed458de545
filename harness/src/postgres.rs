//! A PostgreSQL server of this test's own: `initdb` into a temp dir and `postgres` on a free
//! loopback port, with its unix socket in that dir, run as an unprivileged user (initdb refuses
//! root) in a process group of its own. Every child of the postmaster runs in a session of its
//! own, so a pause signals the postmaster and then each child. Never the server on 5432.
//!
//! - [`PgServer::start`]: a fresh cluster (fsync off unless asked: the tests kill the server, not
//!   the machine's power).
//! - [`PgServer::shared`]: one server per test binary, for the behaviour tests; each test takes a
//!   schema of its own ([`PgServer::fresh_schema`]), so tests never see each other's records.
//! - [`PgServer::pause`] / [`PgServer::resume`] (SIGSTOP/SIGCONT to every server process),
//!   [`PgServer::crash`] (`pg_ctl stop -m immediate`: no checkpoint, WAL replay at the next
//!   start), [`PgServer::start_again`], [`PgServer::sql`] (psql, for inspecting what the proxy
//!   stored).
//!
//! - [`PgServer::try_start`]: the same for a program that reports errors rather than panics
//!   (the load bench): server settings of the caller's (fsync stays on unless they turn it off)
//!   and the server's log in a file.
//!
//! The binaries are found in `PG_BIN` (empty or `none`: as if PostgreSQL were not installed),
//! else the newest `/usr/lib/postgresql/*/bin`, else PATH ([`installed_bin_dir`]). The user is
//! `PG_TEST_USER`, else `postgres`, else `nobody`.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::free_port;

/// The directory holding `initdb`, `postgres`, `pg_ctl`, `psql` and `pgbench`, if PostgreSQL is
/// installed: `PG_BIN` (empty or `none`: not installed), else the newest
/// `/usr/lib/postgresql/*/bin`, else a directory on `PATH` with `postgres` and `initdb`.
pub fn installed_bin_dir() -> Option<PathBuf> {
    if let Some(value) = std::env::var_os("PG_BIN") {
        let none = value.is_empty() || value == "none";
        return (!none).then(|| PathBuf::from(value));
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("postgres").is_file().then_some((v, bin))
        })
        .collect();
    versions.sort();
    if let Some((_, bin)) = versions.pop() {
        return Some(bin);
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .find(|dir| dir.join("postgres").is_file() && dir.join("initdb").is_file())
}

/// A PostgreSQL program (`initdb`, `psql`, `pgbench` …): in [`installed_bin_dir`], else
/// looked up on `PATH` when it runs.
pub fn bin(name: &str) -> PathBuf {
    match installed_bin_dir() {
        Some(dir) => dir.join(name),
        None => PathBuf::from(name),
    }
}

/// The unprivileged user the server runs as: its uid and gid.
fn server_user() -> (u32, u32) {
    try_server_user().unwrap_or_else(|e| panic!("{e}"))
}

/// [`server_user`], or why there is none.
fn try_server_user() -> Result<(u32, u32), String> {
    let wanted: Vec<String> = match std::env::var("PG_TEST_USER") {
        Ok(u) => vec![u],
        Err(_) => vec!["postgres".into(), "nobody".into()],
    };
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
    for name in &wanted {
        for line in passwd.lines() {
            let f: Vec<&str> = line.split(':').collect();
            if f.len() > 3
                && f[0] == name
                && let (Ok(uid), Ok(gid)) = (f[2].parse(), f[3].parse())
            {
                return Ok((uid, gid));
            }
        }
    }
    Err(format!(
        "no unprivileged user for PostgreSQL (tried {wanted:?}; set PG_TEST_USER)"
    ))
}

/// Whether this process runs as root (then the server must run as another user).
fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1).map(|u| u == "0"))
        })
        .unwrap_or(false)
}

/// A command that runs as the server's user when this process is root.
fn as_server_user(program: PathBuf) -> Command {
    let mut cmd = Command::new(program);
    if is_root() {
        let (uid, gid) = server_user();
        cmd.uid(uid).gid(gid);
    }
    cmd
}

/// Makes `path` owned by the server's user (when root) and private to it.
fn hand_over(path: &Path) -> Result<(), String> {
    if is_root() {
        let (uid, gid) = try_server_user()?;
        std::os::unix::fs::chown(path, Some(uid), Some(gid))
            .map_err(|e| format!("chown {}: {e}", path.display()))?;
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| format!("chmod {}: {e}", path.display()))
}

/// A PostgreSQL server on a free loopback port.
pub struct PgServer {
    port: u16,
    /// Holds `data/` (the cluster) and the unix socket.
    dir: tempfile::TempDir,
    child: Option<Child>,
    /// Extra `-c name=value` settings.
    settings: Vec<String>,
    /// Where the server's stderr goes (`None`: nowhere).
    log: Option<PathBuf>,
}

/// The database the proxy's tests use (initdb makes `postgres`).
pub const DATABASE: &str = "postgres";
/// The role: initdb names the superuser after the user running it.
fn role() -> String {
    if is_root() {
        let (uid, _) = server_user();
        let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
        for line in passwd.lines() {
            let f: Vec<&str> = line.split(':').collect();
            if f.len() > 2 && f[2].parse::<u32>().ok() == Some(uid) {
                return f[0].to_owned();
            }
        }
        panic!("no name for uid {uid}");
    }
    std::env::var("USER").unwrap_or_else(|_| "postgres".into())
}

impl PgServer {
    /// Initializes a cluster in a temp dir and starts it, with `settings` as extra
    /// `name=value` server settings.
    pub fn start_with(settings: &[&str]) -> PgServer {
        PgServer::try_start(settings, None).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Initializes a cluster in a temp dir and starts it with `settings` (`name=value`; none
    /// turns fsync off), its log in `log` if given: the error says what failed.
    pub fn try_start(settings: &[&str], log: Option<&Path>) -> Result<PgServer, String> {
        let mut s = PgServer::init(settings)?;
        s.log = log.map(Path::to_owned);
        s.spawn()?;
        Ok(s)
    }

    /// A fresh cluster that wants TLS: `ssl=on` with this certificate and key (copied into the
    /// cluster's directory, owned by the server's user: the server refuses a key that others
    /// can read).
    pub fn start_tls(cert: &Path, key: &Path) -> PgServer {
        let mut s = PgServer::init(&["fsync=off", "ssl=on"]).unwrap_or_else(|e| panic!("{e}"));
        for (name, from) in [("server.crt", cert), ("server.key", key)] {
            let to = s.dir.path().join(name);
            std::fs::copy(from, &to).expect("copy the TLS file");
            if is_root() {
                let (uid, gid) = server_user();
                std::os::unix::fs::chown(&to, Some(uid), Some(gid)).expect("chown the TLS file");
            }
            std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o600))
                .expect("chmod the TLS file");
            let setting = if name == "server.crt" {
                "ssl_cert_file"
            } else {
                "ssl_key_file"
            };
            s.settings.push(format!("{setting}={}", to.display()));
        }
        s.spawn().unwrap_or_else(|e| panic!("{e}"));
        s
    }

    /// `initdb` into a fresh temp dir; not started.
    fn init(settings: &[&str]) -> Result<PgServer, String> {
        if is_root() {
            try_server_user()?;
        }
        let dir = tempfile::Builder::new()
            .prefix("idemproxy-pg-")
            .tempdir()
            .map_err(|e| format!("a temp dir for postgres: {e}"))?;
        hand_over(dir.path())?;
        let data = dir.path().join("data");
        let out = as_server_user(bin("initdb"))
            .arg("-D")
            .arg(&data)
            .args(["-A", "trust", "-E", "UTF8", "--no-sync", "--locale=C"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .map_err(|e| format!("run initdb (install it: apt-get install postgresql): {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "initdb failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(PgServer {
            port: free_port(),
            dir,
            child: None,
            settings: settings.iter().map(|s| (*s).to_owned()).collect(),
            log: None,
        })
    }

    /// A fresh cluster with fsync off (the tests kill processes, never the power).
    pub fn start() -> PgServer {
        PgServer::start_with(&["fsync=off"])
    }

    /// One server for the whole test binary, started on first use and never stopped (the
    /// process group dies with the test binary: see [`Drop`]). Tests that stop, pause or
    /// crash the database start their own with [`PgServer::start`].
    pub fn shared() -> &'static PgServer {
        static SHARED: OnceLock<PgServer> = OnceLock::new();
        SHARED.get_or_init(|| {
            let s = PgServer::start_with(&["fsync=off", "max_connections=400"]);
            reap_on_exit(s.pid(), s.dir.path());
            s
        })
    }

    /// A schema name no other test of this binary has had.
    pub fn fresh_schema() -> String {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        format!(
            "t{}_{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        )
    }

    fn spawn(&mut self) -> Result<(), String> {
        let mut cmd = as_server_user(bin("postgres"));
        cmd.arg("-D")
            .arg(self.dir.path().join("data"))
            .args(["-p", &self.port.to_string()])
            .args(["-c", "listen_addresses=127.0.0.1"])
            .arg("-c")
            .arg(format!(
                "unix_socket_directories={}",
                self.dir.path().display()
            ))
            .args([
                "-c",
                "logging_collector=off",
                "-c",
                "log_min_messages=fatal",
            ]);
        for s in &self.settings {
            cmd.args(["-c", s]);
        }
        let stderr = match &self.log {
            Some(path) => Stdio::from(
                std::fs::File::create(path)
                    .map_err(|e| format!("create {}: {e}", path.display()))?,
            ),
            None => Stdio::null(),
        };
        // Its own process group: SIGSTOP/SIGCONT/SIGKILL to -pgid reach every backend (and
        // a terminal's Ctrl-C does not).
        cmd.process_group(0).stdout(Stdio::null()).stderr(stderr);
        self.child = Some(cmd.spawn().map_err(|e| format!("spawn postgres: {e}"))?);
        self.wait_ready()
    }

    fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok()
                && self.try_sql("SELECT 1").is_ok()
            {
                return Ok(());
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                self.child = None;
                return Err(format!("postgres exited before it answered ({status})"));
            }
            if Instant::now() >= deadline {
                return Err(format!("postgres did not start on {}", self.port));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The role the server knows: initdb names the superuser after the user running it.
    pub fn role(&self) -> String {
        role()
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:PORT`, for a relay in front of it.
    pub fn addr(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// `postgres://ROLE@127.0.0.1:PORT/postgres`.
    pub fn url(&self) -> String {
        self.url_via(self.port)
    }

    /// The same URL through another port (a relay in front of this server).
    pub fn url_via(&self, port: u16) -> String {
        format!("postgres://{}@127.0.0.1:{port}/{DATABASE}", role())
    }

    /// The postmaster's pid (also its process group).
    pub fn pid(&self) -> u32 {
        self.child
            .as_ref()
            .map(Child::id)
            .expect("postgres is running")
    }

    fn signal_group(&self, sig: &str) {
        let status = Command::new("kill")
            .args([sig, "--", &format!("-{}", self.pid())])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {sig} postgres");
    }

    /// The postmaster's children (backends, background processes). Each runs in a session of
    /// its own (postgres calls `setsid` in every child), so a signal to the postmaster's
    /// process group does not reach them.
    fn children(&self) -> Vec<u32> {
        let parent = self.pid();
        let mut found = Vec::new();
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            // `pid (comm) state ppid …`: the name may hold spaces and parentheses.
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|p| p.parse::<u32>().ok());
            if ppid == Some(parent) {
                found.push(pid);
            }
        }
        found
    }

    /// `sig` to the postmaster first (so it forks nobody new meanwhile), then to every child,
    /// all in one `kill`: one process per backend would stretch a short pause by a process
    /// start each on a loaded machine.
    fn signal_server(&self, sig: &str) {
        self.signal_group(sig);
        let children: Vec<String> = self.children().iter().map(u32::to_string).collect();
        if children.is_empty() {
            return;
        }
        // A child may have exited since it was listed: `kill` still signals the others.
        let _ = Command::new("kill")
            .arg(sig)
            .args(&children)
            .stderr(Stdio::null())
            .status();
    }

    /// SIGSTOP to the postmaster and every backend: the database hangs, connections stay open.
    pub fn pause(&self) {
        self.signal_server("-STOP");
    }

    /// SIGCONT to the postmaster and every backend.
    pub fn resume(&self) {
        self.signal_server("-CONT");
    }

    /// A crash: `pg_ctl stop -m immediate` (every process quits at once, no checkpoint; the next
    /// start replays the WAL). Waits for the postmaster to be gone.
    pub fn crash(&mut self) {
        if self.child.is_none() {
            return;
        }
        // A paused server must run to stop.
        self.signal_server("-CONT");
        let Some(mut child) = self.child.take() else {
            return;
        };
        let status = as_server_user(bin("pg_ctl"))
            .arg("-D")
            .arg(self.dir.path().join("data"))
            .args(["stop", "-m", "immediate", "-w"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if !status.is_ok_and(|s| s.success()) {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", child.id())])
                .status();
        }
        let _ = child.wait();
    }

    /// Starts the server again on the same port and data (after [`PgServer::crash`]).
    pub fn start_again(&mut self) {
        self.crash();
        self.spawn().unwrap_or_else(|e| panic!("{e}"));
    }

    /// Runs `sql` with psql (over the unix socket) and returns its unaligned output.
    pub fn try_sql(&self, sql: &str) -> Result<String, String> {
        let out = Command::new(bin("psql"))
            .args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1"])
            .arg("-h")
            .arg(self.dir.path())
            .args(["-p", &self.port.to_string(), "-U", &role(), "-d", DATABASE])
            .args(["-c", sql])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("run psql: {e}"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    /// [`PgServer::try_sql`], panicking on an error.
    pub fn sql(&self, sql: &str) -> String {
        self.try_sql(sql)
            .unwrap_or_else(|e| panic!("psql {sql:?}: {e}"))
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        if self.child.is_some() {
            // The children first, while they are still the postmaster's: a paused backend
            // would otherwise stay stopped for ever once the postmaster is gone.
            let children = self.children();
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", self.pid())])
                .status();
            for pid in children {
                let _ = Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .stderr(Stdio::null())
                    .status();
            }
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.wait();
        }
    }
}

/// The shared server lives in a `static`, which is never dropped: a watchdog process kills its
/// process group and removes its directory once this test binary has exited.
fn reap_on_exit(pgid: u32, dir: &Path) {
    let me = std::process::id();
    let dir = dir.display();
    let script = format!(
        "while kill -0 {me} 2>/dev/null; do sleep 0.2; done; kill -CONT -- -{pgid} 2>/dev/null; kill -KILL -- -{pgid} 2>/dev/null; sleep 0.5; rm -rf '{dir}'"
    );
    let _ = Command::new("sh")
        .args(["-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn();
}

/// The `store:` block of a PostgreSQL store on `url` and `schema`, with `extra` lines (each
/// `name: value`; `timeout: 300ms` unless they set it).
pub fn store_block(url: &str, schema: &str, extra: &str) -> String {
    let mut block = format!("store:\n  backend: postgres\n  url: {url}\n  schema: {schema}\n");
    if !extra.contains("timeout:") {
        block.push_str("  timeout: 300ms\n");
    }
    for line in extra.lines().filter(|l| !l.trim().is_empty()) {
        block.push_str("  ");
        block.push_str(line.trim());
        block.push('\n');
    }
    block
}

/// A configuration made by `Env::config` (memory store) with its `store:` block replaced.
pub fn on_postgres(yaml: &str, block: &str) -> String {
    let memory = "store:\n  backend: memory\n  timeout: 300ms\n";
    assert!(yaml.contains(memory), "the harness's store block moved");
    yaml.replace(memory, block)
}

/// A whole configuration around a `store:` block, for tests of the store alone.
pub fn store_only(block: &str) -> String {
    format!(
        "listen: 127.0.0.1:0\n{block}upstreams:\n  u:\n    url: http://127.0.0.1:9\nroutes:\n  - name: r\n    path: /*\n    upstream: u\n"
    )
}
