//! The socket under one pooled connection, counting the bytes the upstream sent on it: the
//! pool tells from the count whether a request that failed got any response byte back.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// How many bytes the upstream has sent on one connection, as hyper read them (after TLS:
/// a `close_notify` or a session ticket is not a response byte).
#[derive(Debug, Clone, Default)]
pub(super) struct Received(Arc<AtomicU64>);

impl Received {
    pub(super) fn get(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }
}

/// A stream that counts what is read from it into a [`Received`].
pub(super) struct Watched<T> {
    io: T,
    received: Received,
}

impl<T> Watched<T> {
    pub(super) fn new(io: T, received: Received) -> Watched<T> {
        Watched { io, received }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
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

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}
