//! OpenTelemetry traces (`tracing:`): a server span for each request on a route, with child
//! spans for its store operations and its upstream call, exported over OTLP/HTTP (protobuf).
//!
//! - [`Traces`] (here): the tracer, started by [`crate::server::run`] when the file has a
//!   `tracing:` section and shut down (its queue flushed, within a bound) when `run` ends.
//! - `export`: the bounded queue between the request path and the exporter's thread; spans
//!   that do not fit are dropped and counted (`idemproxy_spans_dropped_total`).
//!
//! How a span finds its parent: the request's span rides in the OpenTelemetry [`Context`]
//! attached while the request's future is polled (`FutureExt::with_context`), with the
//! [`Active`] tracer beside it, so the store and the upstream client open child spans without
//! a parameter threaded through every step. Without `tracing:` no context is attached: each
//! check is one thread-local read that finds nothing — no span, no allocation.
//!
//! What a span never carries: a raw key, a header value, a body or the request's path (a path
//! can carry a key). The key appears as the first 16 hex digits of its hash.

mod export;
mod unsampled;

use std::time::Duration;

use http::header::Entry;
use http::{HeaderMap, HeaderName, HeaderValue, Method};
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{
    Link, Span as _, SpanKind, Status, TraceContextExt, TraceId, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    IdGenerator as _, RandomIdGenerator, Sampler, SamplingDecision, SamplingResult, SdkTracer,
    SdkTracerProvider, ShouldSample,
};
use prometheus_client::metrics::counter::Counter;

use futures_util::future::Either;
pub use opentelemetry::context::FutureExt;
use opentelemetry::context::WithContext;

use crate::config::{Config, TracingSettings};
use crate::metrics::Metrics;
use unsampled::{Ratio, TRACEPARENT};

/// How long an export may take before it is abandoned (its spans lost, not retried).
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// The tracer of a running proxy, and the provider whose shutdown flushes its queue.
#[derive(Clone, Debug)]
pub struct Traces {
    tracer: SdkTracer,
    provider: SdkTracerProvider,
    /// What decides for a request without a `traceparent` (the sampler's root rule), asked
    /// before any span is built, so that a request left unrecorded costs no span.
    ratio: Ratio,
}

/// The span of a resolution that outlives its request ([`detached`]).
const DETACHED: &str = "idemproxy.resolve";

/// Parent-based sampling, and one rule more: a [`DETACHED`] span, a root linked to its request,
/// is recorded when its request is.
#[derive(Clone, Debug)]
struct Sampling(Sampler);

impl ShouldSample for Sampling {
    fn should_sample(
        &self,
        parent: Option<&Context>,
        trace_id: TraceId,
        name: &str,
        kind: &SpanKind,
        attributes: &[KeyValue],
        links: &[Link],
    ) -> SamplingResult {
        let root = parent.is_none_or(|cx| !cx.has_active_span());
        if let (true, DETACHED, Some(link)) = (root, name, links.first()) {
            return SamplingResult {
                decision: if link.span_context.is_sampled() {
                    SamplingDecision::RecordAndSample
                } else {
                    SamplingDecision::Drop
                },
                attributes: Vec::new(),
                trace_state: link.span_context.trace_state().clone(),
            };
        }
        self.0
            .should_sample(parent, trace_id, name, kind, attributes, links)
    }
}

/// Set in a request's [`Context`] beside its span: the tracer its child spans come from.
#[derive(Clone, Debug)]
struct Active(SdkTracer);

/// Why tracing could not start.
#[derive(Debug, thiserror::Error)]
#[error("tracing: {0}")]
pub struct TracesError(String);

impl Traces {
    /// Starts the exporter's thread and the tracer; spans dropped for want of room in the
    /// queue are counted in `dropped`.
    pub fn start(settings: &TracingSettings, dropped: Counter) -> Result<Traces, TracesError> {
        let resource = Resource::builder()
            .with_service_name(settings.service_name.clone())
            .build();
        let processor = export::Bounded::start(settings, &resource, dropped)?;
        // Parent-based: a client's `traceparent` decides, sampled or not; the ratio decides
        // for a request that brings none — in `request`, before the span is built, so a root
        // span reaches the sampler only once it is to be recorded.
        let sampler = Sampling(Sampler::ParentBased(Box::new(Sampler::AlwaysOn)));
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_sampler(sampler)
            .with_resource(resource)
            .build();
        let tracer = provider.tracer("idemproxy");
        let ratio = Ratio::new(settings.sample_ratio);
        tracing::info!(
            endpoint = %settings.otlp_endpoint,
            sample_ratio = settings.sample_ratio,
            "traces: exporting spans over OTLP/HTTP"
        );
        Ok(Traces {
            tracer,
            provider,
            ratio,
        })
    }

    /// The tracer `config` asks for (`tracing:`), if any.
    pub fn configured(config: &Config, metrics: &Metrics) -> Result<Option<Traces>, TracesError> {
        config
            .tracing
            .as_ref()
            .map(|settings| Traces::start(settings, metrics.spans_dropped.clone()))
            .transpose()
    }

    /// Flushes what the queue holds and stops the exporter's thread, within the export bound.
    /// Blocking: call it where blocking is allowed.
    pub fn shutdown(&self) {
        if let Err(e) = self.provider.shutdown_with_timeout(EXPORT_TIMEOUT) {
            tracing::warn!(error = %e, "tracing: the last spans could not be exported");
        }
    }

    /// A recorded request's server span, the child of the client's `traceparent` if it sent
    /// one, in a context for the request's future to run in.
    ///
    /// Whether it is recorded is decided first, as the sampler would (parent-based; the ratio
    /// on the trace id otherwise). A request left unrecorded gets no span and no context: its
    /// `traceparent` is rewritten in `headers` as its upstream call would have sent it (the
    /// client's trace id or a new one, a span id of the proxy's, the unsampled flag; the
    /// client's `tracestate` kept), and it runs as untraced requests do. `None` then.
    pub(crate) fn request(
        &self,
        headers: &mut HeaderMap,
        method: &Method,
        route: &str,
    ) -> Option<Context> {
        let ids = RandomIdGenerator::default();
        // Most requests bring no `traceparent`: no propagator, no context to read, and the
        // header's slot, found once, takes the unrecorded request's.
        if let Entry::Vacant(slot) = headers.entry(TRACEPARENT) {
            // One trace id: the ratio decides on it, and an unrecorded request's
            // `traceparent` carries it (a recorded root span gets its own from the SDK, whose
            // span builder takes no trace id).
            let trace_id = ids.new_trace_id();
            if !self.ratio.records(trace_id) {
                if let Some(value) = unsampled::traceparent(trace_id, ids.new_span_id()) {
                    slot.insert(value);
                }
                return None;
            }
            return Some(self.server_span(method, route, Context::new()));
        }
        let parent = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
        let remote = parent.span().span_context().clone();
        // A `traceparent` that does not parse counts as none.
        let trace_id = if remote.is_valid() {
            remote.trace_id()
        } else {
            ids.new_trace_id()
        };
        let recorded = if remote.is_valid() {
            remote.is_sampled()
        } else {
            self.ratio.records(trace_id)
        };
        if !recorded {
            // The client's `tracestate`, if any, stays in the headers as it came.
            if let Some(value) = unsampled::traceparent(trace_id, ids.new_span_id()) {
                headers.insert(TRACEPARENT, value);
            }
            return None;
        }
        Some(self.server_span(method, route, parent))
    }

    /// The request's server span, a child of `parent` (the client's, or none), in the context
    /// its future runs in.
    fn server_span(&self, method: &Method, route: &str, parent: Context) -> Context {
        let span = self
            .tracer
            .span_builder(format!("{method} {route}"))
            .with_kind(SpanKind::Server)
            .with_attributes([
                KeyValue::new("http.request.method", method.as_str().to_owned()),
                KeyValue::new("http.route", route.to_owned()),
            ])
            .start_with_context(&self.tracer, &parent);
        parent
            .with_span(span)
            .with_value(Active(self.tracer.clone()))
    }
}

/// What a request's server span says when it ends.
pub(crate) struct Ending<'a> {
    pub status: u16,
    pub outcome: &'a str,
    pub replayed: bool,
    /// A replay of a result a resolution found (`Idempotent-Resolved`).
    pub resolved: bool,
    /// The hashed store key, if the request had one.
    pub key: Option<&'a [u8]>,
}

/// Ends the request's span in `cx` with what became of the request.
pub(crate) fn end_request(cx: &Context, ending: &Ending<'_>) {
    let span = cx.span();
    if !span.is_recording() {
        return;
    }
    let mut attributes = vec![
        KeyValue::new("http.response.status_code", i64::from(ending.status)),
        KeyValue::new("idemproxy.outcome", ending.outcome.to_owned()),
        KeyValue::new("idemproxy.replayed", ending.replayed),
        KeyValue::new("idemproxy.resolved", ending.resolved),
    ];
    if let Some(key) = ending.key {
        attributes.push(KeyValue::new("idemproxy.key", short_key(key)));
    }
    span.set_attributes(attributes);
    if ending.status >= 500 {
        span.set_status(Status::error(ending.outcome.to_owned()));
    }
    span.end();
}

/// The first 16 hex digits of a hashed store key: enough to find the record with the key
/// tooling, never the key itself.
fn short_key(hashed: &[u8]) -> String {
    hex::encode(&hashed[..hashed.len().min(8)])
}

/// A child span of the request being served on this thread, if it is traced.
pub(crate) struct Child(Option<opentelemetry_sdk::trace::Span>);

impl Child {
    /// A span named `name` under the current request's span; nothing without one.
    pub(crate) fn start(name: &'static str) -> Child {
        Child(Context::map_current(|cx| {
            // An unsampled request records nothing: its steps make no span at all.
            if !sampled(cx) {
                return None;
            }
            let Active(tracer) = cx.get::<Active>()?;
            Some(tracer.start_with_context(name, cx))
        }))
    }

    /// The upstream call: a client span under the current request's span, whose context
    /// goes to the upstream in `traceparent` and `tracestate` (replacing the client's: the
    /// upstream's parent is this span). Nothing without a traced request; `server`'s host is
    /// read only for a span (a search of the authority's text, on every request otherwise).
    pub(crate) fn upstream<B>(req: &mut http::Request<B>, server: &http::uri::Authority) -> Child {
        Child(Context::map_current(|cx| {
            let method = req.method();
            // Not recorded (or no `tracing:`): no span; an unrecorded request's `traceparent`
            // was written into its headers when it arrived (`Traces::request`).
            if !sampled(cx) {
                return None;
            }
            let Active(tracer) = cx.get::<Active>()?;
            let span = tracer
                .span_builder(method.as_str().to_owned())
                .with_kind(SpanKind::Client)
                .with_attributes([
                    KeyValue::new("http.request.method", method.as_str().to_owned()),
                    KeyValue::new("server.address", server.host().to_owned()),
                ])
                .start_with_context(tracer, cx);
            let sent = Context::new().with_remote_span_context(span.span_context().clone());
            TraceContextPropagator::new()
                .inject_context(&sent, &mut HeaderInjector(req.headers_mut()));
            Some(span)
        }))
    }

    /// Records the upstream's status (or that the call failed), then ends the span.
    pub(crate) fn end_call(self, status: Option<u16>) {
        let Some(mut span) = self.0 else { return };
        match status {
            Some(status) => {
                span.set_attribute(KeyValue::new(
                    "http.response.status_code",
                    i64::from(status),
                ));
                if status >= 500 {
                    span.set_status(Status::error(status.to_string()));
                }
            }
            None => span.set_status(Status::error("no response")),
        }
        span.end();
    }

    /// Marks the operation failed; the span ends when dropped.
    pub(crate) fn failed(&mut self, why: &str) {
        if let Some(span) = &mut self.0 {
            span.set_status(Status::error(why.to_owned()));
        }
    }
}

/// Runs `work` in a span named `name` under the current request's span, so that the spans it
/// opens (an upstream call's) are its children; runs it as it is without a traced request.
pub(crate) async fn within<F: Future>(name: &'static str, work: F) -> F::Output {
    let cx = Context::map_current(|cx| {
        if !sampled(cx) {
            return None;
        }
        let Active(tracer) = cx.get::<Active>()?;
        Some(cx.with_span(tracer.start_with_context(name, cx)))
    });
    let Some(cx) = cx else {
        return work.await;
    };
    let out = work.with_context(cx.clone()).await;
    cx.span().end();
    out
}

/// Whether the request in `cx` is recorded: an unsampled one costs no child span.
fn sampled(cx: &Context) -> bool {
    cx.span().span_context().is_sampled()
}

/// A span of its own for work that outlives the current request (a resolution),
/// linked to the request's span and recorded if the request is; the context to run it in. End
/// it with [`end_detached`].
pub(crate) fn detached(route: &str) -> Option<Context> {
    Context::map_current(|cx| {
        // An unrecorded request's resolution is not recorded either.
        if !sampled(cx) {
            return None;
        }
        let Active(tracer) = cx.get::<Active>()?;
        let request = cx.span().span_context().clone();
        // A root span: `Sampling` records it if its request is recorded.
        let span = tracer
            .span_builder(DETACHED)
            .with_attributes([KeyValue::new("http.route", route.to_owned())])
            .with_links(vec![Link::with_context(request)])
            .start_with_context(tracer, &Context::new());
        Some(
            Context::new()
                .with_span(span)
                .with_value(Active(tracer.clone())),
        )
    })
}

/// Ends a span [`detached`] started.
pub(crate) fn end_detached(cx: &Context) {
    cx.span().end();
}

/// Marks the current span (a resolution's) resolved, with how: `idemproxy.resolved` and
/// `idemproxy.resolution`. Nothing without one.
pub(crate) fn resolved(how: &'static str) {
    Context::map_current(|cx| {
        if cx.get::<Active>().is_some() {
            cx.span().set_attributes([
                KeyValue::new("idemproxy.resolved", true),
                KeyValue::new("idemproxy.resolution", how),
            ]);
        }
    });
}

/// `work`, to run in a task of its own, carrying the current request's trace context along:
/// its store operations and upstream calls stay children of the request's span (and its
/// upstream gets the request's `traceparent`), though the request may have been answered by
/// then. As it is when the request is not traced.
pub(crate) fn carried<F: Future>(work: F) -> Either<F, WithContext<F>> {
    match current() {
        Some(cx) => Either::Right(work.with_context(cx)),
        None => Either::Left(work),
    }
}

/// Whether the current request is traced (its context attached): for the steps that move a
/// request's work to a task of its own, which must carry the context along.
pub(crate) fn current() -> Option<Context> {
    Context::map_current(|cx| cx.span().span_context().is_valid().then(|| cx.clone()))
}

struct HeaderExtractor<'a>(&'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

struct HeaderInjector<'a>(&'a mut HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(key.as_bytes()),
            HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}
