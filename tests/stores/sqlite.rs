//! The SQLite store end to end (SPEC §4.6): real proxy processes on a real file — a SIGKILLed
//! proxy restarted on the file replays every finished key and honours a claim that was in
//! flight, a second process on the file is refused, a lost lease is fenced, `sync: full`
//! works, and the sweep keeps the table bounded under churn.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use harness::{Backend, Env, ProxyProcess, Reply, book_with, free_port};
use idemproxy::config::SqliteSync;
use idemproxy::metrics::Metrics;
use idemproxy::store::StoreHandle;
use idemproxy::store::sqlite::SqliteStore;

// The store contract, each check a test of its own (`harness::store_checks`): a file of its own, its clock moved ahead for the checks of minutes.
harness::store_contract!(Sqlite { moved_clock });

/// The request body every booking here sends.
const BODY: &str = r#"{"seat":"12A"}"#;

/// The harness's memory `store:` section, which [`sqlite_config`] replaces.
const MEMORY_STORE: &str = "store:\n  backend: memory\n  timeout: 300ms\n";

/// A database file in a directory that does not exist yet (the proxy creates both).
fn db_path(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("state").join("records.db")
}

/// The harness's configuration (`idem` for `create-booking`) on the SQLite file at `path`,
/// with extra `store:` lines.
fn sqlite_config(env: &Env, path: &Path, idem: &str, store: &str) -> String {
    let yaml = env.config(idem);
    let mut section = format!(
        "store:\n  backend: sqlite\n  path: {}\n  timeout: 300ms\n",
        path.display()
    );
    for line in store.lines().filter(|l| !l.trim().is_empty()) {
        section.push_str("  ");
        section.push_str(line.trim());
        section.push('\n');
    }
    assert!(
        yaml.contains(MEMORY_STORE),
        "the harness's store section moved"
    );
    yaml.replace(MEMORY_STORE, &section)
}

/// Asserts `r` is a replay of `first`: same status and headers, byte-identical body, marked.
fn assert_replay_of(r: &Reply, first: &Reply) {
    assert_eq!(
        r.status, first.status,
        "replayed status; body: {:?}",
        r.body
    );
    assert_eq!(r.header("idempotent-replayed"), "true", "replay marker");
    assert_eq!(r.header_lines(), first.header_lines(), "replayed headers");
    assert_eq!(r.body, first.body, "replayed body is byte-identical");
}

fn assert_forwarded(r: &Reply) {
    assert_eq!(r.status, 201, "forwarded; body: {:?}", r.body);
    assert_eq!(r.header("idempotent-replayed"), "", "not a replay");
}

/// SIGKILL, and wait for the process to be gone (its lock with it).
fn kill(proxy: &mut ProxyProcess) {
    let pid = proxy.pid().to_string();
    proxy.signal("-KILL");
    // A process killed by a signal has no exit code: `wait` reaps it and answers `None`.
    let _ = proxy.wait(Duration::from_secs(5));
    let alive = Command::new("kill")
        .args(["-0", &pid])
        .stderr(Stdio::null())
        .status()
        .expect("run kill -0");
    assert!(!alive.success(), "the proxy did not die");
}

/// Twenty keys finished, SIGKILL, a new process on the same port and file: every key replays
/// byte for byte, and the upstream ran each operation once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_proxy_restarted_on_the_file_replays_every_finished_key() {
    let env = Env::new(Backend::Memory).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let yaml = sqlite_config(&env, &db_path(&dir), "", "");
    let port = free_port();
    let mut proxy = ProxyProcess::spawn_on(&yaml, port);
    let base = proxy.url("");
    let mut firsts = Vec::new();
    for n in 0..20 {
        let key = format!("killed-{n}");
        let first = book_with(&base, &key, BODY, &[]).await;
        assert_forwarded(&first);
        firsts.push((key, first));
    }
    let calls = env.mock.total();
    kill(&mut proxy);

    let proxy = ProxyProcess::spawn_on(&yaml, port);
    for (key, first) in &firsts {
        let again = book_with(&proxy.url(""), key, BODY, &[]).await;
        assert_replay_of(&again, first);
        assert_eq!(env.mock.calls(key), 1, "{key} ran once");
    }
    assert_eq!(env.mock.total(), calls, "no side effect after the restart");
}

/// A claim in flight when the proxy is SIGKILLed is in the file: after the restart the retry
/// gets 409 until the dead holder's lease lapses, then runs once, and replays after that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_in_flight_at_sigkill_holds_until_its_lease_lapses_then_runs_once() {
    let env = Env::new(Backend::Memory).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let lock_ttl = Duration::from_secs(3);
    let yaml = sqlite_config(&env, &db_path(&dir), "lock_ttl: 3s", "");
    let port = free_port();
    let mut victim = ProxyProcess::spawn_on(&yaml, port);
    let key = "in-flight-at-kill";
    let in_flight = {
        let url = victim.url("/bookings");
        tokio::spawn(async move {
            // Fails when the process dies; only the side effect matters.
            let _ = harness::client()
                .post(url)
                .header("Idempotency-Key", key)
                .header("Content-Type", "application/json")
                .header("X-Mock-Delay", "10s")
                .body(BODY)
                .send()
                .await;
        })
    };
    assert!(
        harness::eventually(Duration::from_secs(5), || env.mock.calls(key) == 1).await,
        "the request reached the upstream"
    );
    kill(&mut victim);
    let killed = Instant::now();

    let proxy = ProxyProcess::spawn_on(&yaml, port);
    let right_after = book_with(&proxy.url(""), key, BODY, &[]).await;
    assert!(
        killed.elapsed() < lock_ttl,
        "the restart took longer than the lease; the test proves nothing"
    );
    right_after.assert_problem(409, "request-in-progress");

    let deadline = killed + lock_ttl + Duration::from_secs(2);
    let forwarded = loop {
        let r = book_with(&proxy.url(""), key, BODY, &[]).await;
        if r.status == 201 {
            break r;
        }
        r.assert_problem(409, "request-in-progress");
        assert!(
            Instant::now() < deadline,
            "the dead proxy's claim outlived its lease"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_forwarded(&forwarded);
    assert_eq!(env.mock.calls(key), 2, "the retry ran, once");
    let again = book_with(&proxy.url(""), key, BODY, &[]).await;
    assert_replay_of(&again, &forwarded);
    assert_eq!(env.mock.calls(key), 2);
    in_flight.abort();
}

/// A second process on the same file exits non-zero, naming the file; the first serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_process_on_the_same_file_is_refused() {
    let env = Env::new(Backend::Memory).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let path = db_path(&dir);
    let yaml = sqlite_config(&env, &path, "", "");
    let first = ProxyProcess::spawn(&yaml);

    let config = harness::write_config(&yaml);
    let mut second = Command::new(harness::binary())
        .arg("--config")
        .arg(config.path())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn a second idemproxy");
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = second.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = second.kill();
            let _ = second.wait();
            panic!("the second proxy on the same file kept running");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stderr = {
        use std::io::Read;
        let mut s = String::new();
        second
            .stderr
            .take()
            .expect("stderr")
            .read_to_string(&mut s)
            .expect("read stderr");
        s
    };
    assert!(!status.success(), "exit status {status}; stderr: {stderr}");
    assert!(
        stderr.contains(&path.display().to_string()) && stderr.contains("in use"),
        "stderr names the file: {stderr}"
    );

    let r = book_with(&first.url(""), "after-refusal", BODY, &[]).await;
    assert_forwarded(&r);
}

/// The store contract's fencing check on SQLite: a holder whose lease lapsed and was taken over
/// can neither complete, renew nor release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lease_is_fenced() {
    let dir = tempfile::tempdir().expect("temp dir");
    let metrics = Arc::new(Metrics::new());
    let store = SqliteStore::open(
        &db_path(&dir),
        SqliteSync::Normal,
        Duration::from_secs(30),
        metrics.clone(),
    )
    .expect("open");
    let handle = StoreHandle::new(Arc::new(store), Duration::from_millis(300), metrics);
    harness::store_checks::stale_holder_cannot_overwrite_a_newer_holder(&handle).await;
}

/// `sync: full` end to end, in this process: bookings forwarded and replayed, commits counted;
/// a proxy stopped gracefully hands the file to the next one, which replays every key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_full_works_end_to_end_and_a_stopped_proxy_hands_the_file_on() {
    let env = Env::new(Backend::Memory).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let yaml = sqlite_config(&env, &db_path(&dir), "", "sync: full");
    let proxy = env.proxy(&yaml).await;
    let mut firsts = Vec::new();
    for n in 0..5 {
        let key = format!("full-{n}");
        let first = book_with(&proxy.url(""), &key, BODY, &[]).await;
        assert_forwarded(&first);
        assert_replay_of(&book_with(&proxy.url(""), &key, BODY, &[]).await, &first);
        firsts.push((key, first));
    }
    assert!(proxy.metric("idemproxy_sqlite_batch_size_count", &[]) >= 5.0);
    assert!(proxy.metric("idemproxy_sqlite_commit_duration_seconds_count", &[]) >= 5.0);
    proxy.stop().await;

    let next = env.proxy(&yaml).await;
    for (key, first) in &firsts {
        assert_replay_of(&book_with(&next.url(""), key, BODY, &[]).await, first);
        assert_eq!(env.mock.calls(key), 1);
    }
}

/// Churn: `ttl: 1s`, `sweep_interval: 1s`, new keys at a steady rate for 20 s. The table holds
/// about the last couple of seconds' keys, never all of them. Prints its size over time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_table_stays_bounded_under_churn() {
    let env = Env::new(Backend::Memory).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let path = db_path(&dir);
    let yaml = sqlite_config(&env, &path, "ttl: 1s", "sweep_interval: 1s");
    let proxy = env.proxy(&yaml).await;
    let base = proxy.url("");
    let shell = rusqlite::Connection::open(&path).expect("open the file beside the proxy");
    shell
        .busy_timeout(Duration::from_secs(2))
        .expect("busy timeout");
    let sample = || -> (i64, i64) {
        let rows = shell
            .query_row("SELECT count(*) FROM records", [], |r| r.get(0))
            .expect("count");
        let pages = shell
            .query_row("PRAGMA page_count", [], |r| r.get(0))
            .expect("page count");
        (rows, pages)
    };

    // 5 new keys every 100ms: 50 a second, 1000 in all.
    const RUN: Duration = Duration::from_secs(20);
    const BURST: usize = 5;
    let started = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let mut sent = 0usize;
    let mut sizes = Vec::new();
    let mut next_sample = Duration::ZERO;
    while started.elapsed() < RUN {
        tick.tick().await;
        let burst: Vec<_> = (0..BURST)
            .map(|i| {
                let (base, key) = (base.clone(), format!("churn-{sent}-{i}"));
                tokio::spawn(async move { book_with(&base, &key, BODY, &[]).await.status })
            })
            .collect();
        for b in burst {
            assert_eq!(b.await.expect("request"), 201);
        }
        sent += BURST;
        if started.elapsed() >= next_sample {
            let (rows, pages) = sample();
            println!(
                "churn t={:>4.1}s sent={sent:>4} rows={rows:>4} pages={pages}",
                started.elapsed().as_secs_f64()
            );
            sizes.push(rows);
            next_sample += Duration::from_secs(2);
        }
    }
    let (rows, pages) = sample();
    let swept = proxy.metric("idemproxy_store_swept_total", &[]);
    println!(
        "churn end: sent={sent} rows={rows} pages={pages} swept={swept} — with ttl 1s and \
         sweep_interval 1s, {}s of churn is {} record lifetimes (an hour of churn for a route \
         with ttl 3m)",
        RUN.as_secs(),
        RUN.as_secs()
    );
    // Alive at once: the last second's keys (ttl), plus up to one interval of expired ones
    // not swept yet, plus a margin for a slow machine. 50 keys a second: 150 at most, in
    // principle; all 1000 without the sweep.
    let bound = 250;
    assert!(
        rows <= bound,
        "{rows} rows after {sent} keys (sizes: {sizes:?})"
    );
    for (i, size) in sizes.iter().enumerate().skip(2) {
        assert!(*size <= bound, "sample {i}: {size} rows (sizes: {sizes:?})");
    }
    assert!(swept >= (sent as f64) / 2.0, "swept {swept} of {sent} keys");
}
