//! The upstream connector: hyper-rustls over TCP, each connection stamped with the moment it was
//! made, so that a failed request can tell a reused pooled connection from a fresh one.
//!
//! That distinction matters for SPEC §4.3: an upstream may close a keep-alive connection just as
//! the proxy writes a request into it, and then no response byte comes back. On a reused
//! connection that is the keep-alive race, and under `on_unknown_outcome: release` the request
//! is sent once more on a fresh connection; on a fresh connection it is a real failure.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Uri;
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_rustls::{HttpsConnector, MaybeHttpsStream};
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tower_service::Service;

/// When a connection was made; found in the extensions of every response it carried, and in
/// the connect info of a request that failed on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Born(pub Instant);

/// A connection with its [`Born`] stamp.
pub(crate) struct Stamped<T> {
    inner: T,
    born: Instant,
}

impl<T: Read + Unpin> Read for Stamped<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<T: Write + Unpin> Write for Stamped<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }
}

impl<T: Connection> Connection for Stamped<T> {
    fn connected(&self) -> Connected {
        self.inner.connected().extra(Born(self.born))
    }
}

type Inner = HttpsConnector<HttpConnector>;

/// The connector: [`HttpsConnector`] whose connections are [`Stamped`].
#[derive(Clone)]
pub(crate) struct Connector {
    inner: Inner,
}

impl Connector {
    /// Wraps a connector.
    pub(crate) fn new(inner: Inner) -> Connector {
        Connector { inner }
    }
}

impl Service<Uri> for Connector {
    type Response = Stamped<MaybeHttpsStream<TokioIo<TcpStream>>>;
    type Error = <Inner as Service<Uri>>::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connecting = self.inner.call(uri);
        Box::pin(async move {
            let inner = connecting.await?;
            Ok(Stamped {
                inner,
                born: Instant::now(),
            })
        })
    }
}

/// Whether a failed request got no response on a connection made before `sent`: the
/// keep-alive race, where the upstream closed the connection as the request was written.
pub(crate) fn unanswered_on_reused(e: &hyper_util::client::legacy::Error, sent: Instant) -> bool {
    if e.is_connect() {
        return false;
    }
    let incomplete = std::iter::successors(
        std::error::Error::source(e),
        |s: &&(dyn std::error::Error + 'static)| s.source(),
    )
    .filter_map(|s| s.downcast_ref::<hyper::Error>())
    .any(|h| h.is_incomplete_message() || h.is_canceled());
    let mut extras = http::Extensions::new();
    if let Some(info) = e.connect_info() {
        info.get_extras(&mut extras);
    }
    incomplete && extras.get::<Born>().is_some_and(|b| b.0 < sent)
}
