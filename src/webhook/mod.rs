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
//! use idemproxy::webhook::{self, Event, Rejection};
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
//! // GitHub signs the body alone: the event is the body, and the delivery id only a label.
//! assert!(matches!(verified.event, Some(Event::Body { .. })));
//! assert_eq!(verified.label.as_deref(), Some("72d3162e-cc78-11e3-81ab-4c9367dc0958"));
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

use sha2::{Digest, Sha256};

use crate::key_from::{self, Value};
use crate::route::{self, KeyPart, PathPattern, Provider, WebhookSettings};

pub use signature::MAX_SIGNATURES;

/// A delivery whose signature a configured secret made, within the window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// What the delivery is keyed by. `None` when it carries no event id (SPEC §4.9: for
    /// `stripe` and `slack` a body that is not a JSON object or whose `id`/`event_id` is
    /// absent, empty or not a string; for `hmac` with a `json:` id, a pointer that can't be
    /// read): the proxy forwards it without idempotency and counts it as `missing_key`.
    pub event: Option<Event>,
    /// The id the provider sent beside a body it signed alone (`X-GitHub-Delivery`,
    /// `X-Shopify-Webhook-Id`, an `hmac` id that is not a `json:` part): unsigned, so only a
    /// label for the logs, never part of the key.
    pub label: Option<String>,
    /// The values of the route path's `{NAME}` segments, read from the normalised path (lower
    /// case, so every spelling of one tenant is one tenant), in the pattern's order: they
    /// namespace the key.
    pub namespace: Vec<String>,
}

impl Verified {
    /// The text the proxy hashes (with the route's scope) into the delivery's store key:
    /// `webhook:<hex id>` for a signed id (as before tenants namespaced keys, so a route
    /// without `{NAME}` segments keeps its records), `webhook-body:<hex sha256>[:<hex topic>]`
    /// for a signed body, then `/<hex value>` for each `{NAME}` segment. Hex keeps every
    /// separator out of the values, so no two deliveries share a text unless they share an
    /// event. `None` when the delivery carries no event.
    pub fn key_text(&self) -> Option<String> {
        let mut text = match self.event.as_ref()? {
            Event::Id(id) => format!("webhook:{}", hex::encode(id.as_bytes())),
            Event::Body { sha256, topic } => {
                let mut text = format!("webhook-body:{}", hex::encode(sha256));
                if let Some(topic) = topic {
                    text.push(':');
                    text.push_str(&hex::encode(topic));
                }
                text
            }
        };
        for value in &self.namespace {
            text.push('/');
            text.push_str(&hex::encode(value));
        }
        Some(text)
    }
}

/// What a verified delivery is keyed by: what the provider signed as its event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A signed event id: `standard`'s `webhook-id`, the body's `id` (`stripe`) or `event_id`
    /// (`slack`), an `hmac` `json:` id.
    Id(EventId),
    /// A body the provider signed alone (`github`, `shopify`, another `hmac`): the event is
    /// the body, with the topic the provider sends beside it (`X-GitHub-Event`,
    /// `X-Shopify-Topic`: Shopify sends two topics with byte-identical bodies).
    Body {
        /// The body's SHA-256.
        sha256: [u8; 32],
        /// The topic header's value, where the provider sends one.
        topic: Option<Vec<u8>>,
    },
}

impl Event {
    /// Where the key came from, as the request log says it: `event_id` or `body`.
    pub fn source(&self) -> &'static str {
        match self {
            Event::Id(_) => "event_id",
            Event::Body { .. } => "body",
        }
    }

    /// The event as a resolve lookup's `{key}` reads it: a signed id as sent, a body's SHA-256
    /// in hex (never the unsigned label, which anyone can write).
    pub fn lookup_text(&self) -> String {
        match self {
            Event::Id(id) => String::from_utf8_lossy(id.as_bytes()).into_owned(),
            Event::Body { sha256, .. } => hex::encode(sha256),
        }
    }
}

/// A provider's signed event id.
///
/// A header's value as received; a JSON string's UTF-8 bytes; for an `hmac` `json:` id, the
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

/// Checks what a delivery's head must show before its body is read (SPEC §4.9, "nothing
/// unsigned is read"): the scheme's signature header (and, for the schemes that sign one, its
/// timestamp and id), present and well formed. [`verify`] checks them again with the body.
pub fn check_head(settings: &WebhookSettings, head: &Parts) -> Result<(), Rejection> {
    read_head(settings, &head.headers).map(drop)
}

/// Checks a delivery's signature and reads its event.
///
/// `head` and `body` are the request as received (the body's exact bytes, already bounded by
/// `max_request_body`); `path` is the route's pattern (its `{NAME}` segments namespace the key,
/// read from the normalised request path; an `hmac` `id: path:NAME` reads its segment); `now`
/// is the clock the signed timestamp is checked against.
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
    let signed = read_head(settings, &head.headers)?;
    if !mac::any_secret_signs(&settings.secrets, &signed.pieces, body, &signed.candidates) {
        return Err(Rejection::NoMatch);
    }
    if let Some(timestamp) = signed.timestamp {
        within_tolerance(timestamp, now, settings.tolerance)?;
    }
    let (event, label) = event(settings, head, path, body, signed.id);
    Ok(Verified {
        event,
        label,
        namespace: namespace(head, path),
    })
}

/// The first header that `Connection` names as hop-by-hop among those the scheme reads (its
/// signature, timestamp, id, topic and label headers) and those `also` says the key reads (the
/// route's scope and fingerprinted headers). Such a header would be stripped on its way to the
/// handler, which would then get a delivery other than the one verified: refused, `400
/// hop-by-hop-conflict`.
pub fn named_in_connection(
    settings: &WebhookSettings,
    headers: &http::HeaderMap,
    also: impl Fn(&HeaderName) -> bool,
) -> Option<HeaderName> {
    let read = headers_read(&settings.provider);
    headers
        .get_all(http::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .find(|name| read.contains(name) || also(name))
}

/// Every header a provider's scheme reads.
fn headers_read(provider: &Provider) -> Vec<HeaderName> {
    use signature::*;
    match provider {
        Provider::Standard => vec![
            WEBHOOK_ID,
            WEBHOOK_TIMESTAMP,
            WEBHOOK_SIGNATURE,
            SVIX_ID,
            SVIX_TIMESTAMP,
            SVIX_SIGNATURE,
        ],
        Provider::Stripe => vec![STRIPE_SIGNATURE],
        Provider::Github => vec![X_HUB_SIGNATURE_256, X_GITHUB_EVENT, X_GITHUB_DELIVERY],
        Provider::Shopify => vec![
            X_SHOPIFY_HMAC_SHA256,
            X_SHOPIFY_TOPIC,
            X_SHOPIFY_WEBHOOK_ID,
            X_SHOPIFY_EVENT_ID,
        ],
        Provider::Slack => vec![X_SLACK_SIGNATURE, X_SLACK_REQUEST_TIMESTAMP],
        Provider::Hmac(scheme) => {
            let mut read = vec![scheme.signature_header.clone()];
            if let KeyPart::Header(name) = &scheme.id {
                read.push(name.clone());
            }
            read
        }
    }
}

/// The provider's signature headers, read.
fn read_head<'h>(
    settings: &WebhookSettings,
    headers: &'h http::HeaderMap,
) -> Result<signature::Signed<'h>, Rejection> {
    match &settings.provider {
        Provider::Standard => signature::standard(headers),
        Provider::Stripe => signature::stripe(headers),
        Provider::Github => signature::github(headers),
        Provider::Shopify => signature::shopify(headers),
        Provider::Slack => signature::slack(headers),
        Provider::Hmac(scheme) => signature::hmac(headers, scheme),
    }
}

/// The values of the pattern's `{NAME}` segments in the normalised request path.
fn namespace(head: &Parts, path: &PathPattern) -> Vec<String> {
    let normalised = route::normalise(head.uri.path());
    path.params()
        .map(|name| {
            path.capture_normalised(&normalised, name)
                .unwrap_or_default()
                .to_owned()
        })
        .collect()
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

/// The event of a verified delivery, where the provider puts it, and the unsigned label sent
/// beside a body signed alone. `signed_id`: the id the scheme signed (`standard`'s).
fn event(
    settings: &WebhookSettings,
    head: &Parts,
    path: &PathPattern,
    body: &[u8],
    signed_id: Option<&[u8]>,
) -> (Option<Event>, Option<String>) {
    let header = |name: &HeaderName| match signature::one(&head.headers, name) {
        signature::Occurrence::One(value) => Some(value.as_bytes().to_vec()),
        // Absent, or two lines: no one value.
        signature::Occurrence::Absent | signature::Occurrence::Repeated => None,
    };
    let label = |name: &HeaderName| {
        header(name)
            .filter(|v| !v.is_empty())
            .map(|v| String::from_utf8_lossy(&v).into_owned())
    };
    let by_body = |topic: Option<Vec<u8>>| Event::Body {
        sha256: Sha256::digest(body).into(),
        topic,
    };
    match &settings.provider {
        Provider::Standard => (
            signed_id
                .and_then(|id| EventId::new(id.to_vec()))
                .map(Event::Id),
            None,
        ),
        Provider::Stripe => (body_string(body, "id").map(Event::Id), None),
        Provider::Slack => (body_string(body, "event_id").map(Event::Id), None),
        Provider::Github => (
            Some(by_body(header(&X_GITHUB_EVENT))),
            label(&X_GITHUB_DELIVERY),
        ),
        Provider::Shopify => (
            Some(by_body(header(&X_SHOPIFY_TOPIC))),
            label(&X_SHOPIFY_WEBHOOK_ID).or_else(|| label(&X_SHOPIFY_EVENT_ID)),
        ),
        Provider::Hmac(scheme) => {
            // key_from's own reader: an `id` part reads exactly as the same `key_from` part.
            let id = key_from::read(std::slice::from_ref(&scheme.id), path, head, body)
                .ok()
                .and_then(|mut values| values.pop())
                .and_then(|value| {
                    EventId::new(match value {
                        Value::Text(bytes) => bytes,
                        Value::Number(canonical) => canonical.into_bytes(),
                        Value::Bool(b) => b.to_string().into_bytes(),
                    })
                });
            if matches!(scheme.id, KeyPart::Json(_)) {
                // The id is inside the signed body: signed, so it is the event.
                (id.map(Event::Id), None)
            } else {
                let label = id.map(|id| String::from_utf8_lossy(id.as_bytes()).into_owned());
                (Some(by_body(None)), label)
            }
        }
    }
}

const X_GITHUB_DELIVERY: HeaderName = HeaderName::from_static("x-github-delivery");
const X_GITHUB_EVENT: HeaderName = HeaderName::from_static("x-github-event");
const X_SHOPIFY_WEBHOOK_ID: HeaderName = HeaderName::from_static("x-shopify-webhook-id");
const X_SHOPIFY_EVENT_ID: HeaderName = HeaderName::from_static("x-shopify-event-id");
const X_SHOPIFY_TOPIC: HeaderName = HeaderName::from_static("x-shopify-topic");

/// The string under `field` in a body that is a JSON object; `None` for anything else.
fn body_string(body: &[u8], field: &str) -> Option<EventId> {
    let mut object: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(body).ok()?;
    match object.remove(field)? {
        serde_json::Value::String(id) => EventId::new(id.into_bytes()),
        _ => None,
    }
}
