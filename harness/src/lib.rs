//! idemproxy's test and bench harness: real processes and real sockets, all on loopback.
//!
//! A dev-dependency of the integration tests (`tests/*/main.rs`) and of the benches; what it
//! starts is killed when its handle is dropped (shared servers: when the test binary exits).
//!
//! - [`Env`]: one test's world — a mock booking upstream (in this process, counting side
//!   effects) and a store of the test's own on one of the five backends ([`Backend`]), which a
//!   test can look into ([`Env::stored_keys`]) and cut off ([`Env::make_store_unreachable`]).
//! - [`RedisServer`]: a `redis-server` spawned on a free port, with no persistence; it can be
//!   paused (SIGSTOP), resumed, killed and restarted on the same port; killed on drop.
//! - [`sqlite::SqliteFile`]: an SQLite file in a temp dir, read from outside the proxy and
//!   write-locked on command.
//! - [`postgres::PgServer`]: a PostgreSQL server of the test binary's own (initdb in a temp
//!   dir), shared by its tests, each in a schema of its own, or private to a test that stops,
//!   pauses or crashes it; the load bench's too ([`postgres::PgServer::try_start`]).
//! - [`TestProxy`]: the proxy served in this process (so tests can read its metrics), with
//!   the workers its file asks for (by default one a core), stopped gracefully on
//!   [`TestProxy::stop`] or dropped.
//! - [`ProxyProcess`]: the `idemproxy` binary ([`binary`]) as a child process, for what needs
//!   a process (SIGKILL mid-request, SIGTERM, `--check`, start-up warnings).
//! - [`relay::Relay`]: a TCP relay in front of a store or the upstream that adds latency,
//!   blackholes, resets or cuts connections on command.
//! - [`cluster::RedisCluster`]: a Redis Cluster on loopback — primaries and replicas, with
//!   slot migration and coordinated failover, or a single node serving every slot;
//!   [`secured::SecuredRedis`]: a Redis that wants TLS (a test CA) and/or a password.
//! - [`otlp::OtlpReceiver`]: an OTLP/HTTP trace receiver decoding the spans the proxy exports.
//! - [`mock::start`]: the mock booking service on a free port, with its counters.
//! - [`metric_value`]: a series' value in the Prometheus text, read as a scraper reads it.
//! - [`store_checks`]: the store contract, one suite every backend's test module runs through
//!   [`store_contract!`], with a flag for each optional capability.
//!
//! Every behaviour test is written once and run against every store with [`every_store!`].

pub mod cluster;
pub mod env;
pub mod grpc;
pub mod mock;
pub mod otlp;
pub mod pki;
pub mod postgres;
pub mod prometheus;
pub mod redis_server;
pub mod relay;
pub mod secured;
pub mod sqlite;
pub mod store_checks;

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener as StdListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idemproxy::config::Config;
use idemproxy::metrics::{Metrics, Outcome};
use idemproxy::proxy::Proxy;
use idemproxy::server::workers::Workers;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub use env::{Backend, Env, StoredKey, warm_up};
pub use prometheus::metric_value;
pub use redis_server::{REDIS_EPHEMERAL, RedisServer, redis_binary};

/// A port that was free a moment ago.
pub fn free_port() -> u16 {
    let l = StdListener::bind("127.0.0.1:0").expect("bind a free port");
    l.local_addr().expect("local addr").port()
}

/// The proxy served in this process.
pub struct TestProxy {
    pub addr: SocketAddr,
    pub proxy: Arc<Proxy>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl TestProxy {
    /// Parses `yaml`, binds 127.0.0.1:0 (the file's `listen` is ignored) and serves with the
    /// file's `workers` (worker 0 on the test's runtime, the others on threads of their own),
    /// as `idemproxy --config` would.
    pub async fn start(yaml: &str) -> TestProxy {
        let config = Config::from_yaml(yaml).unwrap_or_else(|e| panic!("config: {e}\n{yaml}"));
        let metrics = Arc::new(Metrics::new());
        let listener = idemproxy::server::bind("127.0.0.1:0".parse().expect("addr")).expect("bind");
        let addr = listener.local_addr().expect("addr");
        let workers = Workers::start(listener, config, metrics)
            .await
            .expect("start the workers");
        let proxy = workers.proxy().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let _ = stopped.await;
            workers.drain().await;
        });
        // Warm the store connection (Redis connects lazily), so that a loaded machine's slow
        // first connect does not turn a test's first request into a 503. A store that is down
        // on purpose just fails these pings.
        for _ in 0..20 {
            if proxy.store().ping().await.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        TestProxy {
            addr,
            proxy,
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// `http://ADDR{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// The proxy's metrics.
    pub fn metrics(&self) -> &Metrics {
        self.proxy.metrics()
    }

    /// [`metric_value`] in this proxy's `/metrics` text.
    pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        metric_value(&self.proxy.encode_metrics(), name, labels)
    }

    /// The requests on `route` counted with `outcome`.
    pub fn requests(&self, route: &str, outcome: Outcome) -> u64 {
        let labels = [("route", route), ("outcome", outcome.as_str())];
        self.metric("idemproxy_requests_total", &labels) as u64
    }

    /// The lost leases counted, every route together.
    pub fn lost_leases(&self) -> u64 {
        self.metric("idemproxy_lost_leases_total", &[]) as u64
    }

    /// Graceful stop: waits for requests in flight and background saves.
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl Drop for TestProxy {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

/// A client that does not reuse connections across tests and never follows redirects.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client")
}

/// A response read whole: status, headers, body bytes.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: bytes::Bytes,
}

impl Reply {
    /// Every header as `name: value` lines, sorted, without `Idempotent-Replayed`: what a replay
    /// must repeat of the first response.
    pub fn header_lines(&self) -> Vec<String> {
        let mut lines: Vec<String> = self
            .headers
            .iter()
            .filter(|(name, _)| name.as_str() != "idempotent-replayed")
            .map(|(name, value)| format!("{name}: {}", String::from_utf8_lossy(value.as_bytes())))
            .collect();
        lines.sort();
        lines
    }

    /// A header's value as text ("" when absent).
    pub fn header(&self, name: &str) -> String {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned()
    }

    /// The body parsed as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {:?}", self.body))
    }

    /// Asserts this is a problem+json of `slug` with `status`, and returns the document.
    pub fn assert_problem(&self, status: u16, slug: &str) -> serde_json::Value {
        assert_eq!(self.status, status, "status; body: {:?}", self.body);
        assert_eq!(
            self.header("content-type"),
            "application/problem+json",
            "content type of a {status}"
        );
        let doc = self.json();
        assert_eq!(
            doc["type"],
            format!("urn:idemproxy:problem:{slug}"),
            "problem type; document: {doc}"
        );
        assert_eq!(doc["status"], status, "problem status member");
        assert!(
            doc["title"].as_str().is_some_and(|t| !t.is_empty()),
            "title"
        );
        assert!(
            doc["detail"].as_str().is_some_and(|t| !t.is_empty()),
            "detail"
        );
        doc
    }
}

/// Sends a request built by `req` and reads the whole reply.
pub async fn send(req: reqwest::RequestBuilder) -> Reply {
    let resp = req.send().await.expect("request failed");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.bytes().await.expect("read body");
    Reply {
        status,
        headers,
        body,
    }
}

/// `POST {proxy}/bookings` with a key and a JSON body.
pub async fn book(proxy: &TestProxy, key: &str, body: &str) -> Reply {
    book_with(&proxy.url(""), key, body, &[]).await
}

/// `POST {base}/bookings` with a key, a JSON body and extra headers (the mock's `X-Mock-*`).
pub async fn book_with(base: &str, key: &str, body: &str, extra: &[(&str, &str)]) -> Reply {
    let mut req = client()
        .post(format!("{base}/bookings"))
        .header("Idempotency-Key", key)
        .header("Content-Type", "application/json")
        .body(body.to_owned());
    for (name, value) in extra {
        req = req.header(*name, *value);
    }
    send(req).await
}

/// Starts `POST {base}/bookings` (as [`book_with`]) with the mock's `X-Mock-Delay: delay`, in
/// a task of its own: a first request that holds its claim while the test goes on.
pub fn spawn_booking(
    base: String,
    key: &str,
    body: &str,
    delay: &str,
) -> tokio::task::JoinHandle<Reply> {
    let (key, body, delay) = (key.to_owned(), body.to_owned(), delay.to_owned());
    tokio::spawn(async move { book_with(&base, &key, &body, &[("X-Mock-Delay", &delay)]).await })
}

/// The store key SPEC §4.1 gives `key` on the route named `route`, as text: `key_prefix` + the
/// route's name + `:` + the hex SHA-256 of the scope values and the key (`key::key_id`).
pub fn store_key(
    prefix: &str,
    route: &str,
    scope: &[http::HeaderName],
    headers: &http::HeaderMap,
    key: &str,
) -> String {
    let id = idemproxy::key::key_id(scope, headers, key);
    format!("{prefix}{route}:{}", hex::encode(id))
}

/// The store key of `key` on the harness's route `create-booking` (default prefix, default
/// `Authorization` scope) for a caller without `Authorization`.
pub fn booking_store_key(key: &str) -> String {
    store_key(
        "idemproxy:",
        "create-booking",
        &[http::HeaderName::from_static("authorization")],
        &http::HeaderMap::new(),
        key,
    )
}

/// The `idemproxy` binary cargo built beside the running test or bench.
pub fn binary() -> PathBuf {
    cargo_binary("idemproxy")
}

/// The `mock-upstream` binary cargo built beside the running test or bench.
pub fn mock_binary() -> PathBuf {
    cargo_binary("mock-upstream")
}

/// A binary of the idemproxy package, for its integration tests and benches: cargo names it in
/// `CARGO_BIN_EXE_<name>` when it runs them; a test binary run by hand (from `target/PROFILE/deps/`)
/// finds it one directory up, where cargo puts a profile's binaries.
pub fn cargo_binary(name: &str) -> PathBuf {
    if let Some(path) = std::env::var_os(format!("CARGO_BIN_EXE_{name}")) {
        return PathBuf::from(path);
    }
    let exe = std::env::current_exe().expect("the running test's own path");
    let beside = exe
        .parent()
        .and_then(|deps| deps.parent())
        .map(|dir| dir.join(name))
        .unwrap_or_else(|| PathBuf::from(name));
    assert!(
        beside.is_file(),
        "no {name} binary at {} (run the tests and benches through cargo, which builds it)",
        beside.display()
    );
    beside
}

/// The `idemproxy` binary as a child process.
pub struct ProxyProcess {
    pub addr: SocketAddr,
    child: Option<Child>,
    pub stderr: Arc<Mutex<String>>,
    /// The thread reading its stderr: joined once the process has exited, so the lines it
    /// wrote last are in [`ProxyProcess::log`] when [`ProxyProcess::wait`] returns.
    reader: Option<std::thread::JoinHandle<()>>,
    _config: tempfile::NamedTempFile,
}

impl ProxyProcess {
    /// Writes `yaml` (its `listen:` line replaced by a free port) to a file and runs
    /// `idemproxy --config FILE`; returns once the proxy accepts connections.
    pub fn spawn(yaml: &str) -> ProxyProcess {
        ProxyProcess::spawn_on(yaml, free_port())
    }

    /// [`ProxyProcess::spawn`] on a given port: a proxy killed with SIGKILL can be started again
    /// where its clients expect it.
    pub fn spawn_on(yaml: &str, port: u16) -> ProxyProcess {
        let yaml = yaml.replace("listen: 127.0.0.1:0", &format!("listen: 127.0.0.1:{port}"));
        let file = write_config(&yaml);
        let mut child = Command::new(binary())
            .arg("--config")
            .arg(file.path())
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn idemproxy");
        let stderr = Arc::new(Mutex::new(String::new()));
        let reader = child.stderr.take().map(|err| {
            let sink = stderr.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(err).lines().map_while(Result::ok) {
                    if let Ok(mut s) = sink.lock() {
                        s.push_str(&line);
                        s.push('\n');
                    }
                }
            })
        });
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_err() {
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "idemproxy exited early ({status}): {}",
                    stderr.lock().map(|s| s.clone()).unwrap_or_default()
                );
            }
            assert!(
                Instant::now() < deadline,
                "idemproxy did not start listening"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        ProxyProcess {
            addr,
            child: Some(child),
            stderr,
            reader,
            _config: file,
        }
    }

    /// `http://ADDR{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// The configuration file it runs with.
    pub fn config_path(&self) -> &std::path::Path {
        self._config.path()
    }

    /// Writes `yaml` over its configuration file (`listen: 127.0.0.1:0` replaced by the port it
    /// listens on, as at spawn), for a reload to read.
    pub fn rewrite_config(&self, yaml: &str) {
        let yaml = yaml.replace(
            "listen: 127.0.0.1:0",
            &format!("listen: 127.0.0.1:{}", self.addr.port()),
        );
        std::fs::write(self._config.path(), yaml).expect("rewrite the configuration");
    }

    /// Everything the process logged so far.
    pub fn log(&self) -> String {
        self.stderr.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).expect("running")
    }

    /// Sends a signal (`-TERM`, `-KILL`, …).
    pub fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .args([sig, &self.pid().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {sig}");
    }

    /// Waits for the process to exit (at most `within`), returning its exit code.
    pub fn wait(&mut self, within: Duration) -> Option<i32> {
        let deadline = Instant::now() + within;
        let child = self.child.as_mut().expect("running");
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                // Its stderr is closed: the reader ends with the last line read.
                if let Some(reader) = self.reader.take() {
                    let _ = reader.join();
                }
                return status.code();
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for ProxyProcess {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Writes a configuration to a temporary file.
pub fn write_config(yaml: &str) -> tempfile::NamedTempFile {
    use std::io::Write;
    let mut f = tempfile::Builder::new()
        .suffix(".yaml")
        .tempfile()
        .expect("temp file");
    f.write_all(yaml.as_bytes()).expect("write config");
    f
}

/// Polls `cond` every 10ms until it holds or `within` passes; returns whether it held.
pub async fn eventually(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
