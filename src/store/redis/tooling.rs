//! What the key tooling asks of the store: a record and its time to live, and forgetting a
//! finished one (one script each, `scripts.rs`).

use std::time::Duration;

use bytes::Bytes;

use super::{RedisConnection, RedisStore, backend};
use crate::store::{Forgotten, Store, StoreError, StoreKey};

impl<C: RedisConnection> RedisStore<C> {
    /// The record under `key` and its time to live, read in one step.
    pub(super) async fn inspect_key(
        &self,
        key: &StoreKey,
    ) -> Result<Option<(Bytes, Duration)>, StoreError> {
        let (value, pttl): (Option<Vec<u8>>, i64) = self
            .shared("inspect", |mut conn| async move {
                self.inspect.key(key.text()).invoke_async(&mut conn).await
            })
            .await?;
        let ttl = Duration::from_millis(u64::try_from(pttl).unwrap_or(0));
        Ok(value.map(|v| (Bytes::from(v), ttl)))
    }

    /// Deletes the record under `key` if it is a finished one; what was found.
    pub(super) async fn forget_finished(&self, key: &StoreKey) -> Result<Forgotten, StoreError> {
        let mut conn = self.conn.clone();
        let n: i64 = self
            .forget
            .key(key.text())
            .invoke_async(&mut conn)
            .await
            .map_err(backend("forget"))?;
        match n {
            0 => Ok(Forgotten::Absent),
            1 => Ok(Forgotten::Forgotten),
            // Left alone: read it again to say why.
            _ => Ok(match Store::get(self, key).await? {
                None => Forgotten::Absent,
                Some(bytes) => Forgotten::of(&bytes),
            }),
        }
    }
}
