//! The providers' published examples, so the schemes are checked against the providers and
//! not only against this code; `refusals`: every rejection of every provider, rotation, the
//! window's edges, `hmac`'s options and where each event id comes from.
//!
//! Values marked "openssl" were computed outside this code, with
//! `printf '%s' MESSAGE | openssl dgst -sha256 -hmac SECRET` (`-binary | base64` for base64),
//! for schemes whose provider publishes no worked example.

use std::time::{Duration, SystemTime};

use http::HeaderName;
use http::request::Parts;

use base64::Engine as _;
use ring::hmac;

use sha2::{Digest, Sha256};

use super::*;
use crate::route::{BASE64, Encoding, HmacScheme, KeyPart, PathPattern, Secrets, WebhookSettings};

mod refusals;

const FIVE_MINUTES: Duration = Duration::from_secs(300);

fn settings(provider: Provider, secrets: &str) -> WebhookSettings {
    WebhookSettings {
        secrets: Secrets::parse(secrets, &provider).expect("valid secrets"),
        provider,
        tolerance: FIVE_MINUTES,
    }
}

fn head(uri: &str, headers: &[(&str, &str)]) -> Parts {
    let mut request = http::Request::post(uri);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.body(()).expect("valid request").into_parts().0
}

fn at(secs: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(secs)
}

fn pattern() -> PathPattern {
    PathPattern::parse("/hooks/{tenant}").expect("valid pattern")
}

fn check(
    settings: &WebhookSettings,
    headers: &[(&str, &str)],
    body: &str,
    now: SystemTime,
) -> Result<Verified, Rejection> {
    verify(
        settings,
        &head("/hooks/t1?delivery=q-7", headers),
        &pattern(),
        body.as_bytes(),
        now,
    )
}

fn id(text: &str) -> Option<EventId> {
    EventId::new(text.as_bytes().to_vec())
}

/// A signed id as the event.
fn event_id(text: &str) -> Option<Event> {
    id(text).map(Event::Id)
}

/// A body signed alone as the event, with its topic.
fn body_event(body: &str, topic: Option<&str>) -> Option<Event> {
    Some(Event::Body {
        sha256: Sha256::digest(body.as_bytes()).into(),
        topic: topic.map(|t| t.as_bytes().to_vec()),
    })
}

/// What `check` verifies: its path `/hooks/t1` namespaces every key by the tenant.
fn verified(event: Option<Event>, label: Option<&str>) -> Verified {
    Verified {
        event,
        label: label.map(str::to_owned),
        namespace: vec!["t1".to_owned()],
    }
}

fn missing(header: &'static str) -> Rejection {
    Rejection::MissingSignature {
        header: HeaderName::from_static(header),
    }
}

/// GitHub's documented example ("Validating webhook deliveries").
const GITHUB_SECRET: &str = "It's a Secret to Everybody";
const GITHUB_SIGNATURE: &str =
    "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17";

/// The Standard Webhooks libraries' signing example (libraries/javascript/src/webhook.test.ts,
/// "sign function works"; the same secret, id and payload in every library's tests).
const STANDARD_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const STANDARD_ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";
const STANDARD_TS: u64 = 1_614_265_330;
const STANDARD_BODY: &str = r#"{"test": 2432232314}"#;
const STANDARD_SIGNATURE: &str = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";

/// Slack's documented example ("Verifying requests from Slack"): a slash command, form-encoded.
const SLACK_SECRET: &str = "8f742231b10e8888abcd99yyyzzz85a5";
const SLACK_TS: u64 = 1_531_420_618;
const SLACK_BODY: &str = "token=xyzz0WbapA4vBCDEFasx0q6G&team_id=T1DC2JH3J&team_domain=testteamnow&channel_id=G8PSS9T3V&channel_name=foobar&user_id=U2CERLKJA&user_name=roadrunner&command=%2Fwebhook-collect&text=&response_url=https%3A%2F%2Fhooks.slack.com%2Fcommands%2FT1DC2JH3J%2F397700885554%2F96rGlfmibIGlgcZRskXaIFfN&trigger_id=398738663015.47445629121.803a0bc887a14d10d2c447fce8b6703c";
const SLACK_SIGNATURE: &str = "v0=a2114d57b48eac39b9ad189dd8316235a7b4a8d21a10bd27519666489c69b503";

/// Stripe publishes the scheme, not a worked example. openssl over
/// `1492774577.{"id":"evt_1NG8Du2eZvKYlo2CUI79vXWy","object":"event"}`, the secret as written.
const STRIPE_SECRET: &str = "whsec_7Qk2eL3bV9xN4pA8sD1fG6hJ0mR5tY2u";
const STRIPE_TS: u64 = 1_492_774_577;
const STRIPE_BODY: &str = r#"{"id":"evt_1NG8Du2eZvKYlo2CUI79vXWy","object":"event"}"#;
const STRIPE_V1: &str = "022c59086281cd918f3bdf3ab3abfd3508132c7d287f10082b26b19a2a9678a7";

/// Shopify publishes no worked example either. openssl, `-binary | base64`.
const SHOPIFY_SECRET: &str = "shpss_hush";
const SHOPIFY_BODY: &str = r#"{"id":820982911946154508,"email":"jon@example.com"}"#;
const SHOPIFY_SIGNATURE: &str = "minWArgZa/Hsplvy6dlnaKNnlyvuW8Y2ovDcBlzZSE0=";

fn stripe_header(v1: &str) -> String {
    format!(
        "t={STRIPE_TS},v1={v1},v0=6ffbb59b2300aae63f272406069a9788598b792a944a07aba816edb039989a39"
    )
}

#[test]
fn github_documented_example() {
    let s = settings(Provider::Github, GITHUB_SECRET);
    let headers = [
        ("x-hub-signature-256", GITHUB_SIGNATURE),
        ("x-github-delivery", "72d3162e-cc78-11e3-81ab-4c9367dc0958"),
    ];
    let got = check(&s, &headers, "Hello, World!", at(0)).expect("verifies");
    // GitHub signs the body alone: the body is the event, the delivery id a label.
    assert_eq!(
        got,
        verified(
            body_event("Hello, World!", None),
            Some("72d3162e-cc78-11e3-81ab-4c9367dc0958")
        )
    );
    // GitHub signs no timestamp: the clock plays no part.
    assert!(check(&s, &headers, "Hello, World!", SystemTime::now()).is_ok());
    assert_eq!(
        check(&s, &headers[..1], "Hello, World!", at(0)),
        Ok(verified(body_event("Hello, World!", None), None)),
        "no delivery id: the same event, keyed by its body"
    );
    let with_topic = [headers[0], ("x-github-event", "push")];
    assert_eq!(
        check(&s, &with_topic, "Hello, World!", at(0)),
        Ok(verified(body_event("Hello, World!", Some("push")), None)),
        "the topic is part of the event"
    );
}

#[test]
fn standard_webhooks_specification_examples() {
    let s = settings(Provider::Standard, STANDARD_SECRET);
    let ts = STANDARD_TS.to_string();
    let headers = [
        ("webhook-id", STANDARD_ID),
        ("webhook-timestamp", ts.as_str()),
        ("webhook-signature", STANDARD_SIGNATURE),
    ];
    let got = check(&s, &headers, STANDARD_BODY, at(STANDARD_TS)).expect("verifies");
    assert_eq!(got, verified(event_id(STANDARD_ID), None));
    // Svix's own names: the same scheme, the same event.
    let svix = [
        ("svix-id", STANDARD_ID),
        ("svix-timestamp", ts.as_str()),
        ("svix-signature", STANDARD_SIGNATURE),
    ];
    assert_eq!(
        check(&s, &svix, STANDARD_BODY, at(STANDARD_TS)),
        Ok(verified(event_id(STANDARD_ID), None))
    );
    // The same secret without its prefix, as the libraries accept it.
    let bare = settings(Provider::Standard, "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw");
    assert!(check(&bare, &headers, STANDARD_BODY, at(STANDARD_TS)).is_ok());
    // The libraries' multi-signature test: other versions and wrong v1s around the real one.
    let multi = format!(
        "v1,Ceo5qEr07ixe2NLpvHk3FH9bwy/WavXrAFQ/9tdO6mc= v2,Ceo5qEr07ixe2NLpvHk3FH9bwy/WavXrAFQ/9tdO6mc= {STANDARD_SIGNATURE} v1,Ceo5qEr07ixe2NLpvHk3FH9bwy/WavXrAFQ/9tdO6mc="
    );
    let headers = [
        headers[0],
        headers[1],
        ("webhook-signature", multi.as_str()),
    ];
    assert!(check(&s, &headers, STANDARD_BODY, at(STANDARD_TS)).is_ok());

    // The Rust library's `test_sign` example (libraries/rust/src/lib.rs).
    let s = settings(Provider::Standard, "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD");
    let headers = [
        ("webhook-id", "msg_27UH4WbU6Z5A5EzD8u03UvzRbpk"),
        ("webhook-timestamp", "1649367553"),
        (
            "webhook-signature",
            "v1,tZ1I4/hDygAJgO5TYxiSd6Sd0kDW6hPenDe+bTa3Kkw=",
        ),
    ];
    let body = r#"{"email":"test@example.com","username":"test_user"}"#;
    assert!(check(&s, &headers, body, at(1_649_367_553)).is_ok());
}

#[test]
fn slack_documented_example() {
    let s = settings(Provider::Slack, SLACK_SECRET);
    let ts = SLACK_TS.to_string();
    let headers = [
        ("x-slack-signature", SLACK_SIGNATURE),
        ("x-slack-request-timestamp", ts.as_str()),
    ];
    assert_eq!(
        check(&s, &headers, SLACK_BODY, at(SLACK_TS + 60)),
        Ok(verified(None, None)),
        "a slash command is form-encoded: no event_id, forwarded without a key"
    );
}

#[test]
fn slack_events_carry_their_event_id() {
    // openssl over `v0:1531420618:{"type":"event_callback","event_id":"Ev08MFMKH6"}`.
    let s = settings(Provider::Slack, SLACK_SECRET);
    let body = r#"{"type":"event_callback","event_id":"Ev08MFMKH6"}"#;
    let headers = [
        (
            "x-slack-signature",
            "v0=649cd74419d0db312c74495a9d279048690dfc1dc085146872cdbe24409ff2ff",
        ),
        ("x-slack-request-timestamp", "1531420618"),
    ];
    let got = check(&s, &headers, body, at(SLACK_TS)).expect("verifies");
    assert_eq!(got, verified(event_id("Ev08MFMKH6"), None));
}

#[test]
fn stripe_scheme() {
    let s = settings(Provider::Stripe, STRIPE_SECRET);
    let header = stripe_header(STRIPE_V1);
    let got = check(
        &s,
        &[("stripe-signature", &header)],
        STRIPE_BODY,
        at(STRIPE_TS),
    )
    .expect("verifies");
    assert_eq!(
        got,
        verified(event_id("evt_1NG8Du2eZvKYlo2CUI79vXWy"), None)
    );
    // Stripe's secret is the key as written: decoding it (as `standard` would) fails.
    let decoded = settings(Provider::Standard, "whsec_7Qk2eL3bV9xN4pA8sD1fG6hJ0mR5tY2u");
    assert_ne!(decoded.secrets, s.secrets);
    // Several v1s (Stripe sends one per active secret during a roll): any one will do.
    let header = format!("t={STRIPE_TS},v1={},v1={STRIPE_V1}", "00".repeat(32));
    assert!(
        check(
            &s,
            &[("stripe-signature", &header)],
            STRIPE_BODY,
            at(STRIPE_TS)
        )
        .is_ok()
    );
}

#[test]
fn shopify_scheme() {
    let s = settings(Provider::Shopify, SHOPIFY_SECRET);
    let headers = [
        ("x-shopify-hmac-sha256", SHOPIFY_SIGNATURE),
        (
            "x-shopify-webhook-id",
            "b54557e4-bdd9-4b37-8a5f-bf7d70bcd043",
        ),
    ];
    let got = check(&s, &headers, SHOPIFY_BODY, at(0)).expect("verifies");
    assert_eq!(
        got,
        verified(
            body_event(SHOPIFY_BODY, None),
            Some("b54557e4-bdd9-4b37-8a5f-bf7d70bcd043")
        )
    );
    // Two topics with byte-identical bodies are two events.
    let topic = |t| [headers[0], ("x-shopify-topic", t)];
    let created = check(&s, &topic("orders/create"), SHOPIFY_BODY, at(0)).expect("verifies");
    let updated = check(&s, &topic("orders/updated"), SHOPIFY_BODY, at(0)).expect("verifies");
    assert_ne!(created.key_text(), updated.key_text());
}

#[test]
fn a_tenant_segment_namespaces_the_key_however_it_is_spelled() {
    let s = settings(Provider::Github, GITHUB_SECRET);
    let headers = [("x-hub-signature-256", GITHUB_SIGNATURE)];
    let key_on = |uri: &str| {
        verify(
            &s,
            &head(uri, &headers),
            &pattern(),
            b"Hello, World!",
            at(0),
        )
        .expect("verifies")
        .key_text()
    };
    let t1 = key_on("/hooks/t1");
    assert_eq!(
        key_on("/HOOKS/T1/"),
        t1,
        "case and a trailing slash do not count"
    );
    assert_eq!(key_on("/hooks/x/../T1.json"), t1);
    assert_ne!(key_on("/hooks/t2"), t1, "another tenant, another event");
}
