//! The listener every server of the crate shares (the proxy's, the admin's, the mock's): idle
//! deadlines on both protocols, the admin listener's bounds, accept errors, clients that stop
//! reading, the head limits on both protocols, and `drain_delay`.
//!
//! Everything runs on loopback against real sockets; every wait is bounded.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use harness::{Backend, Env, ProxyProcess, Reply, TestProxy, book, book_with, client, send};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use tokio::time::{Instant, timeout};

/// `yaml` with a top-level `limits:` section of these `name: value` lines.
fn with_limits(yaml: &str, lines: &[&str]) -> String {
    let mut out = format!("{yaml}limits:\n");
    for line in lines {
        out.push_str("  ");
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// An HTTP/2 connection with prior knowledge (h2c), driven by hyper's client; the task ends
/// when the proxy closes the connection.
struct H2 {
    send: hyper::client::conn::http2::SendRequest<Full<Bytes>>,
    conn: JoinHandle<Result<(), hyper::Error>>,
}

impl H2 {
    async fn open(addr: SocketAddr) -> H2 {
        let stream = timeout(Duration::from_secs(5), TcpStream::connect(addr))
            .await
            .expect("connect in time")
            .expect("connect");
        let (send, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
                .await
                .expect("h2 handshake");
        H2 {
            send,
            conn: tokio::spawn(conn),
        }
    }

    /// Sends a request and returns the response with its body still unread.
    async fn request(
        &mut self,
        req: http::Request<Full<Bytes>>,
    ) -> http::Response<hyper::body::Incoming> {
        timeout(Duration::from_secs(10), self.send.send_request(req))
            .await
            .expect("an h2 answer in time")
            .expect("an h2 answer")
    }

    /// Sends a request and reads the whole response.
    async fn exchange(&mut self, req: http::Request<Full<Bytes>>) -> (u16, Bytes) {
        let resp = self.request(req).await;
        let status = resp.status().as_u16();
        let body = timeout(Duration::from_secs(10), resp.into_body().collect())
            .await
            .expect("the h2 body in time")
            .expect("the h2 body")
            .to_bytes();
        (status, body)
    }

    /// Whether the proxy closes the connection within `within`.
    async fn closed_within(&mut self, within: Duration) -> bool {
        timeout(within, &mut self.conn).await.is_ok()
    }
}

fn get(url: String) -> http::Request<Full<Bytes>> {
    http::Request::get(url)
        .body(Full::new(Bytes::new()))
        .expect("request")
}

// ---------------------------------------------------------------------------------------------
// Idle connections, on HTTP/1.1 and HTTP/2
// ---------------------------------------------------------------------------------------------

/// SPEC 4.3: a connection of either protocol with no request in progress is closed once it has
/// been idle for `limits.header_read_timeout` since its last response. Three h2c connections
/// that each made one request and went quiet held all three `max_connections` slots for ever,
/// so an HTTP/1.1 client waited for ever; now they are closed after 2s and it is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_h2_connections_are_closed_and_free_their_slots() {
    let env = Env::new(Backend::Memory).await;
    let yaml = with_limits(
        &env.config(""),
        &["max_connections: 3", "header_read_timeout: 2s"],
    );
    let proxy = env.proxy(&yaml).await;
    let mut idle = Vec::new();
    for i in 0..3 {
        let mut h2 = H2::open(proxy.addr).await;
        let (status, _) = h2.exchange(get(proxy.url(&format!("/echo/h2-{i}")))).await;
        assert_eq!(status, 200, "h2 request {i}");
        idle.push(h2);
    }
    let started = Instant::now();
    let served = timeout(
        Duration::from_secs(12),
        send(client().get(proxy.url("/echo/h1"))),
    )
    .await;
    let took = started.elapsed();
    let reply = served.expect(
        "an HTTP/1.1 request is served once the idle h2 connections are closed (it waited for ever)",
    );
    assert_eq!(reply.status, 200);
    assert!(
        took >= Duration::from_millis(1000),
        "served only after the idle connections timed out, not beside them: {took:?}"
    );
    for (i, h2) in idle.iter_mut().enumerate() {
        assert!(
            h2.closed_within(Duration::from_secs(5)).await,
            "the proxy closed idle h2 connection {i}"
        );
    }
}

/// SPEC 4.3 (`max_connections`): every connection up to the bound is served, whichever
/// worker's socket the kernel queues it on. The workers share the bound but not their
/// sockets; when an accept loop waiting for a connection held a slot, a connection queued on
/// the other worker's socket waited for an unrelated one to close, with the proxy under its
/// bound (about every second round here hung). Three rounds of `max_connections`
/// connections, all held open at once, each served within seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_connection_up_to_max_connections_is_served_on_either_worker() {
    let env = Env::new(Backend::Memory).await;
    let bound = 8;
    let yaml = with_limits(&env.config(""), &[&format!("max_connections: {bound}")]);
    assert!(
        yaml.contains("workers: 2\n"),
        "the harness runs two workers"
    );
    let proxy = env.proxy(&yaml).await;
    for round in 0..3 {
        let mut open = Vec::new();
        for i in 0..bound {
            let mut h2 = H2::open(proxy.addr).await;
            let path = format!("/echo/bound-{round}-{i}");
            let served = timeout(Duration::from_secs(3), h2.exchange(get(proxy.url(&path)))).await;
            let (status, _) = served.unwrap_or_else(|_| {
                panic!(
                    "round {round}: connection {} of {bound} was not served",
                    i + 1
                )
            });
            assert_eq!(status, 200, "round {round}, connection {i}");
            open.push(h2);
        }
        // Closed by the client: the proxy frees their slots before the next round.
        drop(open);
        let freed = harness::eventually(Duration::from_secs(5), || {
            proxy.metric("idemproxy_open_connections", &[]) == 0.0
        })
        .await;
        assert!(
            freed,
            "round {round}: the closed connections freed their slots"
        );
    }
}

/// The idle deadline counts from the last response, not from the accept, and never cuts a
/// request in progress: an h2 connection that sends a request every 500ms for 3s, and one
/// whose request takes 3s upstream, stay open past `header_read_timeout: 1500ms`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_h2_connections_outlive_header_read_timeout() {
    let env = Env::new(Backend::Memory).await;
    let yaml = with_limits(&env.config(""), &["header_read_timeout: 1500ms"]);
    let proxy = env.proxy(&yaml).await;

    let mut slow = H2::open(proxy.addr).await;
    let slow_req = http::Request::get(proxy.url("/echo/slow"))
        .header("X-Mock-Delay", "3s")
        .body(Full::new(Bytes::new()))
        .expect("request");
    let (status, _) = slow.exchange(slow_req).await;
    assert_eq!(
        status, 200,
        "a 3s request on a 1.5s idle deadline is served"
    );

    let mut busy = H2::open(proxy.addr).await;
    for i in 0..6 {
        let (status, _) = busy
            .exchange(get(proxy.url(&format!("/echo/busy-{i}"))))
            .await;
        assert_eq!(status, 200, "request {i} on the busy connection");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(
        !busy.closed_within(Duration::from_millis(10)).await,
        "the busy connection is still open"
    );
    assert!(
        busy.closed_within(Duration::from_secs(6)).await,
        "and closed once idle"
    );
}

// ---------------------------------------------------------------------------------------------
// The admin listener
// ---------------------------------------------------------------------------------------------

/// Serves the admin endpoints of `proxy` on a port of their own.
async fn admin_of(proxy: &TestProxy) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(idemproxy::server::serve_admin(
        listener,
        proxy.proxy.clone(),
        std::future::pending(),
    ));
    addr
}

/// Opens a connection and sends half a request head.
async fn half_head(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: admin\r\n")
        .await
        .expect("write half a head");
    s
}

/// Whether the peer closes `s` within `within` (EOF or reset; any answer bytes are read).
async fn closes_within(s: &mut TcpStream, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

/// SPEC 5: the admin listener gets the main one's header timeout and a bound of its own.
/// Half-sent admin heads stayed open for ever and admin connections were unbounded; now past
/// `max_admin_connections` new ones wait, and a half-sent head is closed after
/// `header_read_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_connections_are_bounded_and_half_sent_heads_time_out() {
    let env = Env::new(Backend::Memory).await;
    let yaml = with_limits(
        &env.config(""),
        &["header_read_timeout: 3s", "max_admin_connections: 3"],
    );
    let proxy = env.proxy(&yaml).await;
    let admin = admin_of(&proxy).await;
    let healthz = format!("http://{admin}/healthz");
    let ok = send(client().get(&healthz)).await;
    assert_eq!(ok.status, 200, "the admin listener serves");

    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(half_head(admin).await);
    }
    let probe = timeout(Duration::from_secs(1), client().get(&healthz).send()).await;
    assert!(
        probe.is_err(),
        "a fourth admin connection waits while three are held (it was served at once)"
    );
    for (i, s) in held.iter_mut().enumerate() {
        assert!(
            closes_within(s, Duration::from_secs(6)).await,
            "half-sent admin head {i} is closed after header_read_timeout (it stayed open)"
        );
    }
    let after = timeout(Duration::from_secs(5), send(client().get(&healthz)))
        .await
        .expect("served once the held connections are gone");
    assert_eq!(after.status, 200);
}

// ---------------------------------------------------------------------------------------------
// Accept errors
// ---------------------------------------------------------------------------------------------

/// The `idemproxy` binary under `ulimit -n LIMIT`, logging to a buffer.
struct LimitedProcess {
    child: std::process::Child,
    addr: SocketAddr,
    log: std::sync::Arc<std::sync::Mutex<String>>,
    _config: tempfile::NamedTempFile,
}

impl LimitedProcess {
    fn spawn(yaml: &str, fd_limit: u32) -> LimitedProcess {
        use std::io::BufRead;
        let port = harness::free_port();
        let yaml = yaml.replace("listen: 127.0.0.1:0", &format!("listen: 127.0.0.1:{port}"));
        let file = harness::write_config(&yaml);
        let mut child = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!(
                "ulimit -n {fd_limit} && exec \"$0\" --config \"$1\""
            ))
            .arg(harness::binary())
            .arg(file.path())
            .env("RUST_LOG", "info")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn idemproxy under ulimit");
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        if let Some(err) = child.stderr.take() {
            let sink = log.clone();
            std::thread::spawn(move || {
                for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
                    if let Ok(mut s) = sink.lock() {
                        s.push_str(&line);
                        s.push('\n');
                    }
                }
            });
        }
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "idemproxy did not start listening"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        LimitedProcess {
            child,
            addr,
            log,
            _config: file,
        }
    }

    fn log(&self) -> String {
        self.log.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

impl Drop for LimitedProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Out of file descriptors, accept fails until a connection closes. It was retried every 50ms
/// with one warning each (some 1,800 lines a minute); now it backs off exponentially and logs
/// once per burst, and accepting resumes once descriptors are free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accept_errors_back_off_and_are_logged_once_per_burst() {
    let env = Env::new(Backend::Memory).await;
    let yaml = with_limits(&env.config(""), &["header_read_timeout: 30s"]);
    let proxy = LimitedProcess::spawn(&yaml, 64);
    let mut silent = Vec::new();
    for _ in 0..80 {
        if let Ok(Ok(s)) = timeout(Duration::from_secs(2), TcpStream::connect(proxy.addr)).await {
            silent.push(s);
        }
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let log = proxy.log();
    let failures = log.matches("Too many open files").count();
    assert!(
        failures >= 1,
        "the fd limit was reached (else the test proves nothing); log:\n{log}"
    );
    assert!(
        failures <= 2,
        "one warning per burst, not one per failed accept: {failures} lines; log:\n{log}"
    );
    drop(silent);
    let served = timeout(
        Duration::from_secs(10),
        send(client().get(format!("http://{}/echo/after", proxy.addr))),
    )
    .await
    .expect("accepting again once descriptors are free");
    assert_eq!(served.status, 200);
}

// ---------------------------------------------------------------------------------------------
// Clients that stop reading
// ---------------------------------------------------------------------------------------------

const BIG: usize = 16 * 1024 * 1024;

/// A proxy with `send_timeout: 1s` and a 16 MiB response saved under key `big`.
async fn big_replay(env: &Env) -> (TestProxy, Reply) {
    let yaml = with_limits(
        &env.config("max_response_body: 32MiB"),
        &["send_timeout: 1s"],
    );
    let proxy = env.proxy(&yaml).await;
    let size = BIG.to_string();
    let first = book_with(&proxy.url(""), "big", "{}", &[("X-Mock-Body-Size", &size)]).await;
    assert_eq!(first.status, 201);
    assert_eq!(first.body.len(), BIG);
    (proxy, first)
}

/// The repeat of `big`, as raw bytes.
const BIG_REPEAT: &[u8] = b"POST /bookings HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: big\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}";

/// A raw connection with a small receive buffer, so that the kernel holds little of a reply
/// the client does not read.
async fn small_window(addr: SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(16 * 1024).expect("SO_RCVBUF");
    timeout(Duration::from_secs(5), socket.connect(addr))
        .await
        .expect("connect in time")
        .expect("connect")
}

/// Reads until end of stream, an error, `limit` bytes or `deadline`; returns the byte count and
/// whether the stream ended (EOF or reset).
async fn drain(s: &mut TcpStream, limit: usize, deadline: Instant) -> (usize, bool) {
    let mut buf = vec![0u8; 256 * 1024];
    let mut total = 0;
    while total < limit {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Err(_) => return (total, false),
            Ok(Ok(0)) | Ok(Err(_)) => return (total, true),
            Ok(Ok(n)) => total += n,
        }
    }
    (total, false)
}

/// SPEC 4.3: a response that makes no write progress for `limits.send_timeout` is abandoned
/// and its connection closed. Clients that sent the repeat of a 16 MiB replay and never read
/// held it (and their connections) for ever; now each is closed after 1s without progress —
/// reading what is left gives end of stream before the whole body — and the saved result still
/// replays, whole, to a client that reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_a_replay_is_abandoned_and_the_replay_survives() {
    let env = Env::new(Backend::Memory).await;
    let (proxy, first) = big_replay(&env).await;
    let mut stalled = Vec::new();
    for _ in 0..4 {
        let mut s = small_window(proxy.addr).await;
        s.write_all(BIG_REPEAT).await.expect("send the repeat");
        stalled.push(s);
    }
    tokio::time::sleep(Duration::from_secs(4)).await;
    for (i, s) in stalled.iter_mut().enumerate() {
        let (got, ended) = drain(s, BIG + 4096, Instant::now() + Duration::from_secs(20)).await;
        assert!(
            ended && got < BIG,
            "client {i}: the proxy abandoned the stalled replay (read {got} bytes, ended: {ended}; it used to send the whole body)"
        );
    }
    let replay = book(&proxy, "big", "{}").await;
    assert_eq!(replay.status, 201);
    assert_eq!(replay.header("idempotent-replayed"), "true");
    assert!(
        replay.body == first.body,
        "the replay is the first body, whole"
    );
    assert_eq!(env.mock.calls("big"), 1, "the upstream ran once");
}

/// A client that reads slowly, pausing under `send_timeout` between bursts, gets the whole
/// replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_reader_gets_the_whole_replay() {
    let env = Env::new(Backend::Memory).await;
    let (proxy, _) = big_replay(&env).await;
    let mut s = small_window(proxy.addr).await;
    s.write_all(BIG_REPEAT).await.expect("send the repeat");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut total = 0;
    let mut buf = vec![0u8; 64 * 1024];
    let mut burst = 0;
    let mut ended = false;
    while total < BIG && Instant::now() < deadline {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => {
                ended = true;
                break;
            }
            Ok(Ok(n)) => {
                total += n;
                burst += n;
            }
        }
        if burst >= 1024 * 1024 {
            burst = 0;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
    assert!(
        !ended && total >= BIG,
        "the slow reader got the whole replay ({total} bytes)"
    );
}

/// The same over HTTP/2: a client that takes the response head and never reads the body stops
/// granting flow-control window, so the proxy cannot write; the connection is closed after
/// `send_timeout` instead of holding the replay for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2_client_that_stops_reading_is_abandoned() {
    let env = Env::new(Backend::Memory).await;
    let (proxy, _) = big_replay(&env).await;
    let mut h2 = H2::open(proxy.addr).await;
    let req = http::Request::post(proxy.url("/bookings"))
        .header("Idempotency-Key", "big")
        .header("Content-Type", "application/json")
        .body(Full::new(Bytes::from_static(b"{}")))
        .expect("request");
    let resp = h2.request(req).await;
    assert_eq!(resp.status().as_u16(), 201);
    assert!(
        h2.closed_within(Duration::from_secs(8)).await,
        "the proxy closed the h2 connection that stopped reading (it stayed open)"
    );
    drop(resp);
    let replay = book(&proxy, "big", "{}").await;
    assert_eq!(replay.body.len(), BIG, "the saved result still replays");
}

// ---------------------------------------------------------------------------------------------
// The header count on HTTP/2
// ---------------------------------------------------------------------------------------------

/// SPEC 4.3: both protocols refuse the same header count before anything is claimed. An h2c
/// POST with 120 extra headers reached the upstream, whose 431 was saved and replayed to the
/// HTTP/1.1 retry although nothing ran; now the proxy answers the h2 request itself with a
/// 431 problem, the upstream is not called, and the retry runs the operation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_headers_over_h2_are_refused_before_a_claim() {
    let env = Env::new(Backend::Memory).await;
    let proxy = env.proxy(&env.config("")).await;
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .expect("h2c client");
    let mut req = h2
        .post(proxy.url("/bookings"))
        .header("Idempotency-Key", "h2-many")
        .header("Content-Type", "application/json")
        .body("{}");
    for i in 0..120 {
        req = req.header(format!("x-filler-{i}"), "1");
    }
    let refused = send(req).await;
    refused.assert_problem(431, "headers-too-large");
    assert_eq!(env.mock.calls("h2-many"), 0, "the upstream was not called");
    let retry = book(&proxy, "h2-many", "{}").await;
    assert_eq!(retry.status, 201, "the retry runs: {:?}", retry.body);
    assert_eq!(retry.header("idempotent-replayed"), "");
    assert_eq!(env.mock.calls("h2-many"), 1);
}

/// The claims the proxy attempted, every route together.
fn claims(proxy: &TestProxy) -> u64 {
    // The harness's reader fails on a missing series: a claim count that is not exported is
    // an error, never a 0.
    proxy.metric(
        "idemproxy_store_operation_duration_seconds_count",
        &[("op", "claim")],
    ) as u64
}

/// SPEC 4.3: a head over the proxy's limits — more than 97 headers, or more than 64 KiB — gets
/// the same answer on HTTP/1.1 and HTTP/2, a `431 headers-too-large` problem naming the limit,
/// and claims nothing; the key runs afterwards. (HTTP/1.1 got hyper's bare 431 for both, and
/// HTTP/2 h2's bare 431 for a head over 64 KiB.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heads_over_the_limits_get_the_same_problem_on_http1_and_h2() {
    let env = Env::new(Backend::Memory).await;
    let proxy = env.proxy(&env.config("")).await;
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .expect("h2c client");
    let big = "v".repeat(70 * 1024);
    let mut answers = Vec::new();
    for (protocol, client) in [("HTTP/1.1", client()), ("HTTP/2", h2)] {
        let mut many = client
            .post(proxy.url("/bookings"))
            .header("Idempotency-Key", "over-count")
            .header("Content-Type", "application/json")
            .body("{}");
        for i in 0..120 {
            many = many.header(format!("x-filler-{i}"), "1");
        }
        let large = client
            .post(proxy.url("/bookings"))
            .header("Idempotency-Key", "over-size")
            .header("Content-Type", "application/json")
            .header("x-big", &big)
            .body("{}");
        for (what, req, words) in [
            ("too many headers", many, "more than 97 header fields"),
            ("a 70 KiB head", large, "larger than 65536 bytes"),
        ] {
            let reply = send(req).await;
            let doc = reply.assert_problem(431, "headers-too-large");
            let detail = doc["detail"].as_str().unwrap_or_default().to_owned();
            assert!(detail.contains(words), "{protocol}, {what}: {detail}");
            answers.push((what, protocol, reply.body));
        }
    }
    for (what, protocol, body) in &answers[2..] {
        let (_, _, h1) = answers
            .iter()
            .find(|(w, p, _)| w == what && *p == "HTTP/1.1")
            .expect("the HTTP/1.1 answer");
        assert_eq!(body, h1, "{what}: {protocol} gets HTTP/1.1's problem");
    }
    assert_eq!(env.mock.total(), 0, "nothing reached the upstream");
    assert_eq!(claims(&proxy), 0, "nothing was claimed");
    for key in ["over-count", "over-size"] {
        let retry = book(&proxy, key, "{}").await;
        assert_eq!(retry.status, 201, "{key}: the retry runs: {:?}", retry.body);
        assert_eq!(env.mock.calls(key), 1);
    }
}

/// Near the limit, over HTTP/2, each request is either refused by the proxy (a 431 problem,
/// the upstream not called) or reaches the upstream with no more headers than it takes (it
/// runs): the proxy never forwards a head its upstream refuses, and the largest head it
/// forwards fills the upstream's 100 headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_heads_near_the_limit_are_refused_or_run_never_saved_as_a_431() {
    let env = Env::new(Backend::Memory).await;
    let proxy = env.proxy(&env.config("")).await;
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .expect("h2c client");
    let mut largest_forwarded = 0;
    let mut refused = 0;
    for extra in 88..=100 {
        let key = format!("near-{extra}");
        let mut req = h2
            .post(proxy.url("/bookings"))
            .header("Idempotency-Key", &key)
            .body("{}");
        for i in 0..extra {
            req = req.header(format!("x-filler-{i}"), "1");
        }
        let reply = send(req).await;
        if reply.status == 431 {
            reply.assert_problem(431, "headers-too-large");
            assert_eq!(
                env.mock.calls(&key),
                0,
                "{extra} extra headers: not forwarded"
            );
            refused += 1;
        } else {
            assert_eq!(reply.status, 201, "{extra} extra headers: {:?}", reply.body);
            assert_eq!(env.mock.calls(&key), 1);
            let seen = env.mock.last_request().expect("a request upstream");
            largest_forwarded = largest_forwarded.max(seen.headers.len());
        }
    }
    assert!(refused > 0, "the largest heads were refused");
    assert_eq!(
        largest_forwarded, 100,
        "the largest forwarded head fills the upstream's 100 headers"
    );
}

// ---------------------------------------------------------------------------------------------
// drain_delay
// ---------------------------------------------------------------------------------------------

/// After SIGTERM with `drain_delay: 3s`, `/readyz` answers 503 at once while the proxy keeps
/// accepting and serving new connections for the delay (it used to close the listener at the
/// signal); then it drains and exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_delay_keeps_serving_while_readiness_says_503() {
    let env = Env::new(Backend::Memory).await;
    let admin_port = harness::free_port();
    let yaml = env.config("").replace(
        "shutdown_timeout: 10s\n",
        &format!("shutdown_timeout: 10s\ndrain_delay: 3s\nadmin_listen: 127.0.0.1:{admin_port}\n"),
    );
    let mut proxy = ProxyProcess::spawn(&yaml);
    let readyz = format!("http://127.0.0.1:{admin_port}/readyz");
    let mut ready = false;
    for _ in 0..100 {
        if let Ok(r) = client().get(&readyz).send().await
            && r.status() == 200
        {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ready, "ready before the signal");
    let signalled = Instant::now();
    proxy.signal("-TERM");
    // From the signal on, as soon as the proxy has run to take it: on a loaded machine the
    // first answer after `kill` returns may still be the one from before.
    let mut status = 0;
    for _ in 0..20 {
        status = send(client().get(&readyz)).await.status;
        if status == 503 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(status, 503, "readyz says 503 once the signal is taken");
    let during = book_with(&proxy.url(""), "during-delay", "{}", &[]).await;
    assert_eq!(
        during.status, 201,
        "a new connection during drain_delay is served"
    );
    assert!(
        signalled.elapsed() < Duration::from_secs(3),
        "the checks ran inside the delay; the machine is too slow for this test"
    );
    assert_eq!(
        proxy.wait(Duration::from_secs(15)),
        Some(0),
        "exits 0 after the delay; log: {}",
        proxy.log()
    );
    assert!(
        signalled.elapsed() >= Duration::from_millis(2500),
        "not before the delay: {:?}",
        signalled.elapsed()
    );
    assert_eq!(env.mock.calls("during-delay"), 1);
}

/// Without `drain_delay`, SIGTERM closes the listener at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_drain_delay_the_listener_closes_at_the_signal() {
    let env = Env::new(Backend::Memory).await;
    let mut proxy = ProxyProcess::spawn(&env.config(""));
    let ok = book_with(&proxy.url(""), "before", "{}", &[]).await;
    assert_eq!(ok.status, 201);
    proxy.signal("-TERM");
    assert_eq!(proxy.wait(Duration::from_secs(10)), Some(0));
    assert!(TcpStream::connect(proxy.addr).await.is_err(), "closed");
}

/// The request body every booking here sends.
const BODY: &str = r#"{"seat":"12A"}"#;

// ---------------------------------------------------------------------------------------------
// Bounded resources against hostile clients
// ---------------------------------------------------------------------------------------------

/// Reads until the peer closes; returns what arrived, or `None` if it stayed open `within`.
async fn read_until_closed(stream: &mut TcpStream, within: Duration) -> Option<Vec<u8>> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(got),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// Hundreds of connections that stay silent, stop mid-head or trickle a body: the proxy keeps
/// answering other clients at once, closes every one of them within the limits (a 408 problem
/// for a body that stops coming), claims nothing for them, and its memory stays bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_silent_clients_are_closed_and_others_still_served() {
    let env = Env::new(Backend::Memory).await;
    let yaml = env.config("").replace(
        "shutdown_timeout: 10s\n",
        "shutdown_timeout: 10s\nlimits:\n  header_read_timeout: 1s\n  body_read_timeout: 2s\n",
    );
    let proxy = harness::ProxyProcess::spawn(&yaml);
    let rss = |pid: u32| -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap_or(0)
            * 1024
    };
    let before = rss(proxy.pid());
    let addr = proxy.addr;
    let mut hostile = Vec::new();
    for i in 0..300 {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        match i % 3 {
            0 => {} // silent
            1 => s
                .write_all(b"POST /bookings HTTP/1.1\r\nHost: x\r\nIdempotency-Key: slow-head\r\n")
                .await
                .expect("write head"),
            _ => {
                let head = format!(
                    "POST /bookings HTTP/1.1\r\nHost: x\r\nIdempotency-Key: slow-body-{i}\r\nContent-Length: 1000000\r\n\r\n"
                );
                s.write_all(head.as_bytes()).await.expect("write head");
                s.write_all(&vec![b'x'; 60_000])
                    .await
                    .expect("write part of the body");
            }
        }
        hostile.push((i, s));
    }
    // Other clients are served meanwhile, promptly.
    for n in 0..5 {
        let started = Instant::now();
        let r = send(
            client()
                .post(proxy.url("/bookings"))
                .header("Idempotency-Key", format!("ok-{n}"))
                .body(BODY),
        )
        .await;
        assert_eq!(r.status, 201);
        assert!(started.elapsed() < Duration::from_secs(1), "served at once");
    }
    let during = rss(proxy.pid());
    let closed = Arc::new(AtomicUsize::new(0));
    let mut waits = Vec::new();
    for (i, mut s) in hostile {
        let closed = closed.clone();
        waits.push(tokio::spawn(async move {
            let got = read_until_closed(&mut s, Duration::from_secs(6)).await;
            let got = got.unwrap_or_else(|| panic!("connection {i} was left open"));
            if i % 3 == 2 {
                let text = String::from_utf8_lossy(&got);
                assert!(
                    text.starts_with("HTTP/1.1 408")
                        && text.contains("application/problem+json")
                        && text.contains("urn:idemproxy:problem:request-body-timeout"),
                    "a body that stops coming gets a 408 problem: {text}"
                );
            }
            closed.fetch_add(1, Ordering::Relaxed);
        }));
    }
    for w in waits {
        w.await.expect("hostile connection");
    }
    assert_eq!(closed.load(Ordering::Relaxed), 300);
    assert_eq!(
        env.mock.stats().total,
        5,
        "nothing of theirs reached the upstream"
    );
    assert!(
        during.saturating_sub(before) < 96 * 1024 * 1024,
        "memory stays bounded: {before} -> {during} bytes"
    );
}
