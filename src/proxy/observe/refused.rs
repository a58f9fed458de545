//! What `enforce` would refuse on an observed route, counted and logged, the request forwarded
//! all the same (SPEC §4.7): a key missing or unusable, a body over `max_request_body`. The
//! JSON-RPC flow counts a call's refusals here too.

use std::net::SocketAddr;

use crate::metrics::{ObservedMetrics, Outcome, Unclaimed, Would};
use crate::problem::Problem;
use crate::route::IdempotencySettings;

use super::super::matched::Route;

/// Counts (and logs) a request head `enforce` would refuse before reading the body (and a
/// JSON-RPC call whose key `enforce` would refuse).
pub(in crate::proxy) fn refused_head(
    route: &Route,
    observed: &ObservedMetrics,
    problem: &Problem,
    outcome: Outcome,
    client: SocketAddr,
) {
    let would = match outcome {
        Outcome::TooLarge => {
            return too_large_declared(route, observed, problem, client);
        }
        Outcome::MissingKey => Would::MissingKey,
        // A malformed key, the key header twice, or `Connection` naming a header the key,
        // its scope or its fingerprint is read from: the key cannot be used as sent.
        _ => Would::InvalidKey,
    };
    would_refuse(route, observed, would, problem, client);
}

/// Counts and logs a request `enforce` would refuse with a 400 for its key, so an operator
/// finds the clients to fix before switching.
pub(super) fn would_refuse(
    route: &Route,
    observed: &ObservedMetrics,
    would: Would,
    problem: &Problem,
    client: SocketAddr,
) {
    observed.would(would);
    tracing::info!(
        route = %route.name,
        client = %client.ip(),
        would = would.as_str(),
        problem = problem.slug(),
        reason = %reason(problem),
        "observed: enforce would refuse this request ({}); forwarded",
        problem.status().as_u16()
    );
}

/// A body declared (`Content-Length`) over `max_request_body`.
fn too_large_declared(
    route: &Route,
    observed: &ObservedMetrics,
    problem: &Problem,
    client: SocketAddr,
) {
    observed.unclaimed(Unclaimed::TooLarge);
    tracing::info!(
        route = %route.name,
        client = %client.ip(),
        problem = problem.slug(),
        "observed: the declared body is over max_request_body, enforce would refuse it (413); forwarded without a claim"
    );
}

/// A body found over `max_request_body` while reading it.
pub(super) fn too_large(
    route: &Route,
    observed: &ObservedMetrics,
    idem: &IdempotencySettings,
    client: SocketAddr,
) {
    observed.unclaimed(Unclaimed::TooLarge);
    tracing::info!(
        route = %route.name,
        client = %client.ip(),
        limit = idem.max_request_body,
        "observed: the body is over max_request_body, enforce would refuse it (413); forwarded without a claim"
    );
}

/// What is wrong with a refused key, in a few words for the log (never the key itself).
fn reason(problem: &Problem) -> String {
    match problem {
        Problem::MissingKey { header } => format!("no {header} header"),
        Problem::InvalidKey { detail }
        | Problem::UnreadableKeyPart { detail }
        | Problem::UnreadableLookupPart { detail } => detail.clone(),
        Problem::HopByHopConflict { header } => format!("Connection names {header}"),
        other => other.slug().to_owned(),
    }
}
