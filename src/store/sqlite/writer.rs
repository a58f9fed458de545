//! The writer thread: the one connection that writes, and group commit.
//!
//! SQLite allows one writer at a time, and a commit costs about the same for one operation as
//! for a hundred (appending to the WAL, and with `sync: full` an fsync). So a single std thread
//! (not a tokio task: every statement blocks) owns the write connection, takes everything
//! queued — up to [`MAX_BATCH`] operations — and applies it in one transaction:
//! `BEGIN IMMEDIATE`, each operation, `COMMIT`, then the answers.
//!
//! - **An answer only after its commit.** A claim acknowledged before its commit could be lost
//!   in a crash and then run twice; so every operation's answer waits in [`Applied`] until the
//!   batch has committed. If the commit fails, nothing of the batch was written, and every
//!   operation gets an error.
//! - **One operation failing does not fail the others.** Each runs under a savepoint: a
//!   statement that fails (a record over SQLite's blob limit, a disk that fills up while one
//!   large record is written) is rolled back alone and answered with its error, and the batch
//!   commits the rest. Per-operation errors cannot be ruled out (record sizes come from
//!   upstreams), so they are contained rather than left to fail a whole batch. The exception
//!   is an error after which SQLite rolls back the whole transaction itself (an I/O error, a
//!   full disk): then the batch is lost and every operation in it is answered with an error.
//! - **A caller that gave up is skipped.** `StoreHandle` drops an operation's future at its
//!   deadline: such an operation's outcome is unknown to its caller either way, so it is not
//!   applied. This keeps a queue that backed up (a file locked by an operator) from applying
//!   claims for requests that are long gone.
//! - **Bounded.** The queue holds [`QUEUE`] operations; senders wait (under their deadline)
//!   for room.
//! - **Failure is an answer.** A thread that panicked drops its queue, and with it every
//!   pending answer: callers get a store error at once, never a hang. Dropping the store
//!   closes the queue; the thread drains what is queued, then ends, and the drop waits for it,
//!   so the file is closed before its lock is released.
//! - The sweep's deletions come through the same queue, each as a transaction of its own
//!   ([`Job::alone`]), between batches of claims.
//! - **A batch's answers wake each worker once** (`answers.rs`): they are left in a mailbox of
//!   the caller's thread, which a task of its runtime empties, instead of each waking its
//!   caller's runtime from this thread (and being preempted by it).

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use rusqlite::{Connection, Statement};
use tokio::sync::{mpsc, oneshot};

use super::answers::{self, Mailbox, ToWake};
use super::clock::Clock;
use super::ops::Ops;
use super::waiters::Waiters;
use super::{sql_error, unavailable};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::metrics::{StoreSeries, encode_one, latency};
use crate::store::StoreError;

/// The most operations one transaction applies.
pub(super) const MAX_BATCH: usize = 256;

/// The most operations waiting for the writer.
const QUEUE: usize = 4096;

/// The writer thread, as the store sees it.
pub(super) struct Writer {
    /// `None` once dropping.
    queue: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

/// What the writer thread shares with the store.
pub(super) struct Shared {
    pub(super) clock: Arc<Clock>,
    pub(super) waiters: Arc<Waiters>,
    pub(super) series: SqliteSeries,
}

/// The SQLite store's series: the writer's commits.
#[derive(Clone, Debug)]
pub struct SqliteSeries {
    /// Operations committed per transaction (group commit).
    batch_size: Histogram,
    /// How long each commit took.
    commit_duration: Histogram,
}

impl StoreSeries for SqliteSeries {
    fn register(registry: &mut Registry) -> Self {
        let series = SqliteSeries {
            batch_size: Histogram::new(exponential_buckets(1.0, 2.0, 11)),
            commit_duration: latency(),
        };
        registry.register_collector(Box::new(series.clone()));
        series
    }
}

impl Collector for SqliteSeries {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        encode_one(
            &mut encoder,
            "idemproxy_sqlite_batch_size",
            "Store operations committed together in one SQLite transaction (group commit)",
            &self.batch_size,
        )?;
        encode_one(
            &mut encoder,
            "idemproxy_sqlite_commit_duration_seconds",
            "Duration of each SQLite commit of the writer thread",
            &self.commit_duration,
        )
    }
}

impl Writer {
    /// Starts the thread on the write connection.
    pub(super) fn start(conn: Connection, shared: Shared) -> std::io::Result<Writer> {
        let (queue, jobs) = mpsc::channel(QUEUE);
        let thread = std::thread::Builder::new()
            .name("idemproxy-sqlite-writer".into())
            .spawn(move || run(conn, jobs, shared))?;
        Ok(Writer {
            queue: Some(queue),
            thread: Some(thread),
        })
    }

    /// Queues `run` and waits for its answer, which comes only after the transaction it ran
    /// in has committed. `wake`: the key whose waiters are woken once it has. `alone`: in a
    /// transaction of its own (the sweep).
    pub(super) async fn submit<T, F>(
        &self,
        op: &'static str,
        wake: Option<String>,
        alone: bool,
        run: F,
    ) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: for<'c> FnOnce(&mut Ops<'c>, i64) -> rusqlite::Result<T> + Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        let job = Job {
            work: Box::new(Op {
                op,
                wake,
                reply,
                mailbox: answers::current(),
                run,
            }),
            alone,
        };
        let stopped = || unavailable(op, "the SQLite writer thread has stopped");
        let queue = self.queue.as_ref().ok_or_else(stopped)?;
        queue.send(job).await.map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        // Closing the queue ends the thread once it has applied what is queued.
        drop(self.queue.take());
        if let Some(thread) = self.thread.take() {
            // A thread that panicked has already answered (with errors) by dropping its queue.
            let _ = thread.join();
        }
    }
}

/// One queued operation.
pub(super) struct Job {
    work: Box<dyn Work>,
    /// Runs in a transaction of its own.
    alone: bool,
}

/// An operation not yet applied.
trait Work: Send {
    /// Its caller no longer waits for the answer.
    fn abandoned(&self) -> bool;
    /// Runs it, under a savepoint, in the open transaction.
    fn apply(self: Box<Self>, w: &mut WriterThread<'_>, now: i64) -> Box<dyn Applied>;
    /// Answers it with an error without running it.
    fn fail(self: Box<Self>, why: &str);
}

/// An operation applied in the open transaction, its answer held until the commit.
trait Applied: Send {
    /// Sends the answer: the operation's own if the batch committed (`Ok`), else the reason
    /// nothing was written; through its caller's mailbox, noted in `to_wake`, if it has one.
    fn settle(
        self: Box<Self>,
        committed: Result<(), &str>,
        waiters: &Waiters,
        to_wake: &mut ToWake,
    );
}

struct Op<T, F> {
    op: &'static str,
    wake: Option<String>,
    reply: oneshot::Sender<Result<T, StoreError>>,
    /// The caller's worker's (`answers.rs`).
    mailbox: Option<Arc<Mailbox>>,
    run: F,
}

impl<T, F> Work for Op<T, F>
where
    T: Send + 'static,
    F: for<'c> FnOnce(&mut Ops<'c>, i64) -> rusqlite::Result<T> + Send + 'static,
{
    fn abandoned(&self) -> bool {
        self.reply.is_closed()
    }

    fn apply(self: Box<Self>, w: &mut WriterThread<'_>, now: i64) -> Box<dyn Applied> {
        let Op {
            op,
            wake,
            reply,
            mailbox,
            run,
        } = *self;
        let result = w.guarded(|ops| run(ops, now));
        Box::new(Done {
            op,
            wake,
            reply,
            mailbox,
            result,
        })
    }

    fn fail(self: Box<Self>, why: &str) {
        let _ = self.reply.send(Err(unavailable(self.op, why)));
    }
}

struct Done<T> {
    op: &'static str,
    wake: Option<String>,
    reply: oneshot::Sender<Result<T, StoreError>>,
    mailbox: Option<Arc<Mailbox>>,
    result: rusqlite::Result<T>,
}

impl<T: Send + 'static> Applied for Done<T> {
    fn settle(
        self: Box<Self>,
        committed: Result<(), &str>,
        waiters: &Waiters,
        to_wake: &mut ToWake,
    ) {
        let answer = match (self.result, committed) {
            (Err(e), _) => Err(sql_error(self.op, "the SQLite writer", e)),
            (Ok(_), Err(why)) => Err(unavailable(self.op, why)),
            (Ok(v), Ok(())) => Ok(v),
        };
        let changed = answer.is_ok();
        let reply = self.reply;
        match &self.mailbox {
            Some(mailbox) => {
                if mailbox.leave(Box::new(move || {
                    let _ = reply.send(answer);
                })) {
                    to_wake.add(mailbox);
                }
            }
            None => {
                let _ = reply.send(answer);
            }
        }
        if changed && let Some(key) = &self.wake {
            waiters.wake(key);
        }
    }
}

/// The thread's body.
fn run(conn: Connection, mut jobs: mpsc::Receiver<Job>, shared: Shared) {
    match WriterThread::prepare(&conn, shared) {
        Ok(mut w) => w.serve(&mut jobs),
        Err(e) => {
            tracing::error!(error = %e, "the SQLite writer cannot prepare its statements");
            let why = format!("the SQLite writer cannot prepare its statements: {e}");
            while let Some(job) = jobs.blocking_recv() {
                job.work.fail(&why);
            }
        }
    }
}

/// The write connection and its statements, on the writer thread.
struct WriterThread<'c> {
    conn: &'c Connection,
    ops: Ops<'c>,
    begin: Statement<'c>,
    commit: Statement<'c>,
    rollback: Statement<'c>,
    savepoint: Statement<'c>,
    release_savepoint: Statement<'c>,
    rollback_to_savepoint: Statement<'c>,
    shared: Shared,
}

impl<'c> WriterThread<'c> {
    fn prepare(conn: &'c Connection, shared: Shared) -> rusqlite::Result<WriterThread<'c>> {
        Ok(WriterThread {
            conn,
            ops: Ops::prepare(conn)?,
            // IMMEDIATE: the write lock is taken at BEGIN, so no statement of the batch can
            // meet a lock it has to wait for halfway through.
            begin: conn.prepare("BEGIN IMMEDIATE")?,
            commit: conn.prepare("COMMIT")?,
            rollback: conn.prepare("ROLLBACK")?,
            savepoint: conn.prepare("SAVEPOINT op")?,
            release_savepoint: conn.prepare("RELEASE op")?,
            rollback_to_savepoint: conn.prepare("ROLLBACK TO op")?,
            shared,
        })
    }

    /// Applies batches until the queue is closed and empty.
    fn serve(&mut self, jobs: &mut mpsc::Receiver<Job>) {
        let mut carried: Option<Job> = None;
        loop {
            let first = match carried.take() {
                Some(job) => job,
                None => match jobs.blocking_recv() {
                    Some(job) => job,
                    None => return,
                },
            };
            let alone = first.alone;
            let mut batch = vec![first];
            // Everything queued now joins the batch; nothing waits for more to arrive, so a
            // lone operation on an idle store commits at once.
            while !alone && batch.len() < MAX_BATCH {
                match jobs.try_recv() {
                    Ok(job) if job.alone => {
                        carried = Some(job);
                        break;
                    }
                    Ok(job) => batch.push(job),
                    Err(_) => break,
                }
            }
            self.apply_batch(batch);
        }
    }

    /// One transaction: every operation of `batch`, then the commit, then the answers.
    fn apply_batch(&mut self, batch: Vec<Job>) {
        let jobs: Vec<Job> = batch.into_iter().filter(|j| !j.work.abandoned()).collect();
        if jobs.is_empty() {
            return;
        }
        if let Err(e) = self.begin.execute([]) {
            let why = format!("cannot begin an SQLite write transaction: {e}");
            for job in jobs {
                job.work.fail(&why);
            }
            return;
        }
        let mut applied = Vec::with_capacity(jobs.len());
        let mut rest = jobs.into_iter();
        let mut lost = false;
        for job in rest.by_ref() {
            let now = self.shared.clock.now_ms();
            applied.push(job.work.apply(self, now));
            if self.conn.is_autocommit() {
                // SQLite ended the transaction itself: what was applied is gone.
                lost = true;
                break;
            }
        }
        if lost {
            let why = "SQLite rolled back the write transaction after an operation in it failed";
            let mut to_wake = ToWake::default();
            for a in applied {
                a.settle(Err(why), &self.shared.waiters, &mut to_wake);
            }
            to_wake.wake();
            for job in rest {
                job.work.fail(why);
            }
            return;
        }
        let size = applied.len();
        #[allow(
            clippy::disallowed_methods,
            reason = "times the commit for its histogram, on the writer's own thread; no record's time"
        )]
        let started = Instant::now();
        let mut to_wake = ToWake::default();
        match self.commit.execute([]) {
            Ok(_) => {
                let series = &self.shared.series;
                series
                    .commit_duration
                    .observe(started.elapsed().as_secs_f64());
                series.batch_size.observe(size as f64);
                for a in applied {
                    a.settle(Ok(()), &self.shared.waiters, &mut to_wake);
                }
            }
            Err(e) => {
                if !self.conn.is_autocommit() {
                    let _ = self.rollback.execute([]);
                }
                let why =
                    format!("the SQLite commit failed, nothing of its batch was written: {e}");
                for a in applied {
                    a.settle(Err(&why), &self.shared.waiters, &mut to_wake);
                }
            }
        }
        to_wake.wake();
    }

    /// Runs one operation under a savepoint, so that its failure undoes it alone.
    fn guarded<T>(
        &mut self,
        f: impl FnOnce(&mut Ops<'c>) -> rusqlite::Result<T>,
    ) -> rusqlite::Result<T> {
        self.savepoint.execute([])?;
        match f(&mut self.ops) {
            Ok(v) => {
                self.release_savepoint.execute([])?;
                Ok(v)
            }
            Err(e) => {
                if !self.conn.is_autocommit() {
                    let undone = self
                        .rollback_to_savepoint
                        .execute([])
                        .and_then(|_| self.release_savepoint.execute([]));
                    if undone.is_err() {
                        // It cannot be undone alone: give the whole batch up (the caller sees
                        // the transaction gone and answers every operation with an error).
                        let _ = self.rollback.execute([]);
                    }
                }
                Err(e)
            }
        }
    }
}
