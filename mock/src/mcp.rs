//! `POST /mcp`: a minimal MCP server (Streamable HTTP, JSON-RPC 2.0, JSON answers only) whose
//! one tool, `book`, makes a booking as `POST /bookings` does, so the demo can show a tool call
//! made once however often an agent retries it. Hand-written rather than built on an MCP SDK:
//! the mock stays a small crate with no server of its own.
//!
//! | message | answer |
//! | --- | --- |
//! | `initialize` | `200`, the server's capabilities (tools) and the client's protocol version |
//! | `tools/list` | `200`, the `book` tool |
//! | `tools/call` of `book` | `200`, `booked bk_N` (a new booking, counted in the stats) |
//! | `tools/call` of `echo` | `200`, its arguments as text: the work of the echo routes (the load bench's JSON-RPC rows) |
//! | `ping` | `200`, an empty result |
//! | a notification or a response (no `id`, or no `method`) | `202`, no body |
//! | another method or tool | `200`, a JSON-RPC error (`-32601`, `-32602`) |
//! | not JSON | `400`, `-32700` |

use bytes::Bytes;
use http::StatusCode;
use serde_json::{Value, json};

use crate::reply::Reply;
use crate::state::{MockUpstream, X_BOOKING_ID};

/// The answer to one `POST /mcp`.
pub(crate) fn answer(state: &MockUpstream, body: &Bytes) -> Reply {
    let Ok(message) = serde_json::from_slice::<Value>(body) else {
        let error = json!({"jsonrpc": "2.0", "id": null, "error": {"code": -32700, "message": "Parse error"}});
        return Reply::json(StatusCode::BAD_REQUEST, &error);
    };
    let (Some(id), Some(method)) = (
        message.get("id").cloned(),
        message.get("method").and_then(Value::as_str),
    ) else {
        return Reply {
            status: StatusCode::ACCEPTED,
            headers: http::HeaderMap::new(),
            body: crate::body::MockBody::full(Bytes::new()),
        };
    };
    let params = message.get("params").cloned().unwrap_or(Value::Null);
    let outcome = match method {
        "initialize" => Ok(json!({
            "protocolVersion": params.get("protocolVersion").cloned().unwrap_or(json!("2025-06-18")),
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "idemproxy-mock", "version": env!("CARGO_PKG_VERSION")},
        })),
        "ping" => Ok(json!({})),
        "tools/list" => Ok(json!({"tools": [{
            "name": "book",
            "description": "Books a seat; the booking is made once per call that reaches the service",
            "inputSchema": {
                "type": "object",
                "properties": {"seat": {"type": "string"}, "reference": {"type": "string"}},
                "required": ["seat"],
            },
        }]})),
        "tools/call" => call(state, &params),
        _ => Err((-32601, format!("method not found: {method}"))),
    };
    let message = match outcome {
        Ok(result) => json!({"jsonrpc": "2.0", "id": id, "result": result}),
        Err((code, text)) => {
            json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": text}})
        }
    };
    Reply::json(StatusCode::OK, &message)
}

/// `tools/call`: `book` makes a booking from its arguments.
fn call(state: &MockUpstream, params: &Value) -> Result<Value, (i64, String)> {
    let name = params.get("name").and_then(Value::as_str).unwrap_or("");
    let arguments = params.get("arguments").cloned().unwrap_or(json!({}));
    if name == "echo" {
        return Ok(json!({"content": [{"type": "text", "text": arguments.to_string()}]}));
    }
    if name != "book" {
        return Err((-32602, format!("unknown tool: {name}")));
    }
    let reply = state.create_booking(&Bytes::from(arguments.to_string()), None);
    let id = reply
        .headers
        .get(X_BOOKING_ID)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    Ok(json!({
        "content": [{"type": "text", "text": format!("booked {id}")}],
        "structuredContent": {"id": id, "request": arguments},
        "isError": false,
    }))
}
