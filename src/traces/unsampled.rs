//! The sampling decision for a request without a parent, and the `traceparent` an unrecorded
//! request sends upstream: on every request of a traced route, so each costs what it must
//! and no more: no span, no propagator, no formatting machinery.

use http::{HeaderName, HeaderValue};
use opentelemetry::trace::{SpanId, TraceId};

/// The W3C header a request's trace context travels in.
pub(super) const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

/// `sample_ratio` as a bound on a trace id: the OpenTelemetry SDK's `TraceIdRatioBased` rule
/// (the trace id's low 64 bits, shifted right by one, below `ratio · 2⁶³`), with the bound
/// worked out once instead of on every request.
#[derive(Clone, Copy, Debug)]
pub(super) struct Ratio {
    /// Every trace is recorded (`ratio` ≥ 1), whatever its id.
    all: bool,
    bound: u64,
}

impl Ratio {
    pub(super) fn new(ratio: f64) -> Ratio {
        Ratio {
            all: ratio >= 1.0,
            // A float to integer cast saturates: 0 and below give 0, recording nothing.
            bound: (ratio.max(0.0) * (1u64 << 63) as f64) as u64,
        }
    }

    /// Whether a request without a parent whose trace is `trace_id` is recorded.
    pub(super) fn records(self, trace_id: TraceId) -> bool {
        let bytes = trace_id.to_bytes();
        let mut low = [0u8; 8];
        low.copy_from_slice(&bytes[8..]);
        self.all || (u64::from_be_bytes(low) >> 1) < self.bound
    }
}

/// `traceparent` for an unrecorded request: version 00, the trace and span ids in lower-case
/// hex, the flags 00 (not sampled).
pub(super) fn traceparent(trace: TraceId, span: SpanId) -> Option<HeaderValue> {
    let mut text = [0u8; 55];
    text[..3].copy_from_slice(b"00-");
    hex_into(&trace.to_bytes(), &mut text[3..35]);
    text[35] = b'-';
    hex_into(&span.to_bytes(), &mut text[36..52]);
    text[52..].copy_from_slice(b"-00");
    HeaderValue::from_bytes(&text).ok()
}

/// Each byte's two lower-case hex digits.
const HEX_PAIRS: [[u8; 2]; 256] = {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut pairs = [[0u8; 2]; 256];
    let mut byte = 0;
    while byte < 256 {
        pairs[byte] = [DIGITS[byte >> 4], DIGITS[byte & 0xf]];
        byte += 1;
    }
    pairs
};

/// Writes `bytes` in hex into `out`, two digits a byte (`out` is twice as long).
fn hex_into(bytes: &[u8], out: &mut [u8]) {
    for (pair, &byte) in out.chunks_exact_mut(2).zip(bytes) {
        pair.copy_from_slice(&HEX_PAIRS[usize::from(byte)]);
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderMap;
    use opentelemetry::Context;
    use opentelemetry::propagation::TextMapPropagator;
    use opentelemetry::trace::{SpanKind, TraceContextExt, TraceFlags, TraceState};
    use opentelemetry_sdk::propagation::TraceContextPropagator;
    use opentelemetry_sdk::trace::{
        IdGenerator, RandomIdGenerator, Sampler, SamplingDecision, ShouldSample,
    };

    use super::*;
    use crate::traces::HeaderInjector;

    /// What the propagator would write for the same ids and flags, byte for byte.
    #[test]
    fn an_unsampled_traceparent_is_what_the_propagator_writes() {
        let trace = TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").expect("a trace id");
        let span = SpanId::from_hex("00f067aa0ba902b7").expect("a span id");
        let ours = traceparent(trace, span).expect("a header value");
        let mut theirs = HeaderMap::new();
        let cx = Context::new().with_remote_span_context(opentelemetry::trace::SpanContext::new(
            trace,
            span,
            TraceFlags::default(),
            false,
            TraceState::default(),
        ));
        TraceContextPropagator::new().inject_context(&cx, &mut HeaderInjector(&mut theirs));
        assert_eq!(
            ours.as_bytes(),
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
        );
        assert_eq!(theirs.get(TRACEPARENT), Some(&ours));
    }

    /// Any ids: the propagator's text for them.
    #[test]
    fn every_traceparent_carries_its_ids() {
        let ids = RandomIdGenerator::default();
        let made: Vec<(TraceId, SpanId, HeaderValue)> = (0..200)
            .map(|_| {
                let (trace, span) = (ids.new_trace_id(), ids.new_span_id());
                (
                    trace,
                    span,
                    traceparent(trace, span).expect("a header value"),
                )
            })
            .collect();
        for (trace, span, value) in &made {
            assert_eq!(
                value.to_str().ok(),
                Some(format!("00-{trace}-{span}-00").as_str())
            );
        }
    }

    /// The same decision as the SDK's sampler for the same ratio and trace id.
    #[test]
    fn the_ratio_decides_as_the_sdks_sampler() {
        let ids = RandomIdGenerator::default();
        for ratio in [-1.0, 0.0, 1e-9, 0.01, 0.25, 0.5, 0.999, 1.0, 2.0] {
            let sdk = Sampler::TraceIdRatioBased(ratio);
            let ours = Ratio::new(ratio);
            for _ in 0..2_000 {
                let trace = ids.new_trace_id();
                let theirs = sdk
                    .should_sample(None, trace, "r", &SpanKind::Server, &[], &[])
                    .decision
                    == SamplingDecision::RecordAndSample;
                assert_eq!(ours.records(trace), theirs, "ratio {ratio}, trace {trace}");
            }
        }
    }
}
