//! The embedding API: [`Sessiond`] built from a [`Config`] (or from its
//! parts), yielding the tonic services to mount in any router, and the
//! startup and shutdown steps `sessiond serve` runs around them.

use std::{
    convert::Infallible,
    sync::{Arc, Mutex},
    task::{Context as TaskContext, Poll},
    time::Duration,
};

use anyhow::Context;
use chrono::Utc;
#[cfg(feature = "test-hooks")]
use sessiond_engine::PassGate;
use sessiond_engine::SessionManager;
use sessiond_executor::{Backoff, ClientConfig, Executor};
use sessiond_proto::sessiond::v1::{
    session_service_server::SessionServiceServer, workspace_service_server::WorkspaceServiceServer,
};
use sessiond_store::Store;
use tonic::{body::Body, server::NamedService};
use tonic_health::{
    ServingStatus,
    pb::health_server::HealthServer,
    server::{HealthReporter, HealthService},
};
use tower::util::BoxCloneSyncService;

use crate::{
    api::{Api, ApiSettings},
    config::Config,
    metrics::Metrics,
    replica::InstanceLock,
    serve,
};

/// Largest gRPC message the workspace service decodes (WriteFile content).
const MAX_WORKSPACE_MESSAGE: usize = 64 * 1024 * 1024;

/// Services whose health follows startup recovery ("" is the whole server).
pub(crate) const HEALTH_SERVICES: &[&str] = &[
    "",
    "sessiond.v1.SessionService",
    "sessiond.v1.WorkspaceService",
];

/// Why sessiond could not be built or started: the message names the
/// configuration key or resource at fault and what to do (`{:#}` prints the
/// whole chain of causes).
#[derive(Debug, thiserror::Error)]
#[error("{0:#}")]
pub struct Error(anyhow::Error);

impl From<anyhow::Error> for Error {
    fn from(e: anyhow::Error) -> Self {
        // One of ours that passed through anyhow comes back as itself: a
        // nested one would print its chain twice.
        match e.downcast::<Error>() {
            Ok(ours) => ours,
            Err(e) => Error(e),
        }
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The runtimes drivers serve (the configuration's built-in ones plus the
/// embedder's) must hold `executors.default_runtime`, and no runtime may
/// have two embedder drivers.
fn check_runtimes(config: &Config, executors: &[Arc<dyn Executor>]) -> anyhow::Result<()> {
    use sessiond_domain::Runtime;
    let mut runtimes = vec![Runtime::LocalStandalone, Runtime::Remote];
    if config.executors.docker.is_some() {
        runtimes.push(Runtime::LocalDocker);
    }
    let mut registered = std::collections::HashSet::new();
    for driver in executors {
        let runtime = driver.runtime();
        if !registered.insert(runtime) {
            anyhow::bail!(
                "two executor drivers are registered for runtime {runtime}; register one driver \
                 per runtime"
            );
        }
        if !runtimes.contains(&runtime) {
            runtimes.push(runtime);
        }
    }
    let default = config.executors.default_runtime;
    if !runtimes.contains(&default) {
        runtimes.sort();
        let names: Vec<String> = runtimes.iter().map(Runtime::to_string).collect();
        anyhow::bail!(
            "executors.default_runtime: no executor driver is registered for {default} (registered \
             runtimes: {}); a custom runtime's driver is registered by the service that embeds \
             sessiond (Sessiond::builder(config).executor(...)): the sessiond binary drives only \
             the built-in runtimes",
            names.join(", ")
        );
    }
    Ok(())
}

/// Builds a [`Sessiond`]: see [`Sessiond::builder`].
#[must_use = "a builder does nothing until `build` is awaited"]
pub struct SessiondBuilder {
    config: Config,
    store: Option<Store>,
    executors: Vec<Arc<dyn Executor>>,
    agentctl_env: Option<Vec<(String, String)>>,
    /// `serve`: a PostgreSQL that does not answer yet is waited for, its
    /// last error told here.
    wait_for_database: Option<tokio::sync::watch::Sender<Option<String>>>,
    #[cfg(feature = "test-hooks")]
    recovery_gate: Option<PassGate>,
    #[cfg(feature = "test-hooks")]
    heartbeat_gate: Option<PassGate>,
}

impl std::fmt::Debug for SessiondBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessiondBuilder")
            .field("config", &self.config)
            .field("store", &self.store.is_some())
            .field("executors", &self.executors)
            .finish_non_exhaustive()
    }
}

impl SessiondBuilder {
    /// The configuration it builds with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Uses this store instead of opening `config.database_url` (the
    /// migrations ran when it was connected). The instance lock of a SQLite
    /// `database_url` is still taken, so point `database_url` at the same
    /// database.
    pub fn store(mut self, store: Store) -> Self {
        self.store = Some(store);
        self
    }

    /// A PostgreSQL that does not answer yet (starting with the machine,
    /// restarting) is waited for instead of failing the build: what
    /// `sessiond serve` does, so that a supervisor is not needed to order
    /// it after the database. Each failed attempt's error is sent to `told`.
    pub(crate) fn waiting_for_database(
        mut self,
        told: tokio::sync::watch::Sender<Option<String>>,
    ) -> Self {
        self.wait_for_database = Some(told);
        self
    }

    /// Registers an executor driver. It serves the runtime its
    /// [`Executor::runtime`] names: a built-in one's name replaces the
    /// driver the configuration would make for it; a custom name
    /// (`Runtime::Custom`) adds a runtime that `CreateSession` accepts by
    /// `runtime_name`. Sessions of that runtime are launched, recovered,
    /// resumed and stopped through it by the same recovery step machine as
    /// the built-in drivers. [`Self::build`] fails when two drivers are
    /// registered for one runtime.
    pub fn executor(mut self, executor: Arc<dyn Executor>) -> Self {
        self.executors.push(executor);
        self
    }

    /// The environment a standalone agentctl starts with (it inherits
    /// nothing else). Default: [`inherited_agentctl_env`].
    pub fn agentctl_env(mut self, env: Vec<(String, String)>) -> Self {
        self.agentctl_env = Some(env);
        self
    }

    /// Makes the startup recovery pass await `gate` before it takes up each
    /// executor (calls on a session still recover theirs): a test hook
    /// (feature `test-hooks`).
    #[cfg(feature = "test-hooks")]
    pub fn recovery_gate(mut self, gate: PassGate) -> Self {
        self.recovery_gate = Some(gate);
        self
    }

    /// Makes each replica heartbeat await `gate` first: a test hook
    /// (feature `test-hooks`; a fencing test holds a resumed replica before
    /// its first heartbeat).
    #[cfg(feature = "test-hooks")]
    pub fn heartbeat_gate(mut self, gate: PassGate) -> Self {
        self.heartbeat_gate = Some(gate);
        self
    }

    /// Takes the instance lock, opens the store (migrating it), stores the
    /// configured agent profiles, builds the executor drivers and the
    /// session manager, and the services — NOT_SERVING until
    /// [`Sessiond::start`]'s first recovery pass is done.
    pub async fn build(self) -> Result<Sessiond> {
        Ok(self.build_inner().await?)
    }

    async fn build_inner(self) -> anyhow::Result<Sessiond> {
        let config = self.config;
        // Before anything is opened: a driver registered twice or a default
        // runtime nothing drives is a mistake of the embedder's (or of the
        // configuration of the binary, which registers no custom runtime).
        check_runtimes(&config, &self.executors)?;
        // Before the store is opened: a second sessiond on the same SQLite
        // file (or data directory) stops here, having touched nothing.
        let instance_lock = crate::replica::lock_instance(&config)?;
        let store = match (self.store, self.wait_for_database) {
            (Some(store), _) => store,
            (None, Some(told)) => serve::open_store_waiting(&config, &told).await?,
            (None, None) => serve::open_store(&config).await?,
        };
        serve::seed_profiles(&store, &config).await?;
        let agentctl_env = self.agentctl_env.unwrap_or_else(inherited_agentctl_env);
        let (mut drivers, mut docker) = serve::drivers(&config, agentctl_env).await?;
        for custom in self.executors {
            let runtime = custom.runtime();
            drivers.retain(|d| d.runtime() != runtime);
            if runtime == sessiond_domain::Runtime::LocalDocker {
                // The orphan sweep is the built-in Docker driver's.
                docker = None;
            }
            tracing::info!(%runtime, driver = ?custom, "executor driver registered by the embedder");
            drivers.push(custom);
        }
        let replica_id = crate::replica::replica_id(&config)?;
        let manager = SessionManager::new(
            store.clone(),
            drivers,
            serve::manager_config(&config, replica_id.clone(), store.backend()),
        );
        // Calls answer from the moment we listen; one on a session the first
        // pass has not reached yet recovers that session first.
        manager.recovery().expect_startup_recovery();
        #[cfg(feature = "test-hooks")]
        {
            if let Some(gate) = self.recovery_gate {
                manager.recovery().gate_recovery_pass(gate);
            }
            if let Some(gate) = self.heartbeat_gate {
                manager.replica().gate_heartbeat(gate);
            }
        }
        if let Some(docker) = docker {
            // Waits for the first recovery pass and the grace period itself.
            manager.recovery().start_orphan_sweep(docker);
        }
        // Local agentctls ring here when their agent exits.
        let doorbell = config
            .executors
            .run_dir
            .join(sessiond_executor::standalone::DOORBELL_FILE);
        if let Err(e) = manager.recovery().listen_doorbell(&doorbell) {
            tracing::warn!(path = %doorbell.display(), error = %e,
                "no doorbell: an idle session's agent exit is seen at the next liveness check");
        }

        let health = HealthReporter::new();
        for service in HEALTH_SERVICES {
            health
                .set_service_status(*service, ServingStatus::NotServing)
                .await;
        }
        let health_service = HealthServer::new(HealthService::from_health_reporter(health.clone()));

        // The descriptor set also holds agentctl's protocol: list only what we serve.
        let mut reflection = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(sessiond_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET);
        for service in crate::metrics::SERVED_SERVICES {
            reflection = reflection.with_service_name(*service);
        }
        let reflection = ReflectionService(BoxCloneSyncService::new(
            reflection
                .build_v1()
                .context("building the reflection service")?,
        ));

        let metrics = Metrics::new(Some(Box::new(serve::snapshot_source(store.clone()))), |r| {
            manager.metrics().register(r)
        });
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let api = Api::new(
            manager.clone(),
            ApiSettings {
                default_runtime: config.executors.default_runtime,
                default_agent: config.default_agent.clone(),
                max_message_bytes: config.max_message_bytes,
                worktree_roots: config.executors.worktree_roots.clone(),
                repositories: config.executors.repositories.clone(),
                remote_allowed_hosts: config.executors.remote_allowed_hosts.clone(),
                watch_limits: crate::limits::WatchLimits::new(
                    config.limits.max_watch_streams,
                    config.limits.max_watch_streams_per_token,
                ),
                workspace_client: ClientConfig {
                    connect_timeout: config.executors.connect_timeout,
                    call_timeout: Duration::from_secs(15 * 60),
                    ..serve::client_config(&config)?
                },
                peers: crate::forward::Peers::new(
                    replica_id.clone(),
                    serve::forward_policy(&config),
                    MAX_WORKSPACE_MESSAGE.max(
                        config.max_message_bytes
                            + sessiond_engine::attachments::MAX_ATTACHMENT_BYTES
                            + 64 * 1024,
                    ),
                )
                .with_tls(serve::peer_tls(&config)?),
            },
            stop_rx.clone(),
        );
        // Decode a little more than the content and attachment limits so an
        // oversized message is answered INVALID_ARGUMENT naming the limit,
        // not RESOURCE_EXHAUSTED.
        let session = SessionServiceServer::new(api.clone()).max_decoding_message_size(
            (config.max_message_bytes
                + sessiond_engine::attachments::MAX_ATTACHMENT_BYTES
                + 64 * 1024)
                .max(4 * 1024 * 1024),
        );
        let workspace =
            WorkspaceServiceServer::new(api).max_decoding_message_size(MAX_WORKSPACE_MESSAGE);

        Ok(Sessiond {
            config,
            store,
            manager,
            replica_id,
            health,
            services: Services {
                session,
                workspace,
                health: health_service,
                reflection,
            },
            metrics,
            stop_tx,
            stop_rx,
            recovery: Mutex::new(None),
            instance_lock: Mutex::new(instance_lock),
        })
    }
}

/// An embeddable sessiond: the session manager over a store and executor
/// drivers, and the gRPC services over it.
///
/// The life of one, which is what [`crate::serve`] does around a tonic
/// server of its own:
///
/// 1. [`Sessiond::builder`]`(config)…`[`build`](SessiondBuilder::build)`()`;
/// 2. mount [`Sessiond::services`] in your router, with your layers
///    (authentication: sessiond's own is [`crate::AuthLayer`]), and listen;
/// 3. [`Sessiond::start`]`(address)`: registers this replica and runs the
///    startup recovery pass; health turns SERVING when it is done;
/// 4. on shutdown, [`Sessiond::shutdown`] (NOT_SERVING, watch streams end),
///    stop your server ([`Sessiond::stopped`] resolves then), and
///    [`Sessiond::release`] (hands this replica's executors to the others
///    and drops the instance lock). Executors keep running for the next
///    start to reattach.
///
/// ```no_run
/// # async fn run(config: sessiond_server::config::Config) -> Result<(), Box<dyn std::error::Error>> {
/// let sessiond = sessiond_server::Sessiond::builder(config).build().await?;
/// let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
/// let address = listener.local_addr()?;
/// let services = sessiond.services();
/// let server = tonic::transport::Server::builder()
///     .add_service(services.health)
///     .add_service(services.reflection)
///     .add_service(services.session)
///     .add_service(services.workspace)
///     // Nagle off: a reply written in parts would otherwise wait for
///     // the client's delayed ACK (40 ms).
///     .serve_with_incoming_shutdown(
///         tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
///         sessiond.stopped(),
///     );
/// let server = tokio::spawn(server);
/// sessiond.start(&address.to_string()).await?;
/// tokio::signal::ctrl_c().await?;
/// sessiond.shutdown().await;
/// server.await??;
/// sessiond.release().await;
/// # Ok(())
/// # }
/// ```
pub struct Sessiond {
    config: Config,
    store: Store,
    manager: SessionManager,
    replica_id: String,
    health: HealthReporter,
    services: Services,
    metrics: Metrics,
    stop_tx: tokio::sync::watch::Sender<bool>,
    stop_rx: tokio::sync::watch::Receiver<bool>,
    recovery: Mutex<Option<tokio::task::JoinHandle<()>>>,
    instance_lock: Mutex<Option<InstanceLock>>,
}

impl std::fmt::Debug for Sessiond {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sessiond")
            .field("replica_id", &self.replica_id)
            .field("backend", &self.store.backend())
            .finish_non_exhaustive()
    }
}

/// The gRPC services of one [`Sessiond`], each ready for
/// `tonic::transport::Server::add_service` (or a `tonic::service::Routes`).
/// They carry no authentication: put your own layer around them, or
/// sessiond's [`crate::AuthLayer`].
#[derive(Debug, Clone)]
pub struct Services {
    /// `sessiond.v1.SessionService`.
    pub session: SessionServiceServer<Api>,
    /// `sessiond.v1.WorkspaceService`.
    pub workspace: WorkspaceServiceServer<Api>,
    /// `grpc.health.v1.Health`: NOT_SERVING for "" and both sessiond
    /// services until the first recovery pass is done, and again from
    /// [`Sessiond::shutdown`].
    pub health: HealthServer<HealthService>,
    /// `grpc.reflection.v1.ServerReflection`, listing the four services.
    pub reflection: ReflectionService,
}

impl Services {
    /// All four services as one `tonic::service::Routes`, e.g. for
    /// `Server::builder().add_routes(...)` or an axum router.
    pub fn into_routes(self) -> tonic::service::Routes {
        tonic::service::Routes::new(self.health)
            .add_service(self.reflection)
            .add_service(self.session)
            .add_service(self.workspace)
    }
}

/// `grpc.reflection.v1.ServerReflection` over sessiond's descriptors.
#[derive(Clone)]
pub struct ReflectionService(
    BoxCloneSyncService<http::Request<Body>, http::Response<Body>, Infallible>,
);

impl std::fmt::Debug for ReflectionService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReflectionService")
    }
}

impl NamedService for ReflectionService {
    const NAME: &'static str = "grpc.reflection.v1.ServerReflection";
}

impl tower::Service<http::Request<Body>> for ReflectionService {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = <BoxCloneSyncService<http::Request<Body>, http::Response<Body>, Infallible> as tower::Service<http::Request<Body>>>::Future;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), Infallible>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        self.0.call(request)
    }
}

impl Sessiond {
    /// A builder over a validated configuration (see [`crate::config`]).
    pub fn builder(config: Config) -> SessiondBuilder {
        SessiondBuilder {
            config,
            store: None,
            executors: Vec::new(),
            agentctl_env: None,
            wait_for_database: None,
            #[cfg(feature = "test-hooks")]
            recovery_gate: None,
            #[cfg(feature = "test-hooks")]
            heartbeat_gate: None,
        }
    }

    /// The configuration it was built with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The session manager: create, prompt, watch, resume and end sessions
    /// from Rust, without gRPC (the services call the same methods).
    pub fn manager(&self) -> &SessionManager {
        &self.manager
    }

    /// The store it uses.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// This replica's id (configured, or kept in `<data_dir>/replica-id`).
    pub fn replica_id(&self) -> &str {
        &self.replica_id
    }

    /// The gRPC services, to mount in a router (clones: cheap).
    pub fn services(&self) -> Services {
        self.services.clone()
    }

    /// The health reporter behind [`Services::health`], to report the
    /// embedder's own services beside sessiond's.
    pub fn health_reporter(&self) -> HealthReporter {
        self.health.clone()
    }

    pub(crate) fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Resolves once [`Sessiond::shutdown`] was called: the shutdown signal
    /// for the server the services are mounted in.
    pub fn stopped(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.stop_rx.clone();
        async move {
            let _ = rx.wait_for(|stopped| *stopped).await;
        }
    }

    /// Registers this replica under `address` (where other replicas and
    /// clients reach its API; `replica.advertise_address` wins when set,
    /// and it is `https://` when `[tls]` is set), then runs the startup
    /// recovery pass in the background, retrying a database failure;
    /// health turns SERVING once it is done. Call it once the services
    /// answer calls.
    pub async fn start(&self, address: &str) -> Result<()> {
        let advertised = self
            .config
            .replica
            .advertised(address, self.config.tls.is_some());
        self.manager
            .replica()
            .start(sessiond_store::ReplicaInfo {
                id: self.replica_id.clone(),
                address: advertised.clone(),
                hostname: crate::replica::hostname(),
                pid: i64::from(std::process::id()),
                started_at: Utc::now(),
                heartbeat_at: Utc::now(),
                lease_ttl: self.config.replica.lease_ttl,
                owned_executors: 0,
            })
            .await
            .context("registering this replica in the database")?;
        tracing::info!(
            replica = %self.replica_id,
            address = %advertised,
            lease_ttl = ?self.config.replica.lease_ttl,
            exclusive = self.manager.config().replica.exclusive,
            "replica registered"
        );
        let recovery = {
            let manager = self.manager.clone();
            let metrics = self.metrics.clone();
            let health = self.health.clone();
            tokio::spawn(async move {
                // SERVING once every workspace is back; agents that relaunch
                // go on behind it (their sessions say `recovering`).
                let serving = async {
                    manager.recovery().wait_workspaces_recovered().await;
                    load_status_snapshot(&manager).await;
                    for service in HEALTH_SERVICES {
                        health
                            .set_service_status(*service, ServingStatus::Serving)
                            .await;
                    }
                    metrics.set_ready(true);
                    tracing::info!("serving");
                };
                tokio::join!(first_recovery(&manager, &metrics), serving);
            })
        };
        if let Some(old) = self
            .recovery
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .replace(recovery)
        {
            old.abort();
        }
        Ok(())
    }

    /// Whether the first recovery pass has every workspace back (health is
    /// SERVING); agents may still be relaunching, their sessions showing
    /// `recovering` with their progress.
    pub fn is_ready(&self) -> bool {
        self.manager.recovery().workspaces_recovered()
    }

    /// Begins the shutdown: health NOT_SERVING (then its Watch streams
    /// end, and Check answers NOT_FOUND), watch streams end,
    /// [`Sessiond::stopped`] resolves, and the manager stops its
    /// background work. Executors keep running.
    pub async fn shutdown(&self) {
        if let Some(recovery) = self
            .recovery
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            recovery.abort();
        }
        self.metrics.set_ready(false);
        for service in HEALTH_SERVICES {
            self.health
                .set_service_status(*service, ServingStatus::NotServing)
                .await;
        }
        // Then health Watch streams end (their statuses cleared, the
        // streams close): one left open held the stop for the whole
        // shutdown grace (helper-60 F1).
        let mut health = self.health.clone();
        for service in HEALTH_SERVICES {
            health.clear_service_status(service).await;
        }
        let _ = self.stop_tx.send(true);
        self.manager.shutdown();
    }

    /// Ends the shutdown, once the server stopped: releases this replica's
    /// executor leases, so the other replicas adopt them on their next round
    /// instead of after the lease TTL, and drops the instance lock.
    pub async fn release(self) {
        // After the calls ended, so nothing of ours acts on an executor
        // another replica took.
        match self.manager.replica().release_leases().await {
            Ok(0) => {}
            Ok(n) => tracing::info!(executors = n, "leases released for the other replicas"),
            Err(e) => tracing::warn!(error = %e, "leases not released; others adopt after the TTL"),
        }
        drop(
            self.instance_lock
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(),
        );
    }
}

/// Startup recovery's first pass; a database failure is retried, the
/// server answering NOT_SERVING meanwhile.
async fn first_recovery(manager: &SessionManager, metrics: &Metrics) {
    let mut attempt = 0;
    loop {
        match manager.recovery().recover_all().await {
            Ok(summary) => {
                let counts: Vec<(String, u64)> = summary
                    .counts
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), *v as u64))
                    .chain(
                        (summary.failed > 0).then(|| ("failed".to_owned(), summary.failed as u64)),
                    )
                    .collect();
                metrics.record_recovery(summary.duration, &counts);
                break;
            }
            Err(err) => {
                let delay = Backoff::default().delay(attempt);
                attempt += 1;
                tracing::error!(%err, retry_in = ?delay, "startup recovery failed; retrying");
                tokio::time::sleep(delay).await;
            }
        }
    }
}

/// GetSessionStatus from memory from the first call, not one store round
/// trip per session the first time each is asked.
async fn load_status_snapshot(manager: &SessionManager) {
    let t = std::time::Instant::now();
    match manager.load_status_snapshot().await {
        Ok(n) => tracing::info!(
            sessions = n,
            took_ms = t.elapsed().as_millis() as u64,
            "status snapshot loaded"
        ),
        // Not fatal: each session then loads on its first status call.
        Err(e) => tracing::warn!(error = %e, "status snapshot not loaded"),
    }
}

/// What a standalone agentctl inherits from this process: enough to find
/// programs and behave, and its log filter; never tokens, database URLs or
/// anything else `SESSIOND_*` (agentctl passes a subset on to the agent and
/// commands). Reads this process's environment: the builder's default.
pub fn inherited_agentctl_env() -> Vec<(String, String)> {
    const PASSED: &[&str] = &[
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "LANG",
        "LANGUAGE",
        "LC_ALL",
        "LC_CTYPE",
        "TZ",
        "TMPDIR",
        "TERM",
        "AGENTCTL_LOG",
    ];
    PASSED
        .iter()
        .filter_map(|k| std::env::var(k).ok().map(|v| ((*k).to_owned(), v)))
        .collect()
}
