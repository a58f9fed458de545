//! Claiming a key (SPEC §4.1, §4.2): what a key is and what it is scoped to, the store key it
//! becomes, a repeat while the first request runs (`409`, or waiting under `on_conflict: wait`),
//! a key reused for another request (`422`), a store that cannot be reached at claim time, a
//! claim answered too late, and many duplicates at once — in one process or in two.

use crate::support::{
    BODY, SEAT, assert_fresh, assert_nothing_stored, assert_replay_of,
    assert_replay_status_and_body, base, post, ttl_of, until_calls,
};
use async_trait::async_trait;
use bytes::Bytes;
use harness::every_store;
use harness::{
    Backend, Env, Reply, TestProxy, book, book_with, client, eventually, send, spawn_booking,
};
use idemproxy::config::Config;
use idemproxy::metrics::{Metrics, Outcome};
use idemproxy::proxy::{Proxy, RecordName};
use idemproxy::store::memory::MemoryStore;
use idemproxy::store::{Held, Store, StoreError, StoreHandle, StoreKey, Wrap};
use reqwest::header::{HeaderName, HeaderValue};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;
use tokio::task::JoinHandle;

every_store!(
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
    repeat_in_flight_is_409_with_retry_after,
    on_conflict_wait_replays_the_first_response,
    on_conflict_wait_gives_409_after_wait_timeout,
    different_fingerprint_is_422_in_flight_and_finished,
    fingerprint_covers_path_and_query,
    store_unreachable_with_reject_is_503,
    store_unreachable_with_forward_is_forwarded_and_counted,
    fifty_duplicates_with_reject_run_once,
    fifty_duplicates_with_wait_run_once_and_replay,
);

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

/// Sends a request in a task of its own, so the test can act while it is in flight.
fn spawn_send(req: reqwest::RequestBuilder) -> JoinHandle<Reply> {
    tokio::spawn(send(req))
}

async fn store_key_is_prefix_route_and_hash_with_a_ttl(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("ttl: 1h")).await;
    let raw = "raw-key-visible-0123";

    // In flight: the claim already has a TTL (the lease).
    let slow = spawn_send(post(&proxy, "/bookings", raw, SEAT).header("X-Mock-Delay", "1500ms"));
    until_calls(&env, raw, 1).await;
    let expected = harness::store_key(
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
            RecordName::Key(raw),
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
        matches!(entry, Some(idemproxy::record::Record::Finished { .. })),
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

    let expected = harness::store_key(
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
            RecordName::Key("pfx"),
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

// ---------------------------------------------------------------------------------------------
// Concurrency.

/// A generous store deadline: these tests are about concurrency, not about a slow store (a
/// claim that times out is a 503 by design, SPEC §4.5). Shorter than the 2s lease of the
/// harness's `pay` route, as every store deadline must be.
const FIFTY_STORE: &str = "timeout: 1500ms";

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

// ---------------------------------------------------------------------------------------------
// §4.5 A request that has seen its key held never forwards on a store error
// ---------------------------------------------------------------------------------------------

/// `on_conflict: wait` with `on_store_error: forward`: the second request sees the key in
/// flight and waits; Redis stops answering while it polls. The operation is already running, so
/// the waiter must answer 503, never forward (before the fix it was forwarded: two bookings).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_waiter_that_saw_the_key_held_answers_503_on_a_store_error() {
    let env = Env::new(Backend::Redis).await;
    let proxy = env
        .proxy(
            &env.config(
                "on_conflict: wait\nwait_timeout: 5s\non_store_error: forward\nlock_ttl: 10s",
            ),
        )
        .await;
    let key = "waiter-store-error";
    let first = spawn_booking(proxy.url(""), key, BODY, "2500ms");
    assert!(
        eventually(Duration::from_secs(3), || env.mock.calls(key) == 1).await,
        "the first request reached the upstream"
    );
    let claims = || {
        proxy.metric(
            "idemproxy_store_operation_duration_seconds_count",
            &[("op", "claim")],
        ) as u64
    };
    let before = claims();
    let second = spawn_booking(proxy.url(""), key, BODY, "2500ms");
    // Once the second one has seen the claim (its first try done) and waits, stall Redis past
    // the store timeout (300ms) so that its next poll fails.
    assert!(
        eventually(Duration::from_secs(3), || claims() > before).await,
        "the second request tried its claim"
    );
    env.redis().pause();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    env.redis().resume();

    let second = second.await.expect("second request");
    second.assert_problem(503, "store-unavailable");
    let first = first.await.expect("first request");
    assert_eq!(first.status, 201, "the first one ran: {:?}", first.body);
    assert_eq!(env.mock.calls(key), 1, "the waiter was never forwarded");
    assert_eq!(proxy.requests("create-booking", Outcome::StoreError), 1);
}

/// A waiter (`on_conflict: wait`) whose client left stops polling the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_waiters_stop_polling_when_their_client_is_gone() {
    let env = Env::new(Backend::Redis).await;
    let proxy = env
        .proxy(&env.config("on_conflict: wait\nwait_timeout: 10s"))
        .await;
    let key = "abandoned-wait";
    let first = spawn_booking(proxy.url(""), key, BODY, "3s");
    assert!(eventually(Duration::from_secs(3), || env.mock.calls(key) == 1).await);
    let quick = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .expect("client");
    let mut waiters = Vec::new();
    for _ in 0..20 {
        let req = quick
            .post(proxy.url("/bookings"))
            .header("Idempotency-Key", key)
            .header("X-Mock-Delay", "3s")
            .body(BODY);
        waiters.push(tokio::spawn(async move { req.send().await.is_err() }));
    }
    for w in waiters {
        assert!(w.await.expect("waiter"), "the waiter's client gave up");
    }
    // The harness's reader fails on a missing series, never reads it as 0.
    let claims = || {
        proxy.metric(
            "idemproxy_store_operation_duration_seconds_count",
            &[("op", "claim")],
        ) as u64
    };
    // Each waiter may finish the poll it was in; after that, nothing.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let settled = claims();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(claims(), settled, "no more polling after the clients left");
    assert_eq!(first.await.expect("first").status, 201);
    assert_eq!(env.mock.calls(key), 1);
}

// ---------------------------------------------------------------------------------------------
// Several instances on one Redis
// ---------------------------------------------------------------------------------------------

/// Sends 50 identical requests at once, alternating between `a` and `b`.
async fn fifty_duplicates(a: &TestProxy, b: &TestProxy, key: &'static str) -> Vec<Reply> {
    let bases = [base(a), base(b)];
    let tasks: Vec<_> = (0..50)
        .map(|i| {
            let base = bases[i % 2].clone();
            tokio::spawn(
                async move { book_with(&base, key, BODY, &[("X-Mock-Delay", "500ms")]).await },
            )
        })
        .collect();
    let mut replies = Vec::with_capacity(tasks.len());
    for t in tasks {
        replies.push(t.await.expect("request"));
    }
    replies
}

/// The one reply that came from the upstream.
fn the_original(replies: &[Reply]) -> Reply {
    let originals: Vec<&Reply> = replies
        .iter()
        .filter(|r| r.status == 201 && r.header("idempotent-replayed").is_empty())
        .collect();
    assert_eq!(originals.len(), 1, "exactly one forwarded answer");
    originals[0].clone()
}

/// Two instances, `on_conflict: reject`: one booking; every other answer a 409 or a
/// byte-identical replay; a later repeat through either instance replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_two_instances_fifty_duplicates_one_booking() {
    let env = Env::new(Backend::Redis).await;
    let yaml = env.config("");
    let a = env.proxy(&yaml).await;
    let b = env.proxy(&yaml).await;
    let replies = fifty_duplicates(&a, &b, "multi-1").await;
    let original = the_original(&replies);
    for r in &replies {
        match r.status {
            201 if r.header("idempotent-replayed").is_empty() => {}
            201 => assert_replay_status_and_body(r, &original),
            _ => {
                r.assert_problem(409, "request-in-progress");
            }
        }
    }
    assert_eq!(env.mock.calls("multi-1"), 1, "exactly one booking");
    for p in [&a, &b] {
        let r = book_with(&base(p), "multi-1", BODY, &[]).await;
        assert_replay_status_and_body(&r, &original);
        assert_eq!(r.header("location"), original.header("location"));
    }
    assert_eq!(env.mock.calls("multi-1"), 1);
    let conflicts = a.requests("create-booking", Outcome::Conflict)
        + b.requests("create-booking", Outcome::Conflict);
    assert_eq!(
        conflicts,
        replies.iter().filter(|r| r.status == 409).count() as u64
    );
}

/// Two instances, `on_conflict: wait`: every one of the 50 gets the same booking, byte for
/// byte, the waiters on the other instance included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_two_instances_waiting_duplicates_all_get_the_booking() {
    let env = Env::new(Backend::Redis).await;
    let yaml = env.config("on_conflict: wait\nwait_timeout: 5s");
    let a = env.proxy(&yaml).await;
    let b = env.proxy(&yaml).await;
    let replies = fifty_duplicates(&a, &b, "multi-wait").await;
    let original = the_original(&replies);
    for r in &replies {
        assert_eq!(
            r.status, 201,
            "every waiter gets the result; body: {:?}",
            r.body
        );
        assert_eq!(r.body, original.body, "byte-identical");
    }
    assert_eq!(env.mock.calls("multi-wait"), 1, "exactly one booking");
}

// ---------------------------------------------------------------------------------------------
// §4.5 A claim answered after its lease could have expired forwards nothing
// ---------------------------------------------------------------------------------------------

/// The memory store, whose claims are answered `delay` after they were made while the delay
/// is set: the claim is taken at once, the answer comes late (a stalled scheduler, a slow
/// network on the way back).
pub(crate) struct LateClaims {
    pub(crate) inner: MemoryStore,
    pub(crate) delay_ms: AtomicU32,
}

#[async_trait]
impl Wrap for LateClaims {
    fn inner(&self) -> &dyn Store {
        &self.inner
    }
    async fn claim(
        &self,
        key: &StoreKey,
        held: &Held,
        lease: Duration,
    ) -> Result<Option<Bytes>, StoreError> {
        let found = self.inner.claim(key, held, lease).await;
        let delay = self.delay_ms.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(u64::from(delay))).await;
        found
    }
}

/// A claim whose answer takes 1.3s under a `lock_ttl` of 1s: its lease may have expired (and
/// another request may hold the key) by the time the proxy learns it won. It must forward
/// nothing, release the claim and answer 503; the retry then runs the operation once (before
/// the fix the late claim was forwarded).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_answered_after_lock_ttl_forwards_nothing_and_is_released() {
    let env = Env::new(Backend::Memory).await;
    let yaml = env.config("lock_ttl: 1s");
    let config = Config::from_yaml(&yaml).expect("config");
    let metrics = Arc::new(Metrics::new());
    let late = Arc::new(LateClaims {
        inner: MemoryStore::new(1000),
        delay_ms: AtomicU32::new(1300),
    });
    // The handle's own deadline is longer than the delay: the late answer is not a timeout.
    let store = StoreHandle::new(late.clone(), Duration::from_secs(5), metrics.clone());
    let proxy = Arc::new(Proxy::new(config, store, metrics.clone()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(idemproxy::server::serve(listener, proxy, async move {
        let _ = stopped.await;
    }));

    let r = book_with(&base, "late-claim", BODY, &[]).await;
    r.assert_problem(503, "store-unavailable");
    assert_eq!(env.mock.calls("late-claim"), 0, "nothing was forwarded");

    late.delay_ms.store(0, Ordering::SeqCst);
    let r = book_with(&base, "late-claim", BODY, &[]).await;
    assert_eq!(r.status, 201, "the key was released: {:?}", r.body);
    assert_eq!(r.header("idempotent-replayed"), "");
    assert_eq!(env.mock.calls("late-claim"), 1, "the retry ran it once");
    assert_eq!(
        harness::metric_value(&metrics.encode(), "idemproxy_lost_leases_total", &[]),
        0.0,
        "nothing ran under the late claim: no lease was lost"
    );
    let _ = stop.send(());
    let _ = served.await;
}
