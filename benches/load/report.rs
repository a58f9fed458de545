//! The table printed at the end: one row per scenario, with ratios to the baselines measured in
//! the same run (nginx `proxy_pass` and the proxy's pass-through route, of the same body size).
//!
//! The `limit` column says what held a timed row back, from the cores each process taking part
//! used over the row's window (see [`crate::cores`] for the processes and the rule): `cores`
//! when together, with the rest of the machine (`other`), they used at least 90% of the cores
//! (`cores, mostly other programs'` when `other` is half of that); else `NAME saturates a core`
//! when a single-threaded process (redis-server) used at least 0.9 core; else `no core
//! saturated, latency-bound`. Each verdict is followed by the total and every process's cores,
//! biggest first.

use std::time::Duration;

use crate::client::Stats;
use crate::cores::Cores;
use crate::resolve::ResolveReport;
use crate::storm::StormReport;

pub(crate) enum Outcome {
    Timed(Stats),
    Storm(StormReport),
    /// Latencies are the times to resolve; errors, the broken invariants.
    Resolve(ResolveReport),
    Skipped(String),
}

pub(crate) struct Row {
    pub name: String,
    /// 64 KiB responses: compared with the 64 KiB baselines.
    pub big: bool,
    pub outcome: Outcome,
    pub note: String,
}

/// The table's columns.
const COLUMNS: usize = 15;
/// The `limit` column: text, aligned left like the scenario's name (numbers align right).
const LIMIT: usize = COLUMNS - 2;

const HEADERS: [&str; COLUMNS] = [
    "scenario",
    "req/s",
    "p50",
    "p99",
    "p99.9",
    "errors",
    "cpu/req",
    "req/s vs nginx",
    "p99 vs nginx",
    "cpu vs nginx",
    "req/s vs pass",
    "p99 vs pass",
    "cpu vs pass",
    "limit",
    "notes",
];

/// The table, as lines of text.
pub(crate) fn table(rows: &[Row]) -> Vec<String> {
    let mut cells: Vec<[String; COLUMNS]> = vec![HEADERS.map(str::to_owned)];
    for row in rows {
        cells.push(cells_of(row, rows));
    }
    let mut widths = [0; COLUMNS];
    for line in &cells {
        for (width, cell) in widths.iter_mut().zip(line) {
            *width = (*width).max(cell.chars().count());
        }
    }
    cells
        .iter()
        .map(|line| {
            let mut text = String::new();
            for (i, (cell, width)) in line.iter().zip(widths).enumerate() {
                let pad = " ".repeat(width - cell.chars().count());
                match i {
                    0 | LIMIT => text.push_str(&format!("{cell}{pad}")),
                    i if i == COLUMNS - 1 => text.push_str(cell),
                    _ => text.push_str(&format!("{pad}{cell}")),
                }
                text.push_str("  ");
            }
            text.trim_end().to_owned()
        })
        .collect()
}

fn cells_of(row: &Row, rows: &[Row]) -> [String; COLUMNS] {
    let dash = || "-".to_owned();
    let latency = |h: &Stats, q| h.quantile(q).map_or_else(dash, format_duration);
    match &row.outcome {
        Outcome::Timed(stats) => {
            let (nginx, pass) = baselines(rows, row.big);
            let rps_ratio = |base: Option<&Stats>| {
                base.filter(|b| b.rps() > 0.0)
                    .map_or_else(dash, |b| format!("{:.2}x", stats.rps() / b.rps()))
            };
            let p99_ratio = |base: Option<&Stats>| match (
                stats.quantile(0.99),
                base.and_then(|b| b.quantile(0.99)),
            ) {
                (Some(p99), Some(base)) if !base.is_zero() => {
                    format!("{:.2}x", p99.as_secs_f64() / base.as_secs_f64())
                }
                _ => dash(),
            };
            let cpu_ratio = |base: Option<&Stats>| match (
                stats.cpu_per_request,
                base.and_then(|b| b.cpu_per_request),
            ) {
                (Some(cpu), Some(base)) if !base.is_zero() => {
                    format!("{:.2}x", cpu.as_secs_f64() / base.as_secs_f64())
                }
                _ => dash(),
            };
            [
                row.name.clone(),
                format!("{:.0}", stats.rps()),
                latency(stats, 0.5),
                latency(stats, 0.99),
                latency(stats, 0.999),
                stats.errors.to_string(),
                stats.cpu_per_request.map_or_else(dash, format_duration),
                rps_ratio(nginx),
                p99_ratio(nginx),
                cpu_ratio(nginx),
                rps_ratio(pass),
                p99_ratio(pass),
                cpu_ratio(pass),
                stats.cores.as_ref().map_or_else(dash, Cores::limit),
                row.note.clone(),
            ]
        }
        Outcome::Storm(storm) => {
            let h = &storm.histogram;
            let q = |q| (!h.is_empty()).then(|| Duration::from_micros(h.value_at_quantile(q)));
            let fmt = |d: Option<Duration>| d.map_or_else(dash, format_duration);
            [
                row.name.clone(),
                dash(),
                fmt(q(0.5)),
                fmt(q(0.99)),
                fmt(q(0.999)),
                storm.other.values().sum::<u64>().to_string(),
                dash(),
                dash(),
                dash(),
                dash(),
                dash(),
                dash(),
                dash(),
                dash(),
                storm.summary(),
            ]
        }
        Outcome::Resolve(resolve) => {
            let h = &resolve.histogram;
            let q = |q| match h.is_empty() {
                true => dash(),
                false => format_duration(Duration::from_micros(h.value_at_quantile(q))),
            };
            let mut cells = [(); COLUMNS].map(|()| dash());
            cells[0] = row.name.clone();
            cells[2] = q(0.5);
            cells[3] = q(0.99);
            cells[4] = q(0.999);
            cells[5] = resolve.failures.len().to_string();
            cells[COLUMNS - 1] = resolve.summary();
            cells
        }
        Outcome::Skipped(reason) => {
            let mut cells = [(); COLUMNS].map(|()| dash());
            cells[0] = row.name.clone();
            cells[COLUMNS - 1] = format!("skipped: {reason}");
            cells
        }
    }
}

/// One row per scenario, in first-run order, out of the rows of several rounds: the timed run
/// with the median req/s (the lower middle of an even count), else the last row (a storm or
/// a skip; a failed storm is already reported by then).
pub(crate) fn median_rows(rows: Vec<Row>) -> Vec<Row> {
    let mut groups: Vec<Vec<Row>> = Vec::new();
    for row in rows {
        match groups.iter_mut().find(|g| g[0].name == row.name) {
            Some(group) => group.push(row),
            None => groups.push(vec![row]),
        }
    }
    groups
        .into_iter()
        .filter_map(|mut group| {
            let rounds = group.len();
            let rps = |r: &Row| match &r.outcome {
                Outcome::Timed(stats) => Some(stats.rps()),
                _ => None,
            };
            if group.iter().all(|r| rps(r).is_some()) {
                group.sort_by(|a, b| {
                    rps(a)
                        .partial_cmp(&rps(b))
                        .unwrap_or(std::cmp::Ordering::Equal)
                });
                let mut row = group.swap_remove((rounds - 1) / 2);
                if rounds > 1 {
                    row.note.push_str(&format!("; median of {rounds} rounds"));
                }
                Some(row)
            } else {
                group.pop()
            }
        })
        .collect()
}

/// A row's name, and its req/s over nginx's and over the pass-through's.
type RowRatios = (String, Option<f64>, Option<f64>);

/// One round's ratios: each timed row's req/s over those of its baselines in the same round.
pub(crate) struct RoundRatios(Vec<RowRatios>);

impl RoundRatios {
    /// From the rows of one round.
    pub(crate) fn of(rows: &[Row]) -> RoundRatios {
        RoundRatios(
            rows.iter()
                .filter_map(|row| match &row.outcome {
                    Outcome::Timed(stats) => {
                        let (nginx, pass) = baselines(rows, row.big);
                        let ratio = |base: Option<&Stats>| {
                            base.filter(|b| b.rps() > 0.0)
                                .map(|b| stats.rps() / b.rps())
                        };
                        Some((row.name.clone(), ratio(nginx), ratio(pass)))
                    }
                    _ => None,
                })
                .collect(),
        )
    }
}

/// Lines under the table of a run of several rounds: each row's ratios to nginx and to the
/// pass-through round by round, and their median. Rows' medians are taken one by one, so
/// the table's ratios may pair rounds; these never do.
pub(crate) fn round_ratio_lines(rounds: &[RoundRatios]) -> Vec<String> {
    let mut names: Vec<&str> = Vec::new();
    for round in rounds {
        for (name, ..) in &round.0 {
            if !names.contains(&name.as_str()) {
                names.push(name);
            }
        }
    }
    let width = names.iter().map(|n| n.chars().count()).max().unwrap_or(0);
    let series = |name: &str, pick: fn(&RowRatios) -> Option<f64>| {
        let mut values: Vec<f64> = rounds
            .iter()
            .filter_map(|r| r.0.iter().find(|e| e.0 == name).and_then(pick))
            .collect();
        if values.is_empty() {
            return None;
        }
        let shown: Vec<String> = values.iter().map(|v| format!("{v:.2}")).collect();
        values.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
        Some(format!(
            "{} (median {:.2})",
            shown.join(" "),
            values[(values.len() - 1) / 2]
        ))
    };
    let mut lines = vec!["Req/s ratios within each round, in round order:".to_owned()];
    for name in names {
        let nginx = series(name, |e| e.1);
        let pass = series(name, |e| e.2);
        if nginx.is_none() && pass.is_none() {
            continue;
        }
        let mut line = format!("  {name:width$}");
        if let Some(nginx) = nginx {
            line.push_str(&format!("  vs nginx {nginx}"));
        }
        if let Some(pass) = pass {
            line.push_str(&format!("  vs pass {pass}"));
        }
        lines.push(line);
    }
    lines
}

/// The nginx and pass-through rows of the same body size, if they ran.
fn baselines(rows: &[Row], big: bool) -> (Option<&Stats>, Option<&Stats>) {
    let find = |name: &str| {
        rows.iter().find_map(|r| match &r.outcome {
            Outcome::Timed(stats) if r.name == name => Some(stats),
            _ => None,
        })
    };
    if big {
        (find("64k-nginx"), find("64k-passthrough"))
    } else {
        (find("nginx"), find("passthrough"))
    }
}

/// `412µs`, `3.25ms`, `1.20s`.
pub(crate) fn format_duration(d: Duration) -> String {
    let micros = d.as_micros();
    if micros < 1000 {
        format!("{micros}µs")
    } else if micros < 1_000_000 {
        format!("{:.2}ms", d.as_secs_f64() * 1e3)
    } else {
        format!("{:.2}s", d.as_secs_f64())
    }
}

/// A row whose req/s is read over another's of the same run.
pub(crate) struct Pair {
    row: &'static str,
    over: &'static str,
    /// How the row's note names the other.
    named: &'static str,
    /// The least ratio the product aims for, when it has one.
    target: Option<f64>,
}

/// The ratios shown in the notes and under the table: new keys and replays against the
/// ceilings of their stores (the database alone, doing the proxy's statements; the targets of
/// BENCHMARKS.md), the claim on a finished key against a primary-key read, and webhooks against new keys on
/// the same store (a signature check and an event id in place of a key header: the aim is to
/// keep at least 0.9 of new keys' throughput).
const PAIRS: &[Pair] = &[
    Pair {
        row: "new-key/postgres",
        over: "pgbench-shared/postgres",
        named: "the pgbench ceiling beside the same load",
        target: Some(0.9),
    },
    Pair {
        row: "new-key/postgres",
        over: "pgbench/postgres",
        named: "the pgbench ceiling alone",
        target: None,
    },
    Pair {
        row: "new-key/sqlite",
        over: "ceiling-shared/sqlite",
        named: "the SQLite writer's ceiling beside the same load",
        target: Some(0.8),
    },
    Pair {
        row: "new-key/sqlite",
        over: "ceiling/sqlite",
        named: "the SQLite writer's ceiling alone",
        target: None,
    },
    Pair {
        row: "replay/postgres",
        over: "pgbench-read-shared/postgres",
        named: "the pgbench read ceiling beside the same load",
        target: Some(0.8),
    },
    Pair {
        row: "replay/postgres",
        over: "pgbench-read/postgres",
        named: "the pgbench read ceiling alone",
        target: None,
    },
    Pair {
        row: "pgbench-repeat/postgres",
        over: "pgbench-read/postgres",
        named: "a primary-key read",
        target: None,
    },
    Pair {
        row: "webhook/memory",
        over: "new-key/memory",
        named: "new-key/memory",
        target: Some(0.9),
    },
    Pair {
        row: "webhook/postgres",
        over: "new-key/postgres",
        named: "new-key/postgres",
        target: Some(0.9),
    },
    Pair {
        row: "jsonrpc-new/memory",
        over: "new-key/memory",
        named: "new-key/memory",
        target: Some(0.85),
    },
    Pair {
        row: "grpc-pass/memory",
        over: "grpc-direct",
        named: "grpc-direct",
        target: Some(0.8),
    },
    Pair {
        row: "grpc-new/memory",
        over: "grpc-pass/memory",
        named: "grpc-pass/memory",
        target: Some(0.8),
    },
    Pair {
        row: "grpc-replay/memory",
        over: "grpc-pass/memory",
        named: "grpc-pass/memory",
        target: None,
    },
    Pair {
        row: "jsonrpc-replay/memory",
        over: "replay/memory",
        named: "replay/memory",
        target: Some(0.85),
    },
];

/// Each pair's ratio among `rows` (one round's), for the pairs whose two rows both ran.
pub(crate) fn pair_ratios(rows: &[Row]) -> Vec<(&'static Pair, f64)> {
    let rps = |name: &str| {
        rows.iter().find_map(|r| match &r.outcome {
            Outcome::Timed(stats) if r.name == name && stats.rps() > 0.0 => Some(stats.rps()),
            _ => None,
        })
    };
    PAIRS
        .iter()
        .filter_map(|pair| Some((pair, rps(pair.row)? / rps(pair.over)?)))
        .collect()
}

/// Adds each pair's ratio to its row's notes: `0.93x new-key/memory (target >= 0.90)`.
pub(crate) fn note_pairs(rows: &mut [Row]) {
    for (pair, ratio) in pair_ratios(rows) {
        if let Some(row) = rows.iter_mut().find(|r| r.name == pair.row) {
            row.note.push_str(&format!("; {ratio:.2}x {}", pair.named));
            if let Some(target) = pair.target {
                row.note.push_str(&format!(" (target >= {target:.2})"));
            }
        }
    }
}

/// Lines under the table: each pair's ratio, round by round.
pub(crate) fn pair_lines(rounds: &[Vec<(&'static Pair, f64)>]) -> Vec<String> {
    PAIRS
        .iter()
        .filter_map(|pair| {
            let shown: Vec<String> = rounds
                .iter()
                .flatten()
                .filter(|(p, _)| std::ptr::eq(*p, pair))
                .map(|(_, ratio)| format!("{ratio:.2}"))
                .collect();
            let target = pair
                .target
                .map_or(String::new(), |t| format!(" (target >= {t:.2})"));
            (!shown.is_empty()).then(|| {
                format!(
                    "{} req/s over {}, in round order: {}{target}",
                    pair.row,
                    pair.named,
                    shown.join(" ")
                )
            })
        })
        .collect()
}
