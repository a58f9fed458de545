//! The per-request flow: match a route, then either pass the request through or run it under
//! idempotency — admission, the exchange, the lease, replay — in the modules named after those
//! steps.
//!
//! - [`generation`]: the configuration in force, built once (routes, upstream clients, the
//!   key tooling's [`RouteKeys`]), loaded once by each request; [`reload`] swaps in a new one,
//!   or refuses it.
//! - [`matched`]: the route a request matched, built once per configuration, and the two
//!   answers any step can give: a refusal, or the request passed through.
//! - [`keys`]: which record a key names on a route ([`RecordName`]), for the admin's key
//!   tooling.
//! - [`admission`]: the key, the body (bounded) and the fingerprint; refusals that claim nothing.
//! - [`exchange`]: the claim, the upstream call and the decision on what its answer means.
//! - [`settle`]: what an upstream call's end means for its key (save or release), the one set
//!   of rules both modes apply.
//! - [`lease`]: renewing the claim while the call runs, completing or releasing it.
//! - [`replay`]: a saved response, as the repeat gets it.
//! - [`pending`] and [`saving`]: saves retried in the background, their bounds, and
//!   the `result-not-kept` record a save past those bounds writes instead of its response.
//! - [`resolve`]: a route under `on_unknown_outcome: resolve` — its lookup, rendered before
//!   the claim, and asked of the upstream when the outcome is unknown.
//! - [`jsonrpc`]: a JSON-RPC route — a `POST` read as one message, a call of a claimed method
//!   run by the flow above under its key, its answer read (a stream event by event) for the
//!   response to the call, the proxy's own answers rendered as JSON-RPC errors.
//! - [`observe`]: a route in `mode: observe` — every request forwarded, the claim and the save
//!   run beside it and after its answer, what enforce would have answered counted.
//! - `pause` (tests' builds only, the `test-pauses` feature): a pause point between a claim
//!   and its first write, to show what a holder that stalls there does.
//!
//! The rules that keep an operation from running twice, and where they live:
//! - The claim is the only way to get permission to forward, and it is one atomic store step
//!   (`Store::claim`); nothing here checks first and acts after.
//! - Everything the proxy refuses (400, 413, 422, 409) is decided before or instead of a claim,
//!   so a refused request never holds a key.
//! - The claim, the upstream call and the save are never cancelled: they run in the
//!   request's task and move to a task of their own if the client disconnects ([`detach`]), so
//!   a client that leaves drops only its wait for the answer, never a claim half made, the call
//!   or the save, and its retry is a replay.
//! - The holder renews its lease every `lock_ttl/3` while the upstream call runs, and writes
//!   the result with a compare-and-set on its token. A holder that lost its lease (it stalled
//!   past `lock_ttl` and someone else claimed the key) cannot overwrite the newer record.
//! - A holder writes no byte of its request once the upstream's `timeout` has passed since an
//!   instant taken before its claim was sent (checked before every write, the connection reset
//!   then): a holder that stalls and wakes after another instance took its claim over writes
//!   nothing (SPEC §4.8).
//! - If the save fails because the store stalls, the client still gets the upstream's
//!   answer and the save is retried in the background for as long as the lease may still
//!   be valid. Past the pending-save bounds a save drops its response but never its lease: it
//!   saves `result-not-kept` instead, so a retry never runs the operation again.
//! - A claim answered `lock_ttl` or more after it was sent may have outlived its lease: it is
//!   released and answered 503, never forwarded.
//! - An observed route forwards every request, as if the proxy were not there (that is the
//!   point of it); what it saves follows the rules above all the same: only the holder of the
//!   claim saves, under its token, exactly what enforce would have saved.

pub mod admission;
mod context;
mod detach;
mod exchange;
mod generation;
mod grpc;
mod jsonrpc;
mod keys;
mod lease;
mod matched;
mod observe;
#[cfg(feature = "test-pauses")]
pub mod pause;
mod pending;
mod reload;
mod replay;
mod resolve;
mod saving;
mod settle;
mod webhook;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;

use http::request::Parts;
use http::{Request, Response};
use hyper::body::Incoming;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use crate::body::{self, Body};
use crate::config::{Config, Limits};
use crate::key;
use crate::metrics::{Metrics, Outcome};
use crate::problem::{HeadLimit, Problem};
use crate::route;
use crate::store::StoreHandle;
use crate::traces::{self, FutureExt as _, Traces};

use self::context::{Context, Shared};
use self::detach::{Detachable, Panicked};
use self::exchange::Exchange;
use self::generation::Generation;
use self::matched::{Answer, RouteNumbers, forward_plain, refuse};
use self::pending::PendingSaves;
use self::reload::Reloading;

pub use keys::{RecordName, RecordNameError, RouteKeys};
pub use reload::{Changes, KeyChange, Reloaded};

/// The proxy: the configuration in force (routes, upstream clients), the store, metrics, and
/// the tracker of background tasks (upstream calls and saves) that shutdown waits for.
///
/// One `Proxy` serves every worker (`workers:`, see `server::workers`): the configuration in
/// force is one `ArcSwap` that they all load, so a reload swaps it once and the next request on
/// any worker sees it. What a worker must not share with another — its upstream clients, whose
/// pooled connections run on its runtime, and its Redis or PostgreSQL connections — it finds
/// by its number: [`Generation`] holds a route table a worker, and `workers` a [`Shared`] a
/// worker.
pub struct Proxy {
    /// The configuration in force, built. Each request loads it once (one atomic load, no
    /// lock on the hot path); a reload swaps in a whole new one.
    current: ArcSwap<Generation>,
    /// What reloads carry over (route numbers) and who hears of them; locked by reloads only.
    reloading: Mutex<Reloading>,
    /// Per worker, what its exchanges share: its store handle, and the background work that
    /// every worker shares (one tracker, one set of pending saves). Never empty.
    workers: Box<[Arc<Shared>]>,
    metrics: Arc<Metrics>,
    /// Set when shutdown starts: readiness answers 503 from then on.
    draining: AtomicBool,
    /// The tracer (`tracing:`); `None`: nothing is recorded, and nothing is spent on it.
    traces: Option<Traces>,
}

/// Logs what a configuration about to be served does that may not be meant
/// ([`Config::warnings`]): at start, and for each file a reload applies.
fn warn_about(config: &Config) {
    for warning in config.warnings() {
        tracing::warn!(
            route = %warning.route,
            field = %warning.path,
            "configuration: {}",
            warning.message
        );
    }
}

impl Proxy {
    /// Builds the proxy over a store, for one worker: builds every route's upstream, policy
    /// and metrics.
    pub fn new(config: Config, store: StoreHandle, metrics: Arc<Metrics>) -> Proxy {
        Proxy::with_workers(config, store, Vec::new(), metrics)
    }

    /// Builds the proxy for `1 + more.len()` workers: worker 0 uses `first`, worker `i` uses
    /// `more[i - 1]` (for a store every worker shares, each is a handle on the same backend).
    /// Every worker gets a client of its own for each upstream.
    pub(crate) fn with_workers(
        config: Config,
        first: StoreHandle,
        more: Vec<StoreHandle>,
        metrics: Arc<Metrics>,
    ) -> Proxy {
        warn_about(&config);
        let mut numbers = RouteNumbers::default();
        let limits = config.limits;
        let tasks = TaskTracker::new();
        let pending = Arc::new(PendingSaves::new(
            limits.max_pending_saves,
            limits.max_pending_save_bytes,
            metrics.pending_saves.clone(),
            metrics.pending_save_bytes.clone(),
        ));
        let answered = Arc::new(context::Answered::default());
        let workers: Box<[Arc<Shared>]> = std::iter::once(first)
            .chain(more)
            .map(|store| {
                Arc::new(Shared {
                    store,
                    tasks: tasks.clone(),
                    pending: pending.clone(),
                    detached: metrics.detached_exchanges.clone(),
                    answered: answered.clone(),
                    resolutions: metrics.resolutions_running(),
                    deferred: metrics.resolutions_deferred(),
                })
            })
            .collect();
        let generation = Generation::build(config, &metrics, &mut numbers, None, workers.len());
        Proxy {
            current: ArcSwap::from_pointee(generation),
            reloading: Mutex::new(Reloading::new(numbers)),
            workers,
            metrics,
            draining: AtomicBool::new(false),
            traces: None,
        }
    }

    /// The tracer, if requests are traced.
    pub(crate) fn traces(&self) -> Option<&Traces> {
        self.traces.as_ref()
    }

    /// The proxy with requests traced by `traces`.
    pub(crate) fn traced(mut self, traces: Option<Traces>) -> Proxy {
        self.traces = traces;
        self
    }

    /// How many workers it serves.
    pub fn workers(&self) -> usize {
        self.workers.len()
    }

    /// What worker `worker`'s exchanges share (worker 0's for a number past the last, which
    /// no caller of the crate passes).
    fn worker(&self, worker: usize) -> &Arc<Shared> {
        &self.workers[worker.min(self.workers.len() - 1)]
    }

    /// Marks the start of the drain (readiness answers 503 from then on).
    pub(crate) fn start_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// Whether the drain has started.
    pub(crate) fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// The Prometheus text the admin listener serves at `/metrics`.
    pub fn encode_metrics(&self) -> String {
        self.metrics.encode()
    }

    /// The store keys of the idempotent routes in force, as the key tooling names records.
    pub fn keys(&self) -> Arc<RouteKeys> {
        self.current.load().keys.clone()
    }

    /// The background tasks (upstream calls, saves) that must finish before the process
    /// exits.
    pub(crate) fn tasks(&self) -> &TaskTracker {
        &self.worker(0).tasks
    }

    /// Logs the keys whose results are still unsaved (at shutdown, after the drain).
    pub(crate) fn log_pending_saves(&self) {
        self.worker(0).pending.log_pending();
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Worker 0's store: the one the admin listener (on worker 0) uses. With Redis or
    /// PostgreSQL every worker has connections of its own to the same database.
    pub fn store(&self) -> &StoreHandle {
        &self.worker(0).store
    }

    /// Every worker's store, in worker order: with Redis or PostgreSQL each worker has
    /// connections of its own, and readiness asks all of them.
    pub(crate) fn stores(&self) -> impl Iterator<Item = &StoreHandle> {
        self.workers.iter().map(|w| &w.store)
    }

    /// The configuration in force.
    pub(crate) fn config(&self) -> Arc<Config> {
        self.current.load().config.clone()
    }

    /// Handles one request on worker `worker` (the runtime it runs on: its upstream clients
    /// and store connections are that worker's). Never fails: every failure is an HTTP answer.
    pub(crate) async fn handle(
        self: &Arc<Self>,
        mut req: Request<Incoming>,
        client: SocketAddr,
        worker: usize,
    ) -> Response<Body> {
        let start = Instant::now();
        // Once per request: whatever a reload swaps in meanwhile, this request is served to
        // its end by the configuration it arrived under.
        let generation = self.current.load_full();
        let shared = self.worker(worker);
        let method = req.method().clone();
        let uri = req.uri().clone();
        let Some(route) = route::find(
            generation.routes(worker),
            |r| &r.settings,
            generation.webhooks,
            &method,
            uri.path(),
        ) else {
            generation
                .unrouted
                .request(Outcome::NoRoute, start.elapsed());
            tracing::debug!(%method, path = uri.path(), "no route");
            return Problem::NoRoute.response();
        };
        // Only with `tracing:` and a recorded request: its span, and the context its future
        // runs in (an unrecorded one only has its `traceparent` rewritten for the upstream).
        let traced = self
            .traces
            .as_ref()
            .and_then(|traces| traces.request(req.headers_mut(), &method, &route.settings.name));
        let (parts, incoming) = req.into_parts();
        let limits = generation.config.limits;
        let answering = async {
            match &route.idempotency {
                None => {
                    let body = body_with_deadline(incoming, &limits);
                    forward_plain(route, parts, body, client, None).await
                }
                Some(policy) => {
                    let context = Arc::new(Context {
                        route: route.clone(),
                        policy: policy.clone(),
                        shared: shared.clone(),
                        client,
                        limits,
                        start,
                    });
                    self.idempotent(context, parts, incoming).await
                }
            }
        };
        let (resp, outcome) = match &traced {
            None => answering.await,
            Some(cx) => answering.with_context(cx.clone()).await,
        };
        let took = start.elapsed();
        route.metrics.request(outcome, took);
        if let Some(cx) = &traced {
            end_span(cx, &resp, outcome);
        }
        // One event per request: never the raw key, a scope value or a body; the key's hash
        // is what the admin key tooling takes.
        tracing::info!(
            route = %route.settings.name,
            %method,
            path = uri.path(),
            status = resp.status().as_u16(),
            outcome = outcome.as_str(),
            key = resp.extensions().get::<KeyHash>().map(tracing::field::display),
            key_source = resp
                .extensions()
                .get::<KeyHash>()
                .map(|k| k.origin.as_str()),
            delivery = resp
                .extensions()
                .get::<webhook::DeliveryLabel>()
                .map(|l| tracing::field::display(l.0.escape_debug())),
            took_ms = took.as_secs_f64() * 1000.0,
            "request"
        );
        resp
    }

    /// The answer to a request whose head is over the proxy's limits, refused before any step
    /// of the flow: in the terms of the route it came for, found first (on a `grpc:` route a
    /// gRPC call gets `INVALID_ARGUMENT`, SPEC §4.11), problem+json on any other.
    pub(crate) fn refuse_head<B>(
        &self,
        req: &Request<B>,
        limit: HeadLimit,
        worker: usize,
    ) -> Response<Body> {
        let problem = Problem::HeadersTooLarge { limit };
        let generation = self.current.load();
        let route = route::find(
            generation.routes(worker),
            |r| &r.settings,
            generation.webhooks,
            req.method(),
            req.uri().path(),
        );
        match route {
            Some(route) => grpc::refusal(route, req.method(), req.headers(), &problem),
            None => problem.response(),
        }
    }

    /// A request on an idempotent route: admitted (or refused, or passed through without a
    /// key), then claimed and run to its end whether or not the client stays.
    async fn idempotent(&self, context: Arc<Context>, parts: Parts, incoming: Incoming) -> Answer {
        let Context {
            route,
            client,
            limits,
            ..
        } = &*context;
        if let Some(settings) = &route.settings.webhook {
            return self.webhook(&context, settings, parts, incoming).await;
        }
        if let Some(settings) = &route.settings.jsonrpc {
            return self.jsonrpc(&context, settings, parts, incoming).await;
        }
        if route.settings.grpc.is_some() {
            return self.grpc(&context, parts, incoming).await;
        }
        if let Some(observed) = &route.observed {
            let req = Request::from_parts(parts, incoming);
            return self.observed(&context, observed, req).await;
        }
        let admitted = match admission::admit(&context, parts, incoming).await {
            admission::Admission::Admitted(a) => a,
            admission::Admission::NoKey(parts, incoming) => {
                let body = body_with_deadline(incoming, limits);
                return forward_plain(route, parts, body, *client, None).await;
            }
            admission::Admission::Refused(problem, outcome) => return refuse(problem, outcome),
        };
        self.run_admitted(context, admitted).await
    }

    /// An admitted request on an enforced route: claimed and run to its end whether or not the
    /// client stays.
    async fn run_admitted(&self, context: Arc<Context>, admitted: admission::Admitted) -> Answer {
        let Context {
            route,
            shared,
            limits,
            ..
        } = &*context;
        // Exchanges that outlive their clients cost memory and upstream capacity with nobody
        // waiting; past the bound, refuse before anything is claimed.
        if self.metrics.detached_exchanges.get() >= i64::from(limits.max_detached_exchanges) {
            tracing::warn!(route = %route.name, "too many exchanges running after their clients left: 503");
            return refuse(Problem::Overloaded, Outcome::Overloaded);
        }
        // Saves that could not be kept whole still hold their keys (and a little memory) until
        // the store takes their result-not-kept records; at their bound, claim nothing more.
        if shared.pending.is_saturated() {
            tracing::warn!(route = %route.name, "too many results waiting for the store to take them: 503");
            return refuse(Problem::Overloaded, Outcome::Overloaded);
        }
        // From the claim on, nothing is cancelled: a client that goes away cancels neither a
        // claim in flight (which would leave the key blocked until its lease expired) nor the
        // upstream call and the save (its retry gets a replay).
        let (attachment, ended, watch) = detach::guards(self.metrics.detached_exchanges.clone());
        let key_hash = KeyHash {
            id: *admitted.key.id(),
            origin: admitted.origin,
        };
        if admitted.origin == admission::KeyOrigin::Derived {
            route.metrics.derived_key();
        }
        let exchange = Exchange::new(context.clone(), admitted, attachment);
        // Run here, in the request's task (no spawn, no hop to another thread); if the client
        // leaves first, the exchange moves to a task of its own and runs to its end. Either
        // way shutdown waits for it (the tracker).
        let traced = traces::current();
        let exchange = Detachable::new(shared.tasks.track_future(async move {
            let _ended = ended;
            match traced {
                None => exchange.claim_and_run().await,
                Some(cx) => exchange.claim_and_run().with_context(cx).await,
            }
        }));
        // Dropped with this future when the client leaves: counts the exchange as detached.
        let _watch = watch;
        let (mut resp, outcome) = answer_of(exchange.await, &route.name, context.start);
        // For the request log (extensions are never sent).
        resp.extensions_mut().insert(key_hash);
        (resp, outcome)
    }
}

/// Ends a traced request's span with what became of it.
fn end_span(cx: &opentelemetry::Context, resp: &Response<Body>, outcome: Outcome) {
    let ending = traces::Ending {
        status: resp.status().as_u16(),
        outcome: outcome.as_str(),
        replayed: outcome == Outcome::Replayed,
        resolved: resp.headers().contains_key(&replay::RESOLVED),
        key: resp.extensions().get::<KeyHash>().map(|k| &k.id[..]),
    };
    traces::end_request(cx, &ending);
}

/// A client's streamed request body, cut off at `limits.body_read_timeout`, its failures
/// marked as the client's.
fn body_with_deadline(incoming: Incoming, limits: &Limits) -> Body {
    body::from_client(body::boxed(incoming), limits.body_read_timeout)
}

/// The answer of an exchange. One that ended without an answer (a panic) is the proxy's own
/// failure, a 500 of its own type: not an upstream error, which would tell the client the
/// upstream may have acted.
fn answer_of(ended: Result<Answer, Panicked>, route: &str, start: Instant) -> Answer {
    ended.unwrap_or_else(|Panicked(e)| {
        let took_ms = start.elapsed().as_secs_f64() * 1000.0;
        tracing::error!(route, error = %e, took_ms, "the exchange ended without an answer");
        refuse(Problem::Internal, Outcome::Internal)
    })
}

/// The hash of a request's key, and where the key came from, carried in its response's
/// extensions to the request log.
#[derive(Debug, Clone, Copy)]
struct KeyHash {
    id: key::KeyId,
    origin: admission::KeyOrigin,
}

impl std::fmt::Display for KeyHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&hex::encode(self.id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn a_dead_exchange_is_an_internal_error_not_an_upstream_failure() {
        let ended = Detachable::new(async {
            if true {
                panic!("the exchange failed inside");
            }
            refuse(Problem::NoRoute, Outcome::NoRoute)
        })
        .await;
        let (resp, outcome) = answer_of(ended, "r", Instant::now());
        assert_eq!(outcome, Outcome::Internal);
        assert_eq!(resp.status(), http::StatusCode::INTERNAL_SERVER_ERROR);
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        let doc: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
        assert_eq!(doc["type"], "urn:idemproxy:problem:internal-error");
    }
}
