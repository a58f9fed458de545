//! What the key tooling asks of the store: a record and its time to live, and forgetting a
//! finished one.

use std::time::Duration;

use bytes::Bytes;

use super::{Inner, MapKey, shared};
use crate::store::{Forgotten, StoreKey};

impl Inner {
    /// The live record under `key` and its time to live.
    pub(super) fn inspect(&self, key: &StoreKey) -> Option<(Bytes, Duration)> {
        let key = MapKey::of(key);
        let shard = self.shard(&key);
        let now = self.now();
        shard
            .live(&key, now)
            .map(|s| (shared(&s.record), Duration::from_millis(s.expires - now)))
    }

    /// Deletes the record under `key` if it is a finished one; what was found.
    pub(super) fn forget_finished(&self, key: &StoreKey) -> Forgotten {
        let key = MapKey::of(key);
        let mut shard = self.shard(&key);
        let now = self.now();
        let found = match shard.live(&key, now) {
            None => return Forgotten::Absent,
            Some(slot) => Forgotten::of(&slot.record),
        };
        if found == Forgotten::Forgotten {
            shard.map.remove(&key);
            drop(shard);
            self.forget(1);
        }
        found
    }
}
