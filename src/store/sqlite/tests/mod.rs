//! Unit tests of the SQLite store, each on a file of its own in a temporary directory. Time is
//! moved forward on the store's clock ([`Clock::advance`]) rather than slept through.
//!
//! Here: the store contract, as the memory store's tests check it. [`writer`]: group commit,
//! answers after the commit, failures of one operation, of the batch, of the thread.
//! [`file`]: the lock, the schema, reopening, the sweep.

use std::time::Instant;

use http::StatusCode;
use rusqlite::Connection;

use super::*;
use crate::record::{Record, Saved, SavedResponse, new_token};
use crate::store::{Claim, StoreHandle};

mod file;
mod writer;

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
    Record::Finished {
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
    assert_eq!(s.save(&k(1), &a, &d, LEASE).await.ok(), Some(false));
    assert_eq!(s.renew(&k(1), &a, LEASE).await.ok(), Some(false));
    assert_eq!(s.release(&k(1), &a).await.ok(), Some(false));
    assert_eq!(s.get(&k(1)).await.ok(), Some(Some(b.record.clone())));
    assert_eq!(s.save(&k(1), &b, &d, LEASE).await.ok(), Some(true));
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
    assert_eq!(s.save(&k(1), &a, &d, LEASE).await.ok(), Some(true));
    assert_eq!(s.save(&k(1), &a, &d, LEASE).await.ok(), Some(true));
    let other = done(2).encode();
    assert_eq!(s.save(&k(1), &a, &other, LEASE).await.ok(), Some(false));
    assert_eq!(s.get(&k(1)).await.ok(), Some(Some(done(1))));
    // Once the record's TTL is over, the retried save finds nothing of its own.
    f.advance(LEASE + Duration::from_millis(1));
    assert_eq!(s.save(&k(1), &a, &d, LEASE).await.ok(), Some(false));
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
    assert!(s.save(&k(3), &b, &done(1).encode(), LEASE).await.is_ok());
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
    assert!(s.save(&k(1), &a, &done(1).encode(), LEASE).await.is_ok());
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
    assert!(s.save(&k(1), &a, &done(1).encode(), ttl_done).await.is_ok());
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
    assert_eq!(s.save(&k(1), &a, &d, Duration::MAX).await.ok(), Some(true));
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
    let big = Record::Finished {
        fingerprint: [1; 32],
        saved: Saved::Response(SavedResponse {
            status: StatusCode::CREATED,
            headers: vec![],
            body: Bytes::from(body),
        }),
    };
    let encoded = big.encode();
    assert_eq!(s.save(&k(1), &a, &encoded, LEASE).await.ok(), Some(true));
    assert_eq!(
        s.save(&k(1), &a, &encoded, LEASE).await.ok(),
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
    assert_eq!(f.handle.save(&k(1), &a, &d, LEASE).await.ok(), Some(true));
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
    assert_eq!(s.save(&k(1), &a, &d, LEASE).await.ok(), Some(false));
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

/// A read stall (both read threads stuck) fills the read queue up to its bound; past it, a
/// read fails at once with a store error (a 503 to its request), never waits; once the threads
/// run again, reads are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_read_queue_bound_a_read_fails_at_once_during_a_stall() {
    use futures_util::FutureExt;
    use std::sync::mpsc;

    let f = Fixture::new();
    assert!(f.handle.claim(&k(1), &held(1), LEASE).await.is_ok());
    let readers = &f.store.inner.readers;
    // Both read threads take a job that waits for the test: the stall.
    let (started, stalls) = mpsc::channel::<()>();
    let mut releases = Vec::new();
    // Kept, so their jobs are not skipped as abandoned.
    let mut stalling = Vec::new();
    for _ in 0..readers::READERS {
        let (release, released) = mpsc::channel::<()>();
        releases.push(release);
        let started = started.clone();
        let mut stall = Box::pin(readers.read("get", move |_, _| {
            let _ = started.send(());
            let _ = released.recv();
            Ok(())
        }));
        // Queued by the first poll.
        std::future::poll_fn(|cx| {
            assert!(stall.as_mut().poll(cx).is_pending());
            std::task::Poll::Ready(())
        })
        .await;
        stalling.push(stall);
    }
    for _ in 0..readers::READERS {
        stalls
            .recv_timeout(Duration::from_secs(5))
            .expect("a read thread took its stalling job");
    }
    // Requests whose callers gave up at store.timeout: their jobs stay queued meanwhile.
    for _ in 0..readers::QUEUE {
        let read = readers.read("get", |_, _| Ok(()));
        assert!(read.now_or_never().is_none(), "queued, not refused");
    }
    let started = Instant::now();
    let past = tokio::time::timeout(Duration::from_secs(5), f.handle.get(&k(1)))
        .await
        .expect("a read past the bound never waits");
    let Err(e) = past else {
        panic!("a read past the bound fails: {past:?}");
    };
    assert!(matches!(e, StoreError::Backend { op: "get", .. }), "{e:?}");
    assert!(e.to_string().contains("already waiting"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(1), "at once");
    assert_eq!(
        crate::problem::Problem::of_store(&e).status(),
        StatusCode::SERVICE_UNAVAILABLE
    );

    for release in releases {
        let _ = release.send(());
    }
    for stall in stalling {
        assert!(stall.await.is_ok(), "the stalled reads end");
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match f.handle.get(&k(1)).await {
            Ok(Some(_)) => break,
            other => assert!(Instant::now() < deadline, "reads answered again: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

// A claim that can be resolved (`on_unknown_outcome: resolve`): its contract is the harness's
// (`store_checks::resolvable`, on this store's clock moved forward); here, what the sweep does
// with one.

/// A new resolvable claim whose lookup is never made here: the sweep reads only its times.
fn resolvable(give_up_after: Duration) -> Held {
    use crate::record::{Lookup, Resolvable};
    Held::new(Record::Resolvable(Box::new(Resolvable::claim(
        new_token(),
        [4; 32],
        Lookup {
            upstream: "booking".into(),
            method: http::Method::GET,
            target: "/bookings/by-reference/r-1".into(),
            headers: vec![],
        },
        Duration::from_secs(60),
        Duration::from_secs(5),
        give_up_after,
    ))))
}

/// The sweep deletes a resolvable claim by its lifetime, never by its lapsed lease.
#[tokio::test]
async fn the_sweep_leaves_a_resolvable_claim_until_its_lifetime() {
    use crate::store::ResolvableTimes;
    let f = Fixture::new();
    let give_up = Duration::from_secs(30);
    let a = resolvable(give_up);
    let times = ResolvableTimes {
        lease: Duration::from_secs(10),
        send_margin: Duration::from_secs(2),
        lifetime: give_up * 2,
    };
    f.handle
        .claim_resolvable(&k(4), &a, times)
        .await
        .expect("claim");
    f.advance(Duration::from_secs(40));
    f.store.inner.sweep_batch().await.expect("sweep");
    assert_eq!(f.rows(), 1, "a lapsed lease is no lapsed record");
    f.advance(Duration::from_secs(30));
    f.store.inner.sweep_batch().await.expect("sweep");
    assert_eq!(f.rows(), 0, "gone after 2 s + 60 s");
}
