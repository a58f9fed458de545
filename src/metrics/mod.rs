//! Counters and histograms, in Prometheus form: the admin listener serves [`Metrics::encode`]
//! at `/metrics`, and tests read them there, as a scraper does.
//!
//! Every series a request touches is registered once, at start: [`Metrics::route`] hands out a
//! route's counters and histograms, [`Metrics::upstream`] an upstream's histogram, and the store
//! operations have theirs in an array. The hot path then only increments: no label strings,
//! no lookup in a family's map. An observed route (`mode: observe`) also gets its series of
//! what enforce would have answered ([`Would`], from [`Metrics::observed`]), and a route under
//! `on_unknown_outcome: resolve` its resolutions and lookups ([`Metrics::resolved`]).
//!
//! One registry serves every worker (`workers:`): counters and histograms sum across them by
//! themselves, and so do gauges that only go up and down. A gauge a worker *sets* from its own
//! resources (the PostgreSQL pool's) is set through a [`GaugePart`], so that the series is the
//! sum over workers rather than the value of whichever wrote last.

mod observed;
mod resolved;
mod summed;

pub use observed::{ObservedMetrics, Unclaimed, Would};
pub use resolved::{LookupAnswer, Resolution, ResolvedMetrics};
pub use summed::GaugePart;

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Metric, Registry};

/// What happened to one request, as counted and logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum Outcome {
    /// The first request with its key went upstream.
    Forwarded,
    /// A repeat got the saved response.
    Replayed,
    /// A repeat while the first was in flight (409).
    Conflict,
    /// The key was reused with another fingerprint (422).
    Mismatch,
    /// The key header was missing on a required route (400).
    MissingKey,
    /// The key header was invalid (400).
    InvalidKey,
    /// The request body was too large (413).
    TooLarge,
    /// The store failed (503, or forwarded unprotected).
    StoreError,
    /// The upstream failed: connect error, timeout or reset.
    UpstreamError,
    /// A plain pass-through (no idempotency on the route, or no key on a non-required route).
    Passthrough,
    /// A repeat of an operation whose response was too large to save.
    NotReplayable,
    /// No route matched (404).
    NoRoute,
    /// The request could not be read or used: its body (400, 408), or a `Connection` header
    /// naming a header idempotency relies on (400).
    BadRequest,
    /// Too many exchanges are running after their clients left (503); nothing claimed.
    Overloaded,
    /// The proxy failed inside (500).
    Internal,
}

impl Outcome {
    /// Every outcome, in declaration order (`ALL[o as usize] == o`).
    pub const ALL: [Outcome; 15] = [
        Outcome::Forwarded,
        Outcome::Replayed,
        Outcome::Conflict,
        Outcome::Mismatch,
        Outcome::MissingKey,
        Outcome::InvalidKey,
        Outcome::TooLarge,
        Outcome::StoreError,
        Outcome::UpstreamError,
        Outcome::Passthrough,
        Outcome::NotReplayable,
        Outcome::NoRoute,
        Outcome::BadRequest,
        Outcome::Overloaded,
        Outcome::Internal,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Forwarded => "forwarded",
            Outcome::Replayed => "replayed",
            Outcome::Conflict => "conflict",
            Outcome::Mismatch => "mismatch",
            Outcome::MissingKey => "missing_key",
            Outcome::InvalidKey => "invalid_key",
            Outcome::TooLarge => "too_large",
            Outcome::StoreError => "store_error",
            Outcome::UpstreamError => "upstream_error",
            Outcome::Passthrough => "passthrough",
            Outcome::NotReplayable => "not_replayable",
            Outcome::NoRoute => "no_route",
            Outcome::BadRequest => "bad_request",
            Outcome::Overloaded => "overloaded",
            Outcome::Internal => "internal",
        }
    }
}

/// A store operation, as timed and counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum StoreOp {
    /// `claim`.
    Claim,
    /// `renew`.
    Renew,
    /// `complete`.
    Complete,
    /// `release`.
    Release,
    /// `get`.
    Get,
    /// `ping`.
    Ping,
    /// `forget` (key tooling).
    Forget,
}

impl StoreOp {
    /// Every operation, in declaration order.
    pub const ALL: [StoreOp; 7] = [
        StoreOp::Claim,
        StoreOp::Renew,
        StoreOp::Complete,
        StoreOp::Release,
        StoreOp::Get,
        StoreOp::Ping,
        StoreOp::Forget,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            StoreOp::Claim => "claim",
            StoreOp::Renew => "renew",
            StoreOp::Complete => "complete",
            StoreOp::Release => "release",
            StoreOp::Get => "get",
            StoreOp::Ping => "ping",
            StoreOp::Forget => "forget",
        }
    }
}

/// What became of one configuration reload, as counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReloadResult {
    /// The new configuration is in force.
    Applied,
    /// The file is not valid: nothing applied.
    Invalid,
    /// A field that cannot change in place changed: nothing applied.
    NeedsRestart,
}

impl ReloadResult {
    /// Every result: each series is exposed from the start, at 0.
    pub const ALL: [ReloadResult; 3] = [
        ReloadResult::Applied,
        ReloadResult::Invalid,
        ReloadResult::NeedsRestart,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            ReloadResult::Applied => "applied",
            ReloadResult::Invalid => "invalid",
            ReloadResult::NeedsRestart => "needs_restart",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteOutcome {
    route: String,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UpstreamLabel {
    upstream: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabel {
    op: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerLabel {
    worker: u64,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteField {
    route: String,
    field: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabel {
    route: String,
}

#[derive(Clone)]
struct Buckets(fn() -> Histogram);

impl MetricConstructor<Histogram> for Buckets {
    fn new_metric(&self) -> Histogram {
        (self.0)()
    }
}

fn latency() -> Histogram {
    // 0.5ms .. ~33s
    Histogram::new(exponential_buckets(0.0005, 2.0, 17))
}

/// Log lines the process could not write (`idemproxy_log_lines_dropped_total`). One for the
/// process, as its log is one: the log writer is installed before any [`Metrics`] exists, and
/// every registry shows this same counter.
static LOG_LINES_DROPPED: LazyLock<Counter> = LazyLock::new(Counter::default);

/// Counts a log line dropped because the log's destination did not take it (stderr a closed
/// pipe, say).
pub fn log_line_dropped() {
    LOG_LINES_DROPPED.inc();
}

/// Every metric the proxy keeps.
pub struct Metrics {
    registry: Registry,
    routes: RouteFamilies,
    observed: observed::ObservedFamilies,
    resolved: resolved::ResolvedFamilies,
    upstream_duration: Family<UpstreamLabel, Histogram, Buckets>,
    /// Per store operation: its duration histogram and its error counter.
    store_ops: Vec<(Histogram, Counter)>,
    /// Per store operation (claim, complete): writes fewer replicas acknowledged than
    /// `store.wait_replicas` asks.
    replica_acks_missing: Family<OpLabel, Counter>,
    /// `idemproxy_config_reloads_total{result}`.
    config_reloads: Family<ResultLabel, Counter>,
    /// `idemproxy_config_reload_key_changes_total{route,field}`.
    reload_key_changes: Family<RouteField, Counter>,
    /// Completions being retried in the background.
    pub pending_saves: Gauge,
    /// Bytes of the results those completions hold.
    pub pending_save_bytes: Gauge,
    /// Exchanges still running after their client left.
    pub detached_exchanges: Gauge,
    /// Observed repeats held in the background (`on_conflict: wait`), at most
    /// `limits.max_detached_exchanges`.
    pub observed_held: Gauge,
    /// Memory store: records held.
    pub memory_records: Gauge,
    /// Memory store: its bound (`max_entries`).
    pub memory_max_entries: Gauge,
    /// SQLite and PostgreSQL: expired records deleted by the sweep.
    pub store_swept: Counter,
    /// SQLite: operations committed per transaction of the writer (group commit).
    pub sqlite_batch_size: Histogram,
    /// SQLite: how long each of the writer's commits took.
    pub sqlite_commit_duration: Histogram,
    /// PostgreSQL: connections the pools hold open, every worker's together (each worker
    /// sets its part through a [`GaugePart`]).
    pub postgres_pool_connections: Gauge,
    /// PostgreSQL: connections lent out to an operation, every worker's together.
    pub postgres_pool_in_use: Gauge,
    /// PostgreSQL: operations waiting for a connection, every worker's together.
    pub postgres_pool_waiting: Gauge,
    /// Connections each worker's accept loop took on the main listener.
    worker_connections: Family<WorkerLabel, Counter>,
    /// Connections open on the main listener, every worker's together.
    pub open_connections: Gauge,
}

/// The families labelled by route, from which [`Metrics::route`] hands out a route's series.
struct RouteFamilies {
    requests: Family<RouteOutcome, Counter>,
    request_duration: Family<RouteOutcome, Histogram, Buckets>,
    lost_leases: Family<RouteLabel, Counter>,
    unprotected: Family<RouteLabel, Counter>,
    completions_abandoned: Family<RouteLabel, Counter>,
    results_not_kept: Family<RouteLabel, Counter>,
    lease_renewals: Family<RouteLabel, Counter>,
    lease_renewals_late: Family<RouteLabel, Counter>,
    derived_keys: Family<RouteLabel, Counter>,
}

impl RouteFamilies {
    fn register(r: &mut Registry) -> RouteFamilies {
        RouteFamilies {
            requests: register(
                r,
                "idemproxy_requests",
                "Requests by route and outcome",
                Family::default(),
            ),
            request_duration: register(
                r,
                "idemproxy_request_duration_seconds",
                "Request duration by route and outcome",
                Family::new_with_constructor(Buckets(latency)),
            ),
            lost_leases: register(
                r,
                "idemproxy_lost_leases",
                "Claims whose lease expired before the result was saved",
                Family::default(),
            ),
            unprotected: register(
                r,
                "idemproxy_unprotected_requests",
                "Requests forwarded without idempotency because the store failed (on_store_error: forward)",
                Family::default(),
            ),
            completions_abandoned: register(
                r,
                "idemproxy_saves_abandoned",
                "Results given up on: the lease was lost while the store refused their save, so the key runs again on its next retry",
                Family::default(),
            ),
            results_not_kept: register(
                r,
                "idemproxy_results_not_kept",
                "Results dropped to fit the pending-save bounds: a result-not-kept record (502) is saved in their place",
                Family::default(),
            ),
            lease_renewals: register(
                r,
                "idemproxy_lease_renewals",
                "Leases renewed while an upstream call ran",
                Family::default(),
            ),
            lease_renewals_late: register(
                r,
                "idemproxy_lease_renewals_late",
                "Lease renewals answered with less than a third of lock_ttl left on the lease (or none): the store's round trips eat the lease",
                Family::default(),
            ),
            derived_keys: register(
                r,
                "idemproxy_derived_keys",
                "Requests whose key was derived from the request (key_from), not sent",
                Family::default(),
            ),
        }
    }
}

/// Registers `metric` under `name` and hands it back: its clones share its value.
fn register<M: Metric + Clone>(registry: &mut Registry, name: &str, help: &str, metric: M) -> M {
    registry.register(name, help, metric.clone());
    metric
}

/// One route's series, registered at start. A clone shares them (one reference count, not
/// one per series: the exchange and its lease each hold one per request).
#[derive(Clone)]
pub struct RouteMetrics(Arc<RouteSeries>);

struct RouteSeries {
    requests: Vec<(Counter, Histogram)>,
    lost_leases: Counter,
    unprotected: Counter,
    completions_abandoned: Counter,
    results_not_kept: Counter,
    lease_renewals: Counter,
    lease_renewals_late: Counter,
    derived_keys: Counter,
}

impl RouteMetrics {
    /// Counts one finished request.
    pub fn request(&self, outcome: Outcome, took: Duration) {
        if let Some((count, duration)) = self.0.requests.get(outcome as usize) {
            count.inc();
            duration.observe(took.as_secs_f64());
        }
    }

    /// Counts a lost lease.
    pub(crate) fn lost_lease(&self) {
        self.0.lost_leases.inc();
    }

    /// Counts a request whose key was derived (`key_from`).
    pub(crate) fn derived_key(&self) {
        self.0.derived_keys.inc();
    }

    /// Counts a lease renewal.
    pub(crate) fn lease_renewed(&self) {
        self.0.lease_renewals.inc();
    }

    /// Counts a lease renewal answered late (less than a third of the lease left).
    pub(crate) fn lease_renewal_late(&self) {
        self.0.lease_renewals_late.inc();
    }

    /// Counts a request forwarded without protection.
    pub(crate) fn unprotected(&self) {
        self.0.unprotected.inc();
    }

    /// Counts a result given up on: its lease was lost before the store took it.
    pub(crate) fn completion_abandoned(&self) {
        self.0.completions_abandoned.inc();
    }

    /// Counts a result replaced by a `result-not-kept` record (the pending-save bounds).
    pub(crate) fn result_not_kept(&self) {
        self.0.results_not_kept.inc();
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    /// Registers every metric.
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let r = &mut registry;
        let routes = RouteFamilies::register(r);
        let observed = observed::ObservedFamilies::register(r);
        let resolved = resolved::ResolvedFamilies::register(r);
        let upstream_duration = register(
            r,
            "idemproxy_upstream_duration_seconds",
            "Upstream call duration",
            Family::new_with_constructor(Buckets(latency)),
        );
        let store_duration: Family<OpLabel, Histogram, Buckets> = register(
            r,
            "idemproxy_store_operation_duration_seconds",
            "Store operation duration",
            Family::new_with_constructor(Buckets(latency)),
        );
        let store_errors: Family<OpLabel, Counter> = register(
            r,
            "idemproxy_store_errors",
            "Store operations that failed or timed out",
            Family::default(),
        );
        let replica_acks_missing: Family<OpLabel, Counter> = register(
            r,
            "idemproxy_replica_acks_missing",
            "Claims and saves fewer replicas acknowledged in time than store.wait_replicas asks (a claim is then refused with 503; a save stands)",
            Family::default(),
        );
        for op in [StoreOp::Claim, StoreOp::Complete] {
            let _ = replica_acks_missing.get_or_create(&OpLabel { op: op.as_str() });
        }
        let config_reloads: Family<ResultLabel, Counter> = register(
            r,
            "idemproxy_config_reloads",
            "Configuration reloads (SIGHUP) by result: applied, invalid (the file did not validate), needs_restart (a field that cannot change in place changed); nothing of a refused file is applied",
            Family::default(),
        );
        let reload_key_changes = register(
            r,
            "idemproxy_config_reload_key_changes",
            "Applied reloads that changed how a kept route's key or fingerprint is made (scope, header, key_from, fingerprint): its earlier records are out of reach, or answer 422",
            Family::default(),
        );
        r.register(
            "idemproxy_log_lines_dropped",
            "Log lines dropped because the log's destination (stderr) did not take them, a closed pipe say",
            LOG_LINES_DROPPED.clone(),
        );
        for result in ReloadResult::ALL {
            let _ = config_reloads.get_or_create(&ResultLabel {
                result: result.as_str(),
            });
        }
        let store_ops = StoreOp::ALL
            .iter()
            .map(|op| {
                let labels = OpLabel { op: op.as_str() };
                (
                    store_duration.get_or_create(&labels).clone(),
                    store_errors.get_or_create(&labels).clone(),
                )
            })
            .collect();
        Metrics {
            pending_saves: register(
                r,
                "idemproxy_pending_saves",
                "Results whose save is being retried in the background (the store refused or timed out)",
                Gauge::default(),
            ),
            pending_save_bytes: register(
                r,
                "idemproxy_pending_save_bytes",
                "Bytes held by results whose save is being retried",
                Gauge::default(),
            ),
            detached_exchanges: register(
                r,
                "idemproxy_detached_exchanges",
                "Idempotent exchanges still running after their client left",
                Gauge::default(),
            ),
            observed_held: register(
                r,
                "idemproxy_observed_held",
                "Repeats on observed routes held in the background as on_conflict: wait holds them (at most limits.max_detached_exchanges; past it a repeat is counted at once)",
                Gauge::default(),
            ),
            memory_records: register(
                r,
                "idemproxy_memory_store_records",
                "Records the memory store holds (expired ones not yet swept included)",
                Gauge::default(),
            ),
            memory_max_entries: register(
                r,
                "idemproxy_memory_store_max_entries",
                "The memory store's bound (store.max_entries): at it, new claims fail",
                Gauge::default(),
            ),
            store_swept: register(
                r,
                "idemproxy_store_swept",
                "Expired records deleted by the background sweep (sqlite, postgres)",
                Counter::default(),
            ),
            sqlite_batch_size: register(
                r,
                "idemproxy_sqlite_batch_size",
                "Store operations committed together in one SQLite transaction (group commit)",
                Histogram::new(exponential_buckets(1.0, 2.0, 11)),
            ),
            sqlite_commit_duration: register(
                r,
                "idemproxy_sqlite_commit_duration_seconds",
                "Duration of each SQLite commit of the writer thread",
                latency(),
            ),
            postgres_pool_connections: register(
                r,
                "idemproxy_postgres_pool_connections",
                "PostgreSQL connections the pools hold open, every worker's together (at most store.pool_size, or workers when that is larger)",
                Gauge::default(),
            ),
            postgres_pool_in_use: register(
                r,
                "idemproxy_postgres_pool_in_use",
                "PostgreSQL connections lent out to a store operation, every worker's together",
                Gauge::default(),
            ),
            postgres_pool_waiting: register(
                r,
                "idemproxy_postgres_pool_waiting",
                "Store operations waiting for a PostgreSQL connection, every worker's together",
                Gauge::default(),
            ),
            worker_connections: register(
                r,
                "idemproxy_worker_connections",
                "Connections accepted on the main listener, by the worker whose accept loop took them",
                Family::default(),
            ),
            open_connections: register(
                r,
                "idemproxy_open_connections",
                "Connections open on the main listener, every worker's together",
                Gauge::default(),
            ),
            routes,
            observed,
            resolved,
            upstream_duration,
            store_ops,
            replica_acks_missing,
            config_reloads,
            reload_key_changes,
            registry,
        }
    }

    /// Registers a route's series (every outcome) and hands them out.
    pub fn route(&self, route: &str) -> RouteMetrics {
        let label = RouteLabel {
            route: route.to_owned(),
        };
        RouteMetrics(Arc::new(RouteSeries {
            requests: Outcome::ALL
                .iter()
                .map(|o| {
                    let labels = RouteOutcome {
                        route: route.to_owned(),
                        outcome: o.as_str(),
                    };
                    (
                        self.routes.requests.get_or_create(&labels).clone(),
                        self.routes.request_duration.get_or_create(&labels).clone(),
                    )
                })
                .collect(),
            lost_leases: self.routes.lost_leases.get_or_create(&label).clone(),
            unprotected: self.routes.unprotected.get_or_create(&label).clone(),
            completions_abandoned: self
                .routes
                .completions_abandoned
                .get_or_create(&label)
                .clone(),
            results_not_kept: self.routes.results_not_kept.get_or_create(&label).clone(),
            lease_renewals: self.routes.lease_renewals.get_or_create(&label).clone(),
            lease_renewals_late: self
                .routes
                .lease_renewals_late
                .get_or_create(&label)
                .clone(),
            derived_keys: self.routes.derived_keys.get_or_create(&label).clone(),
        }))
    }

    /// Registers an observed route's series (what enforce would have answered) and hands them
    /// out.
    pub fn observed(&self, route: &str) -> ObservedMetrics {
        self.observed.route(route)
    }

    /// Registers the series of a route under `on_unknown_outcome: resolve` (how its
    /// resolutions ended, what its lookups answered) and hands them out.
    pub fn resolved(&self, route: &str) -> ResolvedMetrics {
        self.resolved.route(route)
    }

    /// Registers an upstream's call duration histogram and hands it out.
    pub fn upstream(&self, upstream: &str) -> Histogram {
        self.upstream_duration
            .get_or_create(&UpstreamLabel {
                upstream: upstream.to_owned(),
            })
            .clone()
    }

    /// Registers the counter of the connections worker `worker` accepts and hands it out.
    pub fn worker_connections(&self, worker: usize) -> Counter {
        self.worker_connections
            .get_or_create(&WorkerLabel {
                worker: u64::try_from(worker).unwrap_or(u64::MAX),
            })
            .clone()
    }

    /// Times one store operation, counting failures.
    pub fn store_op(&self, op: StoreOp, took: Duration, failed: bool) {
        if let Some((duration, errors)) = self.store_ops.get(op as usize) {
            duration.observe(took.as_secs_f64());
            if failed {
                errors.inc();
            }
        }
    }

    /// Counts a write (claim or complete) fewer replicas acknowledged than
    /// `store.wait_replicas` asks.
    pub(crate) fn replica_acks_missing(&self, op: StoreOp) {
        self.replica_acks_missing
            .get_or_create(&OpLabel { op: op.as_str() })
            .inc();
    }

    /// Counts a reload that changed how `route`'s key or fingerprint is made (`field`).
    pub(crate) fn reload_key_changed(&self, route: &str, field: &'static str) {
        self.reload_key_changes
            .get_or_create(&RouteField {
                route: route.to_owned(),
                field,
            })
            .inc();
    }

    /// Counts one reload.
    pub(crate) fn config_reload(&self, result: ReloadResult) {
        self.config_reloads
            .get_or_create(&ResultLabel {
                result: result.as_str(),
            })
            .inc();
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcome_and_op_tables_are_in_declaration_order() {
        for (i, o) in Outcome::ALL.iter().enumerate() {
            assert_eq!(*o as usize, i, "{o:?}");
        }
        for (i, op) in StoreOp::ALL.iter().enumerate() {
            assert_eq!(*op as usize, i, "{op:?}");
        }
    }

    #[test]
    fn handed_out_series_are_the_registered_ones() {
        let m = Metrics::new();
        let r = m.route("create-booking");
        r.request(Outcome::Replayed, Duration::from_millis(1));
        r.request(Outcome::Replayed, Duration::from_millis(1));
        r.lost_lease();
        m.store_op(StoreOp::Claim, Duration::from_millis(1), true);
        let text = m.encode();
        let requests = |outcome: &str| {
            format!(r#"idemproxy_requests_total{{route="create-booking",outcome="{outcome}"}}"#)
        };
        assert!(
            text.contains(&format!("{} 2\n", requests("replayed"))),
            "{text}"
        );
        assert!(
            text.contains(&format!("{} 0\n", requests("forwarded"))),
            "{text}"
        );
        assert!(
            text.contains(r#"idemproxy_store_errors_total{op="claim"} 1"#),
            "{text}"
        );
        assert!(text.contains(r#"idemproxy_lost_leases_total{route="create-booking"} 1"#));
    }
}
