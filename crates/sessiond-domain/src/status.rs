//! The Session Status API (`task.session.status`: is the agent running,
//! can it resume, does it need to) as a pure function.

use std::fmt;

use crate::{
    entities::{ExecutorRecord, Session},
    ids::{AgentProfileId, SessionId, TaskId},
    states::{ExecutorStatus, Runtime, SessionState, UnknownValue},
};

/// What the agent process of one execution is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AgentProcessState {
    /// No agent process runs.
    NotRunning,
    /// A launch or resume is in flight (single-flight): neither running nor
    /// in need of another resume.
    Starting,
    /// The agent process runs (idle or in a turn).
    Running,
}

/// What is known about one session's current execution: taken from the
/// in-memory executors cache, or from the executor record when the cache has
/// no entry (see [`ExecutionView::from_record`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecutionView {
    /// The session this execution belongs to. A view of another session of
    /// the same task is ignored (a status is of one session only).
    pub session_id: SessionId,
    /// `"<executor id>/<generation>"` (see [`ExecutorRecord::execution_id`]).
    pub execution_id: String,
    /// The executor's status as last seen.
    pub executor_status: ExecutorStatus,
    /// Whether the agent process runs, is being started, or not.
    pub agent: AgentProcessState,
    /// The capability probe's answer; `None` until probed. It can only lower
    /// the profile's claim.
    pub supports_session_resume: Option<bool>,
    /// The executor's error while it is retried in the background (a remote
    /// host reconnecting, a Docker engine coming back): shown as the status's
    /// message while the session itself keeps its state.
    pub retrying: Option<String>,
}

impl ExecutionView {
    /// A view built from the persisted record alone: no agent is known to run,
    /// and the record's resume flag stands for the probe's last verdict.
    pub fn from_record(record: &ExecutorRecord) -> Self {
        Self {
            session_id: record.session_id,
            execution_id: record.execution_id(),
            executor_status: record.status,
            agent: AgentProcessState::NotRunning,
            supports_session_resume: Some(record.supports_session_resume),
            retrying: retrying_message(record),
        }
    }
}

/// The error codes of an executor that is retried in the background rather
/// than failed (see `RecoveryFailure::code`).
const RETRIED_CODES: [&str; 3] = ["reconnecting:", "docker_unavailable:", "recovering:"];

/// The record's error when the executor is retried in the background: `error`
/// with a code of `RETRIED_CODES`, or `ready` (workspace up) with
/// `recovering:` while its agent's resume is retried.
pub fn retrying_message(record: &ExecutorRecord) -> Option<String> {
    record
        .error_message
        .as_ref()
        .filter(|m| {
            RETRIED_CODES.iter().any(|c| m.starts_with(c))
                && (record.status == ExecutorStatus::Error
                    || (record.status == ExecutorStatus::Ready && m.starts_with("recovering:")))
        })
        .cloned()
}

/// Why a session does, or cannot, need a resume. The string forms are those
/// of `sessiond.v1.ResumeReason` (without the `RESUME_REASON_` prefix, in lower case).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ResumeReason {
    /// Nothing to resume: the agent runs, or a launch/resume is in flight.
    None,
    /// No agent runs and the session can be resumed: show "Resume" (or auto-resume).
    AgentNotRunning,
    /// The profile does not claim resume support, or the agent said it has
    /// none: show "Create a new session".
    NotResumable,
    /// Resume is supported but there is no conversation token: the agent
    /// never opened a conversation (or the session was never launched).
    MissingResumeToken,
    /// The session is COMPLETED or CANCELLED; start a new session instead.
    SessionEnded,
    /// The session's executor is gone for good (its container was removed):
    /// nothing is left to resume into; create a new session. Publicly it is
    /// `not_resumable` (the public strings; not in [`ResumeReason::ALL`]),
    /// with the session's `error_message` (code `container_missing`) saying why.
    ExecutorGone,
}

impl ResumeReason {
    /// The reasons with a string form of their own, in the proto's order
    /// ([`ResumeReason::ExecutorGone`] is shown as `not_resumable`).
    pub const ALL: &'static [ResumeReason] = &[
        ResumeReason::None,
        ResumeReason::AgentNotRunning,
        ResumeReason::NotResumable,
        ResumeReason::MissingResumeToken,
        ResumeReason::SessionEnded,
    ];

    /// The string form: the proto's name in lower case, empty for `None`.
    pub const fn as_str(self) -> &'static str {
        match self {
            ResumeReason::None => "",
            ResumeReason::AgentNotRunning => "agent_not_running",
            ResumeReason::NotResumable => "not_resumable",
            ResumeReason::MissingResumeToken => "missing_resume_token",
            ResumeReason::SessionEnded => "session_ended",
            ResumeReason::ExecutorGone => "not_resumable",
        }
    }

    /// The reason of [`ResumeReason::ALL`] whose string form is `value`
    /// (`not_resumable` parses as [`ResumeReason::NotResumable`]).
    ///
    /// # Errors
    ///
    /// [`UnknownValue`] for any other text.
    pub fn parse(value: &str) -> Result<Self, UnknownValue> {
        Self::ALL
            .iter()
            .copied()
            .find(|r| r.as_str() == value)
            .ok_or_else(|| UnknownValue {
                kind: "resume reason",
                value: value.to_owned(),
                expected: "\"\" agent_not_running not_resumable missing_resume_token session_ended",
            })
    }
}

impl fmt::Display for ResumeReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The answer of `GetSessionStatus`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionStatus {
    /// The session.
    pub session_id: SessionId,
    /// Its task.
    pub task_id: TaskId,
    /// The session's recorded state.
    pub state: SessionState,
    /// The profile its agent is started from.
    pub agent_profile_id: AgentProfileId,
    /// `None` when the session has no execution.
    pub executor_status: Option<ExecutorStatus>,
    /// The current execution's id, else the last one the session recorded.
    pub agent_execution_id: Option<String>,
    /// Where the session's executor runs.
    pub runtime: Runtime,
    /// An agent process runs for this session (not for another session of the task).
    pub is_agent_running: bool,
    /// The session could be resumed: not ended, resume supported by the
    /// profile and not denied by the agent, and a resume token present.
    pub is_resumable: bool,
    /// Resumable, and no agent runs or is being started for it.
    pub needs_resume: bool,
    /// Why a resume is (or is not) needed; see [`session_status`] for the order.
    pub resume_reason: ResumeReason,
    /// The worktree's directory.
    pub worktree_path: String,
    /// The worktree's branch.
    pub worktree_branch: String,
    /// The worktree's id.
    pub worktree_id: String,
    /// The repository sessiond created the worktree from; empty for a
    /// directory the caller made.
    pub worktree_repository: String,
    /// The ref the worktree's branch started at; empty for a directory the
    /// caller made.
    pub worktree_base: String,
    /// The session's error, else the executor's while it is retried in the
    /// background (see [`ExecutionView::retrying`]).
    pub error_message: Option<String>,
    /// Startup recovery has not finished with this session yet: the fields
    /// above are what was recorded before the restart, not yet checked
    /// against the world (see [`SessionStatus::recovering`]).
    pub recovering: bool,
    /// Recovery is bringing the session's agent back (waiting for a launch
    /// slot, launching, resuming, or waiting to retry): where it stands.
    /// The executor's status is real meanwhile (READY: the workspace is up).
    pub agent_recovery: Option<AgentRecovery>,
    /// What the session's turns used and cost (kept in its metadata).
    pub usage: crate::UsageTotals,
    /// Messages waiting for the running turn to end, oldest first.
    pub queued: Vec<crate::QueuedMessage>,
    /// The queue waits for the user: the last turn ended interrupted, and
    /// a retry of it or a new message lets the queue go on.
    pub queue_held: bool,
}

/// Where the relaunch of a session's agent stands while recovery brings it
/// back by itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentRecovery {
    /// What it does now.
    pub stage: RecoveryStage,
    /// While it waits for a launch slot: its 1-based place among the
    /// launches waiting on its host, and how many wait there.
    pub place: Option<(u32, u32)>,
    /// The attempt under way or next (1-based).
    pub attempt: u32,
    /// How many attempts are made before the session goes ERROR.
    pub max_attempts: u32,
    /// Why the previous attempt broke off.
    pub last_error: Option<String>,
    /// While it waits to retry: how long until the next attempt.
    pub retry_in: Option<std::time::Duration>,
    /// History updates the agent replayed so far (a `session/load`).
    pub replayed: u64,
}

/// A stage of [`AgentRecovery`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RecoveryStage {
    /// Waiting for a launch slot on its host.
    Queued,
    /// The agent process is starting (`initialize`).
    Launching,
    /// The agent reopens the conversation (`session/resume` or `session/load`).
    Resuming,
    /// An attempt broke off; the next one starts after a delay.
    WaitingToRetry,
}

impl RecoveryStage {
    /// Its stable name (`queued`, `launching`, `resuming`, `waiting_to_retry`).
    pub const fn as_str(self) -> &'static str {
        match self {
            RecoveryStage::Queued => "queued",
            RecoveryStage::Launching => "launching",
            RecoveryStage::Resuming => "resuming",
            RecoveryStage::WaitingToRetry => "waiting_to_retry",
        }
    }
}

impl SessionStatus {
    /// The status of a session whose agent recovery is bringing back
    /// ([`AgentRecovery`]): recovering, not running, no resume needed; the
    /// executor's status stays as it is (READY: the workspace is up). An
    /// ended session keeps its reason.
    #[must_use]
    pub fn agent_recovering(mut self, progress: AgentRecovery) -> Self {
        self.recovering = true;
        self.is_agent_running = false;
        if self.resume_reason != ResumeReason::SessionEnded {
            self.resume_reason = ResumeReason::None;
            self.needs_resume = false;
        }
        self.agent_recovery = Some(progress);
        self
    }

    /// The status of a session that startup recovery has not finished with
    /// yet. Whether its agent (or agentctl) survived is not known, so it is
    /// shown as being started: not running, no resume needed (recovery
    /// decides that), and an executor `starting` ("being recovered"). An
    /// ended session keeps its reason.
    #[must_use]
    pub fn recovering(mut self) -> Self {
        self.recovering = true;
        self.is_agent_running = false;
        if self.resume_reason != ResumeReason::SessionEnded {
            self.resume_reason = ResumeReason::None;
            self.needs_resume = false;
            if self.executor_status.is_some() {
                self.executor_status = Some(ExecutorStatus::Starting);
            }
        }
        self
    }
}

/// Derives a session's status from the session, what is known of its
/// execution, and the profile's `supports_session_resume` claim.
///
/// The reason is decided in this order, first match wins:
/// 1. COMPLETED or CANCELLED: [`ResumeReason::SessionEnded`].
/// 2. an agent runs or is being started: [`ResumeReason::None`].
/// 3. ERROR because its container no longer exists (`error_message` code
///    `container_missing`): [`ResumeReason::ExecutorGone`].
/// 4. profile claims no resume, or the probe said unsupported: [`ResumeReason::NotResumable`].
/// 5. no token (a CREATED session never has a conversation, whatever its
///    metadata says): [`ResumeReason::MissingResumeToken`].
/// 6. otherwise: [`ResumeReason::AgentNotRunning`].
///
/// `needs_resume` holds exactly when the reason is `agent_not_running`.
/// An `execution` of another session is ignored, as if it were `None`.
///
/// ```
/// use std::collections::BTreeMap;
/// use chrono::Utc;
/// use sessiond_domain::*;
///
/// // A session whose agent was lost in a restart: nothing runs, a token exists.
/// let session = Session {
///     id: SessionId::new(),
///     task_id: TaskId::new(),
///     state: SessionState::WaitingForInput,
///     agent_profile_id: AgentProfileId::new(),
///     agent_execution_id: None,
///     runtime: Runtime::LocalStandalone,
///     executor_id: None,
///     worktree: Worktree::default(),
///     title: String::new(),
///     resume_token: Some("conv-1".into()),
///     metadata: BTreeMap::new(),
///     error_message: None,
///     version: 1,
///     created_at: Utc::now(),
///     updated_at: Utc::now(),
/// };
/// let status = session_status(&session, None, true);
/// assert!(status.needs_resume);
/// assert_eq!(status.resume_reason, ResumeReason::AgentNotRunning);
/// assert_eq!(check_resume(&status), Ok(true));
///
/// // A profile that cannot resume: the user is told to start over.
/// let status = session_status(&session, None, false);
/// assert_eq!(status.resume_reason, ResumeReason::NotResumable);
/// assert_eq!(check_resume(&status), Err(ResumeRefused::NotResumable));
/// ```
pub fn session_status(
    session: &Session,
    execution: Option<&ExecutionView>,
    profile_supports_resume: bool,
) -> SessionStatus {
    session_status_with(
        session,
        execution,
        profile_supports_resume,
        MetadataStatus::of(session),
    )
}

/// What a status shows of a session's metadata (its usage totals and
/// queued messages), parsed from it: a caller answering many status reads
/// of one committed session version keeps it beside the session instead of
/// parsing the metadata at every read.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MetadataStatus {
    /// What the session's turns used and cost.
    pub usage: crate::UsageTotals,
    /// Messages waiting for the running turn to end, oldest first.
    pub queued: Vec<crate::QueuedMessage>,
    /// The queue is held behind an interrupted turn.
    pub queue_held: bool,
}

impl MetadataStatus {
    /// Parsed from `session`'s metadata.
    pub fn of(session: &Session) -> Self {
        Self {
            usage: crate::UsageTotals::from_metadata(&session.metadata),
            queued: crate::queue::queued(&session.metadata),
            queue_held: crate::queue::is_held(&session.metadata),
        }
    }
}

/// [`session_status`] with the metadata's part already parsed (`metadata`
/// must be [`MetadataStatus::of`] this `session`).
pub fn session_status_with(
    session: &Session,
    execution: Option<&ExecutionView>,
    profile_supports_resume: bool,
    metadata: MetadataStatus,
) -> SessionStatus {
    let execution = execution.filter(|view| view.session_id == session.id);
    let agent = execution.map_or(AgentProcessState::NotRunning, |view| view.agent);
    let agent_denies_resume =
        execution.and_then(|view| view.supports_session_resume) == Some(false);
    let supports_resume = profile_supports_resume && !agent_denies_resume;
    let has_token = session.state != SessionState::Created
        && session
            .resume_token
            .as_deref()
            .is_some_and(|token| !token.is_empty());
    let ended = session.state.is_terminal();
    let gone = executor_gone(session);

    let is_agent_running = agent == AgentProcessState::Running;
    let is_resumable = !ended && !gone && supports_resume && has_token;
    let resume_reason = if ended {
        ResumeReason::SessionEnded
    } else if agent != AgentProcessState::NotRunning {
        ResumeReason::None
    } else if gone {
        ResumeReason::ExecutorGone
    } else if !supports_resume {
        ResumeReason::NotResumable
    } else if !has_token {
        ResumeReason::MissingResumeToken
    } else {
        ResumeReason::AgentNotRunning
    };

    SessionStatus {
        session_id: session.id,
        task_id: session.task_id,
        state: session.state,
        agent_profile_id: session.agent_profile_id,
        executor_status: execution.map(|view| view.executor_status),
        agent_execution_id: execution
            .map(|view| view.execution_id.clone())
            .or_else(|| session.agent_execution_id.clone()),
        runtime: session.runtime,
        is_agent_running,
        is_resumable,
        needs_resume: resume_reason == ResumeReason::AgentNotRunning,
        resume_reason,
        worktree_path: session.worktree.path.clone(),
        worktree_branch: session.worktree.branch.clone(),
        worktree_id: session.worktree.id.clone(),
        worktree_repository: session.worktree.repository.clone(),
        worktree_base: session.worktree.base.clone(),
        error_message: session
            .error_message
            .clone()
            .or_else(|| execution.and_then(|view| view.retrying.clone())),
        recovering: false,
        agent_recovery: None,
        usage: metadata.usage,
        queued: metadata.queued,
        queue_held: metadata.queue_held,
    }
}

/// The session is ERROR because its executor is gone for good: recovery or a
/// resume found its container removed and stored that, with the code
/// `container_missing`, as the session's error.
fn executor_gone(session: &Session) -> bool {
    session.state == SessionState::Error
        && session.error_message.as_deref().is_some_and(|m| {
            let code = m.split_once(':').map(|(code, _)| code);
            code == Some(crate::recovery::RecoveryFailure::ContainerMissing.code())
                || code == Some("executor_missing")
        })
}

/// Why an explicit `ResumeSession` is refused (its validation, before any attempt).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResumeRefused {
    /// The session is COMPLETED or CANCELLED (the state it is in).
    #[error("the session has ended ({0}); create a new session")]
    SessionEnded(SessionState),
    /// The profile claims no resume support, or the agent said it has none.
    #[error("this agent cannot resume previous sessions; create a new session")]
    NotResumable,
    /// There is no conversation to resume.
    #[error(
        "the session has no resume token (the agent never opened a conversation); create a new session"
    )]
    MissingResumeToken,
    /// The session's container was removed.
    #[error("the container of this session no longer exists; create a new session")]
    ExecutorGone,
}

/// Whether an explicit resume should go ahead, given the session's status.
///
/// `Ok(false)` means there is nothing to do: the agent runs or a resume is
/// already in flight (the caller joins it instead of starting another).
///
/// # Errors
///
/// [`ResumeRefused`] when the session cannot be resumed at all; its text
/// tells the user what to do instead.
pub fn check_resume(status: &SessionStatus) -> Result<bool, ResumeRefused> {
    match status.resume_reason {
        ResumeReason::AgentNotRunning => Ok(true),
        ResumeReason::None => Ok(false),
        ResumeReason::NotResumable => Err(ResumeRefused::NotResumable),
        ResumeReason::MissingResumeToken => Err(ResumeRefused::MissingResumeToken),
        ResumeReason::SessionEnded => Err(ResumeRefused::SessionEnded(status.state)),
        ResumeReason::ExecutorGone => Err(ResumeRefused::ExecutorGone),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::BTreeMap;

    use chrono::{TimeZone, Utc};

    use super::*;
    use crate::{entities::Worktree, ids::ExecutorId};

    pub(crate) fn session(state: SessionState, token: Option<&str>) -> Session {
        let at = Utc
            .timestamp_opt(1_700_000_000, 0)
            .single()
            .expect("valid time");
        Session {
            id: SessionId::new(),
            task_id: TaskId::new(),
            state,
            agent_profile_id: AgentProfileId::new(),
            agent_execution_id: None,
            runtime: Runtime::LocalDocker,
            executor_id: Some(ExecutorId::new()),
            worktree: Worktree {
                id: "wt".into(),
                path: "/work/wt".into(),
                branch: "feature".into(),
                ..Default::default()
            },
            title: String::new(),
            resume_token: token.map(str::to_owned),
            metadata: BTreeMap::new(),
            error_message: None,
            version: 1,
            created_at: at,
            updated_at: at,
        }
    }

    fn view(session: &Session, agent: AgentProcessState, probe: Option<bool>) -> ExecutionView {
        ExecutionView {
            session_id: session.id,
            execution_id: "exec/1".into(),
            executor_status: ExecutorStatus::Ready,
            agent,
            supports_session_resume: probe,
            retrying: None,
        }
    }

    use AgentProcessState::{NotRunning, Running, Starting};
    use ResumeReason as R;

    /// (state, token, profile claim, agent, probe) -> (running, resumable, needs, reason)
    type Case = (
        SessionState,
        Option<&'static str>,
        bool,
        Option<AgentProcessState>,
        Option<bool>,
        (bool, bool, bool, R),
    );

    #[rustfmt::skip]
    const CASES: &[Case] = {
        use SessionState as S;
        &[
            (S::WaitingForInput, Some("t"), true,  None,             None,        (false, true,  true,  R::AgentNotRunning)),
            (S::WaitingForInput, Some("t"), true,  Some(NotRunning), Some(true),  (false, true,  true,  R::AgentNotRunning)),
            (S::WaitingForInput, Some("t"), true,  Some(Running),    Some(true),  (true,  true,  false, R::None)),
            (S::Running,         Some("t"), true,  Some(Starting),   None,        (false, true,  false, R::None)),
            (S::WaitingForInput, Some("t"), false, None,             None,        (false, false, false, R::NotResumable)),
            (S::WaitingForInput, Some("t"), true,  Some(NotRunning), Some(false), (false, false, false, R::NotResumable)),
            (S::WaitingForInput, Some("t"), false, Some(Running),    None,        (true,  false, false, R::None)),
            (S::WaitingForInput, None,      true,  None,             None,        (false, false, false, R::MissingResumeToken)),
            (S::WaitingForInput, Some(""),  true,  None,             None,        (false, false, false, R::MissingResumeToken)),
            (S::Created,         Some("t"), true,  None,             None,        (false, false, false, R::MissingResumeToken)),
            (S::Starting,        Some("t"), true,  None,             None,        (false, true,  true,  R::AgentNotRunning)),
            (S::Error,           Some("t"), true,  None,             None,        (false, true,  true,  R::AgentNotRunning)),
            (S::Error,           None,      false, None,             None,        (false, false, false, R::NotResumable)),
            (S::Completed,       Some("t"), true,  None,             None,        (false, false, false, R::SessionEnded)),
            (S::Cancelled,       Some("t"), true,  Some(Running),    None,        (true,  false, false, R::SessionEnded)),
        ]
    };

    #[test]
    fn a_removed_container_is_not_resumable_and_says_so() {
        let mut s = session(SessionState::Error, Some("t"));
        s.error_message = Some(crate::recovery::RecoveryFailure::ContainerMissing.message());
        let mut v = view(&s, NotRunning, Some(true));
        v.executor_status = ExecutorStatus::Error;
        let st = session_status(&s, Some(&v), true);
        assert!(!st.is_resumable && !st.needs_resume, "{st:?}");
        assert_eq!(st.resume_reason, R::ExecutorGone);
        let msg = st.error_message.clone().unwrap();
        assert!(msg.contains("create a new session"), "{msg}");
        assert_eq!(check_resume(&st), Err(ResumeRefused::ExecutorGone));
        // Another error (agentctl stopped answering) stays resumable.
        s.error_message =
            Some("unhealthy: agentctl is not healthy: x; resume the session to try again".into());
        let st = session_status(&s, Some(&v), true);
        assert_eq!(st.resume_reason, R::AgentNotRunning);
        // A running agent wins (a later resume brought it back).
        s.error_message = Some(crate::recovery::RecoveryFailure::ContainerMissing.message());
        let running = view(&s, Running, Some(true));
        assert_eq!(
            session_status(&s, Some(&running), true).resume_reason,
            R::None
        );
    }

    #[test]
    fn reasons_table() {
        for (i, &(state, token, profile, agent, probe, expected)) in CASES.iter().enumerate() {
            let s = session(state, token);
            let v = agent.map(|a| view(&s, a, probe));
            let st = session_status(&s, v.as_ref(), profile);
            assert_eq!(
                (
                    st.is_agent_running,
                    st.is_resumable,
                    st.needs_resume,
                    st.resume_reason
                ),
                expected,
                "case {i}: {state} token={token:?} profile={profile} agent={agent:?} probe={probe:?}"
            );
        }
    }

    #[test]
    fn execution_of_another_session_is_ignored() {
        let s = session(SessionState::WaitingForInput, Some("t"));
        let mut other = view(&s, Running, Some(true));
        other.session_id = SessionId::new();
        let st = session_status(&s, Some(&other), true);
        assert!(!st.is_agent_running);
        assert!(st.needs_resume);
        assert_eq!(st.executor_status, None);
    }

    #[test]
    fn copies_session_and_execution_fields() {
        let mut s = session(SessionState::Error, Some("t"));
        s.error_message = Some("boom".into());
        s.agent_execution_id = Some("old/1".into());
        let st = session_status(&s, None, true);
        assert_eq!(st.agent_execution_id.as_deref(), Some("old/1"));
        assert_eq!(st.worktree_path, "/work/wt");
        assert_eq!(st.worktree_branch, "feature");
        assert_eq!(st.error_message.as_deref(), Some("boom"));
        assert_eq!(st.runtime, Runtime::LocalDocker);

        let v = view(&s, NotRunning, None);
        let st = session_status(&s, Some(&v), true);
        assert_eq!(st.agent_execution_id.as_deref(), Some("exec/1"));
        assert_eq!(st.executor_status, Some(ExecutorStatus::Ready));
    }

    #[test]
    fn reason_strings_match_the_proto() {
        let strings: Vec<_> = R::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(
            strings,
            [
                "",
                "agent_not_running",
                "not_resumable",
                "missing_resume_token",
                "session_ended"
            ]
        );
        for r in R::ALL {
            assert_eq!(R::parse(r.as_str()), Ok(*r));
        }
        assert!(R::parse("nope").is_err());
    }

    #[test]
    fn check_resume_follows_the_reason() {
        let s = session(SessionState::Error, Some("t"));
        assert_eq!(check_resume(&session_status(&s, None, true)), Ok(true));
        assert_eq!(
            check_resume(&session_status(&s, None, false)),
            Err(ResumeRefused::NotResumable)
        );
        let running = view(&s, Running, None);
        assert_eq!(
            check_resume(&session_status(&s, Some(&running), true)),
            Ok(false)
        );
        let ended = session(SessionState::Completed, Some("t"));
        assert_eq!(
            check_resume(&session_status(&ended, None, true)),
            Err(ResumeRefused::SessionEnded(SessionState::Completed))
        );
        let tokenless = session(SessionState::WaitingForInput, None);
        assert_eq!(
            check_resume(&session_status(&tokenless, None, true)),
            Err(ResumeRefused::MissingResumeToken)
        );
    }

    /// Every case of the table, shown while startup recovery has not
    /// reached the session: nothing claims the agent runs or needs a resume,
    /// the executor is `starting`; an ended session stays ended.
    #[test]
    fn a_session_not_yet_recovered_is_shown_recovering() {
        for (state, token, profile, agent, probe, _) in CASES {
            let s = session(*state, *token);
            let v = agent.map(|a| view(&s, a, *probe));
            let plain = session_status(&s, v.as_ref(), *profile);
            let st = plain.clone().recovering();
            assert!(st.recovering);
            assert!(!st.is_agent_running, "{state:?}");
            assert!(!st.needs_resume, "{state:?}");
            assert_eq!(st.is_resumable, plain.is_resumable);
            assert_eq!(st.state, plain.state);
            if state.is_terminal() {
                assert_eq!(st.resume_reason, R::SessionEnded);
                assert_eq!(st.executor_status, plain.executor_status);
            } else {
                assert_eq!(st.resume_reason, R::None, "{state:?}");
                assert_eq!(
                    st.executor_status,
                    v.as_ref().map(|_| ExecutorStatus::Starting)
                );
                // An explicit resume joins recovery instead of starting another.
                assert_eq!(check_resume(&st), Ok(false));
            }
        }
    }
}
