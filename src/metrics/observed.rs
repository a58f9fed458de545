//! The series of observed routes (`mode: observe`, SPEC §4.7): what `enforce` would have
//! answered each request, counted per route, registered at start for every observed route.

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use super::register;

/// What `enforce` would have answered a request an observed route forwarded
/// (`idemproxy_observed_total{would}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum Would {
    /// It held its key's claim: it would have been forwarded, and its response saved.
    Forward,
    /// A repeat of a finished request: the saved response would have been replayed (or, for a
    /// response too large to save, `409 response-not-replayable` answered).
    Replay,
    /// A repeat while the first was in flight: `409`, or with `on_conflict: wait` a replay
    /// had the first finished within `wait_timeout`.
    Conflict,
    /// The key was reused with another fingerprint: `422`.
    Mismatch,
    /// No key on a route that requires one: `400`.
    MissingKey,
    /// A key that cannot be used: malformed, sent twice, a `key_from` part that can't be read,
    /// or a header it depends on named in `Connection`: `400`.
    InvalidKey,
    /// The store failed or answered too late: `503` (forwarded all the same here).
    StoreError,
}

impl Would {
    /// Every value, in declaration order (`ALL[w as usize] == w`).
    pub const ALL: [Would; 7] = [
        Would::Forward,
        Would::Replay,
        Would::Conflict,
        Would::Mismatch,
        Would::MissingKey,
        Would::InvalidKey,
        Would::StoreError,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Would::Forward => "forward",
            Would::Replay => "replay",
            Would::Conflict => "conflict",
            Would::Mismatch => "mismatch",
            Would::MissingKey => "missing_key",
            Would::InvalidKey => "invalid_key",
            Would::StoreError => "store_error",
        }
    }
}

/// Why an observed request was forwarded without claiming its key although `enforce` would
/// have refused it for a reason outside idempotency's answers
/// (`idemproxy_observed_unclaimed_total{reason}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum Unclaimed {
    /// A body over `max_request_body`: it cannot be fingerprinted; enforce answers `413`.
    TooLarge,
    /// The proxy was at `limits.max_detached_exchanges` or `limits.max_pending_saves`;
    /// enforce answers `503 overloaded`.
    Overloaded,
}

impl Unclaimed {
    /// Every value, in declaration order.
    pub const ALL: [Unclaimed; 2] = [Unclaimed::TooLarge, Unclaimed::Overloaded];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Unclaimed::TooLarge => "too_large",
            Unclaimed::Overloaded => "overloaded",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteWould {
    route: String,
    would: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteReason {
    route: String,
    reason: &'static str,
}

/// The families, from which [`super::Metrics::observed`] hands out a route's series.
pub(super) struct ObservedFamilies {
    would: Family<RouteWould, Counter>,
    unclaimed: Family<RouteReason, Counter>,
}

impl ObservedFamilies {
    pub(super) fn register(r: &mut Registry) -> ObservedFamilies {
        ObservedFamilies {
            would: register(
                r,
                "idemproxy_observed",
                "Requests on observed routes (mode: observe), all forwarded, by what enforce would have answered",
                Family::default(),
            ),
            unclaimed: register(
                r,
                "idemproxy_observed_unclaimed",
                "Requests on observed routes forwarded without a claim that enforce would have refused outside idempotency (too_large: 413; overloaded: 503)",
                Family::default(),
            ),
        }
    }

    /// Registers a route's series (every value of each label) and hands them out.
    pub(super) fn route(&self, route: &str) -> ObservedMetrics {
        ObservedMetrics(Arc::new(ObservedSeries {
            would: Would::ALL
                .iter()
                .map(|w| {
                    let labels = RouteWould {
                        route: route.to_owned(),
                        would: w.as_str(),
                    };
                    self.would.get_or_create(&labels).clone()
                })
                .collect(),
            unclaimed: Unclaimed::ALL
                .iter()
                .map(|u| {
                    let labels = RouteReason {
                        route: route.to_owned(),
                        reason: u.as_str(),
                    };
                    self.unclaimed.get_or_create(&labels).clone()
                })
                .collect(),
        }))
    }
}

/// One observed route's series, registered at start; a clone shares them.
#[derive(Clone)]
pub struct ObservedMetrics(Arc<ObservedSeries>);

struct ObservedSeries {
    would: Vec<Counter>,
    unclaimed: Vec<Counter>,
}

impl ObservedMetrics {
    /// Counts what enforce would have answered one request.
    pub fn would(&self, would: Would) {
        if let Some(c) = self.0.would.get(would as usize) {
            c.inc();
        }
    }

    /// Counts a request forwarded without a claim, and why.
    pub fn unclaimed(&self, why: Unclaimed) {
        if let Some(c) = self.0.unclaimed.get(why as usize) {
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
        for (i, w) in Would::ALL.iter().enumerate() {
            assert_eq!(*w as usize, i, "{w:?}");
        }
        for (i, u) in Unclaimed::ALL.iter().enumerate() {
            assert_eq!(*u as usize, i, "{u:?}");
        }
    }

    #[test]
    fn every_series_of_an_observed_route_is_there_from_the_start() {
        let m = Metrics::new();
        let observed = m.observed("create-booking");
        observed.would(Would::Replay);
        observed.unclaimed(Unclaimed::TooLarge);
        let text = m.encode();
        for w in Would::ALL {
            let value = if w == Would::Replay { 1 } else { 0 };
            let line = format!(
                "idemproxy_observed_total{{route=\"create-booking\",would=\"{}\"}} {value}\n",
                w.as_str()
            );
            assert!(text.contains(&line), "{line}in\n{text}");
        }
        assert!(text.contains(
            "idemproxy_observed_unclaimed_total{route=\"create-booking\",reason=\"too_large\"} 1\n"
        ));
        assert!(text.contains(
            "idemproxy_observed_unclaimed_total{route=\"create-booking\",reason=\"overloaded\"} 0\n"
        ));
    }
}
