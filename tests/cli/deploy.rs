//! The deployment files — `Dockerfile`, `.dockerignore` and everything under `deploy/` — checked
//! without a container engine or a cluster: what can be known by reading them.
//!
//! - Every YAML file under `deploy/` parses (multi-document files included), and the Grafana
//!   dashboard is JSON with a query in every panel.
//! - Every `idemproxy_*` series a dashboard query or an alert expression names exists in the
//!   exposition of [`Metrics`] with every store's series registered (counters as `_total`,
//!   histograms as `_bucket`, `_sum`, `_count`), with the labels it has and, for `outcome` and
//!   `op`, values the proxy uses.
//! - The compose configuration (`deploy/idemproxy.yaml`) and the Kubernetes ConfigMap's pass
//!   [`Config::from_yaml`]. Their secret files (`/run/secrets/…`) exist only in a container,
//!   so each such path is replaced by a temporary file holding a test secret first.
//! - The Dockerfile's HEALTHCHECK is the exec form of `idemproxy health` against the admin port
//!   those configurations use, its final stage runs as a non-root USER, its stub build covers
//!   every target of Cargo.toml it compiles, and `.dockerignore` lets in what it copies.
//! - Compose and Kubernetes agree with the configuration they mount: paths, ports, secrets,
//!   grace periods; the Kubernetes probes ask `/readyz` and `/healthz` on the admin port.
//! - Every alert has a severity, a summary, a description and a runbook entry in
//!   docs/operations.md; `promtool` checks and unit-tests the rules when it is installed.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use idemproxy::config::Config;
use idemproxy::metrics::{Metrics, Outcome, StoreOp, Unclaimed, Would};
use idemproxy::store::SweptSeries;
use idemproxy::store::memory::MemorySeries;
use idemproxy::store::postgres::PostgresSeries;
use idemproxy::store::redis::RedisSeries;
use idemproxy::store::sqlite::SqliteSeries;
use serde::Deserialize;
use yaml_serde::Value;

// ---------------------------------------------------------------------------------------------
// Reading the files.

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(relative: &str) -> String {
    let path = root().join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {relative}: {e}"))
}

/// Every file under `dir` (recursively) whose name ends in one of `extensions`.
fn files_under(dir: &Path, extensions: &[&str]) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let entries = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()));
        for entry in entries {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                pending.push(path);
            } else if path
                .extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| extensions.contains(&e))
            {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// Every document of a YAML stream (`---`-separated), empty ones left out.
fn yaml_documents(text: &str, name: &str) -> Vec<Value> {
    yaml_serde::Deserializer::from_str(text)
        .map(|doc| {
            Value::deserialize(doc).unwrap_or_else(|e| panic!("{name} is not valid YAML: {e}"))
        })
        .filter(|doc| !doc.is_null())
        .collect()
}

fn yaml(relative: &str) -> Value {
    let mut docs = yaml_documents(&read(relative), relative);
    assert_eq!(docs.len(), 1, "{relative}: one YAML document expected");
    docs.remove(0)
}

/// `value[k1][k2]…`, as a readable panic when absent.
fn at<'a>(value: &'a Value, path: &[&str]) -> &'a Value {
    path.iter().fold(value, |v, k| {
        v.get(*k)
            .unwrap_or_else(|| panic!("no `{}` in {v:?}", path.join(".")))
    })
}

fn text<'a>(value: &'a Value, path: &[&str]) -> &'a str {
    at(value, path)
        .as_str()
        .unwrap_or_else(|| panic!("`{}` is not a string", path.join(".")))
}

fn list<'a>(value: &'a Value, path: &[&str]) -> &'a Vec<Value> {
    at(value, path)
        .as_sequence()
        .unwrap_or_else(|| panic!("`{}` is not a list", path.join(".")))
}

/// Every string in a YAML value, with the key it sits under (if any).
fn yaml_strings<'a>(
    value: &'a Value,
    key: Option<&'a str>,
    out: &mut Vec<(Option<&'a str>, &'a str)>,
) {
    match value {
        Value::String(s) => out.push((key, s)),
        Value::Sequence(items) => items.iter().for_each(|v| yaml_strings(v, key, out)),
        Value::Mapping(map) => {
            for (k, v) in map {
                yaml_strings(v, k.as_str(), out);
            }
        }
        Value::Tagged(tagged) => yaml_strings(&tagged.value, key, out),
        _ => {}
    }
}

/// Every string in a JSON value, with the key it sits under (if any).
fn json_strings<'a>(
    value: &'a serde_json::Value,
    key: Option<&'a str>,
    out: &mut Vec<(Option<&'a str>, &'a str)>,
) {
    match value {
        serde_json::Value::String(s) => out.push((key, s)),
        serde_json::Value::Array(items) => items.iter().for_each(|v| json_strings(v, key, out)),
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                json_strings(v, Some(k), out);
            }
        }
        _ => {}
    }
}

// ---------------------------------------------------------------------------------------------
// Configurations that name secret files.

/// A configuration's text with every `…_file: /run/secrets/…` path replaced by a temporary file
/// holding a test secret (the real files exist only inside a container), and those files.
fn with_test_secrets(config: &str) -> (String, Vec<tempfile::NamedTempFile>) {
    let mut files = Vec::new();
    let mut out = String::new();
    for line in config.lines() {
        let secret_path = line
            .split_once(':')
            .filter(|(key, _)| key.trim_start().ends_with("_file"))
            .map(|(_, value)| value.trim())
            .filter(|value| value.starts_with("/run/secrets/"));
        match secret_path {
            Some(path) => {
                let file = tempfile::NamedTempFile::new().expect("a temporary secret file");
                std::fs::write(file.path(), "test-secret\n").expect("write the test secret");
                out.push_str(&line.replace(path, &file.path().display().to_string()));
                files.push(file);
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    (out, files)
}

/// Loads a configuration with its secret files stood in for; panics with every error.
fn load_config(config: &str, name: &str) -> Config {
    let (config, _files) = with_test_secrets(config);
    Config::from_yaml(&config).unwrap_or_else(|e| panic!("{name} does not load:\n{e}"))
}

/// The secret files a configuration names, as (field, path).
fn secret_files(config: &str) -> Vec<(String, String)> {
    config
        .lines()
        .filter_map(|line| line.split_once(':'))
        .map(|(key, value)| (key.trim().to_owned(), value.trim().to_owned()))
        .filter(|(key, value)| key.ends_with("_file") && value.starts_with("/run/secrets/"))
        .collect()
}

fn admin_listen(config: &Config, name: &str) -> SocketAddr {
    config
        .admin_listen
        .unwrap_or_else(|| panic!("{name}: no admin_listen, so no health checks and no metrics"))
}

// ---------------------------------------------------------------------------------------------
// The metrics exposition, and the PromQL that names it.

/// The series names the proxy exposes, with their label names, and its family names.
struct Exposition {
    /// Series name (`idemproxy_requests_total`, `…_bucket`) → label names seen on it (empty
    /// when the family has no series yet).
    series: BTreeMap<String, BTreeSet<String>>,
    families: BTreeSet<String>,
}

fn exposition() -> Exposition {
    let metrics = Metrics::new();
    // Each store registers its own series when it is opened: register every store's here, as
    // each would, so that the exposition holds them all.
    let _ = metrics.store_series::<MemorySeries>();
    let _ = metrics.store_series::<SqliteSeries>();
    let _ = metrics.store_series::<PostgresSeries>();
    let _ = metrics.store_series::<RedisSeries>();
    let _ = metrics.store_series::<SweptSeries>();
    // Register one of each labelled series, so that their label names show.
    let route = metrics.route("create-booking");
    route.request(Outcome::Forwarded, Duration::from_millis(1));
    let _ = metrics.observed("create-booking");
    let _ = metrics.upstream("booking");
    metrics.store_op(StoreOp::Claim, Duration::from_millis(1), false);
    let text = metrics.encode();

    let mut series: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut families = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut words = rest.split_whitespace();
            let (Some(name), Some(kind)) = (words.next(), words.next()) else {
                panic!("unreadable TYPE line: {line}");
            };
            families.insert(name.to_owned());
            let suffixes: &[&str] = match kind {
                "counter" => &["_total"],
                "histogram" => &["_bucket", "_sum", "_count"],
                "gauge" | "unknown" => &[""],
                other => panic!("metric kind {other} of {name}: teach this test about it"),
            };
            for suffix in suffixes {
                series.entry(format!("{name}{suffix}")).or_default();
            }
        } else if !line.starts_with('#') && !line.is_empty() {
            let name_end = line.find(['{', ' ']).unwrap_or(line.len());
            let labels = series.entry(line[..name_end].to_owned()).or_default();
            if let Some(inside) = line[name_end..]
                .strip_prefix('{')
                .and_then(|l| l.split_once('}'))
                .map(|(inside, _)| inside)
            {
                for matcher in matchers(inside) {
                    labels.insert(matcher.label);
                }
            }
        }
    }
    assert!(
        series.contains_key("idemproxy_requests_total"),
        "the exposition has no idemproxy_requests_total:\n{text}"
    );
    Exposition { series, families }
}

/// One label matcher of a selector: `label op "value"`.
#[derive(Debug)]
struct Matcher {
    label: String,
    op: String,
    value: String,
}

/// The matchers inside `{…}` (also the label pairs of an exposition line).
fn matchers(inside: &str) -> Vec<Matcher> {
    let mut out = Vec::new();
    let mut rest = inside;
    loop {
        rest = rest.trim_start_matches(|c: char| c == ',' || c.is_whitespace());
        if rest.is_empty() {
            return out;
        }
        let name_len = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        let label = rest[..name_len].to_owned();
        rest = rest[name_len..].trim_start();
        let op = ["=~", "!~", "!=", "="]
            .into_iter()
            .find(|op| rest.starts_with(op))
            .unwrap_or_else(|| panic!("no matcher operator after {label:?} in {{{inside}}}"));
        rest = rest[op.len()..].trim_start();
        let Some(quoted) = rest.strip_prefix('"') else {
            panic!("unquoted value for {label:?} in {{{inside}}}");
        };
        let mut value = String::new();
        let mut chars = quoted.char_indices();
        let end = loop {
            match chars.next() {
                Some((_, '\\')) => {
                    if let Some((_, c)) = chars.next() {
                        value.push(c);
                    }
                }
                Some((i, '"')) => break i,
                Some((_, c)) => value.push(c),
                None => panic!("unterminated value for {label:?} in {{{inside}}}"),
            }
        };
        rest = &quoted[end + 1..];
        out.push(Matcher {
            label,
            op: op.to_owned(),
            value,
        });
    }
}

/// Every `idemproxy_*` name in `text`, with the matchers of the selector that follows it.
fn metric_references(text: &str) -> Vec<(String, Vec<Matcher>)> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(found) = text[from..].find("idemproxy_") {
        let start = from + found;
        let boundary = text[..start]
            .chars()
            .next_back()
            .is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '/'));
        let len = text[start..]
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(text.len() - start);
        let end = start + len;
        from = end;
        if !boundary {
            continue;
        }
        let selector = text[end..]
            .strip_prefix('{')
            .and_then(|rest| rest.split_once('}'))
            .map(|(inside, _)| matchers(inside))
            .unwrap_or_default();
        out.push((text[start..end].to_owned(), selector));
    }
    out
}

/// The label values a matcher may name: the proxy's own for `outcome` and `op`.
fn known_values(label: &str) -> Option<Vec<&'static str>> {
    match label {
        "outcome" => Some(Outcome::ALL.iter().map(|o| o.as_str()).collect()),
        "op" => Some(StoreOp::ALL.iter().map(|o| o.as_str()).collect()),
        "would" => Some(Would::ALL.iter().map(|w| w.as_str()).collect()),
        "reason" => Some(Unclaimed::ALL.iter().map(|u| u.as_str()).collect()),
        _ => None,
    }
}

/// Checks every metric named in `strings`: in a query (`strict`) a series name with the labels
/// it has; in prose, a series or family name. Returns what is wrong.
fn check_references(
    exposition: &Exposition,
    strings: &[(bool, String, &str)],
) -> (Vec<String>, BTreeSet<String>) {
    let mut wrong = Vec::new();
    let mut used = BTreeSet::new();
    for (strict, place, text) in strings {
        for (name, selector) in metric_references(text) {
            let Some(labels) = exposition.series.get(&name) else {
                if !*strict && exposition.families.contains(&name) {
                    continue;
                }
                wrong.push(format!(
                    "{place}: `{name}` is not a series the proxy exposes (counters end in _total; \
                     histograms are _bucket, _sum, _count)"
                ));
                continue;
            };
            used.insert(name.clone());
            for m in &selector {
                let known_label = labels.is_empty()
                    || labels.contains(&m.label)
                    || ["job", "instance"].contains(&m.label.as_str());
                if !known_label {
                    wrong.push(format!(
                        "{place}: `{name}` has no label `{}` (it has {labels:?})",
                        m.label
                    ));
                }
                let Some(values) = known_values(&m.label) else {
                    continue;
                };
                if !(m.op == "=" || m.op == "=~") || m.value.contains('$') {
                    continue;
                }
                for v in m.value.split('|') {
                    if !values.contains(&v) {
                        wrong.push(format!(
                            "{place}: `{name}{{{}{}\"{}\"}}`: {v:?} is not a value of `{}` ({values:?})",
                            m.label, m.op, m.value, m.label
                        ));
                    }
                }
            }
        }
    }
    (wrong, used)
}

// ---------------------------------------------------------------------------------------------
// The Dockerfile.

/// The Dockerfile's instructions (continuation lines joined, comments left out), as
/// (INSTRUCTION, arguments).
fn dockerfile() -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in read("Dockerfile").lines() {
        let trimmed = line.trim();
        if trimmed.starts_with('#') || (trimmed.is_empty() && current.is_empty()) {
            continue;
        }
        match trimmed.strip_suffix('\\') {
            Some(part) => {
                current.push_str(part);
                current.push(' ');
            }
            None => {
                current.push_str(trimmed);
                let (instruction, args) = current.split_once(' ').unwrap_or((&current, ""));
                out.push((instruction.to_uppercase(), args.trim().to_owned()));
                current.clear();
            }
        }
    }
    out
}

/// The instructions of the final stage (after the last FROM).
fn final_stage(instructions: &[(String, String)]) -> &[(String, String)] {
    let last_from = instructions
        .iter()
        .rposition(|(i, _)| i == "FROM")
        .expect("the Dockerfile has a FROM");
    &instructions[last_from..]
}

/// Parses an exec-form (JSON array) command.
fn exec_form(args: &str, what: &str) -> Vec<String> {
    serde_json::from_str(args)
        .unwrap_or_else(|e| panic!("{what} must be the exec form (a JSON array): {args}: {e}"))
}

/// The configuration compose mounts into each proxy replica.
const COMPOSE_CONFIG: &str = "deploy/idemproxy.yaml";

// ---------------------------------------------------------------------------------------------
// The tests.

#[test]
fn every_yaml_file_under_deploy_parses() {
    let files = files_under(&root().join("deploy"), &["yaml", "yml"]);
    for expected in [
        "deploy/compose.yaml",
        "deploy/idemproxy.yaml",
        "deploy/kubernetes.yaml",
        "deploy/prometheus/alerts.yaml",
    ] {
        assert!(
            files.contains(&root().join(expected)),
            "{expected} is missing"
        );
    }
    for file in files {
        let name = file.display().to_string();
        let text = std::fs::read_to_string(&file).expect("read a deploy file");
        let docs = yaml_documents(&text, &name);
        assert!(!docs.is_empty(), "{name} holds no YAML document");
    }
    let k8s = yaml_documents(&read("deploy/kubernetes.yaml"), "deploy/kubernetes.yaml");
    assert!(
        k8s.len() >= 4,
        "kubernetes.yaml: ConfigMap, Secret, Deployment, Service at least"
    );
}

#[test]
fn the_dashboard_is_json_with_a_query_in_every_panel() {
    let dashboard: serde_json::Value = serde_json::from_str(&read("deploy/grafana/idemproxy.json"))
        .expect("deploy/grafana/idemproxy.json is valid JSON");
    assert!(dashboard["uid"].is_string() && dashboard["title"].is_string());
    let panels = dashboard["panels"].as_array().expect("a panels array");
    let mut ids = BTreeSet::new();
    let mut queries = 0;
    for panel in panels {
        let title = panel["title"].as_str().expect("every panel has a title");
        assert!(
            ids.insert(panel["id"].as_u64()),
            "panel id repeated: {title}"
        );
        assert!(panel["gridPos"].is_object(), "{title}: no gridPos");
        if panel["type"] == "row" {
            continue;
        }
        let targets = panel["targets"].as_array().expect("a panel has targets");
        assert!(!targets.is_empty(), "{title}: no query");
        for target in targets {
            let expr = target["expr"].as_str().unwrap_or_default();
            assert!(
                expr.contains("idemproxy_"),
                "{title}: query {expr:?} names no idemproxy metric"
            );
            queries += 1;
        }
    }
    assert!(queries >= 10, "the dashboard has only {queries} queries");
    // No two panels share a cell of Grafana's 24-column grid.
    let mut cells = BTreeMap::new();
    for panel in panels {
        let title = panel["title"].as_str().unwrap_or_default();
        let at = |k: &str| panel["gridPos"][k].as_u64().expect("gridPos x, y, w, h");
        for x in at("x")..at("x") + at("w") {
            for y in at("y")..at("y") + at("h") {
                if let Some(other) = cells.insert((x, y), title) {
                    panic!("panels {other:?} and {title:?} overlap at x={x}, y={y}");
                }
            }
        }
    }
}

#[test]
fn every_metric_in_the_dashboard_and_the_alerts_is_exposed() {
    let exposition = exposition();
    let dashboard: serde_json::Value = serde_json::from_str(&read("deploy/grafana/idemproxy.json"))
        .expect("deploy/grafana/idemproxy.json is valid JSON");
    let alerts = yaml("deploy/prometheus/alerts.yaml");

    let mut json = Vec::new();
    json_strings(&dashboard, None, &mut json);
    let mut yml = Vec::new();
    yaml_strings(&alerts, None, &mut yml);
    // Queries must name series; prose (titles, descriptions) may name a family.
    let query_keys = ["expr", "query", "definition"];
    let strings: Vec<(bool, String, &str)> = json
        .iter()
        .map(|(key, s)| {
            let strict = key.is_some_and(|k| query_keys.contains(&k));
            (strict, format!("idemproxy.json {}", key.unwrap_or("")), *s)
        })
        .chain(yml.iter().map(|(key, s)| {
            let strict = *key == Some("expr");
            (strict, format!("alerts.yaml {}", key.unwrap_or("")), *s)
        }))
        .collect();
    let (wrong, used) = check_references(&exposition, &strings);
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    for needed in [
        "idemproxy_requests_total",
        "idemproxy_request_duration_seconds_bucket",
        "idemproxy_upstream_duration_seconds_bucket",
        "idemproxy_store_operation_duration_seconds_bucket",
        "idemproxy_store_errors_total",
        "idemproxy_lost_leases_total",
        "idemproxy_saves_abandoned_total",
        "idemproxy_pending_saves",
        "idemproxy_unprotected_requests_total",
        "idemproxy_memory_store_records",
        "idemproxy_detached_exchanges",
        "idemproxy_observed_total",
        "idemproxy_observed_unclaimed_total",
    ] {
        assert!(
            used.contains(needed),
            "neither the dashboard nor the alerts use {needed}"
        );
    }
}

#[test]
fn the_reference_check_catches_wrong_names_labels_and_values() {
    let exposition = exposition();
    let cases = [
        "rate(idemproxy_requests[5m])",
        "idemproxy_request_duration_seconds{route=\"a\"}",
        "rate(idemproxy_requests_total{outcome=\"replay\"}[5m])",
        "rate(idemproxy_requests_total{outcome=~\"forwarded|nope\"}[5m])",
        "rate(idemproxy_store_errors_total{route=\"a\"}[5m])",
        "rate(idemproxy_store_errors_total{op=\"set\"}[5m])",
        "rate(idemproxy_observed_total{would=\"replayed\"}[5m])",
        "rate(idemproxy_observed_unclaimed_total{reason=\"huge\"}[5m])",
    ];
    for case in cases {
        let (wrong, _) = check_references(&exposition, &[(true, "case".into(), case)]);
        assert!(!wrong.is_empty(), "not caught: {case}");
    }
    let good = "sum by (le) (rate(idemproxy_request_duration_seconds_bucket{job=~\"$job\", \
                route=~\"$route\", outcome=~\"forwarded|replayed\"}[5m]))";
    let (wrong, _) = check_references(&exposition, &[(true, "good".into(), good)]);
    assert!(wrong.is_empty(), "{wrong:?}");
    // In prose a family name is fine.
    let prose = "compare with idemproxy_upstream_duration_seconds";
    let (wrong, _) = check_references(&exposition, &[(false, "prose".into(), prose)]);
    assert!(wrong.is_empty(), "{wrong:?}");
}

#[test]
fn every_alert_has_a_severity_a_summary_and_a_runbook_entry() {
    let alerts = yaml("deploy/prometheus/alerts.yaml");
    let operations = read("docs/operations.md");
    let anchors: BTreeSet<String> = operations
        .lines()
        .filter_map(|l| l.strip_prefix('#'))
        .map(|heading| github_anchor(heading.trim_start_matches('#')))
        .collect();
    let mut names = BTreeSet::new();
    for group in list(&alerts, &["groups"]) {
        for rule in list(group, &["rules"]) {
            let name = text(rule, &["alert"]);
            assert!(names.insert(name.to_owned()), "alert {name} defined twice");
            assert!(
                !text(rule, &["expr"]).trim().is_empty(),
                "{name}: empty expr"
            );
            let severity = text(rule, &["labels", "severity"]);
            assert!(
                ["critical", "warning", "info"].contains(&severity),
                "{name}: severity {severity}"
            );
            for field in ["summary", "description"] {
                assert!(
                    !text(rule, &["annotations", field]).is_empty(),
                    "{name}: no {field}"
                );
            }
            let runbook = text(rule, &["annotations", "runbook"]);
            let anchor = runbook
                .strip_prefix("docs/operations.md#")
                .unwrap_or_else(|| {
                    panic!("{name}: runbook {runbook} is not in docs/operations.md")
                });
            assert!(
                anchors.contains(anchor),
                "{name}: docs/operations.md has no heading for #{anchor}"
            );
            assert_eq!(
                anchor,
                name.to_lowercase(),
                "{name}: its runbook heading is its name"
            );
        }
    }
    assert!(names.len() >= 10, "only {} alerts", names.len());
}

/// GitHub's anchor for a Markdown heading: lower case, spaces to `-`, punctuation dropped.
fn github_anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// Whether this runs under CI: the `CI` variable that CI services set (to `true`, or `1`).
fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && v != "false")
}

/// `promtool` checks and unit-tests the alert rules. Under CI a missing `promtool` fails the
/// test (`scripts/test` installs it); on a workstation without it, the skip is said loudly.
#[test]
fn promtool_checks_and_unit_tests_the_alert_rules_when_installed() {
    let dir = root().join("deploy/prometheus");
    let Ok(version) = Command::new("promtool").arg("--version").output() else {
        assert!(
            !in_ci(),
            "promtool is not installed, and CI is set: the alert rules would go unchecked \
             (scripts/test installs it: Debian's prometheus package)"
        );
        eprintln!(
            "\n*** SKIPPED: promtool is not installed, so `promtool check rules` and \
             `promtool test rules` did not run (CI is not set; ./scripts/test installs it) ***\n"
        );
        return;
    };
    assert!(version.status.success());
    for args in [
        ["check", "rules", "alerts.yaml"],
        ["test", "rules", "alerts.test.yaml"],
    ] {
        let out = Command::new("promtool")
            .args(args)
            .current_dir(&dir)
            .output()
            .expect("run promtool");
        assert!(
            out.status.success(),
            "promtool {}:\n{}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn the_compose_configuration_loads_and_listens_where_the_healthcheck_asks() {
    let config = load_config(&read(COMPOSE_CONFIG), COMPOSE_CONFIG);
    assert!(
        config.listen.ip().is_unspecified(),
        "in a container the proxy must listen on every interface, not {}",
        config.listen
    );
    let admin = admin_listen(&config, COMPOSE_CONFIG);
    assert!(
        admin.ip().is_unspecified() || admin.ip().is_loopback(),
        "the HEALTHCHECK asks 127.0.0.1: admin_listen {admin} does not listen there"
    );
    let healthcheck = dockerfile()
        .into_iter()
        .find(|(i, _)| i == "HEALTHCHECK")
        .expect("the Dockerfile has a HEALTHCHECK");
    assert!(
        healthcheck
            .1
            .contains(&format!("http://127.0.0.1:{}", admin.port())),
        "the HEALTHCHECK does not ask the admin port {} of {COMPOSE_CONFIG}",
        admin.port()
    );
    assert!(
        matches!(
            config.store.backend,
            idemproxy::config::BackendSettings::Redis { .. }
        ),
        "the replicas must share Redis, not each keep a memory store"
    );
}

#[test]
fn the_dockerfile_healthcheck_is_the_exec_form_of_idemproxy_health() {
    let instructions = dockerfile();
    let stage = final_stage(&instructions);
    let (_, args) = stage
        .iter()
        .find(|(i, _)| i == "HEALTHCHECK")
        .expect("the final stage has a HEALTHCHECK");
    let cmd = args
        .split_once("CMD ")
        .map(|(_, cmd)| cmd.trim())
        .unwrap_or_else(|| panic!("HEALTHCHECK without CMD: {args}"));
    let argv = exec_form(cmd, "HEALTHCHECK CMD");
    assert_eq!(
        argv.first().map(String::as_str),
        Some("/usr/local/bin/idemproxy")
    );
    assert_eq!(argv.get(1).map(String::as_str), Some("health"), "{argv:?}");
    let copied_to = stage
        .iter()
        .filter(|(i, _)| i == "COPY")
        .any(|(_, a)| a.ends_with(" /usr/local/bin/idemproxy"));
    assert!(
        copied_to,
        "the final stage does not install /usr/local/bin/idemproxy"
    );
    for (instruction, args) in stage {
        if instruction == "ENTRYPOINT" || instruction == "CMD" {
            exec_form(args, instruction);
        }
    }
}

#[test]
fn the_dockerfile_runs_as_a_non_root_user_and_exposes_both_ports() {
    let instructions = dockerfile();
    let stage = final_stage(&instructions);
    let user = stage
        .iter()
        .rev()
        .find(|(i, _)| i == "USER")
        .map(|(_, a)| a.clone())
        .expect("the final stage sets a USER");
    let name = user.split(':').next().unwrap_or_default();
    assert!(
        !["root", "0", ""].contains(&name),
        "the image runs as root: USER {user}"
    );
    let exposed: BTreeSet<&str> = stage
        .iter()
        .filter(|(i, _)| i == "EXPOSE")
        .flat_map(|(_, a)| a.split_whitespace())
        .collect();
    let config = load_config(&read(COMPOSE_CONFIG), COMPOSE_CONFIG);
    for port in [
        config.listen.port(),
        admin_listen(&config, COMPOSE_CONFIG).port(),
    ] {
        assert!(
            exposed.contains(port.to_string().as_str()),
            "port {port} is not EXPOSEd ({exposed:?})"
        );
    }
}

#[test]
fn the_dockerfile_stub_build_covers_the_manifest_and_dockerignore_lets_in_what_it_copies() {
    // Cargo refuses a manifest whose lib or bin sources are missing: the dependency layer
    // must stub every one of them.
    let manifest = read("Cargo.toml");
    let docker = read("Dockerfile");
    let mut section = String::new();
    let mut stubbed = 0;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line.to_owned();
        } else if let Some(path) = line
            .strip_prefix("path = \"")
            .and_then(|p| p.strip_suffix('"'))
            .filter(|_| section == "[lib]" || section == "[[bin]]")
        {
            assert!(
                docker.contains(&format!("> {path};")),
                "the Dockerfile's dependency layer has no stub for {section} {path}"
            );
            stubbed += 1;
        }
    }
    assert!(
        stubbed >= 3,
        "lib, idemproxy and mock-upstream: {stubbed} found"
    );
    for build_only in ["[[bench]]", "[[test]]", "[[example]]"] {
        let dropped = build_only.trim_start_matches("[[").trim_end_matches("]]");
        assert!(
            docker.contains(dropped),
            "the Dockerfile does not drop {build_only} sections from the manifest copy"
        );
    }

    let ignore = read(".dockerignore");
    let allowed: BTreeSet<&str> = ignore
        .lines()
        .filter_map(|l| l.trim().strip_prefix('!'))
        .map(|p| p.trim_end_matches('/'))
        .collect();
    assert!(
        ignore.lines().any(|l| l.trim() == "*"),
        ".dockerignore is an allowlist: it starts by excluding everything"
    );
    for (instruction, args) in dockerfile() {
        if instruction != "COPY" || args.starts_with("--from") {
            continue;
        }
        let words: Vec<&str> = args.split_whitespace().collect();
        for source in &words[..words.len() - 1] {
            let source = source.trim_end_matches('/');
            assert!(
                allowed.contains(source),
                ".dockerignore keeps {source} out of the build context, but the Dockerfile copies it"
            );
        }
    }
}

#[test]
fn compose_mounts_the_configuration_and_the_secret_it_names() {
    let compose = yaml("deploy/compose.yaml");
    let config_text = read(COMPOSE_CONFIG);
    let config = load_config(&config_text, COMPOSE_CONFIG);
    let proxy = at(&compose, &["services", "proxy"]);

    let replicas = at(proxy, &["deploy", "replicas"])
        .as_u64()
        .expect("replicas");
    assert!(replicas >= 2, "two proxy replicas on one Redis");

    // The file passed as --config is the one mounted from deploy/idemproxy.yaml.
    let command: Vec<&str> = list(proxy, &["command"])
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let config_path = command
        .iter()
        .position(|a| *a == "--config")
        .and_then(|i| command.get(i + 1))
        .expect("the proxy's command passes --config");
    let volumes: Vec<&str> = list(proxy, &["volumes"])
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        volumes
            .iter()
            .any(|v| v.starts_with("./idemproxy.yaml:") && v.contains(&format!(":{config_path}"))),
        "{config_path} is not mounted from ./idemproxy.yaml: {volumes:?}"
    );

    // Each secret file the configuration names is a compose secret mounted there.
    let secrets: Vec<&str> = list(proxy, &["secrets"])
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let files = secret_files(&config_text);
    assert!(
        !files.is_empty(),
        "the admin token comes from a secret file"
    );
    for (field, path) in files {
        let name = path
            .strip_prefix("/run/secrets/")
            .expect("a compose secret path");
        assert!(
            secrets.contains(&name),
            "{field}: {path} is not a secret of the proxy service"
        );
        assert!(
            at(&compose, &["secrets", name, "file"]).as_str().is_some(),
            "secret {name} has no file"
        );
    }

    // The drain is never cut short by SIGKILL.
    let grace = humantime::parse_duration(text(proxy, &["stop_grace_period"]))
        .expect("stop_grace_period is a duration");
    assert!(
        grace > config.shutdown_timeout,
        "stop_grace_period {grace:?} must exceed shutdown_timeout {:?}",
        config.shutdown_timeout
    );

    // The proxies reach the services the configuration names.
    assert!(at(&compose, &["services"]).get("redis").is_some());
    let mock: Vec<&str> = list(&compose, &["services", "mock-upstream", "command"])
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(mock, ["--listen", "0.0.0.0:8081"]);

    // Redis: never evict a record, and keep them across restarts.
    let redis_conf = read("deploy/redis.conf");
    let settings: Vec<&str> = redis_conf
        .lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#'))
        .collect();
    for needed in [
        "maxmemory-policy noeviction",
        "appendonly yes",
        "appendfsync everysec",
    ] {
        assert!(
            settings.contains(&needed),
            "deploy/redis.conf lacks `{needed}`"
        );
    }

    // Prometheus scrapes the admin port.
    let prometheus = yaml("deploy/prometheus/prometheus.yml");
    let scrape = &list(&prometheus, &["scrape_configs"])[0];
    assert_eq!(text(scrape, &["job_name"]), "idemproxy");
    let port = at(&list(scrape, &["dns_sd_configs"])[0], &["port"]).as_u64();
    assert_eq!(
        port,
        Some(u64::from(admin_listen(&config, COMPOSE_CONFIG).port()))
    );
}

/// The Kubernetes objects of `deploy/kubernetes.yaml`, by kind.
fn kubernetes() -> BTreeMap<String, Value> {
    let mut objects = BTreeMap::new();
    for doc in yaml_documents(&read("deploy/kubernetes.yaml"), "deploy/kubernetes.yaml") {
        let kind = text(&doc, &["kind"]).to_owned();
        assert!(
            objects.insert(kind.clone(), doc).is_none(),
            "two {kind} objects"
        );
    }
    objects
}

#[test]
fn kubernetes_probes_ask_the_admin_listener_and_the_config_map_loads() {
    let objects = kubernetes();
    let config_map = &objects["ConfigMap"];
    let config_text = text(config_map, &["data", "config.yaml"]);
    let config = load_config(config_text, "the ConfigMap's config.yaml");
    let admin = admin_listen(&config, "the ConfigMap's config.yaml");
    assert!(
        admin.ip().is_unspecified(),
        "kubelet probes the pod IP: admin_listen {admin}"
    );

    let deployment = &objects["Deployment"];
    let replicas = at(deployment, &["spec", "replicas"])
        .as_u64()
        .expect("replicas");
    assert!(replicas >= 2, "two replicas at least");
    let pod = at(deployment, &["spec", "template", "spec"]);
    let containers = list(pod, &["containers"]);
    assert_eq!(containers.len(), 1);
    let container = &containers[0];

    // The admin port, by name and number.
    let ports = list(container, &["ports"]);
    let port_name = |number: u16| {
        ports
            .iter()
            .find(|p| at(p, &["containerPort"]).as_u64() == Some(u64::from(number)))
            .map(|p| text(p, &["name"]).to_owned())
            .unwrap_or_else(|| panic!("no containerPort {number}"))
    };
    let admin_port = port_name(admin.port());
    let proxy_port = port_name(config.listen.port());
    for (probe, path) in [("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")] {
        let get = at(container, &[probe, "httpGet"]);
        assert_eq!(text(get, &["path"]), path, "{probe}");
        let port = at(get, &["port"]);
        assert!(
            port.as_str() == Some(admin_port.as_str())
                || port.as_u64() == Some(u64::from(admin.port())),
            "{probe} asks port {port:?}, not the admin port {admin_port} ({})",
            admin.port()
        );
    }

    // The drain: the grace period covers the preStop sleep and shutdown_timeout.
    let grace = at(pod, &["terminationGracePeriodSeconds"])
        .as_u64()
        .expect("a grace period");
    let pre_stop = container
        .get("lifecycle")
        .and_then(|l| l.get("preStop"))
        .and_then(|p| p.get("sleep"))
        .and_then(|s| s.get("seconds"))
        .and_then(Value::as_u64)
        .unwrap_or(0);
    assert!(
        Duration::from_secs(grace) > config.shutdown_timeout + Duration::from_secs(pre_stop),
        "terminationGracePeriodSeconds {grace} <= preStop {pre_stop}s + shutdown_timeout {:?}",
        config.shutdown_timeout
    );

    // Non-root, read-only, bounded.
    assert_eq!(
        at(pod, &["securityContext", "runAsNonRoot"]).as_bool(),
        Some(true)
    );
    let security = at(container, &["securityContext"]);
    assert_eq!(
        at(security, &["readOnlyRootFilesystem"]).as_bool(),
        Some(true)
    );
    assert_eq!(
        at(security, &["allowPrivilegeEscalation"]).as_bool(),
        Some(false)
    );
    for kind in ["requests", "limits"] {
        for resource in ["cpu", "memory"] {
            at(container, &["resources", kind, resource]);
        }
    }

    // --config names the ConfigMap's key, mounted where it says.
    let args: Vec<&str> = list(container, &["args"])
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let config_path = args
        .iter()
        .position(|a| *a == "--config")
        .and_then(|i| args.get(i + 1))
        .expect("args pass --config");
    let (dir, file) = config_path
        .rsplit_once('/')
        .expect("an absolute --config path");
    let mounts = list(container, &["volumeMounts"]);
    let volumes = list(pod, &["volumes"]);
    let volume_at = |dir: &str| {
        let mount = mounts
            .iter()
            .find(|m| text(m, &["mountPath"]) == dir)
            .unwrap_or_else(|| panic!("nothing is mounted at {dir}"));
        let name = text(mount, &["name"]);
        volumes
            .iter()
            .find(|v| text(v, &["name"]) == name)
            .unwrap_or_else(|| panic!("no volume {name}"))
    };
    let config_volume = volume_at(dir);
    assert_eq!(
        text(config_volume, &["configMap", "name"]),
        text(config_map, &["metadata", "name"])
    );
    assert!(
        at(config_map, &["data"]).get(file).is_some(),
        "the ConfigMap has no key {file}"
    );

    // Each secret file the configuration names is a key of the Secret, mounted there.
    let secret = &objects["Secret"];
    let files = secret_files(config_text);
    let fields: BTreeSet<&str> = files.iter().map(|(f, _)| f.as_str()).collect();
    assert!(
        fields.contains("admin_token_file") && fields.contains("password_file"),
        "the admin token and the Redis password come from the Secret: {fields:?}"
    );
    for (field, path) in &files {
        let (dir, key) = path.rsplit_once('/').expect("an absolute secret path");
        let volume = volume_at(dir);
        assert_eq!(
            text(volume, &["secret", "secretName"]),
            text(secret, &["metadata", "name"]),
            "{field}"
        );
        let has_key = ["stringData", "data"]
            .iter()
            .any(|section| secret.get(*section).and_then(|s| s.get(key)).is_some());
        assert!(has_key, "{field}: the Secret has no key {key}");
    }

    // The Service exposes the proxy, never the admin listener; Prometheus scrapes the latter.
    let service_ports = list(&objects["Service"], &["spec", "ports"]);
    for port in service_ports {
        let target = at(port, &["targetPort"]);
        assert!(
            target.as_str() == Some(proxy_port.as_str())
                || target.as_u64() == Some(u64::from(config.listen.port())),
            "the Service targets {target:?}, not the proxy port"
        );
    }
    let scrape_port = text(
        deployment,
        &[
            "spec",
            "template",
            "metadata",
            "annotations",
            "prometheus.io/port",
        ],
    );
    assert_eq!(scrape_port, admin.port().to_string());
}

#[test]
fn the_operations_guide_links_resolve() {
    let guide = read("docs/operations.md");
    let anchors: BTreeSet<String> = guide
        .lines()
        .filter_map(|l| l.strip_prefix('#'))
        .map(|heading| github_anchor(heading.trim_start_matches('#')))
        .collect();
    let mut rest = guide.as_str();
    let mut checked = 0;
    while let Some(start) = rest.find("](") {
        let after = &rest[start + 2..];
        let end = after.find(')').expect("a closed link");
        let target = &after[..end];
        rest = &after[end..];
        if let Some(anchor) = target.strip_prefix('#') {
            assert!(
                anchors.contains(anchor),
                "docs/operations.md: no heading for #{anchor}"
            );
        } else if let Some(path) = target.strip_prefix("../") {
            let path = path.split('#').next().unwrap_or(path);
            assert!(
                root().join(path).exists(),
                "docs/operations.md links to missing {path}"
            );
        }
        checked += 1;
    }
    assert!(checked >= 10, "only {checked} links");
}
