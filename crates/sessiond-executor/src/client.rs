//! The authenticated agentctl client every driver hands out.
//!
//! Every call carries the executor's secret (`authorization: Bearer ...`) and a
//! deadline of its own, sent to agentctl as `grpc-timeout` and enforced on this
//! side too; connecting has its own timeout. The deadline fits the call:
//! `Health` and `Capabilities` get the short [`ClientConfig::call_timeout`],
//! calls that wait for the agent or a command get their own time budget plus
//! that much margin (see [`default_deadline`]). An agentctl that accepts the
//! TCP connection and then never answers therefore surfaces as
//! [`Error::Timeout`] once the call's deadline passes, never as a hang.
//!
//! Messages of up to [`MAX_MESSAGE_BYTES`] go both ways (agentctl uses the
//! same limit): file reads of 16 MiB and git output of 32 MiB do not fit
//! tonic's default of 4 MiB.

use std::{
    fmt,
    sync::{
        Arc,
        atomic::{AtomicI64, Ordering},
    },
    time::Duration,
};

use sessiond_domain::ExecutorId;
use sessiond_proto::agentctl::v1::{self as pb, agent_ctl_service_client::AgentCtlServiceClient};
use tonic::{
    metadata::{Ascii, MetadataValue},
    service::{Interceptor, interceptor::InterceptedService},
    transport::{Channel, Endpoint},
};

use crate::error::{Error, Result};

pub use pb::AgentState;

/// Largest gRPC message the client sends or accepts (64 MiB), the same limit
/// agentctl applies (`agentctl::service::MAX_MESSAGE_BYTES`).
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// Request metadata naming the agentctl instance a `StreamUpdates` cursor
/// belongs to (see `proto/agentctl/v1`).
pub const INSTANCE_ID_METADATA: &str = "agentctl-instance-id";

/// Request metadata carrying the lease epoch (fencing token) of the
/// sessiond replica that owns the executor (see `proto/agentctl/v1`):
/// agentctl refuses a call whose epoch is older than the newest it has seen
/// (FAILED_PRECONDITION, message starting with [`STALE_EPOCH`]).
pub const LEASE_EPOCH_METADATA: &str = "sessiond-lease-epoch";

/// How agentctl's refusal of an older lease epoch begins.
pub const STALE_EPOCH: &str = "stale_epoch";

/// No epoch set: calls go without [`LEASE_EPOCH_METADATA`].
const NO_EPOCH: i64 = -1;

/// agentctl's own limits, which the per-call deadlines are built from.
mod budget {
    use std::time::Duration;
    /// An agent's launch (`initialize`) and its session calls (`session/new`,
    /// `session/load`, `session/resume`): agentctl cuts them for silence
    /// (no line written, no CPU used), not for taking long, within a cap of
    /// ten minutes (agentctl's `signs::SETUP_CAP`). The caller judges
    /// silence itself (sessiond's recovery polls `Health`); the deadline
    /// only covers that cap.
    pub const INITIALIZE: Duration = Duration::from_secs(600);
    /// See [`INITIALIZE`].
    pub const SESSION_SETUP: Duration = Duration::from_secs(600);
    /// `StopAgent` grace when `grace_ms` is 0.
    pub const STOP_GRACE: Duration = Duration::from_secs(3);
    /// How long agentctl waits for the process after KILL.
    pub const AFTER_KILL: Duration = Duration::from_secs(5);
    /// `Exec` when `timeout_ms` is 0.
    pub const EXEC: Duration = Duration::from_secs(60);
    /// git commands.
    pub const GIT: Duration = Duration::from_secs(60);
    /// Moving up to 64 MiB of file content.
    pub const FILE_TRANSFER: Duration = Duration::from_secs(30);
}

/// The deadline a call to agentctl's `method` gets when its caller gives
/// none: `call_timeout` for quick calls; for calls that wait on the agent, a
/// command or git, agentctl's own default limit for them plus `call_timeout`
/// as margin. `None` for `StreamUpdates`, which stays open indefinitely.
pub fn default_deadline(method: &str, call_timeout: Duration) -> Option<Duration> {
    let own = match method {
        "StreamUpdates" => return None,
        "LaunchAgent" => budget::INITIALIZE,
        "NewSession" | "ResumeSession" => budget::SESSION_SETUP,
        "StopAgent" => budget::STOP_GRACE + budget::AFTER_KILL,
        "Exec" => budget::EXEC,
        "GitStatus" | "GitDiff" => budget::GIT,
        "ReadFile" | "WriteFile" => budget::FILE_TRANSFER,
        // Health, Capabilities, Prompt (returns at once), Cancel, ListDir.
        _ => Duration::ZERO,
    };
    Some(own + call_timeout)
}

/// `request` with `deadline`: sent to agentctl as `grpc-timeout` and enforced
/// by this side's channel. For callers of the generated client that need a
/// longer (or shorter) deadline than [`default_deadline`].
pub fn with_deadline<T>(message: T, deadline: Duration) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(deadline);
    request
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn or_default(ms: u64, default: Duration) -> Duration {
    if ms == 0 {
        default
    } else {
        Duration::from_millis(ms)
    }
}

/// How the backend talks to agentctl: timeouts and transport security.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Limit for establishing the connection (Unix socket, TCP, TLS).
    pub connect_timeout: Duration,
    /// Deadline of the quick calls (`Health`, `Capabilities`, `Prompt`,
    /// `Cancel`, `ListDir`), and the margin added to the own time budget of
    /// the others (see [`default_deadline`]). Sent to agentctl as
    /// `grpc-timeout` and enforced on this side as well.
    pub call_timeout: Duration,
    /// HTTP/2 keep-alive pings on idle connections, so a dead peer under a
    /// long update stream is noticed.
    pub keep_alive_interval: Duration,
    /// TLS for `https://` agentctl URLs (remote executors).
    pub tls: Option<TlsConfig>,
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(2),
            call_timeout: Duration::from_secs(5),
            keep_alive_interval: Duration::from_secs(20),
            tls: None,
        }
    }
}

/// Trust settings for an `https://` agentctl.
#[derive(Clone)]
pub struct TlsConfig {
    /// PEM of the CA that signed agentctl's certificate.
    pub ca_pem: Vec<u8>,
    /// Name to verify the certificate against, when it differs from the URL host.
    pub domain_name: Option<String>,
    /// PEM certificate and key sessiond presents to agentctls that require
    /// client certificates (`agentctl --tls-client-ca`).
    pub client_identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl TlsConfig {
    /// Reads the CA certificate from a PEM file. For binaries building their
    /// configuration; the library itself reads no files.
    pub fn from_ca_file(path: &std::path::Path) -> Result<Self> {
        let ca_pem = std::fs::read(path).map_err(|source| Error::Io {
            action: "reading CA file",
            path: path.to_owned(),
            source,
        })?;
        Ok(Self {
            ca_pem,
            domain_name: None,
            client_identity: None,
        })
    }

    /// Adds the client certificate and key read from PEM files.
    pub fn with_client_identity_files(
        mut self,
        cert: &std::path::Path,
        key: &std::path::Path,
    ) -> Result<Self> {
        let read = |path: &std::path::Path, action| {
            std::fs::read(path).map_err(|source| Error::Io {
                action,
                path: path.to_owned(),
                source,
            })
        };
        self.client_identity = Some((
            read(cert, "reading client certificate")?,
            read(key, "reading client key")?,
        ));
        Ok(self)
    }
}

impl fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsConfig")
            .field("ca_pem_bytes", &self.ca_pem.len())
            .field("domain_name", &self.domain_name)
            .field("client_identity", &self.client_identity.is_some())
            .finish()
    }
}

/// Adds `authorization: Bearer <secret>` and the lease epoch (when one is
/// set) to every request, and a deadline ([`default_deadline`] of the
/// method) to every request that has none yet.
#[derive(Clone)]
pub struct BearerAuth {
    header: MetadataValue<Ascii>,
    call_timeout: Duration,
    epoch: Arc<AtomicI64>,
}

impl fmt::Debug for BearerAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("BearerAuth(<redacted>)")
    }
}

impl Interceptor for BearerAuth {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        request
            .metadata_mut()
            .insert("authorization", self.header.clone());
        let epoch = self.epoch.load(Ordering::SeqCst);
        if epoch >= 0 {
            request
                .metadata_mut()
                .insert(LEASE_EPOCH_METADATA, MetadataValue::from(epoch));
        }
        inject_trace_context(request.metadata_mut());
        if request.metadata().get("grpc-timeout").is_none() {
            let method = request
                .extensions()
                .get::<tonic::GrpcMethod<'static>>()
                .map(|m| m.method().to_owned());
            let deadline = match method {
                Some(method) => default_deadline(&method, self.call_timeout),
                None => Some(self.call_timeout),
            };
            if let Some(deadline) = deadline {
                request.set_timeout(deadline);
            }
        }
        Ok(request)
    }
}

/// Sets the metadata keys of the propagator the binary installed (W3C
/// `traceparent`, `tracestate`).
struct MetadataInjector<'a>(&'a mut tonic::metadata::MetadataMap);

impl opentelemetry::propagation::Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(key), Ok(value)) = (
            tonic::metadata::MetadataKey::from_bytes(key.as_bytes()),
            MetadataValue::try_from(value),
        ) {
            self.0.insert(key, value);
        }
    }
}

/// Passes the current span's trace context on to agentctl, which continues
/// the trace (its server span is a child of ours). Nothing is added when no
/// OpenTelemetry layer or propagator is installed.
fn inject_trace_context(metadata: &mut tonic::metadata::MetadataMap) {
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let cx = tracing::Span::current().context();
    opentelemetry::global::get_text_map_propagator(|p| {
        p.inject_context(&cx, &mut MetadataInjector(metadata));
    });
}

/// The generated client with authentication applied; all agentctl RPCs.
pub type RawClient = AgentCtlServiceClient<InterceptedService<Channel, BearerAuth>>;

/// What `Health` says about an agentctl.
#[derive(Debug, Clone, PartialEq)]
pub struct Health {
    /// The executor id agentctl was started with; compared with the record's
    /// by [`AgentctlClient::verify_identity`].
    pub executor_id: String,
    /// agentctl's version (its crate version).
    pub agentctl_version: String,
    /// What the agent process is doing (none, starting, idle, busy, exited);
    /// recovery reattaches to an idle or busy agent without a resume.
    pub agent_state: AgentState,
    /// agentctl's own process id as it sees it (in a container: its namespace's).
    pub pid: u32,
    /// How long this agentctl process has run.
    pub uptime: Duration,
    /// Random id of this agentctl process, fresh at every start: update
    /// cursors belong to it (see [`AgentctlClient::stream_updates`]). Empty
    /// from an agentctl too old to report one.
    pub instance_id: String,
    /// The ACP session the agent has open; empty while it has none (an
    /// agent launched whose NewSession / ResumeSession never ran).
    pub acp_session_id: String,
    /// agentctl keeps a durable turn journal.
    pub journaled: bool,
    /// ... which this process created (it knows no earlier process's turns).
    pub journal_fresh: bool,
    /// The session modes of the open conversation; `None` when the agent
    /// offers none or no conversation is open.
    pub modes: Option<pb::SessionModes>,
    /// The agent's signs of life, for telling slow work from silence.
    pub progress: AgentProgress,
    /// The newest update cursor agentctl has (0 from an agentctl too old to
    /// say): what a reader of [`AgentctlClient::stream_updates`] must have
    /// read to have caught up.
    pub latest_cursor: u64,
    /// How the agent process ended, when it did.
    pub agent_exit: Option<pb::AgentExit>,
    /// The newest turn agentctl (or its journal) knows; empty: none, or an
    /// agentctl too old to say.
    pub last_turn_id: String,
    /// The workspace root agentctl serves: `Some("")` while none is bound
    /// (a host's agentctl started with `--worktree-root` only, before a
    /// worktree is made through it); `None` from an agentctl too old to say.
    pub workspace_root: Option<String>,
}

/// Signs of life of an agent process as agentctl counts them (`Health`).
/// Two readings that differ mean the agent did something in between: wrote
/// a line, used CPU, or replayed history. All zero from an agentctl too old
/// to count them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct AgentProgress {
    /// Lines the agent wrote since it was launched (ACP messages, log lines).
    pub activity: u64,
    /// CPU time its process tree used, in milliseconds (0: unknown).
    pub cpu_ms: u64,
    /// Time its process tree waited for a CPU, in milliseconds (`None`:
    /// not counted there, or an agentctl from before the count).
    pub cpu_wait_ms: Option<u64>,
    /// A ResumeSession is in progress.
    pub resuming: bool,
    /// History updates replayed so far by a `session/load` in progress.
    pub replayed: u64,
}

/// Whether a capability is available.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Support {
    /// Not known until the agent has answered ACP `initialize`.
    Unknown,
    /// Available (for session resume: the profile claims it and the agent
    /// advertises ACP `loadSession`).
    Supported,
    /// Not available.
    Unsupported,
}

impl Support {
    /// True only for [`Support::Supported`]; unknown counts as no.
    pub fn is_supported(self) -> bool {
        self == Support::Supported
    }

    fn from_proto(value: i32) -> Self {
        match pb::Capability::try_from(value) {
            Ok(pb::Capability::Supported) => Support::Supported,
            Ok(pb::Capability::Unsupported) => Support::Unsupported,
            _ => Support::Unknown,
        }
    }
}

/// What `Capabilities` says: the capability probe of an agentctl.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capabilities {
    /// agentctl's verdict on resuming conversations: the profile's claim
    /// lowered by the agent's answer; `Unknown` until the agent initialized.
    pub supports_session_resume: Support,
    /// Whether the workspace (shell, files, git) works without an agent.
    pub supports_workspace_only: Support,
    /// What the profile agentctl was launched with claims.
    pub profile_claims_session_resume: bool,
    /// The agent's ACP `loadSession` capability; `None` before `initialize`.
    pub agent_load_session: Option<bool>,
    /// What the agent's prompts may carry besides text (ACP
    /// `promptCapabilities`); `None` before `initialize`.
    pub prompt: Option<pb::PromptCapabilities>,
}

impl Capabilities {
    fn from_proto(resp: pb::CapabilitiesResponse) -> Self {
        Capabilities {
            supports_session_resume: Support::from_proto(resp.supports_session_resume),
            supports_workspace_only: Support::from_proto(resp.supports_workspace_only),
            profile_claims_session_resume: resp.profile_claims_session_resume,
            agent_load_session: resp.agent_load_session,
            prompt: resp.prompt,
        }
    }
}

/// What `Recover` answers ([`AgentctlClient::recover`]).
#[derive(Debug, Clone, PartialEq)]
pub struct RecoverAnswer {
    /// `Health` as the call arrived, before the agent part; its executor id
    /// is the expected one.
    pub health: Health,
    /// `Capabilities` as the call arrived.
    pub capabilities: Capabilities,
    /// What the agent part did (`outcome`), with LaunchAgent's and
    /// ResumeSession's answers, or the call that failed and its status.
    pub agent: pb::RecoverAgent,
}

impl RecoverAnswer {
    /// When the agent part failed: see [`agent_part_failure`].
    pub fn agent_failure(&self) -> Option<(&str, crate::error::Failure, &str)> {
        agent_part_failure(&self.agent)
    }
}

/// When a `Recover`'s agent part failed (outcome FAILED): the call that
/// failed (`LaunchAgent` or `ResumeSession`), what that means, and
/// agentctl's message.
pub fn agent_part_failure(agent: &pb::RecoverAgent) -> Option<(&str, crate::error::Failure, &str)> {
    (agent.outcome() == pb::RecoverOutcome::Failed).then(|| {
        (
            agent.failed_call.as_str(),
            crate::error::Failure::of_code(tonic::Code::from(agent.code)),
            agent.message.as_str(),
        )
    })
}

/// How agentctl's refusal of a `Recover` for another executor begins.
pub const WRONG_EXECUTOR: &str = "wrong_executor";

/// An authenticated, deadline-bound client of one agentctl.
///
/// Cheap to clone; connects lazily and reconnects by itself. One typed
/// method per agentctl RPC, each with its deadline; a failure says what it
/// means through [`Error::failure`].
///
/// Every typed call fails with [`Error::Timeout`] when its deadline passes,
/// [`Error::Unreachable`] or [`Error::Tls`] when no connection can be made,
/// [`Error::Unauthenticated`] when the secret is refused,
/// [`Error::StaleEpoch`] when another replica holds a newer lease, and
/// [`Error::Rpc`] for any other gRPC status agentctl answers with.
#[derive(Clone)]
pub struct AgentctlClient {
    inner: RawClient,
    url: String,
    call_timeout: Duration,
    /// TLS without a client certificate: an agentctl that requires one
    /// closes the connection right after the handshake, which says why.
    tls_without_identity: bool,
    /// The lease epoch every call carries (shared by all clones and the
    /// interceptor); only ever raised.
    epoch: Arc<AtomicI64>,
}

impl fmt::Debug for AgentctlClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentctlClient")
            .field("url", &self.url)
            .field("call_timeout", &self.call_timeout)
            .finish_non_exhaustive()
    }
}

impl AgentctlClient {
    /// A client of the agentctl at `url`: `unix:///path/to/agentctl.sock`
    /// (local executors), `http://host:port` or `https://host:port`
    /// (remote). Does not connect yet.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a URL of another scheme, a relative socket
    /// path, an `https://` URL without [`ClientConfig::tls`], invalid TLS
    /// material, or a secret that is not valid header text.
    ///
    /// ```
    /// use sessiond_executor::{AgentctlClient, ClientConfig, Error};
    ///
    /// let config = ClientConfig::default();
    /// let err = AgentctlClient::new("https://host:7070", "secret", &config).unwrap_err();
    /// assert!(matches!(err, Error::Config(_)), "https needs a CA: {err}");
    /// let err = AgentctlClient::new("unix://agentctl.sock", "secret", &config).unwrap_err();
    /// assert!(err.to_string().contains("absolute socket path"));
    /// ```
    pub fn new(url: &str, secret: &str, config: &ClientConfig) -> Result<Self> {
        let bad = |what: String| Error::Config(format!("agentctl url {url:?}: {what}"));
        let header: MetadataValue<Ascii> = format!("Bearer {secret}")
            .parse()
            .map_err(|_| Error::Config("the executor secret is not valid header text".into()))?;
        // No channel-wide `timeout`: it would cap every call, long ones
        // included, at one value. Each call carries its own deadline instead.
        let settings = |endpoint: Endpoint| {
            endpoint
                .connect_timeout(config.connect_timeout)
                .http2_keep_alive_interval(config.keep_alive_interval)
                .keep_alive_timeout(config.call_timeout)
                .keep_alive_while_idle(true)
        };
        let channel = if let Some(path) = url.strip_prefix("unix://") {
            if !path.starts_with('/') {
                return Err(bad("a unix:// URL needs an absolute socket path".into()));
            }
            // The URI only fills the HTTP/2 `:authority`; the connector
            // ignores it and dials the socket.
            let endpoint = settings(Endpoint::from_static("http://agentctl"));
            let path = std::path::PathBuf::from(path);
            endpoint.connect_with_connector_lazy(tower::service_fn(move |_: http::Uri| {
                let path = path.clone();
                async move {
                    let stream = tokio::net::UnixStream::connect(&path).await?;
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
                }
            }))
        } else {
            let mut endpoint =
                settings(Endpoint::from_shared(url.to_owned()).map_err(|e| bad(e.to_string()))?)
                    .tcp_nodelay(true);
            if url.starts_with("https://") {
                let Some(tls) = &config.tls else {
                    return Err(bad(
                        "https needs a CA certificate (ClientConfig::tls)".into()
                    ));
                };
                endpoint = with_tls(endpoint, tls).map_err(bad)?;
            } else if !url.starts_with("http://") {
                return Err(bad("expected a unix://, http:// or https:// URL".into()));
            }
            endpoint.connect_lazy()
        };
        let epoch = Arc::new(AtomicI64::new(NO_EPOCH));
        let auth = BearerAuth {
            header,
            call_timeout: config.call_timeout,
            epoch: epoch.clone(),
        };
        let inner = AgentCtlServiceClient::with_interceptor(channel, auth)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        Ok(Self {
            inner,
            url: url.to_owned(),
            call_timeout: config.call_timeout,
            tls_without_identity: url.starts_with("https://")
                && config
                    .tls
                    .as_ref()
                    .is_some_and(|t| t.client_identity.is_none()),
            epoch,
        })
    }

    /// This client with calls carrying lease epoch `epoch` (none: no header).
    pub fn with_lease_epoch(self, epoch: Option<i64>) -> Self {
        if let Some(e) = epoch {
            self.raise_lease_epoch(e);
        }
        self
    }

    /// From now on every call (of every clone) carries at least `epoch`:
    /// the epoch is never lowered, so a stale copy of the executor record
    /// cannot make this replica fence itself off.
    pub fn raise_lease_epoch(&self, epoch: i64) {
        self.epoch.fetch_max(epoch.max(NO_EPOCH), Ordering::SeqCst);
    }

    /// The lease epoch calls carry, if any.
    pub fn lease_epoch(&self) -> Option<i64> {
        Some(self.epoch.load(Ordering::SeqCst)).filter(|e| *e >= 0)
    }

    /// The agentctl URL this client calls (named in its errors).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The generated client: every agentctl RPC, authenticated, with message
    /// limits of [`MAX_MESSAGE_BYTES`]. A request without a deadline gets
    /// [`default_deadline`] of its method; pass a longer (or shorter) one
    /// with [`with_deadline`]. The typed methods below choose the deadline
    /// from the request itself and map errors: every caller outside this
    /// crate uses those (`cargo xtask house` checks it); this is for this
    /// crate's own tests of the wire.
    #[doc(hidden)]
    pub fn raw(&self) -> RawClient {
        self.inner.clone()
    }

    /// The short deadline of quick calls (the configuration's `call_timeout`).
    pub fn call_timeout(&self) -> Duration {
        self.call_timeout
    }

    /// `Health`, under the short deadline.
    pub async fn health(&self) -> Result<Health> {
        let resp = self
            .unary(
                "Health",
                self.call_timeout,
                pb::HealthRequest {},
                |mut c, r| async move { c.health(r).await },
            )
            .await?;
        Ok(Health::from_proto(resp))
    }

    /// `Recover` (see the proto): [`Health`] and [`Capabilities`] as the
    /// call arrived and, when `request` carries `launch` and a
    /// `resume_token`, the agent launched and its conversation reopened,
    /// in one exchange. `request.executor_id` is set to `expected`, so
    /// agentctl acts only if it is that executor's; the answer's id is
    /// checked too ([`Error::IdentityMismatch`] either way). The deadline
    /// is the short one, plus LaunchAgent's and ResumeSession's when the
    /// request asks for the agent. An agentctl without the call answers
    /// [`Error::Rpc`] with UNIMPLEMENTED ([`Error::is_unimplemented`]).
    pub async fn recover(
        &self,
        expected: ExecutorId,
        mut request: pb::RecoverRequest,
    ) -> Result<RecoverAnswer> {
        request.executor_id = expected.to_string();
        let deadline = match &request.launch {
            Some(l) if !request.resume_token.is_empty() => {
                or_default(l.initialize_timeout_ms, budget::INITIALIZE)
                    + budget::SESSION_SETUP
                    + self.call_timeout
            }
            _ => self.call_timeout,
        };
        let resp = match self
            .unary("Recover", deadline, request, |mut c, r| async move {
                c.recover(r).await
            })
            .await
        {
            Err(Error::Rpc { status, .. })
                if status.code() == tonic::Code::FailedPrecondition
                    && status.message().starts_with(WRONG_EXECUTOR) =>
            {
                return Err(Error::IdentityMismatch {
                    url: self.url.clone(),
                    expected,
                    actual: status
                        .message()
                        .split_once("serves executor ")
                        .and_then(|(_, rest)| rest.split(';').next())
                        .unwrap_or_default()
                        .to_owned(),
                });
            }
            other => other?,
        };
        let health = Health::from_proto(resp.health.unwrap_or_default());
        if health.executor_id != expected.to_string() {
            return Err(Error::IdentityMismatch {
                url: self.url.clone(),
                expected,
                actual: health.executor_id,
            });
        }
        Ok(RecoverAnswer {
            health,
            capabilities: Capabilities::from_proto(resp.capabilities.unwrap_or_default()),
            agent: resp.agent.unwrap_or_default(),
        })
    }
}

impl Health {
    fn from_proto(resp: pb::HealthResponse) -> Self {
        Health {
            executor_id: resp.executor_id,
            agentctl_version: resp.agentctl_version,
            agent_state: AgentState::try_from(resp.agent_state).unwrap_or(AgentState::Unspecified),
            pid: resp.pid,
            uptime: Duration::from_millis(resp.uptime_ms),
            instance_id: resp.instance_id,
            acp_session_id: resp.acp_session_id,
            journaled: resp.journaled,
            journal_fresh: resp.journal_fresh,
            modes: resp.modes,
            progress: AgentProgress {
                activity: resp.agent_activity,
                cpu_ms: resp.agent_cpu_ms,
                cpu_wait_ms: resp.agent_cpu_wait_ms,
                resuming: resp.resuming,
                replayed: resp.replayed,
            },
            latest_cursor: resp.latest_cursor,
            last_turn_id: resp.last_turn_id,
            workspace_root: resp.workspace_root,
            agent_exit: resp.agent_exit,
        }
    }
}

impl AgentctlClient {
    /// `Health`, then a check that the answer comes from `expected`'s agentctl.
    pub async fn verify_identity(&self, expected: ExecutorId) -> Result<Health> {
        let health = self.health().await?;
        if health.executor_id != expected.to_string() {
            return Err(Error::IdentityMismatch {
                url: self.url.clone(),
                expected,
                actual: health.executor_id,
            });
        }
        Ok(health)
    }

    /// `Capabilities`, under the short deadline.
    pub async fn capabilities(&self) -> Result<Capabilities> {
        let resp = self
            .unary(
                "Capabilities",
                self.call_timeout,
                pb::CapabilitiesRequest {},
                |mut c, r| async move { c.capabilities(r).await },
            )
            .await?;
        Ok(Capabilities::from_proto(resp))
    }

    /// `StopAgent`; an agentctl with no agent running counts as stopped. The
    /// deadline covers the grace, agentctl's wait after KILL, and the margin.
    pub async fn stop_agent(&self, grace: Duration) -> Result<()> {
        let grace_ms = millis(grace);
        let deadline =
            or_default(grace_ms, budget::STOP_GRACE) + budget::AFTER_KILL + self.call_timeout;
        match self
            .unary(
                "StopAgent",
                deadline,
                pb::StopAgentRequest { grace_ms },
                |mut c, r| async move { c.stop_agent(r).await },
            )
            .await
        {
            Ok(_) => Ok(()),
            Err(Error::Rpc { status, .. })
                if matches!(
                    status.code(),
                    tonic::Code::FailedPrecondition | tonic::Code::NotFound
                ) =>
            {
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// `LaunchAgent`. The request's initialize timeout bounds the agent's
    /// silence, not its work: the deadline is agentctl's cap on a launch
    /// (ten minutes) plus the margin.
    pub async fn launch_agent(
        &self,
        request: pb::LaunchAgentRequest,
    ) -> Result<pb::LaunchAgentResponse> {
        let deadline = budget::INITIALIZE + self.call_timeout;
        self.unary("LaunchAgent", deadline, request, |mut c, r| async move {
            c.launch_agent(r).await
        })
        .await
    }

    /// `NewSession`: the new conversation's resume token and modes.
    pub async fn new_session(&self) -> Result<pb::NewSessionResponse> {
        let deadline = budget::SESSION_SETUP + self.call_timeout;
        self.unary(
            "NewSession",
            deadline,
            pb::NewSessionRequest {},
            |mut c, r| async move { c.new_session(r).await },
        )
        .await
    }

    /// `ResumeSession` (ACP `session/load`, which replays the conversation):
    /// its resume token and modes.
    pub async fn resume_session(&self, resume_token: &str) -> Result<pb::ResumeSessionResponse> {
        let deadline = budget::SESSION_SETUP + self.call_timeout;
        let request = pb::ResumeSessionRequest {
            resume_token: resume_token.to_owned(),
        };
        self.unary("ResumeSession", deadline, request, |mut c, r| async move {
            c.resume_session(r).await
        })
        .await
    }

    /// `SetMode` (ACP `session/set_mode`): the modes with `mode_id` current.
    pub async fn set_mode(&self, mode_id: &str) -> Result<Option<pb::SessionModes>> {
        let request = pb::SetModeRequest {
            mode_id: mode_id.to_owned(),
        };
        let resp = self
            .unary(
                "SetMode",
                self.call_timeout,
                request,
                |mut c, r| async move { c.set_mode(r).await },
            )
            .await?;
        Ok(resp.modes)
    }

    /// `SetConfigOption` (ACP `session/set_config_option`): the modes and
    /// options as the agent answered.
    pub async fn set_config_option(
        &self,
        config_id: &str,
        value: &str,
    ) -> Result<Option<pb::SessionModes>> {
        let request = pb::SetConfigOptionRequest {
            config_id: config_id.to_owned(),
            value: value.to_owned(),
        };
        let resp = self
            .unary(
                "SetConfigOption",
                self.call_timeout,
                request,
                |mut c, r| async move { c.set_config_option(r).await },
            )
            .await?;
        Ok(resp.modes)
    }

    /// `RespondPermission`: the user's answer to a permission request the
    /// agent waits on.
    pub async fn respond_permission(&self, request: pb::RespondPermissionRequest) -> Result<()> {
        self.unary(
            "RespondPermission",
            self.call_timeout,
            request,
            |mut c, r| async move { c.respond_permission(r).await },
        )
        .await
        .map(|_| ())
    }

    /// `Prompt`: returns once the turn started, under the short deadline.
    pub async fn prompt(&self, request: pb::PromptRequest) -> Result<pb::PromptResponse> {
        self.unary(
            "Prompt",
            self.call_timeout,
            request,
            |mut c, r| async move { c.prompt(r).await },
        )
        .await
    }

    /// `HoldPrompt`: journals the turn and keeps it back until
    /// [`Self::prompt`] names it (see the proto). An agentctl built before
    /// the method answers UNIMPLEMENTED and holds nothing.
    pub async fn hold_prompt(&self, request: pb::PromptRequest) -> Result<pb::PromptResponse> {
        self.unary(
            "HoldPrompt",
            self.call_timeout,
            request,
            |mut c, r| async move { c.hold_prompt(r).await },
        )
        .await
    }

    /// `Cancel`; false when no turn was in progress.
    pub async fn cancel(&self) -> Result<bool> {
        let resp = self
            .unary(
                "Cancel",
                self.call_timeout,
                pb::CancelRequest {},
                |mut c, r| async move { c.cancel(r).await },
            )
            .await?;
        Ok(resp.cancelled)
    }

    /// `Exec`; the deadline is the request's timeout (60 s when 0) plus the
    /// margin, so agentctl's own timeout (which reports `timed_out`) fires first.
    pub async fn exec(&self, request: pb::ExecRequest) -> Result<pb::ExecResponse> {
        let deadline = or_default(request.timeout_ms, budget::EXEC) + self.call_timeout;
        self.exec_within(request, deadline).await
    }

    /// `Exec` under `deadline` (it should exceed the request's own timeout,
    /// so that agentctl reports `timed_out` with the output so far).
    pub async fn exec_within(
        &self,
        request: pb::ExecRequest,
        deadline: Duration,
    ) -> Result<pb::ExecResponse> {
        self.unary("Exec", deadline, request, |mut c, r| async move {
            c.exec(r).await
        })
        .await
    }

    /// `ReadFile` (up to 16 MiB).
    pub async fn read_file(&self, request: pb::ReadFileRequest) -> Result<Vec<u8>> {
        let deadline = budget::FILE_TRANSFER + self.call_timeout;
        let resp = self
            .unary("ReadFile", deadline, request, |mut c, r| async move {
                c.read_file(r).await
            })
            .await?;
        Ok(resp.content)
    }

    /// `WriteFile`; returns the bytes written.
    pub async fn write_file(&self, request: pb::WriteFileRequest) -> Result<u64> {
        let deadline = budget::FILE_TRANSFER + self.call_timeout;
        let resp = self
            .unary("WriteFile", deadline, request, |mut c, r| async move {
                c.write_file(r).await
            })
            .await?;
        Ok(resp.bytes_written)
    }

    /// `ListDir`.
    pub async fn list_dir(&self, path: &str) -> Result<Vec<pb::DirEntry>> {
        let request = pb::ListDirRequest {
            path: path.to_owned(),
        };
        let resp = self
            .unary(
                "ListDir",
                self.call_timeout,
                request,
                |mut c, r| async move { c.list_dir(r).await },
            )
            .await?;
        Ok(resp.entries)
    }

    /// `GitStatus`.
    pub async fn git_status(&self) -> Result<pb::GitStatusResponse> {
        let deadline = budget::GIT + self.call_timeout;
        self.unary(
            "GitStatus",
            deadline,
            pb::GitStatusRequest {},
            |mut c, r| async move { c.git_status(r).await },
        )
        .await
    }

    /// `Worktree`: one worktree operation on agentctl's host, under
    /// `deadline` (a checkout is work); its JSON answer. A refusal is
    /// [`Error::Worktree`] with agentctl's code and message.
    pub async fn worktree(
        &self,
        request: pb::WorktreeRequest,
        deadline: Duration,
    ) -> Result<String> {
        let resp = self
            .unary("Worktree", deadline, request, |mut c, r| async move {
                c.worktree(r).await
            })
            .await
            .map_err(|e| match e {
                Error::Rpc { status, .. } => Error::Worktree {
                    code: status.code(),
                    message: status.message().to_owned(),
                },
                other => other,
            })?;
        Ok(resp.json)
    }

    /// `GitDiff`; returns the diff text.
    pub async fn git_diff(&self, request: pb::GitDiffRequest) -> Result<String> {
        let deadline = budget::GIT + self.call_timeout;
        let resp = self
            .unary("GitDiff", deadline, request, |mut c, r| async move {
                c.git_diff(r).await
            })
            .await?;
        Ok(resp.diff)
    }

    /// Opens `StreamUpdates` after `after_cursor`, naming the agentctl
    /// instance the cursor belongs to (`""` when unknown, e.g. a first
    /// stream). When agentctl is another process than `instance_id` (it was
    /// restarted: cursors began at 1 again), the stream starts with a `Gap`
    /// and then replays everything still buffered; every update carries its
    /// `instance_id` for the consumer to store next to the cursor. Only the
    /// opening is under the short deadline; the stream itself has none.
    pub async fn stream_updates(
        &self,
        after_cursor: u64,
        instance_id: &str,
    ) -> Result<tonic::Streaming<pb::AgentUpdate>> {
        let mut request = tonic::Request::new(pb::StreamUpdatesRequest { after_cursor });
        if !instance_id.is_empty() {
            let value = instance_id.parse().map_err(|_| {
                Error::Config(format!("instance id {instance_id:?} is not header text"))
            })?;
            request.metadata_mut().insert(INSTANCE_ID_METADATA, value);
        }
        let mut client = self.raw();
        self.call("StreamUpdates", self.call_timeout, async move {
            client.stream_updates(request).await
        })
        .await
    }

    /// One unary call with `deadline` sent as `grpc-timeout`, under the
    /// outer bound of [`Self::call`].
    async fn unary<Req, Resp, F, Fut>(
        &self,
        name: &'static str,
        deadline: Duration,
        message: Req,
        f: F,
    ) -> Result<Resp>
    where
        F: FnOnce(RawClient, tonic::Request<Req>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    {
        let fut = f(self.raw(), with_deadline(message, deadline));
        // Boxed: a tonic call's future is kilobytes, and every future
        // awaiting this one would carry it inline.
        self.call(name, deadline, Box::pin(fut)).await
    }

    /// Runs one call under `deadline` (tonic enforces the `grpc-timeout` too;
    /// this bound also covers connection setup and a peer that accepted the
    /// connection but never answers) and maps its errors.
    async fn call<T>(
        &self,
        name: &'static str,
        deadline: Duration,
        fut: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T> {
        // A little slack so tonic's own deadline (which says more) fires first.
        let outer = deadline + Duration::from_millis(250);
        match tokio::time::timeout(outer, fut).await {
            Err(_) => Err(Error::Timeout {
                url: self.url.clone(),
                call: name,
                timeout: deadline,
            }),
            Ok(Ok(resp)) => Ok(resp.into_inner()),
            Ok(Err(status)) => Err(self.map_status(name, deadline, status)),
        }
    }

    fn map_status(&self, call: &'static str, deadline: Duration, status: tonic::Status) -> Error {
        let url = self.url.clone();
        match status.code() {
            tonic::Code::Unauthenticated => Error::Unauthenticated { url },
            tonic::Code::FailedPrecondition if status.message().starts_with(STALE_EPOCH) => {
                Error::StaleEpoch {
                    url,
                    call,
                    message: status.message().to_owned(),
                }
            }
            // agentctl's own answer (e.g. an agent silent at its start):
            // its words, not this call's deadline, which did not pass.
            tonic::Code::DeadlineExceeded
                if !status.message().is_empty()
                    && !is_timeout(&status)
                    && std::error::Error::source(&status).is_none() =>
            {
                Error::Rpc {
                    url,
                    call,
                    status: Box::new(status),
                }
            }
            tonic::Code::DeadlineExceeded => Error::Timeout {
                url,
                call,
                timeout: deadline,
            },
            tonic::Code::Cancelled if is_timeout(&status) => Error::Timeout {
                url,
                call,
                timeout: deadline,
            },
            tonic::Code::Cancelled
                if self.tls_without_identity
                    && error_chain(&status).contains("connection closed") =>
            {
                Error::Tls {
                    url,
                    message: format!(
                        "agentctl closed the connection after the handshake ({}); it may \
                         require a client certificate (executors.remote.tls_client_cert_file)",
                        error_chain(&status)
                    ),
                }
            }
            tonic::Code::Unavailable | tonic::Code::Unknown if is_transport_error(&status) => {
                let message = error_chain(&status);
                if is_certificate_error(&message) {
                    Error::Tls { url, message }
                } else {
                    Error::Unreachable { url, message }
                }
            }
            _ => Error::Rpc {
                url,
                call,
                status: Box::new(status),
            },
        }
    }
}

fn with_tls(endpoint: Endpoint, tls: &TlsConfig) -> Result<Endpoint, String> {
    use tonic::transport::{Certificate, ClientTlsConfig, Identity};
    let mut config = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&tls.ca_pem));
    if let Some(domain) = &tls.domain_name {
        config = config.domain_name(domain.clone());
    }
    if let Some((cert, key)) = &tls.client_identity {
        config = config.identity(Identity::from_pem(cert, key));
    }
    endpoint.tls_config(config).map_err(|e| e.to_string())
}

/// rustls' words for a handshake refused over a certificate (ours of
/// theirs, or theirs of ours).
fn is_certificate_error(chain: &str) -> bool {
    let text = chain.to_ascii_lowercase();
    [
        "certificate",
        "unknownissuer",
        "unknownca",
        "notvalidforname",
    ]
    .iter()
    .any(|w| text.contains(w))
}

fn is_timeout(status: &tonic::Status) -> bool {
    let text = error_chain(status).to_ascii_lowercase();
    text.contains("timed out") || text.contains("timeout expired")
}

/// True when the status was made on this side from a transport failure
/// (connection refused, reset, ...), not sent by agentctl.
fn is_transport_error(status: &tonic::Status) -> bool {
    // A status agentctl sent comes with its headers: whatever its message
    // says ("the agent's connection closed"), agentctl was reached.
    std::error::Error::source(status).is_some()
        || (status.metadata().is_empty()
            && (status.message().contains("transport error")
                || status.message().contains("connection")))
}

fn error_chain(status: &tonic::Status) -> String {
    let mut text = status.message().to_owned();
    let mut source = std::error::Error::source(status);
    while let Some(err) = source {
        // Said once: hyper's "tcp connect error" already holds its cause.
        let cause = err.to_string();
        if !text.contains(&cause) {
            text.push_str(": ");
            text.push_str(&cause);
        }
        source = err.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_chain_says_each_cause_once() {
        #[derive(Debug)]
        struct Connect(std::io::Error);
        impl std::fmt::Display for Connect {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "tcp connect error: {}", self.0)
            }
        }
        impl std::error::Error for Connect {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let status = tonic::Status::from_error(Box::new(Connect(refused)));
        assert_eq!(error_chain(&status), "tcp connect error: refused");
    }

    /// A throwaway self-signed CA (no key kept), to build a TLS endpoint.
    const TEST_CA: &str = "-----BEGIN CERTIFICATE-----\nMIIBjTCCATOgAwIBAgIUeXAUr90IFS0F1942O0TNt5pb9hAwCgYIKoZIzj0EAwIw\nGzEZMBcGA1UEAwwQc2Vzc2lvbmQtdGVzdC1jYTAgFw0yNjExMjkwODQxNDVaGA8y\nMTI2MTEwNTA4NDE0NVowGzEZMBcGA1UEAwwQc2Vzc2lvbmQtdGVzdC1jYTBZMBMG\nByqGSM49AgEGCCqGSM49AwEHA0IABPFE1gf8GKH15qrHxY5jrkUbQuf3Djz0sS0M\nDuTBm0NIzactjhnRXL0yJ6n8CUEKfcWXv9wpTQPRRYmwyHS1/S6jUzBRMB0GA1Ud\nDgQWBBRyQndZ3lr/ro+6tWUsdzTnUEaV9zAfBgNVHSMEGDAWgBRyQndZ3lr/ro+6\ntWUsdzTnUEaV9zAPBgNVHRMBAf8EBTADAQH/MAoGCCqGSM49BAMCA0gAMEUCID/W\nPYsDSFG0SUMsAIxJoh0K34CapoKaRmptVXf2uZGEAiEA3XbvF0cHzOrdIMlwF+5W\nARVsYYTDcvmRvm4gEVLES3Y=\n-----END CERTIFICATE-----\n";

    #[test]
    fn rejects_urls_it_cannot_serve() {
        let config = ClientConfig::default();
        let err = AgentctlClient::new("unix://relative.sock", "s", &config).expect_err("relative");
        assert!(err.to_string().contains("absolute socket path"), "{err}");
        let err = AgentctlClient::new("ftp://host:1", "s", &config).expect_err("scheme");
        assert!(err.to_string().contains("http:// or https://"), "{err}");
        let err = AgentctlClient::new("https://host:1", "s", &config).expect_err("no CA");
        assert!(err.to_string().contains("CA certificate"), "{err}");
        let err = AgentctlClient::new("http://host:1", "line\nbreak", &config).expect_err("header");
        assert!(matches!(err, Error::Config(_)), "{err}");
    }

    fn intercepted(method: Option<&'static str>, preset: Option<Duration>) -> tonic::Request<()> {
        let mut auth = BearerAuth {
            header: "Bearer s".parse().expect("header"),
            call_timeout: Duration::from_secs(2),
            epoch: Arc::new(AtomicI64::new(NO_EPOCH)),
        };
        let mut request = tonic::Request::new(());
        if let Some(m) = method {
            request
                .extensions_mut()
                .insert(tonic::GrpcMethod::new("agentctl.v1.AgentCtlService", m));
        }
        if let Some(d) = preset {
            request.set_timeout(d);
        }
        auth.call(request).expect("intercepted")
    }

    fn grpc_timeout(request: &tonic::Request<()>) -> Option<Duration> {
        let text = request.metadata().get("grpc-timeout")?.to_str().ok()?;
        let (num, unit) = text.split_at(text.len() - 1);
        let n: u64 = num.parse().ok()?;
        Some(match unit {
            "H" => Duration::from_secs(n * 3600),
            "M" => Duration::from_secs(n * 60),
            "S" => Duration::from_secs(n),
            "m" => Duration::from_millis(n),
            "u" => Duration::from_micros(n),
            "n" => Duration::from_nanos(n),
            _ => return None,
        })
    }

    /// The lease epoch rides on every call once set, is shared by clones,
    /// and is never lowered; without one no header is sent.
    #[tokio::test]
    async fn the_lease_epoch_is_sent_and_only_raised() {
        let config = ClientConfig::default();
        let client = AgentctlClient::new("http://127.0.0.1:1", "s", &config).expect("client");
        assert_eq!(client.lease_epoch(), None);
        let epoch_of = |c: &AgentctlClient| {
            let mut auth = BearerAuth {
                header: "Bearer s".parse().expect("header"),
                call_timeout: Duration::from_secs(2),
                epoch: c.epoch.clone(),
            };
            auth.call(tonic::Request::new(()))
                .expect("intercepted")
                .metadata()
                .get(LEASE_EPOCH_METADATA)
                .map(|v| v.to_str().expect("ascii").to_owned())
        };
        assert_eq!(epoch_of(&client), None);
        let client = client.with_lease_epoch(Some(3));
        let clone = client.clone();
        assert_eq!(epoch_of(&clone).as_deref(), Some("3"));
        clone.raise_lease_epoch(2);
        assert_eq!(client.lease_epoch(), Some(3), "never lowered");
        client.raise_lease_epoch(5);
        assert_eq!(epoch_of(&clone).as_deref(), Some("5"));
    }

    #[test]
    fn every_call_gets_auth_and_a_deadline_of_its_own() {
        let health = intercepted(Some("Health"), None);
        assert_eq!(
            health.metadata().get("authorization").expect("auth"),
            "Bearer s"
        );
        assert_eq!(grpc_timeout(&health), Some(Duration::from_secs(2)));
        // Long calls get agentctl's own budget plus the margin, not 2 s (an
        // agent's setup: agentctl's cap, since it cuts silence itself).
        assert_eq!(
            grpc_timeout(&intercepted(Some("LaunchAgent"), None)),
            Some(Duration::from_secs(602))
        );
        assert_eq!(
            grpc_timeout(&intercepted(Some("Exec"), None)),
            Some(Duration::from_secs(62))
        );
        assert_eq!(
            grpc_timeout(&intercepted(Some("ResumeSession"), None)),
            Some(Duration::from_secs(602))
        );
        // A stream has no deadline; a caller's own deadline is kept.
        assert_eq!(
            grpc_timeout(&intercepted(Some("StreamUpdates"), None)),
            None
        );
        assert_eq!(
            grpc_timeout(&intercepted(Some("Exec"), Some(Duration::from_secs(600)))),
            Some(Duration::from_secs(600))
        );
        assert_eq!(
            grpc_timeout(&intercepted(None, None)),
            Some(Duration::from_secs(2))
        );
    }

    #[test]
    fn default_deadlines_cover_agentctls_own_limits() {
        let short = Duration::from_secs(5);
        assert_eq!(default_deadline("Health", short), Some(short));
        assert_eq!(default_deadline("Capabilities", short), Some(short));
        assert_eq!(
            default_deadline("StopAgent", short),
            Some(Duration::from_secs(13))
        );
        assert_eq!(
            default_deadline("GitDiff", short),
            Some(Duration::from_secs(65))
        );
        assert_eq!(default_deadline("StreamUpdates", short), None);
    }

    #[tokio::test]
    async fn https_with_a_ca_builds_in_the_default_build() {
        let config = ClientConfig {
            tls: Some(TlsConfig {
                ca_pem: TEST_CA.as_bytes().to_vec(),
                domain_name: None,
                client_identity: None,
            }),
            ..ClientConfig::default()
        };
        let built = AgentctlClient::new("https://127.0.0.1:1", "s", &config);
        assert!(built.is_ok(), "{built:?}");
    }
}
