//! A claimed JSON-RPC call's upstream answer (SPEC §4.10): what it means for the key, and what
//! the first client gets.
//!
//! - A `4xx` (the transport refused the request), a `retry_statuses` status, or a `202` with no
//!   body (the old HTTP+SSE transport answers elsewhere): not the call's result, released;
//!   the client gets it as it came.
//! - A `5xx`: an unknown outcome; the client gets it as it came.
//! - A `2xx` `application/json` body: read (bounded by `max_response_body`), the response to
//!   the call found in it and saved (its `result` or `error` member), or released for a
//!   `retry_errors` code or an `input_required` result; no response in it is an unknown outcome.
//! - A `2xx` `text/event-stream`: streamed to the client event by event as it arrives, while
//!   the events are read for the response to the call; that event is passed on once its save
//!   is done (a first answer is sent after its save, SPEC §4.6), and the rest of the stream
//!   follows. A stream that ends, fails or times out before it is an unknown outcome. The
//!   stream is read to its end whether or not the client stays.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::super::context::Context;
use super::super::lease::Lease;
use super::super::matched::first_response;
use super::super::matched::{Answer, refuse};
use super::super::replay::saved_headers;
use super::super::settle::Settlement;
use crate::body::{Body, BoxError};
use crate::fingerprint::Fingerprint;
use crate::jsonrpc::{self, Call, EventStream, Found};
use crate::metrics::Outcome;
use crate::problem::Problem;
use crate::record::SavedResponse;
use crate::route::OnUnknownOutcome;
use crate::store::StoreKey;
use crate::upstream::{self, UpstreamError, error_chain};

/// The MCP session header: a session is the client's, never part of a saved result.
const MCP_SESSION_ID: HeaderName = HeaderName::from_static("mcp-session-id");

/// How many frames of an event stream wait for a slow client before the upstream is read no
/// further (until the client takes them, or leaves).
const STREAM_FRAMES: usize = 16;

/// Who settles a call's key once its answer says what it means: the holder of its claim (an
/// enforced route), or the shadow claim of an observed route, which holds its own lease.
// One a call, moved a few times at most: boxing the lease would cost an allocation a call.
#[allow(clippy::large_enum_variant)]
pub(in crate::proxy) enum Sink {
    /// The claim's lease, renewed while the call runs, and the call's fingerprint.
    Lease {
        lease: Lease,
        fingerprint: Fingerprint,
    },
    /// The observed route's shadow claim, waiting for the settlement; `key` and `owner` mark
    /// the call answered (`context::Answered`) before its result reaches the client, so that a
    /// repeat meanwhile counts as enforce, which saves before answering, would answer it.
    Observed {
        settled: oneshot::Sender<Settlement>,
        key: StoreKey,
        owner: u64,
    },
}

impl Sink {
    /// Runs `work`, renewing the lease meanwhile when this sink holds one.
    async fn renewing<F: Future>(&mut self, work: F) -> F::Output {
        match self {
            Sink::Lease { lease, .. } => lease.renewing(work).await,
            Sink::Observed { .. } => work.await,
        }
    }

    /// Carries out `settlement` (a shadow claim that has ended already has nothing to save:
    /// the send fails quietly).
    async fn settle(self, settlement: Settlement, context: &Arc<Context>) {
        match self {
            Sink::Lease { lease, fingerprint } => {
                settlement.apply(lease, fingerprint, context).await;
            }
            Sink::Observed {
                settled,
                key,
                owner,
            } => {
                if settlement.completes() {
                    context.shared.answered.answered(&key, owner);
                }
                let _ = settled.send(settlement);
            }
        }
    }
}

/// Sends a claimed call and settles its key from the answer through `sink`; `sent` is the
/// latest moment it can have been written upstream.
pub(in crate::proxy) async fn run_call(
    context: Arc<Context>,
    call: Arc<Call>,
    mut sink: Sink,
    req: Request<Bytes>,
    sent: Instant,
) -> Answer {
    let up = &context.route.upstream;
    let idem = &context.policy;
    // Under `release` the upstream is trusted with the forwarded key, so a call lost to the
    // keep-alive race may be sent once more (SPEC §4.3), as on any route.
    let resend = idem.on_unknown_outcome == OnUnknownOutcome::Release;
    let resp = match sink.renewing(up.send_buffered(req, resend)).await {
        Ok(resp) => resp,
        Err(e) => {
            let (settlement, problem, outcome) = Settlement::of_failure(&context, &e, None, sent);
            match e {
                // Nothing was sent, or no whole request: released, as on any route.
                UpstreamError::Connect(_) | UpstreamError::ClientBody { .. } => {
                    sink.settle(settlement, &context).await;
                }
                // No answer: the call's outcome is unknown, and what `keep` saves is the
                // call's `-32095`, not a problem document.
                e => {
                    let what = format!("no complete answer came: {e}");
                    sink.settle(of_unknown(&context, what), &context).await;
                }
            }
            return refuse(problem, outcome);
        }
    };
    let (parts, incoming) = resp.into_parts();
    let status = parts.status;
    let empty = http_body::Body::size_hint(&incoming).exact() == Some(0);
    if let Some(settlement) = of_head(&context, &parts, empty) {
        sink.settle(settlement, &context).await;
        let mut resp = Response::from_parts(parts, incoming);
        if status == StatusCode::ACCEPTED && empty {
            resp.extensions_mut().insert(Unanswered);
        }
        return (resp, Outcome::Forwarded);
    }
    if is_event_stream(&parts.headers) {
        let body = stream(context, call, sink, &parts, incoming);
        return (Response::from_parts(parts, body), Outcome::Forwarded);
    }
    let limit = usize::try_from(idem.max_response_body).unwrap_or(usize::MAX);
    let bytes = match sink.renewing(read_whole(incoming, limit)).await {
        Read::Whole(bytes) => bytes,
        Read::Over { prefix, rest } => {
            // Too large to save: it reaches this client whole, and repeats get `-32096`
            // (`response-not-replayable`), as on any route.
            sink.settle(Settlement::of_over(idem, &parts), &context)
                .await;
            let body = upstream::chain(prefix, rest);
            return (Response::from_parts(parts, body), Outcome::Forwarded);
        }
        Read::Failed(what) => {
            // Cut: the rest of it is lost to this client too, which is told so.
            sink.settle(of_unknown(&context, what.clone()), &context)
                .await;
            return refuse(
                Problem::UpstreamFailed {
                    upstream: up.name().to_owned(),
                    detail: what,
                },
                Outcome::UpstreamError,
            );
        }
    };
    sink.settle(of_body(&context, &call, &parts, &bytes), &context)
        .await;
    (first_response(parts, bytes), Outcome::Forwarded)
}

/// A body read up to a bound.
enum Read {
    Whole(Bytes),
    /// Over the bound: what was read, and the rest still to stream.
    Over {
        prefix: Bytes,
        rest: Body,
    },
    /// It failed (cut, timed out): what came instead, in words.
    Failed(String),
}

/// Reads a body whole, up to `limit` bytes.
async fn read_whole(mut incoming: Body, limit: usize) -> Read {
    let mut buf = bytes::BytesMut::new();
    while let Some(frame) = incoming.frame().await {
        let frame = match frame {
            Ok(frame) => frame,
            Err(e) => {
                return Read::Failed(format!("the response body failed: {}", error_chain(&*e)));
            }
        };
        if let Ok(data) = frame.into_data() {
            buf.extend_from_slice(&data);
            if buf.len() > limit {
                return Read::Over {
                    prefix: buf.freeze(),
                    rest: incoming,
                };
            }
        }
    }
    Read::Whole(buf.freeze())
}

/// Marks the answer to a claimed call that was a `202` with no body, for the count.
#[derive(Debug, Clone, Copy)]
pub(super) struct Unanswered;

/// What the head of a call's answer alone settles: a `4xx`, a `retry_statuses` status, a head
/// the upstream refused or a `202` with no body (`empty`) is not the call's result, and a
/// status that is not a success leaves its outcome unknown. `None`: read the body.
fn of_head(context: &Context, parts: &http::response::Parts, empty: bool) -> Option<Settlement> {
    let status = parts.status;
    if status == StatusCode::ACCEPTED && empty {
        tracing::warn!(
            route = %context.route.name,
            "a claimed call was answered 202 with no body (a server of the old HTTP+SSE transport?): released, not exactly-once"
        );
    }
    if status.is_client_error()
        || context.policy.retry_statuses.contains(&status.as_u16())
        || upstream::refuses_head(parts)
        || (status == StatusCode::ACCEPTED && empty)
    {
        return Some(Settlement::not_the_call_result());
    }
    if !status.is_success() {
        let what = format!("the upstream answered {}", status.as_u16());
        return Some(of_unknown(context, what));
    }
    None
}

/// A `2xx` body read whole: the response to the call in it, or an unknown outcome.
fn of_body(
    context: &Context,
    call: &Call,
    parts: &http::response::Parts,
    bytes: &Bytes,
) -> Settlement {
    match jsonrpc::find_response(call, bytes) {
        Some(found) => of_found(context, parts.status, &parts.headers, &found),
        None => of_unknown(
            context,
            format!(
                "the upstream answered {} with no response to the call",
                parts.status.as_u16()
            ),
        ),
    }
}

/// The response to the call, found: saved, or released for a `retry_errors` code or a result
/// that asks for input.
fn of_found(
    context: &Context,
    status: StatusCode,
    headers: &http::HeaderMap,
    found: &Found,
) -> Settlement {
    let retry_errors = context
        .route
        .settings
        .jsonrpc
        .as_ref()
        .map_or(&[][..], |j| &j.retry_errors[..]);
    Settlement::of_call(
        saved(context, status, headers, found),
        found.releases(retry_errors),
    )
}

/// Whether a response's body is an event stream.
fn is_event_stream(headers: &http::HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("text/event-stream"))
}

/// What is saved for a call's response: the status, the headers a replay carries (never the
/// session, nor the content type, which follows what the repeat accepts) and the member.
fn saved(
    context: &Context,
    status: StatusCode,
    headers: &http::HeaderMap,
    found: &Found,
) -> SavedResponse {
    let headers = saved_headers(headers, &context.policy)
        .into_iter()
        .filter(|(name, _)| {
            *name != MCP_SESSION_ID
                && *name != header::CONTENT_TYPE
                && *name != header::CONTENT_LENGTH
        })
        .collect();
    SavedResponse {
        status,
        headers,
        body: found.member.clone(),
    }
}

/// The call's outcome is unknown (`what` came instead of its response): `keep` saves the
/// proxy's `-32095`, `release` frees the key.
fn of_unknown(context: &Context, what: String) -> Settlement {
    let problem = Problem::UpstreamFailed {
        upstream: context.route.upstream.name().to_owned(),
        detail: format!("No response to the call came: {what}. It may have been performed."),
    };
    let error = SavedResponse {
        status: StatusCode::OK,
        headers: vec![(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        body: jsonrpc::error_member(&problem),
    };
    Settlement::of_call_unknown(&context.policy, error, what)
}

/// The client's body of an event stream: frames passed on as they arrive, from a task that
/// reads the upstream's stream to its end, finds the response to the call and settles the key.
fn stream(
    context: Arc<Context>,
    call: Arc<Call>,
    sink: Sink,
    parts: &http::response::Parts,
    incoming: Body,
) -> Body {
    let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, BoxError>>(STREAM_FRAMES);
    let pump = Pump {
        context: context.clone(),
        call,
        sink: Some(sink),
        status: parts.status,
        headers: parts.headers.clone(),
        tx: Some(tx),
    };
    context
        .shared
        .tasks
        .spawn(crate::traces::carried(pump.run(incoming)));
    StreamBody::new(Frames(rx)).boxed_unsync()
}

/// The frames a [`Pump`] passes on, as a stream.
struct Frames(mpsc::Receiver<Result<Frame<Bytes>, BoxError>>);

impl futures_util::Stream for Frames {
    type Item = Result<Frame<Bytes>, BoxError>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.0.poll_recv(cx)
    }
}

/// The reading of one event stream.
struct Pump {
    context: Arc<Context>,
    call: Arc<Call>,
    /// Held until the response to the call is settled.
    sink: Option<Sink>,
    /// The answer's status and headers, for what is saved.
    status: StatusCode,
    headers: http::HeaderMap,
    /// To the client, while it reads.
    tx: Option<mpsc::Sender<Result<Frame<Bytes>, BoxError>>>,
}

impl Pump {
    async fn run(mut self, mut incoming: Body) {
        let limit = usize::try_from(self.context.policy.max_response_body).unwrap_or(usize::MAX);
        let mut events = Some(EventStream::new(limit));
        let end = loop {
            let frame = match self.sink.as_mut() {
                Some(sink) => sink.renewing(incoming.frame()).await,
                None => incoming.frame().await,
            };
            let frame = match frame {
                None => break "the event stream ended before the response to the call".to_owned(),
                Some(Err(e)) => {
                    let what = format!(
                        "the event stream failed before the response to the call: {}",
                        error_chain(&*e)
                    );
                    self.pass(Err(e)).await;
                    break what;
                }
                Some(Ok(frame)) => frame,
            };
            let mut found = None;
            let mut read = Ok(());
            if self.sink.is_some()
                && let (Some(data), Some(parser)) = (frame.data_ref(), events.as_mut())
            {
                let call = &self.call;
                read = parser.feed(data, |event| {
                    if found.is_none() {
                        found = jsonrpc::find_response(call, &event);
                    }
                });
            }
            if let Err(e) = read {
                // Past the bound nothing more is read for the response; the stream still
                // reaches the client.
                tracing::warn!(route = %self.context.route.name, error = %e, "event stream not read further for the response to the call");
                events = None;
            }
            // Taken only with a response in hand: the lease is held until then.
            if let Some(found) = found
                && let Some(sink) = self.sink.take()
            {
                let settlement = of_found(&self.context, self.status, &self.headers, &found);
                sink.settle(settlement, &self.context).await;
            }
            self.pass(Ok(frame)).await;
        };
        if let Some(sink) = self.sink.take() {
            sink.settle(of_unknown(&self.context, end), &self.context)
                .await;
        }
    }

    /// Passes a frame to the client, if it is still there (the lease renewed meanwhile: a
    /// slow client must not let it lapse).
    async fn pass(&mut self, frame: Result<Frame<Bytes>, BoxError>) {
        let Some(tx) = &self.tx else { return };
        let sent = match self.sink.as_mut() {
            Some(sink) => sink.renewing(tx.send(frame)).await,
            None => tx.send(frame).await,
        };
        if sent.is_err() {
            // The client left: the stream is still read to its end, for the save.
            self.tx = None;
        }
    }
}
