//! The load: the operations, and the clients that send and retry them through both proxies.

use super::*;

pub(crate) const TENANTS: [&str; 3] = ["tenant-a", "tenant-b", "tenant-c"];

/// One logical operation: a tenant, a key, a body, sent until it settles.
#[derive(Debug)]
pub(crate) struct OpSpec {
    pub(crate) idx: usize,
    pub(crate) tenant: &'static str,
    pub(crate) key: String,
    pub(crate) body: String,
    /// `X-Mock-Delay`: how long the upstream takes.
    pub(crate) delay_ms: u64,
    pub(crate) start: Duration,
    /// Concurrent clients (a duplicate job sends the same operation twice at once).
    pub(crate) clients: usize,
    /// On the `resolve` route (`POST /reservations`, [`RESOLVE_ROUTE`]): the booking's
    /// `reference`, which the route's lookup asks the upstream for.
    pub(crate) reference: Option<String>,
    /// The resolve lane's upstream response loss, sent on each client's first attempt only:
    /// `X-Mock-Lose-Response` (`after` or `before` the booking), and `X-Mock-Commit-After` in
    /// milliseconds (the booking visible to a lookup only that late).
    pub(crate) lose: Option<(&'static str, Option<u64>)>,
}

/// The resolve lane's route: `POST /reservations` books as `POST /bookings` does (the mock),
/// under `on_unknown_outcome: resolve` with a lookup by the body's `reference`.
pub(crate) const RESOLVE_ROUTE: &str = "/reservations";

/// The resolve route's `settle_after`: longer than the longest an execution can reach the mock
/// after the request was sent (the slowest upstream delay, 2.8s, plus the relay's largest
/// up-direction latency, 0.9s), so that an `absent` then is final.
pub(crate) const RESOLVE_SETTLE_AFTER: Duration = Duration::from_secs(5);
/// The resolve route's `give_up_after`: a resolution ends well within [`SETTLE_BOUND`].
pub(crate) const RESOLVE_GIVE_UP_AFTER: Duration = Duration::from_secs(10);

pub(crate) fn plan_ops(spec: &RunSpec, rng: &mut Rng) -> Vec<OpSpec> {
    let last_start = spec.chaos.saturating_sub(Duration::from_secs(2));
    let mut ops: Vec<OpSpec> = Vec::with_capacity(spec.ops);
    for idx in 0..spec.ops {
        let mut tenant = TENANTS[(rng.next() % 3) as usize];
        // Every tenth operation reuses the previous one's key under another tenant: the scope
        // makes them two operations.
        let key = match ops.last() {
            Some(prev) if idx % 10 == 9 => {
                while tenant == prev.tenant {
                    tenant = TENANTS[(rng.next() % 3) as usize];
                }
                prev.key.clone()
            }
            _ => format!("chaos-{:x}-{idx}", spec.seed & 0xffff_ffff),
        };
        let body = serde_json::json!({
            "op": format!("{tenant}/{key}"),
            "n": idx,
            "seat": format!("{}{}", rng.between(1, 40), ["A", "B", "C", "D"][idx % 4]),
        })
        .to_string();
        let delay_ms = if rng.percent(15) {
            rng.between(2400, 2800)
        } else {
            rng.between(0, 150)
        };
        ops.push(OpSpec {
            idx,
            tenant,
            key,
            body,
            delay_ms,
            start: rng.ms(200, u64::try_from(last_start.as_millis()).expect("ms")),
            clients: if rng.percent(30) { 2 } else { 1 },
            reference: None,
            lose: None,
        });
    }
    // The resolve lane: a tenth as many operations again on the `resolve` route, each under a
    // key of its own, most of them with their first response lost (after the booking, before
    // it, or after a booking that a lookup sees only later) on top of the run's faults.
    let plain = ops.len();
    for n in 0..spec.ops / 10 {
        let idx = plain + n;
        let tenant = TENANTS[(rng.next() % 3) as usize];
        let key = format!("chaos-r-{:x}-{n}", spec.seed & 0xffff_ffff);
        let reference = format!("ref-{:x}-{n}", spec.seed & 0xffff_ffff);
        let body = serde_json::json!({
            "op": format!("{tenant}/{key}"),
            "n": idx,
            "reference": reference,
        })
        .to_string();
        let lose = match rng.between(0, 99) {
            0..=39 => Some(("after", None)),
            40..=59 => Some(("before", None)),
            60..=74 => Some(("after", Some(rng.between(500, 2000)))),
            _ => None,
        };
        // Some slow enough to time out behind the relay's latency: an unknown outcome too.
        let delay_ms = if rng.percent(20) {
            rng.between(2400, 2800)
        } else {
            rng.between(0, 150)
        };
        ops.push(OpSpec {
            idx,
            tenant,
            key,
            body,
            delay_ms,
            start: rng.ms(200, u64::try_from(last_start.as_millis()).expect("ms")),
            clients: if rng.percent(30) { 2 } else { 1 },
            reference: Some(reference),
            lose,
        });
    }
    ops
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Via {
    A,
    B,
}

impl Via {
    pub(crate) fn tag(self) -> &'static str {
        match self {
            Via::A => "a",
            Via::B => "b",
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) enum AttemptResult {
    Answer {
        status: u16,
        replayed: bool,
        /// `Idempotent-Resolved: true`: a lookup's answer (the `resolve` route).
        resolved: bool,
        /// The problem type's slug, for `application/problem+json`.
        problem: Option<String>,
        body: Bytes,
    },
    Error(String),
}

#[derive(Debug, Clone)]
pub(crate) struct Attempt {
    pub(crate) op: usize,
    pub(crate) client: usize,
    pub(crate) id: u64,
    pub(crate) via: Via,
    pub(crate) sent: Duration,
    pub(crate) ended: Duration,
    pub(crate) result: AttemptResult,
}

impl Attempt {
    pub(crate) fn line(&self) -> String {
        let what = match &self.result {
            AttemptResult::Answer {
                status,
                replayed,
                resolved,
                problem,
                body,
            } => format!(
                "{status}{}{}{} {}",
                if *replayed { " replayed" } else { "" },
                if *resolved { " resolved" } else { "" },
                problem
                    .as_ref()
                    .map(|p| format!(" {p}"))
                    .unwrap_or_default(),
                String::from_utf8_lossy(&body[..body.len().min(90)])
            ),
            AttemptResult::Error(e) => format!("client error: {e}"),
        };
        format!(
            "attempt {} client {} via {} +{}..+{}: {}",
            self.id,
            self.client,
            self.via.tag(),
            secs(self.sent),
            secs(self.ended),
            what
        )
    }
}

pub(crate) struct Ctx {
    pub(crate) clock: Clock,
    pub(crate) http: reqwest::Client,
    pub(crate) a: String,
    pub(crate) b: String,
    /// Milliseconds from the start after which clients stop retrying (set after the last
    /// fault).
    pub(crate) deadline_ms: AtomicU64,
    pub(crate) attempt_ids: AtomicU64,
    pub(crate) attempts: Mutex<Vec<Attempt>>,
}

/// What to do after an attempt.
pub(crate) enum Verdict {
    Settled,
    Retry,
    Unexpected(String),
}

/// What an answer means for an operation on the `resolve` route (`resolve`) or the other.
pub(crate) fn verdict(r: &AttemptResult, resolve: bool) -> Verdict {
    let AttemptResult::Answer {
        status,
        replayed,
        resolved,
        problem,
        ..
    } = r
    else {
        return Verdict::Retry;
    };
    if *resolved && !(resolve && *status == 200 && *replayed && problem.is_none()) {
        return Verdict::Unexpected(format!(
            "Idempotent-Resolved on status {status}, replayed {replayed}, problem {problem:?}"
        ));
    }
    match (*status, *replayed, problem.as_deref()) {
        (201, _, None) => Verdict::Settled,
        // The lookup's found booking, replayed as the key's result.
        (200, true, None) if resolve && *resolved => Verdict::Settled,
        (502 | 504, true, Some("outcome-unknown")) if resolve => Verdict::Settled,
        (502, true, Some("upstream-failed")) | (504, true, Some("upstream-timeout")) => {
            Verdict::Settled
        }
        (409, false, Some("request-in-progress"))
        | (503, false, Some("store-unavailable"))
        | (502, false, Some("upstream-unavailable" | "upstream-failed"))
        | (504, false, Some("upstream-timeout")) => Verdict::Retry,
        (s, replayed, p) => {
            Verdict::Unexpected(format!("status {s}, replayed {replayed}, problem {p:?}"))
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) enum ClientEnd {
    Settled {
        at: Duration,
    },
    Unsettled,
    /// An answer the contract does not allow (reported from the attempt log).
    Unexpected,
}

/// One client of one operation: sends it through A or B at random, with a random timeout,
/// until it settles or the deadline passes.
pub(crate) async fn drive(
    ctx: Arc<Ctx>,
    op: Arc<OpSpec>,
    client: usize,
    mut rng: Rng,
) -> (usize, usize, ClientEnd) {
    let start = op.start
        + if client > 0 {
            rng.ms(0, 300)
        } else {
            Duration::ZERO
        };
    tokio::time::sleep_until(ctx.clock.at(start)).await;
    for n in 0..500 {
        let deadline = Duration::from_millis(ctx.deadline_ms.load(Ordering::SeqCst));
        if ctx.clock.now() >= deadline {
            return (op.idx, client, ClientEnd::Unsettled);
        }
        let via = if rng.percent(50) { Via::A } else { Via::B };
        let timeout = match rng.between(0, 99) {
            0..=19 => rng.ms(300, 800),
            20..=49 => rng.ms(1000, 2000),
            _ => Duration::from_secs(5),
        };
        let a = attempt(&ctx, &op, client, via, timeout, true, n == 0).await;
        let backoff = match verdict(&a.result, op.reference.is_some()) {
            Verdict::Settled => {
                return (op.idx, client, ClientEnd::Settled { at: a.ended });
            }
            Verdict::Unexpected(_) => return (op.idx, client, ClientEnd::Unexpected),
            Verdict::Retry => match &a.result {
                AttemptResult::Answer { status: 409, .. } => rng.ms(100, 500),
                _ => rng.ms(50, 400),
            },
        };
        tokio::time::sleep(backoff).await;
    }
    (op.idx, client, ClientEnd::Unsettled)
}

/// After the faults: sends the operation through `via` until it gets a result (a 201 or a
/// replayed saved answer), retrying a 503 or 409 for at most 10s; returns the last attempt.
pub(crate) async fn settle_via(ctx: &Ctx, op: &OpSpec, via: Via) -> Attempt {
    let until = ctx.clock.now() + Duration::from_secs(10);
    loop {
        let a = attempt(ctx, op, VERIFY, via, Duration::from_secs(5), false, false).await;
        if !matches!(verdict(&a.result, op.reference.is_some()), Verdict::Retry)
            || ctx.clock.now() >= until
        {
            return a;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Sends the operation once and logs the attempt; with `lose`, with the operation's response
/// loss ([`OpSpec::lose`]).
pub(crate) async fn attempt(
    ctx: &Ctx,
    op: &OpSpec,
    client: usize,
    via: Via,
    timeout: Duration,
    slow_upstream: bool,
    lose: bool,
) -> Attempt {
    let id = ctx.attempt_ids.fetch_add(1, Ordering::Relaxed);
    let base = match via {
        Via::A => &ctx.a,
        Via::B => &ctx.b,
    };
    let sent = ctx.clock.now();
    let mut req = ctx
        .http
        .post(format!(
            "{base}{}",
            if op.reference.is_some() {
                RESOLVE_ROUTE
            } else {
                "/bookings"
            }
        ))
        .header("Idempotency-Key", &op.key)
        .header("Authorization", format!("Bearer {}", op.tenant))
        .header("Content-Type", "application/json")
        .header("X-Chaos-Via", via.tag())
        .header("X-Chaos-Attempt", id.to_string())
        .timeout(timeout)
        .body(op.body.clone());
    if slow_upstream {
        req = req.header("X-Mock-Delay", format!("{}ms", op.delay_ms));
    }
    if let (true, Some((when, commit_after))) = (lose, op.lose) {
        req = req.header("X-Mock-Lose-Response", when);
        if let Some(ms) = commit_after {
            req = req.header("X-Mock-Commit-After", format!("{ms}ms"));
        }
    }
    let result = match req.send().await {
        Ok(resp) => {
            let status = resp.status().as_u16();
            let header = |name: &str| {
                resp.headers()
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_owned()
            };
            let replayed = header("idempotent-replayed") == "true";
            let resolved = header("idempotent-resolved") == "true";
            let is_problem = header("content-type") == "application/problem+json";
            match resp.bytes().await {
                Ok(body) => {
                    let problem = is_problem.then(|| {
                        serde_json::from_slice::<serde_json::Value>(&body)
                            .ok()
                            .and_then(|d| d["type"].as_str().map(str::to_owned))
                            .map(|t| {
                                t.strip_prefix("urn:idemproxy:problem:")
                                    .unwrap_or(&t)
                                    .to_owned()
                            })
                            .unwrap_or_else(|| "(unreadable problem)".into())
                    });
                    AttemptResult::Answer {
                        status,
                        replayed,
                        resolved,
                        problem,
                        body,
                    }
                }
                Err(e) => AttemptResult::Error(format!("reading the body: {e}")),
            }
        }
        Err(e) => AttemptResult::Error(if e.is_timeout() {
            format!("timed out after {timeout:?}")
        } else {
            format!("{e}")
        }),
    };
    let a = Attempt {
        op: op.idx,
        client,
        id,
        via,
        sent,
        ended: ctx.clock.now(),
        result,
    };
    ctx.attempts
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push(a.clone());
    a
}
