//! `routes[i].jsonrpc:`: a JSON-RPC route's block as written, and what such a route refuses in
//! its other fields (SPEC §4.10), compiled into [`JsonRpcSettings`].

use serde::Deserialize;

use super::RawRoute;
use crate::route::{FingerprintPart, JsonRpcSettings, OnUnknownOutcome};

/// `routes[i].jsonrpc:` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[serde(expecting = "JSON-RPC settings: a mapping such as {methods: [tools/call]}")]
pub(crate) struct RawJsonRpc {
    /// The methods whose calls are claimed. Required, at least one.
    #[serde(default)]
    pub methods: Option<Vec<String>>,
    /// JSON-RPC error codes that are not a call's result (the claim is released). Default none.
    #[serde(default)]
    pub retry_errors: Vec<i64>,
}

impl RawJsonRpc {
    /// Checks the block. `None`: an error was reported.
    pub(super) fn validate(
        &self,
        path: &str,
        err: &mut impl FnMut(String, String),
    ) -> Option<JsonRpcSettings> {
        let methods = match &self.methods {
            None => {
                err(
                    format!("{path}.methods"),
                    "is required: name the calls to claim, as in [tools/call]".into(),
                );
                return None;
            }
            Some(list) if list.is_empty() => {
                err(
                    format!("{path}.methods"),
                    "is empty: name at least one method whose calls are claimed, as in [tools/call]"
                        .into(),
                );
                return None;
            }
            Some(list) => list,
        };
        let mut ok = true;
        for (j, m) in methods.iter().enumerate() {
            if m.is_empty() {
                err(format!("{path}.methods[{j}]"), "is empty".into());
                ok = false;
            }
        }
        ok.then(|| JsonRpcSettings {
            methods: methods.clone(),
            retry_errors: self.retry_errors.clone(),
        })
    }
}

impl RawRoute {
    /// What a JSON-RPC route refuses around its `jsonrpc:` block: `webhook:` beside it, a
    /// fingerprint part that would count the call's `id` (`body`, `json`), and `on_unknown_outcome:
    /// resolve`. False: an error was reported.
    pub(super) fn check_jsonrpc_route(
        &self,
        path: &str,
        err: &mut impl FnMut(String, String),
    ) -> bool {
        let mut ok = true;
        if self.webhook.is_some() {
            err(
                format!("{path}.jsonrpc"),
                "a route is a JSON-RPC route or a webhook route, not both: remove jsonrpc or webhook"
                    .into(),
            );
            ok = false;
        }
        let Some(i) = &self.idempotency else {
            return ok;
        };
        for (j, part) in i.fingerprint.iter().flatten().enumerate() {
            if matches!(part.trim(), "body" | "json") {
                err(
                    format!("{path}.idempotency.fingerprint[{j}]"),
                    format!(
                        "{:?} is not accepted on a JSON-RPC route: it would count the call's id; the call's method and params always count (use method, path, query or header:NAME)",
                        part.trim()
                    ),
                );
                ok = false;
            }
        }
        if i.on_unknown_outcome == Some(OnUnknownOutcome::Resolve) {
            err(
                format!("{path}.idempotency.on_unknown_outcome"),
                "resolve is not accepted on a JSON-RPC route: use keep or release".into(),
            );
            ok = false;
        }
        ok
    }
}

/// A JSON-RPC route's fingerprint when none is written: `[method, path, query]`, besides the
/// call itself.
pub(super) const DEFAULT_FINGERPRINT: [FingerprintPart; 3] = [
    FingerprintPart::Method,
    FingerprintPart::Path,
    FingerprintPart::Query,
];
