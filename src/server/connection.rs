//! One connection's task: the TLS handshake and hyper serving it; and, on a task beside it, the
//! watcher of the deadlines hyper does not keep — the first request, idleness on either
//! protocol, responses that stall — and of the drain.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::task::Poll;

use futures_util::task::AtomicWaker;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulConnection;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_util::either::Either;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use super::activity::{Activity, InProgress, Next, Tracked};
use super::handler::{Handler, ListenerLimits, Peer, Shared};
use super::io::{ConnIo, Stream};

/// How the listener tells its connections to stop.
#[derive(Debug, Clone, Default)]
pub(super) struct Stop {
    /// Finish the requests in progress, then close.
    pub(super) graceful: CancellationToken,
    /// Close now: the drain deadline has passed.
    pub(super) now: CancellationToken,
}

/// Serves one accepted connection to its end.
pub(super) async fn serve<H: Handler>(
    shared: Arc<Shared<H>>,
    tcp: TcpStream,
    peer: SocketAddr,
    stop: Stop,
) {
    // Read once: a reload that changes the listener's limits applies to connections accepted
    // after it, and this one keeps the deadlines it started with.
    let settings = shared.settings.load_full();
    let limits = settings.limits;
    let activity = Arc::new(Activity::new());
    let Some(stream) = handshake(&shared, &limits, tcp, peer, &activity).await else {
        return;
    };
    let reset = Arc::new(AtomicBool::new(false));
    let io = ConnIo::new(stream, activity.clone(), limits.send_timeout, reset.clone());
    let peer_info = Peer::new(peer, reset);
    let handler = shared.handler.clone();
    let books = activity.clone();
    let service = service_fn(move |req| {
        // Counted from here until the response body is finished or dropped.
        let request = InProgress::start(&books);
        // Boxed where it is made: a task a request holds it over HTTP/2 (see `BoxedSpawn`), and
        // the proxy's is large (every step of the flow), so the stream's task stays small.
        let answer = Box::pin(handler.clone().call(req, peer_info.clone()));
        async move {
            let response = answer.await?;
            Ok::<_, H::Error>(response.map(|body| Tracked::new(body, request)))
        }
    });
    let conn = settings.builder.serve_connection(TokioIo::new(io), service);
    watch(conn, activity, limits, shared.name, peer, stop).await;
}

/// The TLS handshake, if the listener has TLS, within the first-request deadline. It runs in
/// the connection's own task, never in the accept loop: a slow or silent client holds only
/// its own connection.
async fn handshake<H: Handler>(
    shared: &Shared<H>,
    limits: &ListenerLimits,
    tcp: TcpStream,
    peer: SocketAddr,
    activity: &Activity,
) -> Option<Stream> {
    let Some(acceptor) = &shared.tls else {
        return Some(Either::Left(tcp));
    };
    let by = activity.first_request_by(limits.header_read_timeout);
    match tokio::time::timeout_at(by, acceptor.accept(tcp)).await {
        Ok(Ok(tls)) => Some(Either::Right(tls)),
        Ok(Err(error)) => {
            tracing::debug!(listener = shared.name, %peer, %error, "TLS handshake failed");
            None
        }
        Err(_) => {
            tracing::debug!(
                listener = shared.name,
                %peer,
                "no TLS handshake within limits.header_read_timeout: closing"
            );
            None
        }
    }
}

/// What the watcher asks of the connection task; [`Order::None`] until it asks anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Order {
    None = 0,
    /// Finish the request in progress, then close (HTTP/2: GOAWAY).
    Close = 1,
    /// Drop the connection now, with whatever response it holds.
    Drop = 2,
}

/// How the watcher reaches the connection task: an order and the task's waker. The task
/// reads the order each time it runs, an atomic load: it never polls the watcher's timers
/// and cancellation futures itself, which would take their locks on every wake-up of a busy
/// connection (twice a request at least) instead of once a deadline.
#[derive(Debug, Default)]
struct Control {
    order: AtomicU8,
    waker: AtomicWaker,
}

impl Control {
    fn give(&self, order: Order) {
        // An order only ever escalates: a close never takes back a drop.
        self.order.fetch_max(order as u8, Ordering::SeqCst);
        self.waker.wake();
    }

    fn order(&self) -> Order {
        match self.order.load(Ordering::SeqCst) {
            0 => Order::None,
            1 => Order::Close,
            _ => Order::Drop,
        }
    }
}

/// Drives `conn` to its end, doing what the watcher orders: closing it gracefully when it has
/// been idle for `header_read_timeout` or the listener drains, dropping it when a response
/// has made no write progress for `send_timeout`, when it is still idle a whole deadline
/// after being asked to close, or when the drain deadline passes.
async fn watch<C>(
    conn: C,
    activity: Arc<Activity>,
    limits: ListenerLimits,
    name: &'static str,
    peer: SocketAddr,
    stop: Stop,
) where
    C: GracefulConnection,
    C::Error: std::fmt::Display,
{
    let control = Arc::new(Control::default());
    // Aborted when the connection ends, whichever way.
    let _watcher = AbortOnDropHandle::new(tokio::spawn(watcher(
        activity,
        limits,
        name,
        peer,
        stop,
        control.clone(),
    )));
    tokio::pin!(conn);
    let mut closing = false;
    let result = std::future::poll_fn(|cx| {
        control.waker.register(cx.waker());
        match control.order() {
            Order::Drop => return Poll::Ready(None),
            Order::Close if !closing => {
                closing = true;
                conn.as_mut().graceful_shutdown();
            }
            Order::Close | Order::None => {}
        }
        conn.as_mut().poll(cx).map(Some)
    })
    .await;
    if let Some(Err(error)) = result {
        tracing::debug!(listener = name, %peer, %error, "connection ended with an error");
    }
}

/// Watches one connection's deadlines and the listener's stop, and tells the connection task
/// what to do through `control`. Idle means no request in progress and nothing written: an
/// HTTP/2 connection has no other deadline once its first request arrived, and a connection
/// that was accepted but never spoke (not even enough for hyper to tell HTTP/1 from HTTP/2)
/// has none at all. An idle connection is asked to close gracefully (HTTP/2: GOAWAY), and
/// dropped if it is still idle a whole deadline later (a client that never answers the
/// GOAWAY's PING).
async fn watcher(
    activity: Arc<Activity>,
    limits: ListenerLimits,
    name: &'static str,
    peer: SocketAddr,
    stop: Stop,
    control: Arc<Control>,
) {
    let mut closing: Option<Instant> = None;
    let mut draining = false;
    loop {
        let now = Instant::now();
        let wake = match activity.next(
            now,
            limits.header_read_timeout,
            limits.send_timeout,
            closing,
        ) {
            Next::Wait(at) => at,
            Next::Idle if closing.is_some() => {
                tracing::debug!(listener = name, %peer, "still idle after being asked to close: dropping");
                control.give(Order::Drop);
                return;
            }
            Next::Idle => {
                tracing::debug!(listener = name, %peer, "idle for limits.header_read_timeout: closing");
                control.give(Order::Close);
                closing = Some(now);
                continue;
            }
            Next::Stalled => {
                tracing::debug!(
                    listener = name,
                    %peer,
                    "a response made no write progress within limits.send_timeout: abandoning it and closing"
                );
                control.give(Order::Drop);
                return;
            }
        };
        tokio::select! {
            () = stop.graceful.cancelled(), if !draining => {
                draining = true;
                if closing.is_none() {
                    control.give(Order::Close);
                    closing = Some(Instant::now());
                }
            }
            () = stop.now.cancelled() => {
                control.give(Order::Drop);
                return;
            }
            () = tokio::time::sleep_until(wake) => {}
        }
    }
}
