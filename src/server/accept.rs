//! What to do when `accept` fails.
//!
//! Out of file descriptors (EMFILE, ENFILE) or memory, `accept` fails at once, every time, until
//! a connection closes: retried in a tight loop it burns a core, and logged each time it buries
//! the log (a proxy under `ulimit -n 128` wrote some 1,800 lines a minute). So the listener
//! pauses, doubling the pause up to a cap, and says so once per burst of failures, and once
//! more when accepting works again. An error about one connection only (the client reset it
//! while it waited in the queue) is not a burst: the next accept is tried at once.

use std::io;
use std::time::Duration;

use tokio::time::Instant;

/// The pause after the first failure of a burst.
const FIRST_PAUSE: Duration = Duration::from_millis(5);
/// The longest pause: a freed descriptor is used within this.
const MAX_PAUSE: Duration = Duration::from_secs(1);

/// The state of one listener's accept failures.
#[derive(Debug)]
pub(super) struct Backoff {
    name: &'static str,
    /// Failures in the current burst (0: no burst).
    failures: u64,
    /// When the burst began.
    since: Option<Instant>,
    pause: Duration,
}

impl Backoff {
    /// `name` says which listener in the log.
    pub(super) fn new(name: &'static str) -> Backoff {
        Backoff {
            name,
            failures: 0,
            since: None,
            pause: FIRST_PAUSE,
        }
    }

    /// A failed accept: how long to pause before the next (`None`: try again at once).
    pub(super) fn failed(&mut self, error: &io::Error) -> Option<Duration> {
        if is_about_one_connection(error) {
            tracing::debug!(listener = self.name, %error, "accept: a connection was lost in the queue");
            return None;
        }
        if self.failures == 0 {
            tracing::warn!(
                listener = self.name,
                %error,
                max_pause = ?MAX_PAUSE,
                "accept failed: pausing between tries until it works again (logged once for the whole burst)"
            );
            self.since = Some(Instant::now());
        }
        Some(self.next_pause())
    }

    /// A successful accept: ends a burst, if one was running.
    pub(super) fn succeeded(&mut self) {
        if self.failures == 0 {
            return;
        }
        tracing::info!(
            listener = self.name,
            failures = self.failures,
            lasted = ?self.since.map(|s| s.elapsed()).unwrap_or_default(),
            "accepting again after a burst of accept failures"
        );
        self.failures = 0;
        self.since = None;
        self.pause = FIRST_PAUSE;
    }

    fn next_pause(&mut self) -> Duration {
        self.failures += 1;
        let pause = self.pause;
        self.pause = (self.pause * 2).min(MAX_PAUSE);
        pause
    }
}

/// Errors that concern the connection being accepted, not the listener.
fn is_about_one_connection(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionRefused
            | io::ErrorKind::Interrupted
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn emfile() -> io::Error {
        io::Error::from_raw_os_error(24)
    }

    #[test]
    fn pauses_double_up_to_the_cap_and_restart_after_a_success() {
        let mut b = Backoff::new("test");
        let pauses: Vec<Duration> = (0..10).filter_map(|_| b.failed(&emfile())).collect();
        assert_eq!(pauses[0], FIRST_PAUSE);
        assert_eq!(pauses[1], FIRST_PAUSE * 2);
        assert_eq!(pauses[2], FIRST_PAUSE * 4);
        assert!(pauses.windows(2).all(|w| w[1] >= w[0]), "{pauses:?}");
        assert_eq!(pauses[9], MAX_PAUSE, "capped: {pauses:?}");
        assert_eq!(b.failures, 10);
        b.succeeded();
        assert_eq!(b.failures, 0);
        assert_eq!(b.failed(&emfile()), Some(FIRST_PAUSE), "a new burst");
    }

    #[test]
    fn an_error_about_one_connection_is_retried_at_once_and_starts_no_burst() {
        let mut b = Backoff::new("test");
        let reset = io::Error::from(io::ErrorKind::ConnectionAborted);
        assert_eq!(b.failed(&reset), None);
        assert_eq!(b.failures, 0);
    }
}
