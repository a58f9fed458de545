//! The embedded store: one process, no Redis, the same semantics.
//!
//! The records live in [`SHARDS`] hash maps, each under its own `std::sync::Mutex`. Every
//! operation is one short critical section on one shard with no `.await` inside, so a std mutex
//! is right here (as in mini-redis's `db.rs`): it is cheaper than an async one, and holding it
//! across an await is impossible by construction. Because the whole check-and-set happens under
//! the shard's lock, a claim is as atomic as Redis's `SET NX`.
//!
//! Why it is shaped like this (a million records must fit in a few hundred MiB, and a claim must
//! never stall behind a growing map):
//! - A map key is the route's number and the key's 32-byte hash: fixed size, inline, no second
//!   copy of any text. The hash is already uniform, so the map hashes it by taking eight of its
//!   bytes instead of running SipHash.
//! - A record is its encoded bytes in one exact-size allocation (`Arc<[u8]>`), copied out of
//!   whatever buffers the response was read into: a saved header value that was a slice of an
//!   8 KiB read buffer would otherwise keep that whole buffer alive. Replays share the bytes.
//! - Sharding keeps each map small, so a map that grows rehashes a sixty-fourth of the records
//!   while holding one lock, and the other shards go on serving.
//!
//! Expiry: each record has a deadline (milliseconds since the store started). An expired record
//! is treated as absent at once, and its memory is reclaimed by a sweeper that visits every
//! shard once a second, and by a full purge when the store is at its bound. The `max_entries`
//! bound is enforced on claims only, after expired records are gone: a full store refuses new
//! claims (a store error, so 503 or forward) and never evicts a live record — an evicted record
//! is a forgotten operation.
//!
//! A full purge locks and scans every shard, O(`max_entries`): run for every refused claim, a
//! flood of new keys against a full store would cost that much CPU per request, for requests
//! refused anyway. So a claim at the bound purges only when a record may have lapsed since the
//! last purge (the store tracks the earliest deadline it has written since then), and at most
//! once per [`PURGE_AT_BOUND_EVERY`](sweep::PURGE_AT_BOUND_EVERY); otherwise it is refused at once. A claim is refused while
//! a lapsed record could have made room for that long at most.
//!
//! A claim that can be resolved (`on_unknown_outcome: resolve`) keeps its lease inside its
//! value, on this store's clock (milliseconds since the store started); the slot's deadline is
//! then the record's lifetime, which renewals never shorten. Renew, complete and release know it
//! by the held record and compare its token and lease instead of its whole value, since the
//! store rewrites its times in place (a copy: records are immutable once shared).
//!
//! Waiters (`on_conflict: wait`) are woken in-process by a per-key [`Notify`], made only for keys
//! that someone waits on, when the claim is completed, released or expires.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::Notify;
use tokio::time::Instant;

pub use self::gauges::MemorySeries;
use super::{Forgotten, Held, ResolvableFound, ResolvableTimes, Store, StoreError, StoreKey};
use crate::key::KeyId;
use crate::metrics::Metrics;
use crate::record::{self, resolvable as record_resolvable};

/// How many independently locked maps the records are spread over.
const SHARDS: usize = 64;

/// A record's place: the route's number and the key's hash.
#[derive(Clone, Copy, PartialEq, Eq)]
struct MapKey {
    route: u32,
    id: KeyId,
}

impl MapKey {
    fn of(key: &StoreKey) -> MapKey {
        MapKey {
            route: key.route(),
            id: *key.id(),
        }
    }

    fn shard(&self) -> usize {
        usize::from(self.id[0]) % SHARDS
    }
}

impl Hash for MapKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // The id is a SHA-256 output: any eight of its bytes are already a uniform hash. Bytes
        // 8..16 are independent of byte 0, which picks the shard.
        let mut eight = [0u8; 8];
        eight.copy_from_slice(&self.id[8..16]);
        let route = u64::from(self.route).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        state.write_u64(u64::from_le_bytes(eight) ^ route);
    }
}

/// Passes on the one `u64` that [`MapKey`]'s `Hash` writes.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Not used by `MapKey`; fold anything else in rather than drop it.
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type IdMap<V> = HashMap<MapKey, V, BuildHasherDefault<IdHasher>>;

struct Slot {
    /// Milliseconds since the store started; the record is live while `now < expires`.
    expires: u64,
    /// The encoded record.
    record: Arc<[u8]>,
}

#[derive(Default)]
struct Shard {
    map: IdMap<Slot>,
    /// Keys that `on_conflict: wait` requests are waiting on.
    waiters: IdMap<Arc<Notify>>,
}

impl Shard {
    /// The live slot under `key`, if any (an expired one is treated as absent).
    fn live(&self, key: &MapKey, now: u64) -> Option<&Slot> {
        self.map.get(key).filter(|s| s.expires > now)
    }

    /// Whether `held` is what the key holds now (the compare of compare-and-set).
    fn holds(&mut self, key: &MapKey, held: &Held, now: u64) -> Option<&mut Slot> {
        self.map
            .get_mut(key)
            .filter(|s| s.expires > now && *s.record == *held.encoded)
    }

    fn wake(&mut self, key: &MapKey) {
        if let Some(n) = self.waiters.remove(key) {
            n.notify_waiters();
        }
    }
}

struct Inner {
    shards: Box<[Mutex<Shard>]>,
    /// Time zero of every deadline.
    epoch: Instant,
    /// Records held, expired ones not yet swept included.
    held: AtomicU64,
    max_entries: u64,
    /// No record written since the last full purge lapses before this (milliseconds since
    /// `epoch`; a lower bound, so it errs towards purging): until then a purge would find
    /// nothing to reclaim.
    next_lapse: AtomicU64,
    /// When a claim at the bound may next run a full purge.
    purge_due: AtomicU64,
    /// Full purges run by claims at the bound (not by the sweeper): each one locks and scans
    /// every shard, so the unit tests bound how often it happens.
    full_purges: AtomicU64,
}

impl Inner {
    fn shard(&self, key: &MapKey) -> MutexGuard<'_, Shard> {
        lock(&self.shards[key.shard()])
    }

    fn now(&self) -> u64 {
        millis(self.epoch.elapsed())
    }

    /// Takes one place under the bound, if there is one left.
    fn reserve(&self) -> bool {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max_entries).then_some(n + 1)
            })
            .is_ok()
    }

    fn forget(&self, n: u64) {
        self.held.fetch_sub(n, Ordering::AcqRel);
    }

    /// Notes a deadline just written to a slot. Called after the write, so a purge that scans
    /// the shard before the write sees this call's effect, and one that scans after sees the
    /// record: either way `next_lapse` stays a lower bound. The load first keeps the shared
    /// value's cache line unwritten for the common deadline, a later one.
    fn lapses_at(&self, expires: u64) {
        if expires < self.next_lapse.load(Ordering::Acquire) {
            self.next_lapse.fetch_min(expires, Ordering::AcqRel);
        }
    }
}

/// Zero-copy bytes of a record: replays share the stored buffer.
fn shared(record: &Arc<[u8]>) -> Bytes {
    Bytes::from_owner(ArcBytes(record.clone()))
}

struct ArcBytes(Arc<[u8]>);

impl AsRef<[u8]> for ArcBytes {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

/// Milliseconds, saturating (a duration too long for a `u64` of milliseconds is "forever").
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The embedded in-memory store.
pub struct MemoryStore {
    inner: Arc<Inner>,
}

impl MemoryStore {
    /// A store that keeps at most `max_entries` live records. Starts the sweeper on the
    /// current Tokio runtime; it stops when the store is dropped.
    pub fn new(max_entries: u64) -> MemoryStore {
        let inner = Arc::new(Inner {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            epoch: Instant::now(),
            held: AtomicU64::new(0),
            max_entries,
            next_lapse: AtomicU64::new(u64::MAX),
            purge_due: AtomicU64::new(0),
            full_purges: AtomicU64::new(0),
        });
        sweep::spawn(Arc::downgrade(&inner));
        MemoryStore { inner }
    }

    /// [`MemoryStore::new`], its records and bound exported by `metrics` (the proxy's store).
    pub fn open(max_entries: u64, metrics: &Metrics) -> MemoryStore {
        let store = MemoryStore::new(max_entries);
        metrics.store_series::<MemorySeries>().watch(&store.inner);
        store
    }

    /// How many records are held now, expired ones not yet swept included.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        usize::try_from(self.inner.held.load(Ordering::Acquire)).unwrap_or(usize::MAX)
    }

    /// Whether no record is held.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Locks a shard. A panic while holding the lock cannot leave a half-written record (every
/// critical section writes at most one map slot), so a poisoned lock is still safe to use.
fn lock(m: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[async_trait]
impl Store for MemoryStore {
    async fn claim(
        &self,
        key: &StoreKey,
        held: &Held,
        lease: Duration,
    ) -> Result<Option<Bytes>, StoreError> {
        let key = MapKey::of(key);
        if let Ok(found) = self.inner.try_claim(&key, held, lease) {
            return Ok(found);
        }
        // At the bound: reclaim expired records if that can make room now, then try once more.
        let full = StoreError::Full(self.inner.max_entries);
        if !self.inner.purge_at_bound() {
            return Err(full);
        }
        self.inner.try_claim(&key, held, lease).map_err(|()| full)
    }

    async fn renew(
        &self,
        key: &StoreKey,
        held: &Held,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let key = MapKey::of(key);
        if held.resolvable().is_some() {
            return Ok(self
                .inner
                .renew_resolvable(&key, held, lease, None)
                .is_some());
        }
        let mut shard = self.inner.shard(&key);
        let now = self.inner.now();
        match shard.holds(&key, held, now) {
            Some(slot) => {
                slot.expires = now.saturating_add(millis(lease));
                self.inner.lapses_at(slot.expires);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    async fn save(
        &self,
        key: &StoreKey,
        held: &Held,
        done: Bytes,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let key = MapKey::of(key);
        let mut shard = self.inner.shard(&key);
        let now = self.inner.now();
        let holds = if held.resolvable().is_some() {
            shard.holds_resolvable(&key, held, now)
        } else {
            shard.holds(&key, held, now)
        };
        let Some(slot) = holds else {
            // A save sent again after it landed counts as done, as on Redis.
            let landed = shard
                .map
                .get(&key)
                .is_some_and(|s| s.expires > now && *s.record == done[..]);
            return Ok(landed);
        };
        slot.expires = now.saturating_add(millis(ttl));
        slot.record = Arc::from(&done[..]);
        self.inner.lapses_at(slot.expires);
        shard.wake(&key);
        Ok(true)
    }

    async fn release(&self, key: &StoreKey, held: &Held) -> Result<bool, StoreError> {
        let key = MapKey::of(key);
        let mut shard = self.inner.shard(&key);
        let now = self.inner.now();
        let resolvable = held.resolvable().is_some();
        match shard.live(&key, now) {
            // Gone already (as on Redis, where a release may be sent twice): the key is free.
            None => return Ok(true),
            // A resolvable claim is released by its token alone (see `Store::release`).
            Some(slot) if resolvable => {
                let token = held.record.token().map(|t| &t[..]);
                if record::resolvable::token(&slot.record) != token {
                    return Ok(false);
                }
            }
            Some(slot) if *slot.record != *held.encoded => return Ok(false),
            Some(_) => {}
        }
        shard.map.remove(&key);
        shard.wake(&key);
        drop(shard);
        self.inner.forget(1);
        Ok(true)
    }

    async fn get(&self, key: &StoreKey) -> Result<Option<Bytes>, StoreError> {
        let key = MapKey::of(key);
        let shard = self.inner.shard(&key);
        Ok(shard
            .live(&key, self.inner.now())
            .map(|s| shared(&s.record)))
    }

    async fn claim_resolvable(
        &self,
        key: &StoreKey,
        held: &Held,
        times: ResolvableTimes,
    ) -> Result<ResolvableFound, StoreError> {
        let key = MapKey::of(key);
        if let Ok(found) = self.inner.try_claim_resolvable(&key, held, times) {
            return Ok(found);
        }
        let full = StoreError::Full(self.inner.max_entries);
        if !self.inner.purge_at_bound() {
            return Err(full);
        }
        self.inner
            .try_claim_resolvable(&key, held, times)
            .map_err(|()| full)
    }

    async fn resolving(
        &self,
        key: &StoreKey,
        held: &Held,
        next_lookup_in: Duration,
        lease: Duration,
    ) -> Result<Option<u64>, StoreError> {
        let key = MapKey::of(key);
        Ok(self
            .inner
            .renew_resolvable(&key, held, lease, Some(next_lookup_in)))
    }

    async fn now(&self, _key: &StoreKey) -> Result<u64, StoreError> {
        Ok(self.inner.now())
    }

    async fn wait_change(&self, key: &StoreKey, max: Duration) {
        let key = MapKey::of(key);
        let (notify, expires) = {
            let mut shard = self.inner.shard(&key);
            let now = self.inner.now();
            let Some(expires) = shard
                .live(&key, now)
                .filter(|s| record::is_in_flight(&s.record))
                // A resolvable claim's lease is inside it; its slot lives longer.
                .map(|s| record_resolvable::lease_until(&s.record).unwrap_or(s.expires))
            else {
                return;
            };
            (shard.waiters.entry(key).or_default().clone(), expires)
        };
        let notified = notify.notified();
        tokio::pin!(notified);
        // Register before re-checking, so a wake between the check and the await is not lost.
        notified.as_mut().enable();
        let still_in_flight = {
            let shard = self.inner.shard(&key);
            shard
                .live(&key, self.inner.now())
                .is_some_and(|s| record::is_in_flight(&s.record))
        };
        if !still_in_flight {
            return;
        }
        // Also wake when the lease would expire (a dead holder never notifies).
        let lease_end =
            self.inner.epoch + Duration::from_millis(expires) + Duration::from_millis(1);
        let deadline = (Instant::now() + max).min(lease_end);
        let _ = tokio::time::timeout_at(deadline, notified).await;
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }

    async fn inspect(&self, key: &StoreKey) -> Result<Option<(Bytes, Duration)>, StoreError> {
        Ok(self.inner.inspect(key))
    }

    async fn forget(&self, key: &StoreKey) -> Result<Forgotten, StoreError> {
        Ok(self.inner.forget_finished(key))
    }
}

mod claim;
mod gauges;
mod resolvable;
mod sweep;
mod tooling;

#[cfg(test)]
mod tests;
