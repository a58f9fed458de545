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
//! shard once a second, and by a full sweep when the store is at its bound. The `max_entries`
//! bound is enforced on claims only, after expired records are gone: a full store refuses new
//! claims (a store error, so 503 or forward) and never evicts a live record — an evicted record
//! is a forgotten operation.
//!
//! Waiters (`on_conflict: wait`) are woken in-process by a per-key [`Notify`], made only for keys
//! that someone waits on, when the claim is completed, released or expires.

use std::collections::HashMap;
use std::collections::hash_map::Entry as MapEntry;
use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::{Forgotten, Held, Store, StoreError, StoreKey};
use crate::key::KeyId;
use crate::record;

/// How many independently locked maps the records are spread over.
const SHARDS: usize = 64;

/// How often the sweeper visits every shard to reclaim expired records.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

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

    /// Drops expired records; returns how many.
    fn purge_expired(&mut self, now: u64) -> u64 {
        let before = self.map.len();
        let waiters = &mut self.waiters;
        self.map.retain(|k, s| {
            let live = s.expires > now;
            if !live {
                if let Some(n) = waiters.remove(k) {
                    n.notify_waiters();
                }
            }
            live
        });
        (before - self.map.len()) as u64
    }
}

struct Inner {
    shards: Box<[Mutex<Shard>]>,
    /// Time zero of every deadline.
    epoch: Instant,
    /// Records held, expired ones not yet swept included.
    held: AtomicU64,
    max_entries: u64,
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

    /// Drops every expired record, one shard at a time.
    fn purge_all(&self) {
        for shard in self.shards.iter() {
            let now = self.now();
            let gone = lock(shard).purge_expired(now);
            self.forget(gone);
        }
    }

    /// One claim attempt: `Ok(None)` claimed, `Ok(Some(record))` taken, `Err(())` the store is
    /// at its bound.
    fn try_claim(&self, key: &MapKey, held: &Held, lease: Duration) -> Result<Option<Bytes>, ()> {
        let mut shard = self.shard(key);
        let now = self.now();
        // Made only when the claim is taken: a replay or a conflict allocates nothing here.
        let slot = || Slot {
            expires: now.saturating_add(millis(lease)),
            record: Arc::from(&held.encoded[..]),
        };
        match shard.map.entry(*key) {
            MapEntry::Occupied(o) if o.get().expires > now => Ok(Some(shared(&o.get().record))),
            // An expired record is absent: take its place (the count does not change).
            MapEntry::Occupied(mut o) => {
                o.insert(slot());
                shard.wake(key);
                Ok(None)
            }
            MapEntry::Vacant(v) => {
                if !self.reserve() {
                    return Err(());
                }
                v.insert(slot());
                Ok(None)
            }
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
        });
        let weak: Weak<Inner> = Arc::downgrade(&inner);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(SWEEP_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                for i in 0..SHARDS {
                    let Some(inner) = weak.upgrade() else { return };
                    let now = inner.now();
                    let gone = lock(&inner.shards[i]).purge_expired(now);
                    inner.forget(gone);
                    drop(inner);
                    // One shard at a time, letting requests run in between.
                    tokio::task::yield_now().await;
                }
            }
        });
        MemoryStore { inner }
    }

    /// How many records are held now, expired ones not yet swept included.
    pub fn len(&self) -> usize {
        usize::try_from(self.inner.held.load(Ordering::Acquire)).unwrap_or(usize::MAX)
    }

    /// Whether no record is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bound on records held (`store.max_entries`).
    pub fn max_entries(&self) -> u64 {
        self.inner.max_entries
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
        // At the bound: reclaim expired records, then try once more.
        self.inner.purge_all();
        self.inner
            .try_claim(&key, held, lease)
            .map_err(|()| StoreError::Full(self.inner.max_entries))
    }

    async fn renew(
        &self,
        key: &StoreKey,
        held: &Held,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let key = MapKey::of(key);
        let mut shard = self.inner.shard(&key);
        let now = self.inner.now();
        match shard.holds(&key, held, now) {
            Some(slot) => {
                slot.expires = now.saturating_add(millis(lease));
                Ok(true)
            }
            None => Ok(false),
        }
    }

    async fn complete(
        &self,
        key: &StoreKey,
        held: &Held,
        done: Bytes,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let key = MapKey::of(key);
        let mut shard = self.inner.shard(&key);
        let now = self.inner.now();
        let Some(slot) = shard.holds(&key, held, now) else {
            // A completion sent again after it landed counts as done, as on Redis.
            let landed = shard
                .map
                .get(&key)
                .is_some_and(|s| s.expires > now && *s.record == done[..]);
            return Ok(landed);
        };
        slot.expires = now.saturating_add(millis(ttl));
        slot.record = Arc::from(&done[..]);
        shard.wake(&key);
        Ok(true)
    }

    async fn release(&self, key: &StoreKey, held: &Held) -> Result<bool, StoreError> {
        let key = MapKey::of(key);
        let mut shard = self.inner.shard(&key);
        let now = self.inner.now();
        if shard.holds(&key, held, now).is_none() {
            return Ok(false);
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

    async fn wait_change(&self, key: &StoreKey, max: Duration) {
        let key = MapKey::of(key);
        let (notify, expires) = {
            let mut shard = self.inner.shard(&key);
            let now = self.inner.now();
            let Some(expires) = shard
                .live(&key, now)
                .filter(|s| record::is_in_flight(&s.record))
                .map(|s| s.expires)
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

    fn fill(&self) -> Option<(u64, u64)> {
        Some((self.len() as u64, self.inner.max_entries))
    }

    async fn inspect(&self, key: &StoreKey) -> Result<Option<(Bytes, Duration)>, StoreError> {
        let key = MapKey::of(key);
        let shard = self.inner.shard(&key);
        let now = self.inner.now();
        Ok(shard
            .live(&key, now)
            .map(|s| (shared(&s.record), Duration::from_millis(s.expires - now))))
    }

    async fn forget(&self, key: &StoreKey) -> Result<Forgotten, StoreError> {
        let key = MapKey::of(key);
        let mut shard = self.inner.shard(&key);
        let now = self.inner.now();
        let found = match shard.live(&key, now) {
            None => return Ok(Forgotten::Absent),
            Some(slot) => Forgotten::of(&slot.record),
        };
        if found == Forgotten::Forgotten {
            shard.map.remove(&key);
            drop(shard);
            self.inner.forget(1);
        }
        Ok(found)
    }
}

#[cfg(test)]
mod tests;
