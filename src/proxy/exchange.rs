//! The exchange: claim the key, forward the claimed request, and decide what its answer means
//! for the key — complete it with the result, or release it so that a retry runs again.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Response;
use http::header;
use tokio::time::Instant;

use super::admission::Admitted;
use super::context::Context;
use super::detach::Attachment;
use super::jsonrpc::{Sink, run_call};
use super::lease::Lease;
use super::matched::{
    Answer, FIRST_WAIT_POLL, MAX_WAIT_POLL, first_response, forward_plain, refuse,
};
use super::replay::{replay, replay_call};
use super::resolve::{Lookup, StoreClock, take_over};
use super::settle::Settlement;
use super::webhook::DeliveryLabel;
use crate::body::{self, Body};
use crate::fingerprint::Fingerprint;
use crate::metrics::Outcome;
use crate::problem::Problem;
use crate::record::{Phase, Record, Resolvable, new_token};
use crate::route::{OnConflict, OnStoreError, OnUnknownOutcome};
use crate::store::{Claim, Held, ResolvableClaim, ResolvableTimes, StoreError};
use crate::upstream::{self, Bounded, UpstreamError};

/// How long a 409 asks the client to wait (`Retry-After`).
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// One admitted request, from its claim to its answer.
pub(super) struct Exchange {
    context: Arc<Context>,
    request: Admitted,
    held: Held,
    /// Whether the client still waits: a waiter whose client left stops polling.
    attachment: Arc<Attachment>,
    /// A resolvable claim's reading of the store's clock, once the claim is ours: its record's
    /// times are on that clock.
    clock: Option<StoreClock>,
}

impl Exchange {
    pub(crate) fn new(
        context: Arc<Context>,
        request: Admitted,
        attachment: Arc<Attachment>,
    ) -> Exchange {
        let held = claim_of(&context, &request);
        Exchange {
            context,
            request,
            held,
            attachment,
            clock: None,
        }
    }

    /// Claims the key — or replays, refuses, or waits, per what the claim finds — and runs the
    /// exchange when the claim is ours.
    pub(crate) async fn claim_and_run(mut self) -> Answer {
        let context = self.context.clone();
        let (idem, store) = (&context.policy, &context.shared.store);
        let wait_until = Instant::now() + idem.wait_timeout;
        let mut poll = FIRST_WAIT_POLL;
        // Whether a claim has shown this key held by another request. From then on the
        // operation is running or done, so a store error must never forward (SPEC §4.5).
        let mut seen_held = false;
        loop {
            let sent = Instant::now();
            // Each way on from the claim is boxed where it starts: inline, its state (the
            // upstream call, the save: ~12 KiB) would size this future, which `run_admitted`
            // boxes and so copies whole on every request, a replay's too (callgrind counted
            // ~12,000 instructions of `memcpy` a request for that copy).
            let existing = match self.claim(sent).await {
                // The lease runs from the send time: an answer later than lock_ttl may come
                // after it expired, and another request may hold the key and be running the
                // operation already (SPEC §4.5).
                Ok(Claim::Claimed) if sent.elapsed() >= idem.lock_ttl => {
                    return Box::pin(self.claimed_too_late(sent)).await;
                }
                Ok(Claim::Claimed) => return Box::pin(self.run(sent)).await,
                Ok(Claim::Existing(record)) => record,
                Err(e) => return Box::pin(self.store_failure(e, seen_held)).await,
            };
            seen_held = true;
            // The mismatch check comes first, in flight or finished.
            if *existing.fingerprint() != self.request.fingerprint {
                let problem = match self.context.route.settings.webhook {
                    Some(_) => Problem::EventRedeliveredDifferently,
                    None => Problem::KeyReused,
                };
                return refuse(problem, Outcome::Mismatch);
            }
            match &existing {
                Record::Finished { saved, .. } => {
                    return match &self.request.call {
                        Some(call) => replay_call(saved.clone(), call),
                        None => replay(saved.clone()),
                    };
                }
                // A claim that can be resolved is in flight too, or being resolved: either way
                // the operation may have run, so a repeat waits or gets 409.
                Record::InFlight { .. } | Record::Resolvable(_) => {
                    let now = Instant::now();
                    // A waiter whose client left has nobody to answer: stop polling.
                    if idem.on_conflict == OnConflict::Reject
                        || now >= wait_until
                        || self.attachment.is_gone()
                    {
                        let problem = self.in_progress(&existing).await;
                        return refuse(problem, Outcome::Conflict);
                    }
                    // Wait for the holder to finish, then claim again: a released or expired
                    // claim is taken by this request, a finished one is replayed. Stores
                    // that cannot wake us (Redis: the holder may be another instance) are
                    // polled, backing off so a thousand waiters do not flood them.
                    let _waiting = crate::traces::Child::start("idemproxy.wait");
                    store
                        .wait_change(&self.request.key, poll.min(wait_until - now))
                        .await;
                    poll = (poll * 2).min(MAX_WAIT_POLL);
                }
            }
        }
    }

    /// The 409 for a key held by another request: in flight, or being resolved — then with
    /// when its next lookup is due (the store's clock read once more), never "expires within
    /// lock_ttl": a resolution outlives its lease.
    async fn in_progress(&self, existing: &Record) -> Problem {
        if let Record::Resolvable(r) = existing
            && r.phase == Phase::Resolving
            && let Ok(now) = self.context.shared.store.now(&self.request.key).await
        {
            return Problem::BeingResolvedNow {
                next_lookup_in: Duration::from_millis(r.next_lookup_at.saturating_sub(now)),
            };
        }
        Problem::InProgress {
            retry_after: RETRY_AFTER,
        }
    }

    /// One claim of the key: on a `resolve` route the resolvable claim, which takes over a
    /// claim whose holder's lease lapsed. A takeover starts its resolution and is answered as
    /// the claim it took over (in flight: 409, or wait); this request forwards nothing.
    ///
    /// On any other route a plain claim; one that finds a claim carrying a lookup (the route
    /// was under `resolve` when it was made) takes it over as a `resolve` route would: a
    /// record is resolved as it says, whatever the route's policy is now, so a route reloaded
    /// from `resolve` to `keep` strands no key (SPEC §4.8).
    async fn claim(&mut self, sent: Instant) -> Result<Claim, StoreError> {
        let context = self.context.clone();
        let (idem, store) = (&context.policy, &context.shared.store);
        let Some(resolve) = self.held.resolvable().and(idem.resolve.as_ref()) else {
            let claimed = store
                .claim(&self.request.key, &self.held, idem.lock_ttl)
                .await?;
            return match claimed {
                Claim::Existing(Record::Resolvable(found))
                    if found.fingerprint == self.request.fingerprint =>
                {
                    self.take_over_found(*found, sent).await
                }
                claimed => Ok(claimed),
            };
        };
        let times = ResolvableTimes {
            lease: idem.lock_ttl,
            // No byte of the request is written once the upstream's timeout has passed since
            // `sent`, taken before this claim went out (SPEC §4.8): the store's stamp plus it
            // is the latest the upstream can have received any of it.
            send_margin: context.route.upstream.timeout(),
            lifetime: resolve.give_up_after + idem.ttl,
        };
        self.claim_resolvable(times, sent).await
    }

    /// On a route not under `resolve`: `found`, a claim carrying a lookup, is claimed as a
    /// `resolve` route claims — taken over if its holder's lease lapsed (then resolved as it
    /// says), claimed afresh with its lookup if it is gone meanwhile, left alone if live.
    async fn take_over_found(
        &mut self,
        found: Resolvable,
        sent: Instant,
    ) -> Result<Claim, StoreError> {
        let context = self.context.clone();
        let idem = &context.policy;
        let times = ResolvableTimes {
            lease: idem.lock_ttl,
            send_margin: context.route.upstream.timeout(),
            lifetime: found.give_up_after + idem.ttl,
        };
        let mut claim = found;
        claim.token = new_token();
        claim.lease_until = 0;
        claim.phase = Phase::InFlight;
        claim.next_lookup_at = 0;
        claim.legacy = false;
        let plain = std::mem::replace(
            &mut self.held,
            Held::new(Record::Resolvable(Box::new(claim))),
        );
        let claimed = self.claim_resolvable(times, sent).await;
        if !matches!(claimed, Ok(Claim::Claimed)) {
            // Claims from here on are this request's own, plain ones.
            self.held = plain;
        }
        claimed
    }

    /// The resolvable claim of `self.held`, timed by `times`.
    async fn claim_resolvable(
        &mut self,
        times: ResolvableTimes,
        sent: Instant,
    ) -> Result<Claim, StoreError> {
        let context = self.context.clone();
        let store = &context.shared.store;
        let claimed = store
            .claim_resolvable(&self.request.key, &self.held, times)
            .await?;
        match claimed {
            ResolvableClaim::Claimed { held, now } => {
                self.held = held;
                self.clock = Some(StoreClock::read(now));
                Ok(Claim::Claimed)
            }
            ResolvableClaim::TakenOver { held, now, gave_up } => {
                let record = held.record.clone();
                let key = self.request.key.clone();
                take_over(&context, key, held, StoreClock::read(now), gave_up, sent);
                // Claims from here on are this request's own, as a repeat's: never this
                // token, which the resolution holds now.
                self.held = claim_of(&context, &self.request);
                Ok(Claim::Existing(record))
            }
            ResolvableClaim::Existing(record) => Ok(Claim::Existing(record)),
        }
    }

    /// The store failed before this request held the key. `seen_held`: an earlier claim
    /// showed the key held by another request.
    async fn store_failure(self, e: StoreError, seen_held: bool) -> Answer {
        let context = &self.context;
        let route = &context.route;
        // An undecodable record, or a key seen held, means an operation may have run (or be
        // running) under this key: forwarding could run it twice, whatever `on_store_error`
        // says. So does a claim too few replicas acknowledged: the store works, and a
        // duplicate whose claim was acknowledged may be running the operation.
        let policy = if matches!(
            e,
            StoreError::Corrupt(_) | StoreError::ReplicasMissing { .. }
        ) || seen_held
        {
            OnStoreError::Reject
        } else {
            context.policy.on_store_error
        };
        match policy {
            OnStoreError::Reject => {
                tracing::warn!(route = %route.settings.name, key = %self.request.key.id_hex(), error = %e, "store error: 503");
                refuse(Problem::of_store(&e), Outcome::StoreError)
            }
            OnStoreError::Forward => {
                tracing::warn!(
                    route = %route.settings.name,
                    key = %self.request.key.id_hex(),
                    error = %e,
                    "store error: forwarding WITHOUT idempotency (on_store_error: forward)"
                );
                route.metrics.unprotected();
                let Admitted { parts, body, .. } = self.request;
                let body = body::full(body);
                let (resp, _) =
                    forward_plain(route, parts, body, context.client, context.drop_key()).await;
                (resp, Outcome::StoreError)
            }
        }
    }

    /// The claim sent at `sent` was won, but its answer came after its lease could have
    /// expired: forward nothing, free the key if it is still ours, answer 503 (a retry then
    /// claims afresh).
    async fn claimed_too_late(self, sent: Instant) -> Answer {
        let took = sent.elapsed();
        let lock_ttl = self.context.policy.lock_ttl;
        tracing::warn!(
            route = %self.context.route.settings.name,
            key = %self.request.key.id_hex(),
            took_ms = took.as_millis(),
            lock_ttl_ms = lock_ttl.as_millis(),
            "the claim was answered after lock_ttl: its lease may have expired; released, nothing forwarded: 503"
        );
        // Not through `Lease::release`: a claim already expired (or taken over) is what this
        // path expects, not a lost lease, since nothing ran under it.
        if let Err(e) = self
            .context
            .shared
            .store
            .release(&self.request.key, &self.held)
            .await
        {
            tracing::warn!(
                route = %self.context.route.settings.name,
                key = %self.request.key.id_hex(),
                error = %e,
                "release failed; the claim expires within lock_ttl"
            );
        }
        refuse(
            Problem::StoreUnavailable {
                detail: format!(
                    "the claim was answered after {}ms, later than lock_ttl ({}ms)",
                    took.as_millis(),
                    lock_ttl.as_millis()
                ),
            },
            Outcome::StoreError,
        )
    }

    /// Forwards the claimed request, keeping the lease alive, and completes or releases the
    /// claim according to the answer.
    async fn run(self, claimed_at: Instant) -> Answer {
        let Exchange {
            context,
            request,
            held,
            attachment: _,
            clock,
        } = self;
        let Admitted {
            parts,
            body,
            key,
            fingerprint,
            origin: _,
            lookup,
            call,
        } = request;
        let (up, idem) = (&context.route.upstream, &context.policy);
        #[cfg(feature = "test-pauses")]
        super::pause::after_claim(parts.headers.get(&idem.header)).await;
        let mut lease = context.lease(key, held, claimed_at);
        if let Some(call) = call {
            // A JSON-RPC call: its answer is read for the response to the call, which may
            // come on an event stream (SPEC §4.10).
            let sent = Instant::now() + up.connect_timeout();
            return match up.request(parts, body, context.client, context.drop_key()) {
                Ok(req) => {
                    let sink = Sink::Lease { lease, fingerprint };
                    // Boxed: inline, a call's state (its answer may be a stream) would size
                    // every exchange's future, as the claim's ways on do (see `claim_and_run`).
                    Box::pin(run_call(context, call, sink, req, sent)).await
                }
                Err(e) => {
                    let (settlement, problem, outcome) =
                        Settlement::of_failure(&context, &e, None, sent);
                    settlement.apply(lease, fingerprint, &context).await;
                    refuse(problem, outcome)
                }
            };
        }
        // Under `release` the upstream is trusted to honour the forwarded key, so a request
        // lost to the keep-alive race may be sent once more (SPEC §4.3); under `keep` it stays
        // an unknown outcome.
        let resend = idem.on_unknown_outcome == OnUnknownOutcome::Release;
        // No byte of the request is written at or after `write_by`: the upstream's timeout
        // after an instant taken before the claim was sent, so never after the store's stamp
        // plus it, which is what an instance that takes the claim over counts from (SPEC
        // §4.8). A holder that stalled past it (a paused process) writes nothing.
        let write_by = claimed_at + up.timeout();
        // The latest moment a byte of the request can reach the upstream: the resolvable
        // record's, on the store's clock, or `write_by`.
        let sent = match (clock, lease.held().resolvable()) {
            (Some(clock), Some(r)) => clock.local(r.sent_at),
            _ => write_by,
        };
        // A webhook delivery's unsigned id, kept with its result for the key tooling.
        let label = parts.extensions.get::<DeliveryLabel>().cloned();
        let result = match up.request(parts, body, context.client, context.drop_key()) {
            Ok(_) if Instant::now() >= write_by => Err(UpstreamError::Unsent(format!(
                "the upstream's timeout ({}) had passed since the claim was sent; nothing was written",
                humantime::format_duration(up.timeout())
            ))),
            Ok(mut req) => {
                req.extensions_mut().insert(upstream::WriteBy(write_by));
                lease
                    .renewing(up.call_bounded(req, idem.max_response_body, resend))
                    .await
            }
            Err(e) => Err(e),
        };
        let decision = Decision {
            context,
            fingerprint,
            lease,
            lookup,
            sent,
            label,
        };
        match result {
            Ok((parts, Bounded::Complete(bytes))) => decision.whole(parts, bytes).await,
            Ok((parts, Bounded::Over { prefix, rest })) => decision.over(parts, prefix, rest).await,
            Err(e) => decision.failed(e).await,
        }
    }
}

/// The claim a request makes: on an enforced `resolve` route a resolvable record carrying its
/// lookup and the route's times (SPEC §4.8), so that whoever finds its lease lapsed resolves
/// it instead of forwarding it; otherwise a plain claim in flight.
fn claim_of(context: &Context, request: &Admitted) -> Held {
    let token = new_token();
    let resolve = context.policy.resolve.as_ref();
    match (resolve, &request.lookup) {
        (Some(resolve), Some(lookup)) => Held::new(Record::Resolvable(Box::new(
            Resolvable::claim(
                token,
                request.fingerprint,
                lookup.clone(),
                resolve.settle_after,
                resolve.interval,
                resolve.give_up_after,
            )
            .answered_by(&resolve.found, &resolve.absent),
        ))),
        _ => Held::new(Record::InFlight {
            token,
            fingerprint: request.fingerprint,
        }),
    }
}

/// A claimed exchange whose upstream call has ended: what its answer means for the key (the
/// [`Settlement`]), then the answer.
struct Decision {
    context: Arc<Context>,
    fingerprint: Fingerprint,
    lease: Lease,
    /// On a `resolve` route, the request's lookup: asked if its outcome is unknown.
    lookup: Option<Lookup>,
    /// The latest moment the request could have been written upstream.
    sent: Instant,
    /// A webhook delivery's unsigned id, saved with its result (never replayed).
    label: Option<DeliveryLabel>,
}

impl Decision {
    /// The whole response: saved (unless it is not a result) and answered as read. On a gRPC
    /// route its trailers are part of it, and a response without a status is an unknown
    /// outcome.
    async fn whole(self, parts: http::response::Parts, bytes: Bytes) -> Answer {
        if let Some(grpc) = &self.context.route.settings.grpc {
            return match Settlement::of_grpc(&self.context, grpc, &parts, &bytes) {
                Ok(settlement) => {
                    self.settle(settlement).await;
                    (grpc_response(parts, bytes), Outcome::Forwarded)
                }
                Err(unknown) => self.failed(unknown).await,
            };
        }
        let mut settlement = Settlement::of_whole(&self.context.policy, &parts, &bytes);
        if let Some(DeliveryLabel(label)) = &self.label {
            settlement.label(label);
        }
        self.settle(settlement).await;
        (first_response(parts, bytes), Outcome::Forwarded)
    }

    /// A response over `max_response_body`: streamed on to this client, saved as not
    /// replayable (unless it is not a result).
    async fn over(self, parts: http::response::Parts, prefix: Bytes, rest: Body) -> Answer {
        let settlement = Settlement::of_over(&self.context.policy, &parts);
        self.settle(settlement).await;
        (
            Response::from_parts(parts, upstream::chain(prefix, rest)),
            Outcome::Forwarded,
        )
    }

    /// No response: the key is freed when the operation surely did not run, otherwise kept
    /// or freed as `on_unknown_outcome` says.
    async fn failed(mut self, e: UpstreamError) -> Answer {
        let (settlement, problem, outcome) =
            Settlement::of_failure(&self.context, &e, self.lookup.take(), self.sent);
        self.settle(settlement).await;
        refuse(problem, outcome)
    }

    async fn settle(self, settlement: Settlement) {
        settlement
            .apply(self.lease, self.fingerprint, &self.context)
            .await;
    }
}

/// The first client's response on a gRPC route: the upstream's head, the body it read and
/// its trailers.
fn grpc_response(mut parts: http::response::Parts, bytes: Bytes) -> Response<crate::body::Body> {
    match parts.extensions.remove::<upstream::Trailers>() {
        Some(upstream::Trailers(trailers)) => {
            parts.headers.remove(header::CONTENT_LENGTH);
            Response::from_parts(parts, body::with_trailers(bytes, trailers))
        }
        None => first_response(parts, bytes),
    }
}
