//! `routes:`: which requests go where, and each idempotent route's policy, compiled into the
//! [`RouteSettings`] the proxy matches against.

mod grpc;
mod idempotency;
mod jsonrpc;
mod resolve;
mod webhook;

use std::collections::{BTreeMap, HashSet};

use http::Method;
use serde::{Deserialize, Deserializer};

use super::limits::RawLimits;
use super::store::{RawStore, StoreSettings};
use super::upstream::RawUpstream;
use super::{ConfigWarning, SecretsEnv};
use crate::route::{FingerprintPart, IdempotencySettings, PathPattern, RouteSettings};
use grpc::RawGrpc;
pub(crate) use idempotency::RawIdempotency;
use jsonrpc::RawJsonRpc;
use webhook::RawWebhook;

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
    /// A webhook route (SPEC §4.9): the provider's signature is checked first and its event id
    /// is the key. Idempotent with or without `idempotency:`.
    #[serde(default)]
    pub webhook: Option<RawWebhook>,
    /// A JSON-RPC route (SPEC §4.10): each call of a listed method is claimed, whatever its
    /// `id`. Idempotent with or without `idempotency:`.
    #[serde(default)]
    pub jsonrpc: Option<RawJsonRpc>,
    /// A gRPC route (SPEC §4.11): each unary call is claimed, the key in its metadata.
    #[serde(default)]
    pub grpc: Option<RawGrpc>,
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

/// Checks and compiles every route, in file order, leaving out those that fail. `limits` and
/// `store` are the sections a route's policy must agree with (SPEC §4.5).
pub(super) fn validate(
    routes: &[RawRoute],
    upstreams: &BTreeMap<String, RawUpstream>,
    limits: &RawLimits,
    store: &RawStore,
    secrets_env: SecretsEnv,
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
        if let Some(route) = r.validate(&path, upstreams, secrets_env, err) {
            compiled.push(route);
        }
        if let Some(i) = r.effective_idempotency() {
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
        secrets_env: SecretsEnv,
        err: &mut impl FnMut(String, String),
    ) -> Option<RouteSettings> {
        let mut ok = self.check_name(path, err);
        let methods = self.methods(path, err);
        ok &= methods.is_some();
        let pattern = PathPattern::parse(&self.path)
            .map_err(|e| err(format!("{path}.path"), e))
            .ok();
        ok &= self.check_upstream(path, upstreams, err);
        let is_webhook = self.webhook.is_some();
        if is_webhook {
            ok &= self.check_webhook_route(path, methods.as_ref(), err);
        }
        if self.jsonrpc.is_some() {
            ok &= self.check_jsonrpc_route(path, err);
        }
        if self.grpc.is_some() {
            ok &= self.check_grpc_route(path, upstreams, err);
        }
        let idempotency = match self.effective_idempotency() {
            None => None,
            Some(i) => {
                let mut compiled = i.validate(
                    &format!("{path}.idempotency"),
                    pattern.as_ref(),
                    is_webhook,
                    err,
                );
                if let Some(compiled) = &mut compiled {
                    self.kind_fingerprint(compiled);
                }
                ok &= compiled.is_some();
                compiled
            }
        };
        let jsonrpc = match &self.jsonrpc {
            None => None,
            Some(j) => {
                let compiled = j.validate(&format!("{path}.jsonrpc"), err);
                ok &= compiled.is_some();
                compiled
            }
        };
        let grpc = match &self.grpc {
            None => None,
            Some(g) => {
                let compiled = g.validate(&format!("{path}.grpc"), err);
                ok &= compiled.is_some();
                compiled
            }
        };
        let webhook = match &self.webhook {
            None => None,
            Some(w) => {
                let compiled = w.validate(
                    &format!("{path}.webhook"),
                    pattern.as_ref(),
                    secrets_env,
                    err,
                );
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
                webhook,
                jsonrpc,
                grpc,
            }),
            _ => None,
        }
    }

    /// A JSON-RPC or gRPC route's own default fingerprint, where none is written.
    fn kind_fingerprint(&self, compiled: &mut IdempotencySettings) {
        let kind_default: Option<&[FingerprintPart]> = match (&self.jsonrpc, &self.grpc) {
            (Some(_), _) => Some(&jsonrpc::DEFAULT_FINGERPRINT),
            (None, Some(_)) => Some(&grpc::DEFAULT_FINGERPRINT),
            (None, None) => None,
        };
        let written = self
            .idempotency
            .as_ref()
            .is_some_and(|i| i.fingerprint.is_some());
        if let (Some(parts), false) = (kind_default, written) {
            compiled.fingerprint = parts.to_vec();
        }
    }

    /// The idempotency policy as written, or, on a webhook, JSON-RPC or gRPC route without
    /// `idempotency:`, every default (such a route is idempotent all the same).
    fn effective_idempotency(&self) -> Option<std::borrow::Cow<'_, RawIdempotency>> {
        if let Some(i) = &self.idempotency {
            return Some(std::borrow::Cow::Borrowed(i));
        }
        let kind = self.webhook.is_some() || self.jsonrpc.is_some() || self.grpc.is_some();
        kind.then(|| std::borrow::Cow::Owned(RawIdempotency::default()))
    }

    /// What a webhook route refuses around its `webhook:` block: `methods` without `POST`
    /// (providers deliver with POST), and a key of its own (`idempotency.header`, `key_from`):
    /// the event id is the only key. False: an error was reported.
    fn check_webhook_route(
        &self,
        path: &str,
        methods: Option<&Option<Vec<Method>>>,
        err: &mut impl FnMut(String, String),
    ) -> bool {
        let mut ok = true;
        if let Some(Some(list)) = methods
            && !list.contains(&Method::POST)
        {
            err(
                format!("{path}.methods"),
                "a webhook route takes POST (providers deliver with POST): add POST or omit methods"
                    .into(),
            );
            ok = false;
        }
        if let Some(i) = &self.idempotency {
            if i.required == Some(true) {
                err(
                    format!("{path}.idempotency.required"),
                    "is not used on a webhook route: a verified delivery without an event id is forwarded without idempotency, never refused (remove it)".into(),
                );
                ok = false;
            }
            let (header, key_from) = i.names_a_key();
            if header {
                err(
                    format!("{path}.idempotency.header"),
                    "is not used on a webhook route: the provider's event id is the key".into(),
                );
                ok = false;
            }
            if key_from {
                err(
                    format!("{path}.idempotency.key_from"),
                    "is not used on a webhook route: the provider's event id is the key (for provider hmac, webhook.id says where it is)".into(),
                );
                ok = false;
            }
        }
        ok
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

/// The warnings of the compiled `routes` against the `store` section: a route whose
/// `lock_ttl`, less the first third of it that passes before its first renewal is sent, leaves a
/// renewal less than `store.timeout` to land (SPEC §4.5 refuses only `store.timeout` at or past
/// `lock_ttl`). There, a renewal that takes its whole deadline lands after the lease, and a
/// repeat sent meanwhile runs the operation again; renewals are sent earlier when the store
/// answers slowly, but no schedule makes room that the store's deadline takes.
pub(super) fn warnings(routes: &[RouteSettings], store: &StoreSettings) -> Vec<ConfigWarning> {
    let timeout = store.timeout;
    let mut warnings: Vec<ConfigWarning> = routes
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
        .collect();
    warnings.extend(routes.iter().enumerate().filter_map(short_webhook_ttl));
    warnings
}

/// A webhook route whose `ttl` is shorter than its provider's redelivery window: a redelivery
/// that comes after its record expired runs the event again.
fn short_webhook_ttl((i, route): (usize, &RouteSettings)) -> Option<ConfigWarning> {
    let provider = &route.webhook.as_ref()?.provider;
    let (window, said) = provider.redelivery_window()?;
    let ttl = route.idempotency.as_ref()?.ttl;
    (ttl < window).then(|| ConfigWarning {
        route: route.name.clone(),
        path: format!("routes[{i}].idempotency.ttl"),
        message: format!(
            "{} is shorter than how long {} redelivers an event ({said}): a redelivery after the record expired runs the event again; raise ttl to at least {} (the default on a webhook route is 7d)",
            humantime::format_duration(ttl),
            provider.name(),
            humantime::format_duration(window),
        ),
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::Config;

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
