//! The series labelled by route: registered once per route name ([`Metrics::route_of`]), with a
//! request series only for the outcomes a route of its kind can have — a pass-through route
//! has no `replayed` or `mismatch`, and the requests that match no route (`route=""`) only
//! `no_route` — so that the exposition grows with the routes, not with routes × outcomes.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::{Buckets, Metrics, Outcome, latency, register};

/// What kind of route a route's series are for, which says the outcomes it can have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteKind {
    /// A route with an idempotency policy (either mode): every outcome but `no_route`.
    Idempotent,
    /// A plain pass-through route: forwarded, or failed on the way.
    Passthrough,
    /// The requests that match no route (`route=""`).
    Unrouted,
}

impl RouteKind {
    fn can_have(self, outcome: Outcome) -> bool {
        match self {
            RouteKind::Idempotent => outcome != Outcome::NoRoute,
            RouteKind::Passthrough => matches!(
                outcome,
                Outcome::Passthrough | Outcome::UpstreamError | Outcome::BadRequest
            ),
            RouteKind::Unrouted => outcome == Outcome::NoRoute,
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteOutcome {
    route: String,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteResult {
    route: String,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabel {
    route: String,
}

/// The families labelled by route, from which [`Metrics::route`] hands out a route's series.
#[derive(Clone)]
pub(super) struct RouteFamilies {
    requests: Family<RouteOutcome, Counter>,
    request_duration: Family<RouteOutcome, Histogram, Buckets>,
    lost_leases: Family<RouteLabel, Counter>,
    unprotected: Family<RouteLabel, Counter>,
    saves_abandoned: Family<RouteLabel, Counter>,
    results_not_kept: Family<RouteLabel, Counter>,
    lease_renewals: Family<RouteLabel, Counter>,
    lease_renewals_late: Family<RouteLabel, Counter>,
    derived_keys: Family<RouteLabel, Counter>,
    /// `idemproxy_webhooks_total{route,result}`: a series made at a route's first delivery
    /// of each result.
    webhooks: Family<RouteResult, Counter>,
}

impl RouteFamilies {
    /// Makes a webhook route's series, at 0, so that each result is served from the start.
    pub(super) fn webhook_series(&self, route: &str) {
        for result in ["verified", "bad_signature", "stale", "missing_signature"] {
            let labels = RouteResult {
                route: route.to_owned(),
                result,
            };
            drop(self.webhooks.get_or_create(&labels));
        }
    }

    /// Counts a webhook delivery on `route` by the result of its signature check.
    pub(super) fn webhook(&self, route: &str, result: &'static str) {
        let labels = RouteResult {
            route: route.to_owned(),
            result,
        };
        self.webhooks.get_or_create(&labels).inc();
    }

    pub(super) fn register(r: &mut Registry) -> RouteFamilies {
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
            saves_abandoned: register(
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
            webhooks: register(
                r,
                "idemproxy_webhooks",
                "Webhook deliveries by route and the result of their signature check: verified, bad_signature, stale, missing_signature",
                Family::default(),
            ),
        }
    }
}

/// One route's series, registered at start. A clone shares them (one reference count, not
/// one per series: the exchange and its lease each hold one per request).
#[derive(Clone)]
pub struct RouteMetrics(Arc<RouteSeries>);

struct RouteSeries {
    name: String,
    /// Per outcome (`outcome as usize`): its count and duration, made at start for the
    /// outcomes the route can have ([`RouteKind`]).
    requests: Vec<Option<(Counter, Histogram)>>,
    /// Where any other outcome's series would be made, should one ever happen.
    families: RouteFamilies,
    lost_leases: Counter,
    unprotected: Counter,
    saves_abandoned: Counter,
    results_not_kept: Counter,
    lease_renewals: Counter,
    lease_renewals_late: Counter,
    derived_keys: Counter,
}

impl RouteMetrics {
    /// Counts one finished request.
    pub fn request(&self, outcome: Outcome, took: Duration) {
        let took = took.as_secs_f64();
        match self.0.requests.get(outcome as usize) {
            Some(Some((count, duration))) => {
                count.inc();
                duration.observe(took);
            }
            // An outcome its kind of route was not expected to have: counted all the same, in
            // a series made now.
            _ => {
                let labels = RouteOutcome {
                    route: self.0.name.clone(),
                    outcome: outcome.as_str(),
                };
                self.0.families.requests.get_or_create(&labels).inc();
                let duration = self.0.families.request_duration.get_or_create(&labels);
                duration.observe(took);
            }
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
    pub(crate) fn save_abandoned(&self) {
        self.0.saves_abandoned.inc();
    }

    /// Counts a result replaced by a `result-not-kept` record (the pending-save bounds).
    pub(crate) fn result_not_kept(&self) {
        self.0.results_not_kept.inc();
    }
}

impl Metrics {
    /// Registers the series of a route that can have every outcome and hands them out.
    pub fn route(&self, route: &str) -> RouteMetrics {
        self.route_of(route, RouteKind::Idempotent)
    }

    /// Registers a route's series, with a request series for each outcome a route of its
    /// `kind` can have, and hands them out.
    pub fn route_of(&self, route: &str, kind: RouteKind) -> RouteMetrics {
        let label = RouteLabel {
            route: route.to_owned(),
        };
        let f = &self.routes;
        // What no route matched never holds a lease, saves or derives a key: its per-route
        // counters are kept out of the registry, so no `route=""` series sits at 0 forever.
        let own = |family: &prometheus_client::metrics::family::Family<RouteLabel, Counter>| {
            if kind == RouteKind::Unrouted {
                Counter::default()
            } else {
                family.get_or_create(&label).clone()
            }
        };
        RouteMetrics(Arc::new(RouteSeries {
            name: route.to_owned(),
            requests: Outcome::ALL
                .iter()
                .map(|&o| {
                    kind.can_have(o).then(|| {
                        let labels = RouteOutcome {
                            route: route.to_owned(),
                            outcome: o.as_str(),
                        };
                        (
                            f.requests.get_or_create(&labels).clone(),
                            f.request_duration.get_or_create(&labels).clone(),
                        )
                    })
                })
                .collect(),
            families: f.clone(),
            lost_leases: own(&f.lost_leases),
            unprotected: own(&f.unprotected),
            saves_abandoned: own(&f.saves_abandoned),
            results_not_kept: own(&f.results_not_kept),
            lease_renewals: own(&f.lease_renewals),
            lease_renewals_late: own(&f.lease_renewals_late),
            derived_keys: own(&f.derived_keys),
        }))
    }
}
