//! The lease: a held claim, renewed every `lock_ttl/3` while the upstream call runs, then
//! completed with the result or released — only by the holder of its token.
//!
//! Renewal runs in the exchange's future, beside the upstream call ([`Lease::renewing`]), not
//! in a task of its own: nothing can outlive the exchange and keep a key blocked, and a request
//! spawns no task for it.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::completion::Completion;
use super::pending::PendingCompletions;
use crate::key::StoreKey;
use crate::metrics::RouteMetrics;
use crate::record::Record;
use crate::store::{Held, StoreHandle};

/// Once a failing save has backed off this far, it is retried at this steady pace.
const SLOWEST_RETRY: Duration = Duration::from_secs(5);

/// A held claim, and until when it is surely valid.
pub(super) struct Lease {
    store: StoreHandle,
    metrics: RouteMetrics,
    route: Arc<str>,
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
    pub(crate) fn new(
        store: StoreHandle,
        metrics: RouteMetrics,
        route: Arc<str>,
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
    pub(crate) async fn renewing<F: Future>(&mut self, call: F) -> F::Output {
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
                Ok(true) => {
                    self.valid_until = sent + self.lock_ttl;
                    self.metrics.lease_renewed();
                }
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
    pub(crate) async fn release(mut self) {
        match self.store.release(&self.key, &self.held).await {
            Ok(true) => {}
            Ok(false) => self.mark_lost("another request holds the key now"),
            // The claim will expire within lock_ttl; until then repeats get 409.
            Err(e) => tracing::warn!(
                route = %self.route,
                key = %self.key.id_hex(),
                error = %e,
                "release failed; the claim expires within lock_ttl"
            ),
        }
    }

    /// Completes the claim with the finished record (compare-and-set on the token). If the store
    /// fails, the completion goes on in the background (tracked by `tasks`, bounded by
    /// `pending`: past its bounds it saves `result-not-kept` instead) while the lease may still
    /// be valid; the caller answers the client at once either way.
    pub(crate) async fn complete(
        mut self,
        done: Record,
        ttl: Duration,
        tasks: &TaskTracker,
        pending: &Arc<PendingCompletions>,
    ) {
        let encoded = done.encode();
        match self
            .store
            .complete(&self.key, &self.held, &encoded, ttl)
            .await
        {
            Ok(true) => {}
            Ok(false) => {
                self.lost_or_completed(&Completion::whole(done, encoded))
                    .await
            }
            Err(e) => {
                tracing::warn!(
                    route = %self.route,
                    key = %self.key.id_hex(),
                    error = %e,
                    "completing the claim failed; retrying in the background"
                );
                let ticket =
                    pending.begin(self.route.clone(), self.key.id_hex(), encoded.len() as u64);
                let pending = pending.clone();
                tasks.spawn(async move {
                    let completion = Completion::whole(done, encoded);
                    self.complete_in_background(completion, ttl, &ticket.downgrade)
                        .await;
                    pending.finish(&ticket);
                });
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
    /// the lease may still be valid. The backoff doubles up to a steady slow pace (every
    /// [`SLOWEST_RETRY`], or a third of the lease if that is shorter, so renewals keep up).
    ///
    /// Once `downgrade` is cancelled (the pending-save bounds), the result is dropped and the
    /// retries go on with `result-not-kept`: the lease is kept all the same, because a key
    /// freed now would let a retry run the operation a second time.
    async fn complete_in_background(
        &mut self,
        mut completion: Completion,
        ttl: Duration,
        downgrade: &CancellationToken,
    ) {
        let slowest = SLOWEST_RETRY.min(self.lock_ttl / 3);
        let mut backoff = Duration::from_millis(50).min(slowest);
        loop {
            if downgrade.is_cancelled() && !completion.is_downgraded() {
                self.downgrade(&mut completion);
            }
            let now = Instant::now();
            if now >= self.valid_until {
                tracing::error!(
                    route = %self.route,
                    key = %self.key.id_hex(),
                    "gave up saving the result: the lease expired; a retry of this key will run the operation again"
                );
                self.metrics.completion_abandoned();
                self.mark_lost("it expired while the store was failing");
                return;
            }
            let pause = tokio::time::sleep(backoff.min(self.valid_until - now));
            tokio::select! {
                () = pause => {}
                // Let go of the result at once, not after the pause: that frees its bytes.
                () = downgrade.cancelled(), if !completion.is_downgraded() => continue,
            }
            backoff = (backoff * 2).min(slowest);
            match self
                .store
                .complete(&self.key, &self.held, &completion.encoded, ttl)
                .await
            {
                Ok(true) if completion.is_downgraded() => {
                    tracing::warn!(route = %self.route, key = %self.key.id_hex(), "result-not-kept saved in place of the result");
                    return;
                }
                Ok(true) => {
                    tracing::info!(route = %self.route, key = %self.key.id_hex(), "result saved after retrying");
                    return;
                }
                Ok(false) => return self.lost_or_completed(&completion).await,
                // Keep the lease alive while the store comes back.
                Err(_) => {
                    let sent = Instant::now();
                    match self.store.renew(&self.key, &self.held, self.lock_ttl).await {
                        Ok(true) => self.valid_until = sent + self.lock_ttl,
                        Ok(false) => return self.lost_or_completed(&completion).await,
                        Err(_) => {}
                    }
                }
            }
        }
    }

    /// Drops the result of a save the pending-save bounds cannot keep; logged (with the key's
    /// hash, for reconciliation) and counted.
    fn downgrade(&self, completion: &mut Completion) {
        tracing::error!(
            route = %self.route,
            key = %self.key.id_hex(),
            bytes = completion.encoded.len(),
            status = completion.status().as_u16(),
            "result not kept: the store keeps refusing to save it and the pending-save bounds are reached \
             (limits.max_pending_saves / max_pending_save_bytes); the key stays held, and a result-not-kept \
             (502) is saved in its place as soon as the store takes it, so the operation never runs twice"
        );
        self.metrics.result_not_kept();
        completion.downgrade();
    }

    /// The compare-and-set failed: either an earlier attempt whose answer was lost did complete
    /// (the record is ours), or the lease was lost to another request.
    async fn lost_or_completed(&mut self, completion: &Completion) {
        match self.store.get(&self.key).await {
            Ok(Some(current)) if completion.wrote(&current) => {}
            Ok(_) => self.mark_lost("the key was claimed by another request"),
            // Only the confirming read failed: the lease may well be ours and saved. Not
            // counted as lost (that would send operators after a loss that did not happen).
            Err(e) => tracing::warn!(
                route = %self.route,
                key = %self.key.id_hex(),
                error = %e,
                "the save was refused and reading the key back failed: whether the lease was lost is unknown"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;
    use crate::record::{Saved, new_token};
    use crate::store::memory::MemoryStore;
    use crate::store::{Store, StoreError};
    use async_trait::async_trait;
    use bytes::Bytes;
    use http::StatusCode;

    /// A store whose compare-and-set always misses and whose reads fail: the lease cannot tell
    /// whether it was lost.
    struct ReadsFail(MemoryStore);

    #[async_trait]
    impl Store for ReadsFail {
        async fn claim(
            &self,
            key: &StoreKey,
            held: &Held,
            lease: Duration,
        ) -> Result<Option<Bytes>, StoreError> {
            self.0.claim(key, held, lease).await
        }
        async fn renew(&self, _: &StoreKey, _: &Held, _: Duration) -> Result<bool, StoreError> {
            Ok(false)
        }
        async fn complete(
            &self,
            _: &StoreKey,
            _: &Held,
            _: Bytes,
            _: Duration,
        ) -> Result<bool, StoreError> {
            Ok(false)
        }
        async fn release(&self, _: &StoreKey, _: &Held) -> Result<bool, StoreError> {
            Ok(false)
        }
        async fn get(&self, _: &StoreKey) -> Result<Option<Bytes>, StoreError> {
            Err(StoreError::Timeout {
                op: "get",
                after: Duration::from_millis(1),
            })
        }
        async fn ping(&self) -> Result<(), StoreError> {
            Ok(())
        }
        async fn inspect(&self, key: &StoreKey) -> Result<Option<(Bytes, Duration)>, StoreError> {
            self.0.inspect(key).await
        }
        async fn forget(&self, key: &StoreKey) -> Result<crate::store::Forgotten, StoreError> {
            self.0.forget(key).await
        }
    }

    /// The memory store, refusing every save while `refuse` is set (Redis out of memory:
    /// renewals still work).
    struct RefusesSaves {
        inner: MemoryStore,
        refuse: std::sync::atomic::AtomicBool,
    }

    #[async_trait]
    impl Store for RefusesSaves {
        async fn claim(
            &self,
            key: &StoreKey,
            held: &Held,
            lease: Duration,
        ) -> Result<Option<Bytes>, StoreError> {
            self.inner.claim(key, held, lease).await
        }
        async fn renew(
            &self,
            key: &StoreKey,
            held: &Held,
            lease: Duration,
        ) -> Result<bool, StoreError> {
            self.inner.renew(key, held, lease).await
        }
        async fn complete(
            &self,
            key: &StoreKey,
            held: &Held,
            done: Bytes,
            ttl: Duration,
        ) -> Result<bool, StoreError> {
            if self.refuse.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(StoreError::Timeout {
                    op: "complete",
                    after: Duration::from_millis(1),
                });
            }
            self.inner.complete(key, held, done, ttl).await
        }
        async fn release(&self, key: &StoreKey, held: &Held) -> Result<bool, StoreError> {
            self.inner.release(key, held).await
        }
        async fn get(&self, key: &StoreKey) -> Result<Option<Bytes>, StoreError> {
            self.inner.get(key).await
        }
        async fn ping(&self) -> Result<(), StoreError> {
            Ok(())
        }
        async fn inspect(&self, key: &StoreKey) -> Result<Option<(Bytes, Duration)>, StoreError> {
            self.inner.inspect(key).await
        }
        async fn forget(&self, key: &StoreKey) -> Result<crate::store::Forgotten, StoreError> {
            self.inner.forget(key).await
        }
    }

    /// A result alone over `max_pending_save_bytes`, refused by the store for three leases'
    /// time: the save keeps renewing its lease and, once the store takes writes again, saves
    /// `result-not-kept` with the first client's status, under the same fingerprint.
    #[tokio::test]
    async fn a_save_past_the_bounds_keeps_its_lease_and_saves_result_not_kept() {
        let metrics = Arc::new(Metrics::new());
        let refusing = Arc::new(RefusesSaves {
            inner: MemoryStore::new(10),
            refuse: true.into(),
        });
        let store = StoreHandle::new(refusing.clone(), Duration::from_secs(1), metrics.clone());
        let lock_ttl = Duration::from_millis(300);
        let key = StoreKey::new("p:r:".into(), 0, [2; 32]);
        let held = Held::new(Record::InFlight {
            token: new_token(),
            fingerprint: [1; 32],
        });
        let claimed_at = Instant::now();
        assert!(matches!(
            store.claim(&key, &held, lock_ttl).await,
            Ok(crate::store::Claim::Claimed)
        ));
        let lease = Lease::new(
            store.clone(),
            metrics.route("r"),
            "r".into(),
            key.clone(),
            held,
            lock_ttl,
            claimed_at,
        );
        let done = Record::Done {
            fingerprint: [1; 32],
            saved: Saved::Response(crate::record::SavedResponse {
                status: StatusCode::CREATED,
                headers: vec![],
                body: Bytes::from(vec![b'x'; 1000]),
            }),
        };
        let pending = Arc::new(PendingCompletions::new(
            10,
            100,
            Default::default(),
            Default::default(),
        ));
        let tasks = TaskTracker::new();
        lease
            .complete(done, Duration::from_secs(60), &tasks, &pending)
            .await;
        tokio::time::sleep(lock_ttl * 3).await;
        refusing
            .refuse
            .store(false, std::sync::atomic::Ordering::SeqCst);
        tasks.close();
        tokio::time::timeout(Duration::from_secs(5), tasks.wait())
            .await
            .expect("the background save ends once the store takes it");

        let Ok(Some(Record::Done {
            fingerprint,
            saved: Saved::Response(saved),
        })) = store.get(&key).await
        else {
            panic!("a finished record is saved: the lease was kept");
        };
        assert_eq!(fingerprint, [1; 32]);
        assert_eq!(saved.status, StatusCode::BAD_GATEWAY);
        let doc: serde_json::Value = serde_json::from_slice(&saved.body).expect("JSON");
        assert_eq!(doc["type"], "urn:idemproxy:problem:result-not-kept");
        assert!(doc["detail"].as_str().is_some_and(|d| d.contains("201")));
        let text = metrics.encode();
        assert!(text.contains(r#"idemproxy_lost_leases_total{route="r"} 0"#));
        assert!(text.contains(r#"idemproxy_results_not_kept_total{route="r"} 1"#));
        assert!(text.contains(r#"idemproxy_saves_abandoned_total{route="r"} 0"#));
    }

    fn lease(store: StoreHandle, metrics: &Metrics) -> Lease {
        let held = Held::new(Record::InFlight {
            token: new_token(),
            fingerprint: [1; 32],
        });
        Lease::new(
            store,
            metrics.route("r"),
            "r".into(),
            StoreKey::new("p:r:".into(), 0, [2; 32]),
            held,
            Duration::from_secs(10),
            Instant::now(),
        )
    }

    #[tokio::test]
    async fn a_refused_save_whose_confirming_read_fails_is_not_counted_as_a_lost_lease() {
        let metrics = Arc::new(Metrics::new());
        let store = StoreHandle::new(
            Arc::new(ReadsFail(MemoryStore::new(10))),
            Duration::from_secs(1),
            metrics.clone(),
        );
        let done = Record::Done {
            fingerprint: [1; 32],
            saved: Saved::NotReplayable {
                status: http::StatusCode::OK,
            },
        };
        let pending = Arc::new(PendingCompletions::new(
            10,
            1024,
            Default::default(),
            Default::default(),
        ));
        lease(store.clone(), &metrics)
            .complete(done, Duration::from_secs(1), &TaskTracker::new(), &pending)
            .await;
        assert!(
            metrics
                .encode()
                .contains(r#"idemproxy_lost_leases_total{route="r"} 0"#),
            "unknown, not lost"
        );
    }

    #[tokio::test]
    async fn a_refused_save_whose_key_holds_another_record_is_a_lost_lease() {
        let metrics = Arc::new(Metrics::new());
        let memory = MemoryStore::new(10);
        let store = StoreHandle::new(Arc::new(memory), Duration::from_secs(1), metrics.clone());
        // Never claimed: the compare-and-set misses and the key holds nothing of ours.
        let done = Record::Done {
            fingerprint: [1; 32],
            saved: Saved::NotReplayable {
                status: http::StatusCode::OK,
            },
        };
        let pending = Arc::new(PendingCompletions::new(
            10,
            1024,
            Default::default(),
            Default::default(),
        ));
        lease(store, &metrics)
            .complete(done, Duration::from_secs(1), &TaskTracker::new(), &pending)
            .await;
        assert!(
            metrics
                .encode()
                .contains(r#"idemproxy_lost_leases_total{route="r"} 1"#)
        );
    }
}
