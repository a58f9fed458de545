//! A pass-through route on an `h2c` upstream carries gRPC as it is: unary, server-streaming and
//! client-streaming calls, their statuses in the trailers.

use harness::grpc::{Ledger, LedgerClient, TransferRequest};
use harness::{Backend, Env};

/// A proxy whose only route passes the ledger's whole service through to an `h2c` upstream.
async fn proxy_for(env: &Env, ledger: &Ledger) -> harness::TestProxy {
    let yaml = format!(
        "listen: 127.0.0.1:0
{store}upstreams:
  ledger:
    url: {url}
    protocol: h2c
routes:
  - name: ledger
    path: /ledger.v1.Ledger/*
    upstream: ledger
",
        store = env.store_yaml(""),
        url = ledger.url(),
    );
    env.proxy(&yaml).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unary_and_streaming_calls_pass_through_with_their_trailers() {
    let env = Env::new(Backend::Memory).await;
    let ledger = Ledger::start().await;
    let proxy = proxy_for(&env, &ledger).await;
    let mut client = LedgerClient::new(proxy.url("").trim_end_matches('/'));
    let reply = client
        .transfer(tonic::Request::new(TransferRequest {
            reference: "r-1".into(),
            amount: 2400,
        }))
        .await
        .expect("a transfer through the proxy");
    assert_eq!(reply.get_ref().postings, 1);
    assert_eq!(ledger.postings_of("r-1"), 1);
    // A status in the trailers reaches the client as the service sent it.
    let mut req = tonic::Request::new(TransferRequest {
        reference: "r-2".into(),
        amount: 1,
    });
    req.metadata_mut()
        .insert("x-ledger-status", "9".parse().expect("metadata"));
    let status = client
        .transfer(req)
        .await
        .expect_err("the service's status");
    assert_eq!(status.code(), tonic::Code::FailedPrecondition);
    assert_eq!(status.message(), "as asked (x-ledger-status)");
    // Server streaming and client streaming, on the same upstream connection.
    let watched = client.watch(5).await.expect("a server stream");
    assert_eq!(watched.len(), 5);
    assert_eq!(watched[4].reference, "w-4");
    let uploaded = client.upload(7).await.expect("a client stream");
    assert_eq!(uploaded, 7);
    assert_eq!(ledger.calls(), 4);
}
