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

/// `mock-upstream grpc-calls`: `calls` `Transfer` calls, `CONCURRENT` at a time on one HTTP/2
/// connection, each with `key_prefix` and its number as its key (none without a prefix; the
/// prefix alone with `fixed`), for counting what the proxy spends on a call
/// (`scripts/callgrind-per-request`). Fails unless every call got HTTP `200` and `grpc-status`
/// `0`.
pub(crate) async fn calls(
    url: &str,
    calls: u32,
    key_prefix: Option<&str>,
    fixed: bool,
) -> std::io::Result<()> {
    const CONCURRENT: u32 = 4;
    let client = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http::<Full<Bytes>>();
    let target = format!("{}/ledger.v1.Ledger/Transfer", url.trim_end_matches('/'));
    let body = idemproxy_mock::transfer_request("r-calls", 2400);
    let one = |i: u32| {
        let mut req = http::Request::post(target.as_str())
            .header("content-type", "application/grpc")
            .header("te", "trailers");
        match (key_prefix, fixed) {
            (Some(prefix), true) => req = req.header("idempotency-key", prefix),
            (Some(prefix), false) => req = req.header("idempotency-key", format!("{prefix}{i}")),
            (None, _) => {}
        }
        let req = req.body(Full::new(body.clone()));
        let client = client.clone();
        async move {
            let req = req.map_err(std::io::Error::other)?;
            let resp = client.request(req).await.map_err(std::io::Error::other)?;
            let (parts, body) = resp.into_parts();
            let collected = body.collect().await.map_err(std::io::Error::other)?;
            let status = collected
                .trailers()
                .and_then(|t| t.get("grpc-status"))
                .or_else(|| parts.headers.get("grpc-status"))
                .map(|v| v.as_bytes().to_vec());
            if parts.status != http::StatusCode::OK || status.as_deref() != Some(b"0") {
                return Err(std::io::Error::other(format!(
                    "call {i}: HTTP {}, grpc-status {:?}",
                    parts.status, status
                )));
            }
            Ok::<(), std::io::Error>(())
        }
    };
    // The first alone, so that every other call finds the connection made.
    one(0).await?;
    let mut next = 1;
    let mut running = tokio::task::JoinSet::new();
    while next < calls || !running.is_empty() {
        while next < calls && running.len() < CONCURRENT as usize {
            running.spawn(one(next));
            next += 1;
        }
        if let Some(done) = running.join_next().await {
            done.map_err(std::io::Error::other)??;
        }
    }
    let _ = writeln!(std::io::stdout(), "{calls} calls: HTTP 200, grpc-status 0");
    Ok(())
}
