//! The PostgreSQL store: many proxy instances sharing one database, records that survive a
//! restart or a crash of the proxy and of the database.
//!
//! # Layout
//! One row per key in `<schema>.records` (`store.schema`, default `idemproxy`):
//! ```text
//! records(key text PRIMARY KEY,        -- StoreKey::text()
//!         token bytea,                  -- the claim's 16-byte fencing token; NULL once finished
//!         value bytea NOT NULL,         -- the encoded record, in flight or finished
//!         expires_at timestamptz NOT NULL,
//!         times bytea)                  -- a resolvable claim's times as renewals wrote them
//! index records_expires_at ON records (expires_at)
//! schema_version(version integer NOT NULL)   -- its highest row: 2 (1 during an upgrade)
//! ```
//!
//! # Design
//! - **One statement per operation, autocommitted** (`postgres/sql.rs` has each one and what it
//!   does in every interleaving). A claim is one round trip that reads the key's row by its
//!   primary key and, in the same statement, inserts the key or takes over a lapsed row: never a
//!   read and then a write in another statement. On the replay path it only reads (its writers
//!   are skipped), so it writes no WAL, waits for no flush and costs about one primary-key read.
//!   A claim that met another session's claim of the key while it was committing finds no row
//!   and runs again, at most `CLAIM_ATTEMPTS` times. A key this store lately finished or found
//!   taken (`store/recent.rs`) is read first with `get`, the cost of a primary-key read: a
//!   finished record found is the answer, anything else falls through to the claim. Those
//!   reads run pipelined on one connection a worker shared by all its requests
//!   (`postgres/readers.rs`), not on the pool.
//! - **Leases run on the server's clock** (`now()`): instances need not agree on the time.
//! - **Fencing**: renew, save and release change a row only where `token` is the caller's and
//!   the lease is live, so a holder whose lease lapsed can never overwrite a newer holder.
//!   `save` clears the token: a finished record matches no claim.
//! - **Connections** (`postgres/pool.rs`): a deadpool pool of at most `store.pool_size` (less
//!   the shared reader's: one a worker whose share is eight or more), every wait for a
//!   connection and every connect bounded by `store.timeout`, every statement prepared on a
//!   connection's first use. A connection whose call did not finish (it failed, or `StoreHandle`
//!   dropped it at `store.timeout`) has its statement cancelled and goes back to the pool only
//!   once its session is seen idle within `store.timeout`, else it is closed; meanwhile it still
//!   counts in the pool, so the sessions of an instance never outnumber `pool_size`, even while
//!   an outside transaction holds a row its statements wait on. A SIGSTOPped database gives 503s
//!   in bounded time, and once it runs again no request meets a connection still stuck.
//! - **Schema** (`postgres/schema.rs`): set up in one transaction under an advisory lock, before
//!   the first operation that reaches the database: at start when it answers, else by the first
//!   operation after it comes back (a once-guard; the proxy starts and answers 503 meanwhile). A
//!   schema of a newer version refuses the start, or fails every operation if found later.
//! - **Warmer** (`postgres/warm.rs`): connections opened ahead of requests, with ten seconds
//!   to open, and every statement prepared on them, so that a database whose round trips are
//!   long still serves requests after every pooled connection was lost.
//! - **Sweep** (`postgres/sweep.rs`): expired rows deleted in small batches every `sweep_interval`,
//!   by every instance, skipping rows that claims hold locked.
//! - **TLS** (`postgres/secured.rs`): rustls, the roots of `store.ca_file` or the Mozilla set,
//!   when the URL's `sslmode` asks for it.

mod claim;
mod error;
mod pool;
mod readers;
mod resolvable;
mod schema;
mod secured;
mod sql;
mod sweep;
mod tooling;
mod warm;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::future::try_join_all;
use tokio::sync::OnceCell;
use tokio_postgres::Row;
use tokio_postgres::types::ToSql;

pub use self::pool::PostgresSeries;
use super::{
    Forgotten, Held, ResolvableFound, ResolvableTimes, Store, StoreError, StoreKey, SweptSeries,
};
use crate::config::PostgresSettings;
use crate::metrics::{GaugePart, Metrics};
use error::{backend, pg};
use pool::Connections;
use readers::Readers;
use resolvable::returned_now;
use sql::Statements;

use super::recent::RecentKeys;

/// How many times a claim runs its statement when it finds no row: each time, another
/// session changed the key's row while the statement ran (see `sql.rs`): its claim was
/// committing, it took a lapsed row over, or the sweep deleted that row. The next run's
/// snapshot sees the change; several in a row take a storm of claims on one key that keep
/// releasing and taking it again.
const CLAIM_ATTEMPTS: usize = 5;

/// The longest lease or ttl written, in milliseconds (about 100 years): "forever", and far from
/// where `now() + interval` leaves the range of a timestamp.
const MAX_MILLIS: i64 = 100 * 365 * 24 * 60 * 60 * 1000;

/// How long the start waits for the schema setup at least (`store.timeout` if longer): the
/// setup may wait for another instance's setup to commit.
const START_SETUP: Duration = Duration::from_secs(2);

/// Records in a PostgreSQL table.
pub struct PostgresStore {
    inner: Arc<Inner>,
}

/// What the store and its sweep share.
struct Inner {
    connections: Connections,
    /// The reads of likely repeats, pipelined on connections of their own.
    readers: Readers,
    sql: Statements,
    schema: String,
    /// Set once the setup reached the database and concluded; a setup that could not reach it
    /// leaves it unset, for the next operation to try again.
    ready: OnceCell<schema::Outcome>,
    timeout: Duration,
    swept: SweptSeries,
    /// Keys whose next claim reads first (see [`RecentKeys`]).
    recent: RecentKeys,
}

impl PostgresStore {
    /// Builds the pool, creates the schema and table if missing (when the database answers),
    /// and starts the sweep. Fails on settings that cannot work (TLS roots) and on a schema of a
    /// newer version; a database that does not answer is not an error: the proxy starts, and
    /// the setup runs before the first operation that reaches it.
    pub async fn connect(
        settings: &PostgresSettings,
        timeout: Duration,
        metrics: Arc<Metrics>,
    ) -> Result<PostgresStore, StoreError> {
        PostgresStore::connect_worker(settings, timeout, metrics, true).await
    }

    /// [`PostgresStore::connect`] for one worker of several: its pool holds at most
    /// `settings.pool_size` connections (the worker's share), and it runs the sweep only if
    /// `sweeps` — one sweep a process is enough (several instances already sweep side by side,
    /// `SKIP LOCKED` splitting the rows), more would only cost round trips.
    pub async fn connect_worker(
        settings: &PostgresSettings,
        timeout: Duration,
        metrics: Arc<Metrics>,
        sweeps: bool,
    ) -> Result<PostgresStore, StoreError> {
        let shared_readers = Readers::for_share(settings.pool_size);
        let (pool, tls) = pool::build(settings, settings.pool_size - shared_readers, timeout)?;
        let sql = Statements::new(&settings.schema);
        let statements = sql.all().into_iter().map(str::to_owned).collect();
        let series: PostgresSeries = metrics.store_series();
        let readers = Readers::new(
            pool::pg_config(settings, timeout),
            tls.clone(),
            sql.get.clone(),
            shared_readers,
            GaugePart::of(&series.connections),
        );
        let inner = Arc::new(Inner {
            connections: Connections::new(pool, tls, statements, timeout, &metrics),
            readers,
            sql,
            schema: settings.schema.clone(),
            ready: OnceCell::new(),
            timeout,
            swept: metrics.store_series(),
            recent: RecentKeys::new(),
        });
        let bound = timeout.max(START_SETUP);
        match tokio::time::timeout(bound, inner.ready("open")).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) if inner.refused() => return Err(e),
            Ok(Err(e)) => tracing::warn!(
                schema = %settings.schema,
                error = %e,
                "PostgreSQL cannot set up the schema now: starting anyway (the store answers 503 until it can); the first operation that reaches the database sets it up"
            ),
            Err(_) => tracing::warn!(
                schema = %settings.schema,
                after = ?bound,
                "PostgreSQL did not answer at start: starting anyway (the store answers 503 until it does); the first operation that reaches the database sets the schema up"
            ),
        }
        if sweeps {
            sweep::spawn(Arc::downgrade(&inner), settings.sweep_interval);
        }
        warm::spawn(Arc::downgrade(&inner));
        Ok(PostgresStore { inner })
    }
}

/// `idemproxy store upgrade` on PostgreSQL: records schema version 2 (see `schema.rs`), once
/// every instance runs a proxy that knows it. What it found and did, in a sentence; `Err` with
/// why it could not (the database unreachable, a schema of another version, no privilege).
pub async fn upgrade(settings: &PostgresSettings, timeout: Duration) -> Result<String, String> {
    let (pool, tls) =
        pool::build(settings, settings.pool_size, timeout).map_err(|e| e.to_string())?;
    let connections = Connections::new(pool, tls, Vec::new(), timeout, &Metrics::new());
    match schema::upgrade(&connections, &settings.schema).await {
        Ok(Ok(said)) => Ok(said),
        Ok(Err(refused)) => Err(refused),
        Err(e) => Err(e.to_string()),
    }
}

impl Inner {
    /// Sets the schema up if no operation has yet (every caller waits for the one running it),
    /// then answers for `op`: ready, or the refusal the setup concluded.
    async fn ready(&self, op: &'static str) -> Result<(), StoreError> {
        let outcome = self
            .ready
            .get_or_try_init(|| async {
                let outcome = schema::set_up(&self.connections, &self.schema).await?;
                match &outcome {
                    Ok(()) => tracing::info!(schema = %self.schema, version = schema::VERSION, "PostgreSQL schema ready"),
                    Err(why) => tracing::error!(%why, "PostgreSQL schema refused: every store operation fails"),
                }
                Ok::<_, StoreError>(outcome)
            })
            .await?;
        outcome.clone().map_err(|why| backend(op, why.to_string()))
    }

    /// Whether the setup reached the database and refused the schema.
    fn refused(&self) -> bool {
        self.ready.get().is_some_and(Result::is_err)
    }

    /// `sql` with `params` on a pooled connection, once the schema is ready.
    async fn query(
        &self,
        op: &'static str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, StoreError> {
        self.ready(op).await?;
        let conn = self.connections.get(op).await?;
        let statement = self.statement(&conn, op, sql).await?;
        let rows = conn.query(&statement, params).await.map_err(pg(op))?;
        conn.finished();
        Ok(rows)
    }

    /// [`Inner::query`] for a statement without rows: how many it changed.
    async fn execute(
        &self,
        op: &'static str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, StoreError> {
        self.ready(op).await?;
        let conn = self.connections.get(op).await?;
        let statement = self.statement(&conn, op, sql).await?;
        let changed = conn.execute(&statement, params).await.map_err(pg(op))?;
        conn.finished();
        Ok(changed)
    }

    /// `sql` prepared on `conn`. The first statement a connection runs prepares every one the
    /// store runs, together (pipelined: one round trip, as for one), as the warmer does for the
    /// connections it opens: from then on every operation on it is one round trip. Otherwise an
    /// operation meeting a connection without its statement pays a second round trip inside its
    /// `store.timeout` — on a far database, a lease renewal that lands after the lease.
    async fn statement(
        &self,
        conn: &pool::Conn<'_>,
        op: &'static str,
        sql: &str,
    ) -> Result<tokio_postgres::Statement, StoreError> {
        if conn.statement_cache.size() == 0 {
            try_join_all(
                self.sql
                    .all()
                    .into_iter()
                    .map(|sql| conn.prepare_cached(sql)),
            )
            .await
            .map_err(pg(op))?;
        }
        conn.prepare_cached(sql).await.map_err(pg(op))
    }

    /// One batch of the sweep: how many expired rows it deleted.
    async fn sweep_batch(&self) -> Result<u64, StoreError> {
        self.execute("sweep", &self.sql.sweep, &[&sweep::BATCH])
            .await
    }
}

/// The claim's fencing token.
fn token<'a>(op: &'static str, held: &'a Held) -> Result<&'a [u8], StoreError> {
    match held.record.token() {
        Some(token) => Ok(token),
        None => Err(backend(op, "a claim must hold an in-progress record")),
    }
}

/// Milliseconds for `now() + $n * interval '1 millisecond'`: at least 1, at most [`MAX_MILLIS`].
fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis())
        .unwrap_or(i64::MAX)
        .clamp(1, MAX_MILLIS)
}

#[async_trait]
impl Store for PostgresStore {
    async fn claim(
        &self,
        key: &StoreKey,
        held: &Held,
        lease: Duration,
    ) -> Result<Option<Bytes>, StoreError> {
        self.inner.claim(key, held, lease).await
    }

    async fn renew(
        &self,
        key: &StoreKey,
        held: &Held,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let (key, token, lease) = (key.text(), token("renew", held)?, millis(lease));
        if held.resolvable().is_some() {
            let sql = &self.inner.sql.resolvable.renew;
            let rows = self
                .inner
                .query("renew", sql, &[&key, &token, &lease])
                .await?;
            return Ok(returned_now("renew", &rows)?.is_some());
        }
        let changed = self
            .inner
            .execute("renew", &self.inner.sql.renew, &[&key, &token, &lease])
            .await?;
        Ok(changed == 1)
    }

    async fn save(
        &self,
        key: &StoreKey,
        held: &Held,
        done: Bytes,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        self.inner.save(key, held, done, ttl).await
    }

    async fn release(&self, key: &StoreKey, held: &Held) -> Result<bool, StoreError> {
        self.inner.release(key, held).await
    }

    async fn get(&self, key: &StoreKey) -> Result<Option<Bytes>, StoreError> {
        let key = key.text();
        let rows = self
            .inner
            .query("get", &self.inner.sql.get, &[&key])
            .await?;
        match rows.first() {
            Some(row) => Ok(Some(Bytes::from(
                row.try_get::<_, Vec<u8>>(0).map_err(pg("get"))?,
            ))),
            None => Ok(None),
        }
    }

    async fn claim_resolvable(
        &self,
        key: &StoreKey,
        held: &Held,
        times: ResolvableTimes,
    ) -> Result<ResolvableFound, StoreError> {
        self.inner.claim_resolvable(key, held, times).await
    }

    async fn resolving(
        &self,
        key: &StoreKey,
        held: &Held,
        next_lookup_in: Duration,
        lease: Duration,
    ) -> Result<Option<u64>, StoreError> {
        self.inner.resolving(key, held, next_lookup_in, lease).await
    }

    async fn now(&self, _key: &StoreKey) -> Result<u64, StoreError> {
        self.inner.now().await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.inner
            .query("ping", self.inner.sql.ping, &[])
            .await
            .map(drop)
    }

    async fn inspect(&self, key: &StoreKey) -> Result<Option<(Bytes, Duration)>, StoreError> {
        self.inner.inspect(key).await
    }

    async fn forget(&self, key: &StoreKey) -> Result<Forgotten, StoreError> {
        self.inner.forget(key).await
    }
}

#[cfg(test)]
#[allow(
    clippy::disallowed_methods,
    reason = "the tests time their own waits on the host's clock"
)]
mod tests;
