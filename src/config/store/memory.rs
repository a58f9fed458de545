//! `backend: memory`: its one setting.

use super::{BackendSettings, RawStore};

impl RawStore {
    pub(super) fn memory(&self, err: &mut impl FnMut(String, String)) -> Option<BackendSettings> {
        if self.max_entries == 0 {
            err("store.max_entries".into(), "must be at least 1".into());
            return None;
        }
        Some(BackendSettings::Memory {
            max_entries: self.max_entries,
        })
    }
}
