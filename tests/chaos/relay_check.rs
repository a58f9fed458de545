//! The fault relay's own check: every switch the lanes use does what it says.

use super::*;

/// Every switch of the fault relay does what it says, on a TCP echo server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_switches_take_effect() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    let echo = TcpListener::bind("127.0.0.1:0").await.expect("bind echo");
    let target = echo.local_addr().expect("echo addr");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = echo.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    let relay = Relay::start(target).await;
    let read_timeout = Duration::from_millis(400);
    async fn roundtrip(c: &mut TcpStream, msg: &[u8]) -> Vec<u8> {
        c.write_all(msg).await.expect("write");
        let mut buf = vec![0u8; msg.len()];
        c.read_exact(&mut buf).await.expect("read the echo");
        buf
    }
    fn is_reset<T: std::fmt::Debug>(r: &std::io::Result<T>) -> bool {
        matches!(r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset)
    }

    // Pass.
    let mut c = TcpStream::connect(relay.addr()).await.expect("connect");
    assert_eq!(roundtrip(&mut c, b"hello").await, b"hello");

    // Latency, per direction.
    relay.set_latency(Duration::from_millis(150), Duration::from_millis(100));
    let started = Instant::now();
    assert_eq!(roundtrip(&mut c, b"slow").await, b"slow");
    assert!(started.elapsed() >= Duration::from_millis(250), "latency");
    relay.set_latency(Duration::ZERO, Duration::ZERO);

    // Blackhole: nothing comes back; its end resets the connection.
    relay.blackhole();
    c.write_all(b"lost")
        .await
        .expect("write into the blackhole");
    let mut buf = [0u8; 16];
    assert!(
        tokio::time::timeout(read_timeout, c.read(&mut buf))
            .await
            .is_err(),
        "a blackhole forwards nothing"
    );
    let mut during = TcpStream::connect(relay.addr())
        .await
        .expect("a blackhole accepts");
    during.write_all(b"x").await.expect("write");
    // Accepted by the kernel is not yet accepted by the relay.
    let accepted =
        harness::eventually(Duration::from_secs(2), || relay.stats().accepted == 2).await;
    assert!(accepted, "the relay accepts during a blackhole");
    relay.pass();
    let r = tokio::time::timeout(read_timeout, c.read(&mut buf))
        .await
        .expect("the reset arrives");
    assert!(is_reset(&r), "the blackhole's end resets: {r:?}");
    let r = tokio::time::timeout(read_timeout, during.read(&mut buf))
        .await
        .expect("the reset arrives");
    assert!(is_reset(&r), "…connections made during it too: {r:?}");

    // Reset everything open now.
    let mut c = TcpStream::connect(relay.addr()).await.expect("connect");
    assert_eq!(roundtrip(&mut c, b"again").await, b"again");
    relay.reset_all();
    let r = tokio::time::timeout(read_timeout, c.read(&mut buf))
        .await
        .expect("the reset arrives");
    assert!(is_reset(&r), "reset_all: {r:?}");

    // Refuse: new connections are reset at once.
    relay.refuse();
    // The reset may come before the connect call returns.
    match TcpStream::connect(relay.addr()).await {
        Ok(mut c) => {
            let r = tokio::time::timeout(read_timeout, c.read(&mut buf))
                .await
                .expect("the reset arrives");
            assert!(is_reset(&r), "refuse: {r:?}");
        }
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "refuse"),
    }
    relay.pass();

    // Cut after N bytes up: exactly N reach the target, then both sides are reset.
    let before = relay.stats();
    relay.cut_after(Direction::Up, Some(4));
    let mut c = TcpStream::connect(relay.addr()).await.expect("connect");
    c.write_all(b"abcdefgh").await.expect("write");
    let mut got = Vec::new();
    let r = tokio::time::timeout(read_timeout, c.read_to_end(&mut got))
        .await
        .expect("the cut arrives");
    assert!(is_reset(&r), "cut: {r:?}");
    assert_eq!(
        relay.stats().bytes_up - before.bytes_up,
        4,
        "N bytes went up"
    );
    relay.cut_after(Direction::Up, None);

    let stats = relay.stats();
    assert_eq!(stats.accepted, 5, "{stats:?}");
    assert!(stats.resets >= 5, "{stats:?}");
    assert!(stats.dropped >= 5, "{stats:?}");

    // Dropped: open connections close, the port closes.
    let mut open = TcpStream::connect(relay.addr()).await.expect("connect");
    assert_eq!(roundtrip(&mut open, b"last").await, b"last");
    let addr = relay.addr();
    drop(relay);
    let r = tokio::time::timeout(read_timeout, open.read(&mut buf))
        .await
        .expect("the relay's end closes the connection");
    assert!(matches!(r, Ok(0)), "closed in order: {r:?}");
    let closed = harness::eventually(Duration::from_secs(2), || {
        std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(50)).is_err()
    })
    .await;
    assert!(closed, "the relay still accepts after drop");
}
