//! The proxy's servers: the main listener (HTTP/1.1 and h2c, or with `tls:` HTTP/1.1 and h2
//! over TLS) served by every worker, and the wiring of the store, the admin listener and
//! graceful shutdown.
//!
//! On shutdown it marks the proxy draining (readiness answers 503), keeps serving for
//! `drain_delay`, then stops accepting, lets requests in flight finish, and waits for the
//! background tasks (upstream calls whose client left, saves being retried) so that every
//! result that can be saved is saved — all within `shutdown_timeout`, on every worker.
//!
//! - [`run`] (here): the process's server — workers, the pid file, reloads, the admin listener,
//!   the drain.
//! - `error`: [`RunError`], why it could not start or run.
//! - `bind`: [`bind()`] and the sockets every worker binds to the same port.
//! - [`workers`]: a runtime, a thread and an accept loop a worker; what stays single.
//! - `serving`: what runs on a worker — its accept loop and drain ([`serve`]), and the admin
//!   listener ([`serve_admin`]).
//! - `stores`: which store each worker uses (shared, or its own connections).
//! - [`listener`]: the one listener type every server uses, and its [`listener::Handler`].
//! - `handler`: what a listener serves, and the limits it keeps.
//! - `accept`: what to do when accept fails (backoff, one log line a burst).
//! - `connection`: one connection's task — TLS handshake, deadlines, drain.
//! - `head`: the proxy's limits on a request head, the same on both protocols.
//! - `activity`: what a connection is doing, for those deadlines.
//! - `io`: the socket under hyper, with the send deadline.

mod accept;
mod activity;
mod bind;
mod connection;
mod error;
mod handler;
mod head;
mod io;
pub mod listener;
mod serving;
mod stores;
pub mod workers;

use std::sync::Arc;

use tokio::net::TcpListener;

use crate::config::Config;
use crate::metrics::Metrics;
use crate::pid_file::PidFile;
use crate::reload::ReloadSource;
pub use bind::bind;
pub use error::RunError;
pub use serving::{serve, serve_admin};
pub use stores::build_store;
use workers::Workers;

/// Runs the proxy on `listener` until `shutdown` completes, then shuts down gracefully.
/// `reloads` says what a SIGHUP rereads. With `pid_file` set, the process id is written
/// there once the listener's socket listens and SIGHUP is handled, before the workers start
/// serving, and removed on the way out.
///
/// Serves with `config.workers` workers ([`workers`]): worker 0 on the runtime this is called
/// on, with the signal handling, the reloads, the pid file and the admin listener; each other
/// on a thread and runtime of its own, on a socket bound to `listener`'s address.
///
/// # Example
/// A proxy on a free loopback port, in front of an upstream that nobody runs (nothing here
/// reaches it: the request asked matches no route), asked once and stopped:
/// ```
/// use idemproxy::config::Config;
/// use idemproxy::reload::ReloadSource;
/// use tokio::io::{AsyncReadExt, AsyncWriteExt};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let config = Config::from_yaml(
///     "
/// listen: 127.0.0.1:0
/// workers: 1
/// drain_delay: 0s
/// upstreams:
///   booking:
///     url: http://127.0.0.1:9
/// routes:
///   - name: create-booking
///     methods: [POST]
///     path: /bookings
///     upstream: booking
///     idempotency: {}
/// ",
/// )?;
/// let listener = idemproxy::server::bind(config.listen)?;
/// let addr = listener.local_addr()?;
/// let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
/// let shutdown = async move {
///     let _ = stopped.await;
/// };
/// let proxy = tokio::spawn(idemproxy::run(listener, config, ReloadSource::none(), shutdown));
///
/// let mut conn = tokio::net::TcpStream::connect(addr).await?;
/// conn.write_all(b"GET /elsewhere HTTP/1.1\r\nhost: example\r\nconnection: close\r\n\r\n")
///     .await?;
/// let mut answer = String::new();
/// conn.read_to_string(&mut answer).await?;
/// assert!(answer.starts_with("HTTP/1.1 404"), "{answer}");
/// assert!(answer.contains("urn:idemproxy:problem:no-route"), "{answer}");
///
/// let _ = stop.send(());
/// proxy.await??;
/// # Ok(())
/// # }
/// ```
pub async fn run(
    listener: TcpListener,
    config: Config,
    reloads: ReloadSource,
    shutdown: impl Future<Output = ()>,
) -> Result<(), RunError> {
    // First: SIGHUP's default action ends the process, so it is handled before anything (a
    // pid file, a log line) could prompt an operator to send one.
    let hangups = reloads.listen().map_err(RunError::Hangup)?;
    let metrics = Arc::new(Metrics::new());
    let admin = match config.admin_listen {
        Some(addr) => Some(bind(addr)?),
        None => None,
    };
    // Before the workers start: a pid file that can't be written ends the process before
    // anything logs that it listens. The socket listens already (the kernel queues its
    // connections) and SIGHUP is handled, so the file names a process ready for a reload; if
    // the start fails after all, the file goes with `_pid_file`.
    let _pid_file = match config.pid_file.clone() {
        Some(path) => match PidFile::write(&path) {
            Ok(written) => Some(written),
            Err(error) => return Err(RunError::PidFile { path, error }),
        },
        None => None,
    };
    let workers = Workers::start(listener, config, metrics).await?;
    let proxy = workers.proxy().clone();
    let reloader = tokio::spawn(hangups.serve(proxy.clone()));
    // The admin listener outlives the drain (readiness says 503 meanwhile) and stops after it.
    let (admin_stop, admin_stopped) = tokio::sync::oneshot::channel::<()>();
    let admin = admin.map(|listener| {
        tokio::spawn(serve_admin(listener, proxy.clone(), async move {
            let _ = admin_stopped.await;
        }))
    });
    shutdown.await;
    workers.drain().await;
    reloader.abort();
    let _ = admin_stop.send(());
    if let Some(admin) = admin {
        let _ = admin.await;
    }
    Ok(())
}
