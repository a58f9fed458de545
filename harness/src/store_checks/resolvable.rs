//! A claim that can be resolved (`on_unknown_outcome: resolve`), on every store, on real time:
//! its times on the store's clock, its lifetime apart from its lease, the takeover of a lapsed
//! lease by exactly one of many claims at once, the first holder fenced off after it, and a
//! claim sent again that finds its own. [`minutes`]: the same claim over leases and lifetimes
//! of minutes, where the store's clock can be moved.

use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Method, StatusCode};
use idemproxy::record::{Finished, Held, Lookup, Phase, Record, Resolvable, Saved, SavedResponse};
use idemproxy::store::{Forgotten, ResolvableClaim, ResolvableTimes, Store, StoreHandle, StoreKey};

use super::{Subject, handle};

mod minutes;
pub use minutes::{
    a_resolvable_claim_is_released_only_while_its_lease_holds,
    a_resolvable_claim_is_taken_over_after_its_lease_and_fences_its_first_holder,
    a_resolvable_claim_lives_its_lifetime_whatever_its_lease,
};

/// Short, so the tests wait little for a lease to lapse; far longer than a store call.
pub const LEASE: Duration = Duration::from_millis(400);

/// Key `n` of route `create-booking` (route number 0).
pub fn key(n: u8) -> StoreKey {
    StoreKey::new(
        idemproxy::key::namespace("idemproxy:", "create-booking"),
        0,
        [n; 32],
    )
}

/// A lease of [`LEASE`], the send margin and lifetime given.
pub fn times(send_margin: Duration, lifetime: Duration) -> ResolvableTimes {
    ResolvableTimes {
        lease: LEASE,
        send_margin,
        lifetime,
    }
}

/// A token no other claim of this test binary has (two bytes of a counter: every store's
/// checks draw from it at once, more than 256 claims in a run).
pub fn new_token() -> [u8; 16] {
    static NEXT: AtomicU16 = AtomicU16::new(1);
    let mut token = [0xA5; 16];
    token[..2].copy_from_slice(&NEXT.fetch_add(1, Ordering::Relaxed).to_be_bytes());
    token
}

/// A new resolvable claim (fingerprint 5) of a lookup with a header.
pub fn resolvable(give_up_after: Duration) -> Held {
    resolvable_of(5, give_up_after)
}

/// A new resolvable claim of a request whose fingerprint is `[fp; 32]`, its lookup with a
/// header.
pub fn resolvable_of(fp: u8, give_up_after: Duration) -> Held {
    Held::new(Record::Resolvable(Box::new(Resolvable::claim(
        new_token(),
        [fp; 32],
        Lookup {
            upstream: "booking".into(),
            method: Method::GET,
            target: "/bookings/by-reference/r-1".into(),
            headers: vec![(
                HeaderName::from_static("authorization"),
                HeaderValue::from_static("Bearer secret"),
            )],
        },
        Duration::from_secs(60),
        Duration::from_secs(5),
        give_up_after,
    ))))
}

/// What a resolution found for [`resolvable`]'s request.
pub fn found() -> Finished {
    Finished::new(
        [5; 32],
        Saved::Resolved(SavedResponse {
            status: StatusCode::OK,
            headers: vec![],
            body: Bytes::from_static(b"{\"id\":\"bk_1\"}"),
        }),
    )
}

/// The claim a claim answered with, and the store's clock then.
pub fn ours(claim: ResolvableClaim) -> (Held, u64) {
    match claim {
        ResolvableClaim::Claimed { held, now } | ResolvableClaim::TakenOver { held, now, .. } => {
            (held, now)
        }
        ResolvableClaim::Existing(r) => panic!("expected a claim, found {r:?}"),
    }
}

/// The claim `held` holds, as the store stamped it.
pub fn stamped(held: &Held) -> &Resolvable {
    held.resolvable().expect("a resolvable claim")
}

/// Waits until the lease of the claim under `key` has lapsed on the store's clock (bounded).
pub async fn until_lapsed(s: &StoreHandle, key: &StoreKey, held: &Held) {
    let lease_until = stamped(held).lease_until;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let now = s.now(key).await.expect("the store's clock");
        if now > lease_until {
            return;
        }
        assert!(Instant::now() < deadline, "the lease did not lapse");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The store stamps a new claim on its own clock; sent again, a claim finds its own and is
/// still a claim (never a takeover); after a lapse, eight claims at once, from two instances
/// on a shared store, take it over exactly once; the first holder is then fenced off, and the
/// new one resolves and completes.
pub async fn a_lapsed_claim_is_taken_over_by_exactly_one_of_many(subject: &Subject) {
    let s = subject.handle();
    let k = key(1);
    let margin = Duration::from_millis(250);
    let lifetime = Duration::from_secs(60);
    let a = resolvable(Duration::from_secs(30));
    let (a, now) = ours(
        s.claim_resolvable(&k, &a, times(margin, lifetime))
            .await
            .expect("claim"),
    );
    let r = stamped(&a).clone();
    assert_eq!((r.claimed_at, r.phase), (now, Phase::InFlight));
    assert_eq!(r.sent_at, now + 250, "sent at the latest the margin after");
    assert_eq!(r.lease_until, now + 400);
    // Sent again (its answer lost): the key holds our own claim, which is still ours to send.
    match s.claim_resolvable(&k, &a, times(margin, lifetime)).await {
        Ok(ResolvableClaim::Claimed { held, .. }) => assert_eq!(stamped(&held).token, r.token),
        other => panic!("a claim sent again is a claim, got {other:?}"),
    }

    until_lapsed(&s, &k, &a).await;
    // Two instances on one store, where a store is shared (not memory; SQLite takes one
    // process): the claims alternate between this store and a second one of its own.
    let second = subject.another().await.map(Arc::new);
    let s = Arc::new(s);
    let claims: Vec<_> = (0..8)
        .map(|i| {
            let s = match &second {
                Some(other) if i % 2 == 1 => other.clone(),
                _ => s.clone(),
            };
            let k = k.clone();
            tokio::spawn(async move {
                let b = resolvable(Duration::from_secs(30));
                s.claim_resolvable(&k, &b, times(margin, lifetime)).await
            })
        })
        .collect();
    let mut taken = Vec::new();
    for claim in claims {
        match claim.await.expect("claim task").expect("claim") {
            ResolvableClaim::TakenOver { held, gave_up, .. } => {
                assert!(!gave_up);
                taken.push(held);
            }
            ResolvableClaim::Existing(Record::Resolvable(_)) => {}
            other => panic!("expected a takeover or the claim taken over, got {other:?}"),
        }
    }
    assert_eq!(
        taken.len(),
        1,
        "exactly one claim takes the resolution over"
    );
    let b = taken.remove(0);
    let t = stamped(&b).clone();
    assert_eq!(t.phase, Phase::Resolving);
    assert_eq!(
        (t.claimed_at, t.sent_at, &t.lookup),
        (r.claimed_at, r.sent_at, &r.lookup)
    );
    // A takeover sent again finds its own claim resolving: still a takeover, never a claim to
    // send.
    assert!(matches!(
        s.claim_resolvable(&k, &b, times(margin, lifetime)).await,
        Ok(ResolvableClaim::TakenOver { .. })
    ));

    // The first holder is fenced off.
    assert!(!s.renew(&k, &a, LEASE).await.expect("renew"));
    let next = Duration::from_secs(5);
    assert_eq!(
        s.resolving(&k, &a, next, LEASE).await.expect("resolving"),
        None
    );
    let done = found();
    let ttl = Duration::from_secs(60);
    assert!(!s.save(&k, &a, &done, ttl).await.expect("complete"));
    assert!(!s.release(&k, &a).await.expect("release"));

    let at = s
        .resolving(&k, &b, next, LEASE)
        .await
        .expect("resolving")
        .expect("held");
    match s.get(&k).await.expect("get") {
        Some(Record::Resolvable(now)) => {
            assert_eq!(now.phase, Phase::Resolving);
            assert_eq!(now.next_lookup_at, at + 5_000);
        }
        other => panic!("expected the claim resolving, got {other:?}"),
    }
    assert!(s.save(&k, &b, &done, ttl).await.expect("complete"));
    assert!(s.save(&k, &b, &done, ttl).await.expect("sent again"));
    assert_eq!(s.get(&k).await.expect("get").as_ref(), Some(done.record()));
}

/// The key outlives its lease until its lifetime after the send, and renewing never shortens
/// that; a takeover past `give_up_after` says so; then the key is gone and free.
pub async fn a_claim_lives_its_lifetime_whatever_its_lease(subject: &Subject) {
    let raw: Arc<dyn Store> = subject.raw.clone();
    let s = handle(raw.clone());
    let k = key(2);
    let lifetime = Duration::from_millis(2500);
    let give_up = Duration::from_millis(600);
    let a = resolvable(give_up);
    let (a, _) = ours(
        s.claim_resolvable(&k, &a, times(Duration::ZERO, lifetime))
            .await
            .expect("claim"),
    );
    let (_, ttl) = raw.inspect(&k).await.expect("inspect").expect("held");
    assert!(
        ttl > Duration::from_millis(1500),
        "lives its lifetime: {ttl:?}"
    );
    assert!(
        s.renew(&k, &a, Duration::from_millis(1))
            .await
            .expect("renew")
    );
    let (_, renewed) = raw.inspect(&k).await.expect("inspect").expect("held");
    assert!(
        renewed > Duration::from_millis(1500),
        "a short renewal never shortens the lifetime: {renewed:?}"
    );
    // Past the lease and past give_up_after, well within the lifetime.
    subject.clock.pass(Duration::from_millis(800)).await;
    let b = resolvable(give_up);
    match s
        .claim_resolvable(&k, &b, times(Duration::ZERO, lifetime))
        .await
    {
        Ok(ResolvableClaim::TakenOver { gave_up: true, .. }) => {}
        other => panic!("expected a takeover past give_up_after, got {other:?}"),
    }
    assert_eq!(raw.forget(&k).await.expect("forget"), Forgotten::InFlight);
    let deadline = Instant::now() + Duration::from_secs(6);
    while s.get(&k).await.expect("get").is_some() {
        assert!(Instant::now() < deadline, "the claim outlived its lifetime");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let c = resolvable(give_up);
    assert!(matches!(
        s.claim_resolvable(&k, &c, times(Duration::ZERO, lifetime))
            .await,
        Ok(ResolvableClaim::Claimed { .. })
    ));
}

/// A fresh claim is released by its holder; a found response saved for it can be forgotten
/// like any finished record.
pub async fn a_claim_is_released_and_a_resolved_record_forgotten(subject: &Subject) {
    let raw: Arc<dyn Store> = subject.raw.clone();
    let s = handle(raw.clone());
    let k = key(3);
    let lifetime = Duration::from_secs(60);
    let a = resolvable(Duration::from_secs(30));
    let (a, _) = ours(
        s.claim_resolvable(&k, &a, times(Duration::ZERO, lifetime))
            .await
            .expect("claim"),
    );
    assert!(s.release(&k, &a).await.expect("release"));
    assert_eq!(s.get(&k).await.expect("get"), None);
    let b = resolvable(Duration::from_secs(30));
    let (b, _) = ours(
        s.claim_resolvable(&k, &b, times(Duration::ZERO, lifetime))
            .await
            .expect("claim"),
    );
    let done = found();
    assert!(s.save(&k, &b, &done, lifetime).await.expect("complete"));
    assert_eq!(raw.forget(&k).await.expect("forget"), Forgotten::Forgotten);
    assert_eq!(s.get(&k).await.expect("get"), None);
}

/// A claim an earlier proxy wrote (format version 2, its `sent_at` the claim plus the
/// upstream's `connect_timeout`) is still taken over, once its lease lapses, and read as
/// counting from the claim plus the taker's upstream `timeout`; the store keeps its bytes as
/// they were (only the token, the lease and the phase change).
pub async fn a_version_2_claim_is_taken_over_and_counts_from_the_timeout(subject: &Subject) {
    let s = subject.handle();
    let k = key(5);
    let old = {
        let mut r = stamped(&resolvable(Duration::from_secs(30))).clone();
        r.legacy = true;
        Held::new(Record::Resolvable(Box::new(r)))
    };
    assert_eq!(&old.encoded[..5], b"IDP\x02Q", "written as version 2");
    let connect = Duration::from_millis(250);
    let (old, _) = ours(
        s.claim_resolvable(&k, &old, times(connect, Duration::from_secs(60)))
            .await
            .expect("claim"),
    );
    let claimed_at = stamped(&old).claimed_at;
    assert_eq!(
        stamped(&old).sent_at,
        claimed_at + 250,
        "stamped as an earlier proxy did"
    );
    until_lapsed(&s, &k, &old).await;
    let timeout = Duration::from_secs(2);
    let taker = resolvable(Duration::from_secs(30));
    let taken = s
        .claim_resolvable(&k, &taker, times(timeout, Duration::from_secs(60)))
        .await
        .expect("takeover");
    let ResolvableClaim::TakenOver { held, gave_up, .. } = taken else {
        panic!("expected a takeover, got {taken:?}");
    };
    let r = stamped(&held);
    assert!(r.legacy && !gave_up);
    assert_eq!(r.token, stamped(&taker).token);
    assert_eq!(r.phase, Phase::Resolving);
    assert_eq!(
        r.sent_at,
        claimed_at + 2000,
        "counted from the claim plus the timeout, not the connect_timeout"
    );
    assert_eq!(r.settles_at(), claimed_at + 2000 + 60_000);
    assert_eq!(
        &held.encoded[..5],
        b"IDP\x02Q",
        "its bytes kept as they were"
    );
    // Its new holder completes it.
    assert!(
        s.save(&k, &held, &found(), Duration::from_secs(60))
            .await
            .expect("complete")
    );
}
