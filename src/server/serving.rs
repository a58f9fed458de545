//! Serving: a worker's accept loop on the main listener and its drain, the admin listener, and
//! the limits each listener keeps. What a worker is (its thread and runtime) is
//! [`super::workers`]'s; this is what runs on it.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use super::head::{HYPER_HEAD_FACTOR, MAX_HEAD_BYTES, MAX_HEADERS, over_head_limits};
use super::listener::{Counted, Handler, Listener, ListenerLimits, Peer};
use crate::body::Body;
use crate::config::Limits;
use crate::proxy::Proxy;

/// How one worker's drain ended.
#[derive(Debug, Clone, Copy)]
pub(super) struct Drained {
    /// Whether every connection and background task finished within `shutdown_timeout`.
    pub in_time: bool,
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
/// as [`Workers::drain`](super::workers::Workers::drain) drains every worker.
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
    proxy.log_pending_saves();
    Ok(())
}

/// The start of the drain, once for every worker: readiness answers 503 from now on, while
/// the workers still accept for `drain_delay`.
pub(super) async fn begin_drain(proxy: &Proxy) {
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
pub(super) async fn serve_worker(
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
            // In the terms of the route it came for: a gRPC call gets a gRPC status.
            return Ok(self.proxy.refuse_head(&req, limit, self.worker));
        }
        Ok(self.proxy.handle(req, client, self.worker).await)
    }
}
