//! The load generator: HTTP/1.1 keep-alive connections (`hyper::client::conn::http1`), or for
//! the gRPC rows HTTP/2 ones (`hyper::client::conn::http2`, prior knowledge), one per worker task, each sending its next request as soon as the last one is answered (a closed
//! loop), latencies into per-worker HDR histograms that are merged at the end.
//!
//! Every loop is bounded twice: by time (the warm-up plus the measured window) and by a shared
//! count of requests (`max_requests`), so a run stops by itself whatever the server does.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use http::header::{ACCEPT, CONTENT_TYPE, HOST};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpStream;
use tokio::task::JoinSet;

use crate::cores::Cores;
use crate::webhook::Signer;

/// How long a TCP connect (and the HTTP/1 handshake) may take.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long one request may take, from writing it to the last byte of the answer.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause after a failed connect, so a refusing server is not hammered in a tight loop.
const RECONNECT_PAUSE: Duration = Duration::from_millis(50);
/// Latencies are recorded in microseconds, from 1 µs to a minute, 3 significant digits.
const HISTOGRAM_MAX_MICROS: u64 = 60_000_000;

pub(crate) const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
pub(crate) const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// A request sender on one connection.
pub(crate) enum Sender {
    Http1(hyper::client::conn::http1::SendRequest<Full<Bytes>>),
    /// HTTP/2 with prior knowledge (the gRPC rows): one request at a time on it, as on HTTP/1.1,
    /// so the closed loop compares like with like.
    Http2(hyper::client::conn::http2::SendRequest<Full<Bytes>>),
}

impl Sender {
    pub(crate) fn is_closed(&self) -> bool {
        match self {
            Sender::Http1(s) => s.is_closed(),
            Sender::Http2(s) => s.is_closed(),
        }
    }

    async fn ready(&mut self) -> Result<(), hyper::Error> {
        match self {
            Sender::Http1(s) => s.ready().await,
            Sender::Http2(s) => s.ready().await,
        }
    }

    async fn send(
        &mut self,
        request: Request<Full<Bytes>>,
    ) -> Result<http::Response<Incoming>, hyper::Error> {
        match self {
            Sender::Http1(s) => s.send_request(request).await,
            Sender::Http2(s) => s.send_request(request).await,
        }
    }
}

/// A response, read whole.
pub(crate) struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    /// Carries `Idempotent-Replayed: true`.
    pub(crate) fn replayed(&self) -> bool {
        self.headers.get(REPLAYED).is_some_and(|v| v == "true")
    }
}

/// Opens a connection; its driver runs on a task of its own until the sender is dropped or the
/// server closes the connection.
pub(crate) async fn connect(addr: SocketAddr) -> Result<Sender, String> {
    connect_as(addr, false).await
}

/// Opens an HTTP/1.1 connection, or an HTTP/2 one with `h2`.
pub(crate) async fn connect_as(addr: SocketAddr, h2: bool) -> Result<Sender, String> {
    let opening = async {
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        stream
            .set_nodelay(true)
            .map_err(|e| format!("set_nodelay: {e}"))?;
        let io = TokioIo::new(stream);
        if h2 {
            let (sender, connection) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
                    .await
                    .map_err(|e| format!("handshake: {e}"))?;
            tokio::spawn(async move {
                let _ = connection.await;
            });
            return Ok(Sender::Http2(sender));
        }
        let (sender, connection) = hyper::client::conn::http1::handshake(io)
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        tokio::spawn(async move {
            // An error here is the server closing the connection; the sender sees it too.
            let _ = connection.await;
        });
        Ok(Sender::Http1(sender))
    };
    tokio::time::timeout(CONNECT_TIMEOUT, opening)
        .await
        .map_err(|_| format!("connect: no connection within {CONNECT_TIMEOUT:?}"))?
}

/// Sends one request on a ready connection and reads the whole answer, within
/// [`REQUEST_TIMEOUT`].
pub(crate) async fn exchange(
    sender: &mut Sender,
    request: Request<Full<Bytes>>,
) -> Result<Answer, String> {
    let exchange = async {
        sender
            .ready()
            .await
            .map_err(|e| format!("connection closed: {e}"))?;
        let response = sender
            .send(request)
            .await
            .map_err(|e| format!("request failed: {e}"))?;
        let (parts, body) = response.into_parts();
        let body = body
            .collect()
            .await
            .map_err(|e| format!("reading the body failed: {e}"))?
            .to_bytes();
        Ok(Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    };
    tokio::time::timeout(REQUEST_TIMEOUT, exchange)
        .await
        .map_err(|_| format!("no answer within {REQUEST_TIMEOUT:?}"))?
}

/// One request on a connection of its own (setup and control calls, not load).
pub(crate) async fn request_once(
    addr: SocketAddr,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: Bytes,
) -> Result<Answer, String> {
    let mut request = Request::builder()
        .method(method)
        .uri(path)
        .header(HOST, addr.to_string());
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request
        .body(Full::new(body))
        .map_err(|e| format!("building a request: {e}"))?;
    send_once(addr, request).await
}

/// Sends `request` on a connection of its own.
pub(crate) async fn send_once(
    addr: SocketAddr,
    request: Request<Full<Bytes>>,
) -> Result<Answer, String> {
    let h2 = request.uri().scheme().is_some();
    let mut sender = connect_as(addr, h2).await?;
    exchange(&mut sender, request).await
}

/// The `Idempotency-Key` of each request.
#[derive(Clone, Debug)]
pub(crate) enum Key {
    /// No key header.
    None,
    /// The same key every time.
    Fixed(HeaderValue),
    /// A new key per request: this prefix and the request's ticket number.
    Unique { prefix: Arc<str> },
    /// No key header: a Standard Webhooks delivery per request, a new event id each, signed.
    Signed(Arc<Signer>),
    /// No key header: a JSON-RPC `tools/call` of the mock's `echo` tool per request, the body
    /// its arguments, the request's ticket its `id` (a new id every time, as agents retry), and
    /// in `_meta` the key `prefix` (`fixed`: the same every time) or `prefix` and the ticket.
    Call { prefix: Arc<str>, fixed: bool },
    /// A gRPC unary call over HTTP/2 (`content-type: application/grpc`, `te: trailers`, the body
    /// one framed message), with `idempotency-key` metadata: none (`prefix` empty), `prefix`
    /// every time (`fixed`), or `prefix` and the ticket.
    Grpc { prefix: Arc<str>, fixed: bool },
}

impl Key {
    /// Whether its requests go over HTTP/2.
    pub(crate) fn h2(&self) -> bool {
        matches!(self, Key::Grpc { .. })
    }
}

/// What every request of a load run looks like: `POST path` with a JSON body.
#[derive(Clone, Debug)]
pub(crate) struct RequestSpec {
    pub path: &'static str,
    pub host: HeaderValue,
    pub headers: Vec<(HeaderName, HeaderValue)>,
    pub key: Key,
    pub body: Bytes,
}

impl RequestSpec {
    /// The request with ticket number `ticket` (unique within a run).
    pub(crate) fn build(&self, ticket: u64) -> Request<Full<Bytes>> {
        let mut request = Request::new(Full::new(self.body.clone()));
        *request.method_mut() = Method::POST;
        *request.uri_mut() = Uri::from_static(self.path);
        let headers = request.headers_mut();
        headers.insert(HOST, self.host.clone());
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        for (name, value) in &self.headers {
            headers.append(name.clone(), value.clone());
        }
        match &self.key {
            Key::None => {}
            Key::Fixed(value) => {
                headers.insert(IDEMPOTENCY_KEY, value.clone());
            }
            Key::Unique { prefix } => {
                headers.insert(IDEMPOTENCY_KEY, unique_key(prefix, ticket));
            }
            Key::Signed(signer) => {
                for (name, value) in signer.headers(ticket, &self.body) {
                    headers.insert(name, value);
                }
            }
            Key::Grpc { prefix, fixed } => {
                // HTTP/2 names the target in the URI (`:scheme`, `:authority`), set below.
                headers.remove(HOST);
                headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
                headers.insert(http::header::TE, HeaderValue::from_static("trailers"));
                if !prefix.is_empty() {
                    let key = if *fixed {
                        HeaderValue::try_from(prefix.as_ref()).expect("a key is a header value")
                    } else {
                        unique_key(prefix, ticket)
                    };
                    headers.insert(IDEMPOTENCY_KEY, key);
                }
            }
            Key::Call { prefix, fixed } => {
                headers.insert(
                    ACCEPT,
                    HeaderValue::from_static("application/json, text/event-stream"),
                );
                let key = if *fixed {
                    prefix.to_string()
                } else {
                    format!("{prefix}{ticket:012x}")
                };
                *request.body_mut() = Full::new(call_body(ticket, &key, &self.body));
            }
        }
        if self.key.h2()
            && let Ok(uri) = Uri::try_from(format!(
                "http://{}{}",
                self.host.to_str().unwrap_or("127.0.0.1"),
                self.path
            ))
        {
            *request.uri_mut() = uri;
        }
        request
    }
}

/// A `tools/call` of `echo` with `arguments` (JSON), `id` the ticket and `key` in `_meta`.
fn call_body(ticket: u64, key: &str, arguments: &[u8]) -> Bytes {
    let mut body = Vec::with_capacity(arguments.len() + key.len() + 120);
    body.extend_from_slice(
        format!(r#"{{"jsonrpc":"2.0","id":{ticket},"method":"tools/call","params":{{"name":"echo","arguments":"#)
            .as_bytes(),
    );
    body.extend_from_slice(arguments);
    body.extend_from_slice(format!(r#","_meta":{{"idempotency-key":"{key}"}}}}}}"#).as_bytes());
    Bytes::from(body)
}

/// `prefix` and the ticket number in hex: unique as long as the prefix is.
fn unique_key(prefix: &str, ticket: u64) -> HeaderValue {
    HeaderValue::try_from(format!("{prefix}{ticket:012x}")).expect("a key is a header value")
}

/// The answer a scenario expects; anything else is an error.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Expect {
    pub status: StatusCode,
    /// `Idempotent-Replayed: true` present (or, when false, absent).
    pub replayed: bool,
    pub body_len: Option<usize>,
}

impl Expect {
    pub(crate) fn check(&self, answer: &Answer) -> Result<(), String> {
        if answer.status != self.status {
            return Err(format!("status {}", answer.status.as_u16()));
        }
        if answer.replayed() != self.replayed {
            return Err(if self.replayed {
                "not replayed".to_owned()
            } else {
                "replayed".to_owned()
            });
        }
        match self.body_len {
            Some(len) if answer.body.len() != len => {
                Err(format!("body of {} bytes", answer.body.len()))
            }
            _ => Ok(()),
        }
    }

    /// For the notes column: `200`, `200+replayed`.
    pub(crate) fn describe(&self) -> String {
        let replayed = if self.replayed { "+replayed" } else { "" };
        format!("{}{replayed}", self.status.as_u16())
    }
}

/// An empty latency histogram (microseconds).
pub(crate) fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, HISTOGRAM_MAX_MICROS, 3).expect("valid histogram bounds")
}

/// Records `elapsed` in microseconds (clamped to the histogram's range).
pub(crate) fn record(histogram: &mut Histogram<u64>, elapsed: Duration) {
    let micros = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
    histogram.saturating_record(micros.max(1));
}

/// What a load run measured. Only answers completed inside the measured window count.
pub(crate) struct Stats {
    /// Latencies of the expected answers, in microseconds.
    pub histogram: Histogram<u64>,
    pub ok: u64,
    pub errors: u64,
    /// Errors by kind (`status 503`, `connect: ...`), warm-up included.
    pub error_kinds: BTreeMap<String, u64>,
    pub warmup_errors: u64,
    /// Connections the server closed between requests (not errors).
    pub reconnects: u64,
    pub window: Duration,
    /// The request cap ended the run before its time was up.
    pub capped: bool,
    /// CPU time of the server under test per answered request (warm-up included), when its
    /// process could be read.
    pub cpu_per_request: Option<Duration>,
    /// The cores each process taking part used over the same window (the `limit` column), when
    /// the caller measured them.
    pub cores: Option<Cores>,
}

impl Stats {
    pub(crate) fn new() -> Self {
        Stats {
            histogram: histogram(),
            ok: 0,
            errors: 0,
            error_kinds: BTreeMap::new(),
            warmup_errors: 0,
            reconnects: 0,
            window: Duration::ZERO,
            capped: false,
            cpu_per_request: None,
            cores: None,
        }
    }

    /// Expected answers per second of the measured window.
    pub(crate) fn rps(&self) -> f64 {
        let secs = self.window.as_secs_f64();
        if secs > 0.0 {
            self.ok as f64 / secs
        } else {
            0.0
        }
    }

    /// A latency quantile, if anything was recorded.
    pub(crate) fn quantile(&self, q: f64) -> Option<Duration> {
        (!self.histogram.is_empty())
            .then(|| Duration::from_micros(self.histogram.value_at_quantile(q)))
    }

    fn error(&mut self, measured: bool, kind: String) {
        if measured {
            self.errors += 1;
        } else {
            self.warmup_errors += 1;
        }
        *self.error_kinds.entry(kind).or_insert(0) += 1;
    }

    fn merge(&mut self, other: Stats) {
        self.histogram
            .add(&other.histogram)
            .expect("histograms with the same bounds merge");
        self.ok += other.ok;
        self.errors += other.errors;
        self.warmup_errors += other.warmup_errors;
        self.reconnects += other.reconnects;
        self.capped |= other.capped;
        for (kind, n) in other.error_kinds {
            *self.error_kinds.entry(kind).or_insert(0) += n;
        }
    }

    /// The most frequent error kinds, for a progress line.
    pub(crate) fn error_summary(&self) -> String {
        let mut kinds: Vec<_> = self.error_kinds.iter().collect();
        kinds.sort_by(|a, b| b.1.cmp(a.1));
        let shown: Vec<String> = kinds
            .iter()
            .take(3)
            .map(|(kind, n)| format!("{kind} x{n}"))
            .collect();
        shown.join("; ")
    }
}

/// One load run against one address.
#[derive(Clone)]
pub(crate) struct LoadPlan {
    pub addr: SocketAddr,
    pub spec: RequestSpec,
    pub expect: Expect,
    pub connections: usize,
    pub warmup: Duration,
    pub duration: Duration,
    /// The most requests sent in the whole run, warm-up included.
    pub max_requests: u64,
}

/// Runs `plan`: `connections` workers until the warm-up and the window have passed or the
/// request cap is reached. `done` counts answered requests as they land (for progress lines).
pub(crate) async fn run(plan: Arc<LoadPlan>, done: Arc<AtomicU64>) -> Stats {
    let started = Instant::now();
    let measure_from = started + plan.warmup;
    let end = measure_from + plan.duration;
    let tickets = Arc::new(AtomicU64::new(0));
    let mut workers = JoinSet::new();
    for _ in 0..plan.connections.max(1) {
        let (plan, tickets, done) = (plan.clone(), tickets.clone(), done.clone());
        workers.spawn(worker(plan, tickets, done, measure_from, end));
    }
    let mut total = Stats::new();
    let mut last_finish = measure_from;
    while let Some(joined) = workers.join_next().await {
        match joined {
            Ok((stats, finished)) => {
                last_finish = last_finish.max(finished);
                total.merge(stats);
            }
            Err(e) => total.error(true, format!("worker panicked: {e}")),
        }
    }
    total.window = last_finish.min(end).saturating_duration_since(measure_from);
    total
}

async fn worker(
    plan: Arc<LoadPlan>,
    tickets: Arc<AtomicU64>,
    done: Arc<AtomicU64>,
    measure_from: Instant,
    end: Instant,
) -> (Stats, Instant) {
    let mut stats = Stats::new();
    let mut connection: Option<Sender> = None;
    while Instant::now() < end {
        let mut sender = match connection.take() {
            Some(sender) if !sender.is_closed() => sender,
            previous => {
                if previous.is_some() {
                    stats.reconnects += 1;
                }
                match connect_as(plan.addr, plan.spec.key.h2()).await {
                    Ok(sender) => sender,
                    Err(e) => {
                        stats.error(Instant::now() >= measure_from, e);
                        tokio::time::sleep(RECONNECT_PAUSE).await;
                        continue;
                    }
                }
            }
        };
        let ticket = tickets.fetch_add(1, Ordering::Relaxed);
        if ticket >= plan.max_requests {
            stats.capped = true;
            break;
        }
        let request = plan.spec.build(ticket);
        let began = Instant::now();
        let result = exchange(&mut sender, request).await;
        let finished = Instant::now();
        done.fetch_add(1, Ordering::Relaxed);
        let measured = finished >= measure_from && finished <= end;
        match result {
            Ok(answer) => {
                // The answer arrived whole, so the connection is still good for the next one.
                connection = Some(sender);
                match plan.expect.check(&answer) {
                    Ok(()) if measured => {
                        stats.ok += 1;
                        record(&mut stats.histogram, finished - began);
                    }
                    Ok(()) => {}
                    Err(kind) => stats.error(measured, kind),
                }
            }
            // The connection's state is unknown: drop it, the next turn opens a new one.
            Err(kind) => stats.error(measured, kind),
        }
    }
    (stats, Instant::now())
}
