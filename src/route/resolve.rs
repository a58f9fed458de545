//! `resolve:` (SPEC §4.8): how a route whose outcome is unknown asks its upstream whether the
//! operation happened — the lookup's template, the statuses that answer it and the times that
//! bound the asking.
//!
//! The template's parts are `key_from`'s parts ([`KeyPart`], one parser) plus `{key}`; they are
//! read from the request by `key_from`'s reader (one reader), so a part a lookup needs is
//! refused before anything is claimed exactly as an unreadable `key_from` part is.

use std::time::Duration;

use http::uri::PathAndQuery;
use http::{HeaderName, Method};

use super::{KeyPart, PathPattern};

/// One piece of a lookup's path and query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// Written as is.
    Text(String),
    /// `{key}`: the key as the upstream received it (as the client sent it, or the derived key).
    Key,
    /// `{path:NAME}`, `{json:POINTER}`, `{query:NAME}`, `{header:NAME}`: the part's value,
    /// read as `key_from` reads it; its index in [`LookupTemplate::parts`].
    Part(usize),
}

/// `resolve.request`, compiled: `METHOD /path/{part}?name={part}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LookupTemplate {
    /// The lookup's method.
    pub method: Method,
    /// The path and query, piece by piece.
    pub pieces: Vec<Piece>,
    /// The parts the pieces read, in order, as `key_from` reads them.
    pub parts: Vec<KeyPart>,
    /// As written, for messages.
    text: String,
}

impl LookupTemplate {
    /// Parses `METHOD /path…`; `pattern` is the route's path, when it parsed, which a
    /// `{path:NAME}` part must name a segment of. The error says what is wrong.
    pub(crate) fn parse(
        text: &str,
        pattern: Option<&PathPattern>,
    ) -> Result<LookupTemplate, String> {
        let (method, target) = text.trim().split_once(' ').ok_or_else(|| {
            format!(
                "{text:?} is not METHOD /path; write it as in GET /bookings/by-reference/{{json:/reference}}"
            )
        })?;
        // Methods are case-sensitive (RFC 9110 §9.1): `get` is another method than `GET`,
        // one an upstream refuses.
        if method.bytes().any(|b| b.is_ascii_lowercase()) {
            return Err(format!(
                "the method {method:?} must be written in capitals ({:?})",
                method.to_ascii_uppercase()
            ));
        }
        let method = Method::from_bytes(method.as_bytes())
            .map_err(|_| format!("invalid method {method:?}"))?;
        let target = target.trim();
        if !target.starts_with('/') {
            return Err(format!("the path {target:?} must start with '/'"));
        }
        let mut pieces = Vec::new();
        let mut parts = Vec::new();
        let mut rest = target;
        while !rest.is_empty() {
            let Some(open) = rest.find(['{', '}']) else {
                pieces.push(Piece::Text(rest.to_owned()));
                break;
            };
            if rest[open..].starts_with('}') {
                return Err(format!("a '}}' with no '{{' before it in {target:?}"));
            }
            if open > 0 {
                pieces.push(Piece::Text(rest[..open].to_owned()));
            }
            let after = &rest[open + 1..];
            let close = after
                .find('}')
                .ok_or_else(|| format!("a '{{' that is never closed in {target:?}"))?;
            let inner = &after[..close];
            pieces.push(piece(inner, pattern, &mut parts)?);
            rest = &after[close + 1..];
        }
        // Every literal must already be a valid path and query: values are percent-encoded
        // into it, so a stand-in for each shows whether the whole can be sent.
        let sample: String = pieces
            .iter()
            .map(|p| match p {
                Piece::Text(t) => t.as_str(),
                Piece::Key | Piece::Part(_) => "x",
            })
            .collect();
        if sample.contains('#') || PathAndQuery::try_from(sample.as_str()).is_err() {
            return Err(format!(
                "{target:?} is not a valid path and query (characters that are not allowed in a URL must be percent-encoded)"
            ));
        }
        Ok(LookupTemplate {
            text: format!("{method} {target}"),
            method,
            pieces,
            parts,
        })
    }

    /// The template as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

/// One `{…}` of a template.
fn piece(
    inner: &str,
    pattern: Option<&PathPattern>,
    parts: &mut Vec<KeyPart>,
) -> Result<Piece, String> {
    if inner == "key" {
        return Ok(Piece::Key);
    }
    let unknown = || {
        format!(
            "unknown template part {{{inner}}}; expected {{key}}, {{path:NAME}}, {{json:POINTER}}, {{query:NAME}} or {{header:NAME}}"
        )
    };
    // The kinds a template takes are `key_from`'s but `method` (a lookup has its own): an
    // unknown kind is refused here, with the template's list, not `key_from`'s.
    let kind = inner.split_once(':').map_or(inner, |(kind, _)| kind);
    if !matches!(kind, "path" | "json" | "query" | "header") {
        return Err(unknown());
    }
    let part = match KeyPart::parse(inner) {
        Ok(KeyPart::Method) => return Err(unknown()),
        Ok(KeyPart::Path(name)) if pattern.is_some_and(|p| !p.has_param(&name)) => {
            return Err(format!(
                "{{path:{name}}} names no segment of the route's path {:?}; write the path with {{{name}}}",
                pattern.map(|p| p.as_str()).unwrap_or("")
            ));
        }
        Ok(part) => part,
        Err(_) if !inner.contains(':') => return Err(unknown()),
        Err(message) => return Err(format!("template part {{{inner}}}: {message}")),
    };
    parts.push(part);
    Ok(Piece::Part(parts.len() - 1))
}

/// `idempotency.resolve:`, compiled: how to ask, and how to read the answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolveSettings {
    /// The lookup.
    pub request: LookupTemplate,
    /// The upstream it is sent to: the route's unless `resolve.upstream` names another.
    pub upstream: Option<String>,
    /// Request headers copied onto the lookup (default: the route's scope headers).
    pub headers: Vec<HeaderName>,
    /// Statuses that say the operation happened: the answer becomes the key's result.
    pub found: Vec<u16>,
    /// Statuses that say it has not happened (yet).
    pub absent: Vec<u16>,
    /// The upstream's longest processing time: an `absent` answer is final only for a lookup
    /// sent this long or longer after the request.
    pub settle_after: Duration,
    /// How often to ask.
    pub interval: Duration,
    /// Still not known this long after the request: saved as `outcome-unknown`.
    pub give_up_after: Duration,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(p: &str) -> PathPattern {
        PathPattern::parse(p).expect("valid pattern")
    }

    #[test]
    fn a_template_is_a_method_and_pieces() {
        let t = LookupTemplate::parse(
            "GET /bookings/by-reference/{json:/reference}?k={key}&t={path:tenant}",
            Some(&pattern("/t/{tenant}/bookings")),
        )
        .expect("valid");
        assert_eq!(t.method, Method::GET);
        assert_eq!(
            t.pieces,
            vec![
                Piece::Text("/bookings/by-reference/".into()),
                Piece::Part(0),
                Piece::Text("?k=".into()),
                Piece::Key,
                Piece::Text("&t=".into()),
                Piece::Part(1),
            ]
        );
        assert_eq!(
            t.parts,
            vec![
                KeyPart::Json("/reference".into()),
                KeyPart::Path("tenant".into())
            ]
        );
    }

    #[test]
    fn bad_templates_are_refused() {
        let route = pattern("/bookings");
        for bad in [
            "/bookings/{key}",
            "GET bookings/{key}",
            "GET /bookings/{cookie:x}",
            "GET /bookings/{method}",
            "GET /bookings/{ref}",
            "GET /bookings/{json:reference}",
            "GET /bookings/{path:id}",
            "GET /bookings/{key",
            "GET /bookings/key}",
            "GET /bookings/a b",
            "GET /bookings/#{key}",
            "G(T /bookings/{key}",
            "get /bookings/{key}",
            "Get /bookings/{key}",
        ] {
            assert!(
                LookupTemplate::parse(bad, Some(&route)).is_err(),
                "{bad} should be refused"
            );
        }
        assert!(LookupTemplate::parse("GET /b/{header:X-Ref}", Some(&route)).is_ok());
    }

    /// An unknown part is refused with the parts a template takes — not `key_from`'s list,
    /// which has `method`, a part a template does not take.
    #[test]
    fn an_unknown_part_is_refused_with_the_parts_a_template_takes() {
        let route = pattern("/bookings");
        for bad in [
            "GET /b/{cookie:x}",
            "GET /b/{method}",
            "GET /b/{ref}",
            "GET /b/{method:x}",
        ] {
            let error = LookupTemplate::parse(bad, Some(&route)).expect_err(bad);
            assert!(
                error.contains(
                    "expected {key}, {path:NAME}, {json:POINTER}, {query:NAME} or {header:NAME}"
                ),
                "{bad}: {error}"
            );
            assert!(!error.contains("or method"), "{bad}: {error}");
        }
        let pointer = LookupTemplate::parse("GET /b/{json:reference}", Some(&route))
            .expect_err("a pointer without '/'");
        assert!(pointer.contains("RFC 6901"), "{pointer}");
        assert!(LookupTemplate::parse("GET /b?r={query:ref}", Some(&route)).is_ok());
    }
}
