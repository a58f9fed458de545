//! `key::parse` and `key::from_headers` on arbitrary bytes.
//!
//! Invariants: never panics; the answer agrees with an independent model of SPEC §4.1 (an
//! accepted key is 1 to 255 bytes of 0x21–0x7E, plus spaces only from the quoted form); the
//! quoted and bare forms of an accepted key give the same key; one header line is parsed, none
//! is `Missing`, two or more are `Repeated`.
#![no_main]

use http::{HeaderMap, HeaderName, HeaderValue};
use idemproxy::key::{self, KeyError};
use idemproxy_fuzz::check_key_value;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The whole input as one value, when `http` accepts it as a header value.
    if let Ok(value) = HeaderValue::from_bytes(data) {
        check_key_value(&value);
    }

    // The input as several lines of the header: `\n` never occurs in a header value, so it
    // separates them; pieces `http` refuses are dropped.
    let name = HeaderName::from_static("idempotency-key");
    let values: Vec<HeaderValue> = data
        .split(|b| *b == b'\n')
        .filter_map(|piece| HeaderValue::from_bytes(piece).ok())
        .collect();
    let mut headers = HeaderMap::new();
    for v in &values {
        headers.append(name.clone(), v.clone());
    }
    // Other headers must not matter.
    headers.append("idempotency-key-2", HeaderValue::from_static("x"));
    let got = key::from_headers(&headers, &name);
    match (values.len(), &got) {
        (0, Err(KeyError::Missing(n))) | (2.., Err(KeyError::Repeated(n))) => assert_eq!(n, &name),
        (1, _) => {
            let want = key::parse(&values[0]).map_err(|why| KeyError::Invalid {
                header: name.clone(),
                why,
            });
            assert_eq!(got, want);
        }
        (n, _) => panic!("{n} header lines gave {got:?}"),
    }
    if let Err(e) = &got {
        assert!(!e.to_string().is_empty());
    }
});
