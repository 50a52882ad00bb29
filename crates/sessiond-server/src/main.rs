//! `sessiond`: the backend that runs agent sessions and keeps them alive
//! across its own restarts. This binary stays thin: it reads configuration,
//! opens the store and wires the gRPC services.

mod api;
mod auth;
mod config;
mod console;
mod convert;
mod error;
mod forward;
mod limits;
mod metrics;
mod replica;
mod serve;

use clap::{Parser, Subcommand};

use crate::config::ServeArgs;

#[derive(Debug, Parser)]
#[command(
    name = "sessiond",
    version,
    about = "Runs AI coding-agent sessions and keeps them alive across restarts"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Open the database, apply migrations and serve gRPC.
    Serve(ServeArgs),
    /// Apply pending database migrations and exit.
    Migrate(ServeArgs),
    /// Print the version.
    Version,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Version => {
            #[allow(clippy::print_stdout)]
            {
                println!("sessiond {}", env!("CARGO_PKG_VERSION"));
            }
            Ok(())
        }
        Command::Serve(args) => {
            let mut config = args.resolve()?;
            // Flags are visible to every local user in `ps` and /proc.
            if std::env::args().any(|a| a == "--api-tokens" || a.starts_with("--api-tokens=")) {
                config.warnings.push(
                    "--api-tokens puts the API tokens in the process list (ps, /proc/PID/cmdline) \
                     for every local user to read; prefer SESSIOND_API_TOKENS or auth.tokens_file"
                        .to_owned(),
                );
            }
            runtime()?.block_on(serve::serve(config))
        }
        Command::Migrate(args) => runtime()?.block_on(serve::migrate(args.resolve_for_migrate()?)),
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}
