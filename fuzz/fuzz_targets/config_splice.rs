//! `config::Config::from_yaml` on valid configurations with fuzz strings spliced in: field
//! values replaced (plain, quoted, as a flow list), fields inserted (known names and others),
//! lines deleted or repeated. Reaches the validation of each field far more often than
//! arbitrary text does.
//!
//! Invariants: as `config_loader` (no panic, every error with a message, loads deterministic).
#![no_main]

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;

/// The documented example: every field, memory store.
const EXAMPLE: &str = include_str!("../../config.example.yaml");

/// Every other value kind the example does not show: the admin listener, the Redis store,
/// `wait`, a header in the fingerprint, a path with a parameter and a rest.
const REDIS: &str = r#"
listen: 127.0.0.1:8080
admin_listen: 127.0.0.1:9090
log_format: json
shutdown_timeout: 30s
limits:
  max_connections: 100
  header_read_timeout: 1s
  body_read_timeout: 2s
  max_detached_exchanges: 1
  max_pending_saves: 1
  max_pending_save_bytes: 8MiB
store:
  backend: redis
  url: redis://127.0.0.1:6379/0
  key_prefix: "idemproxy:"
  timeout: 500ms
upstreams:
  booking:
    url: http://127.0.0.1:8081/api
    connect_timeout: 2s
    timeout: 30s
    pool_idle_timeout: 1s
routes:
  - name: create-booking
    methods: [POST, put]
    path: /bookings/{id}/*
    upstream: booking
    idempotency:
      header: Idempotency-Key
      required: false
      ttl: 24h
      lock_ttl: 10s
      scope: []
      fingerprint: [method, path, "header:X-Tenant"]
      on_conflict: wait
      wait_timeout: 5s
      on_store_error: forward
      retry_statuses: [429, 503]
      on_unknown_outcome: release
      max_request_body: 1048576
      max_response_body: 8MiB
      replay_set_cookie: true
      forward_key: false
      mode: observe
"#;

/// A route whose key may be derived from the request (`key_from`).
const DERIVED: &str = r#"
listen: 127.0.0.1:8080
upstreams:
  booking:
    url: http://127.0.0.1:8081
routes:
  - name: refund
    methods: [POST]
    path: /tickets/{ticket_id}/refund
    upstream: booking
    idempotency:
      key_from: ["path:ticket_id", "json:/reason/code", "query:ref", "header:X-Request-Id", method]
"#;

/// Field names to insert, so an insertion is often a known field in a new place.
/// `admin_token_file` is left out on purpose: the loader reads the file it names, and a fuzzer
/// that names `/dev/stdin` or a FIFO would hang on it (see the README).
const FIELDS: &[&str] = &[
    "listen",
    "admin_listen",
    "admin_token_env",
    "log_format",
    "shutdown_timeout",
    "limits",
    "max_connections",
    "header_read_timeout",
    "body_read_timeout",
    "max_detached_exchanges",
    "max_pending_saves",
    "max_pending_save_bytes",
    "store",
    "backend",
    "max_entries",
    "url",
    "nodes",
    "key_prefix",
    "timeout",
    "wait_replicas",
    "upstreams",
    "connect_timeout",
    "pool_idle_timeout",
    "routes",
    "name",
    "methods",
    "path",
    "upstream",
    "idempotency",
    "header",
    "required",
    "ttl",
    "lock_ttl",
    "scope",
    "fingerprint",
    "on_conflict",
    "wait_timeout",
    "on_store_error",
    "retry_statuses",
    "on_unknown_outcome",
    "max_request_body",
    "max_response_body",
    "replay_set_cookie",
    "forward_key",
    "mode",
    "key_from",
    "<<",
    "? x",
];

#[derive(Debug, Arbitrary)]
enum Style {
    Plain,
    Double,
    Single,
    Flow,
}

#[derive(Debug, Arbitrary)]
enum Field {
    Known(u8),
    Other(String),
}

#[derive(Debug, Arbitrary)]
enum Edit {
    Set {
        line: u8,
        style: Style,
        value: String,
    },
    Insert {
        line: u8,
        field: Field,
        style: Style,
        value: String,
    },
    Delete {
        line: u8,
    },
    Repeat {
        line: u8,
    },
}

#[derive(Debug, Arbitrary)]
struct Input {
    base: u8,
    edits: Vec<Edit>,
}

fn render(style: &Style, value: &str) -> String {
    match style {
        Style::Plain => value.to_owned(),
        Style::Double => {
            let mut out = String::from("\"");
            for c in value.chars() {
                match c {
                    '"' => out.push_str("\\\""),
                    '\\' => out.push_str("\\\\"),
                    c if c.is_control() => {
                        out.push_str(&format!("\\u{:04x}", u32::from(c) & 0xffff))
                    }
                    c => out.push(c),
                }
            }
            out.push('"');
            out
        }
        Style::Single => format!("'{}'", value.replace('\'', "''")),
        Style::Flow => format!("[{value}]"),
    }
}

/// The line's indentation, with a list item's `- ` counted as spaces.
fn indent(line: &str) -> String {
    let lead = line.len() - line.trim_start_matches([' ', '-']).len();
    " ".repeat(lead)
}

fuzz_target!(|input: Input| {
    let base = [EXAMPLE, REDIS, DERIVED][usize::from(input.base) % 3];
    // Lines that carry something: comments and blank lines are not worth an edit.
    let mut lines: Vec<String> = base
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
        .map(str::to_owned)
        .collect();
    for edit in input.edits.iter().take(4) {
        if lines.is_empty() {
            break;
        }
        let n = lines.len();
        match edit {
            Edit::Set { line, style, value } => {
                let l = &mut lines[usize::from(*line) % n];
                if let Some(colon) = l
                    .find(": ")
                    .or_else(|| l.ends_with(':').then(|| l.len() - 1))
                {
                    l.truncate(colon);
                    l.push_str(": ");
                    l.push_str(&render(style, value));
                }
            }
            Edit::Insert {
                line,
                field,
                style,
                value,
            } => {
                let at = usize::from(*line) % n;
                let name = match field {
                    Field::Known(i) => FIELDS[usize::from(*i) % FIELDS.len()].to_owned(),
                    Field::Other(s) => s.clone(),
                };
                let new = format!("{}{name}: {}", indent(&lines[at]), render(style, value));
                lines.insert(at + 1, new);
            }
            Edit::Delete { line } => {
                lines.remove(usize::from(*line) % n);
            }
            Edit::Repeat { line } => {
                let at = usize::from(*line) % n;
                let copy = lines[at].clone();
                lines.insert(at + 1, copy);
            }
        }
    }
    let text = lines.join("\n");
    let loaded = idemproxy_fuzz::check_config(&text);
    // The bases themselves load; if one stops loading, this target only fuzzes its error path.
    if input.edits.is_empty()
        && usize::from(input.base) % 3 < 2
        && let Err(e) = loaded
    {
        panic!("a base configuration does not load: {e}");
    }
});
