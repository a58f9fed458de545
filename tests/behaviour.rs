//! SPEC §4.1–§4.3 on an idempotent route, each rule written once and run on every store
//! (`every_store!`: memory, sqlite, postgres, redis, redis-cluster).
//!
//! Every test counts what the upstream (the mock booking service) saw, compares replayed
//! responses byte for byte, and checks status, content type and problem type of every refusal.
//! What a store holds is checked from outside the proxy on every store that can be looked into
//! (all but memory: `Env::stored_keys`).

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::{Backend, Env, Reply, StoredKey, TestProxy, book, client, eventually, send};
use idemproxy::proxy::RecordLookup;
use reqwest::header::{HeaderName, HeaderValue};
use tokio::task::JoinHandle;

every_store!(
    // the sample
    first_request_is_forwarded_and_repeat_replayed,
    // §4.1 the key
    bare_and_quoted_forms_are_one_key,
    invalid_keys_are_refused_and_claim_nothing,
    longest_key_and_quoted_spaces_are_accepted,
    missing_key_on_required_route_is_400,
    missing_key_on_optional_route_is_plain_traffic,
    scope_headers_namespace_the_key,
    empty_scope_shares_keys_across_callers,
    same_key_on_two_routes_is_two_operations,
    store_key_is_prefix_route_and_hash_with_a_ttl,
    custom_key_prefix_is_honoured,
    // §4.2 outcomes
    replay_is_byte_identical,
    large_response_replays_byte_identical,
    repeat_in_flight_is_409_with_retry_after,
    on_conflict_wait_replays_the_first_response,
    on_conflict_wait_gives_409_after_wait_timeout,
    different_fingerprint_is_422_in_flight_and_finished,
    fingerprint_covers_path_and_query,
    body_over_max_request_body_is_413_and_claims_nothing,
    chunked_body_over_max_request_body_is_413,
    store_unreachable_with_reject_is_503,
    store_unreachable_with_forward_is_forwarded_and_counted,
    response_over_max_response_body_is_not_replayable,
    upstream_error_statuses_are_saved_and_replayed,
    retry_statuses_are_not_saved,
    custom_retry_statuses,
    hop_by_hop_response_headers_are_not_forwarded_or_replayed,
    set_cookie_is_not_replayed_by_default,
    set_cookie_is_replayed_with_replay_set_cookie,
    // §4.3 the upstream
    hop_by_hop_request_headers_removed_and_forwarded_headers_set,
    forwarded_for_without_incoming_header_is_the_client,
    forward_key_sends_the_key_as_received,
    forward_key_false_drops_the_key,
    passthrough_route_forwards_unchanged_and_streams,
    client_disconnect_does_not_cancel_the_operation,
    no_route_is_404,
    // concurrency
    fifty_duplicates_with_reject_run_once,
    fifty_duplicates_with_wait_run_once_and_replay,
);

// ---------------------------------------------------------------------------------------------
// Helpers local to this file.

const SEAT: &str = r#"{"seat":"12A"}"#;

/// `POST {proxy}{path}` with a key and a JSON body.
fn post(proxy: &TestProxy, path: &str, key: &str, body: &str) -> reqwest::RequestBuilder {
    client()
        .post(proxy.url(path))
        .header("Idempotency-Key", key)
        .header("Content-Type", "application/json")
        .body(body.to_owned())
}

/// Sends a request in a task of its own, so the test can act while it is in flight.
fn spawn_send(req: reqwest::RequestBuilder) -> JoinHandle<Reply> {
    tokio::spawn(send(req))
}

/// Waits until the mock has counted `n` requests carrying `key` (it counts them as soon as they
/// are read, so the proxy holds the claim by then).
async fn until_calls(env: &Env, key: &str, n: u64) {
    assert!(
        eventually(Duration::from_secs(5), || env.mock.calls(key) >= n).await,
        "the upstream never received {n} request(s) with key {key:?}"
    );
}

/// Asserts `again` is the replay of `first`: same status, headers and body bytes, plus
/// `Idempotent-Replayed: true` (which the first response does not carry).
fn assert_replay_of(first: &Reply, again: &Reply) {
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

/// Asserts a response is a first answer (not a replay) with `status`.
fn assert_fresh(reply: &Reply, status: u16) {
    assert_eq!(reply.status, status, "status; body: {:?}", reply.body);
    assert_eq!(
        reply.header("idempotent-replayed"),
        "",
        "not a replay; body: {:?}",
        reply.body
    );
}

/// Asserts the test's store holds no key (on a store that can be looked into).
fn assert_nothing_stored(env: &Env, what: &str) {
    if let Some(keys) = env.stored_key_names() {
        assert!(keys.is_empty(), "{what}: nothing claimed, found {keys:?}");
    }
}

/// The remaining time to live of a stored key (every key the proxy writes has one).
fn ttl_of(key: &StoredKey) -> Duration {
    key.ttl
        .unwrap_or_else(|| panic!("every store key has a TTL: {key:?}"))
}

/// A request with a chunked body (no Content-Length), sent with hyper's client since the
/// available reqwest has no streaming bodies.
async fn send_chunked(url: &str, key: &str, chunks: &[&'static [u8]]) -> Reply {
    use http_body_util::{BodyExt, StreamBody};
    use hyper::body::Frame;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    let frames: Vec<Result<Frame<Bytes>, std::convert::Infallible>> = chunks
        .iter()
        .map(|c| Ok(Frame::data(Bytes::from_static(c))))
        .collect();
    let body = StreamBody::new(futures_util::stream::iter(frames));
    let client = Client::builder(TokioExecutor::new()).build_http();
    let req = http::Request::post(url)
        .header("idempotency-key", key)
        .body(body)
        .expect("request");
    let resp = client.request(req).await.expect("chunked request failed");
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.expect("read body").to_bytes();
    Reply {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body,
    }
}

// ---------------------------------------------------------------------------------------------
// The sample.

async fn first_request_is_forwarded_and_repeat_replayed(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("")).await;
    let first = book(&proxy, "k-1", r#"{"seat":"12A"}"#).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    assert_eq!(first.header("idempotent-replayed"), "");
    let again = book(&proxy, "k-1", r#"{"seat":"12A"}"#).await;
    assert_eq!(again.status, 201);
    assert_eq!(again.body, first.body, "replayed body is byte-identical");
    assert_eq!(again.header("location"), first.header("location"));
    assert_eq!(again.header("idempotent-replayed"), "true");
    assert_eq!(
        env.mock.calls("k-1"),
        1,
        "the upstream ran the operation once"
    );
}

// ---------------------------------------------------------------------------------------------
// §4.1 The key.

async fn bare_and_quoted_forms_are_one_key(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("")).await;
    let key = "8e03978e-40d5-43e8-bc93-6894a57f9324";
    let quoted = format!("\"{key}\"");

    let first = book(&proxy, &quoted, SEAT).await;
    assert_fresh(&first, 201);
    let again = book(&proxy, key, SEAT).await;
    assert_replay_of(&first, &again);
    // And the other way round, on a second key.
    let first = book(&proxy, "k-2", SEAT).await;
    assert_fresh(&first, 201);
    let again = book(&proxy, "\"k-2\"", SEAT).await;
    assert_replay_of(&first, &again);

    assert_eq!(env.mock.total(), 2, "one upstream call per key");
    assert_eq!(env.mock.bookings(), 2);
}

async fn invalid_keys_are_refused_and_claim_nothing(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("")).await;
    let long = "a".repeat(256);
    let cases: Vec<(&str, Vec<HeaderValue>)> = vec![
        ("empty bare", vec![HeaderValue::from_static("")]),
        ("empty quoted", vec![HeaderValue::from_static("\"\"")]),
        (
            "256 chars",
            vec![HeaderValue::from_str(&long).expect("value")],
        ),
        (
            "256 chars quoted",
            vec![HeaderValue::from_str(&format!("\"{long}\"")).expect("value")],
        ),
        (
            "space in a bare key",
            vec![HeaderValue::from_static("abc def")],
        ),
        (
            "tab in a bare key",
            vec![HeaderValue::from_bytes(b"abc\tdef").expect("value")],
        ),
        (
            "non-ASCII bytes",
            vec![HeaderValue::from_bytes(b"k-\xc3\xa9").expect("value")],
        ),
        (
            "non-ASCII bytes quoted",
            vec![HeaderValue::from_bytes(b"\"k-\xc3\xa9\"").expect("value")],
        ),
        (
            "the header twice",
            vec![
                HeaderValue::from_static("dup-key"),
                HeaderValue::from_static("dup-key"),
            ],
        ),
        (
            "the header twice, different values",
            vec![
                HeaderValue::from_static("dup-key"),
                HeaderValue::from_static("other"),
            ],
        ),
    ];
    for (what, values) in cases {
        let mut req = client()
            .post(proxy.url("/bookings"))
            .header("Content-Type", "application/json")
            .body(SEAT);
        for v in values {
            req = req.header("Idempotency-Key", v);
        }
        let reply = send(req).await;
        assert_eq!(reply.status, 400, "{what}: {:?}", reply.body);
        reply.assert_problem(400, "invalid-idempotency-key");
    }
    assert_eq!(env.mock.total(), 0, "nothing forwarded");
    assert_nothing_stored(&env, "invalid keys");

    // The valid neighbours of those keys are first requests: nothing was claimed for them.
    for key in ["dup-key", "\"abc def\"", "k-", &long[..255]] {
        let reply = book(&proxy, key, SEAT).await;
        assert_fresh(&reply, 201);
        assert_eq!(env.mock.calls(key), 1, "{key} forwarded once");
    }
    assert_eq!(env.mock.total(), 4);
}

async fn longest_key_and_quoted_spaces_are_accepted(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("")).await;
    let longest: String = (0..255)
        .map(|i| char::from(0x21 + (i % 94) as u8))
        .collect();
    assert_eq!(longest.len(), 255);
    let first = book(&proxy, &longest, SEAT).await;
    assert_fresh(&first, 201);
    let again = book(&proxy, &longest, SEAT).await;
    assert_replay_of(&first, &again);

    // Quoted: 255 characters inside the quotes, spaces allowed.
    let inner = format!("a b{}", "x".repeat(252));
    let quoted = format!("\"{inner}\"");
    let first = book(&proxy, &quoted, SEAT).await;
    assert_fresh(&first, 201);
    let again = book(&proxy, &quoted, SEAT).await;
    assert_replay_of(&first, &again);
    assert_eq!(env.mock.total(), 2);
}

async fn missing_key_on_required_route_is_400(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("required: true")).await;
    let reply = send(
        client()
            .post(proxy.url("/bookings"))
            .header("Content-Type", "application/json")
            .body(SEAT),
    )
    .await;
    reply.assert_problem(400, "missing-idempotency-key");
    // The `pay` route requires a key by default.
    let reply = send(client().post(proxy.url("/pay/x")).body(SEAT)).await;
    reply.assert_problem(400, "missing-idempotency-key");
    assert_eq!(env.mock.total(), 0, "the upstream was not called");
}

async fn missing_key_on_optional_route_is_plain_traffic(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("required: false")).await;
    let req = || {
        client()
            .post(proxy.url("/bookings"))
            .header("Content-Type", "application/json")
            .body(SEAT)
    };
    let a = send(req()).await;
    assert_fresh(&a, 201);
    let b = send(req()).await;
    assert_fresh(&b, 201);
    assert_ne!(a.body, b.body, "two bookings, not a replay");
    assert_eq!(env.mock.total(), 2, "each one forwarded");
    assert_eq!(env.mock.bookings(), 2);

    // With a key, the optional route is still idempotent.
    let first = book(&proxy, "opt-1", SEAT).await;
    assert_fresh(&first, 201);
    let again = book(&proxy, "opt-1", SEAT).await;
    assert_replay_of(&first, &again);
    assert_eq!(env.mock.calls("opt-1"), 1);
}

async fn scope_headers_namespace_the_key(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("")).await;
    let as_caller =
        |auth: &str| post(&proxy, "/bookings", "shared", SEAT).header("Authorization", auth);

    let alice = send(as_caller("Bearer alice")).await;
    assert_fresh(&alice, 201);
    let bob = send(as_caller("Bearer bob")).await;
    assert_fresh(&bob, 201);
    assert_ne!(alice.body, bob.body, "two operations, two bookings");
    // No Authorization at all is a third caller.
    let anonymous = book(&proxy, "shared", SEAT).await;
    assert_fresh(&anonymous, 201);
    assert_eq!(env.mock.calls("shared"), 3);

    let alice_again = send(as_caller("Bearer alice")).await;
    assert_replay_of(&alice, &alice_again);
    let bob_again = send(as_caller("Bearer bob")).await;
    assert_replay_of(&bob, &bob_again);
    assert_eq!(env.mock.calls("shared"), 3, "repeats are replays");
}

async fn empty_scope_shares_keys_across_callers(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("scope: []")).await;
    let first =
        send(post(&proxy, "/bookings", "shared", SEAT).header("Authorization", "Bearer alice"))
            .await;
    assert_fresh(&first, 201);
    let other =
        send(post(&proxy, "/bookings", "shared", SEAT).header("Authorization", "Bearer bob")).await;
    assert_replay_of(&first, &other);
    let anonymous = book(&proxy, "shared", SEAT).await;
    assert_replay_of(&first, &anonymous);
    assert_eq!(env.mock.calls("shared"), 1);
}

async fn same_key_on_two_routes_is_two_operations(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("")).await;
    let booking = book(&proxy, "two-routes", SEAT).await;
    assert_fresh(&booking, 201);
    let payment = send(post(&proxy, "/pay/x", "two-routes", SEAT)).await;
    assert_fresh(&payment, 200);
    assert_eq!(env.mock.calls("two-routes"), 2, "two operations");

    let booking_again = book(&proxy, "two-routes", SEAT).await;
    assert_replay_of(&booking, &booking_again);
    let payment_again = send(post(&proxy, "/pay/x", "two-routes", SEAT)).await;
    assert_replay_of(&payment, &payment_again);
    assert_eq!(env.mock.calls("two-routes"), 2);
}

async fn store_key_is_prefix_route_and_hash_with_a_ttl(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("ttl: 1h")).await;
    let raw = "raw-key-visible-0123";

    // In flight: the claim already has a TTL (the lease).
    let slow = spawn_send(post(&proxy, "/bookings", raw, SEAT).header("X-Mock-Delay", "1500ms"));
    until_calls(&env, raw, 1).await;
    let expected = common::store_key(
        "idemproxy:",
        "create-booking",
        &[HeaderName::from_static("authorization")],
        &http::HeaderMap::new(),
        raw,
    );
    if backend != Backend::Memory {
        let keys = env.stored_keys();
        let names: Vec<&str> = keys.iter().map(|k| k.key.as_str()).collect();
        assert_eq!(
            names,
            vec![expected.as_str()],
            "one claim, under the store key"
        );
        let ttl = ttl_of(&keys[0]);
        assert!(
            !ttl.is_zero() && ttl <= Duration::from_secs(10),
            "an in-flight claim expires within lock_ttl: {ttl:?}"
        );
    }
    let first = slow.await.expect("request task");
    assert_fresh(&first, 201);

    let store_key = proxy
        .proxy
        .keys()
        .store_key(
            "create-booking",
            RecordLookup::Key(raw),
            &http::HeaderMap::new(),
        )
        .expect("an idempotent route");
    assert_eq!(store_key.text(), expected);
    let entry = proxy
        .proxy
        .store()
        .get(&store_key)
        .await
        .expect("store read");
    assert!(
        matches!(entry, Some(idemproxy::record::Record::Done { .. })),
        "the finished record lives under {expected}: {entry:?}"
    );
    let suffix = expected
        .strip_prefix("idemproxy:create-booking:")
        .expect("prefix + route + ':'");
    assert_eq!(suffix.len(), 64);
    assert!(suffix.bytes().all(|b| b.is_ascii_hexdigit()), "{suffix}");

    if backend != Backend::Memory {
        let keys = env.stored_keys();
        assert_eq!(keys.len(), 1, "{keys:?}");
        let key = &keys[0].key;
        let suffix = key
            .strip_prefix("idemproxy:create-booking:")
            .unwrap_or_else(|| panic!("store key {key} starts with prefix and route"));
        assert_eq!(suffix.len(), 64, "{key}");
        assert!(
            suffix
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
            "lowercase hex SHA-256: {key}"
        );
        assert!(!key.contains(raw), "the raw key is not in the store key");
        let ttl = ttl_of(&keys[0]);
        assert!(
            ttl > Duration::from_secs(3500) && ttl <= Duration::from_secs(3600),
            "a finished record expires after ttl (1h): {ttl:?}"
        );
        // Another route's records are apart under its own prefix.
        let pay = send(post(&proxy, "/pay/a", raw, SEAT)).await;
        assert_fresh(&pay, 200);
        let keys = env.stored_keys();
        let under = |prefix: &str| keys.iter().filter(|k| k.key.starts_with(prefix)).count();
        assert_eq!(under("idemproxy:pay:"), 1, "{keys:?}");
        assert_eq!(under("idemproxy:create-booking:"), 1, "{keys:?}");
        assert_eq!(keys.len(), 2, "{keys:?}");
        for key in &keys {
            assert!(!key.key.contains(raw), "the raw key is in no store key");
            assert!(!ttl_of(key).is_zero(), "every store key has a TTL: {key:?}");
        }
    }
}

async fn custom_key_prefix_is_honoured(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env
        .proxy(&env.config_with("", "key_prefix: \"shop:idem:\""))
        .await;
    let first = book(&proxy, "pfx", SEAT).await;
    assert_fresh(&first, 201);
    let again = book(&proxy, "pfx", SEAT).await;
    assert_replay_of(&first, &again);
    assert_eq!(env.mock.calls("pfx"), 1);

    let expected = common::store_key(
        "shop:idem:",
        "create-booking",
        &[HeaderName::from_static("authorization")],
        &http::HeaderMap::new(),
        "pfx",
    );
    assert!(expected.starts_with("shop:idem:create-booking:"));
    let store_key = proxy
        .proxy
        .keys()
        .store_key(
            "create-booking",
            RecordLookup::Key("pfx"),
            &http::HeaderMap::new(),
        )
        .expect("an idempotent route");
    assert_eq!(store_key.text(), expected);
    let entry = proxy
        .proxy
        .store()
        .get(&store_key)
        .await
        .expect("store read");
    assert!(entry.is_some(), "the record lives under {expected}");
    if let Some(keys) = env.stored_key_names() {
        assert_eq!(
            keys,
            vec![expected],
            "the one record, under the custom prefix only"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// §4.2 Outcomes.

/// A 64 KiB response (on Redis a staged record: written to a key of its own, then moved under
/// the record key) replays byte for byte, from one key that holds all of it with the route's
/// TTL: no staging key is left beside it.
async fn large_response_replays_byte_identical(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env
        .proxy(&env.config("ttl: 1h\nmax_response_body: 1MiB"))
        .await;
    let size = 64 * 1024;
    let req = || {
        post(&proxy, "/bookings", "large-1", SEAT)
            .header("X-Mock-Body-Size", size.to_string())
            .header("X-Mock-Header", "X-Custom: large")
    };
    let first = send(req()).await;
    assert_fresh(&first, 201);
    assert!(first.body[..] == idemproxy_mock::body_pattern(size)[..]);
    for _ in 0..2 {
        let again = send(req()).await;
        assert_replay_of(&first, &again);
        assert_eq!(again.header("x-custom"), "large");
        assert_eq!(again.header("content-length"), size.to_string());
    }
    assert_eq!(env.mock.calls("large-1"), 1, "run once");

    if backend != Backend::Memory {
        let keys = env.stored_keys();
        let expected = common::store_key(
            "idemproxy:",
            "create-booking",
            &[HeaderName::from_static("authorization")],
            &http::HeaderMap::new(),
            "large-1",
        );
        let names: Vec<&str> = keys.iter().map(|k| k.key.as_str()).collect();
        assert_eq!(names, [expected.as_str()], "the record key alone");
        let ttl = ttl_of(&keys[0]);
        assert!(
            ttl > Duration::from_secs(3500) && ttl <= Duration::from_secs(3600),
            "the record expires after ttl (1h): {ttl:?}"
        );
    }
}

async fn replay_is_byte_identical(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("")).await;
    let req = || {
        post(&proxy, "/bookings", "replay-1", SEAT)
            .header("X-Mock-Header", "X-Custom: one")
            .header("X-Mock-Header", "X-Custom: two")
            .header("X-Mock-Header", "Cache-Control: no-store")
    };
    let first = send(req()).await;
    assert_fresh(&first, 201);
    assert!(first.header("location").starts_with("/bookings/bk_"));
    assert!(!first.header("etag").is_empty());
    assert_eq!(first.header("content-type"), "application/json");
    assert!(first.header("x-booking-id").starts_with("bk_"));

    let again = send(req()).await;
    assert_replay_of(&first, &again);
    for name in [
        "location",
        "etag",
        "content-type",
        "x-booking-id",
        "cache-control",
    ] {
        assert_eq!(again.header(name), first.header(name), "{name}");
    }
    let custom: Vec<_> = again.headers.get_all("x-custom").iter().collect();
    assert_eq!(custom, ["one", "two"], "repeated custom header, in order");
    assert_eq!(
        again.header("content-length"),
        again.body.len().to_string(),
        "Content-Length follows the replayed body"
    );
    // A third time is the same replay again.
    let third = send(req()).await;
    assert_replay_of(&first, &third);
    assert_eq!(env.mock.calls("replay-1"), 1);
    assert_eq!(env.mock.bookings(), 1);
}

async fn repeat_in_flight_is_409_with_retry_after(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("on_conflict: reject")).await;
    let slow = spawn_send(post(&proxy, "/bookings", "busy", SEAT).header("X-Mock-Delay", "1500ms"));
    until_calls(&env, "busy", 1).await;

    let repeat = book(&proxy, "busy", SEAT).await;
    repeat.assert_problem(409, "request-in-progress");
    let retry_after = repeat.header("retry-after");
    let secs: u64 = retry_after
        .parse()
        .unwrap_or_else(|_| panic!("Retry-After is delay-seconds: {retry_after:?}"));
    assert!(secs >= 1, "{secs}");

    let first = slow.await.expect("request task");
    assert_fresh(&first, 201);
    let after = book(&proxy, "busy", SEAT).await;
    assert_replay_of(&first, &after);
    assert_eq!(env.mock.calls("busy"), 1, "the 409 forwarded nothing");
}

async fn on_conflict_wait_replays_the_first_response(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env
        .proxy(&env.config("on_conflict: wait\nwait_timeout: 5s"))
        .await;
    let slow =
        spawn_send(post(&proxy, "/bookings", "waited", SEAT).header("X-Mock-Delay", "600ms"));
    until_calls(&env, "waited", 1).await;

    let waiter = book(&proxy, "waited", SEAT).await;
    let first = slow.await.expect("request task");
    assert_fresh(&first, 201);
    assert_replay_of(&first, &waiter);
    assert_eq!(env.mock.calls("waited"), 1, "the waiter forwarded nothing");
}

async fn on_conflict_wait_gives_409_after_wait_timeout(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env
        .proxy(&env.config("on_conflict: wait\nwait_timeout: 300ms"))
        .await;
    let slow =
        spawn_send(post(&proxy, "/bookings", "too-slow", SEAT).header("X-Mock-Delay", "1500ms"));
    until_calls(&env, "too-slow", 1).await;

    let waiter = book(&proxy, "too-slow", SEAT).await;
    waiter.assert_problem(409, "request-in-progress");
    assert!(!waiter.header("retry-after").is_empty(), "Retry-After");

    let first = slow.await.expect("request task");
    assert_fresh(&first, 201);
    let after = book(&proxy, "too-slow", SEAT).await;
    assert_replay_of(&first, &after);
    assert_eq!(env.mock.calls("too-slow"), 1);
}

async fn different_fingerprint_is_422_in_flight_and_finished(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("")).await;
    let slow =
        spawn_send(post(&proxy, "/bookings", "mismatch", SEAT).header("X-Mock-Delay", "1500ms"));
    until_calls(&env, "mismatch", 1).await;

    let other = book(&proxy, "mismatch", r#"{"seat":"14C"}"#).await;
    other.assert_problem(422, "idempotency-key-reused");
    let first = slow.await.expect("request task");
    assert_fresh(&first, 201);
    let other = book(&proxy, "mismatch", r#"{"seat":"14C"}"#).await;
    other.assert_problem(422, "idempotency-key-reused");
    // The mismatch claimed nothing: the original is still replayed.
    let again = book(&proxy, "mismatch", SEAT).await;
    assert_replay_of(&first, &again);
    assert_eq!(env.mock.calls("mismatch"), 1, "no upstream call for a 422");
}

async fn fingerprint_covers_path_and_query(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("")).await;
    let first = send(post(&proxy, "/pay/a?x=1", "fp", SEAT)).await;
    assert_fresh(&first, 200);
    send(post(&proxy, "/pay/b?x=1", "fp", SEAT))
        .await
        .assert_problem(422, "idempotency-key-reused");
    send(post(&proxy, "/pay/a?x=2", "fp", SEAT))
        .await
        .assert_problem(422, "idempotency-key-reused");
    send(
        client()
            .put(proxy.url("/pay/a?x=1"))
            .header("Idempotency-Key", "fp")
            .body(SEAT),
    )
    .await
    .assert_problem(422, "idempotency-key-reused");
    let again = send(post(&proxy, "/pay/a?x=1", "fp", SEAT)).await;
    assert_replay_of(&first, &again);
    assert_eq!(env.mock.calls("fp"), 1);
}

async fn body_over_max_request_body_is_413_and_claims_nothing(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("max_request_body: 16")).await;
    let big = "x".repeat(17);
    let reply = book(&proxy, "big", &big).await;
    reply.assert_problem(413, "request-too-large");
    assert_eq!(env.mock.total(), 0, "nothing forwarded");
    assert_nothing_stored(&env, "a body over the bound");

    // The same key with a body that fits (exactly the limit) is a first request.
    let small = "y".repeat(16);
    let first = book(&proxy, "big", &small).await;
    assert_fresh(&first, 201);
    assert_eq!(env.mock.calls("big"), 1);
    let last = env.mock.last_request().expect("a request");
    assert_eq!(&last.body[..], small.as_bytes());
    let again = book(&proxy, "big", &small).await;
    assert_replay_of(&first, &again);
    assert_eq!(env.mock.calls("big"), 1);
}

async fn chunked_body_over_max_request_body_is_413(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("max_request_body: 16")).await;
    let url = proxy.url("/bookings");
    let reply = send_chunked(&url, "chunked", &[b"0123456", b"789abcd", b"efghijk"]).await;
    reply.assert_problem(413, "request-too-large");
    assert_eq!(env.mock.total(), 0, "nothing forwarded");
    assert_nothing_stored(&env, "a body over the bound");

    // A chunked body within the limit, same key: a first request, forwarded whole.
    let first = send_chunked(&url, "chunked", &[b"01234567", b"89abcdef"]).await;
    assert_fresh(&first, 201);
    let last = env.mock.last_request().expect("a request");
    assert_eq!(&last.body[..], b"0123456789abcdef");
    let again = send_chunked(&url, "chunked", &[b"0123", b"456789abcdef"]).await;
    assert_replay_of(&first, &again);
    assert_eq!(env.mock.calls("chunked"), 1);
}

/// The `store:` lines of a store [`break_store`] can break: memory holds one record at most.
fn breakable(backend: Backend) -> &'static str {
    if backend == Backend::Memory {
        "max_entries: 1"
    } else {
        ""
    }
}

/// Makes the store fail claims for new keys: memory (with [`breakable`]'s `max_entries: 1`) is
/// filled by one operation, which it goes on replaying; every other store has one finished
/// operation too, and is then cut off (`Env::make_store_unreachable`).
async fn break_store(env: &mut Env, proxy: &TestProxy) {
    let filler = book(proxy, "filler", SEAT).await;
    assert_fresh(&filler, 201);
    if env.backend != Backend::Memory {
        env.make_store_unreachable();
    }
}

async fn store_unreachable_with_reject_is_503(backend: Backend) {
    let mut env = Env::new(backend).await;
    let proxy = env
        .proxy(&env.config_with("on_store_error: reject", breakable(backend)))
        .await;
    break_store(&mut env, &proxy).await;
    let before = env.mock.total();
    let reply = book(&proxy, "no-store", SEAT).await;
    reply.assert_problem(503, "store-unavailable");
    assert_eq!(env.mock.calls("no-store"), 0, "upstream not called");
    assert_eq!(env.mock.total(), before);
    if backend == Backend::Memory {
        // A full memory store still replays what it holds.
        let again = book(&proxy, "filler", SEAT).await;
        assert_eq!(again.status, 201);
        assert_eq!(again.header("idempotent-replayed"), "true");
        assert_eq!(env.mock.calls("filler"), 1);
    }
}

async fn store_unreachable_with_forward_is_forwarded_and_counted(backend: Backend) {
    let mut env = Env::new(backend).await;
    let proxy = env
        .proxy(&env.config_with("on_store_error: forward", breakable(backend)))
        .await;
    break_store(&mut env, &proxy).await;
    let reply = book(&proxy, "unprotected", SEAT).await;
    assert_fresh(&reply, 201);
    assert!(reply.header("location").starts_with("/bookings/bk_"));
    assert_eq!(env.mock.calls("unprotected"), 1, "forwarded once");
    let metrics = proxy.metrics().encode();
    assert!(
        metrics.contains(r#"idemproxy_unprotected_requests_total{route="create-booking"} 1"#),
        "counted as unprotected:\n{metrics}"
    );
}

async fn response_over_max_response_body_is_not_replayable(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("max_response_body: 1KiB")).await;
    let req = || post(&proxy, "/bookings", "huge", SEAT).header("X-Mock-Body-Size", "200000");
    let first = send(req()).await;
    assert_fresh(&first, 201);
    assert_eq!(first.body.len(), 200_000);
    assert!(
        first.body[..] == idemproxy_mock::body_pattern(200_000)[..],
        "the first client gets the whole body"
    );
    let repeat = send(req()).await;
    let doc = repeat.assert_problem(409, "response-not-replayable");
    assert!(
        doc["detail"].as_str().is_some_and(|d| d.contains("201")),
        "{doc}"
    );
    assert_eq!(
        env.mock.calls("huge"),
        1,
        "the repeat did not call upstream"
    );

    // A response of exactly the limit is replayable.
    let req = || post(&proxy, "/bookings", "fits", SEAT).header("X-Mock-Body-Size", "1024");
    let first = send(req()).await;
    assert_fresh(&first, 201);
    let again = send(req()).await;
    assert_replay_of(&first, &again);
    assert_eq!(again.body.len(), 1024);
    assert_eq!(env.mock.calls("fits"), 1);
}

async fn upstream_error_statuses_are_saved_and_replayed(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("")).await;
    for status in [400u16, 404, 409, 422, 500, 502, 504] {
        let key = format!("status-{status}");
        let req =
            || post(&proxy, "/bookings", &key, SEAT).header("X-Mock-Status", status.to_string());
        let first = send(req()).await;
        assert_fresh(&first, status);
        let again = send(req()).await;
        assert_replay_of(&first, &again);
        assert_eq!(
            env.mock.calls(&key),
            1,
            "{status} is the operation's result"
        );
    }
}

async fn retry_statuses_are_not_saved(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("")).await;
    for status in [429u16, 503] {
        let key = format!("retry-{status}");
        let failing =
            || post(&proxy, "/bookings", &key, SEAT).header("X-Mock-Status", status.to_string());
        let first = send(failing()).await;
        assert_fresh(&first, status);
        let second = send(failing()).await;
        assert_fresh(&second, status);
        assert_eq!(first.body, second.body);
        assert_eq!(env.mock.calls(&key), 2, "{status} released the key");

        // The retry that succeeds is saved.
        let ok = book(&proxy, &key, SEAT).await;
        assert_fresh(&ok, 201);
        let again = book(&proxy, &key, SEAT).await;
        assert_replay_of(&ok, &again);
        assert_eq!(env.mock.calls(&key), 3);
    }
}

async fn custom_retry_statuses(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("retry_statuses: [500]")).await;
    let req = |key: &str, status: &str| {
        post(&proxy, "/bookings", key, SEAT).header("X-Mock-Status", status.to_owned())
    };
    assert_fresh(&send(req("c-500", "500")).await, 500);
    assert_fresh(&send(req("c-500", "500")).await, 500);
    assert_eq!(env.mock.calls("c-500"), 2, "500 is retried");

    let first = send(req("c-503", "503")).await;
    assert_fresh(&first, 503);
    let again = send(req("c-503", "503")).await;
    assert_replay_of(&first, &again);
    assert_eq!(
        env.mock.calls("c-503"),
        1,
        "503 is no longer a retry status"
    );
}

async fn hop_by_hop_response_headers_are_not_forwarded_or_replayed(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("")).await;
    let req = || {
        post(&proxy, "/bookings", "hop", SEAT)
            .header("X-Mock-Header", "Connection: x-foo")
            .header("X-Mock-Header", "X-Foo: secret")
            .header("X-Mock-Header", "Keep-Alive: timeout=5")
            .header("X-Mock-Header", "Proxy-Authenticate: Basic realm=\"up\"")
            .header("X-Mock-Header", "Transfer-Encoding: chunked")
            .header("X-Mock-Header", "Trailer: X-Checksum")
            .header("X-Mock-Header", "X-Kept: yes")
    };
    // Control: the upstream itself does send them.
    let direct = send(
        client()
            .post(format!("{}/bookings", env.mock.url()))
            .header("X-Mock-Header", "Connection: x-foo")
            .header("X-Mock-Header", "X-Foo: secret")
            .header("X-Mock-Header", "Keep-Alive: timeout=5")
            .header("X-Mock-Header", "Proxy-Authenticate: Basic realm=\"up\"")
            .header("X-Mock-Header", "Transfer-Encoding: chunked")
            .header("X-Mock-Header", "Trailer: X-Checksum"),
    )
    .await;
    for name in [
        "connection",
        "x-foo",
        "keep-alive",
        "proxy-authenticate",
        "transfer-encoding",
        "trailer",
    ] {
        assert!(direct.headers.get(name).is_some(), "the mock sends {name}");
    }

    let first = send(req()).await;
    let again = send(req()).await;
    for (what, reply) in [("first", &first), ("replay", &again)] {
        assert_eq!(reply.status, 201, "{what}");
        for name in [
            "x-foo",
            "keep-alive",
            "proxy-authenticate",
            "transfer-encoding",
            "trailer",
        ] {
            assert!(
                reply.headers.get(name).is_none(),
                "{what} carries {name}: {:?}",
                reply.headers
            );
        }
        assert!(
            !reply.header("connection").contains("x-foo"),
            "{what}: {:?}",
            reply.headers
        );
        assert_eq!(
            reply.header("x-kept"),
            "yes",
            "{what} keeps end-to-end headers"
        );
        assert_eq!(
            reply.header("content-length"),
            reply.body.len().to_string(),
            "{what}: Content-Length is the body's length"
        );
    }
    assert_replay_of(&first, &again);
    assert_eq!(env.mock.calls("hop"), 1);
}

async fn set_cookie_is_not_replayed_by_default(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("")).await;
    let req = || {
        post(&proxy, "/bookings", "cookie", SEAT).header("X-Mock-Set-Cookie", "session=abc; Path=/")
    };
    let first = send(req()).await;
    assert_fresh(&first, 201);
    assert_eq!(first.header("set-cookie"), "session=abc; Path=/");
    let again = send(req()).await;
    assert_eq!(again.header("idempotent-replayed"), "true");
    assert_eq!(again.body, first.body);
    assert!(
        again.headers.get("set-cookie").is_none(),
        "{:?}",
        again.headers
    );
    assert_eq!(again.header("location"), first.header("location"));
    assert_eq!(env.mock.calls("cookie"), 1);
}

async fn set_cookie_is_replayed_with_replay_set_cookie(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("replay_set_cookie: true")).await;
    let req = || {
        post(&proxy, "/bookings", "cookie", SEAT)
            .header("X-Mock-Set-Cookie", "session=abc; Path=/")
            .header("X-Mock-Set-Cookie", "theme=dark")
    };
    let first = send(req()).await;
    assert_fresh(&first, 201);
    let again = send(req()).await;
    assert_replay_of(&first, &again);
    let cookies: Vec<_> = again.headers.get_all("set-cookie").iter().collect();
    assert_eq!(cookies, ["session=abc; Path=/", "theme=dark"]);
    assert_eq!(env.mock.calls("cookie"), 1);
}

// ---------------------------------------------------------------------------------------------
// §4.3 The upstream.

async fn hop_by_hop_request_headers_removed_and_forwarded_headers_set(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("")).await;
    let hop_by_hop = [
        "connection",
        "x-secret",
        "keep-alive",
        "te",
        "trailer",
        "upgrade",
        "proxy-authorization",
        "proxy-connection",
    ];
    let with_hop_by_hop = |req: reqwest::RequestBuilder| {
        req.header("Connection", "x-secret")
            .header("X-Secret", "s3cret")
            .header("Keep-Alive", "timeout=5")
            .header("TE", "trailers")
            .header("Trailer", "X-Checksum")
            .header("Upgrade", "foo/2")
            .header("Proxy-Authorization", "Basic dXA6cHc=")
            .header("Proxy-Connection", "keep-alive")
    };
    // Control: sent straight to the upstream, they all arrive.
    let direct = send(with_hop_by_hop(
        client().post(format!("{}/echo/direct", env.mock.url())),
    ))
    .await;
    assert_eq!(direct.status, 200);
    let got = env.mock.last_request().expect("the upstream got a request");
    for name in hop_by_hop {
        assert!(got.headers.get(name).is_some(), "the client sends {name}");
    }

    let reply = send(with_hop_by_hop(
        post(&proxy, "/pay/echo", "hop-req", SEAT)
            .header("Host", "api.example.com")
            .header("X-Forwarded-For", "10.0.0.1")
            .header("X-End-To-End", "kept"),
    ))
    .await;
    assert_fresh(&reply, 200);
    let got = env.mock.last_request().expect("the upstream got a request");
    assert_eq!(got.uri.path(), "/pay/echo");
    for name in hop_by_hop {
        assert!(
            got.headers.get(name).is_none(),
            "{name} reached the upstream: {:?}",
            got.headers
        );
    }
    assert_eq!(got.headers["x-end-to-end"], "kept");
    assert_eq!(
        got.headers["x-forwarded-for"], "10.0.0.1, 127.0.0.1",
        "appended"
    );
    assert_eq!(got.headers["x-forwarded-proto"], "http");
    assert_eq!(got.headers["x-forwarded-host"], "api.example.com");
    assert_eq!(&got.body[..], SEAT.as_bytes());
}

async fn forwarded_for_without_incoming_header_is_the_client(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("")).await;
    // Idempotent route.
    let reply = send(post(&proxy, "/pay/echo", "xff", SEAT)).await;
    assert_fresh(&reply, 200);
    let got = env.mock.last_request().expect("a request");
    assert_eq!(got.headers["x-forwarded-for"], "127.0.0.1");
    assert_eq!(got.headers["x-forwarded-proto"], "http");
    assert_eq!(
        got.headers["x-forwarded-host"].as_bytes(),
        proxy.addr.to_string().as_bytes()
    );
    // Pass-through route, with a spoofed proto that must be overwritten.
    let reply = send(
        client()
            .get(proxy.url("/echo/x"))
            .header("X-Forwarded-Proto", "https")
            .header("Connection", "x-gone")
            .header("X-Gone", "1"),
    )
    .await;
    assert_eq!(reply.status, 200);
    let got = env.mock.last_request().expect("a request");
    assert_eq!(got.headers["x-forwarded-for"], "127.0.0.1");
    assert_eq!(got.headers["x-forwarded-proto"], "http");
    assert!(got.headers.get("x-gone").is_none());
    assert!(got.headers.get("connection").is_none());
}

async fn forward_key_sends_the_key_as_received(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("forward_key: true")).await;
    let reply = book(&proxy, "\"quoted-fwd\"", SEAT).await;
    assert_fresh(&reply, 201);
    let got = env.mock.last_request().expect("a request");
    assert_eq!(
        got.headers["idempotency-key"], "\"quoted-fwd\"",
        "quoted stays quoted"
    );
    assert_eq!(env.mock.calls("\"quoted-fwd\""), 1);

    let reply = book(&proxy, "bare-fwd", SEAT).await;
    assert_fresh(&reply, 201);
    let got = env.mock.last_request().expect("a request");
    assert_eq!(got.headers["idempotency-key"], "bare-fwd");
    assert_eq!(got.headers.get_all("idempotency-key").iter().count(), 1);
}

async fn forward_key_false_drops_the_key(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("forward_key: false")).await;
    let first = book(&proxy, "hidden", SEAT).await;
    assert_fresh(&first, 201);
    let got = env.mock.last_request().expect("a request");
    assert!(
        got.headers.get("idempotency-key").is_none(),
        "{:?}",
        got.headers
    );
    assert_eq!(env.mock.total(), 1);
    assert_eq!(env.mock.calls("hidden"), 0);
    // Still idempotent.
    let again = book(&proxy, "hidden", SEAT).await;
    assert_replay_of(&first, &again);
    assert_eq!(env.mock.total(), 1);
}

async fn passthrough_route_forwards_unchanged_and_streams(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("")).await;
    let body = "raw\nbody \u{e9} {not json";
    let req = || {
        client()
            .put(proxy.url("/anything/a%20b?x=1&y=%2F&z"))
            .header("Idempotency-Key", "ignored-here")
            .header("X-Custom", "v")
            .body(body)
    };
    let first = send(req()).await;
    assert_fresh(&first, 200);
    let got = env.mock.last_request().expect("a request");
    assert_eq!(got.method, http::Method::PUT);
    assert_eq!(got.uri.path(), "/anything/a%20b");
    assert_eq!(got.uri.query(), Some("x=1&y=%2F&z"));
    assert_eq!(&got.body[..], body.as_bytes());
    assert_eq!(got.headers["x-custom"], "v");
    assert_eq!(got.headers["idempotency-key"], "ignored-here");
    let second = send(req()).await;
    assert_fresh(&second, 200);
    assert_eq!(
        env.mock.calls("ignored-here"),
        2,
        "no idempotency on a pass-through route"
    );

    // Other methods and a large body, whole.
    let big = send(
        client()
            .delete(proxy.url("/anything/big"))
            .header("X-Mock-Body-Size", "3000000"),
    )
    .await;
    assert_eq!(big.status, 200);
    assert_eq!(
        env.mock.last_request().expect("a request").method,
        http::Method::DELETE
    );
    assert!(big.body[..] == idemproxy_mock::body_pattern(3_000_000)[..]);

    // Streamed, not buffered: a body cut short upstream reaches the client as a 200 head and a
    // broken body (a buffering proxy would have answered 502).
    let resp = client()
        .get(proxy.url("/anything/partial"))
        .header("X-Mock-Partial", "true")
        .header("X-Mock-Body-Size", "100000")
        .send()
        .await
        .expect("the head arrives");
    assert_eq!(resp.status(), 200);
    assert!(resp.bytes().await.is_err(), "the body is cut short");
}

async fn client_disconnect_does_not_cancel_the_operation(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("")).await;
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(200))
        .build()
        .expect("client");
    let result = impatient
        .post(proxy.url("/bookings"))
        .header("Idempotency-Key", "gone")
        .header("X-Mock-Delay", "1s")
        .body(SEAT)
        .send()
        .await;
    assert!(result.is_err(), "the client gave up: {result:?}");
    until_calls(&env, "gone", 1).await;

    // Retry until the operation has finished (409 meanwhile), bounded.
    let mut retry = None;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let reply = book(&proxy, "gone", SEAT).await;
        if reply.status == 409 {
            reply.assert_problem(409, "request-in-progress");
            continue;
        }
        retry = Some(reply);
        break;
    }
    let retry = retry.expect("the operation finished within 5s");
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert_eq!(
        retry.header("idempotent-replayed"),
        "true",
        "the saved result is replayed"
    );
    assert!(retry.header("location").starts_with("/bookings/bk_"));
    assert_eq!(env.mock.calls("gone"), 1);
    assert_eq!(env.mock.bookings(), 1);
}

async fn no_route_is_404(backend: Backend) {
    let env = Env::new(backend).await;
    let yaml = format!(
        "listen: 127.0.0.1:0\n{store}upstreams:\n  booking:\n    url: {up}\nroutes:\n  - name: create-booking\n    methods: [POST]\n    path: /bookings\n    upstream: booking\n    idempotency:\n      required: true\n",
        store = env.store_yaml(""),
        up = env.mock.url(),
    );
    let proxy = env.proxy(&yaml).await;
    send(client().get(proxy.url("/other")))
        .await
        .assert_problem(404, "no-route");
    send(
        client()
            .get(proxy.url("/bookings"))
            .header("Idempotency-Key", "k"),
    )
    .await
    .assert_problem(404, "no-route");
    send(
        client()
            .post(proxy.url("/bookings/1"))
            .header("Idempotency-Key", "k"),
    )
    .await
    .assert_problem(404, "no-route");
    assert_eq!(env.mock.total(), 0);
    assert_fresh(&book(&proxy, "k", SEAT).await, 201);
}

// ---------------------------------------------------------------------------------------------
// Concurrency.

/// A generous store deadline: these tests are about concurrency, not about a slow store (a
/// claim that times out is a 503 by design, SPEC §4.5). Shorter than the 2s lease of the
/// harness's `pay` route, as every store deadline must be.
const FIFTY_STORE: &str = "timeout: 1500ms";

/// How many answers had each status, with the problem type of refusals.
fn summary(replies: &[Reply]) -> std::collections::BTreeMap<String, usize> {
    let mut counts = std::collections::BTreeMap::new();
    for r in replies {
        let kind = match serde_json::from_slice::<serde_json::Value>(&r.body) {
            Ok(doc) if doc["type"].is_string() => format!("{} {}", r.status, doc["type"]),
            _ => format!(
                "{} replayed={:?}",
                r.status,
                r.header("idempotent-replayed")
            ),
        };
        *counts.entry(kind).or_insert(0) += 1;
    }
    counts
}

/// Sends 50 identical requests at once (same key, same body) against an upstream that takes 1s,
/// so that every duplicate arrives while the first is in flight even on a loaded machine.
async fn fifty_at_once(proxy: &TestProxy, key: &str) -> Vec<Reply> {
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(50));
    let tasks: Vec<JoinHandle<Reply>> = (0..50)
        .map(|_| {
            let req = post(proxy, "/bookings", key, SEAT).header("X-Mock-Delay", "1s");
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                send(req).await
            })
        })
        .collect();
    let mut replies = Vec::with_capacity(50);
    for t in tasks {
        replies.push(t.await.expect("request task"));
    }
    replies
}

async fn fifty_duplicates_with_reject_run_once(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env
        .proxy(&env.config_with("on_conflict: reject", FIFTY_STORE))
        .await;
    let replies = fifty_at_once(&proxy, "fifty").await;
    assert_eq!(
        env.mock.bookings(),
        1,
        "exactly one booking; answers: {:?}",
        summary(&replies)
    );
    assert_eq!(env.mock.calls("fifty"), 1);
    let (created, others): (Vec<&Reply>, Vec<&Reply>) =
        replies.iter().partition(|r| r.status == 201);
    assert_eq!(created.len(), 1, "one forwarded answer");
    assert_fresh(created[0], 201);
    assert_eq!(others.len(), 49);
    for r in others {
        r.assert_problem(409, "request-in-progress");
    }
}

async fn fifty_duplicates_with_wait_run_once_and_replay(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env
        .proxy(&env.config_with("on_conflict: wait\nwait_timeout: 5s", FIFTY_STORE))
        .await;
    let replies = fifty_at_once(&proxy, "fifty").await;
    assert_eq!(
        env.mock.bookings(),
        1,
        "exactly one booking; answers: {:?}",
        summary(&replies)
    );
    assert_eq!(env.mock.calls("fifty"), 1);
    let (fresh, replayed): (Vec<&Reply>, Vec<&Reply>) = replies
        .iter()
        .partition(|r| r.header("idempotent-replayed").is_empty());
    assert_eq!(fresh.len(), 1, "one forwarded answer");
    assert_fresh(fresh[0], 201);
    assert_eq!(replayed.len(), 49);
    for r in replayed {
        assert_replay_of(fresh[0], r);
    }
}
