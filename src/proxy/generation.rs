//! One configuration as the proxy serves it — a *generation*: the compiled route table, the
//! upstream clients and the key tooling's route keys, built from one validated file, and swapped in whole
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
//! - An upstream whose settings are unchanged keeps its clients, and with them their pooled
//!   connections. A changed or removed one gets new clients (or none); the old ones are
//!   dropped with the last request that holds them, which closes their idle connections.
//!
//! Each worker has a client of its own for every upstream ([`Table`]): a pooled connection's
//! task runs on the runtime that opened it, so a worker that borrowed another's connection
//! would hop threads on every request, and lose it when that worker stopped. A generation
//! holds one route table a worker, each over that worker's clients; every worker loads the
//! same generation, so a reload reaches all of them at once.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::keys::RouteKeys;
use super::matched::{Route, RouteNumbers};
use crate::config::Config;
use crate::metrics::{Metrics, RouteKind, RouteMetrics};
use crate::upstream::Upstream;

/// One configuration, built for serving.
pub(super) struct Generation {
    pub config: Arc<Config>,
    /// Per worker, its routes and upstream clients. Never empty.
    pub tables: Box<[Table]>,
    pub keys: Arc<RouteKeys>,
    /// The series of requests that match no route.
    pub unrouted: RouteMetrics,
    /// Whether any route is a webhook route: only then is a request's path normalised to
    /// find its route (`route::find`).
    pub webhooks: bool,
}

/// One worker's routes, over its own upstream clients.
pub(super) struct Table {
    /// The routes, in file order (first match wins).
    pub routes: Vec<Arc<Route>>,
    /// The upstream clients by name, for the next reload to reuse.
    pub upstreams: BTreeMap<String, Arc<Upstream>>,
}

impl Generation {
    /// Resolves `config` for `workers` workers (at least one). With `previous`, the generation
    /// it replaces, every upstream whose settings are equal keeps each worker's client;
    /// `numbers` gives every route its name's number.
    pub(super) fn build(
        config: Config,
        metrics: &Metrics,
        numbers: &mut RouteNumbers,
        previous: Option<&Generation>,
        workers: usize,
    ) -> Generation {
        let tables: Box<[Table]> = (0..workers.max(1))
            .map(|worker| {
                let before = previous.and_then(|p| p.tables.get(worker).map(|t| (p, t)));
                Table::build(&config, metrics, numbers, before)
            })
            .collect();
        let keys = Arc::new(RouteKeys::new(
            tables.first().map_or(&[][..], |t| &t.routes),
        ));
        Generation {
            webhooks: config.routes.iter().any(|r| r.webhook.is_some()),
            keys,
            unrouted: metrics.route_of("", RouteKind::Unrouted),
            config: Arc::new(config),
            tables,
        }
    }

    /// Worker `worker`'s routes.
    pub(super) fn routes(&self, worker: usize) -> &[Arc<Route>] {
        self.tables
            .get(worker)
            .or_else(|| self.tables.first())
            .map_or(&[], |t| &t.routes)
    }
}

impl Table {
    /// One worker's table; `previous` is the generation replaced and that worker's table in it.
    fn build(
        config: &Config,
        metrics: &Metrics,
        numbers: &mut RouteNumbers,
        previous: Option<(&Generation, &Table)>,
    ) -> Table {
        let upstreams: BTreeMap<String, Arc<Upstream>> = config
            .upstreams
            .iter()
            .map(|(name, settings)| {
                let kept = previous.and_then(|(p, table)| {
                    let same = p.config.upstreams.get(name) == Some(settings);
                    same.then(|| table.upstreams.get(name).cloned()).flatten()
                });
                let client = kept
                    .unwrap_or_else(|| Arc::new(Upstream::new(settings, metrics.upstream(name))));
                (name.clone(), client)
            })
            .collect();
        // The same numbers for every worker: a name's number is given once, by the first.
        let routes = Route::build_all(config, metrics, &upstreams, numbers);
        Table { routes, upstreams }
    }
}
