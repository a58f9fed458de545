//! A fault relay: a TCP relay on a loopback port in front of a target address, whose behaviour
//! a test switches at run time — pass normally, add latency per direction, blackhole, reset
//! connections (a real TCP RST), cut connections after N bytes. Put it between the proxy and
//! Redis, or between the proxy and the upstream.
//!
//! | switch | what the peers see |
//! | --- | --- |
//! | [`Relay::set_latency`] | every chunk reaches the other side that much later, in order (per direction) |
//! | [`Relay::blackhole`] | connections are accepted and read, nothing is forwarded either way, new ones don't reach the target; when it ends ([`Relay::pass`]) every connection open during it is reset, because its byte streams lost bytes |
//! | [`Relay::reset_all`] | every open connection gets a TCP RST on both sides (`SO_LINGER 0`, then close) |
//! | [`Relay::refuse`] | every open connection is reset, and so is every new one, at once, until [`Relay::pass`] |
//! | [`Relay::cut_after`] | a connection is reset once it has forwarded N bytes in that direction (counted from its start; the first N are delivered) |
//! | [`Relay::pass`] | normal relaying (ends a blackhole or refusal; latency and cuts are separate switches) |
//!
//! A connection that fails on one side (a reset, an error) is reset on the other: the relay is
//! a wire, not a peer that would answer. An orderly close (FIN) is passed on as one, after the
//! bytes before it.
//!
//! [`Relay::stats`] counts connections and bytes; a [`Tap`] sees every byte the moment it has
//! been forwarded (for example, to parse and timestamp the HTTP requests an upstream received).
//! Dropping the relay stops it and closes every connection it holds.
//!
//! ```
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! use idemproxy_harness::relay::Relay;
//! let upstream = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
//! let relay = Relay::start(upstream.local_addr().unwrap()).await;
//! // point the proxy at relay.addr() instead of the server, then:
//! relay.blackhole();
//! relay.pass(); // every connection that lived through the blackhole is reset
//! # });
//! ```

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// A direction of traffic through the relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// From the connecting client (e.g. the proxy) to the target.
    Up,
    /// From the target back to the client.
    Down,
}

/// What the relay does with connections and bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Relays normally.
    Pass,
    /// Reads and forwards nothing; new connections never reach the target.
    Blackhole,
    /// Resets every connection, new ones at once.
    Refuse,
}

/// Sees every chunk of bytes once it has been written to the other side.
pub trait Tap: Send + Sync + 'static {
    /// `bytes` were forwarded on connection `conn` (numbered from 1 in accept order).
    fn forwarded(&self, conn: u64, dir: Direction, bytes: &[u8]);
    /// Connection `conn` is gone.
    fn closed(&self, _conn: u64) {}
}

/// A snapshot of the relay's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelayStats {
    /// Connections accepted since start.
    pub accepted: u64,
    /// Connections open now.
    pub open: u64,
    /// Bytes forwarded client → target.
    pub bytes_up: u64,
    /// Bytes forwarded target → client.
    pub bytes_down: u64,
    /// Bytes read and thrown away (blackhole, cut).
    pub dropped: u64,
    /// Connections the relay reset (both sides count once).
    pub resets: u64,
}

/// The switches, shared with every connection through a `watch` channel.
#[derive(Debug, Clone, Copy)]
struct Control {
    mode: Mode,
    latency_up: Duration,
    latency_down: Duration,
    cut_up: Option<u64>,
    cut_down: Option<u64>,
    /// Bumped to reset every open connection.
    reset_generation: u64,
}

#[derive(Default)]
struct Counters {
    accepted: AtomicU64,
    open: AtomicU64,
    bytes_up: AtomicU64,
    bytes_down: AtomicU64,
    dropped: AtomicU64,
    resets: AtomicU64,
}

struct Shared {
    target: SocketAddr,
    counters: Counters,
    tap: Option<Arc<dyn Tap>>,
}

/// A running relay. Cheap to share behind an `Arc`; every switch takes `&self`.
pub struct Relay {
    addr: SocketAddr,
    target: SocketAddr,
    control: watch::Sender<Control>,
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
}

impl Relay {
    /// Starts a relay on `127.0.0.1:0` in front of `target`, passing normally.
    pub async fn start(target: SocketAddr) -> Relay {
        Relay::start_inner(target, None).await
    }

    /// [`Relay::start`], with a tap that sees every forwarded byte.
    pub async fn start_with_tap(target: SocketAddr, tap: Arc<dyn Tap>) -> Relay {
        Relay::start_inner(target, Some(tap)).await
    }

    async fn start_inner(target: SocketAddr, tap: Option<Arc<dyn Tap>>) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the relay");
        let addr = listener.local_addr().expect("relay address");
        let (control, _) = watch::channel(Control {
            mode: Mode::Pass,
            latency_up: Duration::ZERO,
            latency_down: Duration::ZERO,
            cut_up: None,
            cut_down: None,
            reset_generation: 0,
        });
        let shared = Arc::new(Shared {
            target,
            counters: Counters::default(),
            tap,
        });
        let accept = {
            let control = control.clone();
            let shared = shared.clone();
            tokio::spawn(async move {
                let mut next_id = 0u64;
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    };
                    next_id += 1;
                    shared.counters.accepted.fetch_add(1, Ordering::Relaxed);
                    // Subscribed here, in accept order, so a switch made after the accept
                    // reaches this connection.
                    let mut rx = control.subscribe();
                    let start = *rx.borrow_and_update();
                    let conn = Connection {
                        id: next_id,
                        shared: shared.clone(),
                    };
                    tokio::spawn(conn.run(client, rx, start));
                }
            })
        };
        Relay {
            addr,
            target,
            control,
            shared,
            accept,
        }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// What the relay forwards to.
    pub fn target(&self) -> SocketAddr {
        self.target
    }

    /// The counters now.
    pub fn stats(&self) -> RelayStats {
        let c = &self.shared.counters;
        RelayStats {
            accepted: c.accepted.load(Ordering::Relaxed),
            open: c.open.load(Ordering::Relaxed),
            bytes_up: c.bytes_up.load(Ordering::Relaxed),
            bytes_down: c.bytes_down.load(Ordering::Relaxed),
            dropped: c.dropped.load(Ordering::Relaxed),
            resets: c.resets.load(Ordering::Relaxed),
        }
    }

    /// The current mode.
    pub fn mode(&self) -> Mode {
        self.control.borrow().mode
    }

    /// Delays every chunk by `up` (client → target) and `down` (target → client), from now on.
    pub fn set_latency(&self, up: Duration, down: Duration) {
        self.control.send_modify(|c| {
            c.latency_up = up;
            c.latency_down = down;
        });
    }

    /// Resets a connection once it has forwarded `n` bytes in `dir` (`None`: never).
    pub fn cut_after(&self, dir: Direction, n: Option<u64>) {
        self.control.send_modify(|c| match dir {
            Direction::Up => c.cut_up = n,
            Direction::Down => c.cut_down = n,
        });
    }

    /// Stops forwarding anything, on open and new connections, until [`Relay::pass`].
    pub fn blackhole(&self) {
        self.control.send_modify(|c| c.mode = Mode::Blackhole);
    }

    /// Resets every open connection now, and every new one until [`Relay::pass`].
    pub fn refuse(&self) {
        self.control.send_modify(|c| {
            c.mode = Mode::Refuse;
            c.reset_generation += 1;
        });
    }

    /// Resets every open connection now; new ones relay as the mode says.
    pub fn reset_all(&self) {
        self.control.send_modify(|c| c.reset_generation += 1);
    }

    /// Relays normally again. Ending a blackhole resets every connection that was open during
    /// it: bytes were thrown away in the middle of its streams, so nothing sane can follow.
    pub fn pass(&self) {
        self.control.send_modify(|c| {
            if c.mode == Mode::Blackhole {
                c.reset_generation += 1;
            }
            c.mode = Mode::Pass;
        });
    }

    /// Back to a plain relay: passing, no latency, no cuts (open connections are kept, unless
    /// a blackhole ends).
    pub fn heal(&self) {
        self.pass();
        self.control.send_modify(|c| {
            c.latency_up = Duration::ZERO;
            c.latency_down = Duration::ZERO;
            c.cut_up = None;
            c.cut_down = None;
        });
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        // The accept loop stops; connection tasks see the control channel close and end,
        // closing their sockets.
        self.accept.abort();
    }
}

/// How a connection ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// Both directions closed in order.
    Closed,
    /// Reset on purpose, or a side failed: reset both sides.
    Reset,
    /// The relay was dropped.
    Stopped,
}

struct Connection {
    id: u64,
    shared: Arc<Shared>,
}

impl Connection {
    /// Serves one accepted connection; `start` is the switches as they were at the accept.
    async fn run(
        self,
        mut client: TcpStream,
        mut control: watch::Receiver<Control>,
        start: Control,
    ) {
        let counters = &self.shared.counters;
        counters.open.fetch_add(1, Ordering::Relaxed);
        let _ = client.set_nodelay(true);
        let end = match start.mode {
            Mode::Refuse => {
                reset(&client);
                End::Reset
            }
            Mode::Blackhole => {
                // Never reaches the target: read and forget until the blackhole ends (then
                // reset) or the client goes away.
                let end = self
                    .swallow(&mut client, &mut control, start.reset_generation)
                    .await;
                if end == End::Reset {
                    reset(&client);
                }
                end
            }
            Mode::Pass => match self.connect().await {
                Some(mut server) => {
                    let end = self
                        .relay(&mut client, &mut server, control, start.reset_generation)
                        .await;
                    if end == End::Reset {
                        reset(&client);
                        reset(&server);
                    }
                    end
                }
                None => {
                    // The target is down: the client sees its connection reset.
                    reset(&client);
                    End::Reset
                }
            },
        };
        if end == End::Reset {
            counters.resets.fetch_add(1, Ordering::Relaxed);
        }
        counters.open.fetch_sub(1, Ordering::Relaxed);
        if let Some(tap) = &self.shared.tap {
            tap.closed(self.id);
        }
    }

    async fn connect(&self) -> Option<TcpStream> {
        let connect = TcpStream::connect(self.shared.target);
        match tokio::time::timeout(Duration::from_secs(2), connect).await {
            Ok(Ok(s)) => {
                let _ = s.set_nodelay(true);
                Some(s)
            }
            _ => None,
        }
    }

    /// A connection accepted during a blackhole.
    async fn swallow(
        &self,
        client: &mut TcpStream,
        control: &mut watch::Receiver<Control>,
        generation: u64,
    ) -> End {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            tokio::select! {
                r = client.read(&mut buf) => match r {
                    Ok(0) => return End::Closed,
                    Err(_) => return End::Reset,
                    Ok(n) => {
                        self.shared.counters.dropped.fetch_add(n as u64, Ordering::Relaxed);
                    }
                },
                changed = control.changed() => {
                    if changed.is_err() {
                        return End::Stopped;
                    }
                    if control.borrow_and_update().reset_generation != generation {
                        return End::Reset;
                    }
                }
            }
        }
    }

    /// Relays both directions until both close in order, one fails, or a reset is asked for.
    async fn relay(
        &self,
        client: &mut TcpStream,
        server: &mut TcpStream,
        mut control: watch::Receiver<Control>,
        generation: u64,
    ) -> End {
        // A reset asked for since the accept (while connecting) counts too.
        if control.borrow_and_update().reset_generation != generation {
            return End::Reset;
        }
        let (client_read, client_write) = client.split();
        let (server_read, server_write) = server.split();
        let ok = |clean: bool| if clean { Ok(()) } else { Err(()) };
        let up = self.pump(client_read, server_write, Direction::Up, control.clone());
        let down = self.pump(server_read, client_write, Direction::Down, control.clone());
        let up = async { ok(up.await) };
        let down = async { ok(down.await) };
        // A failure either way resets at once; an orderly close waits for the other side.
        let both = async {
            match tokio::try_join!(up, down) {
                Ok(_) => End::Closed,
                Err(()) => End::Reset,
            }
        };
        let asked = async {
            loop {
                if control.changed().await.is_err() {
                    return End::Stopped;
                }
                if control.borrow_and_update().reset_generation != generation {
                    return End::Reset;
                }
            }
        };
        tokio::select! {
            end = both => end,
            end = asked => end,
        }
    }

    /// One direction: a reader that stamps each chunk with its due time, and a writer that
    /// delivers chunks in order when due. `true`: ended in order (EOF passed on as a FIN);
    /// `false`: the connection must be reset (an error, a cut, the other side failing).
    async fn pump(
        &self,
        mut from: ReadHalf<'_>,
        mut to: WriteHalf<'_>,
        dir: Direction,
        control: watch::Receiver<Control>,
    ) -> bool {
        // `None` is the end of the stream.
        let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Option<Vec<u8>>)>();
        let counters = &self.shared.counters;
        let reader = {
            let control = control.clone();
            async move {
                let mut buf = vec![0u8; 16 * 1024];
                loop {
                    let n = match from.read(&mut buf).await {
                        Ok(0) => {
                            let _ = tx.send((Instant::now(), None));
                            return true;
                        }
                        Ok(n) => n,
                        Err(_) => return false,
                    };
                    let c = *control.borrow();
                    if c.mode != Mode::Pass {
                        counters.dropped.fetch_add(n as u64, Ordering::Relaxed);
                        continue;
                    }
                    let latency = match dir {
                        Direction::Up => c.latency_up,
                        Direction::Down => c.latency_down,
                    };
                    if tx
                        .send((Instant::now() + latency, Some(buf[..n].to_vec())))
                        .is_err()
                    {
                        return false;
                    }
                }
            }
        };
        let writer = async move {
            let mut sent = 0u64;
            while let Some((due, chunk)) = rx.recv().await {
                tokio::time::sleep_until(due).await;
                let Some(chunk) = chunk else {
                    // Pass the orderly close on.
                    let _ = to.shutdown().await;
                    return true;
                };
                let c = *control.borrow();
                if c.mode != Mode::Pass {
                    counters
                        .dropped
                        .fetch_add(chunk.len() as u64, Ordering::Relaxed);
                    continue;
                }
                let cut = match dir {
                    Direction::Up => c.cut_up,
                    Direction::Down => c.cut_down,
                };
                let (deliver, cut_here) = match cut {
                    Some(limit) if sent + chunk.len() as u64 >= limit => {
                        let keep = usize::try_from(limit.saturating_sub(sent)).unwrap_or(0);
                        (&chunk[..keep.min(chunk.len())], true)
                    }
                    _ => (&chunk[..], false),
                };
                if !deliver.is_empty() {
                    if to.write_all(deliver).await.is_err() {
                        return false;
                    }
                    sent += deliver.len() as u64;
                    let counter = match dir {
                        Direction::Up => &counters.bytes_up,
                        Direction::Down => &counters.bytes_down,
                    };
                    counter.fetch_add(deliver.len() as u64, Ordering::Relaxed);
                    if let Some(tap) = &self.shared.tap {
                        tap.forwarded(self.id, dir, deliver);
                    }
                }
                if cut_here {
                    counters
                        .dropped
                        .fetch_add((chunk.len() - deliver.len()) as u64, Ordering::Relaxed);
                    return false;
                }
            }
            // The reader failed and dropped its sender.
            false
        };
        // Either side failing ends the direction; a clean reader end still lets the writer
        // drain what is due.
        let reader = async {
            let clean = reader.await;
            if clean {
                // Keep the writer running until it has delivered the FIN.
                std::future::pending::<()>().await;
            }
            clean
        };
        tokio::select! {
            clean = reader => clean,
            clean = writer => clean,
        }
    }
}

/// Closes a socket with a TCP RST instead of a FIN: `SO_LINGER` 0, then the caller drops it.
fn reset(stream: &TcpStream) {
    let _ = stream.set_zero_linger();
}
