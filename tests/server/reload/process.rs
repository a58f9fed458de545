//! The binary: SIGHUP with an invalid file or one that needs a restart (nothing applied, every
//! error logged, counted), `idemproxy reload` through the pid file, and a SIGHUP while
//! draining.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use super::{BOOKINGS, PLAIN_BOOKINGS, REST, yaml};
use harness::{
    Backend, Env, ProxyProcess, Reply, binary, book_with, eventually, free_port, metric_value,
    write_config,
};

/// `top` lines plus an admin listener on `admin`.
fn with_admin(admin: u16, top: &str) -> String {
    format!("admin_listen: 127.0.0.1:{admin}\n{top}")
}

/// The reloads the process at `admin` counted with `result`.
async fn reloads(admin: u16, result: &str) -> u64 {
    let text = reqwest::get(format!("http://127.0.0.1:{admin}/metrics"))
        .await
        .expect("scrape")
        .text()
        .await
        .expect("metrics text");
    metric_value(
        &text,
        "idemproxy_config_reloads_total",
        &[("result", result)],
    ) as u64
}

async fn book(proc: &ProxyProcess, key: &str) -> Reply {
    book_with(&proc.url(""), key, "{}", &[]).await
}

/// Waits until the process has logged `text`.
async fn logged(proc: &ProxyProcess, text: &str) {
    assert!(
        eventually(Duration::from_secs(10), || proc.log().contains(text)).await,
        "the log has no {text:?}:\n{}",
        proc.log()
    );
}

/// `idemproxy reload --config FILE`.
fn reload_command(config: &Path) -> Output {
    Command::new(binary())
        .arg("reload")
        .arg("--config")
        .arg(config)
        .env_remove("IDEMPROXY_CONFIG")
        .output()
        .expect("run idemproxy reload")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_file_keeps_the_routes_in_force_and_logs_every_error() {
    let env = Env::new(Backend::Memory).await;
    let admin = free_port();
    let proc = ProxyProcess::spawn(&yaml(&env, &with_admin(admin, ""), "", &[BOOKINGS, REST]));
    // Two mistakes, and no idempotency on the route: a file that must not apply at all.
    let nowhere = PLAIN_BOOKINGS.replace("upstream: booking", "upstream: nowhere");
    let bad = yaml(
        &env,
        &with_admin(admin, "limits:\n  send_timeout: soon\n"),
        "",
        &[&nowhere, REST],
    );
    proc.rewrite_config(&bad);
    // What --check says of the file is what the reload logs, error for error.
    let check = Command::new(binary())
        .arg("--check")
        .arg("--config")
        .arg(proc.config_path())
        .output()
        .expect("run --check");
    assert_eq!(check.status.code(), Some(2));
    let prefix = format!("{}: ", proc.config_path().display());
    let errors: Vec<String> = stderr(&check)
        .lines()
        .filter(|l| !l.contains("error(s); the configuration is not valid"))
        .filter_map(|l| l.strip_prefix(&prefix).map(str::to_owned))
        .collect();
    assert_eq!(errors.len(), 2, "{}", stderr(&check));
    proc.signal("-HUP");
    logged(&proc, "reload refused: the file is not valid").await;
    for e in &errors {
        assert!(
            proc.log().contains(e.as_str()),
            "{e:?} not logged:\n{}",
            proc.log()
        );
    }
    assert_eq!(reloads(admin, "invalid").await, 1);
    assert_eq!(reloads(admin, "applied").await, 0);
    // The route in force is still idempotent.
    let first = book(&proc, "kept").await;
    assert_eq!(first.status, 201);
    let repeat = book(&proc, "kept").await;
    assert_eq!(repeat.header("idempotent-replayed"), "true");
    assert_eq!(repeat.body, first.body);
    assert_eq!(env.mock.calls("kept"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_listen_is_refused_whole_as_needing_a_restart() {
    let env = Env::new(Backend::Memory).await;
    let admin = free_port();
    let proc = ProxyProcess::spawn(&yaml(&env, &with_admin(admin, ""), "", &[BOOKINGS, REST]));
    let elsewhere = free_port();
    // Valid, but it moves the listener; its route change must not apply either.
    let moved = yaml(&env, &with_admin(admin, ""), "", &[PLAIN_BOOKINGS, REST]).replace(
        "listen: 127.0.0.1:0",
        &format!("listen: 127.0.0.1:{elsewhere}"),
    );
    proc.rewrite_config(&moved);
    proc.signal("-HUP");
    logged(
        &proc,
        "reload refused: listen cannot change while the proxy runs",
    )
    .await;
    assert_eq!(reloads(admin, "needs_restart").await, 1);
    assert_eq!(reloads(admin, "applied").await, 0);
    let first = book(&proc, "still-idempotent").await;
    assert_eq!(first.status, 201);
    let repeat = book(&proc, "still-idempotent").await;
    assert_eq!(
        repeat.header("idempotent-replayed"),
        "true",
        "the old route serves"
    );
    assert_eq!(env.mock.calls("still-idempotent"), 1);
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", elsewhere)).is_err(),
        "nothing listens on the new address"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idemproxy_reload_signals_the_process_its_pid_file_names_and_errs_clearly_otherwise() {
    let env = Env::new(Backend::Memory).await;
    let admin = free_port();
    let dir = tempfile::tempdir().expect("temp dir");
    let pid_path = dir.path().join("idemproxy.pid");
    let top = with_admin(
        admin,
        &format!("pid_file: {}\ndrain_delay: 1s\n", pid_path.display()),
    );
    let mut proc = ProxyProcess::spawn(&yaml(&env, &top, "", &[BOOKINGS, REST]));
    assert!(
        eventually(Duration::from_secs(5), || pid_path.exists()).await,
        "the pid file is written"
    );
    let written = std::fs::read_to_string(&pid_path).expect("read the pid file");
    assert_eq!(written.trim(), proc.pid().to_string());
    assert_eq!(book(&proc, "before").await.status, 201);
    assert_eq!(
        book(&proc, "before").await.header("idempotent-replayed"),
        "true"
    );

    // A file that does not validate: reported as --check reports it, nothing signalled.
    let bad = write_config(&format!(
        "{}\nbogus: 1\n",
        yaml(&env, &top, "", &[BOOKINGS, REST])
    ));
    let out = reload_command(bad.path());
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("bogus"), "{}", stderr(&out));

    // The route made a pass-through: signalled, applied.
    proc.rewrite_config(&yaml(&env, &top, "", &[PLAIN_BOOKINGS, REST]));
    let out = reload_command(proc.config_path());
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains(&format!("pid {}", proc.pid())), "{said}");
    logged(&proc, "configuration reloaded").await;
    assert_eq!(reloads(admin, "applied").await, 1);
    assert_eq!(
        reloads(admin, "invalid").await,
        0,
        "the bad file never reached it"
    );
    assert_eq!(book(&proc, "after").await.status, 201);
    assert_eq!(book(&proc, "after").await.header("idempotent-replayed"), "");
    assert_eq!(env.mock.calls("after"), 2, "passed through now");

    // A SIGHUP while draining (drain_delay) is ignored; the exit is clean, the file removed.
    proc.signal("-TERM");
    logged(&proc, "draining").await;
    proc.signal("-HUP");
    assert_eq!(proc.wait(Duration::from_secs(15)), Some(0));
    assert!(
        proc.log()
            .contains("SIGHUP ignored: the proxy is shutting down"),
        "{}",
        proc.log()
    );
    assert_eq!(
        proc.log()
            .matches("SIGHUP: reloading the configuration")
            .count(),
        1,
        "only idemproxy reload's SIGHUP reloaded"
    );
    assert!(
        !pid_path.exists(),
        "the pid file is removed on a clean exit"
    );

    // No process: the pid file is gone.
    let out = reload_command(proc.config_path());
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("no proxy is running"),
        "{}",
        stderr(&out)
    );
    // A stale file: its process has exited.
    let mut gone = Command::new("true").spawn().expect("run true");
    gone.wait().expect("wait for true");
    std::fs::write(&pid_path, format!("{}\n", gone.id())).expect("write");
    let out = reload_command(proc.config_path());
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("stale pid file"), "{}", stderr(&out));
    // A stale file whose id another program has now: never signalled (SIGHUP would end it).
    let mut other = Command::new("sleep").arg("30").spawn().expect("run sleep");
    std::fs::write(&pid_path, format!("{}\n", other.id())).expect("write");
    let out = reload_command(proc.config_path());
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("not idemproxy"), "{}", stderr(&out));
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        other.try_wait().expect("try_wait").is_none(),
        "sleep still runs"
    );
    let _ = other.kill();
    let _ = other.wait();
    // No pid_file at all.
    let plain = write_config(&yaml(&env, "", "", &[BOOKINGS, REST]));
    let out = reload_command(plain.path());
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("sets no pid_file"),
        "{}",
        stderr(&out)
    );
}

/// A reload that changes how a kept route's key is made is applied (SPEC §2) and says what it
/// does to the route's earlier records: a warning naming the route and the field, counted by
/// both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_makes_keys_another_way_warns_naming_the_route_and_the_field() {
    let env = Env::new(Backend::Memory).await;
    let admin = free_port();
    let proc = ProxyProcess::spawn(&yaml(&env, &with_admin(admin, ""), "", &[BOOKINGS, REST]));
    let rescoped = BOOKINGS.replace("idempotency: {}", "idempotency:\n      scope: [X-Tenant]");
    proc.rewrite_config(&yaml(&env, &with_admin(admin, ""), "", &[&rescoped, REST]));
    proc.signal("-HUP");
    logged(&proc, "configuration reloaded").await;
    let log = proc.log();
    let warning = log
        .lines()
        .find(|l| l.contains("reload: idempotency.scope of route create-booking changed"))
        .unwrap_or_else(|| panic!("no warning:\n{log}"));
    for words in [
        "WARN",
        "route=create-booking",
        "field=scope",
        "out of reach",
    ] {
        assert!(warning.contains(words), "{words}: {warning}");
    }
    assert_eq!(reloads(admin, "applied").await, 1);
    let text = reqwest::get(format!("http://127.0.0.1:{admin}/metrics"))
        .await
        .expect("scrape")
        .text()
        .await
        .expect("metrics text");
    let counted = metric_value(
        &text,
        "idemproxy_config_reload_key_changes_total",
        &[("route", "create-booking"), ("field", "scope")],
    );
    assert_eq!(counted, 1.0, "{text}");
}
