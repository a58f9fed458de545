//! `store.backend: redis-cluster`: the same semantics as one Redis, on a real Redis Cluster
//! started by each test (three primaries on loopback; with a replica each where a test needs
//! failover). The representative behaviour rules of the proxy's tests (`tests/proxy/`) run here
//! with the same assertions (running all of them a third time would triple the suite's
//! time), then what only a cluster has: keys spread over every primary, scripts reloaded per
//! node, a slot moved while requests run (MOVED and ASK followed; large records among them),
//! a large save while its slot moves, and a coordinated failover while requests run —
//! never a duplicate forward, a bounded number of 503s, and traffic that recovers.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use harness::cluster::{NodeLine, RedisCluster};
use harness::{
    Backend, Env, ProxyProcess, Reply, TestProxy, book_with, booking_store_key, client, eventually,
    metric_value, send, spawn_booking,
};
use idemproxy::config::RedisAccess;
use idemproxy::metrics::{Metrics, Outcome};
use idemproxy::record::Record;
use idemproxy::store::redis::RedisStore;
use idemproxy::store::{Claim, Held, StoreHandle, StoreKey};

// The store contract, each check a test of its own (`harness::store_checks`): a one-node cluster of its own; shared by several proxies.
harness::store_contract!(RedisCluster { shared });

/// The request body every booking here sends.
const BODY: &str = r#"{"seat":"12A"}"#;

/// One test's world: the mock upstream (through a memory-backed [`Env`], whose configuration
/// builder this reuses) and a cluster.
struct World {
    env: Env,
    cluster: RedisCluster,
}

impl World {
    /// Three primaries, each with `replicas` replicas.
    async fn new(replicas: usize) -> World {
        let env = Env::new(Backend::Memory).await;
        let cluster = tokio::task::spawn_blocking(move || RedisCluster::start(3, replicas))
            .await
            .expect("start the cluster");
        World { env, cluster }
    }

    /// The harness's configuration (`create-booking`, `pay`, `rest`) with `idem` lines, on
    /// this cluster; the store timeout is 1s unless `store` sets it (six Redis processes and
    /// the test share two cores).
    fn config(&self, idem: &str, store: &str) -> String {
        let mut store = store.to_owned();
        if !store.contains("timeout:") {
            store.push_str("\ntimeout: 1s");
        }
        let yaml = self.env.config_with(idem, &store);
        let lines: String = self
            .cluster
            .store_lines()
            .lines()
            .map(|l| format!("  {l}\n"))
            .collect();
        let out = yaml.replacen("  backend: memory\n", &lines, 1);
        assert_ne!(out, yaml, "the harness's store section moved");
        out
    }

    async fn proxy(&self, idem: &str) -> TestProxy {
        TestProxy::start(&self.config(idem, "")).await
    }

    /// A connection to the primary that serves `store_key`.
    fn conn_for(&self, store_key: &str) -> redis::Connection {
        let owner = self.cluster.owner_of(self.cluster.slot_of(store_key));
        self.cluster.conn(owner.port)
    }
}

async fn post(proxy: &TestProxy, key: &str, extra: &[(&str, &str)]) -> Reply {
    book_with(&proxy.url(""), key, BODY, extra).await
}

/// The cluster slot of a key without a hash tag: CRC16 (XMODEM) of the key, mod 16384.
fn slot_of(key: &str) -> u16 {
    let mut crc: u16 = 0;
    for byte in key.bytes() {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

/// `n` request keys `{prefix}-N` whose store keys fall in `slot`.
fn keys_in_slot(prefix: &str, slot: u16, n: usize) -> Vec<String> {
    (0u64..)
        .map(|i| format!("{prefix}-{i}"))
        .filter(|k| slot_of(&booking_store_key(k)) == slot)
        .take(n)
        .collect()
}

/// Asserts `again` is the replay of `first`: same status, headers and body bytes, marked.
fn assert_replay_of(first: &Reply, again: &Reply) {
    assert_eq!(first.header("idempotent-replayed"), "", "a first response");
    assert_eq!(again.header("idempotent-replayed"), "true", "replay marker");
    assert_eq!(again.status, first.status, "replayed status");
    assert_eq!(again.body, first.body, "replayed body is byte-identical");
    assert_eq!(
        again.header_lines(),
        first.header_lines(),
        "replayed headers"
    );
}

/// Asserts `r` came from the upstream now, a new booking.
fn assert_forwarded(r: &Reply) {
    assert_eq!(r.status, 201, "forwarded; body: {:?}", r.body);
    assert_eq!(r.header("idempotent-replayed"), "", "not a replay");
}

// ---------------------------------------------------------------------------------------------
// The behaviour rules, on a cluster.

/// SPEC §1, §4.2: forwarded once, then replayed byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forward_then_byte_identical_replay() {
    let w = World::new(0).await;
    let proxy = w.proxy("").await;
    let first = post(&proxy, "c-1", &[]).await;
    assert_forwarded(&first);
    for _ in 0..2 {
        assert_replay_of(&first, &post(&proxy, "c-1", &[]).await);
    }
    assert_eq!(w.env.mock.calls("c-1"), 1, "the upstream ran it once");
    // The record lives on the primary that serves its slot, with a TTL.
    let ttl: i64 = redis::cmd("PTTL")
        .arg(booking_store_key("c-1"))
        .query(&mut w.conn_for(&booking_store_key("c-1")))
        .expect("PTTL");
    assert!(ttl > 0, "the record has a TTL on its slot's primary: {ttl}");
}

/// §4.2: a repeat in flight is a 409 with Retry-After (reject), or the first one's response
/// when it lands (wait); a repeat with another body is a 422, in flight and finished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_is_409_or_waits_and_mismatch_is_422() {
    let w = World::new(0).await;
    let reject = w.proxy("").await;
    let wait = w.proxy("on_conflict: wait\nwait_timeout: 5s").await;

    let first = spawn_booking(reject.url(""), "c-slow", BODY, "800ms");
    assert!(
        eventually(Duration::from_secs(5), || w.env.mock.calls("c-slow") == 1).await,
        "the first request reached the upstream"
    );
    let conflict = post(&reject, "c-slow", &[]).await;
    conflict.assert_problem(409, "request-in-progress");
    assert!(!conflict.header("retry-after").is_empty(), "Retry-After");
    let mismatch = send(
        client()
            .post(reject.url("/bookings"))
            .header("Idempotency-Key", "c-slow")
            .body(r#"{"seat":"99Z"}"#),
    )
    .await;
    mismatch.assert_problem(422, "idempotency-key-reused");
    let waited = post(&wait, "c-slow", &[]).await;

    let first = first.await.expect("first request");
    assert_forwarded(&first);
    assert_replay_of(&first, &waited);
    let mismatch = send(
        client()
            .post(reject.url("/bookings"))
            .header("Idempotency-Key", "c-slow")
            .body(r#"{"seat":"99Z"}"#),
    )
    .await;
    mismatch.assert_problem(422, "idempotency-key-reused");
    assert_eq!(w.env.mock.calls("c-slow"), 1);
}

/// §1 step 3: an upstream call four times longer than `lock_ttl` keeps its claim by renewal
/// (the renew script, routed by the key's slot).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_renewal_keeps_a_slow_claim() {
    let w = World::new(0).await;
    // The store deadline stays shorter than the lease (SPEC §4.5: refused otherwise).
    let proxy = TestProxy::start(&w.config("lock_ttl: 300ms", "timeout: 250ms")).await;
    let first = spawn_booking(proxy.url(""), "c-renew", BODY, "1200ms");
    assert!(eventually(Duration::from_secs(3), || w.env.mock.calls("c-renew") == 1).await);
    tokio::time::sleep(Duration::from_millis(600)).await;
    post(&proxy, "c-renew", &[])
        .await
        .assert_problem(409, "request-in-progress");
    let first = first.await.expect("first request");
    assert_forwarded(&first);
    assert_replay_of(&first, &post(&proxy, "c-renew", &[]).await);
    assert_eq!(w.env.mock.calls("c-renew"), 1);
    assert_eq!(proxy.lost_leases(), 0, "no lease was lost");
}

/// §4.4: the compare-and-set on the token, at the store, on a cluster: once A's lease expired
/// and B claimed, nothing A does touches the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_holder_cannot_overwrite_a_newer_holder() {
    let w = World::new(0).await;
    let timeout = Duration::from_secs(2);
    let metrics = Arc::new(Metrics::new());
    let inner = RedisStore::cluster(
        &w.cluster.seeds(),
        &RedisAccess::default(),
        timeout,
        &metrics,
    )
    .expect("cluster store");
    let store = StoreHandle::new(Arc::new(inner), timeout, metrics);
    harness::store_checks::stale_holder_cannot_overwrite_a_newer_holder(&store).await;
}

/// §4.5: a record that does not decode, or another Redis type under the key, is a store error
/// on a cluster too: 503, never forwarded (not even with `on_store_error: forward`), never
/// replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_records_are_store_errors() {
    let w = World::new(0).await;
    let reject = w.proxy("").await;
    let forward = w.proxy("on_store_error: forward").await;
    let garbage = booking_store_key("c-garbage");
    let _: () = redis::cmd("SET")
        .arg(&garbage)
        .arg(b"\x00\xffnot a record".as_slice())
        .arg("PX")
        .arg(60_000)
        .query(&mut w.conn_for(&garbage))
        .expect("SET garbage");
    let wrongtype = booking_store_key("c-wrongtype");
    let _: () = redis::cmd("RPUSH")
        .arg(&wrongtype)
        .arg("x")
        .query(&mut w.conn_for(&wrongtype))
        .expect("RPUSH");
    for key in ["c-garbage", "c-wrongtype"] {
        for proxy in [&reject, &forward] {
            let r = post(proxy, key, &[]).await;
            r.assert_problem(503, "store-unavailable");
            assert_eq!(r.header("idempotent-replayed"), "");
        }
        assert_eq!(w.env.mock.calls(key), 0, "{key}: never forwarded");
    }
}

/// §4.5: the whole cluster hung (SIGSTOP): 503 in bounded time on the new-key and the replay
/// path, nothing forwarded, readiness fails; after SIGCONT it serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_down_is_503_in_bounded_time_then_recovers() {
    let w = World::new(0).await;
    let proxy = TestProxy::start(&w.config("", "timeout: 300ms")).await;
    let warm = post(&proxy, "c-warm", &[]).await;
    assert_forwarded(&warm);

    w.cluster.pause_all();
    for key in ["c-paused", "c-warm"] {
        let started = Instant::now();
        let r = post(&proxy, key, &[]).await;
        let took = started.elapsed();
        r.assert_problem(503, "store-unavailable");
        assert!(
            took < Duration::from_secs(3),
            "{key}: a hung cluster must answer in bounded time, took {took:?}"
        );
    }
    assert!(proxy.proxy.store().ping().await.is_err(), "not ready");
    assert_eq!(w.env.mock.calls("c-paused"), 0, "nothing forwarded");
    assert!(proxy.requests("create-booking", Outcome::StoreError) >= 2);

    w.cluster.resume_all();
    let mut recovered = None;
    for n in 0..60 {
        let key = format!("c-after-{n}");
        let r = post(&proxy, &key, &[]).await;
        if r.status == 201 {
            recovered = Some((key, r));
            break;
        }
        r.assert_problem(503, "store-unavailable");
        assert_eq!(w.env.mock.calls(&key), 0, "a 503 forwards nothing");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (key, first) = recovered.expect("the proxy recovered after the cluster resumed");
    assert_replay_of(&first, &post(&proxy, &key, &[]).await);
    assert_replay_of(&warm, &post(&proxy, "c-warm", &[]).await);
    assert!(proxy.proxy.store().ping().await.is_ok(), "ready again");
}

/// Every node killed, then started again (same ports and cluster configuration, no data):
/// meanwhile 503 at once, nothing forwarded; afterwards the proxy serves again by itself,
/// following the cluster back without a restart. A proxy started while the cluster is down
/// does the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_restarted_proxy_recovers_without_restart() {
    let mut w = World::new(0).await;
    let yaml = w.config("", "");
    let proxy = TestProxy::start(&yaml).await;
    assert_forwarded(&post(&proxy, "c-before", &[]).await);
    w.cluster.kill_all();
    let late = TestProxy::start(&yaml).await;
    for (name, p) in [("running", &proxy), ("started while down", &late)] {
        let started = Instant::now();
        post(p, "c-down", &[])
            .await
            .assert_problem(503, "store-unavailable");
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{name}: a refused connection answers in bounded time"
        );
    }
    assert_eq!(w.env.mock.calls("c-down"), 0);
    let w = tokio::task::spawn_blocking(move || {
        w.cluster.restart_all();
        w
    })
    .await
    .expect("restart the cluster");
    for (i, (name, p)) in [("running", &proxy), ("started while down", &late)]
        .into_iter()
        .enumerate()
    {
        let mut ok = None;
        for n in 0..100 {
            let key = format!("c-back-{i}-{n}");
            let r = post(p, &key, &[]).await;
            if r.status == 201 {
                ok = Some((key, r));
                break;
            }
            r.assert_problem(503, "store-unavailable");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let (key, first) = ok.unwrap_or_else(|| panic!("{name}: never recovered"));
        assert_replay_of(&first, &post(p, &key, &[]).await);
        assert_eq!(w.env.mock.calls(&key), 1);
    }
}

// ---------------------------------------------------------------------------------------------
// What only a cluster has.

/// Keys land on every primary (each routed by its slot), and two proxy instances sharing the
/// cluster behave as one: fifty duplicates split between them run once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_spread_over_every_primary_and_instances_behave_as_one() {
    let w = World::new(0).await;
    let a = w.proxy("").await;
    let b = w.proxy("").await;
    for n in 0..30 {
        assert_forwarded(&post(&a, &format!("spread-{n}"), &[]).await);
    }
    for master in w.cluster.masters() {
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("idemproxy:create-booking:*")
            .query(&mut w.cluster.conn(master.port))
            .expect("KEYS");
        assert!(
            !keys.is_empty(),
            "primary {} holds none of thirty keys",
            master.port
        );
    }

    let mut tasks = Vec::new();
    for i in 0..50 {
        let url = if i % 2 == 0 {
            a.url("/bookings")
        } else {
            b.url("/bookings")
        };
        tasks.push(tokio::spawn(async move {
            send(
                client()
                    .post(url)
                    .header("Idempotency-Key", "dup-50")
                    .header("Content-Type", "application/json")
                    .header("X-Mock-Delay", "200ms")
                    .body(BODY),
            )
            .await
        }));
    }
    let mut created = 0;
    for t in tasks {
        let r = t.await.expect("request");
        match r.status {
            201 if r.header("idempotent-replayed").is_empty() => created += 1,
            201 | 409 => {}
            other => panic!("unexpected {other}: {:?}", r.body),
        }
    }
    assert_eq!(created, 1, "one first response");
    assert_eq!(
        w.env.mock.calls("dup-50"),
        1,
        "one booking across both instances"
    );
}

/// `EVALSHA` → `NOSCRIPT` → load → `EVALSHA` works per node: after `SCRIPT FLUSH` on every
/// node (as on a promoted replica that never saw the scripts), renewals and saves still land.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripts_are_reloaded_on_every_node_after_a_flush() {
    let w = World::new(0).await;
    // The store deadline stays shorter than the lease (SPEC §4.5: refused otherwise).
    let proxy = TestProxy::start(&w.config("lock_ttl: 300ms", "timeout: 250ms")).await;
    for n in 0..6 {
        assert_forwarded(&post(&proxy, &format!("warm-{n}"), &[]).await);
    }
    for node in &w.cluster.nodes {
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query(&mut w.cluster.conn(node.port))
            .expect("SCRIPT FLUSH");
    }
    // Renewals (the call outlives lock_ttl) and saves, on keys of every primary.
    let mut tasks = Vec::new();
    for n in 0..6 {
        let url = proxy.url("/bookings");
        tasks.push(tokio::spawn(async move {
            send(
                client()
                    .post(url)
                    .header("Idempotency-Key", format!("flushed-{n}"))
                    .header("Content-Type", "application/json")
                    .header("X-Mock-Delay", "500ms")
                    .body(BODY),
            )
            .await
        }));
    }
    for (n, t) in tasks.into_iter().enumerate() {
        let first = t.await.expect("request");
        assert_forwarded(&first);
        let key = format!("flushed-{n}");
        assert_replay_of(&first, &post(&proxy, &key, &[]).await);
        assert_eq!(w.env.mock.calls(&key), 1);
    }
    assert_eq!(proxy.lost_leases(), 0);
}

/// At start the proxy reads `maxmemory-policy` on every node and warns about each one that may
/// evict keys, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_policy_is_checked_on_every_node() {
    let w = World::new(0).await;
    let lru = w.cluster.nodes[1].port;
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("allkeys-lru")
        .query(&mut w.cluster.conn(lru))
        .expect("CONFIG SET");
    let p = ProxyProcess::spawn(&w.config("", ""));
    let needle = format!("127.0.0.1:{lru}");
    let warned = eventually(Duration::from_secs(10), || {
        p.log()
            .lines()
            .any(|l| l.contains("WARN") && l.contains("allkeys-lru") && l.contains(&needle))
    })
    .await;
    assert!(
        warned,
        "no eviction warning naming {needle}; log:\n{}",
        p.log()
    );
    let log = p.log();
    let fine = log
        .lines()
        .filter(|l| l.contains("maxmemory-policy is noeviction"))
        .count();
    assert_eq!(fine, 2, "the two other nodes are checked too; log:\n{log}");
}

/// `/metrics` of a proxy on a cluster exports the Redis store's series (the short replica
/// acknowledgements, at 0: a cluster waits for no replica) and no other store's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_export_the_redis_series_and_no_other_stores() {
    let w = World::new(0).await;
    let admin = harness::free_port();
    let p = ProxyProcess::spawn(&format!(
        "admin_listen: 127.0.0.1:{admin}\n{}",
        w.config("", "")
    ));
    assert_forwarded(&book_with(&p.url(""), "m-1", BODY, &[]).await);
    let text = client()
        .get(format!("http://127.0.0.1:{admin}/metrics"))
        .send()
        .await
        .expect("scrape /metrics")
        .text()
        .await
        .expect("the metrics text");
    let forwarded = [("route", "create-booking"), ("outcome", "forwarded")];
    assert_eq!(
        metric_value(&text, "idemproxy_requests_total", &forwarded),
        1.0
    );
    for op in ["claim", "complete"] {
        assert_eq!(
            metric_value(&text, "idemproxy_replica_acks_missing_total", &[("op", op)]),
            0.0,
            "{op}"
        );
    }
    for other in [
        "idemproxy_memory_store_records",
        "idemproxy_store_swept",
        "idemproxy_sqlite_commit_duration_seconds",
        "idemproxy_postgres_pool_connections",
    ] {
        assert!(!text.contains(other), "{other} on a cluster:\n{text}");
    }
}

// ---------------------------------------------------------------------------------------------
// Topology changes under traffic.

/// What a burst of traffic saw.
#[derive(Debug, Default)]
struct Tally {
    ok: usize,
    unavailable: usize,
    conflicts: usize,
    /// Every key sent, for the duplicate check.
    keys: Vec<String>,
}

/// Sends rounds of requests through `proxy` until `stop` is set: the hot key each round, fresh
/// keys `{prefix}-{round}-{i}` (i < 6) sent twice at once, and every fourth round the next of
/// `in_slot` (keys of one slot) twice at once, with a 64 KiB response (saved as a staged
/// record: written to a staging key in the slot, then moved under the record key, both while
/// the slot moves). Any answer but 201 (fresh or replayed), 409 and 503 fails the test.
async fn traffic(
    proxy: &TestProxy,
    prefix: &str,
    hot: &str,
    in_slot: &[String],
    stop: &AtomicBool,
) -> Tally {
    let mut tally = Tally::default();
    let in_slot_keys = in_slot;
    let mut in_slot = in_slot.iter();
    let mut round = 0;
    while !stop.load(Ordering::Relaxed) {
        let mut keys = vec![hot.to_owned()];
        let mut fresh: Vec<String> = (0..6).map(|i| format!("{prefix}-{round}-{i}")).collect();
        if round % 4 == 0 {
            fresh.extend(in_slot.next().cloned());
        }
        for k in fresh {
            keys.push(k.clone());
            tally.keys.push(k.clone());
            keys.push(k);
        }
        let replies = futures_util::future::join_all(keys.iter().map(|k| {
            let large: &[(&str, &str)] = if in_slot_keys.contains(k) {
                &[("X-Mock-Body-Size", "65536")]
            } else {
                &[]
            };
            post(proxy, k, large)
        }))
        .await;
        for r in replies {
            match r.status {
                201 => tally.ok += 1,
                409 => tally.conflicts += 1,
                503 => {
                    r.assert_problem(503, "store-unavailable");
                    tally.unavailable += 1;
                }
                other => panic!("unexpected {other}: {:?}", r.body),
            }
        }
        round += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tally
}

/// Asserts no key of `tally` reached the upstream more than once, and every key that got no
/// 503 reached it once.
fn assert_no_duplicate(w: &World, tally: &Tally) {
    for k in &tally.keys {
        let calls = w.env.mock.calls(k);
        assert!(calls <= 1, "{k} forwarded {calls} times");
    }
    let forwarded = tally
        .keys
        .iter()
        .filter(|k| w.env.mock.calls(k) == 1)
        .count();
    assert!(
        forwarded + tally.unavailable >= tally.keys.len(),
        "every key ran once unless refused: {forwarded} of {} ({} 503s)",
        tally.keys.len(),
        tally.unavailable
    );
}

/// A slot moved from one primary to another while requests run: a hot key in flight when the
/// move starts, requests for it, for new keys of the same slot and for fresh keys of any slot
/// throughout. The client follows ASK (a key of a migrating slot that is not on the old
/// primary) and MOVED (once the slot has moved): nothing is forwarded twice, the hot key's
/// response is replayed byte for byte from its new primary, and at most a few requests get a
/// 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_migration_during_traffic() {
    let hot = "hot-migrating";
    let slot = slot_of(&booking_store_key(hot));
    // Keys of the same slot, found while the cluster starts.
    let in_slot = tokio::task::spawn_blocking(move || keys_in_slot("mig-slot", slot, 6));
    let w = Arc::new(World::new(0).await);
    let in_slot = in_slot.await.expect("keys of the hot slot");
    assert_eq!(
        w.cluster.slot_of(&booking_store_key(hot)),
        slot,
        "CRC16 slot"
    );
    assert_eq!(
        w.cluster.slot_of(&booking_store_key(&in_slot[0])),
        slot,
        "CRC16 slot"
    );
    let proxy = Arc::new(w.proxy("lock_ttl: 2s").await);
    let from = w.cluster.owner_of(slot);
    let to: NodeLine = w
        .cluster
        .masters()
        .into_iter()
        .find(|m| m.id != from.id)
        .expect("another primary");

    // The hot key's first request holds its claim (on the old primary) across the move.
    let first = spawn_booking(proxy.url(""), hot, BODY, "1500ms");
    assert!(eventually(Duration::from_secs(5), || w.env.mock.calls(hot) == 1).await);

    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let (proxy, stop) = (proxy.clone(), stop.clone());
        tokio::spawn(async move { traffic(&proxy, "mig", hot, &in_slot, &stop).await })
    };
    {
        let (w, to) = (w.clone(), to.clone());
        tokio::task::spawn_blocking(move || {
            // Each state (migrating, keys moved, moved) stays a while so traffic meets it.
            w.cluster.migrate_slot(slot, &from, &to, |_| {
                std::thread::sleep(Duration::from_millis(300))
            });
        })
        .await
        .expect("slot moved");
    }
    stop.store(true, Ordering::Relaxed);
    let tally = load.await.expect("traffic");
    eprintln!(
        "slot migration: {} ok, {} conflicts, {} unavailable, {} keys",
        tally.ok,
        tally.conflicts,
        tally.unavailable,
        tally.keys.len()
    );
    let first = first.await.expect("hot key's first request");
    assert_forwarded(&first);

    assert_eq!(w.cluster.owner_of(slot).id, to.id, "the slot moved");
    let mut on_new: Vec<String> = vec![booking_store_key(hot)];
    on_new.extend(
        tally
            .keys
            .iter()
            .filter(|k| k.starts_with("mig-slot"))
            .map(|k| booking_store_key(k)),
    );
    assert!(on_new.len() >= 3, "keys of the slot were sent: {on_new:?}");
    for key in &on_new {
        let exists: bool = redis::cmd("EXISTS")
            .arg(key)
            .query(&mut w.cluster.conn(to.port))
            .expect("EXISTS");
        assert!(exists, "{key} is on the slot's new primary");
    }
    assert_replay_of(&first, &post(&proxy, hot, &[]).await);
    assert_eq!(w.env.mock.calls(hot), 1);
    assert_no_duplicate(&w, &tally);
    assert!(
        tally.unavailable <= 10,
        "at most a few 503s while the slot moved: {tally:?}"
    );
}

/// A large save while its slot moves, for a claim taken before the move: the staging key
/// is new, so the old primary sends its `SET` on to the new one (ASK); the script names the
/// claim, still on the old primary, and the staging key, already on the new one, and is told
/// to try again (TRYAGAIN) until the claim has moved too; then it runs on the new primary
/// (ASK) and moves the record under its key there. Done once, whole, on the new primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_completion_while_its_slot_moves() {
    let w = Arc::new(World::new(0).await);
    let timeout = Duration::from_secs(3);
    let metrics = Arc::new(Metrics::new());
    let inner = RedisStore::cluster(
        &w.cluster.seeds(),
        &RedisAccess::default(),
        timeout,
        &metrics,
    )
    .expect("cluster store");
    let store = StoreHandle::new(Arc::new(inner), timeout, metrics);
    let key = StoreKey::new(
        idemproxy::key::namespace("idemproxy:", "create-booking"),
        0,
        [61; 32],
    );
    let held = Held::new(Record::InFlight {
        token: [1; 16],
        fingerprint: [7; 32],
    });
    assert_eq!(
        store
            .claim(&key, &held, Duration::from_secs(30))
            .await
            .expect("claim"),
        Claim::Claimed
    );
    let slot = w.cluster.slot_of(&key.text());
    let from = w.cluster.owner_of(slot);
    let to: NodeLine = w
        .cluster
        .masters()
        .into_iter()
        .find(|m| m.id != from.id)
        .expect("another primary");

    // The slot is marked migrating; its keys move once the save has been sent.
    let (migrating, marked) = std::sync::mpsc::channel();
    let (go, sent) = std::sync::mpsc::channel::<()>();
    let mover = {
        let (w, from, to) = (w.clone(), from.clone(), to.clone());
        tokio::task::spawn_blocking(move || {
            w.cluster.migrate_slot(slot, &from, &to, |stage| {
                if stage == 1 {
                    migrating.send(()).expect("the test waits");
                    sent.recv().expect("the completion was sent");
                    // The script meets the split slot for a while.
                    std::thread::sleep(Duration::from_millis(150));
                }
            });
        })
    };
    tokio::task::spawn_blocking(move || marked.recv().expect("the slot is migrating"))
        .await
        .expect("wait for the migration");
    let record = harness::store_checks::large(b'm');
    let completion = {
        let (store, key, held, encoded) =
            (store.clone(), key.clone(), held.clone(), record.encode());
        tokio::spawn(async move {
            store
                .save(&key, &held, &encoded, Duration::from_secs(3600))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    go.send(()).expect("the mover waits");
    let done = completion.await.expect("completion task");
    mover.await.expect("slot moved");
    assert!(
        done.as_ref().is_ok_and(|d| *d),
        "the completion lands while the slot moves: {done:?}"
    );
    assert_eq!(w.cluster.owner_of(slot).id, to.id, "the slot moved");
    let mut on_new = w.cluster.conn(to.port);
    let stored: Option<Vec<u8>> = redis::cmd("GET")
        .arg(key.text())
        .query(&mut on_new)
        .expect("GET");
    assert!(
        stored.as_deref() == Some(&record.encode()[..]),
        "the whole record, on the new primary"
    );
    let keys: Vec<String> = redis::cmd("CLUSTER")
        .arg("GETKEYSINSLOT")
        .arg(slot)
        .arg(10)
        .query(&mut on_new)
        .expect("GETKEYSINSLOT");
    assert_eq!(keys, [key.text()], "no staging key is left in the slot");
    assert_eq!(
        store.get(&key).await.expect("get"),
        Some(record),
        "read through the cluster client"
    );
    let split: u64 = [from.port, to.port]
        .into_iter()
        .map(|port| {
            let stats: String = redis::cmd("INFO")
                .arg("errorstats")
                .query(&mut w.cluster.conn(port))
                .expect("INFO errorstats");
            stats
                .lines()
                .find_map(|l| l.strip_prefix("errorstat_TRYAGAIN:count="))
                .and_then(|n| n.trim().parse().ok())
                .unwrap_or(0)
        })
        .sum();
    assert!(split > 0, "the script met the split slot (TRYAGAIN)");
}

/// `CLUSTER FAILOVER` sent to the replica of the hot key's primary while requests run: the
/// coordinated failover loses no write, so nothing is forwarded twice and every response
/// saved before it is still replayed; at most a few 503s, and traffic recovers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coordinated_failover_during_traffic() {
    let w = Arc::new(World::new(1).await);
    let proxy = Arc::new(w.proxy("lock_ttl: 2s").await);
    let hot = "hot-failover";
    let before = post(&proxy, hot, &[]).await;
    assert_forwarded(&before);
    let slot = w.cluster.slot_of(&booking_store_key(hot));
    let old = w.cluster.owner_of(slot);
    let replica = w.cluster.replica_of(&old);

    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let (proxy, stop) = (proxy.clone(), stop.clone());
        tokio::spawn(async move { traffic(&proxy, "fo", hot, &[], &stop).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    {
        let (w, replica) = (w.clone(), replica.clone());
        tokio::task::spawn_blocking(move || w.cluster.failover(&replica))
            .await
            .expect("failover");
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    let tally = load.await.expect("traffic");
    eprintln!(
        "failover: {} ok, {} conflicts, {} unavailable, {} keys",
        tally.ok,
        tally.conflicts,
        tally.unavailable,
        tally.keys.len()
    );
    assert_eq!(
        w.cluster.owner_of(slot).id,
        replica.id,
        "the replica took over"
    );

    assert_no_duplicate(&w, &tally);
    assert_eq!(w.env.mock.calls(hot), 1);
    assert!(
        tally.unavailable <= 15,
        "at most a few 503s during the failover: {tally:?}"
    );
    // Recovered: new keys go through, and what was saved before is replayed from the new
    // primary.
    for n in 0..5 {
        assert_forwarded(&post(&proxy, &format!("fo-after-{n}"), &[]).await);
    }
    assert_replay_of(&before, &post(&proxy, hot, &[]).await);
}
