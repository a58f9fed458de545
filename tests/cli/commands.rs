//! SPEC §2: the command line, through the real `idemproxy` binary.
//!
//! `--check` (exit codes, every error on stderr with its field path, line and column for syntax
//! errors), `IDEMPROXY_CONFIG`, `--version`, `--help`, `demo` (it really serves), the start-up
//! log line, JSON logs, a clean exit 0 on SIGTERM and SIGINT, and a log whose destination is
//! gone (stderr a pipe nobody reads) costing nothing but its lines.

use std::io::{BufRead, BufReader, Read};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use harness::{ProxyProcess, client, free_port, send, write_config};

/// The exit code `--check` documents for an invalid file.
const INVALID: i32 = 2;

/// A valid file whose upstream need not be running (nothing is forwarded by these tests).
fn valid_yaml(listen: &str) -> String {
    format!(
        "listen: {listen}
upstreams:
  booking:
    url: http://127.0.0.1:{up}
routes:
  - name: create-booking
    methods: [POST]
    path: /bookings
    upstream: booking
    idempotency:
      lock_ttl: 2s
  - name: rest
    path: /*
    upstream: booking
",
        up = free_port()
    )
}

/// `idemproxy` with a clean environment: no `IDEMPROXY_CONFIG` from the outside, info logs.
fn idemproxy() -> Command {
    let mut c = Command::new(harness::binary());
    c.env_remove("IDEMPROXY_CONFIG")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// What a finished command did.
struct Output {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Runs a command that must finish by itself, within 30s (killed otherwise).
fn run(mut cmd: Command) -> Output {
    let mut child = cmd.spawn().expect("spawn idemproxy");
    let out = drain(child.stdout.take());
    let err = drain(child.stderr.take());
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("idemproxy did not exit within 30s");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let text = |h: std::thread::JoinHandle<String>| h.join().expect("reader thread");
    Output {
        code: status.code(),
        stdout: text(out),
        stderr: text(err),
    }
}

/// Reads a pipe to its end on a thread.
fn drain(pipe: Option<impl Read + Send + 'static>) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(mut p) = pipe {
            let _ = p.read_to_string(&mut s);
        }
        s
    })
}

/// A long-running `idemproxy` whose stdout and stderr are collected as they come.
struct Running {
    child: Option<Child>,
    stdout: Arc<Mutex<String>>,
    stderr: Arc<Mutex<String>>,
}

impl Running {
    fn spawn(mut cmd: Command) -> Running {
        let mut child = cmd.spawn().expect("spawn idemproxy");
        let collect = |pipe: Option<Box<dyn Read + Send>>| {
            let sink = Arc::new(Mutex::new(String::new()));
            if let Some(p) = pipe {
                let s = sink.clone();
                std::thread::spawn(move || {
                    for line in BufReader::new(p).lines().map_while(Result::ok) {
                        if let Ok(mut s) = s.lock() {
                            s.push_str(&line);
                            s.push('\n');
                        }
                    }
                });
            }
            sink
        };
        let stdout = collect(
            child
                .stdout
                .take()
                .map(|p| Box::new(p) as Box<dyn Read + Send>),
        );
        let stderr = collect(
            child
                .stderr
                .take()
                .map(|p| Box::new(p) as Box<dyn Read + Send>),
        );
        Running {
            child: Some(child),
            stdout,
            stderr,
        }
    }

    fn stdout(&self) -> String {
        self.stdout.lock().map(|s| s.clone()).unwrap_or_default()
    }

    fn stderr(&self) -> String {
        self.stderr.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Waits (at most 15s) until `cond(stdout, stderr)` holds; panics if the process exits or
    /// time runs out first.
    fn wait_for(&mut self, what: &str, cond: impl Fn(&str, &str) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if cond(&self.stdout(), &self.stderr()) {
                return;
            }
            let child = self.child.as_mut().expect("running");
            if let Ok(Some(status)) = child.try_wait() {
                // Let the reader threads catch up before reporting.
                std::thread::sleep(Duration::from_millis(100));
                panic!(
                    "idemproxy exited ({status}) before {what}\nstdout:\n{}\nstderr:\n{}",
                    self.stdout(),
                    self.stderr()
                );
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}\nstdout:\n{}\nstderr:\n{}",
                self.stdout(),
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().expect("running").id();
        let status = Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {sig} {pid}");
    }

    /// Waits at most `within` for the exit; `None` if it is still running.
    fn wait(&mut self, within: Duration) -> Option<i32> {
        let deadline = Instant::now() + within;
        let child = self.child.as_mut().expect("running");
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                // The pipes close at exit; give the reader threads a moment to finish.
                std::thread::sleep(Duration::from_millis(100));
                return status.code();
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn accepts(addr: &str) -> bool {
    let addr: SocketAddr = addr.parse().expect("socket address");
    TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
}

fn check(path: &Path) -> Output {
    let mut c = idemproxy();
    c.arg("--check").arg("--config").arg(path);
    run(c)
}

#[test]
fn check_of_a_valid_file_exits_zero() {
    let file = write_config(&valid_yaml("127.0.0.1:8080"));
    let out = check(file.path());
    assert_eq!(out.code, Some(0), "stderr: {}", out.stderr);
    assert!(out.stdout.contains("valid"), "stdout: {}", out.stdout);
    assert!(
        !out.stderr.contains("error"),
        "no errors on stderr: {}",
        out.stderr
    );
}

#[test]
fn check_does_not_bind_the_listen_address() {
    // --check validates; it must not start serving (or fail because the port is taken).
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    let file = write_config(&valid_yaml(&addr));
    let out = check(file.path());
    assert_eq!(out.code, Some(0), "stderr: {}", out.stderr);
}

#[test]
fn check_of_the_repository_example_exits_zero() {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("config.example.yaml");
    let out = check(&example);
    assert_eq!(out.code, Some(0), "stderr: {}", out.stderr);
}

#[test]
fn check_of_an_invalid_file_prints_every_error_with_its_field_path() {
    let yaml = "\
listen: nowhere
store:
  timeout: 0ms
upstreams:
  booking:
    url: ftp://127.0.0.1:8081
routes:
  - name: a
    path: bookings
    upstream: booking
  - name: a
    path: /x
    upstream: billing
    idempotency:
      lock_ttl: 1ms
      fingerprint: [colour]
      retry_statuses: [1000]
";
    let file = write_config(yaml);
    let out = check(file.path());
    assert_eq!(out.code, Some(INVALID), "stderr: {}", out.stderr);
    for (path, why) in [
        ("listen", "invalid socket address"),
        ("store.timeout", "greater than zero"),
        ("upstreams.booking.url", "invalid upstream URL"),
        ("routes[0].path", "invalid path"),
        ("routes[1].name", "duplicate route name"),
        ("routes[1].upstream", "unknown upstream"),
        ("routes[1].idempotency.lock_ttl", "at least"),
        (
            "routes[1].idempotency.fingerprint[0]",
            "unknown fingerprint part",
        ),
        (
            "routes[1].idempotency.retry_statuses[0]",
            "invalid HTTP status",
        ),
    ] {
        let line = out
            .stderr
            .lines()
            .find(|l| l.contains(&format!("{path}: ")));
        match line {
            Some(l) => assert!(l.contains(why), "{path}: {l}"),
            None => panic!("no error naming {path} on stderr:\n{}", out.stderr),
        }
    }
    assert!(
        out.stdout.trim().is_empty(),
        "nothing on stdout: {}",
        out.stdout
    );
}

#[test]
fn check_names_an_unknown_nested_field_by_its_path() {
    let yaml = valid_yaml("127.0.0.1:8080").replace("lock_ttl: 2s", "ttll: 2s");
    let file = write_config(&yaml);
    let out = check(file.path());
    assert_eq!(out.code, Some(INVALID), "stderr: {}", out.stderr);
    assert!(
        out.stderr
            .contains("routes[0].idempotency.ttll: unknown field `ttll`"),
        "{}",
        out.stderr
    );
    assert!(out.stderr.contains("line 11 column"), "{}", out.stderr);
}

#[test]
fn check_of_a_syntax_error_gives_line_and_column() {
    // The flow sequence opened on line 7 is never closed; the parser finds out on line 8.
    let yaml = valid_yaml("127.0.0.1:8080").replace("methods: [POST]", "methods: [POST");
    assert_eq!(yaml.lines().nth(6), Some("    methods: [POST"));
    let file = write_config(&yaml);
    let out = check(file.path());
    assert_eq!(out.code, Some(INVALID), "stderr: {}", out.stderr);
    assert!(out.stderr.contains("routes[0].methods"), "{}", out.stderr);
    assert!(out.stderr.contains("line 8 column"), "{}", out.stderr);

    // A tab used for indentation on line 4.
    let file = write_config("listen: 127.0.0.1:8080\nupstreams:\n  booking:\n\turl: http://x\n");
    let out = check(file.path());
    assert_eq!(out.code, Some(INVALID), "stderr: {}", out.stderr);
    assert!(out.stderr.contains("line 4 column"), "{}", out.stderr);
}

#[test]
fn check_of_a_missing_file_fails_and_names_it() {
    let dir = tempfile::tempdir().expect("temp dir");
    let missing = dir.path().join("nope.yaml");
    let out = check(&missing);
    assert_eq!(out.code, Some(INVALID), "stderr: {}", out.stderr);
    assert!(
        out.stderr.contains(&*missing.to_string_lossy()),
        "{}",
        out.stderr
    );
}

#[test]
fn the_config_file_can_come_from_idemproxy_config() {
    let good = write_config(&valid_yaml("127.0.0.1:8080"));
    let bad = write_config("listen: 127.0.0.1:8080\ncolour: blue\n");

    let mut c = idemproxy();
    c.arg("--check").env("IDEMPROXY_CONFIG", good.path());
    let out = run(c);
    assert_eq!(out.code, Some(0), "stderr: {}", out.stderr);

    let mut c = idemproxy();
    c.arg("--check").env("IDEMPROXY_CONFIG", bad.path());
    let out = run(c);
    assert_eq!(out.code, Some(INVALID), "stderr: {}", out.stderr);
    assert!(
        out.stderr.contains("colour: unknown field"),
        "{}",
        out.stderr
    );

    // An explicit --config wins over the environment.
    let mut c = idemproxy();
    c.arg("--check")
        .arg("--config")
        .arg(good.path())
        .env("IDEMPROXY_CONFIG", bad.path());
    let out = run(c);
    assert_eq!(out.code, Some(0), "stderr: {}", out.stderr);
}

#[test]
fn without_a_config_it_fails_with_a_helpful_message() {
    for args in [&[][..], &["--check"][..]] {
        let mut c = idemproxy();
        c.args(args);
        let out = run(c);
        assert_ne!(out.code, Some(0), "{args:?}: stderr: {}", out.stderr);
        assert!(out.code.is_some(), "{args:?}: exited, not killed");
        for hint in ["--config", "IDEMPROXY_CONFIG"] {
            assert!(
                out.stderr.contains(hint),
                "{args:?}: stderr should mention {hint}: {}",
                out.stderr
            );
        }
    }
}

#[test]
fn version_prints_the_version() {
    let mut c = idemproxy();
    c.arg("--version");
    let out = run(c);
    assert_eq!(out.code, Some(0), "stderr: {}", out.stderr);
    assert!(
        out.stdout
            .contains(&format!("idemproxy {}", env!("CARGO_PKG_VERSION"))),
        "{}",
        out.stdout
    );
}

#[test]
fn help_mentions_check_config_and_demo() {
    let mut c = idemproxy();
    c.arg("--help");
    let out = run(c);
    assert_eq!(out.code, Some(0), "stderr: {}", out.stderr);
    for word in [
        "--check",
        "--config",
        "IDEMPROXY_CONFIG",
        "demo",
        "reload",
        "--version",
    ] {
        assert!(
            out.stdout.contains(word),
            "--help lacks {word}:\n{}",
            out.stdout
        );
    }
    let mut c = idemproxy();
    c.args(["demo", "--help"]);
    let out = run(c);
    assert_eq!(out.code, Some(0), "stderr: {}", out.stderr);
    for word in ["--listen", "--upstream-listen", "--admin-listen"] {
        assert!(
            out.stdout.contains(word),
            "demo --help lacks {word}:\n{}",
            out.stdout
        );
    }
}

#[test]
fn an_unknown_flag_is_refused() {
    let mut c = idemproxy();
    c.arg("--chekc");
    let out = run(c);
    assert_ne!(out.code, Some(0));
    assert!(out.stderr.contains("--chekc"), "{}", out.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_serves_forward_and_replay_then_stops_on_sigterm() {
    let listen = format!("127.0.0.1:{}", free_port());
    let upstream = format!("127.0.0.1:{}", free_port());
    let admin = format!("127.0.0.1:{}", free_port());
    let mut c = idemproxy();
    c.args([
        "demo",
        "--listen",
        &listen,
        "--upstream-listen",
        &upstream,
        "--admin-listen",
        &admin,
    ]);
    let mut demo = Running::spawn(c);
    demo.wait_for("the curl lines", |out, _| {
        out.contains("Idempotency-Key") && out.contains(&listen)
    });
    let out = demo.stdout();
    assert!(
        out.lines()
            .any(|l| l.starts_with("curl") && l.contains(&format!("http://{listen}/bookings"))),
        "curl lines against the proxy:\n{out}"
    );
    demo.wait_for("the proxy to accept", |_, _| accepts(&listen));

    let book = || {
        client()
            .post(format!("http://{listen}/bookings"))
            .header("Idempotency-Key", "cli-demo-1")
            .header("Content-Type", "application/json")
            .body(r#"{"seat":"12A"}"#)
    };
    let first = send(book()).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    assert_eq!(first.header("idempotent-replayed"), "");
    let again = send(book()).await;
    assert_eq!(again.status, 201);
    assert_eq!(again.header("idempotent-replayed"), "true");
    assert_eq!(again.body, first.body, "byte-identical replay");

    // The mock booking service made one booking for the key (the stats pass through the proxy).
    let stats = send(client().get(format!("http://{listen}/_mock/stats"))).await;
    assert_eq!(stats.status, 200, "{:?}", stats.body);
    assert_eq!(stats.json()["by_key"]["cli-demo-1"], 1, "{:?}", stats.body);

    // Its admin listener, as the lines it printed use it: health, metrics, and the key
    // tooling with the printed token.
    assert!(
        out.contains(&format!("http://{admin}/metrics"))
            && out.contains("IDEMPROXY_ADMIN_TOKEN=demo-token"),
        "admin lines:\n{out}"
    );
    let health = send(client().get(format!("http://{admin}/healthz"))).await;
    assert_eq!(health.status, 200, "{:?}", health.body);
    let metrics = send(client().get(format!("http://{admin}/metrics"))).await;
    assert!(
        String::from_utf8_lossy(&metrics.body)
            .contains(r#"idemproxy_requests_total{route="create-booking",outcome="replayed"} 1"#),
        "{:?}",
        metrics.body
    );
    let record = send(
        client()
            .get(format!("http://{admin}/keys/create-booking?key=cli-demo-1"))
            .header("Authorization", "Bearer demo-token"),
    )
    .await;
    assert_eq!(record.status, 200, "{:?}", record.body);
    assert_eq!(record.json()["state"], "finished", "{:?}", record.body);
    assert_eq!(record.json()["status"], 201, "{:?}", record.body);

    // The MCP pair it prints: a tool call with its key in `_meta`, sent again with another id.
    assert!(
        out.contains(&format!("http://{listen}/mcp")) && out.contains("idempotency-key"),
        "the MCP lines:\n{out}"
    );
    let tool_call = |id: u32| {
        client()
            .post(format!("http://{listen}/mcp"))
            .header("Content-Type", "application/json")
            .header("Accept", "application/json, text/event-stream")
            .body(format!(
                r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"book","arguments":{{"seat":"7C"}},"_meta":{{"idempotency-key":"cli-agent-1"}}}}}}"#
            ))
    };
    let first = send(tool_call(1)).await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    let again = send(tool_call(2)).await;
    assert_eq!(
        again.header("idempotent-replayed"),
        "true",
        "{:?}",
        again.body
    );
    assert_eq!(again.json()["id"], 2, "the retry's own id");
    assert_eq!(again.json()["result"], first.json()["result"]);
    let stats = send(client().get(format!("http://{listen}/_mock/stats"))).await;
    assert_eq!(
        stats.json()["bookings"],
        2,
        "one booking for the two tool calls: {:?}",
        stats.body
    );

    // The gRPC pair it prints: the mock's gRPC client calls the ledger's Transfer twice with
    // one key, over HTTP/2 through the proxy.
    assert!(
        out.contains(&format!(
            "grpc-transfer --url http://{listen} --key demo-g1"
        )),
        "the gRPC lines:\n{out}"
    );
    let grpc_call = || {
        let out = Command::new(harness::mock_binary())
            .args([
                "grpc-transfer",
                "--url",
                &format!("http://{listen}"),
                "--key",
                "cli-demo-g1",
                "--reference",
                "r-cli",
            ])
            .output()
            .expect("run the mock's gRPC client");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let first = tokio::task::block_in_place(grpc_call);
    assert!(
        first.contains("grpc-status 0")
            && first.contains("postings of r-cli: 1")
            && first.contains("idempotent-replayed: -"),
        "{first}"
    );
    let again = tokio::task::block_in_place(grpc_call);
    assert!(
        again.contains("postings of r-cli: 1") && again.contains("idempotent-replayed: true"),
        "{again}"
    );
    let stats = send(client().get(format!("http://{listen}/_mock/stats"))).await;
    assert_eq!(
        stats.json()["postings_by_reference"]["r-cli"],
        1,
        "{:?}",
        stats.body
    );

    demo.signal("-TERM");
    let code = tokio::task::block_in_place(|| demo.wait(Duration::from_secs(15)));
    assert_eq!(code, Some(0), "stderr:\n{}", demo.stderr());
}

#[test]
fn a_pid_file_that_cannot_be_written_stops_the_start_before_listening_is_logged() {
    let dir = tempfile::tempdir().expect("temp dir");
    let pid = dir.path().join("no-such-dir").join("idemproxy.pid");
    let yaml = valid_yaml(&format!("127.0.0.1:{}", free_port())).replace(
        "upstreams:\n",
        &format!("pid_file: {}\nupstreams:\n", pid.display()),
    );
    let file = write_config(&yaml);
    let mut c = idemproxy();
    c.arg("--config").arg(file.path());
    let out = run(c);
    assert_eq!(out.code, Some(1), "stderr:\n{}", out.stderr);
    assert!(
        out.stderr.contains("cannot write pid_file") && out.stderr.contains("no-such-dir"),
        "the reason, naming the file:\n{}",
        out.stderr
    );
    assert!(
        !out.stderr.contains("listening on"),
        "a process that cannot start never says it listens:\n{}",
        out.stderr
    );
    assert!(!pid.exists(), "no pid file left behind");
}

#[test]
fn running_logs_the_listen_address_and_sigterm_exits_zero() {
    let mut p = ProxyProcess::spawn(&valid_yaml("127.0.0.1:0"));
    let addr = p.addr.to_string();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !p.log().contains("listening on") {
        assert!(Instant::now() < deadline, "no start-up line: {}", p.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = p.log();
    let line = log
        .lines()
        .find(|l| l.contains("listening on"))
        .expect("the line");
    assert!(line.contains(&addr), "the line names {addr}: {line}");
    p.signal("-TERM");
    assert_eq!(
        p.wait(Duration::from_secs(15)),
        Some(0),
        "log:\n{}",
        p.log()
    );
}

#[test]
fn idemproxy_config_runs_the_proxy_and_sigint_exits_zero() {
    let listen = format!("127.0.0.1:{}", free_port());
    let file = write_config(&valid_yaml(&listen));
    let mut c = idemproxy();
    c.env("IDEMPROXY_CONFIG", file.path());
    let mut p = Running::spawn(c);
    p.wait_for("the start-up line", |_, err| {
        err.contains("listening on") && err.contains(&listen)
    });
    p.wait_for("the proxy to accept", |_, _| accepts(&listen));
    p.signal("-INT");
    assert_eq!(
        p.wait(Duration::from_secs(15)),
        Some(0),
        "stderr:\n{}",
        p.stderr()
    );
}

#[test]
fn log_format_json_gives_json_lines() {
    let yaml = valid_yaml("127.0.0.1:0").replace("upstreams:", "log_format: json\nupstreams:");
    let mut p = ProxyProcess::spawn(&yaml);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !p.log().contains("listening on") {
        assert!(Instant::now() < deadline, "no start-up line: {}", p.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    p.signal("-TERM");
    assert_eq!(
        p.wait(Duration::from_secs(15)),
        Some(0),
        "log:\n{}",
        p.log()
    );
    let log = p.log();
    let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(lines.len() >= 2, "start-up and shutdown lines: {log}");
    let mut saw_listen = false;
    for line in &lines {
        let doc: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
        assert!(doc.is_object(), "{line}");
        assert!(doc["level"].is_string(), "a level: {line}");
        saw_listen |= line.contains("listening on") && line.contains(&p.addr.to_string());
    }
    assert!(saw_listen, "the start-up line names the address: {log}");
}

/// A log whose destination is gone — stderr a pipe whose reader has exited (`idemproxy … 2>&1 |
/// head -1`, a log collector that died) — costs its lines and nothing else: every request still
/// gets its answer (each one logs a line), a repeat its replay, `/healthz` its 200, SIGTERM exit
/// 0; and the lines lost are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_log_sink_costs_no_answer_no_replay_and_no_clean_exit() {
    let mock = harness::mock::start().await.expect("start the mock");
    let listen = format!("127.0.0.1:{}", free_port());
    let admin = format!("127.0.0.1:{}", free_port());
    let yaml = format!(
        "listen: {listen}
admin_listen: {admin}
upstreams:
  booking:
    url: {up}
routes:
  - name: create-booking
    methods: [POST]
    path: /bookings
    upstream: booking
    idempotency:
      lock_ttl: 2s
  - name: rest
    path: /*
    upstream: booking
",
        up = mock.url()
    );
    let file = write_config(&yaml);
    let mut c = idemproxy();
    c.arg("--config").arg(file.path()).stdout(Stdio::null());
    let mut child = c.spawn().expect("spawn idemproxy");
    // The reader of its stderr is gone from the start: every write there fails (EPIPE).
    drop(child.stderr.take());
    let mut p = Running {
        child: Some(child),
        stdout: Arc::default(),
        stderr: Arc::default(),
    };
    p.wait_for("the proxy to accept", |_, _| {
        accepts(&listen) && accepts(&admin)
    });

    let book = |key: &str| {
        client()
            .post(format!("http://{listen}/bookings"))
            .header("Idempotency-Key", key)
            .header("Content-Type", "application/json")
            .body(r#"{"seat":"12A"}"#)
    };
    for n in 0..3 {
        let key = format!("dead-log-{n}");
        let first = send(book(&key)).await;
        assert_eq!(first.status, 201, "{key}: {:?}", first.body);
        assert_eq!(first.header("idempotent-replayed"), "");
        let again = send(book(&key)).await;
        assert_eq!(again.status, 201, "{key}: {:?}", again.body);
        assert_eq!(again.header("idempotent-replayed"), "true");
        assert_eq!(again.body, first.body, "byte-identical replay");
        assert_eq!(mock.calls(&key), 1, "{key} ran once");
    }
    let passthrough = send(client().get(format!("http://{listen}/_mock/stats"))).await;
    assert_eq!(passthrough.status, 200, "{:?}", passthrough.body);
    for _ in 0..3 {
        let health = send(client().get(format!("http://{admin}/healthz"))).await;
        assert_eq!(health.status, 200, "{:?}", health.body);
    }
    // At least one line a request (seven; the start-up line too, unless the proxy wrote it
    // before the pipe's reader was gone). A request's line is written as its answer ends, which
    // can be a moment after the client has read it: the count is read until it gets there,
    // within a bound.
    let counted_by = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let metrics = send(client().get(format!("http://{admin}/metrics"))).await;
        assert_eq!(metrics.status, 200);
        let text = String::from_utf8_lossy(&metrics.body).into_owned();
        let dropped = harness::metric_value(&text, "idemproxy_log_lines_dropped_total", &[]);
        if dropped >= 7.0 {
            break;
        }
        assert!(
            std::time::Instant::now() < counted_by,
            "lines dropped: {dropped}\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    p.signal("-TERM");
    let code = tokio::task::block_in_place(|| p.wait(Duration::from_secs(15)));
    assert_eq!(code, Some(0), "a clean exit");
}
