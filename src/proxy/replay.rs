//! Replay: a finished operation, as its repeats get it — the saved status, headers and body,
//! byte for byte, plus `Idempotent-Replayed: true`.

use http::Response;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};

use super::matched::{Answer, refuse};
use crate::body::{self, Body};
use crate::metrics::Outcome;
use crate::problem::Problem;
use crate::record::{Saved, SavedResponse};
use crate::route::IdempotencySettings;

/// The header added to every replayed response.
pub(crate) const REPLAYED: &str = "idempotent-replayed";

/// The header added to the replay of a response a resolution found.
pub(crate) const RESOLVED: &str = "idempotent-resolved";

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
    }
}

/// A response made of saved parts; `Content-Length` follows the body.
fn response_of(saved: SavedResponse) -> Response<Body> {
    let len = saved.body.len();
    let mut resp = Response::new(body::full(saved.body));
    *resp.status_mut() = saved.status;
    let headers = resp.headers_mut();
    headers.reserve(saved.headers.len() + 2);
    for (name, value) in saved.headers {
        headers.append(name, value);
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
