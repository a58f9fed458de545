//! The server around the proxy: its listeners, TLS, the admin listener, workers, reloading and
//! shutting down — in this process or as the `idemproxy` binary.
//!
//! - [`listener`] — idle deadlines, connection bounds, accept errors, slow clients, head limits
//!   on both protocols, `drain_delay`.
//! - [`tls`] — TLS to upstreams and on the proxy's own listener.
//! - [`admin`] — `/healthz`, `/readyz`, `/metrics` and the key tooling.
//! - [`workers`] — `workers: N`.
//! - [`reload`] — reloading the configuration while serving.
//! - [`shutdown`] — SIGTERM and a second stop signal.

mod admin;
mod listener;
mod reload;
mod shutdown;
mod tls;
mod workers;
