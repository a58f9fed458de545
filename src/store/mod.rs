//! The record store: one trait, [`Store`], and four backends, each a module of its own:
//! - [`memory`]: embedded, one process, nothing survives a restart; bounded by `max_entries`.
//! - [`sqlite`]: a file, one process; a writer thread with group commit, reads on a pool.
//! - [`postgres`]: a database every instance shares; prepared statements on a pool a worker.
//! - [`redis`]: one server (with replicas, `wait_replicas`) or a cluster, every instance.
//!
//! Every operation the idempotency flow needs is one atomic step on one key:
//! - `claim`: take the key if it is free, else read what is there — one step, never
//!   check-then-act (Redis: `SET key value NX PX lease GET`, a single round trip on both the
//!   new-key and the replay path);
//! - `renew`, `complete`, `release`: only the holder of the claim's token may do them
//!   (compare-and-set on the whole in-progress value; Redis: Lua scripts);
//! - `get`, `wait_change`: for `on_conflict: wait`;
//! - `ping`: readiness; `inspect`, `forget`: the admin's key tooling.
//!
//! [`StoreHandle`] wraps a backend and puts every call under `store.timeout`: a hung Redis
//! (SIGSTOP, a blackholed network) must give a 503 in bounded time, never a hung request. It
//! decodes what the backends return; what they write was encoded by [`crate::record`].

pub mod memory;
pub mod postgres;
pub mod redis;
pub mod sqlite;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

pub use crate::key::StoreKey;
use crate::metrics::{Metrics, StoreOp};
pub use crate::record::Held;
use crate::record::{DecodeError, Encoded, Record};

/// Why a store operation failed. Every variant means "the store could not say": the proxy
/// answers 503 (or forwards, with `on_store_error: forward`), never guesses.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The operation did not finish within `store.timeout`. Its effect is unknown.
    #[error("store operation {op} timed out after {after:?}")]
    Timeout {
        op: &'static str,
        /// The deadline.
        after: Duration,
    },
    /// The backend answered with an error or could not be reached.
    #[error("store operation {op} failed: {source}")]
    Backend {
        op: &'static str,
        /// The backend's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A record could not be decoded (corrupt, or an unknown format version).
    #[error(transparent)]
    Corrupt(#[from] DecodeError),
    /// The memory store is at `max_entries`: new claims fail rather than evict a live record.
    #[error("the memory store is full ({0} records, store.max_entries)")]
    Full(u64),
    /// Redis took the write, but fewer than `store.wait_replicas` replicas acknowledged it
    /// within `store.timeout`: a failover could lose it. A claim in this state has been
    /// released again; the request is refused, never forwarded (the store works, so a
    /// duplicate that did get its claim acknowledged may be running the operation).
    #[error(
        "store operation {op}: {acked} of {wanted} replicas acknowledged the write in time (store.wait_replicas)"
    )]
    ReplicasMissing {
        op: &'static str,
        /// `store.wait_replicas`.
        wanted: u32,
        /// Replicas that acknowledged.
        acked: u32,
    },
}

/// What a claim found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The key was free and is now ours.
    Claimed,
    /// The key was taken; this is what it holds.
    Existing(Record),
}

/// A store backend. Implementations make each method one atomic step on one key.
///
/// The flow's steps: [`claim`](Store::claim), [`renew`](Store::renew),
/// [`complete`](Store::complete), [`release`](Store::release); for `on_conflict: wait`,
/// [`get`](Store::get) and [`wait_change`](Store::wait_change); [`ping`](Store::ping) for
/// readiness; [`inspect`](Store::inspect) and [`forget`](Store::forget) for the key tooling;
/// [`deadline`](Store::deadline), how long an operation may take in all; and
/// [`fill`](Store::fill), the records a self-bounded store holds.
///
/// Backends keep and return records as their encoded bytes: [`StoreHandle`] decodes them, so
/// an undecodable record is refused in one place, and the memory store keeps one compact
/// buffer per record; what they write was encoded once by [`crate::record`].
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// How long `op` may take in all, given `store.timeout`. One round trip for most; a backend
    /// whose operation takes several steps (Redis waiting for replicas) bounds each step by
    /// `timeout` itself and asks for a backstop longer than their sum.
    fn deadline(&self, _op: StoreOp, timeout: Duration) -> Duration {
        timeout
    }
    /// Claims `key` for `lease` if it is free (`None`); otherwise returns what it holds.
    async fn claim(
        &self,
        key: &StoreKey,
        held: &Held,
        lease: Duration,
    ) -> Result<Option<Bytes>, StoreError>;
    /// Extends the lease if `held` still holds the key. `false`: the lease was lost.
    async fn renew(&self, key: &StoreKey, held: &Held, lease: Duration)
    -> Result<bool, StoreError>;
    /// Replaces the claim by the finished record `done`, kept for `ttl`, if `held` still holds
    /// the key; `true` too if the key already holds exactly `done` (a completion retried after
    /// its answer was lost). `false`: the lease was lost and nothing was written.
    async fn complete(
        &self,
        key: &StoreKey,
        held: &Held,
        done: Bytes,
        ttl: Duration,
    ) -> Result<bool, StoreError>;
    /// Deletes the claim if `held` still holds the key. `true` once the key is free of it:
    /// deleted now, or gone already (a release sent again after its answer was lost finds the
    /// key gone; so does one whose lease lapsed with nobody taking the key). `false` only when
    /// the key holds something else — another request's claim or a finished record — which
    /// is left alone: the lease was lost.
    async fn release(&self, key: &StoreKey, held: &Held) -> Result<bool, StoreError>;
    /// Reads the key.
    async fn get(&self, key: &StoreKey) -> Result<Option<Bytes>, StoreError>;
    /// Returns when the key may have changed, or after `max` at the latest. The caller reads
    /// the key again either way, and chooses `max` as its polling interval. The default just
    /// sleeps: a shared store cannot know when another instance finishes.
    async fn wait_change(&self, _key: &StoreKey, max: Duration) {
        tokio::time::sleep(max).await;
    }
    /// Checks that the store answers.
    async fn ping(&self) -> Result<(), StoreError>;
    /// Reads the key and its remaining time to live (key tooling).
    async fn inspect(&self, key: &StoreKey) -> Result<Option<(Bytes, Duration)>, StoreError>;
    /// Deletes the key if, and only if, it holds a finished record (key tooling). An in-flight
    /// claim is never forgotten: its holder may be alive, and a dead holder's lease expires
    /// within `lock_ttl` by itself.
    async fn forget(&self, key: &StoreKey) -> Result<Forgotten, StoreError>;
    /// Records held and the bound, for a store that keeps them itself (the memory store).
    fn fill(&self) -> Option<(u64, u64)> {
        None
    }
}

/// What [`Store::forget`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forgotten {
    /// The finished record was deleted: the next request with the key runs again.
    Forgotten,
    /// Nothing was under the key.
    Absent,
    /// A claim in flight: left alone.
    InFlight,
    /// Something that is not a finished record of this proxy (corrupt, another version): left
    /// alone.
    NotARecord,
}

impl Forgotten {
    /// Classifies encoded bytes: a finished record may be forgotten, nothing else.
    pub(crate) fn of(bytes: &[u8]) -> Forgotten {
        if crate::record::is_finished(bytes) {
            Forgotten::Forgotten
        } else if crate::record::is_in_flight(bytes) {
            Forgotten::InFlight
        } else {
            Forgotten::NotARecord
        }
    }
}

/// A backend behind a deadline, with every call timed and counted.
#[derive(Clone)]
pub struct StoreHandle {
    inner: Arc<dyn Store>,
    timeout: Duration,
    metrics: Arc<Metrics>,
}

impl StoreHandle {
    /// Wraps a backend.
    pub fn new(inner: Arc<dyn Store>, timeout: Duration, metrics: Arc<Metrics>) -> StoreHandle {
        StoreHandle {
            inner,
            timeout,
            metrics,
        }
    }

    async fn timed<T>(
        &self,
        op: StoreOp,
        fut: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let start = tokio::time::Instant::now();
        let deadline = self.inner.deadline(op, self.timeout);
        let result = match tokio::time::timeout(deadline, fut).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Timeout {
                op: op.as_str(),
                after: deadline,
            }),
        };
        self.metrics.store_op(op, start.elapsed(), result.is_err());
        result
    }

    /// See [`Store::claim`]; decodes what the key holds.
    pub async fn claim(
        &self,
        key: &StoreKey,
        held: &Held,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        let found = self
            .timed(StoreOp::Claim, self.inner.claim(key, held, lease))
            .await?;
        match found {
            None => Ok(Claim::Claimed),
            Some(bytes) => Ok(Claim::Existing(Record::decode_shared(&bytes)?)),
        }
    }

    /// See [`Store::renew`].
    pub async fn renew(
        &self,
        key: &StoreKey,
        held: &Held,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.timed(StoreOp::Renew, self.inner.renew(key, held, lease))
            .await
    }

    /// See [`Store::complete`]; `done` was encoded once, by [`crate::record`] (a
    /// [`Finished`](crate::record::Finished) record), so a retried completion writes the very
    /// same bytes. Records cross here in one direction: the store decodes what it reads, and
    /// never encodes a finished record itself.
    pub async fn complete(
        &self,
        key: &StoreKey,
        held: &Held,
        done: &impl Encoded,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let done = done.encoded().clone();
        self.timed(StoreOp::Complete, self.inner.complete(key, held, done, ttl))
            .await
    }

    /// See [`Store::release`].
    pub async fn release(&self, key: &StoreKey, held: &Held) -> Result<bool, StoreError> {
        self.timed(StoreOp::Release, self.inner.release(key, held))
            .await
    }

    /// See [`Store::get`]; decodes the record.
    pub async fn get(&self, key: &StoreKey) -> Result<Option<Record>, StoreError> {
        let found = self.timed(StoreOp::Get, self.inner.get(key)).await?;
        match found {
            None => Ok(None),
            Some(bytes) => Ok(Some(Record::decode_shared(&bytes)?)),
        }
    }

    /// See [`Store::wait_change`].
    pub(crate) async fn wait_change(&self, key: &StoreKey, max: Duration) {
        self.inner.wait_change(key, max).await;
    }

    /// See [`Store::ping`].
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.timed(StoreOp::Ping, self.inner.ping()).await
    }

    /// See [`Store::inspect`]; decodes the record.
    pub(crate) async fn inspect(
        &self,
        key: &StoreKey,
    ) -> Result<Option<(Record, Duration)>, StoreError> {
        let found = self.timed(StoreOp::Get, self.inner.inspect(key)).await?;
        match found {
            None => Ok(None),
            Some((bytes, ttl)) => Ok(Some((Record::decode_shared(&bytes)?, ttl))),
        }
    }

    /// See [`Store::fill`].
    pub(crate) fn fill(&self) -> Option<(u64, u64)> {
        self.inner.fill()
    }

    /// See [`Store::forget`].
    pub(crate) async fn forget(&self, key: &StoreKey) -> Result<Forgotten, StoreError> {
        self.timed(StoreOp::Forget, self.inner.forget(key)).await
    }
}
