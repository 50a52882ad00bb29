//! The `AgentCtlService` gRPC implementation.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sessiond_proto::agentctl::v1 as pb;
use sessiond_proto::agentctl::v1::agent_ctl_service_server::{
    AgentCtlService, AgentCtlServiceServer,
};
use sessiond_proto::agentctl::v1::{
    AgentState, AgentUpdate, CancelRequest, CancelResponse, CapabilitiesRequest,
    CapabilitiesResponse, Capability, ExecRequest, ExecResponse, GitDiffRequest, GitDiffResponse,
    GitStatusRequest, GitStatusResponse, HealthRequest, HealthResponse, LaunchAgentRequest,
    LaunchAgentResponse, ListDirRequest, ListDirResponse, NewSessionRequest, NewSessionResponse,
    PromptRequest, PromptResponse, ReadFileRequest, ReadFileResponse, ResumeMethod,
    ResumeSessionRequest, ResumeSessionResponse, SessionMode, SessionModes, SetConfigOptionRequest,
    SetConfigOptionResponse, SetModeRequest, SetModeResponse, StopAgentRequest, StopAgentResponse,
    StreamUpdatesRequest, TurnPhase, WorktreeRequest, WorktreeResponse, WriteFileRequest,
    WriteFileResponse,
};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status};

use crate::agent::{AgentManager, LaunchSpec, PermissionPolicy, Reopened};
use crate::auth::{Activity, Authenticator};
use crate::exec::{self, ExecSpec};
use crate::git;
use crate::journal::Phase;
use crate::recover::{self, Recoveries};
use crate::updates::{Read, UpdateLog};
use crate::workspace::{Workspace, WorkspaceSlot};

/// Updates sent per read of the log while replaying.
const REPLAY_BATCH: usize = 256;

/// Largest gRPC message agentctl reads or writes (64 MiB), well above its
/// biggest payloads (16 MiB file reads, 2 x 16 MiB exec output, 32 MiB git
/// output). The backend's client (`sessiond-executor`) uses the same limit;
/// tonic's default of 4 MiB would cut those off.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// Request metadata naming the agentctl instance a `StreamUpdates` cursor
/// belongs to (see the proto).
pub const INSTANCE_ID_METADATA: &str = "agentctl-instance-id";

/// The gRPC service as agentctl serves it: authenticated, with the message
/// size limits of [`MAX_MESSAGE_BYTES`].
pub fn server(service: AgentCtl, auth: Authenticator, without_recover: bool) -> Served {
    let server = AgentCtlServiceServer::new(service)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    Served {
        inner: InterceptedService::new(server, auth),
        without_recover,
    }
}

/// The gRPC path of `Recover`.
const RECOVER_PATH: &str = "/agentctl.v1.AgentCtlService/Recover";

/// The service as served. With `without_recover` (a test hook of debug
/// builds) it does not know `Recover`, as an agentctl built before the
/// method existed: the call reaches the generated server under a path it
/// has no route for, and tonic answers UNIMPLEMENTED as it would there.
#[derive(Clone)]
pub struct Served {
    inner: Inner,
    without_recover: bool,
}

type Inner = InterceptedService<AgentCtlServiceServer<AgentCtl>, Authenticator>;
type HttpRequest<B> = tonic::codegen::http::Request<B>;

impl std::fmt::Debug for Served {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Served")
            .field("without_recover", &self.without_recover)
            .finish_non_exhaustive()
    }
}

impl tonic::server::NamedService for Served {
    const NAME: &'static str =
        <AgentCtlServiceServer<AgentCtl> as tonic::server::NamedService>::NAME;
}

impl<B> tonic::codegen::Service<HttpRequest<B>> for Served
where
    Inner: tonic::codegen::Service<HttpRequest<B>>,
{
    type Response = <Inner as tonic::codegen::Service<HttpRequest<B>>>::Response;
    type Error = <Inner as tonic::codegen::Service<HttpRequest<B>>>::Error;
    type Future = <Inner as tonic::codegen::Service<HttpRequest<B>>>::Future;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: HttpRequest<B>) -> Self::Future {
        if self.without_recover && req.uri().path() == RECOVER_PATH {
            *req.uri_mut() = tonic::codegen::http::Uri::from_static(
                "/agentctl.v1.AgentCtlService/NotKnownToThisAgentctl",
            );
        }
        self.inner.call(req)
    }
}

/// One agentctl: identity, workspace, agent and update log.
#[derive(Debug, Clone)]
pub struct AgentCtl {
    executor_id: String,
    started: Instant,
    workspace: Arc<WorkspaceSlot>,
    /// `--worktree-root`: where the `Worktree` call may work (none: refused).
    worktree_roots: Vec<PathBuf>,
    agent: AgentManager,
    updates: Arc<UpdateLog>,
    activity: Arc<Activity>,
    shutdown: watch::Receiver<bool>,
    recoveries: Arc<Recoveries>,
}

impl AgentCtl {
    /// Wires the service. `shutdown` turning true ends open update streams.
    pub fn new(
        executor_id: String,
        workspace: Arc<WorkspaceSlot>,
        agent: AgentManager,
        updates: Arc<UpdateLog>,
        activity: Arc<Activity>,
        shutdown: watch::Receiver<bool>,
    ) -> Self {
        Self {
            executor_id,
            started: Instant::now(),
            workspace,
            worktree_roots: Vec::new(),
            agent,
            updates,
            activity,
            shutdown,
            recoveries: Arc::default(),
        }
    }

    /// Enables the `Worktree` call within `roots`.
    #[must_use]
    pub fn with_worktree_roots(mut self, roots: Vec<PathBuf>) -> Self {
        self.worktree_roots = roots;
        self
    }

    /// `path` (absolute, normalised) inside a worktree root (`strictly`:
    /// not the root itself), or why not.
    fn inside_roots(&self, what: &str, path: &str, strictly: bool) -> Result<PathBuf, Status> {
        let p = PathBuf::from(path);
        let normal = p.is_absolute()
            && p.components().all(|c| {
                matches!(
                    c,
                    std::path::Component::RootDir | std::path::Component::Normal(_)
                )
            });
        if !normal {
            return Err(Status::invalid_argument(format!(
                "{what}: {path:?} is not an absolute, normalised path"
            )));
        }
        // Symlinks resolved as far as the path exists, so none leads out.
        let mut real = PathBuf::new();
        let mut rest = Vec::new();
        let mut probe = p.as_path();
        loop {
            if let Ok(r) = std::fs::canonicalize(probe) {
                real = r;
                break;
            }
            match (probe.parent(), probe.file_name()) {
                (Some(parent), Some(name)) => {
                    rest.push(name.to_owned());
                    probe = parent;
                }
                _ => break,
            }
        }
        for name in rest.into_iter().rev() {
            real.push(name);
        }
        let inside = self.worktree_roots.iter().any(|root| {
            std::fs::canonicalize(root)
                .is_ok_and(|r| real.starts_with(&r) && !(strictly && real == r))
        });
        if !inside {
            return Err(Status::invalid_argument(format!(
                "{what}: {path} is outside this agentctl's worktree roots ({})",
                self.worktree_roots
                    .iter()
                    .map(|r| r.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        Ok(p)
    }
}

impl AgentCtl {
    /// What `Health` answers now.
    fn health_now(&self) -> HealthResponse {
        self.health_of(self.agent.status())
    }

    /// `Health`'s answer for `status` (read once per call: reading it walks
    /// the agent's process tree in `/proc`).
    fn health_of(&self, status: crate::agent::Status) -> HealthResponse {
        let (journaled, journal_fresh) = self.agent.journaled();
        HealthResponse {
            executor_id: self.executor_id.clone(),
            agentctl_version: env!("CARGO_PKG_VERSION").to_owned(),
            agent_state: status.state as i32,
            agent_exit: status.exit,
            uptime_ms: u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX),
            pid: std::process::id(),
            instance_id: self.updates.instance_id().to_owned(),
            latest_cursor: self.updates.latest(),
            acp_session_id: status.session.unwrap_or_default(),
            journaled,
            journal_fresh,
            modes: wire_modes(
                self.agent.modes().as_ref(),
                self.agent.config_options().as_deref(),
            ),
            agent_activity: status.activity,
            agent_cpu_ms: status.cpu_ms,
            agent_cpu_wait_ms: status.cpu_wait_ms,
            resuming: status.resuming,
            replayed: status.replayed,
            last_turn_id: self.agent.last_turn_id(),
            workspace_root: Some(
                self.workspace
                    .root()
                    .map(|r| r.display().to_string())
                    .unwrap_or_default(),
            ),
        }
    }

    /// What `Capabilities` answers now.
    fn capabilities_now(&self) -> CapabilitiesResponse {
        Self::capabilities_of(&self.agent.status())
    }

    /// `Capabilities`' answer for `status`.
    fn capabilities_of(status: &crate::agent::Status) -> CapabilitiesResponse {
        // Resumable by ACP `session/load` or by `session/resume`.
        let offered =
            status.agent_load_session == Some(true) || status.agent_resume_session == Some(true);
        let resume = match status.agent_load_session {
            None => Capability::Unknown,
            Some(_) if status.profile_claim && offered => Capability::Supported,
            Some(_) => Capability::Unsupported,
        };
        CapabilitiesResponse {
            supports_session_resume: resume as i32,
            supports_workspace_only: Capability::Supported as i32,
            profile_claims_session_resume: status.profile_claim,
            agent_load_session: status.agent_load_session,
            agent_resume_session: status.agent_resume_session,
            prompt: status.prompt_caps.as_ref().map(|c| pb::PromptCapabilities {
                image: c.image,
                audio: c.audio,
                embedded_context: c.embedded_context,
            }),
        }
    }

    /// `Recover`, after the identity check: one call that asks for the
    /// agent at a time; one that asks for health only answers at once.
    async fn recover_now(&self, r: pb::RecoverRequest) -> Result<pb::RecoverResponse, Status> {
        let asks_agent = r.launch.is_some() && !r.resume_token.is_empty();
        let mut memory = match asks_agent {
            true => Some(self.recoveries.begin(r.generation).await?),
            false => {
                self.recoveries.admit(r.generation)?;
                None
            }
        };
        let status = self.agent.status();
        let capabilities = Self::capabilities_of(&status);
        let health = self.health_of(status);
        let agent = match (r.launch, memory.as_deref_mut()) {
            (Some(launch), Some(memory)) => match health.agent_state() {
                AgentState::None | AgentState::Exited => {
                    self.launch_and_resume(memory, r.generation, launch, r.resume_token)
                        .await
                }
                // Someone else's to deal with (a starting agent, or one that
                // runs): the caller decides from `health`. The same call
                // repeated finds the agent it launched here.
                _ => self
                    .agent
                    .pid()
                    .and_then(|pid| memory.duplicate(r.generation, &r.resume_token, pid))
                    .filter(|_| health.acp_session_id == r.resume_token)
                    .unwrap_or_else(|| recover::nothing(pb::RecoverOutcome::Skipped)),
            },
            _ => recover::nothing(pb::RecoverOutcome::NotAsked),
        };
        Ok(pb::RecoverResponse {
            health: Some(health),
            capabilities: Some(capabilities),
            agent: Some(agent),
        })
    }

    /// The agent part of `Recover`: launch, then reopen `token`.
    async fn launch_and_resume(
        &self,
        memory: &mut recover::Memory,
        generation: i64,
        launch: LaunchAgentRequest,
        token: String,
    ) -> pb::RecoverAgent {
        let spec = match launch_spec(launch) {
            Ok(spec) => spec,
            Err(e) => return recover::failed("LaunchAgent", &Status::from(e), None),
        };
        let launched = match self.agent.launch(spec).await {
            Ok(l) => wire_launched(l),
            Err(e) => return recover::failed("LaunchAgent", &Status::from(e), None),
        };
        let resumed = match self.agent.resume_session(&token).await {
            Ok(r) => self.wire_resumed(r),
            Err(e) => {
                return recover::failed("ResumeSession", &Status::from(e), Some(launched));
            }
        };
        memory.remember(generation, token, &launched, &resumed);
        pb::RecoverAgent {
            outcome: pb::RecoverOutcome::Done as i32,
            launched: Some(launched),
            resumed: Some(resumed),
            ..Default::default()
        }
    }

    fn wire_resumed(&self, resumed: crate::agent::Resumed) -> ResumeSessionResponse {
        let method = match resumed.method {
            Reopened::Resume => ResumeMethod::Resume,
            Reopened::Load => ResumeMethod::Load,
        };
        ResumeSessionResponse {
            resume_token: resumed.token,
            modes: wire_modes(
                self.agent.modes().as_ref(),
                self.agent.config_options().as_deref(),
            ),
            method: method as i32,
            replayed: resumed.replayed,
        }
    }
}

/// What LaunchAgent asks, as the agent manager takes it.
fn launch_spec(r: LaunchAgentRequest) -> crate::error::Result<LaunchSpec> {
    let permission_policy = match r.permission_policy() {
        pb::PermissionPolicy::Allow => Some(PermissionPolicy::AllowOnce),
        pb::PermissionPolicy::Deny => Some(PermissionPolicy::Reject),
        pb::PermissionPolicy::Ask => Some(PermissionPolicy::Ask),
        pb::PermissionPolicy::Unspecified => None,
    };
    Ok(LaunchSpec {
        command: r.command,
        args: r.args,
        env: r.env,
        profile_supports_session_resume: r.profile_supports_session_resume,
        initialize_timeout: Duration::from_millis(r.initialize_timeout_ms),
        auth_method: Some(r.auth_method).filter(|m| !m.is_empty()),
        permission_policy,
        permission_timeout: Duration::from_millis(r.permission_timeout_ms),
        config_defaults: r.config_defaults.into_iter().collect(),
        mcp_servers: crate::config::McpServers::from_wire(r.mcp_servers)?,
    })
}

/// A launched agent on the wire.
fn wire_launched(launched: crate::agent::Launched) -> LaunchAgentResponse {
    LaunchAgentResponse {
        agent_pid: launched.pid,
        agent_name: launched.name,
        agent_version: launched.version,
        agent_load_session: launched.load_session,
        auth_methods: launched
            .auth_methods
            .into_iter()
            .map(|m| pb::AuthMethod {
                id: m.id,
                name: m.name,
                description: m.description,
            })
            .collect(),
        authenticated_with: launched.authenticated_with.unwrap_or_default(),
    }
}

type Res<T> = Result<Response<T>, Status>;

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> crate::error::Result<T> + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(format!("worker failed: {e}")))?
        .map_err(Status::from)
}

/// Prompt's and HoldPrompt's answer.
fn prompted(p: crate::agent::Prompted) -> PromptResponse {
    let phase = match p.phase {
        Phase::Accepted => TurnPhase::Accepted,
        Phase::Handed => TurnPhase::Handed,
        Phase::Ended => TurnPhase::Ended,
    };
    PromptResponse {
        turn_id: p.turn_id,
        message_id: p.message_id,
        already_accepted: p.already_accepted,
        turn_ended: p.turn_ended,
        accepted_by_instance: p.accepted_by,
        phase: phase as i32,
        end_cursor: p.end_cursor,
    }
}

#[tonic::async_trait]
impl AgentCtlService for AgentCtl {
    async fn health(&self, _req: Request<HealthRequest>) -> Res<HealthResponse> {
        Ok(Response::new(self.health_now()))
    }

    async fn capabilities(&self, _req: Request<CapabilitiesRequest>) -> Res<CapabilitiesResponse> {
        Ok(Response::new(self.capabilities_now()))
    }

    async fn recover(&self, req: Request<pb::RecoverRequest>) -> Res<pb::RecoverResponse> {
        let r = req.into_inner();
        if !r.executor_id.is_empty() && r.executor_id != self.executor_id {
            return Err(Status::failed_precondition(format!(
                "{}: this agentctl serves executor {}; the call is for executor {}",
                recover::WRONG_EXECUTOR,
                self.executor_id,
                r.executor_id
            )));
        }
        let me = self.clone();
        // Run to the end even if the caller goes away, as LaunchAgent and
        // ResumeSession do: the next call finds what this one did.
        tokio::spawn(async move { me.recover_now(r).await })
            .await
            .map_err(|e| Status::unavailable(format!("recovery ended abnormally: {e}")))?
            .map(Response::new)
    }
    async fn launch_agent(&self, req: Request<LaunchAgentRequest>) -> Res<LaunchAgentResponse> {
        let spec = launch_spec(req.into_inner())?;
        let agent = self.agent.clone();
        let launched = to_completion(async move { agent.launch(spec).await }).await?;
        Ok(Response::new(wire_launched(launched)))
    }

    async fn new_session(&self, _req: Request<NewSessionRequest>) -> Res<NewSessionResponse> {
        let agent = self.agent.clone();
        let resume_token = to_completion(async move { agent.new_session().await }).await?;
        Ok(Response::new(NewSessionResponse {
            resume_token,
            modes: wire_modes(
                self.agent.modes().as_ref(),
                self.agent.config_options().as_deref(),
            ),
        }))
    }

    async fn resume_session(
        &self,
        req: Request<ResumeSessionRequest>,
    ) -> Res<ResumeSessionResponse> {
        let token = req.into_inner().resume_token;
        let agent = self.agent.clone();
        let resumed = to_completion(async move { agent.resume_session(&token).await }).await?;
        Ok(Response::new(self.wire_resumed(resumed)))
    }

    async fn set_mode(&self, req: Request<SetModeRequest>) -> Res<SetModeResponse> {
        let mode_id = req.into_inner().mode_id;
        let agent = self.agent.clone();
        let modes = to_completion(async move { agent.set_mode(&mode_id).await }).await?;
        Ok(Response::new(SetModeResponse {
            modes: wire_modes(Some(&modes), self.agent.config_options().as_deref()),
        }))
    }

    async fn set_config_option(
        &self,
        req: Request<SetConfigOptionRequest>,
    ) -> Res<SetConfigOptionResponse> {
        let req = req.into_inner();
        let agent = self.agent.clone();
        let options =
            to_completion(async move { agent.set_config_option(&req.config_id, &req.value).await })
                .await?;
        Ok(Response::new(SetConfigOptionResponse {
            modes: wire_modes(self.agent.modes().as_ref(), Some(&options)),
        }))
    }

    async fn prompt(&self, req: Request<PromptRequest>) -> Res<PromptResponse> {
        let r = req.into_inner();
        let blocks = crate::prompt::from_proto(r.blocks)?;
        let p = self
            .agent
            .prompt(r.text, blocks, r.turn_id, r.only_if_journaled)?;
        Ok(Response::new(prompted(p)))
    }

    async fn hold_prompt(&self, req: Request<PromptRequest>) -> Res<PromptResponse> {
        let r = req.into_inner();
        let blocks = crate::prompt::from_proto(r.blocks)?;
        let p = self.agent.hold_prompt(&r.text, &blocks, r.turn_id)?;
        Ok(Response::new(prompted(p)))
    }

    async fn cancel(&self, _req: Request<CancelRequest>) -> Res<CancelResponse> {
        let cancelled = self.agent.cancel()?;
        Ok(Response::new(CancelResponse { cancelled }))
    }

    async fn respond_permission(
        &self,
        req: Request<pb::RespondPermissionRequest>,
    ) -> Res<pb::RespondPermissionResponse> {
        let r = req.into_inner();
        self.agent
            .respond_permission(&r.request_id, &r.option_id, &r.content_json)?;
        Ok(Response::new(pb::RespondPermissionResponse {}))
    }

    async fn stop_agent(&self, req: Request<StopAgentRequest>) -> Res<StopAgentResponse> {
        let grace = Duration::from_millis(req.into_inner().grace_ms);
        let exit = self.agent.stop(grace).await;
        Ok(Response::new(StopAgentResponse { exit }))
    }

    type StreamUpdatesStream = ReceiverStream<Result<AgentUpdate, Status>>;

    async fn stream_updates(
        &self,
        req: Request<StreamUpdatesRequest>,
    ) -> Res<Self::StreamUpdatesStream> {
        let instance = req
            .metadata()
            .get(INSTANCE_ID_METADATA)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let mut last = req.into_inner().after_cursor;
        let (tx, rx) = mpsc::channel(REPLAY_BATCH);
        let log = self.updates.clone();
        let guard = self.activity.stream_guard();
        let mut shutdown = self.shutdown.clone();
        tokio::spawn(async move {
            let _guard = guard;
            let mut wake = log.subscribe();
            let mut first = true;
            loop {
                wake.borrow_and_update();
                let read = if first {
                    first = false;
                    log.read_first(last, &instance, REPLAY_BATCH)
                } else {
                    log.read_after(last, REPLAY_BATCH)
                };
                match read {
                    Read::Gap(gap) => {
                        last = gap.cursor;
                        if tx.send(Ok(*gap)).await.is_err() {
                            return;
                        }
                    }
                    Read::Updates(batch) if batch.is_empty() => {
                        tokio::select! {
                            changed = wake.changed() => if changed.is_err() { return },
                            () = tx.closed() => return,
                            _ = shutdown.wait_for(|s| *s) => return,
                        }
                    }
                    Read::Updates(batch) => {
                        for update in batch {
                            last = update.cursor;
                            if tx.send(Ok(update)).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn exec(&self, req: Request<ExecRequest>) -> Res<ExecResponse> {
        let r = req.into_inner();
        let ws = self.workspace.get()?;
        let cwd_arg = r.cwd.clone();
        let (cwd, handle) = blocking(move || {
            let cwd = ws.resolve(&cwd_arg)?;
            // Said here: the spawn's own ENOENT would blame the command.
            if !cwd.is_dir() {
                return Err(crate::error::Error::NotFound(format!(
                    "cwd {cwd_arg:?} is not a directory in the workspace"
                )));
            }
            let handle = ws.open_dir(&cwd)?;
            Ok((cwd, handle))
        })
        .await?;
        let timeout = if r.timeout_ms == 0 {
            exec::DEFAULT_TIMEOUT
        } else {
            Duration::from_millis(r.timeout_ms)
        };
        let max_output = if r.max_output_bytes == 0 {
            exec::DEFAULT_MAX_OUTPUT
        } else {
            r.max_output_bytes.min(exec::MAX_OUTPUT)
        };
        let run = exec::run(ExecSpec {
            command: &r.command,
            args: &r.args,
            cwd: &cwd,
            cwd_handle: Some(&handle),
            env: &r.env,
            timeout,
            max_output,
        });
        // agentctl stopping (its session stopped or deleted) ends the
        // command at once, as a dropped call does: the shutdown does not
        // wait out its timeout, nor the caller a broken connection.
        let mut shutdown = self.shutdown.clone();
        let out = tokio::select! {
            out = run => out?,
            _ = shutdown.wait_for(|s| *s) => {
                return Err(Status::failed_precondition(
                    "the command was ended: agentctl is stopping (its session was stopped or deleted)",
                ));
            }
        };
        Ok(Response::new(ExecResponse {
            exit_code: out.exit_code,
            stdout: out.stdout,
            stderr: out.stderr,
            timed_out: out.timed_out,
            stdout_truncated: out.stdout_truncated,
            stderr_truncated: out.stderr_truncated,
            duration_ms: u64::try_from(out.duration.as_millis()).unwrap_or(u64::MAX),
            signal: out.signal,
        }))
    }

    async fn read_file(&self, req: Request<ReadFileRequest>) -> Res<ReadFileResponse> {
        let r = req.into_inner();
        let ws = self.workspace.get()?;
        let content = blocking(move || ws.read_file(&r.path, r.max_bytes)).await?;
        Ok(Response::new(ReadFileResponse { content }))
    }

    async fn write_file(&self, req: Request<WriteFileRequest>) -> Res<WriteFileResponse> {
        let r = req.into_inner();
        // What ReadFile can return, so a file written here can be read back.
        let max = crate::workspace::DEFAULT_MAX_READ;
        if r.content.len() as u64 > max {
            return Err(crate::error::Error::InvalidArgument(format!(
                "content is {} bytes; WriteFile writes at most {max} bytes (16 MiB, the most ReadFile returns): write a bigger file with Exec",
                r.content.len()
            ))
            .into());
        }
        let ws = self.workspace.get()?;
        let bytes_written =
            blocking(move || ws.write_file(&r.path, &r.content, r.create_parents)).await?;
        Ok(Response::new(WriteFileResponse { bytes_written }))
    }

    async fn list_dir(&self, req: Request<ListDirRequest>) -> Res<ListDirResponse> {
        let path = req.into_inner().path;
        let ws = self.workspace.get()?;
        let entries = blocking(move || ws.list_dir(&path)).await?;
        Ok(Response::new(ListDirResponse { entries }))
    }

    async fn git_status(&self, _req: Request<GitStatusRequest>) -> Res<GitStatusResponse> {
        Ok(Response::new(git::status(&*self.workspace.get()?).await?))
    }

    async fn git_diff(&self, req: Request<GitDiffRequest>) -> Res<GitDiffResponse> {
        let r = req.into_inner();
        let ws = self.workspace.get()?;
        let diff = if r.base.is_empty() {
            git::diff(&ws, r.staged, &r.paths).await?
        } else {
            git::diff_against(&ws, &r.base, &r.paths).await?
        };
        Ok(Response::new(GitDiffResponse { diff }))
    }

    async fn worktree(&self, req: Request<WorktreeRequest>) -> Res<WorktreeResponse> {
        let r = req.into_inner();
        if self.worktree_roots.is_empty() {
            return Err(Status::failed_precondition(
                "this agentctl makes no worktrees: it was started without --worktree-root",
            ));
        }
        let repository = self.inside_roots("repository", &r.repository, false)?;
        if r.op == "branches" {
            // Reads the repository only: what a new session on this host
            // can start from, asked before (or beside) the one it serves.
            let answer = crate::worktree::branches(&repository).await?;
            return Ok(Response::new(WorktreeResponse {
                json: serde_json::json!(answer).to_string(),
            }));
        }
        let path = self.inside_roots("path", &r.path, true)?;
        // One agentctl serves one session, so one worktree.
        if let Some(bound) = self.workspace.root()
            && std::fs::canonicalize(&path).ok().as_ref() != Some(&bound)
            && bound != path
        {
            return Err(Status::failed_precondition(format!(
                "this agentctl serves the worktree {}, not {}; start one agentctl per session",
                bound.display(),
                path.display()
            )));
        }
        let spec = crate::worktree::Spec {
            repository,
            base: r.base,
            branch: r.branch,
            path: path.clone(),
        };
        let limit = if r.limit == 0 { 200 } else { r.limit };
        let waiting = || {
            tracing::info!(path = %path.display(),
                "worktree: waiting for another operation on it to finish");
        };
        let answer = crate::worktree::run(
            &r.op,
            &spec,
            r.never_created,
            r.delete_branch,
            limit,
            &waiting,
        )
        .await?;
        match r.op.as_str() {
            // Opened anew: a recreated directory is not the one held before.
            "create" | "restore" => self.workspace.bind(Workspace::open(&path)?),
            "remove" => self.workspace.unbind(),
            _ => {}
        }
        Ok(Response::new(WorktreeResponse {
            json: answer.to_string(),
        }))
    }
}

/// Runs an agent operation to its end even if the caller goes away.
///
/// tonic drops a handler's future when its client disconnects; dropping an
/// ACP `initialize` or `session/load` half-way would leave the agent stuck in
/// `starting` (or half-loaded) for the next backend, which would then wait
/// out its deadline. On its own task the operation finishes and the agent's
/// state stays true; the next caller sees the outcome.
async fn to_completion<T: Send + 'static>(
    work: impl Future<Output = crate::error::Result<T>> + Send + 'static,
) -> crate::error::Result<T> {
    tokio::spawn(work).await.map_err(|e| {
        crate::error::Error::Unavailable(format!("agent operation ended abnormally: {e}"))
    })?
}

/// ACP session modes and config options on the wire; none when the agent
/// has neither.
fn wire_modes(
    modes: Option<&agent_client_protocol::v1::schema::SessionModeState>,
    config: Option<&[agent_client_protocol::v1::schema::SessionConfigOption]>,
) -> Option<SessionModes> {
    if modes.is_none() && config.is_none_or(<[_]>::is_empty) {
        return None;
    }
    Some(SessionModes {
        current_mode_id: modes
            .map(|m| m.current_mode_id.0.to_string())
            .unwrap_or_default(),
        available: modes
            .map(|m| &m.available_modes[..])
            .unwrap_or_default()
            .iter()
            .map(|m| SessionMode {
                id: m.id.0.to_string(),
                name: m.name.clone(),
                description: m.description.clone().unwrap_or_default(),
            })
            .collect(),
        config_options: config
            .unwrap_or_default()
            .iter()
            .map(crate::config::wire)
            .collect(),
    })
}
