//! The Redis store's claims that can be resolved: its lease lives inside the value, on Redis's
//! clock (`TIME`, read by each script), and the key's lifetime is its own (`PXAT` when claimed,
//! never shortened after), so a lapsed lease no longer frees the key: it lets a claim take the
//! resolution over, in one script ([`super::scripts::claim_resolvable`]).

use std::time::Duration;

use bytes::Bytes;
use redis::aio::ConnectionLike;
use redis::{RedisResult, Script};

use super::connection::RedisConnection;
use super::scripts::{
    NOW, claim_resolvable, release_resolvable, renew_resolvable, save_resolvable,
};
use super::{RedisStore, bounded, millis};
use crate::metrics::StoreOp;
use crate::store::{Held, ResolvableFound, ResolvableTimes, StoreError, StoreKey};

/// The scripts of a claim that can be resolved: its lease lives inside the value, on Redis's
/// clock (`TIME`, read by each script), and the key's lifetime is its own (`PXAT` when
/// claimed, never shortened after), so a lapsed lease no longer frees the key: it lets a claim
/// take the resolution over, in one script.
pub(super) struct ResolvableScripts {
    pub(super) claim: Script,
    pub(super) renew: Script,
    pub(super) save: Script,
    pub(super) release: Script,
    pub(super) now: Script,
}

/// A resolvable claim's token (the fence its scripts compare).
pub(super) fn resolvable_token<'a>(
    op: &'static str,
    held: &'a Held,
) -> Result<&'a [u8], StoreError> {
    held.resolvable()
        .map(|r| &r.token[..])
        .ok_or_else(|| StoreError::Backend {
            op,
            source: "a resolvable claim was expected".into(),
        })
}

impl ResolvableScripts {
    pub(super) fn new() -> ResolvableScripts {
        ResolvableScripts {
            claim: Script::new(&claim_resolvable()),
            renew: Script::new(&renew_resolvable()),
            save: Script::new(&save_resolvable()),
            release: Script::new(&release_resolvable()),
            now: Script::new(NOW),
        }
    }
}

impl<C: RedisConnection> RedisStore<C> {
    /// [`Store::claim_resolvable`](crate::store::Store::claim_resolvable); with `store.wait_replicas`, acknowledged by replicas.
    pub(super) async fn claim_resolvable_acknowledged(
        &self,
        key: &StoreKey,
        held: &Held,
        times: ResolvableTimes,
    ) -> Result<ResolvableFound, StoreError> {
        let token = resolvable_token("claim", held)?;
        let (kind, now, value) = match &self.replicas {
            Some(replicas) => {
                let (dedicated, answer) = replicas
                    .write("claim", |mut conn| async move {
                        self.claim_resolvable_on(&mut conn, key, held, times, token)
                            .await
                    })
                    .await?;
                let (kind, now, value) = answer;
                if kind == 3 {
                    dedicated.give_back();
                } else if let Err(short) = replicas.acknowledged(dedicated, StoreOp::Claim).await {
                    // A fresh claim is released, as any claim too few replicas acknowledged. A
                    // takeover is not: the record may have been sent, and must stay to be
                    // resolved; its lease lapses and the next claim takes it over again.
                    if kind == 1 {
                        let _ = bounded("release", self.timeout, self.release_on(key, held)).await;
                    }
                    return Err(StoreError::ReplicasMissing {
                        op: "claim",
                        wanted: replicas.wanted(),
                        acked: short.acked,
                    });
                }
                (kind, now, value)
            }
            None => {
                self.shared("claim", |mut conn| async move {
                    self.claim_resolvable_on(&mut conn, key, held, times, token)
                        .await
                })
                .await?
            }
        };
        let value = Bytes::from(value);
        match kind {
            1 => Ok(ResolvableFound::Claimed { value, now }),
            2 => Ok(ResolvableFound::TakenOver { value, now }),
            _ => Ok(ResolvableFound::Existing { value }),
        }
    }

    /// The claim script of a resolvable claim on `conn`: `(kind, now, value)`.
    async fn claim_resolvable_on(
        &self,
        conn: &mut impl ConnectionLike,
        key: &StoreKey,
        held: &Held,
        times: ResolvableTimes,
        token: &[u8],
    ) -> RedisResult<(i64, u64, Vec<u8>)> {
        self.resolvable
            .claim
            .key(key.text())
            .arg(held.encoded.as_ref())
            .arg(millis(times.lease))
            // 0 is a valid margin here (no `PX` of it): not `millis`, which is at least 1.
            .arg(u64::try_from(times.send_margin.as_millis()).unwrap_or(u64::MAX))
            .arg(millis(times.lifetime))
            .arg(token)
            .invoke_async(conn)
            .await
    }

    /// [`Store::renew`](crate::store::Store::renew) and [`Store::resolving`](crate::store::Store::resolving) of a resolvable claim: `Some(now)` renewed.
    pub(super) async fn renew_resolvable(
        &self,
        key: &StoreKey,
        held: &Held,
        lease: Duration,
        next_lookup_in: Option<Duration>,
    ) -> Result<Option<u64>, StoreError> {
        let token = resolvable_token("renew", held)?;
        let next = next_lookup_in
            .map(|d| millis(d).to_string())
            .unwrap_or_default();
        let (renewed, now): (i64, u64) = self
            .shared("renew", |mut conn| {
                let next = next.clone();
                async move {
                    self.resolvable
                        .renew
                        .key(key.text())
                        .arg(token)
                        .arg(millis(lease))
                        .arg(next)
                        .invoke_async(&mut conn)
                        .await
                }
            })
            .await?;
        Ok((renewed == 1).then_some(now))
    }
}
