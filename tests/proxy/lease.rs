//! The claim's lease (SPEC §4.4): renewed while a slow upstream call runs, fenced so that a holder
//! whose claim was taken over never overwrites the newer holder's record (large bodies
//! included), and given up within `lock_ttl` when its process dies or its claim timed out.

use crate::support::{BODY, assert_forwarded, assert_replay_status_and_body, base};
use harness::every_store;
use harness::{
    Backend, Env, ProxyProcess, book_with, booking_store_key, client, eventually, store_checks,
};
use std::time::{Duration, Instant};

every_store!(
    renewal_keeps_a_claim_slower_than_lock_ttl,
    stale_holder_cannot_overwrite_a_newer_holder,
);

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
    assert_replay_status_and_body(&after, &first);
    assert_eq!(env.mock.calls("renew-1"), 1);
    assert_eq!(proxy.lost_leases(), 0, "no lease was lost");
}

/// The compare-and-set on the token, at the store: A's lease expires, B claims the key; from
/// then on nothing A does (complete, renew, release) touches the key, and B's record stands.
async fn stale_holder_cannot_overwrite_a_newer_holder(backend: Backend) {
    let env = Env::new(backend).await;
    store_checks::stale_holder_cannot_overwrite_a_newer_holder(&env.store_handle().await).await;
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
    assert_replay_status_and_body(&repeat, &second);
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
    assert_replay_status_and_body(&repeat, &second);
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
    harness::warm_up();
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
    assert_replay_status_and_body(&again, &forwarded);
    assert_eq!(env.mock.calls(key), 2);
    in_flight.abort();
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
    assert_replay_status_and_body(&book_with(&base, "limbo", BODY, &[]).await, &forwarded);
}
