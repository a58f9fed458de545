//! A store that wraps another and changes some of its answers: a test's fault (a store whose
//! saves fail, whose renewals are slow, whose claims answer late) written as the one method it
//! changes. Implement [`Wrap::inner`] and the methods that differ; every other one goes to the
//! inner store, and the type is a [`Store`].

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use super::{
    Forgotten, Held, ResolvableFound, ResolvableTimes, Store, StoreError, StoreKey, StoreOp,
};

/// A store in front of [`Wrap::inner`]: each method, unless written, is the inner store's.
#[async_trait]
pub trait Wrap: Send + Sync + 'static {
    /// The store every method not written here goes to.
    fn inner(&self) -> &dyn Store;

    /// See [`Store::deadline`].
    fn deadline(&self, op: StoreOp, timeout: Duration) -> Duration {
        self.inner().deadline(op, timeout)
    }
    /// See [`Store::claim`].
    async fn claim(
        &self,
        key: &StoreKey,
        held: &Held,
        lease: Duration,
    ) -> Result<Option<Bytes>, StoreError> {
        self.inner().claim(key, held, lease).await
    }
    /// See [`Store::renew`].
    async fn renew(
        &self,
        key: &StoreKey,
        held: &Held,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.inner().renew(key, held, lease).await
    }
    /// See [`Store::save`].
    async fn save(
        &self,
        key: &StoreKey,
        held: &Held,
        done: Bytes,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        self.inner().save(key, held, done, ttl).await
    }
    /// See [`Store::release`].
    async fn release(&self, key: &StoreKey, held: &Held) -> Result<bool, StoreError> {
        self.inner().release(key, held).await
    }
    /// See [`Store::get`].
    async fn get(&self, key: &StoreKey) -> Result<Option<Bytes>, StoreError> {
        self.inner().get(key).await
    }
    /// See [`Store::claim_resolvable`].
    async fn claim_resolvable(
        &self,
        key: &StoreKey,
        held: &Held,
        times: ResolvableTimes,
    ) -> Result<ResolvableFound, StoreError> {
        self.inner().claim_resolvable(key, held, times).await
    }
    /// See [`Store::resolving`].
    async fn resolving(
        &self,
        key: &StoreKey,
        held: &Held,
        next_lookup_in: Duration,
        lease: Duration,
    ) -> Result<Option<u64>, StoreError> {
        self.inner()
            .resolving(key, held, next_lookup_in, lease)
            .await
    }
    /// See [`Store::now`].
    async fn now(&self, key: &StoreKey) -> Result<u64, StoreError> {
        self.inner().now(key).await
    }
    /// See [`Store::wait_change`].
    async fn wait_change(&self, key: &StoreKey, max: Duration) {
        self.inner().wait_change(key, max).await;
    }
    /// See [`Store::ping`].
    async fn ping(&self) -> Result<(), StoreError> {
        self.inner().ping().await
    }
    /// See [`Store::inspect`].
    async fn inspect(&self, key: &StoreKey) -> Result<Option<(Bytes, Duration)>, StoreError> {
        self.inner().inspect(key).await
    }
    /// See [`Store::forget`].
    async fn forget(&self, key: &StoreKey) -> Result<Forgotten, StoreError> {
        self.inner().forget(key).await
    }
}

#[async_trait]
impl<W: Wrap> Store for W {
    fn deadline(&self, op: StoreOp, timeout: Duration) -> Duration {
        Wrap::deadline(self, op, timeout)
    }
    async fn claim(
        &self,
        key: &StoreKey,
        held: &Held,
        lease: Duration,
    ) -> Result<Option<Bytes>, StoreError> {
        Wrap::claim(self, key, held, lease).await
    }
    async fn renew(
        &self,
        key: &StoreKey,
        held: &Held,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        Wrap::renew(self, key, held, lease).await
    }
    async fn save(
        &self,
        key: &StoreKey,
        held: &Held,
        done: Bytes,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        Wrap::save(self, key, held, done, ttl).await
    }
    async fn release(&self, key: &StoreKey, held: &Held) -> Result<bool, StoreError> {
        Wrap::release(self, key, held).await
    }
    async fn get(&self, key: &StoreKey) -> Result<Option<Bytes>, StoreError> {
        Wrap::get(self, key).await
    }
    async fn claim_resolvable(
        &self,
        key: &StoreKey,
        held: &Held,
        times: ResolvableTimes,
    ) -> Result<ResolvableFound, StoreError> {
        Wrap::claim_resolvable(self, key, held, times).await
    }
    async fn resolving(
        &self,
        key: &StoreKey,
        held: &Held,
        next_lookup_in: Duration,
        lease: Duration,
    ) -> Result<Option<u64>, StoreError> {
        Wrap::resolving(self, key, held, next_lookup_in, lease).await
    }
    async fn now(&self, key: &StoreKey) -> Result<u64, StoreError> {
        Wrap::now(self, key).await
    }
    async fn wait_change(&self, key: &StoreKey, max: Duration) {
        Wrap::wait_change(self, key, max).await;
    }
    async fn ping(&self) -> Result<(), StoreError> {
        Wrap::ping(self).await
    }
    async fn inspect(&self, key: &StoreKey) -> Result<Option<(Bytes, Duration)>, StoreError> {
        Wrap::inspect(self, key).await
    }
    async fn forget(&self, key: &StoreKey) -> Result<Forgotten, StoreError> {
        Wrap::forget(self, key).await
    }
}
