//! Compiled routes: the path patterns, and what a route does (its upstream and idempotency
//! policy, and on a webhook route its verification settings, in `webhook`), as validated from
//! the configuration.
//!
//! Patterns are compiled once at start into segment lists, so matching a request allocates
//! nothing. First match wins, in file order.

use std::time::Duration;

use http::{HeaderName, Method};
use serde::Deserialize;

mod grpc;
mod jsonrpc;
mod normalise;
mod resolve;
mod webhook;

pub use grpc::GrpcSettings;
pub use jsonrpc::JsonRpcSettings;
pub use normalise::normalise;
pub use resolve::{LookupTemplate, Piece, ResolveSettings};
pub(crate) use webhook::BASE64;
pub use webhook::{
    Encoding, HmacScheme, MAX_SECRETS, Provider, Secrets, SecretsError, WebhookSettings,
};

/// One segment of a path pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    /// Must equal this text.
    Literal(String),
    /// `{name}`: any one non-empty segment, captured under its name (`key_from: path:NAME`).
    Param(String),
}

/// A compiled path pattern: exact segments, `{param}` segments, an optional trailing `/*`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathPattern {
    segments: Vec<Segment>,
    /// A trailing `/*`: matches the rest of the path, including nothing.
    rest: bool,
    /// The segments as a normalised path is compared with them ([`normalise()`]): literals in
    /// lower case, the last one without its `.ext` suffix. What a webhook route matches.
    folded: Vec<Segment>,
    /// The pattern as written, for logs.
    text: String,
}

impl PathPattern {
    /// Compiles a pattern. The error says what is wrong with it.
    pub fn parse(text: &str) -> Result<PathPattern, String> {
        if !text.starts_with('/') {
            return Err(format!("invalid path {text:?}: it must start with '/'"));
        }
        let mut segments = Vec::new();
        let mut rest = false;
        let body = &text[1..];
        let parts: Vec<&str> = if body.is_empty() {
            Vec::new()
        } else {
            body.split('/').collect()
        };
        for (i, part) in parts.iter().enumerate() {
            let last = i + 1 == parts.len();
            if *part == "*" {
                if !last {
                    return Err(format!(
                        "invalid path {text:?}: '*' is only allowed as the last segment (a trailing /*)"
                    ));
                }
                rest = true;
            } else if part.starts_with('{') || part.ends_with('}') {
                let name = part
                    .strip_prefix('{')
                    .and_then(|p| p.strip_suffix('}'))
                    .filter(|n| !n.is_empty() && !n.contains(['{', '}']));
                let Some(name) = name else {
                    return Err(format!(
                        "invalid path {text:?}: a parameter is a whole segment like {{id}}"
                    ));
                };
                if segments.contains(&Segment::Param(name.to_owned())) {
                    return Err(format!(
                        "invalid path {text:?}: the parameter {{{name}}} appears twice"
                    ));
                }
                segments.push(Segment::Param(name.to_owned()));
            } else if part.contains(['{', '}', '*', '?', '#']) {
                return Err(format!(
                    "invalid path {text:?}: segment {part:?} mixes text with '{{', '}}', '*', '?' or '#'"
                ));
            } else if part.is_empty() && !last {
                return Err(format!("invalid path {text:?}: empty segment '//'"));
            } else {
                segments.push(Segment::Literal((*part).to_owned()));
            }
        }
        let last = segments.len().saturating_sub(1);
        let folded = segments
            .iter()
            .enumerate()
            .map(|(i, seg)| match seg {
                Segment::Literal(lit) => {
                    let lower = normalise(&format!("/{lit}"));
                    let lower = lower.trim_start_matches('/');
                    let lower = if i == last && !rest {
                        normalise::strip_extension(lower)
                    } else {
                        lower
                    };
                    Segment::Literal(lower.to_owned())
                }
                Segment::Param(name) => Segment::Param(name.clone()),
            })
            .collect();
        Ok(PathPattern {
            segments,
            rest,
            folded,
            text: text.to_owned(),
        })
    }

    /// Whether a path in its normalised form ([`normalise()`]) matches: every spelling of the
    /// pattern's path does (SPEC §4.9).
    pub(crate) fn matches_normalised(&self, normalised: &str) -> bool {
        Self::match_segments(&self.folded, self.rest, normalised)
    }

    /// The segment of a normalised path that the parameter `{name}` matches (lower case, as
    /// every spelling of it reads); `None` when there is no such parameter or no match.
    pub(crate) fn capture_normalised<'p>(
        &self,
        normalised: &'p str,
        name: &str,
    ) -> Option<&'p str> {
        if !self.matches_normalised(normalised) {
            return None;
        }
        let body = normalised.strip_prefix('/').unwrap_or(normalised);
        self.folded
            .iter()
            .zip(body.split('/'))
            .find_map(|(seg, got)| match seg {
                Segment::Param(n) if n == name => Some(got),
                _ => None,
            })
    }

    /// The names of the pattern's `{NAME}` parameters, in order.
    pub(crate) fn params(&self) -> impl Iterator<Item = &str> {
        self.segments.iter().filter_map(|seg| match seg {
            Segment::Param(name) => Some(name.as_str()),
            Segment::Literal(_) => None,
        })
    }

    /// Whether `path` (without query) matches.
    pub(crate) fn matches(&self, path: &str) -> bool {
        Self::match_segments(&self.segments, self.rest, path)
    }

    fn match_segments(segments: &[Segment], rest: bool, path: &str) -> bool {
        let body = path.strip_prefix('/').unwrap_or(path);
        // "/" has no segments at all (splitting "" would yield one empty segment).
        let mut parts = body.split('/').filter(|_| !body.is_empty());
        for seg in segments {
            match (seg, parts.next()) {
                (Segment::Literal(want), Some(got)) if want == got => {}
                (Segment::Param(_), Some(got)) if !got.is_empty() => {}
                _ => return false,
            }
        }
        rest || parts.next().is_none()
    }

    /// The segment of `path` that the parameter `{name}` matches, as sent (percent-encoded);
    /// `None` when the pattern has no such parameter or `path` does not match.
    pub(crate) fn capture<'p>(&self, path: &'p str, name: &str) -> Option<&'p str> {
        if !self.matches(path) {
            return None;
        }
        let body = path.strip_prefix('/').unwrap_or(path);
        self.segments
            .iter()
            .zip(body.split('/'))
            .find_map(|(seg, got)| match seg {
                Segment::Param(n) if n == name => Some(got),
                _ => None,
            })
    }

    /// Whether the pattern has a `{name}` parameter.
    pub(crate) fn has_param(&self, name: &str) -> bool {
        self.segments.contains(&Segment::Param(name.to_owned()))
    }

    /// The pattern as written.
    pub(crate) fn as_str(&self) -> &str {
        &self.text
    }
}

/// One route, compiled.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteSettings {
    /// Unique name.
    pub name: String,
    /// Methods it matches; `None` matches every method.
    pub methods: Option<Vec<Method>>,
    /// The compiled path pattern.
    pub path: PathPattern,
    /// The upstream's name (a key of the configuration's `upstreams`).
    pub upstream: String,
    /// `None` for pass-through routes.
    pub idempotency: Option<IdempotencySettings>,
    /// `Some` on a webhook route (SPEC §4.9): deliveries are verified first, and the event id
    /// is the key (`idempotency` is then always `Some`).
    pub webhook: Option<WebhookSettings>,
    /// `Some` on a JSON-RPC route (SPEC §4.10): the call, not the request, is claimed
    /// (`idempotency` is then always `Some`).
    pub jsonrpc: Option<JsonRpcSettings>,
    /// `Some` on a gRPC route (SPEC §4.11): each unary call of it is claimed, its whole
    /// response (trailers included) saved and replayed, the proxy's answers gRPC statuses.
    pub grpc: Option<GrpcSettings>,
}

impl RouteSettings {
    /// Whether this route takes a request with this method and path (without query), on its
    /// raw path; a webhook route never does (see [`RouteSettings::matches_normalised`]).
    pub(crate) fn matches(&self, method: &Method, path: &str) -> bool {
        self.webhook.is_none() && self.takes(method) && self.path.matches(path)
    }

    /// Whether this webhook route takes a request with this method and normalised path
    /// ([`normalise()`]): a webhook route matches every spelling of its path, so none reaches a
    /// broader route unverified (SPEC §4.9). Never true of another route.
    pub(crate) fn matches_normalised(&self, method: &Method, normalised: &str) -> bool {
        self.webhook.is_some() && self.takes(method) && self.path.matches_normalised(normalised)
    }

    fn takes(&self, method: &Method) -> bool {
        self.methods.as_ref().is_none_or(|ms| ms.contains(method))
    }
}

/// The route a request with `method` and raw `path` is handled by, of `routes` in file order
/// (`settings` reads each one's compiled settings): the first webhook route whose pattern the
/// normalised path matches, whatever the raw path matches, else the first other route the raw
/// path matches. `webhooks`: whether any route is a webhook route (none: no normalising).
pub fn find<'r, R>(
    routes: &'r [R],
    settings: impl Fn(&R) -> &RouteSettings,
    webhooks: bool,
    method: &Method,
    path: &str,
) -> Option<&'r R> {
    if webhooks {
        let normalised = normalise(path);
        if let Some(route) = routes
            .iter()
            .find(|r| settings(r).matches_normalised(method, &normalised))
        {
            return Some(route);
        }
    }
    routes.iter().find(|r| settings(r).matches(method, path))
}

/// One part of the request fingerprint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FingerprintPart {
    Method,
    Path,
    /// The query string.
    Query,
    Body,
    /// The request body as canonical JSON (key order, whitespace and number spelling do not
    /// count); the raw bytes when it is not JSON.
    Json,
    /// The values of one request header.
    Header(HeaderName),
}

/// One part of a derived key, as configured (`key_from`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyPart {
    /// `path:NAME`: the `{NAME}` segment of the route's path, percent-decoded.
    Path(String),
    /// `json:POINTER`: the string, number or boolean at this RFC 6901 pointer in the body.
    Json(String),
    /// `query:NAME`: the query parameter, percent-decoded; exactly once.
    Query(String),
    /// `header:NAME`: the header's value; exactly once.
    Header(HeaderName),
    /// `method`.
    Method,
}

impl KeyPart {
    /// Parses a configured part. The error says what is wrong.
    pub(crate) fn parse(text: &str) -> Result<KeyPart, String> {
        if text == "method" {
            return Ok(KeyPart::Method);
        }
        let Some((kind, arg)) = text.split_once(':') else {
            return Err(format!(
                "unknown key_from part {text:?}; expected path:NAME, json:POINTER, query:NAME, header:NAME or method"
            ));
        };
        match kind {
            "path" if !arg.is_empty() => Ok(KeyPart::Path(arg.to_owned())),
            "json" => {
                check_pointer(arg)?;
                Ok(KeyPart::Json(arg.to_owned()))
            }
            "query" if !arg.is_empty() => Ok(KeyPart::Query(arg.to_owned())),
            "header" => HeaderName::from_bytes(arg.trim().as_bytes())
                .map(KeyPart::Header)
                .map_err(|_| format!("invalid header name {arg:?}")),
            "path" | "query" => Err(format!("{kind}: needs a name, as in {kind}:id")),
            other => Err(format!(
                "unknown key_from part kind {other:?}; expected path, json, query, header or method"
            )),
        }
    }

    /// The part as configured, for messages.
    pub(crate) fn describe(&self) -> String {
        match self {
            KeyPart::Path(n) => format!("path:{n}"),
            KeyPart::Json(p) => format!("json:{p}"),
            KeyPart::Query(n) => format!("query:{n}"),
            KeyPart::Header(h) => format!("header:{h}"),
            KeyPart::Method => "method".into(),
        }
    }
}

/// RFC 6901: empty (the whole document) or `/`-separated tokens where `~` is only `~0` or `~1`.
fn check_pointer(p: &str) -> Result<(), String> {
    if !p.is_empty() && !p.starts_with('/') {
        return Err(format!(
            "invalid JSON pointer {p:?}: it starts with '/' (RFC 6901), as in json:/reason/code"
        ));
    }
    let mut chars = p.chars();
    while let Some(c) = chars.next() {
        if c == '~' && !matches!(chars.next(), Some('0' | '1')) {
            return Err(format!(
                "invalid JSON pointer {p:?}: '~' is only allowed as ~0 or ~1"
            ));
        }
    }
    Ok(())
}

/// Idempotency settings of one route, compiled.
#[derive(Debug, Clone, PartialEq)]
pub struct IdempotencySettings {
    pub header: HeaderName,
    /// Missing key → 400 when true.
    pub required: bool,
    /// Replay window of a finished response.
    pub ttl: Duration,
    /// In-progress lease.
    pub lock_ttl: Duration,
    /// Headers whose values namespace the key.
    pub scope: Vec<HeaderName>,
    /// What the fingerprint covers.
    pub fingerprint: Vec<FingerprintPart>,
    /// Repeat while in flight.
    pub on_conflict: OnConflict,
    /// With `wait`, the bound.
    pub wait_timeout: Duration,
    /// Store unreachable.
    pub on_store_error: OnStoreError,
    /// Statuses that are not saved.
    pub retry_statuses: Vec<u16>,
    /// Unknown outcome.
    pub on_unknown_outcome: OnUnknownOutcome,
    /// With `on_unknown_outcome: resolve`, how to ask (always `Some` then, `None` otherwise).
    pub resolve: Option<ResolveSettings>,
    /// Request body bound.
    pub max_request_body: u64,
    /// Saved response body bound.
    pub max_response_body: u64,
    /// Save `Set-Cookie`.
    pub replay_set_cookie: bool,
    /// Forward the key header upstream.
    pub forward_key: bool,
    /// Parts to derive a key from when the request has no key header (empty: none).
    pub key_from: Vec<KeyPart>,
    /// Enforce idempotency, or only observe what enforcing it would do.
    pub mode: Mode,
}

/// Whether a route applies its idempotency policy or only measures it (SPEC §4.7).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Claim, forward the first request, replay or refuse its repeats (the default).
    #[default]
    Enforce,
    /// Forward every request and refuse none, while claiming and saving as `enforce` does
    /// and counting what it would have answered: the way to roll idempotency out.
    Observe,
}

/// What to do with a repeat that arrives while the first request is still in flight.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnConflict {
    /// Answer 409 at once (the default).
    #[default]
    Reject,
    /// Wait up to `wait_timeout` for the first one's result, then 409.
    Wait,
}

/// What to do when the store cannot be reached.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnStoreError {
    /// Answer 503 (the default).
    #[default]
    Reject,
    /// Pass the request through without idempotency (logged and counted).
    Forward,
}

/// What to do when the upstream may have acted but no complete response came.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnUnknownOutcome {
    /// Save a 502/504 problem as the key's result: the operation never runs twice (the default).
    #[default]
    Keep,
    /// Free the key so that a retry runs again.
    Release,
    /// Hold the key and ask the upstream (`resolve:`) whether the operation happened; act
    /// only on its answer (SPEC §4.8).
    Resolve,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> PathPattern {
        PathPattern::parse(s).expect("valid pattern")
    }

    #[test]
    fn exact_paths() {
        assert!(p("/bookings").matches("/bookings"));
        assert!(!p("/bookings").matches("/bookings/1"));
        assert!(!p("/bookings").matches("/booking"));
        assert!(!p("/bookings").matches("/"));
        assert!(p("/").matches("/"));
        assert!(!p("/").matches("/x"));
    }

    #[test]
    fn params_match_one_segment() {
        let pat = p("/bookings/{id}/pay");
        assert!(pat.matches("/bookings/42/pay"));
        assert!(!pat.matches("/bookings//pay"));
        assert!(!pat.matches("/bookings/42/x/pay"));
        assert!(!pat.matches("/bookings/42"));
    }

    #[test]
    fn trailing_star_matches_the_rest() {
        let pat = p("/api/*");
        assert!(pat.matches("/api/"));
        assert!(pat.matches("/api/a/b/c"));
        assert!(pat.matches("/api"));
        assert!(!pat.matches("/apix"));
        assert!(p("/*").matches("/anything/at/all"));
    }

    #[test]
    fn named_params_are_captured() {
        let pat = p("/tickets/{ticket_id}/refunds/{n}");
        assert!(pat.has_param("ticket_id") && pat.has_param("n") && !pat.has_param("id"));
        assert_eq!(
            pat.capture("/tickets/T%2D1/refunds/2", "ticket_id"),
            Some("T%2D1")
        );
        assert_eq!(pat.capture("/tickets/T-1/refunds/2", "n"), Some("2"));
        assert_eq!(pat.capture("/tickets/T-1", "ticket_id"), None, "no match");
        assert_eq!(pat.capture("/tickets/T-1/refunds/2", "x"), None);
    }

    #[test]
    fn pointers_and_parts_are_checked() {
        assert!(KeyPart::parse("json:/reason/code").is_ok());
        assert!(KeyPart::parse("json:").is_ok());
        assert!(KeyPart::parse("json:reason").is_err());
        assert!(KeyPart::parse("json:/a~2b").is_err());
        assert!(KeyPart::parse("json:/a~0b~1c").is_ok());
        assert!(KeyPart::parse("cookie:x").is_err());
        assert!(KeyPart::parse("path:").is_err());
        assert_eq!(KeyPart::parse("method"), Ok(KeyPart::Method));
    }

    #[test]
    fn bad_patterns_are_refused() {
        for bad in [
            "bookings",
            "/a/*/b",
            "/a/{",
            "/a/x{id}",
            "/a//b",
            "/a/{}",
            "/a/{x}/{x}",
        ] {
            assert!(PathPattern::parse(bad).is_err(), "{bad} should be refused");
        }
    }
}
