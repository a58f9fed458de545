//! The store under chaos — Redis (with or without persistence) or PostgreSQL —, the proxies'
//! configuration for it, the lane that injects its faults, and the closing scan for claims left
//! in progress (its watchdog is in `watchdogs.rs`).
//!
//! Faults reach the store two ways: through its server's processes (SIGSTOP/SIGCONT; Redis
//! SIGKILLed and started again; PostgreSQL crashed with `pg_ctl stop -m immediate` and started
//! again, which replays its WAL) and through the relay both proxies reach it by (blackhole,
//! reset, latency). Every fault that makes the store unreachable is a window on the timeline;
//! what it may explain is decided in `losses.rs`.
//!
//! # Why a PostgreSQL crash explains nothing
//! A crash keeps every claim and save it committed (`synchronous_commit` on; `fsync=off` only
//! matters when the machine loses power, which the test never does), so it loses no record.
//! What it does do is make the database unreachable, from the stop until the restarted server
//! answers, while the leases run on the database's clock. A lease is lost only when two
//! renewals in a row fail: they are due every `lock_ttl / 3`, so after one miss the next still
//! lands with a third of the lease to spare, but after two the third is due at the very instant
//! the lease ends. An outage that covers two renewal instants of one lease lasts `lock_ttl / 3`
//! or more, counting a renewal already in flight when it began and the first call on a fresh
//! connection after it; each of those takes more than [`MACHINE_STALL`] only on a machine that
//! stalls, which the watchdogs record. So a crash whose outage stays under
//! [`crash_outage_bound`] (`lock_ttl / 3 − 2 × MACHINE_STALL`) cannot lose a lease, and is a
//! window of its own kind, [`Loss::Crash`], which never explains a re-execution. The Postgres run
//! uses a lease long enough that a crash's outage (stop, short down time, restart with WAL
//! replay) fits well under that bound; a restart that overruns it did so because the machine
//! was slow, and its part past the bound is recorded as a machine stall.

use std::path::Path;

use super::*;
use harness::postgres::{PgServer, on_postgres, store_block};

/// Which store a run puts under chaos.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StoreKind {
    /// Redis without persistence: a restart loses every record.
    Redis,
    /// Redis with `appendonly yes`, `appendfsync always`: a restart keeps every record.
    PersistentRedis,
    /// A PostgreSQL server of the test's own: a crash keeps every committed claim and save.
    Postgres,
}

impl StoreKind {
    /// The store's lane on the timeline.
    pub(crate) fn name(self) -> &'static str {
        match self {
            StoreKind::Redis | StoreKind::PersistentRedis => "redis",
            StoreKind::Postgres => "postgres",
        }
    }

    /// How its data survives a restart, for the run's header.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            StoreKind::Redis => "redis, no persistence",
            StoreKind::PersistentRedis => "redis, AOF appendfsync always",
            StoreKind::Postgres => "postgres, crash-safe (fsync off: no power loss here)",
        }
    }
}

/// The proxies' PostgreSQL schema, and their pools: modest, so that a crash or a stop empties
/// and refills them, and two instances contend for the server.
pub(crate) const PG_SCHEMA: &str = "idemproxy";
pub(crate) const PG_POOL_SIZE: u32 = 8;

/// The longest outage of a PostgreSQL crash that explains nothing (see the module's docs).
pub(crate) fn crash_outage_bound(lock_ttl: Duration) -> Duration {
    (lock_ttl / 3).saturating_sub(MACHINE_STALL * 2)
}

/// The store's server.
pub(crate) enum StoreServer {
    Redis(RedisServer),
    Postgres(PgServer),
}

impl StoreServer {
    /// Starts the store of `kind`; a persistent Redis keeps its AOF in `aof_dir`.
    pub(crate) fn start(kind: StoreKind, aof_dir: &Path) -> StoreServer {
        match kind {
            StoreKind::Redis => StoreServer::Redis(RedisServer::start()),
            StoreKind::PersistentRedis => {
                let dir = aof_dir.to_str().expect("utf-8 temp path").to_owned();
                StoreServer::Redis(RedisServer::start_with(&[
                    "--appendonly",
                    "yes",
                    "--appendfsync",
                    "always",
                    "--dir",
                    &dir,
                ]))
            }
            StoreKind::Postgres => StoreServer::Postgres(PgServer::start()),
        }
    }

    /// Where the relay in front of it connects.
    pub(crate) fn addr(&self) -> std::net::SocketAddr {
        match self {
            StoreServer::Redis(r) => r.addr(),
            StoreServer::Postgres(pg) => pg.addr(),
        }
    }

    /// The proxies' configuration (made by `Env::config_with` on the memory store, with
    /// `timeout: …` in its `store:` block) with its `store:` block for this store, reached
    /// through `relay`.
    pub(crate) fn configure(&self, yaml: &str, relay: &Relay) -> String {
        let memory = format!("store:\n  backend: memory\n  timeout: {STORE_TIMEOUT_MS}ms\n");
        assert!(
            yaml.contains(&memory),
            "the harness's store block moved:\n{yaml}"
        );
        match self {
            StoreServer::Redis(_) => yaml.replace(
                &memory,
                &format!(
                    "store:\n  backend: redis\n  url: redis://{}/0\n  timeout: {STORE_TIMEOUT_MS}ms\n",
                    relay.addr()
                ),
            ),
            StoreServer::Postgres(pg) => {
                // The sweep runs several times in a run: deleting lapsed claims while keys
                // are taken over is part of what is under test.
                let extra =
                    format!("pool_size: {PG_POOL_SIZE}\nsweep_interval: 5s\ntimeout: {STORE_TIMEOUT_MS}ms");
                on_postgres(
                    yaml,
                    &store_block(&pg.url_via(relay.addr().port()), PG_SCHEMA, &extra),
                )
            }
        }
    }

    /// SIGSTOP: the store hangs, its connections stay open.
    fn pause(&self) {
        match self {
            StoreServer::Redis(r) => r.pause(),
            StoreServer::Postgres(pg) => pg.pause(),
        }
    }

    fn resume(&self) {
        match self {
            StoreServer::Redis(r) => r.resume(),
            StoreServer::Postgres(pg) => pg.resume(),
        }
    }
}

/// Every record that is an in-progress claim, with its remaining time.
pub(crate) fn in_progress_records(store: &StoreServer) -> Vec<String> {
    match store {
        StoreServer::Redis(r) => in_progress_redis(r),
        StoreServer::Postgres(pg) => {
            // The agreed layout: a claim in flight is the row with a token; a finished record
            // has none.
            let rows = pg.sql(&format!(
                "SELECT key, expires_at - now() FROM {PG_SCHEMA}.records
                 WHERE token IS NOT NULL AND expires_at > now() ORDER BY key"
            ));
            rows.lines()
                .filter(|l| !l.trim().is_empty())
                .map(|l| match l.split_once('|') {
                    Some((key, left)) => format!("{key} ({left} left)"),
                    None => l.to_owned(),
                })
                .collect()
        }
    }
}

/// Every Redis record that is an in-progress claim (`"IDP" 0x01 'P' …`, see `src/record.rs`),
/// with its remaining TTL.
fn in_progress_redis(redis: &RedisServer) -> Vec<String> {
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
// The fault lane
// ---------------------------------------------------------------------------------------------

/// Runs the store's faults; returns the server (for the final scan).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn store_lane(
    plan: Vec<Planned>,
    mut store: StoreServer,
    kind: StoreKind,
    lock_ttl: Duration,
    disturbed: Arc<AtomicU64>,
    relay: Arc<Relay>,
    clock: Clock,
    tl: Arc<Timeline>,
) -> StoreServer {
    let lane = kind.name();
    for p in plan {
        tokio::time::sleep_until(clock.at(p.at)).await;
        let start = clock.now();
        match p.fault {
            Fault::StorePause(d) => {
                disturbed.fetch_add(1, Ordering::SeqCst);
                // PostgreSQL: the postmaster and then each backend, one `kill` each.
                tokio::task::block_in_place(|| store.pause());
                tl.note(start, lane, format!("SIGSTOP (planned {d:?})"));
                tokio::time::sleep(d).await;
                tokio::task::block_in_place(|| store.resume());
                disturbed.fetch_add(1, Ordering::SeqCst);
                let end = clock.now();
                tl.note(end, lane, format!("SIGCONT after {:?}", end - start));
                tl.window(start, end, Loss::Unavailable, format!("{lane} paused"));
            }
            Fault::StoreKill { down } => match &mut store {
                StoreServer::Redis(redis) => {
                    let persistent = kind == StoreKind::PersistentRedis;
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
                StoreServer::Postgres(pg) => {
                    disturbed.fetch_add(1, Ordering::SeqCst);
                    tokio::task::block_in_place(|| pg.crash());
                    let stopped = clock.now();
                    tl.note(
                        start,
                        lane,
                        format!(
                            "crash: pg_ctl stop -m immediate (every process gone after {:?})",
                            stopped - start
                        ),
                    );
                    tokio::time::sleep(down).await;
                    tokio::task::block_in_place(|| pg.start_again());
                    disturbed.fetch_add(1, Ordering::SeqCst);
                    let end = clock.now();
                    let outage = end - start;
                    let bound = crash_outage_bound(lock_ttl);
                    tl.note(
                        end,
                        lane,
                        format!(
                            "restarted (WAL replayed), answering again: outage {outage:?} (down {down:?}; explains nothing under {bound:?})"
                        ),
                    );
                    tl.window(start, end, Loss::Crash, "postgres crashed".into());
                    if outage > bound {
                        // The plan keeps the outage well under the bound; a restart this slow
                        // is the machine's doing, and that is all it may excuse.
                        tl.note(
                            start + bound,
                            lane,
                            format!(
                                "the crash's outage ran {:?} past {bound:?}: a slow machine",
                                outage - bound
                            ),
                        );
                        tl.window(
                            start + bound,
                            end,
                            Loss::Machine,
                            "postgres restart overran".into(),
                        );
                    }
                }
            },
            Fault::StoreBlackhole(d) => {
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
                tl.window(start, end, Loss::Unavailable, format!("{lane} blackholed"));
            }
            Fault::StoreReset => {
                relay.reset_all();
                tl.note(start, lane, "relay resets every connection".into());
                // Commands in flight fail; the client reconnects at once.
                tl.window(
                    start,
                    start + Duration::from_millis(200),
                    Loss::Unavailable,
                    format!("{lane} connections reset"),
                );
            }
            Fault::StoreLatency { each_way, lasting } => {
                relay.set_latency(each_way, each_way);
                tl.note(start, lane, format!("relay latency {each_way:?} each way"));
                tokio::time::sleep(lasting).await;
                relay.set_latency(Duration::ZERO, Duration::ZERO);
                tl.note(clock.now(), lane, "relay latency off".into());
                // Commands still run (late): renewals land, so no lease is lost by latency
                // under lock_ttl / 3 (PostgreSQL: a fresh connection's three round trips,
                // start-up, prepare and execute, fit in store.timeout at its planned latency).
                // Not a window.
            }
            other => unreachable!("not a store fault: {other:?}"),
        }
    }
    store
}
