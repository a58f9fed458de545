//! Start-up checks of the Redis servers behind the store: each one's eviction policy and
//! version, and the replicas `store.wait_replicas` counts on. Failures to check are logged, not
//! fatal: the proxy must start while Redis is down.

use std::time::Duration;

use redis::{FromRedisValue, Value};

use super::RedisConnection;

/// Runs `cmd` on every node, each answer as `(node, Ok(value) | Err(why))`; a failure to run
/// it at all is one `Err` for the whole store. `server` names the node of a single Redis.
async fn every_node<C: RedisConnection>(
    conn: &C,
    server: &str,
    timeout: Duration,
    cmd: redis::Cmd,
) -> Result<Vec<(String, Result<Value, String>)>, String> {
    match tokio::time::timeout(timeout, conn.on_every_node(cmd)).await {
        Ok(Ok(answers)) => Ok(answers
            .into_iter()
            .map(|(node, value)| {
                let node = if node.is_empty() {
                    server.to_owned()
                } else {
                    node
                };
                match value {
                    Value::ServerError(e) => (node, Err(format!("{e:?}"))),
                    v => (node, Ok(v)),
                }
            })
            .collect()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {timeout:?}")),
    }
}

/// Warns loudly about every node that may evict keys (an evicted record is a forgotten
/// operation: a retry would run it twice), and about a Redis too old for `SET NX GET`.
pub(crate) async fn check_servers<C: RedisConnection>(conn: &C, server: &str, timeout: Duration) {
    let mut cmd = redis::cmd("CONFIG");
    cmd.arg("GET").arg("maxmemory-policy");
    match every_node(conn, server, timeout, cmd).await {
        Ok(answers) => {
            for (node, answer) in answers {
                let policy = answer
                    .and_then(|v| Vec::<String>::from_redis_value(v).map_err(|e| e.to_string()));
                match policy.as_deref().map(|v| v.get(1).map(String::as_str)) {
                    Ok(Some("noeviction")) => {
                        tracing::info!(node = %node, "redis maxmemory-policy is noeviction");
                    }
                    Ok(Some(other)) => tracing::warn!(
                        node = %node,
                        policy = other,
                        "REDIS MAY EVICT IDEMPOTENCY RECORDS: maxmemory-policy is {other}, not \
                         noeviction, on {node}. An evicted record is a forgotten operation: a \
                         retry would run it twice. Set `maxmemory-policy noeviction` on every \
                         Redis the store uses."
                    ),
                    Ok(None) => tracing::warn!(
                        node = %node,
                        "could not read redis maxmemory-policy on {node} (CONFIG GET returned nothing); make sure it is noeviction"
                    ),
                    Err(e) => tracing::warn!(
                        node = %node,
                        error = %e,
                        "could not read redis maxmemory-policy on {node}; make sure it is noeviction"
                    ),
                }
            }
        }
        Err(e) => tracing::warn!(
            error = %e,
            "could not read redis maxmemory-policy; make sure it is noeviction"
        ),
    }

    let mut cmd = redis::cmd("INFO");
    cmd.arg("server");
    if let Ok(answers) = every_node(conn, server, timeout, cmd).await {
        for (node, answer) in answers {
            let Ok(info) =
                answer.and_then(|v| String::from_redis_value(v).map_err(|e| e.to_string()))
            else {
                continue;
            };
            let version = field(&info, "redis_version").unwrap_or_default();
            let major: u32 = version
                .split('.')
                .next()
                .and_then(|m| m.parse().ok())
                .unwrap_or(0);
            if major < 7 {
                tracing::error!(
                    node = %node,
                    version = %version,
                    "redis {version} on {node} is too old: idemproxy needs Redis 7.0 or later (SET NX GET); claims will fail"
                );
            }
        }
    }
}

/// With `store.wait_replicas`, warns when the primary has fewer replicas connected than that:
/// every claim would then be refused with a 503 until enough replicas are back.
pub(crate) async fn check_replicas<C: RedisConnection>(
    conn: &C,
    server: &str,
    timeout: Duration,
    wanted: u32,
) {
    let mut cmd = redis::cmd("INFO");
    cmd.arg("replication");
    let Ok(answers) = every_node(conn, server, timeout, cmd).await else {
        return;
    };
    for (node, answer) in answers {
        let Ok(info) = answer.and_then(|v| String::from_redis_value(v).map_err(|e| e.to_string()))
        else {
            continue;
        };
        let connected: u32 = field(&info, "connected_slaves")
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        if connected < wanted {
            tracing::warn!(
                node = %node,
                connected,
                wanted,
                "store.wait_replicas is {wanted} but {node} has {connected} replica(s) connected: \
                 claims will be refused (503) until {wanted} replica(s) acknowledge them"
            );
        } else {
            tracing::info!(node = %node, connected, wanted, "redis replicas for store.wait_replicas");
        }
    }
}

/// `name:value` from an `INFO` answer.
fn field(info: &str, name: &str) -> Option<String> {
    info.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(|v| v.trim().to_owned())
}
