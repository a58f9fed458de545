//! The Lua scripts of the store. Each reads and writes one record key (`KEYS[1]`; the staged
//! completion also its staging key, `KEYS[2]`, in the same slot), so on a Redis Cluster it
//! runs on the node that serves the key's slot, and compares the key's whole value with the
//! caller's before it changes anything (the token's compare-and-set).
//!
//! Large values never go through these scripts: every argument becomes a Lua string, which
//! Redis hashes byte by byte ([`super::staged`] says what that costs and how it is avoided).

/// Extends the holder's claim (ARGV[1]) by ARGV[2] milliseconds. 1: extended; 0: the key holds
/// something else (or nothing), left alone.
pub(crate) const RENEW: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0";

/// Replaces the holder's claim (ARGV[1]) by the finished record (ARGV[2]). A key that already
/// holds that very record counts as done too: the client library may send a command again
/// after a connection error (the cluster client does), and the first attempt may have landed.
pub(crate) const COMPLETE: &str = r"
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
if v == ARGV[2] then
  return 1
end
return 0";

/// Moves a staged finished record (KEYS[2], written by a plain `SET`) over the holder's claim
/// (ARGV[1]) under KEYS[1], kept for ARGV[2] milliseconds. `RENAME` moves the value without
/// copying it. 1: the record is in place; 0: the key holds something else (the lease was
/// lost), and the staging key is deleted — it is this claim's alone, nobody else will move it;
/// 3: the staging key is not there yet (this ran before the `SET`), nothing changed.
///
/// The claim is compared length first, so that a large record already under the key (a
/// completion sent again after its first try landed, or a newer holder's) is not copied into
/// Lua just to differ. Such a record counts as done when it is exactly the staged one: the
/// one place where a large value is read into Lua, on a path that follows a lost answer or a
/// lost lease.
pub(crate) const COMPLETE_STAGED: &str = r"
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

/// Deletes the holder's claim (ARGV[1]). 1: deleted; 2: the key is gone already; 0: the key
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

/// Deletes a finished record only: its value starts with the finished-record prefix
/// (ARGV[1]). 0: absent; 1: forgotten; 2: anything else, left alone.
pub(crate) const FORGET: &str = r"
local v = redis.call('GET', KEYS[1])
if not v then return 0 end
if string.sub(v, 1, string.len(ARGV[1])) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 2";
