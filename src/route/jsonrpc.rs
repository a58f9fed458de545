//! A JSON-RPC route's settings (SPEC §4.10), compiled from its `jsonrpc:` block.

/// `routes[i].jsonrpc:`, compiled: which calls are claimed, and which error codes are not a
/// call's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonRpcSettings {
    /// The methods whose calls are claimed (never empty); every other call passes through.
    pub methods: Vec<String>,
    /// JSON-RPC error codes that are not the call's result: the claim is released, as for
    /// `retry_statuses`.
    pub retry_errors: Vec<i64>,
}

impl JsonRpcSettings {
    /// Whether calls of `method` are claimed.
    pub fn claims(&self, method: &str) -> bool {
        self.methods.iter().any(|m| m == method)
    }
}
