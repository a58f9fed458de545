//! The line between "not sent" and "maybe received" on an HTTP/2 upstream, against a raw HTTP/2
//! server (the `h2` crate) that refuses, answers, stalls or goes away as each test says: a stream
//! refused with `REFUSED_STREAM` is sent again on a fresh connection and runs once; a stream with
//! no answer by the deadline is reset; a `GOAWAY` with an error after the request is an unknown
//! outcome (on a `grpc:` route, `UNKNOWN`, kept).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use harness::{Backend, Env, client, send};
use tokio::net::TcpListener;

/// What the server does with one stream.
#[derive(Clone, Copy)]
enum Act {
    /// `RST_STREAM(REFUSED_STREAM)`: not processed.
    Refuse,
    /// `201` with a body.
    Answer,
    /// Nothing: the stream is held open, and a reset of it by the client is counted.
    Stall,
    /// `GOAWAY(INTERNAL_ERROR)` once the request has arrived: it may have been processed.
    GoAway,
}

#[derive(Default)]
struct Seen {
    /// Streams the server processed (answered, stalled or lost in a GOAWAY).
    processed: AtomicU64,
    /// Streams the client reset.
    resets: AtomicU64,
    /// Connections accepted.
    connections: AtomicU64,
}

/// An HTTP/2 server on loopback doing `acts` to its streams in order, then answering.
async fn upstream(acts: &[Act]) -> (SocketAddr, Arc<Seen>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let plan = Arc::new(Mutex::new(acts.iter().copied().collect::<VecDeque<_>>()));
    let seen = Arc::new(Seen::default());
    let counts = seen.clone();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            counts.connections.fetch_add(1, Ordering::SeqCst);
            let (plan, seen) = (plan.clone(), counts.clone());
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(socket).await else {
                    return;
                };
                while let Some(Ok((req, respond))) = conn.accept().await {
                    let act = plan
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .pop_front()
                        .unwrap_or(Act::Answer);
                    if !matches!(act, Act::GoAway) {
                        // Each stream in a task of its own: the accept loop is what drives the
                        // connection, so it must go on while a stream's body is read.
                        tokio::spawn(handle(act, req, respond, seen.clone()));
                        continue;
                    }
                    // GOAWAY once the request's head has arrived: it may be processed.
                    drop((req, respond));
                    seen.processed.fetch_add(1, Ordering::SeqCst);
                    conn.abrupt_shutdown(h2::Reason::INTERNAL_ERROR);
                    // Drive the GOAWAY out, then drop the connection.
                    let _ = tokio::time::timeout(
                        Duration::from_millis(200),
                        std::future::poll_fn(|cx| conn.poll_closed(cx)),
                    )
                    .await;
                    return;
                }
            });
        }
    });
    (addr, seen)
}

/// One stream: its body read whole, as a handler would, then `act`.
async fn handle(
    act: Act,
    req: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
    seen: Arc<Seen>,
) {
    let mut body = req.into_body();
    while let Some(chunk) = body.data().await {
        if let Ok(chunk) = chunk {
            let _ = body.flow_control().release_capacity(chunk.len());
        }
    }
    match act {
        Act::Refuse => respond.send_reset(h2::Reason::REFUSED_STREAM),
        Act::Answer => {
            seen.processed.fetch_add(1, Ordering::SeqCst);
            let resp = http::Response::builder()
                .status(201)
                .body(())
                .expect("response");
            if let Ok(mut stream) = respond.send_response(resp, false) {
                let _ = stream.send_data(Bytes::from_static(b"{\"posted\":true}"), true);
            }
        }
        Act::Stall => {
            seen.processed.fetch_add(1, Ordering::SeqCst);
            let reset = std::future::poll_fn(|cx| respond.poll_reset(cx)).await;
            if reset.is_ok() {
                seen.resets.fetch_add(1, Ordering::SeqCst);
            }
        }
        Act::GoAway => {}
    }
}

async fn proxy_for(env: &Env, addr: SocketAddr, timeout: &str) -> harness::TestProxy {
    let yaml = format!(
        "listen: 127.0.0.1:0
{store}upstreams:
  ledger:
    url: http://{addr}
    protocol: h2c
    connect_timeout: 200ms
    timeout: {timeout}
routes:
  - name: pay
    methods: [POST]
    path: /pay
    upstream: ledger
    idempotency: {{}}
",
        store = env.store_yaml(""),
    );
    env.proxy(&yaml).await
}

async fn pay(proxy: &harness::TestProxy, key: &str) -> harness::Reply {
    send(
        client()
            .post(proxy.url("/pay"))
            .header("idempotency-key", key)
            .body("{\"amount\":2400}"),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_stream_is_sent_again_on_a_fresh_connection_and_runs_once() {
    let env = Env::new(Backend::Memory).await;
    let (addr, seen) = upstream(&[Act::Refuse, Act::Answer]).await;
    let proxy = proxy_for(&env, addr, "2s").await;
    let first = pay(&proxy, "k-1").await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    assert_eq!(seen.processed.load(Ordering::SeqCst), 1, "processed once");
    assert_eq!(
        seen.connections.load(Ordering::SeqCst),
        2,
        "the second on a fresh connection"
    );
    let again = pay(&proxy, "k-1").await;
    assert_eq!(again.header("idempotent-replayed"), "true");
    assert_eq!(again.body, first.body);
    assert_eq!(seen.processed.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_unanswered_at_the_deadline_is_reset() {
    let env = Env::new(Backend::Memory).await;
    let (addr, seen) = upstream(&[Act::Stall]).await;
    let proxy = proxy_for(&env, addr, "300ms").await;
    let first = pay(&proxy, "k-2").await;
    first.assert_problem(504, "upstream-timeout");
    assert!(
        harness::eventually(Duration::from_secs(2), || seen
            .resets
            .load(Ordering::SeqCst)
            == 1)
        .await,
        "the upstream saw its stream reset"
    );
    // Kept (the default): the repeat gets the saved 504, nothing is sent again.
    let again = pay(&proxy, "k-2").await;
    assert_eq!(again.status, 504);
    assert_eq!(again.header("idempotent-replayed"), "true");
    assert_eq!(seen.processed.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_goaway_with_an_error_after_the_request_is_an_unknown_outcome() {
    let env = Env::new(Backend::Memory).await;
    let (addr, seen) = upstream(&[Act::GoAway]).await;
    let proxy = proxy_for(&env, addr, "2s").await;
    let first = pay(&proxy, "k-3").await;
    assert_eq!(first.status, 502, "{:?}", first.body);
    let again = pay(&proxy, "k-3").await;
    assert_eq!(again.status, 502);
    assert_eq!(
        again.header("idempotent-replayed"),
        "true",
        "kept, never sent twice"
    );
    assert_eq!(seen.processed.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_goaway_after_a_call_is_unknown_and_kept_as_a_grpc_status() {
    let env = Env::new(Backend::Memory).await;
    let (addr, seen) = upstream(&[Act::GoAway]).await;
    let yaml = format!(
        "listen: 127.0.0.1:0
{store}upstreams:
  ledger:
    url: http://{addr}
    protocol: h2c
    connect_timeout: 200ms
    timeout: 2s
routes:
  - name: transfer
    path: /ledger.v1.Ledger/Transfer
    upstream: ledger
    grpc: {{}}
",
        store = env.store_yaml(""),
    );
    let proxy = env.proxy(&yaml).await;
    let call = || async {
        send(
            client()
                .post(proxy.url("/ledger.v1.Ledger/Transfer"))
                .header("content-type", "application/grpc")
                .header("idempotency-key", "k-goaway")
                .body(Bytes::from_static(b"\0\0\0\0\x02\x0a\0")),
        )
        .await
    };
    let first = call().await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    assert_eq!(first.header("grpc-status"), "2", "UNKNOWN");
    assert_eq!(
        first.header("idemproxy-problem-type"),
        "urn:idemproxy:problem:upstream-failed"
    );
    // Kept (the default): the repeat gets the same status, nothing is sent again.
    let again = call().await;
    assert_eq!(again.header("grpc-status"), "2");
    assert_eq!(again.header("idempotent-replayed"), "true");
    assert_eq!(seen.processed.load(Ordering::SeqCst), 1);
}
