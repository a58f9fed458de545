//! The SQLite store: one proxy process per file, records that survive a restart of the proxy.
//!
//! # Design
//! - **The file** (`file.rs`): created if missing, with its directory; WAL mode;
//!   `synchronous` NORMAL (`sync: normal`: a commit survives a crash or SIGKILL of the
//!   proxy) or FULL (`sync: full`: a power loss too). An exclusive `flock` on it, held for the
//!   life of the store, refuses a second process. The schema (`records`, its `expires_at`
//!   index, `schema_version`) is created if missing; a file of a newer layout is refused.
//! - **One writer thread** (`writer.rs`) owns the write connection and applies queued claims,
//!   renewals, saves, releases and forgets in one transaction per batch (group commit),
//!   and answers each operation only after its batch has committed: a claim is durable before
//!   the request it admits is forwarded (SPEC §4.6).
//! - **A checkpoint thread** (`checkpoint.rs`) copies the log back into the file every
//!   second, beside the writer: the writer never stalls on a checkpoint's sync.
//! - **Read threads** (`readers.rs`), each with its own connection, serve `get`, `inspect`,
//!   `ping`'s read, and the first look of a claim of a key lately finished or repeated (a
//!   likely repeat, `store/recent.rs`), beside the writer (WAL).
//! - **The SQL** (`ops.rs` the statements; `claim.rs`, `resolvable.rs`, `tooling.rs` by part): the claim is one `INSERT … ON CONFLICT DO UPDATE … WHERE
//!   expired`; renew, save and release are fenced on the token and on the lease not
//!   having expired.
//! - **Time** (`clock.rs`): leases and TTLs are Unix milliseconds of the host's wall clock,
//!   so they mean the same after a restart (a clock step can end leases early).
//! - **The sweep** (`sweep.rs`) deletes expired rows in small transactions on the writer.
//! - **Waiters** (`waiters.rs`) for `on_conflict: wait` are woken in-process after the commit
//!   of a save or release: this process is the only one on the file.

mod answers;
mod checkpoint;
mod claim;
mod clock;
mod file;
mod ops;
mod readers;
mod resolvable;
mod sweep;
mod tooling;
mod waiters;
mod writer;

use std::fs::File;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use self::checkpoint::Checkpointer;
use self::clock::{Clock, deadline, remaining};
use self::readers::{Readers, Row};
use self::waiters::Waiters;
pub use self::writer::SqliteSeries;
use self::writer::{Shared, Writer};
use super::SweptSeries;
use super::recent::RecentKeys;
use super::{Forgotten, Held, ResolvableFound, ResolvableTimes, Store, StoreError, StoreKey};
use crate::config::SqliteSync;
use crate::metrics::Metrics;
use crate::record::{self, Token};

/// Records in an SQLite file.
pub struct SqliteStore {
    inner: Arc<Inner>,
}

/// The store's parts. Fields drop in order: the writer (which drains its queue) and the
/// readers close their connections before the file's lock is released.
struct Inner {
    writer: Writer,
    readers: Readers,
    /// Copies the log back into the file (after the writer and the readers have closed, the
    /// last connection's close checkpoints what is left).
    _checkpointer: Checkpointer,
    waiters: Arc<Waiters>,
    clock: Arc<Clock>,
    swept: SweptSeries,
    /// Keys whose next claim reads first (see [`RecentKeys`]).
    recent: RecentKeys,
    /// The `flock` that keeps the file to this process, released when this closes.
    _lock: File,
}

impl SqliteStore {
    /// Opens (creating if missing) the database at `path`, locks it against a second process,
    /// and starts the writer thread and the sweep (on the current Tokio runtime).
    pub fn open(
        path: &Path,
        sync: SqliteSync,
        sweep_interval: Duration,
        metrics: Arc<Metrics>,
    ) -> Result<SqliteStore, StoreError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|e| StoreError::Backend {
            op: "open",
            source: format!("the SQLite store runs its sweep on a Tokio runtime: {e}").into(),
        })?;
        let open_error = |e: file::OpenError| StoreError::Backend {
            op: "open",
            source: Box::new(e),
        };
        // The lock first: nothing touches a file another proxy is using.
        let lock = file::lock(path).map_err(open_error)?;
        let conn = file::open_writer(path, sync).map_err(open_error)?;
        let clock = Arc::new(Clock::default());
        let waiters = Arc::new(Waiters::default());
        let readers = Readers::start(path, clock.clone()).map_err(open_error)?;
        let shared = Shared {
            clock: clock.clone(),
            waiters: waiters.clone(),
            series: metrics.store_series(),
        };
        let writer = Writer::start(conn, shared).map_err(|source| {
            open_error(file::OpenError::Io {
                what: "cannot start the writer thread for",
                path: path.to_owned(),
                source,
            })
        })?;
        let checkpointer = file::open_checkpointer(path, sync)
            .map_err(open_error)
            .and_then(|conn| {
                Checkpointer::start(conn, path).map_err(|source| {
                    open_error(file::OpenError::Io {
                        what: "cannot start the checkpoint thread for",
                        path: path.to_owned(),
                        source,
                    })
                })
            })?;
        let inner = Arc::new(Inner {
            writer,
            readers,
            _checkpointer: checkpointer,
            waiters,
            clock,
            swept: metrics.store_series(),
            recent: RecentKeys::new(),
            _lock: lock,
        });
        sweep::start(&runtime, Arc::downgrade(&inner), sweep_interval);
        Ok(SqliteStore { inner })
    }

    /// Moves the store's clock `by` into the future, for the store contract's checks of long
    /// leases and lifetimes (the harness's `store_checks`), which cannot sleep through minutes.
    /// In the tests' builds only (the `test-pauses` feature); never in a release.
    #[cfg(feature = "test-pauses")]
    #[doc(hidden)]
    pub fn advance_clock(&self, by: Duration) {
        self.inner.clock.advance(by);
    }
}

impl Inner {
    /// The key's live row, read on a read connection.
    async fn live(&self, op: &'static str, key: String) -> Result<Option<Row>, StoreError> {
        self.readers
            .read(op, move |reads, now| reads.live(&key, now))
            .await
    }

    /// Deletes up to one sweep batch of expired rows, in a transaction of its own; returns how
    /// many.
    async fn sweep_batch(&self) -> Result<u64, StoreError> {
        let swept = self
            .writer
            .submit("sweep", None, true, |ops, now| {
                ops.sweep(now, sweep::SWEEP_BATCH)
            })
            .await?;
        self.swept.swept(swept);
        Ok(swept)
    }
}

/// The fencing token of a claim held by this proxy.
fn token(op: &'static str, held: &Held) -> Result<Token, StoreError> {
    match held.record.token() {
        Some(token) => Ok(*token),
        None => Err(unavailable(op, "a finished record holds no claim")),
    }
}

/// An SQLite error, with where it happened.
#[derive(Debug, thiserror::Error)]
#[error("{on}: {source}")]
struct SqlFailed {
    on: &'static str,
    #[source]
    source: rusqlite::Error,
}

/// The store could not run the operation (its threads stopped, its batch was not written).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Unavailable(String);

fn sql_error(op: &'static str, on: &'static str, source: rusqlite::Error) -> StoreError {
    StoreError::Backend {
        op,
        source: Box::new(SqlFailed { on, source }),
    }
}

fn unavailable(op: &'static str, why: &str) -> StoreError {
    StoreError::Backend {
        op,
        source: Box::new(Unavailable(why.to_owned())),
    }
}

#[async_trait]
impl Store for SqliteStore {
    async fn claim(
        &self,
        key: &StoreKey,
        held: &Held,
        lease: Duration,
    ) -> Result<Option<Bytes>, StoreError> {
        let store_key = key;
        let key = key.text();
        // A key lately finished or repeated (see `recent.rs`): likely a repeat, so a read
        // first, and a live row found on a read connection is returned as it is, without a
        // write transaction (the replay path costs one read). This is not check-then-act:
        // absence is never acted on here — only the writer's upsert below takes a key, and it
        // checks for a live row again, atomically. Any other key goes to the writer at once: a
        // new key would pay the read thread's hop for nothing.
        let recent = &self.inner.recent;
        if recent.holds(store_key)
            && let Some(row) = self.inner.live("claim", key.clone()).await?
        {
            return Ok(Some(row.value));
        }
        let token = token("claim", held)?;
        let value = held.encoded.clone();
        let found = self
            .inner
            .writer
            .submit("claim", None, false, move |ops, now| {
                ops.claim(&key, &token, &value, deadline(now, lease), now)
            })
            .await?;
        if found.is_some() {
            recent.note(store_key);
        }
        Ok(found)
    }

    async fn renew(
        &self,
        key: &StoreKey,
        held: &Held,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let key = key.text();
        let token = token("renew", held)?;
        if held.resolvable().is_some() {
            return Ok(self
                .inner
                .writer
                .submit("renew", None, false, move |ops, now| {
                    ops.renew_resolvable(&key, &token, lease, None, now)
                })
                .await?
                .is_some());
        }
        self.inner
            .writer
            .submit("renew", None, false, move |ops, now| {
                ops.renew(&key, &token, deadline(now, lease), now)
            })
            .await
    }

    async fn save(
        &self,
        key: &StoreKey,
        held: &Held,
        done: Bytes,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let store_key = key;
        let key = key.text();
        let token = token("complete", held)?;
        if held.resolvable().is_some() {
            return self
                .inner
                .writer
                .submit("complete", Some(key.clone()), false, move |ops, now| {
                    ops.save_resolvable(&key, &token, &done, deadline(now, ttl), now)
                })
                .await;
        }
        let landed = self
            .inner
            .writer
            .submit("complete", Some(key.clone()), false, move |ops, now| {
                ops.save(&key, &token, &done, deadline(now, ttl), now)
            })
            .await?;
        if landed {
            self.inner.recent.note(store_key);
        }
        Ok(landed)
    }

    async fn release(&self, key: &StoreKey, held: &Held) -> Result<bool, StoreError> {
        let key = key.text();
        let token = token("release", held)?;
        if held.resolvable().is_some() {
            return self
                .inner
                .writer
                .submit("release", Some(key.clone()), false, move |ops, now| {
                    ops.release_resolvable(&key, &token, now)
                })
                .await;
        }
        self.inner
            .writer
            .submit("release", Some(key.clone()), false, move |ops, now| {
                ops.release(&key, &token, now)
            })
            .await
    }

    async fn get(&self, key: &StoreKey) -> Result<Option<Bytes>, StoreError> {
        Ok(self.inner.live("get", key.text()).await?.map(|r| r.value))
    }

    async fn claim_resolvable(
        &self,
        key: &StoreKey,
        held: &Held,
        times: ResolvableTimes,
    ) -> Result<ResolvableFound, StoreError> {
        let key = key.text();
        let token = token("claim", held)?;
        let value = held.encoded.clone();
        // Always on the writer: a live record may be a claim to take over, which is a write.
        self.inner
            .writer
            .submit("claim", None, false, move |ops, now| {
                ops.claim_resolvable(&key, &token, &value, times, now)
            })
            .await
    }

    async fn resolving(
        &self,
        key: &StoreKey,
        held: &Held,
        next_lookup_in: Duration,
        lease: Duration,
    ) -> Result<Option<u64>, StoreError> {
        let key = key.text();
        let token = token("renew", held)?;
        self.inner
            .writer
            .submit("renew", None, false, move |ops, now| {
                ops.renew_resolvable(&key, &token, lease, Some(next_lookup_in), now)
            })
            .await
    }

    async fn now(&self, _key: &StoreKey) -> Result<u64, StoreError> {
        Ok(u64::try_from(self.inner.clock.now_ms()).unwrap_or(0))
    }

    async fn wait_change(&self, key: &StoreKey, max: Duration) {
        let key = key.text();
        // Bounded by `max` as a whole: the reads too (this call has no deadline of its own).
        let _ = tokio::time::timeout(max, async {
            let in_flight = |row: &Row| record::is_in_flight(&row.value);
            let Ok(Some(row)) = self.inner.live("get", key.clone()).await else {
                return;
            };
            if !in_flight(&row) {
                return;
            }
            let waiting = self.inner.waiters.join(&key);
            let notified = waiting.notify().notified();
            tokio::pin!(notified);
            // Registered before the second look, so a wake between the look and the await is
            // not lost: the writer wakes only after the commit the second look would see.
            notified.as_mut().enable();
            let Ok(Some(row)) = self.inner.live("get", key.clone()).await else {
                return;
            };
            if !in_flight(&row) {
                return;
            }
            // Also wake when the lease would lapse: a dead holder never completes.
            // A resolvable claim's lease is inside it; its row lives longer.
            let lease_end = record::resolvable::lease_until(&row.value)
                .map_or(row.expires_at, |l| i64::try_from(l).unwrap_or(i64::MAX));
            let lease_left = remaining(lease_end, self.inner.clock.now_ms());
            let _ = tokio::time::timeout(lease_left + Duration::from_millis(1), notified).await;
        })
        .await;
    }

    async fn ping(&self) -> Result<(), StoreError> {
        // The writer answers (a transaction begun and committed: the write lock can be had),
        // and a read connection reads.
        self.inner
            .writer
            .submit("ping", None, false, |_, _| Ok(()))
            .await?;
        self.inner
            .readers
            .read("ping", |reads, _| reads.version())
            .await?;
        Ok(())
    }

    async fn inspect(&self, key: &StoreKey) -> Result<Option<(Bytes, Duration)>, StoreError> {
        let key = key.text();
        self.inner
            .readers
            .read("inspect", move |reads, now| {
                Ok(reads
                    .live(&key, now)?
                    .map(|row| (row.value, remaining(row.expires_at, now))))
            })
            .await
    }

    async fn forget(&self, key: &StoreKey) -> Result<Forgotten, StoreError> {
        let key = key.text();
        self.inner
            .writer
            .submit("forget", None, false, move |ops, now| ops.forget(&key, now))
            .await
    }
}

#[cfg(test)]
#[allow(
    clippy::disallowed_methods,
    reason = "the tests time their own waits on the host's clock"
)]
mod tests;
