//! A claim that can be resolved (`on_unknown_outcome: resolve`) on SQLite: its lease inside its
//! value, its row's `expires_at` its lifetime. Each operation reads the row, judges the token
//! and the lease in Rust, and writes it back, inside the writer's transaction: under SQLite's
//! one write lock nothing changes the row in between, so each is one atomic step.

use bytes::Bytes;
use rusqlite::types::ValueRef;
use rusqlite::{OptionalExtension, params};

use super::ops::{Ops, ms, ms_i64, now_i64};
use crate::record::{Token, layout, resolvable};
use crate::store::{ResolvableFound, ResolvableTimes};

impl Ops<'_> {
    /// The live value under `key` if it is the resolvable claim of `token` with its lease
    /// live at `now`.
    pub(super) fn held_resolvable(
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

    /// Saves the resolvable claim of `token` (token and live lease checked here, then the
    /// fenced save).
    pub(super) fn save_resolvable(
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
        self.save(key, token, done, expires_at, now)
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
}
