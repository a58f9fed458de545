//! idemproxy: a reverse proxy that gives HTTP routes exactly-once effect.
//!
//! A client sends an operation with an `Idempotency-Key`; idemproxy claims the key atomically in
//! a store, forwards only the first request upstream, saves its response, and replays it for
//! every repeat. The README and `docs/` are the user's reference; comments that cite "SPEC §n"
//! name the section of the product contract a rule comes from.
//!
//! # Layout
//! One line a module, in the order a request meets them; `tests/project/layout.rs` keeps the list whole.
//! - [`server`]: [`run`] and the workers — listeners, accept loops, connection deadlines, TLS,
//!   the drain — and which store each worker opens.
//! - [`proxy`]: the per-request flow — match, admission, exchange, lease, settle, replay,
//!   observe — over the configuration in force, which a reload swaps whole.
//! - [`admin`]: what the admin listener answers — health, readiness, metrics, key tooling.
//! - [`webhook`]: a webhook delivery's signature checked and its event id read (SPEC §4.9).
//! - [`jsonrpc`]: a JSON-RPC call read, the response to it found, the proxy's answers as
//!   JSON-RPC errors (SPEC §4.10).
//! - [`grpc`]: a gRPC call recognised, its response's status read, the proxy's answers as gRPC
//!   statuses (SPEC §4.11).
//! - [`problem`]: every answer the proxy makes itself, as problem+json, from one kind table.
//! - [`upstream`]: pooled clients, header rewriting, deadlines, failure classification.
//! - [`store`]: the `Store` trait and its four backends (memory, SQLite, PostgreSQL, Redis).
//! - [`record`]: what the store keeps under a key, and its versioned encoding.
//! - [`key`]: the key header parsed, and namespaced into a fixed-size store key.
//! - [`key_from`]: keys derived from what a request means (`key_from`).
//! - [`fingerprint`]: what makes two requests "the same".
//! - [`body`]: the body type that flows through all of it.
//! - [`route`]: compiled routes — path patterns, upstream, idempotency or webhook policy.
//! - [`config`]: the YAML file, one module a section, validated and compiled into routes.
//! - [`metrics`]: the Prometheus series, by route, upstream and store operation; each store adds
//!   its own when it is opened.
//! - [`traces`]: OpenTelemetry spans — each request's, its store operations', its upstream
//!   call's — and their bounded export over OTLP/HTTP.
//! - [`tls`]: certificates and keys read at load, the listener's and each upstream's roots.
//! - [`reload`]: what triggers a reload (SIGHUP rereads the file).
//! - [`pid_file`]: where the process id is written, for `idemproxy reload` to signal.
//! - [`shutdown`]: stop signals.
//!
//! The bundled mock booking service (demo, tests, benches) is a crate of its own
//! (`idemproxy-mock`, in `mock/`): the library never depends on it.

#![warn(clippy::too_many_lines)]

pub mod admin;
pub mod body;
pub mod config;
pub mod fingerprint;
pub mod grpc;
pub mod jsonrpc;
pub mod key;
pub mod key_from;
pub mod metrics;
pub mod pid_file;
pub mod problem;
pub mod proxy;
pub mod record;
pub mod reload;
pub mod route;
pub mod server;
pub mod shutdown;
pub mod store;
pub mod tls;
pub mod traces;
pub mod upstream;
pub mod webhook;

pub use server::run;
