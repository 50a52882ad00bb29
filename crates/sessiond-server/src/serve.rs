//! `sessiond serve`: opens the store, serves gRPC (+ gRPC-web, health,
//! reflection, metrics), runs startup recovery, and stops on SIGTERM/ctrl-c
//! leaving executors running.
//!
//! Layers around every service, outermost first: CORS (preflights answered
//! without credentials) → gRPC-web translation → RPC metrics → bearer auth.

use std::time::Instant;

use anyhow::Context;
use http::{HeaderName, HeaderValue};
use sessiond_store::{Store, StoreOptions};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic_health::ServingStatus;
use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};

use crate::{
    auth::AuthLayer,
    config::{AuthConfig, Config, CorsConfig},
    metrics::{self, Metrics, RpcMetricsLayer},
};

/// Services whose health follows startup recovery ("" is the whole server).
const HEALTH_SERVICES: &[&str] = &[
    "",
    "sessiond.v1.SessionService",
    "sessiond.v1.WorkspaceService",
];

pub async fn serve(config: Config) -> anyhow::Result<()> {
    init_tracing(config.log_json);
    let started = Instant::now();
    if matches!(config.auth, AuthConfig::Disabled) {
        tracing::warn!(listen = %config.listen, "authentication is disabled (--insecure-no-auth); loopback only");
    }
    let store = open_store(&config).await?;

    let (health, health_service) = tonic_health::server::health_reporter();
    for service in HEALTH_SERVICES {
        health
            .set_service_status(*service, ServingStatus::NotServing)
            .await;
    }

    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(sessiond_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .context("building the reflection service")?;

    let metrics = Metrics::new(snapshot_source(store.clone()));

    let listener = TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("listen: cannot bind {}", config.listen))?;
    let local_addr = listener.local_addr()?;
    let metrics_listener = match config.metrics_listen {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .with_context(|| format!("metrics.listen: cannot bind {addr}"))?,
        ),
        None => None,
    };
    // Machine-readable lines on stdout so scripts (and tests) find the ports.
    #[allow(clippy::print_stdout)]
    {
        println!("sessiond listening on {local_addr}");
        if let Some(l) = &metrics_listener {
            println!("sessiond metrics on {}", l.local_addr()?);
        }
    }

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let wait_stop = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|stopped| *stopped).await;
        }
    };
    if let Some(l) = metrics_listener {
        tokio::spawn(metrics::serve(l, metrics.clone(), wait_stop()));
    }

    let tokens = match &config.auth {
        AuthConfig::Tokens(t) => Some(t.clone()),
        AuthConfig::Disabled => None,
    };
    let router = tonic::transport::Server::builder()
        .accept_http1(true)
        .layer(cors_layer(&config.cors))
        .layer(tonic_web::GrpcWebLayer::new())
        .layer(RpcMetricsLayer::new(metrics.clone()))
        .layer(AuthLayer::new(tokens))
        .add_service(health_service)
        .add_service(reflection);
    let server = tokio::spawn(
        router.serve_with_incoming_shutdown(TcpListenerStream::new(listener), wait_stop()),
    );

    tracing::info!(
        %local_addr,
        backend = ?store.backend(),
        startup_ms = started.elapsed().as_millis() as u64,
        "accepting calls; recovering executors"
    );
    let recovery_started = Instant::now();
    metrics.record_recovery(recovery_started.elapsed(), &[]);
    for service in HEALTH_SERVICES {
        health
            .set_service_status(*service, ServingStatus::Serving)
            .await;
    }
    tracing::info!("serving");

    shutdown_signal().await;
    let _ = stop_tx.send(true);
    match tokio::time::timeout(config.shutdown_grace, server).await {
        Ok(Ok(result)) => result.context("gRPC server failed")?,
        Ok(Err(join)) => return Err(join).context("gRPC server task failed"),
        Err(_) => tracing::warn!(
            grace = ?config.shutdown_grace,
            "in-flight calls did not finish within the shutdown grace; exiting anyway"
        ),
    }
    tracing::info!("stopped; executors keep running for the next start to reattach");
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

/// CORS for browsers calling through gRPC-web: bearer tokens travel in the
/// `authorization` header, never in cookies, so credentials stay off.
fn cors_layer(config: &CorsConfig) -> CorsLayer {
    let origin = if config.allowed_origins.is_empty() {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(
            config
                .allowed_origins
                .iter()
                .filter_map(|o| HeaderValue::from_str(o).ok()),
        )
    };
    CorsLayer::new()
        .allow_origin(origin)
        .allow_methods([http::Method::POST, http::Method::OPTIONS])
        // `*` would not cover `authorization`; echo what the browser asks for.
        .allow_headers(AllowHeaders::mirror_request())
        .expose_headers([
            HeaderName::from_static("grpc-status"),
            HeaderName::from_static("grpc-message"),
            HeaderName::from_static("grpc-status-details-bin"),
        ])
        .max_age(config.max_age)
}

/// Gauges read from the store at scrape time.
fn snapshot_source(store: Store) -> impl Fn() -> metrics::Snapshot + Send + Sync + 'static {
    move || {
        let store = store.clone();
        Box::pin(async move {
            let mut executors = std::collections::BTreeMap::new();
            for s in sessiond_domain::ExecutorStatus::ALL {
                executors.insert(s.as_str().to_owned(), 0.0);
            }
            if let Ok(list) = store.list_executors().await {
                for e in list {
                    *executors.entry(e.status.as_str().to_owned()).or_insert(0.0) += 1.0;
                }
            }
            vec![(
                "sessiond_executors".to_owned(),
                executors
                    .into_iter()
                    .map(|(k, v)| ("status".to_owned(), k, v))
                    .collect(),
            )]
        })
    }
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
