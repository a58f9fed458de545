//! Properties of the pure parts, over generated inputs: the key (SPEC §4.1), the fingerprint,
//! the store key, the record encoding, and the config's size and duration parsers.

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, Request, StatusCode};
use idemproxy::config::{Config, FingerprintPart, parse_duration, parse_size};
use idemproxy::fingerprint;
use idemproxy::key::{self, KeyError};
use std::time::Duration;

use idemproxy::record::{Lookup, Phase, Record, Resolvable, Saved, SavedResponse};
use proptest::prelude::*;

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 256,
        ..ProptestConfig::default()
    }
}

/// A valid key: 1 to 255 visible ASCII characters (0x21–0x7E).
fn valid_key() -> impl Strategy<Value = String> {
    proptest::collection::vec(0x21u8..=0x7e, 1..=255)
        .prop_map(|b| String::from_utf8(b).expect("ASCII"))
}

/// A valid key of the quoted form only: spaces allowed too (0x20–0x7E).
fn valid_quoted_key() -> impl Strategy<Value = String> {
    proptest::collection::vec(0x20u8..=0x7e, 1..=255)
        .prop_map(|b| String::from_utf8(b).expect("ASCII"))
}

/// The Structured Field string form of `key`: `"` and `\` escaped.
fn quote(key: &str) -> String {
    let mut s = String::with_capacity(key.len() + 2);
    s.push('"');
    for c in key.chars() {
        if c == '"' || c == '\\' {
            s.push('\\');
        }
        s.push(c);
    }
    s.push('"');
    s
}

/// Whether a bare value also reads as a well-formed quoted string (`"abc"`): such a value *is*
/// the quoted form of another key, so it cannot be that bare key as well.
fn reads_as_quoted(bare: &str) -> bool {
    let Some(inner) = bare.strip_prefix('"').and_then(|s| s.strip_suffix('"')) else {
        return false;
    };
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some('"' | '\\') => {}
                _ => return false,
            },
            '"' => return false,
            _ => {}
        }
    }
    true
}

fn hv(bytes: &[u8]) -> HeaderValue {
    HeaderValue::from_bytes(bytes).expect("a header value")
}

fn key_header() -> HeaderName {
    HeaderName::from_static("idempotency-key")
}

fn headers_with(name: &HeaderName, value: HeaderValue) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(name.clone(), value);
    h
}

/// A byte no bare key may contain: space, tab, other control characters, DEL, non-ASCII.
fn bad_bare_byte() -> impl Strategy<Value = u8> {
    prop_oneof![
        Just(b' '),
        Just(b'\t'),
        0x00u8..0x20,
        Just(0x7f),
        0x80u8..=0xff
    ]
}

/// A byte no quoted key may contain: anything outside 0x20–0x7E.
fn bad_quoted_byte() -> impl Strategy<Value = u8> {
    prop_oneof![Just(b'\t'), 0x00u8..0x20, Just(0x7f), 0x80u8..=0xff]
}

fn default_parts() -> Vec<FingerprintPart> {
    vec![
        FingerprintPart::Method,
        FingerprintPart::Path,
        FingerprintPart::Query,
        FingerprintPart::Body,
    ]
}

/// A request as the fingerprint sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Req {
    method: String,
    path: String,
    query: String,
    body: Vec<u8>,
}

impl Req {
    fn head(&self) -> Parts {
        let uri = if self.query.is_empty() {
            self.path.clone()
        } else {
            format!("{}?{}", self.path, self.query)
        };
        Request::builder()
            .method(self.method.as_str())
            .uri(uri)
            .header("authorization", "Bearer x")
            .body(())
            .expect("a request")
            .into_parts()
            .0
    }

    fn fingerprint(&self) -> fingerprint::Fingerprint {
        fingerprint::compute(&default_parts(), &self.head(), &self.body)
    }
}

fn method() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("GET".to_owned()),
        Just("POST".to_owned()),
        Just("PUT".to_owned()),
        Just("PATCH".to_owned()),
        Just("DELETE".to_owned()),
        "[A-Z]{1,10}",
    ]
}

fn request() -> impl Strategy<Value = Req> {
    (
        method(),
        "(/[a-zA-Z0-9._~-]{0,12}){1,4}",
        "[a-zA-Z0-9=&%._-]{0,24}",
        proptest::collection::vec(any::<u8>(), 0..512),
    )
        .prop_map(|(method, path, query, body)| Req {
            method,
            path,
            query,
            body,
        })
}

fn header_name() -> impl Strategy<Value = HeaderName> {
    "[a-z][a-z0-9-]{0,20}".prop_map(|s| HeaderName::from_bytes(s.as_bytes()).expect("a name"))
}

/// Any byte sequence `HeaderValue` accepts: visible ASCII, space, tab, and obs-text.
fn header_value() -> impl Strategy<Value = HeaderValue> {
    proptest::collection::vec(
        prop_oneof![0x20u8..=0x7e, Just(b'\t'), 0x80u8..=0xff],
        0..64,
    )
    .prop_map(|b| HeaderValue::from_bytes(&b).expect("a value"))
}

fn status() -> impl Strategy<Value = StatusCode> {
    (100u16..=599).prop_map(|s| StatusCode::from_u16(s).expect("a status"))
}

fn response() -> impl Strategy<Value = SavedResponse> {
    (
        status(),
        proptest::collection::vec((header_name(), header_value()), 0..12),
        proptest::collection::vec(any::<u8>(), 0..4096),
    )
        .prop_map(|(status, headers, body)| SavedResponse {
            status,
            headers,
            body: Bytes::from(body),
        })
}

/// A claim of a `resolve` route, in either format it is read in: version 3 (what this proxy
/// writes, with its `found` and `absent` statuses) or version 2 (`legacy`, written by earlier
/// proxies: no statuses).
fn resolvable() -> impl Strategy<Value = Resolvable> {
    let times = (
        any::<[u8; 16]>(),
        proptest::array::uniform5(any::<u64>()),
        any::<bool>(),
        any::<[u8; 32]>(),
        proptest::array::uniform3(any::<u64>()),
    );
    let lookup = (
        "[a-z][a-z0-9_-]{0,30}",
        method(),
        "(/[a-zA-Z0-9%._~-]{0,20}){1,4}(\\?[a-z=&0-9]{0,20})?",
        proptest::collection::vec((header_name(), header_value()), 0..6),
    )
        .prop_map(|(upstream, method, target, headers)| Lookup {
            upstream,
            method: http::Method::from_bytes(method.as_bytes()).expect("a method"),
            target,
            headers,
        });
    let statuses = (
        any::<bool>(),
        proptest::collection::vec(100u16..=599, 1..4),
        proptest::collection::vec(100u16..=599, 0..4),
    );
    (times, lookup, statuses).prop_map(
        |((token, at, resolving, fingerprint, durations), lookup, (legacy, found, absent))| {
            Resolvable {
                token,
                lease_until: at[0],
                claimed_at: at[1],
                sent_at: at[2],
                phase: if resolving {
                    Phase::Resolving
                } else {
                    Phase::InFlight
                },
                next_lookup_at: at[3] ^ at[4],
                fingerprint,
                settle_after: Duration::from_millis(durations[0]),
                interval: Duration::from_millis(durations[1]),
                give_up_after: Duration::from_millis(durations[2]),
                lookup,
                // A version 2 record carries no statuses: it is read with none.
                found: if legacy { Vec::new() } else { found },
                absent: if legacy { Vec::new() } else { absent },
                legacy,
            }
        },
    )
}

fn entry() -> impl Strategy<Value = Record> {
    let trailed = (
        response(),
        proptest::collection::vec((header_name(), header_value()), 0..4),
    )
        .prop_map(|(response, trailers)| Saved::Trailed { response, trailers });
    let saved = prop_oneof![
        4 => response().prop_map(Saved::Response),
        1 => status().prop_map(|status| Saved::NotReplayable { status }),
        1 => response().prop_map(Saved::Resolved),
        1 => trailed,
    ];
    prop_oneof![
        (any::<[u8; 16]>(), any::<[u8; 32]>())
            .prop_map(|(token, fingerprint)| Record::InFlight { token, fingerprint }),
        (any::<[u8; 32]>(), saved)
            .prop_map(|(fingerprint, saved)| Record::Finished { fingerprint, saved }),
        resolvable().prop_map(|r| Record::Resolvable(Box::new(r))),
    ]
}

/// The first bytes a record is written with: its format version and kind.
fn prefix(record: &Record) -> &'static [u8] {
    match record {
        Record::InFlight { .. } => b"IDP\x01P",
        Record::Resolvable(r) if r.legacy => b"IDP\x02Q",
        Record::Resolvable(_) => b"IDP\x03Q",
        Record::Finished {
            saved: Saved::Resolved(_),
            ..
        } => b"IDP\x02D",
        Record::Finished { .. } => b"IDP\x01D",
    }
}

proptest! {
    #![proptest_config(config())]

    // ---- The key (SPEC §4.1) -------------------------------------------------------------

    #[test]
    fn bare_and_quoted_forms_are_the_same_key(k in valid_key()) {
        let quoted = key::parse(&hv(quote(&k).as_bytes()));
        prop_assert_eq!(quoted.as_deref(), Ok(k.as_str()));
        if !reads_as_quoted(&k) {
            let bare = key::parse(&hv(k.as_bytes()));
            prop_assert_eq!(&bare, &quoted);
        }
    }

    #[test]
    fn bare_and_quoted_forms_give_the_same_store_key(
        k in valid_key(),
        auth in header_value(),
    ) {
        prop_assume!(!reads_as_quoted(&k));
        let name = key_header();
        let scope = [HeaderName::from_static("authorization")];
        let mut bare = headers_with(&name, hv(k.as_bytes()));
        bare.insert("authorization", auth.clone());
        let mut quoted = headers_with(&name, hv(quote(&k).as_bytes()));
        quoted.insert("authorization", auth);
        let kb = key::from_headers(&bare, &name).expect("bare key");
        let kq = key::from_headers(&quoted, &name).expect("quoted key");
        let sb = harness::store_key("idemproxy:", "create-booking", &scope, &bare, &kb);
        let sq = harness::store_key("idemproxy:", "create-booking", &scope, &quoted, &kq);
        prop_assert_eq!(&sb, &sq);
        prop_assert!(sb.starts_with("idemproxy:create-booking:"));
        prop_assert_eq!(sb.len(), "idemproxy:create-booking:".len() + 64);
        // The raw key never appears in the store key (long enough not to be found by chance
        // among 64 hex digits).
        if k.len() >= 8 {
            prop_assert!(!sb.contains(&k));
        }
    }

    #[test]
    fn quoted_keys_may_contain_spaces(k in valid_quoted_key()) {
        prop_assert_eq!(key::parse(&hv(quote(&k).as_bytes())), Ok(k));
    }

    #[test]
    fn keys_longer_than_255_are_refused(
        k in proptest::collection::vec(0x21u8..=0x7e, 256..=600)
            .prop_map(|b| String::from_utf8(b).expect("ASCII")),
    ) {
        prop_assert!(key::parse(&hv(quote(&k).as_bytes())).is_err(), "quoted");
        // A bare value that reads as a quoted string is judged by what it unquotes to.
        prop_assume!(!reads_as_quoted(&k));
        prop_assert!(key::parse(&hv(k.as_bytes())).is_err(), "bare");
    }

    #[test]
    fn quoted_keys_longer_than_255_are_refused(k in valid_quoted_key(), extra in 1usize..100) {
        let long: String = k.chars().cycle().take(255 + extra).collect();
        prop_assert!(key::parse(&hv(quote(&long).as_bytes())).is_err());
    }

    #[test]
    fn a_bare_key_with_any_other_byte_is_refused(
        before in proptest::collection::vec(0x21u8..=0x7e, 0..100),
        bad in bad_bare_byte(),
        after in proptest::collection::vec(0x21u8..=0x7e, 0..100),
    ) {
        let mut v = before;
        v.push(bad);
        v.extend(after);
        // Control characters and DEL cannot even be in a header value; the HTTP layer refuses
        // them before the key parser sees them.
        if let Ok(value) = HeaderValue::from_bytes(&v) {
            // A space is allowed inside a quoted string, so `"a b"` is a valid quoted key.
            let text = String::from_utf8_lossy(&v).into_owned();
            prop_assume!(!(bad == b' ' && reads_as_quoted(&text)));
            prop_assert!(key::parse(&value).is_err(), "{:?}", value);
            let h = headers_with(&key_header(), value);
            let refused = matches!(
                key::from_headers(&h, &key_header()),
                Err(KeyError::Invalid { .. })
            );
            prop_assert!(refused);
        }
    }

    #[test]
    fn a_quoted_key_with_a_byte_outside_0x20_to_0x7e_is_refused(
        before in proptest::collection::vec(0x20u8..=0x7e, 0..100),
        bad in bad_quoted_byte(),
        after in proptest::collection::vec(0x20u8..=0x7e, 0..100),
    ) {
        let mut inner = before;
        inner.push(bad);
        inner.extend(after);
        let mut v = vec![b'"'];
        for b in inner {
            if b == b'"' || b == b'\\' {
                v.push(b'\\');
            }
            v.push(b);
        }
        v.push(b'"');
        if let Ok(value) = HeaderValue::from_bytes(&v) {
            prop_assert!(key::parse(&value).is_err(), "{:?}", value);
        }
    }

    #[test]
    fn empty_keys_and_repeated_headers_are_refused(k in valid_key(), j in valid_key()) {
        prop_assert!(key::parse(&hv(b"")).is_err());
        prop_assert!(key::parse(&hv(b"\"\"")).is_err());
        let name = key_header();
        let mut h = HeaderMap::new();
        h.append(name.clone(), hv(k.as_bytes()));
        h.append(name.clone(), hv(j.as_bytes()));
        prop_assert!(matches!(key::from_headers(&h, &name), Err(KeyError::Repeated(_))));
        prop_assert!(matches!(
            key::from_headers(&HeaderMap::new(), &name),
            Err(KeyError::Missing(_))
        ));
    }

    // ---- The fingerprint -------------------------------------------------------------------

    #[test]
    fn equal_requests_have_equal_fingerprints(r in request()) {
        let again = r.clone();
        prop_assert_eq!(r.fingerprint(), again.fingerprint());
    }

    #[test]
    fn different_bodies_give_different_fingerprints(
        r in request(),
        other in proptest::collection::vec(any::<u8>(), 0..512),
    ) {
        prop_assume!(other != r.body);
        let changed = Req { body: other, ..r.clone() };
        prop_assert_ne!(r.fingerprint(), changed.fingerprint());
    }

    #[test]
    fn different_methods_paths_or_queries_give_different_fingerprints(
        r in request(),
        s in request(),
    ) {
        if s.method != r.method {
            let changed = Req { method: s.method.clone(), ..r.clone() };
            prop_assert_ne!(r.fingerprint(), changed.fingerprint(), "method");
        }
        if s.path != r.path {
            let changed = Req { path: s.path.clone(), ..r.clone() };
            prop_assert_ne!(r.fingerprint(), changed.fingerprint(), "path");
        }
        if s.query != r.query {
            let changed = Req { query: s.query.clone(), ..r.clone() };
            prop_assert_ne!(r.fingerprint(), changed.fingerprint(), "query");
        }
    }

    #[test]
    fn moving_bytes_between_parts_changes_the_fingerprint(
        r in request(),
        n in 1usize..8,
    ) {
        // Query "ab" + body "c" is not query "a" + body "bc": every part is length-prefixed.
        prop_assume!(r.query.len() >= n);
        let split = r.query.len() - n;
        let mut body = r.query.as_bytes()[split..].to_vec();
        body.extend_from_slice(&r.body);
        let moved = Req { query: r.query[..split].to_owned(), body, ..r.clone() };
        prop_assert_ne!(r.fingerprint(), moved.fingerprint());
    }

    // ---- Store keys ------------------------------------------------------------------------

    #[test]
    fn store_keys_differ_when_scope_values_differ(
        k in valid_key(),
        a in header_value(),
        b in header_value(),
    ) {
        prop_assume!(a != b);
        let scope = [HeaderName::from_static("authorization")];
        let ha = headers_with(&HeaderName::from_static("authorization"), a);
        let hb = headers_with(&HeaderName::from_static("authorization"), b);
        let none = HeaderMap::new();
        let sa = harness::store_key("idemproxy:", "r", &scope, &ha, &k);
        let sb = harness::store_key("idemproxy:", "r", &scope, &hb, &k);
        let sn = harness::store_key("idemproxy:", "r", &scope, &none, &k);
        prop_assert_ne!(&sa, &sb);
        prop_assert_ne!(&sa, &sn, "absent and present scope headers are different callers");
        // With no scope, every caller shares the key.
        prop_assert_eq!(
            harness::store_key("idemproxy:", "r", &[], &ha, &k),
            harness::store_key("idemproxy:", "r", &[], &hb, &k)
        );
    }

    #[test]
    fn store_keys_differ_by_key_and_by_route(
        k in valid_key(),
        j in valid_key(),
        auth in header_value(),
    ) {
        let scope = [HeaderName::from_static("authorization")];
        let h = headers_with(&HeaderName::from_static("authorization"), auth);
        let base = harness::store_key("p:", "route-a", &scope, &h, &k);
        if j != k {
            prop_assert_ne!(&base, &harness::store_key("p:", "route-a", &scope, &h, &j));
        }
        let other_route = harness::store_key("p:", "route-b", &scope, &h, &k);
        prop_assert_ne!(&base, &other_route);
        prop_assert!(other_route.starts_with("p:route-b:"));
    }

    #[test]
    fn scope_values_cannot_be_shifted_into_each_other(
        a in "[a-zA-Z0-9]{2,16}",
        b in "[a-zA-Z0-9]{1,16}",
        n in any::<prop::sample::Index>(),
        k in valid_key(),
    ) {
        // ("ab", "c") and ("a", "bc") are different callers: every value is length-prefixed.
        let n = 1 + n.index(a.len() - 1);
        let scope = [HeaderName::from_static("x-a"), HeaderName::from_static("x-b")];
        let make = |x: &str, y: &str| {
            let mut h = HeaderMap::new();
            h.insert("x-a", hv(x.as_bytes()));
            h.insert("x-b", hv(y.as_bytes()));
            harness::store_key("idemproxy:", "r", &scope, &h, &k)
        };
        let (head, tail) = a.split_at(a.len() - n);
        let shifted = format!("{tail}{b}");
        prop_assert_ne!(make(&a, &b), make(head, &shifted));
    }

    // ---- The record encoding ---------------------------------------------------------------

    #[test]
    fn records_round_trip(e in entry()) {
        let bytes = e.encode();
        prop_assert!(bytes.starts_with(prefix(&e)), "versioned: {:?}", &bytes[..5]);
        prop_assert_eq!(Record::decode(&bytes), Ok(e));
    }

    #[test]
    fn decoding_arbitrary_bytes_never_panics(
        bytes in prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..512),
            // Past the magic and version, so the decoder's inner paths are reached too.
            (
                1u8..=3,
                prop_oneof![Just(b'P'), Just(b'D'), Just(b'Q'), any::<u8>()],
                proptest::collection::vec(any::<u8>(), 0..512),
            )
                .prop_map(|(version, kind, rest)| {
                    let mut v = b"IDP".to_vec();
                    v.push(version);
                    v.push(kind);
                    v.extend(rest);
                    v
                }),
        ],
    ) {
        let _ = Record::decode(&bytes);
    }

    #[test]
    fn damaged_records_never_panic_and_truncation_is_detected(
        e in entry(),
        cut in any::<prop::sample::Index>(),
        flip in any::<prop::sample::Index>(),
        mask in 1u8..=255,
    ) {
        let bytes = e.encode().to_vec();
        let n = cut.index(bytes.len());
        prop_assert!(Record::decode(&bytes[..n]).is_err(), "truncated at {}", n);
        let mut extra = bytes.clone();
        extra.push(0);
        prop_assert!(Record::decode(&extra).is_err(), "trailing byte");
        let mut damaged = bytes;
        let i = flip.index(damaged.len());
        damaged[i] ^= mask;
        let _ = Record::decode(&damaged);
    }

    // ---- The configuration parsers ---------------------------------------------------------

    #[test]
    fn size_and_duration_parsers_never_panic(s in any::<String>()) {
        let _ = parse_size(&s);
        let _ = parse_duration(&s);
    }

    #[test]
    fn size_parser_handles_huge_and_unit_forms(
        digits in "[0-9]{1,30}",
        unit in prop_oneof![
            Just(""), Just("B"), Just("KB"), Just("KiB"), Just("MB"), Just("MiB"),
            Just("GB"), Just("GiB"), Just(" KiB"), Just("TiB"), Just("kib")
        ],
    ) {
        let text = format!("{digits}{unit}");
        if let Ok(n) = parse_size(&text) {
            // Whatever is accepted is the number times its unit, without overflow.
            let base: u64 = digits.parse().expect("accepted digits fit in u64");
            let mult = match unit.trim() {
                "" | "B" => 1,
                "KB" => 1000,
                "KiB" => 1024,
                "MB" => 1_000_000,
                "MiB" => 1 << 20,
                "GB" => 1_000_000_000,
                "GiB" => 1 << 30,
                other => panic!("unit {other:?} must be refused"),
            };
            prop_assert_eq!(Some(n), base.checked_mul(mult));
        }
    }

    #[test]
    fn duration_parser_handles_numbers_with_and_without_units(
        n in 0u64..1_000_000,
        unit in prop_oneof![Just("ms"), Just("s"), Just("m"), Just("h")],
    ) {
        prop_assert!(parse_duration(&n.to_string()).is_err(), "a bare number has no unit");
        let d = parse_duration(&format!("{n}{unit}")).expect("a duration");
        let ms = match unit {
            "ms" => n,
            "s" => n * 1000,
            "m" => n * 60_000,
            _ => n * 3_600_000,
        };
        prop_assert_eq!(d.as_millis(), u128::from(ms));
    }

    #[test]
    fn the_config_loader_never_panics(text in "[ -~\n]{0,300}") {
        let _ = Config::from_yaml(&text);
    }

    #[test]
    fn the_config_loader_never_panics_on_damaged_files(
        cut in any::<prop::sample::Index>(),
        junk in "[ -~\n\t]{0,12}",
    ) {
        let example = include_str!("../../config.example.yaml");
        let at = cut.index(example.len());
        let at = (0..=at).rev().find(|i| example.is_char_boundary(*i)).unwrap_or(0);
        let text = format!("{}{}{}", &example[..at], junk, &example[at..]);
        let _ = Config::from_yaml(&text);
    }
}
