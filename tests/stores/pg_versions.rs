//! PostgreSQL schema versions (SPEC §4.8, "Bounded"): a renewal of a resolvable claim writes
//! its times into the row's `times` column (version 2), never its value again, so a 16 KiB
//! lookup costs a renewal no more WAL than a small one; a version 1 schema is served beside
//! version 1 proxies (the times written into both) until `idemproxy store upgrade` records
//! version 2.

use std::sync::Arc;
use std::time::Duration;

use harness::postgres::{PgServer, store_block, store_only};
use idemproxy::config::{BackendSettings, Config};
use idemproxy::metrics::Metrics;
use idemproxy::record::{Held, resolvable};

use super::renewals::claim;
use harness::store_checks::resolvable as claims;
use harness::{Backend, Env};
use idemproxy::store::postgres::PostgresStore;
use idemproxy::store::{ResolvableClaim, ResolvableTimes, Store, StoreHandle, StoreKey};

/// Renewals measured per claim.
const RENEWALS: u64 = 20;

/// The store and a handle on it (the handle runs the flow's operations; the store itself
/// answers `inspect`, as it does for the key tooling).
struct Opened {
    store: Arc<PostgresStore>,
    handle: StoreHandle,
}

impl std::ops::Deref for Opened {
    type Target = StoreHandle;
    fn deref(&self) -> &StoreHandle {
        &self.handle
    }
}

async fn open(url: &str, schema: &str) -> Opened {
    let yaml = store_only(&store_block(url, schema, ""));
    let config = Config::from_yaml(&yaml).unwrap_or_else(|e| panic!("config: {e}\n{yaml}"));
    let BackendSettings::Postgres(settings) = &config.store.backend else {
        panic!("not a postgres store: {yaml}");
    };
    let metrics = Arc::new(Metrics::new());
    let store = PostgresStore::connect(settings, config.store.timeout, metrics.clone())
        .await
        .unwrap_or_else(|e| panic!("open the store: {e}"));
    let store = Arc::new(store);
    let handle = StoreHandle::new(store.clone(), config.store.timeout, metrics);
    Opened { store, handle }
}

fn key(n: u8) -> StoreKey {
    StoreKey::new(
        idemproxy::key::namespace("idemproxy:", "create-booking"),
        0,
        [0xD0 | n; 32],
    )
}

const TIMES: ResolvableTimes = ResolvableTimes {
    lease: Duration::from_secs(30),
    send_margin: Duration::from_secs(1),
    lifetime: Duration::from_secs(3600),
};

async fn claimed(s: &StoreHandle, key: &StoreKey, held: &Held) -> Held {
    match s.claim_resolvable(key, held, TIMES).await.expect("claim") {
        ResolvableClaim::Claimed { held, .. } => held,
        other => panic!("expected a claim, got {other:?}"),
    }
}

/// The lease of the record as the store shows it (decoded by the proxy's own decoder).
async fn shown_lease(s: &Opened, key: &StoreKey) -> u64 {
    let (value, _) = s
        .store
        .inspect(key)
        .await
        .expect("inspect")
        .expect("a record");
    resolvable::lease_until(&value).expect("a resolvable claim")
}

/// `SELECT` of one row's column as text.
fn column(pg: &PgServer, schema: &str, key: &StoreKey, expr: &str) -> String {
    pg.sql(&format!(
        "SELECT {expr} FROM {schema}.records WHERE key = '{}'",
        key.text()
    ))
}

/// The WAL that `RENEWALS` renewals (half of them marking the next lookup) of `held` write.
async fn renewals_wal(pg: &PgServer, s: &StoreHandle, key: &StoreKey, held: &Held) -> u64 {
    let lsn = pg.sql("SELECT pg_current_wal_insert_lsn()");
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
    pg.sql(&format!(
        "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '{lsn}')::bigint"
    ))
    .parse()
    .expect("bytes")
}

/// On a private server (no other test's writes in its WAL; no full-page images, which depend
/// on when the last checkpoint ran rather than on what a renewal writes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_renewal_costs_the_same_wal_whatever_the_lookup_size() {
    let pg = tokio::task::spawn_blocking(|| {
        PgServer::start_with(&["autovacuum=off", "full_page_writes=off"])
    })
    .await
    .expect("start PostgreSQL");
    let s = open(&pg.url(), "renewals").await;
    let (small_key, large_key) = (key(1), key(2));
    let small = claimed(&s, &small_key, &claim(0x31, 16)).await;
    let large = claimed(&s, &large_key, &claim(0x32, 16 * 1024 - 100)).await;
    // Warm: each statement prepared and planned, and each row's first renewal (which adds
    // its `times`) made, before the measured ones.
    renewals_wal(&pg, &s, &small_key, &small).await;
    renewals_wal(&pg, &s, &large_key, &large).await;
    let small_cost = renewals_wal(&pg, &s, &small_key, &small).await;
    let large_cost = renewals_wal(&pg, &s, &large_key, &large).await;
    eprintln!(
        "WAL for {RENEWALS} renewals: small lookup {small_cost} bytes, 16 KiB lookup {large_cost} bytes"
    );
    assert!(small_cost > 0, "the renewals wrote");
    // The large value lives out of line: its row holds a pointer, smaller than the small
    // value itself; rewriting the value would cost 16 KiB a renewal.
    assert!(
        large_cost <= small_cost + RENEWALS * 64,
        "a renewal rewrote the lookup: {large_cost} bytes of WAL for the 16 KiB lookup, {small_cost} for the small one"
    );
    assert!(
        large_cost < RENEWALS * 1024,
        "{large_cost} bytes of WAL for {RENEWALS} renewals"
    );
}

/// The layout a version 1 proxy set up (and the statement it renewed with: the lease inside
/// the value).
fn version_1(pg: &PgServer, schema: &str) {
    pg.sql(&format!(
        "CREATE SCHEMA {schema};
         CREATE TABLE {schema}.schema_version (version integer NOT NULL);
         CREATE TABLE {schema}.records (key text PRIMARY KEY, token bytea, value bytea NOT NULL,
             expires_at timestamptz NOT NULL);
         CREATE INDEX records_expires_at ON {schema}.records (expires_at);
         INSERT INTO {schema}.schema_version VALUES (1)"
    ));
}

/// What a version 1 proxy's renewal writes: the lease inside the value, nothing else.
fn renew_as_version_1(pg: &PgServer, schema: &str, key: &StoreKey, lease_ms: u64) {
    pg.sql(&format!(
        "WITH c AS (SELECT floor(extract(epoch FROM now()) * 1000)::bigint AS ms)
         UPDATE {schema}.records AS r
         SET value = overlay(r.value PLACING int8send(c.ms + {lease_ms}) FROM 22 FOR 8)
         FROM c WHERE r.key = '{}'",
        key.text()
    ));
}

/// A rolling upgrade: a version 1 schema is served (the column added, the version kept) with
/// the times written where version 1 proxies read them, and what those proxies write is
/// read; `idemproxy store upgrade` then records version 2, after which a renewal leaves the
/// value alone — and what a straggling version 1 proxy still wrote is still honoured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_version_1_schema_is_served_then_upgraded() {
    let pg = tokio::task::spawn_blocking(PgServer::shared)
        .await
        .expect("start PostgreSQL");
    let schema = PgServer::fresh_schema();
    version_1(pg, &schema);
    let s = open(&pg.url(), &schema).await;
    assert_eq!(
        pg.sql(&format!("SELECT version FROM {schema}.schema_version")),
        "1",
        "serving leaves the version as it is: version 1 proxies keep starting"
    );
    assert_eq!(
        pg.sql(&format!(
            "SELECT data_type FROM information_schema.columns WHERE table_schema = '{schema}' AND table_name = 'records' AND column_name = 'times'"
        )),
        "bytea"
    );

    // Before the upgrade: a renewal writes the times into the value too, as version 1 reads.
    let k = key(3);
    let held = claimed(&s, &k, &claim(0x41, 4096)).await;
    let before = shown_lease(&s, &k).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(
        s.renew(&k, &held, Duration::from_secs(40))
            .await
            .expect("renew")
    );
    let after = shown_lease(&s, &k).await;
    assert!(after > before, "renewed: {before} → {after}");
    assert_eq!(
        column(
            pg,
            &schema,
            &k,
            "encode(substring(value FROM 22 FOR 33), 'hex')"
        ),
        column(pg, &schema, &k, "encode(times, 'hex')"),
        "a version 1 proxy reads the renewed times in the value"
    );
    // A version 1 proxy renewing its own claim writes only the value: that is what counts.
    renew_as_version_1(pg, &schema, &k, 90_000);
    let by_v1 = shown_lease(&s, &k).await;
    assert!(
        by_v1 > after + 30_000,
        "the version 1 renewal is read: {by_v1}"
    );

    // The upgrade, through the command line.
    let yaml = store_only(&store_block(&pg.url(), &schema, ""));
    let file = harness::write_config(&yaml);
    let upgrade = || {
        std::process::Command::new(harness::binary())
            .args(["store", "upgrade", "--config"])
            .arg(file.path())
            .output()
            .expect("run idemproxy store upgrade")
    };
    let out = upgrade();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        said.contains("upgraded from version 1 to version 2"),
        "{said}"
    );
    assert_eq!(
        pg.sql(&format!("SELECT max(version) FROM {schema}.schema_version")),
        "2"
    );
    let again = upgrade();
    assert!(again.status.success());
    assert!(
        String::from_utf8_lossy(&again.stdout).contains("at version 2 already"),
        "{}",
        String::from_utf8_lossy(&again.stdout)
    );

    // After it: the value is not written by a renewal; the times are, and they count.
    let value = column(pg, &schema, &k, "md5(value)");
    assert!(
        s.renew(&k, &held, Duration::from_secs(120))
            .await
            .expect("renew")
    );
    assert_eq!(
        column(pg, &schema, &k, "md5(value)"),
        value,
        "the value is left alone"
    );
    let upgraded = shown_lease(&s, &k).await;
    assert!(
        upgraded > by_v1,
        "the renewal in `times` is read: {upgraded}"
    );
    // Another claim meets a live holder: no takeover, though the value's own lease lapsed.
    renew_as_version_1(pg, &schema, &k, 0);
    tokio::time::sleep(Duration::from_millis(20)).await;
    match s
        .claim_resolvable(&k, &claim(0x42, 16), TIMES)
        .await
        .expect("claim")
    {
        ResolvableClaim::Existing(_) => {}
        other => panic!("a live holder was taken over: {other:?}"),
    }
    assert!(
        s.resolving(&k, &held, Duration::from_secs(1), Duration::from_secs(30))
            .await
            .expect("resolving")
            .is_some(),
        "the holder still holds it"
    );
}

/// The operations guide's `psql` expression reads a claim's lease out of its value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_the_documented_query_reads_the_lease() {
    let env = Env::new(Backend::Postgres).await;
    let s = harness::store_checks::handle(env.store().await);
    let k = claims::key(4);
    let a = claims::resolvable(Duration::from_secs(30));
    let (a, _) = claims::ours(
        s.claim_resolvable(
            &k,
            &a,
            claims::times(Duration::ZERO, Duration::from_secs(60)),
        )
        .await
        .expect("claim"),
    );
    let pg = env.postgres();
    let read = || {
        pg.server().sql(&format!(
            "SELECT ('x' || encode(greatest(substring(times FROM 1 FOR 8), substring(value FROM 22 FOR 8)), 'hex'))::bit(64)::bigint
             FROM {}.records
             WHERE substring(value FROM 1 FOR 5) IN ('\\x4944500351'::bytea, '\\x4944500251'::bytea)
               AND key = '{}'",
            pg.schema,
            k.text()
        ))
    };
    let claimed_lease = claims::stamped(&a).lease_until;
    assert_eq!(read(), claimed_lease.to_string());
    // After a renewal (written into `times`), the query reads the renewed lease.
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(
        s.renew(&k, &a, Duration::from_secs(90))
            .await
            .expect("renew")
    );
    let renewed: u64 = read().parse().expect("a number");
    assert!(
        renewed > claimed_lease + 30_000,
        "{renewed} after {claimed_lease}"
    );
}
