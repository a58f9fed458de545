//! The Redis store: several proxy instances sharing one Redis, or one Redis Cluster, behave as
//! one.
//!
//! - The claim is one command, `SET key value NX PX lease GET` (Redis ≥ 7.0): it takes the key
//!   if free and otherwise returns what is there, atomically and in one round trip. The replay
//!   path therefore costs one round trip too.
//! - Renew, save and release are Lua scripts that first compare the key's value with the
//!   holder's whole in-progress value (which contains its random token): a holder whose lease
//!   expired and was re-claimed by another request can never overwrite or delete the newer
//!   claim. Scripts run by `EVALSHA` and are reloaded on `NOSCRIPT` ([`redis::Script`] does it;
//!   on a cluster the reload goes to every node, so a promoted replica that never saw the
//!   script gets it too).
//! - A large finished record (from [`staged::STAGE_FROM`] bytes) is not passed to the script:
//!   Lua would hash every byte of it. It goes to a staging key of its own by a plain `SET`, and
//!   the script moves it over the claim with `RENAME` ([`staged`] says why that fences as
//!   strongly); the record key then holds the whole record, as after an inline save.
//! - Every command names one record key (the staged save's script also its staging key,
//!   in the same slot), so on a Redis Cluster each one is routed by its key's slot and follows
//!   `MOVED` and `ASK` redirections like any single-key command: the store is generic over the
//!   connection ([`RedisConnection`]), the same code on both.
//! - One multiplexed connection (a [`ConnectionManager`], or the cluster client's connection
//!   per node), created lazily so the proxy starts while Redis is down, and reconnecting by
//!   itself after Redis comes back. Deadlines are applied by [`super::StoreHandle`], because a
//!   stopped Redis otherwise hangs a call forever.
//! - With `store.wait_replicas`, a claim and a save also wait for replicas to acknowledge
//!   them (`WAIT`), on a dedicated connection ([`replicas`] says why).
//! - A command whose connection had dropped (Redis restarted, or closed it idle) is sent once
//!   more on a new connection, within the same deadline ([`resend`] says when that is safe).
//!
//! Layout: this file holds the store; [`scripts`] its Lua scripts, [`staged`] the save
//! of large records, [`resend`] the second try after a dropped connection, [`connect`] builds
//! clients from the configuration, [`replicas`] the `WAIT` machinery, [`check`] the start-up
//! checks of the servers.

mod check;
mod claim;
mod connect;
mod connection;
mod replicas;
mod resend;
mod resolvable;
mod scripts;
mod staged;
mod tooling;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{AsyncCommands, RedisResult, Script};

pub(crate) use self::connect::{client, cluster_client};
pub use self::connection::RedisConnection;
pub use self::replicas::RedisSeries;
use self::replicas::Replicas;
use self::resolvable::ResolvableScripts;
use self::scripts::{INSPECT, RELEASE, RENEW, SAVE, SAVE_STAGED};
use super::{Forgotten, Held, ResolvableFound, ResolvableTimes, Store, StoreError, StoreKey};
use crate::config::RedisAccess;
use crate::metrics::{Metrics, StoreOp};
use crate::record::DecodeError;

/// The Redis store, on one Redis (the default) or a Redis Cluster.
pub struct RedisStore<C = ConnectionManager> {
    conn: C,
    /// `host:port` of a single Redis, for logs; empty on a cluster (nodes name themselves).
    server: String,
    timeout: Duration,
    renew: Script,
    save: Script,
    save_staged: Script,
    release: Script,
    inspect: Script,
    forget: Script,
    /// The scripts of a claim that can be resolved (`on_unknown_outcome: resolve`).
    resolvable: ResolvableScripts,
    /// `store.wait_replicas` > 0 (one Redis only).
    replicas: Option<Replicas>,
}

/// Maps a Redis error. A value of another Redis type under a store key (WRONGTYPE) is a corrupt
/// record, like one that does not decode (SPEC §4.5): something else wrote there, and an
/// operation may have run under the key, so it is never forwarded.
fn backend(op: &'static str) -> impl FnOnce(redis::RedisError) -> StoreError {
    move |e| {
        if e.code() == Some("WRONGTYPE") || e.to_string().contains("WRONGTYPE") {
            return StoreError::Corrupt(DecodeError(
                "the key holds another Redis type (WRONGTYPE)",
            ));
        }
        StoreError::Backend {
            op,
            source: Box::new(e),
        }
    }
}

/// `fut` within `timeout`, as a [`StoreError::Timeout`] of `op` otherwise: for the steps of an
/// operation made of several (a write, its `WAIT`, a release), each bounded on its own.
async fn bounded<T>(
    op: &'static str,
    timeout: Duration,
    fut: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(timeout, fut)
        .await
        .unwrap_or(Err(StoreError::Timeout { op, after: timeout }))
}

/// Milliseconds for `PX` and `WAIT`, at least 1 (0 is an error for `PX`, and "forever" for
/// `WAIT`).
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl RedisStore<ConnectionManager> {
    /// Prepares a store for `url`. Connects lazily: the proxy starts even while Redis is down,
    /// answering 503 (or forwarding) until it is back. `timeout` bounds each connection attempt.
    pub fn new(url: &str, timeout: Duration) -> Result<Self, StoreError> {
        let client = redis::Client::open(url).map_err(backend("connect"))?;
        Self::with_client(client, timeout)
    }

    /// Prepares a store for one Redis as configured: `url` with the password and CA of
    /// `access`, and with `wait_replicas` > 0, claims and saves acknowledged by that
    /// many replicas (short acknowledgements are counted in `metrics`).
    pub fn connect(
        url: &str,
        access: &RedisAccess,
        wait_replicas: u32,
        timeout: Duration,
        metrics: Arc<Metrics>,
    ) -> Result<Self, StoreError> {
        let client = client(url, access).map_err(backend("connect"))?;
        let series = metrics.store_series::<RedisSeries>();
        let mut store = Self::with_client(client.clone(), timeout)?;
        if wait_replicas > 0 {
            store.replicas = Some(Replicas::new(client, wait_replicas, timeout, series));
        }
        Ok(store)
    }

    fn with_client(client: redis::Client, timeout: Duration) -> Result<Self, StoreError> {
        let server = client.get_connection_info().addr().to_string();
        // One attempt per (re)connection, no backoff retries: a refused connection (Redis
        // down) is a 503 at once, not at `store.timeout` ([`resend`] tries a fresh one). An
        // attempt may outlive its operation (a hung Redis): `store.timeout` ends the wait.
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout.saturating_mul(2)))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(0);
        let conn = client
            .get_connection_manager_lazy(config)
            .map_err(backend("connect"))?;
        Ok(RedisStore::on(conn, server, timeout))
    }
}

impl RedisStore<ClusterConnection> {
    /// Prepares a store for the Redis Cluster reached through `nodes`, with the password and
    /// CA of `access`. Connects in the background: the proxy starts while the cluster is down.
    /// Its series are exported by `metrics` from now on, as one Redis's are.
    pub fn cluster(
        nodes: &[String],
        access: &RedisAccess,
        timeout: Duration,
        metrics: &Metrics,
    ) -> Result<Self, StoreError> {
        let client = cluster_client(nodes, access, timeout).map_err(backend("connect"))?;
        let _ = metrics.store_series::<RedisSeries>();
        let conn = connect::cluster_connection(&client, timeout);
        Ok(RedisStore::on(conn, String::new(), timeout))
    }
}

impl<C: RedisConnection> RedisStore<C> {
    fn on(conn: C, server: String, timeout: Duration) -> Self {
        RedisStore {
            conn,
            server,
            timeout,
            renew: Script::new(RENEW),
            save: Script::new(SAVE),
            save_staged: Script::new(SAVE_STAGED),
            release: Script::new(RELEASE),
            inspect: Script::new(INSPECT),
            forget: Script::new(&scripts::forget()),
            resolvable: ResolvableScripts::new(),
            replicas: None,
        }
    }

    /// Checks the servers at start: warns loudly when one may evict keys (an evicted record is
    /// a forgotten operation), is too old for `SET NX GET`, or (with `store.wait_replicas`)
    /// has fewer replicas than it waits for. Failures to check are logged, not fatal: the
    /// proxy must start while Redis is down.
    pub(crate) async fn check_server(&self, timeout: Duration) {
        check::check_servers(&self.conn, &self.server, timeout).await;
        if let Some(replicas) = &self.replicas {
            check::check_replicas(&self.conn, &self.server, timeout, replicas.wanted()).await;
        }
    }

    /// Runs `attempt` on the shared connection, and once more if that connection had dropped
    /// ([`resend`] says when that is safe).
    async fn shared<T, Fut>(
        &self,
        op: &'static str,
        mut attempt: impl FnMut(C) -> Fut,
    ) -> Result<T, StoreError>
    where
        Fut: Future<Output = RedisResult<T>>,
    {
        resend::once_more(op, C::FRESH_ATTEMPT_AFTER_REFUSAL, || {
            attempt(self.conn.clone())
        })
        .await
        .map_err(backend(op))
    }
}

#[async_trait]
impl<C: RedisConnection> Store for RedisStore<C> {
    fn deadline(&self, op: StoreOp, timeout: Duration) -> Duration {
        match (op, &self.replicas) {
            // Several steps, each bounded by `timeout` on its own (checkout and write, WAIT
            // with its grace, a release): this outer deadline is only a backstop, longer than
            // their sum, so that it never cuts a save whose write has landed.
            (StoreOp::Claim | StoreOp::Save, Some(_)) => timeout * 5,
            _ => timeout,
        }
    }

    async fn claim(
        &self,
        key: &StoreKey,
        held: &Held,
        lease: Duration,
    ) -> Result<Option<Bytes>, StoreError> {
        match &self.replicas {
            // Boxed, as is every path that waits for replicas: their state inline would grow
            // every claim's future (boxed and moved once a claim) by kilobytes.
            Some(replicas) => Box::pin(self.claim_acknowledged(replicas, key, held, lease)).await,
            None => {
                let previous = self
                    .shared("claim", |mut conn| async move {
                        Self::set_nx_get(&mut conn, key, held, lease).await
                    })
                    .await?;
                Ok(Self::found(previous, held))
            }
        }
    }

    async fn renew(
        &self,
        key: &StoreKey,
        held: &Held,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        if held.resolvable().is_some() {
            return Ok(self
                .renew_resolvable(key, held, lease, None)
                .await?
                .is_some());
        }
        let n: i64 = self
            .shared("renew", |mut conn| async move {
                self.renew
                    .key(key.text())
                    .arg(held.encoded.as_ref())
                    .arg(millis(lease))
                    .invoke_async(&mut conn)
                    .await
            })
            .await?;
        Ok(n == 1)
    }

    async fn save(
        &self,
        key: &StoreKey,
        held: &Held,
        done: Bytes,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        match &self.replicas {
            Some(replicas) => {
                Box::pin(self.save_acknowledged(replicas, key, held, &done, ttl)).await
            }
            None => {
                let done = &done;
                self.shared("complete", |conn| async move {
                    self.save_on(conn, key, held, done, ttl).await
                })
                .await
            }
        }
    }

    async fn release(&self, key: &StoreKey, held: &Held) -> Result<bool, StoreError> {
        self.release_on(key, held).await
    }

    async fn get(&self, key: &StoreKey) -> Result<Option<Bytes>, StoreError> {
        let value: Option<Vec<u8>> = self
            .shared("get", |mut conn| async move { conn.get(key.text()).await })
            .await?;
        Ok(value.map(Bytes::from))
    }

    async fn claim_resolvable(
        &self,
        key: &StoreKey,
        held: &Held,
        times: ResolvableTimes,
    ) -> Result<ResolvableFound, StoreError> {
        self.claim_resolvable_acknowledged(key, held, times).await
    }
    async fn resolving(
        &self,
        key: &StoreKey,
        held: &Held,
        next_lookup_in: Duration,
        lease: Duration,
    ) -> Result<Option<u64>, StoreError> {
        self.renew_resolvable(key, held, lease, Some(next_lookup_in))
            .await
    }

    async fn now(&self, key: &StoreKey) -> Result<u64, StoreError> {
        self.shared("now", |mut conn| async move {
            self.resolvable
                .now
                .key(key.text())
                .invoke_async(&mut conn)
                .await
        })
        .await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.shared("ping", |conn| async move { conn.ping().await })
            .await
    }

    async fn inspect(&self, key: &StoreKey) -> Result<Option<(Bytes, Duration)>, StoreError> {
        self.inspect_key(key).await
    }

    async fn forget(&self, key: &StoreKey) -> Result<Forgotten, StoreError> {
        self.forget_finished(key).await
    }
}
