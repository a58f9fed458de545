use super::*;
use crate::metrics::Metrics;
use crate::record::{Record, Saved, new_token};
use crate::store::memory::MemoryStore;
use crate::store::{Store, StoreError, Wrap};
use async_trait::async_trait;
use bytes::Bytes;
use http::StatusCode;

/// A store whose compare-and-set always misses and whose reads fail: the lease cannot tell
/// whether it was lost.
struct ReadsFail(MemoryStore);

#[async_trait]
impl Wrap for ReadsFail {
    fn inner(&self) -> &dyn Store {
        &self.0
    }
    async fn renew(&self, _: &StoreKey, _: &Held, _: Duration) -> Result<bool, StoreError> {
        Ok(false)
    }
    async fn save(
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
}

/// The memory store, refusing every save while `refuse` is set (Redis out of memory:
/// renewals still work).
struct RefusesSaves {
    inner: MemoryStore,
    refuse: std::sync::atomic::AtomicBool,
}

#[async_trait]
impl Wrap for RefusesSaves {
    fn inner(&self) -> &dyn Store {
        &self.inner
    }
    async fn save(
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
        self.inner.save(key, held, done, ttl).await
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
    let done = Finished::new(
        [1; 32],
        Saved::Response(crate::record::SavedResponse {
            status: StatusCode::CREATED,
            headers: vec![],
            body: Bytes::from(vec![b'x'; 1000]),
        }),
    );
    let pending = Arc::new(PendingSaves::new(
        10,
        100,
        Default::default(),
        Default::default(),
    ));
    let tasks = TaskTracker::new();
    lease
        .save(done, Duration::from_secs(60), &tasks, &pending)
        .await;
    tokio::time::sleep(lock_ttl * 3).await;
    refusing
        .refuse
        .store(false, std::sync::atomic::Ordering::SeqCst);
    tasks.close();
    tokio::time::timeout(Duration::from_secs(5), tasks.wait())
        .await
        .expect("the background save ends once the store takes it");

    let Ok(Some(Record::Finished {
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

/// The memory store behind a far link: every renewal takes effect at once but is answered
/// `delay` later (what is slow is the way back, as from a far database).
struct SlowRenewals {
    inner: MemoryStore,
    delay: Duration,
}

#[async_trait]
impl Wrap for SlowRenewals {
    fn inner(&self) -> &dyn Store {
        &self.inner
    }
    async fn renew(
        &self,
        key: &StoreKey,
        held: &Held,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let renewed = self.inner.renew(key, held, lease).await;
        tokio::time::sleep(self.delay).await;
        renewed
    }
}

/// `lock_ttl: 600ms` on a store whose answers come 450 ms late, the claim's too: a call of
/// 2 s keeps its lease to the end (a claim of the key at 1.3 s finds it in flight), and the
/// renewals answered with less than a third of the lease left are counted as late.
#[tokio::test(start_paused = true)]
async fn a_lease_on_a_store_that_answers_late_never_lapses() {
    let metrics = Arc::new(Metrics::new());
    let delay = Duration::from_millis(450);
    let slow = Arc::new(SlowRenewals {
        inner: MemoryStore::new(10),
        delay,
    });
    let store = StoreHandle::new(slow, Duration::from_millis(590), metrics.clone());
    let lock_ttl = Duration::from_millis(600);
    let key = StoreKey::new("p:r:".into(), 0, [3; 32]);
    let held = |token| {
        Held::new(Record::InFlight {
            token: [token; 16],
            fingerprint: [1; 32],
        })
    };
    let claimed_at = Instant::now();
    assert!(matches!(
        store.claim(&key, &held(1), lock_ttl).await,
        Ok(crate::store::Claim::Claimed)
    ));
    // The claim's own answer comes late too.
    tokio::time::sleep(delay).await;
    let mut lease = Lease::new(
        store.clone(),
        metrics.route("r"),
        "r".into(),
        key.clone(),
        held(1),
        lock_ttl,
        claimed_at,
    );
    let duplicate = async {
        tokio::time::sleep_until(claimed_at + Duration::from_millis(1300)).await;
        store.claim(&key, &held(2), lock_ttl).await
    };
    let ((), duplicate) = tokio::join!(
        lease.renewing(tokio::time::sleep_until(
            claimed_at + Duration::from_secs(2)
        )),
        duplicate
    );
    assert!(
        matches!(duplicate, Ok(crate::store::Claim::Existing(Record::InFlight { token, .. })) if token == [1; 16]),
        "the first still holds the key: {duplicate:?}"
    );
    assert!(!lease.lost);
    let text = metrics.encode();
    assert!(text.contains(r#"idemproxy_lost_leases_total{route="r"} 0"#));
    let late: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix(r#"idemproxy_lease_renewals_late_total{route="r"} "#))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!(late >= 1, "late renewals: {late}\n{text}");
}

#[test]
fn renewals_are_due_a_third_of_the_lease_after_the_last_send_or_earlier_on_a_slow_store() {
    let ms = Duration::from_millis;
    let t0 = Instant::now();
    let lock_ttl = ms(600);
    // A quick store: a third of the lease after the last send.
    assert_eq!(
        renewal_due(lock_ttl, t0 + lock_ttl, t0, ms(1)),
        t0 + ms(200)
    );
    // Round trips of 220 ms: sent while the lease has twice that left.
    assert_eq!(
        renewal_due(lock_ttl, t0 + lock_ttl, t0, ms(220)),
        t0 + ms(160)
    );
    // Round trips longer than the lease allows: as soon as a sixth of it has passed since
    // the last send, never sooner.
    assert_eq!(
        renewal_due(lock_ttl, t0 + lock_ttl, t0, ms(450)),
        t0 + ms(100)
    );
    assert_eq!(
        renewal_due(lock_ttl, t0 + ms(1050), t0 + ms(550), ms(450)),
        t0 + ms(650)
    );
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
    let done = Finished::new(
        [1; 32],
        Saved::NotReplayable {
            status: http::StatusCode::OK,
        },
    );
    let pending = Arc::new(PendingSaves::new(
        10,
        1024,
        Default::default(),
        Default::default(),
    ));
    lease(store.clone(), &metrics)
        .save(done, Duration::from_secs(1), &TaskTracker::new(), &pending)
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
    let done = Finished::new(
        [1; 32],
        Saved::NotReplayable {
            status: http::StatusCode::OK,
        },
    );
    let pending = Arc::new(PendingSaves::new(
        10,
        1024,
        Default::default(),
        Default::default(),
    ));
    lease(store, &metrics)
        .save(done, Duration::from_secs(1), &TaskTracker::new(), &pending)
        .await;
    assert!(
        metrics
            .encode()
            .contains(r#"idemproxy_lost_leases_total{route="r"} 1"#)
    );
}
