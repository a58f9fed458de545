//! Keys from what the request means (`key_from`, SPEC §4.1): a request that carries no key
//! header gets a key derived from named parts of the request — a path segment, a JSON value of
//! the body, a query parameter, a header, the method.
//!
//! Why this is safe to dedupe on: the derived key is an unambiguous encoding of (part, value)
//! pairs, each value canonical, so two requests get one key exactly when they name the same
//! thing. Values are canonical as a careful user expects: path segments and query values are
//! percent-decoded; JSON numbers compare by value (`1`, `1.0` and `10e-1` are one number, and
//! integers beyond 2^53 stay exact — numbers are read from their text, never through a float),
//! and the string `"1"` is not the number `1`. The fingerprint still applies, so the same
//! derived key with another body is a 422.
//!
//! The derived key is `derived-` + the hex SHA-256 of the scope values and the parts: that is
//! what goes upstream in the key header (`forward_key`), so two callers never send the provider
//! one key. In the store it is hashed like a header key, under a domain of its own, so a client
//! that sends `derived-…` in the header can never land on a derived record.

use std::borrow::Cow;

use http::request::Parts;
use http::{HeaderMap, HeaderName};
use serde::de::{self, Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};

use crate::route::{KeyPart, LookupTemplate, PathPattern, Piece};

/// A part that could not be read: the 400's detail names it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("key_from part {part} cannot be read: {why}")]
pub struct Unreadable {
    /// The part, as configured.
    pub part: String,
    pub why: String,
}

/// A canonical value of one part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// Text (path segment, query value, header value, method, JSON string).
    Text(Vec<u8>),
    /// A JSON number, canonical (see [`canonical_number`]).
    Number(String),
    /// A JSON boolean.
    Bool(bool),
}

impl Value {
    fn encode(&self, h: &mut Sha256) {
        let (tag, bytes): (u8, &[u8]) = match self {
            Value::Text(t) => (b's', t),
            Value::Number(n) => (b'n', n.as_bytes()),
            Value::Bool(true) => (b'b', b"true"),
            Value::Bool(false) => (b'b', b"false"),
        };
        h.update([tag]);
        h.update((bytes.len() as u64).to_be_bytes());
        h.update(bytes);
    }

    /// Reads a value as the key tooling is given it: JSON text for `json:` parts, raw text
    /// for the others.
    pub(crate) fn from_text(part: &KeyPart, text: &str) -> Result<Value, String> {
        match part {
            KeyPart::Json(_) => {
                let v: serde_json::Value = serde_json::from_str(text).map_err(|e| {
                    format!("a json: part's value is JSON ({e}), e.g. \"dup\" or 42")
                })?;
                json_value(&v)
            }
            _ => Ok(Value::Text(text.as_bytes().to_vec())),
        }
    }
}

/// Reads every part from the request: the values in order, or the first unreadable part.
pub fn read(
    parts: &[KeyPart],
    pattern: &PathPattern,
    head: &Parts,
    body: &[u8],
) -> Result<Vec<Value>, Unreadable> {
    let mut json: Option<Result<&str, String>> = None;
    parts
        .iter()
        .map(|part| {
            let fail = |why: String| Unreadable {
                part: part.describe(),
                why,
            };
            match part {
                KeyPart::Method => Ok(Value::Text(head.method.as_str().as_bytes().to_vec())),
                KeyPart::Path(name) => pattern
                    .capture(head.uri.path(), name)
                    .map(|raw| Value::Text(percent_decode(raw)))
                    .ok_or_else(|| fail("the path has no such segment".into())),
                KeyPart::Query(name) => {
                    let query = head.uri.query().unwrap_or("");
                    let mut found = query_values(query, name.as_bytes());
                    match (found.next(), found.next()) {
                        (Some(v), None) => Ok(Value::Text(v)),
                        (None, _) => Err(fail("the query parameter is absent".into())),
                        (Some(_), Some(_)) => {
                            Err(fail("the query parameter appears more than once".into()))
                        }
                    }
                }
                KeyPart::Header(name) => one_header(&head.headers, name)
                    .map(|v| Value::Text(v.to_vec()))
                    .map_err(fail),
                KeyPart::Json(pointer) => {
                    let doc = json.get_or_insert_with(|| {
                        std::str::from_utf8(body).map_err(|_| not_json(body))
                    });
                    let doc = *doc.as_ref().map_err(|e| fail(e.clone()))?;
                    // The walk reads (and so checks) only what lies on the pointer's way: the
                    // body is checked whole only when nothing is found, to say why.
                    let v = at_pointer(doc, pointer).ok_or_else(|| {
                        match serde_json::from_str::<&RawValue>(doc) {
                            Ok(_) => fail("the body has nothing at this pointer".into()),
                            Err(_) => fail(not_json(body)),
                        }
                    })?;
                    json_value(&v).map_err(fail)
                }
            }
        })
        .collect()
}

/// The value at `pointer` (RFC 6901, as `serde_json::Value::pointer` reads it) in the JSON
/// text `doc`; `None` when there is none, or when `doc` is not JSON (each object on the way is
/// scanned whole, the body's first, so a text that is not JSON finds nothing). Only the objects
/// and arrays on the pointer's way are split into their members, each member left as raw text;
/// only the value found is parsed into a tree. A body's other members — a tool call's
/// arguments, its `_meta` — cost a scan, never a tree of their own.
fn at_pointer(doc: &str, pointer: &str) -> Option<serde_json::Value> {
    if !pointer.is_empty() && !pointer.starts_with('/') {
        return None;
    }
    let mut here: &str = doc;
    for token in pointer.split('/').skip(1) {
        let token: Cow<'_, str> = if token.contains('~') {
            Cow::Owned(token.replace("~1", "/").replace("~0", "~"))
        } else {
            Cow::Borrowed(token)
        };
        here = match here.trim_start().as_bytes().first() {
            // A key written twice counts by its last value, as in a `Value`'s map.
            Some(b'{') => member(here, &token).ok()??.get(),
            Some(b'[') => {
                if token.starts_with('+') || (token.starts_with('0') && token.len() != 1) {
                    return None;
                }
                let index: usize = token.parse().ok()?;
                let items: Vec<&RawValue> = serde_json::from_str(here).ok()?;
                items.get(index)?.get()
            }
            _ => return None,
        };
    }
    serde_json::from_str(here).ok()
}

/// Why a body that `json:` parts read is refused: serde_json's own words for what is wrong.
fn not_json(body: &[u8]) -> String {
    match serde_json::from_slice::<&RawValue>(body) {
        Err(e) => format!("the body is not JSON ({e})"),
        Ok(_) => "the body is not JSON".into(),
    }
}

/// A member name as written when it has no escapes (most do), else unescaped.
struct Name<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Name<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Text;
        impl<'de> Visitor<'de> for Text {
            type Value = Name<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Name<'de>, E> {
                Ok(Name(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Name<'de>, E> {
                Ok(Name(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Name<'de>, E> {
                Ok(Name(Cow::Owned(v)))
            }
        }
        d.deserialize_str(Text)
    }
}

/// The members of the JSON object `object` in the order written, each value as raw text:
/// one scan, no map, and no name copied unless it has an escape.
fn members(object: &RawValue) -> Result<Vec<(Cow<'_, str>, &RawValue)>, serde_json::Error> {
    struct Members;
    impl<'de> Visitor<'de> for Members {
        type Value = Vec<(Cow<'de, str>, &'de RawValue)>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut out = Vec::with_capacity(map.size_hint().unwrap_or(4));
            while let Some(Name(name)) = map.next_key::<Name<'de>>()? {
                out.push((name, map.next_value::<&'de RawValue>()?));
            }
            Ok(out)
        }
    }
    let mut d = serde_json::Deserializer::from_str(object.get());
    let out = d.deserialize_map(Members)?;
    d.end()?;
    Ok(out)
}

/// The member `name` of the JSON object `object` as raw text, the last one when it is written
/// twice (as a `Value`'s map keeps it): one scan, nothing collected.
fn member<'a>(object: &'a str, name: &str) -> Result<Option<&'a RawValue>, serde_json::Error> {
    struct Last<'n>(&'n str);
    impl<'de> Visitor<'de> for Last<'_> {
        type Value = Option<&'de RawValue>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut found = None;
            while let Some(Name(key)) = map.next_key::<Name<'de>>()? {
                let value = map.next_value::<&'de RawValue>()?;
                if key == self.0 {
                    found = Some(value);
                }
            }
            Ok(found)
        }
    }
    let mut d = serde_json::Deserializer::from_str(object);
    let found = d.deserialize_map(Last(name))?;
    d.end()?;
    Ok(found)
}

/// Writes the JSON value `raw` as canonical JSON (see [`canonical_json`]) straight from its
/// text: objects split into their members and sorted, arrays into their items, strings
/// unescaped and written again, numbers by [`canonical_number`] on their text (the crate reads
/// numbers with `arbitrary_precision`, so a `Value`'s number is its text: the same bytes as
/// through a tree, without building one). At the top level a member named `skip` is left out
/// (a JSON-RPC call's `_meta`). An error when a string or number in it cannot be read.
pub(crate) fn canonical_raw(
    raw: &RawValue,
    skip: Option<&str>,
    out: &mut Vec<u8>,
) -> Result<(), serde_json::Error> {
    let text = raw.get().trim();
    match text.as_bytes().first() {
        Some(b'{') => {
            let mut members = members(raw)?;
            // A name written twice counts by its last value, as in a `Value`'s map: a stable
            // sort keeps the written order among equal names, and the last of each run is kept.
            members.sort_by(|a, b| a.0.cmp(&b.0));
            out.push(b'{');
            let mut first = true;
            for (i, (name, value)) in members.iter().enumerate() {
                let last_of_name = members.get(i + 1).is_none_or(|next| next.0 != *name);
                if !last_of_name || skip == Some(name.as_ref()) {
                    continue;
                }
                if !first {
                    out.push(b',');
                }
                first = false;
                write_string(name, out);
                out.push(b':');
                canonical_raw(value, None, out)?;
            }
            out.push(b'}');
        }
        Some(b'[') => {
            let items: Vec<&RawValue> = serde_json::from_str(text)?;
            out.push(b'[');
            for (i, item) in items.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                canonical_raw(item, None, out)?;
            }
            out.push(b']');
        }
        Some(b'"') => {
            let Name(s) = serde_json::from_str(text)?;
            write_string(&s, out);
        }
        Some(b'-' | b'0'..=b'9') => match canonical_number(text) {
            Some(canonical) => out.extend_from_slice(canonical.as_bytes()),
            None => out.extend_from_slice(text.as_bytes()),
        },
        // `true`, `false`, `null`: checked when the text was read.
        _ => out.extend_from_slice(text.as_bytes()),
    }
    Ok(())
}

/// The path and query of a route's lookup (`resolve.request`, SPEC §4.8), its parts read from
/// the request by [`read`] and percent-encoded into it; `key` is the key as the upstream gets
/// it (as the client sent it, or the derived key). The first unreadable part is the error:
/// the request is refused (`400 unreadable-key-part`) before anything is claimed.
pub fn render_lookup(
    template: &LookupTemplate,
    pattern: &PathPattern,
    head: &Parts,
    body: &[u8],
    key: &str,
) -> Result<String, Unreadable> {
    let values = read(&template.parts, pattern, head, body)?;
    let mut out = String::with_capacity(64);
    // Until the template's first `?`, a value lands in the path.
    let mut in_path = true;
    for piece in &template.pieces {
        match piece {
            Piece::Text(text) => {
                in_path &= !text.contains('?');
                out.push_str(text);
            }
            Piece::Key => {
                if in_path {
                    path_value("key", key.as_bytes())?;
                }
                percent_encode(key.as_bytes(), &mut out);
            }
            Piece::Part(i) => match values.get(*i) {
                Some(Value::Text(bytes)) => {
                    if in_path {
                        path_value(&template.parts[*i].describe(), bytes)?;
                    }
                    percent_encode(bytes, &mut out);
                }
                Some(Value::Number(n)) => percent_encode(n.as_bytes(), &mut out),
                Some(Value::Bool(b)) => out.push_str(if *b { "true" } else { "false" }),
                // `read` gives one value a part, in order.
                None => {
                    return Err(Unreadable {
                        part: format!("#{i}"),
                        why: "the template names a part it does not list".into(),
                    });
                }
            },
        }
    }
    Ok(out)
}

/// Refuses a value in a lookup's path that would name another resource than the one it
/// looks up (SPEC §4.8): empty (`//`, or the collection itself), a dot segment (`.`, `..`,
/// which an upstream normalising paths resolves), or holding a `/` or `\` (which an upstream
/// may decode back into a separator, `%2F` or not).
fn path_value(part: &str, bytes: &[u8]) -> Result<(), Unreadable> {
    let why = match bytes {
        [] => "the value is empty, in the lookup's path",
        b"." | b".." => "the value is a dot segment (. or ..), in the lookup's path",
        _ if bytes.iter().any(|b| matches!(b, b'/' | b'\\')) => {
            "the value holds a / or \\, in the lookup's path"
        }
        _ => return Ok(()),
    };
    Err(Unreadable {
        part: part.to_owned(),
        why: why.into(),
    })
}

/// Percent-encodes every byte but RFC 3986's unreserved ones, so a value is one path segment
/// or one query value whatever it holds (`/`, `?`, `&`, `%`, bytes that are not UTF-8).
fn percent_encode(bytes: &[u8], out: &mut String) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    for &b in bytes {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push('%');
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0xF)]));
        }
    }
}

fn one_header<'a>(headers: &'a HeaderMap, name: &HeaderName) -> Result<&'a [u8], String> {
    let mut values = headers.get_all(name).iter();
    match (values.next(), values.next()) {
        (Some(v), None) => Ok(v.as_bytes()),
        (None, _) => Err("the header is absent".into()),
        (Some(_), Some(_)) => Err("the header appears more than once".into()),
    }
}

fn json_value(v: &serde_json::Value) -> Result<Value, String> {
    match v {
        serde_json::Value::String(s) => Ok(Value::Text(s.as_bytes().to_vec())),
        serde_json::Value::Bool(b) => Ok(Value::Bool(*b)),
        serde_json::Value::Number(n) => canonical_number(&n.to_string())
            .map(Value::Number)
            .ok_or_else(|| format!("the number {n} cannot be read")),
        serde_json::Value::Null => Err("the value is null, not a string, number or boolean".into()),
        serde_json::Value::Array(_) | serde_json::Value::Object(_) => {
            Err("the value is an array or an object, not a string, number or boolean".into())
        }
    }
}

/// The canonical form of a JSON number's text: `-`? significant digits, then `e` and the
/// exponent when it is not zero — `1`, `1.0`, `10e-1` and `0.1e1` are all `1`; `-0` is `0`;
/// `123456789012345678901234567890` stays exactly that. `None` for text that is not a number.
pub(crate) fn canonical_number(text: &str) -> Option<String> {
    use std::fmt::Write;
    let (negative, rest) = match text.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, text),
    };
    let (mantissa, exponent) = match rest.find(['e', 'E']) {
        Some(i) => (&rest[..i], rest[i + 1..].parse::<i64>().ok()?),
        None => (rest, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    if int.is_empty() || !int.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    // value = digits × 10^(exponent − len(frac)), the digits those of `int` then `frac`,
    // read in place (no string of them is built).
    let digits = || int.bytes().chain(frac.bytes());
    let total = int.len() + frac.len();
    let Some(leading) = digits().position(|b| b != b'0') else {
        return Some("0".into());
    };
    let trailing = digits().rev().position(|b| b != b'0').unwrap_or(0);
    let exp = exponent
        .checked_sub(i64::try_from(frac.len()).ok()?)?
        .checked_add(i64::try_from(trailing).ok()?)?;
    let mut out = String::with_capacity(total - leading - trailing + 24);
    if negative {
        out.push('-');
    }
    out.extend(
        digits()
            .skip(leading)
            .take(total - leading - trailing)
            .map(char::from),
    );
    if exp != 0 {
        // Writing into a `String` cannot fail.
        let _ = write!(out, "e{exp}");
    }
    Some(out)
}

/// The derived key: `derived-` + hex SHA-256 over the scope values and the (part, value)
/// pairs, every piece tagged and length-prefixed so no two different inputs hash alike.
pub fn derived_key(
    parts: &[KeyPart],
    values: &[Value],
    scope: &[HeaderName],
    headers: &HeaderMap,
) -> String {
    let mut h = Sha256::new();
    h.update(b"idemproxy-derived-v1");
    h.update(crate::key::key_id(scope, headers, ""));
    h.update((parts.len() as u64).to_be_bytes());
    for (part, value) in parts.iter().zip(values) {
        h.update([tag(part)]);
        h.update((name(part).len() as u64).to_be_bytes());
        h.update(name(part));
        value.encode(&mut h);
    }
    let mut hex = [0u8; 64];
    // 32 bytes always fit 64 hex digits.
    let _ = hex::encode_to_slice(h.finalize(), &mut hex);
    let mut key = String::with_capacity(8 + hex.len());
    key.push_str("derived-");
    key.extend(hex.iter().map(|&b| char::from(b)));
    key
}

/// The tag that stands for a part's kind in the derived key's hash.
fn tag(part: &KeyPart) -> u8 {
    match part {
        KeyPart::Path(_) => b'p',
        KeyPart::Json(_) => b'j',
        KeyPart::Query(_) => b'q',
        KeyPart::Header(_) => b'h',
        KeyPart::Method => b'm',
    }
}

/// A part's argument (a name or a pointer), as hashed into the derived key.
fn name(part: &KeyPart) -> &[u8] {
    match part {
        KeyPart::Path(n) | KeyPart::Json(n) | KeyPart::Query(n) => n.as_bytes(),
        KeyPart::Header(h) => h.as_str().as_bytes(),
        KeyPart::Method => b"",
    }
}

/// The body as canonical JSON — object keys sorted, no whitespace, numbers canonical — so that
/// a job that re-serialises the same payload has the same fingerprint. `None` when the body is
/// not JSON.
pub(crate) fn canonical_json(body: &[u8]) -> Option<Vec<u8>> {
    let raw: &RawValue = serde_json::from_slice(body).ok()?;
    let mut out = Vec::with_capacity(body.len());
    canonical_raw(raw, None, &mut out).ok()?;
    Some(out)
}

fn write_string(s: &str, out: &mut Vec<u8>) {
    // Writing a str into a `Vec` cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

/// The store id of a derived key: hashed under a domain of its own, so that a client sending
/// the text `derived-…` as its key header never lands on a derived record.
pub fn derived_id(derived: &str) -> crate::key::KeyId {
    let mut h = Sha256::new();
    h.update(b"idemproxy-derived-id-v1");
    h.update((derived.len() as u64).to_be_bytes());
    h.update(derived.as_bytes());
    h.finalize().into()
}

/// The values of the query parameter `name`, each decoded to the bytes it stands for (`+` is
/// a space, `%XX` a byte). Not through a UTF-8 string: a lossy decoding would map `%FF` and
/// `%FE` to the same U+FFFD, and two different values would derive one key (SPEC §4.1).
fn query_values<'a>(query: &'a str, name: &'a [u8]) -> impl Iterator<Item = Vec<u8>> + 'a {
    query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .filter_map(move |pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (form_decode(k) == name).then(|| form_decode(v))
        })
}

/// `application/x-www-form-urlencoded` decoding to bytes: `+` is a space, then `%XX`.
fn form_decode(raw: &str) -> Vec<u8> {
    if raw.contains('+') {
        percent_decode(&raw.replace('+', " "))
    } else {
        percent_decode(raw)
    }
}

/// Percent-decoding to bytes (never through a UTF-8 string, which would be lossy); a `%` that
/// starts no valid escape stands for itself.
fn percent_decode(raw: &str) -> Vec<u8> {
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
            if let Some(b) = hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests;
