//! SPEC §4.10: a route's `jsonrpc:` block. `--check` refuses what would count a call's `id`
//! or cannot be kept for a call, each refusal at its field; a JSON-RPC route is idempotent
//! without an `idempotency:` block, and its fingerprint defaults to `[method, path, query]`
//! besides the call.

use idemproxy::config::{Config, FingerprintPart};

use super::{errors, has};

/// A file with one JSON-RPC route whose `jsonrpc:` block is `block` and whose other route lines
/// (after `upstream:`) are `extra`, both already indented.
fn jsonrpc_route(block: &str, extra: &str) -> String {
    format!(
        "listen: 127.0.0.1:8080
upstreams:
  tools:
    url: http://127.0.0.1:8081
routes:
  - name: mcp-tools
    path: /mcp
    upstream: tools
{extra}    jsonrpc:
{block}"
    )
}

#[test]
fn a_jsonrpc_route_is_idempotent_and_fingerprints_the_call_not_the_body() {
    let yaml = jsonrpc_route("      methods: [tools/call]\n", "");
    let config = Config::from_yaml(&yaml).expect("valid");
    let route = &config.routes[0];
    let jsonrpc = route.jsonrpc.as_ref().expect("a JSON-RPC route");
    assert_eq!(jsonrpc.methods, vec!["tools/call".to_owned()]);
    assert!(jsonrpc.retry_errors.is_empty());
    let idem = route
        .idempotency
        .as_ref()
        .expect("idempotent without a block");
    assert_eq!(
        idem.fingerprint,
        vec![
            FingerprintPart::Method,
            FingerprintPart::Path,
            FingerprintPart::Query
        ]
    );
    let yaml = jsonrpc_route(
        "      methods: [tools/call, payments/charge]\n      retry_errors: [-32001, -32002]\n",
        "    idempotency:\n      key_from: [\"json:/params/_meta/idempotency-key\"]\n      fingerprint: [path, \"header:X-Tenant\"]\n",
    );
    let config = Config::from_yaml(&yaml).expect("valid");
    let route = &config.routes[0];
    assert_eq!(
        route.jsonrpc.as_ref().map(|j| j.retry_errors.clone()),
        Some(vec![-32001, -32002])
    );
    let idem = route.idempotency.as_ref().expect("idempotent");
    assert_eq!(idem.fingerprint.len(), 2, "as written");
    assert_eq!(idem.key_from.len(), 1);
}

#[test]
fn what_would_count_the_id_or_cannot_be_kept_is_refused_at_its_field() {
    let errs = errors(&jsonrpc_route("      methods: []\n", ""));
    assert!(
        has(&errs, "routes[0].jsonrpc.methods", &["empty"]),
        "{errs}"
    );
    let errs = errors(&jsonrpc_route("      retry_errors: [1]\n", ""));
    assert!(
        has(&errs, "routes[0].jsonrpc.methods", &["required"]),
        "{errs}"
    );
    let errs = errors(&jsonrpc_route(
        "      methods: [tools/call]\n",
        "    idempotency:\n      fingerprint: [method, body, json]\n",
    ));
    assert!(
        has(
            &errs,
            "routes[0].idempotency.fingerprint[1]",
            &["body", "id"]
        ),
        "{errs}"
    );
    assert!(
        has(&errs, "routes[0].idempotency.fingerprint[2]", &["json"]),
        "{errs}"
    );
    let errs = errors(&jsonrpc_route(
        "      methods: [tools/call]\n",
        "    idempotency:\n      on_unknown_outcome: resolve\n      resolve:\n        request: GET /bookings/{json:/params/arguments/reference}\n        found: [200]\n        absent: [404]\n        settle_after: 60s\n        interval: 5s\n        give_up_after: 10m\n",
    ));
    assert!(
        has(
            &errs,
            "routes[0].idempotency.on_unknown_outcome",
            &["resolve"]
        ),
        "{errs}"
    );
    let errs = errors(&jsonrpc_route(
        "      methods: [tools/call]\n",
        "    webhook:\n      provider: stripe\n      secrets_env: NOT_SET_ANYWHERE_X\n",
    ));
    assert!(has(&errs, "routes[0].jsonrpc", &["webhook"]), "{errs}");
    let errs = errors(&jsonrpc_route(
        "      methods: [tools/call]\n      batch: true\n",
        "",
    ));
    assert!(errs.to_string().contains("batch"), "{errs}");
}
