//! The PostgreSQL store against servers of the test's own: the store contract, the table as
//! documented, one execution per key across instances, crashes, a stopped database, a
//! database down at start, the schema's version and setup, the sweep, TLS.
//!
//! Tests that stop, pause or crash the database start a private server ([`PgServer::start`]);
//! the others share one ([`PgServer::shared`]), each in a schema of its own.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use harness::postgres::{PgServer, on_postgres, store_block, store_only};
use harness::relay::Relay;
use harness::{Backend, Env, ProxyProcess, Reply, book_with, client, free_port, send};
use idemproxy::config::{BackendSettings, Config};
use idemproxy::metrics::Metrics;
use idemproxy::record::Record;
use idemproxy::store::postgres::PostgresStore;
use idemproxy::store::{Claim, Forgotten, Held, Store, StoreHandle, StoreKey};

// The store contract, each check a test of its own (`harness::store_checks`): a schema of its own; shared by several proxies.
harness::store_contract!(Postgres { shared });

const BODY: &str = r#"{"room":"101"}"#;

/// The harness: a private server on a free port, as an unprivileged user, crash and restart.
#[test]
fn the_harness_runs_a_private_server_that_survives_a_crash() {
    let mut pg = PgServer::start();
    pg.sql("CREATE TABLE t (v int); INSERT INTO t VALUES (7)");
    pg.crash();
    pg.start_again();
    assert_eq!(pg.sql("SELECT v FROM t"), "7");
    assert_ne!(pg.port(), 5432);
}

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// A store on `url` and `schema` with `extra` store lines, built as the proxy builds it, and the
/// handle the proxy would put in front of it.
async fn open(url: &str, schema: &str, extra: &str) -> (Arc<PostgresStore>, StoreHandle) {
    try_open(url, schema, extra)
        .await
        .unwrap_or_else(|e| panic!("open the store: {e}"))
}

async fn try_open(
    url: &str,
    schema: &str,
    extra: &str,
) -> Result<(Arc<PostgresStore>, StoreHandle), idemproxy::store::StoreError> {
    let yaml = store_only(&store_block(url, schema, extra));
    let config = Config::from_yaml(&yaml).unwrap_or_else(|e| panic!("config: {e}\n{yaml}"));
    let BackendSettings::Postgres(settings) = &config.store.backend else {
        panic!("not a postgres store: {yaml}");
    };
    let metrics = Arc::new(Metrics::new());
    let store =
        Arc::new(PostgresStore::connect(settings, config.store.timeout, metrics.clone()).await?);
    let handle = StoreHandle::new(store.clone(), config.store.timeout, metrics);
    Ok((store, handle))
}

fn key(n: u32) -> StoreKey {
    let mut id = [0u8; 32];
    id[..4].copy_from_slice(&n.to_be_bytes());
    StoreKey::new(
        idemproxy::key::namespace("idemproxy:", "create-booking"),
        0,
        id,
    )
}

fn held(token: u8) -> Held {
    Held::new(Record::InFlight {
        token: [token; 16],
        fingerprint: [7; 32],
    })
}

/// Rows in the schema's table: all of them, and the live ones.
fn rows(pg: &PgServer, schema: &str) -> (u64, u64) {
    let out = pg.sql(&format!(
        "SELECT count(*), count(*) FILTER (WHERE expires_at > now()) FROM {schema}.records"
    ));
    let (all, live) = out.split_once('|').expect("two counts");
    (
        all.parse().expect("a count"),
        live.parse().expect("a count"),
    )
}

/// `/readyz` of the admin listener at `admin`.
async fn readyz(admin: u16) -> u16 {
    send(client().get(format!("http://127.0.0.1:{admin}/readyz")))
        .await
        .status
}

/// The pool's gauges on the admin listener at `admin`: connections open, and in use.
async fn pool_gauges(admin: u16) -> (u64, u64) {
    let text = send(client().get(format!("http://127.0.0.1:{admin}/metrics"))).await;
    let text = String::from_utf8_lossy(&text.body);
    let gauge = |name| harness::metric_value(&text, name, &[]) as u64;
    (
        gauge("idemproxy_postgres_pool_connections"),
        gauge("idemproxy_postgres_pool_in_use"),
    )
}

/// `yaml` with an admin listener on `port`.
fn with_admin(yaml: &str, port: u16) -> String {
    let out = yaml.replacen(
        "listen: 127.0.0.1:0\n",
        &format!("listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:{port}\n"),
        1,
    );
    assert_ne!(out, yaml, "the harness's listen line moved");
    out
}

fn assert_replay_of(again: &Reply, first: &Reply) {
    assert_eq!(again.status, first.status, "body: {:?}", again.body);
    assert_eq!(again.header("idempotent-replayed"), "true");
    assert_eq!(again.body, first.body, "the replay is byte-identical");
    assert_eq!(again.header_lines(), first.header_lines());
}

/// A new key through `base`, forwarded once the store answers: each attempt, every 100ms for at
/// most `within`, uses a key of its own (`{prefix}-{n}`), since a claim refused with a 503 for
/// a timeout may still land and hold its key for its lease. Returns the key and its reply.
async fn first_forwarded(base: &str, prefix: &str, within: Duration) -> (String, Reply) {
    let deadline = Instant::now() + within;
    for n in 0.. {
        let key = format!("{prefix}-{n}");
        let r = book_with(base, &key, BODY, &[]).await;
        if r.status == 201 || Instant::now() > deadline {
            assert_eq!(r.status, 201, "{key}: {:?}", r.body);
            return (key, r);
        }
        r.assert_problem(503, "store-unavailable");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    unreachable!("the loop returns")
}

/// A repeat of a finished key through `base`, once the store answers again: 503s are retried
/// every 100ms for at most `within` (a replay writes nothing, so a refused one leaves nothing).
async fn once_the_store_answers(base: &str, key: &str, within: Duration) -> Reply {
    let deadline = Instant::now() + within;
    loop {
        let r = book_with(base, key, BODY, &[]).await;
        if r.status != 503 || Instant::now() > deadline {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// The store contract and the table
// ---------------------------------------------------------------------------------------------

/// SPEC §4.4: a holder whose lease lapsed is fenced off by the token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lease_is_fenced() {
    let pg = PgServer::shared();
    let (_, store) = open(&pg.url(), &PgServer::fresh_schema(), "").await;
    harness::store_checks::stale_holder_cannot_overwrite_a_newer_holder(&store).await;
}

/// Release, forget, inspect and a repeated save answer as on the other stores, and the
/// table is the documented one (logged, tuned for churn, token cleared once finished).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_contract_and_the_table_as_documented() {
    let pg = PgServer::shared();
    let schema = PgServer::fresh_schema();
    let (store, handle) = open(&pg.url(), &schema, "").await;
    let lease = Duration::from_secs(30);
    let (a, b) = (held(1), held(2));
    let done = harness::store_checks::done([7; 32], r#"{"id":"1"}"#).encode();

    // Release: ours → true; gone → true; another's claim → false; a finished record → false.
    assert_eq!(
        handle.claim(&key(1), &a, lease).await.ok(),
        Some(Claim::Claimed)
    );
    assert!(!handle.release(&key(1), &b).await.expect("release"));
    assert!(handle.release(&key(1), &a).await.expect("release"));
    assert!(handle.release(&key(1), &a).await.expect("release again"));
    assert_eq!(handle.get(&key(1)).await.expect("get"), None);

    // Saving, sent twice; then nobody may release or renew the finished record.
    assert_eq!(
        handle.claim(&key(2), &a, lease).await.ok(),
        Some(Claim::Claimed)
    );
    let token = pg.sql(&format!(
        "SELECT encode(token, 'hex') FROM {schema}.records WHERE key = '{}'",
        key(2).text()
    ));
    assert_eq!(token, "01".repeat(16), "the claim's token, in its column");
    assert!(
        handle
            .save(&key(2), &a, &done, lease)
            .await
            .expect("complete")
    );
    assert!(handle.save(&key(2), &a, &done, lease).await.expect("again"));
    let other = harness::store_checks::done([7; 32], r#"{"id":"2"}"#).encode();
    assert!(
        !handle
            .save(&key(2), &a, &other, lease)
            .await
            .expect("other bytes")
    );
    assert!(!handle.release(&key(2), &a).await.expect("release"));
    assert!(!handle.renew(&key(2), &a, lease).await.expect("renew"));
    assert_eq!(
        pg.sql(&format!(
            "SELECT token IS NULL, value = '\\x{}'::bytea FROM {schema}.records WHERE key = '{}'",
            hex::encode(&done),
            key(2).text()
        )),
        "t|t",
        "finished: no token, the encoded record as value"
    );
    match handle.claim(&key(2), &b, lease).await.expect("claim") {
        Claim::Existing(r) => assert_eq!(r.encode(), done),
        other => panic!("a finished key replays, got {other:?}"),
    }

    // Inspect: the remaining time on the server's clock.
    let (bytes, left) = store
        .inspect(&key(2))
        .await
        .expect("inspect")
        .expect("there");
    assert_eq!(bytes, done);
    assert!(
        left <= lease && left > lease - Duration::from_secs(5),
        "{left:?}"
    );
    assert_eq!(store.inspect(&key(9)).await.expect("inspect"), None);

    // Forget: only a finished record.
    assert_eq!(
        handle.claim(&key(3), &a, lease).await.ok(),
        Some(Claim::Claimed)
    );
    assert_eq!(
        store.forget(&key(3)).await.expect("forget"),
        Forgotten::InFlight
    );
    assert_eq!(
        store.forget(&key(2)).await.expect("forget"),
        Forgotten::Forgotten
    );
    assert_eq!(
        store.forget(&key(2)).await.expect("forget"),
        Forgotten::Absent
    );
    pg.sql(&format!(
        "INSERT INTO {schema}.records VALUES ('{}', NULL, '\\x0102'::bytea, now() + interval '1 hour')",
        key(4).text()
    ));
    assert_eq!(
        store.forget(&key(4)).await.expect("forget"),
        Forgotten::NotARecord
    );
    assert!(
        handle.get(&key(4)).await.is_err(),
        "an undecodable record is a store error"
    );

    // A ttl beyond any clock is "forever", not an error.
    assert_eq!(
        handle.claim(&key(5), &a, Duration::MAX).await.ok(),
        Some(Claim::Claimed)
    );
    assert!(
        handle
            .save(&key(5), &a, &done, Duration::MAX)
            .await
            .expect("complete")
    );

    // The table: logged (never UNLOGGED), autovacuum tuned for churn, the version row.
    assert_eq!(
        pg.sql(&format!(
            "SELECT relpersistence, array_to_string(reloptions, ',') FROM pg_class WHERE oid = '{schema}.records'::regclass"
        )),
        "p|autovacuum_vacuum_scale_factor=0.01,autovacuum_analyze_scale_factor=0.02"
    );
    assert_eq!(
        pg.sql(&format!(
            "SELECT string_agg(column_name || ' ' || data_type || ' ' || is_nullable, ', ' ORDER BY ordinal_position) FROM information_schema.columns WHERE table_schema = '{schema}' AND table_name = 'records'"
        )),
        "key text NO, token bytea YES, value bytea NO, expires_at timestamp with time zone NO, times bytea YES"
    );
    assert_eq!(
        pg.sql(&format!(
            "SELECT count(*) FROM pg_indexes WHERE schemaname = '{schema}' AND indexname = 'records_expires_at'"
        )),
        "1"
    );
    assert_eq!(
        pg.sql(&format!("SELECT version FROM {schema}.schema_version")),
        "2"
    );
}

/// Many claims of one key at once, most of them waiting on the first one's uncommitted insert
/// (the statement runs again then): exactly one wins, every other sees the winner's claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_of_one_key_at_once_have_one_winner() {
    let pg = PgServer::shared();
    // What is checked is atomicity, not latency: 32 claims at once, each one a connection of
    // its own (opened by the first round), must not time out on a loaded 2-core machine.
    let (_, store) = open(
        &pg.url(),
        &PgServer::fresh_schema(),
        "pool_size: 32\ntimeout: 1500ms",
    )
    .await;
    for round in 0..5u32 {
        let claims = (0..32u8).map(|n| {
            let store = store.clone();
            let h = held(n + 1);
            async move {
                let got = store
                    .claim(&key(100 + round), &h, Duration::from_secs(30))
                    .await;
                (h, got)
            }
        });
        let results = futures_util::future::join_all(claims).await;
        let winners: Vec<&Held> = results
            .iter()
            .filter(|(_, got)| matches!(got, Ok(Claim::Claimed)))
            .map(|(h, _)| h)
            .collect();
        assert_eq!(winners.len(), 1, "round {round}: {results:?}");
        for (_, got) in &results {
            match got {
                Ok(Claim::Claimed) => {}
                Ok(Claim::Existing(r)) => assert_eq!(r, &winners[0].record),
                Err(e) => panic!("round {round}: a claim failed: {e}"),
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The claim, measured
// ---------------------------------------------------------------------------------------------

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn summary(mut took: Vec<Duration>) -> String {
    took.sort();
    format!(
        "p50 {:>7.2?}  p99 {:>7.2?}",
        percentile(&took, 0.5),
        percentile(&took, 0.99)
    )
}

/// WAL written between two LSNs.
fn wal_since(pg: &PgServer, lsn: &str) -> u64 {
    pg.sql(&format!(
        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '{lsn}')::bigint"
    ))
    .parse()
    .expect("bytes")
}

/// The claim's replay path only reads: no row lock, no WAL, no flush to wait for. Measured
/// against the shape it avoids (`ON CONFLICT DO UPDATE … WHERE expired`), on a server with
/// `fsync` on, so a flush costs what it costs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_claim_writes_nothing() {
    let pg = PgServer::start_with(&["autovacuum=off"]);
    let schema = "measured";
    let (_, store) = open(&pg.url(), schema, "timeout: 2s").await;
    const N: u32 = 200;
    let lease = Duration::from_secs(60);

    let mut new_keys = Vec::new();
    for n in 0..N {
        let start = Instant::now();
        assert_eq!(
            store.claim(&key(n), &held(1), lease).await.ok(),
            Some(Claim::Claimed)
        );
        new_keys.push(start.elapsed());
    }
    let lsn = pg.sql("SELECT pg_current_wal_lsn()");
    let mut replays = Vec::new();
    for n in 0..N {
        let start = Instant::now();
        assert!(matches!(
            store.claim(&key(n), &held(2), lease).await,
            Ok(Claim::Existing(_))
        ));
        replays.push(start.elapsed());
    }
    let replay_wal = wal_since(&pg, &lsn);

    // The avoided shape, on the same live rows, through a plain client.
    let (client, connection) = tokio_postgres::connect(&pg.url(), tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(connection);
    let upsert = client
        .prepare(&format!(
            "INSERT INTO {schema}.records AS r (key, token, value, expires_at)
             VALUES ($1, $2, $3, now() + interval '1 minute')
             ON CONFLICT (key) DO UPDATE SET token = excluded.token, value = excluded.value,
                 expires_at = excluded.expires_at
             WHERE r.expires_at <= now()
             RETURNING true"
        ))
        .await
        .expect("prepare");
    let lsn = pg.sql("SELECT pg_current_wal_lsn()");
    let mut upserts = Vec::new();
    for n in 0..N {
        let start = Instant::now();
        let rows = client
            .query(
                &upsert,
                &[&key(n).text(), &vec![3u8; 16], &held(3).encoded.to_vec()],
            )
            .await
            .expect("upsert");
        assert!(rows.is_empty(), "a live row is not taken over");
        upserts.push(start.elapsed());
    }
    let upsert_wal = wal_since(&pg, &lsn);

    println!("claims on one connection, {N} each, fsync on:");
    println!("  new key                       {}", summary(new_keys));
    println!(
        "  replay (this store)           {}  WAL {replay_wal} bytes",
        summary(replays)
    );
    println!(
        "  replay (ON CONFLICT DO UPDATE) {}  WAL {upsert_wal} bytes",
        summary(upserts)
    );
    // A background record (a standby snapshot) may land meanwhile; a row lock per replay is
    // tens of bytes each.
    assert!(
        replay_wal < 512,
        "the replay path wrote {replay_wal} bytes of WAL"
    );
    assert!(
        upsert_wal > u64::from(N) * 20,
        "the avoided shape: {upsert_wal}"
    );
}

// ---------------------------------------------------------------------------------------------
// Many instances, crashes, a stopped database
// ---------------------------------------------------------------------------------------------

/// Two instances on one schema, 1,000 requests at once over 20 keys spread over both: the
/// upstream runs once per key, and every answer is the first response, its replay, or a 409,
/// never a 5xx.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_under_a_duplicate_storm_execute_once_per_key() {
    let pg = PgServer::shared();
    let env = Env::new(Backend::Memory).await;
    // 1,000 requests at once on two cores shared with other work: operations queue for the
    // pool, so the deadline is generous (and the pay route's lease, which must outlast it,
    // longer). The claim is what is tested here, not the machine's speed.
    let block = store_block(
        &pg.url(),
        &PgServer::fresh_schema(),
        "timeout: 5s\npool_size: 32",
    );
    let yaml = on_postgres(&env.config("on_conflict: reject"), &block);
    let longer = yaml.replace("      lock_ttl: 2s\n", "      lock_ttl: 20s\n");
    assert_ne!(longer, yaml, "the harness's pay route moved");
    let yaml = longer;
    let proxies = [ProxyProcess::spawn(&yaml), ProxyProcess::spawn(&yaml)];
    let bases: Vec<String> = proxies.iter().map(|p| p.url("")).collect();

    const KEYS: usize = 20;
    const REQUESTS: usize = 1000;
    let http = client();
    let started = Instant::now();
    let storm = (0..REQUESTS).map(|i| {
        let (http, base) = (http.clone(), bases[i % 2].clone());
        let key = format!("storm-{}", i % KEYS);
        async move {
            let req = http
                .post(format!("{base}/bookings"))
                .header("Idempotency-Key", &key)
                .header("Content-Type", "application/json")
                .header("X-Mock-Delay", "100ms")
                .body(BODY);
            (key, send(req).await)
        }
    });
    let replies = futures_util::future::join_all(storm).await;
    let took = started.elapsed();

    let mut first: std::collections::HashMap<String, Bytes> = Default::default();
    let (mut fresh, mut replayed, mut conflicts) = (0, 0, 0);
    for (key, r) in &replies {
        match r.status {
            201 if r.header("idempotent-replayed") == "true" => replayed += 1,
            201 => {
                fresh += 1;
                assert!(
                    first.insert(key.clone(), r.body.clone()).is_none(),
                    "{key} ran twice"
                );
            }
            409 => conflicts += 1,
            s => panic!("{key}: {s} {:?}", r.body),
        }
    }
    for (key, r) in &replies {
        if r.status == 201 {
            assert_eq!(Some(&r.body), first.get(key), "{key}: one response");
        }
    }
    println!(
        "storm: {REQUESTS} requests over {KEYS} keys on 2 instances in {took:?}: {fresh} forwarded, {replayed} replayed, {conflicts} conflicts"
    );
    for n in 0..KEYS {
        assert_eq!(env.mock.calls(&format!("storm-{n}")), 1, "storm-{n}");
    }
    assert_eq!(fresh, KEYS);
}

/// Finished keys replay byte for byte after the database crashes (`pg_ctl stop -m immediate`),
/// and after the proxy is SIGKILLed and both are started again; the upstream ran once per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_keys_replay_after_a_database_crash_and_a_restart_of_both() {
    let mut pg = PgServer::start();
    let env = Env::new(Backend::Memory).await;
    let yaml = on_postgres(&env.config(""), &store_block(&pg.url(), "idemproxy", ""));
    let port = free_port();
    let mut proxy = ProxyProcess::spawn_on(&yaml, port);
    let base = proxy.url("");
    let (mut keys, mut firsts) = (Vec::new(), Vec::new());
    for n in 0..5 {
        let (key, r) = first_forwarded(&base, &format!("durable{n}"), Duration::from_secs(5)).await;
        keys.push(key);
        firsts.push(r);
    }

    pg.crash();
    pg.start_again();
    for (key, first) in keys.iter().zip(&firsts) {
        // The pooled connections died with the server: at most a 503 while they are replaced.
        let again = once_the_store_answers(&base, key, Duration::from_secs(5)).await;
        assert_replay_of(&again, first);
    }

    proxy.signal("-KILL");
    proxy.wait(Duration::from_secs(5));
    pg.crash();
    pg.start_again();
    let proxy = ProxyProcess::spawn_on(&yaml, port);
    for (key, first) in keys.iter().zip(&firsts) {
        let again = once_the_store_answers(&proxy.url(""), key, Duration::from_secs(5)).await;
        assert_replay_of(&again, first);
        assert_eq!(env.mock.calls(key), 1, "{key}");
    }
}

/// A stopped database (SIGSTOP) gives 503 within `store.timeout` (300ms, plus a margin for a
/// loaded machine), on a new key and a finished one, and `/readyz` 503; after SIGCONT the
/// stale connections are gone: a new key runs and a finished key replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_database_gives_503_in_bounded_time_then_recovers() {
    let pg = PgServer::start();
    let env = Env::new(Backend::Memory).await;
    let admin = free_port();
    let yaml = with_admin(
        &on_postgres(
            &env.config(""),
            &store_block(&pg.url(), "idemproxy", "pool_size: 4"),
        ),
        admin,
    );
    let proxy = ProxyProcess::spawn(&yaml);
    let base = proxy.url("");
    let (warm_key, warm) = first_forwarded(&base, "warm", Duration::from_secs(5)).await;
    assert_eq!(readyz(admin).await, 200);

    pg.pause();
    // More requests than pooled connections: every one of them is refused in time, also
    // those that must open a connection to the stopped server.
    for n in 0..6 {
        for key in [format!("paused-{n}"), warm_key.clone()] {
            let started = Instant::now();
            let r = book_with(&base, &key, BODY, &[]).await;
            let took = started.elapsed();
            r.assert_problem(503, "store-unavailable");
            assert!(took < Duration::from_millis(1500), "{key}: {took:?}");
        }
    }
    let started = Instant::now();
    assert_eq!(readyz(admin).await, 503);
    assert!(started.elapsed() < Duration::from_millis(1500));
    assert_eq!(env.mock.calls("paused-0"), 0, "nothing forwarded");
    // Every connection whose call timed out was closed once its cancel went unanswered for
    // store.timeout, not handed back to the pool.
    let deadline = Instant::now() + Duration::from_secs(3);
    while pool_gauges(admin).await != (0, 0) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pool = pool_gauges(admin).await;
    assert_eq!(pool, (0, 0), "pool (connections, in use) while paused");

    pg.resume();
    let (after_key, after) = first_forwarded(&base, "after", Duration::from_secs(5)).await;
    assert_replay_of(&book_with(&base, &warm_key, BODY, &[]).await, &warm);
    assert_replay_of(&book_with(&base, &after_key, BODY, &[]).await, &after);
    // Every later request is served at once: no connection stuck from the pause is reused.
    for n in 0..8 {
        let started = Instant::now();
        let r = book_with(&base, &format!("later-{n}"), BODY, &[]).await;
        assert_eq!(r.status, 201, "{:?}", r.body);
        assert!(started.elapsed() < Duration::from_secs(1));
    }
    assert_eq!(readyz(admin).await, 200);
    assert!(pool_gauges(admin).await.0 > 0, "connections again");
    assert_eq!(env.mock.calls(&warm_key), 1);
}

/// A database whose round trip is longer than a third of `store.timeout` (120 ms against 300 ms)
/// answers each statement in time, but a request could never open a connection and prepare
/// its statement in that time. Once every pooled connection is lost (all reset at once, as by a
/// failover) requests are served again within seconds: connections are opened and prepared
/// ahead of them, not inside their timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_far_database_is_served_again_after_every_connection_was_reset() {
    let pg = PgServer::shared();
    let relay = Relay::start(pg.addr()).await;
    let env = Env::new(Backend::Memory).await;
    let schema = PgServer::fresh_schema();
    let yaml = on_postgres(
        &env.config(""),
        &store_block(
            &pg.url_via(relay.addr().port()),
            &schema,
            "pool_size: 4\n  timeout: 300ms",
        ),
    );
    let proxy = ProxyProcess::spawn(&yaml);
    let base = proxy.url("");
    let (before_key, before) = first_forwarded(&base, "before", Duration::from_secs(10)).await;

    relay.set_latency(Duration::from_millis(60), Duration::from_millis(60));
    relay.reset_all();
    let started = Instant::now();
    let (after_key, after) = first_forwarded(&base, "after", Duration::from_secs(10)).await;
    let recovered = started.elapsed();
    // Served, not once by luck: most requests from here on are answered, and no key runs twice.
    let mut served = 0;
    for n in 0..10 {
        let key = format!("later-{n}");
        let r = book_with(&base, &key, BODY, &[]).await;
        if r.status == 201 {
            served += 1;
            assert_replay_of(&book_with(&base, &key, BODY, &[]).await, &r);
        } else {
            r.assert_problem(503, "store-unavailable");
        }
    }
    assert!(
        served >= 8,
        "{served}/10 served after recovering in {recovered:?}"
    );
    assert_replay_of(&book_with(&base, &before_key, BODY, &[]).await, &before);
    assert_replay_of(&book_with(&base, &after_key, BODY, &[]).await, &after);
    assert_eq!(env.mock.calls(&before_key), 1);
    assert_eq!(env.mock.calls(&after_key), 1);
}

/// A proxy started while the database is down starts, answers 503 (readiness too), and sets
/// the schema up and serves once the database is up. A schema of a newer version found that
/// way fails every operation (a store error, nothing forwarded).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_started_while_the_database_is_down_works_once_it_is_up() {
    let mut pg = PgServer::start();
    pg.sql(
        "CREATE SCHEMA newer; CREATE TABLE newer.schema_version (version integer NOT NULL); INSERT INTO newer.schema_version VALUES (3)",
    );
    pg.crash();
    let env = Env::new(Backend::Memory).await;
    let admin = free_port();
    let yaml = with_admin(
        &on_postgres(&env.config(""), &store_block(&pg.url(), "idemproxy", "")),
        admin,
    );
    let proxy = ProxyProcess::spawn(&yaml);
    let base = proxy.url("");
    book_with(&base, "early", BODY, &[])
        .await
        .assert_problem(503, "store-unavailable");
    assert_eq!(readyz(admin).await, 503);
    let (_, newer) = open(&pg.url(), "newer", "").await;

    pg.start_again();
    let (late, r) = first_forwarded(&base, "late", Duration::from_secs(5)).await;
    assert_replay_of(&book_with(&base, &late, BODY, &[]).await, &r);
    assert_eq!(readyz(admin).await, 200);
    assert_eq!(pg.sql("SELECT version FROM idemproxy.schema_version"), "2");

    let refused = newer.ping().await.expect_err("a newer schema");
    let text = refused.to_string();
    assert!(
        text.contains("version 3") && text.contains("version 2"),
        "{text}"
    );
    assert!(
        newer
            .claim(&key(1), &held(1), Duration::from_secs(1))
            .await
            .is_err()
    );
    assert_eq!(pg.sql("SELECT count(*) FROM newer.schema_version"), "1");
}

/// SPEC §4.6: `pool_size` is the most sessions an instance opens, also while its statements
/// time out. An outside transaction holds a key's row (its uncommitted insert): every claim of
/// the key waits on it until `store.timeout` drops the call (a 503, nothing forwarded). The
/// server sessions of the proxy stay within `pool_size` throughout: a statement given up on is
/// cancelled and its session reused, never left waiting beside a replacement. Once the
/// transaction ends, the key is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_stay_within_pool_size_while_an_outside_transaction_holds_a_row() {
    const POOL: usize = 4;
    const KEY: &str = "held-by-another-transaction";
    let pg = PgServer::shared();
    let env = Env::new(Backend::Memory).await;
    let schema = PgServer::fresh_schema();
    // The proxy's sessions, told apart from those of the tests beside this one.
    let app = format!("idemproxy-{schema}");
    let url = format!("{}?application_name={app}", pg.url());
    let yaml = on_postgres(
        &env.config(""),
        &store_block(&url, &schema, &format!("pool_size: {POOL}")),
    );
    let proxy = harness::TestProxy::start(&yaml).await;
    let base = proxy.url("");
    let (warm_key, warm) = first_forwarded(&base, "warm", Duration::from_secs(10)).await;

    let outside = hold_a_row(pg, &schema, &harness::booking_store_key(KEY)).await;

    let count = format!("SELECT count(*) FROM pg_stat_activity WHERE application_name = '{app}'");
    let storming = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let (storming, count) = (storming.clone(), count.clone());
        std::thread::spawn(move || {
            let mut most = 0usize;
            while storming.load(std::sync::atomic::Ordering::SeqCst) {
                let n: usize = pg.sql(&count).parse().expect("a count");
                most = most.max(n);
                std::thread::sleep(Duration::from_millis(20));
            }
            most
        })
    };
    for _ in 0..6 {
        let storm = (0..8).map(|_| book_with(&base, KEY, BODY, &[]));
        for r in futures_util::future::join_all(storm).await {
            r.assert_problem(503, "store-unavailable");
        }
    }
    // The last timeouts' sessions are still being settled: give them store.timeout and more.
    tokio::time::sleep(Duration::from_secs(1)).await;
    storming.store(false, std::sync::atomic::Ordering::SeqCst);
    let most = sampler.join().expect("the sampler");
    assert!(most <= POOL, "{most} sessions at once, pool_size {POOL}");
    assert_eq!(env.mock.calls(KEY), 0, "nothing forwarded");

    outside.batch_execute("ROLLBACK").await.expect("rollback");
    // None of the claims given up on landed later: the key is free, and runs once.
    let first = once_the_store_answers(&base, KEY, Duration::from_secs(5)).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    assert_eq!(env.mock.calls(KEY), 1);
    assert_replay_of(&book_with(&base, KEY, BODY, &[]).await, &first);
    assert_replay_of(&book_with(&base, &warm_key, BODY, &[]).await, &warm);
    let n: usize = pg.sql(&count).parse().expect("a count");
    assert!(n <= POOL, "{n} sessions after the storm");
}

/// A likely repeat (a key this instance finished) is read on the connections shared by reads,
/// not on the pool: with every pooled connection waiting on a row another transaction holds,
/// a repeat of a finished key is still answered at once with its record. `pool_size: 8` gives
/// one connection to the shared reads and seven to the pool; eight claims of the held key take
/// all seven and wait for more. The sessions stay within `pool_size`, readers included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeat_is_answered_while_every_pooled_connection_waits_on_a_lock() {
    const POOL: usize = 8;
    let pg = PgServer::shared();
    let (schema, app, _store, handle, done) =
        with_a_finished_key(&format!("pool_size: {POOL}\ntimeout: 4s")).await;
    let lease = Duration::from_secs(30);
    until_read_on_a_reader(pg, &app, &handle).await;

    let outside = hold_a_row(pg, &schema, &key(2).text()).await;
    let waiting: Vec<_> = (0..POOL as u8)
        .map(|n| {
            let handle = handle.clone();
            tokio::spawn(async move { handle.claim(&key(2), &held(10 + n), lease).await })
        })
        .collect();
    let count = format!(
        "SELECT count(*) FILTER (WHERE wait_event_type = 'Lock') FROM pg_stat_activity WHERE application_name = '{app}'"
    );
    let deadline = Instant::now() + Duration::from_secs(3);
    while pg.sql(&count).parse::<usize>().expect("a count") < POOL - 1 {
        assert!(
            Instant::now() < deadline,
            "the claims of the held key never all waited"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let started = Instant::now();
    repeat_replays(&handle, &done).await;
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "the repeat waited {:?} for a pooled connection",
        started.elapsed()
    );
    let sessions: usize = pg
        .sql(&format!(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = '{app}'"
        ))
        .parse()
        .expect("a count");
    assert_eq!(sessions, POOL, "seven pooled sessions and the readers' one");

    outside.batch_execute("ROLLBACK").await.expect("rollback");
    let claimed = futures_util::future::join_all(waiting)
        .await
        .into_iter()
        .filter(|got| matches!(got, Ok(Ok(Claim::Claimed))))
        .count();
    assert_eq!(
        claimed, 1,
        "one of the waiting claims takes the released key"
    );
}

/// A store of its own on the shared server with `extra` store lines, its sessions named apart
/// from other tests': its schema, that name, the store, its handle, and `key(1)` claimed and
/// finished with the returned record (a key this instance finished: its repeats are read
/// first).
async fn with_a_finished_key(
    extra: &str,
) -> (String, String, Arc<PostgresStore>, StoreHandle, Bytes) {
    let pg = PgServer::shared();
    let schema = PgServer::fresh_schema();
    let app = format!("idemproxy-{schema}");
    let url = format!("{}?application_name={app}", pg.url());
    let (store, handle) = open(&url, &schema, extra).await;
    let lease = Duration::from_secs(30);
    let done = harness::store_checks::done([7; 32], r#"{"id":"1"}"#).encode();
    assert_eq!(
        handle.claim(&key(1), &held(1), lease).await.ok(),
        Some(Claim::Claimed)
    );
    assert!(
        handle
            .save(&key(1), &held(1), &done, lease)
            .await
            .expect("save")
    );
    (schema, app, store, handle, done)
}

/// A repeat of `key(1)` (finished with `done`) gets `done`.
async fn repeat_replays(handle: &StoreHandle, done: &Bytes) {
    let repeat = handle
        .claim(&key(1), &held(2), Duration::from_secs(30))
        .await;
    match repeat.expect("the repeat") {
        Claim::Existing(r) => assert_eq!(&r.encode(), done),
        other => panic!("a finished key replays, got {other:?}"),
    }
}

/// Repeats `key(1)` (finished) until a repeat was read on a shared connection: the first ones
/// open the reader, in the background, and claim meanwhile. The reader's session is the one
/// whose last statement is the primary-key read (`sql.rs`'s `get`): with readers, a pooled
/// connection never runs it.
async fn until_read_on_a_reader(pg: &PgServer, app: &str, handle: &StoreHandle) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while pg.sql(&format!("SELECT count(*) {}", reader_sessions(app))) == "0" {
        assert!(
            Instant::now() < deadline,
            "no repeat was read on a shared connection"
        );
        assert!(matches!(
            handle
                .claim(&key(1), &held(2), Duration::from_secs(30))
                .await,
            Ok(Claim::Existing(_))
        ));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `FROM … WHERE …` for the sessions of the shared reads of the proxy named `app`.
fn reader_sessions(app: &str) -> String {
    format!(
        "FROM pg_stat_activity WHERE application_name = '{app}' \
         AND query LIKE '%WHERE r.key = $1 AND r.expires_at > now()'"
    )
}

/// A connection of the shared reads that the server ends (a failover, an operator's
/// `pg_terminate_backend`) costs no answer: the repeat after it falls through to the claim,
/// which finds the finished record, and a reader is opened again for the next ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeat_after_the_shared_read_connection_was_ended_still_replays() {
    let pg = PgServer::shared();
    let (_schema, app, _store, handle, done) = with_a_finished_key("pool_size: 8").await;
    until_read_on_a_reader(pg, &app, &handle).await;
    let ended = pg.sql(&format!(
        "SELECT count(pg_terminate_backend(pid)) {}",
        reader_sessions(&app)
    ));
    assert_eq!(ended, "1", "the reader's session was ended");
    for _ in 0..5 {
        repeat_replays(&handle, &done).await;
    }
    // And a reader is open again (the warmer's, or a repeat's).
    until_read_on_a_reader(pg, &app, &handle).await;
}

/// An outside transaction holding the row of the store key `key` in `schema` (its uncommitted
/// insert): every claim of the key waits on it until it ends (`ROLLBACK` on the client
/// returned).
async fn hold_a_row(pg: &PgServer, schema: &str, key: &str) -> tokio_postgres::Client {
    let (outside, connection) = tokio_postgres::connect(&pg.url(), tokio_postgres::NoTls)
        .await
        .expect("connect the outside transaction");
    tokio::spawn(connection);
    outside
        .batch_execute(&format!(
            "BEGIN; INSERT INTO {schema}.records (key, token, value, expires_at) \
             VALUES ('{key}', NULL, '\\x00', now() + interval '1 hour')"
        ))
        .await
        .expect("hold the key's row");
    outside
}

// ---------------------------------------------------------------------------------------------
// Leases on a slow database
// ---------------------------------------------------------------------------------------------

/// A lease held on a database whose answers come 450 ms late (a relay delays every byte the
/// server sends; what the proxy sends arrives at once) never lapses while its holder runs:
/// `lock_ttl: 600ms` (a renewal every 200 ms), a first request that takes 2 s, and a duplicate
/// sent 1.3 s after it is a `409`, not a second run. Each renewal's answer comes back when the
/// lease it extends has less than a third left, or none: counted as late, and no lease is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_on_a_slow_database_never_lapses_while_its_holder_runs() {
    let pg = PgServer::shared();
    let relay = Relay::start(pg.addr()).await;
    let env = Env::new(Backend::Memory).await;
    let schema = PgServer::fresh_schema();
    // One worker, so one pool: warmed below, before the latency, since opening a connection
    // takes several round trips. store.timeout 590ms: the 450 ms of every answer fits in it.
    let yaml = on_postgres(
        &env.config("lock_ttl: 600ms"),
        &store_block(
            &pg.url_via(relay.addr().port()),
            &schema,
            "pool_size: 8\ntimeout: 590ms",
        ),
    )
    .replacen("workers: 2\n", "workers: 1\n", 1);
    let proxy = harness::TestProxy::start(&yaml).await;
    let base = proxy.url("");
    let connections = || proxy.metric("idemproxy_postgres_pool_connections", &[]) as u64;
    // Claims, renewals (two at once on a slow database), the save and the duplicate's claim:
    // each wants a connection of its own, none of which could be opened within store.timeout
    // once the database is slow.
    let deadline = Instant::now() + Duration::from_secs(20);
    for round in 0.. {
        let keys: Vec<String> = (0..8).map(|n| format!("warm-{round}-{n}")).collect();
        let warm = keys.iter().map(|key| book_with(&base, key, BODY, &[]));
        futures_util::future::join_all(warm).await;
        if connections() >= 6 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "pool: {} connections",
            connections()
        );
    }

    relay.set_latency(Duration::ZERO, Duration::from_millis(450));
    let started = Instant::now();
    let first = harness::spawn_booking(base.clone(), "slow-db-lease", BODY, "2s");
    tokio::time::sleep_until((started + Duration::from_millis(1300)).into()).await;
    let duplicate = book_with(&base, "slow-db-lease", BODY, &[]).await;
    duplicate.assert_problem(409, "request-in-progress");
    let first = first.await.expect("the first request");
    assert_eq!(first.status, 201, "{:?}", first.body);
    assert_eq!(env.mock.calls("slow-db-lease"), 1, "the operation ran once");
    assert_replay_of(&book_with(&base, "slow-db-lease", BODY, &[]).await, &first);
    assert_eq!(proxy.lost_leases(), 0);
    let late = proxy.metric(
        "idemproxy_lease_renewals_late_total",
        &[("route", "create-booking")],
    );
    assert!(late >= 1.0, "late renewals: {late}");
    relay.heal();
}

// ---------------------------------------------------------------------------------------------
// The schema
// ---------------------------------------------------------------------------------------------

/// A schema of a newer version refuses the start, saying both versions, and is left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_schema_version_refuses_to_start() {
    let pg = PgServer::shared();
    let schema = PgServer::fresh_schema();
    pg.sql(&format!(
        "CREATE SCHEMA {schema}; CREATE TABLE {schema}.schema_version (version integer NOT NULL); INSERT INTO {schema}.schema_version VALUES (3)"
    ));
    let err = try_open(&pg.url(), &schema, "")
        .await
        .err()
        .expect("refused");
    let text = err.to_string();
    assert!(
        text.contains("version 3") && text.contains("version 2"),
        "{text}"
    );

    // The binary exits with that message.
    let env = Env::new(Backend::Memory).await;
    let yaml = on_postgres(&env.config(""), &store_block(&pg.url(), &schema, "")).replace(
        "listen: 127.0.0.1:0",
        &format!("listen: 127.0.0.1:{}", free_port()),
    );
    let file = harness::write_config(&yaml);
    let out = std::process::Command::new(harness::binary())
        .arg("--config")
        .arg(file.path())
        .output()
        .expect("run idemproxy");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("version 3") && stderr.contains("version 2"),
        "{stderr}"
    );
    assert_eq!(
        pg.sql(&format!("SELECT to_regclass('{schema}.records') IS NULL")),
        "t",
        "nothing created"
    );
}

/// What the stores log, kept in memory.
#[derive(Clone, Default)]
struct Logged(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Logged {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Ok(mut log) = self.0.lock() {
            log.extend_from_slice(buf);
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Instances starting at once on a fresh schema take turns under the advisory lock: every one
/// sets the schema up at start, none meets another's half-made schema (it would log that it
/// cannot set it up, and leave it to its first operation); one version row.
///
/// What the stores log is read from a process-wide subscriber, each line picked by the schema
/// it names: a subscriber scoped to this test's future misses lines, on and off, when other
/// tests of this binary log from the same call sites on other threads at the same moment
/// (tracing caches each call site's interest across threads).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_starting_at_once_on_a_fresh_schema_all_start() {
    let pg = PgServer::shared();
    const INSTANCES: usize = 6;
    let logged = Logged::default();
    let writer = logged.clone();
    tracing::subscriber::set_global_default(
        tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .finish(),
    )
    .expect("no other test of this binary sets a global subscriber");
    for _ in 0..4 {
        let schema = PgServer::fresh_schema();
        let url = pg.url();
        let starts = (0..INSTANCES).map(|_| try_open(&url, &schema, "timeout: 1s"));
        let started = futures_util::future::join_all(starts).await;
        let all = String::from_utf8_lossy(&logged.0.lock().expect("log")).into_owned();
        let named = format!("schema={schema}");
        let log: Vec<&str> = all.lines().filter(|l| l.contains(&named)).collect();
        assert!(!log.iter().any(|l| l.contains("cannot set up")), "{log:#?}");
        assert_eq!(
            log.iter().filter(|l| l.contains("schema ready")).count(),
            INSTANCES,
            "{log:#?}"
        );
        for store in started {
            let (_, store) = store.unwrap_or_else(|e| panic!("a start failed: {e}"));
            store.ping().await.expect("ready");
        }
        assert_eq!(
            pg.sql(&format!("SELECT count(*) FROM {schema}.schema_version")),
            "1"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The sweep
// ---------------------------------------------------------------------------------------------

/// Expired rows go in batches (more than one batch's worth in one sweep), live ones stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_deletes_expired_rows_in_batches_and_keeps_live_ones() {
    let pg = PgServer::shared();
    let schema = PgServer::fresh_schema();
    let (_, store) = open(&pg.url(), &schema, "sweep_interval: 1s").await;
    for n in 0..10 {
        assert_eq!(
            store
                .claim(&key(n), &held(1), Duration::from_secs(60))
                .await
                .ok(),
            Some(Claim::Claimed)
        );
    }
    pg.sql(&format!(
        "INSERT INTO {schema}.records SELECT 'old-' || g, NULL, '\\x00'::bytea, now() - g * interval '1 second' FROM generate_series(1, 2500) g"
    ));
    assert_eq!(rows(pg, &schema), (2510, 10));
    let deadline = Instant::now() + Duration::from_secs(5);
    while rows(pg, &schema).0 > 10 {
        assert!(
            Instant::now() < deadline,
            "not swept: {:?}",
            rows(pg, &schema)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(rows(pg, &schema), (10, 10));
    for n in 0..10 {
        assert!(
            store.get(&key(n)).await.expect("get").is_some(),
            "live key {n} kept"
        );
    }
}

/// Under steady churn (`ttl: 1s`, `sweep_interval: 1s`, 50 new keys a second for 20s), the
/// table stays bounded, and every row is swept in the end. Prints the row counts over time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_table_stays_bounded_under_churn() {
    let pg = PgServer::shared();
    let schema = PgServer::fresh_schema();
    let env = Env::new(Backend::Memory).await;
    let yaml = on_postgres(
        &env.config("ttl: 1s"),
        &store_block(&pg.url(), &schema, "sweep_interval: 1s\ntimeout: 1s"),
    );
    let proxy = env.proxy(&yaml).await;
    let base = proxy.url("");
    const RATE: u64 = 50;
    const LOAD: Duration = Duration::from_secs(20);

    let load = {
        let base = base.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(1000 / RATE));
            let started = Instant::now();
            let mut sent = Vec::new();
            let mut n = 0u64;
            while started.elapsed() < LOAD {
                tick.tick().await;
                let base = base.clone();
                sent.push(tokio::spawn(async move {
                    book_with(&base, &format!("churn-{n}"), BODY, &[])
                        .await
                        .status
                }));
                n += 1;
            }
            let mut created = 0u64;
            for s in sent {
                assert_eq!(s.await.expect("request task"), 201);
                created += 1;
            }
            created
        })
    };
    let started = Instant::now();
    let mut counts = Vec::new();
    while !load.is_finished() {
        tokio::time::sleep(Duration::from_secs(1)).await;
        counts.push((started.elapsed().as_secs(), rows(pg, &schema)));
    }
    let created = load.await.expect("load");
    let deadline = Instant::now() + Duration::from_secs(6);
    while rows(pg, &schema).0 > 0 {
        assert!(
            Instant::now() < deadline,
            "rows left: {:?}",
            rows(pg, &schema)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!("churn: {RATE} new keys/s, ttl 1s, sweep_interval 1s; rows (all, live) each second:");
    for (t, (all, live)) in &counts {
        println!("  {t:>3}s  {all:>5}  {live:>5}");
    }
    let most = counts.iter().map(|(_, (all, _))| *all).max().unwrap_or(0);
    println!("  at most {most} rows for {created} keys; all swept");
    // A row lives its ttl, then waits at most one sweep_interval: about 2s of keys; 5s is
    // the bound with room for a loaded machine.
    assert!(most <= RATE * 5, "the table grew to {most} rows");
    assert_eq!(
        proxy.metric("idemproxy_store_swept_total", &[]) as u64,
        created,
        "every saved key was swept once"
    );
}

// ---------------------------------------------------------------------------------------------
// TLS
// ---------------------------------------------------------------------------------------------

/// A server with TLS: `sslmode=require` and `store.ca_file` reach it over verified TLS; the
/// public roots refuse its certificate; no `sslmode` means no TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_is_used_and_verified_when_sslmode_asks_for_it() {
    let pki = harness::pki::Pki::new();
    let pg = PgServer::start_tls(&pki.cert, &pki.key);
    let ca = format!("ca_file: {}", pki.ca.display());
    let tls_url = format!("{}?sslmode=require&application_name=over_tls", pg.url());
    let (_, store) = open(&tls_url, "tls", &ca).await;
    store.ping().await.expect("a verified TLS connection");
    assert_eq!(
        pg.sql("SELECT bool_and(s.ssl) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) WHERE a.application_name = 'over_tls'"),
        "t"
    );

    let (_, public) = open(&tls_url, "tls", "").await;
    let refused = public.ping().await.expect_err("an unknown CA");
    assert!(refused.to_string().contains("TLS"), "{refused}");

    let plain_url = format!("{}?application_name=plain", pg.url());
    let (_, plain) = open(&plain_url, "tls", "").await;
    plain.ping().await.expect("plaintext");
    assert_eq!(
        pg.sql("SELECT bool_or(s.ssl) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) WHERE a.application_name = 'plain'"),
        "f"
    );
}

/// A claim finds its key's row by the primary key, whatever else the table holds: twenty
/// thousand lapsed rows the planner does not know of (inserted after the table's statistics, as
/// rows lapse between two analyses) are never walked, neither by a new key's claim nor by a
/// repeat's. A claim that reached them through the `expires_at` index, as one did when its
/// lapse test could be answered by that index, read every one of them, each time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_reads_its_row_by_key_whatever_lapsed_rows_the_table_holds() {
    const LAPSED: u64 = 20_000;
    const CLAIMS: u32 = 20;
    let pg = PgServer::shared();
    let schema = PgServer::fresh_schema();
    let (_, handle) = open(&pg.url(), &schema, "sweep_interval: 1h").await;
    let lease = Duration::from_secs(60);
    let t = format!("{schema}.records");
    pg.sql(&format!(
        "ALTER TABLE {t} SET (autovacuum_enabled = false);
         INSERT INTO {t} SELECT 'live-' || i, NULL, '\\x00', now() + interval '1 day'
             FROM generate_series(1, 100) i;
         ANALYZE {t};
         INSERT INTO {t} SELECT 'lapsed-' || i, NULL, '\\x00', now() - interval '1 hour'
             FROM generate_series(1, {LAPSED}) i;"
    ));
    let read = |index: &str| -> (u64, u64) {
        let row = pg.sql(&format!(
            "SELECT idx_scan, idx_tup_read FROM pg_stat_user_indexes
             WHERE schemaname = '{schema}' AND indexrelname = '{index}'"
        ));
        let (scans, tuples) = row.split_once('|').unwrap_or_else(|| panic!("{row:?}"));
        (
            scans.parse().unwrap_or_else(|e| panic!("{row:?}: {e}")),
            tuples.parse().unwrap_or_else(|e| panic!("{row:?}: {e}")),
        )
    };
    let (pkey_before, _) = read("records_pkey");
    let (_, walked_before) = read("records_expires_at");

    let done = harness::store_checks::done([7; 32], r#"{"id":"1"}"#).encode();
    let (a, b) = (held(1), held(2));
    for n in 0..CLAIMS {
        assert_eq!(
            handle.claim(&key(n), &a, lease).await.ok(),
            Some(Claim::Claimed)
        );
        assert!(
            handle
                .save(&key(n), &a, &done, lease)
                .await
                .expect("complete")
        );
        match handle.claim(&key(n), &b, lease).await.expect("claim") {
            Claim::Existing(r) => assert_eq!(r.encode(), done),
            other => panic!("a finished key replays, got {other:?}"),
        }
    }

    // The sessions report their statistics once idle (within a second or so): wait until the
    // primary key shows this test's claims.
    let deadline = Instant::now() + Duration::from_secs(20);
    while read("records_pkey").0 < pkey_before + u64::from(CLAIMS) * 2 {
        assert!(Instant::now() < deadline, "no index statistics reported");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (_, walked) = read("records_expires_at");
    assert!(
        walked - walked_before < LAPSED,
        "the claims walked {} entries of the expires_at index",
        walked - walked_before
    );
}
