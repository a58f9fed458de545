//! What the end of a claimed request's upstream call means for its key: completed with the
//! result, or released so that a retry runs again.
//!
//! The settlement is decided from the upstream's answer alone ([`Settlement::of_whole`],
//! [`Settlement::of_over`], [`Settlement::of_failure`]) and carried out
//! ([`Settlement::apply`]) by whoever holds the key's claim: the exchange of an enforced route,
//! right after its call; the background claim of an observed route, once it holds the key. One
//! set of rules for both modes: an observed route saves exactly what an enforced one would, so
//! switching it to `enforce` keeps its records (SPEC §4.7).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use http::StatusCode;
use tokio::time::Instant;

use super::context::Context;
use super::lease::Lease;
use super::matched::Route;
use super::replay::saved_headers;
use super::resolve::{Lookup, Unknown};
use crate::fingerprint::Fingerprint;
use crate::grpc;
use crate::metrics::Outcome;
use crate::problem::Problem;
use crate::record::{DELIVERY_LABEL, Finished, Saved, SavedResponse};
use crate::route::GrpcSettings;
use crate::route::{IdempotencySettings, Mode, OnUnknownOutcome};
use crate::upstream::{self, UpstreamError};

/// What becomes of a claimed key once its upstream call has ended.
pub(super) struct Settlement {
    action: Action,
    /// Why, for the line [`Settlement::apply`] logs; `None` for an ordinary result or a retry
    /// status, which are not logged.
    why: Option<Why>,
}

enum Action {
    /// Save this as the key's result.
    Complete(Saved),
    /// Free the key: the answer is not the operation's result, or the operation surely did
    /// not run.
    Release,
    /// Hold the key and ask the upstream (`on_unknown_outcome: resolve`): `failure` is what
    /// `keep` would have saved, `lookup` the request's rendered lookup, `sent` the latest
    /// moment the request could have been written.
    Resolve {
        failure: Problem,
        lookup: Option<Lookup>,
        sent: Instant,
    },
}

/// The settlements worth a log line, logged when they are carried out: only a request that
/// holds the claim has a claim to release or a result to save.
enum Why {
    /// The upstream refused the request head: the operation never ran.
    HeadRefused(StatusCode),
    /// A response over `max_response_body` (this limit): saved as not replayable.
    OverLimit(u64),
    /// The client's body failed on its way upstream: the upstream got no whole request.
    ClientBody(String),
    /// The connection could not be made: nothing was sent.
    Connect(String),
    /// No complete response: the upstream may have acted. `kept`: the status of the problem
    /// saved as the result (`on_unknown_outcome: keep`); `None`: released.
    Unknown { error: String, kept: Option<u16> },
    /// No complete response on a `resolve` route: the key is held while the upstream is asked.
    Resolving { error: String },
    /// No response to a JSON-RPC call (`what` came instead). `kept`: the proxy's `-32095` was
    /// saved as its result (`keep`); false: released.
    CallUnknown { what: String, kept: bool },
}

impl Settlement {
    fn new(action: Action, why: Option<Why>) -> Settlement {
        Settlement { action, why }
    }

    /// The whole response: saved, unless it is not the operation's result.
    pub(super) fn of_whole(
        idem: &IdempotencySettings,
        parts: &http::response::Parts,
        bytes: &Bytes,
    ) -> Settlement {
        if let Some(release) = not_a_result(idem, parts) {
            return release;
        }
        let saved = SavedResponse {
            status: parts.status,
            headers: saved_headers(&parts.headers, idem),
            body: bytes.clone(),
        };
        Settlement::new(Action::Complete(Saved::Response(saved)), None)
    }

    /// A response over `max_response_body`, streamed on to its client: saved as not
    /// replayable, unless it is not the operation's result.
    pub(super) fn of_over(idem: &IdempotencySettings, parts: &http::response::Parts) -> Settlement {
        if let Some(release) = not_a_result(idem, parts) {
            return release;
        }
        Settlement::new(
            Action::Complete(Saved::NotReplayable {
                status: parts.status,
            }),
            Some(Why::OverLimit(idem.max_response_body)),
        )
    }

    /// No response: the key is freed when the operation surely did not run, otherwise kept,
    /// freed or resolved as `on_unknown_outcome` says. Also the problem the client gets, and
    /// its outcome. `lookup` is the request's rendered lookup (a `resolve` route's), and
    /// `sent` the latest moment the request could have been written upstream.
    pub(super) fn of_failure(
        context: &Context,
        e: &UpstreamError,
        lookup: Option<Lookup>,
        sent: Instant,
    ) -> (Settlement, Problem, Outcome) {
        let problem = Problem::of_upstream(context.route.upstream.name(), e);
        let settlement = match e {
            // The body here is the buffered one admission read, which cannot fail; were it
            // to, the upstream got no whole request, so the key is freed as for a connect
            // error.
            UpstreamError::ClientBody { .. } => {
                let why = Why::ClientBody(e.to_string());
                return (
                    Settlement::new(Action::Release, Some(why)),
                    problem,
                    Outcome::BadRequest,
                );
            }
            // Nothing was sent (no connection, or the send deadline passed before any byte
            // was written): the operation did not happen; free the key.
            UpstreamError::Connect(_) | UpstreamError::Unsent(_) => {
                Settlement::new(Action::Release, Some(Why::Connect(e.to_string())))
            }
            _ => match context.policy.on_unknown_outcome {
                OnUnknownOutcome::Resolve => {
                    let why = Why::Resolving {
                        error: e.to_string(),
                    };
                    let client = match context.policy.mode {
                        Mode::Enforce => Problem::BeingResolved(Box::new(problem.clone())),
                        // Repeats are forwarded there: the answer says nothing of them.
                        Mode::Observe => problem.clone(),
                    };
                    let action = Action::Resolve {
                        failure: problem,
                        lookup,
                        sent,
                    };
                    return (
                        Settlement::new(action, Some(why)),
                        client,
                        Outcome::UpstreamError,
                    );
                }
                OnUnknownOutcome::Keep => Settlement::new(
                    // On a gRPC route, the status the client got (SPEC §4.11).
                    Action::Complete(Saved::Response(match context.route.settings.grpc {
                        Some(_) => grpc::saved(&problem),
                        None => problem.saved(),
                    })),
                    Some(Why::Unknown {
                        error: e.to_string(),
                        kept: Some(problem.status().as_u16()),
                    }),
                ),
                OnUnknownOutcome::Release => Settlement::new(
                    Action::Release,
                    Some(Why::Unknown {
                        error: e.to_string(),
                        kept: None,
                    }),
                ),
            },
        };
        (settlement, problem, Outcome::UpstreamError)
    }

    /// A gRPC call's whole response (SPEC §4.11): its head, body and trailers saved, unless its
    /// `grpc-status` is in `retry_codes` (released); an error for an unknown outcome — the
    /// upstream's `DEADLINE_EXCEEDED`, or no status at all (the response cut before its
    /// trailers) — which `on_unknown_outcome` decides as for any.
    pub(super) fn of_grpc(
        context: &Context,
        settings: &GrpcSettings,
        parts: &http::response::Parts,
        bytes: &Bytes,
    ) -> Result<Settlement, UpstreamError> {
        let idem = &context.policy;
        let trailers = parts.extensions.get::<upstream::Trailers>().map(|t| &t.0);
        match grpc::verdict(&parts.headers, trailers, &settings.retry_codes) {
            grpc::Verdict::Retry(_) => Ok(Settlement::new(Action::Release, None)),
            grpc::Verdict::DeadlineExceeded => {
                Err(UpstreamError::Timeout(context.route.upstream.timeout()))
            }
            grpc::Verdict::Cut => Err(UpstreamError::Failed(
                "the gRPC response ended without a grpc-status (cut before its trailers)".into(),
            )),
            grpc::Verdict::Result => {
                if let Some(release) = not_a_result(idem, parts) {
                    return Ok(release);
                }
                let response = SavedResponse {
                    status: parts.status,
                    headers: saved_headers(&parts.headers, idem),
                    body: bytes.clone(),
                };
                let saved = match trailers {
                    Some(trailers) => Saved::Trailed {
                        response,
                        trailers: trailers
                            .iter()
                            .map(|(n, v)| (n.clone(), v.clone()))
                            .collect(),
                    },
                    // Trailers-only: the status is in the head.
                    None => Saved::Response(response),
                };
                Ok(Settlement::new(Action::Complete(saved), None))
            }
        }
    }

    /// A JSON-RPC call's response (SPEC §4.10): `saved` (its `result` or `error` member, with
    /// the status and headers) completes the key, unless `release` (an error code in
    /// `retry_errors`, a result that asks for input).
    pub(super) fn of_call(saved: SavedResponse, release: bool) -> Settlement {
        if release {
            return Settlement::new(Action::Release, None);
        }
        Settlement::new(Action::Complete(Saved::Response(saved)), None)
    }

    /// A JSON-RPC call's answer that is not its result (a `4xx`, a `retry_statuses` status, a
    /// `202` with no body): the key is freed.
    pub(super) fn not_the_call_result() -> Settlement {
        Settlement::new(Action::Release, None)
    }

    /// A JSON-RPC call whose outcome is unknown (a `5xx`, an answer without the response to
    /// the call, a stream cut before it): `keep` saves `error` (the proxy's `-32095`, the
    /// detail saying what came; `resolve`, refused on these routes, saves it too), `release`
    /// frees the key.
    pub(super) fn of_call_unknown(
        idem: &IdempotencySettings,
        error: SavedResponse,
        what: String,
    ) -> Settlement {
        match idem.on_unknown_outcome {
            OnUnknownOutcome::Release => Settlement::new(
                Action::Release,
                Some(Why::CallUnknown { what, kept: false }),
            ),
            OnUnknownOutcome::Keep | OnUnknownOutcome::Resolve => Settlement::new(
                Action::Complete(Saved::Response(error)),
                Some(Why::CallUnknown { what, kept: true }),
            ),
        }
    }

    /// Keeps a webhook delivery's unsigned id with the result it saves, if it saves a response
    /// (see [`DELIVERY_LABEL`]).
    pub(super) fn label(&mut self, label: &str) {
        if let Action::Complete(Saved::Response(r)) = &mut self.action
            && let Ok(value) = http::HeaderValue::from_str(label)
        {
            r.headers.push((DELIVERY_LABEL, value));
        }
    }

    /// Whether it saves a result (rather than releasing the key or resolving it).
    pub(super) fn completes(&self) -> bool {
        matches!(self.action, Action::Complete(_))
    }

    /// Carries it out on the held claim: completes it with the result under `fingerprint`
    /// (retried in the background if the store fails, see [`Lease::save`]), or releases
    /// it.
    ///
    /// Boxed: inline, its state (the save and its retry, ~4 KiB) would size the future of
    /// every step that settles, up to the exchange's, which is boxed and so copied whole once
    /// a request (callgrind: a new key's `memcpy` counts one instruction a byte there).
    pub(super) fn apply(
        self,
        lease: Lease,
        fingerprint: Fingerprint,
        context: &Arc<Context>,
    ) -> Pin<Box<impl Future<Output = ()> + '_>> {
        Box::pin(self.carry_out(lease, fingerprint, context))
    }

    async fn carry_out(self, lease: Lease, fingerprint: Fingerprint, context: &Arc<Context>) {
        if let Some(why) = &self.why {
            why.log(&context.route);
        }
        match self.action {
            Action::Complete(saved) => {
                let done = Finished::new(fingerprint, saved);
                let shared = &context.shared;
                lease
                    .save(done, context.policy.ttl, &shared.tasks, &shared.pending)
                    .await;
            }
            Action::Release => lease.release().await,
            Action::Resolve {
                failure,
                lookup: Some(lookup),
                sent,
            } if within_observe_bound(context) => Unknown {
                context: context.clone(),
                lease,
                fingerprint,
                lookup,
                sent,
                failure,
                gave_up: false,
            }
            .spawn(),
            // A resolve route always renders its lookup before the claim; without one there is
            // nothing to ask, and keep's result is the safe one. So it is on an observed route
            // whose background work is at its bound.
            Action::Resolve { failure, .. } => {
                let done = Finished::new(fingerprint, Saved::Response(failure.saved()));
                let shared = &context.shared;
                lease
                    .save(done, context.policy.ttl, &shared.tasks, &shared.pending)
                    .await;
            }
        }
    }
}

impl Why {
    fn log(&self, route: &Route) {
        let (route, up) = (&*route.name, route.upstream.name());
        match self {
            Why::HeadRefused(status) => tracing::warn!(
                %route,
                upstream = up,
                status = status.as_u16(),
                "the upstream refused the request head; not saved, claim released \
                 (its own header limits are tighter than the proxy's)"
            ),
            Why::OverLimit(limit) => tracing::warn!(
                %route,
                limit,
                "response larger than max_response_body: it reaches this client but cannot be replayed"
            ),
            Why::ClientBody(error) => tracing::warn!(
                %route,
                upstream = up,
                %error,
                "request body failed on its way upstream; claim released"
            ),
            Why::Connect(error) => tracing::warn!(
                %route,
                upstream = up,
                %error,
                "upstream connect failed; claim released"
            ),
            Why::Unknown {
                error,
                kept: Some(status),
            } => tracing::warn!(
                %route,
                upstream = up,
                %error,
                "outcome unknown; saving {status} as the key's result (on_unknown_outcome: keep)"
            ),
            Why::Resolving { error } => tracing::warn!(
                %route,
                upstream = up,
                %error,
                "outcome unknown; key held while the upstream is asked (on_unknown_outcome: resolve)"
            ),
            Why::CallUnknown { what, kept: true } => tracing::warn!(
                %route,
                upstream = up,
                "no response to the JSON-RPC call ({what}); outcome unknown, its -32095 error saved as the call's result (on_unknown_outcome: keep)"
            ),
            Why::CallUnknown { what, kept: false } => tracing::warn!(
                %route,
                upstream = up,
                "no response to the JSON-RPC call ({what}); outcome unknown, claim released (on_unknown_outcome: release)"
            ),
            Why::Unknown { error, kept: None } => tracing::warn!(
                %route,
                upstream = up,
                %error,
                "outcome unknown; claim released (on_unknown_outcome: release)"
            ),
        }
    }
}

/// Whether a resolution may start: always on an enforced route (its key is held, and its
/// record taken over if this proxy stops); on an observed route only while the work observe
/// runs after its clients were answered is under `limits.max_detached_exchanges` (SPEC §4.7),
/// past which the key is saved as `keep` would save it, and the line logged.
fn within_observe_bound(context: &Context) -> bool {
    if context.policy.mode == Mode::Enforce {
        return true;
    }
    let bound = i64::from(context.limits.max_detached_exchanges);
    let within = context.shared.detached.get() < bound;
    if !within {
        tracing::warn!(
            route = %context.route.name,
            "observe: at limits.max_detached_exchanges, the unknown outcome is not resolved; saved as keep saves it"
        );
    }
    within
}

/// The release of an upstream answer that is not the operation's result — the upstream's
/// refusal of the request head (the operation never ran), or a `retry_statuses` status — so
/// the answer is passed on and a retry runs again; `None` for a result.
fn not_a_result(idem: &IdempotencySettings, parts: &http::response::Parts) -> Option<Settlement> {
    if upstream::refuses_head(parts) {
        return Some(Settlement::new(
            Action::Release,
            Some(Why::HeadRefused(parts.status)),
        ));
    }
    idem.retry_statuses
        .contains(&parts.status.as_u16())
        .then(|| Settlement::new(Action::Release, None))
}
