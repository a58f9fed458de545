//! SPEC §3: the configuration file. Every invalid configuration is refused with an error that
//! names the field path and says why; validation reports every error at once; a minimal file
//! gets the documented defaults; `config.example.yaml` is valid and shows those defaults.

mod bounds;
mod grpc;
mod jsonrpc;
mod webhook;

use std::time::Duration;

use http::HeaderName;
use idemproxy::config::{
    BackendSettings, Config, ConfigErrors, FingerprintPart, LogFormat, Mode, OnConflict,
    OnStoreError, OnUnknownOutcome,
};

/// A valid file: one upstream, one idempotent route. Rows below change one thing in it.
const VALID: &str = "\
listen: 127.0.0.1:8080
upstreams:
  booking:
    url: http://127.0.0.1:8081
routes:
  - name: create-booking
    methods: [POST]
    path: /bookings
    upstream: booking
    idempotency:
      required: true
";

/// [`VALID`] with `lines` as the route's `idempotency:` settings (one a line).
fn idem(lines: &str) -> String {
    let mut out = VALID.replace("      required: true\n", "");
    for line in lines.lines() {
        out.push_str("      ");
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// [`VALID`] with `text` (whole top-level lines) added before `upstreams:`.
fn top(text: &str) -> String {
    VALID.replace("upstreams:\n", &format!("{text}\nupstreams:\n"))
}

/// [`VALID`] with a `store:` section made of `lines` (one a line).
fn store(lines: &str) -> String {
    let mut s = "store:".to_owned();
    for line in lines.lines() {
        s.push_str("\n  ");
        s.push_str(line);
    }
    top(&s)
}

/// [`VALID`] with the upstream's settings replaced by `lines` (one a line).
fn upstream(lines: &str) -> String {
    let mut s = String::new();
    for line in lines.lines() {
        s.push_str("    ");
        s.push_str(line);
        s.push('\n');
    }
    VALID.replace("    url: http://127.0.0.1:8081\n", &s)
}

/// A file whose `routes:` section is `routes` (already indented).
fn routes(routes: &str) -> String {
    format!(
        "listen: 127.0.0.1:8080\nupstreams:\n  booking:\n    url: http://127.0.0.1:8081\nroutes:\n{routes}"
    )
}

/// The one route of [`VALID`] with `path:` replaced.
fn path(p: &str) -> String {
    VALID.replace("path: /bookings", &format!("path: {p}"))
}

/// The errors of a file that must be refused (a panic if it is accepted).
pub(crate) fn errors(yaml: &str) -> ConfigErrors {
    match Config::from_yaml(yaml) {
        Ok(_) => panic!("this configuration must be refused:\n{yaml}"),
        Err(e) => e,
    }
}

/// Whether some error sits at `path` and contains every one of `words`.
pub(crate) fn has(errs: &ConfigErrors, path: &str, words: &[&str]) -> bool {
    errs.0
        .iter()
        .any(|e| e.path == path && words.iter().all(|w| e.to_string().contains(w)))
}

/// A readable file that holds no PEM at all.
const NOT_PEM: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");

/// One row: the file, the field path its error must name ("" for the document itself), and
/// words the error must contain.
struct Row {
    what: &'static str,
    yaml: String,
    path: &'static str,
    words: &'static [&'static str],
}

fn row(
    what: &'static str,
    yaml: String,
    path: &'static str,
    words: &'static [&'static str],
) -> Row {
    Row {
        what,
        yaml,
        path,
        words,
    }
}

#[rustfmt::skip]
fn table() -> Vec<Row> {
    vec![
        // Unknown fields, at every level.
        row("unknown top-level field", top("colour: blue"), "colour", &["unknown field", "colour"]),
        row("unknown idempotency field", idem("ttll: 3s"), "routes[0].idempotency.ttll", &["unknown field", "ttll"]),
        row("unknown store field", store("backend: memory\nsize: 3"), "store.size", &["unknown field", "size"]),
        row("unknown upstream field", upstream("url: http://127.0.0.1:8081\nretries: 3"), "upstreams.booking.retries", &["unknown field", "retries"]),
        row("unknown route field", VALID.replace("    upstream: booking", "    upstream: booking\n    timeout: 3s"), "routes[0].timeout", &["unknown field", "timeout"]),
        // listen.
        row("missing listen", VALID.replace("listen: 127.0.0.1:8080\n", ""), "listen", &["missing field", "listen"]),
        row("listen without a port", VALID.replace("listen: 127.0.0.1:8080", "listen: 127.0.0.1"), "listen", &["invalid socket address", "127.0.0.1"]),
        row("listen not an address", VALID.replace("listen: 127.0.0.1:8080", "listen: everywhere"), "listen", &["invalid socket address", "everywhere"]),
        // Durations and sizes.
        row("duration without a unit", idem("ttl: 30"), "routes[0].idempotency.ttl", &["invalid duration", "30", "unit"]),
        row("duration that is not one", idem("ttl: soon"), "routes[0].idempotency.ttl", &["invalid duration", "soon"]),
        row("duration without a unit at the top", top("shutdown_timeout: 5"), "shutdown_timeout", &["invalid duration", "unit"]),
        row("store timeout not a duration", store("timeout: fast"), "store.timeout", &["invalid duration", "fast"]),
        row("upstream timeout not a duration", upstream("url: http://127.0.0.1:8081\ntimeout: 1 fortnight"), "upstreams.booking.timeout", &["invalid duration"]),
        row("size with an unknown unit", idem("max_request_body: 12 parsecs"), "routes[0].idempotency.max_request_body", &["invalid size", "12 parsecs"]),
        row("negative size", idem("max_response_body: -1"), "routes[0].idempotency.max_response_body", &["invalid size", "-1"]),
        row("size that overflows", idem("max_request_body: 99999999999999GiB"), "routes[0].idempotency.max_request_body", &["invalid size"]),
        // Upper bounds: a duration or size past any real use would overflow a deadline.
        row("ttl over a year", idem("ttl: 400days"), "routes[0].idempotency.ttl", &["too long", "at most 365d"]),
        row("ttl that overflows any clock", idem("ttl: 500000000years"), "routes[0].idempotency.ttl", &["too long"]),
        row("lock_ttl over a day", idem("lock_ttl: 2days"), "routes[0].idempotency.lock_ttl", &["too long", "1d"]),
        row("wait_timeout over an hour", idem("on_conflict: wait\nwait_timeout: 2h"), "routes[0].idempotency.wait_timeout", &["too long", "1h"]),
        row("request body over 1GiB", idem("max_request_body: 2GiB"), "routes[0].idempotency.max_request_body", &["2GiB is too large", "at most 1GiB"]),
        row("response body over 1GiB", idem("max_response_body: 2GiB"), "routes[0].idempotency.max_response_body", &["too large"]),
        row("shutdown_timeout over an hour", top("shutdown_timeout: 2h"), "shutdown_timeout", &["too long", "1h"]),
        row("store timeout over a minute", store("timeout: 2m"), "store.timeout", &["too long", "1m"]),
        row("max_entries over 100 million", store("max_entries: 200000000"), "store.max_entries", &["too large"]),
        row("upstream timeout over an hour", upstream("url: http://127.0.0.1:8081\ntimeout: 2h"), "upstreams.booking.timeout", &["too long"]),
        row("connect_timeout over 5 minutes", upstream("url: http://127.0.0.1:8081\nconnect_timeout: 6m"), "upstreams.booking.connect_timeout", &["too long", "5m"]),
        row("pool_idle_timeout over an hour", upstream("url: http://127.0.0.1:8081\npool_idle_timeout: 2h"), "upstreams.booking.pool_idle_timeout", &["too long"]),
        row("header_read_timeout over 10 minutes", top("limits:\n  header_read_timeout: 1h"), "limits.header_read_timeout", &["too long", "10m"]),
        row("zero body_read_timeout", top("limits:\n  body_read_timeout: 0s"), "limits.body_read_timeout", &["greater than zero"]),
        row("zero max_connections", top("limits:\n  max_connections: 0"), "limits.max_connections", &["at least 1"]),
        // workers.
        row("zero workers", top("workers: 0"), "workers", &["0: must be from 1 to 256"]),
        row("more workers than the bound", top("workers: 1000"), "workers", &["1000: must be from 1 to 256"]),
        row("workers not a number", top("workers: all"), "workers", &["invalid type", "all"]),
        row("max_pending_save_bytes over 16GiB", top("limits:\n  max_pending_save_bytes: 17GiB"), "limits.max_pending_save_bytes", &["too large"]),
        row("unknown limits field", top("limits:\n  max_bananas: 3"), "limits.max_bananas", &["unknown field", "max_bananas"]),
        // key_from (SPEC 4.1).
        row("key_from naming a segment the path lacks", idem("key_from: [\"path:ticket_id\"]"), "routes[0].idempotency.key_from[0]", &["path:ticket_id", "no segment", "/bookings"]),
        row("key_from with a malformed pointer", idem("key_from: [\"json:reason/code\"]"), "routes[0].idempotency.key_from[0]", &["invalid JSON pointer", "RFC 6901"]),
        row("key_from with a bad pointer escape", idem("key_from: [\"json:/a~2b\"]"), "routes[0].idempotency.key_from[0]", &["~0 or ~1"]),
        row("key_from with an unknown kind", idem("key_from: [\"cookie:session\"]"), "routes[0].idempotency.key_from[0]", &["unknown key_from part kind", "cookie"]),
        row("key_from with a bare word", idem("key_from: [\"ticket\"]"), "routes[0].idempotency.key_from[0]", &["unknown key_from part"]),
        row("key_from with an invalid header name", idem("key_from: [\"header:bad header\"]"), "routes[0].idempotency.key_from[0]", &["invalid header name"]),
        row("path parameter named twice", path("/a/{x}/b/{x}"), "routes[0].path", &["appears twice"]),
        // Zero and too-small values.
        row("zero ttl", idem("ttl: 0s"), "routes[0].idempotency.ttl", &["greater than zero"]),
        row("zero shutdown_timeout", top("shutdown_timeout: 0s"), "shutdown_timeout", &["greater than zero"]),
        row("zero store timeout", store("timeout: 0ms"), "store.timeout", &["greater than zero"]),
        row("zero connect_timeout", upstream("url: http://127.0.0.1:8081\nconnect_timeout: 0s"), "upstreams.booking.connect_timeout", &["greater than zero"]),
        row("zero upstream timeout", upstream("url: http://127.0.0.1:8081\ntimeout: 0s"), "upstreams.booking.timeout", &["greater than zero"]),
        // SPEC §4.4: the connection is made within what is left of `timeout`, so a connect_timeout
        // as long never ends as a connect failure; the default 2s counts as written.
        row("connect_timeout as long as timeout", upstream("url: http://127.0.0.1:8081\nconnect_timeout: 3s\ntimeout: 3s"), "upstreams.booking.connect_timeout", &["3s", "must be shorter than upstreams.booking.timeout (3s)"]),
        row("connect_timeout longer than timeout", upstream("url: http://127.0.0.1:8081\nconnect_timeout: 5s\ntimeout: 800ms"), "upstreams.booking.connect_timeout", &["5s", "upstreams.booking.timeout (800ms)"]),
        row("the default connect_timeout with a 2s timeout", upstream("url: http://127.0.0.1:8081\ntimeout: 2s"), "upstreams.booking.connect_timeout", &["2s (the default, as it is not set) must be shorter", "upstreams.booking.timeout (2s)"]),
        row("the default connect_timeout with a 500ms timeout", upstream("url: http://127.0.0.1:8081\ntimeout: 500ms"), "upstreams.booking.connect_timeout", &["2s (the default, as it is not set) must be shorter", "upstreams.booking.timeout (500ms)"]),
        row("lock_ttl too small", idem("lock_ttl: 10ms"), "routes[0].idempotency.lock_ttl", &["at least"]),
        row("zero wait_timeout with wait", idem("on_conflict: wait\nwait_timeout: 0s"), "routes[0].idempotency.wait_timeout", &["greater than zero", "wait"]),
        row("zero max_request_body", idem("max_request_body: 0"), "routes[0].idempotency.max_request_body", &["greater than zero"]),
        row("zero max_entries", store("backend: memory\nmax_entries: 0"), "store.max_entries", &["at least 1"]),
        row("empty key_prefix", store("key_prefix: \"\""), "store.key_prefix", &["must not be empty"]),
        // Routes.
        row("no routes at all", VALID.split("routes:").next().unwrap_or_default().to_owned(), "routes", &["no routes"]),
        row("empty route list", routes("  []\n"), "routes", &["no routes"]),
        row("duplicate route names", routes("  - name: a\n    path: /a\n    upstream: booking\n  - name: a\n    path: /b\n    upstream: booking\n"), "routes[1].name", &["duplicate route name", "\"a\""]),
        row("route name with a space", VALID.replace("name: create-booking", "name: \"create booking\""), "routes[0].name", &["invalid route name", "create booking"]),
        row("route name with a colon", VALID.replace("name: create-booking", "name: \"a:b\""), "routes[0].name", &["invalid route name", "a:b"]),
        row("empty route name", VALID.replace("name: create-booking", "name: \"\""), "routes[0].name", &["invalid route name"]),
        row("route missing its path", VALID.replace("    path: /bookings\n", ""), "routes[0].path", &["missing field", "path"]),
        row("route referencing an unknown upstream", VALID.replace("upstream: booking", "upstream: billing"), "routes[0].upstream", &["unknown upstream", "billing", "booking"]),
        row("path without a leading slash", path("bookings"), "routes[0].path", &["invalid path", "start with '/'"]),
        row("star in the middle of a path", path("/a/*/b"), "routes[0].path", &["invalid path", "last segment"]),
        row("parameter not a whole segment", path("/x{id}"), "routes[0].path", &["invalid path", "{id}"]),
        row("empty parameter", path("/a/{}"), "routes[0].path", &["invalid path"]),
        row("empty segment", path("/a//b"), "routes[0].path", &["invalid path", "empty segment"]),
        row("path not a string", path("[a, b]"), "routes[0].path", &["invalid type"]),
        row("method with a space", VALID.replace("methods: [POST]", "methods: [POST, \"GE T\"]"), "routes[0].methods[1]", &["invalid HTTP method", "GE T"]),
        row("empty method", VALID.replace("methods: [POST]", "methods: [\"\"]"), "routes[0].methods[0]", &["invalid HTTP method"]),
        row("empty method list", VALID.replace("methods: [POST]", "methods: []"), "routes[0].methods", &["empty"]),
        // Header names.
        row("bad key header name", idem("header: \"Idempotency Key\""), "routes[0].idempotency.header", &["invalid header name", "Idempotency Key"]),
        row("bad scope header name", idem("scope: [Authorization, \"X Tenant\"]"), "routes[0].idempotency.scope[1]", &["invalid header name", "X Tenant"]),
        row("bad fingerprint header name", idem("fingerprint: [method, \"header:X Tenant\"]"), "routes[0].idempotency.fingerprint[1]", &["invalid header name", "X Tenant"]),
        row("unknown fingerprint part", idem("fingerprint: [method, colour]"), "routes[0].idempotency.fingerprint[1]", &["unknown fingerprint part", "colour", "header:NAME"]),
        // Statuses.
        row("retry status above 599", idem("retry_statuses: [429, 700]"), "routes[0].idempotency.retry_statuses[1]", &["invalid HTTP status", "700", "100 to 599"]),
        row("retry status below 100", idem("retry_statuses: [99]"), "routes[0].idempotency.retry_statuses[0]", &["invalid HTTP status", "99"]),
        row("negative retry status", idem("retry_statuses: [-1]"), "routes[0].idempotency.retry_statuses[0]", &["-1"]),
        // Upstream URLs.
        row("ftp upstream", upstream("url: ftp://127.0.0.1:8081"), "upstreams.booking.url", &["invalid upstream URL", "ftp://"]),
        row("upstream without a host", upstream("url: \"http://\""), "upstreams.booking.url", &["invalid upstream URL"]),
        row("upstream with a query", upstream("url: http://127.0.0.1:8081/api?x=1"), "upstreams.booking.url", &["invalid upstream URL", "query"]),
        row("upstream that is only a path", upstream("url: /api"), "upstreams.booking.url", &["invalid upstream URL", "/api"]),
        row("upstream missing its url", upstream("timeout: 3s"), "upstreams.booking.url", &["missing field", "url"]),
        // Redis.
        row("redis url with another scheme", store("backend: redis\nurl: http://127.0.0.1:6379"), "store.url", &["invalid Redis URL", "redis://"]),
        row("redis url that does not parse", store("backend: redis\nurl: \"redis://:x@[zz/0\""), "store.url", &["invalid Redis URL"]),
        // Enums.
        row("on_conflict bogus", idem("on_conflict: sometimes"), "routes[0].idempotency.on_conflict", &["unknown variant", "sometimes", "reject", "wait"]),
        row("on_store_error bogus", idem("on_store_error: ignore"), "routes[0].idempotency.on_store_error", &["unknown variant", "ignore", "forward"]),
        row("on_unknown_outcome bogus", idem("on_unknown_outcome: guess"), "routes[0].idempotency.on_unknown_outcome", &["unknown variant", "guess", "keep", "release"]),
        row("mode bogus", idem("mode: audit"), "routes[0].idempotency.mode", &["unknown variant", "audit", "enforce", "observe"]),
        row("log_format bogus", top("log_format: xml"), "log_format", &["unknown variant", "xml", "text", "json"]),
        row("pid_file empty", top("pid_file: \"  \""), "pid_file", &["file path"]),
        row("backend bogus", store("backend: mysql"), "store.backend", &["unknown variant", "mysql", "memory", "sqlite", "postgres", "redis"]),
        row("required not a bool", idem("required: sometimes"), "routes[0].idempotency.required", &["invalid type"]),
        // Not supported yet.
        row("admin_listen not an address", top("admin_listen: nine-oh-nine-oh"), "admin_listen", &["invalid socket address"]),
        row("admin_listen equal to listen", top("admin_listen: 127.0.0.1:8080"), "admin_listen", &["must differ from listen"]),
        row("admin token file unreadable", top("admin_listen: 127.0.0.1:9090\nadmin_token_file: /nonexistent/token"), "admin_token_file", &["cannot read", "/nonexistent/token"]),
        row("admin token env unset", top("admin_listen: 127.0.0.1:9090\nadmin_token_env: IDEMPROXY_TEST_UNSET_TOKEN_VAR"), "admin_token_env", &["IDEMPROXY_TEST_UNSET_TOKEN_VAR", "not set"]),
        row("admin token from both a file and env", top("admin_listen: 127.0.0.1:9090\nadmin_token_file: /etc/hostname\nadmin_token_env: HOME"), "admin_token_file", &["not both"]),
        row("admin token without admin_listen", top("admin_token_env: HOME"), "admin_listen", &["no admin_listen"]),
        row("admin token inline", top("admin_token: s3cret"), "admin_token", &["unknown field"]),
        // Redis settings on the wrong backend, and the store's other bounds.
        row("wait_replicas on memory", store("wait_replicas: 1"), "store.wait_replicas", &["Redis setting"]),
        row("wait_replicas on redis-cluster", store("backend: redis-cluster\nnodes: [redis://127.0.0.1:7000]\nwait_replicas: 1"), "store.wait_replicas", &["not supported with backend redis-cluster"]),
        row("wait_replicas too large", store("backend: redis\nwait_replicas: 17"), "store.wait_replicas", &["too large", "16"]),
        row("redis-cluster without nodes", store("backend: redis-cluster"), "store.nodes", &["at least one seed node"]),
        row("nodes on memory", store("nodes: [redis://127.0.0.1:7000]"), "store.nodes", &["Redis setting"]),
        row("nodes on redis", store("backend: redis\nnodes: [redis://127.0.0.1:7000]"), "store.nodes", &["redis-cluster"]),
        row("url on redis-cluster", store("backend: redis-cluster\nurl: redis://127.0.0.1:7000\nnodes: [redis://127.0.0.1:7000]"), "store.url", &["store.nodes"]),
        row("node with another scheme", store("backend: redis-cluster\nnodes: [redis://127.0.0.1:7000, http://127.0.0.1:7001]"), "store.nodes[1]", &["invalid Redis URL", "redis://"]),
        row("nodes with mixed TLS", store("backend: redis-cluster\nnodes: [redis://127.0.0.1:7000, rediss://127.0.0.1:7001]"), "store.nodes", &["TLS"]),
        row("redis password file unreadable", store("backend: redis\npassword_file: /nonexistent/redis-password"), "store.password_file", &["cannot read", "/nonexistent/redis-password"]),
        row("redis password env unset", store("backend: redis\npassword_env: IDEMPROXY_TEST_UNSET_REDIS_PASSWORD"), "store.password_env", &["IDEMPROXY_TEST_UNSET_REDIS_PASSWORD", "not set"]),
        row("redis password from a file and env", store("backend: redis\npassword_file: /etc/hostname\npassword_env: HOME"), "store.password_file", &["not both"]),
        row("redis password in the url and a file", store("backend: redis\nurl: redis://:inline@127.0.0.1:6379/0\npassword_file: /etc/hostname"), "store.password_file", &["already carries a password"]),
        row("redis password inline", store("backend: redis\npassword: s3cret"), "store.password", &["unknown field"]),
        row("redis password file on memory", store("password_file: /etc/hostname"), "store.password_file", &["Redis and PostgreSQL setting", "not read by backend memory"]),
        row("redis ca_file unreadable", store("backend: redis\nurl: rediss://127.0.0.1:6380/0\nca_file: /nonexistent/redis-ca.pem"), "store.ca_file", &["cannot read", "/nonexistent/redis-ca.pem"]),
        row("redis ca_file not PEM", store(concat!("backend: redis\nurl: rediss://127.0.0.1:6380/0\nca_file: ", env!("CARGO_MANIFEST_DIR"), "/Cargo.toml")), "store.ca_file", &["no PEM certificate", "Cargo.toml"]),
        row("redis ca_file without rediss", store("backend: redis\nca_file: /nonexistent/redis-ca.pem"), "store.ca_file", &["rediss://"]),
        // The durable stores: each setting only on the backend that reads it, and its bounds.
        row("path on memory", store("path: /tmp/records.db"), "store.path", &["SQLite setting", "not read by backend memory"]),
        row("sync on redis", store("backend: redis\nsync: normal"), "store.sync", &["SQLite setting", "not read by backend redis"]),
        row("sync bogus", store("backend: sqlite\npath: /tmp/r.db\nsync: sometimes"), "store.sync", &["unknown variant", "normal", "full"]),
        row("sqlite in memory", store("backend: sqlite\npath: \":memory:\""), "store.path", &["path of a file"]),
        row("schema on sqlite", store("backend: sqlite\npath: /tmp/r.db\nschema: x"), "store.schema", &["PostgreSQL setting", "not read by backend sqlite"]),
        row("sweep_interval on redis", store("backend: redis\nsweep_interval: 1s"), "store.sweep_interval", &["SQLite and PostgreSQL setting"]),
        row("sweep_interval zero", store("backend: sqlite\npath: /tmp/r.db\nsweep_interval: 0s"), "store.sweep_interval", &["greater than zero"]),
        row("postgres without url", store("backend: postgres"), "store.url", &["needs store.url"]),
        row("postgres url of another scheme", store("backend: postgres\nurl: mysql://u@127.0.0.1/db"), "store.url", &["postgres://"]),
        row("postgres url without user", store("backend: postgres\nurl: postgres://127.0.0.1:5432/db"), "store.url", &["no user"]),
        row("postgres bad sslmode", store("backend: postgres\nurl: postgres://u@127.0.0.1/db?sslmode=sometimes"), "store.url", &["invalid PostgreSQL URL"]),
        row("postgres schema not plain", store("backend: postgres\nurl: postgres://u@127.0.0.1/db\nschema: Bad-Name"), "store.schema", &["plain identifier"]),
        row("postgres pool_size zero", store("backend: postgres\nurl: postgres://u@127.0.0.1/db\npool_size: 0"), "store.pool_size", &["from 1 to 1000"]),
        row("postgres password in url and file", store("backend: postgres\nurl: postgres://u:pw@127.0.0.1/db\npassword_file: /etc/hostname"), "store.password_file", &["already carries a password"]),
        row("postgres ca_file without tls", store("backend: postgres\nurl: postgres://u@127.0.0.1/db\nca_file: /nonexistent/pg-ca.pem"), "store.ca_file", &["sslmode=require"]),
        row("wait_replicas on postgres", store("backend: postgres\nurl: postgres://u@127.0.0.1/db\nwait_replicas: 1"), "store.wait_replicas", &["synchronous replication"]),
        // TLS files (tests/server/tls.rs has the rows that need real certificates).
        row("tls cert_file unreadable", top("tls:\n  cert_file: /nonexistent/cert.pem\n  key_file: /nonexistent/key.pem"), "tls.cert_file", &["cannot read", "/nonexistent/cert.pem"]),
        row("tls key_file unreadable", top("tls:\n  cert_file: /nonexistent/cert.pem\n  key_file: /nonexistent/key.pem"), "tls.key_file", &["cannot read", "/nonexistent/key.pem"]),
        row("tls cert_file not PEM", top(&format!("tls:\n  cert_file: {NOT_PEM}\n  key_file: {NOT_PEM}")), "tls.cert_file", &["no certificate", "Cargo.toml"]),
        row("tls key_file not PEM", top(&format!("tls:\n  cert_file: {NOT_PEM}\n  key_file: {NOT_PEM}")), "tls.key_file", &["no private key", "Cargo.toml"]),
        row("tls without key_file", top("tls:\n  cert_file: /nonexistent/cert.pem"), "tls.key_file", &["missing field", "key_file"]),
        row("unknown tls field", top("tls:\n  cert_file: a\n  key_file: b\n  ciphers: all"), "tls.ciphers", &["unknown field", "ciphers"]),
        row("ca_file unreadable", upstream("url: https://127.0.0.1:8443\nca_file: /nonexistent/ca.pem"), "upstreams.booking.ca_file", &["cannot read", "/nonexistent/ca.pem"]),
        row("ca_file not PEM", upstream(&format!("url: https://127.0.0.1:8443\nca_file: {NOT_PEM}")), "upstreams.booking.ca_file", &["no certificate", "Cargo.toml"]),
        row("ca_file on an http upstream", upstream("url: http://127.0.0.1:8081\nca_file: /nonexistent/ca.pem"), "upstreams.booking.ca_file", &["https://"]),
        // The document itself.
        row("empty file", String::new(), "", &["empty", "listen"]),
        row("only whitespace", "  \n\n".to_owned(), "", &["empty", "listen"]),
        row("only a comment", "# nothing here\n".to_owned(), "listen", &["listen"]),
        row("a list instead of a mapping", "- listen: 127.0.0.1:8080\n".to_owned(), "", &["invalid type"]),
        row("duplicate key", top("listen: 127.0.0.1:9999"), "listen", &["duplicate", "listen", "line 2 column 1"]),
    ]
}

/// `routes[0].idempotency.ttl` → `routes`, `routes[0]`, `routes[0].idempotency`, and itself.
fn path_prefixes(path: &str) -> Vec<&str> {
    let mut out: Vec<&str> = path
        .char_indices()
        .filter(|(i, c)| *i > 0 && matches!(c, '.' | '['))
        .map(|(i, _)| &path[..i])
        .collect();
    if !path.is_empty() {
        out.push(path);
    }
    out
}

#[test]
fn every_invalid_configuration_is_refused_with_its_field_path_and_reason() {
    let rows = table();
    assert!(rows.len() >= 25);
    let mut failures = Vec::new();
    for r in &rows {
        let errs = match Config::from_yaml(&r.yaml) {
            Ok(_) => {
                failures.push(format!("[{}] was accepted:\n{}", r.what, r.yaml));
                continue;
            }
            Err(e) => e,
        };
        let shown = errs.to_string();
        let hit = errs.0.iter().find(|e| {
            e.path == r.path && {
                let text = e.to_string();
                r.words.iter().all(|w| text.contains(w))
            }
        });
        match hit {
            None => failures.push(format!(
                "[{}] no error at path {:?} containing {:?}; got:\n{shown}",
                r.what, r.path, r.words
            )),
            Some(e) => {
                let text = e.to_string();
                if !r.path.is_empty() && !text.starts_with(&format!("{}: ", r.path)) {
                    failures.push(format!(
                        "[{}] the error does not start with its field path: {text}",
                        r.what
                    ));
                }
                // The field is named once: no second, coarser path before the message.
                if let Some(prefix) = path_prefixes(r.path)
                    .into_iter()
                    .find(|p| e.message.starts_with(&format!("{p}: ")))
                {
                    failures.push(format!(
                        "[{}] the message repeats the path {prefix:?}: {text}",
                        r.what
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn a_yaml_syntax_error_gives_line_and_column() {
    // Line 7 opens a flow sequence that never closes; the parser notices on line 8.
    let yaml = VALID.replace("methods: [POST]", "methods: [POST");
    assert_eq!(yaml.lines().nth(6), Some("    methods: [POST"));
    let errs = errors(&yaml);
    assert_eq!(errs.0.len(), 1, "{errs}");
    assert_eq!(errs.0[0].path, "routes[0].methods");
    let text = errs.to_string();
    assert!(text.contains("line 8 column"), "{text}");

    // A stray `]` on line 7.
    let errs = errors(&VALID.replace("methods: [POST]", "methods: [POST]]"));
    assert_eq!(errs.0[0].path, "routes[0]", "{errs}");
    assert!(errs.to_string().contains("line 7 column"), "{errs}");

    // A tab where indentation is expected, on line 4.
    let yaml = "listen: 127.0.0.1:8080\nupstreams:\n  booking:\n\turl: http://127.0.0.1:8081\n";
    let text = errors(yaml).to_string();
    assert!(text.contains("line 4 column"), "{text}");

    // A mapping value where none is allowed, on line 2.
    let text = errors("listen: 127.0.0.1:8080\n  bad: indent\n").to_string();
    assert!(text.contains("line 2 column"), "{text}");

    // An unterminated quoted string opened on line 6.
    let yaml = "listen: 127.0.0.1:8080\nupstreams:\n  booking:\n    url: http://127.0.0.1:8081\nroutes:\n  - name: \"create-booking\n";
    let text = errors(yaml).to_string();
    assert!(text.contains("line 6 column"), "{text}");
}

#[test]
fn serde_errors_give_the_line_of_the_offending_field() {
    // `ttll` is on line 12 of this file.
    let yaml = idem("ttl: 24h\nttll: 3s");
    assert_eq!(yaml.lines().nth(11), Some("      ttll: 3s"), "{yaml}");
    let errs = errors(&yaml);
    assert_eq!(errs.0[0].path, "routes[0].idempotency.ttll");
    assert!(errs.to_string().contains("line 12 column"), "{errs}");
}

/// What `--check` prints for `yaml`'s first error, whole.
fn first_error(yaml: &str) -> String {
    let errs = errors(yaml);
    let first = errs.0.first().expect("an error");
    format!("{}: {}", first.path, first.message)
}

#[test]
fn a_value_that_does_not_read_is_reported_at_its_own_line_and_column() {
    // At the top level: not "line 1 column 1", where the document's mapping starts.
    let yaml = VALID.replace("upstreams:\n", "shutdown_timeout: 30\nupstreams:\n");
    let e = first_error(&yaml);
    assert!(
        e.starts_with("shutdown_timeout: invalid duration") && e.ends_with("at line 2 column 19"),
        "{e}"
    );
    // Inside a route, a duration and a size written after other fields.
    let yaml = idem("ttl: 24h\nlock_ttl: soon");
    assert_eq!(yaml.lines().nth(11), Some("      lock_ttl: soon"), "{yaml}");
    let e = first_error(&yaml);
    assert!(
        e.starts_with("routes[0].idempotency.lock_ttl:") && e.ends_with("at line 12 column 17"),
        "{e}"
    );
    let e = first_error(&idem("ttl: 24h\nmax_request_body: 12 parsecs"));
    assert!(
        e.starts_with("routes[0].idempotency.max_request_body: invalid size")
            && e.ends_with("at line 12 column 25"),
        "{e}"
    );
}

#[test]
fn repeated_and_missing_fields_are_named_by_their_path() {
    // A field written twice: its path, and the line of the repeat.
    let yaml = idem("ttl: 1h\nlock_ttl: 5s\nttl: 2h");
    assert_eq!(yaml.lines().nth(12), Some("      ttl: 2h"), "{yaml}");
    let e = first_error(&yaml);
    assert_eq!(
        e, "routes[0].idempotency.ttl: duplicate field `ttl` at line 13 column 7",
        "{yaml}"
    );
    // A key written twice in the map of upstreams: refused too (it was the last one silently).
    let yaml = VALID.replace(
        "routes:\n",
        "  booking:\n    url: http://127.0.0.1:8082\nroutes:\n",
    );
    let e = first_error(&yaml);
    assert!(
        e.starts_with("upstreams.booking: duplicate entry") && e.ends_with("at line 5 column 3"),
        "{e}"
    );
    // A missing field: its path, where its mapping is.
    let e = first_error(&VALID.replace("    path: /bookings\n", ""));
    assert_eq!(
        e, "routes[0].path: missing field `path` at line 6 column 5",
        "the route's mapping starts on line 6"
    );
}

#[test]
fn validation_reports_every_error_at_once() {
    let yaml = "\
listen: nowhere
shutdown_timeout: 0s
store:
  timeout: 0ms
  wait_replicas: 2
upstreams:
  booking:
    url: ftp://127.0.0.1:8081
routes:
  - name: a
    path: bookings
    upstream: booking
  - name: a
    path: /x
    upstream: billing
    idempotency:
      lock_ttl: 1ms
      scope: [\"bad header\"]
      fingerprint: [colour]
      retry_statuses: [1000]
";
    let errs = errors(yaml);
    let want = [
        ("listen", "invalid socket address"),
        ("shutdown_timeout", "greater than zero"),
        ("store.timeout", "greater than zero"),
        ("store.wait_replicas", "Redis setting"),
        ("upstreams.booking.url", "invalid upstream URL"),
        ("routes[0].path", "invalid path"),
        ("routes[1].name", "duplicate route name"),
        ("routes[1].upstream", "unknown upstream"),
        ("routes[1].idempotency.lock_ttl", "at least"),
        ("routes[1].idempotency.scope[0]", "invalid header name"),
        (
            "routes[1].idempotency.fingerprint[0]",
            "unknown fingerprint part",
        ),
        (
            "routes[1].idempotency.retry_statuses[0]",
            "invalid HTTP status",
        ),
    ];
    for (path, words) in want {
        assert!(
            errs.0
                .iter()
                .any(|e| e.path == path && e.message.contains(words)),
            "no {path} error containing {words:?} in:\n{errs}"
        );
    }
    assert_eq!(errs.0.len(), want.len(), "exactly these errors:\n{errs}");
    // Display lists every error, one a line, each starting with its path.
    let shown = errs.to_string();
    let lines: Vec<&str> = shown.lines().collect();
    assert_eq!(lines.len(), want.len(), "{shown}");
    for (line, e) in lines.iter().zip(&errs.0) {
        assert!(line.starts_with(&format!("{}: ", e.path)), "{line}");
    }
}

const MINIMAL: &str = "\
listen: 127.0.0.1:8080
upstreams:
  booking:
    url: http://127.0.0.1:8081
routes:
  - name: create-booking
    path: /bookings
    upstream: booking
    idempotency: {}
  - name: rest
    path: /*
    upstream: booking
";

#[test]
fn a_minimal_file_gets_the_documented_defaults() {
    let c = Config::from_yaml(MINIMAL).expect("valid");
    assert_eq!(c.listen.to_string(), "127.0.0.1:8080");
    assert_eq!(c.log_format, LogFormat::Text);
    assert_eq!(c.pid_file, None);
    assert_eq!(c.shutdown_timeout, Duration::from_secs(30));
    // workers: one a core the process may use.
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    assert_eq!(c.workers, cores.clamp(1, 256));

    // store: memory, 1,000,000 entries, "idemproxy:", 500ms.
    match c.store.backend {
        BackendSettings::Memory { max_entries } => assert_eq!(max_entries, 1_000_000),
        other => panic!("default backend is memory, got {other:?}"),
    }
    assert_eq!(c.store.key_prefix, "idemproxy:");
    assert_eq!(c.store.timeout, Duration::from_millis(500));

    // upstream: connect 2s, whole response 30s.
    let up = &c.upstreams["booking"];
    assert_eq!(up.name, "booking");
    assert_eq!(up.url.to_string(), "http://127.0.0.1:8081/");
    assert_eq!(up.connect_timeout, Duration::from_secs(2));
    assert_eq!(up.timeout, Duration::from_secs(30));

    let routes = &c.routes;
    assert_eq!(routes.len(), 2);
    let r = &routes[0];
    assert_eq!(r.name, "create-booking");
    assert!(r.methods.is_none(), "default: every method");
    assert_eq!(r.upstream, "booking");
    assert!(
        routes[1].idempotency.is_none(),
        "no idempotency: pass-through"
    );

    let i = r.idempotency.as_ref().expect("idempotent route");
    assert_eq!(i.header, HeaderName::from_static("idempotency-key"));
    assert!(i.required);
    assert_eq!(i.ttl, Duration::from_secs(24 * 3600));
    assert_eq!(i.lock_ttl, Duration::from_secs(10));
    assert_eq!(i.scope, vec![HeaderName::from_static("authorization")]);
    assert_eq!(
        i.fingerprint,
        vec![
            FingerprintPart::Method,
            FingerprintPart::Path,
            FingerprintPart::Query,
            FingerprintPart::Body,
        ]
    );
    assert_eq!(i.on_conflict, OnConflict::Reject);
    assert_eq!(i.wait_timeout, Duration::from_secs(5));
    assert_eq!(i.on_store_error, OnStoreError::Reject);
    assert_eq!(i.retry_statuses, vec![429, 503]);
    assert_eq!(i.on_unknown_outcome, OnUnknownOutcome::Keep);
    assert_eq!(i.max_request_body, 1024 * 1024);
    assert_eq!(i.max_response_body, 8 * 1024 * 1024);
    assert!(!i.replay_set_cookie);
    assert!(i.forward_key);
    assert_eq!(i.mode, Mode::Enforce);
}

#[test]
fn redis_without_a_url_uses_the_default_url() {
    let yaml = MINIMAL.replace("upstreams:", "store:\n  backend: redis\nupstreams:");
    let c = Config::from_yaml(&yaml).expect("valid");
    match &c.store.backend {
        BackendSettings::Redis {
            url,
            access,
            wait_replicas,
        } => {
            assert_eq!(url, "redis://127.0.0.1:6379/0");
            assert!(access.password.is_none() && access.ca_pem.is_none());
            assert_eq!(*wait_replicas, 0);
        }
        other => panic!("expected redis, got {other:?}"),
    }
    assert_eq!(c.store.key_prefix, "idemproxy:");
    assert_eq!(c.store.timeout, Duration::from_millis(500));

    let yaml = MINIMAL.replace(
        "upstreams:",
        "store:\n  backend: redis\n  url: rediss://user:secret@127.0.0.1:6380/2\nupstreams:",
    );
    let c = Config::from_yaml(&yaml).expect("valid");
    match &c.store.backend {
        BackendSettings::Redis { url, .. } => {
            assert_eq!(url, "rediss://user:secret@127.0.0.1:6380/2")
        }
        other => panic!("expected redis, got {other:?}"),
    }
}

#[test]
fn values_are_read_as_written() {
    let yaml = idem(
        "header: X-Request-Key\nrequired: false\nttl: 1h 30m\nlock_ttl: 250ms\nscope: []\nfingerprint: [body, \"header:X-Tenant\"]\non_conflict: wait\nwait_timeout: 2s\non_store_error: forward\nretry_statuses: []\non_unknown_outcome: release\nmax_request_body: 64KiB\nmax_response_body: 1000\nreplay_set_cookie: true\nforward_key: false\nmode: observe",
    )
    .replace("methods: [POST]", "methods: [post, PUT]");
    let yaml = format!(
        "{}store:\n  backend: memory\n  max_entries: 10\n  key_prefix: \"idp/\"\n  timeout: 200ms\nlog_format: json\npid_file: /run/idemproxy.pid\nshutdown_timeout: 1m\n",
        yaml
    );
    let c = Config::from_yaml(&yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"));
    assert_eq!(c.log_format, LogFormat::Json);
    assert_eq!(
        c.pid_file.as_deref(),
        Some(std::path::Path::new("/run/idemproxy.pid"))
    );
    assert_eq!(c.shutdown_timeout, Duration::from_secs(60));
    assert!(matches!(
        c.store.backend,
        BackendSettings::Memory { max_entries: 10 }
    ));
    assert_eq!(c.store.key_prefix, "idp/");
    assert_eq!(c.store.timeout, Duration::from_millis(200));
    let r = &c.routes[0];
    assert_eq!(
        r.methods.as_deref(),
        Some(&[http::Method::POST, http::Method::PUT][..])
    );
    let i = r.idempotency.as_ref().expect("idempotent");
    assert_eq!(i.header, HeaderName::from_static("x-request-key"));
    assert!(!i.required);
    assert_eq!(i.ttl, Duration::from_secs(5400));
    assert_eq!(i.lock_ttl, Duration::from_millis(250));
    assert!(i.scope.is_empty());
    assert_eq!(
        i.fingerprint,
        vec![
            FingerprintPart::Body,
            FingerprintPart::Header(HeaderName::from_static("x-tenant"))
        ]
    );
    assert_eq!(i.on_conflict, OnConflict::Wait);
    assert_eq!(i.wait_timeout, Duration::from_secs(2));
    assert_eq!(i.on_store_error, OnStoreError::Forward);
    assert!(i.retry_statuses.is_empty());
    assert_eq!(i.on_unknown_outcome, OnUnknownOutcome::Release);
    assert_eq!(i.max_request_body, 65536);
    assert_eq!(i.max_response_body, 1000);
    assert!(i.replay_set_cookie);
    assert!(!i.forward_key);
    assert_eq!(i.mode, Mode::Observe);
}

fn example() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/config.example.yaml");
    std::fs::read_to_string(path).expect("read config.example.yaml")
}

#[test]
fn the_example_file_is_valid_and_shows_the_defaults() {
    let text = example();
    let ex = Config::from_yaml(&text).unwrap_or_else(|e| panic!("config.example.yaml: {e}"));
    let min = Config::from_yaml(MINIMAL).expect("valid");
    // Every value the example writes out is the default.
    assert_eq!(ex.log_format, min.log_format);
    assert_eq!(ex.shutdown_timeout, min.shutdown_timeout);
    assert_eq!(
        format!("{:?}", ex.store),
        format!("{:?}", min.store),
        "store section"
    );
    assert_eq!(
        format!("{:?}", ex.upstreams["booking"]),
        format!("{:?}", min.upstreams["booking"]),
        "upstream"
    );
    let first = |c: &Config| {
        format!(
            "{:?}",
            c.routes[0].idempotency.as_ref().expect("idempotent")
        )
    };
    assert_eq!(first(&ex), first(&min), "idempotency section");
    // Every field of SPEC §3 appears in it (commented out or not).
    for field in [
        "listen:",
        "admin_listen:",
        "log_format:",
        "pid_file:",
        "shutdown_timeout:",
        "workers:",
        "store:",
        "backend:",
        "max_entries:",
        "url:",
        "nodes:",
        "key_prefix:",
        "timeout:",
        "wait_replicas:",
        "password_file:",
        "password_env:",
        "upstreams:",
        "connect_timeout:",
        "pool_idle_timeout:",
        "ca_file:",
        "tls:",
        "cert_file:",
        "key_file:",
        "routes:",
        "name:",
        "methods:",
        "path:",
        "upstream:",
        "idempotency:",
        "header:",
        "required:",
        "ttl:",
        "lock_ttl:",
        "scope:",
        "fingerprint:",
        "on_conflict:",
        "wait_timeout:",
        "on_store_error:",
        "retry_statuses:",
        "on_unknown_outcome:",
        "max_request_body:",
        "max_response_body:",
        "replay_set_cookie:",
        "forward_key:",
        "mode:",
    ] {
        assert!(text.contains(field), "config.example.yaml lacks {field}");
    }
}

/// Uncomments the line of `text` that starts (after indentation) with `# {field}`.
fn uncomment(text: &str, field: &str) -> String {
    let needle = format!("# {field}");
    let mut found = false;
    let out: Vec<String> = text
        .lines()
        .map(|line| {
            let trimmed = line.trim_start();
            if !found && trimmed.starts_with(&needle) {
                found = true;
                let indent = &line[..line.len() - trimmed.len()];
                format!("{indent}{}", &trimmed[2..])
            } else {
                line.to_owned()
            }
        })
        .collect();
    assert!(found, "no commented-out {field} in config.example.yaml");
    out.join("\n")
}

#[test]
fn the_examples_commented_out_store_fields_are_valid_when_uncommented() {
    let text = example();
    // The seed nodes, with the backend that takes them.
    let yaml = uncomment(&text, "nodes:").replace("backend: memory", "backend: redis-cluster");
    let c = Config::from_yaml(&yaml).unwrap_or_else(|e| panic!("nodes: {e}"));
    assert!(
        matches!(&c.store.backend, BackendSettings::RedisCluster { nodes, .. } if nodes.len() == 3),
        "{:?}",
        c.store.backend
    );
    // `wait_replicas: 0` (the default, "don't wait") and any other value up to 16 on redis.
    let yaml = uncomment(&text, "wait_replicas:").replace("backend: memory", "backend: redis");
    Config::from_yaml(&yaml).unwrap_or_else(|e| panic!("wait_replicas: 0: {e}"));
    let c = Config::from_yaml(&yaml.replace("wait_replicas: 0", "wait_replicas: 2"))
        .unwrap_or_else(|e| panic!("wait_replicas: 2: {e}"));
    assert!(matches!(
        c.store.backend,
        BackendSettings::Redis {
            wait_replicas: 2,
            ..
        }
    ));
    // The password and CA files name files of the operator's: uncommented here, they are read
    // (and refused, since they are not there), which shows the loader takes them.
    for (field, path) in [
        ("password_file:", "store.password_file"),
        ("ca_file: /etc/idemproxy/redis", "store.ca_file"),
    ] {
        let yaml = uncomment(&text, field)
            .replace("backend: memory", "backend: redis")
            .replace("# url: redis://", "url: rediss://");
        let errs = errors(&yaml);
        assert!(
            errs.0
                .iter()
                .any(|e| e.path == path && e.message.contains("cannot read")),
            "{field}: {errs}"
        );
    }
    // The commented-out Redis URL is the default one, and valid.
    let yaml = uncomment(&text, "url: redis://").replace("backend: memory", "backend: redis");
    let c = Config::from_yaml(&yaml).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        matches!(&c.store.backend, BackendSettings::Redis { url, .. } if url == "redis://127.0.0.1:6379/0")
    );
}

#[test]
fn redis_password_is_read_from_a_file_or_the_environment_and_never_printed() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("redis-password");
    std::fs::write(&file, "s3cret-from-file\n").expect("write the password");
    let yaml = MINIMAL.replace(
        "upstreams:",
        &format!(
            "store:\n  backend: redis\n  url: redis://127.0.0.1:6379/0\n  password_file: {}\nupstreams:",
            file.display()
        ),
    );
    let c = Config::from_yaml(&yaml).unwrap_or_else(|e| panic!("{e}"));
    let BackendSettings::Redis { access, .. } = &c.store.backend else {
        panic!("expected redis, got {:?}", c.store.backend)
    };
    let password = access.password.as_ref().expect("a password");
    assert_eq!(
        password.expose(),
        "s3cret-from-file",
        "trailing newline trimmed"
    );
    assert!(
        !format!("{:?}", c.store).contains("s3cret"),
        "the password is never printed: {:?}",
        c.store
    );

    // From the environment (a variable every test process has, since `set_var` is unsafe and
    // the crate forbids unsafe code), on a cluster this time.
    let home = std::env::var("HOME").expect("HOME is set");
    let yaml = MINIMAL.replace(
        "upstreams:",
        "store:\n  backend: redis-cluster\n  nodes: [redis://127.0.0.1:7000, redis://127.0.0.1:7001]\n  password_env: HOME\nupstreams:",
    );
    let c = Config::from_yaml(&yaml).unwrap_or_else(|e| panic!("{e}"));
    let BackendSettings::RedisCluster { nodes, access } = &c.store.backend else {
        panic!("expected redis-cluster, got {:?}", c.store.backend)
    };
    assert_eq!(nodes.len(), 2);
    assert_eq!(access.password.as_deref(), Some(home.as_str()));

    let yaml = yaml.replace(
        "password_env: HOME",
        "password_env: IDEMPROXY_TEST_UNSET_VAR_2",
    );
    let errs = errors(&yaml);
    assert!(
        errs.0.iter().any(|e| e.path == "store.password_env"),
        "an unset variable is an error: {errs}"
    );
}
