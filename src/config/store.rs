//! `store:`: which store keeps the idempotency records, and how to reach it.
//!
//! The typed settings the store is built from ([`StoreSettings`], [`BackendSettings`],
//! [`RedisAccess`]) are defined here and the store imports them, never the other way: loading
//! a file opens no store. A Redis URL is checked with the redis crate's own parsers and client
//! builders, which connect nothing.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::secret::{Secret, secret};
use super::units::{at_most, bounds, count_at_most, duration};

/// Which store keeps the idempotency records.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Backend {
    /// The embedded in-memory store: one instance only, nothing survives a restart.
    #[default]
    Memory,
    /// An SQLite file: one proxy process per file; records survive a restart of the proxy.
    Sqlite,
    /// A PostgreSQL database shared by every instance.
    Postgres,
    /// One Redis server (or a primary with replicas), shared by every instance.
    Redis,
    /// A Redis Cluster, reached through its seed nodes (`store.nodes`).
    RedisCluster,
}

/// `store:` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[serde(expecting = "store: a mapping with backend and its settings")]
pub(crate) struct RawStore {
    /// `memory` (default), `sqlite`, `postgres`, `redis` or `redis-cluster`.
    #[serde(default)]
    pub backend: Backend,
    /// Memory: the most records kept at once. Default 1,000,000.
    #[serde(default = "defaults::max_entries")]
    pub max_entries: u64,
    /// SQLite: the database file, created if missing (with its directory). Default
    /// `/var/lib/idemproxy/records.db`.
    #[serde(default)]
    pub path: Option<String>,
    /// SQLite: `normal` (default: survives a crash of the proxy) or `full` (also a power loss).
    #[serde(default)]
    pub sync: Option<SqliteSync>,
    /// PostgreSQL: the schema the proxy creates (if missing) and keeps its table in. Default
    /// `idemproxy`.
    #[serde(default)]
    pub schema: Option<String>,
    /// PostgreSQL: the most connections one instance opens. Default 16.
    #[serde(default)]
    pub pool_size: Option<u32>,
    /// SQLite and PostgreSQL: how often expired records are deleted. Default 30s.
    #[serde(default, with = "duration::option")]
    pub sweep_interval: Option<Duration>,
    /// Redis: `redis://` or `rediss://` URL. Default `redis://127.0.0.1:6379/0`.
    /// PostgreSQL: `postgres://` or `postgresql://` URL (required).
    #[serde(default)]
    pub url: Option<String>,
    /// Redis Cluster: seed nodes, `redis://` or `rediss://` URLs (the rest of the cluster is
    /// discovered from them). Required with `redis-cluster`.
    #[serde(default)]
    pub nodes: Vec<String>,
    /// Redis, Redis Cluster and PostgreSQL: a file holding the password, so it need not sit
    /// in the URL. Default: none.
    #[serde(default)]
    pub password_file: Option<String>,
    /// Redis, Redis Cluster and PostgreSQL: an environment variable holding the password
    /// (instead of a file). Default: none.
    #[serde(default)]
    pub password_env: Option<String>,
    /// Redis and Redis Cluster over TLS (`rediss://`), PostgreSQL over TLS (`sslmode` in the
    /// URL): a PEM file of the CA certificates that sign the server's certificate, for a
    /// private CA. Default: none (the public web roots).
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
            path: None,
            sync: None,
            schema: None,
            pool_size: None,
            sweep_interval: None,
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

/// The documented defaults, one function each so serde and the docs agree.
mod defaults {
    use std::time::Duration;

    pub(super) fn max_entries() -> u64 {
        1_000_000
    }
    pub(super) fn key_prefix() -> String {
        "idemproxy:".to_owned()
    }
    pub(super) fn store_timeout() -> Duration {
        Duration::from_millis(500)
    }
    /// The Redis URL used when `store.url` is absent.
    pub(super) const REDIS_URL: &str = "redis://127.0.0.1:6379/0";
    /// The SQLite file used when `store.path` is absent.
    pub(super) const SQLITE_PATH: &str = "/var/lib/idemproxy/records.db";
    /// The PostgreSQL schema used when `store.schema` is absent.
    pub(super) const SCHEMA: &str = "idemproxy";
    /// PostgreSQL connections per instance when `store.pool_size` is absent.
    pub(super) const POOL_SIZE: u32 = 16;
    /// How often expired rows are deleted when `store.sweep_interval` is absent.
    pub(super) const SWEEP_INTERVAL: std::time::Duration = std::time::Duration::from_secs(30);
}

/// `store.sync` (SQLite): how hard a commit pushes to disk.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SqliteSync {
    /// `PRAGMA synchronous = NORMAL` in WAL mode: a commit survives a crash or SIGKILL of the
    /// proxy (the WAL is in the OS's page cache); a power loss may lose the last commits.
    #[default]
    Normal,
    /// `PRAGMA synchronous = FULL`: every commit is fsynced, so it also survives a power loss.
    Full,
}

/// Which store, and how to reach it. Compared whole by a reload (a store can't change in place).
#[derive(Debug, Clone, PartialEq)]
pub struct StoreSettings {
    /// The backend and its own settings.
    pub backend: BackendSettings,
    /// Every store key starts with it.
    pub key_prefix: String,
    /// Deadline of each store operation.
    pub timeout: Duration,
}

/// Backend-specific settings.
#[derive(Debug, Clone, PartialEq)]
pub enum BackendSettings {
    /// The embedded store, bounded to `max_entries` records.
    Memory { max_entries: u64 },
    /// One Redis server (or a primary with replicas).
    Redis {
        /// `redis://` or `rediss://` URL.
        url: String,
        /// Password and CA, from outside the URL.
        access: RedisAccess,
        /// Replicas that must acknowledge a claim (`WAIT`); 0: don't wait.
        wait_replicas: u32,
    },
    RedisCluster {
        /// Seed nodes: `redis://` or `rediss://` URLs.
        nodes: Vec<String>,
        /// Password and CA, from outside the URLs.
        access: RedisAccess,
    },
    /// An SQLite file, one proxy process per file.
    Sqlite {
        /// The database file (created if missing, with its directory).
        path: PathBuf,
        /// How hard a commit pushes to disk.
        sync: SqliteSync,
        /// How often expired rows are deleted.
        sweep_interval: Duration,
    },
    /// A PostgreSQL database shared by every instance (boxed: its connection settings are
    /// far larger than the other variants).
    Postgres(Box<PostgresSettings>),
}

/// How to reach PostgreSQL and where the proxy keeps its table.
#[derive(Clone, PartialEq)]
pub struct PostgresSettings {
    /// The connection settings parsed from `store.url` (a `sslmode=verify-ca` or `verify-full`
    /// reads as `require`: the proxy always verifies the server's certificate over TLS).
    pub config: tokio_postgres::Config,
    /// The password (`store.password_file` / `store.password_env`), if not in the URL.
    pub password: Option<Secret>,
    /// PEM CA certificates (`store.ca_file`) that replace the public web roots over TLS.
    pub ca_pem: Option<Vec<u8>>,
    /// The schema of the proxy's tables (a plain lower-case identifier, never quoted).
    pub schema: String,
    /// The most connections one instance opens.
    pub pool_size: u32,
    /// How often expired rows are deleted.
    pub sweep_interval: Duration,
}

impl fmt::Debug for PostgresSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // tokio_postgres::Config's Debug redacts the password.
        f.debug_struct("PostgresSettings")
            .field("config", &self.config)
            .field("password", &self.password)
            .field("ca_pem", &self.ca_pem.as_ref().map(|pem| pem.len()))
            .field("schema", &self.schema)
            .field("pool_size", &self.pool_size)
            .field("sweep_interval", &self.sweep_interval)
            .finish()
    }
}

/// How to authenticate to Redis and trust its certificate, beyond what the URL says.
#[derive(Clone, Default, PartialEq)]
pub struct RedisAccess {
    /// The password (`store.password_file` / `store.password_env`), sent with `AUTH`.
    pub password: Option<Secret>,
    /// PEM CA certificates (`store.ca_file`) that replace the public web roots for `rediss://`.
    pub ca_pem: Option<Vec<u8>>,
}

impl RedisAccess {
    /// The CA certificates to trust instead of the public web roots, if `store.ca_file` names
    /// any, in the form the redis crate takes them.
    pub(crate) fn certificates(&self) -> Option<redis::TlsCertificates> {
        self.ca_pem.as_ref().map(|pem| redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(pem.clone()),
        })
    }
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

impl Backend {
    /// The name as written in `store.backend`.
    fn name(self) -> &'static str {
        match self {
            Backend::Memory => "memory",
            Backend::Sqlite => "sqlite",
            Backend::Postgres => "postgres",
            Backend::Redis => "redis",
            Backend::RedisCluster => "redis-cluster",
        }
    }
}

impl RawStore {
    /// Checks the section and builds the settings of its backend. `None`: an error was
    /// reported.
    pub(super) fn validate(&self, err: &mut impl FnMut(String, String)) -> Option<StoreSettings> {
        let common = self.check_common(err);
        let backend = match self.backend {
            Backend::Memory => self.memory(err),
            Backend::Sqlite => self.sqlite(err),
            Backend::Postgres => self.postgres(err),
            Backend::Redis => self.redis(err),
            Backend::RedisCluster => self.redis_cluster(err),
        };
        let common = self.fields_fit_backend(err) && common;
        match backend {
            Some(backend) if common => Some(StoreSettings {
                backend,
                key_prefix: self.key_prefix.clone(),
                timeout: self.timeout,
            }),
            _ => None,
        }
    }

    /// The settings every backend takes. False: an error was reported.
    fn check_common(&self, err: &mut impl FnMut(String, String)) -> bool {
        at_most(err, "store.timeout", self.timeout, bounds::STORE_TIMEOUT);
        count_at_most(
            err,
            "store.max_entries",
            self.max_entries,
            bounds::MAX_ENTRIES,
        );
        let mut ok = true;
        if self.timeout.is_zero() {
            err("store.timeout".into(), "must be greater than zero".into());
            ok = false;
        }
        if self.key_prefix.is_empty() {
            err(
                "store.key_prefix".into(),
                "must not be empty: operators find the proxy's keys by it".into(),
            );
            ok = false;
        }
        count_at_most(
            err,
            "store.wait_replicas",
            u64::from(self.wait_replicas),
            u64::from(bounds::WAIT_REPLICAS),
        );
        ok && self.wait_replicas <= bounds::WAIT_REPLICAS
    }

    fn memory(&self, err: &mut impl FnMut(String, String)) -> Option<BackendSettings> {
        if self.max_entries == 0 {
            err("store.max_entries".into(), "must be at least 1".into());
            return None;
        }
        Some(BackendSettings::Memory {
            max_entries: self.max_entries,
        })
    }

    /// Refuses every field set that the chosen backend does not read: a setting that would be
    /// silently ignored is a mistake the operator wants to hear about. False: an error was
    /// reported.
    fn fields_fit_backend(&self, err: &mut impl FnMut(String, String)) -> bool {
        use Backend::{Memory, Postgres, Redis, RedisCluster, Sqlite};
        let set: [(&str, bool, &[Backend]); 11] = [
            (
                "store.max_entries",
                self.max_entries != defaults::max_entries(),
                &[Memory],
            ),
            ("store.path", self.path.is_some(), &[Sqlite]),
            ("store.sync", self.sync.is_some(), &[Sqlite]),
            ("store.schema", self.schema.is_some(), &[Postgres]),
            ("store.pool_size", self.pool_size.is_some(), &[Postgres]),
            (
                "store.sweep_interval",
                self.sweep_interval.is_some(),
                &[Sqlite, Postgres],
            ),
            ("store.url", self.url.is_some(), &[Redis, Postgres]),
            ("store.nodes", !self.nodes.is_empty(), &[RedisCluster]),
            (
                "store.password_file",
                self.password_file.is_some(),
                &[Redis, RedisCluster, Postgres],
            ),
            (
                "store.password_env",
                self.password_env.is_some(),
                &[Redis, RedisCluster, Postgres],
            ),
            (
                "store.ca_file",
                self.ca_file.is_some(),
                &[Redis, RedisCluster, Postgres],
            ),
        ];
        let mut ok = true;
        for (field, is_set, backends) in set {
            if is_set && !backends.contains(&self.backend) {
                // redis / redis-cluster give more precise advice about url and nodes below.
                let redis_pair = matches!(
                    (field, self.backend),
                    ("store.url", RedisCluster) | ("store.nodes", Redis)
                );
                if !redis_pair {
                    err(
                        field.into(),
                        format!(
                            "is {}, not read by backend {}: remove it or change store.backend",
                            owners(backends),
                            self.backend.name()
                        ),
                    );
                }
                ok = false;
            }
        }
        if self.wait_replicas != 0 && !matches!(self.backend, Redis | RedisCluster) {
            err(
                "store.wait_replicas".into(),
                format!(
                    "is a Redis setting, not read by backend {}{}",
                    self.backend.name(),
                    if self.backend == Postgres {
                        " (PostgreSQL's analogue is synchronous replication: synchronous_standby_names on the server)"
                    } else {
                        ""
                    }
                ),
            );
            ok = false;
        }
        ok
    }

    fn sweep_interval(&self, err: &mut impl FnMut(String, String)) -> Option<Duration> {
        let every = self.sweep_interval.unwrap_or(defaults::SWEEP_INTERVAL);
        if every.is_zero() {
            err(
                "store.sweep_interval".into(),
                "must be greater than zero".into(),
            );
            return None;
        }
        at_most(err, "store.sweep_interval", every, bounds::SWEEP_INTERVAL);
        (every <= bounds::SWEEP_INTERVAL).then_some(every)
    }

    fn sqlite(&self, err: &mut impl FnMut(String, String)) -> Option<BackendSettings> {
        let sweep_interval = self.sweep_interval(err);
        let path = self.path.as_deref().unwrap_or(defaults::SQLITE_PATH);
        if path.is_empty() {
            err("store.path".into(), "must not be empty".into());
            return None;
        }
        if path == ":memory:" || path.starts_with("file:") {
            err(
                "store.path".into(),
                "must be the path of a file (an in-memory SQLite database keeps nothing across a restart: use backend memory)".into(),
            );
            return None;
        }
        Some(BackendSettings::Sqlite {
            path: PathBuf::from(path),
            sync: self.sync.unwrap_or_default(),
            sweep_interval: sweep_interval?,
        })
    }

    fn postgres(&self, err: &mut impl FnMut(String, String)) -> Option<BackendSettings> {
        let sweep_interval = self.sweep_interval(err);
        let schema = self.schema.as_deref().unwrap_or(defaults::SCHEMA);
        let schema_ok = is_plain_identifier(schema);
        if !schema_ok {
            err(
                "store.schema".into(),
                format!(
                    "{schema:?} is not a plain identifier: 1 to 63 of a-z, 0-9 and _, not starting with a digit"
                ),
            );
        }
        let pool_size = self.pool_size.unwrap_or(defaults::POOL_SIZE);
        let pool_ok = (1..=bounds::POOL_SIZE).contains(&pool_size);
        if !pool_ok {
            err(
                "store.pool_size".into(),
                format!("{pool_size}: must be from 1 to {}", bounds::POOL_SIZE),
            );
        }
        let Some(url) = &self.url else {
            err(
                "store.url".into(),
                "backend postgres needs store.url (postgres://USER@HOST:PORT/DATABASE)".into(),
            );
            return None;
        };
        let config = postgres_config(url, err);
        let password = secret(
            "store.password",
            self.password_file.as_deref(),
            self.password_env.as_deref(),
            err,
        );
        let mut ok =
            !((self.password_file.is_some() || self.password_env.is_some()) && password.is_none());
        let ca_pem = match &self.ca_file {
            None => Some(None),
            Some(path) => read_ca(path, err).map(Some),
        };
        if let Some(config) = &config {
            if password.is_some() && config.get_password().is_some() {
                let field = if self.password_file.is_some() {
                    "store.password_file"
                } else {
                    "store.password_env"
                };
                err(
                    field.into(),
                    "store.url already carries a password; keep one of the two".into(),
                );
                ok = false;
            }
            if self.ca_file.is_some()
                && config.get_ssl_mode() == tokio_postgres::config::SslMode::Disable
            {
                err(
                    "store.ca_file".into(),
                    "is only used over TLS: add sslmode=require to store.url".into(),
                );
                ok = false;
            }
        }
        let (config, ca_pem, sweep_interval) = (config?, ca_pem?, sweep_interval?);
        (ok && schema_ok && pool_ok).then(|| {
            BackendSettings::Postgres(Box::new(PostgresSettings {
                config,
                password,
                ca_pem,
                schema: schema.to_owned(),
                pool_size,
                sweep_interval,
            }))
        })
    }

    fn redis(&self, err: &mut impl FnMut(String, String)) -> Option<BackendSettings> {
        let mut ok = true;
        if !self.nodes.is_empty() {
            err(
                "store.nodes".into(),
                "is for backend redis-cluster; backend redis takes one store.url".into(),
            );
            ok = false;
        }
        let url = self
            .url
            .clone()
            .unwrap_or_else(|| defaults::REDIS_URL.to_owned());
        let access = self.redis_access(std::slice::from_ref(&url), "store.url", err);
        if !redis_url(&url, "store.url", err) {
            ok = false;
        } else if let Some(certs) = access.as_ref().and_then(RedisAccess::certificates) {
            // The client parses the CA file when it is built: build one (it connects
            // lazily) so that a CA file that is not one fails here, at load.
            if let Err(e) = redis::Client::build_with_tls(url.as_str(), certs) {
                err("store.ca_file".into(), e.to_string());
                ok = false;
            }
        }
        let access = access?;
        ok.then_some(BackendSettings::Redis {
            url,
            access,
            wait_replicas: self.wait_replicas,
        })
    }

    fn redis_cluster(&self, err: &mut impl FnMut(String, String)) -> Option<BackendSettings> {
        let mut ok = self.check_seed_nodes(err);
        let access = self.redis_access(&self.nodes, "store.nodes", err);
        if let (true, Some(access)) = (ok, &access) {
            // The cluster client checks what the URLs alone cannot: the same TLS mode and
            // credentials on every seed node, a CA file that parses. Building one connects
            // nothing. The password of `access` is left out: a URL with one of its own
            // was refused above, so there is nothing to compare it with.
            let mut cluster =
                redis::cluster::ClusterClient::builder(self.nodes.iter().map(String::as_str));
            if let Some(certs) = access.certificates() {
                cluster = cluster.certs(certs);
            }
            if let Err(e) = cluster.build() {
                err("store.nodes".into(), e.to_string());
                ok = false;
            }
        }
        let access = access?;
        ok.then(|| BackendSettings::RedisCluster {
            nodes: self.nodes.clone(),
            access,
        })
    }

    /// What `redis-cluster` asks of `store:`, its seed nodes one by one. False: an error was
    /// reported.
    fn check_seed_nodes(&self, err: &mut impl FnMut(String, String)) -> bool {
        let mut ok = true;
        if self.url.is_some() {
            err(
                "store.url".into(),
                "is for backend redis; list the cluster's seed nodes in store.nodes".into(),
            );
            ok = false;
        }
        if self.wait_replicas != 0 {
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
        if self.nodes.is_empty() {
            err(
                "store.nodes".into(),
                "backend redis-cluster needs at least one seed node (redis://HOST:PORT)".into(),
            );
            ok = false;
        }
        if self.nodes.len() > bounds::NODES {
            err(
                "store.nodes".into(),
                format!("{} seed nodes: at most {}", self.nodes.len(), bounds::NODES),
            );
            ok = false;
        }
        for (i, node) in self.nodes.iter().enumerate() {
            ok &= redis_url(node, &format!("store.nodes[{i}]"), err);
        }
        let tls = self
            .nodes
            .iter()
            .filter(|n| n.starts_with("rediss://"))
            .count();
        if tls != 0 && tls != self.nodes.len() {
            err(
                "store.nodes".into(),
                "mixes redis:// and rediss:// (TLS) seed nodes; a cluster is reached one way"
                    .into(),
            );
            ok = false;
        }
        ok
    }

    /// Reads the Redis password (`store.password_file` / `store.password_env`) and CA file
    /// (`store.ca_file`), checking them against the URLs: a password in a URL *and* in a file
    /// is ambiguous, and a CA without `rediss://` would silently not be used. `None`: an error
    /// was reported.
    fn redis_access(
        &self,
        urls: &[String],
        urls_field: &str,
        err: &mut impl FnMut(String, String),
    ) -> Option<RedisAccess> {
        let password = self.redis_password(urls, urls_field, err);
        let ca_pem = self.redis_ca(urls, urls_field, err);
        Some(RedisAccess {
            password: password?,
            ca_pem: ca_pem?,
        })
    }

    /// The password, if one is set outside the URLs. Outer `None`: an error was reported.
    fn redis_password(
        &self,
        urls: &[String],
        urls_field: &str,
        err: &mut impl FnMut(String, String),
    ) -> Option<Option<Secret>> {
        let mut ok = true;
        let password = secret(
            "store.password",
            self.password_file.as_deref(),
            self.password_env.as_deref(),
            err,
        );
        if (self.password_file.is_some() || self.password_env.is_some()) && password.is_none() {
            ok = false;
        }
        let inline_password = urls.iter().any(|u| {
            redis::IntoConnectionInfo::into_connection_info(u.as_str())
                .is_ok_and(|info| info.redis_settings().password().is_some())
        });
        if password.is_some() && inline_password {
            let field = if self.password_file.is_some() {
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
        ok.then_some(password)
    }

    /// The PEM of `store.ca_file`, if set. Outer `None`: an error was reported.
    fn redis_ca(
        &self,
        urls: &[String],
        urls_field: &str,
        err: &mut impl FnMut(String, String),
    ) -> Option<Option<Vec<u8>>> {
        let Some(path) = &self.ca_file else {
            return Some(None);
        };
        let mut ok = true;
        if !urls.iter().all(|u| u.starts_with("rediss://")) {
            err(
                "store.ca_file".into(),
                format!("is only used over TLS: {urls_field} must use rediss://"),
            );
            ok = false;
        }
        let pem = read_ca(path, err)?;
        ok.then_some(Some(pem))
    }
}

/// Who reads a setting, as an error message names them: "a Redis setting".
fn owners(backends: &[Backend]) -> &'static str {
    use Backend::{Memory, Postgres, Redis, RedisCluster, Sqlite};
    match backends {
        [Memory] => "a memory-store setting",
        [Sqlite] => "an SQLite setting",
        [Postgres] => "a PostgreSQL setting",
        [Sqlite, Postgres] => "an SQLite and PostgreSQL setting",
        [Redis] | [RedisCluster] | [Redis, RedisCluster] => "a Redis setting",
        [Redis, Postgres] => "a Redis and PostgreSQL setting",
        _ => "a Redis and PostgreSQL setting",
    }
}

/// Reads a PEM file of CA certificates (`store.ca_file`). `None`: an error was reported.
fn read_ca(path: &str, err: &mut impl FnMut(String, String)) -> Option<Vec<u8>> {
    match std::fs::read(path) {
        Ok(pem) if String::from_utf8_lossy(&pem).contains("-----BEGIN CERTIFICATE-----") => {
            Some(pem)
        }
        Ok(_) => {
            err(
                "store.ca_file".into(),
                format!("{path} holds no PEM certificate (-----BEGIN CERTIFICATE-----)"),
            );
            None
        }
        Err(e) => {
            err("store.ca_file".into(), format!("cannot read {path}: {e}"));
            None
        }
    }
}

/// 1 to 63 of `a-z`, `0-9`, `_`, not starting with a digit: a name PostgreSQL takes as it is,
/// unquoted, so it can be put into the proxy's statements without quoting rules.
fn is_plain_identifier(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

/// Parses a PostgreSQL URL with tokio-postgres's own parser. libpq's `sslmode=verify-ca` and
/// `verify-full` read as `require`: over TLS the proxy always verifies the server's certificate
/// (against `store.ca_file`, or the public web roots). `None`: an error was reported.
fn postgres_config(
    url: &str,
    err: &mut impl FnMut(String, String),
) -> Option<tokio_postgres::Config> {
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        err(
            "store.url".into(),
            format!(
                "invalid PostgreSQL URL {:?}: it must start with postgres:// or postgresql://",
                redact_url(url)
            ),
        );
        return None;
    }
    let normalized = url
        .replace("sslmode=verify-full", "sslmode=require")
        .replace("sslmode=verify-ca", "sslmode=require");
    match normalized.parse::<tokio_postgres::Config>() {
        Ok(config) if config.get_hosts().is_empty() => {
            err(
                "store.url".into(),
                "names no host (postgres://USER@HOST:PORT/DATABASE)".into(),
            );
            None
        }
        Ok(config) if config.get_user().is_none() => {
            err(
                "store.url".into(),
                "names no user (postgres://USER@HOST:PORT/DATABASE)".into(),
            );
            None
        }
        Ok(mut config) => {
            // tokio-postgres reads an absent sslmode as `prefer`, and the proxy's TLS always
            // verifies the certificate: a server offering TLS with a certificate nobody signed
            // (a distribution's snakeoil) would then be refused where plaintext was meant.
            // Absent means no TLS, as documented; `prefer` must be asked for.
            if !names_sslmode(&normalized) {
                config.ssl_mode(tokio_postgres::config::SslMode::Disable);
            }
            Some(config)
        }
        Err(e) => {
            err("store.url".into(), format!("invalid PostgreSQL URL: {e}"));
            None
        }
    }
}

/// Whether the URL's query names `sslmode`.
fn names_sslmode(url: &str) -> bool {
    url.split_once('?').is_some_and(|(_, query)| {
        form_urlencoded::parse(query.as_bytes()).any(|(name, _)| name == "sslmode")
    })
}

/// The URL with any password replaced by `***`, for an error message.
fn redact_url(url: &str) -> String {
    match (url.find("://"), url.find('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            match userinfo.find(':') {
                Some(colon) => format!(
                    "{}{}:***{}",
                    &url[..scheme + 3],
                    &userinfo[..colon],
                    &url[at..]
                ),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

/// Checks one Redis URL with the redis crate's own parser, reporting at `field`. False: an
/// error was reported.
fn redis_url(url: &str, field: &str, err: &mut impl FnMut(String, String)) -> bool {
    if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
        err(
            field.into(),
            format!("invalid Redis URL {url:?}: it must start with redis:// or rediss://"),
        );
        false
    } else if let Err(e) = redis::Client::open(url) {
        err(field.into(), format!("invalid Redis URL: {e}"));
        false
    } else {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The paths of the errors `store:` written as `yaml` gets.
    fn refused_at(yaml: &str) -> Vec<String> {
        let raw: RawStore = yaml_serde::from_str(yaml).expect("a store section");
        let mut paths = Vec::new();
        let settings = raw.validate(&mut |path, _| paths.push(path));
        assert!(settings.is_none(), "{yaml} was accepted");
        paths
    }

    /// No `sslmode` in the URL means no TLS (tokio-postgres alone would read `prefer`).
    #[test]
    fn a_postgres_url_without_sslmode_means_no_tls() {
        use tokio_postgres::config::SslMode;
        let mode = |url: &str| {
            let raw: RawStore = yaml_serde::from_str(&format!("backend: postgres\nurl: {url}"))
                .expect("a store section");
            match raw.validate(&mut |path, why| panic!("{path}: {why}")) {
                Some(StoreSettings {
                    backend: BackendSettings::Postgres(pg),
                    ..
                }) => pg.config.get_ssl_mode(),
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(mode("postgres://u@db/x"), SslMode::Disable);
        assert_eq!(mode("postgres://u@db/x?sslmode=prefer"), SslMode::Prefer);
        assert_eq!(
            mode("postgres://u@db/x?sslmode=verify-full"),
            SslMode::Require
        );
        let dir = tempfile::tempdir().expect("temp dir");
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, "-----BEGIN CERTIFICATE-----\n").expect("write");
        let plain = format!(
            "backend: postgres\nurl: postgres://u@db/x\nca_file: {}",
            ca.display()
        );
        assert_eq!(refused_at(&plain), ["store.ca_file"]);
    }

    /// The checks the Redis clients make when they are built, made at load without the store.
    #[test]
    fn redis_settings_the_client_would_refuse_are_refused_at_load() {
        let nodes = "backend: redis-cluster\nnodes: [\"redis://:a@127.0.0.1:7000\", \"redis://:b@127.0.0.1:7001\"]";
        assert_eq!(refused_at(nodes), ["store.nodes"], "different passwords");
        let dir = tempfile::tempdir().expect("temp dir");
        let ca = dir.path().join("ca.pem");
        std::fs::write(
            &ca,
            "-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n",
        )
        .expect("write");
        let ca = ca.display();
        let redis = format!("backend: redis\nurl: rediss://127.0.0.1:6380/0\nca_file: {ca}");
        assert_eq!(refused_at(&redis), ["store.ca_file"]);
        let cluster =
            format!("backend: redis-cluster\nnodes: [\"rediss://127.0.0.1:7000\"]\nca_file: {ca}");
        assert_eq!(refused_at(&cluster), ["store.nodes"]);
    }
}
