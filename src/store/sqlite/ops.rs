//! The writes, as SQL on the writer's connection, each run inside the writer's open
//! transaction (see `writer.rs`).
//!
//! Atomicity comes from the writer holding SQLite's one write lock (`BEGIN IMMEDIATE`) for the
//! whole batch: between a statement and the next one of the same operation, no other
//! connection can change a row. Still, the claim takes the key in *one* statement, an
//! `INSERT … ON CONFLICT … DO UPDATE … WHERE expired`, so that "free or expired, then ours"
//! never rests on a read followed by a write.
//!
//! Fencing: renew, complete and release change a row only `WHERE key = ? AND token = ? AND
//! expires_at > now`. A lapsed lease therefore changes nothing, even when nobody has taken the
//! key since; and a finished row (token NULL) matches no token at all.
//!
//! Blobs are bound by reference (SQLite copies each once, into the row it writes) and read
//! into one owned buffer; comparisons read the stored blob in place.

use bytes::Bytes;
use rusqlite::types::ValueRef;
use rusqlite::{Connection, OptionalExtension, Statement, params};

use crate::record::Token;
use crate::store::Forgotten;

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
const COMPLETE: &str = "
    UPDATE records SET token = NULL, value = ?3, expires_at = ?4
    WHERE key = ?1 AND token = ?2 AND expires_at > ?5";
const FINISHED_VALUE: &str =
    "SELECT value FROM records WHERE key = ?1 AND token IS NULL AND expires_at > ?2";
const RELEASE: &str = "DELETE FROM records WHERE key = ?1 AND token = ?2 AND expires_at > ?3";
const LIVE: &str = "SELECT 1 FROM records WHERE key = ?1 AND expires_at > ?2";
const DELETE: &str = "DELETE FROM records WHERE key = ?1";
/// Expired rows, oldest first through the `expires_at` index, a bounded number at a time.
const SWEEP: &str = "
    DELETE FROM records WHERE rowid IN
        (SELECT rowid FROM records WHERE expires_at <= ?1 ORDER BY expires_at LIMIT ?2)";

/// The write connection's statements, prepared once for the life of the writer thread.
pub(super) struct Ops<'c> {
    #[cfg(test)]
    conn: &'c Connection,
    claim: Statement<'c>,
    live_value: Statement<'c>,
    renew: Statement<'c>,
    complete: Statement<'c>,
    finished_value: Statement<'c>,
    release: Statement<'c>,
    live: Statement<'c>,
    delete: Statement<'c>,
    sweep: Statement<'c>,
}

impl<'c> Ops<'c> {
    pub(super) fn prepare(conn: &'c Connection) -> rusqlite::Result<Ops<'c>> {
        Ok(Ops {
            #[cfg(test)]
            conn,
            claim: conn.prepare(CLAIM)?,
            live_value: conn.prepare(LIVE_VALUE)?,
            renew: conn.prepare(RENEW)?,
            complete: conn.prepare(COMPLETE)?,
            finished_value: conn.prepare(FINISHED_VALUE)?,
            release: conn.prepare(RELEASE)?,
            live: conn.prepare(LIVE)?,
            delete: conn.prepare(DELETE)?,
            sweep: conn.prepare(SWEEP)?,
        })
    }

    /// The connection itself (tests run statements of their own inside a batch).
    #[cfg(test)]
    pub(super) fn conn(&self) -> &'c Connection {
        self.conn
    }

    /// Takes `key` for `token` until `expires_at` if it is absent or expired (`None`);
    /// otherwise returns the live row's value.
    pub(super) fn claim(
        &mut self,
        key: &str,
        token: &Token,
        value: &[u8],
        expires_at: i64,
        now: i64,
    ) -> rusqlite::Result<Option<Bytes>> {
        let wrote = self
            .claim
            .query_row(params![key, &token[..], value, expires_at, now], |_| Ok(()))
            .optional()?;
        if wrote.is_some() {
            return Ok(None);
        }
        // Nothing written: a live row holds the key. This read is in the same transaction, on
        // the connection that holds the write lock, so nothing can have changed the row since
        // the insert saw it: together, one atomic step.
        let value = self
            .live_value
            .query_row(params![key, now], |r| r.get::<_, Vec<u8>>(0))?;
        Ok(Some(Bytes::from(value)))
    }

    /// Extends the lease held by `token` to `expires_at`; `false`: it is not held any more.
    pub(super) fn renew(
        &mut self,
        key: &str,
        token: &Token,
        expires_at: i64,
        now: i64,
    ) -> rusqlite::Result<bool> {
        let changed = self
            .renew
            .execute(params![key, &token[..], expires_at, now])?;
        Ok(changed == 1)
    }

    /// Replaces the claim held by `token` by the finished record `done` (token NULL) until
    /// `expires_at`; `true` too when the key already holds exactly `done` (a completion sent
    /// again after its answer was lost).
    pub(super) fn complete(
        &mut self,
        key: &str,
        token: &Token,
        done: &[u8],
        expires_at: i64,
        now: i64,
    ) -> rusqlite::Result<bool> {
        let changed = self
            .complete
            .execute(params![key, &token[..], done, expires_at, now])?;
        if changed == 1 {
            return Ok(true);
        }
        let landed = self
            .finished_value
            .query_row(params![key, now], |r| {
                Ok(matches!(r.get_ref(0)?, ValueRef::Blob(b) if b == done))
            })
            .optional()?;
        Ok(landed == Some(true))
    }

    /// Deletes the claim held by `token`. `true` once the key is free of it (deleted now, gone
    /// already, or lapsed with nobody taking it); `false` when something else lives there.
    pub(super) fn release(&mut self, key: &str, token: &Token, now: i64) -> rusqlite::Result<bool> {
        if self.release.execute(params![key, &token[..], now])? == 1 {
            return Ok(true);
        }
        // A lapsed row of ours is left for the sweep: it counts as absent already.
        let other = self.live.exists(params![key, now])?;
        Ok(!other)
    }

    /// Deletes the key if, and only if, it holds a live finished record.
    pub(super) fn forget(&mut self, key: &str, now: i64) -> rusqlite::Result<Forgotten> {
        let found = self
            .live_value
            .query_row(params![key, now], |r| {
                Ok(match r.get_ref(0)? {
                    ValueRef::Blob(b) => Forgotten::of(b),
                    _ => Forgotten::NotARecord,
                })
            })
            .optional()?;
        match found {
            None => Ok(Forgotten::Absent),
            Some(Forgotten::Forgotten) => {
                self.delete.execute(params![key])?;
                Ok(Forgotten::Forgotten)
            }
            Some(other) => Ok(other),
        }
    }

    /// Deletes at most `limit` rows expired at `now`; returns how many.
    pub(super) fn sweep(&mut self, now: i64, limit: usize) -> rusqlite::Result<u64> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let deleted = self.sweep.execute(params![now, limit])?;
        Ok(deleted as u64)
    }
}
