//! A proxy whose `tracing:` points at a receiver, and what its tests read of the spans.

use harness::otlp::ReceivedSpan;
use harness::{Env, Reply, TestProxy, client, send};

/// `env`'s usual configuration (`create-booking` idempotent with `idem`, `pay`, `rest`) with
/// `tracing:` pointing at `endpoint`, at `ratio`.
pub(crate) fn traced(env: &Env, idem: &str, endpoint: &str, ratio: &str) -> String {
    format!(
        "tracing:\n  otlp_endpoint: {endpoint}\n  sample_ratio: {ratio}\n  service_name: booking-proxy\n{}",
        env.config(idem)
    )
}

/// `POST /bookings` with `key` and `extra` headers.
pub(crate) async fn book(proxy: &TestProxy, key: &str, extra: &[(&str, &str)]) -> Reply {
    let mut req = client()
        .post(proxy.url("/bookings"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(r#"{"guest":"ada","room":"12"}"#);
    for (name, value) in extra {
        req = req.header(*name, *value);
    }
    send(req).await
}

/// The server spans among `spans`.
pub(crate) fn servers(spans: &[ReceivedSpan]) -> Vec<&ReceivedSpan> {
    spans.iter().filter(|s| s.kind == 2).collect()
}

/// The spans whose parent is `parent`.
pub(crate) fn children<'a>(
    spans: &'a [ReceivedSpan],
    parent: &ReceivedSpan,
) -> Vec<&'a ReceivedSpan> {
    spans
        .iter()
        .filter(|s| s.parent_span_id == parent.span_id && s.trace_id == parent.trace_id)
        .collect()
}

/// The names of `spans`, sorted.
pub(crate) fn names(spans: &[&ReceivedSpan]) -> Vec<String> {
    let mut names: Vec<String> = spans.iter().map(|s| s.name.clone()).collect();
    names.sort();
    names
}

/// No attribute of any span holds `secret` (a raw key, a path, a header value).
pub(crate) fn assert_nowhere(spans: &[ReceivedSpan], secret: &str) {
    for span in spans {
        for (name, value) in &span.attributes {
            assert!(
                !value.contains(secret),
                "{} carries {secret:?} in {name}: {value}",
                span.name
            );
        }
    }
}
