//! The proxy's request path, in this process against a real mock upstream and a real store:
//! each module checks one part of it, most rules on every store (`harness::every_store!`:
//! `cargo test --test proxy -- claim::sqlite::` runs one module on one store).
//!
//! - [`admission`] — what a request must be to be admitted — keys, headers and bodies, hostile
//!   input over raw TCP, framing, limits, routes.
//! - [`claim`] — keys, scopes, store keys, conflicts (409, 422) and duplicates.
//! - [`lease`] — renewal, fencing and expiry of a claim.
//! - [`replay`] — what is saved, and its replay byte for byte.
//! - [`upstream`] — forwarding, and every way an upstream call ends.
//! - [`store_errors`] — the answers when the store fails.
//! - [`observe`] — `mode: observe`.
//! - [`key_from`] — keys derived from the request.
//! - [`resolve`] — `on_unknown_outcome: resolve`: a lost response resolved by the upstream's
//!   lookup.
//! - [`webhooks`] — webhook routes: signatures verified, deliveries and redeliveries once.

mod admission;
mod claim;
mod key_from;
mod lease;
mod observe;
mod replay;
mod resolve;
mod store_errors;
mod support;
mod upstream;
mod webhooks;
