//! `sessiond`: the backend that runs agent sessions and keeps them alive
//! across its own restarts. This binary stays thin: it reads configuration
//! (file, environment, flags) and hands it to the `sessiond_server` library.

use anyhow::Context;
use clap::{Parser, Subcommand};
use sessiond_server::config::{Config, ServeArgs};

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
    keep_inherited_descriptors_from_children();
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
            fewer_malloc_arenas();
            runtime()?.block_on(async {
                let _telemetry = init_telemetry(&config)?;
                let builder = sessiond_server::Sessiond::builder(config)
                    .agentctl_env(sessiond_server::inherited_agentctl_env());
                #[cfg(feature = "test-hooks")]
                let builder = test_hooks::apply(builder);
                builder.serve().await?;
                Ok(())
            })
        }
        Command::Migrate(args) => {
            let config = args.resolve_for_migrate()?;
            runtime()?.block_on(async {
                let _telemetry = init_telemetry(&Config {
                    otlp_endpoint: None,
                    ..config.clone()
                })?;
                sessiond_server::migrate(config).await?;
                Ok(())
            })
        }
    }
}

/// At most two malloc arenas, unless `MALLOC_ARENA_MAX` says otherwise:
/// glibc gives threads that allocate at once arenas of their own (up to 8
/// per core), which left a 10,000-session server ~20 MiB larger at its peak
/// (the bench: 152 -> 131 MiB) for no throughput.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn fewer_malloc_arenas() {
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        // SAFETY: sets one allocator parameter, before the runtime starts
        // any thread; mallopt has no other effect.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, 2);
        }
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn fewer_malloc_arenas() {}

/// Marks every descriptor from 3 up close-on-exec: one this process's
/// parent left open without the flag (a supervisor's lock file, a shell's
/// pipe) must not reach agentctl, which outlives sessiond and would hold it
/// (helper-41 3: `flock` could not restart sessiond). sessiond's own
/// descriptors carry the flag already. An old kernel changes nothing.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn keep_inherited_descriptors_from_children() {
    // SAFETY: close_range takes integers; with CLOSE_RANGE_CLOEXEC it only
    // sets a flag on descriptors of this process, closing none.
    unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3 as libc::c_uint,
            libc::c_uint::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        );
    }
}

#[cfg(not(target_os = "linux"))]
fn keep_inherited_descriptors_from_children() {}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

/// Logs (`SESSIOND_LOG` filter, text or JSON) and, when
/// `traces.otlp_endpoint` is set, span export.
fn init_telemetry(config: &Config) -> anyhow::Result<sessiond_telemetry::Telemetry> {
    let log_filter = std::env::var("SESSIOND_LOG")
        .ok()
        .filter(|f| !f.trim().is_empty())
        .unwrap_or_else(|| "info".into());
    let telemetry = sessiond_telemetry::init(sessiond_telemetry::Settings {
        service_name: "sessiond",
        log_filter,
        log_json: config.log_json,
        otlp_endpoint: config.otlp_endpoint.clone(),
        sample_ratio: config.trace_sample_ratio,
    })
    .context("traces")?;
    if let Some(endpoint) = &config.otlp_endpoint {
        tracing::info!(%endpoint, sample_ratio = config.trace_sample_ratio, "exporting traces over OTLP/gRPC");
    }
    Ok(telemetry)
}

/// Gates the tests of this binary set by environment; only in a build with
/// the `test-hooks` feature (the crate's own tests turn it on).
#[cfg(feature = "test-hooks")]
mod test_hooks {
    use std::{sync::Arc, time::Duration};

    use sessiond_server::SessiondBuilder;

    /// `SESSIOND_TEST_RECOVERY_GATE=<file>`: the startup recovery pass waits
    /// while that file exists before it takes up each executor (calls on
    /// sessions still recover theirs), so a test can look at the API in the
    /// middle of a pass without guessing a time.
    /// `SESSIOND_TEST_HEARTBEAT_GATE=<file>`: each replica heartbeat waits
    /// while that file exists (a fencing test holds a resumed replica before
    /// its first heartbeat, without guessing a time).
    pub(crate) fn apply(mut builder: SessiondBuilder) -> SessiondBuilder {
        if let Some(gate) = file_gate("SESSIOND_TEST_RECOVERY_GATE") {
            builder = builder.recovery_gate(gate);
        }
        if let Some(gate) = file_gate("SESSIOND_TEST_HEARTBEAT_GATE") {
            builder = builder.heartbeat_gate(gate);
        }
        builder
    }

    fn file_gate(var: &str) -> Option<sessiond_engine::PassGate> {
        let path = std::env::var_os(var).filter(|p| !p.is_empty())?;
        let path = std::path::PathBuf::from(path);
        tracing::warn!(gate = %path.display(), "{var}: waits while this file exists");
        Some(Arc::new(move || {
            let path = path.clone();
            Box::pin(async move {
                while path.exists() {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            })
        }))
    }
}
