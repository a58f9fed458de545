//! The sweep: expired rows deleted in the background, in small transactions.
//!
//! Every `sweep_interval` (the first time one interval after the start), the sweep deletes expired rows [`SWEEP_BATCH`] at a time, each batch its own short write
//! transaction queued on the writer like any operation, so claims queued meanwhile commit
//! between two batches instead of waiting for the whole pass. A pass ends with a batch that
//! comes back short. Correctness never depends on it: every read and write treats an expired
//! row as absent; the sweep only keeps the file from growing.
//!
//! The task holds the store weakly, and a strong reference only for one batch at a time: it
//! never keeps a dropped store (and its file lock) alive, and ends once the store is gone.

use std::sync::Weak;
use std::time::Duration;

use tokio::runtime::Handle;

use rusqlite::params;

use super::Inner;
use super::ops::Ops;
use crate::store::StoreError;

/// The most rows one sweep transaction deletes.
pub(super) const SWEEP_BATCH: usize = 500;

/// Starts the sweep on `runtime`.
pub(super) fn start(runtime: &Handle, store: Weak<Inner>, every: Duration) {
    runtime.spawn(async move {
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            match pass(&store).await {
                Some(Ok(swept)) => tracing::debug!(swept, "sqlite sweep"),
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "sqlite sweep failed; it runs again at the next interval");
                }
                None => return,
            }
        }
    });
}

/// One pass: batches until one comes back short. `None`: the store is gone.
pub(super) async fn pass(store: &Weak<Inner>) -> Option<Result<u64, StoreError>> {
    let mut total = 0;
    loop {
        let inner = store.upgrade()?;
        let swept = match inner.sweep_batch().await {
            Ok(n) => n,
            Err(e) => return Some(Err(e)),
        };
        drop(inner);
        total += swept;
        if swept < SWEEP_BATCH as u64 {
            return Some(Ok(total));
        }
    }
}

impl Ops<'_> {
    /// Deletes at most `limit` rows expired at `now`; returns how many.
    pub(super) fn sweep(&mut self, now: i64, limit: usize) -> rusqlite::Result<u64> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let deleted = self.sweep.execute(params![now, limit])?;
        Ok(deleted as u64)
    }
}
