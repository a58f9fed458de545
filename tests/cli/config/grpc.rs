//! SPEC §4.11: `upstreams.NAME.protocol` and a route's `grpc:` block. `--check` refuses a gRPC
//! route on an upstream that does not speak HTTP/2, `resolve` on one, `grpc:` beside `webhook:`
//! or `jsonrpc:`, a fingerprinted header a client sets per attempt, and a protocol that does
//! not fit the URL's scheme, each at its field; a gRPC route is idempotent without an
//! `idempotency:` block, and fingerprints `[path, body]`.

use idemproxy::config::{Config, FingerprintPart, Protocol};

use super::{errors, has};

/// A file with one upstream of `protocol` at `url` and one route whose lines after `upstream:`
/// are `extra`, already indented.
fn grpc_route(url: &str, protocol: &str, extra: &str) -> String {
    format!(
        "listen: 127.0.0.1:8080
upstreams:
  ledger:
    url: {url}
    protocol: {protocol}
routes:
  - name: ledger-transfer
    path: /ledger.v1.Ledger/Transfer
    upstream: ledger
{extra}"
    )
}

#[test]
fn a_grpc_route_is_idempotent_and_fingerprints_the_method_and_the_message() {
    let yaml = grpc_route("http://127.0.0.1:50051", "h2c", "    grpc: {}\n");
    let config = Config::from_yaml(&yaml).expect("valid");
    assert_eq!(config.upstreams["ledger"].protocol, Protocol::H2c);
    let route = &config.routes[0];
    let grpc = route.grpc.as_ref().expect("a gRPC route");
    assert_eq!(grpc.retry_codes, vec![8, 14]);
    let idem = route
        .idempotency
        .as_ref()
        .expect("idempotent without a block");
    assert_eq!(
        idem.fingerprint,
        vec![FingerprintPart::Path, FingerprintPart::Body]
    );
    assert_eq!(idem.header.as_str(), "idempotency-key", "the metadata key");
    let yaml = grpc_route(
        "https://ledger.internal:443",
        "h2",
        "    grpc: {retry_codes: [14]}\n    idempotency: {on_unknown_outcome: release}\n",
    );
    let config = Config::from_yaml(&yaml).expect("valid");
    assert_eq!(config.upstreams["ledger"].protocol, Protocol::H2);
    assert_eq!(
        config.routes[0]
            .grpc
            .as_ref()
            .map(|g| g.retry_codes.clone()),
        Some(vec![14])
    );
    // The default protocol is HTTP/1.1.
    let plain = "listen: 127.0.0.1:8080\nupstreams:\n  a:\n    url: http://127.0.0.1:1\nroutes:\n  - name: r\n    path: /\n    upstream: a\n";
    let config = Config::from_yaml(plain).expect("valid");
    assert_eq!(config.upstreams["a"].protocol, Protocol::Http1);
}

#[test]
fn every_invalid_grpc_setting_is_refused_with_its_field() {
    let rows: Vec<(&str, String, &str, &[&str])> = vec![
        (
            "a gRPC route on an HTTP/1.1 upstream",
            grpc_route("http://127.0.0.1:50051", "http1", "    grpc: {}\n"),
            "routes[0].upstream",
            &["HTTP/2", "h2c"],
        ),
        (
            "resolve on a gRPC route",
            grpc_route(
                "http://127.0.0.1:50051",
                "h2c",
                "    grpc: {}\n    idempotency:\n      on_unknown_outcome: resolve\n      resolve: {request: 'GET /x/{key}', found: [200], absent: [404], settle_after: 60s, interval: 5s, give_up_after: 10m}\n",
            ),
            "routes[0].idempotency.on_unknown_outcome",
            &["resolve", "gRPC"],
        ),
        (
            "grpc beside jsonrpc",
            grpc_route(
                "http://127.0.0.1:50051",
                "h2c",
                "    grpc: {}\n    jsonrpc: {methods: [tools/call]}\n",
            ),
            "routes[0].grpc",
            &["one of them"],
        ),
        (
            "a per-attempt header in the fingerprint",
            grpc_route(
                "http://127.0.0.1:50051",
                "h2c",
                "    grpc: {}\n    idempotency:\n      fingerprint: [path, body, \"header:grpc-timeout\"]\n",
            ),
            "routes[0].idempotency.fingerprint[2]",
            &["per attempt"],
        ),
        (
            "a retry code out of range",
            grpc_route(
                "http://127.0.0.1:50051",
                "h2c",
                "    grpc: {retry_codes: [0, 17]}\n",
            ),
            "routes[0].grpc.retry_codes[0]",
            &["1 to 16"],
        ),
        (
            "h2c on https",
            grpc_route("https://127.0.0.1:50051", "h2c", ""),
            "upstreams.ledger.protocol",
            &["http://"],
        ),
        (
            "h2 on http",
            grpc_route("http://127.0.0.1:50051", "h2", ""),
            "upstreams.ledger.protocol",
            &["https://"],
        ),
        (
            "an unknown protocol",
            grpc_route("http://127.0.0.1:50051", "http3", ""),
            "",
            &["http3"],
        ),
    ];
    for (what, yaml, path, words) in rows {
        let errs = errors(&yaml);
        let shown = errs.to_string();
        if path.is_empty() {
            assert!(words.iter().all(|w| shown.contains(w)), "{what}: {shown}");
        } else {
            assert!(
                has(&errs, path, words),
                "{what}: expected {path} {words:?}, got {shown}"
            );
        }
    }
    // grpc beside webhook.
    let dir = tempfile::tempdir().expect("temp dir");
    let secret = dir.path().join("s");
    std::fs::write(&secret, "s3cret\n").expect("write");
    let yaml = grpc_route(
        "http://127.0.0.1:50051",
        "h2c",
        &format!(
            "    grpc: {{}}\n    webhook: {{provider: github, secrets_file: {}}}\n",
            secret.display()
        ),
    );
    assert!(has(&errors(&yaml), "routes[0].grpc", &["one of them"]));
}
