//! The compiled route table: which route, if any, a request belongs to.
//!
//! Patterns are compiled once at start into segment lists, so matching a request allocates
//! nothing. First match wins, in file order.

use http::Method;

use crate::config::RouteSettings;

/// One segment of a path pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    /// Must equal this text.
    Literal(String),
    /// `{name}`: any one non-empty segment.
    Param,
}

/// A compiled path pattern: exact segments, `{param}` segments, an optional trailing `/*`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathPattern {
    segments: Vec<Segment>,
    /// A trailing `/*`: matches the rest of the path, including nothing.
    rest: bool,
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
                if name.is_none() {
                    return Err(format!(
                        "invalid path {text:?}: a parameter is a whole segment like {{id}}"
                    ));
                }
                segments.push(Segment::Param);
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
        Ok(PathPattern {
            segments,
            rest,
            text: text.to_owned(),
        })
    }

    /// Whether `path` (without query) matches.
    pub fn matches(&self, path: &str) -> bool {
        let body = path.strip_prefix('/').unwrap_or(path);
        // "/" has no segments at all (splitting "" would yield one empty segment).
        let mut parts = body.split('/').filter(|_| !body.is_empty());
        for seg in &self.segments {
            match (seg, parts.next()) {
                (Segment::Literal(want), Some(got)) if want == got => {}
                (Segment::Param, Some(got)) if !got.is_empty() => {}
                _ => return false,
            }
        }
        self.rest || parts.next().is_none()
    }

    /// The pattern as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

/// The routes in file order.
#[derive(Debug, Clone, Default)]
pub struct RouteTable {
    routes: Vec<RouteSettings>,
}

impl RouteTable {
    /// Wraps compiled routes.
    pub fn new(routes: Vec<RouteSettings>) -> Self {
        RouteTable { routes }
    }

    /// Every route, in file order.
    pub fn routes(&self) -> &[RouteSettings] {
        &self.routes
    }

    /// The index of the first route that matches, if any.
    pub fn find(&self, method: &Method, path: &str) -> Option<usize> {
        self.routes.iter().position(|r| {
            r.methods.as_ref().is_none_or(|ms| ms.contains(method)) && r.path.matches(path)
        })
    }
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
    fn bad_patterns_are_refused() {
        for bad in ["bookings", "/a/*/b", "/a/{", "/a/x{id}", "/a//b", "/a/{}"] {
            assert!(PathPattern::parse(bad).is_err(), "{bad} should be refused");
        }
    }
}
