//! The docs say what the code does: the README, the configuration reference and the operations
//! guide name fields, metrics and commands that a reader pastes as they are, so each list that
//! names parts of the code is checked here against a running proxy, not against a copy of the
//! list kept in the test.
//!
//! - The fields a reload refuses as needing a restart: every list in the docs names exactly
//!   the fields a running proxy's refusal names.
//! - The metrics: the operations guide's table names exactly the series a running proxy
//!   serves (with every store's own series, which a proxy serves on that store only), and
//!   every metric name anywhere in the docs is one of them (a counter with its `_total`, as
//!   Prometheus is queried).
//! - The quick start: the lines the README shows are the lines `idemproxy demo` prints.
//! - The admin token: rotated by a reload, as the operations guide tells operators to do it.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use harness::{ProxyProcess, eventually, free_port};

/// A documentation file of the repository, read whole.
fn doc(path: &str) -> String {
    let full = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("read {}: {e}", full.display()))
}

/// The text of `text` from `start` (excluded) to the first `end` after it (excluded).
fn between<'a>(text: &'a str, start: &str, end: &str) -> &'a str {
    let from = text
        .find(start)
        .unwrap_or_else(|| panic!("the docs no longer say {start:?}: update this test"))
        + start.len();
    let len = text[from..]
        .find(end)
        .unwrap_or_else(|| panic!("nothing ends {start:?} with {end:?}: update this test"));
    &text[from..from + len]
}

/// `text` without its parenthesised asides (nested ones too): what a list says in passing
/// about a field is not the list.
fn without_asides(text: &str) -> String {
    let mut depth = 0usize;
    let mut out = String::new();
    for c in text.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            c if depth == 0 => out.push(c),
            _ => {}
        }
    }
    out
}

/// The field names a span of prose writes in backticks (`listen`, `limits.max_connections`).
fn fields(text: &str) -> BTreeSet<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .filter(|t| {
            !t.is_empty()
                && t.chars()
                    .all(|c| c.is_ascii_lowercase() || c == '_' || c == '.')
        })
        .map(str::to_owned)
        .collect()
}

/// The `idemproxy_…` names in `text`.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("idemproxy_") {
        let before = rest[..at].chars().next_back();
        let tail = &rest[at..];
        let len = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        // Not a metric: part of a longer word, or an environment variable.
        if !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            names.insert(tail[..len].trim_end_matches('_').to_owned());
        }
        rest = &tail[len.max(1)..];
    }
    names
}

/// A secrets file for the webhook route of [`config`], written once per test process into
/// cargo's scratch directory for integration tests (under `target/`, not the system's temp
/// directory, where it would be left behind after every run).
fn webhook_secrets() -> &'static str {
    static FILE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    FILE.get_or_init(|| {
        let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
            "idemproxy-docs-{}.webhook-secret",
            std::process::id()
        ));
        std::fs::write(&path, "a webhook secret\n").expect("write the webhook secret");
        path.to_str().expect("a UTF-8 temp path").to_owned()
    })
}

/// A configuration with an admin listener, an observed route and a webhook route to an
/// upstream nobody needs (nothing is forwarded here), and the fields a reload test changes.
fn config(admin: u16, extra: &str) -> String {
    format!(
        "listen: 127.0.0.1:0
admin_listen: 127.0.0.1:{admin}
{extra}upstreams:
  booking:
    url: http://127.0.0.1:{up}
routes:
  - name: observed
    methods: [POST]
    path: /observed
    upstream: booking
    idempotency:
      mode: observe
  - name: resolved
    methods: [POST]
    path: /resolved
    upstream: booking
    idempotency:
      on_unknown_outcome: resolve
      resolve:
        request: GET /resolved/{{key}}
        settle_after: 10s
  - name: events
    methods: [POST]
    path: /webhooks/github
    upstream: booking
    webhook:
      provider: github
      secrets_file: {secrets}
  - name: tools
    path: /mcp
    upstream: booking
    jsonrpc:
      methods: [tools/call]
  - name: rest
    path: /*
    upstream: booking
",
        up = free_port(),
        secrets = webhook_secrets(),
    )
}

/// The `/metrics` text of the admin listener at `admin`.
async fn scrape(admin: u16) -> String {
    harness::client()
        .get(format!("http://127.0.0.1:{admin}/metrics"))
        .send()
        .await
        .expect("scrape /metrics")
        .text()
        .await
        .expect("the metrics text")
}

/// The names a Prometheus server stores for the families of an OpenMetrics text: a counter
/// `NAME_total`, a gauge `NAME`, a histogram `NAME` (with `_bucket`, `_count` and `_sum`).
fn served(text: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let mut names = BTreeSet::new();
    let mut histograms = BTreeSet::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let mut words = rest.split_whitespace();
        let (Some(name), Some(kind)) = (words.next(), words.next()) else {
            panic!("a TYPE line without a name and a type: {line:?}");
        };
        match kind {
            "counter" => names.insert(format!("{name}_total")),
            "histogram" => histograms.insert(name.to_owned()) && names.insert(name.to_owned()),
            _ => names.insert(name.to_owned()),
        };
    }
    (names, histograms)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_restart_list_names_what_a_reload_refuses() {
    let admin = free_port();
    let proc = ProxyProcess::spawn(&config(admin, "workers: 1\n"));
    // A file that changes every field the running proxy can't change in place, and that is
    // valid otherwise: the refusal names them all.
    let pki = harness::pki::Pki::new();
    let pid_dir = tempfile::tempdir().expect("temp dir");
    let changed = format!(
        "workers: 2
tls:
  cert_file: {cert}
  key_file: {key}
store:
  backend: memory
  max_entries: 5000
log_format: json
pid_file: {pid}
tracing: {{otlp_endpoint: http://127.0.0.1:9}}
limits:
  max_connections: 5000
  max_admin_connections: 100
",
        cert = pki.cert.display(),
        key = pki.key.display(),
        pid = pid_dir.path().join("idemproxy.pid").display(),
    );
    let changed = config(free_port(), &changed).replace(
        "listen: 127.0.0.1:0",
        &format!("listen: 127.0.0.1:{}", free_port()),
    );
    proc.rewrite_config(&changed);
    proc.signal("-HUP");
    let refused = " cannot change while the proxy runs";
    assert!(
        eventually(Duration::from_secs(10), || proc.log().contains(refused)).await,
        "no refusal for a restart logged:\n{}",
        proc.log()
    );
    let log = proc.log();
    let line = log
        .lines()
        .find(|l| l.contains(refused))
        .expect("the refusal's line");
    let named = between(line, "reload refused: ", refused);
    let code: BTreeSet<String> = named.split(", ").map(str::to_owned).collect();
    assert!(
        code.contains("listen") && code.contains("workers") && code.len() >= 10,
        "the file was meant to change every such field: {code:?}"
    );

    let readme = doc("README.md");
    let reference = doc("docs/configuration.md");
    let guide = doc("docs/operations.md");
    let lists = [
        (
            "README.md, the SIGHUP paragraph",
            fields(between(
                &readme,
                "finish under the configuration they started with.",
                "need a restart",
            )),
        ),
        (
            "docs/configuration.md, What needs a restart",
            fields(&without_asides(between(
                &reference,
                "**What needs a restart**:",
                "Only a `workers` the file writes counts",
            ))),
        ),
        (
            "docs/operations.md, IdemproxyConfigReloadFailed",
            fields(between(
                &guide,
                "names the fields that need a restart (",
                "). Fix the",
            )),
        ),
        (
            "docs/operations.md, Reloading the configuration",
            fields(between(
                &guide,
                "in short, everything but",
                "What a reload keeps",
            )),
        ),
    ];
    for (place, listed) in lists {
        assert_eq!(
            listed, code,
            "{place} lists other fields than a reload refuses (left: the doc, right: the code)"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_the_docs_name_are_the_ones_a_proxy_serves() {
    let admin = free_port();
    let proc = ProxyProcess::spawn(&config(admin, ""));
    // Some families have a series only once something happened: a reload that changes how a
    // route's keys are made, here.
    let upstream_line = |yaml: &str| {
        yaml.lines()
            .find(|l| l.contains("url: "))
            .map(str::to_owned)
            .expect("the upstream's url")
    };
    let running = std::fs::read_to_string(proc.config_path()).expect("the running file");
    let rescoped = config(admin, "")
        .replace(&upstream_line(&config(admin, "")), &upstream_line(&running))
        .replace(
            "      mode: observe\n",
            "      mode: observe\n      scope: []\n",
        );
    proc.rewrite_config(&rescoped);
    proc.signal("-HUP");
    assert!(
        eventually(Duration::from_secs(10), || proc
            .log()
            .contains("configuration reloaded"))
        .await,
        "the reload was not applied:\n{}",
        proc.log()
    );
    let (mut names, mut histograms) = served(&scrape(admin).await);
    assert!(
        names.contains("idemproxy_requests_total") && names.len() > 20,
        "the scrape lacks the proxy's families: {names:?}"
    );
    // Each store exports its own series only when it is the store in use: the table names
    // them all, so the served names are those of a proxy on each store.
    for (store_names, store_histograms) in served_by_each_store().await {
        names.extend(store_names);
        histograms.extend(store_histograms);
    }

    // The operations guide's table: one row per family, every family a row.
    let guide = doc("docs/operations.md");
    let rows = between(&guide, "| metric | labels | what it says |", "\n\n");
    let mut tabled = BTreeSet::new();
    for row in rows.lines().filter(|l| l.starts_with("| `")) {
        let first = row.split('|').nth(1).expect("a first cell");
        tabled.extend(metric_names(first));
    }
    assert_eq!(
        tabled, names,
        "the operations guide's metrics table names other series than the proxy serves (left: the table, right: /metrics)"
    );

    // Anywhere in the docs, a metric name is one to query: a served name, or a histogram's
    // series.
    for path in ["README.md", "docs/configuration.md", "docs/operations.md"] {
        for name in metric_names(&doc(path)) {
            let histogram_series = ["_bucket", "_count", "_sum"].iter().any(|s| {
                name.strip_suffix(s)
                    .is_some_and(|base| histograms.contains(base))
            });
            assert!(
                names.contains(&name) || histogram_series,
                "{path} names {name}, which the proxy does not serve{}",
                if names.contains(&format!("{name}_total")) {
                    " (a counter: its name ends in _total)"
                } else {
                    ""
                }
            );
        }
    }
}

/// What proxies on `sqlite`, `redis` and `postgres` serve, one scrape each (each store adds
/// its own series to those every proxy has).
async fn served_by_each_store() -> Vec<(BTreeSet<String>, BTreeSet<String>)> {
    let dir = tempfile::tempdir().expect("temp dir");
    let redis = harness::RedisServer::start();
    let pg = harness::postgres::PgServer::shared();
    let stores = [
        format!(
            "store:\n  backend: sqlite\n  path: {}\n",
            dir.path().join("records.db").display()
        ),
        format!("store:\n  backend: redis\n  url: {}\n", redis.url()),
        format!(
            "store:\n  backend: postgres\n  url: {}\n  schema: {}\n",
            pg.url(),
            harness::postgres::PgServer::fresh_schema()
        ),
    ];
    let mut scrapes = Vec::new();
    for store in stores {
        let admin = free_port();
        let proc = ProxyProcess::spawn(&config(admin, &store));
        scrapes.push(served(&scrape(admin).await));
        drop(proc);
    }
    scrapes
}

/// Where the binary of the README's first command (`cargo run … -- demo`) lands, as the demo
/// prints it: `./target/release/idemproxy` for `--release`, `./target/NAME/idemproxy` for
/// `--profile NAME`, `./target/debug/idemproxy` without either.
fn built_by_first_command(readme: &str) -> String {
    let quick = between(readme, "## Quick start", "\n```\n");
    let line = quick
        .lines()
        .find(|l| l.starts_with("cargo run") && l.contains("demo"))
        .expect("the quick start's first command runs the demo");
    let words: Vec<&str> = line.split_whitespace().collect();
    let profile = match words.iter().position(|w| *w == "--profile") {
        Some(at) => words.get(at + 1).copied().expect("a profile name"),
        None if words.contains(&"--release") => "release",
        None => "debug",
    };
    let dir = if profile == "dev" { "debug" } else { profile };
    format!("./target/{dir}/idemproxy")
}

#[test]
fn the_quick_start_shows_what_the_demo_prints() {
    let (listen, upstream, admin) = (free_port(), free_port(), free_port());
    let mut child = Command::new(harness::binary())
        .args([
            "demo",
            "--listen",
            &format!("127.0.0.1:{listen}"),
            "--upstream-listen",
            &format!("127.0.0.1:{upstream}"),
            "--admin-listen",
            &format!("127.0.0.1:{admin}"),
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn idemproxy demo");
    let printed = Arc::new(Mutex::new(String::new()));
    if let Some(out) = child.stdout.take() {
        let sink = printed.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Ok(mut s) = sink.lock() {
                    s.push_str(&line);
                    s.push('\n');
                }
            }
        });
    }
    let text = || printed.lock().map(|s| s.clone()).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !text().contains("Ctrl-C stops both.") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    // As printed on the default ports, by the binary the README's first command builds.
    let readme = doc("README.md");
    let built = built_by_first_command(&readme);
    let exe = harness::binary();
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    // The demo prints its path relative to where it runs, or whole when the target directory
    // is elsewhere (`CARGO_TARGET_DIR` on a build machine): either way, the README's.
    let exe = match exe.strip_prefix(here) {
        Ok(relative) => format!("./{}", relative.display()),
        Err(_) => exe.display().to_string(),
    };
    let printed = text()
        .replace(&format!("127.0.0.1:{listen}"), "127.0.0.1:8080")
        .replace(&format!("127.0.0.1:{upstream}"), "127.0.0.1:8081")
        .replace(&format!("127.0.0.1:{admin}"), "127.0.0.1:9090")
        .replace(&exe, &built);
    assert!(
        printed.contains("Ctrl-C stops both."),
        "the demo printed no lines to try within 20s:\n{printed}"
    );
    let section = between(&readme, "`demo` prints these lines", "\n```\n");
    let shown = section
        .split_once("```sh\n")
        .map(|(_, block)| block)
        .expect("a sh block of the lines to try");
    assert!(
        shown.contains("curl") && printed.contains(shown),
        "the README's quick start shows other lines than the demo prints.\nREADME:\n{shown}\nprinted:\n{printed}"
    );
}

/// The operations guide: the admin token is rotated by writing the new one into
/// `admin_token_file` and reloading — no restart. The old token is refused from then on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_rotates_the_admin_token() {
    let dir = tempfile::tempdir().expect("temp dir");
    let token_file = dir.path().join("admin-token");
    std::fs::write(&token_file, "old-token\n").expect("write the token");
    let admin = free_port();
    let proc = ProxyProcess::spawn(&config(
        admin,
        &format!("admin_token_file: {}\n", token_file.display()),
    ));
    let lookup = |token: &'static str| async move {
        harness::client()
            .get(format!("http://127.0.0.1:{admin}/keys/observed?key=k-1"))
            .bearer_auth(token)
            .send()
            .await
            .expect("a /keys call")
            .status()
            .as_u16()
    };
    // Authorized: nothing is saved under that key.
    assert_eq!(lookup("old-token").await, 404);
    assert_eq!(lookup("new-token").await, 401);

    std::fs::write(&token_file, "new-token\n").expect("rotate the token");
    proc.signal("-HUP");
    let mut rotated = false;
    for _ in 0..100 {
        if lookup("new-token").await == 404 {
            rotated = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        rotated,
        "the new token is taken after the reload:\n{}",
        proc.log()
    );
    assert_eq!(lookup("old-token").await, 401, "the old one is refused");
}
