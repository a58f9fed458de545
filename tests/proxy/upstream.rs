//! Forwarding to the upstream (SPEC §4.3, §4.4): the headers sent and dropped, pass-through
//! routes, and every way an upstream call can end — not connected, reset, timed out, cut short,
//! a refused request head — with what is saved, released or resent; the connection pool's
//! keep-alive races and bounds.

use crate::support::{
    BODY, SEAT, assert_forwarded, assert_fresh, assert_replay_of, assert_replay_status_and_body,
    base, post, post_booking,
};
use harness::every_store;
use harness::relay::{Direction, Relay, Tap};
use harness::{
    Backend, Env, Reply, TestProxy, book, book_with, client, eventually, free_port, mock, send,
};
use idemproxy::metrics::Outcome;
use idemproxy_mock::MockUpstream;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

every_store!(
    hop_by_hop_request_headers_removed_and_forwarded_headers_set,
    forwarded_for_without_incoming_header_is_the_client,
    forward_key_sends_the_key_as_received,
    forward_key_false_drops_the_key,
    passthrough_route_forwards_unchanged_and_streams,
    connect_failure_releases_the_claim,
    a_connect_that_hangs_is_released_as_a_502_never_saved_as_a_504,
    reset_after_sending_is_kept_as_a_502,
    timeout_is_kept_as_a_504,
    partial_response_is_an_unknown_outcome,
    release_lets_a_retry_run_again,
    upstream_head_refusals_are_passed_on_and_not_saved,
);

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

/// `forward_key: false` holds on the unprotected path too: with Redis dead and
/// `on_store_error: forward`, the upstream gets the request without the key header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_forward_key_false_holds_when_forwarding_unprotected() {
    let mut env = Env::new(Backend::Redis).await;
    let proxy = env
        .proxy(&env.config("on_store_error: forward\nforward_key: false"))
        .await;
    // Protected first: the key is not forwarded.
    assert_eq!(post_booking(&proxy, "fk-protected", &[]).await.status, 201);
    let seen = env.mock.last_request().expect("a request reached the mock");
    assert!(seen.headers.get("idempotency-key").is_none());

    env.redis_mut().kill();
    let r = post_booking(&proxy, "fk-unprotected", &[]).await;
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

    let r = post_booking(&proxy, "after-slow-read", &[]).await;
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
    let first = post_booking(&release, "rel-first", &[]).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    // The pooled connection is reused, and reset as this request arrives.
    let second = post_booking(&release, "rel-second", &[]).await;
    assert_eq!(
        second.status, 201,
        "resent on a fresh connection: {:?}",
        second.body
    );
    assert_eq!(second.header("idempotent-replayed"), "");
    assert_eq!(env.mock.calls("rel-second"), 1, "booked once");
    let again = post_booking(&release, "rel-second", &[]).await;
    assert_eq!(again.header("idempotent-replayed"), "true");
    assert_eq!(again.body, second.body);
    assert_eq!(env.mock.calls("rel-second"), 1);
    release.stop().await;

    let keep = env.proxy(&one_worker_to(&env, "", relay, "")).await;
    let first = post_booking(&keep, "keep-first", &[]).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    let second = post_booking(&keep, "keep-second", &[]).await;
    second.assert_problem(502, "upstream-failed");
    assert_eq!(env.mock.calls("keep-second"), 0, "never resent under keep");
}

/// The value of a metric without labels.
fn gauge(proxy: &TestProxy, name: &str) -> i64 {
    let text = proxy.metrics().encode();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} not found in:\n{text}"))
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
    let r = post_booking(&proxy, "after-flood", &[]).await;
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
    assert_eq!(post_booking(&proxy, "after-flood", &[]).await.status, 201);
    let mut replayed = 0;
    for n in 0..40 {
        let key = format!("flood-{n}");
        let r = post_booking(&proxy, &key, &[("X-Mock-Delay", "2500ms")]).await;
        assert_eq!(r.status, 201, "{key}");
        replayed += usize::from(r.header("idempotent-replayed") == "true");
        assert_eq!(env.mock.calls(&key), 1, "{key} ran once");
    }
    assert!(
        replayed as i64 >= detached,
        "the detached exchanges saved their results"
    );
}

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
    assert_replay_status_and_body(&again, &now);
    assert_eq!(
        upstream.calls("cf-1"),
        1,
        "the upstream ran the operation once"
    );
    let _ = stop.send(());
    let _ = served.await;
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
    assert_replay_status_and_body(&again, &now);
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
    assert_replay_status_and_body(&again, &first);
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
    assert_replay_status_and_body(&again, &first);
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
    assert_replay_status_and_body(&again, &first);
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
        assert_replay_status_and_body(&again, &retry);
        assert_eq!(env.mock.calls(key), 2, "{key}: then it is replayed");
    }
}

/// `431` and `414` from the upstream refuse the request's head: the operation never ran, so the
/// claim is released and the upstream's answer passed on; the retry runs again (before the fix
/// the refusal was saved and replayed).
async fn upstream_head_refusals_are_passed_on_and_not_saved(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("")).await;
    let refusals: [(&str, &[(&str, &str)]); 3] = [
        ("head-431", &[("X-Mock-Status", "431")]),
        ("head-414", &[("X-Mock-Status", "414")]),
        (
            "head-431-close",
            &[
                ("X-Mock-Status", "431"),
                ("X-Mock-Header", "Connection: close"),
            ],
        ),
    ];
    for (key, extra) in refusals {
        let status: u16 = extra[0].1.parse().expect("status");
        for attempt in 1..=2 {
            let r = post_booking(&proxy, key, extra).await;
            assert_eq!(r.status, status, "{key}: the upstream's answer, passed on");
            assert_eq!(
                r.header("idempotent-replayed"),
                "",
                "{key} attempt {attempt}: never replayed"
            );
            assert_eq!(r.header("connection"), "", "hop-by-hop, not passed on");
            assert_eq!(env.mock.calls(key), attempt, "{key}: each attempt ran");
        }
    }
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
    let proxy = harness::TestProxy::start(&yaml).await;
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
