//! Export never costs an answer: a collector down, hanging or refusing; a flood.

use std::time::{Duration, Instant};

use harness::otlp::{Mode, OtlpReceiver};
use harness::{Backend, Env, free_port};

use crate::support::{book, traced};

/// Requests answered one after the other; the slowest answer's time.
async fn slowest(proxy: &harness::TestProxy, prefix: &str, n: usize) -> Duration {
    let mut worst = Duration::ZERO;
    for i in 0..n {
        let start = Instant::now();
        let reply = book(proxy, &format!("{prefix}-{i}"), &[]).await;
        assert_eq!(reply.status, 201, "{reply:?}");
        worst = worst.max(start.elapsed());
    }
    worst
}

#[tokio::test]
async fn a_collector_down_hanging_or_refusing_changes_no_answer() {
    let env = Env::new(Backend::Memory).await;
    // Down: nothing listens there.
    let down = format!("http://127.0.0.1:{}", free_port());
    let proxy = env.proxy(&traced(&env, "", &down, "1")).await;
    let worst = slowest(&proxy, "down", 30).await;
    assert!(worst < Duration::from_secs(1), "a request took {worst:?}");
    proxy.stop().await;

    for mode in [Mode::Hang, Mode::Refuse] {
        let receiver = OtlpReceiver::start().await;
        receiver.set_mode(mode);
        let proxy = env
            .proxy(&traced(&env, "", &receiver.endpoint(), "1"))
            .await;
        let worst = slowest(&proxy, &format!("{mode:?}"), 30).await;
        assert!(
            worst < Duration::from_secs(1),
            "{mode:?}: a request took {worst:?}"
        );
        // The exporter did try: the first export reached the collector.
        let deadline = Instant::now() + Duration::from_secs(5);
        while receiver.requests() == 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(receiver.requests() > 0, "{mode:?}: no export arrived");
        drop(proxy);
    }
}

#[tokio::test]
async fn the_queue_holds_its_bound_under_a_flood_and_counts_its_drops() {
    let receiver = OtlpReceiver::start().await;
    receiver.set_mode(Mode::Hang);
    let env = Env::new(Backend::Memory).await;
    let proxy = env
        .proxy(&traced(&env, "", &receiver.endpoint(), "1"))
        .await;
    // Four spans a request (server, claim, upstream, save): far more than the queue holds
    // while the collector holds the first batch.
    let n = 1000;
    let worst = slowest(&proxy, "flood", n).await;
    assert!(worst < Duration::from_secs(1), "a request took {worst:?}");
    let dropped = proxy.metric("idemproxy_spans_dropped_total", &[]);
    let recorded = 4.0 * n as f64;
    // What is not dropped is queued or in the one batch the hanging export holds.
    assert!(dropped > 0.0, "nothing dropped");
    assert!(
        recorded - dropped <= (2048 + 512) as f64,
        "{recorded} recorded, {dropped} dropped: more kept than the queue holds"
    );
    drop(proxy);
}

/// A steady stream of spans, more than a batch, all reach the collector, and soon: the
/// exporter's thread wakes once a batch (a full one, or the first span of one, whose linger
/// then runs), and what a full batch leaves behind waits one linger at most. Then a second,
/// later request's spans arrive on their own too (an idle exporter wakes for a new batch).
#[tokio::test]
async fn every_span_of_a_stream_longer_than_a_batch_reaches_the_collector() {
    let receiver = OtlpReceiver::counting().await;
    let env = Env::new(Backend::Memory).await;
    let proxy = env
        .proxy(&traced(&env, "", &receiver.endpoint(), "1"))
        .await;
    // Four spans a request (server, claim, upstream, save): 1,200, two full batches of 512
    // and 176 left over.
    let n = 300;
    slowest(&proxy, "stream", n).await;
    let expected = 4 * n as u64;
    let until = Instant::now() + Duration::from_secs(5);
    while receiver.counted() < expected && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(receiver.counted(), expected, "spans received");
    assert_eq!(proxy.metric("idemproxy_spans_dropped_total", &[]), 0.0);

    tokio::time::sleep(Duration::from_secs(1)).await;
    slowest(&proxy, "later", 1).await;
    let until = Instant::now() + Duration::from_secs(3);
    while receiver.counted() < expected + 4 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        receiver.counted(),
        expected + 4,
        "the later request's spans"
    );
}

#[tokio::test]
async fn with_tracing_absent_nothing_is_propagated_or_counted() {
    let env = Env::new(Backend::Memory).await;
    let proxy = env.proxy(&env.config("")).await;
    assert_eq!(book(&proxy, "untraced-1", &[]).await.status, 201);
    let sent = env.mock.last_request().expect("the upstream's request");
    assert!(
        !sent.headers.contains_key("traceparent"),
        "nothing propagated"
    );
    assert_eq!(proxy.metric("idemproxy_spans_dropped_total", &[]), 0.0);
    proxy.stop().await;
}

#[tokio::test]
async fn a_hanging_collector_holds_the_exit_one_export_timeout_at_most() {
    let receiver = OtlpReceiver::start().await;
    receiver.set_mode(Mode::Hang);
    let env = Env::new(Backend::Memory).await;
    let proxy = env
        .proxy(&traced(&env, "", &receiver.endpoint(), "1"))
        .await;
    slowest(&proxy, "exit", 200).await;
    // Wait for the first export to hang.
    let deadline = Instant::now() + Duration::from_secs(5);
    while receiver.requests() == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(receiver.requests() > 0, "no export arrived");
    let start = Instant::now();
    proxy.stop().await;
    let took = start.elapsed();
    // The export timeout is 10s; the queued spans are not waited for one batch at a time.
    assert!(took < Duration::from_secs(15), "the stop took {took:?}");
}
