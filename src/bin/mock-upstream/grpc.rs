//! `mock-upstream grpc-transfer`: one gRPC `Transfer` call, as a gRPC client sends it (HTTP/2,
//! `content-type: application/grpc`, `te: trailers`, one length-prefixed message), and what
//! came back printed on one line: the status, `grpc-status`, the reply, and whether it was a
//! replay.

use std::io::Write;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

pub(crate) async fn transfer(
    url: &str,
    key: &str,
    reference: &str,
    amount: i64,
) -> std::io::Result<()> {
    let client = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http::<Full<Bytes>>();
    let req = http::Request::post(format!(
        "{}/ledger.v1.Ledger/Transfer",
        url.trim_end_matches('/')
    ))
    .header("content-type", "application/grpc")
    .header("te", "trailers")
    .header("idempotency-key", key)
    .body(Full::new(idemproxy_mock::transfer_request(
        reference, amount,
    )))
    .map_err(std::io::Error::other)?;
    let resp = client.request(req).await.map_err(std::io::Error::other)?;
    let (parts, body) = resp.into_parts();
    let collected = body.collect().await.map_err(std::io::Error::other)?;
    let trailers = collected.trailers().cloned().unwrap_or_default();
    let bytes = collected.to_bytes();
    let field = |name: &str| {
        trailers
            .get(name)
            .or_else(|| parts.headers.get(name))
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-")
            .to_owned()
    };
    let reply = match idemproxy_mock::read_reply(&bytes) {
        Some((id, postings)) => format!("posting {id}, postings of {reference}: {postings}"),
        None => format!("grpc-message: {}", field("grpc-message")),
    };
    let replayed = parts
        .headers
        .get("idempotent-replayed")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-");
    let _ = writeln!(
        std::io::stdout(),
        "HTTP {} grpc-status {} | {reply} | idempotent-replayed: {replayed}",
        parts.status.as_u16(),
        field("grpc-status"),
    );
    Ok(())
}
