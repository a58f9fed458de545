//! What one connection is doing, as far as its deadlines care: requests in progress, response
//! bodies waiting for the client to take more, and when a byte last went out.
//!
//! hyper gives an HTTP/1.1 connection a deadline for each request head, but an HTTP/2
//! connection none at all once its first request has arrived, and neither protocol notices a
//! client that stops reading. So the connection task keeps its own books here: the service
//! counts a request from its call until its response body has been sent (or dropped), the
//! body notes each chunk it hands hyper, and the IO notes each write. From those,
//! [`Activity::next`] tells the connection's watcher when it is idle, when a response has
//! stalled, or how long to sleep. Nothing here wakes the watcher: it looks again at the times
//! `next` gives, which are never later than a deadline that could fall due meanwhile, so the
//! request path pays a few atomic writes and no wake-up.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::time::Instant;

/// Data frames larger than this reach hyper in slices of this size. hyper's HTTP/2 side takes a
/// frame whole and buffers it until the client's flow-control window lets it out; a 12 MiB
/// replay handed over as one frame would leave the body "finished" at once while the client
/// has read nothing. In slices, the body is asked for the next one only as the client takes
/// data, so a client that stops reading shows as a body waiting, which is what the send
/// deadline watches. (Slicing `Bytes` copies nothing.)
const SLICE: usize = 64 * 1024;

/// The books of one connection; shared by its task, its service, its response bodies and its
/// IO.
#[derive(Debug)]
pub(super) struct Activity {
    /// The accept: times below are milliseconds since it.
    epoch: Instant,
    /// Requests from the service call until their response body is finished or dropped.
    requests: AtomicUsize,
    /// When `requests` last fell to zero.
    idle_since: AtomicU64,
    /// Response bodies that handed hyper a chunk and have not been asked for the next one:
    /// hyper is still writing it, or waiting for the client to make room for it.
    waiting: AtomicUsize,
    /// When the connection last wrote a byte, or a body was asked for its next chunk.
    progress: AtomicU64,
}

/// What the connection task should do next.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Next {
    /// Nothing is due before this instant.
    Wait(Instant),
    /// No request in progress and nothing written for the idle deadline: close.
    Idle,
    /// A response has made no write progress for the send deadline: abandon it.
    Stalled,
}

impl Activity {
    pub(super) fn new() -> Activity {
        Activity {
            epoch: Instant::now(),
            requests: AtomicUsize::new(0),
            idle_since: AtomicU64::new(0),
            waiting: AtomicUsize::new(0),
            progress: AtomicU64::new(0),
        }
    }

    /// The deadline of the TLS handshake and the first request: a connection is idle from its
    /// accept.
    pub(super) fn first_request_by(&self, header_read_timeout: Duration) -> Instant {
        self.epoch + header_read_timeout
    }

    fn since_epoch(&self) -> u64 {
        u64::try_from(Instant::now().duration_since(self.epoch).as_millis()).unwrap_or(u64::MAX)
    }

    fn at(&self, millis: &AtomicU64) -> Instant {
        self.epoch + Duration::from_millis(millis.load(Ordering::SeqCst))
    }

    /// Notes write progress: a byte written, or a chunk taken from a body.
    pub(super) fn progressed(&self) {
        self.progress
            .fetch_max(self.since_epoch(), Ordering::SeqCst);
    }

    /// What is due at `now`. `closing_since`: when the task asked hyper to close the
    /// connection; a connection still idle a whole idle deadline after that is dropped.
    pub(super) fn next(
        &self,
        now: Instant,
        idle_after: Duration,
        stall_after: Duration,
        closing_since: Option<Instant>,
    ) -> Next {
        if self.requests.load(Ordering::SeqCst) == 0 {
            // The last response is finished once its bytes are out, not when its body ended:
            // the idle clock starts at whichever came last.
            let mut since = self.at(&self.idle_since).max(self.at(&self.progress));
            if let Some(closing) = closing_since {
                since = since.max(closing);
            }
            let deadline = since + idle_after;
            // A request may start meanwhile, and it says nothing when it does: look again
            // within a send deadline, the earliest its response could stall (see below).
            return if now >= deadline {
                Next::Idle
            } else {
                Next::Wait(deadline.min(now + stall_after))
            };
        }
        // The requests in progress may all end any moment from now, and nothing says when
        // they do: the connection is idle `idle_after` after that at the earliest, so looking
        // again by `now + idle_after` is never late for the idle deadline.
        let idle_by = now + idle_after;
        if self.waiting.load(Ordering::SeqCst) > 0 {
            let deadline = self.at(&self.progress) + stall_after;
            return if now >= deadline {
                Next::Stalled
            } else {
                Next::Wait(deadline.min(idle_by))
            };
        }
        // A body that starts waiting later notes its progress then, so it cannot stall before
        // `now + stall_after`: looking again at that time is never late either. (So the
        // watcher wakes once per deadline while requests run, and nothing on the request path
        // has to wake it.)
        Next::Wait((now + stall_after).min(idle_by))
    }
}

/// One request in progress, from the service call until its response body is finished or
/// dropped (the client left, or the connection closed).
#[derive(Debug)]
pub(super) struct InProgress(Arc<Activity>);

impl InProgress {
    pub(super) fn start(activity: &Arc<Activity>) -> InProgress {
        activity.requests.fetch_add(1, Ordering::SeqCst);
        InProgress(activity.clone())
    }
}

impl Drop for InProgress {
    fn drop(&mut self) {
        let a = &self.0;
        // Written before the count falls, so that a task seeing zero requests reads this
        // request's end, not an older one.
        a.idle_since.fetch_max(a.since_epoch(), Ordering::SeqCst);
        a.requests.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A response body that keeps its request in progress until it is finished or dropped, and
/// tells the connection's books when hyper is holding one of its chunks.
pub(super) struct Tracked<B> {
    inner: B,
    /// What is left of a frame larger than [`SLICE`].
    rest: Bytes,
    /// A chunk was handed to hyper and the next one has not been asked for.
    handed: bool,
    request: InProgress,
}

impl<B> Tracked<B> {
    pub(super) fn new(inner: B, request: InProgress) -> Tracked<B> {
        Tracked {
            inner,
            rest: Bytes::new(),
            handed: false,
            request,
        }
    }

    fn hand(&mut self, mut data: Bytes) -> Frame<Bytes> {
        if data.len() > SLICE {
            self.rest = data.split_off(SLICE);
        }
        if !self.handed {
            self.handed = true;
            self.request.0.waiting.fetch_add(1, Ordering::SeqCst);
        }
        self.request.0.progressed();
        Frame::data(data)
    }

    fn taken(&mut self) {
        if self.handed {
            self.handed = false;
            self.request.0.progressed();
            self.request.0.waiting.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl<B> Body for Tracked<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.get_mut();
        // hyper asks for the next chunk only once it has sent (or safely buffered) the last.
        this.taken();
        if !this.rest.is_empty() {
            let rest = std::mem::take(&mut this.rest);
            return Poll::Ready(Some(Ok(this.hand(rest))));
        }
        match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => Poll::Ready(Some(Ok(this.hand(data)))),
                Err(other) => Poll::Ready(Some(Ok(other))),
            },
            other => Poll::Ready(other),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_empty() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let inner = self.inner.size_hint();
        let rest = self.rest.len() as u64;
        let mut hint = SizeHint::new();
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper.saturating_add(rest));
        }
        hint.set_lower(inner.lower().saturating_add(rest));
        hint
    }
}

impl<B> Drop for Tracked<B> {
    fn drop(&mut self) {
        // Before `request` drops: the books never show no request but a waiting body.
        self.taken();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full};

    const IDLE: Duration = Duration::from_secs(10);
    const STALL: Duration = Duration::from_secs(30);

    #[tokio::test(start_paused = true)]
    async fn a_new_connection_is_idle_from_its_accept() {
        let a = Arc::new(Activity::new());
        let accepted = Instant::now();
        assert_eq!(
            a.next(accepted, IDLE, STALL, None),
            Next::Wait(accepted + IDLE)
        );
        tokio::time::advance(IDLE).await;
        assert_eq!(a.next(Instant::now(), IDLE, STALL, None), Next::Idle);
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_looks_again_within_a_send_deadline() {
        let a = Arc::new(Activity::new());
        let now = Instant::now();
        let short = Duration::from_secs(1);
        assert_eq!(
            a.next(now, IDLE, short, None),
            Next::Wait(now + short),
            "a request starting now could stall after `short`"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_idle_clock_starts_when_the_last_request_ends() {
        let a = Arc::new(Activity::new());
        let first = InProgress::start(&a);
        let second = InProgress::start(&a);
        tokio::time::advance(IDLE * 2).await;
        assert_eq!(
            a.next(Instant::now(), IDLE, STALL, None),
            Next::Wait(Instant::now() + IDLE),
            "a request in progress is never idle; it may end now, so look again within IDLE"
        );
        assert_eq!(
            a.next(Instant::now(), IDLE, IDLE / 2, None),
            Next::Wait(Instant::now() + IDLE / 2),
            "or within the send deadline, if it is the shorter"
        );
        drop(first);
        tokio::time::advance(Duration::from_secs(1)).await;
        drop(second);
        let ended = Instant::now();
        assert_eq!(a.next(ended, IDLE, STALL, None), Next::Wait(ended + IDLE));
        // Asked to close at `ended`: still idle a whole deadline later, it is dropped.
        tokio::time::advance(IDLE).await;
        assert_eq!(a.next(Instant::now(), IDLE, STALL, None), Next::Idle);
        assert_eq!(
            a.next(Instant::now(), IDLE, STALL, Some(Instant::now())),
            Next::Wait(Instant::now() + IDLE)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_whose_chunk_is_not_taken_stalls_unless_bytes_go_out() {
        let a = Arc::new(Activity::new());
        let body = Full::new(Bytes::from(vec![7u8; SLICE * 3]));
        let mut tracked = Tracked::new(body, InProgress::start(&a));
        let frame = tracked.frame().await.expect("a frame").expect("data");
        assert_eq!(frame.into_data().expect("data").len(), SLICE, "sliced");
        let handed = Instant::now();
        assert_eq!(
            a.next(handed, STALL, STALL, None),
            Next::Wait(handed + STALL)
        );
        assert_eq!(
            a.next(handed, IDLE, STALL, None),
            Next::Wait(handed + IDLE),
            "the body may end any moment: the idle deadline could be due first"
        );
        tokio::time::advance(STALL / 2).await;
        a.progressed();
        let wrote = Instant::now();
        tokio::time::advance(STALL / 2).await;
        assert_eq!(
            a.next(Instant::now(), STALL, STALL, None),
            Next::Wait(wrote + STALL),
            "writes are progress"
        );
        tokio::time::advance(STALL).await;
        assert_eq!(a.next(Instant::now(), IDLE, STALL, None), Next::Stalled);
        // Taking the rest is progress; a finished, dropped body leaves the connection idle.
        let mut total = SLICE;
        while let Some(frame) = tracked.frame().await {
            total += frame.expect("data").into_data().expect("data").len();
        }
        assert_eq!(total, SLICE * 3, "every byte, once");
        drop(tracked);
        let done = Instant::now();
        assert_eq!(a.next(done, IDLE, STALL, None), Next::Wait(done + IDLE));
    }

    #[test]
    fn a_sliced_body_keeps_its_size() {
        let a = Arc::new(Activity::new());
        let tracked = Tracked::new(
            Full::new(Bytes::from(vec![1u8; SLICE * 2 + 5])),
            InProgress::start(&a),
        );
        assert_eq!(tracked.size_hint().exact(), Some((SLICE * 2 + 5) as u64));
        assert!(!tracked.is_end_stream());
    }
}
