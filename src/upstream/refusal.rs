//! Upstream answers that are not an operation's result: an upstream's refusal of the request's
//! head (SPEC §4.3) means the operation never ran, so it is never saved as the key's result.

use http::StatusCode;
use http::header::{self, HeaderMap};

/// Set in a response's extensions when the upstream sent `Connection: close` on it: the header
/// itself is hop-by-hop, removed before anyone else sees the response.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ClosedByUpstream;

/// Whether an upstream's answer refuses the request's head rather than answering the operation
/// (SPEC §4.3), so it must never be saved as the key's result: `431` and `414` always; `400`
/// only when it closes the connection, which is what HTTP parsers do when they give up on a
/// head (nginx, Node, Go, gunicorn), while an application's `400` leaves it open.
pub(crate) fn refuses_head(parts: &http::response::Parts) -> bool {
    match parts.status {
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE | StatusCode::URI_TOO_LONG => true,
        StatusCode::BAD_REQUEST => parts.extensions.get::<ClosedByUpstream>().is_some(),
        _ => false,
    }
}

/// Whether `Connection` says the upstream closes the connection after this response.
pub(super) fn says_close(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("close"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderValue, Response};

    #[test]
    fn a_head_refusal_is_431_414_or_a_400_that_closes_the_connection() {
        let parts = |status: u16, close: bool| {
            let (mut parts, ()) = Response::builder()
                .status(status)
                .body(())
                .expect("response")
                .into_parts();
            if close {
                parts.extensions.insert(ClosedByUpstream);
            }
            parts
        };
        assert!(refuses_head(&parts(431, false)));
        assert!(refuses_head(&parts(414, false)));
        assert!(refuses_head(&parts(400, true)), "a parser's 400");
        assert!(!refuses_head(&parts(400, false)), "an application's 400");
        assert!(!refuses_head(&parts(422, true)));
        assert!(!refuses_head(&parts(201, true)));
        let mut h = HeaderMap::new();
        h.append("connection", HeaderValue::from_static("keep-alive"));
        assert!(!says_close(&h));
        h.append("connection", HeaderValue::from_static("x-a, Close"));
        assert!(says_close(&h));
    }
}
