//! JSON-RPC calls (SPEC §4.10): a request body read as one JSON-RPC 2.0 message, the response
//! to a call found in what the server answered, and the proxy's own answers rendered as
//! JSON-RPC errors.
//!
//! **Why the call, not the request.** Agents retry a tool call as a new call: the MCP SDKs give
//! every attempt a new `id`. A byte fingerprint would call the retry another request, and a
//! byte replay would answer it with the first attempt's `id`, which its client drops. So on a
//! `jsonrpc` route the fingerprint is the call's `method` and its `params` without `_meta`
//! ([`Call::fingerprint_bytes`]), what is saved is the response's `result` or `error` member
//! alone ([`Found::member`]), and a replay is rebuilt around the repeat's own `id`, byte for
//! byte as it wrote it ([`replay_body`]).
//!
//! This module imports no store, upstream or proxy: it reads bytes and writes bytes, and the
//! proxy's shared flow claims, leases, saves and replays.
//!
//! # Example
//!
//! ```
//! use idemproxy::jsonrpc::{Message, parse};
//! let body = br#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"book"}}"#;
//! let Ok(Message::Call(call)) = parse(body) else { panic!("a call") };
//! assert_eq!(call.method(), "tools/call");
//! assert_eq!(call.id(), "7");
//! ```

mod sse;

use bytes::{BufMut, Bytes, BytesMut};
use serde::{Deserialize, Deserializer};
use serde_json::value::RawValue;

use crate::key_from::{canonical_number, canonical_raw};
use crate::problem::Problem;

pub use sse::{EventStream, SseError};

/// JSON-RPC's "parse error": the body is not JSON.
pub const PARSE_ERROR: i64 = -32700;
/// JSON-RPC's "invalid request": a batch, or an object that is not a JSON-RPC 2.0 message.
pub const INVALID_REQUEST: i64 = -32600;
/// The proxy's own failure inside (JSON-RPC's "internal error").
pub const INTERNAL_ERROR: i64 = -32603;
/// An unknown outcome, the upstream failed (the proxy's `-32095`).
pub const OUTCOME_UNKNOWN: i64 = -32095;

/// What a `POST` body on a `jsonrpc` route is.
#[derive(Debug)]
pub enum Message {
    /// A request with an `id`: claimed when its method is listed.
    Call(Call),
    /// A request without an `id`: it has no answer to save.
    Notification { method: String },
    /// A response (`result` or `error`, no `method`): a client answering the server's request.
    Response,
}

/// Why a body is not a JSON-RPC message: `400`, with this code and `"id": null`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid {
    /// [`PARSE_ERROR`] or [`INVALID_REQUEST`].
    pub code: i64,
    /// What is wrong, in words.
    pub detail: String,
}

/// A JSON-RPC request with an `id`, as the proxy keeps it through the exchange.
#[derive(Debug, Clone)]
pub struct Call {
    /// The `id` exactly as the client wrote it: a replay or an error carries it back.
    id: Box<RawValue>,
    method: String,
    /// The canonical form of `params` without `_meta` (`null` when there are none).
    params: Vec<u8>,
    /// The client accepts `application/json` (else a replay is a one-event event stream).
    json: bool,
}

impl Call {
    /// The `id` as the client wrote it.
    pub fn id(&self) -> &str {
        self.id.get()
    }

    pub fn method(&self) -> &str {
        &self.method
    }

    /// What makes two calls "the same": the method and the canonical `params` without
    /// `_meta`, tagged and length-prefixed so no bytes move from one to the other.
    pub fn fingerprint_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.method.len() + self.params.len() + 16);
        out.extend_from_slice(&(self.method.len() as u64).to_be_bytes());
        out.extend_from_slice(self.method.as_bytes());
        out.extend_from_slice(&(self.params.len() as u64).to_be_bytes());
        out.extend_from_slice(&self.params);
        out
    }

    /// Records what the client's `Accept` header allows: a replay is `application/json` when
    /// it takes it (or says nothing), else a one-event `text/event-stream`.
    pub fn accept(&mut self, accept: Option<&[u8]>) {
        self.json = accept.is_none_or(accepts_json);
    }

    /// Whether a replay to this call is `application/json`.
    pub fn wants_json(&self) -> bool {
        self.json
    }
}

/// Whether an `Accept` value takes `application/json`.
fn accepts_json(accept: &[u8]) -> bool {
    accept.split(|&b| b == b',').any(|range| {
        let mut parts = range.split(|&b| b == b';');
        let kind = parts.next().unwrap_or_default().trim_ascii();
        let refused = parts.any(|p| {
            // `q=0`, `q = 0.00`: spaces anywhere, up to three zero decimals.
            let p: Vec<u8> = p.iter().copied().filter(|&b| b != b' ').collect();
            let p = p.trim_ascii();
            matches!(
                p,
                b"q=0"
                    | b"q=0.0"
                    | b"q=0.00"
                    | b"q=0.000"
                    | b"Q=0"
                    | b"Q=0.0"
                    | b"Q=0.00"
                    | b"Q=0.000"
            )
        });
        !refused
            && (kind.eq_ignore_ascii_case(b"application/json")
                || kind.eq_ignore_ascii_case(b"application/*")
                || kind == b"*/*")
    })
}

/// The members of a JSON-RPC message this module reads, borrowed from the text as written
/// (every other member is skipped unread). Read in one pass, without a map of every member.
#[derive(Deserialize, Default)]
struct Members<'a> {
    #[serde(borrow, default, deserialize_with = "raw")]
    jsonrpc: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "raw")]
    method: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "raw")]
    id: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "raw")]
    params: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "raw")]
    result: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "raw")]
    error: Option<&'a RawValue>,
}

/// The members of a result or an error object this module reads.
#[derive(Deserialize, Default)]
struct Fields<'a> {
    #[serde(borrow, default, deserialize_with = "raw", rename = "resultType")]
    result_type: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "raw")]
    code: Option<&'a RawValue>,
}

/// A member present, whatever its value — `null` included (an `"id": null` is an id, and a
/// wrong one, not a missing one).
fn raw<'de, D: Deserializer<'de>>(d: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&RawValue>::deserialize(d).map(Some)
}

/// The members of `text` if it is one JSON object (a derived struct would also take an array,
/// member by member: the first byte decides first). A member that appears twice is an error.
fn object_of<'a, T: Deserialize<'a>>(text: &'a [u8]) -> Result<T, Option<serde_json::Error>> {
    if text.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(None);
    }
    serde_json::from_slice(text).map_err(Some)
}

/// Reads a body as one JSON-RPC 2.0 message.
pub fn parse(body: &[u8]) -> Result<Message, Invalid> {
    let invalid = |detail: &str| Invalid {
        code: INVALID_REQUEST,
        detail: detail.to_owned(),
    };
    // One parse on the way every call takes; a body that is not an object is looked at again
    // only to tell "not JSON" from "not a JSON-RPC object".
    let members: Members<'_> = match object_of(body) {
        Ok(members) => members,
        Err(e) => return Err(not_an_object(body, e.as_ref())),
    };
    if members.jsonrpc.map(|v| v.get().trim()) != Some("\"2.0\"") {
        let version: Option<String> = members
            .jsonrpc
            .and_then(|v| serde_json::from_str(v.get()).ok());
        if version.as_deref() != Some("2.0") {
            return Err(invalid("the member \"jsonrpc\" is not \"2.0\""));
        }
    }
    let Some(method) = members.method else {
        if members.result.is_some() || members.error.is_some() {
            return Ok(Message::Response);
        }
        return Err(invalid(
            "the object has neither \"method\" nor \"result\" or \"error\"",
        ));
    };
    let method: String = serde_json::from_str(method.get())
        .map_err(|_| invalid("the member \"method\" is not a string"))?;
    if let Some(params) = members.params
        && !matches!(params.get().as_bytes().first(), Some(b'{' | b'['))
    {
        return Err(invalid(
            "the member \"params\" is not an object or an array",
        ));
    }
    let Some(id) = members.id else {
        return Ok(Message::Notification { method });
    };
    if !matches!(id.get().as_bytes().first(), Some(b'"' | b'-' | b'0'..=b'9')) {
        return Err(invalid("the member \"id\" is not a string or a number"));
    }
    let params = match members.params {
        None => b"null".to_vec(),
        Some(raw) => {
            let mut out = Vec::with_capacity(raw.get().len());
            canonical_raw(raw, Some("_meta"), &mut out)
                .map_err(|e| invalid(&format!("the member \"params\" cannot be read: {e}")))?;
            out
        }
    };
    Ok(Message::Call(Call {
        id: id.to_owned(),
        method,
        params,
        json: true,
    }))
}

/// Why a body that is not a JSON object was refused: `-32700` when it is not JSON at all,
/// `-32600` for a batch or any other JSON value.
fn not_an_object(body: &[u8], e: Option<&serde_json::Error>) -> Invalid {
    if let Err(e) = serde_json::from_slice::<serde::de::IgnoredAny>(body) {
        return Invalid {
            code: PARSE_ERROR,
            detail: format!("the body is not JSON: {e}"),
        };
    }
    let first = body.iter().find(|b| !b.is_ascii_whitespace()).copied();
    let detail = match first {
        Some(b'[') => {
            "a batch (a JSON array) is not accepted on this route: send one call a request".into()
        }
        Some(b'{') => match e {
            Some(e) => format!("the body is not a JSON-RPC 2.0 object: {e}"),
            None => "the body is not a JSON-RPC 2.0 object".into(),
        },
        _ => "the body is not a JSON-RPC 2.0 object".into(),
    };
    Invalid {
        code: INVALID_REQUEST,
        detail,
    }
}

/// The response to a call, found in what the server answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// `{"result":…}` or `{"error":…}`: the member as the server wrote it, in an object of its
    /// own, which is what is saved.
    pub member: Bytes,
    /// The `error.code`, for an error.
    pub error_code: Option<i64>,
    /// A result whose `resultType` is `input_required`: the call goes on in a later request.
    pub input_required: bool,
}

impl Found {
    /// Whether the claim is released rather than saved: an error code the route lists in
    /// `retry_errors`, or a result that asks for input.
    pub fn releases(&self, retry_errors: &[i64]) -> bool {
        self.input_required || self.error_code.is_some_and(|c| retry_errors.contains(&c))
    }
}

/// The response to `call` in one JSON text (an `application/json` body, or one event's data):
/// an object (or an array's element) with `result` or `error`, no `method`, and an `id` equal
/// to the call's as a JSON value. `None` when there is none.
pub fn find_response(call: &Call, text: &[u8]) -> Option<Found> {
    let first = text.iter().find(|b| !b.is_ascii_whitespace()).copied();
    if first == Some(b'[') {
        let items: Vec<&RawValue> = serde_json::from_slice(text).ok()?;
        return items
            .iter()
            .find_map(|item| find_response(call, item.get().as_bytes()));
    }
    let members: Members<'_> = object_of(text).ok()?;
    if members.method.is_some() {
        return None;
    }
    let id = members.id?;
    if !same_id(call.id.get(), id.get()) {
        return None;
    }
    let (name, value) = match (members.result, members.error) {
        (Some(result), None) => ("result", result),
        (None, Some(error)) => ("error", error),
        _ => return None,
    };
    let mut member = BytesMut::with_capacity(value.get().len() + name.len() + 5);
    member.put_slice(b"{\"");
    member.put_slice(name.as_bytes());
    member.put_slice(b"\":");
    member.put_slice(value.get().as_bytes());
    member.put_u8(b'}');
    let fields: Fields<'_> = object_of(value.get().as_bytes()).unwrap_or_default();
    let error_code = (name == "error")
        .then_some(fields.code)
        .flatten()
        .and_then(|c| serde_json::from_str::<i64>(c.get()).ok());
    let input_required = name == "result"
        && fields
            .result_type
            .and_then(|t| serde_json::from_str::<String>(t.get()).ok())
            .is_some_and(|t| t == "input_required");
    Some(Found {
        member: member.freeze(),
        error_code,
        input_required,
    })
}

/// Two ids equal as JSON values: strings by their text, numbers by their value (`1` = `1.0`);
/// a string never equals a number.
fn same_id(a: &str, b: &str) -> bool {
    let (a, b) = (a.trim(), b.trim());
    match (a.as_bytes().first(), b.as_bytes().first()) {
        (Some(b'"'), Some(b'"')) => {
            let a: Option<String> = serde_json::from_str(a).ok();
            let b: Option<String> = serde_json::from_str(b).ok();
            a.is_some() && a == b
        }
        (Some(b'-' | b'0'..=b'9'), Some(b'-' | b'0'..=b'9')) => {
            let (a, b) = (canonical_number(a), canonical_number(b));
            a.is_some() && a == b
        }
        _ => false,
    }
}

/// The envelope around a saved member for a call: `{"jsonrpc":"2.0","id":<its id>,…member}`.
/// A member that is not a one-member object (a record saved before the route was a `jsonrpc`
/// one) is `None`.
pub fn replay_body(call: &Call, member: &[u8]) -> Option<Bytes> {
    let inner = member.strip_prefix(b"{")?;
    if !(inner.starts_with(b"\"result\":") || inner.starts_with(b"\"error\":")) {
        return None;
    }
    let mut out = BytesMut::with_capacity(member.len() + call.id().len() + 24);
    out.put_slice(b"{\"jsonrpc\":\"2.0\",\"id\":");
    out.put_slice(call.id().as_bytes());
    out.put_u8(b',');
    out.put_slice(inner);
    Some(out.freeze())
}

/// A JSON-RPC message as a one-event `text/event-stream` body.
pub fn as_event(message: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(message.len() + 24);
    out.put_slice(b"event: message\ndata: ");
    out.put_slice(message);
    out.put_slice(b"\n\n");
    out.freeze()
}

/// The error code of a problem of the proxy's (by its `type` slug), per the table of SPEC
/// §4.10; [`INTERNAL_ERROR`] for any other.
pub fn code_of(slug: &str) -> i64 {
    match slug {
        "missing-idempotency-key"
        | "invalid-idempotency-key"
        | "unreadable-key-part"
        | "hop-by-hop-conflict" => -32090,
        "request-in-progress" => -32091,
        "idempotency-key-reused" => -32092,
        "request-too-large" => -32093,
        "store-unavailable" | "overloaded" => -32094,
        "upstream-unavailable"
        | "upstream-timeout"
        | "upstream-failed"
        | "outcome-unknown"
        | "result-not-kept" => OUTCOME_UNKNOWN,
        "response-not-replayable" => -32096,
        "bad-request-body" | "request-body-timeout" => INVALID_REQUEST,
        _ => INTERNAL_ERROR,
    }
}

/// The `error` member of the proxy's own answer to a call: the problem's code, its title as
/// the message, the whole problem document as `data`.
pub fn error_member(problem: &Problem) -> Bytes {
    error_member_of(
        code_of(problem.slug()),
        problem.title(),
        &problem.document(),
    )
}

/// `{"error":{"code":…,"message":…,"data":…}}`.
pub fn error_member_of(code: i64, message: &str, data: &serde_json::Value) -> Bytes {
    let error = serde_json::json!({"error": {"code": code, "message": message, "data": data}});
    Bytes::from(error.to_string())
}

/// A problem document that was saved as a response (a `result-not-kept` record, or one saved
/// before the route was a `jsonrpc` one) as an `error` member; `None` when it is not one.
pub fn member_of_document(document: &[u8]) -> Option<Bytes> {
    let doc: serde_json::Value = serde_json::from_slice(document).ok()?;
    let slug = doc
        .get("type")?
        .as_str()?
        .strip_prefix(crate::problem::TYPE_PREFIX)?;
    let title = doc.get("title").and_then(|t| t.as_str()).unwrap_or(slug);
    Some(error_member_of(code_of(slug), title, &doc))
}

/// The answer to a body that is not a call (`invalid`): `{"jsonrpc":"2.0","id":null,"error":…}`.
pub fn invalid_body(invalid: &Invalid) -> Bytes {
    let message = if invalid.code == PARSE_ERROR {
        "Parse error"
    } else {
        "Invalid Request"
    };
    let doc = serde_json::json!({
        "jsonrpc": "2.0",
        "id": null,
        "error": {"code": invalid.code, "message": message, "data": {"detail": invalid.detail}},
    });
    Bytes::from(doc.to_string())
}

#[cfg(test)]
mod tests;
