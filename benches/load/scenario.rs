//! The scenario catalogue, in run order, and choosing scenarios from a comma list of globs.

use Store::{Memory, Redis};
use Target::{Direct, Fill, NewKey, Nginx, Observe, Passthrough, Replay, Storm};

/// Which store a proxy scenario runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Store {
    Memory,
    Redis,
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
    /// The memory store filled with many finished keys.
    Fill,
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
            Target::Fill => Some(Store::Memory),
            Target::Direct | Target::Nginx | Target::Passthrough => None,
        }
    }

    /// Part of a run when no scenario is named.
    pub(crate) fn in_default_run(&self) -> bool {
        self.target != Target::Fill
    }

    /// Its throughput is compared with the nginx and pass-through rows of the same body size.
    fn wants_baselines(&self) -> bool {
        matches!(
            self.target,
            Target::NewKey(_) | Target::Observe(_) | Target::Replay(_)
        )
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
    scenario("direct", Direct, false, "straight to the mock upstream"),
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
        "fill-1m",
        Fill,
        false,
        "new-key before/after filling the memory store (--fill-keys)",
    ),
];

/// The scenarios a comma list of patterns names, in run order.
///
/// A pattern is a scenario name, a name without its store (`new-key`), a glob with `*`
/// (`64k-*`, `*/redis`), `default` (everything but `fill-1m`) or `all`. With `baselines`, the
/// nginx and pass-through rows of the same body size are added to any new-key or replay
/// scenario, so its ratios can be computed.
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
