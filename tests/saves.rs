//! Saves the proxy cannot keep, claims answered too late, upstream refusals of a request head
//! and broken client bodies (SPEC §4.3, §4.5): each test shows a way the operation could run
//! twice, or a client's fault blamed on the upstream.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use common::{Backend, Env, Reply, TestProxy, book_with, eventually};
use idemproxy::config::Config;
use idemproxy::metrics::Metrics;
use idemproxy::proxy::Proxy;
use idemproxy::store::memory::MemoryStore;
use idemproxy::store::{Forgotten, Held, Store, StoreError, StoreHandle, StoreKey};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The request body every booking here sends.
const BODY: &str = r#"{"seat":"12A"}"#;

fn redis_config(conn: &mut ::redis::Connection, name: &str, value: &str) {
    let _: () = ::redis::cmd("CONFIG")
        .arg("SET")
        .arg(name)
        .arg(value)
        .query(conn)
        .unwrap_or_else(|e| panic!("CONFIG SET {name} {value}: {e}"));
}

// ---------------------------------------------------------------------------------------------
// §4.5 A save that can't be kept pending is downgraded, never given up while its lease is valid
// ---------------------------------------------------------------------------------------------

/// Two 4000-byte results are refused by a Redis out of memory (`noeviction` refuses the save's
/// `SET` and still takes `PEXPIRE`), and together they are over `max_pending_save_bytes`. The
/// older one can't be kept: it must keep its lease and save a `502 result-not-kept` in place of
/// its response once Redis has room, so its retry is a replay of that problem and the upstream
/// ran once (before the fix it was dropped, its lease expired, and its retry ran it again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_save_past_the_pending_bytes_bound_keeps_its_lease_and_saves_result_not_kept() {
    let env = Env::new(Backend::Redis).await;
    let yaml = env
        .config("lock_ttl: 1s\nmax_response_body: 4KiB")
        .replace(
            "shutdown_timeout: 10s\n",
            "shutdown_timeout: 10s\nlimits:\n  max_pending_save_bytes: 6KiB\n",
        )
        // The harness's other idempotent route must fit the bound too (refused at load otherwise).
        .replace(
            "      lock_ttl: 2s\n",
            "      lock_ttl: 2s\n      max_response_body: 4KiB\n",
        );
    let proxy = env.proxy(&yaml).await;
    let mut conn = env.redis().conn();
    redis_config(&mut conn, "maxmemory-policy", "noeviction");

    // Staggered, so that "kept-0" is the older pending save.
    let mut firsts = Vec::new();
    for (key, delay) in [("kept-0", "1s"), ("kept-1", "1200ms")] {
        let base = proxy.url("");
        firsts.push(tokio::spawn(async move {
            book_with(
                &base,
                key,
                BODY,
                &[("X-Mock-Delay", delay), ("X-Mock-Body-Size", "4000")],
            )
            .await
        }));
    }
    assert!(
        eventually(Duration::from_secs(3), || env.mock.calls("kept-0") == 1
            && env.mock.calls("kept-1") == 1)
        .await,
        "both claimed and forwarded"
    );
    redis_config(&mut conn, "maxmemory", "1");
    for first in firsts {
        let r = first.await.expect("first request");
        assert_eq!(r.status, 201, "the client still gets its answer");
        assert_eq!(r.body.len(), 4000);
    }
    let metrics = || proxy.metrics().encode();
    // Longer than lock_ttl: only renewals keep both claims alive.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    redis_config(&mut conn, "maxmemory", "0");
    assert!(
        eventually(Duration::from_secs(5), || metrics()
            .contains("idemproxy_pending_saves 0"))
        .await,
        "both saves landed:\n{}",
        metrics()
    );

    let r = book_with(
        &proxy.url(""),
        "kept-0",
        BODY,
        &[("X-Mock-Delay", "1s"), ("X-Mock-Body-Size", "4000")],
    )
    .await;
    assert_eq!(
        env.mock.calls("kept-0"),
        1,
        "kept-0 ran once; its retry got {} (replayed: {:?})",
        r.status,
        r.header("idempotent-replayed")
    );
    let doc = r.assert_problem(502, "result-not-kept");
    assert_eq!(r.header("idempotent-replayed"), "true", "a replay: {doc}");
    let r = book_with(
        &proxy.url(""),
        "kept-1",
        BODY,
        &[("X-Mock-Delay", "1200ms"), ("X-Mock-Body-Size", "4000")],
    )
    .await;
    assert_eq!(r.status, 201);
    assert_eq!(r.header("idempotent-replayed"), "true");
    assert_eq!(&r.body[..], &idemproxy_mock::body_pattern(4000)[..]);
    assert_eq!(env.mock.calls("kept-1"), 1, "kept-1 ran once");
    assert_eq!(proxy.lost_leases(), 0, "no lease was lost");
    assert!(
        metrics().contains(r#"idemproxy_results_not_kept_total{route="create-booking"} 1"#),
        "the older save was downgraded, and counted:\n{}",
        metrics()
    );
    assert!(
        metrics().contains(r#"idemproxy_saves_abandoned_total{route="create-booking"} 0"#),
        "nothing was abandoned:\n{}",
        metrics()
    );
}

// ---------------------------------------------------------------------------------------------
// §4.5 A claim answered after its lease could have expired forwards nothing
// ---------------------------------------------------------------------------------------------

/// The memory store, whose claims are answered `delay` after they were made while the delay
/// is set: the claim is taken at once, the answer comes late (a stalled scheduler, a slow
/// network on the way back).
struct LateClaims {
    inner: MemoryStore,
    delay_ms: AtomicU32,
}

#[async_trait]
impl Store for LateClaims {
    async fn claim(
        &self,
        key: &StoreKey,
        held: &Held,
        lease: Duration,
    ) -> Result<Option<Bytes>, StoreError> {
        let found = self.inner.claim(key, held, lease).await;
        let delay = self.delay_ms.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(u64::from(delay))).await;
        found
    }
    async fn renew(
        &self,
        key: &StoreKey,
        held: &Held,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.inner.renew(key, held, lease).await
    }
    async fn complete(
        &self,
        key: &StoreKey,
        held: &Held,
        done: Bytes,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        self.inner.complete(key, held, done, ttl).await
    }
    async fn release(&self, key: &StoreKey, held: &Held) -> Result<bool, StoreError> {
        self.inner.release(key, held).await
    }
    async fn get(&self, key: &StoreKey) -> Result<Option<Bytes>, StoreError> {
        self.inner.get(key).await
    }
    async fn claim_resolvable(
        &self,
        key: &StoreKey,
        held: &Held,
        times: idemproxy::store::ResolvableTimes,
    ) -> Result<idemproxy::store::ResolvableFound, StoreError> {
        self.inner.claim_resolvable(key, held, times).await
    }
    async fn resolving(
        &self,
        key: &StoreKey,
        held: &Held,
        next_lookup_in: Duration,
        lease: Duration,
    ) -> Result<Option<u64>, StoreError> {
        self.inner.resolving(key, held, next_lookup_in, lease).await
    }
    async fn now(&self, key: &StoreKey) -> Result<u64, StoreError> {
        self.inner.now(key).await
    }
    async fn ping(&self) -> Result<(), StoreError> {
        self.inner.ping().await
    }
    async fn inspect(&self, key: &StoreKey) -> Result<Option<(Bytes, Duration)>, StoreError> {
        self.inner.inspect(key).await
    }
    async fn forget(&self, key: &StoreKey) -> Result<Forgotten, StoreError> {
        self.inner.forget(key).await
    }
}

/// A claim whose answer takes 1.3s under a `lock_ttl` of 1s: its lease may have expired (and
/// another request may hold the key) by the time the proxy learns it won. It must forward
/// nothing, release the claim and answer 503; the retry then runs the operation once (before
/// the fix the late claim was forwarded).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_answered_after_lock_ttl_forwards_nothing_and_is_released() {
    let env = Env::new(Backend::Memory).await;
    let yaml = env.config("lock_ttl: 1s");
    let config = Config::from_yaml(&yaml).expect("config");
    let metrics = Arc::new(Metrics::new());
    let late = Arc::new(LateClaims {
        inner: MemoryStore::new(1000),
        delay_ms: AtomicU32::new(1300),
    });
    // The handle's own deadline is longer than the delay: the late answer is not a timeout.
    let store = StoreHandle::new(late.clone(), Duration::from_secs(5), metrics.clone());
    let proxy = Arc::new(Proxy::new(config, store, metrics.clone()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(idemproxy::server::serve(listener, proxy, async move {
        let _ = stopped.await;
    }));

    let r = book_with(&base, "late-claim", BODY, &[]).await;
    r.assert_problem(503, "store-unavailable");
    assert_eq!(env.mock.calls("late-claim"), 0, "nothing was forwarded");

    late.delay_ms.store(0, Ordering::SeqCst);
    let r = book_with(&base, "late-claim", BODY, &[]).await;
    assert_eq!(r.status, 201, "the key was released: {:?}", r.body);
    assert_eq!(r.header("idempotent-replayed"), "");
    assert_eq!(env.mock.calls("late-claim"), 1, "the retry ran it once");
    assert_eq!(
        common::metric_value(&metrics.encode(), "idemproxy_lost_leases_total", &[]),
        0.0,
        "nothing ran under the late claim: no lease was lost"
    );
    let _ = stop.send(());
    let _ = served.await;
}

// ---------------------------------------------------------------------------------------------
// §4.3 An upstream's refusal of a request head is not the operation's result
// ---------------------------------------------------------------------------------------------

async fn post(proxy: &TestProxy, key: &str, extra: &[(&str, &str)]) -> Reply {
    book_with(&proxy.url(""), key, BODY, extra).await
}

/// `431` and `414` from the upstream refuse the request's head: the operation never ran, so the
/// claim is released and the upstream's answer passed on; the retry runs again (before the fix
/// the refusal was saved and replayed).
async fn upstream_head_refusals_are_passed_on_and_not_saved(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("")).await;
    let refusals: [(&str, &[(&str, &str)]); 3] = [
        ("head-431", &[("X-Mock-Status", "431")]),
        ("head-414", &[("X-Mock-Status", "414")]),
        (
            "head-431-close",
            &[
                ("X-Mock-Status", "431"),
                ("X-Mock-Header", "Connection: close"),
            ],
        ),
    ];
    for (key, extra) in refusals {
        let status: u16 = extra[0].1.parse().expect("status");
        for attempt in 1..=2 {
            let r = post(&proxy, key, extra).await;
            assert_eq!(r.status, status, "{key}: the upstream's answer, passed on");
            assert_eq!(
                r.header("idempotent-replayed"),
                "",
                "{key} attempt {attempt}: never replayed"
            );
            assert_eq!(r.header("connection"), "", "hop-by-hop, not passed on");
            assert_eq!(env.mock.calls(key), attempt, "{key}: each attempt ran");
        }
    }
}

/// An application's `400` (its connection stays open) is the operation's result: saved and
/// replayed.
async fn an_application_400_is_saved_and_replayed(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("")).await;
    let first = post(&proxy, "app-400", &[("X-Mock-Status", "400")]).await;
    assert_eq!(first.status, 400);
    let again = post(&proxy, "app-400", &[("X-Mock-Status", "400")]).await;
    assert_eq!(again.status, 400);
    assert_eq!(again.header("idempotent-replayed"), "true");
    assert_eq!(again.body, first.body);
    assert_eq!(env.mock.calls("app-400"), 1);
}

/// SPEC §4.3: a `400` is the operation's result whatever headers come with it. An upstream that
/// closes every connection (gunicorn's `sync` worker, Apache with `KeepAlive Off`) sends
/// `Connection: close` with its application's "card declined" too: three tries with one key
/// reach it once, and the two repeats replay its `400` and JSON body. (Before, a `400` with
/// `Connection: close` was taken for a parser's refusal of the head: never saved, every retry
/// ran the operation again.)
async fn a_400_that_closes_the_connection_is_saved_and_replayed(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("")).await;
    let closing_400 = [
        ("X-Mock-Status", "400"),
        ("X-Mock-Header", "Connection: close"),
    ];
    let first = post(&proxy, "declined", &closing_400).await;
    assert_eq!(first.status, 400, "the upstream's answer: {:?}", first.body);
    assert_eq!(first.header("content-type"), "application/json");
    let doc: serde_json::Value = serde_json::from_slice(&first.body).expect("a JSON body");
    assert_eq!(doc["status"], 400, "the upstream's own body: {doc}");
    assert_eq!(first.header("idempotent-replayed"), "");
    assert_eq!(first.header("connection"), "", "hop-by-hop, not passed on");
    for attempt in 2..=3 {
        let again = post(&proxy, "declined", &closing_400).await;
        assert_eq!(again.status, 400, "attempt {attempt}");
        assert_eq!(
            again.header("idempotent-replayed"),
            "true",
            "attempt {attempt}"
        );
        assert_eq!(again.header("content-type"), "application/json");
        assert_eq!(again.body, first.body, "attempt {attempt}: byte-identical");
    }
    assert_eq!(
        env.mock.calls("declined"),
        1,
        "the upstream ran the operation once"
    );
}

every_store!(
    upstream_head_refusals_are_passed_on_and_not_saved,
    an_application_400_is_saved_and_replayed,
    a_400_that_closes_the_connection_is_saved_and_replayed,
);

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
