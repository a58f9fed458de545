//! The listener: accepts connections, serves them with hyper (HTTP/1.1 and h2c, or with `tls:`
//! HTTP/1.1 and h2 over TLS), and shuts down gracefully.
//!
//! On shutdown it stops accepting, lets requests in flight finish, and waits for the
//! background tasks (upstream calls whose client left, saves being retried) so that every
//! result that can be saved is saved — all within `shutdown_timeout`.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::either::Either;

use crate::config::{BackendSettings, Config};
use crate::metrics::Metrics;
use crate::proxy::Proxy;
use crate::store::memory::MemoryStore;
use crate::store::redis::RedisStore;
use crate::store::{Store, StoreError, StoreHandle};

/// At most this many request headers: 100 (hyper's and many servers' limit) less the three
/// `X-Forwarded-*` the proxy adds. A request the upstream would refuse while parsing must be
/// refused here, before a claim: otherwise the upstream's 431 would be saved as the operation's
/// result and replayed to every retry, though nothing ran.
const MAX_HEADERS: usize = 97;
/// At most this many bytes of request head (HTTP/1.1 buffer; HTTP/2 header list).
const MAX_HEAD_BYTES: usize = 64 * 1024;

/// Why the proxy could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The store could not be set up.
    #[error("cannot set up the store: {0}")]
    Store(#[from] StoreError),
    /// The listener failed.
    #[error("listener: {0}")]
    Io(#[from] std::io::Error),
}

/// Pending connections the listener queues (the kernel caps it at `net.core.somaxconn`):
/// a burst of a thousand clients retrying at once must not be refused at the door.
const LISTEN_BACKLOG: u32 = 4096;

/// Binds a listener with a deep accept queue and `SO_REUSEADDR` (a restart does not wait for
/// the old process's connections to leave TIME_WAIT).
pub fn bind(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Builds the store the configuration names. With Redis, checks every server's eviction policy
/// in the background (it must not delay start, and Redis may be down).
pub fn build_store(config: &Config, metrics: Arc<Metrics>) -> Result<StoreHandle, RunError> {
    let s = &config.store;
    let check_timeout = s.timeout.max(Duration::from_secs(2));
    let backend: Arc<dyn Store> = match &s.backend {
        BackendSettings::Memory { max_entries } => Arc::new(MemoryStore::new(*max_entries)),
        BackendSettings::Redis {
            url,
            access,
            wait_replicas,
        } => {
            let redis = Arc::new(RedisStore::connect(
                url,
                access,
                *wait_replicas,
                s.timeout,
                metrics.clone(),
            )?);
            let check = redis.clone();
            tokio::spawn(async move { check.check_server(check_timeout).await });
            redis
        }
        BackendSettings::RedisCluster { nodes, access } => {
            let redis = Arc::new(RedisStore::cluster(nodes, access, s.timeout)?);
            let check = redis.clone();
            tokio::spawn(async move { check.check_server(check_timeout).await });
            redis
        }
    };
    Ok(StoreHandle::new(backend, s.timeout, metrics))
}

/// Runs the proxy on `listener` until `shutdown` completes, then shuts down gracefully.
pub async fn run(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()>,
) -> Result<(), RunError> {
    let metrics = Arc::new(Metrics::new());
    let admin = match config.admin_listen {
        Some(addr) => Some(bind(addr)?),
        None => None,
    };
    let store = build_store(&config, metrics.clone())?;
    let proxy = Arc::new(Proxy::new(config, store, metrics));
    // The admin listener outlives the drain (readiness says 503 meanwhile) and stops after it.
    let (admin_stop, admin_stopped) = tokio::sync::oneshot::channel::<()>();
    let admin = admin.map(|listener| {
        tokio::spawn(crate::admin::serve(listener, proxy.clone(), async move {
            let _ = admin_stopped.await;
        }))
    });
    let served = serve(listener, proxy, shutdown).await;
    let _ = admin_stop.send(());
    if let Some(admin) = admin {
        let _ = admin.await;
    }
    served?;
    Ok(())
}

/// Serves an already-built proxy (tests and benches use this to read its metrics).
pub async fn serve(
    listener: TcpListener,
    proxy: Arc<Proxy>,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let limits = proxy.config().limits;
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        // Bounds a request head, and an idle keep-alive connection waiting for the next one.
        .header_read_timeout(limits.header_read_timeout)
        .max_headers(MAX_HEADERS)
        .max_buf_size(MAX_HEAD_BYTES);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(MAX_HEAD_BYTES as u32);
    // Shared by every connection task; each connection borrows it for its whole life.
    let builder = Arc::new(builder);
    let graceful = GracefulShutdown::new();
    let tls = proxy
        .config()
        .tls
        .as_ref()
        .map(crate::tls::ServerTls::acceptor);
    let scheme = if tls.is_some() { "https" } else { "http" };
    tracing::info!(
        addr = %listener.local_addr()?,
        "idemproxy listening on {scheme}://{}",
        listener.local_addr()?
    );
    // At most `max_connections` open: past it, accepting pauses and new connections wait in
    // the kernel's queue, so a flood of idle sockets cannot exhaust memory or file descriptors.
    let slots = Arc::new(Semaphore::new(limits.max_connections as usize));
    tokio::pin!(shutdown);
    loop {
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => match slot {
                Ok(s) => s,
                // The semaphore is never closed.
                Err(_) => break,
            },
            () = &mut shutdown => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Usually EMFILE: back off briefly instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let proxy_for_conn = proxy.clone();
        let started = Arc::new(AtomicBool::new(false));
        let first = started.clone();
        let svc = service_fn(move |req| {
            first.store(true, Ordering::Relaxed);
            let proxy = proxy_for_conn.clone();
            async move { Ok::<_, Infallible>(proxy.handle(req, peer).await) }
        });
        // Taken before the task starts, so that a shutdown beginning during a TLS handshake
        // still waits for this connection (and tells it to close once it is served).
        let watcher = graceful.watcher();
        let builder = builder.clone();
        let tls = tls.clone();
        // One deadline from the accept for the TLS handshake and the first request head: a
        // client that connects and stalls anywhere before its first request is closed by it.
        let first_request_by = Instant::now() + limits.header_read_timeout;
        tokio::spawn(async move {
            let _slot = slot;
            // The handshake runs here, in the connection's own task, never in the accept loop:
            // a slow or silent client holds only its own connection.
            let stream = match tls {
                None => Either::Left(stream),
                Some(acceptor) => {
                    match tokio::time::timeout_at(first_request_by, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => Either::Right(tls),
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "TLS handshake failed");
                            return;
                        }
                        Err(_) => {
                            tracing::debug!(%peer, "no TLS handshake within limits.header_read_timeout: closing");
                            return;
                        }
                    }
                }
            };
            let conn = watcher.watch(builder.serve_connection(TokioIo::new(stream), svc));
            tokio::pin!(conn);
            // hyper bounds a head once it is reading one, but not the bytes before it knows
            // HTTP/1 from HTTP/2: a client that connects and stays silent is closed here.
            let result = tokio::select! {
                r = &mut conn => r,
                () = tokio::time::sleep_until(first_request_by) => {
                    if started.load(Ordering::Relaxed) {
                        conn.await
                    } else {
                        tracing::debug!(%peer, "no request within limits.header_read_timeout: closing");
                        return;
                    }
                }
            };
            if let Err(e) = result {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    proxy.start_draining();
    let timeout = proxy.config().shutdown_timeout;
    tracing::info!(
        timeout = ?timeout,
        "shutting down: no new connections; waiting for requests in flight"
    );
    proxy.tasks().close();
    let drained = tokio::time::timeout(timeout, async {
        graceful.shutdown().await;
        proxy.tasks().wait().await;
    })
    .await;
    match drained {
        Ok(()) => tracing::info!("shutdown complete"),
        Err(_) => {
            tracing::warn!("shutdown_timeout reached with work still in flight; exiting anyway")
        }
    }
    proxy.log_pending_saves();
    Ok(())
}
