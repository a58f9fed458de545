//! `routes[i].webhook:`: a webhook route's provider, secrets and window as written, and how they
//! are checked and compiled into [`WebhookSettings`] (SPEC §4.9). The secrets are read here, so a
//! reload, which reads the whole file again, reads them again too.

use std::path::Path;
use std::time::Duration;

use http::HeaderName;
use serde::Deserialize;

use crate::config::SecretsEnv;
use crate::config::secret::read_text;
use crate::config::units::duration;
use crate::route::{
    Encoding, HmacScheme, KeyPart, PathPattern, Provider, Secrets, WebhookSettings,
};

/// `routes[i].webhook:` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[serde(expecting = "webhook settings: a mapping such as {provider: stripe, secrets_file: PATH}")]
pub(crate) struct RawWebhook {
    /// `standard`, `stripe`, `github`, `shopify`, `slack` or `hmac`. Required.
    pub provider: String,
    /// A file of secrets, one a line.
    #[serde(default)]
    pub secrets_file: Option<String>,
    /// An environment variable holding the secrets, one a line.
    #[serde(default)]
    pub secrets_env: Option<String>,
    /// How far a signed timestamp may be from the proxy's clock, for the schemes that sign
    /// one. Default 5m; 1s to 1h.
    #[serde(default, with = "duration::option")]
    pub tolerance: Option<Duration>,
    /// `hmac`: the header carrying the signature. Required there.
    #[serde(default)]
    pub signature_header: Option<String>,
    /// `hmac`: `hex` (default) or `base64`.
    #[serde(default)]
    pub encoding: Option<Encoding>,
    /// `hmac`: text before the encoded signature, as in `sha256=`.
    #[serde(default)]
    pub prefix: Option<String>,
    /// `hmac`: where the event id is read, a `key_from` part. Required there.
    #[serde(default)]
    pub id: Option<String>,
}

fn default_tolerance() -> Duration {
    Duration::from_secs(300)
}

/// The narrowest `tolerance`: a signed timestamp is whole seconds.
const MIN_TOLERANCE: Duration = Duration::from_secs(1);
/// The widest `tolerance`: a captured delivery is accepted again for as long as this, and
/// every provider's own libraries default to 5 minutes.
const MAX_TOLERANCE: Duration = Duration::from_secs(3600);

/// The providers `provider:` names.
const PROVIDERS: &str = "standard, stripe, github, shopify, slack or hmac";

impl RawWebhook {
    /// Checks the block, reads the secrets and compiles it. `pattern` is the route's path, when
    /// it parsed, for an `hmac` `id: path:NAME`. `None`: an error was reported.
    pub(super) fn validate(
        &self,
        path: &str,
        pattern: Option<&PathPattern>,
        secrets_env: SecretsEnv,
        err: &mut impl FnMut(String, String),
    ) -> Option<WebhookSettings> {
        let provider = self.provider(path, pattern, err)?;
        let tolerance = self.tolerance(path, &provider, err);
        let secrets = self.secrets(path, &provider, secrets_env, err)?;
        Some(WebhookSettings {
            provider,
            secrets,
            tolerance: tolerance?,
        })
    }

    /// `tolerance`, written only for a scheme that signs a timestamp, within 1s..=1h.
    fn tolerance(
        &self,
        path: &str,
        provider: &Provider,
        err: &mut impl FnMut(String, String),
    ) -> Option<Duration> {
        let Some(written) = self.tolerance else {
            return Some(default_tolerance());
        };
        let field = format!("{path}.tolerance");
        if !provider.signs_timestamp() {
            err(
                field,
                format!(
                    "is not used with provider {}, which signs no timestamp (remove it)",
                    provider.name()
                ),
            );
            return None;
        }
        if !(MIN_TOLERANCE..=MAX_TOLERANCE).contains(&written) {
            err(
                field,
                format!(
                    "{} is out of bounds: a tolerance is 1s to 1h (the providers' libraries use 5m)",
                    humantime::format_duration(written)
                ),
            );
            return None;
        }
        Some(written)
    }

    /// The provider, with `hmac`'s fields; the fields of `hmac` refused on any other.
    fn provider(
        &self,
        path: &str,
        pattern: Option<&PathPattern>,
        err: &mut impl FnMut(String, String),
    ) -> Option<Provider> {
        let simple = match self.provider.as_str() {
            "standard" => Some(Provider::Standard),
            "stripe" => Some(Provider::Stripe),
            "github" => Some(Provider::Github),
            "shopify" => Some(Provider::Shopify),
            "slack" => Some(Provider::Slack),
            "hmac" => None,
            other => {
                err(
                    format!("{path}.provider"),
                    format!("unknown provider {other:?}; expected {PROVIDERS}"),
                );
                return None;
            }
        };
        if let Some(provider) = simple {
            let mut ok = true;
            for (field, written) in [
                ("signature_header", self.signature_header.is_some()),
                ("encoding", self.encoding.is_some()),
                ("prefix", self.prefix.is_some()),
                ("id", self.id.is_some()),
            ] {
                if written {
                    err(
                        format!("{path}.{field}"),
                        format!(
                            "is a field of provider hmac; provider {} has its own header and event id",
                            provider.name()
                        ),
                    );
                    ok = false;
                }
            }
            return ok.then_some(provider);
        }
        self.hmac(path, pattern, err).map(Provider::Hmac)
    }

    /// `hmac`'s scheme: `signature_header` and `id` required.
    fn hmac(
        &self,
        path: &str,
        pattern: Option<&PathPattern>,
        err: &mut impl FnMut(String, String),
    ) -> Option<HmacScheme> {
        let signature_header = match &self.signature_header {
            None => {
                err(
                    format!("{path}.signature_header"),
                    "is required with provider hmac: the header that carries the signature".into(),
                );
                None
            }
            Some(text) => HeaderName::from_bytes(text.trim().as_bytes())
                .map_err(|_| {
                    err(
                        format!("{path}.signature_header"),
                        format!("invalid header name {text:?}"),
                    )
                })
                .ok(),
        };
        let id = match &self.id {
            None => {
                err(
                    format!("{path}.id"),
                    "is required with provider hmac: where the event id is read, a key_from part such as header:X-Event-Id or json:/id".into(),
                );
                None
            }
            Some(text) => match KeyPart::parse(text) {
                Ok(KeyPart::Path(name)) if pattern.is_some_and(|p| !p.has_param(&name)) => {
                    err(
                        format!("{path}.id"),
                        format!(
                            "path:{name} names no segment of the route's path; write the path with {{{name}}}"
                        ),
                    );
                    None
                }
                Ok(part) => Some(part),
                Err(message) => {
                    err(format!("{path}.id"), message);
                    None
                }
            },
        };
        Some(HmacScheme {
            signature_header: signature_header?,
            encoding: self.encoding.unwrap_or_default(),
            prefix: self.prefix.clone().unwrap_or_default(),
            id: id?,
        })
    }

    /// The secrets, from `secrets_file` or `secrets_env` (exactly one).
    fn secrets(
        &self,
        path: &str,
        provider: &Provider,
        secrets_env: SecretsEnv,
        err: &mut impl FnMut(String, String),
    ) -> Option<Secrets> {
        let (field, text) = match (&self.secrets_file, &self.secrets_env) {
            (None, None) => {
                err(
                    format!("{path}.secrets_file"),
                    "a webhook route needs its secrets: set secrets_file or secrets_env".into(),
                );
                return None;
            }
            (Some(_), Some(_)) => {
                err(
                    format!("{path}.secrets_file"),
                    "set secrets_file or secrets_env, not both".into(),
                );
                return None;
            }
            (Some(file), None) => ("secrets_file", read_text(Path::new(file))),
            (None, Some(var)) => match std::env::var(var) {
                Ok(text) => ("secrets_env", Ok(text)),
                // Not this process's to read: the running proxy's environment has it.
                Err(_) if secrets_env == SecretsEnv::Optional => {
                    return Secrets::unread()
                        .map_err(|e| err(format!("{path}.secrets_env"), e.to_string()))
                        .ok();
                }
                Err(_) => (
                    "secrets_env",
                    Err(format!(
                        "the environment variable {var} is not set (an environment variable is read at start: set it in the proxy's environment)"
                    )),
                ),
            },
        };
        let field = format!("{path}.{field}");
        let text = text.map_err(|message| err(field.clone(), message)).ok()?;
        Secrets::parse(&text, provider)
            .map_err(|e| err(field, e.to_string()))
            .ok()
    }
}
