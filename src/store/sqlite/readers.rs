//! The read side: a few threads, each owning a read connection and its prepared statements.
//!
//! WAL lets readers run beside the writer: each read sees the last committed state, never a
//! batch half applied, and never waits for the writer's lock. The reads (`get`, `inspect`,
//! `ping`'s read, and the first look of a claim) thus never queue behind group commits.
//! Statements block, so they run on these std threads, not on the runtime's workers; a thread
//! keeps its statements prepared for its whole life.
//!
//! The threads take jobs from one shared queue. A job whose caller gave up is skipped. A thread
//! that panicked is one fewer to serve; when none is left, the queue is closed and every read
//! fails at once with a store error.
//!
//! The queue is bounded ([`QUEUE`]): during a read stall (a disk that stopped answering, say)
//! it would otherwise grow with the request rate, each caller's job kept long after the caller
//! gave up at `store.timeout`. Past the bound a read fails at once, a store error (503) like
//! any other, never a wait.

use std::path::Path;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use bytes::Bytes;
use rusqlite::{Connection, OptionalExtension, Statement, params};
use tokio::sync::oneshot;

use super::clock::Clock;
use super::file::{self, OpenError};
use super::{sql_error, unavailable};
use crate::store::StoreError;

/// Read threads (and connections). Reads are short and the machine may be small: two serve
/// replays beside the writer without crowding it.
pub(super) const READERS: usize = 2;

/// Reads waiting for a read thread, at most. Far more than a healthy file ever queues (each read
/// takes microseconds), few enough to hold nothing worth counting.
pub(super) const QUEUE: usize = 1024;

const LIVE: &str = "SELECT value, expires_at FROM records WHERE key = ?1 AND expires_at > ?2";
const VERSION: &str = "SELECT max(version) FROM schema_version";

/// A live row as read.
pub(super) struct Row {
    pub(super) value: Bytes,
    pub(super) expires_at: i64,
}

/// A read connection's statements.
pub(super) struct Reads<'c> {
    live: Statement<'c>,
    version: Statement<'c>,
}

impl<'c> Reads<'c> {
    fn prepare(conn: &'c Connection) -> rusqlite::Result<Reads<'c>> {
        Ok(Reads {
            live: conn.prepare(LIVE)?,
            version: conn.prepare(VERSION)?,
        })
    }

    /// The key's row if it is live at `now`.
    pub(super) fn live(&mut self, key: &str, now: i64) -> rusqlite::Result<Option<Row>> {
        self.live
            .query_row(params![key, now], |r| {
                Ok(Row {
                    value: Bytes::from(r.get::<_, Vec<u8>>(0)?),
                    expires_at: r.get(1)?,
                })
            })
            .optional()
    }

    /// The schema version (a read that proves the file answers).
    pub(super) fn version(&mut self) -> rusqlite::Result<Option<i64>> {
        self.version.query_row([], |r| r.get(0))
    }
}

type ReadJob = Box<dyn for<'c> FnOnce(&mut Reads<'c>, i64) + Send>;

/// The read threads, as the store sees them.
pub(super) struct Readers {
    /// `None` once dropping.
    queue: Option<SyncSender<ReadJob>>,
    threads: Vec<JoinHandle<()>>,
}

impl Readers {
    /// Opens [`READERS`] connections (here, so that a failure is an error of the open) and
    /// starts a thread on each.
    pub(super) fn start(path: &Path, clock: Arc<Clock>) -> Result<Readers, OpenError> {
        let conns = (0..READERS)
            .map(|_| file::open_reader(path))
            .collect::<Result<Vec<_>, _>>()?;
        let (queue, jobs) = std::sync::mpsc::sync_channel::<ReadJob>(QUEUE);
        let jobs = Arc::new(Mutex::new(jobs));
        let mut threads = Vec::with_capacity(READERS);
        for (i, conn) in conns.into_iter().enumerate() {
            let (jobs, clock) = (jobs.clone(), clock.clone());
            let thread = std::thread::Builder::new()
                .name(format!("idemproxy-sqlite-reader-{i}"))
                .spawn(move || serve(conn, &jobs, &clock))
                .map_err(|source| OpenError::Io {
                    what: "cannot start a read thread for",
                    path: path.to_owned(),
                    source,
                })?;
            threads.push(thread);
        }
        Ok(Readers {
            queue: Some(queue),
            threads,
        })
    }

    /// Runs `read` on a read connection, with `now` on the store's clock.
    pub(super) async fn read<T, F>(&self, op: &'static str, read: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: for<'c> FnOnce(&mut Reads<'c>, i64) -> rusqlite::Result<T> + Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        let job: ReadJob = Box::new(move |reads, now| {
            if !reply.is_closed() {
                let _ = reply.send(read(reads, now));
            }
        });
        let stopped = || unavailable(op, "the SQLite read threads have stopped");
        // Never blocks the runtime's thread: a full queue is an error at once.
        let queue = self.queue.as_ref().ok_or_else(stopped)?;
        queue.try_send(job).map_err(|e| match e {
            TrySendError::Full(_) => unavailable(
                op,
                &format!(
                    "{QUEUE} SQLite reads are already waiting for a read thread (the file stalls)"
                ),
            ),
            TrySendError::Disconnected(_) => stopped(),
        })?;
        answer
            .await
            .map_err(|_| stopped())?
            .map_err(|e| sql_error(op, "an SQLite read connection", e))
    }
}

impl Drop for Readers {
    fn drop(&mut self) {
        // Closing the queue ends every thread once it is empty; their connections close before
        // the store releases the file's lock.
        drop(self.queue.take());
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// A read thread's body: jobs until the queue is closed.
fn serve(conn: Connection, jobs: &Mutex<Receiver<ReadJob>>, clock: &Clock) {
    let mut reads = match Reads::prepare(&conn) {
        Ok(r) => r,
        Err(e) => {
            // The other threads serve on; with none left, reads fail at once.
            tracing::error!(error = %e, "an SQLite read thread cannot prepare its statements");
            return;
        }
    };
    loop {
        // The lock is held while waiting, so one idle thread waits on the queue and the
        // others on the lock: a job wakes exactly one of them.
        let job = jobs.lock().unwrap_or_else(|p| p.into_inner()).recv();
        let Ok(job) = job else { return };
        job(&mut reads, clock.now_ms());
    }
}
