//! The bundled mock booking service: a fake legacy booking API that counts its side effects.
//!
//! The demo puts the proxy in front of it, the integration tests use it to see whether the
//! upstream "ran the operation", and the benches use it as the baseline upstream.
//!
//! This crate answers requests ([`MockUpstream::handle`]) and brings no server, and it depends
//! on nothing of idemproxy (idemproxy depends on it). idemproxy serves it on its own listener
//! (HTTP/1.1, and HTTP/2 with prior knowledge) — in the `mock-upstream` binary, in
//! `idemproxy demo` and in the test harness — so everything the proxy does to a request or a
//! response crosses a real socket.
//!
//! # Routes
//!
//! | route | answer | counted |
//! | --- | --- | --- |
//! | `POST /bookings` | `201 Created`, a new booking `bk_N` (`N` = 1, 2, … never reused), with `Location: /bookings/bk_N`, `ETag`, `X-Booking-Id: bk_N` and the body `{"id":"bk_N","seq":N,"request":…}` (the request body, embedded as JSON if it is JSON, else as a string) | yes |
//! | `POST /reservations` | the same as `POST /bookings` (one store of bookings): a second path, for a proxy route of its own in front of it | yes |
//! | `POST /mcp` | a minimal MCP server (Streamable HTTP, JSON answers): `initialize`, `tools/list`, and `tools/call` of its one tool `book`, which makes a booking as `POST /bookings` does (its arguments are the booking's request) and answers `booked bk_N`; a notification gets `202` | yes |
//! | `GET /bookings/{id}` | `200` with the stored booking, or `404` | yes |
//! | `GET /bookings/by-reference/{reference}` | `200` with the first booking whose request body's `reference` (a JSON string) is `{reference}` (percent-decoded), as `GET /bookings/{id}` answers it; `404` `{"error":"no booking with this reference","reference":…}` when there is none (yet: see `X-Mock-Commit-After`) | yes |
//! | `POST /webhooks/{provider}` | `200` `{"received":true,"provider":…,"event_id":…,"deliveries":N}`: a webhook handler that counts deliveries per event id (`N`: this id's count so far; `event_id` `null` when the delivery has none), read where the provider puts it (`standard`: `webhook-id`; `github`: `X-GitHub-Delivery`; `shopify`: `X-Shopify-Webhook-Id`; `stripe`: the body's `id`; `slack`: the body's `event_id`; another name: `webhook-id`, else the body's `id`, else its `event_id`). It verifies no signature: the proxy does | yes |
//! | `POST /ledger.v1.Ledger/Transfer` (gRPC over HTTP/2, `content-type: application/grpc`) | a gRPC answer: one `TransferReply {posting_id: "p_N", postings}` message and `grpc-status: 0` in the trailers, counting the postings per `reference` of the `TransferRequest {reference, amount}` (`ledger`); a body that is not one such message is a trailers-only `INVALID_ARGUMENT` | yes |
//! | anything else outside `/_mock/` (`/echo/…`, `/payments`, …) | `200` with a JSON echo of what arrived: `{"method","path","query","headers":{name:[values]},"body"}` | yes |
//! | `GET /_mock/stats` | `{"total":N,"bookings":N,"by_key":{"KEY":N,…},"by_reference":{"REF":N,…},"webhooks":N,"events":{"ID":N,…},"postings":N,"postings_by_reference":{"REF":N,…}}` | no |
//! | `GET /_mock/calls?key=K` | `{"key":"K","calls":N}` | no |
//! | `POST /_mock/reset` | zeroes every counter and forgets the stored bookings (ids keep growing) | no |
//!
//! In the stats, `by_reference` counts the bookings made per `reference`, visible to a lookup
//! yet or not (so "one booking for that reference" can be checked whatever was lost), and
//! `events` the handled webhook deliveries per event id; `webhooks` counts every handled
//! delivery, with an id or without. Like a booking, a delivery is handled only when the route
//! runs (not under `X-Mock-Status`).
//!
//! Every JSON answer is compact, and object keys come in no particular order: read them as JSON,
//! not as text. An embedded request body is re-serialized, not copied byte for byte.
//!
//! A counted request is recorded — the total, and the count of its `Idempotency-Key` value as
//! received (a request without the header counts in the total only) — **as soon as its head and
//! body have been read, before any delay or failure below**: a request that is later reset, cut
//! short or answered with a 503 still counts as "the upstream ran the operation", which is exactly
//! the case the proxy has to handle.
//!
//! # Control headers
//!
//! Optional request headers that steer the answer of any counted route. An invalid value is
//! answered with `400` (the request is still counted).
//!
//! | header | effect |
//! | --- | --- |
//! | `X-Mock-Delay: 300ms` | wait that long (any `humantime` duration: `2s`, `1m`) before answering |
//! | `X-Mock-Status: 503` | answer with that status (200–599) and a JSON body describing it; the route itself does not run (no booking is created) |
//! | `X-Mock-Reset: true` | drop the connection abruptly, without a response (a TCP reset on HTTP/1, `RST_STREAM` on HTTP/2) |
//! | `X-Mock-Body-Size: N` | answer with exactly `N` bytes of [`body_pattern`], `Content-Type: application/octet-stream` |
//! | `X-Mock-Set-Cookie: v` | add `Set-Cookie: v` (repeatable) |
//! | `X-Mock-Header: Name: value` | add a response header (repeatable; the first one for a name replaces what the route set, later ones append), e.g. `Connection: x-foo`, `Keep-Alive: timeout=5` |
//! | `X-Mock-Partial: true` | send the head and half of the body, which is declared with its full `Content-Length`, then drop the connection |
//! | `X-Mock-Lose-Response: after` | the route runs (a booking is made, stored and counted), then the connection is dropped without a response, as `X-Mock-Reset` drops it: the response is lost *after* the side effect |
//! | `X-Mock-Lose-Response: before` | the connection is dropped without a response and the route does not run (no booking): lost *before* the side effect |
//! | `X-Mock-Hang: 30s` | after the route ran (after the booking was made), wait that long before answering — or, with `X-Mock-Lose-Response`, before dropping the connection. Longer than the proxy's upstream `timeout`, the proxy times out while the booking exists |
//! | `X-Mock-Commit-After: 3s` | `POST /bookings`: the booking is made and counted at once, but `GET /bookings/{id}` and the lookup by reference see it only that long after (a slow backend's write reaching its read side late) |
//!
//! Booleans accept `true`/`false`, `1`/`0`, `yes`/`no`; durations are `humantime`'s (`300ms`,
//! `2s`, `1m`). The order: the delay; then a reset (`X-Mock-Reset`), or, with
//! `X-Mock-Lose-Response: before`, the hang and the drop; otherwise the route (or the status),
//! then the hang; then, with `X-Mock-Lose-Response: after`, the drop; otherwise the body size,
//! headers and partial body combine.
//!
//! The cases of an unknown outcome (the proxy's `on_unknown_outcome`), modelled:
//!
//! | the response is lost… | headers |
//! | --- | --- |
//! | after the booking was made, at once (a reset) | `X-Mock-Lose-Response: after` |
//! | after the booking was made, after the proxy's `timeout` fired | `X-Mock-Lose-Response: after`, `X-Mock-Hang: 1m` |
//! | before the booking was made | `X-Mock-Lose-Response: before` (with `X-Mock-Hang` for a timeout) |
//! | and the booking shows up only later | `X-Mock-Lose-Response: after`, `X-Mock-Commit-After: 3s` |
//!
//! # Example
//!
//! ```
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use idemproxy_mock::MockUpstream;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mock = MockUpstream::new();
//! // A server hands each request to `handle`.
//! let request = http::Request::post("/bookings")
//!     .header("Idempotency-Key", "8e03978e-40d5-43e8-bc93-6894a57f9324")
//!     .body(Full::new(Bytes::from_static(br#"{"seat":"12A"}"#)))?;
//! let response = mock.handle(request).await?;
//! assert_eq!(response.status(), http::StatusCode::CREATED);
//! assert_eq!(mock.calls("8e03978e-40d5-43e8-bc93-6894a57f9324"), 1);
//! # Ok(())
//! # }
//! ```
//!
//! # Layout
//! - `state`: [`MockUpstream`], its counters and stored bookings.
//! - `directives`: the `X-Mock-*` control headers, parsed.
//! - `reply`: a response under construction; the echo, status and error answers.
//! - `body`: [`MockBody`], the response body, and [`body_pattern`].
//! - `query`: percent-decoding a query parameter (`/_mock/calls?key=K`) and a path segment.
//! - `webhook`: where each provider puts a webhook delivery's event id.
//! - `ledger`: the gRPC ledger's transfer, its framing and messages written by hand.
//! - `mcp`: `POST /mcp`, a minimal MCP server whose `book` tool makes a booking.

mod body;
mod directives;
mod ledger;
mod mcp;
mod query;
mod reply;
mod state;
mod webhook;

#[cfg(test)]
mod tests;

use std::collections::HashSet;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, SET_COOKIE};
use http::request::Parts;
use http::{Method, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde_json::json;

use directives::{Directives, Lose};
use query::{path_segment, query_param};
use reply::{Reply, echo_reply, error_reply, status_reply};

pub use body::{MockBody, body_pattern};
pub use ledger::{read_reply, transfer_request};
pub use state::{MockStats, MockUpstream, RecordedRequest};

/// Request bodies above this are answered with 413 and not counted. Far above anything the
/// proxy forwards; it only keeps a stray client from exhausting memory.
const MAX_REQUEST_BODY: usize = 64 * 1024 * 1024;

/// Why the mock gave up on a request instead of answering it: the server then closes the
/// connection without a response, which is the point for [`MockError::Reset`].
#[derive(Debug, thiserror::Error)]
pub enum MockError {
    /// `X-Mock-Reset` or `X-Mock-Lose-Response`: the server is to drop the connection
    /// abruptly, writing nothing more, not even a FIN (idemproxy's listener does it with
    /// `Peer::reset`).
    #[error("connection reset on request (X-Mock-Reset or X-Mock-Lose-Response)")]
    Reset,
    #[error("reading the request body failed")]
    RequestBody(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl MockUpstream {
    /// Answers one request as the [routes](crate#routes) and the
    /// [control headers](crate#control-headers) say; a counted route counts it before anything
    /// can delay or fail the answer. An `Err` is answered with no response at all: the server
    /// closes the connection.
    pub async fn handle<B>(&self, request: Request<B>) -> Result<Response<MockBody>, MockError>
    where
        B: Body,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let (parts, body) = request.into_parts();
        let body = match Limited::new(body, MAX_REQUEST_BODY).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(error) if error.is::<LengthLimitError>() => {
                return Ok(
                    error_reply(StatusCode::PAYLOAD_TOO_LARGE, "request body too large").finish(),
                );
            }
            Err(error) => return Err(MockError::RequestBody(error)),
        };

        if let Some(control) = parts.uri.path().strip_prefix("/_mock/") {
            return Ok(control_reply(self, &parts, control).finish());
        }

        // The side effect happens here, before anything below can delay or fail the answer.
        self.record(&parts, &body);

        let directives = match Directives::parse(&parts.headers) {
            Ok(directives) => directives,
            Err(message) => return Ok(error_reply(StatusCode::BAD_REQUEST, &message).finish()),
        };
        if let Some(delay) = directives.delay {
            tokio::time::sleep(delay).await;
        }
        if directives.reset {
            return Err(MockError::Reset);
        }
        if directives.lose == Some(Lose::Before) {
            if let Some(hang) = directives.hang {
                tokio::time::sleep(hang).await;
            }
            return Err(MockError::Reset);
        }

        let mut reply = match directives.status {
            Some(status) => status_reply(status, &parts),
            None => route(self, &parts, &body, &directives),
        };
        // The side effect has happened: what follows loses or delays only its answer.
        if let Some(hang) = directives.hang {
            tokio::time::sleep(hang).await;
        }
        if directives.lose == Some(Lose::After) {
            return Err(MockError::Reset);
        }
        if let Some(size) = directives.body_size {
            reply.body = MockBody::pattern(size);
            reply.insert(CONTENT_TYPE, "application/octet-stream");
        }
        let mut replaced = HashSet::new();
        for (name, value) in directives.headers {
            if replaced.insert(name.clone()) {
                reply.headers.insert(name, value);
            } else {
                reply.headers.append(name, value);
            }
        }
        for cookie in directives.set_cookies {
            reply.headers.append(SET_COOKIE, cookie);
        }
        if directives.partial {
            reply.body = reply.body.cut_short();
        }
        Ok(reply.finish())
    }
}

fn route(state: &MockUpstream, parts: &Parts, body: &Bytes, directives: &Directives) -> Reply {
    let path = parts.uri.path();
    let segment = |prefix: &str| {
        path.strip_prefix(prefix)
            .filter(|rest| !rest.is_empty() && !rest.contains('/'))
    };
    // `/reservations` books as `/bookings` does: a second path, so that a proxy can put a route
    // of its own (another policy) in front of the same bookings.
    if parts.method == Method::POST && (path == "/bookings" || path == "/reservations") {
        return state.create_booking(body, directives.commit_after);
    }
    if parts.method == Method::POST && path == "/mcp" {
        return mcp::answer(state, body);
    }
    if parts.method == Method::GET {
        if let Some(raw) = segment("/bookings/by-reference/") {
            return match path_segment(raw) {
                Some(reference) => state.booking_by_reference(&reference),
                None => error_reply(StatusCode::NOT_FOUND, "no booking with this reference"),
            };
        }
        if let Some(id) = segment("/bookings/") {
            return state.get_booking(id);
        }
    }
    if parts.method == Method::POST {
        if path == ledger::TRANSFER {
            return match ledger::read_transfer(body) {
                Some(transfer) => state.post_transfer(transfer),
                None => ledger::invalid(),
            };
        }
        if let Some(provider) = segment("/webhooks/") {
            let event_id = webhook::event_id(provider, &parts.headers, body);
            return state.receive_webhook(provider, event_id);
        }
    }
    echo_reply(parts, body)
}

fn control_reply(state: &MockUpstream, parts: &Parts, control: &str) -> Reply {
    match (&parts.method, control) {
        (&Method::GET, "stats") => Reply::json(StatusCode::OK, &state.stats_json()),
        (&Method::GET, "calls") => {
            let Some(key) = query_param(parts.uri.query().unwrap_or(""), "key") else {
                return error_reply(StatusCode::BAD_REQUEST, "missing query parameter: key");
            };
            let calls = state.calls(&key);
            Reply::json(StatusCode::OK, &json!({ "key": key, "calls": calls }))
        }
        (&Method::POST, "reset") => {
            state.reset();
            Reply::json(StatusCode::OK, &json!({ "reset": true }))
        }
        (_, "stats" | "calls" | "reset") => {
            error_reply(StatusCode::METHOD_NOT_ALLOWED, "method not allowed")
        }
        _ => error_reply(StatusCode::NOT_FOUND, "unknown control endpoint"),
    }
}
