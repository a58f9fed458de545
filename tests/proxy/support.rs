//! Helpers several modules share.

use harness::{Env, Reply, StoredKey, TestProxy, book_with, client, eventually};
use std::time::Duration;

/// The request body every booking here sends.
pub(crate) const BODY: &str = r#"{"seat":"12A"}"#;

pub(crate) const SEAT: &str = r#"{"seat":"12A"}"#;

/// Asserts `r` came from the upstream now (not a replay) with a new booking.
pub(crate) fn assert_forwarded(r: &Reply) {
    assert_eq!(r.status, 201, "forwarded; body: {:?}", r.body);
    assert_eq!(r.header("idempotent-replayed"), "", "not a replay");
}

/// Asserts a response is a first answer (not a replay) with `status`.
pub(crate) fn assert_fresh(reply: &Reply, status: u16) {
    assert_eq!(reply.status, status, "status; body: {:?}", reply.body);
    assert_eq!(
        reply.header("idempotent-replayed"),
        "",
        "not a replay; body: {:?}",
        reply.body
    );
}

/// Asserts the test's store holds no key (on a store that can be looked into).
pub(crate) fn assert_nothing_stored(env: &Env, what: &str) {
    if let Some(keys) = env.stored_key_names() {
        assert!(keys.is_empty(), "{what}: nothing claimed, found {keys:?}");
    }
}

/// Asserts `again` is the replay of `first`: same status, headers and body bytes, plus
/// `Idempotent-Replayed: true` (which the first response does not carry).
pub(crate) fn assert_replay_of(first: &Reply, again: &Reply) {
    assert_eq!(
        first.header("idempotent-replayed"),
        "",
        "a first response is not a replay"
    );
    assert_eq!(again.header("idempotent-replayed"), "true", "replay marker");
    assert_eq!(again.status, first.status, "replayed status");
    assert_eq!(again.body, first.body, "replayed body is byte-identical");
    assert_eq!(
        again.header_lines(),
        first.header_lines(),
        "replayed headers are the first response's"
    );
}

/// Asserts `r` is a replay of `first`: same status, byte-identical body, marked replayed.
pub(crate) fn assert_replay_status_and_body(r: &Reply, first: &Reply) {
    assert_eq!(
        r.status, first.status,
        "replayed status; body: {:?}",
        r.body
    );
    assert_eq!(r.header("idempotent-replayed"), "true", "replay marker");
    assert_eq!(r.body, first.body, "replayed body is byte-identical");
}

/// The proxy's base URL.
pub(crate) fn base(proxy: &TestProxy) -> String {
    proxy.url("")
}

/// `POST {proxy}{path}` with a key and a JSON body.
pub(crate) fn post(
    proxy: &TestProxy,
    path: &str,
    key: &str,
    body: &str,
) -> reqwest::RequestBuilder {
    client()
        .post(proxy.url(path))
        .header("Idempotency-Key", key)
        .header("Content-Type", "application/json")
        .body(body.to_owned())
}

pub(crate) async fn post_booking(proxy: &TestProxy, key: &str, extra: &[(&str, &str)]) -> Reply {
    book_with(&proxy.url(""), key, BODY, extra).await
}

/// The remaining time to live of a stored key (every key the proxy writes has one).
pub(crate) fn ttl_of(key: &StoredKey) -> Duration {
    key.ttl
        .unwrap_or_else(|| panic!("every store key has a TTL: {key:?}"))
}

/// Waits until the mock has counted `n` requests carrying `key` (it counts them as soon as they
/// are read, so the proxy holds the claim by then).
pub(crate) async fn until_calls(env: &Env, key: &str, n: u64) {
    assert!(
        eventually(Duration::from_secs(5), || env.mock.calls(key) >= n).await,
        "the upstream never received {n} request(s) with key {key:?}"
    );
}
