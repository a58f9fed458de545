//! `backend: sqlite`: the file, how hard a commit pushes to disk, the sweep.

use std::path::PathBuf;

use serde::Deserialize;

use super::{BackendSettings, RawStore, defaults};

/// `store.sync` (SQLite): how hard a commit pushes to disk.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SqliteSync {
    /// `PRAGMA synchronous = NORMAL` in WAL mode: a commit survives a crash or SIGKILL of the
    /// proxy (the WAL is in the OS's page cache); a power loss may lose the last commits.
    #[default]
    Normal,
    /// `PRAGMA synchronous = FULL`: every commit is fsynced, so it also survives a power loss.
    Full,
}

impl RawStore {
    pub(super) fn sqlite(&self, err: &mut impl FnMut(String, String)) -> Option<BackendSettings> {
        let sweep_interval = self.sweep_interval(err);
        let path = self.path.as_deref().unwrap_or(defaults::SQLITE_PATH);
        if path.is_empty() {
            err("store.path".into(), "must not be empty".into());
            return None;
        }
        if path == ":memory:" || path.starts_with("file:") {
            err(
                "store.path".into(),
                "must be the path of a file (an in-memory SQLite database keeps nothing across a restart: use backend memory)".into(),
            );
            return None;
        }
        Some(BackendSettings::Sqlite {
            path: PathBuf::from(path),
            sync: self.sync.unwrap_or_default(),
            sweep_interval: sweep_interval?,
        })
    }
}
