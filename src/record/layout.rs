//! The record's bytes, in one place: every magic, version, tag, offset and length the encoding
//! uses, and the four transitions of a claim that can be resolved (claim, takeover, resolving,
//! renew) as functions on those bytes.
//!
//! The Rust encoder and decoder (`record/mod.rs`, `record/resolvable.rs`), the memory and
//! SQLite stores (which stamp in Rust, with the functions here), the Redis scripts and the
//! PostgreSQL statements (built from these constants when the store starts, with [`lua`] and
//! [`sql`]) all read them from here: no offset is written anywhere else.
//!
//! ```text
//! offset  0 "IDP"  3 version  4 state  5 …what the state holds
//! 'Q' (a claim that can be resolved, versions 2 and 3):
//!         5 token[16]  21 lease_until:u64  29 claimed_at:u64  37 sent_at:u64  45 phase:u8
//!         46 next_lookup_at:u64  54 fingerprint[32]  86 timings, lookup, statuses
//! ```

use std::ops::Range;

/// The first three bytes of every record.
pub const MAGIC: [u8; 3] = *b"IDP";
/// Where the format version sits.
pub const VERSION_AT: usize = 3;
/// Where the state byte sits.
pub const STATE_AT: usize = 4;
/// How long a record's prefix is (magic, version, state).
pub const PREFIX_LEN: usize = 5;

/// The format of in-flight claims and of every finished record of a route that does not
/// resolve.
pub const VERSION_1: u8 = 1;
/// The format of a resolve route's finished records (and of its claims written by earlier
/// proxies).
pub const VERSION_2: u8 = 2;
/// The format of a resolve route's claims.
pub const VERSION_3: u8 = 3;

/// State: a claim in flight (version 1).
pub const IN_FLIGHT: u8 = b'P';
/// State: a finished record.
pub const FINISHED: u8 = b'D';
/// State: a claim that can be resolved (versions 2 and 3).
pub const RESOLVABLE: u8 = b'Q';

/// A finished record's kind: a response, replayed byte for byte.
pub const RESPONSE: u8 = b'R';
/// A finished record's kind: a response too large to replay (its status only).
pub const NOT_REPLAYABLE: u8 = b'N';
/// A finished record's kind: a response a resolution found (version 2).
pub const RESOLVED: u8 = b'V';
/// A finished record's kind: a response with trailers (a gRPC call's).
pub const TRAILED: u8 = b'T';

/// A resolvable claim's phase: the request may be on its way.
pub const PHASE_IN_FLIGHT: u8 = b'F';
/// A resolvable claim's phase: lookups are being sent.
pub const PHASE_RESOLVING: u8 = b'R';

/// The prefix of a record of `version` in `state`.
const fn prefix(version: u8, state: u8) -> [u8; PREFIX_LEN] {
    [MAGIC[0], MAGIC[1], MAGIC[2], version, state]
}
/// Every finished record of version 1 starts with it.
pub const FINISHED_PREFIX: [u8; PREFIX_LEN] = prefix(VERSION_1, FINISHED);
/// Every finished record of version 2 starts with it.
pub const FINISHED_PREFIX_2: [u8; PREFIX_LEN] = prefix(VERSION_2, FINISHED);
/// Every claim that can be resolved that this proxy writes (version 3) starts with it.
pub const RESOLVABLE_PREFIX: [u8; PREFIX_LEN] = prefix(VERSION_3, RESOLVABLE);
/// Every such claim an earlier proxy wrote (version 2) starts with it.
pub const RESOLVABLE_PREFIX_2: [u8; PREFIX_LEN] = prefix(VERSION_2, RESOLVABLE);

/// A resolvable claim's fencing token.
pub const TOKEN: Range<usize> = PREFIX_LEN..PREFIX_LEN + 16;
/// Its lease: the holder is alive until then (store clock, ms).
pub const LEASE_UNTIL: Range<usize> = TOKEN.end..TOKEN.end + 8;
/// When it was claimed.
pub const CLAIMED_AT: Range<usize> = LEASE_UNTIL.end..LEASE_UNTIL.end + 8;
/// The latest any byte of the request can have reached the upstream.
pub const SENT_AT: Range<usize> = CLAIMED_AT.end..CLAIMED_AT.end + 8;
/// Its phase ([`PHASE_IN_FLIGHT`] or [`PHASE_RESOLVING`]).
pub const PHASE: usize = SENT_AT.end;
/// While resolving, when the next lookup is due (0 in flight).
pub const NEXT_LOOKUP_AT: Range<usize> = PHASE + 1..PHASE + 9;
/// The times a store writes: from the lease to the next lookup, contiguous (PostgreSQL keeps a
/// renewed copy of them in a column of their own).
pub const TIMES: Range<usize> = LEASE_UNTIL.start..NEXT_LOOKUP_AT.end;
/// Where the fixed part ends (the fingerprint's 32 bytes follow the times): a resolvable
/// claim is at least this long.
pub const FIXED: usize = NEXT_LOOKUP_AT.end + 32;

/// Whether `bytes` are a claim that can be resolved, of either version (long enough to hold
/// the fixed part; the rest is checked when it is decoded).
pub fn is_resolvable(bytes: &[u8]) -> bool {
    bytes.len() >= FIXED
        && (bytes.starts_with(&RESOLVABLE_PREFIX) || bytes.starts_with(&RESOLVABLE_PREFIX_2))
}

/// Whether `bytes` are a finished record, of either version.
pub fn is_finished(bytes: &[u8]) -> bool {
    bytes.len() > PREFIX_LEN
        && (bytes.starts_with(&FINISHED_PREFIX) || bytes.starts_with(&FINISHED_PREFIX_2))
}

/// The `u64` at `at`.
pub fn read(bytes: &[u8], at: Range<usize>) -> u64 {
    let mut eight = [0u8; 8];
    eight.copy_from_slice(&bytes[at]);
    u64::from_be_bytes(eight)
}

/// Writes `value` at `at`.
pub fn write(bytes: &mut [u8], at: Range<usize>, value: u64) {
    bytes[at].copy_from_slice(&value.to_be_bytes());
}

/// Claim: claimed `now`, leased until `now + lease`, sent at the latest `now + send_margin`
/// (the upstream's `timeout`), in flight, no lookup due.
pub fn stamp_claim(bytes: &mut [u8], now: u64, lease: u64, send_margin: u64) {
    write(bytes, LEASE_UNTIL, now.saturating_add(lease));
    write(bytes, CLAIMED_AT, now);
    write(bytes, SENT_AT, now.saturating_add(send_margin));
    bytes[PHASE] = PHASE_IN_FLIGHT;
    write(bytes, NEXT_LOOKUP_AT, 0);
}

/// Takeover: the claim is `token`'s, leased until `now + lease`, resolving, its next lookup
/// at once. When it was claimed and sent, the lookup and the timings stay as the first holder
/// wrote them.
pub fn stamp_takeover(bytes: &mut [u8], token: &[u8], now: u64, lease: u64) {
    bytes[TOKEN].copy_from_slice(token);
    write(bytes, LEASE_UNTIL, now.saturating_add(lease));
    bytes[PHASE] = PHASE_RESOLVING;
    write(bytes, NEXT_LOOKUP_AT, now);
}

/// Renew: leased until `lease_until`.
pub fn stamp_renew(bytes: &mut [u8], lease_until: u64) {
    write(bytes, LEASE_UNTIL, lease_until);
}

/// Resolving: leased until `lease_until`, resolving, the next lookup due at `next_lookup_at`.
pub fn stamp_resolving(bytes: &mut [u8], lease_until: u64, next_lookup_at: u64) {
    stamp_renew(bytes, lease_until);
    bytes[PHASE] = PHASE_RESOLVING;
    write(bytes, NEXT_LOOKUP_AT, next_lookup_at);
}

/// The layout as Lua reads it (strings count from 1): for the Redis scripts.
pub mod lua {
    use std::fmt::Write as _;

    /// The 1-based position of byte `at`.
    pub const fn at(at: usize) -> usize {
        at + 1
    }

    /// The 1-based last position of `range` (inclusive, as `string.sub` takes it).
    pub const fn last(range: &std::ops::Range<usize>) -> usize {
        range.end
    }

    /// `bytes` as a Lua string literal, every byte a decimal escape.
    pub fn literal(bytes: &[u8]) -> String {
        let mut out = String::with_capacity(2 + 4 * bytes.len());
        out.push('\'');
        for b in bytes {
            let _ = write!(out, "\\{b}");
        }
        out.push('\'');
        out
    }
}

/// The layout as SQL reads it (`substring`, `overlay` count from 1): for the PostgreSQL
/// statements.
pub mod sql {
    /// The 1-based position of byte `at`.
    pub const fn at(at: usize) -> usize {
        at + 1
    }

    /// `bytes` as a `bytea` literal.
    pub fn literal(bytes: &[u8]) -> String {
        format!("'\\x{}'::bytea", hex::encode(bytes))
    }

    /// `substring(value FROM … FOR …)` of `range` of the column `column`.
    pub fn slice(column: &str, range: &std::ops::Range<usize>) -> String {
        format!(
            "substring({column} FROM {} FOR {})",
            at(range.start),
            range.len()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The offsets as the format has them since version 2 (operators' queries and earlier
    /// proxies' scripts read them): changing one is a new format version.
    #[test]
    fn the_offsets_are_the_formats() {
        assert_eq!(RESOLVABLE_PREFIX, *b"IDP\x03Q");
        assert_eq!(RESOLVABLE_PREFIX_2, *b"IDP\x02Q");
        assert_eq!(FINISHED_PREFIX, *b"IDP\x01D");
        assert_eq!(FINISHED_PREFIX_2, *b"IDP\x02D");
        assert_eq!(TOKEN, 5..21);
        assert_eq!(LEASE_UNTIL, 21..29);
        assert_eq!(CLAIMED_AT, 29..37);
        assert_eq!(SENT_AT, 37..45);
        assert_eq!(PHASE, 45);
        assert_eq!(NEXT_LOOKUP_AT, 46..54);
        assert_eq!(TIMES, 21..54);
        assert_eq!(FIXED, 86);
        assert_eq!(lua::literal(b"IDP\x03Q"), "'\\73\\68\\80\\3\\81'");
        assert_eq!(sql::literal(b"IDP\x03Q"), "'\\x4944500351'::bytea");
        assert_eq!(sql::slice("v", &LEASE_UNTIL), "substring(v FROM 22 FOR 8)");
    }
}
