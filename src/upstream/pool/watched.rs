//! The socket under one pooled connection, counting the bytes the upstream sent on it: the
//! pool tells from the count whether a request that failed got any response byte back.
//!
//! It is also where a request's send deadline is enforced (SPEC §4.8, "When the request was
//! sent"): every write of request bytes, head or body chunk, passes here, so the check sits
//! right before each one. Once the deadline has passed nothing more is written: the socket is
//! given `SO_LINGER` 0 and the write fails, so hyper drops the connection, and closing it sends
//! a TCP RST that discards what the kernel still holds in its send buffer — bytes handed to an
//! earlier `write()` would otherwise still reach a slow reader after the deadline.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use hyper_rustls::MaybeHttpsStream;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Instant;

/// How many bytes the upstream has sent on one connection, as hyper read them (after TLS:
/// a `close_notify` or a session ticket is not a response byte).
#[derive(Debug, Clone, Default)]
pub(super) struct Received(Arc<AtomicU64>);

impl Received {
    pub(super) fn get(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }
}

/// The send deadline of the request a connection carries, and what was written of it.
///
/// Armed by the pool for each request sent on the connection (with the request's deadline, or
/// none), read by the socket before every write. Unarmed, the socket pays one atomic load a
/// poll.
#[derive(Debug, Clone, Default)]
pub(super) struct Gate(Arc<GateState>);

#[derive(Debug, Default)]
struct GateState {
    /// A deadline is set (or the connection was cut): the socket looks at `armed`.
    armed: AtomicBool,
    armed_state: Mutex<Armed>,
}

#[derive(Debug, Default)]
struct Armed {
    /// No byte of the current request is written at or after this.
    write_by: Option<Instant>,
    /// Bytes written since the current request was armed.
    written: u64,
    /// The deadline passed: the connection is being reset, nothing more goes through it.
    cut: bool,
    /// The connection task's waker, to make it see a cut at once.
    waker: Option<Waker>,
}

impl Gate {
    fn state(&self) -> std::sync::MutexGuard<'_, Armed> {
        self.0.armed_state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new request goes out on the connection: no byte of it is written at or after
    /// `write_by` (none: no deadline of its own).
    pub(super) fn arm(&self, write_by: Option<Instant>) {
        // A pass-through request on a connection never armed: nothing to reset (the hot path
        // of plain traffic takes no lock).
        if write_by.is_none() && !self.0.armed.load(Ordering::Acquire) {
            return;
        }
        let mut state = self.state();
        state.write_by = write_by;
        state.written = 0;
        self.0
            .armed
            .store(write_by.is_some() || state.cut, Ordering::Release);
    }

    /// The request's deadline passed before its answer came: reset the connection now, even
    /// while it waits for the socket (a slow reader), so nothing queued reaches the upstream.
    pub(super) fn cut(&self) {
        let waker = {
            let mut state = self.state();
            state.cut = true;
            state.waker.take()
        };
        self.0.armed.store(true, Ordering::Release);
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    /// Bytes of the current request written so far.
    pub(super) fn written(&self) -> u64 {
        self.state().written
    }

    /// Whether the connection was cut at a deadline.
    pub(super) fn was_cut(&self) -> bool {
        self.0.armed.load(Ordering::Acquire) && self.state().cut
    }

    /// Whether the socket may go on (`true`); `false` once the deadline has passed, which
    /// cuts the connection. Remembers the connection task's waker for [`Gate::cut`].
    fn open(&self, cx: &Context<'_>) -> bool {
        if !self.0.armed.load(Ordering::Acquire) {
            return true;
        }
        let mut state = self.state();
        if !state
            .waker
            .as_ref()
            .is_some_and(|w| w.will_wake(cx.waker()))
        {
            state.waker = Some(cx.waker().clone());
        }
        if !state.cut && state.write_by.is_some_and(|by| Instant::now() >= by) {
            state.cut = true;
        }
        !state.cut
    }

    fn wrote(&self, n: usize) {
        if self.0.armed.load(Ordering::Acquire) {
            let mut state = self.state();
            state.written = state
                .written
                .saturating_add(u64::try_from(n).unwrap_or(u64::MAX));
        }
    }
}

/// A socket that can be made to close with a TCP RST.
pub(super) trait Abort {
    /// Sets `SO_LINGER` 0: closing the socket then resets the connection and drops whatever
    /// its send buffer still holds.
    fn abort(&self);
}

/// The connector's stream: plain TCP, or TLS over it.
impl Abort for TokioIo<MaybeHttpsStream<TokioIo<TcpStream>>> {
    fn abort(&self) {
        let tcp: &TcpStream = match self.inner() {
            MaybeHttpsStream::Http(tcp) => tcp.inner(),
            MaybeHttpsStream::Https(tls) => tls.inner().get_ref().0.inner().inner(),
        };
        if let Err(error) = tcp.set_zero_linger() {
            tracing::debug!(%error, "SO_LINGER 0 failed; the connection closes without a reset");
        }
    }
}

/// The error of a write refused at the deadline.
fn deadline_passed() -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        "the request's send deadline passed: nothing more is written, the connection is reset",
    )
}

/// A stream that counts what is read from it into a [`Received`], and writes nothing past its
/// [`Gate`]'s deadline.
pub(super) struct Watched<T> {
    io: T,
    received: Received,
    gate: Gate,
}

impl<T: Abort> Watched<T> {
    pub(super) fn new(io: T, received: Received, gate: Gate) -> Watched<T> {
        Watched { io, received, gate }
    }

    /// Whether the socket may go on; if not, it is set to close with a reset.
    fn open(&self, cx: &Context<'_>) -> bool {
        if self.gate.open(cx) {
            return true;
        }
        self.io.abort();
        false
    }
}

impl<T: AsyncRead + Abort + Unpin> AsyncRead for Watched<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        // Reading is allowed past the deadline (the response may be on its way); a cut
        // connection is not read any more.
        if self.gate.0.armed.load(Ordering::Acquire) && !self.open_to_read(cx) {
            return Poll::Ready(Err(deadline_passed()));
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        let read = buf.filled().len().saturating_sub(before);
        if read > 0 {
            self.received
                .0
                .fetch_add(u64::try_from(read).unwrap_or(u64::MAX), Ordering::Release);
        }
        polled
    }
}

impl<T: Abort> Watched<T> {
    /// Whether a read may go on: only a cut connection is refused (and reset).
    fn open_to_read(&self, cx: &Context<'_>) -> bool {
        let cut = {
            let mut state = self.gate.state();
            if !state
                .waker
                .as_ref()
                .is_some_and(|w| w.will_wake(cx.waker()))
            {
                state.waker = Some(cx.waker().clone());
            }
            state.cut
        };
        if cut {
            self.io.abort();
        }
        !cut
    }
}

impl<T: AsyncWrite + Abort + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if !self.open(cx) {
            return Poll::Ready(Err(deadline_passed()));
        }
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = &polled {
            self.gate.wrote(*n);
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if !self.open(cx) {
            return Poll::Ready(Err(deadline_passed()));
        }
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = &polled {
            self.gate.wrote(*n);
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.open(cx) {
            return Poll::Ready(Err(deadline_passed()));
        }
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}
