//! Why the proxy could not start or run.

use crate::store::StoreError;

/// Why the proxy could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The store could not be set up.
    #[error("cannot set up the store: {0}")]
    Store(#[from] StoreError),
    /// The listener failed.
    #[error("listener: {0}")]
    Io(#[from] std::io::Error),
    /// The reload signal could not be set up.
    #[error("cannot listen for SIGHUP (reload): {0}")]
    Hangup(std::io::Error),
    /// `pid_file` could not be written.
    #[error("cannot write pid_file {path}: {error}")]
    PidFile {
        path: std::path::PathBuf,
        error: std::io::Error,
    },
    /// A worker could not start.
    #[error("worker {worker} {what}: {error}")]
    Worker {
        worker: usize,
        what: &'static str,
        error: std::io::Error,
    },
    /// The trace exporter could not start.
    #[error("{0}")]
    Traces(crate::traces::TracesError),
    /// A worker's thread ended before it said whether it could start (it panicked).
    #[error("worker {0} ended while starting")]
    WorkerLost(usize),
}
