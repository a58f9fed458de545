//! A Standard Webhooks sender as the specification signs (`{id}.{timestamp}.{body}`,
//! HMAC-SHA256, `webhook-signature: v1,<base64>`, secret `whsec_<base64>`), and a proxy with one
//! webhook route in front of the mock's handler.

use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use harness::{Env, Reply, TestProxy, client, send};

/// A route's secret: its `whsec_` form for the file, its key for signing.
pub(crate) struct Secret {
    pub(crate) written: String,
    key: Vec<u8>,
}

impl Secret {
    pub(crate) fn new(key: &[u8]) -> Secret {
        Secret {
            written: format!("whsec_{}", STANDARD.encode(key)),
            key: key.to_vec(),
        }
    }

    /// `v1,<base64>` over `{id}.{timestamp}.{body}`.
    pub(crate) fn sign(&self, id: &str, timestamp: u64, body: &str) -> String {
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &self.key);
        let signed = format!("{id}.{timestamp}.{body}");
        let tag = ring::hmac::sign(&key, signed.as_bytes());
        format!("v1,{}", STANDARD.encode(tag.as_ref()))
    }
}

/// Seconds since the epoch, as a sender stamps a delivery.
pub(crate) fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A secrets file, kept as long as the value lives.
pub(crate) struct SecretsFile {
    _dir: tempfile::TempDir,
    pub(crate) path: String,
}

impl SecretsFile {
    pub(crate) fn new(secrets: &[&Secret]) -> SecretsFile {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("webhook-secrets");
        let path = file.to_str().expect("a UTF-8 temp path").to_owned();
        let file = SecretsFile { _dir: dir, path };
        file.write(secrets);
        file
    }

    /// Replaces the file's secrets.
    pub(crate) fn write(&self, secrets: &[&Secret]) {
        let text: String = secrets.iter().map(|s| format!("{}\n", s.written)).collect();
        std::fs::write(&self.path, text).expect("write the secrets");
    }
}

/// The route `events` at `/webhooks/standard` (the mock's Standard Webhooks handler), its
/// secrets in `file`, `idempotency` lines (already indented) under it when not empty.
pub(crate) fn yaml(env: &Env, file: &SecretsFile, idempotency: &str) -> String {
    format!(
        "listen: 127.0.0.1:0
{store}upstreams:
  mock:
    url: {up}
routes:
  - name: events
    methods: [POST]
    path: /webhooks/standard
    upstream: mock
    webhook:
      provider: standard
      secrets_file: {secrets}
{idempotency}",
        store = env.store_yaml(""),
        up = env.mock.url(),
        secrets = file.path,
    )
}

/// A delivery as a sender makes it: `id`, `timestamp`, `body`, signed by `secret`; `extra`
/// headers added (the mock's controls, say), none of them signed.
pub(crate) async fn deliver(
    proxy: &TestProxy,
    secret: &Secret,
    id: &str,
    timestamp: u64,
    body: &str,
    extra: &[(&str, &str)],
) -> Reply {
    let signature = secret.sign(id, timestamp, body);
    deliver_signed(proxy, id, timestamp, Some(&signature), body, extra).await
}

/// A delivery with the signature header given as is (`None`: absent).
pub(crate) async fn deliver_signed(
    proxy: &TestProxy,
    id: &str,
    timestamp: u64,
    signature: Option<&str>,
    body: &str,
    extra: &[(&str, &str)],
) -> Reply {
    let mut req = client()
        .post(proxy.url("/webhooks/standard"))
        .header("content-type", "application/json")
        .header("webhook-id", id)
        .header("webhook-timestamp", timestamp.to_string())
        .body(body.to_owned());
    if let Some(signature) = signature {
        req = req.header("webhook-signature", signature);
    }
    for (name, value) in extra {
        req = req.header(*name, *value);
    }
    send(req).await
}

/// The deliveries the mock's handler ran for `id`.
pub(crate) fn handled(env: &Env, id: &str) -> u64 {
    env.mock.stats().events.get(id).copied().unwrap_or(0)
}

/// `idemproxy_webhooks_total{route="events",result}`.
pub(crate) fn webhooks(proxy: &TestProxy, result: &str) -> u64 {
    proxy.metric(
        "idemproxy_webhooks_total",
        &[("route", "events"), ("result", result)],
    ) as u64
}
