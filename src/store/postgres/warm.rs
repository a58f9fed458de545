//! The warmer: opens connections ahead of the requests, with time to finish, and prepares
//! every statement on them before they serve one.
//!
//! Why: a request that finds no idle connection opens one inside its own `store.timeout`, and
//! a fresh connection costs round trips before its first statement runs (TCP, the start-up and
//! authentication, TLS, then a `prepare` per statement). On a database far away or slow to
//! answer (a round trip of 100 ms, say, with the default 300 ms timeout) that never fits: the
//! request gives up, its half-made connection is closed, and once every pooled connection has
//! been lost (a failover, a reset network, a stall whose calls timed out) every request after it
//! would meet the same fate, a 503 for ever although the database answers each statement in
//! time. The warmer's connections are opened under a bound of their own ([`OPEN_WITHIN`]), so
//! the pool fills again and requests find prepared connections waiting; a request's statement
//! is then one round trip.
//!
//! It opens one connection at a time, only while the pool has room and no idle connection, so
//! an idle proxy opens nothing and a busy one stops at `pool_size`. Each time it looks, it
//! first drops the idle connections whose session has ended (a reset, a server restart), so
//! that it replaces them before a request is lent one, and has the shared reader whose
//! session ended opened again (`readers.rs`). After a failure it waits
//! longer each time (up to [`MOST_BACKOFF`]): a database that is down is not called in a loop.

use std::sync::Weak;
use std::time::Duration;

use futures_util::future::try_join_all;

use super::Inner;
use super::error::pg;
use crate::store::StoreError;

/// How often the pool is looked at.
const LOOK_EVERY: Duration = Duration::from_millis(50);

/// How long opening and preparing one connection may take.
pub(super) const OPEN_WITHIN: Duration = Duration::from_secs(10);

/// The longest wait after failures in a row.
const MOST_BACKOFF: Duration = Duration::from_secs(2);

/// Warms the pool until the store is dropped (the task holds it only while it opens one).
pub(super) fn spawn(store: Weak<Inner>) {
    tokio::spawn(async move {
        let mut backoff = LOOK_EVERY;
        loop {
            tokio::time::sleep(backoff).await;
            let Some(inner) = store.upgrade() else {
                return;
            };
            inner.connections.drop_closed();
            inner.readers.reopen_closed();
            if !inner.connections.wants_one() {
                backoff = LOOK_EVERY;
                continue;
            }
            match tokio::time::timeout(OPEN_WITHIN, warm_one(&inner)).await {
                Ok(Ok(())) => backoff = LOOK_EVERY,
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "postgres: opening a connection ahead of requests failed");
                    backoff = (backoff * 2).min(MOST_BACKOFF);
                }
                Err(_) => {
                    tracing::debug!(within = ?OPEN_WITHIN, "postgres: opening a connection ahead of requests timed out");
                    backoff = (backoff * 2).min(MOST_BACKOFF);
                }
            }
        }
    });
}

/// Opens a connection, sets the schema up if no operation has, prepares every statement on it,
/// and hands it to the pool.
async fn warm_one(inner: &Inner) -> Result<(), StoreError> {
    let conn = inner.connections.open("open").await?;
    if inner.ready.get().is_none() {
        // The schema first (the statements name its table). Its setup takes a connection from
        // the pool: most likely this one, handed back.
        conn.finished();
        return inner.ready("open").await;
    }
    try_join_all(
        inner
            .sql
            .all()
            .into_iter()
            .map(|sql| conn.prepare_cached(sql)),
    )
    .await
    .map_err(pg("open"))?;
    conn.finished();
    Ok(())
}
