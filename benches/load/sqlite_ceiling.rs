//! `ceiling/sqlite`: the ceiling of `new-key/sqlite`, measured on a fresh file in the run's
//! directory in the same run. It is what pgbench is for PostgreSQL (`pgbench`), for the store
//! that has no server: the proxy's own writer-thread work, done as fast as one thread can, with
//! nothing else (no HTTP, no upstream, no queue between tasks and the thread) in the way.
//!
//! # What is copied
//! The statements, the pragmas and the transaction shape are those of the proxy's SQLite
//! store, copied from `src/store/sqlite/` and to be kept in step with it:
//! - `file.rs`: the connection flags and busy timeout, WAL, `synchronous = NORMAL` (the
//!   `new-key/sqlite` scenario's `sync: normal`), `journal_size_limit`, `wal_autocheckpoint = 0`
//!   on the writer, and the schema;
//! - `checkpoint.rs`: a `PASSIVE` checkpoint every second on a connection of its own, beside
//!   the writer (without it the log would grow for the whole run);
//! - `ops.rs`: the claim (`INSERT … ON CONFLICT … DO UPDATE … WHERE expired RETURNING 1`) and
//!   the completion (`UPDATE … WHERE key AND token AND live`), with the same parameters;
//! - `writer.rs`: a batch is `BEGIN IMMEDIATE`, each operation under `SAVEPOINT op` / `RELEASE
//!   op`, then `COMMIT`; at most `MAX_BATCH` (256) operations a batch; the clock read once per
//!   operation.
//!
//! Keys are `StoreKey::text()`'s shape: the bench's `key_prefix`, the route, `:` and 64 hex
//! characters spread over the index as the proxy's hashes are; tokens are 16 bytes; values
//! have the sizes of the records the proxy writes for the bench's echo request (the encoding is
//! the same on every store: see `pgbench`'s constants; an SQLite row of the echo holds the same
//! bytes, give or take the client's headers the echo carries).
//!
//! # The model of concurrency
//! The proxy's writer takes everything queued when it starts a batch. Under the bench's closed
//! loop, `--connections` clients each have one request in flight, so at most that many claims
//! are queued at once: they arrive together, are committed together, are forwarded together,
//! and their completions come back together. Here the writer runs that steady state directly:
//! a batch of `connections` claims (one transaction), then the batch of their completions (a
//! second transaction), again and again. One request = one claim + one completion, as on the
//! pgbench row; its latency runs from the start of its claims' transaction to the commit of its
//! completions'. Left out, as they do not hold the writer up: the proxy's first look at a key
//! it lately finished or found taken (a read on a read connection, beside the writer; a new key
//! has none) and the sweep (nothing expires in a run of
//! fresh keys with a 24h `ttl`).

use std::path::Path;
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rusqlite::{Connection, OpenFlags, OptionalExtension, Statement, params};

use crate::client::{self, Stats};
use crate::cores::{Meter, Part, Source};
use crate::pgbench::{FINISHED_LEN, IN_FLIGHT_LEN, LEASE_MILLIS, TTL_MILLIS};

/// `MAX_BATCH` of `src/store/sqlite/writer.rs`: the most operations one transaction applies.
pub(crate) const MAX_BATCH: usize = 256;
/// `BUSY_TIMEOUT` of `src/store/sqlite/file.rs`.
const BUSY_TIMEOUT: Duration = Duration::from_millis(250);
/// `EVERY` of `src/store/sqlite/checkpoint.rs`: how often the log is copied back.
const CHECKPOINT_EVERY: Duration = Duration::from_secs(1);
/// The namespace of the bench's idempotent route: `key_prefix` + route + `:`.
const NAMESPACE: &str = "idemproxy-load:idempotent:";

/// `SCHEMA` of `src/store/sqlite/file.rs`.
const SCHEMA: &str = "
    CREATE TABLE IF NOT EXISTS records (
        key TEXT PRIMARY KEY,
        token BLOB,
        value BLOB NOT NULL,
        expires_at INTEGER NOT NULL
    );
    CREATE INDEX IF NOT EXISTS records_expires_at ON records (expires_at);
    CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);
    INSERT INTO schema_version (version) VALUES (1);
";
/// `CLAIM` of `src/store/sqlite/ops.rs`.
const CLAIM: &str = "
    INSERT INTO records (key, token, value, expires_at) VALUES (?1, ?2, ?3, ?4)
    ON CONFLICT (key) DO UPDATE
        SET token = excluded.token, value = excluded.value, expires_at = excluded.expires_at
        WHERE records.expires_at <= ?5
    RETURNING 1";
/// `SAVE` of `src/store/sqlite/ops.rs`.
const SAVE: &str = "
    UPDATE records SET token = NULL, value = ?3, expires_at = ?4
    WHERE key = ?1 AND token = ?2 AND expires_at > ?5";

pub(crate) struct SqliteCeilingPlan<'a> {
    /// Claims per batch: the clients of the proxy scenario, one request in flight each.
    pub connections: usize,
    pub duration: Duration,
    /// Where the fresh file goes (named `sqlite-…`, so the run removes it after the scenario).
    pub dir: &'a Path,
}

pub(crate) struct SqliteCeiling {
    /// Requests (claim + completion) per second; `cpu_per_request` is the writer thread's CPU
    /// per request.
    pub stats: Stats,
    /// Claims that found the key taken, completions that found their claim gone: none should.
    pub failed: u64,
    /// Transactions committed (two per batch of requests).
    pub commits: u64,
}

/// Runs the writer for `plan.duration` on a fresh file, with the checkpoint thread beside it.
pub(crate) fn run(plan: &SqliteCeilingPlan<'_>) -> Result<SqliteCeiling, String> {
    let path = plan.dir.join("sqlite-ceiling.db");
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    let writer = open_writer(&path)?;
    let checkpointer = Checkpointer::start(&path)?;
    let batch = plan.connections.clamp(1, MAX_BATCH);
    // This process is the writer (and the checkpoint thread, which sleeps most of the time):
    // a single thread does the work, so it limits the row once it uses a whole core.
    let part = Part {
        name: "sqlite-writer",
        source: Source::Client,
        single_threaded: true,
    };
    let mut meter = Meter::start(vec![part]);
    let result = Writer::prepare(&writer, batch).and_then(|mut w| w.serve(plan.duration));
    meter.end();
    checkpointer.stop();
    let mut ceiling = result?;
    ceiling.stats.cores = meter.finish();
    Ok(ceiling)
}

/// The write connection, as `open_writer` of `src/store/sqlite/file.rs` opens it with
/// `sync: normal`, and the schema.
fn open_writer(path: &Path) -> Result<Connection, String> {
    let conn = connect(path)?;
    let fail = |what: &str| {
        let path = path.display().to_string();
        let what = what.to_owned();
        move |e: rusqlite::Error| format!("{what} {path}: {e}")
    };
    let mode: String = conn
        .pragma_update_and_check(None, "journal_mode", "WAL", |row| row.get(0))
        .map_err(fail("switch to WAL mode"))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(format!(
            "{} stays in journal mode {mode}, not WAL",
            path.display()
        ));
    }
    conn.pragma_update(None, "synchronous", "NORMAL")
        .map_err(fail("set synchronous on"))?;
    conn.pragma_update(None, "journal_size_limit", 64 * 1024 * 1024)
        .map_err(fail("set journal_size_limit on"))?;
    conn.pragma_update(None, "wal_autocheckpoint", 0)
        .map_err(fail("turn off the writer's checkpoints on"))?;
    conn.execute_batch(SCHEMA)
        .map_err(fail("create the schema of"))?;
    Ok(conn)
}

/// `connect` of `src/store/sqlite/file.rs`: read-write, no SQLite mutexes (one thread a
/// connection), the busy timeout.
fn connect(path: &Path) -> Result<Connection, String> {
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_NO_MUTEX
        | OpenFlags::SQLITE_OPEN_CREATE;
    let conn = Connection::open_with_flags(path, flags)
        .map_err(|e| format!("open {}: {e}", path.display()))?;
    conn.busy_timeout(BUSY_TIMEOUT)
        .map_err(|e| format!("set the busy timeout on {}: {e}", path.display()))?;
    Ok(conn)
}

/// The checkpoint thread of `src/store/sqlite/checkpoint.rs`: a passive checkpoint every
/// second on a connection of its own, until stopped.
struct Checkpointer {
    stop: Sender<()>,
    thread: JoinHandle<()>,
}

impl Checkpointer {
    fn start(path: &Path) -> Result<Checkpointer, String> {
        let conn = connect(path)?;
        conn.pragma_update(None, "synchronous", "NORMAL")
            .map_err(|e| format!("set synchronous on {}: {e}", path.display()))?;
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("sqlite-ceiling-checkpoint".into())
            .spawn(move || {
                while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(CHECKPOINT_EVERY) {
                    // A failed checkpoint is tried again a second later, as the proxy does.
                    let _ = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()));
                }
            })
            .map_err(|e| format!("start the checkpoint thread: {e}"))?;
        Ok(Checkpointer { stop, thread })
    }

    fn stop(self) {
        drop(self.stop);
        let _ = self.thread.join();
    }
}

/// The write connection's statements, prepared once, and the run's counters.
struct Writer<'c> {
    begin: Statement<'c>,
    commit: Statement<'c>,
    savepoint: Statement<'c>,
    release_savepoint: Statement<'c>,
    claim: Statement<'c>,
    save: Statement<'c>,
    /// Requests a batch holds.
    batch: usize,
    /// Makes this run's keys unlike those of an earlier run in the same directory.
    nonce: u64,
    /// Requests begun so far.
    next: u64,
    in_flight: Vec<u8>,
    finished: Vec<u8>,
    failed: u64,
    commits: u64,
}

/// One request's parts, as the proxy binds them.
struct Request {
    key: String,
    token: [u8; 16],
}

impl<'c> Writer<'c> {
    fn prepare(conn: &'c Connection, batch: usize) -> Result<Writer<'c>, String> {
        let prepare = |sql: &str| {
            conn.prepare(sql)
                .map_err(|e| format!("prepare {:?}: {e}", sql.trim()))
        };
        Ok(Writer {
            begin: prepare("BEGIN IMMEDIATE")?,
            commit: prepare("COMMIT")?,
            savepoint: prepare("SAVEPOINT op")?,
            release_savepoint: prepare("RELEASE op")?,
            claim: prepare(CLAIM)?,
            save: prepare(SAVE)?,
            batch,
            nonce: u64::try_from(now_ms()).unwrap_or(0),
            next: 0,
            in_flight: vec![0xa5; IN_FLIGHT_LEN],
            finished: vec![0x5a; FINISHED_LEN],
            failed: 0,
            commits: 0,
        })
    }

    /// Batches of claims, each followed by the batch of their completions, for `duration`
    /// (the last batch is finished, not cut).
    fn serve(&mut self, duration: Duration) -> Result<SqliteCeiling, String> {
        let mut stats = Stats::new();
        let cpu_before = thread_cpu_time();
        let started = Instant::now();
        let end = started + duration;
        while Instant::now() < end {
            let began = Instant::now();
            let requests: Vec<Request> = (0..self.batch).map(|_| self.request()).collect();
            self.transaction(&requests, Writer::claim_one)?;
            self.transaction(&requests, Writer::complete_one)?;
            let latency = began.elapsed();
            for _ in &requests {
                client::record(&mut stats.histogram, latency);
            }
            stats.ok += requests.len() as u64;
        }
        stats.window = started.elapsed();
        stats.cpu_per_request = match (cpu_before, thread_cpu_time()) {
            (Some(before), Some(after)) => u32::try_from(stats.ok)
                .ok()
                .filter(|n| *n > 0)
                .and_then(|n| after.checked_sub(before).map(|d| d / n)),
            _ => None,
        };
        stats.errors = self.failed;
        Ok(SqliteCeiling {
            stats,
            failed: self.failed,
            commits: self.commits,
        })
    }

    /// The next request's key and token: `NAMESPACE` + 64 hex characters (a counter mixed so
    /// that consecutive keys land all over the index, as hashes do), a token of 16 bytes.
    fn request(&mut self) -> Request {
        let n = self.next;
        self.next += 1;
        let key = format!(
            "{NAMESPACE}{:016x}{:016x}{:016x}{:016x}",
            mix(n ^ self.nonce),
            mix(n.wrapping_add(1)),
            mix(n.wrapping_add(2)),
            mix(n.wrapping_add(3))
        );
        let mut token = [0; 16];
        token[..8].copy_from_slice(&n.to_le_bytes());
        token[8..].copy_from_slice(&self.nonce.to_le_bytes());
        Request { key, token }
    }

    /// One transaction as the proxy's writer applies a batch: `BEGIN IMMEDIATE`, each
    /// operation under a savepoint, `COMMIT`.
    fn transaction(
        &mut self,
        requests: &[Request],
        op: fn(&mut Self, &Request, i64) -> rusqlite::Result<bool>,
    ) -> Result<(), String> {
        self.begin
            .execute([])
            .map_err(|e| format!("BEGIN IMMEDIATE: {e}"))?;
        for request in requests {
            self.savepoint
                .execute([])
                .map_err(|e| format!("SAVEPOINT: {e}"))?;
            let done = op(self, request, now_ms()).map_err(|e| format!("{}: {e}", request.key))?;
            if !done {
                self.failed += 1;
            }
            self.release_savepoint
                .execute([])
                .map_err(|e| format!("RELEASE: {e}"))?;
        }
        self.commit
            .execute([])
            .map_err(|e| format!("COMMIT: {e}"))?;
        self.commits += 1;
        Ok(())
    }

    /// The claim of `Ops::claim`: `true` when it took the key (always, for a new key).
    fn claim_one(&mut self, r: &Request, now: i64) -> rusqlite::Result<bool> {
        let expires_at = now.saturating_add(LEASE_MILLIS as i64);
        let wrote = self
            .claim
            .query_row(
                params![r.key, &r.token[..], self.in_flight, expires_at, now],
                |_| Ok(()),
            )
            .optional()?;
        Ok(wrote.is_some())
    }

    /// The completion of `Ops::save`: `true` when it replaced its claim.
    fn complete_one(&mut self, r: &Request, now: i64) -> rusqlite::Result<bool> {
        let expires_at = now.saturating_add(TTL_MILLIS as i64);
        let changed =
            self.save
                .execute(params![r.key, &r.token[..], self.finished, expires_at, now])?;
        Ok(changed == 1)
    }
}

/// The proxy's clock (`src/store/sqlite/clock.rs`): Unix milliseconds of the wall clock.
fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// splitmix64's finalizer: a counter in, bits spread evenly out.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The calling thread's CPU time (user + system), from `/proc/thread-self/stat`: the writer's
/// own, without the checkpoint thread's or the load generator's idle runtime.
fn thread_cpu_time() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").ok()?;
    // The fields after the command name, which is in parentheses and may hold spaces.
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    let fields: Vec<u64> = rest
        .split_whitespace()
        .map(|f| f.parse().unwrap_or(0))
        .collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    Some(crate::procs::ticks_to_duration(
        fields.get(11)? + fields.get(12)?,
    ))
}
