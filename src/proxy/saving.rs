//! What a save retried in the background writes: the whole result, or the small
//! `result-not-kept` record the pending-save bounds downgrade it to (see [`super::pending`]).

use http::StatusCode;
use sha2::{Digest, Sha256};

use crate::grpc;
use crate::problem::Problem;
use crate::record::{Finished, Record, Saved};

/// A finished record a background save is writing: the whole result, or, once the
/// pending-save bounds downgraded it, the small `result-not-kept` record that stands in for it.
pub(super) struct Saving {
    pub done: Finished,
    /// The SHA-256 of the whole result's encoding, once downgraded: an attempt made before,
    /// whose answer was lost, may have written it, and then the record is ours.
    whole_digest: Option<[u8; 32]>,
}

impl Saving {
    pub(crate) fn whole(done: Finished) -> Saving {
        Saving {
            done,
            whole_digest: None,
        }
    }

    pub(crate) fn is_downgraded(&self) -> bool {
        self.whole_digest.is_some()
    }

    /// Lets go of the result, keeping the record that says it was not kept. The status the
    /// first client got goes into the record: it tells the caller the operation ran. On a gRPC
    /// route (`grpc`) the record is that answer as a gRPC status, as every answer of the proxy's
    /// own to a call is (SPEC §4.11).
    pub(crate) fn downgrade(&mut self, grpc: bool) {
        let problem = Problem::ResultNotKept {
            status: self.status(),
        };
        let saved = if grpc {
            grpc::saved(&problem)
        } else {
            problem.saved()
        };
        let small = Finished::new(*self.done.record().fingerprint(), Saved::Response(saved));
        self.whole_digest = Some(Sha256::digest(self.done.encoded()).into());
        self.done = small;
    }

    /// Whether `current`, read back from the store, is what this save (or an earlier attempt
    /// of it) wrote.
    pub(crate) fn wrote(&self, current: &Record) -> bool {
        current == self.done.record()
            || self
                .whole_digest
                .is_some_and(|d| <[u8; 32]>::from(Sha256::digest(current.encode())) == d)
    }

    pub(crate) fn status(&self) -> StatusCode {
        match self.done.record() {
            Record::Finished {
                saved: Saved::Response(r),
                ..
            } => r.status,
            Record::Finished {
                saved: Saved::NotReplayable { status },
                ..
            } => *status,
            Record::Finished {
                saved: Saved::Resolved(r) | Saved::Trailed { response: r, .. },
                ..
            } => r.status,
            Record::InFlight { .. } | Record::Resolvable(_) => StatusCode::BAD_GATEWAY,
        }
    }
}
