//! The one body type that flows through the proxy, and helpers to make it.

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full, combinators::UnsyncBoxBody};

/// Any error a body may fail with.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A boxed body: a buffered one (saved, replayed, problem documents) or a streamed one
/// (pass-through traffic, responses too large to save).
pub type Body = UnsyncBoxBody<Bytes, BoxError>;

/// A body of these bytes.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// An empty body.
pub fn empty() -> Body {
    Empty::<Bytes>::new()
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// Boxes any body whose error converts.
pub fn boxed<B>(b: B) -> Body
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    b.map_err(Into::into).boxed_unsync()
}

/// Fails `body` with a timeout error if it has not ended by `deadline`: an upstream's
/// `timeout` bounds the whole response, streamed bodies included, so a stalled upstream
/// cannot hold a client connection forever; `limits.body_read_timeout` bounds a client's
/// streamed request body the same way. `what` names the body in the error.
pub fn with_deadline(body: Body, deadline: tokio::time::Instant, what: &'static str) -> Body {
    Deadline {
        inner: body,
        sleep: Box::pin(tokio::time::sleep_until(deadline)),
        what,
    }
    .boxed_unsync()
}

struct Deadline {
    inner: Body,
    sleep: std::pin::Pin<Box<tokio::time::Sleep>>,
    what: &'static str,
}

/// The error a [`with_deadline`] body fails with.
#[derive(Debug, thiserror::Error)]
#[error("{0} did not complete in time")]
pub struct DeadlineExceeded(pub &'static str);

impl http_body::Body for Deadline {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        use std::task::Poll;
        if let Poll::Ready(frame) = std::pin::Pin::new(&mut self.inner).poll_frame(cx) {
            return Poll::Ready(frame);
        }
        match self.sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Some(Err(Box::new(DeadlineExceeded(self.what))))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}
