//! `churn/{sqlite,postgres}`: does the table stay bounded under an hour-equivalent of churn?
//! New keys at full speed for minutes on a route with `ttl: 1s` and `store.sweep_interval: 1s`,
//! so a key lives about a second and the sweep must delete as fast as requests insert. Every
//! few seconds the table's row count (expired rows not yet swept included: they are what would
//! grow) and its size on disk are sampled from outside the proxy. Bounded means the largest
//! count stays near what a second or two of requests write: at most
//! rate × (ttl + sweep_interval + [`SLACK`]), with rate the run's own req/s.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::client::{self, LoadPlan, Stats};
use crate::cores::{Meter, Part};
use crate::procs::CpuMeter;

/// The route's `ttl` and the store's `sweep_interval` in churn runs.
pub(crate) const TTL: &str = "1s";
pub(crate) const SWEEP_INTERVAL: &str = "1s";
const TTL_SECS: f64 = 1.0;
const SWEEP_SECS: f64 = 1.0;
/// Room for a sweep pass that takes a while, and for samples taken mid-pass.
const SLACK: f64 = 1.0;

/// One look at the table: rows, bytes on disk.
pub(crate) type Sample = (u64, u64);

/// Counts the table's rows and bytes (a blocking call: it runs on a blocking thread).
pub(crate) type Sampler = Arc<dyn Fn() -> Result<Sample, String> + Send + Sync>;

pub(crate) struct ChurnPlan {
    pub load: LoadPlan,
    pub proxy_pid: u32,
    /// The processes the `limit` column reads.
    pub parts: Vec<Part>,
    pub every: Duration,
    pub sample: Sampler,
}

pub(crate) struct ChurnReport {
    pub stats: Stats,
    /// Seconds since the start, rows, bytes.
    pub samples: Vec<(f64, u64, u64)>,
    /// Requests answered (each wrote one key).
    pub written: u64,
}

impl ChurnReport {
    fn max_rows(&self) -> u64 {
        self.samples.iter().map(|s| s.1).max().unwrap_or(0)
    }

    /// rate × (ttl + sweep_interval + slack).
    fn bound(&self) -> u64 {
        (self.stats.rps() * (TTL_SECS + SWEEP_SECS + SLACK)).ceil() as u64
    }

    pub(crate) fn bounded(&self) -> bool {
        !self.samples.is_empty() && self.max_rows() <= self.bound()
    }

    /// The row's note.
    pub(crate) fn note(&self) -> String {
        let last = self.samples.last().copied().unwrap_or_default();
        format!(
            "rows max {} final {} of {} written (bound {}: {}); {:.1} MiB at the end",
            self.max_rows(),
            last.1,
            self.written,
            self.bound(),
            if self.bounded() {
                "bounded"
            } else {
                "NOT bounded"
            },
            last.2 as f64 / 1048576.0
        )
    }

    /// The lines under the table: the samples, compressed to one line.
    pub(crate) fn summary(&self, name: &str) -> Vec<String> {
        let max_bytes = self.samples.iter().map(|s| s.2).max().unwrap_or(0);
        let series: Vec<String> = self
            .samples
            .iter()
            .map(|(t, rows, bytes)| format!("{t:.0}s:{rows}/{:.1}M", *bytes as f64 / 1048576.0))
            .collect();
        vec![
            format!(
                "{name}: {}; largest size {:.1} MiB",
                self.note(),
                max_bytes as f64 / 1048576.0
            ),
            format!("{name}: samples (time:rows/MiB): {}", series.join(" ")),
        ]
    }
}

pub(crate) async fn run(plan: ChurnPlan) -> Result<ChurnReport, String> {
    let answered = Arc::new(AtomicU64::new(0));
    let cpu = CpuMeter::start(plan.proxy_pid);
    let meter = Meter::start(plan.parts);
    let started = Instant::now();
    let load = tokio::spawn(client::run(Arc::new(plan.load), answered.clone()));
    let mut samples = Vec::new();
    let mut next = started + plan.every;
    while !load.is_finished() {
        let now = Instant::now();
        if now < next {
            // Short sleeps: the loop notices the end of the load soon after it comes.
            tokio::time::sleep((next - now).min(Duration::from_millis(200))).await;
            continue;
        }
        next += plan.every;
        let sample = plan.sample.clone();
        let (rows, bytes) = tokio::task::spawn_blocking(move || sample())
            .await
            .map_err(|e| format!("churn sample: {e}"))??;
        let at = started.elapsed().as_secs_f64();
        println!(
            "  churn: {at:.0}s, {} requests, {rows} rows, {:.1} MiB",
            answered.load(Ordering::Relaxed),
            bytes as f64 / 1048576.0
        );
        samples.push((at, rows, bytes));
    }
    let mut stats = load.await.map_err(|e| format!("churn load: {e}"))?;
    stats.cores = meter.finish();
    let written = answered.load(Ordering::Relaxed);
    stats.cpu_per_request = cpu.per_request(written);
    // One more look once the load has stopped.
    let sample = plan.sample.clone();
    let (rows, bytes) = tokio::task::spawn_blocking(move || sample())
        .await
        .map_err(|e| format!("churn sample: {e}"))??;
    samples.push((started.elapsed().as_secs_f64(), rows, bytes));
    Ok(ChurnReport {
        stats,
        samples,
        written,
    })
}
