//! The PostgreSQL store: many proxy instances sharing one database.
//!
//! (Being written: see the store contract in `store/mod.rs`.)

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use super::{Forgotten, Held, Store, StoreError, StoreKey};
use crate::config::PostgresSettings;
use crate::metrics::Metrics;

/// Records in a PostgreSQL table.
pub struct PostgresStore {}

impl PostgresStore {
    /// Builds the pool, creates the schema and table if missing (when the database answers),
    /// and starts the sweep.
    pub async fn connect(
        settings: &PostgresSettings,
        timeout: Duration,
        metrics: Arc<Metrics>,
    ) -> Result<PostgresStore, StoreError> {
        let _ = (settings, timeout, metrics);
        Err(StoreError::Backend {
            op: "open",
            source: "the postgres store is not built yet".into(),
        })
    }
}

#[async_trait]
impl Store for PostgresStore {
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
