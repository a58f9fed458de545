//! The lease: a held claim, renewed every `lock_ttl/3` while the upstream call runs, then
//! completed with the result or released — only by the holder of its token.
//!
//! Renewal runs in the exchange's future, beside the upstream call ([`Lease::renewing`]), not
//! in a task of its own: nothing can outlive the exchange and keep a key blocked, and a request
//! spawns no task for it.
//!
//! # When renewals are sent
//! A renewal extends the lease from when the store runs it, so what matters is that one
//! *reaches* the store before the lease ends there. The schedule therefore counts from send
//! times, never from answers, and from the claim's own send time for the first one: a store
//! that answers slowly (a far database, a busy pool, a starved CPU) never pushes the next
//! renewal later. Each is sent a third of the lease after the previous one, or earlier when the
//! store's round trips are slow: by the time the lease has twice the slowest recent round trip
//! left ([`renewal_due`]). A renewal still waiting for its answer does not hold the next one
//! back: up to [`RENEWALS_IN_FLIGHT`] run at once, never two sent closer than a sixth of the
//! lease. A renewal answered with less than a third of the lease left is counted
//! (`idemproxy_lease_renewals_late_total`): the store's round trips are eating the lease.

use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::pending::PendingSaves;
use super::saving::Saving;
use crate::key::StoreKey;
use crate::metrics::RouteMetrics;
use crate::record::Finished;
use crate::store::{Held, StoreError, StoreHandle};

/// Once a failing save has backed off this far, it is retried at this steady pace.
const SLOWEST_RETRY: Duration = Duration::from_secs(5);

/// Renewals of one lease in flight at once, at most: a slow one never holds the next back, and
/// one lease takes at most this many store connections (PostgreSQL's pool) for its renewals.
const RENEWALS_IN_FLIGHT: usize = 2;

/// A renewal in flight: its send time, and the store's answer.
type Renewal<'a> = Pin<Box<dyn Future<Output = (Instant, Result<bool, StoreError>)> + Send + 'a>>;

/// A held claim, and until when it is surely valid.
pub(super) struct Lease {
    store: StoreHandle,
    metrics: RouteMetrics,
    route: Arc<str>,
    key: StoreKey,
    held: Held,
    lock_ttl: Duration,
    /// Until when the lease is surely valid: the send time of the last successful claim or
    /// renewal plus `lock_ttl` (the send time, not the answer time, so it is never optimistic).
    valid_until: Instant,
    /// The slowest recent round trip of the store, the claim's first: how long before the end
    /// of the lease a renewal must be sent to land in time.
    round_trip: Duration,
    /// Set once the lease is known lost, so it is logged and counted once.
    lost: bool,
    /// Whether the route is a gRPC one: a result not kept is saved as a gRPC status.
    grpc: bool,
}

impl Lease {
    /// The lease of a claim sent at `claimed_at`.
    pub(crate) fn new(
        store: StoreHandle,
        metrics: RouteMetrics,
        route: Arc<str>,
        key: StoreKey,
        held: Held,
        lock_ttl: Duration,
        claimed_at: Instant,
    ) -> Lease {
        Lease {
            store,
            metrics,
            route,
            key,
            held,
            lock_ttl,
            valid_until: claimed_at + lock_ttl,
            // The claim was answered just now: its round trip is the first one seen.
            round_trip: Instant::now().saturating_duration_since(claimed_at),
            lost: false,
            grpc: false,
        }
    }

    /// The lease of a claim on a gRPC route: what it saves in place of a result it cannot
    /// keep is a gRPC status (SPEC §4.11).
    pub(crate) fn on_grpc_route(mut self, grpc: bool) -> Lease {
        self.grpc = grpc;
        self
    }

    /// Drives `call` to its end, renewing the lease meanwhile (see the module's *When renewals
    /// are sent*). Renewals never hold the call back: all are polled together. A failed
    /// renewal is followed by the next at its time (two more chances before the lease can
    /// expire, more when the store is slow); once the key is known to hold another claim,
    /// renewing stops.
    pub(crate) async fn renewing<F: Future>(&mut self, call: F) -> F::Output {
        tokio::pin!(call);
        let (store, key, held, lock_ttl) = (&self.store, &self.key, &self.held, self.lock_ttl);
        // Boxed only once a renewal is sent: most calls end before the first is due.
        let mut in_flight: [Option<Renewal<'_>>; RENEWALS_IN_FLIGHT] = Default::default();
        let mut last_sent = self.valid_until - lock_ttl;
        loop {
            let due = renewal_due(lock_ttl, self.valid_until, last_sent, self.round_trip);
            let sending = in_flight.iter().any(Option::is_some);
            let room = in_flight.iter().any(Option::is_none);
            let (sent, renewed) = tokio::select! {
                biased;
                out = &mut call => return out,
                answer = next_answer(&mut in_flight), if sending => answer,
                () = tokio::time::sleep_until(due), if room => {
                    last_sent = Instant::now();
                    let sent = last_sent;
                    let renewal: Renewal<'_> = Box::pin(async move {
                        (sent, store.renew(key, held, lock_ttl).await)
                    });
                    if let Some(slot) = in_flight.iter_mut().find(|slot| slot.is_none()) {
                        *slot = Some(renewal);
                    }
                    continue;
                }
            };
            let answered = Instant::now();
            let took = answered.saturating_duration_since(sent);
            // A quick answer does not wipe out a slow one at once: the estimate decays.
            self.round_trip = took.max(self.round_trip * 3 / 4);
            let left = self.valid_until.saturating_duration_since(answered);
            if left < lock_ttl / 3 {
                self.metrics.lease_renewal_late();
                if left.is_zero() {
                    tracing::warn!(
                        route = %self.route,
                        key = %key.id_hex(),
                        took_ms = took.as_millis(),
                        lock_ttl_ms = lock_ttl.as_millis(),
                        "a lease renewal was answered after the lease could have lapsed: the store's round trips are too slow for lock_ttl"
                    );
                }
            }
            match renewed {
                Ok(true) => {
                    // Answers of renewals sent close together may come in any order.
                    self.valid_until = self.valid_until.max(sent + lock_ttl);
                    self.metrics.lease_renewed();
                }
                Ok(false) => {
                    drop(in_flight);
                    self.mark_lost("another request holds the key now");
                    return call.await;
                }
                Err(e) => {
                    tracing::warn!(route = %self.route, key = %key.id_hex(), error = %e, "lease renewal failed; the next one is sent at its time")
                }
            }
        }
    }

    /// The key it holds.
    pub(crate) fn key(&self) -> &StoreKey {
        &self.key
    }

    /// The claim it holds.
    pub(crate) fn held(&self) -> &Held {
        &self.held
    }

    /// Frees the key (holder only).
    pub(crate) async fn release(mut self) {
        match self.store.release(&self.key, &self.held).await {
            Ok(true) => {}
            Ok(false) => self.mark_lost("another request holds the key now"),
            // The claim will expire within lock_ttl; until then repeats get 409.
            Err(e) => tracing::warn!(
                route = %self.route,
                key = %self.key.id_hex(),
                error = %e,
                "release failed; the claim expires within lock_ttl"
            ),
        }
    }

    /// Saves the claim with the finished record (compare-and-set on the token). If the store
    /// fails, the save goes on in the background (tracked by `tasks`, bounded by
    /// `pending`: past its bounds it saves `result-not-kept` instead) while the lease may still
    /// be valid; the caller answers the client at once either way.
    pub(crate) async fn save(
        mut self,
        done: Finished,
        ttl: Duration,
        tasks: &TaskTracker,
        pending: &Arc<PendingSaves>,
    ) {
        match self.store.save(&self.key, &self.held, &done, ttl).await {
            Ok(true) => {}
            Ok(false) => self.lost_or_saved(&Saving::whole(done)).await,
            Err(e) => {
                tracing::warn!(
                    route = %self.route,
                    key = %self.key.id_hex(),
                    error = %e,
                    "completing the claim failed; retrying in the background"
                );
                let bytes = done.encoded().len() as u64;
                let ticket = pending.begin(self.route.clone(), self.key.id_hex(), bytes);
                let pending = pending.clone();
                // The retries are the request's store operations still: in its trace.
                tasks.spawn(crate::traces::carried(async move {
                    let completion = Saving::whole(done);
                    self.save_in_background(completion, ttl, &ticket.downgrade)
                        .await;
                    pending.finish(&ticket);
                }));
            }
        }
    }

    fn mark_lost(&mut self, why: &str) {
        if !self.lost {
            self.lost = true;
            tracing::error!(
                route = %self.route,
                key = %self.key.id_hex(),
                "lease lost: {why}; the result is not saved under this claim"
            );
            self.metrics.lost_lease();
        }
    }

    /// Retries a failed save with backoff, renewing the lease meanwhile, for as long as
    /// the lease may still be valid. The backoff doubles up to a steady slow pace (every
    /// [`SLOWEST_RETRY`], or a third of the lease if that is shorter, so renewals keep up).
    ///
    /// Once `downgrade` is cancelled (the pending-save bounds), the result is dropped and the
    /// retries go on with `result-not-kept`: the lease is kept all the same, because a key
    /// freed now would let a retry run the operation a second time.
    async fn save_in_background(
        &mut self,
        mut completion: Saving,
        ttl: Duration,
        downgrade: &CancellationToken,
    ) {
        let slowest = SLOWEST_RETRY.min(self.lock_ttl / 3);
        let mut backoff = Duration::from_millis(50).min(slowest);
        loop {
            if downgrade.is_cancelled() && !completion.is_downgraded() {
                self.downgrade(&mut completion);
            }
            let now = Instant::now();
            if now >= self.valid_until {
                tracing::error!(
                    route = %self.route,
                    key = %self.key.id_hex(),
                    "gave up saving the result: the lease expired; a retry of this key will run the operation again"
                );
                self.metrics.save_abandoned();
                self.mark_lost("it expired while the store was failing");
                return;
            }
            let pause = tokio::time::sleep(backoff.min(self.valid_until - now));
            tokio::select! {
                () = pause => {}
                // Let go of the result at once, not after the pause: that frees its bytes.
                () = downgrade.cancelled(), if !completion.is_downgraded() => continue,
            }
            backoff = (backoff * 2).min(slowest);
            match self
                .store
                .save(&self.key, &self.held, &completion.done, ttl)
                .await
            {
                Ok(true) if completion.is_downgraded() => {
                    tracing::warn!(route = %self.route, key = %self.key.id_hex(), "result-not-kept saved in place of the result");
                    return;
                }
                Ok(true) => {
                    tracing::info!(route = %self.route, key = %self.key.id_hex(), "result saved after retrying");
                    return;
                }
                Ok(false) => return self.lost_or_saved(&completion).await,
                // Keep the lease alive while the store comes back.
                Err(_) => {
                    let sent = Instant::now();
                    match self.store.renew(&self.key, &self.held, self.lock_ttl).await {
                        Ok(true) => self.valid_until = sent + self.lock_ttl,
                        Ok(false) => return self.lost_or_saved(&completion).await,
                        Err(_) => {}
                    }
                }
            }
        }
    }

    /// Drops the result of a save the pending-save bounds cannot keep; logged (with the key's
    /// hash, for reconciliation) and counted.
    fn downgrade(&self, completion: &mut Saving) {
        tracing::error!(
            route = %self.route,
            key = %self.key.id_hex(),
            bytes = completion.done.encoded().len(),
            status = completion.status().as_u16(),
            "result not kept: the store keeps refusing to save it and the pending-save bounds are reached \
             (limits.max_pending_saves / max_pending_save_bytes); the key stays held, and a result-not-kept \
             (502) is saved in its place as soon as the store takes it, so the operation never runs twice"
        );
        self.metrics.result_not_kept();
        completion.downgrade(self.grpc);
    }

    /// The compare-and-set failed: either an earlier attempt whose answer was lost did complete
    /// (the record is ours), or the lease was lost to another request.
    async fn lost_or_saved(&mut self, completion: &Saving) {
        match self.store.get(&self.key).await {
            Ok(Some(current)) if completion.wrote(&current) => {}
            Ok(_) => self.mark_lost("the key was claimed by another request"),
            // Only the confirming read failed: the lease may well be ours and saved. Not
            // counted as lost (that would send operators after a loss that did not happen).
            Err(e) => tracing::warn!(
                route = %self.route,
                key = %self.key.id_hex(),
                error = %e,
                "the save was refused and reading the key back failed: whether the lease was lost is unknown"
            ),
        }
    }
}

/// When the next renewal is due, for a lease surely valid until `valid_until`, whose last
/// renewal (or claim) was sent at `last_sent`, on a store whose recent round trips took up to
/// `round_trip`: a third of the lease after the last send, or earlier so that it is sent while
/// the lease has twice that round trip left (it lands with a round trip to spare); never
/// sooner than a sixth of the lease after the last send, so that slow renewals overlap rather
/// than pile up.
fn renewal_due(
    lock_ttl: Duration,
    valid_until: Instant,
    last_sent: Instant,
    round_trip: Duration,
) -> Instant {
    let period = lock_ttl / 3;
    let in_time = valid_until
        .checked_sub(round_trip.saturating_mul(2))
        .unwrap_or(last_sent);
    (last_sent + period)
        .min(in_time)
        .max(last_sent + period / 2)
}

/// The first answer of the renewals in flight (its slot emptied); pending while none has one.
async fn next_answer(in_flight: &mut [Option<Renewal<'_>>]) -> (Instant, Result<bool, StoreError>) {
    std::future::poll_fn(|cx| {
        for slot in in_flight.iter_mut() {
            if let Some(renewal) = slot
                && let Poll::Ready(answer) = renewal.as_mut().poll(cx)
            {
                *slot = None;
                return Poll::Ready(answer);
            }
        }
        Poll::Pending
    })
    .await
}

#[cfg(test)]
mod tests;
