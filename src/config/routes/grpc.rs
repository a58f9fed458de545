//! `routes[i].grpc:`: a gRPC route's block as written, and what such a route refuses in its
//! other fields (SPEC §4.11), compiled into [`GrpcSettings`].

use std::collections::BTreeMap;

use serde::Deserialize;

use super::RawRoute;
use crate::config::upstream::RawUpstream;
use crate::route::{FingerprintPart, GrpcSettings, OnUnknownOutcome};

/// `routes[i].grpc:` as written.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
#[serde(expecting = "gRPC settings: a mapping such as {retry_codes: [8, 14]}")]
pub(crate) struct RawGrpc {
    /// `grpc-status` codes that are not a call's result. Default `[8, 14]`.
    #[serde(default)]
    pub retry_codes: Option<Vec<u32>>,
}

/// The headers a gRPC client sets per attempt, which never count in a fingerprint: two attempts
/// of one call differ in them.
pub(crate) const PER_ATTEMPT: [&str; 4] = [
    "grpc-timeout",
    "grpc-previous-rpc-attempts",
    "grpc-accept-encoding",
    "user-agent",
];

impl RawGrpc {
    /// Checks the block. `None`: an error was reported.
    pub(super) fn validate(
        &self,
        path: &str,
        err: &mut impl FnMut(String, String),
    ) -> Option<GrpcSettings> {
        let retry_codes = self.retry_codes.clone().unwrap_or_else(|| vec![8, 14]);
        let mut ok = true;
        for (j, code) in retry_codes.iter().enumerate() {
            if *code == 0 || *code > 16 {
                err(
                    format!("{path}.retry_codes[{j}]"),
                    format!(
                        "{code} is not a gRPC status code that can be retried (1 to 16; 0 is OK)"
                    ),
                );
                ok = false;
            }
        }
        ok.then_some(GrpcSettings { retry_codes })
    }
}

impl RawRoute {
    /// What a gRPC route refuses around its `grpc:` block: `webhook:` or `jsonrpc:` beside
    /// it, an upstream that does not speak HTTP/2, `on_unknown_outcome: resolve`, and a
    /// fingerprinted header a client sets per attempt. False: an error was reported.
    pub(super) fn check_grpc_route(
        &self,
        path: &str,
        upstreams: &BTreeMap<String, RawUpstream>,
        err: &mut impl FnMut(String, String),
    ) -> bool {
        let mut ok = true;
        if self.webhook.is_some() || self.jsonrpc.is_some() {
            err(
                format!("{path}.grpc"),
                "a route is a gRPC route, a JSON-RPC route or a webhook route, one of them: remove grpc, jsonrpc or webhook".into(),
            );
            ok = false;
        }
        if let Some(up) = upstreams.get(&self.upstream)
            && !up.protocol.is_h2()
        {
            err(
                format!("{path}.upstream"),
                format!(
                    "a gRPC route needs an HTTP/2 upstream: set upstreams.{}.protocol to h2c (http://) or h2 (https://)",
                    self.upstream
                ),
            );
            ok = false;
        }
        let Some(i) = &self.idempotency else {
            return ok;
        };
        if i.on_unknown_outcome == Some(OnUnknownOutcome::Resolve) {
            err(
                format!("{path}.idempotency.on_unknown_outcome"),
                "resolve is not accepted on a gRPC route: use keep or release".into(),
            );
            ok = false;
        }
        for (j, part) in i.fingerprint.iter().flatten().enumerate() {
            let header = part
                .trim()
                .strip_prefix("header:")
                .map(|h| h.trim().to_ascii_lowercase());
            if let Some(h) = header
                && PER_ATTEMPT.contains(&h.as_str())
            {
                err(
                    format!("{path}.idempotency.fingerprint[{j}]"),
                    format!(
                        "header:{h} is set per attempt by gRPC clients: it never counts in a fingerprint"
                    ),
                );
                ok = false;
            }
        }
        ok
    }
}

/// A gRPC route's fingerprint when none is written: `[path, body]`, the method and the
/// request's message bytes as sent.
pub(super) const DEFAULT_FINGERPRINT: [FingerprintPart; 2] =
    [FingerprintPart::Path, FingerprintPart::Body];
