//! The plain claim's steps on PostgreSQL, each one statement (`sql.rs` has them and what each
//! does in every interleaving): the claim, run again when it met another session's commit; the
//! save, asked again when it changed nothing; the release.

use std::time::Duration;

use bytes::Bytes;
use tokio_postgres::Row;

use super::error::{backend, pg};
use super::{CLAIM_ATTEMPTS, Inner, millis, token};
use crate::store::{Held, StoreError, StoreKey};

impl Inner {
    pub(super) async fn claim(
        &self,
        key: &StoreKey,
        held: &Held,
        lease: Duration,
    ) -> Result<Option<Bytes>, StoreError> {
        let inner = self;
        inner.ready("claim").await?;
        let store_key = key;
        let (key, token, value, lease) = (
            key.text(),
            token("claim", held)?,
            held.encoded.as_ref(),
            millis(lease),
        );
        if inner.recent.holds(store_key) {
            // Likely a repeat: a primary-key read, and a finished record found is the answer
            // the claim would give (see `recent.rs`). Anything else falls through to it.
            if let Some(found) = inner.read_first(&key).await?
                && crate::record::is_finished(&found)
            {
                return Ok(Some(Bytes::from(found)));
            }
        }
        let conn = inner.connections.get("claim").await?;
        let statement = inner.statement(&conn, "claim", &inner.sql.claim).await?;
        for _ in 0..CLAIM_ATTEMPTS {
            let rows = conn
                .query(&statement, &[&key, &token, &value, &lease])
                .await
                .map_err(pg("claim"))?;
            if let Some(found) = claim_outcome(&rows).map_err(pg("claim"))? {
                conn.finished();
                if found.is_some() {
                    inner.recent.note(store_key);
                }
                return Ok(found);
            }
        }
        conn.finished();
        Err(backend(
            "claim",
            format!(
                "each of {CLAIM_ATTEMPTS} runs of the claim met another request's claim of the key while it was committing (requests claiming and releasing the key over and over)"
            ),
        ))
    }

    /// The read before a likely repeat's claim: on the worker's shared reader, or on a pooled
    /// connection when the worker has none; `None` when the read had no answer (the claim
    /// then decides alone).
    async fn read_first(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        if self.readers.any() {
            return Ok(self.readers.read(key).await);
        }
        let conn = self.connections.get("claim").await?;
        let statement = self.statement(&conn, "claim", &self.sql.get).await?;
        let rows = conn.query(&statement, &[&key]).await.map_err(pg("claim"))?;
        let found = match rows.first() {
            Some(row) => Some(row.try_get(0).map_err(pg("claim"))?),
            None => None,
        };
        conn.finished();
        Ok(found)
    }

    pub(super) async fn save(
        &self,
        key: &StoreKey,
        held: &Held,
        done: Bytes,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let inner = self;
        let store_key = key;
        let (key, token, done, ttl) = (
            key.text(),
            token("complete", held)?,
            done.as_ref(),
            millis(ttl),
        );
        let statement = if held.resolvable().is_some() {
            &inner.sql.resolvable.save
        } else {
            &inner.sql.save
        };
        let changed = inner
            .execute("complete", statement, &[&key, &token, &done, &ttl])
            .await?;
        if changed == 1 {
            inner.recent.note(store_key);
            return Ok(true);
        }
        // Nothing changed: either the lease was lost, or this save was sent again after
        // the first landed (its answer lost) and the key already holds exactly `done`.
        let landed = inner
            .query("complete", &inner.sql.saved, &[&key, &done])
            .await?;
        Ok(!landed.is_empty())
    }

    pub(super) async fn release(&self, key: &StoreKey, held: &Held) -> Result<bool, StoreError> {
        let (key, token) = (key.text(), token("release", held)?);
        let statement = if held.resolvable().is_some() {
            &self.sql.resolvable.release
        } else {
            &self.sql.release
        };
        let rows = self.query("release", statement, &[&key, &token]).await?;
        match rows.first() {
            Some(row) => row.try_get(0).map_err(pg("release")),
            None => Err(backend("release", "the release statement returned no row")),
        }
    }
}

/// What the claim statement's rows say: `None` no row (run it again), `Some(None)` the key is
/// ours, `Some(Some(value))` a live record. A `true` row wins over a value row (see `sql.rs`).
fn claim_outcome(rows: &[Row]) -> Result<Option<Option<Bytes>>, tokio_postgres::Error> {
    let mut found = None;
    for row in rows {
        if row.try_get::<_, bool>(0)? {
            return Ok(Some(None));
        }
        if found.is_none() {
            found = Some(Some(Bytes::from(row.try_get::<_, Vec<u8>>(1)?)));
        }
    }
    Ok(found)
}
