//! The sweep: every `sweep_interval`, each instance deletes expired rows in batches of
//! [`BATCH`], oldest first, repeating while a batch comes back full.
//!
//! Correctness never depends on it: an expired row is absent to every statement already. It
//! only keeps the table (and its index) from growing with every key ever used. Any instance may
//! sweep, several at once: `SKIP LOCKED` splits the rows between them and leaves alone any row
//! a claim or a holder is writing (see `sql.rs`).

use std::sync::Weak;
use std::time::Duration;

use super::Inner;

/// Rows deleted per statement: a claim that meets a row of the batch waits for the batch's
/// commit, so a batch is kept to a few milliseconds of work.
pub(super) const BATCH: i64 = 1000;

/// Sweeps until the store is dropped (the task holds it only while a batch runs).
pub(super) fn spawn(store: Weak<Inner>, every: Duration) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The first tick is at once: the store has only just been made.
        tick.tick().await;
        loop {
            tick.tick().await;
            loop {
                let Some(inner) = store.upgrade() else {
                    return;
                };
                // A batch is one store operation: bounded by store.timeout like any other.
                let batch = tokio::time::timeout(inner.timeout, inner.sweep_batch()).await;
                match batch {
                    Ok(Ok(deleted)) => {
                        inner.swept.swept(deleted);
                        if deleted < BATCH.unsigned_abs() {
                            break;
                        }
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(error = %e, "postgres sweep failed; trying again at the next sweep_interval");
                        break;
                    }
                    Err(_) => {
                        tracing::warn!(
                            after = ?inner.timeout,
                            "postgres sweep batch timed out (store.timeout); trying again at the next sweep_interval"
                        );
                        break;
                    }
                }
                drop(inner);
                // Between full batches, let the requests of this instance run.
                tokio::task::yield_now().await;
            }
        }
    });
}
