//! The database file: its directory, the lock that keeps it to one process, the connections
//! and their settings, and the schema.
//!
//! One process per file: the writer thread is the only writer SQLite allows, leases are kept on
//! this host's clock, and waiters are woken in-process. A second proxy on the same file would
//! break all three, so [`lock`] takes an exclusive `flock` on the file before anything else and
//! holds it for the life of the store. The kernel drops it when the process dies, however it
//! dies, so a SIGKILLed proxy never leaves a stale lock behind.
//!
//! The lock is a `flock`, which SQLite does not use: SQLite locks byte ranges with `fcntl`, and
//! on a local Linux file system the two never conflict, so holding it costs SQLite nothing.
//! (WAL needs a local file system anyway: its index is shared memory.) An operator's `sqlite3`
//! shell can still open the file; it just cannot start a second proxy on it.

use std::fs::{File, OpenOptions, TryLockError};
use std::path::{Path, PathBuf};
use std::time::Duration;

use rusqlite::{Connection, OpenFlags, OptionalExtension};

use crate::config::SqliteSync;

/// The table layout this code writes and reads (`schema_version.version`).
pub(super) const SCHEMA_VERSION: i64 = 1;

/// How long a statement waits for a lock another connection holds (an operator's `sqlite3`
/// shell in a write transaction, a checkpoint) before failing with "database is locked". Far
/// below any sane `store.timeout`, so a locked file gives a store error, and the request its
/// answer, in bounded time; long enough to ride out a checkpoint.
pub(super) const BUSY_TIMEOUT: Duration = Duration::from_millis(250);

/// The layout agreed with the operations guide (an operator looks records up with `sqlite3`):
/// - `key`: `StoreKey::text()`;
/// - `token`: the claim's 16-byte fencing token while in flight, NULL once finished — renew,
///   save and release match on it;
/// - `value`: the encoded record, in flight or finished, as the other stores keep it;
/// - `expires_at`: Unix milliseconds on the host's wall clock; a row is live while
///   `expires_at > now`, and an expired row counts as absent everywhere (the sweep deletes it
///   later; correctness never waits for it).
const SCHEMA: &str = "
    CREATE TABLE IF NOT EXISTS records (
        key TEXT PRIMARY KEY,
        token BLOB,
        value BLOB NOT NULL,
        expires_at INTEGER NOT NULL
    );
    CREATE INDEX IF NOT EXISTS records_expires_at ON records (expires_at);
    CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);
";

/// Why the file could not be opened. Every message names the file.
#[derive(Debug, thiserror::Error)]
pub(super) enum OpenError {
    #[error(
        "the SQLite file {} is in use by another process (one proxy process per file)",
        path.display()
    )]
    InUse { path: PathBuf },
    #[error(
        "the SQLite file {} has schema version {found}, newer than this proxy's \
         ({SCHEMA_VERSION}): run the proxy version that wrote it, or use another file",
        path.display()
    )]
    Newer { path: PathBuf, found: i64 },
    #[error(
        "the SQLite file {} has schema version {found}, which no proxy version wrote (this \
         one writes {SCHEMA_VERSION})",
        path.display()
    )]
    Unknown { path: PathBuf, found: i64 },
    #[error(
        "the SQLite file {} stays in journal mode {mode}: the store needs WAL (is it on a \
         file system without shared memory, such as a network share?)",
        path.display()
    )]
    NotWal { path: PathBuf, mode: String },
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} {}: {source}", path.display())]
    Sqlite {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: rusqlite::Error,
    },
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> OpenError {
    move |source| OpenError::Io {
        what,
        path: path.to_owned(),
        source,
    }
}

fn sqlite(what: &'static str, path: &Path) -> impl FnOnce(rusqlite::Error) -> OpenError {
    move |source| OpenError::Sqlite {
        what,
        path: path.to_owned(),
        source,
    }
}

/// Creates the file (and its directory) if missing and locks it for this process. The lock
/// lasts as long as the returned `File` is open.
///
/// Closing a descriptor of a file drops every `fcntl` lock the process holds on it, SQLite's
/// included. So this descriptor is closed only after every SQLite connection of its store has
/// closed (the store drops it last); and one refused here (the file is locked) can only hold
/// SQLite locks if this very process already has a store on the file, which is what is
/// being refused.
pub(super) fn lock(path: &Path) -> Result<File, OpenError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io("cannot create the directory of", path))?;
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(io("cannot open the SQLite file", path))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(TryLockError::WouldBlock) => Err(OpenError::InUse {
            path: path.to_owned(),
        }),
        Err(TryLockError::Error(e)) => Err(io("cannot lock the SQLite file", path)(e)),
    }
}

/// Opens the write connection: WAL, the `sync` level, the busy timeout; creates the schema if
/// missing and checks its version.
pub(super) fn open_writer(path: &Path, sync: SqliteSync) -> Result<Connection, OpenError> {
    let conn = connect(path, OpenFlags::SQLITE_OPEN_CREATE)?;
    // WAL: readers run beside the writer, and a commit appends to the log instead of
    // rewriting pages. The mode is kept in the file, so every later connection gets it too.
    let mode: String = conn
        .pragma_update_and_check(None, "journal_mode", "WAL", |row| row.get(0))
        .map_err(sqlite("cannot switch to WAL mode", path))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(OpenError::NotWal {
            path: path.to_owned(),
            mode,
        });
    }
    // In WAL mode, NORMAL syncs the log at checkpoints only: a commit is in the OS's page
    // cache when it returns, so it survives a crash or SIGKILL of the proxy, not a power loss.
    // FULL syncs the log at every commit, so it survives a power loss too.
    let synchronous = match sync {
        SqliteSync::Normal => "NORMAL",
        SqliteSync::Full => "FULL",
    };
    conn.pragma_update(None, "synchronous", synchronous)
        .map_err(sqlite("cannot set synchronous on", path))?;
    // After a checkpoint, cut the log back to this size: one burst of multi-MiB records must
    // not leave a WAL of that size behind for ever.
    conn.pragma_update(None, "journal_size_limit", 64 * 1024 * 1024)
        .map_err(sqlite("cannot set journal_size_limit on", path))?;
    // No checkpoint on the writer: a checkpoint copies the log into the file and syncs it, and
    // that sync (hundreds of milliseconds on a busy disk) would stall every queued claim behind
    // it. The checkpoint thread does it beside the writer (`checkpoint.rs`).
    conn.pragma_update(None, "wal_autocheckpoint", 0)
        .map_err(sqlite("cannot turn off the writer's checkpoints on", path))?;
    schema(&conn, path)?;
    Ok(conn)
}

/// Opens the checkpoint connection, at the writer's `sync` level (a checkpoint syncs the log
/// before it copies it, and the file after).
pub(super) fn open_checkpointer(path: &Path, sync: SqliteSync) -> Result<Connection, OpenError> {
    let conn = connect(path, OpenFlags::empty())?;
    let synchronous = match sync {
        SqliteSync::Normal => "NORMAL",
        SqliteSync::Full => "FULL",
    };
    conn.pragma_update(None, "synchronous", synchronous)
        .map_err(sqlite("cannot set synchronous on", path))?;
    Ok(conn)
}

/// Opens a read connection (`query_only`: it can never write, whatever a bug asks of it).
pub(super) fn open_reader(path: &Path) -> Result<Connection, OpenError> {
    let conn = connect(path, OpenFlags::empty())?;
    conn.pragma_update(None, "query_only", true)
        .map_err(sqlite("cannot make a read connection query-only on", path))?;
    Ok(conn)
}

fn connect(path: &Path, extra: OpenFlags) -> Result<Connection, OpenError> {
    // Each connection lives on one thread, so SQLite's own mutexes are not needed.
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX | extra;
    let conn = Connection::open_with_flags(path, flags)
        .map_err(sqlite("cannot open the SQLite file", path))?;
    conn.busy_timeout(BUSY_TIMEOUT)
        .map_err(sqlite("cannot set the busy timeout on", path))?;
    Ok(conn)
}

/// Creates the tables and index if missing and checks the schema version, in one write
/// transaction: two processes can never both see an empty file and both write a version row.
fn schema(conn: &Connection, path: &Path) -> Result<(), OpenError> {
    let what = "cannot set up the schema of";
    conn.execute_batch("BEGIN IMMEDIATE")
        .map_err(sqlite(what, path))?;
    let checked = (|| {
        conn.execute_batch(SCHEMA).map_err(sqlite(what, path))?;
        let found: Option<i64> = conn
            .query_row("SELECT max(version) FROM schema_version", [], |r| r.get(0))
            .optional()
            .map_err(sqlite(what, path))?
            .flatten();
        match found {
            None => {
                conn.execute(
                    "INSERT INTO schema_version (version) VALUES (?1)",
                    [SCHEMA_VERSION],
                )
                .map_err(sqlite(what, path))?;
                Ok(())
            }
            Some(SCHEMA_VERSION) => Ok(()),
            Some(found) if found > SCHEMA_VERSION => Err(OpenError::Newer {
                path: path.to_owned(),
                found,
            }),
            Some(found) => Err(OpenError::Unknown {
                path: path.to_owned(),
                found,
            }),
        }
    })();
    match checked {
        Ok(()) => conn.execute_batch("COMMIT").map_err(sqlite(what, path)),
        Err(e) => {
            // Nothing of a refused file is changed (tables created for a newer layout's file
            // would be none of ours to add).
            let _ = conn.execute_batch("ROLLBACK");
            Err(e)
        }
    }
}
