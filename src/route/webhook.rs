//! A webhook route's compiled settings (SPEC §4.9): which provider's scheme signs its
//! deliveries, the secrets as HMAC keys, and the window for a signed timestamp.
//!
//! The configuration builds them (it reads `secrets_file` or `secrets_env`, then hands the text
//! to [`Secrets::parse`]); `crate::webhook` verifies deliveries with them. They live here, with
//! the other compiled route settings, because the route table holds them and the route module
//! imports nothing of the flow.

use std::fmt;
use std::time::Duration;

use base64::Engine as _;
use http::HeaderName;
use ring::hmac;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::KeyPart;

/// The most secrets a route reads. Every secret costs one HMAC over the whole body of every
/// delivery; a rotation needs two, so a file with more than this is a mistake (a wrong path),
/// not a rotation.
pub const MAX_SECRETS: usize = 16;

/// A webhook route's verification settings, compiled.
#[derive(Debug, Clone, PartialEq)]
pub struct WebhookSettings {
    /// Whose scheme signs the deliveries.
    pub provider: Provider,
    /// Every secret that is accepted (two during a rotation).
    pub secrets: Secrets,
    /// For the schemes that sign a timestamp (`standard`, `stripe`, `slack`): how far it may be
    /// from the proxy's clock, in the past or in the future.
    pub tolerance: Duration,
}

/// A provider's signature scheme (SPEC §4.9's table).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Provider {
    /// Standard Webhooks (Svix and the services built on it): `webhook-id`,
    /// `webhook-timestamp`, `webhook-signature: v1,<base64> …`; secret `whsec_<base64>`.
    Standard,
    /// `Stripe-Signature: t=<ts>,v1=<hex>[,v1=<hex>]`; the event id is the body's `id`.
    Stripe,
    /// `X-Hub-Signature-256: sha256=<hex>`; the event id is `X-GitHub-Delivery`.
    Github,
    /// `X-Shopify-Hmac-Sha256: <base64>`; the event id is `X-Shopify-Webhook-Id`.
    Shopify,
    /// `X-Slack-Signature: v0=<hex>` with `X-Slack-Request-Timestamp`; the event id is the
    /// body's `event_id`.
    Slack,
    /// A provider of its own: HMAC-SHA256 of the body in a configured header.
    Hmac(HmacScheme),
}

impl Provider {
    /// The provider as configured (`provider:`), for logs and messages.
    pub fn name(&self) -> &'static str {
        match self {
            Provider::Standard => "standard",
            Provider::Stripe => "stripe",
            Provider::Github => "github",
            Provider::Shopify => "shopify",
            Provider::Slack => "slack",
            Provider::Hmac(_) => "hmac",
        }
    }

    /// How long the provider redelivers an event that was not acknowledged with a `2xx`, and
    /// that window in words; `None` where it redelivers nothing on its own (GitHub) or is not
    /// known (`hmac`). A webhook route's `ttl` shorter than this is warned about.
    pub fn redelivery_window(&self) -> Option<(Duration, &'static str)> {
        const HOUR: u64 = 3600;
        match self {
            Provider::Stripe => Some((Duration::from_secs(72 * HOUR), "up to three days")),
            Provider::Standard => Some((
                Duration::from_secs(36 * HOUR),
                "Svix's schedule: about a day and a half",
            )),
            Provider::Shopify => Some((Duration::from_secs(4 * HOUR), "about 4 hours")),
            Provider::Slack => Some((Duration::from_secs(600), "a few minutes")),
            Provider::Github | Provider::Hmac(_) => None,
        }
    }

    /// Whether the scheme signs its event id, so that the id is the key (`standard`, `stripe`,
    /// `slack`, `hmac` with a `json:` id); the others sign the body alone, which is the key.
    pub fn signs_event_id(&self) -> bool {
        match self {
            Provider::Standard | Provider::Stripe | Provider::Slack => true,
            Provider::Github | Provider::Shopify => false,
            Provider::Hmac(scheme) => matches!(scheme.id, KeyPart::Json(_)),
        }
    }

    /// Whether the scheme signs a timestamp, so that `tolerance` applies to it.
    pub fn signs_timestamp(&self) -> bool {
        matches!(
            self,
            Provider::Standard | Provider::Stripe | Provider::Slack
        )
    }
}

/// The `hmac` provider's scheme: HMAC-SHA256 over the body, carried in one header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HmacScheme {
    /// The header that carries the signature (`signature_header`, required).
    pub signature_header: HeaderName,
    /// How the signature's bytes are written.
    pub encoding: Encoding,
    /// Text before the encoded signature, as in `sha256=` (empty: none).
    pub prefix: String,
    /// Where the event id is read (`id`, a `key_from` part, required).
    pub id: KeyPart,
}

/// How an `hmac` provider writes its signature.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    /// Hexadecimal, either case (the default).
    #[default]
    Hex,
    /// Standard base64 (`+/`), padded or not.
    Base64,
}

/// The secrets a route accepts, each ready as an HMAC-SHA256 key. Never printed: `Debug` says
/// how many there are, nothing more.
#[derive(Clone)]
pub struct Secrets {
    keys: Vec<hmac::Key>,
    /// A random key of this process, for comparing a computed signature with a received one in
    /// constant time (`crate::webhook`'s `mac`): never derived from the secrets.
    compare: hmac::Key,
    /// SHA-256 over the keys' bytes, so that two loads of one file compare equal (a reload
    /// tells what changed) without keeping the secrets' bytes around.
    digest: [u8; 32],
}

/// Why the secrets could not be read. Names a line, never shows a secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretsError {
    /// Nothing but blank lines.
    #[error("no secret: the text is empty or holds only blank lines")]
    Empty,
    /// One line is not a secret of this provider's form.
    #[error("the secret on line {line} {why}")]
    Invalid {
        /// 1-based, counting blank lines.
        line: usize,
        /// What is wrong with it (never the secret).
        why: &'static str,
    },
    /// More than [`MAX_SECRETS`].
    #[error("{count} secrets: at most {MAX_SECRETS} are accepted (a rotation needs two)")]
    TooMany {
        /// How many non-blank lines there are.
        count: usize,
    },
    /// The comparison key could not be drawn.
    #[error("the system's random number generator failed")]
    Random,
}

/// Standard base64, padding optional: the Standard Webhooks libraries decode what they are
/// given, and a secret copied without its `=` is still the same secret.
pub(crate) const BASE64: base64::engine::GeneralPurpose = base64::engine::GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    base64::engine::GeneralPurposeConfig::new()
        .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
);

impl Secrets {
    /// Reads the secrets of `provider` from text, one a line (a file's content or an
    /// environment variable's value). Blank lines (empty or only whitespace) are skipped and a
    /// trailing `\r` is stripped (a file written on Windows); any other whitespace is part of
    /// the secret, except for `standard` and `stripe`, whose secrets contain none, so a space
    /// there is refused as a copy mistake rather than taken as a different secret.
    ///
    /// - `standard`: `whsec_` then base64; the decoded bytes are the key. A line without the
    ///   `whsec_` prefix is read as bare base64, as the Standard Webhooks libraries read it
    ///   (they strip the prefix when it is there and decode the rest).
    /// - `stripe`: the `whsec_…` string itself is the key, as written (Stripe never decodes it).
    /// - `github`, `shopify`, `slack`, `hmac`: the line's bytes are the key.
    pub fn parse(text: &str, provider: &Provider) -> Result<Secrets, SecretsError> {
        let mut raw: Vec<Vec<u8>> = Vec::new();
        for (i, line) in text.split('\n').enumerate() {
            let line = line.strip_suffix('\r').unwrap_or(line);
            if line.trim().is_empty() {
                continue;
            }
            if raw.len() == MAX_SECRETS {
                let count = text.split('\n').filter(|l| !l.trim().is_empty()).count();
                return Err(SecretsError::TooMany { count });
            }
            let invalid = |why| SecretsError::Invalid { line: i + 1, why };
            raw.push(key_bytes(line, provider).map_err(invalid)?);
        }
        if raw.is_empty() {
            return Err(SecretsError::Empty);
        }
        let mut h = Sha256::new();
        h.update(b"idemproxy-webhook-secrets-v1");
        h.update((raw.len() as u64).to_be_bytes());
        for key in &raw {
            h.update((key.len() as u64).to_be_bytes());
            h.update(key);
        }
        let compare = hmac::Key::generate(hmac::HMAC_SHA256, &ring::rand::SystemRandom::new())
            .map_err(|_| SecretsError::Random)?;
        Ok(Secrets {
            keys: raw
                .iter()
                .map(|k| hmac::Key::new(hmac::HMAC_SHA256, k))
                .collect(),
            compare,
            digest: h.finalize().into(),
        })
    }

    /// One random key that no provider holds: the secrets of a route whose `secrets_env` is
    /// not this process's to read (`idemproxy reload` checking a file for a running proxy).
    /// Verifies nothing.
    pub(crate) fn unread() -> Result<Secrets, SecretsError> {
        let rng = ring::rand::SystemRandom::new();
        let key = hmac::Key::generate(hmac::HMAC_SHA256, &rng).map_err(|_| SecretsError::Random)?;
        let compare =
            hmac::Key::generate(hmac::HMAC_SHA256, &rng).map_err(|_| SecretsError::Random)?;
        Ok(Secrets {
            keys: vec![key],
            compare,
            digest: [0; 32],
        })
    }

    /// How many secrets there are.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Never true: [`Secrets::parse`] refuses an empty text.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The HMAC keys, in the order of their lines.
    pub(crate) fn keys(&self) -> &[hmac::Key] {
        &self.keys
    }

    /// The process's comparison key (see the field).
    pub(crate) fn compare_key(&self) -> &hmac::Key {
        &self.compare
    }
}

/// The HMAC key one line stands for.
fn key_bytes(line: &str, provider: &Provider) -> Result<Vec<u8>, &'static str> {
    let no_whitespace = || {
        if line.contains(char::is_whitespace) {
            Err("contains whitespace, which this provider's secrets never do")
        } else {
            Ok(())
        }
    };
    match provider {
        Provider::Standard => {
            no_whitespace()?;
            let encoded = line.strip_prefix("whsec_").unwrap_or(line);
            let key = BASE64
                .decode(encoded)
                .map_err(|_| "is not base64 after whsec_ (Standard Webhooks: whsec_<base64>)")?;
            if key.is_empty() {
                return Err("is empty after whsec_");
            }
            Ok(key)
        }
        Provider::Stripe => {
            no_whitespace()?;
            Ok(line.as_bytes().to_vec())
        }
        Provider::Github | Provider::Shopify | Provider::Slack | Provider::Hmac(_) => {
            Ok(line.as_bytes().to_vec())
        }
    }
}

impl PartialEq for Secrets {
    fn eq(&self, other: &Secrets) -> bool {
        // The digest covers every key's bytes in order; the comparison key is the process's
        // own and says nothing about the secrets.
        self.digest == other.digest
    }
}

impl fmt::Debug for Secrets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secrets(<{} redacted>)", self.keys.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hmac_scheme() -> Provider {
        Provider::Hmac(HmacScheme {
            signature_header: HeaderName::from_static("x-signature"),
            encoding: Encoding::Hex,
            prefix: String::new(),
            id: KeyPart::Method,
        })
    }

    /// The key a parsed secret stands for, seen through the MAC it makes.
    fn mac(secrets: &Secrets, i: usize) -> Vec<u8> {
        hmac::sign(&secrets.keys()[i], b"probe").as_ref().to_vec()
    }

    fn mac_with(key: &[u8]) -> Vec<u8> {
        hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, key), b"probe")
            .as_ref()
            .to_vec()
    }

    #[test]
    fn standard_secrets_are_base64_after_whsec() {
        let s = Secrets::parse(
            "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\n",
            &Provider::Standard,
        )
        .expect("valid");
        let key = BASE64
            .decode("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
            .expect("base64");
        assert_eq!(s.len(), 1);
        assert_eq!(mac(&s, 0), mac_with(&key));
        // Bare base64 is the same secret, as the Standard Webhooks libraries read it.
        let bare =
            Secrets::parse("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", &Provider::Standard).expect("valid");
        assert_eq!(bare, s);
        // Padding is optional.
        let padded = Secrets::parse("whsec_YWJjZA==", &Provider::Standard).expect("valid");
        let unpadded = Secrets::parse("whsec_YWJjZA", &Provider::Standard).expect("valid");
        assert_eq!(padded, unpadded);
        assert_eq!(mac(&padded, 0), mac_with(b"abcd"));
    }

    #[test]
    fn stripe_secrets_are_used_as_written() {
        let s = Secrets::parse("whsec_abc123", &Provider::Stripe).expect("valid");
        assert_eq!(mac(&s, 0), mac_with(b"whsec_abc123"));
        for provider in [
            Provider::Github,
            Provider::Shopify,
            Provider::Slack,
            hmac_scheme(),
        ] {
            let s = Secrets::parse("It's a Secret to Everybody", &provider).expect("valid");
            assert_eq!(mac(&s, 0), mac_with(b"It's a Secret to Everybody"));
        }
    }

    #[test]
    fn one_secret_a_line_blank_lines_and_crlf_skipped() {
        let s = Secrets::parse("\r\none\r\n\n  \ntwo\n", &Provider::Github).expect("valid");
        assert_eq!(s.len(), 2);
        assert_eq!(mac(&s, 0), mac_with(b"one"));
        assert_eq!(mac(&s, 1), mac_with(b"two"));
        assert_eq!(
            Secrets::parse("one\ntwo", &Provider::Github),
            Ok(s.clone()),
            "equal by content"
        );
        assert_ne!(
            Secrets::parse("two\none", &Provider::Github).expect("valid"),
            s,
            "order counts: a reload that swaps them is a change"
        );
    }

    #[test]
    fn bad_secrets_are_refused_without_being_shown() {
        for (text, provider, want) in [
            ("", Provider::Standard, SecretsError::Empty),
            (" \n\r\n\t", Provider::Github, SecretsError::Empty),
            (
                "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\nwhsec_not*base64",
                Provider::Standard,
                SecretsError::Invalid {
                    line: 2,
                    why: "is not base64 after whsec_ (Standard Webhooks: whsec_<base64>)",
                },
            ),
            (
                "whsec_",
                Provider::Standard,
                SecretsError::Invalid {
                    line: 1,
                    why: "is empty after whsec_",
                },
            ),
            (
                "\nwhsec_abc ",
                Provider::Stripe,
                SecretsError::Invalid {
                    line: 2,
                    why: "contains whitespace, which this provider's secrets never do",
                },
            ),
        ] {
            let error = Secrets::parse(text, &provider).expect_err(text);
            assert_eq!(error, want, "{text:?}");
            let shown = error.to_string();
            assert!(
                !shown.contains("not*base64") && !shown.contains("abc"),
                "{shown}"
            );
        }
        let many: String = (0..=MAX_SECRETS).map(|i| format!("s{i}\n")).collect();
        assert_eq!(
            Secrets::parse(&many, &Provider::Github),
            Err(SecretsError::TooMany {
                count: MAX_SECRETS + 1
            })
        );
    }

    #[test]
    fn debug_never_shows_a_secret() {
        let s = Secrets::parse("whsec_topsecret\nother", &Provider::Stripe).expect("valid");
        let settings = WebhookSettings {
            provider: Provider::Stripe,
            secrets: s,
            tolerance: Duration::from_secs(300),
        };
        let shown = format!("{settings:?}");
        assert!(shown.contains("Secrets(<2 redacted>)"), "{shown}");
        assert!(
            !shown.contains("topsecret") && !shown.contains("other"),
            "{shown}"
        );
    }
}
