//! The scenario catalogue, in run order, and choosing scenarios from a comma list of globs.

use Store::{Memory, Redis};

use crate::pgbench::Script;
use Target::{
    Direct, Fill, JsonRpcNew, JsonRpcReplay, NewKey, Nginx, Observe, Passthrough, Replay, Resolve,
    Storm, Webhook,
};

/// Which store a proxy scenario runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Store {
    Memory,
    Redis,
    /// An SQLite file of the scenario's own, `sync: normal`.
    Sqlite,
    /// The same with `sync: full` (an fsync per commit).
    SqliteFull,
    /// A schema of the scenario's own on the run's private PostgreSQL server.
    Postgres,
}

impl Store {
    /// Why a scenario on this store is skipped when its server is missing.
    pub(crate) fn missing(self) -> &'static str {
        match self {
            Store::Postgres => "PostgreSQL is not installed (apt-get install postgresql)",
            Store::Memory | Store::Redis | Store::Sqlite | Store::SqliteFull => {
                "redis-server is not installed"
            }
        }
    }
}

/// What a scenario sends its load to, and how.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Target {
    /// Straight to the mock upstream.
    Direct,
    /// nginx `proxy_pass` to the mock: the reference reverse proxy.
    Nginx,
    /// The proxy's plain pass-through route.
    Passthrough,
    /// An idempotent route, a new key on every request.
    NewKey(Store),
    /// An observed route (`mode: observe`), a new key on every request: forwarded at once,
    /// claimed and saved beside and after it.
    Observe(Store),
    /// An idempotent route, one finished key on every request.
    Replay(Store),
    /// Duplicates of keys still in flight, all at once.
    Storm(Store),
    /// `pgbench` against the run's PostgreSQL, with the proxy's own statements: the ceiling of
    /// `new-key/postgres` (claim + complete), of `replay/postgres` (a primary-key read of the
    /// record), and what the claim costs on a finished key; alone, or [`Beside::Load`].
    Ceiling(Script, Beside),
    /// The proxy's SQLite writer, its claims and completions on a fresh file as fast as one
    /// thread can (`sqlite_ceiling`): the ceiling of `new-key/sqlite`; alone, or
    /// [`Beside::Load`].
    SqliteCeiling(Beside),
    /// A Standard Webhooks route, a new event id on every delivery, each signed.
    Webhook(Store),
    /// A JSON-RPC route: a `tools/call` with a new key in `_meta` per request.
    JsonRpcNew(Store),
    /// A JSON-RPC route: one finished call, repeated with a new `id` per request.
    JsonRpcReplay(Store),
    /// The mock ledger's gRPC `Transfer` called directly over HTTP/2: the gRPC rows' ceiling.
    GrpcDirect,
    /// The same calls through the proxy's pass-through route on an `h2c` upstream.
    GrpcPass,
    /// The same calls on a `grpc:` route, a new key in the metadata per call.
    GrpcNew(Store),
    /// The same call on a `grpc:` route, one finished key.
    GrpcReplay(Store),
    /// A route under `on_unknown_outcome: resolve`: a bounded number of requests whose answer
    /// is lost after the upstream acted, then the wait until each is resolved.
    Resolve(Store),
    /// New keys at full speed with `ttl: 1s` for minutes, the store's row count sampled.
    Churn(Store),
    /// The memory store filled with many finished keys.
    Fill,
}

/// What a ceiling shares the machine with while it is measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Beside {
    /// The cores to itself: the database's (or the writer's) best.
    Nothing,
    /// The load generator driving the mock upstream at the same concurrency, as the proxy's
    /// rows run them: the database shares the cores with them as it does in those rows, so a
    /// ratio to this ceiling compares like with like (what the proxy adds is the difference).
    Load,
}

/// One named scenario.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Scenario {
    pub name: &'static str,
    pub target: Target,
    /// 64 KiB responses (`X-Mock-Body-Size: 65536`) instead of the ~370-byte JSON echo.
    pub big: bool,
    pub about: &'static str,
}

impl Scenario {
    /// The store the proxy runs on, if the scenario goes through an idempotent route.
    pub(crate) fn store(&self) -> Option<Store> {
        match self.target {
            Target::NewKey(s) | Target::Observe(s) | Target::Replay(s) | Target::Storm(s) => {
                Some(s)
            }
            Target::Churn(s) | Target::Webhook(s) | Target::Resolve(s) => Some(s),
            Target::JsonRpcNew(s) | Target::JsonRpcReplay(s) => Some(s),
            Target::GrpcNew(s) | Target::GrpcReplay(s) => Some(s),
            Target::Ceiling(..) => Some(Store::Postgres),
            Target::SqliteCeiling(_) => Some(Store::Sqlite),
            Target::Fill => Some(Store::Memory),
            Target::Direct
            | Target::Nginx
            | Target::Passthrough
            | Target::GrpcDirect
            | Target::GrpcPass => None,
        }
    }

    /// Part of a run when no scenario is named.
    pub(crate) fn in_default_run(&self) -> bool {
        self.target != Target::Fill && !self.is_churn()
    }

    /// A churn scenario: minutes long, picked only by a pattern that names it (see [`select`]).
    fn is_churn(&self) -> bool {
        matches!(self.target, Target::Churn(_))
    }

    /// Its throughput is compared with the nginx and pass-through rows of the same body size.
    fn wants_baselines(&self) -> bool {
        matches!(
            self.target,
            Target::NewKey(_)
                | Target::Observe(_)
                | Target::Replay(_)
                | Target::Webhook(_)
                | Target::JsonRpcNew(_)
                | Target::JsonRpcReplay(_)
        )
    }

    /// The ceilings run beside it: the pgbench rows for new keys and replays on PostgreSQL,
    /// the SQLite writer's for new keys on SQLite (`sync: normal`, small bodies).
    fn ceilings(&self) -> &'static [Target] {
        match self.target {
            NewKey(Store::Postgres) if !self.big => &[
                Target::Ceiling(Script::ClaimComplete, Beside::Nothing),
                Target::Ceiling(Script::ClaimComplete, Beside::Load),
            ],
            Replay(Store::Postgres) if !self.big => &[
                Target::Ceiling(Script::Read, Beside::Nothing),
                Target::Ceiling(Script::Read, Beside::Load),
                Target::Ceiling(Script::Repeat, Beside::Nothing),
            ],
            NewKey(Store::Sqlite) if !self.big => &[
                Target::SqliteCeiling(Beside::Nothing),
                Target::SqliteCeiling(Beside::Load),
            ],
            _ => &[],
        }
    }

    /// The scenario it is compared with: new keys on the same store, for a webhook row or a
    /// new JSON-RPC call; replays, for a JSON-RPC replay.
    fn reference(&self) -> Option<Target> {
        match self.target {
            Webhook(store) | JsonRpcNew(store) => Some(NewKey(store)),
            JsonRpcReplay(store) => Some(Replay(store)),
            Target::GrpcPass => Some(Target::GrpcDirect),
            Target::GrpcNew(_) | Target::GrpcReplay(_) => Some(Target::GrpcPass),
            _ => None,
        }
    }

    /// The name without its `/store` suffix: `new-key/redis` -> `new-key`.
    fn family(&self) -> &'static str {
        self.name.split('/').next().unwrap_or(self.name)
    }
}

const fn scenario(name: &'static str, target: Target, big: bool, about: &'static str) -> Scenario {
    Scenario {
        name,
        target,
        big,
        about,
    }
}

/// Every scenario, in the order a run executes them (baselines first).
pub(crate) const ALL: &[Scenario] = &[
    scenario("direct", Direct, false, "straight to the upstream"),
    scenario(
        "nginx",
        Nginx,
        false,
        "nginx proxy_pass (keep-alive upstream)",
    ),
    scenario(
        "passthrough",
        Passthrough,
        false,
        "the proxy's pass-through route",
    ),
    scenario(
        "new-key/memory",
        NewKey(Memory),
        false,
        "a new Idempotency-Key per request",
    ),
    scenario(
        "new-key/redis",
        NewKey(Redis),
        false,
        "a new Idempotency-Key per request",
    ),
    scenario(
        "new-key/sqlite",
        NewKey(Store::Sqlite),
        false,
        "a new Idempotency-Key per request, SQLite sync: normal",
    ),
    scenario(
        "ceiling/sqlite",
        Target::SqliteCeiling(Beside::Nothing),
        false,
        "the proxy's SQLite writer alone: claim + complete batches on a fresh file",
    ),
    scenario(
        "ceiling-shared/sqlite",
        Target::SqliteCeiling(Beside::Load),
        false,
        "the SQLite writer beside the load generator driving the mock, as new-key/sqlite shares the cores",
    ),
    scenario(
        "new-key/sqlite-full",
        NewKey(Store::SqliteFull),
        false,
        "a new Idempotency-Key per request, SQLite sync: full",
    ),
    scenario(
        "new-key/postgres",
        NewKey(Store::Postgres),
        false,
        "a new Idempotency-Key per request",
    ),
    scenario(
        "pgbench/postgres",
        Target::Ceiling(Script::ClaimComplete, Beside::Nothing),
        false,
        "pgbench alone: the proxy's claim + complete per transaction",
    ),
    scenario(
        "pgbench-shared/postgres",
        Target::Ceiling(Script::ClaimComplete, Beside::Load),
        false,
        "pgbench beside the load generator driving the mock: claim + complete per transaction",
    ),
    scenario(
        "observe/memory",
        Observe(Memory),
        false,
        "a new key per request on an observed route",
    ),
    scenario(
        "observe/redis",
        Observe(Redis),
        false,
        "a new key per request on an observed route",
    ),
    scenario(
        "webhook/memory",
        Webhook(Memory),
        false,
        "a Standard Webhooks route, a new signed event id per delivery",
    ),
    scenario(
        "webhook/postgres",
        Webhook(Store::Postgres),
        false,
        "a Standard Webhooks route, a new signed event id per delivery",
    ),
    scenario(
        "jsonrpc-new/memory",
        JsonRpcNew(Memory),
        false,
        "a JSON-RPC tools/call per request, a new key in _meta",
    ),
    scenario(
        "replay/memory",
        Replay(Memory),
        false,
        "one finished key, replayed",
    ),
    scenario(
        "replay/redis",
        Replay(Redis),
        false,
        "one finished key, replayed",
    ),
    scenario(
        "replay/sqlite",
        Replay(Store::Sqlite),
        false,
        "one finished key, replayed",
    ),
    scenario(
        "replay/postgres",
        Replay(Store::Postgres),
        false,
        "one finished key, replayed",
    ),
    scenario(
        "grpc-direct",
        Target::GrpcDirect,
        false,
        "gRPC unary calls straight to the mock ledger over HTTP/2: the gRPC rows' ceiling",
    ),
    scenario(
        "grpc-pass/memory",
        Target::GrpcPass,
        false,
        "the same calls through a pass-through route on an h2c upstream",
    ),
    scenario(
        "grpc-new/memory",
        Target::GrpcNew(Memory),
        false,
        "the same calls on a grpc: route, a new idempotency-key per call",
    ),
    scenario(
        "grpc-replay/memory",
        Target::GrpcReplay(Memory),
        false,
        "one finished call on a grpc: route, replayed",
    ),
    scenario(
        "jsonrpc-replay/memory",
        JsonRpcReplay(Memory),
        false,
        "one finished tools/call, repeated with a new id each time",
    ),
    scenario(
        "pgbench-read/postgres",
        Target::Ceiling(Script::Read, Beside::Nothing),
        false,
        "pgbench alone: a primary-key read of one finished record per transaction",
    ),
    scenario(
        "pgbench-read-shared/postgres",
        Target::Ceiling(Script::Read, Beside::Load),
        false,
        "pgbench beside the load generator driving the mock: a primary-key read per transaction",
    ),
    scenario(
        "pgbench-repeat/postgres",
        Target::Ceiling(Script::Repeat, Beside::Nothing),
        false,
        "pgbench alone: the proxy's claim statement on one finished record per transaction",
    ),
    scenario(
        "conflict-storm/memory",
        Storm(Memory),
        false,
        "duplicates of keys in flight",
    ),
    scenario(
        "conflict-storm/redis",
        Storm(Redis),
        false,
        "duplicates of keys in flight",
    ),
    scenario(
        "conflict-storm/sqlite",
        Storm(Store::Sqlite),
        false,
        "duplicates of keys in flight",
    ),
    scenario(
        "conflict-storm/postgres",
        Storm(Store::Postgres),
        false,
        "duplicates of keys in flight",
    ),
    scenario(
        "resolve/memory",
        Resolve(Memory),
        false,
        "responses lost after the booking (--lost), resolved by lookup",
    ),
    scenario(
        "resolve/postgres",
        Resolve(Store::Postgres),
        false,
        "responses lost after the booking (--lost), resolved by lookup",
    ),
    scenario(
        "64k-direct",
        Direct,
        true,
        "64 KiB responses, straight to the mock",
    ),
    scenario("64k-nginx", Nginx, true, "64 KiB responses through nginx"),
    scenario(
        "64k-passthrough",
        Passthrough,
        true,
        "64 KiB responses, pass-through",
    ),
    scenario(
        "64k-new-key/memory",
        NewKey(Memory),
        true,
        "64 KiB responses saved",
    ),
    scenario(
        "64k-new-key/redis",
        NewKey(Redis),
        true,
        "64 KiB responses saved",
    ),
    scenario(
        "64k-new-key/sqlite",
        NewKey(Store::Sqlite),
        true,
        "64 KiB responses saved",
    ),
    scenario(
        "64k-new-key/postgres",
        NewKey(Store::Postgres),
        true,
        "64 KiB responses saved",
    ),
    scenario(
        "64k-replay/memory",
        Replay(Memory),
        true,
        "64 KiB responses replayed",
    ),
    scenario(
        "64k-replay/redis",
        Replay(Redis),
        true,
        "64 KiB responses replayed",
    ),
    scenario(
        "churn/sqlite",
        Target::Churn(Store::Sqlite),
        false,
        "new keys with ttl: 1s for minutes, rows sampled (--churn-duration)",
    ),
    scenario(
        "churn/postgres",
        Target::Churn(Store::Postgres),
        false,
        "new keys with ttl: 1s for minutes, rows sampled (--churn-duration)",
    ),
    scenario(
        "fill-1m",
        Fill,
        false,
        "new-key before/after filling the memory store (--fill-keys)",
    ),
];

/// The scenarios a comma list of patterns names, in run order.
///
/// A pattern is a scenario name, a name without its store (`new-key`), a glob with `*`
/// (`64k-*`, `*/redis`), `default` (everything but `fill-1m` and `churn/*`) or `all`. A glob
/// that starts with `*` (`*/sqlite*`) picks no churn scenario: those run for minutes, and are
/// picked by a pattern that begins with their name (`churn`, `churn/*`, `churn/sqlite`). With
/// `baselines`, the nginx and pass-through rows of the same body size are added to any new-key,
/// observe, replay or webhook scenario, so its ratios can be computed; the pgbench ceiling to
/// `new-key/postgres` and the SQLite writer's to `new-key/sqlite`; and `new-key/STORE` to
/// `webhook/STORE`. Only what a pattern picked brings rows along: a `new-key` row added for a
/// webhook row brings no ceiling.
pub(crate) fn select(list: &str, baselines: bool) -> Result<Vec<&'static Scenario>, String> {
    let patterns: Vec<&str> = list
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect();
    let mut chosen = vec![false; ALL.len()];
    if patterns.is_empty() {
        for (slot, s) in chosen.iter_mut().zip(ALL) {
            *slot = s.in_default_run();
        }
    }
    for pattern in patterns {
        let mut matched = false;
        for (slot, s) in chosen.iter_mut().zip(ALL) {
            let hit = match pattern {
                "all" => true,
                "default" => s.in_default_run(),
                _ => glob(pattern, s.name) || glob(pattern, s.family()),
            };
            let hit = hit && !(s.is_churn() && pattern.starts_with('*'));
            if hit {
                *slot = true;
                matched = true;
            }
        }
        if !matched {
            let names: Vec<&str> = ALL.iter().map(|s| s.name).collect();
            return Err(format!(
                "no scenario matches {pattern:?}; the scenarios are: {}",
                names.join(", ")
            ));
        }
    }
    if baselines {
        let wanted: Vec<bool> = ALL
            .iter()
            .zip(&chosen)
            .filter(|(s, on)| **on && s.wants_baselines())
            .map(|(s, _)| s.big)
            .collect();
        for (slot, s) in chosen.iter_mut().zip(ALL) {
            if matches!(s.target, Nginx | Passthrough) && wanted.contains(&s.big) {
                *slot = true;
            }
        }
        let brought: Vec<Target> = ALL
            .iter()
            .zip(&chosen)
            .filter(|(_, on)| **on)
            .flat_map(|(s, _)| s.ceilings().iter().copied().chain(s.reference()))
            .collect();
        for (slot, s) in chosen.iter_mut().zip(ALL) {
            if !s.big && brought.contains(&s.target) {
                *slot = true;
            }
        }
    }
    Ok(ALL
        .iter()
        .zip(chosen)
        .filter_map(|(s, on)| on.then_some(s))
        .collect())
}

/// `*` matches any run of characters; everything else matches itself.
fn glob(pattern: &str, text: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == text,
        Some((head, rest)) => match text.strip_prefix(head) {
            None => false,
            Some(tail) => (0..=tail.len())
                .filter(|&i| tail.is_char_boundary(i))
                .any(|i| glob(rest, &tail[i..])),
        },
    }
}

/// The `--help` text listing the scenarios.
pub(crate) fn listing() -> String {
    let mut out = String::from("Scenarios (in run order; * = not in the default run):\n");
    for s in ALL {
        let mark = if s.in_default_run() { ' ' } else { '*' };
        out.push_str(&format!("  {mark} {:<22} {}\n", s.name, s.about));
    }
    out
}
