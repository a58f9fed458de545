//! The store's clock, read on this host's: a resolvable record's times (when the request was
//! sent, when an `absent` becomes final, when to give up) are milliseconds on the clock its
//! leases use — Redis's, PostgreSQL's — so that any instance reads them alike (SPEC §4.8).
//! They are turned into this host's instants from one reading: the store's `now` of a claim,
//! and the instant its answer arrived.

use std::time::Duration;

use tokio::time::Instant;

/// One reading of the store's clock against this host's.
#[derive(Debug, Clone, Copy)]
pub(in crate::proxy) struct StoreClock {
    /// The store's clock when it ran the operation (ms).
    store_now: u64,
    /// This host's clock once the answer had arrived: no earlier than `store_now`.
    local: Instant,
}

impl StoreClock {
    /// The reading of an answer carrying the store's `now`, taken as the answer arrives.
    pub(in crate::proxy) fn read(store_now: u64) -> StoreClock {
        StoreClock {
            store_now,
            local: Instant::now(),
        }
    }

    /// The instant on this host at which the store's clock reads `at`, or later: the store
    /// read `store_now` before the answer arrived, so the mapping errs late — an `absent` is
    /// never taken as final early, and the give-up comes no sooner than the record says.
    pub(in crate::proxy) fn local(&self, at: u64) -> Instant {
        if at >= self.store_now {
            self.local + Duration::from_millis(at - self.store_now)
        } else {
            let before = Duration::from_millis(self.store_now - at);
            self.local.checked_sub(before).unwrap_or(self.local)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_times_map_to_local_instants_from_one_reading() {
        let clock = StoreClock::read(10_000);
        assert_eq!(clock.local(10_000), clock.local);
        assert_eq!(
            clock.local(12_500),
            clock.local + Duration::from_millis(2500)
        );
        assert!(clock.local(9_000) <= clock.local);
    }
}
