//! SPEC §5 and the operations tooling: the admin listener (`/healthz`, `/readyz`, `/metrics`),
//! the counts the metrics keep, readiness during the drain, and the key tooling (look up and
//! forget one record, over HTTP and from the command line).

use std::process::Command;
use std::time::Duration;

use harness::every_store;
use harness::{
    Backend, Env, ProxyProcess, Reply, TestProxy, binary, client, eventually, free_port, send,
    spawn_booking, write_config,
};
use http::{HeaderMap, HeaderName, HeaderValue};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

const BODY: &str = r#"{"seat":"12A"}"#;

/// An admin listener over an in-process proxy; stopped on drop or by [`Admin::stop`].
struct Admin {
    base: String,
    stop: oneshot::Sender<()>,
    task: JoinHandle<std::io::Result<()>>,
}

impl Admin {
    /// Stops the admin listener and waits until it is done (it holds the proxy meanwhile).
    async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}

async fn admin(proxy: &TestProxy) -> Admin {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind admin");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(idemproxy::server::serve_admin(
        listener,
        proxy.proxy.clone(),
        async move {
            let _ = stopped.await;
        },
    ));
    Admin { base, stop, task }
}

async fn get(url: String, token: Option<&str>) -> Reply {
    let mut req = client().get(url);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    send(req).await
}

async fn post(proxy: &TestProxy, key: &str, extra: &[(&str, &str)]) -> Reply {
    let mut req = client()
        .post(proxy.url("/bookings"))
        .header("Idempotency-Key", key)
        .body(BODY);
    for (n, v) in extra {
        req = req.header(*n, *v);
    }
    send(req).await
}

/// The value of the series `line_start` (name and labels exactly as exposed) in `text`.
fn value(text: &str, line_start: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(line_start)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {line_start} in:\n{text}"))
}

fn requests(text: &str, outcome: &str) -> f64 {
    value(
        text,
        &format!(r#"idemproxy_requests_total{{route="create-booking",outcome="{outcome}"}}"#),
    )
}

every_store!(
    health_readiness_and_metrics_count_every_outcome,
    key_tooling_shows_and_forgets_records,
);

/// `/healthz` and `/readyz` answer 200; `/metrics` counts forwards, replays, conflicts,
/// mismatches and refusals as they happen, and the memory store's fill.
async fn health_readiness_and_metrics_count_every_outcome(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("")).await;
    let admin = admin(&proxy).await;
    assert_eq!(
        get(format!("{}/healthz", admin.base), None).await.status,
        200
    );
    assert_eq!(
        get(format!("{}/readyz", admin.base), None).await.status,
        200
    );

    assert_eq!(post(&proxy, "m-1", &[]).await.status, 201);
    assert_eq!(post(&proxy, "m-1", &[]).await.status, 201);
    let slow = spawn_booking(proxy.url(""), "m-2", BODY, "800ms");
    assert!(eventually(Duration::from_secs(3), || env.mock.calls("m-2") == 1).await);
    assert_eq!(post(&proxy, "m-2", &[]).await.status, 409);
    let mismatch = send(
        client()
            .post(proxy.url("/bookings"))
            .header("Idempotency-Key", "m-1")
            .body("another body"),
    )
    .await;
    assert_eq!(mismatch.status, 422);
    assert_eq!(
        send(client().post(proxy.url("/bookings")).body(BODY))
            .await
            .status,
        400
    );
    assert_eq!(slow.await.expect("slow").status, 201);

    let m = get(format!("{}/metrics", admin.base), None).await;
    assert_eq!(m.status, 200);
    assert!(m.header("content-type").contains("openmetrics-text"));
    let text = String::from_utf8_lossy(&m.body).into_owned();
    assert_eq!(requests(&text, "forwarded"), 2.0);
    assert_eq!(requests(&text, "replayed"), 1.0);
    assert_eq!(requests(&text, "conflict"), 1.0);
    assert_eq!(requests(&text, "mismatch"), 1.0);
    assert_eq!(requests(&text, "missing_key"), 1.0);
    assert_eq!(requests(&text, "store_error"), 0.0);
    assert_eq!(
        value(
            &text,
            r#"idemproxy_request_duration_seconds_count{route="create-booking",outcome="forwarded"}"#
        ),
        2.0
    );
    assert!(
        value(
            &text,
            r#"idemproxy_upstream_duration_seconds_count{upstream="booking"}"#
        ) >= 2.0
    );
    assert!(
        value(
            &text,
            r#"idemproxy_store_operation_duration_seconds_count{op="claim"}"#
        ) >= 5.0
    );
    for name in [
        "idemproxy_lost_leases_total",
        "idemproxy_saves_abandoned_total",
        "idemproxy_unprotected_requests_total",
        "idemproxy_lease_renewals_total",
    ] {
        assert!(text.contains(name), "{name} is exposed");
    }
    if backend == Backend::Memory {
        assert_eq!(value(&text, "idemproxy_memory_store_records"), 2.0);
        assert_eq!(
            value(&text, "idemproxy_memory_store_max_entries"),
            1_000_000.0
        );
    } else {
        // The same two records, seen from outside the proxy.
        let keys = env.stored_keys();
        assert_eq!(keys.len(), 2, "m-1 and m-2 are kept: {keys:?}");
    }
}

/// Readiness follows the store: 503 while Redis does not answer, 200 once it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_readiness_follows_the_store_and_store_errors_are_counted() {
    let env = Env::new(Backend::Redis).await;
    let proxy = env.proxy(&env.config("")).await;
    let admin = admin(&proxy).await;
    assert_eq!(
        get(format!("{}/readyz", admin.base), None).await.status,
        200
    );
    env.redis().pause();
    let started = std::time::Instant::now();
    let r = get(format!("{}/readyz", admin.base), None).await;
    assert_eq!(r.status, 503, "{:?}", r.body);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "within the store timeout"
    );
    assert_eq!(post(&proxy, "down", &[]).await.status, 503);
    env.redis().resume();
    let mut ready = false;
    for _ in 0..50 {
        if get(format!("{}/readyz", admin.base), None).await.status == 200 {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ready, "ready again once Redis answers");
    let text = String::from_utf8_lossy(&get(format!("{}/metrics", admin.base), None).await.body)
        .into_owned();
    assert_eq!(requests(&text, "store_error"), 1.0);
    assert!(value(&text, r#"idemproxy_store_errors_total{op="claim"}"#) >= 1.0);
    assert!(value(&text, r#"idemproxy_store_errors_total{op="ping"}"#) >= 1.0);
}

/// What a raw `HEAD path` on `addr` gets back: the whole answer as text, read until the
/// server closes (`Connection: close`) or 5s pass.
async fn raw_head(addr: &str, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect to the admin listener");
    let req = format!("HEAD {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    conn.write_all(req.as_bytes()).await.expect("send HEAD");
    let mut got = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut got)).await;
    assert!(
        read.is_ok(),
        "the answer to HEAD {path} did not end within 5s"
    );
    String::from_utf8_lossy(&got).into_owned()
}

/// Load balancers that probe with `HEAD` get what `GET` gets, without the body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn head_probes_get_the_status_of_get_without_a_body() {
    let env = Env::new(Backend::Memory).await;
    let proxy = env.proxy(&env.config("")).await;
    let admin = admin(&proxy).await;
    let addr = admin.base.trim_start_matches("http://").to_owned();
    for (path, body) in [("/healthz", "ok\n"), ("/readyz", "ready\n")] {
        let get = get(format!("{}{path}", admin.base), None).await;
        assert_eq!(get.status, 200, "GET {path}");
        assert_eq!(get.body, body.as_bytes(), "GET {path}");
        let answer = raw_head(&addr, path).await;
        let (head, rest) = answer
            .split_once("\r\n\r\n")
            .unwrap_or_else(|| panic!("no head in the answer to HEAD {path}: {answer:?}"));
        assert!(head.starts_with("HTTP/1.1 200 "), "HEAD {path}: {head}");
        assert!(
            head.to_ascii_lowercase()
                .contains(&format!("content-length: {}", body.len())),
            "HEAD {path} announces GET's body: {head}"
        );
        assert_eq!(rest, "", "HEAD {path} has no body");
    }
    // Other paths are refused as before, HEAD or not.
    let answer = raw_head(&addr, "/nothing").await;
    assert!(answer.starts_with("HTTP/1.1 404 "), "{answer}");
    admin.stop().await;
    proxy.stop().await;
}

/// After SIGTERM, `/readyz` answers 503 while requests in flight finish (a load balancer stops
/// sending), and the process exits 0 once they are done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_is_503_while_draining() {
    let env = Env::new(Backend::Memory).await;
    let admin_port = free_port();
    let yaml = env.config("").replace(
        "shutdown_timeout: 10s\n",
        &format!("shutdown_timeout: 10s\nadmin_listen: 127.0.0.1:{admin_port}\n"),
    );
    let mut proxy = ProxyProcess::spawn(&yaml);
    let admin = format!("http://127.0.0.1:{admin_port}");
    let mut up = false;
    for _ in 0..50 {
        if let Ok(r) = client().get(format!("{admin}/readyz")).send().await {
            up = r.status() == 200;
            if up {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(up, "ready before the drain");
    let slow = spawn_booking(proxy.url(""), "drain-1", BODY, "1500ms");
    assert!(eventually(Duration::from_secs(3), || env.mock.calls("drain-1") == 1).await);
    proxy.signal("-TERM");
    let mut saw_draining = false;
    for _ in 0..40 {
        match client().get(format!("{admin}/readyz")).send().await {
            Ok(r) if r.status() == 503 => {
                saw_draining = true;
                break;
            }
            _ => tokio::time::sleep(Duration::from_millis(25)).await,
        }
    }
    assert!(saw_draining, "readyz said 503 during the drain");
    assert_eq!(
        slow.await.expect("slow").status,
        201,
        "the request in flight finished"
    );
    assert_eq!(proxy.wait(Duration::from_secs(10)), Some(0));
}

/// A token file, written for the test.
fn token_file(token: &str) -> tempfile::NamedTempFile {
    write_config(&format!("{token}\n"))
}

/// The key tooling: off without a token, 401 with a wrong one; a record is shown by key and
/// scope or by its hash, without its body unless asked; an in-flight claim is shown and never
/// forgotten; a finished record (here a saved 502) is forgotten, so the retry runs again.
async fn key_tooling_shows_and_forgets_records(backend: Backend) {
    let env = Env::new(backend).await;
    let off = env.proxy(&env.config("")).await;
    let off_admin = admin(&off).await;
    // No token configured: the endpoints do not exist. Refusals are problem+json.
    get(
        format!("{}/keys/create-booking?key=x", off_admin.base),
        Some("t"),
    )
    .await
    .assert_problem(404, "key-tooling-off");
    get(format!("{}/nothing-here", off_admin.base), None)
        .await
        .assert_problem(404, "no-admin-endpoint");
    // One proxy on the store at a time: an SQLite file is one store's at once.
    off_admin.stop().await;
    off.stop().await;

    let token = token_file("s3cret-token");
    let yaml = env.config("").replace(
        "shutdown_timeout: 10s\n",
        &format!(
            "shutdown_timeout: 10s\nadmin_listen: 127.0.0.1:1\nadmin_token_file: {}\n",
            token.path().display()
        ),
    );
    let proxy = env.proxy(&yaml).await;
    let admin = admin(&proxy).await;
    let base = &admin.base;
    let auth = ("Authorization", "Bearer alice");
    let first = post(&proxy, "kt-1", &[auth]).await;
    assert_eq!(first.status, 201);

    let by_key =
        format!("{base}/keys/create-booking?key=kt-1&scope=Authorization%3A%20Bearer%20alice");
    get(by_key.clone(), None)
        .await
        .assert_problem(401, "unauthorized");
    assert_eq!(get(by_key.clone(), Some("wrong")).await.status, 401);
    let shown = get(by_key.clone(), Some("s3cret-token")).await;
    assert_eq!(shown.status, 200, "{:?}", shown.body);
    // The auth scheme is case-insensitive (RFC 9110 §11.1); the token is not.
    for (authorization, status) in [
        ("bearer s3cret-token", 200),
        ("BEARER s3cret-token", 200),
        ("Bearer S3CRET-TOKEN", 401),
        ("Basic s3cret-token", 401),
        ("Bearers3cret-token", 401),
    ] {
        let r = send(
            client()
                .get(by_key.clone())
                .header("Authorization", authorization),
        )
        .await;
        assert_eq!(r.status, status, "{authorization}");
    }
    let doc = shown.json();
    assert_eq!(doc["state"], "finished");
    assert_eq!(doc["status"], 201);
    assert_eq!(doc["body_bytes"], first.body.len());
    assert!(
        doc["headers"]
            .as_array()
            .expect("headers")
            .iter()
            .any(|h| h == "content-type")
    );
    assert!(doc.get("body").is_none(), "never the body unless asked");
    assert!(doc["ttl_remaining_ms"].as_u64().expect("ttl") > 86_000_000);
    assert!(doc["age_ms"].as_u64().expect("age") < 60_000);
    let mut scope = HeaderMap::new();
    scope.insert(
        HeaderName::from_static("authorization"),
        HeaderValue::from_static("Bearer alice"),
    );
    let expected = harness::store_key(
        "idemproxy:",
        "create-booking",
        &[HeaderName::from_static("authorization")],
        &scope,
        "kt-1",
    );
    let hash = expected.rsplit(':').next().expect("hash").to_owned();
    assert_eq!(doc["key_hash"], hash.as_str());
    assert_eq!(doc["store_key"], expected.as_str());
    // By hash, with the body.
    let with_body = get(
        format!("{base}/keys/create-booking/{hash}?body=true"),
        Some("s3cret-token"),
    )
    .await
    .json();
    assert_eq!(
        with_body["body"].as_str().expect("body").as_bytes(),
        &first.body[..]
    );
    // Another caller's same key is another record.
    let other = get(
        format!("{base}/keys/create-booking?key=kt-1&scope=Authorization%3A%20Bearer%20bob"),
        Some("s3cret-token"),
    )
    .await;
    other.assert_problem(404, "no-record");
    for (url, status, slug) in [
        ("/keys/no-such-route?key=kt-1", 404, "no-idempotent-route"),
        ("/keys/rest?key=kt-1", 404, "no-idempotent-route"),
        ("/keys/create-booking/abc", 400, "invalid-record-name"),
        ("/keys/create-booking", 400, "invalid-record-name"),
        (
            "/keys/create-booking?key=kt-1&scope=nocolon",
            400,
            "invalid-record-name",
        ),
    ] {
        get(format!("{base}{url}"), Some("s3cret-token"))
            .await
            .assert_problem(status, slug);
    }
    send(client().put(by_key.clone()).bearer_auth("s3cret-token"))
        .await
        .assert_problem(405, "method-not-allowed");

    // In flight: shown, never forgotten.
    let slow = spawn_booking(proxy.url(""), "kt-2", BODY, "1s");
    assert!(eventually(Duration::from_secs(3), || env.mock.calls("kt-2") == 1).await);
    let url = format!("{base}/keys/create-booking?key=kt-2");
    assert_eq!(
        get(url.clone(), Some("s3cret-token")).await.json()["state"],
        "in_flight"
    );
    let del = send(client().delete(url.clone()).bearer_auth("s3cret-token")).await;
    del.assert_problem(409, "record-in-flight");
    assert_eq!(slow.await.expect("slow").status, 201);

    // A saved 502 (the upstream reset after receiving; on_unknown_outcome: keep) is forgotten,
    // and the customer's retry runs again.
    let failed = post(&proxy, "kt-3", &[("X-Mock-Reset", "true")]).await;
    assert_eq!(failed.status, 502);
    assert_eq!(post(&proxy, "kt-3", &[]).await.status, 502, "replayed");
    let url = format!("{base}/keys/create-booking?key=kt-3");
    let del = send(client().delete(url.clone()).bearer_auth("s3cret-token")).await;
    assert_eq!(del.status, 200, "{:?}", del.body);
    assert_eq!(del.json()["forgotten"], true);
    assert_eq!(get(url.clone(), Some("s3cret-token")).await.status, 404);
    let retried = post(&proxy, "kt-3", &[]).await;
    assert_eq!(retried.status, 201, "the retry ran again");
    assert_eq!(env.mock.calls("kt-3"), 2);
    assert_eq!(
        send(client().delete(url).bearer_auth("s3cret-token"))
            .await
            .status,
        200
    );
}

/// The same from the command line, against a running proxy process: `idemproxy health`,
/// `idemproxy keys show`, `idemproxy keys forget`; and the request log carries the key's hash
/// (never the key itself).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn command_line_health_and_keys() {
    let env = Env::new(Backend::Memory).await;
    let admin_port = free_port();
    let token = token_file("cli-token");
    let yaml = env.config("").replace(
        "shutdown_timeout: 10s\n",
        &format!(
            "shutdown_timeout: 10s\nadmin_listen: 127.0.0.1:{admin_port}\nadmin_token_file: {}\n",
            token.path().display()
        ),
    );
    let proxy = ProxyProcess::spawn(&yaml);
    let admin = format!("http://127.0.0.1:{admin_port}");
    let run = |args: &[&str]| {
        let out = Command::new(binary())
            .args(args)
            .env("IDEMPROXY_ADMIN", &admin)
            .env_remove("IDEMPROXY_ADMIN_TOKEN")
            .output()
            .expect("run idemproxy");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let mut healthy = false;
    for _ in 0..50 {
        if run(&["health"]).0 == Some(0) {
            healthy = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(healthy, "idemproxy health exits 0 against a running proxy");
    let (code, _, err) = run(&["health", "--admin", "http://127.0.0.1:1"]);
    assert_eq!(code, Some(1), "unhealthy when nothing answers: {err}");

    let r = send(
        client()
            .post(proxy.url("/bookings"))
            .header("Idempotency-Key", "cli-secret-key-1")
            .header("X-Mock-Reset", "true")
            .body(BODY),
    )
    .await;
    assert_eq!(r.status, 502);
    let token_path = token.path().display().to_string();
    let (code, out, err) = run(&[
        "keys",
        "show",
        "--route",
        "create-booking",
        "--key",
        "cli-secret-key-1",
        "--token-file",
        &token_path,
    ]);
    assert_eq!(code, Some(0), "{err}");
    let doc: serde_json::Value = serde_json::from_str(&out).expect("JSON on stdout");
    assert_eq!(doc["state"], "finished");
    assert_eq!(doc["status"], 502);
    let hash = doc["key_hash"].as_str().expect("hash").to_owned();
    // "The key, as the client sent it": its quoted Structured Field form is the same key.
    let (code, out, err) = run(&[
        "keys",
        "show",
        "--route",
        "create-booking",
        "--key",
        "\"cli-secret-key-1\"",
        "--token-file",
        &token_path,
    ]);
    assert_eq!(code, Some(0), "the quoted form finds the record: {err}");
    let quoted: serde_json::Value = serde_json::from_str(&out).expect("JSON on stdout");
    assert_eq!(quoted["key_hash"], hash.as_str());
    let (code, _, err) = run(&[
        "keys",
        "show",
        "--route",
        "create-booking",
        "--key",
        "bad key",
        "--token-file",
        &token_path,
    ]);
    assert_eq!(code, Some(1), "an invalid key is refused: {err}");
    assert!(err.contains("400"), "{err}");

    // The request log names the key by its hash, never by the key.
    let log = proxy.log();
    assert!(log.contains(&hash), "the log carries the key hash:\n{log}");
    assert!(
        !log.contains("cli-secret-key-1"),
        "never the raw key:\n{log}"
    );

    let (code, _, err) = run(&[
        "keys",
        "show",
        "--route",
        "create-booking",
        "--hash",
        &hash,
        "--token-file",
        &token_path,
    ]);
    assert_eq!(code, Some(0), "{err}");
    let (code, _, err) = run(&[
        "keys",
        "forget",
        "--route",
        "create-booking",
        "--hash",
        &hash,
    ]);
    assert_eq!(code, Some(1), "no token: refused: {err}");
    assert!(err.contains("401"), "{err}");
    let (code, out, err) = run(&[
        "keys",
        "forget",
        "--route",
        "create-booking",
        "--hash",
        &hash,
        "--token-file",
        &token_path,
    ]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("forgotten"), "{out}");
    assert!(
        eventually(Duration::from_secs(2), || proxy
            .log()
            .contains("record forgotten"))
        .await,
        "every forget is logged"
    );
    let again = send(
        client()
            .post(proxy.url("/bookings"))
            .header("Idempotency-Key", "cli-secret-key-1")
            .body(BODY),
    )
    .await;
    assert_eq!(again.status, 201, "the retry ran again");
}

/// The harness reads `/metrics` as a scraper does: by name and labels, summing what matches.
#[test]
fn the_metrics_text_is_read_as_a_scraper_reads_it() {
    let text = "# TYPE r counter\n\
        r_total{route=\"a\",outcome=\"x\"} 2\n\
        r_total{route=\"b \\\"q\\\"\",outcome=\"x\"} 3\n\
        g 7\n# EOF\n";
    assert_eq!(
        harness::metric_value(text, "r_total", &[("route", "a")]),
        2.0
    );
    assert_eq!(
        harness::metric_value(text, "r_total", &[("route", "b \"q\"")]),
        3.0
    );
    assert_eq!(
        harness::metric_value(text, "r_total", &[("outcome", "x")]),
        5.0
    );
    assert_eq!(harness::metric_value(text, "g", &[]), 7.0);
    assert!(
        std::panic::catch_unwind(|| harness::metric_value(text, "r_total", &[("route", "c")]))
            .is_err()
    );
}

/// §4.8: a key being resolved (its claim taken over, written here as another instance on the
/// same Redis would) shows as `resolving` with the wait for its next lookup and the lookup's
/// upstream, method and header names — never the copied header values; `keys forget`
/// answers 409 for it, as for any claim in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_show_a_key_being_resolved_and_never_forget_it() {
    use idemproxy::record::{Held, Lookup, Record, Resolvable};
    use idemproxy::store::{ResolvableClaim, ResolvableTimes, StoreKey};

    let env = Env::new(Backend::Redis).await;
    let token = token_file("s3cret-token");
    let yaml = env.config("").replace(
        "shutdown_timeout: 10s\n",
        &format!(
            "shutdown_timeout: 10s\nadmin_listen: 127.0.0.1:1\nadmin_token_file: {}\n",
            token.path().display()
        ),
    );
    let proxy = env.proxy(&yaml).await;
    let admin = admin(&proxy).await;
    let store = env.store_handle().await;
    let key = StoreKey::new(
        idemproxy::key::namespace("idemproxy:", "create-booking"),
        0,
        [0x42; 32],
    );
    let claim = Held::new(Record::Resolvable(Box::new(Resolvable::claim(
        [1; 16],
        [2; 32],
        Lookup {
            upstream: "booking".into(),
            method: http::Method::GET,
            target: "/bookings/by-reference/r-9".into(),
            headers: vec![(
                HeaderName::from_static("authorization"),
                HeaderValue::from_static("Bearer very-secret-credential"),
            )],
        },
        Duration::from_secs(60),
        Duration::from_secs(5),
        Duration::from_secs(600),
    ))));
    let times = ResolvableTimes {
        lease: Duration::from_secs(30),
        send_margin: Duration::from_secs(1),
        lifetime: Duration::from_secs(3600),
    };
    let Ok(ResolvableClaim::Claimed { held, .. }) =
        store.claim_resolvable(&key, &claim, times).await
    else {
        panic!("the claim of a free key");
    };
    let url = format!("{}/keys/create-booking/{}", admin.base, "42".repeat(32));
    let in_flight = get(url.clone(), Some("s3cret-token")).await;
    assert_eq!(
        in_flight.json()["state"],
        "in_flight",
        "{:?}",
        in_flight.body
    );
    let next = Duration::from_secs(20);
    store
        .resolving(&key, &held, next, times.lease)
        .await
        .expect("resolving")
        .expect("still held");

    let shown = get(url.clone(), Some("s3cret-token")).await;
    assert_eq!(shown.status, 200, "{:?}", shown.body);
    let doc = shown.json();
    assert_eq!(doc["state"], "resolving");
    let wait = doc["next_lookup_in_ms"].as_u64().expect("the next lookup");
    assert!(wait > 15_000 && wait <= 20_000, "next lookup in {wait} ms");
    assert!(doc["next_lookup_at_unix_ms"].as_u64().is_some());
    assert_eq!(doc["lookup"]["upstream"], "booking");
    assert_eq!(doc["lookup"]["method"], "GET");
    assert_eq!(doc["lookup"]["headers"][0], "authorization");
    let text = String::from_utf8_lossy(&shown.body);
    assert!(
        !text.contains("very-secret-credential"),
        "never a copied header's value: {text}"
    );
    let del = send(client().delete(url.clone()).bearer_auth("s3cret-token")).await;
    del.assert_problem(409, "record-in-flight");
    assert_eq!(
        get(url, Some("s3cret-token")).await.json()["state"],
        "resolving"
    );
    admin.stop().await;
    proxy.stop().await;
}

/// §4.8: a key being resolved whose holder is gone (its lease lapsed: a crash, a drain) is
/// taken over only when a repeat of the key arrives. Until then `keys show` says it waits for
/// that repeat — not `next_lookup_in_ms: 0`, which reads as "about to be asked" — and
/// `keys forget` says what takes it over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_show_a_resolution_without_a_holder_as_waiting_for_a_repeat() {
    use idemproxy::record::{Lookup, Record, Resolvable};
    use idemproxy::store::{ResolvableClaim, ResolvableTimes, StoreKey};

    let env = Env::new(Backend::Redis).await;
    let token = token_file("s3cret-token");
    let yaml = env.config("").replace(
        "shutdown_timeout: 10s\n",
        &format!(
            "shutdown_timeout: 10s\nadmin_listen: 127.0.0.1:1\nadmin_token_file: {}\n",
            token.path().display()
        ),
    );
    let proxy = env.proxy(&yaml).await;
    let admin = admin(&proxy).await;
    let store = env.store_handle().await;
    let key = StoreKey::new(
        idemproxy::key::namespace("idemproxy:", "create-booking"),
        0,
        [0x43; 32],
    );
    let claim = idemproxy::record::Held::new(Record::Resolvable(Box::new(Resolvable::claim(
        [1; 16],
        [2; 32],
        Lookup {
            upstream: "booking".into(),
            method: http::Method::GET,
            target: "/bookings/by-reference/r-10".into(),
            headers: Vec::new(),
        },
        Duration::from_secs(60),
        Duration::from_secs(5),
        Duration::from_secs(600),
    ))));
    // A holder that marks the key resolving, its next lookup due in 100ms, and then dies:
    // its lease (300ms) is never renewed.
    let times = ResolvableTimes {
        lease: Duration::from_millis(300),
        send_margin: Duration::from_millis(100),
        lifetime: Duration::from_secs(3600),
    };
    let Ok(ResolvableClaim::Claimed { held, .. }) =
        store.claim_resolvable(&key, &claim, times).await
    else {
        panic!("the claim of a free key");
    };
    store
        .resolving(&key, &held, Duration::from_millis(100), times.lease)
        .await
        .expect("resolving")
        .expect("still held");
    let url = format!("{}/keys/create-booking/{}", admin.base, "43".repeat(32));
    let shown = get(url.clone(), Some("s3cret-token")).await;
    assert!(
        shown.json()["next_lookup_in_ms"].as_u64().is_some(),
        "held: its next lookup is due: {:?}",
        shown.body
    );

    // Asked until the lease has lapsed on the store's clock, for at most 5s.
    let until = std::time::Instant::now() + Duration::from_secs(5);
    let doc = loop {
        let doc = get(url.clone(), Some("s3cret-token")).await.json();
        if doc.get("lease_lapsed_ms_ago").is_some() || std::time::Instant::now() >= until {
            break doc;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        doc.get("lease_lapsed_ms_ago").is_some(),
        "the lease lapses within 5s: {doc}"
    );
    assert_eq!(doc["state"], "resolving", "{doc}");
    assert_eq!(
        doc["waiting_for"], "a repeat of the key to take it over",
        "{doc}"
    );
    assert!(
        doc.get("next_lookup_in_ms").is_none() && doc.get("next_lookup_at_unix_ms").is_none(),
        "no lookup is due without a holder: {doc}"
    );
    let del = send(client().delete(url.clone()).bearer_auth("s3cret-token")).await;
    let problem = del.assert_problem(409, "record-in-flight");
    let detail = problem["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("repeat of the key takes it over") && !detail.contains("next at"),
        "{detail}"
    );
    admin.stop().await;
    proxy.stop().await;
}

/// The ids of the Redis connections other than `own`'s (the test's), oldest first.
fn other_clients(own: &mut ::redis::Connection) -> Vec<u64> {
    let me: u64 = ::redis::cmd("CLIENT")
        .arg("ID")
        .query(own)
        .expect("CLIENT ID");
    let list: String = ::redis::cmd("CLIENT")
        .arg("LIST")
        .query(own)
        .expect("CLIENT LIST");
    list.lines()
        .filter_map(|line| line.strip_prefix("id="))
        .filter_map(|rest| rest.split(' ').next()?.parse().ok())
        .filter(|id| *id != me)
        .collect()
}

/// `CONFIG SET maxclients n` on Redis.
fn max_clients(own: &mut ::redis::Connection, n: u32) {
    let _: () = ::redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxclients")
        .arg(n)
        .query(own)
        .expect("CONFIG SET maxclients");
}

/// `/readyz` answers for every worker's store connections: with `workers: 2` on Redis (one
/// connection a worker), each worker's connection in turn is cut off — killed, and Redis
/// refusing a new one (`maxclients`) — while the other's works: `/readyz` is 503 both times,
/// and 200 once the connection is back. (Asking worker 0's connection alone, it was 200 in the
/// round that cut worker 1's.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_fails_when_any_worker_loses_its_store_connection() {
    let env = Env::new(Backend::Redis).await;
    let mut own = env.redis().conn();
    let yaml = env.config("");
    assert!(yaml.contains("workers: 2\n"), "two workers: {yaml}");
    let proxy = env.proxy(&yaml).await;
    let admin = admin(&proxy).await;
    let readyz = format!("{}/readyz", admin.base);
    assert_eq!(get(readyz.clone(), None).await.status, 200);
    let first = other_clients(&mut own);
    assert_eq!(first.len(), 2, "one connection a worker: {first:?}");
    // Cut off each in turn: the first one, then the one that stayed up meanwhile.
    for cut in [first[0], first[1]] {
        // Only the test's connection and the other worker's: no room for a new one.
        max_clients(&mut own, 2);
        let _: () = ::redis::cmd("CLIENT")
            .arg("KILL")
            .arg("ID")
            .arg(cut)
            .query(&mut own)
            .expect("CLIENT KILL");
        let r = get(readyz.clone(), None).await;
        assert_eq!(r.status, 503, "connection {cut} cut off: {:?}", r.body);
        max_clients(&mut own, 10_000);
        let mut ready = false;
        for _ in 0..50 {
            if get(readyz.clone(), None).await.status == 200 {
                ready = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(ready, "ready again once Redis takes the connection back");
    }
    assert_eq!(
        other_clients(&mut own).len(),
        2,
        "both connections are back"
    );
    admin.stop().await;
    proxy.stop().await;
}
