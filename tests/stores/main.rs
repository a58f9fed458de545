//! The stores against real servers of the tests' own: the contract every store keeps, then what
//! each backend adds.
//!
//! - [`contract`] — the store contract, each check on every store.
//! - [`faults`] — reconnecting after a restart or a dropped connection, replies lost after a
//!   release or a large save, large records staged on their way in.
//! - [`redis`] — TLS and passwords, scripts Redis forgot.
//! - [`wait_replicas`] — `store.wait_replicas`.
//! - [`cluster`] — `redis-cluster`, slot moves and failover.
//! - [`postgres`] — the PostgreSQL store.
//! - [`sqlite`] — the SQLite store.
//! - [`resolvable`] — the claim of a `resolve` route: takeover, lifetime, fencing.
//! - [`renewals`] — what renewing such a claim writes, whatever its lookup's size.

mod cluster;
mod contract;
mod faults;
mod pg_versions;
mod postgres;
mod redis;
mod renewals;
mod resolvable;
mod sqlite;
mod wait_replicas;
