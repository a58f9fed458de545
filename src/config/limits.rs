//! `limits:`: what hostile or broken clients may hold at most.

use std::time::Duration;

use serde::Deserialize;

use super::units::{at_most, bounds, byte_size, count_at_most, duration, size_at_most};

/// `limits:` as written: what hostile or broken clients may hold at most.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[serde(expecting = "limits: a mapping of bounds")]
pub(crate) struct RawLimits {
    /// Open client connections at most; past it, new connections wait in the accept queue.
    /// Default 10000.
    #[serde(default = "defaults::max_connections")]
    pub max_connections: u32,
    /// How long a client may take to send a request head, and how long an idle keep-alive
    /// connection stays open. Default 10s.
    #[serde(default = "defaults::header_read_timeout", with = "duration")]
    pub header_read_timeout: Duration,
    /// How long a client may take to send a whole request body, on every route. Default 30s.
    #[serde(default = "defaults::body_read_timeout", with = "duration")]
    pub body_read_timeout: Duration,
    /// Idempotent exchanges still running after their client left, at most; past it, new
    /// idempotent requests get a 503 before anything is claimed. Default 1000.
    #[serde(default = "defaults::max_detached_exchanges")]
    pub max_detached_exchanges: u32,
    /// Results whose save is being retried in the background, held whole, at most; past
    /// it (or past `max_pending_save_bytes`) the oldest lets go of its response and saves a
    /// `502 result-not-kept` in its place, keeping its lease meanwhile. Default 1000.
    #[serde(default = "defaults::max_pending_saves")]
    pub max_pending_saves: u32,
    /// Bytes of those results, at most. Default 64MiB.
    #[serde(default = "defaults::max_pending_save_bytes", with = "byte_size")]
    pub max_pending_save_bytes: u64,
    /// How long a response may make no write progress (a client that stopped reading) before
    /// it is abandoned and its connection closed. Default 30s.
    #[serde(default = "defaults::send_timeout", with = "duration")]
    pub send_timeout: Duration,
    /// Open admin-listener connections at most. Default 256.
    #[serde(default = "defaults::max_admin_connections")]
    pub max_admin_connections: u32,
    /// Resolutions (`on_unknown_outcome: resolve`) running at once on this instance, at most;
    /// past it an unknown outcome is left held in the store, its lease left to lapse, and
    /// resolved when a repeat of its key takes it over. Default 1024.
    #[serde(default = "defaults::max_resolutions")]
    pub max_resolutions: u32,
}

impl Default for RawLimits {
    fn default() -> Self {
        RawLimits {
            max_connections: defaults::max_connections(),
            header_read_timeout: defaults::header_read_timeout(),
            body_read_timeout: defaults::body_read_timeout(),
            max_detached_exchanges: defaults::max_detached_exchanges(),
            max_pending_saves: defaults::max_pending_saves(),
            max_pending_save_bytes: defaults::max_pending_save_bytes(),
            send_timeout: defaults::send_timeout(),
            max_admin_connections: defaults::max_admin_connections(),
            max_resolutions: defaults::max_resolutions(),
        }
    }
}

/// The documented defaults, one function each so serde and the docs agree.
mod defaults {
    use std::time::Duration;

    pub(super) fn max_connections() -> u32 {
        10_000
    }
    pub(super) fn header_read_timeout() -> Duration {
        Duration::from_secs(10)
    }
    pub(super) fn body_read_timeout() -> Duration {
        Duration::from_secs(30)
    }
    pub(super) fn send_timeout() -> Duration {
        Duration::from_secs(30)
    }
    pub(super) fn max_admin_connections() -> u32 {
        256
    }
    pub(super) fn max_detached_exchanges() -> u32 {
        1000
    }
    pub(super) fn max_pending_saves() -> u32 {
        1000
    }
    pub(super) fn max_pending_save_bytes() -> u64 {
        64 * 1024 * 1024
    }
    pub(super) fn max_resolutions() -> u32 {
        1024
    }
}

/// What hostile or broken clients may hold at most (see [`RawLimits`] for each field).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Open client connections at most.
    pub max_connections: u32,
    /// Deadline of a request head, and of an idle keep-alive connection.
    pub header_read_timeout: Duration,
    /// Deadline of a whole request body.
    pub body_read_timeout: Duration,
    /// Exchanges still running after their client left, at most.
    pub max_detached_exchanges: u32,
    /// Saves retried in the background, at most.
    pub max_pending_saves: u32,
    /// Bytes of those, at most.
    pub max_pending_save_bytes: u64,
    /// How long a response may make no write progress before its connection is closed.
    pub send_timeout: Duration,
    /// Open admin-listener connections at most.
    pub max_admin_connections: u32,
    /// Resolutions running at once on this instance, at most.
    pub max_resolutions: u32,
}

impl RawLimits {
    /// Checks every bound, reporting what is out of range. The limits are returned either way:
    /// the caller builds a [`super::Config`] only when no error at all was reported.
    pub(super) fn validate(&self, err: &mut impl FnMut(String, String)) -> Limits {
        self.check_counts(err);
        self.check_timeouts(err);
        if self.max_pending_save_bytes == 0 {
            err(
                "limits.max_pending_save_bytes".into(),
                "must be greater than zero: no result could be kept for a retried save".into(),
            );
        }
        size_at_most(
            err,
            "limits.max_pending_save_bytes",
            self.max_pending_save_bytes,
            bounds::PENDING_SAVE_BYTES,
        );
        Limits {
            max_connections: self.max_connections,
            header_read_timeout: self.header_read_timeout,
            body_read_timeout: self.body_read_timeout,
            max_detached_exchanges: self.max_detached_exchanges,
            max_pending_saves: self.max_pending_saves,
            max_pending_save_bytes: self.max_pending_save_bytes,
            send_timeout: self.send_timeout,
            max_admin_connections: self.max_admin_connections,
            max_resolutions: self.max_resolutions,
        }
    }

    fn check_counts(&self, err: &mut impl FnMut(String, String)) {
        for (field, value) in [
            ("limits.max_connections", self.max_connections),
            ("limits.max_pending_saves", self.max_pending_saves),
            ("limits.max_admin_connections", self.max_admin_connections),
            ("limits.max_resolutions", self.max_resolutions),
        ] {
            if value == 0 {
                err(field.into(), "must be at least 1".into());
            }
            count_at_most(err, field, u64::from(value), bounds::COUNT);
        }
        if self.max_detached_exchanges == 0 {
            // The admission check refuses a new idempotent request once this many run
            // detached: at zero that is every one of them, a 503 for all traffic.
            err(
                "limits.max_detached_exchanges".into(),
                "must be at least 1: at 0 every idempotent request is refused as overloaded".into(),
            );
        }
        count_at_most(
            err,
            "limits.max_detached_exchanges",
            u64::from(self.max_detached_exchanges),
            bounds::COUNT,
        );
    }

    fn check_timeouts(&self, err: &mut impl FnMut(String, String)) {
        for (field, value, max) in [
            (
                "limits.header_read_timeout",
                self.header_read_timeout,
                bounds::HEADER_READ_TIMEOUT,
            ),
            (
                "limits.body_read_timeout",
                self.body_read_timeout,
                bounds::BODY_READ_TIMEOUT,
            ),
            (
                "limits.send_timeout",
                self.send_timeout,
                bounds::SEND_TIMEOUT,
            ),
        ] {
            if value.is_zero() {
                err(field.into(), "must be greater than zero".into());
            }
            at_most(err, field, value, max);
        }
    }
}
