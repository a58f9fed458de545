//! What each store writes, read back with the proxy's own decoder: every record kind and every
//! transition of a claim that can be resolved, whether the store stamps the bytes in Rust
//! (memory, SQLite), in Lua (Redis) or in SQL (PostgreSQL). The positions those scripts and
//! statements patch come from `record::layout`; this is where a wrong one shows.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Method, StatusCode};
use idemproxy::record::{Finished, Lookup, Phase, Record, Resolvable, Saved, SavedResponse};
use idemproxy::store::{Held, ResolvableClaim, ResolvableTimes, Store, StoreKey};

use super::{LONG, Subject, done, handle, key};

/// The record under `key`, as the store holds it, decoded.
async fn stored(raw: &Arc<dyn Store>, key: &StoreKey) -> Record {
    let (bytes, _) = raw
        .inspect(key)
        .await
        .expect("inspect")
        .expect("a record under the key");
    Record::decode(&bytes).unwrap_or_else(|e| panic!("what the store wrote decodes: {e}"))
}

/// The claim as the store holds it.
async fn stored_claim(raw: &Arc<dyn Store>, key: &StoreKey) -> Resolvable {
    match stored(raw, key).await {
        Record::Resolvable(r) => *r,
        other => panic!("a resolvable claim was expected, found {other:?}"),
    }
}

/// A resolvable claim with token `token`, a lookup with a header, statuses of its own.
fn resolvable(token: u8) -> Held {
    Held::new(Record::Resolvable(Box::new(Resolvable::claim(
        [token; 16],
        [9; 32],
        Lookup {
            upstream: "booking".into(),
            method: Method::GET,
            target: "/bookings/by-reference/r-9?x=1".into(),
            headers: vec![(
                HeaderName::from_static("authorization"),
                HeaderValue::from_static("Bearer lookup"),
            )],
        },
        Duration::from_secs(61),
        Duration::from_secs(7),
        Duration::from_secs(601),
    ))))
}

/// Every record kind and transition, written by the store, decodes to what was meant.
pub async fn what_each_transition_writes_decodes(subject: &Subject) {
    let raw = subject.raw.clone();
    let s = handle(raw.clone());

    // A claim in flight, then its finished record.
    let k = key(0xB1);
    let plain = Held::new(Record::InFlight {
        token: [0x31; 16],
        fingerprint: [3; 32],
    });
    s.claim(&k, &plain, LONG).await.expect("claim");
    assert_eq!(stored(&raw, &k).await, plain.record);
    let finished = Finished::new([3; 32], {
        let Record::Finished { saved, .. } = done([3; 32], "{\"id\":1}") else {
            unreachable!("done() is a finished record")
        };
        saved
    });
    assert!(s.save(&k, &plain, &finished, LONG).await.expect("save"));
    assert_eq!(&stored(&raw, &k).await, finished.record());

    // A resolvable claim: stamped by the store on its clock.
    let k = key(0xB2);
    let lease = Duration::from_millis(300);
    let times = ResolvableTimes {
        lease,
        send_margin: Duration::from_secs(2),
        lifetime: Duration::from_secs(60),
    };
    let a = resolvable(0x41);
    let (a, now) = match s.claim_resolvable(&k, &a, times).await.expect("claim") {
        ResolvableClaim::Claimed { held, now } => (held, now),
        other => panic!("expected a claim, got {other:?}"),
    };
    let claimed = stored_claim(&raw, &k).await;
    assert_eq!(claimed.token, [0x41; 16]);
    assert_eq!(claimed.phase, Phase::InFlight);
    assert_eq!(claimed.claimed_at, now);
    assert_eq!(claimed.lease_until, now + 300);
    assert_eq!(claimed.sent_at, now + 2_000);
    assert_eq!(claimed.next_lookup_at, 0);
    let Record::Resolvable(meant) = &a.record else {
        unreachable!("claimed as resolvable")
    };
    assert_eq!(
        claimed.lookup, meant.lookup,
        "the lookup survives the stamp"
    );
    assert_eq!(claimed.fingerprint, [9; 32]);
    assert_eq!(
        (
            claimed.settle_after,
            claimed.interval,
            claimed.give_up_after
        ),
        (
            Duration::from_secs(61),
            Duration::from_secs(7),
            Duration::from_secs(601)
        )
    );

    // Renewed: the lease only.
    assert!(s.renew(&k, &a, lease).await.expect("renew"));
    let renewed = stored_claim(&raw, &k).await;
    assert!(renewed.lease_until >= claimed.lease_until);
    assert_eq!(renewed.phase, Phase::InFlight);
    assert_eq!(
        (renewed.claimed_at, renewed.sent_at, renewed.lookup.clone()),
        (claimed.claimed_at, claimed.sent_at, claimed.lookup.clone())
    );

    // Resolving: the lease, the phase, the next lookup.
    let at = s
        .resolving(&k, &a, Duration::from_secs(3), lease)
        .await
        .expect("resolving")
        .expect("still held");
    let resolving = stored_claim(&raw, &k).await;
    assert_eq!(resolving.phase, Phase::Resolving);
    assert_eq!(resolving.next_lookup_at, at + 3_000);
    assert_eq!(resolving.lease_until, at + 300);
    assert_eq!(resolving.sent_at, claimed.sent_at);

    // Taken over once the lease lapsed: the new token, lease and next lookup; the rest kept.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let b = resolvable(0x42);
    let (b, took_at) = loop {
        match s.claim_resolvable(&k, &b, times).await.expect("claim") {
            ResolvableClaim::TakenOver { held, now, .. } => break (held, now),
            ResolvableClaim::Existing(_) => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the lease did not lapse"
                );
                subject.clock.pass(Duration::from_millis(50)).await;
            }
            other => panic!("expected a takeover, got {other:?}"),
        }
    };
    let taken = stored_claim(&raw, &k).await;
    assert_eq!(taken.token, [0x42; 16]);
    assert_eq!(taken.phase, Phase::Resolving);
    assert_eq!(taken.lease_until, took_at + 300);
    assert_eq!(taken.next_lookup_at, took_at);
    assert_eq!(
        (taken.claimed_at, taken.sent_at, taken.lookup.clone()),
        (claimed.claimed_at, claimed.sent_at, claimed.lookup.clone())
    );

    // Finished with what the resolution found.
    let found = Finished::new(
        [9; 32],
        Saved::Resolved(SavedResponse {
            status: StatusCode::OK,
            headers: vec![],
            body: Bytes::from_static(b"{\"id\":\"bk_9\"}"),
        }),
    );
    assert!(s.save(&k, &b, &found, LONG).await.expect("save"));
    assert_eq!(&stored(&raw, &k).await, found.record());
}
