//! `workers: N`: one current-thread runtime a worker, each on its own thread with its own
//! accept loop on the listen address (the sockets share the port).
//!
//! Every worker accepts and serves; one key's duplicates spread over the workers run once on
//! every store (memory and SQLite are one store for all workers; Redis and PostgreSQL are one
//! database reached through each worker's own connections); a reload reaches every worker; a
//! drain waits for the requests in flight, and the work their clients left behind, on every
//! worker; the PostgreSQL pool gauges are the sum of every worker's pool; `workers: 1` is one
//! thread; an invalid `workers` is refused with a message that says why.
//!
//! Which worker takes a connection is the kernel's choice (`SO_REUSEPORT` hashes each new
//! connection's addresses), so the tests open many connections — every request here is sent
//! on a client of its own — and check with `idemproxy_worker_connections_total{worker}` that
//! each worker took some.

use std::process::Command;
use std::time::Duration;

use harness::every_store;
use harness::{
    Backend, Env, ProxyProcess, Reply, TestProxy, binary, book_with, client, eventually, free_port,
    metric_value, send, spawn_booking, write_config,
};
use idemproxy::config::Config;
use idemproxy::proxy::Reloaded;

const BODY: &str = r#"{"seat":"7C"}"#;

/// `yaml` (a harness configuration: two workers) with `workers: n`.
fn with_workers(n: usize, yaml: &str) -> String {
    let out = yaml.replacen("workers: 2\n", &format!("workers: {n}\n"), 1);
    assert!(
        out.contains(&format!("workers: {n}\n")),
        "the harness's workers line moved"
    );
    out
}

/// The connections each of the first `n` workers accepted, as `/metrics` says.
fn accepted_by(text: &str, n: usize) -> Vec<u64> {
    (0..n)
        .map(|w| {
            let worker = w.to_string();
            metric_value(
                text,
                "idemproxy_worker_connections_total",
                &[("worker", &worker)],
            ) as u64
        })
        .collect()
}

/// `POST /bookings` with `key`, `count` times at once, each on a connection of its own.
async fn at_once(
    base: &str,
    keys: impl Fn(usize) -> String,
    count: usize,
    delay: &str,
) -> Vec<Reply> {
    let tasks: Vec<_> = (0..count)
        .map(|i| spawn_booking(base.to_owned(), &keys(i), BODY, delay))
        .collect();
    let mut replies = Vec::with_capacity(count);
    for t in tasks {
        replies.push(t.await.expect("request"));
    }
    replies
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_worker_accepts_on_the_shared_port_and_serves() {
    let env = Env::new(Backend::Memory).await;
    let proxy = env.proxy(&with_workers(3, &env.config(""))).await;
    assert_eq!(proxy.proxy.workers(), 3);
    let replies = at_once(&proxy.url(""), |i| format!("spread-{i}"), 96, "0ms").await;
    assert!(replies.iter().all(|r| r.status == 201), "{replies:?}");
    let accepted = accepted_by(&proxy.proxy.encode_metrics(), 3);
    assert!(
        accepted.iter().all(|&n| n > 0),
        "every worker takes connections: {accepted:?}"
    );
    assert_eq!(accepted.iter().sum::<u64>(), 96, "one connection a request");
    assert_eq!(env.mock.bookings(), 96);
}

every_store!(one_keys_duplicates_spread_over_the_workers_run_once);

/// Duplicates of one key on many connections, so on both workers at once: the claim is one
/// atomic step in the one store they share (or the one database their connections reach).
async fn one_keys_duplicates_spread_over_the_workers_run_once(backend: Backend) {
    let env = Env::new(backend).await;
    // Room for a loaded machine: the point is atomicity, not latency.
    let yaml = env.config_with("on_conflict: reject", "timeout: 1s");
    let proxy = env.proxy(&with_workers(2, &yaml)).await;
    let before = accepted_by(&proxy.proxy.encode_metrics(), 2);
    let replies = at_once(&proxy.url(""), |_| "across-workers".to_owned(), 24, "400ms").await;
    let after = accepted_by(&proxy.proxy.encode_metrics(), 2);
    assert!(
        after.iter().zip(&before).all(|(a, b)| a > b),
        "the duplicates reached both workers: {before:?} -> {after:?}"
    );
    let forwarded: Vec<&Reply> = replies
        .iter()
        .filter(|r| r.status == 201 && r.header("idempotent-replayed").is_empty())
        .collect();
    assert_eq!(forwarded.len(), 1, "one forwarded answer: {replies:?}");
    for r in &replies {
        assert!(
            r.status == 409 || (r.status == 201 && r.body == forwarded[0].body),
            "a duplicate is a conflict or a replay: {r:?}"
        );
    }
    assert_eq!(
        env.mock.calls("across-workers"),
        1,
        "the upstream ran it once"
    );
    // And once it is saved, every worker replays it.
    let replays = at_once(&proxy.url(""), |_| "across-workers".to_owned(), 16, "0ms").await;
    assert!(
        replays
            .iter()
            .all(|r| r.header("idempotent-replayed") == "true" && r.body == forwarded[0].body),
        "{replays:?}"
    );
    assert_eq!(env.mock.calls("across-workers"), 1);
}

/// One reload swaps the configuration every worker loads: after it, a request on any worker
/// gets the new rules, and before it none did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_reaches_every_worker() {
    let env = Env::new(Backend::Memory).await;
    let required = with_workers(2, &env.config("required: true"));
    let proxy = env.proxy(&required).await;
    let without_key = || async {
        let tasks: Vec<_> = (0..32)
            .map(|_| {
                let url = proxy.url("/bookings");
                tokio::spawn(async move { send(client().post(url).body(BODY)).await.status })
            })
            .collect();
        let mut statuses = Vec::new();
        for t in tasks {
            statuses.push(t.await.expect("request"));
        }
        statuses
    };
    let served = || accepted_by(&proxy.proxy.encode_metrics(), 2);
    let both = |from: &[u64], to: &[u64]| to.iter().zip(from).all(|(a, b)| a > b);
    let start = served();
    let statuses = without_key().await;
    assert!(
        statuses.iter().all(|&s| s == 400),
        "a key is required: {statuses:?}"
    );
    let before = served();
    assert!(
        both(&start, &before),
        "both workers served: {start:?} -> {before:?}"
    );
    let optional = with_workers(2, &env.config("required: false"));
    let config = Config::from_yaml(&optional).expect("valid");
    assert!(
        matches!(proxy.proxy.reload(config), Reloaded::Applied(_)),
        "reloaded"
    );
    let statuses = without_key().await;
    assert!(
        statuses.iter().all(|&s| s == 201),
        "every worker forwards a request without a key now: {statuses:?}"
    );
    let after = served();
    assert!(
        both(&before, &after),
        "both workers served: {before:?} -> {after:?}"
    );
    // A change of `workers` cannot be applied in place.
    let three = Config::from_yaml(&with_workers(3, &env.config("required: false"))).expect("valid");
    match proxy.proxy.reload(three) {
        Reloaded::NeedsRestart(fields) => assert_eq!(fields, ["workers"]),
        other => panic!("{other:?}"),
    }
}

/// SIGTERM while every worker has requests in flight, half of whose clients have gone: no
/// worker's requests are cut off, every upstream call left running (by every worker) is
/// saved, and the process exits 0 once all of that is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_waits_for_every_workers_requests_and_the_work_left_behind() {
    let env = Env::new(Backend::Sqlite).await;
    let admin = free_port();
    let yaml = with_workers(
        2,
        &format!("admin_listen: 127.0.0.1:{admin}\n{}", env.config("")),
    );
    let mut p = ProxyProcess::spawn(&yaml);
    // The port answers as soon as worker 0's socket listens; the start is logged once every
    // worker's does.
    assert!(
        eventually(Duration::from_secs(10), || p.log().contains("listening on")).await,
        "started; log:\n{}",
        p.log()
    );
    const N: usize = 32;
    let key = |i: usize| format!("drain-{i}");
    let tasks: Vec<_> = (0..N)
        .map(|i| spawn_booking(p.url(""), &key(i), BODY, "1500ms"))
        .collect();
    assert!(
        eventually(Duration::from_secs(10), || env.mock.total() == N as u64).await,
        "every request reached the upstream ({} of {N})",
        env.mock.total()
    );
    let metrics = send(client().get(format!("http://127.0.0.1:{admin}/metrics"))).await;
    let accepted = accepted_by(&String::from_utf8_lossy(&metrics.body), 2);
    assert!(
        accepted.iter().all(|&n| n > 0),
        "both workers hold requests in flight: {accepted:?}"
    );
    // Every other client leaves: its exchange runs on, detached, on the worker that has it.
    // (Spread over 32 connections, the 16 that leave are on both workers but for a chance of
    // one in 30,000.)
    let mut staying = Vec::new();
    for (i, t) in tasks.into_iter().enumerate() {
        if i % 2 == 0 {
            t.abort();
        } else {
            staying.push(t);
        }
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    p.signal("-TERM");
    for t in staying {
        let reply = t.await.expect("request in flight");
        assert_eq!(reply.status, 201, "{reply:?}; log:\n{}", p.log());
    }
    let code = p.wait(Duration::from_secs(10));
    assert_eq!(code, Some(0), "exit code; log:\n{}", p.log());
    // Every result was saved before the process exited: a proxy on the same file replays all.
    let proxy = env.proxy(&env.config("")).await;
    for i in 0..N {
        let again = book_with(&proxy.url(""), &key(i), BODY, &[]).await;
        assert_eq!(again.status, 201, "{again:?}");
        assert_eq!(again.header("idempotent-replayed"), "true", "key {i}");
        assert_eq!(env.mock.calls(&key(i)), 1, "key {i} ran once");
    }
}

/// Every worker has its own PostgreSQL pool, and `idemproxy_postgres_pool_connections` is
/// their sum — what the server counts — not the size of whichever pool was looked at last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_pool_gauges_are_the_sum_over_workers() {
    let env = Env::new(Backend::Postgres).await;
    let app = format!("workers_sum_{}", std::process::id());
    let url = env.postgres().url();
    let yaml = env.config("").replace(
        &format!("url: {url}"),
        &format!("url: {url}?application_name={app}"),
    );
    assert!(yaml.contains(&app), "the harness's url line moved");
    let proxy = env.proxy(&with_workers(2, &yaml)).await;
    let sessions = || {
        env.postgres()
            .server()
            .sql(&format!(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = '{app}'"
            ))
            .parse::<u64>()
            .expect("a count")
    };
    let gauge = |name| proxy.metric(name, &[]) as u64;
    // Each worker's warmer keeps a connection ready (worker 0 may have opened one more for
    // its start): at least two in all, and the gauge shows every one — a gauge that showed
    // the last pool looked at would show fewer than the server counts.
    let settled = eventually(Duration::from_secs(10), || {
        let open = sessions();
        open >= 2 && gauge("idemproxy_postgres_pool_connections") == open
    })
    .await;
    assert!(
        settled,
        "connections: {} on the server, {} in the gauge",
        sessions(),
        gauge("idemproxy_postgres_pool_connections")
    );
    // Requests on both workers, several at once on each: the pools grow, the gauge follows
    // the server's count, and nothing stays lent out.
    let replies = at_once(&proxy.url(""), |i| format!("pool-{i}"), 16, "200ms").await;
    assert!(replies.iter().all(|r| r.status == 201), "{replies:?}");
    assert!(
        eventually(Duration::from_secs(5), || {
            gauge("idemproxy_postgres_pool_connections") == sessions()
                && gauge("idemproxy_postgres_pool_in_use") == 0
        })
        .await,
        "connections: {} on the server, {} in the gauge; {} in use",
        sessions(),
        gauge("idemproxy_postgres_pool_connections"),
        gauge("idemproxy_postgres_pool_in_use")
    );
    assert!(
        sessions() <= 16,
        "at most pool_size (16) in all: {}",
        sessions()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_worker_serves_alone() {
    let env = Env::new(Backend::Memory).await;
    let proxy: TestProxy = env.proxy(&with_workers(1, &env.config(""))).await;
    assert_eq!(proxy.proxy.workers(), 1);
    let replies = at_once(&proxy.url(""), |_| "alone".to_owned(), 8, "200ms").await;
    assert_eq!(env.mock.calls("alone"), 1);
    assert!(
        replies.iter().all(|r| matches!(r.status, 201 | 409)),
        "{replies:?}"
    );
    let text = proxy.proxy.encode_metrics();
    assert_eq!(accepted_by(&text, 1), [8]);
    assert!(
        !text.contains("idemproxy_worker_connections_total{worker=\"1\"}"),
        "no second worker"
    );
}

/// The process runs one thread a worker (the main thread is worker 0), and says how many
/// serve when it starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_process_runs_a_thread_a_worker() {
    let env = Env::new(Backend::Memory).await;
    for n in [1, 3] {
        let p = ProxyProcess::spawn(&with_workers(n, &env.config("")));
        let listening = eventually(Duration::from_secs(5), || {
            p.log()
                .lines()
                .any(|l| l.contains("listening on") && l.contains(&format!("workers={n}")))
        })
        .await;
        assert!(listening, "the start names the workers; log:\n{}", p.log());
        let workers = std::fs::read_dir(format!("/proc/{}/task", p.pid()))
            .expect("the process's threads")
            .filter_map(Result::ok)
            .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
            .filter(|name| name.trim().starts_with("worker-"))
            .count();
        assert_eq!(workers, n - 1, "threads besides the main one");
        let reply = book_with(&p.url(""), &format!("threads-{n}"), BODY, &[]).await;
        assert_eq!(reply.status, 201);
    }
}

#[test]
fn an_invalid_workers_is_refused_with_its_bounds() {
    for (value, words) in [
        ("0", "workers: 0: must be from 1 to 256"),
        ("257", "workers: 257: must be from 1 to 256"),
        ("-1", "workers"),
        ("two", "workers"),
    ] {
        let yaml = format!(
            "listen: 127.0.0.1:8080\nworkers: {value}\nupstreams:\n  a:\n    url: http://127.0.0.1:9\nroutes:\n  - name: r\n    path: /\n    upstream: a\n"
        );
        let file = write_config(&yaml);
        let out = Command::new(binary())
            .arg("--check")
            .arg("--config")
            .arg(file.path())
            .output()
            .expect("run --check");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "workers: {value}; {stderr}");
        assert!(stderr.contains(words), "workers: {value}: {stderr}");
    }
}
