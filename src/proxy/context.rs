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
use crate::fingerprint::Fingerprint;
use crate::key::{KeyId, StoreKey};
use crate::route::IdempotencySettings;
use crate::store::{Held, StoreHandle};

/// What every exchange shares with the proxy: the store, the tracker of the background tasks
/// (detached exchanges, saves) that shutdown waits for, the saves being retried, and
/// the count of work running after its client was answered (`idemproxy_detached_exchanges`).
pub(super) struct Shared {
    pub store: StoreHandle,
    pub tasks: TaskTracker,
    pub pending: Arc<PendingSaves>,
    pub detached: Gauge,
    /// Observed keys whose first request has its answer and whose save has not landed yet,
    /// shared by every worker (see [`Answered`]).
    pub answered: Arc<Answered>,
    /// Resolutions running on this instance (`idemproxy_resolutions_running`), bounded by
    /// `limits.max_resolutions`.
    pub resolutions: Gauge,
    /// Unknown outcomes left held at that bound (`idemproxy_resolutions_deferred_total`).
    pub deferred: Counter,
}

/// The first observed request (`mode: observe`) of each key this instance is claiming, and
/// whether it has been answered with a result to save.
///
/// Enforce claims before it forwards and saves before it answers, so a repeat that comes after
/// the first's answer finds the result and replays it. Observe forwards beside its claim and
/// saves after it answers: a repeat may find the claim still in flight, or even reach the store
/// before the first's own claim has landed (PostgreSQL). Counted by what the store shows, it
/// would be a `conflict` (or a `forward`) that enforce never answers (SPEC §4.7). So a request
/// that finds an earlier one of its key here, answered, counts `replay` (or `mismatch`) at once,
/// before it claims anything, as enforce would answer it.
///
/// Every change happens under one lock; an entry goes when its request's claim ends.
#[derive(Default)]
pub(super) struct Answered {
    next: std::sync::atomic::AtomicU64,
    /// By key: the first request's number, its fingerprint, and whether it is answered.
    keys: std::sync::Mutex<std::collections::HashMap<(u32, KeyId), First>>,
}

#[derive(Clone, Copy)]
struct First {
    owner: u64,
    fingerprint: Fingerprint,
    answered: bool,
}

/// What an observed request finds when it starts its claim.
pub(super) enum Found {
    /// No earlier request of its key here: it is the first (and registered as such).
    First,
    /// An earlier one, answered, with this fingerprint: enforce would answer from its result.
    Answered(Fingerprint),
    /// An earlier one still running here, with this fingerprint: the store decides, as it
    /// always did — within the bound on held repeats, which its read of the record counts
    /// against (see `observe::shadow`).
    Running(Fingerprint),
}

impl Answered {
    /// A number for one observed request.
    pub(super) fn owner(&self) -> u64 {
        self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    /// Request `owner`, of `fingerprint`, starts its claim of `key`.
    pub(super) fn start(&self, key: &StoreKey, owner: u64, fingerprint: Fingerprint) -> Found {
        let mut keys = self.lock();
        match keys.entry(identity(key)) {
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(First {
                    owner,
                    fingerprint,
                    answered: false,
                });
                Found::First
            }
            std::collections::hash_map::Entry::Occupied(first) => {
                let first = first.get();
                if first.answered {
                    Found::Answered(first.fingerprint)
                } else {
                    Found::Running(first.fingerprint)
                }
            }
        }
    }

    /// Request `owner` of `key` is answered with a result to save.
    pub(super) fn answered(&self, key: &StoreKey, owner: u64) {
        if let Some(first) = self.lock().get_mut(&identity(key))
            && first.owner == owner
        {
            first.answered = true;
        }
    }

    /// The claim of request `owner` of `key` has ended: its entry, if it is the first, goes.
    pub(super) fn end(&self, key: &StoreKey, owner: u64) {
        let mut keys = self.lock();
        let id = identity(key);
        if keys.get(&id).is_some_and(|first| first.owner == owner) {
            keys.remove(&id);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<(u32, KeyId), First>> {
        self.keys.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A store key as one value: its route's number (which follows the route's name, see
/// `RouteNumbers`) and its hash; two routes may share a hash.
fn identity(key: &StoreKey) -> (u32, KeyId) {
    (key.route(), *key.id())
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
        .on_grpc_route(self.route.settings.grpc.is_some())
    }

    /// The header not to forward: the key header of a route with `forward_key: false`.
    pub(super) fn drop_key(&self) -> Option<&http::HeaderName> {
        (!self.policy.forward_key).then_some(&self.policy.header)
    }
}
