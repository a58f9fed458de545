//! The bounded queue between the request path and the exporter, and the exporter's thread.
//!
//! The SDK's own batch processor drops spans when its queue is full but counts them nowhere an
//! operator can see, and its thread has no Tokio runtime (a hyper client panics there on the
//! first export). This one keeps a bounded queue: a span that does not fit is dropped and
//! counted (`idemproxy_spans_dropped_total`) on the spot, without waiting; a thread of its own
//! with a current-thread runtime sends the spans in batches to `otlp_endpoint/v1/traces`, each
//! export bounded in time. A collector that is down, slow or refusing costs the request path
//! nothing but those drops, and memory nothing beyond the queue.
//!
//! The thread is woken once a batch, not once a span: when a span lands in an empty queue (the
//! batch's first, whose [`LINGER`] starts then) and when the queue holds a full batch. Waking
//! it for every span cost a futex call and a switch to its thread each (invisible in
//! instruction counts, measured in the load bench: pass-through at `sample_ratio: 0.01` lost
//! ~4% of its req/s to them).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use opentelemetry_http::hyper::HyperClient;
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{SpanData, SpanExporter, SpanProcessor};
use prometheus_client::metrics::counter::Counter;

use super::{EXPORT_TIMEOUT, TracesError};
use crate::config::TracingSettings;

/// Spans the queue holds at most.
pub(crate) const QUEUE: usize = 2048;
/// Spans a batch sends at most.
const BATCH: usize = 512;
/// How long a span waits for its batch to fill before the batch goes anyway.
const LINGER: Duration = Duration::from_millis(500);

/// What wakes the exporter's thread.
enum Message {
    /// A span landed in an empty queue, or the queue holds a batch.
    Spans,
    /// Export what is queued, then say so.
    Flush(mpsc::Sender<()>),
    /// Export what is queued, then stop.
    Stop(mpsc::Sender<()>),
}

/// Control messages queued at most: a [`Message::Spans`] that does not fit is one the thread
/// has yet to see.
const MESSAGES: usize = 64;

/// The span processor: a bounded queue, and the thread that empties it.
#[derive(Debug)]
pub(super) struct Bounded {
    spans: Arc<Mutex<VecDeque<SpanData>>>,
    wake: SyncSender<Message>,
    dropped: Counter,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Set at shutdown: the thread stops after the export it is in, whatever is still queued
    /// (a collector that hangs would otherwise hold the exit for one export a batch).
    stopping: Arc<AtomicBool>,
}

impl Bounded {
    /// Builds the OTLP exporter for `settings` and starts its thread.
    pub(super) fn start(
        settings: &TracingSettings,
        resource: &Resource,
        dropped: Counter,
    ) -> Result<Bounded, TracesError> {
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_webpki_roots()
            .https_or_http()
            .enable_http1()
            .build();
        let endpoint = format!("{}/v1/traces", settings.otlp_endpoint.trim_end_matches('/'));
        let mut exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(HyperClient::new(connector, EXPORT_TIMEOUT, None))
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(endpoint)
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(|e| TracesError(e.to_string()))?;
        exporter.set_resource(resource);
        let spans = Arc::new(Mutex::new(VecDeque::new()));
        let (wake, woken) = mpsc::sync_channel(MESSAGES);
        let stopping = Arc::new(AtomicBool::new(false));
        let stop = stopping.clone();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| TracesError(format!("the exporter's runtime: {e}")))?;
        let thread = std::thread::Builder::new()
            .name("idemproxy-traces".into())
            .spawn({
                let spans = Arc::clone(&spans);
                move || export_loop(&runtime, &exporter, &spans, &woken, &stop)
            })
            .map_err(|e| TracesError(format!("the exporter's thread: {e}")))?;
        Ok(Bounded {
            spans,
            wake,
            dropped,
            thread: Mutex::new(Some(thread)),
            stopping,
        })
    }

    /// Sends `message` if the queue has room, and waits up to `timeout` for the thread's
    /// answer. Never blocks on a full queue.
    fn ask(&self, message: impl FnOnce(mpsc::Sender<()>) -> Message, timeout: Duration) -> bool {
        let (done, answered) = mpsc::channel();
        if self.wake.try_send(message(done)).is_err() {
            return false;
        }
        answered.recv_timeout(timeout).is_ok()
    }
}

impl SpanProcessor for Bounded {
    fn on_start(&self, _span: &mut opentelemetry_sdk::trace::Span, _cx: &opentelemetry::Context) {}

    fn on_end(&self, span: SpanData) {
        if !span.span_context.is_sampled() {
            return;
        }
        let Ok(mut queue) = self.spans.lock() else {
            self.dropped.inc();
            return;
        };
        if queue.len() >= QUEUE {
            drop(queue);
            self.dropped.inc();
            return;
        }
        queue.push_back(span);
        let wake = queue.len() == 1 || queue.len() == BATCH;
        drop(queue);
        if wake {
            // Full: a wake-up is already waiting. Disconnected: the thread has stopped, and
            // the span waits with the queue for nothing (dropped at shutdown).
            let _ = self.wake.try_send(Message::Spans);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        if self.ask(Message::Flush, EXPORT_TIMEOUT) {
            Ok(())
        } else {
            Err(OTelSdkError::Timeout(EXPORT_TIMEOUT))
        }
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.stopping.store(true, Ordering::Release);
        let stopped = self.ask(Message::Stop, timeout);
        let thread = self.thread.lock().map(|mut t| t.take()).unwrap_or(None);
        match thread {
            // Stopped, or stopping after the export it is in (bounded by its timeout).
            Some(thread) if stopped || thread.is_finished() => {
                let _ = thread.join();
                Ok(())
            }
            // Left to end on its own: the process does not wait for it.
            _ => Err(OTelSdkError::Timeout(timeout)),
        }
    }
}

/// The exporter's thread: batches of up to [`BATCH`] spans, sent when the queue holds one or
/// [`LINGER`] after the first span of a batch landed, one export at a time.
fn export_loop(
    runtime: &tokio::runtime::Runtime,
    exporter: &opentelemetry_otlp::SpanExporter,
    spans: &Mutex<VecDeque<SpanData>>,
    woken: &Receiver<Message>,
    stopping: &AtomicBool,
) {
    let mut since: Option<Instant> = None;
    loop {
        let wait = since.map_or(Duration::from_secs(3600), |t| {
            LINGER.saturating_sub(t.elapsed())
        });
        let (all, reply, stop) = match woken.recv_timeout(wait) {
            Ok(Message::Spans) => (false, None, false),
            Ok(Message::Flush(reply)) => (true, Some(reply), false),
            Ok(Message::Stop(reply)) => (true, Some(reply), true),
            Err(RecvTimeoutError::Timeout) => (true, None, false),
            Err(RecvTimeoutError::Disconnected) => (true, None, true),
        };
        let mut failed = false;
        // The full batches; and, at the end of a linger, a flush or a stop, the rest too.
        while let Some(batch) = take_batch(spans, all) {
            failed |= !export(runtime, exporter, batch);
            if failed && stopping.load(Ordering::Acquire) {
                break;
            }
        }
        // What is left waits for its batch to fill or its linger to end, counted from now.
        let waiting = spans.lock().map(|q| !q.is_empty()).unwrap_or(false);
        since = match (waiting, all) {
            (false, _) => None,
            (true, true) => Some(Instant::now()),
            (true, false) => Some(since.unwrap_or_else(Instant::now)),
        };
        if let Some(reply) = reply {
            let _ = reply.send(());
        }
        // Shutting down and the collector fails: what is still queued is not worth the wait.
        if stop || (failed && stopping.load(Ordering::Acquire)) {
            return;
        }
    }
}

/// The next batch to send: a full one, or (when `all`) whatever is queued; `None` if none.
fn take_batch(spans: &Mutex<VecDeque<SpanData>>, all: bool) -> Option<Vec<SpanData>> {
    let mut queue = spans.lock().ok()?;
    let n = queue.len().min(BATCH);
    (n == BATCH || (all && n > 0)).then(|| queue.drain(..n).collect())
}

/// Sends `batch`, within [`EXPORT_TIMEOUT`]: whether the collector took it.
fn export(
    runtime: &tokio::runtime::Runtime,
    exporter: &opentelemetry_otlp::SpanExporter,
    batch: Vec<SpanData>,
) -> bool {
    let sent = runtime
        .block_on(async { tokio::time::timeout(EXPORT_TIMEOUT, exporter.export(batch)).await });
    match sent {
        Ok(Ok(())) => true,
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "tracing: an export failed");
            false
        }
        Err(_) => {
            tracing::debug!("tracing: an export timed out");
            false
        }
    }
}
