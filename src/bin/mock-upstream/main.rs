//! `mock-upstream`: the bundled mock booking service as a standalone process, for the demo, manual
//! testing with curl and the load benches. See [`idemproxy_mock`] for its routes and the
//! `X-Mock-*` control headers.

#![warn(clippy::too_many_lines)]

mod grpc;
mod serve;

use std::io::{IsTerminal, Write};
use std::net::SocketAddr;

use clap::Parser;
use idemproxy_mock::MockUpstream;
use tokio::net::TcpListener;
use tracing_subscriber::EnvFilter;

/// A fake legacy booking API that counts side effects per Idempotency-Key.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Address to listen on (port 0 picks a free port; the chosen address is printed).
    #[arg(long, default_value = "127.0.0.1:8081", env = "MOCK_UPSTREAM_LISTEN")]
    listen: SocketAddr,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Calls the mock ledger's gRPC `Transfer` once (through the proxy, say), with the key in the
    /// call's `idempotency-key` metadata, and prints what came back: a gRPC client for the demo
    /// that needs no grpcurl.
    GrpcTransfer {
        /// The base URL to call (HTTP/2 with prior knowledge).
        #[arg(long, default_value = "http://127.0.0.1:8080")]
        url: String,
        /// The `idempotency-key` metadata.
        #[arg(long)]
        key: String,
        /// The transfer's reference.
        #[arg(long, default_value = "r-1")]
        reference: String,
        /// The transfer's amount.
        #[arg(long, default_value_t = 2400)]
        amount: i64,
    },
    /// Sends many `Transfer` calls, 4 at a time on one HTTP/2 connection, and fails unless each
    /// got `grpc-status: 0`: a load for counting what the proxy spends on a call.
    #[command(hide = true)]
    GrpcCalls {
        /// The base URL to call (HTTP/2 with prior knowledge).
        #[arg(long, default_value = "http://127.0.0.1:8080")]
        url: String,
        /// How many calls.
        #[arg(long, default_value_t = 1000)]
        calls: u32,
        /// Each call's `idempotency-key` is this and its number (none without it).
        #[arg(long)]
        key_prefix: Option<String>,
        /// Every call's key is the prefix alone: one key, replayed.
        #[arg(long, requires = "key_prefix")]
        fixed: bool,
    },
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let args = Args::parse();
    if let Some(Command::GrpcTransfer {
        url,
        key,
        reference,
        amount,
    }) = args.command
    {
        return grpc::transfer(&url, &key, &reference, amount).await;
    }
    if let Some(Command::GrpcCalls {
        url,
        calls,
        key_prefix,
        fixed,
    }) = args.command
    {
        return grpc::calls(&url, calls, key_prefix.as_deref(), fixed).await;
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        // Its report of a failed write would be an `eprintln!`, a panic on a closed stderr.
        .log_internal_errors(false)
        .init();

    let listener = TcpListener::bind(args.listen).await?;
    let addr = listener.local_addr()?;
    // On stdout as well as in the log, so a script or bench that passed port 0 can read it.
    // A closed stdout loses the line, not the process (`println!` would panic).
    let _ = writeln!(
        std::io::stdout(),
        "mock-upstream listening on http://{addr}"
    );
    tracing::info!(%addr, "mock-upstream listening on http://{addr}");

    serve::serve(listener, MockUpstream::new(), idemproxy::shutdown::signal()).await?;
    tracing::info!("mock-upstream stopped");
    Ok(())
}
