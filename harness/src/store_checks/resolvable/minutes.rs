//! The contract of a claim that can be resolved over leases and lifetimes of minutes, run on
//! every store whose clock a test can move (memory: Tokio's paused clock; SQLite: its clock
//! moved ahead; [`Capabilities`](crate::store_checks::Capabilities)). Every store runs the
//! same steps on real time, with short leases, in [`super`].

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use idemproxy::record::{Finished, Phase, Record, Resolvable, Saved, SavedResponse};
use idemproxy::store::{
    Claim, Forgotten, Held, ResolvableClaim, ResolvableTimes, StoreHandle, StoreKey,
};

use super::{new_token, resolvable_of};
use crate::store_checks::{Subject, forget, key};

const LEASE: Duration = Duration::from_secs(10);
const MARGIN: Duration = Duration::from_secs(2);

fn times(lifetime: Duration) -> ResolvableTimes {
    ResolvableTimes {
        lease: LEASE,
        send_margin: MARGIN,
        lifetime,
    }
}

fn found(fp: u8) -> Finished {
    Finished::new(
        [fp; 32],
        Saved::Resolved(SavedResponse {
            status: StatusCode::OK,
            headers: vec![],
            body: Bytes::from_static(b"{\"id\":\"bk_1\"}"),
        }),
    )
}

fn stamped(claim: &ResolvableClaim) -> (&Held, u64) {
    match claim {
        ResolvableClaim::Claimed { held, now } | ResolvableClaim::TakenOver { held, now, .. } => {
            (held, *now)
        }
        ResolvableClaim::Existing(r) => panic!("expected a claim, found {r:?}"),
    }
}

async fn get_resolvable(s: &StoreHandle, key: &StoreKey) -> Resolvable {
    match s.get(key).await.expect("get") {
        Some(Record::Resolvable(r)) => *r,
        other => panic!("expected a resolvable claim, found {other:?}"),
    }
}

/// Claim, conflict, renewal, takeover after the lease, fencing of the old holder, resolving,
/// save with a found response.
async fn claim_takeover_and_save<F, Fut>(s: &StoreHandle, key: &StoreKey, advance: F)
where
    F: Fn(Duration) -> Fut,
    Fut: Future<Output = ()>,
{
    let give_up = Duration::from_secs(600);
    let lifetime = give_up + Duration::from_secs(3600);
    let a = resolvable_of(1, give_up);
    let claim = s
        .claim_resolvable(key, &a, times(lifetime))
        .await
        .expect("claim");
    assert!(
        matches!(claim, ResolvableClaim::Claimed { .. }),
        "{claim:?}"
    );
    let (a, now) = stamped(&claim);
    let a = a.clone();
    let r = a.resolvable().expect("resolvable").clone();
    assert_eq!(r.claimed_at, now);
    assert_eq!(r.lease_until, now + 10_000);
    assert_eq!(
        r.sent_at,
        now + 2_000,
        "sent at the latest the connect timeout after"
    );
    assert_eq!(r.phase, Phase::InFlight);
    assert_eq!(
        get_resolvable(s, key).await,
        r,
        "the store keeps what it answered"
    );

    let b = resolvable_of(1, give_up);
    live_claim_is_left_alone(s, key, &b, &r, lifetime).await;

    // Renewing moves the lease only.
    advance(Duration::from_secs(5)).await;
    assert!(s.renew(key, &a, LEASE).await.expect("renew"));
    let renewed = get_resolvable(s, key).await;
    assert!(renewed.lease_until >= r.lease_until + 5_000);
    assert_eq!(
        (renewed.claimed_at, renewed.sent_at),
        (r.claimed_at, r.sent_at)
    );
    assert!(!s.renew(key, &b, LEASE).await.expect("renew"), "not b's");

    // The holder dies: past its lease, the next claim takes the resolution over.
    advance(LEASE + Duration::from_millis(100)).await;
    let claim = s
        .claim_resolvable(key, &b, times(lifetime))
        .await
        .expect("takeover");
    let ResolvableClaim::TakenOver { gave_up, .. } = &claim else {
        panic!("expected a takeover, got {claim:?}");
    };
    assert!(!gave_up);
    let (b, now) = stamped(&claim);
    let b = b.clone();
    let taken = b.resolvable().expect("resolvable").clone();
    assert_eq!(taken.token, b_token(&b));
    assert_ne!(taken.token, r.token);
    assert_eq!(taken.phase, Phase::Resolving);
    assert_eq!(taken.next_lookup_at, now, "the next lookup at once");
    assert_eq!(taken.lease_until, now + 10_000);
    assert_eq!(
        (
            taken.claimed_at,
            taken.sent_at,
            &taken.lookup,
            taken.fingerprint
        ),
        (r.claimed_at, r.sent_at, &r.lookup, r.fingerprint),
        "the first holder's times and lookup are kept"
    );
    // A third claim now finds b's live claim.
    let c = resolvable_of(1, give_up);
    assert!(matches!(
        s.claim_resolvable(key, &c, times(lifetime)).await,
        Ok(ResolvableClaim::Existing(Record::Resolvable(_)))
    ));

    fenced_then_resolved(s, key, &a, &b).await;
}

/// After a takeover: the old holder `a` is fenced off everywhere; the new holder `b` resolves
/// and saves a found response.
async fn fenced_then_resolved(s: &StoreHandle, key: &StoreKey, a: &Held, b: &Held) {
    assert!(!s.renew(key, a, LEASE).await.expect("renew"));
    assert_eq!(
        s.resolving(key, a, Duration::from_secs(5), LEASE)
            .await
            .expect("resolving"),
        None
    );
    assert!(
        !s.save(key, a, &found(1), Duration::from_secs(60))
            .await
            .expect("complete")
    );
    assert!(!s.release(key, a).await.expect("release"));

    // The new holder resolves: its next lookup recorded, then the found response saved.
    let at = s
        .resolving(key, b, Duration::from_secs(5), LEASE)
        .await
        .expect("resolving")
        .expect("held");
    let resolving = get_resolvable(s, key).await;
    assert_eq!(resolving.phase, Phase::Resolving);
    assert_eq!(resolving.next_lookup_at, at + 5_000);
    assert_eq!(resolving.lease_until, at + 10_000);
    let done = found(1);
    assert!(
        s.save(key, b, &done, Duration::from_secs(60))
            .await
            .expect("complete")
    );
    assert_eq!(s.get(key).await.expect("get").as_ref(), Some(done.record()));
    // Sent again after its answer was lost: done already.
    assert!(
        s.save(key, b, &done, Duration::from_secs(60))
            .await
            .expect("complete")
    );
}

/// While the lease is live, another resolvable claim finds the claim untouched, and a plain
/// claim never takes a resolvable claim over.
async fn live_claim_is_left_alone(
    s: &StoreHandle,
    key: &StoreKey,
    b: &Held,
    r: &Resolvable,
    lifetime: Duration,
) {
    match s.claim_resolvable(key, b, times(lifetime)).await {
        Ok(ResolvableClaim::Existing(Record::Resolvable(found))) => assert_eq!(*found, *r),
        other => panic!("expected the live claim, got {other:?}"),
    }
    let plain = Held::new(Record::InFlight {
        token: new_token(),
        fingerprint: [1; 32],
    });
    assert!(matches!(
        s.claim(key, &plain, LEASE).await,
        Ok(Claim::Existing(Record::Resolvable(_)))
    ));
}

fn b_token(held: &Held) -> [u8; 16] {
    held.resolvable().expect("a claim").token
}

/// The key outlives the lease until `lifetime` after the send, then is gone; a takeover
/// past `give_up_after` says so.
async fn lifetime_and_give_up<F, Fut>(s: &StoreHandle, key: &StoreKey, advance: F)
where
    F: Fn(Duration) -> Fut,
    Fut: Future<Output = ()>,
{
    let give_up = Duration::from_secs(30);
    let lifetime = give_up + Duration::from_secs(60);
    let a = resolvable_of(2, give_up);
    let claim = s
        .claim_resolvable(key, &a, times(lifetime))
        .await
        .expect("claim");
    assert!(matches!(claim, ResolvableClaim::Claimed { .. }));
    // Long past the lease, before give_up_after: the record is there to take over.
    advance(Duration::from_secs(20)).await;
    assert!(matches!(
        s.get(key).await.expect("get"),
        Some(Record::Resolvable(_))
    ));
    // Past give_up_after (sent_at + 30 s): the takeover says to give up at once.
    advance(Duration::from_secs(15)).await;
    let b = resolvable_of(2, give_up);
    match s.claim_resolvable(key, &b, times(lifetime)).await {
        Ok(ResolvableClaim::TakenOver { gave_up: true, .. }) => {}
        other => panic!("expected a takeover past give_up_after, got {other:?}"),
    }
    // Renewing never shortens the lifetime: a short lease renewed leaves it as it was.
    assert!(
        s.renew(key, &b, Duration::from_millis(10))
            .await
            .expect("renew")
    );
    // 2 s margin + 90 s lifetime from the claim; 35 s have passed.
    advance(Duration::from_secs(55)).await;
    assert!(
        s.get(key).await.expect("get").is_some(),
        "lives until the send plus its lifetime"
    );
    advance(Duration::from_secs(3)).await;
    assert_eq!(
        s.get(key).await.expect("get"),
        None,
        "gone after its lifetime"
    );
    // Then the key is free: a new claim is a fresh one.
    let c = resolvable_of(2, give_up);
    assert!(matches!(
        s.claim_resolvable(key, &c, times(lifetime)).await,
        Ok(ResolvableClaim::Claimed { .. })
    ));
}

/// A fresh claim given up before anything was sent is released, its lease lapsed or not (a
/// claim answered too late); a takeover fences the first holder's release off.
async fn release_is_fenced<F, Fut>(subject: &Subject, s: &StoreHandle, key: &StoreKey, advance: F)
where
    F: Fn(Duration) -> Fut,
    Fut: Future<Output = ()>,
{
    let give_up = Duration::from_secs(600);
    let lifetime = give_up * 2;
    let a = resolvable_of(3, give_up);
    let claim = s
        .claim_resolvable(key, &a, times(lifetime))
        .await
        .expect("claim");
    let (a, _) = stamped(&claim);
    let a = a.clone();
    assert!(s.release(key, &a).await.expect("release"));
    assert_eq!(s.get(key).await.expect("get"), None);
    assert!(
        s.release(key, &a).await.expect("release again"),
        "gone: free"
    );

    let b = resolvable_of(3, give_up);
    let claim = s
        .claim_resolvable(key, &b, times(lifetime))
        .await
        .expect("claim");
    let (b, _) = stamped(&claim);
    let b = b.clone();
    advance(LEASE + Duration::from_millis(100)).await;
    assert!(
        s.release(key, &b).await.expect("release"),
        "the token still holds it: nobody took it over"
    );
    assert_eq!(s.get(key).await.expect("get"), None);

    let c = resolvable_of(3, give_up);
    let claim = s
        .claim_resolvable(key, &c, times(lifetime))
        .await
        .expect("claim");
    let (c, _) = stamped(&claim);
    let c = c.clone();
    advance(LEASE + Duration::from_millis(100)).await;
    let d = resolvable_of(3, give_up);
    assert!(matches!(
        s.claim_resolvable(key, &d, times(lifetime)).await,
        Ok(ResolvableClaim::TakenOver { .. })
    ));
    assert!(!s.release(key, &c).await.expect("release"), "taken over");
    assert!(matches!(
        s.get(key).await.expect("get"),
        Some(Record::Resolvable(_))
    ));
    // keys forget refuses it, as any claim in flight.
    assert_eq!(forget(&subject.raw, key).await, Forgotten::InFlight);
}

/// Claim, conflict, renewal, takeover after the lease, fencing of the old holder, resolving,
/// save with a found response ([`claim_takeover_and_save`]).
pub async fn a_resolvable_claim_is_taken_over_after_its_lease_and_fences_its_first_holder(
    subject: &Subject,
) {
    let advance = |d| subject.clock.pass(d);
    claim_takeover_and_save(&subject.handle(), &key(0x21), advance).await;
}

/// The key outlives the lease until its lifetime, and a late takeover gives up
/// ([`lifetime_and_give_up`]).
pub async fn a_resolvable_claim_lives_its_lifetime_whatever_its_lease(subject: &Subject) {
    let advance = |d| subject.clock.pass(d);
    lifetime_and_give_up(&subject.handle(), &key(0x22), advance).await;
}

/// A fresh claim is released by its holder, a takeover fences the first holder's release off
/// ([`release_is_fenced`]).
pub async fn a_resolvable_claim_is_released_only_while_its_lease_holds(subject: &Subject) {
    let advance = |d| subject.clock.pass(d);
    release_is_fenced(subject, &subject.handle(), &key(0x23), advance).await;
}
