//! Replay: a finished operation, as its repeats get it — the saved status, headers and body,
//! byte for byte, plus `Idempotent-Replayed: true`.

use http::Response;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};

use super::matched::{Answer, refuse};
use crate::body::{self, Body};
use crate::jsonrpc::{self, Call};
use crate::metrics::Outcome;
use crate::problem::Problem;
use crate::record::{DELIVERY_LABEL, Saved, SavedResponse};
use crate::route::IdempotencySettings;

/// The header added to every replayed response. A `HeaderName` made once: inserting by a
/// `&str` parses and checks the name again on every replay.
pub(crate) const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The header added to the replay of a response a resolution found.
pub(crate) const RESOLVED: HeaderName = HeaderName::from_static("idempotent-resolved");

/// The answer to a repeat of a finished operation.
pub(super) fn replay(saved: Saved) -> Answer {
    match saved {
        Saved::Response(saved) => {
            let mut resp = response_of(saved);
            resp.headers_mut()
                .insert(REPLAYED, HeaderValue::from_static("true"));
            (resp, Outcome::Replayed)
        }
        Saved::Resolved(saved) => {
            let mut resp = response_of(saved);
            let headers = resp.headers_mut();
            headers.insert(REPLAYED, HeaderValue::from_static("true"));
            headers.insert(RESOLVED, HeaderValue::from_static("true"));
            (resp, Outcome::Replayed)
        }
        Saved::NotReplayable { status } => {
            refuse(Problem::NotReplayable { status }, Outcome::NotReplayable)
        }
        Saved::Trailed { response, trailers } => {
            let SavedResponse {
                status,
                headers,
                body: data,
            } = response;
            let (mut parts, _) = response_of(SavedResponse {
                status,
                headers,
                body: bytes::Bytes::new(),
            })
            .into_parts();
            // No Content-Length: the body ends with trailers, as the upstream sent it.
            parts.headers.remove(header::CONTENT_LENGTH);
            parts
                .headers
                .insert(REPLAYED, HeaderValue::from_static("true"));
            let trailers: HeaderMap = trailers.into_iter().collect();
            let resp = Response::from_parts(parts, body::with_trailers(data, trailers));
            (resp, Outcome::Replayed)
        }
    }
}

/// The answer to a repeat of a finished JSON-RPC call (SPEC §4.10): the saved status and
/// headers, and the saved `result` or `error` in an envelope around the repeat's own `id`, as
/// `application/json` when the repeat takes it, else as a one-event `text/event-stream`.
pub(super) fn replay_call(saved: Saved, call: &Call) -> Answer {
    let (saved, resolved) = match saved {
        Saved::Response(saved) => (saved, false),
        Saved::Resolved(saved) => (saved, true),
        Saved::NotReplayable { status } => {
            return refuse(Problem::NotReplayable { status }, Outcome::NotReplayable);
        }
        // Not a call's record (a gRPC route's, before a reload made the route a JSON-RPC one):
        // as it was saved.
        trailed @ Saved::Trailed { .. } => return replay(trailed),
    };
    // A problem saved in place of a result (`result-not-kept`) is the call's error too, and
    // answered as the proxy's own answers to a call are: `200`.
    let (message, status) = match jsonrpc::replay_body(call, &saved.body) {
        Some(message) => (Some(message), saved.status),
        None => (
            jsonrpc::member_of_document(&saved.body)
                .and_then(|member| jsonrpc::replay_body(call, &member)),
            http::StatusCode::OK,
        ),
    };
    let Some(message) = message else {
        // Not a call's record (saved before the route was a JSON-RPC one): as it was saved.
        return replay(if resolved {
            Saved::Resolved(saved)
        } else {
            Saved::Response(saved)
        });
    };
    let (body, content_type) = if call.wants_json() {
        (message, "application/json")
    } else {
        (jsonrpc::as_event(&message), "text/event-stream")
    };
    let mut resp = response_of(SavedResponse {
        status,
        headers: saved
            .headers
            .into_iter()
            .filter(|(name, _)| *name != header::CONTENT_TYPE)
            .collect(),
        body,
    });
    let headers = resp.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(REPLAYED, HeaderValue::from_static("true"));
    if resolved {
        headers.insert(RESOLVED, HeaderValue::from_static("true"));
    }
    (resp, Outcome::Replayed)
}

/// A response made of saved parts; `Content-Length` follows the body.
fn response_of(saved: SavedResponse) -> Response<Body> {
    let len = saved.body.len();
    let mut resp = Response::new(body::full(saved.body));
    *resp.status_mut() = saved.status;
    let headers = resp.headers_mut();
    headers.reserve(saved.headers.len() + 2);
    for (name, value) in saved.headers {
        // Kept for the key tooling, never sent (a webhook delivery's label).
        if name != DELIVERY_LABEL {
            headers.append(name, value);
        }
    }
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    resp
}

/// The headers saved for replay: everything end-to-end except `Content-Length` (it follows the
/// replayed body) and, unless `replay_set_cookie`, `Set-Cookie`. Hop-by-hop headers were
/// already removed.
pub(in crate::proxy) fn saved_headers(
    headers: &HeaderMap,
    idem: &IdempotencySettings,
) -> Vec<(HeaderName, HeaderValue)> {
    headers
        .iter()
        .filter(|(name, _)| {
            *name != header::CONTENT_LENGTH
                && (idem.replay_set_cookie || *name != header::SET_COOKIE)
        })
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect()
}
