//! Checks shared by the fuzz targets: an independent model of the key rules (SPEC §4.1) and the
//! invariants every configuration load must keep.
//!
//! The key model is written from SPEC, not from `src/key.rs`, so that a target comparing the two
//! finds a disagreement instead of repeating the same mistake.

use http::HeaderValue;
use std::time::{Duration, Instant};

use idemproxy::config::{Config, ConfigErrors, bounds};
use idemproxy::key::{self, MAX_KEY_LEN};

/// RFC 8941 sf-string: `"`, then printable ASCII (0x20–0x7E) where `"` and `\` appear only
/// escaped as `\"` and `\\`, then `"`. Returns the unescaped content, or `None` when `bytes` is
/// not exactly one sf-string.
pub fn sf_string(bytes: &[u8]) -> Option<Vec<u8>> {
    if bytes.len() < 2 || bytes[0] != b'"' || bytes[bytes.len() - 1] != b'"' {
        return None;
    }
    let inner = &bytes[1..bytes.len() - 1];
    let mut out = Vec::with_capacity(inner.len());
    let mut i = 0;
    while i < inner.len() {
        match inner[i] {
            b'\\' if matches!(inner.get(i + 1), Some(b'"' | b'\\')) => {
                out.push(inner[i + 1]);
                i += 2;
            }
            b'\\' | b'"' => return None,
            b @ 0x20..=0x7e => {
                out.push(b);
                i += 1;
            }
            _ => return None,
        }
    }
    Some(out)
}

/// The quoted (sf-string) form of a key.
pub fn quote(key: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(key.len() + 2);
    out.push(b'"');
    for &b in key {
        if b == b'"' || b == b'\\' {
            out.push(b'\\');
        }
        out.push(b);
    }
    out.push(b'"');
    out
}

/// What SPEC §4.1 says one header value means: `Some(key)` or `None` (refused).
pub fn expected_key(value: &[u8]) -> Option<Vec<u8>> {
    let visible = |b: &u8| (0x21..=0x7e).contains(b);
    let (key, quoted) = match sf_string(value) {
        Some(inner) => (inner, true),
        None => (value.to_vec(), false),
    };
    let ok = (1..=MAX_KEY_LEN).contains(&key.len())
        && key.iter().all(|b| visible(b) || (quoted && *b == b' '));
    ok.then_some(key)
}

/// The key rules an accepted key must keep, whatever code path accepted it: 1 to 255 bytes of
/// visible ASCII, and spaces only when the header value was the quoted form.
pub fn assert_key_rules(key: &str, header_value: &[u8]) {
    let b = key.as_bytes();
    assert!(
        (1..=MAX_KEY_LEN).contains(&b.len()),
        "accepted a key of {} bytes",
        b.len()
    );
    assert!(
        b.iter().all(|c| (0x21..=0x7e).contains(c) || *c == b' '),
        "accepted a key with a byte outside 0x20..=0x7e: {key:?}"
    );
    if b.contains(&b' ') {
        assert!(
            sf_string(header_value).is_some(),
            "accepted a key with a space from a value that is not a quoted string: {:?}",
            String::from_utf8_lossy(header_value)
        );
    }
}

/// Parses one header value and checks the result against the SPEC model, then checks that the
/// other form of an accepted key means the same key.
pub fn check_key_value(value: &HeaderValue) {
    let raw = value.as_bytes();
    let got = key::parse(value);
    let want = expected_key(raw);
    match (&got, &want) {
        (Ok(k), Some(w)) => assert_eq!(k.as_bytes(), &w[..], "key of {raw:?}"),
        (Err(why), None) => assert!(!why.is_empty(), "a refusal without a reason"),
        _ => panic!("key::parse({raw:?}) = {got:?}, SPEC says {want:?}"),
    }
    let Ok(key) = got else { return };
    assert_key_rules(&key, raw);

    // The quoted form of any accepted key is the same key.
    let quoted = HeaderValue::from_bytes(&quote(key.as_bytes()))
        .expect("a quoted key is a valid header value");
    assert_eq!(
        key::parse(&quoted).as_deref(),
        Ok(key.as_str()),
        "the quoted form {quoted:?} of {key:?} is another key"
    );
    // The bare form of a key that has one (no space, and not itself a quoted string, which
    // would read as the quoted form) is the same key.
    if !key.contains(' ') && sf_string(key.as_bytes()).is_none() {
        let bare =
            HeaderValue::from_str(&key).expect("a visible-ASCII key is a valid header value");
        assert_eq!(
            key::parse(&bare).as_deref(),
            Ok(key.as_str()),
            "the bare form of {key:?} is another key"
        );
    }
}

/// Loads `text` twice and checks what every load must keep: no panic, every error named with a
/// non-empty message, and the same answer both times. Returns the first result.
pub fn check_config(text: &str) -> Result<Config, ConfigErrors> {
    let first = Config::from_yaml(text);
    match &first {
        Err(errors) => {
            assert!(!errors.0.is_empty(), "a failed load with no error");
            for e in &errors.0 {
                assert!(
                    !e.message.trim().is_empty(),
                    "an error without a message: {e:?}"
                );
            }
            assert!(!errors.to_string().trim().is_empty());
        }
        Ok(config) => {
            assert_within_bounds(config);
            assert!(!config.routes.is_empty(), "a config without routes loaded");
            for (i, r) in config.routes.iter().enumerate() {
                assert!(
                    config.upstreams.contains_key(&r.upstream),
                    "routes[{i}] names an unknown upstream"
                );
                assert!(
                    config.routes[..i].iter().all(|o| o.name != r.name),
                    "duplicate route name loaded"
                );
            }
        }
    }
    let second = Config::from_yaml(text);
    assert_eq!(
        format!("{first:?}"),
        format!("{second:?}"),
        "two loads of one text disagree"
    );
    first
}

/// A loaded configuration keeps `config::bounds`, and every deadline the proxy computes from it
/// (`now + duration`) fits the clock: a config that loads must not panic the server later.
pub fn assert_within_bounds(config: &Config) {
    let now = Instant::now();
    let check = |what: &str, value: Duration, max: Duration| {
        assert!(
            value <= max,
            "{what} = {value:?} loaded, over its bound {max:?}"
        );
        assert!(
            now.checked_add(value).is_some(),
            "{what} = {value:?} overflows the clock"
        );
    };
    check(
        "shutdown_timeout",
        config.shutdown_timeout,
        bounds::SHUTDOWN_TIMEOUT,
    );
    check("store.timeout", config.store.timeout, bounds::STORE_TIMEOUT);
    check(
        "limits.header_read_timeout",
        config.limits.header_read_timeout,
        bounds::HEADER_READ_TIMEOUT,
    );
    check(
        "limits.body_read_timeout",
        config.limits.body_read_timeout,
        bounds::BODY_READ_TIMEOUT,
    );
    for (name, up) in &config.upstreams {
        check(
            &format!("upstreams.{name}.connect_timeout"),
            up.connect_timeout,
            bounds::CONNECT_TIMEOUT,
        );
        check(
            &format!("upstreams.{name}.timeout"),
            up.timeout,
            bounds::UPSTREAM_TIMEOUT,
        );
        check(
            &format!("upstreams.{name}.pool_idle_timeout"),
            up.pool_idle_timeout,
            bounds::POOL_IDLE_TIMEOUT,
        );
    }
    for r in &config.routes {
        let Some(i) = &r.idempotency else { continue };
        let name = &r.name;
        check(&format!("{name}.ttl"), i.ttl, bounds::TTL);
        check(&format!("{name}.lock_ttl"), i.lock_ttl, bounds::LOCK_TTL);
        check(
            &format!("{name}.wait_timeout"),
            i.wait_timeout,
            bounds::WAIT_TIMEOUT,
        );
        assert!(
            !i.ttl.is_zero() && !i.lock_ttl.is_zero(),
            "{name}: a zero ttl or lock_ttl loaded"
        );
        assert!(
            (1..=bounds::BODY).contains(&i.max_request_body) && i.max_response_body <= bounds::BODY,
            "{name}: body bounds out of range"
        );
    }
    assert!(
        u64::from(config.limits.max_connections) <= bounds::COUNT
            && config.limits.max_pending_save_bytes <= bounds::PENDING_SAVE_BYTES,
        "limits out of range"
    );
}
