//! idemproxy: a reverse proxy that gives HTTP routes exactly-once effect.
//!
//! A client sends an operation with an `Idempotency-Key`; idemproxy claims the key atomically in
//! a store, forwards only the first request upstream, saves its response, and replays it for
//! every repeat. The README and `docs/` are the user's reference; comments that cite "SPEC §n"
//! name the section of the product contract a rule comes from.
//!
//! # Layout
//! - [`config`]: the YAML file, one file a section (`limits`, `store`, `upstream`, `routes`,
//!   with `units`, `secret` and the YAML pass `load`) — serde structs with defaults, then
//!   validation and compilation; reads only `route` and `tls`.
//! - [`route`]: compiled routes — path patterns (exact, `{param}`, trailing `/*`) and each
//!   route's upstream and idempotency policy; a webhook route's provider, secrets and tolerance.
//! - [`key`]: parsing the key header; namespacing it into a hashed, fixed-size store key.
//! - [`key_from`]: keys derived from what the request means (`key_from`), canonical values.
//! - [`fingerprint`]: what makes two requests "the same".
//! - [`record`]: what the store keeps under a key, and its versioned encoding.
//! - [`store`]: the `Store` trait (claim, renew, complete, release, get) and its backends
//!   ([`store::memory`], [`store::redis`]), all calls under a deadline.
//! - [`proxy`]: the configuration in force (`generation`, swapped whole by `reload`) and the
//!   per-request flow — match (`matched`: a route built once per configuration), then
//!   admission (key, body, fingerprint), the exchange (claim, forward, decide), the lease
//!   (renew, complete, release), pending saves, replay, `detach`, `observe` (a route
//!   that forwards everything and counts what enforce would have done); and
//!   [`proxy::RouteKeys`], the store key of a record as the key tooling names it.
//! - [`upstream`]: connection pools, header rewriting, timeouts, failure classification.
//! - [`webhook`]: a webhook delivery's signature checked and its event id read (SPEC §4.9),
//!   before anything is claimed; reached from the proxy, it imports no store, upstream or proxy.
//! - [`problem`]: every answer the proxy (and its admin listener) makes itself, as
//!   problem+json, in one place.
//! - [`admin`]: what the admin listener answers — health, readiness, metrics, key tooling
//!   (served by [`server::serve_admin`]).
//! - [`metrics`]: counters and histograms, registered once per route, upstream and store op.
//! - [`reload`]: what triggers a reload (SIGHUP rereads the file); what a reload changes is
//!   [`proxy::Proxy::reload`]'s. [`pid_file`]: where the process id is written, and how
//!   `idemproxy reload` finds the process by it and signals it.
//! - [`server`]: wiring and graceful shutdown ([`server::run`] is what `main` calls);
//!   [`server::workers`], a current-thread runtime, thread and accept loop a worker (what each
//!   has of its own, what they share, and what stays single on worker 0), and `stores`, which
//!   store each worker uses; all on [`server::listener`], the one listener type the proxy,
//!   admin and mock share: `accept` (backoff), `connection` (TLS handshake, deadlines),
//!   `activity` and `io` (idle and send timeouts), `handler` (what a listener serves).
//! - [`tls`]: certificates and keys read at load — the listener's, and each upstream's roots.
//! - [`shutdown`]: stop signals.
//! - [`body`]: the body type that flows through all of it.
//!
//! The bundled mock booking service (demo, tests, benches) is a crate of its own
//! (`idemproxy-mock`, in `mock/`): the library never depends on it.

pub mod admin;
pub mod body;
pub mod config;
pub mod fingerprint;
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
pub mod upstream;
pub mod webhook;

pub use server::run;
