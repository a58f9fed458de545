//! The fault plan: a seeded PRNG, the faults each lane injects and when, and the timeline of
//! what happened.

use super::*;

#[derive(Clone)]
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    /// Seeds through splitmix64, so that nearby seeds give unrelated streams (and 0 works).
    pub(crate) fn new(seed: u64) -> Rng {
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        Rng(if z == 0 { 1 } else { z })
    }

    pub(crate) fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `lo..=hi`.
    pub(crate) fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }

    /// Milliseconds, uniform in `lo..=hi`.
    pub(crate) fn ms(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(self.between(lo, hi))
    }

    pub(crate) fn percent(&mut self, p: u64) -> bool {
        self.next() % 100 < p
    }

    /// An independent stream.
    pub(crate) fn fork(&mut self, salt: u64) -> Rng {
        Rng::new(self.next() ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }
}

// ---------------------------------------------------------------------------------------------
// Faults: the plan, the lanes that inject them, the timeline
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lane {
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
pub(crate) enum Fault {
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
    pub(crate) fn lane(&self) -> Lane {
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
    pub(crate) fn lasting(&self) -> Duration {
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

    pub(crate) fn describe(&self) -> String {
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
pub(crate) struct Planned {
    pub(crate) at: Duration,
    pub(crate) fault: Fault,
}

/// The faults of a run, from its seed. Within a lane faults never overlap; Redis faults are at
/// least `lock_ttl` apart, so that short stalls stay short.
pub(crate) fn plan_faults(spec: &RunSpec, rng: &mut Rng) -> Vec<Planned> {
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
pub(crate) fn max_upstream_latency(windows: &[Window]) -> Duration {
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
pub(crate) struct Clock(pub(crate) Instant);

impl Clock {
    pub(crate) fn now(&self) -> Duration {
        self.0.elapsed()
    }

    pub(crate) fn at(&self, offset: Duration) -> tokio::time::Instant {
        (self.0 + offset).into()
    }
}

pub(crate) fn secs(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64())
}

/// What a fault can do to claims and records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Loss {
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
pub(crate) struct Window {
    pub(crate) start: Duration,
    pub(crate) end: Duration,
    pub(crate) loss: Loss,
    pub(crate) what: String,
}

#[derive(Default)]
pub(crate) struct Timeline {
    pub(crate) entries: Mutex<Vec<(Duration, String, String)>>,
    pub(crate) windows: Mutex<Vec<Window>>,
}

impl Timeline {
    pub(crate) fn note(&self, at: Duration, lane: &str, text: String) {
        self.entries
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((at, lane.to_owned(), text));
    }

    pub(crate) fn window(&self, start: Duration, end: Duration, loss: Loss, what: String) {
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

    pub(crate) fn windows(&self) -> Vec<Window> {
        self.windows
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub(crate) fn render(&self) -> String {
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
pub(crate) const MACHINE_STALL: Duration = Duration::from_millis(250);

/// Watches this process's scheduling: a wake-up due every 20ms that comes [`MACHINE_STALL`]
/// late or more is a stall of the whole process (a loaded machine), recorded as a window. Runs
/// until aborted.
pub(crate) async fn process_watchdog(clock: Clock, tl: Arc<Timeline>) {
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
pub(crate) async fn redis_watchdog(
    url: String,
    clock: Clock,
    tl: Arc<Timeline>,
    disturbed: Arc<AtomicU64>,
) {
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
        let undisturbed = epoch.is_multiple_of(2) && disturbed.load(Ordering::SeqCst) == epoch;
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
pub(crate) async fn redis_lane(
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
pub(crate) async fn proxy_lane(
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
pub(crate) async fn upstream_lane(
    plan: Vec<Planned>,
    relay: Arc<Relay>,
    clock: Clock,
    tl: Arc<Timeline>,
) {
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
