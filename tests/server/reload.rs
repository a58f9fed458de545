//! Reloading the configuration while serving (SPEC §2): SIGHUP, `idemproxy reload` and
//! `Proxy::reload`, against the real listener, the mock upstream and every store.
//!
//! - `records`: requests in flight across a reload, records that follow their route's name
//!   (reordered, renamed, made idempotent), on every store.
//! - `connections`: upstream pools kept or drained, listener limits for new connections, and
//!   twenty reloads under load that drop nothing.
//! - `process`: the binary — an invalid file, a file that needs a restart, `idemproxy reload`
//!   and its pid file, SIGHUP while draining.

mod connections;
mod process;
mod records;

use idemproxy::config::Config;
use idemproxy::proxy::{Changes, Reloaded};

use harness::{Env, TestProxy};

/// `POST /bookings`, idempotent with the defaults.
const BOOKINGS: &str = "  - name: create-booking\n    methods: [POST]\n    path: /bookings\n    upstream: booking\n    idempotency: {}\n";
/// `POST /bookings` passed through (no idempotency).
const PLAIN_BOOKINGS: &str =
    "  - name: create-booking\n    methods: [POST]\n    path: /bookings\n    upstream: booking\n";
/// `/pay/*`, idempotent.
const PAY: &str = "  - name: pay\n    path: /pay/*\n    upstream: booking\n    idempotency: {}\n";
/// Everything else, passed through.
const REST: &str = "  - name: rest\n    path: /*\n    upstream: booking\n";

/// A configuration on `env`'s store, its upstream `booking` the mock (or `upstream_url`), with
/// `top` lines at the top level, `upstream` lines in the upstream and `routes` as the list.
fn yaml_to(env: &Env, upstream_url: &str, top: &str, upstream: &str, routes: &[&str]) -> String {
    format!(
        "listen: 127.0.0.1:0\nworkers: 2\nshutdown_timeout: 10s\n{top}{store}upstreams:\n  booking:\n    url: {upstream_url}\n    connect_timeout: 1s\n    timeout: 5s\n{upstream}routes:\n{routes}",
        store = env.store_yaml(""),
        routes = routes.concat(),
    )
}

/// [`yaml_to`] the mock.
fn yaml(env: &Env, top: &str, upstream: &str, routes: &[&str]) -> String {
    yaml_to(env, &env.mock.url(), top, upstream, routes)
}

/// Reloads `proxy` with `yaml`, which must apply; what changed.
fn reload(proxy: &TestProxy, yaml: &str) -> Changes {
    let config = Config::from_yaml(yaml).unwrap_or_else(|e| panic!("config: {e}\n{yaml}"));
    match proxy.proxy.reload(config) {
        Reloaded::Applied(changes) => changes,
        other => panic!("the reload was not applied: {other:?}"),
    }
}

/// The reloads counted with `result`.
fn reloads(proxy: &TestProxy, result: &str) -> u64 {
    proxy.metric("idemproxy_config_reloads_total", &[("result", result)]) as u64
}
