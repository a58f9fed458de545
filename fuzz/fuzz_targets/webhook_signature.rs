//! Webhook signatures: `webhook::verify` on signature headers assembled from the real
//! signature, wrong ones, flipped bits, odd timestamps, junk and raw bytes, for every provider
//! (`standard`'s space-separated `webhook-signature` list, `Stripe-Signature`'s `t=`/`v1=` list,
//! Slack's, GitHub's and Shopify's single values, and `hmac` in hex with a prefix and in
//! base64), with a signed timestamp anywhere around the clock, sometimes a second header line.
//!
//! Invariants: never panics; never accepts unless the header carries the real HMAC of what the
//! scheme signs, computed here with ring directly (not through idemproxy); never accepts a
//! timestamp outside the tolerance; the well-formed header with the real signature, inside the
//! window, is always accepted; a refusal has one of the three labels and a detail that shows
//! neither the secret nor the real signature.
#![no_main]

use std::sync::LazyLock;
use std::time::{Duration, SystemTime};

use base64::Engine as _;
use http::{HeaderName, HeaderValue, Request};
use idemproxy::route::{
    Encoding, HmacScheme, KeyPart, PathPattern, Provider, Secrets, WebhookSettings,
};
use idemproxy::webhook;
use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use ring::hmac;

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const NOW: u64 = 1_700_000_000;
const TOLERANCE: u64 = 300;
const ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";

/// Padded standard base64, as the providers write it.
const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

fn providers() -> Vec<Provider> {
    let scheme = |encoding, prefix: &str| {
        Provider::Hmac(HmacScheme {
            signature_header: HeaderName::from_static("x-signature"),
            encoding,
            prefix: prefix.to_owned(),
            id: KeyPart::Header(HeaderName::from_static("x-delivery")),
        })
    };
    vec![
        Provider::Standard,
        Provider::Stripe,
        Provider::Slack,
        Provider::Github,
        Provider::Shopify,
        scheme(Encoding::Hex, "sha256="),
        scheme(Encoding::Base64, ""),
    ]
}

/// Each provider's settings, built once (the secrets as the configuration would hand them).
static SETTINGS: LazyLock<Vec<WebhookSettings>> = LazyLock::new(|| {
    providers()
        .into_iter()
        .map(|provider| WebhookSettings {
            secrets: Secrets::parse(SECRET, &provider).expect("the secret is valid"),
            provider,
            tolerance: Duration::from_secs(TOLERANCE),
        })
        .collect()
});

static PATH: LazyLock<PathPattern> =
    LazyLock::new(|| PathPattern::parse("/hooks/{tenant}").expect("valid pattern"));

#[derive(Debug, Arbitrary)]
enum Token {
    /// The real signature, with the scheme's marker.
    Real,
    /// The real signature with one bit flipped.
    Flipped(u8),
    /// A well-formed signature that is not the real one.
    Wrong([u8; 32]),
    /// The real signature's encoding after another marker (`v2,`, `v0=`, …).
    Marked(String),
    /// `t=` and the timestamp that was signed (Stripe).
    Time,
    /// `t=` and some other text.
    OtherTime(String),
    /// Anything.
    Raw(String),
}

#[derive(Debug, Arbitrary)]
struct Input {
    provider: u8,
    tokens: Vec<Token>,
    /// `,` for Stripe and ` ` for the others, or something else.
    separator: Option<String>,
    /// Replaces the signed timestamp header (`webhook-timestamp`, Slack's) when present.
    timestamp: Option<String>,
    /// Replaces `webhook-id` when present.
    id: Option<String>,
    /// Seconds between the signed timestamp and the clock.
    skew: i16,
    body: Vec<u8>,
    /// A second line of the signature header.
    second_line: Option<String>,
}

/// The HMAC key the secret stands for, derived here from the scheme's rules.
fn key(provider: &Provider) -> hmac::Key {
    let bytes = match provider {
        Provider::Standard => B64
            .decode(SECRET.trim_start_matches("whsec_"))
            .expect("the secret is base64"),
        _ => SECRET.as_bytes().to_vec(),
    };
    hmac::Key::new(hmac::HMAC_SHA256, &bytes)
}

fn hex_scheme(provider: &Provider) -> bool {
    match provider {
        Provider::Standard | Provider::Shopify => false,
        Provider::Hmac(s) => s.encoding == Encoding::Hex,
        _ => true,
    }
}

fn encode(provider: &Provider, mac: &[u8]) -> String {
    if hex_scheme(provider) {
        hex::encode(mac)
    } else {
        B64.encode(mac)
    }
}

fn marker(provider: &Provider) -> &str {
    match provider {
        Provider::Standard => "v1,",
        Provider::Stripe => "v1=",
        Provider::Slack => "v0=",
        Provider::Github => "sha256=",
        Provider::Shopify => "",
        Provider::Hmac(s) => &s.prefix,
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

fuzz_target!(|input: Input| {
    let settings = &SETTINGS[usize::from(input.provider) % SETTINGS.len()];
    let provider = &settings.provider;
    let ts = NOW.to_string();
    let id = input.id.as_deref().unwrap_or(ID);
    let signed_ts = input.timestamp.as_deref().unwrap_or(&ts);

    // What the scheme signs, with the headers as they will be sent.
    let prefix = match provider {
        Provider::Standard => format!("{id}.{signed_ts}."),
        Provider::Stripe => format!("{ts}."),
        Provider::Slack => format!("v0:{signed_ts}:"),
        _ => String::new(),
    };
    let real = hmac::sign(&key(provider), &[prefix.as_bytes(), &input.body].concat());
    let real = real.as_ref();
    let real_encoded = encode(provider, real);

    let separator = input.separator.as_deref().unwrap_or(match provider {
        Provider::Stripe => ",",
        _ => " ",
    });
    let value = input
        .tokens
        .iter()
        .take(24)
        .map(|t| match t {
            Token::Real => format!("{}{real_encoded}", marker(provider)),
            Token::Flipped(bit) => {
                let mut mac = real.to_vec();
                mac[usize::from(bit / 8) % 32] ^= 1 << (bit % 8);
                format!("{}{}", marker(provider), encode(provider, &mac))
            }
            Token::Wrong(mac) => format!("{}{}", marker(provider), encode(provider, mac)),
            Token::Marked(m) => format!("{m}{real_encoded}"),
            Token::Time => format!("t={ts}"),
            Token::OtherTime(text) => format!("t={text}"),
            Token::Raw(text) => text.clone(),
        })
        .collect::<Vec<_>>()
        .join(separator);
    let Ok(value) = HeaderValue::from_str(&value) else {
        return;
    };

    let mut request = Request::post("/hooks/t1").header("x-delivery", "d-1");
    for (name, text) in [
        ("webhook-id", id),
        ("webhook-timestamp", signed_ts),
        ("x-slack-request-timestamp", signed_ts),
    ] {
        let Ok(v) = HeaderValue::from_str(text) else {
            return;
        };
        request = request.header(name, v);
    }
    request = request.header(signature_header(provider), value.clone());
    let mut lines = vec![value];
    if let Some(second) = &input.second_line {
        let Ok(v) = HeaderValue::from_str(second) else {
            return;
        };
        request = request.header(signature_header(provider), v.clone());
        lines.push(v);
    }
    let Ok(request) = request.body(()) else {
        return;
    };
    let (head, ()) = request.into_parts();
    let skew = i64::from(input.skew);
    let now = SystemTime::UNIX_EPOCH + Duration::from_secs(NOW.saturating_add_signed(-skew));

    let result = webhook::verify(settings, &head, &PATH, &input.body, now);

    let text: String = lines
        .iter()
        .map(|l| String::from_utf8_lossy(l.as_bytes()).into_owned())
        .collect::<Vec<_>>()
        .join("\n");
    match &result {
        Ok(_) => {
            let carried = if hex_scheme(provider) {
                text.to_ascii_lowercase().contains(&real_encoded)
            } else {
                text.contains(real_encoded.trim_end_matches('='))
            };
            assert!(carried, "accepted without the real signature: {text:?}");
            assert_eq!(lines.len(), 1, "accepted with two signature lines");
            if provider.signs_timestamp() {
                // The timestamp the real signature covers: Stripe's is the `t=` the real one was
                // computed for; the others' is their header, which must be plain digits.
                let signed = match provider {
                    Provider::Stripe => NOW,
                    _ => {
                        assert!(
                            signed_ts.bytes().all(|b| b.is_ascii_digit()),
                            "{signed_ts:?}"
                        );
                        signed_ts.parse().expect("accepted a timestamp beyond u64")
                    }
                };
                let clock = NOW.saturating_add_signed(-skew);
                assert!(
                    signed.abs_diff(clock) <= TOLERANCE,
                    "accepted outside the window"
                );
            }
        }
        Err(rejection) => {
            assert!(matches!(
                rejection.result(),
                "missing_signature" | "bad_signature" | "stale"
            ));
            let detail = rejection.detail();
            assert!(!detail.is_empty());
            assert!(
                !detail.contains(SECRET) && !detail.contains(&real_encoded),
                "{detail}"
            );
        }
    }

    // The well-formed header, the real signature, inside the window: accepted.
    let canonical = match provider {
        Provider::Stripe => matches!(input.tokens[..], [Token::Time, Token::Real]),
        _ => matches!(input.tokens[..], [Token::Real]),
    };
    if canonical
        && input.separator.is_none()
        && input.timestamp.is_none()
        && input.id.is_none()
        && input.second_line.is_none()
        && skew.unsigned_abs() <= TOLERANCE
    {
        assert!(result.is_ok(), "{text:?}: {result:?}");
    }
});
