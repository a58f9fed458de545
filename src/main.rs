//! The `idemproxy` command: parse flags, set up logging, load the configuration, run.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use idemproxy::config::{Config, LogFormat};
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
    /// Start the bundled mock booking service and the proxy in front of it (embedded store),
    /// and print curl lines to try.
    Demo {
        /// Where the proxy listens.
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: SocketAddr,
        /// Where the mock booking service listens.
        #[arg(long, default_value = "127.0.0.1:8081")]
        upstream_listen: SocketAddr,
    },
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(Command::Demo {
        listen,
        upstream_listen,
    }) = args.command
    {
        init_logging(LogFormat::Text);
        return block_on(demo(listen, upstream_listen));
    }
    let Some(path) = args.config else {
        eprintln!(
            "error: no configuration: pass --config FILE or set IDEMPROXY_CONFIG (or run `idemproxy demo`)"
        );
        return ExitCode::from(2);
    };
    let config = match Config::load(&path) {
        Ok(c) => c,
        Err(errors) => {
            for e in &errors.0 {
                eprintln!("{}: {e}", path.display());
            }
            eprintln!(
                "{}: {} error(s); the configuration is not valid",
                path.display(),
                errors.0.len()
            );
            return ExitCode::from(2);
        }
    };
    if args.check {
        println!("{}: configuration is valid", path.display());
        return ExitCode::SUCCESS;
    }
    init_logging(config.log_format);
    block_on(serve(config))
}

fn block_on(fut: impl Future<Output = ExitCode>) -> ExitCode {
    match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt.block_on(fut),
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            ExitCode::FAILURE
        }
    }
}

fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
    }
}

async fn serve(config: Config) -> ExitCode {
    let listener = match idemproxy::server::bind(config.listen) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(listen = %config.listen, error = %e, "cannot listen");
            return ExitCode::FAILURE;
        }
    };
    match idemproxy::run(listener, config, stop_signal()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "idemproxy stopped");
            ExitCode::FAILURE
        }
    }
}

async fn demo(listen: SocketAddr, upstream_listen: SocketAddr) -> ExitCode {
    let up = match idemproxy::server::bind(upstream_listen) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(%upstream_listen, error = %e, "cannot start the mock booking service (pass --upstream-listen)");
            return ExitCode::FAILURE;
        }
    };
    let proxy = match idemproxy::server::bind(listen) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(%listen, error = %e, "cannot listen (pass --listen)");
            return ExitCode::FAILURE;
        }
    };
    let (Ok(up_addr), Ok(addr)) = (up.local_addr(), proxy.local_addr()) else {
        return ExitCode::FAILURE;
    };
    let yaml = idemproxy::demo_config(addr, up_addr);
    let config = match Config::from_yaml(&yaml) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "the demo configuration is invalid");
            return ExitCode::FAILURE;
        }
    };
    let (stop_mock, mock_stopped) = tokio::sync::oneshot::channel::<()>();
    let mock = tokio::spawn(idemproxy::mock::serve(
        up,
        idemproxy::mock::MockUpstream::new(),
        async move {
            let _ = mock_stopped.await;
        },
    ));
    println!("{}", idemproxy::demo_instructions(addr, up_addr));
    let result = idemproxy::run(proxy, config, stop_signal()).await;
    let _ = stop_mock.send(());
    let _ = mock.await;
    match result {
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
