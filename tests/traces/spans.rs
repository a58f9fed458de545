//! The spans each kind of request gives, their attributes and their parents.

use std::time::Duration;

use harness::otlp::OtlpReceiver;
use harness::{Backend, Env, client, send};

use crate::support::{assert_nowhere, book, children, names, servers, traced};

const WAIT: Duration = Duration::from_secs(10);

#[tokio::test]
async fn a_first_request_and_its_replay_give_their_spans() {
    let receiver = OtlpReceiver::start().await;
    let env = Env::new(Backend::Memory).await;
    let proxy = env
        .proxy(&traced(&env, "", &receiver.endpoint(), "1"))
        .await;
    let key = "trace-first-9f1c2e";
    let first = book(&proxy, key, &[]).await;
    assert_eq!(first.status, 201, "{first:?}");
    let spans = receiver
        .wait_for(WAIT, |s| servers(s).len() == 1 && s.len() >= 4)
        .await;
    let server = *servers(&spans).first().expect("a server span");
    assert_eq!(server.name, "POST create-booking");
    assert_eq!(server.service_name, "booking-proxy");
    assert_eq!(server.attr("http.request.method"), "POST");
    assert_eq!(server.attr("http.route"), "create-booking");
    assert_eq!(server.attr("http.response.status_code"), "201");
    assert_eq!(server.attr("idemproxy.outcome"), "forwarded");
    assert_eq!(server.attr("idemproxy.replayed"), "false");
    let hashed = server.attr("idemproxy.key");
    assert_eq!(hashed.len(), 16, "{hashed}");
    assert!(hashed.bytes().all(|b| b.is_ascii_hexdigit()), "{hashed}");
    assert!(
        server.parent_span_id.is_empty(),
        "a request without traceparent starts a trace"
    );
    let under = children(&spans, server);
    assert_eq!(
        names(&under),
        ["POST", "idemproxy.store.claim", "idemproxy.store.save"],
        "{spans:#?}"
    );
    let call = under.iter().find(|s| s.kind == 3).expect("a client span");
    assert_eq!(call.attr("server.address"), "127.0.0.1");
    assert_eq!(call.attr("http.response.status_code"), "201");

    let replay = book(&proxy, key, &[]).await;
    assert_eq!(replay.status, 201);
    assert_eq!(replay.header("idempotent-replayed"), "true");
    let spans = receiver.wait_for(WAIT, |s| servers(s).len() == 2).await;
    let again = servers(&spans)
        .into_iter()
        .find(|s| s.attr("idemproxy.outcome") == "replayed")
        .expect("the replay's server span");
    assert_eq!(again.attr("idemproxy.replayed"), "true");
    assert_eq!(
        again.attr("idemproxy.key"),
        hashed,
        "the same key, the same hash"
    );
    let under = children(&spans, again);
    assert_eq!(
        names(&under),
        ["idemproxy.store.claim"],
        "a replay has no upstream span"
    );
    assert_nowhere(&spans, key);
    assert_nowhere(&spans, "/bookings");
    proxy.stop().await;
}

#[tokio::test]
async fn a_conflict_is_a_server_span_with_its_outcome_and_no_upstream_span() {
    let receiver = OtlpReceiver::start().await;
    let env = Env::new(Backend::Memory).await;
    let proxy = env
        .proxy(&traced(&env, "", &receiver.endpoint(), "1"))
        .await;
    let key = "trace-conflict-41d0";
    let slow = {
        let url = proxy.url("/bookings");
        tokio::spawn(async move {
            send(
                client()
                    .post(url)
                    .header("idempotency-key", key)
                    .header("x-mock-delay", "1s")
                    .header("content-type", "application/json")
                    .body(r#"{"guest":"ada","room":"12"}"#),
            )
            .await
        })
    };
    // The first claim is in: its upstream call waits a second.
    let mut conflict = None;
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(25)).await;
        let reply = book(&proxy, key, &[]).await;
        if reply.status == 409 {
            conflict = Some(reply);
            break;
        }
    }
    assert!(
        conflict.is_some(),
        "the repeat while the first runs is a conflict"
    );
    assert_eq!(slow.await.expect("the first").status, 201);
    let spans = receiver
        .wait_for(WAIT, |s| {
            servers(s)
                .iter()
                .any(|s| s.attr("idemproxy.outcome") == "conflict")
                && servers(s)
                    .iter()
                    .any(|s| s.attr("idemproxy.outcome") == "forwarded")
        })
        .await;
    let conflict = servers(&spans)
        .into_iter()
        .find(|s| s.attr("idemproxy.outcome") == "conflict")
        .expect("the conflict's span");
    assert_eq!(conflict.attr("http.response.status_code"), "409");
    assert!(
        children(&spans, conflict).iter().all(|s| s.kind != 3),
        "a conflict calls no upstream: {spans:#?}"
    );
    assert_nowhere(&spans, key);
    proxy.stop().await;
}

#[tokio::test]
async fn a_clients_traceparent_is_the_parent_and_the_upstream_gets_the_upstream_span() {
    let receiver = OtlpReceiver::start().await;
    let env = Env::new(Backend::Memory).await;
    // Ratio 0: only the client's sampled flag records these.
    let proxy = env
        .proxy(&traced(&env, "", &receiver.endpoint(), "0"))
        .await;
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent = "00f067aa0ba902b7";
    let sampled = format!("00-{trace}-{parent}-01");
    let reply = book(
        &proxy,
        "trace-parent-1",
        &[("traceparent", &sampled), ("tracestate", "k=v")],
    )
    .await;
    assert_eq!(reply.status, 201);
    let spans = receiver
        .wait_for(WAIT, |s| servers(s).len() == 1 && s.len() >= 4)
        .await;
    let server = *servers(&spans).first().expect("a server span");
    assert_eq!(server.trace_id, trace);
    assert_eq!(server.parent_span_id, parent);
    let call = children(&spans, server)
        .into_iter()
        .find(|s| s.kind == 3)
        .expect("the upstream span");
    let sent = env.mock.last_request().expect("the upstream's request");
    let got = sent
        .headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    assert_eq!(
        got,
        format!("00-{trace}-{}-01", call.span_id),
        "the upstream's parent is the upstream span"
    );
    assert_eq!(
        sent.headers.get("tracestate").and_then(|v| v.to_str().ok()),
        Some("k=v")
    );

    // Not sampled: nothing recorded, the trace id and the flag still go upstream.
    let before = receiver.spans().len();
    let unsampled = format!("00-{trace}-{parent}-00");
    let reply = book(&proxy, "trace-parent-2", &[("traceparent", &unsampled)]).await;
    assert_eq!(reply.status, 201);
    let sent = env.mock.last_request().expect("the upstream's request");
    let got = sent
        .headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    assert!(
        got.starts_with(&format!("00-{trace}-")) && got.ends_with("-00"),
        "{got}"
    );
    // And a request with none, at ratio 0: not recorded either, but it starts a trace upstream.
    let reply = book(&proxy, "trace-parent-3", &[]).await;
    assert_eq!(reply.status, 201);
    let sent = env.mock.last_request().expect("the upstream's request");
    assert!(sent.headers.contains_key("traceparent"));
    proxy.stop().await;
    assert_eq!(
        receiver.spans().len(),
        before,
        "nothing recorded for unsampled requests"
    );
}

#[tokio::test]
async fn a_pass_through_request_is_traced_and_propagated_too() {
    let receiver = OtlpReceiver::start().await;
    let env = Env::new(Backend::Memory).await;
    let proxy = env
        .proxy(&traced(&env, "", &receiver.endpoint(), "1"))
        .await;
    let reply = send(client().get(proxy.url("/bookings/secret-path-77"))).await;
    assert!(reply.status < 500, "{reply:?}");
    let spans = receiver.wait_for(WAIT, |s| s.len() >= 2).await;
    let server = *servers(&spans).first().expect("a server span");
    assert_eq!(server.attr("http.route"), "rest");
    assert_eq!(server.attr("idemproxy.outcome"), "passthrough");
    let call = children(&spans, server)
        .into_iter()
        .find(|s| s.kind == 3)
        .expect("the upstream span");
    let sent = env.mock.last_request().expect("the upstream's request");
    let got = sent
        .headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    assert!(got.contains(&call.span_id), "{got}");
    assert_nowhere(&spans, "secret-path-77");
    proxy.stop().await;
}

/// The usual configuration with `create-booking` under `on_unknown_outcome: resolve`, asking
/// the mock's lookup by reference, traced at ratio 1.
fn resolving(env: &Env, endpoint: &str) -> String {
    let yaml = traced(env, "on_unknown_outcome: resolve\nresolve:", endpoint, "1");
    let block = "        request: GET /bookings/by-reference/{json:/reference}\n        settle_after: 5s\n        interval: 200ms\n";
    yaml.replacen("      resolve:\n", &format!("      resolve:\n{block}"), 1)
}

#[tokio::test]
async fn a_resolution_is_a_span_of_its_own_linked_to_its_request_with_its_lookups() {
    let receiver = OtlpReceiver::start().await;
    let env = Env::new(Backend::Memory).await;
    let proxy = env.proxy(&resolving(&env, &receiver.endpoint())).await;
    let body = r#"{"seat":"12A","reference":"R-traced"}"#;
    let first = harness::book_with(
        &proxy.url(""),
        "trace-resolve-1",
        body,
        &[("X-Mock-Lose-Response", "after")],
    )
    .await;
    assert_eq!(first.status, 502, "{first:?}");
    let spans = receiver
        .wait_for(WAIT, |s| {
            s.iter().any(|s| s.name == "idemproxy.resolve")
                && s.iter().any(|s| s.name == "idemproxy.resolve.lookup")
        })
        .await;
    let request = *servers(&spans).first().expect("the request's span");
    assert_eq!(request.attr("http.response.status_code"), "502");
    let resolution = spans
        .iter()
        .find(|s| s.name == "idemproxy.resolve")
        .expect("the resolution's span");
    assert!(resolution.parent_span_id.is_empty(), "a span of its own");
    assert_eq!(
        resolution.links,
        [(request.trace_id.clone(), request.span_id.clone())],
        "linked to its request"
    );
    assert_eq!(resolution.attr("http.route"), "create-booking");
    assert_eq!(resolution.attr("idemproxy.resolved"), "true");
    assert_eq!(resolution.attr("idemproxy.resolution"), "found");
    let under = children(&spans, resolution);
    let lookups: Vec<_> = under
        .iter()
        .filter(|s| s.name == "idemproxy.resolve.lookup")
        .collect();
    assert!(!lookups.is_empty(), "{spans:#?}");
    assert!(
        under.iter().any(|s| s.name == "idemproxy.store.save"),
        "the found answer saved under the resolution: {spans:#?}"
    );
    let asked = children(&spans, lookups[0]);
    assert!(
        asked
            .iter()
            .any(|s| s.kind == 3 && s.attr("http.response.status_code") == "200"),
        "the lookup's upstream call: {spans:#?}"
    );
    // The retry replays what the resolution found, and says so.
    let retry = harness::book_with(&proxy.url(""), "trace-resolve-1", body, &[]).await;
    assert_eq!(retry.header("idempotent-resolved"), "true", "{retry:?}");
    let spans = receiver.wait_for(WAIT, |s| servers(s).len() == 2).await;
    let replay = servers(&spans)
        .into_iter()
        .find(|s| s.attr("idemproxy.outcome") == "replayed")
        .expect("the retry's span");
    assert_eq!(replay.attr("idemproxy.resolved"), "true");
    assert_eq!(request.attr("idemproxy.resolved"), "false");
    assert_nowhere(&spans, "trace-resolve-1");
    assert_nowhere(&spans, "R-traced");
    proxy.stop().await;
}

#[tokio::test]
async fn a_webhook_delivery_is_a_server_span_with_its_key_hash_and_upstream_span() {
    use base64::Engine as _;
    let receiver = OtlpReceiver::start().await;
    let env = Env::new(Backend::Memory).await;
    let key = b"trace-webhook-secret-0123456789";
    let dir = tempfile::tempdir().expect("temp dir");
    let secrets = dir.path().join("secrets");
    let written = base64::engine::general_purpose::STANDARD.encode(key);
    std::fs::write(&secrets, format!("whsec_{written}\n")).expect("write the secret");
    let yaml = format!(
        "listen: 127.0.0.1:0\ntracing: {{otlp_endpoint: {endpoint}, sample_ratio: 1}}\n{store}upstreams:\n  mock:\n    url: {up}\nroutes:\n  - name: events\n    methods: [POST]\n    path: /webhooks/standard\n    upstream: mock\n    webhook:\n      provider: standard\n      secrets_file: {file}\n",
        endpoint = receiver.endpoint(),
        store = env.store_yaml(""),
        up = env.mock.url(),
        file = secrets.display(),
    );
    let proxy = env.proxy(&yaml).await;
    let id = "msg_trace_2bd1";
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let body = r#"{"type":"booking.paid","data":{"id":"b1"}}"#;
    let tag = ring::hmac::sign(
        &ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key),
        format!("{id}.{stamp}.{body}").as_bytes(),
    );
    let signature = format!(
        "v1,{}",
        base64::engine::general_purpose::STANDARD.encode(tag.as_ref())
    );
    let reply = send(
        client()
            .post(proxy.url("/webhooks/standard"))
            .header("content-type", "application/json")
            .header("webhook-id", id)
            .header("webhook-timestamp", stamp.to_string())
            .header("webhook-signature", &signature)
            .body(body),
    )
    .await;
    assert!(reply.status < 300, "{reply:?}");
    let spans = receiver
        .wait_for(WAIT, |s| servers(s).len() == 1 && s.len() >= 4)
        .await;
    let server = *servers(&spans).first().expect("the delivery's span");
    assert_eq!(server.name, "POST events");
    assert_eq!(server.attr("idemproxy.outcome"), "forwarded");
    assert_eq!(server.attr("idemproxy.key").len(), 16);
    let under = children(&spans, server);
    assert!(under.iter().any(|s| s.name == "idemproxy.store.claim"));
    assert!(under.iter().any(|s| s.kind == 3), "{spans:#?}");
    assert_nowhere(&spans, id);
    assert_nowhere(&spans, &signature);
    proxy.stop().await;
}

#[tokio::test]
async fn a_wait_under_on_conflict_wait_is_a_span_of_the_waiting_request() {
    let receiver = OtlpReceiver::start().await;
    let env = Env::new(Backend::Memory).await;
    let yaml = traced(
        &env,
        "on_conflict: wait\nwait_timeout: 5s",
        &receiver.endpoint(),
        "1",
    );
    let proxy = env.proxy(&yaml).await;
    let key = "trace-wait-5e2a";
    let first = {
        let url = proxy.url("/bookings");
        tokio::spawn(async move {
            send(
                client()
                    .post(url)
                    .header("idempotency-key", key)
                    .header("x-mock-delay", "600ms")
                    .header("content-type", "application/json")
                    .body(r#"{"guest":"ada","room":"12"}"#),
            )
            .await
        })
    };
    // Until the first claim is in, a repeat would claim the key itself: wait for its upstream
    // call to start.
    let mut started = false;
    for _ in 0..100 {
        if env.mock.calls(key) > 0 {
            started = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(started, "the first request reached the upstream");
    let repeat = book(&proxy, key, &[]).await;
    assert_eq!(repeat.status, 201, "the waiter gets the first's answer");
    assert_eq!(repeat.header("idempotent-replayed"), "true");
    assert_eq!(first.await.expect("the first").status, 201);
    let spans = receiver
        .wait_for(WAIT, |s| {
            servers(s)
                .iter()
                .any(|s| s.attr("idemproxy.outcome") == "replayed")
        })
        .await;
    let waiter = servers(&spans)
        .into_iter()
        .find(|s| s.attr("idemproxy.outcome") == "replayed")
        .expect("the waiter's span");
    let under = children(&spans, waiter);
    assert!(
        under.iter().any(|s| s.name == "idemproxy.wait"),
        "{spans:#?}"
    );
    assert!(
        under.iter().all(|s| s.kind != 3),
        "a waiter calls no upstream"
    );
    proxy.stop().await;
}

#[tokio::test]
async fn a_json_rpc_call_is_traced_and_its_upstream_gets_the_upstream_span() {
    let receiver = OtlpReceiver::start().await;
    let env = Env::new(Backend::Memory).await;
    let yaml = format!(
        "listen: 127.0.0.1:0\ntracing: {{otlp_endpoint: {endpoint}, sample_ratio: 1}}\n{store}upstreams:\n  tools:\n    url: {up}\nroutes:\n  - name: mcp-tools\n    path: /mcp\n    upstream: tools\n    jsonrpc: {{methods: [tools/call]}}\n    idempotency: {{key_from: [\"json:/params/_meta/idempotency-key\"]}}\n",
        endpoint = receiver.endpoint(),
        store = env.store_yaml(""),
        up = env.mock.url(),
    );
    let proxy = env.proxy(&yaml).await;
    let call = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"book","arguments":{"guest":"ada","room":"12"},"_meta":{"idempotency-key":"trace-mcp-77"}}}"#;
    let reply = send(
        client()
            .post(proxy.url("/mcp"))
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .body(call),
    )
    .await;
    assert_eq!(reply.status, 200, "{reply:?}");
    let spans = receiver
        .wait_for(WAIT, |s| servers(s).len() == 1 && s.len() >= 4)
        .await;
    let server = *servers(&spans).first().expect("the call's span");
    assert_eq!(server.attr("http.route"), "mcp-tools");
    assert_eq!(server.attr("idemproxy.outcome"), "forwarded");
    let upstream = children(&spans, server)
        .into_iter()
        .find(|s| s.kind == 3)
        .expect("the upstream span");
    let sent = env.mock.last_request().expect("the upstream's request");
    let got = sent
        .headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    assert_eq!(
        got,
        format!("00-{}-{}-01", server.trace_id, upstream.span_id)
    );
    assert_nowhere(&spans, "trace-mcp-77");
    proxy.stop().await;
}

#[tokio::test]
async fn a_grpc_call_is_a_server_span_with_its_upstream_span() {
    use harness::grpc::{Ledger, LedgerClient, TRANSFER, TransferRequest};
    let receiver = OtlpReceiver::start().await;
    let env = Env::new(Backend::Memory).await;
    let ledger = Ledger::start().await;
    let yaml = format!(
        "listen: 127.0.0.1:0\ntracing: {{otlp_endpoint: {endpoint}, sample_ratio: 1}}\n{store}upstreams:\n  ledger:\n    url: {url}\n    protocol: h2c\nroutes:\n  - name: ledger-transfer\n    path: {TRANSFER}\n    upstream: ledger\n    grpc: {{}}\n    idempotency: {{}}\n",
        endpoint = receiver.endpoint(),
        store = env.store_yaml(""),
        url = ledger.url(),
    );
    let proxy = env.proxy(&yaml).await;
    let mut client = LedgerClient::new(proxy.url("").trim_end_matches('/'));
    let mut req = tonic::Request::new(TransferRequest {
        reference: "trace-ref-1".into(),
        amount: 5,
    });
    req.metadata_mut()
        .insert("idempotency-key", "trace-grpc-1".parse().expect("metadata"));
    client.transfer(req).await.expect("the transfer");
    let spans = receiver
        .wait_for(WAIT, |s| servers(s).len() == 1 && s.len() >= 4)
        .await;
    let server = *servers(&spans).first().expect("the call's span");
    assert_eq!(server.name, "POST ledger-transfer");
    assert_eq!(server.attr("idemproxy.outcome"), "forwarded");
    let under = children(&spans, server);
    assert!(
        under
            .iter()
            .any(|s| s.kind == 3 && s.attr("http.response.status_code") == "200"),
        "{spans:#?}"
    );
    assert_nowhere(&spans, "trace-grpc-1");
    assert_nowhere(&spans, TRANSFER);
    proxy.stop().await;
}

/// `sample_ratio` decides for requests without a `traceparent`, once each: at 0.5 about half
/// of them are recorded (200 requests: 100 expected, a standard deviation of about 7), and
/// each unrecorded one still starts a trace of its own upstream, flagged unsampled.
#[tokio::test]
async fn the_ratio_records_its_share_of_requests_without_a_traceparent() {
    let receiver = OtlpReceiver::start().await;
    let env = Env::new(Backend::Memory).await;
    let proxy = env
        .proxy(&traced(&env, "", &receiver.endpoint(), "0.5"))
        .await;
    const N: usize = 200;
    let mut sent_ids = std::collections::HashSet::new();
    let mut unsampled = 0;
    for i in 0..N {
        let reply = send(client().get(proxy.url(&format!("/bookings/ratio-{i}")))).await;
        assert!(reply.status < 500, "{reply:?}");
        let sent = env.mock.last_request().expect("the upstream's request");
        let got = sent
            .headers
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        let parts: Vec<&str> = got.split('-').collect();
        assert_eq!(parts.len(), 4, "a traceparent upstream: {got:?}");
        sent_ids.insert(parts[1].to_owned());
        if parts[3] == "00" {
            unsampled += 1;
        }
    }
    proxy.stop().await;
    let recorded = servers(&receiver.spans()).len();
    assert!(
        (60..=140).contains(&recorded),
        "{recorded} of {N} requests recorded at sample_ratio 0.5"
    );
    assert_eq!(recorded + unsampled, N, "each request decided once");
    assert_eq!(sent_ids.len(), N, "a trace of its own for each request");
}

/// Under `mode: observe` the claim and the save run beside the request (the save after the
/// answer): they are still its store operations, children of its server span, and so are a
/// repeat's.
#[tokio::test]
async fn an_observed_request_keeps_its_store_operations_in_its_trace() {
    let receiver = OtlpReceiver::start().await;
    let env = Env::new(Backend::Memory).await;
    let proxy = env
        .proxy(&traced(&env, "mode: observe", &receiver.endpoint(), "1"))
        .await;
    let key = "trace-observed-51d0";
    let first = book(&proxy, key, &[]).await;
    assert_eq!(first.status, 201, "{first:?}");
    let spans = receiver
        .wait_for(WAIT, |s| {
            servers(s).len() == 1
                && s.iter().any(|x| x.name == "idemproxy.store.save")
                && s.iter().any(|x| x.name == "idemproxy.store.claim")
        })
        .await;
    let server = *servers(&spans).first().expect("a server span");
    assert_eq!(server.attr("http.route"), "create-booking");
    let mut under = names(&children(&spans, server));
    under.sort();
    assert_eq!(
        under,
        ["POST", "idemproxy.store.claim", "idemproxy.store.save"],
        "{spans:#?}"
    );
    proxy.stop().await;
}
