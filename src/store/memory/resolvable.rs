//! The memory store's claims that can be resolved: the lease inside the value, the slot's
//! deadline the record's lifetime (see the module's docs).

use std::collections::hash_map::Entry;
use std::sync::Arc;
use std::time::Duration;

use super::{Held, Inner, MapKey, Shard, Slot, millis, shared};
use crate::record::{layout, resolvable};
use crate::store::{ResolvableFound, ResolvableTimes};

impl Shard {
    /// The live slot of the resolvable claim `held`, while its token holds it and its lease
    /// has not lapsed (the compare of a resolvable claim's compare-and-set).
    pub(super) fn holds_resolvable(
        &mut self,
        key: &MapKey,
        held: &Held,
        now: u64,
    ) -> Option<&mut Slot> {
        let token = held.resolvable()?.token;
        self.map.get_mut(key).filter(|s| {
            s.expires > now
                && resolvable::token(&s.record) == Some(&token[..])
                && resolvable::lease_until(&s.record).is_some_and(|l| l > now)
        })
    }
}

impl Inner {
    /// One resolvable claim attempt (see [`Store::claim_resolvable`](crate::store::Store::claim_resolvable)); `Err(())` the store is
    /// at its bound.
    pub(super) fn try_claim_resolvable(
        &self,
        key: &MapKey,
        held: &Held,
        times: ResolvableTimes,
    ) -> Result<ResolvableFound, ()> {
        let mut shard = self.shard(key);
        let now = self.now();
        let lease = millis(times.lease);
        match shard.map.entry(*key) {
            Entry::Occupied(mut o) if o.get().expires > now => {
                let slot = o.get_mut();
                let lapsed = resolvable::lease_until(&slot.record).is_some_and(|l| l <= now);
                let token = held.record.token();
                let (true, Some(token)) = (lapsed, token) else {
                    return Ok(ResolvableFound::Existing {
                        value: shared(&slot.record),
                    });
                };
                // A takeover: the lifetime (the slot's deadline) stays as the first claim set it.
                let mut value = slot.record.to_vec();
                layout::stamp_takeover(&mut value, token, now, lease);
                slot.record = Arc::from(value);
                let value = shared(&slot.record);
                self.lapses_at(slot.expires);
                Ok(ResolvableFound::TakenOver { value, now })
            }
            entry => {
                let mut value = held.encoded.to_vec();
                layout::stamp_claim(&mut value, now, lease, millis(times.send_margin));
                let expires = now
                    .saturating_add(millis(times.send_margin))
                    .saturating_add(millis(times.lifetime));
                let slot = Slot {
                    expires,
                    record: Arc::from(value),
                };
                let value = shared(&slot.record);
                match entry {
                    // An expired record is absent: take its place (the count does not change).
                    Entry::Occupied(mut o) => {
                        o.insert(slot);
                        shard.wake(key);
                    }
                    Entry::Vacant(v) => {
                        if !self.reserve() {
                            return Err(());
                        }
                        v.insert(slot);
                    }
                }
                self.lapses_at(expires);
                Ok(ResolvableFound::Claimed { value, now })
            }
        }
    }

    /// Rewrites the lease of the resolvable claim `held` to `lease` from now, and with
    /// `next_lookup_in`, marks it resolving; the slot's deadline (its lifetime) only grows.
    pub(super) fn renew_resolvable(
        &self,
        key: &MapKey,
        held: &Held,
        lease: Duration,
        next_lookup_in: Option<Duration>,
    ) -> Option<u64> {
        let mut shard = self.shard(key);
        let now = self.now();
        let slot = shard.holds_resolvable(key, held, now)?;
        let mut value = slot.record.to_vec();
        let lease_until = now.saturating_add(millis(lease));
        match next_lookup_in {
            None => layout::stamp_renew(&mut value, lease_until),
            Some(next) => {
                layout::stamp_resolving(&mut value, lease_until, now.saturating_add(millis(next)));
            }
        }
        slot.record = Arc::from(value);
        slot.expires = slot.expires.max(lease_until);
        Some(now)
    }
}
