//! The proxy's limits on a request head, kept in its service rather than by hyper so that
//! HTTP/1.1 and HTTP/2 get the same answer for them (SPEC §4.3): how many header fields, and
//! how many bytes of head, counted as HTTP/1.1 — the upstream's protocol — writes them.

use http::{Request, header};

use crate::problem::HeadLimit;

/// At most this many request headers: 100 (hyper's and many servers' limit) less the three
/// `X-Forwarded-*` the proxy adds. A request the upstream would refuse while parsing must be
/// refused here, before a claim: otherwise the upstream's 431 would be saved as the operation's
/// result and replayed to every retry, though nothing ran.
pub(super) const MAX_HEADERS: usize = 97;
/// At most this many bytes of request head: request line and headers, as HTTP/1.1 writes them.
pub(super) const MAX_HEAD_BYTES: usize = 64 * 1024;
/// hyper's own bounds on the main listener (HTTP/1.1 header count and read buffer, HTTP/2
/// header list) are this many times the proxy's limits, so that a head over the proxy's limits
/// still reaches the service, which refuses it with the same problem on either protocol (SPEC
/// §4.3). Only a head beyond hyper's bound gets hyper's own answer (a bare 431 on HTTP/1.1);
/// the bound keeps what one connection can make the proxy buffer small.
pub(super) const HYPER_HEAD_FACTOR: usize = 4;

/// The limit the request's head is over, if any: more than [`MAX_HEADERS`] header fields, or
/// more than [`MAX_HEAD_BYTES`] of head, both counted as the head would be written on HTTP/1.1
/// (the upstream's protocol), whichever protocol it came on.
///
/// An HTTP/2 request carries its host in the `:authority` pseudo-header, which becomes a `Host`
/// line upstream, so it counts as one header; its other pseudo-headers make the request line.
pub(super) fn over_head_limits<B>(req: &Request<B>) -> Option<HeadLimit> {
    let uri = req.uri();
    let has_host = req.headers().contains_key(header::HOST);
    let authority_as_host = if has_host { None } else { uri.authority() };
    let count = req.headers().len() + usize::from(authority_as_host.is_some());
    if count > MAX_HEADERS {
        return Some(HeadLimit::Count(MAX_HEADERS));
    }
    (head_size(req, authority_as_host) > MAX_HEAD_BYTES).then_some(HeadLimit::Bytes(MAX_HEAD_BYTES))
}

/// The bytes of `req`'s head written as HTTP/1.1: `METHOD target HTTP/1.1`, a `name: value`
/// line a header (and a `host` line for `authority_as_host`), each ended by CR LF, and the
/// blank line.
fn head_size<B>(req: &Request<B>, authority_as_host: Option<&http::uri::Authority>) -> usize {
    const CRLF: usize = 2;
    const HTTP11: usize = " HTTP/1.1".len();
    let uri = req.uri();
    let path_and_query = uri.path_and_query().map_or(1, |pq| pq.as_str().len());
    // An HTTP/1.1 request in absolute form (`POST http://host/path`) sent its scheme and
    // authority in the request line; an HTTP/2 request's are pseudo-headers, counted apart.
    let absolute = match (req.version(), uri.scheme_str(), uri.authority()) {
        (v, Some(scheme), Some(authority)) if v < http::Version::HTTP_2 => {
            scheme.len() + "://".len() + authority.as_str().len()
        }
        _ => 0,
    };
    let mut size = req.method().as_str().len() + 1 + absolute + path_and_query + HTTP11 + CRLF;
    for (name, value) in req.headers() {
        size += name.as_str().len() + ": ".len() + value.len() + CRLF;
    }
    if let Some(authority) = authority_as_host {
        size += "host: ".len() + authority.as_str().len() + CRLF;
    }
    size + CRLF
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(version: http::Version, uri: &str, headers: &[(&str, &str)]) -> Request<()> {
        let mut req = Request::builder().method("POST").uri(uri).version(version);
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        req.body(()).expect("request")
    }

    #[test]
    fn the_head_size_is_the_head_as_http1_writes_it() {
        let h1 = request(
            http::Version::HTTP_11,
            "/bookings?x=1",
            &[("host", "shop.test"), ("idempotency-key", "k1")],
        );
        let wire = "POST /bookings?x=1 HTTP/1.1\r\nhost: shop.test\r\nidempotency-key: k1\r\n\r\n";
        assert_eq!(head_size(&h1, None), wire.len());
        // The same request over HTTP/2: the authority becomes the host line.
        let h2 = request(
            http::Version::HTTP_2,
            "http://shop.test/bookings?x=1",
            &[("idempotency-key", "k1")],
        );
        let authority = h2.uri().authority().cloned();
        assert_eq!(head_size(&h2, authority.as_ref()), wire.len());
    }

    #[test]
    fn heads_over_either_limit_are_refused_on_both_protocols() {
        let filler = |n: usize| -> Vec<(String, String)> {
            (0..n)
                .map(|i| (format!("x-f-{i}"), "1".to_owned()))
                .collect()
        };
        for (version, uri, host) in [
            (http::Version::HTTP_11, "/bookings", true),
            (http::Version::HTTP_2, "http://shop.test/bookings", false),
        ] {
            let build = |extra: &[(String, String)]| {
                let mut headers: Vec<(&str, &str)> = extra
                    .iter()
                    .map(|(n, v)| (n.as_str(), v.as_str()))
                    .collect();
                if host {
                    headers.push(("host", "shop.test"));
                }
                request(version, uri, &headers)
            };
            // The host counts as one, on either protocol.
            assert_eq!(over_head_limits(&build(&filler(96))), None, "{version:?}");
            assert_eq!(
                over_head_limits(&build(&filler(97))),
                Some(HeadLimit::Count(MAX_HEADERS)),
                "{version:?}"
            );
            let big = vec![("x-big".to_owned(), "v".repeat(MAX_HEAD_BYTES))];
            assert_eq!(
                over_head_limits(&build(&big)),
                Some(HeadLimit::Bytes(MAX_HEAD_BYTES)),
                "{version:?}"
            );
            let fits = vec![("x-big".to_owned(), "v".repeat(MAX_HEAD_BYTES - 200))];
            assert_eq!(over_head_limits(&build(&fits)), None, "{version:?}");
        }
    }
}
