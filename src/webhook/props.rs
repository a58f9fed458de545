//! The fuzz target's invariants (`fuzz/fuzz_targets/webhook_signature.rs`) as a property, so
//! every `cargo test` runs them without a nightly compiler: signature headers assembled from
//! real signatures, wrong ones, junk, odd timestamps and separators never verify unless they
//! carry the real HMAC of what the scheme signs, which the test computes itself; and the
//! well-formed header with the real signature, in the window, always verifies.

use std::time::{Duration, SystemTime};

use base64::Engine as _;
use proptest::prelude::*;
use ring::hmac;

use super::*;
use crate::route::{BASE64, Encoding, HmacScheme, KeyPart, Secrets};

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const NOW: u64 = 1_700_000_000;
const ID: &str = "msg_1";

/// One piece of a signature header.
#[derive(Debug, Clone)]
enum Token {
    /// The real signature for the test's timestamp.
    Real,
    /// A well-formed signature that is not the real one.
    Wrong([u8; 32]),
    /// The real signature with one bit flipped.
    Flipped(usize),
    /// `t=` with the test's timestamp (Stripe).
    Time,
    /// `t=` with some other text.
    OtherTime(String),
    /// Anything printable.
    Junk(String),
}

fn token() -> impl Strategy<Value = Token> {
    prop_oneof![
        3 => Just(Token::Real),
        2 => any::<[u8; 32]>().prop_map(Token::Wrong),
        1 => (0usize..256).prop_map(Token::Flipped),
        2 => Just(Token::Time),
        1 => "[0-9+ .e-]{0,22}".prop_map(Token::OtherTime),
        2 => "[ -~]{0,16}".prop_map(Token::Junk),
    ]
}

fn providers() -> Vec<Provider> {
    let id = KeyPart::Header(http::HeaderName::from_static("x-delivery"));
    vec![
        Provider::Standard,
        Provider::Stripe,
        Provider::Slack,
        Provider::Github,
        Provider::Shopify,
        Provider::Hmac(HmacScheme {
            signature_header: http::HeaderName::from_static("x-signature"),
            encoding: Encoding::Hex,
            prefix: "sha256=".into(),
            id: id.clone(),
        }),
        Provider::Hmac(HmacScheme {
            signature_header: http::HeaderName::from_static("x-signature"),
            encoding: Encoding::Base64,
            prefix: String::new(),
            id,
        }),
    ]
}

/// The HMAC key the secret stands for, computed here, not by `Secrets`.
fn key(provider: &Provider) -> hmac::Key {
    let bytes = match provider {
        Provider::Standard => BASE64
            .decode(SECRET.trim_start_matches("whsec_"))
            .unwrap_or_default(),
        _ => SECRET.as_bytes().to_vec(),
    };
    hmac::Key::new(hmac::HMAC_SHA256, &bytes)
}

/// What the scheme signs, for timestamp `ts`.
fn message(provider: &Provider, ts: &str, body: &[u8]) -> Vec<u8> {
    let prefix = match provider {
        Provider::Standard => format!("{ID}.{ts}."),
        Provider::Stripe => format!("{ts}."),
        Provider::Slack => format!("v0:{ts}:"),
        _ => String::new(),
    };
    [prefix.as_bytes(), body].concat()
}

/// A signature in the scheme's encoding, with the scheme's marker.
fn written(provider: &Provider, mac: &[u8]) -> String {
    match provider {
        Provider::Standard => format!("v1,{}", BASE64.encode(mac)),
        Provider::Stripe => format!("v1={}", hex::encode(mac)),
        Provider::Slack => format!("v0={}", hex::encode(mac)),
        Provider::Github => format!("sha256={}", hex::encode(mac)),
        Provider::Shopify => BASE64.encode(mac),
        Provider::Hmac(s) if s.encoding == Encoding::Hex => {
            format!("{}{}", s.prefix, hex::encode(mac))
        }
        Provider::Hmac(s) => format!("{}{}", s.prefix, BASE64.encode(mac)),
    }
}

fn signature_header(provider: &Provider) -> &'static str {
    match provider {
        Provider::Standard => "webhook-signature",
        Provider::Stripe => "stripe-signature",
        Provider::Slack => "x-slack-signature",
        Provider::Github => "x-hub-signature-256",
        Provider::Shopify => "x-shopify-hmac-sha256",
        Provider::Hmac(_) => "x-signature",
    }
}

/// Runs one assembled delivery through `verify` and checks the invariants.
fn run(provider: &Provider, tokens: &[Token], body: &[u8], skew: i64) -> Result<(), TestCaseError> {
    let fail = |e: String| TestCaseError::fail(e);
    let ts = NOW.to_string();
    let real = hmac::sign(&key(provider), &message(provider, &ts, body));
    let real_written = written(provider, real.as_ref());
    let real = real.as_ref();
    let separator = match provider {
        Provider::Stripe => ",",
        _ => " ",
    };
    let value = tokens
        .iter()
        .map(|t| match t {
            Token::Real => real_written.clone(),
            Token::Wrong(mac) => written(provider, mac),
            Token::Flipped(bit) => {
                let mut mac = real.to_vec();
                mac[bit / 8 % 32] ^= 1 << (bit % 8);
                written(provider, &mac)
            }
            Token::Time => format!("t={ts}"),
            Token::OtherTime(text) => format!("t={text}"),
            Token::Junk(text) => text.clone(),
        })
        .collect::<Vec<_>>()
        .join(separator);
    let Ok(value) = http::HeaderValue::from_str(&value) else {
        return Ok(());
    };
    let mut request = http::Request::post("/hooks/t1")
        .header("webhook-id", ID)
        .header("webhook-timestamp", ts.as_str())
        .header("x-slack-request-timestamp", ts.as_str())
        .header("x-delivery", "d-1")
        .body(())
        .map_err(|e| fail(e.to_string()))?;
    request
        .headers_mut()
        .insert(signature_header(provider), value.clone());
    let (head, ()) = request.into_parts();
    let settings = WebhookSettings {
        provider: provider.clone(),
        secrets: Secrets::parse(SECRET, provider).map_err(|e| fail(e.to_string()))?,
        tolerance: Duration::from_secs(300),
    };
    let now = SystemTime::UNIX_EPOCH + Duration::from_secs(NOW.saturating_add_signed(skew));
    let pattern = crate::route::PathPattern::parse("/hooks/{tenant}").map_err(fail)?;
    let result = verify(&settings, &head, &pattern, body, now);

    let text = value.to_str().unwrap_or_default();
    if result.is_ok() {
        // Never accepted without the real HMAC in the header, in the scheme's encoding (hex
        // in either case; base64 with or without its padding).
        let hex_scheme = match provider {
            Provider::Standard | Provider::Shopify => false,
            Provider::Hmac(s) => s.encoding == Encoding::Hex,
            _ => true,
        };
        let carried = if hex_scheme {
            text.to_ascii_lowercase().contains(&hex::encode(real))
        } else {
            text.contains(BASE64.encode(real).trim_end_matches('='))
        };
        prop_assert!(carried, "accepted without the real signature: {text:?}");
        prop_assert!(
            !provider.signs_timestamp() || skew.unsigned_abs() <= 300,
            "accepted outside the window"
        );
    }
    // The canonical header, in the window: always accepted.
    let canonical = match provider {
        Provider::Stripe => matches!(tokens, [Token::Time, Token::Real]),
        _ => matches!(tokens, [Token::Real]),
    };
    if canonical && skew.unsigned_abs() <= 300 {
        prop_assert!(result.is_ok(), "{text:?}: {result:?}");
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    #[test]
    fn nothing_verifies_without_the_real_hmac(
        provider in 0usize..7,
        tokens in prop::collection::vec(token(), 0..6),
        body in prop::collection::vec(any::<u8>(), 0..48),
        skew in -400i64..400,
    ) {
        let provider = &providers()[provider];
        run(provider, &tokens, &body, skew)?;
    }

    #[test]
    fn the_canonical_header_verifies(
        provider in 0usize..7,
        body in prop::collection::vec(any::<u8>(), 0..48),
        skew in -300i64..=300,
    ) {
        let provider = &providers()[provider];
        let tokens = match provider {
            Provider::Stripe => vec![Token::Time, Token::Real],
            _ => vec![Token::Real],
        };
        run(provider, &tokens, &body, skew)?;
    }
}
