//! Unit tests of the SQLite store, each on a file of its own in a temporary directory. Time is
//! moved forward on the store's clock ([`Clock::advance`]) rather than slept through.

use std::time::Instant;

use http::StatusCode;
use rusqlite::{Connection, OptionalExtension};

use super::*;
use crate::record::{Saved, SavedResponse, new_token};
use crate::store::{Claim, StoreHandle};

struct Fixture {
    handle: StoreHandle,
    store: Arc<SqliteStore>,
    metrics: Arc<Metrics>,
    path: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Fixture {
    fn new() -> Fixture {
        Fixture::with(SqliteSync::Normal, Duration::from_secs(3600))
    }

    fn with(sync: SqliteSync, sweep: Duration) -> Fixture {
        let dir = tempfile::tempdir().expect("temp dir");
        // A directory that does not exist yet: the store creates it.
        let path = dir.path().join("state").join("records.db");
        let metrics = Arc::new(Metrics::new());
        let store = Arc::new(SqliteStore::open(&path, sync, sweep, metrics.clone()).expect("open"));
        let handle = StoreHandle::new(store.clone(), Duration::from_secs(5), metrics.clone());
        Fixture {
            handle,
            store,
            metrics,
            path,
            _dir: dir,
        }
    }

    fn advance(&self, by: Duration) {
        self.store.inner.clock.advance(by);
    }

    /// A connection of its own to the file, as an operator's `sqlite3` shell.
    fn shell(&self) -> Connection {
        let c = Connection::open(&self.path).expect("open the file beside the store");
        c.busy_timeout(Duration::from_secs(5))
            .expect("busy timeout");
        c
    }

    fn rows(&self) -> i64 {
        self.shell()
            .query_row("SELECT count(*) FROM records", [], |r| r.get(0))
            .expect("count")
    }

    /// A histogram's `_count` or `_sum`, or a counter, as the Prometheus text shows it.
    fn metric(&self, series: &str) -> f64 {
        let text = self.metrics.encode();
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .find_map(|l| {
                let (name, value) = l.split_once(' ')?;
                (name == series).then(|| value.parse::<f64>().expect("a number"))
            })
            .unwrap_or_else(|| panic!("no series {series} in:\n{text}"))
    }

    fn commits(&self) -> f64 {
        self.metric("idemproxy_sqlite_batch_size_count")
    }
}

fn k(n: u8) -> StoreKey {
    StoreKey::new("test:r:".into(), 0, [n; 32])
}

fn held(fp: u8) -> Held {
    Held::new(Record::InFlight {
        token: new_token(),
        fingerprint: [fp; 32],
    })
}

fn done(fp: u8) -> Record {
    Record::Done {
        fingerprint: [fp; 32],
        saved: Saved::NotReplayable {
            status: StatusCode::OK,
        },
    }
}

const LEASE: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_is_exclusive_and_expires() {
    let f = Fixture::new();
    let s = &f.handle;
    let (a, b) = (held(1), held(1));
    assert_eq!(s.claim(&k(1), &a, LEASE).await.ok(), Some(Claim::Claimed));
    assert_eq!(
        s.claim(&k(1), &b, LEASE).await.ok(),
        Some(Claim::Existing(a.record.clone()))
    );
    f.advance(LEASE + Duration::from_millis(1));
    // a's lease expired: b may claim, and a may no longer complete, renew or release.
    assert_eq!(s.claim(&k(1), &b, LEASE).await.ok(), Some(Claim::Claimed));
    let d = done(1).encode();
    assert_eq!(s.complete(&k(1), &a, &d, LEASE).await.ok(), Some(false));
    assert_eq!(s.renew(&k(1), &a, LEASE).await.ok(), Some(false));
    assert_eq!(s.release(&k(1), &a).await.ok(), Some(false));
    assert_eq!(s.get(&k(1)).await.ok(), Some(Some(b.record.clone())));
    assert_eq!(s.complete(&k(1), &b, &d, LEASE).await.ok(), Some(true));
    assert_eq!(s.get(&k(1)).await.ok(), Some(Some(done(1))));
    // A finished key replays to every claim.
    assert_eq!(
        s.claim(&k(1), &held(1), LEASE).await.ok(),
        Some(Claim::Existing(done(1)))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_namespace_the_same_id() {
    let f = Fixture::new();
    let other_route = StoreKey::new("test:r2:".into(), 1, [1; 32]);
    for key in [k(1), other_route] {
        assert_eq!(
            f.handle.claim(&key, &held(1), LEASE).await.ok(),
            Some(Claim::Claimed)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renew_extends_the_lease_and_only_its_holder_may() {
    let f = Fixture::new();
    let s = &f.handle;
    let a = held(1);
    let lease = Duration::from_secs(1);
    assert_eq!(s.claim(&k(1), &a, lease).await.ok(), Some(Claim::Claimed));
    assert_eq!(s.renew(&k(1), &held(1), lease).await.ok(), Some(false));
    for _ in 0..5 {
        f.advance(Duration::from_millis(500));
        assert_eq!(s.renew(&k(1), &a, lease).await.ok(), Some(true));
    }
    assert!(matches!(
        s.claim(&k(1), &held(1), lease).await,
        Ok(Claim::Existing(_))
    ));
    // A lease that lapsed cannot be renewed back to life, even with nobody else on the key.
    f.advance(Duration::from_millis(1001));
    assert_eq!(s.renew(&k(1), &a, lease).await.ok(), Some(false));
    assert_eq!(s.get(&k(1)).await.ok(), Some(None));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_sent_again_counts_as_done_but_no_other_record_does() {
    let f = Fixture::new();
    let s = &f.handle;
    let a = held(1);
    assert!(s.claim(&k(1), &a, LEASE).await.is_ok());
    let d = done(1).encode();
    assert_eq!(s.complete(&k(1), &a, &d, LEASE).await.ok(), Some(true));
    assert_eq!(s.complete(&k(1), &a, &d, LEASE).await.ok(), Some(true));
    let other = done(2).encode();
    assert_eq!(s.complete(&k(1), &a, &other, LEASE).await.ok(), Some(false));
    assert_eq!(s.get(&k(1)).await.ok(), Some(Some(done(1))));
    // Once the record's TTL is over, the retried completion finds nothing of its own.
    f.advance(LEASE + Duration::from_millis(1));
    assert_eq!(s.complete(&k(1), &a, &d, LEASE).await.ok(), Some(false));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_frees_only_the_holders_claim() {
    let f = Fixture::new();
    let s = &f.handle;
    let a = held(1);
    assert!(s.claim(&k(1), &a, LEASE).await.is_ok());
    assert_eq!(
        s.release(&k(1), &held(1)).await.ok(),
        Some(false),
        "another token"
    );
    assert_eq!(s.release(&k(1), &a).await.ok(), Some(true));
    assert_eq!(s.get(&k(1)).await.ok(), Some(None));
    assert_eq!(
        s.release(&k(1), &a).await.ok(),
        Some(true),
        "sent again: gone already"
    );

    // Lapsed with nobody taking the key: free of the claim.
    assert!(s.claim(&k(2), &a, Duration::from_secs(1)).await.is_ok());
    f.advance(Duration::from_millis(1001));
    assert_eq!(s.release(&k(2), &a).await.ok(), Some(true));

    // A finished record is not a claim: nobody may release it.
    let b = held(1);
    assert!(s.claim(&k(3), &b, LEASE).await.is_ok());
    assert!(
        s.complete(&k(3), &b, &done(1).encode(), LEASE)
            .await
            .is_ok()
    );
    assert_eq!(s.release(&k(3), &b).await.ok(), Some(false));
    assert_eq!(s.get(&k(3)).await.ok(), Some(Some(done(1))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forget_deletes_only_a_finished_record() {
    let f = Fixture::new();
    let s = &f.handle;
    assert_eq!(s.forget(&k(1)).await.ok(), Some(Forgotten::Absent));
    let a = held(1);
    assert!(s.claim(&k(1), &a, LEASE).await.is_ok());
    assert_eq!(s.forget(&k(1)).await.ok(), Some(Forgotten::InFlight));
    assert!(
        s.complete(&k(1), &a, &done(1).encode(), LEASE)
            .await
            .is_ok()
    );
    assert_eq!(s.forget(&k(1)).await.ok(), Some(Forgotten::Forgotten));
    assert_eq!(s.get(&k(1)).await.ok(), Some(None));
    assert_eq!(
        s.claim(&k(1), &held(1), LEASE).await.ok(),
        Some(Claim::Claimed),
        "a forgotten key runs again"
    );

    // Something an operator wrote by hand is left alone.
    let far = f.store.inner.clock.now_ms() + 60_000;
    f.shell()
        .execute(
            "INSERT INTO records (key, token, value, expires_at) VALUES (?1, NULL, ?2, ?3)",
            rusqlite::params![k(2).text(), &b"not a record"[..], far],
        )
        .expect("insert");
    assert_eq!(s.forget(&k(2)).await.ok(), Some(Forgotten::NotARecord));
    assert!(
        matches!(s.get(&k(2)).await, Err(StoreError::Corrupt(_))),
        "an undecodable row is a store error"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_gives_the_time_left() {
    let f = Fixture::new();
    let s = &f.handle;
    let a = held(1);
    assert!(s.inspect(&k(1)).await.expect("inspect").is_none());
    assert!(s.claim(&k(1), &a, LEASE).await.is_ok());
    f.advance(Duration::from_secs(4));
    let (record, ttl) = s.inspect(&k(1)).await.expect("inspect").expect("held");
    assert_eq!(record, a.record);
    assert!(
        ttl <= Duration::from_secs(6) && ttl > Duration::from_secs(5),
        "{ttl:?} left"
    );
    let ttl_done = Duration::from_secs(3600);
    assert!(
        s.complete(&k(1), &a, &done(1).encode(), ttl_done)
            .await
            .is_ok()
    );
    let (_, ttl) = s.inspect(&k(1)).await.expect("inspect").expect("held");
    assert!(ttl > Duration::from_secs(3590), "{ttl:?} left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ttl_beyond_any_clock_means_forever_not_a_panic() {
    let f = Fixture::new();
    let s = &f.handle;
    let a = held(1);
    assert!(s.claim(&k(1), &a, Duration::MAX).await.is_ok());
    assert_eq!(s.renew(&k(1), &a, Duration::MAX).await.ok(), Some(true));
    let d = done(1).encode();
    assert_eq!(
        s.complete(&k(1), &a, &d, Duration::MAX).await.ok(),
        Some(true)
    );
    f.advance(Duration::from_secs(86_400 * 365 * 100));
    assert_eq!(s.get(&k(1)).await.ok(), Some(Some(done(1))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_of_several_mib_round_trips_byte_for_byte() {
    let f = Fixture::new();
    let s = &f.handle;
    let a = held(1);
    assert!(s.claim(&k(1), &a, LEASE).await.is_ok());
    let body: Vec<u8> = (0..6 * 1024 * 1024u32).map(|i| (i % 251) as u8).collect();
    let big = Record::Done {
        fingerprint: [1; 32],
        saved: Saved::Response(SavedResponse {
            status: StatusCode::CREATED,
            headers: vec![],
            body: Bytes::from(body),
        }),
    };
    let encoded = big.encode();
    assert_eq!(
        s.complete(&k(1), &a, &encoded, LEASE).await.ok(),
        Some(true)
    );
    assert_eq!(
        s.complete(&k(1), &a, &encoded, LEASE).await.ok(),
        Some(true),
        "a retried completion compares several MiB"
    );
    assert_eq!(s.get(&k(1)).await.ok(), Some(Some(big)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_wake_on_completion() {
    let f = Fixture::new();
    let a = held(1);
    assert!(f.handle.claim(&k(1), &a, LEASE).await.is_ok());
    let s2 = f.handle.clone();
    let waiter = tokio::spawn(async move {
        let start = Instant::now();
        s2.wait_change(&k(1), Duration::from_secs(20)).await;
        start.elapsed()
    });
    let key = k(1).text();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !f.store.inner.waiters.is_waited_on(&key) {
        assert!(Instant::now() < deadline, "the waiter never registered");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let d = done(1).encode();
    assert_eq!(
        f.handle.complete(&k(1), &a, &d, LEASE).await.ok(),
        Some(true)
    );
    let waited = waiter.await.expect("waiter");
    assert!(
        waited < Duration::from_secs(10),
        "woken by the completion, not at the deadline ({waited:?})"
    );
    assert!(
        !f.store.inner.waiters.is_waited_on(&key),
        "nothing left behind"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_that_times_out_leaves_nothing_behind() {
    let f = Fixture::new();
    assert!(f.handle.claim(&k(1), &held(1), LEASE).await.is_ok());
    let start = Instant::now();
    f.handle
        .wait_change(&k(1), Duration::from_millis(100))
        .await;
    assert!(start.elapsed() >= Duration::from_millis(100));
    assert!(!f.store.inner.waiters.is_waited_on(&k(1).text()));
}

/// Holds the file's write lock from a connection of its own (an operator's shell in a write
/// transaction) for `hold`, on a thread; returns once the lock is held.
fn hold_write_lock(f: &Fixture, hold: Duration) -> std::thread::JoinHandle<()> {
    let shell = f.shell();
    let (held, is_held) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        shell.execute_batch("BEGIN IMMEDIATE").expect("lock");
        held.send(()).expect("tell");
        std::thread::sleep(hold);
        shell.execute_batch("COMMIT").expect("unlock");
    });
    is_held.recv().expect("the lock is held");
    thread
}

/// Many claims arriving while one commit is under way are applied together: far fewer
/// commits than operations.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_commit_batches_concurrent_claims() {
    let f = Fixture::new();
    // While another connection holds the lock, the first claim waits in BEGIN (the busy
    // timeout) and the others queue up behind it.
    let lock = hold_write_lock(&f, Duration::from_millis(150));
    let mut tasks = Vec::new();
    for n in 0..200u8 {
        let s = f.handle.clone();
        tasks.push(tokio::spawn(async move {
            s.claim(&k(n), &held(1), LEASE).await
        }));
    }
    for t in tasks {
        assert_eq!(t.await.expect("task").ok(), Some(Claim::Claimed));
    }
    lock.join().expect("lock thread");
    let commits = f.commits();
    assert_eq!(
        f.metric("idemproxy_sqlite_batch_size_sum"),
        200.0,
        "every claim committed once"
    );
    assert!(commits <= 20.0, "200 claims took {commits} commits");
    assert_eq!(f.rows(), 200);
}

/// Acknowledged only after the commit: once a claim (or a completion) is answered, a
/// connection of its own sees it in the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answered_write_is_committed() {
    let f = Fixture::with(SqliteSync::Full, Duration::from_secs(3600));
    let shell = f.shell();
    let token_of = |n: u8| -> Option<Option<Vec<u8>>> {
        shell
            .query_row(
                "SELECT token FROM records WHERE key = ?1",
                [k(n).text()],
                |r| r.get(0),
            )
            .optional()
            .expect("read")
    };
    for n in 0..20u8 {
        let a = held(1);
        assert_eq!(
            f.handle.claim(&k(n), &a, LEASE).await.ok(),
            Some(Claim::Claimed)
        );
        assert_eq!(
            token_of(n),
            Some(Some(token("t", &a).expect("token").to_vec()))
        );
        assert_eq!(
            f.handle
                .complete(&k(n), &a, &done(1).encode(), LEASE)
                .await
                .ok(),
            Some(true)
        );
        assert_eq!(token_of(n), Some(None), "finished: token NULL");
    }
    // And a claim is not answered while its transaction cannot commit.
    let lock = hold_write_lock(&f, Duration::from_millis(150));
    let started = Instant::now();
    assert_eq!(
        f.handle.claim(&k(100), &held(1), LEASE).await.ok(),
        Some(Claim::Claimed)
    );
    assert!(started.elapsed() >= Duration::from_millis(100));
    assert!(token_of(100).is_some());
    lock.join().expect("lock thread");
}

/// One operation failing inside a batch is undone alone: the others of its batch commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_operation_does_not_poison_its_batch() {
    let f = Fixture::new();
    let lock = hold_write_lock(&f, Duration::from_millis(150));
    let before = f.handle.clone();
    let first = tokio::spawn(async move { before.claim(&k(1), &held(1), LEASE).await });
    tokio::time::sleep(Duration::from_millis(30)).await;
    // Queued behind the first claim, so these three share a batch.
    let inner = f.store.inner.clone();
    let failing = tokio::spawn(async move {
        inner
            .writer
            .submit("test", None, false, |ops, _| {
                // Writes, then fails: its savepoint must undo the write.
                ops.conn().execute(
                    "INSERT INTO records (key, value, expires_at) VALUES ('half', x'00', 9e15)",
                    [],
                )?;
                ops.conn()
                    .execute("INSERT INTO no_such_table VALUES (1)", [])
            })
            .await
    });
    let after = f.handle.clone();
    let second = tokio::spawn(async move { after.claim(&k(2), &held(1), LEASE).await });
    assert_eq!(first.await.expect("task").ok(), Some(Claim::Claimed));
    let err = failing.await.expect("task").expect_err("a statement error");
    assert!(err.to_string().contains("no_such_table"), "{err}");
    assert_eq!(second.await.expect("task").ok(), Some(Claim::Claimed));
    lock.join().expect("lock thread");
    assert_eq!(
        f.rows(),
        2,
        "both claims, and nothing of the failed operation"
    );
}

/// Another connection holding the write lock longer than the busy timeout: a store error in
/// bounded time, and the store serves again once the lock is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_file_gives_errors_in_bounded_time() {
    let f = Fixture::new();
    let lock = hold_write_lock(&f, Duration::from_millis(1500));
    let started = Instant::now();
    let err = f
        .handle
        .claim(&k(1), &held(1), LEASE)
        .await
        .expect_err("the file is locked");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    assert!(err.to_string().contains("locked"), "{err}");
    assert!(f.handle.ping().await.is_err(), "not ready while locked");
    lock.join().expect("lock thread");
    assert_eq!(
        f.handle.claim(&k(1), &held(1), LEASE).await.ok(),
        Some(Claim::Claimed)
    );
    assert!(f.handle.ping().await.is_ok());
}

/// A writer thread that died answers with errors, at once, never a hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_writer_thread_gives_errors_not_hangs() {
    let f = Fixture::new();
    let panicked = f
        .store
        .inner
        .writer
        .submit("test", None, false, |_, _| -> rusqlite::Result<()> {
            panic!("a bug in the writer")
        })
        .await;
    assert!(panicked.is_err());
    let started = Instant::now();
    let err = f
        .handle
        .claim(&k(1), &held(1), LEASE)
        .await
        .expect_err("no writer");
    assert!(
        err.to_string().contains("writer thread has stopped"),
        "{err}"
    );
    assert!(f.handle.ping().await.is_err());
    assert!(started.elapsed() < Duration::from_secs(1));
    // Reads still work.
    assert_eq!(f.handle.get(&k(1)).await.ok(), Some(None));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ping_goes_through_the_writer_and_a_reader() {
    let f = Fixture::new();
    let before = f.commits();
    assert!(f.handle.ping().await.is_ok());
    assert_eq!(f.commits(), before + 1.0, "a no-op transaction committed");
}

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
        s.complete(&k(4), &a, &done(1).encode(), LEASE * 100)
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
            .complete(&k(1), &a, &done(1).encode(), LEASE)
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

/// Concurrent claims of one key that all find it free on a read connection: the writer's
/// upsert lets exactly one take it, and shows the others the winner's claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_claims_past_the_read_have_one_winner() {
    let f = Fixture::new();
    // Every claim reads "absent" while the writer cannot commit, then queues on it.
    let lock = hold_write_lock(&f, Duration::from_millis(150));
    let contenders: Vec<Held> = (0..20).map(|_| held(1)).collect();
    let mut tasks = Vec::new();
    for h in &contenders {
        let (s, h) = (f.handle.clone(), h.clone());
        tasks.push(tokio::spawn(async move { s.claim(&k(1), &h, LEASE).await }));
    }
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.expect("task").expect("claim"));
    }
    lock.join().expect("lock thread");
    let winners: Vec<usize> = (0..answers.len())
        .filter(|i| answers[*i] == Claim::Claimed)
        .collect();
    assert_eq!(winners.len(), 1, "{answers:?}");
    let winner = &contenders[winners[0]];
    for a in answers.iter().filter(|a| **a != Claim::Claimed) {
        assert_eq!(*a, Claim::Existing(winner.record.clone()));
    }
    let commits = f.commits();
    assert!(commits < 20.0, "20 claims took {commits} commits");
}

/// A lapsed lease can never complete, even when nobody has taken the key since: the row is
/// still the holder's, but its `expires_at` has passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lapsed_lease_can_never_complete() {
    let f = Fixture::new();
    let s = &f.handle;
    let a = held(1);
    assert!(s.claim(&k(1), &a, Duration::from_secs(1)).await.is_ok());
    f.advance(Duration::from_millis(1001));
    let d = done(1).encode();
    assert_eq!(s.complete(&k(1), &a, &d, LEASE).await.ok(), Some(false));
    assert_eq!(s.get(&k(1)).await.ok(), Some(None));
    let token: Option<Vec<u8>> = f
        .shell()
        .query_row(
            "SELECT token FROM records WHERE key = ?1",
            [k(1).text()],
            |r| r.get(0),
        )
        .expect("the lapsed row is still there, unchanged");
    assert_eq!(token, Some(token_of(&a)));
}

fn token_of(h: &Held) -> Vec<u8> {
    token("test", h).expect("a claim").to_vec()
}
