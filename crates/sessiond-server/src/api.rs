//! `sessiond.v1.SessionService` and `sessiond.v1.WorkspaceService` over the
//! session manager: parse and validate, call, convert. Every error goes
//! through [`crate::error`].

use std::{
    collections::HashMap,
    path::Path,
    pin::Pin,
    sync::{Arc, Mutex},
    time::Duration,
};

use chrono::Utc;
use futures::{Stream, StreamExt};
use sessiond_domain::{
    AgentProfileId, ExecutorId, ExecutorRecord, ExecutorStatus, MessageId, Runtime, Session,
    SessionId, Task, TaskId, TaskState, Worktree,
};
use sessiond_engine::{EndReason, NewSession, Outgoing, RemoteAgentctl, Sent, SessionManager};
use sessiond_executor::{AgentctlClient, ClientConfig};
use sessiond_proto::{agentctl::v1 as apb, sessiond::v1 as pb};
use sessiond_store::Store;
use tonic::{Request, Response, Status};

use crate::{
    bounds::{Bounded, MAX_ARG_BYTES, MAX_PATH_BYTES, MAX_REMOTE_BYTES as MAX_REMOTE_FIELD_BYTES},
    convert,
    error::{ApiError, ApiResult},
    forward::{self, Failure, Forward, Origin, Owner, Peers, WorkspaceCall},
};

/// Longest Exec timeout a client may ask for (24 h).
const MAX_EXEC_TIMEOUT_MS: u64 = 24 * 3600 * 1000;
/// Largest per-stream output cap a client may ask for (agentctl's 16 MiB).
const MAX_EXEC_OUTPUT: u64 = 16 << 20;

/// Output kept per stream in a timed-out Exec's status details.
const TIMED_OUT_OUTPUT: usize = 4 * 1024;

/// Settings the handlers need from the configuration.
#[derive(Debug, Clone)]
pub struct ApiSettings {
    pub default_runtime: Runtime,
    pub default_agent: String,
    pub max_message_bytes: usize,
    /// Local worktrees must lie in one of these (absolute, normalised).
    pub worktree_roots: Vec<std::path::PathBuf>,
    /// `executors.repositories`: offered to clients creating a session.
    pub repositories: Vec<std::path::PathBuf>,
    /// Hosts a remote session's agentctl URL may name.
    pub remote_allowed_hosts: crate::limits::AllowedHosts,
    /// Open watch streams, globally and per token.
    pub watch_limits: Arc<crate::limits::WatchLimits>,
    /// Client settings for proxied workspace calls (a longer call deadline
    /// than the manager's, since `Exec` may run for minutes).
    pub workspace_client: ClientConfig,
    /// Forwarding of commands to the replica that owns their session.
    pub peers: Peers,
}

/// The implementation of both public gRPC services (`SessionService` and
/// `WorkspaceService` of `sessiond-proto`), over one session manager;
/// cheap to clone. Embedders get it inside [`crate::Services`].
#[derive(Clone)]
pub struct Api {
    manager: SessionManager,
    store: Store,
    settings: Arc<ApiSettings>,
    /// Becomes true when the server shuts down: live streams end.
    stop: tokio::sync::watch::Receiver<bool>,
    /// agentctl clients for workspace calls, by executor and generation.
    clients: Arc<Mutex<HashMap<(ExecutorId, i64), AgentctlClient>>>,
}

impl std::fmt::Debug for Api {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Api")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

const DEFAULT_PAGE: i32 = 100;
const MAX_PAGE: i32 = 1000;
pub(crate) const MAX_TITLE_CHARS: usize = 1000;

/// The most message text (content and data) one ListMessages page holds.
const MAX_PAGE_BYTES: usize = 40 << 20;

fn page_size(value: i32) -> ApiResult<u32> {
    match value {
        0 => Ok(DEFAULT_PAGE as u32),
        1..=MAX_PAGE => Ok(value as u32),
        _ => Err(ApiError::invalid(format!(
            "page_size: {value} is not between 0 and {MAX_PAGE}"
        ))),
    }
}

/// Longest path component (Linux's NAME_MAX).
const MAX_NAME_BYTES: usize = 255;
/// Most Exec arguments, and their total size (well inside ARG_MAX).
const MAX_ARGS: usize = 4096;
const MAX_ARGS_TOTAL_BYTES: usize = 1024 * 1024;

/// A workspace path a client sends (relative to the workspace, or empty for
/// its root): the sizes the kernel would refuse are INVALID_ARGUMENT here,
/// naming the field, instead of an OS error later.
fn check_path_field(field: &str, path: &str) -> ApiResult<()> {
    if path.len() > MAX_PATH_BYTES {
        return Err(ApiError::invalid(format!(
            "{field}: {} bytes is longer than {MAX_PATH_BYTES} bytes",
            path.len()
        )));
    }
    if path.contains('\0') {
        return Err(ApiError::invalid(format!("{field}: contains a NUL byte")));
    }
    if let Some(long) = path.split('/').find(|c| c.len() > MAX_NAME_BYTES) {
        return Err(ApiError::invalid(format!(
            "{field}: a component of {} bytes is longer than {MAX_NAME_BYTES} bytes",
            long.len()
        )));
    }
    Ok(())
}

/// Exec's command line: sizes `execve` would refuse (E2BIG), and NUL.
fn check_command_line(command: &str, args: &[String]) -> ApiResult<()> {
    if command.len() > MAX_PATH_BYTES {
        return Err(ApiError::invalid(format!(
            "command: {} bytes is longer than {MAX_PATH_BYTES} bytes",
            command.len()
        )));
    }
    if command.contains('\0') {
        return Err(ApiError::invalid("command: contains a NUL byte"));
    }
    if args.len() > MAX_ARGS {
        return Err(ApiError::invalid(format!(
            "args: {} arguments are more than {MAX_ARGS}",
            args.len()
        )));
    }
    let mut total = 0usize;
    for (i, arg) in args.iter().enumerate() {
        if arg.len() > MAX_ARG_BYTES {
            return Err(ApiError::invalid(format!(
                "args[{i}]: {} bytes is longer than {MAX_ARG_BYTES} bytes",
                arg.len()
            )));
        }
        if arg.contains('\0') {
            return Err(ApiError::invalid(format!("args[{i}]: contains a NUL byte")));
        }
        total += arg.len() + 1;
    }
    if total > MAX_ARGS_TOTAL_BYTES {
        return Err(ApiError::invalid(format!(
            "args: {total} bytes in all is more than {MAX_ARGS_TOTAL_BYTES} bytes"
        )));
    }
    Ok(())
}

/// The longest branch name sessiond takes (git hosts take 255 bytes; a
/// ref's file name must stay under the file system's 255 with `.lock`).
const MAX_BRANCH_BYTES: usize = 240;

/// A worktree's names are shown on terminals and passed to git: no control
/// character (a NUL reached agentctl's command line, an escape sequence
/// the terminal of whoever lists the session: helper-52 5, 7), and a
/// branch git can make a ref of (300 bytes stored an ERROR session).
fn check_worktree_names(w: &pb::Worktree) -> ApiResult<()> {
    for (field, value) in [
        ("worktree.id", &w.id),
        ("worktree.branch", &w.branch),
        ("worktree.base", &w.base),
        ("worktree.repository", &w.repository),
    ] {
        if value.chars().any(char::is_control) {
            return Err(ApiError::invalid(format!(
                "{field}: contains a control character"
            )));
        }
        // Bidirectional controls make a name read as another (U+202E
        // shows `x\u{202e}live` as `xevil`: helper-53 e).
        if value.chars().any(|c| {
            matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
        }) {
            return Err(ApiError::invalid(format!(
                "{field}: contains a bidirectional text control (U+200E, U+200F, U+202A-U+202E \
                 or U+2066-U+2069)"
            )));
        }
    }
    if w.id.len() > MAX_NAME_BYTES {
        return Err(ApiError::invalid(format!(
            "worktree.id: {} bytes is longer than {MAX_NAME_BYTES} bytes",
            w.id.len()
        )));
    }
    if w.branch.len() > MAX_BRANCH_BYTES {
        return Err(ApiError::invalid(format!(
            "worktree.branch: {} bytes is longer than {MAX_BRANCH_BYTES} bytes",
            w.branch.len()
        )));
    }
    if !w.repository.is_empty() && (w.branch == "@" || w.branch.starts_with("refs/")) {
        return Err(ApiError::invalid(format!(
            "worktree.branch: {:?} is not a branch name sessiond makes (git reads \"@\" as HEAD, \
             and a name starting with refs/ as a full ref); give the short name, e.g. \
             feature/login",
            w.branch
        )));
    }
    Ok(())
}

/// A local worktree must be a normalised absolute path inside one of
/// `roots`, and, when it exists, stay inside one after symlinks resolve.
fn check_worktree(path: &str, roots: &[std::path::PathBuf]) -> ApiResult<()> {
    use std::path::Component;
    if path.chars().any(char::is_control) {
        return Err(ApiError::invalid(
            "worktree.path: contains a control character",
        ));
    }
    let p = Path::new(path);
    if p.components()
        .any(|c| !matches!(c, Component::RootDir | Component::Normal(_)))
    {
        return Err(ApiError::invalid(format!(
            "worktree.path: {path:?} is not normalised (no . or .. components)"
        )));
    }
    let inside = |p: &Path| {
        roots.iter().any(|root| {
            p.starts_with(root)
                || std::fs::canonicalize(root).is_ok_and(|canonical| p.starts_with(canonical))
        })
    };
    let listed = || {
        roots
            .iter()
            .map(|r| r.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    if !inside(p) {
        return Err(ApiError::invalid(format!(
            "worktree.path: {path:?} is outside executors.worktree_roots ({}); \
             use a directory inside one, or add its parent to worktree_roots",
            listed()
        )));
    }
    if let Ok(canonical) = std::fs::canonicalize(p)
        && !inside(&canonical)
    {
        return Err(ApiError::invalid(format!(
            "worktree.path: {path:?} resolves to {} (through a symlink), outside \
             executors.worktree_roots ({})",
            canonical.display(),
            listed()
        )));
    }
    Ok(())
}

fn task_id(value: &str) -> ApiResult<TaskId> {
    if value.is_empty() {
        return Err(ApiError::invalid("task_id: required"));
    }
    Ok(TaskId::parse(value)?)
}

fn session_id(value: &str) -> ApiResult<SessionId> {
    if value.is_empty() {
        return Err(ApiError::invalid("session_id: required"));
    }
    Ok(SessionId::parse(value)?)
}

fn ids(task: &str, session: &str) -> ApiResult<(TaskId, SessionId)> {
    Ok((task_id(task)?, session_id(session)?))
}

/// The caller `auth.rs` identified (its token's index).
fn caller<T>(request: &Request<T>) -> crate::limits::Caller {
    request
        .extensions()
        .get::<crate::limits::Caller>()
        .copied()
        .unwrap_or(crate::limits::Caller(0))
}

fn reply<T>(result: ApiResult<T>) -> Result<Response<T>, Status> {
    result.map(Response::new).map_err(Status::from)
}

/// The stream a WatchSession or WatchTask call answers with.
pub type EventStream = Pin<Box<dyn Stream<Item = Result<pb::Event, Status>> + Send>>;

impl Api {
    pub(crate) fn new(
        manager: SessionManager,
        settings: ApiSettings,
        stop: tokio::sync::watch::Receiver<bool>,
    ) -> Self {
        Self {
            store: manager.store().clone(),
            manager,
            settings: Arc::new(settings),
            stop,
            clients: Arc::default(),
        }
    }

    /// A stored session as answered now: with whether it is being brought
    /// back (its stored state is what it returns to).
    fn session_now(&self, s: &Session) -> pb::Session {
        pb::Session {
            recovering: self.manager.recovery().is_bringing_back(s.id),
            ..convert::session(s)
        }
    }

    /// The session, checked to belong to `task`.
    async fn session_of(&self, task: TaskId, session: SessionId) -> ApiResult<Session> {
        let s = self.store.get_session(session).await?;
        if s.task_id != task {
            return Err(ApiError::session_not_in_task(session, task));
        }
        Ok(s)
    }

    async fn profile_id(&self, value: &str) -> ApiResult<AgentProfileId> {
        let name = if value.trim().is_empty() {
            self.settings.default_agent.as_str()
        } else {
            value.trim()
        };
        if let Ok(id) = AgentProfileId::parse(name) {
            return Ok(self.store.get_agent_profile(id).await?.id);
        }
        match self.store.get_agent_profile_by_name(name).await {
            Ok(p) => Ok(p.id),
            Err(e) if e.is_not_found() => Err(ApiError::NotFound(format!(
                "agent profile {name:?} not found; ListAgentProfiles shows the configured ones"
            ))),
            Err(e) => Err(e.into()),
        }
    }

    /// A watch stream that a shutdown ends with UNAVAILABLE, not OK: a
    /// client must not take a cut stream for a finished one, and resubscribes
    /// from its last seq.
    /// `permit` holds the stream's watch slot until the stream is dropped.
    fn stream(
        &self,
        events: sessiond_engine::EventStream,
        permit: crate::limits::WatchPermit,
    ) -> EventStream {
        let events = events
            .map(|item| {
                item.map(|e| convert::event(&e))
                    .map_err(|e| Status::from(ApiError::from(e)))
            })
            .boxed();
        self.until_stopped(events, Some(permit))
    }

    /// `answers` until the server shuts down, then UNAVAILABLE
    /// `shutting_down` (resubscribe from your last cursor); holding
    /// `permit` meanwhile.
    fn until_stopped<T: Send + 'static>(
        &self,
        answers: Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>,
        permit: Option<crate::limits::WatchPermit>,
    ) -> Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>> {
        let mut stop = self.stop.clone();
        let stopped = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        let after = self.stop.clone();
        let cut = futures::stream::once(async move {
            (*after.borrow()).then(|| {
                let mut status = Status::unavailable(
                    "sessiond is shutting down; resubscribe from your last seq",
                );
                status.metadata_mut().insert(
                    "sessiond-error",
                    tonic::metadata::MetadataValue::from_static("shutting_down"),
                );
                Err(status)
            })
        })
        .filter_map(futures::future::ready);
        answers
            .map(move |item| {
                let _slot = &permit;
                item
            })
            .take_until(stopped)
            .chain(cut)
            .boxed()
    }

    // ------------------------------------------------------------ routing

    /// Where a command on `session` runs: here (`None`: its executor is this
    /// replica's, or its lease was free or expired and is now claimed here
    /// and the executor recovered), or on the replica that owns it, to which
    /// the call is forwarded (see `forward.rs`).
    async fn route(&self, session: SessionId, origin: &Origin) -> ApiResult<Option<Owner>> {
        self.route_for(session, origin, false).await
    }

    /// [`Self::route`]; for a workspace call (`workspace`), a recovery here
    /// is waited for only until the workspace is back, not the agent.
    async fn route_for(
        &self,
        session: SessionId,
        origin: &Origin,
        workspace: bool,
    ) -> ApiResult<Option<Owner>> {
        // Already ours: the call's own recovery step (which may pause the
        // startup pass for it) does the rest.
        if self.manager.replica().owns(session) {
            return Ok(None);
        }
        let recovered = if workspace {
            self.manager.recovery().ensure_workspace(session).await
        } else {
            self.manager.recovery().ensure_recovered(session).await
        };
        match recovered {
            Ok(()) => Ok(None),
            Err(sessiond_engine::Error::NotOwner {
                session_id,
                owner,
                address,
                ttl_secs,
            }) => {
                let error = sessiond_engine::Error::NotOwner {
                    session_id,
                    owner: owner.clone(),
                    address: address.clone(),
                    ttl_secs,
                };
                let o = self
                    .settings
                    .peers
                    .owner(session, owner, address, origin, error)?;
                tracing::debug!(%session, owner = %o.replica, address = %o.address, "forwarding a call to the session's owner");
                Ok(Some(o))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Runs `here` when this replica serves `session` (see [`Self::route`]);
    /// else sends `req` on to its owner, whose answer is the answer.
    async fn here_or_forward<R, F, Fut>(
        &self,
        session: SessionId,
        origin: &Origin,
        req: R,
        here: F,
    ) -> ApiResult<R::Reply>
    where
        R: Forward,
        F: FnOnce(R) -> Fut,
        Fut: Future<Output = ApiResult<R::Reply>>,
    {
        match self.route(session, origin).await? {
            None => here(req).await,
            Some(o) => {
                let r = req.send(&o).await;
                self.forwarded(&o, r).await
            }
        }
    }

    /// Runs `here` with a client of the session's agentctl when this
    /// replica serves the session (see [`Self::workspace_target`]); else
    /// sends `req` on to its owner, whose answer is the answer.
    async fn in_workspace<R, F, Fut>(&self, origin: &Origin, req: R, here: F) -> ApiResult<R::Reply>
    where
        R: WorkspaceCall,
        F: FnOnce(R, AgentctlClient) -> Fut,
        Fut: Future<Output = ApiResult<R::Reply>>,
    {
        match self.workspace_target(req.session(), origin).await? {
            Target::Here(client) => here(req, client).await,
            Target::Owner(o) => {
                let r = req.send(&o).await;
                self.forwarded(&o, r).await
            }
        }
    }

    /// The answer of a call forwarded to `owner`.
    async fn forwarded<T>(
        &self,
        owner: &Owner,
        result: Result<Response<T>, Status>,
    ) -> ApiResult<T> {
        let status = match result {
            Ok(r) => return Ok(r.into_inner()),
            Err(s) => s,
        };
        match forward::classify(owner, status) {
            Failure::Answered(s) | Failure::DeadlineExceeded(s) => Err(ApiError::Forwarded(s)),
            Failure::Refused(status) => Err(ApiError::OwnerRefused {
                owner: owner.replica.clone(),
                status,
            }),
            Failure::Untrusted(s) => {
                tracing::warn!(session = %owner.session, owner = %owner.replica, address = %owner.address, error = %forward::error_chain(&s), "the owner's TLS certificate is not trusted (replica.peer_tls_ca_file); call not forwarded");
                Err(ApiError::NotOwner {
                    error: sessiond_engine::Error::NotOwner {
                        session_id: owner.session,
                        owner: owner.replica.clone(),
                        address: owner.address.clone(),
                        ttl_secs: self.manager.config().replica.lease_ttl.as_secs(),
                    },
                    retry_after: forward::RETRY_SOON,
                    note: Some(format!(
                        "(not forwarded: the TLS certificate of replica {} is not trusted by this \
                         replica's replica.peer_tls_ca_file / peer_tls_domain_name: {}; send the \
                         call to the owner)",
                        owner.replica,
                        forward::error_chain(&s)
                    )),
                })
            }
            Failure::Unreachable(s) => {
                let retry_after = self.lease_left(owner).await;
                tracing::warn!(session = %owner.session, owner = %owner.replica, address = %owner.address, error = %s.message(), "the owner of a session did not answer a forwarded call");
                Err(ApiError::OwnershipMoving {
                    session: owner.session,
                    owner: owner.replica.clone(),
                    address: owner.address.clone(),
                    retry_after,
                    cause: format!("{:?}: {}", s.code(), s.message()),
                })
            }
        }
    }

    /// When a retry may find `owner`'s session served by someone: after
    /// what is left of its lease plus one adoption round; soon when the
    /// lease has run out or moved already.
    async fn lease_left(&self, owner: &Owner) -> Duration {
        let ttl = self.manager.config().replica.lease_ttl;
        let round = (ttl / 3).min(Duration::from_secs(1));
        match self.store.get_executor_for_session(owner.session).await {
            Ok(Some(r)) if r.owner_id.as_deref() == Some(owner.replica.as_str()) => r
                .lease_expires_at
                .and_then(|t| (t - Utc::now()).to_std().ok())
                .map_or(forward::RETRY_SOON, |left| left + round),
            _ => forward::RETRY_SOON,
        }
    }

    // ------------------------------------------------------------ workspace

    /// Where a workspace call runs: an agentctl client of the session's
    /// executor when it is this replica's and ready, else its owner.
    async fn workspace_target(
        &self,
        r: Option<&pb::SessionRef>,
        origin: &Origin,
    ) -> ApiResult<Target> {
        let r = r.ok_or_else(|| ApiError::invalid("session: required"))?;
        let (task, session) = ids(&r.task_id, &r.session_id)?;
        self.session_of(task, session).await?;
        // Not recovered since the restart yet: recover it first; another
        // replica's: forward the call there.
        if let Some(owner) = self.route_for(session, origin, true).await? {
            return Ok(Target::Owner(owner));
        }
        // Its workspace, not its agent: that relaunch goes on (helper-52 1).
        self.manager.recovery().ensure_workspace(session).await?;
        let record: Option<ExecutorRecord> = match self.manager.execution(session) {
            Some(e) => Some(e.record),
            None => self.store.get_executor_for_session(session).await?,
        };
        let record = match record {
            Some(r) if r.status == ExecutorStatus::Ready => r,
            other => {
                return Err(ApiError::ExecutorNotReady {
                    session_id: session,
                    status: other.as_ref().map(|r| r.status),
                    detail: other.and_then(|r| r.error_message),
                });
            }
        };
        let url = record.agentctl_url.clone().unwrap_or_default();
        let key = (record.id, record.generation);
        let mut clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = clients.get(&key)
            && c.url() == url
        {
            // Fenced like the manager's calls: this replica's lease epoch.
            c.raise_lease_epoch(record.lease_epoch);
            return Ok(Target::Here(c.clone()));
        }
        let client =
            AgentctlClient::new(&url, &record.auth_secret, &self.settings.workspace_client)?
                .with_lease_epoch(Some(record.lease_epoch));
        clients.retain(|(id, _), _| *id != record.id);
        clients.insert(key, client.clone());
        Ok(Target::Here(client))
    }

    /// The remote host's agentctl a request names (`remote_url`,
    /// `remote_secret`, `remote_executor_id`): required and checked for
    /// [`Runtime::Remote`] before anything is dialled, refused for others.
    fn remote_agentctl(
        &self,
        runtime: Runtime,
        url: &str,
        secret: &str,
        executor_id: &str,
    ) -> Result<Option<RemoteAgentctl>, ApiError> {
        if runtime != Runtime::Remote {
            if !url.is_empty() {
                return Err(ApiError::invalid(format!(
                    "remote_url: only for RUNTIME_REMOTE, not {runtime}"
                )));
            }
            return Ok(None);
        }
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(ApiError::invalid(
                "remote_url: a remote session needs the http(s):// URL of its agentctl",
            ));
        }
        for (field, value) in [("remote_url", url), ("remote_secret", secret)] {
            if value.len() > MAX_REMOTE_FIELD_BYTES {
                return Err(ApiError::invalid(format!(
                    "{field}: longer than {MAX_REMOTE_FIELD_BYTES} bytes"
                )));
            }
        }
        // Before anything is stored or dialled: a caller must not make
        // sessiond connect wherever it likes (SSRF).
        self.settings
            .remote_allowed_hosts
            .check(url)
            .map_err(ApiError::InvalidArgument)?;
        if secret.is_empty() {
            return Err(ApiError::invalid(
                "remote_secret: a remote session needs the secret its agentctl was started with",
            ));
        }
        let executor_id = ExecutorId::parse(executor_id).map_err(|_| {
            ApiError::invalid(
                "remote_executor_id: a remote session needs the executor id (a UUID) its agentctl was started with",
            )
        })?;
        Ok(Some(RemoteAgentctl {
            executor_id,
            url: url.to_owned(),
            auth_secret: secret.to_owned(),
        }))
    }
}

/// Where a workspace call goes.
enum Target {
    Here(AgentctlClient),
    Owner(Owner),
}

/// A workspace call's failure: agentctl's own answer keeps its status (a
/// missing file, a path outside the workspace: the caller's to fix); not
/// reaching agentctl, or it refusing this replica, is the executor's.
fn agentctl(e: sessiond_executor::Error) -> ApiError {
    use sessiond_executor::Error as E;
    match e {
        E::Rpc { status, .. } => ApiError::Agentctl(*status),
        // The call's own deadline ran out on our side: DEADLINE_EXCEEDED,
        // as when agentctl says so.
        E::Timeout { .. } => ApiError::Agentctl(Status::deadline_exceeded(e.to_string())),
        // agentctl refused the secret we hold for it: our problem, not the
        // caller's.
        E::Unauthenticated { .. } => ApiError::Agentctl(Status::unauthenticated(e.to_string())),
        other => ApiError::Executor(other),
    }
}

#[tonic::async_trait]
impl pb::session_service_server::SessionService for Api {
    async fn create_task(
        &self,
        request: Request<pb::CreateTaskRequest>,
    ) -> Result<Response<pb::CreateTaskResponse>, Status> {
        let req = request.into_inner();
        req.check_bounds(self.settings.max_message_bytes)
            .map_err(Status::from)?;
        reply(
            async {
                let title = req.title.trim();
                if title.is_empty() {
                    return Err(ApiError::invalid("title: required"));
                }
                if title.chars().count() > MAX_TITLE_CHARS {
                    return Err(ApiError::invalid(format!(
                        "title: longer than {MAX_TITLE_CHARS} characters"
                    )));
                }
                // NUL, terminal escapes and text reordering would reach
                // every client's screen.
                if let Some(problem) = sessiond_domain::user_title_problem(title) {
                    return Err(ApiError::invalid(format!("title: {problem}")));
                }
                let now = Utc::now();
                let task = self
                    .store
                    .create_task(&Task {
                        id: TaskId::new(),
                        title: title.to_owned(),
                        state: TaskState::Todo,
                        created_at: now,
                        updated_at: now,
                    })
                    .await?;
                Ok(pb::CreateTaskResponse {
                    task: Some(convert::task(&task)),
                })
            }
            .await,
        )
    }

    async fn get_task(
        &self,
        request: Request<pb::GetTaskRequest>,
    ) -> Result<Response<pb::GetTaskResponse>, Status> {
        let req = request.into_inner();
        req.check_bounds(self.settings.max_message_bytes)
            .map_err(Status::from)?;
        reply(
            async {
                let task = self.store.get_task(task_id(&req.task_id)?).await?;
                // The task's usage is its sessions' (each keeps its own).
                let mut usage = sessiond_domain::UsageTotals::default();
                for s in self.store.list_sessions(task.id).await? {
                    usage.add(&sessiond_domain::UsageTotals::from_metadata(&s.metadata));
                }
                let mut out = convert::task(&task);
                out.usage = Some(convert::usage_totals(&usage));
                Ok(pb::GetTaskResponse { task: Some(out) })
            }
            .await,
        )
    }

    async fn list_tasks(
        &self,
        request: Request<pb::ListTasksRequest>,
    ) -> Result<Response<pb::ListTasksResponse>, Status> {
        let req = request.into_inner();
        req.check_bounds(self.settings.max_message_bytes)
            .map_err(Status::from)?;
        reply(
            async {
                let limit = page_size(req.page_size)?;
                let after = match req.page_token.as_str() {
                    "" => None,
                    token => Some(TaskId::parse(token).map_err(|_| {
                        ApiError::invalid("page_token: not a token this server gave")
                    })?),
                };
                let tasks = self.store.list_tasks(after, limit).await?;
                let next_page_token = if tasks.len() == limit as usize {
                    tasks.last().map(|t| t.id.to_string()).unwrap_or_default()
                } else {
                    String::new()
                };
                Ok(pb::ListTasksResponse {
                    tasks: tasks.iter().map(convert::task).collect(),
                    next_page_token,
                })
            }
            .await,
        )
    }

    async fn list_agent_profiles(
        &self,
        _request: Request<pb::ListAgentProfilesRequest>,
    ) -> Result<Response<pb::ListAgentProfilesResponse>, Status> {
        reply(
            async {
                let profiles = self.store.list_agent_profiles().await?;
                Ok(pb::ListAgentProfilesResponse {
                    profiles: profiles.iter().map(convert::profile).collect(),
                })
            }
            .await,
        )
    }

    async fn list_runtimes(
        &self,
        request: Request<pb::ListRuntimesRequest>,
    ) -> Result<Response<pb::ListRuntimesResponse>, Status> {
        request
            .into_inner()
            .check_bounds(self.settings.max_message_bytes)
            .map_err(Status::from)?;
        let runtimes = self.manager.runtimes();
        Ok(Response::new(pb::ListRuntimesResponse {
            runtimes: runtimes
                .iter()
                .map(|r| convert::runtime(*r) as i32)
                .collect(),
            runtime_names: runtimes.iter().map(ToString::to_string).collect(),
        }))
    }

    async fn list_repositories(
        &self,
        _request: Request<pb::ListRepositoriesRequest>,
    ) -> Result<Response<pb::ListRepositoriesResponse>, Status> {
        Ok(Response::new(pb::ListRepositoriesResponse {
            repositories: self
                .settings
                .repositories
                .iter()
                .map(|r| r.display().to_string())
                .collect(),
        }))
    }

    async fn list_repository_branches(
        &self,
        request: Request<pb::ListRepositoryBranchesRequest>,
    ) -> Result<Response<pb::ListRepositoryBranchesResponse>, Status> {
        let req = request.into_inner();
        req.check_bounds(self.settings.max_message_bytes)
            .map_err(Status::from)?;
        reply(
            async {
                let runtime = convert::runtime_from(req.runtime, "")
                    .map_err(ApiError::InvalidArgument)?
                    .unwrap_or(self.settings.default_runtime);
                if !Path::new(&req.repository).is_absolute() {
                    return Err(ApiError::invalid(format!(
                        "repository: {:?} is not an absolute path",
                        req.repository
                    )));
                }
                let remote = self.remote_agentctl(
                    runtime,
                    &req.remote_url,
                    &req.remote_secret,
                    &req.remote_executor_id,
                )?;
                if runtime != Runtime::Remote {
                    check_worktree(&req.repository, &self.settings.worktree_roots).map_err(
                        |e| match e {
                            ApiError::InvalidArgument(m) => ApiError::InvalidArgument(m.replacen(
                                "worktree.path",
                                "repository",
                                1,
                            )),
                            other => other,
                        },
                    )?;
                }
                let (branches, current) = self
                    .manager
                    .repository_branches(runtime, &req.repository, remote.as_ref())
                    .await?;
                Ok(pb::ListRepositoryBranchesResponse { branches, current })
            }
            .await,
        )
    }

    async fn list_replicas(
        &self,
        _request: Request<pb::ListReplicasRequest>,
    ) -> Result<Response<pb::ListReplicasResponse>, Status> {
        reply(
            async {
                let now = chrono::Utc::now();
                let me = self.manager.replica().id().to_owned();
                let mut replicas = self.store.list_replicas(now).await?;
                // One process on its own store holds no leases: it owns
                // every live executor.
                if self.manager.config().replica.exclusive {
                    let live: i64 = self
                        .store
                        .count_executors_by_runtime_and_status()
                        .await?
                        .into_iter()
                        .filter(|(_, status, _)| *status != ExecutorStatus::Stopped)
                        .map(|(_, _, n)| n)
                        .sum();
                    for r in replicas.iter_mut().filter(|r| r.id == me) {
                        r.owned_executors = live;
                    }
                }
                Ok(pb::ListReplicasResponse {
                    replicas: replicas.iter().map(|r| convert::replica(r, now)).collect(),
                    self_id: me,
                })
            }
            .await,
        )
    }

    async fn create_session(
        &self,
        request: Request<pb::CreateSessionRequest>,
    ) -> Result<Response<pb::CreateSessionResponse>, Status> {
        let req = request.into_inner();
        req.check_bounds(self.settings.max_message_bytes)
            .map_err(Status::from)?;
        reply(
            async {
                let task = task_id(&req.task_id)?;
                let runtime = convert::runtime_from(req.runtime, &req.runtime_name)
                    .map_err(ApiError::InvalidArgument)?
                    .unwrap_or(self.settings.default_runtime);
                let w = req.worktree.unwrap_or_default();
                check_worktree_names(&w)?;
                let managed = !w.repository.is_empty();
                if managed {
                    if !w.path.is_empty() {
                        return Err(ApiError::invalid(
                            "worktree.path: must be empty with worktree.repository (sessiond \
                         creates the worktree under executors.worktrees_dir)",
                        ));
                    }
                    if !Path::new(&w.repository).is_absolute() {
                        return Err(ApiError::invalid(format!(
                            "worktree.repository: {:?} is not an absolute path",
                            w.repository
                        )));
                    }
                    if runtime != Runtime::Remote {
                        check_worktree(&w.repository, &self.settings.worktree_roots).map_err(
                            |e| match e {
                                ApiError::InvalidArgument(m) => ApiError::InvalidArgument(
                                    m.replacen("worktree.path", "worktree.repository", 1),
                                ),
                                other => other,
                            },
                        )?;
                    }
                } else if w.path.trim().is_empty() {
                    return Err(ApiError::invalid("worktree.path: required"));
                }
                if !managed && !Path::new(&w.path).is_absolute() {
                    return Err(ApiError::invalid(format!(
                        "worktree.path: {:?} is not an absolute path",
                        w.path
                    )));
                }
                if !managed && w.path.len() > MAX_PATH_BYTES {
                    return Err(ApiError::invalid(format!(
                        "worktree.path: longer than {MAX_PATH_BYTES} bytes"
                    )));
                }
                // Custom runtimes too: sessiond cannot know where a driver puts
                // the worktree, so it holds them to the same roots.
                if !managed && runtime != Runtime::Remote {
                    check_worktree(&w.path, &self.settings.worktree_roots)?;
                }
                // On this host: said now, not as a missing worktree of a
                // session that is never stored.
                if !managed && matches!(runtime, Runtime::LocalStandalone | Runtime::LocalDocker) {
                    match std::fs::metadata(&w.path) {
                        Ok(m) if m.is_dir() => {}
                        Ok(_) => {
                            return Err(ApiError::WorktreeMissing(format!(
                                "worktree.path: {:?} is not a directory",
                                w.path
                            )));
                        }
                        Err(e) => {
                            return Err(ApiError::WorktreeMissing(format!(
                                "worktree.path: {:?}: {e}; create the directory first",
                                w.path
                            )));
                        }
                    }
                }
                let remote = self.remote_agentctl(
                    runtime,
                    &req.remote_url,
                    &req.remote_secret,
                    &req.remote_executor_id,
                )?;
                // Unknown task before unknown profile: the task is the parent.
                self.store.get_task(task).await?;
                let agent_profile_id = self.profile_id(&req.agent_profile).await?;
                let mcp_servers =
                    convert::mcp_servers_in(&req.mcp_servers).map_err(ApiError::invalid)?;
                let session = self
                    .manager
                    .create_session(NewSession {
                        task_id: task,
                        agent_profile_id,
                        runtime,
                        worktree: Worktree {
                            id: w.id,
                            path: w.path,
                            branch: w.branch,
                            repository: w.repository,
                            base: w.base,
                        },
                        remote,
                        metadata: Default::default(),
                        mcp_servers,
                    })
                    .await?;
                Ok(pb::CreateSessionResponse {
                    session: Some(convert::session(&session)),
                })
            }
            .await,
        )
    }

    async fn get_session(
        &self,
        request: Request<pb::GetSessionRequest>,
    ) -> Result<Response<pb::GetSessionResponse>, Status> {
        let req = request.into_inner();
        req.check_bounds(self.settings.max_message_bytes)
            .map_err(Status::from)?;
        reply(
            async {
                let (task, session) = ids(&req.task_id, &req.session_id)?;
                let s = self.session_of(task, session).await?;
                Ok(pb::GetSessionResponse {
                    session: Some(self.session_now(&s)),
                })
            }
            .await,
        )
    }

    async fn list_sessions(
        &self,
        request: Request<pb::ListSessionsRequest>,
    ) -> Result<Response<pb::ListSessionsResponse>, Status> {
        let req = request.into_inner();
        req.check_bounds(self.settings.max_message_bytes)
            .map_err(Status::from)?;
        reply(
            async {
                let task = task_id(&req.task_id)?;
                self.store.get_task(task).await?;
                let sessions = self.store.list_sessions(task).await?;
                Ok(pb::ListSessionsResponse {
                    sessions: sessions.iter().map(|s| self.session_now(s)).collect(),
                })
            }
            .await,
        )
    }

    async fn get_session_status(
        &self,
        request: Request<pb::GetSessionStatusRequest>,
    ) -> Result<Response<pb::GetSessionStatusResponse>, Status> {
        let req = request.into_inner();
        req.check_bounds(self.settings.max_message_bytes)
            .map_err(Status::from)?;
        reply(
            async {
                let (task, session) = ids(&req.task_id, &req.session_id)?;
                let (status, modes) = self.manager.session_status_and_modes(task, session).await?;
                let running = status.state == sessiond_domain::SessionState::Running;
                let mut out = convert::status(status);
                out.config_options = modes
                    .as_ref()
                    .map(convert::config_options)
                    .unwrap_or_default();
                // An agent with config options but no modes has none to list.
                out.modes = modes
                    .as_ref()
                    .filter(|m| !m.available.is_empty())
                    .map(convert::modes);
                // Only a turn in progress can wait on one.
                if running {
                    out.pending_permissions = Box::pin(self.manager.pending_permissions(session))
                        .await?
                        .iter()
                        .map(convert::permission_request)
                        .collect();
                }
                Ok(out)
            }
            .await,
        )
    }

    async fn resume_session(
        &self,
        request: Request<pb::ResumeSessionRequest>,
    ) -> Result<Response<pb::ResumeSessionResponse>, Status> {
        let origin = Origin::of(&request);
        let req = request.into_inner();
        req.check_bounds(self.settings.max_message_bytes)
            .map_err(Status::from)?;
        reply(
            async {
                let (task, session) = ids(&req.task_id, &req.session_id)?;
                self.here_or_forward(session, &origin, req, |_| async move {
                    self.manager.resume_session(task, session).await?;
                    let s = self.session_of(task, session).await?;
                    Ok(pb::ResumeSessionResponse {
                        session: Some(convert::session(&s)),
                    })
                })
                .await
            }
            .await,
        )
    }

    async fn send_message(
        &self,
        request: Request<pb::SendMessageRequest>,
    ) -> Result<Response<pb::SendMessageResponse>, Status> {
        let origin = Origin::of(&request);
        let req = request.into_inner();
        req.check_bounds(self.settings.max_message_bytes)
            .map_err(Status::from)?;
        reply(
            async {
                let (task, session) = ids(&req.task_id, &req.session_id)?;
                let limit = self.settings.max_message_bytes;
                if req.content.len() > limit {
                    return Err(ApiError::invalid(format!(
                        "content: {} bytes is over the limit of {limit} bytes (max_message_bytes)",
                        req.content.len()
                    )));
                }
                let attachments =
                    convert::attachments_in(&req.attachments).map_err(ApiError::invalid)?;
                if req.content.trim().is_empty() && attachments.is_empty() {
                    return Err(ApiError::invalid("content: required"));
                }
                self.here_or_forward(session, &origin, req, |req| async move {
                    let outgoing = Outgoing {
                        queue: !req.no_queue,
                        request_id: (!req.request_id.is_empty()).then_some(req.request_id),
                        text: req.content,
                        attachments,
                    };
                    Ok(
                        match self.manager.send_outgoing(task, session, outgoing).await? {
                            Sent::Started(m) => pb::SendMessageResponse {
                                message: Some(convert::message(&m)),
                                queued: None,
                            },
                            Sent::Queued(q) => pb::SendMessageResponse {
                                message: None,
                                queued: Some(convert::queued_message(&q)),
                            },
                        },
                    )
                })
                .await
            }
            .await,
        )
    }

    async fn cancel_queued_message(
        &self,
        request: Request<pb::CancelQueuedMessageRequest>,
    ) -> Result<Response<pb::CancelQueuedMessageResponse>, Status> {
        let origin = Origin::of(&request);
        let req = request.into_inner();
        req.check_bounds(self.settings.max_message_bytes)
            .map_err(Status::from)?;
        reply(
            async {
                let (task, session) = ids(&req.task_id, &req.session_id)?;
                let message = MessageId::parse(&req.message_id)?;
                self.here_or_forward(session, &origin, req, |_| async move {
                    let cancelled = self
                        .manager
                        .cancel_queued_message(task, session, message)
                        .await?;
                    Ok(pb::CancelQueuedMessageResponse {
                        cancelled: Some(convert::queued_message(&cancelled)),
                    })
                })
                .await
            }
            .await,
        )
    }

    async fn retry_turn(
        &self,
        request: Request<pb::RetryTurnRequest>,
    ) -> Result<Response<pb::RetryTurnResponse>, Status> {
        let origin = Origin::of(&request);
        let req = request.into_inner();
        req.check_bounds(self.settings.max_message_bytes)
            .map_err(Status::from)?;
        reply(
            async {
                let (task, session) = ids(&req.task_id, &req.session_id)?;
                self.here_or_forward(session, &origin, req, |req| async move {
                    let message = if req.message_id.is_empty() {
                        None
                    } else {
                        Some(MessageId::parse(&req.message_id)?)
                    };
                    let (message, retried) =
                        self.manager.retry_turn(task, session, message).await?;
                    Ok(pb::RetryTurnResponse {
                        message: Some(convert::message(&message)),
                        retried_message_id: retried.to_string(),
                    })
                })
                .await
            }
            .await,
        )
    }

    async fn cancel_turn(
        &self,
        request: Request<pb::CancelTurnRequest>,
    ) -> Result<Response<pb::CancelTurnResponse>, Status> {
        let origin = Origin::of(&request);
        let req = request.into_inner();
        req.check_bounds(self.settings.max_message_bytes)
            .map_err(Status::from)?;
        reply(
            async {
                let (task, session) = ids(&req.task_id, &req.session_id)?;
                self.here_or_forward(session, &origin, req, |_| async move {
                    let cancelled = self.manager.cancel_turn(task, session).await?;
                    Ok(pb::CancelTurnResponse { cancelled })
                })
                .await
            }
            .await,
        )
    }

    async fn respond_to_permission(
        &self,
        request: Request<pb::RespondToPermissionRequest>,
    ) -> Result<Response<pb::RespondToPermissionResponse>, Status> {
        let origin = Origin::of(&request);
        let req = request.into_inner();
        req.check_bounds(self.settings.max_message_bytes)
            .map_err(Status::from)?;
        reply(
            async {
                let (task, session) = ids(&req.task_id, &req.session_id)?;
                self.here_or_forward(session, &origin, req, |req| async move {
                    let m = self
                        .manager
                        .respond_with_values(
                            task,
                            session,
                            &req.request_id,
                            &req.option_id,
                            &req.content_json,
                        )
                        .await?;
                    Ok(pb::RespondToPermissionResponse {
                        request: Some(convert::permission_request(&m)),
                    })
                })
                .await
            }
            .await,
        )
    }

    async fn set_session_mode(
        &self,
        request: Request<pb::SetSessionModeRequest>,
    ) -> Result<Response<pb::SetSessionModeResponse>, Status> {
        let origin = Origin::of(&request);
        let req = request.into_inner();
        req.check_bounds(self.settings.max_message_bytes)
            .map_err(Status::from)?;
        reply(
            async {
                let (task, session) = ids(&req.task_id, &req.session_id)?;
                self.here_or_forward(session, &origin, req, |req| async move {
                    let modes = self
                        .manager
                        .set_session_mode(task, session, &req.mode_id)
                        .await?;
                    Ok(pb::SetSessionModeResponse {
                        modes: Some(convert::modes(&modes)),
                    })
                })
                .await
            }
            .await,
        )
    }

    async fn set_session_title(
        &self,
        request: Request<pb::SetSessionTitleRequest>,
    ) -> Result<Response<pb::SetSessionTitleResponse>, Status> {
        let origin = Origin::of(&request);
        let req = request.into_inner();
        req.check_bounds(self.settings.max_message_bytes)
            .map_err(Status::from)?;
        reply(
            async {
                let (task, session) = ids(&req.task_id, &req.session_id)?;
                let title = req.title.trim();
                let max = sessiond_domain::MAX_SESSION_TITLE_CHARS;
                if title.chars().count() > max {
                    return Err(ApiError::invalid(format!(
                        "title: longer than {max} characters"
                    )));
                }
                if let Some(problem) = sessiond_domain::user_title_problem(title) {
                    return Err(ApiError::invalid(format!("title: {problem}")));
                }
                self.session_of(task, session).await?;
                let title = title.to_owned();
                // Written on the owner, whose status snapshot (and the next
                // turn's naming by its prompt) must see it at once.
                self.here_or_forward(session, &origin, req, |_| async move {
                    let (s, _) = self
                        .manager
                        .set_session_title(session, title, sessiond_domain::TitleSource::User)
                        .await?;
                    Ok(pb::SetSessionTitleResponse {
                        session: Some(convert::session(&s)),
                    })
                })
                .await
            }
            .await,
        )
    }

    async fn set_session_config_option(
        &self,
        request: Request<pb::SetSessionConfigOptionRequest>,
    ) -> Result<Response<pb::SetSessionConfigOptionResponse>, Status> {
        let origin = Origin::of(&request);
        let req = request.into_inner();
        req.check_bounds(self.settings.max_message_bytes)
            .map_err(Status::from)?;
        reply(
            async {
                let (task, session) = ids(&req.task_id, &req.session_id)?;
                self.here_or_forward(session, &origin, req, |req| async move {
                    let modes = self
                        .manager
                        .set_session_config_option(task, session, &req.config_id, &req.value)
                        .await?;
                    Ok(pb::SetSessionConfigOptionResponse {
                        config_options: convert::config_options(&modes),
                    })
                })
                .await
            }
            .await,
        )
    }

    async fn list_messages(
        &self,
        request: Request<pb::ListMessagesRequest>,
    ) -> Result<Response<pb::ListMessagesResponse>, Status> {
        let req = request.into_inner();
        req.check_bounds(self.settings.max_message_bytes)
            .map_err(Status::from)?;
        reply(
            async {
                let (task, session) = ids(&req.task_id, &req.session_id)?;
                if req.after_seq < 0 {
                    return Err(ApiError::invalid("after_seq: must not be negative"));
                }
                let limit = page_size(req.page_size)?;
                self.session_of(task, session).await?;
                let mut messages = self
                    .store
                    .list_messages(session, req.after_seq, limit)
                    .await?;
                let mut next_after_seq = if messages.len() == limit as usize {
                    messages.last().map_or(0, |m| m.seq)
                } else {
                    0
                };
                // A page stays well under what clients read (64 MiB): a
                // reply can hold 32 MiB, so two would not fit. At least one
                // message per page, so a listing always moves on.
                let mut bytes = 0;
                if let Some(cut) = messages.iter().position(|m| {
                    bytes += m.content.len() + m.data.len();
                    bytes > MAX_PAGE_BYTES
                }) {
                    let keep = cut.max(1);
                    if keep < messages.len() {
                        messages.truncate(keep);
                        next_after_seq = messages.last().map_or(0, |m| m.seq);
                    }
                }
                Ok(pb::ListMessagesResponse {
                    messages: messages.iter().map(convert::message).collect(),
                    next_after_seq,
                })
            }
            .await,
        )
    }

    async fn stop_session(
        &self,
        request: Request<pb::StopSessionRequest>,
    ) -> Result<Response<pb::StopSessionResponse>, Status> {
        let origin = Origin::of(&request);
        let req = request.into_inner();
        req.check_bounds(self.settings.max_message_bytes)
            .map_err(Status::from)?;
        reply(
            async {
                let (task, session) = ids(&req.task_id, &req.session_id)?;
                let reason = match pb::StopOutcome::try_from(req.outcome) {
                    Ok(pb::StopOutcome::Completed) => EndReason::Completed,
                    Ok(pb::StopOutcome::Cancelled | pb::StopOutcome::Unspecified) => {
                        EndReason::Cancelled
                    }
                    Err(_) => {
                        return Err(ApiError::invalid(format!(
                            "outcome: {} is not a StopOutcome",
                            req.outcome
                        )));
                    }
                };
                self.here_or_forward(session, &origin, req, |_| async move {
                    let s = self.manager.end_session(task, session, reason).await?;
                    Ok(pb::StopSessionResponse {
                        session: Some(convert::session(&s)),
                    })
                })
                .await
            }
            .await,
        )
    }

    async fn delete_session(
        &self,
        request: Request<pb::DeleteSessionRequest>,
    ) -> Result<Response<pb::DeleteSessionResponse>, Status> {
        let origin = Origin::of(&request);
        let req = request.into_inner();
        req.check_bounds(self.settings.max_message_bytes)
            .map_err(Status::from)?;
        reply(
            async {
                let (task, session) = ids(&req.task_id, &req.session_id)?;
                self.here_or_forward(session, &origin, req, |req| async move {
                    let asked = sessiond_domain::worktree::RemovalRequest {
                        discard: req.discard_worktree,
                        keep: req.keep_worktree,
                        delete_branch: req.delete_branch,
                    };
                    if asked.discard && asked.keep {
                        return Err(ApiError::invalid(
                            "discard_worktree and keep_worktree exclude each other",
                        ));
                    }
                    self.manager
                        .delete_session_with(task, session, asked)
                        .await?;
                    Ok(pb::DeleteSessionResponse {})
                })
                .await
            }
            .await,
        )
    }

    type WatchSessionStream = EventStream;

    async fn watch_session(
        &self,
        request: Request<pb::WatchSessionRequest>,
    ) -> Result<Response<Self::WatchSessionStream>, Status> {
        let caller = caller(&request);
        let req = request.into_inner();
        req.check_bounds(self.settings.max_message_bytes)
            .map_err(Status::from)?;
        reply(
            async {
                let session = session_id(&req.session_id)?;
                if req.after_seq < 0 {
                    return Err(ApiError::invalid("after_seq: must not be negative"));
                }
                let permit = self.settings.watch_limits.acquire(caller)?;
                let events = self.manager.watch_session(session, req.after_seq).await?;
                Ok(self.stream(events, permit))
            }
            .await,
        )
    }

    type WatchTaskStream = EventStream;

    async fn watch_task(
        &self,
        request: Request<pb::WatchTaskRequest>,
    ) -> Result<Response<Self::WatchTaskStream>, Status> {
        let caller = caller(&request);
        let req = request.into_inner();
        req.check_bounds(self.settings.max_message_bytes)
            .map_err(Status::from)?;
        reply(
            async {
                let task = task_id(&req.task_id)?;
                if req.after_task_seq < 0 {
                    return Err(ApiError::invalid("after_task_seq: must not be negative"));
                }
                let permit = self.settings.watch_limits.acquire(caller)?;
                let events = self.manager.watch_task(task, req.after_task_seq).await?;
                Ok(self.stream(events, permit))
            }
            .await,
        )
    }

    type WatchManyStream = WatchManyStream;

    async fn watch_many(
        &self,
        request: Request<pb::WatchManyRequest>,
    ) -> Result<Response<Self::WatchManyStream>, Status> {
        let caller = caller(&request);
        let req = request.into_inner();
        req.check_bounds(self.settings.max_message_bytes)
            .map_err(Status::from)?;
        reply(
            async {
                if req.targets.is_empty() || req.targets.len() > MAX_WATCH_TARGETS {
                    return Err(ApiError::invalid(format!(
                        "targets: {} given; watch 1 to {MAX_WATCH_TARGETS} sessions or tasks per call",
                        req.targets.len()
                    )));
                }
                enum Target {
                    Session(SessionId),
                    Task(TaskId),
                }
                let mut targets = Vec::with_capacity(req.targets.len());
                for (i, t) in req.targets.iter().enumerate() {
                    let target = match (t.session_id.is_empty(), t.task_id.is_empty()) {
                        (false, true) => SessionId::parse(&t.session_id)
                            .map(Target::Session)
                            .map_err(|e| {
                                ApiError::invalid(format!("targets[{i}].session_id: {e}"))
                            })?,
                        (true, false) => TaskId::parse(&t.task_id).map(Target::Task).map_err(
                            |e| ApiError::invalid(format!("targets[{i}].task_id: {e}")),
                        )?,
                        _ => {
                            return Err(ApiError::invalid(format!(
                                "targets[{i}]: give exactly one of session_id and task_id"
                            )));
                        }
                    };
                    if t.after < 0 {
                        return Err(ApiError::invalid(format!(
                            "targets[{i}].after: must not be negative"
                        )));
                    }
                    targets.push((target, t.after));
                }
                // Each target is a stream the server follows.
                let permits = self
                    .settings
                    .watch_limits
                    .acquire_n(caller, targets.len())?
                    .split();
                let mut streams = Vec::with_capacity(targets.len());
                for (i, ((target, after), permit)) in targets.into_iter().zip(permits).enumerate() {
                    let index = i as u32;
                    let opened = match target {
                        Target::Session(id) => self.manager.watch_session(id, after).await,
                        Target::Task(id) => self.manager.watch_task(id, after).await,
                    };
                    // A target that cannot be followed (deleted) ends alone.
                    let events = match opened {
                        Ok(events) => events,
                        Err(e) => futures::stream::once(futures::future::ready(Err(e))).boxed(),
                    };
                    streams.push(watch_target(index, events, permit));
                }
                let merged = futures::stream::select_all(streams).boxed();
                // Each target holds its own slot (`watch_target`).
                Ok(self.until_stopped(merged, None))
            }
            .await,
        )
    }
}

/// The most targets one WatchMany call follows.
const MAX_WATCH_TARGETS: usize = 64;

/// WatchMany's answer stream.
pub type WatchManyStream =
    Pin<Box<dyn Stream<Item = Result<pb::WatchManyResponse, Status>> + Send>>;

/// One WatchMany target's events, each naming `index`. Its session or task
/// deleted (NOT_FOUND), the target ends alone with a `WatchEnded`; any
/// other failure (the database away, shutting down) ends the call, as it
/// would end a WatchSession, for the client to resubscribe.
fn watch_target(
    index: u32,
    events: sessiond_engine::EventStream,
    permit: crate::limits::WatchPermit,
) -> Pin<Box<dyn Stream<Item = Result<pb::WatchManyResponse, Status>> + Send>> {
    // The state holds the target's slot until its last answer: an ended
    // target's stream ends (and frees the slot) at once, without waiting
    // for another event of its source.
    futures::stream::unfold(Some((events, permit)), move |state| async move {
        let (mut events, permit) = state?;
        let item = events.next().await?;
        let answer = match item {
            Ok(e) => {
                let answer = pb::WatchManyResponse {
                    target: index,
                    event: Some(convert::event(&e)),
                    ended: None,
                };
                return Some((Ok(answer), Some((events, permit))));
            }
            Err(e) => {
                let status = Status::from(ApiError::from(e));
                if status.code() == tonic::Code::NotFound {
                    let error = status
                        .metadata()
                        .get("sessiond-error")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_owned();
                    Ok(pb::WatchManyResponse {
                        target: index,
                        event: None,
                        ended: Some(pb::WatchEnded {
                            code: status.code() as i32,
                            message: status.message().to_owned(),
                            error,
                        }),
                    })
                } else {
                    Err(status)
                }
            }
        };
        drop((events, permit));
        Some((answer, None))
    })
    .boxed()
}

#[tonic::async_trait]
impl pb::workspace_service_server::WorkspaceService for Api {
    async fn exec(
        &self,
        request: Request<pb::ExecRequest>,
    ) -> Result<Response<pb::ExecResponse>, Status> {
        let origin = Origin::of(&request);
        let req = request.into_inner();
        req.check_bounds(self.settings.max_message_bytes)
            .map_err(Status::from)?;
        reply(
            async {
                if req.command.is_empty() {
                    return Err(ApiError::invalid("command: required"));
                }
                check_command_line(&req.command, &req.args)?;
                check_path_field("cwd", &req.cwd)?;
                if req.timeout_ms > MAX_EXEC_TIMEOUT_MS {
                    return Err(ApiError::invalid(format!(
                        "timeout_ms: {} is more than the maximum of {MAX_EXEC_TIMEOUT_MS} (24 h)",
                        req.timeout_ms
                    )));
                }
                if req.max_output_bytes > MAX_EXEC_OUTPUT {
                    return Err(ApiError::invalid(format!(
                        "max_output_bytes: {} is more than the maximum of {MAX_EXEC_OUTPUT}",
                        req.max_output_bytes
                    )));
                }
                self.in_workspace(&origin, req, |req, client| async move {
                    let timeout_ms = if req.timeout_ms == 0 {
                        60_000
                    } else {
                        req.timeout_ms
                    };
                    let command = req.command.clone();
                    let call = apb::ExecRequest {
                        command: req.command,
                        args: req.args,
                        cwd: req.cwd,
                        env: Default::default(),
                        timeout_ms,
                        max_output_bytes: req.max_output_bytes,
                    };
                    // The command's own limit, plus time to collect its output.
                    let deadline = Duration::from_millis(timeout_ms) + Duration::from_secs(10);
                    let r = client.exec_within(call, deadline).await.map_err(agentctl)?;
                    let response = pb::ExecResponse {
                        exit_code: r.exit_code,
                        stdout: r.stdout,
                        stderr: r.stderr,
                        timed_out: r.timed_out,
                        stdout_truncated: r.stdout_truncated,
                        stderr_truncated: r.stderr_truncated,
                        signal: r.signal,
                    };
                    if response.timed_out {
                        // Details travel in a trailer: keep them well inside
                        // header limits.
                        let mut partial = response;
                        for (buf, cut) in [
                            (&mut partial.stdout, &mut partial.stdout_truncated),
                            (&mut partial.stderr, &mut partial.stderr_truncated),
                        ] {
                            if buf.len() > TIMED_OUT_OUTPUT {
                                buf.truncate(TIMED_OUT_OUTPUT);
                                *cut = true;
                            }
                        }
                        return Err(ApiError::CommandTimedOut {
                            command,
                            timeout_ms,
                            output: prost::Message::encode_to_vec(&partial),
                        });
                    }
                    Ok(response)
                })
                .await
            }
            .await,
        )
    }

    async fn read_file(
        &self,
        request: Request<pb::ReadFileRequest>,
    ) -> Result<Response<pb::ReadFileResponse>, Status> {
        let origin = Origin::of(&request);
        let req = request.into_inner();
        req.check_bounds(self.settings.max_message_bytes)
            .map_err(Status::from)?;
        reply(
            async {
                check_path_field("path", &req.path)?;
                self.in_workspace(&origin, req, |req, client| async move {
                    let content = client
                        .read_file(apb::ReadFileRequest {
                            path: req.path,
                            max_bytes: 0,
                        })
                        .await
                        .map_err(agentctl)?;
                    Ok(pb::ReadFileResponse { content })
                })
                .await
            }
            .await,
        )
    }

    async fn write_file(
        &self,
        request: Request<pb::WriteFileRequest>,
    ) -> Result<Response<pb::WriteFileResponse>, Status> {
        let origin = Origin::of(&request);
        let req = request.into_inner();
        req.check_bounds(self.settings.max_message_bytes)
            .map_err(Status::from)?;
        reply(
            async {
                check_path_field("path", &req.path)?;
                self.in_workspace(&origin, req, |req, client| async move {
                    let bytes_written = client
                        .write_file(apb::WriteFileRequest {
                            path: req.path,
                            content: req.content,
                            create_parents: req.create_parents,
                        })
                        .await
                        .map_err(agentctl)?;
                    Ok(pb::WriteFileResponse { bytes_written })
                })
                .await
            }
            .await,
        )
    }

    async fn list_dir(
        &self,
        request: Request<pb::ListDirRequest>,
    ) -> Result<Response<pb::ListDirResponse>, Status> {
        let origin = Origin::of(&request);
        let req = request.into_inner();
        req.check_bounds(self.settings.max_message_bytes)
            .map_err(Status::from)?;
        reply(
            async {
                check_path_field("path", &req.path)?;
                self.in_workspace(&origin, req, |req, client| async move {
                    let entries = client.list_dir(&req.path).await.map_err(agentctl)?;
                    Ok(pb::ListDirResponse {
                        entries: entries
                            .into_iter()
                            .map(|e| pb::DirEntry {
                                is_dir: e.kind == apb::EntryKind::Dir as i32,
                                name: e.name,
                                size: e.size,
                            })
                            .collect(),
                    })
                })
                .await
            }
            .await,
        )
    }

    async fn git_status(
        &self,
        request: Request<pb::GitStatusRequest>,
    ) -> Result<Response<pb::GitStatusResponse>, Status> {
        let origin = Origin::of(&request);
        let req = request.into_inner();
        req.check_bounds(self.settings.max_message_bytes)
            .map_err(Status::from)?;
        reply(
            async {
                self.in_workspace(&origin, req, |_, client| async move {
                    let r = client.git_status().await.map_err(agentctl)?;
                    Ok(pb::GitStatusResponse {
                        branch: r.branch,
                        files: r
                            .files
                            .into_iter()
                            .map(|f| pb::GitFileStatus {
                                path: f.path,
                                code: f.code,
                            })
                            .collect(),
                    })
                })
                .await
            }
            .await,
        )
    }

    async fn git_diff(
        &self,
        request: Request<pb::GitDiffRequest>,
    ) -> Result<Response<pb::GitDiffResponse>, Status> {
        let origin = Origin::of(&request);
        let req = request.into_inner();
        req.check_bounds(self.settings.max_message_bytes)
            .map_err(Status::from)?;
        reply(
            async {
                self.in_workspace(&origin, req, |req, client| async move {
                let base = if req.against_base {
                    let r = req.session.as_ref().ok_or_else(|| ApiError::invalid("session: required"))?;
                    let (task, session) = ids(&r.task_id, &r.session_id)?;
                    let s = self.session_of(task, session).await?;
                    if s.worktree.base.is_empty() {
                        return Err(ApiError::Recovery(sessiond_engine::Error::InvalidState {
                            session_id: session,
                            state: s.state,
                            action: "diff against its base",
                            hint: "its worktree is a directory the caller made, with no base \
                                   recorded; against_base needs one sessiond created from a repository",
                        }));
                    }
                    s.worktree.base
                } else {
                    String::new()
                };
                let diff = client
                    .git_diff(apb::GitDiffRequest {
                        staged: req.staged,
                        paths: Vec::new(),
                        base,
                    })
                    .await
                    .map_err(agentctl)?;
                Ok(pb::GitDiffResponse { diff })
                })
                .await
            }
            .await,
        )
    }

    async fn list_branch_commits(
        &self,
        request: Request<pb::ListBranchCommitsRequest>,
    ) -> Result<Response<pb::ListBranchCommitsResponse>, Status> {
        let origin = Origin::of(&request);
        let req = request.into_inner();
        req.check_bounds(self.settings.max_message_bytes)
            .map_err(Status::from)?;
        reply(
            async {
                let r = req
                    .session
                    .as_ref()
                    .ok_or_else(|| ApiError::invalid("session: required"))?;
                let (task, session) = ids(&r.task_id, &r.session_id)?;
                self.here_or_forward(session, &origin, req, |req| async move {
                    let limit = match req.limit {
                        0 => 200,
                        n if n > 1000 => {
                            return Err(ApiError::invalid("limit: at most 1000"));
                        }
                        n => n,
                    };
                    let s = self.session_of(task, session).await?;
                    let commits = self.manager.branch_commits(task, session, limit).await?;
                    Ok(pb::ListBranchCommitsResponse {
                        commits: commits
                            .into_iter()
                            .map(|c| pb::BranchCommit {
                                sha: c.sha,
                                subject: c.subject,
                                author: c.author,
                                time: c.time,
                            })
                            .collect(),
                        branch: s.worktree.branch,
                        base: s.worktree.base,
                    })
                })
                .await
            }
            .await,
        )
    }
}
