//! Reclaiming expired records: a sweeper that visits every shard each [`SWEEP_EVERY`], and a
//! full purge a claim at the bound may run (at most every [`PURGE_AT_BOUND_EVERY`]). An
//! expired record is absent the moment it expires; this only gives its memory back.

use std::sync::Weak;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{Inner, SHARDS, Shard, lock, millis};

/// How often the sweeper visits every shard to reclaim expired records.
pub(super) const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// The least time between two full purges run by claims at the bound: how long, at most, a full
/// store refuses claims while lapsed records could have made room.
pub(super) const PURGE_AT_BOUND_EVERY: Duration = Duration::from_millis(100);

/// Starts the sweeper on the current Tokio runtime; it stops once the store is dropped.
pub(super) fn spawn(weak: Weak<Inner>) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(SWEEP_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            for i in 0..SHARDS {
                let Some(inner) = weak.upgrade() else { return };
                let now = inner.now();
                let (gone, _) = lock(&inner.shards[i]).purge_expired(now);
                inner.forget(gone);
                drop(inner);
                // One shard at a time, letting requests run in between.
                tokio::task::yield_now().await;
            }
        }
    });
}

impl Shard {
    /// Drops expired records; returns how many, and the earliest deadline of those left
    /// (`u64::MAX` if none).
    pub(super) fn purge_expired(&mut self, now: u64) -> (u64, u64) {
        let before = self.map.len();
        let waiters = &mut self.waiters;
        let mut earliest = u64::MAX;
        self.map.retain(|k, s| {
            let live = s.expires > now;
            if live {
                earliest = earliest.min(s.expires);
            } else if let Some(n) = waiters.remove(k) {
                n.notify_waiters();
            }
            live
        });
        ((before - self.map.len()) as u64, earliest)
    }
}

impl Inner {
    /// At the bound: reclaims expired records if one may have lapsed since the last purge and
    /// no purge ran in the last [`PURGE_AT_BOUND_EVERY`]. Whether it purged: only then can a
    /// second try find room. Claims that lose the race for the purge are refused at once
    /// rather than queue for the shards' locks behind it.
    pub(super) fn purge_at_bound(&self) -> bool {
        let now = self.now();
        if now < self.next_lapse.load(Ordering::Acquire) {
            return false;
        }
        let due = self.purge_due.load(Ordering::Acquire);
        let next = now.saturating_add(millis(PURGE_AT_BOUND_EVERY));
        if now < due
            || self
                .purge_due
                .compare_exchange(due, next, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
        {
            return false;
        }
        self.purge_all();
        true
    }

    /// Drops every expired record, one shard at a time, and starts `next_lapse` again from
    /// what is left (writes meanwhile lower it by themselves).
    pub(super) fn purge_all(&self) {
        self.full_purges.fetch_add(1, Ordering::Relaxed);
        self.next_lapse.store(u64::MAX, Ordering::Release);
        for shard in self.shards.iter() {
            let now = self.now();
            let (gone, earliest) = lock(shard).purge_expired(now);
            self.forget(gone);
            self.lapses_at(earliest);
        }
    }
}
