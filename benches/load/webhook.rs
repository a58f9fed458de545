//! Standard Webhooks deliveries for the `webhook/*` scenarios, signed here as a sender signs
//! them (<https://www.standardwebhooks.com>, docs/configuration.md `routes[i].webhook`): the
//! event id in `webhook-id`, the Unix time in `webhook-timestamp`, and `webhook-signature:
//! v1,<base64>` of HMAC-SHA256 over `{id}.{timestamp}.{body}` with the key that the secret
//! `whsec_<base64>` holds.
//!
//! Every delivery has a new event id, so every one is claimed, forwarded and saved, as a new
//! key is on the `new-key/*` rows: the difference between the two rows is the signature check
//! and reading the event id. Signing costs the load generator about a microsecond a request.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use http::{HeaderName, HeaderValue};
use ring::hmac;

const ID: HeaderName = HeaderName::from_static("webhook-id");
const TIMESTAMP: HeaderName = HeaderName::from_static("webhook-timestamp");
const SIGNATURE: HeaderName = HeaderName::from_static("webhook-signature");

/// A sender's secret and its event ids.
#[derive(Debug)]
pub(crate) struct Signer {
    key: hmac::Key,
    /// The secret as the route's secrets file holds it.
    written: String,
    /// Event ids are this and a ticket number: unique as long as the prefix is.
    prefix: String,
}

impl Signer {
    /// A sender with the key `secret`, its event ids starting with `prefix`.
    pub(crate) fn new(secret: &[u8], prefix: String) -> Signer {
        Signer {
            key: hmac::Key::new(hmac::HMAC_SHA256, secret),
            written: format!("whsec_{}", STANDARD.encode(secret)),
            prefix,
        }
    }

    /// The line of the route's `secrets_file`.
    pub(crate) fn secrets_line(&self) -> &str {
        &self.written
    }

    /// The headers of delivery `ticket` of `body`, stamped now and signed.
    pub(crate) fn headers(&self, ticket: u64, body: &[u8]) -> [(HeaderName, HeaderValue); 3] {
        let id = format!("{}{ticket:012x}", self.prefix);
        let timestamp = unix_seconds().to_string();
        let signature = self.signature(&id, &timestamp, body);
        [
            (ID, value(id)),
            (TIMESTAMP, value(timestamp)),
            (SIGNATURE, value(signature)),
        ]
    }

    /// `v1,<base64>` of HMAC-SHA256 over `{id}.{timestamp}.{body}`.
    pub(crate) fn signature(&self, id: &str, timestamp: &str, body: &[u8]) -> String {
        let mut signed = hmac::Context::with_key(&self.key);
        for part in [id.as_bytes(), b".", timestamp.as_bytes(), b".", body] {
            signed.update(part);
        }
        format!("v1,{}", STANDARD.encode(signed.sign().as_ref()))
    }
}

/// A header value made of hex, digits and base64 only.
fn value(text: String) -> HeaderValue {
    HeaderValue::try_from(text).expect("ids, digits and base64 are header values")
}

/// Seconds since the epoch, as a sender stamps a delivery (0 for a clock before 1970, which
/// the proxy refuses as stale: every request an error, not a wrong measurement).
fn unix_seconds() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
