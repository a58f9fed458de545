//! What held a timed row back: the cores each process taking part used over the row's load
//! run, and a verdict drawn from them (the table's `limit` column).
//!
//! The processes, each named in the column as here:
//! - the server under test: `proxy`, `nginx` (the reference proxy, master and workers), or the
//!   upstream itself for `direct`;
//! - the upstream: `mock` (`mock-upstream`), or `nginx-upstream` with `--upstream nginx`;
//! - `client`: the load generator, that is this process's own threads (`/proc/self/stat`; the
//!   children it starts are not in it);
//! - the database: `redis-server`, or `postgres` with its backends and helpers;
//! - on the pgbench row, `pgbench` and `postgres` only (`pgbench` is this process's child, read
//!   from the `cutime` it leaves behind when it exits).
//! - on the SQLite ceiling's row, `sqlite-writer` only: this process, whose writer thread does
//!   the work (its checkpoint thread sleeps between checkpoints), single-threaded.
//!
//! A process's cores are its CPU time (user + system, every thread, its children included) over
//! the window, divided by the window's wall time. The window is the one of the `cpu/req`
//! column: the whole load run, warm-up included. `other` is the rest of the machine's busy
//! time over the same window (`/proc/stat`: other programs on this shared machine, interrupts),
//! shown when `/proc/stat` counts as many cores as this process may use.
//!
//! # The rule
//! 1. Everything together, `other` included, used at least [`BUSY`] (90%) of the cores:
//!    `cores (...)`, every user listed, biggest first: more load would not bring more answers.
//!    `cores, mostly other programs'` when `other` is half of it or more: this run measured a
//!    busy machine.
//! 2. Else a single-threaded process used at least [`BUSY`] of a core: `NAME saturates a core`.
//!    `redis-server` is one (one thread runs every command), and so is pgbench on a one-core
//!    machine (`-j 1`); the mock and the load generator run a thread per core (Tokio's
//!    multi-threaded runtime), the proxy a worker per core (`workers`, a current-thread runtime
//!    each), nginx a worker per core and PostgreSQL a backend per connection.
//! 3. Else `no core saturated, latency-bound`: the row waits (the store's round trips, its
//!    fsyncs, the closed loop's fixed connections), it does not run out of CPU.

use std::time::{Duration, Instant};

use crate::procs::{cpu_time, own_cpu_time, ticks_to_duration};

/// The share of the cores (rule 1) or of one core (rule 2) that counts as all of it.
pub(crate) const BUSY: f64 = 0.9;

/// The rest of the machine's busy time, as a participant.
const OTHER: &str = "other";

/// Where a participant's CPU time is read.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Source {
    /// A child process of the run, with its own children: [`cpu_time`].
    Process(u32),
    /// This process's own threads.
    Client,
    /// This process's children that exited (were reaped) inside the window.
    Reaped,
}

/// A process taking part in a row.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Part {
    pub name: &'static str,
    pub source: Source,
    /// One thread does all of its work: it limits the row once it uses a whole core, whatever
    /// the other cores do.
    pub single_threaded: bool,
}

impl Part {
    pub(crate) fn process(name: &'static str, pid: u32) -> Part {
        Part {
            name,
            source: Source::Process(pid),
            single_threaded: false,
        }
    }

    pub(crate) fn client() -> Part {
        Part {
            name: "client",
            source: Source::Client,
            single_threaded: false,
        }
    }

    /// The process, when it is one of the run's children.
    pub(crate) fn pid(&self) -> Option<u32> {
        match self.source {
            Source::Process(pid) => Some(pid),
            Source::Client | Source::Reaped => None,
        }
    }

    fn read(&self) -> Option<Duration> {
        match self.source {
            Source::Process(pid) => cpu_time(pid),
            Source::Client => own_cpu_time().map(|(own, _)| own),
            Source::Reaped => own_cpu_time().map(|(_, reaped)| reaped),
        }
    }
}

/// The CPU times of a row's processes and of the whole machine at the start of its window.
pub(crate) struct Meter {
    parts: Vec<(Part, Option<Duration>)>,
    machine: Option<Machine>,
    started: Instant,
    /// When the window ended and the machine's busy time then, if marked before [`finish`].
    ///
    /// [`finish`]: Meter::finish
    ended: Option<(Instant, Option<Machine>)>,
}

impl Meter {
    pub(crate) fn start(parts: Vec<Part>) -> Meter {
        let machine = Machine::read();
        let parts = parts.into_iter().map(|p| (p, p.read())).collect();
        Meter {
            parts,
            machine,
            started: Instant::now(),
            ended: None,
        }
    }

    /// Ends the window now, for processes whose CPU time can only be read a little later
    /// (pgbench's backends, until the postmaster has reaped them).
    pub(crate) fn end(&mut self) {
        self.ended = Some((Instant::now(), Machine::read()));
    }

    /// The cores used over the window (until now, unless [`end`] marked it). `None` for an
    /// empty window.
    ///
    /// [`end`]: Meter::end
    pub(crate) fn finish(self) -> Option<Cores> {
        let (ended, machine) = self
            .ended
            .unwrap_or_else(|| (Instant::now(), Machine::read()));
        let wall = ended.saturating_duration_since(self.started).as_secs_f64();
        if wall <= 0.0 {
            return None;
        }
        let mut used: Vec<Used> = self
            .parts
            .iter()
            .filter_map(|(part, before)| {
                let spent = part.read()?.checked_sub((*before)?)?;
                Some(Used {
                    name: part.name,
                    cores: spent.as_secs_f64() / wall,
                    single_threaded: part.single_threaded,
                })
            })
            .collect();
        let ours: f64 = used.iter().map(|u| u.cores).sum();
        let available = std::thread::available_parallelism().map_or(1, |n| n.get());
        if let (Some(before), Some(after)) = (self.machine, machine)
            && after.cores == available
        {
            let busy = after.busy.saturating_sub(before.busy).as_secs_f64() / wall;
            used.push(Used {
                name: OTHER,
                cores: (busy - ours).max(0.0),
                single_threaded: false,
            });
        }
        used.sort_by(|a, b| b.cores.total_cmp(&a.cores));
        Some(Cores { used, available })
    }
}

/// The machine's busy time, every core, from the first line of `/proc/stat`.
#[derive(Clone, Copy)]
struct Machine {
    busy: Duration,
    /// The `cpuN` lines.
    cores: usize,
}

impl Machine {
    fn read() -> Option<Machine> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let mut lines = stat.lines();
        // `cpu user nice system idle iowait irq softirq steal guest guest_nice`; guest time is
        // already in user. Busy: all but idle and iowait.
        let total: Vec<u64> = lines
            .next()?
            .strip_prefix("cpu ")?
            .split_whitespace()
            .map(|f| f.parse().ok())
            .collect::<Option<_>>()?;
        let busy = [0, 1, 2, 5, 6, 7]
            .iter()
            .map(|&i| total.get(i).copied().unwrap_or(0))
            .sum();
        let cores = lines
            .filter(|l| l.starts_with("cpu") && l.as_bytes().get(3).is_some_and(u8::is_ascii_digit))
            .count();
        Some(Machine {
            busy: ticks_to_duration(busy),
            cores,
        })
    }
}

/// One process's share of a window.
#[derive(Clone, Debug)]
pub(crate) struct Used {
    pub name: &'static str,
    pub cores: f64,
    pub single_threaded: bool,
}

/// The cores a row's processes used, biggest first, and the cores there are.
#[derive(Clone, Debug)]
pub(crate) struct Cores {
    pub used: Vec<Used>,
    pub available: usize,
}

impl Cores {
    /// The `limit` cell: the verdict of the rule (see the module docs), then the total and
    /// each process's cores.
    pub(crate) fn limit(&self) -> String {
        let total: f64 = self.used.iter().map(|u| u.cores).sum();
        let other = self
            .used
            .iter()
            .find(|u| u.name == OTHER)
            .map_or(0.0, |u| u.cores);
        let verdict = if total >= BUSY * self.available as f64 && other * 2.0 >= total {
            "cores, mostly other programs'".to_owned()
        } else if total >= BUSY * self.available as f64 {
            "cores".to_owned()
        } else if let Some(single) = self
            .used
            .iter()
            .find(|u| u.single_threaded && u.cores >= BUSY)
        {
            format!("{} saturates a core", single.name)
        } else {
            "no core saturated, latency-bound".to_owned()
        };
        let each: Vec<String> = self
            .used
            .iter()
            .map(|u| format!("{} {:.2}", u.name, u.cores))
            .collect();
        format!(
            "{verdict} ({total:.2} of {}: {})",
            self.available,
            each.join(", ")
        )
    }
}
