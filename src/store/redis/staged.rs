//! Large finished records: written by a plain `SET` to a staging key of their own, then moved
//! over the claim by the fenced script, so that no large value ever passes through Lua.
//!
//! Why: Redis's Lua turns every script argument into a Lua string, and Redis's copy of Lua
//! hashes *every byte* of a string it creates (upstream Lua 5.1 samples about 32 bytes of a long
//! string; `deps/lua/src/lstring.c` in Redis sets the step to 1), in a serial loop of a few
//! cycles a byte. `redis.call('SET', …)` then copies the value once more into a Redis object. A new key
//! with a 64 KiB response cost redis-server about 170 µs of CPU that way, against about 65 µs
//! for a plain `SET` of the same bytes; staged, about 95 µs (BENCHMARKS.md, "Large records on
//! Redis": two thirds of the inline script's cost was making its arguments Lua strings, half
//! of it that hash).
//!
//! How, for a record of at least [`STAGE_FROM`] bytes:
//! 1. `SET <staging key> <record> PX ttl` — a plain command: Redis keeps a large argument's
//!    buffer as the value, no copy;
//! 2. the script [`SAVE_STAGED`](super::scripts::SAVE_STAGED), with the record key and
//!    the staging key: only if the record key still holds the caller's claim, `RENAME` the
//!    staging key over it (O(1): the value moves, nothing is copied) and set the record's TTL.
//!
//! Both commands are sent at once, so a save still costs one round trip, and the record
//! ends up under its key exactly as an inline save leaves it: readers, `inspect`,
//! `forget` and the claim's `GET` see one key holding the whole record, as before (a record
//! written by an older proxy reads the same; nothing changes for them). Smaller records keep
//! the inline script: below a few KiB its hash costs less than a second command.
//!
//! The fencing stays what it was, because the staging key belongs to one claim alone: its
//! name carries the claim's random token, only that claim's holder writes it, and only the
//! fenced script moves it. A holder whose lease lapsed writes its staging key and then finds
//! another value under the record key: the script deletes the staging key and answers 0 —
//! nothing it wrote ever becomes the key's record, and nothing of a newer holder's is touched.
//! A holder that dies between the two commands leaves a staging key that nobody reads and
//! that expires by itself (`PX` = the record's `ttl`).
//!
//! On a Redis Cluster, both keys must be in one slot (a script's keys must be). The staging key
//! takes the record key's hash tag when it has one, and otherwise makes the whole record key
//! its tag (`…{<record key>}`), which hashes to the record key's own slot. A record key with
//! braces that form no tag (from its `key_prefix`) allows neither, and saves inline.

use std::time::Duration;

use bytes::Bytes;
use redis::aio::ConnectionLike;
use redis::{RedisResult, Script};

use super::millis;
use crate::record::Record;
use crate::store::Held;

/// Records of this many bytes or more are staged; smaller ones are saved inline. Measured
/// (redis-server CPU per claim and save, both one round trip): staging costs a few µs more
/// at 1 KiB (its second command), about the same at 4–8 KiB, a third less at 16 KiB, half at
/// 64 KiB. Below 8 KiB the proxy's second command would buy Redis nothing.
pub(crate) const STAGE_FROM: usize = 8 * 1024;

/// The staging key of `held`'s save under `key`: `<key>:staged:<token hex>`, plus a hash
/// tag that puts it in `key`'s slot when `key` has none. `None`: `held` is no claim, or `key`'s
/// braces allow no tag of the same slot.
pub(crate) fn staging_key(key: &str, held: &Held) -> Option<String> {
    let Record::InFlight { token, .. } = &held.record else {
        return None;
    };
    let token = hex::encode(token);
    if has_hash_tag(key) {
        // The first tag decides the slot: the record key's comes first in both.
        Some(format!("{key}:staged:{token}"))
    } else if !key.contains(['{', '}']) {
        // The tag is the whole record key: CRC16 of the same bytes, the same slot.
        Some(format!("{key}:staged:{token}{{{key}}}"))
    } else {
        None
    }
}

/// Whether Redis Cluster hashes `key` by a tag: a `{` followed, later, by a `}` with at least
/// one byte between them (the first `{` and the first `}` after it).
fn has_hash_tag(key: &str) -> bool {
    let Some(open) = key.find('{') else {
        return false;
    };
    matches!(key[open + 1..].find('}'), Some(close) if close > 0)
}

/// What the script answered.
const MOVED: i64 = 1;
const LOST: i64 = 0;
/// The staging key was not there: the script ran before the `SET` landed.
const NOT_STAGED: i64 = 3;

/// Completes `held`'s claim under `key` with `done`, staged under `staging`, for `ttl`: `true`
/// when the record is in place (now, or by an earlier try of this same save), `false`
/// when the lease was lost and nothing was written.
///
/// The `SET` and the script are sent together, on clones of one connection: in order on one
/// Redis, and in practice on a cluster node too, but each is its own request there (so each
/// follows its own redirects), and their order is not promised. The script therefore tells
/// "staged" from "not yet": if it ran first, it changed nothing, and it runs again once the
/// `SET` has answered.
pub(crate) async fn save<Conn>(
    script: &Script,
    conn: Conn,
    key: &str,
    staging: &str,
    held: &Held,
    done: &Bytes,
    ttl: Duration,
) -> RedisResult<bool>
where
    Conn: ConnectionLike + Clone + Send,
{
    let ttl = millis(ttl);
    let mut invocation = script.key(key);
    invocation.key(staging).arg(held.encoded.as_ref()).arg(ttl);
    let (mut for_set, mut for_script) = (conn.clone(), conn);
    let mut set = redis::cmd("SET");
    set.arg(staging).arg(done.as_ref()).arg("PX").arg(ttl);
    let stage = set.query_async::<()>(&mut for_set);
    let fenced = invocation.invoke_async::<i64>(&mut for_script);
    let (staged, answer) = tokio::join!(stage, fenced);
    staged?;
    let answer = match answer? {
        NOT_STAGED => invocation.invoke_async::<i64>(&mut for_script).await?,
        other => other,
    };
    match answer {
        MOVED => Ok(true),
        LOST => Ok(false),
        _ => Err(redis::RedisError::from((
            redis::ErrorKind::Client,
            "the staged record vanished before it could be moved under its key",
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held() -> Held {
        Held::new(Record::InFlight {
            token: [0xab; 16],
            fingerprint: [7; 32],
        })
    }

    /// Redis Cluster's slot of `key` (CRC16/XMODEM of the tag, or of the whole key).
    fn slot(key: &str) -> u16 {
        let bytes = key.as_bytes();
        let hashed = match key.find('{') {
            Some(open) => match key[open + 1..].find('}') {
                Some(close) if close > 0 => &bytes[open + 1..open + 1 + close],
                _ => bytes,
            },
            None => bytes,
        };
        let mut crc: u16 = 0;
        for &b in hashed {
            crc ^= u16::from(b) << 8;
            for _ in 0..8 {
                crc = if crc & 0x8000 != 0 {
                    (crc << 1) ^ 0x1021
                } else {
                    crc << 1
                };
            }
        }
        crc % 16384
    }

    #[test]
    fn the_crc_is_redis_clusters() {
        // The examples of the Redis Cluster specification.
        assert_eq!(slot("123456789"), 0x31c3, "CRC16/XMODEM of 123456789");
        assert_eq!(slot("{user1000}.following"), slot("user1000"));
    }

    #[test]
    fn a_staging_key_shares_its_record_keys_slot_and_carries_the_token() {
        let token = "ab".repeat(16);
        for key in [
            "idemproxy:create-booking:00ff",
            "{idemproxy}:create-booking:00ff",
            "app:{tenant-1}:create-booking:{00ff}",
        ] {
            let staged = staging_key(key, &held()).expect("a staging key");
            assert!(
                staged.starts_with(key),
                "{staged} starts with its record key"
            );
            assert!(staged.contains(&token), "{staged} carries the token");
            assert_eq!(slot(&staged), slot(key), "{staged} is in {key}'s slot");
        }
    }

    #[test]
    fn braces_without_a_tag_complete_inline() {
        for key in ["a}b:00ff", "a{}b:00ff", "a{b:00ff", "a}{b:00ff"] {
            assert!(!has_hash_tag(key), "{key} has no tag");
            assert_eq!(staging_key(key, &held()), None, "{key}");
        }
        assert_eq!(
            staging_key(
                "idemproxy:x:00",
                &Held::new(Record::Finished {
                    fingerprint: [7; 32],
                    saved: crate::record::Saved::NotReplayable {
                        status: http::StatusCode::OK
                    },
                })
            ),
            None,
            "a finished record holds no claim"
        );
    }
}
