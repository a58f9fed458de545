//! The stores against real servers of the tests' own: each backend's module runs the store
//! contract (`harness::store_checks`, through `harness::store_contract!`, as its `contract`
//! module: `cargo test --test stores -- sqlite::contract::` runs it on one store), then what
//! that backend adds.
//!
//! - [`memory`] — the memory store: the contract, also on Tokio's paused clock.
//! - [`sqlite`] — the SQLite store; the contract, also on its clock moved ahead.
//! - [`postgres`] — the PostgreSQL store.
//! - [`pg_versions`] — PostgreSQL schema versions, the lease the operations guide's query reads.
//! - [`redis`] — TLS and passwords, scripts Redis forgot.
//! - [`wait_replicas`] — `store.wait_replicas`.
//! - [`cluster`] — `redis-cluster`, slot moves and failover.
//! - [`faults`] — reconnecting after a restart or a dropped connection, replies lost after a
//!   release or a large save, large records staged on their way in.
//! - [`renewals`] — what renewing a resolvable claim writes, whatever its lookup's size.

mod cluster;
mod faults;
mod memory;
mod pg_versions;
mod postgres;
mod redis;
mod renewals;
mod sqlite;
mod wait_replicas;
