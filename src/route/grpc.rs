//! A gRPC route's settings (SPEC §4.11), compiled from its `grpc:` block.

/// `routes[i].grpc:`, compiled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrpcSettings {
    /// `grpc-status` codes that are not a call's result (the claim is released, as for
    /// `retry_statuses`): by default `RESOURCE_EXHAUSTED` (8) and `UNAVAILABLE` (14).
    pub retry_codes: Vec<u32>,
}
