//! `backend: postgres`: the URL (parsed by tokio-postgres's own parser), the schema, the pool,
//! the password and the CA.

use std::fmt;
use std::time::Duration;

use super::{BackendSettings, RawStore, defaults, read_ca};
use crate::config::secret::{Secret, secret};
use crate::config::units::bounds;

/// How to reach PostgreSQL and where the proxy keeps its table.
#[derive(Clone, PartialEq)]
pub struct PostgresSettings {
    /// The connection settings parsed from `store.url` (a `sslmode=verify-ca` or `verify-full`
    /// reads as `require`: the proxy always verifies the server's certificate over TLS).
    pub config: tokio_postgres::Config,
    /// The password (`store.password_file` / `store.password_env`), if not in the URL.
    pub password: Option<Secret>,
    /// PEM CA certificates (`store.ca_file`) that replace the public web roots over TLS.
    pub ca_pem: Option<Vec<u8>>,
    /// The schema of the proxy's tables (a plain lower-case identifier, never quoted).
    pub schema: String,
    /// The most connections one instance opens.
    pub pool_size: u32,
    /// How often expired rows are deleted.
    pub sweep_interval: Duration,
}

impl fmt::Debug for PostgresSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // tokio_postgres::Config's Debug redacts the password.
        f.debug_struct("PostgresSettings")
            .field("config", &self.config)
            .field("password", &self.password)
            .field("ca_pem", &self.ca_pem.as_ref().map(|pem| pem.len()))
            .field("schema", &self.schema)
            .field("pool_size", &self.pool_size)
            .field("sweep_interval", &self.sweep_interval)
            .finish()
    }
}

impl RawStore {
    pub(super) fn postgres(&self, err: &mut impl FnMut(String, String)) -> Option<BackendSettings> {
        let sweep_interval = self.sweep_interval(err);
        let schema = self.schema.as_deref().unwrap_or(defaults::SCHEMA);
        let schema_ok = is_plain_identifier(schema);
        if !schema_ok {
            err(
                "store.schema".into(),
                format!(
                    "{schema:?} is not a plain identifier: 1 to 63 of a-z, 0-9 and _, not starting with a digit"
                ),
            );
        }
        let pool_size = self.pool_size.unwrap_or(defaults::POOL_SIZE);
        let pool_ok = (1..=bounds::POOL_SIZE).contains(&pool_size);
        if !pool_ok {
            err(
                "store.pool_size".into(),
                format!("{pool_size}: must be from 1 to {}", bounds::POOL_SIZE),
            );
        }
        let Some(url) = &self.url else {
            err(
                "store.url".into(),
                "backend postgres needs store.url (postgres://USER@HOST:PORT/DATABASE)".into(),
            );
            return None;
        };
        let config = postgres_config(url, err);
        let password = secret(
            "store.password",
            self.password_file.as_deref(),
            self.password_env.as_deref(),
            err,
        );
        let mut ok =
            !((self.password_file.is_some() || self.password_env.is_some()) && password.is_none());
        let ca_pem = match &self.ca_file {
            None => Some(None),
            Some(path) => read_ca(path, err).map(Some),
        };
        if let Some(config) = &config {
            if password.is_some() && config.get_password().is_some() {
                let field = if self.password_file.is_some() {
                    "store.password_file"
                } else {
                    "store.password_env"
                };
                err(
                    field.into(),
                    "store.url already carries a password; keep one of the two".into(),
                );
                ok = false;
            }
            if self.ca_file.is_some()
                && config.get_ssl_mode() == tokio_postgres::config::SslMode::Disable
            {
                err(
                    "store.ca_file".into(),
                    "is only used over TLS: add sslmode=require to store.url".into(),
                );
                ok = false;
            }
        }
        let (config, ca_pem, sweep_interval) = (config?, ca_pem?, sweep_interval?);
        (ok && schema_ok && pool_ok).then(|| {
            BackendSettings::Postgres(Box::new(PostgresSettings {
                config,
                password,
                ca_pem,
                schema: schema.to_owned(),
                pool_size,
                sweep_interval,
            }))
        })
    }
}

/// 1 to 63 of `a-z`, `0-9`, `_`, not starting with a digit: a name PostgreSQL takes as it is,
/// unquoted, so it can be put into the proxy's statements without quoting rules.
fn is_plain_identifier(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

/// Parses a PostgreSQL URL with tokio-postgres's own parser. libpq's `sslmode=verify-ca` and
/// `verify-full` read as `require`: over TLS the proxy always verifies the server's certificate
/// (against `store.ca_file`, or the public web roots). `None`: an error was reported.
fn postgres_config(
    url: &str,
    err: &mut impl FnMut(String, String),
) -> Option<tokio_postgres::Config> {
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        err(
            "store.url".into(),
            format!(
                "invalid PostgreSQL URL {:?}: it must start with postgres:// or postgresql://",
                redact_url(url)
            ),
        );
        return None;
    }
    let normalized = url
        .replace("sslmode=verify-full", "sslmode=require")
        .replace("sslmode=verify-ca", "sslmode=require");
    match normalized.parse::<tokio_postgres::Config>() {
        Ok(config) if config.get_hosts().is_empty() => {
            err(
                "store.url".into(),
                "names no host (postgres://USER@HOST:PORT/DATABASE)".into(),
            );
            None
        }
        Ok(config) if config.get_user().is_none() => {
            err(
                "store.url".into(),
                "names no user (postgres://USER@HOST:PORT/DATABASE)".into(),
            );
            None
        }
        Ok(mut config) => {
            // tokio-postgres reads an absent sslmode as `prefer`, and the proxy's TLS always
            // verifies the certificate: a server offering TLS with a certificate nobody signed
            // (a distribution's snakeoil) would then be refused where plaintext was meant.
            // Absent means no TLS, as documented; `prefer` must be asked for.
            if !names_sslmode(&normalized) {
                config.ssl_mode(tokio_postgres::config::SslMode::Disable);
            }
            Some(config)
        }
        Err(e) => {
            err("store.url".into(), format!("invalid PostgreSQL URL: {e}"));
            None
        }
    }
}

/// Whether the URL's query names `sslmode`.
fn names_sslmode(url: &str) -> bool {
    url.split_once('?').is_some_and(|(_, query)| {
        form_urlencoded::parse(query.as_bytes()).any(|(name, _)| name == "sslmode")
    })
}

/// The URL with any password replaced by `***`, for an error message.
fn redact_url(url: &str) -> String {
    match (url.find("://"), url.find('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            match userinfo.find(':') {
                Some(colon) => format!(
                    "{}{}:***{}",
                    &url[..scheme + 3],
                    &userinfo[..colon],
                    &url[at..]
                ),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}
