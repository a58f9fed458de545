//! The plain claim on the memory store: one step under the key's shard lock.

use std::collections::hash_map::Entry;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use super::{Inner, MapKey, Slot, millis, shared};
use crate::store::Held;

impl Inner {
    /// One claim attempt: `Ok(None)` claimed, `Ok(Some(record))` taken, `Err(())` the store is
    /// at its bound.
    pub(super) fn try_claim(
        &self,
        key: &MapKey,
        held: &Held,
        lease: Duration,
    ) -> Result<Option<Bytes>, ()> {
        let mut shard = self.shard(key);
        let now = self.now();
        let expires = now.saturating_add(millis(lease));
        // Made only when the claim is taken: a replay or a conflict allocates nothing here.
        let slot = || Slot {
            expires,
            record: Arc::from(&held.encoded[..]),
        };
        match shard.map.entry(*key) {
            Entry::Occupied(o) if o.get().expires > now => {
                return Ok(Some(shared(&o.get().record)));
            }
            // An expired record is absent: take its place (the count does not change).
            Entry::Occupied(mut o) => {
                o.insert(slot());
                shard.wake(key);
            }
            Entry::Vacant(v) => {
                if !self.reserve() {
                    return Err(());
                }
                v.insert(slot());
            }
        }
        self.lapses_at(expires);
        Ok(None)
    }
}
