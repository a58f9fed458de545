//! `routes[i].idempotency.resolve:` (SPEC §4.8): how a route under `on_unknown_outcome:
//! resolve` asks its upstream whether an operation whose outcome is unknown happened.

use std::collections::BTreeMap;
use std::time::Duration;

use http::HeaderName;
use serde::Deserialize;

use crate::config::units::{at_most, bounds, duration};
use crate::config::upstream::RawUpstream;
use crate::route::{LookupTemplate, OnUnknownOutcome, PathPattern, ResolveSettings};

/// `resolve:` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[serde(expecting = "resolve settings: a mapping with request and settle_after")]
pub(crate) struct RawResolve {
    /// `METHOD /path/{part}`: the lookup, its parts those of `key_from` and `{key}`. Required.
    pub request: String,
    /// Another upstream, if the lookup lives elsewhere. Default: the route's.
    #[serde(default)]
    pub upstream: Option<String>,
    /// Request headers copied onto the lookup. Default: the route's `scope` headers.
    #[serde(default)]
    pub headers: Option<Vec<String>>,
    /// Statuses that say the operation happened. Default `[200]`.
    #[serde(default = "defaults::found")]
    pub found: Vec<u16>,
    /// Statuses that say it has not happened (yet). Default `[404]`.
    #[serde(default = "defaults::absent")]
    pub absent: Vec<u16>,
    /// The upstream's longest processing time. Required: only the operator knows it.
    #[serde(with = "duration")]
    pub settle_after: Duration,
    /// How often to ask. Default 5s.
    #[serde(default = "defaults::interval", with = "duration")]
    pub interval: Duration,
    /// Still unknown this long after the request: saved as `outcome-unknown`. Default 10m.
    #[serde(default = "defaults::give_up_after", with = "duration")]
    pub give_up_after: Duration,
}

/// The documented defaults.
mod defaults {
    use std::time::Duration;

    pub(super) fn found() -> Vec<u16> {
        vec![200]
    }
    pub(super) fn absent() -> Vec<u16> {
        vec![404]
    }
    pub(super) fn interval() -> Duration {
        Duration::from_secs(5)
    }
    pub(super) fn give_up_after() -> Duration {
        Duration::from_secs(600)
    }
}

/// The longest `give_up_after` (and so `settle_after`): a key held this long is already a
/// day of repeats answered 409.
const MAX_GIVE_UP_AFTER: Duration = Duration::from_secs(7 * 24 * 3600);

/// Checks `on_unknown_outcome` against `resolve:` and compiles the block. `path` is the
/// route's `idempotency` path, `pattern` its path when it parsed, `scope` its compiled scope
/// headers (the default `headers`). Outer `None`: an error was reported.
pub(in crate::config) fn validate(
    policy: OnUnknownOutcome,
    raw: Option<&RawResolve>,
    path: &str,
    pattern: Option<&PathPattern>,
    scope: Option<&[HeaderName]>,
    err: &mut impl FnMut(String, String),
) -> Option<Option<ResolveSettings>> {
    match (policy, raw) {
        (OnUnknownOutcome::Resolve, Some(raw)) => raw
            .validate(&format!("{path}.resolve"), pattern, scope, err)
            .map(Some),
        (OnUnknownOutcome::Resolve, None) => {
            err(
                format!("{path}.resolve"),
                "on_unknown_outcome: resolve needs a resolve: block saying how to ask the upstream (request, settle_after)".into(),
            );
            None
        }
        (other, Some(_)) => {
            let name = match other {
                OnUnknownOutcome::Keep => "keep",
                _ => "release",
            };
            err(
                format!("{path}.resolve"),
                format!(
                    "a resolve: block is read only under on_unknown_outcome: resolve, and this route's is {name}; remove the block or set on_unknown_outcome: resolve"
                ),
            );
            None
        }
        (_, None) => Some(None),
    }
}

impl RawResolve {
    /// `None`: an error was reported.
    fn validate(
        &self,
        path: &str,
        pattern: Option<&PathPattern>,
        scope: Option<&[HeaderName]>,
        err: &mut impl FnMut(String, String),
    ) -> Option<ResolveSettings> {
        let request = LookupTemplate::parse(&self.request, pattern)
            .map_err(|e| err(format!("{path}.request"), e))
            .ok();
        let headers = self.headers(path, scope, err);
        let statuses = self.check_statuses(path, err);
        let times = self.check_times(path, err);
        match (request, headers) {
            (Some(request), Some(headers)) if statuses && times => Some(ResolveSettings {
                request,
                upstream: self.upstream.clone(),
                headers,
                found: self.found.clone(),
                absent: self.absent.clone(),
                settle_after: self.settle_after,
                interval: self.interval,
                give_up_after: self.give_up_after,
            }),
            _ => None,
        }
    }

    /// The copied headers: as written, or the scope's. `None`: an error was reported.
    fn headers(
        &self,
        path: &str,
        scope: Option<&[HeaderName]>,
        err: &mut impl FnMut(String, String),
    ) -> Option<Vec<HeaderName>> {
        let Some(list) = &self.headers else {
            return scope.map(<[HeaderName]>::to_vec);
        };
        let mut ok = true;
        let mut names = Vec::new();
        for (j, text) in list.iter().enumerate() {
            match HeaderName::from_bytes(text.trim().as_bytes()) {
                Ok(name) => names.push(name),
                Err(_) => {
                    err(
                        format!("{path}.headers[{j}]"),
                        format!("invalid header name {text:?}"),
                    );
                    ok = false;
                }
            }
        }
        ok.then_some(names)
    }

    /// `found` and `absent`: valid, not empty, not overlapping. False: an error was reported.
    fn check_statuses(&self, path: &str, err: &mut impl FnMut(String, String)) -> bool {
        let mut ok = true;
        for (field, list) in [("found", &self.found), ("absent", &self.absent)] {
            if list.is_empty() {
                err(
                    format!("{path}.{field}"),
                    format!(
                        "is empty: name at least one status a lookup answers with when the operation {}",
                        if field == "found" {
                            "happened"
                        } else {
                            "has not happened"
                        }
                    ),
                );
                ok = false;
            }
            for (j, s) in list.iter().enumerate() {
                if !(100..=599).contains(s) {
                    err(
                        format!("{path}.{field}[{j}]"),
                        format!("invalid HTTP status {s}; expected 100 to 599"),
                    );
                    ok = false;
                }
            }
        }
        for (j, s) in self.absent.iter().enumerate() {
            if self.found.contains(s) {
                err(
                    format!("{path}.absent[{j}]"),
                    format!("{s} is in found as well: a lookup's answer must mean one thing"),
                );
                ok = false;
            }
        }
        ok
    }

    /// `interval` within `settle_after`, `settle_after` within `give_up_after`. False: an
    /// error was reported.
    fn check_times(&self, path: &str, err: &mut impl FnMut(String, String)) -> bool {
        let mut ok = true;
        at_most(
            err,
            &format!("{path}.give_up_after"),
            self.give_up_after,
            MAX_GIVE_UP_AFTER,
        );
        at_most(
            err,
            &format!("{path}.interval"),
            self.interval,
            bounds::LOCK_TTL,
        );
        ok &= self.give_up_after <= MAX_GIVE_UP_AFTER && self.interval <= bounds::LOCK_TTL;
        if self.interval.is_zero() {
            err(
                format!("{path}.interval"),
                "must be greater than zero".into(),
            );
            ok = false;
        } else if self.interval > self.settle_after {
            err(
                format!("{path}.interval"),
                format!(
                    "{} is longer than settle_after ({}): no lookup would be sent between the request and the moment an absent answer becomes final; lower interval or raise settle_after",
                    humantime::format_duration(self.interval),
                    humantime::format_duration(self.settle_after)
                ),
            );
            ok = false;
        }
        if self.give_up_after < self.settle_after {
            err(
                format!("{path}.give_up_after"),
                format!(
                    "{} is shorter than settle_after ({}): the proxy would give up before an absent answer could ever be final; raise give_up_after",
                    humantime::format_duration(self.give_up_after),
                    humantime::format_duration(self.settle_after)
                ),
            );
            ok = false;
        }
        ok
    }

    /// `upstream`, when set, names an upstream. Reported at `path` (the `resolve` block's).
    pub(in crate::config) fn check_upstream(
        &self,
        path: &str,
        upstreams: &BTreeMap<String, RawUpstream>,
        err: &mut impl FnMut(String, String),
    ) {
        if let Some(name) = &self.upstream
            && !upstreams.contains_key(name)
        {
            let known: Vec<&str> = upstreams.keys().map(String::as_str).collect();
            err(
                format!("{path}.upstream"),
                format!(
                    "unknown upstream {name:?}; defined upstreams: [{}]",
                    known.join(", ")
                ),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn yaml(idempotency: &str) -> String {
        format!(
            "listen: 127.0.0.1:8080
upstreams:
  booking: {{url: 'http://127.0.0.1:8081'}}
  lookups: {{url: 'http://127.0.0.1:8082'}}
routes:
  - name: book
    path: /t/{{tenant}}/bookings
    upstream: booking
    idempotency:
{idempotency}"
        )
    }

    const RESOLVE: &str = "      on_unknown_outcome: resolve
      resolve:
        request: GET /bookings/by-reference/{json:/reference}
        settle_after: 60s
";

    /// The `(path, message)` of every error of `idempotency`.
    fn refusals(idempotency: &str) -> Vec<(String, String)> {
        match Config::from_yaml(&yaml(idempotency)) {
            Ok(_) => Vec::new(),
            Err(e) => e.0.into_iter().map(|e| (e.path, e.message)).collect(),
        }
    }

    #[test]
    fn a_resolve_block_compiles_with_its_defaults() {
        let c = Config::from_yaml(&yaml(&format!(
            "      scope: [Authorization, X-Tenant]\n{RESOLVE}"
        )))
        .expect("valid");
        let i = c.routes[0].idempotency.as_ref().expect("idempotent");
        assert_eq!(i.on_unknown_outcome, OnUnknownOutcome::Resolve);
        let r = i.resolve.as_ref().expect("a resolve block");
        assert_eq!(
            r.request.as_str(),
            "GET /bookings/by-reference/{json:/reference}"
        );
        assert_eq!(r.upstream, None);
        assert_eq!(
            r.headers,
            ["authorization", "x-tenant"],
            "the scope headers by default"
        );
        assert_eq!(
            (r.found.as_slice(), r.absent.as_slice()),
            (&[200][..], &[404][..])
        );
        assert_eq!(r.settle_after, Duration::from_secs(60));
        assert_eq!(r.interval, Duration::from_secs(5));
        assert_eq!(r.give_up_after, Duration::from_secs(600));
        let other = format!("{RESOLVE}        upstream: lookups\n        headers: []\n");
        let c = Config::from_yaml(&yaml(&other)).expect("valid");
        let r = c.routes[0]
            .idempotency
            .as_ref()
            .and_then(|i| i.resolve.as_ref());
        assert_eq!(r.and_then(|r| r.upstream.as_deref()), Some("lookups"));
        assert_eq!(r.map(|r| r.headers.len()), Some(0));
    }

    #[test]
    fn what_section_4_8_lists_is_refused_at_its_field() {
        let base = "routes[0].idempotency";
        for (idempotency, field, says) in [
            (
                "      on_unknown_outcome: resolve\n".to_owned(),
                format!("{base}.resolve"),
                "needs a resolve: block",
            ),
            (
                RESOLVE.replace("on_unknown_outcome: resolve", "on_unknown_outcome: keep"),
                format!("{base}.resolve"),
                "only under on_unknown_outcome: resolve",
            ),
            (
                RESOLVE.replace("{json:/reference}", "{cookie:ref}"),
                format!("{base}.resolve.request"),
                "cookie",
            ),
            (
                RESOLVE.replace("{json:/reference}", "{path:id}"),
                format!("{base}.resolve.request"),
                "names no segment",
            ),
            (
                RESOLVE.replace("GET /bookings", "get /bookings"),
                format!("{base}.resolve.request"),
                "must be written in capitals",
            ),
            (
                format!("{RESOLVE}        found: []\n"),
                format!("{base}.resolve.found"),
                "is empty",
            ),
            (
                format!("{RESOLVE}        absent: [404, 200]\n"),
                format!("{base}.resolve.absent[1]"),
                "in found as well",
            ),
            (
                format!("{RESOLVE}        interval: 2m\n"),
                format!("{base}.resolve.interval"),
                "longer than settle_after",
            ),
            (
                format!("{RESOLVE}        give_up_after: 30s\n"),
                format!("{base}.resolve.give_up_after"),
                "shorter than settle_after",
            ),
            (
                format!("{RESOLVE}        upstream: nowhere\n"),
                format!("{base}.resolve.upstream"),
                "unknown upstream",
            ),
            (
                format!("{RESOLVE}        headers: ['bad header']\n"),
                format!("{base}.resolve.headers[0]"),
                "invalid header name",
            ),
        ] {
            let errors = refusals(&idempotency);
            assert!(
                errors
                    .iter()
                    .any(|(path, message)| *path == field && message.contains(says)),
                "{idempotency}: expected {field}: …{says}…, got {errors:?}"
            );
        }
        assert!(refusals(RESOLVE).is_empty());
    }
}
