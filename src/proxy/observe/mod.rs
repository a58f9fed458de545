//! Observe mode (`mode: observe`, SPEC §4.7): every request is forwarded and none is replayed
//! or refused for idempotency reasons, while the key is claimed and the result saved as
//! `enforce` would, and what `enforce` would have answered is counted
//! (`idemproxy_observed_total{route,would}`) — so an operator measures idempotency in front of
//! a live service before turning it on, and the switch to `enforce` finds the records in place.
//!
//! The client's answer never waits for the store:
//! 1. Admission as `enforce` does it (the key, the body, the fingerprint), except that what
//!    `enforce` would refuse is counted and forwarded: a missing or invalid key, a `key_from`
//!    part that can't be read, a body over `max_request_body` (not fingerprinted, so not
//!    claimed: counted in `idemproxy_observed_unclaimed_total{reason="too_large"}`).
//! 2. The claim starts in a task of its own ([`shadow`]) while the request is forwarded at
//!    once, here.
//! 3. The upstream's response is read as `enforce` reads it (bounded by `max_response_body`)
//!    and answered at once; what it means for the key (a [`Settlement`]: save or release,
//!    decided by the same rules as `enforce`) is handed to the claim's task, which carries it
//!    out if — and only if — it holds the key. Every interleaving of the claim and the call is
//!    in [`shadow`].
//!
//! As on an enforced route, the forwarding and the upstream call are never cancelled by a
//! client that leaves ([`super::detach`]): the result is still saved, so the repeat would be
//! replayed once the route enforces. Both tasks are tracked, so shutdown waits for the saves.
//!
//! What runs after the client has its answer is bounded (SPEC §4.7): new claims stop at the
//! bounds that make `enforce` answer 503 (`limits.max_detached_exchanges`,
//! `limits.max_pending_saves`: forwarded without a claim), and the repeats held as
//! `on_conflict: wait` would hold them, which nothing else bounds (each client is answered at
//! once), are at most `limits.max_detached_exchanges` (`idemproxy_observed_held`); past that, a
//! repeat is counted at once by what its record shows (see [`shadow`]).
//!
//! `idemproxy_requests_total` counts what the proxy did, not what `enforce` would have done:
//! `passthrough` for every request forwarded (as on a pass-through route), `upstream_error`
//! and `bad_request` as there.

pub(in crate::proxy) mod refused;
mod shadow;

use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::sync::oneshot;
use tokio::time::Instant;

use self::refused::{refused_head, too_large, would_refuse};
use self::shadow::{HeldRepeats, Shadow};
use super::admission::{self, Admitted, KeySource, Underived};
use super::context::Context;
use super::detach::{self, Detachable};
use super::jsonrpc::{Sink, run_call};
use super::matched::{Answer, first_response, forward_plain, refuse};
use super::settle::Settlement;
use super::{KeyHash, Proxy, answer_of, body_with_deadline};
use crate::body::{self, Body, ClientBodyError};
use crate::metrics::{ObservedMetrics, Outcome, Unclaimed, Would};
use crate::problem::Problem;
use crate::route::OnUnknownOutcome;
use crate::upstream::{self, Bounded};

impl Proxy {
    /// A request on an observed route (`observed`: its series): admitted as `enforce` would,
    /// counted, and forwarded whatever admission says.
    pub(super) async fn observed(
        &self,
        context: &Arc<Context>,
        observed: &ObservedMetrics,
        req: Request<Incoming>,
    ) -> Answer {
        let admitted = match admit(context, observed, req).await {
            Ok(admitted) => admitted,
            Err(answer) => return answer,
        };
        self.observe_admitted(context, observed, admitted).await
    }

    /// An admitted request on an observed route: claimed beside its forwarding, counted.
    pub(in crate::proxy) async fn observe_admitted(
        &self,
        context: &Arc<Context>,
        observed: &ObservedMetrics,
        admitted: Admitted,
    ) -> Answer {
        let Context {
            route,
            shared,
            client,
            limits,
            ..
        } = &**context;
        let (client, drop_key) = (*client, context.drop_key());
        if admitted.origin == admission::KeyOrigin::Derived {
            route.metrics.derived_key();
        }
        // The bounds that make `enforce` answer 503 before claiming hold here too, or an
        // observed route could pile up work that nobody waits for; past them the request is
        // forwarded without a claim.
        if self.metrics.detached_exchanges.get() >= i64::from(limits.max_detached_exchanges)
            || shared.pending.is_saturated()
        {
            tracing::warn!(
                route = %route.name,
                "at limits.max_detached_exchanges or limits.max_pending_saves: forwarded without a claim (observe)"
            );
            observed.unclaimed(Unclaimed::Overloaded);
            let Admitted { parts, body, .. } = admitted;
            return forward_plain(route, parts, body::full(body), client, drop_key).await;
        }
        let key_hash = KeyHash {
            id: *admitted.key.id(),
            origin: admitted.origin,
        };
        let observation = Observation {
            context: context.clone(),
            observed: observed.clone(),
            held: HeldRepeats {
                count: self.metrics.observed_held.clone(),
                bound: limits.max_detached_exchanges,
            },
            request: admitted,
        };
        // As on an enforced route: run here, moved to a task of its own if the client leaves
        // first, tracked either way (see `idempotent`).
        let (_attachment, ended, watch) = detach::guards(self.metrics.detached_exchanges.clone());
        let exchange = Detachable::new(shared.tasks.track_future(crate::traces::carried(
            async move {
                let _ended = ended;
                observation.forward().await
            },
        )));
        let _watch = watch;
        let (mut resp, outcome) = answer_of(exchange.await, &route.name, context.start);
        resp.extensions_mut().insert(key_hash);
        (resp, outcome)
    }
}

/// Admission as `enforce` does it, except that what `enforce` would refuse is counted and
/// forwarded here (`Err`: the answer of that forwarding, or of a body that cannot be read).
async fn admit(
    context: &Context,
    observed: &ObservedMetrics,
    req: Request<Incoming>,
) -> Result<Admitted, Answer> {
    let Context {
        route,
        policy: idem,
        client,
        limits,
        ..
    } = context;
    let client = *client;
    let (parts, incoming) = req.into_parts();
    let drop_key = context.drop_key();
    let source = match admission::check_head(idem, &parts) {
        // No key on a route that neither requires nor derives one: plain traffic under
        // `enforce` too, nothing for idempotency to decide, so not counted.
        Ok(KeySource::None) => {
            let body = body_with_deadline(incoming, limits);
            return Err(forward_plain(route, parts, body, client, None).await);
        }
        Ok(source) => source,
        Err((problem, outcome)) => {
            refused_head(route, observed, &problem, outcome, client);
            let body = body_with_deadline(incoming, limits);
            return Err(forward_plain(route, parts, body, client, drop_key).await);
        }
    };
    let body = body_with_deadline(incoming, limits);
    let body = match read_bounded(body, idem.max_request_body).await {
        Ok(Read::Whole(bytes)) => bytes,
        Ok(Read::Over { prefix, rest }) => {
            too_large(route, observed, idem, client);
            let body = upstream::chain(prefix, rest);
            return Err(forward_plain(route, parts, body, client, drop_key).await);
        }
        // A body that cannot be read cannot be forwarded either: answered as `enforce`
        // (and a pass-through route) would, which is no idempotency refusal.
        Err(problem) => return Err(refuse(problem, Outcome::BadRequest)),
    };
    let admitted = match admission::with_body(context, source, parts, body, None) {
        Ok(admitted) => admitted,
        Err(underived) => {
            let Underived {
                problem,
                parts,
                body,
            } = *underived;
            would_refuse(route, observed, Would::InvalidKey, &problem, client);
            return Err(forward_plain(route, parts, body::full(body), client, drop_key).await);
        }
    };
    Ok(admitted)
}

/// An admitted request on an observed route, from its forwarding to its answer.
struct Observation {
    context: Arc<Context>,
    observed: ObservedMetrics,
    /// How many repeats observe holds in the background, and how many it may.
    held: HeldRepeats,
    request: Admitted,
}

impl Observation {
    /// Starts the claim in a task of its own, forwards the request meanwhile, answers with the
    /// upstream's response as soon as it has been read, and hands the claim what that response
    /// means for the key.
    async fn forward(self) -> Answer {
        let Observation {
            context,
            observed,
            held,
            request,
        } = self;
        let Admitted {
            parts,
            body,
            key,
            fingerprint,
            origin,
            lookup,
            call,
        } = request;
        let (settled, settlement) = oneshot::channel();
        let answered_key = key.clone();
        let owner = context.shared.answered.owner();
        let shadow = Shadow {
            #[cfg(feature = "test-pauses")]
            pause: super::pause::shadow_claim(parts.headers.get(&context.policy.header)),
            context: context.clone(),
            observed,
            held,
            key,
            fingerprint,
            origin,
            owner,
        };
        shadow.spawn(settlement);

        let (route, idem) = (&context.route, &context.policy);
        let up = &route.upstream;
        // The request goes out as `enforce` would send it, resent after the keep-alive race
        // only where `enforce` would (SPEC §4.3).
        let resend = idem.on_unknown_outcome == OnUnknownOutcome::Release;
        // The latest moment the request can be written: the call's start plus the longest its
        // connection can take.
        let sent = Instant::now() + up.connect_timeout();
        let result = match (
            up.request(parts, body, context.client, context.drop_key()),
            call,
        ) {
            (Ok(req), Some(call)) => {
                // A JSON-RPC call: its answer streamed on as enforce streams it, the response
                // to the call handed to the shadow claim as enforce would save it.
                let sink = Sink::Observed {
                    settled,
                    key: answered_key,
                    owner,
                };
                let (resp, outcome) = run_call(context.clone(), call, sink, req, sent).await;
                let outcome = match outcome {
                    Outcome::Forwarded => Outcome::Passthrough,
                    other => other,
                };
                return (resp, outcome);
            }
            (Ok(req), None) => up.call_bounded(req, idem.max_response_body, resend).await,
            (Err(e), _) => Err(e),
        };
        let (settlement, answer) = match result {
            Ok((parts, Bounded::Complete(bytes))) => (
                Settlement::of_whole(idem, &parts, &bytes),
                (first_response(parts, bytes), Outcome::Passthrough),
            ),
            Ok((parts, Bounded::Over { prefix, rest })) => (
                Settlement::of_over(idem, &parts),
                (
                    Response::from_parts(parts, upstream::chain(prefix, rest)),
                    Outcome::Passthrough,
                ),
            ),
            Err(e) => {
                tracing::warn!(route = %route.name, upstream = up.name(), error = %e, "upstream call failed");
                let (settlement, problem, outcome) =
                    Settlement::of_failure(&context, &e, lookup, sent.min(Instant::now()));
                (settlement, refuse(problem, outcome))
            }
        };
        // The answer goes out now and the result is saved after it: a repeat meanwhile is
        // counted as enforce, which saves first, would answer it (a replay).
        if settlement.completes() {
            context.shared.answered.answered(&answered_key, owner);
        }
        // A claim that has already ended without the key (a duplicate, a store error) has
        // dropped its receiver: there is nothing to save, and the send fails quietly.
        let _ = settled.send(settlement);
        answer
    }
}

/// A request body read up to a bound.
enum Read {
    /// The whole body fit.
    Whole(Bytes),
    /// It is larger: what was read, and the rest still to stream.
    Over { prefix: Bytes, rest: Body },
}

/// Reads `body` (a client's, under its deadline) up to `limit` bytes, keeping what was read
/// when it is larger, so the request can still be forwarded whole. A body that fails is the
/// client's: its problem, as `enforce` answers it.
async fn read_bounded(mut body: Body, limit: u64) -> Result<Read, Problem> {
    let limit = usize::try_from(limit).unwrap_or(usize::MAX);
    let mut read = bytes::BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| body_problem(e.as_ref()))?;
        if let Ok(data) = frame.into_data() {
            read.extend_from_slice(&data);
            if read.len() > limit {
                return Ok(Read::Over {
                    prefix: read.freeze(),
                    rest: body,
                });
            }
        }
    }
    Ok(Read::Whole(read.freeze()))
}

/// The problem of a client body that failed while it was read.
fn body_problem(e: &(dyn std::error::Error + 'static)) -> Problem {
    match e.downcast_ref::<ClientBodyError>() {
        Some(ClientBodyError {
            timed_out: Some(after),
            ..
        }) => Problem::BodyTimeout { after: *after },
        Some(client) => Problem::BadRequestBody {
            detail: client.detail(),
        },
        None => Problem::BadRequestBody {
            detail: upstream::error_chain(e),
        },
    }
}
