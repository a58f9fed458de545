//! Request admission: `proxy::admission::check_head` on arbitrary request heads (method, URI,
//! headers, any number of key lines and `Content-Length` values) against five routes, then, for
//! an admitted head, what the proxy computes next: `fingerprint::compute`, and `key::key_id` for
//! a sent key or `key_from::read` and `key_from::derived_key` for a derived one.
//!
//! Invariants: never panics; the decision agrees with SPEC (exactly one valid key line, a
//! declared length within `max_request_body`, no `Connection` line naming a header that
//! idempotency reads; a sent key wins over `key_from`; no key on a non-required route without
//! `key_from` is plain traffic); a refusal is a problem whose status is the one its outcome
//! implies (400 missing or invalid key, or the Connection conflict; 413 too large) and whose
//! problem+json document says so; an admitted key keeps the key rules; a derived key is a valid
//! key too; fingerprint, key id and derived key are deterministic.
#![no_main]

use std::sync::LazyLock;

use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Uri, header};
use idemproxy::config::{Config, FingerprintPart, RouteSettings};
use idemproxy::key_from;
use idemproxy::metrics::Outcome;
use idemproxy::problem::TYPE_PREFIX;
use idemproxy::proxy::admission::{KeySource, check_head};
use idemproxy::route::KeyPart;
use idemproxy::{fingerprint, key};
use idemproxy_fuzz::{assert_key_rules, expected_key};
use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;

/// Routes to admit against (a path pattern and an idempotency policy), loaded the way the proxy
/// loads them.
const POLICIES: &[(&str, &str)] = &[
    // Every default.
    ("/*", "idempotency: {}"),
    // A key is optional.
    ("/*", "idempotency:\n      required: false"),
    // Another header, a tiny body bound, keys shared across callers, a header fingerprinted.
    (
        "/*",
        "idempotency:\n      header: X-Request-Id\n      max_request_body: 16\n      scope: []\n      fingerprint: [method, \"header:X-Tenant\", body]",
    ),
    // Optional key, the smallest bound, two scope headers.
    (
        "/*",
        "idempotency:\n      required: false\n      max_request_body: 1\n      scope: [Authorization, X-Tenant]",
    ),
    // A key derived from the request when no key header is sent; the body fingerprinted as JSON.
    (
        "/tickets/{ticket_id}/*",
        "idempotency:\n      key_from: [\"path:ticket_id\", \"json:/order/id\", \"query:ref\", \"header:X-Tenant\", \"header:X-Correlation\", method]\n      fingerprint: [method, path, query, json, \"header:X-Tenant\"]",
    ),
];

static ROUTES: LazyLock<Vec<RouteSettings>> = LazyLock::new(|| {
    POLICIES
        .iter()
        .map(|(path, policy)| {
            let yaml = format!(
                "listen: 127.0.0.1:8080\nupstreams:\n  booking:\n    url: http://127.0.0.1:8081\nroutes:\n  - name: r\n    path: {path}\n    upstream: booking\n    {policy}\n"
            );
            let config = Config::from_yaml(&yaml).expect("the fuzz target's policy loads");
            let route = config.routes[0].clone();
            assert!(route.idempotency.is_some(), "an idempotent route");
            route
        })
        .collect()
});

#[derive(Debug, Arbitrary)]
enum Length {
    Number(u64),
    Text(Vec<u8>),
}

/// Header names and values that mean something to admission, so that the fuzzer combines them
/// (a `Connection` line naming the key header, say) without having to spell them.
const NAMES: &[&str] = &[
    "idempotency-key",
    "x-request-id",
    "content-length",
    "connection",
    "authorization",
    "x-tenant",
    "x-correlation",
    "transfer-encoding",
    "keep-alive",
    "upgrade",
];
const VALUES: &[&str] = &[
    "idempotency-key",
    "Idempotency-Key",
    "X-Request-Id",
    "authorization",
    "x-tenant",
    "close",
    "keep-alive, Idempotency-Key",
    " x-tenant ,close",
    "X-Correlation",
    "\"abc\"",
    "0",
    "17",
];

/// URIs that reach the `path:` and `query:` parts of `key_from`.
const URIS: &[&str] = &[
    "/tickets/T-1/refund?ref=r1",
    "/tickets/T%2D1/refund?ref=r%31&x=1",
    "/tickets/T-1?ref=a&ref=b",
    "/tickets//x",
    "/bookings",
];

/// Bodies that reach the JSON paths of `key_from` and the `json` fingerprint.
const BODIES: &[&str] = &[
    r#"{"order":{"id":"A1"}}"#,
    r#"{"order":{"id":1.0},"x":[1,2]}"#,
    r#"{"order":{"id":10e-1}}"#,
    r#"{"order":{"id":123456789012345678901234567890}}"#,
    r#"{"order":{"id":true}}"#,
    r#"{"order":{"id":null}}"#,
    r#"{"order":[]}"#,
];

#[derive(Debug, Arbitrary)]
enum Text {
    Known(u8),
    Raw(Vec<u8>),
}

impl Text {
    fn bytes<'a>(&'a self, known: &[&'static str]) -> &'a [u8] {
        match self {
            Text::Known(i) => known[usize::from(*i) % known.len()].as_bytes(),
            Text::Raw(b) => b,
        }
    }
}

#[derive(Debug, Arbitrary)]
struct Head {
    policy: u8,
    method: Vec<u8>,
    uri: Text,
    /// Values of the route's key header, one line each.
    keys: Vec<Vec<u8>>,
    /// `Content-Length` lines.
    lengths: Vec<Length>,
    /// Any other headers (which may also be the key header, `Content-Length` or `Connection`).
    headers: Vec<(Text, Text)>,
    body: Text,
}

fuzz_target!(|head: Head| {
    let route = &ROUTES[usize::from(head.policy) % ROUTES.len()];
    let Some(idem) = &route.idempotency else {
        return;
    };
    let body = head.body.bytes(BODIES);

    let mut headers = HeaderMap::new();
    for (name, value) in &head.headers {
        let (name, value) = (name.bytes(NAMES), value.bytes(VALUES));
        if let (Ok(n), Ok(v)) = (HeaderName::from_bytes(name), HeaderValue::from_bytes(value)) {
            headers.append(n, v);
        }
    }
    for k in &head.keys {
        if let Ok(v) = HeaderValue::from_bytes(k) {
            headers.append(idem.header.clone(), v);
        }
    }
    for l in &head.lengths {
        let v = match l {
            Length::Number(n) => Some(HeaderValue::from(*n)),
            Length::Text(t) => HeaderValue::from_bytes(t).ok(),
        };
        if let Some(v) = v {
            headers.append(header::CONTENT_LENGTH, v);
        }
    }
    let (mut parts, ()) = Request::new(()).into_parts();
    parts.method = Method::from_bytes(&head.method).unwrap_or(Method::POST);
    parts.uri =
        Uri::try_from(head.uri.bytes(URIS)).unwrap_or_else(|_| Uri::from_static("/bookings"));
    parts.headers = headers;

    // What SPEC says of this head, modelled apart from the code under test.
    let key_lines: Vec<&HeaderValue> = parts.headers.get_all(&idem.header).iter().collect();
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| std::str::from_utf8(v.as_bytes()).ok())
        .and_then(|v| v.parse::<u64>().ok());
    let too_large = declared.is_some_and(|n| n > idem.max_request_body);
    // A `Connection` line naming a header idempotency reads would have a hop strip it on the way
    // upstream: refused. The key header, a scope header and a fingerprinted header always count;
    // a `key_from` header surely counts when the key is derived from it.
    let named = |read: &dyn Fn(&str) -> bool| {
        parts
            .headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|token| read(&token.trim().to_ascii_lowercase()))
    };
    let conflict = named(&|name| {
        name == idem.header.as_str()
            || idem.scope.iter().any(|h| h.as_str() == name)
            || idem
                .fingerprint
                .iter()
                .any(|p| matches!(p, FingerprintPart::Header(h) if h.as_str() == name))
    });
    let key_from_conflict = named(&|name| {
        idem.key_from
            .iter()
            .any(|p| matches!(p, KeyPart::Header(h) if h.as_str() == name))
    });
    // The head's key is acceptable: one valid line, or none on a route that derives one.
    let deriving = key_lines.is_empty() && !idem.key_from.is_empty();
    let key_ok =
        (key_lines.len() == 1 && expected_key(key_lines[0].as_bytes()).is_some()) || deriving;

    match check_head(idem, &parts) {
        Ok(KeySource::Header(key)) => {
            assert_eq!(
                key_lines.len(),
                1,
                "admitted with {} key lines",
                key_lines.len()
            );
            let raw = key_lines[0].as_bytes();
            assert_eq!(
                expected_key(raw).as_deref(),
                Some(key.as_bytes()),
                "admitted key of {raw:?}"
            );
            assert_key_rules(&key, raw);
            assert!(!too_large, "admitted a declared length of {declared:?}");
            assert!(
                !conflict,
                "admitted with a Connection line naming a header idempotency reads"
            );

            check_fingerprint(&idem.fingerprint, &parts, body);
            let id = key::key_id(&idem.scope, &parts.headers, &key);
            assert_eq!(id, key::key_id(&idem.scope, &parts.headers, &key));
        }
        Ok(KeySource::Derive) => {
            assert!(
                !idem.key_from.is_empty(),
                "a key to derive on a route without key_from"
            );
            assert!(
                key_lines.is_empty(),
                "a key line ignored: a sent key wins over key_from"
            );
            assert!(!too_large, "admitted a declared length of {declared:?}");
            assert!(
                !conflict && !key_from_conflict,
                "a key derived from a header that a Connection line names"
            );
            check_fingerprint(&idem.fingerprint, &parts, body);
            check_derived(route, &parts, body);
        }
        Ok(KeySource::None) => {
            assert!(!idem.required, "no key on a required route let through");
            assert!(
                idem.key_from.is_empty(),
                "no key derived on a route with key_from"
            );
            assert!(key_lines.is_empty(), "a key line ignored");
        }
        Err((problem, outcome)) => {
            let status = match outcome {
                Outcome::MissingKey => {
                    assert!(
                        idem.key_from.is_empty(),
                        "missing_key on a route with key_from"
                    );
                    assert!(
                        idem.required && key_lines.is_empty(),
                        "missing_key with {} key lines",
                        key_lines.len()
                    );
                    400
                }
                Outcome::InvalidKey => {
                    assert!(
                        key_lines.len() > 1
                            || key_lines
                                .first()
                                .is_some_and(|v| expected_key(v.as_bytes()).is_none()),
                        "invalid_key for the key lines {key_lines:?}"
                    );
                    400
                }
                Outcome::TooLarge => {
                    assert!(
                        too_large,
                        "too_large with a declared length of {declared:?}"
                    );
                    assert!(key_ok, "too_large before the key was checked");
                    413
                }
                Outcome::BadRequest => {
                    assert!(
                        conflict || key_from_conflict,
                        "bad_request from the head without a Connection conflict: {problem:?}"
                    );
                    assert!(key_ok, "bad_request before the key was checked");
                    400
                }
                other => panic!("the head alone refused with outcome {other:?}"),
            };
            assert_eq!(
                problem.status().as_u16(),
                status,
                "{problem:?} for outcome {outcome:?}"
            );

            let response = problem.response();
            assert_eq!(response.status().as_u16(), status);
            assert_eq!(
                response
                    .headers()
                    .get(header::CONTENT_TYPE)
                    .map(HeaderValue::as_bytes),
                Some(&b"application/problem+json"[..])
            );
            let doc: serde_json::Value =
                serde_json::from_slice(&problem.body()).expect("problem+json is JSON");
            assert_eq!(doc["status"], status);
            assert_eq!(doc["type"], format!("{TYPE_PREFIX}{}", problem.slug()));
            for field in ["title", "detail"] {
                assert!(
                    doc[field].as_str().is_some_and(|s| !s.is_empty()),
                    "no {field} in {doc}"
                );
            }
        }
    }
});

/// The fingerprint is a pure function of the head and the body.
fn check_fingerprint(fp: &[FingerprintPart], parts: &Parts, body: &[u8]) {
    assert_eq!(
        fingerprint::compute(fp, parts, body),
        fingerprint::compute(fp, parts, body)
    );
}

/// A derived key is read from the request, or refused naming the part; one that is read is
/// `derived-` and 64 hex digits, deterministic, and itself a valid key, since it goes upstream in
/// the key header; its store id is not the id of the same text sent as a key.
fn check_derived(route: &RouteSettings, parts: &Parts, body: &[u8]) {
    let Some(idem) = &route.idempotency else {
        return;
    };
    let values = match key_from::read(&idem.key_from, &route.path, parts, body) {
        Ok(values) => values,
        Err(e) => {
            assert!(!e.part.is_empty() && !e.why.is_empty(), "{e:?}");
            return;
        }
    };
    assert_eq!(values.len(), idem.key_from.len());
    assert_eq!(
        values,
        key_from::read(&idem.key_from, &route.path, parts, body).expect("read twice")
    );
    let derived = key_from::derived_key(&idem.key_from, &values, &idem.scope, &parts.headers);
    let hex = derived
        .strip_prefix("derived-")
        .expect("a derived key starts with derived-");
    assert!(
        hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()),
        "{derived}"
    );
    let value = HeaderValue::from_str(&derived).expect("a derived key is a header value");
    assert_eq!(key::parse(&value).as_deref(), Ok(derived.as_str()));
    assert_ne!(
        key_from::derived_id(&derived),
        key::key_id(&idem.scope, &parts.headers, &derived),
        "a sent key could land on a derived record"
    );
}
