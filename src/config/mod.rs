//! The configuration file: serde structs with documented defaults, then a separate validation step.
//!
//! Loading is two stages, as in Pingora: [`RawConfig`] is what YAML deserializes into (unknown
//! fields refused, every default written down next to its field), and [`RawConfig::validate`]
//! checks what serde cannot and compiles the result into a [`Config`] that the proxy uses without
//! any further per-request work. Every error names the field path (`routes[2].idempotency.ttl`)
//! and says why; YAML syntax errors also give line and column. Validation collects every error
//! it finds, so `--check` can print them all at once.
//!
//! # Layout
//! This file holds the whole document ([`RawConfig`], [`Config`]), its top-level fields and the
//! errors; each section has a file with its raw struct, its defaults and its validation:
//! - `load`: the YAML pass, which sets aside a value that does not deserialize and reads on.
//! - `units`: durations and sizes as written, and the [`bounds`] of every section.
//! - `secret`: the admin token and the Redis password, read from a file or the environment.
//! - `limits`, `store`, `upstream`, `routes`, `tracing`: the sections of the same names.
//!
//! Config reads no other part of the product but [`crate::route`] (the compiled types, whose
//! `key_from` parts are [`crate::route::KeyPart`]) and [`crate::tls`]: the store, the upstream
//! client and the server take their typed settings from here, and loading a file opens,
//! connects or starts nothing.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::uri::Scheme;
use serde::Deserialize;

pub use crate::route::{FingerprintPart, RouteSettings};
pub use crate::route::{IdempotencySettings, Mode, OnConflict, OnStoreError, OnUnknownOutcome};
use crate::tls::{ServerTls, TlsFile};

mod limits;
mod load;
mod routes;
mod secret;
mod store;
mod tracing;
mod units;
mod upstream;

pub use limits::Limits;
pub(crate) use limits::RawLimits;
pub(crate) use routes::RawRoute;
pub use secret::Secret;
use secret::secret;
pub(crate) use store::RawStore;
pub use store::{BackendSettings, PostgresSettings, RedisAccess, SqliteSync, StoreSettings};
pub use tracing::TracingSettings;
use units::{at_most, duration};
pub use units::{bounds, parse_duration, parse_size};
pub(crate) use upstream::RawUpstream;
pub use upstream::{Protocol, UpstreamSettings};

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

/// Whether a webhook route's `secrets_env` must be set in this process's environment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SecretsEnv {
    /// It must: the proxy (at start, at a reload) and `--check` read the secrets.
    Read,
    /// It may be unset: `idemproxy reload` checks a file for a proxy whose environment is not
    /// the caller's.
    Optional,
}

/// Something a valid configuration does that may not be what its author wants: logged (as a
/// warning, naming the route and the field) at start and at every reload that applies the
/// file, and printed by `--check`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigWarning {
    /// The route it concerns.
    pub route: String,
    /// The field path.
    pub path: String,
    /// What may go wrong, in words.
    pub message: String,
}

impl fmt::Display for ConfigWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
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
pub(crate) struct RawConfig {
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
    /// A file the proxy writes its process id to once it listens (and removes on a clean
    /// exit), for `idemproxy reload` to find it. Default: none.
    #[serde(default)]
    pub pid_file: Option<String>,
    /// How long in-flight requests may run after SIGTERM/SIGINT. Default 30s.
    #[serde(default = "defaults::shutdown_timeout", with = "duration")]
    pub shutdown_timeout: Duration,
    /// After SIGTERM/SIGINT, how long to keep accepting while `/readyz` answers 503, so that
    /// load balancers polling readiness move traffic away before the listener closes. Default 0s.
    #[serde(default, with = "duration")]
    pub drain_delay: Duration,
    /// Worker threads, each with its own runtime and accept loop on `listen`. Default: the
    /// number of cores the process may use (at most [`bounds::WORKERS`]).
    #[serde(default)]
    pub workers: Option<u32>,
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
    /// OpenTelemetry traces. Default: none (nothing recorded).
    #[serde(default)]
    pub tracing: Option<tracing::RawTracing>,
}

/// `tls:` as written: the listener's certificate chain and key, both PEM files.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[serde(expecting = "tls: a mapping with cert_file and key_file")]
pub(crate) struct RawTls {
    /// The certificate chain, leaf first. Required.
    pub cert_file: String,
    /// The leaf's private key (PKCS#8, PKCS#1 or SEC1), unencrypted. Required.
    pub key_file: String,
}

/// `log_format:`: how each log line is written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines (the default).
    #[default]
    Text,
    /// One JSON object a line.
    Json,
}

/// The documented defaults, one function each so serde and the docs agree.
mod defaults {
    use std::time::Duration;

    pub(super) fn shutdown_timeout() -> Duration {
        Duration::from_secs(30)
    }

    /// One worker a core the process may use (its CPU affinity and cgroup quota count, as
    /// `std::thread::available_parallelism` reads them), within the bounds: a larger machine
    /// than [`super::bounds::WORKERS`] cores gets that many.
    pub(super) fn workers() -> u32 {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        u32::try_from(cores)
            .unwrap_or(u32::MAX)
            .clamp(1, super::bounds::WORKERS)
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
    pub log_format: LogFormat,
    /// Where the proxy writes its process id, if anywhere.
    pub pid_file: Option<PathBuf>,
    /// How long in-flight requests may run after a stop signal.
    pub shutdown_timeout: Duration,
    /// How long to keep accepting, unready, after a stop signal.
    pub drain_delay: Duration,
    /// Worker threads serving `listen`, from 1 to [`bounds::WORKERS`]: as the file says, or
    /// else one a core the process may use, counted when the file was loaded.
    pub workers: usize,
    /// `workers` as the file wrote it; `None`: the default. A reload compares this, not the
    /// count: the default counted again at a reload may differ (a container's CPU quota
    /// changed) without the file asking for another number of workers.
    pub workers_written: Option<usize>,
    pub store: StoreSettings,
    /// Upstreams by name.
    pub upstreams: BTreeMap<String, UpstreamSettings>,
    /// The compiled routes, in file order.
    pub routes: Vec<RouteSettings>,
    /// Bounds on what clients may hold.
    pub limits: Limits,
    /// OpenTelemetry traces, if configured.
    pub tracing: Option<TracingSettings>,
}

impl Config {
    /// What this valid configuration does that may not be meant (see [`ConfigWarning`]).
    pub fn warnings(&self) -> Vec<ConfigWarning> {
        routes::warnings(&self.routes, &self.store)
    }

    /// Reads, parses and validates a file.
    pub fn load(path: &Path) -> Result<Config, ConfigErrors> {
        Config::load_as(path, SecretsEnv::Read)
    }

    /// Reads, parses and validates a file as `idemproxy reload` checks it before signalling
    /// the running proxy: a webhook route's `secrets_env` variable is the running proxy's, read
    /// at its start, so one not set in the caller's environment is no error here (its secrets
    /// are left unread; the proxy's reload keeps the ones it read).
    pub fn load_for_reload(path: &Path) -> Result<Config, ConfigErrors> {
        Config::load_as(path, SecretsEnv::Optional)
    }

    fn load_as(path: &Path, secrets_env: SecretsEnv) -> Result<Config, ConfigErrors> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigErrors::one("", format!("cannot read {}: {e}", path.display())))?;
        Config::parse(&text, secrets_env)
    }

    /// Parses and validates YAML text. Every error is reported: a value that does not
    /// deserialize is set aside (see `config/load.rs`) so that the rest of the file is still
    /// read and validated.
    pub fn from_yaml(text: &str) -> Result<Config, ConfigErrors> {
        Config::parse(text, SecretsEnv::Read)
    }

    fn parse(text: &str, secrets_env: SecretsEnv) -> Result<Config, ConfigErrors> {
        let mut parsed = load::parse(text);
        let validated = parsed.raw.take().map(|raw| raw.validate(secrets_env));
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
    /// Checks everything serde cannot and compiles the routes. Collects every error.
    pub(crate) fn validate(self, secrets_env: SecretsEnv) -> Result<Config, ConfigErrors> {
        let mut errs = Vec::new();
        let mut err = |path: String, message: String| errs.push(ConfigError { path, message });

        let (listen, admin_listen) = self.listeners(&mut err);
        let tls = self.server_tls(&mut err);
        let forwarded_proto = match self.tls {
            Some(_) => Scheme::HTTPS,
            None => Scheme::HTTP,
        };
        let admin_token = self.admin_token(&mut err);
        self.check_shutdown(&mut err);
        self.check_workers(&mut err);
        let pid_file = self.pid_file(&mut err);
        let limits = self.limits.validate(&mut err);
        let store = self.store.validate(&mut err);
        let tracing = self.tracing.as_ref().and_then(|t| t.validate(&mut err));
        let upstreams = upstream::validate(&self.upstreams, &forwarded_proto, &mut err);
        let routes = routes::validate(
            &self.routes,
            &self.upstreams,
            &self.limits,
            &self.store,
            secrets_env,
            &mut err,
        );
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
                pid_file,
                shutdown_timeout: self.shutdown_timeout,
                drain_delay: self.drain_delay,
                workers: usize::try_from(self.workers.unwrap_or_else(defaults::workers))
                    .unwrap_or(1),
                workers_written: self.workers.and_then(|n| usize::try_from(n).ok()),
                store,
                upstreams,
                routes,
                limits,
                tracing,
            }),
            _ => Err(ConfigErrors::one("", "invalid configuration")),
        }
    }

    /// The proxy's address and the admin listener's, if any; `None` where an error was
    /// reported.
    fn listeners(
        &self,
        err: &mut impl FnMut(String, String),
    ) -> (Option<SocketAddr>, Option<SocketAddr>) {
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
        (listen, admin_listen)
    }

    /// The listener's certificate and key, read now so that a bad file fails at load.
    fn server_tls(&self, err: &mut impl FnMut(String, String)) -> Option<ServerTls> {
        let t = self.tls.as_ref()?;
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
    }

    fn admin_token(&self, err: &mut impl FnMut(String, String)) -> Option<Secret> {
        let admin_token = secret(
            "admin_token",
            self.admin_token_file.as_deref(),
            self.admin_token_env.as_deref(),
            err,
        );
        if admin_token.is_some() && self.admin_listen.is_none() {
            err(
                "admin_listen".into(),
                "an admin token is configured but there is no admin_listen to use it on".into(),
            );
        }
        admin_token
    }

    fn pid_file(&self, err: &mut impl FnMut(String, String)) -> Option<PathBuf> {
        match self.pid_file.as_deref() {
            Some(path) if path.trim().is_empty() => {
                err(
                    "pid_file".into(),
                    "must be a file path (omit the field for no pid file)".into(),
                );
                None
            }
            path => path.map(PathBuf::from),
        }
    }

    fn check_workers(&self, err: &mut impl FnMut(String, String)) {
        if let Some(workers) = self.workers
            && !(1..=bounds::WORKERS).contains(&workers)
        {
            err(
                "workers".into(),
                format!(
                    "{workers}: must be from 1 to {} (omit it for one worker a core)",
                    bounds::WORKERS
                ),
            );
        }
    }

    fn check_shutdown(&self, err: &mut impl FnMut(String, String)) {
        if self.shutdown_timeout.is_zero() {
            err(
                "shutdown_timeout".into(),
                "must be greater than zero".into(),
            );
        }
        at_most(
            err,
            "shutdown_timeout",
            self.shutdown_timeout,
            bounds::SHUTDOWN_TIMEOUT,
        );
        at_most(err, "drain_delay", self.drain_delay, bounds::DRAIN_DELAY);
    }
}
