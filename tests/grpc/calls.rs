//! Unary calls on a `grpc:` route, on every store, through tonic clients to the ledger: each
//! posting runs once per key whatever a client's retry or hedging policy sends, the retry gets
//! the first answer (trailers byte for byte), and the proxy's own answers are gRPC statuses.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use harness::grpc::{Ledger, LedgerClient, TRANSFER, TransferRequest};
use harness::{Backend, Env, TestProxy, every_store};
use http_body_util::BodyExt;
use prost::Message;
use tonic::Code;

every_store!(
    a_lost_answer_retried_with_the_same_key_posts_once_and_gets_the_first_answer,
    hedged_copies_post_once_and_the_others_are_told_to_come_back,
    the_same_key_with_another_message_is_failed_precondition,
    an_unavailable_service_is_released_and_the_retry_posts,
    the_replay_is_the_first_response_byte_for_byte_trailers_included,
);

/// A proxy with the ledger's `Transfer` as a `grpc:` route and the rest of the service passed
/// through, both on one `h2c` upstream.
async fn proxy_for(env: &Env, ledger: &Ledger) -> TestProxy {
    let yaml = format!(
        "listen: 127.0.0.1:0
{store}upstreams:
  ledger:
    url: {url}
    protocol: h2c
routes:
  - name: ledger-transfer
    path: {TRANSFER}
    upstream: ledger
    grpc: {{}}
    idempotency: {{}}
  - name: ledger
    path: /ledger.v1.Ledger/*
    upstream: ledger
",
        store = env.store_yaml(""),
        url = ledger.url(),
    );
    env.proxy(&yaml).await
}

fn client_of(proxy: &TestProxy) -> LedgerClient {
    LedgerClient::new(proxy.url("").trim_end_matches('/'))
}

/// A transfer call with `key` in its metadata, and `meta` besides.
fn call(
    key: &str,
    reference: &str,
    amount: i64,
    meta: &[(&'static str, &str)],
) -> tonic::Request<TransferRequest> {
    let mut req = tonic::Request::new(TransferRequest {
        reference: reference.into(),
        amount,
    });
    req.metadata_mut()
        .insert("idempotency-key", key.parse().expect("metadata"));
    for (name, value) in meta {
        req.metadata_mut()
            .insert(*name, value.parse().expect("metadata"));
    }
    req
}

async fn a_lost_answer_retried_with_the_same_key_posts_once_and_gets_the_first_answer(
    backend: Backend,
) {
    let env = Env::new(backend).await;
    let ledger = Ledger::start().await;
    let proxy = proxy_for(&env, &ledger).await;
    let mut client = client_of(&proxy);
    // The first attempt's deadline (200ms) ends before the ledger answers (600ms after it
    // posted): the client gives up, as a retry policy's per-attempt deadline does.
    let first = tokio::time::timeout(
        Duration::from_millis(200),
        client.transfer(call(
            "k-lost",
            "r-lost",
            2400,
            &[("x-ledger-delay-ms", "600")],
        )),
    )
    .await;
    assert!(first.is_err(), "the first answer never reached the client");
    assert_eq!(ledger.postings_of("r-lost"), 1, "but the ledger posted");
    // The retry: the same call, the same key, a fresh attempt.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let retry = client
        .transfer(call("k-lost", "r-lost", 2400, &[]))
        .await
        .expect("the retry gets the first answer");
    assert_eq!(retry.get_ref().postings, 1, "the first posting's answer");
    assert_eq!(
        retry
            .metadata()
            .get("idempotent-replayed")
            .map(|v| v.to_str().unwrap_or("")),
        Some("true")
    );
    assert_eq!(ledger.postings_of("r-lost"), 1, "posted once");
}

async fn hedged_copies_post_once_and_the_others_are_told_to_come_back(backend: Backend) {
    let env = Env::new(backend).await;
    let ledger = Ledger::start().await;
    let proxy = Arc::new(proxy_for(&env, &ledger).await);
    // A hedging client sends copies at once; the first one's posting takes 300ms.
    let mut copies = Vec::new();
    for _ in 0..8 {
        let mut client = client_of(&proxy);
        copies.push(tokio::spawn(async move {
            client
                .transfer(call(
                    "k-hedge",
                    "r-hedge",
                    100,
                    &[("x-ledger-delay-ms", "300")],
                ))
                .await
        }));
    }
    let mut ok = 0;
    let mut told_to_wait = 0;
    for copy in copies {
        match copy.await.expect("a copy") {
            Ok(reply) => {
                ok += 1;
                assert_eq!(reply.get_ref().postings, 1);
            }
            Err(status) => {
                assert_eq!(status.code(), Code::Unavailable, "{status:?}");
                let pushback = status
                    .metadata()
                    .get("grpc-retry-pushback-ms")
                    .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
                assert!(pushback.is_some_and(|ms| ms >= 1000), "{status:?}");
                assert!(
                    status.message().contains("not finished"),
                    "{}",
                    status.message()
                );
                told_to_wait += 1;
            }
        }
    }
    assert_eq!(ok + told_to_wait, 8);
    assert!(ok >= 1, "the first copy got its answer");
    assert_eq!(
        proxy.requests("ledger-transfer", idemproxy::metrics::Outcome::Conflict),
        told_to_wait,
        "the proxy saw the others as conflicts"
    );
    assert_eq!(ledger.postings_of("r-hedge"), 1, "posted once");
    // The retry policy comes back after the pushback: the first answer.
    let later = client_of(&proxy)
        .transfer(call("k-hedge", "r-hedge", 100, &[]))
        .await
        .expect("a replay");
    assert_eq!(later.get_ref().postings, 1);
    assert_eq!(ledger.postings_of("r-hedge"), 1);
}

async fn the_same_key_with_another_message_is_failed_precondition(backend: Backend) {
    let env = Env::new(backend).await;
    let ledger = Ledger::start().await;
    let proxy = proxy_for(&env, &ledger).await;
    let mut client = client_of(&proxy);
    client
        .transfer(call("k-mismatch", "r-m", 10, &[]))
        .await
        .expect("the first call");
    let status = client
        .transfer(call("k-mismatch", "r-m", 99, &[]))
        .await
        .expect_err("another message under the same key");
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert_eq!(
        status
            .metadata()
            .get("idemproxy-problem-type")
            .and_then(|v| v.to_str().ok()),
        Some("urn:idemproxy:problem:idempotency-key-reused")
    );
    assert_eq!(ledger.postings_of("r-m"), 1);
    // No key: INVALID_ARGUMENT, nothing forwarded.
    let mut keyless = tonic::Request::new(TransferRequest {
        reference: "r-none".into(),
        amount: 1,
    });
    keyless
        .metadata_mut()
        .insert("x-note", "no key".parse().expect("metadata"));
    let status = client.transfer(keyless).await.expect_err("no key");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert_eq!(ledger.postings_of("r-none"), 0);
}

async fn an_unavailable_service_is_released_and_the_retry_posts(backend: Backend) {
    let env = Env::new(backend).await;
    let ledger = Ledger::start().await;
    let proxy = proxy_for(&env, &ledger).await;
    let mut client = client_of(&proxy);
    let status = client
        .transfer(call("k-unavail", "r-u", 5, &[("x-ledger-status", "14")]))
        .await
        .expect_err("the service's UNAVAILABLE");
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(
        status.message(),
        "as asked (x-ledger-status)",
        "the service's own answer"
    );
    assert_eq!(ledger.postings_of("r-u"), 0);
    // Released: the retry runs.
    let reply = client
        .transfer(call("k-unavail", "r-u", 5, &[]))
        .await
        .expect("the retry posts");
    assert_eq!(reply.get_ref().postings, 1);
    assert!(reply.metadata().get("idempotent-replayed").is_none());
    // A status that is the call's result is saved and replayed.
    let status = client
        .transfer(call("k-failed", "r-f", 5, &[("x-ledger-status", "9")]))
        .await
        .expect_err("FAILED_PRECONDITION from the service");
    assert_eq!(status.code(), Code::FailedPrecondition);
    let again = client
        .transfer(call("k-failed", "r-f", 5, &[]))
        .await
        .expect_err("replayed");
    assert_eq!(again.code(), Code::FailedPrecondition);
    assert_eq!(again.message(), "as asked (x-ledger-status)");
    // Streaming methods pass through the same upstream on the other route.
    assert_eq!(client.watch(3).await.expect("a server stream").len(), 3);
    assert_eq!(client.upload(4).await.expect("a client stream"), 4);
}

/// One raw HTTP/2 unary call: the response's head, body bytes and trailers.
async fn raw_call(
    base: &str,
    key: &str,
    msg: &TransferRequest,
) -> (http::HeaderMap, Bytes, http::HeaderMap) {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(true)
        .build_http::<http_body_util::Full<Bytes>>();
    let payload = msg.encode_to_vec();
    let mut framed = vec![0u8];
    framed.extend_from_slice(&u32::try_from(payload.len()).unwrap_or(0).to_be_bytes());
    framed.extend_from_slice(&payload);
    let req = http::Request::post(format!("{base}{TRANSFER}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("idempotency-key", key)
        .body(http_body_util::Full::new(Bytes::from(framed)))
        .expect("request");
    let resp = client.request(req).await.expect("a response");
    let (parts, body) = resp.into_parts();
    let collected = body.collect().await.expect("the body");
    let trailers = collected.trailers().cloned().unwrap_or_default();
    (parts.headers, collected.to_bytes(), trailers)
}

async fn the_replay_is_the_first_response_byte_for_byte_trailers_included(backend: Backend) {
    let env = Env::new(backend).await;
    let ledger = Ledger::start().await;
    let proxy = proxy_for(&env, &ledger).await;
    let base = proxy.url("").trim_end_matches('/').to_owned();
    let msg = TransferRequest {
        reference: "r-bytes".into(),
        amount: 7,
    };
    let (head, body, trailers) = raw_call(&base, "k-bytes", &msg).await;
    assert_eq!(
        trailers.get("grpc-status").map(|v| v.as_bytes()),
        Some(&b"0"[..])
    );
    let (replay_head, replay_body, replay_trailers) = raw_call(&base, "k-bytes", &msg).await;
    assert_eq!(replay_body, body, "every message, byte for byte");
    assert_eq!(replay_trailers, trailers, "the trailers, byte for byte");
    assert_eq!(
        replay_head.get("idempotent-replayed").map(|v| v.as_bytes()),
        Some(&b"true"[..])
    );
    for name in ["content-type", "grpc-accept-encoding", "grpc-encoding"] {
        assert_eq!(replay_head.get(name), head.get(name), "{name}");
    }
    assert_eq!(ledger.postings_of("r-bytes"), 1);
    // A request that is not a gRPC call: 415, nothing forwarded.
    let r = harness::send(
        harness::client()
            .post(format!("{base}{TRANSFER}"))
            .header("content-type", "application/grpc-web+proto")
            .header("idempotency-key", "k-web")
            .body("x"),
    )
    .await;
    r.assert_problem(415, "unsupported-media-type");
    assert_eq!(
        ledger.calls(),
        1,
        "the replay and the refusal reached nothing"
    );
}
