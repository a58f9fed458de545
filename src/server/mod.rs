//! The proxy's servers: the main listener (HTTP/1.1 and h2c, or with `tls:` HTTP/1.1 and h2
//! over TLS) served by every worker, and the wiring of the store, the admin listener and
//! graceful shutdown.
//!
//! On shutdown it marks the proxy draining (readiness answers 503), keeps serving for
//! `drain_delay`, then stops accepting, lets requests in flight finish, and waits for the
//! background tasks (upstream calls whose client left, saves being retried) so that every
//! result that can be saved is saved — all within `shutdown_timeout`, on every worker.
//!
//! - [`workers`]: a runtime, a thread and an accept loop a worker; what stays single.
//! - `stores`: which store each worker uses (shared, or its own connections).
//! - [`listener`]: the one listener type every server uses, and its [`listener::Handler`].
//! - `accept`: what to do when accept fails (backoff, one log line a burst).
//! - `connection`: one connection's task — TLS handshake, deadlines, drain.
//! - `head`: the proxy's limits on a request head, the same on both protocols.
//! - `activity`: what a connection is doing, for those deadlines.
//! - `io`: the socket under hyper, with the send deadline.

mod accept;
mod activity;
mod connection;
mod handler;
mod head;
mod io;
pub mod listener;
mod stores;
pub mod workers;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::body::Body;
use crate::config::{Config, Limits};
use crate::metrics::Metrics;
use crate::pid_file::PidFile;
use crate::problem::Problem;
use crate::proxy::Proxy;
use crate::reload::ReloadSource;
use crate::store::StoreError;
use head::{HYPER_HEAD_FACTOR, MAX_HEAD_BYTES, MAX_HEADERS, over_head_limits};
use listener::{Counted, Handler, Listener, ListenerLimits, Peer};
pub use stores::build_store;
use workers::{Drained, Workers};

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
    /// A worker's thread ended before it said whether it could start (it panicked).
    #[error("worker {0} ended while starting")]
    WorkerLost(usize),
}

/// Pending connections the listener queues (the kernel caps it at `net.core.somaxconn`):
/// a burst of a thousand clients retrying at once must not be refused at the door.
const LISTEN_BACKLOG: u32 = 4096;

/// Binds the main listener with a deep accept queue, `SO_REUSEADDR` (a restart does not wait
/// for the old process's connections to leave TIME_WAIT) and `SO_REUSEPORT`, so that every
/// worker binds a socket of its own to the same address ([`bind_shared`]).
///
/// `SO_REUSEPORT` would also let *another* process of the same user bind the port and take a
/// share of its connections — a second proxy started by mistake, with a memory store of its
/// own, would run a key's duplicates once each. So a fixed port is first bound plainly, as
/// only a free port can be: a port that anything listens on is refused (`AddrInUse`), as it
/// was before the workers shared it.
pub fn bind(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    if addr.port() != 0 {
        let probe = new_socket(addr)?;
        probe.set_reuseaddr(true)?;
        probe.bind(addr)?;
    }
    bind_shared(addr)
}

/// Binds one more socket to `addr` — an address [`bind`] has bound, its port resolved — for a
/// worker's accept loop: the kernel spreads new connections across the sockets of the port.
pub(crate) fn bind_shared(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let socket = new_socket(addr)?;
    socket.set_reuseaddr(true)?;
    #[cfg(all(unix, not(target_os = "solaris"), not(target_os = "illumos")))]
    socket.set_reuseport(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

fn new_socket(addr: std::net::SocketAddr) -> std::io::Result<tokio::net::TcpSocket> {
    if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()
    } else {
        tokio::net::TcpSocket::new_v6()
    }
}

/// How long admin requests in flight (a scrape, a key lookup) may run once the admin listener
/// stops, after the proxy's own drain.
const ADMIN_DRAIN: Duration = Duration::from_secs(2);

/// Serves the admin endpoints on `listener` until `shutdown` completes. The admin listener
/// keeps the main one's header and idle deadlines and send timeout, with a connection bound of
/// its own (`limits.max_admin_connections`): a flood of admin sockets must not starve the
/// main listener of file descriptors.
pub async fn serve_admin(
    listener: TcpListener,
    proxy: Arc<Proxy>,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let addr = listener.local_addr()?;
    tracing::info!(%addr, "admin listening on http://{addr} (/healthz, /readyz, /metrics)");
    let config = proxy.config();
    let limits = client_limits(&config.limits, config.limits.max_admin_connections);
    let listener = Listener::new(listener, "admin", limits);
    let live = listener.live_limits();
    proxy.on_reload(move |c| live.set(reloaded(limits, &c.limits)));
    let drain = listener.run(AdminService(proxy), shutdown).await;
    if !drain.close_within(ADMIN_DRAIN).await {
        tracing::debug!("admin requests still in flight after the drain: closed");
    }
    Ok(())
}

/// The admin listener's handler.
struct AdminService(Arc<Proxy>);

impl Handler for AdminService {
    type Body = Body;
    type Error = Infallible;

    async fn call(
        self: Arc<Self>,
        req: Request<Incoming>,
        peer: Peer,
    ) -> Result<Response<Body>, Infallible> {
        Ok(crate::admin::handle(&self.0, req, peer.addr()).await)
    }
}

/// Runs the proxy on `listener` until `shutdown` completes, then shuts down gracefully.
/// `reloads` says what a SIGHUP rereads. With `pid_file` set, the process id is written
/// there once the listener's socket listens and SIGHUP is handled, before the workers start
/// serving, and removed on the way out.
///
/// Serves with `config.workers` workers ([`workers`]): worker 0 on the runtime this is called
/// on, with the signal handling, the reloads, the pid file and the admin listener; each other
/// on a thread and runtime of its own, on a socket bound to `listener`'s address.
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

/// The limits of a listener that serves the proxy's clients (the main one, and the admin one
/// with its own connection bound). hyper keeps the head limits itself: on the admin listener,
/// which makes no problem of its own for them, a head over them is hyper's bare 431.
pub(crate) fn client_limits(limits: &Limits, max_connections: u32) -> ListenerLimits {
    ListenerLimits {
        max_connections: usize::try_from(max_connections).unwrap_or(usize::MAX),
        header_read_timeout: limits.header_read_timeout,
        send_timeout: limits.send_timeout,
        max_headers: MAX_HEADERS,
        max_head_bytes: MAX_HEAD_BYTES,
    }
}

/// The main listener's limits: as [`client_limits`], with hyper's head bounds
/// [`HYPER_HEAD_FACTOR`] times the proxy's, which [`ProxyService`] keeps.
fn proxy_limits(limits: &Limits, max_connections: u32) -> ListenerLimits {
    ListenerLimits {
        max_headers: MAX_HEADERS * HYPER_HEAD_FACTOR,
        max_head_bytes: MAX_HEAD_BYTES * HYPER_HEAD_FACTOR,
        ..client_limits(limits, max_connections)
    }
}

/// A listener's limits after a reload to `new`: the per-connection ones as `new` says, the
/// connection bound as the accept loop started with (it cannot change in place).
fn reloaded(started: ListenerLimits, new: &Limits) -> ListenerLimits {
    ListenerLimits {
        header_read_timeout: new.header_read_timeout,
        send_timeout: new.send_timeout,
        ..started
    }
}

/// Serves an already-built proxy on this runtime, as one worker (tests use this with a
/// store of their own, and to read its metrics), until `shutdown` completes; then drains it
/// as [`Workers::drain`] drains every worker.
pub async fn serve(
    listener: TcpListener,
    proxy: Arc<Proxy>,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let max_connections = proxy.config().limits.max_connections;
    let slots = Arc::new(Semaphore::new(
        usize::try_from(max_connections)
            .unwrap_or(usize::MAX)
            .max(1),
    ));
    let draining = proxy.clone();
    let stop = async move {
        shutdown.await;
        begin_drain(&draining).await;
        tracing::info!(
            timeout = ?draining.config().shutdown_timeout,
            "shutting down: no new connections; waiting for requests in flight"
        );
    };
    let drained = serve_worker(listener, proxy.clone(), 0, slots, stop).await;
    if drained.in_time {
        tracing::info!("shutdown complete");
    } else {
        tracing::warn!("shutdown_timeout reached with work still in flight; exiting anyway");
    }
    proxy.log_pending_completions();
    Ok(())
}

/// The start of the drain, once for every worker: readiness answers 503 from now on, while
/// the workers still accept for `drain_delay`.
async fn begin_drain(proxy: &Proxy) {
    // Readiness says 503 from the signal on, while the listener still serves: a load
    // balancer polling it moves traffic away before the socket closes.
    proxy.start_draining();
    // Read now: a reload may have changed it since start.
    let drain_delay = proxy.config().drain_delay;
    if !drain_delay.is_zero() {
        tracing::info!(
            ?drain_delay,
            "draining: /readyz answers 503; still accepting for drain_delay"
        );
        tokio::time::sleep(drain_delay).await;
    }
}

/// One worker's share of the main listener: its accept loop on `listener` until `stop`
/// completes, then its drain — its connections finish their requests, and the background
/// tasks of every worker (one tracker) finish — within `shutdown_timeout`. `slots` bounds the
/// connections open on every worker together.
async fn serve_worker(
    listener: TcpListener,
    proxy: Arc<Proxy>,
    worker: usize,
    slots: Arc<Semaphore>,
    stop: impl Future<Output = ()>,
) -> Drained {
    let config = proxy.config();
    let limits = proxy_limits(&config.limits, config.limits.max_connections);
    let tls = config.tls.as_ref().map(crate::tls::ServerTls::acceptor);
    let scheme = if tls.is_some() { "https" } else { "http" };
    match listener.local_addr() {
        Ok(addr) if worker == 0 => tracing::info!(
            %addr,
            workers = proxy.workers(),
            "idemproxy listening on {scheme}://{addr}"
        ),
        Ok(addr) => tracing::debug!(%addr, worker, "worker accepting"),
        Err(e) => tracing::warn!(worker, error = %e, "the listener has no address"),
    }
    let counted = Counted {
        accepted: proxy.metrics().worker_connections(worker),
        open: proxy.metrics().open_connections.clone(),
    };
    let listener = Listener::new(listener, "proxy", limits)
        .tls(tls)
        .share_slots(slots)
        .counted(counted);
    let live = listener.live_limits();
    proxy.on_reload(move |c| live.set(reloaded(limits, &c.limits)));
    let service = ProxyService {
        proxy: proxy.clone(),
        worker,
    };
    let drain = listener.run(service, stop).await;
    // Draining: no reload swaps in another configuration from here on.
    let shutdown_timeout = proxy.config().shutdown_timeout;
    tracing::debug!(
        worker,
        "worker stopped accepting; waiting for its requests in flight"
    );
    proxy.tasks().close();
    let drained = tokio::time::timeout(shutdown_timeout, async {
        drain.close().await;
        proxy.tasks().wait().await;
    })
    .await;
    if drained.is_err() {
        drain.abort();
    }
    Drained {
        in_time: drained.is_ok(),
    }
}

/// The main listener's handler on one worker: the proxy, behind the head limits, which are
/// kept here rather than by hyper so that both protocols get the same problem for them.
struct ProxyService {
    proxy: Arc<Proxy>,
    worker: usize,
}

impl Handler for ProxyService {
    type Body = Body;
    type Error = Infallible;

    async fn call(
        self: Arc<Self>,
        req: Request<Incoming>,
        peer: Peer,
    ) -> Result<Response<Body>, Infallible> {
        let client = peer.addr();
        if let Some(limit) = over_head_limits(&req) {
            tracing::debug!(%client, ?limit, "request head over the proxy's limits: refused");
            return Ok(Problem::HeadersTooLarge { limit }.response());
        }
        Ok(self.proxy.handle(req, client, self.worker).await)
    }
}
