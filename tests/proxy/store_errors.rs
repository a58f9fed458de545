//! The proxy when its store fails (SPEC §4.5): a paused, killed or restarted Redis answered with
//! 503 (or forwarded unprotected under `on_store_error: forward`) in bounded time and recovered
//! from without a restart; records it cannot read are store errors; an eviction policy that
//! could drop claims is warned about.

use crate::support::{BODY, assert_forwarded, assert_replay_status_and_body, base, post_booking};
use harness::{
    Backend, Env, ProxyProcess, RedisServer, Reply, book_with, booking_store_key, eventually,
};
use idemproxy::metrics::Outcome;
use std::time::{Duration, Instant};

/// WRONGTYPE: a value of another Redis type under a store key is a corrupt record — 503 and
/// never forwarded, not even with `on_store_error: forward` (before the fix: forwarded).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_wrongtype_under_a_store_key_is_a_corrupt_record() {
    let env = Env::new(Backend::Redis).await;
    let reject = env.proxy(&env.config("")).await;
    let forward = env.proxy(&env.config("on_store_error: forward")).await;
    let mut conn = env.redis().conn();
    let key = "a-list-lives-here";
    let _: i64 = ::redis::cmd("LPUSH")
        .arg(booking_store_key(key))
        .arg("not a record")
        .query(&mut conn)
        .expect("LPUSH");
    for proxy in [&reject, &forward] {
        for _ in 0..2 {
            let r = post_booking(proxy, key, &[]).await;
            let doc = r.assert_problem(503, "store-unavailable");
            assert!(
                doc["detail"].as_str().unwrap_or("").contains("WRONGTYPE"),
                "the detail names it: {doc}"
            );
        }
    }
    assert_eq!(env.mock.calls(key), 0, "never forwarded");
    let still: Vec<String> = ::redis::cmd("LRANGE")
        .arg(booking_store_key(key))
        .arg(0)
        .arg(-1)
        .query(&mut conn)
        .expect("LRANGE");
    assert_eq!(still, vec!["not a record".to_owned()], "left as it was");
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
    assert_replay_status_and_body(&again, &first);
    assert_eq!(env.mock.calls(&key), 1);
    let warm_again = book_with(&base, "warm", BODY, &[]).await;
    assert_replay_status_and_body(&warm_again, &warm);
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
    assert_replay_status_and_body(&again, &first);
    assert_eq!(env.mock.calls(&key), 1);
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
