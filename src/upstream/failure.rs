//! What a failed upstream call says, for people and for the flow: the client's own body
//! failing on its way told from the upstream's failure, and an error's causes joined once.

use super::UpstreamError;
use super::pool::SendError;
use crate::body;

/// A failed connection: the client's body failing on its way, or the upstream's failure.
pub(super) fn failed(e: &SendError) -> UpstreamError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if let Some(client) = s.downcast_ref::<body::ClientBodyError>() {
            return UpstreamError::ClientBody {
                detail: client.detail(),
                timed_out: client.timed_out,
            };
        }
        source = s.source();
    }
    UpstreamError::Failed(error_chain(e))
}

/// An error with its sources, joined: hyper's top-level messages alone ("client error
/// (Connect)") do not say what happened.
///
/// A cause is said once: hyper's and h2's errors often repeat their source's words in their
/// own (`connection error: connection error: …`), so a source whose text the chain already
/// holds is left out.
pub(crate) fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !text.is_empty() && !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}
