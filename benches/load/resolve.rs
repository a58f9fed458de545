//! `resolve/*`: what resolving an unknown outcome costs (SPEC §4.8, `on_unknown_outcome:
//! resolve`), on a route whose lookup the mock answers: `GET /bookings/by-reference/{reference}`
//! finds the booking a request with that body `reference` made.
//!
//! A bounded number of requests (`--lost`) book on the mock, which then holds its answer
//! (`X-Mock-Hang`, after the booking) past the route upstream's short `timeout`: each costs one
//! upstream timeout, and the proxy answers `504` with the key held. The upstream already knows
//! the booking, so the proxy's first lookup, sent at once, should find it: one lookup per
//! resolution is the target. Meanwhile the client repeats the request every [`POLL`] until the
//! repeat is replayed with `Idempotent-Resolved: true` (a `409` until then; nothing forwarded).
//!
//! Measured: the keys resolved, the time from each `504` to its first resolved replay
//! (quantiles; to within one [`POLL`], the repeats' cadence: polling faster would load the
//! proxy with `409`s while it resolves), and, from the proxy's `/metrics` on its admin listener, the lookups sent
//! (`idemproxy_resolve_lookups_total`) per resolution (`idemproxy_resolutions_total{result=
//! "found"}`). Checked, as conflict-storm checks its invariants: every key resolved to the
//! booking, and exactly one booking per reference on the mock. `connections` clients share
//! the keys; the whole scenario is bounded by [`BOUND`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use http::{Method, StatusCode};
use tokio::task::JoinSet;

use crate::client::{self, Answer};
use crate::procs::RESOLVE_PATH;
use crate::procs::resolve_route::{NAME as ROUTE, UPSTREAM_TIMEOUT};
use crate::storm;

/// How long the mock holds each answer after booking: well past [`UPSTREAM_TIMEOUT`].
const HANG: &str = "2s";
/// Between two repeats of a key being resolved.
const POLL: Duration = Duration::from_millis(5);
/// The most the scenario may take, every key's resolution included.
const BOUND: Duration = Duration::from_secs(30);
/// How long the counters may lag the replays they count.
const COUNTERS_SETTLE: Duration = Duration::from_secs(1);

pub(crate) struct ResolvePlan {
    pub proxy: SocketAddr,
    pub admin: SocketAddr,
    pub mock: SocketAddr,
    /// Requests whose answer is lost.
    pub lost: usize,
    /// Clients sending them, one request in flight each.
    pub connections: usize,
    pub nonce: u64,
}

pub(crate) struct ResolveReport {
    pub lost: usize,
    /// Keys whose repeat was replayed with `Idempotent-Resolved: true`.
    pub resolved: u64,
    /// From each `504` to its key's first resolved replay, in microseconds.
    pub histogram: Histogram<u64>,
    /// `idemproxy_resolve_lookups_total` of the route, every answer.
    pub lookups: u64,
    /// `idemproxy_resolutions_total{result="found"}` of the route.
    pub found: u64,
    /// From the first request sent to the last key resolved.
    pub elapsed: Duration,
    /// Broken invariants; empty when the scenario passed.
    pub failures: Vec<String>,
}

impl ResolveReport {
    pub(crate) fn passed(&self) -> bool {
        self.failures.is_empty()
    }

    /// Lookups sent per resolution found (the target is 1: the upstream already knew).
    pub(crate) fn lookups_per_resolution(&self) -> Option<f64> {
        (self.found > 0).then(|| self.lookups as f64 / self.found as f64)
    }

    /// For the notes column.
    pub(crate) fn summary(&self) -> String {
        let per = self
            .lookups_per_resolution()
            .map_or("-".to_owned(), |p| format!("{p:.2}"));
        format!(
            "{} lost (504 after {UPSTREAM_TIMEOUT}), {} resolved in {:.1?}: {} lookups for {} \
             found = {per}/resolution (target 1), 1 booking per key => {}",
            self.lost,
            self.resolved,
            self.elapsed,
            self.lookups,
            self.found,
            if self.passed() { "PASS" } else { "FAIL" }
        )
    }
}

/// What one key's client saw.
enum Fate {
    /// Resolved this long after its `504`.
    Resolved(Duration),
    Failed(String),
}

pub(crate) async fn run(plan: &ResolvePlan) -> Result<ResolveReport, String> {
    let started = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    let mut clients = JoinSet::new();
    for _ in 0..plan.connections.clamp(1, plan.lost.max(1)) {
        let (next, proxy, lost, nonce) = (next.clone(), plan.proxy, plan.lost, plan.nonce);
        clients.spawn(async move {
            let mut fates = Vec::new();
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= lost {
                    return fates;
                }
                let deadline = started + BOUND;
                fates.push(one_key(proxy, &Operation::new(nonce, n), deadline).await);
            }
        });
    }
    let mut report = ResolveReport {
        lost: plan.lost,
        resolved: 0,
        histogram: client::histogram(),
        lookups: 0,
        found: 0,
        elapsed: Duration::ZERO,
        failures: Vec::new(),
    };
    while let Some(joined) = clients.join_next().await {
        for fate in joined.map_err(|e| format!("a resolve client panicked: {e}"))? {
            match fate {
                Fate::Resolved(took) => {
                    report.resolved += 1;
                    client::record(&mut report.histogram, took);
                }
                Fate::Failed(why) => report.failures.push(why),
            }
        }
    }
    report.elapsed = started.elapsed();
    check_bookings(plan, &mut report).await?;
    read_counters(plan.admin, &mut report).await?;
    Ok(report)
}

/// One request of the scenario: its key, and its body with the reference the lookup asks for.
struct Operation {
    key: String,
    reference: String,
    body: Bytes,
}

impl Operation {
    fn new(nonce: u64, n: usize) -> Operation {
        let reference = format!("ref-{nonce:016x}-{n}");
        Operation {
            key: format!("resolve-{nonce:016x}-{n}"),
            body: Bytes::from(format!(
                r#"{{"from":"DEL","to":"BOM","reference":"{reference}"}}"#
            )),
            reference,
        }
    }

    /// The request; `hang`: the mock holds its answer after booking (the first send only; a
    /// repeat forwarded by mistake would book again at once, which the ledger shows).
    async fn send(&self, proxy: SocketAddr, hang: bool) -> Result<Answer, String> {
        let mut headers = vec![
            ("idempotency-key", self.key.as_str()),
            ("content-type", "application/json"),
        ];
        if hang {
            headers.push(("x-mock-hang", HANG));
        }
        client::request_once(
            proxy,
            Method::POST,
            RESOLVE_PATH,
            &headers,
            self.body.clone(),
        )
        .await
    }
}

/// Sends the request whose answer is lost, then repeats it until it is replayed resolved.
async fn one_key(proxy: SocketAddr, op: &Operation, deadline: Instant) -> Fate {
    let first = match op.send(proxy, true).await {
        Ok(answer) if answer.status == StatusCode::GATEWAY_TIMEOUT => Instant::now(),
        Ok(answer) => {
            return Fate::Failed(format!(
                "{}: answered {} where the upstream's timeout was expected",
                op.key, answer.status
            ));
        }
        Err(e) => return Fate::Failed(format!("{}: {e}", op.key)),
    };
    while Instant::now() < deadline {
        let answer = match op.send(proxy, false).await {
            Ok(answer) => answer,
            Err(e) => return Fate::Failed(format!("{}: a repeat: {e}", op.key)),
        };
        let resolved = answer
            .headers
            .get("idempotent-resolved")
            .is_some_and(|v| v == "true");
        match answer.status {
            StatusCode::CONFLICT => tokio::time::sleep(POLL).await,
            StatusCode::OK if resolved && answer.replayed() => {
                return Fate::Resolved(first.elapsed());
            }
            status => {
                return Fate::Failed(format!(
                    "{}: a repeat answered {status} (replayed {}, resolved {resolved}), not the \
                     resolved booking",
                    op.key,
                    answer.replayed()
                ));
            }
        }
    }
    Fate::Failed(format!("{}: not resolved within {BOUND:?}", op.key))
}

/// Exactly one booking per reference on the mock: the lost request's, none from a repeat.
async fn check_bookings(plan: &ResolvePlan, report: &mut ResolveReport) -> Result<(), String> {
    let stats = storm::mock_stats(plan.mock).await?;
    let by_reference = &stats["by_reference"];
    let mut wrong = 0;
    for n in 0..plan.lost {
        let op = Operation::new(plan.nonce, n);
        let bookings = by_reference[op.reference.as_str()].as_u64().unwrap_or(0);
        if bookings != 1 {
            wrong += 1;
            if wrong <= 10 {
                report.failures.push(format!(
                    "{}: {bookings} bookings on the mock, not 1",
                    op.reference
                ));
            }
        }
    }
    if wrong > 10 {
        report.failures.push(format!(
            "{wrong} references in all without exactly 1 booking"
        ));
    }
    Ok(())
}

/// The route's lookup and resolution counters from the proxy's `/metrics`, read again for a
/// moment while they count fewer resolutions than the keys seen resolved (a counter may be
/// bumped just after the replay it counts became visible).
async fn read_counters(admin: SocketAddr, report: &mut ResolveReport) -> Result<(), String> {
    let until = Instant::now() + COUNTERS_SETTLE;
    loop {
        read_counters_once(admin, report).await?;
        if report.found >= report.resolved || Instant::now() >= until {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn read_counters_once(admin: SocketAddr, report: &mut ResolveReport) -> Result<(), String> {
    let answer = client::request_once(admin, Method::GET, "/metrics", &[], Bytes::new()).await?;
    if answer.status != StatusCode::OK {
        return Err(format!("GET /metrics on {admin}: {}", answer.status));
    }
    let text = String::from_utf8_lossy(&answer.body);
    report.lookups = counter(&text, "idemproxy_resolve_lookups_total{", &[]);
    report.found = counter(&text, "idemproxy_resolutions_total{", &["result=\"found\""]);
    Ok(())
}

/// The sum of the samples of `series` (its name and `{`) on the route [`ROUTE`] that carry
/// every label of `labels`.
fn counter(text: &str, series: &str, labels: &[&str]) -> u64 {
    let route = format!("route=\"{ROUTE}\"");
    text.lines()
        .filter(|line| line.starts_with(series) && line.contains(&route))
        .filter(|line| labels.iter().all(|l| line.contains(l)))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}
