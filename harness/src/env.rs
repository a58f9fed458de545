//! One test's world ([`Env`]) on one of the five stores ([`Backend`]), and [`every_store!`](crate::every_store),
//! which runs a test written once on each of them.
//!
//! Every test gets a store of its own, so tests running side by side never see each other's
//! records:
//! - `memory`: the proxy's own;
//! - `sqlite`: a file in a temp dir of the test's ([`SqliteFile`]);
//! - `postgres`: a schema of its own ([`PgServer::fresh_schema`]) on the test binary's one
//!   server ([`PgServer::shared`]: an initdb per test would cost seconds), reached through a
//!   [`Relay`] of its own, so a test can cut its store off without touching the server the other
//!   tests use;
//! - `redis`: a `redis-server` of its own;
//! - `redis-cluster`: a one-node cluster of its own ([`RedisCluster::single_node`]): one process
//!   serving every slot, and still a real cluster to the client (it reads the slot map and
//!   routes each command by slot, as on a cluster of many).
//!
//! A test looks into any store but memory with [`Env::stored_keys`] — the live store keys and
//! their remaining time to live, read as an operator reads them (`KEYS`/`PTTL`, `sqlite3`,
//! `psql`) — and cuts it off with [`Env::make_store_unreachable`].

use std::sync::{Arc, Once};
use std::time::Duration;

use idemproxy::config::{BackendSettings, Config};
use idemproxy::metrics::Metrics;
use idemproxy::store::memory::MemoryStore;
use idemproxy::store::postgres::PostgresStore;
use idemproxy::store::redis::RedisStore;
use idemproxy::store::sqlite::SqliteStore;
use idemproxy::store::{Store, StoreHandle};

use super::cluster::RedisCluster;
use super::mock::{self, MockHandle};
use super::postgres::PgServer;
use super::relay::Relay;
use super::sqlite::SqliteFile;
use super::store_checks;
use super::{RedisServer, TestProxy};

/// Which store a test runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Memory,
    Sqlite,
    Postgres,
    Redis,
    RedisCluster,
}

impl Backend {
    /// Its name in `store.backend`.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Memory => "memory",
            Backend::Sqlite => "sqlite",
            Backend::Postgres => "postgres",
            Backend::Redis => "redis",
            Backend::RedisCluster => "redis-cluster",
        }
    }
}

/// Runs each named `async fn NAME(backend: Backend)` against every store, as `memory::NAME`,
/// `sqlite::NAME`, `postgres::NAME`, `redis::NAME` and `redis_cluster::NAME` (so
/// `cargo test --test proxy -- sqlite::` runs one backend).
#[macro_export]
macro_rules! every_store {
    ($($name:ident),* $(,)?) => {
        $crate::every_store!(@on memory, Memory, $($name),*);
        $crate::every_store!(@on sqlite, Sqlite, $($name),*);
        $crate::every_store!(@on postgres, Postgres, $($name),*);
        $crate::every_store!(@on redis, Redis, $($name),*);
        $crate::every_store!(@on redis_cluster, RedisCluster, $($name),*);
    };
    (@on $module:ident, $backend:ident, $($name:ident),*) => {
        mod $module {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    $crate::warm_up();
                    super::$name($crate::Backend::$backend).await
                }
            )*
        }
    };
}

/// Starts, once per test binary and in the background, the spare one-node clusters (2s each
/// before a new primary says `cluster_state:ok`). `every_store!` and `store_contract!` call it
/// first thing in every test: where libtest runs `memory::*` first, by the time the first
/// `redis_cluster::` test asks for its store, one is ready, instead of both test threads
/// waiting for it. (Each spare has
/// its watchdog from the moment it is spawned, so a binary that exits meanwhile leaves none
/// behind. The shared PostgreSQL server is not started ahead: between its spawn and its
/// watchdog, an exit would leave it running.)
pub fn warm_up() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        std::thread::spawn(RedisCluster::start_spares);
    });
}

/// A live store key, as the store keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredKey {
    /// `key_prefix` + route + `:` + hex SHA-256.
    pub key: String,
    /// Its remaining time to live; `None` for a Redis key without one (`PTTL` -1), which the
    /// proxy never writes.
    pub ttl: Option<Duration>,
}

/// A schema of the test's own on the shared PostgreSQL server, through a relay of its own.
pub struct PgSchema {
    /// The schema's name (`store.schema`).
    pub schema: String,
    /// Between the proxy and the server: the test's switch to cut its store off.
    pub relay: Relay,
}

impl PgSchema {
    async fn new() -> PgSchema {
        // The first test of the binary starts the server (initdb, a few seconds): off the
        // runtime's threads.
        let pg = tokio::task::spawn_blocking(PgServer::shared)
            .await
            .expect("start the shared PostgreSQL server");
        PgSchema {
            schema: PgServer::fresh_schema(),
            relay: Relay::start(pg.addr()).await,
        }
    }

    /// The server, for `sql`.
    pub fn server(&self) -> &'static PgServer {
        PgServer::shared()
    }

    /// `store.url`: the server through the relay.
    pub fn url(&self) -> String {
        self.server().url_via(self.relay.addr().port())
    }

    /// Every row of `<schema>.records` that expires in the future (an expired row may linger
    /// until the sweep, and counts as absent), with its remaining time to live on the server's
    /// clock, sorted by key. Read over the server's own socket, never through the relay.
    pub fn stored_keys(&self) -> Vec<StoredKey> {
        let out = self.server().sql(&format!(
            "SELECT key, (extract(epoch FROM expires_at - now()) * 1000)::bigint \
             FROM {}.records WHERE expires_at > now() ORDER BY key",
            self.schema
        ));
        out.lines()
            .filter(|l| !l.is_empty())
            .map(|line| {
                let (key, ms) = line
                    .rsplit_once('|')
                    .unwrap_or_else(|| panic!("a row is key|ms: {line:?}"));
                let ms: u64 = ms
                    .parse()
                    .unwrap_or_else(|e| panic!("remaining ms {ms:?}: {e}"));
                StoredKey {
                    key: key.to_owned(),
                    ttl: Some(Duration::from_millis(ms)),
                }
            })
            .collect()
    }
}

/// What holds a test's records.
enum TestStore {
    Memory,
    Sqlite(SqliteFile),
    Postgres(PgSchema),
    Redis(RedisServer),
    RedisCluster(RedisCluster),
    /// The test took its Redis out ([`Env::take_redis`]).
    Taken,
}

/// One test's world: an upstream and a store of its own.
pub struct Env {
    pub backend: Backend,
    pub mock: MockHandle,
    store: TestStore,
}

impl Env {
    /// A fresh mock upstream and a fresh store on `backend`.
    pub async fn new(backend: Backend) -> Env {
        let store = match backend {
            Backend::Memory => TestStore::Memory,
            Backend::Sqlite => TestStore::Sqlite(SqliteFile::new()),
            Backend::Postgres => TestStore::Postgres(PgSchema::new().await),
            Backend::Redis => TestStore::Redis(RedisServer::start()),
            Backend::RedisCluster => TestStore::RedisCluster(RedisCluster::single_node()),
        };
        Env::on(backend, store).await
    }

    /// A fresh mock upstream and this Redis (started with options of the test's).
    pub async fn on_redis(redis: RedisServer) -> Env {
        Env::on(Backend::Redis, TestStore::Redis(redis)).await
    }

    async fn on(backend: Backend, store: TestStore) -> Env {
        let mock = mock::start().await.expect("start the mock upstream");
        Env {
            backend,
            mock,
            store,
        }
    }

    /// The Redis of a Redis test.
    pub fn redis(&self) -> &RedisServer {
        match &self.store {
            TestStore::Redis(r) => r,
            _ => panic!("a Redis test (this one runs on {})", self.backend.name()),
        }
    }

    /// Mutable access to the Redis of a Redis test.
    pub fn redis_mut(&mut self) -> &mut RedisServer {
        match &mut self.store {
            TestStore::Redis(r) => r,
            _ => panic!("a Redis test (this one runs on {})", self.backend.name()),
        }
    }

    /// Takes the Redis of a Redis test out of the `Env`, so that a test can restart or kill it
    /// while the `Env` is borrowed elsewhere. The configuration must be made before: the `Env`
    /// has no store to name from then on.
    pub fn take_redis(&mut self) -> RedisServer {
        match std::mem::replace(&mut self.store, TestStore::Taken) {
            TestStore::Redis(r) => r,
            other => {
                self.store = other;
                panic!("a Redis test (this one runs on {})", self.backend.name())
            }
        }
    }

    /// The one-node cluster of a Redis Cluster test.
    pub fn cluster(&self) -> &RedisCluster {
        match &self.store {
            TestStore::RedisCluster(c) => c,
            _ => panic!(
                "a Redis Cluster test (this one runs on {})",
                self.backend.name()
            ),
        }
    }

    /// A connection to the Redis of a Redis test, or to the node of a one-node Redis Cluster
    /// test (which holds every key).
    pub fn redis_conn(&self) -> redis::Connection {
        match &self.store {
            TestStore::Redis(r) => r.conn(),
            TestStore::RedisCluster(c) => c.conn(c.nodes[0].port),
            _ => panic!(
                "a Redis or Redis Cluster test (this one runs on {})",
                self.backend.name()
            ),
        }
    }

    /// The SQLite file of an SQLite test.
    pub fn sqlite(&self) -> &SqliteFile {
        match &self.store {
            TestStore::Sqlite(f) => f,
            _ => panic!("an SQLite test (this one runs on {})", self.backend.name()),
        }
    }

    /// The schema and relay of a PostgreSQL test.
    pub fn postgres(&self) -> &PgSchema {
        match &self.store {
            TestStore::Postgres(p) => p,
            _ => panic!(
                "a PostgreSQL test (this one runs on {})",
                self.backend.name()
            ),
        }
    }

    /// The `store:` lines that name this test's store (unindented).
    fn store_lines(&self) -> String {
        match &self.store {
            TestStore::Memory => "backend: memory\n".to_owned(),
            TestStore::Sqlite(f) => format!("backend: sqlite\npath: {}\n", f.path().display()),
            TestStore::Postgres(p) => format!(
                "backend: postgres\nurl: {}\nschema: {}\n",
                p.url(),
                p.schema
            ),
            TestStore::Redis(r) => format!("backend: redis\nurl: {}\n", r.url()),
            TestStore::RedisCluster(c) => c.store_lines(),
            TestStore::Taken => panic!("the test took its Redis out: no store to name"),
        }
    }

    /// The `store:` section for this backend, with the lines in `extra` (store timeout 300ms
    /// unless `extra` sets it).
    pub fn store_yaml(&self, extra: &str) -> String {
        let mut s = "store:\n".to_owned();
        let mut lines: Vec<String> = self.store_lines().lines().map(str::to_owned).collect();
        if !extra.contains("timeout:") {
            lines.push("timeout: 300ms".to_owned());
        }
        lines.extend(
            extra
                .lines()
                .filter(|l| !l.trim().is_empty())
                .map(|l| l.trim().to_owned()),
        );
        for line in lines {
            s.push_str("  ");
            s.push_str(&line);
            s.push('\n');
        }
        s
    }

    /// A whole configuration: `POST /bookings` (route `create-booking`) idempotent with the
    /// `idempotency:` lines in `idem` (indented freely; one setting a line), `/pay/*` (route
    /// `pay`) idempotent with `lock_ttl: 2s`, and every other path (route `rest`) passed
    /// through; served by two workers, whatever the machine (the default, one a core, would be
    /// one on a one-core runner), so that every test on it — drains, reloads and chaos among
    /// them — has connections on two workers.
    pub fn config(&self, idem: &str) -> String {
        self.config_with(idem, "")
    }

    /// [`Env::config`] with extra `store:` lines.
    pub fn config_with(&self, idem: &str, store: &str) -> String {
        let mut idem_lines = String::new();
        for line in idem.lines().filter(|l| !l.trim().is_empty()) {
            idem_lines.push_str("      ");
            idem_lines.push_str(line.trim());
            idem_lines.push('\n');
        }
        if idem_lines.is_empty() {
            idem_lines.push_str("      required: true\n");
        }
        format!(
            "listen: 127.0.0.1:0\nworkers: 2\nshutdown_timeout: 10s\n{store}upstreams:\n  booking:\n    url: {up}\n    connect_timeout: 1s\n    timeout: 5s\nroutes:\n  - name: create-booking\n    methods: [POST]\n    path: /bookings\n    upstream: booking\n    idempotency:\n{idem_lines}  - name: pay\n    path: /pay/*\n    upstream: booking\n    idempotency:\n      lock_ttl: 2s\n  - name: rest\n    path: /*\n    upstream: booking\n",
            store = self.store_yaml(store),
            up = self.mock.url(),
        )
    }

    /// Starts a proxy in this process with this configuration.
    pub async fn proxy(&self, yaml: &str) -> TestProxy {
        TestProxy::start(yaml).await
    }

    /// This test's store as a bare backend, built from its `store:` section as the proxy builds
    /// it, with `store.timeout` [`store_checks::DEADLINE`]: for the contract checks. On
    /// SQLite, one store at a time (and no proxy meanwhile): the file takes one at once.
    pub async fn store(&self) -> Arc<dyn Store> {
        let timeout = store_checks::DEADLINE.as_millis();
        let yaml = self.config_with("", &format!("timeout: {timeout}ms"));
        let config = Config::from_yaml(&yaml).unwrap_or_else(|e| panic!("config: {e}\n{yaml}"));
        let s = &config.store;
        let metrics = Arc::new(Metrics::new());
        let what = self.backend.name();
        match &s.backend {
            BackendSettings::Memory { max_entries } => Arc::new(MemoryStore::new(*max_entries)),
            BackendSettings::Sqlite {
                path,
                sync,
                sweep_interval,
            } => Arc::new(
                SqliteStore::open(path, *sync, *sweep_interval, metrics)
                    .unwrap_or_else(|e| panic!("open the {what} store: {e}")),
            ),
            BackendSettings::Postgres(settings) => Arc::new(
                PostgresStore::connect(settings, s.timeout, metrics)
                    .await
                    .unwrap_or_else(|e| panic!("connect the {what} store: {e}")),
            ),
            BackendSettings::Redis {
                url,
                access,
                wait_replicas,
            } => Arc::new(
                RedisStore::connect(url, access, *wait_replicas, s.timeout, metrics)
                    .unwrap_or_else(|e| panic!("connect the {what} store: {e}")),
            ),
            BackendSettings::RedisCluster { nodes, access } => Arc::new(
                RedisStore::cluster(nodes, access, s.timeout, &metrics)
                    .unwrap_or_else(|e| panic!("connect the {what} store: {e}")),
            ),
        }
    }

    /// [`Env::store`] behind a [`StoreHandle`], as the proxy holds its store.
    pub async fn store_handle(&self) -> StoreHandle {
        store_checks::handle(self.store().await)
    }

    /// Every live key in this test's store with its remaining time to live, sorted by key.
    /// Any backend but memory, whose records only the proxy can see: check
    /// [`Backend::Memory`] first, or use [`Env::stored_key_names`].
    pub fn stored_keys(&self) -> Vec<StoredKey> {
        match &self.store {
            TestStore::Memory => panic!("the memory store cannot be looked into from outside"),
            TestStore::Sqlite(f) => f.stored_keys(),
            TestStore::Postgres(p) => p.stored_keys(),
            TestStore::Redis(r) => redis_keys(&mut r.conn()),
            TestStore::RedisCluster(c) => {
                // The one node serves every slot: it holds every key.
                let port = c.nodes[0].port;
                redis_keys(&mut c.conn(port))
            }
            TestStore::Taken => panic!("the test took its Redis out"),
        }
    }

    /// The names of [`Env::stored_keys`]; `None` on memory, which cannot be looked into.
    pub fn stored_key_names(&self) -> Option<Vec<String>> {
        (self.backend != Backend::Memory)
            .then(|| self.stored_keys().into_iter().map(|k| k.key).collect())
    }

    /// Cuts the proxy off from its store, so that every operation fails in bounded time: Redis
    /// is killed; the cluster's node is killed; PostgreSQL's relay resets every connection and
    /// refuses new ones; the SQLite file's write lock is taken by another connection (every
    /// write then fails with SQLITE_BUSY once the store's busy timeout, shorter than
    /// `store.timeout`, runs out; reads still answer). Not memory, which has no outside: fill
    /// it (`max_entries`) instead.
    pub fn make_store_unreachable(&mut self) {
        match &mut self.store {
            TestStore::Memory => panic!("the memory store cannot be cut off: fill it instead"),
            TestStore::Sqlite(f) => f.lock_writes(),
            TestStore::Postgres(p) => p.relay.refuse(),
            TestStore::Redis(r) => r.kill(),
            TestStore::RedisCluster(c) => c.kill_all(),
            TestStore::Taken => panic!("the test took its Redis out"),
        }
    }
}

/// `KEYS *` and each key's `PTTL`, sorted by key (a key that expired between the two is left
/// out).
fn redis_keys(conn: &mut redis::Connection) -> Vec<StoredKey> {
    let mut keys: Vec<String> = redis::cmd("KEYS").arg("*").query(conn).expect("KEYS *");
    keys.sort();
    keys.into_iter()
        .filter_map(|key| {
            let pttl: i64 = redis::cmd("PTTL").arg(&key).query(conn).expect("PTTL");
            match pttl {
                -2 => None,
                -1 => Some(StoredKey { key, ttl: None }),
                ms => Some(StoredKey {
                    key,
                    ttl: Some(Duration::from_millis(
                        u64::try_from(ms).expect("PTTL is -2, -1 or the milliseconds left"),
                    )),
                }),
            }
        })
        .collect()
}
