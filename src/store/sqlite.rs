//! The SQLite store: one proxy process per file, records that survive a restart of the proxy.
//!
//! (Being written: see the store contract in `store/mod.rs`.)

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use super::{Forgotten, Held, Store, StoreError, StoreKey};
use crate::config::SqliteSync;
use crate::metrics::Metrics;

/// Records in an SQLite file.
pub struct SqliteStore {}

impl SqliteStore {
    /// Opens (creating if missing) the database at `path`, locks it against a second process,
    /// and starts the writer thread and the sweep.
    pub fn open(
        path: &Path,
        sync: SqliteSync,
        sweep_interval: Duration,
        metrics: Arc<Metrics>,
    ) -> Result<SqliteStore, StoreError> {
        let _ = (path, sync, sweep_interval, metrics);
        Err(StoreError::Backend {
            op: "open",
            source: "the sqlite store is not built yet".into(),
        })
    }
}

#[async_trait]
impl Store for SqliteStore {
    async fn claim(
        &self,
        _key: &StoreKey,
        _held: &Held,
        _lease: Duration,
    ) -> Result<Option<Bytes>, StoreError> {
        unimplemented!()
    }
    async fn renew(
        &self,
        _key: &StoreKey,
        _held: &Held,
        _lease: Duration,
    ) -> Result<bool, StoreError> {
        unimplemented!()
    }
    async fn complete(
        &self,
        _key: &StoreKey,
        _held: &Held,
        _done: Bytes,
        _ttl: Duration,
    ) -> Result<bool, StoreError> {
        unimplemented!()
    }
    async fn release(&self, _key: &StoreKey, _held: &Held) -> Result<bool, StoreError> {
        unimplemented!()
    }
    async fn get(&self, _key: &StoreKey) -> Result<Option<Bytes>, StoreError> {
        unimplemented!()
    }
    async fn ping(&self) -> Result<(), StoreError> {
        unimplemented!()
    }
    async fn inspect(&self, _key: &StoreKey) -> Result<Option<(Bytes, Duration)>, StoreError> {
        unimplemented!()
    }
    async fn forget(&self, _key: &StoreKey) -> Result<Forgotten, StoreError> {
        unimplemented!()
    }
}
