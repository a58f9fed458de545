//! SPEC §4.8, "Bounded": renewing a resolvable claim's lease never rewrites its copied lookup
//! in the store. Measured as the bytes a renewal makes the store write: on Redis, the
//! replication stream a replica receives (its `total_net_input_bytes`), which carries every
//! write the primary makes. A claim with a 16 KiB lookup costs no more a renewal than one with
//! a small lookup.

use std::time::{Duration, Instant};

use harness::{Backend, Env, RedisServer, store_checks};
use http::{HeaderName, HeaderValue, Method};
use idemproxy::record::{Held, Lookup, Record, Resolvable};
use idemproxy::store::{ResolvableClaim, ResolvableTimes, StoreHandle, StoreKey};

/// Renewals measured per claim.
const RENEWALS: u64 = 20;
/// What a renewal of the large claim may cost over the small one's (the numbers' digits, the
/// replication protocol's framing).
const MARGIN_PER_RENEWAL: u64 = 64;

fn key(n: u8) -> StoreKey {
    StoreKey::new(
        idemproxy::key::namespace("idemproxy:", "create-booking"),
        0,
        [0xE0 | n; 32],
    )
}

/// A resolvable claim whose lookup copies a header of `header_len` bytes.
pub(super) fn claim(token: u8, header_len: usize) -> Held {
    // Not compressible, so no store can make it small: every byte differs from its neighbour.
    let value: String = (0..header_len)
        .map(|i| char::from(b'!' + u8::try_from((i * 7 + i / 94) % 94).unwrap_or(0)))
        .collect();
    Held::new(Record::Resolvable(Box::new(Resolvable::claim(
        [token; 16],
        [5; 32],
        Lookup {
            upstream: "booking".into(),
            method: Method::GET,
            target: "/bookings/by-reference/r-1".into(),
            headers: vec![(
                HeaderName::from_static("authorization"),
                HeaderValue::from_str(&value).expect("a header value"),
            )],
        },
        Duration::from_secs(60),
        Duration::from_secs(5),
        Duration::from_secs(600),
    ))))
}

async fn claimed(s: &StoreHandle, key: &StoreKey, held: &Held) -> Held {
    let times = ResolvableTimes {
        lease: Duration::from_secs(30),
        send_margin: Duration::from_secs(1),
        lifetime: Duration::from_secs(3600),
    };
    match s.claim_resolvable(key, held, times).await.expect("claim") {
        ResolvableClaim::Claimed { held, .. } => held,
        other => panic!("expected a claim, got {other:?}"),
    }
}

/// The replica's `total_net_input_bytes`.
fn net_input(replica: &RedisServer) -> u64 {
    let mut c = replica.conn();
    let info: String = ::redis::cmd("INFO")
        .arg("stats")
        .query(&mut c)
        .expect("INFO");
    info.lines()
        .find_map(|l| l.strip_prefix("total_net_input_bytes:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("total_net_input_bytes")
}

/// What `RENEWALS` renewals (half of them also marking the next lookup) of `held` cost the
/// replica in input bytes.
async fn renewals_cost(s: &StoreHandle, key: &StoreKey, held: &Held, replica: &RedisServer) -> u64 {
    // Whatever the claim itself sent has arrived. Each reading is one `INFO` on a connection
    // of its own (its bytes count too, alike for both claims).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = net_input(replica);
    for i in 0..RENEWALS {
        let renewed = if i % 2 == 0 {
            s.renew(key, held, Duration::from_secs(30))
                .await
                .expect("renew")
        } else {
            s.resolving(key, held, Duration::from_secs(5), Duration::from_secs(30))
                .await
                .expect("resolving")
                .is_some()
        };
        assert!(renewed, "renewal {i}");
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = net_input(replica);
    after - before
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_renewal_costs_the_same_whatever_the_lookup_size() {
    let env = Env::new(Backend::Redis).await;
    let primary = env.redis().port();
    let replica = tokio::task::spawn_blocking(move || {
        RedisServer::start_with(&["--replicaof", "127.0.0.1", &primary.to_string()])
    })
    .await
    .expect("start the replica");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut c = replica.conn();
        let info: String = ::redis::cmd("INFO")
            .arg("replication")
            .query(&mut c)
            .expect("INFO");
        if info.contains("master_link_status:up") {
            break;
        }
        assert!(Instant::now() < deadline, "the replica did not sync");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let s = store_checks::handle(env.store().await);
    let (small_key, large_key) = (key(1), key(2));
    let small = claimed(&s, &small_key, &claim(0x31, 16)).await;
    let large = claimed(&s, &large_key, &claim(0x32, 16 * 1024 - 100)).await;
    let small_cost = renewals_cost(&s, &small_key, &small, &replica).await;
    let large_cost = renewals_cost(&s, &large_key, &large, &replica).await;
    eprintln!(
        "replica input for {RENEWALS} renewals: small lookup {small_cost} bytes, 16 KiB lookup {large_cost} bytes"
    );
    assert!(small_cost > 0, "the renewals reached the replica");
    assert!(
        large_cost <= small_cost + RENEWALS * MARGIN_PER_RENEWAL,
        "a renewal rewrote the lookup: {large_cost} bytes for the 16 KiB lookup, {small_cost} for the small one"
    );
}
