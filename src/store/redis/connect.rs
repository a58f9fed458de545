//! Building Redis clients from the configuration: the URL or seed nodes, plus the password and
//! CA certificates that do not sit in the URL (`store.password_file` / `password_env`,
//! `store.ca_file`).
//!
//! Nothing here connects: every client is lazy, so the proxy starts while Redis is down.

use std::time::Duration;

use redis::cluster::{ClusterClient, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::{ConnectionInfo, IntoConnectionInfo, RedisResult};

use crate::config::RedisAccess;

/// `url` with the password from outside it, if any.
fn connection_info(url: &str, access: &RedisAccess) -> RedisResult<ConnectionInfo> {
    let info = url.into_connection_info()?;
    Ok(match &access.password {
        Some(password) => {
            let settings = info
                .redis_settings()
                .clone()
                .set_password(password.expose());
            info.set_redis_settings(settings)
        }
        None => info,
    })
}

/// A client for one Redis server: `url`, plus the password and CA of `access`.
pub(crate) fn client(url: &str, access: &RedisAccess) -> RedisResult<redis::Client> {
    let info = connection_info(url, access)?;
    match access.certificates() {
        // Parses the PEM now: a CA file that is not one fails here, at start.
        Some(certs) => redis::Client::build_with_tls(info, certs),
        None => redis::Client::open(info),
    }
}

/// A client for a Redis Cluster reached through `nodes`, plus the password and CA of `access`.
/// Every attempt, response and retry is kept short: a redirect or a retry must fit in one
/// store operation's deadline (`timeout`), which the store applies on top.
pub(crate) fn cluster_client(
    nodes: &[String],
    access: &RedisAccess,
    timeout: Duration,
) -> RedisResult<ClusterClient> {
    let infos = nodes
        .iter()
        .map(|n| n.as_str().into_connection_info())
        .collect::<RedisResult<Vec<_>>>()?;
    let mut builder = ClusterClient::builder(infos)
        .connection_timeout(timeout)
        .response_timeout(timeout)
        // The crate's default back-off starts at 1.28s, longer than a whole store operation
        // may take: a retry after a connection error (a node failing over) would never run.
        .min_retry_wait(10)
        .max_retry_wait(100)
        .retries(8);
    if let Some(password) = &access.password {
        builder = builder.password(password.expose());
    }
    if let Some(certs) = access.certificates() {
        builder = builder.certs(certs);
    }
    builder.build()
}

/// A cluster connection that connects in the background and keeps following the cluster's
/// topology (MOVED, ASK, failovers) by itself.
pub(crate) fn cluster_connection(client: &ClusterClient, timeout: Duration) -> ClusterConnection {
    client.get_pending_async_connection_with_config(
        ClusterConfig::new()
            .set_connection_timeout(timeout)
            .set_response_timeout(timeout),
    )
}
