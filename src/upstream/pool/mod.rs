//! One upstream's HTTP/1.1 connections on one worker: a stack of idle ones, reused most
//! recent first, and dropped — never reused — once they may have been idle, as the upstream
//! counts it, for `pool_idle_timeout` (SPEC §4.3).
//!
//! hyper-util's pooled client did this before, keyed by scheme and authority for any number
//! of hosts, behind a lock shared by every task, and it spawned a task for every response to
//! give the connection back when it was ready again. Each [`Pool`] here serves one upstream
//! on one worker, so a checkout is a pop from a vector, and a connection goes back from the
//! response body the moment the body has ended (hyper's connection task has taken the
//! response's last byte by then and is ready for the next request). callgrind put the legacy
//! client at ~9,000 instructions a pass-through request, most of it SipHash and the pool's
//! bookkeeping.
//!
//! A connection is reused only when it is known to be between requests: its response body
//! ended, and hyper says it is ready and not closed. A body dropped before its end leaves the
//! connection mid-response, and it is closed, not reused.
//!
//! A connection's idle time counts from the arrival of its last response's head, not from the
//! end of its body: the upstream counts its idle time from when it finished sending, which for
//! a large body streamed to a slow client is long before the proxy has read it all. Counted
//! from the body's end, such a connection would look fresh to the proxy while the upstream is
//! about to close it — the keep-alive race `pool_idle_timeout` is there to avoid.
//!
//! Deadlines: a request has one, the end of `upstreams.*.timeout`. A new connection (TCP
//! connect, TLS handshake) must be made within `connect_timeout` and before that deadline; if
//! it is not, nothing was sent, and that is a [`SendError::Connect`] whichever ran out. Once a
//! connection took the request, a deadline that passes is a [`SendError::TimedOut`].
//!
//! A request that carries a [`WriteBy`] (every request of an idempotent route) has a send
//! deadline as well: no byte of it is written at or after that instant (checked by the socket
//! before every write, see [`watched`]), and if no response head has come by then the
//! connection is reset, so nothing still queued reaches the upstream late. A request cut
//! before any of its bytes was written is [`SendError::Unsent`]: its outcome is known.

mod watched;

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, Uri};
use http_body::{Body as _, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use tokio::time::Instant;
use tower_service::Service;

use self::watched::{Gate, Received, Watched};
use crate::body::Body;

/// The connector under every pool: TCP, and TLS for an https upstream.
pub(crate) type Connector = HttpsConnector<HttpConnector>;

/// How a request failed to get a response head.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SendError {
    /// No connection could be made, or not in time: nothing was sent.
    #[error("{0}")]
    Connect(String),
    /// A connection took the request, and no response head came before the deadline.
    #[error("no response head before the deadline")]
    TimedOut,
    /// HTTP/2: the upstream reset the request's stream with `REFUSED_STREAM`, which says it
    /// did not process it (RFC 9113 §8.7): not received, so it may be sent again.
    #[error("the upstream refused the stream (REFUSED_STREAM): {0}")]
    Refused(#[source] hyper::Error),
    /// The request's send deadline ([`WriteBy`]) passed before any byte of it was written:
    /// nothing was sent, and the connection was reset.
    #[error("{0}")]
    Unsent(String),
    /// The connection failed while the request was sent or its response awaited.
    #[error("{error}")]
    Failed {
        #[source]
        error: hyper::Error,
        /// The connection had carried an earlier request.
        reused: bool,
        /// The upstream had sent a byte of this request's response.
        answered: bool,
    },
}

impl SendError {
    /// The connection had served before and failed — closed, reset, or the write failed —
    /// before any byte of a response came back: most likely the upstream closed it as the
    /// request went out (the keep-alive race of SPEC §4.3), so a fresh connection may get an
    /// answer.
    pub(crate) fn unanswered_on_reused(&self) -> bool {
        match self {
            SendError::Connect(_)
            | SendError::TimedOut
            | SendError::Refused(_)
            | SendError::Unsent(_) => false,
            SendError::Failed {
                error,
                reused,
                answered,
            } => *reused && !*answered && connection_failed(error),
        }
    }
}

/// Whether hyper's error is the connection's failure (an end of stream, a reset, a failed
/// write), not something the request itself caused.
fn connection_failed(error: &hyper::Error) -> bool {
    if error.is_incomplete_message() || error.is_canceled() || error.is_closed() {
        return true;
    }
    let mut source = std::error::Error::source(error);
    while let Some(s) = source {
        if s.is::<std::io::Error>() {
            return true;
        }
        source = s.source();
    }
    false
}

/// The send deadline of a request, carried in its extensions: no byte of it is written at or
/// after this instant, and its connection is reset then if no response head has come (SPEC
/// §4.8). The exchange of an idempotent route sets it to an instant taken before its claim was
/// sent plus the upstream's `timeout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WriteBy(pub Instant);

/// A response head on its way.
pub(crate) type Responding<'a> =
    Pin<Box<dyn Future<Output = Result<Response<Body>, SendError>> + Send + 'a>>;

/// The connections of one upstream on one worker.
pub(crate) struct Pool {
    inner: Arc<Inner>,
}

struct Inner {
    connector: Connector,
    /// Where connections go: the upstream URL's scheme and authority.
    target: Uri,
    /// How long making a connection (TCP connect, TLS handshake) may take.
    connect_timeout: Duration,
    /// Zero: a connection serves one request and is closed.
    idle_timeout: Duration,
    /// Ordered by `since`, the most recent last.
    idle: Mutex<Vec<Idle>>,
    /// A reaper task runs (started with the first connection put back, on the worker's runtime).
    reaping: AtomicBool,
}

struct Idle {
    conn: Conn,
    /// When its last response's head arrived: the upstream has counted it idle since then at
    /// the latest.
    since: Instant,
}

/// One connection: hyper's handle to send on it, and what the upstream has sent on it.
struct Conn {
    sender: SendRequest<Body>,
    received: Received,
    /// The send deadline of the request it carries.
    gate: Gate,
}

impl Pool {
    pub(crate) fn new(
        connector: Connector,
        target: Uri,
        connect_timeout: Duration,
        idle_timeout: Duration,
    ) -> Pool {
        Pool {
            inner: Arc::new(Inner {
                connector,
                target,
                connect_timeout,
                idle_timeout,
                idle: Mutex::new(Vec::new()),
                reaping: AtomicBool::new(false),
            }),
        }
    }

    /// Sends `req` (origin-form URI) on an idle connection, or a new one, and waits for the
    /// response head until `deadline`. A request that a pooled connection closed before taking
    /// is sent on a new one: nothing of it reached the upstream.
    ///
    /// Boxed, like every future here that a request awaits: inline, its state (the request,
    /// the connection, hyper's answer) would grow the exchange's future, which is boxed and
    /// moved once a request, by its size again at every level (callgrind: ~9,000 instructions
    /// of `memcpy` a new key, for one allocation here).
    pub(crate) fn send(&self, req: Request<Body>, deadline: Instant) -> Responding<'_> {
        Box::pin(async move {
            let mut req = req;
            while let Some(lent) = self.inner.checkout() {
                match lent.try_send(req, deadline).await {
                    Sent::Answered(resp) => return Ok(resp),
                    Sent::TimedOut => return Err(SendError::TimedOut),
                    Sent::Unsent(detail) => return Err(SendError::Unsent(detail)),
                    Sent::Failed { error, answered } => {
                        return Err(SendError::Failed {
                            error,
                            reused: true,
                            answered,
                        });
                    }
                    Sent::NotTaken(back) => req = back,
                }
            }
            self.send_fresh(req, deadline).await
        })
    }

    /// Sends `req` on a connection of its own, made for it, and waits for the response head
    /// until `deadline`.
    pub(crate) fn send_fresh(&self, req: Request<Body>, deadline: Instant) -> Responding<'_> {
        Box::pin(async move {
            let lent = self.inner.connect(deadline).await?;
            match lent.try_send(req, deadline).await {
                Sent::Answered(resp) => Ok(resp),
                Sent::TimedOut => Err(SendError::TimedOut),
                Sent::Unsent(detail) => Err(SendError::Unsent(detail)),
                Sent::Failed { error, answered } => Err(SendError::Failed {
                    error,
                    reused: false,
                    answered,
                }),
                Sent::NotTaken(_) => Err(SendError::Connect(
                    "the new connection closed before it took the request".to_owned(),
                )),
            }
        })
    }
}

/// A connection lent to one request.
struct Lent {
    conn: Conn,
    pool: Weak<Inner>,
}

enum Sent {
    Answered(Response<Body>),
    /// The connection failed after taking the request: the upstream may have acted.
    Failed {
        error: hyper::Error,
        /// A byte of the response had come back.
        answered: bool,
    },
    /// The connection took the request, and the deadline passed before the response head
    /// came: the upstream may have acted.
    TimedOut,
    /// The connection closed before taking the request; here it is back.
    NotTaken(Request<Body>),
    /// The request's send deadline passed before any byte of it was written; the connection
    /// was reset.
    Unsent(String),
}

impl Lent {
    async fn try_send(mut self, req: Request<Body>, deadline: Instant) -> Sent {
        // Whatever the upstream sent before this request belonged to earlier responses, all
        // read to their end: anything more is this request's answer.
        let before = self.conn.received.get();
        let write_by = req.extensions().get::<WriteBy>().map(|w| w.0);
        self.conn.gate.arm(write_by);
        let deadline = write_by.map_or(deadline, |by| by.min(deadline));
        let sent = tokio::time::timeout_at(deadline, self.conn.sender.try_send_request(req)).await;
        if write_by.is_some() && (sent.is_err() || self.conn.gate.was_cut()) {
            // No head by the send deadline: reset the connection now, even while it waits
            // on a slow reader, so no byte still queued for it reaches the upstream late.
            self.conn.gate.cut();
            if self.conn.gate.written() == 0 {
                return Sent::Unsent(
                    "the request's deadline (upstreams.*.timeout, counted from before its claim) passed before any byte of it was written; the connection was reset".to_owned(),
                );
            }
        }
        match sent {
            Err(_) => Sent::TimedOut,
            Ok(Ok(resp)) => {
                let head_at = Instant::now();
                Sent::Answered(resp.map(|incoming| {
                    crate::body::boxed(Returning {
                        inner: incoming,
                        lent: Some(self),
                        head_at,
                    })
                }))
            }
            Ok(Err(mut e)) => match e.take_message() {
                Some(req) => Sent::NotTaken(req),
                None => Sent::Failed {
                    error: e.into_error(),
                    answered: self.conn.received.get() > before,
                },
            },
        }
    }

    /// The response whose head arrived at `head_at` has ended: the connection goes back to its
    /// pool if it can serve again.
    fn give_back(self, head_at: Instant) {
        // Its request has been answered whole: no deadline of its own any more.
        self.conn.gate.arm(None);
        if let Some(pool) = self.pool.upgrade() {
            pool.put(self.conn, head_at);
        }
    }
}

impl Inner {
    fn checkout(self: &Arc<Self>) -> Option<Lent> {
        let now = Instant::now();
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(Idle { conn, since }) = idle.pop() {
            if now.duration_since(since) >= self.idle_timeout {
                // Every connection below it has been idle longer still.
                idle.clear();
                return None;
            }
            if conn.sender.is_ready() && !conn.sender.is_closed() {
                return Some(Lent {
                    conn,
                    pool: Arc::downgrade(self),
                });
            }
        }
        None
    }

    /// A new connection, made within `connect_timeout` and before `deadline`. Either running
    /// out means nothing was sent: a connect error, never a timeout (SPEC §4.4).
    async fn connect(self: &Arc<Self>, deadline: Instant) -> Result<Lent, SendError> {
        let started = Instant::now();
        let own = started + self.connect_timeout;
        let by = own.min(deadline);
        match tokio::time::timeout_at(by, self.make()).await {
            Ok(made) => made,
            Err(_) if by == own => Err(SendError::Connect(format!(
                "no connection within connect_timeout ({}): the TCP connect or the TLS handshake did not finish",
                humantime::format_duration(self.connect_timeout)
            ))),
            Err(_) => Err(SendError::Connect(format!(
                "no connection within what was left of timeout ({}): the TCP connect or the TLS handshake did not finish",
                humantime::format_duration(millis(by.saturating_duration_since(started)))
            ))),
        }
    }

    /// TCP connect, TLS handshake for an https upstream, and hyper's HTTP/1.1 handshake (which
    /// only sets up the connection's state: nothing is written).
    async fn make(self: &Arc<Self>) -> Result<Lent, SendError> {
        let io = self
            .connector
            .clone()
            .call(self.target.clone())
            .await
            .map_err(|e| SendError::Connect(crate::upstream::error_chain(&*e)))?;
        let received = Received::default();
        let gate = Gate::default();
        let io = TokioIo::new(Watched::new(
            TokioIo::new(io),
            received.clone(),
            gate.clone(),
        ));
        let (sender, conn) = http1::Builder::new()
            .handshake(io)
            .await
            .map_err(|e| SendError::Connect(format!("HTTP/1.1 handshake failed: {e}")))?;
        tokio::spawn(async move {
            if let Err(error) = conn.await {
                tracing::debug!(%error, "upstream connection ended with an error");
            }
        });
        Ok(Lent {
            conn: Conn {
                sender,
                received,
                gate,
            },
            pool: Arc::downgrade(self),
        })
    }

    /// Keeps `conn`, whose last response's head arrived at `since`, for the next request, if
    /// it can serve one before the upstream may count it idle for `idle_timeout`.
    fn put(self: &Arc<Self>, conn: Conn, since: Instant) {
        if self.idle_timeout.is_zero()
            || conn.sender.is_closed()
            || !conn.sender.is_ready()
            || since.elapsed() >= self.idle_timeout
        {
            // Not between requests, idle too long already (its body took that long to read),
            // or not to be reused at all: dropping the sender closes it.
            return;
        }
        {
            let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            // Bodies end in another order than their heads arrived: keep the stack ordered by
            // `since`, which `checkout` and the reaper count on. Nearly always the top.
            let at = idle.partition_point(|c| c.since <= since);
            idle.insert(at, Idle { conn, since });
        }
        // On the worker's runtime, where every body is read; without one (a body dropped as a
        // runtime shuts down) the next put starts the reaper.
        if !self.reaping.load(Ordering::Relaxed)
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            self.reaping.store(true, Ordering::Relaxed);
            runtime.spawn(reap(Arc::downgrade(self), self.idle_timeout));
        }
    }
}

/// A duration rounded to whole milliseconds, for messages.
fn millis(d: Duration) -> Duration {
    Duration::from_millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Closes the connections idle for `idle_timeout`, so that a quiet upstream does not keep
/// them open; ends with the pool.
async fn reap(pool: Weak<Inner>, idle_timeout: Duration) {
    let mut every = tokio::time::interval(idle_timeout.max(Duration::from_millis(100)));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let Some(pool) = pool.upgrade() else { return };
        let now = Instant::now();
        pool.idle
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|c| now.duration_since(c.since) < idle_timeout && !c.conn.sender.is_closed());
    }
}

/// A response body that gives its connection back once it has ended.
struct Returning {
    inner: Incoming,
    lent: Option<Lent>,
    /// When the response's head arrived.
    head_at: Instant,
}

impl Returning {
    fn ended(&mut self) {
        if let Some(lent) = self.lent.take() {
            lent.give_back(self.head_at);
        }
    }
}

impl http_body::Body for Returning {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => self.ended(),
            // A reader that trusts `is_end_stream` does not ask again after the last frame.
            Poll::Ready(Some(Ok(_))) if self.inner.is_end_stream() => self.ended(),
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Returning {
    fn drop(&mut self) {
        // A body without bytes (204, 304, a HEAD) may never be polled.
        if self.inner.is_end_stream() {
            self.ended();
        }
    }
}

#[cfg(test)]
mod tests;
