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
//! Its times count from when the request was sent, never from earlier: the latest moment it
//! could have been written (the call's start plus the upstream's `connect_timeout`), so an
//! `absent` is never taken as final before `settle_after` has really passed.
//!
//! It runs on the proxy's task tracker, so a drain waits for it up to `shutdown_timeout`.

use std::sync::Arc;

use tokio::time::Instant;

use super::ask::{self, Answer, Lookup, Statuses};
use crate::fingerprint::Fingerprint;
use crate::metrics::Resolution;
use crate::problem::Problem;
use crate::proxy::context::Context;
use crate::proxy::lease::Lease;
use crate::proxy::replay::RESOLVED;
use crate::record::{Finished, Saved};
use crate::route::ResolveSettings;

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
}

/// How one resolution ended, and after how many lookups.
struct Ended {
    result: Resolution,
    lookups: u32,
}

impl Unknown {
    /// Starts its resolution in a task of its own, tracked so that a drain waits for it.
    pub(in crate::proxy) fn spawn(self) {
        let tasks = self.context.shared.tasks.clone();
        tasks.spawn(self.run());
    }

    async fn run(self) {
        let started = Instant::now();
        let context = self.context.clone();
        let route = context.route.name.clone();
        let key = self.lease.key().id_hex();
        let Some(resolve) = self.context.policy.resolve.clone() else {
            // Only a route under `resolve` starts one; were the policy to lack its block, the
            // safe end is keep's.
            self.give_up().await;
            return;
        };
        let ended = self.resolve(&resolve).await;
        if let Some(metrics) = &context.route.resolved {
            metrics.resolution(ended.result);
        }
        tracing::info!(
            %route,
            key = %key,
            result = ended.result.as_str(),
            lookups = ended.lookups,
            took_ms = started.elapsed().as_millis(),
            "unknown outcome resolved"
        );
    }

    /// Asks until an answer settles it, or `give_up_after`.
    async fn resolve(mut self, resolve: &ResolveSettings) -> Ended {
        let settles_at = self.sent + resolve.settle_after;
        let gives_up_at = self.sent + resolve.give_up_after;
        let upstream = self.context.route.resolve_upstream.clone();
        let statuses = Statuses {
            found: &resolve.found,
            absent: &resolve.absent,
        };
        let mut lookups = 0;
        loop {
            let asked = Instant::now();
            if asked >= gives_up_at {
                break;
            }
            let answer = match &upstream {
                Some(up) if up.name() == self.lookup.upstream => {
                    let policy = self.context.policy.clone();
                    let asking = ask::ask(up, &self.lookup, &statuses, &policy);
                    let answer = self
                        .lease
                        .renewing(tokio::time::timeout_at(gives_up_at, asking))
                        .await;
                    match answer {
                        Ok(answer) => answer,
                        Err(_) => break,
                    }
                }
                // The lookup's upstream is not configured (any more): nobody can be asked.
                _ => Answer::Failed(format!("no upstream {:?} to ask", self.lookup.upstream)),
            };
            lookups += 1;
            self.count(&answer);
            match answer {
                Answer::Found(saved) => {
                    self.found(saved).await;
                    return Ended {
                        result: Resolution::Found,
                        lookups,
                    };
                }
                Answer::Absent if asked >= settles_at => {
                    self.lease.release().await;
                    return Ended {
                        result: Resolution::Absent,
                        lookups,
                    };
                }
                Answer::Absent => {}
                Answer::Other(status) => tracing::debug!(
                    route = %self.context.route.name,
                    key = %self.lease.key().id_hex(),
                    status = status.as_u16(),
                    "lookup answered neither found nor absent; asking again"
                ),
                Answer::Failed(error) => tracing::debug!(
                    route = %self.context.route.name,
                    key = %self.lease.key().id_hex(),
                    %error,
                    "lookup failed; asking again"
                ),
            }
            let next = (asked + resolve.interval).min(gives_up_at);
            self.lease.renewing(tokio::time::sleep_until(next)).await;
        }
        self.give_up().await;
        Ended {
            result: Resolution::GaveUp,
            lookups,
        }
    }

    fn count(&self, answer: &Answer) {
        if let Some(metrics) = &self.context.route.resolved {
            metrics.lookup(answer.counted());
        }
    }

    /// Saves the found response as the key's result.
    async fn found(self, saved: Saved) {
        self.complete(resolved(saved)).await;
    }

    /// Saves what `keep` would have, as `outcome-unknown`.
    async fn give_up(self) {
        let upstream = self.context.route.upstream.name().to_owned();
        let problem = Problem::OutcomeUnknown {
            upstream,
            status: self.failure.status(),
        };
        self.complete(Saved::Response(problem.saved())).await;
    }

    async fn complete(self, saved: Saved) {
        let Unknown {
            context,
            lease,
            fingerprint,
            ..
        } = self;
        let shared = &context.shared;
        lease
            .complete(
                Finished::new(fingerprint, saved),
                context.policy.ttl,
                &shared.tasks,
                &shared.pending,
            )
            .await;
    }
}

/// A found response as the key's result: its replays say `Idempotent-Resolved: true`.
fn resolved(saved: Saved) -> Saved {
    match saved {
        Saved::Response(mut response) => {
            response.headers.push((
                http::HeaderName::from_static(RESOLVED),
                http::HeaderValue::from_static("true"),
            ));
            Saved::Response(response)
        }
        other => other,
    }
}
