//! What a listener serves ([`Handler`]), the client it sees ([`Peer`]), what it lets each
//! client hold ([`ListenerLimits`]), and what its connection tasks share: the types both the
//! accept loop ([`super::listener`]) and the connection tasks ([`super::connection`]) use.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::TokioTimer;
use hyper_util::server::conn::auto;
use tokio_rustls::TlsAcceptor;

use crate::body::BoxError;

/// What one listener lets each client hold.
#[derive(Debug, Clone, Copy)]
pub struct ListenerLimits {
    /// Connections open at once. Past it, accepting pauses and new connections wait in the
    /// kernel's queue: a flood of idle sockets cannot exhaust memory or file descriptors.
    pub max_connections: usize,
    /// From the accept, the deadline of the TLS handshake and the first request; then of each
    /// HTTP/1.1 request head, and of an idle connection (either protocol, no request in
    /// progress) since its last response.
    pub header_read_timeout: Duration,
    /// How long a response may make no write progress before it is abandoned and its
    /// connection closed.
    pub send_timeout: Duration,
    /// HTTP/1.1 request headers at most (HTTP/2 has no such setting: a handler that cares
    /// counts them itself). hyper refuses more itself, before the handler: a bare 431.
    pub max_headers: usize,
    /// Bytes of request head at most: the HTTP/1.1 read buffer, the HTTP/2 header list. hyper
    /// refuses more itself (a bare 431); a handler may keep tighter limits of its own, as the
    /// proxy's does, to answer them on both protocols alike.
    pub max_head_bytes: usize,
}

/// What a listener serves: one call per request. `peer` is the connection's client.
pub trait Handler: Send + Sync + 'static {
    type Body: http_body::Body<Data = Bytes, Error: Into<BoxError>> + Send + Unpin + 'static;
    /// A failure that hyper answers by closing the connection (a handler with an HTTP answer
    /// for everything uses `Infallible`).
    type Error: Into<BoxError>;

    /// Answers one request. Everything is passed owned, so that the answer borrows nothing and
    /// hyper can run it on its own.
    fn call(
        self: Arc<Self>,
        req: Request<Incoming>,
        peer: Peer,
    ) -> impl Future<Output = Result<Response<Self::Body>, Self::Error>> + Send + 'static;
}

/// The client of a connection, as a [`Handler`] sees it.
#[derive(Debug, Clone)]
pub struct Peer {
    addr: SocketAddr,
    reset: Arc<AtomicBool>,
}

impl Peer {
    pub(super) fn new(addr: SocketAddr, reset: Arc<AtomicBool>) -> Peer {
        Peer { addr, reset }
    }

    /// The client's address.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Ends the connection abruptly: from now on nothing more is written (not even a FIN),
    /// and the socket closes with a TCP reset. The mock upstream plays a crashing server with
    /// it.
    pub fn reset(&self) {
        self.reset.store(true, Ordering::SeqCst);
    }
}

/// What every connection task of one listener shares.
pub(super) struct Shared<H> {
    pub(super) handler: Arc<H>,
    /// Read once by each connection, at its start.
    pub(super) settings: Arc<LiveLimits>,
    pub(super) tls: Option<TlsAcceptor>,
    pub(super) name: &'static str,
}

/// A listener's per-connection limits as the next connection gets them. A reload may replace
/// them ([`LiveLimits::set`]): connections accepted after it get the new ones, connections
/// already open keep theirs.
pub struct LiveLimits(ArcSwap<ConnectionSettings>);

/// The limits of one connection and the hyper builder that keeps them, built together once
/// per change rather than once per connection.
pub(super) struct ConnectionSettings {
    pub(super) limits: ListenerLimits,
    pub(super) builder: auto::Builder<BoxedSpawn>,
}

impl LiveLimits {
    pub(super) fn new(limits: ListenerLimits) -> LiveLimits {
        LiveLimits(ArcSwap::from_pointee(ConnectionSettings::new(limits)))
    }

    /// The limits of the connections accepted from now on. `max_connections` is not among
    /// them: it bounds the accept loop, which keeps the bound it started with.
    pub fn set(&self, limits: ListenerLimits) {
        self.0.store(Arc::new(ConnectionSettings::new(limits)));
    }

    pub(super) fn load_full(&self) -> Arc<ConnectionSettings> {
        self.0.load_full()
    }
}

impl ConnectionSettings {
    fn new(limits: ListenerLimits) -> ConnectionSettings {
        ConnectionSettings {
            limits,
            builder: builder(&limits),
        }
    }
}

/// Runs the task hyper spawns for each HTTP/2 request (the stream: the handler's future and
/// the response it sends) boxed. The proxy's future is large (every step of the flow): in the
/// runtime's task cell it would be copied whole at the spawn and again at each change of the
/// task's stage, several times a request; boxed, once. HTTP/1.1 spawns nothing a request.
#[derive(Clone, Copy)]
pub(super) struct BoxedSpawn;

impl<F> hyper::rt::Executor<F> for BoxedSpawn
where
    F: Future<Output = ()> + Send + 'static,
{
    fn execute(&self, future: F) {
        tokio::spawn(Box::pin(future));
    }
}

/// hyper refuses a smaller HTTP/1 buffer (it must hold a request line and a few headers).
const MIN_HEAD_BYTES: usize = 8192;

/// The builder the connections share: hyper's own limits.
fn builder(limits: &ListenerLimits) -> auto::Builder<BoxedSpawn> {
    let head_bytes = limits.max_head_bytes.max(MIN_HEAD_BYTES);
    let mut builder = auto::Builder::new(BoxedSpawn);
    builder
        .http1()
        .timer(TokioTimer::new())
        // Bounds each request head; for an idle keep-alive connection, hyper's deadline and
        // the connection task's are the same.
        .header_read_timeout(limits.header_read_timeout)
        .max_headers(limits.max_headers)
        .max_buf_size(head_bytes);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(head_bytes).unwrap_or(u32::MAX));
    builder
}
