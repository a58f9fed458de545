//! The flags of the load bench; each has an environment variable too (`LOAD_*`), so
//! `LOAD_SCENARIOS=fill-1m cargo bench --bench load` works like `-- --scenarios fill-1m`.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};

use crate::scenario;

/// Load scenarios against the idemproxy binary, with nginx and pass-through baselines.
#[derive(Debug, Parser)]
#[command(name = "load", bin_name = "cargo bench --bench load --", after_help = format!(
    "{}\nREDIS_SERVER and NGINX name the binaries to use (empty or `none`: skip them); by default \
     they are looked up on PATH and in the sbin directories. PG_BIN names PostgreSQL's bin \
     directory (default: the newest /usr/lib/postgresql/*/bin; `none`: skip PostgreSQL).",
    scenario::listing()
))]
pub(crate) struct Args {
    /// Scenarios: a comma list of names, names without the store (`new-key`), globs (`64k-*`,
    /// `*/redis`), `default` or `all`. Default: every scenario but fill-1m.
    #[arg(long, env = "LOAD_SCENARIOS", value_name = "LIST")]
    pub scenarios: Option<String>,
    /// Measured time per scenario.
    #[arg(long, env = "LOAD_DURATION", default_value = "5s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Load before the measurement starts (not counted).
    #[arg(long, env = "LOAD_WARMUP", default_value = "1s", value_parser = humantime::parse_duration)]
    pub warmup: Duration,
    /// Runs of the whole selection, one after another; each row of the table is the round
    /// with the median req/s, which steadies the ratios on a noisy machine.
    #[arg(long, env = "LOAD_ROUNDS", default_value_t = 1)]
    pub rounds: usize,
    /// The upstream of every proxy and of the reference nginx: `mock` (mock-upstream, with its
    /// call ledger and `X-Mock-*` headers) or `nginx` (a second nginx answering every request
    /// with `return 200` and a fixed small JSON body: the cheapest upstream there is, so the
    /// proxy's own cost stands out; the scenarios that need the mock are skipped).
    #[arg(long, env = "LOAD_UPSTREAM", value_enum, default_value_t = UpstreamKind::Mock)]
    pub upstream: UpstreamKind,
    /// Keep-alive connections, one request in flight on each.
    #[arg(long, env = "LOAD_CONNECTIONS", default_value_t = 32)]
    pub connections: usize,
    /// `store.pool_size` of the `*/postgres` proxies: the PostgreSQL connections (backends)
    /// each opens. Default: `--connections`, what pgbench's ceiling runs with.
    #[arg(long, env = "LOAD_PG_POOL", value_name = "N")]
    pub pg_pool: Option<usize>,
    /// Hard cap on the requests of one scenario, warm-up included.
    #[arg(long, env = "LOAD_MAX_REQUESTS", default_value_t = 5_000_000)]
    pub max_requests: u64,
    /// RUST_LOG of the proxy processes.
    #[arg(
        long,
        env = "LOAD_PROXY_LOG",
        default_value = "warn",
        value_name = "FILTER"
    )]
    pub proxy_log: String,
    /// A second idemproxy binary (`target/debug/idemproxy`, what the README's `cargo run --
    /// demo` builds, or another profile's, or another commit's): each selected pass-through,
    /// new-key and replay scenario runs on it too, right after the bench's own binary, as a row
    /// `NAME @compare` with its ratios to this run's baselines.
    #[arg(long, env = "LOAD_COMPARE_BINARY", value_name = "PATH")]
    pub compare_binary: Option<PathBuf>,
    /// The `sample_ratio`s the pass-through and new-key/memory scenarios run again at with
    /// tracing on (rows `NAME trace=RATIO`); `none` runs no traced row.
    #[arg(
        long,
        env = "LOAD_TRACE_RATIOS",
        default_value = "0,0.01,1",
        value_name = "LIST"
    )]
    pub trace_ratios: String,
    /// Keep the temp directory with every config and log (also kept after a failure).
    #[arg(long, env = "LOAD_KEEP_LOGS", value_parser = clap::builder::BoolishValueParser::new())]
    pub keep_logs: bool,
    /// Do not add the nginx and pass-through baselines to a selection that lacks them, nor
    /// the ceilings to new-key/postgres and new-key/sqlite, nor new-key to webhook/*.
    #[arg(long)]
    pub no_baselines: bool,
    /// conflict-storm: keys in flight.
    #[arg(long, env = "LOAD_STORM_KEYS", default_value_t = 10)]
    pub storm_keys: usize,
    /// conflict-storm: concurrent duplicates per key (one connection each).
    #[arg(long, env = "LOAD_STORM_DUPLICATES", default_value_t = 100)]
    pub storm_duplicates: usize,
    /// conflict-storm: how long the mock holds each first request (X-Mock-Delay).
    #[arg(long, env = "LOAD_STORM_DELAY", default_value = "500ms", value_parser = humantime::parse_duration)]
    pub storm_delay: Duration,
    /// resolve/*: requests whose answer is lost (each costs one upstream timeout), then
    /// resolved.
    #[arg(long, env = "LOAD_LOST", default_value_t = 100)]
    pub lost: usize,
    /// fill-1m: finished keys to add to the memory store.
    #[arg(long, env = "LOAD_FILL_KEYS", default_value_t = 1_000_000)]
    pub fill_keys: u64,
    /// fill-1m: the most time the fill may take.
    #[arg(long, env = "LOAD_FILL_TIMEOUT", default_value = "10m", value_parser = humantime::parse_duration)]
    pub fill_timeout: Duration,
    /// churn/*: how long new keys are sent (the table's row count is sampled meanwhile).
    #[arg(long, env = "LOAD_CHURN_DURATION", default_value = "150s", value_parser = humantime::parse_duration)]
    pub churn_duration: Duration,
    /// churn/*: how often the row count is sampled.
    #[arg(long, env = "LOAD_CHURN_SAMPLE", default_value = "5s", value_parser = humantime::parse_duration)]
    pub churn_sample: Duration,
    /// List the scenarios and exit.
    #[arg(long)]
    pub list: bool,
    /// Passed by `cargo bench`; without it (`cargo test --all-targets`) nothing runs.
    #[arg(long, hide = true)]
    pub bench: bool,
    /// A scenario list given as a bare argument (`cargo bench --bench load new-key`).
    #[arg(hide = true)]
    pub filter: Option<String>,
}

/// `--upstream`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum UpstreamKind {
    Mock,
    Nginx,
}
