//! The writes, as SQL on the writer's connection, each run inside the writer's open
//! transaction (see `writer.rs`).
//!
//! Atomicity comes from the writer holding SQLite's one write lock (`BEGIN IMMEDIATE`) for the
//! whole batch: between a statement and the next one of the same operation, no other
//! connection can change a row. Still, the claim takes the key in *one* statement, an
//! `INSERT … ON CONFLICT … DO UPDATE … WHERE expired`, so that "free or expired, then ours"
//! never rests on a read followed by a write.
//!
//! Fencing: renew, save and release change a row only `WHERE key = ? AND token = ? AND
//! expires_at > now`. A lapsed lease therefore changes nothing, even when nobody has taken the
//! key since; and a finished row (token NULL) matches no token at all.
//!
//! A claim that can be resolved (`on_unknown_outcome: resolve`) keeps its lease inside its
//! value, and its row's `expires_at` is its lifetime, not its lease. Its operations read the
//! row, judge the token and the lease in Rust, and write it back, all inside the writer's
//! transaction: under SQLite's one write lock nothing can change the row in between, so each
//! is one atomic step, as a single statement would be.
//!
//! Blobs are bound by reference (SQLite copies each once, into the row it writes) and read
//! into one owned buffer; comparisons read the stored blob in place.

use rusqlite::{Connection, Statement};

/// The claim: insert, or take over a row whose lease or TTL has run out; anything live is left
/// as it is. `RETURNING` yields a row only when this statement wrote one, so "no row" means the
/// key is held by a live row.
const CLAIM: &str = "
    INSERT INTO records (key, token, value, expires_at) VALUES (?1, ?2, ?3, ?4)
    ON CONFLICT (key) DO UPDATE
        SET token = excluded.token, value = excluded.value, expires_at = excluded.expires_at
        WHERE records.expires_at <= ?5
    RETURNING 1";
const LIVE_VALUE: &str = "SELECT value FROM records WHERE key = ?1 AND expires_at > ?2";
const RENEW: &str = "
    UPDATE records SET expires_at = ?3
    WHERE key = ?1 AND token = ?2 AND expires_at > ?4";
const SAVE: &str = "
    UPDATE records SET token = NULL, value = ?3, expires_at = ?4
    WHERE key = ?1 AND token = ?2 AND expires_at > ?5";
const FINISHED_VALUE: &str =
    "SELECT value FROM records WHERE key = ?1 AND token IS NULL AND expires_at > ?2";
const RELEASE: &str = "DELETE FROM records WHERE key = ?1 AND token = ?2 AND expires_at > ?3";
const LIVE: &str = "SELECT 1 FROM records WHERE key = ?1 AND expires_at > ?2";
/// A resolvable claim rewritten by its holder or taken over (its lifetime only ever grows).
const REWRITE: &str = "
    UPDATE records SET token = ?2, value = ?3, expires_at = max(expires_at, ?4) WHERE key = ?1";
const DELETE: &str = "DELETE FROM records WHERE key = ?1";
/// Expired rows, oldest first through the `expires_at` index, a bounded number at a time.
const SWEEP: &str = "
    DELETE FROM records WHERE rowid IN
        (SELECT rowid FROM records WHERE expires_at <= ?1 ORDER BY expires_at LIMIT ?2)";

/// The write connection's statements, prepared once for the life of the writer thread.
pub(super) struct Ops<'c> {
    #[cfg(test)]
    pub(super) conn: &'c Connection,
    pub(super) claim: Statement<'c>,
    pub(super) live_value: Statement<'c>,
    pub(super) renew: Statement<'c>,
    pub(super) save: Statement<'c>,
    pub(super) finished_value: Statement<'c>,
    pub(super) release: Statement<'c>,
    pub(super) live: Statement<'c>,
    pub(super) delete: Statement<'c>,
    pub(super) sweep: Statement<'c>,
    pub(super) rewrite: Statement<'c>,
}

impl<'c> Ops<'c> {
    pub(super) fn prepare(conn: &'c Connection) -> rusqlite::Result<Ops<'c>> {
        Ok(Ops {
            #[cfg(test)]
            conn,
            claim: conn.prepare(CLAIM)?,
            live_value: conn.prepare(LIVE_VALUE)?,
            renew: conn.prepare(RENEW)?,
            save: conn.prepare(SAVE)?,
            finished_value: conn.prepare(FINISHED_VALUE)?,
            release: conn.prepare(RELEASE)?,
            live: conn.prepare(LIVE)?,
            delete: conn.prepare(DELETE)?,
            sweep: conn.prepare(SWEEP)?,
            rewrite: conn.prepare(REWRITE)?,
        })
    }

    /// The connection itself (tests run statements of their own inside a batch).
    #[cfg(test)]
    pub(super) fn conn(&self) -> &'c Connection {
        self.conn
    }
}

/// Milliseconds of a duration, saturating.
pub(super) fn ms(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Milliseconds of a duration as an SQLite integer, saturating.
pub(super) fn ms_i64(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// A time of a record as an SQLite integer, saturating.
pub(super) fn now_i64(t: u64) -> i64 {
    i64::try_from(t).unwrap_or(i64::MAX)
}
