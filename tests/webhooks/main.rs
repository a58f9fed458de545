//! SPEC §4.9: webhook routes end to end, through the proxy to the mock's webhook handler (which
//! counts the deliveries it handles per event id), on every store (`harness::every_store!`:
//! `cargo test --test webhooks -- flow::sqlite::` runs one store).
//!
//! - [`support`] — a Standard Webhooks sender: the secrets, the signing, the route.
//! - [`flow`] — delivery and redelivery, forgeries, bad signatures, rotation, failures,
//!   conflicts and a burst of duplicates.

mod flow;
mod support;
