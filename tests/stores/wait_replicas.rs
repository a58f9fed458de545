//! `store.wait_replicas` (SPEC §3, §4.5) on a real primary and replica on loopback: a claim
//! counts only once enough replicas acknowledge it (`WAIT`); fewer in time, and the claim is
//! released and the request refused with 503 before anything is forwarded. A save fewer
//! replicas acknowledge still answers the client, and is counted. The `WAIT` runs on a
//! dedicated connection, so a slow one does not stall anyone else's store operations.

use std::time::{Duration, Instant};

use harness::cluster::wait_for;
use harness::store_checks::resolvable as claims;
use harness::{
    Backend, Env, ProxyProcess, RedisServer, Reply, TestProxy, book_with, booking_store_key,
    client, eventually, send, spawn_booking,
};
use idemproxy::metrics::StoreOp;
use idemproxy::record::Record;
use idemproxy::store::StoreHandle;
use std::sync::Arc;

const BODY: &str = r#"{"seat":"12A"}"#;

/// A primary (the [`Env`]'s Redis) with one replica in sync.
struct Replicated {
    env: Env,
    replica: RedisServer,
}

impl Replicated {
    async fn new() -> Replicated {
        let env = Env::new(Backend::Redis).await;
        let primary = env.redis().port();
        let replica = tokio::task::spawn_blocking(move || {
            let replica =
                RedisServer::start_with(&["--replicaof", "127.0.0.1", &primary.to_string()]);
            wait_in_sync(&replica);
            replica
        })
        .await
        .expect("start the replica");
        Replicated { env, replica }
    }

    /// The harness's configuration with `wait_replicas` and `store` lines.
    fn config(&self, idem: &str, store: &str) -> String {
        self.env.config_with(idem, store)
    }

    async fn proxy(&self, idem: &str, store: &str) -> TestProxy {
        TestProxy::start(&self.config(idem, store)).await
    }

    /// Resumes the replica and waits until it is in sync again.
    async fn resume_replica(&self) {
        self.replica.resume();
        let port = self.replica.port();
        tokio::task::spawn_blocking(move || {
            wait_for(Duration::from_secs(10), "the replica to catch up", || {
                link_up(port)
            })
        })
        .await
        .expect("replica in sync");
    }
}

fn link_up(port: u16) -> bool {
    let Ok(client) = redis::Client::open(format!("redis://127.0.0.1:{port}/0")) else {
        return false;
    };
    let Ok(mut c) = client.get_connection_with_timeout(Duration::from_millis(500)) else {
        return false;
    };
    redis::cmd("INFO")
        .arg("replication")
        .query::<String>(&mut c)
        .is_ok_and(|i| i.contains("master_link_status:up"))
}

fn wait_in_sync(replica: &RedisServer) {
    let port = replica.port();
    wait_for(Duration::from_secs(10), "the replica to sync", || {
        link_up(port)
    });
}

async fn post(proxy: &TestProxy, key: &str, extra: &[(&str, &str)]) -> Reply {
    book_with(&proxy.url(""), key, BODY, extra).await
}

fn assert_forwarded(r: &Reply) {
    assert_eq!(r.status, 201, "forwarded; body: {:?}", r.body);
    assert_eq!(r.header("idempotent-replayed"), "", "not a replay");
}

fn assert_replay_of(r: &Reply, first: &Reply) {
    assert_eq!(r.status, first.status, "replayed status");
    assert_eq!(r.header("idempotent-replayed"), "true", "replay marker");
    assert_eq!(r.body, first.body, "replayed body is byte-identical");
}

/// What the key holds on the server at `port`.
fn value_at(port: u16, key: &str) -> Option<Vec<u8>> {
    let mut c = redis::Client::open(format!("redis://127.0.0.1:{port}/0"))
        .expect("url")
        .get_connection_with_timeout(Duration::from_secs(2))
        .expect("connect");
    redis::cmd("GET").arg(key).query(&mut c).expect("GET")
}

/// The writes for `op` fewer replicas acknowledged than `store.wait_replicas` asks, as counted.
fn acks_missing(proxy: &TestProxy, op: StoreOp) -> f64 {
    proxy.metric(
        "idemproxy_replica_acks_missing_total",
        &[("op", op.as_str())],
    )
}

/// With the replica in sync: forwarded once, replayed; both the claim and the record reached
/// the replica before anyone was told; no short acknowledgement counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_claims_forward_and_replay() {
    let r = Replicated::new().await;
    let proxy = r.proxy("", "wait_replicas: 1").await;
    let first = post(&proxy, "wr-1", &[]).await;
    assert_forwarded(&first);
    assert_replay_of(&post(&proxy, "wr-1", &[]).await, &first);
    assert_eq!(r.env.mock.calls("wr-1"), 1);
    assert!(
        value_at(r.replica.port(), &booking_store_key("wr-1")).is_some(),
        "the saved record is on the replica"
    );
    // The series are exported from the start (metric_value panics on a missing one).
    assert_eq!(acks_missing(&proxy, StoreOp::Claim), 0.0);
    assert_eq!(acks_missing(&proxy, StoreOp::Save), 0.0);
}

/// A large response is saved in two writes on the dedicated connection (the staging `SET`,
/// then the script that moves it under the key), and the save's `WAIT` covers both: by the
/// time the client has its response, the replica holds the whole record under the key and no
/// staging key; nothing came up short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_large_record_is_whole_on_the_replica() {
    let r = Replicated::new().await;
    let proxy = r.proxy("max_response_body: 1MiB", "wait_replicas: 1").await;
    let large = [("X-Mock-Body-Size", "65536")];
    let first = post(&proxy, "wr-large", &large).await;
    assert_forwarded(&first);
    assert_eq!(first.body.len(), 65536);
    let key = booking_store_key("wr-large");
    let on_replica = value_at(r.replica.port(), &key).expect("the record is on the replica");
    assert_eq!(
        Some(on_replica),
        value_at(r.env.redis().port(), &key),
        "the replica holds the primary's record, whole"
    );
    let mut replica = r.replica.conn();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query(&mut replica)
        .expect("KEYS");
    assert_eq!(keys, [key], "no staging key on the replica");
    assert_replay_of(&post(&proxy, "wr-large", &[]).await, &first);
    assert_eq!(r.env.mock.calls("wr-large"), 1);
    assert_eq!(acks_missing(&proxy, StoreOp::Save), 0.0);
}

/// The replica stopped (SIGSTOP): the claim is not acknowledged within `store.timeout`, so it
/// is released and the request gets 503 — with `on_store_error: forward` too — and nothing is
/// forwarded. The key is free again: once the replica is back, the same key is forwarded,
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unacknowledged_claim_is_released_and_refused() {
    let r = Replicated::new().await;
    let reject = r.proxy("", "wait_replicas: 1").await;
    let forward = r.proxy("on_store_error: forward", "wait_replicas: 1").await;
    r.replica.pause();
    for (name, proxy) in [("reject", &reject), ("forward", &forward)] {
        let started = Instant::now();
        let refused = post(proxy, "wr-paused", &[]).await;
        let took = started.elapsed();
        let doc = refused.assert_problem(503, "store-unavailable");
        assert!(
            doc["detail"]
                .as_str()
                .is_some_and(|d| d.contains("replicas")),
            "{name}: the detail says why: {doc}"
        );
        assert!(
            took < Duration::from_secs(3),
            "{name}: refused in bounded time, took {took:?}"
        );
        assert_eq!(
            r.env.mock.calls("wr-paused"),
            0,
            "{name}: nothing forwarded"
        );
        assert_eq!(
            value_at(r.env.redis().port(), &booking_store_key("wr-paused")),
            None,
            "{name}: the claim was released"
        );
    }
    assert_eq!(acks_missing(&reject, StoreOp::Claim), 1.0);

    r.resume_replica().await;
    let first = post(&reject, "wr-paused", &[]).await;
    assert_forwarded(&first);
    assert_replay_of(&post(&forward, "wr-paused", &[]).await, &first);
    assert_eq!(r.env.mock.calls("wr-paused"), 1, "forwarded once, after");
}

/// A claim waiting for a stopped replica (up to a 1.9s `store.timeout`: shorter than the 2s lease
/// of the harness's `pay` route, as every store deadline must be) holds only its own
/// dedicated connection: meanwhile readiness pings, replays and conflicts answer at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_wait_does_not_stall_other_requests() {
    let r = Replicated::new().await;
    let proxy = r.proxy("", "wait_replicas: 1\ntimeout: 1900ms").await;
    let warm = post(&proxy, "wr-warm", &[]).await;
    assert_forwarded(&warm);
    let in_flight = spawn_booking(proxy.url(""), "wr-in-flight", BODY, "3s");
    assert!(
        eventually(Duration::from_secs(5), || r.env.mock.calls("wr-in-flight")
            == 1)
        .await,
        "acknowledged, forwarded"
    );

    r.replica.pause();
    let stalled = {
        let url = proxy.url("/bookings");
        tokio::spawn(async move {
            let started = Instant::now();
            let reply = send(
                client()
                    .post(url)
                    .header("Idempotency-Key", "wr-stalled")
                    .header("Content-Type", "application/json")
                    .body(BODY),
            )
            .await;
            (reply, started.elapsed())
        })
    };
    // Let its WAIT start.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for round in 0..5 {
        let started = Instant::now();
        proxy.proxy.store().ping().await.expect("ping");
        let replay = post(&proxy, "wr-warm", &[]).await;
        assert_replay_of(&replay, &warm);
        post(&proxy, "wr-in-flight", &[])
            .await
            .assert_problem(409, "request-in-progress");
        let took = started.elapsed();
        assert!(
            took < Duration::from_millis(800),
            "round {round}: a ping, a replay and a 409 took {took:?} while a WAIT blocked"
        );
    }
    let (reply, took) = stalled.await.expect("the stalled claim");
    reply.assert_problem(503, "store-unavailable");
    assert!(
        took >= Duration::from_millis(1500),
        "the stalled claim waited for its replica ({took:?})"
    );
    assert_eq!(r.env.mock.calls("wr-stalled"), 0);
    r.replica.resume();
    let _ = in_flight.await.expect("the slow request");
}

/// The replica stops after the claim was acknowledged and while the upstream works: the
/// save's `WAIT` comes up short. The client still gets the upstream's response, the record is
/// saved (replayed), and the shortfall is counted for `complete`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unacknowledged_save_still_answers_and_is_counted() {
    let r = Replicated::new().await;
    let proxy = r.proxy("", "wait_replicas: 1").await;
    let first = spawn_booking(proxy.url(""), "wr-save", BODY, "800ms");
    assert!(eventually(Duration::from_secs(5), || r.env.mock.calls("wr-save") == 1).await);
    r.replica.pause();
    let first = first.await.expect("the request");
    assert_forwarded(&first);
    assert!(
        eventually(Duration::from_secs(3), || {
            acks_missing(&proxy, StoreOp::Save) == 1.0
        })
        .await,
        "the short acknowledgement of the save is counted"
    );
    assert_eq!(proxy.lost_leases(), 0, "the save landed: no lease lost");
    let saved = value_at(r.env.redis().port(), &booking_store_key("wr-save")).expect("saved");
    assert!(
        saved.starts_with(b"IDP"),
        "a finished record on the primary"
    );
    r.resume_replica().await;
    assert_replay_of(&post(&proxy, "wr-save", &[]).await, &first);
    assert_eq!(r.env.mock.calls("wr-save"), 1);
}

/// At start, a primary with fewer replicas than `wait_replicas` is warned about: every claim
/// would be refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_few_replicas_are_warned_about_at_start() {
    let r = Replicated::new().await;
    let p = ProxyProcess::spawn(&r.config("", "wait_replicas: 2"));
    let warned = eventually(Duration::from_secs(5), || {
        p.log().lines().any(|l| {
            l.contains("WARN") && l.contains("wait_replicas is 2") && l.contains("1 replica")
        })
    })
    .await;
    assert!(warned, "no warning; log:\n{}", p.log());
}

/// With `store.wait_replicas`, a fresh claim too few replicas acknowledged is released (it was
/// never sent), and a takeover is not (it may have been sent: it stays to be resolved).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_claim_too_few_replicas_acknowledge_is_released_and_a_takeover_kept() {
    use harness::RedisServer;
    use idemproxy::config::RedisAccess;
    use idemproxy::metrics::Metrics;
    use idemproxy::store::StoreError;
    use idemproxy::store::redis::RedisStore;

    let env = Env::new(Backend::Redis).await;
    let primary = env.redis().port();
    let replica = tokio::task::spawn_blocking(move || {
        RedisServer::start_with(&["--replicaof", "127.0.0.1", &primary.to_string()])
    })
    .await
    .expect("start the replica");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut c = ::redis::Client::open(replica.url())
            .expect("replica url")
            .get_connection_with_timeout(Duration::from_secs(1))
            .expect("connect to the replica");
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
    let timeout = Duration::from_millis(500);
    let metrics = Arc::new(Metrics::new());
    let store = RedisStore::connect(
        &env.redis().url(),
        &RedisAccess::default(),
        1,
        timeout,
        metrics.clone(),
    )
    .expect("redis store");
    let s = StoreHandle::new(Arc::new(store), timeout, metrics);
    let lifetime = Duration::from_secs(60);
    let a = claims::resolvable(Duration::from_secs(30));
    let (a, _) = claims::ours(
        s.claim_resolvable(&claims::key(5), &a, claims::times(Duration::ZERO, lifetime))
            .await
            .expect("an acknowledged claim"),
    );

    replica.pause();
    let fresh = claims::resolvable(Duration::from_secs(30));
    match s
        .claim_resolvable(
            &claims::key(6),
            &fresh,
            claims::times(Duration::ZERO, lifetime),
        )
        .await
    {
        Err(StoreError::ReplicasMissing { .. }) => {}
        other => panic!("expected too few replicas, got {other:?}"),
    }
    assert_eq!(s.get(&claims::key(6)).await.expect("get"), None, "released");

    claims::until_lapsed(&s, &claims::key(5), &a).await;
    let b = claims::resolvable(Duration::from_secs(30));
    match s
        .claim_resolvable(&claims::key(5), &b, claims::times(Duration::ZERO, lifetime))
        .await
    {
        Err(StoreError::ReplicasMissing { .. }) => {}
        other => panic!("expected too few replicas, got {other:?}"),
    }
    assert!(
        matches!(
            s.get(&claims::key(5)).await.expect("get"),
            Some(Record::Resolvable(_))
        ),
        "a takeover stays to be resolved"
    );
    replica.resume();
}
