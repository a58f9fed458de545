//! SPEC §4.8, "When the request was sent": no byte of a request is written once the upstream's
//! `timeout` has passed since an instant taken before its claim, and `settle_after` counts from
//! the claim plus that `timeout`. A holder that stalls after its claim and wakes after the key
//! was taken over, resolved absent and booked by a retry writes nothing; a body still being
//! written to a slow reader when `timeout` runs out is cut off with a reset, never delivered
//! after a final `absent`. And a lookup value that would name another resource is refused
//! before anything is claimed.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use harness::{Backend, Env, TestProxy, book_with};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::{booking, bookings_for, resolving, retry_until_settled};

/// The stalled holder's timings: a 1s lease, a 2s upstream `timeout`, `settle_after` 1s. The
/// holder stalls 5s after its claim: its lease lapses at 1s, the takeover's `absent` is final
/// at 3s (claim + timeout + settle_after), and a retry books; the holder wakes at 5s.
fn stalling(env: &Env) -> String {
    resolving(
        env,
        "settle_after: 1s\ninterval: 200ms\ngive_up_after: 30s",
        "lock_ttl: 1s\n",
    )
    .replacen("    timeout: 5s\n", "    timeout: 2s\n", 1)
}

/// A holder stalled between its claim and its first write (the test pause point) while
/// `taker` takes its claim over, finds the booking absent for good and releases the key, and a
/// retry books: the holder wakes past its deadline, writes nothing, and answers as for a
/// request never sent. One booking.
async fn a_stalled_holder_writes_nothing_after_a_takeover(
    env: &Env,
    holder: &TestProxy,
    taker: &TestProxy,
    key: &str,
    reference: &str,
) {
    idemproxy::proxy::pause::arm_after_claim(key, Duration::from_secs(5));
    let body = booking(reference);
    let stalled = {
        let (url, key, body) = (holder.url(""), key.to_owned(), body.clone());
        tokio::spawn(async move { book_with(&url, &key, &body, &[]).await })
    };
    // Past the holder's lease: the repeat takes the claim over and resolves it.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let retried = retry_until_settled(taker, key, &body).await;
    assert_eq!(
        retried.status, 201,
        "released after a final absent, the retry books: {:?}",
        retried.body
    );
    assert_eq!(bookings_for(env, reference), 1);
    let woke = stalled.await.expect("the stalled request");
    woke.assert_problem(502, "upstream-unavailable");
    assert_eq!(
        bookings_for(env, reference),
        1,
        "the holder that woke past its deadline wrote nothing"
    );
    // The retry's result stands: the late holder released nothing it no longer held.
    let replay = book_with(&taker.url(""), key, &body, &[]).await;
    assert_eq!(replay.status, 201);
    assert_eq!(replay.header("idempotent-replayed"), "true");
}

pub(super) async fn a_holder_stalled_past_its_deadline_writes_nothing(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&stalling(&env)).await;
    let key = format!("k-stalled-{}", backend.name());
    a_stalled_holder_writes_nothing_after_a_takeover(&env, &proxy, &proxy, &key, "R-stalled").await;
    proxy.stop().await;
}

/// Two instances on one shared store: the holder on one stalls, the other takes over.
pub(super) async fn two_instances_a_stalled_holder_writes_nothing(backend: Backend) {
    let env = Env::new(backend).await;
    let yaml = stalling(&env);
    let (a, b) = (env.proxy(&yaml).await, env.proxy(&yaml).await);
    let key = format!("k-stalled-two-{}", backend.name());
    a_stalled_holder_writes_nothing_after_a_takeover(&env, &a, &b, &key, "R-stalled-two").await;
    a.stop().await;
    b.stop().await;
}

/// An upstream that books `POST /bookings` only once it has read the whole body — the first
/// request's body at about 1 MB/s, later ones at once — and answers the lookup
/// `GET /bookings/by-reference/{X-Ref}` with 200 once booked, 404 before.
struct SlowReader {
    url: String,
    booked: Arc<AtomicU64>,
    /// Body bytes the upstream read of requests it never finished reading.
    cut_off: Arc<AtomicU64>,
    /// The first (slow) request has ended: booked, or cut off.
    first_ended: Arc<AtomicBool>,
}

impl SlowReader {
    async fn start() -> SlowReader {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        let booked = Arc::new(AtomicU64::new(0));
        let cut_off = Arc::new(AtomicU64::new(0));
        let slow = Arc::new(AtomicBool::new(true));
        let first_ended = Arc::new(AtomicBool::new(false));
        let state = (booked.clone(), cut_off.clone(), slow, first_ended.clone());
        tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                let state = state.clone();
                tokio::spawn(async move {
                    let (booked, cut_off, slow, first_ended) = state;
                    if serve(conn, &booked, &cut_off, &slow).await {
                        first_ended.store(true, Ordering::SeqCst);
                    }
                });
            }
        });
        SlowReader {
            url,
            booked,
            cut_off,
            first_ended,
        }
    }
}

/// One request a connection (`Connection: close`). True when it was the slow one.
async fn serve(
    conn: TcpStream,
    booked: &AtomicU64,
    cut_off: &AtomicU64,
    slow: &AtomicBool,
) -> bool {
    let mut slowly = false;
    let _ = serve_one(conn, booked, cut_off, slow, &mut slowly).await;
    slowly
}

async fn serve_one(
    mut conn: TcpStream,
    booked: &AtomicU64,
    cut_off: &AtomicU64,
    slow: &AtomicBool,
    slowly: &mut bool,
) -> std::io::Result<()> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if conn.read(&mut byte).await? == 0 {
            return Ok(());
        }
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
    let length: u64 = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    let answer = |status: &str| {
        format!("HTTP/1.1 {status}\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{{}}")
    };
    if head.starts_with("get ") {
        let status = if booked.load(Ordering::SeqCst) > 0 {
            "200 OK"
        } else {
            "404 Not Found"
        };
        return conn.write_all(answer(status).as_bytes()).await;
    }
    *slowly = slow.swap(false, Ordering::SeqCst);
    let mut read = 0u64;
    let mut chunk = vec![0u8; 64 * 1024];
    while read < length {
        match conn.read(&mut chunk).await {
            Ok(0) | Err(_) => {
                cut_off.fetch_add(read, Ordering::SeqCst);
                return Ok(());
            }
            Ok(n) => read += n as u64,
        }
        if *slowly {
            // About 1 MB/s.
            tokio::time::sleep(Duration::from_millis(60)).await;
        }
    }
    booked.fetch_add(1, Ordering::SeqCst);
    conn.write_all(answer("201 Created").as_bytes()).await
}

/// A 10 MB body to an upstream that reads 1 MB/s, under a 3s `timeout` and a 1s
/// `settle_after`: the proxy stops writing at its deadline and resets the connection, so the
/// upstream never gets the whole body; the lookup's `absent` is final only after the claim
/// plus `timeout` plus `settle_after`, and the retry books once.
pub(super) async fn a_body_cut_off_at_the_deadline_is_never_booked_after_a_final_absent(
    backend: Backend,
) {
    let env = Env::new(backend).await;
    let upstream = SlowReader::start().await;
    let yaml = resolving(
        &env,
        "settle_after: 1s\ninterval: 200ms\ngive_up_after: 30s",
        "max_request_body: 16MiB\n",
    )
    .replacen("{json:/reference}", "{header:X-Ref}", 1)
    .replacen(&env.mock.url(), &upstream.url, 1)
    .replacen("    timeout: 5s\n", "    timeout: 3s\n", 1);
    let proxy = env.proxy(&yaml).await;
    let body = vec![b'x'; 10 * 1024 * 1024];
    let post = || {
        harness::client()
            .post(proxy.url("/bookings"))
            .header("Idempotency-Key", "k-slow")
            .header("X-Ref", "R-slow")
            .header("Content-Type", "application/octet-stream")
            .body(body.clone())
    };
    let first = harness::send(post()).await;
    assert!(
        first.status == 504 || first.status == 502,
        "the outcome is unknown: {} {:?}",
        first.status,
        first.body
    );
    let until = std::time::Instant::now() + Duration::from_secs(20);
    let retried = loop {
        let reply = harness::send(post()).await;
        if reply.status != 409 || std::time::Instant::now() >= until {
            break reply;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(retried.status, 201, "{:?}", retried.body);
    // Whatever of the first body was queued in a socket buffer has reached the upstream by
    // the time it has read it all or seen the connection end.
    assert!(
        harness::eventually(Duration::from_secs(20), || upstream
            .first_ended
            .load(Ordering::SeqCst))
        .await,
        "the first request ended"
    );
    assert_eq!(
        upstream.booked.load(Ordering::SeqCst),
        1,
        "one booking: the first body was cut off at the deadline"
    );
    assert!(
        upstream.cut_off.load(Ordering::SeqCst) < 10 * 1024 * 1024,
        "the first body never arrived whole"
    );
    proxy.stop().await;
}

/// A lookup value that is a dot segment or holds a `/` would name another resource in the
/// lookup's path: refused before the claim, and the same key then runs with a readable one.
pub(super) async fn a_lookup_value_naming_another_resource_is_refused_before_the_claim(
    backend: Backend,
) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&resolving(&env, "settle_after: 5s", "")).await;
    // JSON strings: `a\\b` is a backslash between a and b.
    for (i, reference) in ["..", ".", "a/b", r"a\\b", ""].into_iter().enumerate() {
        let key = format!("k-dots-{i}");
        let refused = book_with(&proxy.url(""), &key, &booking(reference), &[]).await;
        let doc = refused.assert_problem(400, "unreadable-key-part");
        assert!(
            doc["detail"]
                .as_str()
                .is_some_and(|d| d.contains("json:/reference")),
            "{reference:?}: the detail names the part: {doc}"
        );
        assert_eq!(env.mock.calls(&key), 0, "{reference:?}: nothing forwarded");
        // Nothing claimed: the same key with a readable value runs.
        let ran = book_with(&proxy.url(""), &key, &booking(&format!("R-dots-{i}")), &[]).await;
        assert_eq!(ran.status, 201, "{reference:?}: {:?}", ran.body);
    }
    proxy.stop().await;
}
