//! One upstream's HTTP/1.1 connections on one worker: a stack of idle ones, reused most
//! recent first, and dropped — never reused — once idle for `pool_idle_timeout` (SPEC §4.3).
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
use tokio::time::Instant;
use tower_service::Service;

use crate::body::Body;

/// The connector under every pool: TCP, and TLS for an https upstream.
pub(crate) type Connector = HttpsConnector<HttpConnector>;

/// How a request failed to get a response head.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SendError {
    /// No connection could be made: nothing was sent.
    #[error("{0}")]
    Connect(String),
    /// The connection failed while the request was sent or its response awaited.
    #[error("{error}")]
    Failed {
        #[source]
        error: hyper::Error,
        /// The connection had carried an earlier request.
        reused: bool,
    },
}

impl SendError {
    /// No response byte came back on a connection that had served before: the upstream closed
    /// it as the request went out (the keep-alive race of SPEC §4.3).
    pub(crate) fn unanswered_on_reused(&self) -> bool {
        match self {
            SendError::Connect(_) => false,
            SendError::Failed { error, reused } => {
                *reused && (error.is_incomplete_message() || error.is_canceled())
            }
        }
    }
}

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
    /// Zero: a connection serves one request and is closed.
    idle_timeout: Duration,
    /// Most recently idle last.
    idle: Mutex<Vec<Idle>>,
    /// A reaper task runs (started with the first connection put back, on the worker's runtime).
    reaping: AtomicBool,
}

struct Idle {
    sender: SendRequest<Body>,
    since: Instant,
}

impl Pool {
    pub(crate) fn new(connector: Connector, target: Uri, idle_timeout: Duration) -> Pool {
        Pool {
            inner: Arc::new(Inner {
                connector,
                target,
                idle_timeout,
                idle: Mutex::new(Vec::new()),
                reaping: AtomicBool::new(false),
            }),
        }
    }

    /// Sends `req` (origin-form URI) on an idle connection, or a new one, and waits for the
    /// response head. A request that a pooled connection closed before taking is sent on a
    /// new one: nothing of it reached the upstream.
    ///
    /// Boxed, like every future here that a request awaits: inline, its state (the request,
    /// the connection, hyper's answer) would grow the exchange's future, which is boxed and
    /// moved once a request, by its size again at every level (callgrind: ~9,000 instructions
    /// of `memcpy` a new key, for one allocation here).
    pub(crate) fn send(&self, req: Request<Body>) -> Responding<'_> {
        Box::pin(async move {
            let mut req = req;
            while let Some(sender) = self.inner.checkout() {
                match sender.try_send(req).await {
                    Sent::Answered(resp) => return Ok(resp),
                    Sent::Failed(error) => {
                        return Err(SendError::Failed {
                            error,
                            reused: true,
                        });
                    }
                    Sent::NotTaken(back) => req = back,
                }
            }
            self.send_fresh(req).await
        })
    }

    /// Sends `req` on a connection of its own, made for it.
    pub(crate) fn send_fresh(&self, req: Request<Body>) -> Responding<'_> {
        Box::pin(async move {
            let sender = self.inner.connect().await?;
            match sender.try_send(req).await {
                Sent::Answered(resp) => Ok(resp),
                Sent::Failed(error) => Err(SendError::Failed {
                    error,
                    reused: false,
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
    sender: SendRequest<Body>,
    pool: Weak<Inner>,
}

enum Sent {
    Answered(Response<Body>),
    /// The connection failed after taking the request: the upstream may have acted.
    Failed(hyper::Error),
    /// The connection closed before taking the request; here it is back.
    NotTaken(Request<Body>),
}

impl Lent {
    async fn try_send(mut self, req: Request<Body>) -> Sent {
        match self.sender.try_send_request(req).await {
            Ok(resp) => Sent::Answered(resp.map(|incoming| {
                crate::body::boxed(Returning {
                    inner: incoming,
                    lent: Some(self),
                })
            })),
            Err(mut e) => match e.take_message() {
                Some(req) => Sent::NotTaken(req),
                None => Sent::Failed(e.into_error()),
            },
        }
    }

    /// The response has ended: the connection goes back to its pool if it can serve again.
    fn give_back(self) {
        if let Some(pool) = self.pool.upgrade() {
            pool.put(self.sender);
        }
    }
}

impl Inner {
    fn checkout(self: &Arc<Self>) -> Option<Lent> {
        let now = Instant::now();
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(conn) = idle.pop() {
            if now.duration_since(conn.since) >= self.idle_timeout {
                // Every connection below it has been idle longer still.
                idle.clear();
                return None;
            }
            if conn.sender.is_ready() && !conn.sender.is_closed() {
                return Some(Lent {
                    sender: conn.sender,
                    pool: Arc::downgrade(self),
                });
            }
        }
        None
    }

    async fn connect(self: &Arc<Self>) -> Result<Lent, SendError> {
        let io = self
            .connector
            .clone()
            .call(self.target.clone())
            .await
            .map_err(|e| SendError::Connect(crate::upstream::error_chain(&*e)))?;
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
            sender,
            pool: Arc::downgrade(self),
        })
    }

    fn put(self: &Arc<Self>, sender: SendRequest<Body>) {
        if self.idle_timeout.is_zero() || sender.is_closed() || !sender.is_ready() {
            // Not between requests (or not to be reused at all): dropping the sender closes it.
            return;
        }
        self.idle
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Idle {
                sender,
                since: Instant::now(),
            });
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
            .retain(|c| now.duration_since(c.since) < idle_timeout && !c.sender.is_closed());
    }
}

/// A response body that gives its connection back once it has ended.
struct Returning {
    inner: Incoming,
    lent: Option<Lent>,
}

impl Returning {
    fn ended(&mut self) {
        if let Some(lent) = self.lent.take() {
            lent.give_back();
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
mod tests {
    use std::convert::Infallible;
    use std::sync::atomic::AtomicUsize;

    use http_body_util::{BodyExt, Full};
    use hyper_util::rt::TokioIo;
    use tokio::net::TcpListener;

    use super::*;

    /// An upstream on loopback that answers every request with `size` bytes (the path says
    /// how many), counting the connections it accepted.
    async fn upstream() -> (Uri, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(|req: Request<Incoming>| async move {
                        let size: usize = req.uri().path()[1..].parse().unwrap_or(0);
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(vec![b'x'; size]))))
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tcp), service)
                        .await;
                });
            }
        });
        let target = format!("http://{addr}/").parse().expect("uri");
        (target, accepted)
    }

    fn pool(target: Uri, idle_timeout: Duration) -> Pool {
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(
                crate::tls::ClientTls::public_roots()
                    .expect("the Mozilla roots")
                    .client_config(),
            )
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        Pool::new(connector, target, idle_timeout)
    }

    fn get(size: usize) -> Request<Body> {
        let mut req = Request::new(crate::body::empty());
        *req.uri_mut() = format!("/{size}").parse().expect("uri");
        req
    }

    async fn read(pool: &Pool, size: usize) -> usize {
        let resp = pool.send(get(size)).await.expect("a response");
        resp.into_body()
            .collect()
            .await
            .expect("the body")
            .to_bytes()
            .len()
    }

    #[tokio::test]
    async fn a_connection_serves_again_once_its_response_has_ended() {
        let (target, accepted) = upstream().await;
        let pool = pool(target, Duration::from_secs(60));
        for size in [10, 0, 100_000, 3] {
            assert_eq!(read(&pool, size).await, size);
        }
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "one connection for all four"
        );
    }

    #[tokio::test]
    async fn a_response_dropped_before_its_end_takes_its_connection_with_it() {
        let (target, accepted) = upstream().await;
        let pool = pool(target, Duration::from_secs(60));
        let resp = pool.send(get(1_000_000)).await.expect("a response");
        drop(resp);
        assert_eq!(read(&pool, 5).await, 5);
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            2,
            "the connection still carrying a body is never lent again"
        );
    }

    #[tokio::test]
    async fn an_idle_timeout_of_zero_never_reuses() {
        let (target, accepted) = upstream().await;
        let pool = pool(target, Duration::ZERO);
        for _ in 0..3 {
            assert_eq!(read(&pool, 1).await, 1);
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_connection_idle_for_the_timeout_is_never_reused() {
        let (target, accepted) = upstream().await;
        let pool = pool(target, Duration::from_millis(200));
        assert_eq!(read(&pool, 1).await, 1);
        assert_eq!(read(&pool, 1).await, 1);
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "reused within the timeout"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert_eq!(read(&pool, 1).await, 1);
        assert_eq!(accepted.load(Ordering::SeqCst), 2, "not reused after it");
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            pool.inner.idle.lock().expect("idle").is_empty(),
            "the reaper closed the idle connection"
        );
    }

    #[tokio::test]
    async fn nothing_listening_is_a_connect_error() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        drop(listener);
        let pool = pool(
            format!("http://{addr}/").parse().expect("uri"),
            Duration::from_secs(1),
        );
        match pool.send(get(1)).await {
            Err(SendError::Connect(detail)) => assert!(detail.contains("connect"), "{detail}"),
            other => panic!(
                "expected a connect error, got {:?}",
                other.map(|r| r.status())
            ),
        }
    }
}
