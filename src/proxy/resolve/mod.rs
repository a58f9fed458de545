//! Resolving an unknown outcome (`on_unknown_outcome: resolve`, SPEC §4.8): the route's lookup,
//! rendered from the request before anything is claimed, and asked of the upstream when the
//! request's outcome is unknown.
//!
//! - [`ask`]: the lookup a request renders ([`Lookup`]) and one asking of it, its answer
//!   classified as found, absent, another answer, or failed.
//! - [`clock`]: a resolvable record's times, on the store's clock, read on this host's.
//! - [`resolver`]: the task that holds a key whose outcome is unknown and asks until an
//!   answer settles it.

pub(super) mod ask;
mod clock;
mod resolver;

pub(crate) use ask::{Lookup, render as render_lookup};
pub(super) use clock::StoreClock;
pub(super) use resolver::{Unknown, take_over};
