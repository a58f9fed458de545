//! `upstreams:`: the named services that routes forward to.

use std::collections::BTreeMap;
use std::time::Duration;

use http::Uri;
use http::uri::Scheme;
use serde::Deserialize;

use super::units::{at_most, bounds, duration};
use crate::tls::ClientTls;

/// `upstreams.NAME:` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[serde(expecting = "an upstream: a mapping with url")]
pub(crate) struct RawUpstream {
    /// `http://` or `https://` base URL. Required.
    pub url: String,
    /// Deadline of the connection's making: TCP connect and TLS handshake, within what is
    /// left of `timeout`. Default 2s; must be shorter than `timeout`.
    #[serde(default, with = "duration::option")]
    pub connect_timeout: Option<Duration>,
    /// Deadline until the whole response has arrived. Default 30s.
    #[serde(default = "defaults::upstream_timeout", with = "duration")]
    pub timeout: Duration,
    /// A pooled connection idle this long is never reused (SPEC §4.3). Default 1s: shorter
    /// than the 2s after which gunicorn drops idle connections, and Node's 5s. `0s`: no pooling.
    #[serde(default = "defaults::pool_idle_timeout", with = "duration")]
    pub pool_idle_timeout: Duration,
    /// https: a PEM file of the CA certificates to trust instead of the Mozilla roots.
    /// Default: none (the Mozilla roots).
    #[serde(default)]
    pub ca_file: Option<String>,
    /// `http1` (the default), `h2c` (HTTP/2 without TLS, prior knowledge, on an `http://` URL)
    /// or `h2` (HTTP/2 over TLS with ALPN `h2`, on an `https://` URL).
    #[serde(default)]
    pub protocol: Protocol,
}

/// The HTTP version the proxy speaks to an upstream (SPEC §4.11).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// HTTP/1.1, a pool of connections (the default).
    #[default]
    Http1,
    /// HTTP/2 without TLS, by prior knowledge: many requests on one connection.
    H2c,
    /// HTTP/2 over TLS, negotiated with ALPN `h2`.
    H2,
}

impl Protocol {
    /// As the file writes it.
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Http1 => "http1",
            Protocol::H2c => "h2c",
            Protocol::H2 => "h2",
        }
    }

    /// Whether it is HTTP/2.
    pub fn is_h2(self) -> bool {
        !matches!(self, Protocol::Http1)
    }
}

/// The documented defaults, one function each so serde and the docs agree.
mod defaults {
    use std::time::Duration;

    pub(super) fn connect_timeout() -> Duration {
        Duration::from_secs(2)
    }
    pub(super) fn upstream_timeout() -> Duration {
        Duration::from_secs(30)
    }
    pub(super) fn pool_idle_timeout() -> Duration {
        Duration::from_secs(1)
    }
}

/// One upstream. Equal settings (the files they name holding the same roots too) let a reload
/// keep the upstream's client and its pooled connections.
#[derive(Debug, Clone, PartialEq)]
pub struct UpstreamSettings {
    /// Its name in the file.
    pub name: String,
    /// Base URL (scheme, authority and an optional path prefix).
    pub url: Uri,
    /// Deadline of the connection's making (TCP connect and TLS handshake), shorter than
    /// `timeout`.
    pub connect_timeout: Duration,
    /// Deadline until the whole response has arrived.
    pub timeout: Duration,
    /// A pooled connection idle this long is not reused.
    pub pool_idle_timeout: Duration,
    /// What an https connection to it trusts (`ca_file`, else the Mozilla roots).
    pub tls: ClientTls,
    /// HTTP/1.1, or HTTP/2 with or without TLS.
    pub protocol: Protocol,
    /// The `X-Forwarded-Proto` it is sent: the scheme of the proxy's own listener (`https`
    /// with `tls:`), resolved at load because one listener has one scheme, so a request
    /// only copies it.
    pub forwarded_proto: Scheme,
}

/// Checks every upstream, keeping those that passed, by name.
pub(super) fn validate(
    upstreams: &BTreeMap<String, RawUpstream>,
    forwarded_proto: &Scheme,
    err: &mut impl FnMut(String, String),
) -> BTreeMap<String, UpstreamSettings> {
    let mut valid = BTreeMap::new();
    for (name, up) in upstreams {
        if let Some(u) = up.validate(name, forwarded_proto, err) {
            valid.insert(name.clone(), u);
        }
    }
    valid
}

impl RawUpstream {
    fn validate(
        &self,
        name: &str,
        forwarded_proto: &Scheme,
        err: &mut impl FnMut(String, String),
    ) -> Option<UpstreamSettings> {
        let path = format!("upstreams.{name}");
        let mut ok = self.check_timeouts(&path, err);
        let url = self.base_url(&path, err);
        if let Some(url) = &url {
            ok &= self.check_protocol(url, &path, err);
        }
        let tls = self.tls(url.as_ref(), &path, err);
        match (url, tls) {
            (Some(url), Some(tls)) if ok => Some(UpstreamSettings {
                name: name.to_owned(),
                url,
                connect_timeout: self.connect_timeout(),
                timeout: self.timeout,
                pool_idle_timeout: self.pool_idle_timeout,
                tls,
                protocol: self.protocol,
                forwarded_proto: forwarded_proto.clone(),
            }),
            _ => None,
        }
    }

    /// `h2c` on an `http://` URL, `h2` on an `https://` one. False: an error was reported.
    fn check_protocol(&self, url: &Uri, path: &str, err: &mut impl FnMut(String, String)) -> bool {
        let https = url.scheme() == Some(&Scheme::HTTPS);
        let why = match (self.protocol, https) {
            (Protocol::H2c, true) => {
                "h2c is HTTP/2 without TLS: use it with an http:// url, or protocol: h2 for https://"
            }
            (Protocol::H2, false) => {
                "h2 is HTTP/2 over TLS (ALPN h2): use it with an https:// url, or protocol: h2c for http://"
            }
            _ => return true,
        };
        err(format!("{path}.protocol"), why.into());
        false
    }

    /// `connect_timeout` as written, or its default.
    fn connect_timeout(&self) -> Duration {
        self.connect_timeout
            .unwrap_or_else(defaults::connect_timeout)
    }

    /// False: an error was reported.
    fn check_timeouts(&self, path: &str, err: &mut impl FnMut(String, String)) -> bool {
        let mut ok = true;
        let connect_timeout = self.connect_timeout();
        at_most(
            err,
            &format!("{path}.connect_timeout"),
            connect_timeout,
            bounds::CONNECT_TIMEOUT,
        );
        at_most(
            err,
            &format!("{path}.timeout"),
            self.timeout,
            bounds::UPSTREAM_TIMEOUT,
        );
        at_most(
            err,
            &format!("{path}.pool_idle_timeout"),
            self.pool_idle_timeout,
            bounds::POOL_IDLE_TIMEOUT,
        );
        if connect_timeout.is_zero() {
            err(
                format!("{path}.connect_timeout"),
                "must be greater than zero".into(),
            );
            ok = false;
        }
        if self.timeout.is_zero() {
            err(
                format!("{path}.timeout"),
                "must be greater than zero".into(),
            );
            ok = false;
        }
        // The connection is made within what is left of `timeout` as well: a `connect_timeout`
        // as long would never end a connect as a connect failure (nothing sent, the claim
        // released), only as a response timeout, which under `on_unknown_outcome: keep` is a
        // saved 504 for a request never sent (SPEC §4.4).
        if !connect_timeout.is_zero() && !self.timeout.is_zero() && connect_timeout >= self.timeout
        {
            let written = if self.connect_timeout.is_some() {
                ""
            } else {
                " (the default, as it is not set)"
            };
            err(
                format!("{path}.connect_timeout"),
                format!(
                    "{}{written} must be shorter than {path}.timeout ({}): the connection is made within what is left of timeout; lower connect_timeout or raise timeout",
                    humantime::format_duration(connect_timeout),
                    humantime::format_duration(self.timeout),
                ),
            );
            ok = false;
        }
        ok
    }

    fn base_url(&self, path: &str, err: &mut impl FnMut(String, String)) -> Option<Uri> {
        match self.url.parse::<Uri>() {
            Ok(u)
                if matches!(u.scheme_str(), Some("http") | Some("https"))
                    && u.authority().is_some()
                    && u.query().is_none() =>
            {
                Some(u)
            }
            _ => {
                err(
                    format!("{path}.url"),
                    format!(
                        "invalid upstream URL {:?}: expected http://HOST[:PORT][/PREFIX] or https://…, without a query",
                        self.url
                    ),
                );
                None
            }
        }
    }

    /// What an https connection trusts; `url` is `None` when it did not parse.
    fn tls(
        &self,
        url: Option<&Uri>,
        path: &str,
        err: &mut impl FnMut(String, String),
    ) -> Option<ClientTls> {
        let https = url.and_then(Uri::scheme) == Some(&Scheme::HTTPS);
        let tls = match &self.ca_file {
            // A CA file on a cleartext upstream would be silently unused: say so instead.
            Some(_) if url.is_some() && !https => Err((
                format!("{path}.ca_file"),
                "applies to https:// upstreams only; this url is http://".to_owned(),
            )),
            Some(file) => {
                ClientTls::private_roots(file).map_err(|m| (format!("{path}.ca_file"), m))
            }
            None => ClientTls::public_roots().map_err(|m| (path.to_owned(), m)),
        };
        tls.map_err(|(field, message)| err(field, message)).ok()
    }
}
