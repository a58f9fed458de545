//! The reads of likely repeats (`store/recent.rs`), pipelined on a few connections of their own.
//!
//! A repeat of a finished key costs a primary-key read. On a pooled connection each read holds
//! a session for its round trip, so under load the server runs as many backends as the pool
//! has connections, each woken for one read: on few cores, switching between them costs more
//! than the reads. tokio-postgres pipelines the queries of every task that shares one client,
//! so here a few connections carry every concurrent read, each backend answering a stream of
//! them back to back.
//!
//! Why reads only: a read takes no lock and leaves nothing in its session, so one given up on
//! (its future dropped at `store.timeout`) poisons nothing — its connection drops the answer
//! when it comes — and there is never a statement to cancel on a shared backend, which would
//! cancel other requests' statements. A read that failed or was given up on retires its reader
//! all the same (a server that stopped answering, a network that dropped the connection
//! silently): no read goes to it any more, its connection closes once the reads on it now are
//! answered, and a new one is opened in the background. A read is only a hint: while a slot has
//! no reader, or when its read failed, the claim goes on without it.
//!
//! The readers count in `pool_size` (SPEC §4.6: the most sessions an instance opens) and in
//! `idemproxy_postgres_pool_connections`: a worker's share of `pool_size` gives one connection
//! in [`SHARE_PER_READER`] to the readers, taken from its pool.

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

/// A worker's share of `pool_size` gives one connection in this many to the readers; a share
/// smaller than this keeps every read on the pool.
pub(super) const SHARE_PER_READER: u32 = 8;

/// After a reader could not be opened, its slot goes without one for this long: a database
/// that is down is not asked for a connection by every repeat.
const REOPEN_AFTER: Duration = Duration::from_secs(1);

/// The shared connections of one worker's store.
pub(super) struct Readers {
    slots: Box<[Arc<Slot>]>,
    /// The slot the next read goes to, round robin.
    next: AtomicUsize,
    opener: Arc<Opener>,
}

struct Slot {
    reader: ArcSwapOption<Reader>,
    /// Set while the slot's reader is being opened: one open a slot at a time.
    opening: AtomicBool,
    /// When the slot's last open failed.
    failed: Mutex<Option<Instant>>,
    /// The slot's connections still open: a retired reader's stays open until its reads are
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
    /// `count` readers (opened on first use) with `config` and `tls`, reading with `get`.
    pub(super) fn new(
        config: tokio_postgres::Config,
        tls: MakeRustlsConnect,
        get: String,
        count: usize,
        gauge: GaugePart,
    ) -> Readers {
        let slots = (0..count)
            .map(|_| {
                Arc::new(Slot {
                    reader: ArcSwapOption::empty(),
                    opening: AtomicBool::new(false),
                    failed: Mutex::new(None),
                    sessions: AtomicUsize::new(0),
                })
            })
            .collect();
        Readers {
            slots,
            next: AtomicUsize::new(0),
            opener: Arc::new(Opener {
                config,
                tls,
                get,
                count: AtomicI64::new(0),
                gauge,
            }),
        }
    }

    /// How many readers for a worker whose share of `pool_size` is `share`.
    pub(super) fn for_share(share: u32) -> u32 {
        share / SHARE_PER_READER
    }

    /// Whether this worker has readers (its share of `pool_size` is large enough).
    pub(super) fn any(&self) -> bool {
        !self.slots.is_empty()
    }

    /// Reads `key`'s row on a shared connection: its encoded record, or `None` when it has no
    /// live row or the read had no answer (no reader now, or the read failed) — the claim
    /// decides then, as without the read.
    pub(super) async fn read(&self, key: &str) -> Option<Vec<u8>> {
        let n = self.slots.len();
        if n == 0 {
            return None;
        }
        let slot = &self.slots[self.next.fetch_add(1, Ordering::Relaxed) % n];
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

    /// Opens again, in the background, the readers whose connection the server ended (a
    /// restart, a failover), so that the next repeats find one: called by the warmer. A slot
    /// never opened stays so until a repeat needs it.
    pub(super) fn reopen_closed(&self) {
        for slot in &self.slots {
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

    /// Opens `slot`'s reader in a task of its own, unless one is being opened, the retired
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
