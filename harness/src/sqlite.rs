//! An SQLite file of a test's own ([`SqliteFile`]): a path in a temp dir (the proxy creates the
//! file), read from outside the proxy as an operator's `sqlite3` would, and write-locked on
//! command so that the proxy's writes fail.
//!
//! The agreed layout: `records(key TEXT PRIMARY KEY, token BLOB, value BLOB NOT NULL,
//! expires_at INTEGER NOT NULL)`, `expires_at` in Unix milliseconds of the host's wall clock.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rusqlite::{Connection, OpenFlags};

use super::StoredKey;

/// How long a connection of the test's waits for a lock the proxy holds for a moment (a write
/// transaction of its writer) before it gives up.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// A database path in a temp dir, removed with it.
pub struct SqliteFile {
    dir: tempfile::TempDir,
    path: PathBuf,
    /// A second connection inside `BEGIN EXCLUSIVE` while the test keeps the database's write
    /// lock ([`SqliteFile::lock_writes`]). A `Mutex` because a connection is not `Sync`, and the
    /// test's `Env` is shared with tasks by reference.
    write_lock: Mutex<Option<Connection>>,
}

impl Default for SqliteFile {
    /// A fresh path ([`SqliteFile::new`]).
    fn default() -> SqliteFile {
        SqliteFile::new()
    }
}

impl SqliteFile {
    /// A path `records.db` in a fresh temp dir; nothing is created yet.
    pub fn new() -> SqliteFile {
        let dir = tempfile::Builder::new()
            .prefix("idemproxy-sqlite-")
            .tempdir()
            .expect("a temp dir for the SQLite file");
        let path = dir.path().join("records.db");
        SqliteFile {
            dir,
            path,
            write_lock: Mutex::new(None),
        }
    }

    /// The database file (`store.path`).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A read-only connection to the database the proxy made.
    pub fn read(&self) -> Connection {
        let conn = Connection::open_with_flags(
            &self.path,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .unwrap_or_else(|e| panic!("open {} read-only: {e}", self.path.display()));
        conn.busy_timeout(BUSY_TIMEOUT).expect("busy timeout");
        conn
    }

    /// Every record whose `expires_at` is in the future (an expired row may linger until the
    /// sweep, and counts as absent), with its remaining time to live, sorted by key.
    pub fn stored_keys(&self) -> Vec<StoredKey> {
        let conn = self.read();
        let now = unix_millis();
        let mut stmt = conn
            .prepare("SELECT key, expires_at FROM records WHERE expires_at > ?1 ORDER BY key")
            .expect("prepare the records query");
        let rows = stmt
            .query_map([now], |row| {
                Ok((row.get::<_, String>(0)?, row.get::<_, i64>(1)?))
            })
            .expect("query the records");
        rows.map(|row| {
            let (key, expires_at) = row.expect("a records row");
            let left = u64::try_from(expires_at - now).expect("expires in the future");
            StoredKey {
                key,
                ttl: Some(Duration::from_millis(left)),
            }
        })
        .collect()
    }

    /// Takes the database's write lock from a second connection (`BEGIN EXCLUSIVE`) and keeps
    /// it until [`SqliteFile::unlock_writes`] or the drop: every write of the proxy's then waits
    /// out its busy timeout and fails (SQLITE_BUSY), a store error in bounded time. Reads go on
    /// (WAL): what the store holds is still replayed.
    pub fn lock_writes(&self) {
        let conn = Connection::open(&self.path)
            .unwrap_or_else(|e| panic!("open {}: {e}", self.path.display()));
        conn.busy_timeout(BUSY_TIMEOUT).expect("busy timeout");
        conn.execute_batch("BEGIN EXCLUSIVE")
            .unwrap_or_else(|e| panic!("take the write lock of {}: {e}", self.path.display()));
        *self.write_lock.lock().expect("the write lock's slot") = Some(conn);
    }

    /// Gives the write lock back (a rollback: the locking connection wrote nothing).
    pub fn unlock_writes(&self) {
        let conn = self
            .write_lock
            .lock()
            .expect("the write lock's slot")
            .take();
        if let Some(conn) = conn {
            conn.execute_batch("ROLLBACK")
                .expect("give the write lock back");
        }
    }

    /// The temp dir the file lives in.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

/// Now on the host's wall clock, in Unix milliseconds (the clock the SQLite store's leases run
/// on).
fn unix_millis() -> i64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("the clock is past 1970");
    i64::try_from(since.as_millis()).expect("milliseconds fit in i64")
}
