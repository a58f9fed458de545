//! The lookup by reference, the lost responses and the webhook handler, through
//! [`MockUpstream::handle`] on paused time (a hang of a minute takes no real time). Over a real
//! socket, as the `mock-upstream` binary serves it: `tests/socket.rs`.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::{MockError, MockUpstream};

/// Sends one request; `Err` when the mock drops the connection.
async fn send(
    mock: &MockUpstream,
    method: Method,
    uri: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Result<(StatusCode, Value), MockError> {
    let mut request = Request::builder().method(method).uri(uri);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap();
    let response = mock.handle(request).await?;
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    Ok((status, serde_json::from_slice(&body).unwrap()))
}

async fn book(
    mock: &MockUpstream,
    body: &str,
    headers: &[(&str, &str)],
) -> Result<Value, MockError> {
    let (status, booking) = send(mock, Method::POST, "/bookings", headers, body).await?;
    assert_eq!(status, StatusCode::CREATED);
    Ok(booking)
}

async fn lookup(mock: &MockUpstream, reference: &str) -> (StatusCode, Value) {
    let uri = format!("/bookings/by-reference/{reference}");
    send(mock, Method::GET, &uri, &[], "").await.unwrap()
}

#[tokio::test]
async fn lookup_by_reference_finds_the_first_booking() {
    let mock = MockUpstream::new();
    let first = book(&mock, r#"{"reference":"R-1","seat":"12A"}"#, &[])
        .await
        .unwrap();
    book(&mock, r#"{"reference":"R-1","seat":"14C"}"#, &[])
        .await
        .unwrap();
    book(&mock, r#"{"reference":"R/7 ₹"}"#, &[]).await.unwrap();
    book(&mock, r#"{"reference":7}"#, &[]).await.unwrap();
    book(&mock, "reference=R-1", &[]).await.unwrap();

    assert_eq!(lookup(&mock, "R-1").await, (StatusCode::OK, first));
    let (status, found) = lookup(&mock, "R%2F7%20%E2%82%B9").await;
    assert_eq!((status, &found["id"]), (StatusCode::OK, &json!("bk_3")));
    for missing in ["R-2", "7", "%FF"] {
        let (status, body) = lookup(&mock, missing).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{missing}");
        assert_eq!(body["error"], "no booking with this reference", "{missing}");
    }
    assert_eq!(lookup(&mock, "R-2").await.1["reference"], "R-2");

    assert_eq!(mock.bookings_for("R-1"), 2);
    assert_eq!(mock.bookings_for("R/7 ₹"), 1);
    assert_eq!(mock.bookings(), 5, "every booking, with a reference or not");
    let stats = mock.stats();
    assert_eq!(stats.by_reference.len(), 2, "{stats:?}");
    let (_, stats) = send(&mock, Method::GET, "/_mock/stats", &[], "")
        .await
        .unwrap();
    assert_eq!(stats["by_reference"], json!({"R-1": 2, "R/7 ₹": 1}));

    mock.reset();
    assert_eq!(lookup(&mock, "R-1").await.0, StatusCode::NOT_FOUND);
    assert_eq!(mock.bookings_for("R-1"), 0);
}

#[tokio::test]
async fn a_response_lost_after_the_booking_leaves_the_booking() {
    let mock = MockUpstream::new();
    let lost = book(
        &mock,
        r#"{"reference":"R-1"}"#,
        &[("x-mock-lose-response", "after")],
    )
    .await;
    assert!(matches!(lost, Err(MockError::Reset)), "{lost:?}");
    assert_eq!(mock.bookings(), 1);
    assert_eq!(mock.bookings_for("R-1"), 1);
    let (status, booking) = lookup(&mock, "R-1").await;
    assert_eq!((status, &booking["id"]), (StatusCode::OK, &json!("bk_1")));
}

#[tokio::test]
async fn a_response_lost_before_the_booking_leaves_nothing() {
    let mock = MockUpstream::new();
    let lost = book(
        &mock,
        r#"{"reference":"R-1"}"#,
        &[("X-Mock-Lose-Response", "Before")],
    )
    .await;
    assert!(matches!(lost, Err(MockError::Reset)), "{lost:?}");
    assert_eq!(mock.bookings(), 0);
    assert_eq!(mock.bookings_for("R-1"), 0);
    assert_eq!(mock.total(), 1, "the request itself was counted");
    assert_eq!(lookup(&mock, "R-1").await.0, StatusCode::NOT_FOUND);
}

#[tokio::test(start_paused = true)]
async fn the_hang_comes_after_the_booking() {
    let mock = MockUpstream::new();
    let started = Instant::now();
    let hanging = tokio::spawn({
        let mock = mock.clone();
        async move {
            let headers = [("x-mock-lose-response", "after"), ("x-mock-hang", "1m")];
            book(&mock, r#"{"reference":"R-1"}"#, &headers)
                .await
                .map(|_| ())
        }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!hanging.is_finished(), "still hanging");
    assert_eq!(
        lookup(&mock, "R-1").await.0,
        StatusCode::OK,
        "booked before the hang"
    );
    let lost = hanging.await.unwrap();
    assert!(matches!(lost, Err(MockError::Reset)), "{lost:?}");
    assert!(started.elapsed() >= Duration::from_secs(60));

    // Lost before: nothing is booked, during the hang or after it.
    let hanging = tokio::spawn({
        let mock = mock.clone();
        async move {
            let headers = [("x-mock-lose-response", "before"), ("x-mock-hang", "1m")];
            book(&mock, r#"{"reference":"R-2"}"#, &headers)
                .await
                .map(|_| ())
        }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!hanging.is_finished());
    assert!(matches!(hanging.await.unwrap(), Err(MockError::Reset)));
    assert_eq!(mock.bookings_for("R-2"), 0);

    // A hang alone delays the answer after the booking, and answers.
    let headers = [("x-mock-hang", "2s")];
    let before = Instant::now();
    book(&mock, r#"{"reference":"R-3"}"#, &headers)
        .await
        .unwrap();
    assert!(before.elapsed() >= Duration::from_secs(2));
}

#[tokio::test(start_paused = true)]
async fn a_late_commit_hides_the_booking_until_then() {
    let mock = MockUpstream::new();
    let headers = [
        ("x-mock-lose-response", "after"),
        ("x-mock-commit-after", "3s"),
    ];
    let lost = book(&mock, r#"{"reference":"R-1"}"#, &headers).await;
    assert!(matches!(lost, Err(MockError::Reset)), "{lost:?}");
    assert_eq!(mock.bookings_for("R-1"), 1, "made and counted at once");
    assert_eq!(lookup(&mock, "R-1").await.0, StatusCode::NOT_FOUND);
    let (status, _) = send(&mock, Method::GET, "/bookings/bk_1", &[], "")
        .await
        .unwrap();
    assert_eq!(status, StatusCode::NOT_FOUND);

    tokio::time::advance(Duration::from_millis(2900)).await;
    assert_eq!(lookup(&mock, "R-1").await.0, StatusCode::NOT_FOUND);
    tokio::time::advance(Duration::from_millis(100)).await;
    let (status, booking) = lookup(&mock, "R-1").await;
    assert_eq!((status, &booking["id"]), (StatusCode::OK, &json!("bk_1")));
    let (status, _) = send(&mock, Method::GET, "/bookings/bk_1", &[], "")
        .await
        .unwrap();
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn the_lookup_skips_bookings_not_yet_visible() {
    let mock = MockUpstream::new();
    book(
        &mock,
        r#"{"reference":"R-1"}"#,
        &[("x-mock-commit-after", "1h")],
    )
    .await
    .unwrap();
    book(&mock, r#"{"reference":"R-1"}"#, &[]).await.unwrap();
    let (status, booking) = lookup(&mock, "R-1").await;
    assert_eq!((status, &booking["id"]), (StatusCode::OK, &json!("bk_2")));
}

#[tokio::test]
async fn webhooks_are_counted_by_event_id() {
    let mock = MockUpstream::new();
    let stripe = r#"{"id":"evt_1","type":"charge.succeeded"}"#;
    for n in 1..=2 {
        let (status, answer) = send(&mock, Method::POST, "/webhooks/stripe", &[], stripe)
            .await
            .unwrap();
        assert_eq!(status, StatusCode::OK);
        assert_eq!(
            answer,
            json!({"received": true, "provider": "stripe", "event_id": "evt_1", "deliveries": n})
        );
    }
    let headers = [("x-github-delivery", "72d3162e")];
    let (_, answer) = send(&mock, Method::POST, "/webhooks/github", &headers, "{}")
        .await
        .unwrap();
    assert_eq!(answer["event_id"], "72d3162e");
    // No id (Slack's url_verification handshake): handled, counted in `webhooks` only.
    let handshake = r#"{"type":"url_verification","challenge":"c"}"#;
    let (status, answer) = send(&mock, Method::POST, "/webhooks/slack", &[], handshake)
        .await
        .unwrap();
    assert_eq!(
        (status, &answer["event_id"]),
        (StatusCode::OK, &Value::Null)
    );
    // A failing handler (X-Mock-Status) handled nothing.
    let failing = [("x-mock-status", "503")];
    let (status, _) = send(&mock, Method::POST, "/webhooks/stripe", &failing, stripe)
        .await
        .unwrap();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);

    assert_eq!(mock.events("evt_1"), 2);
    assert_eq!(mock.events("72d3162e"), 1);
    assert_eq!(mock.total(), 5);
    let (_, stats) = send(&mock, Method::GET, "/_mock/stats", &[], "")
        .await
        .unwrap();
    assert_eq!(stats["webhooks"], 4);
    assert_eq!(stats["events"], json!({"evt_1": 2, "72d3162e": 1}));

    // Not a webhook: a GET, or no provider, is echoed like any other path.
    for (method, uri) in [
        (Method::GET, "/webhooks/stripe"),
        (Method::POST, "/webhooks/"),
    ] {
        let (_, echo) = send(&mock, method, uri, &[], stripe).await.unwrap();
        assert_eq!(echo["path"], uri);
    }
    assert_eq!(mock.stats().webhooks, 4);
}

#[tokio::test]
async fn bad_control_values_are_a_400() {
    let mock = MockUpstream::new();
    for (name, value) in [
        ("x-mock-lose-response", "sometimes"),
        ("x-mock-hang", "forever"),
        ("x-mock-commit-after", "later"),
    ] {
        let (status, body) = send(&mock, Method::POST, "/bookings", &[(name, value)], "{}")
            .await
            .unwrap();
        assert_eq!(status, StatusCode::BAD_REQUEST, "{name}");
        assert!(body["error"].as_str().unwrap().contains(name), "{body}");
    }
    assert_eq!(mock.bookings(), 0);
}

#[tokio::test]
async fn reservations_book_as_bookings_do_into_the_same_store() {
    let mock = MockUpstream::new();
    let body = r#"{"reference":"R-9","seat":"15D"}"#;
    let (status, made) = send(&mock, Method::POST, "/reservations", &[], body)
        .await
        .unwrap();
    assert_eq!(status, StatusCode::CREATED);
    let (status, found) = lookup(&mock, "R-9").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(found["id"], made["id"]);
    assert_eq!(mock.stats().by_reference.get("R-9"), Some(&1));
}

#[tokio::test]
async fn the_mcp_tool_books_once_per_call() {
    let mock = MockUpstream::new();
    let call = |id: u32| {
        let body = format!(
            r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"book","arguments":{{"seat":"3F"}}}}}}"#
        );
        http::Request::post("/mcp")
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from(body)))
            .expect("a request")
    };
    let answer = mock.handle(call(7)).await.expect("an answer");
    assert_eq!(answer.status(), http::StatusCode::OK);
    let body = http_body_util::BodyExt::collect(answer.into_body())
        .await
        .expect("the body")
        .to_bytes();
    let doc: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
    assert_eq!(doc["id"], 7);
    assert_eq!(doc["result"]["content"][0]["text"], "booked bk_1");
    assert_eq!(mock.bookings(), 1);
    let note = http::Request::post("/mcp")
        .body(http_body_util::Full::new(bytes::Bytes::from_static(
            br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
        )))
        .expect("a request");
    let answer = mock.handle(note).await.expect("an answer");
    assert_eq!(answer.status(), http::StatusCode::ACCEPTED);
    assert_eq!(mock.bookings(), 1);
}
