//! The claim of an observed request, in a task of its own beside the forwarding: it claims the
//! key as `enforce` would, counts what `enforce` would have answered, and — holding the key —
//! renews its lease until the upstream call has ended, then saves or releases as that call's
//! [`Settlement`] says.
//!
//! How the claim and the call interleave, and what each case does:
//! - **The claim is won before the response arrives** (the usual case): the lease is renewed
//!   every `lock_ttl/3` while the call runs ([`Lease::renewing`](crate::proxy::lease::Lease::renewing)), and the settlement is
//!   applied when it comes. The client already has its answer when the save is sent.
//! - **The claim is won after the response arrived** (a slow store): the settlement is waiting
//!   in the channel and is applied at once. The lease runs from the claim's *send* time, as on
//!   an enforced route, so a claim answered `lock_ttl` or more after it was sent may have
//!   outlived its lease: it is released and counted as `store_error` — enforce would have
//!   answered 503 — and nothing is saved.
//! - **The claim fails** (store error, timeout, corrupt record): counted as `store_error` and
//!   logged; the request has been forwarded all the same, and nothing is saved: without the
//!   claim there is no token to save under.
//! - **The claim finds the key held**: a repeat, counted as `mismatch` (another fingerprint,
//!   finished or in flight: the mismatch check comes first, as in enforce), `replay` (finished)
//!   or `conflict` (in flight), and logged with the key's hash and whether the fingerprint
//!   matched. Nothing is saved: the key's record is the first request's, and this one's
//!   settlement is dropped unread. With `on_conflict: wait` the claim waits for the first to
//!   finish, as enforce would, up to `wait_timeout` (a replay when it does; a claim of its own
//!   when the first released the key: then it is a `forward`, and this response is saved).
//!   Such a wait is held after the client has its answer, so nothing but a bound of its own
//!   limits how many pile up: at most `limits.max_detached_exchanges` are held at once
//!   ([`HeldRepeats`]); past that a repeat is counted at once by what the record shows
//!   (`conflict`, the first being in flight), never held.
//! - **A repeat of a request still running on this instance** takes its place among the held
//!   repeats before it reads the record at all, under either `on_conflict`: that read is held
//!   work as well, and behind a store that answers slowly (a PostgreSQL pool of a few
//!   connections) a burst of duplicates would queue one read each, without bound. Past the
//!   bound it is counted at once, without a read, as enforce would answer a repeat of a request
//!   in flight (`conflict`, or `mismatch` for another fingerprint).
//! - **The forwarding ended without a settlement** (it panicked): the key is released, since
//!   no result can be saved for it.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::super::admission::KeyOrigin;
use super::super::context::{Context, Found};
use super::super::matched::{FIRST_WAIT_POLL, MAX_WAIT_POLL};
use super::super::settle::Settlement;
use crate::fingerprint::Fingerprint;
use crate::key::StoreKey;
use crate::metrics::{ObservedMetrics, Would};
use crate::record::{Record, Saved, new_token};
use crate::route::OnConflict;
use crate::store::{Claim, Held};

/// The claim of one observed request.
pub(super) struct Shadow {
    /// The request's context (its client's address: the log of a duplicate says who sent it).
    pub context: Arc<Context>,
    pub observed: ObservedMetrics,
    /// The bound on repeats held waiting for the first (`on_conflict: wait`).
    pub held: HeldRepeats,
    pub key: StoreKey,
    pub fingerprint: Fingerprint,
    /// Where the key came from.
    pub origin: KeyOrigin,
    /// This request's number among the observed requests of its key (`Answered`).
    pub owner: u64,
    /// A test's pause before the task's first step (`pause::arm_before_shadow_claim`).
    #[cfg(feature = "test-pauses")]
    pub pause: Option<Duration>,
}

impl Shadow {
    /// Claims the key, counts what enforce would have answered, and saves the request's result
    /// (`settlement`, sent when its upstream call has ended) if the claim is this request's.
    /// Runs the shadow claim in a task of its own, in the request's trace: its claim and its
    /// save are the request's store operations, children of its span.
    ///
    /// The request takes its place among its key's observed requests here, before the task
    /// starts: the forwarding marks it answered as soon as the upstream has answered, which on
    /// a loaded machine can come before the task's first poll, and a mark that found no place
    /// would be lost (a repeat sent at once would then read the first's claim in flight and be
    /// counted a conflict, where enforce would replay it).
    pub(super) fn spawn(self, settlement: oneshot::Receiver<Settlement>) {
        let found = self
            .context
            .shared
            .answered
            .start(&self.key, self.owner, self.fingerprint);
        // However the claim ends — or if its task is dropped unrun at shutdown — the request
        // is no longer its key's first here.
        let registered = Registered {
            answered: self.context.shared.answered.clone(),
            key: self.key.clone(),
            owner: self.owner,
        };
        let tasks = self.context.shared.tasks.clone();
        tasks.spawn(crate::traces::carried(async move {
            let _registered = registered;
            #[cfg(feature = "test-pauses")]
            if let Some(pause) = self.pause {
                tokio::time::sleep(pause).await;
            }
            self.claim(settlement, found).await;
        }));
    }

    async fn claim(self, settlement: oneshot::Receiver<Settlement>, found: Found) {
        let held = Held::new(Record::InFlight {
            token: new_token(),
            fingerprint: self.fingerprint,
        });
        // Taken before this repeat's first read of the record when an earlier request of its
        // key runs here, else at its first wait; kept until this claim has ended (a wait can
        // end in a claim of its own and its save, which are held work too).
        let Some(mut place) = self.before_the_read(found) else {
            return;
        };
        let lock_ttl = self.context.policy.lock_ttl;
        let wait_until = Instant::now() + self.context.policy.wait_timeout;
        let mut poll = FIRST_WAIT_POLL;
        loop {
            let sent = Instant::now();
            let existing = match self
                .context
                .shared
                .store
                .claim(&self.key, &held, lock_ttl)
                .await
            {
                Ok(Claim::Claimed) if sent.elapsed() >= lock_ttl => {
                    return self.claimed_too_late(&held, sent.elapsed()).await;
                }
                Ok(Claim::Claimed) => {
                    self.observed.would(Would::Forward);
                    return self.save(held, sent, settlement).await;
                }
                Ok(Claim::Existing(record)) => record,
                Err(e) => {
                    self.observed.would(Would::StoreError);
                    tracing::warn!(
                        route = %self.context.route.name,
                        key = %self.key.id_hex(),
                        error = %e,
                        "observe: the claim failed (enforce would have answered 503); the request was forwarded, nothing is saved"
                    );
                    return;
                }
            };
            if *existing.fingerprint() != self.fingerprint {
                return self.duplicate(Would::Mismatch, &existing);
            }
            match &existing {
                Record::Finished { .. } => return self.duplicate(Would::Replay, &existing),
                Record::InFlight { .. } | Record::Resolvable(_) => {
                    let now = Instant::now();
                    if self.context.policy.on_conflict == OnConflict::Reject || now >= wait_until {
                        return self.duplicate(Would::Conflict, &existing);
                    }
                    if place.is_none() {
                        place = self.held.take();
                        if place.is_none() {
                            return self.not_held(&existing);
                        }
                    }
                    // Enforce's waiter, in the background: a finished first one is a replay,
                    // a released one is claimed by this request (see `Exchange::claim_and_run`).
                    self.context
                        .shared
                        .store
                        .wait_change(&self.key, poll.min(wait_until - now))
                        .await;
                    poll = (poll * 2).min(MAX_WAIT_POLL);
                }
            }
        }
    }

    /// What this instance knows before the store is asked. `None`: the repeat is counted, and
    /// nothing is read; else the place it took among the held repeats, if any.
    fn before_the_read(&self, found: Found) -> Option<Option<Place>> {
        // The first was answered and this instance is saving its result: enforce, which saves
        // before it answers, would replay this repeat (or refuse it as a mismatch). Counted
        // before claiming: the first's own claim may not have landed yet.
        match found {
            Found::Answered(first) => {
                let would = if first == self.fingerprint {
                    Would::Replay
                } else {
                    Would::Mismatch
                };
                self.answered_repeat(would);
                None
            }
            // A repeat of a request running here: its read of the record is held work too,
            // which may queue behind a slow store's pool (PostgreSQL's, a few connections)
            // for as long as the store takes, whatever happens to the client. Past the bound it
            // is counted at once by what is known here — the first is in flight — and the
            // store is not asked.
            Found::Running(first) => match self.held.take() {
                Some(place) => Some(Some(place)),
                None => {
                    self.unread(first);
                    None
                }
            },
            Found::First => Some(None),
        }
    }

    /// Holds the key: renews the lease until the upstream call has ended, then carries out
    /// what its answer means for the key, exactly as an enforced exchange does.
    async fn save(
        self,
        held: Held,
        claimed_at: Instant,
        settlement: oneshot::Receiver<Settlement>,
    ) {
        let mut lease = self.context.lease(self.key.clone(), held, claimed_at);
        match lease.renewing(settlement).await {
            Ok(settlement) => {
                settlement
                    .apply(lease, self.fingerprint, &self.context)
                    .await;
            }
            Err(_) => {
                tracing::error!(
                    route = %self.context.route.name,
                    key = %self.key.id_hex(),
                    "observe: the request ended without its upstream call's outcome; claim released"
                );
                lease.release().await;
            }
        }
    }

    /// The claim was won, but answered `took` after it was sent, later than `lock_ttl`: its
    /// lease may have expired and another request may hold the key, so it is released (the
    /// token's compare-and-set leaves another holder alone) and nothing is saved.
    async fn claimed_too_late(self, held: &Held, took: Duration) {
        self.observed.would(Would::StoreError);
        tracing::warn!(
            route = %self.context.route.name,
            key = %self.key.id_hex(),
            took_ms = took.as_millis(),
            lock_ttl_ms = self.context.policy.lock_ttl.as_millis(),
            "observe: the claim was answered after lock_ttl (enforce would have answered 503); released, nothing is saved"
        );
        if let Err(e) = self.context.shared.store.release(&self.key, held).await {
            tracing::warn!(
                route = %self.context.route.name,
                key = %self.key.id_hex(),
                error = %e,
                "release failed; the claim expires within lock_ttl"
            );
        }
    }

    /// A repeat of a request that was answered and whose result is being saved: counted as
    /// enforce would answer it, and logged as a duplicate is.
    fn answered_repeat(&self, would: Would) {
        self.observed.would(would);
        tracing::info!(
            route = %self.context.route.name,
            key = %self.key.id_hex(),
            key_source = self.origin.as_str(),
            client = %self.context.client.ip(),
            would = would.as_str(),
            first = "finished",
            "observed a duplicate of a request answered moments ago: enforce would have answered from its saved result, not forwarded it"
        );
    }

    /// A repeat that `on_conflict: wait` would hold while the held repeats are at their bound:
    /// counted at once by what the record shows (the first is in flight: `conflict`), and
    /// logged as a duplicate is, saying why it was not held.
    fn not_held(&self, existing: &Record) {
        tracing::debug!(
            route = %self.context.route.name,
            key = %self.key.id_hex(),
            bound = self.held.bound,
            "observe: at limits.max_detached_exchanges held repeats; this one is not held (counted as a conflict)"
        );
        self.duplicate(Would::Conflict, existing);
    }

    /// A repeat of a request running here while the held repeats are at their bound: counted,
    /// without reading the record, as enforce would answer a repeat of a request in flight —
    /// `mismatch` for another fingerprint, else `conflict` — and logged as a duplicate is.
    fn unread(&self, first: Fingerprint) {
        tracing::debug!(
            route = %self.context.route.name,
            key = %self.key.id_hex(),
            bound = self.held.bound,
            "observe: at limits.max_detached_exchanges held repeats; this repeat of a request in flight here is counted without reading the store"
        );
        let would = if first == self.fingerprint {
            Would::Conflict
        } else {
            Would::Mismatch
        };
        let existing = Record::InFlight {
            token: [0; 16],
            fingerprint: first,
        };
        self.duplicate(would, &existing);
    }

    /// A repeat of a request that holds (or held) the key: counted, and logged so an operator
    /// can find the clients that enforce would answer from the store or refuse.
    fn duplicate(&self, would: Would, existing: &Record) {
        self.observed.would(would);
        let (first, enforce) = match (would, existing) {
            (Would::Mismatch, Record::Finished { .. }) => {
                ("finished", "422 idempotency-key-reused")
            }
            (Would::Mismatch, _) => ("in_flight", "422 idempotency-key-reused"),
            (
                _,
                Record::Finished {
                    saved: Saved::NotReplayable { .. },
                    ..
                },
            ) => ("finished", "409 response-not-replayable"),
            (_, Record::Finished { .. }) => ("finished", "the saved response, replayed"),
            _ => ("in_flight", "409 request-in-progress"),
        };
        tracing::info!(
            route = %self.context.route.name,
            key = %self.key.id_hex(),
            key_source = self.origin.as_str(),
            client = %self.context.client.ip(),
            would = would.as_str(),
            fingerprint_matched = would != Would::Mismatch,
            first,
            "observed a duplicate: enforce would have answered {enforce}, not forwarded it"
        );
    }
}

/// How many observed repeats are held in the background waiting for the first
/// (`idemproxy_observed_held`), and how many may be (`limits.max_detached_exchanges` of the
/// configuration the request arrived under).
pub(super) struct HeldRepeats {
    pub count: Gauge,
    pub bound: u32,
}

impl HeldRepeats {
    /// A place among the held repeats, if fewer than the bound are held. The check and the
    /// count are one atomic step, so workers taking places at once never pass the bound.
    fn take(&self) -> Option<Place> {
        let bound = i64::from(self.bound);
        self.count
            .inner()
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < bound).then_some(n + 1)
            })
            .ok()?;
        Some(Place(self.count.clone()))
    }
}

/// An observed request's place among its key's requests on this instance
/// ([`Answered`](super::super::context::Answered)), given up when its claim's task ends or is
/// dropped.
struct Registered {
    answered: Arc<super::super::context::Answered>,
    key: StoreKey,
    owner: u64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.answered.end(&self.key, self.owner);
    }
}

/// A held repeat's place, given back when it is dropped (a panic too).
struct Place(Gauge);

impl Drop for Place {
    fn drop(&mut self) {
        self.0.dec();
    }
}
