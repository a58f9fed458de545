//! Webhook deliveries: the provider's signature checked, and the event id read (SPEC §4.9).
//!
//! **Why verification comes before the claim.** On a webhook route the event id is the
//! idempotency key. Were the key claimed first, anyone who can reach the endpoint could send a
//! forged delivery carrying a real event id before the provider does: the forgery's (refused)
//! answer would be saved under that id, and the genuine delivery would get it replayed — the
//! event lost. So [`verify`] runs over the exact bytes of the body before anything is claimed
//! or forwarded, and only a verified delivery's id becomes a key. A delivery that fails gets
//! `401 webhook-signature-invalid`, with [`Rejection::detail`] as the detail and
//! [`Rejection::result`] as its label in `idemproxy_webhooks_total`.
//!
//! The schemes are the providers' published ones (`signature`); every one is HMAC-SHA256,
//! compared in constant time (`mac`). Secrets appear in no error, log or `Debug` output, and
//! neither does a computed signature.
//!
//! Order of the checks: the headers are read first (missing, then malformed), then the
//! signature, and only a matching signature has its timestamp checked. So `stale` counts
//! deliveries the provider really signed whose timestamp is off — a clock skew or a replayed
//! capture, which an operator can act on — and never forgeries, which are `bad_signature`.
//!
//! This module imports no store, upstream or proxy: it takes the request's head and body and
//! answers, and the proxy acts on the answer.
//!
//! # Example
//!
//! GitHub's documented delivery:
//!
//! ```
//! use std::time::{Duration, SystemTime};
//! use idemproxy::route::{PathPattern, Provider, Secrets, WebhookSettings};
//! use idemproxy::webhook::{self, Rejection};
//!
//! let settings = WebhookSettings {
//!     secrets: Secrets::parse("It's a Secret to Everybody\n", &Provider::Github)?,
//!     provider: Provider::Github,
//!     tolerance: Duration::from_secs(300),
//! };
//! let (head, ()) = http::Request::post("/webhooks/github")
//!     .header("X-Hub-Signature-256",
//!             "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17")
//!     .header("X-GitHub-Delivery", "72d3162e-cc78-11e3-81ab-4c9367dc0958")
//!     .body(())?
//!     .into_parts();
//! let path = PathPattern::parse("/webhooks/github")?;
//!
//! let verified = webhook::verify(&settings, &head, &path, b"Hello, World!", SystemTime::now())?;
//! let id = verified.event_id.expect("GitHub sends X-GitHub-Delivery");
//! assert_eq!(id.as_bytes(), b"72d3162e-cc78-11e3-81ab-4c9367dc0958");
//!
//! let forged = webhook::verify(&settings, &head, &path, b"Hello, World?", SystemTime::now());
//! assert_eq!(forged, Err(Rejection::NoMatch));
//! assert_eq!(Rejection::NoMatch.result(), "bad_signature");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Layout
//! - `signature`: each provider's headers read into what was signed and the signatures to try.
//! - `mac`: the HMAC, and the constant-time comparison.

mod mac;
mod signature;

#[cfg(test)]
mod props;
#[cfg(test)]
mod tests;

use std::fmt;
use std::time::{Duration, SystemTime};

use http::HeaderName;
use http::request::Parts;

use crate::key_from::{self, Value};
use crate::route::{PathPattern, Provider, WebhookSettings};

pub use signature::MAX_SIGNATURES;

/// A delivery whose signature a configured secret made, within the window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// The provider's event id, the delivery's idempotency key. `None` when the delivery
    /// carries none (SPEC §4.9: the id header missing; for `stripe` and `slack` a body that is
    /// not a JSON object or whose `id`/`event_id` is absent, empty or not a string; for `hmac`
    /// an `id` part that can't be read): the proxy forwards it without idempotency and counts
    /// it as `missing_key`.
    pub event_id: Option<EventId>,
}

/// A provider's event id: the bytes the proxy hashes into the delivery's store key.
///
/// A header's value as received; a JSON string's UTF-8 bytes; for an `hmac` `id` part, the
/// part's value as `key_from` reads it (a number in its canonical spelling, a boolean as
/// `true`/`false`). Never empty.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct EventId(Vec<u8>);

impl EventId {
    fn new(bytes: Vec<u8>) -> Option<EventId> {
        (!bytes.is_empty()).then_some(EventId(bytes))
    }

    /// The id's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The id's bytes, owned.
    pub fn into_bytes(self) -> Vec<u8> {
        self.0
    }
}

impl fmt::Debug for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Not a secret: an event id is in every provider's dashboard.
        write!(f, "EventId({:?})", String::from_utf8_lossy(&self.0))
    }
}

/// Why a delivery is refused: `401 webhook-signature-invalid`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejection {
    /// The scheme's signature header is absent.
    MissingSignature {
        /// The header the scheme signs with.
        header: HeaderName,
    },
    /// A header of the scheme is there but can't be read: repeated, not ASCII, not of the
    /// scheme's form, no signature of the expected version, a companion header (the signed id
    /// or timestamp) missing.
    Malformed {
        /// The header at fault.
        header: HeaderName,
        /// What is wrong, completing "{header} …" (never a secret or a signature).
        why: &'static str,
    },
    /// Well-formed, but no configured secret makes any of the signatures.
    NoMatch,
    /// A matching signature whose signed timestamp is outside `tolerance`.
    Stale {
        /// How far the timestamp is from the proxy's clock, in whole seconds.
        skew: Duration,
        /// Whether it is ahead of the clock (else behind).
        future: bool,
        /// The route's tolerance.
        tolerance: Duration,
    },
}

impl Rejection {
    /// The `result` label of `idemproxy_webhooks_total`: `missing_signature`,
    /// `bad_signature` (malformed, or no secret matches) or `stale`.
    pub fn result(&self) -> &'static str {
        match self {
            Rejection::MissingSignature { .. } => "missing_signature",
            Rejection::Malformed { .. } | Rejection::NoMatch => "bad_signature",
            Rejection::Stale { .. } => "stale",
        }
    }

    /// The 401's detail: which check failed, for a person. Never a secret, never a computed
    /// signature.
    pub fn detail(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rejection::MissingSignature { header } => {
                write!(f, "missing signature: the {header} header is absent")
            }
            Rejection::Malformed { header, why } => {
                write!(f, "malformed signature: the {header} header {why}")
            }
            Rejection::NoMatch => {
                f.write_str("bad signature: no configured secret makes the signature of this body")
            }
            Rejection::Stale {
                skew,
                future,
                tolerance,
            } => write!(
                f,
                "stale signature: the signed timestamp is {} {} the proxy's clock, outside the \
                 tolerance of {}",
                humantime::format_duration(*skew),
                if *future { "ahead of" } else { "behind" },
                humantime::format_duration(*tolerance),
            ),
        }
    }
}

impl std::error::Error for Rejection {}

/// Checks a delivery's signature and reads its event id.
///
/// `head` and `body` are the request as received (the body's exact bytes, already bounded by
/// `max_request_body`); `path` is the route's pattern (an `hmac` `id: path:NAME` reads its
/// segment); `now` is the clock the signed timestamp is checked against.
///
/// The work is bounded whatever a sender writes: at most [`MAX_SIGNATURES`] signatures are read
/// from a header, and the body is hashed once per configured secret.
pub fn verify(
    settings: &WebhookSettings,
    head: &Parts,
    path: &PathPattern,
    body: &[u8],
    now: SystemTime,
) -> Result<Verified, Rejection> {
    let headers = &head.headers;
    let signed = match &settings.provider {
        Provider::Standard => signature::standard(headers)?,
        Provider::Stripe => signature::stripe(headers)?,
        Provider::Github => signature::github(headers)?,
        Provider::Shopify => signature::shopify(headers)?,
        Provider::Slack => signature::slack(headers)?,
        Provider::Hmac(scheme) => signature::hmac(headers, scheme)?,
    };
    if !mac::any_secret_signs(&settings.secrets, &signed.pieces, body, &signed.candidates) {
        return Err(Rejection::NoMatch);
    }
    if let Some(timestamp) = signed.timestamp {
        within_tolerance(timestamp, now, settings.tolerance)?;
    }
    Ok(Verified {
        event_id: event_id(settings, head, path, body),
    })
}

/// The window, both ways, in whole seconds as the providers count it: the signed timestamp is
/// whole seconds, so the clock is read in whole seconds too (a delivery signed at `t` is
/// accepted until `t + tolerance`, inclusive).
fn within_tolerance(timestamp: u64, now: SystemTime, tolerance: Duration) -> Result<(), Rejection> {
    // A clock before 1970 is a broken clock: read it as 0 rather than fail every delivery.
    let now = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let future = timestamp > now;
    let skew = Duration::from_secs(timestamp.abs_diff(now));
    if skew > tolerance {
        return Err(Rejection::Stale {
            skew,
            future,
            tolerance,
        });
    }
    Ok(())
}

/// The event id of a verified delivery, where the provider puts it.
fn event_id(
    settings: &WebhookSettings,
    head: &Parts,
    path: &PathPattern,
    body: &[u8],
) -> Option<EventId> {
    let header = |name: &HeaderName| match signature::one(&head.headers, name) {
        signature::Lookup::One(value) => EventId::new(value.as_bytes().to_vec()),
        // Absent, or two lines: no one id.
        signature::Lookup::Absent | signature::Lookup::Repeated => None,
    };
    match &settings.provider {
        Provider::Standard => header(&signature::WEBHOOK_ID),
        Provider::Stripe => body_string(body, "id"),
        Provider::Github => header(&X_GITHUB_DELIVERY),
        Provider::Shopify => header(&X_SHOPIFY_WEBHOOK_ID),
        Provider::Slack => body_string(body, "event_id"),
        Provider::Hmac(scheme) => {
            // key_from's own reader: an `id` part reads exactly as the same `key_from` part.
            let value = key_from::read(std::slice::from_ref(&scheme.id), path, head, body)
                .ok()?
                .pop()?;
            EventId::new(match value {
                Value::Text(bytes) => bytes,
                Value::Number(canonical) => canonical.into_bytes(),
                Value::Bool(b) => b.to_string().into_bytes(),
            })
        }
    }
}

const X_GITHUB_DELIVERY: HeaderName = HeaderName::from_static("x-github-delivery");
const X_SHOPIFY_WEBHOOK_ID: HeaderName = HeaderName::from_static("x-shopify-webhook-id");

/// The string under `field` in a body that is a JSON object; `None` for anything else.
fn body_string(body: &[u8], field: &str) -> Option<EventId> {
    let mut object: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(body).ok()?;
    match object.remove(field)? {
        serde_json::Value::String(id) => EventId::new(id.into_bytes()),
        _ => None,
    }
}
