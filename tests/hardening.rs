//! Faults found in review, each with the test that showed it: a waiter forwarded next to the
//! running first request, WRONGTYPE records, `forward_key: false` on the unprotected path,
//! headers named in `Connection`, saves the store keeps refusing, and the upstream keep-alive
//! race (SPEC §4.3–§4.5).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::relay::{Direction, Relay, Tap};
use common::{
    Backend, Env, Reply, TestProxy, book_with, booking_store_key, client, eventually, send,
    spawn_booking,
};
use idemproxy::metrics::Outcome;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The request body every booking here sends.
const BODY: &str = r#"{"seat":"12A"}"#;

async fn post(proxy: &TestProxy, key: &str, extra: &[(&str, &str)]) -> Reply {
    book_with(&proxy.url(""), key, BODY, extra).await
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
    let second = spawn_booking(proxy.url(""), key, BODY, "2500ms");
    // Let the second one see the claim and start waiting, then stall Redis past the store
    // timeout (300ms) so that its next poll fails.
    tokio::time::sleep(Duration::from_millis(200)).await;
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
            let r = post(proxy, key, &[]).await;
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

/// `forward_key: false` holds on the unprotected path too: with Redis dead and
/// `on_store_error: forward`, the upstream gets the request without the key header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_forward_key_false_holds_when_forwarding_unprotected() {
    let mut env = Env::new(Backend::Redis).await;
    let proxy = env
        .proxy(&env.config("on_store_error: forward\nforward_key: false"))
        .await;
    // Protected first: the key is not forwarded.
    assert_eq!(post(&proxy, "fk-protected", &[]).await.status, 201);
    let seen = env.mock.last_request().expect("a request reached the mock");
    assert!(seen.headers.get("idempotency-key").is_none());

    env.redis_mut().kill();
    let r = post(&proxy, "fk-unprotected", &[]).await;
    assert_eq!(r.status, 201, "forwarded unprotected: {:?}", r.body);
    let seen = env.mock.last_request().expect("a request reached the mock");
    assert!(
        seen.headers.get("idempotency-key").is_none(),
        "forward_key: false, even unprotected: {:?}",
        seen.headers
    );
    assert_eq!(
        env.mock.stats().total,
        2,
        "both requests reached the upstream"
    );
}

// ---------------------------------------------------------------------------------------------
// Connection naming a header that idempotency reads
// ---------------------------------------------------------------------------------------------

every_store!(connection_naming_the_key_scope_or_fingerprint_header_is_refused);

/// A `Connection` header that names the key header, a scope header or a fingerprinted header
/// would strip it before the upstream although the key, its namespace or the fingerprint were
/// read from it. The proxy refuses it with a 400 of its own type; nothing is claimed.
async fn connection_naming_the_key_scope_or_fingerprint_header_is_refused(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env
        .proxy(&env.config("fingerprint: [method, path, body, \"header:X-Tenant\"]"))
        .await;
    for (n, named) in ["Idempotency-Key", "authorization", "x-tenant, keep-alive"]
        .iter()
        .enumerate()
    {
        let key = format!("conn-{n}");
        let r = post(
            &proxy,
            &key,
            &[
                ("Connection", named),
                ("Authorization", "Bearer a"),
                ("X-Tenant", "t1"),
            ],
        )
        .await;
        let doc = r.assert_problem(400, "hop-by-hop-conflict");
        assert!(
            doc["detail"]
                .as_str()
                .unwrap_or("")
                .contains(&named.split(',').next().unwrap_or("").to_ascii_lowercase()),
            "the detail names the header: {doc}"
        );
        assert_eq!(env.mock.calls(&key), 0, "nothing forwarded");
        if let Some(keys) = env.stored_key_names() {
            assert_eq!(keys.len(), n, "the refusal claimed nothing: {keys:?}");
        }
        // Nothing was claimed: the same key without the Connection header runs.
        let ok = post(
            &proxy,
            &key,
            &[("Authorization", "Bearer a"), ("X-Tenant", "t1")],
        )
        .await;
        assert_eq!(ok.status, 201, "{:?}", ok.body);
        assert_eq!(env.mock.calls(&key), 1);
    }
    // A Connection header naming anything else is fine (and stripped as usual).
    let r = post(&proxy, "conn-other", &[("Connection", "x-other")]).await;
    assert_eq!(r.status, 201);
    // Counted as observe mode counts them (`would="invalid_key"`), not as a bad body.
    assert_eq!(proxy.requests("create-booking", Outcome::InvalidKey), 3);
    assert_eq!(proxy.requests("create-booking", Outcome::BadRequest), 0);
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
    let r = post(&proxy, "oom-1", &[("X-Mock-Delay", "750ms")]).await;
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
        let r = post(&proxy, key, &[("X-Mock-Delay", delay)]).await;
        assert_eq!(r.status, 201);
        assert_eq!(r.header("idempotent-replayed"), "true", "{key} replayed");
    }
    let r = post(&proxy, "oom-0", &[("X-Mock-Delay", "600ms")]).await;
    r.assert_problem(502, "result-not-kept");
    assert_eq!(r.header("idempotent-replayed"), "true", "oom-0 replayed");
    for key in keys {
        assert_eq!(env.mock.calls(key), 1, "{key} ran once");
    }
    assert_eq!(proxy.lost_leases(), 0, "no lease was lost");
}

// ---------------------------------------------------------------------------------------------
// §4.3 The upstream keep-alive race
// ---------------------------------------------------------------------------------------------

/// An upstream 20ms away that closes keep-alive connections idle for 2s, like gunicorn: a TCP
/// relay in front of the mock. When a connection has been idle 2s it starts closing: for the
/// next 20ms (the close travelling back) whatever the proxy writes into it is lost, then it is
/// closed. Returns the relay's address.
async fn idle_closing_upstream(target: std::net::SocketAddr) -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind relay");
    let addr = listener.local_addr().expect("relay addr");
    tokio::spawn(async move {
        while let Ok((down, _)) = listener.accept().await {
            tokio::spawn(async move {
                let Ok(up) = TcpStream::connect(target).await else {
                    return;
                };
                relay_until_idle(down, up).await;
            });
        }
    });
    addr
}

async fn relay_until_idle(down: TcpStream, up: TcpStream) {
    let idle = Duration::from_secs(2);
    let latency = Duration::from_millis(20);
    let (mut dr, mut dw) = down.into_split();
    let (mut ur, mut uw) = up.into_split();
    let mut from_down = vec![0u8; 64 * 1024];
    let mut from_up = vec![0u8; 64 * 1024];
    loop {
        tokio::select! {
            n = dr.read(&mut from_down) => {
                let Ok(n @ 1..) = n else { return };
                tokio::time::sleep(latency).await;
                if uw.write_all(&from_down[..n]).await.is_err() { return; }
            }
            n = ur.read(&mut from_up) => {
                let Ok(n @ 1..) = n else { return };
                tokio::time::sleep(latency).await;
                if dw.write_all(&from_up[..n]).await.is_err() { return; }
            }
            () = tokio::time::sleep(idle) => {
                // Closing: what arrives now is lost, then the connection goes.
                let until = tokio::time::Instant::now() + latency;
                while let Ok(Ok(1..)) = tokio::time::timeout_at(until, dr.read(&mut from_down)).await {}
                return;
            }
        }
    }
}

/// Requests from several lanes, each lane sending again after an idle gap spread around the
/// upstream's 2s idle limit. Returns every reply with its key.
async fn requests_around_the_idle_limit(proxy: &TestProxy, prefix: &str) -> Vec<(String, Reply)> {
    let lanes = 10;
    let mut tasks = Vec::new();
    for lane in 0..lanes {
        let url = proxy.url("/bookings");
        let prefix = prefix.to_owned();
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            // Gaps from 1.96s to 2.05s: some requests land as the upstream closes.
            let gap = Duration::from_millis(1960 + 10 * lane);
            for round in 0..3 {
                let key = format!("{prefix}-{lane}-{round}");
                let r = send(
                    client()
                        .post(&url)
                        .header("Idempotency-Key", &key)
                        .body(BODY),
                )
                .await;
                out.push((key, r));
                tokio::time::sleep(gap).await;
            }
            out
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("lane"));
    }
    all
}

/// With the defaults (`pool_idle_timeout: 1s`, `on_unknown_outcome: keep`), a connection idle
/// long enough for the upstream to drop it is never reused: no 5xx, every booking made once.
/// (With a 60s pool idle timeout, as before the fix, some of these got a saved 502.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_race_defaults_never_reuse_a_connection_the_upstream_drops() {
    let env = Env::new(Backend::Memory).await;
    let relay = idle_closing_upstream(env.mock.addr()).await;
    let yaml = env
        .config("")
        .replace(&env.mock.url(), &format!("http://{relay}"));
    let proxy = env.proxy(&yaml).await;
    let replies = requests_around_the_idle_limit(&proxy, "ka").await;
    assert_eq!(replies.len(), 30);
    for (key, r) in &replies {
        assert_eq!(r.status, 201, "{key}: {:?}", r.body);
        assert_eq!(env.mock.calls(key), 1, "{key} booked once");
    }
}

/// Under `on_unknown_outcome: release` only, a request that got no response on a reused
/// connection is sent once more on a fresh one. Forced here with connections kept for 60s:
/// requests written into connections the upstream is closing are resent, so no 5xx, and each
/// booking is made once (the lost write never reached the upstream).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_race_release_resends_on_a_fresh_connection() {
    let env = Env::new(Backend::Memory).await;
    let relay = idle_closing_upstream(env.mock.addr()).await;
    let yaml = env.config("on_unknown_outcome: release").replace(
        &env.mock.url(),
        &format!("http://{relay}\n    pool_idle_timeout: 60s"),
    );
    let proxy = env.proxy(&yaml).await;
    let replies = requests_around_the_idle_limit(&proxy, "rel").await;
    for (key, r) in &replies {
        assert_eq!(r.status, 201, "{key}: {:?}", r.body);
        assert_eq!(env.mock.calls(key), 1, "{key} booked once");
    }
}

/// The harness's configuration for `upstream`, on one worker (so one pool holds every upstream
/// connection), with the upstream's `extra` lines.
fn one_worker_to(env: &Env, idem: &str, upstream: std::net::SocketAddr, extra: &str) -> String {
    let yaml = env.config(idem);
    let out = yaml
        .replacen("workers: 2\n", "workers: 1\n", 1)
        .replace(&env.mock.url(), &format!("http://{upstream}{extra}"));
    assert!(
        out.contains("workers: 1\n") && out.contains(&upstream.to_string()),
        "the harness's configuration changed shape:\n{yaml}"
    );
    out
}

/// Keeps what the proxy wrote on each upstream connection (the first 64 KiB of each), to tell
/// which connection carried which request.
#[derive(Default)]
struct Written(std::sync::Mutex<std::collections::BTreeMap<u64, Vec<u8>>>);

impl Tap for Written {
    fn forwarded(&self, conn: u64, dir: Direction, bytes: &[u8]) {
        if dir != Direction::Up {
            return;
        }
        let mut all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let kept = all.entry(conn).or_default();
        let room = (64 * 1024usize).saturating_sub(kept.len());
        kept.extend_from_slice(&bytes[..bytes.len().min(room)]);
    }
}

impl Written {
    /// The connections on which `needle` was written.
    fn connections_with(&self, needle: &str) -> Vec<u64> {
        let all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        all.iter()
            .filter(|(_, bytes)| bytes.windows(needle.len()).any(|w| w == needle.as_bytes()))
            .map(|(conn, _)| *conn)
            .collect()
    }
}

/// SPEC §4.3: the upstream counts a connection idle from when it sent the last byte of a
/// response, which for a large body streamed to a slow client is long before the proxy has read
/// it all. A 16 MB pass-through response whose client pauses 2s mid-body, then an idempotent
/// POST, with `pool_idle_timeout: 500ms`: the POST goes on a fresh connection, because the idle
/// time counts from the response head's arrival. (Counted from the body's end, as before, the
/// connection looked fresh and was lent, though the upstream had seen it idle for 2s: with an
/// upstream that closes idle connections a little late, a reset and, under `keep`, a saved
/// 502 for a booking never made.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_whose_body_was_read_slowly_is_not_lent_again() {
    const SIZE: usize = 16_000_000;
    let env = Env::new(Backend::Memory).await;
    let written = Arc::new(Written::default());
    let relay = Relay::start_with_tap(env.mock.addr(), written.clone()).await;
    let yaml = one_worker_to(&env, "", relay.addr(), "\n    pool_idle_timeout: 500ms");
    let proxy = env.proxy(&yaml).await;

    // A client with a small receive buffer, so the proxy cannot run far ahead of it.
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(32 * 1024).expect("SO_RCVBUF");
    let mut slow = socket.connect(proxy.addr).await.expect("connect");
    let get = format!(
        "GET /downloads/big HTTP/1.1\r\nHost: proxy.test\r\nX-Mock-Body-Size: {SIZE}\r\n\r\n"
    );
    slow.write_all(get.as_bytes()).await.expect("write");
    let mut buf = vec![0u8; 64 * 1024];
    let mut got = 0usize;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut paused = false;
    while got < SIZE {
        if !paused && got >= 1_000_000 {
            // The upstream sent its whole body long ago; the proxy is still reading it.
            tokio::time::sleep(Duration::from_secs(2)).await;
            paused = true;
        }
        match tokio::time::timeout_at(deadline, slow.read(&mut buf)).await {
            Ok(Ok(n @ 1..)) => got += n,
            other => panic!("the download stopped after {got} bytes: {other:?}"),
        }
    }
    assert!(paused, "the client paused mid-body");
    let downloads = written.connections_with("GET /downloads/big");
    assert_eq!(downloads.len(), 1, "one connection carried the download");

    let r = post(&proxy, "after-slow-read", &[]).await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    assert_eq!(env.mock.calls("after-slow-read"), 1);
    let posted = written.connections_with("after-slow-read");
    assert_eq!(posted.len(), 1, "the POST went out once");
    assert_ne!(
        posted, downloads,
        "the POST went on a fresh connection, not the one idle 2s on the upstream's side"
    );
}

/// An upstream that answers the first request on each connection, then resets the connection
/// (`SO_LINGER 0`) when the next one arrives, before any byte of an answer and without passing
/// it on: what a server that closed a keep-alive connection with a request unread sends.
/// A relay in front of `target`; returns its address.
async fn resetting_second_requests(target: std::net::SocketAddr) -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind relay");
    let addr = listener.local_addr().expect("relay addr");
    tokio::spawn(async move {
        while let Ok((down, _)) = listener.accept().await {
            tokio::spawn(async move {
                let Ok(up) = TcpStream::connect(target).await else {
                    return;
                };
                let (mut dr, mut dw) = down.into_split();
                let (mut ur, mut uw) = up.into_split();
                let mut from_down = vec![0u8; 64 * 1024];
                let mut from_up = vec![0u8; 64 * 1024];
                let mut answered = false;
                loop {
                    tokio::select! {
                        n = dr.read(&mut from_down) => {
                            let Ok(n @ 1..) = n else { return };
                            if answered {
                                // A second request: reset, pass nothing on.
                                if let Ok(down) = dr.reunite(dw) {
                                    let _ = down.set_zero_linger();
                                }
                                return;
                            }
                            if uw.write_all(&from_down[..n]).await.is_err() { return; }
                        }
                        n = ur.read(&mut from_up) => {
                            let Ok(n @ 1..) = n else { return };
                            answered = true;
                            if dw.write_all(&from_up[..n]).await.is_err() { return; }
                        }
                    }
                }
            });
        }
    });
    addr
}

/// SPEC §4.3: under `on_unknown_outcome: release`, a request that got no response byte on a
/// reused connection — here the connection is reset as the request arrives — is sent once more
/// on a fresh connection: the client gets the booking, made once. (Only a clean close was
/// resent before; a reset was a 502.) Under `keep`, nothing is sent twice: the proxy cannot
/// know the upstream did not act, so the 502 is the key's result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_on_a_reused_connection_is_resent_once_on_a_fresh_one_under_release() {
    let env = Env::new(Backend::Memory).await;
    let relay = resetting_second_requests(env.mock.addr()).await;
    let release = env
        .proxy(&one_worker_to(
            &env,
            "on_unknown_outcome: release",
            relay,
            "",
        ))
        .await;
    let first = post(&release, "rel-first", &[]).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    // The pooled connection is reused, and reset as this request arrives.
    let second = post(&release, "rel-second", &[]).await;
    assert_eq!(
        second.status, 201,
        "resent on a fresh connection: {:?}",
        second.body
    );
    assert_eq!(second.header("idempotent-replayed"), "");
    assert_eq!(env.mock.calls("rel-second"), 1, "booked once");
    let again = post(&release, "rel-second", &[]).await;
    assert_eq!(again.header("idempotent-replayed"), "true");
    assert_eq!(again.body, second.body);
    assert_eq!(env.mock.calls("rel-second"), 1);
    release.stop().await;

    let keep = env.proxy(&one_worker_to(&env, "", relay, "")).await;
    let first = post(&keep, "keep-first", &[]).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    let second = post(&keep, "keep-second", &[]).await;
    second.assert_problem(502, "upstream-failed");
    assert_eq!(env.mock.calls("keep-second"), 0, "never resent under keep");
}

// ---------------------------------------------------------------------------------------------
// Bounded resources against hostile clients
// ---------------------------------------------------------------------------------------------

/// Reads until the peer closes; returns what arrived, or `None` if it stayed open `within`.
async fn read_until_closed(stream: &mut TcpStream, within: Duration) -> Option<Vec<u8>> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(got),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// Hundreds of connections that stay silent, stop mid-head or trickle a body: the proxy keeps
/// answering other clients at once, closes every one of them within the limits (a 408 problem
/// for a body that stops coming), claims nothing for them, and its memory stays bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_silent_clients_are_closed_and_others_still_served() {
    let env = Env::new(Backend::Memory).await;
    let yaml = env.config("").replace(
        "shutdown_timeout: 10s\n",
        "shutdown_timeout: 10s\nlimits:\n  header_read_timeout: 1s\n  body_read_timeout: 2s\n",
    );
    let proxy = common::ProxyProcess::spawn(&yaml);
    let rss = |pid: u32| -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap_or(0)
            * 1024
    };
    let before = rss(proxy.pid());
    let addr = proxy.addr;
    let mut hostile = Vec::new();
    for i in 0..300 {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        match i % 3 {
            0 => {} // silent
            1 => s
                .write_all(b"POST /bookings HTTP/1.1\r\nHost: x\r\nIdempotency-Key: slow-head\r\n")
                .await
                .expect("write head"),
            _ => {
                let head = format!(
                    "POST /bookings HTTP/1.1\r\nHost: x\r\nIdempotency-Key: slow-body-{i}\r\nContent-Length: 1000000\r\n\r\n"
                );
                s.write_all(head.as_bytes()).await.expect("write head");
                s.write_all(&vec![b'x'; 60_000])
                    .await
                    .expect("write part of the body");
            }
        }
        hostile.push((i, s));
    }
    // Other clients are served meanwhile, promptly.
    for n in 0..5 {
        let started = Instant::now();
        let r = send(
            client()
                .post(proxy.url("/bookings"))
                .header("Idempotency-Key", format!("ok-{n}"))
                .body(BODY),
        )
        .await;
        assert_eq!(r.status, 201);
        assert!(started.elapsed() < Duration::from_secs(1), "served at once");
    }
    let during = rss(proxy.pid());
    let closed = Arc::new(AtomicUsize::new(0));
    let mut waits = Vec::new();
    for (i, mut s) in hostile {
        let closed = closed.clone();
        waits.push(tokio::spawn(async move {
            let got = read_until_closed(&mut s, Duration::from_secs(6)).await;
            let got = got.unwrap_or_else(|| panic!("connection {i} was left open"));
            if i % 3 == 2 {
                let text = String::from_utf8_lossy(&got);
                assert!(
                    text.starts_with("HTTP/1.1 408")
                        && text.contains("application/problem+json")
                        && text.contains("urn:idemproxy:problem:request-body-timeout"),
                    "a body that stops coming gets a 408 problem: {text}"
                );
            }
            closed.fetch_add(1, Ordering::Relaxed);
        }));
    }
    for w in waits {
        w.await.expect("hostile connection");
    }
    assert_eq!(closed.load(Ordering::Relaxed), 300);
    assert_eq!(
        env.mock.stats().total,
        5,
        "nothing of theirs reached the upstream"
    );
    assert!(
        during.saturating_sub(before) < 96 * 1024 * 1024,
        "memory stays bounded: {before} -> {during} bytes"
    );
}

/// Clients that leave while their exchange runs: the exchanges finish (their results are
/// saved, so the retries replay), at most `limits.max_detached_exchanges` of them at once;
/// past it, new idempotent requests get a 503 `overloaded` problem before anything is claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detached_exchanges_are_bounded() {
    let env = Env::new(Backend::Memory).await;
    let yaml = env.config("").replace(
        "shutdown_timeout: 10s\n",
        "shutdown_timeout: 10s\nlimits:\n  max_detached_exchanges: 10\n",
    );
    let proxy = env.proxy(&yaml).await;
    // A flood of 40 requests whose clients give up after 600ms.
    let quick = reqwest::Client::builder()
        .timeout(Duration::from_millis(600))
        .build()
        .expect("client");
    let mut flood = Vec::new();
    for n in 0..40 {
        let req = quick
            .post(proxy.url("/bookings"))
            .header("Idempotency-Key", format!("flood-{n}"))
            .header("X-Mock-Delay", "2500ms")
            .body(BODY);
        flood.push(tokio::spawn(async move { req.send().await.is_err() }));
    }
    for f in flood {
        assert!(f.await.expect("flood request"), "the client gave up");
    }
    // Every flood request that reached the exchange before its client left is detached now
    // (one whose client left even earlier never started one).
    let detached = gauge(&proxy, "idemproxy_detached_exchanges");
    assert!(
        detached > 10,
        "the flood's exchanges outlive their clients: {detached}"
    );
    let r = post(&proxy, "after-flood", &[]).await;
    r.assert_problem(503, "overloaded");
    assert!(!r.header("retry-after").is_empty());
    assert_eq!(
        env.mock.calls("after-flood"),
        0,
        "nothing claimed or forwarded"
    );
    // Once they finish, requests go through again, and the flood's retries are replays.
    assert!(
        eventually(Duration::from_secs(8), || gauge(
            &proxy,
            "idemproxy_detached_exchanges"
        ) == 0)
        .await
    );
    assert_eq!(post(&proxy, "after-flood", &[]).await.status, 201);
    let mut replayed = 0;
    for n in 0..40 {
        let key = format!("flood-{n}");
        let r = post(&proxy, &key, &[("X-Mock-Delay", "2500ms")]).await;
        assert_eq!(r.status, 201, "{key}");
        replayed += usize::from(r.header("idempotent-replayed") == "true");
        assert_eq!(env.mock.calls(&key), 1, "{key} ran once");
    }
    assert!(
        replayed as i64 >= detached,
        "the detached exchanges saved their results"
    );
}

/// The value of a metric without labels.
fn gauge(proxy: &TestProxy, name: &str) -> i64 {
    let text = proxy.metrics().encode();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} not found in:\n{text}"))
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
    let claims = || {
        let text = proxy.metrics().encode();
        text.lines()
            .find(|l| {
                l.starts_with("idemproxy_store_operation_duration_seconds_count{op=\"claim\"}")
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // Each waiter may finish the poll it was in; after that, nothing.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let settled = claims();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(claims(), settled, "no more polling after the clients left");
    assert_eq!(first.await.expect("first").status, 201);
    assert_eq!(env.mock.calls(key), 1);
}
