//! One configuration as the proxy serves it — a *generation*: the compiled route table, the
//! upstream clients and the key resolver, built from one validated file, and swapped in whole
//! by a reload.
//!
//! A request loads the generation in force once, when it arrives, and keeps that `Arc` to its
//! end. Its route, upstream client, policy and limits all come from it, and so do the lease,
//! the save and a detached exchange (they hold the request's `Arc<Route>`), so a reload never
//! changes the rules under a request half served: SPEC §2, "requests already in flight finish
//! under the configuration they started with". The previous generation is freed when its last
//! request ends.
//!
//! Two things carry over from one generation to the next, because they outlive a reload:
//! - A route's number follows its name ([`RouteNumbers`]): the memory store keys records by
//!   it, and a route keeps its records as long as it keeps its name.
//! - An upstream whose settings are unchanged keeps its client, and with it its pooled
//!   connections. A changed or removed one gets a new client (or none); the old client is
//!   dropped with the last request that holds it, which closes its idle connections.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::keys::KeyResolver;
use super::resolved::{Route, RouteNumbers};
use crate::config::Config;
use crate::metrics::{Metrics, RouteMetrics};
use crate::upstream::Upstream;

/// One configuration, resolved.
pub(super) struct Generation {
    pub config: Arc<Config>,
    /// The routes, in file order (first match wins).
    pub routes: Vec<Arc<Route>>,
    /// The upstream clients by name, for the next reload to reuse.
    pub upstreams: BTreeMap<String, Arc<Upstream>>,
    pub keys: Arc<KeyResolver>,
    /// The series of requests that match no route.
    pub unrouted: RouteMetrics,
}

impl Generation {
    /// Resolves `config`. With `previous`, the generation it replaces, every upstream whose
    /// settings are equal keeps its client; `numbers` gives every route its name's number.
    pub(super) fn build(
        config: Config,
        metrics: &Metrics,
        numbers: &mut RouteNumbers,
        previous: Option<&Generation>,
    ) -> Generation {
        let upstreams: BTreeMap<String, Arc<Upstream>> = config
            .upstreams
            .iter()
            .map(|(name, settings)| {
                let kept = previous.and_then(|p| {
                    let same = p.config.upstreams.get(name) == Some(settings);
                    same.then(|| p.upstreams.get(name).cloned()).flatten()
                });
                let client = kept
                    .unwrap_or_else(|| Arc::new(Upstream::new(settings, metrics.upstream(name))));
                (name.clone(), client)
            })
            .collect();
        let routes = Route::resolve_all(&config, metrics, &upstreams, numbers);
        Generation {
            keys: Arc::new(KeyResolver::new(&routes)),
            unrouted: metrics.route(""),
            config: Arc::new(config),
            routes,
            upstreams,
        }
    }
}
