//! The lease: a held claim, renewed every `lock_ttl/3` while the upstream call runs, then
//! completed with the result or released — only by the holder of its token.
//!
//! Renewal runs in the exchange's own task, beside the upstream call ([`Lease::renewing`]), not
//! in a task of its own: nothing can outlive the exchange and keep a key blocked, and a request
//! costs one spawned task, not two.

use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use crate::key::StoreKey;
use crate::metrics::RouteMetrics;
use crate::record::Entry;
use crate::store::{Held, StoreHandle};

/// A held claim, and until when it is surely valid.
pub(super) struct Lease {
    store: StoreHandle,
    metrics: RouteMetrics,
    route: std::sync::Arc<str>,
    key: StoreKey,
    held: Held,
    lock_ttl: Duration,
    /// Until when the lease is surely valid: the send time of the last successful claim or
    /// renewal plus `lock_ttl` (the send time, not the answer time, so it is never optimistic).
    valid_until: Instant,
    /// Set once the lease is known lost, so it is logged and counted once.
    lost: bool,
}

impl Lease {
    /// The lease of a claim sent at `claimed_at`.
    pub fn new(
        store: StoreHandle,
        metrics: RouteMetrics,
        route: std::sync::Arc<str>,
        key: StoreKey,
        held: Held,
        lock_ttl: Duration,
        claimed_at: Instant,
    ) -> Lease {
        Lease {
            store,
            metrics,
            route,
            key,
            held,
            lock_ttl,
            valid_until: claimed_at + lock_ttl,
            lost: false,
        }
    }

    /// Drives `call` to its end, renewing the lease every `lock_ttl/3` meanwhile. A renewal in
    /// flight never holds the call back: both are polled together. A failed renewal is retried
    /// at the next tick (two more chances before the lease can expire); once the key is known
    /// to hold another claim, renewing stops.
    pub async fn renewing<F: Future>(&mut self, call: F) -> F::Output {
        let period = self.lock_ttl / 3;
        tokio::pin!(call);
        let mut next = Instant::now() + period;
        loop {
            tokio::select! {
                biased;
                out = &mut call => return out,
                () = tokio::time::sleep_until(next) => {}
            }
            let sent = Instant::now();
            let renewed = {
                let renewal = self.store.renew(&self.key, &self.held, self.lock_ttl);
                tokio::select! {
                    biased;
                    out = &mut call => return out,
                    r = renewal => r,
                }
            };
            match renewed {
                Ok(true) => self.valid_until = sent + self.lock_ttl,
                Ok(false) => {
                    self.mark_lost("another request holds the key now");
                    return call.await;
                }
                Err(e) => {
                    tracing::warn!(route = %self.route, key = %self.key.id_hex(), error = %e, "lease renewal failed; retrying")
                }
            }
            next = (next + period).max(Instant::now());
        }
    }

    /// Frees the key (holder only).
    pub async fn release(mut self) {
        match self.store.release(&self.key, &self.held).await {
            Ok(true) => {}
            Ok(false) => self.mark_lost("the claim was gone before release"),
            // The claim will expire within lock_ttl; until then repeats get 409.
            Err(e) => tracing::warn!(
                route = %self.route,
                key = %self.key.id_hex(),
                error = %e,
                "release failed; the claim expires within lock_ttl"
            ),
        }
    }

    /// Completes the claim with the finished entry (compare-and-set on the token). If the store
    /// fails, the completion goes on in the background (tracked by `tasks`) while the lease may
    /// still be valid; the caller answers the client at once either way.
    pub async fn complete(mut self, done: Entry, ttl: Duration, tasks: &TaskTracker) {
        let encoded = done.encode();
        match self
            .store
            .complete(&self.key, &self.held, &encoded, ttl)
            .await
        {
            Ok(true) => {}
            Ok(false) => self.lost_or_completed(&done).await,
            Err(e) => {
                tracing::warn!(
                    route = %self.route,
                    key = %self.key.id_hex(),
                    error = %e,
                    "completing the claim failed; retrying in the background"
                );
                tasks.spawn(self.complete_in_background(done, encoded, ttl));
            }
        }
    }

    fn mark_lost(&mut self, why: &str) {
        if !self.lost {
            self.lost = true;
            tracing::error!(
                route = %self.route,
                key = %self.key.id_hex(),
                "lease lost: {why}; the result is not saved under this claim"
            );
            self.metrics.lost_lease();
        }
    }

    /// Retries a failed completion with backoff, renewing the lease meanwhile, for as long as
    /// the lease may still be valid.
    async fn complete_in_background(mut self, done: Entry, encoded: Bytes, ttl: Duration) {
        let mut backoff = Duration::from_millis(50);
        loop {
            let now = Instant::now();
            if now >= self.valid_until {
                tracing::error!(
                    route = %self.route,
                    key = %self.key.id_hex(),
                    "gave up saving the result: the lease expired; a retry of this key will run the operation again"
                );
                self.metrics.save_abandoned();
                self.mark_lost("it expired while the store was failing");
                return;
            }
            tokio::time::sleep(backoff.min(self.valid_until - now)).await;
            backoff = (backoff * 2).min(Duration::from_secs(1));
            match self
                .store
                .complete(&self.key, &self.held, &encoded, ttl)
                .await
            {
                Ok(true) => {
                    tracing::info!(route = %self.route, key = %self.key.id_hex(), "result saved after retrying");
                    return;
                }
                Ok(false) => return self.lost_or_completed(&done).await,
                // Keep the lease alive while the store comes back.
                Err(_) => {
                    let sent = Instant::now();
                    match self.store.renew(&self.key, &self.held, self.lock_ttl).await {
                        Ok(true) => self.valid_until = sent + self.lock_ttl,
                        Ok(false) => return self.lost_or_completed(&done).await,
                        Err(_) => {}
                    }
                }
            }
        }
    }

    /// The compare-and-set failed: either an earlier attempt whose answer was lost did complete
    /// (the record is ours), or the lease was lost to another request.
    async fn lost_or_completed(&mut self, done: &Entry) {
        if let Ok(Some(current)) = self.store.get(&self.key).await {
            if current == *done {
                return;
            }
        }
        self.mark_lost("the key was claimed by another request");
    }
}
