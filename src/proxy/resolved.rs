//! A route resolved once at start — its upstream client, policy and metric series in one value —
//! and the two answers every step of the flow can give on it: a refusal, or the request passed
//! through as it is.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use http::Response;
use http::request::Parts;

use crate::body::Body;
use crate::config::Config;
use crate::key::{self, KeyId, StoreKey};
use crate::metrics::{Metrics, ObservedMetrics, Outcome, RouteMetrics};
use crate::problem::Problem;
use crate::route::{IdempotencySettings, Mode, RouteSettings};
use crate::upstream::{Upstream, UpstreamError};

/// A route resolved once at start: everything a request on it needs, in one value.
pub(super) struct Route {
    /// The route's name, for logs.
    pub name: Arc<str>,
    pub settings: RouteSettings,
    /// The idempotency policy (`None`: a pass-through route), shared with exchange tasks.
    pub idempotency: Option<Arc<IdempotencySettings>>,
    /// One pooled client per upstream, shared by its routes.
    pub upstream: Arc<Upstream>,
    /// The route's metric series, registered at start.
    pub metrics: RouteMetrics,
    /// `Some` on an observed route (`mode: observe`): what enforce would have answered, its
    /// series registered at start.
    pub observed: Option<ObservedMetrics>,
    /// `key_prefix + name + ":"`: what every store key of the route starts with.
    pub namespace: Arc<str>,
    /// The route's position in the file, which namespaces its keys in the memory store.
    pub number: u32,
}

impl Route {
    /// Resolves every route of `config`, in file order: its upstream's client, its policy and
    /// its metric series.
    pub(crate) fn resolve_all(config: &Config, metrics: &Metrics) -> Vec<Arc<Route>> {
        let upstreams: BTreeMap<&str, Arc<Upstream>> = config
            .upstreams
            .iter()
            .map(|(name, s)| {
                (
                    name.as_str(),
                    Arc::new(Upstream::new(s, metrics.upstream(name))),
                )
            })
            .collect();
        config
            .routes
            .iter()
            .zip(0u32..)
            .filter_map(|(r, number)| {
                // Validation guarantees every route's upstream exists.
                let upstream = upstreams.get(r.upstream.as_str())?.clone();
                Some(Arc::new(Route {
                    name: r.name.as_str().into(),
                    settings: r.clone(),
                    idempotency: r.idempotency.clone().map(Arc::new),
                    upstream,
                    metrics: metrics.route(&r.name),
                    observed: r
                        .idempotency
                        .as_ref()
                        .filter(|i| i.mode == Mode::Observe)
                        .map(|_| metrics.observed(&r.name)),
                    namespace: key::namespace(&config.store.key_prefix, &r.name),
                    number,
                }))
            })
            .collect()
    }

    /// The store key of the key whose hash is `id`, on this route.
    pub(crate) fn store_key(&self, id: KeyId) -> StoreKey {
        StoreKey::new(self.namespace.clone(), self.number, id)
    }
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
