//! Binding the main listener's sockets: one for worker 0, then one more a worker on the same
//! port (`SO_REUSEPORT`), without ever sharing a port another process listens on.

use tokio::net::TcpListener;

/// Pending connections the listener queues (the kernel caps it at `net.core.somaxconn`):
/// a burst of a thousand clients retrying at once must not be refused at the door.
const LISTEN_BACKLOG: u32 = 4096;

/// Binds the main listener with a deep accept queue, `SO_REUSEADDR` (a restart does not wait
/// for the old process's connections to leave TIME_WAIT) and `SO_REUSEPORT`, so that every
/// worker binds a socket of its own to the same address ([`bind_shared`]).
///
/// `SO_REUSEPORT` would also let *another* process of the same user bind the port and take a
/// share of its connections — a second proxy started by mistake, with a memory store of its
/// own, would run a key's duplicates once each. So a fixed port is first bound plainly, as
/// only a free port can be: a port that anything listens on is refused (`AddrInUse`), as it
/// was before the workers shared it.
pub fn bind(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    if addr.port() != 0 {
        let probe = new_socket(addr)?;
        probe.set_reuseaddr(true)?;
        probe.bind(addr)?;
    }
    bind_shared(addr)
}

/// Binds one more socket to `addr` — an address [`bind`] has bound, its port resolved — for a
/// worker's accept loop: the kernel spreads new connections across the sockets of the port.
pub(crate) fn bind_shared(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let socket = new_socket(addr)?;
    socket.set_reuseaddr(true)?;
    #[cfg(all(unix, not(target_os = "solaris"), not(target_os = "illumos")))]
    socket.set_reuseport(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

fn new_socket(addr: std::net::SocketAddr) -> std::io::Result<tokio::net::TcpSocket> {
    if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()
    } else {
        tokio::net::TcpSocket::new_v6()
    }
}
