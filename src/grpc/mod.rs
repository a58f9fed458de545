//! gRPC on a route with a `grpc:` block (SPEC §4.11): which requests are calls, what a call's
//! response says about the call, and the proxy's own answers as gRPC statuses.
//!
//! A call is claimed, forwarded, saved and replayed by the shared flow, as any request: this
//! module only reads and writes what gRPC adds — the content type, the `grpc-status` of a
//! response (in its trailers, or in its headers for a trailers-only response), and the
//! trailers-only answer that carries one of the proxy's problems (HTTP `200`, `content-type:
//! application/grpc`, `grpc-status`, `grpc-message`, and the problem's type in
//! `idemproxy-problem-type`).
//!
//! This module imports no store, upstream or flow: it takes heads and problems and answers.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Response, StatusCode};

use crate::body::{self, Body};
use crate::problem::Problem;
use crate::record::SavedResponse;

/// `grpc-status`.
pub const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
/// `grpc-message`.
pub const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
/// `grpc-retry-pushback-ms`: when a client's retry policy may try again.
pub const GRPC_RETRY_PUSHBACK_MS: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");
/// The proxy's problem type, on its own answers.
pub const PROBLEM_TYPE: HeaderName = HeaderName::from_static("idemproxy-problem-type");

/// gRPC status codes the proxy answers or reads.
pub mod code {
    /// The call's result.
    pub const OK: u32 = 0;
    pub const UNKNOWN: u32 = 2;
    pub const INVALID_ARGUMENT: u32 = 3;
    pub const DEADLINE_EXCEEDED: u32 = 4;
    pub const RESOURCE_EXHAUSTED: u32 = 8;
    pub const FAILED_PRECONDITION: u32 = 9;
    pub const INTERNAL: u32 = 13;
    pub const UNAVAILABLE: u32 = 14;
}

/// Whether a request is a gRPC call: a `POST` whose content type is `application/grpc` or
/// `application/grpc+…` (a codec: `+proto`, `+json`). gRPC-Web (`application/grpc-web…`) and
/// Connect are not.
pub fn is_call(method: &http::Method, headers: &HeaderMap) -> bool {
    method == http::Method::POST && headers.get(header::CONTENT_TYPE).is_some_and(is_grpc_type)
}

fn is_grpc_type(value: &HeaderValue) -> bool {
    let Ok(text) = value.to_str() else {
        return false;
    };
    let essence = text.split(';').next().unwrap_or("").trim();
    let Some(rest) = essence
        .get(..16)
        .filter(|p| p.eq_ignore_ascii_case("application/grpc"))
        .map(|_| &essence[16..])
    else {
        return false;
    };
    rest.is_empty() || rest.starts_with('+')
}

/// What a whole response says about its call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// A status that is the call's result (`OK`, or any other not in `retry_codes`): saved.
    Result,
    /// A status in `retry_codes`: not the call's result, released.
    Retry(u32),
    /// The upstream's `DEADLINE_EXCEEDED`: the call may have run, or may still.
    DeadlineExceeded,
    /// No `grpc-status` at all: the response was cut before its trailers.
    Cut,
}

/// The verdict on a whole response: its `grpc-status` read from `trailers`, or from the
/// response's headers for a trailers-only response.
pub fn verdict(headers: &HeaderMap, trailers: Option<&HeaderMap>, retry_codes: &[u32]) -> Verdict {
    let status = trailers
        .and_then(|t| t.get(&GRPC_STATUS))
        .or_else(|| headers.get(&GRPC_STATUS))
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u32>().ok());
    match status {
        None => Verdict::Cut,
        Some(code::DEADLINE_EXCEEDED) => Verdict::DeadlineExceeded,
        Some(c) if retry_codes.contains(&c) => Verdict::Retry(c),
        Some(_) => Verdict::Result,
    }
}

/// The gRPC status of one of the proxy's problems (SPEC §4.11's list).
pub fn code_of(problem: &Problem) -> u32 {
    match problem {
        Problem::MissingKey { .. }
        | Problem::InvalidKey { .. }
        | Problem::UnreadableKeyPart { .. }
        | Problem::UnreadableLookupPart { .. }
        | Problem::HeadersTooLarge { .. }
        | Problem::HopByHopConflict { .. }
        | Problem::BadRequestBody { .. }
        | Problem::BodyTimeout { .. } => code::INVALID_ARGUMENT,
        // Not sent, released: a client's retry policy sends it again.
        Problem::UpstreamUnavailable { .. }
        | Problem::InProgress { .. }
        | Problem::BeingResolvedNow { .. }
        | Problem::StoreUnavailable { .. }
        | Problem::Overloaded => code::UNAVAILABLE,
        Problem::KeyReused
        | Problem::EventRedeliveredDifferently
        | Problem::NotReplayable { .. }
        | Problem::ResultNotKept { .. } => code::FAILED_PRECONDITION,
        Problem::BodyTooLarge { .. } => code::RESOURCE_EXHAUSTED,
        Problem::UpstreamTimeout { .. } => code::DEADLINE_EXCEEDED,
        Problem::OutcomeUnknown { status, .. } if *status == StatusCode::GATEWAY_TIMEOUT => {
            code::DEADLINE_EXCEEDED
        }
        Problem::BeingResolved(cause) => code_of(cause),
        Problem::Internal => code::INTERNAL,
        Problem::UpstreamFailed { .. }
        | Problem::OutcomeUnknown { .. }
        | Problem::NoRoute
        | Problem::UnsupportedMediaType { .. }
        | Problem::WebhookSignatureInvalid { .. } => code::UNKNOWN,
    }
}

/// The trailers-only answer of `problem` (HTTP `200`): its gRPC status, its title and detail
/// as `grpc-message`, its type in `idemproxy-problem-type`, and, for a call in flight,
/// `grpc-retry-pushback-ms` set to its `Retry-After` time.
pub fn answer(problem: &Problem) -> Response<Body> {
    let mut resp = Response::new(body::full(bytes::Bytes::new()));
    *resp.headers_mut() = headers_of(problem);
    resp
}

/// [`answer`] as a record saves it (`on_unknown_outcome: keep`): replayed to every repeat.
pub fn saved(problem: &Problem) -> SavedResponse {
    SavedResponse {
        status: StatusCode::OK,
        headers: headers_of(problem)
            .iter()
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect(),
        body: bytes::Bytes::new(),
    }
}

fn headers_of(problem: &Problem) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    h.insert(GRPC_STATUS, HeaderValue::from(code_of(problem)));
    let message = format!("{}: {}", problem.title(), problem.detail());
    if let Ok(v) = HeaderValue::from_str(&percent_encode(&message)) {
        h.insert(GRPC_MESSAGE, v);
    }
    if let Ok(v) = HeaderValue::from_str(&format!("urn:idemproxy:problem:{}", problem.slug())) {
        h.insert(PROBLEM_TYPE, v);
    }
    if let (Problem::InProgress { .. } | Problem::BeingResolvedNow { .. }, Some(secs)) =
        (problem, problem.retry_after())
    {
        h.insert(
            GRPC_RETRY_PUSHBACK_MS,
            HeaderValue::from(secs.saturating_mul(1000)),
        );
    }
    h
}

/// `grpc-message` as gRPC writes it: UTF-8, every byte outside printable ASCII, and `%`,
/// percent-encoded.
pub fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if (0x20..=0x7E).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn ct(value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_str(value).expect("value"),
        );
        h
    }

    #[test]
    fn only_grpc_content_types_are_calls() {
        let post = http::Method::POST;
        for yes in [
            "application/grpc",
            "application/grpc+proto",
            "Application/GRPC+json",
            "application/grpc; charset=utf-8",
        ] {
            assert!(is_call(&post, &ct(yes)), "{yes}");
        }
        for no in [
            "application/grpc-web",
            "application/grpc-web+proto",
            "application/json",
            "application/connect+proto",
            "application/grpcx",
        ] {
            assert!(!is_call(&post, &ct(no)), "{no}");
        }
        assert!(!is_call(&http::Method::GET, &ct("application/grpc")));
        assert!(!is_call(&post, &HeaderMap::new()));
    }

    #[test]
    fn the_status_comes_from_the_trailers_or_a_trailers_only_head() {
        let mut trailers = HeaderMap::new();
        trailers.insert(GRPC_STATUS, HeaderValue::from_static("0"));
        assert_eq!(
            verdict(&HeaderMap::new(), Some(&trailers), &[8, 14]),
            Verdict::Result
        );
        trailers.insert(GRPC_STATUS, HeaderValue::from_static("14"));
        assert_eq!(
            verdict(&HeaderMap::new(), Some(&trailers), &[8, 14]),
            Verdict::Retry(14)
        );
        trailers.insert(GRPC_STATUS, HeaderValue::from_static("4"));
        assert_eq!(
            verdict(&HeaderMap::new(), Some(&trailers), &[]),
            Verdict::DeadlineExceeded
        );
        let mut head = HeaderMap::new();
        head.insert(GRPC_STATUS, HeaderValue::from_static("9"));
        assert_eq!(
            verdict(&head, None, &[8, 14]),
            Verdict::Result,
            "trailers-only"
        );
        assert_eq!(verdict(&HeaderMap::new(), None, &[8, 14]), Verdict::Cut);
    }

    /// SPEC §4.11's list, one row a problem the proxy can answer on a `grpc:` route.
    #[test]
    #[allow(clippy::too_many_lines)] // A table: one row a problem.
    fn every_problem_on_a_grpc_route_has_the_status_the_spec_lists() {
        let up = || "ledger".to_owned();
        let rows = [
            (
                Problem::MissingKey {
                    header: header::HeaderName::from_static("idempotency-key"),
                },
                code::INVALID_ARGUMENT,
            ),
            (
                Problem::InvalidKey {
                    detail: "too long".into(),
                },
                code::INVALID_ARGUMENT,
            ),
            (
                Problem::UnreadableKeyPart {
                    detail: "x-ref".into(),
                },
                code::INVALID_ARGUMENT,
            ),
            (
                Problem::HeadersTooLarge {
                    limit: crate::problem::HeadLimit::Count(97),
                },
                code::INVALID_ARGUMENT,
            ),
            (
                Problem::HopByHopConflict {
                    header: header::HeaderName::from_static("idempotency-key"),
                },
                code::INVALID_ARGUMENT,
            ),
            (
                Problem::UpstreamUnavailable {
                    upstream: up(),
                    detail: "refused".into(),
                },
                code::UNAVAILABLE,
            ),
            (
                Problem::InProgress {
                    retry_after: Duration::from_secs(1),
                },
                code::UNAVAILABLE,
            ),
            (Problem::KeyReused, code::FAILED_PRECONDITION),
            (
                Problem::BodyTooLarge { limit: 64 },
                code::RESOURCE_EXHAUSTED,
            ),
            (
                Problem::StoreUnavailable {
                    detail: "down".into(),
                },
                code::UNAVAILABLE,
            ),
            (
                Problem::UpstreamFailed {
                    upstream: up(),
                    detail: "reset".into(),
                },
                code::UNKNOWN,
            ),
            (
                Problem::UpstreamTimeout { upstream: up() },
                code::DEADLINE_EXCEEDED,
            ),
            (
                Problem::NotReplayable {
                    status: StatusCode::OK,
                },
                code::FAILED_PRECONDITION,
            ),
            (
                Problem::ResultNotKept {
                    status: StatusCode::OK,
                },
                code::FAILED_PRECONDITION,
            ),
        ];
        for (problem, code) in rows {
            let resp = answer(&problem);
            assert_eq!(resp.status(), StatusCode::OK, "{problem:?}");
            assert_eq!(
                resp.headers()[GRPC_STATUS],
                code.to_string().as_str(),
                "{problem:?}"
            );
            assert_eq!(
                resp.headers()[PROBLEM_TYPE],
                format!("urn:idemproxy:problem:{}", problem.slug()).as_str()
            );
            // Only the in-flight answer tells a retry policy when to come back.
            assert_eq!(
                resp.headers().contains_key(GRPC_RETRY_PUSHBACK_MS),
                matches!(problem, Problem::InProgress { .. }),
                "{problem:?}"
            );
        }
    }

    #[test]
    fn problems_are_trailers_only_answers() {
        let resp = answer(&Problem::InProgress {
            retry_after: Duration::from_millis(1500),
        });
        assert_eq!(resp.status(), StatusCode::OK);
        let h = resp.headers();
        assert_eq!(h[header::CONTENT_TYPE], "application/grpc");
        assert_eq!(h[GRPC_STATUS], "14");
        assert_eq!(h[GRPC_RETRY_PUSHBACK_MS], "2000");
        assert_eq!(h[PROBLEM_TYPE], "urn:idemproxy:problem:request-in-progress");
        assert_eq!(answer(&Problem::KeyReused).headers()[GRPC_STATUS], "9");
        assert_eq!(
            answer(&Problem::UpstreamTimeout {
                upstream: "u".into()
            })
            .headers()[GRPC_STATUS],
            "4"
        );
        assert_eq!(percent_encode("50% é"), "50%25 %C3%A9");
    }
}
