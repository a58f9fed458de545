//! The stores under faults of their own: a Redis that restarted or dropped an idle connection
//! between two requests (the first store operation afterwards must not be a 503), a reply lost
//! after a release landed (the release sent again must not count as a lost lease), on one
//! Redis, a Redis with `wait_replicas` and a Redis Cluster.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::RedisServer;
use common::cluster::RedisCluster;
use idemproxy::config::RedisAccess;
use idemproxy::metrics::Metrics;
use idemproxy::record::Entry;
use idemproxy::store::memory::MemoryStore;
use idemproxy::store::redis::RedisStore;
use idemproxy::store::{Claim, Held, Store, StoreHandle, StoreKey};

// ---------------------------------------------------------------------------------------------
// A release sent again after it landed
// ---------------------------------------------------------------------------------------------

fn held(token: u8) -> Held {
    Held::new(Entry::InFlight {
        token: [token; 16],
        fingerprint: [7; 32],
    })
}

fn store_key(n: u8) -> StoreKey {
    StoreKey::new(
        idemproxy::key::namespace("idemproxy:", "create-booking"),
        0,
        [n; 32],
    )
}

fn handle(store: impl Store, timeout: Duration) -> StoreHandle {
    StoreHandle::new(Arc::new(store), timeout, Arc::new(Metrics::new()))
}

/// What a release answers: `true` once the key is free of the claim (the holder released it,
/// or a release sent again finds it gone already: not a lost lease), `false` only while another
/// claim holds the key (the lease was lost), which it leaves alone.
async fn release_answers(store: &StoreHandle) {
    let key = &store_key(21);
    let (a, b) = (held(1), held(2));
    let lease = Duration::from_secs(30);
    assert_eq!(
        store.claim(key, &a, lease).await.expect("A claims"),
        Claim::Claimed
    );
    assert!(
        store.release(key, &a).await.expect("A releases"),
        "the holder releases"
    );
    assert!(
        store.release(key, &a).await.expect("A's release again"),
        "a release sent again after it landed finds the key gone: not a lost lease"
    );
    assert_eq!(
        store.claim(key, &b, lease).await.expect("B claims"),
        Claim::Claimed
    );
    assert!(
        !store.release(key, &a).await.expect("A releases B's claim"),
        "another claim holds the key: the lease was lost"
    );
    assert_eq!(
        store.get(key).await.expect("get"),
        Some(b.entry.clone()),
        "B's claim is untouched"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_release_answers() {
    release_answers(&handle(MemoryStore::new(100), Duration::from_secs(1))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_release_answers() {
    let redis = RedisServer::start();
    let timeout = Duration::from_secs(2);
    let store = RedisStore::new(&redis.url(), timeout).expect("redis store");
    release_answers(&handle(store, timeout)).await;
}

/// The cluster client sends a command again by itself after a connection error (`retries`),
/// a release whose answer was lost included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_release_answers() {
    let cluster = tokio::task::spawn_blocking(|| RedisCluster::start(3, 0))
        .await
        .expect("start the cluster");
    let timeout = Duration::from_secs(2);
    let store = RedisStore::cluster(&cluster.seeds(), &RedisAccess::default(), timeout)
        .expect("cluster store");
    release_answers(&handle(store, timeout)).await;
}
