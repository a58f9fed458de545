//! `idemproxy demo`: the configuration it runs and the curl lines it prints.

use std::net::SocketAddr;

/// The demo's configuration: the embedded store, `POST /bookings` idempotent, everything else
/// passed through to the mock booking service.
pub fn demo_config(listen: SocketAddr, upstream: SocketAddr) -> String {
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
pub fn demo_instructions(listen: SocketAddr, upstream: SocketAddr) -> String {
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
