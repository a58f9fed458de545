//! The configuration file: serde structs with documented defaults, then a separate validation step.
//!
//! Loading is two stages, as in Pingora: [`RawConfig`] is what YAML deserializes into (unknown
//! fields refused, every default written down next to its field), and [`RawConfig::validate`]
//! checks what serde cannot and compiles the result into a [`Config`] that the proxy uses without
//! any further per-request work. Every error names the field path (`routes[2].idempotency.ttl`)
//! and says why; YAML syntax errors also give line and column. Validation collects every error
//! it finds, so `--check` can print them all at once.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use http::uri::Scheme;
use http::{HeaderName, Method};
use serde::{Deserialize, Deserializer};

use crate::route::PathPattern;
pub use crate::route::{
    FingerprintPart, IdempotencySettings, OnConflict, OnStoreError, OnUnknownOutcome, RouteSettings,
};
use crate::tls::{ServerTls, TlsFile};

mod limits;
mod load;
mod secret;
mod store;
mod units;
mod upstream;

pub use limits::{Limits, RawLimits};
pub use secret::Secret;
use secret::secret;
pub use store::{Backend, BackendSettings, RawStore, RedisAccess, StoreSettings};
use units::{at_most, byte_size, count_at_most, duration};
pub use units::{bounds, parse_duration, parse_size};
pub use upstream::{RawUpstream, UpstreamSettings};

/// One configuration error: where (a field path such as `routes[0].idempotency.ttl`, empty for
/// the document itself) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The field path, or empty when the error concerns the whole document.
    pub path: String,
    /// What is wrong, in words.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() || self.path == "." {
            write!(f, "{}", self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

/// Every error found in one configuration file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl ConfigErrors {
    fn one(path: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigErrors(vec![ConfigError {
            path: path.into(),
            message: message.into(),
        }])
    }
}

/// The configuration as written in YAML, with defaults applied.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[serde(expecting = "the configuration: a mapping with listen, upstreams and routes")]
pub struct RawConfig {
    /// Address the proxy listens on. Required.
    pub listen: String,
    /// TLS on that listener. Default: none (plain HTTP, for a terminating load balancer).
    #[serde(default)]
    pub tls: Option<RawTls>,
    /// Address of the admin server (health, readiness, metrics, key tooling).
    #[serde(default)]
    pub admin_listen: Option<String>,
    /// A file holding the admin token that turns the key tooling on.
    #[serde(default)]
    pub admin_token_file: Option<String>,
    /// An environment variable holding the admin token (instead of a file).
    #[serde(default)]
    pub admin_token_env: Option<String>,
    /// `text` (default) or `json`.
    #[serde(default)]
    pub log_format: LogFormat,
    /// How long in-flight requests may run after SIGTERM/SIGINT. Default 30s.
    #[serde(default = "defaults::shutdown_timeout", with = "duration")]
    pub shutdown_timeout: Duration,
    /// After SIGTERM/SIGINT, how long to keep accepting while `/readyz` answers 503, so that
    /// load balancers polling readiness move traffic away before the listener closes. Default 0s.
    #[serde(default, with = "duration")]
    pub drain_delay: Duration,
    /// The idempotency record store.
    #[serde(default)]
    pub store: RawStore,
    /// Named upstreams that routes forward to.
    #[serde(default)]
    pub upstreams: BTreeMap<String, RawUpstream>,
    /// Routes, first match wins.
    #[serde(default)]
    pub routes: Vec<RawRoute>,
    /// Bounds on what clients may hold: connections, slow requests, detached work.
    #[serde(default)]
    pub limits: RawLimits,
}

/// `tls:` as written: the listener's certificate chain and key, both PEM files.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[serde(expecting = "tls: a mapping with cert_file and key_file")]
pub struct RawTls {
    /// The certificate chain, leaf first. Required.
    pub cert_file: String,
    /// The leaf's private key (PKCS#8, PKCS#1 or SEC1), unencrypted. Required.
    pub key_file: String,
}

/// Log line format.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines (the default).
    #[default]
    Text,
    /// One JSON object a line.
    Json,
}

/// `routes[i]:` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[serde(expecting = "a route: a mapping with name, path and upstream")]
pub struct RawRoute {
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
pub struct RawIdempotency {
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
    /// `keep` (default) or `release`.
    #[serde(default)]
    pub on_unknown_outcome: OnUnknownOutcome,
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
            max_request_body: defaults::max_request_body(),
            max_response_body: defaults::max_response_body(),
            replay_set_cookie: false,
            forward_key: true,
        }
    }
}

/// The documented defaults, one function each so serde and the docs agree.
pub mod defaults {
    use std::time::Duration;

    pub(crate) fn shutdown_timeout() -> Duration {
        Duration::from_secs(30)
    }
    pub(crate) fn header() -> String {
        "Idempotency-Key".to_owned()
    }
    pub(crate) fn yes() -> bool {
        true
    }
    pub(crate) fn ttl() -> Duration {
        Duration::from_secs(24 * 3600)
    }
    pub(crate) fn lock_ttl() -> Duration {
        Duration::from_secs(10)
    }
    pub(crate) fn scope() -> Vec<String> {
        vec!["Authorization".to_owned()]
    }
    pub(crate) fn fingerprint() -> Vec<String> {
        ["method", "path", "query", "body"]
            .iter()
            .map(|s| (*s).to_owned())
            .collect()
    }
    pub(crate) fn wait_timeout() -> Duration {
        Duration::from_secs(5)
    }
    pub(crate) fn retry_statuses() -> Vec<u16> {
        vec![429, 503]
    }
    pub(crate) fn max_request_body() -> u64 {
        1024 * 1024
    }
    pub(crate) fn max_response_body() -> u64 {
        8 * 1024 * 1024
    }
}

// ---------------------------------------------------------------------------------------------
// The validated, compiled configuration.

/// A configuration that passed validation: addresses parsed, routes compiled.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where the proxy listens.
    pub listen: SocketAddr,
    /// TLS on the listener, if any.
    pub tls: Option<ServerTls>,
    /// Where the admin endpoints listen, if anywhere.
    pub admin_listen: Option<SocketAddr>,
    /// The admin token that turns the key tooling on (read from a file or the environment).
    pub admin_token: Option<Secret>,
    /// Log line format.
    pub log_format: LogFormat,
    /// How long in-flight requests may run after a stop signal.
    pub shutdown_timeout: Duration,
    /// How long to keep accepting, unready, after a stop signal.
    pub drain_delay: Duration,
    /// The store.
    pub store: StoreSettings,
    /// Upstreams by name.
    pub upstreams: BTreeMap<String, UpstreamSettings>,
    /// The compiled routes, in file order.
    pub routes: Vec<RouteSettings>,
    /// Bounds on what clients may hold.
    pub limits: Limits,
}

/// The shortest lease accepted: renewal runs every `lock_ttl/3`, and a lease shorter than a few
/// store round trips would be lost by ordinary jitter.
const MIN_LOCK_TTL: Duration = Duration::from_millis(30);

impl Config {
    /// Reads, parses and validates a file.
    pub fn load(path: &Path) -> Result<Config, ConfigErrors> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigErrors::one("", format!("cannot read {}: {e}", path.display())))?;
        Config::from_yaml(&text)
    }

    /// Parses and validates YAML text. Every error is reported: a value that does not
    /// deserialize is set aside (see [`load`]) so that the rest of the file is still read and
    /// validated.
    pub fn from_yaml(text: &str) -> Result<Config, ConfigErrors> {
        let mut parsed = load::parse(text);
        let validated = parsed.raw.take().map(RawConfig::validate);
        match validated {
            Some(Ok(config)) if parsed.errors.is_empty() => Ok(config),
            Some(Err(errors)) => {
                parsed.add_validation(errors.0);
                Err(ConfigErrors(parsed.errors))
            }
            _ => Err(ConfigErrors(parsed.errors)),
        }
    }
}

impl RawConfig {
    /// Parses YAML text. Errors carry the field path and, for the first one where YAML knows
    /// it, line and column; every value that does not deserialize is reported, not only the
    /// first.
    pub fn from_yaml(text: &str) -> Result<RawConfig, ConfigErrors> {
        match load::parse(text) {
            load::Parsed {
                raw: Some(raw),
                errors,
                ..
            } if errors.is_empty() => Ok(raw),
            parsed => Err(ConfigErrors(parsed.errors)),
        }
    }

    /// Checks everything serde cannot and compiles the routes. Collects every error.
    pub fn validate(self) -> Result<Config, ConfigErrors> {
        let mut errs = Vec::new();
        let mut err = |path: String, message: String| errs.push(ConfigError { path, message });

        let listen = match self.listen.parse::<SocketAddr>() {
            Ok(a) => Some(a),
            Err(_) => {
                err(
                    "listen".into(),
                    format!(
                        "invalid socket address {:?}; expected HOST:PORT such as 127.0.0.1:8080",
                        self.listen
                    ),
                );
                None
            }
        };
        let admin_listen = match &self.admin_listen {
            None => None,
            Some(text) => match text.parse::<SocketAddr>() {
                Ok(a) if Some(a) == listen => {
                    err("admin_listen".into(), "must differ from listen".into());
                    None
                }
                Ok(a) => Some(a),
                Err(_) => {
                    err(
                        "admin_listen".into(),
                        format!(
                            "invalid socket address {text:?}; expected HOST:PORT such as 127.0.0.1:9090"
                        ),
                    );
                    None
                }
            },
        };
        let tls = self.tls.as_ref().and_then(|t| {
            ServerTls::load(&t.cert_file, &t.key_file)
                .map_err(|errors| {
                    for (file, message) in errors {
                        let field = match file {
                            TlsFile::Cert => "tls.cert_file",
                            TlsFile::Key => "tls.key_file",
                        };
                        err(field.into(), message);
                    }
                })
                .ok()
        });
        let forwarded_proto = match self.tls {
            Some(_) => Scheme::HTTPS,
            None => Scheme::HTTP,
        };
        let admin_token = secret(
            "admin_token",
            self.admin_token_file.as_deref(),
            self.admin_token_env.as_deref(),
            &mut err,
        );
        if admin_token.is_some() && self.admin_listen.is_none() {
            err(
                "admin_listen".into(),
                "an admin token is configured but there is no admin_listen to use it on".into(),
            );
        }
        if self.shutdown_timeout.is_zero() {
            err(
                "shutdown_timeout".into(),
                "must be greater than zero".into(),
            );
        }

        at_most(
            &mut err,
            "shutdown_timeout",
            self.shutdown_timeout,
            bounds::SHUTDOWN_TIMEOUT,
        );
        at_most(
            &mut err,
            "drain_delay",
            self.drain_delay,
            bounds::DRAIN_DELAY,
        );
        let limits = self.limits.validate(&mut err);
        let store = self.store.validate(&mut err);

        let upstreams = upstream::validate(&self.upstreams, &forwarded_proto, &mut err);

        if self.routes.is_empty() {
            err(
                "routes".into(),
                "no routes: name at least one route, or every request gets 404".into(),
            );
        }
        let mut names = HashSet::new();
        let mut routes = Vec::new();
        for (i, r) in self.routes.iter().enumerate() {
            let path = format!("routes[{i}]");
            if !names.insert(r.name.clone()) {
                err(
                    format!("{path}.name"),
                    format!(
                        "duplicate route name {:?}; route names must be unique",
                        r.name
                    ),
                );
            }
            if let Some(route) = validate_route(r, &path, &self.upstreams, &mut err) {
                routes.push(route);
            }
            if let Some(i) = &r.idempotency {
                across_sections(i, &format!("{path}.idempotency"), &self, &mut err);
            }
        }

        if !errs.is_empty() {
            return Err(ConfigErrors(errs));
        }
        match (listen, store) {
            (Some(listen), Some(store)) => Ok(Config {
                listen,
                tls,
                admin_listen,
                admin_token,
                log_format: self.log_format,
                shutdown_timeout: self.shutdown_timeout,
                drain_delay: self.drain_delay,
                store,
                upstreams,
                routes,
                limits,
            }),
            _ => Err(ConfigErrors::one("", "invalid configuration")),
        }
    }
}

fn validate_route(
    r: &RawRoute,
    path: &str,
    upstreams: &BTreeMap<String, RawUpstream>,
    err: &mut impl FnMut(String, String),
) -> Option<RouteSettings> {
    let mut ok = true;
    if r.name.is_empty()
        || !r
            .name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        err(
            format!("{path}.name"),
            format!(
                "invalid route name {:?}: use letters, digits, '-', '_' and '.' (it becomes part of store keys and metric labels)",
                r.name
            ),
        );
        ok = false;
    }
    let methods = match &r.methods {
        None => None,
        Some(list) if list.is_empty() => {
            err(
                format!("{path}.methods"),
                "is empty: omit it to match every method".into(),
            );
            ok = false;
            None
        }
        Some(list) => {
            let mut out = Vec::new();
            for (j, m) in list.iter().enumerate() {
                match Method::from_bytes(m.to_ascii_uppercase().as_bytes()) {
                    Ok(method) => out.push(method),
                    Err(_) => {
                        err(
                            format!("{path}.methods[{j}]"),
                            format!("invalid HTTP method {m:?}"),
                        );
                        ok = false;
                    }
                }
            }
            Some(out)
        }
    };
    let pattern = match PathPattern::parse(&r.path) {
        Ok(p) => Some(p),
        Err(e) => {
            err(format!("{path}.path"), e);
            None
        }
    };
    if !upstreams.contains_key(&r.upstream) {
        let known: Vec<&str> = upstreams.keys().map(String::as_str).collect();
        err(
            format!("{path}.upstream"),
            format!(
                "unknown upstream {:?}; defined upstreams: [{}]",
                r.upstream,
                known.join(", ")
            ),
        );
        ok = false;
    }
    let idempotency = match &r.idempotency {
        None => None,
        Some(i) => {
            let compiled =
                validate_idempotency(i, &format!("{path}.idempotency"), pattern.as_ref(), err);
            if compiled.is_none() {
                ok = false;
            }
            compiled
        }
    };
    match pattern {
        Some(p) if ok => Some(RouteSettings {
            name: r.name.clone(),
            methods,
            path: p,
            upstream: r.upstream.clone(),
            idempotency,
        }),
        _ => None,
    }
}

/// The refusals of SPEC §4.5 that join a route to another section: each names the route's
/// field and, in its message, the other one.
fn across_sections(
    i: &RawIdempotency,
    path: &str,
    c: &RawConfig,
    err: &mut impl FnMut(String, String),
) {
    let pending = c.limits.max_pending_save_bytes;
    // A save the store refused is retried from memory, within these bytes; a response that
    // can never fit is given up at once, and its key answers `result-not-kept` for ever.
    if pending > 0 && i.max_response_body > pending {
        err(
            format!("{path}.max_response_body"),
            format!(
                "{} bytes is more than limits.max_pending_save_bytes ({pending} bytes): a response this large could never be kept while its save is retried; lower it or raise limits.max_pending_save_bytes",
                i.max_response_body
            ),
        );
    }
    // A claim answered later than `lock_ttl` after it was sent is released unused (its lease
    // may have expired), so a store deadline at or past the lease turns every slow answer
    // into a 503 and leaves no margin for renewal.
    let timeout = c.store.timeout;
    if i.lock_ttl >= MIN_LOCK_TTL && !timeout.is_zero() && timeout >= i.lock_ttl {
        err(
            format!("{path}.lock_ttl"),
            format!(
                "{} must be longer than store.timeout ({}): a claim answered after its lease could have expired forwards nothing; raise lock_ttl or lower store.timeout",
                humantime::format_duration(i.lock_ttl),
                humantime::format_duration(timeout)
            ),
        );
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

fn validate_idempotency(
    i: &RawIdempotency,
    path: &str,
    pattern: Option<&PathPattern>,
    err: &mut impl FnMut(String, String),
) -> Option<IdempotencySettings> {
    let mut ok = true;
    at_most(err, &format!("{path}.ttl"), i.ttl, bounds::TTL);
    at_most(
        err,
        &format!("{path}.lock_ttl"),
        i.lock_ttl,
        bounds::LOCK_TTL,
    );
    at_most(
        err,
        &format!("{path}.wait_timeout"),
        i.wait_timeout,
        bounds::WAIT_TIMEOUT,
    );
    count_at_most(
        err,
        &format!("{path}.max_request_body"),
        i.max_request_body,
        bounds::BODY,
    );
    count_at_most(
        err,
        &format!("{path}.max_response_body"),
        i.max_response_body,
        bounds::BODY,
    );
    let header = header_name(&i.header, format!("{path}.header"), err);
    ok &= header.is_some();
    if i.ttl.is_zero() {
        err(format!("{path}.ttl"), "must be greater than zero".into());
        ok = false;
    }
    if i.lock_ttl < MIN_LOCK_TTL {
        err(
            format!("{path}.lock_ttl"),
            format!(
                "must be at least {} (the lease is renewed every lock_ttl/3)",
                humantime::format_duration(MIN_LOCK_TTL)
            ),
        );
        ok = false;
    }
    if i.on_conflict == OnConflict::Wait && i.wait_timeout.is_zero() {
        err(
            format!("{path}.wait_timeout"),
            "must be greater than zero with on_conflict: wait".into(),
        );
        ok = false;
    }
    let mut scope = Vec::new();
    for (j, s) in i.scope.iter().enumerate() {
        match header_name(s, format!("{path}.scope[{j}]"), err) {
            Some(h) => scope.push(h),
            None => ok = false,
        }
    }
    let mut fingerprint = Vec::new();
    for (j, f) in i.fingerprint.iter().enumerate() {
        let part = match f.as_str() {
            "method" => Some(FingerprintPart::Method),
            "path" => Some(FingerprintPart::Path),
            "query" => Some(FingerprintPart::Query),
            "body" => Some(FingerprintPart::Body),
            "json" => Some(FingerprintPart::Json),
            other => match other.strip_prefix("header:") {
                Some(name) => header_name(name.trim(), format!("{path}.fingerprint[{j}]"), err)
                    .map(FingerprintPart::Header),
                None => {
                    err(
                        format!("{path}.fingerprint[{j}]"),
                        format!(
                            "unknown fingerprint part {other:?}; expected method, path, query, body, json or header:NAME"
                        ),
                    );
                    None
                }
            },
        };
        match part {
            Some(p) => fingerprint.push(p),
            None => ok = false,
        }
    }
    let mut key_from = Vec::new();
    for (j, text) in i.key_from.iter().enumerate() {
        let field = format!("{path}.key_from[{j}]");
        match crate::derive::KeyPart::parse(text) {
            Ok(crate::derive::KeyPart::Path(name))
                if pattern.is_some_and(|p| !p.has_param(&name)) =>
            {
                err(
                    field,
                    format!(
                        "path:{name} names no segment of the route's path {:?}; write the path with {{{name}}}",
                        pattern.map(|p| p.as_str()).unwrap_or("")
                    ),
                );
                ok = false;
            }
            Ok(part) => key_from.push(part),
            Err(message) => {
                err(field, message);
                ok = false;
            }
        }
    }
    for (j, s) in i.retry_statuses.iter().enumerate() {
        if !(100..=599).contains(s) {
            err(
                format!("{path}.retry_statuses[{j}]"),
                format!("invalid HTTP status {s}; expected 100 to 599"),
            );
            ok = false;
        }
    }
    if i.max_request_body == 0 {
        err(
            format!("{path}.max_request_body"),
            "must be greater than zero".into(),
        );
        ok = false;
    }
    if i.max_response_body == 0 {
        err(
            format!("{path}.max_response_body"),
            "must be greater than zero: at 0 no response with a body could be replayed".into(),
        );
        ok = false;
    }
    match header {
        Some(header) if ok => Some(IdempotencySettings {
            header,
            required: i.required,
            ttl: i.ttl,
            lock_ttl: i.lock_ttl,
            scope,
            fingerprint,
            on_conflict: i.on_conflict,
            wait_timeout: i.wait_timeout,
            on_store_error: i.on_store_error,
            retry_statuses: i.retry_statuses.clone(),
            on_unknown_outcome: i.on_unknown_outcome,
            max_request_body: i.max_request_body,
            max_response_body: i.max_response_body,
            replay_set_cookie: i.replay_set_cookie,
            forward_key: i.forward_key,
            key_from,
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
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
