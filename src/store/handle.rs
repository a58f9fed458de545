//! [`StoreHandle`]: a backend behind a deadline, every call timed, counted and traced, and the
//! records it reads decoded in one place.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use super::{
    Claim, Forgotten, Held, ResolvableClaim, ResolvableFound, ResolvableTimes, Store, StoreError,
    StoreKey,
};
use crate::metrics::{Metrics, StoreOp};
use crate::record::{DecodeError, Encoded, Record};

/// The span of a store operation (`tracing:`); a save is the save.
fn span_name(op: StoreOp) -> &'static str {
    match op {
        StoreOp::Claim => "idemproxy.store.claim",
        StoreOp::Renew => "idemproxy.store.renew",
        StoreOp::Save => "idemproxy.store.save",
        StoreOp::Release => "idemproxy.store.release",
        StoreOp::Get => "idemproxy.store.get",
        StoreOp::Ping => "idemproxy.store.ping",
        StoreOp::Forget => "idemproxy.store.forget",
    }
}

/// A backend behind a deadline, with every call timed and counted.
#[derive(Clone)]
pub struct StoreHandle {
    inner: Arc<dyn Store>,
    timeout: Duration,
    metrics: Arc<Metrics>,
}

impl StoreHandle {
    /// Wraps a backend.
    pub fn new(inner: Arc<dyn Store>, timeout: Duration, metrics: Arc<Metrics>) -> StoreHandle {
        StoreHandle {
            inner,
            timeout,
            metrics,
        }
    }

    async fn timed<T>(
        &self,
        op: StoreOp,
        fut: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let start = tokio::time::Instant::now();
        let mut span = crate::traces::Child::start(span_name(op));
        let deadline = self.inner.deadline(op, self.timeout);
        let result = match tokio::time::timeout(deadline, fut).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Timeout {
                op: op.as_str(),
                after: deadline,
            }),
        };
        self.metrics.store_op(op, start.elapsed(), result.is_err());
        if result.is_err() {
            span.failed("store error");
        }
        result
    }

    /// See [`Store::claim`]; decodes what the key holds.
    pub async fn claim(
        &self,
        key: &StoreKey,
        held: &Held,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        let found = self
            .timed(StoreOp::Claim, self.inner.claim(key, held, lease))
            .await?;
        match found {
            None => Ok(Claim::Claimed),
            Some(bytes) => Ok(Claim::Existing(Record::decode_shared(&bytes)?)),
        }
    }

    /// See [`Store::renew`].
    pub async fn renew(
        &self,
        key: &StoreKey,
        held: &Held,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.timed(StoreOp::Renew, self.inner.renew(key, held, lease))
            .await
    }

    /// See [`Store::save`]; `done` was encoded once, by [`crate::record`] (a
    /// [`Finished`](crate::record::Finished) record), so a retried save writes the very
    /// same bytes. Records cross here in one direction: the store decodes what it reads, and
    /// never encodes a finished record itself.
    pub async fn save(
        &self,
        key: &StoreKey,
        held: &Held,
        done: &impl Encoded,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let done = done.encoded().clone();
        self.timed(StoreOp::Save, self.inner.save(key, held, done, ttl))
            .await
    }

    /// See [`Store::release`].
    pub async fn release(&self, key: &StoreKey, held: &Held) -> Result<bool, StoreError> {
        self.timed(StoreOp::Release, self.inner.release(key, held))
            .await
    }

    /// See [`Store::get`]; decodes the record.
    pub async fn get(&self, key: &StoreKey) -> Result<Option<Record>, StoreError> {
        let found = self.timed(StoreOp::Get, self.inner.get(key)).await?;
        match found {
            None => Ok(None),
            Some(bytes) => Ok(Some(Record::decode_shared(&bytes)?)),
        }
    }

    /// See [`Store::claim_resolvable`]; decodes what the key holds. A key found holding our
    /// own claim (a claim sent again after its answer was lost, and the first landed) counts
    /// as claimed if it is still in flight, and as taken over if it is resolving: only a
    /// takeover makes it resolving, so a takeover is never mistaken for a fresh claim.
    pub async fn claim_resolvable(
        &self,
        key: &StoreKey,
        held: &Held,
        times: ResolvableTimes,
    ) -> Result<ResolvableClaim, StoreError> {
        if held.resolvable().is_none() {
            return Err(StoreError::Backend {
                op: "claim",
                source: "claim_resolvable needs a resolvable claim (Record::Resolvable)".into(),
            });
        }
        let found = self
            .timed(
                StoreOp::Claim,
                self.inner.claim_resolvable(key, held, times),
            )
            .await?;
        let ours = |value: &Bytes| -> Result<Held, StoreError> {
            let Record::Resolvable(mut r) = Record::decode_shared(value)? else {
                return Err(StoreError::Corrupt(DecodeError(
                    "a resolvable claim was answered with another kind of record",
                )));
            };
            counted_from_timeout(&mut r, times);
            Ok(Held {
                record: Record::Resolvable(r),
                encoded: value.clone(),
            })
        };
        let taken_over = |held: Held, now: u64| {
            let gave_up = held.resolvable().is_some_and(|r| now >= r.gives_up_at());
            ResolvableClaim::TakenOver { held, now, gave_up }
        };
        match found {
            ResolvableFound::Claimed { value, now } => Ok(ResolvableClaim::Claimed {
                held: ours(&value)?,
                now,
            }),
            ResolvableFound::TakenOver { value, now } => Ok(taken_over(ours(&value)?, now)),
            ResolvableFound::Existing { value } => {
                let mut record = Record::decode_shared(&value)?;
                if let Record::Resolvable(r) = &mut record {
                    counted_from_timeout(r, times);
                }
                match (&record, held.record.token()) {
                    (Record::Resolvable(r), Some(token)) if r.token == *token => {
                        let now = r.claimed_at.max(r.next_lookup_at);
                        let held = Held {
                            record: record.clone(),
                            encoded: value,
                        };
                        Ok(match r.phase {
                            crate::record::Phase::InFlight => {
                                ResolvableClaim::Claimed { held, now }
                            }
                            crate::record::Phase::Resolving => taken_over(held, now),
                        })
                    }
                    _ => Ok(ResolvableClaim::Existing(record)),
                }
            }
        }
    }

    /// See [`Store::resolving`].
    pub async fn resolving(
        &self,
        key: &StoreKey,
        held: &Held,
        next_lookup_in: Duration,
        lease: Duration,
    ) -> Result<Option<u64>, StoreError> {
        self.timed(
            StoreOp::Renew,
            self.inner.resolving(key, held, next_lookup_in, lease),
        )
        .await
    }

    /// See [`Store::now`].
    pub async fn now(&self, key: &StoreKey) -> Result<u64, StoreError> {
        self.timed(StoreOp::Get, self.inner.now(key)).await
    }

    /// See [`Store::wait_change`].
    pub(crate) async fn wait_change(&self, key: &StoreKey, max: Duration) {
        self.inner.wait_change(key, max).await;
    }

    /// See [`Store::ping`].
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.timed(StoreOp::Ping, self.inner.ping()).await
    }

    /// See [`Store::inspect`]; decodes the record.
    pub(crate) async fn inspect(
        &self,
        key: &StoreKey,
    ) -> Result<Option<(Record, Duration)>, StoreError> {
        let found = self.timed(StoreOp::Get, self.inner.inspect(key)).await?;
        match found {
            None => Ok(None),
            Some((bytes, ttl)) => Ok(Some((Record::decode_shared(&bytes)?, ttl))),
        }
    }

    /// See [`Store::forget`].
    pub(crate) async fn forget(&self, key: &StoreKey) -> Result<Forgotten, StoreError> {
        self.timed(StoreOp::Forget, self.inner.forget(key)).await
    }
}

/// A claim an earlier proxy wrote (format version 2) counted its `sent_at` from the claim plus
/// the upstream's `connect_timeout`; a request could be written later than that (its body,
/// bounded only by `timeout`). It is read as counting from the claim plus the claiming route's
/// upstream `timeout` (`times.send_margin`), never earlier than it says (SPEC §4.8).
fn counted_from_timeout(r: &mut crate::record::Resolvable, times: ResolvableTimes) {
    if r.legacy {
        let by_timeout = r
            .claimed_at
            .saturating_add(u64::try_from(times.send_margin.as_millis()).unwrap_or(u64::MAX));
        r.sent_at = r.sent_at.max(by_timeout);
    }
}
