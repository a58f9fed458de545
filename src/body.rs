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
