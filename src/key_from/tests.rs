use super::*;

/// The canonical form through a `serde_json::Value` tree, as it was computed before
/// [`canonical_raw`]: what the tests hold the raw writer to, byte for byte.
fn write_canonical(v: &serde_json::Value, out: &mut Vec<u8>) {
    match v {
        serde_json::Value::Null => out.extend_from_slice(b"null"),
        serde_json::Value::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
        serde_json::Value::Number(n) => {
            let text = n.to_string();
            out.extend_from_slice(canonical_number(&text).unwrap_or(text).as_bytes());
        }
        serde_json::Value::String(s) => write_string(s, out),
        serde_json::Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(item, out);
            }
            out.push(b']');
        }
        serde_json::Value::Object(map) => {
            // serde_json's map is ordered by key (no `preserve_order`); sort anyway, so the
            // canonical form never depends on a feature flag.
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            out.push(b'{');
            for (i, (k, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_string(k, out);
                out.push(b':');
                write_canonical(item, out);
            }
            out.push(b'}');
        }
    }
}

#[test]
fn numbers_compare_by_value_and_stay_exact() {
    for (a, b) in [
        ("1", "1.0"),
        ("1", "10e-1"),
        ("1", "0.1e1"),
        ("100", "1e2"),
        ("0", "-0"),
        ("0", "0.000"),
        ("-2.5", "-25e-1"),
    ] {
        assert_eq!(canonical_number(a), canonical_number(b), "{a} vs {b}");
    }
    assert_ne!(canonical_number("1"), canonical_number("2"));
    assert_ne!(
        canonical_number("9007199254740993"),
        canonical_number("9007199254740992"),
        "beyond 2^53, exact"
    );
    assert_eq!(
        canonical_number("123456789012345678901234567890").as_deref(),
        Some("12345678901234567890123456789e1")
    );
    assert_eq!(canonical_number("abc"), None);
}

#[test]
fn canonical_json_ignores_key_order_whitespace_and_number_spelling() {
    let a = canonical_json(br#"{"b": 1.0, "a": [true, null, "x"]}"#);
    let b = canonical_json(br#"{"a":[true,null,"x"],"b":1}"#);
    assert_eq!(a, b);
    assert_eq!(a.as_deref(), Some(&br#"{"a":[true,null,"x"],"b":1}"#[..]));
    assert_ne!(
        canonical_json(br#"{"b":"1"}"#),
        canonical_json(br#"{"b":1}"#)
    );
    assert_eq!(canonical_json(b"not json"), None);
}

/// JSON text as clients write it: numbers spelt every way, strings with escapes and
/// non-ASCII, names repeated, whitespace between tokens.
fn json_text() -> impl proptest::strategy::Strategy<Value = String> {
    use proptest::prelude::*;
    let leaf = prop_oneof![
        Just("null".to_owned()),
        Just("true".to_owned()),
        Just("false".to_owned()),
        any::<i64>().prop_map(|n| n.to_string()),
        (any::<i32>(), 0u32..1000, -30i32..30).prop_map(|(a, b, e)| format!("{a}.{b}e{e}")),
        Just("123456789012345678901234567890".to_owned()),
        Just("-0.0".to_owned()),
        "[a-c _\\\"é😀]{0,6}".prop_map(|s| serde_json::to_string(&s).unwrap_or_default()),
        Just(r#""\u00e9\n\/x""#.to_owned()),
    ];
    leaf.prop_recursive(4, 32, 5, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..5)
                .prop_map(|items| format!("[ {} ]", items.join(" , "))),
            proptest::collection::vec(("[a-c_]{0,2}|\\u0061|_meta", inner), 0..5).prop_map(
                |members| {
                    let members: Vec<String> = members
                        .iter()
                        .map(|(k, v)| format!("\"{k}\" :{v}"))
                        .collect();
                    format!("{{ {} }}", members.join(","))
                }
            ),
        ]
    })
}

proptest::proptest! {
    #[test]
    fn the_raw_canonical_form_is_the_trees(text in json_text()) {
        let tree: serde_json::Value = serde_json::from_str(&text).expect("generated JSON");
        let mut through_tree = Vec::new();
        write_canonical(&tree, &mut through_tree);
        let raw: &RawValue = serde_json::from_str(&text).expect("generated JSON");
        let mut from_text = Vec::new();
        canonical_raw(raw, None, &mut from_text).expect("readable");
        proptest::prop_assert_eq!(&from_text, &through_tree, "{}", text);
        // `_meta` left out at the top level only, as a call's params are read.
        let mut without_meta = Vec::new();
        canonical_raw(raw, Some("_meta"), &mut without_meta).expect("readable");
        let mut tree = tree;
        if let serde_json::Value::Object(map) = &mut tree {
            map.remove("_meta");
        }
        let mut through_tree = Vec::new();
        write_canonical(&tree, &mut through_tree);
        proptest::prop_assert_eq!(&without_meta, &through_tree, "{}", text);
    }

    #[test]
    fn a_pointer_finds_what_the_trees_pointer_finds(text in json_text(), path in proptest::collection::vec("[a-c_]{0,2}|0|1", 0..3)) {
        let pointer: String = path.iter().map(|t| format!("/{t}")).collect();
        let tree: serde_json::Value = serde_json::from_str(&text).expect("generated JSON");
        let raw: &RawValue = serde_json::from_str(&text).expect("generated JSON");
        let found = at_pointer(raw.get(), &pointer);
        proptest::prop_assert_eq!(found.as_ref(), tree.pointer(&pointer));
    }
}

/// [`canonical_number`] as it was first written (a string of the digits, then trimmed):
/// what the in-place reading is held to.
fn canonical_number_by_strings(text: &str) -> Option<String> {
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
    let digits = format!("{int}{frac}");
    let mut exp = exponent.checked_sub(i64::try_from(frac.len()).ok()?)?;
    let digits = digits.trim_start_matches('0');
    if digits.is_empty() {
        return Some("0".into());
    }
    let trimmed = digits.trim_end_matches('0');
    exp = exp.checked_add(i64::try_from(digits.len() - trimmed.len()).ok()?)?;
    let sign = if negative { "-" } else { "" };
    if exp == 0 {
        Some(format!("{sign}{trimmed}"))
    } else {
        Some(format!("{sign}{trimmed}e{exp}"))
    }
}

proptest::proptest! {
    #[test]
    fn a_number_reads_as_it_did_through_strings(text in "-?[0-9]{0,6}(\\.[0-9]{0,4})?([eE][+-]?[0-9]{1,3})?|-?0*|[0-9a-e.+-]{0,8}") {
        proptest::prop_assert_eq!(canonical_number(&text), canonical_number_by_strings(&text), "{}", text);
    }
}

#[test]
fn a_body_broken_anywhere_is_not_json_and_a_missing_value_is_named() {
    let pattern = PathPattern::parse("/bookings").expect("pattern");
    let parts = [KeyPart::Json("/ref".into())];
    let (head, ()) = http::Request::post("/bookings")
        .body(())
        .expect("request")
        .into_parts();
    let why = |body: &[u8]| read(&parts, &pattern, &head, body).map_err(|e| e.why);
    assert_eq!(
        why(br#"{"ref":"R-1"}"#),
        Ok(vec![Value::Text(b"R-1".to_vec())])
    );
    // Broken after the value the pointer finds, in a member it skips, or in its bytes.
    for broken in [
        &br#"{"ref":"R-1","x":}"#[..],
        br#"{"ref":"R-1"} trailing"#,
        br#"{"x":[1,2,"ref":"R-1"}"#,
        b"{\"ref\":\"R-\xff\"}",
        b"",
    ] {
        let why = why(broken).expect_err("not JSON");
        assert!(why.starts_with("the body is not JSON ("), "{why}");
    }
    assert_eq!(
        why(br#"{"reference":"R-1"}"#),
        Err("the body has nothing at this pointer".into())
    );
    assert_eq!(
        why(br#""R-1""#),
        Err("the body has nothing at this pointer".into())
    );
}

#[test]
fn a_number_that_overflows_a_float_is_still_read() {
    let raw: &RawValue = serde_json::from_str(r#"{"n":1e400}"#).expect("JSON");
    let mut out = Vec::new();
    assert!(canonical_raw(raw, None, &mut out).is_ok());
    assert_eq!(out, br#"{"n":1e400}"#);
}

#[test]
fn query_values_are_the_bytes_they_decode_to() {
    let values = |q: &'static str| query_values(q, b"ref").collect::<Vec<_>>();
    // Not UTF-8, and different: never one value (a lossy decode made both U+FFFD).
    assert_eq!(values("ref=%FF"), vec![vec![0xFF]]);
    assert_eq!(values("ref=%FE"), vec![vec![0xFE]]);
    assert_ne!(values("ref=%FF"), values("ref=%FE"));
    assert_eq!(values("a=1&ref=x+y&b"), vec![b"x y".to_vec()]);
    assert_eq!(values("r%65f=1&ref=2"), vec![b"1".to_vec(), b"2".to_vec()]);
    assert_eq!(values("ref"), vec![Vec::<u8>::new()]);
    assert!(values("refx=1&&=2").is_empty());
}

#[test]
fn a_lookup_is_rendered_from_the_request_with_every_value_encoded() {
    let pattern = PathPattern::parse("/t/{tenant}/bookings").expect("pattern");
    let template = LookupTemplate::parse(
        "GET /by-ref/{json:/reference}?k={key}&t={path:tenant}&n={json:/n}&q={query:x}&h={header:x-h}&b={json:/b}",
        Some(&pattern),
    )
    .expect("template");
    let req = http::Request::post("/t/a%2Fb/bookings?x=%FF+1")
        .header("x-h", "v w")
        .body(())
        .expect("request");
    let (head, ()) = req.into_parts();
    let body = br#"{"reference":"R:1 ?&%","n":1.50,"b":true}"#;
    let rendered = render_lookup(&template, &pattern, &head, body, "k 1");
    assert_eq!(
        rendered.as_deref(),
        Ok("/by-ref/R%3A1%20%3F%26%25?k=k%201&t=a%2Fb&n=15e-1&q=%FF%201&h=v%20w&b=true")
    );
    // A value that would name another resource, in the path: refused; in the query, kept.
    let template =
        LookupTemplate::parse("GET /by-ref/{json:/reference}", Some(&pattern)).expect("valid");
    for (value, refused) in [
        ("..", true),
        (".", true),
        ("", true),
        ("a/b", true),
        ("a\\b", true),
        ("a.b", false),
        ("...", false),
    ] {
        let body = serde_json::json!({ "reference": value }).to_string();
        let rendered = render_lookup(&template, &pattern, &head, body.as_bytes(), "k");
        assert_eq!(rendered.is_err(), refused, "{value:?}: {rendered:?}");
    }
    let in_query =
        LookupTemplate::parse("GET /by-ref?r={json:/reference}", Some(&pattern)).expect("valid");
    for value in ["..", "a/b", ""] {
        let body = serde_json::json!({ "reference": value }).to_string();
        assert!(
            render_lookup(&in_query, &pattern, &head, body.as_bytes(), "k").is_ok(),
            "{value:?} in the query"
        );
    }
    let by_key = LookupTemplate::parse("GET /by-key/{key}", Some(&pattern)).expect("valid");
    assert_eq!(
        render_lookup(&by_key, &pattern, &head, b"{}", "..").map_err(|e| e.part),
        Err("key".to_owned())
    );
    let missing = render_lookup(&template, &pattern, &head, b"{}", "k");
    assert_eq!(
        missing.map_err(|e| e.part),
        Err("json:/reference".to_owned()),
        "a part that can't be read is named"
    );
}

#[test]
fn percent_decoding() {
    assert_eq!(percent_decode("T%2D1"), b"T-1");
    assert_eq!(percent_decode("a%zzb"), b"a%zzb");
    assert_eq!(percent_decode("%41"), b"A");
    assert_eq!(percent_decode("%4"), b"%4");
}
