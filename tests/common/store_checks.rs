//! Checks of the store contract that run the same on every store (memory, Redis, Redis Cluster).

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderName, StatusCode};
use idemproxy::record::{Record, Saved, SavedResponse};
use idemproxy::store::{Claim, Held, StoreHandle, StoreKey};

/// A finished record: a 201 JSON response with `body`.
pub(crate) fn done(fingerprint: [u8; 32], body: &'static str) -> Record {
    Record::Done {
        fingerprint,
        saved: Saved::Response(SavedResponse {
            status: StatusCode::CREATED,
            headers: vec![(
                HeaderName::from_static("content-type"),
                http::HeaderValue::from_static("application/json"),
            )],
            body: Bytes::from_static(body.as_bytes()),
        }),
    }
}

/// The compare-and-set on the token (SPEC §4.4): A's lease expires, B claims the key; from then
/// on nothing A does (complete, renew, release) touches the key, and B's record stands.
pub(crate) async fn stale_holder_cannot_overwrite_a_newer_holder(store: &StoreHandle) {
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
    let deadline = Instant::now() + Duration::from_secs(3);
    while store.get(key).await.expect("get").is_some() {
        assert!(Instant::now() < deadline, "A's lease did not expire");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
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
            .complete(key, &a, &from_a.encode(), long)
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
            .complete(key, &b, &from_b.encode(), long)
            .await
            .expect("B completes")
    );
    assert!(
        store
            .complete(key, &b, &from_b.encode(), long)
            .await
            .expect("B's completion sent twice"),
        "a completion sent again after it landed counts as done"
    );
    assert!(
        !store
            .complete(key, &a, &from_a.encode(), long)
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
