//! The startup recovery decision for one executor (find it, bring it back,
//! mark it ready, then the agent: docs/decisions/0006-recovery-decision-table.md),
//! as a step machine without IO.
//!
//! The orchestrator owns the IO. It builds a [`Recovery`], calls
//! [`Recovery::start`], performs the returned [`Action`], reports what it saw
//! as an [`Observation`] to [`Recovery::observe`], and repeats until
//! [`Action::Done`]. At most [`MAX_STEPS`] actions are returned, `Done` included.
//!
//! Writes happen at three points, each persisted together with its events in
//! one transaction:
//! - [`Action::LaunchAgentctl`] / [`Action::StartContainer`]: the launch intent
//!   (executor `starting`, the new generation, `session.agentctl_starting`),
//!   written before anything is spawned;
//! - [`Action::MarkExecutorReady`]: executor `ready`, execution registered in
//!   the executors cache, `last_seen_at`, `session.agentctl_ready`. Workspace
//!   access (shell, files, git) is on from here, whatever the agent does;
//! - [`Action::Done`]: the final executor status and session state with the
//!   remaining events ([`RecoveryOutcome::events`]).
//!
//! Paths per runtime (`->` is the next action, `=>` the outcome):
//!
//! | runtime          | probe                                                                 |
//! |------------------|-----------------------------------------------------------------------|
//! | local_standalone | CheckWorktree (missing => executor_error) -> ProbeProcess if a pid is recorded (alive with pid + start time matching -> reattach: HealthCheck, and if that fails our agentctl is hung -> EndAgentctl -> LaunchAgentctl; gone or not ours -> LaunchAgentctl) -> HealthCheck |
//! | local_docker     | CheckWorktree (a worktree sessiond created is restored from its branch; unrecoverable or missing => executor_error) -> FindContainer (running -> HealthCheck; stopped -> StartContainer -> HealthCheck; missing => executor_error; Docker down => retrying until the engine answers) |
//! | remote           | HealthCheck (unreachable => retrying, or executor_error once the background window is over) -> CheckWorktree when sessiond created the worktree (the host's agentctl restores it and serves it; unrecoverable => executor_error) |
//! | custom (a registered name) | ProbeExecutor: the driver's `probe` (reattachable -> HealthCheck; needs start -> StartContainer -> HealthCheck; needs launch -> LaunchAgentctl -> HealthCheck; missing => executor_error; the driver cannot tell => executor_error; no driver registered => executor `error` `runtime_not_registered`, session unchanged, taken up again by the first startup with the driver) |
//!
//! then, for every runtime: healthy -> ProbeCapabilities -> MarkExecutorReady ->
//! - agent found alive in agentctl => `reattached` (no resume needed, even for
//!   agents that cannot resume: nothing was lost);
//! - session CREATED or ERROR => `executor_only` (never auto-resumed);
//! - resume unsupported by record, profile or probe => `not_resumable`, session ERROR;
//! - session STARTING with no resume token (its create died before the agent
//!   gave one; nothing was said) and policy `startup` => OpenConversation
//!   => `opened` (WAITING_FOR_INPUT with the new token);
//! - no resume token => `missing_resume_token`, session ERROR;
//! - policy `on_demand` => `executor_only`, session unchanged (status says `needs_resume`);
//! - otherwise ResumeAgent => `resumed` (WAITING_FOR_INPUT) or `resume_failed`
//!   (session ERROR, executor stays ready).
//!
//! A custom runtime's driver declares its recovery shape through its
//! `probe` answers alone: an owned executor answers "reattachable", "needs
//! start" or "needs launch"; one reached by URL that it cannot tell about
//! fails the probe (executor_error, resumable). Pending turns and resumes
//! follow the same rules as for the built-in runtimes.
//!
//! A session already COMPLETED or CANCELLED whose executor is still recorded as
//! live gets StopExecutor => `stopped`.

use std::fmt;

use crate::{
    entities::{ExecutorRecord, Session},
    events::EventPayload,
    ids::ExecutorId,
    states::{ExecutorStatus, Runtime, SessionState, UnknownValue},
    transitions::SessionEvent,
};

/// The most actions one recovery returns, `Done` included (local standalone
/// whose hung agentctl is ended and relaunched, then a resume).
pub const MAX_STEPS: usize = 10;

/// When agents are resumed: by the startup pass, or only when asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ResumePolicy {
    /// At backend start, sessions in STARTING, RUNNING or WAITING_FOR_INPUT.
    #[default]
    Startup,
    /// Only on an explicit `ResumeSession`; startup restores workspaces only.
    OnDemand,
}

impl ResumePolicy {
    /// Every policy.
    pub const ALL: &'static [ResumePolicy] = &[ResumePolicy::Startup, ResumePolicy::OnDemand];

    /// The configuration form: `startup` or `on_demand`.
    pub const fn as_str(self) -> &'static str {
        match self {
            ResumePolicy::Startup => "startup",
            ResumePolicy::OnDemand => "on_demand",
        }
    }

    /// The policy whose [`as_str`](Self::as_str) is `value`.
    ///
    /// # Errors
    ///
    /// [`UnknownValue`] for any other text.
    pub fn parse(value: &str) -> Result<Self, UnknownValue> {
        Self::ALL
            .iter()
            .copied()
            .find(|p| p.as_str() == value)
            .ok_or_else(|| UnknownValue {
                kind: "resume policy",
                value: value.to_owned(),
                expected: "startup on_demand",
            })
    }
}

impl fmt::Display for ResumePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The agent process agentctl reported in `Health` (agentctl and its agent
/// may both have survived the backend).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SurvivingAgent {
    /// No agent, or it is still starting, or it exited.
    None,
    /// Initialized and idle.
    Idle,
    /// In the middle of a turn.
    Busy,
}

/// What the orchestrator saw after performing an action.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observation {
    /// After [`Action::CheckWorktree`]: the directory exists.
    WorktreeExists,
    /// After [`Action::CheckWorktree`]: the directory is gone.
    WorktreeMissing,
    /// After [`Action::CheckWorktree`] of a worktree sessiond created: the
    /// directory is gone and cannot be recreated, because its branch is
    /// gone too (or git refused); `reason` names the branch.
    WorktreeUnrecoverable {
        /// What was tried and what to do, naming the branch.
        reason: String,
    },
    /// After [`Action::CheckWorktree`] of a worktree sessiond created:
    /// something else is at its directory (a directory made by hand,
    /// another clone), which is neither taken for it nor touched.
    WorktreeInTheWay {
        /// What is there and what to do, naming the branch.
        reason: String,
    },
    /// The recorded pid is alive; `identity_proven` when its start time matches
    /// the record too (otherwise the pid was reused and must not be touched).
    ProcessAlive {
        /// The start time matches `pid_start_time` too.
        identity_proven: bool,
    },
    /// After [`Action::ProbeProcess`]: no process has the recorded pid.
    ProcessGone,
    /// After [`Action::FindContainer`]: found and running.
    ContainerRunning,
    /// After [`Action::FindContainer`]: found, not running.
    ContainerStopped,
    /// After [`Action::FindContainer`]: neither the id nor the label matches
    /// a container.
    ContainerMissing,
    /// After [`Action::FindContainer`]: the Docker engine did not answer.
    DockerUnavailable {
        /// The engine's (or the client's) error.
        reason: String,
    },
    /// After [`Action::ProbeExecutor`]: the recorded agentctl runs and proved
    /// its identity (the driver's `Probe::Reattachable`).
    ExecutorReattachable,
    /// After [`Action::ProbeExecutor`]: the executor exists but is stopped
    /// (`Probe::NeedsStart`).
    ExecutorNeedsStart,
    /// After [`Action::ProbeExecutor`]: nothing usable runs; launch anew
    /// (`Probe::NeedsLaunch`).
    ExecutorNeedsLaunch,
    /// After [`Action::ProbeExecutor`]: it cannot come back (`Probe::Missing`).
    ExecutorMissing {
        /// What is gone, as the driver said.
        reason: String,
    },
    /// After [`Action::ProbeExecutor`]: no driver is registered for the
    /// runtime (it was, when the executor was launched).
    RuntimeNotRegistered,
    /// agentctl was spawned, or the container started.
    Launched,
    /// The remote host (or agentctl's address) did not answer. The startup
    /// pass sets `retry_in_background` while the reconnect window is open;
    /// the background retrier clears it once the window is over.
    HostUnreachable {
        /// The transport error.
        reason: String,
        /// Keep the session as it is and retry later instead of failing now.
        retry_in_background: bool,
    },
    /// Health answered with this executor's id and accepted the secret.
    Healthy {
        /// The agent agentctl reports, if one survived.
        agent: SurvivingAgent,
    },
    /// Health answered wrongly (another executor's id, secret refused, ...).
    Unhealthy {
        /// What was wrong.
        reason: String,
    },
    /// After [`Action::ProbeCapabilities`]: the agent's own answer.
    Capabilities {
        /// The agent says it can load earlier conversations (ACP
        /// `loadSession`); `false` lowers the profile's claim.
        supports_session_resume: bool,
    },
    /// The agent has not answered ACP `initialize` yet, or the call failed.
    CapabilitiesUnknown,
    /// The write of [`Action::MarkExecutorReady`] is done.
    Applied,
    /// After [`Action::ResumeAgent`]: the conversation is loaded, the agent idle.
    ResumeSucceeded,
    /// After [`Action::ResumeAgent`]: not attempted, as a stop or a delete
    /// of the session came first (no agent is launched only to be
    /// stopped): the workspace is back, the session as it was, the agent
    /// down (`executor_only`).
    ResumeWithdrawn,
    /// After [`Action::ResumeAgent`]: launching the agent or loading failed
    /// (another try may succeed).
    ResumeFailed {
        /// The agent's or agentctl's error.
        reason: String,
    },
    /// The agent refused to load a conversation that has turns: it no
    /// longer has it (another try fails the same way).
    ConversationLost {
        /// The agent's error.
        reason: String,
    },
    /// After [`Action::StopExecutor`] or [`Action::EndAgentctl`]: nothing of
    /// it runs any more.
    ExecutorStopped,
    /// The action could not be performed (spawn, container start or stop failed).
    ActionFailed {
        /// Why.
        reason: String,
    },
    /// The last action was cut: nothing showed progress for the silence
    /// limit (agentctl not answering, the agent neither writing nor using
    /// CPU), or the attempt's overall cap passed.
    DeadlineExceeded,
    /// After [`Action::ResumeAgent`]: the attempt broke off for a reason
    /// that can pass by itself (the agent exited while starting or loading,
    /// agentctl stopped answering); another attempt may succeed. As opposed
    /// to [`Observation::ResumeFailed`], the agent's own verdict.
    ResumeInterrupted {
        /// What happened.
        reason: String,
    },
}

/// What the orchestrator should do next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Does the worktree directory exist? Expect `WorktreeExists` / `WorktreeMissing`.
    CheckWorktree {
        /// The worktree's directory.
        path: String,
    },
    /// Is the recorded agentctl process alive, with the recorded start time?
    /// Expect `ProcessAlive` / `ProcessGone`.
    ProbeProcess {
        /// The recorded pid.
        pid: u32,
        /// Its recorded start time (clock ticks since boot); `None` never
        /// proves identity.
        pid_start_time: Option<u64>,
    },
    /// Persist the intent (executor `starting`, `generation`, `event`), then
    /// spawn agentctl. Expect `Launched` / `ActionFailed`.
    LaunchAgentctl {
        /// The new generation to write (one more than recorded).
        generation: i64,
        /// The `session.agentctl_starting` event to write with it.
        event: EventPayload,
    },
    /// Find the container by id, else by the `sessiond.executor_id` label.
    /// Expect `ContainerRunning` / `ContainerStopped` / `ContainerMissing` / `DockerUnavailable`.
    FindContainer {
        /// The recorded container id, if any.
        container_id: Option<String>,
    },
    /// Custom runtimes: ask the runtime's driver (`Executor::probe`) what
    /// became of the recorded executor; it starts nothing. Expect
    /// `ExecutorReattachable` / `ExecutorNeedsStart` / `ExecutorNeedsLaunch` /
    /// `ExecutorMissing` / `RuntimeNotRegistered` / `ActionFailed` (the
    /// driver could not tell).
    ProbeExecutor,
    /// Persist the intent as for `LaunchAgentctl`, then start the stopped
    /// container (or a custom runtime's stopped executor, through its
    /// driver's `start`). Expect `Launched` / `ActionFailed`.
    StartContainer {
        /// The new generation to write (one more than recorded).
        generation: i64,
        /// The `session.agentctl_starting` event to write with it.
        event: EventPayload,
    },
    /// Call agentctl `Health`, check identity. Expect `Healthy` / `Unhealthy` / `HostUnreachable`.
    HealthCheck,
    /// Call agentctl `Capabilities`. Expect `Capabilities` / `CapabilitiesUnknown`.
    ProbeCapabilities,
    /// Persist executor `ready` with `event`, register the execution in the
    /// executors cache. Expect `Applied`.
    MarkExecutorReady {
        /// The `session.agentctl_ready` event to write with it.
        event: EventPayload,
    },
    /// Launch the agent if none runs and load the conversation.
    /// Expect `ResumeSucceeded` / `ResumeFailed` / `ConversationLost`, or
    /// `HostUnreachable` when a remote host went away during it (a transport
    /// error, and `Health` confirms the host no longer answers).
    ResumeAgent {
        /// The agent's token of the conversation to load.
        resume_token: String,
    },
    /// Launch the agent if none runs and open a new conversation: the
    /// session's create died before the agent gave one (STARTING, no
    /// token), so nothing was said yet and nothing can be lost. Expects
    /// what `ResumeAgent` expects.
    OpenConversation,
    /// The session has ended: stop whatever still runs for it (idempotent).
    /// Expect `ExecutorStopped` / `ActionFailed`.
    StopExecutor,
    /// The recorded agentctl is ours (pid + start time) but `Health` failed:
    /// it is hung. End it (TERM, then KILL), so the relaunch that follows
    /// leaves exactly one. Expect `ExecutorStopped` / `ActionFailed`.
    EndAgentctl,
    /// Persist the outcome and publish its events; log its label.
    Done(RecoveryOutcome),
}

/// The outcome label for the per-executor summary log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OutcomeLabel {
    /// The agent was resumed from its token.
    Resumed,
    /// The agent was started with the conversation its interrupted create
    /// never got (nothing had been said).
    Opened,
    /// agentctl and its agent had survived; reattached without a resume.
    Reattached,
    /// Workspace restored; the agent was not resumed (policy or session state).
    ExecutorOnly,
    /// Workspace restored; the agent cannot resume, the session is ERROR.
    NotResumable,
    /// Workspace restored; there was no token to resume from, the session is ERROR.
    MissingResumeToken,
    /// Workspace restored; resuming the agent failed, the session is ERROR.
    ResumeFailed,
    /// The executor could not be recovered; executor and session are ERROR.
    ExecutorError,
    /// Not back yet for a reason that can pass by itself (a remote host
    /// unreachable, the Docker engine down, an agent cut for silence):
    /// retried in the background.
    Retrying,
    /// The session had ended; its executor was stopped.
    Stopped,
}

impl OutcomeLabel {
    /// The session's agent runs with its conversation after this outcome
    /// (resumed, opened, or it had survived).
    pub const fn agent_back(self) -> bool {
        matches!(
            self,
            OutcomeLabel::Resumed | OutcomeLabel::Opened | OutcomeLabel::Reattached
        )
    }

    /// The label as logged and counted in metrics (e.g. `reattached`).
    pub const fn as_str(self) -> &'static str {
        match self {
            OutcomeLabel::Resumed => "resumed",
            OutcomeLabel::Opened => "opened",
            OutcomeLabel::Reattached => "reattached",
            OutcomeLabel::ExecutorOnly => "executor_only",
            OutcomeLabel::NotResumable => "not_resumable",
            OutcomeLabel::MissingResumeToken => "missing_resume_token",
            OutcomeLabel::ResumeFailed => "resume_failed",
            OutcomeLabel::ExecutorError => "executor_error",
            OutcomeLabel::Retrying => "retrying",
            OutcomeLabel::Stopped => "stopped",
        }
    }
}

impl fmt::Display for OutcomeLabel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why recovery left an executor or a session in error. `code()` is stable
/// and machine-readable; the display text tells the user what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecoveryFailure {
    /// `worktree_missing`: the worktree directory is gone (local standalone).
    #[error("worktree {path} no longer exists; create a new session")]
    WorktreeMissing {
        /// The missing directory.
        path: String,
    },
    /// `worktree_branch_missing`: a worktree sessiond created is gone and
    /// could not be recreated from its branch.
    #[error("{reason}")]
    WorktreeUnrecoverable {
        /// What is gone, naming the branch, and what to do.
        reason: String,
    },
    /// `worktree_in_the_way`: something else is where the worktree sessiond
    /// created was; it is left as it is.
    #[error("{reason}")]
    WorktreeInTheWay {
        /// What is there, and what to do.
        reason: String,
    },
    /// `docker_unavailable`: the engine did not answer; retried in the background.
    #[error(
        "Docker is not available ({reason}); the session recovers by itself once the engine answers"
    )]
    DockerUnavailable {
        /// The engine's (or the client's) error.
        reason: String,
    },
    /// `container_missing`: the container was removed; nothing is left to resume into.
    #[error("the container of this session no longer exists; create a new session")]
    ContainerMissing,
    /// `executor_missing`: a custom runtime's driver says the executor
    /// cannot come back.
    #[error("the executor of this session no longer exists ({reason}); create a new session")]
    ExecutorMissing {
        /// What is gone, as the driver said.
        reason: String,
    },
    /// `runtime_not_registered`: no driver serves the executor's runtime in
    /// this process (a custom runtime whose driver is not registered any
    /// more). The session is left as it was: startup recovery takes the
    /// executor up again once the driver is registered.
    #[error(
        "{runtime}: no executor driver is registered for this runtime; the session recovers when \
         sessiond starts with one"
    )]
    RuntimeNotRegistered {
        /// The runtime's name.
        runtime: String,
    },
    /// `launch_failed`: spawning agentctl or starting its container failed.
    #[error("could not start agentctl: {reason}; resume the session to try again")]
    LaunchFailed {
        /// The spawn or start error.
        reason: String,
    },
    /// `unhealthy`: agentctl answered wrongly or not at all.
    #[error("agentctl is not healthy: {reason}; resume the session to try again")]
    Unhealthy {
        /// What was wrong.
        reason: String,
    },
    /// `reconnecting`: a remote host is unreachable; retried in the background.
    #[error("remote executor {url} is unreachable ({reason}); reconnecting in the background")]
    Reconnecting {
        /// agentctl's URL on that host.
        url: String,
        /// The transport error.
        reason: String,
    },
    /// `host_unreachable`: a remote host stayed unreachable past the
    /// reconnect window; the user resumes once it is back.
    #[error(
        "remote executor {url} is unreachable ({reason}); resume the session once the host is back"
    )]
    HostUnreachable {
        /// agentctl's URL on that host.
        url: String,
        /// The transport error.
        reason: String,
    },
    /// `not_resumable`: the record, the profile or the agent says it cannot resume.
    #[error("this agent cannot resume previous sessions; create a new session")]
    NotResumable,
    /// `missing_resume_token`: there is no conversation to resume.
    #[error("the agent never gave a resume token for this session; create a new session")]
    MissingResumeToken,
    /// `resume_failed`: launching the agent or loading the conversation failed.
    #[error("resuming the agent failed: {reason}; resume the session to try again")]
    ResumeFailed {
        /// The agent's or agentctl's error.
        reason: String,
    },
    /// `resume_failed` too: the agent no longer has the conversation, so
    /// retrying fails the same way.
    #[error(
        "the agent could not load this conversation ({reason}): it no longer has it, so resuming \
         again fails the same way unless the agent gets it back; the messages stay readable and the \
         workspace usable; create a new session to continue the work"
    )]
    ConversationLost {
        /// The agent's error.
        reason: String,
    },
    /// `stop_failed`: the executor of an ended session could not be stopped.
    #[error("could not stop the executor of this ended session: {reason}")]
    StopFailed {
        /// The stop error.
        reason: String,
    },
    /// `deadline_exceeded`: the executor's recovery deadline passed.
    #[error("recovery did not finish in time while {during}; resume the session to try again")]
    DeadlineExceeded {
        /// What recovery was doing then (e.g. `checking agentctl health`).
        during: &'static str,
    },
    /// `recovering`: an attempt broke off for a reason that can pass by
    /// itself; the next one runs in the background.
    #[error(
        "attempt {attempt} of {max_attempts} broke off while {during} ({reason}); the session \
         recovers by itself, retrying in the background"
    )]
    Recovering {
        /// The attempt that broke off (1-based).
        attempt: u32,
        /// How many are made before the session goes ERROR.
        max_attempts: u32,
        /// What recovery was doing then.
        during: &'static str,
        /// Why it broke off.
        reason: String,
    },
    /// `attempts_exhausted`: every attempt broke off; the last one's reason.
    #[error(
        "{attempts} attempts broke off, the last while {during} ({reason}); resume the session to \
         try again"
    )]
    AttemptsExhausted {
        /// How many attempts were made.
        attempts: u32,
        /// What the last attempt was doing when it broke off.
        during: &'static str,
        /// Why it broke off.
        reason: String,
    },
}

impl RecoveryFailure {
    /// The stable, machine-readable code (e.g. `container_missing`); the
    /// prefix of [`message`](Self::message).
    pub const fn code(&self) -> &'static str {
        match self {
            RecoveryFailure::WorktreeMissing { .. } => "worktree_missing",
            RecoveryFailure::WorktreeUnrecoverable { .. } => "worktree_branch_missing",
            RecoveryFailure::WorktreeInTheWay { .. } => "worktree_in_the_way",
            RecoveryFailure::DockerUnavailable { .. } => "docker_unavailable",
            RecoveryFailure::ContainerMissing => "container_missing",
            RecoveryFailure::ExecutorMissing { .. } => "executor_missing",
            RecoveryFailure::RuntimeNotRegistered { .. } => "runtime_not_registered",
            RecoveryFailure::LaunchFailed { .. } => "launch_failed",
            RecoveryFailure::Unhealthy { .. } => "unhealthy",
            RecoveryFailure::Reconnecting { .. } => "reconnecting",
            RecoveryFailure::HostUnreachable { .. } => "host_unreachable",
            RecoveryFailure::NotResumable => "not_resumable",
            RecoveryFailure::MissingResumeToken => "missing_resume_token",
            RecoveryFailure::ResumeFailed { .. } | RecoveryFailure::ConversationLost { .. } => {
                "resume_failed"
            }
            RecoveryFailure::StopFailed { .. } => "stop_failed",
            RecoveryFailure::DeadlineExceeded { .. } => "deadline_exceeded",
            RecoveryFailure::Recovering { .. } => "recovering",
            RecoveryFailure::AttemptsExhausted { .. } => "attempts_exhausted",
        }
    }

    /// The text stored as `error_message`: `"<code>: <what to do>"`, so the
    /// `error_message=not_resumable` clients look for stays recognisable by its
    /// prefix.
    pub fn message(&self) -> String {
        format!("{}: {self}", self.code())
    }
}

/// Where recovery ends for one executor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveryOutcome {
    /// Which way recovery ended, for the summary log line and metrics.
    pub label: OutcomeLabel,
    /// The executor's status to write.
    pub executor_status: ExecutorStatus,
    /// The executor's error, `None` to clear it.
    pub executor_error: Option<RecoveryFailure>,
    /// The generation after recovery (grown by one if agentctl was relaunched).
    pub generation: i64,
    /// The session's state after recovery; write it only if it differs from
    /// the state recovery started with (a `state_changed` event is in `events`
    /// exactly then).
    pub session_state: SessionState,
    /// The session's new error; `Some` only together with a change to ERROR.
    /// When the state changes to anything else, clear the session's error.
    pub session_error: Option<RecoveryFailure>,
    /// Shell, files and git are available (agentctl is healthy).
    pub workspace_enabled: bool,
    /// Keep reconnecting in the background and run recovery again when the
    /// host answers.
    pub retry_in_background: bool,
    /// Events to publish with the final write, in order. Events of earlier
    /// writes (`agentctl_starting`, `agentctl_ready`) are not repeated.
    pub events: Vec<EventPayload>,
}

impl RecoveryOutcome {
    /// The message to show for the session: its own error, else the executor's.
    pub fn error_message(&self) -> Option<String> {
        self.session_error
            .as_ref()
            .or(self.executor_error.as_ref())
            .map(RecoveryFailure::message)
    }
}

/// Everything the decision depends on, copied out of the records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveryInput {
    /// The executor being recovered.
    pub executor_id: ExecutorId,
    /// Where it runs; decides the path (see the module documentation).
    pub runtime: Runtime,
    /// Its recorded generation; a relaunch writes one more.
    pub generation: i64,
    /// agentctl's recorded URL (named in remote errors).
    pub agentctl_url: Option<String>,
    /// The recorded container (local Docker).
    pub container_id: Option<String>,
    /// The recorded agentctl pid (local standalone).
    pub pid: Option<u32>,
    /// The recorded start time of `pid`, to tell a reused pid.
    pub pid_start_time: Option<u64>,
    /// The worktree's directory (the record's workspace path if it has none).
    pub worktree_path: String,
    /// sessiond created the worktree: a Docker recovery first brings its
    /// directory back (from its branch), before the container starts.
    pub worktree_managed: bool,
    /// `executors_running.supports_session_resume`.
    pub record_supports_session_resume: bool,
    /// The agent profile's claim.
    pub profile_supports_session_resume: bool,
    /// The conversation to resume; `None` (never empty) when there is none.
    pub resume_token: Option<String>,
    /// The session's state when recovery started.
    pub session_state: SessionState,
    /// Whether agents are resumed now or only on request.
    pub policy: ResumePolicy,
    /// Which attempt this is (1-based): an attempt that breaks off for a
    /// reason that can pass by itself is retried in the background while
    /// `attempt < max_attempts`.
    pub attempt: u32,
    /// How many attempts are made before a session goes ERROR for a reason
    /// that could have passed by itself. 1: no retry.
    pub max_attempts: u32,
}

impl RecoveryInput {
    /// Takes the session's resume token, or the record's when the session has none.
    pub fn new(
        record: &ExecutorRecord,
        session: &Session,
        profile_supports_session_resume: bool,
        policy: ResumePolicy,
    ) -> Self {
        let non_empty = |token: &Option<String>| token.clone().filter(|t| !t.is_empty());
        let worktree_path = if record.worktree.path.is_empty() {
            record.workspace_path.clone()
        } else {
            record.worktree.path.clone()
        };
        Self {
            executor_id: record.id,
            runtime: record.runtime,
            generation: record.generation,
            agentctl_url: record.agentctl_url.clone(),
            container_id: record.container_id.clone(),
            pid: record.pid,
            pid_start_time: record.pid_start_time,
            worktree_path,
            worktree_managed: session.worktree.is_managed(),
            record_supports_session_resume: record.supports_session_resume,
            profile_supports_session_resume,
            resume_token: non_empty(&session.resume_token)
                .or_else(|| non_empty(&record.resume_token)),
            session_state: session.state,
            policy,
            attempt: 1,
            max_attempts: 1,
        }
    }

    /// The same input for attempt `attempt` of `max_attempts`.
    pub fn attempt(mut self, attempt: u32, max_attempts: u32) -> Self {
        self.attempt = attempt.max(1);
        self.max_attempts = max_attempts.max(1);
        self
    }
}

/// An observation that makes no sense after the last action: a bug in the
/// orchestrator. The machine is unchanged; report what the action really
/// produced (`ActionFailed` and `DeadlineExceeded` are always accepted).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("recovery of executor {executor_id}: unexpected observation {observation:?} while {phase}")]
pub struct UnexpectedObservation {
    /// The executor whose recovery received it.
    pub executor_id: ExecutorId,
    /// What the machine was waiting for (e.g. `checking agentctl health`).
    pub phase: &'static str,
    /// The observation that was refused.
    pub observation: Observation,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    NotStarted,
    CheckingWorktree,
    ProbingProcess,
    Launching,
    FindingContainer,
    ProbingExecutor,
    StartingContainer,
    CheckingHealth,
    ProbingCapabilities,
    MarkingReady,
    Resuming,
    Stopping,
    EndingHung,
    Done,
}

impl Phase {
    const fn describe(self) -> &'static str {
        match self {
            Phase::NotStarted => "not started",
            Phase::CheckingWorktree => "checking the worktree",
            Phase::ProbingProcess => "probing the agentctl process",
            Phase::Launching => "launching agentctl",
            Phase::FindingContainer => "finding the container",
            Phase::ProbingExecutor => "probing the executor through its driver",
            Phase::StartingContainer => "starting the container",
            Phase::CheckingHealth => "checking agentctl health",
            Phase::ProbingCapabilities => "probing capabilities",
            Phase::MarkingReady => "marking the executor ready",
            Phase::Resuming => "resuming the agent",
            Phase::Stopping => "stopping the executor",
            Phase::EndingHung => "ending the hung agentctl",
            Phase::Done => "done",
        }
    }
}

/// The recovery of one executor. See the module documentation.
///
/// A remote executor whose agentctl and idle agent survived the backend is
/// reattached without a resume:
///
/// ```
/// use sessiond_domain::*;
///
/// let input = RecoveryInput {
///     executor_id: ExecutorId::new(),
///     runtime: Runtime::Remote,
///     generation: 3,
///     agentctl_url: Some("https://host:7070".into()),
///     container_id: None,
///     pid: None,
///     pid_start_time: None,
///     worktree_path: "/work/repo".into(),
///     worktree_managed: false,
///     record_supports_session_resume: true,
///     profile_supports_session_resume: true,
///     resume_token: Some("conv-1".into()),
///     session_state: SessionState::WaitingForInput,
///     policy: ResumePolicy::Startup,
///     attempt: 1,
///     max_attempts: 1,
/// };
/// let mut recovery = Recovery::new(input);
/// assert_eq!(recovery.start(), Action::HealthCheck);
/// let next = recovery.observe(Observation::Healthy { agent: SurvivingAgent::Idle })?;
/// assert_eq!(next, Action::ProbeCapabilities);
/// let next = recovery.observe(Observation::Capabilities { supports_session_resume: true })?;
/// assert!(matches!(next, Action::MarkExecutorReady { .. }));
/// let Action::Done(outcome) = recovery.observe(Observation::Applied)? else {
///     panic!("recovery should be done");
/// };
/// assert_eq!(outcome.label, OutcomeLabel::Reattached);
/// assert_eq!(outcome.executor_status, ExecutorStatus::Ready);
/// assert_eq!(outcome.session_state, SessionState::WaitingForInput);
/// assert!(outcome.events.is_empty(), "nothing changed for the session");
/// assert!(recovery.is_done());
/// # Ok::<(), UnexpectedObservation>(())
/// ```
#[derive(Debug, Clone)]
pub struct Recovery {
    input: RecoveryInput,
    phase: Phase,
    generation: i64,
    agent: SurvivingAgent,
    probe: Option<bool>,
    steps: usize,
    /// The health check under way is of the recorded agentctl, proven ours
    /// by pid and start time: if it fails, that process is hung.
    checking_recorded: bool,
    /// The agent step opens the conversation a create never got.
    opening: bool,
}

impl Recovery {
    /// A recovery that has not started; call [`Recovery::start`] next.
    pub fn new(input: RecoveryInput) -> Self {
        Self {
            generation: input.generation,
            input,
            phase: Phase::NotStarted,
            agent: SurvivingAgent::None,
            probe: None,
            steps: 0,
            checking_recorded: false,
            opening: false,
        }
    }

    /// The conversation this recovery resumes next if the pending
    /// [`Action::HealthCheck`] finds agentctl healthy with no agent and the
    /// capability probe answers nothing new: what a caller may ask agentctl
    /// to do in the health check's own exchange, before the machine has
    /// seen the answer. Asks a copy of the machine, so the decision stays
    /// this machine's. `None` when the pending action is no health check,
    /// or such an answer leads anywhere but a resume (a worktree to check,
    /// a policy or a claim that rules the resume out).
    pub fn resume_after_health(&self) -> Option<String> {
        if self.phase != Phase::CheckingHealth {
            return None;
        }
        let mut ahead = self.clone();
        let mut action = ahead
            .observe(Observation::Healthy {
                agent: SurvivingAgent::None,
            })
            .ok()?;
        loop {
            action = match action {
                Action::ProbeCapabilities => {
                    ahead.observe(Observation::CapabilitiesUnknown).ok()?
                }
                Action::MarkExecutorReady { .. } => ahead.observe(Observation::Applied).ok()?,
                Action::ResumeAgent { resume_token } => return Some(resume_token),
                _ => return None,
            };
        }
    }

    /// What the decision is based on.
    pub fn input(&self) -> &RecoveryInput {
        &self.input
    }

    /// [`Action::Done`] was returned; further observations are refused.
    pub fn is_done(&self) -> bool {
        self.phase == Phase::Done
    }

    /// The first action. Calling it again returns the same action only if
    /// nothing was observed yet; afterwards use [`Recovery::observe`].
    pub fn start(&mut self) -> Action {
        self.phase = Phase::NotStarted;
        self.steps = 0;
        self.checking_recorded = false;
        self.generation = self.input.generation;
        if self.input.session_state.is_terminal() {
            return self.go(Phase::Stopping, Action::StopExecutor);
        }
        match self.input.runtime {
            Runtime::LocalStandalone => {
                let path = self.input.worktree_path.clone();
                self.go(Phase::CheckingWorktree, Action::CheckWorktree { path })
            }
            // The container mounts the worktree: without it the container
            // cannot start, which is the worktree's verdict, not the
            // container's (helper-37: a deleted directory read as
            // `container_missing`, never resumable even once it was back).
            Runtime::LocalDocker => {
                let path = self.input.worktree_path.clone();
                self.go(Phase::CheckingWorktree, Action::CheckWorktree { path })
            }
            Runtime::Remote => self.go(Phase::CheckingHealth, Action::HealthCheck),
            Runtime::Custom(_) => self.go(Phase::ProbingExecutor, Action::ProbeExecutor),
        }
    }

    fn find_container(&mut self) -> Action {
        let container_id = self.input.container_id.clone();
        self.go(
            Phase::FindingContainer,
            Action::FindContainer { container_id },
        )
    }

    /// The next action after `observation`.
    ///
    /// # Errors
    ///
    /// [`UnexpectedObservation`] when `observation` cannot follow the last
    /// action (or the recovery is not started or done); the machine is
    /// unchanged.
    pub fn observe(&mut self, observation: Observation) -> Result<Action, UnexpectedObservation> {
        use Observation as O;
        use Phase as P;
        let action = match (self.phase, observation) {
            (P::NotStarted | P::Done, observation) => return Err(self.unexpected(observation)),

            (P::Stopping, O::ExecutorStopped) => self.stopped(),
            (P::Stopping, O::ActionFailed { reason }) => {
                self.executor_failed(RecoveryFailure::StopFailed { reason })
            }

            (P::Resuming, O::ResumeSucceeded) => {
                let label = if self.opening {
                    OutcomeLabel::Opened
                } else {
                    OutcomeLabel::Resumed
                };
                self.ready_done(label, SessionEvent::Resumed, None)
            }
            (P::Resuming, O::ResumeWithdrawn) => self.ready_unchanged(OutcomeLabel::ExecutorOnly),
            (P::Resuming, O::ResumeFailed { reason } | O::ActionFailed { reason }) => self
                .ready_done(
                    OutcomeLabel::ResumeFailed,
                    SessionEvent::Failed,
                    Some(RecoveryFailure::ResumeFailed { reason }),
                ),
            (P::Resuming, O::ConversationLost { reason }) => self.ready_done(
                OutcomeLabel::ResumeFailed,
                SessionEvent::Failed,
                Some(RecoveryFailure::ConversationLost { reason }),
            ),
            // The remote host went away between its Health and the agent's
            // resume: the host's failure, not the agent's, so the reconnect
            // path (inside the window) rather than `resume_failed`.
            (
                P::Resuming,
                O::HostUnreachable {
                    reason,
                    retry_in_background,
                },
            ) => self.unreachable(reason, retry_in_background),
            (P::Resuming, O::DeadlineExceeded) => self.resume_broke_off(
                "no sign of life from the agent within the silence limit".to_owned(),
            ),
            (P::Resuming, O::ResumeInterrupted { reason }) => self.resume_broke_off(reason),

            // Our own agentctl did not answer Health in time: it is hung.
            (P::CheckingHealth, O::DeadlineExceeded) if self.checking_recorded => {
                self.checking_recorded = false;
                self.go(P::EndingHung, Action::EndAgentctl)
            }
            (phase, O::DeadlineExceeded) => {
                if self.retries_left() {
                    self.retrying(RecoveryFailure::Recovering {
                        attempt: self.input.attempt,
                        max_attempts: self.input.max_attempts,
                        during: phase.describe(),
                        reason: "no answer within the silence limit".to_owned(),
                    })
                } else if self.input.max_attempts > 1 {
                    self.executor_failed(RecoveryFailure::AttemptsExhausted {
                        attempts: self.input.attempt,
                        during: phase.describe(),
                        reason: "no answer within the silence limit".to_owned(),
                    })
                } else {
                    self.executor_failed(RecoveryFailure::DeadlineExceeded {
                        during: phase.describe(),
                    })
                }
            }

            (P::CheckingWorktree, O::WorktreeMissing) => {
                let path = self.input.worktree_path.clone();
                self.executor_failed(RecoveryFailure::WorktreeMissing { path })
            }
            (P::CheckingWorktree, O::WorktreeUnrecoverable { reason }) => {
                self.executor_failed(RecoveryFailure::WorktreeUnrecoverable { reason })
            }
            (P::CheckingWorktree, O::WorktreeInTheWay { reason }) => {
                self.executor_failed(RecoveryFailure::WorktreeInTheWay { reason })
            }
            // A remote host's agentctl went away between its Health and the
            // worktree's restore: the host's failure, not a lost branch.
            (
                P::CheckingWorktree,
                O::HostUnreachable {
                    reason,
                    retry_in_background,
                },
            ) => self.unreachable(reason, retry_in_background),
            (P::CheckingWorktree, O::WorktreeExists)
                if self.input.runtime == Runtime::LocalDocker =>
            {
                self.find_container()
            }
            (P::CheckingWorktree, O::WorktreeExists) if self.input.runtime == Runtime::Remote => {
                self.go(P::ProbingCapabilities, Action::ProbeCapabilities)
            }
            (P::CheckingWorktree, O::WorktreeExists) => match self.input.pid {
                Some(pid) => {
                    let pid_start_time = self.input.pid_start_time;
                    self.go(
                        P::ProbingProcess,
                        Action::ProbeProcess {
                            pid,
                            pid_start_time,
                        },
                    )
                }
                None => self.launch_agentctl(),
            },

            (
                P::ProbingProcess,
                O::ProcessAlive {
                    identity_proven: true,
                },
            ) => {
                self.checking_recorded = true;
                self.go(P::CheckingHealth, Action::HealthCheck)
            }
            // Our own agentctl does not answer: end it and launch a new one.
            (
                P::CheckingHealth,
                O::Unhealthy { .. } | O::HostUnreachable { .. } | O::ActionFailed { .. },
            ) if self.checking_recorded => {
                self.checking_recorded = false;
                self.go(P::EndingHung, Action::EndAgentctl)
            }
            (P::EndingHung, O::ExecutorStopped) => self.launch_agentctl(),
            (P::EndingHung, O::ActionFailed { reason }) => {
                self.executor_failed(RecoveryFailure::Unhealthy { reason })
            }
            // A reused pid belongs to someone else: leave it alone, launch anew.
            (
                P::ProbingProcess,
                O::ProcessAlive {
                    identity_proven: false,
                }
                | O::ProcessGone,
            ) => self.launch_agentctl(),

            (P::FindingContainer, O::ContainerRunning) => {
                self.go(P::CheckingHealth, Action::HealthCheck)
            }
            (P::FindingContainer, O::ContainerStopped) => {
                self.generation += 1;
                let event = self.starting_event();
                let generation = self.generation;
                self.go(
                    P::StartingContainer,
                    Action::StartContainer { generation, event },
                )
            }
            (P::FindingContainer, O::ContainerMissing) => {
                self.executor_failed(RecoveryFailure::ContainerMissing)
            }
            (P::FindingContainer, O::DockerUnavailable { reason }) => {
                self.retrying(RecoveryFailure::DockerUnavailable { reason })
            }

            (P::ProbingExecutor, O::ExecutorReattachable) => {
                self.go(P::CheckingHealth, Action::HealthCheck)
            }
            (P::ProbingExecutor, O::ExecutorNeedsStart) => {
                self.generation += 1;
                let event = self.starting_event();
                let generation = self.generation;
                self.go(
                    P::StartingContainer,
                    Action::StartContainer { generation, event },
                )
            }
            (P::ProbingExecutor, O::ExecutorNeedsLaunch) => self.launch_agentctl(),
            (P::ProbingExecutor, O::ExecutorMissing { reason }) => {
                self.executor_failed(RecoveryFailure::ExecutorMissing { reason })
            }
            (P::ProbingExecutor, O::RuntimeNotRegistered) => self.driver_missing(),
            (P::ProbingExecutor, O::ActionFailed { reason }) => {
                self.executor_failed(RecoveryFailure::Unhealthy { reason })
            }

            (P::Launching | P::StartingContainer, O::Launched) => {
                self.go(P::CheckingHealth, Action::HealthCheck)
            }
            (P::Launching | P::StartingContainer, O::ActionFailed { reason }) => {
                if self.retries_left() {
                    let during = self.phase.describe();
                    self.retrying(RecoveryFailure::Recovering {
                        attempt: self.input.attempt,
                        max_attempts: self.input.max_attempts,
                        during,
                        reason,
                    })
                } else {
                    self.executor_failed(RecoveryFailure::LaunchFailed { reason })
                }
            }

            (P::CheckingHealth, O::Healthy { agent })
                if self.input.runtime == Runtime::Remote && self.input.worktree_managed =>
            {
                // Its host's agentctl restores the worktree (and serves it)
                // before anything runs in it.
                self.checking_recorded = false;
                self.agent = agent;
                let path = self.input.worktree_path.clone();
                self.go(P::CheckingWorktree, Action::CheckWorktree { path })
            }
            (P::CheckingHealth, O::Healthy { agent }) => {
                self.checking_recorded = false;
                self.agent = agent;
                self.go(P::ProbingCapabilities, Action::ProbeCapabilities)
            }
            (P::CheckingHealth, O::Unhealthy { reason }) => {
                self.executor_failed(RecoveryFailure::Unhealthy { reason })
            }
            (
                P::CheckingHealth,
                O::HostUnreachable {
                    reason,
                    retry_in_background,
                },
            ) => self.unreachable(reason, retry_in_background),
            (P::CheckingHealth, O::ActionFailed { reason }) => {
                self.executor_failed(RecoveryFailure::Unhealthy { reason })
            }

            (
                P::ProbingCapabilities,
                O::Capabilities {
                    supports_session_resume,
                },
            ) => {
                self.probe = Some(supports_session_resume);
                self.mark_ready()
            }
            (P::ProbingCapabilities, O::CapabilitiesUnknown | O::ActionFailed { .. }) => {
                self.probe = None;
                self.mark_ready()
            }

            (P::MarkingReady, O::Applied) => self.after_ready(),
            (P::MarkingReady, O::ActionFailed { reason }) => {
                self.executor_failed(RecoveryFailure::Unhealthy { reason })
            }

            (_, observation) => return Err(self.unexpected(observation)),
        };
        Ok(action)
    }

    /// Another attempt may follow this one.
    fn retries_left(&self) -> bool {
        self.input.attempt < self.input.max_attempts
    }

    /// The agent's resume broke off for a reason that can pass by itself:
    /// the workspace stays up and the session as it was while attempts
    /// remain (retried in the background); then the session goes ERROR
    /// naming the attempts and the last reason.
    fn resume_broke_off(&mut self, reason: String) -> Action {
        let during = Phase::Resuming.describe();
        if self.retries_left() {
            let failure = RecoveryFailure::Recovering {
                attempt: self.input.attempt,
                max_attempts: self.input.max_attempts,
                during,
                reason,
            };
            return self.done(RecoveryOutcome {
                label: OutcomeLabel::Retrying,
                executor_status: ExecutorStatus::Ready,
                executor_error: Some(failure),
                generation: self.generation,
                session_state: self.input.session_state,
                session_error: None,
                workspace_enabled: true,
                retry_in_background: true,
                events: Vec::new(),
            });
        }
        let failure = if self.input.max_attempts > 1 {
            RecoveryFailure::AttemptsExhausted {
                attempts: self.input.attempt,
                during,
                reason,
            }
        } else {
            RecoveryFailure::DeadlineExceeded { during }
        };
        self.ready_done(
            OutcomeLabel::ResumeFailed,
            SessionEvent::Failed,
            Some(failure),
        )
    }

    /// Resume is possible as far as anyone said: the record, the profile and
    /// (once probed) the agent. The probe can only lower the claims.
    fn supports_resume(&self) -> bool {
        self.input.record_supports_session_resume
            && self.input.profile_supports_session_resume
            && self.probe != Some(false)
    }

    /// [`Self::supports_resume`] for the ready event: unknown (`None`) while
    /// the claims allow it and the agent was not probed.
    fn resume_verdict(&self) -> Option<bool> {
        if self.input.record_supports_session_resume && self.input.profile_supports_session_resume {
            self.probe
        } else {
            Some(false)
        }
    }

    fn go(&mut self, phase: Phase, action: Action) -> Action {
        self.phase = phase;
        self.steps += 1;
        debug_assert!(
            self.steps <= MAX_STEPS,
            "recovery exceeded {MAX_STEPS} steps"
        );
        action
    }

    fn unexpected(&self, observation: Observation) -> UnexpectedObservation {
        UnexpectedObservation {
            executor_id: self.input.executor_id,
            phase: self.phase.describe(),
            observation,
        }
    }

    fn starting_event(&self) -> EventPayload {
        EventPayload::AgentctlStarting {
            executor_id: self.input.executor_id,
            runtime: self.input.runtime,
            generation: self.generation,
        }
    }

    fn launch_agentctl(&mut self) -> Action {
        self.generation += 1;
        let event = self.starting_event();
        let generation = self.generation;
        self.go(
            Phase::Launching,
            Action::LaunchAgentctl { generation, event },
        )
    }

    fn mark_ready(&mut self) -> Action {
        let event = EventPayload::AgentctlReady {
            executor_id: self.input.executor_id,
            runtime: self.input.runtime,
            supports_session_resume: self.resume_verdict(),
        };
        self.go(Phase::MarkingReady, Action::MarkExecutorReady { event })
    }

    fn after_ready(&mut self) -> Action {
        let state = self.input.session_state;
        match self.agent {
            SurvivingAgent::Idle if state.is_auto_resumable() => {
                return self.ready_done(OutcomeLabel::Reattached, SessionEvent::Resumed, None);
            }
            SurvivingAgent::Busy if state.is_auto_resumable() => {
                return self.ready_done(
                    OutcomeLabel::Reattached,
                    SessionEvent::AgentFoundBusy,
                    None,
                );
            }
            _ => {}
        }
        if !state.is_auto_resumable() {
            return self.ready_unchanged(OutcomeLabel::ExecutorOnly);
        }
        // A create that died before the agent gave its conversation: nothing
        // was said, so a new conversation loses nothing (and needs no
        // resume support). The create's own caller is long gone; without
        // this the session would be ERROR for a restart at the wrong moment.
        if state == SessionState::Starting
            && self.input.resume_token.is_none()
            && self.input.policy == ResumePolicy::Startup
        {
            self.opening = true;
            return self.go(Phase::Resuming, Action::OpenConversation);
        }
        if !self.supports_resume() {
            return self.ready_done(
                OutcomeLabel::NotResumable,
                SessionEvent::Failed,
                Some(RecoveryFailure::NotResumable),
            );
        }
        let Some(resume_token) = self.input.resume_token.clone() else {
            return self.ready_done(
                OutcomeLabel::MissingResumeToken,
                SessionEvent::Failed,
                Some(RecoveryFailure::MissingResumeToken),
            );
        };
        match self.input.policy {
            ResumePolicy::OnDemand => self.ready_unchanged(OutcomeLabel::ExecutorOnly),
            ResumePolicy::Startup => self.go(Phase::Resuming, Action::ResumeAgent { resume_token }),
        }
    }

    /// Applies `event` to the session: the new state, and a `state_changed`
    /// event if the state changed. An illegal event leaves the session as is.
    fn session_after(
        &self,
        event: SessionEvent,
        error: Option<&RecoveryFailure>,
    ) -> (SessionState, Option<EventPayload>) {
        let from = self.input.session_state;
        let to = from.transition(event).unwrap_or(from);
        let changed = (to != from).then(|| EventPayload::StateChanged {
            from,
            to,
            error_message: error.map(RecoveryFailure::message),
        });
        (to, changed)
    }

    fn done(&mut self, outcome: RecoveryOutcome) -> Action {
        let action = self.go(Phase::Done, Action::Done(outcome));
        debug_assert!(self.steps <= MAX_STEPS);
        action
    }

    fn ready_done(
        &mut self,
        label: OutcomeLabel,
        event: SessionEvent,
        error: Option<RecoveryFailure>,
    ) -> Action {
        let (session_state, changed) = self.session_after(event, error.as_ref());
        let session_error = if changed.is_some() { error } else { None };
        self.done(RecoveryOutcome {
            label,
            executor_status: ExecutorStatus::Ready,
            executor_error: None,
            generation: self.generation,
            session_state,
            session_error,
            workspace_enabled: true,
            retry_in_background: false,
            events: changed.into_iter().collect(),
        })
    }

    fn ready_unchanged(&mut self, label: OutcomeLabel) -> Action {
        self.done(RecoveryOutcome {
            label,
            executor_status: ExecutorStatus::Ready,
            executor_error: None,
            generation: self.generation,
            session_state: self.input.session_state,
            session_error: None,
            workspace_enabled: true,
            retry_in_background: false,
            events: Vec::new(),
        })
    }

    /// Executor `error`; the session goes ERROR with the same reason unless it
    /// already is ERROR (its earlier reason stays) or has ended.
    fn executor_failed(&mut self, failure: RecoveryFailure) -> Action {
        let (session_state, changed) = self.session_after(SessionEvent::Failed, Some(&failure));
        let mut events = vec![EventPayload::AgentctlError {
            executor_id: self.input.executor_id,
            error_message: failure.message(),
        }];
        let session_error = changed.is_some().then(|| failure.clone());
        events.extend(changed);
        self.done(RecoveryOutcome {
            label: OutcomeLabel::ExecutorError,
            executor_status: ExecutorStatus::Error,
            executor_error: Some(failure),
            generation: self.generation,
            session_state,
            session_error,
            workspace_enabled: false,
            retry_in_background: false,
            events,
        })
    }

    /// Remote hosts outlive the backend: while the reconnect window is open
    /// the executor shows `error` with its reason but the session is left as
    /// it was, so it resumes without a state change when the host answers.
    fn unreachable(&mut self, reason: String, retry_in_background: bool) -> Action {
        let url = self.input.agentctl_url.clone().unwrap_or_default();
        if self.input.runtime != Runtime::Remote {
            // An agentctl of ours that stopped answering mid-attempt (killed
            // while it started or resumed): the next attempt launches
            // another, as after a launch that failed.
            if self.retries_left() {
                let during = self.phase.describe();
                return self.retrying(RecoveryFailure::Recovering {
                    attempt: self.input.attempt,
                    max_attempts: self.input.max_attempts,
                    during,
                    reason,
                });
            }
            return self.executor_failed(RecoveryFailure::Unhealthy { reason });
        }
        if !retry_in_background {
            return self.executor_failed(if self.input.runtime == Runtime::Remote {
                RecoveryFailure::HostUnreachable { url, reason }
            } else {
                RecoveryFailure::Unhealthy { reason }
            });
        }
        self.retrying(RecoveryFailure::Reconnecting { url, reason })
    }

    /// No driver serves the custom runtime in this process: executor `error`
    /// with `runtime_not_registered`, the session left as it was (a pending
    /// turn stays pending). Nothing retries in the background: startup
    /// recovery takes the executor up again once a driver is registered for
    /// its runtime, and resumes the session as it would have now.
    fn driver_missing(&mut self) -> Action {
        let failure = RecoveryFailure::RuntimeNotRegistered {
            runtime: self.input.runtime.to_string(),
        };
        let events = vec![EventPayload::AgentctlError {
            executor_id: self.input.executor_id,
            error_message: failure.message(),
        }];
        self.done(RecoveryOutcome {
            label: OutcomeLabel::ExecutorError,
            executor_status: ExecutorStatus::Error,
            executor_error: Some(failure),
            generation: self.generation,
            session_state: self.input.session_state,
            session_error: None,
            workspace_enabled: false,
            retry_in_background: false,
            events,
        })
    }

    /// The executor cannot be reached for now (remote host, Docker engine):
    /// executor `error` with the failure, session unchanged, and a retry in
    /// the background that runs recovery again once it answers.
    fn retrying(&mut self, failure: RecoveryFailure) -> Action {
        let events = vec![EventPayload::AgentctlError {
            executor_id: self.input.executor_id,
            error_message: failure.message(),
        }];
        self.done(RecoveryOutcome {
            label: OutcomeLabel::Retrying,
            executor_status: ExecutorStatus::Error,
            executor_error: Some(failure),
            generation: self.generation,
            session_state: self.input.session_state,
            session_error: None,
            workspace_enabled: false,
            retry_in_background: true,
            events,
        })
    }

    fn stopped(&mut self) -> Action {
        self.done(RecoveryOutcome {
            label: OutcomeLabel::Stopped,
            executor_status: ExecutorStatus::Stopped,
            executor_error: None,
            generation: self.generation,
            session_state: self.input.session_state,
            session_error: None,
            workspace_enabled: false,
            retry_in_background: false,
            events: Vec::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::EventKind;

    use Observation as O;
    use OutcomeLabel as L;
    use SessionState as S;

    fn input(runtime: Runtime, session_state: SessionState) -> RecoveryInput {
        RecoveryInput {
            executor_id: ExecutorId::new(),
            runtime,
            generation: 3,
            agentctl_url: Some("http://10.0.0.7:7070".into()),
            container_id: Some("c0ffee".into()),
            pid: Some(4242),
            pid_start_time: Some(99),
            worktree_path: "/work/wt/feature".into(),
            worktree_managed: false,
            record_supports_session_resume: true,
            profile_supports_session_resume: true,
            resume_token: Some("tok".into()),
            session_state,
            policy: ResumePolicy::Startup,
            attempt: 1,
            max_attempts: 1,
        }
    }

    fn kind(action: &Action) -> &'static str {
        match action {
            Action::CheckWorktree { .. } => "check_worktree",
            Action::ProbeProcess { .. } => "probe_process",
            Action::LaunchAgentctl { .. } => "launch_agentctl",
            Action::FindContainer { .. } => "find_container",
            Action::StartContainer { .. } => "start_container",
            Action::ProbeExecutor => "probe_executor",
            Action::HealthCheck => "health_check",
            Action::ProbeCapabilities => "probe_capabilities",
            Action::MarkExecutorReady { .. } => "mark_ready",
            Action::ResumeAgent { .. } => "resume_agent",
            Action::OpenConversation => "open_conversation",
            Action::StopExecutor => "stop_executor",
            Action::EndAgentctl => "end_agentctl",
            Action::Done(_) => "done",
        }
    }

    /// Feeds `observations` in order; returns every action and the outcome.
    fn run(input: RecoveryInput, observations: Vec<Observation>) -> (Vec<Action>, RecoveryOutcome) {
        let mut recovery = Recovery::new(input);
        let mut actions = vec![recovery.start()];
        for observation in observations {
            let action = recovery.observe(observation).expect("expected observation");
            actions.push(action);
        }
        match actions.last() {
            Some(Action::Done(outcome)) => {
                let outcome = outcome.clone();
                (actions, outcome)
            }
            other => panic!("recovery not done, last action {other:?}"),
        }
    }

    fn healthy() -> Observation {
        O::Healthy {
            agent: SurvivingAgent::None,
        }
    }

    fn caps(supports: bool) -> Observation {
        O::Capabilities {
            supports_session_resume: supports,
        }
    }

    struct Expect {
        actions: &'static [&'static str],
        label: OutcomeLabel,
        executor: ExecutorStatus,
        session: SessionState,
        workspace: bool,
        /// Events of the final write.
        events: &'static [EventKind],
    }

    fn check(name: &str, input: RecoveryInput, observations: Vec<Observation>, expect: Expect) {
        let initial = input.session_state;
        let (actions, outcome) = run(input, observations);
        let kinds: Vec<_> = actions.iter().map(kind).collect();
        assert_eq!(kinds, expect.actions, "{name}: actions");
        assert!(actions.len() <= MAX_STEPS, "{name}: bounded");
        assert_eq!(outcome.label, expect.label, "{name}: label");
        assert_eq!(outcome.executor_status, expect.executor, "{name}: executor");
        assert_eq!(outcome.session_state, expect.session, "{name}: session");
        assert_eq!(
            outcome.workspace_enabled, expect.workspace,
            "{name}: workspace"
        );
        let events: Vec<_> = outcome.events.iter().map(EventPayload::kind).collect();
        assert_eq!(events, expect.events, "{name}: events");
        assert_eq!(
            events.contains(&EventKind::StateChanged),
            initial != outcome.session_state,
            "{name}: state_changed exactly when the state changed"
        );
    }

    const AGENTCTL_ERROR_AND_STATE: &[EventKind] =
        &[EventKind::AgentctlError, EventKind::StateChanged];

    /// The resume a health check may carry: only a pending health check
    /// whose "no agent" answer leads to `ResumeAgent`, with the token the
    /// machine then asks for; never when the machine would go elsewhere.
    #[test]
    fn resume_after_health_is_what_the_machine_would_do() {
        let mut m = Recovery::new(input(Runtime::Remote, S::WaitingForInput));
        assert_eq!(m.resume_after_health(), None, "not started");
        assert_eq!(m.start(), Action::HealthCheck);
        assert_eq!(m.resume_after_health(), Some("tok".to_owned()));
        // Asking changed nothing: the machine goes on as if never asked.
        assert_eq!(
            m.observe(healthy()).expect("healthy"),
            Action::ProbeCapabilities
        );
        assert_eq!(m.resume_after_health(), None, "no health check pending");

        let mut managed = input(Runtime::Remote, S::WaitingForInput);
        managed.worktree_managed = true;
        let mut m = Recovery::new(managed);
        m.start();
        assert_eq!(
            m.resume_after_health(),
            None,
            "a worktree check comes first"
        );

        let mut on_demand = input(Runtime::Remote, S::WaitingForInput);
        on_demand.policy = ResumePolicy::OnDemand;
        let mut m = Recovery::new(on_demand);
        m.start();
        assert_eq!(
            m.resume_after_health(),
            None,
            "on demand: no resume at startup"
        );

        let mut no_claim = input(Runtime::Remote, S::WaitingForInput);
        no_claim.profile_supports_session_resume = false;
        let mut m = Recovery::new(no_claim);
        m.start();
        assert_eq!(m.resume_after_health(), None, "the profile cannot resume");

        // A standalone agentctl that survived, proven ours by pid.
        let mut m = Recovery::new(input(Runtime::LocalStandalone, S::WaitingForInput));
        m.start();
        m.observe(O::WorktreeExists).expect("worktree");
        m.observe(O::ProcessAlive {
            identity_proven: true,
        })
        .expect("alive");
        assert_eq!(m.resume_after_health(), Some("tok".to_owned()));
        // A freshly launched one.
        let mut m = Recovery::new(input(Runtime::LocalStandalone, S::Running));
        m.start();
        m.observe(O::WorktreeExists).expect("worktree");
        m.observe(O::ProcessGone).expect("gone");
        assert_eq!(
            m.observe(O::Launched).expect("launched"),
            Action::HealthCheck
        );
        assert_eq!(m.resume_after_health(), Some("tok".to_owned()));
    }

    #[test]
    fn standalone_table() {
        let standalone = |state| input(Runtime::LocalStandalone, state);
        let full = &[
            "check_worktree",
            "probe_process",
            "launch_agentctl",
            "health_check",
            "probe_capabilities",
            "mark_ready",
            "resume_agent",
            "done",
        ];
        check(
            "worktree missing",
            standalone(S::WaitingForInput),
            vec![O::WorktreeMissing],
            Expect {
                actions: &["check_worktree", "done"],
                label: L::ExecutorError,
                executor: ExecutorStatus::Error,
                session: S::Error,
                workspace: false,
                events: AGENTCTL_ERROR_AND_STATE,
            },
        );
        check(
            "worktree and its branch gone",
            standalone(S::WaitingForInput),
            vec![O::WorktreeUnrecoverable {
                reason: "branch \"s/1\" no longer exists".into(),
            }],
            Expect {
                actions: &["check_worktree", "done"],
                label: L::ExecutorError,
                executor: ExecutorStatus::Error,
                session: S::Error,
                workspace: false,
                events: AGENTCTL_ERROR_AND_STATE,
            },
        );
        check(
            "something else where the worktree was",
            standalone(S::WaitingForInput),
            vec![O::WorktreeInTheWay {
                reason: "/w/s-1 exists and is not the worktree of branch \"s/1\"".into(),
            }],
            Expect {
                actions: &["check_worktree", "done"],
                label: L::ExecutorError,
                executor: ExecutorStatus::Error,
                session: S::Error,
                workspace: false,
                events: AGENTCTL_ERROR_AND_STATE,
            },
        );
        check(
            "process gone: relaunch and resume",
            standalone(S::WaitingForInput),
            vec![
                O::WorktreeExists,
                O::ProcessGone,
                O::Launched,
                healthy(),
                caps(true),
                O::Applied,
                O::ResumeSucceeded,
            ],
            Expect {
                actions: full,
                label: L::Resumed,
                executor: ExecutorStatus::Ready,
                session: S::WaitingForInput,
                workspace: true,
                events: &[],
            },
        );
        check(
            "process gone, a stop came first: the workspace only, the session as it was",
            standalone(S::WaitingForInput),
            vec![
                O::WorktreeExists,
                O::ProcessGone,
                O::Launched,
                healthy(),
                caps(true),
                O::Applied,
                O::ResumeWithdrawn,
            ],
            Expect {
                actions: full,
                label: L::ExecutorOnly,
                executor: ExecutorStatus::Ready,
                session: S::WaitingForInput,
                workspace: true,
                events: &[],
            },
        );
        check(
            "pid reused: never trusted, relaunch",
            standalone(S::Running),
            vec![
                O::WorktreeExists,
                O::ProcessAlive {
                    identity_proven: false,
                },
                O::Launched,
                healthy(),
                O::CapabilitiesUnknown,
                O::Applied,
                O::ResumeSucceeded,
            ],
            Expect {
                actions: full,
                label: L::Resumed,
                executor: ExecutorStatus::Ready,
                session: S::WaitingForInput,
                workspace: true,
                events: &[EventKind::StateChanged],
            },
        );
        for hung in [
            O::DeadlineExceeded,
            O::Unhealthy {
                reason: "Health did not answer".into(),
            },
            O::HostUnreachable {
                reason: "deadline".into(),
                retry_in_background: false,
            },
        ] {
            check(
                "our agentctl hung: ended, relaunched, resumed",
                standalone(S::WaitingForInput),
                vec![
                    O::WorktreeExists,
                    O::ProcessAlive {
                        identity_proven: true,
                    },
                    hung,
                    O::ExecutorStopped,
                    O::Launched,
                    healthy(),
                    caps(true),
                    O::Applied,
                    O::ResumeSucceeded,
                ],
                Expect {
                    actions: &[
                        "check_worktree",
                        "probe_process",
                        "health_check",
                        "end_agentctl",
                        "launch_agentctl",
                        "health_check",
                        "probe_capabilities",
                        "mark_ready",
                        "resume_agent",
                        "done",
                    ],
                    label: L::Resumed,
                    executor: ExecutorStatus::Ready,
                    session: S::WaitingForInput,
                    workspace: true,
                    events: &[],
                },
            );
        }
        check(
            "hung agentctl that cannot be ended: error",
            standalone(S::WaitingForInput),
            vec![
                O::WorktreeExists,
                O::ProcessAlive {
                    identity_proven: true,
                },
                O::Unhealthy {
                    reason: "no answer".into(),
                },
                O::ActionFailed {
                    reason: "still running after KILL".into(),
                },
            ],
            Expect {
                actions: &[
                    "check_worktree",
                    "probe_process",
                    "health_check",
                    "end_agentctl",
                    "done",
                ],
                label: L::ExecutorError,
                executor: ExecutorStatus::Error,
                session: S::Error,
                workspace: false,
                events: AGENTCTL_ERROR_AND_STATE,
            },
        );
        check(
            "the relaunched agentctl unhealthy too: error, no second end",
            standalone(S::WaitingForInput),
            vec![
                O::WorktreeExists,
                O::ProcessAlive {
                    identity_proven: true,
                },
                O::Unhealthy {
                    reason: "no answer".into(),
                },
                O::ExecutorStopped,
                O::Launched,
                O::Unhealthy {
                    reason: "no answer".into(),
                },
            ],
            Expect {
                actions: &[
                    "check_worktree",
                    "probe_process",
                    "health_check",
                    "end_agentctl",
                    "launch_agentctl",
                    "health_check",
                    "done",
                ],
                label: L::ExecutorError,
                executor: ExecutorStatus::Error,
                session: S::Error,
                workspace: false,
                events: AGENTCTL_ERROR_AND_STATE,
            },
        );
        check(
            "agentctl and agent survived: reattach",
            standalone(S::WaitingForInput),
            vec![
                O::WorktreeExists,
                O::ProcessAlive {
                    identity_proven: true,
                },
                O::Healthy {
                    agent: SurvivingAgent::Idle,
                },
                caps(true),
                O::Applied,
            ],
            Expect {
                actions: &[
                    "check_worktree",
                    "probe_process",
                    "health_check",
                    "probe_capabilities",
                    "mark_ready",
                    "done",
                ],
                label: L::Reattached,
                executor: ExecutorStatus::Ready,
                session: S::WaitingForInput,
                workspace: true,
                events: &[],
            },
        );
        check(
            "no pid recorded: launch",
            RecoveryInput {
                pid: None,
                ..standalone(S::Starting)
            },
            vec![
                O::WorktreeExists,
                O::Launched,
                healthy(),
                caps(true),
                O::Applied,
                O::ResumeSucceeded,
            ],
            Expect {
                actions: &[
                    "check_worktree",
                    "launch_agentctl",
                    "health_check",
                    "probe_capabilities",
                    "mark_ready",
                    "resume_agent",
                    "done",
                ],
                label: L::Resumed,
                executor: ExecutorStatus::Ready,
                session: S::WaitingForInput,
                workspace: true,
                events: &[EventKind::StateChanged],
            },
        );
        check(
            "launch failed",
            standalone(S::WaitingForInput),
            vec![
                O::WorktreeExists,
                O::ProcessGone,
                O::ActionFailed {
                    reason: "ENOENT".into(),
                },
            ],
            Expect {
                actions: &["check_worktree", "probe_process", "launch_agentctl", "done"],
                label: L::ExecutorError,
                executor: ExecutorStatus::Error,
                session: S::Error,
                workspace: false,
                events: AGENTCTL_ERROR_AND_STATE,
            },
        );
        check(
            "resume failed keeps the workspace",
            standalone(S::WaitingForInput),
            vec![
                O::WorktreeExists,
                O::ProcessGone,
                O::Launched,
                healthy(),
                caps(true),
                O::Applied,
                O::ResumeFailed {
                    reason: "session not found".into(),
                },
            ],
            Expect {
                actions: full,
                label: L::ResumeFailed,
                executor: ExecutorStatus::Ready,
                session: S::Error,
                workspace: true,
                events: &[EventKind::StateChanged],
            },
        );
        check(
            "deadline while resuming keeps the workspace",
            standalone(S::Running),
            vec![
                O::WorktreeExists,
                O::ProcessGone,
                O::Launched,
                healthy(),
                caps(true),
                O::Applied,
                O::DeadlineExceeded,
            ],
            Expect {
                actions: full,
                label: L::ResumeFailed,
                executor: ExecutorStatus::Ready,
                session: S::Error,
                workspace: true,
                events: &[EventKind::StateChanged],
            },
        );
        check(
            "deadline during health check",
            standalone(S::WaitingForInput),
            vec![
                O::WorktreeExists,
                O::ProcessGone,
                O::Launched,
                O::DeadlineExceeded,
            ],
            Expect {
                actions: &[
                    "check_worktree",
                    "probe_process",
                    "launch_agentctl",
                    "health_check",
                    "done",
                ],
                label: L::ExecutorError,
                executor: ExecutorStatus::Error,
                session: S::Error,
                workspace: false,
                events: AGENTCTL_ERROR_AND_STATE,
            },
        );
    }

    #[test]
    fn docker_table() {
        let docker = |state| input(Runtime::LocalDocker, state);
        // Every Docker recovery looks at the worktree first (the container
        // mounts it); the rows below start where a present one leads.
        let check = |name: &str, input: RecoveryInput, obs: Vec<Observation>, expect: Expect| {
            if input.worktree_managed {
                return check(name, input, obs, expect);
            }
            let obs = std::iter::once(O::WorktreeExists).chain(obs).collect();
            let actions: Vec<&'static str> = std::iter::once("check_worktree")
                .chain(expect.actions.iter().copied())
                .collect();
            check(
                name,
                input,
                obs,
                Expect {
                    actions: Box::leak(actions.into_boxed_slice()),
                    ..expect
                },
            )
        };
        // helper-37: the directory a stopped container mounts, gone, read as
        // `container_missing` (never resumable, even once it was back).
        super::tests::check(
            "the directory it mounts gone: worktree_missing, the container left",
            docker(S::WaitingForInput),
            vec![O::WorktreeMissing],
            Expect {
                actions: &["check_worktree", "done"],
                label: L::ExecutorError,
                executor: ExecutorStatus::Error,
                session: S::Error,
                workspace: false,
                events: AGENTCTL_ERROR_AND_STATE,
            },
        );
        let to_ready = |first: Observation| vec![first, healthy(), caps(true), O::Applied];
        let with = |mut obs: Vec<Observation>, last: Observation| {
            obs.push(last);
            obs
        };
        let ready_path: &[&str] = &[
            "find_container",
            "health_check",
            "probe_capabilities",
            "mark_ready",
            "done",
        ];
        let resume_path: &[&str] = &[
            "find_container",
            "health_check",
            "probe_capabilities",
            "mark_ready",
            "resume_agent",
            "done",
        ];
        check(
            "container running: resume",
            docker(S::WaitingForInput),
            with(to_ready(O::ContainerRunning), O::ResumeSucceeded),
            Expect {
                actions: resume_path,
                label: L::Resumed,
                executor: ExecutorStatus::Ready,
                session: S::WaitingForInput,
                workspace: true,
                events: &[],
            },
        );
        check(
            "container stopped: start it",
            docker(S::Running),
            vec![
                O::ContainerStopped,
                O::Launched,
                healthy(),
                caps(true),
                O::Applied,
                O::ResumeSucceeded,
            ],
            Expect {
                actions: &[
                    "find_container",
                    "start_container",
                    "health_check",
                    "probe_capabilities",
                    "mark_ready",
                    "resume_agent",
                    "done",
                ],
                label: L::Resumed,
                executor: ExecutorStatus::Ready,
                session: S::WaitingForInput,
                workspace: true,
                events: &[EventKind::StateChanged],
            },
        );
        let managed = |state| RecoveryInput {
            worktree_managed: true,
            ..docker(state)
        };
        check(
            "a worktree sessiond made: brought back before the container starts",
            managed(S::Running),
            vec![
                O::WorktreeExists,
                O::ContainerStopped,
                O::Launched,
                healthy(),
                caps(true),
                O::Applied,
                O::ResumeSucceeded,
            ],
            Expect {
                actions: &[
                    "check_worktree",
                    "find_container",
                    "start_container",
                    "health_check",
                    "probe_capabilities",
                    "mark_ready",
                    "resume_agent",
                    "done",
                ],
                label: L::Resumed,
                executor: ExecutorStatus::Ready,
                session: S::WaitingForInput,
                workspace: true,
                events: &[EventKind::StateChanged],
            },
        );
        check(
            "a worktree sessiond made, its branch gone: no container is looked for",
            managed(S::WaitingForInput),
            vec![O::WorktreeUnrecoverable {
                reason: "branch \"s/1\" no longer exists".into(),
            }],
            Expect {
                actions: &["check_worktree", "done"],
                label: L::ExecutorError,
                executor: ExecutorStatus::Error,
                session: S::Error,
                workspace: false,
                events: AGENTCTL_ERROR_AND_STATE,
            },
        );
        check(
            "docker down: retrying, session unchanged",
            docker(S::WaitingForInput),
            vec![O::DockerUnavailable {
                reason: "no socket".into(),
            }],
            Expect {
                actions: &["find_container", "done"],
                label: L::Retrying,
                executor: ExecutorStatus::Error,
                session: S::WaitingForInput,
                workspace: false,
                events: &[EventKind::AgentctlError],
            },
        );
        check(
            "container missing",
            docker(S::WaitingForInput),
            vec![O::ContainerMissing],
            Expect {
                actions: &["find_container", "done"],
                label: L::ExecutorError,
                executor: ExecutorStatus::Error,
                session: S::Error,
                workspace: false,
                events: AGENTCTL_ERROR_AND_STATE,
            },
        );
        let not_resumable = Expect {
            actions: ready_path,
            label: L::NotResumable,
            executor: ExecutorStatus::Ready,
            session: S::Error,
            workspace: true,
            events: &[EventKind::StateChanged],
        };
        check(
            "record says not resumable",
            RecoveryInput {
                record_supports_session_resume: false,
                ..docker(S::WaitingForInput)
            },
            to_ready(O::ContainerRunning),
            not_resumable,
        );
        check(
            "profile says not resumable",
            RecoveryInput {
                profile_supports_session_resume: false,
                ..docker(S::Running)
            },
            to_ready(O::ContainerRunning),
            Expect {
                actions: ready_path,
                ..not_resumable_expect()
            },
        );
        check(
            "probe lowers the claim",
            docker(S::WaitingForInput),
            vec![O::ContainerRunning, healthy(), caps(false), O::Applied],
            not_resumable_expect(),
        );
        check(
            "no token",
            RecoveryInput {
                resume_token: None,
                ..docker(S::WaitingForInput)
            },
            to_ready(O::ContainerRunning),
            Expect {
                label: L::MissingResumeToken,
                ..not_resumable_expect()
            },
        );
        check(
            "a create that died before the agent's conversation: a new one, even not resumable",
            RecoveryInput {
                resume_token: None,
                profile_supports_session_resume: false,
                ..docker(S::Starting)
            },
            with(to_ready(O::ContainerRunning), O::ResumeSucceeded),
            Expect {
                actions: &[
                    "find_container",
                    "health_check",
                    "probe_capabilities",
                    "mark_ready",
                    "open_conversation",
                    "done",
                ],
                label: L::Opened,
                executor: ExecutorStatus::Ready,
                session: S::WaitingForInput,
                workspace: true,
                events: &[EventKind::StateChanged],
            },
        );
        check(
            "a create that died, on_demand policy: no token to resume",
            RecoveryInput {
                resume_token: None,
                policy: ResumePolicy::OnDemand,
                ..docker(S::Starting)
            },
            to_ready(O::ContainerRunning),
            Expect {
                label: L::MissingResumeToken,
                ..not_resumable_expect()
            },
        );
        let unchanged = |session| Expect {
            actions: ready_path,
            label: L::ExecutorOnly,
            executor: ExecutorStatus::Ready,
            session,
            workspace: true,
            events: &[],
        };
        check(
            "on_demand policy",
            RecoveryInput {
                policy: ResumePolicy::OnDemand,
                ..docker(S::WaitingForInput)
            },
            to_ready(O::ContainerRunning),
            unchanged(S::WaitingForInput),
        );
        check(
            "ERROR is never auto-resumed",
            docker(S::Error),
            to_ready(O::ContainerRunning),
            unchanged(S::Error),
        );
        check(
            "CREATED is never auto-resumed",
            docker(S::Created),
            to_ready(O::ContainerRunning),
            unchanged(S::Created),
        );
        check(
            "agent found busy",
            docker(S::WaitingForInput),
            vec![
                O::ContainerRunning,
                O::Healthy {
                    agent: SurvivingAgent::Busy,
                },
                caps(true),
                O::Applied,
            ],
            Expect {
                actions: ready_path,
                label: L::Reattached,
                executor: ExecutorStatus::Ready,
                session: S::Running,
                workspace: true,
                events: &[EventKind::StateChanged],
            },
        );
        check(
            "surviving agent of a non-resumable profile keeps working",
            RecoveryInput {
                profile_supports_session_resume: false,
                ..docker(S::Running)
            },
            vec![
                O::ContainerRunning,
                O::Healthy {
                    agent: SurvivingAgent::Idle,
                },
                caps(false),
                O::Applied,
            ],
            Expect {
                actions: ready_path,
                label: L::Reattached,
                executor: ExecutorStatus::Ready,
                session: S::WaitingForInput,
                workspace: true,
                events: &[EventKind::StateChanged],
            },
        );
        check(
            "executor lost while the session is already ERROR",
            docker(S::Error),
            vec![O::ContainerMissing],
            Expect {
                actions: &["find_container", "done"],
                label: L::ExecutorError,
                executor: ExecutorStatus::Error,
                session: S::Error,
                workspace: false,
                events: &[EventKind::AgentctlError],
            },
        );
    }

    fn not_resumable_expect() -> Expect {
        Expect {
            actions: &[
                "find_container",
                "health_check",
                "probe_capabilities",
                "mark_ready",
                "done",
            ],
            label: L::NotResumable,
            executor: ExecutorStatus::Ready,
            session: S::Error,
            workspace: true,
            events: &[EventKind::StateChanged],
        }
    }

    #[test]
    fn remote_table() {
        let remote = |state| input(Runtime::Remote, state);
        check(
            "reachable: resume",
            remote(S::WaitingForInput),
            vec![healthy(), caps(true), O::Applied, O::ResumeSucceeded],
            Expect {
                actions: &[
                    "health_check",
                    "probe_capabilities",
                    "mark_ready",
                    "resume_agent",
                    "done",
                ],
                label: L::Resumed,
                executor: ExecutorStatus::Ready,
                session: S::WaitingForInput,
                workspace: true,
                events: &[],
            },
        );
        let managed = |state| RecoveryInput {
            worktree_managed: true,
            ..remote(state)
        };
        check(
            "a worktree sessiond made: the host's agentctl restores it first",
            managed(S::WaitingForInput),
            vec![
                healthy(),
                O::WorktreeExists,
                caps(true),
                O::Applied,
                O::ResumeSucceeded,
            ],
            Expect {
                actions: &[
                    "health_check",
                    "check_worktree",
                    "probe_capabilities",
                    "mark_ready",
                    "resume_agent",
                    "done",
                ],
                label: L::Resumed,
                executor: ExecutorStatus::Ready,
                session: S::WaitingForInput,
                workspace: true,
                events: &[],
            },
        );
        check(
            "a worktree sessiond made, its branch gone on the host",
            managed(S::WaitingForInput),
            vec![
                healthy(),
                O::WorktreeUnrecoverable {
                    reason: "branch \"s/1\" no longer exists".into(),
                },
            ],
            Expect {
                actions: &["health_check", "check_worktree", "done"],
                label: L::ExecutorError,
                executor: ExecutorStatus::Error,
                session: S::Error,
                workspace: false,
                events: AGENTCTL_ERROR_AND_STATE,
            },
        );
        check(
            "host gone during the worktree's restore, inside the window: retry, no branch verdict",
            managed(S::Running),
            vec![
                healthy(),
                O::HostUnreachable {
                    reason: "broken pipe".into(),
                    retry_in_background: true,
                },
            ],
            Expect {
                actions: &["health_check", "check_worktree", "done"],
                label: L::Retrying,
                executor: ExecutorStatus::Error,
                session: S::Running,
                workspace: false,
                events: &[EventKind::AgentctlError],
            },
        );
        check(
            "host gone during the worktree's restore, after the window",
            managed(S::WaitingForInput),
            vec![
                healthy(),
                O::HostUnreachable {
                    reason: "broken pipe".into(),
                    retry_in_background: false,
                },
            ],
            Expect {
                actions: &["health_check", "check_worktree", "done"],
                label: L::ExecutorError,
                executor: ExecutorStatus::Error,
                session: S::Error,
                workspace: false,
                events: AGENTCTL_ERROR_AND_STATE,
            },
        );
        check(
            "unreachable within the window: retry, session kept",
            remote(S::Running),
            vec![O::HostUnreachable {
                reason: "connection refused".into(),
                retry_in_background: true,
            }],
            Expect {
                actions: &["health_check", "done"],
                label: L::Retrying,
                executor: ExecutorStatus::Error,
                session: S::Running,
                workspace: false,
                events: &[EventKind::AgentctlError],
            },
        );
        check(
            "unreachable after the window",
            remote(S::Running),
            vec![O::HostUnreachable {
                reason: "timeout".into(),
                retry_in_background: false,
            }],
            Expect {
                actions: &["health_check", "done"],
                label: L::ExecutorError,
                executor: ExecutorStatus::Error,
                session: S::Error,
                workspace: false,
                events: AGENTCTL_ERROR_AND_STATE,
            },
        );
        let resume_steps = &[
            "health_check",
            "probe_capabilities",
            "mark_ready",
            "resume_agent",
            "done",
        ];
        check(
            "host gone during the agent's resume, inside the window: retry, turn kept",
            remote(S::Running),
            vec![
                healthy(),
                caps(true),
                O::Applied,
                O::HostUnreachable {
                    reason: "connection refused".into(),
                    retry_in_background: true,
                },
            ],
            Expect {
                actions: resume_steps,
                label: L::Retrying,
                executor: ExecutorStatus::Error,
                session: S::Running,
                workspace: false,
                events: &[EventKind::AgentctlError],
            },
        );
        check(
            "host gone during the agent's resume, after the window",
            remote(S::WaitingForInput),
            vec![
                healthy(),
                caps(true),
                O::Applied,
                O::HostUnreachable {
                    reason: "connection refused".into(),
                    retry_in_background: false,
                },
            ],
            Expect {
                actions: resume_steps,
                label: L::ExecutorError,
                executor: ExecutorStatus::Error,
                session: S::Error,
                workspace: false,
                events: AGENTCTL_ERROR_AND_STATE,
            },
        );
        check(
            "answers as another executor",
            remote(S::WaitingForInput),
            vec![O::Unhealthy {
                reason: "executor id mismatch".into(),
            }],
            Expect {
                actions: &["health_check", "done"],
                label: L::ExecutorError,
                executor: ExecutorStatus::Error,
                session: S::Error,
                workspace: false,
                events: AGENTCTL_ERROR_AND_STATE,
            },
        );
    }

    fn vm() -> Runtime {
        Runtime::parse("vm").unwrap()
    }

    #[test]
    fn custom_table() {
        let custom = |state| input(vm(), state);
        check(
            "reattachable: the surviving agent is kept",
            custom(S::Running),
            vec![
                O::ExecutorReattachable,
                O::Healthy {
                    agent: SurvivingAgent::Busy,
                },
                caps(true),
                O::Applied,
            ],
            Expect {
                actions: &[
                    "probe_executor",
                    "health_check",
                    "probe_capabilities",
                    "mark_ready",
                    "done",
                ],
                label: L::Reattached,
                executor: ExecutorStatus::Ready,
                session: S::Running,
                workspace: true,
                events: &[],
            },
        );
        let relaunch = &[
            "probe_executor",
            "launch_agentctl",
            "health_check",
            "probe_capabilities",
            "mark_ready",
            "resume_agent",
            "done",
        ];
        check(
            "needs launch: relaunched and resumed",
            custom(S::WaitingForInput),
            vec![
                O::ExecutorNeedsLaunch,
                O::Launched,
                healthy(),
                caps(true),
                O::Applied,
                O::ResumeSucceeded,
            ],
            Expect {
                actions: relaunch,
                label: L::Resumed,
                executor: ExecutorStatus::Ready,
                session: S::WaitingForInput,
                workspace: true,
                events: &[],
            },
        );
        check(
            "needs start: started and resumed",
            custom(S::WaitingForInput),
            vec![
                O::ExecutorNeedsStart,
                O::Launched,
                healthy(),
                caps(true),
                O::Applied,
                O::ResumeSucceeded,
            ],
            Expect {
                actions: &[
                    "probe_executor",
                    "start_container",
                    "health_check",
                    "probe_capabilities",
                    "mark_ready",
                    "resume_agent",
                    "done",
                ],
                label: L::Resumed,
                executor: ExecutorStatus::Ready,
                session: S::WaitingForInput,
                workspace: true,
                events: &[],
            },
        );
        for (name, observation) in [
            (
                "missing",
                O::ExecutorMissing {
                    reason: "vm deleted".into(),
                },
            ),
            (
                "driver cannot tell",
                O::ActionFailed {
                    reason: "hypervisor down".into(),
                },
            ),
            ("deadline", O::DeadlineExceeded),
        ] {
            check(
                name,
                custom(S::WaitingForInput),
                vec![observation],
                Expect {
                    actions: &["probe_executor", "done"],
                    label: L::ExecutorError,
                    executor: ExecutorStatus::Error,
                    session: S::Error,
                    workspace: false,
                    events: AGENTCTL_ERROR_AND_STATE,
                },
            );
        }
        for state in [S::Running, S::WaitingForInput, S::Error] {
            check(
                "driver not registered: session kept for when it is",
                custom(state),
                vec![O::RuntimeNotRegistered],
                Expect {
                    actions: &["probe_executor", "done"],
                    label: L::ExecutorError,
                    executor: ExecutorStatus::Error,
                    session: state,
                    workspace: false,
                    events: &[EventKind::AgentctlError],
                },
            );
        }
        check(
            "launch failed",
            custom(S::WaitingForInput),
            vec![
                O::ExecutorNeedsLaunch,
                O::ActionFailed {
                    reason: "no capacity".into(),
                },
            ],
            Expect {
                actions: &["probe_executor", "launch_agentctl", "done"],
                label: L::ExecutorError,
                executor: ExecutorStatus::Error,
                session: S::Error,
                workspace: false,
                events: AGENTCTL_ERROR_AND_STATE,
            },
        );
    }

    #[test]
    fn custom_failures_say_what_to_do() {
        let (actions, outcome) = run(
            input(vm(), S::WaitingForInput),
            vec![
                O::ExecutorNeedsLaunch,
                O::Launched,
                healthy(),
                caps(true),
                O::Applied,
                O::ResumeSucceeded,
            ],
        );
        match &actions[1] {
            Action::LaunchAgentctl { generation, event } => {
                assert_eq!(*generation, 4);
                assert!(
                    matches!(event, EventPayload::AgentctlStarting { runtime, generation: 4, .. } if *runtime == vm())
                );
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(outcome.generation, 4);
        let (_, outcome) = run(
            input(vm(), S::WaitingForInput),
            vec![O::RuntimeNotRegistered],
        );
        assert_eq!(
            outcome.error_message().as_deref(),
            Some(
                "runtime_not_registered: vm: no executor driver is registered for this runtime; \
                 the session recovers when sessiond starts with one"
            )
        );
        let (_, outcome) = run(
            input(vm(), S::WaitingForInput),
            vec![O::ExecutorMissing {
                reason: "vm deleted".into(),
            }],
        );
        assert_eq!(
            outcome.error_message().as_deref(),
            Some(
                "executor_missing: the executor of this session no longer exists (vm deleted); \
                 create a new session"
            )
        );
    }

    /// A deadline bounds silence, not work: what can pass by itself (the
    /// agent cut for silence, its resume interrupted, agentctl's launch
    /// failing or silent) is retried while attempts remain, with the
    /// workspace kept when it is up and the session as it was; the last
    /// attempt's failure is ERROR naming the attempts. Verdicts (the agent
    /// refusing the conversation) are ERROR at the first attempt.
    #[test]
    fn what_can_pass_by_itself_is_retried_until_attempts_run_out() {
        let resumed = || {
            vec![
                O::WorktreeExists,
                O::ProcessGone,
                O::Launched,
                healthy(),
                caps(true),
                O::Applied,
            ]
        };
        let standalone = |attempt, max| {
            input(Runtime::LocalStandalone, S::WaitingForInput).attempt(attempt, max)
        };
        struct Case {
            name: &'static str,
            input: RecoveryInput,
            last: Observation,
            label: L,
            session: S,
            code: &'static str,
            retry: bool,
        }
        let exited = || O::ResumeInterrupted {
            reason: "the agent exited".into(),
        };
        let case = |name, input, last, label, session, code, retry| Case {
            name,
            input,
            last,
            label,
            session,
            code,
            retry,
        };
        let cases = vec![
            case(
                "silence, attempts left",
                standalone(1, 3),
                O::DeadlineExceeded,
                L::Retrying,
                S::WaitingForInput,
                "recovering",
                true,
            ),
            case(
                "interrupted, attempts left",
                standalone(2, 3),
                exited(),
                L::Retrying,
                S::WaitingForInput,
                "recovering",
                true,
            ),
            case(
                "silence, last attempt",
                standalone(3, 3),
                O::DeadlineExceeded,
                L::ResumeFailed,
                S::Error,
                "attempts_exhausted",
                false,
            ),
            case(
                "interrupted, last attempt",
                standalone(3, 3),
                exited(),
                L::ResumeFailed,
                S::Error,
                "attempts_exhausted",
                false,
            ),
            case(
                "silence, no retries configured",
                standalone(1, 1),
                O::DeadlineExceeded,
                L::ResumeFailed,
                S::Error,
                "deadline_exceeded",
                false,
            ),
            case(
                "a verdict is not retried",
                standalone(1, 3),
                O::ConversationLost {
                    reason: "not found".into(),
                },
                L::ResumeFailed,
                S::Error,
                "resume_failed",
                false,
            ),
        ];
        for c in cases {
            let name = c.name;
            let mut observations = resumed();
            observations.push(c.last);
            let (_, outcome) = run(c.input, observations);
            assert_eq!(outcome.label, c.label, "{name}");
            assert_eq!(outcome.executor_status, ExecutorStatus::Ready, "{name}");
            assert_eq!(outcome.session_state, c.session, "{name}");
            assert_eq!(outcome.retry_in_background, c.retry, "{name}");
            assert!(outcome.workspace_enabled, "{name}: the workspace stays up");
            let message = outcome.error_message().unwrap_or_default();
            assert!(
                message.starts_with(&format!("{}:", c.code)),
                "{name}: {message}"
            );
            if c.retry {
                assert!(outcome.events.is_empty(), "{name}: nothing to announce");
                assert!(outcome.session_error.is_none(), "{name}");
            }
        }
        // agentctl's own launch: a failed spawn or a silent start is retried
        // too (executor `error` meanwhile, session unchanged).
        for (name, last) in [
            (
                "spawn failed",
                O::ActionFailed {
                    reason: "EAGAIN".into(),
                },
            ),
            ("silent start", O::DeadlineExceeded),
        ] {
            let (_, outcome) = run(
                standalone(1, 2),
                vec![O::WorktreeExists, O::ProcessGone, last.clone()],
            );
            assert_eq!(outcome.label, L::Retrying, "{name}");
            assert_eq!(outcome.executor_status, ExecutorStatus::Error, "{name}");
            assert_eq!(outcome.session_state, S::WaitingForInput, "{name}");
            assert!(outcome.retry_in_background, "{name}");
            let (_, outcome) = run(
                standalone(2, 2),
                vec![O::WorktreeExists, O::ProcessGone, last],
            );
            assert_eq!(outcome.session_state, S::Error, "{name}: last attempt");
            assert!(!outcome.retry_in_background, "{name}: last attempt");
        }
        // The agentctl just launched is killed before it answers Health:
        // the next attempt launches another (it was once ERROR at once).
        let killed = || {
            vec![
                O::WorktreeExists,
                O::ProcessGone,
                O::Launched,
                O::HostUnreachable {
                    reason: "stream closed because of a broken pipe".into(),
                    retry_in_background: false,
                },
            ]
        };
        let (_, outcome) = run(standalone(1, 2), killed());
        assert_eq!(outcome.label, L::Retrying);
        assert_eq!(outcome.session_state, S::WaitingForInput);
        assert!(outcome.retry_in_background);
        let message = outcome.error_message().unwrap_or_default();
        assert!(message.starts_with("recovering:"), "{message}");
        assert!(message.contains("broken pipe"), "{message}");
        let (_, outcome) = run(standalone(2, 2), killed());
        assert_eq!(outcome.session_state, S::Error, "last attempt");
        assert!(!outcome.retry_in_background, "last attempt");
    }

    #[test]
    fn ended_sessions_get_their_executor_stopped() {
        for state in [S::Completed, S::Cancelled] {
            for runtime in Runtime::ALL.iter().copied().chain([vm()]) {
                check(
                    "ended",
                    input(runtime, state),
                    vec![O::ExecutorStopped],
                    Expect {
                        actions: &["stop_executor", "done"],
                        label: L::Stopped,
                        executor: ExecutorStatus::Stopped,
                        session: state,
                        workspace: false,
                        events: &[],
                    },
                );
                check(
                    "stop failed",
                    input(runtime, state),
                    vec![O::ActionFailed {
                        reason: "busy".into(),
                    }],
                    Expect {
                        actions: &["stop_executor", "done"],
                        label: L::ExecutorError,
                        executor: ExecutorStatus::Error,
                        session: state,
                        workspace: false,
                        events: &[EventKind::AgentctlError],
                    },
                );
            }
        }
    }

    #[test]
    fn messages_are_actionable_and_coded() {
        let (_, outcome) = run(
            input(Runtime::LocalStandalone, S::Running),
            vec![O::WorktreeMissing],
        );
        assert_eq!(
            outcome.error_message().as_deref(),
            Some(
                "worktree_missing: worktree /work/wt/feature no longer exists; create a new session"
            )
        );
        match &outcome.events[1] {
            EventPayload::StateChanged {
                from,
                to,
                error_message,
            } => {
                assert_eq!((*from, *to), (S::Running, S::Error));
                assert_eq!(error_message, &outcome.error_message());
            }
            other => panic!("expected state_changed, got {other:?}"),
        }
        assert!(
            RecoveryFailure::NotResumable
                .message()
                .starts_with("not_resumable: ")
        );
        let (_, outcome) = run(
            input(Runtime::Remote, S::Running),
            vec![O::HostUnreachable {
                reason: "refused".into(),
                retry_in_background: true,
            }],
        );
        assert!(outcome.retry_in_background);
        assert!(
            outcome
                .error_message()
                .is_some_and(|m| m.contains("http://10.0.0.7:7070") && m.contains("reconnecting"))
        );
    }

    #[test]
    fn launch_writes_the_next_generation_before_spawning() {
        let (actions, outcome) = run(
            input(Runtime::LocalStandalone, S::WaitingForInput),
            vec![
                O::WorktreeExists,
                O::ProcessGone,
                O::ActionFailed { reason: "x".into() },
            ],
        );
        let Action::LaunchAgentctl { generation, event } = &actions[2] else {
            panic!("expected a launch, got {:?}", actions[2]);
        };
        assert_eq!(*generation, 4);
        assert!(matches!(
            event,
            EventPayload::AgentctlStarting { generation: 4, .. }
        ));
        assert_eq!(outcome.generation, 4);
    }

    #[test]
    fn ready_event_carries_the_effective_capability() {
        let mut recovery = Recovery::new(input(Runtime::Remote, S::WaitingForInput));
        recovery.start();
        recovery.observe(healthy()).expect("health");
        let action = recovery.observe(caps(false)).expect("caps");
        assert!(matches!(
            action,
            Action::MarkExecutorReady {
                event: EventPayload::AgentctlReady {
                    supports_session_resume: Some(false),
                    ..
                }
            }
        ));
    }

    #[test]
    fn resume_uses_the_token() {
        let mut recovery = Recovery::new(input(Runtime::Remote, S::WaitingForInput));
        recovery.start();
        recovery.observe(healthy()).expect("health");
        recovery.observe(caps(true)).expect("caps");
        let action = recovery.observe(O::Applied).expect("applied");
        assert_eq!(
            action,
            Action::ResumeAgent {
                resume_token: "tok".into()
            }
        );
    }

    #[test]
    fn unexpected_observations_are_rejected_without_effect() {
        let mut recovery = Recovery::new(input(Runtime::LocalDocker, S::WaitingForInput));
        assert!(
            recovery.observe(O::ContainerRunning).is_err(),
            "before start"
        );
        recovery.start();
        recovery
            .observe(O::WorktreeExists)
            .expect("the worktree first");
        let err = recovery.observe(O::ResumeSucceeded).unwrap_err();
        assert_eq!(err.phase, "finding the container");
        assert_eq!(
            recovery
                .observe(O::ContainerRunning)
                .expect("still finding"),
            Action::HealthCheck
        );
        let done = recovery.observe(O::DeadlineExceeded).expect("deadline");
        assert!(matches!(done, Action::Done(_)));
        assert!(recovery.is_done());
        assert!(recovery.observe(O::Applied).is_err(), "after done");
    }

    #[test]
    fn input_from_records_prefers_the_session_token() {
        use crate::status::tests::session;
        use chrono::{TimeZone, Utc};

        let session = session(S::Running, Some("from-session"));
        let at = Utc
            .timestamp_opt(1_700_000_000, 0)
            .single()
            .expect("valid time");
        let mut record = ExecutorRecord {
            id: ExecutorId::new(),
            session_id: session.id,
            task_id: session.task_id,
            runtime: Runtime::LocalStandalone,
            status: ExecutorStatus::Ready,
            agentctl_url: None,
            agentctl_port: Some(7070),
            container_id: None,
            pid: Some(1),
            pid_start_time: Some(2),
            auth_secret: "s".into(),
            generation: 7,
            supports_session_resume: true,
            supports_workspace_only: true,
            resume_token: Some("from-record".into()),
            workspace_path: "/work/ws".into(),
            worktree: Default::default(),
            last_seen_at: None,
            error_message: None,
            owner_id: None,
            lease_expires_at: None,
            lease_epoch: 0,
            version: 1,
            created_at: at,
            updated_at: at,
        };
        let built = RecoveryInput::new(&record, &session, true, ResumePolicy::Startup);
        assert_eq!(built.resume_token.as_deref(), Some("from-session"));
        assert_eq!(built.worktree_path, "/work/ws");
        assert_eq!(built.generation, 7);

        let tokenless = crate::status::tests::session(S::Running, None);
        let built = RecoveryInput::new(&record, &tokenless, true, ResumePolicy::Startup);
        assert_eq!(built.resume_token.as_deref(), Some("from-record"));

        record.resume_token = Some(String::new());
        let built = RecoveryInput::new(&record, &tokenless, true, ResumePolicy::Startup);
        assert_eq!(built.resume_token, None);
    }

    #[test]
    fn policy_strings() {
        for p in ResumePolicy::ALL {
            assert_eq!(ResumePolicy::parse(p.as_str()), Ok(*p));
        }
        assert_eq!(ResumePolicy::default(), ResumePolicy::Startup);
        assert!(ResumePolicy::parse("eager").is_err());
    }
}
