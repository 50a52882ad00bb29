//! `sessiond serve`: opens the store, then serves gRPC until SIGTERM/ctrl-c.

use std::time::Instant;

use anyhow::Context;
use sessiond_store::{Store, StoreOptions};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic_health::ServingStatus;

use crate::config::Config;

pub async fn serve(config: Config) -> anyhow::Result<()> {
    init_tracing(config.log_json);
    let started = Instant::now();
    let store = open_store(&config).await?;

    let (health, health_service) = tonic_health::server::health_reporter();
    // "" is the whole server; it reports SERVING only once the store is open.
    health
        .set_service_status("", ServingStatus::NotServing)
        .await;

    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(sessiond_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .context("building the reflection service")?;

    let listener = TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("listen: cannot bind {}", config.listen))?;
    let local_addr = listener.local_addr()?;
    // One machine-readable line on stdout so scripts (and tests) find the port.
    #[allow(clippy::print_stdout)]
    {
        println!("sessiond listening on {local_addr}");
    }

    health.set_service_status("", ServingStatus::Serving).await;
    tracing::info!(
        %local_addr,
        backend = ?store.backend(),
        startup_ms = started.elapsed().as_millis() as u64,
        "serving"
    );

    tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(reflection)
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), shutdown_signal())
        .await
        .context("gRPC server failed")?;
    tracing::info!("stopped");
    Ok(())
}

pub async fn migrate(config: Config) -> anyhow::Result<()> {
    init_tracing(config.log_json);
    open_store(&config).await?;
    tracing::info!("migrations applied");
    Ok(())
}

async fn open_store(config: &Config) -> anyhow::Result<Store> {
    if !config.database_url.starts_with("postgres") {
        std::fs::create_dir_all(&config.data_dir)
            .with_context(|| format!("data_dir: cannot create {}", config.data_dir.display()))?;
    }
    Store::connect(&config.database_url, StoreOptions::default())
        .await
        .with_context(|| format!("database_url: cannot open {}", redact(&config.database_url)))
}

/// Hides the password of a `postgres://user:password@host` URL.
fn redact(url: &str) -> String {
    match (url.find("://"), url.find('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            let credentials = &url[scheme_end + 3..at];
            match credentials.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme_end + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(term) => term,
                Err(err) => {
                    tracing::warn!(%err, "cannot listen for SIGTERM; only ctrl-c stops the server");
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
    tracing::info!("shutdown requested; finishing in-flight calls");
}

fn init_tracing(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("SESSIOND_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn redacts_postgres_password() {
        assert_eq!(redact("postgres://u:secret@h/db"), "postgres://u:***@h/db");
        assert_eq!(redact("postgres://u@h/db"), "postgres://u@h/db");
        assert_eq!(redact("/tmp/x.sqlite3"), "/tmp/x.sqlite3");
    }
}
