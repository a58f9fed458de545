//! SPEC §4.9: a route's `webhook:` block. Each refusal names its field; a webhook route gets the
//! webhook defaults for the idempotency fields not written, is idempotent without an
//! `idempotency:` block, and reads its secrets from a file or the environment.

use std::time::Duration;

use idemproxy::config::{Config, FingerprintPart};

use super::{errors, has};
use idemproxy::route::{OnUnknownOutcome, Provider};

/// A file with one webhook route whose `webhook:` block is `block` and whose other route lines
/// (after `upstream:`) are `extra`, both already indented.
fn webhook_route(block: &str, extra: &str) -> String {
    format!(
        "listen: 127.0.0.1:8080
upstreams:
  booking:
    url: http://127.0.0.1:8081
routes:
  - name: events
    path: /webhooks/events
    upstream: booking
{extra}    webhook:
{block}"
    )
}

/// A secrets file holding `text`, kept for the test's length.
fn secrets_file(text: &str) -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("secrets");
    std::fs::write(&file, text).expect("write the secrets");
    let shown = file.to_str().expect("a UTF-8 temp path").to_owned();
    (dir, shown)
}

#[test]
fn a_webhook_route_without_idempotency_gets_the_webhook_defaults() {
    let (_dir, file) = secrets_file("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\n");
    let yaml = webhook_route(
        &format!("      provider: standard\n      secrets_file: {file}\n"),
        "",
    );
    let config = Config::from_yaml(&yaml).expect("valid");
    let route = &config.routes[0];
    let webhook = route.webhook.as_ref().expect("a webhook route");
    assert_eq!(webhook.provider, Provider::Standard);
    assert_eq!(webhook.tolerance, Duration::from_secs(300));
    assert_eq!(webhook.secrets.len(), 1);
    let idem = route
        .idempotency
        .as_ref()
        .expect("idempotent without an idempotency block");
    assert!(idem.scope.is_empty());
    assert!(
        idem.fingerprint.is_empty(),
        "the event is the provider's word"
    );
    assert_eq!(idem.ttl, Duration::from_secs(7 * 24 * 3600));
    assert_eq!(idem.on_unknown_outcome, OnUnknownOutcome::Release);
    assert_eq!(idem.retry_statuses, vec![408, 429, 500, 502, 503, 504]);
    assert!(!idem.required);
    assert!(config.warnings().is_empty(), "{:?}", config.warnings());
    // Every other field as written, the written ones over the webhook defaults.
    let (_dir, standard) = secrets_file("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\n");
    let yaml = webhook_route(
        &format!("      provider: standard\n      secrets_file: {standard}\n      tolerance: 1m\n"),
        "    idempotency:\n      ttl: 40h\n      scope: [X-Tenant]\n      retry_statuses: [503]\n      fingerprint: [body]\n      on_unknown_outcome: keep\n",
    );
    let config = Config::from_yaml(&yaml).expect("valid");
    let idem = config.routes[0].idempotency.as_ref().expect("idempotent");
    assert_eq!(idem.ttl, Duration::from_secs(40 * 3600));
    assert_eq!(idem.scope.len(), 1);
    assert_eq!(idem.retry_statuses, vec![503]);
    assert_eq!(idem.fingerprint, vec![FingerprintPart::Body]);
    assert_eq!(idem.on_unknown_outcome, OnUnknownOutcome::Keep);
    let tolerance = config.routes[0].webhook.as_ref().map(|w| w.tolerance);
    assert_eq!(tolerance, Some(Duration::from_secs(60)));
    assert!(config.warnings().is_empty(), "{:?}", config.warnings());
}

#[test]
fn a_route_without_webhook_keeps_its_defaults() {
    let yaml = "listen: 127.0.0.1:8080
upstreams:
  booking:
    url: http://127.0.0.1:8081
routes:
  - name: create
    path: /bookings
    upstream: booking
    idempotency: {}
";
    let config = Config::from_yaml(yaml).expect("valid");
    let idem = config.routes[0].idempotency.as_ref().expect("idempotent");
    assert!(idem.required);
    assert_eq!(idem.retry_statuses, vec![429, 503]);
    assert_eq!(idem.scope.len(), 1);
    assert_eq!(idem.fingerprint.len(), 4);
    assert!(config.routes[0].webhook.is_none());
}

#[test]
fn secrets_come_from_the_environment_too() {
    // Cargo sets it for every test it runs; the binary sets no variable itself.
    let var = "CARGO_PKG_NAME";
    let yaml = webhook_route(
        &format!("      provider: shopify\n      secrets_env: {var}\n"),
        "",
    );
    let config = Config::from_yaml(&yaml).expect("valid");
    let webhook = config.routes[0].webhook.as_ref().expect("a webhook route");
    assert_eq!(webhook.secrets.len(), 1);
}

#[test]
fn the_hmac_provider_reads_its_fields() {
    let (_dir, file) = secrets_file("s3cret\n");
    let yaml = webhook_route(
        &format!(
            "      provider: hmac\n      secrets_file: {file}\n      signature_header: X-Signature\n      encoding: base64\n      prefix: \"sha256=\"\n      id: header:X-Event-Id\n"
        ),
        "    methods: [POST]\n",
    );
    let config = Config::from_yaml(&yaml).expect("valid");
    let webhook = config.routes[0].webhook.as_ref().expect("a webhook route");
    let Provider::Hmac(scheme) = &webhook.provider else {
        panic!("hmac provider expected, got {:?}", webhook.provider);
    };
    assert_eq!(scheme.signature_header.as_str(), "x-signature");
    assert_eq!(scheme.prefix, "sha256=");
}

#[test]
fn every_invalid_webhook_block_is_refused_with_its_field() {
    let (_dir, file) = secrets_file("whsec_abc\n");
    let (_empty_dir, empty) = secrets_file("\n  \n");
    let secrets = format!("      secrets_file: {file}\n");
    let rows: Vec<(&str, String, &str, &[&str])> = vec![
        (
            "unknown provider",
            webhook_route(&format!("      provider: paypal\n{secrets}"), ""),
            "routes[0].webhook.provider",
            &["unknown provider", "paypal", "standard"],
        ),
        (
            "no secret source",
            webhook_route("      provider: stripe\n", ""),
            "routes[0].webhook.secrets_file",
            &["secrets_file or secrets_env"],
        ),
        (
            "both secret sources",
            webhook_route(
                &format!("      provider: stripe\n{secrets}      secrets_env: X\n"),
                "",
            ),
            "routes[0].webhook.secrets_file",
            &["not both"],
        ),
        (
            "an empty secrets file",
            webhook_route(
                &format!("      provider: stripe\n      secrets_file: {empty}\n"),
                "",
            ),
            "routes[0].webhook.secrets_file",
            &["no secret"],
        ),
        (
            "a missing secrets file",
            webhook_route(
                "      provider: stripe\n      secrets_file: /nonexistent/idemproxy/secrets\n",
                "",
            ),
            "routes[0].webhook.secrets_file",
            &["cannot read", "/nonexistent/idemproxy/secrets"],
        ),
        (
            "an unset secrets variable",
            webhook_route(
                "      provider: stripe\n      secrets_env: IDEMPROXY_TEST_UNSET_WEBHOOK_VAR\n",
                "",
            ),
            "routes[0].webhook.secrets_env",
            &["IDEMPROXY_TEST_UNSET_WEBHOOK_VAR", "not set"],
        ),
        (
            "a field of hmac on stripe",
            webhook_route(
                &format!("      provider: stripe\n{secrets}      signature_header: X-Sig\n"),
                "",
            ),
            "routes[0].webhook.signature_header",
            &["provider hmac", "stripe"],
        ),
        (
            "an id on github",
            webhook_route(
                &format!("      provider: github\n{secrets}      id: header:X-Id\n"),
                "",
            ),
            "routes[0].webhook.id",
            &["provider hmac"],
        ),
        (
            "hmac without signature_header",
            webhook_route(
                &format!("      provider: hmac\n{secrets}      id: header:X-Id\n"),
                "",
            ),
            "routes[0].webhook.signature_header",
            &["required"],
        ),
        (
            "hmac without id",
            webhook_route(
                &format!("      provider: hmac\n{secrets}      signature_header: X-Sig\n"),
                "",
            ),
            "routes[0].webhook.id",
            &["required"],
        ),
        (
            "methods without POST",
            webhook_route(
                &format!("      provider: github\n{secrets}"),
                "    methods: [PUT]\n",
            ),
            "routes[0].methods",
            &["POST"],
        ),
        (
            "key_from on a webhook route",
            webhook_route(
                &format!("      provider: github\n{secrets}"),
                "    idempotency:\n      key_from: [\"header:X-GitHub-Delivery\"]\n",
            ),
            "routes[0].idempotency.key_from",
            &["event id"],
        ),
        (
            "idempotency.header on a webhook route",
            webhook_route(
                &format!("      provider: github\n{secrets}"),
                "    idempotency:\n      header: Idempotency-Key\n",
            ),
            "routes[0].idempotency.header",
            &["event id"],
        ),
        (
            "required: true on a webhook route",
            webhook_route(
                &format!("      provider: github\n{secrets}"),
                "    idempotency:\n      required: true\n",
            ),
            "routes[0].idempotency.required",
            &["not used on a webhook route"],
        ),
        (
            "tolerance on a provider that signs no timestamp",
            webhook_route(
                &format!("      provider: github\n{secrets}      tolerance: 1m\n"),
                "",
            ),
            "routes[0].webhook.tolerance",
            &["github", "signs no timestamp"],
        ),
        (
            "tolerance under 1s",
            webhook_route(
                &format!("      provider: stripe\n{secrets}      tolerance: 500ms\n"),
                "",
            ),
            "routes[0].webhook.tolerance",
            &["1s to 1h"],
        ),
        (
            "tolerance over 1h",
            webhook_route(
                &format!("      provider: slack\n{secrets}      tolerance: 2h\n"),
                "",
            ),
            "routes[0].webhook.tolerance",
            &["1s to 1h"],
        ),
        (
            "an unknown field",
            webhook_route(
                &format!("      provider: github\n{secrets}      secret: x\n"),
                "",
            ),
            "",
            &["unknown field", "secret"],
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
        assert!(
            !shown.contains("whsec_abc"),
            "{what}: a secret shown: {shown}"
        );
    }
}

#[test]
fn a_ttl_shorter_than_the_providers_redelivery_window_is_warned_about() {
    let (_dir, file) = secrets_file("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\n");
    for (provider, ttl, warned) in [
        ("stripe", "24h", true),
        ("stripe", "3d", false),
        ("standard", "24h", true),
        ("standard", "2d", false),
        ("shopify", "1h", true),
        ("shopify", "5h", false),
        ("slack", "1m", true),
        ("slack", "1h", false),
        // GitHub redelivers nothing on its own.
        ("github", "1m", false),
    ] {
        let yaml = webhook_route(
            &format!("      provider: {provider}\n      secrets_file: {file}\n"),
            &format!("    idempotency:\n      ttl: {ttl}\n"),
        );
        let config = Config::from_yaml(&yaml).expect("valid: a warning, not an error");
        let warnings = config.warnings();
        assert_eq!(
            !warnings.is_empty(),
            warned,
            "{provider} {ttl}: {warnings:?}"
        );
        if let Some(w) = warnings.first() {
            assert_eq!(w.route, "events");
            assert_eq!(w.path, "routes[0].idempotency.ttl");
            assert!(w.message.contains(provider), "{}", w.message);
        }
    }
}

#[test]
fn reload_checks_a_file_whose_secrets_variable_only_the_proxy_has() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("idemproxy.yaml");
    let yaml = webhook_route(
        "      provider: stripe\n      secrets_env: IDEMPROXY_TEST_UNSET_WEBHOOK_VAR\n",
        "",
    );
    std::fs::write(&path, yaml).expect("write the file");
    assert!(Config::load(&path).is_err(), "the proxy itself needs it");
    let config = Config::load_for_reload(&path).expect("idemproxy reload signals the proxy");
    assert!(config.routes[0].webhook.is_some());
}
