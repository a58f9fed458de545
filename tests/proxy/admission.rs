//! What a request must be to be admitted (SPEC §4.1, §4.2): first hostile input over raw TCP,
//! requests no client library would send — malformed keys, control bytes, line breaks inside
//! headers, too many or too large headers, oversized bodies, and framing conflicts that smuggle
//! one request inside another; then, through a client library, bodies over
//! `max_request_body`, a request no route matches, a `Connection` header naming the key, scope
//! or fingerprint headers, and broken client bodies on a pass-through route.
//!
//! Each raw test writes bytes to the proxy and asserts the status, who answered (the proxy, with
//! `application/problem+json`, or hyper itself, before the proxy's service runs), that nothing
//! was claimed, and what the upstream saw.

use std::time::Duration;

use crate::support::{SEAT, assert_fresh, assert_nothing_stored, assert_replay_of, post_booking};
use bytes::Bytes;
use harness::every_store;
use harness::{Backend, Env, TestProxy};
use harness::{Reply, book, client, send};
use idemproxy::metrics::Outcome;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

// ---------------------------------------------------------------------------------------------
// Raw HTTP/1.1 over TCP
// ---------------------------------------------------------------------------------------------

/// How long any single exchange with the proxy may take before the test gives up.
const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// A response buffered beyond this is a bug in the test, not something to wait for.
const MAX_READ: usize = 1024 * 1024;

/// A response read off a raw connection.
#[derive(Debug)]
struct RawReply {
    status: u16,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
}

impl RawReply {
    /// The first value of a header (names compared case-insensitively), as lossy text.
    fn header(&self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    }

    /// Whether the proxy made this answer itself (a problem document).
    fn is_problem(&self) -> bool {
        self.header("content-type").as_deref() == Some("application/problem+json")
    }

    /// Asserts a problem+json of `slug` with `status`; returns the document.
    fn assert_problem(&self, status: u16, slug: &str) -> serde_json::Value {
        assert_eq!(self.status, status, "status; reply: {self}");
        assert!(self.is_problem(), "a problem+json; reply: {self}");
        let doc: serde_json::Value = serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("problem body is not JSON ({e}): {self}"));
        assert_eq!(
            doc["type"],
            format!("urn:idemproxy:problem:{slug}"),
            "problem type; reply: {self}"
        );
        assert_eq!(doc["status"], status, "problem status member: {doc}");
        doc
    }
}

impl std::fmt::Display for RawReply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} [", self.status)?;
        for (n, v) in &self.headers {
            write!(f, "{n}: {}; ", String::from_utf8_lossy(v))?;
        }
        write!(f, "] {}", String::from_utf8_lossy(&self.body))
    }
}

/// One raw client connection to the proxy, reading responses off it by hand.
struct RawConn {
    stream: TcpStream,
    /// Bytes read but not yet consumed by a parsed response.
    buf: Vec<u8>,
}

impl RawConn {
    async fn open(proxy: &TestProxy) -> RawConn {
        let stream = tokio::time::timeout(IO_TIMEOUT, TcpStream::connect(proxy.addr))
            .await
            .expect("connect in time")
            .expect("connect to the proxy");
        RawConn {
            stream,
            buf: Vec::new(),
        }
    }

    /// Writes `bytes`; false when the proxy had closed (or reset) the connection already,
    /// which is a legitimate answer to a request it refused before reading it all.
    async fn send(&mut self, bytes: &[u8]) -> bool {
        matches!(
            tokio::time::timeout(IO_TIMEOUT, self.stream.write_all(bytes)).await,
            Ok(Ok(()))
        )
    }

    /// Half-closes: the proxy reads the end of the stream, and can still answer.
    async fn finish_sending(&mut self) {
        let _ = tokio::time::timeout(IO_TIMEOUT, self.stream.shutdown()).await;
    }

    /// Reads more bytes into the buffer; false at end of stream, on an error, at `deadline`
    /// or when the buffer is full.
    async fn read_more(&mut self, deadline: Instant) -> bool {
        if self.buf.len() >= MAX_READ {
            return false;
        }
        let mut chunk = [0u8; 16 * 1024];
        match tokio::time::timeout_at(deadline, self.stream.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => {
                self.buf.extend_from_slice(&chunk[..n]);
                true
            }
            _ => false,
        }
    }

    /// The index of the first `needle` at or after `from`, reading until it arrives.
    async fn find(&mut self, from: usize, needle: &[u8], deadline: Instant) -> Option<usize> {
        loop {
            if let Some(i) = self.buf.get(from..).and_then(|b| position(b, needle)) {
                return Some(from + i);
            }
            if !self.read_more(deadline).await {
                return None;
            }
        }
    }

    /// Reads until the buffer holds at least `len` bytes.
    async fn fill(&mut self, len: usize, deadline: Instant) -> bool {
        while self.buf.len() < len {
            if !self.read_more(deadline).await {
                return false;
            }
        }
        true
    }

    /// Reads one whole response (head, then the body by `Content-Length`, chunked, or until the
    /// connection closes); `None` when the connection ends or `IO_TIMEOUT` passes first.
    async fn response(&mut self) -> Option<RawReply> {
        let deadline = Instant::now() + IO_TIMEOUT;
        let head_end = self.find(0, b"\r\n\r\n", deadline).await?;
        let head = String::from_utf8_lossy(&self.buf[..head_end]).into_owned();
        let mut lines = head.split("\r\n");
        let status = lines
            .next()
            .and_then(|l| l.strip_prefix("HTTP/1.1 "))
            .and_then(|l| l.get(..3))
            .and_then(|s| s.parse::<u16>().ok())?;
        let headers: Vec<(String, Vec<u8>)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(n, v)| (n.trim().to_owned(), v.trim().as_bytes().to_vec()))
            .collect();
        let mut reply = RawReply {
            status,
            headers,
            body: Vec::new(),
        };
        let start = head_end + 4;
        let chunked = reply
            .header("transfer-encoding")
            .is_some_and(|te| te.eq_ignore_ascii_case("chunked"));
        let length = reply
            .header("content-length")
            .and_then(|v| v.parse::<usize>().ok());
        let end = if chunked {
            let mut at = start;
            loop {
                let line_end = self.find(at, b"\r\n", deadline).await?;
                let size_text = String::from_utf8_lossy(&self.buf[at..line_end]).into_owned();
                let size_text = size_text.split(';').next().unwrap_or("").trim();
                let size = usize::from_str_radix(size_text, 16).ok()?;
                if size == 0 {
                    // No trailers from the proxy: the last chunk is followed by one empty line.
                    let last = line_end + 2;
                    if !self.fill(last + 2, deadline).await {
                        return None;
                    }
                    break last + 2;
                }
                let data = line_end + 2;
                if size > MAX_READ || !self.fill(data + size + 2, deadline).await {
                    return None;
                }
                reply.body.extend_from_slice(&self.buf[data..data + size]);
                at = data + size + 2;
            }
        } else if let Some(len) = length {
            if len > MAX_READ || !self.fill(start + len, deadline).await {
                return None;
            }
            reply.body = self.buf[start..start + len].to_vec();
            start + len
        } else if status == 204 || status == 304 || (100..200).contains(&status) {
            start
        } else {
            while self.read_more(deadline).await {}
            reply.body = self.buf[start..].to_vec();
            self.buf.len()
        };
        self.buf.drain(..end);
        Some(reply)
    }

    /// Whether the proxy closes the connection within `IO_TIMEOUT` without sending anything
    /// more (more bytes are kept in the buffer and make it false).
    async fn closes(&mut self) -> bool {
        let before = self.buf.len();
        let deadline = Instant::now() + IO_TIMEOUT;
        let mut chunk = [0u8; 4096];
        loop {
            match tokio::time::timeout_at(deadline, self.stream.read(&mut chunk)).await {
                Err(_) => return false,
                Ok(Ok(0)) | Ok(Err(_)) => return self.buf.len() == before,
                Ok(Ok(n)) => {
                    if self.buf.len() < MAX_READ {
                        self.buf.extend_from_slice(&chunk[..n]);
                    }
                }
            }
        }
    }
}

fn position(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Opens a connection, writes `request` and reads one response.
async fn exchange(proxy: &TestProxy, request: &[u8]) -> (RawReply, RawConn) {
    let mut conn = RawConn::open(proxy).await;
    conn.send(request).await;
    let reply = conn.response().await.unwrap_or_else(|| {
        panic!(
            "no response to {:?} (got {:?})",
            String::from_utf8_lossy(request),
            String::from_utf8_lossy(&conn.buf)
        )
    });
    (reply, conn)
}

// ---------------------------------------------------------------------------------------------
// Requests
// ---------------------------------------------------------------------------------------------

/// The request body every booking here sends.
const BODY: &str = r#"{"seat":"12A"}"#;

/// The chunk that ends a chunked body (no trailers).
const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

/// A request head: the request line `start`, `Host`, then `lines` (raw header lines, each
/// without its CRLF), then the empty line.
fn head(start: &str, lines: &[&[u8]]) -> Vec<u8> {
    let mut out = format!("{start}\r\nHost: proxy.test\r\n").into_bytes();
    for line in lines {
        out.extend_from_slice(line);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out
}

/// `POST /bookings` with `lines` and [`BODY`] by `Content-Length`.
fn booking(lines: &[&[u8]]) -> Vec<u8> {
    let length = format!("Content-Length: {}", BODY.len());
    let mut all = lines.to_vec();
    all.push(length.as_bytes());
    let mut out = head("POST /bookings HTTP/1.1", &all);
    out.extend_from_slice(BODY.as_bytes());
    out
}

/// `Idempotency-Key: ` followed by `value`, as one raw header line.
fn key_line(value: &[u8]) -> Vec<u8> {
    [b"Idempotency-Key: ".as_slice(), value].concat()
}

/// `POST /bookings` with one key header whose value is `value`, byte for byte.
fn booking_with_key(value: &[u8]) -> Vec<u8> {
    booking(&[&key_line(value)])
}

/// `POST /bookings` with key `key` and `lines`, then `body` as it is (framed by the caller).
fn booking_framed(key: &str, lines: &[&[u8]], body: &[u8]) -> Vec<u8> {
    let key = key_line(key.as_bytes());
    let mut all: Vec<&[u8]> = vec![&key];
    all.extend_from_slice(lines);
    let mut out = head("POST /bookings HTTP/1.1", &all);
    out.extend_from_slice(body);
    out
}

/// One chunk of a chunked body: `data` framed by its hex size.
fn chunk(data: &[u8]) -> Vec<u8> {
    let mut out = format!("{:x}\r\n", data.len()).into_bytes();
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
    out
}

/// A whole chunked body of `sizes` chunks of `x`, ended by [`LAST_CHUNK`].
fn chunked_body(sizes: &[usize]) -> Vec<u8> {
    let mut out: Vec<u8> = sizes.iter().flat_map(|&n| chunk(&vec![b'x'; n])).collect();
    out.extend_from_slice(LAST_CHUNK);
    out
}

/// `POST /bookings` with key `key` and exactly `total` request headers (Host, the key,
/// Content-Length and `X-Filler-N` lines).
fn booking_with_headers(key: &str, total: usize) -> Vec<u8> {
    let fillers: Vec<Vec<u8>> = (0..total.saturating_sub(3))
        .map(|i| format!("X-Filler-{i}: v").into_bytes())
        .collect();
    let key = key_line(key.as_bytes());
    let mut lines: Vec<&[u8]> = vec![&key];
    lines.extend(fillers.iter().map(Vec::as_slice));
    booking(&lines)
}

// ---------------------------------------------------------------------------------------------
// What was claimed, what went upstream
// ---------------------------------------------------------------------------------------------

/// The configuration of these tests: [`Env::config`] with `max_request_body: 1KiB` on
/// `create-booking` (`POST /bookings`).
fn small_body_config(env: &Env) -> String {
    env.config("required: true\nmax_request_body: 1KiB")
}

/// How many claims the proxy has attempted in its store (`claim` store operations).
fn claims(proxy: &TestProxy) -> u64 {
    // The harness's reader fails on a missing series: a claim count that is not exported is
    // an error, never a 0.
    proxy.metric(
        "idemproxy_store_operation_duration_seconds_count",
        &[("op", "claim")],
    ) as u64
}

/// Every key the proxy wrote to the store, sorted; empty for the memory store, which cannot be
/// looked into from outside.
fn stored_keys(env: &Env) -> Vec<String> {
    env.stored_key_names().unwrap_or_default()
}

/// Nothing was claimed: no claim was attempted, and the store (if it can be looked into) holds
/// no key.
fn assert_nothing_claimed(env: &Env, proxy: &TestProxy, what: &str) {
    assert_eq!(claims(proxy), 0, "{what}: no claim was attempted");
    assert_eq!(
        stored_keys(env),
        Vec::<String>::new(),
        "{what}: the store holds nothing"
    );
}

/// On a store that can be looked into, it holds exactly `count` keys, each
/// `idemproxy:create-booking:` and 64 hex digits: whatever bytes a key had, they never reach
/// the store unhashed.
fn assert_store_keys_hashed(env: &Env, count: usize) {
    if env.backend == Backend::Memory {
        return;
    }
    let keys = stored_keys(env);
    assert_eq!(keys.len(), count, "one store key per operation: {keys:?}");
    for k in &keys {
        let hash = k
            .strip_prefix("idemproxy:create-booking:")
            .unwrap_or_else(|| panic!("store key {k:?} has the route's prefix"));
        assert!(
            hash.len() == 64 && hash.bytes().all(|b| b.is_ascii_hexdigit()),
            "store key {k:?} is the prefix and a SHA-256 in hex"
        );
    }
}

/// A valid booking with key `key` now is forwarded (a 201 and one upstream call): an earlier
/// refusal with the same key left nothing behind — no claim (a 409) and no record (a replay).
async fn assert_key_is_free(env: &Env, proxy: &TestProxy, key: &str) {
    let (reply, _) = exchange(proxy, &booking_with_key(key.as_bytes())).await;
    assert_eq!(reply.status, 201, "key {key:?} is still free: {reply}");
    assert_eq!(
        reply.header("idempotent-replayed"),
        None,
        "not a replay: {reply}"
    );
    assert_eq!(env.mock.calls(key), 1, "key {key:?} went upstream once");
}

/// Sends `request` and asserts hyper's own refusal: `status`, and the connection closed after
/// it. hyper answers before the proxy's service runs, so the answer is hyper's: an empty body
/// with `connection: close` and no `Content-Type` (not problem+json, unlike the proxy's own
/// refusals). Only the status and the close are asserted.
async fn assert_refused_by_hyper(proxy: &TestProxy, request: &[u8], status: u16, what: &str) {
    let (reply, mut conn) = exchange(proxy, request).await;
    assert_eq!(reply.status, status, "{what}: hyper's answer: {reply}");
    assert!(
        conn.closes().await,
        "{what}: the connection is closed after it"
    );
}

/// Sends `request` and asserts the proxy's own refusal: a problem of `slug` with `status`.
async fn assert_refused_by_proxy(proxy: &TestProxy, request: &[u8], status: u16, slug: &str) {
    let (reply, _) = exchange(proxy, request).await;
    reply.assert_problem(status, slug);
}

// ---------------------------------------------------------------------------------------------
// The tests that concern an idempotent route, run on every store
// ---------------------------------------------------------------------------------------------

every_store!(
    malformed_keys_are_refused_by_the_proxy_and_claim_nothing,
    control_bytes_in_a_key_are_refused_by_hyper,
    odd_but_valid_keys_run_once_and_replay,
    key_header_sent_twice_is_refused,
    line_breaks_in_header_values,
    more_than_97_headers_get_a_431_problem,
    a_head_over_64_kib_gets_a_431_problem,
    bodies_over_max_request_body_are_413_by_length_and_by_chunks,
    conflicting_or_malformed_framing_headers_get_400_from_hyper,
    content_length_with_chunked_is_read_as_chunked_and_the_connection_closes,
    a_request_inside_a_chunked_body_stays_body,
    broken_or_cut_short_bodies_are_400_bad_request_body,
    body_over_max_request_body_is_413_and_claims_nothing,
    chunked_body_over_max_request_body_is_413,
    no_route_is_404,
    connection_naming_the_key_scope_or_fingerprint_header_is_refused,
);

// ---------------------------------------------------------------------------------------------
// Keys (SPEC §4.1)
// ---------------------------------------------------------------------------------------------

/// Values that reach the proxy's service but are not keys (SPEC §4.1: 1 to 255 visible ASCII
/// characters, spaces only inside a quoted string): each is a 400 `invalid-idempotency-key`
/// problem; nothing is claimed, nothing is forwarded, nothing is written to the store.
async fn malformed_keys_are_refused_by_the_proxy_and_claim_nothing(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&small_body_config(&env)).await;
    let long_bare = "k".repeat(256).into_bytes();
    let long_quoted = format!("\"{}\"", "q".repeat(256)).into_bytes();
    let cases: [(&str, &[u8]); 15] = [
        ("empty", b""),
        ("only spaces (trimmed to empty by the HTTP layer)", b"   "),
        ("256 characters", &long_bare),
        ("256 characters quoted", &long_quoted),
        ("an empty quoted string", b"\"\""),
        ("UTF-8 (e acute)", "caf\u{e9}".as_bytes()),
        ("a raw 0x80 byte", b"key-\x80"),
        ("a raw 0xFF byte", b"key-\xff"),
        ("UTF-8 inside a quoted string", "\"caf\u{e9}\"".as_bytes()),
        ("a TAB inside a bare key", b"a\tb"),
        ("a TAB inside a quoted key", b"\"a\tb\""),
        ("a space in a bare key", b"a b"),
        ("a Redis command as a bare key", b"SET idemproxy:x 1"),
        ("an unterminated quote with a space", b"\"a b"),
        ("a list of two keys", b"a, b"),
    ];
    for (what, value) in cases {
        let (reply, _) = exchange(&proxy, &booking_with_key(value)).await;
        let doc = reply.assert_problem(400, "invalid-idempotency-key");
        assert!(
            doc["detail"].as_str().is_some_and(|d| !d.is_empty()),
            "{what}: a detail: {doc}"
        );
    }
    assert_eq!(env.mock.stats().total, 0, "nothing was forwarded");
    assert_nothing_claimed(&env, &proxy, "malformed keys");
    assert_eq!(
        proxy.requests("create-booking", Outcome::InvalidKey),
        cases.len() as u64
    );
}

/// Control characters other than TAB (0x01, ESC, DEL 0x7F, NUL) and a bare CR inside the key's
/// value never reach the proxy's service: hyper's parser refuses the head with a bare 400 and
/// closes the connection. Nothing is claimed or forwarded.
async fn control_bytes_in_a_key_are_refused_by_hyper(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&small_body_config(&env)).await;
    let cases: [(&str, &[u8]); 5] = [
        ("0x01", b"ctl-\x01-key"),
        ("ESC 0x1B", b"ctl-\x1b-key"),
        ("DEL 0x7F", b"ctl-\x7f-key"),
        ("NUL", b"ctl-\x00-key"),
        ("a bare CR", b"ctl-\r-key"),
    ];
    for (what, value) in cases {
        assert_refused_by_hyper(&proxy, &booking_with_key(value), 400, what).await;
    }
    assert_eq!(env.mock.stats().total, 0, "nothing was forwarded");
    assert_nothing_claimed(&env, &proxy, "control bytes");
}

/// Forms that look hostile but are keys per SPEC §4.1 — 255 characters (bare or quoted),
/// strings that are not well-formed quoted strings and so are bare keys of visible ASCII
/// (`"abc`, `"a\"`, `"a"b"`), RESP and Redis-cluster syntax (`*3`, `$-1`, `{tag}`, `{}`), a
/// comma, literal `\r\n` text, a quoted key with a space, a key padded with TABs (the HTTP layer
/// trims them) — each runs once, forwarded with the value as received, and its repeat is a
/// replay. In every store that can be looked into, each is one store key made of the route's
/// prefix and a hash: no byte of any key reaches the store.
async fn odd_but_valid_keys_run_once_and_replay(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&small_body_config(&env)).await;
    let long_bare = "b".repeat(255);
    let long_quoted = format!("\"{}\"", "q".repeat(255));
    // (as sent, as the upstream receives it)
    let cases: [(&str, &str); 14] = [
        (&long_bare, &long_bare),
        (&long_quoted, &long_quoted),
        ("\"abc", "\"abc"),
        ("\"a\\\"", "\"a\\\""),
        ("\"a\"b\"", "\"a\"b\""),
        ("\"a b\"", "\"a b\""),
        ("*3", "*3"),
        ("$-1", "$-1"),
        ("{tag}", "{tag}"),
        ("{}", "{}"),
        ("a,b", "a,b"),
        ("a\\r\\nb", "a\\r\\nb"),
        ("idemproxy:create-booking:*", "idemproxy:create-booking:*"),
        ("\tpadded\t", "padded"),
    ];
    for (sent, received) in cases {
        let request = booking_with_key(sent.as_bytes());
        let (first, _) = exchange(&proxy, &request).await;
        assert_eq!(first.status, 201, "key {sent:?} is accepted: {first}");
        assert_eq!(
            env.mock.calls(received),
            1,
            "key {sent:?} went upstream once"
        );
        let (again, _) = exchange(&proxy, &request).await;
        assert_eq!(again.status, 201, "key {sent:?} repeated: {again}");
        assert_eq!(
            again.header("idempotent-replayed").as_deref(),
            Some("true"),
            "key {sent:?}: the repeat is a replay"
        );
        assert_eq!(again.body, first.body, "key {sent:?}: the same booking");
        assert_eq!(
            env.mock.calls(received),
            1,
            "key {sent:?}: not forwarded again"
        );
    }
    assert_eq!(env.mock.stats().total, cases.len() as u64);
    assert_store_keys_hashed(&env, cases.len());
    // A quoted key and the same key bare are one key: the bare one is a replay.
    let (quoted, _) = exchange(&proxy, &booking_with_key(b"\"same-key\"")).await;
    assert_eq!(quoted.status, 201);
    let (bare, _) = exchange(&proxy, &booking_with_key(b"same-key")).await;
    assert_eq!(bare.header("idempotent-replayed").as_deref(), Some("true"));
    assert_eq!(bare.body, quoted.body);
    assert_eq!(env.mock.stats().total, cases.len() as u64 + 1);
}

/// The key header twice — the same value, different values, names differing in case, one of
/// them empty — is a 400 `invalid-idempotency-key`; nothing is claimed or forwarded, and the
/// key sent alone afterwards runs.
async fn key_header_sent_twice_is_refused(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&small_body_config(&env)).await;
    let cases: [(&str, &[&[u8]]); 4] = [
        (
            "twice-same",
            &[
                b"Idempotency-Key: twice-same",
                b"Idempotency-Key: twice-same",
            ],
        ),
        (
            "twice-diff",
            &[b"Idempotency-Key: twice-diff", b"Idempotency-Key: other"],
        ),
        (
            "twice-case",
            &[
                b"idempotency-key: twice-case",
                b"IDEMPOTENCY-KEY: twice-case",
            ],
        ),
        (
            "twice-empty",
            &[b"Idempotency-Key: twice-empty", b"Idempotency-Key:"],
        ),
    ];
    for (_, lines) in cases {
        assert_refused_by_proxy(&proxy, &booking(lines), 400, "invalid-idempotency-key").await;
    }
    assert_eq!(env.mock.stats().total, 0, "nothing was forwarded");
    assert_nothing_claimed(&env, &proxy, "the header twice");
    for (key, _) in cases {
        assert_key_is_free(&env, &proxy, key).await;
    }
}

/// CR LF cannot be inside a header value: it ends the header line. So a quoted key with
/// `\r\n` inside is cut there — `"crlf` (a valid bare key) plus a header of its own — and
/// runs under that key; the hashed store key makes the CR LF harmless anyway. A CR LF followed
/// by a line without a colon, an obs-fold continuation line, a bare LF followed by such a line,
/// a bare CR, a NUL and a space before the colon are refused by hyper (400, connection closed),
/// nothing forwarded. A bare LF is a line terminator to hyper (RFC 9112 §2.2 allows it): a
/// header after one is a header, and a request with LF line endings throughout is served.
async fn line_breaks_in_header_values(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&small_body_config(&env)).await;

    let refused: [(&str, Vec<u8>); 7] = [
        ("CR LF then no colon", booking_with_key(b"\"crlf\r\nnext\"")),
        ("obs-fold", booking_with_key(b"folded\r\n continued-key")),
        ("bare LF then no colon", booking_with_key(b"lf\nnext")),
        ("bare CR", booking_with_key(b"cr\rnext")),
        (
            "NUL in another header",
            booking(&[&key_line(b"nul-key"), b"X-Note: a\x00b"]),
        ),
        (
            "space before the colon",
            booking(&[b"Idempotency-Key : spaced-key"]),
        ),
        (
            "LF then obs-fold",
            booking(&[&key_line(b"lf-fold"), b"X-Note: a\n b"]),
        ),
    ];
    for (what, request) in &refused {
        assert_refused_by_hyper(&proxy, request, 400, what).await;
    }
    assert_eq!(env.mock.stats().total, 0, "nothing refused was forwarded");
    assert_nothing_claimed(&env, &proxy, "line breaks");
    for key in ["folded", "nul-key", "spaced-key", "lf-fold"] {
        assert_key_is_free(&env, &proxy, key).await;
    }
    let base = env.mock.stats().total;

    // CR LF "inside" a quoted key ends the header: the key is `"crlf`.
    let (reply, _) = exchange(&proxy, &booking_with_key(b"\"crlf\r\nX-Injected: 1\"")).await;
    assert_eq!(reply.status, 201, "{reply}");
    assert_eq!(env.mock.calls("\"crlf"), 1, "run under the bare key \"crlf");
    let seen = env.mock.last_request().expect("a request upstream");
    assert_eq!(
        seen.headers["x-injected"], "1\"",
        "the rest is a header of its own"
    );

    // A bare LF ends a header line too.
    let (reply, _) = exchange(
        &proxy,
        &booking(&[b"X-Note: a\nIdempotency-Key: after-bare-lf"]),
    )
    .await;
    assert_eq!(reply.status, 201, "{reply}");
    assert_eq!(env.mock.calls("after-bare-lf"), 1);
    let seen = env.mock.last_request().expect("a request upstream");
    assert_eq!(seen.headers["x-note"], "a");

    // LF line endings throughout: served, re-framed by the proxy for the upstream.
    let lf_only = format!(
        "POST /bookings HTTP/1.1\nHost: proxy.test\nIdempotency-Key: lf-only\nContent-Length: {}\n\n{BODY}",
        BODY.len()
    );
    let (reply, _) = exchange(&proxy, lf_only.as_bytes()).await;
    assert_eq!(reply.status, 201, "{reply}");
    assert_eq!(env.mock.calls("lf-only"), 1);
    assert_eq!(env.mock.last_request().expect("a request").body, BODY);

    assert_eq!(env.mock.stats().total, base + 3);
    assert_store_keys_hashed(&env, 4 + 3);
}

// ---------------------------------------------------------------------------------------------
// Heads too large
// ---------------------------------------------------------------------------------------------

/// The proxy allows 97 request headers (100 less the three `X-Forwarded-*` it adds): 101 or
/// 200 are refused by the proxy with a `431 headers-too-large` problem (as on HTTP/2), nothing
/// claimed or forwarded, and the key runs afterwards. Beyond hyper's own bound (four times the
/// proxy's: 388), hyper refuses the head itself: a bare 431, the connection closed. A request
/// with 97 headers reaches the upstream with the proxy's three `X-Forwarded-*` added (100).
async fn more_than_97_headers_get_a_431_problem(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&small_body_config(&env)).await;
    for total in [98, 101, 200, 388] {
        let (reply, _) = exchange(&proxy, &booking_with_headers("many", total)).await;
        let doc = reply.assert_problem(431, "headers-too-large");
        let detail = doc["detail"].as_str().unwrap_or_default();
        assert!(
            detail.contains("more than 97 header fields"),
            "{total} headers: {detail}"
        );
    }
    assert_refused_by_hyper(
        &proxy,
        &booking_with_headers("h400", 400),
        431,
        "400 headers, beyond hyper's bound",
    )
    .await;
    assert_eq!(env.mock.stats().total, 0, "nothing was forwarded");
    assert_nothing_claimed(&env, &proxy, "too many headers");
    assert_key_is_free(&env, &proxy, "many").await;

    let (reply, _) = exchange(&proxy, &booking_with_headers("h97", 97)).await;
    assert_eq!(reply.status, 201, "{reply}");
    assert_eq!(env.mock.calls("h97"), 1);
    let seen = env.mock.last_request().expect("a request upstream");
    assert!(
        seen.headers.len() >= 100,
        "97 and the X-Forwarded-* headers"
    );
}

/// A head over 64 KiB — one 70 KiB header, or a 60 KiB request target with 8 KiB of headers
/// — is refused by the proxy with a `431 headers-too-large` problem (as on HTTP/2); nothing
/// claimed or forwarded. hyper refuses, itself, a head beyond its own bound (256 KiB): a bare
/// 431, the connection closed; and a request target longer than a URI can be (64 KiB less
/// two bytes, the `http` crate's bound): a bare 414. A 48 KiB head is served.
async fn a_head_over_64_kib_gets_a_431_problem(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&small_body_config(&env)).await;
    let big = "v".repeat(70 * 1024);
    let big_header = format!("X-Big: {big}");
    let headers_8k = format!("X-Notes: {}", "v".repeat(8 * 1024));
    let long_target = head(
        &format!("POST /bookings?q={} HTTP/1.1", "v".repeat(60 * 1024)),
        &[
            &key_line(b"big-target"),
            headers_8k.as_bytes(),
            b"Content-Length: 0",
        ],
    );
    for (what, request) in [
        (
            "a 70 KiB header",
            booking(&[&key_line(b"big-header"), big_header.as_bytes()]),
        ),
        ("a 60 KiB request target and 8 KiB of headers", long_target),
    ] {
        let (reply, _) = exchange(&proxy, &request).await;
        let doc = reply.assert_problem(431, "headers-too-large");
        let detail = doc["detail"].as_str().unwrap_or_default();
        assert!(
            detail.contains("larger than 65536 bytes"),
            "{what}: {detail}"
        );
    }
    let huge = format!("X-Huge: {}", "v".repeat(300 * 1024));
    assert_refused_by_hyper(
        &proxy,
        &booking(&[&key_line(b"huge-header"), huge.as_bytes()]),
        431,
        "a 300 KiB header, beyond hyper's bound",
    )
    .await;
    let longest_target = head(
        &format!("POST /bookings?q={big} HTTP/1.1"),
        &[&key_line(b"huge-target"), b"Content-Length: 0"],
    );
    assert_refused_by_hyper(
        &proxy,
        &longest_target,
        414,
        "a 70 KiB request target, longer than a URI can be",
    )
    .await;
    assert_eq!(env.mock.stats().total, 0, "nothing was forwarded");
    assert_nothing_claimed(&env, &proxy, "heads over 64 KiB");
    assert_key_is_free(&env, &proxy, "big-header").await;

    let fillers: Vec<String> = (0..24)
        .map(|i| format!("X-Big-{i}: {}", "v".repeat(2000)))
        .collect();
    let key = key_line(b"big-but-fine");
    let mut lines: Vec<&[u8]> = vec![&key];
    lines.extend(fillers.iter().map(|l| l.as_bytes()));
    let (reply, _) = exchange(&proxy, &booking(&lines)).await;
    assert_eq!(reply.status, 201, "a 48 KiB head is served: {reply}");
    assert_eq!(env.mock.calls("big-but-fine"), 1);
}

/// A request with 98 to 100 headers would reach a hyper upstream (100 headers at most) with
/// more than 100 once the proxy adds its three `X-Forwarded-*`, and the upstream would refuse
/// it with a 431 the proxy saves as the key's result — replayed to every retry although nothing
/// ran. The proxy refuses such a request itself, before any claim: the retry with fewer headers
/// runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_98_to_100_are_refused_before_a_claim_not_saved_as_an_upstream_431() {
    let env = Env::new(Backend::Memory).await;
    let proxy = env.proxy(&small_body_config(&env)).await;
    for total in [98, 99, 100] {
        let key = format!("h{total}");
        let (reply, _) = exchange(&proxy, &booking_with_headers(&key, total)).await;
        assert_eq!(reply.status, 431, "{total} headers: {reply}");
        let (retry, _) = exchange(&proxy, &booking_with_headers(&key, 10)).await;
        assert_eq!(
            retry.status, 201,
            "the retry with fewer headers runs: {retry}"
        );
        assert_eq!(env.mock.calls(&key), 1);
    }
}

// ---------------------------------------------------------------------------------------------
// Bodies over the limit
// ---------------------------------------------------------------------------------------------

/// `max_request_body: 1KiB`: a body over it is a 413 `request-too-large` whether declared by
/// `Content-Length` (sent, or not sent at all — refused from the head, also under
/// `Expect: 100-continue`, without a `100 Continue`) or sent chunked (several chunks, or one
/// chunk declared 1 MiB of which 2 KiB arrive). Nothing is claimed or forwarded, and each key
/// runs afterwards. Exactly 1 KiB, by length or chunked, is served.
async fn bodies_over_max_request_body_are_413_by_length_and_by_chunks(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&small_body_config(&env)).await;
    let x2048 = vec![b'x'; 2048];
    let mut one_big_chunk = b"100000\r\n".to_vec();
    one_big_chunk.extend_from_slice(&x2048);
    let cases: [(&str, Vec<u8>); 5] = [
        (
            "over-by-length",
            booking_framed("over-by-length", &[b"Content-Length: 2048"], &x2048),
        ),
        (
            "declared-only",
            booking_framed("declared-only", &[b"Content-Length: 10000000"], b""),
        ),
        (
            "expect-continue",
            booking_framed(
                "expect-continue",
                &[b"Expect: 100-continue", b"Content-Length: 10000000"],
                b"",
            ),
        ),
        (
            "over-by-chunks",
            booking_framed(
                "over-by-chunks",
                &[b"Transfer-Encoding: chunked"],
                &chunked_body(&[512, 512, 512, 512]),
            ),
        ),
        (
            "one-big-chunk",
            booking_framed(
                "one-big-chunk",
                &[b"Transfer-Encoding: chunked"],
                &one_big_chunk,
            ),
        ),
    ];
    for (key, request) in &cases {
        let (reply, _) = exchange(&proxy, request).await;
        let doc = reply.assert_problem(413, "request-too-large");
        assert!(
            doc["detail"].as_str().is_some_and(|d| d.contains("1024")),
            "{key}: {doc}"
        );
    }
    assert_eq!(env.mock.stats().total, 0, "nothing was forwarded");
    assert_nothing_claimed(&env, &proxy, "bodies over the limit");
    assert_eq!(
        proxy.requests("create-booking", Outcome::TooLarge),
        cases.len() as u64
    );
    for (key, _) in &cases {
        assert_key_is_free(&env, &proxy, key).await;
    }

    let x1024 = vec![b'x'; 1024];
    let exact: [(&str, Vec<u8>); 2] = [
        (
            "exact-by-length",
            booking_framed("exact-by-length", &[b"Content-Length: 1024"], &x1024),
        ),
        (
            "exact-by-chunks",
            booking_framed(
                "exact-by-chunks",
                &[b"Transfer-Encoding: chunked"],
                &chunked_body(&[512, 512]),
            ),
        ),
    ];
    for (key, request) in &exact {
        let (reply, _) = exchange(&proxy, request).await;
        assert_eq!(reply.status, 201, "{key}: {reply}");
        assert_eq!(env.mock.calls(key), 1);
        assert_eq!(env.mock.last_request().expect("a request").body, x1024);
    }
    assert_store_keys_hashed(&env, cases.len() + exact.len());
}

// ---------------------------------------------------------------------------------------------
// Framing: smuggling shapes
// ---------------------------------------------------------------------------------------------

/// Framing headers that are malformed or contradict each other — `Transfer-Encoding` whose
/// last coding is not `chunked` (`chunked, identity`; `identity`; `chunked` then `identity` on
/// two lines), two different `Content-Length`s, a `Content-Length` of `+5`, `-1`, `0x10` or
/// `5, 5`, and `Transfer-Encoding` in HTTP/1.0 — are refused by hyper with a bare 400 and the
/// connection closed. Nothing is claimed or forwarded; each key runs afterwards.
async fn conflicting_or_malformed_framing_headers_get_400_from_hyper(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&small_body_config(&env)).await;
    let chunked = [chunk(BODY.as_bytes()), LAST_CHUNK.to_vec()].concat();
    let cases: [(&str, Vec<u8>); 9] = [
        (
            "te-chunked-identity",
            booking_framed(
                "te-chunked-identity",
                &[b"Transfer-Encoding: chunked, identity"],
                &chunked,
            ),
        ),
        (
            "te-identity",
            booking_framed(
                "te-identity",
                &[b"Transfer-Encoding: identity", b"Content-Length: 14"],
                BODY.as_bytes(),
            ),
        ),
        (
            "te-two-lines",
            booking_framed(
                "te-two-lines",
                &[
                    b"Transfer-Encoding: chunked",
                    b"Transfer-Encoding: identity",
                ],
                &chunked,
            ),
        ),
        (
            "cl-differ",
            booking_framed(
                "cl-differ",
                &[b"Content-Length: 14", b"Content-Length: 5"],
                BODY.as_bytes(),
            ),
        ),
        (
            "cl-plus",
            booking_framed("cl-plus", &[b"Content-Length: +14"], BODY.as_bytes()),
        ),
        (
            "cl-minus",
            booking_framed("cl-minus", &[b"Content-Length: -1"], BODY.as_bytes()),
        ),
        (
            "cl-hex",
            booking_framed("cl-hex", &[b"Content-Length: 0x0e"], BODY.as_bytes()),
        ),
        (
            "cl-list",
            booking_framed("cl-list", &[b"Content-Length: 14, 14"], BODY.as_bytes()),
        ),
        ("http10-te", {
            let mut r = head(
                "POST /bookings HTTP/1.0",
                &[&key_line(b"http10-te"), b"Transfer-Encoding: chunked"],
            );
            r.extend_from_slice(&chunked);
            r
        }),
    ];
    for (key, request) in &cases {
        assert_refused_by_hyper(&proxy, request, 400, key).await;
    }
    assert_eq!(env.mock.stats().total, 0, "nothing was forwarded");
    assert_nothing_claimed(&env, &proxy, "framing headers");
    for (key, _) in &cases {
        assert_key_is_free(&env, &proxy, key).await;
    }
}

/// `Content-Length` together with `Transfer-Encoding: chunked`, in either order, with a second
/// request pipelined after the chunked body (where a front end reading by length would have put
/// it inside the body): the body is read as chunked, the upstream sees one well-framed request
/// (its own `Content-Length`, no `Transfer-Encoding`), and the proxy answers with
/// `connection: close` and closes (RFC 9112 §6.1), so the pipelined request is never read and
/// never reaches the upstream.
async fn content_length_with_chunked_is_read_as_chunked_and_the_connection_closes(
    backend: Backend,
) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&small_body_config(&env)).await;
    let smuggled = booking_with_key(b"smuggled");
    let mut body = [chunk(BODY.as_bytes()), LAST_CHUNK.to_vec()].concat();
    body.extend_from_slice(&smuggled);
    let declared = format!("Content-Length: {}", body.len());
    let orders: [(&str, [&[u8]; 2]); 2] = [
        (
            "cl-then-te",
            [declared.as_bytes(), b"Transfer-Encoding: chunked"],
        ),
        (
            "te-then-cl",
            [b"Transfer-Encoding: chunked", b"Content-Length: 3"],
        ),
    ];
    for (n, (key, lines)) in orders.iter().enumerate() {
        let (reply, mut conn) = exchange(&proxy, &booking_framed(key, lines, &body)).await;
        assert_eq!(reply.status, 201, "{key}: {reply}");
        assert_eq!(
            reply.header("connection").as_deref(),
            Some("close"),
            "{key}"
        );
        assert!(
            conn.closes().await,
            "{key}: closed, the pipelined request unread"
        );
        assert_eq!(env.mock.calls(key), 1, "{key}");
        assert_eq!(
            env.mock.stats().total,
            n as u64 + 1,
            "{key}: one request upstream"
        );
        let seen = env.mock.last_request().expect("a request upstream");
        assert_eq!(seen.body, BODY, "{key}: the chunked body, decoded");
        assert_eq!(seen.headers["content-length"], "14", "{key}");
        assert!(!seen.headers.contains_key("transfer-encoding"), "{key}");
    }
    assert_eq!(
        env.mock.calls("smuggled"),
        0,
        "the pipelined request never ran"
    );
    assert_store_keys_hashed(&env, 2);
}

/// A chunked body whose data is the text of another request, then a pipelined second request:
/// the first request's body is that text (the upstream gets it as a body, framed by its length),
/// the second is served on the same connection, in order, and the request inside the body never
/// runs: two requests upstream, each with its own key.
async fn a_request_inside_a_chunked_body_stays_body(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&small_body_config(&env)).await;
    let inner = booking_with_key(b"smuggled");
    let mut request = booking_framed(
        "carrier",
        &[b"Transfer-Encoding: chunked"],
        &[chunk(&inner), LAST_CHUNK.to_vec()].concat(),
    );
    request.extend_from_slice(&booking_with_key(b"pipelined"));
    let mut conn = RawConn::open(&proxy).await;
    conn.send(&request).await;
    let first = conn.response().await.expect("the first response");
    let second = conn.response().await.expect("the pipelined response");
    assert_eq!(first.status, 201, "{first}");
    assert_eq!(second.status, 201, "{second}");
    let doc: serde_json::Value = serde_json::from_slice(&first.body).expect("a booking");
    assert_eq!(
        doc["request"].as_str().map(str::as_bytes),
        Some(inner.as_slice()),
        "the upstream got the inner request as the first one's body"
    );
    assert_eq!(env.mock.calls("carrier"), 1);
    assert_eq!(env.mock.calls("pipelined"), 1);
    assert_eq!(
        env.mock.calls("smuggled"),
        0,
        "the request inside a body never ran"
    );
    assert_eq!(env.mock.stats().total, 2);
    assert_eq!(env.mock.last_request().expect("a request").body, BODY);
    assert_store_keys_hashed(&env, 2);
}

/// Chunked framing that breaks inside the body — a size that is not hex, a size that
/// overflows, chunk lines ended by a bare LF, chunk data longer than its size — and a body cut
/// short (the client half-closes before the declared length or the last chunk) reach the
/// proxy's service as a body error: a 400 `bad-request-body` problem. Nothing is claimed or
/// forwarded; each key runs afterwards.
async fn broken_or_cut_short_bodies_are_400_bad_request_body(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&small_body_config(&env)).await;
    let te: &[&[u8]] = &[b"Transfer-Encoding: chunked"];
    let broken: [(&str, &[u8]); 4] = [
        ("chunk-not-hex", b"zz\r\nhello\r\n0\r\n\r\n"),
        (
            "chunk-overflow",
            b"fffffffffffffffff1\r\nhello\r\n0\r\n\r\n",
        ),
        ("chunk-bare-lf", b"5\nhello\n0\n\n"),
        ("chunk-too-long", b"5\r\nhello-and-more\r\n0\r\n\r\n"),
    ];
    for (key, body) in broken {
        let (reply, mut conn) = exchange(&proxy, &booking_framed(key, te, body)).await;
        reply.assert_problem(400, "bad-request-body");
        assert!(
            conn.closes().await,
            "{key}: the connection is closed after it"
        );
    }
    let cut_short: [(&str, Vec<u8>); 2] = [
        (
            "cut-by-length",
            booking_framed("cut-by-length", &[b"Content-Length: 100"], b"{\"seat\""),
        ),
        (
            "cut-by-chunks",
            booking_framed("cut-by-chunks", te, b"5\r\nhello\r\n"),
        ),
    ];
    for (key, request) in &cut_short {
        let mut conn = RawConn::open(&proxy).await;
        conn.send(request).await;
        conn.finish_sending().await;
        let reply = conn
            .response()
            .await
            .unwrap_or_else(|| panic!("{key}: an answer after the half-close"));
        reply.assert_problem(400, "bad-request-body");
    }
    assert_eq!(env.mock.stats().total, 0, "nothing was forwarded");
    assert_nothing_claimed(&env, &proxy, "broken bodies");
    let keys = broken
        .iter()
        .map(|c| c.0)
        .chain(cut_short.iter().map(|c| c.0));
    for key in keys {
        assert_key_is_free(&env, &proxy, key).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Framing on a pass-through route
// ---------------------------------------------------------------------------------------------

/// On a pass-through route (`rest`, streamed): `Content-Length` with `Transfer-Encoding:
/// chunked` is read as chunked, the upstream sees one request with the decoded body, and the
/// connection closes before the pipelined request. A chunk that breaks mid-body never counts
/// as a request upstream, and the client gets a 400 `bad-request-body`: its own fault, not an
/// upstream that "may have performed the operation".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passthrough_route_reads_chunked_over_content_length_and_forwards_no_broken_body() {
    let env = Env::new(Backend::Memory).await;
    let proxy = env.proxy(&small_body_config(&env)).await;
    let mut body = [chunk(BODY.as_bytes()), LAST_CHUNK.to_vec()].concat();
    body.extend_from_slice(&head("GET /smuggled HTTP/1.1", &[]));
    let mut request = head(
        "POST /echo HTTP/1.1",
        &[b"Content-Length: 50", b"Transfer-Encoding: chunked"],
    );
    request.extend_from_slice(&body);
    let (reply, mut conn) = exchange(&proxy, &request).await;
    assert_eq!(reply.status, 200, "{reply}");
    assert!(conn.closes().await, "closed, the pipelined request unread");
    assert_eq!(env.mock.stats().total, 1, "one request upstream");
    let seen = env.mock.last_request().expect("a request upstream");
    assert_eq!(seen.uri.path(), "/echo");
    assert_eq!(seen.body, BODY);
    assert!(
        !seen.headers.contains_key("content-length"),
        "no stale length"
    );

    let mut broken = head("POST /echo HTTP/1.1", &[b"Transfer-Encoding: chunked"]);
    broken.extend_from_slice(b"5\r\nhello\r\nzz\r\n");
    let (reply, mut conn) = exchange(&proxy, &broken).await;
    assert!(reply.is_problem(), "a problem: {reply}");
    let doc: serde_json::Value = serde_json::from_slice(&reply.body).expect("a problem");
    assert_eq!(reply.status, 400, "{reply}");
    assert_eq!(
        doc["type"], "urn:idemproxy:problem:bad-request-body",
        "{reply}"
    );
    assert!(conn.closes().await, "the connection is closed after it");
    assert_eq!(
        env.mock.stats().total,
        1,
        "the broken body never counted upstream"
    );
}

// ---------------------------------------------------------------------------------------------
// Bodies, routes and headers through a client library
// ---------------------------------------------------------------------------------------------

/// A request with a chunked body (no Content-Length), sent with hyper's client since the
/// available reqwest has no streaming bodies.
async fn send_chunked(url: &str, key: &str, chunks: &[&'static [u8]]) -> Reply {
    use http_body_util::{BodyExt, StreamBody};
    use hyper::body::Frame;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    let frames: Vec<Result<Frame<Bytes>, std::convert::Infallible>> = chunks
        .iter()
        .map(|c| Ok(Frame::data(Bytes::from_static(c))))
        .collect();
    let body = StreamBody::new(futures_util::stream::iter(frames));
    let client = Client::builder(TokioExecutor::new()).build_http();
    let req = http::Request::post(url)
        .header("idempotency-key", key)
        .body(body)
        .expect("request");
    let resp = client.request(req).await.expect("chunked request failed");
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.expect("read body").to_bytes();
    Reply {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body,
    }
}

fn response_complete(out: &[u8]) -> bool {
    let text = String::from_utf8_lossy(out);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return false;
    };
    head.lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .and_then(|v| v.trim().parse::<usize>().ok())
        })
        .is_some_and(|n| body.len() >= n)
}

// ---------------------------------------------------------------------------------------------
// A broken client body on a pass-through route is the client's fault
// ---------------------------------------------------------------------------------------------

/// Writes `parts` to the proxy, `pause` apart, and reads one response (or until the
/// connection closes): its status, and its head and body as text, a blank line between.
async fn raw_exchange(proxy: &TestProxy, parts: &[&[u8]], pause: Duration) -> (u16, String) {
    let mut stream = TcpStream::connect(proxy.addr).await.expect("connect");
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            tokio::time::sleep(pause).await;
        }
        stream.write_all(part).await.expect("write");
    }
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let read = tokio::time::timeout(Duration::from_secs(10), async {
        while !response_complete(&out) {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    let text = String::from_utf8_lossy(&out).into_owned();
    assert!(read.is_ok(), "an answer within 10s; got {text:?}");
    let status = text
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("a status line: {text:?}"));
    (status, text.replacen("\r\n\r\n", "\n\n", 1))
}

fn problem_type(answer: &str) -> serde_json::Value {
    let (head, body) = answer.split_once("\n\n").expect("head and body");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/problem+json"),
        "a problem document: {answer}"
    );
    let doc: serde_json::Value =
        serde_json::from_str(body).unwrap_or_else(|e| panic!("JSON ({e}): {answer}"));
    doc["type"].clone()
}

async fn body_over_max_request_body_is_413_and_claims_nothing(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("max_request_body: 16")).await;
    let big = "x".repeat(17);
    let reply = book(&proxy, "big", &big).await;
    reply.assert_problem(413, "request-too-large");
    assert_eq!(env.mock.total(), 0, "nothing forwarded");
    assert_nothing_stored(&env, "a body over the bound");

    // The same key with a body that fits (exactly the limit) is a first request.
    let small = "y".repeat(16);
    let first = book(&proxy, "big", &small).await;
    assert_fresh(&first, 201);
    assert_eq!(env.mock.calls("big"), 1);
    let last = env.mock.last_request().expect("a request");
    assert_eq!(&last.body[..], small.as_bytes());
    let again = book(&proxy, "big", &small).await;
    assert_replay_of(&first, &again);
    assert_eq!(env.mock.calls("big"), 1);
}

async fn chunked_body_over_max_request_body_is_413(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("max_request_body: 16")).await;
    let url = proxy.url("/bookings");
    let reply = send_chunked(&url, "chunked", &[b"0123456", b"789abcd", b"efghijk"]).await;
    reply.assert_problem(413, "request-too-large");
    assert_eq!(env.mock.total(), 0, "nothing forwarded");
    assert_nothing_stored(&env, "a body over the bound");

    // A chunked body within the limit, same key: a first request, forwarded whole.
    let first = send_chunked(&url, "chunked", &[b"01234567", b"89abcdef"]).await;
    assert_fresh(&first, 201);
    let last = env.mock.last_request().expect("a request");
    assert_eq!(&last.body[..], b"0123456789abcdef");
    let again = send_chunked(&url, "chunked", &[b"0123", b"456789abcdef"]).await;
    assert_replay_of(&first, &again);
    assert_eq!(env.mock.calls("chunked"), 1);
}

async fn no_route_is_404(backend: Backend) {
    let env = Env::new(backend).await;
    let yaml = format!(
        "listen: 127.0.0.1:0\n{store}upstreams:\n  booking:\n    url: {up}\nroutes:\n  - name: create-booking\n    methods: [POST]\n    path: /bookings\n    upstream: booking\n    idempotency:\n      required: true\n",
        store = env.store_yaml(""),
        up = env.mock.url(),
    );
    let proxy = env.proxy(&yaml).await;
    send(client().get(proxy.url("/other")))
        .await
        .assert_problem(404, "no-route");
    send(
        client()
            .get(proxy.url("/bookings"))
            .header("Idempotency-Key", "k"),
    )
    .await
    .assert_problem(404, "no-route");
    send(
        client()
            .post(proxy.url("/bookings/1"))
            .header("Idempotency-Key", "k"),
    )
    .await
    .assert_problem(404, "no-route");
    assert_eq!(env.mock.total(), 0);
    assert_fresh(&book(&proxy, "k", SEAT).await, 201);
}

/// A `Connection` header that names the key header, a scope header or a fingerprinted header
/// would strip it before the upstream although the key, its namespace or the fingerprint were
/// read from it. The proxy refuses it with a 400 of its own type; nothing is claimed.
async fn connection_naming_the_key_scope_or_fingerprint_header_is_refused(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env
        .proxy(&env.config("fingerprint: [method, path, body, \"header:X-Tenant\"]"))
        .await;
    for (n, named) in ["Idempotency-Key", "authorization", "x-tenant, keep-alive"]
        .iter()
        .enumerate()
    {
        let key = format!("conn-{n}");
        let r = post_booking(
            &proxy,
            &key,
            &[
                ("Connection", named),
                ("Authorization", "Bearer a"),
                ("X-Tenant", "t1"),
            ],
        )
        .await;
        let doc = r.assert_problem(400, "hop-by-hop-conflict");
        assert!(
            doc["detail"]
                .as_str()
                .unwrap_or("")
                .contains(&named.split(',').next().unwrap_or("").to_ascii_lowercase()),
            "the detail names the header: {doc}"
        );
        assert_eq!(env.mock.calls(&key), 0, "nothing forwarded");
        if let Some(keys) = env.stored_key_names() {
            assert_eq!(keys.len(), n, "the refusal claimed nothing: {keys:?}");
        }
        // Nothing was claimed: the same key without the Connection header runs.
        let ok = post_booking(
            &proxy,
            &key,
            &[("Authorization", "Bearer a"), ("X-Tenant", "t1")],
        )
        .await;
        assert_eq!(ok.status, 201, "{:?}", ok.body);
        assert_eq!(env.mock.calls(&key), 1);
    }
    // A Connection header naming anything else is fine (and stripped as usual).
    let r = post_booking(&proxy, "conn-other", &[("Connection", "x-other")]).await;
    assert_eq!(r.status, 201);
    // Counted as observe mode counts them (`would="invalid_key"`), not as a bad body.
    assert_eq!(proxy.requests("create-booking", Outcome::InvalidKey), 3);
    assert_eq!(proxy.requests("create-booking", Outcome::BadRequest), 0);
}

/// A chunked POST whose second chunk size is not hex, on a pass-through route: the client's
/// fault, a `400 bad-request-body` (before the fix it was a `502 upstream-failed`, blaming an
/// upstream that did nothing wrong).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_chunked_body_on_a_pass_through_route_is_a_400() {
    let env = Env::new(Backend::Memory).await;
    let proxy = env.proxy(&env.config("")).await;
    let (status, answer) = raw_exchange(
        &proxy,
        &[
            b"POST /echo/broken HTTP/1.1\r\nHost: shop.example\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
            b"zz\r\nworld\r\n0\r\n\r\n",
        ],
        Duration::from_millis(200),
    )
    .await;
    assert_eq!(status, 400, "{answer}");
    assert_eq!(
        problem_type(&answer),
        "urn:idemproxy:problem:bad-request-body",
        "{answer}"
    );
}

/// A chunked POST that stops sending its body on a pass-through route: the client's fault too,
/// a `408 request-body-timeout` at `limits.body_read_timeout` (before the fix, a `502`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_chunked_body_on_a_pass_through_route_is_a_408() {
    let env = Env::new(Backend::Memory).await;
    let yaml = env.config("").replace(
        "shutdown_timeout: 10s\n",
        "shutdown_timeout: 10s\nlimits:\n  body_read_timeout: 1s\n",
    );
    let proxy = env.proxy(&yaml).await;
    let (status, answer) = raw_exchange(
        &proxy,
        &[b"POST /echo/stalled HTTP/1.1\r\nHost: shop.example\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"],
        Duration::ZERO,
    )
    .await;
    assert_eq!(status, 408, "{answer}");
    assert_eq!(
        problem_type(&answer),
        "urn:idemproxy:problem:request-body-timeout",
        "{answer}"
    );
}

#[tokio::test]
async fn too_many_or_too_large_request_headers_are_refused_before_anything_runs() {
    let env = Env::new(Backend::Memory).await;
    let proxy = env.proxy(&env.config("")).await;

    let mut many = client()
        .post(proxy.url("/bookings"))
        .header("Idempotency-Key", "many-headers");
    for i in 0..150 {
        many = many.header(format!("x-filler-{i}"), "1");
    }
    let refused = many.send().await.expect("an answer");
    assert_eq!(refused.status().as_u16(), 431, "too many headers");

    let huge = "v".repeat(100 * 1024);
    let refused = client()
        .post(proxy.url("/bookings"))
        .header("Idempotency-Key", "huge-header")
        .header("x-huge", huge)
        .send()
        .await
        .expect("an answer");
    assert_eq!(refused.status().as_u16(), 431, "a 100 KiB header");
    assert_eq!(env.mock.total(), 0, "nothing reached the upstream");

    // The proxy still serves normal requests afterwards.
    let ok = book(&proxy, "after-limits", "{}").await;
    assert_eq!(ok.status, 201);
}
