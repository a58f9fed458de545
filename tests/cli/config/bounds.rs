//! Values out of bounds and cross-field rules: a value that does not parse hides no other error (SPEC
//! §2: `--check` prints every error), zero is refused wherever it would make the proxy
//! unusable, the cross-field refusals of SPEC §4.5, and one way of reading a secret file for
//! the server and the command line.

use std::process::Command;
use std::time::Duration;

use harness::{Backend, Env, ProxyProcess, binary, client, send, write_config};
use idemproxy::config::Config;

use super::{errors, has};

/// `routes[0]` has a duration that does not parse, `routes[1]` names an undefined upstream.
const TTL_AND_UPSTREAM: &str = "\
listen: 127.0.0.1:8080
upstreams:
  booking:
    url: http://127.0.0.1:8081
routes:
  - name: create-booking
    path: /bookings
    upstream: booking
    idempotency:
      ttl: soon
  - name: refunds
    path: /refunds
    upstream: billing
";

#[test]
fn a_value_that_does_not_parse_hides_no_other_error() {
    let errs = errors(TTL_AND_UPSTREAM);
    assert!(
        has(
            &errs,
            "routes[0].idempotency.ttl",
            &["invalid duration", "soon"]
        ),
        "{errs}"
    );
    assert!(
        has(
            &errs,
            "routes[1].upstream",
            &["unknown upstream", "billing"]
        ),
        "the second route's error is reported too:\n{errs}"
    );
    assert_eq!(errs.0.len(), 2, "exactly these two:\n{errs}");
    // The first error keeps the position YAML gives it: `ttl` is on line 10.
    assert_eq!(TTL_AND_UPSTREAM.lines().nth(9), Some("      ttl: soon"));
    assert!(
        errs.0[0].to_string().contains("line 10 column"),
        "{}",
        errs.0[0]
    );
}

#[test]
fn type_errors_in_three_sections_are_all_reported_with_the_rest() {
    let yaml = "\
listen: 127.0.0.1:8080
store:
  timeout: fast
upstreams:
  booking:
    url: http://127.0.0.1:8081
    connect_timeout: 1 fortnight
    retries: 3
routes:
  - name: create-booking
    path: /bookings
    upstream: booking
    idempotency:
      max_request_body: 12 parsecs
      retry_statuses: [-1, 700]
      on_conflict: sometimes
  - just a string
  - name: refunds
    path: refunds
    upstream: billing
";
    let errs = errors(yaml);
    let want: &[(&str, &[&str])] = &[
        ("store.timeout", &["invalid duration", "fast"]),
        ("upstreams.booking.connect_timeout", &["invalid duration"]),
        ("upstreams.booking.retries", &["unknown field", "retries"]),
        (
            "routes[0].idempotency.max_request_body",
            &["invalid size", "12 parsecs"],
        ),
        ("routes[0].idempotency.retry_statuses[0]", &["-1"]),
        (
            "routes[0].idempotency.on_conflict",
            &["unknown variant", "sometimes"],
        ),
        // The error after a removed list element keeps its own index.
        (
            "routes[0].idempotency.retry_statuses[1]",
            &["invalid HTTP status", "700"],
        ),
        ("routes[1]", &["invalid type"]),
        // And so do the routes after a route that is not a mapping.
        ("routes[2].path", &["invalid path"]),
        ("routes[2].upstream", &["unknown upstream", "billing"]),
    ];
    for (path, words) in want {
        assert!(
            has(&errs, path, words),
            "no {path} error {words:?} in:\n{errs}"
        );
    }
    assert_eq!(errs.0.len(), want.len(), "exactly these errors:\n{errs}");
    for e in &errs.0 {
        let text = e.to_string();
        assert!(text.starts_with(&format!("{}: ", e.path)), "{text}");
    }
}

#[test]
fn a_removed_required_field_adds_no_missing_field_error() {
    // `path` is required: once its bad value is set aside, the route lacks it; that is a
    // consequence, not a second mistake.
    let yaml = TTL_AND_UPSTREAM.replace("path: /bookings", "path: [a, b]");
    let errs = errors(&yaml);
    assert!(has(&errs, "routes[0].path", &["invalid type"]), "{errs}");
    assert!(
        !errs.to_string().contains("missing field"),
        "no consequential missing field:\n{errs}"
    );
    // A field that really is missing is still reported, after the type error before it.
    let yaml = TTL_AND_UPSTREAM.replace("    path: /refunds\n", "");
    let errs = errors(&yaml);
    assert!(
        has(&errs, "routes[0].idempotency.ttl", &["invalid duration"]),
        "{errs}"
    );
    assert!(
        has(&errs, "routes[1].path", &["missing field", "path"]),
        "{errs}"
    );
}

#[test]
fn check_prints_every_error_when_a_value_does_not_parse() {
    let file = write_config(TTL_AND_UPSTREAM);
    let out = Command::new(binary())
        .arg("--check")
        .arg("--config")
        .arg(file.path())
        .env_remove("IDEMPROXY_CONFIG")
        .output()
        .expect("run idemproxy --check");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let line = |path: &str| {
        stderr
            .lines()
            .find(|l| l.contains(&format!("{path}: ")))
            .unwrap_or_else(|| panic!("no error naming {path} on stderr:\n{stderr}"))
            .to_owned()
    };
    assert!(line("routes[0].idempotency.ttl").contains("invalid duration"));
    assert!(line("routes[0].idempotency.ttl").contains("line 10 column"));
    assert!(line("routes[1].upstream").contains("unknown upstream"));
    assert!(stderr.contains("2 error(s)"), "{stderr}");
}

/// A valid file; rows below add one setting to it.
const VALID: &str = "\
listen: 127.0.0.1:8080
upstreams:
  booking:
    url: http://127.0.0.1:8081
routes:
  - name: create-booking
    path: /bookings
    upstream: booking
    idempotency:
      required: true
";

/// [`VALID`] with `section:` holding `line` (`section` empty: a top-level line; `idempotency`:
/// a line of the route's idempotency settings; `upstream`: one of the upstream's).
fn with(section: &str, line: &str) -> String {
    match section {
        "" => VALID.replace("upstreams:\n", &format!("{line}\nupstreams:\n")),
        "idempotency" => VALID.replace(
            "      required: true\n",
            &format!("      required: true\n      {line}\n"),
        ),
        "upstream" => VALID.replace(
            "    url: http://127.0.0.1:8081\n",
            &format!("    url: http://127.0.0.1:8081\n    {line}\n"),
        ),
        _ => VALID.replace(
            "upstreams:\n",
            &format!("{section}:\n  {line}\nupstreams:\n"),
        ),
    }
}

/// Every count, size and duration at zero: refused where zero would leave the proxy unable to
/// do its job, accepted where zero means something (and the docs say what).
#[test]
fn zero_is_refused_wherever_it_makes_the_proxy_unusable() {
    #[rustfmt::skip]
    let rows: &[(&str, &str, &str, Option<&str>)] = &[
        // (section, line, field path, Some(words of the refusal) or None: accepted)
        ("", "shutdown_timeout: 0s", "shutdown_timeout", Some("greater than zero")),
        ("", "drain_delay: 0s", "drain_delay", None),
        ("", "workers: 0", "workers", Some("from 1 to 256")),
        ("store", "timeout: 0s", "store.timeout", Some("greater than zero")),
        ("store", "max_entries: 0", "store.max_entries", Some("at least 1")),
        ("store", "wait_replicas: 0", "store.wait_replicas", None),
        ("upstream", "connect_timeout: 0s", "upstreams.booking.connect_timeout", Some("greater than zero")),
        ("upstream", "timeout: 0s", "upstreams.booking.timeout", Some("greater than zero")),
        ("upstream", "pool_idle_timeout: 0s", "upstreams.booking.pool_idle_timeout", None),
        ("limits", "max_connections: 0", "limits.max_connections", Some("at least 1")),
        ("limits", "header_read_timeout: 0s", "limits.header_read_timeout", Some("greater than zero")),
        ("limits", "body_read_timeout: 0s", "limits.body_read_timeout", Some("greater than zero")),
        ("limits", "max_detached_exchanges: 0", "limits.max_detached_exchanges", Some("at least 1")),
        ("limits", "max_pending_saves: 0", "limits.max_pending_saves", Some("at least 1")),
        ("limits", "max_pending_save_bytes: 0", "limits.max_pending_save_bytes", Some("greater than zero")),
        ("limits", "send_timeout: 0s", "limits.send_timeout", Some("greater than zero")),
        ("limits", "max_admin_connections: 0", "limits.max_admin_connections", Some("at least 1")),
        ("idempotency", "ttl: 0s", "routes[0].idempotency.ttl", Some("greater than zero")),
        ("idempotency", "lock_ttl: 0s", "routes[0].idempotency.lock_ttl", Some("at least")),
        ("idempotency", "on_conflict: wait\n      wait_timeout: 0s", "routes[0].idempotency.wait_timeout", Some("greater than zero")),
        ("idempotency", "wait_timeout: 0s", "routes[0].idempotency.wait_timeout", None),
        ("idempotency", "max_request_body: 0", "routes[0].idempotency.max_request_body", Some("greater than zero")),
        ("idempotency", "max_response_body: 0", "routes[0].idempotency.max_response_body", Some("greater than zero")),
        ("idempotency", "retry_statuses: []", "routes[0].idempotency.retry_statuses", None),
        ("idempotency", "scope: []", "routes[0].idempotency.scope", None),
    ];
    let mut failures = Vec::new();
    for (section, line, path, refusal) in rows {
        let yaml = with(section, line);
        match (Config::from_yaml(&yaml), refusal) {
            (Ok(_), None) => {}
            (Ok(_), Some(_)) => failures.push(format!("{path} at zero was accepted")),
            (Err(errs), None) => failures.push(format!("{path} at zero was refused:\n{errs}")),
            (Err(errs), Some(words)) => {
                if !has(&errs, path, &[words]) {
                    failures.push(format!("{path}: no error containing {words:?}:\n{errs}"));
                } else if errs.0.len() != 1 {
                    failures.push(format!("{path}: only that error expected:\n{errs}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn a_response_that_can_never_fit_the_pending_save_bounds_is_refused() {
    // SPEC §4.5: max_response_body over limits.max_pending_save_bytes; both fields named.
    let yaml = with("idempotency", "max_response_body: 100MiB");
    let errs = errors(&yaml);
    assert!(
        has(
            &errs,
            "routes[0].idempotency.max_response_body",
            &[
                "100MiB is more than",
                "limits.max_pending_save_bytes (64MiB)"
            ]
        ),
        "{errs}"
    );
    assert_eq!(errs.0.len(), 1, "{errs}");
    let yaml = with("limits", "max_pending_save_bytes: 4MiB");
    let errs = errors(&yaml);
    assert!(
        has(
            &errs,
            "routes[0].idempotency.max_response_body",
            &["8MiB is more than", "limits.max_pending_save_bytes (4MiB)"]
        ),
        "the default max_response_body over a smaller bound: {errs}"
    );
    // Equal fits.
    let yaml = with("limits", "max_pending_save_bytes: 8MiB");
    Config::from_yaml(&yaml).unwrap_or_else(|e| panic!("8MiB in 8MiB fits: {e}"));
}

#[test]
fn store_timeout_must_be_shorter_than_every_lock_ttl() {
    let yaml = with("store", "timeout: 5s").replace(
        "      required: true\n",
        "      required: true\n      lock_ttl: 100ms\n",
    );
    let errs = errors(&yaml);
    assert!(
        has(
            &errs,
            "routes[0].idempotency.lock_ttl",
            &["store.timeout", "5s", "100ms"]
        ),
        "{errs}"
    );
    assert_eq!(errs.0.len(), 1, "{errs}");
    // Whatever the backend.
    for backend in [
        "backend: redis\n  url: redis://127.0.0.1:6379/0",
        "backend: redis-cluster\n  nodes: [redis://127.0.0.1:7000]",
    ] {
        let yaml = with("store", &format!("{backend}\n  timeout: 2s")).replace(
            "      required: true\n",
            "      required: true\n      lock_ttl: 2s\n",
        );
        let errs = errors(&yaml);
        assert!(
            has(&errs, "routes[0].idempotency.lock_ttl", &["store.timeout"]),
            "equal is not shorter ({backend}): {errs}"
        );
    }
    // Just shorter is accepted; the defaults (500ms against 10s) too.
    let yaml = with("store", "timeout: 99ms").replace(
        "      required: true\n",
        "      required: true\n      lock_ttl: 100ms\n",
    );
    Config::from_yaml(&yaml).unwrap_or_else(|e| panic!("{e}"));
    let c = Config::from_yaml(VALID).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(c.store.timeout, Duration::from_millis(500));
}

/// A lease whose last two thirds are shorter than `store.timeout` is accepted (SPEC §4.5 refuses
/// only `store.timeout` at or past `lock_ttl`) but warned about, naming the route and the field:
/// a renewal as slow as the store's deadline would land after the lease. `--check` prints the
/// warning and still exits 0; the proxy logs it when it starts.
#[test]
fn a_lease_too_short_for_a_slow_renewal_is_warned_about_at_load() {
    let lease = |lock_ttl: &str, timeout: &str| {
        with("store", &format!("timeout: {timeout}")).replace(
            "      required: true\n",
            &format!("      required: true\n      lock_ttl: {lock_ttl}\n"),
        )
    };
    let config = |yaml: &str| Config::from_yaml(yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"));
    let warned = config(&lease("600ms", "590ms")).warnings();
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert_eq!(warned[0].route, "create-booking");
    assert_eq!(warned[0].path, "routes[0].idempotency.lock_ttl");
    for words in ["600ms", "400ms", "store.timeout (590ms)", "885ms"] {
        assert!(warned[0].message.contains(words), "{words}: {}", warned[0]);
    }
    // Two thirds of the lease exactly store.timeout: enough. The defaults: nothing to say.
    assert_eq!(config(&lease("900ms", "600ms")).warnings(), vec![]);
    assert_eq!(config(&lease("899ms", "600ms")).warnings().len(), 1);
    assert_eq!(config(VALID).warnings(), vec![]);

    let file = write_config(&lease("600ms", "590ms"));
    let out = Command::new(binary())
        .arg("--check")
        .arg("--config")
        .arg(file.path())
        .output()
        .expect("run idemproxy --check");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("warning: routes[0].idempotency.lock_ttl: 600ms leaves"),
        "{stderr}"
    );

    let yaml = lease("600ms", "590ms").replace("listen: 127.0.0.1:8080", "listen: 127.0.0.1:0");
    let mut proxy = ProxyProcess::spawn(&yaml);
    let logged = || {
        proxy.log().lines().any(|l| {
            l.contains("WARN")
                && l.contains("route=create-booking")
                && l.contains("field=routes[0].idempotency.lock_ttl")
        })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !logged() {
        assert!(std::time::Instant::now() < deadline, "{}", proxy.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    proxy.signal("-TERM");
    assert_eq!(proxy.wait(Duration::from_secs(15)), Some(0));
}

/// The token file a person writes by hand (`echo "tok " > file`, an editor's trailing space)
/// works from the command line against the server that read the same file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_file_with_surrounding_whitespace_works_from_the_cli() {
    let env = Env::new(Backend::Memory).await;
    let admin_port = harness::free_port();
    let token = write_config("  cli-token \t \n");
    let yaml = env.config("").replace(
        "shutdown_timeout: 10s\n",
        &format!(
            "shutdown_timeout: 10s\nadmin_listen: 127.0.0.1:{admin_port}\nadmin_token_file: {}\n",
            token.path().display()
        ),
    );
    let proxy = ProxyProcess::spawn(&yaml);
    let first = send(
        client()
            .post(proxy.url("/bookings"))
            .header("Idempotency-Key", "ws-token-1")
            .body(r#"{"seat":"1A"}"#),
    )
    .await;
    assert_eq!(first.status, 201);
    let admin = format!("http://127.0.0.1:{admin_port}");
    let show = |token_args: &[&str], env_token: Option<&str>| {
        let mut cmd = Command::new(binary());
        cmd.args([
            "keys",
            "show",
            "--route",
            "create-booking",
            "--key",
            "ws-token-1",
        ])
        .args(token_args)
        .env("IDEMPROXY_ADMIN", &admin)
        .env_remove("IDEMPROXY_ADMIN_TOKEN");
        if let Some(t) = env_token {
            cmd.env("IDEMPROXY_ADMIN_TOKEN", t);
        }
        let out = cmd.output().expect("run idemproxy keys show");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let token_path = token.path().display().to_string();
    let (code, out, err) = show(&["--token-file", &token_path], None);
    assert_eq!(code, Some(0), "the same file on both sides: {err}");
    let doc: serde_json::Value = serde_json::from_str(&out).expect("JSON on stdout");
    assert_eq!(doc["state"], "finished");
    assert_eq!(doc["status"], 201);
    // The token from the environment is trimmed the same way.
    let (code, _, err) = show(&[], Some(" cli-token\n"));
    assert_eq!(code, Some(0), "the token from IDEMPROXY_ADMIN_TOKEN: {err}");
    // And over HTTP, the token is what the file holds without its surrounding whitespace.
    let url = format!("{admin}/keys/create-booking?key=ws-token-1");
    let ok = send(client().get(&url).bearer_auth("cli-token")).await;
    assert_eq!(ok.status, 200, "{:?}", ok.body);
    let (code, _, err) = show(&[], Some("wrong"));
    assert_eq!(code, Some(1), "a wrong token is refused: {err}");
}
