//! `idemproxy demo`: the mock booking service and the proxy in front of it, in one process;
//! the configuration it runs and the curl lines it prints.
//!
//! A module of the binary, not of the library: the demo serves the mock, and the product
//! library never depends on the mock crate.

use std::net::SocketAddr;
use std::process::ExitCode;

use idemproxy::config::{Config, Secret};
use idemproxy_mock::MockUpstream;

/// The demo's admin token, printed with the lines to try: the demo listens on loopback
/// addresses by default and keeps nothing worth protecting.
const DEMO_TOKEN: &str = "demo-token";

/// The demo webhook route's Standard Webhooks secret, printed with the lines to try, and the
/// key it stands for in hex (what `openssl dgst -mac HMAC -macopt hexkey:` takes).
const DEMO_WEBHOOK_SECRET: &str = "whsec_aWRlbXByb3h5IGRlbW8gd2ViaG9vayBrZXkh";
const DEMO_WEBHOOK_KEY_HEX: &str = "6964656d70726f78792064656d6f20776562686f6f6b206b657921";

/// The `mock-upstream` binary's serving code, the one place that puts the mock on a socket.
#[path = "bin/mock-upstream/serve.rs"]
mod mock_upstream;

/// Serves the mock booking service on `upstream_listen` and the proxy in front of it on
/// `listen`, with its admin listener on `admin_listen`, until a stop signal.
pub(crate) async fn run(
    listen: SocketAddr,
    upstream_listen: SocketAddr,
    admin_listen: SocketAddr,
) -> ExitCode {
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
    // Tried here, so that a port in use is reported with the flag that moves it; the proxy
    // binds it again (with port 0, the port found here) as it binds every admin listener.
    let admin = match std::net::TcpListener::bind(admin_listen).and_then(|l| l.local_addr()) {
        Ok(a) => a,
        Err(e) => {
            tracing::error!(%admin_listen, error = %e, "cannot start the admin listener (pass --admin-listen)");
            return ExitCode::FAILURE;
        }
    };
    let (Ok(up_addr), Ok(addr)) = (up.local_addr(), proxy.local_addr()) else {
        return ExitCode::FAILURE;
    };
    // The webhook route reads its secret from a file when the configuration is read, once:
    // the demo rereads no configuration, so the file goes as soon as it is read.
    let secret_file = std::env::temp_dir().join(format!(
        "idemproxy-demo-{}.webhook-secret",
        std::process::id()
    ));
    if let Err(e) = std::fs::write(&secret_file, DEMO_WEBHOOK_SECRET) {
        tracing::error!(error = %e, file = %secret_file.display(), "cannot write the demo's webhook secret");
        return ExitCode::FAILURE;
    }
    let yaml = demo_config(addr, up_addr, admin, &secret_file.display().to_string());
    let parsed = Config::from_yaml(&yaml);
    let _ = std::fs::remove_file(&secret_file);
    let mut config = match parsed {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "the demo configuration is invalid");
            return ExitCode::FAILURE;
        }
    };
    // Set here rather than through admin_token_file or admin_token_env: the demo needs no
    // file or variable of its own, and it rereads no configuration (SIGHUP is ignored).
    config.admin_token = Some(Secret::new(DEMO_TOKEN));
    let (stop_mock, mock_stopped) = tokio::sync::oneshot::channel::<()>();
    let mock = tokio::spawn(mock_upstream::serve(up, MockUpstream::new(), async move {
        let _ = mock_stopped.await;
    }));
    say!("{}", demo_instructions(addr, up_addr, admin, &own_path()));
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

/// The demo's configuration: the embedded store, `POST /bookings` idempotent, a Standard
/// Webhooks route (its secret in `webhook_secrets`), an MCP route whose tool calls are claimed
/// by the key in their `_meta`, the mock ledger's gRPC `Transfer` over HTTP/2 claimed by its
/// `idempotency-key` metadata, everything else passed through to the mock booking service, and
/// the admin listener.
fn demo_config(
    listen: SocketAddr,
    upstream: SocketAddr,
    admin: SocketAddr,
    webhook_secrets: &str,
) -> String {
    format!(
        r#"listen: {listen}
admin_listen: {admin}
store:
  backend: memory
upstreams:
  booking:
    url: http://{upstream}
  booking-fast:
    url: http://{upstream}
    connect_timeout: 500ms
    timeout: 2s
  ledger:
    url: http://{upstream}
    protocol: h2c
routes:
  - name: create-booking
    methods: [POST]
    path: /bookings
    upstream: booking
    idempotency:
      lock_ttl: 10s
  - name: reserve
    methods: [POST]
    path: /reservations
    upstream: booking-fast
    idempotency:
      on_unknown_outcome: resolve
      resolve:
        request: GET /bookings/by-reference/{{json:/reference}}
        settle_after: 5s
        interval: 500ms
        give_up_after: 1m
  - name: webhook-events
    methods: [POST]
    path: /webhooks/standard
    upstream: booking
    webhook:
      provider: standard
      secrets_file: {webhook_secrets}
  - name: mcp-tools
    path: /mcp
    upstream: booking
    jsonrpc:
      methods: [tools/call]
    idempotency:
      key_from: ["json:/params/_meta/idempotency-key"]
  - name: ledger-transfer
    path: /ledger.v1.Ledger/Transfer
    upstream: ledger
    grpc: {{}}
    idempotency: {{}}
  - name: everything-else
    path: /*
    upstream: booking
"#
    )
}

/// This binary as the user can run it from where they are: `./target/release/idemproxy` after
/// `cargo run --release -- demo` in the repository, else its absolute path.
fn own_path() -> String {
    let Ok(exe) = std::env::current_exe() else {
        return "idemproxy".to_owned();
    };
    match std::env::current_dir()
        .ok()
        .and_then(|here| exe.strip_prefix(here).ok().map(|p| p.to_path_buf()))
    {
        Some(relative) => format!("./{}", relative.display()),
        None => exe.display().to_string(),
    }
}

/// What the demo prints: where things listen and the lines to try (README's quick start shows
/// them as printed on the default ports).
fn demo_instructions(
    listen: SocketAddr,
    upstream: SocketAddr,
    admin: SocketAddr,
    exe: &str,
) -> String {
    let p = format!("http://{listen}");
    let a = format!("http://{admin}");
    format!(
        r#"
idemproxy demo: the proxy on {p} (embedded store), in front of the mock booking service on http://{upstream};
its admin listener on {a} (admin token: {DEMO_TOKEN}).
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

# How many bookings the mock really made (two: demo-1 and demo-2; wait lets demo-2's 5s end first):
wait; curl -s {p}/_mock/stats; echo

# 5. The admin listener: health, the request counters, and the record of demo-1 through the key tooling.
curl -s {a}/healthz
curl -s {a}/metrics | grep '^idemproxy_requests_total{{route="create-booking"' | grep -v ' 0$'
{exe} health --admin {a} && echo healthy
IDEMPROXY_ADMIN_TOKEN={DEMO_TOKEN} {exe} keys show --admin {a} --route create-booking --key demo-1

# 6. Resolve: a reservation whose response is lost after the booking was made (the mock drops the connection).
#    The client gets 502 at once; the proxy asks the booking service by reference, and the retry gets the real
#    booking (200, Idempotent-Resolved: true). The stats show one booking for trip-42.
curl -i -X POST {p}/reservations -H 'Idempotency-Key: demo-3' -H 'Content-Type: application/json' -H 'X-Mock-Lose-Response: after' -d '{{"seat":"15D","reference":"trip-42"}}'
sleep 1; curl -i -X POST {p}/reservations -H 'Idempotency-Key: demo-3' -H 'Content-Type: application/json' -d '{{"seat":"15D","reference":"trip-42"}}'
curl -s {p}/_mock/stats; echo

# 7. A webhook: a Standard Webhooks delivery signed now with the demo's secret ({DEMO_WEBHOOK_SECRET}), sent twice.
#    The handler runs once ("deliveries":1); the second gets its answer replayed (Idempotent-Replayed: true).
ts=$(date +%s); body='{{"type":"booking.paid","booking":"bk_1"}}'; sig=$(printf '%s' "evt_demo_1.$ts.$body" | openssl dgst -sha256 -mac HMAC -macopt hexkey:{DEMO_WEBHOOK_KEY_HEX} -binary | base64)
for i in 1 2; do curl -i -X POST {p}/webhooks/standard -H 'webhook-id: evt_demo_1' -H "webhook-timestamp: $ts" -H "webhook-signature: v1,$sig" -H 'Content-Type: application/json' -d "$body"; echo; done

# 8. An MCP tool call (JSON-RPC): the key in _meta, sent again as an agent retries it, as a new call with another id.
#    One booking; the second answer is the first result around its own id ("id":2), with Idempotent-Replayed: true.
curl -i -X POST {p}/mcp -H 'Content-Type: application/json' -H 'Accept: application/json, text/event-stream' -d '{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"book","arguments":{{"seat":"7C"}},"_meta":{{"idempotency-key":"agent-run-1"}}}}}}'
curl -i -X POST {p}/mcp -H 'Content-Type: application/json' -H 'Accept: application/json, text/event-stream' -d '{{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{{"name":"book","arguments":{{"seat":"7C"}},"_meta":{{"idempotency-key":"agent-run-1"}}}}}}'

# 9. A gRPC call over HTTP/2, the key in its idempotency-key metadata, sent twice by a small gRPC client of the mock's.
#    One posting; the second gets the first answer, trailers and all ("idempotent-replayed: true").
cargo run -q --bin mock-upstream -- grpc-transfer --url {p} --key demo-g1 --reference r-g1
cargo run -q --bin mock-upstream -- grpc-transfer --url {p} --key demo-g1 --reference r-g1

Ctrl-C stops both.
"#
    )
}
