//! The Redis store: several proxy instances sharing one Redis behave as one.
//!
//! - The claim is one command, `SET key value NX PX lease GET` (Redis ≥ 7.0): it takes the key
//!   if free and otherwise returns what is there, atomically and in one round trip. The replay
//!   path therefore costs one round trip too.
//! - Renew, complete and release are Lua scripts that first compare the key's value with the
//!   holder's whole in-progress value (which contains its random token): a holder whose lease
//!   expired and was re-claimed by another request can never overwrite or delete the newer
//!   claim. Scripts run by `EVALSHA` and are reloaded on `NOSCRIPT` ([`redis::Script`] does it).
//! - One multiplexed [`ConnectionManager`], created lazily so the proxy starts while Redis is
//!   down, and reconnecting by itself after Redis comes back. Deadlines are applied by
//!   [`super::StoreHandle`], because a stopped Redis otherwise hangs a call forever.

use std::time::Duration;

use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{AsyncCommands, Script};

use bytes::Bytes;

use super::{Forgotten, Held, Store, StoreError, StoreKey};
use crate::record::{DecodeError, FINISHED_PREFIX};

const RENEW: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0";

const COMPLETE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0";

const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0";

const INSPECT: &str = r"
return {redis.call('GET', KEYS[1]), redis.call('PTTL', KEYS[1])}";

/// Deletes a finished record only: its value starts with the finished-record prefix
/// (ARGV[1]). 0: absent; 1: forgotten; 2: anything else, left alone.
const FORGET: &str = r"
local v = redis.call('GET', KEYS[1])
if not v then return 0 end
if string.sub(v, 1, string.len(ARGV[1])) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 2";

/// The Redis store.
pub struct RedisStore {
    conn: ConnectionManager,
    renew: Script,
    complete: Script,
    release: Script,
    inspect: Script,
    forget: Script,
}

/// Maps a Redis error. A value of another Redis type under a store key (WRONGTYPE) is a corrupt
/// record, like one that does not decode (SPEC §4.5): something else wrote there, and an
/// operation may have run under the key, so it is never forwarded.
fn backend(op: &'static str) -> impl FnOnce(redis::RedisError) -> StoreError {
    move |e| {
        if e.code() == Some("WRONGTYPE") || e.to_string().contains("WRONGTYPE") {
            return StoreError::Corrupt(DecodeError(
                "the key holds another Redis type (WRONGTYPE)",
            ));
        }
        StoreError::Backend {
            op,
            source: Box::new(e),
        }
    }
}

/// Milliseconds for `PX`, at least 1 (0 is an error in Redis).
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl RedisStore {
    /// Prepares a store for `url`. Connects lazily: the proxy starts even while Redis is down,
    /// answering 503 (or forwarding) until it is back. `timeout` bounds each connection attempt.
    pub fn new(url: &str, timeout: Duration) -> Result<RedisStore, StoreError> {
        let client = redis::Client::open(url).map_err(backend("connect"))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(3)
            .set_max_delay(Duration::from_secs(1));
        let conn = client
            .get_connection_manager_lazy(config)
            .map_err(backend("connect"))?;
        Ok(RedisStore {
            conn,
            renew: Script::new(RENEW),
            complete: Script::new(COMPLETE),
            release: Script::new(RELEASE),
            inspect: Script::new(INSPECT),
            forget: Script::new(FORGET),
        })
    }

    /// Checks the server at start: warns loudly when Redis may evict keys (an evicted record is
    /// a forgotten operation) or is too old for `SET NX GET`. Failures to check are logged, not
    /// fatal: the proxy must start while Redis is down.
    pub async fn check_server(&self, timeout: Duration) {
        let mut conn = self.conn.clone();
        let policy = tokio::time::timeout(
            timeout,
            redis::cmd("CONFIG")
                .arg("GET")
                .arg("maxmemory-policy")
                .query_async::<Vec<String>>(&mut conn),
        )
        .await;
        match policy {
            Ok(Ok(v)) => match v.get(1).map(String::as_str) {
                Some("noeviction") => {
                    tracing::info!("redis maxmemory-policy is noeviction");
                }
                Some(other) => tracing::warn!(
                    policy = other,
                    "REDIS MAY EVICT IDEMPOTENCY RECORDS: maxmemory-policy is {other}, not \
                     noeviction. An evicted record is a forgotten operation: a retry would run \
                     it twice. Set `maxmemory-policy noeviction` on this Redis."
                ),
                None => tracing::warn!(
                    "could not read redis maxmemory-policy (CONFIG GET returned nothing); make sure it is noeviction"
                ),
            },
            Ok(Err(e)) => tracing::warn!(
                error = %e,
                "could not read redis maxmemory-policy; make sure it is noeviction"
            ),
            Err(_) => tracing::warn!(
                "redis did not answer CONFIG GET maxmemory-policy in time; make sure it is noeviction"
            ),
        }
        let info = tokio::time::timeout(
            timeout,
            redis::cmd("INFO")
                .arg("server")
                .query_async::<String>(&mut conn),
        )
        .await;
        if let Ok(Ok(info)) = info {
            let version = info
                .lines()
                .find_map(|l| l.strip_prefix("redis_version:"))
                .unwrap_or("")
                .trim()
                .to_owned();
            let major: u32 = version
                .split('.')
                .next()
                .and_then(|m| m.parse().ok())
                .unwrap_or(0);
            if major < 7 {
                tracing::error!(
                    version = %version,
                    "redis {version} is too old: idemproxy needs Redis 7.0 or later (SET NX GET); claims will fail"
                );
            }
        }
    }
}

#[async_trait]
impl Store for RedisStore {
    async fn claim(
        &self,
        key: &StoreKey,
        held: &Held,
        lease: Duration,
    ) -> Result<Option<Bytes>, StoreError> {
        let mut conn = self.conn.clone();
        // One atomic step: set if absent, and return the previous value if there was one.
        let previous: Option<Vec<u8>> = redis::cmd("SET")
            .arg(key.text())
            .arg(held.encoded.as_ref())
            .arg("NX")
            .arg("PX")
            .arg(millis(lease))
            .arg("GET")
            .query_async(&mut conn)
            .await
            .map_err(backend("claim"))?;
        Ok(previous.map(Bytes::from))
    }

    async fn renew(
        &self,
        key: &StoreKey,
        held: &Held,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let mut conn = self.conn.clone();
        let n: i64 = self
            .renew
            .key(key.text())
            .arg(held.encoded.as_ref())
            .arg(millis(lease))
            .invoke_async(&mut conn)
            .await
            .map_err(backend("renew"))?;
        Ok(n == 1)
    }

    async fn complete(
        &self,
        key: &StoreKey,
        held: &Held,
        done: Bytes,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let mut conn = self.conn.clone();
        let n: i64 = self
            .complete
            .key(key.text())
            .arg(held.encoded.as_ref())
            .arg(done.as_ref())
            .arg(millis(ttl))
            .invoke_async(&mut conn)
            .await
            .map_err(backend("complete"))?;
        Ok(n == 1)
    }

    async fn release(&self, key: &StoreKey, held: &Held) -> Result<bool, StoreError> {
        let mut conn = self.conn.clone();
        let n: i64 = self
            .release
            .key(key.text())
            .arg(held.encoded.as_ref())
            .invoke_async(&mut conn)
            .await
            .map_err(backend("release"))?;
        Ok(n == 1)
    }

    async fn get(&self, key: &StoreKey) -> Result<Option<Bytes>, StoreError> {
        let mut conn = self.conn.clone();
        let value: Option<Vec<u8>> = conn.get(key.text()).await.map_err(backend("get"))?;
        Ok(value.map(Bytes::from))
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let mut conn = self.conn.clone();
        let _: String = redis::cmd("PING")
            .query_async(&mut conn)
            .await
            .map_err(backend("ping"))?;
        Ok(())
    }

    async fn inspect(&self, key: &StoreKey) -> Result<Option<(Bytes, Duration)>, StoreError> {
        let mut conn = self.conn.clone();
        let (value, pttl): (Option<Vec<u8>>, i64) = self
            .inspect
            .key(key.text())
            .invoke_async(&mut conn)
            .await
            .map_err(backend("inspect"))?;
        let ttl = Duration::from_millis(u64::try_from(pttl).unwrap_or(0));
        Ok(value.map(|v| (Bytes::from(v), ttl)))
    }

    async fn forget(&self, key: &StoreKey) -> Result<Forgotten, StoreError> {
        let mut conn = self.conn.clone();
        let n: i64 = self
            .forget
            .key(key.text())
            .arg(FINISHED_PREFIX)
            .invoke_async(&mut conn)
            .await
            .map_err(backend("forget"))?;
        match n {
            0 => Ok(Forgotten::Absent),
            1 => Ok(Forgotten::Forgotten),
            // Left alone: read it again to say why.
            _ => Ok(match self.get(key).await? {
                None => Forgotten::Absent,
                Some(bytes) => Forgotten::of(&bytes),
            }),
        }
    }
}
