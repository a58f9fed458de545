//! One HTTP/2 upstream's connection on one worker (`protocol: h2c` or `h2`, SPEC §4.11): many
//! requests, each a stream, on one connection, made when the first request needs it and made
//! again when it closes (a `GOAWAY`, an error, the upstream's restart).
//!
//! **Sent or not.** The line between "not sent" and "maybe received" (SPEC §4.4) is drawn where
//! the HTTP/2 client can know it:
//! - a request hyper hands back unsent (the connection closed before a stream was opened for
//!   it) was not received: it is sent once more, on a fresh connection, whatever the route's
//!   policy — servers that age their connections out send `GOAWAY` routinely;
//! - a stream the upstream reset with `REFUSED_STREAM` was not processed (RFC 9113 §8.7):
//!   [`SendError::Refused`], which the caller sends once more on a fresh connection when it
//!   still holds the request's bytes;
//! - every other failure once the request was handed to the connection (a reset, a `GOAWAY`
//!   with an error code reaching the stream, the connection's loss) may have been received: an
//!   unknown outcome.
//!
//! **Deadlines.** On an idempotent route a request carries its send deadline ([`WriteBy`]):
//! past it the request is not sent at all, and a stream with no response head by then is
//! reset. Making the connection (TCP connect, the TLS handshake with ALPN `h2`, the
//! HTTP/2 preface) is bounded by `connect_timeout` and by the request's deadline, and is a
//! [`SendError::Connect`] when it does not finish. At the deadline the response future is
//! dropped, which resets the stream (`RST_STREAM` with `CANCEL`): the upstream is told at once,
//! and the connection goes on serving the other streams.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Request, Response, Uri};
use hyper::client::conn::http2::{self, SendRequest};
use hyper_util::rt::TokioTimer;
use tokio::time::Instant;
use tower_service::Service;

use super::pool::{Connector, Responding, SendError, WriteBy};
use crate::body::{self, Body};

/// The HTTP/2 connection of one upstream on one worker.
pub(crate) struct H2Pool {
    inner: Arc<Inner>,
}

struct Inner {
    connector: Connector,
    /// Where the connection goes: the upstream URL's scheme and authority.
    target: Uri,
    connect_timeout: Duration,
    /// The connection in use, while it is open.
    current: Mutex<Option<Conn>>,
    /// The number the next connection gets.
    next: std::sync::atomic::AtomicU64,
    /// Held while a connection is being made, so that a burst of first requests makes one
    /// connection and shares it, instead of one each.
    connecting: tokio::sync::Mutex<()>,
}

impl H2Pool {
    pub(crate) fn new(connector: Connector, target: Uri, connect_timeout: Duration) -> H2Pool {
        H2Pool {
            inner: Arc::new(Inner {
                connector,
                target,
                connect_timeout,
                current: Mutex::new(None),
                next: std::sync::atomic::AtomicU64::new(0),
                connecting: tokio::sync::Mutex::new(()),
            }),
        }
    }

    /// Sends `req` as a stream of the open connection (made if there is none) and waits for
    /// the response head until `deadline`. A request handed back unsent is sent once more on a
    /// fresh connection.
    pub(crate) fn send(&self, req: Request<Body>, deadline: Instant) -> Responding<'_> {
        Box::pin(async move {
            let conn = self.inner.connection(deadline, None).await?;
            let used = conn.id;
            match self.inner.try_send(conn, req, deadline).await {
                Attempt::Done(result) => result,
                Attempt::Unsent(req) => {
                    // The connection closed before it opened a stream for the request: nothing
                    // of it went out. Once more, on a connection that is not that one.
                    let fresh = self.inner.connection(deadline, Some(used)).await?;
                    match self.inner.try_send(fresh, req, deadline).await {
                        Attempt::Done(result) => result,
                        Attempt::Unsent(_) => Err(SendError::Connect(
                            "the upstream's HTTP/2 connection closed twice before the request was sent"
                                .into(),
                        )),
                    }
                }
            }
        })
    }

    /// Sends `req` on a connection made for it (the open one is replaced): after a stream was
    /// refused, the next try goes to a connection the upstream has just accepted.
    pub(crate) fn send_fresh(&self, req: Request<Body>, deadline: Instant) -> Responding<'_> {
        Box::pin(async move {
            let stale = self.inner.open().map(|c| c.id);
            let conn = self.inner.connection(deadline, stale).await?;
            match self.inner.try_send(conn, req, deadline).await {
                Attempt::Done(result) => result,
                Attempt::Unsent(_) => Err(SendError::Connect(
                    "the upstream's HTTP/2 connection closed before the request was sent".into(),
                )),
            }
        })
    }
}

/// What one try on one connection came to.
enum Attempt {
    /// An answer, or a failure that ends the request.
    Done(Result<Response<Body>, SendError>),
    /// hyper handed the request back: no stream was opened for it.
    Unsent(Request<Body>),
}

/// One connection: hyper's handle to open streams on it, and its number in this pool.
#[derive(Clone)]
struct Conn {
    id: u64,
    sender: SendRequest<Body>,
}

impl Inner {
    /// The open connection, if any.
    fn open(&self) -> Option<Conn> {
        let current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        current.as_ref().filter(|c| !c.sender.is_closed()).cloned()
    }

    /// The open connection, or a new one; `not` is the number of a connection that must not
    /// be used again (it handed a request back, or refused one).
    async fn connection(&self, deadline: Instant, not: Option<u64>) -> Result<Conn, SendError> {
        let usable = |c: &Conn| !c.sender.is_closed() && not != Some(c.id);
        if let Some(open) = self.open().filter(usable) {
            return Ok(open);
        }
        let started = Instant::now();
        let own = started + self.connect_timeout;
        let by = own.min(deadline);
        let made = tokio::time::timeout_at(by, async {
            let _making = self.connecting.lock().await;
            // Another request may have made one while this one waited.
            if let Some(open) = self.open().filter(usable) {
                return Ok(open);
            }
            let conn = Conn {
                id: self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                sender: self.make().await?,
            };
            *self.current.lock().unwrap_or_else(|p| p.into_inner()) = Some(conn.clone());
            Ok(conn)
        })
        .await;
        match made {
            Ok(made) => made,
            Err(_) if by == own => Err(SendError::Connect(format!(
                "no HTTP/2 connection within connect_timeout ({}): the TCP connect, the TLS handshake or the HTTP/2 preface did not finish",
                humantime::format_duration(self.connect_timeout)
            ))),
            Err(_) => Err(SendError::Connect(
                "no HTTP/2 connection within what was left of timeout: the TCP connect, the TLS handshake or the HTTP/2 preface did not finish"
                    .into(),
            )),
        }
    }

    /// TCP connect, the TLS handshake (ALPN `h2`) for `h2`, and HTTP/2's handshake.
    async fn make(&self) -> Result<SendRequest<Body>, SendError> {
        let io = self
            .connector
            .clone()
            .call(self.target.clone())
            .await
            .map_err(|e| SendError::Connect(crate::upstream::error_chain(&*e)))?;
        let (sender, conn) = http2::Builder::new(BoxedSpawn)
            .timer(TokioTimer::new())
            .handshake(io)
            .await
            .map_err(|e| SendError::Connect(format!("HTTP/2 handshake failed: {e}")))?;
        tokio::spawn(async move {
            if let Err(error) = conn.await {
                tracing::debug!(%error, "upstream HTTP/2 connection ended with an error");
            }
        });
        Ok(sender)
    }

    /// One try of `req` on `sender`, its response head awaited until `deadline` (then the
    /// response future is dropped, which resets the stream).
    async fn try_send(&self, conn: Conn, req: Request<Body>, deadline: Instant) -> Attempt {
        // The send deadline of an idempotent route's request (SPEC §4.8): nothing of it is
        // written at or after it, and a stream with no response head by then is reset (the
        // response future dropped), so no byte still held back by flow control goes out late.
        let write_by = req.extensions().get::<WriteBy>().map(|by| by.0);
        if write_by.is_some_and(|by| Instant::now() >= by) {
            return Attempt::Done(Err(SendError::Unsent(
                "the request's send deadline (its claim's time plus the upstream's timeout) passed before it was written: nothing was sent"
                    .into(),
            )));
        }
        let deadline = write_by.map_or(deadline, |by| by.min(deadline));
        let Conn { id, mut sender } = conn;
        match tokio::time::timeout_at(deadline, sender.try_send_request(req)).await {
            Err(_) => Attempt::Done(Err(SendError::TimedOut)),
            Ok(Ok(resp)) => Attempt::Done(Ok(resp.map(body::boxed))),
            Ok(Err(mut e)) => match e.take_message() {
                Some(req) => Attempt::Unsent(req),
                None => {
                    let error = e.into_error();
                    if refused(&error) {
                        self.forget(id);
                        return Attempt::Done(Err(SendError::Refused(error)));
                    }
                    Attempt::Done(Err(SendError::Failed {
                        error,
                        reused: false,
                        answered: false,
                    }))
                }
            },
        }
    }

    /// Stops opening streams on connection `id` (its streams in flight go on).
    fn forget(&self, id: u64) {
        let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if current.as_ref().is_some_and(|c| c.id == id) {
            *current = None;
        }
    }
}

/// Runs the tasks hyper's HTTP/2 client spawns — the connection's, and per request one that
/// waits for its response and one that sends its body — each boxed. hyper spawns all of them as
/// one enum, as large as its largest variant, the connection (its IO and codec): unboxed, every
/// request's two small tasks would copy that whole size into the runtime's task cell, and again
/// at each change of the task's stage, several times a request.
#[derive(Clone, Copy)]
struct BoxedSpawn;

impl<F> hyper::rt::Executor<F> for BoxedSpawn
where
    F: Future<Output = ()> + Send + 'static,
{
    fn execute(&self, future: F) {
        tokio::spawn(Box::pin(future));
    }
}

/// Whether the upstream reset the stream with `REFUSED_STREAM`: it did not process it.
pub(crate) fn refused(error: &hyper::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(s) = source {
        if let Some(h2) = s.downcast_ref::<h2::Error>() {
            return h2.reason() == Some(h2::Reason::REFUSED_STREAM);
        }
        source = s.source();
    }
    false
}
