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
//! A claim that can be resolved (`on_unknown_outcome: resolve`) keeps its lease inside its
//! value, and its row's `expires_at` is its lifetime, not its lease. Its operations read the
//! row, judge the token and the lease in Rust, and write it back, all inside the writer's
//! transaction: under SQLite's one write lock nothing can change the row in between, so each
//! is one atomic step, as a single statement would be.
//!
//! Blobs are bound by reference (SQLite copies each once, into the row it writes) and read
//! into one owned buffer; comparisons read the stored blob in place.

use bytes::Bytes;
use rusqlite::types::ValueRef;
use rusqlite::{Connection, OptionalExtension, Statement, params};

use crate::record::{Token, layout, resolvable};
use crate::store::{Forgotten, ResolvableFound, ResolvableTimes};

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
    rewrite: Statement<'c>,
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
            rewrite: conn.prepare(REWRITE)?,
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

    /// The live value under `key`, if any.
    fn live_value(&mut self, key: &str, now: i64) -> rusqlite::Result<Option<Vec<u8>>> {
        self.live_value
            .query_row(params![key, now], |r| r.get::<_, Vec<u8>>(0))
            .optional()
    }

    /// The live value under `key` if it is the resolvable claim of `token` with its lease
    /// live at `now`.
    fn held_resolvable(
        &mut self,
        key: &str,
        token: &Token,
        now: i64,
    ) -> rusqlite::Result<Option<Vec<u8>>> {
        let now = u64::try_from(now).unwrap_or(0);
        Ok(self.live_value(key, now_i64(now))?.filter(|v| {
            resolvable::token(v) == Some(&token[..])
                && resolvable::lease_until(v).is_some_and(|l| l > now)
        }))
    }

    /// See [`crate::store::Store::claim_resolvable`]: `value` is the new claim, unstamped.
    pub(super) fn claim_resolvable(
        &mut self,
        key: &str,
        token: &Token,
        value: &[u8],
        times: ResolvableTimes,
        now: i64,
    ) -> rusqlite::Result<ResolvableFound> {
        let at = u64::try_from(now).unwrap_or(0);
        let mut stamped = value.to_vec();
        layout::stamp_claim(&mut stamped, at, ms(times.lease), ms(times.send_margin));
        let expires_at = now
            .saturating_add(ms_i64(times.send_margin))
            .saturating_add(ms_i64(times.lifetime));
        // Free or lived its lifetime: the upsert takes it (the same statement as a claim).
        let wrote = self
            .claim
            .query_row(params![key, &token[..], &stamped, expires_at, now], |_| {
                Ok(())
            })
            .optional()?;
        if wrote.is_some() {
            return Ok(ResolvableFound::Claimed {
                value: Bytes::from(stamped),
                now: at,
            });
        }
        let Some(live) = self.live_value(key, now)? else {
            return Err(rusqlite::Error::QueryReturnedNoRows);
        };
        let lapsed = resolvable::lease_until(&live).is_some_and(|l| l <= at);
        if !lapsed {
            return Ok(ResolvableFound::Existing {
                value: Bytes::from(live),
            });
        }
        let mut taken = live;
        layout::stamp_takeover(&mut taken, token, at, ms(times.lease));
        self.rewrite
            .execute(params![key, &token[..], &taken, i64::MIN])?;
        Ok(ResolvableFound::TakenOver {
            value: Bytes::from(taken),
            now: at,
        })
    }

    /// Renews the resolvable claim of `token` to `lease` from `now` (and with `next_lookup_in`,
    /// marks it resolving); `Some(now)` if it held the key.
    pub(super) fn renew_resolvable(
        &mut self,
        key: &str,
        token: &Token,
        lease: std::time::Duration,
        next_lookup_in: Option<std::time::Duration>,
        now: i64,
    ) -> rusqlite::Result<Option<u64>> {
        let Some(mut value) = self.held_resolvable(key, token, now)? else {
            return Ok(None);
        };
        let at = u64::try_from(now).unwrap_or(0);
        let lease_until = at.saturating_add(ms(lease));
        match next_lookup_in {
            None => layout::stamp_renew(&mut value, lease_until),
            Some(next) => {
                layout::stamp_resolving(&mut value, lease_until, at.saturating_add(ms(next)));
            }
        }
        self.rewrite
            .execute(params![key, &token[..], &value, now_i64(lease_until)])?;
        Ok(Some(at))
    }

    /// Completes the resolvable claim of `token` (token and live lease checked here, then the
    /// fenced completion).
    pub(super) fn complete_resolvable(
        &mut self,
        key: &str,
        token: &Token,
        done: &[u8],
        expires_at: i64,
        now: i64,
    ) -> rusqlite::Result<bool> {
        if self.held_resolvable(key, token, now)?.is_none() {
            let landed = self
                .finished_value
                .query_row(params![key, now], |r| {
                    Ok(matches!(r.get_ref(0)?, ValueRef::Blob(b) if b == done))
                })
                .optional()?;
            return Ok(landed == Some(true));
        }
        self.complete(key, token, done, expires_at, now)
    }

    /// Deletes the resolvable claim of `token` (its token alone: see `Store::release`). `true`
    /// once the key is free of it; `false` when something else lives there.
    pub(super) fn release_resolvable(
        &mut self,
        key: &str,
        token: &Token,
        now: i64,
    ) -> rusqlite::Result<bool> {
        let ours = self
            .live_value(key, now)?
            .is_some_and(|v| resolvable::token(&v) == Some(&token[..]));
        if ours {
            self.delete.execute(params![key])?;
            return Ok(true);
        }
        Ok(!self.live.exists(params![key, now])?)
    }

    /// Deletes at most `limit` rows expired at `now`; returns how many.
    pub(super) fn sweep(&mut self, now: i64, limit: usize) -> rusqlite::Result<u64> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let deleted = self.sweep.execute(params![now, limit])?;
        Ok(deleted as u64)
    }
}

/// Milliseconds of a duration, saturating.
fn ms(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Milliseconds of a duration as an SQLite integer, saturating.
fn ms_i64(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// A time of a record as an SQLite integer, saturating.
fn now_i64(t: u64) -> i64 {
    i64::try_from(t).unwrap_or(i64::MAX)
}
