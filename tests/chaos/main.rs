//! Chaos: two proxy instances on one Redis, clients retrying hundreds of operations through
//! both, and a seeded schedule of faults in every dependency. Afterwards the mock upstream's
//! ledger, the requests it received (timestamped) and every client's log are checked against
//! the exactly-once contract (SPEC §4.3–4.5, §5).
//!
//! ```text
//! clients ─┬─> proxy A (in this process) ─┬─> relay ─> redis-server (killed, paused, restarted)
//!          └─> proxy B (child process;  ──┤
//!              SIGKILLed, restarted)      └─> relay ─> mock upstream (in this process: the ledger)
//! ```
//!
//! Two runs, one seed (`CHAOS_SEED`, decimal or `0x…` hex; a fixed default otherwise):
//! - **main**: Redis without persistence. Faults: Redis SIGKILL and restart (empty), SIGSTOP and
//!   SIGCONT, blackhole / reset / latency on the Redis relay, SIGKILL and restart of proxy B,
//!   latency / blackhole / reset / refusal / cut-after-N-bytes on the upstream relay.
//! - **persistent**: Redis with `appendonly yes`, `appendfsync always`; restarts keep every
//!   record; no proxy kills and only short stalls. No operation may run twice at all.
//!
//! # What is checked
//! 1. Every operation executed more than once is explained, execution by execution: between two
//!    consecutive upstream executions of one operation lies a fault that can lose its claim —
//!    proxy B killed after the earlier one went through B, a Redis restart that lost the
//!    records, or a store stall long enough to outlast a lease (a merged window of Redis
//!    unavailability of at least `lock_ttl / 3`: the lease is renewed every `lock_ttl / 3`, so
//!    that is when a renewal can first miss). In the persistent run nothing runs twice.
//!    The machine stalling counts as Redis unavailability too — this process not scheduled
//!    (the relays run here) or Redis not answering outside an injected fault (an `fsync` under
//!    `appendfsync always` on a busy disk); two watchdogs measure both. In the persistent run
//!    that is the only excuse, and the timeline shows it.
//! 2. An operation a client saw succeed (201, fresh or replayed) ran exactly once, unless 1
//!    explains it.
//! 3. Replays are byte-identical: every answer that is an operation's result (a 201, a saved
//!    502/504) has one body per operation, unless a claim-losing fault touched its lifetime
//!    (then at most one more per such fault); the closing check replays every operation through
//!    both instances and wants the same bytes twice.
//! 4. No client gets another operation's body: a booking embeds the request it came from, which
//!    names the tenant (the `Authorization` scope) and the key; some keys are used by two
//!    tenants, so a scope mix-up shows as a 422 or a foreign body. A booking id answers one
//!    operation only.
//! 5. Nothing hangs: after the last fault every operation settles (a 201, or a replayed saved
//!    answer) within [`SETTLE_BOUND`].
//! 6. No in-progress record outlives `lock_ttl` after the last fault: once every client has
//!    settled, a scan of Redis at `lock_ttl` + the upstream timeout (the longest a live holder
//!    may legitimately keep a claim) + 1s after the last fault finds none.
//!
//! Between the runs and the closing replays, every operation is also sent once more through
//! each instance after the faults (the first answer may be a 503 right after a reconnect; it is
//! retried for a bounded time): A's answer must be its result, B's a byte-identical replay of
//! it, and — unless a claim-losing fault came after the operation settled — the result the
//! clients last saw.
//!
//! The upstream executions are observed by a tap on the upstream relay, which parses the
//! requests it forwards and timestamps each one with its `Authorization`, `Idempotency-Key` and
//! the `X-Chaos-Via` / `X-Chaos-Attempt` headers the clients add (end-to-end headers: the proxy
//! forwards them; they are not part of the fingerprint). The tap may see a request the mock then
//! never reads, never the reverse, so its counts are checked to cover the mock's ledger.
//!
//! # Replaying a failure
//! The seed and the fault timeline (planned at start, as it happened on failure) are printed:
//! `CHAOS_SEED=0x… cargo test --test chaos -- --nocapture`. Faults are planned from the seed;
//! the clients' random choices too; what the machine's scheduler does is not, so a replay is
//! close, not identical.

mod checks;
#[path = "../common/mod.rs"]
mod common;
mod load;
mod plan;
mod tap;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::relay::{Direction, Relay, Tap};
use common::{Env, ProxyProcess, RedisServer, free_port};

use checks::*;
use load::*;
use plan::*;
use tap::*;

/// The seed when `CHAOS_SEED` is not set.
const DEFAULT_SEED: u64 = 0x1DE3_C4A0_5EED_0001;

/// Every proxy here: the lease, and the per-operation store deadline.
const LOCK_TTL: Duration = Duration::from_secs(2);
const STORE_TIMEOUT_MS: u64 = 300;

/// The upstream's `timeout` in the proxies' configuration.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(3);

/// After the last fault, every operation settles within this (a lease to expire, an upstream
/// timeout, the longest client timeout, backoffs, and room for a slow machine).
const SETTLE_BOUND: Duration = Duration::from_secs(15);

/// A client attempt's number in [`Attempt::client`] for the closing replays.
const VERIFY: usize = 9;

/// The two chaos runs share Redis-heavy timing on a small machine: one at a time.
static RUNS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

// ---------------------------------------------------------------------------------------------
// The runs
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_main_run() {
    let _one_at_a_time = RUNS.lock().await;
    let seed = seed();
    run(RunSpec {
        name: "main",
        seed,
        chaos: Duration::from_secs(30),
        ops: 320,
        persistent: false,
        proxy_kills: true,
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_persistent_redis_run() {
    let _one_at_a_time = RUNS.lock().await;
    let seed = seed();
    run(RunSpec {
        name: "persistent",
        // Its own stream of faults and operations, still named by the one seed.
        seed: seed ^ 0x5045_5253_4953_5400,
        chaos: Duration::from_secs(14),
        ops: 140,
        persistent: true,
        proxy_kills: false,
    })
    .await;
}

/// The seed: `CHAOS_SEED` (decimal, or hex with `0x`), else [`DEFAULT_SEED`].
fn seed() -> u64 {
    match std::env::var("CHAOS_SEED") {
        Ok(s) => {
            let s = s.trim();
            let parsed = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
                Some(hex) => u64::from_str_radix(&hex.replace('_', ""), 16),
                None => s.replace('_', "").parse(),
            };
            parsed.unwrap_or_else(|e| panic!("CHAOS_SEED={s:?} is not a number: {e}"))
        }
        Err(_) => DEFAULT_SEED,
    }
}

struct RunSpec {
    name: &'static str,
    seed: u64,
    /// How long faults are injected.
    chaos: Duration,
    ops: usize,
    /// Redis with AOF (`appendfsync always`): restarts keep every record.
    persistent: bool,
    proxy_kills: bool,
}

/// One chaos run: the world, the plan, the load, the faults, then every check.
async fn run(spec: RunSpec) {
    let mut rng = Rng::new(spec.seed);
    let plan = plan_faults(&spec, &mut rng.fork(1));
    let ops: Vec<Arc<OpSpec>> = plan_ops(&spec, &mut rng.fork(2))
        .into_iter()
        .map(Arc::new)
        .collect();
    println!(
        "chaos {} run: seed {:#x} (replay: CHAOS_SEED={:#x} cargo test --test chaos -- --nocapture)",
        spec.name,
        seed(),
        seed()
    );
    println!(
        "  {} operations over {:?}, lock_ttl {:?}, store timeout {}ms, redis persistence {}, proxy kills {}",
        ops.len(),
        spec.chaos,
        LOCK_TTL,
        STORE_TIMEOUT_MS,
        if spec.persistent {
            "AOF always"
        } else {
            "none"
        },
        spec.proxy_kills
    );
    println!("  planned faults (seconds from start):");
    for p in &plan {
        println!(
            "    +{:>7}  {:<8} {}",
            secs(p.at),
            p.fault.lane(),
            p.fault.describe()
        );
    }

    // The world.
    let aof_dir = tempfile::tempdir().expect("a directory for the AOF");
    let redis = if spec.persistent {
        let dir = aof_dir.path().to_str().expect("utf-8 temp path").to_owned();
        RedisServer::start_with(&[
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--dir",
            &dir,
        ])
    } else {
        RedisServer::start()
    };
    let mut env = Env::on_redis(redis).await;
    let redis_relay = Arc::new(Relay::start(env.redis().addr()).await);
    let tap = Arc::new(ExecTap::default());
    let upstream_relay = Arc::new(Relay::start_with_tap(env.mock.addr(), tap.clone()).await);
    let yaml = chaos_config(&env, &redis_relay, &upstream_relay);
    let proxy_a = env.proxy(&yaml).await;
    let b_port = free_port();
    let proxy_b = tokio::task::block_in_place(|| ProxyProcess::spawn_on(&yaml, b_port));
    let redis = env.take_redis();

    let clock = Clock(Instant::now());
    tap.start(clock.clone());
    let timeline = Arc::new(Timeline::default());
    let ctx = Arc::new(Ctx {
        clock: clock.clone(),
        http: reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .pool_max_idle_per_host(64)
            .build()
            .expect("http client"),
        a: proxy_a.url(""),
        b: format!("http://127.0.0.1:{b_port}"),
        deadline_ms: AtomicU64::new(u64::MAX),
        attempt_ids: AtomicU64::new(1),
        attempts: Mutex::new(Vec::new()),
    });

    // The load: every operation's clients, each sleeping until its start.
    let mut clients = Vec::new();
    for op in &ops {
        for client in 0..op.clients {
            let rng = rng.fork(1000 + (op.idx * 8 + client) as u64);
            clients.push(tokio::spawn(drive(ctx.clone(), op.clone(), client, rng)));
        }
    }

    // The faults, one task per lane.
    let lane = |l: Lane| {
        plan.iter()
            .filter(|p| p.fault.lane() == l)
            .cloned()
            .collect()
    };
    let redis_url = redis.url();
    let disturbed = Arc::new(AtomicU64::new(0));
    let redis_lane = tokio::spawn(redis_lane(
        lane(Lane::Redis),
        redis,
        disturbed.clone(),
        redis_relay.clone(),
        spec.persistent,
        clock.clone(),
        timeline.clone(),
    ));
    let proxy_lane = tokio::spawn(proxy_lane(
        lane(Lane::Proxy),
        proxy_b,
        yaml.clone(),
        b_port,
        clock.clone(),
        timeline.clone(),
    ));
    let upstream_lane = tokio::spawn(upstream_lane(
        lane(Lane::Upstream),
        upstream_relay.clone(),
        clock.clone(),
        timeline.clone(),
    ));
    let watchdogs = [
        tokio::spawn(process_watchdog(clock.clone(), timeline.clone())),
        tokio::spawn(redis_watchdog(
            redis_url,
            clock.clone(),
            timeline.clone(),
            disturbed.clone(),
        )),
    ];
    let redis = redis_lane.await.expect("the redis fault lane");
    let (proxy_b, mut b_logs) = proxy_lane.await.expect("the proxy fault lane");
    upstream_lane.await.expect("the upstream fault lane");
    let last_fault = clock.now();
    timeline.note(
        last_fault,
        "-",
        "last fault over: every dependency healthy".into(),
    );
    ctx.deadline_ms.store(
        u64::try_from((last_fault + SETTLE_BOUND).as_millis()).expect("ms"),
        Ordering::SeqCst,
    );

    // Every client stops by itself by the deadline (plus its last attempt's timeout).
    let mut ends = Vec::new();
    let hard_stop =
        tokio::time::Instant::from(clock.0 + last_fault + SETTLE_BOUND) + Duration::from_secs(15);
    for c in clients {
        match tokio::time::timeout_at(hard_stop, c).await {
            Ok(end) => ends.push(end.expect("client task")),
            Err(_) => panic!("a client loop did not stop by itself (seed {:#x})", seed()),
        }
    }
    let settled_by = clock.now();

    // No in-progress record outlives lock_ttl after the last fault (every client has settled:
    // nothing legitimately holds a claim now).
    // A holder may legitimately keep its claim until its upstream call ends (the upstream
    // timeout), and a dead holder's claim lasts lock_ttl.
    let scan_at = last_fault + LOCK_TTL + UPSTREAM_TIMEOUT + Duration::from_secs(1);
    if clock.now() < scan_at {
        tokio::time::sleep(scan_at - clock.now()).await;
    }
    let in_progress = tokio::task::block_in_place(|| in_progress_records(&redis));

    // The closing replays: through A, then B (each retried past a 503 or 409 for a bounded
    // time); the second must replay the first byte for byte. Without the upstream delay: the
    // header is not part of the fingerprint, and a re-execution need not be slow.
    let permits = Arc::new(tokio::sync::Semaphore::new(32));
    let tasks: Vec<_> = ops
        .iter()
        .map(|op| {
            let (ctx, op, permits) = (ctx.clone(), op.clone(), permits.clone());
            tokio::spawn(async move {
                let _permit = permits.acquire().await.expect("semaphore");
                let a = settle_via(&ctx, &op, Via::A).await;
                let b = settle_via(&ctx, &op, Via::B).await;
                (op.idx, a, b)
            })
        })
        .collect();
    let mut verifications = Vec::new();
    for t in tasks {
        verifications.push(t.await.expect("verification"));
    }
    let finished = clock.now();
    for w in &watchdogs {
        w.abort();
    }

    let data = RunData {
        spec: &spec,
        ops: &ops,
        attempts: ctx
            .attempts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone(),
        ends,
        execs: tap.events(),
        tap_errors: tap.errors(),
        ledger: env.mock.stats().by_key,
        windows: timeline.windows(),
        last_fault,
        in_progress,
        verifications,
    };
    let outcome = check(&data);

    let mut report = String::new();
    let _ = writeln!(
        report,
        "chaos {} run, seed {:#x}: faults until +{}s, clients settled by +{}s, finished at +{}s",
        spec.name,
        seed(),
        secs(last_fault),
        secs(settled_by),
        secs(finished)
    );
    let _ = writeln!(report, "{}", outcome.summary);
    let _ = writeln!(
        report,
        "relays: redis {:?}; upstream {:?}",
        redis_relay.stats(),
        upstream_relay.stats()
    );
    b_logs.push(proxy_b.log());
    let b_lost = b_logs
        .iter()
        .flat_map(|l| l.lines())
        .filter(|l| l.contains("lease lost"))
        .count();
    let _ = writeln!(
        report,
        "lost leases: proxy A {}, proxy B {b_lost} (its log)",
        proxy_a.lost_leases()
    );
    report.push_str("timeline (seconds from start):\n");
    report.push_str(&timeline.render());
    println!("{report}");

    drop(proxy_b);
    drop(redis);
    if !outcome.failures.is_empty() {
        let mut text = format!(
            "CHAOS FAILURE in the {} run (seed {:#x}): {} problem(s)\n",
            spec.name,
            seed(),
            outcome.failures.len()
        );
        for f in outcome.failures.iter().take(25) {
            let _ = writeln!(text, "- {f}");
        }
        if outcome.failures.len() > 25 {
            let _ = writeln!(text, "- … and {} more", outcome.failures.len() - 25);
        }
        text.push_str("proxy B log, lines about leases, saves and errors:\n");
        for line in b_logs
            .iter()
            .flat_map(|l| l.lines())
            .filter(|l| {
                ["lease", "gave up", "ERROR", "completing", "saved after"]
                    .iter()
                    .any(|w| l.contains(w))
            })
            .take(60)
        {
            let _ = writeln!(text, "  {line}");
        }
        text.push_str(&report);
        let _ = writeln!(
            text,
            "replay: CHAOS_SEED={:#x} cargo test --test chaos -- --nocapture",
            seed()
        );
        panic!("{text}");
    }
}

/// The proxies' configuration: `POST /bookings` idempotent (scope `Authorization`, the
/// default), Redis and the upstream behind their relays, [`LOCK_TTL`], [`STORE_TIMEOUT_MS`],
/// [`UPSTREAM_TIMEOUT`].
fn chaos_config(env: &Env, redis_relay: &Relay, upstream_relay: &Relay) -> String {
    let lock_ttl = format!("lock_ttl: {}ms\nttl: 10m", LOCK_TTL.as_millis());
    let yaml = env.config_with(&lock_ttl, &format!("timeout: {STORE_TIMEOUT_MS}ms"));
    let upstream_timeout = format!("    timeout: {}ms\n", UPSTREAM_TIMEOUT.as_millis());
    let swapped = yaml
        .replace(
            &env.redis().url(),
            &format!("redis://{}/0", redis_relay.addr()),
        )
        .replace(
            &env.mock.url(),
            &format!("http://{}", upstream_relay.addr()),
        )
        .replace("    timeout: 5s\n", &upstream_timeout);
    assert!(
        swapped.contains(&redis_relay.addr().to_string())
            && swapped.contains(&upstream_relay.addr().to_string())
            && swapped.contains(&upstream_timeout),
        "the harness's configuration changed shape:\n{yaml}"
    );
    swapped
}

// ---------------------------------------------------------------------------------------------
// The relay itself
// ---------------------------------------------------------------------------------------------

/// Every switch of the fault relay does what it says, on a TCP echo server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_switches_take_effect() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    let echo = TcpListener::bind("127.0.0.1:0").await.expect("bind echo");
    let target = echo.local_addr().expect("echo addr");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = echo.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    let relay = Relay::start(target).await;
    let read_timeout = Duration::from_millis(400);
    async fn roundtrip(c: &mut TcpStream, msg: &[u8]) -> Vec<u8> {
        c.write_all(msg).await.expect("write");
        let mut buf = vec![0u8; msg.len()];
        c.read_exact(&mut buf).await.expect("read the echo");
        buf
    }
    fn is_reset<T: std::fmt::Debug>(r: &std::io::Result<T>) -> bool {
        matches!(r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset)
    }

    // Pass.
    let mut c = TcpStream::connect(relay.addr()).await.expect("connect");
    assert_eq!(roundtrip(&mut c, b"hello").await, b"hello");

    // Latency, per direction.
    relay.set_latency(Duration::from_millis(150), Duration::from_millis(100));
    let started = Instant::now();
    assert_eq!(roundtrip(&mut c, b"slow").await, b"slow");
    assert!(started.elapsed() >= Duration::from_millis(250), "latency");
    relay.set_latency(Duration::ZERO, Duration::ZERO);

    // Blackhole: nothing comes back; its end resets the connection.
    relay.blackhole();
    c.write_all(b"lost")
        .await
        .expect("write into the blackhole");
    let mut buf = [0u8; 16];
    assert!(
        tokio::time::timeout(read_timeout, c.read(&mut buf))
            .await
            .is_err(),
        "a blackhole forwards nothing"
    );
    let mut during = TcpStream::connect(relay.addr())
        .await
        .expect("a blackhole accepts");
    during.write_all(b"x").await.expect("write");
    // Accepted by the kernel is not yet accepted by the relay.
    let accepted = common::eventually(Duration::from_secs(2), || relay.stats().accepted == 2).await;
    assert!(accepted, "the relay accepts during a blackhole");
    relay.pass();
    let r = tokio::time::timeout(read_timeout, c.read(&mut buf))
        .await
        .expect("the reset arrives");
    assert!(is_reset(&r), "the blackhole's end resets: {r:?}");
    let r = tokio::time::timeout(read_timeout, during.read(&mut buf))
        .await
        .expect("the reset arrives");
    assert!(is_reset(&r), "…connections made during it too: {r:?}");

    // Reset everything open now.
    let mut c = TcpStream::connect(relay.addr()).await.expect("connect");
    assert_eq!(roundtrip(&mut c, b"again").await, b"again");
    relay.reset_all();
    let r = tokio::time::timeout(read_timeout, c.read(&mut buf))
        .await
        .expect("the reset arrives");
    assert!(is_reset(&r), "reset_all: {r:?}");

    // Refuse: new connections are reset at once.
    relay.refuse();
    // The reset may come before the connect call returns.
    match TcpStream::connect(relay.addr()).await {
        Ok(mut c) => {
            let r = tokio::time::timeout(read_timeout, c.read(&mut buf))
                .await
                .expect("the reset arrives");
            assert!(is_reset(&r), "refuse: {r:?}");
        }
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "refuse"),
    }
    relay.pass();

    // Cut after N bytes up: exactly N reach the target, then both sides are reset.
    let before = relay.stats();
    relay.cut_after(Direction::Up, Some(4));
    let mut c = TcpStream::connect(relay.addr()).await.expect("connect");
    c.write_all(b"abcdefgh").await.expect("write");
    let mut got = Vec::new();
    let r = tokio::time::timeout(read_timeout, c.read_to_end(&mut got))
        .await
        .expect("the cut arrives");
    assert!(is_reset(&r), "cut: {r:?}");
    assert_eq!(
        relay.stats().bytes_up - before.bytes_up,
        4,
        "N bytes went up"
    );
    relay.cut_after(Direction::Up, None);

    let stats = relay.stats();
    assert_eq!(stats.accepted, 5, "{stats:?}");
    assert!(stats.resets >= 5, "{stats:?}");
    assert!(stats.dropped >= 5, "{stats:?}");

    // Dropped: open connections close, the port closes.
    let mut open = TcpStream::connect(relay.addr()).await.expect("connect");
    assert_eq!(roundtrip(&mut open, b"last").await, b"last");
    let addr = relay.addr();
    drop(relay);
    let r = tokio::time::timeout(read_timeout, open.read(&mut buf))
        .await
        .expect("the relay's end closes the connection");
    assert!(matches!(r, Ok(0)), "closed in order: {r:?}");
    let closed = common::eventually(Duration::from_secs(2), || {
        std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(50)).is_err()
    })
    .await;
    assert!(closed, "the relay still accepts after drop");
}
