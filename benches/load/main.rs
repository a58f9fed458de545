//! `cargo bench --bench load`: the proxy under load, as separate processes, next to baselines
//! measured in the same run.
//!
//! It starts `mock-upstream` and `idemproxy` as cargo built them for it (the `bench` profile:
//! whole-program LTO and one codegen unit, like the image's `release` build; one proxy process per
//! scenario, its config in a temp file), a `redis-server` of its own for the Redis scenarios, a
//! PostgreSQL server of its own for the PostgreSQL ones (an SQLite scenario gets a fresh file in
//! the temp dir) and nginx `proxy_pass` as the reference proxy (each skipped, with a message,
//! when not installed), all on 127.0.0.1. `--upstream nginx` puts a second nginx, answering a
//! fixed small JSON body, in the mock's place (see `upstream`). The load generator runs here: a
//! fixed number of keep-alive connections for a fixed time after a warm-up, latencies into HDR
//! histograms. It prints progress lines, then one table with each scenario's throughput,
//! latency quantiles, errors, the CPU time the server under test spent per request, and its
//! ratios to nginx and to the pass-through route: this machine is shared and noisy, the ratios
//! are what to read (`--rounds N` repeats the whole selection and keeps medians).
//! `--compare-binary PATH` runs the pass-through and new-key scenarios on another build of the
//! proxy too (rows `NAME @compare`): what a build profile costs at run time.
//!
//! Each timed row also says what held it back (the `limit` column, see `cores`): the cores the
//! server, the upstream, the load generator and the database each used over the row's window
//! (CPU seconds over wall seconds), and the rest of the machine's (`other`). `cores` when all
//! together used at least 90% of the cores (`cores, mostly other programs'` when `other` is
//! half of that); else `NAME saturates a core` when a single-threaded process (redis-server)
//! used at least 0.9 core; else `no core saturated, latency-bound`. See BENCHMARKS.md, or run
//! `cargo bench --bench load -- --help`.
//!
//! # Layout
//! - `args`: the flags and their environment variables.
//! - `scenario`: the catalogue, in run order, and choosing from a comma list of globs.
//! - `procs`: the child processes (killed on drop) and their config files.
//! - `upstream`: what every proxy forwards to, the mock or a fixed-answer nginx.
//! - `client`: the load generator and one-shot requests.
//! - `cores`: the cores each process of a row used, and what limited the row.
//! - `storm`: the conflict storm and its invariants.
//! - `fill`: filling the memory store with many keys, RSS before and after.
//! - `pg`: the run's PostgreSQL server.
//! - `pgbench`: the ceiling of `new-key/postgres`, pgbench with the proxy's own statements.
//! - `sqlite_ceiling`: the ceiling of `new-key/sqlite`, the proxy's SQLite writer alone.
//! - `webhook`: Standard Webhooks deliveries, signed, for the `webhook/*` rows.
//! - `resolve`: responses lost after the upstream acted, and their resolution.
//! - `churn`: the durable stores' tables under minutes of short-lived keys.
//! - `report`: the final table.

mod args;
mod churn;
mod client;
mod cores;
mod fill;
mod pg;
mod pgbench;
mod procs;
mod report;
mod resolve;
mod scenario;
mod sqlite_ceiling;
mod storm;
mod upstream;
mod webhook;

use std::cell::{Cell, RefCell};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use clap::Parser;
use http::{HeaderName, HeaderValue, StatusCode};
use tokio::runtime::Runtime;

use args::Args;
use client::{Expect, Key, LoadPlan, RequestSpec};
use cores::Part;
use pg::Postgres;
use procs::{
    CpuMeter, GRPC_PATH, IDEMPOTENT_PATH, JSONRPC_PATH, Nginx, NginxSite, OBSERVED_PATH,
    PASSTHROUGH_PATH, Proxy, Redis, Routes, StoreConfig, WEBHOOK_PATH,
};
use report::{Outcome, Row};
use scenario::{Beside, Scenario, Store, Target};
use upstream::Upstream;

/// The request body of every scenario: 31 bytes of JSON.
const BODY: &[u8] = br#"{"from":"DEL","to":"BOM","p":2}"#;
/// The response size of the `64k-*` scenarios (`X-Mock-Body-Size`).
const BIG_BODY: usize = 64 * 1024;
/// `store.max_entries` of the memory-store proxies (the default), far above what a run adds.
const MAX_ENTRIES: u64 = 1_000_000;

fn main() -> ExitCode {
    // `cargo test --all-targets` runs this debug build without `--bench`: do nothing.
    if !std::env::args().any(|a| a == "--bench") {
        return ExitCode::SUCCESS;
    }
    let args = Args::parse();
    if args.list {
        print!("{}", scenario::listing());
        return ExitCode::SUCCESS;
    }
    match run(args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("\nload bench: FAIL (see the lines marked FAIL above)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("load bench: error: {e}");
            ExitCode::from(2)
        }
    }
}

/// The mark of a row measured on `--compare-binary`.
const COMPARE: &str = "@compare";

/// What one scenario produced.
#[derive(Default)]
struct Done {
    rows: Vec<Row>,
    /// Printed under the table.
    summary: Vec<String>,
    failed: bool,
}

impl Done {
    fn row(s: &Scenario, outcome: Outcome, note: String) -> Done {
        Done {
            rows: vec![Row {
                name: s.name.to_owned(),
                big: s.big,
                outcome,
                note,
            }],
            ..Done::default()
        }
    }

    fn skipped(s: &Scenario, reason: &str) -> Done {
        println!("  skipped: {reason}");
        Done::row(s, Outcome::Skipped(reason.to_owned()), String::new())
    }
}

/// The server a timed run loads: a proxy of this run (checked afterwards), or another process.
enum Server<'a> {
    Proxy(&'a mut Proxy),
    Other(Part),
}

/// One run's world. Children are dropped (killed) before the directory their logs are in.
struct Bench {
    args: Args,
    rt: Runtime,
    /// Makes this run's keys unlike any other run's.
    nonce: u64,
    /// Key spaces handed out so far (each load run gets its own).
    key_spaces: Cell<u32>,
    /// The proxy binary the next proxies start from: this build's, or `--compare-binary`'s
    /// while a scenario runs again on it.
    proxy_bin: RefCell<PathBuf>,
    /// The `tracing:` section the next proxies start with: none, but while a scenario runs
    /// again traced ([`Bench::traced`]).
    tracing: RefCell<Option<String>>,
    /// The OTLP receiver the traced rows export to.
    collector: harness::otlp::OtlpReceiver,
    nginx: Option<Nginx>,
    redis: Option<Redis>,
    postgres: Option<Postgres>,
    upstream: Upstream,
    dir: tempfile::TempDir,
}

fn run(args: Args) -> Result<bool, String> {
    let list = args.scenarios.clone().or(args.filter.clone());
    let selected = scenario::select(list.as_deref().unwrap_or(""), !args.no_baselines)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "load bench: {} scenario(s), {cores} cores, upstream {}; per scenario {:?} warm-up + {:?} \
         measured over {} connections; proxy processes run with RUST_LOG={} (--proxy-log)",
        selected.len(),
        Upstream::describe(args.upstream),
        args.warmup,
        args.duration,
        args.connections,
        args.proxy_log
    );
    if let Some(other) = &args.compare_binary {
        if !other.is_file() {
            return Err(format!(
                "--compare-binary {}: no such file (build it first, e.g. `cargo build`)",
                other.display()
            ));
        }
        println!(
            "compare binary: {} (rows `NAME {COMPARE}` for the pass-through, new-key and replay scenarios)",
            other.display()
        );
    }
    let dir = tempfile::Builder::new()
        .prefix("idemproxy-load.")
        .tempdir()
        .map_err(|e| format!("temp dir: {e}"))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("tokio runtime: {e}"))?;
    let (dir_path, keep_logs) = (dir.path().to_owned(), args.keep_logs);
    rt.spawn(async move {
        interrupted().await;
        eprintln!("\nload bench: interrupted; stopping the child processes");
        procs::kill_all();
        if keep_logs {
            eprintln!("Configs and logs kept in {}", dir_path.display());
        } else {
            let _ = std::fs::remove_dir_all(&dir_path);
        }
        std::process::exit(130);
    });
    let upstream = Upstream::start(args.upstream, dir.path())?;
    let redis = match selected.iter().any(|s| s.store() == Some(Store::Redis)) {
        false => None,
        true => match procs::find_binary("redis-server", "REDIS_SERVER") {
            Some(bin) => {
                let redis = Redis::start(&bin, dir.path())?;
                println!("redis-server on {}", redis.url());
                Some(redis)
            }
            None => {
                println!(
                    "redis-server is not installed (apt-get install redis-server): the Redis \
                     scenarios are skipped"
                );
                None
            }
        },
    };
    let postgres = match selected.iter().any(|s| s.store() == Some(Store::Postgres)) {
        false => None,
        true => match pg::find_bin_dir() {
            Some(_) => {
                let postgres = Postgres::start(dir.path())?;
                println!(
                    "postgres on {} (fsync on, synchronous_commit on)",
                    postgres.url()
                );
                Some(postgres)
            }
            None => {
                println!(
                    "PostgreSQL is not installed (apt-get install postgresql): the PostgreSQL \
                     scenarios are skipped"
                );
                None
            }
        },
    };
    let nginx = match selected.iter().any(|s| s.target == Target::Nginx) {
        false => None,
        true => match procs::find_binary("nginx", "NGINX") {
            Some(bin) => {
                let site = NginxSite::Proxy(upstream.addr());
                let nginx = Nginx::start(&bin, dir.path(), "nginx", site)?;
                println!("nginx proxy_pass on http://{}", nginx.addr);
                Some(nginx)
            }
            None => {
                println!(
                    "nginx is not installed (apt-get install nginx-light): its rows are skipped \
                     and the pass-through route is the only baseline"
                );
                None
            }
        },
    };
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    // Served on the run's runtime, whose workers run it while the load runs.
    let collector = rt.block_on(harness::otlp::OtlpReceiver::counting());
    let bench = Bench {
        args,
        rt,
        nonce,
        key_spaces: Cell::new(0),
        proxy_bin: RefCell::new(PathBuf::from(env!("CARGO_BIN_EXE_idemproxy"))),
        tracing: RefCell::new(None),
        collector,
        nginx,
        redis,
        postgres,
        upstream,
        dir,
    };

    let mut all = Done::default();
    let rounds = bench.args.rounds.max(1);
    let mut ratios = Vec::new();
    let mut pairs = Vec::new();
    for round in 1..=rounds {
        if rounds > 1 {
            println!("round {round}/{rounds}");
        }
        let first_row = all.rows.len();
        for (i, s) in selected.iter().enumerate() {
            println!("[{}/{}] {}: {}", i + 1, selected.len(), s.name, s.about);
            // The row and its variants (on the other binary, traced): in every other round the
            // other way round, so that no variant always runs first or last — the machine's
            // drift over a scenario's rows (its caches, the host's neighbours) falls on each
            // variant alike, and a ratio between them says what the variant costs.
            let mut variants = vec![Variant::Plain];
            variants.extend(bench.compared(s).map(Variant::Compared));
            variants.extend(bench.traced(s).into_iter().map(Variant::Traced));
            if round % 2 == 0 {
                variants.reverse();
            }
            for variant in variants {
                let (suffix, done) = match variant {
                    Variant::Plain => (String::new(), bench.scenario_or_failure(s)),
                    Variant::Compared(other) => {
                        println!(
                            "[{}/{}] {} {COMPARE}: the same on {}",
                            i + 1,
                            selected.len(),
                            s.name,
                            other.display()
                        );
                        let own = bench.proxy_bin.replace(other);
                        let done = bench.scenario_or_failure(s);
                        bench.proxy_bin.replace(own);
                        (format!(" {COMPARE}"), done)
                    }
                    Variant::Traced(ratio) => {
                        println!("[{}/{}] {} trace={ratio}", i + 1, selected.len(), s.name);
                        bench.tracing.replace(Some(format!(
                            "tracing: {{otlp_endpoint: {}, sample_ratio: {ratio}}}\n",
                            bench.collector.endpoint()
                        )));
                        let done = bench.scenario_or_failure(s);
                        bench.tracing.replace(None);
                        (format!(" trace={ratio}"), done)
                    }
                };
                for mut row in done.rows {
                    row.name.push_str(&suffix);
                    all.rows.push(row);
                }
                all.summary.extend(done.summary);
                all.failed |= done.failed;
            }
        }
        ratios.push(report::RoundRatios::of(&all.rows[first_row..]));
        pairs.push(report::pair_ratios(&all.rows[first_row..]));
    }
    all.rows = report::median_rows(all.rows);
    report::note_pairs(&mut all.rows);
    if rounds > 1 {
        all.summary.extend(report::round_ratio_lines(&ratios));
    }
    all.summary.extend(report::pair_lines(&pairs));

    println!();
    for line in report::table(&all.rows) {
        println!("{line}");
    }
    println!();
    for line in &all.summary {
        println!("{line}");
    }
    let nginx_note = if bench.nginx.is_some() || !selected.iter().any(|s| s.target == Target::Nginx)
    {
        ""
    } else {
        " nginx was not installed: the pass-through route is the baseline."
    };
    println!(
        "Ratios: req/s and p99 of a row over those of nginx proxy_pass and of the proxy's \
         pass-through route with the same response size, measured in this run.{nginx_note}"
    );
    println!(
        "Latency: per request, closed loop ({} connections, one request in flight on each); \
         errors: answers other than the expected ones (notes), in the measured window.",
        bench.args.connections
    );
    println!(
        "Limit: the cores each process used over the row's load run (CPU s / wall s, warm-up \
         included; other = the rest of the machine): `cores` when all together used >= {:.0}% \
         of the {cores} cores (`mostly other programs'` when other is half of that), else `NAME \
         saturates a core` when a single-threaded process (redis-server) used >= {} core, else \
         latency-bound.",
        cores::BUSY * 100.0,
        cores::BUSY
    );
    if bench.upstream.mock().is_none() {
        println!(
            "Upstream: nginx return 200 with a fixed body; the scenarios that need the mock are \
             skipped, and replay checks the first answer only (no upstream call count)."
        );
    }
    bench.finish(all.failed);
    Ok(!all.failed)
}

/// One run of a scenario: as it is, on the `--compare-binary` binary, or with tracing on at a
/// `sample_ratio`.
enum Variant<'a> {
    Plain,
    Compared(PathBuf),
    Traced(&'a str),
}

impl Bench {
    /// `--compare-binary`, when `s` is a scenario to run on it too: the pass-through route and
    /// new keys, on every store and body size.
    fn compared(&self, s: &Scenario) -> Option<PathBuf> {
        let other = self.args.compare_binary.clone()?;
        matches!(
            s.target,
            Target::Passthrough | Target::NewKey(_) | Target::Replay(_)
        )
        .then_some(other)
    }

    /// The `sample_ratio`s `s` runs again at with tracing on (rows `NAME trace=RATIO`,
    /// `--trace-ratios`): the pass-through route and new keys on memory, against the same rows
    /// untraced.
    fn traced(&self, s: &Scenario) -> Vec<&str> {
        let ratios = self.args.trace_ratios.as_str();
        match s.target {
            Target::Passthrough | Target::NewKey(Store::Memory) if !s.big && ratios != "none" => {
                ratios.split(',').map(str::trim).collect()
            }
            _ => Vec::new(),
        }
    }

    /// [`Bench::scenario`], an error made a failed row of its own.
    fn scenario_or_failure(&self, s: &Scenario) -> Done {
        self.scenario(s).unwrap_or_else(|e| {
            println!("  FAIL: {e}");
            let reason = e.lines().next().unwrap_or_default();
            let mut done = Done::row(
                s,
                Outcome::Skipped(format!("error: {reason}")),
                String::new(),
            );
            done.failed = true;
            done
        })
    }

    fn scenario(&self, s: &Scenario) -> Result<Done, String> {
        if let Some(reason) = self.upstream.lacks(s) {
            return Ok(Done::skipped(s, reason));
        }
        // Zeroed counters: each scenario's checks read only its own calls, and the mock's
        // per-key map stays small.
        if let Some(mock) = self.upstream.mock() {
            self.rt.block_on(storm::reset_mock(mock.addr))?;
        }
        let done = self.run_scenario(s);
        // Each scenario starts from an empty store; the 64 KiB ones leave gigabytes behind.
        self.clean_durable()?;
        done
    }

    fn run_scenario(&self, s: &Scenario) -> Result<Done, String> {
        match s.target {
            Target::Direct => {
                let server = Server::Other(self.upstream.part());
                self.timed(s, self.upstream.addr(), PASSTHROUGH_PATH, Key::None, server)
            }
            Target::Nginx => match &self.nginx {
                Some(nginx) => {
                    let server = Server::Other(Part::process("nginx", nginx.pid()));
                    self.timed(s, nginx.addr, PASSTHROUGH_PATH, Key::None, server)
                }
                None => Ok(Done::skipped(s, "nginx is not installed")),
            },
            Target::Passthrough => {
                let config = StoreConfig::Memory {
                    max_entries: MAX_ENTRIES,
                };
                let mut proxy = self.start_proxy(s.name, &config)?;
                self.timed(
                    s,
                    proxy.addr,
                    PASSTHROUGH_PATH,
                    Key::None,
                    Server::Proxy(&mut proxy),
                )
            }
            Target::NewKey(store) => {
                let Some(mut proxy) = self.proxy(s, store)? else {
                    return Ok(Done::skipped(s, store.missing()));
                };
                let key = self.new_keys();
                self.timed(
                    s,
                    proxy.addr,
                    IDEMPOTENT_PATH,
                    key,
                    Server::Proxy(&mut proxy),
                )
            }
            Target::Observe(store) => {
                let Some(mut proxy) = self.proxy(s, store)? else {
                    return Ok(Done::skipped(s, store.missing()));
                };
                let key = self.new_keys();
                self.timed(s, proxy.addr, OBSERVED_PATH, key, Server::Proxy(&mut proxy))
            }
            Target::Replay(store) => {
                let Some(mut proxy) = self.proxy(s, store)? else {
                    return Ok(Done::skipped(s, store.missing()));
                };
                self.replay(s, &mut proxy)
            }
            Target::Storm(store) => {
                let Some(mut proxy) = self.proxy(s, store)? else {
                    return Ok(Done::skipped(s, store.missing()));
                };
                self.storm(s, &mut proxy)
            }
            Target::Ceiling(script, beside) => match &self.postgres {
                Some(pg) => self.beside(beside, || self.ceiling(s, pg, script)),
                None => Ok(Done::skipped(s, Store::Postgres.missing())),
            },
            Target::SqliteCeiling(beside) => self.beside(beside, || self.sqlite_ceiling(s)),
            Target::Webhook(store) => self.webhook(s, store),
            Target::JsonRpcNew(store) => self.jsonrpc(s, store, false),
            Target::JsonRpcReplay(store) => self.jsonrpc(s, store, true),
            Target::GrpcDirect => {
                let server = Server::Other(self.upstream.part());
                let key = grpc_key("", false);
                self.timed(s, self.upstream.addr(), GRPC_PATH, key, server)
            }
            Target::GrpcPass => self.grpc(s, Store::Memory, None),
            Target::GrpcNew(store) => self.grpc(s, store, Some(false)),
            Target::GrpcReplay(store) => self.grpc(s, store, Some(true)),
            Target::Resolve(store) => self.resolve(s, store),
            Target::Churn(store) => self.churn(s, store),
            Target::Fill => self.fill(s),
        }
    }

    /// The SQLite file a scenario's proxy opens (fresh: removed after every scenario).
    fn sqlite_path(&self, label: &str) -> std::path::PathBuf {
        self.dir
            .path()
            .join(format!("sqlite-{}.db", label.replace('/', "-")))
    }

    /// Removes the SQLite files and the PostgreSQL schemas of the scenario that just ran.
    fn clean_durable(&self) -> Result<(), String> {
        let entries = std::fs::read_dir(self.dir.path())
            .map_err(|e| format!("read {}: {e}", self.dir.path().display()))?;
        for entry in entries.flatten() {
            if entry.file_name().to_string_lossy().starts_with("sqlite-") {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        match &self.postgres {
            Some(pg) => pg.drop_schemas(),
            None => Ok(()),
        }
    }

    /// The durable store configs; `None` when PostgreSQL is wanted but not installed.
    fn durable_config(
        &self,
        label: &str,
        store: Store,
        sweep_interval: Option<&'static str>,
    ) -> Option<StoreConfig> {
        match store {
            Store::Sqlite | Store::SqliteFull => Some(StoreConfig::Sqlite {
                path: self.sqlite_path(label),
                sync: if store == Store::SqliteFull {
                    "full"
                } else {
                    "normal"
                },
                sweep_interval,
            }),
            Store::Postgres => self.postgres.as_ref().map(|pg| StoreConfig::Postgres {
                url: pg.url(),
                schema: pg.fresh_schema(),
                // By default as many connections as the load has: what pgbench's ceiling runs
                // with; `--pg-pool` to measure another count.
                pool_size: self.args.pg_pool.unwrap_or(self.args.connections),
                sweep_interval,
            }),
            Store::Memory | Store::Redis => None,
        }
    }

    /// A fresh proxy process on `store` (Redis emptied first, a new SQLite file or PostgreSQL
    /// schema); `None` when Redis or PostgreSQL is wanted but not installed.
    fn proxy(&self, s: &Scenario, store: Store) -> Result<Option<Proxy>, String> {
        match self.store_config(s, store)? {
            Some(config) => self.start_proxy(s.name, &config).map(Some),
            None => Ok(None),
        }
    }

    /// The store of a fresh proxy on `store` (Redis emptied first, a new SQLite file or
    /// PostgreSQL schema); `None` when Redis or PostgreSQL is wanted but not installed.
    fn store_config(&self, s: &Scenario, store: Store) -> Result<Option<StoreConfig>, String> {
        let config = match (store, &self.redis) {
            (Store::Memory, _) => StoreConfig::Memory {
                max_entries: MAX_ENTRIES,
            },
            (Store::Redis, None) => return Ok(None),
            (Store::Redis, Some(redis)) => {
                redis.flush()?;
                StoreConfig::Redis { url: redis.url() }
            }
            (Store::Sqlite | Store::SqliteFull | Store::Postgres, _) => {
                match self.durable_config(s.name, store, None) {
                    Some(config) => config,
                    None => return Ok(None),
                }
            }
        };
        Ok(Some(config))
    }

    fn start_proxy(&self, label: &str, config: &StoreConfig) -> Result<Proxy, String> {
        self.start_proxy_ttl(label, config, "24h")
    }

    fn start_proxy_ttl(
        &self,
        label: &str,
        config: &StoreConfig,
        ttl: &str,
    ) -> Result<Proxy, String> {
        self.start_proxy_with(label, config, &Routes::plain(ttl))
    }

    /// A proxy with the routes a scenario adds (a webhook route, a resolve route).
    fn start_proxy_with(
        &self,
        label: &str,
        config: &StoreConfig,
        routes: &Routes<'_>,
    ) -> Result<Proxy, String> {
        let bin = self.proxy_bin.borrow().clone();
        let tracing = self.tracing.borrow().clone();
        let routes = &Routes {
            tracing: tracing.as_deref(),
            ..*routes
        };
        Proxy::start(
            &bin,
            self.dir.path(),
            label,
            config,
            self.upstream.addr(),
            routes,
            &self.args.proxy_log,
        )
    }

    /// The mock's address; only the scenarios [`Upstream::lacks`] lets through on another
    /// upstream get here without it.
    fn mock_addr(&self) -> Result<SocketAddr, String> {
        self.upstream
            .mock()
            .map(|mock| mock.addr)
            .ok_or_else(|| "this scenario needs the mock upstream".to_owned())
    }

    /// The database server working for the proxy on the same cores, for the notes and the
    /// `limit` column.
    fn database(&self, store: Option<Store>) -> Option<Part> {
        match (store, &self.redis, &self.postgres) {
            // One thread runs every Redis command.
            (Some(Store::Redis), Some(redis), _) => Some(Part {
                single_threaded: true,
                ..Part::process("redis-server", redis.pid())
            }),
            (Some(Store::Postgres), _, Some(pg)) => Some(Part::process("postgres", pg.pid())),
            _ => None,
        }
    }

    /// The processes a load run of `s` keeps busy: the server under test, the upstream (unless
    /// it is the server: `direct`), the load generator and the store's database.
    fn parts(&self, s: &Scenario, server: Part) -> Vec<Part> {
        let mut parts = vec![server];
        if s.target != Target::Direct {
            parts.push(self.upstream.part());
        }
        parts.push(Part::client());
        parts.extend(self.database(s.store()));
        parts
    }

    /// A new key on every request, from a key space no other load run of this run uses:
    /// 36-character keys, `NONCE-SPACE-TICKET` in hex.
    fn new_keys(&self) -> Key {
        let space = self.key_spaces.get();
        self.key_spaces.set(space + 1);
        Key::Unique {
            prefix: format!("{:016x}-{space:06x}-", self.nonce).into(),
        }
    }

    fn spec(&self, addr: SocketAddr, path: &'static str, key: Key, big: bool) -> RequestSpec {
        let mut headers = Vec::new();
        if big {
            headers.push((
                HeaderName::from_static("x-mock-body-size"),
                HeaderValue::from(BIG_BODY),
            ));
        }
        RequestSpec {
            path,
            host: HeaderValue::try_from(addr.to_string()).expect("an address is a header value"),
            headers,
            body: match key {
                // One framed `TransferRequest`, the mock ledger's.
                Key::Grpc { .. } => idemproxy_mock::transfer_request("r-bench", 2400),
                _ => Bytes::from_static(BODY),
            },
            key,
        }
    }

    fn expect(&self, s: &Scenario, replayed: bool) -> Expect {
        Expect {
            status: StatusCode::OK,
            replayed,
            body_len: s.big.then_some(BIG_BODY),
        }
    }

    fn plan(&self, addr: SocketAddr, spec: RequestSpec, expect: Expect) -> LoadPlan {
        LoadPlan {
            addr,
            spec,
            expect,
            connections: self.args.connections,
            warmup: self.args.warmup,
            duration: self.args.duration,
            max_requests: self.args.max_requests,
        }
    }

    /// A timed closed-loop run against `server`, whose CPU time per request is measured; a
    /// proxy is checked afterwards (still running, log).
    fn timed(
        &self,
        s: &Scenario,
        addr: SocketAddr,
        path: &'static str,
        key: Key,
        server: Server<'_>,
    ) -> Result<Done, String> {
        let replayed = matches!(
            key,
            Key::Fixed(_) | Key::Call { fixed: true, .. } | Key::Grpc { fixed: true, .. }
        );
        let expect = self.expect(s, replayed);
        let plan = self.plan(addr, self.spec(addr, path, key, s.big), expect);
        let server_part = match &server {
            Server::Proxy(proxy) => Part::process("proxy", proxy.process.pid()),
            Server::Other(part) => *part,
        };
        // Redis or PostgreSQL works for the proxy on the same cores: its CPU per request goes
        // in the notes.
        let db_cpu = self
            .database(s.store())
            .and_then(|db| Some((db.name, CpuMeter::start(db.pid()?))));
        let answered = Arc::new(AtomicU64::new(0));
        let server_cpu = server_part.pid().map(CpuMeter::start);
        let meter = cores::Meter::start(self.parts(s, server_part));
        let mut stats = self
            .rt
            .block_on(client::run(Arc::new(plan), answered.clone()));
        stats.cores = meter.finish();
        let requests = answered.load(Ordering::Relaxed);
        stats.cpu_per_request = server_cpu.and_then(|m| m.per_request(requests));
        let db_cpu = db_cpu.and_then(|(name, m)| Some((name, m.per_request(requests)?)));
        let fmt = |q| {
            stats
                .quantile(q)
                .map_or("-".to_owned(), report::format_duration)
        };
        let mut line = format!(
            "  {:.0} req/s, p50 {}, p99 {}, {} errors",
            stats.rps(),
            fmt(0.5),
            fmt(0.99),
            stats.errors
        );
        if stats.errors + stats.warmup_errors > 0 {
            line.push_str(&format!(
                " ({} in the warm-up): {}",
                stats.warmup_errors,
                stats.error_summary()
            ));
        }
        println!("{line}");
        let mut note = format!("expects {}", expect.describe());
        if let Some((name, cpu)) = db_cpu {
            note.push_str(&format!("; {name} {}/req", report::format_duration(cpu)));
        }
        if stats.capped {
            note.push_str("; hit --max-requests");
        }
        if let Server::Proxy(proxy) = server {
            note.push_str(&check_proxy(proxy)?);
        }
        Ok(Done::row(s, Outcome::Timed(stats), note))
    }

    /// One finished key, then every request replays it; the upstream must see it once (counted
    /// by the mock; another upstream counts nothing, so only the first answer is checked).
    fn replay(&self, s: &Scenario, proxy: &mut Proxy) -> Result<Done, String> {
        let key = format!("replay-{:016x}-{}", self.nonce, s.name);
        let value = HeaderValue::try_from(key.as_str()).map_err(|e| e.to_string())?;
        let spec = self.spec(proxy.addr, IDEMPOTENT_PATH, Key::Fixed(value), s.big);
        let first = self
            .rt
            .block_on(client::send_once(proxy.addr, spec.build(0)))?;
        self.expect(s, false)
            .check(&first)
            .map_err(|e| format!("the first request of the replayed key: {e}"))?;

        let mut done = self.timed(
            s,
            proxy.addr,
            IDEMPOTENT_PATH,
            spec.key,
            Server::Proxy(proxy),
        )?;
        let Some(mock) = self.upstream.mock() else {
            done.rows[0]
                .note
                .push_str("; upstream calls not counted (not the mock)");
            return Ok(done);
        };
        let forwarded = self.rt.block_on(storm::mock_stats(mock.addr))?["total"]
            .as_u64()
            .unwrap_or(0);
        if forwarded != 1 {
            println!("  FAIL: the upstream was called {forwarded} times for one replayed key");
            done.failed = true;
            done.summary.push(format!(
                "{}: FAIL: {forwarded} upstream calls for one key",
                s.name
            ));
        }
        Ok(done)
    }

    fn storm(&self, s: &Scenario, proxy: &mut Proxy) -> Result<Done, String> {
        let plan = storm::StormPlan {
            proxy: proxy.addr,
            mock: self.mock_addr()?,
            keys: self.args.storm_keys.max(1),
            duplicates: self.args.storm_duplicates,
            delay: self.args.storm_delay,
            body: Bytes::from_static(BODY),
            nonce: self.nonce,
        };
        let report = self.rt.block_on(storm::run(&plan))?;
        let note = check_proxy(proxy)?;
        println!("  {}", report.summary());
        let mut summary = Vec::new();
        for warning in &report.warnings {
            println!("  warning: {warning}");
            summary.push(format!("{}: warning: {warning}", s.name));
        }
        let failed = !report.passed();
        show_failures(s, &report.failures, &mut summary);
        let mut done = Done::row(
            s,
            Outcome::Storm(report),
            note.trim_start_matches("; ").to_owned(),
        );
        done.summary = summary;
        done.failed = failed;
        Ok(done)
    }

    /// Measures a ceiling (`measure`) alone, or beside the load generator driving the mock
    /// upstream's pass-through path at the run's concurrency ([`Beside::Load`]): the load starts
    /// first, the ceiling is measured once the load's warm-up is over, and the load ends with
    /// it. Its requests go in the row's note.
    fn beside(
        &self,
        beside: Beside,
        measure: impl FnOnce() -> Result<Done, String>,
    ) -> Result<Done, String> {
        if beside == Beside::Nothing {
            return measure();
        }
        let addr = self.upstream.addr();
        let expect = Expect {
            status: StatusCode::OK,
            replayed: false,
            body_len: None,
        };
        let plan = Arc::new(self.plan(
            addr,
            self.spec(addr, PASSTHROUGH_PATH, Key::None, false),
            expect,
        ));
        let answered = Arc::new(AtomicU64::new(0));
        let load = self.rt.spawn(client::run(plan, answered.clone()));
        std::thread::sleep(self.args.warmup);
        let mut done = measure();
        let stats = self
            .rt
            .block_on(load)
            .map_err(|e| format!("the load beside the ceiling: {e}"))?;
        if let Ok(done) = &mut done {
            let beside = format!(
                "beside {:.0} req/s of the load generator to the mock ({} connections)",
                stats.rps(),
                self.args.connections
            );
            for row in &mut done.rows {
                row.note.push_str(&format!("; {beside}"));
            }
        }
        done
    }

    /// pgbench against the run's PostgreSQL: the ceiling of new-key/postgres.
    fn ceiling(
        &self,
        s: &Scenario,
        pg: &Postgres,
        script: pgbench::Script,
    ) -> Result<Done, String> {
        let plan = pgbench::CeilingPlan {
            connections: self.args.connections,
            duration: self.args.duration,
            dir: self.dir.path(),
        };
        let ceiling = pgbench::run(pg, &plan, script)?;
        let cpu = ceiling
            .stats
            .cpu_per_request
            .map_or("?".to_owned(), report::format_duration);
        println!(
            "  {:.0} transactions/s ({}), {} failed, postgres {cpu}/transaction",
            ceiling.stats.rps(),
            script.about(),
            ceiling.failed
        );
        let note = format!(
            "pgbench -c {} -T {}s -M prepared, {} per transaction; cpu/req is postgres's",
            plan.connections,
            plan.duration.as_secs().max(1),
            script.about()
        );
        let mut done = Done::row(s, Outcome::Timed(ceiling.stats), note);
        done.failed = ceiling.failed > 0;
        Ok(done)
    }

    /// The proxy's SQLite writer on a fresh file: the ceiling of new-key/sqlite.
    fn sqlite_ceiling(&self, s: &Scenario) -> Result<Done, String> {
        let plan = sqlite_ceiling::SqliteCeilingPlan {
            connections: self.args.connections,
            duration: self.args.duration,
            dir: self.dir.path(),
        };
        let ceiling = sqlite_ceiling::run(&plan)?;
        let cpu = ceiling
            .stats
            .cpu_per_request
            .map_or("?".to_owned(), report::format_duration);
        println!(
            "  {:.0} requests/s (claim + complete), {} commits, {} failed, writer {cpu}/request",
            ceiling.stats.rps(),
            ceiling.commits,
            ceiling.failed
        );
        let batch = plan.connections.clamp(1, sqlite_ceiling::MAX_BATCH);
        let note = format!(
            "one writer thread, sync: normal, batches of {batch} claims then their {batch} \
             completions, {}s; cpu/req is the writer thread's",
            plan.duration.as_secs().max(1)
        );
        let mut done = Done::row(s, Outcome::Timed(ceiling.stats), note);
        done.failed = ceiling.failed > 0;
        Ok(done)
    }

    /// New keys on a webhook route: a Standard Webhooks delivery per request, each a new
    /// event id, signed here. One delivery is checked first: signed, it is forwarded; sent
    /// again, replayed; with a wrong signature, refused.
    fn webhook(&self, s: &Scenario, store: Store) -> Result<Done, String> {
        let space = self.key_spaces.get();
        self.key_spaces.set(space + 1);
        let secret = format!("load-{:016x}-{}", self.nonce, s.name);
        let signer = webhook::Signer::new(
            secret.as_bytes(),
            format!("evt-{:016x}-{space:06x}-", self.nonce),
        );
        let secrets = self
            .dir
            .path()
            .join(format!("webhook-secrets-{}", s.name.replace('/', "-")));
        std::fs::write(&secrets, format!("{}\n", signer.secrets_line()))
            .map_err(|e| format!("write {}: {e}", secrets.display()))?;
        let Some(config) = self.store_config(s, store)? else {
            return Ok(Done::skipped(s, store.missing()));
        };
        let routes = Routes {
            webhook_secrets: Some(&secrets),
            ..Routes::plain("24h")
        };
        let mut proxy = self.start_proxy_with(s.name, &config, &routes)?;
        let key = Key::Signed(Arc::new(signer));
        self.check_deliveries(s, proxy.addr, &key)?;
        self.timed(s, proxy.addr, WEBHOOK_PATH, key, Server::Proxy(&mut proxy))
    }

    /// Tool calls on a JSON-RPC route: a new key in `_meta` per call (`replay` false), or one
    /// finished call repeated with a new `id` each time, which must reach the upstream once.
    fn jsonrpc(&self, s: &Scenario, store: Store, replay: bool) -> Result<Done, String> {
        let Some(config) = self.store_config(s, store)? else {
            return Ok(Done::skipped(s, store.missing()));
        };
        let routes = Routes {
            jsonrpc: true,
            ..Routes::plain("24h")
        };
        let mut proxy = self.start_proxy_with(s.name, &config, &routes)?;
        let space = self.key_spaces.get();
        self.key_spaces.set(space + 1);
        let prefix: Arc<str> = format!("call-{:016x}-{space:06x}-", self.nonce).into();
        let key = Key::Call {
            prefix,
            fixed: replay,
        };
        if replay {
            let spec = self.spec(proxy.addr, JSONRPC_PATH, key.clone(), false);
            let first = self
                .rt
                .block_on(client::send_once(proxy.addr, spec.build(u64::MAX >> 16)))?;
            self.expect(s, false)
                .check(&first)
                .map_err(|e| format!("the first call of the replayed key: {e}"))?;
        }
        let mut done = self.timed(s, proxy.addr, JSONRPC_PATH, key, Server::Proxy(&mut proxy))?;
        if replay && let Some(mock) = self.upstream.mock() {
            let forwarded = self.rt.block_on(storm::mock_stats(mock.addr))?["total"]
                .as_u64()
                .unwrap_or(0);
            if forwarded != 1 {
                println!("  FAIL: the upstream was called {forwarded} times for one replayed call");
                done.failed = true;
                done.summary.push(format!(
                    "{}: FAIL: {forwarded} upstream calls for one key",
                    s.name
                ));
            }
        }
        Ok(done)
    }

    /// gRPC calls through the proxy over HTTP/2 to the mock ledger: through a pass-through
    /// route (`replay` `None`), or a `grpc:` route with a new key per call (`Some(false)`) or one
    /// finished key (`Some(true)`, which must reach the upstream once).
    fn grpc(&self, s: &Scenario, store: Store, replay: Option<bool>) -> Result<Done, String> {
        let Some(config) = self.store_config(s, store)? else {
            return Ok(Done::skipped(s, store.missing()));
        };
        let routes = Routes {
            grpc: Some(replay.is_some()),
            ..Routes::plain("24h")
        };
        let mut proxy = self.start_proxy_with(s.name, &config, &routes)?;
        let space = self.key_spaces.get();
        self.key_spaces.set(space + 1);
        let prefix = match replay {
            None => String::new(),
            Some(_) => format!("grpc-{:016x}-{space:06x}-", self.nonce),
        };
        let fixed = replay == Some(true);
        let key = grpc_key(&prefix, fixed);
        if fixed {
            let spec = self.spec(proxy.addr, GRPC_PATH, key.clone(), false);
            let first = self
                .rt
                .block_on(client::send_once(proxy.addr, spec.build(u64::MAX >> 16)))?;
            self.expect(s, false)
                .check(&first)
                .map_err(|e| format!("the first call of the replayed key: {e}"))?;
        }
        let mut done = self.timed(s, proxy.addr, GRPC_PATH, key, Server::Proxy(&mut proxy))?;
        if fixed && let Some(mock) = self.upstream.mock() {
            let forwarded = self.rt.block_on(storm::mock_stats(mock.addr))?["postings"]
                .as_u64()
                .unwrap_or(0);
            if forwarded != 1 {
                println!("  FAIL: the ledger posted {forwarded} times for one replayed call");
                done.failed = true;
                done.summary.push(format!(
                    "{}: FAIL: {forwarded} postings for one key",
                    s.name
                ));
            }
        }
        Ok(done)
    }

    /// A signed delivery is forwarded and, sent again, replayed; a forged one is refused.
    fn check_deliveries(&self, s: &Scenario, addr: SocketAddr, key: &Key) -> Result<(), String> {
        let spec = self.spec(addr, WEBHOOK_PATH, key.clone(), false);
        // The last ticket a run could reach: never one the load sends.
        let ticket = u64::MAX >> 16;
        let request = spec.build(ticket);
        let forged = {
            let mut forged = spec.build(ticket + 1);
            let signature =
                HeaderValue::from_static("v1,Zm9yZ2VkIHNpZ25hdHVyZSBvZiAzMiBieXRlcyEhISE=");
            forged
                .headers_mut()
                .insert(HeaderName::from_static("webhook-signature"), signature);
            forged
        };
        let again = spec.build(ticket);
        let (first, again, forged) = self.rt.block_on(async {
            Ok::<_, String>((
                client::send_once(addr, request).await?,
                client::send_once(addr, again).await?,
                client::send_once(addr, forged).await?,
            ))
        })?;
        self.expect(s, false)
            .check(&first)
            .map_err(|e| format!("a signed delivery: {e}"))?;
        self.expect(s, true)
            .check(&again)
            .map_err(|e| format!("a signed delivery sent again: {e}"))?;
        if forged.status != StatusCode::UNAUTHORIZED {
            return Err(format!(
                "a delivery with a wrong signature: status {}, not 401",
                forged.status
            ));
        }
        Ok(())
    }

    /// Requests whose answer is lost after the booking, then their resolution (`resolve`).
    fn resolve(&self, s: &Scenario, store: Store) -> Result<Done, String> {
        let Some(config) = self.store_config(s, store)? else {
            return Ok(Done::skipped(s, store.missing()));
        };
        let routes = Routes {
            resolve: true,
            ..Routes::plain("24h")
        };
        let mut proxy = self.start_proxy_with(s.name, &config, &routes)?;
        let admin = proxy
            .admin
            .ok_or_else(|| "the resolve proxy has no admin listener".to_owned())?;
        let plan = resolve::ResolvePlan {
            proxy: proxy.addr,
            admin,
            mock: self.mock_addr()?,
            lost: self.args.lost.max(1),
            connections: self.args.connections,
            nonce: self.nonce,
        };
        let report = self.rt.block_on(resolve::run(&plan))?;
        let note = check_proxy(&mut proxy)?;
        println!("  {}", report.summary());
        let failed = !report.passed();
        let mut summary = Vec::new();
        show_failures(s, &report.failures, &mut summary);
        let mut done = Done::row(
            s,
            Outcome::Resolve(report),
            note.trim_start_matches("; ").to_owned(),
        );
        done.summary = summary;
        done.failed = failed;
        Ok(done)
    }

    /// New keys at full speed with `ttl: 1s` for `--churn-duration`, the table sampled.
    fn churn(&self, s: &Scenario, store: Store) -> Result<Done, String> {
        let Some(config) = self.durable_config(s.name, store, Some(churn::SWEEP_INTERVAL)) else {
            return Ok(Done::skipped(s, store.missing()));
        };
        let sample: churn::Sampler = match (&config, &self.postgres) {
            (StoreConfig::Sqlite { path, .. }, _) => {
                let path = path.clone();
                Arc::new(move || sqlite_sample(&path))
            }
            (StoreConfig::Postgres { schema, .. }, Some(pg)) => {
                let (psql, url, table) = (pg.bin("psql"), pg.url(), format!("{schema}.records"));
                Arc::new(move || postgres_sample(&psql, &url, &table))
            }
            _ => return Ok(Done::skipped(s, store.missing())),
        };
        let mut proxy = self.start_proxy_ttl(s.name, &config, churn::TTL)?;
        let spec = self.spec(proxy.addr, IDEMPOTENT_PATH, self.new_keys(), false);
        let load = LoadPlan {
            warmup: std::time::Duration::ZERO,
            duration: self.args.churn_duration,
            max_requests: u64::MAX,
            ..self.plan(proxy.addr, spec, self.expect(s, false))
        };
        println!(
            "  churn: new keys for {:?}, ttl {}, sweep_interval {}, rows sampled every {:?}",
            load.duration,
            churn::TTL,
            churn::SWEEP_INTERVAL,
            self.args.churn_sample
        );
        let report = self.rt.block_on(churn::run(churn::ChurnPlan {
            load,
            proxy_pid: proxy.process.pid(),
            parts: self.parts(s, Part::process("proxy", proxy.process.pid())),
            every: self.args.churn_sample,
            sample,
        }))?;
        let note = format!("{}{}", report.note(), check_proxy(&mut proxy)?);
        let summary = report.summary(s.name);
        for line in &summary {
            println!("  {line}");
        }
        let failed = !report.bounded();
        let mut done = Done::row(s, Outcome::Timed(report.stats), note);
        done.summary = summary;
        done.failed = failed;
        Ok(done)
    }

    fn fill(&self, s: &Scenario) -> Result<Done, String> {
        let keys = self.args.fill_keys;
        let config = StoreConfig::Memory {
            max_entries: (keys + MAX_ENTRIES).max(2_000_000),
        };
        let mut proxy = self.start_proxy(s.name, &config)?;
        let spec = self.spec(proxy.addr, IDEMPOTENT_PATH, self.new_keys(), false);
        let plan = fill::FillPlan {
            load: self.plan(proxy.addr, spec, self.expect(s, false)),
            proxy_pid: proxy.process.pid(),
            parts: self.parts(s, Part::process("proxy", proxy.process.pid())),
            mock: self.mock_addr()?,
            keys,
            timeout: self.args.fill_timeout,
            fill_keys: self.new_keys(),
            full_keys: self.new_keys(),
        };
        let report = self.rt.block_on(fill::run(plan))?;
        let note = check_proxy(&mut proxy)?;
        let summary = report.summary();
        for line in &summary {
            println!("  {line}");
        }
        let store_note = |n: u64| format!("expects 200; store holds ~{n} keys{note}");
        let keys_full = report.keys_before + report.keys_filled;
        Ok(Done {
            rows: vec![
                Row {
                    name: format!("{}/empty", s.name),
                    big: false,
                    outcome: Outcome::Timed(report.empty),
                    note: store_note(0),
                },
                Row {
                    name: format!("{}/full", s.name),
                    big: false,
                    outcome: Outcome::Timed(report.full),
                    note: store_note(keys_full),
                },
            ],
            summary,
            failed: false,
        })
    }

    /// Stops every child, then removes the temp directory unless it is to be kept.
    fn finish(self, failed: bool) {
        let Bench {
            args,
            nginx,
            redis,
            postgres,
            upstream,
            dir,
            ..
        } = self;
        drop((nginx, redis, postgres, upstream));
        if args.keep_logs || failed {
            let path = dir.keep();
            println!("Configs and logs kept in {}", path.display());
        }
    }
}

/// SIGINT or SIGTERM: the handles of the children will not be dropped, so they are killed here.
async fn interrupted() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// The proxy is still running; its log lines (warnings, at the default filter) are shown.
fn check_proxy(proxy: &mut Proxy) -> Result<String, String> {
    proxy.process.ensure_running()?;
    let lines = proxy.process.log_lines();
    if lines.is_empty() {
        return Ok(String::new());
    }
    for line in lines.iter().take(3) {
        println!("  proxy log: {line}");
    }
    Ok(format!("; proxy logged {} line(s)", lines.len()))
}

/// An SQLite file's rows (a read-only connection beside the proxy's: WAL lets it read while the
/// proxy writes) and its bytes on disk, the WAL included.
fn sqlite_sample(path: &Path) -> Result<churn::Sample, String> {
    let conn = rusqlite::Connection::open_with_flags(
        path,
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(|e| format!("open {} read-only: {e}", path.display()))?;
    conn.busy_timeout(std::time::Duration::from_secs(2))
        .map_err(|e| format!("sqlite busy_timeout: {e}"))?;
    let rows: i64 = conn
        .query_row("SELECT count(*) FROM records", [], |row| row.get(0))
        .map_err(|e| format!("count the rows of {}: {e}", path.display()))?;
    let mut bytes = 0;
    for suffix in ["", "-wal"] {
        let file = format!("{}{suffix}", path.display());
        bytes += std::fs::metadata(&file).map_or(0, |m| m.len());
    }
    Ok((rows.unsigned_abs(), bytes))
}

/// A PostgreSQL table's rows (expired ones not yet swept included) and its size with its
/// indexes and TOAST, through psql.
fn postgres_sample(psql: &Path, url: &str, table: &str) -> Result<churn::Sample, String> {
    let out = std::process::Command::new(psql)
        .args([
            "-X",
            "-q",
            "-A",
            "-t",
            "-F",
            " ",
            "-v",
            "ON_ERROR_STOP=1",
            url,
        ])
        .args([
            "-c",
            &format!("SELECT count(*), pg_total_relation_size('{table}') FROM {table}"),
        ])
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("run psql: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut fields = text.split_whitespace().map(str::parse::<u64>);
    match (out.status.success(), fields.next(), fields.next()) {
        (true, Some(Ok(rows)), Some(Ok(bytes))) => Ok((rows, bytes)),
        _ => Err(format!(
            "count the rows of {table}: {}{}",
            text.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        )),
    }
}

/// Prints a scenario's broken invariants (the first ten) and adds one line for them to the
/// summary under the table; nothing when there are none.
fn show_failures(s: &Scenario, failures: &[String], summary: &mut Vec<String>) {
    let Some(first) = failures.first() else {
        return;
    };
    println!("  FAIL: {} broken invariant(s):", failures.len());
    for failure in failures.iter().take(10) {
        println!("  FAIL:   {failure}");
    }
    summary.push(format!(
        "{}: FAIL: {} (first: {first})",
        s.name,
        failures.len()
    ));
}

/// The gRPC rows' key: `idempotency-key` metadata `prefix` (none when empty), the same every
/// call (`fixed`) or with the call's ticket.
fn grpc_key(prefix: &str, fixed: bool) -> Key {
    Key::Grpc {
        prefix: prefix.into(),
        fixed,
    }
}
