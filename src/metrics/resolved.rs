//! The series of routes under `on_unknown_outcome: resolve` (SPEC §4.8): how each resolution
//! ended, and what each lookup answered, registered at start for every such route.

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::register;

/// How a resolution ended (`idemproxy_resolutions_total{result}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum Resolution {
    /// A lookup found the operation: its answer is the key's result.
    Found,
    /// A lookup sent `settle_after` or more after the request found nothing: the key was
    /// released, and the next retry runs the operation.
    Absent,
    /// Nothing settled it by `give_up_after`: `outcome-unknown` saved.
    GaveUp,
}

impl Resolution {
    /// Every value, in declaration order (`ALL[r as usize] == r`).
    pub const ALL: [Resolution; 3] = [Resolution::Found, Resolution::Absent, Resolution::GaveUp];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Resolution::Found => "found",
            Resolution::Absent => "absent",
            Resolution::GaveUp => "gave_up",
        }
    }
}

/// What one lookup answered (`idemproxy_resolve_lookups_total{answer}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum LookupAnswer {
    /// A `found` status.
    Found,
    /// An `absent` status (final or not).
    Absent,
    /// Another status.
    Other,
    /// No answer: a connect failure, a reset, the upstream's timeout.
    Failed,
}

impl LookupAnswer {
    /// Every value, in declaration order.
    pub const ALL: [LookupAnswer; 4] = [
        LookupAnswer::Found,
        LookupAnswer::Absent,
        LookupAnswer::Other,
        LookupAnswer::Failed,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            LookupAnswer::Found => "found",
            LookupAnswer::Absent => "absent",
            LookupAnswer::Other => "other",
            LookupAnswer::Failed => "failed",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteResult {
    route: String,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteAnswer {
    route: String,
    answer: &'static str,
}

/// The families, from which [`super::Metrics::resolved`] hands out a route's series.
pub(super) struct ResolvedFamilies {
    resolutions: Family<RouteResult, Counter>,
    lookups: Family<RouteAnswer, Counter>,
    /// Resolutions running on this instance, every route's together.
    pub(super) running: Gauge,
    /// Unknown outcomes left held at `limits.max_resolutions`, every route's together.
    pub(super) deferred: Counter,
}

impl ResolvedFamilies {
    pub(super) fn register(r: &mut Registry) -> ResolvedFamilies {
        ResolvedFamilies {
            resolutions: register(
                r,
                "idemproxy_resolutions",
                "Unknown outcomes resolved by asking the upstream (on_unknown_outcome: resolve), by how they ended (found: the answer saved; absent: released; gave_up: outcome-unknown saved)",
                Family::default(),
            ),
            lookups: register(
                r,
                "idemproxy_resolve_lookups",
                "Lookups sent to resolve unknown outcomes, by what they answered (found, absent, other: another status, failed: no answer)",
                Family::default(),
            ),
            running: register(
                r,
                "idemproxy_resolutions_running",
                "Resolutions of unknown outcomes running on this instance (at most limits.max_resolutions)",
                Gauge::default(),
            ),
            deferred: register(
                r,
                "idemproxy_resolutions_deferred",
                "Unknown outcomes left held in the store at limits.max_resolutions, their lease left to lapse: a repeat of the key takes it over and resolves it",
                Counter::default(),
            ),
        }
    }

    /// Registers a route's series (every value of each label) and hands them out.
    pub(super) fn route(&self, route: &str) -> ResolvedMetrics {
        ResolvedMetrics(Arc::new(ResolvedSeries {
            resolutions: Resolution::ALL
                .iter()
                .map(|r| {
                    let labels = RouteResult {
                        route: route.to_owned(),
                        result: r.as_str(),
                    };
                    self.resolutions.get_or_create(&labels).clone()
                })
                .collect(),
            lookups: LookupAnswer::ALL
                .iter()
                .map(|a| {
                    let labels = RouteAnswer {
                        route: route.to_owned(),
                        answer: a.as_str(),
                    };
                    self.lookups.get_or_create(&labels).clone()
                })
                .collect(),
        }))
    }
}

/// One resolving route's series, registered at start; a clone shares them.
#[derive(Clone)]
pub struct ResolvedMetrics(Arc<ResolvedSeries>);

struct ResolvedSeries {
    resolutions: Vec<Counter>,
    lookups: Vec<Counter>,
}

impl ResolvedMetrics {
    /// Counts one resolution that ended.
    pub fn resolution(&self, result: Resolution) {
        if let Some(c) = self.0.resolutions.get(result as usize) {
            c.inc();
        }
    }

    /// Counts one lookup's answer.
    pub fn lookup(&self, answer: LookupAnswer) {
        if let Some(c) = self.0.lookups.get(answer as usize) {
            c.inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::Metrics;
    use super::*;

    #[test]
    fn tables_are_in_declaration_order() {
        for (i, r) in Resolution::ALL.iter().enumerate() {
            assert_eq!(*r as usize, i, "{r:?}");
        }
        for (i, a) in LookupAnswer::ALL.iter().enumerate() {
            assert_eq!(*a as usize, i, "{a:?}");
        }
    }

    #[test]
    fn every_series_of_a_resolving_route_is_there_from_the_start() {
        let m = Metrics::new();
        let resolved = m.resolved("create-booking");
        resolved.resolution(Resolution::GaveUp);
        resolved.lookup(LookupAnswer::Failed);
        let text = m.encode();
        for r in Resolution::ALL {
            let value = if r == Resolution::GaveUp { 1 } else { 0 };
            let line = format!(
                "idemproxy_resolutions_total{{route=\"create-booking\",result=\"{}\"}} {value}\n",
                r.as_str()
            );
            assert!(text.contains(&line), "{line}in\n{text}");
        }
        for a in LookupAnswer::ALL {
            let value = if a == LookupAnswer::Failed { 1 } else { 0 };
            let line = format!(
                "idemproxy_resolve_lookups_total{{route=\"create-booking\",answer=\"{}\"}} {value}\n",
                a.as_str()
            );
            assert!(text.contains(&line), "{line}in\n{text}");
        }
    }
}
