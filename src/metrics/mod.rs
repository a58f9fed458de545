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
//!
//! A store's own series (the SQLite commit histogram, the PostgreSQL pool gauges, …) are the
//! store's: each store defines them, as a [`StoreSeries`], and registers them on this registry
//! when it is opened ([`Metrics::store_series`]). So a proxy exports the series of the store it
//! uses and no other's, and a bare [`Metrics::new`] exports none.

mod jsonrpc;
mod observed;
mod resolved;
mod routes;
mod summed;

pub use jsonrpc::CallResult;
pub use observed::{ObservedMetrics, Unclaimed, Would};
pub use resolved::{LookupAnswer, Resolution, ResolvedMetrics};
pub use routes::{RouteKind, RouteMetrics};
pub use summed::GaugePart;

use std::any::Any;
use std::fmt;
use std::sync::{LazyLock, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
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
    Claim,
    Renew,
    /// The save of a finished record; its label value stays `complete`, as dashboards and the
    /// operations guide know it.
    Save,
    Release,
    Get,
    Ping,
    /// `forget` (key tooling).
    Forget,
}

impl StoreOp {
    /// Every operation, in declaration order.
    pub const ALL: [StoreOp; 7] = [
        StoreOp::Claim,
        StoreOp::Renew,
        StoreOp::Save,
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
            StoreOp::Save => "complete",
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
struct UpstreamLabel {
    upstream: String,
}

/// A store operation's label (`op="claim"`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct OpLabel {
    pub(crate) op: &'static str,
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

#[derive(Clone)]
struct Buckets(fn() -> Histogram);

impl MetricConstructor<Histogram> for Buckets {
    fn new_metric(&self) -> Histogram {
        (self.0)()
    }
}

/// A histogram of durations, in seconds: the buckets of every latency series.
pub(crate) fn latency() -> Histogram {
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

/// A store's own series, made and registered once on a [`Metrics`] registry by the first of
/// its stores opened there ([`Metrics::store_series`]); the stores opened after it (one a
/// worker) share them.
pub trait StoreSeries: Clone + Send + Sync + 'static {
    /// Makes the series and registers them with `registry`.
    fn register(registry: &mut Registry) -> Self;
}

/// Encodes one series under `name`, from a store's collector: as the registry would have, but
/// for the full stop the registry adds to a help text (the stores' series always had none).
pub(crate) fn encode_one(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    metric: &impl EncodeMetric,
) -> fmt::Result {
    let metric_encoder = encoder.encode_descriptor(name, help, None, metric.metric_type())?;
    metric.encode(metric_encoder)
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere while holding the lock leaves the registry whole: use it.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Every metric the proxy keeps.
pub struct Metrics {
    /// Behind a lock for the stores, which register their series once the proxy runs.
    registry: Mutex<Registry>,
    /// The [`StoreSeries`] registered so far, one of each type.
    store_series: Mutex<Vec<Box<dyn Any + Send + Sync>>>,
    routes: routes::RouteFamilies,
    jsonrpc: jsonrpc::JsonRpcFamilies,
    observed: observed::ObservedFamilies,
    resolved: resolved::ResolvedFamilies,
    upstream_duration: Family<UpstreamLabel, Histogram, Buckets>,
    /// Per store operation: its duration histogram and its error counter.
    store_ops: Vec<(Histogram, Counter)>,
    /// `idemproxy_config_reloads_total{result}`.
    config_reloads: Family<ResultLabel, Counter>,
    /// `idemproxy_config_reload_key_changes_total{route,field}`.
    reload_key_changes: Family<RouteField, Counter>,
    /// Saves being retried in the background.
    pub pending_saves: Gauge,
    /// Bytes of the results those saves hold.
    pub pending_save_bytes: Gauge,
    /// Exchanges still running after their client left.
    pub detached_exchanges: Gauge,
    /// Observed repeats held in the background (`on_conflict: wait`), at most
    /// `limits.max_detached_exchanges`.
    pub observed_held: Gauge,
    /// Connections each worker's accept loop took on the main listener.
    worker_connections: Family<WorkerLabel, Counter>,
    /// Connections open on the main listener, every worker's together.
    pub open_connections: Gauge,
    /// Spans dropped because the export queue was full (`tracing:`).
    pub spans_dropped: Counter,
}

/// Registers what is dropped rather than wait: log lines (the process's one counter) and
/// spans (`tracing:`), whose counter it hands back.
fn dropped_counters(r: &mut Registry) -> Counter {
    r.register(
        "idemproxy_log_lines_dropped",
        "Log lines dropped because the log's destination (stderr) did not take them, a closed pipe say",
        LOG_LINES_DROPPED.clone(),
    );
    register(
        r,
        "idemproxy_spans_dropped",
        "Spans dropped because the export queue was full (the collector slow, down or refusing)",
        Counter::default(),
    )
}

/// Registers `metric` under `name` and hands it back: its clones share its value.
fn register<M: Metric + Clone>(registry: &mut Registry, name: &str, help: &str, metric: M) -> M {
    registry.register(name, help, metric.clone());
    metric
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

/// Registers the store operations' families and hands out each operation's duration
/// histogram and error counter, in [`StoreOp::ALL`]'s order.
fn store_ops(r: &mut Registry) -> Vec<(Histogram, Counter)> {
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
    StoreOp::ALL
        .iter()
        .map(|op| {
            let labels = OpLabel { op: op.as_str() };
            (
                store_duration.get_or_create(&labels).clone(),
                store_errors.get_or_create(&labels).clone(),
            )
        })
        .collect()
}

impl Metrics {
    /// Registers every metric.
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let r = &mut registry;
        let routes = routes::RouteFamilies::register(r);
        let upstream_duration = register(
            r,
            "idemproxy_upstream_duration_seconds",
            "Upstream call duration",
            Family::new_with_constructor(Buckets(latency)),
        );
        let store_ops = store_ops(r);
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
        let spans_dropped = dropped_counters(r);
        for result in ReloadResult::ALL {
            let _ = config_reloads.get_or_create(&ResultLabel {
                result: result.as_str(),
            });
        }
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
            spans_dropped,
            routes,
            jsonrpc: jsonrpc::JsonRpcFamilies::register(r),
            observed: observed::ObservedFamilies::register(r),
            resolved: resolved::ResolvedFamilies::register(r),
            upstream_duration,
            store_ops,
            config_reloads,
            reload_key_changes,
            registry: Mutex::new(registry),
            store_series: Mutex::default(),
        }
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

    /// Resolutions running on this instance, at most `limits.max_resolutions`
    /// (`idemproxy_resolutions_running`; its clones share it).
    pub fn resolutions_running(&self) -> Gauge {
        self.resolved.running.clone()
    }

    /// Unknown outcomes left held in the store at `limits.max_resolutions`
    /// (`idemproxy_resolutions_deferred_total`; its clones share it).
    pub fn resolutions_deferred(&self) -> Counter {
        self.resolved.deferred.clone()
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

    /// Registers a webhook route's `idemproxy_webhooks_total` series, each result at 0.
    pub(crate) fn webhook_route(&self, route: &str) {
        self.routes.webhook_series(route);
    }

    /// Counts a webhook delivery on `route` by the result of its signature check (`verified`,
    /// `bad_signature`, `stale`, `missing_signature`).
    pub(crate) fn webhook(&self, route: &str, result: &'static str) {
        self.routes.webhook(route, result);
    }

    /// Counts a `POST` on a JSON-RPC route by its method and what became of it; `claimed`:
    /// the route's claimed methods (see `metrics::jsonrpc` for the `method` label).
    pub(crate) fn jsonrpc_call(
        &self,
        route: &str,
        method: &str,
        claimed: &[String],
        result: CallResult,
    ) {
        self.jsonrpc.call(route, method, claimed, result);
    }

    /// Registers a JSON-RPC route's series, at 0 (`claimed`: its claimed methods).
    pub(crate) fn jsonrpc_route(&self, route: &str, claimed: &[String]) {
        self.jsonrpc.route(route, claimed);
    }

    /// Counts a claimed call answered `202` with no body (released).
    pub(crate) fn jsonrpc_unanswered(&self, route: &str) {
        self.jsonrpc.unanswered(route);
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

    /// The series of store type `S`: registered by the first call, shared by the later ones
    /// (each worker's store of that type).
    pub fn store_series<S: StoreSeries>(&self) -> S {
        let mut made = lock(&self.store_series);
        if let Some(series) = made.iter().find_map(|s| s.downcast_ref::<S>()) {
            return series.clone();
        }
        let series = S::register(&mut lock(&self.registry));
        made.push(Box::new(series.clone()));
        series
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &lock(&self.registry));
        out
    }
}

#[cfg(test)]
mod tests;
