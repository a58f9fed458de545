//! The clock leases and TTLs run on: the host's wall clock, in Unix milliseconds.
//!
//! The file outlives the process, so a deadline written into it must mean the same after a
//! restart. A monotonic clock (tokio's `Instant`) starts again with every process; the wall
//! clock does not, which is why the rows carry Unix time (`expires_at`, milliseconds).
//!
//! The price (documented for operators): a step of the wall clock moves every deadline with
//! it. A step forward ends leases and TTLs early — a claim may then be taken over while its
//! holder still runs, and the holder's save is fenced off (a lost lease, logged and
//! counted), never written over the newer claim. A step back keeps records and leases longer.
//! NTP slews small corrections rather than stepping, so only a large correction does this.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

#[cfg(any(test, feature = "test-pauses"))]
use std::sync::atomic::{AtomicI64, Ordering};

/// The wall clock, read by the writer and the readers alike. Tests move it forward instead of
/// sleeping: the unit tests, and (in the tests' builds, the `test-pauses` feature) the store
/// contract's checks of long leases and lifetimes (`SqliteStore::advance_clock`).
#[derive(Debug, Default)]
pub(super) struct Clock {
    /// Milliseconds added to the wall clock (tests only).
    #[cfg(any(test, feature = "test-pauses"))]
    ahead: AtomicI64,
}

impl Clock {
    /// Now, in Unix milliseconds. A clock before 1970 reads as 0: every deadline is then in
    /// the future, which errs towards keeping records, never towards taking a live claim.
    #[allow(
        clippy::disallowed_methods,
        reason = "the SQLite store's clock is its host's wall clock, read here and nowhere else"
    )]
    pub(super) fn now_ms(&self) -> i64 {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(millis)
            .unwrap_or(0);
        #[cfg(any(test, feature = "test-pauses"))]
        let wall = wall.saturating_add(self.ahead.load(Ordering::Relaxed));
        wall
    }

    /// Moves this clock `by` into the future.
    #[cfg(any(test, feature = "test-pauses"))]
    pub(super) fn advance(&self, by: Duration) {
        self.ahead.fetch_add(millis(by), Ordering::Relaxed);
    }
}

/// Milliseconds, saturating: a duration too long for an `i64` of milliseconds is "forever".
pub(super) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The deadline `d` after `now` (saturating, as [`millis`]).
pub(super) fn deadline(now: i64, d: Duration) -> i64 {
    now.saturating_add(millis(d))
}

/// What is left until `expires_at`, seen at `now` (zero once it has passed).
pub(super) fn remaining(expires_at: i64, now: i64) -> Duration {
    Duration::from_millis(u64::try_from(expires_at.saturating_sub(now)).unwrap_or(0))
}
