//! Upstream answers that are not an operation's result: an upstream's refusal of the request's
//! head (SPEC §4.3) means the operation never ran, so it is never saved as the key's result.

use http::StatusCode;

/// Whether an upstream's answer refuses the request's head rather than answering the operation
/// (SPEC §4.3), so it must never be saved as the key's result: `431` and `414`, and nothing
/// else. A `400` is the operation's result like any other 4xx, whatever headers come with it:
/// servers that close every connection (gunicorn's `sync` worker, Apache with `KeepAlive Off`)
/// send `Connection: close` on an application's "card declined" as on a parser's refusal, and
/// taking the one for the other would run a declined operation again on every retry.
pub(crate) fn refuses_head(parts: &http::response::Parts) -> bool {
    matches!(
        parts.status,
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE | StatusCode::URI_TOO_LONG
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Response;

    #[test]
    fn a_head_refusal_is_431_or_414_and_a_400_is_a_result_whatever_its_headers() {
        let parts = |status: u16, connection: Option<&str>| {
            let mut resp = Response::builder().status(status);
            if let Some(value) = connection {
                resp = resp.header("connection", value);
            }
            resp.body(()).expect("response").into_parts().0
        };
        assert!(refuses_head(&parts(431, None)));
        assert!(refuses_head(&parts(414, None)));
        assert!(refuses_head(&parts(431, Some("close"))));
        assert!(
            !refuses_head(&parts(400, Some("close"))),
            "a 400 that closes"
        );
        assert!(!refuses_head(&parts(400, None)), "an application's 400");
        assert!(!refuses_head(&parts(422, Some("close"))));
        assert!(!refuses_head(&parts(201, None)));
    }
}
