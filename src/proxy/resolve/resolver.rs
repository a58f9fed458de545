//! The resolver: one task a key whose outcome is unknown, holding its claim (the lease renewed
//! while it asks and while it waits), asking the upstream at once and then every `interval`,
//! and acting only on the answer (SPEC §4.8):
//! - a `found` status: its response is the key's result, replayed with
//!   `Idempotent-Resolved: true`;
//! - an `absent` status to a lookup sent `settle_after` or more after the request: the
//!   operation did not happen and will not, so the key is released and the next retry runs it;
//!   an earlier `absent` only means "not yet";
//! - anything else, until `give_up_after`: then `outcome-unknown` is saved, so the operation
//!   never runs twice.
//!
//! Its times count from when the request was sent, never from earlier: the latest moment any
//! byte of it could have reached the upstream (the claim plus the upstream's `timeout`, past
//! which nothing of it is written). On an enforced route the claim is a resolvable record,
//! which carries those times on the store's clock with the lookup (and the upstream it goes
//! to), the route's `found` and `absent` statuses and its `settle_after`, `interval` and
//! `give_up_after` as they were at the claim: a resolution runs to its end under what its
//! record carries, whichever instance holds it (the one that sent the request, or one that took
//! it over after that one's lease lapsed), whatever a reload changed meanwhile — even a route
//! no longer under `resolve`.
//!
//! It runs on the proxy's task tracker, so a drain waits for it up to `shutdown_timeout`; one
//! still running then stops with the process, and its record is taken over after the restart.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use tokio::time::Instant;

use super::ask::{self, Answer, Lookup, Statuses};
use super::clock::StoreClock;
use crate::fingerprint::Fingerprint;
use crate::key::StoreKey;
use crate::metrics::Resolution;
use crate::problem::{LastLookup, Problem};
use crate::proxy::context::Context;
use crate::proxy::lease::Lease;
use crate::record::{Finished, Saved};
use crate::route::Mode;
use crate::store::Held;
use crate::traces::FutureExt as _;
use crate::upstream::Upstream;

/// A key to resolve: its held claim, and what asking about it takes.
pub(in crate::proxy) struct Unknown {
    pub context: Arc<Context>,
    pub lease: Lease,
    pub fingerprint: Fingerprint,
    pub lookup: Lookup,
    /// The latest moment the request could have been written upstream.
    pub sent: Instant,
    /// What `keep` would have saved: the result if nothing settles it (as `outcome-unknown`).
    pub failure: Problem,
    /// Past `give_up_after` already (a takeover of an old record): give up without asking.
    pub gave_up: bool,
}

/// How one resolution ended, and after how many lookups; `None`: its lease was lost to
/// another instance, which goes on with it.
struct Ended {
    result: Option<Resolution>,
    lookups: u32,
}

/// The times one resolution runs under.
struct Times {
    settle_after: Duration,
    interval: Duration,
    give_up_after: Duration,
}

/// Takes over the resolution of a record whose holder's lease lapsed (`held`, as the store
/// stamped it, claimed at `claimed_at` and read with `clock`): never forwarded, only asked
/// about — or, `gave_up`, saved as `outcome-unknown` at once.
pub(in crate::proxy) fn take_over(
    context: &Arc<Context>,
    key: StoreKey,
    held: Held,
    clock: StoreClock,
    gave_up: bool,
    claimed_at: Instant,
) {
    let Some(record) = held.resolvable().cloned() else {
        return;
    };
    tracing::warn!(
        route = %context.route.name,
        key = %key.id_hex(),
        "a claim whose holder's lease lapsed is taken over: resolving it, never forwarding it"
    );
    // Its holder died before knowing the outcome: no complete response came, as after a
    // timeout.
    let failure = Problem::UpstreamTimeout {
        upstream: record.lookup.upstream.clone(),
    };
    Unknown {
        context: context.clone(),
        lease: context.lease(key, held, claimed_at),
        fingerprint: record.fingerprint,
        sent: clock.local(record.sent_at),
        lookup: record.lookup,
        failure,
        gave_up,
    }
    .spawn();
}

impl Unknown {
    /// Starts its resolution in a task of its own, tracked so that a drain waits for it.
    /// On an observed route it counts as work after its client was answered
    /// (`idemproxy_detached_exchanges`), which observe's bound limits (SPEC §4.7).
    ///
    /// At most `limits.max_resolutions` run at once on this instance (SPEC §4.8, "Bounded"):
    /// past it the key is left held in the store, its lease left to lapse (never released:
    /// its outcome is unknown), and a repeat of the key takes it over and resolves it then.
    pub(in crate::proxy) fn spawn(self) {
        let shared = &self.context.shared;
        let bound = i64::from(self.context.limits.max_resolutions);
        // One atomic step: the count before this one's increment says whether it fits.
        if shared.resolutions.inc() >= bound {
            shared.resolutions.dec();
            shared.deferred.inc();
            tracing::warn!(
                route = %self.context.route.name,
                key = %self.lease.key().id_hex(),
                max_resolutions = bound,
                "at limits.max_resolutions: the unknown outcome is left held in the store, its lease left to lapse; a repeat of its key takes it over and resolves it"
            );
            // Dropped, not released: the claim stays until its lease lapses.
            drop(self);
            return;
        }
        let running = Running(shared.resolutions.clone());
        let tasks = shared.tasks.clone();
        let counted = (self.context.policy.mode == Mode::Observe)
            .then(|| Counted::new(self.context.shared.detached.clone()));
        // Outlives the request: a span of its own, linked to the request's.
        let traced = crate::traces::detached(&self.context.route.name);
        tasks.spawn(async move {
            let _counted = counted;
            let _running = running;
            match traced {
                None => self.run().await,
                Some(cx) => {
                    self.run().with_context(cx.clone()).await;
                    crate::traces::end_detached(&cx);
                }
            }
        });
    }

    async fn run(self) {
        let started = Instant::now();
        let context = self.context.clone();
        let key = self.lease.key().id_hex();
        let ended = self.resolve().await;
        let route = &context.route;
        match ended.result {
            Some(result) => {
                crate::traces::resolved(result.as_str());
                tracing::info!(
                    route = %route.name,
                    key = %key,
                    result = result.as_str(),
                    lookups = ended.lookups,
                    took_ms = started.elapsed().as_millis(),
                    "unknown outcome resolved"
                );
            }
            None => tracing::warn!(
                route = %route.name,
                key = %key,
                lookups = ended.lookups,
                took_ms = started.elapsed().as_millis(),
                "resolution stopped: its lease was lost, another instance resolves the key"
            ),
        }
    }

    /// The times: the record's, as the route had them when the key was claimed; the route's
    /// for a claim that is not a resolvable record (an observed route's).
    fn times(&self) -> Option<Times> {
        if let Some(r) = self.lease.held().resolvable() {
            return Some(Times {
                settle_after: r.settle_after,
                interval: r.interval,
                give_up_after: r.give_up_after,
            });
        }
        let resolve = self.context.policy.resolve.as_ref()?;
        Some(Times {
            settle_after: resolve.settle_after,
            interval: resolve.interval,
            give_up_after: resolve.give_up_after,
        })
    }

    /// The statuses that answer its lookups: its record's (a version 3 record carries the
    /// route's as they were when the key was claimed); the route's for a record that does not
    /// say (version 2, or an observed route's claim); none when the route no longer resolves
    /// either.
    fn statuses(&self) -> Option<(Vec<u16>, Vec<u16>)> {
        if let Some(r) = self.lease.held().resolvable()
            && !r.found.is_empty()
        {
            return Some((r.found.clone(), r.absent.clone()));
        }
        let resolve = self.context.policy.resolve.as_ref()?;
        Some((resolve.found.clone(), resolve.absent.clone()))
    }

    /// Asks until an answer settles it, or `give_up_after`.
    async fn resolve(mut self) -> Ended {
        let (Some(times), Some((found, absent))) = (self.times(), self.statuses()) else {
            // Nothing says how to read an answer (an old record on a route that no longer
            // resolves): the safe end is keep's.
            self.count(Resolution::GaveUp);
            self.give_up(LastLookup::None).await;
            return Ended {
                result: Some(Resolution::GaveUp),
                lookups: 0,
            };
        };
        let settles_at = self.sent + times.settle_after;
        let gives_up_at = self.sent + times.give_up_after;
        // The upstream its record names, as configured now (its timeouts and pool).
        let upstream = self
            .context
            .route
            .upstreams
            .get(&self.lookup.upstream)
            .cloned();
        let statuses = Statuses {
            found: &found,
            absent: &absent,
        };
        let mut lookups = 0;
        // What the last lookup answered: the `outcome-unknown` detail says it.
        let mut last = LastLookup::None;
        loop {
            let asked = Instant::now();
            if self.gave_up || asked >= gives_up_at {
                break;
            }
            let Some(answer) = self.ask(upstream.as_deref(), &statuses, gives_up_at).await else {
                // Cut off by give_up_after: no answer came.
                last = LastLookup::Failed;
                break;
            };
            lookups += 1;
            if let Some(metrics) = &self.context.route.resolved {
                metrics.lookup(answer.counted());
            }
            last = match answer {
                Answer::Found(saved) => {
                    self.count(Resolution::Found);
                    self.found(saved).await;
                    return Ended {
                        result: Some(Resolution::Found),
                        lookups,
                    };
                }
                Answer::Absent(_) if asked >= settles_at => {
                    self.count(Resolution::Absent);
                    self.lease.release().await;
                    return Ended {
                        result: Some(Resolution::Absent),
                        lookups,
                    };
                }
                Answer::Absent(status) => LastLookup::EarlyAbsent {
                    status: status.as_u16(),
                },
                Answer::Other(status) => self.other(status, &statuses),
                Answer::Failed(error) => {
                    self.log_failed(&error);
                    LastLookup::Failed
                }
            };
            let next = (asked + times.interval).min(gives_up_at);
            if !self.resolving(next).await {
                return Ended {
                    result: None,
                    lookups,
                };
            }
            self.lease.renewing(tokio::time::sleep_until(next)).await;
        }
        self.count(Resolution::GaveUp);
        self.give_up(last).await;
        Ended {
            result: Some(Resolution::GaveUp),
            lookups,
        }
    }

    /// Counts how it ended (`idemproxy_resolutions_total`) before the key shows it: a client
    /// that reads the saved result, or retries after the release, finds it counted.
    fn count(&self, result: Resolution) {
        if let Some(metrics) = &self.context.route.resolved {
            metrics.resolution(result);
        }
    }

    /// Writes the next lookup's time into a resolvable record (`keys show` reads it), which
    /// also marks it resolving. False: the lease was lost, and the key is another's now.
    async fn resolving(&self, next: Instant) -> bool {
        let held = self.lease.held();
        if held.resolvable().is_none() {
            return true;
        }
        let store = &self.context.shared.store;
        let next_in = next.saturating_duration_since(Instant::now());
        match store
            .resolving(
                self.lease.key(),
                held,
                next_in,
                self.context.policy.lock_ttl,
            )
            .await
        {
            Ok(Some(_)) => true,
            Ok(None) => false,
            // The lease is renewed meanwhile; the next lookup writes its time again.
            Err(e) => {
                tracing::debug!(
                    route = %self.context.route.name,
                    key = %self.lease.key().id_hex(),
                    error = %e,
                    "recording the next lookup's time failed"
                );
                true
            }
        }
    }

    /// Sends one lookup to `upstream` (none: it is not configured any more, and nobody can be
    /// asked), its lease renewed meanwhile. `None`: no answer came by `gives_up_at`.
    async fn ask(
        &mut self,
        upstream: Option<&Upstream>,
        statuses: &Statuses<'_>,
        gives_up_at: Instant,
    ) -> Option<Answer> {
        let Some(up) = upstream else {
            let nobody = format!("no upstream {:?} to ask", self.lookup.upstream);
            return Some(Answer::Failed(nobody));
        };
        let policy = self.context.policy.clone();
        let asking = ask::ask(up, &self.lookup, statuses, &policy);
        self.lease
            .renewing(tokio::time::timeout_at(gives_up_at, asking))
            .await
            .ok()
    }

    /// A status in neither list: asked again; the `outcome-unknown` detail names it.
    fn other(&self, status: http::StatusCode, statuses: &Statuses<'_>) -> LastLookup {
        tracing::debug!(
            route = %self.context.route.name,
            key = %self.lease.key().id_hex(),
            status = status.as_u16(),
            "lookup answered neither found nor absent; asking again"
        );
        LastLookup::Other {
            status: status.as_u16(),
            found: statuses.found.to_vec(),
            absent: statuses.absent.to_vec(),
        }
    }

    fn log_failed(&self, error: &str) {
        tracing::debug!(
            route = %self.context.route.name,
            key = %self.lease.key().id_hex(),
            %error,
            "lookup failed; asking again"
        );
    }

    /// Saves the found response as the key's result: its replays say
    /// `Idempotent-Resolved: true`.
    async fn found(self, saved: Saved) {
        let saved = match saved {
            Saved::Response(response) => Saved::Resolved(response),
            other => other,
        };
        self.save(saved).await;
    }

    /// Saves what `keep` would have, as `outcome-unknown`, saying what the last lookup
    /// answered.
    async fn give_up(self, last: LastLookup) {
        let upstream = self.context.route.upstream.name().to_owned();
        let problem = Problem::OutcomeUnknown {
            upstream,
            status: self.failure.status(),
            last,
        };
        self.save(Saved::Response(problem.saved())).await;
    }

    async fn save(self, saved: Saved) {
        let Unknown {
            context,
            lease,
            fingerprint,
            ..
        } = self;
        let shared = &context.shared;
        lease
            .save(
                Finished::new(fingerprint, saved),
                context.policy.ttl,
                &shared.tasks,
                &shared.pending,
            )
            .await;
    }
}

/// One running resolution, already counted in its gauge: taken off at the task's end, or its
/// panic.
struct Running(Gauge);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// One unit of a gauge for as long as it lives: dropped at the task's end, or its panic.
struct Counted(Gauge);

impl Counted {
    fn new(gauge: Gauge) -> Counted {
        gauge.inc();
        Counted(gauge)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.dec();
    }
}
