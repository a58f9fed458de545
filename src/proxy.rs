//! The per-request flow: match → key → body → fingerprint → claim → forward and save | replay |
//! refuse.
//!
//! The rules that keep an operation from running twice, and where they live:
//! - The claim is the only way to get permission to forward, and it is one atomic store step
//!   (`Store::claim`); nothing here checks first and acts after.
//! - Everything the proxy refuses (400, 413, 422, 409) is decided before or instead of a claim,
//!   so a refused request never holds a key.
//! - The claim, the upstream call and the save run in a task of their own: a client that
//!   disconnects drops only its wait for the answer, never a claim half made, the call or the
//!   save, so its retry is a replay.
//! - The holder renews its lease every `lock_ttl/3` while the upstream call runs, and writes
//!   the result with a compare-and-set on its token. A holder that lost its lease (it stalled
//!   past `lock_ttl` and someone else claimed the key) cannot overwrite the newer record.
//! - If the save fails because the store stalls, the client still gets the upstream's answer
//!   and the save is retried in the background for as long as the lease may still be valid.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::request::Parts;
use http::{Request, Response};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use crate::body::{self, Body};
use crate::config::{
    Config, IdempotencySettings, OnConflict, OnStoreError, OnUnknownOutcome, RouteSettings,
};
use crate::fingerprint;
use crate::key::{self, KeyError};
use crate::metrics::{Metrics, Outcome};
use crate::problem::Problem;
use crate::record::{Entry, Outcome as Saved, SavedResponse, new_token};
use crate::store::{Claim, Held, StoreError, StoreHandle};
use crate::upstream::{self, Bounded, Upstream, UpstreamError};

/// The header added to every replayed response.
pub const REPLAYED: &str = "idempotent-replayed";

/// How long a 409 asks the client to wait (`Retry-After`).
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// `on_conflict: wait` looks again after this long at first, doubling up to
/// [`MAX_WAIT_POLL`] (the memory store wakes waiters at once instead).
const FIRST_WAIT_POLL: Duration = Duration::from_millis(10);
const MAX_WAIT_POLL: Duration = Duration::from_millis(200);

/// A route with its upstream resolved.
struct Route {
    settings: RouteSettings,
    upstream: Arc<Upstream>,
}

/// The proxy: routes, upstream clients, the store, metrics, and the tracker of background
/// tasks (upstream calls and saves) that shutdown waits for.
pub struct Proxy {
    config: Config,
    routes: Vec<Route>,
    store: StoreHandle,
    metrics: Arc<Metrics>,
    tasks: TaskTracker,
}

/// What a handler produced: the response and the outcome to count and log.
type Answer = (Response<Body>, Outcome);

fn refuse(p: Problem, outcome: Outcome) -> Answer {
    (p.response(), outcome)
}

impl Proxy {
    /// Builds the proxy over a store.
    pub fn new(config: Config, store: StoreHandle, metrics: Arc<Metrics>) -> Proxy {
        let upstreams: std::collections::BTreeMap<String, Arc<Upstream>> = config
            .upstreams
            .iter()
            .map(|(name, s)| (name.clone(), Arc::new(Upstream::new(s))))
            .collect();
        let routes = config
            .routes
            .routes()
            .iter()
            .filter_map(|r| {
                // Validation guarantees every route's upstream exists.
                upstreams.get(&r.upstream).map(|u| Route {
                    settings: r.clone(),
                    upstream: u.clone(),
                })
            })
            .collect();
        Proxy {
            config,
            routes,
            store,
            metrics,
            tasks: TaskTracker::new(),
        }
    }

    /// The background tasks (upstream calls, saves) that must finish before the process exits.
    pub fn tasks(&self) -> &TaskTracker {
        &self.tasks
    }

    /// The metrics.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The store.
    pub fn store(&self) -> &StoreHandle {
        &self.store
    }

    /// The configuration in force.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Handles one request. Never fails: every failure is an HTTP answer.
    pub async fn handle(
        self: &Arc<Self>,
        req: Request<Incoming>,
        client: SocketAddr,
    ) -> Response<Body> {
        let start = Instant::now();
        let method = req.method().clone();
        let path = req.uri().path().to_owned();
        let Some(index) = self.config.routes.find(&method, &path) else {
            self.metrics.request("", Outcome::NoRoute, start.elapsed());
            tracing::debug!(%method, %path, "no route");
            return Problem::NoRoute.response();
        };
        let route = &self.routes[index];
        let (resp, outcome) = match &route.settings.idempotency {
            None => self.passthrough(route, req, client).await,
            Some(idem) => self.idempotent(index, idem, req, client).await,
        };
        let took = start.elapsed();
        self.metrics.request(&route.settings.name, outcome, took);
        tracing::info!(
            route = %route.settings.name,
            %method,
            %path,
            status = resp.status().as_u16(),
            outcome = outcome.as_str(),
            took_ms = took.as_secs_f64() * 1000.0,
            "request"
        );
        resp
    }

    /// A plain proxied request: streamed both ways.
    async fn passthrough(
        &self,
        route: &Route,
        req: Request<Incoming>,
        client: SocketAddr,
    ) -> Answer {
        let (parts, incoming) = req.into_parts();
        self.forward_plain(
            route,
            &parts,
            body::boxed(incoming),
            client,
            Outcome::Passthrough,
        )
        .await
    }

    async fn forward_plain(
        &self,
        route: &Route,
        parts: &Parts,
        body: Body,
        client: SocketAddr,
        outcome: Outcome,
    ) -> Answer {
        let up = &route.upstream;
        let req = match up.request(parts, body, client, None) {
            Ok(r) => r,
            Err(e) => return self.upstream_failure(up, e),
        };
        let start = Instant::now();
        let result = up.send(req).await;
        self.metrics.upstream(up.name(), start.elapsed());
        match result {
            Ok(resp) => (resp, outcome),
            Err(e) => self.upstream_failure(up, e),
        }
    }

    fn upstream_failure(&self, up: &Upstream, e: UpstreamError) -> Answer {
        tracing::warn!(upstream = up.name(), error = %e, "upstream call failed");
        refuse(unknown_problem(up, &e), Outcome::UpstreamError)
    }

    async fn idempotent(
        self: &Arc<Self>,
        route_index: usize,
        idem: &IdempotencySettings,
        req: Request<Incoming>,
        client: SocketAddr,
    ) -> Answer {
        let route = &self.routes[route_index];
        let (parts, incoming) = req.into_parts();
        let raw_key = match key::from_headers(&parts.headers, &idem.header) {
            Ok(k) => k,
            Err(KeyError::Missing(_)) if !idem.required => {
                return self
                    .forward_plain(
                        route,
                        &parts,
                        body::boxed(incoming),
                        client,
                        Outcome::Passthrough,
                    )
                    .await;
            }
            Err(KeyError::Missing(header)) => {
                return refuse(Problem::MissingKey { header }, Outcome::MissingKey);
            }
            Err(e) => {
                return refuse(
                    Problem::InvalidKey {
                        detail: e.to_string(),
                    },
                    Outcome::InvalidKey,
                );
            }
        };
        let body = match read_body(&parts, incoming, idem.max_request_body).await {
            Ok(b) => b,
            Err(p) => {
                let outcome = if matches!(p, Problem::BodyTooLarge { .. }) {
                    Outcome::TooLarge
                } else {
                    Outcome::BadRequest
                };
                return refuse(p, outcome);
            }
        };
        let fp = fingerprint::compute(&idem.fingerprint, &parts, &body);
        let store_key = key::store_key(
            &self.config.store.key_prefix,
            &route.settings.name,
            &idem.scope,
            &parts.headers,
            &raw_key,
        );
        let held = Held::new(Entry::InFlight {
            token: new_token(),
            fingerprint: fp,
        });
        // From the claim on, everything runs in a task of its own: a client that goes away
        // can cancel neither a claim in flight (which would leave the key blocked until its
        // lease expired) nor the upstream call and the save (its retry gets a replay).
        let (tx, rx) = oneshot::channel();
        let job = Exchange {
            proxy: self.clone(),
            route_index,
            parts,
            body,
            client,
            store_key,
            held,
        };
        self.tasks.spawn(async move {
            // The client may be gone; the result is saved either way.
            let _ = tx.send(job.claim_and_run().await);
        });
        match rx.await {
            Ok(answer) => answer,
            Err(_) => {
                tracing::error!(route = %route.settings.name, "exchange task ended without an answer");
                refuse(
                    Problem::UpstreamFailed {
                        upstream: route.upstream.name().to_owned(),
                        detail: "internal error".into(),
                    },
                    Outcome::UpstreamError,
                )
            }
        }
    }

    async fn store_failure(
        &self,
        route: &Route,
        idem: &IdempotencySettings,
        parts: &Parts,
        body: Bytes,
        client: SocketAddr,
        e: StoreError,
    ) -> Answer {
        // An undecodable record means an operation may have run under this key: forwarding
        // could run it twice, whatever `on_store_error` says.
        let policy = if matches!(e, StoreError::Corrupt(_)) {
            OnStoreError::Reject
        } else {
            idem.on_store_error
        };
        match policy {
            OnStoreError::Reject => {
                tracing::warn!(route = %route.settings.name, error = %e, "store error: 503");
                refuse(
                    Problem::StoreUnavailable {
                        detail: e.to_string(),
                    },
                    Outcome::StoreError,
                )
            }
            OnStoreError::Forward => {
                tracing::warn!(
                    route = %route.settings.name,
                    error = %e,
                    "store error: forwarding WITHOUT idempotency (on_store_error: forward)"
                );
                self.metrics.unprotected(&route.settings.name);
                let (resp, _) = self
                    .forward_plain(route, parts, body::full(body), client, Outcome::StoreError)
                    .await;
                (resp, Outcome::StoreError)
            }
        }
    }
}

/// Reads the request body, refusing more than `limit` bytes (413) before anything is claimed.
async fn read_body(parts: &Parts, incoming: Incoming, limit: u64) -> Result<Bytes, Problem> {
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(Problem::BodyTooLarge { limit });
    }
    let limited = Limited::new(incoming, usize::try_from(limit).unwrap_or(usize::MAX));
    match limited.collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            Err(Problem::BodyTooLarge { limit })
        }
        Err(e) => Err(Problem::BadRequestBody {
            detail: upstream::error_chain(e.as_ref()),
        }),
    }
}

/// The answer to a repeat of a finished operation.
fn replay(outcome: Saved) -> Answer {
    match outcome {
        Saved::Response(saved) => {
            let mut resp = response_of(saved);
            resp.headers_mut()
                .insert(REPLAYED, HeaderValue::from_static("true"));
            (resp, Outcome::Replayed)
        }
        Saved::NotReplayable { status } => {
            refuse(Problem::NotReplayable { status }, Outcome::NotReplayable)
        }
    }
}

/// A response made of saved parts; `Content-Length` follows the body.
fn response_of(saved: SavedResponse) -> Response<Body> {
    let len = saved.body.len();
    let mut resp = Response::new(body::full(saved.body));
    *resp.status_mut() = saved.status;
    let headers = resp.headers_mut();
    for (name, value) in saved.headers {
        headers.append(name, value);
    }
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    resp
}

/// The problem answered (and, with `keep`, saved) for an upstream failure.
fn unknown_problem(up: &Upstream, e: &UpstreamError) -> Problem {
    match e {
        UpstreamError::Connect(detail) => Problem::UpstreamUnavailable {
            upstream: up.name().to_owned(),
            detail: detail.clone(),
        },
        UpstreamError::Timeout(_) => Problem::UpstreamTimeout {
            upstream: up.name().to_owned(),
        },
        UpstreamError::Failed(detail) => Problem::UpstreamFailed {
            upstream: up.name().to_owned(),
            detail: detail.clone(),
        },
    }
}

/// The headers saved for replay: everything end-to-end except `Content-Length` (it follows the
/// replayed body) and, unless `replay_set_cookie`, `Set-Cookie`. Hop-by-hop headers were
/// already removed.
fn saved_headers(
    headers: &http::HeaderMap,
    idem: &IdempotencySettings,
) -> Vec<(http::HeaderName, HeaderValue)> {
    headers
        .iter()
        .filter(|(name, _)| {
            *name != header::CONTENT_LENGTH
                && (idem.replay_set_cookie || *name != header::SET_COOKIE)
        })
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect()
}

/// One claimed request: forward it, keep the lease alive meanwhile, save the result.
struct Exchange {
    proxy: Arc<Proxy>,
    route_index: usize,
    parts: Parts,
    body: Bytes,
    client: SocketAddr,
    store_key: String,
    held: Held,
}

impl Exchange {
    /// Claims the key — or replays, refuses, or waits, per what the claim finds — and runs the
    /// exchange when the claim is ours.
    async fn claim_and_run(self) -> Answer {
        let proxy = self.proxy.clone();
        let route = &proxy.routes[self.route_index];
        let Some(idem) = route.settings.idempotency.as_ref() else {
            // Unreachable: only idempotent routes get here.
            return refuse(Problem::NoRoute, Outcome::NoRoute);
        };
        let fp = *self.held.entry.fingerprint();
        let wait_until = Instant::now() + idem.wait_timeout;
        let mut poll = FIRST_WAIT_POLL;
        loop {
            let claim = proxy
                .store
                .claim(&self.store_key, &self.held, idem.lock_ttl)
                .await;
            let existing = match claim {
                Ok(Claim::Claimed) => return self.run().await,
                Ok(Claim::Existing(entry)) => entry,
                Err(e) => {
                    return proxy
                        .store_failure(route, idem, &self.parts, self.body, self.client, e)
                        .await;
                }
            };
            // The mismatch check comes first, in flight or finished.
            if *existing.fingerprint() != fp {
                return refuse(Problem::KeyReused, Outcome::Mismatch);
            }
            match existing {
                Entry::Done { outcome, .. } => return replay(outcome),
                Entry::InFlight { .. } => {
                    let now = Instant::now();
                    if idem.on_conflict == OnConflict::Reject || now >= wait_until {
                        return refuse(
                            Problem::InProgress {
                                retry_after: RETRY_AFTER,
                            },
                            Outcome::Conflict,
                        );
                    }
                    // Wait for the holder to finish, then claim again: a released or expired
                    // claim is taken by this request, a finished one is replayed. Stores
                    // that cannot wake us (Redis: the holder may be another instance) are
                    // polled, backing off so a thousand waiters do not flood them.
                    proxy
                        .store
                        .wait_change(&self.store_key, poll.min(wait_until - now))
                        .await;
                    poll = (poll * 2).min(MAX_WAIT_POLL);
                }
            }
        }
    }

    /// Forwards the claimed request, keeping the lease alive, and saves the result.
    async fn run(self) -> Answer {
        let proxy = self.proxy.clone();
        let route = &proxy.routes[self.route_index];
        let Some(idem) = route.settings.idempotency.as_ref() else {
            // Unreachable: only idempotent routes claim.
            return refuse(Problem::NoRoute, Outcome::NoRoute);
        };
        let up = &route.upstream;
        let lease = Lease::start(
            &proxy,
            &route.settings.name,
            self.store_key.clone(),
            self.held.clone(),
            idem.lock_ttl,
        );
        let drop_key = (!idem.forward_key).then_some(&idem.header);
        let req = up.request(
            &self.parts,
            body::full(self.body.clone()),
            self.client,
            drop_key,
        );
        let start = Instant::now();
        let result = match req {
            Ok(req) => up.call_bounded(req, idem.max_response_body).await,
            Err(e) => Err(e),
        };
        proxy.metrics.upstream(up.name(), start.elapsed());

        match result {
            Ok((parts, Bounded::Complete(bytes))) => {
                let status = parts.status.as_u16();
                if idem.retry_statuses.contains(&status) {
                    // Not the operation's result: free the key so that a retry runs again.
                    lease.release().await;
                    let mut resp = Response::from_parts(parts, body::full(bytes));
                    resp.headers_mut().remove(header::CONTENT_LENGTH);
                    return (resp, Outcome::Forwarded);
                }
                let saved = SavedResponse {
                    status: parts.status,
                    headers: saved_headers(&parts.headers, idem),
                    body: bytes.clone(),
                };
                lease
                    .save(self.done(Saved::Response(saved)), idem.ttl)
                    .await;
                let mut resp = Response::from_parts(parts, body::full(bytes));
                // The first response carries exactly the length of the body it has.
                resp.headers_mut().remove(header::CONTENT_LENGTH);
                (resp, Outcome::Forwarded)
            }
            Ok((parts, Bounded::Over { prefix, rest })) => {
                let status = parts.status;
                if idem.retry_statuses.contains(&status.as_u16()) {
                    lease.release().await;
                } else {
                    tracing::warn!(
                        route = %route.settings.name,
                        limit = idem.max_response_body,
                        "response larger than max_response_body: it reaches this client but cannot be replayed"
                    );
                    lease
                        .save(self.done(Saved::NotReplayable { status }), idem.ttl)
                        .await;
                }
                (
                    Response::from_parts(parts, upstream::chain(prefix, rest)),
                    Outcome::Forwarded,
                )
            }
            Err(e @ UpstreamError::Connect(_)) => {
                // Nothing was sent: the operation did not happen; free the key.
                tracing::warn!(route = %route.settings.name, upstream = up.name(), error = %e, "upstream connect failed; claim released");
                lease.release().await;
                refuse(unknown_problem(up, &e), Outcome::UpstreamError)
            }
            Err(e) => {
                let problem = unknown_problem(up, &e);
                match idem.on_unknown_outcome {
                    OnUnknownOutcome::Keep => {
                        tracing::warn!(route = %route.settings.name, upstream = up.name(), error = %e,
                            "outcome unknown; saving {} as the key's result (on_unknown_outcome: keep)", problem.status().as_u16());
                        lease
                            .save(self.done(Saved::Response(problem.saved())), idem.ttl)
                            .await;
                    }
                    OnUnknownOutcome::Release => {
                        tracing::warn!(route = %route.settings.name, upstream = up.name(), error = %e,
                            "outcome unknown; claim released (on_unknown_outcome: release)");
                        lease.release().await;
                    }
                }
                refuse(problem, Outcome::UpstreamError)
            }
        }
    }

    fn done(&self, outcome: Saved) -> Entry {
        Entry::Done {
            fingerprint: *self.held.entry.fingerprint(),
            outcome,
        }
    }
}

/// A held claim: renews itself every `lock_ttl/3` until it is saved or released, and knows
/// until when it may still be valid.
struct Lease {
    inner: Arc<LeaseInner>,
    tasks: TaskTracker,
    renewer: tokio::task::JoinHandle<()>,
}

struct LeaseInner {
    store: StoreHandle,
    metrics: Arc<Metrics>,
    route: String,
    key: String,
    held: Held,
    lock_ttl: Duration,
    /// Until when the lease is surely valid: the send time of the last successful claim or
    /// renewal plus `lock_ttl` (the send time, not the answer time, so it is never optimistic).
    valid_until: std::sync::Mutex<Instant>,
    /// Set once the lease is known lost, so it is logged and counted once.
    lost: AtomicBool,
}

impl Drop for Lease {
    fn drop(&mut self) {
        // However the exchange ends (even by a panic), stop renewing: an orphaned renewer
        // would keep the key blocked forever.
        self.renewer.abort();
    }
}

impl Lease {
    fn start(proxy: &Proxy, route: &str, key: String, held: Held, lock_ttl: Duration) -> Lease {
        let inner = Arc::new(LeaseInner {
            store: proxy.store.clone(),
            metrics: proxy.metrics.clone(),
            route: route.to_owned(),
            key,
            held,
            lock_ttl,
            // The claim was sent just before this; `now` is optimistic by at most one round
            // trip, which the first renewal (at a third of the lease) more than covers.
            valid_until: std::sync::Mutex::new(Instant::now() + lock_ttl),
            lost: AtomicBool::new(false),
        });
        let renewer = tokio::spawn(inner.clone().renew_every_third());
        Lease {
            inner,
            tasks: proxy.tasks.clone(),
            renewer,
        }
    }

    /// Frees the key (owner only).
    async fn release(self) {
        self.renewer.abort();
        let l = &self.inner;
        match l.store.release(&l.key, &l.held).await {
            Ok(true) => {}
            Ok(false) => l.mark_lost("the claim was gone before release"),
            // The claim will expire within lock_ttl; until then repeats get 409.
            Err(e) => tracing::warn!(
                route = %l.route,
                error = %e,
                "release failed; the claim expires within lock_ttl"
            ),
        }
    }

    /// Saves the finished entry with a compare-and-set on the token. If the store fails, the
    /// save goes on in the background while the lease may still be valid; the caller answers
    /// the client at once either way.
    async fn save(self, done: Entry, ttl: Duration) {
        self.renewer.abort();
        let l = self.inner.clone();
        match l.store.complete(&l.key, &l.held, &done, ttl).await {
            Ok(true) => {}
            Ok(false) => l.lost_or_saved(&done).await,
            Err(e) => {
                tracing::warn!(
                    route = %l.route,
                    error = %e,
                    "saving the result failed; retrying in the background"
                );
                self.tasks.spawn(l.save_in_background(done, ttl));
            }
        }
    }
}

impl LeaseInner {
    fn valid_until(&self) -> Instant {
        *self
            .valid_until
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn extend(&self, until: Instant) {
        *self
            .valid_until
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = until;
    }

    fn mark_lost(&self, why: &str) {
        if !self.lost.swap(true, Ordering::SeqCst) {
            tracing::error!(
                route = %self.route,
                key = %self.key,
                "lease lost: {why}; the result is not saved under this claim"
            );
            self.metrics.lost_lease(&self.route);
        }
    }

    /// Renews the lease every `lock_ttl/3` until aborted or lost. A failed renewal is retried
    /// at the next tick: two more chances before the lease can expire.
    async fn renew_every_third(self: Arc<Self>) {
        let period = self.lock_ttl / 3;
        let mut tick = tokio::time::interval_at(Instant::now() + period, period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if self.renew_once().await == Some(false) {
                self.mark_lost("another request holds the key now");
                return;
            }
        }
    }

    /// One renewal: `Some(true)` renewed, `Some(false)` the key no longer holds our claim,
    /// `None` the store failed (logged).
    async fn renew_once(&self) -> Option<bool> {
        let sent = Instant::now();
        match self.store.renew(&self.key, &self.held, self.lock_ttl).await {
            Ok(true) => {
                self.extend(sent + self.lock_ttl);
                Some(true)
            }
            Ok(false) => Some(false),
            Err(e) => {
                tracing::warn!(route = %self.route, error = %e, "lease renewal failed; retrying");
                None
            }
        }
    }

    /// Retries a failed save with backoff, renewing the lease meanwhile, for as long as the
    /// lease may still be valid.
    async fn save_in_background(self: Arc<Self>, done: Entry, ttl: Duration) {
        let mut backoff = Duration::from_millis(50);
        loop {
            let valid_until = self.valid_until();
            let now = Instant::now();
            if now >= valid_until {
                tracing::error!(
                    route = %self.route,
                    key = %self.key,
                    "gave up saving the result: the lease expired; a retry of this key will run the operation again"
                );
                self.metrics.save_abandoned(&self.route);
                self.mark_lost("it expired while the store was failing");
                return;
            }
            tokio::time::sleep(backoff.min(valid_until - now)).await;
            backoff = (backoff * 2).min(Duration::from_secs(1));
            match self.store.complete(&self.key, &self.held, &done, ttl).await {
                Ok(true) => {
                    tracing::info!(route = %self.route, "result saved after retrying");
                    return;
                }
                Ok(false) => return self.lost_or_saved(&done).await,
                // Keep the lease alive while the store comes back.
                Err(_) => {
                    if self.renew_once().await == Some(false) {
                        return self.lost_or_saved(&done).await;
                    }
                }
            }
        }
    }

    /// The compare-and-set failed: either an earlier attempt whose answer was lost did save
    /// (the record is ours), or the lease was lost to another request.
    async fn lost_or_saved(&self, done: &Entry) {
        if let Ok(Some(current)) = self.store.get(&self.key).await {
            if current == *done {
                return;
            }
        }
        self.mark_lost("the key was claimed by another request");
    }
}
