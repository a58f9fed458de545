//! The claim that can be resolved (`on_unknown_outcome: resolve`): its claim or takeover in
//! one statement, its renewals into `times`, the server's clock (`sql.rs` has the statements).

use bytes::Bytes;
use std::time::Duration;
use tokio_postgres::Row;

use super::error::{backend, pg};
use super::{CLAIM_ATTEMPTS, Inner, MAX_MILLIS, millis, token};
use crate::record::resolvable;
use crate::store::{Held, ResolvableFound, ResolvableTimes, StoreError, StoreKey};

impl Inner {
    pub(super) async fn claim_resolvable(
        &self,
        key: &StoreKey,
        held: &Held,
        times: ResolvableTimes,
    ) -> Result<ResolvableFound, StoreError> {
        let inner = self;
        inner.ready("claim").await?;
        let (key, token, value) = (key.text(), token("claim", held)?, held.encoded.as_ref());
        let (lease, lifetime) = (millis(times.lease), millis(times.lifetime));
        // 0 is a valid margin (`millis` is at least 1).
        let margin = i64::try_from(times.send_margin.as_millis())
            .unwrap_or(MAX_MILLIS)
            .min(MAX_MILLIS);
        let conn = inner.connections.get("claim").await?;
        let sql = &inner.sql.resolvable.claim;
        let statement = inner.statement(&conn, "claim", sql).await?;
        for _ in 0..CLAIM_ATTEMPTS {
            let rows = conn
                .query(
                    &statement,
                    &[&key, &token, &value, &lease, &margin, &lifetime],
                )
                .await
                .map_err(pg("claim"))?;
            if let Some(found) = resolvable_outcome(&rows).map_err(pg("claim"))? {
                conn.finished();
                return Ok(found);
            }
        }
        conn.finished();
        Err(backend(
            "claim",
            format!(
                "each of {CLAIM_ATTEMPTS} runs of the claim met another request's claim or takeover of the key while it was committing"
            ),
        ))
    }

    pub(super) async fn resolving(
        &self,
        key: &StoreKey,
        held: &Held,
        next_lookup_in: Duration,
        lease: Duration,
    ) -> Result<Option<u64>, StoreError> {
        let (key, token) = (key.text(), token("renew", held)?);
        let (lease, next) = (millis(lease), millis(next_lookup_in));
        let sql = &self.sql.resolvable.resolving;
        let rows = self
            .query("renew", sql, &[&key, &token, &lease, &next])
            .await?;
        returned_now("renew", &rows)
    }

    pub(super) async fn now(&self) -> Result<u64, StoreError> {
        let rows = self.query("now", &self.sql.resolvable.now, &[]).await?;
        Ok(returned_now("now", &rows)?.unwrap_or(0))
    }
}

/// What the resolvable claim statement's rows say: `None` run it again (no row: another
/// session's claim was committing; or only a resolvable claim with a lapsed lease, which
/// another session's takeover was committing), else what happened.
fn resolvable_outcome(rows: &[Row]) -> Result<Option<ResolvableFound>, tokio_postgres::Error> {
    let mut existing = None;
    for row in rows {
        let kind: i32 = row.try_get(0)?;
        let value = Bytes::from(row.try_get::<_, Vec<u8>>(1)?);
        let now = u64::try_from(row.try_get::<_, i64>(2)?).unwrap_or(0);
        match kind {
            1 => return Ok(Some(ResolvableFound::Claimed { value, now })),
            2 => return Ok(Some(ResolvableFound::TakenOver { value, now })),
            _ => {
                if existing.is_none() {
                    let lapsed = resolvable::lease_until(&value).is_some_and(|l| l <= now);
                    existing = Some((value, lapsed));
                }
            }
        }
    }
    Ok(match existing {
        Some((_, true)) | None => None,
        Some((value, false)) => Some(ResolvableFound::Existing { value }),
    })
}

/// The number a resolvable statement returned (`now_ms`), if it returned a row.
pub(super) fn returned_now(op: &'static str, rows: &[Row]) -> Result<Option<u64>, StoreError> {
    match rows.first() {
        None => Ok(None),
        Some(row) => {
            let now: i64 = row.try_get(0).map_err(pg(op))?;
            Ok(Some(u64::try_from(now).unwrap_or(0)))
        }
    }
}
