//! Each store's own series, exported only by a proxy that uses that store: a memory-store proxy
//! shows no SQLite commit histogram, and a SQLite one no PostgreSQL pool gauges. A store says
//! it is in use ([`StoreSeries::in_use`]) when it is opened (the memory store, at its first
//! scrape); from then on only the series of the stores in use are exported. A registry no
//! store has said so to (one made for a check of the names, say) exports every store's.
//! Names are as they always were.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use super::{OpLabel, StoreOp, latency};

/// A store whose series a proxy exports once it uses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum StoreKind {
    Memory = 1,
    Sqlite = 2,
    Postgres = 4,
    /// One Redis server or a cluster.
    Redis = 8,
}

/// The series of every store, each exported only while its store is in use. A clone shares
/// them.
#[derive(Clone, Debug)]
pub struct StoreSeries {
    /// The [`StoreKind`]s in use, as bits.
    in_use: Arc<AtomicU8>,
    /// Memory: records held.
    pub memory_records: Gauge,
    /// Memory: its bound (`max_entries`).
    pub memory_max_entries: Gauge,
    /// SQLite and PostgreSQL: expired records deleted by the sweep.
    pub swept: Counter,
    /// SQLite: operations committed per transaction of the writer (group commit).
    pub sqlite_batch_size: Histogram,
    /// SQLite: how long each of the writer's commits took.
    pub sqlite_commit_duration: Histogram,
    /// PostgreSQL: connections the pools hold open, every worker's together (each worker
    /// sets its part through a [`super::GaugePart`]).
    pub postgres_pool_connections: Gauge,
    /// PostgreSQL: connections lent out to an operation, every worker's together.
    pub postgres_pool_in_use: Gauge,
    /// PostgreSQL: operations waiting for a connection, every worker's together.
    pub postgres_pool_waiting: Gauge,
    /// Redis: writes (claim, complete) fewer replicas acknowledged than `store.wait_replicas`
    /// asks.
    replica_acks_missing: Family<OpLabel, Counter>,
}

impl StoreSeries {
    /// Makes every store's series and registers them with `registry`, to be exported by the
    /// stores in use.
    pub(super) fn register(registry: &mut Registry) -> StoreSeries {
        let replica_acks_missing = Family::<OpLabel, Counter>::default();
        for op in [StoreOp::Claim, StoreOp::Complete] {
            let _ = replica_acks_missing.get_or_create(&OpLabel { op: op.as_str() });
        }
        let series = StoreSeries {
            in_use: Arc::default(),
            memory_records: Gauge::default(),
            memory_max_entries: Gauge::default(),
            swept: Counter::default(),
            sqlite_batch_size: Histogram::new(exponential_buckets(1.0, 2.0, 11)),
            sqlite_commit_duration: latency(),
            postgres_pool_connections: Gauge::default(),
            postgres_pool_in_use: Gauge::default(),
            postgres_pool_waiting: Gauge::default(),
            replica_acks_missing,
        };
        registry.register_collector(Box::new(series.clone()));
        series
    }

    /// Marks `kind` in use: its series are exported from now on.
    pub fn in_use(&self, kind: StoreKind) {
        self.in_use.fetch_or(kind as u8, Ordering::Relaxed);
    }

    /// Counts a write (claim or complete) fewer replicas acknowledged than
    /// `store.wait_replicas` asks.
    pub(crate) fn replica_acks_missing(&self, op: StoreOp) {
        self.replica_acks_missing
            .get_or_create(&OpLabel { op: op.as_str() })
            .inc();
    }
}

impl Collector for StoreSeries {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let in_use = self.in_use.load(Ordering::Relaxed);
        let uses = |kind: StoreKind| in_use == 0 || in_use & kind as u8 != 0;
        let e = &mut encoder;
        if uses(StoreKind::Memory) {
            one(
                e,
                "idemproxy_memory_store_records",
                "Records the memory store holds (expired ones not yet swept included)",
                &self.memory_records,
            )?;
            one(
                e,
                "idemproxy_memory_store_max_entries",
                "The memory store's bound (store.max_entries): at it, new claims fail",
                &self.memory_max_entries,
            )?;
        }
        if uses(StoreKind::Sqlite) || uses(StoreKind::Postgres) {
            one(
                e,
                "idemproxy_store_swept",
                "Expired records deleted by the background sweep (sqlite, postgres)",
                &self.swept,
            )?;
        }
        if uses(StoreKind::Sqlite) {
            one(
                e,
                "idemproxy_sqlite_batch_size",
                "Store operations committed together in one SQLite transaction (group commit)",
                &self.sqlite_batch_size,
            )?;
            one(
                e,
                "idemproxy_sqlite_commit_duration_seconds",
                "Duration of each SQLite commit of the writer thread",
                &self.sqlite_commit_duration,
            )?;
        }
        if uses(StoreKind::Postgres) {
            self.encode_postgres(e)?;
        }
        if uses(StoreKind::Redis) {
            one(
                e,
                "idemproxy_replica_acks_missing",
                "Claims and saves fewer replicas acknowledged in time than store.wait_replicas asks (a claim is then refused with 503; a save stands)",
                &self.replica_acks_missing,
            )?;
        }
        Ok(())
    }
}

impl StoreSeries {
    fn encode_postgres(&self, e: &mut DescriptorEncoder) -> fmt::Result {
        one(
            e,
            "idemproxy_postgres_pool_connections",
            "PostgreSQL connections the pools hold open, every worker's together (at most store.pool_size, or workers when that is larger)",
            &self.postgres_pool_connections,
        )?;
        one(
            e,
            "idemproxy_postgres_pool_in_use",
            "PostgreSQL connections lent out to a store operation, every worker's together",
            &self.postgres_pool_in_use,
        )?;
        one(
            e,
            "idemproxy_postgres_pool_waiting",
            "Store operations waiting for a PostgreSQL connection, every worker's together",
            &self.postgres_pool_waiting,
        )
    }
}

/// Encodes one series under `name`, as the registry would have.
fn one(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    metric: &impl EncodeMetric,
) -> fmt::Result {
    let metric_encoder = encoder.encode_descriptor(name, help, None, metric.metric_type())?;
    metric.encode(metric_encoder)
}
