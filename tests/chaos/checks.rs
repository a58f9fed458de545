//! The checks: the exactly-once invariants, from the run's evidence and its loss windows.
//! [`check`] runs one function per invariant, in the order their failures are reported, then
//! sums the run up.

use super::*;

// ---------------------------------------------------------------------------------------------
// The checks
// ---------------------------------------------------------------------------------------------

pub(crate) struct RunData<'a> {
    pub(crate) spec: &'a RunSpec,
    pub(crate) ops: &'a [Arc<OpSpec>],
    pub(crate) attempts: Vec<Attempt>,
    pub(crate) ends: Vec<(usize, usize, ClientEnd)>,
    pub(crate) execs: Vec<Exec>,
    pub(crate) tap_errors: Vec<String>,
    pub(crate) ledger: BTreeMap<String, u64>,
    /// The bookings the mock made per `reference` (the resolve lane's operations).
    pub(crate) bookings: BTreeMap<String, u64>,
    pub(crate) windows: Vec<Window>,
    pub(crate) last_fault: Duration,
    pub(crate) in_progress: Vec<String>,
    pub(crate) verifications: Vec<(usize, Attempt, Attempt)>,
}

pub(crate) struct Outcome {
    pub(crate) failures: Vec<String>,
    pub(crate) summary: String,
}

/// Every invariant checked against the run's evidence, one function each, in the order their
/// failures are reported; then the run summed up.
pub(crate) fn check(d: &RunData<'_>) -> Outcome {
    let mut failures = Vec::new();
    let ev = Evidence::of(d);
    let execs_of = the_tap_is_whole(d, &mut failures);
    every_answer_is_allowed(d, &mut failures);
    let bookings_of = a_booking_answers_its_own_request(d, &mut failures);
    let reexecuted = every_reexecution_is_explained(d, &ev, &execs_of, &bookings_of, &mut failures);
    one_result_per_operation(d, &ev, &mut failures);
    let settled = nothing_hangs(d, &ev, &mut failures);
    no_in_progress_record_outlives_lock_ttl(d, &mut failures);
    the_closing_requests_replay(d, &ev, &settled.at, &mut failures);
    let summary = summary(d, &ev, &reexecuted, settled.after_fault);
    Outcome { failures, summary }
}

/// What the invariants read beside the run's data: the windows in which a claim could be lost
/// (which explain a re-execution), the slack around them, and each operation's attempts.
struct Evidence<'d> {
    strict: bool,
    losses: Vec<LossWindow>,
    slack: Duration,
    attempts_of: HashMap<usize, Vec<&'d Attempt>>,
}

impl<'d> Evidence<'d> {
    fn of(d: &'d RunData<'_>) -> Evidence<'d> {
        // With a persistent Redis and no proxy kills, nothing may run twice — unless the machine
        // stalled long enough to lose a lease (measured, and printed in the timeline).
        let strict = d.spec.store == StoreKind::PersistentRedis;
        let losses: Vec<LossWindow> = loss_windows(&d.windows, d.spec.lock_ttl)
            .into_iter()
            .filter(|w| !strict || w.machine)
            .collect();
        let slack = Duration::from_secs(1) + max_upstream_latency(&d.windows);
        let mut attempts_of: HashMap<usize, Vec<&Attempt>> = HashMap::new();
        for a in &d.attempts {
            attempts_of.entry(a.op).or_default().push(a);
        }
        for v in attempts_of.values_mut() {
            v.sort_by_key(|a| (a.sent, a.id));
        }
        Evidence {
            strict,
            losses,
            slack,
            attempts_of,
        }
    }

    /// The operation's attempts (the first 30), a line each, for a failure's message.
    fn history(&self, op: usize) -> String {
        let mut s = String::new();
        for a in self.attempts_of.get(&op).into_iter().flatten().take(30) {
            let _ = write!(s, "\n      {}", a.line());
        }
        s
    }
}

/// How many operations ran more than once, and what explained their re-executions.
struct Reexecuted {
    twice: usize,
    explained_by: BTreeMap<String, usize>,
}

/// When each operation settled, and how long after the last fault the last one did.
struct Settled {
    at: HashMap<usize, Duration>,
    after_fault: Duration,
}

/// The tap is the evidence: it must be whole — every execution the upstream received is one a
/// client sent, and the mock counted none the tap missed. Each operation's executions, in
/// order.
fn the_tap_is_whole<'d>(
    d: &'d RunData<'_>,
    failures: &mut Vec<String>,
) -> HashMap<usize, Vec<&'d Exec>> {
    let op_of: HashMap<(String, String), usize> = d
        .ops
        .iter()
        .map(|o| ((format!("Bearer {}", o.tenant), o.key.clone()), o.idx))
        .collect();
    // The tap is the evidence: it must be whole.
    for e in &d.tap_errors {
        failures.push(format!("harness: the upstream tap lost track: {e}"));
    }
    let mut execs_of: HashMap<usize, Vec<&Exec>> = HashMap::new();
    let mut tap_by_key: HashMap<&str, u64> = HashMap::new();
    for e in &d.execs {
        *tap_by_key.entry(e.key.as_str()).or_default() += 1;
        match op_of.get(&(e.auth.clone(), e.key.clone())) {
            Some(op) => execs_of.entry(*op).or_default().push(e),
            None => failures.push(format!(
                "the upstream received an operation no client sent: {} {:?}",
                e.auth, e.key
            )),
        }
    }
    for v in execs_of.values_mut() {
        v.sort_by_key(|e| e.at);
    }
    for (key, calls) in &d.ledger {
        let seen = tap_by_key.get(key.as_str()).copied().unwrap_or(0);
        if *calls > seen {
            failures.push(format!(
                "harness: the mock counted {calls} executions of {key:?}, the tap saw {seen}"
            ));
        }
    }
    execs_of
}

/// Every answer is one the contract allows.
fn every_answer_is_allowed(d: &RunData<'_>, failures: &mut Vec<String>) {
    // Every answer is one the contract allows.
    for a in &d.attempts {
        if let Verdict::Unexpected(why) = verdict(&a.result, d.ops[a.op].reference.is_some()) {
            failures.push(format!(
                "op {} got an answer the contract does not allow ({why}): {}",
                a.op,
                a.line()
            ));
        }
    }
}

/// A booking embeds its own request, and a booking id answers one operation. The booking ids
/// each operation was answered.
fn a_booking_answers_its_own_request(
    d: &RunData<'_>,
    failures: &mut Vec<String>,
) -> HashMap<usize, HashSet<String>> {
    // Bodies: a booking embeds its own request; a booking id answers one operation.
    let mut booking_owner: HashMap<String, usize> = HashMap::new();
    let mut bookings_of: HashMap<usize, HashSet<String>> = HashMap::new();
    for a in &d.attempts {
        let body = match &a.result {
            AttemptResult::Answer {
                status: 201, body, ..
            }
            | AttemptResult::Answer {
                status: 200,
                resolved: true,
                body,
                ..
            } => body,
            _ => continue,
        };
        let op = &d.ops[a.op];
        let doc: serde_json::Value = match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(e) => {
                failures.push(format!(
                    "op {}: a 201 that is not JSON ({e}): {}",
                    a.op,
                    a.line()
                ));
                continue;
            }
        };
        let expected: serde_json::Value =
            serde_json::from_str(&op.body).expect("the op body is JSON");
        if doc["request"] != expected {
            failures.push(format!(
                "op {} ({}/{}) got another request's booking: {}",
                a.op,
                op.tenant,
                op.key,
                a.line()
            ));
        }
        let Some(id) = doc["id"].as_str() else {
            failures.push(format!(
                "op {}: a booking without an id: {}",
                a.op,
                a.line()
            ));
            continue;
        };
        let owner = *booking_owner.entry(id.to_owned()).or_insert(a.op);
        if owner != a.op {
            failures.push(format!(
                "booking {id} was answered to op {owner} and to op {}",
                a.op
            ));
        }
        bookings_of.entry(a.op).or_default().insert(id.to_owned());
    }
    bookings_of
}

/// Every re-execution is explained by a window in which its claim could be lost, or there is
/// none at all (a persistent run); on the resolve route, only a store that lost the record.
fn every_reexecution_is_explained(
    d: &RunData<'_>,
    ev: &Evidence<'_>,
    execs_of: &HashMap<usize, Vec<&Exec>>,
    bookings_of: &HashMap<usize, HashSet<String>>,
    failures: &mut Vec<String>,
) -> Reexecuted {
    let (strict, losses, slack) = (ev.strict, &ev.losses, ev.slack);
    let attempts_of = &ev.attempts_of;
    let history = |op: usize| ev.history(op);
    // Executions: every re-execution explained, or none at all (persistent run).
    let mut twice = 0usize;
    let mut explained_by: BTreeMap<String, usize> = BTreeMap::new();
    for op in d.ops {
        let execs = execs_of.get(&op.idx).cloned().unwrap_or_default();
        let succeeded = attempts_of.get(&op.idx).into_iter().flatten().any(|a| {
            matches!(
                a.result,
                AttemptResult::Answer { status: 201, .. }
                    | AttemptResult::Answer {
                        status: 200,
                        resolved: true,
                        ..
                    }
            )
        });
        if succeeded && execs.is_empty() {
            failures.push(format!(
                "op {} got a 201 but the upstream never received it{}",
                op.idx,
                history(op.idx)
            ));
        }
        let bookings = bookings_of.get(&op.idx).map_or(0, HashSet::len);
        if bookings > execs.len() {
            failures.push(format!(
                "op {}: {bookings} different bookings answered, {} executions",
                op.idx,
                execs.len()
            ));
        }
        // The resolve lane: an unknown outcome is never forwarded again without the upstream's
        // word, proxy kills and lapsed leases included (the claim carries its lookup, and is
        // taken over as a resolution); only a store that lost the record itself (Redis without
        // persistence, restarted) between two of its upstream requests excuses a second booking.
        // Counted by the bookings the mock made for the reference: the tap also sees requests
        // dropped before the booking (`X-Mock-Lose-Response: before`), which a final `absent`
        // rightly lets run again.
        if let Some(reference) = &op.reference {
            let booked = d.bookings.get(reference).copied().unwrap_or(0);
            if succeeded && booked == 0 {
                failures.push(format!(
                    "op {} ({}/{}, resolve route) was answered a booking the mock never made{}",
                    op.idx,
                    op.tenant,
                    op.key,
                    history(op.idx)
                ));
            }
            if booked < 2 {
                continue;
            }
            twice += 1;
            let (Some(first), Some(last)) = (
                attempts_of.get(&op.idx).and_then(|v| v.first()),
                attempts_of
                    .get(&op.idx)
                    .and_then(|v| v.iter().map(|a| a.ended).max()),
            ) else {
                continue;
            };
            // The restart lies between two of its upstream requests (the tap's), as for any
            // re-execution.
            let records_lost = losses.iter().find(|w| {
                w.loss == Loss::RecordsLost
                    && execs
                        .windows(2)
                        .any(|pair| explains(w, pair[0], pair[1], slack))
            });
            match records_lost {
                Some(w) => *explained_by.entry(w.kind()).or_default() += 1,
                None => failures.push(format!(
                    "op {} ({}/{}, resolve route) was booked {booked} times and no store lost \
                     its record between two of its executions (lifetime +{}..+{}): executions {}{}",
                    op.idx,
                    op.tenant,
                    op.key,
                    secs(first.sent),
                    secs(last),
                    execs
                        .iter()
                        .map(|e| format!("+{} via {} (attempt {})", secs(e.at), e.via, e.attempt))
                        .collect::<Vec<_>>()
                        .join(", "),
                    history(op.idx)
                )),
            }
            continue;
        }
        if execs.len() < 2 {
            continue;
        }
        twice += 1;
        let times: Vec<String> = execs
            .iter()
            .map(|e| format!("+{} via {} (attempt {})", secs(e.at), e.via, e.attempt))
            .collect();
        let explanations: Vec<Option<&LossWindow>> = execs
            .windows(2)
            .map(|pair| losses.iter().find(|w| explains(w, pair[0], pair[1], slack)))
            .collect();
        for w in explanations.iter().flatten() {
            *explained_by.entry(w.kind()).or_default() += 1;
        }
        if strict && explanations.iter().any(Option::is_none) {
            failures.push(format!(
                "op {} ({}/{}) ran {} times with a persistent Redis and no proxy kills{}: {}{}",
                op.idx,
                op.tenant,
                op.key,
                execs.len(),
                if succeeded {
                    " (a client saw it succeed)"
                } else {
                    ""
                },
                times.join(", "),
                history(op.idx)
            ));
            continue;
        }
        for (pair, explanation) in execs.windows(2).zip(&explanations) {
            let (prev, next) = (pair[0], pair[1]);
            if explanation.is_some() {
                continue;
            }
            failures.push(format!(
                "op {} ({}/{}) ran again with nothing to explain it: executions {}; \
                     no claim-losing fault between +{} (minus {}s slack) and +{}{}{}",
                op.idx,
                op.tenant,
                op.key,
                times.join(", "),
                secs(prev.at),
                secs(slack),
                secs(next.at),
                if succeeded {
                    "; a client saw it succeed"
                } else {
                    ""
                },
                history(op.idx)
            ));
        }
    }
    Reexecuted {
        twice,
        explained_by,
    }
}

/// One result per operation: replays byte-identical, unless a claim-losing fault touched its
/// lifetime.
fn one_result_per_operation(d: &RunData<'_>, ev: &Evidence<'_>, failures: &mut Vec<String>) {
    let (losses, slack) = (&ev.losses, ev.slack);
    let attempts_of = &ev.attempts_of;
    let history = |op: usize| ev.history(op);
    // Results: one body per operation, unless a claim-losing fault touched its lifetime.
    // On the resolve route a fresh 502/504 is no result (the key is being resolved); a found
    // booking, replayed, and a saved `outcome-unknown` are.
    for op in d.ops {
        let all = attempts_of.get(&op.idx).cloned().unwrap_or_default();
        let results: Vec<&&Attempt> = all.iter().filter(|a| is_result(d, a)).collect();
        let distinct: HashSet<(u16, Bytes)> = results.iter().filter_map(|a| body_of(a)).collect();
        let (Some(first), Some(last)) = (all.first(), all.iter().map(|a| a.ended).max()) else {
            continue;
        };
        let lifetime_losses = losses
            .iter()
            .filter(|w| w.end + slack >= first.sent && w.start <= last)
            .count();
        if distinct.len() > 1 + lifetime_losses {
            failures.push(format!(
                "op {} ({}/{}) has {} different results and {} claim-losing fault(s) in its \
                 lifetime: replays must be byte-identical{}",
                op.idx,
                op.tenant,
                op.key,
                distinct.len(),
                lifetime_losses,
                history(op.idx)
            ));
        }
    }
}

/// Nothing hangs: every client settles within the bound after the last fault. When each
/// operation settled, and how long after the last fault the last one did.
fn nothing_hangs(d: &RunData<'_>, ev: &Evidence<'_>, failures: &mut Vec<String>) -> Settled {
    let history = |op: usize| ev.history(op);
    // Nothing hangs.
    let mut settle_after_fault = Duration::ZERO;
    let mut settled_at: HashMap<usize, Duration> = HashMap::new();
    for (op, client, end) in &d.ends {
        match end {
            ClientEnd::Settled { at } => {
                settle_after_fault = settle_after_fault.max(at.saturating_sub(d.last_fault));
                let e = settled_at.entry(*op).or_insert(*at);
                *e = (*e).max(*at);
            }
            ClientEnd::Unsettled => failures.push(format!(
                "op {op} client {client} did not settle within {SETTLE_BOUND:?} after the last \
                 fault (+{}){}",
                secs(d.last_fault),
                history(*op)
            )),
            // Already reported with every unexpected answer.
            ClientEnd::Unexpected => {}
        }
    }
    Settled {
        at: settled_at,
        after_fault: settle_after_fault,
    }
}

/// No in-progress record outlives lock_ttl after the last fault.
fn no_in_progress_record_outlives_lock_ttl(d: &RunData<'_>, failures: &mut Vec<String>) {
    // No in-progress record outlives lock_ttl after the last fault.
    for r in &d.in_progress {
        failures.push(format!(
            "an in-progress record outlived lock_ttl after the last fault: {r}"
        ));
    }
}

/// The closing requests: two of each operation, after the faults, a result and its
/// byte-identical replay; without a claim-losing fault since the operation settled, its
/// record answers unchanged.
fn the_closing_requests_replay(
    d: &RunData<'_>,
    ev: &Evidence<'_>,
    settled_at: &HashMap<usize, Duration>,
    failures: &mut Vec<String>,
) {
    let (losses, slack) = (&ev.losses, ev.slack);
    let attempts_of = &ev.attempts_of;
    let history = |op: usize| ev.history(op);
    // The closing replays.
    for (op, a, b) in &d.verifications {
        let (Some(ra), Some(rb)) = (body_of(a), body_of(b)) else {
            failures.push(format!(
                "op {op}: a closing request failed: {} / {}",
                a.line(),
                b.line()
            ));
            continue;
        };
        if !matches!(
            verdict(&a.result, d.ops[*op].reference.is_some()),
            Verdict::Settled
        ) {
            failures.push(format!(
                "op {op}: after the faults, not a result: {}",
                a.line()
            ));
            continue;
        }
        let b_replayed = matches!(b.result, AttemptResult::Answer { replayed: true, .. });
        if ra != rb || !b_replayed {
            failures.push(format!(
                "op {op}: two closing requests, not a byte-identical replay:\n      {}\n      {}",
                a.line(),
                b.line()
            ));
        }
        // Without a claim-losing fault since the op settled, its record answers unchanged.
        let Some(settled) = settled_at.get(op) else {
            continue;
        };
        let lost_since = losses
            .iter()
            .any(|w| w.end + slack >= *settled && w.start <= a.sent);
        let a_replayed = matches!(a.result, AttemptResult::Answer { replayed: true, .. });
        if !lost_since {
            let last_result = attempts_of
                .get(op)
                .into_iter()
                .flatten()
                .filter(|x| x.client != VERIFY && is_result(d, x))
                .max_by_key(|x| x.ended)
                .and_then(|x| body_of(x));
            if !a_replayed || last_result.as_ref() != Some(&ra) {
                failures.push(format!(
                    "op {op}: its record did not survive (no fault could lose it): {}{}",
                    a.line(),
                    history(*op)
                ));
            }
        }
    }
}

/// The run in numbers: answers, executions, re-executions and what explained them, the resolve
/// lane, the claim-losing windows and the crashes.
fn summary(
    d: &RunData<'_>,
    ev: &Evidence<'_>,
    reexecuted: &Reexecuted,
    settle_after_fault: Duration,
) -> String {
    let (losses, slack) = (&ev.losses, ev.slack);
    let attempts_of = &ev.attempts_of;
    let Reexecuted {
        twice,
        explained_by,
    } = reexecuted;
    let ledger_total: u64 = d.ledger.values().sum();
    let mut statuses: BTreeMap<String, usize> = BTreeMap::new();
    for a in &d.attempts {
        let k = match &a.result {
            AttemptResult::Answer {
                status,
                replayed,
                resolved,
                problem,
                ..
            } => format!(
                "{status}{}{}{}",
                if *replayed { " replayed" } else { "" },
                if *resolved { " resolved" } else { "" },
                problem
                    .as_ref()
                    .map(|p| format!(" {p}"))
                    .unwrap_or_default()
            ),
            AttemptResult::Error(e) if e.starts_with("timed out") => "client timeout".into(),
            AttemptResult::Error(_) => "client error".into(),
        };
        *statuses.entry(k).or_default() += 1;
    }
    let mut summary = String::new();
    let _ = writeln!(
        summary,
        "operations {}, attempts {}, upstream executions {} (ledger {}), operations run more \
         than once {} (explained re-executions: {:?}), settled at most {}s after the last \
         fault, in-progress records left {}",
        d.ops.len(),
        d.attempts.len(),
        d.execs.len(),
        ledger_total,
        twice,
        explained_by,
        secs(settle_after_fault),
        d.in_progress.len()
    );
    let _ = writeln!(summary, "answers: {statuses:?}");
    let resolve_ops: Vec<&Arc<OpSpec>> = d.ops.iter().filter(|o| o.reference.is_some()).collect();
    let booked = |o: &OpSpec| {
        o.reference
            .as_ref()
            .and_then(|r| d.bookings.get(r))
            .copied()
            .unwrap_or(0)
    };
    let killed_in_lifetime = resolve_ops
        .iter()
        .filter(|o| {
            let Some(all) = attempts_of.get(&o.idx) else {
                return false;
            };
            let (Some(first), Some(last)) = (all.first(), all.iter().map(|a| a.ended).max()) else {
                return false;
            };
            losses.iter().any(|w| {
                w.loss == Loss::ClaimsOfB && w.end + slack >= first.sent && w.start <= last
            })
        })
        .count();
    let _ = writeln!(
        summary,
        "resolve lane: {} operations ({} with their first response lost), booked once {}, never {}, \
         more than once {}; {} with a proxy B kill in their lifetime",
        resolve_ops.len(),
        resolve_ops.iter().filter(|o| o.lose.is_some()).count(),
        resolve_ops.iter().filter(|o| booked(o) == 1).count(),
        resolve_ops.iter().filter(|o| booked(o) == 0).count(),
        resolve_ops.iter().filter(|o| booked(o) > 1).count(),
        killed_in_lifetime
    );
    let _ = write!(summary, "claim-losing windows (slack {}s):", secs(slack));
    for w in losses {
        let _ = write!(
            summary,
            "\n  +{}..+{} {}: {}",
            secs(w.start),
            secs(w.end),
            w.kind(),
            w.what
        );
    }
    let crashes: Vec<String> = d
        .windows
        .iter()
        .filter(|w| w.loss == Loss::Crash)
        .map(|w| format!("+{} ({:?})", secs(w.start), w.end - w.start))
        .collect();
    if !crashes.is_empty() {
        let _ = write!(
            summary,
            "\ncrash outages (explain nothing under {:?}): {}",
            crash_outage_bound(d.spec.lock_ttl),
            crashes.join(", ")
        );
    }
    summary
}

/// Whether an attempt's answer is a result of its operation. On the resolve route a fresh
/// 502/504 is no result (the key is being resolved); a found booking, replayed, and a saved
/// `outcome-unknown` are.
fn is_result(d: &RunData<'_>, a: &Attempt) -> bool {
    match &a.result {
        AttemptResult::Answer {
            status,
            problem,
            replayed,
            resolved,
            ..
        } => {
            let resolve = d.ops[a.op].reference.is_some();
            *status == 201
                || (resolve && *status == 200 && *resolved)
                || ((*replayed || !resolve)
                    && ((*status == 502 && problem.as_deref() == Some("upstream-failed"))
                        || (*status == 504 && problem.as_deref() == Some("upstream-timeout"))))
                || (resolve
                    && *replayed
                    && matches!(*status, 502 | 504)
                    && problem.as_deref() == Some("outcome-unknown"))
        }
        AttemptResult::Error(_) => false,
    }
}

/// An answer's status and body.
fn body_of(a: &Attempt) -> Option<(u16, Bytes)> {
    match &a.result {
        AttemptResult::Answer { body, status, .. } => Some((*status, body.clone())),
        AttemptResult::Error(_) => None,
    }
}
