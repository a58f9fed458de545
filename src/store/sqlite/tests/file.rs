//! The file: one process per file, the schema and its version, reopening, the sweep.

use std::time::Instant;

use rusqlite::Connection;

use super::*;

/// The sweep deletes expired rows only, in batches of [`sweep::SWEEP_BATCH`], and keeps a row
/// that was claimed again after it lapsed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_deletes_only_expired_rows() {
    let f = Fixture::new();
    let s = &f.handle;
    let short = Duration::from_secs(1);
    assert!(s.claim(&k(1), &held(1), short).await.is_ok());
    assert!(s.claim(&k(2), &held(1), short).await.is_ok());
    assert!(s.claim(&k(3), &held(1), LEASE * 100).await.is_ok());
    let a = held(1);
    assert!(s.claim(&k(4), &a, short).await.is_ok());
    assert!(
        s.save(&k(4), &a, &done(1).encode(), LEASE * 100)
            .await
            .is_ok()
    );
    f.advance(Duration::from_secs(2));
    // k(2) lapsed and was taken again: live, and kept.
    assert_eq!(
        s.claim(&k(2), &held(1), LEASE).await.ok(),
        Some(Claim::Claimed)
    );
    assert_eq!(f.store.inner.sweep_batch().await.ok(), Some(1));
    assert_eq!(f.rows(), 3);
    for n in 2..=4 {
        assert!(s.get(&k(n)).await.expect("get").is_some(), "k({n}) kept");
    }
    assert_eq!(f.metric("idemproxy_store_swept_total"), 1.0);

    // Many expired rows: the pass takes several short transactions.
    let far_past = f.store.inner.clock.now_ms() - 1;
    let shell = f.shell();
    shell.execute_batch("BEGIN").expect("begin");
    for n in 0..1200 {
        shell
            .execute(
                "INSERT INTO records (key, token, value, expires_at) VALUES (?1, NULL, x'00', ?2)",
                rusqlite::params![format!("old:{n}"), far_past],
            )
            .expect("insert");
    }
    shell.execute_batch("COMMIT").expect("commit");
    let commits = f.commits();
    let weak = Arc::downgrade(&f.store.inner);
    assert_eq!(sweep::pass(&weak).await.map(|r| r.ok()), Some(Some(1200)));
    assert_eq!(f.commits() - commits, 3.0, "500 + 500 + 200");
    assert_eq!(f.rows(), 3);
}

/// The periodic sweep runs by itself, and stops with the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_runs_every_interval_and_stops_with_the_store() {
    let f = Fixture::with(SqliteSync::Normal, Duration::from_millis(50));
    for n in 0..10 {
        assert!(f.handle.claim(&k(n), &held(1), LEASE).await.is_ok());
    }
    f.advance(LEASE * 2);
    let deadline = Instant::now() + Duration::from_secs(5);
    while f.rows() > 0 {
        assert!(Instant::now() < deadline, "the sweep did not run");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let weak = Arc::downgrade(&f.store.inner);
    let Fixture { handle, store, .. } = f;
    drop((handle, store));
    // The sweep holds the store only while a batch runs: then the store is gone.
    let deadline = Instant::now() + Duration::from_secs(2);
    while weak.upgrade().is_some() {
        assert!(Instant::now() < deadline, "the sweep keeps the store alive");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_open_of_the_same_file_is_refused() {
    let f = Fixture::new();
    let Err(err) = SqliteStore::open(&f.path, SqliteSync::Normal, LEASE, Arc::new(Metrics::new()))
    else {
        panic!("a second store on the same file");
    };
    let text = err.to_string();
    assert!(text.contains(&f.path.display().to_string()), "{text}");
    assert!(text.contains("in use by another process"), "{text}");
    // The first store serves on.
    assert_eq!(
        f.handle.claim(&k(1), &held(1), LEASE).await.ok(),
        Some(Claim::Claimed)
    );
}

/// Dropping the store releases the file: a new store opens it at once, with every record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reopening_after_drop_keeps_every_record() {
    let f = Fixture::new();
    let a = held(1);
    assert!(f.handle.claim(&k(1), &a, LEASE).await.is_ok());
    assert!(
        f.handle
            .save(&k(1), &a, &done(1).encode(), LEASE)
            .await
            .is_ok()
    );
    let b = held(2);
    assert!(f.handle.claim(&k(2), &b, LEASE).await.is_ok());
    let Fixture {
        handle,
        store,
        path,
        _dir,
        ..
    } = f;
    drop((handle, store));
    let store = SqliteStore::open(&path, SqliteSync::Normal, LEASE, Arc::new(Metrics::new()))
        .expect("open again");
    assert_eq!(store.get(&k(1)).await.expect("get"), Some(done(1).encode()));
    assert_eq!(
        store.claim(&k(2), &held(2), LEASE).await.expect("claim"),
        Some(b.encoded.clone()),
        "a claim survives the restart"
    );
    assert_eq!(store.renew(&k(2), &b, LEASE).await.ok(), Some(true));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_schema_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("records.db");
    {
        let store = SqliteStore::open(&path, SqliteSync::Normal, LEASE, Arc::new(Metrics::new()))
            .expect("open");
        drop(store);
    }
    Connection::open(&path)
        .and_then(|c| c.execute("UPDATE schema_version SET version = 7", []))
        .expect("a newer layout");
    let Err(err) = SqliteStore::open(&path, SqliteSync::Normal, LEASE, Arc::new(Metrics::new()))
    else {
        panic!("a file of a newer layout was opened");
    };
    let text = err.to_string();
    assert!(text.contains(&path.display().to_string()), "{text}");
    assert!(text.contains("version 7") && text.contains("(1)"), "{text}");
    let version: i64 = Connection::open(&path)
        .and_then(|c| c.query_row("SELECT version FROM schema_version", [], |r| r.get(0)))
        .expect("read");
    assert_eq!(version, 7, "the refused file is left as it was");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_file_is_in_wal_mode_with_the_agreed_layout() {
    let f = Fixture::new();
    let shell = f.shell();
    let mode: String = shell
        .query_row("PRAGMA journal_mode", [], |r| r.get(0))
        .expect("mode");
    assert_eq!(mode, "wal");
    let columns: Vec<(String, String, bool, bool)> = shell
        .prepare("SELECT name, type, \"notnull\", pk FROM pragma_table_info('records')")
        .and_then(|mut s| {
            s.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))?
                .collect()
        })
        .expect("columns");
    let expected = [
        ("key", "TEXT", false, true),
        ("token", "BLOB", false, false),
        ("value", "BLOB", true, false),
        ("expires_at", "INTEGER", true, false),
    ];
    let columns: Vec<_> = columns
        .iter()
        .map(|(n, t, nn, pk)| (n.as_str(), t.as_str(), *nn, *pk))
        .collect();
    assert_eq!(columns, expected);
    let index: i64 = shell
        .query_row(
            "SELECT count(*) FROM sqlite_master WHERE type = 'index' AND name = 'records_expires_at'",
            [],
            |r| r.get(0),
        )
        .expect("index");
    assert_eq!(index, 1);
}

/// The writer never checkpoints; the checkpoint thread copies the log back into the file
/// while the store is open, so the records reach the database file (and the log can start
/// over) without a stall of the writer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_is_copied_into_the_file_beside_the_writer() {
    let f = Fixture::new();
    let writer_checkpoints: i64 = f
        .store
        .inner
        .writer
        .submit("test", None, true, |ops, _| {
            ops.conn()
                .pragma_query_value(None, "wal_autocheckpoint", |r| r.get(0))
        })
        .await
        .expect("read the writer's setting");
    assert_eq!(writer_checkpoints, 0, "the writer does not checkpoint");
    let file_size = || std::fs::metadata(&f.path).expect("the file").len();
    let before = file_size();
    for n in 0..2000u32 {
        let mut id = [0u8; 32];
        id[..4].copy_from_slice(&n.to_be_bytes());
        let key = StoreKey::new(crate::key::namespace("idemproxy:", "r"), 0, id);
        let h = held(1);
        assert!(f.handle.claim(&key, &h, LEASE).await.is_ok());
        assert!(
            f.handle
                .save(&key, &h, &done(1).encode(), LEASE * 100)
                .await
                .is_ok()
        );
    }
    // The file itself grows only by checkpoints (every second).
    let deadline = Instant::now() + Duration::from_secs(10);
    while file_size() <= before + 64 * 1024 {
        assert!(
            Instant::now() < deadline,
            "the database file stayed at {before} bytes: nothing was checkpointed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
