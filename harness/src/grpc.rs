//! A gRPC ledger service on loopback, and tonic clients for it: the real peers of the gRPC
//! tests (SPEC §4.11).
//!
//! The service is served with tonic's own server machinery (`tonic::server::Grpc`, prost
//! messages through `tonic_prost`) on an HTTP/2 listener of its own (prior knowledge, `h2c`),
//! and counts what a ledger must never do twice: its postings, by reference. Its methods:
//!
//! | method | kind | does |
//! | --- | --- | --- |
//! | `/ledger.v1.Ledger/Transfer` | unary | posts `amount` under `reference` (counted), answers the posting's id and the reference's count so far |
//! | `/ledger.v1.Ledger/Watch` | server streaming | `count` postings, one message each |
//! | `/ledger.v1.Ledger/Upload` | client streaming | counts the messages it was sent |
//!
//! Controls, as request metadata: `x-ledger-delay-ms` (the transfer is posted at once, its
//! answer sent this much later: the lost answer of a client whose deadline is shorter) and
//! `x-ledger-status` (a gRPC status code: the transfer is answered with it, nothing posted).

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use http::uri::PathAndQuery;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tonic::{Request, Response, Status, Streaming};
use tonic_prost::ProstCodec;

/// `ledger.v1.TransferRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TransferRequest {
    #[prost(string, tag = "1")]
    pub reference: String,
    #[prost(int64, tag = "2")]
    pub amount: i64,
}

/// `ledger.v1.TransferReply`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TransferReply {
    /// `p_N`, N counting every posting the service made.
    #[prost(string, tag = "1")]
    pub posting_id: String,
    /// How many postings the reference has now.
    #[prost(uint64, tag = "2")]
    pub postings: u64,
}

/// `ledger.v1.WatchRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct WatchRequest {
    #[prost(uint32, tag = "1")]
    pub count: u32,
}

/// `ledger.v1.Posting`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Posting {
    #[prost(string, tag = "1")]
    pub reference: String,
    #[prost(int64, tag = "2")]
    pub amount: i64,
}

/// `ledger.v1.UploadReply`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct UploadReply {
    #[prost(uint64, tag = "1")]
    pub count: u64,
}

pub const TRANSFER: &str = "/ledger.v1.Ledger/Transfer";
pub const WATCH: &str = "/ledger.v1.Ledger/Watch";
pub const UPLOAD: &str = "/ledger.v1.Ledger/Upload";

/// What the ledger has done.
#[derive(Default)]
struct State {
    /// Postings per reference.
    by_reference: Mutex<HashMap<String, u64>>,
    /// Every posting.
    postings: AtomicU64,
    /// Every call of any method.
    calls: AtomicU64,
}

/// The ledger service, served until dropped.
pub struct Ledger {
    addr: SocketAddr,
    state: Arc<State>,
    task: JoinHandle<()>,
}

impl Ledger {
    /// Serves the ledger on a free loopback port (HTTP/2 with prior knowledge).
    pub async fn start() -> Ledger {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the ledger");
        let addr = listener.local_addr().expect("the ledger's address");
        let state = Arc::new(State::default());
        let served = state.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let state = served.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let state = state.clone();
                        async move { Ok::<_, Infallible>(dispatch(state, req).await) }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .http2_only()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ledger { addr, state, task }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Postings made under `reference`.
    pub fn postings_of(&self, reference: &str) -> u64 {
        self.state
            .by_reference
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(reference)
            .copied()
            .unwrap_or(0)
    }

    /// Every posting made.
    pub fn postings(&self) -> u64 {
        self.state.postings.load(Ordering::SeqCst)
    }

    /// Every call received, of any method.
    pub fn calls(&self) -> u64 {
        self.state.calls.load(Ordering::SeqCst)
    }
}

impl Drop for Ledger {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type Answer = http::Response<tonic::body::Body>;

async fn dispatch(state: Arc<State>, req: http::Request<hyper::body::Incoming>) -> Answer {
    state.calls.fetch_add(1, Ordering::SeqCst);
    match req.uri().path() {
        TRANSFER => {
            let mut grpc =
                tonic::server::Grpc::new(ProstCodec::<TransferReply, TransferRequest>::default());
            grpc.unary(Transfer(state), req).await
        }
        WATCH => {
            let mut grpc = tonic::server::Grpc::new(ProstCodec::<Posting, WatchRequest>::default());
            grpc.server_streaming(Watch, req).await
        }
        UPLOAD => {
            let mut grpc = tonic::server::Grpc::new(ProstCodec::<UploadReply, Posting>::default());
            grpc.client_streaming(Upload, req).await
        }
        _ => Status::unimplemented("no such method").into_http(),
    }
}

type Boxed<T> = Pin<Box<dyn Future<Output = Result<T, Status>> + Send>>;

struct Transfer(Arc<State>);

impl tower_service::Service<Request<TransferRequest>> for Transfer {
    type Response = Response<TransferReply>;
    type Error = Status;
    type Future = Boxed<Response<TransferReply>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Status>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<TransferRequest>) -> Self::Future {
        let state = self.0.clone();
        Box::pin(async move {
            let meta = req.metadata();
            let delay = meta
                .get("x-ledger-delay-ms")
                .and_then(|v| v.to_str().ok()?.parse().ok())
                .map(Duration::from_millis);
            let status = meta
                .get("x-ledger-status")
                .and_then(|v| v.to_str().ok()?.parse::<i32>().ok());
            if let Some(code) = status {
                return Err(Status::new(code.into(), "as asked (x-ledger-status)"));
            }
            let msg = req.into_inner();
            let n = state.postings.fetch_add(1, Ordering::SeqCst) + 1;
            let postings = {
                let mut by = state.by_reference.lock().unwrap_or_else(|p| p.into_inner());
                let count = by.entry(msg.reference).or_insert(0);
                *count += 1;
                *count
            };
            if let Some(delay) = delay {
                tokio::time::sleep(delay).await;
            }
            Ok(Response::new(TransferReply {
                posting_id: format!("p_{n}"),
                postings,
            }))
        })
    }
}

struct Watch;

type PostingStream = futures_util::stream::Iter<std::vec::IntoIter<Result<Posting, Status>>>;

impl tower_service::Service<Request<WatchRequest>> for Watch {
    type Response = Response<PostingStream>;
    type Error = Status;
    type Future = Boxed<Response<PostingStream>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Status>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<WatchRequest>) -> Self::Future {
        let count = req.into_inner().count;
        Box::pin(async move {
            let items: Vec<Result<Posting, Status>> = (0..count)
                .map(|i| {
                    Ok(Posting {
                        reference: format!("w-{i}"),
                        amount: i64::from(i),
                    })
                })
                .collect();
            Ok(Response::new(futures_util::stream::iter(items)))
        })
    }
}

struct Upload;

impl tower_service::Service<Request<Streaming<Posting>>> for Upload {
    type Response = Response<UploadReply>;
    type Error = Status;
    type Future = Boxed<Response<UploadReply>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Status>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Streaming<Posting>>) -> Self::Future {
        Box::pin(async move {
            let mut stream = req.into_inner();
            let mut count = 0;
            while stream.message().await?.is_some() {
                count += 1;
            }
            Ok(Response::new(UploadReply { count }))
        })
    }
}

/// A tonic client of the ledger at `base` (`http://…`: the service itself, or the proxy in
/// front of it), over HTTP/2 with prior knowledge.
#[derive(Clone)]
pub struct LedgerClient {
    grpc: tonic::client::Grpc<Client<HttpConnector, tonic::body::Body>>,
}

impl LedgerClient {
    pub fn new(base: &str) -> LedgerClient {
        let client = Client::builder(TokioExecutor::new())
            .http2_only(true)
            .build_http();
        let origin = base.parse().expect("a base URL");
        LedgerClient {
            grpc: tonic::client::Grpc::with_origin(client, origin),
        }
    }

    /// `Transfer`.
    pub async fn transfer(
        &mut self,
        req: Request<TransferRequest>,
    ) -> Result<Response<TransferReply>, Status> {
        self.grpc
            .ready()
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        self.grpc
            .unary(
                req,
                PathAndQuery::from_static(TRANSFER),
                ProstCodec::default(),
            )
            .await
    }

    /// `Watch`: every message of the stream.
    pub async fn watch(&mut self, count: u32) -> Result<Vec<Posting>, Status> {
        self.grpc
            .ready()
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let mut stream = self
            .grpc
            .server_streaming(
                Request::new(WatchRequest { count }),
                PathAndQuery::from_static(WATCH),
                ProstCodec::default(),
            )
            .await?
            .into_inner();
        let mut out = Vec::new();
        while let Some(p) = stream.message().await? {
            out.push(p);
        }
        Ok(out)
    }

    /// `Upload` of `n` postings.
    pub async fn upload(&mut self, n: u32) -> Result<u64, Status> {
        self.grpc
            .ready()
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let postings: Vec<Posting> = (0..n)
            .map(|i| Posting {
                reference: format!("u-{i}"),
                amount: i64::from(i),
            })
            .collect();
        let reply: Response<UploadReply> = self
            .grpc
            .client_streaming(
                Request::new(futures_util::stream::iter(postings)),
                PathAndQuery::from_static(UPLOAD),
                ProstCodec::default(),
            )
            .await?;
        Ok(reply.into_inner().count)
    }
}
