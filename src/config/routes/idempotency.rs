//! `routes[i].idempotency:`: a route's policy as written, its documented defaults, and how it is
//! checked and compiled into [`IdempotencySettings`], alone and against the other sections.

use std::time::Duration;

use http::HeaderName;
use serde::Deserialize;

use super::resolve::{self, RawResolve};
use crate::config::limits::RawLimits;
use crate::config::store::RawStore;
use crate::config::units::{at_most, bounds, byte_size, duration, show_size, size_at_most};
use crate::route::{
    FingerprintPart, IdempotencySettings, KeyPart, Mode, OnConflict, OnStoreError,
    OnUnknownOutcome, PathPattern,
};

/// `routes[i].idempotency:` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[serde(expecting = "idempotency settings: a mapping such as {ttl: 24h}")]
pub(crate) struct RawIdempotency {
    /// Request header carrying the key. Default `Idempotency-Key`. `None`: not written (a
    /// webhook route refuses it written).
    #[serde(default)]
    pub header: Option<String>,
    /// Missing key: 400 when true (default; `false` on a webhook route); forwarded without
    /// idempotency when false.
    #[serde(default)]
    pub required: Option<bool>,
    /// How long a finished response is replayed. Default 24h (7d on a webhook route).
    #[serde(default, with = "duration::option")]
    pub ttl: Option<Duration>,
    /// In-progress lease, renewed every `lock_ttl/3` while the upstream call runs. Default 10s.
    #[serde(default = "defaults::lock_ttl", with = "duration")]
    pub lock_ttl: Duration,
    /// Request headers whose values namespace the key. Default `[Authorization]` (`[]` on a
    /// webhook route).
    #[serde(default)]
    pub scope: Option<Vec<String>>,
    /// What makes two requests "the same". Default `[method, path, query, body]` (`[]` on a
    /// webhook route).
    #[serde(default)]
    pub fingerprint: Option<Vec<String>>,
    /// Parts to derive the key from when the request has no key header. Default: none.
    #[serde(default)]
    pub key_from: Vec<String>,
    /// `reject` (default) or `wait`.
    #[serde(default)]
    pub on_conflict: OnConflict,
    /// With `on_conflict: wait`, how long to wait. Default 5s.
    #[serde(default = "defaults::wait_timeout", with = "duration")]
    pub wait_timeout: Duration,
    /// `reject` (default) or `forward`.
    #[serde(default)]
    pub on_store_error: OnStoreError,
    /// Upstream statuses that are not saved. Default `[429, 503]` (`[408, 429, 500, 502, 503,
    /// 504]` on a webhook route).
    #[serde(default)]
    pub retry_statuses: Option<Vec<u16>>,
    /// `keep` (default; `release` on a webhook route), `release` or `resolve`.
    #[serde(default)]
    pub on_unknown_outcome: Option<OnUnknownOutcome>,
    /// With `on_unknown_outcome: resolve`, how to ask the upstream (and only then).
    #[serde(default)]
    pub resolve: Option<RawResolve>,
    /// Larger request bodies get 413. Default 1MiB.
    #[serde(default = "defaults::max_request_body", with = "byte_size")]
    pub max_request_body: u64,
    /// Larger responses reach the client but cannot be replayed. Default 8MiB.
    #[serde(default = "defaults::max_response_body", with = "byte_size")]
    pub max_response_body: u64,
    /// Save and replay `Set-Cookie`. Default false.
    #[serde(default)]
    pub replay_set_cookie: bool,
    /// Send the key header to the upstream. Default true.
    #[serde(default = "defaults::yes")]
    pub forward_key: bool,
    /// `enforce` (default) or `observe`: forward every request, count what enforce would do.
    #[serde(default)]
    pub mode: Mode,
}

impl Default for RawIdempotency {
    fn default() -> Self {
        RawIdempotency {
            header: None,
            required: None,
            ttl: None,
            lock_ttl: defaults::lock_ttl(),
            scope: None,
            fingerprint: None,
            key_from: Vec::new(),
            on_conflict: OnConflict::default(),
            wait_timeout: defaults::wait_timeout(),
            on_store_error: OnStoreError::default(),
            retry_statuses: None,
            on_unknown_outcome: None,
            resolve: None,
            max_request_body: defaults::max_request_body(),
            max_response_body: defaults::max_response_body(),
            replay_set_cookie: false,
            forward_key: true,
            mode: Mode::default(),
        }
    }
}

/// The documented defaults, one function each so serde and the docs agree.
mod defaults {
    use std::time::Duration;

    pub(super) fn header() -> String {
        "Idempotency-Key".to_owned()
    }
    pub(super) fn yes() -> bool {
        true
    }
    /// On a webhook route (SPEC §4.9): the signature is the caller's identity.
    pub(super) fn webhook_scope() -> Vec<String> {
        Vec::new()
    }
    /// On a webhook route: a signed id, or an id bound to its body, is the provider's word
    /// that two deliveries are one event, even when a counter in the body changed between
    /// attempts (Stripe's `pending_webhooks`).
    pub(super) fn webhook_fingerprint() -> Vec<String> {
        Vec::new()
    }
    /// On a webhook route: longer than every provider's redelivery window (Stripe retries for
    /// three days).
    pub(super) fn webhook_ttl() -> Duration {
        Duration::from_secs(7 * 24 * 3600)
    }
    /// On a webhook route: a handling whose answer was lost is released, so the provider's
    /// redelivery runs it again; a saved `504` would be replayed to every redelivery until
    /// the provider gives up, losing the event.
    pub(super) fn webhook_on_unknown_outcome() -> super::OnUnknownOutcome {
        super::OnUnknownOutcome::Release
    }
    /// On a webhook route: the provider redelivers on a non-2xx, and a failed handling should
    /// run again.
    pub(super) fn webhook_retry_statuses() -> Vec<u16> {
        vec![408, 429, 500, 502, 503, 504]
    }
    pub(super) fn ttl() -> Duration {
        Duration::from_secs(24 * 3600)
    }
    pub(super) fn lock_ttl() -> Duration {
        Duration::from_secs(10)
    }
    pub(super) fn scope() -> Vec<String> {
        vec!["Authorization".to_owned()]
    }
    pub(super) fn fingerprint() -> Vec<String> {
        ["method", "path", "query", "body"]
            .iter()
            .map(|s| (*s).to_owned())
            .collect()
    }
    pub(super) fn wait_timeout() -> Duration {
        Duration::from_secs(5)
    }
    pub(super) fn retry_statuses() -> Vec<u16> {
        vec![429, 503]
    }
    pub(super) fn max_request_body() -> u64 {
        1024 * 1024
    }
    pub(super) fn max_response_body() -> u64 {
        8 * 1024 * 1024
    }
}

/// The shortest lease accepted: renewal runs every `lock_ttl/3`, and a lease shorter than a few
/// store round trips would be lost by ordinary jitter.
const MIN_LOCK_TTL: Duration = Duration::from_millis(30);

impl RawIdempotency {
    /// Checks the policy and compiles it. `pattern` is the route's path, when it parsed, for
    /// `key_from` parts that name a segment of it; `webhook`: the route has a `webhook:` block,
    /// whose defaults (SPEC §4.9) apply to the fields not written. `None`: an error was
    /// reported.
    pub(super) fn validate(
        &self,
        path: &str,
        pattern: Option<&PathPattern>,
        webhook: bool,
        err: &mut impl FnMut(String, String),
    ) -> Option<IdempotencySettings> {
        let ttl = self.ttl.unwrap_or_else(|| {
            if webhook {
                defaults::webhook_ttl()
            } else {
                defaults::ttl()
            }
        });
        let on_unknown_outcome = self.on_unknown_outcome.unwrap_or_else(|| {
            if webhook {
                defaults::webhook_on_unknown_outcome()
            } else {
                OnUnknownOutcome::default()
            }
        });
        self.check_bounds(path, ttl, err);
        let header_text = self.header.clone().unwrap_or_else(defaults::header);
        let header = header_name(&header_text, format!("{path}.header"), err);
        let required = self.required.unwrap_or(!webhook);
        let retry_statuses = self.retry_statuses.clone().unwrap_or_else(|| {
            if webhook {
                defaults::webhook_retry_statuses()
            } else {
                defaults::retry_statuses()
            }
        });
        let durations = self.check_durations(path, ttl, err);
        let scope = self.scope(path, webhook, err);
        let fingerprint = self.fingerprint(path, webhook, err);
        let key_from = self.key_from(path, pattern, err);
        let statuses = check_retry_statuses(&retry_statuses, path, err);
        let bodies = self.check_bodies(path, err);
        let resolve = resolve::validate(
            on_unknown_outcome,
            self.resolve.as_ref(),
            path,
            pattern,
            scope.as_deref(),
            err,
        );
        match (header, scope, fingerprint, key_from, resolve) {
            (Some(header), Some(scope), Some(fingerprint), Some(key_from), Some(resolve))
                if durations && statuses && bodies =>
            {
                Some(IdempotencySettings {
                    header,
                    required,
                    ttl,
                    lock_ttl: self.lock_ttl,
                    scope,
                    fingerprint,
                    on_conflict: self.on_conflict,
                    wait_timeout: self.wait_timeout,
                    on_store_error: self.on_store_error,
                    retry_statuses,
                    on_unknown_outcome,
                    resolve,
                    max_request_body: self.max_request_body,
                    max_response_body: self.max_response_body,
                    replay_set_cookie: self.replay_set_cookie,
                    forward_key: self.forward_key,
                    key_from,
                    mode: self.mode,
                })
            }
            _ => None,
        }
    }

    /// The largest values (see [`bounds`]).
    fn check_bounds(&self, path: &str, ttl: Duration, err: &mut impl FnMut(String, String)) {
        at_most(err, &format!("{path}.ttl"), ttl, bounds::TTL);
        at_most(
            err,
            &format!("{path}.lock_ttl"),
            self.lock_ttl,
            bounds::LOCK_TTL,
        );
        at_most(
            err,
            &format!("{path}.wait_timeout"),
            self.wait_timeout,
            bounds::WAIT_TIMEOUT,
        );
        size_at_most(
            err,
            &format!("{path}.max_request_body"),
            self.max_request_body,
            bounds::BODY,
        );
        size_at_most(
            err,
            &format!("{path}.max_response_body"),
            self.max_response_body,
            bounds::BODY,
        );
    }

    /// The smallest durations. False: an error was reported.
    fn check_durations(
        &self,
        path: &str,
        ttl: Duration,
        err: &mut impl FnMut(String, String),
    ) -> bool {
        let mut ok = true;
        if ttl.is_zero() {
            err(format!("{path}.ttl"), "must be greater than zero".into());
            ok = false;
        }
        if self.lock_ttl < MIN_LOCK_TTL {
            err(
                format!("{path}.lock_ttl"),
                format!(
                    "must be at least {} (the lease is renewed every lock_ttl/3)",
                    humantime::format_duration(MIN_LOCK_TTL)
                ),
            );
            ok = false;
        }
        if self.on_conflict == OnConflict::Wait && self.wait_timeout.is_zero() {
            err(
                format!("{path}.wait_timeout"),
                "must be greater than zero with on_conflict: wait".into(),
            );
            ok = false;
        }
        ok
    }

    /// `None`: an error was reported.
    fn scope(
        &self,
        path: &str,
        webhook: bool,
        err: &mut impl FnMut(String, String),
    ) -> Option<Vec<HeaderName>> {
        let written = self.scope.clone().unwrap_or_else(|| {
            if webhook {
                defaults::webhook_scope()
            } else {
                defaults::scope()
            }
        });
        let mut ok = true;
        let mut scope = Vec::new();
        for (j, s) in written.iter().enumerate() {
            match header_name(s, format!("{path}.scope[{j}]"), err) {
                Some(h) => scope.push(h),
                None => ok = false,
            }
        }
        ok.then_some(scope)
    }

    /// `None`: an error was reported.
    fn fingerprint(
        &self,
        path: &str,
        webhook: bool,
        err: &mut impl FnMut(String, String),
    ) -> Option<Vec<FingerprintPart>> {
        let written = self.fingerprint.clone().unwrap_or_else(|| {
            if webhook {
                defaults::webhook_fingerprint()
            } else {
                defaults::fingerprint()
            }
        });
        let mut ok = true;
        let mut parts = Vec::new();
        for (j, f) in written.iter().enumerate() {
            match fingerprint_part(f, format!("{path}.fingerprint[{j}]"), err) {
                Some(p) => parts.push(p),
                None => ok = false,
            }
        }
        ok.then_some(parts)
    }

    /// `None`: an error was reported.
    fn key_from(
        &self,
        path: &str,
        pattern: Option<&PathPattern>,
        err: &mut impl FnMut(String, String),
    ) -> Option<Vec<KeyPart>> {
        let mut ok = true;
        let mut parts = Vec::new();
        for (j, text) in self.key_from.iter().enumerate() {
            let field = format!("{path}.key_from[{j}]");
            match KeyPart::parse(text) {
                Ok(KeyPart::Path(name)) if pattern.is_some_and(|p| !p.has_param(&name)) => {
                    err(
                        field,
                        format!(
                            "path:{name} names no segment of the route's path {:?}; write the path with {{{name}}}",
                            pattern.map(|p| p.as_str()).unwrap_or("")
                        ),
                    );
                    ok = false;
                }
                Ok(part) => parts.push(part),
                Err(message) => {
                    err(field, message);
                    ok = false;
                }
            }
        }
        ok.then_some(parts)
    }

    /// Whether `header:` or `key_from:` is written: a webhook route refuses either, its key
    /// being the event id (SPEC §4.9).
    pub(super) fn names_a_key(&self) -> (bool, bool) {
        (self.header.is_some(), !self.key_from.is_empty())
    }

    /// The smallest body sizes. False: an error was reported.
    fn check_bodies(&self, path: &str, err: &mut impl FnMut(String, String)) -> bool {
        let mut ok = true;
        if self.max_request_body == 0 {
            err(
                format!("{path}.max_request_body"),
                "must be greater than zero".into(),
            );
            ok = false;
        }
        if self.max_response_body == 0 {
            err(
                format!("{path}.max_response_body"),
                "must be greater than zero: at 0 no response with a body could be replayed".into(),
            );
            ok = false;
        }
        ok
    }

    /// The refusals of SPEC §4.5 that join a route to another section: each names the route's
    /// field and, in its message, the other one.
    pub(super) fn across_sections(
        &self,
        path: &str,
        limits: &RawLimits,
        store: &RawStore,
        err: &mut impl FnMut(String, String),
    ) {
        let pending = limits.max_pending_save_bytes;
        // A save the store refused is retried from memory, within these bytes; a response that
        // can never fit is given up at once, and its key answers `result-not-kept` for ever.
        if pending > 0 && self.max_response_body > pending {
            err(
                format!("{path}.max_response_body"),
                format!(
                    "{} is more than limits.max_pending_save_bytes ({}): a response this large could never be kept while its save is retried; lower it or raise limits.max_pending_save_bytes",
                    show_size(self.max_response_body),
                    show_size(pending)
                ),
            );
        }
        // A claim answered later than `lock_ttl` after it was sent is released unused (its
        // lease may have expired), so a store deadline at or past the lease turns every slow
        // answer into a 503 and leaves no margin for renewal.
        let timeout = store.timeout;
        if self.lock_ttl >= MIN_LOCK_TTL && !timeout.is_zero() && timeout >= self.lock_ttl {
            err(
                format!("{path}.lock_ttl"),
                format!(
                    "{} must be longer than store.timeout ({}): a claim answered after its lease could have expired forwards nothing; raise lock_ttl or lower store.timeout",
                    humantime::format_duration(self.lock_ttl),
                    humantime::format_duration(timeout)
                ),
            );
        }
    }
}

/// False: an error was reported.
fn check_retry_statuses(
    statuses: &[u16],
    path: &str,
    err: &mut impl FnMut(String, String),
) -> bool {
    let mut ok = true;
    for (j, s) in statuses.iter().enumerate() {
        if !(100..=599).contains(s) {
            err(
                format!("{path}.retry_statuses[{j}]"),
                format!("invalid HTTP status {s}; expected 100 to 599"),
            );
            ok = false;
        }
    }
    ok
}

/// One part of `fingerprint:`. `None`: an error was reported at `field`.
fn fingerprint_part(
    text: &str,
    field: String,
    err: &mut impl FnMut(String, String),
) -> Option<FingerprintPart> {
    match text {
        "method" => Some(FingerprintPart::Method),
        "path" => Some(FingerprintPart::Path),
        "query" => Some(FingerprintPart::Query),
        "body" => Some(FingerprintPart::Body),
        "json" => Some(FingerprintPart::Json),
        other => match other.strip_prefix("header:") {
            Some(name) => header_name(name.trim(), field, err).map(FingerprintPart::Header),
            None => {
                err(
                    field,
                    format!(
                        "unknown fingerprint part {other:?}; expected method, path, query, body, json or header:NAME"
                    ),
                );
                None
            }
        },
    }
}

fn header_name(
    text: &str,
    path: String,
    err: &mut impl FnMut(String, String),
) -> Option<HeaderName> {
    match HeaderName::from_bytes(text.as_bytes()) {
        Ok(h) => Some(h),
        Err(_) => {
            err(path, format!("invalid header name {text:?}"));
            None
        }
    }
}
