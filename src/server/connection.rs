//! One connection's task: the TLS handshake, hyper serving it, and the deadlines hyper does not
//! keep — the first request, idleness on either protocol, responses that stall — and the drain.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulConnection;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_util::either::Either;
use tokio_util::sync::CancellationToken;

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
        let answer = handler.clone().call(req, peer_info.clone());
        async move {
            let response = answer.await?;
            Ok::<_, H::Error>(response.map(|body| Tracked::new(body, request)))
        }
    });
    let conn = settings.builder.serve_connection(TokioIo::new(io), service);
    watch(conn, &activity, &limits, shared.name, peer, &stop).await;
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

/// Drives `conn` to its end, closing it when it has been idle for `header_read_timeout`, when
/// a response has made no write progress for `send_timeout`, or when the listener drains.
///
/// Idle means no request in progress and nothing written: an HTTP/2 connection has no other
/// deadline once its first request arrived, and a connection that was accepted but never
/// spoke (not even enough for hyper to tell HTTP/1 from HTTP/2) has none at all. An idle
/// connection is asked to close gracefully (HTTP/2: GOAWAY), and dropped if it is still idle
/// a whole deadline later (a client that never answers the GOAWAY's PING).
async fn watch<C>(
    conn: C,
    activity: &Activity,
    limits: &ListenerLimits,
    name: &'static str,
    peer: SocketAddr,
    stop: &Stop,
) where
    C: GracefulConnection,
    C::Error: std::fmt::Display,
{
    tokio::pin!(conn);
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
                return;
            }
            Next::Idle => {
                tracing::debug!(listener = name, %peer, "idle for limits.header_read_timeout: closing");
                conn.as_mut().graceful_shutdown();
                closing = Some(now);
                continue;
            }
            Next::Stalled => {
                tracing::debug!(
                    listener = name,
                    %peer,
                    "a response made no write progress within limits.send_timeout: abandoning it and closing"
                );
                return;
            }
        };
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(error) = result {
                    tracing::debug!(listener = name, %peer, %error, "connection ended with an error");
                }
                return;
            }
            () = stop.graceful.cancelled(), if !draining => {
                draining = true;
                if closing.is_none() {
                    conn.as_mut().graceful_shutdown();
                    closing = Some(Instant::now());
                }
            }
            () = stop.now.cancelled() => return,
            () = activity.idle.notified() => {}
            () = tokio::time::sleep_until(wake) => {}
        }
    }
}
