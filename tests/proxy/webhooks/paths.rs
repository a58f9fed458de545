//! Nothing reaches a webhook handler unverified: every spelling of a webhook route's path is
//! checked by that route (a broader pass-through route never takes it), a delivery without
//! its signature is refused before its body is read, and a `Connection` header can't strip a
//! signed header on its way to the handler. No store plays a part: the embedded one.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use harness::{Env, client, send};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::support::{Secret, SecretsFile, deliver, now};

/// The webhook route at `/webhooks/standard` and, after it, a pass-through route for
/// everything else: the layout that let spellings through.
fn yaml(env: &Env, file: &SecretsFile) -> String {
    format!(
        "listen: 127.0.0.1:0
upstreams:
  mock:
    url: {up}
routes:
  - name: events
    methods: [POST]
    path: /webhooks/standard
    upstream: mock
    webhook:
      provider: standard
      secrets_file: {secrets}
  - name: everything-else
    path: /*
    upstream: mock
",
        up = env.mock.url(),
        secrets = file.path,
    )
}

/// `POST path` written as is on a fresh connection (an HTTP client library would resolve dot
/// segments and backslashes before sending): the status and the body.
async fn raw_post(addr: &str, path: &str, headers: &[(&str, String)], body: &str) -> (u16, String) {
    let mut conn = TcpStream::connect(addr).await.expect("connect");
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    conn.write_all(head.as_bytes()).await.expect("head");
    conn.write_all(body.as_bytes()).await.expect("body");
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut answer))
        .await
        .expect("an answer in time")
        .expect("read the answer");
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or_default();
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

fn address(proxy: &harness::TestProxy) -> String {
    proxy
        .url("")
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_spelling_of_a_webhook_path_is_checked_by_its_route() {
    let env = Env::new(harness::Backend::Memory).await;
    let secret = Secret::new(b"the route's secret");
    let file = SecretsFile::new(&[&secret]);
    let proxy = env.proxy(&yaml(&env, &file)).await;
    let addr = address(&proxy);
    for path in [
        "/webhooks/standard",
        "/webhooks/standard/",
        "/Webhooks/Standard",
        "/webhooks//standard",
        "/webhooks/./standard",
        "/webhooks/x/../standard",
        "/webhooks/standard/x/..",
        "/webhooks/standard;x=1",
        "/webhook%73/standard",
        "/webhooks%2Fstandard",
        "/webhooks%5Cstandard",
        "/webhooks\\standard",
        "/webhooks/standard.json",
        "/WEBHOOKS/%2e/STANDARD.xml/",
    ] {
        let (status, body) = raw_post(&addr, path, &[], r#"{"type":"forged"}"#).await;
        assert_eq!(status, 401, "{path}: {body}");
        assert!(
            body.contains("webhook-signature-invalid") && body.contains("missing signature"),
            "{path}: {body}"
        );
    }
    assert_eq!(env.mock.stats().total, 0, "nothing reached the upstream");
    // A genuine delivery to another spelling is verified and forwarded as it was written.
    let ts = now();
    let body = r#"{"type":"invoice.paid"}"#;
    let headers = [
        ("webhook-id", "msg_1".to_owned()),
        ("webhook-timestamp", ts.to_string()),
        ("webhook-signature", secret.sign("msg_1", ts, body)),
    ];
    let (status, answer) = raw_post(&addr, "/Webhooks/Standard/", &headers, body).await;
    assert_ne!(status, 401, "{answer}");
    let seen = env.mock.last_request().expect("forwarded");
    assert_eq!(
        seen.uri.path(),
        "/Webhooks/Standard/",
        "the raw path is forwarded"
    );
    // Other routes still match the raw path: an escaped slash inside an id, a matrix
    // parameter, are normal traffic.
    let r = send(client().get(proxy.url("/bookings/a%2Fb;v=1"))).await;
    assert_ne!(r.status, 401);
    assert_eq!(
        env.mock.last_request().map(|r| r.uri.path().to_owned()),
        Some("/bookings/a%2Fb;v=1".to_owned())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsigned_delivery_is_refused_before_its_body_is_read() {
    let env = Env::new(harness::Backend::Memory).await;
    let secret = Secret::new(b"the route's secret");
    let file = SecretsFile::new(&[&secret]);
    let proxy = env
        .proxy(&super::support::yaml(
            &env,
            &file,
            "    idempotency:\n      max_request_body: 64MiB\n",
        ))
        .await;
    let conn = TcpStream::connect(address(&proxy)).await.expect("connect");
    let (mut reader, mut writer) = conn.into_split();
    let declared = 50 * 1024 * 1024;
    let head = format!(
        "POST /webhooks/standard HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {declared}\r\n\r\n"
    );
    writer.write_all(head.as_bytes()).await.expect("head");
    // The client goes on sending its body, 16 KiB at a time, while it waits for an answer.
    let sent = Arc::new(AtomicUsize::new(0));
    let counted = sent.clone();
    let sender = tokio::spawn(async move {
        let chunk = vec![b'x'; 16 * 1024];
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(10)
            && counted.load(Ordering::Relaxed) < declared
        {
            if writer.write_all(&chunk).await.is_err() {
                break;
            }
            counted.fetch_add(chunk.len(), Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    });
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    let read = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let n = reader.read(&mut buf).await.expect("read the answer");
            answer.extend_from_slice(&buf[..n]);
            if n == 0 || answer.windows(4).any(|w| w == b"\r\n\r\n") {
                break;
            }
        }
    })
    .await;
    let sent = sent.load(Ordering::Relaxed);
    sender.abort();
    assert!(read.is_ok(), "no answer while the body was still coming");
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 401"), "{text}");
    // The sender was stopped once the answer came: whatever it had sent by then.
    assert!(
        sent < 1024 * 1024,
        "answered after {sent} bytes of the body"
    );
    assert_eq!(env.mock.stats().total, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_header_naming_a_signed_header_is_refused() {
    let env = Env::new(harness::Backend::Memory).await;
    let secret = Secret::new(b"the route's secret");
    let file = SecretsFile::new(&[&secret]);
    let proxy = env.proxy(&super::support::yaml(&env, &file, "")).await;
    let body = r#"{"type":"invoice.paid"}"#;
    for named in ["webhook-signature", "webhook-id", "Webhook-Timestamp"] {
        let r = deliver(
            &proxy,
            &secret,
            "msg_1",
            now(),
            body,
            &[("connection", named)],
        )
        .await;
        r.assert_problem(400, "hop-by-hop-conflict");
    }
    assert_eq!(env.mock.stats().total, 0, "nothing forwarded");
    let r = deliver(&proxy, &secret, "msg_1", now(), body, &[]).await;
    assert_eq!(r.status, 200, "nothing claimed: {:?}", r.body);
}
