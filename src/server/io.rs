//! The IO under every connection: the socket (or TLS over it), with a send deadline, write
//! progress noted for the connection's books, and an abortive close on request.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};
use tokio_rustls::server::TlsStream;
use tokio_util::either::Either;

use super::activity::Activity;

/// A connection's byte stream: plain TCP, or TLS over it.
pub(super) type Stream = Either<TcpStream, TlsStream<TcpStream>>;

/// The stream, as hyper uses it.
///
/// A write (or flush, or shutdown) that stays pending for `send_timeout` without a byte
/// accepted fails with `TimedOut`: the client has stopped reading, and hyper then drops the
/// connection and the response it holds — a 12 MiB replay to a client that never reads would
/// otherwise stay in memory for as long as the client keeps the socket open.
pub(super) struct ConnIo {
    stream: Stream,
    activity: Arc<Activity>,
    send_timeout: Duration,
    /// Allocated at the first stall only; most connections never need it.
    stall: Option<Pin<Box<Sleep>>>,
    /// `stall` runs for the write pending now.
    armed: bool,
    reset: Arc<AtomicBool>,
}

impl ConnIo {
    pub(super) fn new(
        stream: Stream,
        activity: Arc<Activity>,
        send_timeout: Duration,
        reset: Arc<AtomicBool>,
    ) -> ConnIo {
        ConnIo {
            stream,
            activity,
            send_timeout,
            stall: None,
            armed: false,
            reset,
        }
    }

    fn is_reset(&self) -> bool {
        self.reset.load(Ordering::SeqCst)
    }

    fn tcp(&self) -> &TcpStream {
        match &self.stream {
            Either::Left(tcp) => tcp,
            Either::Right(tls) => tls.get_ref().0,
        }
    }

    /// A write made progress (or failed for good): the next stall starts its own clock.
    fn settled<T>(&mut self, result: io::Result<T>, wrote: bool) -> Poll<io::Result<T>> {
        self.armed = false;
        if wrote {
            self.activity.progressed();
        }
        Poll::Ready(result)
    }

    /// The stream said Pending: fails once it has said so for `send_timeout` in a row.
    fn stalled<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        let timeout = self.send_timeout;
        let sleep = self
            .stall
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        if !self.armed {
            sleep.as_mut().reset(Instant::now() + timeout);
            self.armed = true;
        }
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client took no data within limits.send_timeout",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

fn reset_error() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "the service asked for a reset",
    )
}

impl AsyncRead for ConnIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for ConnIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.is_reset() {
            return Poll::Ready(Err(reset_error()));
        }
        match Pin::new(&mut this.stream).poll_write(cx, buf) {
            Poll::Ready(Ok(n)) => this.settled(Ok(n), n > 0),
            Poll::Ready(Err(e)) => this.settled(Err(e), false),
            Poll::Pending => this.stalled(cx),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.is_reset() {
            return Poll::Ready(Err(reset_error()));
        }
        match Pin::new(&mut this.stream).poll_write_vectored(cx, bufs) {
            Poll::Ready(Ok(n)) => this.settled(Ok(n), n > 0),
            Poll::Ready(Err(e)) => this.settled(Err(e), false),
            Poll::Pending => this.stalled(cx),
        }
    }

    fn is_write_vectored(&self) -> bool {
        // hyper queues a large body's chunks for vectored writes instead of copying them
        // into one buffer, so this must say what the socket says.
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut this.stream).poll_flush(cx) {
            Poll::Ready(result) => this.settled(result, false),
            Poll::Pending => this.stalled(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.is_reset() {
            // No FIN: the reset happens on drop.
            return Poll::Ready(Err(reset_error()));
        }
        match Pin::new(&mut this.stream).poll_shutdown(cx) {
            Poll::Ready(result) => this.settled(result, false),
            Poll::Pending => this.stalled(cx),
        }
    }
}

impl Drop for ConnIo {
    fn drop(&mut self) {
        if self.is_reset() {
            // SO_LINGER 0: closing sends a TCP reset, not an orderly FIN.
            if let Err(error) = self.tcp().set_zero_linger() {
                tracing::debug!(%error, "could not arm the reset");
            }
        }
    }
}
