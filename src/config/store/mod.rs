//! `store:`: which store keeps the idempotency records, and how to reach it: the section as
//! written ([`RawStore`], one flat mapping, SPEC §3) and what every backend shares here, each
//! backend's own settings and checks in a file of its own (`memory`, `sqlite`, `postgres`,
//! `redis`).
//!
//! The typed settings the store is built from ([`StoreSettings`], [`BackendSettings`],
//! [`RedisAccess`]) are defined here and the store imports them, never the other way: loading
//! a file opens no store. A Redis URL is checked with the redis crate's own parsers and client
//! builders, which connect nothing.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

mod memory;
mod postgres;
mod redis;
mod sqlite;

use super::units::{at_most, bounds, count_at_most, duration};

pub use postgres::PostgresSettings;
pub use redis::RedisAccess;
pub use sqlite::SqliteSync;

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
