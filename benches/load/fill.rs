//! `fill-1m`: how the memory store behaves when it holds many finished keys. New-key throughput
//! and latency on a nearly empty store, then the store filled with `--fill-keys` more finished
//! keys (as fast as the connections allow, bounded in time), then the same measurement again;
//! the proxy's resident memory before and after the fill gives the cost of a key.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::client::{self, Key, LoadPlan, Stats};
use crate::cores::{Meter, Part};
use crate::procs::{self, CpuMeter};
use crate::storm::{mock_stats, reset_mock};

/// How often the fill prints a progress line.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

pub(crate) struct FillPlan {
    /// The new-key measurement before and after the fill; the fill itself uses its address,
    /// request and connections.
    pub load: LoadPlan,
    pub proxy_pid: u32,
    /// The processes the `limit` column reads, for both measurements.
    pub parts: Vec<Part>,
    pub mock: SocketAddr,
    /// Keys to add.
    pub keys: u64,
    /// The most time the fill may take.
    pub timeout: Duration,
    /// Key spaces of the fill and of the measurement on the full store (`load` has the first).
    pub fill_keys: Key,
    pub full_keys: Key,
}

pub(crate) struct FillReport {
    pub empty: Stats,
    pub full: Stats,
    /// Finished keys in the store when the RSS was read before the fill (the empty run's).
    pub keys_before: u64,
    /// Keys the fill added (upstream calls it caused, each one saved).
    pub keys_filled: u64,
    pub fill_time: Duration,
    pub fill_errors: u64,
    pub rss_before: Option<u64>,
    pub rss_after: Option<u64>,
}

impl FillReport {
    /// The lines printed under the table.
    pub(crate) fn summary(&self) -> Vec<String> {
        let mib = |b: Option<u64>| {
            b.map_or("?".to_owned(), |b| {
                format!("{:.1} MiB", b as f64 / 1048576.0)
            })
        };
        let per_key = match (self.rss_before, self.rss_after) {
            (Some(before), Some(after)) if self.keys_filled > 0 => format!(
                "{:.0} bytes/key",
                (after as f64 - before as f64) / self.keys_filled as f64
            ),
            _ => "? bytes/key".to_owned(),
        };
        let ratio = |full: f64, empty: f64| {
            if empty > 0.0 {
                format!("{:.2}x", full / empty)
            } else {
                "?".to_owned()
            }
        };
        let p99 = |s: &Stats| s.quantile(0.99).map_or(0.0, |d| d.as_secs_f64());
        let cpu = |s: &Stats| s.cpu_per_request.map_or(0.0, |d| d.as_secs_f64());
        vec![
            format!(
                "fill: {} keys added in {:.1?} ({:.0} keys/s, {} errors); the store held {} before",
                self.keys_filled,
                self.fill_time,
                self.keys_filled as f64 / self.fill_time.as_secs_f64().max(1e-9),
                self.fill_errors,
                self.keys_before
            ),
            format!(
                "fill: proxy RSS {} before, {} after: {per_key}",
                mib(self.rss_before),
                mib(self.rss_after)
            ),
            format!(
                "fill: full/empty throughput {}, p99 {}, proxy CPU per request {}",
                ratio(self.full.rps(), self.empty.rps()),
                ratio(p99(&self.full), p99(&self.empty)),
                ratio(cpu(&self.full), cpu(&self.empty))
            ),
        ]
    }
}

pub(crate) async fn run(plan: FillPlan) -> Result<FillReport, String> {
    reset_mock(plan.mock).await?;
    println!("  fill: new-key on the empty store ...");
    let empty = measured(plan.load.clone(), plan.proxy_pid, &plan.parts).await;
    // Every call the upstream counted is a finished key in the store (the answers are 200s).
    let keys_before = forwarded(plan.mock).await?;
    reset_mock(plan.mock).await?;
    let rss_before = procs::rss_bytes(plan.proxy_pid);

    println!(
        "  fill: adding {} keys over {} connections (at most {:?}) ...",
        plan.keys, plan.load.connections, plan.timeout
    );
    let mut fill = LoadPlan {
        warmup: Duration::ZERO,
        duration: plan.timeout,
        max_requests: plan.keys,
        ..plan.load.clone()
    };
    fill.spec.key = plan.fill_keys;
    let done = Arc::new(AtomicU64::new(0));
    let ticker = tokio::spawn(progress(done.clone(), plan.keys, plan.proxy_pid));
    let started = Instant::now();
    let filled = client::run(Arc::new(fill), done).await;
    let fill_time = started.elapsed();
    ticker.abort();
    if filled.errors + filled.warmup_errors > 0 {
        println!("  fill: errors: {}", filled.error_summary());
    }
    let keys_filled = forwarded(plan.mock).await?;
    reset_mock(plan.mock).await?;
    let rss_after = procs::rss_bytes(plan.proxy_pid);

    println!("  fill: new-key on the full store ...");
    let mut full = plan.load;
    full.spec.key = plan.full_keys;
    let full = measured(full, plan.proxy_pid, &plan.parts).await;
    Ok(FillReport {
        empty,
        full,
        keys_before,
        keys_filled,
        fill_time,
        fill_errors: filled.errors + filled.warmup_errors,
        rss_before,
        rss_after,
    })
}

/// A load run with the proxy's CPU time per request and the cores of `parts`.
async fn measured(load: LoadPlan, proxy_pid: u32, parts: &[Part]) -> Stats {
    let answered = Arc::new(AtomicU64::new(0));
    let cpu = CpuMeter::start(proxy_pid);
    let meter = Meter::start(parts.to_vec());
    let mut stats = client::run(Arc::new(load), answered.clone()).await;
    stats.cores = meter.finish();
    stats.cpu_per_request = cpu.per_request(answered.load(Ordering::Relaxed));
    stats
}

async fn forwarded(mock: SocketAddr) -> Result<u64, String> {
    mock_stats(mock).await?["total"]
        .as_u64()
        .ok_or_else(|| "mock stats: no total".to_owned())
}

async fn progress(done: Arc<AtomicU64>, keys: u64, pid: u32) {
    let started = Instant::now();
    loop {
        tokio::time::sleep(PROGRESS_EVERY).await;
        let n = done.load(Ordering::Relaxed);
        let rss = procs::rss_bytes(pid).map_or(0.0, |b| b as f64 / 1048576.0);
        println!(
            "  fill: {n}/{keys} requests, {:.0} req/s, proxy RSS {rss:.0} MiB",
            n as f64 / started.elapsed().as_secs_f64()
        );
    }
}
