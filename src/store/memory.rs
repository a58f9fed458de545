//! The embedded store: one process, no Redis, the same semantics.
//!
//! A `HashMap` under a `std::sync::Mutex`. Every operation is one short critical section with
//! no `.await` inside, so a std mutex is right here (as in mini-redis's `db.rs`): it is cheaper
//! than an async one, and holding it across an await is impossible by construction. Because
//! the whole check-and-set happens under the lock, a claim is as atomic as Redis's `SET NX`.
//!
//! Expiry: each record has a deadline, kept in a min-heap next to the map. Expired records are
//! dropped lazily before every claim and by a sweeper task, and never counted as live. The
//! `max_entries` bound is enforced on claims only, after expired records are gone: a full store
//! refuses new claims (a store error, so 503 or forward) and never evicts a live record — an
//! evicted record is a forgotten operation.
//!
//! Waiters (`on_conflict: wait`) are woken in-process by a per-key [`Notify`] when the claim
//! is completed or released.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::{Claim, Held, Store, StoreError};
use crate::record::Entry;

/// How often the sweeper drops expired records when there is no traffic to do it.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

struct Slot {
    entry: Entry,
    expires: Instant,
    /// Bumped on every write, so stale heap items are recognised and skipped.
    generation: u64,
    /// Woken when this in-progress claim is completed or released.
    notify: Option<Arc<Notify>>,
}

#[derive(Default)]
struct Inner {
    map: HashMap<String, Slot>,
    expiries: BinaryHeap<Reverse<(Instant, u64, String)>>,
    next_generation: u64,
}

impl Inner {
    fn purge_expired(&mut self, now: Instant) {
        while let Some(Reverse((at, generation, _))) = self.expiries.peek() {
            if *at > now {
                break;
            }
            let generation = *generation;
            let Some(Reverse((_, _, key))) = self.expiries.pop() else {
                break;
            };
            if self
                .map
                .get(&key)
                .is_some_and(|s| s.generation == generation && s.expires <= now)
            {
                if let Some(slot) = self.map.remove(&key) {
                    wake(&slot);
                }
            }
        }
    }

    /// The live slot under `key`, if any (an expired one is treated as absent).
    fn live(&mut self, key: &str, now: Instant) -> Option<&mut Slot> {
        self.map.get_mut(key).filter(|s| s.expires > now)
    }

    fn put(&mut self, key: &str, entry: Entry, ttl: Duration, now: Instant) -> u64 {
        self.next_generation += 1;
        let generation = self.next_generation;
        let expires = now + ttl;
        self.expiries
            .push(Reverse((expires, generation, key.to_owned())));
        let notify = matches!(entry, Entry::InFlight { .. }).then(|| Arc::new(Notify::new()));
        if let Some(old) = self.map.insert(
            key.to_owned(),
            Slot {
                entry,
                expires,
                generation,
                notify,
            },
        ) {
            wake(&old);
        }
        generation
    }

    fn touch(&mut self, key: &str, ttl: Duration, now: Instant) {
        self.next_generation += 1;
        let generation = self.next_generation;
        if let Some(slot) = self.map.get_mut(key) {
            slot.expires = now + ttl;
            slot.generation = generation;
            self.expiries
                .push(Reverse((slot.expires, generation, key.to_owned())));
        }
    }

    /// Whether `held` is what the key holds now (the compare of compare-and-set).
    fn holds(&mut self, key: &str, held: &Held, now: Instant) -> bool {
        self.live(key, now).is_some_and(|s| s.entry == held.entry)
    }
}

fn wake(slot: &Slot) {
    if let Some(n) = &slot.notify {
        n.notify_waiters();
    }
}

/// The embedded in-memory store.
pub struct MemoryStore {
    inner: Arc<Mutex<Inner>>,
    max_entries: u64,
}

impl MemoryStore {
    /// A store that keeps at most `max_entries` live records. Starts the sweeper on the
    /// current Tokio runtime; it stops when the store is dropped.
    pub fn new(max_entries: u64) -> MemoryStore {
        let inner = Arc::new(Mutex::new(Inner::default()));
        let weak: Weak<Mutex<Inner>> = Arc::downgrade(&inner);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(SWEEP_EVERY);
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { return };
                lock(&inner).purge_expired(Instant::now());
            }
        });
        MemoryStore { inner, max_entries }
    }

    /// How many records are held now, expired ones not yet swept included.
    pub fn len(&self) -> usize {
        lock(&self.inner).map.len()
    }

    /// Whether no record is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Locks the map. A panic while holding the lock cannot leave a half-written record (every
/// critical section writes at most one map slot and one heap item), so a poisoned lock is
/// still safe to use.
fn lock(m: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[async_trait]
impl Store for MemoryStore {
    async fn claim(&self, key: &str, held: &Held, lease: Duration) -> Result<Claim, StoreError> {
        let now = Instant::now();
        let mut inner = lock(&self.inner);
        inner.purge_expired(now);
        if let Some(slot) = inner.live(key, now) {
            return Ok(Claim::Existing(slot.entry.clone()));
        }
        if inner.map.len() as u64 >= self.max_entries {
            return Err(StoreError::Full(self.max_entries));
        }
        inner.put(key, held.entry.clone(), lease, now);
        Ok(Claim::Claimed)
    }

    async fn renew(&self, key: &str, held: &Held, lease: Duration) -> Result<bool, StoreError> {
        let now = Instant::now();
        let mut inner = lock(&self.inner);
        if !inner.holds(key, held, now) {
            return Ok(false);
        }
        inner.touch(key, lease, now);
        Ok(true)
    }

    async fn complete(
        &self,
        key: &str,
        held: &Held,
        done: &Entry,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let now = Instant::now();
        let mut inner = lock(&self.inner);
        if !inner.holds(key, held, now) {
            return Ok(false);
        }
        inner.put(key, done.clone(), ttl, now);
        Ok(true)
    }

    async fn release(&self, key: &str, held: &Held) -> Result<bool, StoreError> {
        let now = Instant::now();
        let mut inner = lock(&self.inner);
        if !inner.holds(key, held, now) {
            return Ok(false);
        }
        if let Some(slot) = inner.map.remove(key) {
            wake(&slot);
        }
        Ok(true)
    }

    async fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        let now = Instant::now();
        let mut inner = lock(&self.inner);
        Ok(inner.live(key, now).map(|s| s.entry.clone()))
    }

    async fn wait_change(&self, key: &str, max: Duration) {
        let notify = {
            let mut inner = lock(&self.inner);
            match inner.live(key, Instant::now()) {
                Some(Slot {
                    notify: Some(n),
                    expires,
                    ..
                }) => Some((n.clone(), *expires)),
                _ => None,
            }
        };
        let Some((notify, expires)) = notify else {
            return;
        };
        let notified = notify.notified();
        tokio::pin!(notified);
        // Register before re-checking, so a wake between the check and the await is not lost.
        notified.as_mut().enable();
        let still_in_flight = {
            let mut inner = lock(&self.inner);
            inner
                .live(key, Instant::now())
                .is_some_and(|s| matches!(s.entry, Entry::InFlight { .. }))
        };
        if !still_in_flight {
            return;
        }
        // Also wake when the lease would expire (a dead holder never notifies).
        let until = Instant::now() + max;
        let deadline = until.min(expires + Duration::from_millis(1));
        let _ = tokio::time::timeout_at(deadline, notified).await;
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{Outcome, new_token};
    use http::StatusCode;

    fn held(fp: u8) -> Held {
        Held::new(Entry::InFlight {
            token: new_token(),
            fingerprint: [fp; 32],
        })
    }

    fn done(fp: u8) -> Entry {
        Entry::Done {
            fingerprint: [fp; 32],
            outcome: Outcome::NotReplayable {
                status: StatusCode::OK,
            },
        }
    }

    #[tokio::test(start_paused = true)]
    async fn claim_is_exclusive_and_expires() {
        let s = MemoryStore::new(10);
        let a = held(1);
        let b = held(1);
        let lease = Duration::from_secs(1);
        assert_eq!(s.claim("k", &a, lease).await.ok(), Some(Claim::Claimed));
        assert_eq!(
            s.claim("k", &b, lease).await.ok(),
            Some(Claim::Existing(a.entry.clone()))
        );
        tokio::time::advance(Duration::from_millis(1001)).await;
        // a's lease expired: b may claim, and a may no longer complete.
        assert_eq!(s.claim("k", &b, lease).await.ok(), Some(Claim::Claimed));
        assert_eq!(s.complete("k", &a, &done(1), lease).await.ok(), Some(false));
        assert_eq!(s.renew("k", &a, lease).await.ok(), Some(false));
        assert_eq!(s.release("k", &a).await.ok(), Some(false));
        assert_eq!(s.complete("k", &b, &done(1), lease).await.ok(), Some(true));
        assert_eq!(s.get("k").await.ok(), Some(Some(done(1))));
    }

    #[tokio::test(start_paused = true)]
    async fn renew_extends_the_lease() {
        let s = MemoryStore::new(10);
        let a = held(1);
        let lease = Duration::from_secs(1);
        assert_eq!(s.claim("k", &a, lease).await.ok(), Some(Claim::Claimed));
        for _ in 0..5 {
            tokio::time::advance(Duration::from_millis(500)).await;
            assert_eq!(s.renew("k", &a, lease).await.ok(), Some(true));
        }
        assert!(matches!(
            s.claim("k", &held(1), lease).await,
            Ok(Claim::Existing(_))
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn full_store_refuses_new_claims_and_never_evicts() {
        let s = MemoryStore::new(2);
        let lease = Duration::from_secs(10);
        assert!(s.claim("a", &held(1), lease).await.is_ok());
        assert!(s.claim("b", &held(1), lease).await.is_ok());
        assert!(matches!(
            s.claim("c", &held(1), lease).await,
            Err(StoreError::Full(2))
        ));
        assert!(s.get("a").await.ok().flatten().is_some());
        // Once records expire, there is room again.
        tokio::time::advance(Duration::from_secs(11)).await;
        assert_eq!(
            s.claim("c", &held(1), lease).await.ok(),
            Some(Claim::Claimed)
        );
        assert_eq!(s.len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn waiters_wake_on_completion() {
        let s = Arc::new(MemoryStore::new(10));
        let a = held(1);
        let lease = Duration::from_secs(10);
        assert!(s.claim("k", &a, lease).await.is_ok());
        let s2 = s.clone();
        let waiter = tokio::spawn(async move {
            let start = Instant::now();
            s2.wait_change("k", Duration::from_secs(5)).await;
            start.elapsed()
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(s.complete("k", &a, &done(1), lease).await.ok(), Some(true));
        let waited = waiter.await.expect("waiter");
        assert!(
            waited < Duration::from_secs(1),
            "woken at once, not at the deadline"
        );
    }
}
