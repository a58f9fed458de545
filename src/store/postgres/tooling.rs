//! What the key tooling asks of the store (`idemproxy keys show` and `keys forget`, through
//! the admin listener): a record and its time to live, and forgetting a finished one.

use bytes::Bytes;
use std::time::Duration;

use super::Inner;
use super::error::pg;
use crate::store::{Forgotten, StoreError, StoreKey};

impl Inner {
    pub(super) async fn inspect(
        &self,
        key: &StoreKey,
    ) -> Result<Option<(Bytes, Duration)>, StoreError> {
        let key = key.text();
        let rows = self.query("inspect", &self.sql.inspect, &[&key]).await?;
        let Some(row) = rows.first() else {
            return Ok(None);
        };
        let value: Vec<u8> = row.try_get(0).map_err(pg("inspect"))?;
        let left: i64 = row.try_get(1).map_err(pg("inspect"))?;
        let left = Duration::from_millis(u64::try_from(left).unwrap_or(0));
        Ok(Some((Bytes::from(value), left)))
    }

    pub(super) async fn forget(&self, key: &StoreKey) -> Result<Forgotten, StoreError> {
        let key = key.text();
        let rows = self.query("forget", &self.sql.forget, &[&key]).await?;
        let mut found = Forgotten::Absent;
        for row in &rows {
            if row.try_get::<_, bool>(0).map_err(pg("forget"))? {
                return Ok(Forgotten::Forgotten);
            }
            let value: Vec<u8> = row.try_get(1).map_err(pg("forget"))?;
            found = match Forgotten::of(&value) {
                // Finished in the snapshot, yet not deleted: another forget deleted it first.
                Forgotten::Forgotten => Forgotten::Absent,
                other => other,
            };
        }
        Ok(found)
    }
}
