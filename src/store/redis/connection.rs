//! What the Redis store runs on: one Redis or a Redis Cluster, behind one trait.

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, ResponsePolicy, RoutingInfo};
use redis::{RedisResult, Value};

/// A connection the store can run on: one Redis ([`ConnectionManager`]) or a Redis Cluster
/// ([`ClusterConnection`]). Single-key commands go through [`ConnectionLike`] on both; what
/// concerns every server goes through these methods.
pub trait RedisConnection: ConnectionLike + Clone + Send + Sync + 'static {
    /// Runs `cmd` on every server the store uses, giving each server's answer (an error
    /// answer as [`Value::ServerError`]) with its `host:port`, empty for a single Redis.
    fn on_every_node(
        &self,
        cmd: redis::Cmd,
    ) -> impl Future<Output = RedisResult<Vec<(String, Value)>>> + Send;

    /// Readiness: every key can be served. One Redis answers `PING`; on a cluster, the
    /// primary of every slot does (a replica that is down serves no key).
    fn ping(&self) -> impl Future<Output = RedisResult<()>> + Send;

    /// Whether a command refused a connection gets one more try ([`resend`](super::resend)): where the
    /// refusal may be a stale one and the next try a fresh connection attempt.
    const FRESH_ATTEMPT_AFTER_REFUSAL: bool;
}

impl RedisConnection for ConnectionManager {
    const FRESH_ATTEMPT_AFTER_REFUSAL: bool = true;

    async fn on_every_node(&self, cmd: redis::Cmd) -> RedisResult<Vec<(String, Value)>> {
        let mut conn = self.clone();
        let value = match cmd.query_async::<Value>(&mut conn).await {
            Ok(v) => v,
            Err(e) => match e.try_into() {
                Ok(server_error) => Value::ServerError(server_error),
                Err(e) => return Err(e),
            },
        };
        Ok(vec![(String::new(), value)])
    }

    async fn ping(&self) -> RedisResult<()> {
        let mut conn = self.clone();
        redis::cmd("PING").query_async::<String>(&mut conn).await?;
        Ok(())
    }
}

impl RedisConnection for ClusterConnection {
    const FRESH_ATTEMPT_AFTER_REFUSAL: bool = false;

    async fn on_every_node(&self, cmd: redis::Cmd) -> RedisResult<Vec<(String, Value)>> {
        let mut conn = self.clone();
        // No response policy: the cluster client then answers with a map of each node's
        // address to its answer.
        let answers = conn
            .route_command(
                cmd,
                RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllNodes, None)),
            )
            .await?;
        let Value::Map(pairs) = answers else {
            return Err(redis::RedisError::from((
                redis::ErrorKind::Client,
                "a command sent to every cluster node did not answer per node",
            )));
        };
        Ok(pairs
            .into_iter()
            .map(|(node, value)| {
                let node = match node {
                    Value::BulkString(b) => String::from_utf8_lossy(&b).into_owned(),
                    other => format!("{other:?}"),
                };
                (node, value)
            })
            .collect())
    }

    async fn ping(&self) -> RedisResult<()> {
        let mut conn = self.clone();
        conn.route_command(
            redis::cmd("PING"),
            RoutingInfo::MultiNode((
                MultipleNodeRoutingInfo::AllMasters,
                Some(ResponsePolicy::AllSucceeded),
            )),
        )
        .await?;
        Ok(())
    }
}
