//! Results whose completion is being retried in the background, and the bounds on them.
//!
//! SPEC §4.5: when the store fails after the upstream answered, the proxy keeps retrying the
//! save for as long as its lease can still be valid. A store that keeps refusing writes (Redis
//! out of memory under `noeviction` refuses `SET` while `PEXPIRE` still works) would let those
//! retries pile up for the life of the process, each holding its response. So they are bounded
//! in count and bytes (`limits.max_pending_saves`, `limits.max_pending_save_bytes`): past
//! either bound the oldest is given up — logged with its key's hash and counted — and what is
//! still pending at shutdown is logged, so an operator can reconcile those keys.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use prometheus_client::metrics::gauge::Gauge;
use tokio_util::sync::CancellationToken;

use crate::metrics::RouteMetrics;

struct Pending {
    route: Arc<str>,
    key: String,
    bytes: u64,
    give_up: CancellationToken,
    metrics: RouteMetrics,
}

#[derive(Default)]
struct Inner {
    next: u64,
    /// By admission order: the first entry is the oldest.
    entries: BTreeMap<u64, Pending>,
    bytes: u64,
}

/// The pending background saves.
pub(super) struct PendingSaves {
    inner: Mutex<Inner>,
    max: u64,
    max_bytes: u64,
    count: Gauge,
    held_bytes: Gauge,
}

/// One admitted pending save; [`PendingSaves::finish`] it when the retries end.
pub(super) struct Ticket {
    id: u64,
    /// Cancelled when the save is given up to make room.
    pub give_up: CancellationToken,
}

impl PendingSaves {
    pub fn new(max: u32, max_bytes: u64, count: Gauge, held_bytes: Gauge) -> PendingSaves {
        PendingSaves {
            inner: Mutex::default(),
            max: u64::from(max),
            max_bytes,
            count,
            held_bytes,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Every critical section leaves the map and the byte count consistent.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Admits a save of `bytes` for the key whose hash is `key`; gives up the oldest ones while
    /// the bounds are exceeded.
    pub fn admit(&self, route: Arc<str>, key: String, bytes: u64, metrics: RouteMetrics) -> Ticket {
        let give_up = CancellationToken::new();
        let mut inner = self.lock();
        let id = inner.next;
        inner.next += 1;
        inner.bytes += bytes;
        inner.entries.insert(
            id,
            Pending {
                route,
                key,
                bytes,
                give_up: give_up.clone(),
                metrics,
            },
        );
        while inner.entries.len() as u64 > self.max || inner.bytes > self.max_bytes {
            let Some((_, oldest)) = inner.entries.pop_first() else {
                break;
            };
            inner.bytes -= oldest.bytes;
            tracing::error!(
                route = %oldest.route,
                key = %oldest.key,
                bytes = oldest.bytes,
                "gave up saving a result to make room (limits.max_pending_saves / max_pending_save_bytes): \
                 the key stays in flight until its lease expires, then a retry runs the operation again"
            );
            oldest.metrics.save_abandoned();
            oldest.give_up.cancel();
        }
        self.publish(&inner);
        Ticket { id, give_up }
    }

    /// The save ended (saved, lost or given up).
    pub fn finish(&self, ticket: &Ticket) {
        let mut inner = self.lock();
        if let Some(p) = inner.entries.remove(&ticket.id) {
            inner.bytes -= p.bytes;
        }
        self.publish(&inner);
    }

    fn publish(&self, inner: &Inner) {
        self.count
            .set(i64::try_from(inner.entries.len()).unwrap_or(i64::MAX));
        self.held_bytes
            .set(i64::try_from(inner.bytes).unwrap_or(i64::MAX));
    }

    /// Logs every save still pending (at shutdown), with its key's hash.
    pub fn log_pending(&self) {
        let inner = self.lock();
        if inner.entries.is_empty() {
            return;
        }
        tracing::error!(
            count = inner.entries.len(),
            "results still unsaved at shutdown; their keys stay in flight until their leases expire, then a retry runs the operation again"
        );
        for p in inner.entries.values() {
            tracing::error!(route = %p.route, key = %p.key, bytes = p.bytes, "unsaved result at shutdown");
        }
    }

    /// How many saves are pending.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;

    #[test]
    fn past_either_bound_the_oldest_is_given_up() {
        let m = Metrics::new();
        let p = PendingSaves::new(2, 100, Gauge::default(), Gauge::default());
        let r = || m.route("r");
        let a = p.admit("r".into(), "a".into(), 10, r());
        let b = p.admit("r".into(), "b".into(), 10, r());
        assert!(!a.give_up.is_cancelled() && !b.give_up.is_cancelled());
        let c = p.admit("r".into(), "c".into(), 10, r());
        assert!(a.give_up.is_cancelled(), "the oldest goes past the count");
        assert!(!b.give_up.is_cancelled() && !c.give_up.is_cancelled());
        let d = p.admit("r".into(), "d".into(), 85, r());
        assert!(b.give_up.is_cancelled(), "and past the bytes");
        assert!(!c.give_up.is_cancelled() && !d.give_up.is_cancelled());
        assert_eq!(p.len(), 2);
        p.finish(&c);
        p.finish(&d);
        p.finish(&a);
        assert_eq!(p.len(), 0);
        assert!(
            m.encode()
                .contains(r#"idemproxy_saves_abandoned_total{route="r"} 2"#)
        );
    }
}
