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
//! - `activity`: what a connection is doing, for those deadlines.
//! - `io`: the socket under hyper, with the send deadline.

mod accept;
mod activity;
mod connection;
mod handler;
mod io;
pub mod listener;
mod stores;
pub mod workers;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, header};
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::body::Body;
use crate::config::{Config, Limits};
use crate::metrics::Metrics;
use crate::pid_file::PidFile;
use crate::problem::{HeadLimit, Problem};
use crate::proxy::Proxy;
use crate::reload::ReloadSource;
use crate::store::StoreError;
use listener::{Counted, Handler, Listener, ListenerLimits, Peer};
pub use stores::build_store;
use workers::{Drained, Workers};

/// At most this many request headers: 100 (hyper's and many servers' limit) less the three
/// `X-Forwarded-*` the proxy adds. A request the upstream would refuse while parsing must be
/// refused here, before a claim: otherwise the upstream's 431 would be saved as the operation's
/// result and replayed to every retry, though nothing ran.
const MAX_HEADERS: usize = 97;
/// At most this many bytes of request head: request line and headers, as HTTP/1.1 writes them.
const MAX_HEAD_BYTES: usize = 64 * 1024;
/// hyper's own bounds on the main listener (HTTP/1.1 header count and read buffer, HTTP/2
/// header list) are this many times the proxy's limits, so that a head over the proxy's limits
/// still reaches the service, which refuses it with the same problem on either protocol (SPEC
/// §4.3). Only a head beyond hyper's bound gets hyper's own answer (a bare 431 on HTTP/1.1);
/// the bound keeps what one connection can make the proxy buffer small.
const HYPER_HEAD_FACTOR: usize = 4;

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
/// there once everything listens (and SIGHUP is handled), and removed on the way out.
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
    let pid_file = config.pid_file.clone();
    let workers = Workers::start(listener, config, metrics).await?;
    let proxy = workers.proxy().clone();
    let _pid_file = match pid_file {
        Some(path) => match PidFile::write(&path) {
            Ok(written) => Some(written),
            Err(error) => {
                workers.stop().await;
                return Err(RunError::PidFile { path, error });
            }
        },
        None => None,
    };
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

/// The limit the request's head is over, if any: more than [`MAX_HEADERS`] header fields, or
/// more than [`MAX_HEAD_BYTES`] of head, both counted as the head would be written on HTTP/1.1
/// (the upstream's protocol), whichever protocol it came on.
///
/// An HTTP/2 request carries its host in the `:authority` pseudo-header, which becomes a `Host`
/// line upstream, so it counts as one header; its other pseudo-headers make the request line.
fn over_head_limits<B>(req: &Request<B>) -> Option<HeadLimit> {
    let uri = req.uri();
    let has_host = req.headers().contains_key(header::HOST);
    let authority_as_host = if has_host { None } else { uri.authority() };
    let count = req.headers().len() + usize::from(authority_as_host.is_some());
    if count > MAX_HEADERS {
        return Some(HeadLimit::Count(MAX_HEADERS));
    }
    (head_size(req, authority_as_host) > MAX_HEAD_BYTES).then_some(HeadLimit::Bytes(MAX_HEAD_BYTES))
}

/// The bytes of `req`'s head written as HTTP/1.1: `METHOD target HTTP/1.1`, a `name: value`
/// line a header (and a `host` line for `authority_as_host`), each ended by CR LF, and the
/// blank line.
fn head_size<B>(req: &Request<B>, authority_as_host: Option<&http::uri::Authority>) -> usize {
    const CRLF: usize = 2;
    const HTTP11: usize = " HTTP/1.1".len();
    let uri = req.uri();
    let path_and_query = uri.path_and_query().map_or(1, |pq| pq.as_str().len());
    // An HTTP/1.1 request in absolute form (`POST http://host/path`) sent its scheme and
    // authority in the request line; an HTTP/2 request's are pseudo-headers, counted apart.
    let absolute = match (req.version(), uri.scheme_str(), uri.authority()) {
        (v, Some(scheme), Some(authority)) if v < http::Version::HTTP_2 => {
            scheme.len() + "://".len() + authority.as_str().len()
        }
        _ => 0,
    };
    let mut size = req.method().as_str().len() + 1 + absolute + path_and_query + HTTP11 + CRLF;
    for (name, value) in req.headers() {
        size += name.as_str().len() + ": ".len() + value.len() + CRLF;
    }
    if let Some(authority) = authority_as_host {
        size += "host: ".len() + authority.as_str().len() + CRLF;
    }
    size + CRLF
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(version: http::Version, uri: &str, headers: &[(&str, &str)]) -> Request<()> {
        let mut req = Request::builder().method("POST").uri(uri).version(version);
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        req.body(()).expect("request")
    }

    #[test]
    fn the_head_size_is_the_head_as_http1_writes_it() {
        let h1 = request(
            http::Version::HTTP_11,
            "/bookings?x=1",
            &[("host", "shop.test"), ("idempotency-key", "k1")],
        );
        let wire = "POST /bookings?x=1 HTTP/1.1\r\nhost: shop.test\r\nidempotency-key: k1\r\n\r\n";
        assert_eq!(head_size(&h1, None), wire.len());
        // The same request over HTTP/2: the authority becomes the host line.
        let h2 = request(
            http::Version::HTTP_2,
            "http://shop.test/bookings?x=1",
            &[("idempotency-key", "k1")],
        );
        let authority = h2.uri().authority().cloned();
        assert_eq!(head_size(&h2, authority.as_ref()), wire.len());
    }

    #[test]
    fn heads_over_either_limit_are_refused_on_both_protocols() {
        let filler = |n: usize| -> Vec<(String, String)> {
            (0..n)
                .map(|i| (format!("x-f-{i}"), "1".to_owned()))
                .collect()
        };
        for (version, uri, host) in [
            (http::Version::HTTP_11, "/bookings", true),
            (http::Version::HTTP_2, "http://shop.test/bookings", false),
        ] {
            let build = |extra: &[(String, String)]| {
                let mut headers: Vec<(&str, &str)> = extra
                    .iter()
                    .map(|(n, v)| (n.as_str(), v.as_str()))
                    .collect();
                if host {
                    headers.push(("host", "shop.test"));
                }
                request(version, uri, &headers)
            };
            // The host counts as one, on either protocol.
            assert_eq!(over_head_limits(&build(&filler(96))), None, "{version:?}");
            assert_eq!(
                over_head_limits(&build(&filler(97))),
                Some(HeadLimit::Count(MAX_HEADERS)),
                "{version:?}"
            );
            let big = vec![("x-big".to_owned(), "v".repeat(MAX_HEAD_BYTES))];
            assert_eq!(
                over_head_limits(&build(&big)),
                Some(HeadLimit::Bytes(MAX_HEAD_BYTES)),
                "{version:?}"
            );
            let fits = vec![("x-big".to_owned(), "v".repeat(MAX_HEAD_BYTES - 200))];
            assert_eq!(over_head_limits(&build(&fits)), None, "{version:?}");
        }
    }
}
