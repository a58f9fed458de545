//! What triggers a reload: SIGHUP rereads the configuration file the proxy was started with
//! and hands it to [`Proxy::reload_file`], which validates it as `--check` does and swaps it
//! in, or refuses it whole (see `proxy/reload/` for what can change in place).
//!
//! `idemproxy reload --config FILE` is the same signal, sent to the process named by the
//! file's `pid_file` ([`crate::pid_file`]).

use std::path::PathBuf;
use std::sync::Arc;

use crate::proxy::Proxy;

/// What a SIGHUP rereads.
#[derive(Debug, Clone)]
pub struct ReloadSource {
    file: Option<PathBuf>,
}

impl ReloadSource {
    /// SIGHUP rereads `file` (the one given with `--config`).
    pub fn file(file: impl Into<PathBuf>) -> ReloadSource {
        ReloadSource {
            file: Some(file.into()),
        }
    }

    /// No file to reread (`idemproxy demo` builds its configuration in code): a SIGHUP is
    /// logged and otherwise ignored, rather than ending the process as it would by default.
    pub fn none() -> ReloadSource {
        ReloadSource { file: None }
    }

    /// Starts handling SIGHUP now (before this, the signal would end the process).
    pub(crate) fn listen(self) -> std::io::Result<Hangups> {
        #[cfg(unix)]
        let signal = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
        Ok(Hangups {
            source: self,
            #[cfg(unix)]
            signal,
        })
    }
}

/// SIGHUP, handled.
pub(crate) struct Hangups {
    source: ReloadSource,
    #[cfg(unix)]
    signal: tokio::signal::unix::Signal,
}

impl Hangups {
    /// Reloads `proxy` at every SIGHUP, one reload at a time, until the task is aborted (at
    /// the end of the drain). A SIGHUP while draining is logged and ignored.
    pub(crate) async fn serve(self, proxy: Arc<Proxy>) {
        #[cfg(unix)]
        {
            let Hangups { source, mut signal } = self;
            while signal.recv().await.is_some() {
                if proxy.is_draining() {
                    tracing::warn!("SIGHUP ignored: the proxy is shutting down");
                    continue;
                }
                let Some(file) = source.file.clone() else {
                    tracing::warn!(
                        "SIGHUP ignored: this proxy has no configuration file to reread"
                    );
                    continue;
                };
                tracing::info!(file = %file.display(), "SIGHUP: reloading the configuration");
                let proxy = proxy.clone();
                // Reading the file (and the certificates and secrets it names) is blocking
                // I/O: off the runtime's workers.
                if let Err(e) = tokio::task::spawn_blocking(move || proxy.reload_file(&file)).await
                {
                    tracing::error!(error = %e, "the reload failed inside; the configuration in force stays");
                }
            }
        }
        #[cfg(not(unix))]
        {
            let _ = (self, proxy);
            std::future::pending::<()>().await;
        }
    }
}
