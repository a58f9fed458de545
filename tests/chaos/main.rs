//! Chaos: two proxy instances on one store (Redis, or PostgreSQL), clients retrying hundreds of
//! operations through both, and a seeded schedule of faults in every dependency. Afterwards the
//! mock upstream's ledger, the requests it received (timestamped) and every client's log are
//! checked against the exactly-once contract (SPEC §4.3–4.6, §5).
//!
//! ```text
//! clients ─┬─> proxy A (in this process) ─┬─> relay ─> the store (redis-server or postgres:
//!          └─> proxy B (child process;  ──┤                killed or crashed, paused, restarted)
//!              SIGKILLed, restarted)      └─> relay ─> mock upstream (in this process: the ledger)
//! ```
//!
//! Three runs, one seed (`CHAOS_SEED`, decimal or `0x…` hex; a fixed default otherwise), each
//! with a stream of faults and operations of its own derived from it:
//! - **main**: Redis without persistence. Faults: Redis SIGKILL and restart (empty), SIGSTOP and
//!   SIGCONT, blackhole / reset / latency on the Redis relay, SIGKILL and restart of proxy B,
//!   latency / blackhole / reset / refusal / cut-after-N-bytes on the upstream relay.
//! - **persistent**: Redis with `appendonly yes`, `appendfsync always`; restarts keep every
//!   record; no proxy kills and only short stalls. No operation may run twice at all.
//! - **postgres**: a PostgreSQL server of the run's own (`store.backend: postgres`, a pool of
//!   [`PG_POOL_SIZE`] per instance). Faults: crashes (`pg_ctl stop -m immediate`) and restarts
//!   after a short down time (the WAL replayed), SIGSTOP of every server process (short, and at
//!   least `lock_ttl`), blackhole (short and long) / reset / latency on its relay, SIGKILL and
//!   restart of proxy B, and the upstream faults of the main run. A crash keeps every committed
//!   claim and save, so it explains no re-execution at all (see `store.rs`). Its lease is longer
//!   ([`PG_LOCK_TTL`]) so that a crash's whole outage fits well inside a renewal period.
//!
//! # What is checked
//! 1. Every operation executed more than once is explained, execution by execution: between two
//!    consecutive upstream executions of one operation lies a fault that can lose its claim —
//!    proxy B killed after the earlier one went through B, a Redis restart that lost the
//!    records, or a store stall long enough to outlast a lease (a merged window of store
//!    unavailability of at least `lock_ttl / 3`: the lease is renewed every `lock_ttl / 3`, and
//!    it is lost only when two renewals in a row miss — after two misses the third is due the
//!    instant the lease ends —, which an outage covers from `lock_ttl / 3` on). In the persistent
//!    run nothing runs twice. The machine stalling counts as store unavailability too — this
//!    process not scheduled (the relays run here) or the store not answering outside an
//!    injected fault (an `fsync` under `appendfsync always` on a busy disk, a starved backend);
//!    two watchdogs measure both. In the persistent run that is the only excuse, and the
//!    timeline shows it.
//!
//!    **A PostgreSQL crash is never an excuse.** It loses no committed claim or record (no
//!    "records lost" kind exists for it), and its outage — from the stop until the restarted
//!    server answers, measured — is a window of its own kind that makes no merged span
//!    claim-losing: a span that holds a crash counts only if it also holds a stop, a blackhole,
//!    a reset or a measured machine stall, and a crash merges only with neighbours closer than
//!    `lock_ttl / 3` + `store.timeout` (farther apart, every lease renewed in between). This is
//!    sound because the plan keeps a crash's outage under `lock_ttl / 3 − 2 × MACHINE_STALL`,
//!    so that no lease can miss two renewals in it ([`crash_outage_bound`]); a restart that
//!    overran that bound was slowed by the machine, and only its overrun is recorded, as a
//!    machine stall. The summary lists every crash's outage and, per re-execution, what
//!    explained it (`+Crash` marks a span that held one; the crash was not the reason).
//! 2. An operation a client saw succeed (201, fresh or replayed) ran exactly once, unless 1
//!    explains it.
//! 3. Replays are byte-identical: every answer that is an operation's result (a 201, a saved
//!    502/504) has one body per operation, unless a claim-losing fault touched its lifetime
//!    (then at most one more per such fault); the closing check replays every operation through
//!    both instances and wants the same bytes twice. On PostgreSQL a crash is no such fault: a
//!    record saved before a crash replays after it, unchanged.
//! 4. No client gets another operation's body: a booking embeds the request it came from, which
//!    names the tenant (the `Authorization` scope) and the key; some keys are used by two
//!    tenants, so a scope mix-up shows as a 422 or a foreign body. A booking id answers one
//!    operation only.
//! 5. Nothing hangs: after the last fault every operation settles (a 201, or a replayed saved
//!    answer) within [`SETTLE_BOUND`].
//! 6. No in-progress record outlives `lock_ttl` after the last fault: once every client has
//!    settled, a scan of the store at `lock_ttl` + the upstream timeout (the longest a live
//!    holder may legitimately keep a claim) + 1s after the last fault finds none (Redis: a
//!    value of an in-progress record; PostgreSQL: a live row that still has a token).
//! 7. The resolve lane: in every run a tenth as many operations again go to `POST /reservations`
//!    under `on_unknown_outcome: resolve` (SPEC §4.8; lookup `GET /bookings/by-reference/…`),
//!    most with their first response lost (`X-Mock-Lose-Response: after` or `before`, some with
//!    `X-Mock-Commit-After`) on top of the run's faults. Each is booked (by the mock's count per
//!    reference) zero times or once, never twice, proxy kills and lapsed leases included — only
//!    a Redis restart that lost the records in its lifetime excuses a second booking; a found
//!    booking replayed (`200`, `Idempotent-Resolved: true`) is the booking the mock made, and a
//!    saved `outcome-unknown` is a result like any other.
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
mod lanes;
mod load;
mod losses;
mod plan;
mod relay_check;
mod store;
mod tap;
mod watchdogs;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use harness::relay::{Direction, Relay, Tap};
use harness::{Backend, Env, ProxyProcess, RedisServer, free_port};

use checks::*;
use lanes::*;
use load::*;
use losses::*;
use plan::*;
use store::*;
use tap::*;
use watchdogs::*;

/// The seed when `CHAOS_SEED` is not set.
const DEFAULT_SEED: u64 = 0x1DE3_C4A0_5EED_0001;

/// The lease of the Redis runs, and the per-operation store deadline of every run.
const LOCK_TTL: Duration = Duration::from_secs(2);
const STORE_TIMEOUT_MS: u64 = 300;

/// The Postgres run's lease: its renewal period (a third of it) leaves a crash's whole outage
/// (stop, down time, restart with WAL replay: about half a second on a loaded machine) room
/// under [`crash_outage_bound`].
const PG_LOCK_TTL: Duration = Duration::from_secs(4);

/// The upstream's `timeout` in the proxies' configuration.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(3);

/// After the last fault, every operation settles within this (a lease to expire, an upstream
/// timeout, the longest client timeout, backoffs, and room for a slow machine).
const SETTLE_BOUND: Duration = Duration::from_secs(15);

/// A client attempt's number in [`Attempt::client`] for the closing replays.
const VERIFY: usize = 9;

/// The chaos runs share store-heavy timing on a small machine: one at a time.
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
        store: StoreKind::Redis,
        proxy_kills: true,
        lock_ttl: LOCK_TTL,
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
        store: StoreKind::PersistentRedis,
        proxy_kills: false,
        lock_ttl: LOCK_TTL,
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_postgres_run() {
    let _one_at_a_time = RUNS.lock().await;
    let seed = seed();
    run(RunSpec {
        name: "postgres",
        // Its own stream of faults and operations, still named by the one seed.
        seed: seed ^ 0x504F_5354_4752_4553,
        chaos: Duration::from_secs(27),
        ops: 250,
        store: StoreKind::Postgres,
        proxy_kills: true,
        lock_ttl: PG_LOCK_TTL,
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
    store: StoreKind,
    proxy_kills: bool,
    /// The route's `lock_ttl`: leases are renewed every third of it.
    lock_ttl: Duration,
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
        "  {} operations over {:?}, lock_ttl {:?}, store timeout {}ms, store {}, proxy kills {}",
        ops.len(),
        spec.chaos,
        spec.lock_ttl,
        STORE_TIMEOUT_MS,
        spec.store.describe(),
        spec.proxy_kills
    );
    println!("  planned faults (seconds from start):");
    for p in &plan {
        let lane = match p.fault.lane() {
            Lane::Store => spec.store.name().to_owned(),
            other => other.to_string(),
        };
        println!("    +{:>7}  {:<8} {}", secs(p.at), lane, p.what);
    }

    // The world.
    let env = Env::new(Backend::Memory).await;
    let aof_dir = tempfile::tempdir().expect("a directory for the AOF");
    let store = tokio::task::block_in_place(|| StoreServer::start(spec.store, aof_dir.path()));
    let store_relay = Arc::new(Relay::start(store.addr()).await);
    let tap = Arc::new(ExecTap::default());
    let upstream_relay = Arc::new(Relay::start_with_tap(env.mock.addr(), tap.clone()).await);
    let yaml = chaos_config(&env, &spec, &store, &store_relay, &upstream_relay);
    let proxy_a = env.proxy(&yaml).await;
    let b_port = free_port();
    let proxy_b = tokio::task::block_in_place(|| ProxyProcess::spawn_on(&yaml, b_port));

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

    // The faults, one task per lane, and the watchdogs.
    let disturbed = Arc::new(AtomicU64::new(0));
    let lane = |l: Lane| {
        plan.iter()
            .filter(|p| p.fault.lane() == l)
            .cloned()
            .collect()
    };
    let store_watchdog = match &store {
        StoreServer::Redis(r) => tokio::spawn(redis_watchdog(
            r.url(),
            clock.clone(),
            timeline.clone(),
            disturbed.clone(),
        )),
        StoreServer::Postgres(pg) => tokio::spawn(postgres_watchdog(
            pg.url(),
            clock.clone(),
            timeline.clone(),
            disturbed.clone(),
        )),
    };
    let store_lane = tokio::spawn(store_lane(
        lane(Lane::Store),
        store,
        spec.store,
        spec.lock_ttl,
        disturbed.clone(),
        store_relay.clone(),
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
        store_watchdog,
    ];
    let store = store_lane.await.expect("the store fault lane");
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
    let scan_at = last_fault + spec.lock_ttl + UPSTREAM_TIMEOUT + Duration::from_secs(1);
    if clock.now() < scan_at {
        tokio::time::sleep(scan_at - clock.now()).await;
    }
    let in_progress = tokio::task::block_in_place(|| in_progress_records(&store));

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
        bookings: env.mock.stats().by_reference,
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
        "relays: {} {:?}; upstream {:?}",
        spec.store.name(),
        store_relay.stats(),
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
    drop(store);
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
/// default) with the run's `lock_ttl`, `POST /reservations` alike under
/// `on_unknown_outcome: resolve` (the resolve lane), the store and the upstream behind their
/// relays, [`STORE_TIMEOUT_MS`], [`UPSTREAM_TIMEOUT`].
fn chaos_config(
    env: &Env,
    spec: &RunSpec,
    store: &StoreServer,
    store_relay: &Relay,
    upstream_relay: &Relay,
) -> String {
    let lock_ttl = format!("lock_ttl: {}ms\nttl: 10m", spec.lock_ttl.as_millis());
    let yaml = env.config_with(&lock_ttl, &format!("timeout: {STORE_TIMEOUT_MS}ms"));
    let upstream_timeout = format!("    timeout: {}ms\n", UPSTREAM_TIMEOUT.as_millis());
    // The resolve lane's route, before `pay` (and `rest`, which would take the path).
    let resolve_route = format!(
        "  - name: reserve\n    methods: [POST]\n    path: {RESOLVE_ROUTE}\n    upstream: booking\n    \
         idempotency:\n      {lock_ttl_line}\n      ttl: 10m\n      on_unknown_outcome: resolve\n      \
         resolve:\n        request: GET /bookings/by-reference/{{json:/reference}}\n        \
         settle_after: {}ms\n        interval: 300ms\n        give_up_after: {}ms\n  - name: pay\n",
        RESOLVE_SETTLE_AFTER.as_millis(),
        RESOLVE_GIVE_UP_AFTER.as_millis(),
        lock_ttl_line = format_args!("lock_ttl: {}ms", spec.lock_ttl.as_millis()),
    );
    let yaml = yaml.replacen("  - name: pay\n", &resolve_route, 1);
    let swapped = store
        .configure(&yaml, store_relay)
        .replace(
            &env.mock.url(),
            &format!("http://{}", upstream_relay.addr()),
        )
        .replace("    timeout: 5s\n", &upstream_timeout);
    assert!(
        swapped.contains(&store_relay.addr().to_string())
            && swapped.contains(&upstream_relay.addr().to_string())
            && swapped.contains(&upstream_timeout)
            && swapped.contains("on_unknown_outcome: resolve"),
        "the harness's configuration changed shape:\n{yaml}"
    );
    swapped
}
