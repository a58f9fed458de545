//! The `idemproxy` command: parse flags, set up logging, load the configuration, run.

#![warn(clippy::too_many_lines)]

/// `println!` that never panics: a line for a stdout that is gone (a closed pipe) is lost, and
/// the command goes on to its exit code.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

/// `eprintln!` that never panics, for the same reason as `say!`.
macro_rules! complain {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

mod demo;

use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use idemproxy::config::{Config, LogFormat, Secret};
use tracing_subscriber::EnvFilter;

/// A reverse proxy that gives HTTP routes exactly-once effect through Idempotency-Key.
#[derive(Debug, Parser)]
#[command(version, about, args_conflicts_with_subcommands = true)]
struct Args {
    /// The configuration file (YAML).
    #[arg(long, short = 'c', env = "IDEMPROXY_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,
    /// Validate the configuration file and exit: 0 if valid, 2 with every error otherwise.
    #[arg(long)]
    check: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Check a running proxy's health through its admin listener: exit 0 when it answers
    /// `GET /healthz` with 200 (a container HEALTHCHECK needs no shell tools).
    Health {
        /// The admin listener's URL.
        #[arg(long, env = "IDEMPROXY_ADMIN", default_value = "http://127.0.0.1:9090")]
        admin: String,
    },
    /// Validate a configuration file (as --check does), then tell the proxy running with it to
    /// reload it: SIGHUP to the process whose id the file's `pid_file` holds.
    Reload {
        /// The configuration file (YAML) the running proxy was started with.
        #[arg(long, short = 'c', env = "IDEMPROXY_CONFIG", value_name = "FILE")]
        config: PathBuf,
    },
    /// The store's own maintenance.
    Store {
        #[command(subcommand)]
        action: StoreAction,
    },
    /// Look up or forget one idempotency record through a running proxy's admin listener.
    Keys {
        #[command(subcommand)]
        action: KeysAction,
    },
    /// Start the bundled mock booking service and the proxy in front of it (embedded store),
    /// and print curl lines to try.
    Demo {
        /// Where the proxy listens.
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: SocketAddr,
        /// Where the mock booking service listens.
        #[arg(long, default_value = "127.0.0.1:8081")]
        upstream_listen: SocketAddr,
        /// Where the admin listener listens (/healthz, /readyz, /metrics, /keys with the
        /// token `demo-token`).
        #[arg(long, default_value = "127.0.0.1:9090")]
        admin_listen: SocketAddr,
    },
}

#[derive(Debug, Subcommand)]
enum StoreAction {
    /// Finish a rolling upgrade of the PostgreSQL schema: record the newest version this
    /// idemproxy knows, once every instance runs it (older instances then refuse to start on
    /// the schema). Nothing to do on the other stores.
    Upgrade {
        /// The configuration file (YAML) whose `store` section names the database.
        #[arg(long, short = 'c', env = "IDEMPROXY_CONFIG", value_name = "FILE")]
        config: PathBuf,
    },
}

/// Which record a `keys` command is about.
#[derive(Debug, clap::Args)]
struct RecordArgs {
    /// The route's name.
    #[arg(long)]
    route: String,
    /// The key, as the client sent it.
    #[arg(long, conflicts_with_all = ["hash", "part"], required_unless_present_any = ["hash", "part"])]
    key: Option<String>,
    /// On a `key_from` route, a part value of the derived key (repeat, in the configured
    /// order; JSON text for `json:` parts, e.g. '"dup"' or 42).
    #[arg(long = "part", conflicts_with = "hash")]
    part: Vec<String>,
    /// A scope header of the caller, `Name: value` (repeat for each; default scope is
    /// Authorization).
    #[arg(long = "scope")]
    scope: Vec<String>,
    /// The key's hash, as the logs show it (64 hex digits).
    #[arg(long)]
    hash: Option<String>,
    /// The admin listener's URL.
    #[arg(long, env = "IDEMPROXY_ADMIN", default_value = "http://127.0.0.1:9090")]
    admin: String,
    /// A file holding the admin token (or set IDEMPROXY_ADMIN_TOKEN).
    #[arg(long)]
    token_file: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
enum KeysAction {
    /// Show a record: state, fingerprint, saved status, header names, body size, age, TTL.
    Show {
        #[command(flatten)]
        record: RecordArgs,
        /// Include the saved body.
        #[arg(long)]
        body: bool,
    },
    /// Forget a finished record so that the next request with its key runs again (a claim in
    /// flight is never forgotten).
    Forget {
        #[command(flatten)]
        record: RecordArgs,
    },
}

fn main() -> ExitCode {
    let args = Args::parse();
    match args.command {
        Some(Command::Health { admin }) => return block_on(health(admin)),
        Some(Command::Keys { action }) => return block_on(keys(action)),
        Some(Command::Reload { config }) => return reload(&config),
        Some(Command::Store {
            action: StoreAction::Upgrade { config },
        }) => return block_on(store_upgrade(config)),
        _ => {}
    }
    if let Some(Command::Demo {
        listen,
        upstream_listen,
        admin_listen,
    }) = args.command
    {
        init_logging(LogFormat::Text);
        return block_on(demo::run(listen, upstream_listen, admin_listen));
    }
    let Some(path) = args.config else {
        complain!(
            "error: no configuration: pass --config FILE or set IDEMPROXY_CONFIG (or run `idemproxy demo`)"
        );
        return ExitCode::from(2);
    };
    let config = match load(&path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    if args.check {
        for warning in config.warnings() {
            complain!("{}: warning: {warning}", path.display());
        }
        say!("{}: configuration is valid", path.display());
        return ExitCode::SUCCESS;
    }
    init_logging(config.log_format);
    block_on(serve(config, path))
}

/// Loads and validates `path`, as `--check` does: every error on stderr, exit code 2.
fn load(path: &Path) -> Result<Config, ExitCode> {
    load_with(path, Config::load)
}

/// Loads `path` with `read`, every error on stderr, exit code 2.
fn load_with(
    path: &Path,
    read: impl FnOnce(&Path) -> Result<Config, idemproxy::config::ConfigErrors>,
) -> Result<Config, ExitCode> {
    read(path).map_err(|errors| {
        for e in &errors.0 {
            complain!("{}: {e}", path.display());
        }
        complain!(
            "{}: {} error(s); the configuration is not valid",
            path.display(),
            errors.0.len()
        );
        ExitCode::from(2)
    })
}

/// `idemproxy reload`: validates the file first, so that a file the proxy would refuse is
/// reported here, with every error, and nothing is signalled (exit 2); then signals the
/// process its `pid_file` names (exit 1 when there is none to signal).
fn reload(path: &Path) -> ExitCode {
    let config = match load_with(path, Config::load_for_reload) {
        Ok(c) => c,
        Err(code) => return code,
    };
    match idemproxy::pid_file::signal_reload(config.pid_file.as_deref()) {
        Ok(pid) => {
            say!(
                "{}: valid; sent SIGHUP to idemproxy (pid {pid}), which reloads it and logs what it applied",
                path.display()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            complain!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `idemproxy store upgrade`: exit 0 when the schema is at the newest version (upgraded now or
/// before), 1 when the database refused or could not be reached, 2 for an invalid file.
async fn store_upgrade(path: PathBuf) -> ExitCode {
    use idemproxy::config::BackendSettings;
    let config = match load_with(&path, Config::load) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let BackendSettings::Postgres(settings) = &config.store.backend else {
        say!(
            "{}: the store keeps no schema of versions (only postgres does): nothing to upgrade",
            path.display()
        );
        return ExitCode::SUCCESS;
    };
    match idemproxy::store::postgres::upgrade(settings, config.store.timeout).await {
        Ok(said) => {
            say!("{said}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            complain!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Runs `fut` on a current-thread runtime: the main thread. Serving, it is worker 0, and the
/// proxy starts the other workers' threads and runtimes itself (see `server::workers`).
fn block_on(fut: impl Future<Output = ExitCode>) -> ExitCode {
    match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt.block_on(fut),
        Err(e) => {
            complain!("error: cannot start the runtime: {e}");
            ExitCode::FAILURE
        }
    }
}

fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(LogSink)
        // Its own report of a failed write is an `eprintln!`, which panics when stderr is a
        // closed pipe: in the request that logged, the connection then closes unanswered.
        .log_internal_errors(false);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
    }
}

/// Where log lines go: stderr, one write a line. A line stderr does not take (a closed pipe —
/// a log collector that died, `| head -1` —, a full disk) is dropped and counted
/// (`idemproxy_log_lines_dropped_total`), never an error or a panic in whoever logged it: a
/// failing log costs no answer, no save and no clean exit.
#[derive(Debug, Clone, Copy)]
struct LogSink;

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogSink {
    type Writer = LogSink;

    fn make_writer(&'a self) -> LogSink {
        LogSink
    }
}

impl Write for LogSink {
    fn write(&mut self, line: &[u8]) -> std::io::Result<usize> {
        match std::io::stderr().write(line) {
            Ok(0) if !line.is_empty() => Ok(dropped(line)),
            Ok(n) => Ok(n),
            // `write_all` tries again.
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => Err(e),
            Err(_) => Ok(dropped(line)),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        // Unbuffered: nothing is held here to lose.
        let _ = std::io::stderr().flush();
        Ok(())
    }
}

/// Counts a line (or the rest of one) that could not be written; says it was written, so the
/// subscriber moves on to the next.
fn dropped(line: &[u8]) -> usize {
    idemproxy::metrics::log_line_dropped();
    line.len()
}

async fn health(admin: String) -> ExitCode {
    use idemproxy::admin::client;
    match client::call(&admin, http::Method::GET, "/healthz", None).await {
        Ok((status, _)) if status == http::StatusCode::OK => ExitCode::SUCCESS,
        Ok((status, body)) => {
            complain!("unhealthy: {status} {body}");
            ExitCode::FAILURE
        }
        Err(e) => {
            complain!("unhealthy: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn keys(action: KeysAction) -> ExitCode {
    use idemproxy::admin::client;
    let (method, record, body) = match action {
        KeysAction::Show { record, body } => (http::Method::GET, record, body),
        KeysAction::Forget { record } => (http::Method::DELETE, record, false),
    };
    // Read and trimmed exactly as the proxy reads admin_token_file, or the two would differ.
    let token = match &record.token_file {
        Some(path) => Secret::read_file(path).map(Some),
        None => match std::env::var("IDEMPROXY_ADMIN_TOKEN") {
            Ok(text) => Secret::from_text(&text)
                .map(Some)
                .map_err(|e| format!("IDEMPROXY_ADMIN_TOKEN: {e}")),
            Err(_) => Ok(None),
        },
    };
    let token = match token {
        Ok(token) => token,
        Err(e) => {
            complain!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let path = client::record_path(
        &record.route,
        record.key.as_deref(),
        &record.part,
        &record.scope,
        record.hash.as_deref(),
        body,
    );
    match client::call(
        &record.admin,
        method,
        &path,
        token.as_ref().map(Secret::expose),
    )
    .await
    {
        Ok((status, text)) => {
            let pretty = serde_json::from_str::<serde_json::Value>(&text)
                .ok()
                .and_then(|v| serde_json::to_string_pretty(&v).ok())
                .unwrap_or(text);
            if status.is_success() {
                say!("{pretty}");
                ExitCode::SUCCESS
            } else {
                complain!("{status}: {pretty}");
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            complain!("error: {e}");
            ExitCode::from(2)
        }
    }
}

async fn serve(config: Config, path: PathBuf) -> ExitCode {
    let listener = match idemproxy::server::bind(config.listen) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(listen = %config.listen, error = %e, "cannot listen");
            return ExitCode::FAILURE;
        }
    };
    let reloads = idemproxy::reload::ReloadSource::file(path);
    match idemproxy::run(listener, config, reloads, stop_signal()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "idemproxy stopped");
            ExitCode::FAILURE
        }
    }
}

/// The first SIGTERM/SIGINT starts a graceful shutdown; a second one ends the process at once
/// (an operator who presses Ctrl-C twice means it).
async fn stop_signal() {
    idemproxy::shutdown::signal().await;
    tokio::spawn(async {
        idemproxy::shutdown::signal().await;
        tracing::warn!("second stop signal: exiting without waiting for requests in flight");
        std::process::exit(130);
    });
}
