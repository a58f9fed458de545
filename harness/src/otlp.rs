//! A real OTLP/HTTP trace receiver on loopback: `POST /v1/traces` bodies decoded as
//! `ExportTraceServiceRequest` (protobuf, with `opentelemetry-proto`), their spans kept for a
//! test to read. It can be told to hang (take a request and never answer) or refuse (503).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// How the receiver answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// 200, the spans kept.
    Accept = 0,
    /// Never answers (the request read and held).
    Hang = 1,
    /// 503, nothing kept.
    Refuse = 2,
}

/// One exported span, as the receiver decoded it.
#[derive(Debug, Clone)]
pub struct ReceivedSpan {
    pub name: String,
    /// 32 hex digits.
    pub trace_id: String,
    /// 16 hex digits.
    pub span_id: String,
    /// 16 hex digits, empty for a root span.
    pub parent_span_id: String,
    /// OTLP's span kind: 2 server, 3 client, 1 internal.
    pub kind: i32,
    /// Every attribute, its value as text.
    pub attributes: BTreeMap<String, String>,
    /// `(trace_id, span_id)` of each link.
    pub links: Vec<(String, String)>,
    /// The resource's `service.name`.
    pub service_name: String,
    /// OTLP status code: 0 unset, 1 ok, 2 error.
    pub status: i32,
}

impl ReceivedSpan {
    /// An attribute's value as text ("" when absent).
    pub fn attr(&self, key: &str) -> &str {
        self.attributes.get(key).map_or("", String::as_str)
    }
}

#[derive(Default)]
struct Received {
    spans: Mutex<Vec<ReceivedSpan>>,
    /// Spans decoded, kept or not.
    counted: AtomicU64,
    /// Decode and count only (a bench's long runs): keep nothing.
    count_only: bool,
    requests: AtomicU64,
    mode: AtomicU8,
}

/// The receiver: its address and what it received. Stops serving when dropped.
pub struct OtlpReceiver {
    addr: SocketAddr,
    received: Arc<Received>,
    task: JoinHandle<()>,
}

impl OtlpReceiver {
    /// Binds `127.0.0.1:0` and serves on the current Tokio runtime.
    pub async fn start() -> OtlpReceiver {
        OtlpReceiver::serve(false).await
    }

    /// [`OtlpReceiver::start`] for a load: spans decoded and counted ([`OtlpReceiver::counted`]),
    /// none kept.
    pub async fn counting() -> OtlpReceiver {
        OtlpReceiver::serve(true).await
    }

    async fn serve(count_only: bool) -> OtlpReceiver {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let received = Arc::new(Received {
            count_only,
            ..Received::default()
        });
        let state = received.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let state = state.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req| answer(state.clone(), req));
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        OtlpReceiver {
            addr,
            received,
            task,
        }
    }

    /// The base URL to write as `otlp_endpoint`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// How it answers from now on.
    pub fn set_mode(&self, mode: Mode) {
        self.received.mode.store(mode as u8, Ordering::SeqCst);
    }

    /// Export requests received (answered or not).
    pub fn requests(&self) -> u64 {
        self.received.requests.load(Ordering::SeqCst)
    }

    /// Spans decoded so far, kept or not.
    pub fn counted(&self) -> u64 {
        self.received.counted.load(Ordering::SeqCst)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.received.spans.lock().expect("spans").clone()
    }

    /// The spans received once `done` holds of them, polled until `within` has passed; then
    /// whatever there is (the caller's assertions say what is missing).
    pub async fn wait_for(
        &self,
        within: Duration,
        done: impl Fn(&[ReceivedSpan]) -> bool,
    ) -> Vec<ReceivedSpan> {
        let until = Instant::now() + within;
        loop {
            let spans = self.spans();
            if done(&spans) || Instant::now() >= until {
                return spans;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn answer(
    state: Arc<Received>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    state.requests.fetch_add(1, Ordering::SeqCst);
    let path_ok = req.uri().path() == "/v1/traces";
    let protobuf = req
        .headers()
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes() == b"application/x-protobuf");
    let body = req.into_body().collect().await.map(|b| b.to_bytes());
    let mode = state.mode.load(Ordering::SeqCst);
    if mode == Mode::Hang as u8 {
        std::future::pending::<()>().await;
    }
    let status = match body {
        _ if mode == Mode::Refuse as u8 => StatusCode::SERVICE_UNAVAILABLE,
        _ if !path_ok => StatusCode::NOT_FOUND,
        _ if !protobuf => StatusCode::UNSUPPORTED_MEDIA_TYPE,
        Err(_) => StatusCode::BAD_REQUEST,
        Ok(bytes) => match ExportTraceServiceRequest::decode(bytes) {
            Err(_) => StatusCode::BAD_REQUEST,
            Ok(export) => {
                let spans = spans_of(export);
                state
                    .counted
                    .fetch_add(spans.len() as u64, Ordering::SeqCst);
                if !state.count_only {
                    state.spans.lock().expect("spans").extend(spans);
                }
                StatusCode::OK
            }
        },
    };
    let mut resp = Response::new(Full::new(Bytes::new()));
    *resp.status_mut() = status;
    Ok(resp)
}

fn spans_of(export: ExportTraceServiceRequest) -> Vec<ReceivedSpan> {
    let mut out = Vec::new();
    for rs in export.resource_spans {
        let resource = rs
            .resource
            .map(|r| attributes(&r.attributes))
            .unwrap_or_default();
        let service_name = resource.get("service.name").cloned().unwrap_or_default();
        for ss in rs.scope_spans {
            for span in ss.spans {
                out.push(ReceivedSpan {
                    name: span.name,
                    trace_id: hex::encode(&span.trace_id),
                    span_id: hex::encode(&span.span_id),
                    parent_span_id: hex::encode(&span.parent_span_id),
                    kind: span.kind,
                    attributes: attributes(&span.attributes),
                    links: span
                        .links
                        .iter()
                        .map(|l| (hex::encode(&l.trace_id), hex::encode(&l.span_id)))
                        .collect(),
                    service_name: service_name.clone(),
                    status: span.status.map_or(0, |s| s.code),
                });
            }
        }
    }
    out
}

fn attributes(kvs: &[KeyValue]) -> BTreeMap<String, String> {
    kvs.iter()
        .map(|kv| {
            let value = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(Value::StringValue(s)) => s.clone(),
                Some(Value::BoolValue(b)) => b.to_string(),
                Some(Value::IntValue(i)) => i.to_string(),
                Some(Value::DoubleValue(d)) => d.to_string(),
                Some(other) => format!("{other:?}"),
                None => String::new(),
            };
            (kv.key.clone(), value)
        })
        .collect()
}
