//! Unit tests of the memory store, on paused time.

use super::sweep::{PURGE_AT_BOUND_EVERY, SWEEP_EVERY};
use super::*;
use crate::metrics::Metrics;
use crate::record::{Record, Saved, new_token};
use crate::store::{Claim, StoreHandle};
use http::StatusCode;

fn store(max_entries: u64) -> (StoreHandle, Arc<MemoryStore>) {
    let memory = Arc::new(MemoryStore::new(max_entries));
    let handle = StoreHandle::new(
        memory.clone(),
        Duration::from_secs(1),
        Arc::new(Metrics::new()),
    );
    (handle, memory)
}

/// Keys `n` land in different shards for different `n`.
fn k(n: u8) -> StoreKey {
    let mut id = [n; 32];
    id[0] = n;
    StoreKey::new("test:r:".into(), 0, id)
}

fn held(fp: u8) -> Held {
    Held::new(Record::InFlight {
        token: new_token(),
        fingerprint: [fp; 32],
    })
}

fn done(fp: u8) -> Record {
    Record::Finished {
        fingerprint: [fp; 32],
        saved: Saved::NotReplayable {
            status: StatusCode::OK,
        },
    }
}

#[tokio::test(start_paused = true)]
async fn claim_is_exclusive_and_expires() {
    let (s, _) = store(10);
    let a = held(1);
    let b = held(1);
    let lease = Duration::from_secs(1);
    assert_eq!(s.claim(&k(1), &a, lease).await.ok(), Some(Claim::Claimed));
    assert_eq!(
        s.claim(&k(1), &b, lease).await.ok(),
        Some(Claim::Existing(a.record.clone()))
    );
    tokio::time::advance(Duration::from_millis(1001)).await;
    // a's lease expired: b may claim, and a may no longer complete.
    assert_eq!(s.claim(&k(1), &b, lease).await.ok(), Some(Claim::Claimed));
    let d = done(1).encode();
    assert_eq!(s.save(&k(1), &a, &d, lease).await.ok(), Some(false));
    assert_eq!(s.renew(&k(1), &a, lease).await.ok(), Some(false));
    assert_eq!(s.release(&k(1), &a).await.ok(), Some(false));
    assert_eq!(s.save(&k(1), &b, &d, lease).await.ok(), Some(true));
    assert_eq!(s.get(&k(1)).await.ok(), Some(Some(done(1))));
}

#[tokio::test(start_paused = true)]
async fn routes_namespace_the_same_id() {
    let (s, _) = store(10);
    let lease = Duration::from_secs(1);
    let other_route = StoreKey::new("test:r2:".into(), 1, *k(1).id());
    assert_eq!(
        s.claim(&k(1), &held(1), lease).await.ok(),
        Some(Claim::Claimed)
    );
    assert_eq!(
        s.claim(&other_route, &held(1), lease).await.ok(),
        Some(Claim::Claimed)
    );
}

#[tokio::test(start_paused = true)]
async fn renew_extends_the_lease() {
    let (s, _) = store(10);
    let a = held(1);
    let lease = Duration::from_secs(1);
    assert_eq!(s.claim(&k(1), &a, lease).await.ok(), Some(Claim::Claimed));
    for _ in 0..5 {
        tokio::time::advance(Duration::from_millis(500)).await;
        assert_eq!(s.renew(&k(1), &a, lease).await.ok(), Some(true));
    }
    assert!(matches!(
        s.claim(&k(1), &held(1), lease).await,
        Ok(Claim::Existing(_))
    ));
}

#[tokio::test(start_paused = true)]
async fn full_store_refuses_new_claims_and_never_evicts() {
    let (s, memory) = store(2);
    let lease = Duration::from_secs(10);
    assert!(s.claim(&k(1), &held(1), lease).await.is_ok());
    assert!(s.claim(&k(2), &held(1), lease).await.is_ok());
    assert!(matches!(
        s.claim(&k(3), &held(1), lease).await,
        Err(StoreError::Full(2))
    ));
    assert!(s.get(&k(1)).await.ok().flatten().is_some());
    // Nobody but the holder can release a claim.
    let a = held(1);
    assert!(s.release(&k(1), &held(1)).await.is_ok_and(|r| !r));
    tokio::time::advance(Duration::from_secs(11)).await;
    // Once records expire, there is room again, whatever the sweeper has done so far.
    assert_eq!(s.claim(&k(3), &a, lease).await.ok(), Some(Claim::Claimed));
    assert_eq!(memory.len(), 1);
    assert!(s.release(&k(3), &a).await.is_ok_and(|r| r));
    assert!(memory.is_empty());
}

#[tokio::test(start_paused = true)]
async fn the_sweeper_reclaims_expired_records() {
    let (s, memory) = store(1000);
    let lease = Duration::from_millis(100);
    for n in 0..200u8 {
        assert!(s.claim(&k(n), &held(1), lease).await.is_ok());
    }
    assert_eq!(memory.len(), 200);
    tokio::time::sleep(SWEEP_EVERY * 2).await;
    assert_eq!(memory.len(), 0, "every expired record was swept");
}

#[tokio::test(start_paused = true)]
async fn a_ttl_beyond_any_clock_means_forever_not_a_panic() {
    let (s, _) = store(10);
    let a = held(1);
    assert!(s.claim(&k(1), &a, Duration::MAX).await.is_ok());
    assert_eq!(s.renew(&k(1), &a, Duration::MAX).await.ok(), Some(true));
    let d = done(1).encode();
    assert_eq!(s.save(&k(1), &a, &d, Duration::MAX).await.ok(), Some(true));
    tokio::time::advance(Duration::from_secs(86_400 * 365)).await;
    assert_eq!(s.get(&k(1)).await.ok(), Some(Some(done(1))));
}

#[tokio::test(start_paused = true)]
async fn a_saved_record_is_one_compact_copy() {
    let (s, memory) = store(10);
    let a = held(1);
    assert!(s.claim(&k(1), &a, Duration::from_secs(1)).await.is_ok());
    // A record encoded into a much larger buffer: the store keeps only its own bytes.
    let d = done(1).encode();
    let mut big = bytes::BytesMut::with_capacity(64 * 1024);
    big.extend_from_slice(&d);
    let big = big.freeze();
    assert!(
        s.save(&k(1), &a, &big, Duration::from_secs(1))
            .await
            .is_ok()
    );
    let shard = memory.inner.shard(&MapKey::of(&k(1)));
    let slot = shard.map.get(&MapKey::of(&k(1))).expect("the record");
    assert_eq!(slot.record.len(), d.len());
}

#[tokio::test(start_paused = true)]
async fn waiters_wake_on_completion() {
    let (s, _) = store(10);
    let a = held(1);
    let lease = Duration::from_secs(10);
    assert!(s.claim(&k(1), &a, lease).await.is_ok());
    let s2 = s.clone();
    let waiter = tokio::spawn(async move {
        let start = Instant::now();
        s2.wait_change(&k(1), Duration::from_secs(5)).await;
        start.elapsed()
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let d = done(1).encode();
    assert_eq!(s.save(&k(1), &a, &d, lease).await.ok(), Some(true));
    let waited = waiter.await.expect("waiter");
    assert!(
        waited < Duration::from_secs(1),
        "woken at once, not at the deadline"
    );
}

/// Key `n` of many: byte 0 spreads them over the shards, byte 1 tells apart those that share
/// one.
fn many(n: u16) -> StoreKey {
    let [low, high] = n.to_le_bytes();
    let mut id = [0xA5; 32];
    id[0] = low;
    id[1] = high;
    StoreKey::new("test:r:".into(), 0, id)
}

fn full_purges(memory: &MemoryStore) -> u64 {
    memory.inner.full_purges.load(Ordering::Relaxed)
}

/// A flood of new keys against a store full of live records: every claim is refused, and
/// none of them scans every shard again (each scan locks all 64 shards and visits every
/// record, so one per refused claim costs O(max_entries) each).
#[tokio::test(start_paused = true)]
async fn refused_claims_at_the_bound_do_not_each_scan_the_store() {
    let (s, memory) = store(64);
    let lease = Duration::from_secs(60);
    for n in 0..64 {
        assert!(s.claim(&many(n), &held(1), lease).await.is_ok());
    }
    for n in 64..1064 {
        assert!(matches!(
            s.claim(&many(n), &held(1), lease).await,
            Err(StoreError::Full(64))
        ));
        // Time passes, but no record comes near its end.
        tokio::time::advance(Duration::from_millis(5)).await;
    }
    assert!(
        full_purges(&memory) <= 1,
        "1000 refused claims ran {} full purges",
        full_purges(&memory)
    );
    assert_eq!(memory.len(), 64, "nothing was evicted");
}

/// A full store whose records lapse takes claims again within the purge interval, without a
/// purge per refused claim in between; a live record is never evicted.
#[tokio::test(start_paused = true)]
async fn a_full_store_takes_claims_again_soon_after_records_lapse() {
    let (s, memory) = store(64);
    let long = Duration::from_secs(100);
    for n in 0..62 {
        assert!(s.claim(&many(n), &held(1), long).await.is_ok());
    }
    // Two claims that lapse between two passes of the sweeper (it runs at 0s, 1s, 2s…).
    assert!(
        s.claim(&many(62), &held(1), Duration::from_millis(1300))
            .await
            .is_ok()
    );
    assert!(
        s.claim(&many(63), &held(1), Duration::from_millis(1350))
            .await
            .is_ok()
    );
    for n in 100..600 {
        assert!(s.claim(&many(n), &held(1), long).await.is_err());
    }
    assert_eq!(full_purges(&memory), 0, "nothing had lapsed: no purge");

    // `sleep`, not `advance`: the sweeper's pass at 1s runs to its end (nothing lapsed then).
    tokio::time::sleep(Duration::from_millis(1310)).await;
    assert_eq!(
        memory.len(),
        64,
        "the sweeper found nothing to reclaim at 1s"
    );
    assert_eq!(
        s.claim(&many(1000), &held(1), long).await.ok(),
        Some(Claim::Claimed),
        "one record lapsed: room again at once"
    );
    assert_eq!(full_purges(&memory), 1);

    // The other lapses: within the purge interval, claims may be refused, but none scans.
    tokio::time::sleep(Duration::from_millis(50)).await;
    for n in 1001..1500 {
        assert!(matches!(
            s.claim(&many(n), &held(1), long).await,
            Err(StoreError::Full(64))
        ));
    }
    assert_eq!(full_purges(&memory), 1, "at most one purge per interval");
    tokio::time::sleep(PURGE_AT_BOUND_EVERY).await;
    assert_eq!(
        s.claim(&many(1500), &held(1), long).await.ok(),
        Some(Claim::Claimed),
        "room again once the interval is over"
    );
    assert_eq!(full_purges(&memory), 2);
    for n in 0..62 {
        assert!(
            s.get(&many(n)).await.ok().flatten().is_some(),
            "live record {n} kept"
        );
    }
}
