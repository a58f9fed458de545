//! The pool against a real HTTP/1.1 upstream on loopback.

use std::convert::Infallible;
use std::sync::atomic::AtomicUsize;

use http_body_util::{BodyExt, Full};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::*;

/// An upstream on loopback that answers every request with `size` bytes (the path says
/// how many), counting the connections it accepted.
async fn upstream() -> (Uri, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let service = hyper::service::service_fn(|req: Request<Incoming>| async move {
                    let size: usize = req.uri().path()[1..].parse().unwrap_or(0);
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(vec![b'x'; size]))))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tcp), service)
                    .await;
            });
        }
    });
    let target = format!("http://{addr}/").parse().expect("uri");
    (target, accepted)
}

fn pool(target: Uri, idle_timeout: Duration) -> Pool {
    pool_connecting_within(target, Duration::from_secs(5), idle_timeout)
}

fn pool_connecting_within(target: Uri, connect_timeout: Duration, idle_timeout: Duration) -> Pool {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(
            crate::tls::ClientTls::public_roots()
                .expect("the Mozilla roots")
                .client_config(),
        )
        .https_or_http()
        .enable_http1()
        .wrap_connector(http);
    Pool::new(connector, target, connect_timeout, idle_timeout)
}

/// A deadline no test here reaches.
fn far() -> Instant {
    Instant::now() + Duration::from_secs(30)
}

fn get(size: usize) -> Request<Body> {
    let mut req = Request::new(crate::body::empty());
    *req.uri_mut() = format!("/{size}").parse().expect("uri");
    req
}

async fn read(pool: &Pool, size: usize) -> usize {
    let resp = pool.send(get(size), far()).await.expect("a response");
    resp.into_body()
        .collect()
        .await
        .expect("the body")
        .to_bytes()
        .len()
}

#[tokio::test]
async fn a_connection_serves_again_once_its_response_has_ended() {
    let (target, accepted) = upstream().await;
    let pool = pool(target, Duration::from_secs(60));
    for size in [10, 0, 100_000, 3] {
        assert_eq!(read(&pool, size).await, size);
    }
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        1,
        "one connection for all four"
    );
}

#[tokio::test]
async fn a_response_dropped_before_its_end_takes_its_connection_with_it() {
    let (target, accepted) = upstream().await;
    let pool = pool(target, Duration::from_secs(60));
    let resp = pool.send(get(1_000_000), far()).await.expect("a response");
    drop(resp);
    assert_eq!(read(&pool, 5).await, 5);
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        2,
        "the connection still carrying a body is never lent again"
    );
}

#[tokio::test]
async fn an_idle_timeout_of_zero_never_reuses() {
    let (target, accepted) = upstream().await;
    let pool = pool(target, Duration::ZERO);
    for _ in 0..3 {
        assert_eq!(read(&pool, 1).await, 1);
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn a_connection_idle_for_the_timeout_is_never_reused() {
    let (target, accepted) = upstream().await;
    let pool = pool(target, Duration::from_millis(200));
    assert_eq!(read(&pool, 1).await, 1);
    assert_eq!(read(&pool, 1).await, 1);
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        1,
        "reused within the timeout"
    );
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert_eq!(read(&pool, 1).await, 1);
    assert_eq!(accepted.load(Ordering::SeqCst), 2, "not reused after it");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        pool.inner.idle.lock().expect("idle").is_empty(),
        "the reaper closed the idle connection"
    );
}

#[tokio::test]
async fn nothing_listening_is_a_connect_error() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    drop(listener);
    let pool = pool(
        format!("http://{addr}/").parse().expect("uri"),
        Duration::from_secs(1),
    );
    match pool.send(get(1), far()).await {
        Err(SendError::Connect(detail)) => assert!(detail.contains("connect"), "{detail}"),
        other => panic!(
            "expected a connect error, got {:?}",
            other.map(|r| r.status())
        ),
    }
}

/// SPEC §4.3: the upstream counts a connection idle from when it sent the last byte of a
/// response, which can be long before the proxy finished reading it. A response whose body is
/// read for longer than the idle timeout leaves its connection too old to lend, counted from
/// the head's arrival (counted from the body's end, as before, it was lent again).
#[tokio::test]
async fn the_idle_clock_starts_when_the_response_head_arrives() {
    let (target, accepted) = upstream().await;
    let pool = pool(target, Duration::from_millis(300));
    let resp = pool.send(get(100), far()).await.expect("a response");
    // A slow reader: the whole body has long been sent by the upstream.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let body = resp.into_body().collect().await.expect("the body");
    assert_eq!(body.to_bytes().len(), 100);
    assert_eq!(read(&pool, 1).await, 1);
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        2,
        "the connection idle 600ms on the upstream's side was not lent again"
    );
    assert_eq!(read(&pool, 1).await, 1);
    assert_eq!(accepted.load(Ordering::SeqCst), 2, "a fresh one is reused");
}

/// A connection put back after a slower body than the one before it keeps the stack ordered
/// by the heads' arrival: the connection whose head came last is lent first.
#[tokio::test]
async fn connections_are_kept_in_the_order_their_heads_arrived() {
    let (target, _accepted) = upstream().await;
    let pool = pool(target, Duration::from_secs(60));
    let first = pool.send(get(10), far()).await.expect("a response");
    let second = pool.send(get(10), far()).await.expect("a response");
    // The second head arrived last, but its body ends first.
    second.into_body().collect().await.expect("the body");
    first.into_body().collect().await.expect("the body");
    let idle = pool.inner.idle.lock().expect("idle");
    assert_eq!(idle.len(), 2);
    assert!(idle[0].since <= idle[1].since, "ordered by head arrival");
}

/// An upstream that answers the first request on each connection, then resets the connection
/// when the next request arrives, before any byte of an answer (a server that closed it with
/// the request unread).
async fn resetting_upstream() -> Uri {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let mut got = Vec::new();
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match tcp.read(&mut buf).await {
                        Ok(n @ 1..) => got.extend_from_slice(&buf[..n]),
                        _ => return,
                    }
                }
                let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                if tcp.write_all(answer).await.is_err() {
                    return;
                }
                if let Ok(1..) = tcp.read(&mut buf).await {
                    let _ = tcp.set_zero_linger();
                }
            });
        }
    });
    format!("http://{addr}/").parse().expect("uri")
}

/// SPEC §4.3: a reset on a reused connection with no response byte is a request the upstream
/// answered nothing to, which the proxy may send once more on a fresh connection (under
/// `on_unknown_outcome: release`); the same reset on a fresh connection, or after a response
/// byte, is not.
#[tokio::test]
async fn a_reset_on_a_reused_connection_before_any_answer_is_unanswered() {
    let pool = pool(resetting_upstream().await, Duration::from_secs(60));
    assert_eq!(read(&pool, 1).await, 2, "the first request is answered");
    match pool.send(get(1), far()).await {
        Err(e @ SendError::Failed { reused: true, .. }) => {
            assert!(e.unanswered_on_reused(), "a reset before any answer: {e:?}");
        }
        other => panic!(
            "expected a failure on the reused connection, got {:?}",
            other.map(|r| r.status())
        ),
    }
    match pool.send_fresh(get(1), far()).await {
        Ok(resp) => assert_eq!(resp.status(), 200, "a fresh connection answers"),
        Err(e) => panic!("the fresh connection failed: {e:?}"),
    }
}

/// A listener whose accept queue is full: new connections' SYNs are dropped, so a connect
/// hangs (as behind a firewall, or to an overloaded host). Returns it and the connections that
/// fill its queue, which must be kept open.
async fn full_backlog() -> (tokio::net::TcpListener, Vec<TcpStream>) {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind("127.0.0.1:0".parse().expect("addr"))
        .expect("bind");
    let listener = socket.listen(0).expect("listen");
    let addr = listener.local_addr().expect("addr");
    let mut fillers = Vec::new();
    for _ in 0..8 {
        match tokio::time::timeout(Duration::from_millis(300), TcpStream::connect(addr)).await {
            Ok(Ok(tcp)) => fillers.push(tcp),
            _ => return (listener, fillers),
        }
    }
    panic!("the accept queue of a listen(0) socket never filled");
}

/// SPEC §4.4: a connection not made within `connect_timeout`, or within what is left of the
/// request's deadline, whichever ends first, is a connect error (nothing was sent), never a
/// timeout.
#[tokio::test]
async fn a_connect_that_hangs_is_a_connect_error_at_the_first_deadline() {
    let (listener, _fillers) = full_backlog().await;
    let target: Uri = format!("http://{}/", listener.local_addr().expect("addr"))
        .parse()
        .expect("uri");

    let pool = pool_connecting_within(
        target.clone(),
        Duration::from_millis(200),
        Duration::from_secs(60),
    );
    let started = Instant::now();
    match pool.send(get(1), far()).await {
        Err(SendError::Connect(detail)) => {
            assert!(detail.contains("connect_timeout (200ms)"), "{detail}");
        }
        other => panic!(
            "expected a connect error, got {:?}",
            other.map(|r| r.status())
        ),
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "at connect_timeout"
    );

    let pool = pool_connecting_within(target, Duration::from_secs(20), Duration::from_secs(60));
    let deadline = Instant::now() + Duration::from_millis(200);
    match pool.send(get(1), deadline).await {
        Err(SendError::Connect(detail)) => {
            assert!(detail.contains("what was left of timeout"), "{detail}");
        }
        other => panic!(
            "expected a connect error, got {:?}",
            other.map(|r| r.status())
        ),
    }
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "at the deadline"
    );
}

/// What a raw upstream saw on one connection after its first answer: the bytes that came, and
/// how the connection ended.
#[derive(Debug, Default)]
struct Seen {
    after_answer: usize,
    reset: bool,
}

/// An upstream that answers the first request head it reads with an empty `200` (when
/// `answer_first`) and then, after `stall`, reads everything else the connection brings, to
/// its end.
async fn raw_upstream(
    answer_first: bool,
    stall: Duration,
) -> (Uri, tokio::sync::oneshot::Receiver<Seen>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let Ok((mut tcp, _)) = listener.accept().await else {
            return;
        };
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            if tcp.read(&mut byte).await.unwrap_or(0) == 0 {
                return;
            }
            head.push(byte[0]);
        }
        if answer_first {
            let _ = tcp
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                .await;
        }
        tokio::time::sleep(stall).await;
        let mut seen = Seen::default();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match tcp.read(&mut buf).await {
                Ok(0) => break,
                Ok(n) => seen.after_answer += n,
                Err(e) => {
                    seen.reset = e.kind() == std::io::ErrorKind::ConnectionReset;
                    break;
                }
            }
        }
        let _ = tx.send(seen);
    });
    (format!("http://{addr}/").parse().expect("uri"), rx)
}

fn post_by(size: usize, write_by: Instant) -> Request<Body> {
    let mut req = Request::new(crate::body::full(Bytes::from(vec![b'y'; size])));
    *req.method_mut() = http::Method::POST;
    *req.uri_mut() = "/book".parse().expect("uri");
    req.extensions_mut().insert(WriteBy(write_by));
    req
}

/// A request whose send deadline has passed when it goes out on a pooled connection writes
/// nothing: it is `Unsent`, and the connection is reset.
#[tokio::test]
async fn past_its_send_deadline_a_request_writes_nothing_and_resets_the_connection() {
    let (target, seen) = raw_upstream(true, Duration::ZERO).await;
    let pool = pool(target, Duration::from_secs(60));
    let first = pool.send(get(0), far()).await.expect("the first answer");
    first.into_body().collect().await.expect("its body");
    match pool.send(post_by(1024, Instant::now()), far()).await {
        Err(SendError::Unsent(detail)) => assert!(detail.contains("deadline"), "{detail}"),
        other => panic!("expected Unsent, got {other:?}"),
    }
    let seen = tokio::time::timeout(Duration::from_secs(5), seen)
        .await
        .expect("the upstream's connection ended")
        .expect("seen");
    assert_eq!(seen.after_answer, 0, "not a byte of the second request");
    assert!(seen.reset, "reset, not closed: {seen:?}");
}

/// A body still being written to an upstream that does not read when the send deadline passes
/// is cut off: the connection is reset, so what the kernel still held never arrives.
#[tokio::test]
async fn a_body_cut_off_at_its_send_deadline_never_arrives_whole() {
    const SIZE: usize = 32 * 1024 * 1024;
    let (target, seen) = raw_upstream(false, Duration::from_secs(1)).await;
    let pool = pool(target, Duration::from_secs(60));
    let write_by = Instant::now() + Duration::from_millis(300);
    match pool.send(post_by(SIZE, write_by), far()).await {
        Err(SendError::TimedOut | SendError::Failed { .. }) => {}
        other => panic!("expected an unknown outcome, got {other:?}"),
    }
    assert!(
        Instant::now() < write_by + Duration::from_millis(500),
        "cut at the deadline"
    );
    let seen = tokio::time::timeout(Duration::from_secs(10), seen)
        .await
        .expect("the upstream's connection ended")
        .expect("seen");
    assert!(
        seen.after_answer < SIZE,
        "the body never arrived whole: {seen:?}"
    );
    assert!(seen.reset, "reset, not closed: {seen:?}");
}
