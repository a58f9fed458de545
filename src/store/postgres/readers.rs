//! The reads of likely repeats (`store/recent.rs`), pipelined on one connection a worker.
//!
//! A repeat of a finished key costs a primary-key read. On a pooled connection each read holds
//! a session for its round trip, so under load the server runs as many backends as the pool
//! has connections, each woken for one read: on few cores, switching between them costs more
//! than the reads. tokio-postgres pipelines the queries of every task that shares one client,
//! so here one connection carries every concurrent read of a worker: each time the worker's
//! tasks have run, the reads they asked for go out in one write and one backend answers them
//! back to back. One connection, not several: the reads of one pass of the worker split over
//! several connections would take a write and a backend's wake-up each (measured: two readers a
//! worker served a tenth fewer repeats than one, at more of the server's CPU a read), and one
//! backend answers primary-key reads faster than one worker can ask for them.
//!
//! Why reads only: a read takes no lock and leaves nothing in its session, so one given up on
//! (its future dropped at `store.timeout`) poisons nothing — its connection drops the answer
//! when it comes — and there is never a statement to cancel on a shared backend, which would
//! cancel other requests' statements. A read that failed or was given up on retires its reader
//! all the same (a server that stopped answering, a network that dropped the connection
//! silently): no read goes to it any more, its connection closes once the reads on it now are
//! answered, and a new one is opened in the background. A read is only a hint: while the worker
//! has no reader, or when its read failed, the claim goes on without it.
//!
//! The reader counts in `pool_size` (SPEC §4.6: the most sessions an instance opens) and in
//! `idemproxy_postgres_pool_connections`: a worker whose share of `pool_size` is at least
//! [`SHARE_FOR_READER`] gives one connection of it to its reader, taken from its pool.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use tokio::time::Instant;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Statement};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::error::describe;
use super::warm::OPEN_WITHIN;
use crate::metrics::GaugePart;

/// A worker's share of `pool_size` of at least this many connections gives one of them to its
/// reader; a smaller share keeps every read on the pool.
pub(super) const SHARE_FOR_READER: u32 = 8;

/// After a reader could not be opened, the worker goes without one for this long: a database
/// that is down is not asked for a connection by every repeat.
const REOPEN_AFTER: Duration = Duration::from_secs(1);

/// The shared read connection of one worker's store, if its share of `pool_size` has one.
pub(super) struct Readers {
    slot: Option<Arc<Slot>>,
    opener: Arc<Opener>,
}

struct Slot {
    reader: ArcSwapOption<Reader>,
    /// Set while the reader is being opened: one open at a time.
    opening: AtomicBool,
    /// When the last open failed.
    failed: Mutex<Option<Instant>>,
    /// The reader's connections still open: a retired reader's stays open until its reads are
    /// answered or given up on, and no replacement is opened before it closes, so the
    /// instance's sessions never outnumber `pool_size`.
    sessions: AtomicUsize,
}

struct Reader {
    client: Client,
    get: Statement,
}

/// What opening a reader takes, and the count of open ones the connection gauge shows.
struct Opener {
    config: tokio_postgres::Config,
    tls: MakeRustlsConnect,
    /// The primary-key read (`sql.rs`'s `get`).
    get: String,
    count: AtomicI64,
    gauge: GaugePart,
}

impl Readers {
    /// A reader (opened on first use) with `config` and `tls`, reading with `get`, if `count`
    /// (what [`Readers::for_share`] gave) is one; none if it is zero.
    pub(super) fn new(
        config: tokio_postgres::Config,
        tls: MakeRustlsConnect,
        get: String,
        count: u32,
        gauge: GaugePart,
    ) -> Readers {
        let slot = (count > 0).then(|| {
            Arc::new(Slot {
                reader: ArcSwapOption::empty(),
                opening: AtomicBool::new(false),
                failed: Mutex::new(None),
                sessions: AtomicUsize::new(0),
            })
        });
        Readers {
            slot,
            opener: Arc::new(Opener {
                config,
                tls,
                get,
                count: AtomicI64::new(0),
                gauge,
            }),
        }
    }

    /// How many readers (one or none) for a worker whose share of `pool_size` is `share`.
    pub(super) fn for_share(share: u32) -> u32 {
        u32::from(share >= SHARE_FOR_READER)
    }

    /// Whether this worker has a reader (its share of `pool_size` is large enough).
    pub(super) fn any(&self) -> bool {
        self.slot.is_some()
    }

    /// Reads `key`'s row on a shared connection: its encoded record, or `None` when it has no
    /// live row or the read had no answer (no reader now, or the read failed) — the claim
    /// decides then, as without the read.
    pub(super) async fn read(&self, key: &str) -> Option<Vec<u8>> {
        let slot = self.slot.as_ref()?;
        let Some(reader) = slot
            .reader
            .load_full()
            .filter(|reader| !reader.client.is_closed())
        else {
            self.open_in_background(slot);
            return None;
        };
        // Retires the reader unless the read finished (given up on at `store.timeout`, the
        // future is dropped here).
        let mut pending = Pending {
            slot,
            reader: &reader,
            finished: false,
        };
        let params: [&(dyn ToSql + Sync); 1] = [&key];
        let read = reader.client.query(&reader.get, &params).await;
        let read = read.and_then(|rows| match rows.first() {
            None => Ok(None),
            Some(row) => row.try_get::<_, Vec<u8>>(0).map(Some),
        });
        match read {
            Ok(found) => {
                pending.finished = true;
                found
            }
            Err(e) => {
                tracing::debug!(error = %describe(&e), "postgres: a shared read failed; its connection is retired and the claim goes on without it");
                None
            }
        }
    }

    /// Opens the reader again, in the background, if the server ended its connection (a
    /// restart, a failover), so that the next repeats find one: called by the warmer. A reader
    /// never opened stays so until a repeat needs it.
    pub(super) fn reopen_closed(&self) {
        if let Some(slot) = &self.slot {
            let closed = slot
                .reader
                .load()
                .as_ref()
                .is_some_and(|reader| reader.client.is_closed());
            if closed {
                slot.reader.store(None);
                self.open_in_background(slot);
            }
        }
    }

    /// Opens the reader in a task of its own, unless one is being opened, the retired
    /// one's connection is still open, or the last attempt failed moments ago: no request waits
    /// for a connection to open.
    fn open_in_background(&self, slot: &Arc<Slot>) {
        if slot.sessions.load(Ordering::Acquire) > 0 || slot.opening.swap(true, Ordering::AcqRel) {
            return;
        }
        let failed_lately = slot
            .failed
            .lock()
            .map(|at| at.is_some_and(|at| at.elapsed() < REOPEN_AFTER))
            .unwrap_or(false);
        if failed_lately {
            slot.opening.store(false, Ordering::Release);
            return;
        }
        let (slot, opener) = (Arc::clone(slot), Arc::clone(&self.opener));
        tokio::spawn(async move {
            let opened = tokio::time::timeout(OPEN_WITHIN, opener.open(&slot)).await;
            let failed = match opened {
                Ok(Ok(reader)) => {
                    slot.reader.store(Some(Arc::new(reader)));
                    None
                }
                Ok(Err(e)) => Some(describe(&e)),
                Err(_) => Some(format!("not open within {OPEN_WITHIN:?}")),
            };
            if let Some(why) = &failed {
                tracing::debug!(error = %why, "postgres: a connection for shared reads could not be opened; likely repeats go straight to the claim meanwhile");
            }
            if let Ok(mut at) = slot.failed.lock() {
                *at = failed.map(|_| Instant::now());
            }
            slot.opening.store(false, Ordering::Release);
        });
    }
}

impl Opener {
    /// A new connection, counted while it is open, with the read prepared on it.
    async fn open(self: &Arc<Self>, slot: &Arc<Slot>) -> Result<Reader, tokio_postgres::Error> {
        let (client, connection) = self.config.connect(self.tls.clone()).await?;
        self.changed(1);
        slot.sessions.fetch_add(1, Ordering::AcqRel);
        let (opener, slot) = (Arc::clone(self), Arc::clone(slot));
        tokio::spawn(async move {
            // Ends when the server closes the session, or once the client is dropped (the
            // reader retired and its reads answered).
            if let Err(e) = connection.await {
                tracing::debug!(error = %describe(&e), "postgres: a shared read connection ended");
            }
            slot.sessions.fetch_sub(1, Ordering::AcqRel);
            opener.changed(-1);
        });
        let get = client.prepare(&self.get).await?;
        Ok(Reader { client, get })
    }

    fn changed(&self, by: i64) {
        let now = self.count.fetch_add(by, Ordering::AcqRel) + by;
        self.gauge.set(now);
    }
}

/// A read on a reader: unless it finished, the reader is retired when this is dropped.
struct Pending<'a> {
    slot: &'a Slot,
    reader: &'a Arc<Reader>,
    finished: bool,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if !self.finished {
            // Unless another read already replaced it.
            self.slot
                .reader
                .compare_and_swap(self.reader, None::<Arc<Reader>>);
        }
    }
}
