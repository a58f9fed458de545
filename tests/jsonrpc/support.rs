//! A real MCP server (the official Rust SDK's Streamable HTTP server) with a `book` tool that
//! counts its executions by reference, served on loopback; the SDK's own client; and a proxy
//! with one JSON-RPC route in front of the server.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use harness::{Env, Reply, TestProxy, client, send};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ClientConfig, ContentBlock,
    InputRequiredResult, MetaObject, ProgressNotificationParam, ProtocolVersion, RequestMetaObject,
    ServerCapabilities, ServerConfig,
};
use rmcp::service::{RequestContext, RunningService};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, RoleClient, RoleServer, ServerHandler, ServiceExt};
use tokio::sync::Notify;
use tower_service::Service;

/// What the server saw and did.
#[derive(Default)]
pub(crate) struct Seen {
    /// `book` executions by `reference`.
    pub(crate) bookings: Mutex<HashMap<String, u64>>,
    /// HTTP requests by JSON-RPC method (`GET`, `DELETE` by their HTTP method; a batch as `batch`).
    pub(crate) methods: Mutex<HashMap<String, u64>>,
    /// Signalled each time a `book` execution starts.
    pub(crate) started: Notify,
    /// Set: `slow` bookings wait for [`Seen::release`] before answering.
    pub(crate) hold: AtomicBool,
    pub(crate) release: Notify,
}

impl Seen {
    pub(crate) fn bookings(&self, reference: &str) -> u64 {
        lock(&self.bookings).get(reference).copied().unwrap_or(0)
    }

    pub(crate) fn method(&self, method: &str) -> u64 {
        lock(&self.methods).get(method).copied().unwrap_or(0)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The booking tools.
#[derive(Clone)]
struct Booking {
    seen: Arc<Seen>,
}

impl ServerHandler for Booking {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let args = request.arguments.clone().unwrap_or_default();
        let reference = args
            .get("reference")
            .and_then(|v| v.as_str())
            .unwrap_or("none")
            .to_owned();
        match &*request.name {
            "ask" => {
                // Needs input before it runs: nothing is booked yet.
                return Ok(CallToolResponse::InputRequired(
                    InputRequiredResult::from_request_state("more please"),
                ));
            }
            "busy" => {
                return Err(ErrorData::new(
                    rmcp::model::ErrorCode(-32001),
                    "try again",
                    None,
                ));
            }
            "book" | "cancel" => {}
            other => {
                return Err(ErrorData::invalid_params(format!("no tool {other}"), None));
            }
        }
        let n = {
            let mut bookings = lock(&self.seen.bookings);
            let n = bookings.entry(reference.clone()).or_insert(0);
            *n += 1;
            *n
        };
        self.seen.started.notify_waiters();
        if args.get("progress").and_then(|v| v.as_bool()) == Some(true)
            && let Some(token) = context.meta.get_progress_token()
        {
            for step in 1..=3u32 {
                let _ = context
                    .peer
                    .notify_progress(
                        ProgressNotificationParam::new(token.clone(), f64::from(step))
                            .with_total(3.0),
                    )
                    .await;
                if step == 1 && self.seen.hold.load(Ordering::SeqCst) {
                    // The test reads the first event before the tool goes on.
                    self.seen.release.notified().await;
                }
            }
        } else if args.get("slow").and_then(|v| v.as_bool()) == Some(true) {
            tokio::time::sleep(Duration::from_millis(600)).await;
        }
        Ok(
            CallToolResult::success(vec![ContentBlock::text(format!("booked {reference} #{n}"))])
                .into(),
        )
    }
}

/// An MCP server on loopback: its address and what it saw.
pub(crate) struct McpServer {
    pub(crate) addr: SocketAddr,
    pub(crate) seen: Arc<Seen>,
    stop: tokio_util::sync::CancellationToken,
}

impl Drop for McpServer {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl McpServer {
    /// A stateless server of the current protocol revision.
    pub(crate) async fn start() -> McpServer {
        McpServer::start_with(false).await
    }

    /// `sessions`: the legacy session mode (`Mcp-Session-Id`, the 2025 revisions).
    pub(crate) async fn start_with(sessions: bool) -> McpServer {
        let seen = Arc::new(Seen::default());
        let stop = tokio_util::sync::CancellationToken::new();
        let config = StreamableHttpServerConfig::default()
            .with_legacy_session_mode(sessions)
            .with_json_response(true)
            .with_sse_keep_alive(None)
            .with_cancellation_token(stop.child_token());
        let handler = Booking { seen: seen.clone() };
        let service: StreamableHttpService<Booking, LocalSessionManager> =
            StreamableHttpService::new(move || Ok(handler.clone()), Arc::default(), config);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the MCP server");
        let addr = listener.local_addr().expect("addr");
        let served = seen.clone();
        let stopped = stop.clone();
        tokio::spawn(async move {
            loop {
                let (stream, _) = tokio::select! {
                    accepted = listener.accept() => match accepted {
                        Ok(a) => a,
                        Err(_) => continue,
                    },
                    () = stopped.cancelled() => return,
                };
                let service = service.clone();
                let seen = served.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(
                        move |req: http::Request<hyper::body::Incoming>| {
                            let mut service = service.clone();
                            let seen = seen.clone();
                            async move {
                                let (parts, body) = req.into_parts();
                                let bytes = body
                                    .collect()
                                    .await
                                    .map(|c| c.to_bytes())
                                    .unwrap_or_default();
                                count(&seen, &parts.method, &bytes);
                                let req = http::Request::from_parts(parts, Full::new(bytes));
                                service.call(req).await
                            }
                        },
                    );
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        McpServer { addr, seen, stop }
    }
}

/// Counts a request by its JSON-RPC method.
fn count(seen: &Seen, method: &http::Method, body: &Bytes) {
    let name = if method != http::Method::POST {
        method.as_str().to_owned()
    } else {
        match serde_json::from_slice::<serde_json::Value>(body) {
            Ok(serde_json::Value::Array(_)) => "batch".to_owned(),
            Ok(v) => match v.get("method").and_then(|m| m.as_str()) {
                Some(m) => m.to_owned(),
                None => "response".to_owned(),
            },
            Err(_) => "not-json".to_owned(),
        }
    };
    *lock(&seen.methods).entry(name).or_insert(0) += 1;
}

/// The route `mcp-tools` at `/mcp` in front of `server`, claiming `tools/call` with the key in
/// `_meta`, with extra `idempotency:` lines (indented already).
pub(crate) fn yaml(env: &Env, server: &McpServer, idempotency: &str) -> String {
    format!(
        "listen: 127.0.0.1:0
{store}upstreams:
  tools:
    url: http://{addr}
    connect_timeout: 1s
    timeout: 5s
routes:
  - name: mcp-tools
    path: /mcp
    upstream: tools
    jsonrpc:
      methods: [tools/call]
      retry_errors: [-32001]
    idempotency:
      key_from: [\"json:/params/_meta/idempotency-key\"]
{idempotency}",
        store = env.store_yaml(""),
        addr = server.addr,
    )
}

/// The SDK's client on `url` (the current revision: no sessions).
pub(crate) async fn mcp_client(url: &str) -> RunningService<RoleClient, ClientConfig> {
    mcp_client_with(url, None, &[]).await
}

/// The SDK's client on `url`, of protocol `version` when given, sending `headers` on every
/// request.
pub(crate) async fn mcp_client_with(
    url: &str,
    version: Option<ProtocolVersion>,
    headers: &[(&str, &str)],
) -> RunningService<RoleClient, ClientConfig> {
    let mut config = StreamableHttpClientTransportConfig::with_uri(url.to_owned());
    for (name, value) in headers {
        config.custom_headers.insert(
            http::HeaderName::from_bytes(name.as_bytes()).expect("header name"),
            http::HeaderValue::from_str(value).expect("header value"),
        );
    }
    let transport = StreamableHttpClientTransport::from_config(config);
    let mut client = ClientConfig::default();
    if let Some(version) = version {
        client = client.with_protocol_version(version);
    }
    client
        .serve(transport)
        .await
        .expect("the MCP client starts")
}

/// `book` with these arguments, the key in `_meta` (and more `_meta` members).
pub(crate) fn book(
    args: serde_json::Value,
    key: &str,
    meta: serde_json::Value,
) -> CallToolRequestParams {
    call_of("book", args, key, meta)
}

/// A call of `tool` with these arguments, the key in `_meta` (and more `_meta` members).
pub(crate) fn call_of(
    tool: &str,
    args: serde_json::Value,
    key: &str,
    meta: serde_json::Value,
) -> CallToolRequestParams {
    let mut params = CallToolRequestParams::new(tool.to_owned());
    if let serde_json::Value::Object(args) = args {
        params = params.with_arguments(args);
    }
    let mut object = serde_json::Map::new();
    object.insert("idempotency-key".into(), key.into());
    if let serde_json::Value::Object(more) = meta {
        object.extend(more);
    }
    params.meta = Some(RequestMetaObject(MetaObject(object)));
    params
}

/// The text of a tool result.
pub(crate) fn text(result: &CallToolResult) -> String {
    serde_json::to_value(&result.content)
        .ok()
        .and_then(|v| {
            v.get(0)
                .and_then(|c| c.get("text"))
                .and_then(|t| t.as_str())
                .map(str::to_owned)
        })
        .unwrap_or_default()
}

/// A raw `tools/call` of `book` with this `id` (as written), `arguments` and key, as the
/// current revision sends it (`_meta` carries the protocol), `accept` as given.
pub(crate) async fn raw_call(
    proxy: &TestProxy,
    id: &str,
    arguments: &str,
    key: &str,
    accept: &str,
) -> Reply {
    let body = format!(
        r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"book","arguments":{arguments},"_meta":{{"idempotency-key":"{key}","io.modelcontextprotocol/protocolVersion":"2026-07-28","io.modelcontextprotocol/clientInfo":{{"name":"raw","version":"1"}},"io.modelcontextprotocol/clientCapabilities":{{}}}}}}}}"#
    );
    raw_post(proxy, &body, accept).await
}

/// A raw `POST /mcp` of `body`.
pub(crate) async fn raw_post(proxy: &TestProxy, body: &str, accept: &str) -> Reply {
    // The current revision names the tool in a header too, as the body does.
    let tool = serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["params"]["name"].as_str().map(str::to_owned))
        .unwrap_or_else(|| "book".to_owned());
    let req = client()
        .post(proxy.url("/mcp"))
        .header("content-type", "application/json")
        .header("accept", accept)
        .header("mcp-protocol-version", "2026-07-28")
        .header("mcp-method", "tools/call")
        .header("mcp-name", tool)
        .body(body.to_owned());
    send(req).await
}

/// `idemproxy_jsonrpc_calls_total{route="mcp-tools",method,result}`.
pub(crate) fn calls(proxy: &TestProxy, method: &str, result: &str) -> u64 {
    proxy.metric(
        "idemproxy_jsonrpc_calls_total",
        &[
            ("route", "mcp-tools"),
            ("method", method),
            ("result", result),
        ],
    ) as u64
}
