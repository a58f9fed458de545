//! Every way each provider's delivery is refused, rotation, the window's edges, `hmac`'s
//! options, and where each provider's event id comes from.

use super::*;

/// One provider's good delivery, to be broken in every way the provider can be.
struct Case {
    settings: WebhookSettings,
    headers: Vec<(&'static str, String)>,
    body: &'static str,
    now: u64,
    /// The signature header.
    signature: &'static str,
    /// The header that carries a signed timestamp, when the scheme has one of its own.
    timestamp: Option<&'static str>,
    /// Another secret of the provider's form, which signed none of it.
    wrong_secret: &'static str,
}

impl Case {
    fn run(
        &self,
        headers: &[(&'static str, String)],
        body: &str,
        now: u64,
    ) -> Result<Verified, Rejection> {
        let headers: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
        check(&self.settings, &headers, body, at(now))
    }

    fn without(&self, name: &str) -> Vec<(&'static str, String)> {
        self.headers
            .iter()
            .filter(|(n, _)| *n != name)
            .cloned()
            .collect()
    }

    fn with(&self, name: &'static str, value: &str) -> Vec<(&'static str, String)> {
        let mut headers = self.without(name);
        headers.push((name, value.to_owned()));
        headers
    }

    fn twice(&self, name: &'static str) -> Vec<(&'static str, String)> {
        let mut headers = self.headers.clone();
        headers.extend(self.headers.iter().filter(|(n, _)| *n == name).cloned());
        headers
    }
}

fn hmac_provider(encoding: Encoding, prefix: &str, id: KeyPart) -> Provider {
    Provider::Hmac(HmacScheme {
        signature_header: HeaderName::from_static("x-signature"),
        encoding,
        prefix: prefix.to_owned(),
        id,
    })
}

fn cases() -> Vec<Case> {
    let hmac = hmac_provider(
        Encoding::Hex,
        "sha256=",
        KeyPart::Header(HeaderName::from_static("x-delivery")),
    );
    vec![
        Case {
            settings: settings(Provider::Github, GITHUB_SECRET),
            headers: vec![("x-hub-signature-256", GITHUB_SIGNATURE.into())],
            body: "Hello, World!",
            now: 0,
            signature: "x-hub-signature-256",
            timestamp: None,
            wrong_secret: "It's a secret to everybody",
        },
        Case {
            settings: settings(Provider::Standard, STANDARD_SECRET),
            headers: vec![
                ("webhook-id", STANDARD_ID.into()),
                ("webhook-timestamp", STANDARD_TS.to_string()),
                ("webhook-signature", STANDARD_SIGNATURE.into()),
            ],
            body: STANDARD_BODY,
            now: STANDARD_TS,
            signature: "webhook-signature",
            timestamp: Some("webhook-timestamp"),
            wrong_secret: "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSx",
        },
        Case {
            settings: settings(Provider::Slack, SLACK_SECRET),
            headers: vec![
                ("x-slack-signature", SLACK_SIGNATURE.into()),
                ("x-slack-request-timestamp", SLACK_TS.to_string()),
            ],
            body: SLACK_BODY,
            now: SLACK_TS,
            signature: "x-slack-signature",
            timestamp: Some("x-slack-request-timestamp"),
            wrong_secret: "8f742231b10e8888abcd99yyyzzz85a6",
        },
        Case {
            settings: settings(Provider::Stripe, STRIPE_SECRET),
            headers: vec![("stripe-signature", stripe_header(STRIPE_V1))],
            body: STRIPE_BODY,
            now: STRIPE_TS,
            signature: "stripe-signature",
            timestamp: None,
            wrong_secret: "whsec_7Qk2eL3bV9xN4pA8sD1fG6hJ0mR5tY2v",
        },
        Case {
            settings: settings(Provider::Shopify, SHOPIFY_SECRET),
            headers: vec![("x-shopify-hmac-sha256", SHOPIFY_SIGNATURE.into())],
            body: SHOPIFY_BODY,
            now: 0,
            signature: "x-shopify-hmac-sha256",
            timestamp: None,
            wrong_secret: "shpss_hush!",
        },
        Case {
            // GitHub's published value, in a header of the operator's choosing.
            settings: settings(hmac, GITHUB_SECRET),
            headers: vec![("x-signature", GITHUB_SIGNATURE.into())],
            body: "Hello, World!",
            now: 0,
            signature: "x-signature",
            timestamp: None,
            wrong_secret: "another secret",
        },
    ]
}

fn is_malformed(result: &Result<Verified, Rejection>, header: &str) -> bool {
    matches!(result, Err(Rejection::Malformed { header: h, .. }) if h == header)
}

#[test]
fn every_provider_refuses_each_way() {
    for case in cases() {
        let name = case.settings.provider.name();
        let good = case.run(&case.headers, case.body, case.now);
        assert!(good.is_ok(), "{name}: {good:?}");

        let result = case.run(&case.without(case.signature), case.body, case.now);
        assert_eq!(result, Err(missing(case.signature)), "{name}");
        let result = case.run(&case.twice(case.signature), case.body, case.now);
        assert!(is_malformed(&result, case.signature), "{name}: {result:?}");
        for garbage in ["nonsense", "v1,", "sha256=", "t=1,v1=zz", "v0=12"] {
            let result = case.run(&case.with(case.signature, garbage), case.body, case.now);
            assert!(
                is_malformed(&result, case.signature),
                "{name} {garbage:?}: {result:?}"
            );
        }

        let tampered = format!("{} ", case.body);
        let result = case.run(&case.headers, &tampered, case.now);
        assert_eq!(result, Err(Rejection::NoMatch), "{name}: a changed body");
        let wrong = settings(case.settings.provider.clone(), case.wrong_secret);
        let headers: Vec<(&str, &str)> =
            case.headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
        let result = check(&wrong, &headers, case.body, at(case.now));
        assert_eq!(result, Err(Rejection::NoMatch), "{name}: another secret");

        if case.settings.provider.signs_timestamp() {
            let behind = case.run(&case.headers, case.body, case.now + 301);
            assert!(
                matches!(behind, Err(Rejection::Stale { future: false, .. })),
                "{name}: {behind:?}"
            );
            let ahead = case.run(&case.headers, case.body, case.now - 301);
            assert!(
                matches!(ahead, Err(Rejection::Stale { future: true, .. })),
                "{name}: {ahead:?}"
            );
            // A forgery with an old timestamp is a bad signature, not a stale one.
            let result = case.run(&case.headers, &tampered, case.now + 3600);
            assert_eq!(result, Err(Rejection::NoMatch), "{name}");
        }
        if let Some(ts) = case.timestamp {
            let result = case.run(&case.without(ts), case.body, case.now);
            assert!(is_malformed(&result, ts), "{name}: {result:?}");
            for bad in ["soon", "+1614265330", "1614265330.5", "-1"] {
                let result = case.run(&case.with(ts, bad), case.body, case.now);
                assert!(is_malformed(&result, ts), "{name} {bad}: {result:?}");
            }
        }
    }
}

#[test]
fn a_standard_delivery_without_its_id_is_malformed() {
    let case = &cases()[1];
    let result = case.run(&case.without("webhook-id"), case.body, case.now);
    assert!(is_malformed(&result, "webhook-id"), "{result:?}");
    assert_eq!(result.map_err(|r| r.result()), Err("bad_signature"));
    let result = case.run(&case.with("webhook-id", ""), case.body, case.now);
    assert!(is_malformed(&result, "webhook-id"), "{result:?}");
    // The id is signed: another one does not verify.
    let result = case.run(&case.with("webhook-id", "msg_other"), case.body, case.now);
    assert_eq!(result, Err(Rejection::NoMatch));
}

#[test]
fn stripe_timestamp_is_signed_and_required() {
    let case = &cases()[3];
    for header in [
        format!("v1={STRIPE_V1}"),
        format!("t=,v1={STRIPE_V1}"),
        format!("t=abc,v1={STRIPE_V1}"),
        format!("t={STRIPE_TS},t={STRIPE_TS},v1={STRIPE_V1}"),
        format!("t={STRIPE_TS},v0={STRIPE_V1}"),
    ] {
        let result = case.run(&case.with("stripe-signature", &header), case.body, case.now);
        assert!(
            is_malformed(&result, "stripe-signature"),
            "{header}: {result:?}"
        );
    }
    let other_t = format!("t={},v1={STRIPE_V1}", STRIPE_TS + 1);
    let result = case.run(
        &case.with("stripe-signature", &other_t),
        case.body,
        case.now,
    );
    assert_eq!(
        result,
        Err(Rejection::NoMatch),
        "t is part of what is signed"
    );
    let spaced = format!(" t={STRIPE_TS} , v1={STRIPE_V1} ");
    assert!(
        case.run(&case.with("stripe-signature", &spaced), case.body, case.now)
            .is_ok()
    );
}

#[test]
fn rotation_every_secret_is_tried() {
    for (secrets, ok) in [
        (format!("an old one\n{GITHUB_SECRET}\n"), true),
        (format!("{GITHUB_SECRET}\r\nan old one"), true),
        ("an old one\nanother".to_owned(), false),
    ] {
        let s = settings(Provider::Github, &secrets);
        let result = check(
            &s,
            &[("x-hub-signature-256", GITHUB_SIGNATURE)],
            "Hello, World!",
            at(0),
        );
        assert_eq!(result.is_ok(), ok, "{result:?}");
    }
    let s = settings(
        Provider::Standard,
        &format!("whsec_dGhlIG9sZCBvbmUgb2YgdGhlIHR3bw==\n{STANDARD_SECRET}"),
    );
    let case = &cases()[1];
    let headers: Vec<(&str, &str)> = case.headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
    assert!(check(&s, &headers, STANDARD_BODY, at(STANDARD_TS)).is_ok());
}

#[test]
fn tolerance_edges_both_ways() {
    let case = &cases()[1];
    for (now, ok) in [
        (STANDARD_TS + 300, true),
        (STANDARD_TS + 301, false),
        (STANDARD_TS - 300, true),
        (STANDARD_TS - 301, false),
    ] {
        let result = case.run(&case.headers, case.body, now);
        assert_eq!(result.is_ok(), ok, "now {now}: {result:?}");
    }
    // Whole seconds, as the timestamp is: 300.999 s after it is still 300 s.
    let headers: Vec<(&str, &str)> = case.headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
    let late = at(STANDARD_TS + 300) + Duration::from_millis(999);
    assert!(check(&case.settings, &headers, STANDARD_BODY, late).is_ok());
    // A zero tolerance takes only the very second.
    let strict = WebhookSettings {
        tolerance: Duration::ZERO,
        ..case.settings.clone()
    };
    assert!(check(&strict, &headers, STANDARD_BODY, at(STANDARD_TS)).is_ok());
    let result = check(&strict, &headers, STANDARD_BODY, at(STANDARD_TS + 1));
    assert_eq!(
        result,
        Err(Rejection::Stale {
            skew: Duration::from_secs(1),
            future: false,
            tolerance: Duration::ZERO
        })
    );
    // A clock before 1970 reads as 0: everything is far ahead of it, nothing panics.
    let result = check(
        &case.settings,
        &headers,
        STANDARD_BODY,
        SystemTime::UNIX_EPOCH - Duration::from_secs(5),
    );
    assert!(
        matches!(result, Err(Rejection::Stale { future: true, .. })),
        "{result:?}"
    );
}

#[test]
fn hmac_encodings_prefixes_and_ids() {
    let delivery = KeyPart::Header(HeaderName::from_static("x-delivery"));
    let hex = GITHUB_SIGNATURE.trim_start_matches("sha256=");
    let b64 = "dXEH6g6yUJ/CESIczphLijdXC211hsIsRvQ3nIsEPhc=";
    for (encoding, prefix, value, ok) in [
        (Encoding::Hex, "", hex.to_owned(), true),
        (Encoding::Hex, "", hex.to_uppercase(), true),
        (Encoding::Hex, "sha256=", format!("sha256={hex}"), true),
        (Encoding::Hex, "sha256=", hex.to_owned(), false),
        (Encoding::Hex, "", b64.to_owned(), false),
        (Encoding::Base64, "", b64.to_owned(), true),
        (
            Encoding::Base64,
            "",
            b64.trim_end_matches('=').to_owned(),
            true,
        ),
        (Encoding::Base64, "v1=", format!("v1={b64}"), true),
        (Encoding::Base64, "", hex.to_owned(), false),
    ] {
        let s = settings(
            hmac_provider(encoding, prefix, delivery.clone()),
            GITHUB_SECRET,
        );
        let result = check(
            &s,
            &[("x-signature", &value), ("x-delivery", "d-1")],
            "Hello, World!",
            at(0),
        );
        if ok {
            // A header id is not signed: the body is the event, the id a label.
            assert_eq!(
                result,
                Ok(verified(body_event("Hello, World!", None), Some("d-1"))),
                "{value}"
            );
        } else {
            assert!(is_malformed(&result, "x-signature"), "{value}: {result:?}");
        }
    }
}

#[test]
fn hmac_ids_are_key_from_parts_and_only_a_json_id_is_signed() {
    let delivery = KeyPart::Header(HeaderName::from_static("x-delivery"));
    // The id is a key_from part, read by key_from's reader: every kind of part.
    // openssl over the body below with GitHub's secret, hex.
    let body = r#"{"event":{"id":42.0,"kind":"paid"}}"#;
    let signature = "0a97e7035fd88dfcc9ee5337e8060a5cc60f108b8072987b548ace4c1001f7ae";
    let by_body = || body_event(body, None);
    for (part, want) in [
        // A `json:` id is inside the signed body: signed, so it is the event.
        (
            KeyPart::Json("/event/id".into()),
            verified(event_id("42"), None),
        ),
        (
            KeyPart::Json("/event/kind".into()),
            verified(event_id("paid"), None),
        ),
        // Any other part is not signed: the body is the event, the part a label.
        (
            KeyPart::Path("tenant".into()),
            verified(by_body(), Some("t1")),
        ),
        (
            KeyPart::Query("delivery".into()),
            verified(by_body(), Some("q-7")),
        ),
        (KeyPart::Method, verified(by_body(), Some("POST"))),
        (delivery.clone(), verified(by_body(), Some("d-2"))),
        // Unreadable: a `json:` id is verified all the same, forwarded without a key; any
        // other part leaves the body as the event, with no label.
        (KeyPart::Json("/event/missing".into()), verified(None, None)),
        (KeyPart::Json("/event".into()), verified(None, None)),
        (KeyPart::Query("absent".into()), verified(by_body(), None)),
        (
            KeyPart::Header(HeaderName::from_static("x-absent")),
            verified(by_body(), None),
        ),
    ] {
        let s = settings(
            hmac_provider(Encoding::Hex, "", part.clone()),
            GITHUB_SECRET,
        );
        let result = check(
            &s,
            &[("x-signature", signature), ("x-delivery", "d-2")],
            body,
            at(0),
        );
        assert_eq!(result, Ok(want), "{part:?}");
    }
}

#[test]
fn event_ids_only_from_where_the_provider_puts_them() {
    // Stripe: the body's `id`, a string, in a JSON object.
    let stripe = &cases()[3];
    for (body, want) in [
        (r#"{"id":"evt_1"}"#, id("evt_1")),
        (
            r#"{"object":"event","id":"evt_2","data":{"id":"ch_1"}}"#,
            id("evt_2"),
        ),
        (r#"{"id":1}"#, None),
        (r#"{"id":""}"#, None),
        (r#"{"data":{"id":"ch_1"}}"#, None),
        (r#"["evt_1"]"#, None),
        ("id=evt_1", None),
    ] {
        let key = hmac::Key::new(hmac::HMAC_SHA256, STRIPE_SECRET.as_bytes());
        let v1 = hex::encode(hmac::sign(&key, format!("{STRIPE_TS}.{body}").as_bytes()));
        let header = format!("t={STRIPE_TS},v1={v1}");
        let result = stripe.run(&stripe.with("stripe-signature", &header), body, stripe.now);
        assert_eq!(result, Ok(verified(want.map(Event::Id), None)), "{body}");
    }
    // GitHub and Shopify: the body is the event whatever the id header says; one id header
    // line is its label, two are none.
    let github = &cases()[0];
    let mut headers = github.with("x-github-delivery", "d-1");
    let first = github.run(&headers, github.body, 0).expect("verifies");
    assert_eq!(first.label.as_deref(), Some("d-1"));
    headers.push(("x-github-delivery", "d-2".into()));
    let twice = github.run(&headers, github.body, 0).expect("verifies");
    assert_eq!(twice.label, None);
    assert_eq!(
        twice.event, first.event,
        "the label plays no part in the event"
    );
    let shopify = &cases()[4];
    let headers = shopify.with("x-shopify-webhook-id", "w-1");
    let got = shopify.run(&headers, shopify.body, 0).expect("verifies");
    assert_eq!(got.label.as_deref(), Some("w-1"));
    assert!(matches!(got.event, Some(Event::Body { .. })));
}

#[test]
fn rejections_name_the_check_and_never_a_secret_or_a_signature() {
    let mut seen = std::collections::BTreeSet::new();
    for case in cases() {
        let wrong = settings(case.settings.provider.clone(), case.wrong_secret);
        let headers: Vec<(&str, &str)> =
            case.headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
        // The signature the wrong secret would have wanted: never shown either.
        let wanted = hmac::sign(
            &hmac::Key::new(hmac::HMAC_SHA256, case.wrong_secret.as_bytes()),
            case.body.as_bytes(),
        );
        for (settings, headers, now) in [
            (&wrong, headers.clone(), case.now),
            (&case.settings, headers.clone(), case.now + 3600),
            (&case.settings, headers[..0].to_vec(), case.now),
            (&case.settings, vec![(case.signature, "garbage")], case.now),
        ] {
            let Err(rejection) = check(settings, &headers, case.body, at(now)) else {
                continue;
            };
            let shown = format!("{} {rejection:?}", rejection.detail());
            for secret in [
                case.wrong_secret,
                GITHUB_SECRET,
                STANDARD_SECRET,
                SLACK_SECRET,
                STRIPE_SECRET,
                SHOPIFY_SECRET,
            ] {
                assert!(!shown.contains(secret), "{shown}");
            }
            assert!(!shown.contains(&hex::encode(wanted.as_ref())), "{shown}");
            assert!(!shown.contains(&BASE64.encode(wanted.as_ref())), "{shown}");
            seen.insert((
                rejection.result(),
                rejection.detail().split(':').next().map(str::to_owned),
            ));
        }
    }
    let seen: Vec<_> = seen.into_iter().collect();
    assert_eq!(
        seen,
        [
            ("bad_signature", Some("bad signature".to_owned())),
            ("bad_signature", Some("malformed signature".to_owned())),
            ("missing_signature", Some("missing signature".to_owned())),
            ("stale", Some("stale signature".to_owned())),
        ]
    );
    let stale = Rejection::Stale {
        skew: Duration::from_secs(301),
        future: false,
        tolerance: FIVE_MINUTES,
    };
    assert_eq!(
        stale.detail(),
        "stale signature: the signed timestamp is 5m 1s behind the proxy's clock, outside the tolerance of 5m"
    );
    assert_eq!(
        missing("stripe-signature").detail(),
        "missing signature: the stripe-signature header is absent"
    );
}
