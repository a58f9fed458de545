//! The route a request matched, built once per configuration — its upstream client, policy and
//! metric series in one value — and the two answers every step of the flow can give on it: a
//! refusal, or the request passed through as it is.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;

use http::Response;
use http::request::Parts;

use crate::body::Body;
use crate::config::Config;
use crate::key::{self, KeyId, StoreKey};
use crate::metrics::{Metrics, ObservedMetrics, Outcome, ResolvedMetrics, RouteKind, RouteMetrics};
use crate::problem::Problem;
use crate::route::{IdempotencySettings, Mode, OnUnknownOutcome, RouteSettings};
use crate::upstream::{Upstream, UpstreamError};

/// A route built once per configuration (at start, at each reload): everything a request on
/// it needs, in one value.
pub(super) struct Route {
    /// The route's name, for logs.
    pub name: Arc<str>,
    pub settings: RouteSettings,
    /// The idempotency policy (`None`: a pass-through route), shared with exchange tasks.
    pub idempotency: Option<Arc<IdempotencySettings>>,
    /// The upstream and its connection pool (this worker's), shared by the routes that name it.
    pub upstream: Arc<Upstream>,
    /// The route's metric series, registered at start.
    pub metrics: RouteMetrics,
    /// `Some` on an observed route (`mode: observe`): what enforce would have answered, its
    /// series registered when the route is built (at start, or at the reload that makes it
    /// observed) and kept by the registry across later reloads.
    pub observed: Option<ObservedMetrics>,
    /// `Some` on a route under `on_unknown_outcome: resolve`: how its resolutions ended and
    /// what its lookups answered, registered when the route is built.
    pub resolved: Option<ResolvedMetrics>,
    /// Every upstream of its generation, by name: a resolution sends its lookup to the one its
    /// record names (`resolve.upstream`, or the route's, when the key was claimed), whatever
    /// the route says now (SPEC §4.8).
    pub upstreams: Arc<BTreeMap<String, Arc<Upstream>>>,
    /// `key_prefix + name + ":"`: what every store key of the route starts with.
    pub namespace: Arc<str>,
    /// The number its name was given when the process first saw it, which namespaces its keys
    /// in the memory store; it follows the name across reloads (see [`RouteNumbers`]).
    pub number: u32,
}

impl Route {
    /// Builds every route of `config`, in file order, over the upstream clients `upstreams`:
    /// its policy, its metric series, and the number its name has in `numbers`.
    pub(crate) fn build_all(
        config: &Config,
        metrics: &Metrics,
        upstreams: &BTreeMap<String, Arc<Upstream>>,
        numbers: &mut RouteNumbers,
    ) -> Vec<Arc<Route>> {
        let all = Arc::new(upstreams.clone());
        config
            .routes
            .iter()
            .filter_map(|r| {
                // Validation guarantees every route's upstream exists.
                let upstream = upstreams.get(r.upstream.as_str())?.clone();
                if r.webhook.is_some() {
                    metrics.webhook_route(&r.name);
                }
                if let Some(jsonrpc) = &r.jsonrpc {
                    metrics.jsonrpc_route(&r.name, &jsonrpc.methods);
                }
                let kind = match r.idempotency {
                    Some(_) => RouteKind::Idempotent,
                    None => RouteKind::Passthrough,
                };
                Some(Arc::new(Route {
                    name: r.name.as_str().into(),
                    settings: r.clone(),
                    idempotency: r.idempotency.clone().map(Arc::new),
                    upstream,
                    // The same series as before a reload, for a name the registry has seen.
                    metrics: metrics.route_of(&r.name, kind),
                    observed: r
                        .idempotency
                        .as_ref()
                        .filter(|i| i.mode == Mode::Observe)
                        .map(|_| metrics.observed(&r.name)),
                    resolved: r
                        .idempotency
                        .as_ref()
                        .filter(|i| i.on_unknown_outcome == OnUnknownOutcome::Resolve)
                        .map(|_| metrics.resolved(&r.name)),
                    upstreams: all.clone(),
                    namespace: key::namespace(&config.store.key_prefix, &r.name),
                    number: numbers.of(&r.name),
                }))
            })
            .collect()
    }

    /// The store key of the key whose hash is `id`, on this route.
    pub(crate) fn store_key(&self, id: KeyId) -> StoreKey {
        StoreKey::new(self.namespace.clone(), self.number, id)
    }
}

/// The number of every route name the process has served, for its life.
///
/// The memory store keys a record by its route's number, not its name (a fixed-size key, see
/// `store::memory`). Numbered by position in the file, a reload that inserts, removes or
/// reorders routes would hand one route's records to another: a repeat could replay another
/// route's response, and a route could lose its own. So a number belongs to a name: a name
/// keeps its number across reloads, and a new name gets a number no name ever had, never one
/// freed by a removed route. A name removed and later restored gets its number back, and with
/// it its records still in their `ttl`, as on Redis and the SQL stores, whose keys hold the name
/// itself. At start the numbers are the file's order.
#[derive(Debug, Default)]
pub(crate) struct RouteNumbers {
    by_name: HashMap<String, u32>,
}

impl RouteNumbers {
    /// The number of `name`, given it now if it has none.
    pub(crate) fn of(&mut self, name: &str) -> u32 {
        if let Some(&n) = self.by_name.get(name) {
            return n;
        }
        // One entry per distinct name in the process's life: four billion route names would
        // need far more memory than the table could ever be given first.
        let n = u32::try_from(self.by_name.len()).unwrap_or(u32::MAX);
        self.by_name.insert(name.to_owned(), n);
        n
    }
}

/// `on_conflict: wait` looks again after this long at first, doubling up to
/// [`MAX_WAIT_POLL`] (the memory store wakes waiters at once instead): the enforced exchange's
/// waiter and the observed shadow claim's alike.
pub(super) const FIRST_WAIT_POLL: std::time::Duration = std::time::Duration::from_millis(10);
pub(super) const MAX_WAIT_POLL: std::time::Duration = std::time::Duration::from_millis(200);

/// The first client's response: the upstream's head, and exactly the body it read (enforced,
/// observed and JSON-RPC flows alike).
pub(super) fn first_response(parts: http::response::Parts, bytes: bytes::Bytes) -> Response<Body> {
    let mut resp = Response::from_parts(parts, crate::body::full(bytes));
    // The body is whole: hyper sets its length.
    resp.headers_mut().remove(http::header::CONTENT_LENGTH);
    resp
}

/// What a handler produced: the response and the outcome to count and log.
pub(super) type Answer = (Response<Body>, Outcome);

pub(super) fn refuse(p: Problem, outcome: Outcome) -> Answer {
    (p.response(), outcome)
}

/// A plain proxied request: streamed both ways. `drop_key` names a header not to forward
/// (the key header of a route with `forward_key: false`).
pub(super) async fn forward_plain(
    route: &Route,
    parts: Parts,
    body: Body,
    client: SocketAddr,
    drop_key: Option<&http::HeaderName>,
) -> Answer {
    let up = &route.upstream;
    let result = match up.request(parts, body, client, drop_key) {
        Ok(req) => up.send(req).await,
        Err(e) => Err(e),
    };
    match result {
        Ok(resp) => (resp, Outcome::Passthrough),
        Err(e @ UpstreamError::ClientBody { .. }) => {
            tracing::info!(upstream = up.name(), error = %e, "the client's request body failed; upstream request abandoned");
            refuse(Problem::of_upstream(up.name(), &e), Outcome::BadRequest)
        }
        Err(e) => {
            tracing::warn!(upstream = up.name(), error = %e, "upstream call failed");
            refuse(Problem::of_upstream(up.name(), &e), Outcome::UpstreamError)
        }
    }
}
