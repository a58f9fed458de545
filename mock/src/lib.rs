//! The bundled mock booking service: a fake legacy booking API that counts its side effects.
//!
//! The demo puts the proxy in front of it, the integration tests use it to see whether the
//! upstream "ran the operation", and the benches use it as the baseline upstream. It is a real
//! HTTP server (HTTP/1.1, and HTTP/2 with prior knowledge, on the crate's own
//! [`Listener`](crate::server::listener::Listener)), so everything the proxy does to a request or a response
//! crosses a real socket.
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
//! ```no_run
//! # async fn example() -> std::io::Result<()> {
//! let mock = idemproxy::mock::start().await?;
//! // point the proxy (or any client) at mock.url(), then:
//! assert_eq!(mock.calls("8e03978e-40d5-43e8-bc93-6894a57f9324"), 0);
//! mock.shutdown().await
//! # }
//! ```

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::io;
use std::net::SocketAddr;
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
use hyper::body::Incoming;
use serde_json::{Map, Value, json};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::server::listener::{Handler, Listener, ListenerLimits, Peer};

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

/// How long `serve` lets requests in flight finish after its shutdown future resolves. A mock
/// must not hang a test run (or a Ctrl-C) on a request that asked for a one-hour delay.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

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
/// Cheap to clone (an `Arc` inside); every clone sees the same counters. Pass one to [`serve`]
/// and keep another to read the counters, or use [`start`], whose handle does both.
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

/// Serves the mock on `listener` until `shutdown` resolves, then stops accepting, lets requests
/// in flight finish (for a few seconds at most) and returns.
///
/// Each connection speaks HTTP/1.1 or, with prior knowledge, HTTP/2. Accept errors (for example
/// running out of file descriptors) are logged and retried, never fatal.
pub async fn serve(
    listener: TcpListener,
    state: MockUpstream,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let drain = Listener::new(listener, "mock upstream", LIMITS)
        .run(Service(state), shutdown)
        .await;
    if !drain.close_within(SHUTDOWN_GRACE).await {
        tracing::warn!("mock upstream: requests still in flight after the grace period");
    }
    Ok(())
}

/// The mock's limits are generous: tests park requests on it for seconds (`X-Mock-Delay`) and
/// the proxy keeps pooled connections to it. Its header limits are hyper's defaults (100
/// headers), which the proxy's own limits are measured against.
const LIMITS: ListenerLimits = ListenerLimits {
    max_connections: 10_000,
    header_read_timeout: Duration::from_secs(300),
    send_timeout: Duration::from_secs(300),
    max_headers: 100,
    max_head_bytes: 8192 + 4096 * 100,
};

/// The mock as a listener's handler.
struct Service(MockUpstream);

impl Handler for Service {
    type Body = MockBody;
    type Error = MockError;

    async fn call(
        self: Arc<Self>,
        request: Request<Incoming>,
        peer: Peer,
    ) -> Result<Response<MockBody>, MockError> {
        handle(&self.0, &peer, request).await
    }
}

/// Binds `127.0.0.1:0`, serves a fresh [`MockUpstream`] there on the current Tokio runtime and
/// returns its handle.
pub async fn start() -> io::Result<MockHandle> {
    let listener = TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0)).await?;
    let addr = listener.local_addr()?;
    let state = MockUpstream::new();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(serve(listener, state.clone(), async move {
        // Resolves on an explicit stop and when the handle is dropped.
        let _ = stopped.await;
    }));
    Ok(MockHandle {
        addr,
        state,
        stop: Some(stop),
        task: Some(task),
    })
}

/// A running mock started by [`start`]: its address and its counters. Stops the server when
/// dropped (requests in flight get a few seconds to finish).
pub struct MockHandle {
    addr: SocketAddr,
    state: MockUpstream,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<io::Result<()>>>,
}

impl MockHandle {
    /// The address the mock listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The base URL, e.g. `http://127.0.0.1:40123` (no trailing slash).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The shared state, to hand to code that wants a [`MockUpstream`].
    pub fn state(&self) -> &MockUpstream {
        &self.state
    }

    /// See [`MockUpstream::calls`].
    pub fn calls(&self, key: &str) -> u64 {
        self.state.calls(key)
    }

    /// See [`MockUpstream::total`].
    pub fn total(&self) -> u64 {
        self.state.total()
    }

    /// See [`MockUpstream::bookings`].
    pub fn bookings(&self) -> u64 {
        self.state.bookings()
    }

    /// See [`MockUpstream::stats`].
    pub fn stats(&self) -> MockStats {
        self.state.stats()
    }

    /// See [`MockUpstream::last_request`].
    pub fn last_request(&self) -> Option<RecordedRequest> {
        self.state.last_request()
    }

    /// See [`MockUpstream::reset`].
    pub fn reset(&self) {
        self.state.reset();
    }

    /// Stops the server and waits until it has stopped.
    pub async fn shutdown(mut self) -> io::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.task.take() {
            Some(task) => task.await.map_err(io::Error::other)?,
            None => Ok(()),
        }
    }
}

impl Drop for MockHandle {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

impl std::fmt::Debug for MockHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MockHandle")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

/// Why the service gave up on a request instead of answering it. Hyper then closes the
/// connection without a response, which is the point for [`MockError::Reset`].
#[derive(Debug, thiserror::Error)]
enum MockError {
    #[error("connection reset on request (X-Mock-Reset)")]
    Reset,
    #[error("reading the request body failed")]
    RequestBody(#[source] Box<dyn std::error::Error + Send + Sync>),
}

async fn handle(
    state: &MockUpstream,
    peer: &Peer,
    request: Request<Incoming>,
) -> Result<Response<MockBody>, MockError> {
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
        return Ok(control_reply(state, &parts, control).finish());
    }

    // The side effect happens here, before anything below can delay or fail the answer.
    state.record(&parts, &body);

    let directives = match Directives::parse(&parts.headers) {
        Ok(directives) => directives,
        Err(message) => return Ok(error_reply(StatusCode::BAD_REQUEST, &message).finish()),
    };
    if let Some(delay) = directives.delay {
        tokio::time::sleep(delay).await;
    }
    if directives.reset {
        // Nothing more is written, not even a FIN, and the socket closes with a TCP reset.
        peer.reset();
        return Err(MockError::Reset);
    }

    let mut reply = match directives.status {
        Some(status) => status_reply(status, &parts),
        None => route(state, &parts, &body),
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
struct MockBody {
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
    #![allow(clippy::unwrap_used)]

    use super::*;
    use http_body_util::Full;
    use hyper_util::client::legacy::Client;
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::rt::TokioExecutor;
    use std::time::Instant;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    type TestClient = Client<HttpConnector, Full<Bytes>>;

    fn client() -> TestClient {
        Client::builder(TokioExecutor::new()).build_http()
    }

    async fn send(
        client: &TestClient,
        method: Method,
        url: String,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Result<(StatusCode, HeaderMap, Bytes), Box<dyn std::error::Error + Send + Sync>> {
        let mut request = Request::builder().method(method).uri(url);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request.body(Full::new(Bytes::from(body.to_owned())))?;
        let response = client.request(request).await?;
        let (parts, body) = response.into_parts();
        let body = body.collect().await?.to_bytes();
        Ok((parts.status, parts.headers, body))
    }

    fn doc(body: &Bytes) -> Value {
        serde_json::from_slice(body).unwrap()
    }

    #[tokio::test]
    async fn post_bookings_creates_and_counts_per_key() {
        let mock = start().await.unwrap();
        let client = client();
        let url = format!("{}/bookings", mock.url());

        let (status, headers, body) = send(
            &client,
            Method::POST,
            url.clone(),
            &[
                ("idempotency-key", "k1"),
                ("content-type", "application/json"),
            ],
            r#"{"room": 12, "nights": [1, 2]}"#,
        )
        .await
        .unwrap();
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(headers["location"], "/bookings/bk_1");
        assert_eq!(headers["x-booking-id"], "bk_1");
        assert_eq!(headers["content-type"], "application/json");
        assert!(headers.contains_key("etag"));
        assert_eq!(
            doc(&body),
            json!({"id": "bk_1", "seq": 1, "request": {"room": 12, "nights": [1, 2]}})
        );

        let (status, _, created) = send(
            &client,
            Method::POST,
            url.clone(),
            &[("idempotency-key", "k1")],
            "not \"json\"",
        )
        .await
        .unwrap();
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(
            doc(&created),
            json!({"id": "bk_2", "seq": 2, "request": "not \"json\""})
        );
        send(&client, Method::POST, url, &[("idempotency-key", "k2")], "")
            .await
            .unwrap();

        assert_eq!(mock.calls("k1"), 2);
        assert_eq!(mock.calls("k2"), 1);
        assert_eq!(mock.calls("nope"), 0);
        assert_eq!(mock.total(), 3);
        assert_eq!(mock.bookings(), 3);

        let (status, headers, body) = send(
            &client,
            Method::GET,
            format!("{}/bookings/bk_2", mock.url()),
            &[],
            "",
        )
        .await
        .unwrap();
        assert_eq!(status, StatusCode::OK);
        assert_eq!(headers["x-booking-id"], "bk_2");
        assert_eq!(body, created, "the stored booking, byte for byte");
        let (status, _, body) = send(
            &client,
            Method::GET,
            format!("{}/bookings/bk_99", mock.url()),
            &[],
            "",
        )
        .await
        .unwrap();
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert_eq!(
            doc(&body),
            json!({"error": "booking not found", "id": "bk_99"})
        );
        // GETs count too (no key): 3 + 2.
        assert_eq!(mock.total(), 5);

        mock.reset();
        assert_eq!(mock.stats(), MockStats::default());
        let (_, headers, _) = send(
            &client,
            Method::POST,
            format!("{}/bookings", mock.url()),
            &[],
            "",
        )
        .await
        .unwrap();
        assert_eq!(headers["x-booking-id"], "bk_4", "ids are never reused");
        mock.shutdown().await.unwrap();
    }

    #[tokio::test]
    async fn delay_is_counted_before_the_answer() {
        let mock = start().await.unwrap();
        let client = client();
        let url = format!("{}/payments", mock.url());
        let started = Instant::now();
        let request = tokio::spawn(async move {
            send(
                &client,
                Method::POST,
                url,
                &[("idempotency-key", "slow"), ("x-mock-delay", "300ms")],
                "{}",
            )
            .await
            .map(|(status, _, _)| status)
        });
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(mock.calls("slow"), 1, "counted while still delaying");
        assert!(!request.is_finished());
        assert_eq!(request.await.unwrap().unwrap(), StatusCode::OK);
        assert!(started.elapsed() >= Duration::from_millis(300));
    }

    #[tokio::test]
    async fn status_override() {
        let mock = start().await.unwrap();
        let (status, headers, body) = send(
            &client(),
            Method::POST,
            format!("{}/bookings", mock.url()),
            &[("idempotency-key", "k"), ("x-mock-status", "503")],
            "{}",
        )
        .await
        .unwrap();
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(headers["content-type"], "application/json");
        assert_eq!(
            doc(&body),
            json!({
                "status": 503,
                "reason": "Service Unavailable",
                "method": "POST",
                "path": "/bookings",
                "mock": "X-Mock-Status",
            })
        );
        assert_eq!(mock.calls("k"), 1);
        assert_eq!(mock.bookings(), 0, "the route did not run");
    }

    #[tokio::test]
    async fn invalid_directive_is_a_400() {
        let mock = start().await.unwrap();
        let (status, _, body) = send(
            &client(),
            Method::GET,
            format!("{}/x", mock.url()),
            &[("x-mock-delay", "soon")],
            "",
        )
        .await
        .unwrap();
        assert_eq!(status, StatusCode::BAD_REQUEST);
        let error = doc(&body)["error"].as_str().unwrap().to_owned();
        assert!(error.contains("x-mock-delay"), "{error}");
    }

    #[tokio::test]
    async fn body_size_headers_and_cookies() {
        let mock = start().await.unwrap();
        for size in [0usize, 1, 100, 64 * 1024, 200_001] {
            let size_text = size.to_string();
            let (status, headers, body) = send(
                &client(),
                Method::POST,
                format!("{}/bookings", mock.url()),
                &[
                    ("x-mock-body-size", &size_text),
                    ("x-mock-set-cookie", "session=abc; Path=/"),
                    ("x-mock-header", "X-Foo: 1"),
                    ("x-mock-header", "Keep-Alive: timeout=5"),
                    ("x-mock-header", "X-Foo: 2"),
                ],
                "{}",
            )
            .await
            .unwrap();
            assert_eq!(status, StatusCode::CREATED);
            assert_eq!(headers["content-type"], "application/octet-stream");
            assert_eq!(headers["content-length"], size_text.as_str());
            assert_eq!(headers["set-cookie"], "session=abc; Path=/");
            let foo: Vec<_> = headers.get_all("x-foo").iter().collect();
            assert_eq!(foo, ["1", "2"]);
            assert_eq!(headers["keep-alive"], "timeout=5");
            assert_eq!(body.len(), size);
            assert!(body[..] == body_pattern(size)[..]);
        }
    }

    #[tokio::test]
    async fn echo_shows_what_arrived() {
        let mock = start().await.unwrap();
        let (status, _, body) = send(
            &client(),
            Method::PUT,
            format!("{}/echo/a?b=1&c=%20", mock.url()),
            &[
                ("idempotency-key", "\"quoted\""),
                ("x-forwarded-for", "10.0.0.1"),
            ],
            "plain\ntext",
        )
        .await
        .unwrap();
        assert_eq!(status, StatusCode::OK);
        let echo = doc(&body);
        assert_eq!(echo["method"], "PUT");
        assert_eq!(echo["path"], "/echo/a");
        assert_eq!(echo["query"], "b=1&c=%20");
        assert_eq!(echo["headers"]["idempotency-key"], json!(["\"quoted\""]));
        assert_eq!(echo["headers"]["x-forwarded-for"], json!(["10.0.0.1"]));
        assert_eq!(echo["body"], "plain\ntext");
        assert_eq!(echo.as_object().unwrap().len(), 5, "{echo}");
        assert_eq!(mock.calls("\"quoted\""), 1);
        let last = mock.last_request().unwrap();
        assert_eq!(last.method, Method::PUT);
        assert_eq!(last.uri.query(), Some("b=1&c=%20"));
        assert_eq!(last.headers["x-forwarded-for"], "10.0.0.1");
        assert_eq!(&last.body[..], b"plain\ntext");
    }

    #[tokio::test]
    async fn reset_is_a_client_error_and_still_counted() {
        let mock = start().await.unwrap();
        let result = send(
            &client(),
            Method::POST,
            format!("{}/bookings", mock.url()),
            &[("idempotency-key", "boom"), ("x-mock-reset", "true")],
            "{}",
        )
        .await;
        assert!(result.is_err(), "{result:?}");
        assert_eq!(mock.calls("boom"), 1);
    }

    #[tokio::test]
    async fn reset_is_a_tcp_reset() {
        let mock = start().await.unwrap();
        let mut stream = TcpStream::connect(mock.addr()).await.unwrap();
        stream
            .write_all(b"GET /x HTTP/1.1\r\nhost: mock\r\nx-mock-reset: 1\r\n\r\n")
            .await
            .unwrap();
        let mut buf = Vec::new();
        let error = stream.read_to_end(&mut buf).await.unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::ConnectionReset);
        assert!(buf.is_empty());
    }

    #[tokio::test]
    async fn partial_sends_half_then_drops() {
        let mock = start().await.unwrap();
        let mut stream = TcpStream::connect(mock.addr()).await.unwrap();
        stream
            .write_all(
                b"GET /x HTTP/1.1\r\nhost: mock\r\nx-mock-partial: true\r\nx-mock-body-size: 1000\r\n\r\n",
            )
            .await
            .unwrap();
        let mut buf = Vec::new();
        // An orderly close (or a reset) after the first half; either way, no more data.
        let _ = stream.read_to_end(&mut buf).await;
        let text = String::from_utf8_lossy(&buf);
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert!(head.contains("content-length: 1000"), "{head}");
        assert_eq!(body.as_bytes(), &body_pattern(500)[..]);

        // The hyper client sees an incomplete body.
        let result = send(
            &client(),
            Method::POST,
            format!("{}/bookings", mock.url()),
            &[("x-mock-partial", "true")],
            "{}",
        )
        .await;
        assert!(result.is_err(), "{result:?}");
        assert_eq!(mock.total(), 2);
    }

    #[tokio::test]
    async fn control_endpoints_are_not_counted() {
        let mock = start().await.unwrap();
        let client = client();
        for key in ["a", "a", "b/c d"] {
            send(
                &client,
                Method::POST,
                format!("{}/bookings", mock.url()),
                &[("idempotency-key", key)],
                "",
            )
            .await
            .unwrap();
        }
        send(
            &client,
            Method::DELETE,
            format!("{}/x", mock.url()),
            &[],
            "",
        )
        .await
        .unwrap();

        let (status, _, body) = send(
            &client,
            Method::GET,
            format!("{}/_mock/stats", mock.url()),
            &[],
            "",
        )
        .await
        .unwrap();
        assert_eq!(status, StatusCode::OK);
        assert_eq!(
            doc(&body),
            json!({"total": 4, "bookings": 3, "by_key": {"a": 2, "b/c d": 1}})
        );
        let (_, _, body) = send(
            &client,
            Method::GET,
            format!("{}/_mock/calls?key=b%2Fc+d", mock.url()),
            &[],
            "",
        )
        .await
        .unwrap();
        assert_eq!(doc(&body), json!({"key": "b/c d", "calls": 1}));
        let (status, _, body) = send(
            &client,
            Method::POST,
            format!("{}/_mock/reset", mock.url()),
            &[],
            "",
        )
        .await
        .unwrap();
        assert_eq!(status, StatusCode::OK);
        assert_eq!(doc(&body), json!({"reset": true}));
        assert_eq!(mock.stats(), MockStats::default());
    }

    #[tokio::test]
    async fn speaks_h2c() {
        let mock = start().await.unwrap();
        let client: TestClient = Client::builder(TokioExecutor::new())
            .http2_only(true)
            .build_http();
        let (status, _, body) = send(
            &client,
            Method::POST,
            format!("{}/bookings", mock.url()),
            &[("idempotency-key", "h2")],
            "{}",
        )
        .await
        .unwrap();
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(doc(&body), json!({"id": "bk_1", "seq": 1, "request": {}}));
        assert_eq!(mock.calls("h2"), 1);
    }

    #[tokio::test]
    async fn drop_stops_the_server() {
        let mock = start().await.unwrap();
        let addr = mock.addr();
        drop(mock);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(TcpStream::connect(addr).await.is_err());
    }

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
