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

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::relay::{Direction, Relay, Tap};
use common::{Backend, Env, ProxyProcess, RedisServer, free_port};

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
    let mut env = Env::new(Backend::Memory).await;
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
    env.redis = Some(redis);
    env.backend = Backend::Redis;
    let redis_relay = Arc::new(Relay::start(env.redis().addr()).await);
    let tap = Arc::new(ExecTap::default());
    let upstream_relay = Arc::new(Relay::start_with_tap(env.mock.addr(), tap.clone()).await);
    let yaml = chaos_config(&env, &redis_relay, &upstream_relay);
    let proxy_a = env.proxy(&yaml).await;
    let b_port = free_port();
    let proxy_b = tokio::task::block_in_place(|| ProxyProcess::spawn_on(&yaml, b_port));
    let redis = env.redis.take().expect("the run's redis");

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
        proxy_a.metrics().lost_leases_count()
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
// A small seeded PRNG (xorshift64*)
// ---------------------------------------------------------------------------------------------

#[derive(Clone)]
struct Rng(u64);

impl Rng {
    /// Seeds through splitmix64, so that nearby seeds give unrelated streams (and 0 works).
    fn new(seed: u64) -> Rng {
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        Rng(if z == 0 { 1 } else { z })
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `lo..=hi`.
    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }

    /// Milliseconds, uniform in `lo..=hi`.
    fn ms(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(self.between(lo, hi))
    }

    fn percent(&mut self, p: u64) -> bool {
        self.next() % 100 < p
    }

    /// An independent stream.
    fn fork(&mut self, salt: u64) -> Rng {
        Rng::new(self.next() ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }
}

// ---------------------------------------------------------------------------------------------
// Faults: the plan, the lanes that inject them, the timeline
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lane {
    Redis,
    Proxy,
    Upstream,
}

impl std::fmt::Display for Lane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(match self {
            Lane::Redis => "redis",
            Lane::Proxy => "proxy-b",
            Lane::Upstream => "upstream",
        })
    }
}

#[derive(Debug, Clone)]
enum Fault {
    RedisPause(Duration),
    RedisKill {
        down: Duration,
    },
    RedisBlackhole(Duration),
    RedisReset,
    RedisLatency {
        each_way: Duration,
        lasting: Duration,
    },
    ProxyKill {
        down: Duration,
    },
    UpstreamLatency {
        up: Duration,
        down: Duration,
        lasting: Duration,
    },
    UpstreamBlackhole(Duration),
    UpstreamReset,
    UpstreamRefuse(Duration),
    UpstreamCut {
        dir: Direction,
        after: u64,
        lasting: Duration,
    },
}

impl Fault {
    fn lane(&self) -> Lane {
        match self {
            Fault::RedisPause(_)
            | Fault::RedisKill { .. }
            | Fault::RedisBlackhole(_)
            | Fault::RedisReset
            | Fault::RedisLatency { .. } => Lane::Redis,
            Fault::ProxyKill { .. } => Lane::Proxy,
            _ => Lane::Upstream,
        }
    }

    /// How long it lasts (as planned).
    fn lasting(&self) -> Duration {
        match self {
            Fault::RedisPause(d)
            | Fault::RedisBlackhole(d)
            | Fault::UpstreamBlackhole(d)
            | Fault::UpstreamRefuse(d) => *d,
            Fault::RedisKill { down } | Fault::ProxyKill { down } => *down,
            Fault::RedisLatency { lasting, .. }
            | Fault::UpstreamLatency { lasting, .. }
            | Fault::UpstreamCut { lasting, .. } => *lasting,
            Fault::RedisReset | Fault::UpstreamReset => Duration::ZERO,
        }
    }

    fn describe(&self) -> String {
        match self {
            Fault::RedisPause(d) => format!("pause redis (SIGSTOP) for {d:?}"),
            Fault::RedisKill { down } => format!("kill redis (SIGKILL), restart after {down:?}"),
            Fault::RedisBlackhole(d) => format!("blackhole the redis relay for {d:?}"),
            Fault::RedisReset => "reset every redis connection".into(),
            Fault::RedisLatency { each_way, lasting } => {
                format!("redis relay latency {each_way:?} each way for {lasting:?}")
            }
            Fault::ProxyKill { down } => format!("kill proxy B (SIGKILL), restart after {down:?}"),
            Fault::UpstreamLatency { up, down, lasting } => {
                format!("upstream latency up {up:?} down {down:?} for {lasting:?}")
            }
            Fault::UpstreamBlackhole(d) => format!("blackhole the upstream relay for {d:?}"),
            Fault::UpstreamReset => "reset every upstream connection".into(),
            Fault::UpstreamRefuse(d) => {
                format!("reset upstream connections, new ones too, for {d:?}")
            }
            Fault::UpstreamCut {
                dir,
                after,
                lasting,
            } => format!("cut upstream connections after {after} bytes {dir:?} for {lasting:?}"),
        }
    }
}

#[derive(Debug, Clone)]
struct Planned {
    at: Duration,
    fault: Fault,
}

/// The faults of a run, from its seed. Within a lane faults never overlap; Redis faults are at
/// least `lock_ttl` apart, so that short stalls stay short.
fn plan_faults(spec: &RunSpec, rng: &mut Rng) -> Vec<Planned> {
    let end = spec.chaos;
    let margin = Duration::from_millis(500);
    let mut out = Vec::new();

    let mut t = rng.ms(1000, 2000);
    loop {
        let short = rng.ms(120, 400);
        let long = rng.ms(2300, 3300);
        let roll = rng.between(0, 99);
        let fault = if spec.persistent {
            // Restarts keep the data; every stall stays well under lock_ttl / 3.
            match roll {
                0..=29 => Fault::RedisPause(short),
                30..=49 => Fault::RedisKill {
                    down: Duration::ZERO,
                },
                50..=64 => Fault::RedisBlackhole(short),
                65..=84 => Fault::RedisReset,
                _ => Fault::RedisLatency {
                    each_way: rng.ms(50, 200),
                    lasting: rng.ms(500, 1500),
                },
            }
        } else {
            match roll {
                0..=17 => Fault::RedisPause(short),
                18..=29 => Fault::RedisPause(long),
                30..=45 => Fault::RedisKill {
                    down: rng.ms(100, 1500),
                },
                46..=57 => Fault::RedisBlackhole(short),
                58..=67 => Fault::RedisBlackhole(long),
                68..=84 => Fault::RedisReset,
                _ => Fault::RedisLatency {
                    each_way: rng.ms(50, 200),
                    lasting: rng.ms(500, 2000),
                },
            }
        };
        if t + fault.lasting() + margin > end {
            break;
        }
        let next = t + fault.lasting() + LOCK_TTL + rng.ms(300, 2000);
        out.push(Planned { at: t, fault });
        t = next;
    }

    if spec.proxy_kills {
        let mut t = rng.ms(2500, 5000);
        while t + Duration::from_secs(3) < end {
            out.push(Planned {
                at: t,
                fault: Fault::ProxyKill {
                    down: rng.ms(200, 1500),
                },
            });
            t += rng.ms(6000, 10_000);
        }
    }

    let mut t = rng.ms(500, 1500);
    loop {
        let fault = match rng.between(0, 99) {
            0..=24 => Fault::UpstreamLatency {
                up: rng.ms(100, 900),
                down: rng.ms(0, 600),
                lasting: rng.ms(800, 2500),
            },
            25..=44 => Fault::UpstreamBlackhole(rng.ms(400, 2500)),
            45..=64 => Fault::UpstreamReset,
            65..=79 => Fault::UpstreamRefuse(rng.ms(200, 800)),
            _ => Fault::UpstreamCut {
                dir: if rng.percent(50) {
                    Direction::Up
                } else {
                    Direction::Down
                },
                after: rng.between(40, 3000),
                lasting: rng.ms(800, 2000),
            },
        };
        if t + fault.lasting() + margin > end {
            break;
        }
        let next = t + fault.lasting() + rng.ms(800, 3000);
        out.push(Planned { at: t, fault });
        t = next;
    }
    out.sort_by_key(|p| p.at);
    out
}

/// The upstream relay's largest planned up-direction latency: an execution reaches the mock
/// at most that long after its claim (plus scheduling).
fn max_upstream_latency(windows: &[Window]) -> Duration {
    windows
        .iter()
        .filter_map(|w| match w.loss {
            Loss::Delay(d) => Some(d),
            _ => None,
        })
        .max()
        .unwrap_or(Duration::ZERO)
}

/// Seconds since the run's start.
#[derive(Clone)]
struct Clock(Instant);

impl Clock {
    fn now(&self) -> Duration {
        self.0.elapsed()
    }

    fn at(&self, offset: Duration) -> tokio::time::Instant {
        (self.0 + offset).into()
    }
}

fn secs(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64())
}

/// What a fault can do to claims and records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Loss {
    /// Redis restarted without persistence: every claim and record is gone.
    RecordsLost,
    /// Proxy B died: the claims it held are no longer renewed and expire.
    ClaimsOfB,
    /// Redis could not be reached (paused, blackholed, down, connections reset): leases are
    /// not renewed meanwhile. Merged with its neighbours; claim-losing from `lock_ttl / 3`.
    Unavailable,
    /// The machine stalled, not the plan: this process was not scheduled (CPU starvation; the
    /// relays run here, so Redis and the upstream stalled for both proxies), or Redis itself
    /// stopped answering outside any injected fault (an `fsync` under `appendfsync always` on
    /// a busy disk). Measured by the watchdogs. Counts like [`Loss::Unavailable`]; the only
    /// thing that can excuse a re-execution in the persistent run.
    Machine,
    /// The upstream relay delayed requests by up to this much (no loss; widens the gap between
    /// a claim and its execution).
    Delay(Duration),
}

#[derive(Debug, Clone)]
struct Window {
    start: Duration,
    end: Duration,
    loss: Loss,
    what: String,
}

#[derive(Default)]
struct Timeline {
    entries: Mutex<Vec<(Duration, String, String)>>,
    windows: Mutex<Vec<Window>>,
}

impl Timeline {
    fn note(&self, at: Duration, lane: &str, text: String) {
        self.entries
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((at, lane.to_owned(), text));
    }

    fn window(&self, start: Duration, end: Duration, loss: Loss, what: String) {
        self.windows
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Window {
                start,
                end,
                loss,
                what,
            });
    }

    fn windows(&self) -> Vec<Window> {
        self.windows
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn render(&self) -> String {
        let mut entries = self
            .entries
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        entries.sort_by_key(|e| e.0);
        let mut out = String::new();
        for (at, lane, text) in entries {
            let _ = writeln!(out, "  +{:>7}  {:<8} {}", secs(at), lane, text);
        }
        out
    }
}

/// How late a watchdog's answer must be to count as a stall of the machine.
const MACHINE_STALL: Duration = Duration::from_millis(250);

/// Watches this process's scheduling: a wake-up due every 20ms that comes [`MACHINE_STALL`]
/// late or more is a stall of the whole process (a loaded machine), recorded as a window. Runs
/// until aborted.
async fn process_watchdog(clock: Clock, tl: Arc<Timeline>) {
    let tick = Duration::from_millis(20);
    loop {
        let before = clock.now();
        tokio::time::sleep(tick).await;
        let after = clock.now();
        let late = (after - before).saturating_sub(tick);
        if late >= MACHINE_STALL {
            tl.note(
                before,
                "-",
                format!("this process stalled for {late:?} (CPU starvation)"),
            );
            tl.window(before, after, Loss::Machine, "process stalled".into());
        }
    }
}

/// Watches Redis itself, on a direct connection (not through the relay): a PING every 50ms
/// that takes [`MACHINE_STALL`] or more while no fault is injected into Redis (`disturbed` is
/// odd during a pause or a restart, and moves on at each start and end) is a stall of Redis,
/// recorded as a window. Runs until aborted.
async fn redis_watchdog(url: String, clock: Clock, tl: Arc<Timeline>, disturbed: Arc<AtomicU64>) {
    let client = ::redis::Client::open(url).expect("redis url");
    let mut conn: Option<::redis::aio::MultiplexedConnection> = None;
    loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let Some(c) = conn.as_mut() else {
            let connect = client.get_multiplexed_async_connection();
            conn = tokio::time::timeout(Duration::from_secs(1), connect)
                .await
                .ok()
                .and_then(Result::ok);
            continue;
        };
        let epoch = disturbed.load(Ordering::SeqCst);
        let sent = clock.now();
        let cmd = ::redis::cmd("PING");
        let ping = cmd.query_async::<String>(c);
        let answered = tokio::time::timeout(Duration::from_secs(2), ping).await;
        let took = clock.now() - sent;
        if !matches!(answered, Ok(Ok(_))) {
            conn = None;
        }
        let undisturbed = epoch % 2 == 0 && disturbed.load(Ordering::SeqCst) == epoch;
        if undisturbed && took >= MACHINE_STALL {
            tl.note(
                sent,
                "redis",
                format!("redis stalled for {took:?} (not injected)"),
            );
            tl.window(sent, sent + took, Loss::Machine, "redis stalled".into());
        }
    }
}

/// Runs the Redis faults; returns the server (for the final scan).
async fn redis_lane(
    plan: Vec<Planned>,
    mut redis: RedisServer,
    disturbed: Arc<AtomicU64>,
    relay: Arc<Relay>,
    persistent: bool,
    clock: Clock,
    tl: Arc<Timeline>,
) -> RedisServer {
    let lane = "redis";
    for p in plan {
        tokio::time::sleep_until(clock.at(p.at)).await;
        let start = clock.now();
        match p.fault {
            Fault::RedisPause(d) => {
                disturbed.fetch_add(1, Ordering::SeqCst);
                redis.pause();
                tl.note(start, lane, format!("SIGSTOP (planned {d:?})"));
                tokio::time::sleep(d).await;
                redis.resume();
                disturbed.fetch_add(1, Ordering::SeqCst);
                let end = clock.now();
                tl.note(end, lane, format!("SIGCONT after {:?}", end - start));
                tl.window(start, end, Loss::Unavailable, "redis paused".into());
            }
            Fault::RedisKill { down } => {
                disturbed.fetch_add(1, Ordering::SeqCst);
                tokio::task::block_in_place(|| redis.kill());
                tl.note(start, lane, "SIGKILL".into());
                tokio::time::sleep(down).await;
                tokio::task::block_in_place(|| redis.restart());
                disturbed.fetch_add(1, Ordering::SeqCst);
                let end = clock.now();
                let how = if persistent {
                    "restarted from its AOF"
                } else {
                    "restarted EMPTY (no persistence)"
                };
                tl.note(end, lane, format!("{how}, down {:?}", end - start));
                if persistent {
                    tl.window(start, end, Loss::Unavailable, "redis restarted".into());
                } else {
                    tl.window(
                        start,
                        end,
                        Loss::RecordsLost,
                        "redis restarted empty".into(),
                    );
                }
            }
            Fault::RedisBlackhole(d) => {
                relay.blackhole();
                tl.note(start, lane, format!("relay blackhole (planned {d:?})"));
                tokio::time::sleep(d).await;
                relay.pass();
                let end = clock.now();
                tl.note(
                    end,
                    lane,
                    format!(
                        "relay passes again after {:?}; its connections reset",
                        end - start
                    ),
                );
                tl.window(start, end, Loss::Unavailable, "redis blackholed".into());
            }
            Fault::RedisReset => {
                relay.reset_all();
                tl.note(start, lane, "relay resets every connection".into());
                // Commands in flight fail; the client reconnects at once.
                tl.window(
                    start,
                    start + Duration::from_millis(200),
                    Loss::Unavailable,
                    "redis connections reset".into(),
                );
            }
            Fault::RedisLatency { each_way, lasting } => {
                relay.set_latency(each_way, each_way);
                tl.note(start, lane, format!("relay latency {each_way:?} each way"));
                tokio::time::sleep(lasting).await;
                relay.set_latency(Duration::ZERO, Duration::ZERO);
                tl.note(clock.now(), lane, "relay latency off".into());
                // Commands still run (late): renewals land, so no lease is lost by latency
                // under lock_ttl / 3. Not a window.
            }
            other => unreachable!("not a redis fault: {other:?}"),
        }
    }
    redis
}

/// Runs the proxy-B faults; returns the running process and the logs of those killed.
async fn proxy_lane(
    plan: Vec<Planned>,
    mut b: ProxyProcess,
    yaml: String,
    port: u16,
    clock: Clock,
    tl: Arc<Timeline>,
) -> (ProxyProcess, Vec<String>) {
    let lane = "proxy-b";
    let mut logs = Vec::new();
    for p in plan {
        let Fault::ProxyKill { down } = p.fault else {
            unreachable!("not a proxy fault: {:?}", p.fault);
        };
        tokio::time::sleep_until(clock.at(p.at)).await;
        let start = clock.now();
        b.signal("-KILL");
        tl.note(start, lane, "SIGKILL".into());
        tl.window(start, start, Loss::ClaimsOfB, "proxy B killed".into());
        tokio::task::block_in_place(|| b.wait(Duration::from_secs(5)));
        logs.push(b.log());
        tokio::time::sleep(down).await;
        b = tokio::task::block_in_place(|| ProxyProcess::spawn_on(&yaml, port));
        let end = clock.now();
        tl.note(
            end,
            lane,
            format!("restarted on the same port, down {:?}", end - start),
        );
    }
    (b, logs)
}

/// Runs the upstream faults.
async fn upstream_lane(plan: Vec<Planned>, relay: Arc<Relay>, clock: Clock, tl: Arc<Timeline>) {
    let lane = "upstream";
    for p in plan {
        tokio::time::sleep_until(clock.at(p.at)).await;
        let start = clock.now();
        tl.note(start, lane, p.fault.describe());
        match p.fault {
            Fault::UpstreamLatency { up, down, lasting } => {
                relay.set_latency(up, down);
                tl.window(
                    start,
                    start + lasting,
                    Loss::Delay(up),
                    "upstream delayed".into(),
                );
                tokio::time::sleep(lasting).await;
                relay.set_latency(Duration::ZERO, Duration::ZERO);
            }
            Fault::UpstreamBlackhole(d) => {
                relay.blackhole();
                tokio::time::sleep(d).await;
                relay.pass();
            }
            Fault::UpstreamReset => relay.reset_all(),
            Fault::UpstreamRefuse(d) => {
                relay.refuse();
                tokio::time::sleep(d).await;
                relay.pass();
            }
            Fault::UpstreamCut {
                dir,
                after,
                lasting,
            } => {
                relay.cut_after(dir, Some(after));
                tokio::time::sleep(lasting).await;
                relay.cut_after(dir, None);
            }
            other => unreachable!("not an upstream fault: {other:?}"),
        }
        if p.fault.lasting() > Duration::ZERO {
            tl.note(clock.now(), lane, "healthy again".into());
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The load: operations and their clients
// ---------------------------------------------------------------------------------------------

const TENANTS: [&str; 3] = ["tenant-a", "tenant-b", "tenant-c"];

/// One logical operation: a tenant, a key, a body, sent until it settles.
#[derive(Debug)]
struct OpSpec {
    idx: usize,
    tenant: &'static str,
    key: String,
    body: String,
    /// `X-Mock-Delay`: how long the upstream takes.
    delay_ms: u64,
    start: Duration,
    /// Concurrent clients (a duplicate job sends the same operation twice at once).
    clients: usize,
}

fn plan_ops(spec: &RunSpec, rng: &mut Rng) -> Vec<OpSpec> {
    let last_start = spec.chaos.saturating_sub(Duration::from_secs(2));
    let mut ops: Vec<OpSpec> = Vec::with_capacity(spec.ops);
    for idx in 0..spec.ops {
        let mut tenant = TENANTS[(rng.next() % 3) as usize];
        // Every tenth operation reuses the previous one's key under another tenant: the scope
        // makes them two operations.
        let key = match ops.last() {
            Some(prev) if idx % 10 == 9 => {
                while tenant == prev.tenant {
                    tenant = TENANTS[(rng.next() % 3) as usize];
                }
                prev.key.clone()
            }
            _ => format!("chaos-{:x}-{idx}", spec.seed & 0xffff_ffff),
        };
        let body = serde_json::json!({
            "op": format!("{tenant}/{key}"),
            "n": idx,
            "seat": format!("{}{}", rng.between(1, 40), ["A", "B", "C", "D"][idx % 4]),
        })
        .to_string();
        let delay_ms = if rng.percent(15) {
            rng.between(2400, 2800)
        } else {
            rng.between(0, 150)
        };
        ops.push(OpSpec {
            idx,
            tenant,
            key,
            body,
            delay_ms,
            start: rng.ms(200, u64::try_from(last_start.as_millis()).expect("ms")),
            clients: if rng.percent(30) { 2 } else { 1 },
        });
    }
    ops
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Via {
    A,
    B,
}

impl Via {
    fn tag(self) -> &'static str {
        match self {
            Via::A => "a",
            Via::B => "b",
        }
    }
}

#[derive(Debug, Clone)]
enum AttemptResult {
    Answer {
        status: u16,
        replayed: bool,
        /// The problem type's slug, for `application/problem+json`.
        problem: Option<String>,
        body: Bytes,
    },
    Error(String),
}

#[derive(Debug, Clone)]
struct Attempt {
    op: usize,
    client: usize,
    id: u64,
    via: Via,
    sent: Duration,
    ended: Duration,
    result: AttemptResult,
}

impl Attempt {
    fn line(&self) -> String {
        let what = match &self.result {
            AttemptResult::Answer {
                status,
                replayed,
                problem,
                body,
            } => format!(
                "{status}{}{} {}",
                if *replayed { " replayed" } else { "" },
                problem
                    .as_ref()
                    .map(|p| format!(" {p}"))
                    .unwrap_or_default(),
                String::from_utf8_lossy(&body[..body.len().min(90)])
            ),
            AttemptResult::Error(e) => format!("client error: {e}"),
        };
        format!(
            "attempt {} client {} via {} +{}..+{}: {}",
            self.id,
            self.client,
            self.via.tag(),
            secs(self.sent),
            secs(self.ended),
            what
        )
    }
}

struct Ctx {
    clock: Clock,
    http: reqwest::Client,
    a: String,
    b: String,
    /// Milliseconds from the start after which clients stop retrying (set after the last
    /// fault).
    deadline_ms: AtomicU64,
    attempt_ids: AtomicU64,
    attempts: Mutex<Vec<Attempt>>,
}

/// What to do after an attempt.
enum Verdict {
    Settled,
    Retry,
    Unexpected(String),
}

fn verdict(r: &AttemptResult) -> Verdict {
    let AttemptResult::Answer {
        status,
        replayed,
        problem,
        ..
    } = r
    else {
        return Verdict::Retry;
    };
    match (*status, *replayed, problem.as_deref()) {
        (201, _, None) => Verdict::Settled,
        (502, true, Some("upstream-failed")) | (504, true, Some("upstream-timeout")) => {
            Verdict::Settled
        }
        (409, false, Some("request-in-progress"))
        | (503, false, Some("store-unavailable"))
        | (502, false, Some("upstream-unavailable" | "upstream-failed"))
        | (504, false, Some("upstream-timeout")) => Verdict::Retry,
        (s, replayed, p) => {
            Verdict::Unexpected(format!("status {s}, replayed {replayed}, problem {p:?}"))
        }
    }
}

#[derive(Debug, Clone)]
enum ClientEnd {
    Settled {
        at: Duration,
    },
    Unsettled,
    /// An answer the contract does not allow (reported from the attempt log).
    Unexpected,
}

/// One client of one operation: sends it through A or B at random, with a random timeout,
/// until it settles or the deadline passes.
async fn drive(
    ctx: Arc<Ctx>,
    op: Arc<OpSpec>,
    client: usize,
    mut rng: Rng,
) -> (usize, usize, ClientEnd) {
    let start = op.start
        + if client > 0 {
            rng.ms(0, 300)
        } else {
            Duration::ZERO
        };
    tokio::time::sleep_until(ctx.clock.at(start)).await;
    for _ in 0..500 {
        let deadline = Duration::from_millis(ctx.deadline_ms.load(Ordering::SeqCst));
        if ctx.clock.now() >= deadline {
            return (op.idx, client, ClientEnd::Unsettled);
        }
        let via = if rng.percent(50) { Via::A } else { Via::B };
        let timeout = match rng.between(0, 99) {
            0..=19 => rng.ms(300, 800),
            20..=49 => rng.ms(1000, 2000),
            _ => Duration::from_secs(5),
        };
        let a = attempt(&ctx, &op, client, via, timeout, true).await;
        let backoff = match verdict(&a.result) {
            Verdict::Settled => {
                return (op.idx, client, ClientEnd::Settled { at: a.ended });
            }
            Verdict::Unexpected(_) => return (op.idx, client, ClientEnd::Unexpected),
            Verdict::Retry => match &a.result {
                AttemptResult::Answer { status: 409, .. } => rng.ms(100, 500),
                _ => rng.ms(50, 400),
            },
        };
        tokio::time::sleep(backoff).await;
    }
    (op.idx, client, ClientEnd::Unsettled)
}

/// After the faults: sends the operation through `via` until it gets a result (a 201 or a
/// replayed saved answer), retrying a 503 or 409 for at most 10s; returns the last attempt.
async fn settle_via(ctx: &Ctx, op: &OpSpec, via: Via) -> Attempt {
    let until = ctx.clock.now() + Duration::from_secs(10);
    loop {
        let a = attempt(ctx, op, VERIFY, via, Duration::from_secs(5), false).await;
        if !matches!(verdict(&a.result), Verdict::Retry) || ctx.clock.now() >= until {
            return a;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Sends the operation once and logs the attempt.
async fn attempt(
    ctx: &Ctx,
    op: &OpSpec,
    client: usize,
    via: Via,
    timeout: Duration,
    slow_upstream: bool,
) -> Attempt {
    let id = ctx.attempt_ids.fetch_add(1, Ordering::Relaxed);
    let base = match via {
        Via::A => &ctx.a,
        Via::B => &ctx.b,
    };
    let sent = ctx.clock.now();
    let mut req = ctx
        .http
        .post(format!("{base}/bookings"))
        .header("Idempotency-Key", &op.key)
        .header("Authorization", format!("Bearer {}", op.tenant))
        .header("Content-Type", "application/json")
        .header("X-Chaos-Via", via.tag())
        .header("X-Chaos-Attempt", id.to_string())
        .timeout(timeout)
        .body(op.body.clone());
    if slow_upstream {
        req = req.header("X-Mock-Delay", format!("{}ms", op.delay_ms));
    }
    let result = match req.send().await {
        Ok(resp) => {
            let status = resp.status().as_u16();
            let header = |name: &str| {
                resp.headers()
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_owned()
            };
            let replayed = header("idempotent-replayed") == "true";
            let is_problem = header("content-type") == "application/problem+json";
            match resp.bytes().await {
                Ok(body) => {
                    let problem = is_problem.then(|| {
                        serde_json::from_slice::<serde_json::Value>(&body)
                            .ok()
                            .and_then(|d| d["type"].as_str().map(str::to_owned))
                            .map(|t| {
                                t.strip_prefix("urn:idemproxy:problem:")
                                    .unwrap_or(&t)
                                    .to_owned()
                            })
                            .unwrap_or_else(|| "(unreadable problem)".into())
                    });
                    AttemptResult::Answer {
                        status,
                        replayed,
                        problem,
                        body,
                    }
                }
                Err(e) => AttemptResult::Error(format!("reading the body: {e}")),
            }
        }
        Err(e) => AttemptResult::Error(if e.is_timeout() {
            format!("timed out after {timeout:?}")
        } else {
            format!("{e}")
        }),
    };
    let a = Attempt {
        op: op.idx,
        client,
        id,
        via,
        sent,
        ended: ctx.clock.now(),
        result,
    };
    ctx.attempts
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push(a.clone());
    a
}

// ---------------------------------------------------------------------------------------------
// The tap: the requests the upstream received, timestamped
// ---------------------------------------------------------------------------------------------

/// One request forwarded to the mock upstream, whole (head and body): an execution.
#[derive(Debug, Clone)]
struct Exec {
    at: Duration,
    auth: String,
    key: String,
    via: String,
    attempt: String,
}

/// Parses the HTTP/1.1 requests the upstream relay forwards (hyper's client: `content-length`
/// bodies), per connection.
#[derive(Default)]
struct ExecTap {
    clock: Mutex<Option<Clock>>,
    conns: Mutex<HashMap<u64, RequestParser>>,
    events: Mutex<Vec<Exec>>,
    errors: Mutex<Vec<String>>,
}

impl ExecTap {
    fn start(&self, clock: Clock) {
        *self.clock.lock().unwrap_or_else(PoisonError::into_inner) = Some(clock);
    }

    fn events(&self) -> Vec<Exec> {
        self.events
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn errors(&self) -> Vec<String> {
        self.errors
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl Tap for ExecTap {
    fn forwarded(&self, conn: u64, dir: Direction, bytes: &[u8]) {
        if dir != Direction::Up {
            return;
        }
        let now = self
            .clock
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map(Clock::now)
            .unwrap_or_default();
        let mut done = Vec::new();
        let result = self
            .conns
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(conn)
            .or_default()
            .feed(bytes, now, &mut done);
        if let Err(e) = result {
            self.errors
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(format!("connection {conn}: {e}"));
        }
        self.events
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(done);
    }

    fn closed(&self, conn: u64) {
        self.conns
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&conn);
    }
}

#[derive(Default)]
struct RequestParser {
    buf: Vec<u8>,
    /// The request whose body is being read, and how much of it is left.
    pending: Option<Exec>,
    body_left: usize,
    broken: bool,
}

impl RequestParser {
    fn feed(&mut self, bytes: &[u8], now: Duration, out: &mut Vec<Exec>) -> Result<(), String> {
        if self.broken {
            return Ok(());
        }
        self.buf.extend_from_slice(bytes);
        loop {
            if let Some(mut exec) = self.pending.take() {
                if self.buf.len() < self.body_left {
                    self.body_left -= self.buf.len();
                    self.buf.clear();
                    self.pending = Some(exec);
                    return Ok(());
                }
                self.buf.drain(..self.body_left);
                self.body_left = 0;
                exec.at = now;
                if !exec.key.is_empty() {
                    out.push(exec);
                }
                continue;
            }
            let Some(end) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                return Ok(());
            };
            let head = String::from_utf8_lossy(&self.buf[..end]).into_owned();
            self.buf.drain(..end + 4);
            let mut exec = Exec {
                at: now,
                auth: String::new(),
                key: String::new(),
                via: String::new(),
                attempt: String::new(),
            };
            let mut length = 0usize;
            for line in head.lines().skip(1) {
                let Some((name, value)) = line.split_once(':') else {
                    continue;
                };
                let value = value.trim().to_owned();
                match name.trim().to_ascii_lowercase().as_str() {
                    "content-length" => {
                        length = value.parse().map_err(|_| format!("bad length {value:?}"))?;
                    }
                    "transfer-encoding" => {
                        self.broken = true;
                        return Err(format!("a {value} request body: the tap can't follow it"));
                    }
                    "authorization" => exec.auth = value,
                    "idempotency-key" => exec.key = value,
                    "x-chaos-via" => exec.via = value,
                    "x-chaos-attempt" => exec.attempt = value,
                    _ => {}
                }
            }
            self.pending = Some(exec);
            self.body_left = length;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Evidence from Redis
// ---------------------------------------------------------------------------------------------

/// Every record that is an in-progress claim (`"IDP" 0x01 'P' …`, see `src/record.rs`), with
/// its remaining TTL.
fn in_progress_records(redis: &RedisServer) -> Vec<String> {
    let mut conn = redis.conn();
    let mut cursor: u64 = 0;
    let mut found = Vec::new();
    loop {
        let (next, keys): (u64, Vec<String>) = ::redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg("idemproxy:*")
            .arg("COUNT")
            .arg(1000)
            .query(&mut conn)
            .expect("SCAN");
        for key in keys {
            let value: Option<Vec<u8>> =
                ::redis::cmd("GET").arg(&key).query(&mut conn).expect("GET");
            if value.is_some_and(|v| v.starts_with(b"IDP\x01P")) {
                let pttl: i64 = ::redis::cmd("PTTL")
                    .arg(&key)
                    .query(&mut conn)
                    .expect("PTTL");
                found.push(format!("{key} (pttl {pttl}ms)"));
            }
        }
        cursor = next;
        if cursor == 0 {
            return found;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The checks
// ---------------------------------------------------------------------------------------------

struct RunData<'a> {
    spec: &'a RunSpec,
    ops: &'a [Arc<OpSpec>],
    attempts: Vec<Attempt>,
    ends: Vec<(usize, usize, ClientEnd)>,
    execs: Vec<Exec>,
    tap_errors: Vec<String>,
    ledger: BTreeMap<String, u64>,
    windows: Vec<Window>,
    last_fault: Duration,
    in_progress: Vec<String>,
    verifications: Vec<(usize, Attempt, Attempt)>,
}

struct Outcome {
    failures: Vec<String>,
    summary: String,
}

/// A fault that can make an operation run again.
#[derive(Debug, Clone)]
struct LossWindow {
    start: Duration,
    end: Duration,
    loss: Loss,
    what: String,
    /// Part of it was the machine stalling ([`Loss::Machine`]).
    machine: bool,
}

/// The claim-losing windows: restarts that lost data, kills of B, and Redis unavailability
/// merged with neighbours closer than `lock_ttl`, kept when the merged span reaches
/// `lock_ttl / 3`.
fn loss_windows(windows: &[Window]) -> Vec<LossWindow> {
    let mut out: Vec<LossWindow> = windows
        .iter()
        .filter(|w| matches!(w.loss, Loss::RecordsLost | Loss::ClaimsOfB))
        .map(|w| LossWindow {
            start: w.start,
            end: w.end,
            loss: w.loss,
            what: w.what.clone(),
            machine: false,
        })
        .collect();
    let mut stalls: Vec<&Window> = windows
        .iter()
        .filter(|w| matches!(w.loss, Loss::Unavailable | Loss::Machine))
        .collect();
    stalls.sort_by_key(|w| w.start);
    let mut merged: Vec<LossWindow> = Vec::new();
    for w in stalls {
        match merged.last_mut() {
            Some(m) if w.start <= m.end + LOCK_TTL => {
                m.end = m.end.max(w.end);
                m.what = format!("{} + {}", m.what, w.what);
                m.machine |= w.loss == Loss::Machine;
            }
            _ => merged.push(LossWindow {
                start: w.start,
                end: w.end,
                loss: Loss::Unavailable,
                what: w.what.clone(),
                machine: w.loss == Loss::Machine,
            }),
        }
    }
    out.extend(
        merged
            .into_iter()
            .filter(|m| m.end - m.start >= LOCK_TTL / 3),
    );
    out.sort_by_key(|w| w.start);
    out
}

/// Does `w` explain that the execution at `prev` (through `via`) ran again at `next`? The
/// fault must come after the earlier execution's claim (at most `slack` before it reached the
/// upstream) and before the later one.
fn explains(w: &LossWindow, prev: &Exec, next: &Exec, slack: Duration) -> bool {
    let after_claim = w.end + slack >= prev.at;
    let before_next = w.start <= next.at;
    match w.loss {
        Loss::ClaimsOfB => prev.via == "b" && after_claim && before_next,
        _ => after_claim && before_next,
    }
}

fn check(d: &RunData<'_>) -> Outcome {
    let mut failures = Vec::new();
    // With a persistent Redis and no proxy kills, nothing may run twice — unless the machine
    // stalled long enough to lose a lease (measured, and printed in the timeline).
    let strict = d.spec.persistent;
    let losses: Vec<LossWindow> = loss_windows(&d.windows)
        .into_iter()
        .filter(|w| !strict || w.machine)
        .collect();
    let slack = Duration::from_secs(1) + max_upstream_latency(&d.windows);
    let op_of: HashMap<(String, String), usize> = d
        .ops
        .iter()
        .map(|o| ((format!("Bearer {}", o.tenant), o.key.clone()), o.idx))
        .collect();
    let mut attempts_of: HashMap<usize, Vec<&Attempt>> = HashMap::new();
    for a in &d.attempts {
        attempts_of.entry(a.op).or_default().push(a);
    }
    for v in attempts_of.values_mut() {
        v.sort_by_key(|a| (a.sent, a.id));
    }
    let history = |op: usize| -> String {
        let mut s = String::new();
        for a in attempts_of.get(&op).into_iter().flatten().take(30) {
            let _ = write!(s, "\n      {}", a.line());
        }
        s
    };

    // The tap is the evidence: it must be whole.
    for e in &d.tap_errors {
        failures.push(format!("harness: the upstream tap lost track: {e}"));
    }
    let mut execs_of: HashMap<usize, Vec<&Exec>> = HashMap::new();
    let mut tap_by_key: HashMap<&str, u64> = HashMap::new();
    for e in &d.execs {
        *tap_by_key.entry(e.key.as_str()).or_default() += 1;
        match op_of.get(&(e.auth.clone(), e.key.clone())) {
            Some(op) => execs_of.entry(*op).or_default().push(e),
            None => failures.push(format!(
                "the upstream received an operation no client sent: {} {:?}",
                e.auth, e.key
            )),
        }
    }
    for v in execs_of.values_mut() {
        v.sort_by_key(|e| e.at);
    }
    for (key, calls) in &d.ledger {
        let seen = tap_by_key.get(key.as_str()).copied().unwrap_or(0);
        if *calls > seen {
            failures.push(format!(
                "harness: the mock counted {calls} executions of {key:?}, the tap saw {seen}"
            ));
        }
    }
    let ledger_total: u64 = d.ledger.values().sum();

    // Every answer is one the contract allows.
    for a in &d.attempts {
        if let Verdict::Unexpected(why) = verdict(&a.result) {
            failures.push(format!(
                "op {} got an answer the contract does not allow ({why}): {}",
                a.op,
                a.line()
            ));
        }
    }

    // Bodies: a booking embeds its own request; a booking id answers one operation.
    let mut booking_owner: HashMap<String, usize> = HashMap::new();
    let mut bookings_of: HashMap<usize, HashSet<String>> = HashMap::new();
    for a in &d.attempts {
        let AttemptResult::Answer {
            status: 201, body, ..
        } = &a.result
        else {
            continue;
        };
        let op = &d.ops[a.op];
        let doc: serde_json::Value = match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(e) => {
                failures.push(format!(
                    "op {}: a 201 that is not JSON ({e}): {}",
                    a.op,
                    a.line()
                ));
                continue;
            }
        };
        let expected: serde_json::Value =
            serde_json::from_str(&op.body).expect("the op body is JSON");
        if doc["request"] != expected {
            failures.push(format!(
                "op {} ({}/{}) got another request's booking: {}",
                a.op,
                op.tenant,
                op.key,
                a.line()
            ));
        }
        let Some(id) = doc["id"].as_str() else {
            failures.push(format!(
                "op {}: a booking without an id: {}",
                a.op,
                a.line()
            ));
            continue;
        };
        let owner = *booking_owner.entry(id.to_owned()).or_insert(a.op);
        if owner != a.op {
            failures.push(format!(
                "booking {id} was answered to op {owner} and to op {}",
                a.op
            ));
        }
        bookings_of.entry(a.op).or_default().insert(id.to_owned());
    }

    // Executions: every re-execution explained, or none at all (persistent run).
    let mut twice = 0usize;
    let mut explained_by: BTreeMap<String, usize> = BTreeMap::new();
    for op in d.ops {
        let execs = execs_of.get(&op.idx).cloned().unwrap_or_default();
        let succeeded = attempts_of
            .get(&op.idx)
            .into_iter()
            .flatten()
            .any(|a| matches!(a.result, AttemptResult::Answer { status: 201, .. }));
        if succeeded && execs.is_empty() {
            failures.push(format!(
                "op {} got a 201 but the upstream never received it{}",
                op.idx,
                history(op.idx)
            ));
        }
        let bookings = bookings_of.get(&op.idx).map_or(0, HashSet::len);
        if bookings > execs.len() {
            failures.push(format!(
                "op {}: {bookings} different bookings answered, {} executions",
                op.idx,
                execs.len()
            ));
        }
        if execs.len() < 2 {
            continue;
        }
        twice += 1;
        let times: Vec<String> = execs
            .iter()
            .map(|e| format!("+{} via {} (attempt {})", secs(e.at), e.via, e.attempt))
            .collect();
        let explanations: Vec<Option<&LossWindow>> = execs
            .windows(2)
            .map(|pair| losses.iter().find(|w| explains(w, pair[0], pair[1], slack)))
            .collect();
        for w in explanations.iter().flatten() {
            let kind = if w.machine {
                format!("{:?}+Machine", w.loss)
            } else {
                format!("{:?}", w.loss)
            };
            *explained_by.entry(kind).or_default() += 1;
        }
        if strict && explanations.iter().any(Option::is_none) {
            failures.push(format!(
                "op {} ({}/{}) ran {} times with a persistent Redis and no proxy kills{}: {}{}",
                op.idx,
                op.tenant,
                op.key,
                execs.len(),
                if succeeded {
                    " (a client saw it succeed)"
                } else {
                    ""
                },
                times.join(", "),
                history(op.idx)
            ));
            continue;
        }
        for (pair, explanation) in execs.windows(2).zip(&explanations) {
            let (prev, next) = (pair[0], pair[1]);
            if explanation.is_some() {
                continue;
            }
            failures.push(format!(
                "op {} ({}/{}) ran again with nothing to explain it: executions {}; \
                     no claim-losing fault between +{} (minus {}s slack) and +{}{}{}",
                op.idx,
                op.tenant,
                op.key,
                times.join(", "),
                secs(prev.at),
                secs(slack),
                secs(next.at),
                if succeeded {
                    "; a client saw it succeed"
                } else {
                    ""
                },
                history(op.idx)
            ));
        }
    }

    // Results: one body per operation, unless a claim-losing fault touched its lifetime.
    let is_result = |a: &Attempt| match &a.result {
        AttemptResult::Answer {
            status, problem, ..
        } => {
            *status == 201
                || (*status == 502 && problem.as_deref() == Some("upstream-failed"))
                || (*status == 504 && problem.as_deref() == Some("upstream-timeout"))
        }
        AttemptResult::Error(_) => false,
    };
    let body_of = |a: &Attempt| match &a.result {
        AttemptResult::Answer { body, status, .. } => Some((*status, body.clone())),
        AttemptResult::Error(_) => None,
    };
    for op in d.ops {
        let all = attempts_of.get(&op.idx).cloned().unwrap_or_default();
        let results: Vec<&&Attempt> = all.iter().filter(|a| is_result(a)).collect();
        let distinct: HashSet<(u16, Bytes)> = results.iter().filter_map(|a| body_of(a)).collect();
        let (Some(first), Some(last)) = (all.first(), all.iter().map(|a| a.ended).max()) else {
            continue;
        };
        let lifetime_losses = losses
            .iter()
            .filter(|w| w.end + slack >= first.sent && w.start <= last)
            .count();
        if distinct.len() > 1 + lifetime_losses {
            failures.push(format!(
                "op {} ({}/{}) has {} different results and {} claim-losing fault(s) in its \
                 lifetime: replays must be byte-identical{}",
                op.idx,
                op.tenant,
                op.key,
                distinct.len(),
                lifetime_losses,
                history(op.idx)
            ));
        }
    }

    // Nothing hangs.
    let mut settle_after_fault = Duration::ZERO;
    let mut settled_at: HashMap<usize, Duration> = HashMap::new();
    for (op, client, end) in &d.ends {
        match end {
            ClientEnd::Settled { at } => {
                settle_after_fault = settle_after_fault.max(at.saturating_sub(d.last_fault));
                let e = settled_at.entry(*op).or_insert(*at);
                *e = (*e).max(*at);
            }
            ClientEnd::Unsettled => failures.push(format!(
                "op {op} client {client} did not settle within {SETTLE_BOUND:?} after the last \
                 fault (+{}){}",
                secs(d.last_fault),
                history(*op)
            )),
            // Already reported with every unexpected answer.
            ClientEnd::Unexpected => {}
        }
    }

    // No in-progress record outlives lock_ttl after the last fault.
    for r in &d.in_progress {
        failures.push(format!(
            "an in-progress record outlived lock_ttl after the last fault: {r}"
        ));
    }

    // The closing replays.
    for (op, a, b) in &d.verifications {
        let (Some(ra), Some(rb)) = (body_of(a), body_of(b)) else {
            failures.push(format!(
                "op {op}: a closing request failed: {} / {}",
                a.line(),
                b.line()
            ));
            continue;
        };
        if !matches!(verdict(&a.result), Verdict::Settled) {
            failures.push(format!(
                "op {op}: after the faults, not a result: {}",
                a.line()
            ));
            continue;
        }
        let b_replayed = matches!(b.result, AttemptResult::Answer { replayed: true, .. });
        if ra != rb || !b_replayed {
            failures.push(format!(
                "op {op}: two closing requests, not a byte-identical replay:\n      {}\n      {}",
                a.line(),
                b.line()
            ));
        }
        // Without a claim-losing fault since the op settled, its record answers unchanged.
        let Some(settled) = settled_at.get(op) else {
            continue;
        };
        let lost_since = losses
            .iter()
            .any(|w| w.end + slack >= *settled && w.start <= a.sent);
        let a_replayed = matches!(a.result, AttemptResult::Answer { replayed: true, .. });
        if !lost_since {
            let last_result = attempts_of
                .get(op)
                .into_iter()
                .flatten()
                .filter(|x| x.client != VERIFY && is_result(x))
                .max_by_key(|x| x.ended)
                .and_then(|x| body_of(x));
            if !a_replayed || last_result.as_ref() != Some(&ra) {
                failures.push(format!(
                    "op {op}: its record did not survive (no fault could lose it): {}{}",
                    a.line(),
                    history(*op)
                ));
            }
        }
    }

    let mut statuses: BTreeMap<String, usize> = BTreeMap::new();
    for a in &d.attempts {
        let k = match &a.result {
            AttemptResult::Answer {
                status,
                replayed,
                problem,
                ..
            } => format!(
                "{status}{}{}",
                if *replayed { " replayed" } else { "" },
                problem
                    .as_ref()
                    .map(|p| format!(" {p}"))
                    .unwrap_or_default()
            ),
            AttemptResult::Error(e) if e.starts_with("timed out") => "client timeout".into(),
            AttemptResult::Error(_) => "client error".into(),
        };
        *statuses.entry(k).or_default() += 1;
    }
    let mut summary = String::new();
    let _ = writeln!(
        summary,
        "operations {}, attempts {}, upstream executions {} (ledger {}), operations run more \
         than once {} (explained re-executions: {:?}), settled at most {}s after the last \
         fault, in-progress records left {}",
        d.ops.len(),
        d.attempts.len(),
        d.execs.len(),
        ledger_total,
        twice,
        explained_by,
        secs(settle_after_fault),
        d.in_progress.len()
    );
    let _ = writeln!(summary, "answers: {statuses:?}");
    let _ = write!(summary, "claim-losing windows (slack {}s):", secs(slack));
    for w in &losses {
        let _ = write!(
            summary,
            "\n  +{}..+{} {:?}: {}",
            secs(w.start),
            secs(w.end),
            w.loss,
            w.what
        );
    }
    Outcome { failures, summary }
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
