//! `routes:`: which requests go where, and each idempotent route's policy, compiled into the
//! [`RouteSettings`] the proxy matches against.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use http::{HeaderName, Method};
use serde::{Deserialize, Deserializer};

use super::ConfigWarning;
use super::limits::RawLimits;
use super::resolve::{self, RawResolve};
use super::store::{RawStore, StoreSettings};
use super::units::{at_most, bounds, byte_size, duration, show_size, size_at_most};
use super::upstream::RawUpstream;
use crate::route::KeyPart;
use crate::route::{
    FingerprintPart, IdempotencySettings, Mode, OnConflict, OnStoreError, OnUnknownOutcome,
    PathPattern, RouteSettings,
};

/// `routes[i]:` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[serde(expecting = "a route: a mapping with name, path and upstream")]
pub(crate) struct RawRoute {
    /// Unique name; appears in logs, metrics and store keys. Required.
    pub name: String,
    /// Methods this route matches. Default: every method.
    #[serde(default)]
    pub methods: Option<Vec<String>>,
    /// Path pattern: exact segments, `{param}` for one segment, a trailing `/*` for the rest.
    pub path: String,
    /// Name of an entry of `upstreams`. Required.
    pub upstream: String,
    /// Absent: a plain pass-through route. Present, even empty (`idempotency:` or
    /// `idempotency: {}`): an idempotent route with the defaults.
    #[serde(default, deserialize_with = "present_means_idempotent")]
    pub idempotency: Option<RawIdempotency>,
}

/// `idempotency:` with nothing under it is YAML null; it must not silently turn the route
/// into a pass-through, so null means "every default".
fn present_means_idempotent<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<RawIdempotency>, D::Error> {
    Ok(Some(
        Option::<RawIdempotency>::deserialize(d)?.unwrap_or_default(),
    ))
}

/// `routes[i].idempotency:` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[serde(expecting = "idempotency settings: a mapping such as {ttl: 24h}")]
pub(crate) struct RawIdempotency {
    /// Request header carrying the key. Default `Idempotency-Key`.
    #[serde(default = "defaults::header")]
    pub header: String,
    /// Missing key: 400 when true (default); forwarded without idempotency when false.
    #[serde(default = "defaults::yes")]
    pub required: bool,
    /// How long a finished response is replayed. Default 24h.
    #[serde(default = "defaults::ttl", with = "duration")]
    pub ttl: Duration,
    /// In-progress lease, renewed every `lock_ttl/3` while the upstream call runs. Default 10s.
    #[serde(default = "defaults::lock_ttl", with = "duration")]
    pub lock_ttl: Duration,
    /// Request headers whose values namespace the key. Default `[Authorization]`.
    #[serde(default = "defaults::scope")]
    pub scope: Vec<String>,
    /// What makes two requests "the same". Default `[method, path, query, body]`.
    #[serde(default = "defaults::fingerprint")]
    pub fingerprint: Vec<String>,
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
    /// Upstream statuses that are not saved. Default `[429, 503]`.
    #[serde(default = "defaults::retry_statuses")]
    pub retry_statuses: Vec<u16>,
    /// `keep` (default), `release` or `resolve`.
    #[serde(default)]
    pub on_unknown_outcome: OnUnknownOutcome,
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
            header: defaults::header(),
            required: true,
            ttl: defaults::ttl(),
            lock_ttl: defaults::lock_ttl(),
            scope: defaults::scope(),
            fingerprint: defaults::fingerprint(),
            key_from: Vec::new(),
            on_conflict: OnConflict::default(),
            wait_timeout: defaults::wait_timeout(),
            on_store_error: OnStoreError::default(),
            retry_statuses: defaults::retry_statuses(),
            on_unknown_outcome: OnUnknownOutcome::default(),
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

/// Checks and compiles every route, in file order, leaving out those that fail. `limits` and
/// `store` are the sections a route's policy must agree with (SPEC §4.5).
pub(super) fn validate(
    routes: &[RawRoute],
    upstreams: &BTreeMap<String, RawUpstream>,
    limits: &RawLimits,
    store: &RawStore,
    err: &mut impl FnMut(String, String),
) -> Vec<RouteSettings> {
    if routes.is_empty() {
        err(
            "routes".into(),
            "no routes: name at least one route, or every request gets 404".into(),
        );
    }
    let mut names = HashSet::new();
    let mut compiled = Vec::new();
    for (i, r) in routes.iter().enumerate() {
        let path = format!("routes[{i}]");
        if !names.insert(r.name.as_str()) {
            err(
                format!("{path}.name"),
                format!(
                    "duplicate route name {:?}; route names must be unique",
                    r.name
                ),
            );
        }
        if let Some(route) = r.validate(&path, upstreams, err) {
            compiled.push(route);
        }
        if let Some(i) = &r.idempotency {
            i.across_sections(&format!("{path}.idempotency"), limits, store, err);
            if let Some(resolve) = &i.resolve {
                resolve.check_upstream(&format!("{path}.idempotency.resolve"), upstreams, err);
            }
        }
    }
    compiled
}

impl RawRoute {
    fn validate(
        &self,
        path: &str,
        upstreams: &BTreeMap<String, RawUpstream>,
        err: &mut impl FnMut(String, String),
    ) -> Option<RouteSettings> {
        let mut ok = self.check_name(path, err);
        let methods = self.methods(path, err);
        ok &= methods.is_some();
        let pattern = PathPattern::parse(&self.path)
            .map_err(|e| err(format!("{path}.path"), e))
            .ok();
        ok &= self.check_upstream(path, upstreams, err);
        let idempotency = match &self.idempotency {
            None => None,
            Some(i) => {
                let compiled = i.validate(&format!("{path}.idempotency"), pattern.as_ref(), err);
                ok &= compiled.is_some();
                compiled
            }
        };
        match pattern {
            Some(p) if ok => Some(RouteSettings {
                name: self.name.clone(),
                methods: methods.flatten(),
                path: p,
                upstream: self.upstream.clone(),
                idempotency,
            }),
            _ => None,
        }
    }

    /// False: an error was reported.
    fn check_name(&self, path: &str, err: &mut impl FnMut(String, String)) -> bool {
        let valid = !self.name.is_empty()
            && self
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
        if !valid {
            err(
                format!("{path}.name"),
                format!(
                    "invalid route name {:?}: use letters, digits, '-', '_' and '.' (it becomes part of store keys and metric labels)",
                    self.name
                ),
            );
        }
        valid
    }

    /// The methods matched, `None` within for every method. Outer `None`: an error was
    /// reported.
    fn methods(
        &self,
        path: &str,
        err: &mut impl FnMut(String, String),
    ) -> Option<Option<Vec<Method>>> {
        let Some(list) = &self.methods else {
            return Some(None);
        };
        if list.is_empty() {
            err(
                format!("{path}.methods"),
                "is empty: omit it to match every method".into(),
            );
            return None;
        }
        let mut ok = true;
        let mut methods = Vec::new();
        for (j, m) in list.iter().enumerate() {
            match Method::from_bytes(m.to_ascii_uppercase().as_bytes()) {
                Ok(method) => methods.push(method),
                Err(_) => {
                    err(
                        format!("{path}.methods[{j}]"),
                        format!("invalid HTTP method {m:?}"),
                    );
                    ok = false;
                }
            }
        }
        ok.then_some(Some(methods))
    }

    /// False: an error was reported.
    fn check_upstream(
        &self,
        path: &str,
        upstreams: &BTreeMap<String, RawUpstream>,
        err: &mut impl FnMut(String, String),
    ) -> bool {
        if upstreams.contains_key(&self.upstream) {
            return true;
        }
        let known: Vec<&str> = upstreams.keys().map(String::as_str).collect();
        err(
            format!("{path}.upstream"),
            format!(
                "unknown upstream {:?}; defined upstreams: [{}]",
                self.upstream,
                known.join(", ")
            ),
        );
        false
    }
}

impl RawIdempotency {
    /// Checks the policy and compiles it. `pattern` is the route's path, when it parsed, for
    /// `key_from` parts that name a segment of it. `None`: an error was reported.
    fn validate(
        &self,
        path: &str,
        pattern: Option<&PathPattern>,
        err: &mut impl FnMut(String, String),
    ) -> Option<IdempotencySettings> {
        self.check_bounds(path, err);
        let header = header_name(&self.header, format!("{path}.header"), err);
        let durations = self.check_durations(path, err);
        let scope = self.scope(path, err);
        let fingerprint = self.fingerprint(path, err);
        let key_from = self.key_from(path, pattern, err);
        let statuses = self.check_retry_statuses(path, err);
        let bodies = self.check_bodies(path, err);
        let resolve = resolve::validate(
            self.on_unknown_outcome,
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
                    required: self.required,
                    ttl: self.ttl,
                    lock_ttl: self.lock_ttl,
                    scope,
                    fingerprint,
                    on_conflict: self.on_conflict,
                    wait_timeout: self.wait_timeout,
                    on_store_error: self.on_store_error,
                    retry_statuses: self.retry_statuses.clone(),
                    on_unknown_outcome: self.on_unknown_outcome,
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
    fn check_bounds(&self, path: &str, err: &mut impl FnMut(String, String)) {
        at_most(err, &format!("{path}.ttl"), self.ttl, bounds::TTL);
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
    fn check_durations(&self, path: &str, err: &mut impl FnMut(String, String)) -> bool {
        let mut ok = true;
        if self.ttl.is_zero() {
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
    fn scope(&self, path: &str, err: &mut impl FnMut(String, String)) -> Option<Vec<HeaderName>> {
        let mut ok = true;
        let mut scope = Vec::new();
        for (j, s) in self.scope.iter().enumerate() {
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
        err: &mut impl FnMut(String, String),
    ) -> Option<Vec<FingerprintPart>> {
        let mut ok = true;
        let mut parts = Vec::new();
        for (j, f) in self.fingerprint.iter().enumerate() {
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

    /// False: an error was reported.
    fn check_retry_statuses(&self, path: &str, err: &mut impl FnMut(String, String)) -> bool {
        let mut ok = true;
        for (j, s) in self.retry_statuses.iter().enumerate() {
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
    fn across_sections(
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

/// The warnings of the compiled `routes` against the `store` section: a route whose
/// `lock_ttl`, less the first third of it that passes before its first renewal is sent, leaves a
/// renewal less than `store.timeout` to land (SPEC §4.5 refuses only `store.timeout` at or past
/// `lock_ttl`). There, a renewal that takes its whole deadline lands after the lease, and a
/// repeat sent meanwhile runs the operation again; renewals are sent earlier when the store
/// answers slowly, but no schedule makes room that the store's deadline takes.
pub(super) fn warnings(routes: &[RouteSettings], store: &StoreSettings) -> Vec<ConfigWarning> {
    let timeout = store.timeout;
    routes
        .iter()
        .enumerate()
        .filter_map(|(i, route)| {
            let lock_ttl = route.idempotency.as_ref()?.lock_ttl;
            let left = lock_ttl - lock_ttl / 3;
            (left < timeout).then(|| ConfigWarning {
                route: route.name.clone(),
                path: format!("routes[{i}].idempotency.lock_ttl"),
                message: format!(
                    "{} leaves a lease renewal {} (lock_ttl less its first third) to land, less than store.timeout ({}): a renewal as slow as store.timeout lands after the lease, and a retry sent meanwhile runs the operation again; raise lock_ttl to at least {} (one and a half store.timeout) or lower store.timeout",
                    humantime::format_duration(lock_ttl),
                    humantime::format_duration(left),
                    humantime::format_duration(timeout),
                    humantime::format_duration(timeout + timeout / 2),
                ),
            })
        })
        .collect()
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

#[cfg(test)]
mod tests {
    use super::super::Config;
    use super::*;

    const MINIMAL: &str = "
listen: 127.0.0.1:8080
upstreams:
  booking:
    url: http://127.0.0.1:8081
routes:
  - name: create-booking
    path: /bookings
    upstream: booking
    idempotency: {}
";

    #[test]
    fn an_empty_idempotency_section_means_every_default() {
        let yaml = MINIMAL.replace("idempotency: {}", "idempotency:");
        let c = Config::from_yaml(&yaml).expect("valid");
        let i = c.routes[0].idempotency.as_ref().expect("idempotent");
        assert_eq!(i.lock_ttl, Duration::from_secs(10));
        let passthrough = MINIMAL.replace("    idempotency: {}\n", "");
        let c = Config::from_yaml(&passthrough).expect("valid");
        assert!(c.routes[0].idempotency.is_none());
    }
}
