use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::metrics::Metrics;
use crate::store::StoreHandle;
use crate::store::memory::MemoryStore;

/// A configuration: `routes` is the YAML list under `routes:`, `extra` more top-level lines.
fn config(extra: &str, routes: &str) -> Config {
    let yaml = format!(
        "listen: 127.0.0.1:8080\n{extra}\nupstreams:\n  a:\n    url: http://127.0.0.1:9001\n  b:\n    url: http://127.0.0.1:9002\nroutes:\n{routes}"
    );
    Config::from_yaml(&yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"))
}

const TWO: &str = "  - name: one\n    path: /one\n    upstream: a\n    idempotency: {}\n  - name: two\n    path: /two\n    upstream: b\n";

fn proxy(config: Config) -> Proxy {
    let metrics = Arc::new(Metrics::new());
    let store = StoreHandle::new(
        Arc::new(MemoryStore::new(1000)),
        Duration::from_secs(1),
        metrics.clone(),
    );
    Proxy::new(config, store, metrics)
}

fn number_of(proxy: &Proxy, name: &str) -> u32 {
    let current = proxy.current.load();
    let route = current.routes(0).iter().find(|r| &*r.name == name);
    route.map(|r| r.number).expect(name)
}

#[tokio::test]
async fn route_numbers_follow_names_and_new_names_never_reuse_one() {
    let p = proxy(config("", TWO));
    assert_eq!((number_of(&p, "one"), number_of(&p, "two")), (0, 1));
    // Reordered, one removed, a new one first.
    let reordered = "  - name: three\n    path: /three\n    upstream: a\n  - name: two\n    path: /two\n    upstream: b\n";
    assert!(matches!(
        p.reload(config("", reordered)),
        Reloaded::Applied(_)
    ));
    assert_eq!(number_of(&p, "two"), 1);
    assert_eq!(
        number_of(&p, "three"),
        2,
        "a fresh number, not the removed route's 0"
    );
    // The removed name comes back with its own number.
    assert!(matches!(p.reload(config("", TWO)), Reloaded::Applied(_)));
    assert_eq!((number_of(&p, "one"), number_of(&p, "two")), (0, 1));
}

#[tokio::test]
async fn an_unchanged_upstream_keeps_its_client_and_a_changed_one_gets_a_new_one() {
    let p = proxy(config("", TWO));
    let before = p.current.load_full();
    let changed = config("", TWO);
    let mut changed = changed;
    if let Some(b) = changed.upstreams.get_mut("b") {
        b.timeout = Duration::from_secs(7);
    }
    let Reloaded::Applied(changes) = p.reload(changed) else {
        panic!("not applied");
    };
    let after = p.current.load_full();
    let (before, after) = (&before.tables[0], &after.tables[0]);
    assert!(Arc::ptr_eq(&before.upstreams["a"], &after.upstreams["a"]));
    assert!(!Arc::ptr_eq(&before.upstreams["b"], &after.upstreams["b"]));
    assert_eq!(changes.upstreams_changed, ["b"]);
    assert!(changes.routes_changed.is_empty(), "{changes}");
    // The route on the changed upstream uses the new client.
    let two = after
        .routes
        .iter()
        .find(|r| &*r.name == "two")
        .expect("two");
    assert!(Arc::ptr_eq(&two.upstream, &after.upstreams["b"]));
}

#[test]
fn changes_name_what_was_added_removed_changed_and_reordered() {
    let old = config("", TWO);
    let new = config(
        "limits:\n  send_timeout: 5s",
        "  - name: two\n    path: /two\n    upstream: b\n    idempotency: {}\n  - name: three\n    path: /three\n    upstream: a\n",
    );
    let c = Changes::between(&old, &new);
    assert_eq!(c.routes_added, ["three"]);
    assert_eq!(c.routes_removed, ["one"]);
    assert_eq!(c.routes_changed, ["two"]);
    assert!(!c.routes_reordered, "two is the only route kept");
    assert_eq!(c.other, ["limits.send_timeout"]);
    assert_eq!(
        c.to_string(),
        "routes added: three; routes removed: one; routes changed: two; also changed: limits.send_timeout"
    );
    let swapped = "  - name: two\n    path: /two\n    upstream: b\n  - name: one\n    path: /one\n    upstream: a\n    idempotency: {}\n";
    let c = Changes::between(&old, &config("", swapped));
    assert!(c.routes_reordered && c.routes_changed.is_empty(), "{c}");
    assert_eq!(
        Changes::between(&old, &config("", TWO)).to_string(),
        "nothing changed"
    );
}

#[tokio::test]
async fn a_file_that_needs_a_restart_is_refused_whole_and_counted() {
    let p = proxy(config("", TWO));
    let refused = config(
        "log_format: json\nlimits:\n  max_connections: 5\nstore:\n  backend: memory\n  max_entries: 7",
        "  - name: other\n    path: /other\n    upstream: a\n",
    );
    match p.reload(refused) {
        Reloaded::NeedsRestart(fields) => assert_eq!(
            fields,
            ["store", "log_format", "limits.max_connections"],
            "every field named"
        ),
        other => panic!("{other:?}"),
    }
    // Nothing of it applied: the old routes serve.
    assert_eq!(number_of(&p, "one"), 0);
    assert!(
        p.current
            .load()
            .routes(0)
            .iter()
            .all(|r| &*r.name != "other")
    );
    let mut moved = config("", TWO);
    moved.listen = "127.0.0.1:8081".parse().expect("addr");
    assert!(matches!(p.reload(moved), Reloaded::NeedsRestart(f) if f == ["listen"]));
    let text = p.metrics.encode();
    for (result, n) in [("applied", 0), ("invalid", 0), ("needs_restart", 2)] {
        let series = format!("idemproxy_config_reloads_total{{result=\"{result}\"}} {n}\n");
        assert!(text.contains(&series), "{series} in\n{text}");
    }
}

#[tokio::test]
async fn a_reload_while_draining_is_ignored_and_not_counted() {
    let p = proxy(config("", TWO));
    p.start_draining();
    let other = "  - name: other\n    path: /other\n    upstream: a\n";
    assert!(matches!(p.reload(config("", other)), Reloaded::Draining));
    assert_eq!(number_of(&p, "one"), 0);
    assert!(
        p.metrics
            .encode()
            .contains("idemproxy_config_reloads_total{result=\"applied\"} 0\n")
    );
}

#[tokio::test]
async fn the_listeners_hear_of_each_applied_reload_and_pending_bounds_follow() {
    let p = proxy(config("", TWO));
    let heard = Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = heard.clone();
    p.on_reload(move |c| {
        sink.lock()
            .expect("lock")
            .push(c.limits.header_read_timeout)
    });
    let new = config(
        "limits:\n  header_read_timeout: 3s\n  max_pending_saves: 1\n  max_pending_save_bytes: 8MiB",
        TWO,
    );
    assert!(matches!(p.reload(new), Reloaded::Applied(_)));
    assert_eq!(*heard.lock().expect("lock"), [Duration::from_secs(3)]);
    // The new count bound holds for the next save: one whole result at most.
    let first = p.worker(0).pending.begin("one".into(), "k1".into(), 10);
    let second = p.worker(0).pending.begin("one".into(), "k2".into(), 10);
    assert!(
        first.downgrade.is_cancelled(),
        "the oldest let go of its result"
    );
    assert!(!second.downgrade.is_cancelled());
}

#[tokio::test]
async fn every_worker_has_its_own_clients_and_one_reload_reaches_them_all() {
    let metrics = Arc::new(Metrics::new());
    let store = StoreHandle::new(
        Arc::new(MemoryStore::new(1000)),
        Duration::from_secs(1),
        metrics.clone(),
    );
    let p = Proxy::with_workers(config("", TWO), store.clone(), vec![store], metrics);
    assert_eq!(p.workers(), 2);
    let before = p.current.load_full();
    let (first, second) = (&before.tables[0], &before.tables[1]);
    assert!(
        !Arc::ptr_eq(&first.upstreams["a"], &second.upstreams["a"]),
        "a client (and its pool) a worker"
    );
    let mut changed = config("", TWO);
    if let Some(b) = changed.upstreams.get_mut("b") {
        b.timeout = Duration::from_secs(7);
    }
    assert!(matches!(p.reload(changed), Reloaded::Applied(_)));
    let after = p.current.load_full();
    for worker in 0..2 {
        let (was, now) = (&before.tables[worker], &after.tables[worker]);
        assert!(
            Arc::ptr_eq(&was.upstreams["a"], &now.upstreams["a"]),
            "kept"
        );
        assert!(
            !Arc::ptr_eq(&was.upstreams["b"], &now.upstreams["b"]),
            "new"
        );
        let two = now.routes.iter().find(|r| &*r.name == "two").expect("two");
        assert!(Arc::ptr_eq(&two.upstream, &now.upstreams["b"]), "its own");
        // The same route numbers on every worker: the memory store is theirs together.
        let numbers: Vec<u32> = now.routes.iter().map(|r| r.number).collect();
        assert_eq!(numbers, [0, 1]);
    }
}

#[test]
fn changes_name_each_kept_route_whose_key_or_fingerprint_is_made_another_way() {
    let old = config("", TWO);
    let new = config(
        "",
        "  - name: one\n    path: /one\n    upstream: a\n    idempotency:\n      scope: [X-Tenant]\n      header: X-Request-Key\n      key_from: [method]\n      fingerprint: [body]\n      ttl: 1h\n  - name: two\n    path: /two\n    upstream: b\n    idempotency:\n      scope: []\n",
    );
    let c = Changes::between(&old, &new);
    let named: Vec<(&str, &str)> = c
        .key_changes
        .iter()
        .map(|k| (k.route.as_str(), k.field))
        .collect();
    // `two` was made idempotent: it had no records to lose. `ttl` changes nothing of the key.
    assert_eq!(
        named,
        [
            ("one", "scope"),
            ("one", "header"),
            ("one", "key_from"),
            ("one", "fingerprint")
        ]
    );
    assert_eq!(
        c.to_string(),
        "routes changed: one, two; keys made another way: one.scope, one.header, one.key_from, one.fingerprint"
    );
    let ttl_only = "  - name: one\n    path: /one\n    upstream: a\n    idempotency:\n      ttl: 1h\n  - name: two\n    path: /two\n    upstream: b\n";
    assert!(
        Changes::between(&old, &config("", ttl_only))
            .key_changes
            .is_empty()
    );
}

#[test]
fn a_route_that_becomes_a_json_rpc_route_fingerprints_another_way() {
    // The fingerprint written, so that only the route's kind changes.
    let plain = "  - name: one\n    path: /one\n    upstream: a\n    idempotency:\n      fingerprint: [method, path]\n";
    let jsonrpc = "  - name: one\n    path: /one\n    upstream: a\n    jsonrpc: {methods: [tools/call]}\n    idempotency:\n      fingerprint: [method, path]\n";
    for (from, to) in [(plain, jsonrpc), (jsonrpc, plain)] {
        let c = Changes::between(&config("", from), &config("", to));
        let named: Vec<(&str, &str)> = c
            .key_changes
            .iter()
            .map(|k| (k.route.as_str(), k.field))
            .collect();
        assert_eq!(named, [("one", "fingerprint")]);
    }
}

#[tokio::test]
async fn a_reload_that_makes_keys_another_way_is_applied_and_counted_by_route_and_field() {
    let p = proxy(config("", TWO));
    let new = config(
        "",
        "  - name: one\n    path: /one\n    upstream: a\n    idempotency:\n      scope: []\n      fingerprint: [method, path]\n  - name: two\n    path: /two\n    upstream: b\n",
    );
    let Reloaded::Applied(changes) = p.reload(new) else {
        panic!("applied");
    };
    assert_eq!(changes.key_changes.len(), 2, "{changes}");
    let text = p.metrics.encode();
    for field in ["scope", "fingerprint"] {
        let series = format!(
            "idemproxy_config_reload_key_changes_total{{route=\"one\",field=\"{field}\"}} 1\n"
        );
        assert!(text.contains(&series), "{series} in\n{text}");
    }
    assert!(!text.contains("field=\"header\""), "{text}");
}

/// Only a `workers` the file writes needs a restart: the default, one worker a core, counted
/// again at a reload where the process may use another number of cores (a container whose CPU
/// quota changed), is no change, and the workers running stay.
#[tokio::test]
async fn a_default_workers_counted_again_differently_is_no_change() {
    let p = proxy(config("", TWO));
    let running = p.current.load().config.workers;
    let mut same_file = config("", TWO);
    // The same file, read where the cores counted differ.
    same_file.workers = running + 3;
    assert!(
        matches!(p.reload(same_file), Reloaded::Applied(_)),
        "an unchanged file applies"
    );
    assert_eq!(p.current.load().config.workers, running, "what runs");
    // Written as the number running: nothing to restart. Written otherwise: a restart.
    let written = config(&format!("workers: {running}"), TWO);
    assert!(matches!(p.reload(written), Reloaded::Applied(_)));
    let other = config(&format!("workers: {}", running + 1), TWO);
    assert!(matches!(p.reload(other), Reloaded::NeedsRestart(f) if f == ["workers"]));
}
