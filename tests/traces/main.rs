//! Traces (`tracing:`), against a real OTLP/HTTP receiver in this process (the harness's
//! [`harness::otlp::OtlpReceiver`], decoding `ExportTraceServiceRequest`), the proxy in this
//! process and the mock upstream, all on loopback.
//!
//! - [`spans`] — the spans of a first request, a replay, a conflict, a webhook delivery and a
//!   pass-through, their attributes, and their parents: a client's `traceparent`, and the
//!   upstream's, whose parent is the upstream span.
//! - [`export`] — a collector that is down, hangs or refuses changes no answer; the queue
//!   holds its bound under a flood, its drops counted.

mod export;
mod spans;
mod support;
