//! Graceful shutdown (SPEC §2): SIGTERM lets the request in flight finish and its result be saved
//! before the process exits, and a second stop signal exits at once.

use harness::{Backend, Env, ProxyProcess, Reply, TestProxy, book_with, client, eventually, send};
use std::time::Duration;

/// The request body every booking here sends (the fingerprint covers it, not the headers).
const BODY: &str = r#"{"seat":"12A"}"#;

/// The proxy's base URL.
fn base(proxy: &TestProxy) -> String {
    proxy.url("")
}

/// Asserts `r` came from the upstream now (not a replay) with a new booking.
fn assert_forwarded(r: &Reply) {
    assert_eq!(r.status, 201, "forwarded; body: {:?}", r.body);
    assert_eq!(r.header("idempotent-replayed"), "", "not a replay");
}

/// Asserts `r` is a replay of `first`: same status, byte-identical body, marked replayed.
fn assert_replay_status_and_body(r: &Reply, first: &Reply) {
    assert_eq!(
        r.status, first.status,
        "replayed status; body: {:?}",
        r.body
    );
    assert_eq!(r.header("idempotent-replayed"), "true", "replay marker");
    assert_eq!(r.body, first.body, "replayed body is byte-identical");
}

// ---------------------------------------------------------------------------------------------
// Shutdown
// ---------------------------------------------------------------------------------------------

/// SIGTERM with a request in flight: no new connections, the request completes with its 201,
/// its result is saved, the process exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_sigterm_finishes_and_saves_the_request_in_flight() {
    let env = Env::new(Backend::Redis).await;
    let yaml = env.config("");
    let mut p = ProxyProcess::spawn(&yaml);
    let addr = p.addr;
    let in_flight = {
        let url = p.url("");
        tokio::spawn(
            async move { book_with(&url, "term-1", BODY, &[("X-Mock-Delay", "1s")]).await },
        )
    };
    assert!(
        eventually(Duration::from_secs(5), || env.mock.calls("term-1") == 1).await,
        "the request reached the upstream"
    );
    p.signal("-TERM");

    let refused = eventually(Duration::from_secs(2), || {
        std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_err()
    })
    .await;
    assert!(refused, "new connections are still accepted after SIGTERM");
    assert!(
        !in_flight.is_finished(),
        "the listener closed while the request was still in flight"
    );

    let first = in_flight.await.expect("request in flight");
    assert_forwarded(&first);
    let code = p.wait(Duration::from_secs(5));
    assert_eq!(code, Some(0), "exit code; log:\n{}", p.log());

    let proxy = env.proxy(&yaml).await;
    let again = book_with(&base(&proxy), "term-1", BODY, &[]).await;
    assert_replay_status_and_body(&again, &first);
    assert_eq!(env.mock.calls("term-1"), 1, "its result was saved");
}

/// The first SIGTERM drains requests in flight; a second one ends the process at once
/// (exit code 130) instead of waiting out `shutdown_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_stop_signal_exits_without_waiting() {
    let env = Env::new(Backend::Memory).await;
    let yaml = env
        .config("")
        .replace("shutdown_timeout: 10s", "shutdown_timeout: 60s");
    let mut proxy = harness::ProxyProcess::spawn(&yaml);
    let slow = tokio::spawn(send(
        client()
            .post(proxy.url("/bookings"))
            .header("Idempotency-Key", "slow")
            .header("X-Mock-Delay", "20s")
            .body("{}"),
    ));
    assert!(
        harness::eventually(std::time::Duration::from_secs(5), || env.mock.calls("slow")
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
