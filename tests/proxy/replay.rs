//! Saving a result and replaying it (SPEC §4.2, §4.3, §4.5): a repeat gets the first response
//! byte for byte; what is never saved (retry statuses, bodies over `max_response_body`,
//! `Set-Cookie` unless asked) and what is (upstream errors, a 400); saves the store refuses or
//! loses, kept in the background within their bounds; over HTTP/1.1 and HTTP/2.

use crate::support::{
    BODY, SEAT, assert_forwarded, assert_fresh, assert_replay_of, assert_replay_status_and_body,
    base, post, post_booking, ttl_of, until_calls,
};
use harness::every_store;
use harness::relay::Relay;
use harness::{Backend, Env, book, book_with, booking_store_key, client, eventually, send};
use idemproxy::record::Record;
use reqwest::header::HeaderName;
use std::time::{Duration, Instant};

every_store!(
    first_request_is_forwarded_and_repeat_replayed,
    large_response_replays_byte_identical,
    replay_is_byte_identical,
    response_over_max_response_body_is_not_replayable,
    upstream_error_statuses_are_saved_and_replayed,
    retry_statuses_are_not_saved,
    custom_retry_statuses,
    hop_by_hop_response_headers_are_not_forwarded_or_replayed,
    set_cookie_is_not_replayed_by_default,
    set_cookie_is_replayed_with_replay_set_cookie,
    client_disconnect_does_not_cancel_the_operation,
    an_application_400_is_saved_and_replayed,
    a_400_that_closes_the_connection_is_saved_and_replayed,
    h2c_clients_get_forwarding_and_replays,
);

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
        let expected = harness::store_key(
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

// ---------------------------------------------------------------------------------------------
// §4.5 A save the store keeps refusing is bounded
// ---------------------------------------------------------------------------------------------

/// Redis out of memory under `noeviction` refuses the save (`SET`) while renewals (`PEXPIRE`)
/// still work: the saves go on in the background, bounded by `limits.max_pending_saves`; past
/// it the oldest lets go of its response (logged with its key's hash, counted) but keeps its
/// lease; the pending count is a metric; once Redis has room, the saves still pending land and
/// are replayed, the oldest as a `result-not-kept` problem.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_saves_refused_for_lack_of_memory_are_bounded_and_land_later() {
    let env = Env::new(Backend::Redis).await;
    let yaml = env.config("lock_ttl: 3s").replace(
        "shutdown_timeout: 10s\n",
        "shutdown_timeout: 10s\nlimits:\n  max_pending_saves: 2\n",
    );
    let proxy = env.proxy(&yaml).await;
    let mut conn = env.redis().conn();
    let _: () = ::redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("noeviction")
        .query(&mut conn)
        .expect("CONFIG SET");

    let keys: [&'static str; 3] = ["oom-0", "oom-1", "oom-2"];
    let mut tasks = Vec::new();
    for (i, key) in keys.into_iter().enumerate() {
        let url = proxy.url("/bookings");
        // Staggered, so that the first one is the oldest pending save.
        let delay = format!("{}ms", 600 + 150 * i);
        tasks.push(tokio::spawn(async move {
            send(
                client()
                    .post(url)
                    .header("Idempotency-Key", key)
                    .header("X-Mock-Delay", delay)
                    .body(BODY),
            )
            .await
        }));
    }
    assert!(
        eventually(Duration::from_secs(3), || keys
            .iter()
            .all(|k| env.mock.calls(k) == 1))
        .await,
        "all three claimed and forwarded"
    );
    // Now Redis is out of memory: every write that may grow it is refused.
    let _: () = ::redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg(1)
        .query(&mut conn)
        .expect("CONFIG SET maxmemory");
    for t in tasks {
        let r = t.await.expect("request");
        assert_eq!(
            r.status, 201,
            "the client still gets its answer: {:?}",
            r.body
        );
    }
    let metrics = || proxy.metrics().encode();
    assert!(
        eventually(Duration::from_secs(2), || metrics().contains(
            r#"idemproxy_results_not_kept_total{route="create-booking"} 1"#
        ))
        .await,
        "past max_pending_saves the oldest lets go of its response:\n{}",
        metrics()
    );
    assert!(
        metrics().contains("idemproxy_pending_saves 3"),
        "{}",
        metrics()
    );
    // Meanwhile a repeat is never a second run (Redis refuses even the claim: a 503).
    let r = post_booking(&proxy, "oom-1", &[("X-Mock-Delay", "750ms")]).await;
    r.assert_problem(503, "store-unavailable");

    // Redis has room again: the two pending saves land; their repeats are replays.
    let _: () = ::redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg(0)
        .query(&mut conn)
        .expect("CONFIG SET maxmemory 0");
    assert!(
        eventually(Duration::from_secs(8), || metrics()
            .contains("idemproxy_pending_saves 0"))
        .await,
        "the pending saves landed:\n{}",
        metrics()
    );
    for (key, delay) in [("oom-1", "750ms"), ("oom-2", "900ms")] {
        let r = post_booking(&proxy, key, &[("X-Mock-Delay", delay)]).await;
        assert_eq!(r.status, 201);
        assert_eq!(r.header("idempotent-replayed"), "true", "{key} replayed");
    }
    let r = post_booking(&proxy, "oom-0", &[("X-Mock-Delay", "600ms")]).await;
    r.assert_problem(502, "result-not-kept");
    assert_eq!(r.header("idempotent-replayed"), "true", "oom-0 replayed");
    for key in keys {
        assert_eq!(env.mock.calls(key), 1, "{key} ran once");
    }
    assert_eq!(proxy.lost_leases(), 0, "no lease was lost");
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
    assert_replay_status_and_body(&replay, &first);
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
    assert_replay_status_and_body(&replay, &first);
    assert_eq!(env.mock.calls("cut-1"), 1, "nothing ran twice");
    assert_eq!(proxy.lost_leases(), 0, "nothing lost");
}

fn redis_config(conn: &mut ::redis::Connection, name: &str, value: &str) {
    let _: () = ::redis::cmd("CONFIG")
        .arg("SET")
        .arg(name)
        .arg(value)
        .query(conn)
        .unwrap_or_else(|e| panic!("CONFIG SET {name} {value}: {e}"));
}

// ---------------------------------------------------------------------------------------------
// §4.5 A save that can't be kept pending is downgraded, never given up while its lease is valid
// ---------------------------------------------------------------------------------------------

/// Two 4000-byte results are refused by a Redis out of memory (`noeviction` refuses the save's
/// `SET` and still takes `PEXPIRE`), and together they are over `max_pending_save_bytes`. The
/// older one can't be kept: it must keep its lease and save a `502 result-not-kept` in place of
/// its response once Redis has room, so its retry is a replay of that problem and the upstream
/// ran once (before the fix it was dropped, its lease expired, and its retry ran it again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_save_past_the_pending_bytes_bound_keeps_its_lease_and_saves_result_not_kept() {
    let env = Env::new(Backend::Redis).await;
    let yaml = env
        .config("lock_ttl: 1s\nmax_response_body: 4KiB")
        .replace(
            "shutdown_timeout: 10s\n",
            "shutdown_timeout: 10s\nlimits:\n  max_pending_save_bytes: 6KiB\n",
        )
        // The harness's other idempotent route must fit the bound too (refused at load otherwise).
        .replace(
            "      lock_ttl: 2s\n",
            "      lock_ttl: 2s\n      max_response_body: 4KiB\n",
        );
    let proxy = env.proxy(&yaml).await;
    let mut conn = env.redis().conn();
    redis_config(&mut conn, "maxmemory-policy", "noeviction");

    // Staggered, so that "kept-0" is the older pending save.
    let mut firsts = Vec::new();
    for (key, delay) in [("kept-0", "1s"), ("kept-1", "1200ms")] {
        let base = proxy.url("");
        firsts.push(tokio::spawn(async move {
            book_with(
                &base,
                key,
                BODY,
                &[("X-Mock-Delay", delay), ("X-Mock-Body-Size", "4000")],
            )
            .await
        }));
    }
    assert!(
        eventually(Duration::from_secs(3), || env.mock.calls("kept-0") == 1
            && env.mock.calls("kept-1") == 1)
        .await,
        "both claimed and forwarded"
    );
    redis_config(&mut conn, "maxmemory", "1");
    for first in firsts {
        let r = first.await.expect("first request");
        assert_eq!(r.status, 201, "the client still gets its answer");
        assert_eq!(r.body.len(), 4000);
    }
    let metrics = || proxy.metrics().encode();
    // Longer than lock_ttl: only renewals keep both claims alive.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    redis_config(&mut conn, "maxmemory", "0");
    assert!(
        eventually(Duration::from_secs(5), || metrics()
            .contains("idemproxy_pending_saves 0"))
        .await,
        "both saves landed:\n{}",
        metrics()
    );

    let r = book_with(
        &proxy.url(""),
        "kept-0",
        BODY,
        &[("X-Mock-Delay", "1s"), ("X-Mock-Body-Size", "4000")],
    )
    .await;
    assert_eq!(
        env.mock.calls("kept-0"),
        1,
        "kept-0 ran once; its retry got {} (replayed: {:?})",
        r.status,
        r.header("idempotent-replayed")
    );
    let doc = r.assert_problem(502, "result-not-kept");
    assert_eq!(r.header("idempotent-replayed"), "true", "a replay: {doc}");
    let r = book_with(
        &proxy.url(""),
        "kept-1",
        BODY,
        &[("X-Mock-Delay", "1200ms"), ("X-Mock-Body-Size", "4000")],
    )
    .await;
    assert_eq!(r.status, 201);
    assert_eq!(r.header("idempotent-replayed"), "true");
    assert_eq!(&r.body[..], &idemproxy_mock::body_pattern(4000)[..]);
    assert_eq!(env.mock.calls("kept-1"), 1, "kept-1 ran once");
    assert_eq!(proxy.lost_leases(), 0, "no lease was lost");
    assert!(
        metrics().contains(r#"idemproxy_results_not_kept_total{route="create-booking"} 1"#),
        "the older save was downgraded, and counted:\n{}",
        metrics()
    );
    assert!(
        metrics().contains(r#"idemproxy_saves_abandoned_total{route="create-booking"} 0"#),
        "nothing was abandoned:\n{}",
        metrics()
    );
}

/// An application's `400` (its connection stays open) is the operation's result: saved and
/// replayed.
async fn an_application_400_is_saved_and_replayed(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("")).await;
    let first = post_booking(&proxy, "app-400", &[("X-Mock-Status", "400")]).await;
    assert_eq!(first.status, 400);
    let again = post_booking(&proxy, "app-400", &[("X-Mock-Status", "400")]).await;
    assert_eq!(again.status, 400);
    assert_eq!(again.header("idempotent-replayed"), "true");
    assert_eq!(again.body, first.body);
    assert_eq!(env.mock.calls("app-400"), 1);
}

/// SPEC §4.3: a `400` is the operation's result whatever headers come with it. An upstream that
/// closes every connection (gunicorn's `sync` worker, Apache with `KeepAlive Off`) sends
/// `Connection: close` with its application's "card declined" too: three tries with one key
/// reach it once, and the two repeats replay its `400` and JSON body. (Before, a `400` with
/// `Connection: close` was taken for a parser's refusal of the head: never saved, every retry
/// ran the operation again.)
async fn a_400_that_closes_the_connection_is_saved_and_replayed(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("")).await;
    let closing_400 = [
        ("X-Mock-Status", "400"),
        ("X-Mock-Header", "Connection: close"),
    ];
    let first = post_booking(&proxy, "declined", &closing_400).await;
    assert_eq!(first.status, 400, "the upstream's answer: {:?}", first.body);
    assert_eq!(first.header("content-type"), "application/json");
    let doc: serde_json::Value = serde_json::from_slice(&first.body).expect("a JSON body");
    assert_eq!(doc["status"], 400, "the upstream's own body: {doc}");
    assert_eq!(first.header("idempotent-replayed"), "");
    assert_eq!(first.header("connection"), "", "hop-by-hop, not passed on");
    for attempt in 2..=3 {
        let again = post_booking(&proxy, "declined", &closing_400).await;
        assert_eq!(again.status, 400, "attempt {attempt}");
        assert_eq!(
            again.header("idempotent-replayed"),
            "true",
            "attempt {attempt}"
        );
        assert_eq!(again.header("content-type"), "application/json");
        assert_eq!(again.body, first.body, "attempt {attempt}: byte-identical");
    }
    assert_eq!(
        env.mock.calls("declined"),
        1,
        "the upstream ran the operation once"
    );
}

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
