//! Tool calls through a JSON-RPC route, on every store: the call, not the request, is what runs
//! once.

use std::time::Duration;

use harness::every_store;
use harness::relay::Relay;
use harness::{Backend, Env, client};
use rmcp::ServiceError;
use rmcp::model::ProtocolVersion;
use serde_json::json;

use crate::support::{
    McpServer, book, call_of, calls, mcp_client, mcp_client_with, raw_call, raw_post, text, yaml,
};

every_store!(
    a_lost_answer_is_replayed_to_the_retry_under_its_own_id,
    a_replay_carries_the_repeats_id_byte_for_byte,
    meta_and_argument_order_do_not_count_but_arguments_and_tool_do,
    a_call_in_flight_is_a_conflict_with_retry_after,
    an_event_stream_reaches_the_first_client_as_it_streams_and_replays_as_json,
    answers_that_are_not_the_result_release_the_key,
    an_expired_session_releases_and_other_traffic_passes_through,
    a_batch_or_a_body_that_is_not_json_is_refused_with_nothing_forwarded,
);

/// The JSON-RPC error code of a client error, if the server (or the proxy) answered one.
fn code(e: &ServiceError) -> Option<i32> {
    match e {
        ServiceError::McpError(data) => Some(data.code.0),
        _ => None,
    }
}

/// Calls `params` through `mcp` until it is not in flight any more (`-32091`), as an
/// application retries; at most 50 times.
async fn call_until_done(
    mcp: &rmcp::service::RunningService<rmcp::RoleClient, rmcp::model::ClientConfig>,
    params: rmcp::model::CallToolRequestParams,
) -> Result<rmcp::model::CallToolResult, ServiceError> {
    for _ in 0..50 {
        match mcp.call_tool(params.clone()).await {
            Err(e) if code(&e) == Some(-32091) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => return other,
        }
    }
    panic!("still in flight after 50 tries");
}

async fn a_lost_answer_is_replayed_to_the_retry_under_its_own_id(backend: Backend) {
    let env = Env::new(backend).await;
    let server = McpServer::start().await;
    let proxy = env.proxy(&yaml(&env, &server, "")).await;
    // The agent reaches the proxy through a wire the test can cut.
    let wire = Relay::start(proxy.addr).await;
    let agent = mcp_client(&format!("http://{}/mcp", wire.addr())).await;
    let args = json!({"reference": "R-lost", "seats": 2, "slow": true});
    let started = server.seen.started.notified();
    tokio::pin!(started);
    started.as_mut().enable();
    let first = tokio::spawn({
        let params = book(args.clone(), "key-lost", json!({}));
        async move { agent.call_tool(params).await }
    });
    tokio::time::timeout(Duration::from_secs(5), started)
        .await
        .expect("the tool started");
    // The answer is lost on its way back: the agent's connection breaks while the tool runs.
    wire.reset_all();
    let lost = tokio::time::timeout(Duration::from_secs(10), first)
        .await
        .expect("the first call ends")
        .expect("the task");
    assert!(lost.is_err(), "the first answer was lost: {lost:?}");
    // The application retries as applications do: a new call (a new id), the same key in
    // `_meta`, other `_meta` (a trace context) beside it.
    let retry_client = mcp_client(&proxy.url("/mcp")).await;
    let retry = book(
        args,
        "key-lost",
        json!({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}),
    );
    let result = call_until_done(&retry_client, retry)
        .await
        .expect("the retry gets the first result");
    assert_eq!(text(&result), "booked R-lost #1");
    assert_eq!(server.seen.bookings("R-lost"), 1, "the tool ran once");
    assert!(calls(&proxy, "tools/call", "claimed") >= 2);
}

async fn a_replay_carries_the_repeats_id_byte_for_byte(backend: Backend) {
    let env = Env::new(backend).await;
    let server = McpServer::start().await;
    let proxy = env.proxy(&yaml(&env, &server, "")).await;
    let args = r#"{"reference":"R-ids","seats":2}"#;
    let accept = "application/json, text/event-stream";
    let first = raw_call(&proxy, "1", args, "key-ids", accept).await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    assert_eq!(first.header("idempotent-replayed"), "");
    let result = first.json()["result"].clone();
    assert!(result.is_object(), "{:?}", first.body);
    for id in [r#""7""#, "7", "1.0", r#""a\u0062""#] {
        let again = raw_call(&proxy, id, args, "key-ids", accept).await;
        assert_eq!(again.status, 200, "{:?}", again.body);
        assert_eq!(again.header("idempotent-replayed"), "true");
        assert_eq!(again.header("content-type"), "application/json");
        assert_eq!(
            again.header("content-length"),
            again.body.len().to_string(),
            "Content-Length follows the body"
        );
        let expected_start = format!(r#"{{"jsonrpc":"2.0","id":{id},"result":"#);
        assert!(
            again.body.starts_with(expected_start.as_bytes()),
            "the repeat's own id as it wrote it: {:?}",
            again.body
        );
        assert_eq!(again.json()["result"], result, "the first result");
        assert!(again.header("mcp-session-id").is_empty());
    }
    // A repeat that takes only an event stream gets the replay as one event.
    let sse = raw_call(&proxy, "9", args, "key-ids", "text/event-stream").await;
    assert_eq!(sse.status, 200, "{:?}", sse.body);
    assert_eq!(sse.header("content-type"), "text/event-stream");
    let text_body = String::from_utf8_lossy(&sse.body).into_owned();
    let data = text_body
        .strip_prefix("event: message\ndata: ")
        .and_then(|b| b.strip_suffix("\n\n"))
        .unwrap_or_else(|| panic!("one event: {:?}", sse.body));
    let message: serde_json::Value = serde_json::from_str(data).expect("JSON in the event");
    assert_eq!(message["id"], 9);
    assert_eq!(message["result"], result);
    assert_eq!(server.seen.bookings("R-ids"), 1);
}

async fn meta_and_argument_order_do_not_count_but_arguments_and_tool_do(backend: Backend) {
    let env = Env::new(backend).await;
    let server = McpServer::start().await;
    let proxy = env.proxy(&yaml(&env, &server, "")).await;
    let agent = mcp_client(&proxy.url("/mcp")).await;
    let first = agent
        .call_tool(book(
            json!({"reference": "R-fp", "seats": 2}),
            "key-fp",
            json!({"progressToken": "p-1"}),
        ))
        .await
        .expect("booked");
    assert_eq!(text(&first), "booked R-fp #1");
    // Another progress token, a trace context: the same call.
    let again = agent
        .call_tool(book(
            json!({"reference": "R-fp", "seats": 2}),
            "key-fp",
            json!({"progressToken": "p-2", "traceparent": "00-1-2-01"}),
        ))
        .await
        .expect("replayed");
    assert_eq!(text(&again), "booked R-fp #1");
    // The arguments in another order, a number spelled otherwise: the same call.
    let accept = "application/json, text/event-stream";
    let reordered = raw_call(
        &proxy,
        "41",
        r#"{"seats":2.0,"reference":"R-fp"}"#,
        "key-fp",
        accept,
    )
    .await;
    assert_eq!(
        reordered.header("idempotent-replayed"),
        "true",
        "{:?}",
        reordered.body
    );
    // Other arguments, or another tool, under the same key: the mismatch answer.
    let other = agent
        .call_tool(book(
            json!({"reference": "R-fp", "seats": 3}),
            "key-fp",
            json!({}),
        ))
        .await
        .expect_err("another call under the key");
    assert_eq!(code(&other), Some(-32092), "{other:?}");
    let tool = agent
        .call_tool(call_of(
            "cancel",
            json!({"reference": "R-fp", "seats": 2}),
            "key-fp",
            json!({}),
        ))
        .await
        .expect_err("another tool under the key");
    assert_eq!(code(&tool), Some(-32092), "{tool:?}");
    let raw = raw_call(
        &proxy,
        r#""m""#,
        r#"{"reference":"R-fp","seats":4}"#,
        "key-fp",
        accept,
    )
    .await;
    assert_eq!(raw.status, 200);
    let doc = raw.json();
    assert_eq!(doc["id"], "m", "the proxy's answer carries the call's id");
    assert_eq!(doc["error"]["code"], -32092);
    assert_eq!(
        doc["error"]["data"]["type"],
        "urn:idemproxy:problem:idempotency-key-reused"
    );
    assert_eq!(doc["error"]["data"]["status"], 422);
    assert_eq!(server.seen.bookings("R-fp"), 1);
}

async fn a_call_in_flight_is_a_conflict_with_retry_after(backend: Backend) {
    let env = Env::new(backend).await;
    let server = McpServer::start().await;
    let proxy = env.proxy(&yaml(&env, &server, "")).await;
    let url = proxy.url("/mcp");
    let agent = mcp_client(&url).await;
    let args = json!({"reference": "R-busy", "slow": true});
    let started = server.seen.started.notified();
    tokio::pin!(started);
    started.as_mut().enable();
    let first = tokio::spawn({
        let params = book(args.clone(), "key-busy", json!({}));
        async move { agent.call_tool(params).await }
    });
    tokio::time::timeout(Duration::from_secs(5), started)
        .await
        .expect("the tool started");
    let accept = "application/json, text/event-stream";
    let busy = raw_call(
        &proxy,
        "5",
        r#"{"reference":"R-busy","slow":true}"#,
        "key-busy",
        accept,
    )
    .await;
    assert_eq!(busy.status, 200, "{:?}", busy.body);
    assert_eq!(busy.header("retry-after"), "1");
    let doc = busy.json();
    assert_eq!(doc["id"], 5);
    assert_eq!(doc["error"]["code"], -32091);
    assert_eq!(doc["error"]["message"], doc["error"]["data"]["title"]);
    assert_eq!(doc["error"]["data"]["retry_after"], 1);
    let first = first.await.expect("the task").expect("the first call");
    assert_eq!(text(&first), "booked R-busy #1");
    assert_eq!(server.seen.bookings("R-busy"), 1);
}

async fn an_event_stream_reaches_the_first_client_as_it_streams_and_replays_as_json(
    backend: Backend,
) {
    let env = Env::new(backend).await;
    let server = McpServer::start().await;
    let proxy = env.proxy(&yaml(&env, &server, "")).await;
    server
        .seen
        .hold
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let body = r#"{"jsonrpc":"2.0","id":"s-1","method":"tools/call","params":{"name":"book","arguments":{"reference":"R-sse","progress":true},"_meta":{"idempotency-key":"key-sse","progressToken":"pt","io.modelcontextprotocol/protocolVersion":"2026-07-28","io.modelcontextprotocol/clientInfo":{"name":"raw","version":"1"},"io.modelcontextprotocol/clientCapabilities":{}}}}"#;
    let mut resp = client()
        .post(proxy.url("/mcp"))
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .header("mcp-protocol-version", "2026-07-28")
        .header("mcp-method", "tools/call")
        .header("mcp-name", "book")
        .body(body)
        .send()
        .await
        .expect("the first call");
    assert_eq!(resp.status(), 200);
    assert!(
        resp.headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream")),
        "{:?}",
        resp.headers()
    );
    // The first progress event arrives while the tool is held: nothing waits for the end.
    let mut seen = String::new();
    while !seen.contains("notifications/progress") {
        let chunk = tokio::time::timeout(Duration::from_secs(5), resp.chunk())
            .await
            .expect("an event before the tool goes on")
            .expect("the stream")
            .expect("a chunk before the end");
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(
        !seen.contains("booked"),
        "the result is not there yet: {seen}"
    );
    // A permit, not a wake-up: the tool may not be waiting yet when the event arrives.
    server.seen.release.notify_one();
    while let Some(chunk) = tokio::time::timeout(Duration::from_secs(5), resp.chunk())
        .await
        .expect("the rest of the stream")
        .expect("the stream")
    {
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(seen.contains("booked R-sse #1"), "{seen}");
    assert_eq!(seen.matches("notifications/progress").count(), 3, "{seen}");
    // The retry: one JSON response around its own id.
    let again = raw_call(
        &proxy,
        "2",
        r#"{"reference":"R-sse","progress":true}"#,
        "key-sse",
        "application/json, text/event-stream",
    )
    .await;
    assert_eq!(
        again.header("idempotent-replayed"),
        "true",
        "{:?}",
        again.body
    );
    assert_eq!(again.header("content-type"), "application/json");
    let doc = again.json();
    assert_eq!(doc["id"], 2);
    assert_eq!(doc["result"]["content"][0]["text"], "booked R-sse #1");
    assert_eq!(server.seen.bookings("R-sse"), 1);
}

async fn answers_that_are_not_the_result_release_the_key(backend: Backend) {
    let env = Env::new(backend).await;
    let server = McpServer::start().await;
    let proxy = env.proxy(&yaml(&env, &server, "")).await;
    let agent = mcp_client(&proxy.url("/mcp")).await;
    // A result that asks for input is not the call's result (the call goes on in a later
    // request): released each time.
    let ask = r#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"ask","arguments":{"reference":"R-ask"},"_meta":{"idempotency-key":"key-ask","io.modelcontextprotocol/protocolVersion":"2026-07-28","io.modelcontextprotocol/clientInfo":{"name":"raw","version":"1"},"io.modelcontextprotocol/clientCapabilities":{}}}}"#;
    for _ in 0..2 {
        let asked = raw_post(&proxy, ask, "application/json, text/event-stream").await;
        assert_eq!(asked.status, 200, "{:?}", asked.body);
        assert_eq!(asked.header("idempotent-replayed"), "");
        assert_eq!(
            asked.json()["result"]["resultType"],
            "input_required",
            "{:?}",
            asked.body
        );
    }
    // An error code in retry_errors: released each time.
    for _ in 0..2 {
        let busy = agent
            .call_tool(call_of("busy", json!({}), "key-retry", json!({})))
            .await
            .expect_err("the tool's error");
        assert_eq!(code(&busy), Some(-32001));
    }
    assert_eq!(
        server.seen.method("tools/call"),
        4,
        "every released call reached the server"
    );
}

async fn an_expired_session_releases_and_other_traffic_passes_through(backend: Backend) {
    let env = Env::new(backend).await;
    let server = McpServer::start_with(true).await;
    let proxy = env.proxy(&yaml(&env, &server, "")).await;
    let url = proxy.url("/mcp");
    // A session the server does not know (expired): 404, released.
    let body = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"book","arguments":{"reference":"R-session"},"_meta":{"idempotency-key":"key-session"}}}"#;
    let expired = harness::send(
        client()
            .post(&url)
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .header("mcp-protocol-version", "2025-06-18")
            .header("mcp-session-id", "expired-session")
            .body(body),
    )
    .await;
    assert_eq!(expired.status, 404, "{:?}", expired.body);
    assert_eq!(server.seen.bookings("R-session"), 0);
    // The client initializes again, and the call runs.
    let inits = server.seen.method("initialize");
    let agent = mcp_client_with(&url, Some(ProtocolVersion::V_2025_06_18), &[]).await;
    let booked = agent
        .call_tool(book(
            json!({"reference": "R-session"}),
            "key-session",
            json!({}),
        ))
        .await
        .expect("runs after the session's 404");
    assert_eq!(text(&booked), "booked R-session #1");
    // initialize, its notification and tools/list pass through, counted each time.
    let second = mcp_client_with(&url, Some(ProtocolVersion::V_2025_06_18), &[]).await;
    assert_eq!(server.seen.method("initialize"), inits + 2);
    let lists = server.seen.method("tools/list");
    second.list_all_tools().await.expect("tools/list");
    second.list_all_tools().await.expect("tools/list");
    assert_eq!(server.seen.method("tools/list"), lists + 2);
    assert_eq!(calls(&proxy, "tools/list", "passthrough"), 2);
    assert_eq!(calls(&proxy, "initialize", "passthrough"), 2);
    assert!(server.seen.method("notifications/initialized") >= 2);
    assert!(calls(&proxy, "notifications/initialized", "notification") >= 2);
}

async fn a_batch_or_a_body_that_is_not_json_is_refused_with_nothing_forwarded(backend: Backend) {
    let env = Env::new(backend).await;
    let server = McpServer::start().await;
    let proxy = env.proxy(&yaml(&env, &server, "")).await;
    let accept = "application/json, text/event-stream";
    let batch = raw_post(
        &proxy,
        r#"[{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"book","arguments":{"reference":"R-batch"},"_meta":{"idempotency-key":"k"}}}]"#,
        accept,
    )
    .await;
    assert_eq!(batch.status, 400);
    let doc = batch.json();
    assert_eq!(doc["error"]["code"], -32600);
    assert!(doc["id"].is_null());
    let garbage = raw_post(&proxy, "{not json", accept).await;
    assert_eq!(garbage.status, 400);
    assert_eq!(garbage.json()["error"]["code"], -32700);
    assert!(garbage.json()["id"].is_null());
    assert_eq!(server.seen.method("batch"), 0, "nothing forwarded");
    assert_eq!(server.seen.method("not-json"), 0, "nothing forwarded");
    assert_eq!(calls(&proxy, "", "invalid"), 2);
    // A claimed call without its key: the proxy's -32090, with the call's id.
    let keyless = raw_post(
        &proxy,
        r#"{"jsonrpc":"2.0","id":"nokey","method":"tools/call","params":{"name":"book","arguments":{"reference":"R-nokey"}}}"#,
        accept,
    )
    .await;
    assert_eq!(keyless.status, 200);
    assert_eq!(keyless.json()["id"], "nokey");
    assert_eq!(keyless.json()["error"]["code"], -32090);
    assert_eq!(server.seen.bookings("R-nokey"), 0);
}

/// MCP's OAuth tokens are short-lived: scoped by the stable identity header an auth layer sets,
/// a retry after a token refresh replays, and another caller's same key runs on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scope_by_a_stable_identity_header_survives_a_token_refresh() {
    let env = Env::new(Backend::Memory).await;
    let server = McpServer::start().await;
    let proxy = env
        .proxy(&yaml(&env, &server, "      scope: [X-User-Id]\n"))
        .await;
    let url = proxy.url("/mcp");
    let before = mcp_client_with(
        &url,
        None,
        &[("authorization", "Bearer token-1"), ("x-user-id", "alice")],
    )
    .await;
    let args = json!({"reference": "R-scope"});
    let first = before
        .call_tool(book(args.clone(), "key-scope", json!({})))
        .await
        .expect("booked");
    let refreshed = mcp_client_with(
        &url,
        None,
        &[("authorization", "Bearer token-2"), ("x-user-id", "alice")],
    )
    .await;
    let again = refreshed
        .call_tool(book(args.clone(), "key-scope", json!({})))
        .await
        .expect("replayed");
    assert_eq!(text(&again), text(&first));
    assert_eq!(
        server.seen.bookings("R-scope"),
        1,
        "a token refresh is the same caller"
    );
    let other = mcp_client_with(
        &url,
        None,
        &[("authorization", "Bearer token-3"), ("x-user-id", "bob")],
    )
    .await;
    let theirs = other
        .call_tool(book(args, "key-scope", json!({})))
        .await
        .expect("booked for another caller");
    assert_eq!(text(&theirs), "booked R-scope #2");
}

/// Observe mode forwards every call and counts what enforce would have answered; what it saves
/// is the call's result, which enforce replays once the route is switched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_mode_forwards_every_call_and_counts_what_enforce_would_do() {
    let env = Env::new(Backend::Memory).await;
    let server = McpServer::start().await;
    let proxy = env
        .proxy(&yaml(&env, &server, "      mode: observe\n"))
        .await;
    let accept = "application/json, text/event-stream";
    let args = r#"{"reference":"R-observe"}"#;
    let first = raw_call(&proxy, "1", args, "key-observe", accept).await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    let again = raw_call(&proxy, "2", args, "key-observe", accept).await;
    assert_eq!(
        again.header("idempotent-replayed"),
        "",
        "observe replays nothing"
    );
    assert_eq!(again.json()["id"], 2);
    assert_eq!(server.seen.bookings("R-observe"), 2, "every call forwarded");
    let keyless = raw_post(
        &proxy,
        r#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"book","arguments":{"reference":"R-observe-nokey"},"_meta":{"io.modelcontextprotocol/protocolVersion":"2026-07-28","io.modelcontextprotocol/clientInfo":{"name":"raw","version":"1"},"io.modelcontextprotocol/clientCapabilities":{}}}}"#,
        accept,
    )
    .await;
    assert_eq!(keyless.status, 200, "{:?}", keyless.body);
    assert!(
        keyless.json()["result"].is_object(),
        "forwarded: {:?}",
        keyless.body
    );
    assert_eq!(server.seen.bookings("R-observe-nokey"), 1);
    let would = |w: &str| {
        proxy.metric(
            "idemproxy_observed_total",
            &[("route", "mcp-tools"), ("would", w)],
        ) as u64
    };
    assert!(
        harness::eventually(Duration::from_secs(5), || would("replay") == 1).await,
        "the repeat would have been replayed"
    );
    assert_eq!(
        would("invalid_key"),
        1,
        "the keyless call would have been refused"
    );
}

/// The server's answer is cut after the tool ran: under `keep` (the default) the first client
/// gets the proxy's `-32095`, and every retry gets it again around its own id; the tool never
/// runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_cut_after_the_tool_ran_keeps_its_unknown_outcome() {
    let env = Env::new(Backend::Memory).await;
    let server = McpServer::start().await;
    let wire = Relay::start(server.addr).await;
    let config =
        yaml(&env, &server, "").replace(&server.addr.to_string(), &wire.addr().to_string());
    let proxy = env.proxy(&config).await;
    let started = server.seen.started.notified();
    tokio::pin!(started);
    started.as_mut().enable();
    let accept = "application/json, text/event-stream";
    let args = r#"{"reference":"R-cut","slow":true}"#;
    let first = tokio::spawn({
        let url = proxy.url("/mcp");
        async move {
            let body = format!(
                r#"{{"jsonrpc":"2.0","id":"first","method":"tools/call","params":{{"name":"book","arguments":{args},"_meta":{{"idempotency-key":"key-cut","io.modelcontextprotocol/protocolVersion":"2026-07-28","io.modelcontextprotocol/clientInfo":{{"name":"raw","version":"1"}},"io.modelcontextprotocol/clientCapabilities":{{}}}}}}}}"#
            );
            harness::send(
                client()
                    .post(url)
                    .header("content-type", "application/json")
                    .header("accept", accept)
                    .header("mcp-protocol-version", "2026-07-28")
                    .header("mcp-method", "tools/call")
                    .header("mcp-name", "book")
                    .body(body),
            )
            .await
        }
    });
    tokio::time::timeout(Duration::from_secs(5), started)
        .await
        .expect("the tool started");
    wire.reset_all();
    let first = first.await.expect("the first call");
    assert_eq!(first.status, 200, "{:?}", first.body);
    assert_eq!(first.json()["id"], "first");
    assert_eq!(first.json()["error"]["code"], -32095, "{:?}", first.body);
    let again = raw_call(&proxy, "7", args, "key-cut", accept).await;
    assert_eq!(again.status, 200, "{:?}", again.body);
    assert_eq!(again.header("idempotent-replayed"), "true");
    assert_eq!(again.json()["id"], 7);
    assert_eq!(again.json()["error"]["code"], -32095, "{:?}", again.body);
    assert_eq!(server.seen.bookings("R-cut"), 1, "never run twice");
}

/// An answer over `max_response_body` reaches its client whole; a repeat gets `-32096`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_too_large_to_save_reaches_its_client_and_repeats_get_32096() {
    let env = Env::new(Backend::Memory).await;
    let server = McpServer::start().await;
    let proxy = env
        .proxy(&yaml(&env, &server, "      max_response_body: 40\n"))
        .await;
    let accept = "application/json, text/event-stream";
    let args = r#"{"reference":"R-large"}"#;
    let first = raw_call(&proxy, "1", args, "key-large", accept).await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    assert_eq!(
        first.json()["result"]["content"][0]["text"],
        "booked R-large #1",
        "whole: {:?}",
        first.body
    );
    let again = raw_call(&proxy, "2", args, "key-large", accept).await;
    assert_eq!(again.status, 200);
    assert_eq!(again.json()["id"], 2);
    assert_eq!(again.json()["error"]["code"], -32096, "{:?}", again.body);
    assert_eq!(server.seen.bookings("R-large"), 1);
}

/// The store down: a claimed call is the JSON-RPC error `-32094` with the call's id and
/// `Retry-After`, nothing forwarded; other traffic still passes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_is_32094_with_retry_after_and_nothing_forwarded() {
    let mut env = Env::new(Backend::Redis).await;
    let server = McpServer::start().await;
    let proxy = env.proxy(&yaml(&env, &server, "")).await;
    env.make_store_unreachable();
    let accept = "application/json, text/event-stream";
    let down = raw_call(
        &proxy,
        r#""s""#,
        r#"{"reference":"R-down"}"#,
        "key-down",
        accept,
    )
    .await;
    assert_eq!(down.status, 200, "{:?}", down.body);
    assert_eq!(down.header("retry-after"), "1");
    let doc = down.json();
    assert_eq!(doc["id"], "s");
    assert_eq!(doc["error"]["code"], -32094, "{:?}", down.body);
    assert_eq!(doc["error"]["data"]["status"], 503);
    assert_eq!(server.seen.bookings("R-down"), 0, "nothing forwarded");
}

/// Observe mode streams an event-stream answer as enforce does, saves the response to the call,
/// and a reload to enforce replays it around the repeat's own id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_mode_streams_and_its_records_replay_once_enforced() {
    let env = Env::new(Backend::Memory).await;
    let server = McpServer::start().await;
    let observed = yaml(&env, &server, "      mode: observe\n");
    let proxy = env.proxy(&observed).await;
    server
        .seen
        .hold
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let body = r#"{"jsonrpc":"2.0","id":"o-1","method":"tools/call","params":{"name":"book","arguments":{"reference":"R-obs-sse","progress":true},"_meta":{"idempotency-key":"key-obs-sse","progressToken":"pt","io.modelcontextprotocol/protocolVersion":"2026-07-28","io.modelcontextprotocol/clientInfo":{"name":"raw","version":"1"},"io.modelcontextprotocol/clientCapabilities":{}}}}"#;
    let mut resp = client()
        .post(proxy.url("/mcp"))
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .header("mcp-protocol-version", "2026-07-28")
        .header("mcp-method", "tools/call")
        .header("mcp-name", "book")
        .body(body)
        .send()
        .await
        .expect("the first call");
    let mut seen = String::new();
    while !seen.contains("notifications/progress") {
        let chunk = tokio::time::timeout(Duration::from_secs(5), resp.chunk())
            .await
            .expect("an event before the tool goes on")
            .expect("the stream")
            .expect("a chunk before the end");
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    // A permit, not a wake-up: the tool may not be waiting yet when the event arrives.
    server.seen.release.notify_one();
    while let Some(chunk) = tokio::time::timeout(Duration::from_secs(5), resp.chunk())
        .await
        .expect("the rest of the stream")
        .expect("the stream")
    {
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(seen.contains("booked R-obs-sse #1"), "{seen}");
    let enforced = observed.replace("      mode: observe\n", "");
    let config = idemproxy::config::Config::from_yaml(&enforced).expect("valid");
    assert!(matches!(
        proxy.proxy.reload(config),
        idemproxy::proxy::Reloaded::Applied(_)
    ));
    let accept = "application/json, text/event-stream";
    let mut replayed = None;
    for _ in 0..50 {
        let again = raw_call(
            &proxy,
            "9",
            r#"{"reference":"R-obs-sse","progress":true}"#,
            "key-obs-sse",
            accept,
        )
        .await;
        if again.header("idempotent-replayed") == "true" {
            replayed = Some(again);
            break;
        }
        // The shadow claim saves after the answer: a repeat meanwhile is in flight.
        assert_eq!(again.json()["error"]["code"], -32091, "{:?}", again.body);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let again = replayed.expect("replayed once the save landed");
    assert_eq!(again.json()["id"], 9);
    assert_eq!(
        again.json()["result"]["content"][0]["text"],
        "booked R-obs-sse #1"
    );
    assert_eq!(server.seen.bookings("R-obs-sse"), 1);
}
