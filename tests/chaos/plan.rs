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
// Faults: the plan and the timeline
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lane {
    /// The store: named after it on the timeline ([`StoreKind::name`]).
    Store,
    Proxy,
    Upstream,
}

impl std::fmt::Display for Lane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(match self {
            Lane::Store => "store",
            Lane::Proxy => "proxy-b",
            Lane::Upstream => "upstream",
        })
    }
}

#[derive(Debug, Clone)]
pub(crate) enum Fault {
    /// SIGSTOP of the store's server (PostgreSQL: every process of it), SIGCONT after this.
    StorePause(Duration),
    /// Redis: SIGKILL; PostgreSQL: a crash (`pg_ctl stop -m immediate`). Started again after
    /// `down`.
    StoreKill {
        down: Duration,
    },
    StoreBlackhole(Duration),
    StoreReset,
    StoreLatency {
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
            Fault::StorePause(_)
            | Fault::StoreKill { .. }
            | Fault::StoreBlackhole(_)
            | Fault::StoreReset
            | Fault::StoreLatency { .. } => Lane::Store,
            Fault::ProxyKill { .. } => Lane::Proxy,
            _ => Lane::Upstream,
        }
    }

    /// How long it lasts (as planned).
    pub(crate) fn lasting(&self) -> Duration {
        match self {
            Fault::StorePause(d)
            | Fault::StoreBlackhole(d)
            | Fault::UpstreamBlackhole(d)
            | Fault::UpstreamRefuse(d) => *d,
            Fault::StoreKill { down } | Fault::ProxyKill { down } => *down,
            Fault::StoreLatency { lasting, .. }
            | Fault::UpstreamLatency { lasting, .. }
            | Fault::UpstreamCut { lasting, .. } => *lasting,
            Fault::StoreReset | Fault::UpstreamReset => Duration::ZERO,
        }
    }

    /// What it does, in words; a store fault names the run's `store`.
    pub(crate) fn describe(&self, store: StoreKind) -> String {
        let name = store.name();
        match self {
            Fault::StorePause(d) => format!("pause {name} (SIGSTOP) for {d:?}"),
            Fault::StoreKill { down } if store == StoreKind::Postgres => {
                format!("crash postgres (pg_ctl stop -m immediate), restart after {down:?}")
            }
            Fault::StoreKill { down } => format!("kill {name} (SIGKILL), restart after {down:?}"),
            Fault::StoreBlackhole(d) => format!("blackhole the {name} relay for {d:?}"),
            Fault::StoreReset => format!("reset every {name} connection"),
            Fault::StoreLatency { each_way, lasting } => {
                format!("{name} relay latency {each_way:?} each way for {lasting:?}")
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
    /// [`Fault::describe`], for the run's store.
    pub(crate) what: String,
}

/// The faults of a run, from its seed. Within a lane faults never overlap; store faults are at
/// least `lock_ttl` apart, so that short stalls stay short.
pub(crate) fn plan_faults(spec: &RunSpec, rng: &mut Rng) -> Vec<Planned> {
    let end = spec.chaos;
    let margin = Duration::from_millis(500);
    let mut out = Vec::new();

    let mut t = rng.ms(1000, 2000);
    loop {
        let short = rng.ms(120, 400);
        // At least lock_ttl: every lease lapses meanwhile (the store's clock runs on).
        let long = spec.lock_ttl + rng.ms(300, 1300);
        let roll = rng.between(0, 99);
        let fault = match spec.store {
            // Restarts keep the data; every stall stays well under lock_ttl / 3.
            StoreKind::PersistentRedis => match roll {
                0..=29 => Fault::StorePause(short),
                30..=49 => Fault::StoreKill {
                    down: Duration::ZERO,
                },
                50..=64 => Fault::StoreBlackhole(short),
                65..=84 => Fault::StoreReset,
                _ => Fault::StoreLatency {
                    each_way: rng.ms(50, 200),
                    lasting: rng.ms(500, 1500),
                },
            },
            StoreKind::Redis => match roll {
                0..=17 => Fault::StorePause(short),
                18..=29 => Fault::StorePause(long),
                30..=45 => Fault::StoreKill {
                    down: rng.ms(100, 1500),
                },
                46..=57 => Fault::StoreBlackhole(short),
                58..=67 => Fault::StoreBlackhole(long),
                68..=84 => Fault::StoreReset,
                _ => Fault::StoreLatency {
                    each_way: rng.ms(50, 200),
                    lasting: rng.ms(500, 2000),
                },
            },
            // A crash keeps every record; its down time stays short, so that the whole outage
            // (stop, down time, restart with WAL replay) stays under `crash_outage_bound` and
            // the crash explains nothing (see `store.rs`). Latency stays low enough that a
            // fresh connection (start-up, prepare, execute: three round trips) still fits in
            // store.timeout, so renewals land through it.
            StoreKind::Postgres => match roll {
                0..=13 => Fault::StorePause(short),
                14..=25 => Fault::StorePause(long),
                26..=55 => Fault::StoreKill {
                    down: rng.ms(0, 150),
                },
                56..=65 => Fault::StoreBlackhole(short),
                66..=74 => Fault::StoreBlackhole(long),
                75..=87 => Fault::StoreReset,
                _ => Fault::StoreLatency {
                    each_way: rng.ms(10, 30),
                    lasting: rng.ms(500, 2000),
                },
            },
        };
        if t + fault.lasting() + margin > end {
            break;
        }
        let next = t + fault.lasting() + spec.lock_ttl + rng.ms(300, 2000);
        out.push(Planned {
            at: t,
            fault,
            what: String::new(),
        });
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
                what: String::new(),
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
        out.push(Planned {
            at: t,
            fault,
            what: String::new(),
        });
        t = next;
    }
    out.sort_by_key(|p| p.at);
    for p in &mut out {
        p.what = p.fault.describe(spec.store);
    }
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
    /// PostgreSQL crashed and started again: every committed claim and record is kept. The
    /// database was unreachable meanwhile, so the span merges with its neighbours like
    /// [`Loss::Unavailable`], but never makes a merged span claim-losing by itself: a crash
    /// whose outage stays under `crash_outage_bound` cannot lose a lease (see `store.rs`).
    Crash,
    /// Proxy B died: the claims it held are no longer renewed and expire.
    ClaimsOfB,
    /// The store could not be reached (paused, blackholed, down, connections reset): leases
    /// are not renewed meanwhile. Merged with its neighbours; claim-losing from `lock_ttl / 3`.
    Unavailable,
    /// The machine stalled, not the plan: this process was not scheduled (CPU starvation; the
    /// relays run here, so the store and the upstream stalled for both proxies), or the store
    /// itself stopped answering outside any injected fault (an `fsync` under `appendfsync
    /// always` on a busy disk, a starved PostgreSQL backend, a restart that overran its bound).
    /// Measured by the watchdogs. Counts like [`Loss::Unavailable`]; the only thing that can
    /// excuse a re-execution in the persistent run.
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
