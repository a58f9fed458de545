//! What every exchange shares with the proxy, in a module of its own: the exchange, the
//! settlement of its end and the observed flow all use it, and none of them owns it.

use std::sync::Arc;

use tokio_util::task::TaskTracker;

use super::pending::PendingCompletions;
use crate::store::StoreHandle;

/// What every exchange shares with the proxy: the store, the tracker of the background tasks
/// (detached exchanges, completions) that shutdown waits for, and the completions being retried.
pub(super) struct Shared {
    pub store: StoreHandle,
    pub tasks: TaskTracker,
    pub pending: Arc<PendingCompletions>,
}
