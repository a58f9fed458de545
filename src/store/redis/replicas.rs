//! `store.wait_replicas`: a write counts only once enough replicas have it (`WAIT`).
//!
//! Redis replicates asynchronously: a primary that fails over right after acknowledging a
//! claim can lose it, and the promoted replica would let a retry run the operation a second
//! time. `WAIT numreplicas timeout` closes most of that window: it blocks until that many
//! replicas have acknowledged every write *made on the connection it runs on*, or until the
//! timeout, and says how many did.
//!
//! Two consequences shape this module:
//! - `WAIT` must run on the very connection that made the write. The store's shared
//!   multiplexed connection carries every other request's commands too, so a `WAIT` there
//!   would wait for their writes as well.
//! - `WAIT` blocks its connection until it returns: on the shared connection, every other
//!   request's claim, replay and renewal would queue behind it for up to `store.timeout`.
//!
//! So a write that must be acknowledged runs, with its `WAIT`, on a *dedicated* connection
//! checked out of a small pool: created on demand, at most [`MAX_DEDICATED`] at once, put back
//! after a clean use and closed after any error or abandoned `WAIT` (Redis may still hold it
//! blocked, and the next user's commands would queue behind that).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, RedisResult};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{backend, bounded, millis, resend};
use crate::metrics::{OpLabel, StoreOp, StoreSeries, encode_one};
use crate::store::StoreError;

/// Dedicated connections open at most. Each is busy for one write and its `WAIT` (a round trip
/// or two while replicas keep up, `store.timeout` at worst); past the bound, claims wait for
/// one to come back, within their deadline.
pub(crate) const MAX_DEDICATED: usize = 32;

/// The replica acknowledgement policy of one Redis store.
pub(crate) struct Replicas {
    /// `store.wait_replicas`.
    wanted: u32,
    /// `store.timeout`: how long `WAIT` waits, and each step's deadline.
    timeout: Duration,
    client: redis::Client,
    idle: Mutex<Vec<MultiplexedConnection>>,
    slots: Arc<Semaphore>,
    series: RedisSeries,
}

/// The Redis store's series: the writes (claim, save) fewer replicas acknowledged than
/// `store.wait_replicas` asks. Exported by a store on one Redis or on a cluster (where it stays
/// at 0: a cluster waits for no replica).
#[derive(Clone, Debug)]
pub struct RedisSeries {
    acks_missing: Family<OpLabel, Counter>,
}

impl StoreSeries for RedisSeries {
    fn register(registry: &mut Registry) -> Self {
        let acks_missing = Family::<OpLabel, Counter>::default();
        for op in [StoreOp::Claim, StoreOp::Save] {
            let _ = acks_missing.get_or_create(&OpLabel { op: op.as_str() });
        }
        let series = RedisSeries { acks_missing };
        registry.register_collector(Box::new(series.clone()));
        series
    }
}

impl Collector for RedisSeries {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        encode_one(
            &mut encoder,
            "idemproxy_replica_acks_missing",
            "Claims and saves fewer replicas acknowledged in time than store.wait_replicas asks (a claim is then refused with 503; a save stands)",
            &self.acks_missing,
        )
    }
}

/// A connection used by one write and its `WAIT`, and by nothing else meanwhile.
pub(crate) struct Dedicated<'a> {
    conn: MultiplexedConnection,
    owner: &'a Replicas,
    _slot: OwnedSemaphorePermit,
}

impl Dedicated<'_> {
    pub(crate) fn conn(&mut self) -> &mut MultiplexedConnection {
        &mut self.conn
    }

    /// Returns the connection to the pool: only after a clean use, when no command of ours is
    /// still pending on it. Dropping a `Dedicated` instead closes the connection.
    pub(crate) fn give_back(self) {
        let mut idle = self
            .owner
            .idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        idle.push(self.conn);
    }
}

/// How many replicas acknowledged a write in time, when fewer than wanted.
#[derive(Debug)]
pub(crate) struct Short {
    /// Replicas that acknowledged (0 when `WAIT` itself failed).
    pub acked: u32,
    /// Why, in words, for the log.
    pub why: String,
}

impl Replicas {
    /// Waits for `wanted` replicas on connections made by `client`, each `WAIT` bounded by
    /// `timeout`; short acknowledgements are counted in `metrics`.
    pub(crate) fn new(
        client: redis::Client,
        wanted: u32,
        timeout: Duration,
        series: RedisSeries,
    ) -> Replicas {
        Replicas {
            wanted,
            timeout,
            client,
            idle: Mutex::new(Vec::new()),
            slots: Arc::new(Semaphore::new(MAX_DEDICATED)),
            series,
        }
    }

    /// `store.wait_replicas`.
    pub(crate) fn wanted(&self) -> u32 {
        self.wanted
    }

    /// Runs the write `attempt` on a dedicated connection, and gives back the connection with
    /// the write's answer, for the `WAIT` that must follow on that very connection.
    ///
    /// A pooled connection may have outlived its server (Redis restarted, or closed it for
    /// idling). When the write finds its connection dropped, the pool's other idle
    /// connections go too (they date from the same server), and the write runs once more on a
    /// new connection ([`resend`] says why that is safe). The checkout is bounded by
    /// `timeout`, and so are the write and its second try together.
    pub(crate) async fn write<T, Fut>(
        &self,
        op: &'static str,
        mut attempt: impl FnMut(MultiplexedConnection) -> Fut,
    ) -> Result<(Dedicated<'_>, T), StoreError>
    where
        Fut: Future<Output = RedisResult<T>>,
    {
        let dedicated = self.checkout(op, true).await?;
        bounded(op, self.timeout, async move {
            match attempt(dedicated.conn.clone()).await {
                Ok(answer) => Ok((dedicated, answer)),
                Err(e) if resend::dropped(&e) => {
                    tracing::debug!(op, error = %e, "a pooled Redis connection had dropped; writing again on a new one");
                    drop(dedicated);
                    self.idle
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .clear();
                    let fresh = self.checkout(op, false).await?;
                    let answer = attempt(fresh.conn.clone()).await.map_err(backend(op))?;
                    Ok((fresh, answer))
                }
                Err(e) => Err(backend(op)(e)),
            }
        })
        .await
    }

    /// A dedicated connection: an idle one if `pooled` and there is one, else a new one,
    /// while fewer than [`MAX_DEDICATED`] are open. Bounded by `timeout` (waiting for a free
    /// slot included).
    async fn checkout(&self, op: &'static str, pooled: bool) -> Result<Dedicated<'_>, StoreError> {
        bounded(op, self.timeout, async {
            let slot =
                self.slots
                    .clone()
                    .acquire_owned()
                    .await
                    .map_err(|e| StoreError::Backend {
                        op,
                        source: Box::new(e),
                    })?;
            let idle = if pooled {
                self.idle
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .pop()
            } else {
                None
            };
            let conn = match idle {
                Some(conn) => conn,
                None => {
                    // No response timeout of the crate's own (its default is 500ms): `WAIT`
                    // legitimately takes up to `store.timeout`, and every step here is bounded
                    // by the store.
                    let config = AsyncConnectionConfig::new()
                        .set_connection_timeout(Some(self.timeout))
                        .set_response_timeout(None);
                    self.client
                        .get_multiplexed_async_connection_with_config(&config)
                        .await
                        .map_err(backend(op))?
                }
            };
            Ok(Dedicated {
                conn,
                owner: self,
                _slot: slot,
            })
        })
        .await
    }

    /// `WAIT wanted timeout` on the connection that made the write: `Ok` when enough replicas
    /// acknowledged it, and the connection goes back to the pool; otherwise the shortfall, and
    /// the connection is closed unless `WAIT` answered.
    pub(crate) async fn acknowledged(
        &self,
        mut dedicated: Dedicated<'_>,
        op: StoreOp,
    ) -> Result<(), Short> {
        // Redis answers at its own timeout; the grace covers the round trip. A Redis that has
        // not answered by then is hung, and the connection is dropped with the future.
        let grace = self.timeout;
        let wait = tokio::time::timeout(
            self.timeout + grace,
            redis::cmd("WAIT")
                .arg(self.wanted)
                .arg(millis(self.timeout))
                .query_async::<i64>(dedicated.conn()),
        )
        .await;
        let acked = match wait {
            Ok(Ok(n)) => {
                dedicated.give_back();
                u32::try_from(n).unwrap_or(0)
            }
            Ok(Err(e)) => return Err(self.short(op, 0, format!("WAIT failed: {e}"))),
            Err(_) => {
                return Err(self.short(
                    op,
                    0,
                    format!("WAIT did not answer within {:?}", self.timeout + grace),
                ));
            }
        };
        if acked >= self.wanted {
            Ok(())
        } else {
            Err(self.short(
                op,
                acked,
                format!(
                    "{acked} of {} replicas acknowledged within {:?}",
                    self.wanted, self.timeout
                ),
            ))
        }
    }

    fn short(&self, op: StoreOp, acked: u32, why: String) -> Short {
        self.series
            .acks_missing
            .get_or_create(&OpLabel { op: op.as_str() })
            .inc();
        Short { acked, why }
    }
}
