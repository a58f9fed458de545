//! What the key tooling asks of the writer: forgetting a finished record (reads, `inspect`
//! among them, run on the read pool: `readers.rs`).

use rusqlite::types::ValueRef;
use rusqlite::{OptionalExtension, params};

use super::ops::Ops;
use crate::store::Forgotten;

impl Ops<'_> {
    /// Deletes the key if, and only if, it holds a live finished record.
    pub(super) fn forget(&mut self, key: &str, now: i64) -> rusqlite::Result<Forgotten> {
        let found = self
            .live_value
            .query_row(params![key, now], |r| {
                Ok(match r.get_ref(0)? {
                    ValueRef::Blob(b) => Forgotten::of(b),
                    _ => Forgotten::NotARecord,
                })
            })
            .optional()?;
        match found {
            None => Ok(Forgotten::Absent),
            Some(Forgotten::Forgotten) => {
                self.delete.execute(params![key])?;
                Ok(Forgotten::Forgotten)
            }
            Some(other) => Ok(other),
        }
    }
}
