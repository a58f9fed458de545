//! The writer thread: group commit, answers only after the commit, an operation failing
//! alone, a locked file, a dead thread.

use std::time::Instant;

use rusqlite::OptionalExtension;

use super::*;

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

/// Acknowledged only after the commit: once a claim (or a save) is answered, a
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
                .save(&k(n), &a, &done(1).encode(), LEASE)
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

/// An operation after which SQLite has rolled back the whole transaction (as it does itself
/// on an I/O error or a full disk; here the operation rolls back on purpose): nothing of the
/// batch was written, so every operation in it is answered with an error, and the next batch
/// starts afresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_whose_transaction_is_lost_answers_every_operation_with_an_error() {
    let f = Fixture::new();
    let lock = hold_write_lock(&f, Duration::from_millis(150));
    let blocker = f.handle.clone();
    let blocked = tokio::spawn(async move { blocker.claim(&k(1), &held(1), LEASE).await });
    tokio::time::sleep(Duration::from_millis(30)).await;
    // These three share the next batch: a claim, the loss, a claim.
    let before = f.handle.clone();
    let first = tokio::spawn(async move { before.claim(&k(2), &held(1), LEASE).await });
    tokio::time::sleep(Duration::from_millis(10)).await;
    let inner = f.store.inner.clone();
    let losing = tokio::spawn(async move {
        inner
            .writer
            .submit("test", None, false, |ops, _| {
                ops.conn().execute_batch("ROLLBACK")
            })
            .await
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    let after = f.handle.clone();
    let second = tokio::spawn(async move { after.claim(&k(3), &held(1), LEASE).await });
    assert_eq!(blocked.await.expect("task").ok(), Some(Claim::Claimed));
    let first = first.await.expect("task");
    assert!(losing.await.expect("task").is_err());
    let second = second.await.expect("task");
    lock.join().expect("lock thread");
    for (name, answer) in [("before", first), ("after", second)] {
        let err = answer.expect_err("the batch was lost");
        assert!(err.to_string().contains("rolled back"), "{name}: {err}");
    }
    assert_eq!(f.rows(), 1, "only the first batch's claim");
    assert_eq!(
        f.handle.claim(&k(2), &held(1), LEASE).await.ok(),
        Some(Claim::Claimed),
        "the next batch commits"
    );
}

/// Answers go through a mailbox of the caller's thread (`answers.rs`): a caller on a runtime
/// started after the thread's last one ended still gets its answer, at once (a mailbox left
/// from the ended runtime, with no task to empty it, would hold it until the deadline).
#[test]
fn a_caller_on_each_new_runtime_of_a_thread_is_answered() {
    let started = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let f = {
        let _in = started.enter();
        Fixture::new()
    };
    for n in 0..3u8 {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let asked = Instant::now();
        let claimed = runtime.block_on(f.handle.claim(&k(n), &held(1), LEASE));
        assert_eq!(
            claimed.ok(),
            Some(Claim::Claimed),
            "the claim on runtime {n}"
        );
        assert!(
            asked.elapsed() < Duration::from_secs(2),
            "runtime {n} waited {:?} for its answer",
            asked.elapsed()
        );
        drop(runtime);
    }
    assert_eq!(f.rows(), 3);
}
