//! SPEC §4.10: JSON-RPC routes end to end — the official Rust MCP SDK's Streamable HTTP server
//! behind the proxy, and the SDK's own client calling it — on every store
//! (`harness::every_store!`: `cargo test --test jsonrpc -- calls::sqlite::` runs one store).
//!
//! - [`support`] — the MCP server (a `book` tool that counts its executions by reference), the
//!   client, the route.
//! - [`calls`] — retries with new ids replayed with their own, mismatches, conflicts,
//!   pass-through traffic, streams, releases, refusals.
//! - [`storm`] — two proxies on one Redis or PostgreSQL under a storm of retried calls.

mod calls;
mod storm;
mod support;
