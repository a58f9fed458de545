//! Unit tests of the record encoding.

use super::*;
use http::Method;

fn done() -> Record {
    Record::Finished {
        fingerprint: [7; 32],
        saved: Saved::Response(SavedResponse {
            status: StatusCode::CREATED,
            headers: vec![
                (
                    HeaderName::from_static("content-type"),
                    HeaderValue::from_static("application/json"),
                ),
                (
                    HeaderName::from_static("x-a"),
                    HeaderValue::from_static("1"),
                ),
                (
                    HeaderName::from_static("x-a"),
                    HeaderValue::from_static("2"),
                ),
            ],
            body: Bytes::from_static(b"{\"id\":\"bk_1\"}\x00\xff"),
        }),
    }
}

#[test]
fn round_trips() {
    for e in [
        done(),
        Record::InFlight {
            token: [1; 16],
            fingerprint: [2; 32],
        },
        Record::Finished {
            fingerprint: [3; 32],
            saved: Saved::NotReplayable {
                status: StatusCode::OK,
            },
        },
    ] {
        assert_eq!(Record::decode(&e.encode()), Ok(e));
    }
}

#[test]
fn damage_is_detected() {
    let bytes = done().encode();
    for cut in 0..bytes.len() {
        assert!(Record::decode(&bytes[..cut]).is_err(), "cut at {cut}");
    }
    let mut extra = bytes.to_vec();
    extra.push(0);
    assert!(Record::decode(&extra).is_err());
    let mut v4 = bytes.to_vec();
    v4[3] = 4;
    assert_eq!(
        Record::decode(&v4),
        Err(DecodeError("unknown record format version"))
    );
    assert!(Record::decode(b"garbage").is_err());
}

fn resolvable() -> Resolvable {
    let mut r = Resolvable::claim(
        [9; 16],
        [8; 32],
        Lookup {
            upstream: "booking".into(),
            method: Method::GET,
            target: "/bookings/by-reference/r%201?x=1".into(),
            headers: vec![(
                HeaderName::from_static("authorization"),
                HeaderValue::from_static("Bearer secret"),
            )],
        },
        Duration::from_secs(60),
        Duration::from_secs(5),
        Duration::from_secs(600),
    )
    .answered_by(&[200, 201], &[404]);
    r.lease_until = 1_764_656_010_123;
    r.claimed_at = 1_764_656_000_123;
    r.sent_at = 1_764_656_002_123;
    r.phase = Phase::Resolving;
    r.next_lookup_at = 1_764_656_005_000;
    r
}

fn resolved() -> Record {
    Record::Finished {
        fingerprint: [4; 32],
        saved: Saved::Resolved(SavedResponse {
            status: StatusCode::OK,
            headers: vec![(
                HeaderName::from_static("content-type"),
                HeaderValue::from_static("application/json"),
            )],
            body: Bytes::from_static(b"{\"id\":\"bk_1\"}"),
        }),
    }
}

#[test]
fn version_2_round_trips_and_version_1_is_unchanged() {
    for (e, version) in [
        (Record::Resolvable(Box::new(resolvable())), 3),
        (resolved(), 2),
    ] {
        let bytes = e.encode();
        assert_eq!(bytes[3], version, "{e:?}");
        assert_eq!(Record::decode(&bytes), Ok(e));
    }
    // Every other record is still written as version 1, as before.
    let v1 = done().encode();
    assert_eq!(&v1[..5], FINISHED_PREFIX);
    let claim = Record::InFlight {
        token: [1; 16],
        fingerprint: [2; 32],
    }
    .encode();
    assert_eq!(&claim[..5], b"IDP\x01P");
    assert!(is_in_flight(&claim) && !is_finished(&claim));
    assert!(is_finished(&resolved().encode()));
    assert!(is_in_flight(
        &Record::Resolvable(Box::new(resolvable())).encode()
    ));
}

#[test]
fn the_fixed_offsets_are_where_the_encoder_writes() {
    let r = resolvable();
    let bytes = Record::Resolvable(Box::new(r.clone())).encode();
    assert!(layout::is_resolvable(&bytes));
    assert_eq!(resolvable::token(&bytes), Some(&r.token[..]));
    assert_eq!(resolvable::lease_until(&bytes), Some(r.lease_until));
    assert_eq!(layout::read(&bytes, layout::CLAIMED_AT), r.claimed_at);
    assert_eq!(layout::read(&bytes, layout::SENT_AT), r.sent_at);
    assert_eq!(bytes[layout::PHASE], b'R');
    assert_eq!(
        layout::read(&bytes, layout::NEXT_LOOKUP_AT),
        r.next_lookup_at
    );
    assert_eq!(&bytes[54..86], &r.fingerprint);

    let mut claim = bytes.to_vec();
    layout::stamp_claim(&mut claim, 1_000, 300, 20);
    let Ok(Record::Resolvable(c)) = Record::decode(&claim) else {
        panic!("a stamped claim decodes");
    };
    assert_eq!(
        (
            c.lease_until,
            c.claimed_at,
            c.sent_at,
            c.phase,
            c.next_lookup_at
        ),
        (1_300, 1_000, 1_020, Phase::InFlight, 0)
    );
    let mut taken = claim.clone();
    layout::stamp_takeover(&mut taken, &[7; 16], 5_000, 300);
    let Ok(Record::Resolvable(t)) = Record::decode(&taken) else {
        panic!("a taken-over claim decodes");
    };
    assert_eq!(
        (t.token, t.lease_until, t.phase, t.next_lookup_at),
        ([7; 16], 5_300, Phase::Resolving, 5_000)
    );
    assert_eq!(
        (t.claimed_at, t.sent_at, &t.lookup),
        (1_000, 1_020, &c.lookup)
    );
    assert_eq!(t.settles_at(), 1_020 + 60_000);
    assert_eq!(t.gives_up_at(), 1_020 + 600_000);
}

#[test]
fn version_2_damage_and_unknown_versions_are_errors() {
    let bytes = Record::Resolvable(Box::new(resolvable())).encode();
    for cut in 0..bytes.len() {
        assert!(Record::decode(&bytes[..cut]).is_err(), "cut at {cut}");
    }
    let mut v4 = bytes.to_vec();
    v4[3] = 4;
    assert_eq!(
        Record::decode(&v4),
        Err(DecodeError("unknown record format version"))
    );
    let mut phase = bytes.to_vec();
    phase[layout::PHASE] = b'X';
    assert!(Record::decode(&phase).is_err());
    // States belong to their version: no 'Q' in version 1, no 'P' in version 2, no
    // resolved outcome in version 1.
    let mut q1 = bytes.to_vec();
    q1[3] = 1;
    assert!(Record::decode(&q1).is_err());
    let mut p2 = Record::InFlight {
        token: [1; 16],
        fingerprint: [2; 32],
    }
    .encode()
    .to_vec();
    p2[3] = 2;
    assert!(Record::decode(&p2).is_err());
    let mut v1 = resolved().encode().to_vec();
    v1[3] = 1;
    assert!(Record::decode(&v1).is_err());
}

/// A claim an earlier proxy wrote (format version 2: no statuses after its headers) is still
/// read, marked as such, and written back as it was; a version 3 claim carries its statuses.
#[test]
fn a_version_2_claim_is_read_and_version_3_carries_its_statuses() {
    let v3 = resolvable();
    let bytes = Record::Resolvable(Box::new(v3.clone())).encode();
    assert_eq!(&bytes[..5], layout::RESOLVABLE_PREFIX);
    let Ok(Record::Resolvable(read)) = Record::decode(&bytes) else {
        panic!("a version 3 claim decodes");
    };
    assert_eq!(
        (read.found.as_slice(), read.absent.as_slice(), read.legacy),
        (&[200, 201][..], &[404][..], false)
    );
    // The same claim as version 2 wrote it: the prefix's version byte, no statuses.
    let mut v2 = bytes[..bytes.len() - (2 + 4 + 2 + 2)].to_vec();
    v2[3] = 2;
    assert!(layout::is_resolvable(&v2));
    assert_eq!(resolvable::token(&v2), Some(&v3.token[..]));
    let Ok(Record::Resolvable(old)) = Record::decode(&v2) else {
        panic!("a version 2 claim decodes");
    };
    assert!(old.legacy);
    assert!(old.found.is_empty() && old.absent.is_empty());
    assert_eq!((old.sent_at, &old.lookup), (v3.sent_at, &v3.lookup));
    assert_eq!(
        Record::Resolvable(old).encode().as_ref(),
        &v2[..],
        "written back as read"
    );
    // Statuses after a version 2 claim are trailing bytes.
    let mut extra = v2.clone();
    extra.extend_from_slice(&bytes[bytes.len() - 10..]);
    assert!(Record::decode(&extra).is_err());
}
