//! SPEC §4.11: gRPC through the proxy to a real gRPC service (the harness's ledger, served by
//! tonic) on an `h2c` upstream, called by tonic clients.
//!
//! - [`answers`] — the proxy's own answers on a `grpc:` route as gRPC statuses: refusals, a
//!   head over the limits, an unreachable upstream, a timeout kept, a store down, a result not
//!   replayable or not kept.
//! - [`passthrough`] — HTTP/2 to the upstream: unary and streaming calls carried as they are,
//!   trailers relayed, `te: trailers` forwarded.
//! - [`calls`] — unary calls on a `grpc:` route, every store: a lost answer retried, hedged
//!   copies, a mismatch, a released status, the replay byte for byte, the proxy's statuses.
//! - [`h2`] — sent or not on HTTP/2: a refused stream sent again, a stream reset at the
//!   deadline, a `GOAWAY` after the request an unknown outcome.

mod answers;
mod calls;
mod h2;
mod passthrough;
