//! The stores under faults of their own: a Redis that restarted or dropped an idle connection
//! between two requests (the first store operation afterwards must not be a 503), a reply lost
//! after a release or a large save landed (the operation sent again must not count as a
//! lost lease), on one Redis, a Redis with `wait_replicas` and a Redis Cluster; and what a large
//! record leaves in Redis on its way in (a staging key with a TTL, then nothing beside it).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use harness::cluster::{RedisCluster, wait_for};
use harness::relay::{Direction, Relay};
use harness::{Backend, Env, RedisServer, Reply, TestProxy, book_with};
use idemproxy::config::RedisAccess;
use idemproxy::metrics::{Metrics, Outcome};
use idemproxy::record::Record;
use idemproxy::store::memory::MemoryStore;
use idemproxy::store::redis::RedisStore;
use idemproxy::store::{Claim, Forgotten, Held, Store, StoreError, StoreHandle, StoreKey};

const BODY: &str = r#"{"seat":"12A"}"#;

async fn post(proxy: &TestProxy, key: &str) -> Reply {
    book_with(&proxy.url(""), key, BODY, &[]).await
}

fn assert_forwarded(r: &Reply, what: &str) {
    assert_eq!(r.status, 201, "{what}: forwarded; body: {:?}", r.body);
    assert_eq!(r.header("idempotent-replayed"), "", "{what}: not a replay");
}

fn assert_replay_of(r: &Reply, first: &Reply) {
    assert_eq!(r.status, first.status, "replayed status");
    assert_eq!(r.header("idempotent-replayed"), "true", "replay marker");
    assert_eq!(r.body, first.body, "replayed body is byte-identical");
}

/// A booking before the fault, the fault, then a booking of a new key: it is forwarded once
/// (201, not a 503) and replayed, and no store error was counted.
async fn request_fault_request(env: &Env, proxy: &TestProxy, fault: impl FnOnce()) {
    let before = post(proxy, "before-fault").await;
    assert_forwarded(&before, "before the fault");
    fault();
    let after = post(proxy, "after-fault").await;
    assert_forwarded(&after, "the first request after the fault");
    assert_eq!(env.mock.calls("after-fault"), 1);
    assert_replay_of(&post(proxy, "after-fault").await, &after);
    assert_eq!(env.mock.calls("after-fault"), 1, "run once");
    assert_eq!(
        proxy.requests("create-booking", Outcome::StoreError),
        0,
        "no request answered a store error"
    );
}

/// Redis restarts (same port, empty) between two requests: the shared connection is dead, and
/// the first command on it fails. The store sends it again on the reconnected connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restart_between_two_requests_is_not_a_503() {
    let mut env = Env::new(Backend::Redis).await;
    let proxy = env.proxy(&env.config("")).await;
    let mut redis = env.take_redis();
    request_fault_request(&env, &proxy, || {
        tokio::task::block_in_place(|| redis.restart());
    })
    .await;
}

/// Redis closes connections idle for a second (`timeout 1`): the next request finds its
/// connection closed, and still gets its 201.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_closing_an_idle_connection_is_not_a_503() {
    let env = Env::on_redis(RedisServer::start_with(&["--timeout", "1"])).await;
    let proxy = env.proxy(&env.config("")).await;
    request_fault_request(&env, &proxy, || {
        // Redis checks idle clients about ten times a second: 1s idle, plus margin.
        std::thread::sleep(Duration::from_millis(2500));
    })
    .await;
}

/// With `wait_replicas`, claims run on dedicated connections kept in a pool: after the primary
/// restarts (and its replica has synced again), a pooled connection is dead, and the claim
/// on it must not be a 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restart_with_wait_replicas_is_not_a_503() {
    let mut env = Env::new(Backend::Redis).await;
    let primary = env.redis().port();
    let replica = tokio::task::spawn_blocking(move || {
        let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &primary.to_string()]);
        wait_linked(&replica);
        replica
    })
    .await
    .expect("start the replica");
    let proxy = env
        .proxy(&env.config_with("", "wait_replicas: 1\ntimeout: 1s"))
        .await;
    let mut redis = env.take_redis();
    request_fault_request(&env, &proxy, || {
        tokio::task::block_in_place(|| {
            redis.restart();
            wait_linked(&replica);
            wait_acknowledged(&redis);
        });
    })
    .await;
}

/// Waits until `replica`'s link to its primary is up.
fn wait_linked(replica: &RedisServer) {
    wait_for(Duration::from_secs(15), "the replica to sync", || {
        let Ok(client) = redis::Client::open(replica.url()) else {
            return false;
        };
        let Ok(mut c) = client.get_connection_with_timeout(Duration::from_millis(500)) else {
            return false;
        };
        redis::cmd("INFO")
            .arg("replication")
            .query::<String>(&mut c)
            .is_ok_and(|i| i.contains("master_link_status:up"))
    });
}

/// Waits until `primary`'s replica acknowledges a write within a second, as the proxy's `WAIT`
/// asks: a link that is up may still be resyncing, and a `WAIT` then times out.
fn wait_acknowledged(primary: &RedisServer) {
    wait_for(Duration::from_secs(15), "the replica's ack", || {
        let Ok(client) = redis::Client::open(primary.url()) else {
            return false;
        };
        let Ok(mut c) = client.get_connection_with_timeout(Duration::from_millis(500)) else {
            return false;
        };
        redis::pipe()
            .cmd("INCR")
            .arg("test:replica-sync")
            .ignore()
            .cmd("WAIT")
            .arg(1)
            .arg(1000)
            .query::<(i64,)>(&mut c)
            .is_ok_and(|(acked,)| acked >= 1)
    });
}

/// Every node of a Redis Cluster restarts (same ports and cluster configuration, no data)
/// between two requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_restart_between_two_requests_is_not_a_503() {
    let env = Env::new(Backend::Memory).await;
    let mut cluster = tokio::task::spawn_blocking(|| RedisCluster::start(3, 0))
        .await
        .expect("start the cluster");
    let yaml = env.config_with("", "timeout: 1s");
    let lines: String = cluster
        .store_lines()
        .lines()
        .map(|l| format!("  {l}\n"))
        .collect();
    let yaml = yaml.replacen("  backend: memory\n", &lines, 1);
    let proxy = TestProxy::start(&yaml).await;
    request_fault_request(&env, &proxy, || {
        tokio::task::block_in_place(|| cluster.restart_all());
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// A release sent again after it landed
// ---------------------------------------------------------------------------------------------

fn held(token: u8) -> Held {
    Held::new(Record::InFlight {
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
        Some(b.record.clone()),
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
    let metrics = Metrics::new();
    let store = RedisStore::cluster(&cluster.seeds(), &RedisAccess::default(), timeout, &metrics)
        .expect("cluster store");
    release_answers(&handle(store, timeout)).await;
}

/// A Redis of the test's own behind a relay, and a store on the relay (2 s timeout): the
/// server, the relay, the store itself and the handle the proxy would put in front of it.
async fn relayed_redis_store() -> (RedisServer, Relay, Arc<RedisStore>, StoreHandle) {
    let redis = RedisServer::start();
    let relay = Relay::start(redis.addr()).await;
    let timeout = Duration::from_secs(2);
    let inner = Arc::new(
        RedisStore::new(&format!("redis://{}/0", relay.addr()), timeout).expect("redis store"),
    );
    let store = StoreHandle::new(inner.clone(), timeout, Arc::new(Metrics::new()));
    (redis, relay, inner, store)
}

/// Sends enough bytes down the store's one connection (a 16 KiB value under `filler`, read back
/// through the store) that a connection opened after it could never reach a byte count cut
/// later on this one; and checks that it is still the one connection.
async fn fill_the_connection(
    redis: &RedisServer,
    inner: &RedisStore,
    relay: &Relay,
    filler: StoreKey,
) {
    let _: () = redis::cmd("SET")
        .arg(filler.text())
        .arg(vec![b'x'; 16 * 1024])
        .query(&mut redis.conn())
        .expect("SET filler");
    let filler = inner.get(&filler).await.expect("read the filler");
    assert_eq!(filler.map(|f| f.len()), Some(16 * 1024));
    assert_eq!(relay.stats().accepted, 1, "one connection so far");
}

/// The connection breaks after Redis ran a release and before its answer came back: the store
/// sends the release again on a new connection, which finds the key gone — released, not a
/// store error and not a lost lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_release_whose_answer_was_lost_is_released() {
    let (redis, relay, inner, store) = relayed_redis_store().await;
    let key = &store_key(22);
    let a = held(1);
    assert_eq!(
        store
            .claim(key, &a, Duration::from_secs(30))
            .await
            .expect("claim"),
        Claim::Claimed
    );
    fill_the_connection(&redis, &inner, &relay, store_key(23)).await;
    relay.cut_after(Direction::Down, Some(relay.stats().bytes_down));

    let released = store.release(key, &a).await;
    assert_eq!(relay.stats().resets, 1, "the release's answer was cut off");
    assert!(
        released.as_ref().is_ok_and(|r| *r),
        "sent again, the release finds the key gone: released, got {released:?}"
    );
    let left: Option<Vec<u8>> = redis::cmd("GET")
        .arg(key.text())
        .query(&mut redis.conn())
        .expect("GET");
    assert_eq!(left, None, "the claim is gone");
}

/// Both tries share the operation's one deadline: the connection is closed under the store
/// and Redis then hangs (SIGSTOP), so the first try fails at once and the second waits for a
/// reconnection that never finishes; the claim is a timeout after `store.timeout`, not after
/// twice that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_try_stays_within_store_timeout() {
    let redis = RedisServer::start();
    let timeout = Duration::from_millis(800);
    let store = handle(
        RedisStore::new(&redis.url(), timeout).expect("redis store"),
        timeout,
    );
    assert_eq!(
        store
            .claim(&store_key(31), &held(1), Duration::from_secs(30))
            .await
            .expect("warm"),
        Claim::Claimed
    );
    let _: () = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("normal")
        .arg("SKIPME")
        .arg("yes")
        .query(&mut redis.conn())
        .expect("CLIENT KILL");
    redis.pause();
    let started = std::time::Instant::now();
    let claim = store
        .claim(&store_key(32), &held(1), Duration::from_secs(30))
        .await;
    let took = started.elapsed();
    redis.resume();
    assert!(
        matches!(claim, Err(StoreError::Timeout { .. })),
        "the second try waited for the hung Redis: {claim:?}"
    );
    assert!(
        took < timeout + Duration::from_millis(400),
        "both tries within one store.timeout ({timeout:?}): took {took:?}"
    );
}

/// Redis down — nothing listens on its port, every connection is refused — is a store error at
/// once, every time, not a wait for reconnections until `store.timeout`; and once Redis is back
/// the next claim is served, without a restart of the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_is_an_error_at_once_and_redis_back_is_served() {
    let mut redis = RedisServer::start();
    let timeout = Duration::from_secs(3);
    let store = handle(
        RedisStore::new(&redis.url(), timeout).expect("redis store"),
        timeout,
    );
    let lease = Duration::from_secs(30);
    assert_eq!(
        store
            .claim(&store_key(41), &held(1), lease)
            .await
            .expect("warm"),
        Claim::Claimed
    );
    redis.kill();
    for n in 0..4u8 {
        let started = std::time::Instant::now();
        let claim = store.claim(&store_key(42 + n), &held(1), lease).await;
        let took = started.elapsed();
        assert!(
            matches!(claim, Err(StoreError::Backend { .. })),
            "try {n}: a refused connection is a backend error: {claim:?}"
        );
        assert!(
            took < Duration::from_millis(500),
            "try {n}: refused at once, not after waiting for reconnections (store.timeout {timeout:?}): took {took:?}"
        );
    }
    tokio::task::block_in_place(|| redis.restart());
    assert_eq!(
        store
            .claim(&store_key(50), &held(1), lease)
            .await
            .expect("Redis is back"),
        Claim::Claimed
    );
}

/// With `wait_replicas`, a claim whose answer was lost (the connection broke after Redis ran
/// the `SET`) is sent again on a new connection, finds its own claim, and writes nothing
/// there. `WAIT` waits for the offset its connection last noted, so the claim must still be
/// waited for: with the replica stopped, the claim is refused (too few replicas), not taken as
/// acknowledged. (Redis 7.0 notes the offset after every command, so the found claim is
/// covered anyway; Redis versions that note it only after a write need the store's renewal of
/// the found claim on the new connection.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_sent_again_still_waits_for_the_replicas() {
    let primary = RedisServer::start();
    let port = primary.port();
    let replica = tokio::task::spawn_blocking(move || {
        let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &port.to_string()]);
        wait_linked(&replica);
        replica
    })
    .await
    .expect("start the replica");
    let relay = Relay::start(primary.addr()).await;
    let timeout = Duration::from_millis(500);
    let metrics = Arc::new(Metrics::new());
    let inner = RedisStore::connect(
        &format!("redis://{}/0", relay.addr()),
        &RedisAccess::default(),
        1,
        timeout,
        metrics.clone(),
    )
    .expect("redis store");
    let store = StoreHandle::new(Arc::new(inner), timeout, metrics);

    // A claim of a key holding 16 KiB sends them down the pooled connection: a new connection
    // never gets as far as the cut below.
    let filler = store_key(41);
    let _: () = redis::cmd("SET")
        .arg(filler.text())
        .arg(vec![b'x'; 16 * 1024])
        .query(&mut primary.conn())
        .expect("SET filler");
    let found = store
        .claim(&filler, &held(1), Duration::from_secs(30))
        .await;
    assert!(found.is_err(), "the filler is no record: {found:?}");
    assert_eq!(relay.stats().accepted, 1, "one pooled connection so far");
    relay.cut_after(Direction::Down, Some(relay.stats().bytes_down));

    replica.pause();
    let key = &store_key(42);
    let a = held(1);
    let claim = store.claim(key, &a, Duration::from_secs(30)).await;
    replica.resume();
    assert_eq!(relay.stats().resets, 1, "the claim's answer was cut off");
    assert!(
        matches!(claim, Err(StoreError::ReplicasMissing { acked: 0, .. })),
        "the stopped replica never acknowledged the claim: {claim:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Large records on Redis: staged under a key of their own, then moved under the record key
// ---------------------------------------------------------------------------------------------

/// The keyspace events (`(event, key)`) of one Redis server, from [`KeyEvents::start`] until
/// [`KeyEvents::stop`], read by a subscriber on a thread of its own.
struct KeyEvents {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<(String, String)>>,
}

impl KeyEvents {
    /// Turns on the events of generic and string commands (`SET`, `EXPIRE`, `RENAME`, `DEL`
    /// …) on the server of `conn`, and subscribes to them on `listener`, a connection to the
    /// same server.
    fn start(mut conn: redis::Connection, mut listener: redis::Connection) -> KeyEvents {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("notify-keyspace-events")
            .arg("Eg$")
            .query(&mut conn)
            .expect("CONFIG SET notify-keyspace-events");
        let stop = Arc::new(AtomicBool::new(false));
        let (ready, subscribed) = std::sync::mpsc::channel();
        let thread = std::thread::spawn({
            let stop = stop.clone();
            move || {
                let mut pubsub = listener.as_pubsub();
                pubsub.psubscribe("__keyevent@*__:*").expect("PSUBSCRIBE");
                pubsub
                    .set_read_timeout(Some(Duration::from_millis(200)))
                    .expect("read timeout");
                ready.send(()).expect("the test waits");
                let mut events = Vec::new();
                loop {
                    match pubsub.get_message() {
                        Ok(msg) => {
                            let event = msg
                                .get_channel_name()
                                .rsplit_once("__:")
                                .map(|(_, e)| e.to_owned())
                                .unwrap_or_default();
                            let key: String = msg.get_payload().expect("a key name");
                            events.push((event, key));
                        }
                        // Quiet for a read timeout: everything sent before `stop` is in.
                        Err(e) if e.is_timeout() => {
                            if stop.load(Ordering::Relaxed) {
                                return events;
                            }
                        }
                        Err(e) => panic!("reading keyspace events: {e}"),
                    }
                }
            }
        });
        subscribed.recv().expect("the subscriber is ready");
        KeyEvents { stop, thread }
    }

    /// Every event since the start, in order.
    fn stop(self) -> Vec<(String, String)> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("the subscriber")
    }
}

/// The events of `events` about `key`, in order.
fn events_of<'a>(events: &'a [(String, String)], key: &str) -> Vec<&'a str> {
    events
        .iter()
        .filter(|(_, k)| k == key)
        .map(|(e, _)| e.as_str())
        .collect()
}

/// On Redis and on a Redis Cluster, as the store sees them: a large record is first written to
/// a staging key of its own with a TTL (`set`, then `expire`: a staging key left behind by a
/// proxy that died between the two steps expires by itself), named by the claim's token; the
/// holder's is moved under the record key (`rename`), a lapsed holder's is deleted and never
/// becomes the key's record. Afterwards the record key alone is left, with the record's TTL,
/// and `forget` leaves nothing.
async fn a_large_record_is_staged_with_a_ttl_and_leaves_no_key_behind(backend: Backend) {
    let env = Env::new(backend).await;
    let raw = env.store().await;
    let store = harness::store_checks::handle(raw.clone());
    let events = KeyEvents::start(env.redis_conn(), env.redis_conn());
    let key = &store_key(51);
    let (a, b) = (held(1), held(2));
    let (from_a, from_b) = (
        harness::store_checks::large(b'a'),
        harness::store_checks::large(b'b'),
    );
    let hour = Duration::from_secs(3600);

    assert_eq!(
        store
            .claim(key, &a, Duration::from_millis(200))
            .await
            .expect("A claims"),
        Claim::Claimed
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while store.get(key).await.expect("get").is_some() {
        assert!(
            std::time::Instant::now() < deadline,
            "A's lease did not lapse"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        store.claim(key, &b, hour).await.expect("B claims"),
        Claim::Claimed
    );
    assert!(
        !store
            .save(key, &a, &from_a.encode(), hour)
            .await
            .expect("A completes late"),
        "A's lease is lost"
    );
    assert!(
        store
            .save(key, &b, &from_b.encode(), hour)
            .await
            .expect("B completes")
    );
    let events = events.stop();

    let staged = |token: u8| format!("{}:staged:{}", key.text(), hex(&[token; 16]));
    let staging: Vec<&str> = {
        let mut keys: Vec<&str> = events
            .iter()
            .map(|(_, k)| k.as_str())
            .filter(|k| k.starts_with(&format!("{}:staged:", key.text())))
            .collect();
        keys.dedup();
        keys
    };
    assert_eq!(staging.len(), 2, "one staging key per holder: {events:?}");
    let (a_staged, b_staged) = (staging[0], staging[1]);
    assert!(
        a_staged.starts_with(&staged(1)),
        "{a_staged} names A's token"
    );
    assert!(
        b_staged.starts_with(&staged(2)),
        "{b_staged} names B's token"
    );
    assert_eq!(
        events_of(&events, a_staged),
        ["set", "expire", "del"],
        "A's record: staged with a TTL, then deleted by the fenced script"
    );
    assert_eq!(
        events_of(&events, b_staged),
        ["set", "expire", "rename_from"],
        "B's record: staged with a TTL, then moved"
    );
    let record = events_of(&events, &key.text());
    assert!(
        record.ends_with(&["rename_to", "expire"]),
        "the record key: B's claim, then B's record with the record's TTL: {record:?}"
    );

    let keys = env.stored_keys();
    assert_eq!(keys.len(), 1, "the record key alone: {keys:?}");
    assert_eq!(keys[0].key, key.text());
    let ttl = keys[0].ttl.expect("a TTL");
    assert!(
        ttl > hour - Duration::from_secs(60) && ttl <= hour,
        "the record's TTL: {ttl:?}"
    );
    assert_eq!(
        store.get(key).await.expect("get"),
        Some(from_b),
        "B's record, whole"
    );
    assert_eq!(raw.forget(key).await.expect("forget"), Forgotten::Forgotten);
    assert_eq!(env.stored_key_names(), Some(Vec::new()), "nothing is left");
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_large_record_is_staged_with_a_ttl_and_leaves_no_key_behind() {
    a_large_record_is_staged_with_a_ttl_and_leaves_no_key_behind(Backend::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_large_record_is_staged_with_a_ttl_and_leaves_no_key_behind() {
    harness::warm_up();
    a_large_record_is_staged_with_a_ttl_and_leaves_no_key_behind(Backend::RedisCluster).await;
}

/// The connection breaks after Redis ran a staged save whole (the `SET` and the move)
/// and before the script's answer came back: the store sends both again on a new connection;
/// the script finds the very record under the key, deletes the second staged copy and answers
/// done. Saved once, moved once, nothing left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_large_completion_whose_answer_was_lost_is_done() {
    let (redis, relay, inner, store) = relayed_redis_store().await;
    let a = held(1);
    let long = Duration::from_secs(30);

    // A first staged save loads the script (no NOSCRIPT answer below).
    let warm = &store_key(52);
    assert_eq!(
        store.claim(warm, &a, long).await.expect("claim"),
        Claim::Claimed
    );
    let record = harness::store_checks::large(b'w').encode();
    assert!(store.save(warm, &a, &record, long).await.expect("warm"));

    let key = &store_key(53);
    assert_eq!(
        store.claim(key, &a, long).await.expect("claim"),
        Claim::Claimed
    );
    fill_the_connection(&redis, &inner, &relay, store_key(54)).await;
    // The `SET`'s `+OK` passes; the script's answer is cut off.
    relay.cut_after(Direction::Down, Some(relay.stats().bytes_down + 5));

    let record = harness::store_checks::large(b'x').encode();
    let done = store.save(key, &a, &record, long).await;
    assert_eq!(relay.stats().resets, 1, "the script's answer was cut off");
    assert!(
        done.as_ref().is_ok_and(|d| *d),
        "sent again, the completion finds its own record: done, got {done:?}"
    );
    let stored: Option<Vec<u8>> = redis::cmd("GET")
        .arg(key.text())
        .query(&mut redis.conn())
        .expect("GET");
    assert!(stored.as_deref() == Some(&record[..]), "the record, whole");
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut redis.conn())
        .expect("INFO commandstats");
    assert!(
        stats.contains("cmdstat_rename:calls=2,"),
        "moved once for each key: the second try found the record in place\n{stats}"
    );
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query(&mut redis.conn())
        .expect("KEYS");
    assert!(
        keys.iter().all(|k| !k.contains(":staged:")),
        "no staging key is left: {keys:?}"
    );
}
