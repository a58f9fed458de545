//! What the last lookup of a resolution that gave up answered: the `outcome-unknown` detail
//! says it, so that an operator is sent where the answer points — the route's `found` and
//! `absent` lists for a status in neither, the network for a lookup that got no answer.

use http::StatusCode;

/// The last lookup a resolution sent before `give_up_after`, as [`super::Problem::OutcomeUnknown`]
/// says it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LastLookup {
    /// None was sent: the key was taken over past `give_up_after`, or nothing said how to ask.
    None,
    /// A status in neither `found` nor `absent` (the lists the resolution read answers by).
    Other {
        status: u16,
        found: Vec<u16>,
        absent: Vec<u16>,
    },
    /// An `absent` status to a lookup sent before `settle_after` had passed: "not yet".
    EarlyAbsent { status: u16 },
    /// No answer: the lookup failed (a refused or reset connection) or timed out.
    Failed,
}

impl LastLookup {
    /// The detail of an `outcome-unknown` saved after asking `upstream`, whose first request
    /// got `status`.
    pub(super) fn detail(&self, upstream: &str, status: StatusCode) -> String {
        format!(
            "No complete response came from upstream {upstream} (the first request got status {}), and asking it whether it performed the operation did not settle it by give_up_after: {}. It may have happened. The operation will not be run again with this key: check with the upstream before retrying with a new one.",
            status.as_u16(),
            self.said()
        )
    }

    /// What asking answered, and where to look.
    fn said(&self) -> String {
        match self {
            LastLookup::None => {
                "no lookup was sent before give_up_after passed (the key was taken over after that)"
                    .into()
            }
            LastLookup::Other {
                status,
                found,
                absent,
            } => format!(
                "the last lookup answered status {status}, which is in neither the route's resolve.found {} nor its resolve.absent {} (if {status} says whether the operation happened, add it to one of them)",
                list(found),
                list(absent)
            ),
            LastLookup::EarlyAbsent { status } => format!(
                "the last lookup answered status {status}, a resolve.absent status, but was sent before settle_after had passed, when it only means \"not yet\""
            ),
            LastLookup::Failed => {
                "the last lookup got no answer (its connection failed or it timed out)".into()
            }
        }
    }
}

fn list(statuses: &[u16]) -> String {
    let each: Vec<String> = statuses.iter().map(u16::to_string).collect();
    format!("[{}]", each.join(", "))
}
