//! Durations and sizes as the file writes them (`250ms`, `24h`, `8MiB`), and the largest value
//! each may take.

use std::fmt;
use std::time::Duration;

/// Durations written as strings: `250ms`, `30s`, `24h`, `1h 30m`.
pub(super) mod duration {
    use std::time::Duration;

    use serde::Deserializer;

    pub(in crate::config) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Duration, D::Error> {
        d.deserialize_any(super::Parse(super::parse_duration))
    }

    /// An optional duration: absent is `None` (with `#[serde(default)]`).
    pub(in crate::config) mod option {
        use std::time::Duration;

        use serde::Deserializer;

        pub(in crate::config) fn deserialize<'de, D: Deserializer<'de>>(
            d: D,
        ) -> Result<Option<Duration>, D::Error> {
            super::deserialize(d).map(Some)
        }
    }
}

/// Sizes written as bytes (`1048576`) or strings (`64KiB`, `8MiB`, `1MB`).
pub(super) mod byte_size {
    use serde::Deserializer;

    pub(in crate::config) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        d.deserialize_any(super::Parse(super::parse_size))
    }
}

/// A scalar read as text and parsed by the function it holds, so that `max_request_body: 1024`
/// and `max_request_body: 1KiB` both work and `ttl: 30` reaches the duration parser, which then
/// says what it expects. The parse runs inside the visitor, while the deserializer still stands
/// on the scalar: its error carries the value's own line and column, not those of the mapping
/// around it.
struct Parse<T>(fn(&str) -> Result<T, String>);

impl<T> serde::de::Visitor<'_> for Parse<T> {
    type Value = T;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string or a number")
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<T, E> {
        (self.0)(v).map_err(E::custom)
    }
    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<T, E> {
        self.visit_str(&v.to_string())
    }
    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<T, E> {
        self.visit_str(&v.to_string())
    }
    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<T, E> {
        self.visit_str(&v.to_string())
    }
}

/// Parses `250ms`, `30s`, `24h` (any unit humantime knows). A bare number is refused: a unit-less
/// duration is the classic misconfiguration (seconds or milliseconds?).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    if !t.is_empty() && t.chars().all(|c| c.is_ascii_digit()) {
        return Err(format!(
            "invalid duration {t:?}: give a unit, for example \"{t}s\" or \"{t}ms\""
        ));
    }
    humantime::parse_duration(t)
        .map_err(|e| format!("invalid duration {t:?} ({e}); expected for example 250ms, 30s, 24h"))
}

/// Parses a size: a whole number of bytes, or a number with a unit `B`, `KB`, `KiB`, `MB`,
/// `MiB`, `GB`, `GiB` (KB = 1000, KiB = 1024).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let bad = || format!("invalid size {t:?}; expected bytes or a string like 64KiB, 8MiB");
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "KB" | "kB" => 1000,
        "KiB" => 1024,
        "MB" => 1000 * 1000,
        "MiB" => 1024 * 1024,
        "GB" => 1000 * 1000 * 1000,
        "GiB" => 1024 * 1024 * 1024,
        _ => return Err(bad()),
    };
    n.checked_mul(mult).ok_or_else(bad)
}

/// The largest value each duration and size may take. Generous for any real deployment, and
/// small enough that deadlines computed from them cannot overflow a clock or Redis's `PX`.
/// Kept in one table, every section's, so that the limits can be read (and fuzzed) together.
pub mod bounds {
    use std::time::Duration;

    const DAY: u64 = 24 * 3600;
    const MIB: u64 = 1024 * 1024;

    /// `shutdown_timeout`.
    pub const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(3600);
    /// `store.timeout`.
    pub const STORE_TIMEOUT: Duration = Duration::from_secs(60);
    /// `store.max_entries`.
    pub(crate) const MAX_ENTRIES: u64 = 100_000_000;
    /// `store.wait_replicas`.
    pub(crate) const WAIT_REPLICAS: u32 = 16;
    /// `store.nodes`.
    pub(crate) const NODES: usize = 1000;
    /// `store.pool_size`.
    pub(crate) const POOL_SIZE: u32 = 1000;
    /// `workers`: threads, each with a runtime, accept loop, upstream pools and (Redis,
    /// PostgreSQL) store connections of its own.
    pub const WORKERS: u32 = 256;
    /// `store.sweep_interval`.
    pub const SWEEP_INTERVAL: Duration = Duration::from_secs(DAY);
    /// `upstreams.*.connect_timeout`.
    pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(300);
    /// `upstreams.*.timeout`.
    pub const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(3600);
    /// `upstreams.*.pool_idle_timeout`.
    pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(3600);
    /// `idempotency.ttl`: a year.
    pub const TTL: Duration = Duration::from_secs(365 * DAY);
    /// `idempotency.lock_ttl`.
    pub const LOCK_TTL: Duration = Duration::from_secs(DAY);
    /// `idempotency.wait_timeout`.
    pub const WAIT_TIMEOUT: Duration = Duration::from_secs(3600);
    /// `idempotency.max_request_body` and `max_response_body`.
    pub const BODY: u64 = 1024 * MIB;
    /// `limits.max_connections`, `max_detached_exchanges`, `max_pending_saves`.
    pub const COUNT: u64 = 1_000_000;
    /// `limits.header_read_timeout`.
    pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(600);
    /// `limits.body_read_timeout`.
    pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(3600);
    /// `limits.send_timeout`.
    pub(crate) const SEND_TIMEOUT: Duration = Duration::from_secs(3600);
    /// `drain_delay`.
    pub(crate) const DRAIN_DELAY: Duration = Duration::from_secs(3600);
    /// `limits.max_pending_save_bytes`.
    pub const PENDING_SAVE_BYTES: u64 = 16 * 1024 * MIB;
}

/// Refuses a duration above `max`, naming the field and the bound.
pub(super) fn at_most(
    err: &mut impl FnMut(String, String),
    path: &str,
    value: Duration,
    max: Duration,
) {
    if value > max {
        err(
            path.to_owned(),
            format!("is too long: at most {}", whole_unit(max)),
        );
    }
}

/// A bound in the largest whole unit: `365d`, `1h`, `10m`, `90s`.
fn whole_unit(d: Duration) -> String {
    let secs = d.as_secs();
    for (unit, n) in [("d", 86_400), ("h", 3600), ("m", 60)] {
        if secs >= n && secs.is_multiple_of(n) {
            return format!("{}{unit}", secs / n);
        }
    }
    format!("{secs}s")
}

/// A size as a person writes it: in the largest unit it is a whole number of (`64KiB`, `2GB`),
/// else in bytes (`1000003`).
pub(super) fn show_size(bytes: u64) -> String {
    const UNITS: [(&str, u64); 6] = [
        ("GiB", 1 << 30),
        ("GB", 1_000_000_000),
        ("MiB", 1 << 20),
        ("MB", 1_000_000),
        ("KiB", 1 << 10),
        ("KB", 1000),
    ];
    for (unit, n) in UNITS {
        if bytes >= n && bytes.is_multiple_of(n) {
            return format!("{}{unit}", bytes / n);
        }
    }
    bytes.to_string()
}

/// Refuses a size above `max`, naming the field and the bound, both as sizes are written.
pub(super) fn size_at_most(err: &mut impl FnMut(String, String), path: &str, value: u64, max: u64) {
    if value > max {
        err(
            path.to_owned(),
            format!(
                "{} is too large: at most {}",
                show_size(value),
                show_size(max)
            ),
        );
    }
}

/// Refuses a count above `max`, naming the field and the bound.
pub(super) fn count_at_most(
    err: &mut impl FnMut(String, String),
    path: &str,
    value: u64,
    max: u64,
) {
    if value > max {
        err(
            path.to_owned(),
            format!("{value} is too large: at most {max}"),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_durations() {
        assert_eq!(parse_size("64KiB"), Ok(65536));
        assert_eq!(parse_size("8MiB"), Ok(8 * 1024 * 1024));
        assert_eq!(parse_size("1000"), Ok(1000));
        assert_eq!(parse_size("1MB"), Ok(1_000_000));
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("").is_err());
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("24h"), Ok(Duration::from_secs(86400)));
        assert!(parse_duration("30").is_err());
        assert!(parse_duration("soon").is_err());
        assert_eq!(parse_duration("2d"), Ok(Duration::from_secs(2 * 86400)));
    }

    #[test]
    fn sizes_are_shown_in_the_unit_they_are_written_in() {
        assert_eq!(show_size(64 * 1024), "64KiB");
        assert_eq!(show_size(2 << 30), "2GiB");
        assert_eq!(show_size(2_000_000_000), "2GB");
        assert_eq!(show_size(1_500_000), "1500KB");
        assert_eq!(show_size(1000), "1KB");
        assert_eq!(show_size(1_000_003), "1000003");
        assert_eq!(show_size(0), "0");
        let mut said = Vec::new();
        size_at_most(
            &mut |path, message| said.push(format!("{path}: {message}")),
            "routes[0].idempotency.max_request_body",
            2 << 30,
            bounds::BODY,
        );
        assert_eq!(
            said,
            ["routes[0].idempotency.max_request_body: 2GiB is too large: at most 1GiB"]
        );
    }
}
