//! The proxy's own answers on a `grpc:` route (SPEC §4.11): each one a gRPC status in a
//! trailers-only response — HTTP `200`, `content-type: application/grpc`, the status in the
//! head, the problem's title and detail in `grpc-message`, its type in `idemproxy-problem-type`
//! — and the ledger sees exactly what each answer says it saw.

use std::time::Duration;

use bytes::Bytes;
use harness::grpc::{Ledger, LedgerClient, TRANSFER, TransferRequest};
use harness::{Backend, Env, TestProxy, client, eventually, send};
use http::HeaderMap;
use http_body_util::BodyExt;
use prost::Message;
use tonic::Code;

/// A route with no upstream method behind it, whose key comes from `x-ref` (`key_from`).
const DERIVED: &str = "/ledger.v1.Ledger/Derived";

/// The ledger's `Transfer` as a `grpc:` route (its `idempotency:` lines in `idem`), a `grpc:`
/// route keyed by `x-ref` ([`DERIVED`]), and the rest of the service passed through, on one
/// `h2c` upstream at `url` (its extra lines in `upstream`); `top` goes before the store.
fn yaml(env: &Env, url: &str, upstream: &str, idem: &str, top: &str) -> String {
    let indent = |lines: &str, by: &str| -> String {
        lines
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| format!("{by}{}\n", l.trim()))
            .collect()
    };
    format!(
        "listen: 127.0.0.1:0
{top}{store}upstreams:
  ledger:
    url: {url}
    protocol: h2c
{upstream}routes:
  - name: ledger-transfer
    path: {TRANSFER}
    upstream: ledger
    grpc: {{}}
    idempotency:
      required: true
{idem}  - name: ledger-derived
    path: {DERIVED}
    upstream: ledger
    grpc: {{}}
    idempotency:
      key_from: [\"header:x-ref\"]
  - name: ledger
    path: /ledger.v1.Ledger/*
    upstream: ledger
",
        store = env.store_yaml(""),
        upstream = indent(upstream, "    "),
        idem = indent(idem, "      "),
    )
}

/// What came back to one raw HTTP/2 call.
struct Answer {
    status: u16,
    head: HeaderMap,
    body: Bytes,
    trailers: Option<HeaderMap>,
}

impl Answer {
    fn header(&self, name: &str) -> &str {
        self.head
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }

    /// Asserts the proxy's own answer: trailers-only, gRPC status `code`, problem `slug`, and
    /// `grpc-message` the problem's title, then its detail, percent-encoded.
    fn assert_status(&self, code: u32, slug: &str) {
        assert_eq!(
            self.status, 200,
            "HTTP 200 for a gRPC status: {:?}",
            self.head
        );
        assert_eq!(self.header("content-type"), "application/grpc");
        assert!(self.body.is_empty(), "trailers-only: no message");
        assert!(
            self.trailers.as_ref().is_none_or(HeaderMap::is_empty),
            "trailers-only: the status is in the head"
        );
        assert_eq!(
            self.header("grpc-status"),
            code.to_string(),
            "{:?}",
            self.head
        );
        assert_eq!(
            self.header("idemproxy-problem-type"),
            format!("urn:idemproxy:problem:{slug}")
        );
        let message = self.header("grpc-message");
        assert!(
            message.bytes().all(|b| (0x20..=0x7e).contains(&b)),
            "percent-encoded: {message:?}"
        );
        let (title, detail) = message.split_once(": ").unwrap_or(("", ""));
        assert!(!title.is_empty() && !detail.is_empty(), "{message:?}");
    }
}

/// A transfer's request message, gRPC-framed.
fn framed(msg: &TransferRequest) -> Bytes {
    let payload = msg.encode_to_vec();
    let mut out = vec![0u8];
    out.extend_from_slice(
        &u32::try_from(payload.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    out.extend_from_slice(&payload);
    Bytes::from(out)
}

/// One unary call over HTTP/2 to `path` on the proxy, with `headers` (a gRPC content type
/// unless they name one).
async fn call(
    proxy: &TestProxy,
    path: &str,
    headers: &[(&str, &str)],
    msg: &TransferRequest,
) -> Answer {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(true)
        .build_http::<http_body_util::Full<Bytes>>();
    let mut req = http::Request::post(proxy.url(path)).header("te", "trailers");
    if !headers.iter().any(|(n, _)| *n == "content-type") {
        req = req.header("content-type", "application/grpc");
    }
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let req = req
        .body(http_body_util::Full::new(framed(msg)))
        .expect("request");
    let resp = client.request(req).await.expect("a response");
    let (parts, body) = resp.into_parts();
    let collected = body.collect().await.expect("the body");
    let trailers = collected.trailers().cloned();
    Answer {
        status: parts.status.as_u16(),
        head: parts.headers,
        body: collected.to_bytes(),
        trailers,
    }
}

fn transfer(reference: &str, amount: i64) -> TransferRequest {
    TransferRequest {
        reference: reference.into(),
        amount,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_over_the_limits_is_invalid_argument_on_a_grpc_route() {
    let env = Env::new(Backend::Memory).await;
    let ledger = Ledger::start().await;
    let proxy = env.proxy(&yaml(&env, &ledger.url(), "", "", "")).await;
    // A tonic client's call with more metadata than the proxy's 97 header fields.
    let mut req = tonic::Request::new(transfer("r-head", 5));
    let meta = req.metadata_mut();
    meta.insert("idempotency-key", "k-head".parse().expect("metadata"));
    for i in 0..100 {
        let name: tonic::metadata::MetadataKey<_> =
            format!("x-filler-{i}").parse().expect("a metadata name");
        meta.insert(name, "1".parse().expect("metadata"));
    }
    let status = LedgerClient::new(proxy.url("").trim_end_matches('/'))
        .transfer(req)
        .await
        .expect_err("refused");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert_eq!(
        status
            .metadata()
            .get("idemproxy-problem-type")
            .and_then(|v| v.to_str().ok()),
        Some("urn:idemproxy:problem:headers-too-large")
    );
    assert!(
        status.message().starts_with("Request head too large: "),
        "{}",
        status.message()
    );
    // The same head, raw: a trailers-only answer.
    let filler: Vec<(String, String)> = (0..100)
        .map(|i| (format!("x-filler-{i}"), "1".to_owned()))
        .collect();
    let mut headers: Vec<(&str, &str)> = filler
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    headers.push(("idempotency-key", "k-head"));
    call(&proxy, TRANSFER, &headers, &transfer("r-head", 5))
        .await
        .assert_status(3, "headers-too-large");
    // Not a gRPC call, or not a gRPC route: the plain HTTP answer.
    let mut plain = headers.clone();
    plain.push(("content-type", "application/json"));
    let a = call(&proxy, TRANSFER, &plain, &transfer("r-head", 5)).await;
    assert_eq!(a.status, 431);
    assert_eq!(a.header("content-type"), "application/problem+json");
    let a = call(
        &proxy,
        "/ledger.v1.Ledger/Watch",
        &headers,
        &transfer("r", 1),
    )
    .await;
    assert_eq!(a.status, 431, "a pass-through route answers as HTTP");
    assert_eq!(ledger.calls(), 0, "nothing reached the ledger");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_before_a_claim_are_statuses_and_reach_nothing() {
    let env = Env::new(Backend::Memory).await;
    let ledger = Ledger::start().await;
    let proxy = env
        .proxy(&yaml(&env, &ledger.url(), "", "max_request_body: 64B", ""))
        .await;
    let long_key = "k".repeat(300);
    call(
        &proxy,
        TRANSFER,
        &[("idempotency-key", &long_key)],
        &transfer("r", 1),
    )
    .await
    .assert_status(3, "invalid-idempotency-key");
    call(&proxy, TRANSFER, &[], &transfer("r", 1))
        .await
        .assert_status(3, "missing-idempotency-key");
    // No key header, and no x-ref to derive one from.
    call(&proxy, DERIVED, &[], &transfer("r", 1))
        .await
        .assert_status(3, "unreadable-key-part");
    let big = transfer(&"r".repeat(100), 1);
    call(&proxy, TRANSFER, &[("idempotency-key", "k-big")], &big)
        .await
        .assert_status(8, "request-too-large");
    // Over HTTP/1.1 (HTTP/2 has no Connection header): the key header named hop-by-hop.
    let r = send(
        client()
            .post(proxy.url(TRANSFER))
            .header("content-type", "application/grpc")
            .header("connection", "idempotency-key")
            .header("idempotency-key", "k-hop")
            .body(framed(&transfer("r", 1))),
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), "application/grpc");
    assert_eq!(r.header("grpc-status"), "3");
    assert_eq!(
        r.header("idemproxy-problem-type"),
        "urn:idemproxy:problem:hop-by-hop-conflict"
    );
    assert_eq!(ledger.calls(), 0, "nothing reached the ledger");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_too_large_to_save_is_failed_precondition_on_replay() {
    let env = Env::new(Backend::Memory).await;
    let ledger = Ledger::start().await;
    let proxy = env
        .proxy(&yaml(&env, &ledger.url(), "", "max_response_body: 4B", ""))
        .await;
    let mut client = LedgerClient::new(proxy.url("").trim_end_matches('/'));
    let mut first = tonic::Request::new(transfer("r-big", 3));
    first
        .metadata_mut()
        .insert("idempotency-key", "k-big".parse().expect("metadata"));
    let reply = client
        .transfer(first)
        .await
        .expect("the first client gets it whole");
    assert_eq!(reply.get_ref().postings, 1);
    let a = call(
        &proxy,
        TRANSFER,
        &[("idempotency-key", "k-big")],
        &transfer("r-big", 3),
    )
    .await;
    a.assert_status(9, "response-not-replayable");
    assert_eq!(ledger.postings_of("r-big"), 1, "posted once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_cannot_be_reached_is_unavailable_and_released() {
    let env = Env::new(Backend::Memory).await;
    let url = format!("http://127.0.0.1:{}", harness::free_port());
    let proxy = env
        .proxy(&yaml(&env, &url, "connect_timeout: 300ms", "", ""))
        .await;
    for _ in 0..2 {
        let a = call(
            &proxy,
            TRANSFER,
            &[("idempotency-key", "k-down")],
            &transfer("r", 1),
        )
        .await;
        a.assert_status(14, "upstream-unavailable");
        assert_eq!(a.header("idempotent-replayed"), "", "released, never saved");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_is_deadline_exceeded_and_kept() {
    let env = Env::new(Backend::Memory).await;
    let ledger = Ledger::start().await;
    let proxy = env
        .proxy(&yaml(
            &env,
            &ledger.url(),
            "connect_timeout: 100ms\ntimeout: 300ms",
            "",
            "",
        ))
        .await;
    let slow = [("idempotency-key", "k-slow"), ("x-ledger-delay-ms", "800")];
    let first = call(&proxy, TRANSFER, &slow, &transfer("r-slow", 9)).await;
    first.assert_status(4, "upstream-timeout");
    assert_eq!(ledger.postings_of("r-slow"), 1, "the ledger posted");
    // Under keep (the default) the answer is the key's result, replayed.
    let again = call(
        &proxy,
        TRANSFER,
        &[("idempotency-key", "k-slow")],
        &transfer("r-slow", 9),
    )
    .await;
    again.assert_status(4, "upstream-timeout");
    assert_eq!(again.header("idempotent-replayed"), "true");
    assert_eq!(again.header("grpc-message"), first.header("grpc-message"));
    assert_eq!(ledger.postings_of("r-slow"), 1, "posted once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_is_down_is_unavailable_and_nothing_is_forwarded() {
    let mut env = Env::new(Backend::Redis).await;
    let ledger = Ledger::start().await;
    let proxy = env.proxy(&yaml(&env, &ledger.url(), "", "", "")).await;
    env.make_store_unreachable();
    let a = call(
        &proxy,
        TRANSFER,
        &[("idempotency-key", "k-store")],
        &transfer("r-s", 1),
    )
    .await;
    a.assert_status(14, "store-unavailable");
    assert_eq!(ledger.calls(), 0);
}

/// Redis out of memory refuses the save while renewals still work; past the pending-save
/// bounds the result is let go, and the record saved in its place is replayed as a gRPC status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_not_kept_is_failed_precondition_on_replay() {
    let env = Env::new(Backend::Redis).await;
    let ledger = Ledger::start().await;
    let top = "limits:\n  max_pending_saves: 1\n";
    let proxy = env
        .proxy(&yaml(&env, &ledger.url(), "", "lock_ttl: 3s", top))
        .await;
    let mut conn = env.redis().conn();
    let config = |conn: &mut redis::Connection, name: &str, value: &str| {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(value)
            .query(conn)
            .expect("CONFIG SET");
    };
    config(&mut conn, "maxmemory-policy", "noeviction");
    // Two calls whose answers come after Redis is full: two saves pending, one past the bound.
    let mut calls = Vec::new();
    for (key, reference, delay) in [("k-nk-0", "r-nk-0", "600"), ("k-nk-1", "r-nk-1", "750")] {
        let proxy_url = proxy.url("");
        calls.push(tokio::spawn(async move {
            let mut client = LedgerClient::new(proxy_url.trim_end_matches('/'));
            let mut req = tonic::Request::new(transfer(reference, 1));
            req.metadata_mut()
                .insert("idempotency-key", key.parse().expect("metadata"));
            req.metadata_mut()
                .insert("x-ledger-delay-ms", delay.parse().expect("metadata"));
            client.transfer(req).await
        }));
    }
    assert!(
        eventually(Duration::from_secs(3), || ledger.postings() == 2).await,
        "both posted"
    );
    config(&mut conn, "maxmemory", "1");
    for c in calls {
        let reply = c
            .await
            .expect("a call")
            .expect("the client gets its answer");
        assert_eq!(reply.get_ref().postings, 1);
    }
    let not_kept = || {
        proxy.metric(
            "idemproxy_results_not_kept_total",
            &[("route", "ledger-transfer")],
        )
    };
    assert!(
        eventually(Duration::from_secs(3), || not_kept() == 1.0).await,
        "the oldest result let go"
    );
    config(&mut conn, "maxmemory", "0");
    assert!(
        eventually(Duration::from_secs(8), || proxy
            .metric("idemproxy_pending_saves", &[])
            == 0.0)
        .await,
        "the pending saves landed"
    );
    let a = call(
        &proxy,
        TRANSFER,
        &[("idempotency-key", "k-nk-0")],
        &transfer("r-nk-0", 1),
    )
    .await;
    a.assert_status(9, "result-not-kept");
    assert_eq!(a.header("idempotent-replayed"), "true");
    let b = call(
        &proxy,
        TRANSFER,
        &[("idempotency-key", "k-nk-1")],
        &transfer("r-nk-1", 1),
    )
    .await;
    assert_eq!(
        b.header("grpc-status"),
        "",
        "the whole result, its status in the trailers"
    );
    assert_eq!(
        b.trailers
            .as_ref()
            .and_then(|t| t.get("grpc-status"))
            .map(|v| v.as_bytes()),
        Some(&b"0"[..])
    );
    assert_eq!(ledger.postings_of("r-nk-0"), 1);
    assert_eq!(ledger.postings_of("r-nk-1"), 1);
    assert_eq!(proxy.lost_leases(), 0);
}
