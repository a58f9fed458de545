//! What one request on an idempotent route carries through its steps, in one value the steps
//! borrow: the [`Context`] built by `Proxy::handle` once the route is matched, over the
//! [`Shared`] handles of the worker it runs on. Admission, the exchange, the settlement, the
//! observed flow and its shadow claim all take it; none of them owns it.

use std::net::SocketAddr;
use std::sync::Arc;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use super::lease::Lease;
use super::matched::Route;
use super::pending::PendingSaves;
use crate::config::Limits;
use crate::key::StoreKey;
use crate::route::IdempotencySettings;
use crate::store::{Held, StoreHandle};

/// What every exchange shares with the proxy: the store, the tracker of the background tasks
/// (detached exchanges, completions) that shutdown waits for, the saves being retried, and
/// the count of work running after its client was answered (`idemproxy_detached_exchanges`).
pub(super) struct Shared {
    pub store: StoreHandle,
    pub tasks: TaskTracker,
    pub pending: Arc<PendingSaves>,
    pub detached: Gauge,
    /// Resolutions running on this instance (`idemproxy_resolutions_running`), bounded by
    /// `limits.max_resolutions`.
    pub resolutions: Gauge,
    /// Unknown outcomes left held at that bound (`idemproxy_resolutions_deferred_total`).
    pub deferred: Counter,
}

/// One request on an idempotent route, from its match to its answer (and past it, for the
/// work that outlives its client): shared by reference, or by `Arc` with the tasks that
/// outlive the request's own future.
pub(super) struct Context {
    /// The route it matched, from the generation it arrived under.
    pub route: Arc<Route>,
    /// The route's idempotency policy (its `idempotency`), taken out once at the match.
    pub policy: Arc<IdempotencySettings>,
    /// The handles of the worker it runs on.
    pub shared: Arc<Shared>,
    pub client: SocketAddr,
    /// The limits of the generation it arrived under.
    pub limits: Limits,
    /// When it arrived.
    pub start: Instant,
}

impl Context {
    /// The lease of the claim `held` on `key`, sent at `claimed_at`.
    pub(super) fn lease(&self, key: StoreKey, held: Held, claimed_at: Instant) -> Lease {
        Lease::new(
            self.shared.store.clone(),
            self.route.metrics.clone(),
            self.route.name.clone(),
            key,
            held,
            self.policy.lock_ttl,
            claimed_at,
        )
    }

    /// The header not to forward: the key header of a route with `forward_key: false`.
    pub(super) fn drop_key(&self) -> Option<&http::HeaderName> {
        (!self.policy.forward_key).then_some(&self.policy.header)
    }
}
