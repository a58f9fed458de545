//! The `Idempotency-Key` header: parsing, and namespacing it into a store key.
//!
//! Two forms mean the same key: a bare token (`abc-123`) and a quoted Structured Field string
//! (`"abc-123"`, the IETF draft's form). A key is 1 to 255 characters of visible ASCII
//! (0x21–0x7E), plus spaces inside a quoted string.
//!
//! The raw key never becomes part of a store key: the store key is
//! `key_prefix + route + ":" + hex(SHA-256(scope values, key))`, every input length-prefixed so
//! that no two different inputs hash the same bytes. Hashing also keeps store keys short and
//! free of anything a client might smuggle into them.

use std::sync::Arc;

use http::{HeaderMap, HeaderName, HeaderValue};
use sha2::{Digest, Sha256};

/// The longest key accepted, in characters.
pub const MAX_KEY_LEN: usize = 255;

/// Why a key header was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The header is absent.
    #[error("the {0} header is missing")]
    Missing(HeaderName),
    /// The header appears more than once.
    #[error("the {0} header appears more than once")]
    Repeated(HeaderName),
    /// The value is not a valid key.
    #[error("the {header} header is not a valid key: {why}")]
    Invalid {
        header: HeaderName,
        /// What is wrong.
        why: &'static str,
    },
}

/// Reads the key header from a request: exactly one value, in one of the two accepted forms.
/// Returns the key itself (unquoted).
pub fn from_headers(headers: &HeaderMap, name: &HeaderName) -> Result<String, KeyError> {
    let mut values = headers.get_all(name).iter();
    let value = values
        .next()
        .ok_or_else(|| KeyError::Missing(name.clone()))?;
    if values.next().is_some() {
        return Err(KeyError::Repeated(name.clone()));
    }
    parse(value).map_err(|why| KeyError::Invalid {
        header: name.clone(),
        why,
    })
}

/// Parses one header value into a key.
///
/// A value that is a well-formed Structured Field string is the quoted form; anything else is
/// read as a bare token. So `"abc"` and `abc` are one key, while `"abc` (not a valid string) is
/// the bare key `"abc`, which is visible ASCII as SPEC allows.
pub fn parse(value: &HeaderValue) -> Result<String, &'static str> {
    let bytes = value.as_bytes();
    if let Some(unquoted) = unquote_sf_string(bytes) {
        return check(unquoted, true);
    }
    if bytes.is_empty() {
        return Err("it is empty");
    }
    if bytes.iter().any(|b| !(0x21..=0x7e).contains(b)) {
        return Err("a bare key may contain only visible ASCII characters (no spaces)");
    }
    check(bytes.to_vec(), false)
}

fn check(key: Vec<u8>, quoted: bool) -> Result<String, &'static str> {
    if key.is_empty() {
        return Err("it is empty");
    }
    if key.len() > MAX_KEY_LEN {
        return Err("it is longer than 255 characters");
    }
    let allowed = |b: &u8| (0x21..=0x7e).contains(b) || (quoted && *b == b' ');
    if !key.iter().all(allowed) {
        return Err("it may contain only visible ASCII characters");
    }
    // Every byte is ASCII, so this cannot fail; map it anyway rather than unwrap.
    String::from_utf8(key).map_err(|_| "it is not ASCII")
}

/// RFC 8941 sf-string: `"` then printable ASCII with `\"` and `\\` escapes, then `"`.
/// Returns the unescaped content, or `None` when `bytes` is not exactly one sf-string.
fn unquote_sf_string(bytes: &[u8]) -> Option<Vec<u8>> {
    let inner = bytes.strip_prefix(b"\"")?.strip_suffix(b"\"")?;
    let mut out = Vec::with_capacity(inner.len());
    let mut it = inner.iter();
    while let Some(&b) = it.next() {
        match b {
            b'\\' => match it.next() {
                Some(&e @ (b'"' | b'\\')) => out.push(e),
                _ => return None,
            },
            b'"' => return None,
            0x20..=0x7e => out.push(b),
            _ => return None,
        }
    }
    Some(out)
}

/// The hash that names one operation within a route: SHA-256 over the scope header values and
/// the key. Logs show it in hex, never the key itself.
pub(crate) type KeyId = [u8; 32];

/// Hashes the scope header values and the key, each length-prefixed (and absent headers marked
/// as such, so an absent `Authorization` and an empty one are different callers).
pub fn key_id(scope: &[HeaderName], headers: &HeaderMap, key: &str) -> KeyId {
    let mut h = Sha256::new();
    h.update(b"idemproxy-key-v1");
    h.update((scope.len() as u64).to_be_bytes());
    for name in scope {
        let mut values = headers.get_all(name).iter().peekable();
        if values.peek().is_none() {
            h.update([0u8]);
            continue;
        }
        h.update([1u8]);
        let values: Vec<&HeaderValue> = values.collect();
        h.update((values.len() as u64).to_be_bytes());
        for v in values {
            h.update((v.len() as u64).to_be_bytes());
            h.update(v.as_bytes());
        }
    }
    h.update((key.len() as u64).to_be_bytes());
    h.update(key.as_bytes());
    h.finalize().into()
}

/// `prefix + route + ":"`: what every store key of a route starts with.
pub fn namespace(prefix: &str, route: &str) -> Arc<str> {
    format!("{prefix}{route}:").into()
}

/// Where one operation's record lives: its route's namespace and the key's hash.
///
/// Redis names it by text (`namespace + hex(id)`, so an operator can scan one route's records
/// by prefix); the memory store by the route's number and the 32-byte id, a fixed-size key
/// that needs no allocation and no second copy of the text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreKey {
    namespace: Arc<str>,
    route: u32,
    id: KeyId,
}

impl StoreKey {
    /// A key of the route numbered `route` whose namespace is `namespace`.
    pub fn new(namespace: Arc<str>, route: u32, id: KeyId) -> StoreKey {
        StoreKey {
            namespace,
            route,
            id,
        }
    }

    /// The route's number (its position in the configuration).
    pub(crate) fn route(&self) -> u32 {
        self.route
    }

    /// The key's hash.
    pub(crate) fn id(&self) -> &KeyId {
        &self.id
    }

    /// The key's hash in hex, as logs show it.
    pub(crate) fn id_hex(&self) -> String {
        hex::encode(self.id)
    }

    /// The whole key as text: `key_prefix + route + ":" + hex(id)`.
    pub fn text(&self) -> String {
        let mut out = String::with_capacity(self.namespace.len() + 64);
        out.push_str(&self.namespace);
        out.push_str(&hex::encode(self.id));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hv(s: &str) -> HeaderValue {
        HeaderValue::from_str(s).expect("header value")
    }

    #[test]
    fn bare_and_quoted_are_one_key() {
        assert_eq!(parse(&hv("abc-123")), Ok("abc-123".into()));
        assert_eq!(parse(&hv("\"abc-123\"")), Ok("abc-123".into()));
        assert_eq!(parse(&hv("\"a b\"")), Ok("a b".into()));
        assert_eq!(parse(&hv(r#""a\"b""#)), Ok("a\"b".into()));
        assert_eq!(parse(&hv(r#"a"b"#)), Ok("a\"b".into()));
    }

    #[test]
    fn refusals() {
        assert!(parse(&hv("")).is_err());
        assert!(parse(&hv("\"\"")).is_err());
        assert!(parse(&hv("a b")).is_err());
        assert!(parse(&hv(&"k".repeat(256))).is_err());
        assert!(parse(&hv(&"k".repeat(255))).is_ok());
        assert!(parse(&HeaderValue::from_bytes(b"caf\xc3\xa9").expect("bytes")).is_err());
    }

    /// The text of `key`'s store key on the route `route` (numbered 0).
    fn store_key(
        prefix: &str,
        route: &str,
        scope: &[HeaderName],
        headers: &HeaderMap,
        key: &str,
    ) -> String {
        StoreKey::new(namespace(prefix, route), 0, key_id(scope, headers, key)).text()
    }

    #[test]
    fn store_keys_are_namespaced_and_hashed() {
        let scope = [HeaderName::from_static("authorization")];
        let mut a = HeaderMap::new();
        a.insert("authorization", hv("Bearer a"));
        let mut b = HeaderMap::new();
        b.insert("authorization", hv("Bearer b"));
        let none = HeaderMap::new();
        let ka = store_key("p:", "r", &scope, &a, "k1");
        assert!(ka.starts_with("p:r:"));
        assert!(!ka.contains("k1"));
        assert_eq!(ka.len(), "p:r:".len() + 64);
        assert_ne!(ka, store_key("p:", "r", &scope, &b, "k1"));
        assert_ne!(ka, store_key("p:", "r", &scope, &none, "k1"));
        assert_ne!(ka, store_key("p:", "r2", &scope, &a, "k1"));
        assert_eq!(
            store_key("p:", "r", &[], &a, "k1"),
            store_key("p:", "r", &[], &b, "k1")
        );
    }
}
