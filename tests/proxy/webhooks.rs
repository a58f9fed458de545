//! SPEC §4.9: webhook routes end to end, through the proxy to the mock's webhook handler (which
//! counts the deliveries it handles per event id), on every store (`harness::every_store!`:
//! `cargo test --test proxy -- webhooks::flow::sqlite::` runs one store).
//!
//! - [`support`] — a Standard Webhooks sender: the secrets, the signing, the route.
//! - [`flow`] — delivery and redelivery, forgeries, bad signatures, rotation, failures,
//!   conflicts and a burst of duplicates.
//! - [`providers`] — each provider's deliveries as it sends them: keys bound to what it
//!   signed, Svix's own names, a redelivery whose body changed.
//! - [`paths`] — nothing reaches a handler unverified: every spelling of a webhook path, a
//!   delivery refused before its body is read, a `Connection` header naming a signed one.

mod flow;
mod paths;
mod providers;
mod support;
