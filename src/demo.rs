//! `idemproxy demo`: the mock booking service and the proxy in front of it, in one process;
//! the configuration it runs and the curl lines it prints.
//!
//! A module of the binary, not of the library: the demo serves the mock, and the product
//! library never depends on the mock crate.

use std::net::SocketAddr;
use std::process::ExitCode;

use idemproxy::config::Config;
use idemproxy_mock::MockUpstream;

/// The `mock-upstream` binary's serving code, the one place that puts the mock on a socket.
#[path = "bin/mock-upstream/serve.rs"]
mod mock_upstream;

/// Serves the mock booking service on `upstream_listen` and the proxy in front of it on
/// `listen`, until a stop signal.
pub(crate) async fn run(listen: SocketAddr, upstream_listen: SocketAddr) -> ExitCode {
    let up = match idemproxy::server::bind(upstream_listen) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(%upstream_listen, error = %e, "cannot start the mock booking service (pass --upstream-listen)");
            return ExitCode::FAILURE;
        }
    };
    let proxy = match idemproxy::server::bind(listen) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(%listen, error = %e, "cannot listen (pass --listen)");
            return ExitCode::FAILURE;
        }
    };
    let (Ok(up_addr), Ok(addr)) = (up.local_addr(), proxy.local_addr()) else {
        return ExitCode::FAILURE;
    };
    let yaml = demo_config(addr, up_addr);
    let config = match Config::from_yaml(&yaml) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "the demo configuration is invalid");
            return ExitCode::FAILURE;
        }
    };
    let (stop_mock, mock_stopped) = tokio::sync::oneshot::channel::<()>();
    let mock = tokio::spawn(mock_upstream::serve(up, MockUpstream::new(), async move {
        let _ = mock_stopped.await;
    }));
    say!("{}", demo_instructions(addr, up_addr));
    let result = idemproxy::run(
        proxy,
        config,
        idemproxy::reload::ReloadSource::none(),
        crate::stop_signal(),
    )
    .await;
    let _ = stop_mock.send(());
    let _ = mock.await;
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "idemproxy stopped");
            ExitCode::FAILURE
        }
    }
}

/// The demo's configuration: the embedded store, `POST /bookings` idempotent, everything else
/// passed through to the mock booking service.
fn demo_config(listen: SocketAddr, upstream: SocketAddr) -> String {
    format!(
        r#"listen: {listen}
store:
  backend: memory
upstreams:
  booking:
    url: http://{upstream}
routes:
  - name: create-booking
    methods: [POST]
    path: /bookings
    upstream: booking
    idempotency:
      lock_ttl: 10s
  - name: everything-else
    path: /*
    upstream: booking
"#
    )
}

/// What the demo prints: where things listen and the curl lines to try.
fn demo_instructions(listen: SocketAddr, upstream: SocketAddr) -> String {
    let p = format!("http://{listen}");
    format!(
        r#"
idemproxy demo: the proxy on {p} (embedded store), in front of the mock booking service on http://{upstream}.
Try these in another terminal:

# 1. Forward: the first request with a key creates a booking (201, a new bk_ id).
curl -i -X POST {p}/bookings -H 'Idempotency-Key: demo-1' -H 'Content-Type: application/json' -d '{{"seat":"12A"}}'

# 2. Replay: the same request again gets the same response byte for byte, plus Idempotent-Replayed: true.
#    No second booking is made.
curl -i -X POST {p}/bookings -H 'Idempotency-Key: demo-1' -H 'Content-Type: application/json' -d '{{"seat":"12A"}}'

# 3. 409: a slow first request (the mock waits 5s) and a repeat while it is still running.
curl -s -o /dev/null -X POST {p}/bookings -H 'Idempotency-Key: demo-2' -H 'X-Mock-Delay: 5s' -d '{{"seat":"14C"}}' &
sleep 1; curl -i -X POST {p}/bookings -H 'Idempotency-Key: demo-2' -d '{{"seat":"14C"}}'

# 4. 422: the same key reused for a different request.
curl -i -X POST {p}/bookings -H 'Idempotency-Key: demo-1' -H 'Content-Type: application/json' -d '{{"seat":"99Z"}}'

# How many bookings the mock really made (two: demo-1 and demo-2):
curl -s {p}/_mock/stats; echo

Ctrl-C stops both.
"#
    )
}
