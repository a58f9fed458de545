//! The Lua scripts of the store. Each reads and writes exactly one key (`KEYS[1]`), so on a
//! Redis Cluster it runs on the node that serves the key's slot, and compares the key's whole
//! value with the caller's before it changes anything (the token's compare-and-set).

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
