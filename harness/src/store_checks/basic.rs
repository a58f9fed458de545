//! The checks of the plain claim (SPEC §4.4): exclusive, fenced by its token, renewed,
//! released, completed once; `inspect`, `forget` and `wait_change`; records small and large.
//! Each runs on every store, on real time: leases are short and waits for one to lapse poll.

use std::time::{Duration, Instant};

use bytes::Bytes;
use idemproxy::record::Record;
use idemproxy::store::{Claim, Forgotten, Held, StoreError, StoreHandle, StoreKey};

use super::{
    DEADLINE, LONG, Subject, claim, done, done_with, forget, handle, inspect, key, large,
    until_absent,
};

/// The compare-and-set on the token (SPEC §4.4): A's lease expires, B claims the key; from then
/// on nothing A does (complete, renew, release) touches the key, and B's record stands.
pub async fn stale_holder_cannot_overwrite_a_newer_holder(store: &StoreHandle) {
    let key = &StoreKey::new(
        idemproxy::key::namespace("idemproxy:", "create-booking"),
        0,
        [9; 32],
    );
    let fp = [7u8; 32];
    let a = Held::new(Record::InFlight {
        token: [1; 16],
        fingerprint: fp,
    });
    let b = Held::new(Record::InFlight {
        token: [2; 16],
        fingerprint: fp,
    });
    let long = Duration::from_secs(30);

    assert_eq!(
        store
            .claim(key, &a, Duration::from_millis(200))
            .await
            .expect("A claims"),
        Claim::Claimed
    );
    assert_eq!(
        store.claim(key, &b, long).await.expect("B tries"),
        Claim::Existing(a.record.clone()),
        "while A's lease runs, B sees A's claim"
    );

    // A stalls and does not renew: its lease runs out.
    until_absent(store, key, "A's lease").await;
    assert!(
        !store.renew(key, &a, long).await.expect("renew"),
        "an expired lease cannot be renewed"
    );

    assert_eq!(
        store.claim(key, &b, long).await.expect("B claims"),
        Claim::Claimed
    );
    let from_a = done(fp, r#"{"id":"from A"}"#);
    let from_b = done(fp, r#"{"id":"from B"}"#);
    assert!(
        !store
            .save(key, &a, &from_a.encode(), long)
            .await
            .expect("A completes"),
        "A's save must not land"
    );
    assert!(!store.renew(key, &a, long).await.expect("A renews"));
    assert!(!store.release(key, &a).await.expect("A releases"));
    assert_eq!(
        store.get(key).await.expect("get"),
        Some(b.record.clone()),
        "B's claim is untouched"
    );

    assert!(
        store
            .save(key, &b, &from_b.encode(), long)
            .await
            .expect("B completes")
    );
    assert!(
        store
            .save(key, &b, &from_b.encode(), long)
            .await
            .expect("B's completion sent twice"),
        "a completion sent again after it landed counts as done"
    );
    assert!(
        !store
            .save(key, &a, &from_a.encode(), long)
            .await
            .expect("A completes late")
    );
    assert!(!store.release(key, &a).await.expect("A releases late"));
    assert!(
        !store.release(key, &b).await.expect("B releases after"),
        "a finished record is not a claim: nobody may release it"
    );
    assert_eq!(store.get(key).await.expect("get"), Some(from_b));
}

/// A claim takes a free key once: another's later claim reads the claim; a finished record is
/// then what every claim reads, and it is no claim any more (nobody renews it). Keys of another
/// route or another hash are apart.
pub async fn a_claim_is_exclusive_and_a_finished_record_is_what_claims_read(subject: &Subject) {
    let raw = subject.raw.clone();
    let store = handle(raw);
    store.ping().await.expect("the store answers");
    let (a, b) = (claim(1), claim(2));
    assert_eq!(store.get(&key(1)).await.expect("get"), None, "fresh store");
    assert_eq!(
        store.claim(&key(1), &a, LONG).await.expect("A claims"),
        Claim::Claimed
    );
    // (The holder's own claim sent again is left out: Redis answers it `Claimed`, as a claim
    // resent after its answer was lost must be; the memory store reads it as anyone's.)
    assert_eq!(
        store.claim(&key(1), &b, LONG).await.expect("B claims"),
        Claim::Existing(a.record.clone()),
        "B reads A's claim"
    );
    assert_eq!(
        store.get(&key(1)).await.expect("get"),
        Some(a.record.clone())
    );

    // Apart: the same hash on another route, another hash on this route.
    let other_route = StoreKey::new(idemproxy::key::namespace("idemproxy:", "pay"), 1, [1; 32]);
    for (what, k) in [("another route", &other_route), ("another hash", &key(2))] {
        assert_eq!(
            store.claim(k, &b, LONG).await.expect("claim"),
            Claim::Claimed,
            "{what} is another key"
        );
    }

    let finished = done([7; 32], r#"{"id":"bk_1"}"#);
    assert!(
        store
            .save(&key(1), &a, &finished.encode(), LONG)
            .await
            .expect("A completes")
    );
    assert_eq!(
        store.claim(&key(1), &b, LONG).await.expect("B claims"),
        Claim::Existing(finished.clone()),
        "a claim reads the finished record"
    );
    assert!(
        !store.renew(&key(1), &a, LONG).await.expect("A renews"),
        "a finished record is no claim: nothing to renew"
    );
    assert_eq!(store.get(&key(1)).await.expect("get"), Some(finished));
    assert_eq!(
        store.get(&other_route).await.expect("get"),
        Some(b.record.clone()),
        "the other route's claim is untouched"
    );
}

/// A key whose repeats the store has just answered (a finished record read by claims, the
/// durable stores' hint for a read first) is still decided by what is stored: once its record
/// has expired, or while another holds it after that, a claim takes it or reads that claim,
/// never the expired record.
pub async fn a_repeated_key_is_free_once_its_record_expires(subject: &Subject) {
    let raw = subject.raw.clone();
    let store = handle(raw);
    let (a, b, c) = (claim(1), claim(2), claim(3));
    let ttl = Duration::from_millis(400);
    assert_eq!(
        store.claim(&key(5), &a, LONG).await.expect("A claims"),
        Claim::Claimed
    );
    let finished = done([7; 32], r#"{"id":"bk_5"}"#);
    assert!(
        store
            .save(&key(5), &a, &finished.encode(), ttl)
            .await
            .expect("A completes")
    );
    for _ in 0..3 {
        assert_eq!(
            store.claim(&key(5), &b, LONG).await.expect("B repeats"),
            Claim::Existing(finished.clone()),
            "a repeat reads the finished record"
        );
    }
    subject.clock.pass(ttl + Duration::from_millis(200)).await;
    assert_eq!(
        store.claim(&key(5), &b, LONG).await.expect("B claims"),
        Claim::Claimed,
        "the record expired: the key is free"
    );
    assert_eq!(
        store.claim(&key(5), &c, LONG).await.expect("C claims"),
        Claim::Existing(b.record.clone()),
        "C reads B's claim, not the expired record"
    );
}

/// Many claims of one free key at once: exactly one takes it, every other reads that one's
/// claim. The claim is one atomic step, never a read and then a write.
pub async fn one_of_many_concurrent_claims_takes_the_key(subject: &Subject) {
    let raw = subject.raw.clone();
    let store = handle(raw);
    let claims: Vec<_> = (1..=24u8)
        .map(|t| {
            let store = store.clone();
            tokio::spawn(async move {
                let held = claim(t);
                let found = store.claim(&key(3), &held, LONG).await;
                (held, found)
            })
        })
        .collect();
    let mut winners = Vec::new();
    let mut seen = Vec::new();
    for c in claims {
        let (held, found) = c.await.expect("a claim task");
        match found.expect("a claim answers") {
            Claim::Claimed => winners.push(held.record),
            Claim::Existing(record) => seen.push(record),
        }
    }
    assert_eq!(winners.len(), 1, "exactly one claim takes the key");
    assert!(
        seen.iter().all(|r| *r == winners[0]),
        "every other claim reads the winner's claim: {seen:?}"
    );
    assert_eq!(
        store.get(&key(3)).await.expect("get"),
        Some(winners[0].clone())
    );
}

/// Renewals keep a claim well past its first lease; once they stop, it lapses, and the key is
/// anyone's. A renewal sets the lease anew (`inspect` shows it).
pub async fn renewal_keeps_a_claim_and_its_end_frees_the_key(subject: &Subject) {
    let raw = subject.raw.clone();
    let store = handle(raw.clone());
    let (a, b) = (claim(1), claim(2));
    let lease = Duration::from_millis(400);
    assert_eq!(
        store.claim(&key(4), &a, lease).await.expect("A claims"),
        Claim::Claimed
    );
    let start = Instant::now();
    while start.elapsed() < lease * 3 {
        subject.clock.pass(Duration::from_millis(100)).await;
        assert!(
            store.renew(&key(4), &a, lease).await.expect("A renews"),
            "the holder renews its live claim"
        );
    }
    assert_eq!(
        store.claim(&key(4), &b, LONG).await.expect("B tries"),
        Claim::Existing(a.record.clone()),
        "three leases later, the renewed claim still stands"
    );
    assert!(store.renew(&key(4), &a, LONG).await.expect("A renews long"));
    let (_, ttl) = inspect(&raw, &key(4)).await.expect("the claim");
    assert!(
        ttl > LONG - Duration::from_secs(5) && ttl <= LONG,
        "a renewal sets the lease anew: {ttl:?} left of {LONG:?}"
    );
    assert!(
        store
            .renew(&key(4), &a, lease)
            .await
            .expect("A renews short")
    );
    until_absent(&store, &key(4), "the unrenewed claim").await;
    assert_eq!(
        store.claim(&key(4), &b, LONG).await.expect("B claims"),
        Claim::Claimed
    );
}

/// A lapsed claim is fenced off even while nobody has taken the key: its holder can neither
/// renew nor complete it (nothing is written), and releasing it answers that the key is free.
pub async fn a_lapsed_claim_can_neither_renew_nor_complete(subject: &Subject) {
    let raw = subject.raw.clone();
    let store = handle(raw);
    let a = claim(1);
    assert_eq!(
        store
            .claim(&key(5), &a, Duration::from_millis(200))
            .await
            .expect("A claims"),
        Claim::Claimed
    );
    until_absent(&store, &key(5), "A's lease").await;
    assert!(!store.renew(&key(5), &a, LONG).await.expect("A renews"));
    let finished = done([7; 32], r#"{"id":"late"}"#);
    assert!(
        !store
            .save(&key(5), &a, &finished.encode(), LONG)
            .await
            .expect("A completes"),
        "a lapsed lease never completes"
    );
    assert_eq!(
        store.get(&key(5)).await.expect("get"),
        None,
        "nothing was written"
    );
    assert!(
        store.release(&key(5), &a).await.expect("A releases"),
        "a lapsed claim nobody took: the key is free of it"
    );
    assert_eq!(
        store
            .claim(&key(5), &claim(2), LONG)
            .await
            .expect("B claims"),
        Claim::Claimed
    );
}

/// Only the holder releases its claim; a release sent again finds the key free; another
/// holder's claim and a finished record are left alone.
pub async fn release_frees_only_the_holders_claim(subject: &Subject) {
    let raw = subject.raw.clone();
    let store = handle(raw);
    let (a, b) = (claim(1), claim(2));
    assert_eq!(
        store.claim(&key(6), &a, LONG).await.expect("A claims"),
        Claim::Claimed
    );
    assert!(
        !store.release(&key(6), &b).await.expect("B releases"),
        "another token's release fails"
    );
    assert_eq!(
        store.get(&key(6)).await.expect("get"),
        Some(a.record.clone())
    );
    assert!(store.release(&key(6), &a).await.expect("A releases"));
    assert_eq!(
        store.get(&key(6)).await.expect("get"),
        None,
        "the key is free"
    );
    assert!(
        store.release(&key(6), &a).await.expect("A releases again"),
        "a release sent again after its answer was lost: the key is free of it"
    );
    assert_eq!(
        store.claim(&key(6), &b, LONG).await.expect("B claims"),
        Claim::Claimed
    );
    assert!(
        !store.release(&key(6), &a).await.expect("A releases B's"),
        "B's claim is not A's to release"
    );
    let finished = done([7; 32], r#"{"id":"by B"}"#);
    assert!(
        store
            .save(&key(6), &b, &finished.encode(), LONG)
            .await
            .expect("B completes")
    );
    for (who, held) in [("A", &a), ("B", &b)] {
        assert!(
            !store.release(&key(6), held).await.expect("a release"),
            "{who}: a finished record is no claim to release"
        );
    }
    assert_eq!(store.get(&key(6)).await.expect("get"), Some(finished));
}

/// A save sent again counts as done only when the key holds exactly what it sends: a
/// second, different save is refused and changes nothing.
pub async fn only_the_same_completion_counts_twice(subject: &Subject) {
    let raw = subject.raw.clone();
    let store = handle(raw);
    let a = claim(1);
    assert_eq!(
        store.claim(&key(7), &a, LONG).await.expect("A claims"),
        Claim::Claimed
    );
    let first = done([7; 32], r#"{"id":"first"}"#);
    let other = done([7; 32], r#"{"id":"other"}"#);
    assert!(
        store
            .save(&key(7), &a, &first.encode(), LONG)
            .await
            .expect("A completes")
    );
    assert!(
        store
            .save(&key(7), &a, &first.encode(), LONG)
            .await
            .expect("again"),
        "the same completion again counts as done"
    );
    assert!(
        !store
            .save(&key(7), &a, &other.encode(), LONG)
            .await
            .expect("another completion"),
        "another completion does not"
    );
    assert_eq!(store.get(&key(7)).await.expect("get"), Some(first));
}

/// `inspect` (key tooling) reads a record and its remaining time to live: the lease while in
/// flight, the TTL once finished; nothing for an absent key.
pub async fn inspect_shows_the_remaining_time_to_live(subject: &Subject) {
    let raw = subject.raw.clone();
    let store = handle(raw.clone());
    assert!(inspect(&raw, &key(8)).await.is_none(), "absent");
    let a = claim(1);
    let lease = Duration::from_secs(10);
    assert_eq!(
        store.claim(&key(8), &a, lease).await.expect("A claims"),
        Claim::Claimed
    );
    let (record, ttl) = inspect(&raw, &key(8)).await.expect("the claim");
    assert_eq!(record, a.record);
    assert!(
        ttl > lease - Duration::from_secs(5) && ttl <= lease,
        "in flight: the lease's {ttl:?} left of {lease:?}"
    );
    let hour = Duration::from_secs(3600);
    let finished = done([7; 32], r#"{"id":"bk"}"#);
    assert!(
        store
            .save(&key(8), &a, &finished.encode(), hour)
            .await
            .expect("A completes")
    );
    let (record, ttl) = inspect(&raw, &key(8)).await.expect("the record");
    assert_eq!(record, finished);
    assert!(
        ttl > hour - Duration::from_secs(10) && ttl <= hour,
        "finished: the TTL's {ttl:?} left of {hour:?}"
    );
}

/// `forget` (key tooling) deletes a finished record only: an in-flight claim stays (its holder
/// may be alive), bytes that are not a finished record of this proxy stay, and an absent key
/// says so. A forgotten key is free.
pub async fn forget_deletes_only_a_finished_record(subject: &Subject) {
    let raw = subject.raw.clone();
    let store = handle(raw.clone());
    assert_eq!(forget(&raw, &key(9)).await, Forgotten::Absent);

    let a = claim(1);
    assert_eq!(
        store.claim(&key(9), &a, LONG).await.expect("A claims"),
        Claim::Claimed
    );
    assert_eq!(forget(&raw, &key(9)).await, Forgotten::InFlight);
    assert_eq!(
        store.get(&key(9)).await.expect("get"),
        Some(a.record.clone()),
        "the claim stays"
    );
    let finished = done([7; 32], r#"{"id":"bk"}"#);
    assert!(
        store
            .save(&key(9), &a, &finished.encode(), LONG)
            .await
            .expect("A completes")
    );
    assert_eq!(forget(&raw, &key(9)).await, Forgotten::Forgotten);
    assert_eq!(store.get(&key(9)).await.expect("get"), None, "forgotten");
    assert_eq!(
        store
            .claim(&key(9), &claim(2), LONG)
            .await
            .expect("B claims"),
        Claim::Claimed,
        "a forgotten key is free"
    );

    // Bytes that decode as no record (written as a save, as a corrupted save would be):
    // a store error when read, and never forgotten.
    let c = claim(3);
    assert_eq!(
        store.claim(&key(10), &c, LONG).await.expect("C claims"),
        Claim::Claimed
    );
    let garbage = Bytes::from_static(b"\x00\xffnot a record");
    assert!(
        store
            .save(&key(10), &c, &garbage, LONG)
            .await
            .expect("C completes")
    );
    assert!(
        matches!(store.get(&key(10)).await, Err(StoreError::Corrupt(_))),
        "an undecodable record is a store error"
    );
    assert_eq!(forget(&raw, &key(10)).await, Forgotten::NotARecord);
    let left = tokio::time::timeout(DEADLINE, raw.get(&key(10)))
        .await
        .expect("get within the deadline")
        .expect("get");
    assert_eq!(left, Some(garbage), "left alone");
}

/// A record of several MiB (a large saved response) is kept and read back byte for byte.
pub async fn a_record_of_several_mib_round_trips(subject: &Subject) {
    let raw = subject.raw.clone();
    let store = handle(raw);
    let a = claim(1);
    assert_eq!(
        store.claim(&key(11), &a, LONG).await.expect("A claims"),
        Claim::Claimed
    );
    let body: Bytes = (0..4 * 1024 * 1024u32)
        .map(|i| (i % 251) as u8)
        .collect::<Vec<u8>>()
        .into();
    let big = done_with([7; 32], body);
    assert!(
        store
            .save(&key(11), &a, &big.encode(), LONG)
            .await
            .expect("A completes with 4 MiB")
    );
    assert_eq!(
        store
            .claim(&key(11), &claim(2), LONG)
            .await
            .expect("B claims"),
        Claim::Existing(big),
        "read back whole"
    );
}

/// A large record is fenced exactly like a small one (SPEC §4.4): a holder whose lease lapsed
/// writes nothing, whether the key is free or a newer holder has it; the newer holder's large
/// record lands, counts as done when sent again, is never replaced by another record of the
/// same length, and reads back byte for byte with its TTL.
pub async fn a_large_record_is_fenced_like_a_small_one(subject: &Subject) {
    let raw = subject.raw.clone();
    let store = handle(raw.clone());
    let (a, b) = (claim(1), claim(2));
    let (from_a, from_b, other_b) = (large(b'a'), large(b'b'), large(b'c'));
    assert_eq!(
        store
            .claim(&key(13), &a, Duration::from_millis(200))
            .await
            .expect("A claims"),
        Claim::Claimed
    );
    until_absent(&store, &key(13), "A's lease").await;
    assert!(
        !store
            .save(&key(13), &a, &from_a.encode(), LONG)
            .await
            .expect("A completes after its lease"),
        "a lapsed lease never completes"
    );
    assert_eq!(
        store.get(&key(13)).await.expect("get"),
        None,
        "nothing was written"
    );

    assert_eq!(
        store.claim(&key(13), &b, LONG).await.expect("B claims"),
        Claim::Claimed
    );
    assert!(
        !store
            .save(&key(13), &a, &from_a.encode(), LONG)
            .await
            .expect("A completes over B's claim"),
        "A's large save must not land"
    );
    assert_eq!(
        store.get(&key(13)).await.expect("get"),
        Some(b.record.clone()),
        "B's claim is untouched"
    );

    assert!(
        store
            .save(&key(13), &b, &from_b.encode(), LONG)
            .await
            .expect("B completes")
    );
    assert!(
        store
            .save(&key(13), &b, &from_b.encode(), LONG)
            .await
            .expect("B's completion sent again"),
        "the same large completion again counts as done"
    );
    for (what, held, record) in [("A, late", &a, &from_a), ("B, another", &b, &other_b)] {
        assert!(
            !store
                .save(&key(13), held, &record.encode(), LONG)
                .await
                .expect("a completion"),
            "{what}: a record of the same length is another record"
        );
    }
    assert_eq!(
        store
            .claim(&key(13), &claim(3), LONG)
            .await
            .expect("C claims"),
        Claim::Existing(from_b.clone()),
        "B's record is what every claim reads, byte for byte"
    );
    let (record, ttl) = inspect(&raw, &key(13)).await.expect("the record");
    assert_eq!(record, from_b);
    assert!(
        ttl > LONG - Duration::from_secs(10) && ttl <= LONG,
        "the record's TTL: {ttl:?} left of {LONG:?}"
    );
}

/// `wait_change` returns by its bound at the latest, whether or not the key changes.
pub async fn wait_change_returns_by_its_bound(subject: &Subject) {
    let raw = subject.raw.clone();
    let store = handle(raw.clone());
    let a = claim(1);
    assert_eq!(
        store.claim(&key(12), &a, LONG).await.expect("A claims"),
        Claim::Claimed
    );
    let max = Duration::from_millis(300);
    let start = Instant::now();
    raw.wait_change(&key(12), max).await;
    let waited = start.elapsed();
    assert!(
        waited < max + Duration::from_secs(2),
        "nothing changed: back after its bound ({waited:?} for {max:?})"
    );
    let finished = done([7; 32], r#"{"id":"bk"}"#);
    let completer = {
        let store = store.clone();
        let a = a.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            store.save(&key(12), &a, &finished.encode(), LONG).await
        })
    };
    let start = Instant::now();
    raw.wait_change(&key(12), max).await;
    assert!(start.elapsed() < max + Duration::from_secs(2));
    assert!(completer.await.expect("completer").expect("A completes"));
}
