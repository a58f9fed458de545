//! The store each worker uses.
//!
//! - **Shared by every worker** — `memory` and `sqlite`: one process's records must be in one
//!   place (two memory stores would be two sets of claims, and a key claimed on one worker
//!   would be free on the other), and the SQLite file takes one writer. Built once, on the
//!   runtime `run` is called on (the memory store's sweeper and the SQLite sweep run there;
//!   the SQLite writer and readers are threads of their own); every worker holds the same `Arc`.
//! - **One a worker** — `redis`, `redis-cluster`, `postgres`: connections whose tasks run on the
//!   runtime that opened them. Each worker opens its own on its own runtime, so no request hops
//!   to another thread to reach the database, and atomicity is the database's as between
//!   instances (several workers are several clients of one Redis or PostgreSQL, as several
//!   instances are). Redis: one multiplexed connection a worker (a cluster: one a node a
//!   worker). PostgreSQL: `pool_size` is the instance's, split between the workers
//!   ([`pool_share`]); only worker 0 sweeps, and only worker 0 checks Redis's eviction policy.

use std::sync::Arc;
use std::time::Duration;

use super::error::RunError;
use crate::config::{BackendSettings, Config};
use crate::metrics::Metrics;
use crate::store::memory::MemoryStore;
use crate::store::postgres::PostgresStore;
use crate::store::redis::RedisStore;
use crate::store::sqlite::SqliteStore;
use crate::store::{Store, StoreHandle};

/// Builds the store the configuration names, for a proxy of one worker. With Redis, checks
/// every server's eviction policy in the background (it must not delay start, and Redis may
/// be down).
pub async fn build_store(config: &Config, metrics: Arc<Metrics>) -> Result<StoreHandle, RunError> {
    let backend = open(config, metrics.clone(), 0, 1).await?;
    Ok(StoreHandle::new(backend, config.store.timeout, metrics))
}

/// Whether every worker shares one store of this backend (memory, SQLite) rather than each
/// opening its own.
pub(super) fn is_shared(backend: &BackendSettings) -> bool {
    matches!(
        backend,
        BackendSettings::Memory { .. } | BackendSettings::Sqlite { .. }
    )
}

/// Opens the store, on the runtime this runs on, as worker `worker` of `workers` would have it:
/// a shared backend whole (the caller opens it once), or worker `worker`'s own connections.
pub(super) async fn open(
    config: &Config,
    metrics: Arc<Metrics>,
    worker: usize,
    workers: usize,
) -> Result<Arc<dyn Store>, RunError> {
    let s = &config.store;
    let check_timeout = s.timeout.max(Duration::from_secs(2));
    let first = worker == 0;
    let store: Arc<dyn Store> = match &s.backend {
        BackendSettings::Memory { max_entries } => {
            Arc::new(MemoryStore::open(*max_entries, &metrics))
        }
        BackendSettings::Sqlite {
            path,
            sync,
            sweep_interval,
        } => Arc::new(SqliteStore::open(path, *sync, *sweep_interval, metrics)?),
        BackendSettings::Redis {
            url,
            access,
            wait_replicas,
        } => {
            let redis = Arc::new(RedisStore::connect(
                url,
                access,
                *wait_replicas,
                s.timeout,
                metrics,
            )?);
            if first {
                let check = redis.clone();
                tokio::spawn(async move { check.check_server(check_timeout).await });
            }
            redis
        }
        BackendSettings::RedisCluster { nodes, access } => {
            let redis = Arc::new(RedisStore::cluster(nodes, access, s.timeout, &metrics)?);
            if first {
                let check = redis.clone();
                tokio::spawn(async move { check.check_server(check_timeout).await });
            }
            redis
        }
        BackendSettings::Postgres(settings) => {
            let mut mine = settings.clone();
            mine.pool_size = pool_share(settings.pool_size, workers, worker);
            Arc::new(PostgresStore::connect_worker(&mine, s.timeout, metrics, first).await?)
        }
    };
    Ok(store)
}

/// Starts opening a worker's own connections now, in the background on this runtime, rather
/// than at its first request: the Redis clients connect lazily, and a request that found no
/// connection would pay the connect inside its `store.timeout`. Not counted as an operation: a
/// store down at start is nobody's failed request.
pub(super) fn warm(store: &Arc<dyn Store>, timeout: Duration) {
    let store = store.clone();
    tokio::spawn(async move {
        let _ = tokio::time::timeout(timeout, store.ping()).await;
    });
}

/// Worker `worker`'s share of `pool_size` connections among `workers`: as even as can be, the
/// first workers taking one more each when it does not divide, so the shares add up to
/// `pool_size` exactly — except that every worker gets at least one (with fewer connections
/// than workers, the instance opens one a worker: `workers` in all).
pub(super) fn pool_share(pool_size: u32, workers: usize, worker: usize) -> u32 {
    let workers = u32::try_from(workers.max(1)).unwrap_or(u32::MAX);
    let worker = u32::try_from(worker).unwrap_or(u32::MAX);
    let extra = u32::from(worker < pool_size % workers);
    (pool_size / workers + extra).max(1)
}

#[cfg(test)]
mod tests {
    use super::pool_share;

    #[test]
    fn pool_shares_add_up_to_the_pool_size_and_never_fall_to_zero() {
        for (pool, workers) in [(16, 1), (16, 2), (16, 3), (7, 4), (1000, 256), (4, 4)] {
            let shares: Vec<u32> = (0..workers).map(|w| pool_share(pool, workers, w)).collect();
            assert_eq!(
                shares.iter().sum::<u32>(),
                pool,
                "{pool} over {workers}: {shares:?}"
            );
            let (min, max) = (shares.iter().min(), shares.iter().max());
            assert!(max.zip(min).is_some_and(|(a, b)| a - b <= 1), "{shares:?}");
        }
        assert_eq!(pool_share(16, 2, 0), 8);
        // Fewer connections than workers: one each.
        let shares: Vec<u32> = (0..4).map(|w| pool_share(2, 4, w)).collect();
        assert_eq!(shares, [1, 1, 1, 1]);
    }
}
