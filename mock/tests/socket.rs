//! The bundled mock booking service on a real socket: its routes, counters and `X-Mock-*`
//! control headers as a client sees them, served as the `mock-upstream` binary serves it (on
//! the product's Listener, through the harness). What needs no socket is tested in
//! `src/tests.rs`.
#![allow(clippy::unwrap_used)]

use std::io;
use std::time::{Duration, Instant};

use bytes::Bytes;
use harness::mock::start;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idemproxy_mock::{MockStats, body_pattern};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

type TestClient = Client<HttpConnector, Full<Bytes>>;

fn client() -> TestClient {
    Client::builder(TokioExecutor::new()).build_http()
}

async fn send(
    client: &TestClient,
    method: Method,
    url: String,
    headers: &[(&str, &str)],
    body: &str,
) -> Result<(StatusCode, HeaderMap, Bytes), Box<dyn std::error::Error + Send + Sync>> {
    let mut request = Request::builder().method(method).uri(url);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(Full::new(Bytes::from(body.to_owned())))?;
    let response = client.request(request).await?;
    let (parts, body) = response.into_parts();
    let body = body.collect().await?.to_bytes();
    Ok((parts.status, parts.headers, body))
}

fn doc(body: &Bytes) -> Value {
    serde_json::from_slice(body).unwrap()
}

#[tokio::test]
async fn post_bookings_creates_and_counts_per_key() {
    let mock = start().await.unwrap();
    let client = client();
    let url = format!("{}/bookings", mock.url());

    let (status, headers, body) = send(
        &client,
        Method::POST,
        url.clone(),
        &[
            ("idempotency-key", "k1"),
            ("content-type", "application/json"),
        ],
        r#"{"room": 12, "nights": [1, 2]}"#,
    )
    .await
    .unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["location"], "/bookings/bk_1");
    assert_eq!(headers["x-booking-id"], "bk_1");
    assert_eq!(headers["content-type"], "application/json");
    assert!(headers.contains_key("etag"));
    assert_eq!(
        doc(&body),
        json!({"id": "bk_1", "seq": 1, "request": {"room": 12, "nights": [1, 2]}})
    );

    let (status, _, created) = send(
        &client,
        Method::POST,
        url.clone(),
        &[("idempotency-key", "k1")],
        "not \"json\"",
    )
    .await
    .unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(
        doc(&created),
        json!({"id": "bk_2", "seq": 2, "request": "not \"json\""})
    );
    send(&client, Method::POST, url, &[("idempotency-key", "k2")], "")
        .await
        .unwrap();

    assert_eq!(mock.calls("k1"), 2);
    assert_eq!(mock.calls("k2"), 1);
    assert_eq!(mock.calls("nope"), 0);
    assert_eq!(mock.total(), 3);
    assert_eq!(mock.bookings(), 3);

    let (status, headers, body) = send(
        &client,
        Method::GET,
        format!("{}/bookings/bk_2", mock.url()),
        &[],
        "",
    )
    .await
    .unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["x-booking-id"], "bk_2");
    assert_eq!(body, created, "the stored booking, byte for byte");
    let (status, _, body) = send(
        &client,
        Method::GET,
        format!("{}/bookings/bk_99", mock.url()),
        &[],
        "",
    )
    .await
    .unwrap();
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(
        doc(&body),
        json!({"error": "booking not found", "id": "bk_99"})
    );
    // GETs count too (no key): 3 + 2.
    assert_eq!(mock.total(), 5);

    mock.reset();
    assert_eq!(mock.stats(), MockStats::default());
    let (_, headers, _) = send(
        &client,
        Method::POST,
        format!("{}/bookings", mock.url()),
        &[],
        "",
    )
    .await
    .unwrap();
    assert_eq!(headers["x-booking-id"], "bk_4", "ids are never reused");
    mock.shutdown().await.unwrap();
}

#[tokio::test]
async fn delay_is_counted_before_the_answer() {
    let mock = start().await.unwrap();
    let client = client();
    let url = format!("{}/payments", mock.url());
    let started = Instant::now();
    let request = tokio::spawn(async move {
        send(
            &client,
            Method::POST,
            url,
            &[("idempotency-key", "slow"), ("x-mock-delay", "300ms")],
            "{}",
        )
        .await
        .map(|(status, _, _)| status)
    });
    // Counted on arrival, 300ms before its answer: polled for, at most 3s.
    let counted = harness::eventually(Duration::from_secs(3), || mock.calls("slow") == 1).await;
    assert!(counted, "counted while still delaying");
    assert!(!request.is_finished());
    assert_eq!(request.await.unwrap().unwrap(), StatusCode::OK);
    assert!(started.elapsed() >= Duration::from_millis(300));
}

#[tokio::test]
async fn status_override() {
    let mock = start().await.unwrap();
    let (status, headers, body) = send(
        &client(),
        Method::POST,
        format!("{}/bookings", mock.url()),
        &[("idempotency-key", "k"), ("x-mock-status", "503")],
        "{}",
    )
    .await
    .unwrap();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["content-type"], "application/json");
    assert_eq!(
        doc(&body),
        json!({
            "status": 503,
            "reason": "Service Unavailable",
            "method": "POST",
            "path": "/bookings",
            "mock": "X-Mock-Status",
        })
    );
    assert_eq!(mock.calls("k"), 1);
    assert_eq!(mock.bookings(), 0, "the route did not run");
}

#[tokio::test]
async fn invalid_directive_is_a_400() {
    let mock = start().await.unwrap();
    let (status, _, body) = send(
        &client(),
        Method::GET,
        format!("{}/x", mock.url()),
        &[("x-mock-delay", "soon")],
        "",
    )
    .await
    .unwrap();
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let error = doc(&body)["error"].as_str().unwrap().to_owned();
    assert!(error.contains("x-mock-delay"), "{error}");
}

#[tokio::test]
async fn body_size_headers_and_cookies() {
    let mock = start().await.unwrap();
    for size in [0usize, 1, 100, 64 * 1024, 200_001] {
        let size_text = size.to_string();
        let (status, headers, body) = send(
            &client(),
            Method::POST,
            format!("{}/bookings", mock.url()),
            &[
                ("x-mock-body-size", &size_text),
                ("x-mock-set-cookie", "session=abc; Path=/"),
                ("x-mock-header", "X-Foo: 1"),
                ("x-mock-header", "Keep-Alive: timeout=5"),
                ("x-mock-header", "X-Foo: 2"),
            ],
            "{}",
        )
        .await
        .unwrap();
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(headers["content-type"], "application/octet-stream");
        assert_eq!(headers["content-length"], size_text.as_str());
        assert_eq!(headers["set-cookie"], "session=abc; Path=/");
        let foo: Vec<_> = headers.get_all("x-foo").iter().collect();
        assert_eq!(foo, ["1", "2"]);
        assert_eq!(headers["keep-alive"], "timeout=5");
        assert_eq!(body.len(), size);
        assert!(body[..] == body_pattern(size)[..]);
    }
}

#[tokio::test]
async fn echo_shows_what_arrived() {
    let mock = start().await.unwrap();
    let (status, _, body) = send(
        &client(),
        Method::PUT,
        format!("{}/echo/a?b=1&c=%20", mock.url()),
        &[
            ("idempotency-key", "\"quoted\""),
            ("x-forwarded-for", "10.0.0.1"),
        ],
        "plain\ntext",
    )
    .await
    .unwrap();
    assert_eq!(status, StatusCode::OK);
    let echo = doc(&body);
    assert_eq!(echo["method"], "PUT");
    assert_eq!(echo["path"], "/echo/a");
    assert_eq!(echo["query"], "b=1&c=%20");
    assert_eq!(echo["headers"]["idempotency-key"], json!(["\"quoted\""]));
    assert_eq!(echo["headers"]["x-forwarded-for"], json!(["10.0.0.1"]));
    assert_eq!(echo["body"], "plain\ntext");
    assert_eq!(echo.as_object().unwrap().len(), 5, "{echo}");
    assert_eq!(mock.calls("\"quoted\""), 1);
    let last = mock.last_request().unwrap();
    assert_eq!(last.method, Method::PUT);
    assert_eq!(last.uri.query(), Some("b=1&c=%20"));
    assert_eq!(last.headers["x-forwarded-for"], "10.0.0.1");
    assert_eq!(&last.body[..], b"plain\ntext");
}

#[tokio::test]
async fn reset_is_a_client_error_and_still_counted() {
    let mock = start().await.unwrap();
    let result = send(
        &client(),
        Method::POST,
        format!("{}/bookings", mock.url()),
        &[("idempotency-key", "boom"), ("x-mock-reset", "true")],
        "{}",
    )
    .await;
    assert!(result.is_err(), "{result:?}");
    assert_eq!(mock.calls("boom"), 1);
}

#[tokio::test]
async fn reset_is_a_tcp_reset() {
    let mock = start().await.unwrap();
    let mut stream = TcpStream::connect(mock.addr()).await.unwrap();
    stream
        .write_all(b"GET /x HTTP/1.1\r\nhost: mock\r\nx-mock-reset: 1\r\n\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let error = stream.read_to_end(&mut buf).await.unwrap_err();
    assert_eq!(error.kind(), io::ErrorKind::ConnectionReset);
    assert!(buf.is_empty());
}

#[tokio::test]
async fn partial_sends_half_then_drops() {
    let mock = start().await.unwrap();
    let mut stream = TcpStream::connect(mock.addr()).await.unwrap();
    stream
        .write_all(
            b"GET /x HTTP/1.1\r\nhost: mock\r\nx-mock-partial: true\r\nx-mock-body-size: 1000\r\n\r\n",
        )
        .await
        .unwrap();
    let mut buf = Vec::new();
    // An orderly close (or a reset) after the first half; either way, no more data.
    let _ = stream.read_to_end(&mut buf).await;
    let text = String::from_utf8_lossy(&buf);
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("content-length: 1000"), "{head}");
    assert_eq!(body.as_bytes(), &body_pattern(500)[..]);

    // The hyper client sees an incomplete body.
    let result = send(
        &client(),
        Method::POST,
        format!("{}/bookings", mock.url()),
        &[("x-mock-partial", "true")],
        "{}",
    )
    .await;
    assert!(result.is_err(), "{result:?}");
    assert_eq!(mock.total(), 2);
}

#[tokio::test]
async fn control_endpoints_are_not_counted() {
    let mock = start().await.unwrap();
    let client = client();
    for key in ["a", "a", "b/c d"] {
        send(
            &client,
            Method::POST,
            format!("{}/bookings", mock.url()),
            &[("idempotency-key", key)],
            "",
        )
        .await
        .unwrap();
    }
    send(
        &client,
        Method::DELETE,
        format!("{}/x", mock.url()),
        &[],
        "",
    )
    .await
    .unwrap();

    let (status, _, body) = send(
        &client,
        Method::GET,
        format!("{}/_mock/stats", mock.url()),
        &[],
        "",
    )
    .await
    .unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        doc(&body),
        json!({
            "total": 4,
            "bookings": 3,
            "by_key": {"a": 2, "b/c d": 1},
            "by_reference": {},
            "webhooks": 0,
            "events": {},
            "postings": 0,
            "postings_by_reference": {},
        })
    );
    let (_, _, body) = send(
        &client,
        Method::GET,
        format!("{}/_mock/calls?key=b%2Fc+d", mock.url()),
        &[],
        "",
    )
    .await
    .unwrap();
    assert_eq!(doc(&body), json!({"key": "b/c d", "calls": 1}));
    let (status, _, body) = send(
        &client,
        Method::POST,
        format!("{}/_mock/reset", mock.url()),
        &[],
        "",
    )
    .await
    .unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(doc(&body), json!({"reset": true}));
    assert_eq!(mock.stats(), MockStats::default());
}

#[tokio::test]
async fn responses_lost_after_and_before_the_booking() {
    let mock = start().await.unwrap();
    let client = client();
    let book = |reference: &str, lose: &'static str| {
        let body = format!(r#"{{"reference":"{reference}"}}"#);
        let (client, url) = (&client, format!("{}/bookings", mock.url()));
        async move {
            let headers = [("x-mock-lose-response", lose)];
            send(client, Method::POST, url, &headers, &body).await
        }
    };
    let lookup = |reference: &str| {
        send(
            &client,
            Method::GET,
            format!("{}/bookings/by-reference/{reference}", mock.url()),
            &[],
            "",
        )
    };

    let lost = book("R-1", "after").await;
    assert!(lost.is_err(), "no response: {lost:?}");
    let (status, headers, body) = lookup("R-1").await.unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["x-booking-id"], "bk_1");
    assert_eq!(
        doc(&body),
        json!({"id": "bk_1", "seq": 1, "request": {"reference": "R-1"}})
    );

    let lost = book("R-2", "before").await;
    assert!(lost.is_err(), "no response: {lost:?}");
    let (status, _, body) = lookup("R-2").await.unwrap();
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(
        doc(&body),
        json!({"error": "no booking with this reference", "reference": "R-2"})
    );

    let stats = mock.stats();
    assert_eq!((stats.bookings, stats.total), (1, 4));
    assert_eq!(stats.by_reference.get("R-1"), Some(&1));
    assert_eq!(stats.by_reference.get("R-2"), None);
}

#[tokio::test]
async fn a_hang_holds_the_answer_after_the_booking() {
    let mock = start().await.unwrap();
    let url = mock.url();
    let started = Instant::now();
    let hanging = tokio::spawn(async move {
        send(
            &client(),
            Method::POST,
            format!("{url}/bookings"),
            &[("x-mock-lose-response", "after"), ("x-mock-hang", "1s")],
            r#"{"reference":"R-1"}"#,
        )
        .await
        .map(|(status, _, _)| status)
    });
    // The booking exists while the answer is held.
    let deadline = Instant::now() + Duration::from_secs(5);
    while mock.state().bookings_for("R-1") == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (status, _, _) = send(
        &client(),
        Method::GET,
        format!("{}/bookings/by-reference/R-1", mock.url()),
        &[],
        "",
    )
    .await
    .unwrap();
    assert_eq!(status, StatusCode::OK);
    let lost = hanging.await.unwrap();
    assert!(lost.is_err(), "no response after the hang: {lost:?}");
    assert!(started.elapsed() >= Duration::from_secs(1));
}

#[tokio::test]
async fn a_late_commit_shows_the_booking_only_later() {
    let mock = start().await.unwrap();
    let client = client();
    let lost = send(
        &client,
        Method::POST,
        format!("{}/bookings", mock.url()),
        &[
            ("x-mock-lose-response", "after"),
            ("x-mock-commit-after", "300ms"),
        ],
        r#"{"reference":"R-1"}"#,
    )
    .await;
    assert!(lost.is_err(), "{lost:?}");
    let made = Instant::now();
    let url = format!("{}/bookings/by-reference/R-1", mock.url());
    let (status, _, _) = send(&client, Method::GET, url.clone(), &[], "")
        .await
        .unwrap();
    // Generous: this lookup is well within 300 ms of the booking unless the machine stalls.
    if made.elapsed() < Duration::from_millis(250) {
        assert_eq!(status, StatusCode::NOT_FOUND, "not visible yet");
    }
    assert_eq!(mock.state().bookings_for("R-1"), 1, "made at once");
    let deadline = Instant::now() + Duration::from_secs(5);
    let status = loop {
        let (status, _, _) = send(&client, Method::GET, url.clone(), &[], "")
            .await
            .unwrap();
        if status == StatusCode::OK || Instant::now() > deadline {
            break status;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(status, StatusCode::OK);
    assert!(made.elapsed() >= Duration::from_millis(250));
}

#[tokio::test]
async fn the_webhook_handler_counts_events() {
    let mock = start().await.unwrap();
    let client = client();
    for _ in 0..3 {
        let (status, _, body) = send(
            &client,
            Method::POST,
            format!("{}/webhooks/standard", mock.url()),
            &[
                ("webhook-id", "msg_1"),
                ("content-type", "application/json"),
            ],
            r#"{"type":"booking.paid"}"#,
        )
        .await
        .unwrap();
        assert_eq!(status, StatusCode::OK);
        assert_eq!(doc(&body)["event_id"], "msg_1");
    }
    let (status, _, _) = send(
        &client,
        Method::POST,
        format!("{}/webhooks/standard", mock.url()),
        &[("webhook-id", "msg_2"), ("x-mock-status", "500")],
        "{}",
    )
    .await
    .unwrap();
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    let (_, _, body) = send(
        &client,
        Method::GET,
        format!("{}/_mock/stats", mock.url()),
        &[],
        "",
    )
    .await
    .unwrap();
    let stats = doc(&body);
    assert_eq!(stats["webhooks"], 3);
    assert_eq!(stats["events"], json!({"msg_1": 3}));
    assert_eq!(stats["total"], 4);
    assert_eq!(mock.state().events("msg_1"), 3);
}

#[tokio::test]
async fn speaks_h2c() {
    let mock = start().await.unwrap();
    let client: TestClient = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let (status, _, body) = send(
        &client,
        Method::POST,
        format!("{}/bookings", mock.url()),
        &[("idempotency-key", "h2")],
        "{}",
    )
    .await
    .unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(doc(&body), json!({"id": "bk_1", "seq": 1, "request": {}}));
    assert_eq!(mock.calls("h2"), 1);
}

#[tokio::test]
async fn drop_stops_the_server() {
    let mock = start().await.unwrap();
    let addr = mock.addr();
    drop(mock);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(TcpStream::connect(addr).await.is_err());
}
