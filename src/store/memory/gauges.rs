//! The memory store's series: how many records it holds and its bound, read from the store at
//! each scrape.

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use super::Inner;
use crate::metrics::{StoreSeries, encode_one};

/// The memory store's gauges: `idemproxy_memory_store_records` and
/// `idemproxy_memory_store_max_entries`, of the store last opened on the registry (0 before
/// one is, or once it is gone).
#[derive(Clone, Debug, Default)]
pub struct MemorySeries {
    store: Arc<Mutex<Weak<Inner>>>,
}

impl MemorySeries {
    /// Reads `store`'s fill from now on.
    pub(super) fn watch(&self, store: &Arc<Inner>) {
        *self.store.lock().unwrap_or_else(PoisonError::into_inner) = Arc::downgrade(store);
    }
}

impl StoreSeries for MemorySeries {
    fn register(registry: &mut Registry) -> Self {
        let series = MemorySeries::default();
        registry.register_collector(Box::new(series.clone()));
        series
    }
}

impl Collector for MemorySeries {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let store = self
            .store
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .upgrade();
        let (held, max) = store.map_or((0, 0), |s| (s.held.load(Ordering::Acquire), s.max_entries));
        let gauge = |n: u64| ConstGauge::new(i64::try_from(n).unwrap_or(i64::MAX));
        encode_one(
            &mut encoder,
            "idemproxy_memory_store_records",
            "Records the memory store holds (expired ones not yet swept included)",
            &gauge(held),
        )?;
        encode_one(
            &mut encoder,
            "idemproxy_memory_store_max_entries",
            "The memory store's bound (store.max_entries): at it, new claims fail",
            &gauge(max),
        )
    }
}
