//! The one listener every server of the crate uses — the proxy's, the admin's and the mock
//! upstream's — in the shape of mini-redis's `Listener`: an accept loop bounded by a
//! semaphore, with backoff when accept fails, and a task per connection that keeps its
//! deadlines (see [`super::connection`]). Each server brings only its [`Handler`] and its
//! [`ListenerLimits`].
//!
//! ```no_run
//! use std::convert::Infallible;
//! use std::sync::Arc;
//!
//! use idemproxy::server::listener::{Handler, Listener, ListenerLimits, Peer};
//!
//! struct Hello;
//!
//! impl Handler for Hello {
//!     type Body = http_body_util::Full<bytes::Bytes>;
//!     type Error = Infallible;
//!
//!     async fn call(
//!         self: Arc<Self>,
//!         _req: http::Request<hyper::body::Incoming>,
//!         _peer: Peer,
//!     ) -> Result<http::Response<Self::Body>, Infallible> {
//!         Ok(http::Response::new("hello\n".into()))
//!     }
//! }
//!
//! # async fn example(tcp: tokio::net::TcpListener, limits: ListenerLimits) {
//! let stop = async {
//!     let _ = tokio::signal::ctrl_c().await;
//! };
//! let drain = Listener::new(tcp, "hello", limits).run(Hello, stop).await;
//! drain.close_within(std::time::Duration::from_secs(5)).await;
//! # }
//! ```

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;
use tokio_util::task::TaskTracker;

use super::accept::Backoff;
use super::connection::{self, Stop};
use super::handler::Shared;
pub use super::handler::{Handler, ListenerLimits, LiveLimits, Peer};

/// A bound socket, ready to serve.
pub struct Listener {
    tcp: TcpListener,
    name: &'static str,
    /// The accept loop's bound, fixed for its life: one permit a connection. Several
    /// listeners may share one (the workers' sockets on one address: the bound is the
    /// address's, not each socket's).
    slots: Arc<Semaphore>,
    /// Each connection's limits, which a reload may change (see [`Listener::live_limits`]).
    limits: Arc<LiveLimits>,
    tls: Option<TlsAcceptor>,
    /// Counts the connections it accepts, and those open.
    counted: Option<Counted>,
}

/// What a listener counts: connections accepted (its own counter), and open (a gauge that
/// several listeners may move together).
#[derive(Debug, Clone)]
pub(crate) struct Counted {
    pub accepted: Counter,
    pub open: Gauge,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("name", &self.name)
            .field("addr", &self.tcp.local_addr().ok())
            .field("limits", &self.limits.load_full().limits)
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl Listener {
    /// `name` says which listener in the log (`proxy`, `admin`, …).
    pub fn new(tcp: TcpListener, name: &'static str, limits: ListenerLimits) -> Listener {
        Listener {
            tcp,
            name,
            slots: Arc::new(Semaphore::new(limits.max_connections.max(1))),
            limits: Arc::new(LiveLimits::new(limits)),
            tls: None,
            counted: None,
        }
    }

    /// Takes its connection slots from `slots`, shared with other listeners, instead of a
    /// bound of its own.
    pub(crate) fn share_slots(mut self, slots: Arc<Semaphore>) -> Listener {
        self.slots = slots;
        self
    }

    /// Counts what it accepts and holds open.
    pub(crate) fn counted(mut self, counted: Counted) -> Listener {
        self.counted = Some(counted);
        self
    }

    /// The limits its connections will get, for a reload to change: connections accepted
    /// after [`LiveLimits::set`] get the new ones.
    pub(crate) fn live_limits(&self) -> Arc<LiveLimits> {
        self.limits.clone()
    }

    /// Serves TLS (HTTP/1.1 and h2 by ALPN) instead of cleartext.
    pub(crate) fn tls(mut self, acceptor: Option<TlsAcceptor>) -> Listener {
        self.tls = acceptor;
        self
    }

    /// Accepts and serves until `shutdown` resolves, then closes the socket and returns the
    /// connections still open, for the caller to [`Drain`].
    pub async fn run<H: Handler>(self, handler: H, shutdown: impl Future<Output = ()>) -> Drain {
        let shared = Arc::new(Shared {
            handler: Arc::new(handler),
            settings: self.limits,
            tls: self.tls,
            name: self.name,
        });
        let slots = self.slots;
        let connections = TaskTracker::new();
        let stop = Stop::default();
        let mut backoff = Backoff::new(self.name);
        tokio::pin!(shutdown);
        loop {
            // Accepted first, then given a slot: an accept loop waiting for a connection must
            // not hold one. Workers share the slots but not the sockets, and the kernel picks
            // the socket: with a slot held by a worker idle in accept, a connection queued on
            // another worker's socket would wait with the proxy under its bound (three
            // connections open of `max_connections: 3`, one slot reserved, a fourth waiting
            // for an unrelated connection to close). At the bound, each worker holds the one
            // connection it accepted until a slot frees, and accepts no other: the rest wait
            // in the kernel's accept queue.
            let (tcp, peer) = tokio::select! {
                accepted = self.tcp.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        if let Some(pause) = backoff.failed(&error) {
                            tokio::select! {
                                () = tokio::time::sleep(pause) => {}
                                () = &mut shutdown => break,
                            }
                        }
                        continue;
                    }
                },
                () = &mut shutdown => break,
            };
            backoff.succeeded();
            let slot = tokio::select! {
                slot = slots.clone().acquire_owned() => match slot {
                    Ok(slot) => slot,
                    // The semaphore is never closed.
                    Err(_) => break,
                },
                () = &mut shutdown => break,
            };
            if let Err(error) = tcp.set_nodelay(true) {
                tracing::debug!(listener = self.name, %peer, %error, "set_nodelay failed");
            }
            let open = self.counted.as_ref().map(|c| {
                c.accepted.inc();
                OpenConnection::new(c.open.clone())
            });
            let shared = shared.clone();
            // Cloned before the task starts, so that a drain beginning during a TLS handshake
            // still reaches this connection.
            let stop = stop.clone();
            connections.spawn(async move {
                let _slot = slot;
                let _open = open;
                connection::serve(shared, tcp, peer, stop).await;
            });
        }
        drop(self.tcp);
        Drain { connections, stop }
    }
}

/// One connection counted open until it is dropped.
struct OpenConnection(Gauge);

impl OpenConnection {
    fn new(open: Gauge) -> OpenConnection {
        open.inc();
        OpenConnection(open)
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// The connections of a listener that has stopped accepting.
#[derive(Debug)]
pub struct Drain {
    connections: TaskTracker,
    stop: Stop,
}

impl Drain {
    /// Tells every connection to finish the requests it is serving and close (HTTP/1.1: no
    /// keep-alive; HTTP/2: GOAWAY), and waits until all have.
    pub(crate) async fn close(&self) {
        self.stop.graceful.cancel();
        self.connections.close();
        self.connections.wait().await;
    }

    /// Closes every connection still open at once.
    pub(crate) fn abort(&self) {
        self.stop.now.cancel();
    }

    /// [`Drain::close`] for at most `timeout`, then [`Drain::abort`]; whether every connection
    /// closed in time.
    pub async fn close_within(&self, timeout: Duration) -> bool {
        let closed = tokio::time::timeout(timeout, self.close()).await.is_ok();
        if !closed {
            self.abort();
        }
        closed
    }
}
