//! Every answer the proxy makes itself, as `application/problem+json` (RFC 9457), in one place:
//! [`Problem`] on the proxy's listener, [`AdminProblem`] for the admin listener's refusals.
//!
//! Each kind has a stable `type` URI, `urn:idemproxy:problem:<slug>`, listed in the README;
//! clients may branch on it. The `detail` says what happened to this request in words.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Response, StatusCode, header};

use crate::body::{self, Body};
use crate::record::SavedResponse;
use crate::store::StoreError;
use crate::upstream::UpstreamError;

/// The prefix of every problem `type`.
pub const TYPE_PREFIX: &str = "urn:idemproxy:problem:";

/// A refusal or failure the proxy answers itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Problem {
    /// No route matches the method and path (404).
    NoRoute,
    /// The key header is missing on a route that requires it (400).
    MissingKey { header: HeaderName },
    /// The key header is invalid or repeated (400).
    InvalidKey {
        /// What is wrong with it.
        detail: String,
    },
    /// The request body is over `max_request_body` (413).
    BodyTooLarge {
        /// The limit, in bytes.
        limit: u64,
    },
    /// The request body could not be read (400).
    BadRequestBody {
        /// Why.
        detail: String,
    },
    /// The key was used before for a different request (422).
    KeyReused,
    /// On a gRPC route, a request that is not a gRPC call (another content type: gRPC-Web,
    /// Connect, plain HTTP) (415); nothing forwarded.
    UnsupportedMediaType {
        /// The content type it has (empty: none).
        content_type: String,
    },
    /// On a webhook route whose `fingerprint` is written, a redelivery of an event whose
    /// fingerprinted parts differ from the first delivery's (422, the same type as
    /// [`Problem::KeyReused`]: the event is the key).
    EventRedeliveredDifferently,
    /// The first request with this key is still in flight (409, `Retry-After`).
    InProgress {
        /// When to try again.
        retry_after: Duration,
    },
    /// The first request's outcome is unknown and is being resolved: a repeat is refused as
    /// in flight (409, `Retry-After` when the next lookup is due), its detail saying so.
    BeingResolvedNow {
        /// When the next lookup is sent, from now (on the store's clock).
        next_lookup_in: Duration,
    },
    /// The key's first response was too large to save (409).
    NotReplayable {
        /// The status the first request got.
        status: StatusCode,
    },
    /// The operation ran, but its response could not be kept while the store refused to save
    /// it (the pending-save bounds were reached): saved in its place, and replayed (502).
    ResultNotKept {
        /// The status the first request got.
        status: StatusCode,
    },
    /// The store could not be reached or did not answer in time (503).
    StoreUnavailable {
        /// The store error, for the log and the detail.
        detail: String,
    },
    /// The upstream could not be reached; nothing was sent (502).
    UpstreamUnavailable {
        upstream: String,
        /// Why.
        detail: String,
    },
    /// The upstream did not answer completely within its timeout; it may have acted (504).
    UpstreamTimeout { upstream: String },
    /// The upstream connection failed after the request was sent; it may have acted (502).
    UpstreamFailed {
        upstream: String,
        /// Why.
        detail: String,
    },
    /// A header the proxy reads for idempotency is named in `Connection`, which would strip it
    /// before the upstream (400).
    HopByHopConflict { header: HeaderName },
    /// The client did not send the whole body within `limits.body_read_timeout` (408).
    BodyTimeout {
        /// The deadline.
        after: Duration,
    },
    /// Too many exchanges are still running after their clients left, or too many results wait
    /// for the store as `result-not-kept` records (503); nothing claimed.
    Overloaded,
    /// The proxy failed inside (500); it may not have finished the exchange.
    Internal,
    /// A `key_from` part could not be read from the request (400); nothing claimed.
    UnreadableKeyPart {
        /// Which part, and why.
        detail: String,
    },
    /// The request's head is over the proxy's limits (431); nothing claimed. The same answer on
    /// HTTP/1.1 and HTTP/2 (SPEC §4.3).
    HeadersTooLarge {
        /// The limit it is over.
        limit: HeadLimit,
    },
    /// A part of a `resolve` route's lookup (`resolve.request`) could not be read from the
    /// request (400, the type of [`Problem::UnreadableKeyPart`]); nothing claimed: a request whose
    /// outcome could not be asked about is never sent (SPEC §4.8).
    UnreadableLookupPart {
        /// Which part, and why.
        detail: String,
    },
    /// An unknown outcome on a route under `on_unknown_outcome: resolve`, as its first client
    /// gets it: the upstream failure (its kind, status and title), and a detail that says the
    /// proxy is asking the upstream (SPEC §4.8).
    BeingResolved(Box<Problem>),
    /// An unknown outcome that asking the upstream did not settle by `give_up_after`: saved as
    /// the key's result in place of `keep`'s, with the status `keep` saves (504 or 502).
    OutcomeUnknown {
        /// The upstream's name.
        upstream: String,
        /// 504 after a timeout, 502 after a failed connection.
        status: StatusCode,
        /// What the last lookup answered.
        last: LastLookup,
    },
    /// A delivery on a webhook route whose signature is missing, malformed, made by no
    /// configured secret, or outside the window (401); nothing claimed, nothing forwarded.
    WebhookSignatureInvalid {
        /// Which check failed (`webhook::Rejection::detail`): never a secret or a signature.
        detail: String,
    },
}

/// A limit on a request head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadLimit {
    /// At most this many header fields (the host counts as one).
    Count(usize),
    /// At most this many bytes of request line and headers, as HTTP/1.1 writes them.
    Bytes(usize),
}

impl Problem {
    /// The answer to a store failure before anything was forwarded (503): whatever the
    /// backend, the same kind, with the error in the detail.
    pub(crate) fn of_store(e: &StoreError) -> Problem {
        Problem::StoreUnavailable {
            detail: e.to_string(),
        }
    }

    /// The answer to an upstream failure (and, with `on_unknown_outcome: keep`, the key's saved
    /// result), or to the client's body failing on its way upstream.
    pub(crate) fn of_upstream(upstream: &str, e: &UpstreamError) -> Problem {
        let upstream = upstream.to_owned();
        match e {
            UpstreamError::Connect(detail) | UpstreamError::Unsent(detail) => {
                Problem::UpstreamUnavailable {
                    upstream,
                    detail: detail.clone(),
                }
            }
            UpstreamError::Timeout(_) => Problem::UpstreamTimeout { upstream },
            UpstreamError::Failed(detail) => Problem::UpstreamFailed {
                upstream,
                detail: detail.clone(),
            },
            UpstreamError::ClientBody {
                timed_out: Some(after),
                ..
            } => Problem::BodyTimeout { after: *after },
            UpstreamError::ClientBody { detail, .. } => Problem::BadRequestBody {
                detail: detail.clone(),
            },
        }
    }

    /// Its row of the kind table: every kind's slug, status and title, in one place.
    #[allow(clippy::too_many_lines)] // A table: one row a kind.
    fn kind(&self) -> Kind {
        use StatusCode as S;
        let (slug, status, title) = match self {
            Problem::NoRoute => ("no-route", S::NOT_FOUND, "No route matches this request"),
            Problem::MissingKey { .. } => (
                "missing-idempotency-key",
                S::BAD_REQUEST,
                "Idempotency key missing",
            ),
            Problem::InvalidKey { .. } => (
                "invalid-idempotency-key",
                S::BAD_REQUEST,
                "Invalid idempotency key",
            ),
            Problem::BodyTooLarge { .. } => (
                "request-too-large",
                S::PAYLOAD_TOO_LARGE,
                "Request body too large",
            ),
            Problem::BadRequestBody { .. } => (
                "bad-request-body",
                S::BAD_REQUEST,
                "Request body could not be read",
            ),
            Problem::UnsupportedMediaType { .. } => (
                "unsupported-media-type",
                S::UNSUPPORTED_MEDIA_TYPE,
                "Not a gRPC call",
            ),
            Problem::KeyReused | Problem::EventRedeliveredDifferently => (
                "idempotency-key-reused",
                S::UNPROCESSABLE_ENTITY,
                "Idempotency key reused for a different request",
            ),
            Problem::InProgress { .. } | Problem::BeingResolvedNow { .. } => (
                "request-in-progress",
                S::CONFLICT,
                "A request with this idempotency key is in progress",
            ),
            Problem::NotReplayable { .. } => (
                "response-not-replayable",
                S::CONFLICT,
                "Response cannot be replayed",
            ),
            Problem::ResultNotKept { .. } => {
                ("result-not-kept", S::BAD_GATEWAY, "Response not kept")
            }
            Problem::StoreUnavailable { .. } => (
                "store-unavailable",
                S::SERVICE_UNAVAILABLE,
                "Idempotency store unavailable",
            ),
            Problem::UpstreamUnavailable { .. } => (
                "upstream-unavailable",
                S::BAD_GATEWAY,
                "Upstream unavailable",
            ),
            Problem::UpstreamTimeout { .. } => {
                ("upstream-timeout", S::GATEWAY_TIMEOUT, "Upstream timed out")
            }
            Problem::UpstreamFailed { .. } => {
                ("upstream-failed", S::BAD_GATEWAY, "Upstream failed")
            }
            Problem::HopByHopConflict { .. } => (
                "hop-by-hop-conflict",
                S::BAD_REQUEST,
                "A header idempotency relies on is named in Connection",
            ),
            Problem::BodyTimeout { .. } => (
                "request-body-timeout",
                S::REQUEST_TIMEOUT,
                "Request body not received in time",
            ),
            Problem::Overloaded => (
                "overloaded",
                S::SERVICE_UNAVAILABLE,
                "Too much unfinished work",
            ),
            Problem::Internal => (
                "internal-error",
                S::INTERNAL_SERVER_ERROR,
                "Internal proxy error",
            ),
            Problem::UnreadableKeyPart { .. } | Problem::UnreadableLookupPart { .. } => (
                "unreadable-key-part",
                S::BAD_REQUEST,
                "Idempotency key cannot be derived",
            ),
            Problem::HeadersTooLarge { .. } => (
                "headers-too-large",
                S::REQUEST_HEADER_FIELDS_TOO_LARGE,
                "Request head too large",
            ),
            Problem::BeingResolved(cause) => return cause.kind(),
            Problem::OutcomeUnknown { status, .. } => (
                "outcome-unknown",
                *status,
                "Outcome of the operation unknown",
            ),
            Problem::WebhookSignatureInvalid { .. } => (
                "webhook-signature-invalid",
                S::UNAUTHORIZED,
                "Webhook signature invalid",
            ),
        };
        Kind {
            slug,
            status,
            title,
        }
    }

    /// The stable slug of this kind (the last part of its `type`).
    pub fn slug(&self) -> &'static str {
        self.kind().slug
    }

    pub fn status(&self) -> StatusCode {
        self.kind().status
    }

    /// The detail, for a person: what happened and what to do.
    pub fn detail(&self) -> String {
        match self {
            Problem::UnsupportedMediaType { content_type } => not_a_grpc_call(content_type),
            Problem::NoRoute => "No configured route matches this method and path.".into(),
            Problem::MissingKey { header } => format!(
                "This route requires the {header} header; send a unique key per operation and reuse it on retries."
            ),
            Problem::InvalidKey { detail } => format!(
                "{detail}. A key is 1 to 255 visible ASCII characters, bare or as a quoted string, sent once."
            ),
            Problem::BodyTooLarge { limit } => format!(
                "The request body is larger than this route's limit of {limit} bytes; nothing was done."
            ),
            Problem::BadRequestBody { detail } => {
                format!("The request body could not be read: {detail}.")
            }
            Problem::KeyReused => "This idempotency key was already used for a request with a different method, path, query, body or fingerprinted headers. Use a new key for a new operation.".into(),
            Problem::EventRedeliveredDifferently => "This delivery is a redelivery of an event already handled (or being handled), with another body or other fingerprinted headers than the first delivery: it was not handled again. On a webhook route the event is the key; remove the route's fingerprint to replay the first answer to every redelivery of an event.".into(),
            Problem::InProgress { .. } => "The first request with this idempotency key has not finished yet; retry after the time in Retry-After to get its response.".into(),
            Problem::BeingResolvedNow { next_lookup_in } => format!(
                "The outcome of the first request with this idempotency key is unknown and is being resolved: the proxy asks the upstream whether the operation happened, next at {} (in {}ms), and forwards nothing meanwhile. Retry after the time in Retry-After to get the result.",
                humantime::format_rfc3339_seconds(std::time::SystemTime::now() + *next_lookup_in),
                next_lookup_in.as_millis()
            ),
            Problem::NotReplayable { status } => format!(
                "The operation with this idempotency key was performed (the first request got status {}), but its response was too large to be saved, so it cannot be replayed. Do not retry it with a new key unless you mean to do it again.",
                status.as_u16()
            ),
            Problem::ResultNotKept { status } => format!(
                "The operation with this idempotency key was performed (the first request got status {}), but the idempotency store refused to save its response for longer than the proxy could hold it, so this record was saved in its place. Do not retry it with a new key unless you mean to do it again.",
                status.as_u16()
            ),
            Problem::StoreUnavailable { detail } => format!(
                "The idempotency store did not answer ({detail}); nothing was forwarded. Retry later with the same key."
            ),
            Problem::UpstreamUnavailable { upstream, detail } => format!(
                "Could not connect to upstream {upstream} ({detail}); the request was not sent. Retry with the same key."
            ),
            Problem::UpstreamTimeout { upstream } => format!(
                "Upstream {upstream} did not send a complete response in time; it may have performed the operation."
            ),
            Problem::UpstreamFailed { upstream, detail } => format!(
                "The connection to upstream {upstream} failed after the request was sent ({detail}); it may have performed the operation."
            ),
            Problem::HopByHopConflict { header } => format!(
                "The Connection header names {header}, which this route reads for the idempotency key, its scope or its fingerprint; a hop-by-hop header would not reach the upstream. Nothing was done."
            ),
            Problem::BodyTimeout { after } => format!(
                "The request body did not arrive within {}s; nothing was done. Retry with the same key.",
                after.as_secs_f64()
            ),
            Problem::Overloaded => "The proxy holds too much unfinished work (requests whose clients left, or results the idempotency store has not taken yet); nothing was done. Retry later with the same key.".into(),
            Problem::Internal => "The proxy failed while handling this request; the upstream may or may not have performed the operation. Retry with the same key: a finished operation is replayed.".into(),
            Problem::WebhookSignatureInvalid { detail } => format!(
                "The delivery's signature was refused ({detail}); nothing was done."
            ),
            Problem::UnreadableKeyPart { detail } => format!(
                "The request has no idempotency key header, and the key this route derives from the request could not be made: {detail}. Send the key header, or the parts the key is made of. Nothing was done."
            ),
            Problem::UnreadableLookupPart { detail } => format!(
                "This route asks the upstream about a request whose outcome is unknown with a lookup made of parts of the request, and one could not be read: {detail}. Send that part. Nothing was done."
            ),
            Problem::HeadersTooLarge { limit } => head_too_large(*limit),
            Problem::BeingResolved(cause) => format!(
                "{} The proxy is asking the upstream whether it did; until it knows, a retry with the same key gets 409 (Retry-After), then the operation's result, or, if it did not happen, runs it once.",
                cause.detail()
            ),
            Problem::OutcomeUnknown {
                upstream,
                status,
                last,
            } => last.detail(upstream, *status),
        }
    }

    /// The problem document's bytes.
    pub fn body(&self) -> Bytes {
        document(&self.kind(), &self.detail())
    }

    /// The kind's title.
    pub fn title(&self) -> &'static str {
        self.kind().title
    }

    /// The document as a JSON value, with `retry_after` (seconds) where the answer has a
    /// `Retry-After`: the `data` of a JSON-RPC error (SPEC §4.10).
    pub fn document(&self) -> serde_json::Value {
        let kind = self.kind();
        let mut doc = serde_json::json!({
            "type": format!("{TYPE_PREFIX}{}", kind.slug),
            "title": kind.title,
            "status": kind.status.as_u16(),
            "detail": self.detail(),
        });
        if let (Some(secs), Some(map)) = (self.retry_after(), doc.as_object_mut()) {
            map.insert("retry_after".into(), secs.into());
        }
        doc
    }

    /// The `Retry-After` of the answer, in whole seconds (at least 1), where it has one.
    pub fn retry_after(&self) -> Option<u64> {
        let retry_after = match self {
            Problem::InProgress { retry_after } => Some(*retry_after),
            Problem::BeingResolvedNow { next_lookup_in } => Some(*next_lookup_in),
            // A store outage is usually short; a client retrying with the same key is safe.
            Problem::StoreUnavailable { .. } | Problem::Overloaded => Some(Duration::from_secs(1)),
            _ => None,
        };
        // Whole seconds, at least 1 (Retry-After has no fractions).
        retry_after.map(|after| after.as_secs_f64().ceil().max(1.0) as u64)
    }

    fn headers(&self) -> Vec<(HeaderName, HeaderValue)> {
        let mut h = vec![content_type()];
        if let Some(secs) = self.retry_after() {
            h.push((header::RETRY_AFTER, HeaderValue::from(secs)));
        }
        h
    }

    /// The problem+json answer. It carries the problem in its extensions (never sent), so a
    /// route kind that answers in its own protocol (a JSON-RPC call's error) can render it.
    pub fn response(&self) -> Response<Body> {
        let mut resp = respond(self.status(), self.body(), self.headers());
        resp.extensions_mut().insert(self.clone());
        resp
    }

    /// The problem as a response to save: with `on_unknown_outcome: keep`, a 502/504 problem
    /// becomes the key's result and is replayed to every repeat.
    pub(crate) fn saved(&self) -> SavedResponse {
        SavedResponse {
            status: self.status(),
            headers: self.headers(),
            body: self.body(),
        }
    }
}

mod admin;
pub(crate) use admin::AdminProblem;
mod unknown;
pub use unknown::LastLookup;

fn content_type() -> (HeaderName, HeaderValue) {
    (
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    )
}

/// A kind's row of its table: what every document of that kind shares.
struct Kind {
    /// The last part of its `type`: stable, clients may branch on it.
    slug: &'static str,
    status: StatusCode,
    title: &'static str,
}

/// An RFC 9457 document: `type`, `title`, `status`, `detail`.
fn document(kind: &Kind, detail: &str) -> Bytes {
    let doc = serde_json::json!({
        "type": format!("{TYPE_PREFIX}{}", kind.slug),
        "title": kind.title,
        "status": kind.status.as_u16(),
        "detail": detail,
    });
    Bytes::from(doc.to_string())
}

fn respond(
    status: StatusCode,
    body: Bytes,
    headers: Vec<(HeaderName, HeaderValue)>,
) -> Response<Body> {
    let mut resp = Response::new(body::full(body));
    *resp.status_mut() = status;
    resp.headers_mut()
        .extend(headers.into_iter().map(|(n, v)| (Some(n), v)));
    resp
}

#[cfg(test)]
mod tests;

/// The detail of [`Problem::HeadersTooLarge`].
fn head_too_large(limit: HeadLimit) -> String {
    match limit {
        HeadLimit::Count(limit) => format!(
            "The request has more than {limit} header fields (the host counts as one); nothing was done. Retry with fewer headers and the same key."
        ),
        HeadLimit::Bytes(limit) => format!(
            "The request head (its request line and headers, as HTTP/1.1 writes them) is larger than {limit} bytes; nothing was done. Retry with a smaller head and the same key."
        ),
    }
}

/// The detail of [`Problem::UnsupportedMediaType`].
fn not_a_grpc_call(content_type: &str) -> String {
    format!(
        "This route takes gRPC calls (content-type application/grpc or application/grpc+…), and this request's content type is {content_type:?}; nothing was forwarded. gRPC-Web and Connect are not translated: call it with a gRPC client over HTTP/2."
    )
}
