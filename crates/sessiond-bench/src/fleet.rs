//! A bench-only agentctl "fleet": one process that answers for many
//! executors. The bearer secret names the executor (`fleet.<executor id>`),
//! so `Health` proves the identity the backend expects without any protocol
//! change. Calls answer at once and deterministically: no agent runs until
//! `LaunchAgent` (or a `Recover` that asks for it), after which the agent is
//! idle; `ResumeSession` accepts any token; `Prompt` is accepted (by a launched agent) and never answered;
//! `StreamUpdates` stays open and sends nothing.

use std::{
    collections::HashMap,
    net::SocketAddr,
    pin::Pin,
    sync::{Arc, Mutex},
    time::Instant,
};

use futures::Stream;
use sessiond_proto::agentctl::v1::{
    self as pb,
    agent_ctl_service_server::{AgentCtlService, AgentCtlServiceServer},
};
use tokio::net::TcpListener;
use tonic::{Request, Response, Status};

/// The secret the fleet accepts for `executor_id`.
pub fn secret_for(executor_id: &str) -> String {
    format!("fleet.{executor_id}")
}

const SHARDS: usize = 64;

/// Executor id -> its launched agent's open session (None: no session yet).
type Agents = HashMap<String, Option<String>>;

#[derive(Clone)]
pub struct Fleet {
    started: Instant,
    /// Launched agents, sharded to keep 64 concurrent callers apart.
    agents: Arc<Vec<Mutex<Agents>>>,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet").finish_non_exhaustive()
    }
}

impl Default for Fleet {
    fn default() -> Self {
        Self {
            started: Instant::now(),
            agents: Arc::new((0..SHARDS).map(|_| Mutex::default()).collect()),
        }
    }
}

type Res<T> = Result<Response<T>, Status>;

impl Fleet {
    fn identity<T>(req: &Request<T>) -> Result<String, Status> {
        let header = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| Status::unauthenticated("missing bearer secret"))?;
        header
            .strip_prefix("Bearer fleet.")
            .map(str::to_owned)
            .ok_or_else(|| Status::unauthenticated("unknown secret"))
    }

    fn shard(&self, id: &str) -> &Mutex<Agents> {
        let h = id.bytes().fold(0usize, |a, b| {
            a.wrapping_mul(31).wrapping_add(usize::from(b))
        });
        &self.agents[h % SHARDS]
    }

    fn agents(&self, id: &str) -> std::sync::MutexGuard<'_, Agents> {
        self.shard(id)
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn agent_running(&self, id: &str) -> bool {
        self.agents(id).contains_key(id)
    }

    /// The open session of `id`'s agent; empty when none.
    fn session_of(&self, id: &str) -> String {
        self.agents(id)
            .get(id)
            .cloned()
            .flatten()
            .unwrap_or_default()
    }

    fn set_agent(&self, id: String, running: bool) {
        let mut agents = self.agents(&id);
        if running {
            agents.insert(id, None);
        } else {
            agents.remove(&id);
        }
    }

    fn open_session(&self, id: String, session: String) {
        self.agents(&id).insert(id, Some(session));
    }
}

impl Fleet {
    fn health_of(&self, id: String) -> pb::HealthResponse {
        let state = if self.agent_running(&id) {
            pb::AgentState::Ready
        } else {
            pb::AgentState::None
        };
        pb::HealthResponse {
            acp_session_id: self.session_of(&id),
            executor_id: id,
            agentctl_version: "fleet".into(),
            agent_state: state as i32,
            uptime_ms: self.started.elapsed().as_millis() as u64,
            pid: std::process::id(),
            instance_id: "fleet".into(),
            ..Default::default()
        }
    }

    fn capabilities_of(&self, id: &str) -> pb::CapabilitiesResponse {
        let resume = if self.agent_running(id) {
            pb::Capability::Supported
        } else {
            pb::Capability::Unknown
        };
        pb::CapabilitiesResponse {
            supports_session_resume: resume as i32,
            supports_workspace_only: pb::Capability::Supported as i32,
            profile_claims_session_resume: true,
            agent_load_session: Some(true),
            agent_resume_session: Some(false),
            prompt: None,
        }
    }
}

fn launched() -> pb::LaunchAgentResponse {
    pb::LaunchAgentResponse {
        agent_pid: std::process::id(),
        agent_name: "fleet-agent".into(),
        agent_version: "1".into(),
        agent_load_session: true,
        auth_methods: Vec::new(),
        authenticated_with: String::new(),
    }
}

type UpdateStream = Pin<Box<dyn Stream<Item = Result<pb::AgentUpdate, Status>> + Send>>;

#[tonic::async_trait]
impl AgentCtlService for Fleet {
    async fn health(&self, req: Request<pb::HealthRequest>) -> Res<pb::HealthResponse> {
        let id = Self::identity(&req)?;
        Ok(Response::new(self.health_of(id)))
    }

    async fn capabilities(
        &self,
        req: Request<pb::CapabilitiesRequest>,
    ) -> Res<pb::CapabilitiesResponse> {
        let id = Self::identity(&req)?;
        Ok(Response::new(self.capabilities_of(&id)))
    }

    /// As agentctl: health and capabilities as the call arrives, then the
    /// agent launched and the conversation opened when asked and none runs.
    async fn recover(&self, req: Request<pb::RecoverRequest>) -> Res<pb::RecoverResponse> {
        let id = Self::identity(&req)?;
        let r = req.into_inner();
        if !r.executor_id.is_empty() && r.executor_id != id {
            return Err(Status::failed_precondition(format!(
                "wrong_executor: this agentctl serves executor {id}; the call is for executor {}",
                r.executor_id
            )));
        }
        let capabilities = self.capabilities_of(&id);
        let health = self.health_of(id.clone());
        let outcome = if r.launch.is_none() || r.resume_token.is_empty() {
            pb::RecoverOutcome::NotAsked
        } else if self.agent_running(&id) {
            pb::RecoverOutcome::Skipped
        } else {
            self.open_session(id, r.resume_token.clone());
            pb::RecoverOutcome::Done
        };
        let done = outcome == pb::RecoverOutcome::Done;
        Ok(Response::new(pb::RecoverResponse {
            health: Some(health),
            capabilities: Some(capabilities),
            agent: Some(pb::RecoverAgent {
                outcome: outcome as i32,
                launched: done.then(launched),
                resumed: done.then_some(pb::ResumeSessionResponse {
                    resume_token: r.resume_token,
                    modes: None,
                    method: pb::ResumeMethod::Load as i32,
                    replayed: 0,
                }),
                ..Default::default()
            }),
        }))
    }

    async fn launch_agent(
        &self,
        req: Request<pb::LaunchAgentRequest>,
    ) -> Res<pb::LaunchAgentResponse> {
        let id = Self::identity(&req)?;
        self.set_agent(id, true);
        Ok(Response::new(launched()))
    }

    async fn new_session(
        &self,
        req: Request<pb::NewSessionRequest>,
    ) -> Res<pb::NewSessionResponse> {
        let id = Self::identity(&req)?;
        if !self.agent_running(&id) {
            return Err(Status::failed_precondition("no agent runs"));
        }
        let token = format!("conv-{id}");
        self.open_session(id, token.clone());
        Ok(Response::new(pb::NewSessionResponse {
            resume_token: token,
            modes: None,
        }))
    }

    async fn resume_session(
        &self,
        req: Request<pb::ResumeSessionRequest>,
    ) -> Res<pb::ResumeSessionResponse> {
        let id = Self::identity(&req)?;
        if !self.agent_running(&id) {
            return Err(Status::failed_precondition("no agent runs"));
        }
        let token = req.into_inner().resume_token;
        self.open_session(id, token.clone());
        Ok(Response::new(pb::ResumeSessionResponse {
            resume_token: token,
            modes: None,
            method: pb::ResumeMethod::Load as i32,
            replayed: 0,
        }))
    }

    /// Accepted and never answered (the update stream stays silent): what
    /// the availability bench times is sessiond answering SendMessage.
    async fn hold_prompt(&self, _req: Request<pb::PromptRequest>) -> Res<pb::PromptResponse> {
        Err(Status::failed_precondition(
            "the bench fleet keeps no turn journal: there is nothing to hold",
        ))
    }

    async fn prompt(&self, req: Request<pb::PromptRequest>) -> Res<pb::PromptResponse> {
        let id = Self::identity(&req)?;
        if !self.agent_running(&id) {
            return Err(Status::failed_precondition("no agent runs"));
        }
        let turn_id = req.into_inner().turn_id;
        Ok(Response::new(pb::PromptResponse {
            message_id: format!("reply-{turn_id}"),
            turn_id,
            ..Default::default()
        }))
    }

    async fn cancel(&self, req: Request<pb::CancelRequest>) -> Res<pb::CancelResponse> {
        Self::identity(&req)?;
        Ok(Response::new(pb::CancelResponse { cancelled: false }))
    }

    async fn set_mode(&self, req: Request<pb::SetModeRequest>) -> Res<pb::SetModeResponse> {
        Self::identity(&req)?;
        Err(Status::failed_precondition(
            "the bench fleet stands in for recovery only; it has no session modes",
        ))
    }

    async fn set_config_option(
        &self,
        req: Request<pb::SetConfigOptionRequest>,
    ) -> Res<pb::SetConfigOptionResponse> {
        Self::identity(&req)?;
        Err(Status::failed_precondition(
            "the bench fleet stands in for recovery only; it has no config options",
        ))
    }

    async fn respond_permission(
        &self,
        req: Request<pb::RespondPermissionRequest>,
    ) -> Res<pb::RespondPermissionResponse> {
        Self::identity(&req)?;
        Err(Status::not_found(
            "the bench fleet stands in for recovery only; no permission request waits",
        ))
    }

    async fn stop_agent(&self, req: Request<pb::StopAgentRequest>) -> Res<pb::StopAgentResponse> {
        let id = Self::identity(&req)?;
        self.set_agent(id, false);
        Ok(Response::new(pb::StopAgentResponse::default()))
    }

    type StreamUpdatesStream = UpdateStream;

    async fn stream_updates(
        &self,
        req: Request<pb::StreamUpdatesRequest>,
    ) -> Res<Self::StreamUpdatesStream> {
        Self::identity(&req)?;
        Ok(Response::new(Box::pin(futures::stream::pending())))
    }

    async fn exec(&self, _req: Request<pb::ExecRequest>) -> Res<pb::ExecResponse> {
        Err(no_workspace())
    }
    async fn read_file(&self, _req: Request<pb::ReadFileRequest>) -> Res<pb::ReadFileResponse> {
        Err(no_workspace())
    }
    async fn write_file(&self, _req: Request<pb::WriteFileRequest>) -> Res<pb::WriteFileResponse> {
        Err(no_workspace())
    }
    async fn list_dir(&self, _req: Request<pb::ListDirRequest>) -> Res<pb::ListDirResponse> {
        Err(no_workspace())
    }
    async fn git_status(&self, _req: Request<pb::GitStatusRequest>) -> Res<pb::GitStatusResponse> {
        Err(no_workspace())
    }
    async fn git_diff(&self, _req: Request<pb::GitDiffRequest>) -> Res<pb::GitDiffResponse> {
        Err(no_workspace())
    }
    async fn worktree(&self, _req: Request<pb::WorktreeRequest>) -> Res<pb::WorktreeResponse> {
        Err(no_workspace())
    }
}

/// Serves the fleet on `ports` loopback listeners (port 0 each); prints one
/// `fleet listening on ADDR` line per listener, then serves until killed.
pub async fn serve(ports: usize) -> anyhow::Result<()> {
    let fleet = Fleet::default();
    let mut addrs: Vec<SocketAddr> = Vec::new();
    let mut tasks = Vec::new();
    for _ in 0..ports.max(1) {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        addrs.push(listener.local_addr()?);
        let svc = AgentCtlServiceServer::new(fleet.clone());
        // Nagle off, as agentctl's listener (see its `tcp_incoming`).
        tasks.push(tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(
                    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
                ),
        ));
    }
    {
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        for a in &addrs {
            writeln!(out, "fleet listening on {a}")?;
        }
        out.flush()?;
    }
    for t in tasks {
        t.await??;
    }
    Ok(())
}

/// A bare tonic unary server (the standard `grpc.health.v1` Check, which
/// answers from a map): the yardstick for GetSessionStatus.
pub async fn serve_echo() -> anyhow::Result<()> {
    let (reporter, service) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    {
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        writeln!(out, "echo listening on {}", listener.local_addr()?)?;
        out.flush()?;
    }
    tonic::transport::Server::builder()
        .add_service(service)
        .serve_with_incoming(
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
        )
        .await?;
    Ok(())
}

/// The fleet serves the calls startup recovery makes; the bench never uses a
/// workspace, so none is behind it.
fn no_workspace() -> Status {
    Status::failed_precondition("the bench fleet stands in for recovery only; it has no workspace")
}
