//! When things fail: SPEC §4.4 (unknown outcomes, leases), §4.5 (store faults), graceful
//! shutdown (§2), and several instances on one Redis (§5).
//!
//! A rule that holds on every store runs on every store (`every_store!`), and so does each
//! check of the store contract (`contract::*`); Redis faults (SIGSTOP,
//! SIGKILL, restart, corrupt records, eviction policy) and what needs several processes sharing
//! one store are Redis-only. Every wall-clock bound here is one the SPEC asks for ("bounded
//! time", "within lock_ttl") and is generous: the machine is small and noisy.

mod common;

use std::time::{Duration, Instant};

use common::mock;
use common::relay::Relay;
use common::store_checks;
use common::{
    Backend, Env, ProxyProcess, RedisServer, Reply, TestProxy, book_with, booking_store_key,
    client, eventually, free_port, send,
};
use idemproxy::metrics::Outcome;
use idemproxy::record::Record;
use idemproxy_mock::MockUpstream;

/// The request body every booking here sends (the fingerprint covers it, not the headers).
const BODY: &str = r#"{"seat":"12A"}"#;

/// The proxy's base URL.
fn base(proxy: &TestProxy) -> String {
    proxy.url("")
}

/// Asserts `r` is a replay of `first`: same status, byte-identical body, marked replayed.
fn assert_replay_of(r: &Reply, first: &Reply) {
    assert_eq!(
        r.status, first.status,
        "replayed status; body: {:?}",
        r.body
    );
    assert_eq!(r.header("idempotent-replayed"), "true", "replay marker");
    assert_eq!(r.body, first.body, "replayed body is byte-identical");
}

/// Asserts `r` came from the upstream now (not a replay) with a new booking.
fn assert_forwarded(r: &Reply) {
    assert_eq!(r.status, 201, "forwarded; body: {:?}", r.body);
    assert_eq!(r.header("idempotent-replayed"), "", "not a replay");
}

/// `yaml` with the upstream's response timeout set to `t`, and its connect timeout to
/// `connect` (it must be the shorter: SPEC §4.4). A loopback connect is made by the kernel,
/// however busy the mock is, so a short one is safe.
fn with_upstream_timeouts(yaml: &str, connect: &str, t: &str) -> String {
    let out = yaml.replace(
        "    connect_timeout: 1s\n    timeout: 5s\n",
        &format!("    connect_timeout: {connect}\n    timeout: {t}\n"),
    );
    assert_ne!(out, yaml, "the harness's upstream timeout lines moved");
    out
}

/// A request with this key, sent through `base` and answered 201 by the upstream, retried at
/// most `attempts` times 100ms apart while the answer is a 503 (the store coming back). Each
/// attempt uses a new key `{prefix}-{n}`, so a refused attempt leaves nothing behind that a
/// later one could replay. Returns the key that went through and its reply.
async fn first_forwarded_after_outage(
    env: &Env,
    base: &str,
    prefix: &str,
    attempts: usize,
) -> (String, Reply) {
    for n in 0..attempts {
        let key = format!("{prefix}-{n}");
        let r = book_with(base, &key, BODY, &[]).await;
        if r.status == 201 {
            return (key, r);
        }
        r.assert_problem(503, "store-unavailable");
        assert_eq!(env.mock.calls(&key), 0, "a 503 forwards nothing");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the proxy did not recover within {attempts} attempts");
}

// ---------------------------------------------------------------------------------------------
// §4.4 When the outcome is unknown
// ---------------------------------------------------------------------------------------------

every_store!(
    connect_failure_releases_the_claim,
    a_connect_that_hangs_is_released_as_a_502_never_saved_as_a_504,
    reset_after_sending_is_kept_as_a_502,
    timeout_is_kept_as_a_504,
    partial_response_is_an_unknown_outcome,
    release_lets_a_retry_run_again,
    renewal_keeps_a_claim_slower_than_lock_ttl,
    stale_holder_cannot_overwrite_a_newer_holder,
);

/// Nothing was sent: the claim is released (502 upstream-unavailable each time, never a 409 or
/// a replay), and once the upstream is up the same key is forwarded.
async fn connect_failure_releases_the_claim(backend: Backend) {
    let env = Env::new(backend).await;
    let port = free_port();
    let yaml = env
        .config("")
        .replace(&env.mock.url(), &format!("http://127.0.0.1:{port}"));
    let proxy = env.proxy(&yaml).await;
    let base = base(&proxy);

    for attempt in 0..2 {
        let r = book_with(&base, "cf-1", BODY, &[]).await;
        r.assert_problem(502, "upstream-unavailable");
        assert_eq!(
            r.header("idempotent-replayed"),
            "",
            "attempt {attempt}: a connect failure is not saved"
        );
    }
    assert_eq!(proxy.requests("create-booking", Outcome::UpstreamError), 2);

    // The upstream comes up on that port: the key was released, so it is forwarded now.
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .expect("bind the upstream's port");
    let upstream = MockUpstream::new();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(mock::serve(listener, upstream.clone(), async move {
        let _ = stopped.await;
    }));
    let now = book_with(&base, "cf-1", BODY, &[]).await;
    assert_forwarded(&now);
    assert_eq!(upstream.calls("cf-1"), 1);
    let again = book_with(&base, "cf-1", BODY, &[]).await;
    assert_replay_of(&again, &now);
    assert_eq!(
        upstream.calls("cf-1"),
        1,
        "the upstream ran the operation once"
    );
    let _ = stop.send(());
    let _ = served.await;
}

/// A listener whose accept queue is full, as an overloaded upstream's: the kernel drops new
/// connections' SYNs, so a connect to it hangs. Returns it with the connections that fill its
/// queue, which must stay open until it accepts.
async fn listener_dropping_syns() -> (tokio::net::TcpListener, Vec<tokio::net::TcpStream>) {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind("127.0.0.1:0".parse().expect("addr"))
        .expect("bind");
    // A backlog of 0 still queues one connection: the next SYN is dropped.
    let listener = socket.listen(0).expect("listen");
    let addr = listener.local_addr().expect("addr");
    let mut fillers = Vec::new();
    for _ in 0..8 {
        let connect = tokio::net::TcpStream::connect(addr);
        match tokio::time::timeout(Duration::from_millis(300), connect).await {
            Ok(Ok(tcp)) => fillers.push(tcp),
            _ => return (listener, fillers),
        }
    }
    panic!("the accept queue of a listen(0) socket never filled");
}

/// SPEC §4.4: a connection that is not made within `connect_timeout` sent nothing: the claim is
/// released and the client gets a `502 upstream-unavailable`, on an idempotent route and a
/// pass-through one alike, never a `504` saved as the key's result; once the upstream accepts,
/// the retry runs. The issue's own configuration — `timeout: 800ms` under the default 2s
/// `connect_timeout`, with which the first request got a `504` at the timeout, replayed to the
/// retry, though the upstream had received nothing — is refused at load, naming both fields.
async fn a_connect_that_hangs_is_released_as_a_502_never_saved_as_a_504(backend: Backend) {
    let env = Env::new(backend).await;
    let (listener, fillers) = listener_dropping_syns().await;
    let addr = listener.local_addr().expect("addr");
    let pointed = env
        .config("on_unknown_outcome: keep")
        .replace(&env.mock.url(), &format!("http://{addr}"));
    let as_reported = pointed.replace(
        "    connect_timeout: 1s\n    timeout: 5s\n",
        "    timeout: 800ms\n",
    );
    assert_ne!(as_reported, pointed, "the harness's upstream lines moved");
    let refused = idemproxy::config::Config::from_yaml(&as_reported)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        refused.contains("upstreams.booking.connect_timeout")
            && refused.contains("upstreams.booking.timeout (800ms)"),
        "connect_timeout 2s (the default) with timeout 800ms is refused: {refused:?}"
    );

    let yaml = with_upstream_timeouts(&pointed, "300ms", "800ms");
    let proxy = env.proxy(&yaml).await;
    let base = base(&proxy);
    for attempt in 0..2 {
        let started = Instant::now();
        let r = book_with(&base, "syn-dropped", BODY, &[]).await;
        let doc = r.assert_problem(502, "upstream-unavailable");
        let detail = doc["detail"].as_str().unwrap_or_default();
        assert!(detail.contains("connect"), "attempt {attempt}: {detail}");
        assert_eq!(
            r.header("idempotent-replayed"),
            "",
            "attempt {attempt}: not saved"
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "attempt {attempt}: within the deadlines, not hung"
        );
    }
    // A pass-through route makes its connections the same way.
    let passed = send(client().get(format!("{base}/inventory"))).await;
    passed.assert_problem(502, "upstream-unavailable");

    // The upstream starts accepting: the key was released, so the retry runs.
    drop(fillers);
    let upstream = MockUpstream::new();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(mock::serve(listener, upstream.clone(), async move {
        let _ = stopped.await;
    }));
    let now = book_with(&base, "syn-dropped", BODY, &[]).await;
    assert_forwarded(&now);
    assert_eq!(upstream.calls("syn-dropped"), 1);
    let again = book_with(&base, "syn-dropped", BODY, &[]).await;
    assert_replay_of(&again, &now);
    assert_eq!(upstream.calls("syn-dropped"), 1, "run once");
    let _ = stop.send(());
    let _ = served.await;
}

/// The upstream read the request and reset the connection: with `keep`, the 502 is the key's
/// result and is replayed; the operation never runs twice.
async fn reset_after_sending_is_kept_as_a_502(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("on_unknown_outcome: keep")).await;
    let base = base(&proxy);
    let first = book_with(&base, "reset-1", BODY, &[("X-Mock-Reset", "true")]).await;
    first.assert_problem(502, "upstream-failed");
    assert_eq!(first.header("idempotent-replayed"), "");
    assert_eq!(env.mock.calls("reset-1"), 1, "the upstream received it");

    // The retry would succeed upstream, but the first may have acted: replay the 502.
    let again = book_with(&base, "reset-1", BODY, &[]).await;
    again.assert_problem(502, "upstream-failed");
    assert_replay_of(&again, &first);
    assert_eq!(env.mock.calls("reset-1"), 1, "never run twice");
}

/// No complete response within the upstream timeout: with `keep` (the default), the 504 is the
/// key's result.
async fn timeout_is_kept_as_a_504(backend: Backend) {
    let env = Env::new(backend).await;
    let yaml = with_upstream_timeouts(&env.config(""), "150ms", "300ms");
    let proxy = env.proxy(&yaml).await;
    let base = base(&proxy);
    let first = book_with(&base, "slow-up", BODY, &[("X-Mock-Delay", "2s")]).await;
    first.assert_problem(504, "upstream-timeout");
    assert_eq!(env.mock.calls("slow-up"), 1);

    let again = book_with(&base, "slow-up", BODY, &[]).await;
    again.assert_problem(504, "upstream-timeout");
    assert_replay_of(&again, &first);
    assert_eq!(env.mock.calls("slow-up"), 1, "never run twice");
}

/// A response cut short (head and half the declared body, then the connection drops) is an
/// unknown outcome too: 502, kept.
async fn partial_response_is_an_unknown_outcome(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("")).await;
    let base = base(&proxy);
    let first = book_with(&base, "partial-1", BODY, &[("X-Mock-Partial", "true")]).await;
    first.assert_problem(502, "upstream-failed");
    assert_eq!(env.mock.calls("partial-1"), 1);

    let again = book_with(&base, "partial-1", BODY, &[]).await;
    again.assert_problem(502, "upstream-failed");
    assert_replay_of(&again, &first);
    assert_eq!(env.mock.calls("partial-1"), 1, "never run twice");
}

/// With `on_unknown_outcome: release`, a reset or a timeout frees the key: the retry runs
/// upstream again (the upstream is trusted to dedupe on the forwarded key), and that result is
/// then replayed.
async fn release_lets_a_retry_run_again(backend: Backend) {
    let env = Env::new(backend).await;
    let yaml = with_upstream_timeouts(&env.config("on_unknown_outcome: release"), "150ms", "300ms");
    let proxy = env.proxy(&yaml).await;
    let base = base(&proxy);

    for (key, fault, slug, status) in [
        (
            "rel-reset",
            ("X-Mock-Reset", "true"),
            "upstream-failed",
            502,
        ),
        (
            "rel-timeout",
            ("X-Mock-Delay", "2s"),
            "upstream-timeout",
            504,
        ),
    ] {
        let first = book_with(&base, key, BODY, &[fault]).await;
        first.assert_problem(status, slug);
        assert_eq!(env.mock.calls(key), 1);

        let retry = book_with(&base, key, BODY, &[]).await;
        assert_forwarded(&retry);
        assert_eq!(
            env.mock.calls(key),
            2,
            "{key}: the retry ran upstream again"
        );

        let again = book_with(&base, key, BODY, &[]).await;
        assert_replay_of(&again, &retry);
        assert_eq!(env.mock.calls(key), 2, "{key}: then it is replayed");
    }
}

// ---------------------------------------------------------------------------------------------
// Leases
// ---------------------------------------------------------------------------------------------

/// An upstream call four times longer than `lock_ttl` keeps its claim by renewal: a repeat well
/// past `lock_ttl` is a 409, not a second forward; afterwards it is a replay.
async fn renewal_keeps_a_claim_slower_than_lock_ttl(backend: Backend) {
    let env = Env::new(backend).await;
    // The store deadline stays shorter than the lease (SPEC §4.5: refused otherwise).
    let proxy = env
        .proxy(&env.config_with("lock_ttl: 300ms", "timeout: 150ms"))
        .await;
    let base = base(&proxy);
    let first = {
        let base = base.clone();
        tokio::spawn(async move {
            book_with(&base, "renew-1", BODY, &[("X-Mock-Delay", "1200ms")]).await
        })
    };
    assert!(
        eventually(Duration::from_secs(3), || env.mock.calls("renew-1") == 1).await,
        "the first request reached the upstream"
    );
    // Twice lock_ttl later: an unrenewed claim would have expired by now.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let during = book_with(&base, "renew-1", BODY, &[]).await;
    during.assert_problem(409, "request-in-progress");
    assert!(
        !during.header("retry-after").is_empty(),
        "409 has Retry-After"
    );
    assert_eq!(env.mock.calls("renew-1"), 1, "the repeat was not forwarded");

    let first = first.await.expect("first request");
    assert_forwarded(&first);
    let after = book_with(&base, "renew-1", BODY, &[]).await;
    assert_replay_of(&after, &first);
    assert_eq!(env.mock.calls("renew-1"), 1);
    assert_eq!(proxy.lost_leases(), 0, "no lease was lost");
}

/// The compare-and-set on the token, at the store: A's lease expires, B claims the key; from
/// then on nothing A does (complete, renew, release) touches the key, and B's record stands.
async fn stale_holder_cannot_overwrite_a_newer_holder(backend: Backend) {
    let env = Env::new(backend).await;
    store_checks::stale_holder_cannot_overwrite_a_newer_holder(&env.store_handle().await).await;
}

// ---------------------------------------------------------------------------------------------
// The store contract, on every store
// ---------------------------------------------------------------------------------------------

/// Each check of `common::store_checks` as a test of its own on every store, on a store of the
/// test's own built from its `store:` section as the proxy builds it.
macro_rules! contract_checks {
    ($($check:ident),* $(,)?) => {
        $(
            async fn $check(backend: Backend) {
                let env = Env::new(backend).await;
                store_checks::$check(env.store().await).await;
            }
        )*
        crate::every_store!($($check),*);
    };
}

mod contract {
    use super::common::{Backend, Env, store_checks};

    contract_checks!(
        a_claim_is_exclusive_and_a_finished_record_is_what_claims_read,
        one_of_many_concurrent_claims_takes_the_key,
        renewal_keeps_a_claim_and_its_end_frees_the_key,
        a_lapsed_claim_can_neither_renew_nor_complete,
        release_frees_only_the_holders_claim,
        only_the_same_completion_counts_twice,
        inspect_shows_the_remaining_time_to_live,
        forget_deletes_only_a_finished_record,
        a_record_of_several_mib_round_trips,
        a_large_record_is_fenced_like_a_small_one,
        wait_change_returns_by_its_bound,
    );
}

/// At the proxy, on Redis: the first holder's claim disappears while its upstream call runs (as
/// if its lease had expired), a second request claims and runs the operation. The first's save
/// must not overwrite the second's record; the lost lease is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_taken_over_holder_does_not_overwrite_and_counts_a_lost_lease() {
    let env = Env::new(Backend::Redis).await;
    let proxy = env.proxy(&env.config("lock_ttl: 600ms")).await;
    let base = base(&proxy);
    let key = "taken-over";
    let first = {
        let base = base.clone();
        tokio::spawn(async move { book_with(&base, key, BODY, &[("X-Mock-Delay", "1s")]).await })
    };
    assert!(
        eventually(Duration::from_secs(3), || env.mock.calls(key) == 1).await,
        "the first request reached the upstream"
    );
    let mut conn = env.redis().conn();
    let deleted: i64 = ::redis::cmd("DEL")
        .arg(booking_store_key(key))
        .query(&mut conn)
        .expect("DEL");
    assert_eq!(
        deleted, 1,
        "the first's claim is under the documented store key"
    );

    let second = book_with(&base, key, BODY, &[]).await;
    assert_forwarded(&second);
    assert_eq!(env.mock.calls(key), 2);

    let first = first.await.expect("first request");
    assert_forwarded(&first);
    assert_ne!(first.body, second.body, "two bookings were made");
    assert!(
        eventually(Duration::from_secs(2), || proxy.lost_leases() >= 1).await,
        "the lost lease is counted"
    );
    assert!(
        proxy.metrics().encode().contains("idemproxy_lost_leases"),
        "the lost-lease counter is exported"
    );

    let repeat = book_with(&base, key, BODY, &[]).await;
    assert_replay_of(&repeat, &second);
    assert_eq!(env.mock.calls(key), 2);
}

/// As above with large responses (staged on Redis: each written to a key of its own first),
/// on Redis and on Redis Cluster: the first holder's late save writes its large record to its
/// own staging key and then finds the second holder's record under the key; nothing of it
/// becomes visible, the second's result replays, and no staging key is left behind.
async fn taken_over_holder_with_a_large_body_changes_nothing(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env
        .proxy(&env.config("lock_ttl: 600ms\nmax_response_body: 1MiB"))
        .await;
    let base = base(&proxy);
    let key = "taken-over-large";
    // Two sizes, so that the two results differ.
    let (first_size, second_size) = (96 * 1024, 64 * 1024);
    let first = {
        let base = base.clone();
        let size = first_size.to_string();
        tokio::spawn(async move {
            book_with(
                &base,
                key,
                BODY,
                &[("X-Mock-Delay", "1s"), ("X-Mock-Body-Size", &size)],
            )
            .await
        })
    };
    assert!(
        eventually(Duration::from_secs(3), || env.mock.calls(key) == 1).await,
        "the first request reached the upstream"
    );
    let deleted: i64 = ::redis::cmd("DEL")
        .arg(booking_store_key(key))
        .query(&mut env.redis_conn())
        .expect("DEL");
    assert_eq!(deleted, 1, "the first's claim is under the store key");

    let second_size_text = second_size.to_string();
    let second = book_with(
        &base,
        key,
        BODY,
        &[("X-Mock-Body-Size", second_size_text.as_str())],
    )
    .await;
    assert_eq!(second.status, 201, "forwarded");
    assert_eq!(second.body.len(), second_size);
    let first = first.await.expect("first request");
    assert_eq!(
        first.status, 201,
        "the first client still gets its response"
    );
    assert_eq!(first.body.len(), first_size);
    assert!(
        eventually(Duration::from_secs(2), || proxy.lost_leases() >= 1).await,
        "the first's lost lease is counted"
    );

    let repeat = book_with(&base, key, BODY, &[]).await;
    assert_replay_of(&repeat, &second);
    assert_eq!(env.mock.calls(key), 2);
    let keys = env.stored_key_names().expect("a Redis store");
    assert_eq!(
        keys,
        [booking_store_key(key)],
        "the record key alone: the late save's staging key is gone"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_taken_over_holder_with_a_large_body_changes_nothing() {
    taken_over_holder_with_a_large_body_changes_nothing(Backend::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_taken_over_holder_with_a_large_body_changes_nothing() {
    common::warm_up();
    taken_over_holder_with_a_large_body_changes_nothing(Backend::RedisCluster).await;
}

/// A proxy process killed with SIGKILL mid-request stops renewing: its claim is a 409 at once
/// and expires within `lock_ttl`, after which a retry through another instance runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_proxy_process_claim_expires_within_lock_ttl() {
    let env = Env::new(Backend::Redis).await;
    let lock_ttl = Duration::from_secs(1);
    let yaml = env.config("lock_ttl: 1s");
    let victim = ProxyProcess::spawn(&yaml);
    let survivor = env.proxy(&yaml).await;
    let key = "killed-mid-request";
    let in_flight = {
        let url = victim.url("/bookings");
        tokio::spawn(async move {
            // Fails when the process dies; only the side effect matters.
            let _ = client()
                .post(url)
                .header("Idempotency-Key", key)
                .header("Content-Type", "application/json")
                .header("X-Mock-Delay", "3s")
                .body(BODY)
                .send()
                .await;
        })
    };
    assert!(
        eventually(Duration::from_secs(5), || env.mock.calls(key) == 1).await,
        "the request reached the upstream through the victim"
    );
    victim.signal("-KILL");
    let killed = Instant::now();

    let right_after = book_with(&base(&survivor), key, BODY, &[]).await;
    right_after.assert_problem(409, "request-in-progress");

    let deadline = killed + lock_ttl + Duration::from_secs(1);
    let forwarded = loop {
        let r = book_with(&base(&survivor), key, BODY, &[]).await;
        if r.status == 201 {
            break r;
        }
        r.assert_problem(409, "request-in-progress");
        assert!(
            Instant::now() < deadline,
            "the dead proxy's claim did not expire within lock_ttl + 1s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_forwarded(&forwarded);
    assert_eq!(env.mock.calls(key), 2, "the retry ran again");
    let again = book_with(&base(&survivor), key, BODY, &[]).await;
    assert_replay_of(&again, &forwarded);
    assert_eq!(env.mock.calls(key), 2);
    in_flight.abort();
}

// ---------------------------------------------------------------------------------------------
// §4.5 When the store fails (Redis)
// ---------------------------------------------------------------------------------------------

/// A hung Redis (SIGSTOP) gives 503 within `store.timeout` (300ms) plus a margin, on the claim
/// path and on the replay path, never a hang; after SIGCONT the proxy serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_paused_gives_503_in_bounded_time_then_recovers() {
    let env = Env::new(Backend::Redis).await;
    let proxy = env.proxy(&env.config("")).await;
    let base = base(&proxy);
    let warm = book_with(&base, "warm", BODY, &[]).await;
    assert_forwarded(&warm);

    env.redis().pause();
    for key in ["paused-new", "warm"] {
        let started = Instant::now();
        let r = book_with(&base, key, BODY, &[]).await;
        let took = started.elapsed();
        r.assert_problem(503, "store-unavailable");
        assert!(
            took < Duration::from_secs(2),
            "{key}: a hung store must answer in bounded time, took {took:?}"
        );
    }
    assert_eq!(env.mock.calls("paused-new"), 0, "nothing forwarded");
    assert_eq!(env.mock.calls("warm"), 1);
    assert!(proxy.requests("create-booking", Outcome::StoreError) >= 2);

    env.redis().resume();
    let (key, first) = first_forwarded_after_outage(&env, &base, "after-pause", 50).await;
    let again = book_with(&base, &key, BODY, &[]).await;
    assert_replay_of(&again, &first);
    assert_eq!(env.mock.calls(&key), 1);
    let warm_again = book_with(&base, "warm", BODY, &[]).await;
    assert_replay_of(&warm_again, &warm);
}

/// A claim that timed out has an unknown outcome: it forwards nothing (503). The `SET NX`
/// queued while Redis was paused lands when it resumes, so retries get 409 until that lease
/// would have expired; then the key is forwarded, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_claim_that_timed_out_is_a_conflict_until_its_lease_expires() {
    let env = Env::new(Backend::Redis).await;
    let lock_ttl = Duration::from_secs(1);
    let proxy = env.proxy(&env.config("lock_ttl: 1s")).await;
    let base = base(&proxy);
    assert_forwarded(&book_with(&base, "warm", BODY, &[]).await);

    env.redis().pause();
    let r = book_with(&base, "limbo", BODY, &[]).await;
    r.assert_problem(503, "store-unavailable");
    env.redis().resume();
    let resumed = Instant::now();
    assert_eq!(
        env.mock.calls("limbo"),
        0,
        "a timed-out claim forwards nothing"
    );

    let r = book_with(&base, "limbo", BODY, &[]).await;
    r.assert_problem(409, "request-in-progress");
    let deadline = resumed + lock_ttl + Duration::from_secs(1);
    let forwarded = loop {
        let r = book_with(&base, "limbo", BODY, &[]).await;
        if r.status == 201 {
            break r;
        }
        r.assert_problem(409, "request-in-progress");
        assert_eq!(env.mock.calls("limbo"), 0);
        assert!(
            Instant::now() < deadline,
            "the timed-out claim did not expire within lock_ttl + 1s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_forwarded(&forwarded);
    assert_eq!(env.mock.calls("limbo"), 1);
    assert_replay_of(&book_with(&base, "limbo", BODY, &[]).await, &forwarded);
}

/// Redis dies: `on_store_error: reject` answers 503 and forwards nothing; `forward` passes the
/// request through without idempotency, and counts it as unprotected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_rejects_or_forwards_unprotected() {
    let mut env = Env::new(Backend::Redis).await;
    let reject = env.proxy(&env.config("on_store_error: reject")).await;
    let forward = env.proxy(&env.config("on_store_error: forward")).await;
    assert_forwarded(&book_with(&base(&reject), "warm-r", BODY, &[]).await);
    assert_forwarded(&book_with(&base(&forward), "warm-f", BODY, &[]).await);

    env.redis_mut().kill();

    let started = Instant::now();
    let r = book_with(&base(&reject), "dead-r", BODY, &[]).await;
    r.assert_problem(503, "store-unavailable");
    assert!(started.elapsed() < Duration::from_secs(2), "bounded time");
    assert_eq!(env.mock.calls("dead-r"), 0, "reject forwards nothing");

    let f = book_with(&base(&forward), "dead-f", BODY, &[]).await;
    assert_forwarded(&f);
    assert_eq!(env.mock.calls("dead-f"), 1);
    // Unprotected: the same key again runs again (that is what `forward` trades away).
    let f2 = book_with(&base(&forward), "dead-f", BODY, &[]).await;
    assert_forwarded(&f2);
    assert_eq!(env.mock.calls("dead-f"), 2);

    assert_eq!(reject.requests("create-booking", Outcome::StoreError), 1);
    assert_eq!(forward.requests("create-booking", Outcome::StoreError), 2);
    let text = forward.metrics().encode();
    assert!(
        text.contains(r#"idemproxy_unprotected_requests_total{route="create-booking"} 2"#),
        "unprotected requests are counted:\n{text}"
    );
}

/// Redis is restarted on the same port (empty): the proxy reconnects by itself, no restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restarted_proxy_recovers_without_restart() {
    let mut env = Env::new(Backend::Redis).await;
    let proxy = env.proxy(&env.config("")).await;
    let base = base(&proxy);
    assert_forwarded(&book_with(&base, "before-restart", BODY, &[]).await);

    env.redis_mut().restart();
    let (key, first) = first_forwarded_after_outage(&env, &base, "after-restart", 50).await;
    let again = book_with(&base, &key, BODY, &[]).await;
    assert_replay_of(&again, &first);
    assert_eq!(env.mock.calls(&key), 1);
}

/// The store stalls after the upstream answered: the client gets its 201 anyway (while Redis
/// is still paused), the save is retried in the background, and after Redis resumes a repeat
/// is a replay — nothing lost, nothing run twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stall_after_the_upstream_answered_loses_nothing() {
    let env = Env::new(Backend::Redis).await;
    let yaml = env.config_with("lock_ttl: 3s", "timeout: 200ms");
    let proxy = env.proxy(&yaml).await;
    let base = base(&proxy);
    // Loads the scripts and the connection before the fault.
    assert_forwarded(&book_with(&base, "warm", BODY, &[]).await);

    let first = {
        let base = base.clone();
        tokio::spawn(async move {
            book_with(&base, "stall-1", BODY, &[("X-Mock-Delay", "600ms")]).await
        })
    };
    assert!(
        eventually(Duration::from_secs(3), || env.mock.calls("stall-1") == 1).await,
        "claimed and forwarded"
    );
    let reached = Instant::now();
    env.redis().pause();
    // The upstream answers ~600ms after it got the request; the save times out 200ms later.
    let answered =
        tokio::time::timeout_at((reached + Duration::from_millis(1500)).into(), first).await;
    env.redis().resume();
    let first = answered
        .expect("the client got its answer while the store was still stalled")
        .expect("first request");
    assert_forwarded(&first);

    let deadline = Instant::now() + Duration::from_secs(3);
    let replay = loop {
        let r = book_with(&base, "stall-1", BODY, &[]).await;
        if r.status == 201 {
            break r;
        }
        r.assert_problem(409, "request-in-progress");
        assert!(
            Instant::now() < deadline,
            "the background save never landed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_replay_of(&replay, &first);
    assert_eq!(env.mock.calls("stall-1"), 1, "nothing ran twice");
    assert_eq!(proxy.lost_leases(), 0, "nothing lost");
}

/// The save fails after the upstream answered and the command that carried it is lost (the
/// connection to Redis is cut): the client still gets its 201, the proxy retries the save in
/// the background with backoff while its lease is valid, and a repeat is then a replay.
///
/// A blackholed relay in front of Redis swallows the save (Redis never sees it), and its end
/// resets every connection, losing it for good. Unlike SIGSTOP, where the commands queued while
/// Redis is stopped still run when it resumes, only a retry by the proxy can save the result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_lost_save_is_retried_in_the_background() {
    let env = Env::new(Backend::Redis).await;
    let relay = Relay::start(env.redis().addr()).await;
    let yaml = env
        .config_with("lock_ttl: 3s", "timeout: 200ms")
        .replace(&env.redis().url(), &format!("redis://{}/0", relay.addr()));
    let proxy = env.proxy(&yaml).await;
    let base = base(&proxy);
    assert_forwarded(&book_with(&base, "warm", BODY, &[]).await);

    let first = {
        let base = base.clone();
        tokio::spawn(
            async move { book_with(&base, "cut-1", BODY, &[("X-Mock-Delay", "600ms")]).await },
        )
    };
    assert!(
        eventually(Duration::from_secs(3), || env.mock.calls("cut-1") == 1).await,
        "claimed and forwarded"
    );
    relay.blackhole();
    let first = tokio::time::timeout(Duration::from_secs(3), first)
        .await
        .expect("the client got its answer while the store was unreachable")
        .expect("first request");
    assert_forwarded(&first);
    // The save did not reach Redis: the key still holds the claim.
    let mut conn = env.redis().conn();
    let raw: Vec<u8> = ::redis::cmd("GET")
        .arg(booking_store_key("cut-1"))
        .query(&mut conn)
        .expect("GET");
    assert!(
        matches!(
            Record::decode(&raw).expect("decodable"),
            Record::InFlight { .. }
        ),
        "the first save attempt must not have landed yet"
    );
    relay.pass();

    let deadline = Instant::now() + Duration::from_secs(3);
    let replay = loop {
        let r = book_with(&base, "cut-1", BODY, &[]).await;
        if r.status == 201 {
            break r;
        }
        assert!(
            r.status == 409 || r.status == 503,
            "while the save is retried: 409 or 503, got {} {:?}",
            r.status,
            r.body
        );
        assert!(
            Instant::now() < deadline,
            "the background save never landed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_replay_of(&replay, &first);
    assert_eq!(env.mock.calls("cut-1"), 1, "nothing ran twice");
    assert_eq!(proxy.lost_leases(), 0, "nothing lost");
}

/// A record the proxy cannot decode — garbage, or a well-formed record of an unknown format
/// version — is a store error: 503, never forwarded (not even with `on_store_error: forward`),
/// never replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_undecodable_records_are_store_errors() {
    let env = Env::new(Backend::Redis).await;
    let reject = env.proxy(&env.config("")).await;
    let forward = env.proxy(&env.config("on_store_error: forward")).await;
    let mut conn = env.redis().conn();

    // A real record, as the proxy wrote it, copied under another key with version byte 2.
    let original = book_with(&base(&reject), "original", BODY, &[]).await;
    assert_forwarded(&original);
    let record: Vec<u8> = ::redis::cmd("GET")
        .arg(booking_store_key("original"))
        .query(&mut conn)
        .expect("GET");
    assert_eq!(&record[..4], b"IDP\x01", "the record's magic and version");
    let mut future = record.clone();
    future[3] = 0x02;
    for (key, value) in [
        ("garbage", b"\x00\xffnot a record at all".to_vec()),
        ("future-version", future),
    ] {
        let _: () = ::redis::cmd("SET")
            .arg(booking_store_key(key))
            .arg(value)
            .arg("PX")
            .arg(60_000)
            .query(&mut conn)
            .expect("SET");
        for (name, proxy) in [("reject", &reject), ("forward", &forward)] {
            for attempt in 0..2 {
                let r = book_with(&base(proxy), key, BODY, &[]).await;
                r.assert_problem(503, "store-unavailable");
                assert_eq!(
                    r.header("idempotent-replayed"),
                    "",
                    "{key} via {name}, attempt {attempt}: never replayed"
                );
            }
        }
        assert_eq!(env.mock.calls(key), 0, "{key}: never forwarded");
    }
}

/// At start the proxy reads `maxmemory-policy` and warns when Redis may evict keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_eviction_policy_is_warned_about_at_start() {
    let env = Env::on_redis(RedisServer::start_with(&[
        "--maxmemory-policy",
        "allkeys-lru",
    ]))
    .await;
    let p = ProxyProcess::spawn(&env.config(""));
    let warned = eventually(Duration::from_secs(5), || {
        p.log().lines().any(|l| {
            l.contains("WARN") && l.contains("maxmemory-policy") && l.contains("allkeys-lru")
        })
    })
    .await;
    assert!(warned, "no eviction warning; log:\n{}", p.log());
}

/// …and does not warn on a `noeviction` Redis (the default).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_noeviction_is_not_warned_about() {
    let env = Env::new(Backend::Redis).await;
    let p = ProxyProcess::spawn(&env.config(""));
    // The check logs what it found; wait for that, then look for a warning.
    let checked = eventually(Duration::from_secs(5), || {
        p.log()
            .lines()
            .any(|l| l.contains("maxmemory-policy") && l.contains("noeviction"))
    })
    .await;
    let log = p.log();
    assert!(checked, "the policy check did not run; log:\n{log}");
    assert!(
        !log.lines()
            .any(|l| l.contains("WARN") && l.contains("maxmemory-policy")),
        "warned on noeviction; log:\n{log}"
    );
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
    assert_replay_of(&again, &first);
    assert_eq!(env.mock.calls("term-1"), 1, "its result was saved");
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
            201 => assert_replay_of(r, &original),
            _ => {
                r.assert_problem(409, "request-in-progress");
            }
        }
    }
    assert_eq!(env.mock.calls("multi-1"), 1, "exactly one booking");
    for p in [&a, &b] {
        let r = book_with(&base(p), "multi-1", BODY, &[]).await;
        assert_replay_of(&r, &original);
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
