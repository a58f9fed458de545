//! A request on a JSON-RPC route (SPEC §4.10): a `POST` read (bounded) as one JSON-RPC
//! message; a call of a claimed method run under its key by the shared flow (admission, the
//! claim, the lease, the save, the replay), everything else forwarded unclaimed and streamed;
//! and the proxy's own answers to a call rendered as JSON-RPC errors carrying its `id`.

mod answer;

use std::sync::Arc;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::request::Parts;
use http::{Method, Response, StatusCode};
use hyper::body::Incoming;

use super::admission::{self, KeySource};
use super::context::Context;
use super::matched::{Answer, forward_plain};
use super::observe::refused::refused_head;
use super::{Proxy, body_with_deadline};
use crate::body;
use crate::jsonrpc::{self, Call, Message};
use crate::metrics::{CallResult, Outcome};
use crate::problem::Problem;
use crate::route::JsonRpcSettings;

pub(super) use answer::{Sink, run_call};

impl Proxy {
    /// A request on a JSON-RPC route: a call of a claimed method is run under idempotency;
    /// anything else is forwarded unclaimed (a `POST` after its body was read and checked).
    pub(super) async fn jsonrpc(
        &self,
        context: &Arc<Context>,
        settings: &JsonRpcSettings,
        parts: Parts,
        incoming: Incoming,
    ) -> Answer {
        let route = &context.route;
        let client = context.client;
        if parts.method != Method::POST {
            // A server's event stream (`GET`), a session's end (`DELETE`): streamed both ways.
            let body = body_with_deadline(incoming, &context.limits);
            return forward_plain(route, parts, body, client, None).await;
        }
        let body = match admission::read_delivery(context, &parts, incoming).await {
            Ok(body) => body,
            // No call read yet, so no `id` to answer: the error carries `"id": null`.
            Err((problem, outcome)) => return (uncalled(&problem), outcome),
        };
        let count = |method: &str, result| {
            self.metrics
                .jsonrpc_call(&route.name, method, &settings.methods, result);
        };
        let mut call = match jsonrpc::parse(&body) {
            Ok(Message::Call(call)) if settings.claims(call.method()) => call,
            Ok(Message::Call(call)) => {
                count(call.method(), CallResult::Passthrough);
                return forward_plain(route, parts, body::full(body), client, None).await;
            }
            Ok(Message::Notification { method }) => {
                count(&method, CallResult::Notification);
                return forward_plain(route, parts, body::full(body), client, None).await;
            }
            Ok(Message::Response) => {
                count("", CallResult::Passthrough);
                return forward_plain(route, parts, body::full(body), client, None).await;
            }
            Err(invalid) => {
                count("", CallResult::Invalid);
                tracing::debug!(route = %route.name, code = invalid.code, detail = %invalid.detail, "not a JSON-RPC message: 400");
                return (
                    json_response(StatusCode::BAD_REQUEST, jsonrpc::invalid_body(&invalid)),
                    Outcome::BadRequest,
                );
            }
        };
        call.accept(parts.headers.get(header::ACCEPT).map(HeaderValue::as_bytes));
        let call = Arc::new(call);
        let admitted = match admit(context, parts, body, call.clone()) {
            CallAdmission::Admitted(admitted) => *admitted,
            // No key on a route that does not require one: plain traffic, as on any route.
            CallAdmission::NoKey(parts, body) => {
                count(call.method(), CallResult::Passthrough);
                return forward_plain(route, parts, body::full(body), client, None).await;
            }
            CallAdmission::Refused(problem, outcome, parts, body) => {
                count(call.method(), CallResult::Claimed);
                if let Some(observed) = &route.observed {
                    // Observe mode refuses nothing: counted as enforce would have answered,
                    // and forwarded.
                    refused_head(route, observed, &problem, outcome, client);
                    let body = body::full(body);
                    return forward_plain(route, parts, body, client, context.drop_key()).await;
                }
                return (error_response(&problem, &call), outcome);
            }
        };
        count(call.method(), CallResult::Claimed);
        let (resp, outcome) = match &route.observed {
            Some(observed) => self.observe_admitted(context, observed, admitted).await,
            None => self.run_admitted(context.clone(), admitted).await,
        };
        if resp.extensions().get::<answer::Unanswered>().is_some() {
            self.metrics.jsonrpc_unanswered(&route.name);
        }
        (render(resp, &call), outcome)
    }
}

/// What admission decided for a claimed call; a refusal hands the request back, which an
/// observed route forwards all the same.
enum CallAdmission {
    Admitted(Box<admission::Admitted>),
    NoKey(Parts, Bytes),
    Refused(Problem, Outcome, Parts, Bytes),
}

/// A claimed call's key, body and fingerprint — the call's method and params, never its `id`
/// — or the refusal that claims nothing.
fn admit(context: &Context, parts: Parts, body: Bytes, call: Arc<Call>) -> CallAdmission {
    let idem = &*context.policy;
    let source = match admission::call_key_source(idem, &parts) {
        Ok(KeySource::None) => return CallAdmission::NoKey(parts, body),
        Ok(source) => source,
        Err((problem, outcome)) => return CallAdmission::Refused(problem, outcome, parts, body),
    };
    match admission::with_body(context, source, parts, body, Some(call)) {
        Ok(admitted) => CallAdmission::Admitted(Box::new(admitted)),
        Err(underived) => {
            let admission::Underived {
                problem,
                parts,
                body,
            } = *underived;
            CallAdmission::Refused(problem, Outcome::InvalidKey, parts, body)
        }
    }
}

/// The proxy's own answer to a call (a problem, in the response's extensions) as a JSON-RPC
/// error carrying the call's `id`, `200`, `Retry-After` kept; any other response as it is.
fn render(resp: Response<body::Body>, call: &Call) -> Response<body::Body> {
    match resp.extensions().get::<Problem>() {
        Some(problem) => error_response(problem, call),
        None => resp,
    }
}

/// `problem` as the JSON-RPC error answering `call`.
fn error_response(problem: &Problem, call: &Call) -> Response<body::Body> {
    let member = jsonrpc::error_member(problem);
    let message = jsonrpc::replay_body(call, &member).unwrap_or(member);
    let mut resp = json_response(StatusCode::OK, message);
    if let Some(secs) = problem.retry_after() {
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    resp
}

/// A refusal before any call was read (a body too large, too slow): the JSON-RPC error with
/// `"id": null`, under the problem's own HTTP status.
fn uncalled(problem: &Problem) -> Response<body::Body> {
    let doc = serde_json::json!({
        "jsonrpc": "2.0",
        "id": null,
        "error": {
            "code": jsonrpc::code_of(problem.slug()),
            "message": problem.title(),
            "data": problem.document(),
        },
    });
    json_response(problem.status(), Bytes::from(doc.to_string()))
}

fn json_response(status: StatusCode, body: Bytes) -> Response<body::Body> {
    let mut resp = Response::new(body::full(body));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}
