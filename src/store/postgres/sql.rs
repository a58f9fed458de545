//! The statements, written once at start with the schema in them (a plain identifier, checked
//! at load, so it needs no quoting), prepared once per connection (`prepare_cached`).
//!
//! Every statement runs on its own, autocommitted: one statement is one transaction, and all of
//! it reads one snapshot, taken when it starts, with one `now()` (the server's clock, the only
//! clock leases run on: instances' clocks may disagree, the server's is one). What each
//! statement does in every interleaving is written next to it; the words used:
//! - *live*: `expires_at > now()`; *lapsed*: not live (an expired row counts as absent, whether
//!   or not the sweep has deleted it yet);
//! - *in the snapshot*: committed before the statement started. A row written by a transaction
//!   that commits later is invisible to the statement's reads, but its writes still wait for
//!   that transaction (a unique-index check, or an `UPDATE`/`DELETE` reaching a locked row)
//!   and then look at the row's newest version (READ COMMITTED's re-check of the `WHERE`).
//!
//! Parameters: `$1` the key (`StoreKey::text`), then the token, the value and a duration in
//! milliseconds, as each statement says. Durations are added as `$n::bigint * interval '1
//! millisecond'`: exact, and bounded by [`super::MAX_MILLIS`] so that the sum stays a valid
//! timestamp.

use std::ops::Range;

use crate::record::layout::{self, sql};

/// The statements of one schema.
pub(super) struct Statements {
    /// `$1` key, `$2` token, `$3` the in-progress record, `$4` lease: rows `(claimed, value)`.
    pub(super) claim: String,
    /// `$1` key, `$2` token, `$3` lease: rows changed (0 or 1).
    pub(super) renew: String,
    /// `$1` key, `$2` token, `$3` the finished record, `$4` ttl: rows changed (0 or 1).
    pub(super) save: String,
    /// `$1` key, `$2` the finished record: a row if the key holds exactly it.
    pub(super) saved: String,
    /// `$1` key, `$2` token: one row, whether the key is free of that claim.
    pub(super) release: String,
    /// `$1` key: the live value.
    pub(super) get: String,
    /// `$1` key: the live value and its remaining milliseconds.
    pub(super) inspect: String,
    /// `$1` key: rows `(deleted, value)`.
    pub(super) forget: String,
    /// `$1` batch size: rows deleted.
    pub(super) sweep: String,
    /// `SELECT 1`.
    pub(super) ping: &'static str,
    /// The statements of a claim that can be resolved.
    pub(super) resolvable: ResolvableStatements,
}

/// The statements of a claim that can be resolved (`on_unknown_outcome: resolve`). Its times
/// (lease, claimed, sent, phase and next lookup: offsets in [`crate::record::resolvable`], plus
/// one, as SQL counts from 1) live inside its value as a claim or a takeover wrote them, and in
/// the row's `times` column (the same 33 bytes) as a renewal rewrote them, so that a renewal
/// never writes the value (and its copied lookup) again; [`RecordSql::effective_value`] is the record as
/// it stands. The times are milliseconds of the server's `now()`, and the row's `expires_at` is
/// its lifetime:
/// a lapsed lease no longer frees the row (the sweep and every `expires_at` test leave it
/// alone); it lets a claim take the resolution over, in one statement. The lease is compared as
/// the 8 big-endian bytes it is stored as (`int8send`), which order as the numbers do.
pub(super) struct ResolvableStatements {
    /// `$1` key, `$2` token, `$3` the new claim (unstamped), `$4` lease, `$5` send margin, `$6`
    /// lifetime after the send: rows `(kind, value, now_ms)`, kind 1 claimed, 2 taken over,
    /// 3 existing.
    pub(super) claim: String,
    /// `$1` key, `$2` token, `$3` lease: `now_ms` if renewed.
    pub(super) renew: String,
    /// `$1` key, `$2` token, `$3` lease, `$4` next lookup in: `now_ms` if done.
    pub(super) resolving: String,
    /// `$1` key, `$2` token, `$3` the finished record, `$4` ttl: rows changed (0 or 1).
    pub(super) save: String,
    /// `$1` key, `$2` token: one row, whether the key is free of that claim.
    pub(super) release: String,
    /// The server's clock in milliseconds.
    pub(super) now: String,
}

impl Statements {
    pub(super) fn new(schema: &str) -> Statements {
        let t = format!("{schema}.records");
        let bytes = RecordSql::new();
        let value = &bytes.effective_value;
        let finished = &bytes.is_finished;
        Statements {
            // The claim: one statement, one round trip, on both the new-key and the replay path.
            //
            // Not `INSERT … ON CONFLICT DO UPDATE … WHERE expires_at <= now()`: that locks the
            // conflicting row even when its WHERE is false, so every replay and every conflict
            // would take a row lock, assign a transaction id and wait for a WAL flush. Here a
            // live key is only read: the replay path writes nothing.
            //
            // `cur` reads the key's row once, by its primary key; the two writers run only
            // when that read calls for them, so a repeat costs about one primary-key read
            // (the writers' one-time filters skip them: no conflict check, no index scan) and
            // a new key one read and the insert. `ins` inserts when the snapshot has no row;
            // `upd` takes over a lapsed row; the last branch returns a live row. Cases:
            // - absent: `ins` inserts; `upd` is skipped → (true). Ours.
            // - live: both writers are skipped; the read's value → (false, value), the version
            //   in the snapshot even while its holder's renew or save commits, or a
            //   release or `forget` deletes it (as if this claim had come just before that
            //   write).
            // - lapsed: `ins` is skipped; `upd` finds the row by its key, locks it and
            //   re-checks `expires_at <= now()` on its newest version (READ COMMITTED):
            //   still lapsed → rewritten with our token, value and lease → (true). Ours.
            //   Taken over or deleted meanwhile → no update, and no row at all: the caller
            //   runs the claim again (a new snapshot, which sees what happened).
            // - absent in the snapshot, with another session's insert of the key in flight
            //   (uncommitted, or committed after the snapshot): `ins`'s conflict check waits
            //   for it. It commits: `ins` does nothing → no row at all: run again. It rolls
            //   back: `ins` inserts → ours.
            // Two claims can never both win: both write the one row of the key (an insert
            // under its unique index, or an update that re-checks under the row lock).
            //
            // `(expires_at <= now()) IS TRUE` is the lapse test written so that no index can
            // answer it (the column is NOT NULL: the same test): the row is then found by its
            // primary key. With the bare comparison a generic plan may walk the `expires_at`
            // index from its start instead, over every lapsed entry and every dead one a
            // save left behind (each moves the row's `expires_at`) until a vacuum: a
            // scan that grows with the traffic of the last minutes.
            claim: format!(
                "WITH cur AS (
                    SELECT {value} AS value, r.expires_at > now() AS live FROM {t} AS r
                    WHERE r.key = $1
                ), ins AS (
                    INSERT INTO {t} (key, token, value, expires_at)
                    SELECT $1, $2, $3, now() + $4::bigint * interval '1 millisecond'
                    WHERE NOT EXISTS (SELECT 1 FROM cur)
                    ON CONFLICT (key) DO NOTHING
                    RETURNING 1
                ), upd AS (
                    UPDATE {t}
                    SET token = $2, value = $3, times = NULL,
                        expires_at = now() + $4::bigint * interval '1 millisecond'
                    WHERE key = $1 AND (expires_at <= now()) IS TRUE
                      AND EXISTS (SELECT 1 FROM cur WHERE NOT live)
                    RETURNING 1
                )
                SELECT true, NULL::bytea FROM ins
                UNION ALL SELECT true, NULL::bytea FROM upd
                UNION ALL SELECT false, value FROM cur WHERE live"
            ),
            // Fenced: only the holder's token, only while its lease is live. A lapsed lease can
            // never be renewed, even if nobody has taken the key yet.
            renew: format!(
                "UPDATE {t} SET expires_at = now() + $3::bigint * interval '1 millisecond'
                 WHERE key = $1 AND token = $2 AND expires_at > now()"
            ),
            // Fenced like renew; the finished row has no token, so no later claim's token can
            // match it and nothing but forget or expiry removes it. If it finds nothing, the
            // caller asks `saved` in a statement of its own: a save sent again while
            // the first was still committing waits here for the row's lock, finds its own
            // finished row (token gone) and changes nothing; only a statement started after
            // that wait has a snapshot that sees the first save's row.
            save: format!(
                "UPDATE {t}
                 SET token = NULL, value = $3, times = NULL,
                     expires_at = now() + $4::bigint * interval '1 millisecond'
                 WHERE key = $1 AND token = $2 AND expires_at > now()"
            ),
            saved: format!(
                "SELECT 1 FROM {t}
                 WHERE key = $1 AND token IS NULL AND value = $2 AND expires_at > now()"
            ),
            // Deletes the claim if it is ours and live. True when the key is then free of our
            // claim:
            // - ours, live: deleted → true;
            // - absent (released before, swept) or lapsed (nobody took it) → true;
            // - another token's claim, or a finished record (no token), live → false: left
            //   alone, the lease was lost;
            // - ours in the snapshot but deleted meanwhile (a release sent again while the
            //   first was committing, or the sweep after the lease lapsed on its clock):
            //   `del` finds it gone; our own token does not count as "something else" → true.
            release: format!(
                "WITH del AS (
                    DELETE FROM {t} WHERE key = $1 AND token = $2 AND expires_at > now()
                    RETURNING 1
                )
                SELECT EXISTS (SELECT 1 FROM del)
                    OR NOT EXISTS (
                        SELECT 1 FROM {t}
                        WHERE key = $1 AND expires_at > now() AND token IS DISTINCT FROM $2
                    )"
            ),
            get: format!("SELECT {value} FROM {t} AS r WHERE r.key = $1 AND r.expires_at > now()"),
            // The remaining time on the server's clock.
            inspect: format!(
                "SELECT {value}, (extract(epoch FROM r.expires_at - now()) * 1000)::bigint
                 FROM {t} AS r WHERE r.key = $1 AND r.expires_at > now()"
            ),
            // Deletes only a finished record: no token, and the bytes of one (a claim in
            // flight may have a live holder; anything else is not ours to judge). Otherwise
            // returns what is there, for the caller to say why it was left alone.
            forget: format!(
                "WITH del AS (
                    DELETE FROM {t}
                    WHERE key = $1 AND token IS NULL AND expires_at > now()
                      AND {finished}
                    RETURNING 1
                )
                SELECT true, NULL::bytea FROM del
                UNION ALL SELECT false, {value} FROM {t} AS r WHERE r.key = $1 AND r.expires_at > now()"
            ),
            // One batch of the sweep, oldest first. SKIP LOCKED: a row a claim, renew or
            // save holds locked is left for the next sweep, so the sweep never waits on
            // them (and several instances sweeping at once split the rows). FOR UPDATE re-checks
            // the inner WHERE on a row's newest version; the outer re-check says it again, so a
            // row taken over meanwhile (live again) is never deleted. A claim that meets a row
            // this batch has locked waits for the batch's commit, then finds it gone and inserts:
            // batches stay small so that wait stays short.
            sweep: format!(
                "DELETE FROM {t}
                 WHERE key IN (
                     SELECT key FROM {t} WHERE expires_at < now()
                     ORDER BY expires_at LIMIT $1
                     FOR UPDATE SKIP LOCKED
                 )
                 AND expires_at < now()"
            ),
            ping: "SELECT 1",
            resolvable: ResolvableStatements::new(schema, &t, &bytes),
        }
    }

    /// Every statement the store runs on a request's behalf: what a fresh connection prepares
    /// before it serves one (`warm.rs`).
    pub(super) fn all(&self) -> [&str; 16] {
        let r = &self.resolvable;
        [
            &r.claim,
            &r.renew,
            &r.resolving,
            &r.save,
            &r.release,
            &r.now,
            &self.claim,
            &self.renew,
            &self.save,
            &self.saved,
            &self.release,
            &self.get,
            &self.inspect,
            &self.forget,
            &self.sweep,
            self.ping,
        ]
    }
}

/// The server's clock in milliseconds since the epoch: the clock of a resolvable record's times.
const NOW_MS: &str = "floor(extract(epoch FROM now()) * 1000)::bigint";
/// The SQL that reads and writes a resolvable record's bytes (in `r.value`, and its renewed
/// times in `r.times`), every position from [`layout`] (SQL counts from 1).
pub(super) struct RecordSql {
    /// `r.value` is a resolvable claim (format version 3, or 2 written by an earlier proxy).
    is_resolvable: String,
    /// `value` is a finished record, of either version.
    pub(super) is_finished: String,
    /// The record as the proxy decodes it: the value, with newer times patched in.
    pub(super) effective_value: String,
    /// The claim's times as they stand, from `times` or from the value.
    times: String,
}

/// `range` of the record, counted within its times (where `r.times` holds them).
const fn within_times(range: Range<usize>) -> Range<usize> {
    range.start - layout::TIMES.start..range.end - layout::TIMES.start
}

/// `overlay(value PLACING what …)` over `range` of the record.
fn overlay(value: &str, what: &str, range: &Range<usize>) -> String {
    format!(
        "overlay({value} PLACING {what} FROM {} FOR {})",
        sql::at(range.start),
        range.len()
    )
}

/// A one-byte `bytea` literal.
fn byte(b: u8) -> String {
    sql::literal(&[b])
}

impl RecordSql {
    pub(super) fn new() -> RecordSql {
        let is_resolvable = format!(
            "octet_length(r.value) >= {} AND {} IN ({}, {})",
            layout::FIXED,
            sql::slice("r.value", &(0..layout::PREFIX_LEN)),
            sql::literal(&layout::RESOLVABLE_PREFIX),
            sql::literal(&layout::RESOLVABLE_PREFIX_2),
        );
        // `r.times` holds the claim's times, newer than those inside `r.value`: a renewal
        // wrote them there. A `times` left behind by an earlier incarnation of the row (by a
        // proxy of schema version 1, which knows no `times`) holds a lease that had lapsed
        // before the row was claimed again, so it never wins over the value's own.
        let times_win = format!(
            "r.times IS NOT NULL AND {is_resolvable} AND {} > {}",
            sql::slice("r.times", &within_times(layout::LEASE_UNTIL)),
            sql::slice("r.value", &layout::LEASE_UNTIL),
        );
        let effective_value = format!(
            "CASE WHEN {times_win} THEN {} ELSE r.value END",
            overlay("r.value", "r.times", &layout::TIMES)
        );
        let times = format!(
            "(CASE WHEN {times_win} THEN r.times ELSE {} END)",
            sql::slice("r.value", &layout::TIMES)
        );
        let is_finished = format!(
            "{} IN ({}, {})",
            sql::slice("value", &(0..layout::PREFIX_LEN)),
            sql::literal(&layout::FINISHED_PREFIX),
            sql::literal(&layout::FINISHED_PREFIX_2)
        );
        RecordSql {
            is_resolvable,
            is_finished,
            effective_value,
            times,
        }
    }

    /// The claim's lease as it stands.
    fn lease(&self) -> String {
        sql::slice(&self.times, &within_times(layout::LEASE_UNTIL))
    }

    /// The claim's times with a new lease (`lease_until`, a number) and, with `next`, resolving
    /// with its next lookup then: what a renewal writes.
    fn renewed(&self, lease_until: &str, next: Option<&str>) -> String {
        let kept = match next {
            None => layout::CLAIMED_AT.start..layout::TIMES.end,
            Some(_) => layout::CLAIMED_AT.start..layout::SENT_AT.end,
        };
        let mut new = format!(
            "int8send({lease_until}) || {}",
            sql::slice(&self.times, &within_times(kept))
        );
        if let Some(next) = next {
            new.push_str(&format!(
                " || {} || int8send({next})",
                byte(layout::PHASE_RESOLVING)
            ));
        }
        new
    }
}

impl ResolvableStatements {
    fn new(schema: &str, t: &str, bytes: &RecordSql) -> ResolvableStatements {
        let is_resolvable = &bytes.is_resolvable;
        // Held: our token, the row live, a resolvable claim, its lease live.
        let held = format!(
            "r.key = $1 AND r.token = $2 AND r.expires_at > now() AND {is_resolvable}
             AND {} > int8send(c.ms)",
            bytes.lease()
        );
        // Whether every instance writes schema version 2: renewals then leave the value alone.
        // Until then (a rolling upgrade from version 1, whose instances read the times only
        // in the value) they write the new times into both.
        let upgraded = format!(
            "EXISTS (SELECT 1 FROM {schema}.schema_version WHERE version >= {})",
            super::schema::VERSION
        );
        // What a renewal writes: `new` (the claim's new times) into `times`, and into the
        // value too until the schema is upgraded. The value's bytes are then left as they are:
        // a large lookup stored out of line is not written again.
        let renewed = |new: String| {
            format!(
                "times = {new},
                 value = CASE WHEN {upgraded} THEN r.value ELSE {} END",
                overlay("r.value", &new, &layout::TIMES)
            )
        };
        let renew = renewed(bytes.renewed("c.ms + $3::bigint", None));
        let resolving = renewed(bytes.renewed("c.ms + $3::bigint", Some("c.ms + $4::bigint")));
        ResolvableStatements {
            claim: claim(t, bytes),
            // The lease only: the row's lifetime grows if the lease outlasts it, never shrinks.
            renew: format!(
                "WITH c AS (SELECT {NOW_MS} AS ms)
                UPDATE {t} AS r
                SET {renew},
                    expires_at = greatest(r.expires_at, now() + $3::bigint * interval '1 millisecond')
                FROM c
                WHERE {held}
                RETURNING c.ms"
            ),
            resolving: format!(
                "WITH c AS (SELECT {NOW_MS} AS ms)
                UPDATE {t} AS r
                SET {resolving},
                    expires_at = greatest(r.expires_at, now() + $3::bigint * interval '1 millisecond')
                FROM c
                WHERE {held}
                RETURNING c.ms"
            ),
            save: format!(
                "WITH c AS (SELECT {NOW_MS} AS ms)
                UPDATE {t} AS r
                SET token = NULL, value = $3, times = NULL,
                    expires_at = now() + $4::bigint * interval '1 millisecond'
                FROM c
                WHERE {held}"
            ),
            // True when the key is then free of our claim: deleted now, or nothing live there.
            // Fenced on the token alone (see `Store::release`): a takeover replaces the token.
            release: format!(
                "WITH del AS (
                    DELETE FROM {t} AS r
                    WHERE r.key = $1 AND r.token = $2 AND r.expires_at > now() AND {is_resolvable}
                    RETURNING 1
                )
                SELECT EXISTS (SELECT 1 FROM del)
                    OR NOT EXISTS (SELECT 1 FROM {t} WHERE key = $1 AND expires_at > now())"
            ),
            now: format!("SELECT {NOW_MS}"),
        }
    }
}

/// The resolvable claim statement.
/// Like the plain claim before its read came first (see `Statements::claim`, the
/// lapse test written as there so that the row is found by its key), with a third
/// writer: `took` takes over a live resolvable claim whose lease has lapsed.
/// `upd` (lifetime over) and `took` (lifetime not over) can never both match one
/// version of the row, and two takeovers at once cannot both win: the second
/// waits for the first's row lock, re-checks its WHERE on the new version — whose
/// lease is live — and changes nothing; its read then shows the old version, which
/// the caller recognises (a lapsed lease, no claim) and runs the statement again.
/// A claim and a takeover write the whole value (the token inside it changes) and
/// clear `times`.
fn claim(t: &str, bytes: &RecordSql) -> String {
    let RecordSql {
        is_resolvable,
        effective_value,
        times,
        ..
    } = bytes;
    let stamp = format!(
        "int8send(c.ms + $4::bigint) || int8send(c.ms) || int8send(c.ms + $5::bigint) || {} || int8send(0::bigint)",
        byte(layout::PHASE_IN_FLIGHT)
    );
    let stamped = overlay("$3::bytea", &stamp, &layout::TIMES);
    // The takeover: the times as they stand, then the new token and lease, then resolving with
    // its next lookup now.
    let took = overlay(
        &overlay(
            &overlay("r.value", times, &layout::TIMES),
            "$2::bytea || int8send(c.ms + $4::bigint)",
            &(layout::TOKEN.start..layout::LEASE_UNTIL.end),
        ),
        &format!("{} || int8send(c.ms)", byte(layout::PHASE_RESOLVING)),
        &(layout::PHASE..layout::NEXT_LOOKUP_AT.end),
    );
    let lease = bytes.lease();
    format!(
        "WITH c AS (SELECT {NOW_MS} AS ms),
        stamped AS (
            SELECT {stamped} AS value,
                now() + ($5::bigint + $6::bigint) * interval '1 millisecond' AS expires_at
            FROM c
        ), ins AS (
            INSERT INTO {t} (key, token, value, expires_at)
            SELECT $1, $2, s.value, s.expires_at FROM stamped s
            ON CONFLICT (key) DO NOTHING
            RETURNING value
        ), upd AS (
            UPDATE {t} AS r
            SET token = $2, value = s.value, times = NULL, expires_at = s.expires_at
            FROM stamped s
            WHERE r.key = $1 AND (r.expires_at <= now()) IS TRUE
            RETURNING r.value
        ), took AS (
            UPDATE {t} AS r
            SET token = $2, times = NULL, value = {took}
            FROM c
            WHERE r.key = $1 AND r.expires_at > now() AND {is_resolvable}
              AND {lease} <= int8send(c.ms)
            RETURNING r.value
        )
        SELECT 1, value, (SELECT ms FROM c) FROM ins
        UNION ALL SELECT 1, value, (SELECT ms FROM c) FROM upd
        UNION ALL SELECT 2, value, (SELECT ms FROM c) FROM took
        UNION ALL SELECT 3, {effective_value}, (SELECT ms FROM c) FROM {t} AS r
            WHERE r.key = $1 AND r.expires_at > now()"
    )
}
