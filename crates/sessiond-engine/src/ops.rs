//! Executor and agent operations built from the public API of
//! `sessiond-executor`, at the grain the flows need: "is the recorded agentctl
//! alive and ours?" without relaunching it, a launch that cannot leave an
//! unrecorded agentctl behind when its caller's deadline passes, and the
//! agent calls (LaunchAgent, NewSession, ResumeSession).

use std::{
    path::PathBuf,
    sync::{Arc, atomic::Ordering},
    time::{Duration, Instant},
};

use sessiond_domain::{
    AgentProcessState, AgentProfile, ExecutorId, ExecutorRecord, PermissionPolicy, Runtime,
    SurvivingAgent,
};
use sessiond_executor::{
    AgentState, AgentctlClient, Executor, ExecutorHandle, Health, LaunchSpec, RemoteTarget,
    Support,
    process::{self, OwnedProcess},
};
use sessiond_proto::agentctl::v1 as pb;

use crate::error::{Error, Result};
use crate::lease::Fencing;

/// What agentctl's `Health` says about its agent, for the recovery machine.
/// An idle agent survives only with the session's conversation open (the
/// ACP session is the session's resume token, when it has one): an agent
/// launched by a backend that died before ResumeSession (or NewSession)
/// has none, could not take a Prompt, and must be resumed, not reattached.
pub(crate) fn surviving_agent(health: &Health, resume_token: Option<&str>) -> SurvivingAgent {
    let conversation_open = !health.acp_session_id.is_empty()
        && resume_token.is_none_or(|t| t == health.acp_session_id);
    match health.agent_state {
        AgentState::Ready if conversation_open => SurvivingAgent::Idle,
        AgentState::Busy => SurvivingAgent::Busy,
        _ => SurvivingAgent::None,
    }
}

/// The agent's state for the executors cache.
pub(crate) fn agent_process(state: AgentState) -> AgentProcessState {
    match state {
        AgentState::Ready | AgentState::Busy => AgentProcessState::Running,
        AgentState::Starting => AgentProcessState::Starting,
        _ => AgentProcessState::NotRunning,
    }
}

/// The probe's verdict on resume: `None` until the agent answered `initialize`.
pub(crate) fn probe_verdict(support: Support) -> Option<bool> {
    match support {
        Support::Supported => Some(true),
        Support::Unsupported => Some(false),
        Support::Unknown => None,
    }
}

/// The pid of a standalone executor's recorded agentctl process when that
/// process (pid and start time) no longer runs: its agentctl is gone, and
/// nothing that talks to it can come back. `None` for other runtimes, or
/// with no process recorded.
pub(crate) fn local_agentctl_gone(record: &ExecutorRecord) -> Option<u32> {
    match (record.runtime, record.pid, record.pid_start_time) {
        (Runtime::LocalStandalone, Some(pid), Some(started))
            if !sessiond_executor::process::is_same_running(pid, started) =>
        {
            Some(pid)
        }
        _ => None,
    }
}

/// Local agentctl processes started for `executor_id` (found by their
/// `--executor-id` argument): positive evidence that they belong to this
/// executor, even when their pid was never recorded (a crash between spawn
/// and persist).
pub(crate) fn agentctl_processes_of(executor_id: ExecutorId) -> Vec<(u32, u64)> {
    let wanted = executor_id.to_string();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        let is_agentctl = args.first().is_some_and(|a0| {
            std::path::Path::new(std::str::from_utf8(a0).unwrap_or_default())
                .file_name()
                .is_some_and(|n| n == "agentctl")
        });
        let ours = args
            .windows(2)
            .any(|w| w[0] == b"--executor-id" && w[1] == wanted.as_bytes());
        if is_agentctl
            && ours
            && let Some(st) = process::stat(pid).filter(|s| s.is_running())
        {
            found.push((pid, st.start_time));
        }
    }
    found
}

/// How a resume got the agent's conversation back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Resumed {
    /// `session/load` of the stored resume token.
    Loaded,
    /// The agent could not load a conversation that had no turn yet; the new
    /// conversation `token` replaces it (`reason`: the agent's answer).
    Replaced { token: String, reason: String },
    /// There was no conversation (a create died before the agent gave
    /// one); `token` is the one opened now.
    Opened { token: String },
}

/// The agent answered `session/load` with an error of its own (it does not
/// have the conversation, or rejects it), as opposed to not answering
/// (another try may work) or requiring authentication (a profile fix).
pub(crate) fn load_refused(e: &Error) -> bool {
    matches!(
        e,
        Error::Agent {
            call: "ResumeSession",
            failure: sessiond_executor::Failure::NotFound
                | sessiond_executor::Failure::FailedPrecondition
                | sessiond_executor::Failure::InvalidArgument,
            message,
        } if !message.contains("requires authentication")
    )
}

/// The profile's MCP servers with their secret references resolved, for
/// LaunchAgent (agentctl holds them in memory only).
fn mcp_servers(
    profile: &sessiond_domain::AgentProfile,
    secrets: &sessiond_domain::Secrets,
) -> Result<Vec<pb::McpServer>> {
    use sessiond_domain::{McpTransport, SecretValue};
    let resolve = |server: &str, map: &std::collections::BTreeMap<String, SecretValue>| {
        map.iter()
            .map(|(k, v)| match secrets.resolve(v) {
                Some(value) => Ok((k.clone(), value.to_owned())),
                None => Err(Error::InvalidArgument(format!(
                    "profile {:?}: MCP server {server:?} needs {k} from {}, which sessiond did \
                     not read at startup; set it and restart sessiond",
                    profile.name,
                    match v {
                        SecretValue::Env(var) => format!("the environment variable {var}"),
                        SecretValue::File(path) => format!("the file {path}"),
                        SecretValue::Plain(_) => "its value".into(),
                    }
                ))),
            })
            .collect::<Result<std::collections::HashMap<_, _>>>()
    };
    profile
        .mcp_servers
        .iter()
        .map(|s| {
            let (command, args, env, url, headers) = match &s.transport {
                McpTransport::Stdio { command, args, env } => (
                    command.clone(),
                    args.clone(),
                    resolve(&s.name, env)?,
                    String::new(),
                    Default::default(),
                ),
                McpTransport::Http { url, headers } | McpTransport::Sse { url, headers } => (
                    String::new(),
                    Vec::new(),
                    Default::default(),
                    url.clone(),
                    resolve(&s.name, headers)?,
                ),
            };
            Ok(pb::McpServer {
                name: s.name.clone(),
                r#type: s.transport.kind().to_owned(),
                command,
                args,
                env,
                url,
                headers,
            })
        })
        .collect()
}

pub(crate) fn agent_modes(m: &pb::SessionModes) -> sessiond_domain::AgentModes {
    sessiond_domain::AgentModes {
        current: m.current_mode_id.clone(),
        available: m
            .available
            .iter()
            .map(|m| sessiond_domain::AgentMode {
                id: m.id.clone(),
                name: m.name.clone(),
                description: m.description.clone(),
            })
            .collect(),
        config_options: m
            .config_options
            .iter()
            .map(|o| sessiond_domain::ConfigOption {
                id: o.id.clone(),
                name: o.name.clone(),
                description: o.description.clone(),
                category: o.category.clone(),
                kind: o.r#type.clone(),
                current: o.current_value.clone(),
                values: o
                    .values
                    .iter()
                    .map(|v| sessiond_domain::ConfigValue {
                        value: v.value.clone(),
                        name: v.name.clone(),
                        description: v.description.clone(),
                    })
                    .collect(),
            })
            .collect(),
    }
}

/// The agent and its agentctl on the executor's host: starting them,
/// opening, loading or resuming the conversation, stopping them, and the
/// clients that talk to agentctl.
pub(crate) struct Agents<'m>(pub(crate) &'m crate::manager::SessionManager);

impl std::ops::Deref for Agents<'_> {
    type Target = crate::manager::SessionManager;

    fn deref(&self) -> &Self::Target {
        self.0
    }
}

impl Agents<'_> {
    /// Ends every local agentctl of this executor (used right before a new
    /// generation is spawned, so one executor never has two).
    pub(crate) async fn end_stray_agentctls(&self, record: &ExecutorRecord) {
        if record.runtime != Runtime::LocalStandalone {
            return;
        }
        for (pid, start_time) in agentctl_processes_of(record.id) {
            if let Some(p) = OwnedProcess::open(pid, start_time) {
                tracing::warn!(executor_id = %record.id, pid, "ending a stray agentctl of this executor before relaunching");
                if let Err(e) = p
                    .terminate(start_time, self.inner.config.agent_stop_grace)
                    .await
                {
                    tracing::warn!(executor_id = %record.id, pid, error = %e, "could not end stray agentctl");
                }
            }
        }
    }

    /// Starts (or for remote: connects to) agentctl for `record` at
    /// `generation`. The caller has persisted the launch intent.
    ///
    /// The launch runs on its own task. If `limit` passes first, `None` is
    /// returned and the launch, should it still succeed, is stopped again:
    /// nothing runs that no record describes.
    pub(crate) async fn launch_agentctl(
        &self,
        record: &ExecutorRecord,
        profile: &AgentProfile,
        generation: i64,
        limit: Duration,
    ) -> Option<Result<ExecutorHandle>> {
        let driver = match self.driver(record.runtime) {
            Ok(d) => d,
            Err(e) => return Some(Err(e)),
        };
        // Test-only crash point: the caller's intent row is committed, nothing
        // is spawned yet (compiled only with the `failpoints` feature).
        #[cfg(feature = "failpoints")]
        fail::fail_point!("launch-after-intent");
        // Checked at the create, and again at every launch: the directory
        // (or a parent) swapped for a symlink since would run the agent, and
        // the workspace calls, outside the roots (helper-52 3).
        if record.runtime != Runtime::Remote
            && let Some(resolved) = self
                .inner
                .config
                .worktrees
                .outside_roots(std::path::Path::new(&record.workspace_path))
        {
            return Some(Err(Error::InvalidArgument(format!(
                "the session's directory {} now resolves to {} (through a symlink), outside \
                 executors.worktree_roots ({}); agentctl was not started there: put the \
                 directory back, then resume the session",
                record.workspace_path,
                resolved.display(),
                self.inner.config.worktrees.listed_roots()
            ))));
        }
        self.end_stray_agentctls(record).await;
        let spec = LaunchSpec {
            executor_id: record.id,
            session_id: record.session_id,
            task_id: record.task_id,
            workspace_path: PathBuf::from(&record.workspace_path),
            generation,
            remote: (record.runtime == Runtime::Remote).then(|| RemoteTarget {
                url: record.agentctl_url.clone().unwrap_or_default(),
                auth_secret: record.auth_secret.clone(),
            }),
            image: profile.container_image().map(str::to_owned),
            // Every call of the launch carries this replica's lease epoch,
            // the readiness check included.
            lease_epoch: Fencing(self).fence(record.session_id).map(|f| f.epoch),
            repository: record
                .worktree
                .is_managed()
                .then(|| PathBuf::from(&record.worktree.repository)),
        };
        self.inner
            .counters
            .agentctl_launches
            .fetch_add(1, Ordering::Relaxed);
        let d = driver.clone();
        let span = tracing::info_span!(
            "launch_agentctl",
            executor_id = %record.id,
            runtime = record.runtime.as_str(),
            generation,
        );
        let mut task = tokio::spawn(tracing::Instrument::instrument(
            async move { d.launch(&spec).await },
            span,
        ));
        let result = tokio::time::timeout(limit, &mut task).await;
        let outcome = match &result {
            Ok(Ok(Ok(_))) => "ok",
            Ok(_) => "failed",
            Err(_) => "timeout",
        };
        self.inner
            .metrics
            .launch(record.runtime, generation, outcome);
        match result {
            Ok(Ok(r)) => {
                // Test-only crash point: agentctl runs, its handle is not saved.
                #[cfg(feature = "failpoints")]
                fail::fail_point!("launch-after-spawn");
                Some(r.map_err(Error::from))
            }
            Ok(Err(e)) => Some(Err(Error::Internal(format!("launch task failed: {e}")))),
            Err(_) => {
                let executor_id = record.id;
                tokio::spawn(async move {
                    if let Ok(Ok(handle)) = task.await {
                        tracing::warn!(%executor_id, "agentctl came up after the recovery deadline; stopping it");
                        if let Err(e) = driver.stop(&handle).await {
                            tracing::warn!(%executor_id, error = %e, "could not stop late agentctl");
                        }
                    }
                });
                None
            }
        }
    }

    /// Launches the profile's agent unless one runs already; waits for a
    /// starting one. Returns true when it launched one.
    pub(crate) async fn ensure_agent(
        &self,
        client: &AgentctlClient,
        profile: &AgentProfile,
        runtime: Runtime,
    ) -> Result<bool> {
        self.ensure_agent_seen(client, profile, runtime, None).await
    }

    /// [`Self::ensure_agent`], given the agent state a `Health` of the
    /// caller saw just before (startup recovery's identity check): a
    /// definite answer (running, or no agent) is used instead of asking
    /// again; a starting agent (or none seen) is asked about as usual.
    pub(crate) async fn ensure_agent_seen(
        &self,
        client: &AgentctlClient,
        profile: &AgentProfile,
        runtime: Runtime,
        seen: Option<AgentState>,
    ) -> Result<bool> {
        let deadline = Instant::now() + self.inner.config.agent_initialize_timeout;
        let mut seen = seen.filter(|s| {
            matches!(
                s,
                AgentState::Ready | AgentState::Busy | AgentState::None | AgentState::Exited
            )
        });
        loop {
            let state = match seen.take() {
                Some(s) => s,
                None => client.health().await?.agent_state,
            };
            match state {
                AgentState::Ready | AgentState::Busy => return Ok(false),
                AgentState::Starting if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                _ => break,
            }
        }
        self.inner
            .counters
            .agent_launches
            .fetch_add(1, Ordering::Relaxed);
        let request = self.launch_request(profile, runtime)?;
        client
            .launch_agent(request)
            .await
            .map_err(|e| Error::agent("LaunchAgent", &e))?;
        Ok(true)
    }

    /// The `LaunchAgent` request of `profile`'s agent on `runtime`.
    pub(crate) fn launch_request(
        &self,
        profile: &AgentProfile,
        runtime: Runtime,
    ) -> Result<pb::LaunchAgentRequest> {
        let timeout_ms =
            u64::try_from(self.inner.config.agent_initialize_timeout.as_millis()).unwrap_or(0);
        // A container has its own file system: the profile may name another
        // command for it.
        let agent = profile.agent_command(runtime);
        let mcp_servers = mcp_servers(profile, &self.inner.config.mcp_secrets)?;
        Ok(pb::LaunchAgentRequest {
            command: agent.command,
            args: agent.args,
            env: agent.env.into_iter().collect(),
            profile_supports_session_resume: profile.supports_session_resume,
            initialize_timeout_ms: timeout_ms,
            auth_method: profile.auth_method.clone().unwrap_or_default(),
            permission_policy: match profile.permission_policy {
                PermissionPolicy::Allow => pb::PermissionPolicy::Allow,
                PermissionPolicy::Deny => pb::PermissionPolicy::Deny,
                PermissionPolicy::Ask => pb::PermissionPolicy::Ask,
            } as i32,
            permission_timeout_ms: u64::try_from(profile.permission_timeout.as_millis())
                .unwrap_or(u64::MAX),
            config_defaults: profile.config_defaults.clone().into_iter().collect(),
            mcp_servers,
        })
    }

    /// Opens a new ACP conversation in `record`'s agent; returns its resume
    /// token. The modes it answers are kept for GetSessionStatus.
    pub(crate) async fn new_conversation(
        &self,
        client: &AgentctlClient,
        record: &ExecutorRecord,
    ) -> Result<String> {
        let (_, stamp) = self.inner.sessions.cached_modes(record.session_id, "");
        let opened = client
            .new_session()
            .await
            .map_err(|e| Error::agent("NewSession", &e))?;
        self.inner.sessions.remember_modes(
            record.session_id,
            record.execution_id(),
            stamp,
            opened.modes.as_ref().map(agent_modes),
        );
        let token = opened.resume_token;
        if token.is_empty() {
            return Err(Error::Agent {
                call: "NewSession",
                failure: sessiond_executor::Failure::Transient,
                message: "the agent returned an empty session id".into(),
            });
        }
        Ok(token)
    }

    /// Loads the conversation `token` into `record`'s running agent. The
    /// modes it answers are kept for GetSessionStatus.
    pub(crate) async fn load_conversation(
        &self,
        client: &AgentctlClient,
        record: &ExecutorRecord,
        token: &str,
    ) -> Result<()> {
        self.inner
            .counters
            .resume_attempts
            .fetch_add(1, Ordering::Relaxed);
        let (_, stamp) = self.inner.sessions.cached_modes(record.session_id, "");
        let loaded = client.resume_session(token).await;
        self.inner.metrics.resume(loaded.is_ok());
        let loaded = loaded.map_err(|e| Error::agent("ResumeSession", &e))?;
        self.inner.sessions.remember_modes(
            record.session_id,
            record.execution_id(),
            stamp,
            loaded.modes.as_ref().map(agent_modes),
        );
        Ok(())
    }

    /// Resumes the agent with the agent state a `Health` just saw (see
    /// [`Self::ensure_agent_seen`]).
    ///
    /// `no_turn_yet`: the session was never prompted. Agents such as
    /// claude-code-acp and codex-acp store nothing before the first prompt,
    /// so their `session/load` of such a conversation fails after a
    /// restart; a new conversation then replaces it, as nothing is lost.
    pub(crate) async fn resume_agent_seen(
        &self,
        record: &ExecutorRecord,
        profile: &AgentProfile,
        token: &str,
        seen: Option<AgentState>,
        no_turn_yet: bool,
    ) -> Result<Resumed> {
        let client = self.client(record)?;
        self.ensure_agent_seen(&client, profile, record.runtime, seen)
            .await?;
        match self.load_conversation(&client, record, token).await {
            Ok(()) => Ok(Resumed::Loaded),
            Err(e) if no_turn_yet && load_refused(&e) => {
                self.replace_conversation(&client, record, e.to_string())
                    .await
            }
            Err(e) => Err(e),
        }
    }

    /// A conversation never prompted whose load the agent refused
    /// (`reason`): a new one replaces it, as nothing is lost.
    pub(crate) async fn replace_conversation(
        &self,
        client: &AgentctlClient,
        record: &ExecutorRecord,
        reason: String,
    ) -> Result<Resumed> {
        match self.new_conversation(client, record).await {
            Ok(token) => Ok(Resumed::Replaced { token, reason }),
            Err(new) => Err(Error::Agent {
                call: "NewSession",
                failure: sessiond_executor::Failure::FailedPrecondition,
                message: format!(
                    "the agent could not load the conversation ({reason}) nor open a new one ({new})"
                ),
            }),
        }
    }

    /// Starts the agent if none runs and opens the conversation a create
    /// that died never got (recovery's `OpenConversation`).
    pub(crate) async fn open_conversation_seen(
        &self,
        record: &ExecutorRecord,
        profile: &AgentProfile,
        seen: Option<AgentState>,
    ) -> Result<Resumed> {
        let client = self.client(record)?;
        self.ensure_agent_seen(&client, profile, record.runtime, seen)
            .await?;
        let token = self.new_conversation(&client, record).await?;
        Ok(Resumed::Opened { token })
    }

    /// Stops the agent, best effort (after a failed resume, so no agent runs
    /// without a conversation).
    pub(crate) async fn stop_agent_quietly(&self, record: &ExecutorRecord) {
        if let Ok(client) = self.client(record)
            && let Err(e) = client.stop_agent(self.inner.config.agent_stop_grace).await
        {
            tracing::debug!(executor_id = %record.id, error = %e, "StopAgent failed");
        }
    }
}

impl Agents<'_> {
    pub(crate) fn driver(&self, runtime: Runtime) -> Result<Arc<dyn Executor>> {
        self.inner.drivers.get(&runtime).cloned().ok_or_else(|| {
            Error::Unavailable(format!(
                "no executor driver is configured for runtime {runtime}"
            ))
        })
    }

    pub(crate) fn client(&self, record: &ExecutorRecord) -> Result<AgentctlClient> {
        let driver = self.driver(record.runtime)?;
        Ok(self.agentctl(record, &driver)?)
    }

    /// The client of the record's agentctl, made once per address and
    /// secret and then reused (health, capabilities, resume, update pump),
    /// so a session's calls share one HTTP/2 connection instead of opening
    /// one each.
    pub(crate) fn agentctl(
        &self,
        record: &ExecutorRecord,
        driver: &Arc<dyn Executor>,
    ) -> sessiond_executor::Result<AgentctlClient> {
        let url = record.agentctl_url.as_deref().unwrap_or_default();
        let sessions = &self.inner.sessions;
        if let Some(c) = sessions.client(record.session_id, url, &record.auth_secret) {
            // A claim since the client was made: calls carry the new epoch.
            c.raise_lease_epoch(record.lease_epoch);
            return Ok(c);
        }
        let client = driver.client(&ExecutorHandle::from_record(record))?;
        sessions.keep_client(record.session_id, url, &record.auth_secret, client.clone());
        Ok(client)
    }

    /// The cached client of the record's agentctl, if one is cached for the
    /// same address and secret (never creates or caches one).
    pub(crate) fn cached_agentctl(&self, record: &ExecutorRecord) -> Option<AgentctlClient> {
        let url = record.agentctl_url.as_deref().unwrap_or_default();
        self.inner
            .sessions
            .client(record.session_id, url, &record.auth_secret)
    }
}
