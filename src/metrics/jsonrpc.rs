//! The series of JSON-RPC routes (SPEC §4.10): `idemproxy_jsonrpc_calls_total{route,method,result}`
//! and `idemproxy_jsonrpc_unanswered_total{route}`.
//!
//! `method` is a label only for the names a route can know of: its claimed methods and MCP's
//! own; any other is `other`, so a client cannot grow the registry by inventing method names.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use super::register;

/// What became of a `POST` on a JSON-RPC route (the `result` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallResult {
    /// A call of a claimed method, with its key: run under idempotency.
    Claimed,
    /// A call of another method, or a client's response: forwarded unclaimed.
    Passthrough,
    /// A request without an `id`: forwarded unclaimed.
    Notification,
    /// Not JSON, a batch, or not a JSON-RPC 2.0 message: refused with `400`.
    Invalid,
}

impl CallResult {
    pub fn as_str(self) -> &'static str {
        match self {
            CallResult::Claimed => "claimed",
            CallResult::Passthrough => "passthrough",
            CallResult::Notification => "notification",
            CallResult::Invalid => "invalid",
        }
    }
}

/// MCP's own method names (2025-11-25), labelled by name; any other unclaimed method is `other`.
const MCP_METHODS: &[&str] = &[
    "initialize",
    "ping",
    "tools/list",
    "tools/call",
    "resources/list",
    "resources/templates/list",
    "resources/read",
    "resources/subscribe",
    "resources/unsubscribe",
    "prompts/list",
    "prompts/get",
    "completion/complete",
    "logging/setLevel",
    "sampling/createMessage",
    "elicitation/create",
    "roots/list",
    "tasks/get",
    "tasks/list",
    "tasks/result",
    "tasks/cancel",
    "notifications/initialized",
    "notifications/cancelled",
    "notifications/progress",
    "notifications/message",
    "notifications/roots/list_changed",
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    route: String,
    method: String,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabel {
    route: String,
}

/// The JSON-RPC families, registered at start.
pub(super) struct JsonRpcFamilies {
    calls: Family<CallLabels, Counter>,
    unanswered: Family<RouteLabel, Counter>,
}

impl JsonRpcFamilies {
    pub(super) fn register(r: &mut Registry) -> JsonRpcFamilies {
        JsonRpcFamilies {
            calls: register(
                r,
                "idemproxy_jsonrpc_calls",
                "POSTs on JSON-RPC routes by route, method and result: claimed, passthrough, notification, invalid",
                Family::default(),
            ),
            unanswered: register(
                r,
                "idemproxy_jsonrpc_unanswered",
                "Claimed calls answered 202 with no body (a server of the old HTTP+SSE transport answers on another stream): released, never exactly-once",
                Family::default(),
            ),
        }
    }

    /// Makes a JSON-RPC route's series at 0, so that they are served from the start: each
    /// claimed method with each result but `invalid`, `invalid` itself, and the unanswered count.
    pub(super) fn route(&self, route: &str, claimed: &[String]) {
        for method in claimed {
            for result in [
                CallResult::Claimed,
                CallResult::Passthrough,
                CallResult::Notification,
            ] {
                drop(self.calls.get_or_create(&CallLabels {
                    route: route.to_owned(),
                    method: method.clone(),
                    result: result.as_str(),
                }));
            }
        }
        drop(self.calls.get_or_create(&CallLabels {
            route: route.to_owned(),
            method: String::new(),
            result: CallResult::Invalid.as_str(),
        }));
        drop(self.unanswered.get_or_create(&RouteLabel {
            route: route.to_owned(),
        }));
    }

    /// Counts one `POST`; `claimed` lists the route's claimed methods.
    pub(super) fn call(&self, route: &str, method: &str, claimed: &[String], result: CallResult) {
        let known = method.is_empty()
            || claimed.iter().any(|m| m == method)
            || MCP_METHODS.contains(&method);
        let labels = CallLabels {
            route: route.to_owned(),
            method: if known { method } else { "other" }.to_owned(),
            result: result.as_str(),
        };
        self.calls.get_or_create(&labels).inc();
    }

    pub(super) fn unanswered(&self, route: &str) {
        self.unanswered
            .get_or_create(&RouteLabel {
                route: route.to_owned(),
            })
            .inc();
    }
}
