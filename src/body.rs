//! The one body type that flows through the proxy, and helpers to make it.

use bytes::Bytes;
use http_body_util::{BodyExt, Full, combinators::UnsyncBoxBody};

/// Any error a body may fail with.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A boxed body: a buffered one (saved, replayed, problem documents) or a streamed one
/// (pass-through traffic, responses too large to save).
pub(crate) type Body = UnsyncBoxBody<Bytes, BoxError>;

/// A body of these bytes.
pub(crate) fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// A body of these bytes, then these trailers (a gRPC response's `grpc-status` and the rest).
pub(crate) fn with_trailers(bytes: Bytes, trailers: http::HeaderMap) -> Body {
    let frames = [
        Ok::<_, BoxError>(http_body::Frame::data(bytes)),
        Ok(http_body::Frame::trailers(trailers)),
    ];
    http_body_util::StreamBody::new(futures_util::stream::iter(frames)).boxed_unsync()
}

/// An empty body.
#[cfg(test)]
pub(crate) fn empty() -> Body {
    http_body_util::Empty::<Bytes>::new()
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// Boxes any body whose error converts.
pub(crate) fn boxed<B>(b: B) -> Body
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
pub(crate) fn with_deadline(
    body: Body,
    deadline: tokio::time::Instant,
    what: &'static str,
) -> Body {
    Deadline {
        inner: body,
        sleep: Box::pin(tokio::time::sleep_until(deadline)),
        what,
    }
    .boxed_unsync()
}

/// A client's request body streamed upstream, cut off at `timeout` (`limits.body_read_timeout`),
/// its failures marked as the client's: hyper's client reports a body that fails mid-send as its
/// own error, and without the mark a client that broke off its body (or sent a malformed chunk)
/// would read as an upstream failure.
pub(crate) fn from_client(body: Body, timeout: std::time::Duration) -> Body {
    let deadline = tokio::time::Instant::now() + timeout;
    with_deadline(
        body,
        deadline,
        "the request body (limits.body_read_timeout)",
    )
    .map_err(move |source| {
        let timed_out = source.is::<DeadlineExceeded>().then_some(timeout);
        Box::new(ClientBodyError { source, timed_out }) as BoxError
    })
    .boxed_unsync()
}

/// The error of a [`from_client`] body: the client's fault, whatever carried it.
#[derive(Debug, thiserror::Error)]
#[error("the client's request body failed")]
pub(crate) struct ClientBodyError {
    #[source]
    source: BoxError,
    /// `Some(limit)` when the body missed its deadline of `limit`.
    pub timed_out: Option<std::time::Duration>,
}

impl ClientBodyError {
    /// What went wrong with the body, without the wrapping.
    pub(crate) fn detail(&self) -> String {
        self.source.to_string()
    }
}

struct Deadline {
    inner: Body,
    sleep: std::pin::Pin<Box<tokio::time::Sleep>>,
    what: &'static str,
}

/// The error a [`with_deadline`] body fails with.
#[derive(Debug, thiserror::Error)]
#[error("{0} did not complete in time")]
pub(crate) struct DeadlineExceeded(pub &'static str);

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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn failing() -> Body {
        let frames = futures_util::stream::iter([
            Ok(http_body::Frame::data(Bytes::from_static(b"hello"))),
            Err::<http_body::Frame<Bytes>, BoxError>("invalid chunk size".into()),
        ]);
        boxed(http_body_util::StreamBody::new(frames))
    }

    async fn error_of(body: Body) -> BoxError {
        match body.collect().await {
            Ok(_) => panic!("the body must fail"),
            Err(e) => e,
        }
    }

    #[tokio::test]
    async fn a_client_body_failure_is_marked_as_the_clients() {
        let e = error_of(from_client(failing(), Duration::from_secs(5))).await;
        let client = e.downcast_ref::<ClientBodyError>().expect("marked");
        assert_eq!(client.timed_out, None);
        assert_eq!(client.detail(), "invalid chunk size");
    }

    #[tokio::test]
    async fn a_client_body_past_its_deadline_says_which_limit() {
        let stalled = boxed(http_body_util::StreamBody::new(
            futures_util::stream::pending::<Result<http_body::Frame<Bytes>, BoxError>>(),
        ));
        let limit = Duration::from_millis(20);
        let e = error_of(from_client(stalled, limit)).await;
        let client = e.downcast_ref::<ClientBodyError>().expect("marked");
        assert_eq!(client.timed_out, Some(limit));
    }
}
