//! The conflict storm: many duplicates of keys whose first request is still in flight, all at
//! once. It measures how the proxy answers a retry burst, and checks the invariants: the
//! upstream ran each operation once, no 5xx, and every duplicate got a 409 or a replay.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use http::header::{CONTENT_TYPE, HOST};
use http::{HeaderValue, Method, Request, StatusCode};
use http_body_util::Full;
use serde_json::Value;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::client::{self, Answer, IDEMPOTENCY_KEY};
use crate::procs::IDEMPOTENT_PATH;

/// Connections opened at the same time while preparing the burst.
const CONNECT_CONCURRENCY: usize = 128;

pub(crate) struct StormPlan {
    pub proxy: SocketAddr,
    pub mock: SocketAddr,
    pub keys: usize,
    pub duplicates: usize,
    /// `X-Mock-Delay` of every request: how long each first request stays in flight.
    pub delay: Duration,
    pub body: Bytes,
    pub nonce: u64,
}

pub(crate) struct StormReport {
    pub keys: usize,
    pub sent: usize,
    pub conflicts: u64,
    pub replays: u64,
    pub server_errors: u64,
    /// Duplicates answered otherwise (another status, no answer).
    pub other: BTreeMap<String, u64>,
    /// Counted upstream calls beyond one per key.
    pub duplicate_forwards: u64,
    /// Latencies of the duplicates' answers.
    pub histogram: Histogram<u64>,
    /// From the first duplicate sent to the last answered.
    pub burst: Duration,
    /// Broken invariants; empty when the storm passed.
    pub failures: Vec<String>,
    /// Things worth knowing that are not failures.
    pub warnings: Vec<String>,
}

impl StormReport {
    pub(crate) fn passed(&self) -> bool {
        self.failures.is_empty()
    }

    /// For the notes column.
    pub(crate) fn summary(&self) -> String {
        format!(
            "{} dups of {} keys in {:.0?}: 409 x{}, replay x{}, other x{}, dup fwd {} => {}",
            self.sent,
            self.keys,
            self.burst,
            self.conflicts,
            self.replays,
            self.other.values().sum::<u64>(),
            self.duplicate_forwards,
            if self.passed() { "PASS" } else { "FAIL" }
        )
    }
}

pub(crate) async fn run(plan: &StormPlan) -> Result<StormReport, String> {
    reset_mock(plan.mock).await?;
    let total = plan.keys * plan.duplicates;
    let keys: Vec<String> = (0..plan.keys)
        .map(|i| format!("storm-{:016x}-{i}", plan.nonce))
        .collect();
    let delay = humantime::format_duration(plan.delay).to_string();
    let mut failures = Vec::new();
    let mut warnings = Vec::new();

    // Every duplicate's connection is open before the first request goes out, so the burst is
    // not spread out by connects.
    let gate = Arc::new(Semaphore::new(CONNECT_CONCURRENCY));
    let mut opening = JoinSet::new();
    for _ in 0..total {
        let (gate, addr) = (gate.clone(), plan.proxy);
        opening.spawn(async move {
            let _permit = gate.acquire_owned().await;
            client::connect(addr).await
        });
    }
    let mut senders = Vec::with_capacity(total);
    while let Some(joined) = opening.join_next().await {
        match joined {
            Ok(Ok(sender)) => senders.push(sender),
            Ok(Err(e)) => failures.push(format!("a duplicate's connection failed: {e}")),
            Err(e) => failures.push(format!("a connect task failed: {e}")),
        }
    }

    let mut firsts = JoinSet::new();
    for key in &keys {
        // The first request is exactly what its duplicates will be.
        let (proxy, request, key) = (plan.proxy, duplicate(plan, key, &delay)?, key.clone());
        firsts.spawn(async move { (key, client::send_once(proxy, request).await) });
    }
    // The mock counts a request as soon as it arrives: then its key is claimed and in flight.
    let forwarded = wait_for_calls(plan.mock, plan.keys as u64, plan.delay).await?;
    if forwarded < plan.keys as u64 {
        warnings.push(format!(
            "only {forwarded} of {} first requests reached the mock within {delay}: \
             later duplicates may meet finished keys",
            plan.keys
        ));
    }

    let burst_start = Instant::now();
    let mut duplicates = JoinSet::new();
    for (i, mut sender) in senders.into_iter().enumerate() {
        let key = keys[i % keys.len()].clone();
        let request = duplicate(plan, &key, &delay)?;
        duplicates.spawn(async move {
            let began = Instant::now();
            let answer = client::exchange(&mut sender, request).await;
            (key, answer, began.elapsed())
        });
    }
    let mut answers = Vec::with_capacity(total);
    while let Some(joined) = duplicates.join_next().await {
        answers.push(joined.map_err(|e| format!("a duplicate's task failed: {e}"))?);
    }
    let burst = burst_start.elapsed();

    let mut first_bodies: HashMap<String, Bytes> = HashMap::new();
    while let Some(joined) = firsts.join_next().await {
        let (key, answer) = joined.map_err(|e| format!("a first request's task failed: {e}"))?;
        match answer {
            Ok(a) if a.status == StatusCode::OK && !a.replayed() => {
                first_bodies.insert(key, a.body);
            }
            Ok(a) => failures.push(format!(
                "the first request of {key} got {} (replayed: {}), not the upstream's 200",
                a.status,
                a.replayed()
            )),
            Err(e) => failures.push(format!("the first request of {key}: {e}")),
        }
    }

    let mut report = StormReport {
        keys: plan.keys,
        sent: answers.len(),
        conflicts: 0,
        replays: 0,
        server_errors: 0,
        other: BTreeMap::new(),
        duplicate_forwards: 0,
        histogram: client::histogram(),
        burst,
        failures,
        warnings,
    };
    for (key, answer, elapsed) in answers {
        classify(&mut report, &first_bodies, &key, answer, elapsed);
    }
    count_forwards(&mut report, plan.mock, &keys).await?;
    Ok(report)
}

/// A duplicate: the same method, path, body (so the same fingerprint) and headers as the first.
fn duplicate(plan: &StormPlan, key: &str, delay: &str) -> Result<Request<Full<Bytes>>, String> {
    Request::post(IDEMPOTENT_PATH)
        .header(HOST, plan.proxy.to_string())
        .header(CONTENT_TYPE, "application/json")
        .header(IDEMPOTENCY_KEY, key)
        .header(
            "x-mock-delay",
            HeaderValue::from_str(delay).map_err(|e| e.to_string())?,
        )
        .body(Full::new(plan.body.clone()))
        .map_err(|e| format!("building a duplicate: {e}"))
}

fn classify(
    report: &mut StormReport,
    first_bodies: &HashMap<String, Bytes>,
    key: &str,
    answer: Result<Answer, String>,
    elapsed: Duration,
) {
    let answer = match answer {
        Ok(answer) => answer,
        Err(e) => {
            *report.other.entry(format!("no answer: {e}")).or_insert(0) += 1;
            report
                .failures
                .push(format!("a duplicate of {key} got no answer: {e}"));
            return;
        }
    };
    client::record(&mut report.histogram, elapsed);
    let status = answer.status;
    if status == StatusCode::CONFLICT {
        report.conflicts += 1;
    } else if status == StatusCode::OK && answer.replayed() {
        report.replays += 1;
        if first_bodies
            .get(key)
            .is_some_and(|first| *first != answer.body)
        {
            report
                .failures
                .push(format!("a replay of {key} differs from the first response"));
        }
    } else {
        *report.other.entry(format!("status {status}")).or_insert(0) += 1;
        if status.is_server_error() {
            report.server_errors += 1;
        }
        report.failures.push(format!(
            "a duplicate of {key} got {status} (replayed: {}): neither a 409 nor a replay",
            answer.replayed()
        ));
    }
}

/// Reads the mock's counters: every key must have reached it exactly once, nothing else at all.
async fn count_forwards(
    report: &mut StormReport,
    mock: SocketAddr,
    keys: &[String],
) -> Result<(), String> {
    let stats = mock_stats(mock).await?;
    let total = stats["total"].as_u64().ok_or("mock stats: no total")?;
    let mut counted = 0;
    for key in keys {
        let calls = stats["by_key"][key.as_str()].as_u64().unwrap_or(0);
        counted += calls;
        if calls == 0 {
            report
                .failures
                .push(format!("{key} never reached the upstream"));
        }
    }
    report.duplicate_forwards = total.saturating_sub(keys.len() as u64);
    if report.duplicate_forwards > 0 {
        report.failures.push(format!(
            "{} duplicate forwards: the upstream counted {total} calls ({counted} with the storm's \
             keys) for {} keys",
            report.duplicate_forwards,
            keys.len()
        ));
    }
    Ok(())
}

/// Polls the mock until it has counted `want` requests or `within` has passed; returns the count.
async fn wait_for_calls(mock: SocketAddr, want: u64, within: Duration) -> Result<u64, String> {
    let deadline = Instant::now() + within;
    loop {
        let total = mock_stats(mock).await?["total"].as_u64().unwrap_or(0);
        if total >= want || Instant::now() >= deadline {
            return Ok(total);
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

pub(crate) async fn reset_mock(mock: SocketAddr) -> Result<(), String> {
    let answer =
        client::request_once(mock, Method::POST, "/_mock/reset", &[], Bytes::new()).await?;
    if answer.status != StatusCode::OK {
        return Err(format!("POST /_mock/reset: {}", answer.status));
    }
    Ok(())
}

/// `GET /_mock/stats`: `{"total":N,"bookings":N,"by_key":{...}}`.
pub(crate) async fn mock_stats(mock: SocketAddr) -> Result<Value, String> {
    let answer = client::request_once(mock, Method::GET, "/_mock/stats", &[], Bytes::new()).await?;
    if answer.status != StatusCode::OK {
        return Err(format!("GET /_mock/stats: {}", answer.status));
    }
    serde_json::from_slice(&answer.body).map_err(|e| format!("GET /_mock/stats: {e}"))
}
