use super::*;

fn settings(forwarded_proto: http::uri::Scheme) -> UpstreamSettings {
    UpstreamSettings {
        name: "booking".into(),
        url: "http://127.0.0.1:9/api/".parse().expect("uri"),
        connect_timeout: Duration::from_millis(500),
        timeout: Duration::from_secs(1),
        pool_idle_timeout: Duration::from_secs(1),
        tls: crate::tls::ClientTls::public_roots().expect("the Mozilla roots"),
        protocol: Protocol::Http1,
        forwarded_proto,
    }
}

/// An upstream that takes one connection and then refuses every other (its listener
/// closed): it answers the first request on it and resets it when the next arrives, before
/// any byte of an answer.
async fn one_connection_then_gone() -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let Ok((mut tcp, _)) = listener.accept().await else {
            return;
        };
        drop(listener);
        let mut buf = vec![0u8; 4096];
        let mut got = Vec::new();
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            match tcp.read(&mut buf).await {
                Ok(n @ 1..) => got.extend_from_slice(&buf[..n]),
                _ => return,
            }
        }
        let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
        if tcp.write_all(answer).await.is_ok() && matches!(tcp.read(&mut buf).await, Ok(1..)) {
            let _ = tcp.set_zero_linger();
        }
    });
    addr
}

/// A request resent after its reused connection failed, whose fresh connection cannot be
/// made, answers with the first failure (the upstream may have received it), never with a
/// connect error that would say the request was not sent.
#[tokio::test]
async fn a_resend_that_cannot_connect_answers_with_the_first_failure() {
    let addr = one_connection_then_gone().await;
    let mut settings = settings(http::uri::Scheme::HTTP);
    settings.url = format!("http://{addr}/").parse().expect("uri");
    settings.timeout = Duration::from_secs(5);
    let up = Upstream::new(&settings, Histogram::new([0.1]));
    let get = || {
        let mut req = Request::new(Bytes::new());
        *req.uri_mut() = Uri::from_static("/");
        req
    };
    match up.call_bounded(get(), 1024, true).await {
        Ok((parts, Bounded::Complete(body))) => {
            assert_eq!((parts.status.as_u16(), &body[..]), (200, &b"ok"[..]));
        }
        Ok(_) => panic!("a 2-byte body over the bound"),
        Err(e) => panic!("the first request failed: {e}"),
    }
    match up.call_bounded(get(), 1024, true).await {
        Err(UpstreamError::Failed(detail)) => {
            assert!(detail.contains("reset"), "{detail}");
        }
        Err(e) => panic!("expected the reused connection's failure, got {e:?}"),
        Ok(_) => panic!("the reused connection was reset"),
    }
}

#[tokio::test]
async fn x_forwarded_proto_is_the_listeners_scheme() {
    for scheme in [http::uri::Scheme::HTTP, http::uri::Scheme::HTTPS] {
        let up = Upstream::new(&settings(scheme.clone()), Histogram::new([0.1]));
        let (parts, ()) = Request::builder()
            .uri("/bookings")
            // A client's own claim is replaced, never passed on.
            .header("x-forwarded-proto", "gopher")
            .body(())
            .expect("request")
            .into_parts();
        let client: SocketAddr = "127.0.0.7:5555".parse().expect("addr");
        let req = up
            .request(parts, body::empty(), client, None)
            .expect("request");
        assert_eq!(req.headers()["x-forwarded-proto"], scheme.as_str());
    }
}

#[tokio::test]
async fn the_upstream_request_is_rebased_and_carries_forwarding_headers() {
    let up = Upstream::new(&settings(http::uri::Scheme::HTTP), Histogram::new([0.1]));
    let (parts, ()) = Request::builder()
        .method("POST")
        .uri("/bookings?x=1")
        .header("host", "shop.example")
        .header("x-forwarded-for", "10.0.0.1")
        .header("x-forwarded-for", "10.0.0.2")
        .header("idempotency-key", "k")
        .header("connection", "x-secret")
        .header("x-secret", "1")
        .body(())
        .expect("request")
        .into_parts();
    let client: SocketAddr = "127.0.0.7:5555".parse().expect("addr");
    let key = HeaderName::from_static("idempotency-key");
    let req = up
        .request(parts, body::empty(), client, Some(&key))
        .expect("request");
    assert_eq!(req.uri(), "/api/bookings?x=1", "origin form, rebased");
    let h = req.headers();
    assert_eq!(h["x-forwarded-for"], "10.0.0.1, 10.0.0.2, 127.0.0.7");
    assert_eq!(h["x-forwarded-host"], "shop.example");
    assert_eq!(h["x-forwarded-proto"], "http");
    assert_eq!(h["host"], "127.0.0.1:9", "the upstream's own Host");
    assert!(h.get("idempotency-key").is_none(), "forward_key: false");
    assert!(h.get("x-secret").is_none() && h.get("connection").is_none());
}

#[test]
fn the_host_header_leaves_out_the_schemes_default_port() {
    use http::uri::Scheme;
    for (scheme, authority, host) in [
        (Scheme::HTTP, "bookings.internal", "bookings.internal"),
        (Scheme::HTTP, "bookings.internal:80", "bookings.internal"),
        (Scheme::HTTP, "10.0.0.5:8080", "10.0.0.5:8080"),
        (Scheme::HTTPS, "pay.example:443", "pay.example"),
        (Scheme::HTTPS, "pay.example:80", "pay.example:80"),
        (Scheme::HTTP, "[::1]:9000", "[::1]:9000"),
    ] {
        let authority = http::uri::Authority::from_static(authority);
        assert_eq!(
            host_header(&scheme, &authority),
            host,
            "{scheme}://{authority}"
        );
    }
}

#[test]
fn client_addresses_are_written_as_display_writes_them() {
    for ip in [
        "0.0.0.0",
        "127.0.0.1",
        "10.20.100.255",
        "9.99.199.200",
        "::1",
        "2001:db8::7",
    ] {
        let ip: std::net::IpAddr = ip.parse().expect("ip");
        let mut out = String::from("x, ");
        push_ip(&mut out, ip);
        assert_eq!(out, format!("x, {ip}"));
    }
}

#[test]
fn hop_by_hop_headers_go_including_those_connection_names() {
    let mut h = HeaderMap::new();
    h.insert("connection", HeaderValue::from_static("close, x-secret"));
    h.insert("x-secret", HeaderValue::from_static("1"));
    h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
    h.insert("proxy-foo", HeaderValue::from_static("1"));
    h.insert("te", HeaderValue::from_static("trailers"));
    h.insert("upgrade", HeaderValue::from_static("websocket"));
    h.insert("x-keep", HeaderValue::from_static("1"));
    h.insert("set-cookie", HeaderValue::from_static("a=b"));
    strip_hop_by_hop(&mut h);
    let left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
    assert_eq!(left, vec!["x-keep", "set-cookie"]);
    // A gRPC call's head: `te` goes, the rest stay in their order.
    let mut h = HeaderMap::new();
    h.insert("content-type", HeaderValue::from_static("application/grpc"));
    h.insert("te", HeaderValue::from_static("trailers"));
    h.insert("grpc-timeout", HeaderValue::from_static("1S"));
    h.insert("idempotency-key", HeaderValue::from_static("k"));
    strip_hop_by_hop(&mut h);
    let left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
    assert_eq!(
        left,
        vec!["content-type", "idempotency-key", "grpc-timeout"]
    );
}

#[test]
fn an_error_chain_says_each_cause_once() {
    #[derive(Debug)]
    struct Layer(&'static str, Option<Box<Layer>>);
    impl std::fmt::Display for Layer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }
    impl std::error::Error for Layer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1
                .as_deref()
                .map(|l| l as &(dyn std::error::Error + 'static))
        }
    }
    let e = Layer(
        "connection error",
        Some(Box::new(Layer(
            "connection error",
            Some(Box::new(Layer("connection reset by peer", None))),
        ))),
    );
    assert_eq!(
        error_chain(&e),
        "connection error: connection reset by peer"
    );
}
