//! The mock booking service ([`idemproxy_mock`]) served on the product's one
//! [`Listener`]: the only place that puts the mock on a socket.
//!
//! The mock crate answers requests and knows no socket: it cannot depend on idemproxy, since
//! idemproxy's binaries depend on it (Cargo refuses a package cycle). And the product library
//! must not depend on the mock. So this file belongs to the binary side: it is a module of the
//! `mock-upstream` binary, and the `idemproxy` binary (for `idemproxy demo`) and the test
//! harness (`harness/src/mock.rs`) compile the same file with `#[path]`.

use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use idemproxy::server::listener::{Handler, Listener, ListenerLimits, Peer};
use idemproxy_mock::{MockBody, MockError, MockUpstream};
use tokio::net::TcpListener;

/// How long `serve` lets requests in flight finish after its shutdown future resolves. A mock
/// must not hang a test run (or a Ctrl-C) on a request that asked for a one-hour delay.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Serves the mock on `listener` until `shutdown` resolves, then stops accepting, lets requests
/// in flight finish (for a few seconds at most) and returns.
///
/// Each connection speaks HTTP/1.1 or, with prior knowledge, HTTP/2. Accept errors (for example
/// running out of file descriptors) are logged and retried, never fatal.
pub(crate) async fn serve(
    listener: TcpListener,
    state: MockUpstream,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let drain = Listener::new(listener, "mock upstream", LIMITS)
        .run(Service(state), shutdown)
        .await;
    if !drain.close_within(SHUTDOWN_GRACE).await {
        tracing::warn!("mock upstream: requests still in flight after the grace period");
    }
    Ok(())
}

/// The mock's limits are generous: tests park requests on it for seconds (`X-Mock-Delay`) and
/// the proxy keeps pooled connections to it. Its header limits are hyper's defaults (100
/// headers), which the proxy's own limits are measured against.
const LIMITS: ListenerLimits = ListenerLimits {
    max_connections: 10_000,
    header_read_timeout: Duration::from_secs(300),
    send_timeout: Duration::from_secs(300),
    max_headers: 100,
    max_head_bytes: 8192 + 4096 * 100,
};

/// The mock as a listener's handler.
struct Service(MockUpstream);

impl Handler for Service {
    type Body = MockBody;
    type Error = MockError;

    async fn call(
        self: Arc<Self>,
        request: Request<Incoming>,
        peer: Peer,
    ) -> Result<Response<MockBody>, MockError> {
        let answer = self.0.handle(request).await;
        if let Err(MockError::Reset) = answer {
            // Nothing more is written, not even a FIN, and the socket closes with a TCP reset.
            peer.reset();
        }
        answer
    }
}
