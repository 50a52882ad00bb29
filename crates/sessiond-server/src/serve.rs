//! `sessiond serve`: a [`Sessiond`] behind sessiond's own tonic server
//! (+ gRPC-web, auth, metrics), stopped by SIGTERM/ctrl-c leaving executors
//! running; and the helpers [`Sessiond`]'s builder uses.
//!
//! Layers around every service, outermost first: the web console (`GET`
//! and `HEAD` answered from the embedded files), CORS (preflights answered
//! without credentials) → gRPC-web translation → RPC metrics → bearer auth.

use std::{sync::Arc, time::Instant};

use anyhow::Context;
use chrono::Utc;
use http::{HeaderName, HeaderValue};
use sessiond_domain::{AgentProfile, AgentProfileId, Runtime};
use sessiond_engine::ManagerConfig;
use sessiond_executor::{
    Backoff, ClientConfig, Executor, TlsConfig,
    docker::{DockerExecutor, ResourceLimits},
    remote::{RemoteConfig, RemoteExecutor},
    standalone::{StandaloneConfig, StandaloneExecutor},
};
use sessiond_store::{Store, StoreOptions};
use tokio::net::TcpListener;
use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};

use crate::{
    auth::AuthLayer,
    config::{AllowedOrigins, AuthConfig, Config, CorsConfig},
    embed::{Result, Sessiond, SessiondBuilder},
    metrics::{self, RpcMetricsLayer},
};

/// What `sessiond serve` does: builds a [`Sessiond`] from `config`, serves
/// its services on `config.listen` (TLS, gRPC-web, CORS, bearer-token auth,
/// the console) and metrics on `metrics.listen`, runs startup recovery, and
/// stops on SIGTERM or ctrl-c leaving executors running. Logging is the
/// caller's (the binary sets up `sessiond-telemetry`).
///
/// Prints `sessiond listening on <addr>` (and `sessiond metrics on <addr>`)
/// on stdout once it listens.
pub async fn serve(config: Config) -> Result<()> {
    Sessiond::builder(config).serve().await
}

impl SessiondBuilder {
    /// [`crate::serve`] with this builder's parts: builds, then serves until
    /// SIGTERM or ctrl-c.
    pub async fn serve(self) -> Result<()> {
        Ok(serve_until(self, shutdown_signal()).await?)
    }
}

async fn serve_until(
    builder: SessiondBuilder,
    stop: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let started = Instant::now();
    let config = builder.config().clone();
    for warning in &config.warnings {
        tracing::warn!("{warning}");
    }
    if matches!(config.auth, AuthConfig::Disabled) {
        tracing::warn!(listen = %config.listen, "authentication is disabled (--insecure-no-auth); loopback only");
    }
    let (told, mut database) = tokio::sync::watch::channel(None::<String>);
    let build = builder.waiting_for_database(told).build();
    tokio::pin!(build);
    tokio::pin!(stop);
    // The metrics endpoint serves these once they exist, and stops when
    // `metrics_stop` fires or is dropped.
    let metrics_slot = metrics::MetricsSlot::default();
    let (metrics_stop, metrics_stopped) = tokio::sync::oneshot::channel::<()>();
    let mut metrics_stopped = Some(metrics_stopped);
    // Once the database is found not to answer yet: the sockets, bound
    // then (after the instance lock), the API's served by
    // `serve_while_waiting` until the build is done (dropping `meanwhile`
    // stops that server; the real one takes the same socket over), the
    // metrics' by its server from the start.
    let mut bound = None;
    let mut meanwhile = None;
    let mut told_closed = false;
    let sessiond = loop {
        tokio::select! {
            built = &mut build => break built?,
            // SIGTERM or ctrl-c while the database is awaited: nothing was
            // started yet, so there is nothing to stop (helper-59 4: the
            // signal's default action ended the process, saying nothing).
            () = &mut stop, if bound.is_some() => {
                tracing::info!("stopped while waiting for the database; nothing was started");
                return Ok(());
            }
            changed = database.changed(), if bound.is_none() && !told_closed => {
                if changed.is_err() {
                    told_closed = true;
                    continue;
                }
                let (listener, metrics_listener) = bind(&config).await?;
                meanwhile = Some(
                    serve_while_waiting(&config, listener.try_clone()?, database.clone()).await?,
                );
                announce(listener.local_addr()?, metrics_listener.as_ref())?;
                if let (Some(l), Some(stopped)) = (metrics_listener, metrics_stopped.take()) {
                    spawn_metrics(&config, l, metrics_slot.clone(), stopped);
                }
                bound = Some(listener);
            }
        }
    };
    drop(meanwhile);
    let _ = metrics_slot.set(sessiond.metrics().clone());
    let stopped = sessiond.stopped();
    tokio::spawn(async move {
        stopped.await;
        let _ = metrics_stop.send(());
    });
    let announced = bound.is_some();
    let (listener, metrics_listener) = match bound {
        Some(listener) => (listener, None),
        None => bind(&config).await?,
    };
    let local_addr = listener.local_addr()?;
    let listener = TcpListener::from_std(listener)?;
    // Registered before the first recovery pass claims anything.
    sessiond.start(&local_addr.to_string()).await?;
    if !announced {
        announce(local_addr, metrics_listener.as_ref())?;
        if let (Some(l), Some(stopped)) = (metrics_listener, metrics_stopped) {
            spawn_metrics(&config, l, metrics_slot, stopped);
        }
    }

    let tokens = api_tokens(&config);
    let services = sessiond.services();
    let request_body_timeout = config.request_body_timeout;
    let router = tonic_server(&config)?
        .accept_http1(true)
        .layer(crate::console::ConsoleLayer)
        .layer(crate::cors::BrowserCorsLayer(cors_layer(&config.cors)))
        .layer(tonic_web::GrpcWebLayer::new())
        .layer(sessiond_telemetry::GrpcTraceLayer)
        .layer(RpcMetricsLayer::new(sessiond.metrics().clone()))
        .layer(AuthLayer::new(tokens, config.cors.allowed_origins.clone()))
        // A request body that stalls (slowloris inside a request) is ended;
        // responses (watch streams) are not bounded.
        .layer(tower::util::MapRequestLayer::new(
            move |req: http::Request<tonic::body::Body>| {
                req.map(|body| {
                    tonic::body::Body::new(tower_http::timeout::TimeoutBody::new(
                        request_body_timeout,
                        body,
                    ))
                })
            },
        ))
        .add_service(services.health)
        .add_service(services.reflection)
        .add_service(services.session)
        .add_service(services.workspace);
    let server = tokio::spawn(router.serve_with_incoming_shutdown(
        first_bytes_within(tcp_incoming(listener), config.handshake_timeout),
        sessiond.stopped(),
    ));

    tracing::info!(
        %local_addr,
        backend = ?sessiond.store().backend(),
        startup_ms = started.elapsed().as_millis() as u64,
        "accepting calls; recovering executors"
    );

    stop.await;
    sessiond.shutdown().await;
    let served = match tokio::time::timeout(config.shutdown_grace, server).await {
        Ok(Ok(result)) => result.context("gRPC server failed"),
        Ok(Err(join)) => Err(join).context("gRPC server task failed"),
        Err(_) => {
            tracing::warn!(
                grace = ?config.shutdown_grace,
                "in-flight calls did not finish within the shutdown grace; exiting anyway"
            );
            Ok(())
        }
    };
    // Graceful handoff (leases released), then the instance lock dropped.
    sessiond.release().await;
    served?;
    tracing::info!("stopped; executors keep running for the next start to reattach");
    Ok(())
}

/// The API's socket (a std listener, so that a second handle of it can
/// serve while the database is awaited) and the metrics'.
async fn bind(config: &Config) -> anyhow::Result<(std::net::TcpListener, Option<TcpListener>)> {
    let listener = std::net::TcpListener::bind(config.listen)
        .and_then(|l| l.set_nonblocking(true).map(|()| l))
        .with_context(|| format!("listen: cannot bind {}", config.listen))?;
    let metrics = match config.metrics_listen {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .with_context(|| format!("metrics.listen: cannot bind {addr}"))?,
        ),
        None => None,
    };
    Ok((listener, metrics))
}

/// Serves the metrics endpoint on `listener` until `stopped` resolves.
fn spawn_metrics(
    config: &Config,
    listener: TcpListener,
    slot: metrics::MetricsSlot,
    stopped: tokio::sync::oneshot::Receiver<()>,
) {
    let limits = metrics::HttpLimits {
        max_connections: config.metrics_max_connections,
        idle_timeout: config.metrics_idle_timeout,
    };
    tokio::spawn(metrics::serve(listener, slot, limits, async move {
        let _ = stopped.await;
    }));
}

/// Machine-readable lines on stdout, so scripts (and tests) find the ports.
#[allow(clippy::print_stdout)]
fn announce(listening: std::net::SocketAddr, metrics: Option<&TcpListener>) -> std::io::Result<()> {
    println!("sessiond listening on {listening}");
    if let Some(l) = metrics {
        println!("sessiond metrics on {}", l.local_addr()?);
    }
    Ok(())
}

/// The bearer tokens calls must present (`None`: authentication off).
fn api_tokens(config: &Config) -> Option<Vec<String>> {
    match &config.auth {
        AuthConfig::Tokens(t) => Some(t.clone()),
        AuthConfig::Disabled => None,
    }
}

/// A tonic server with the configured TLS, if any.
fn tonic_server(config: &Config) -> anyhow::Result<tonic::transport::Server> {
    let mut builder = tonic::transport::Server::builder();
    if let Some((cert, key)) = &config.tls {
        // ALPN offers h2, so browsers speak HTTP/2 (no 6-connection limit of
        // HTTP/1.1); a client sending no ALPN may still speak HTTP/1.1.
        let read = |key_name: &str, path: &std::path::Path| {
            std::fs::read(path)
                .with_context(|| format!("{key_name}: cannot read {}", path.display()))
        };
        let identity = tonic::transport::Identity::from_pem(
            read("tls.cert_file", cert)?,
            read("tls.key_file", key)?,
        );
        // A connection that never finishes its handshake (never sends a
        // ClientHello, or stalls in it) is closed, not held open forever.
        builder = builder
            .tls_config(
                tonic::transport::ServerTlsConfig::new()
                    .identity(identity)
                    .timeout(config.handshake_timeout),
            )
            .context("tls.cert_file / tls.key_file")?;
    }
    Ok(builder)
}

/// How long the server answering while the database is awaited may finish
/// what it has open once the real one serves.
const WAITING_SERVER_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// Serves on `listener` (a second handle of the real server's socket)
/// while the database does not answer: health NOT_SERVING, every other
/// call told to retry (`waiting::WaitingLayer`), behind the same TLS and
/// auth as the real server. Stops when the returned sender is dropped.
async fn serve_while_waiting(
    config: &Config,
    listener: std::net::TcpListener,
    why: tokio::sync::watch::Receiver<Option<String>>,
) -> anyhow::Result<tokio::sync::oneshot::Sender<()>> {
    let mut health = tonic_health::server::HealthReporter::new();
    for service in crate::embed::HEALTH_SERVICES {
        health
            .set_service_status(*service, tonic_health::ServingStatus::NotServing)
            .await;
    }
    let router = tonic_server(config)?
        .accept_http1(true)
        .layer(crate::waiting::WaitingLayer {
            why: why.clone(),
            http: true,
        })
        .layer(tonic_web::GrpcWebLayer::new())
        .layer(AuthLayer::new(
            api_tokens(config),
            config.cors.allowed_origins.clone(),
        ))
        .layer(crate::waiting::WaitingLayer { why, http: false })
        .add_service(tonic_health::pb::health_server::HealthServer::new(
            tonic_health::server::HealthService::from_health_reporter(health.clone()),
        ));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (stopping, stopping_seen) = tokio::sync::oneshot::channel::<()>();
    let incoming = first_bytes_within(
        tcp_incoming(TcpListener::from_std(listener)?),
        config.handshake_timeout,
    );
    let shutdown = async move {
        let _ = stopped.await;
        // Ends the health Watch streams opened meanwhile (their statuses
        // gone, the streams close), so their clients watch again, on the
        // real server (helper-59 3: they stayed NOT_SERVING).
        for service in crate::embed::HEALTH_SERVICES {
            health.clear_service_status(service).await;
        }
        let _ = stopping.send(());
    };
    tokio::spawn(async move {
        let serving = router.serve_with_incoming_shutdown(incoming, shutdown);
        tokio::pin!(serving);
        // Everything else it answers at once: what is still open after a
        // short grace is cut, so its clients reconnect to the real server.
        let cut = async {
            match stopping_seen.await {
                Ok(()) => tokio::time::sleep(WAITING_SERVER_GRACE).await,
                Err(_) => std::future::pending().await,
            }
        };
        tokio::select! {
            ended = &mut serving => {
                if let Err(e) = ended {
                    tracing::warn!(error = %e, "the server answering while the database is awaited failed");
                }
            }
            () = cut => {}
        }
    });
    Ok(stop)
}

/// What `sessiond migrate` does: opens the database named by
/// `config.database_url` and applies pending migrations.
pub async fn migrate(config: Config) -> Result<()> {
    open_store(&config).await?;
    tracing::info!("migrations applied");
    Ok(())
}

pub(crate) async fn open_store(config: &Config) -> anyhow::Result<Store> {
    if !config.database_url.starts_with("postgres") {
        private_dir(&config.data_dir, "data_dir")?;
        // SQLite gives -wal and -shm the main file's mode.
        let db = std::path::Path::new(&config.database_url);
        if db.starts_with(&config.data_dir) && !db.exists() {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .open(db)
                .with_context(|| format!("database_url: cannot create {}", db.display()))?;
        }
        tighten_files(&config.data_dir);
    }
    // A replica stopped inside a transaction (SIGSTOP, a frozen VM) must
    // let go of its row locks before its leases expire, or the others
    // cannot adopt its sessions, nor write for their tasks.
    let idle = std::time::Duration::from_secs(5).min(config.replica.lease_ttl / 2);
    Store::connect(
        &config.database_url,
        StoreOptions::default().idle_in_transaction_timeout(idle),
    )
    .await
    .with_context(|| format!("database_url: cannot open {}", redact(&config.database_url)))
}

/// [`open_store`], waiting while a PostgreSQL `database_url` cannot be
/// reached (refused, unreachable, starting up): one warning per attempt,
/// the pause growing to 5 s. An answer that will not change by waiting (a
/// wrong password, a database that does not exist, a failed migration)
/// fails at once. Each attempt's error goes to `told`: `serve` answers
/// calls with it meanwhile, and stops cleanly on SIGTERM or ctrl-c.
pub(crate) async fn open_store_waiting(
    config: &Config,
    told: &tokio::sync::watch::Sender<Option<String>>,
) -> anyhow::Result<Store> {
    let mut pause = std::time::Duration::from_millis(500);
    let mut attempt = 1u32;
    loop {
        match open_store(config).await {
            Ok(store) => {
                if attempt > 1 {
                    tracing::info!(attempts = attempt, "the database answers; starting");
                }
                return Ok(store);
            }
            Err(e) if config.database_url.starts_with("postgres") && worth_waiting_for(&e) => {
                let error = e
                    .downcast_ref::<sessiond_store::Error>()
                    .map_or_else(|| format!("{e:#}"), ToString::to_string);
                told.send_replace(Some(error.trim_end().to_owned()));
                tracing::warn!(
                    attempt,
                    retry_in_ms = pause.as_millis() as u64,
                    error = error.trim_end(),
                    "database_url: {} does not answer yet; waiting for it (sessiond serves once it answers; calls meanwhile are UNAVAILABLE)",
                    redact(&config.database_url)
                );
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(std::time::Duration::from_secs(5));
                attempt += 1;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Whether a failure to open the database may pass by waiting: the server
/// could not be reached, or is not accepting connections yet.
fn worth_waiting_for(e: &anyhow::Error) -> bool {
    let Some(store) = e.downcast_ref::<sessiond_store::Error>() else {
        return false;
    };
    if !store.is_unavailable() {
        return false;
    }
    // PostgreSQL's answers that waiting will not change.
    let text = store.to_string().to_lowercase();
    const FINAL: [&str; 6] = [
        "authentication failed",
        "does not exist",
        "pg_hba.conf",
        "permission denied",
        "invalid",
        "ssl",
    ];
    !FINAL.iter().any(|word| text.contains(word))
}

/// Accepted connections with Nagle's algorithm off: with it on, a reply
/// written in parts (HTTP/2 headers, then data and trailers) can wait for
/// the client's delayed ACK, a 40 ms stall on a call that takes 1 ms.
fn tcp_incoming(listener: tokio::net::TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
}

/// Each accepted connection must send its first bytes within `limit`
/// (`handshake_timeout`), or reading from it fails and it is closed. A
/// client that connects and says nothing would otherwise hold its socket
/// and task forever: hyper's HTTP/1 header timeout starts only once the
/// protocol is known, HTTP/2 waits for its preface, and tonic's TLS
/// handshake timeout covers only servers with TLS.
fn first_bytes_within(
    incoming: tonic::transport::server::TcpIncoming,
    limit: std::time::Duration,
) -> impl futures::Stream<Item = std::io::Result<FirstBytes>> {
    use futures::StreamExt;
    incoming.map(move |accepted| {
        accepted.map(|stream| FirstBytes {
            stream,
            deadline: Some(Box::pin(tokio::time::sleep(limit))),
        })
    })
}

/// An accepted connection whose reads fail with `TimedOut` when its
/// deadline passes before its first byte.
struct FirstBytes {
    stream: tokio::net::TcpStream,
    /// Until the first byte arrives.
    deadline: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl tokio::io::AsyncRead for FirstBytes {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::{future::Future, task::Poll};
        let before = buf.filled().len();
        match std::pin::Pin::new(&mut self.stream).poll_read(cx, buf) {
            Poll::Ready(result) => {
                if buf.filled().len() > before {
                    self.deadline = None;
                }
                return Poll::Ready(result);
            }
            Poll::Pending => {}
        }
        if let Some(deadline) = self.deadline.as_mut()
            && deadline.as_mut().poll(cx).is_ready()
        {
            return Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the client sent nothing within handshake_timeout",
            )));
        }
        Poll::Pending
    }
}

impl tokio::io::AsyncWrite for FirstBytes {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for FirstBytes {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}

/// Creates `dir` (and missing parents) readable by this user only, or
/// tightens an existing one to 0700 with a warning: it holds the database
/// with every agentctl's secret, logs and port files.
fn private_dir(dir: &std::path::Path, key: &str) -> anyhow::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("{key}: cannot create {}", dir.display()))?;
    }
    let mode = std::fs::metadata(dir)
        .with_context(|| format!("{key}: cannot stat {}", dir.display()))?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("{key}: cannot restrict {} to 0700", dir.display()))?;
        tracing::warn!(
            path = %dir.display(),
            was = format!("{:o}", mode & 0o777),
            "{key} was readable by other users; restricted to 0700"
        );
    }
    Ok(())
}

/// Restricts the regular files directly in `dir` to 0600 (warning once),
/// for state left by an older version or created under a looser umask.
fn tighten_files(dir: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut fixed = 0;
    for entry in entries.flatten() {
        let Ok(meta) = entry.path().symlink_metadata() else {
            continue;
        };
        if meta.is_file()
            && meta.permissions().mode() & 0o077 != 0
            && std::fs::set_permissions(entry.path(), std::fs::Permissions::from_mode(0o600))
                .is_ok()
        {
            fixed += 1;
        }
    }
    if fixed > 0 {
        tracing::warn!(
            dir = %dir.display(),
            files = fixed,
            "files were readable by other users; restricted to 0600"
        );
    }
}

/// The configured agent profiles, stored by name (ids stay stable).
pub(crate) async fn seed_profiles(store: &Store, config: &Config) -> anyhow::Result<()> {
    for (i, a) in config.agents.iter().enumerate() {
        // Said at start rather than at the first create that fails; a
        // profile with a container image runs its command in there.
        if a.container.is_none() && !command_on_host(&a.command) {
            tracing::warn!(profile = %a.name, command = %a.command,
                "the agent profile's command is not found on this host (not a file, not on \
                 PATH): sessions with it on local_standalone will not start; a remote \
                 host needs it on its own PATH");
        }
        let now = Utc::now();
        store
            .upsert_agent_profile(&AgentProfile {
                id: AgentProfileId::new(),
                name: a.name.clone(),
                command: a.command.clone(),
                args: a.args.clone(),
                env: a.env.clone(),
                supports_session_resume: a.supports_session_resume,
                container: a.container.clone(),
                auth_method: a.auth_method.clone(),
                permission_policy: a.permission_policy,
                permission_timeout: a.permission_timeout,
                config_defaults: a.config_defaults.clone(),
                mcp_servers: a.mcp_servers.clone(),
                created_at: now,
                updated_at: now,
            })
            .await
            .with_context(|| format!("agents[{i}]: cannot store profile {:?}", a.name))?;
    }
    Ok(())
}

/// Whether `command` names a program here: a path to a file, or a name
/// found in a directory of `PATH`.
fn command_on_host(command: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let runnable = |p: &std::path::Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if command.contains('/') {
        return runnable(std::path::Path::new(command));
    }
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| runnable(&dir.join(command))))
}

/// Whether commands for sessions other replicas own are forwarded to them
/// (see `forward.rs`): only with authentication (the caller's token is what
/// the owner checks).
pub(crate) fn forward_policy(config: &Config) -> crate::forward::Policy {
    use crate::forward::Policy;
    if matches!(config.auth, AuthConfig::Disabled) {
        Policy::Refuse(
            "this replica runs without authentication (insecure_no_auth) and never forwards \
             calls; send it to the owner",
        )
    } else {
        Policy::Forward
    }
}

/// How this replica reaches owners serving TLS (`replica.peer_tls_ca_file`),
/// and whether it may reach plain-text ones: not when it serves TLS itself
/// (a caller's token sent over TLS is not passed on in clear text).
pub(crate) fn peer_tls(config: &Config) -> anyhow::Result<crate::forward::PeerTls> {
    let r = &config.replica;
    let trust = match &r.peer_tls_ca_file {
        Some(path) => {
            let pem = std::fs::read(path).with_context(|| {
                format!("replica.peer_tls_ca_file: cannot read {}", path.display())
            })?;
            let mut tls = tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(pem));
            if let Some(name) = &r.peer_tls_domain_name {
                tls = tls.domain_name(name.clone());
            }
            // Built once here so a bad certificate or name fails the start,
            // not the first forwarded call.
            tonic::transport::Endpoint::from_static("https://replica.invalid")
                .tls_config(tls.clone())
                .map_err(|e| {
                    anyhow::anyhow!(
                        "replica.peer_tls_ca_file {} / replica.peer_tls_domain_name: {}",
                        path.display(),
                        crate::forward::error_chain(&e)
                    )
                })?;
            Some(tls)
        }
        None => None,
    };
    Ok(crate::forward::PeerTls {
        trust,
        no_plain_text: config.tls.is_some(),
    })
}

pub(crate) fn client_config(config: &Config) -> anyhow::Result<ClientConfig> {
    let e = &config.executors;
    let tls = match &e.remote_tls_ca_file {
        Some(path) => {
            let mut tls = TlsConfig::from_ca_file(path)
                .with_context(|| format!("executors.remote.tls_ca_file: {}", path.display()))?;
            tls.domain_name.clone_from(&e.remote_tls_domain_name);
            if let Some((cert, key)) = &e.remote_tls_client_identity {
                tls = tls
                    .with_client_identity_files(cert, key)
                    .context("executors.remote.tls_client_cert_file / tls_client_key_file")?;
            }
            Some(tls)
        }
        None => None,
    };
    Ok(ClientConfig {
        connect_timeout: e.connect_timeout,
        call_timeout: e.call_timeout,
        tls,
        ..ClientConfig::default()
    })
}

/// One driver per enabled runtime.
/// The executor drivers, and the Docker one again by its type for the orphan
/// sweep when Docker is enabled.
pub(crate) async fn drivers(
    config: &Config,
    agentctl_env: Vec<(String, String)>,
) -> anyhow::Result<(Vec<Arc<dyn Executor>>, Option<Arc<DockerExecutor>>)> {
    let e = &config.executors;
    let client = client_config(config)?;
    let mut standalone = StandaloneConfig::new(e.agentctl_path.clone(), e.run_dir.clone());
    standalone.log_dir = Some(e.log_dir.clone());
    standalone.idle_timeout = e.idle_timeout;
    standalone.startup_timeout = e.standalone_startup_timeout;
    standalone.client = client.clone();
    standalone.env = agentctl_env;
    standalone.env.extend(agentctl_telemetry_env(config));
    for (dir, key) in [
        (&e.run_dir, "executors.standalone.run_dir"),
        (&e.log_dir, "executors.standalone.log_dir"),
    ] {
        private_dir(dir, key)?;
        tighten_files(dir);
    }
    if !e.agentctl_path.is_file() {
        tracing::warn!(
            path = %e.agentctl_path.display(),
            "executors.standalone.agentctl_path: no such file; standalone sessions will fail \
             until agentctl is installed there (or set SESSIOND_AGENTCTL_PATH)"
        );
    }
    let standalone_env = standalone.env.clone();
    let mut drivers: Vec<Arc<dyn Executor>> = vec![
        Arc::new(StandaloneExecutor::new(standalone)),
        Arc::new(RemoteExecutor::new(RemoteConfig {
            client: client.clone(),
            backoff: Backoff {
                initial: config.recovery.remote_backoff_initial,
                max: config.recovery.remote_backoff_max,
            },
            ready_deadline: config.recovery.executor_deadline,
            ..RemoteConfig::default()
        })),
    ];
    let mut docker_driver = None;
    if let Some(d) = &e.docker {
        let mut dc = sessiond_executor::docker::DockerConfig::new(
            d.host.clone(),
            d.image.clone(),
            e.run_dir.join("docker"),
        );
        dc.agentctl_path.clone_from(&d.agentctl_path);
        dc.network_mode.clone_from(&d.network_mode);
        dc.user.clone_from(&d.user);
        dc.limits = ResourceLimits {
            memory_bytes: d.memory_bytes,
            nano_cpus: d.nano_cpus,
            pids_limit: d.pids_limit,
        };
        dc.idle_timeout = e.idle_timeout;
        dc.startup_timeout = d.startup_timeout;
        dc.client = client;
        dc.env = agentctl_telemetry_env(config);
        // Worktrees of Docker sessions are made on this host, by the same
        // agentctl standalone sessions use.
        dc.host_agentctl = Some(e.agentctl_path.clone());
        dc.host_env.clone_from(&standalone_env);
        // A bad address is a configuration error; an engine that does not
        // answer is not: the backend starts and recovers everything else,
        // and Docker executors go to error (`docker_unavailable`) until the
        // engine answers (the driver negotiates on its first call).
        let docker = DockerExecutor::new(dc)
            .with_context(|| format!("executors.docker.host: cannot use {}", d.host))?;
        if let Err(e) = docker.engine().await {
            tracing::warn!(host = %d.host, error = %e,
                "the Docker engine does not answer; starting without it: Docker sessions are in \
                 error (docker_unavailable) until it does");
        }
        docker_driver = Some(Arc::new(docker));
    }
    if let Some(docker) = &docker_driver {
        drivers.push(docker.clone());
    }
    tracing::debug!(
        runtimes = ?drivers.iter().map(|d| d.runtime()).collect::<Vec<Runtime>>(),
        "executor drivers"
    );
    Ok((drivers, docker_driver))
}

pub(crate) fn manager_config(
    config: &Config,
    replica_id: String,
    backend: sessiond_store::Backend,
) -> ManagerConfig {
    let r = &config.recovery;
    ManagerConfig {
        replica: sessiond_engine::ReplicaSettings {
            id: replica_id,
            lease_ttl: config.replica.lease_ttl,
            // SQLite is locked to this process (`replica::lock_instance`).
            exclusive: backend == sessiond_store::Backend::Sqlite,
        },
        resume_policy: r.policy,
        recovery_concurrency: r.concurrency,
        executor_deadline: r.executor_deadline,
        resume_cap: r.resume_cap,
        max_attempts: r.max_attempts,
        retry_backoff: Backoff {
            initial: r.retry_backoff_initial,
            max: r.retry_backoff_max,
        },
        agent_restarts: r.agent_restarts,
        cancel_grace: r.cancel_grace,
        launches: sessiond_engine::LaunchLimits {
            initial: r.launch_concurrency,
            max: r.launch_concurrency_max,
        },
        remote_retry_window: r.remote_backoff_window,
        remote_backoff: Backoff {
            initial: r.remote_backoff_initial,
            max: r.remote_backoff_max,
        },
        orphan_sweep_grace: r.orphan_sweep_grace,
        orphan_sweep_interval: Some(r.orphan_sweep_interval),
        liveness_interval: Some(liveness_interval(config.executors.idle_timeout)),
        max_live_sessions: Some(config.limits.max_live_sessions),
        mcp_secrets: config.mcp_secrets.clone(),
        worktrees: sessiond_engine::WorktreeSettings {
            dirs: config
                .executors
                .worktrees_dir
                .iter()
                .map(|d| (Runtime::LocalStandalone, d.clone()))
                .chain(
                    config
                        .executors
                        .docker
                        .iter()
                        .filter_map(|d| d.worktrees_dir.clone())
                        .map(|d| (Runtime::LocalDocker, d)),
                )
                .chain(
                    config
                        .executors
                        .remote_worktrees_dir
                        .iter()
                        .map(|d| (Runtime::Remote, d.clone())),
                )
                .collect(),
            branch_prefix: config.executors.worktree_branch_prefix.clone(),
            roots: config.executors.worktree_roots.clone(),
        },
        ..ManagerConfig::default()
    }
}

/// How often executors are health-checked. An idle session holds no update
/// stream (its pump is parked), so these authenticated `Health` calls are
/// what keeps its agentctl's idle clock from running out: at most a third
/// of `executors.idle_timeout`, and 30 s at most.
fn liveness_interval(idle_timeout: Option<std::time::Duration>) -> std::time::Duration {
    let every = std::time::Duration::from_secs(30);
    match idle_timeout {
        Some(idle) if !idle.is_zero() => every.min(idle / 3),
        _ => every,
    }
}

/// CORS for browsers calling through gRPC-web: bearer tokens travel in the
/// `authorization` header, never in cookies, so credentials stay off. With
/// no origins configured no preflight is allowed (and `AuthLayer` refuses
/// any request that carries an `Origin`).
fn cors_layer(config: &CorsConfig) -> CorsLayer {
    let origin = match &config.allowed_origins {
        AllowedOrigins::Any => AllowOrigin::any(),
        AllowedOrigins::None => AllowOrigin::list(Vec::<HeaderValue>::new()),
        AllowedOrigins::List(list) => {
            AllowOrigin::list(list.iter().filter_map(|o| HeaderValue::from_str(o).ok()))
        }
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
            HeaderName::from_static(crate::error::ERROR_METADATA),
            HeaderName::from_static(crate::error::OWNER_METADATA),
            HeaderName::from_static(crate::error::OWNER_ADDRESS_METADATA),
        ])
        .max_age(config.max_age)
}

/// Counts read from the store at scrape time; every state and status is
/// listed (0 when none) so a series does not vanish when it empties.
pub(crate) fn snapshot_source(
    store: Store,
) -> impl Fn() -> metrics::Snapshot + Send + Sync + 'static {
    use sessiond_domain::{ExecutorStatus, SessionState};
    move || {
        let store = store.clone();
        Box::pin(async move {
            let mut sessions: std::collections::BTreeMap<&'static str, i64> =
                SessionState::ALL.iter().map(|s| (s.as_str(), 0)).collect();
            match store.count_sessions_by_state().await {
                Ok(counts) => {
                    for (state, n) in counts {
                        sessions.insert(state.as_str(), n);
                    }
                }
                Err(err) => tracing::warn!(%err, "metrics: cannot count sessions"),
            }
            let mut executors: std::collections::BTreeMap<(String, &'static str), i64> =
                Runtime::ALL
                    .iter()
                    .flat_map(|r| {
                        ExecutorStatus::ALL
                            .iter()
                            .map(|s| ((r.to_string(), s.as_str()), 0))
                    })
                    .collect();
            match store.count_executors_by_runtime_and_status().await {
                Ok(counts) => {
                    for (runtime, status, n) in counts {
                        executors.insert((runtime.to_string(), status.as_str()), n);
                    }
                }
                Err(err) => tracing::warn!(%err, "metrics: cannot count executors"),
            }
            let permission_requests_pending = store
                .count_open_parts(sessiond_domain::MessageKind::Permission)
                .await
                .unwrap_or_else(|err| {
                    tracing::warn!(%err, "metrics: cannot count permission requests");
                    0
                });
            metrics::StoreCounts {
                permission_requests_pending,
                sessions: sessions.into_iter().collect(),
                executors: executors.into_iter().map(|((r, s), n)| (r, s, n)).collect(),
            }
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

/// Resolves on SIGTERM or ctrl-c (SIGINT).
fn shutdown_signal() -> impl Future<Output = ()> {
    // Registered now, not at the first poll: `serve` polls this only once
    // it waits for its database or serves, and a SIGTERM in between must
    // not take the signal's default action (helper-59 4).
    #[cfg(unix)]
    let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate());
    #[cfg(unix)]
    let interrupt = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt());
    async move {
        #[cfg(unix)]
        match (term, interrupt) {
            (Ok(mut term), Ok(mut interrupt)) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = interrupt.recv() => {}
                }
            }
            (Ok(mut term), Err(_)) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            (Err(err), _) => {
                tracing::warn!(%err, "cannot listen for SIGTERM; only ctrl-c stops the server");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
        tracing::info!("shutdown requested; finishing in-flight calls");
    }
}

/// What agentctl needs to continue our traces (and log like us): the same
/// collector and ratio (a sampled parent is followed anyway).
fn agentctl_telemetry_env(config: &Config) -> Vec<(String, String)> {
    let mut env = Vec::new();
    if let Some(endpoint) = &config.otlp_endpoint {
        env.push(("AGENTCTL_OTLP_ENDPOINT".to_owned(), endpoint.clone()));
        env.push((
            "AGENTCTL_TRACE_SAMPLE_RATIO".to_owned(),
            config.trace_sample_ratio.to_string(),
        ));
    }
    if config.log_json {
        env.push(("AGENTCTL_LOG_JSON".to_owned(), "true".to_owned()));
    }
    env
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{command_on_host, liveness_interval, redact, tcp_incoming};

    #[test]
    fn a_command_is_found_by_path_or_on_path() {
        assert!(command_on_host("sh"));
        assert!(command_on_host("/bin/sh"));
        assert!(!command_on_host("/nonexistent/agent"));
        assert!(!command_on_host("definitely-not-a-command-xyz"));
        // A directory or a file that is not executable is not a program.
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("notes.txt");
        std::fs::write(&plain, "not a program").unwrap();
        assert!(!command_on_host(dir.path().to_str().unwrap()));
        assert!(!command_on_host(plain.to_str().unwrap()));
    }

    #[tokio::test]
    async fn accepted_connections_have_nagle_off() {
        use tokio_stream::StreamExt as _;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let mut incoming = tcp_incoming(listener);
        let _client = tokio::net::TcpStream::connect(address).await.unwrap();
        let accepted = incoming.next().await.unwrap().unwrap();
        assert!(accepted.nodelay().unwrap(), "TCP_NODELAY is not set");
    }

    #[test]
    fn liveness_feeds_the_agentctl_idle_clock() {
        assert_eq!(liveness_interval(None), Duration::from_secs(30));
        assert_eq!(
            liveness_interval(Some(Duration::ZERO)),
            Duration::from_secs(30)
        );
        assert_eq!(
            liveness_interval(Some(Duration::from_secs(60))),
            Duration::from_secs(20)
        );
        assert_eq!(
            liveness_interval(Some(Duration::from_secs(1800))),
            Duration::from_secs(30)
        );
    }

    #[test]
    fn redacts_postgres_password() {
        assert_eq!(redact("postgres://u:secret@h/db"), "postgres://u:***@h/db");
        assert_eq!(redact("postgres://u@h/db"), "postgres://u@h/db");
        assert_eq!(redact("/tmp/x.sqlite3"), "/tmp/x.sqlite3");
    }
}
