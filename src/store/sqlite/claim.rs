//! The plain claim's steps on the writer's connection (statements in `ops.rs`): the claim in
//! one statement, renew, save and release fenced on the token and a live lease.

use bytes::Bytes;
use rusqlite::types::ValueRef;
use rusqlite::{OptionalExtension, params};

use super::ops::Ops;
use crate::record::Token;

impl Ops<'_> {
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
    /// `expires_at`; `true` too when the key already holds exactly `done` (a save sent
    /// again after its answer was lost).
    pub(super) fn save(
        &mut self,
        key: &str,
        token: &Token,
        done: &[u8],
        expires_at: i64,
        now: i64,
    ) -> rusqlite::Result<bool> {
        let changed = self
            .save
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

    /// The live value under `key`, if any.
    pub(super) fn live_value(&mut self, key: &str, now: i64) -> rusqlite::Result<Option<Vec<u8>>> {
        self.live_value
            .query_row(params![key, now], |r| r.get::<_, Vec<u8>>(0))
            .optional()
    }
}
