//! Percent-decoding what a URL carries: a query parameter (`GET /_mock/calls?key=K`) and a path
//! segment (`GET /bookings/by-reference/{reference}`).

/// The first value of `name` in a query string, percent-decoded (`+` as a space).
pub(crate) fn query_param(query: &str, name: &str) -> Option<String> {
    query.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (lossy(percent_decode(k, true)) == name).then(|| lossy(percent_decode(v, true)))
    })
}

/// A path segment, percent-decoded (`+` is itself in a path); `None` when the bytes it stands
/// for are not UTF-8, which no JSON string (a booking's `reference`) can equal.
pub(crate) fn path_segment(raw: &str) -> Option<String> {
    String::from_utf8(percent_decode(raw, false)).ok()
}

fn lossy(bytes: Vec<u8>) -> String {
    String::from_utf8_lossy(&bytes).into_owned()
}

fn percent_decode(s: &str, plus_as_space: bool) -> Vec<u8> {
    let hex = |b: u8| {
        char::from(b)
            .to_digit(16)
            .and_then(|d| u8::try_from(d).ok())
    };
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        let escaped = match (b, bytes.get(i + 1), bytes.get(i + 2)) {
            (b'%', Some(&hi), Some(&lo)) => hex(hi).zip(hex(lo)).map(|(hi, lo)| hi << 4 | lo),
            _ => None,
        };
        match (b, escaped) {
            (_, Some(decoded)) => {
                out.push(decoded);
                i += 3;
            }
            (b'+', None) if plus_as_space => {
                out.push(b' ');
                i += 1;
            }
            (b, None) => {
                out.push(b);
                i += 1;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_decoding() {
        assert_eq!(
            query_param("a=1&key=x%2By+z", "key").as_deref(),
            Some("x+y z")
        );
        assert_eq!(query_param("key=%zz%4", "key").as_deref(), Some("%zz%4"));
        assert_eq!(query_param("a=1", "key"), None);
    }

    #[test]
    fn path_segment_decoding() {
        assert_eq!(path_segment("R%2F7+a%20b").as_deref(), Some("R/7+a b"));
        assert_eq!(path_segment("%E2%82%B9").as_deref(), Some("\u{20b9}"));
        assert_eq!(path_segment("%FF"), None, "not UTF-8");
    }
}
