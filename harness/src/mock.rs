//! The mock booking service ([`idemproxy_mock`]) served in this process on the product's
//! Listener, for tests that count the upstream's side effects: [`start`] and its
//! [`MockHandle`]. [`serve`] is the `mock-upstream` binary's own serving code (one file, compiled
//! here too), for a test that needs the mock on a socket it bound itself.

use std::io;
use std::net::SocketAddr;

use idemproxy_mock::{MockStats, MockUpstream, RecordedRequest};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

#[path = "../../src/bin/mock-upstream/serve.rs"]
mod serving;

/// Serves the mock on `listener` until `shutdown` resolves, then lets requests in flight finish
/// for a few seconds at most: the `mock-upstream` binary's own serving code.
pub async fn serve(
    listener: TcpListener,
    state: MockUpstream,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    serving::serve(listener, state, shutdown).await
}

/// Binds `127.0.0.1:0`, serves a fresh [`MockUpstream`] there on the current Tokio runtime and
/// returns its handle.
pub async fn start() -> io::Result<MockHandle> {
    let listener = TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0)).await?;
    let addr = listener.local_addr()?;
    let state = MockUpstream::new();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(serve(listener, state.clone(), async move {
        // Resolves on an explicit stop and when the handle is dropped.
        let _ = stopped.await;
    }));
    Ok(MockHandle {
        addr,
        state,
        stop: Some(stop),
        task: Some(task),
    })
}

/// A running mock started by [`start`]: its address and its counters. Stops the server when
/// dropped (requests in flight get a few seconds to finish).
pub struct MockHandle {
    addr: SocketAddr,
    state: MockUpstream,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<io::Result<()>>>,
}

impl MockHandle {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The base URL, e.g. `http://127.0.0.1:40123` (no trailing slash).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The shared state, to hand to code that wants a [`MockUpstream`].
    pub fn state(&self) -> &MockUpstream {
        &self.state
    }

    /// See [`MockUpstream::calls`].
    pub fn calls(&self, key: &str) -> u64 {
        self.state.calls(key)
    }

    /// See [`MockUpstream::total`].
    pub fn total(&self) -> u64 {
        self.state.total()
    }

    /// See [`MockUpstream::bookings`].
    pub fn bookings(&self) -> u64 {
        self.state.bookings()
    }

    /// See [`MockUpstream::stats`].
    pub fn stats(&self) -> MockStats {
        self.state.stats()
    }

    /// See [`MockUpstream::last_request`].
    pub fn last_request(&self) -> Option<RecordedRequest> {
        self.state.last_request()
    }

    /// See [`MockUpstream::reset`].
    pub fn reset(&self) {
        self.state.reset();
    }

    /// Stops the server and waits until it has stopped.
    pub async fn shutdown(mut self) -> io::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.task.take() {
            Some(task) => task.await.map_err(io::Error::other)?,
            None => Ok(()),
        }
    }
}

impl Drop for MockHandle {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

impl std::fmt::Debug for MockHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MockHandle")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}
