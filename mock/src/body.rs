//! The response body, and the pattern `X-Mock-Body-Size` sends.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

/// How long a cut-short body ([`X-Mock-Partial`](crate#control-headers)) waits before failing,
/// so the server flushes the head and the first half before the connection drops.
const PARTIAL_FLUSH_PAUSE: Duration = Duration::from_millis(50);

/// One period of the body produced by `X-Mock-Body-Size` (64 bytes, printable, ends in `\n`).
const PATTERN: &[u8; 64] = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-\n";

/// The body sent for `X-Mock-Body-Size: len`: a printable 64-byte pattern (`0-9a-zA-Z-\n`)
/// repeated and cut at `len` bytes.
/// Tests compare a response against it byte for byte.
pub fn body_pattern(len: usize) -> Vec<u8> {
    PATTERN.iter().copied().cycle().take(len).collect()
}

/// A 64 KiB block of the pattern, shared by every response: big bodies are sent as slices of it,
/// so `X-Mock-Body-Size: 100000000` costs no allocation. Its length is a multiple of the pattern
/// period, so consecutive blocks continue the pattern seamlessly.
fn pattern_block() -> &'static Bytes {
    static BLOCK: OnceLock<Bytes> = OnceLock::new();
    BLOCK.get_or_init(|| Bytes::from(body_pattern(64 * 1024)))
}

/// The response body: a buffer and/or a stretch of [`body_pattern`], with an exact length (so
/// HTTP/1 gets a `Content-Length`), optionally cut short by a failure.
#[derive(Debug)]
pub struct MockBody {
    head: Option<Bytes>,
    /// Pattern bytes still to send after `head`.
    pattern_left: u64,
    /// Bytes still to send as declared in the size hint; more than the rest of the data when
    /// the body is cut short.
    declared_left: u64,
    cut: Cut,
    /// Sent after the data (a gRPC answer's status).
    trailers: Option<http::HeaderMap>,
}

#[derive(Debug)]
enum Cut {
    No,
    /// Fail once the data runs out, after a pause that lets the server flush what was sent.
    Armed,
    Pausing(Pin<Box<tokio::time::Sleep>>),
    Done,
}

impl MockBody {
    pub(crate) fn full(bytes: Bytes) -> Self {
        MockBody {
            declared_left: bytes.len() as u64,
            head: Some(bytes).filter(|b| !b.is_empty()),
            pattern_left: 0,
            cut: Cut::No,
            trailers: None,
        }
    }

    /// These bytes, then these trailers.
    pub(crate) fn with_trailers(bytes: Bytes, trailers: http::HeaderMap) -> Self {
        MockBody {
            trailers: Some(trailers),
            ..MockBody::full(bytes)
        }
    }

    pub(crate) fn pattern(len: u64) -> Self {
        MockBody {
            head: None,
            pattern_left: len,
            declared_left: len,
            cut: Cut::No,
            trailers: None,
        }
    }

    /// Keeps the declared length but sends only the first half, then fails.
    pub(crate) fn cut_short(mut self) -> Self {
        let half = self.declared_left / 2;
        match &mut self.head {
            Some(head) => {
                let keep = usize::try_from(half).unwrap_or(usize::MAX).min(head.len());
                head.truncate(keep);
            }
            None => self.pattern_left = half,
        }
        self.cut = Cut::Armed;
        self
    }
}

impl Body for MockBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = &mut *self;
        if let Some(head) = this.head.take().filter(|h| !h.is_empty()) {
            this.declared_left = this.declared_left.saturating_sub(head.len() as u64);
            return Poll::Ready(Some(Ok(Frame::data(head))));
        }
        if this.pattern_left > 0 {
            let block = pattern_block();
            let len = usize::try_from(this.pattern_left)
                .unwrap_or(usize::MAX)
                .min(block.len());
            this.pattern_left -= len as u64;
            this.declared_left = this.declared_left.saturating_sub(len as u64);
            return Poll::Ready(Some(Ok(Frame::data(block.slice(..len)))));
        }
        loop {
            match &mut this.cut {
                Cut::No => {
                    return Poll::Ready(this.trailers.take().map(|t| Ok(Frame::trailers(t))));
                }
                Cut::Done => return Poll::Ready(None),
                Cut::Armed => {
                    this.cut = Cut::Pausing(Box::pin(tokio::time::sleep(PARTIAL_FLUSH_PAUSE)));
                }
                Cut::Pausing(pause) => {
                    if pause.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    this.cut = Cut::Done;
                    return Poll::Ready(Some(Err(io::Error::new(
                        io::ErrorKind::ConnectionAborted,
                        "response body cut short (X-Mock-Partial)",
                    ))));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.head.as_ref().is_none_or(Bytes::is_empty)
            && self.pattern_left == 0
            && self.trailers.is_none()
            && matches!(self.cut, Cut::No | Cut::Done)
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.declared_left)
    }
}
