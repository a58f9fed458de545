//! Reloading the configuration (SIGHUP, `idemproxy reload`, or [`Proxy::reload`]): the new
//! file validated as `--check` validates it, compared with the configuration in force, then
//! swapped in whole or refused whole (SPEC §2).
//!
//! What cannot change in place, and why — a file that changes any of it is refused whole,
//! logged as needing a restart (naming the fields) and counted `needs_restart`:
//! - `listen`, `admin_listen`, `tls`: the sockets are bound, and the TLS acceptor built, once
//!   (a renewed certificate under the same file names is a change too: it is compared by what
//!   the files hold).
//! - `store`: the records are in it, and its connections, pools and writer thread are set up
//!   once; a password rotated in `password_file` is a change too.
//! - `log_format`: the log subscriber is installed once per process.
//! - `pid_file`: written at start, and how `idemproxy reload` finds the process.
//! - `limits.max_connections`, `limits.max_admin_connections`: the bounds of the accept loops,
//!   fixed when they start.
//! - `workers`: the threads, their runtimes, sockets, upstream pools and store connections
//!   are made at start. Only a number the file writes counts: a file that leaves it to the
//!   default keeps the workers running, even if the cores counted now differ (a container
//!   whose CPU quota changed), or every reload of an unchanged file would be refused.
//!
//! A route that keeps its name keeps its records, but a change of how its key is made —
//! `idempotency.scope`, `header` or `key_from` — puts the records made before the reload out
//! of reach (a retry of an earlier operation runs it again), and a change of its `fingerprint`
//! turns those retries into `422`s. Such a reload is applied, as SPEC §2 asks, and each change
//! is logged as a warning naming the route and the field, and counted
//! (`idemproxy_config_reload_key_changes_total{route,field}`).
//!
//! Everything else applies to the requests that arrive after the swap — routes, upstreams,
//! policies, the other limits (`header_read_timeout` and `send_timeout` to connections
//! accepted after it; a connection keeps the deadlines it was accepted with), the admin token,
//! `shutdown_timeout` and `drain_delay` — while requests in flight finish under the generation
//! they loaded (see [`super::generation`]).

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use super::Proxy;
use super::generation::Generation;
use super::matched::RouteNumbers;
use crate::config::{Config, ConfigErrors, IdempotencySettings};
use crate::metrics::ReloadResult;

/// Called with each configuration a reload applies (a listener taking its new limits).
type Hook = Box<dyn Fn(&Config) + Send + Sync>;

/// What reloads share: the route numbers they carry over, and who must hear of each one
/// applied. Locked for the length of one reload, so two never interleave.
pub(super) struct Reloading {
    numbers: RouteNumbers,
    hooks: Vec<Hook>,
}

impl Reloading {
    pub(super) fn new(numbers: RouteNumbers) -> Reloading {
        Reloading {
            numbers,
            hooks: Vec::new(),
        }
    }
}

/// What a reload did.
#[derive(Debug)]
pub enum Reloaded {
    /// The new configuration is in force; what changed.
    Applied(Changes),
    /// The file is not valid (every error); the configuration in force stays.
    Invalid(ConfigErrors),
    /// These fields changed, and cannot change in place; nothing of the file was applied.
    NeedsRestart(Vec<&'static str>),
    /// The proxy is shutting down: the reload was ignored (and not counted).
    Draining,
}

/// What an applied reload changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changes {
    /// Routes by name: new ones, gone ones, and ones whose settings differ.
    pub routes_added: Vec<String>,
    pub routes_removed: Vec<String>,
    pub routes_changed: Vec<String>,
    /// Whether the routes that stayed are in another order (first match wins).
    pub routes_reordered: bool,
    /// Upstreams by name. A changed one gets a new client and connection pool.
    pub upstreams_added: Vec<String>,
    pub upstreams_removed: Vec<String>,
    pub upstreams_changed: Vec<String>,
    /// Other fields that changed (`limits.send_timeout`, `admin_token`, …).
    pub other: Vec<&'static str>,
    /// Routes kept whose key or fingerprint is made another way: their earlier records are out
    /// of reach or answer `422` to retries.
    pub key_changes: Vec<KeyChange>,
}

/// A field of a kept route that decides which record a request finds (see the module).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyChange {
    pub route: String,
    /// `scope`, `header`, `key_from` or `fingerprint`.
    pub field: &'static str,
}

impl KeyChange {
    /// What the change does to the route's earlier records, for the log.
    fn consequence(&self) -> &'static str {
        match self.field {
            "fingerprint" => {
                "a retry of an operation from before the reload now gets 422 (its fingerprint is computed another way)"
            }
            _ => {
                "the records made before the reload are out of reach: a retry of an operation from before it runs the operation again"
            }
        }
    }
}

/// The fields of a kept route's idempotency that changed how its records are found.
/// `kind_changed`: the route became, or stopped being, a JSON-RPC route, which fingerprints
/// calls, not requests (SPEC §4.10).
fn key_changes(
    route: &str,
    old: &IdempotencySettings,
    new: &IdempotencySettings,
    kind_changed: bool,
) -> Vec<KeyChange> {
    [
        ("scope", old.scope != new.scope),
        ("header", old.header != new.header),
        ("key_from", old.key_from != new.key_from),
        (
            "fingerprint",
            old.fingerprint != new.fingerprint || kind_changed,
        ),
    ]
    .into_iter()
    .filter(|(_, changed)| *changed)
    .map(|(field, _)| KeyChange {
        route: route.to_owned(),
        field,
    })
    .collect()
}

impl Changes {
    fn between(old: &Config, new: &Config) -> Changes {
        let route = |c: &Config, name: &str| c.routes.iter().find(|r| r.name == name).cloned();
        let mut changes = Changes::default();
        for r in &new.routes {
            match route(old, &r.name) {
                None => changes.routes_added.push(r.name.clone()),
                Some(before) if before != *r => {
                    changes.routes_changed.push(r.name.clone());
                    if let (Some(was), Some(now)) = (&before.idempotency, &r.idempotency) {
                        let kind = before.jsonrpc.is_some() != r.jsonrpc.is_some();
                        changes
                            .key_changes
                            .extend(key_changes(&r.name, was, now, kind));
                    }
                }
                Some(_) => {}
            }
        }
        changes.routes_removed = old
            .routes
            .iter()
            .filter(|r| route(new, &r.name).is_none())
            .map(|r| r.name.clone())
            .collect();
        let kept = |from: &Config, other: &Config| -> Vec<String> {
            from.routes
                .iter()
                .filter(|r| route(other, &r.name).is_some())
                .map(|r| r.name.clone())
                .collect()
        };
        changes.routes_reordered = kept(old, new) != kept(new, old);
        for (name, settings) in &new.upstreams {
            match old.upstreams.get(name) {
                None => changes.upstreams_added.push(name.clone()),
                Some(before) if before != settings => changes.upstreams_changed.push(name.clone()),
                Some(_) => {}
            }
        }
        changes.upstreams_removed = old
            .upstreams
            .keys()
            .filter(|name| !new.upstreams.contains_key(*name))
            .cloned()
            .collect();
        let (a, b) = (&old.limits, &new.limits);
        let fields = [
            (
                "limits.header_read_timeout",
                a.header_read_timeout != b.header_read_timeout,
            ),
            ("limits.send_timeout", a.send_timeout != b.send_timeout),
            (
                "limits.body_read_timeout",
                a.body_read_timeout != b.body_read_timeout,
            ),
            (
                "limits.max_detached_exchanges",
                a.max_detached_exchanges != b.max_detached_exchanges,
            ),
            (
                "limits.max_pending_saves",
                a.max_pending_saves != b.max_pending_saves,
            ),
            (
                "limits.max_pending_save_bytes",
                a.max_pending_save_bytes != b.max_pending_save_bytes,
            ),
            ("admin_token", old.admin_token != new.admin_token),
            (
                "shutdown_timeout",
                old.shutdown_timeout != new.shutdown_timeout,
            ),
            ("drain_delay", old.drain_delay != new.drain_delay),
        ];
        changes.other = fields.iter().filter(|(_, c)| *c).map(|(f, _)| *f).collect();
        changes
    }

    /// Whether the file changed nothing at all.
    pub fn is_empty(&self) -> bool {
        *self == Changes::default()
    }
}

/// One line: each kind of change that happened, with its names.
impl fmt::Display for Changes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return f.write_str("nothing changed");
        }
        let lists: [(&str, &[String]); 6] = [
            ("routes added", &self.routes_added),
            ("routes removed", &self.routes_removed),
            ("routes changed", &self.routes_changed),
            ("upstreams added", &self.upstreams_added),
            ("upstreams removed", &self.upstreams_removed),
            ("upstreams changed", &self.upstreams_changed),
        ];
        let mut parts: Vec<String> = lists
            .iter()
            .filter(|(_, names)| !names.is_empty())
            .map(|(what, names)| format!("{what}: {}", names.join(", ")))
            .collect();
        if self.routes_reordered {
            parts.push("routes reordered".to_owned());
        }
        if !self.other.is_empty() {
            parts.push(format!("also changed: {}", self.other.join(", ")));
        }
        if !self.key_changes.is_empty() {
            let named: Vec<String> = self
                .key_changes
                .iter()
                .map(|c| format!("{}.{}", c.route, c.field))
                .collect();
            parts.push(format!("keys made another way: {}", named.join(", ")));
        }
        f.write_str(&parts.join("; "))
    }
}

/// The fields of `new` that differ from `old` and cannot change in place.
fn needs_restart(old: &Config, new: &Config) -> Vec<&'static str> {
    let fields = [
        ("listen", old.listen != new.listen),
        // Only a number the file writes (see the module): a default counted again is no
        // change, and a written one equal to what runs needs nothing either.
        (
            "workers",
            old.workers_written != new.workers_written && old.workers != new.workers,
        ),
        ("admin_listen", old.admin_listen != new.admin_listen),
        ("tls", old.tls != new.tls),
        ("store", old.store != new.store),
        ("log_format", old.log_format != new.log_format),
        ("pid_file", old.pid_file != new.pid_file),
        // The exporter is started once, with the process.
        ("tracing", old.tracing != new.tracing),
        (
            "limits.max_connections",
            old.limits.max_connections != new.limits.max_connections,
        ),
        (
            "limits.max_admin_connections",
            old.limits.max_admin_connections != new.limits.max_admin_connections,
        ),
    ];
    fields.iter().filter(|(_, c)| *c).map(|(f, _)| *f).collect()
}

impl Proxy {
    /// Reads and validates `path` as `--check` does, then [`Proxy::reload`]s it. An invalid
    /// file is logged, every error, and counted; the configuration in force stays.
    pub fn reload_file(&self, path: &Path) -> Reloaded {
        if self.is_draining() {
            return self.ignored_while_draining();
        }
        match Config::load(path) {
            Ok(config) => self.reload(config),
            Err(errors) => {
                for e in &errors.0 {
                    tracing::error!(file = %path.display(), error = %e, "reload: invalid configuration");
                }
                tracing::warn!(
                    file = %path.display(),
                    errors = errors.0.len(),
                    "reload refused: the file is not valid; still serving the configuration in force"
                );
                self.metrics.config_reload(ReloadResult::Invalid);
                Reloaded::Invalid(errors)
            }
        }
    }

    /// Swaps in `config` (already validated), unless it changes a field that cannot change
    /// in place: then nothing of it is applied. Requests that arrive after the swap use the
    /// new configuration; requests in flight finish under the one they started with.
    pub fn reload(&self, config: Config) -> Reloaded {
        if self.is_draining() {
            return self.ignored_while_draining();
        }
        // Never poisoned in a way that matters: a panicking reload swapped nothing in.
        let mut reloading = self
            .reloading
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let current = self.current.load_full();
        let fields = needs_restart(&current.config, &config);
        if !fields.is_empty() {
            tracing::warn!(
                fields = %fields.join(", "),
                "reload refused: {} cannot change while the proxy runs; restart it to apply this file (nothing of it was applied)",
                fields.join(", ")
            );
            self.metrics.config_reload(ReloadResult::NeedsRestart);
            return Reloaded::NeedsRestart(fields);
        }
        let mut config = config;
        // What runs: a default counted again may differ (see `needs_restart`).
        config.workers = current.config.workers;
        let changes = Changes::between(&current.config, &config);
        super::warn_about(&config);
        for change in &changes.key_changes {
            tracing::warn!(
                route = %change.route,
                field = %change.field,
                "reload: idempotency.{} of route {} changed: {}",
                change.field,
                change.route,
                change.consequence()
            );
            self.metrics.reload_key_changed(&change.route, change.field);
        }
        let Reloading { numbers, hooks } = &mut *reloading;
        let generation = Generation::build(
            config,
            &self.metrics,
            numbers,
            Some(&current),
            self.workers(),
        );
        let limits = generation.config.limits;
        // One set of pending saves for every worker: bounded once.
        self.worker(0)
            .pending
            .set_bounds(limits.max_pending_saves, limits.max_pending_save_bytes);
        for hook in hooks.iter() {
            hook(&generation.config);
        }
        // One swap that every worker sees: they all load this one `ArcSwap`.
        self.current.store(Arc::new(generation));
        self.metrics.config_reload(ReloadResult::Applied);
        tracing::info!(%changes, "configuration reloaded");
        Reloaded::Applied(changes)
    }

    /// Runs `hook` with every configuration a reload applies, before requests see it.
    pub(crate) fn on_reload(&self, hook: impl Fn(&Config) + Send + Sync + 'static) {
        self.reloading
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .hooks
            .push(Box::new(hook));
    }

    fn ignored_while_draining(&self) -> Reloaded {
        tracing::warn!("reload ignored: the proxy is shutting down");
        Reloaded::Draining
    }
}

#[cfg(test)]
mod tests;
