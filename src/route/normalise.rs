//! One path, however it is spelled (SPEC §4.9): the normalised form of a request path that a
//! webhook route matches.
//!
//! **Why.** The frameworks a webhook handler runs on (Express, ASP.NET Core, Spring, Rails,
//! servlet containers) route many spellings of one path to one handler: `/Webhooks/Stripe/`,
//! `/webhooks//stripe`, `/webhooks/./stripe`, `/webhooks/stripe;x=1`, `/webhook%73/stripe`,
//! `/webhooks/stripe.json`. Were a webhook route matched on the raw path only, each of those
//! spellings would fall through to a broader pass-through route and reach the handler without
//! its signature checked. So a webhook route matches the normalised path, which folds every
//! such spelling into one; the raw path is still what is forwarded.
//!
//! The steps, in order:
//! 1. percent-encoded unreserved characters decoded (`%73` is `s`, `%2E` is `.`), and `%2F`,
//!    `%5C` and `\` read as `/`; every other escape kept, its hex digits in one case;
//! 2. empty segments merged (`//`);
//! 3. a `;…` parameter removed from every segment (servlet containers drop them from each);
//! 4. dot segments resolved as RFC 3986 §5.2.4 does: `.` dropped, `..` removes the segment
//!    before it, the last segment too;
//! 5. a `.ext` suffix of the last segment removed (from its first `.` on, as Spring's suffix
//!    matching and Rails' formats read any suffix);
//! 6. one trailing slash removed (step 2 already merged it away);
//! 7. letter case ignored: the whole path in ASCII lower case.
//!
//! Route patterns go through steps 5 and 7 for their literal segments (`route::PathPattern`),
//! so a pattern and every spelling of it meet in the same form.

/// The normalised form of `path` (without query): segments joined by `/`, starting with `/`.
pub fn normalise(path: &str) -> String {
    let decoded = decode(path);
    let mut segments: Vec<&str> = Vec::new();
    for raw in decoded.split('/') {
        // Step 3: a `;…` parameter is no part of the segment's name.
        let segment = raw.split_once(';').map_or(raw, |(name, _)| name);
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            _ => segments.push(segment),
        }
    }
    let mut out = String::with_capacity(decoded.len() + 1);
    let last = segments.len().saturating_sub(1);
    for (i, segment) in segments.iter().enumerate() {
        out.push('/');
        if i == last {
            out.push_str(strip_extension(segment));
        } else {
            out.push_str(segment);
        }
    }
    if out.is_empty() {
        out.push('/');
    }
    out
}

/// A last segment without its `.ext` suffix: from its first `.` after the first character on
/// (a segment that starts with `.`, as `.well-known`, keeps its name).
pub(crate) fn strip_extension(segment: &str) -> &str {
    match segment.char_indices().skip(1).find(|&(_, c)| c == '.') {
        Some((at, _)) => &segment[..at],
        None => segment,
    }
}

/// Step 1 and step 7: escapes of unreserved characters and of `/` and `\` decoded, `\` read as
/// `/`, every other escape kept (upper-case hex, then lowered with the rest), the whole in
/// ASCII lower case.
fn decode(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'%'
            && let Some(decoded) = bytes
                .get(i + 1..i + 3)
                .and_then(|hex| u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok())
        {
            match decoded {
                b'/' | b'\\' => out.push('/'),
                c if c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_' | b'~') => {
                    out.push(char::from(c.to_ascii_lowercase()));
                }
                c => {
                    out.push('%');
                    out.push_str(&format!("{c:02x}"));
                }
            }
            i += 3;
            continue;
        }
        match b {
            b'\\' => out.push('/'),
            // A URI path is ASCII (hyper refuses anything else); a stray byte is kept as its
            // escape so the result stays one string.
            c if c.is_ascii() => out.push(char::from(c.to_ascii_lowercase())),
            c => out.push_str(&format!("%{c:02x}")),
        }
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::normalise;

    #[test]
    fn every_spelling_of_one_path_is_one_path() {
        for spelled in [
            "/webhooks/standard",
            "/webhooks/standard/",
            "/Webhooks/Standard",
            "/WEBHOOKS/STANDARD/",
            "/webhooks//standard",
            "//webhooks///standard//",
            "/webhooks/./standard",
            "/webhooks/x/../standard",
            "/webhooks/standard;x=1",
            "/webhooks;a=b/standard",
            "/webhook%73/standard",
            "/webhook%53/standard",
            "/webhooks%2Fstandard",
            "/webhooks%2fstandard",
            "/webhooks%5Cstandard",
            "/webhooks\\standard",
            "/webhooks/standard.json",
            "/webhooks/standard.tar.gz",
            "/webhooks/%2E/standard",
            "/webhooks/%2e%2e/webhooks/standard",
            "/webhooks/standard/x/..",
        ] {
            assert_eq!(normalise(spelled), "/webhooks/standard", "{spelled}");
        }
    }

    #[test]
    fn dot_segments_resolve_as_rfc_3986_says() {
        assert_eq!(normalise("/a/b/c/./../../g"), "/a/g");
        assert_eq!(normalise("/../../a"), "/a", "nothing above the root");
        assert_eq!(normalise("/a/.."), "/", "the last segment too");
        assert_eq!(normalise("/"), "/");
        assert_eq!(normalise(""), "/");
    }

    #[test]
    fn other_escapes_are_kept_in_one_case() {
        assert_eq!(normalise("/a/%C3%A9"), normalise("/A/%c3%a9"));
        assert_eq!(normalise("/a/%C3%A9"), "/a/%c3%a9");
        assert_eq!(normalise("/a%20b"), "/a%20b");
        assert_eq!(normalise("/a/%zz"), "/a/%zz", "a broken escape is text");
        assert_eq!(normalise("/.well-known"), "/.well-known");
    }
}
