//! Store errors from tokio-postgres and pool errors, with the whole chain of causes: the
//! top-level `Display` of a tokio-postgres error is only its kind ("db error", "error
//! connecting to server"); the server's message and the OS error are its sources. Neither kind
//! ever carries the password.

use std::error::Error;

use deadpool_postgres::{PoolError, TimeoutType};

use crate::store::StoreError;

/// `error` and every cause under it, joined by `: `.
pub(super) fn describe(error: &(dyn Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(e) = cause {
        let next = e.to_string();
        // Some errors repeat their cause in their own message.
        if !text.ends_with(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        cause = e.source();
    }
    text
}

/// A store error for `op` from tokio-postgres.
pub(super) fn pg(op: &'static str) -> impl FnOnce(tokio_postgres::Error) -> StoreError {
    move |e| backend(op, describe(&e))
}

/// A store error for `op` from the pool: no connection within `store.timeout`, or none could be
/// made.
pub(super) fn pool(op: &'static str) -> impl FnOnce(PoolError) -> StoreError {
    move |e| {
        let why = match e {
            PoolError::Timeout(TimeoutType::Wait) => {
                "no pooled connection came free within store.timeout (store.pool_size)".to_owned()
            }
            PoolError::Timeout(TimeoutType::Create) => {
                "connecting to PostgreSQL took longer than store.timeout".to_owned()
            }
            PoolError::Timeout(TimeoutType::Recycle) => {
                "checking a pooled connection took longer than store.timeout".to_owned()
            }
            PoolError::Backend(e) => describe(&e),
            e => describe(&e),
        };
        backend(op, why)
    }
}

/// A store error for `op` with `why`.
pub(super) fn backend(op: &'static str, why: impl Into<String>) -> StoreError {
    StoreError::Backend {
        op,
        source: why.into().into(),
    }
}
