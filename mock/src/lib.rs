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
//! | `GET /bookings/{id}` | `200` with the stored booking, or `404` | yes |
//! | anything else outside `/_mock/` (`/echo/…`, `/payments`, …) | `200` with a JSON echo of what arrived: `{"method","path","query","headers":{name:[values]},"body"}` | yes |
//! | `GET /_mock/stats` | `{"total":N,"bookings":N,"by_key":{"KEY":N,…}}` | no |
//! | `GET /_mock/calls?key=K` | `{"key":"K","calls":N}` | no |
//! | `POST /_mock/reset` | zeroes every counter and forgets the stored bookings (ids keep growing) | no |
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
//!
//! Booleans accept `true`/`false`, `1`/`0`, `yes`/`no`. The delay comes first; then a reset;
//! otherwise the status, body size, headers and partial body combine.
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

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, ETAG, LOCATION, SET_COOKIE};
use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode, Uri};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde_json::{Map, Value, json};

/// The header whose value the mock counts side effects under.
const IDEMPOTENCY_KEY: &str = "idempotency-key";
const X_MOCK_DELAY: &str = "x-mock-delay";
const X_MOCK_STATUS: &str = "x-mock-status";
const X_MOCK_RESET: &str = "x-mock-reset";
const X_MOCK_BODY_SIZE: &str = "x-mock-body-size";
const X_MOCK_SET_COOKIE: &str = "x-mock-set-cookie";
const X_MOCK_HEADER: &str = "x-mock-header";
const X_MOCK_PARTIAL: &str = "x-mock-partial";
const X_BOOKING_ID: &str = "x-booking-id";

/// Request bodies above this are answered with 413 and not counted. Far above anything the
/// proxy forwards; it only keeps a stray client from exhausting memory.
const MAX_REQUEST_BODY: usize = 64 * 1024 * 1024;

/// How long a cut-short body ([`X-Mock-Partial`](self#control-headers)) waits before failing,
/// so the server flushes the head and the first half before the connection drops.
const PARTIAL_FLUSH_PAUSE: Duration = Duration::from_millis(50);

/// One period of the body produced by `X-Mock-Body-Size` (64 bytes, printable, ends in `\n`).
const PATTERN: &[u8; 64] = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-\n";

/// The body sent for `X-Mock-Body-Size: len`: a printable 64-byte pattern (`0-9a-zA-Z-\n`)
/// repeated and cut at `len` bytes.
/// Tests compare a response against it byte for byte.
pub fn body_pattern(len: usize) -> Vec<u8> {
    PATTERN.iter().copied().cycle().take(len).collect()
}

/// A 64 KiB block of the pattern, shared by every response: big bodies are sent as slices of it,
/// so `X-Mock-Body-Size: 100000000` costs no allocation. Its length is a multiple of the pattern
/// period, so consecutive blocks continue the pattern seamlessly.
fn pattern_block() -> &'static Bytes {
    static BLOCK: OnceLock<Bytes> = OnceLock::new();
    BLOCK.get_or_init(|| Bytes::from(body_pattern(64 * 1024)))
}

/// The state of a mock upstream: its side-effect counters and stored bookings.
///
/// Cheap to clone (an `Arc` inside); every clone sees the same counters. Serve one (each
/// request through [`MockUpstream::handle`]) and keep another to read the counters.
#[derive(Clone, Default)]
pub struct MockUpstream {
    ledger: Arc<Mutex<Ledger>>,
}

#[derive(Default)]
struct Ledger {
    total: u64,
    by_key: BTreeMap<String, u64>,
    bookings: u64,
    /// The last booking sequence number handed out. Not reset, so a booking id never names two
    /// different bookings in one process (a replayed `bk_3` can't be mistaken for a fresh one).
    last_seq: u64,
    store: HashMap<String, Value>,
    last_request: Option<RecordedRequest>,
}

/// A snapshot of the counters, as `GET /_mock/stats` reports them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MockStats {
    /// Every counted request since start or the last reset.
    pub total: u64,
    /// Bookings created since start or the last reset.
    pub bookings: u64,
    /// Counted requests per `Idempotency-Key` value, as received.
    pub by_key: BTreeMap<String, u64>,
}

/// A counted request as the mock received it, so tests can check what the proxy forwarded
/// without parsing the JSON echo.
#[derive(Clone, Debug)]
pub struct RecordedRequest {
    /// The request method.
    pub method: Method,
    /// The request target (path and query) as received.
    pub uri: Uri,
    /// Every request header, including the `X-Mock-*` ones.
    pub headers: HeaderMap,
    /// The whole request body.
    pub body: Bytes,
}

impl MockUpstream {
    /// Fresh state: every counter at zero, no bookings.
    pub fn new() -> Self {
        Self::default()
    }

    /// Counted requests that carried `Idempotency-Key: key` (the value as received).
    pub fn calls(&self, key: &str) -> u64 {
        self.ledger().by_key.get(key).copied().unwrap_or(0)
    }

    /// Every counted request, with or without a key.
    pub fn total(&self) -> u64 {
        self.ledger().total
    }

    /// Bookings created by `POST /bookings`.
    pub fn bookings(&self) -> u64 {
        self.ledger().bookings
    }

    /// All counters at once.
    pub fn stats(&self) -> MockStats {
        let ledger = self.ledger();
        MockStats {
            total: ledger.total,
            bookings: ledger.bookings,
            by_key: ledger.by_key.clone(),
        }
    }

    /// The last counted request, if any since start or the last reset.
    pub fn last_request(&self) -> Option<RecordedRequest> {
        self.ledger().last_request.clone()
    }

    /// Zeroes every counter and forgets the stored bookings; booking ids keep growing.
    pub fn reset(&self) {
        let mut ledger = self.ledger();
        let last_seq = ledger.last_seq;
        *ledger = Ledger {
            last_seq,
            ..Ledger::default()
        };
    }

    /// The lock is a std `Mutex`: it is held for a few map operations and never across an
    /// `.await`, so an async mutex would only add cost. A panic while holding it cannot leave
    /// the counters half-updated in a way that matters to a mock, so poisoning is ignored.
    fn ledger(&self) -> MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records the side effect of one request. Called as soon as head and body are read.
    fn record(&self, parts: &Parts, body: &Bytes) {
        let key = idempotency_key(&parts.headers);
        tracing::debug!(method = %parts.method, uri = %parts.uri, key = ?key, "mock upstream: counted");
        let mut ledger = self.ledger();
        ledger.total += 1;
        if let Some(key) = key {
            *ledger.by_key.entry(key).or_insert(0) += 1;
        }
        ledger.last_request = Some(RecordedRequest {
            method: parts.method.clone(),
            uri: parts.uri.clone(),
            headers: parts.headers.clone(),
            body: body.clone(),
        });
    }

    fn create_booking(&self, request_body: &Bytes) -> Reply {
        let request = body_json(request_body);
        let mut ledger = self.ledger();
        ledger.last_seq += 1;
        ledger.bookings += 1;
        let seq = ledger.last_seq;
        let id = format!("bk_{seq}");
        let booking = json!({ "id": id, "seq": seq, "request": request });
        let mut reply = Reply::json(StatusCode::CREATED, &booking);
        ledger.store.insert(id.clone(), booking);
        drop(ledger);

        reply.insert(LOCATION, &format!("/bookings/{id}"));
        reply.insert(ETAG, &etag(&id));
        reply.insert(HeaderName::from_static(X_BOOKING_ID), &id);
        reply
    }

    fn get_booking(&self, id: &str) -> Reply {
        // Serialized under the lock: `Value` is not cheap to clone, its text is.
        let stored = self
            .ledger()
            .store
            .get(id)
            .map(|booking| Reply::json(StatusCode::OK, booking));
        match stored {
            Some(mut reply) => {
                reply.insert(ETAG, &etag(id));
                reply.insert(HeaderName::from_static(X_BOOKING_ID), id);
                reply
            }
            None => Reply::json(
                StatusCode::NOT_FOUND,
                &json!({ "error": "booking not found", "id": id }),
            ),
        }
    }

    fn stats_json(&self) -> Value {
        let stats = self.stats();
        json!({ "total": stats.total, "bookings": stats.bookings, "by_key": stats.by_key })
    }
}

fn etag(id: &str) -> String {
    format!("\"{id}.v1\"")
}

/// The `Idempotency-Key` as received; several fields are combined as HTTP combines them.
fn idempotency_key(headers: &HeaderMap) -> Option<String> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter().peekable();
    values.peek()?;
    let values: Vec<_> = values
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .collect();
    Some(values.join(", "))
}

/// Why the mock gave up on a request instead of answering it: the server then closes the
/// connection without a response, which is the point for [`MockError::Reset`].
#[derive(Debug, thiserror::Error)]
pub enum MockError {
    /// `X-Mock-Reset`: the server is to drop the connection abruptly, writing nothing more, not
    /// even a FIN (idemproxy's listener does it with `Peer::reset`).
    #[error("connection reset on request (X-Mock-Reset)")]
    Reset,
    /// The request body could not be read.
    #[error("reading the request body failed")]
    RequestBody(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl MockUpstream {
    /// Answers one request as the [routes](self#routes) and [control headers](self#control-headers)
    /// say, counting it first. An error is to be answered with no response at all.
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

        let mut reply = match directives.status {
            Some(status) => status_reply(status, &parts),
            None => route(self, &parts, &body),
        };
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

fn route(state: &MockUpstream, parts: &Parts, body: &Bytes) -> Reply {
    let path = parts.uri.path();
    if parts.method == Method::POST && path == "/bookings" {
        return state.create_booking(body);
    }
    if parts.method == Method::GET {
        if let Some(id) = path.strip_prefix("/bookings/") {
            if !id.is_empty() && !id.contains('/') {
                return state.get_booking(id);
            }
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

fn echo_reply(parts: &Parts, body: &Bytes) -> Reply {
    let headers: Map<String, Value> = parts
        .headers
        .keys()
        .map(|name| {
            let values = parts.headers.get_all(name).iter();
            let values = values.map(|v| String::from_utf8_lossy(v.as_bytes()));
            (name.as_str().to_owned(), values.collect())
        })
        .collect();
    let echo = json!({
        "method": parts.method.as_str(),
        "path": parts.uri.path(),
        "query": parts.uri.query(),
        "headers": headers,
        "body": body_json(body),
    });
    Reply::json(StatusCode::OK, &echo)
}

fn status_reply(status: StatusCode, parts: &Parts) -> Reply {
    if matches!(status.as_u16(), 204 | 205 | 304) {
        // These statuses carry no body.
        return Reply {
            status,
            headers: HeaderMap::new(),
            body: MockBody::full(Bytes::new()),
        };
    }
    let json = json!({
        "status": status.as_u16(),
        "reason": status.canonical_reason().unwrap_or(""),
        "method": parts.method.as_str(),
        "path": parts.uri.path(),
        "mock": "X-Mock-Status",
    });
    Reply::json(status, &json)
}

fn error_reply(status: StatusCode, message: &str) -> Reply {
    Reply::json(status, &json!({ "error": message }))
}

/// A request body as it is embedded in a JSON answer: the parsed value if the body is JSON,
/// else the body as a (lossy UTF-8) string. What serde_json can't hold as a [`Value`] counts as
/// "not JSON": nesting deeper than its recursion limit (128), a number beyond `f64` (`1e400`),
/// a lone surrogate escape.
fn body_json(body: &[u8]) -> Value {
    serde_json::from_slice(body)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(body).into_owned()))
}

/// The parsed `X-Mock-*` request headers.
#[derive(Debug, Default)]
struct Directives {
    delay: Option<Duration>,
    status: Option<StatusCode>,
    reset: bool,
    body_size: Option<u64>,
    set_cookies: Vec<HeaderValue>,
    headers: Vec<(HeaderName, HeaderValue)>,
    partial: bool,
}

impl Directives {
    fn parse(headers: &HeaderMap) -> Result<Self, String> {
        let text = |name: &str| -> Result<Option<&str>, String> {
            headers
                .get(name)
                .map(|v| v.to_str().map(str::trim))
                .transpose()
                .map_err(|_| format!("{name}: not visible ASCII"))
        };
        let flag = |name: &str| -> Result<bool, String> {
            match text(name)?.map(str::to_ascii_lowercase).as_deref() {
                None | Some("false" | "0" | "no") => Ok(false),
                Some("true" | "1" | "yes") => Ok(true),
                Some(other) => Err(format!("{name}: expected true or false, got {other:?}")),
            }
        };

        let mut directives = Directives {
            reset: flag(X_MOCK_RESET)?,
            partial: flag(X_MOCK_PARTIAL)?,
            ..Directives::default()
        };
        if let Some(delay) = text(X_MOCK_DELAY)? {
            let delay = humantime::parse_duration(delay)
                .map_err(|e| format!("{X_MOCK_DELAY}: {e} (expected e.g. 300ms or 2s)"))?;
            directives.delay = Some(delay);
        }
        if let Some(status) = text(X_MOCK_STATUS)? {
            let status = status
                .parse::<u16>()
                .ok()
                .filter(|s| (200..=599).contains(s))
                .and_then(|s| StatusCode::from_u16(s).ok())
                .ok_or_else(|| {
                    format!("{X_MOCK_STATUS}: expected a status 200-599, got {status:?}")
                })?;
            directives.status = Some(status);
        }
        if let Some(size) = text(X_MOCK_BODY_SIZE)? {
            let size = size
                .parse::<u64>()
                .map_err(|_| format!("{X_MOCK_BODY_SIZE}: expected a byte count, got {size:?}"))?;
            directives.body_size = Some(size);
        }
        directives.set_cookies = headers.get_all(X_MOCK_SET_COOKIE).iter().cloned().collect();
        for line in headers.get_all(X_MOCK_HEADER) {
            let invalid = || format!("{X_MOCK_HEADER}: expected \"Name: value\", got {line:?}");
            let (name, value) = line
                .to_str()
                .ok()
                .and_then(|line| line.split_once(':'))
                .ok_or_else(invalid)?;
            let name = HeaderName::from_bytes(name.trim().as_bytes()).map_err(|_| invalid())?;
            let value = HeaderValue::from_str(value.trim()).map_err(|_| invalid())?;
            directives.headers.push((name, value));
        }
        Ok(directives)
    }
}

/// A response under construction.
struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: MockBody,
}

impl Reply {
    fn json(status: StatusCode, json: &Value) -> Self {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        Reply {
            status,
            headers,
            body: MockBody::full(Bytes::from(json.to_string())),
        }
    }

    /// Sets a header whose value the mock itself generated.
    fn insert(&mut self, name: HeaderName, value: &str) {
        match HeaderValue::from_str(value) {
            Ok(value) => {
                self.headers.insert(name, value);
            }
            Err(_) => tracing::warn!(%name, value, "mock upstream: unencodable header value"),
        }
    }

    fn finish(self) -> Response<MockBody> {
        let mut response = Response::new(self.body);
        *response.status_mut() = self.status;
        *response.headers_mut() = self.headers;
        response
    }
}

/// The response body: a buffer and/or a stretch of [`body_pattern`], with an exact length (so
/// HTTP/1 gets a `Content-Length`), optionally cut short by a failure.
#[derive(Debug)]
pub struct MockBody {
    head: Option<Bytes>,
    /// Pattern bytes still to send after `head`.
    pattern_left: u64,
    /// Bytes still to send as declared in the size hint; more than the rest of the data when
    /// the body is cut short.
    declared_left: u64,
    cut: Cut,
}

#[derive(Debug)]
enum Cut {
    No,
    /// Fail once the data runs out, after a pause that lets the server flush what was sent.
    Armed,
    Pausing(Pin<Box<tokio::time::Sleep>>),
    Done,
}

impl MockBody {
    fn full(bytes: Bytes) -> Self {
        MockBody {
            declared_left: bytes.len() as u64,
            head: Some(bytes).filter(|b| !b.is_empty()),
            pattern_left: 0,
            cut: Cut::No,
        }
    }

    fn pattern(len: u64) -> Self {
        MockBody {
            head: None,
            pattern_left: len,
            declared_left: len,
            cut: Cut::No,
        }
    }

    /// Keeps the declared length but sends only the first half, then fails.
    fn cut_short(mut self) -> Self {
        let half = self.declared_left / 2;
        match &mut self.head {
            Some(head) => {
                let keep = usize::try_from(half).unwrap_or(usize::MAX).min(head.len());
                head.truncate(keep);
            }
            None => self.pattern_left = half,
        }
        self.cut = Cut::Armed;
        self
    }
}

impl Body for MockBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = &mut *self;
        if let Some(head) = this.head.take().filter(|h| !h.is_empty()) {
            this.declared_left = this.declared_left.saturating_sub(head.len() as u64);
            return Poll::Ready(Some(Ok(Frame::data(head))));
        }
        if this.pattern_left > 0 {
            let block = pattern_block();
            let len = usize::try_from(this.pattern_left)
                .unwrap_or(usize::MAX)
                .min(block.len());
            this.pattern_left -= len as u64;
            this.declared_left = this.declared_left.saturating_sub(len as u64);
            return Poll::Ready(Some(Ok(Frame::data(block.slice(..len)))));
        }
        loop {
            match &mut this.cut {
                Cut::No | Cut::Done => return Poll::Ready(None),
                Cut::Armed => {
                    this.cut = Cut::Pausing(Box::pin(tokio::time::sleep(PARTIAL_FLUSH_PAUSE)));
                }
                Cut::Pausing(pause) => {
                    if pause.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    this.cut = Cut::Done;
                    return Poll::Ready(Some(Err(io::Error::new(
                        io::ErrorKind::ConnectionAborted,
                        "response body cut short (X-Mock-Partial)",
                    ))));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.head.as_ref().is_none_or(Bytes::is_empty)
            && self.pattern_left == 0
            && matches!(self.cut, Cut::No | Cut::Done)
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.declared_left)
    }
}

/// The first value of `name` in a query string, percent-decoded (`+` as a space).
fn query_param(query: &str, name: &str) -> Option<String> {
    query.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (percent_decode(k) == name).then(|| percent_decode(v))
    })
}

fn percent_decode(s: &str) -> String {
    let hex = |b: u8| {
        char::from(b)
            .to_digit(16)
            .and_then(|d| u8::try_from(d).ok())
    };
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        let escaped = match (b, bytes.get(i + 1), bytes.get(i + 2)) {
            (b'%', Some(&hi), Some(&lo)) => hex(hi).zip(hex(lo)).map(|(hi, lo)| hi << 4 | lo),
            _ => None,
        };
        match (b, escaped) {
            (_, Some(decoded)) => {
                out.push(decoded);
                i += 3;
            }
            (b'+', None) => {
                out.push(b' ');
                i += 1;
            }
            (b, None) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn request_bodies_embed_as_json_or_as_text() {
        for (body, expected) in [
            ("{}", json!({})),
            (
                // Numbers keep their text (serde_json's arbitrary_precision, which the proxy's
                // key derivation needs), so compare a spelling that round-trips.
                " [1, -2500.0, true, false, null, \"a\\u00e9\\n\"] ",
                json!([1, -2500.0, true, false, null, "a\u{e9}\n"]),
            ),
            (r#"{"a":{"b":[{}]}}"#, json!({"a": {"b": [{}]}})),
            ("0", json!(0)),
            ("\"x\"", json!("x")),
        ] {
            assert_eq!(body_json(body.as_bytes()), expected, "{body}");
        }
        for text in [
            "",
            "{",
            "{a:1}",
            "01",
            "[1,]",
            "\"\\x\"",
            "1 2",
            "tru",
            "-",
            "1.",
            "\"\\ud800\"",
        ] {
            assert_eq!(body_json(text.as_bytes()), json!(text), "{text}");
        }
        let deep = format!("{}{}", "[".repeat(1000), "]".repeat(1000));
        assert_eq!(body_json(deep.as_bytes()), json!(deep), "too deep: text");
        assert_eq!(body_json(b"a\xffb"), json!("a\u{fffd}b"), "lossy UTF-8");
    }

    #[test]
    fn query_decoding() {
        assert_eq!(
            query_param("a=1&key=x%2By+z", "key").as_deref(),
            Some("x+y z")
        );
        assert_eq!(query_param("key=%zz%4", "key").as_deref(), Some("%zz%4"));
        assert_eq!(query_param("a=1", "key"), None);
    }
}
