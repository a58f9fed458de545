//! `pgbench/postgres`: the ceiling of `new-key/postgres`, measured on the same server in the
//! same run. One proxy new-key request is one claim and one completion (renewals only for an
//! upstream slower than a third of `lock_ttl`: none here), each its own autocommitted
//! statement, so each its own WAL flush. The pgbench script runs exactly those two statements,
//! copied from `src/store/postgres/sql.rs`, per transaction: `-c` = the bench's connections,
//! `-M prepared` (the proxy prepares each statement once per connection), `-n` (no vacuum),
//! alone against the server (no proxy runs meanwhile), in a fresh schema of the proxy's layout.
//!
//! The parameters the proxy binds are written as expressions of pgbench variables: the key is
//! `key_prefix` + route + `.` + 64 hex characters, like `StoreKey::text()` (two `md5`s of the
//! client id and a random number, so every client's keys are new and spread over the index as
//! the proxy's hashes are); the token is 16 bytes; the values have the sizes of the records the
//! proxy writes for the bench's echo request (an in-flight record, then the finished one).
//!
//! Two more rows measure the repeat of a finished key, the replay path: `pgbench-read/postgres`
//! runs a primary-key read of the record (the proxy's `get`), the least a replay can cost the
//! database, and `pgbench-repeat/postgres` the proxy's claim statement on that same finished
//! key, what each replay does cost it. Both on one key, as `replay/postgres` sends, written
//! before pgbench starts.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::client::{self, Stats};
use crate::cores::{Meter, Part, Source};
use crate::pg::{DATABASE, Postgres};
use crate::procs::CpuMeter;

/// The encoded in-flight record: 4-byte tag and version, 1 kind byte, token, fingerprint. The
/// encoding is the same on every store: the SQLite ceiling writes these sizes too.
pub(crate) const IN_FLIGHT_LEN: usize = 4 + 1 + 16 + 32;
/// The finished record of the bench's echo answer (status, saved headers, JSON body), as the
/// proxy stores it for `new-key/postgres` (`octet_length(value)` of its rows).
pub(crate) const FINISHED_LEN: usize = 516;
/// `lock_ttl` and `ttl` of the bench's idempotent route, in milliseconds.
pub(crate) const LEASE_MILLIS: u64 = 10_000;
pub(crate) const TTL_MILLIS: u64 = 24 * 60 * 60 * 1000;

pub(crate) struct CeilingPlan<'a> {
    pub connections: usize,
    pub duration: Duration,
    /// Where the script and pgbench's per-transaction logs go.
    pub dir: &'a Path,
}

pub(crate) struct Ceiling {
    /// Transactions (a [`Script`]'s statements) as requests; `cpu_per_request` is PostgreSQL's CPU per
    /// transaction.
    pub stats: Stats,
    pub failed: u64,
}

/// What a pgbench ceiling runs per transaction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Script {
    /// The claim of a new key, then its completion: the ceiling of `new-key/postgres`.
    ClaimComplete,
    /// A primary-key read of a finished record: the ceiling of `replay/postgres`.
    Read,
    /// The claim statement on a finished record: what a replay costs the database.
    Repeat,
}

impl Script {
    /// Its file name, and how the row's note says what a transaction is.
    fn name(self) -> (&'static str, &'static str) {
        match self {
            Script::ClaimComplete => ("pgbench-claim-complete.sql", "claim + complete"),
            Script::Read => (
                "pgbench-read.sql",
                "a primary-key read of the finished record",
            ),
            Script::Repeat => (
                "pgbench-repeat.sql",
                "the claim statement on the finished record",
            ),
        }
    }

    /// How the row's note says what one transaction is.
    pub(crate) fn about(self) -> &'static str {
        self.name().1
    }
}

/// `.` where the proxy has `:`: pgbench would take `:idempotent` for a variable, even in a
/// string literal. Same length, same index.
const KEY_PREFIX: &str = "idemproxy-load.idempotent.";

/// The proxy's claim statement (`src/store/postgres/sql.rs`, `Statements::claim`), with `key`,
/// `token` and the in-flight record written in. Keep it in step with that file.
fn claim(t: &str, key: &str, token: &str) -> String {
    let in_flight = format!("'\\x{}'::bytea", "a5".repeat(IN_FLIGHT_LEN));
    format!(
        "WITH cur AS (
    SELECT value, expires_at > now() AS live FROM {t} WHERE key = {key}
), ins AS (
    INSERT INTO {t} (key, token, value, expires_at)
    SELECT {key}, {token}, {in_flight}, now() + {LEASE_MILLIS}::bigint * interval '1 millisecond'
    WHERE NOT EXISTS (SELECT 1 FROM cur)
    ON CONFLICT (key) DO NOTHING
    RETURNING 1
), upd AS (
    UPDATE {t}
    SET token = {token}, value = {in_flight}, expires_at = now() + {LEASE_MILLIS}::bigint * interval '1 millisecond'
    WHERE key = {key} AND (expires_at <= now()) IS TRUE
      AND EXISTS (SELECT 1 FROM cur WHERE NOT live)
    RETURNING 1
)
SELECT true, NULL::bytea FROM ins
UNION ALL SELECT true, NULL::bytea FROM upd
UNION ALL SELECT false, value FROM cur WHERE live;"
    )
}

/// The finished record of the bench's echo answer, as a literal.
fn finished() -> String {
    format!("'\\x{}'::bytea", "5a".repeat(FINISHED_LEN))
}

/// The one key the replay scripts repeat.
fn repeated_key() -> String {
    format!("'{KEY_PREFIX}{}'", "7".repeat(64))
}

/// The script of `kind`: one transaction each.
fn script(schema: &str, kind: Script) -> String {
    let t = format!("{schema}.records");
    match kind {
        Script::ClaimComplete => {
            let key = format!(
                "('{KEY_PREFIX}' || md5(:client_id::text || '-' || :k::text) || md5(:k::text || '-' || :client_id::text))"
            );
            let token = "decode(md5(:k::text), 'hex')";
            let claim = claim(&t, &key, token);
            let finished = finished();
            let complete = format!(
                "UPDATE {t}
SET token = NULL, value = {finished}, expires_at = now() + {TTL_MILLIS}::bigint * interval '1 millisecond'
WHERE key = {key} AND token = {token} AND expires_at > now();"
            );
            format!("\\set k random(1, 1000000000)\n{claim}\n{complete}\n")
        }
        Script::Read => format!(
            "SELECT value FROM {t} WHERE key = {} AND expires_at > now();\n",
            repeated_key()
        ),
        Script::Repeat => format!(
            "{}\n",
            claim(
                &t,
                &repeated_key(),
                "'\\x00112233445566778899aabbccddeeff'::bytea"
            )
        ),
    }
}

/// The finished row the replay scripts repeat, written before pgbench starts.
fn finished_row(schema: &str) -> String {
    format!(
        "INSERT INTO {schema}.records (key, token, value, expires_at)
         VALUES ({}, NULL, {}, now() + {TTL_MILLIS}::bigint * interval '1 millisecond');",
        repeated_key(),
        finished()
    )
}

/// The proxy's tables (`src/store/postgres/schema.rs`), in `schema`.
fn create_schema(pg: &Postgres, schema: &str) -> Result<(), String> {
    pg.sql(&format!(
        "CREATE SCHEMA {schema};
         CREATE TABLE {schema}.schema_version (version integer NOT NULL);
         CREATE TABLE {schema}.records (
             key text PRIMARY KEY,
             token bytea,
             value bytea NOT NULL,
             expires_at timestamptz NOT NULL
         );
         CREATE INDEX records_expires_at ON {schema}.records (expires_at);
         ALTER TABLE {schema}.records SET (
             autovacuum_vacuum_scale_factor = 0.01,
             autovacuum_analyze_scale_factor = 0.02
         );
         INSERT INTO {schema}.schema_version (version) VALUES (1);"
    ))
    .map(drop)
}

pub(crate) fn run(pg: &Postgres, plan: &CeilingPlan<'_>, kind: Script) -> Result<Ceiling, String> {
    let schema = pg.fresh_schema();
    create_schema(pg, &schema)?;
    if kind != Script::ClaimComplete {
        pg.sql(&finished_row(&schema))?;
    }
    let script_path = plan.dir.join(kind.name().0);
    std::fs::write(&script_path, script(&schema, kind))
        .map_err(|e| format!("write {}: {e}", script_path.display()))?;
    let logs = plan.dir.join("pgbench-logs");
    let _ = std::fs::remove_dir_all(&logs);
    std::fs::create_dir_all(&logs).map_err(|e| format!("create {}: {e}", logs.display()))?;
    let seconds = plan.duration.as_secs().max(1);
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(plan.connections.max(1));
    let cpu = CpuMeter::start(pg.pid());
    // pgbench is this process's child: its CPU time is read once it has exited and been
    // waited for, from what it leaves in this process's `cutime`. Nothing else of this run
    // exits meanwhile.
    let pgbench = Part {
        name: "pgbench",
        source: Source::Reaped,
        single_threaded: threads == 1,
    };
    let mut meter = Meter::start(vec![pgbench, Part::process("postgres", pg.pid())]);
    let out = Command::new(pg.bin("pgbench"))
        .args(["-n", "-M", "prepared"])
        .args(["-c", &plan.connections.to_string()])
        .args(["-j", &threads.to_string()])
        .args(["-T", &seconds.to_string()])
        .arg("-f")
        .arg(&script_path)
        .arg("-l")
        .arg(format!("--log-prefix={}", logs.join("txn").display()))
        .args(["-h", "127.0.0.1", "-p", &pg.port().to_string()])
        .args(["-U", &pg.role(), DATABASE])
        // pgbench writes its log files into the current directory's prefix path.
        .current_dir(plan.dir)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("run pgbench: {e}"))?;
    meter.end();
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "pgbench failed ({}): {}{}",
            out.status,
            stdout.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    // The backends exit with pgbench's connections; give the postmaster a moment to reap
    // them, so their CPU time is in its children's total.
    std::thread::sleep(Duration::from_millis(200));
    let field = |prefix: &str| {
        stdout
            .lines()
            .find_map(|l| l.trim().strip_prefix(prefix))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse::<f64>().ok())
    };
    let tps = field("tps = ").ok_or_else(|| format!("pgbench printed no tps:\n{stdout}"))?;
    let failed = field("number of failed transactions: ").unwrap_or(0.0) as u64;
    let mut stats = Stats::new();
    stats.window = Duration::from_secs(seconds);
    stats.ok = (tps * seconds as f64).round() as u64;
    stats.errors = failed;
    read_latencies(&logs, &mut stats)?;
    let transactions =
        field("number of transactions actually processed: ").map_or(stats.ok, |n| n as u64);
    stats.cpu_per_request = cpu.per_request(transactions);
    stats.cores = meter.finish();
    Ok(Ceiling { stats, failed })
}

/// pgbench's per-transaction logs (`client txn latency_us script epoch epoch_us` per line)
/// into the histogram.
fn read_latencies(logs: &Path, stats: &mut Stats) -> Result<(), String> {
    let entries = std::fs::read_dir(logs).map_err(|e| format!("read {}: {e}", logs.display()))?;
    for entry in entries.flatten() {
        let text = std::fs::read_to_string(entry.path())
            .map_err(|e| format!("read {}: {e}", entry.path().display()))?;
        for line in text.lines() {
            if let Some(micros) = line
                .split_whitespace()
                .nth(2)
                .and_then(|f| f.parse::<u64>().ok())
            {
                client::record(&mut stats.histogram, Duration::from_micros(micros));
            }
        }
    }
    Ok(())
}
