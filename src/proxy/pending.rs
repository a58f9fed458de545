//! Results whose save is being retried in the background, and the bounds on them.
//!
//! SPEC §4.5: when the store fails after the upstream answered, the proxy keeps retrying the
//! save for as long as its lease can still be valid. A store that keeps refusing writes (Redis
//! out of memory under `noeviction` refuses `SET` while `PEXPIRE` still works) would let those
//! retries pile up for the life of the process, each holding its response. So the responses
//! they hold are bounded in count and bytes (`limits.max_pending_saves`,
//! `limits.max_pending_save_bytes`).
//!
//! Past either bound the oldest is *downgraded*, never dropped: dropping a save would stop the
//! renewals of its lease, the lease would expire, and the retry would run the operation a
//! second time. A downgraded save lets go of its response (freeing its bytes) and goes on
//! retrying with a small `result-not-kept` record instead, renewing its lease meanwhile; the
//! lease side ([`super::lease`]) logs and counts that when it happens. Only a lost lease ends a
//! save unsaved.
//!
//! Downgraded saves hold a few hundred bytes each, and there can be no more of them than
//! requests that were claimed while the store worked and then saw it fail; still, a store that
//! keeps failing that way must not grow them without end. So as many of them as
//! `limits.max_pending_saves` may be pending; at that many, new requests on idempotent routes
//! are refused (`503 overloaded`) before anything is claimed, until some land. What is still
//! pending at shutdown is logged, so an operator can reconcile those keys.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use prometheus_client::metrics::gauge::Gauge;
use tokio_util::sync::CancellationToken;

struct Pending {
    route: Arc<str>,
    key: String,
    /// What its whole result takes; counted in the byte bound until it is downgraded.
    bytes: u64,
    downgrade: CancellationToken,
}

#[derive(Default)]
struct Inner {
    next: u64,
    /// The saves that still hold their whole result, oldest first.
    whole: BTreeMap<u64, Pending>,
    /// The saves that were downgraded to a `result-not-kept` record.
    downgraded: BTreeMap<u64, Pending>,
    /// The bytes of the whole results held.
    bytes: u64,
}

/// The saves retried in the background, bounded.
pub(super) struct PendingSaves {
    inner: Mutex<Inner>,
    /// The bounds: a reload may change them, for the saves that begin after it.
    max: AtomicU64,
    max_bytes: AtomicU64,
    count: Gauge,
    held_bytes: Gauge,
}

/// One pending save; [`PendingSaves::finish`] it when the retries end.
pub(super) struct Ticket {
    id: u64,
    /// Cancelled when the save must let go of its result and save `result-not-kept` instead.
    pub downgrade: CancellationToken,
}

impl PendingSaves {
    pub(crate) fn new(max: u32, max_bytes: u64, count: Gauge, held_bytes: Gauge) -> PendingSaves {
        PendingSaves {
            inner: Mutex::default(),
            max: AtomicU64::new(u64::from(max)),
            max_bytes: AtomicU64::new(max_bytes),
            count,
            held_bytes,
        }
    }

    /// Sets the bounds (a reload's `limits`). Saves already pending are held to them from the
    /// next [`PendingSaves::begin`] on, as if they had begun under them.
    pub(crate) fn set_bounds(&self, max: u32, max_bytes: u64) {
        self.max.store(u64::from(max), Ordering::Relaxed);
        self.max_bytes.store(max_bytes, Ordering::Relaxed);
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Every critical section leaves the maps and the byte count consistent.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts tracking a save of a `bytes` long result for the key whose hash is `key`;
    /// downgrades the oldest whole ones — this one too, if it alone is over the byte bound —
    /// while the bounds are exceeded.
    pub(crate) fn begin(&self, route: Arc<str>, key: String, bytes: u64) -> Ticket {
        let downgrade = CancellationToken::new();
        let mut inner = self.lock();
        let id = inner.next;
        inner.next += 1;
        inner.bytes += bytes;
        inner.whole.insert(
            id,
            Pending {
                route,
                key,
                bytes,
                downgrade: downgrade.clone(),
            },
        );
        let (max, max_bytes) = (
            self.max.load(Ordering::Relaxed),
            self.max_bytes.load(Ordering::Relaxed),
        );
        while inner.whole.len() as u64 > max || inner.bytes > max_bytes {
            let Some((oldest_id, oldest)) = inner.whole.pop_first() else {
                break;
            };
            inner.bytes -= oldest.bytes;
            oldest.downgrade.cancel();
            inner.downgraded.insert(oldest_id, oldest);
        }
        self.publish(&inner);
        Ticket { id, downgrade }
    }

    /// Whether as many downgraded saves are pending as the bound allows: new claims must wait.
    pub(crate) fn is_saturated(&self) -> bool {
        self.lock().downgraded.len() as u64 >= self.max.load(Ordering::Relaxed)
    }

    /// The save ended (saved, or its lease lost).
    pub(crate) fn finish(&self, ticket: &Ticket) {
        let mut inner = self.lock();
        if let Some(p) = inner.whole.remove(&ticket.id) {
            inner.bytes -= p.bytes;
        }
        inner.downgraded.remove(&ticket.id);
        self.publish(&inner);
    }

    fn publish(&self, inner: &Inner) {
        let count = inner.whole.len() + inner.downgraded.len();
        self.count.set(i64::try_from(count).unwrap_or(i64::MAX));
        self.held_bytes
            .set(i64::try_from(inner.bytes).unwrap_or(i64::MAX));
    }

    /// Logs every save still pending (at shutdown), with its key's hash.
    pub(crate) fn log_pending(&self) {
        let inner = self.lock();
        let count = inner.whole.len() + inner.downgraded.len();
        if count == 0 {
            return;
        }
        tracing::error!(
            count,
            "results still unsaved at shutdown; their keys stay in flight until their leases expire, then a retry runs the operation again"
        );
        for p in inner.whole.values() {
            tracing::error!(route = %p.route, key = %p.key, bytes = p.bytes, "unsaved result at shutdown");
        }
        for p in inner.downgraded.values() {
            tracing::error!(route = %p.route, key = %p.key, bytes = p.bytes, "unsaved result at shutdown (its result-not-kept record was not saved either)");
        }
    }

    /// How many saves are pending, whole and downgraded.
    #[cfg(test)]
    pub(crate) fn len(&self) -> (usize, usize) {
        let inner = self.lock();
        (inner.whole.len(), inner.downgraded.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn saves(max: u32, max_bytes: u64) -> (PendingSaves, Gauge, Gauge) {
        let (count, bytes) = (Gauge::default(), Gauge::default());
        (
            PendingSaves::new(max, max_bytes, count.clone(), bytes.clone()),
            count,
            bytes,
        )
    }

    fn begin(p: &PendingSaves, key: &str, bytes: u64) -> Ticket {
        p.begin("r".into(), key.into(), bytes)
    }

    #[test]
    fn past_either_bound_the_oldest_is_downgraded_and_stays_pending() {
        let (p, count, bytes) = saves(2, 100);
        let a = begin(&p, "a", 10);
        let b = begin(&p, "b", 10);
        assert!(!a.downgrade.is_cancelled() && !b.downgrade.is_cancelled());
        let c = begin(&p, "c", 10);
        assert!(a.downgrade.is_cancelled(), "the oldest goes past the count");
        assert!(!b.downgrade.is_cancelled() && !c.downgrade.is_cancelled());
        let d = begin(&p, "d", 85);
        assert!(b.downgrade.is_cancelled(), "and past the bytes");
        assert!(!c.downgrade.is_cancelled() && !d.downgrade.is_cancelled());
        assert_eq!(
            p.len(),
            (2, 2),
            "downgraded, not dropped: their leases are kept"
        );
        assert_eq!(
            (count.get(), bytes.get()),
            (4, 95),
            "only whole results hold bytes"
        );
        for t in [&c, &d, &a, &b] {
            p.finish(t);
        }
        assert_eq!(p.len(), (0, 0));
        assert_eq!((count.get(), bytes.get()), (0, 0));
    }

    #[test]
    fn a_result_alone_over_the_byte_bound_is_downgraded_at_once_not_given_up() {
        let (p, count, bytes) = saves(10, 1024);
        let big = begin(&p, "big", 4096);
        assert!(big.downgrade.is_cancelled());
        assert_eq!(p.len(), (0, 1), "still pending: it keeps its lease");
        assert_eq!((count.get(), bytes.get()), (1, 0));
        let small = begin(&p, "small", 100);
        assert!(!small.downgrade.is_cancelled(), "the next one still fits");
        p.finish(&big);
        p.finish(&small);
        assert_eq!(p.len(), (0, 0));
    }

    #[test]
    fn as_many_downgraded_saves_as_the_count_bound_saturate_it() {
        let (p, _, _) = saves(2, 100);
        let a = begin(&p, "a", 200);
        assert!(!p.is_saturated());
        let b = begin(&p, "b", 200);
        assert!(
            p.is_saturated(),
            "two downgraded saves pending, at max_pending_saves 2"
        );
        p.finish(&a);
        assert!(!p.is_saturated(), "one landed: claims may go on");
        p.finish(&b);
    }

    #[test]
    fn finishing_twice_or_in_any_order_keeps_the_counts() {
        let (p, count, bytes) = saves(1, 100);
        let a = begin(&p, "a", 40);
        let b = begin(&p, "b", 50);
        assert!(a.downgrade.is_cancelled() && !b.downgrade.is_cancelled());
        p.finish(&a);
        p.finish(&a);
        assert_eq!((count.get(), bytes.get()), (1, 50));
        p.finish(&b);
        assert_eq!((count.get(), bytes.get()), (0, 0));
    }
}
