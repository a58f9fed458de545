//! The admin listener's own refusals: a path it does not serve, and the key tooling's answers
//! that are not a record, from the same kind table and document as every other problem.

use std::time::Duration;

use http::{Response, StatusCode};

use super::{Kind, content_type, document, respond};
use crate::body::Body;
use crate::store::StoreError;

/// A refusal of the admin listener: a path it does not serve, and the key tooling's (`/keys`)
/// answers that are not a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum AdminProblem {
    /// No admin endpoint has this path (404).
    NoEndpoint,
    /// No admin token is configured, so the key tooling does not exist (404).
    KeyToolingOff,
    /// The bearer token is missing or wrong (401).
    Unauthorized,
    /// `/keys` takes `GET` and `DELETE` only (405).
    MethodNotAllowed,
    /// The request does not name a record in a form the tooling reads (400).
    InvalidRecordName {
        /// What is wrong with it.
        detail: String,
    },
    /// No idempotent route has that name (404).
    NoIdempotentRoute,
    /// Nothing is saved under the key (404).
    NoRecord,
    /// The key holds a claim in flight, which is never forgotten (409).
    RecordInFlight,
    /// The key holds a claim whose outcome is being resolved, never forgotten (409).
    RecordResolving {
        /// When its next lookup is sent, from now (on the store's clock); `None` when its
        /// holder's lease has lapsed: no lookup is due until a repeat of the key takes it over.
        next_lookup_in: Option<Duration>,
    },
    /// What the key holds is not a finished record of this proxy, so it is left alone (409).
    NotARecord,
    /// The store failed or did not answer in time (503).
    StoreUnavailable { detail: String },
}

/// Why a claim of a `resolve` route is left alone.
const NEVER_FORGOTTEN: &str = "A key being resolved is never forgotten: it ends found, absent or outcome-unknown (give_up_after).";

impl AdminProblem {
    /// The admin's answer to a store failure (503, no `Retry-After`).
    pub(crate) fn of_store(e: &StoreError) -> AdminProblem {
        AdminProblem::StoreUnavailable {
            detail: e.to_string(),
        }
    }

    /// Its row of the kind table: every kind's slug, status and title, in one place.
    pub(super) fn kind(&self) -> Kind {
        use StatusCode as S;
        let (slug, status, title) = match self {
            AdminProblem::NoEndpoint => {
                ("no-admin-endpoint", S::NOT_FOUND, "No such admin endpoint")
            }
            AdminProblem::KeyToolingOff => ("key-tooling-off", S::NOT_FOUND, "Key tooling off"),
            AdminProblem::Unauthorized => ("unauthorized", S::UNAUTHORIZED, "Admin token required"),
            AdminProblem::MethodNotAllowed => (
                "method-not-allowed",
                S::METHOD_NOT_ALLOWED,
                "Method not allowed",
            ),
            AdminProblem::InvalidRecordName { .. } => {
                ("invalid-record-name", S::BAD_REQUEST, "Record not named")
            }
            AdminProblem::NoIdempotentRoute => (
                "no-idempotent-route",
                S::NOT_FOUND,
                "No such idempotent route",
            ),
            AdminProblem::NoRecord => ("no-record", S::NOT_FOUND, "No record"),
            AdminProblem::RecordInFlight | AdminProblem::RecordResolving { .. } => {
                ("record-in-flight", S::CONFLICT, "Claim in flight")
            }
            AdminProblem::NotARecord => ("not-a-record", S::CONFLICT, "Not a record"),
            AdminProblem::StoreUnavailable { .. } => (
                "admin-store-unavailable",
                S::SERVICE_UNAVAILABLE,
                "Idempotency store unavailable",
            ),
        };
        Kind {
            slug,
            status,
            title,
        }
    }

    pub(super) fn detail(&self) -> String {
        match self {
            AdminProblem::NoEndpoint => "The admin listener serves /healthz, /readyz, /metrics and, with an admin token, /keys/ROUTE.".into(),
            AdminProblem::KeyToolingOff => "The key tooling is off: configure admin_token_file or admin_token_env.".into(),
            AdminProblem::Unauthorized => "Send Authorization: Bearer <admin token>.".into(),
            AdminProblem::MethodNotAllowed => "/keys takes GET (show a record) or DELETE (forget it).".into(),
            AdminProblem::InvalidRecordName { detail } => format!("{detail}."),
            AdminProblem::NoIdempotentRoute => "No idempotent route has that name.".into(),
            AdminProblem::NoRecord => "No record under this key.".into(),
            AdminProblem::RecordInFlight => "A claim in flight is never forgotten: its holder may be alive; a dead holder's lease expires within lock_ttl.".into(),
            AdminProblem::RecordResolving {
                next_lookup_in: Some(next),
            } => format!(
                "The outcome of this key's first request is unknown and is being resolved: the proxy asks the upstream whether the operation happened, next at {} (in {}ms). {NEVER_FORGOTTEN}",
                humantime::format_rfc3339_seconds(std::time::SystemTime::now() + *next),
                next.as_millis()
            ),
            AdminProblem::RecordResolving {
                next_lookup_in: None,
            } => format!(
                "The outcome of this key's first request is unknown, and no instance is resolving it now: its holder's lease lapsed (a crash, a drain, or limits.max_resolutions). The next repeat of the key takes it over and asks the upstream: send it (the client's retry). {NEVER_FORGOTTEN}"
            ),
            AdminProblem::NotARecord => "What is under this key is not a finished record of this proxy; left alone.".into(),
            AdminProblem::StoreUnavailable { detail } => {
                format!("The idempotency store did not answer ({detail}).")
            }
        }
    }

    pub(crate) fn response(&self) -> Response<Body> {
        let kind = self.kind();
        let body = document(&kind, &self.detail());
        respond(kind.status, body, vec![content_type()])
    }
}
