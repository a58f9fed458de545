//! Admission: what a request on an idempotent route must show before anything is claimed — a
//! valid key, a body within bounds — and the fingerprint that tells a repeat from a different
//! request. Every refusal here happens before the claim, so it holds no key.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::request::Parts;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;

use super::context::Context;
use super::resolve::{Lookup, render_lookup};
use crate::fingerprint::{self, Fingerprint};
use crate::jsonrpc::Call;
use crate::key::{self, KeyError, StoreKey};
use crate::key_from;
use crate::metrics::Outcome;
use crate::problem::Problem;
use crate::route::{FingerprintPart, IdempotencySettings, KeyPart};
use crate::upstream;
use crate::webhook::Event;

/// A request that may be claimed.
pub(crate) struct Admitted {
    pub parts: Parts,
    pub body: Bytes,
    pub key: StoreKey,
    pub fingerprint: Fingerprint,
    /// Where the key came from, for the request log and the derived-key count.
    pub origin: KeyOrigin,
    /// On a route under `on_unknown_outcome: resolve`, its lookup for this request, rendered
    /// before the claim so that the claim can carry it.
    pub lookup: Option<Lookup>,
    /// On a JSON-RPC route, the call (SPEC §4.10): its answer is read, saved and replayed as
    /// the call's.
    pub call: Option<Arc<Call>>,
}

/// Where an admitted request's key came from, as the request log's `key_source` says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyOrigin {
    /// The key header, as the client sent it.
    Header,
    /// Derived from the request's parts (`key_from`).
    Derived,
    /// A webhook delivery's signed event id.
    EventId,
    /// A webhook delivery's signed body (the provider signs no id).
    Body,
}

impl KeyOrigin {
    /// `header`, `derived`, `event_id` or `body`.
    pub fn as_str(self) -> &'static str {
        match self {
            KeyOrigin::Header => "header",
            KeyOrigin::Derived => "derived",
            KeyOrigin::EventId => "event_id",
            KeyOrigin::Body => "body",
        }
    }
}

/// Where a request's key comes from, as far as its head tells.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// The key header, parsed.
    Header(String),
    /// No key header, and the route derives one (`key_from`) once the body is read.
    Derive,
    /// No key header on a route that does not require one and derives none: plain traffic.
    None,
}

/// What admission decided.
pub(super) enum Admission {
    /// Claim it.
    Admitted(Admitted),
    /// No key on a route that does not require one: plain traffic.
    NoKey(Parts, Incoming),
    /// Refused, nothing claimed.
    Refused(Problem, Outcome),
}

/// Reads the key, the body and the fingerprint.
pub(super) async fn admit(context: &Context, parts: Parts, incoming: Incoming) -> Admission {
    let (idem, limits) = (&*context.policy, &context.limits);
    let source = match check_head(idem, &parts) {
        Ok(KeySource::None) => return Admission::NoKey(parts, incoming),
        Ok(source) => source,
        Err((problem, outcome)) => return Admission::Refused(problem, outcome),
    };
    let read = read_body(incoming, idem.max_request_body);
    let body = match tokio::time::timeout(limits.body_read_timeout, read)
        .await
        .unwrap_or(Err(Problem::BodyTimeout {
            after: limits.body_read_timeout,
        })) {
        Ok(b) => b,
        Err(p) => {
            let outcome = if matches!(p, Problem::BodyTooLarge { .. }) {
                Outcome::TooLarge
            } else {
                Outcome::BadRequest
            };
            return Admission::Refused(p, outcome);
        }
    };
    match with_body(context, source, parts, body, None) {
        Ok(admitted) => Admission::Admitted(admitted),
        Err(underived) => Admission::Refused(underived.problem, Outcome::InvalidKey),
    }
}

/// A webhook delivery's body, read before anything else (SPEC §4.9): a declared or actual
/// length over `max_request_body` is a 413, a body that does not arrive in time a 408.
pub(super) async fn read_delivery(
    context: &Context,
    parts: &Parts,
    incoming: Incoming,
) -> Result<Bytes, (Problem, Outcome)> {
    let (idem, limits) = (&*context.policy, &context.limits);
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let too_large = Problem::BodyTooLarge {
        limit: idem.max_request_body,
    };
    if declared.is_some_and(|n| n > idem.max_request_body) {
        return Err((too_large, Outcome::TooLarge));
    }
    let read = read_body(incoming, idem.max_request_body);
    tokio::time::timeout(limits.body_read_timeout, read)
        .await
        .unwrap_or(Err(Problem::BodyTimeout {
            after: limits.body_read_timeout,
        }))
        .map_err(|p| {
            let outcome = if matches!(p, Problem::BodyTooLarge { .. }) {
                Outcome::TooLarge
            } else {
                Outcome::BadRequest
            };
            (p, outcome)
        })
}

/// A verified webhook delivery, admitted under its event: the event is the only key (a
/// delivery's own key header plays no part), namespaced by the route's `scope` like any key;
/// `key_text` is the text hashed into it (`Verified::key_text`: the event, and the route path's
/// `{NAME}` segments).
pub(super) fn webhook_delivery(
    context: &Context,
    parts: Parts,
    body: Bytes,
    event: &Event,
    key_text: &str,
) -> Result<Admitted, Problem> {
    let (route, idem) = (&context.route, &*context.policy);
    let fingerprint = fingerprint::compute(&idem.fingerprint, &parts, &body);
    let id = key::key_id(&idem.scope, &parts.headers, key_text);
    let origin = match event {
        Event::Id(_) => KeyOrigin::EventId,
        Event::Body { .. } => KeyOrigin::Body,
    };
    // Under `resolve`, `{key}` is the signed event id as the handler receives it (a body's
    // SHA-256 where the body is the event).
    let lookup = lookup_for(context, &parts, &body, &event.lookup_text())?;
    Ok(Admitted {
        key: route.store_key(id),
        parts,
        body,
        fingerprint,
        origin,
        lookup,
        call: None,
    })
}

/// On a route under `on_unknown_outcome: resolve`, its lookup for this request, rendered before
/// the claim so that the claim can carry it; `key` is the key as the upstream gets it. A part
/// that can't be read is `400 unreadable-key-part`: nothing is claimed (SPEC §4.8).
fn lookup_for(
    context: &Context,
    parts: &Parts,
    body: &Bytes,
    key: &str,
) -> Result<Option<Lookup>, Problem> {
    let (route, idem) = (&context.route, &*context.policy);
    let Some(resolve) = &idem.resolve else {
        return Ok(None);
    };
    let upstream = route.upstream.name();
    render_lookup(resolve, upstream, &route.settings.path, parts, body, key)
        .map(Some)
        .map_err(|e| Problem::UnreadableLookupPart {
            detail: format!("resolve.request part {} cannot be read: {}", e.part, e.why),
        })
}

/// A request whose key a `key_from` part could not be derived from, handed back whole (an
/// observed route forwards it all the same). Boxed: it is the rare path, and as large as the
/// request head.
pub(super) struct Underived {
    pub problem: Problem,
    pub parts: Parts,
    pub body: Bytes,
}

/// The fingerprint and the key of a request whose head passed [`check_head`] (`source`) and
/// whose body has been read. A JSON-RPC call (`call`) is fingerprinted by its method and
/// params, never by the body that carries its `id` (SPEC §4.10).
pub(super) fn with_body(
    context: &Context,
    source: KeySource,
    mut parts: Parts,
    body: Bytes,
    call: Option<Arc<Call>>,
) -> Result<Admitted, Box<Underived>> {
    let (route, idem) = (&context.route, &*context.policy);
    let fingerprint = match &call {
        Some(call) => fingerprint::of_call(&idem.fingerprint, &parts, &call.fingerprint_bytes()),
        None => fingerprint::compute(&idem.fingerprint, &parts, &body),
    };
    let mut derived_key: Option<String> = None;
    let (id, origin) = match &source {
        KeySource::Header(raw_key) => (
            key::key_id(&idem.scope, &parts.headers, raw_key),
            KeyOrigin::Header,
        ),
        KeySource::Derive | KeySource::None => {
            let values = match key_from::read(&idem.key_from, &route.settings.path, &parts, &body) {
                Ok(v) => v,
                Err(e) => {
                    let problem = Problem::UnreadableKeyPart {
                        detail: e.to_string(),
                    };
                    return Err(Box::new(Underived {
                        problem,
                        parts,
                        body,
                    }));
                }
            };
            let derived =
                key_from::derived_key(&idem.key_from, &values, &idem.scope, &parts.headers);
            // With forward_key, the upstream gets the derived key in the key header, as a
            // caller's key would arrive: a stable value that differs between callers. A key
            // header a JSON-RPC call sent all the same (its key comes from `key_from` alone) is
            // forwarded as it came.
            if idem.forward_key
                && !parts.headers.contains_key(&idem.header)
                && let Ok(v) = HeaderValue::from_str(&derived)
            {
                parts.headers.insert(idem.header.clone(), v);
            }
            let id = key_from::derived_id(&derived);
            derived_key = Some(derived);
            (id, KeyOrigin::Derived)
        }
    };
    // The key as the upstream gets it: the header as the client sent it, or the derived key.
    let upstream_key = match &source {
        KeySource::Header(parsed) => parts
            .headers
            .get(&idem.header)
            .and_then(|v| v.to_str().ok())
            .unwrap_or(parsed),
        KeySource::Derive | KeySource::None => derived_key.as_deref().unwrap_or(""),
    };
    let lookup = match lookup_for(context, &parts, &body, upstream_key) {
        Ok(lookup) => lookup,
        Err(problem) => {
            return Err(Box::new(Underived {
                problem,
                parts,
                body,
            }));
        }
    };
    Ok(Admitted {
        lookup,
        key: route.store_key(id),
        parts,
        body,
        fingerprint,
        origin,
        call,
    })
}

/// Where a JSON-RPC call's key comes from (SPEC §4.10): `key_from` alone when the route writes
/// it (a key header is then forwarded as any header, so a session-wide header cannot make two
/// calls one), else the key header, as [`check_head`] reads it.
pub(super) fn call_key_source(
    idem: &IdempotencySettings,
    parts: &Parts,
) -> Result<KeySource, (Problem, Outcome)> {
    if idem.key_from.is_empty() {
        return check_head(idem, parts);
    }
    if let Some(header) = named_in_connection(idem, &parts.headers) {
        return Err((Problem::HopByHopConflict { header }, Outcome::InvalidKey));
    }
    Ok(KeySource::Derive)
}

/// What the request head alone decides, before any body byte is read or anything is claimed:
/// where the key comes from, or a refusal. A key header wins over `key_from`. Pure, so the fuzz
/// target runs it on arbitrary heads.
pub fn check_head(
    idem: &IdempotencySettings,
    parts: &Parts,
) -> Result<KeySource, (Problem, Outcome)> {
    let source = match key::from_headers(&parts.headers, &idem.header) {
        Ok(k) => KeySource::Header(k),
        // `key_from` applies whether or not the route is `required`.
        Err(KeyError::Missing(_)) if !idem.key_from.is_empty() => KeySource::Derive,
        Err(KeyError::Missing(_)) if !idem.required => return Ok(KeySource::None),
        Err(KeyError::Missing(header)) => {
            return Err((Problem::MissingKey { header }, Outcome::MissingKey));
        }
        Err(e) => {
            return Err((
                Problem::InvalidKey {
                    detail: e.to_string(),
                },
                Outcome::InvalidKey,
            ));
        }
    };
    if let Some(header) = named_in_connection(idem, &parts.headers) {
        // Counted as observe mode counts it (`would="invalid_key"`: the key can't be used as
        // sent), so a rollout's observed counts and its enforced ones line up.
        return Err((Problem::HopByHopConflict { header }, Outcome::InvalidKey));
    }
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > idem.max_request_body) {
        return Err((
            Problem::BodyTooLarge {
                limit: idem.max_request_body,
            },
            Outcome::TooLarge,
        ));
    }
    Ok(source)
}

/// The first header that idempotency reads (the key header, a scope header, a fingerprinted
/// header, a `key_from` header) and that `Connection` names as hop-by-hop. Such a header would be stripped before the
/// upstream although the key, its namespace or the fingerprint came from it: the upstream would
/// run an operation the proxy recorded under other terms, so the request is refused.
fn named_in_connection(idem: &IdempotencySettings, headers: &HeaderMap) -> Option<HeaderName> {
    let used = |name: &HeaderName| {
        *name == idem.header
            || idem.scope.contains(name)
            || idem
                .fingerprint
                .iter()
                .any(|p| matches!(p, FingerprintPart::Header(h) if h == name))
            || idem
                .key_from
                .iter()
                .any(|p| matches!(p, KeyPart::Header(h) if h == name))
    };
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .find(|name| used(name))
}

/// Reads the request body, refusing more than `limit` bytes (413) before anything is claimed
/// (a declared `Content-Length` over the limit was refused by [`check_head`] already).
async fn read_body(incoming: Incoming, limit: u64) -> Result<Bytes, Problem> {
    let limited = Limited::new(incoming, usize::try_from(limit).unwrap_or(usize::MAX));
    match limited.collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            Err(Problem::BodyTooLarge { limit })
        }
        Err(e) => Err(Problem::BadRequestBody {
            detail: upstream::error_chain(e.as_ref()),
        }),
    }
}
