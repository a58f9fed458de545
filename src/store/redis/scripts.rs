//! The Lua scripts of the store. Each reads and writes one record key (`KEYS[1]`; the staged
//! save also its staging key, `KEYS[2]`, in the same slot), so on a Redis Cluster it
//! runs on the node that serves the key's slot, and compares the key's whole value with the
//! caller's before it changes anything (the token's compare-and-set).
//!
//! The scripts that read or write a record's bytes are built when the store starts, every
//! position and prefix from [`layout`] (Lua counts from 1: [`lua::at`]).
//!
//! Large values never go through these scripts: every argument becomes a Lua string, which
//! Redis hashes byte by byte ([`super::staged`] says what that costs and how it is avoided).

use crate::record::layout::{self, lua};

/// Extends the holder's claim (`ARGV[1]`) by `ARGV[2]` milliseconds. 1: extended; 0: the key holds
/// something else (or nothing), left alone.
pub(crate) const RENEW: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0";

/// Replaces the holder's claim (`ARGV[1]`) by the finished record (`ARGV[2]`). A key that already
/// holds that very record counts as done too: the client library may send a command again
/// after a connection error (the cluster client does), and the first attempt may have landed.
pub(crate) const SAVE: &str = r"
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
if v == ARGV[2] then
  return 1
end
return 0";

/// Moves a staged finished record (`KEYS[2]`, written by a plain `SET`) over the holder's claim
/// (`ARGV[1]`) under `KEYS[1]`, kept for `ARGV[2]` milliseconds. `RENAME` moves the value without
/// copying it. 1: the record is in place; 0: the key holds something else (the lease was
/// lost), and the staging key is deleted — it is this claim's alone, nobody else will move it;
/// 3: the staging key is not there yet (this ran before the `SET`), nothing changed.
///
/// The claim is compared length first, so that a large record already under the key (a
/// save sent again after its first try landed, or a newer holder's) is not copied into
/// Lua just to differ. Such a record counts as done when it is exactly the staged one: the
/// one place where a large value is read into Lua, on a path that follows a lost answer or a
/// lost lease.
pub(crate) const SAVE_STAGED: &str = r"
local held = ARGV[1]
if redis.call('STRLEN', KEYS[1]) == #held and redis.call('GET', KEYS[1]) == held then
  if redis.call('EXISTS', KEYS[2]) == 0 then
    return 3
  end
  redis.call('RENAME', KEYS[2], KEYS[1])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
local n = redis.call('STRLEN', KEYS[2])
if n == 0 then
  return 3
end
local same = redis.call('STRLEN', KEYS[1]) == n
  and redis.call('GET', KEYS[1]) == redis.call('GET', KEYS[2])
redis.call('DEL', KEYS[2])
if same then
  return 1
end
return 0";

/// Deletes the holder's claim (`ARGV[1]`). 1: deleted; 2: the key is gone already; 0: the key
/// holds something else, left alone. "Gone" is told apart from "another value" because a
/// release is sent again after a connection error (by the cluster client's own `retries`, and
/// by the store, see [`super::resend`]): the second attempt finds the key the first one
/// deleted, and that is no lost lease.
pub(crate) const RELEASE: &str = r"
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
if not v then
  return 2
end
return 0";

/// The key's value and its remaining time to live (milliseconds), read in one step.
pub(crate) const INSPECT: &str = r"
return {redis.call('GET', KEYS[1]), redis.call('PTTL', KEYS[1])}";

/// Deletes a finished record only: its value starts with a finished-record prefix (of format
/// version 1 or 2). 0: absent; 1: forgotten; 2: anything else, left alone.
pub(crate) fn forget() -> String {
    format!(
        "local v = redis.call('GET', KEYS[1])
if not v then return 0 end
local p = string.sub(v, 1, {len})
if p == {v1} or p == {v2} then
  redis.call('DEL', KEYS[1])
  return 1
end
return 2",
        len = layout::PREFIX_LEN,
        v1 = lua::literal(&layout::FINISHED_PREFIX),
        v2 = lua::literal(&layout::FINISHED_PREFIX_2),
    )
}

/// The store's clock, in milliseconds, from Redis's `TIME` (the clock every time in a
/// resolvable record is on). Every script that reads or writes those times reads the clock
/// itself, on the node that serves the key.
macro_rules! now_ms {
    () => {
        "local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"
    };
}

/// Whether `v` is a resolvable claim (`'Q'`, format version 3, or 2 written by an earlier
/// proxy), and whether its lease is still live at `now`.
fn resolvable_fns() -> String {
    format!(
        "local function is_q(v)
  if not v or #v < {fixed} then return false end
  local p = string.sub(v, 1, {len})
  return p == {v3} or p == {v2}
end
local function lease_live(v, now)
  return struct.unpack('>I8', v, {lease}) > now
end
",
        fixed = layout::FIXED,
        len = layout::PREFIX_LEN,
        v3 = lua::literal(&layout::RESOLVABLE_PREFIX),
        v2 = lua::literal(&layout::RESOLVABLE_PREFIX_2),
        lease = lua::at(layout::LEASE_UNTIL.start),
    )
}

/// `string.sub(v, …)` of the token.
fn token_of(v: &str) -> String {
    format!(
        "string.sub({v}, {}, {})",
        lua::at(layout::TOKEN.start),
        lua::last(&layout::TOKEN)
    )
}

/// A claim on a `resolve` route (`ARGV[1]`, its times to be stamped here): takes the key if it is
/// absent, stamping the claim with Redis's clock (lease until now + `ARGV[2]`, claimed now, sent at
/// the latest now + `ARGV[3]`) and giving the key its lifetime (`ARGV[4]` after it was sent,
/// `PXAT`); or, when the key holds a resolvable claim whose lease has lapsed, takes it over for
/// the token `ARGV[5]` (lease until now + `ARGV[2]`, resolving, next lookup now; the rest of the
/// value and the key's lifetime kept, `KEEPTTL`); or leaves the key as it is. One script, so
/// two instances can never both take one key over. Answers `{1 claimed | 2 taken over |
/// 3 existing, now, value}`.
pub(crate) fn claim_resolvable() -> String {
    format!(
        "{now}{fns}
local v = redis.call('GET', KEYS[1])
local lease = tonumber(ARGV[2])
if not v then
  local sent = now + tonumber(ARGV[3])
  local value = string.sub(ARGV[1], 1, {before_times})
    .. struct.pack('>I8I8I8', now + lease, now, sent) .. {in_flight} .. struct.pack('>I8', 0)
    .. string.sub(ARGV[1], {after_times})
  redis.call('SET', KEYS[1], value, 'PXAT', sent + tonumber(ARGV[4]))
  return {{1, now, value}}
end
if is_q(v) and not lease_live(v, now) then
  local value = string.sub(v, 1, {len}) .. ARGV[5] .. struct.pack('>I8', now + lease)
    .. string.sub(v, {claimed}, {sent_last}) .. {resolving} .. struct.pack('>I8', now)
    .. string.sub(v, {after_times})
  redis.call('SET', KEYS[1], value, 'KEEPTTL')
  return {{2, now, value}}
end
return {{3, now, v}}",
        now = now_ms!(),
        fns = resolvable_fns(),
        before_times = layout::TIMES.start,
        after_times = lua::at(layout::TIMES.end),
        in_flight = lua::literal(&[layout::PHASE_IN_FLIGHT]),
        resolving = lua::literal(&[layout::PHASE_RESOLVING]),
        len = layout::PREFIX_LEN,
        claimed = lua::at(layout::CLAIMED_AT.start),
        sent_last = lua::last(&layout::SENT_AT),
    )
}

/// The holder (token `ARGV[1]`, lease live) of a resolvable claim extends its lease to now +
/// `ARGV[2]`; with `ARGV[3]` not empty, also marks it resolving, its next lookup at now + `ARGV[3]`.
/// The key's lifetime is never shortened (only lengthened, should the lease outlast it).
/// Answers `{1 | 0 (lost, nothing written), now}`.
///
/// Only the bytes that change are read and written (`GETRANGE`, `SETRANGE`): the rest of the
/// value — the lookup, up to 16 KiB — is never rewritten, so a renewal costs the same memory
/// traffic, replication stream and AOF bytes whatever the lookup's size (SPEC §4.8, "Bounded").
pub(crate) fn renew_resolvable() -> String {
    format!(
        "{now}
if redis.call('STRLEN', KEYS[1]) < {fixed} then
  return {{0, now}}
end
local head = redis.call('GETRANGE', KEYS[1], 0, {head_last})
local p = string.sub(head, 1, {len})
if (p ~= {v3} and p ~= {v2}) or {token} ~= ARGV[1]
  or struct.unpack('>I8', head, {lease}) <= now then
  return {{0, now}}
end
local lease_until = now + tonumber(ARGV[2])
redis.call('SETRANGE', KEYS[1], {lease_at}, struct.pack('>I8', lease_until))
if ARGV[3] ~= '' then
  redis.call('SETRANGE', KEYS[1], {phase_at}, {resolving} .. struct.pack('>I8', now + tonumber(ARGV[3])))
end
local expires = redis.call('PEXPIRETIME', KEYS[1])
if expires >= 0 and expires < lease_until then
  redis.call('PEXPIREAT', KEYS[1], lease_until)
end
return {{1, now}}",
        now = now_ms!(),
        fixed = layout::FIXED,
        // `GETRANGE` and `SETRANGE` count from 0, the end inclusive.
        head_last = layout::LEASE_UNTIL.end - 1,
        len = layout::PREFIX_LEN,
        v3 = lua::literal(&layout::RESOLVABLE_PREFIX),
        v2 = lua::literal(&layout::RESOLVABLE_PREFIX_2),
        token = token_of("head"),
        lease = lua::at(layout::LEASE_UNTIL.start),
        lease_at = layout::LEASE_UNTIL.start,
        phase_at = layout::PHASE,
        resolving = lua::literal(&[layout::PHASE_RESOLVING]),
    )
}

/// The holder (token `ARGV[1]`, lease live) of a resolvable claim replaces it by the finished
/// record `ARGV[2]`, kept for `ARGV[3]` milliseconds. A key that already holds that very record
/// counts as done too (a save sent again). 1: done; 0: the lease was lost.
pub(crate) fn save_resolvable() -> String {
    format!(
        "{now}{fns}
local v = redis.call('GET', KEYS[1])
if is_q(v) and {token} == ARGV[1] and lease_live(v, now) then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
if v == ARGV[2] then
  return 1
end
return 0",
        now = now_ms!(),
        fns = resolvable_fns(),
        token = token_of("v"),
    )
}

/// The holder (token `ARGV[1]`) of a resolvable claim deletes it, its lease lapsed or not (see
/// `Store::release`). 1: deleted; 2: the key is gone already; 0: it holds something else.
pub(crate) fn release_resolvable() -> String {
    format!(
        "{fns}
local v = redis.call('GET', KEYS[1])
if not v then
  return 2
end
if is_q(v) and {token} == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0",
        fns = resolvable_fns(),
        token = token_of("v"),
    )
}

/// Redis's clock on the node that serves `KEYS[1]`, in milliseconds.
pub(crate) const NOW: &str = concat!(now_ms!(), "return now");
