//! The checkpoint thread: copies the write-ahead log back into the database file, beside the
//! writer instead of inside its transactions.
//!
//! SQLite's default runs a checkpoint in the connection whose commit crossed 1000 log pages:
//! here that is the writer, and a checkpoint ends with a sync of the file, which on a busy disk
//! takes hundreds of milliseconds, during which no batch commits and every queued claim waits
//! (measured: a stall of the whole queue past a 500 ms `store.timeout`, seconds into a load
//! run). So the writer never checkpoints (`wal_autocheckpoint = 0`), and this thread runs a
//! `PASSIVE` checkpoint every [`EVERY`] on its own connection: passive never takes the write
//! lock and never waits for readers, so the writer commits meanwhile. Once a checkpoint has
//! copied the whole log and no reader is in it, the writer's next transaction starts the log
//! from the beginning again (and `journal_size_limit` cuts the file back), so the log stays a
//! few seconds of writes long.

use std::path::Path;
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::Duration;

use rusqlite::Connection;

/// How often the log is copied back.
const EVERY: Duration = Duration::from_secs(1);

/// Checkpoints in a row that could not copy the whole log before that is logged: readers that
/// never let go of it, which keeps the log from starting over and lets it grow.
const STARVED: u32 = 60;

/// The checkpoint thread; dropping it stops the thread and waits for it.
pub(super) struct Checkpointer {
    stop: Option<Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Checkpointer {
    pub(super) fn start(conn: Connection, path: &Path) -> std::io::Result<Checkpointer> {
        let (stop, stopped) = mpsc::channel::<()>();
        let path = path.display().to_string();
        let thread = std::thread::Builder::new()
            .name("idemproxy-sqlite-checkpoint".into())
            .spawn(move || {
                let mut behind = 0u32;
                loop {
                    match stopped.recv_timeout(EVERY) {
                        Err(RecvTimeoutError::Timeout) => {}
                        Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
                    }
                    match checkpoint(&conn) {
                        Ok((log, copied)) if copied < log => {
                            behind += 1;
                            if behind == STARVED {
                                tracing::warn!(file = %path, log_pages = log, copied_pages = copied, "sqlite: {STARVED} checkpoints in a row could not copy the whole log (a reader holds it); the log grows until one can");
                            }
                        }
                        Ok(_) => behind = 0,
                        Err(e) => {
                            tracing::warn!(file = %path, error = %e, "sqlite: checkpoint failed; trying again");
                        }
                    }
                }
            })?;
        Ok(Checkpointer {
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

/// One passive checkpoint: the pages in the log, and how many of them are in the file now.
fn checkpoint(conn: &Connection) -> rusqlite::Result<(i64, i64)> {
    conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |row| {
        Ok((row.get(1)?, row.get(2)?))
    })
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
