//! Keys that have been repeated or finished lately, as a hint for the durable stores: which
//! claims are worth a plain read first.
//!
//! Why: on PostgreSQL a repeat of a finished key costs the claim statement (a read and two
//! writers skipped, ~1.5× a primary-key read), and on SQLite every claim looked on a read
//! thread first, a hop new keys paid for nothing. A read first for every claim would make each
//! new key pay a round trip to spare the repeats one; a read first for no claim makes every
//! repeat pay the claim. Repeats come in bursts on keys this proxy has just answered (a
//! client's retries, duplicates of one delivery), so the keys it has just seen finished or
//! repeated are the ones whose next claim is likely a repeat.
//!
//! The hint decides nothing: a read that finds a finished record returns it (what the claim
//! would have returned), and a read that finds nothing or a claim in flight falls through to
//! the claim, which decides every winner. A wrong hint costs one read; a hint missed (a key
//! seen by another process or worker, or overwritten in the table) costs what a claim costs
//! without it. So the table is small and lossy: one 64-bit fingerprint a slot, a slot chosen
//! by the fingerprint, a newer key overwriting an older one, no lock.

use std::sync::atomic::{AtomicU64, Ordering};

use super::StoreKey;

/// Slots: 2 MiB, the keys of the last minute or so at thousands of new keys a second, longer
/// at lower rates.
const SLOTS: usize = 1 << 18;

/// The fingerprints of keys lately finished or repeated.
pub(crate) struct RecentKeys {
    slots: Box<[AtomicU64]>,
}

impl RecentKeys {
    pub(crate) fn new() -> RecentKeys {
        RecentKeys {
            slots: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Notes `key`: finished by this proxy, or found taken by a claim.
    pub(crate) fn note(&self, key: &StoreKey) {
        let fingerprint = fingerprint(key);
        self.slot(fingerprint).store(fingerprint, Ordering::Relaxed);
    }

    /// Whether `key` was noted lately (or a key sharing its fingerprint: a wasted read).
    pub(crate) fn holds(&self, key: &StoreKey) -> bool {
        let fingerprint = fingerprint(key);
        self.slot(fingerprint).load(Ordering::Relaxed) == fingerprint
    }

    fn slot(&self, fingerprint: u64) -> &AtomicU64 {
        // The fingerprint is a hash already: its low bits pick the slot.
        &self.slots[(fingerprint as usize) & (SLOTS - 1)]
    }
}

/// 64 bits of the key's hash and its route; never 0 (an empty slot).
fn fingerprint(key: &StoreKey) -> u64 {
    let id = key.id();
    let mut head = [0u8; 8];
    head.copy_from_slice(&id[..8]);
    (u64::from_le_bytes(head) ^ u64::from(key.route())).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::namespace;

    fn key(route: u32, first: u8) -> StoreKey {
        let mut id = [7u8; 32];
        id[0] = first;
        StoreKey::new(namespace("idemproxy:", "r"), route, id)
    }

    #[test]
    fn a_noted_key_is_held_and_others_are_not() {
        let recent = RecentKeys::new();
        assert!(!recent.holds(&key(0, 1)), "an empty table holds nothing");
        recent.note(&key(0, 1));
        assert!(recent.holds(&key(0, 1)));
        assert!(!recent.holds(&key(0, 2)), "another hash");
        assert!(!recent.holds(&key(1, 1)), "the same hash on another route");
    }

    #[test]
    fn a_newer_key_in_the_same_slot_takes_it_over() {
        let recent = RecentKeys::new();
        let older = key(0, 1);
        // Differs only above the slot bits: the same slot, another fingerprint.
        let mut id = [7u8; 32];
        id[0] = 1;
        id[7] = 8;
        let newer = StoreKey::new(namespace("idemproxy:", "r"), 0, id);
        recent.note(&older);
        recent.note(&newer);
        assert!(recent.holds(&newer));
        assert!(!recent.holds(&older), "lossy: one key a slot");
    }
}
