//! The plain claim's steps on Redis: `SET NX PX GET` (with `WAIT` for replicas when asked), the
//! holder's own claim rewritten, the save (in place, or staged for a large record) and the
//! release, each a script that compares the holder's claim first (`scripts.rs`).

use std::time::Duration;

use bytes::Bytes;
use redis::RedisResult;
use redis::aio::ConnectionLike;

use super::replicas::Replicas;
use super::resolvable::resolvable_token;
use super::{RedisConnection, RedisStore, backend, bounded, millis, staged};
use crate::metrics::StoreOp;
use crate::store::{Held, StoreError, StoreKey};

impl<C: RedisConnection> RedisStore<C> {
    /// `SET key held NX PX lease GET` on `conn`: what the key held before, if anything. One
    /// atomic step: set if absent, and return the previous value if there was one.
    pub(super) async fn set_nx_get(
        conn: &mut impl ConnectionLike,
        key: &StoreKey,
        held: &Held,
        lease: Duration,
    ) -> RedisResult<Option<Vec<u8>>> {
        redis::cmd("SET")
            .arg(key.text())
            .arg(held.encoded.as_ref())
            .arg("NX")
            .arg("PX")
            .arg(millis(lease))
            .arg("GET")
            .query_async(conn)
            .await
    }

    /// What a claim found, given what the key held before its `SET NX GET`. Finding our own
    /// claim there means this very command was sent twice (after a connection error, by the
    /// cluster client or by [`resend`](super::resend); the first attempt landed): the claim is ours.
    pub(super) fn found(previous: Option<Vec<u8>>, held: &Held) -> Option<Bytes> {
        previous
            .filter(|p| p.as_slice() != held.encoded.as_ref())
            .map(Bytes::from)
    }

    /// A claim sent again found its own claim: the first try landed, on a connection that
    /// broke before its answer came back. `WAIT` waits for the replication offset its
    /// connection last noted: Redis 7.0 notes it after every command, but the current Redis
    /// source only after a command that propagated a write, and then the `WAIT` to come would
    /// not cover that first `SET`. Renewing the claim here is a write on this connection, later
    /// in the replication stream than the `SET`, whatever the version.
    pub(super) async fn rewrite_own_claim(
        &self,
        conn: &mut impl ConnectionLike,
        key: &StoreKey,
        held: &Held,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let renewal = async {
            self.renew
                .key(key.text())
                .arg(held.encoded.as_ref())
                .arg(millis(lease))
                .invoke_async::<i64>(conn)
                .await
                .map_err(backend("claim"))
        };
        match bounded("claim", self.timeout, renewal).await? {
            1 => Ok(()),
            // Within one store.timeout (shorter than any lease) nobody else can take the key.
            _ => Err(StoreError::Backend {
                op: "claim",
                source: "the claim vanished right after it was taken".into(),
            }),
        }
    }

    /// The compare-and-set of a save on `conn`: inline (the record is an argument of the
    /// script), or, for a large record, staged ([`staged`]).
    pub(super) async fn save_on(
        &self,
        mut conn: impl ConnectionLike + Clone + Send,
        key: &StoreKey,
        held: &Held,
        done: &Bytes,
        ttl: Duration,
    ) -> RedisResult<bool> {
        let key = key.text();
        // A resolvable claim is fenced on its token (its value changes as its lease is
        // renewed), so the staged path, which compares whole values, does not apply: the
        // record goes inline. Resolutions are rare, and their records are bounded by
        // `max_response_body` like any.
        if let Some(r) = held.resolvable() {
            let n: i64 = self
                .resolvable
                .save
                .key(key)
                .arg(&r.token[..])
                .arg(done.as_ref())
                .arg(millis(ttl))
                .invoke_async(&mut conn)
                .await?;
            return Ok(n == 1);
        }
        if done.len() >= staged::STAGE_FROM
            && let Some(staging) = staged::staging_key(&key, held)
        {
            return staged::save(&self.save_staged, conn, &key, &staging, held, done, ttl).await;
        }
        let n: i64 = self
            .save
            .key(key)
            .arg(held.encoded.as_ref())
            .arg(done.as_ref())
            .arg(millis(ttl))
            .invoke_async(&mut conn)
            .await?;
        Ok(n == 1)
    }

    /// A claim that `replicas` must acknowledge: the `SET` and its `WAIT` on one dedicated
    /// connection. Too few acknowledgements in time: the claim is released (holder-only, so a
    /// claim that expired meanwhile and was taken by another request is left alone) and the
    /// answer is [`StoreError::ReplicasMissing`], so nothing is forwarded.
    pub(super) async fn claim_acknowledged(
        &self,
        replicas: &Replicas,
        key: &StoreKey,
        held: &Held,
        lease: Duration,
    ) -> Result<Option<Bytes>, StoreError> {
        let (mut dedicated, previous) = replicas
            .write("claim", |mut conn| async move {
                Self::set_nx_get(&mut conn, key, held, lease).await
            })
            .await?;
        if previous.as_deref() == Some(held.encoded.as_ref()) {
            self.rewrite_own_claim(dedicated.conn(), key, held, lease)
                .await?;
        }
        let previous = Self::found(previous, held);
        if previous.is_some() {
            // Nothing was written: there is nothing to wait for.
            dedicated.give_back();
            return Ok(previous);
        }
        let Err(short) = replicas.acknowledged(dedicated, StoreOp::Claim).await else {
            return Ok(None);
        };
        // The release goes over the shared connection: the dedicated one may still be
        // blocked in its WAIT, and a release needs no acknowledgement (at worst the claim
        // outlives a failover and expires with its lease).
        let released = bounded("release", self.timeout, self.release_on(key, held)).await;
        match &released {
            Ok(_) => tracing::warn!(
                key = %key.id_hex(),
                why = %short.why,
                "claim not acknowledged by enough replicas (store.wait_replicas): released, 503"
            ),
            Err(e) => tracing::warn!(
                key = %key.id_hex(),
                why = %short.why,
                error = %e,
                "claim not acknowledged by enough replicas (store.wait_replicas), and releasing it failed: the key stays claimed until its lease expires"
            ),
        }
        Err(StoreError::ReplicasMissing {
            op: "claim",
            wanted: replicas.wanted(),
            acked: short.acked,
        })
    }

    /// A save that `replicas` should acknowledge. Once the compare-and-set has landed,
    /// the result is saved whatever the replicas say: a short acknowledgement is logged and
    /// counted, never an error (an error would make the caller retry a save that is done, and
    /// the retry would find no claim and report a lost lease).
    pub(super) async fn save_acknowledged(
        &self,
        replicas: &Replicas,
        key: &StoreKey,
        held: &Held,
        done: &Bytes,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let (dedicated, saved) = replicas
            .write("complete", |conn| async move {
                self.save_on(conn, key, held, done, ttl).await
            })
            .await?;
        if !saved {
            return Ok(false);
        }
        if let Err(short) = replicas.acknowledged(dedicated, StoreOp::Save).await {
            tracing::warn!(
                key = %key.id_hex(),
                why = %short.why,
                "saved result not acknowledged by enough replicas (store.wait_replicas): a failover now could lose it"
            );
        }
        Ok(true)
    }

    pub(super) async fn release_on(&self, key: &StoreKey, held: &Held) -> Result<bool, StoreError> {
        if held.resolvable().is_some() {
            let token = resolvable_token("release", held)?;
            let n: i64 = self
                .shared("release", |mut conn| async move {
                    self.resolvable
                        .release
                        .key(key.text())
                        .arg(token)
                        .invoke_async(&mut conn)
                        .await
                })
                .await?;
            return Ok(n != 0);
        }
        let n: i64 = self
            .shared("release", |mut conn| async move {
                self.release
                    .key(key.text())
                    .arg(held.encoded.as_ref())
                    .invoke_async(&mut conn)
                    .await
            })
            .await?;
        Ok(n != 0)
    }
}
