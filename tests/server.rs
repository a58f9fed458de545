//! The listener and the store wiring: HTTP/2 cleartext, request head limits, and Lua scripts
//! that Redis forgot.

mod common;

use common::{Backend, Env, book, client, send};

every_store!(h2c_clients_get_forwarding_and_replays);

/// The auto builder serves HTTP/2 with prior knowledge (h2c) next to HTTP/1.1.
async fn h2c_clients_get_forwarding_and_replays(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("")).await;
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .expect("h2c client");
    let post = || {
        h2.post(proxy.url("/bookings"))
            .header("Idempotency-Key", "h2-key")
            .body(r#"{"seat":"1A"}"#)
    };
    let first = send(post()).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    let again = send(post()).await;
    assert_eq!(again.status, 201);
    assert_eq!(again.header("idempotent-replayed"), "true");
    assert_eq!(again.body, first.body);
    assert_eq!(env.mock.calls("h2-key"), 1);
    // And an HTTP/1.1 client sees the same record.
    let h1 = book(&proxy, "h2-key", r#"{"seat":"1A"}"#).await;
    assert_eq!(h1.body, first.body);
    assert_eq!(h1.header("idempotent-replayed"), "true");
}

#[tokio::test]
async fn too_many_or_too_large_request_headers_are_refused_before_anything_runs() {
    let env = Env::new(Backend::Memory).await;
    let proxy = env.proxy(&env.config("")).await;

    let mut many = client()
        .post(proxy.url("/bookings"))
        .header("Idempotency-Key", "many-headers");
    for i in 0..150 {
        many = many.header(format!("x-filler-{i}"), "1");
    }
    let refused = many.send().await.expect("an answer");
    assert_eq!(refused.status().as_u16(), 431, "too many headers");

    let huge = "v".repeat(100 * 1024);
    let refused = client()
        .post(proxy.url("/bookings"))
        .header("Idempotency-Key", "huge-header")
        .header("x-huge", huge)
        .send()
        .await
        .expect("an answer");
    assert_eq!(refused.status().as_u16(), 431, "a 100 KiB header");
    assert_eq!(env.mock.total(), 0, "nothing reached the upstream");

    // The proxy still serves normal requests afterwards.
    let ok = book(&proxy, "after-limits", "{}").await;
    assert_eq!(ok.status, 201);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_scripts_are_reloaded_after_script_flush() {
    let env = Env::new(Backend::Redis).await;
    let proxy = env.proxy(&env.config("")).await;
    let first = book(&proxy, "before-flush", "{}").await;
    assert_eq!(first.status, 201);

    // Redis forgets every cached script (as after a restart or failover with the same data).
    let mut conn = env.redis().conn();
    let flushed: String = ::redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut conn)
        .expect("SCRIPT FLUSH");
    assert_eq!(flushed, "OK");

    // Completing needs the compare-and-set script: EVALSHA fails with NOSCRIPT and the script
    // is loaded again. The replay proves the result was saved.
    let second = book(&proxy, "after-flush", "{}").await;
    assert_eq!(second.status, 201, "{:?}", second.body);
    let replay = book(&proxy, "after-flush", "{}").await;
    assert_eq!(replay.header("idempotent-replayed"), "true");
    assert_eq!(replay.body, second.body);
    assert_eq!(env.mock.calls("after-flush"), 1);
}

/// An upstream that sends a response head and part of the body, then stalls for good.
async fn stalling_upstream() -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        // Bounded: the test makes one request.
        for _ in 0..4 {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = sock.read(&mut buf).await;
                let _ = sock
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789")
                    .await;
                tokio::time::sleep(std::time::Duration::from_secs(10)).await;
            });
        }
    });
    addr
}

/// `upstreams.*.timeout` bounds the whole response on pass-through routes too: a body that
/// stalls is cut off at the deadline instead of holding the client forever.
#[tokio::test]
async fn a_stalled_passthrough_body_is_cut_off_at_the_upstream_timeout() {
    let up = stalling_upstream().await;
    let yaml = format!(
        "listen: 127.0.0.1:0\nupstreams:\n  slow:\n    url: http://{up}\n    connect_timeout: 200ms\n    timeout: 500ms\nroutes:\n  - name: rest\n    path: /*\n    upstream: slow\n"
    );
    let proxy = common::TestProxy::start(&yaml).await;
    let started = std::time::Instant::now();
    let resp = client()
        .get(proxy.url("/stream"))
        .send()
        .await
        .expect("the head arrives");
    assert_eq!(resp.status().as_u16(), 200);
    let body = resp.bytes().await;
    assert!(body.is_err(), "the body must fail, not complete: {body:?}");
    let took = started.elapsed();
    assert!(
        took < std::time::Duration::from_secs(5),
        "cut off near the 500ms timeout, not after the upstream's 10s stall: {took:?}"
    );
}

/// The first SIGTERM drains requests in flight; a second one ends the process at once
/// (exit code 130) instead of waiting out `shutdown_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_stop_signal_exits_without_waiting() {
    let env = Env::new(Backend::Memory).await;
    let yaml = env
        .config("")
        .replace("shutdown_timeout: 10s", "shutdown_timeout: 60s");
    let mut proxy = common::ProxyProcess::spawn(&yaml);
    let slow = tokio::spawn(send(
        client()
            .post(proxy.url("/bookings"))
            .header("Idempotency-Key", "slow")
            .header("X-Mock-Delay", "20s")
            .body("{}"),
    ));
    assert!(
        common::eventually(std::time::Duration::from_secs(5), || env.mock.calls("slow")
            == 1)
        .await,
        "the slow request reached the upstream"
    );
    proxy.signal("-TERM");
    // Still draining: the first signal alone does not end the process.
    assert_eq!(proxy.wait(std::time::Duration::from_millis(500)), None);
    proxy.signal("-TERM");
    assert_eq!(
        proxy.wait(std::time::Duration::from_secs(5)),
        Some(130),
        "log: {}",
        proxy.log()
    );
    slow.abort();
}
