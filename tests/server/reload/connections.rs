//! Connections across reloads: an unchanged upstream keeps its pool and a changed one drains
//! its own; new listener limits reach new connections only; and twenty reloads under load
//! drop no connection and fail no request.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::{BOOKINGS, PAY, REST, reload, reloads, yaml, yaml_to};
use harness::relay::Relay;
use harness::{Backend, Env, TestProxy, client, eventually, send};

/// `GET {base}/echo/{n}` through the pass-through route: 200.
async fn echo(base: &str, n: u32) {
    echo_on(&client(), base, n).await;
}

/// [`echo`] on `client`: on its kept-alive connection to the proxy, if it has one.
async fn echo_on(client: &reqwest::Client, base: &str, n: u32) {
    let reply = send(client.get(format!("{base}/echo/{n}"))).await;
    assert_eq!(reply.status, 200, "body: {:?}", reply.body);
}

/// The upstream settings that keep idle connections pooled.
const POOLED: &str = "    pool_idle_timeout: 30s\n";

/// A proxy whose upstream is the mock behind a relay, which counts the connections the proxy
/// opens to it: the relay, the upstream's URL and the proxy.
async fn pooled_through_a_relay(env: &Env) -> (Relay, String, TestProxy) {
    let relay = Relay::start(env.mock.addr()).await;
    let url = format!("http://{}", relay.addr());
    let p = env
        .proxy(&yaml_to(env, &url, "", POOLED, &[BOOKINGS, REST]))
        .await;
    (relay, url, p)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unchanged_upstream_keeps_its_pool_and_a_changed_one_drains_its_own() {
    let env = Env::new(Backend::Memory).await;
    let (relay, url, p) = pooled_through_a_relay(&env).await;
    // Every worker has a pool of its own for the upstream: the requests go over one
    // connection to the proxy, so one worker (and one pool) serves them all.
    let one = client();
    echo_on(&one, &p.url(""), 1).await;
    assert_eq!(relay.stats().accepted, 1);
    // Routes change, the upstream does not: its client and idle connection are kept.
    let changes = reload(&p, &yaml_to(&env, &url, "", POOLED, &[PAY, BOOKINGS, REST]));
    assert!(changes.upstreams_changed.is_empty(), "{changes}");
    echo_on(&one, &p.url(""), 2).await;
    assert_eq!(
        relay.stats().accepted,
        1,
        "the pooled connection was reused"
    );
    // The upstream changes: a new client, a new connection; the old client goes with the
    // generation that held it, and closes its idle connection.
    let changed = "    pool_idle_timeout: 29s\n";
    let changes = reload(
        &p,
        &yaml_to(&env, &url, "", changed, &[PAY, BOOKINGS, REST]),
    );
    assert_eq!(changes.upstreams_changed, ["booking"], "{changes}");
    echo_on(&one, &p.url(""), 3).await;
    assert_eq!(
        relay.stats().accepted,
        2,
        "a changed upstream connects afresh"
    );
    assert!(
        eventually(Duration::from_secs(5), || relay.stats().open == 1).await,
        "the old pool's connection is closed: {:?}",
        relay.stats()
    );
    echo_on(&one, &p.url(""), 4).await;
    assert_eq!(relay.stats().accepted, 2, "the new pool is reused in turn");
}

/// Each worker has its own client for an upstream, and keeps it across a reload that leaves
/// the upstream as it was: one upstream connection a worker, reused before and after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_worker_keeps_its_own_pool_across_a_reload() {
    let env = Env::new(Backend::Memory).await;
    let (relay, url, p) = pooled_through_a_relay(&env).await;
    // Sixteen connections to the proxy, spread by the kernel over the workers; one request
    // after another, so each worker's one upstream connection serves all of its requests.
    let clients: Vec<reqwest::Client> = (0..16).map(|_| client()).collect();
    for (n, c) in (0..).zip(&clients) {
        echo_on(c, &p.url(""), n).await;
    }
    let workers_serving = (0..2)
        .filter(|w| {
            let worker = w.to_string();
            p.metric("idemproxy_worker_connections_total", &[("worker", &worker)]) > 0.0
        })
        .count() as u64;
    assert_eq!(workers_serving, 2, "both workers took connections");
    assert_eq!(
        relay.stats().accepted,
        2,
        "one upstream connection a worker"
    );
    let changes = reload(&p, &yaml_to(&env, &url, "", POOLED, &[PAY, BOOKINGS, REST]));
    assert!(changes.upstreams_changed.is_empty(), "{changes}");
    for (n, c) in (100..).zip(&clients) {
        echo_on(c, &p.url(""), n).await;
    }
    assert_eq!(
        relay.stats().accepted,
        2,
        "every worker reused its pooled connection"
    );
}

/// Whether the proxy closed `conn` within `within` (it sends nothing on a silent connection:
/// a read ends at EOF or a reset when it closes).
async fn closed_within(conn: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 64];
    matches!(
        tokio::time::timeout(within, conn.read(&mut buf)).await,
        Ok(Ok(0) | Err(_))
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_listener_limits_reach_connections_accepted_after_the_reload_only() {
    let env = Env::new(Backend::Memory).await;
    let p = env.proxy(&yaml(&env, "", "", &[BOOKINGS, REST])).await;
    // Accepted under the default header_read_timeout (10s).
    let mut before = TcpStream::connect(p.addr).await.expect("connect");
    let changes = reload(
        &p,
        &yaml(
            &env,
            "limits:\n  header_read_timeout: 300ms\n",
            "",
            &[BOOKINGS, REST],
        ),
    );
    assert_eq!(changes.other, ["limits.header_read_timeout"], "{changes}");
    let started = Instant::now();
    let mut after = TcpStream::connect(p.addr).await.expect("connect");
    assert!(
        closed_within(&mut after, Duration::from_secs(3)).await,
        "a silent connection accepted after the reload is closed at the new deadline"
    );
    assert!(
        started.elapsed() >= Duration::from_millis(250),
        "not before it"
    );
    assert!(
        !closed_within(&mut before, Duration::from_millis(200)).await,
        "the connection accepted before the reload keeps its 10s"
    );
    echo(&p.url(""), 1).await;
}

/// Load: connections that each send one request after another for this long.
const LOAD_FOR: Duration = Duration::from_secs(10);
const CONNECTIONS: u32 = 32;
/// At most this many requests a connection, whatever the machine's speed.
const MAX_REQUESTS: u32 = 5000;
const RELOADS: u32 = 20;

/// What the clients saw.
#[derive(Default)]
struct Tally {
    sent: AtomicU64,
    /// Bookings forwarded (first of a pair) and replayed (second).
    forwarded: AtomicU64,
    replayed: AtomicU64,
    /// Anything else: a transport error (a connection dropped) or an unexpected answer.
    failures: AtomicU64,
}

/// One client connection: bookings in pairs (a first request, then its repeat, which must be
/// a replay of the same bytes) and pass-through requests between them.
async fn client_loop(base: String, n: u32, tally: Arc<Tally>, until: Instant) {
    // One connection: requests go one after another, so the pool never needs a second.
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(1)
        .timeout(Duration::from_secs(20))
        .build()
        .expect("client");
    let fail = |what: String| {
        tally.failures.fetch_add(1, Ordering::Relaxed);
        eprintln!("connection {n}: {what}");
    };
    for i in 0..MAX_REQUESTS {
        if Instant::now() >= until {
            break;
        }
        tally.sent.fetch_add(1, Ordering::Relaxed);
        if i % 3 == 2 {
            match http.get(format!("{base}/echo/{n}/{i}")).send().await {
                Ok(r) => {
                    let status = r.status();
                    match r.bytes().await {
                        Ok(_) if status == 200 => {}
                        Ok(body) => fail(format!("pass-through answered {status}: {body:?}")),
                        Err(e) => fail(format!("pass-through body failed: {e}")),
                    }
                }
                Err(e) => fail(format!("pass-through failed: {e}")),
            }
            continue;
        }
        // Requests 3k and 3k+1 carry the same key.
        let key = format!("load-{n}-{}", i / 3);
        let sent = http
            .post(format!("{base}/bookings"))
            .header("Idempotency-Key", &key)
            .body(format!(r#"{{"conn":{n}}}"#))
            .send()
            .await;
        let reply = match sent {
            Ok(r) => {
                let replayed = r.headers().contains_key("idempotent-replayed");
                let status = r.status().as_u16();
                match r.bytes().await {
                    Ok(body) => (status, replayed, body),
                    Err(e) => {
                        fail(format!("{key}: body failed: {e}"));
                        continue;
                    }
                }
            }
            Err(e) => {
                fail(format!("{key}: request failed: {e}"));
                continue;
            }
        };
        match (i % 3, reply) {
            (0, (201, false, _)) => {
                tally.forwarded.fetch_add(1, Ordering::Relaxed);
            }
            (1, (201, true, _)) => {
                tally.replayed.fetch_add(1, Ordering::Relaxed);
            }
            (_, (status, replayed, body)) => fail(format!(
                "{key}: request {i} answered {status} (replayed: {replayed}): {body:?}"
            )),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_reloads_under_load_drop_no_connection_and_fail_no_request() {
    let env = Env::new(Backend::Memory).await;
    let a = yaml(&env, "", "", &[BOOKINGS, PAY, REST]);
    // Routes reordered and changed, one added, the upstream changed (a new pool each time),
    // limits changed: everything a reload can change in place.
    let extra = "  - name: extra\n    path: /extra\n    upstream: booking\n";
    let changed = BOOKINGS.replace("idempotency: {}", "idempotency:\n      lock_ttl: 5s");
    let b = yaml(
        &env,
        "limits:\n  send_timeout: 20s\n  body_read_timeout: 20s\n",
        "    pool_idle_timeout: 2s\n",
        &[PAY, extra, &changed, REST],
    );
    let p = env.proxy(&a).await;
    // The relay counts the clients' connections to the proxy: one each, never re-opened.
    let relay = Relay::start(p.addr).await;
    let base = format!("http://{}", relay.addr());
    let tally = Arc::new(Tally::default());
    let until = Instant::now() + LOAD_FOR;
    let clients: Vec<_> = (0..CONNECTIONS)
        .map(|n| tokio::spawn(client_loop(base.clone(), n, tally.clone(), until)))
        .collect();
    let pause = LOAD_FOR / (RELOADS + 1);
    for i in 0..RELOADS {
        tokio::time::sleep(pause).await;
        reload(&p, if i % 2 == 0 { &b } else { &a });
    }
    for c in clients {
        c.await.expect("a client task");
    }
    let sent = tally.sent.load(Ordering::Relaxed);
    let (forwarded, replayed) = (
        tally.forwarded.load(Ordering::Relaxed),
        tally.replayed.load(Ordering::Relaxed),
    );
    eprintln!("{sent} requests, {forwarded} bookings, {replayed} replays, {RELOADS} reloads");
    assert_eq!(
        tally.failures.load(Ordering::Relaxed),
        0,
        "of {sent} requests"
    );
    assert!(
        sent >= u64::from(CONNECTIONS) * 10,
        "a real load: {sent} requests"
    );
    assert_eq!(reloads(&p, "applied"), u64::from(RELOADS));
    assert_eq!(
        relay.stats().accepted,
        u64::from(CONNECTIONS),
        "no connection was dropped and re-opened"
    );
    // Exactly once: every booking forwarded made one, every repeat replayed it.
    assert_eq!(
        env.mock.bookings(),
        forwarded,
        "one booking per first request"
    );
    assert!(
        replayed + u64::from(CONNECTIONS) >= forwarded,
        "{replayed} / {forwarded}"
    );
}
