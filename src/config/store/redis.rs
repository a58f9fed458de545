//! `backend: redis` and `backend: redis-cluster`: the URL or the seed nodes (checked with the
//! redis crate's own parsers, which connect nothing), the password and the CA.

use std::fmt;

use super::{BackendSettings, RawStore, defaults, read_ca};
use crate::config::secret::{Secret, secret};
use crate::config::units::bounds;

/// How to authenticate to Redis and trust its certificate, beyond what the URL says.
#[derive(Clone, Default, PartialEq)]
pub struct RedisAccess {
    /// The password (`store.password_file` / `store.password_env`), sent with `AUTH`.
    pub password: Option<Secret>,
    /// PEM CA certificates (`store.ca_file`) that replace the public web roots for `rediss://`.
    pub ca_pem: Option<Vec<u8>>,
}

impl RedisAccess {
    /// The CA certificates to trust instead of the public web roots, if `store.ca_file` names
    /// any, in the form the redis crate takes them.
    pub(crate) fn certificates(&self) -> Option<redis::TlsCertificates> {
        self.ca_pem.as_ref().map(|pem| redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(pem.clone()),
        })
    }
}

impl fmt::Debug for RedisAccess {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisAccess")
            .field("password", &self.password)
            .field(
                "ca_pem",
                &self
                    .ca_pem
                    .as_ref()
                    .map(|pem| format!("<{} bytes>", pem.len())),
            )
            .finish()
    }
}

impl RawStore {
    pub(super) fn redis(&self, err: &mut impl FnMut(String, String)) -> Option<BackendSettings> {
        let mut ok = true;
        if !self.nodes.is_empty() {
            err(
                "store.nodes".into(),
                "is for backend redis-cluster; backend redis takes one store.url".into(),
            );
            ok = false;
        }
        let url = self
            .url
            .clone()
            .unwrap_or_else(|| defaults::REDIS_URL.to_owned());
        let access = self.redis_access(std::slice::from_ref(&url), "store.url", err);
        if !redis_url(&url, "store.url", err) {
            ok = false;
        } else if let Some(certs) = access.as_ref().and_then(RedisAccess::certificates) {
            // The client parses the CA file when it is built: build one (it connects
            // lazily) so that a CA file that is not one fails here, at load.
            if let Err(e) = redis::Client::build_with_tls(url.as_str(), certs) {
                err("store.ca_file".into(), e.to_string());
                ok = false;
            }
        }
        let access = access?;
        ok.then_some(BackendSettings::Redis {
            url,
            access,
            wait_replicas: self.wait_replicas,
        })
    }

    pub(super) fn redis_cluster(
        &self,
        err: &mut impl FnMut(String, String),
    ) -> Option<BackendSettings> {
        let mut ok = self.check_seed_nodes(err);
        let access = self.redis_access(&self.nodes, "store.nodes", err);
        if let (true, Some(access)) = (ok, &access) {
            // The cluster client checks what the URLs alone cannot: the same TLS mode and
            // credentials on every seed node, a CA file that parses. Building one connects
            // nothing. The password of `access` is left out: a URL with one of its own
            // was refused above, so there is nothing to compare it with.
            let mut cluster =
                redis::cluster::ClusterClient::builder(self.nodes.iter().map(String::as_str));
            if let Some(certs) = access.certificates() {
                cluster = cluster.certs(certs);
            }
            if let Err(e) = cluster.build() {
                err("store.nodes".into(), e.to_string());
                ok = false;
            }
        }
        let access = access?;
        ok.then(|| BackendSettings::RedisCluster {
            nodes: self.nodes.clone(),
            access,
        })
    }

    /// What `redis-cluster` asks of `store:`, its seed nodes one by one. False: an error was
    /// reported.
    fn check_seed_nodes(&self, err: &mut impl FnMut(String, String)) -> bool {
        let mut ok = true;
        if self.url.is_some() {
            err(
                "store.url".into(),
                "is for backend redis; list the cluster's seed nodes in store.nodes".into(),
            );
            ok = false;
        }
        if self.wait_replicas != 0 {
            // The cluster client keeps one multiplexed connection per node, and routes
            // WAIT to every primary, not to the key's. A WAIT must run on the connection
            // that wrote the key and blocks it: on the cluster client that stalls every
            // request to that node, and after an ASK redirection the write and the WAIT
            // are not on the same node at all. Refused rather than half-done.
            err(
                "store.wait_replicas".into(),
                "is not supported with backend redis-cluster (the cluster client cannot run WAIT on the connection that wrote the key without stalling every other request to that node); set 0, or use backend redis with a primary and replicas".into(),
            );
            ok = false;
        }
        if self.nodes.is_empty() {
            err(
                "store.nodes".into(),
                "backend redis-cluster needs at least one seed node (redis://HOST:PORT)".into(),
            );
            ok = false;
        }
        if self.nodes.len() > bounds::NODES {
            err(
                "store.nodes".into(),
                format!("{} seed nodes: at most {}", self.nodes.len(), bounds::NODES),
            );
            ok = false;
        }
        for (i, node) in self.nodes.iter().enumerate() {
            ok &= redis_url(node, &format!("store.nodes[{i}]"), err);
        }
        let tls = self
            .nodes
            .iter()
            .filter(|n| n.starts_with("rediss://"))
            .count();
        if tls != 0 && tls != self.nodes.len() {
            err(
                "store.nodes".into(),
                "mixes redis:// and rediss:// (TLS) seed nodes; a cluster is reached one way"
                    .into(),
            );
            ok = false;
        }
        ok
    }

    /// Reads the Redis password (`store.password_file` / `store.password_env`) and CA file
    /// (`store.ca_file`), checking them against the URLs: a password in a URL *and* in a file
    /// is ambiguous, and a CA without `rediss://` would silently not be used. `None`: an error
    /// was reported.
    fn redis_access(
        &self,
        urls: &[String],
        urls_field: &str,
        err: &mut impl FnMut(String, String),
    ) -> Option<RedisAccess> {
        let password = self.redis_password(urls, urls_field, err);
        let ca_pem = self.redis_ca(urls, urls_field, err);
        Some(RedisAccess {
            password: password?,
            ca_pem: ca_pem?,
        })
    }

    /// The password, if one is set outside the URLs. Outer `None`: an error was reported.
    fn redis_password(
        &self,
        urls: &[String],
        urls_field: &str,
        err: &mut impl FnMut(String, String),
    ) -> Option<Option<Secret>> {
        let mut ok = true;
        let password = secret(
            "store.password",
            self.password_file.as_deref(),
            self.password_env.as_deref(),
            err,
        );
        if (self.password_file.is_some() || self.password_env.is_some()) && password.is_none() {
            ok = false;
        }
        let inline_password = urls.iter().any(|u| {
            redis::IntoConnectionInfo::into_connection_info(u.as_str())
                .is_ok_and(|info| info.redis_settings().password().is_some())
        });
        if password.is_some() && inline_password {
            let field = if self.password_file.is_some() {
                "store.password_file"
            } else {
                "store.password_env"
            };
            err(
                field.into(),
                format!("{urls_field} already carries a password; keep one of the two"),
            );
            ok = false;
        }
        ok.then_some(password)
    }

    /// The PEM of `store.ca_file`, if set. Outer `None`: an error was reported.
    fn redis_ca(
        &self,
        urls: &[String],
        urls_field: &str,
        err: &mut impl FnMut(String, String),
    ) -> Option<Option<Vec<u8>>> {
        let Some(path) = &self.ca_file else {
            return Some(None);
        };
        let mut ok = true;
        if !urls.iter().all(|u| u.starts_with("rediss://")) {
            err(
                "store.ca_file".into(),
                format!("is only used over TLS: {urls_field} must use rediss://"),
            );
            ok = false;
        }
        let pem = read_ca(path, err)?;
        ok.then_some(Some(pem))
    }
}

/// Checks one Redis URL with the redis crate's own parser, reporting at `field`. False: an
/// error was reported.
fn redis_url(url: &str, field: &str, err: &mut impl FnMut(String, String)) -> bool {
    if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
        err(
            field.into(),
            format!("invalid Redis URL {url:?}: it must start with redis:// or rediss://"),
        );
        false
    } else if let Err(e) = redis::Client::open(url) {
        err(field.into(), format!("invalid Redis URL: {e}"));
        false
    } else {
        true
    }
}
