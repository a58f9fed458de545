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
use http::{HeaderName, Method, Uri};
use serde::{Deserialize, Deserializer};

use crate::route::PathPattern;
pub use crate::route::{
    FingerprintPart, IdempotencySettings, OnConflict, OnStoreError, OnUnknownOutcome, RouteSettings,
};
use crate::tls::{ClientTls, ServerTls, TlsFile};

mod load;
mod secret;

pub use secret::Secret;
use secret::secret;

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

/// `limits:` as written: what hostile or broken clients may hold at most.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[serde(expecting = "limits: a mapping of bounds")]
pub struct RawLimits {
    /// Open client connections at most; past it, new connections wait in the accept queue.
    /// Default 10000.
    #[serde(default = "defaults::max_connections")]
    pub max_connections: u32,
    /// How long a client may take to send a request head, and how long an idle keep-alive
    /// connection stays open. Default 10s.
    #[serde(default = "defaults::header_read_timeout", with = "duration")]
    pub header_read_timeout: Duration,
    /// How long a client may take to send a whole request body, on every route. Default 30s.
    #[serde(default = "defaults::body_read_timeout", with = "duration")]
    pub body_read_timeout: Duration,
    /// Idempotent exchanges still running after their client left, at most; past it, new
    /// idempotent requests get a 503 before anything is claimed. Default 1000.
    #[serde(default = "defaults::max_detached_exchanges")]
    pub max_detached_exchanges: u32,
    /// Results whose completion is being retried in the background, at most; past it (or past
    /// `max_pending_save_bytes`) the oldest is given up. Default 1000.
    #[serde(default = "defaults::max_pending_saves")]
    pub max_pending_saves: u32,
    /// Bytes of those results, at most. Default 64MiB.
    #[serde(default = "defaults::max_pending_save_bytes", with = "byte_size")]
    pub max_pending_save_bytes: u64,
    /// How long a response may make no write progress (a client that stopped reading) before
    /// it is abandoned and its connection closed. Default 30s.
    #[serde(default = "defaults::send_timeout", with = "duration")]
    pub send_timeout: Duration,
    /// Open admin-listener connections at most. Default 256.
    #[serde(default = "defaults::max_admin_connections")]
    pub max_admin_connections: u32,
}

impl Default for RawLimits {
    fn default() -> Self {
        RawLimits {
            max_connections: defaults::max_connections(),
            header_read_timeout: defaults::header_read_timeout(),
            body_read_timeout: defaults::body_read_timeout(),
            max_detached_exchanges: defaults::max_detached_exchanges(),
            max_pending_saves: defaults::max_pending_saves(),
            max_pending_save_bytes: defaults::max_pending_save_bytes(),
            send_timeout: defaults::send_timeout(),
            max_admin_connections: defaults::max_admin_connections(),
        }
    }
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

/// Which store keeps the idempotency records.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Backend {
    /// The embedded in-memory store: one instance only, nothing survives a restart.
    #[default]
    Memory,
    /// One Redis server (or a primary with replicas), shared by every instance.
    Redis,
    /// A Redis Cluster, reached through its seed nodes (`store.nodes`).
    RedisCluster,
}

/// `store:` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[serde(expecting = "store: a mapping with backend and its settings")]
pub struct RawStore {
    /// `memory` (default), `redis` or `redis-cluster`.
    #[serde(default)]
    pub backend: Backend,
    /// Memory: the most records kept at once. Default 1,000,000.
    #[serde(default = "defaults::max_entries")]
    pub max_entries: u64,
    /// Redis: `redis://` or `rediss://` URL. Default `redis://127.0.0.1:6379/0`.
    #[serde(default)]
    pub url: Option<String>,
    /// Redis Cluster: seed nodes, `redis://` or `rediss://` URLs (the rest of the cluster is
    /// discovered from them). Required with `redis-cluster`.
    #[serde(default)]
    pub nodes: Vec<String>,
    /// Redis and Redis Cluster: a file holding the password (`AUTH`), so it need not sit in
    /// the URL. Default: none.
    #[serde(default)]
    pub password_file: Option<String>,
    /// Redis and Redis Cluster: an environment variable holding the password (instead of a
    /// file). Default: none.
    #[serde(default)]
    pub password_env: Option<String>,
    /// Redis and Redis Cluster over TLS (`rediss://`): a PEM file of the CA certificates that
    /// sign the server's certificate, for a private CA. Default: none (the public web roots).
    #[serde(default)]
    pub ca_file: Option<String>,
    /// Every store key starts with it. Default `idemproxy:`.
    #[serde(default = "defaults::key_prefix")]
    pub key_prefix: String,
    /// Deadline of each store operation. Default 500ms.
    #[serde(default = "defaults::store_timeout", with = "duration")]
    pub timeout: Duration,
    /// Redis: replicas that must acknowledge a claim (`WAIT`) before anything is forwarded;
    /// fewer within `timeout` release the claim and answer 503. Default 0 (don't wait).
    #[serde(default)]
    pub wait_replicas: u32,
}

impl Default for RawStore {
    fn default() -> Self {
        RawStore {
            backend: Backend::default(),
            max_entries: defaults::max_entries(),
            url: None,
            nodes: Vec::new(),
            password_file: None,
            password_env: None,
            ca_file: None,
            key_prefix: defaults::key_prefix(),
            timeout: defaults::store_timeout(),
            wait_replicas: 0,
        }
    }
}

/// `upstreams.NAME:` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[serde(expecting = "an upstream: a mapping with url")]
pub struct RawUpstream {
    /// `http://` or `https://` base URL. Required.
    pub url: String,
    /// TCP (and TLS) connect deadline. Default 2s.
    #[serde(default = "defaults::connect_timeout", with = "duration")]
    pub connect_timeout: Duration,
    /// Deadline until the whole response has arrived. Default 30s.
    #[serde(default = "defaults::upstream_timeout", with = "duration")]
    pub timeout: Duration,
    /// A pooled connection idle this long is never reused (SPEC §4.3). Default 1s: shorter
    /// than the 2s after which gunicorn drops idle connections, and Node's 5s. `0s`: no pooling.
    #[serde(default = "defaults::pool_idle_timeout", with = "duration")]
    pub pool_idle_timeout: Duration,
    /// https: a PEM file of the CA certificates to trust instead of the Mozilla roots.
    /// Default: none (the Mozilla roots).
    #[serde(default)]
    pub ca_file: Option<String>,
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
    pub(crate) fn max_entries() -> u64 {
        1_000_000
    }
    pub(crate) fn key_prefix() -> String {
        "idemproxy:".to_owned()
    }
    pub(crate) fn store_timeout() -> Duration {
        Duration::from_millis(500)
    }
    /// The Redis URL used when `store.url` is absent.
    pub const REDIS_URL: &str = "redis://127.0.0.1:6379/0";
    pub(crate) fn connect_timeout() -> Duration {
        Duration::from_secs(2)
    }
    pub(crate) fn upstream_timeout() -> Duration {
        Duration::from_secs(30)
    }
    pub(crate) fn pool_idle_timeout() -> Duration {
        Duration::from_secs(1)
    }
    pub(crate) fn max_connections() -> u32 {
        10_000
    }
    pub(crate) fn header_read_timeout() -> Duration {
        Duration::from_secs(10)
    }
    pub(crate) fn body_read_timeout() -> Duration {
        Duration::from_secs(30)
    }
    pub(crate) fn send_timeout() -> Duration {
        Duration::from_secs(30)
    }
    pub(crate) fn max_admin_connections() -> u32 {
        256
    }
    pub(crate) fn max_detached_exchanges() -> u32 {
        1000
    }
    pub(crate) fn max_pending_saves() -> u32 {
        1000
    }
    pub(crate) fn max_pending_save_bytes() -> u64 {
        64 * 1024 * 1024
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

/// Durations written as strings: `250ms`, `30s`, `24h`, `1h 30m`.
mod duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, de::Error};

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let text = super::StringOrNumber::deserialize(d)?.0;
        super::parse_duration(&text).map_err(D::Error::custom)
    }
}

/// Sizes written as bytes (`1048576`) or strings (`64KiB`, `8MiB`, `1MB`).
mod byte_size {
    use serde::{Deserialize, Deserializer, de::Error};

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        let text = super::StringOrNumber::deserialize(d)?.0;
        super::parse_size(&text).map_err(D::Error::custom)
    }
}

/// A scalar read as text, so that `max_request_body: 1024` and `max_request_body: 1KiB` both work
/// and `ttl: 30` reaches the duration parser, which then says what it expects.
struct StringOrNumber(String);

impl<'de> Deserialize<'de> for StringOrNumber {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = StringOrNumber;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or a number")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(StringOrNumber(v.to_owned()))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
                Ok(StringOrNumber(v.to_string()))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Self::Value, E> {
                Ok(StringOrNumber(v.to_string()))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Self::Value, E> {
                Ok(StringOrNumber(v.to_string()))
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// Parses `250ms`, `30s`, `24h` (any unit humantime knows). A bare number is refused: a unit-less
/// duration is the classic misconfiguration (seconds or milliseconds?).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    if !t.is_empty() && t.chars().all(|c| c.is_ascii_digit()) {
        return Err(format!(
            "invalid duration {t:?}: give a unit, for example \"{t}s\" or \"{t}ms\""
        ));
    }
    humantime::parse_duration(t)
        .map_err(|e| format!("invalid duration {t:?} ({e}); expected for example 250ms, 30s, 24h"))
}

/// Parses a size: a whole number of bytes, or a number with a unit `B`, `KB`, `KiB`, `MB`,
/// `MiB`, `GB`, `GiB` (KB = 1000, KiB = 1024).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let bad = || format!("invalid size {t:?}; expected bytes or a string like 64KiB, 8MiB");
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "KB" | "kB" => 1000,
        "KiB" => 1024,
        "MB" => 1000 * 1000,
        "MiB" => 1024 * 1024,
        "GB" => 1000 * 1000 * 1000,
        "GiB" => 1024 * 1024 * 1024,
        _ => return Err(bad()),
    };
    n.checked_mul(mult).ok_or_else(bad)
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

/// What hostile or broken clients may hold at most (see [`RawLimits`] for each field).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Open client connections at most.
    pub max_connections: u32,
    /// Deadline of a request head, and of an idle keep-alive connection.
    pub header_read_timeout: Duration,
    /// Deadline of a whole request body.
    pub body_read_timeout: Duration,
    /// Exchanges still running after their client left, at most.
    pub max_detached_exchanges: u32,
    /// Completions retried in the background, at most.
    pub max_pending_saves: u32,
    /// Bytes of those, at most.
    pub max_pending_save_bytes: u64,
    /// How long a response may make no write progress before its connection is closed.
    pub send_timeout: Duration,
    /// Open admin-listener connections at most.
    pub max_admin_connections: u32,
}

/// Which store, and how to reach it.
#[derive(Debug, Clone)]
pub struct StoreSettings {
    /// The backend and its own settings.
    pub backend: BackendSettings,
    /// Every store key starts with it.
    pub key_prefix: String,
    /// Deadline of each store operation.
    pub timeout: Duration,
}

/// Backend-specific settings.
#[derive(Debug, Clone)]
pub enum BackendSettings {
    /// The embedded store, bounded to `max_entries` records.
    Memory {
        /// The bound.
        max_entries: u64,
    },
    /// One Redis server (or a primary with replicas).
    Redis {
        /// `redis://` or `rediss://` URL.
        url: String,
        /// Password and CA, from outside the URL.
        access: RedisAccess,
        /// Replicas that must acknowledge a claim (`WAIT`); 0: don't wait.
        wait_replicas: u32,
    },
    /// A Redis Cluster.
    RedisCluster {
        /// Seed nodes: `redis://` or `rediss://` URLs.
        nodes: Vec<String>,
        /// Password and CA, from outside the URLs.
        access: RedisAccess,
    },
}

/// How to authenticate to Redis and trust its certificate, beyond what the URL says.
#[derive(Clone, Default)]
pub struct RedisAccess {
    /// The password (`store.password_file` / `store.password_env`), sent with `AUTH`.
    pub password: Option<Secret>,
    /// PEM CA certificates (`store.ca_file`) that replace the public web roots for `rediss://`.
    pub ca_pem: Option<Vec<u8>>,
}

impl fmt::Debug for RedisAccess {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisAccess")
            .field("password", &self.password)
            .field(
                "ca_pem",
                &self
                    .ca_pem
                    .as_ref()
                    .map(|pem| format!("<{} bytes>", pem.len())),
            )
            .finish()
    }
}

/// One upstream.
#[derive(Debug, Clone)]
pub struct UpstreamSettings {
    /// Its name in the file.
    pub name: String,
    /// Base URL (scheme, authority and an optional path prefix).
    pub url: Uri,
    /// TCP (and TLS) connect deadline.
    pub connect_timeout: Duration,
    /// Deadline until the whole response has arrived.
    pub timeout: Duration,
    /// A pooled connection idle this long is not reused.
    pub pool_idle_timeout: Duration,
    /// What an https connection to it trusts (`ca_file`, else the Mozilla roots).
    pub tls: ClientTls,
    /// The `X-Forwarded-Proto` it is sent: the scheme of the proxy's own listener (`https`
    /// with `tls:`), resolved at load because one listener has one scheme, so a request
    /// only copies it.
    pub forwarded_proto: Scheme,
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
        validate_limits(&self.limits, &mut err);
        let store = validate_store(&self.store, &mut err);

        let mut upstreams = BTreeMap::new();
        for (name, up) in &self.upstreams {
            let path = format!("upstreams.{name}");
            if let Some(u) = validate_upstream(name, up, &path, &forwarded_proto, &mut err) {
                upstreams.insert(name.clone(), u);
            }
        }

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
                limits: Limits {
                    max_connections: self.limits.max_connections,
                    header_read_timeout: self.limits.header_read_timeout,
                    body_read_timeout: self.limits.body_read_timeout,
                    max_detached_exchanges: self.limits.max_detached_exchanges,
                    max_pending_saves: self.limits.max_pending_saves,
                    max_pending_save_bytes: self.limits.max_pending_save_bytes,
                    send_timeout: self.limits.send_timeout,
                    max_admin_connections: self.limits.max_admin_connections,
                },
            }),
            _ => Err(ConfigErrors::one("", "invalid configuration")),
        }
    }
}

/// The largest value each duration and size may take. Generous for any real deployment, and
/// small enough that deadlines computed from them cannot overflow a clock or Redis's `PX`.
pub mod bounds {
    use std::time::Duration;

    const DAY: u64 = 24 * 3600;
    const MIB: u64 = 1024 * 1024;

    /// `shutdown_timeout`.
    pub const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(3600);
    /// `store.timeout`.
    pub const STORE_TIMEOUT: Duration = Duration::from_secs(60);
    /// `store.max_entries`.
    pub const MAX_ENTRIES: u64 = 100_000_000;
    /// `store.wait_replicas`.
    pub const WAIT_REPLICAS: u32 = 16;
    /// `store.nodes`.
    pub const NODES: usize = 1000;
    /// `upstreams.*.connect_timeout`.
    pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(300);
    /// `upstreams.*.timeout`.
    pub const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(3600);
    /// `upstreams.*.pool_idle_timeout`.
    pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(3600);
    /// `idempotency.ttl`: a year.
    pub const TTL: Duration = Duration::from_secs(365 * DAY);
    /// `idempotency.lock_ttl`.
    pub const LOCK_TTL: Duration = Duration::from_secs(DAY);
    /// `idempotency.wait_timeout`.
    pub const WAIT_TIMEOUT: Duration = Duration::from_secs(3600);
    /// `idempotency.max_request_body` and `max_response_body`.
    pub const BODY: u64 = 1024 * MIB;
    /// `limits.max_connections`, `max_detached_exchanges`, `max_pending_saves`.
    pub const COUNT: u64 = 1_000_000;
    /// `limits.header_read_timeout`.
    pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(600);
    /// `limits.body_read_timeout`.
    pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(3600);
    /// `limits.send_timeout`.
    pub const SEND_TIMEOUT: Duration = Duration::from_secs(3600);
    /// `drain_delay`.
    pub const DRAIN_DELAY: Duration = Duration::from_secs(3600);
    /// `limits.max_pending_save_bytes`.
    pub const PENDING_SAVE_BYTES: u64 = 16 * 1024 * MIB;
}

/// Refuses a duration above `max`, naming the field and the bound.
fn at_most(err: &mut impl FnMut(String, String), path: &str, value: Duration, max: Duration) {
    if value > max {
        err(
            path.to_owned(),
            format!("is too long: at most {}", whole_unit(max)),
        );
    }
}

/// A bound in the largest whole unit: `365d`, `1h`, `10m`, `90s`.
fn whole_unit(d: Duration) -> String {
    let secs = d.as_secs();
    for (unit, n) in [("d", 86_400), ("h", 3600), ("m", 60)] {
        if secs >= n && secs % n == 0 {
            return format!("{}{unit}", secs / n);
        }
    }
    format!("{secs}s")
}

/// Refuses a count or size above `max`, naming the field and the bound.
fn count_at_most(err: &mut impl FnMut(String, String), path: &str, value: u64, max: u64) {
    if value > max {
        err(
            path.to_owned(),
            format!("{value} is too large: at most {max}"),
        );
    }
}

fn validate_limits(l: &RawLimits, err: &mut impl FnMut(String, String)) {
    for (field, value) in [
        ("limits.max_connections", l.max_connections),
        ("limits.max_pending_saves", l.max_pending_saves),
        ("limits.max_admin_connections", l.max_admin_connections),
    ] {
        if value == 0 {
            err(field.into(), "must be at least 1".into());
        }
        count_at_most(err, field, u64::from(value), bounds::COUNT);
    }
    if l.max_detached_exchanges == 0 {
        // The admission check refuses a new idempotent request once this many run detached:
        // at zero that is every one of them, a 503 for all traffic.
        err(
            "limits.max_detached_exchanges".into(),
            "must be at least 1: at 0 every idempotent request is refused as overloaded".into(),
        );
    }
    count_at_most(
        err,
        "limits.max_detached_exchanges",
        u64::from(l.max_detached_exchanges),
        bounds::COUNT,
    );
    for (field, value, max) in [
        (
            "limits.header_read_timeout",
            l.header_read_timeout,
            bounds::HEADER_READ_TIMEOUT,
        ),
        (
            "limits.body_read_timeout",
            l.body_read_timeout,
            bounds::BODY_READ_TIMEOUT,
        ),
        ("limits.send_timeout", l.send_timeout, bounds::SEND_TIMEOUT),
    ] {
        if value.is_zero() {
            err(field.into(), "must be greater than zero".into());
        }
        at_most(err, field, value, max);
    }
    if l.max_pending_save_bytes == 0 {
        err(
            "limits.max_pending_save_bytes".into(),
            "must be greater than zero: no result could be kept for a retried save".into(),
        );
    }
    count_at_most(
        err,
        "limits.max_pending_save_bytes",
        l.max_pending_save_bytes,
        bounds::PENDING_SAVE_BYTES,
    );
}

fn validate_store(s: &RawStore, err: &mut impl FnMut(String, String)) -> Option<StoreSettings> {
    at_most(err, "store.timeout", s.timeout, bounds::STORE_TIMEOUT);
    count_at_most(err, "store.max_entries", s.max_entries, bounds::MAX_ENTRIES);
    let mut ok = true;
    if s.timeout.is_zero() {
        err("store.timeout".into(), "must be greater than zero".into());
        ok = false;
    }
    if s.key_prefix.is_empty() {
        err(
            "store.key_prefix".into(),
            "must not be empty: operators find the proxy's keys by it".into(),
        );
        ok = false;
    }
    count_at_most(
        err,
        "store.wait_replicas",
        u64::from(s.wait_replicas),
        u64::from(bounds::WAIT_REPLICAS),
    );
    if s.wait_replicas > bounds::WAIT_REPLICAS {
        ok = false;
    }
    let redis_only = [
        ("store.url", s.url.is_some()),
        ("store.nodes", !s.nodes.is_empty()),
        ("store.password_file", s.password_file.is_some()),
        ("store.password_env", s.password_env.is_some()),
        ("store.ca_file", s.ca_file.is_some()),
        ("store.wait_replicas", s.wait_replicas != 0),
    ];
    let backend = match s.backend {
        Backend::Memory => {
            if s.max_entries == 0 {
                err("store.max_entries".into(), "must be at least 1".into());
                ok = false;
            }
            for (field, set) in redis_only {
                if set {
                    err(
                        field.into(),
                        "is a Redis setting: set store.backend to redis or redis-cluster, or remove it".into(),
                    );
                    ok = false;
                }
            }
            BackendSettings::Memory {
                max_entries: s.max_entries,
            }
        }
        Backend::Redis => {
            if !s.nodes.is_empty() {
                err(
                    "store.nodes".into(),
                    "is for backend redis-cluster; backend redis takes one store.url".into(),
                );
                ok = false;
            }
            let url = s
                .url
                .clone()
                .unwrap_or_else(|| defaults::REDIS_URL.to_owned());
            let access = redis_access(s, std::slice::from_ref(&url), "store.url", err);
            if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
                err(
                    "store.url".into(),
                    format!("invalid Redis URL {url:?}: it must start with redis:// or rediss://"),
                );
                ok = false;
            } else if let Err(e) = redis::Client::open(url.as_str()) {
                err("store.url".into(), format!("invalid Redis URL: {e}"));
                ok = false;
            } else if let Some(access) = &access {
                // Parses the CA file as the client will.
                if let Err(e) = crate::store::redis::client(&url, access) {
                    let field = if s.ca_file.is_some() {
                        "store.ca_file"
                    } else {
                        "store.url"
                    };
                    err(field.into(), e.to_string());
                    ok = false;
                }
            }
            match access {
                Some(access) => BackendSettings::Redis {
                    url,
                    access,
                    wait_replicas: s.wait_replicas,
                },
                None => return None,
            }
        }
        Backend::RedisCluster => {
            if s.url.is_some() {
                err(
                    "store.url".into(),
                    "is for backend redis; list the cluster's seed nodes in store.nodes".into(),
                );
                ok = false;
            }
            if s.wait_replicas != 0 {
                // The cluster client keeps one multiplexed connection per node, and routes
                // WAIT to every primary, not to the key's. A WAIT must run on the connection
                // that wrote the key and blocks it: on the cluster client that stalls every
                // request to that node, and after an ASK redirection the write and the WAIT
                // are not on the same node at all. Refused rather than half-done.
                err(
                    "store.wait_replicas".into(),
                    "is not supported with backend redis-cluster (the cluster client cannot run WAIT on the connection that wrote the key without stalling every other request to that node); set 0, or use backend redis with a primary and replicas".into(),
                );
                ok = false;
            }
            if s.nodes.is_empty() {
                err(
                    "store.nodes".into(),
                    "backend redis-cluster needs at least one seed node (redis://HOST:PORT)".into(),
                );
                ok = false;
            }
            if s.nodes.len() > bounds::NODES {
                err(
                    "store.nodes".into(),
                    format!("{} seed nodes: at most {}", s.nodes.len(), bounds::NODES),
                );
                ok = false;
            }
            for (i, node) in s.nodes.iter().enumerate() {
                if !(node.starts_with("redis://") || node.starts_with("rediss://")) {
                    err(
                        format!("store.nodes[{i}]"),
                        format!(
                            "invalid Redis URL {node:?}: it must start with redis:// or rediss://"
                        ),
                    );
                    ok = false;
                } else if let Err(e) = redis::Client::open(node.as_str()) {
                    err(
                        format!("store.nodes[{i}]"),
                        format!("invalid Redis URL: {e}"),
                    );
                    ok = false;
                }
            }
            let tls = s
                .nodes
                .iter()
                .filter(|n| n.starts_with("rediss://"))
                .count();
            if tls != 0 && tls != s.nodes.len() {
                err(
                    "store.nodes".into(),
                    "mixes redis:// and rediss:// (TLS) seed nodes; a cluster is reached one way"
                        .into(),
                );
                ok = false;
            }
            let access = redis_access(s, &s.nodes, "store.nodes", err);
            if let (true, Some(access)) = (ok, &access) {
                // The client checks what the URLs alone cannot: the same TLS mode and
                // credentials on every seed node, a CA file that parses.
                if let Err(e) = crate::store::redis::cluster_client(&s.nodes, access, s.timeout) {
                    err("store.nodes".into(), e.to_string());
                    ok = false;
                }
            }
            match access {
                Some(access) => BackendSettings::RedisCluster {
                    nodes: s.nodes.clone(),
                    access,
                },
                None => return None,
            }
        }
    };
    ok.then(|| StoreSettings {
        backend,
        key_prefix: s.key_prefix.clone(),
        timeout: s.timeout,
    })
}

/// Reads the Redis password (`store.password_file` / `store.password_env`) and CA file
/// (`store.ca_file`), checking them against the URLs: a password in a URL *and* in a file is
/// ambiguous, and a CA without `rediss://` would silently not be used. `None`: an error was
/// reported.
fn redis_access(
    s: &RawStore,
    urls: &[String],
    urls_field: &str,
    err: &mut impl FnMut(String, String),
) -> Option<RedisAccess> {
    let mut ok = true;
    let password = secret(
        "store.password",
        s.password_file.as_deref(),
        s.password_env.as_deref(),
        err,
    );
    if (s.password_file.is_some() || s.password_env.is_some()) && password.is_none() {
        ok = false;
    }
    let inline_password = urls.iter().any(|u| {
        redis::IntoConnectionInfo::into_connection_info(u.as_str())
            .is_ok_and(|info| info.redis_settings().password().is_some())
    });
    if password.is_some() && inline_password {
        let field = if s.password_file.is_some() {
            "store.password_file"
        } else {
            "store.password_env"
        };
        err(
            field.into(),
            format!("{urls_field} already carries a password; keep one of the two"),
        );
        ok = false;
    }
    let ca_pem = match &s.ca_file {
        None => None,
        Some(path) => {
            if !urls.iter().all(|u| u.starts_with("rediss://")) {
                err(
                    "store.ca_file".into(),
                    format!("is only used over TLS: {urls_field} must use rediss://"),
                );
                ok = false;
            }
            match std::fs::read(path) {
                Ok(pem)
                    if String::from_utf8_lossy(&pem).contains("-----BEGIN CERTIFICATE-----") =>
                {
                    Some(pem)
                }
                Ok(_) => {
                    err(
                        "store.ca_file".into(),
                        format!("{path} holds no PEM certificate (-----BEGIN CERTIFICATE-----)"),
                    );
                    ok = false;
                    None
                }
                Err(e) => {
                    err("store.ca_file".into(), format!("cannot read {path}: {e}"));
                    ok = false;
                    None
                }
            }
        }
    };
    ok.then_some(RedisAccess { password, ca_pem })
}

fn validate_upstream(
    name: &str,
    up: &RawUpstream,
    path: &str,
    forwarded_proto: &Scheme,
    err: &mut impl FnMut(String, String),
) -> Option<UpstreamSettings> {
    let mut ok = true;
    at_most(
        err,
        &format!("{path}.connect_timeout"),
        up.connect_timeout,
        bounds::CONNECT_TIMEOUT,
    );
    at_most(
        err,
        &format!("{path}.timeout"),
        up.timeout,
        bounds::UPSTREAM_TIMEOUT,
    );
    at_most(
        err,
        &format!("{path}.pool_idle_timeout"),
        up.pool_idle_timeout,
        bounds::POOL_IDLE_TIMEOUT,
    );
    if up.connect_timeout.is_zero() {
        err(
            format!("{path}.connect_timeout"),
            "must be greater than zero".into(),
        );
        ok = false;
    }
    if up.timeout.is_zero() {
        err(
            format!("{path}.timeout"),
            "must be greater than zero".into(),
        );
        ok = false;
    }
    let url = match up.url.parse::<Uri>() {
        Ok(u)
            if matches!(u.scheme_str(), Some("http") | Some("https"))
                && u.authority().is_some()
                && u.query().is_none() =>
        {
            Some(u)
        }
        _ => {
            err(
                format!("{path}.url"),
                format!(
                    "invalid upstream URL {:?}: expected http://HOST[:PORT][/PREFIX] or https://…, without a query",
                    up.url
                ),
            );
            None
        }
    };
    let https = url.as_ref().and_then(Uri::scheme) == Some(&Scheme::HTTPS);
    let tls = match &up.ca_file {
        // A CA file on a cleartext upstream would be silently unused: say so instead.
        Some(_) if url.is_some() && !https => Err((
            format!("{path}.ca_file"),
            "applies to https:// upstreams only; this url is http://".to_owned(),
        )),
        Some(file) => ClientTls::private_roots(file).map_err(|m| (format!("{path}.ca_file"), m)),
        None => ClientTls::public_roots().map_err(|m| (path.to_owned(), m)),
    };
    let tls = match tls {
        Ok(tls) => Some(tls),
        Err((field, message)) => {
            err(field, message);
            None
        }
    };
    match (url, tls) {
        (Some(url), Some(tls)) if ok => Some(UpstreamSettings {
            name: name.to_owned(),
            url,
            connect_timeout: up.connect_timeout,
            timeout: up.timeout,
            pool_idle_timeout: up.pool_idle_timeout,
            tls,
            forwarded_proto: forwarded_proto.clone(),
        }),
        _ => None,
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
        match crate::route::KeyPart::parse(text) {
            Ok(crate::route::KeyPart::Path(name))
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

    #[test]
    fn sizes_and_durations() {
        assert_eq!(parse_size("64KiB"), Ok(65536));
        assert_eq!(parse_size("8MiB"), Ok(8 * 1024 * 1024));
        assert_eq!(parse_size("1000"), Ok(1000));
        assert_eq!(parse_size("1MB"), Ok(1_000_000));
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("").is_err());
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("24h"), Ok(Duration::from_secs(86400)));
        assert!(parse_duration("30").is_err());
        assert!(parse_duration("soon").is_err());
    }
}
