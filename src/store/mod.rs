//! The record store: one trait, [`Store`], and four backends, each a module of its own:
//! - [`memory`]: embedded, one process, nothing survives a restart; bounded by `max_entries`.
//! - [`sqlite`]: a file, one process; a writer thread with group commit, reads on a pool.
//! - [`postgres`]: a database every instance shares; prepared statements on a pool a worker.
//! - [`redis`]: one server (with replicas, `wait_replicas`) or a cluster, every instance.
//!
//! Every backend's folder has the same files for the same parts, so a reader who knows one
//! knows where everything is in the others: `mod.rs` the adapter (the type, its opening, the
//! [`Store`] impl, each method a call into the file of its part), `claim.rs` the plain
//! claim's steps (claim, save, release), `resolvable.rs` the claim that can be resolved,
//! `tooling.rs` what the key tooling asks, `sweep.rs` reclaiming expired records (not on
//! Redis: its keys expire by themselves); beside them the backend's own connection and
//! statement code. The record's bytes are `crate::record::layout`'s; [`wrap`] puts a test's
//! fault in front of a store, one method at a time.
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
//! On a route with `on_unknown_outcome: resolve` the claim is a [`crate::record::Resolvable`] record (format
//! version 2), and its lifetime is not its lease:
//! - `claim_resolvable` takes a free key, *or takes over* a resolvable claim whose lease has
//!   lapsed (one atomic step: Redis a script, SQL one statement under the row's lock), so two
//!   instances never resolve one key at once. The store stamps the times on its own clock.
//!   The key then lives until `give_up_after` + `ttl` after the request could have been sent,
//!   whatever happens to the lease; sweeps and expiry never end it earlier.
//! - `renew` extends only the lease inside the value (never shortening the key's lifetime);
//!   `resolving` also records that the holder resolves, and when it asks next; `complete` is
//!   fenced on the token and on the lease being live, `release` on the token alone. All four know a resolvable
//!   claim by `held.record` and compare its token, not its whole value (the store rewrites its
//!   times).
//! - `now`: the store's clock, which every time in a resolvable record is on.
//!
//! [`StoreHandle`] wraps a backend and puts every call under `store.timeout`: a hung Redis
//! (SIGSTOP, a blackholed network) must give a 503 in bounded time, never a hung request. It
//! decodes what the backends return; what they write was encoded by [`crate::record`].
//!
//! [`recent`] is the hint the durable stores share: keys lately finished or repeated, whose next
//! claim is worth a plain read first.
//!
//! Each backend defines its own metric series and registers them when it is opened (see
//! [`crate::metrics::StoreSeries`]); [`SweptSeries`] is the one the two that sweep share.

// The host's clocks are not the store's (clippy.toml says which and why).
#![deny(clippy::disallowed_methods)]

mod handle;
pub mod memory;
pub mod postgres;
pub(crate) mod recent;
pub mod redis;
pub mod sqlite;
pub mod wrap;

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;

pub use crate::key::StoreKey;
use crate::metrics::{StoreOp, StoreSeries, encode_one};
pub use crate::record::Held;
use crate::record::{DecodeError, Record};
pub use handle::StoreHandle;
pub use wrap::Wrap;

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

/// How a claim that can be resolved is timed, from the route as it is when the key is claimed.
/// The store stamps the record with them, on its own clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResolvableTimes {
    /// The lease (`lock_ttl`): a claim after it has lapsed takes the record over.
    pub lease: Duration,
    /// How long after the claim a byte of the request can have been written at the latest:
    /// the upstream's `timeout` (counted from an instant taken before the claim was sent, no
    /// byte is written after it). `sent_at` = claim + this.
    pub send_margin: Duration,
    /// How long the key lives after `sent_at`: `give_up_after` + `ttl`.
    pub lifetime: Duration,
}

/// What a backend's [`Store::claim_resolvable`] did, with the value the key holds now and the
/// store's clock when it did it (milliseconds, the clock of the record's times).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResolvableFound {
    /// The key was free (or its record had lived its lifetime): it holds our claim, stamped.
    Claimed { value: Bytes, now: u64 },
    /// The key held a resolvable claim whose lease had lapsed: it is ours now, resolving.
    TakenOver { value: Bytes, now: u64 },
    /// The key holds something live: left alone.
    Existing { value: Bytes },
}

/// What [`StoreHandle::claim_resolvable`] found.
#[derive(Debug, Clone)]
pub enum ResolvableClaim {
    /// The key was free and is ours: send the request. `held` is the claim as the store
    /// stamped it (its `sent_at` is when `settle_after` counts from); `now` the store's clock
    /// when it claimed.
    Claimed { held: Held, now: u64 },
    /// Another holder's lease had lapsed: the claim is ours, its phase `Resolving` and its next
    /// lookup due at once. Resolve it — never forward it. `gave_up`: it is past
    /// `give_up_after` already, so save `outcome-unknown` at once instead of asking.
    TakenOver { held: Held, now: u64, gave_up: bool },
    /// The key holds something else, live (a live claim of either kind, a finished record).
    Existing(Record),
}

/// A store backend. Implementations make each method one atomic step on one key.
///
/// The flow's steps: [`claim`](Store::claim), [`renew`](Store::renew),
/// [`complete`](Store::save), [`release`](Store::release); for `on_conflict: wait`,
/// [`get`](Store::get) and [`wait_change`](Store::wait_change); [`ping`](Store::ping) for
/// readiness; [`inspect`](Store::inspect) and [`forget`](Store::forget) for the key tooling;
/// and [`deadline`](Store::deadline), how long an operation may take in all.
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
    /// the key; `true` too if the key already holds exactly `done` (a save retried after
    /// its answer was lost). `false`: the lease was lost and nothing was written.
    async fn save(
        &self,
        key: &StoreKey,
        held: &Held,
        done: Bytes,
        ttl: Duration,
    ) -> Result<bool, StoreError>;
    /// Deletes the claim if `held` still holds the key. A resolvable claim is released by its
    /// token alone, its lease lapsed or not: a takeover replaces the token in the same step
    /// that takes the claim over, so a token still in place means nobody else holds it, and
    /// a release says the request was never sent (a claim answered too late, a refusal before
    /// any byte) or that its lookup found it absent for good — a takeover would then only
    /// resolve it again. `true` once the key is free of it:
    /// deleted now, or gone already (a release sent again after its answer was lost finds the
    /// key gone; so does one whose lease lapsed with nobody taking the key). `false` only when
    /// the key holds something else — another request's claim or a finished record — which
    /// is left alone: the lease was lost.
    async fn release(&self, key: &StoreKey, held: &Held) -> Result<bool, StoreError>;
    /// Reads the key.
    async fn get(&self, key: &StoreKey) -> Result<Option<Bytes>, StoreError>;
    /// Claims `key` with the resolvable claim `held` if it is free, stamping its times on the
    /// store's clock (see [`crate::record::layout::stamp_claim`]); or takes over the
    /// resolvable claim it holds if that one's lease has lapsed (token and lease replaced,
    /// phase resolving, next lookup now, everything else and the key's lifetime kept,
    /// [`crate::record::layout::stamp_takeover`]); or returns what it holds. One atomic
    /// step.
    async fn claim_resolvable(
        &self,
        key: &StoreKey,
        held: &Held,
        times: ResolvableTimes,
    ) -> Result<ResolvableFound, StoreError>;
    /// The holder of the resolvable claim `held` (its token, its lease live) marks it
    /// resolving, with its next lookup `next_lookup_in` from now, and extends its lease to
    /// `lease` from now (never shortening the key's lifetime). `Some(now)` on the store's
    /// clock; `None`: the lease was lost, nothing was written.
    async fn resolving(
        &self,
        key: &StoreKey,
        held: &Held,
        next_lookup_in: Duration,
        lease: Duration,
    ) -> Result<Option<u64>, StoreError>;
    /// The store's clock where `key` lives, in milliseconds: the clock of every time in its
    /// resolvable record (on a Redis Cluster, the clock of the node serving its slot).
    async fn now(&self, key: &StoreKey) -> Result<u64, StoreError>;
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

/// Expired records deleted by the background sweep: the series of the stores that sweep
/// (SQLite, PostgreSQL).
#[derive(Clone, Debug, Default)]
pub struct SweptSeries(Counter);

impl SweptSeries {
    /// Counts `n` expired records deleted.
    pub(crate) fn swept(&self, n: u64) {
        self.0.inc_by(n);
    }
}

impl StoreSeries for SweptSeries {
    fn register(registry: &mut Registry) -> Self {
        let series = SweptSeries::default();
        registry.register_collector(Box::new(series.clone()));
        series
    }
}

impl Collector for SweptSeries {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        encode_one(
            &mut encoder,
            "idemproxy_store_swept",
            "Expired records deleted by the background sweep (sqlite, postgres)",
            &self.0,
        )
    }
}
