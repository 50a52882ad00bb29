//! The agent process and agentctl's ACP client side of it.
//!
//! [`AgentManager`] owns at most one agent process at a time: it spawns it in
//! its own process group, speaks ACP over its stdio with the
//! `agent-client-protocol` crate, turns ACP session updates into
//! [`UpdateLog`] entries, answers the agent's own requests (permission, file
//! system) and notices when the process exits.
//!
//! Locking: `slot` is a plain mutex held only for short, non-async sections;
//! updates about the agent's state are pushed while it is held so the log
//! order matches the state order. `ops` serializes the slow lifecycle calls
//! (launch, new session, resume).

use std::collections::{HashMap, HashSet, VecDeque};
use std::process::Stdio;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use agent_client_protocol::schema::ProtocolVersion;
use agent_client_protocol::v1::ConnectionTo;
use agent_client_protocol::v1::schema::{
    AuthMethod, AuthenticateRequest, CancelNotification, ClientCapabilities, CloseSessionRequest,
    ConfigOptionUpdate, ContentBlock, CreateElicitationRequest, CreateElicitationResponse,
    CreateTerminalRequest, CreateTerminalResponse, CurrentModeUpdate, ElicitationAcceptAction,
    ElicitationAction, ElicitationCapabilities, ElicitationFormCapabilities,
    ElicitationUrlCapabilities, FileSystemCapabilities, Implementation, InitializeRequest,
    KillTerminalRequest, KillTerminalResponse, LoadSessionRequest, NewSessionRequest,
    PermissionOptionKind, PromptCapabilities, PromptRequest, ReadTextFileRequest,
    ReadTextFileResponse, ReleaseTerminalRequest, ReleaseTerminalResponse,
    RequestPermissionOutcome, RequestPermissionRequest, RequestPermissionResponse,
    ResumeSessionRequest, SelectedPermissionOutcome, SessionConfigOption, SessionId, SessionModeId,
    SessionModeState, SessionNotification, SessionUpdate, SetSessionConfigOptionRequest,
    SetSessionModeRequest, StopReason, TerminalExitStatus, TerminalOutputRequest,
    TerminalOutputResponse, TextContent, WaitForTerminalExitRequest, WaitForTerminalExitResponse,
    WriteTextFileRequest, WriteTextFileResponse,
};
use agent_client_protocol::{Agent, Client, ErrorCode, Handled, Lines, UntypedMessage};
use sessiond_proto::agentctl::v1::{
    AgentExit, AgentExited, AgentState, AgentStateChanged, MessageChunk, TurnEnded, TurnStarted,
    agent_update::Kind,
};
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::sync::{oneshot, watch};

use crate::activity::{self, Parts};
use crate::error::{Error, Result};
use crate::exec::explicit_env;
use crate::journal::{AgentRecord, Journal, Loaded, Phase, TurnRecord};
use crate::signs::{self, Signs};
use crate::stdio;
use crate::sys;
use crate::terminal::{TerminalExit, TerminalSpec, Terminals};
use crate::tree;
use crate::updates::UpdateLog;
use crate::usage::UsageTrack;
use crate::workspace::WorkspaceSlot;

/// How long the agent may show no sign of life (no output, no CPU time)
/// before ACP `initialize` is given up, when the request gives no limit.
/// A slow start that keeps computing or writing is waited for, up to
/// [`signs::SETUP_CAP`].
pub const DEFAULT_INITIALIZE_TIMEOUT: Duration = Duration::from_secs(30);
/// Grace period between TERM and KILL when the request gives none.
pub const DEFAULT_STOP_GRACE: Duration = Duration::from_secs(3);
/// How long the agent may show no sign of life before `session/new`,
/// `session/load`, `session/resume` or `session/set_mode` is given up (see
/// [`signs::until_silent`]; at most [`signs::SETUP_CAP`] in all).
const SESSION_SETUP_SILENCE: Duration = Duration::from_secs(120);
/// How many started turns `Prompt` remembers for its idempotency by
/// `turn_id` (the proto promises 256).
pub const REMEMBERED_TURNS: usize = 256;
/// How long a stop waits for the agent's answer to `session/close` (at most
/// the stop's grace) before it ends the process anyway.
const CLOSE_LIMIT: Duration = Duration::from_secs(2);
/// Kinds of unparseable updates logged at most: an agent sending a new
/// error in every update cannot flood the log.
const MAX_UNPARSED_LOGGED: usize = 64;

/// The largest piece of the agent's reply text one update carries.
const MAX_CHUNK_BYTES: usize = 1 << 20;

/// How agentctl answers an agent's `session/request_permission`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PermissionPolicy {
    /// Pick the agent's allow-once option (or allow-always when that is all
    /// it offers).
    AllowOnce,
    /// Pick a reject option, or cancel.
    Reject,
    /// Ask the backend: the request goes on the update stream (an
    /// `Activity` of kind `permission`) and waits for `RespondPermission`,
    /// at most the launch's permission timeout, then picks a reject option
    /// (or cancels when the agent offered none).
    Ask,
}

/// How long an `ask` permission request waits when the launch gives no
/// timeout; then it is answered with a reject option.
pub const DEFAULT_PERMISSION_TIMEOUT: Duration = Duration::from_secs(300);

/// A permission request (or an elicitation) waiting for the backend's answer.
#[derive(Debug)]
struct Ask {
    /// The agent's option ids (`accept`, `decline`, `cancel` for an
    /// elicitation).
    options: Vec<String>,
    /// For an elicitation: its form, which an answer's values must fit.
    form: Option<crate::elicit::Form>,
    answer: oneshot::Sender<Reply>,
}

/// The backend's answer to an [`Ask`].
#[derive(Debug)]
struct Reply {
    option_id: String,
    /// An accepted elicitation's values.
    content: Option<serde_json::Map<String, serde_json::Value>>,
}

/// What to launch.
#[derive(Debug, Clone, Default)]
pub struct LaunchSpec {
    /// Program, looked up on PATH when not absolute.
    pub command: String,
    /// Arguments.
    pub args: Vec<String>,
    /// Extra environment.
    pub env: HashMap<String, String>,
    /// The profile's `supports_session_resume` claim.
    pub profile_supports_session_resume: bool,
    /// How long the agent may show no sign of life during ACP
    /// `initialize` (and `authenticate`) before it is given up (zero: the
    /// default).
    pub initialize_timeout: Duration,
    /// ACP auth method to `authenticate` with after `initialize`.
    pub auth_method: Option<String>,
    /// Permission policy for this agent; `None`: agentctl's default.
    pub permission_policy: Option<PermissionPolicy>,
    /// How long an `ask` request waits for an answer (zero: the default).
    pub permission_timeout: Duration,
    /// Config option values set right after `session/new`, by option id.
    pub config_defaults: std::collections::BTreeMap<String, String>,
    /// MCP servers given with every session/new, load and resume.
    pub mcp_servers: crate::config::McpServers,
}

/// An auth method the agent offered at `initialize`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OfferedAuth {
    pub id: String,
    pub name: String,
    pub description: String,
}

fn offered_auth(m: &AuthMethod) -> OfferedAuth {
    OfferedAuth {
        id: m.id().0.to_string(),
        name: m.name().to_owned(),
        description: m.description().unwrap_or_default().to_owned(),
    }
}

/// `openai-api-key ("Use OPENAI_API_KEY"), chatgpt ("Log in")`, or `none`.
fn describe_offered(methods: &[OfferedAuth]) -> String {
    if methods.is_empty() {
        return "none".into();
    }
    methods
        .iter()
        .map(|m| format!("{} ({:?})", m.id, m.name))
        .collect::<Vec<_>>()
        .join(", ")
}

/// What the agent said at `initialize`.
#[derive(Debug, Clone, Default)]
pub struct Launched {
    /// Process id (and process group id) of the agent.
    pub pid: u32,
    /// `agentInfo.name`, when given.
    pub name: String,
    /// `agentInfo.version`, when given.
    pub version: String,
    /// `agentCapabilities.loadSession`.
    pub load_session: bool,
    /// `agentCapabilities.sessionCapabilities.resume` is present.
    pub resume_session: bool,
    /// `authMethods` the agent offered.
    pub auth_methods: Vec<OfferedAuth>,
    /// The method `authenticate` succeeded with, if one was called.
    pub authenticated_with: Option<String>,
}

/// What [`AgentManager::prompt`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompted {
    /// The turn's id (the caller's, or a generated one).
    pub turn_id: String,
    /// The id the reply's chunks carry.
    pub message_id: String,
    /// The turn id was known: nothing was started.
    pub already_accepted: bool,
    /// With `already_accepted`: the known turn has ended.
    pub turn_ended: bool,
    /// The agentctl instance that accepted the turn.
    pub accepted_by: String,
    /// How far the turn got.
    pub phase: Phase,
    /// With `turn_ended`: the cursor of its `TurnEnded`.
    pub end_cursor: u64,
}

/// A snapshot for Health and Capabilities.
#[derive(Debug, Clone)]
pub struct Status {
    /// Current agent state.
    pub state: AgentState,
    /// How the last agent ended, when it has.
    pub exit: Option<AgentExit>,
    /// The profile's claim at the last launch.
    pub profile_claim: bool,
    /// `loadSession` from the last successful `initialize`.
    pub agent_load_session: Option<bool>,
    /// `sessionCapabilities.resume` from the last successful `initialize`.
    pub agent_resume_session: Option<bool>,
    /// `promptCapabilities` from the last successful `initialize`.
    pub prompt_caps: Option<PromptCapabilities>,
    /// The ACP session the agent has open, if any.
    pub session: Option<String>,
    /// Lines the last launched agent wrote (see [`Signs`]).
    pub activity: u64,
    /// CPU time of the last launched agent's tree, in milliseconds.
    pub cpu_ms: u64,
    /// Its wait for a CPU, in milliseconds; `None` where none is counted.
    pub cpu_wait_ms: Option<u64>,
    /// A `resume_session` is in progress.
    pub resuming: bool,
    /// History updates dropped so far by the `resume_session` in progress.
    pub replayed: u64,
}

/// How [`AgentManager::resume_session`] reopened the conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reopened {
    /// ACP `session/resume`: nothing replayed.
    Resume,
    /// ACP `session/load`: the agent replayed the history.
    Load,
}

/// What [`AgentManager::resume_session`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resumed {
    /// The ACP session now open.
    pub token: String,
    /// The ACP call that reopened it.
    pub method: Reopened,
    /// History updates the agent replayed (dropped, not re-emitted).
    pub replayed: u64,
}

#[derive(Debug)]
struct Running {
    pid: u32,
    conn: Option<ConnectionTo<Agent>>,
    exit_rx: watch::Receiver<Option<AgentExit>>,
    /// Dropping it ends the ACP connection's foreground.
    _close: oneshot::Sender<()>,
}

#[derive(Debug, Clone)]
struct Turn {
    turn_id: String,
    message_id: String,
    session: SessionId,
}

/// A turn [`AgentManager::hold_prompt`] journaled and keeps back.
#[derive(Debug, Clone)]
struct Held {
    turn_id: String,
    message_id: String,
}

#[derive(Debug)]
struct Slot {
    generation: u64,
    state: AgentState,
    exit: Option<AgentExit>,
    profile_claim: bool,
    agent_load_session: Option<bool>,
    agent_resume_session: Option<bool>,
    /// What a prompt may carry besides text (the agent's `initialize`).
    prompt_caps: Option<PromptCapabilities>,
    /// Signs of life of the last launched agent.
    signs: Option<Arc<Signs>>,
    /// What the current agent offered at `initialize`, for error messages.
    auth_methods: Vec<OfferedAuth>,
    /// The current agent's permission policy.
    policy: PermissionPolicy,
    running: Option<Running>,
    session: Option<SessionId>,
    /// The conversation `new_session` opened in this agent process, until
    /// it is prompted: a `NewSession` while it is still the open one is
    /// the same request again (its answer was lost with the backend that
    /// asked), and gets it instead of a second conversation.
    opened: Option<SessionId>,
    /// What reopened `session` in this agent process (a `resume_session`):
    /// another resume of the same conversation (a second backend's, or the
    /// same call retried after its backend died) answers it again instead
    /// of making the agent load the history twice.
    reopened: Option<Resumed>,
    turn: Option<Turn>,
    /// A turn journaled as accepted by [`AgentManager::hold_prompt`] and
    /// not handed to any agent: the Prompt of the same turn id starts it
    /// without journaling it again. Replaced by the next turn held or
    /// prompted (its journal line then stays `accepted`: never handed).
    held: Option<Held>,
    /// A `session/resume` or `session/load` is in flight for this session:
    /// whatever it replays is dropped instead of being reported as new
    /// messages.
    replaying: Option<SessionId>,
    /// Updates dropped during the current (or last) resume.
    replayed: u64,
    /// Turns started by this process or (read from the journal) earlier
    /// agentctl processes of this executor, oldest first, at most
    /// [`REMEMBERED_TURNS`]. Kept across agent relaunches, so a Prompt
    /// re-sent for a turn an earlier agent got is not run again.
    turns: VecDeque<TurnRecord>,
    /// Marker of the running agent's process tree (see [`tree`]).
    marker: String,
    /// The session modes the agent offered for `session` (ACP session
    /// modes, from `session/new` / `session/load`), the current one kept up
    /// to date by `set_mode` and the agent's own `current_mode_update`.
    modes: Option<SessionModeState>,
    /// The activity parts of the turn in progress.
    parts: Parts,
    /// How long an `ask` permission request waits.
    permission_timeout: Duration,
    /// `ask` permission requests waiting for an answer, by request id.
    /// Dropping one (agent exit, turn cancelled) answers it `cancelled`.
    asks: HashMap<String, Ask>,
    /// Kinds of unparseable updates already logged (method and error).
    unparsed_logged: HashSet<String>,
    /// What the current agent process reported it used and cost.
    usage: UsageTrack,
    /// The current agent offers `session/close` (`sessionCapabilities.close`).
    agent_close_session: bool,
    /// Config option values the profile sets on a new conversation.
    config_defaults: std::collections::BTreeMap<String, String>,
    /// MCP servers the profile gives the agent.
    mcp_servers: crate::config::McpServers,
    /// What MCP transports the current agent takes (its initialize answer).
    mcp_caps: agent_client_protocol::v1::schema::McpCapabilities,
    /// The open conversation's ACP config options, as the agent last
    /// described them (session/new, load, resume answers, its
    /// `config_option_update`s, a set's answer).
    config: Option<Vec<SessionConfigOption>>,
}

#[derive(Debug)]
struct Shared {
    workspace: Arc<WorkspaceSlot>,
    updates: Arc<UpdateLog>,
    /// The agent's ACP terminals.
    terminals: Terminals,
    policy: PermissionPolicy,
    slot: Mutex<Slot>,
    ops: tokio::sync::Mutex<()>,
    journal: Journal,
    /// The journal was created by this process (see the proto's Health).
    journal_fresh: bool,
    /// Test hook: the crash point at which this process SIGKILLs itself.
    crash_at: Option<CrashHook>,
    /// The backend's socket rung when the agent exits, and our executor id.
    doorbell: Option<(std::path::PathBuf, String)>,
}

/// Test hook for deterministic crash tests: the point of a turn at which
/// agentctl SIGKILLs itself (`NAME`, or `NAME:TEXT` for the prompt `TEXT`
/// only, so a test can run earlier turns through the same process).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CrashHook {
    pub at: String,
    /// Fire only while this marker file does not exist, creating it first:
    /// a backend that relaunches agentctl with the same environment (a local
    /// process, a restarted container) must not crash it again at the turn
    /// it delivers after recovery.
    pub once: Option<std::path::PathBuf>,
}

/// Owns the agent process and the ACP connection to it.
#[derive(Debug, Clone)]
pub struct AgentManager {
    shared: Arc<Shared>,
}

impl Shared {
    fn slot(&self) -> MutexGuard<'_, Slot> {
        self.slot
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// [`acp_error`], and for ACP's "authentication required" a message
    /// naming what the agent offered and the profile key to set.
    fn acp_error(&self, what: &str, e: &agent_client_protocol::Error) -> Error {
        if e.code == ErrorCode::AUTH_REQUIRED {
            let offered = describe_offered(&self.slot().auth_methods);
            return Error::FailedPrecondition(format!(
                "{what}: the agent requires authentication ({}); it offers the auth methods: {offered}; set `auth_method` in the agent profile (sessiond config `[[agents]] auth_method = \"...\"`) to one of them and give the environment it needs in the profile's `env`",
                e.message
            ));
        }
        acp_error(what, e)
    }
}

/// ACP `initialize` failed. The SDK checks the protocol version the agent
/// selected itself and reports a mismatch as JSON-RPC -32600, which must
/// not read as if the agent had answered with an error.
fn initialize_error(e: &agent_client_protocol::Error) -> Error {
    let data = e.data.as_ref().map(ToString::to_string).unwrap_or_default();
    if e.code == ErrorCode::INVALID_REQUEST && data.contains("protocol version") {
        return Error::FailedPrecondition(format!(
            "the agent's ACP protocol version is not supported: agentctl speaks ACP protocol version 1 and rejected the agent's initialize answer ({}); use a version of the agent that speaks ACP v1",
            data.trim_matches('"')
        ));
    }
    acp_error("ACP initialize", e)
}

impl Slot {
    /// Changes state and reports it, if it changed.
    fn set_state(&mut self, updates: &UpdateLog, state: AgentState) {
        if self.state != state {
            self.state = state;
            updates.push(Kind::StateChanged(AgentStateChanged {
                state: state as i32,
            }));
        }
    }

    /// The answer to a Prompt for `turn_id` when it must start nothing:
    /// this process accepted it, or an earlier one handed it to an agent.
    /// A turn an earlier process accepted but never handed to an agent is
    /// not known: it provably reached no agent and may run now.
    fn known_turn(&self, turn_id: &str, instance: &str) -> Option<Prompted> {
        if turn_id.is_empty() {
            return None;
        }
        self.turns
            .iter()
            .rev()
            .find(|t| t.turn_id == turn_id)
            .filter(|t| t.instance == instance || t.phase != Phase::Accepted)
            .map(|t| Prompted {
                turn_id: t.turn_id.clone(),
                message_id: t.message_id.clone(),
                already_accepted: true,
                turn_ended: t.phase == Phase::Ended,
                accepted_by: t.instance.clone(),
                phase: t.phase,
                end_cursor: t.end_cursor,
            })
    }

    /// Marks a remembered turn of this process with `phase`.
    fn set_phase(&mut self, turn_id: &str, instance: &str, phase: Phase, cursor: u64) {
        if let Some(t) = self
            .turns
            .iter_mut()
            .rev()
            .find(|t| t.turn_id == turn_id && t.instance == instance)
        {
            t.phase = phase;
            t.end_cursor = cursor;
        }
    }

    fn is_alive(&self) -> bool {
        matches!(
            self.state,
            AgentState::Starting | AgentState::Ready | AgentState::Busy
        )
    }

    /// Whether a turn with `blocks` can start now (a running agent, no
    /// turn in progress, an open conversation taking such blocks): its
    /// connection and conversation, else FAILED_PRECONDITION or
    /// INVALID_ARGUMENT saying why. Prompt's and HoldPrompt's check.
    fn ready_for_turn(&self, blocks: &[ContentBlock]) -> Result<(ConnectionTo<Agent>, SessionId)> {
        let conn = self.connection()?;
        if self.state == AgentState::Busy {
            return Err(Error::FailedPrecondition(
                "a turn is already in progress; wait for TurnEnded or Cancel".into(),
            ));
        }
        let Some(session) = self.session.clone() else {
            return Err(Error::FailedPrecondition(
                "no session; call NewSession or ResumeSession first".into(),
            ));
        };
        crate::prompt::check_capabilities(blocks, self.prompt_caps.as_ref())?;
        Ok((conn, session))
    }

    /// The connection of a running, initialized agent.
    fn connection(&self) -> Result<ConnectionTo<Agent>> {
        match (&self.state, &self.running) {
            (AgentState::Ready | AgentState::Busy, Some(Running { conn: Some(c), .. })) => {
                Ok(c.clone())
            }
            (AgentState::Starting, _) => Err(Error::FailedPrecondition(
                "the agent is still starting (ACP initialize not answered)".into(),
            )),
            _ => Err(Error::FailedPrecondition(
                "no agent is running; call LaunchAgent first".into(),
            )),
        }
    }
}

fn exit_of(status: std::process::ExitStatus) -> AgentExit {
    use std::os::unix::process::ExitStatusExt;
    AgentExit {
        code: status.code(),
        signal: status.signal(),
    }
}

fn describe_exit(exit: &AgentExit) -> String {
    match (exit.code, exit.signal) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => format!("signal {s}"),
        (None, None) => "unknown status".into(),
    }
}

fn stop_reason_name(r: StopReason) -> String {
    serde_json::to_value(r)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_else(|| format!("{r:?}"))
}

/// How long an agent whose output closed during `initialize` is given to
/// be seen exiting, so its exit status is what the error says.
const EXIT_AFTER_CLOSE: Duration = Duration::from_secs(2);

fn acp_error(what: &str, e: &agent_client_protocol::Error) -> Error {
    if agent_client_protocol::is_connection_terminated(e)
        || agent_client_protocol::is_incoming_transport_closed(e)
    {
        return Error::Unavailable(format!("{what}: the agent's connection closed"));
    }
    let detail = match &e.data {
        Some(d) => format!("{} ({d})", e.message),
        None => e.message.clone(),
    };
    if e.code == ErrorCode::RESOURCE_NOT_FOUND {
        Error::NotFound(format!("{what}: {detail}"))
    } else if e.code == ErrorCode::INVALID_PARAMS {
        Error::InvalidArgument(format!("{what}: {detail}"))
    } else {
        Error::Agent(format!(
            "{what}: agent answered error {}: {detail}",
            e.code.value()
        ))
    }
}

impl AgentManager {
    /// A manager with no agent and no journal.
    pub fn new(
        workspace: Arc<WorkspaceSlot>,
        updates: Arc<UpdateLog>,
        policy: PermissionPolicy,
    ) -> Self {
        Self::with_journal(
            workspace,
            updates,
            policy,
            Journal::none(),
            Loaded::default(),
            None,
        )
    }

    /// A manager with no agent, recording turns in `journal`, knowing the
    /// turns earlier processes recorded there (`loaded`). `crash_at` is a test hook:
    /// the process SIGKILLs itself at that point of a turn
    /// (`after-accepted`: recorded, Prompt not answered; `after-handed`:
    /// recorded as handed, the agent not yet sent it).
    pub fn with_journal(
        workspace: Arc<WorkspaceSlot>,
        updates: Arc<UpdateLog>,
        policy: PermissionPolicy,
        journal: Journal,
        loaded: Loaded,
        crash_at: Option<CrashHook>,
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                workspace,
                terminals: Terminals::new(updates.clone()),
                updates,
                policy,
                slot: Mutex::new(Slot {
                    generation: 0,
                    state: AgentState::None,
                    exit: None,
                    profile_claim: false,
                    agent_load_session: None,
                    agent_resume_session: None,
                    prompt_caps: None,
                    signs: None,
                    auth_methods: Vec::new(),
                    policy,
                    running: None,
                    session: None,
                    opened: None,
                    reopened: None,
                    turn: None,
                    held: None,
                    replaying: None,
                    replayed: 0,
                    turns: loaded.turns,
                    marker: String::new(),
                    modes: None,
                    parts: Parts::default(),
                    permission_timeout: DEFAULT_PERMISSION_TIMEOUT,
                    asks: HashMap::new(),
                    unparsed_logged: HashSet::new(),
                    usage: UsageTrack::default(),
                    agent_close_session: false,
                    config: None,
                    config_defaults: Default::default(),
                    mcp_servers: Default::default(),
                    mcp_caps: Default::default(),
                }),
                ops: tokio::sync::Mutex::new(()),
                journal_fresh: journal.is_durable() && loaded.fresh,
                journal,
                crash_at,
                doorbell: None,
            }),
        }
        .report_dead_permissions(loaded.permissions)
        .report_orphan_turn()
    }

    /// Rings `doorbell` (a Unix datagram socket of the backend) with
    /// `executor_id` whenever the agent exits. Call before sharing.
    #[must_use]
    pub fn with_doorbell(
        mut self,
        doorbell: Option<std::path::PathBuf>,
        executor_id: String,
    ) -> Self {
        match (Arc::get_mut(&mut self.shared), doorbell) {
            (Some(shared), Some(path)) => shared.doorbell = Some((path, executor_id)),
            (None, Some(_)) => tracing::warn!("doorbell set on a shared agent manager; ignored"),
            _ => {}
        }
        self
    }

    /// Permission requests an earlier agentctl process journaled and never
    /// resolved: it died waiting, and its agent with it, so each is put on
    /// this process's stream as `cancelled` (the backend clears its prompt)
    /// and journaled resolved.
    fn report_dead_permissions(self, pending: Vec<crate::journal::PermissionRecord>) -> Self {
        let instance = self.shared.updates.instance_id().to_owned();
        for p in pending {
            let mut part = activity::permission_part(&p.turn_id, &p.request_id, p.part);
            activity::permission_resolved(
                &mut part,
                "cancelled",
                None,
                "agentctl exited while the request waited (its agent exited with it)",
            );
            tracing::info!(request_id = %p.request_id, "permission request of an earlier agentctl process reported cancelled");
            self.shared.updates.push(Kind::Activity(part));
            if let Err(e) = self
                .shared
                .journal
                .permission_resolved(&p.request_id, &instance)
            {
                tracing::warn!(request_id = %p.request_id, error = %e, "could not journal the permission request's end");
            }
        }
        self
    }

    /// The last turn of an earlier agentctl process, if it handed it to its
    /// agent: that process died, and its agent with it, so whatever the
    /// turn did that the backend had not read (its end, or all of it) is
    /// gone. The backend may never have recorded the turn at all (it stores
    /// a turn while the Prompt runs), so it is put on this process's stream
    /// as `TurnStarted` with `earlier_instance`, from the journal's text; a
    /// backend that has the turn ignores it. Only the last: turns run one
    /// at a time, and each is recorded before the next is sent.
    fn report_orphan_turn(self) -> Self {
        let instance = self.shared.updates.instance_id().to_owned();
        let orphan = {
            let mut slot = self.shared.slot();
            let orphan = slot
                .turns
                .back_mut()
                .filter(|t| {
                    t.instance != instance && t.phase != Phase::Accepted && !t.text.is_empty()
                })
                .map(|t| (t.turn_id.clone(), std::mem::take(&mut t.text), t.phase));
            // Texts are for this report only.
            for t in &mut slot.turns {
                t.text = String::new();
            }
            orphan
        };
        if let Some((turn_id, text, phase)) = orphan {
            tracing::info!(%turn_id, ?phase, "the last turn of an earlier agentctl process; reported");
            self.shared.updates.push(Kind::TurnStarted(TurnStarted {
                turn_id,
                text,
                blocks: 0,
                earlier_instance: true,
                ended: phase == Phase::Ended,
            }));
        }
        self
    }

    /// The newest turn this process or its journal knows (empty: none).
    pub fn last_turn_id(&self) -> String {
        self.shared
            .slot()
            .turns
            .back()
            .map(|t| t.turn_id.clone())
            .unwrap_or_default()
    }

    /// Current state, for Health and Capabilities. Reads the agent's CPU
    /// time from `/proc` while it runs.
    pub fn status(&self) -> Status {
        let (mut status, signs, alive) = {
            let slot = self.shared.slot();
            let resuming = slot.replaying.is_some();
            let status = Status {
                state: slot.state,
                exit: slot.exit,
                profile_claim: slot.profile_claim,
                agent_load_session: slot.agent_load_session,
                agent_resume_session: slot.agent_resume_session,
                prompt_caps: slot.prompt_caps.clone(),
                session: slot.session.as_ref().map(|s| s.0.to_string()),
                activity: 0,
                cpu_ms: 0,
                cpu_wait_ms: None,
                resuming,
                replayed: if resuming { slot.replayed } else { 0 },
            };
            (status, slot.signs.clone(), slot.running.is_some())
        };
        if let Some(signs) = signs {
            status.activity = signs.lines();
            let used = if alive { signs.sample() } else { signs.last() };
            status.cpu_ms = used.cpu_ms;
            status.cpu_wait_ms = used.wait_ms;
        }
        status
    }

    /// Signs of life of the running agent (of the last launch when none runs).
    fn signs(&self) -> Result<Arc<Signs>> {
        self.shared
            .slot()
            .signs
            .clone()
            .ok_or_else(|| Error::FailedPrecondition("no agent was launched".into()))
    }

    /// Spawns the agent and runs ACP `initialize`.
    pub async fn launch(&self, spec: LaunchSpec) -> Result<Launched> {
        let _op = self.shared.ops.lock().await;
        if spec.command.is_empty() {
            return Err(Error::InvalidArgument("command is empty".into()));
        }
        if spec.command.contains('\0') || spec.args.iter().any(|a| a.contains('\0')) {
            return Err(Error::InvalidArgument(
                "command and arguments must not contain NUL bytes".into(),
            ));
        }
        if spec
            .env
            .iter()
            .any(|(k, v)| k.is_empty() || k.contains(['\0', '=']) || v.contains('\0'))
        {
            return Err(Error::InvalidArgument(
                "invalid environment variable".into(),
            ));
        }
        {
            let slot = self.shared.slot();
            if slot.is_alive() {
                let pid = slot.running.as_ref().map_or(0, |r| r.pid);
                return Err(Error::FailedPrecondition(format!(
                    "an agent is already running (pid {pid}); call StopAgent first"
                )));
            }
        }
        let mut cmd = tokio::process::Command::new(&spec.command);
        cmd.args(&spec.args)
            .current_dir(self.shared.workspace.get()?.root())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // A small base plus the profile's variables, never agentctl's (or its
        // starter's) whole environment: the agent is prompt-injectable.
        explicit_env(&mut cmd, &spec.env);
        // Its own session (so its own process group), and a marker every
        // descendant inherits: the tree can be ended whole, even after
        // agentctl died (see `tree`).
        let marker = uuid::Uuid::new_v4().simple().to_string();
        cmd.env(tree::MARKER_ENV, &marker);
        sys::new_session(&mut cmd);
        // Dies with agentctl even when agentctl is SIGKILLed. This runs in an
        // async fn, so on a tokio worker thread (see the caveat there).
        sys::kill_on_parent_death(&mut cmd);
        let mut child = cmd
            .spawn()
            .map_err(|e| Error::io(format!("starting agent `{}`", spec.command), e))?;
        let pid = child.id().unwrap_or(0);
        let (Some(stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            let _ = sys::kill_group(pid, sys::SIGKILL);
            return Err(Error::Unavailable("agent stdio was not captured".into()));
        };
        tracing::info!(pid, command = %spec.command, "agent spawned");
        let record = AgentRecord {
            instance: self.shared.updates.instance_id().to_owned(),
            pid,
            start_time: tree::stat(pid).map_or(0, |(st, _)| st),
            marker: marker.clone(),
        };
        if let Err(e) = self.shared.journal.agent(&record) {
            let _ = sys::kill_group(pid, sys::SIGKILL);
            return Err(e);
        }
        let signs = Arc::new(Signs::new(record));

        let (exit_tx, exit_rx) = watch::channel(None);
        let (close_tx, close_rx) = oneshot::channel::<()>();
        let generation = {
            let mut slot = self.shared.slot();
            slot.generation += 1;
            slot.exit = None;
            slot.usage = UsageTrack::default();
            slot.profile_claim = spec.profile_supports_session_resume;
            slot.agent_load_session = None;
            slot.agent_resume_session = None;
            slot.prompt_caps = None;
            slot.agent_close_session = false;
            slot.signs = Some(signs.clone());
            slot.auth_methods = Vec::new();
            slot.policy = spec.permission_policy.unwrap_or(self.shared.policy);
            slot.config_defaults = spec.config_defaults.clone();
            slot.mcp_servers = spec.mcp_servers.clone();
            slot.permission_timeout = if spec.permission_timeout.is_zero() {
                DEFAULT_PERMISSION_TIMEOUT
            } else {
                spec.permission_timeout
            };
            slot.asks.clear();
            slot.session = None;
            slot.opened = None;
            slot.reopened = None;
            slot.modes = None;
            slot.config = None;
            slot.turn = None;
            slot.replaying = None;
            slot.marker = marker;
            slot.running = Some(Running {
                pid,
                conn: None,
                exit_rx: exit_rx.clone(),
                _close: close_tx,
            });
            slot.set_state(&self.shared.updates, AgentState::Starting);
            slot.generation
        };

        // Agent stderr goes to our log, line by line (a long one cut);
        // each line is a sign of life.
        let stderr_signs = signs.clone();
        tokio::spawn(async move {
            let mut reader = BufReader::new(stderr);
            let mut buf = Vec::new();
            let mut budget = stdio::LogBudget::default();
            while let Ok(Some(line)) =
                stdio::next_line(&mut reader, &mut buf, stdio::MAX_LOG_LINE).await
            {
                stderr_signs.line();
                let shown = match &line {
                    stdio::Line::TooLong { head, .. } => head.len(),
                    _ => line.shown().len(),
                };
                let (log, skipped) = budget.admit(shown);
                if skipped > 0 {
                    tracing::info!(target: "agent_stderr", pid, skipped,
                        "({skipped} lines of the agent's stderr not logged: over {} lines or {} bytes a second)",
                        stdio::STDERR_LINES_PER_SECOND, stdio::STDERR_BYTES_PER_SECOND);
                }
                if !log {
                    continue;
                }
                match &line {
                    stdio::Line::TooLong { len, head } => {
                        tracing::info!(target: "agent_stderr", pid, "{head}… ({len} bytes, cut)");
                    }
                    _ => tracing::info!(target: "agent_stderr", pid, "{}", line.shown()),
                }
            }
        });
        // Exit watcher: the only place the child is reaped.
        let shared = self.shared.clone();
        tokio::spawn(async move {
            let exit = match child.wait().await {
                Ok(status) => exit_of(status),
                Err(e) => {
                    tracing::warn!(pid, error = %e, "waiting for agent failed");
                    AgentExit::default()
                }
            };
            tracing::info!(pid, exit = %describe_exit(&exit), "agent exited");
            if on_exit(&shared, generation, exit) {
                // Its terminals end with it (their processes were in its
                // tree); the parts say they were released.
                shared.terminals.release_all().await;
            }
            let _ = exit_tx.send(Some(exit));
        });

        let (conn_tx, conn_rx) = oneshot::channel();
        let shared = self.shared.clone();
        let transport = lines_transport(pid, stdin, stdout, signs.clone());
        tokio::spawn(async move {
            let result = run_connection(shared, generation, transport, conn_tx, close_rx).await;
            if let Err(e) = result {
                tracing::info!(pid, error = ?e, "ACP connection ended");
            }
        });

        let silence = if spec.initialize_timeout.is_zero() {
            DEFAULT_INITIALIZE_TIMEOUT
        } else {
            spec.initialize_timeout
        };
        let init = async {
            let conn = conn_rx
                .await
                .map_err(|_| Error::Unavailable("ACP connection did not start".into()))?;
            let request = InitializeRequest::new(ProtocolVersion::V1)
                .client_capabilities(
                    ClientCapabilities::new()
                        .fs(FileSystemCapabilities::new()
                            .read_text_file(true)
                            .write_text_file(true))
                        .terminal(true)
                        .elicitation(
                            ElicitationCapabilities::new()
                                .form(ElicitationFormCapabilities::new())
                                .url(ElicitationUrlCapabilities::new()),
                        ),
                )
                .client_info(Implementation::new("agentctl", env!("CARGO_PKG_VERSION")));
            let resp = conn
                .send_request(request)
                .block_task()
                .await
                .map_err(|e| initialize_error(&e))?;
            let offered: Vec<OfferedAuth> = resp.auth_methods.iter().map(offered_auth).collect();
            let authenticated_with = match spec.auth_method.as_deref().filter(|m| !m.is_empty()) {
                None => None,
                Some(method) => {
                    if !offered.iter().any(|m| m.id == method) {
                        return Err(Error::FailedPrecondition(format!(
                            "the profile's auth_method {method:?} is not offered by the agent; it offers: {}; set the profile's auth_method to one of them (or remove it)",
                            describe_offered(&offered)
                        )));
                    }
                    conn.send_request(AuthenticateRequest::new(method.to_owned()))
                        .block_task()
                        .await
                        .map_err(|e| {
                            let err = acp_error(&format!("ACP authenticate with {method:?}"), &e);
                            match err {
                                Error::Unavailable(_) => err,
                                other => Error::FailedPrecondition(format!(
                                    "{other}; check the environment this auth method needs (e.g. the API key in the profile's env)"
                                )),
                            }
                        })?;
                    tracing::info!(pid, method, "agent authenticated");
                    Some(method.to_owned())
                }
            };
            Ok::<_, Error>((conn, resp, offered, authenticated_with))
        };
        let mut exit_wait = exit_rx.clone();
        let outcome = tokio::select! {
            r = signs::until_silent(&signs, silence, signs::SETUP_CAP, init) => match r {
                Ok(r) => r,
                Err(cut) => Err(Error::DeadlineExceeded(cut.describe("ACP initialize"))),
            },
            exit = exit_wait.wait_for(Option::is_some) => {
                let exit = exit.ok().and_then(|e| *e).unwrap_or_default();
                Err(Error::Unavailable(format!(
                    "the agent exited during ACP initialize ({})",
                    describe_exit(&exit)
                )))
            }
        };
        // An agent that exits closes its output before its exit is seen:
        // say how it exited rather than that its connection closed
        // (helper-39 10).
        let outcome = match outcome {
            Err(Error::Unavailable(m)) if m.ends_with("the agent's connection closed") => {
                let mut exit_wait = exit_rx.clone();
                let exited =
                    tokio::time::timeout(EXIT_AFTER_CLOSE, exit_wait.wait_for(Option::is_some))
                        .await;
                match exited {
                    Ok(Ok(exit)) => Err(Error::Unavailable(format!(
                        "the agent exited during ACP initialize ({})",
                        describe_exit(&(*exit).unwrap_or_default())
                    ))),
                    _ => Err(Error::Unavailable(m)),
                }
            }
            other => other,
        };
        match outcome {
            Ok((conn, resp, auth_methods, authenticated_with)) => {
                let load_session = resp.agent_capabilities.load_session;
                let resume_session = resp
                    .agent_capabilities
                    .session_capabilities
                    .resume
                    .is_some();
                let (name, version) = resp
                    .agent_info
                    .map(|i| (i.name, i.version))
                    .unwrap_or_default();
                let mut slot = self.shared.slot();
                if slot.generation != generation || slot.state != AgentState::Starting {
                    return Err(Error::Unavailable(
                        "the agent exited right after ACP initialize".into(),
                    ));
                }
                if let Some(r) = slot.running.as_mut() {
                    r.conn = Some(conn);
                }
                slot.agent_load_session = Some(load_session);
                slot.agent_resume_session = Some(resume_session);
                slot.prompt_caps = Some(resp.agent_capabilities.prompt_capabilities.clone());
                slot.agent_close_session =
                    resp.agent_capabilities.session_capabilities.close.is_some();
                slot.mcp_caps = resp.agent_capabilities.mcp_capabilities.clone();
                slot.auth_methods = auth_methods.clone();
                slot.set_state(&self.shared.updates, AgentState::Ready);
                tracing::info!(pid, %name, %version, load_session, resume_session, activity = signs.lines(), cpu_ms = signs.sample().cpu_ms, "agent initialized");
                Ok(Launched {
                    pid,
                    name,
                    version,
                    load_session,
                    resume_session,
                    auth_methods,
                    authenticated_with,
                })
            }
            Err(e) => {
                tracing::warn!(pid, error = %e, "agent launch failed; stopping it");
                self.stop_pid(pid, exit_rx, Duration::from_millis(500))
                    .await;
                Err(e)
            }
        }
    }

    /// Opens a new ACP session; its id is the resume token.
    pub async fn new_session(&self) -> Result<String> {
        let _op = self.shared.ops.lock().await;
        let conn = {
            let slot = self.shared.slot();
            if slot.state == AgentState::Busy {
                return Err(Error::FailedPrecondition("a turn is in progress".into()));
            }
            // A backend killed while this agent opened its conversation
            // (or after, before it stored the answer) asks again: one
            // conversation per agent, not one more agent-side session
            // (the Claude Code adapter runs a CLI process per conversation).
            if let Some(open) = slot
                .opened
                .as_ref()
                .filter(|o| slot.session.as_ref() == Some(*o))
            {
                tracing::info!(session = %open, "session/new asked again before the conversation it opened was prompted: answering that one");
                return Ok(open.0.to_string());
            }
            slot.connection()?
        };
        let signs = self.signs()?;
        let mcp = {
            let slot = self.shared.slot();
            slot.mcp_servers.check(&slot.mcp_caps)?;
            slot.mcp_servers.0.clone()
        };
        let request = NewSessionRequest::new(self.shared.workspace.get()?.root().to_path_buf())
            .mcp_servers(mcp);
        let resp = signs::until_silent(
            &signs,
            SESSION_SETUP_SILENCE,
            signs::SETUP_CAP,
            conn.send_request(request).block_task(),
        )
        .await
        .map_err(|cut| Error::DeadlineExceeded(cut.describe("ACP session/new")))?
        .map_err(|e| self.shared.acp_error("ACP session/new", &e))?;
        let id = resp.session_id;
        let defaults = {
            let mut slot = self.shared.slot();
            slot.session = Some(id.clone());
            slot.opened = Some(id.clone());
            slot.reopened = None;
            slot.modes = resp.modes;
            slot.config = resp.config_options;
            slot.config_defaults.clone()
        };
        // The profile's values, in a new conversation only. The ops lock
        // is ours already: set them as `set_config_option` would.
        for (config_id, value) in &defaults {
            let options = self.shared.slot().config.clone().unwrap_or_default();
            let acp_value =
                crate::config::value_for(&options, config_id, value).map_err(|e| match e {
                    Error::InvalidArgument(m) => Error::InvalidArgument(format!(
                        "the profile's config default {config_id} = {value}: {m}"
                    )),
                    other => other,
                })?;
            let resp = signs::until_silent(
                &signs,
                SESSION_SETUP_SILENCE,
                signs::SETUP_CAP,
                conn.send_request(SetSessionConfigOptionRequest::new(
                    id.clone(),
                    config_id.clone(),
                    acp_value,
                ))
                .block_task(),
            )
            .await
            .map_err(|cut| Error::DeadlineExceeded(cut.describe("ACP session/set_config_option")))?
            .map_err(|e| self.shared.acp_error("ACP session/set_config_option", &e))?;
            self.shared.slot().config = Some(resp.config_options);
            tracing::info!(session = %id, %config_id, %value, "config default set");
        }
        Ok(id.0.to_string())
    }

    /// Reopens the conversation `token` (from `new_session`): ACP
    /// `session/resume` when the agent offers it (nothing replayed), else
    /// `session/load`, also when the agent refuses `session/resume` as an
    /// unknown method. Whatever the agent replays meanwhile is dropped, not
    /// put on the update stream.
    pub async fn resume_session(&self, token: &str) -> Result<Resumed> {
        let _op = self.shared.ops.lock().await;
        if token.is_empty() {
            return Err(Error::InvalidArgument("resume_token is empty".into()));
        }
        let session = SessionId::new(token);
        let (conn, offers_resume, offers_load) = {
            let mut slot = self.shared.slot();
            let conn = slot.connection()?;
            if let Some(done) = slot.reopened.as_ref().filter(|r| r.token == token)
                && slot.session.as_ref() == Some(&session)
            {
                tracing::info!(session = %session, "the conversation is open already; not reopened");
                return Ok(done.clone());
            }
            if slot.state == AgentState::Busy {
                return Err(Error::FailedPrecondition("a turn is in progress".into()));
            }
            let offers_resume = slot.agent_resume_session == Some(true);
            let offers_load = slot.agent_load_session == Some(true);
            if !offers_resume && !offers_load {
                return Err(Error::FailedPrecondition(
                    "the agent does not support session resume (neither the ACP loadSession capability nor sessionCapabilities.resume); start a new session".into(),
                ));
            }
            if !slot.profile_claim {
                return Err(Error::FailedPrecondition(
                    "the agent profile does not claim session resume; start a new session".into(),
                ));
            }
            slot.replaying = Some(session.clone());
            slot.replayed = 0;
            (conn, offers_resume, offers_load)
        };
        let signs = self.signs()?;
        let cwd = self.shared.workspace.get()?.root().to_path_buf();
        let mcp = {
            let slot = self.shared.slot();
            slot.mcp_servers.check(&slot.mcp_caps)?;
            slot.mcp_servers.0.clone()
        };
        let reopen = async {
            if offers_resume {
                let request = ResumeSessionRequest::new(session.clone(), cwd.clone())
                    .mcp_servers(mcp.clone());
                let answer = signs::until_silent(
                    &signs,
                    SESSION_SETUP_SILENCE,
                    signs::SETUP_CAP,
                    conn.send_request(request).block_task(),
                )
                .await
                .map_err(|cut| Error::DeadlineExceeded(cut.describe("ACP session/resume")))?;
                match answer {
                    Ok(resp) => {
                        return Ok((Reopened::Resume, resp.modes, resp.config_options));
                    }
                    Err(e) if e.code == ErrorCode::METHOD_NOT_FOUND && offers_load => {
                        tracing::info!(session = %session, "the agent refused session/resume as an unknown method; loading instead");
                    }
                    Err(e) => {
                        return Err(self.shared.acp_error(
                            &format!("ACP session/resume of {token:?} was rejected"),
                            &e,
                        ));
                    }
                }
            }
            let request = LoadSessionRequest::new(session.clone(), cwd).mcp_servers(mcp);
            let resp = signs::until_silent(
                &signs,
                SESSION_SETUP_SILENCE,
                signs::SETUP_CAP,
                conn.send_request(request).block_task(),
            )
            .await
            .map_err(|cut| Error::DeadlineExceeded(cut.describe("ACP session/load")))?
            .map_err(|e| {
                self.shared
                    .acp_error(&format!("ACP session/load of {token:?} was rejected"), &e)
            })?;
            Ok((Reopened::Load, resp.modes, resp.config_options))
        };
        let result = reopen.await;
        let mut slot = self.shared.slot();
        slot.replaying = None;
        let (method, modes, config) = result?;
        let replayed = slot.replayed;
        match method {
            Reopened::Resume => {
                tracing::info!(session = %session, replayed, "session/resume done");
            }
            Reopened::Load => tracing::info!(
                session = %session,
                replayed,
                "session/load done; replayed history not re-emitted"
            ),
        }
        slot.session = Some(session);
        slot.modes = modes;
        slot.config = config;
        let resumed = Resumed {
            token: token.to_owned(),
            method,
            replayed,
        };
        slot.reopened = Some(resumed.clone());
        Ok(resumed)
    }

    /// Process id of the agent running now, if one runs.
    pub fn pid(&self) -> Option<u32> {
        self.shared.slot().running.as_ref().map(|r| r.pid)
    }

    /// The session modes of the open conversation, if the agent has modes.
    pub fn modes(&self) -> Option<SessionModeState> {
        self.shared.slot().modes.clone()
    }

    /// The open conversation's config options, if the agent has any.
    pub fn config_options(&self) -> Option<Vec<SessionConfigOption>> {
        self.shared.slot().config.clone()
    }

    /// ACP `session/set_config_option` of the open conversation, after
    /// checking the option and the value; returns the options as the agent
    /// answered (it may change others with it).
    pub async fn set_config_option(
        &self,
        config_id: &str,
        value: &str,
    ) -> Result<Vec<SessionConfigOption>> {
        let _op = self.shared.ops.lock().await;
        let (conn, session, options) = {
            let slot = self.shared.slot();
            let conn = slot.connection()?;
            let Some(session) = slot.session.clone() else {
                return Err(Error::FailedPrecondition(
                    "no conversation is open (NewSession or ResumeSession first)".into(),
                ));
            };
            (conn, session, slot.config.clone().unwrap_or_default())
        };
        let acp_value = crate::config::value_for(&options, config_id, value)?;
        let signs = self.signs()?;
        let resp = signs::until_silent(
            &signs,
            SESSION_SETUP_SILENCE,
            signs::SETUP_CAP,
            conn.send_request(SetSessionConfigOptionRequest::new(
                session,
                config_id.to_owned(),
                acp_value,
            ))
            .block_task(),
        )
        .await
        .map_err(|cut| Error::DeadlineExceeded(cut.describe("ACP session/set_config_option")))?
        .map_err(|e| self.shared.acp_error("ACP session/set_config_option", &e))?;
        // Every watcher sees the options as set, as for a mode, unless the
        // agent announced them during the call (that was the part).
        let announced = {
            let mut slot = self.shared.slot();
            let announced = slot.config.as_ref() == Some(&resp.config_options);
            slot.config = Some(resp.config_options.clone());
            announced
        };
        let update =
            SessionUpdate::ConfigOptionUpdate(ConfigOptionUpdate::new(resp.config_options.clone()));
        if !announced && let Some(part) = crate::activity::outside_turn(update) {
            self.shared.updates.push(Kind::Activity(part));
        }
        Ok(resp.config_options)
    }

    /// ACP `session/set_mode` of the open conversation; returns its modes
    /// with `mode_id` current.
    pub async fn set_mode(&self, mode_id: &str) -> Result<SessionModeState> {
        let _op = self.shared.ops.lock().await;
        let (conn, session, modes) = {
            let slot = self.shared.slot();
            let conn = slot.connection()?;
            let Some(session) = slot.session.clone() else {
                return Err(Error::FailedPrecondition(
                    "no conversation is open (NewSession or ResumeSession first)".into(),
                ));
            };
            (conn, session, slot.modes.clone())
        };
        let Some(modes) = modes else {
            return Err(Error::FailedPrecondition(
                "the agent offers no session modes".into(),
            ));
        };
        if !modes.available_modes.iter().any(|m| &*m.id.0 == mode_id) {
            let known: Vec<&str> = modes.available_modes.iter().map(|m| &*m.id.0).collect();
            return Err(Error::InvalidArgument(format!(
                "mode_id: the agent has no mode {mode_id:?}; its modes are {}",
                known.join(", ")
            )));
        }
        let signs = self.signs()?;
        signs::until_silent(
            &signs,
            SESSION_SETUP_SILENCE,
            signs::SETUP_CAP,
            conn.send_request(SetSessionModeRequest::new(session, mode_id.to_owned()))
                .block_task(),
        )
        .await
        .map_err(|cut| Error::DeadlineExceeded(cut.describe("ACP session/set_mode")))?
        .map_err(|e| self.shared.acp_error("ACP session/set_mode", &e))?;
        let (modes, announced) = {
            let mut slot = self.shared.slot();
            let mut modes = slot.modes.clone().unwrap_or(modes);
            let announced = *modes.current_mode_id.0 == *mode_id;
            modes.current_mode_id = SessionModeId::new(mode_id);
            slot.modes = Some(modes.clone());
            (modes, announced)
        };
        // On the update stream as if the agent had said it (agents seldom
        // announce a mode the client set): every watcher of the session
        // sees the new mode, not only the caller. One the agent announced
        // during the call was the part already; one it announces later is
        // a repeat (`on_session_update`).
        let update = SessionUpdate::CurrentModeUpdate(CurrentModeUpdate::new(mode_id.to_owned()));
        if !announced && let Some(part) = crate::activity::outside_turn(update) {
            self.shared.updates.push(Kind::Activity(part));
        }
        Ok(modes)
    }

    /// Journals turn `turn_id` as accepted and keeps it back: the
    /// agent is sent nothing until [`Self::prompt`] is called with the same
    /// turn id, which then starts it without journaling it again. A backend
    /// calls this while its own record of the turn is being committed, so
    /// the journal's write is not on its turn's critical path; if the
    /// backend never prompts the turn (it crashed before its commit), the
    /// turn reaches no agent, and the journal says so.
    ///
    /// Checked as a Prompt is (a turn in progress, no conversation, the
    /// blocks the agent takes); a known turn id holds nothing and answers
    /// as [`Self::prompt`] would. Needs the journal (FAILED_PRECONDITION
    /// without one: there is nothing to gain).
    pub fn hold_prompt(
        &self,
        text: &str,
        blocks: &[ContentBlock],
        turn_id: String,
    ) -> Result<Prompted> {
        if turn_id.is_empty() {
            return Err(Error::InvalidArgument(
                "turn_id: a held turn needs the id its Prompt will name".into(),
            ));
        }
        if !self.shared.journal.is_durable() {
            return Err(Error::FailedPrecondition(
                "this agentctl keeps no turn journal (--journal): there is nothing to hold".into(),
            ));
        }
        if text.is_empty() && blocks.is_empty() {
            return Err(Error::InvalidArgument("prompt text is empty".into()));
        }
        let instance = self.shared.updates.instance_id().to_owned();
        let mut slot = self.shared.slot();
        if let Some(p) = slot.known_turn(&turn_id, &instance) {
            return Ok(p);
        }
        if let Some(h) = slot.held.as_ref().filter(|h| h.turn_id == turn_id) {
            return Ok(Prompted {
                turn_id,
                message_id: h.message_id.clone(),
                already_accepted: false,
                turn_ended: false,
                accepted_by: instance,
                phase: Phase::Accepted,
                end_cursor: 0,
            });
        }
        slot.ready_for_turn(blocks)?;
        let message_id = uuid::Uuid::now_v7().to_string();
        // Under the slot lock, as every accepted line: the journal's order
        // is the turns' order.
        self.shared
            .journal
            .accepted(&turn_id, &message_id, &instance, text)?;
        slot.held = Some(Held {
            turn_id: turn_id.clone(),
            message_id: message_id.clone(),
        });
        Ok(Prompted {
            turn_id,
            message_id,
            already_accepted: false,
            turn_ended: false,
            accepted_by: instance,
            phase: Phase::Accepted,
            end_cursor: 0,
        })
    }

    /// Starts one turn in the background. Idempotent by `turn_id`: a turn id
    /// this process already started (in progress or among the last
    /// [`REMEMBERED_TURNS`]) starts nothing and answers as the first call did.
    ///
    /// The turn is recorded in the journal as accepted before this returns
    /// (already done for a turn [`Self::hold_prompt`] kept back) and as
    /// handed (fsync, making both lines durable) before the agent is sent
    /// it. With `only_if_journaled` and no journal, nothing starts
    /// (FAILED_PRECONDITION).
    pub fn prompt(
        &self,
        text: String,
        blocks: Vec<ContentBlock>,
        turn_id: String,
        only_if_journaled: bool,
    ) -> Result<Prompted> {
        let instance = self.shared.updates.instance_id().to_owned();
        let known = self.shared.slot().known_turn(&turn_id, &instance);
        if let Some(p) = known {
            tracing::info!(turn_id = %p.turn_id, ended = p.turn_ended, accepted_by = %p.accepted_by,
                "Prompt for a turn already accepted; nothing started");
            return Ok(p);
        }
        if only_if_journaled && !self.shared.journal.is_durable() {
            return Err(Error::FailedPrecondition(
                "this agentctl keeps no turn journal (--journal), so it cannot tell whether an \
                 earlier agentctl process handed this turn to an agent; not starting it"
                    .into(),
            ));
        }
        if text.is_empty() && blocks.is_empty() {
            return Err(Error::InvalidArgument("prompt text is empty".into()));
        }
        let turn_id = if turn_id.is_empty() {
            uuid::Uuid::now_v7().to_string()
        } else {
            turn_id
        };
        let (conn, session, exit_rx, pid, message_id) = {
            let mut slot = self.shared.slot();
            // Checked again under this lock: a concurrent duplicate may
            // have started the turn since the check above.
            if let Some(p) = slot.known_turn(&turn_id, &instance) {
                return Ok(p);
            }
            let (conn, session) = slot.ready_for_turn(&blocks)?;
            let (exit_rx, pid) = slot
                .running
                .as_ref()
                .map(|r| (r.exit_rx.clone(), r.pid))
                .ok_or_else(|| Error::FailedPrecondition("no agent is running".into()))?;
            // Durable before anything else happens (under the slot lock, so
            // the journal's order is the turns' order; no turn runs now),
            // unless this turn was held: its accepted line is written.
            let message_id = match slot.held.take() {
                Some(h) if h.turn_id == turn_id => h.message_id,
                _ => {
                    let message_id = uuid::Uuid::now_v7().to_string();
                    self.shared
                        .journal
                        .accepted(&turn_id, &message_id, &instance, &text)?;
                    message_id
                }
            };
            // Ahead of everything the turn produces, under the slot lock: a
            // backend with no record of the turn records it from here.
            self.shared.updates.push(Kind::TurnStarted(TurnStarted {
                turn_id: turn_id.clone(),
                text: text.clone(),
                blocks: u32::try_from(blocks.len()).unwrap_or(u32::MAX),
                earlier_instance: false,
                ended: false,
            }));
            slot.parts = Parts::default();
            slot.usage.turn_started();
            // Prompted: a NewSession from now on means another conversation.
            slot.opened = None;
            slot.turn = Some(Turn {
                turn_id: turn_id.clone(),
                message_id: message_id.clone(),
                session: session.clone(),
            });
            slot.turns.retain(|t| t.turn_id != turn_id);
            slot.turns.push_back(TurnRecord {
                turn_id: turn_id.clone(),
                message_id: message_id.clone(),
                instance: instance.clone(),
                phase: Phase::Accepted,
                end_cursor: 0,
                text: String::new(),
            });
            while slot.turns.len() > REMEMBERED_TURNS {
                slot.turns.pop_front();
            }
            slot.set_state(&self.shared.updates, AgentState::Busy);
            (conn, session, exit_rx, pid, message_id)
        };
        self.crash_point("after-accepted", &text);
        let shared = self.shared.clone();
        let tid = turn_id.clone();
        let this = self.clone();
        // The agent's turn in the trace: a child of the Prompt call's span
        // (current here), open until the agent answers session/prompt.
        let turn_span = tracing::info_span!(
            "agent_turn",
            otel.name = "agent turn",
            turn_id = %turn_id,
            acp.stop_reason = tracing::field::Empty,
        );
        let task = async move {
            // Durable before the agent can see the prompt.
            let handed = {
                let mut slot = shared.slot();
                let still_ours = slot.turn.as_ref().is_some_and(|t| t.turn_id == tid);
                still_ours.then(|| {
                    let r = shared.journal.handed(&tid, &instance);
                    if r.is_ok() {
                        slot.set_phase(&tid, &instance, Phase::Handed, 0);
                    }
                    r
                })
            };
            match handed {
                None => return, // the agent exited meanwhile; the turn ended
                Some(Err(e)) => {
                    tracing::error!(turn_id = %tid, error = %e, "could not record the turn as handed; not sending it");
                    finish_turn(&shared, &tid, "error", &e.to_string(), None);
                    return;
                }
                Some(Ok(())) => {}
            }
            this.crash_point("after-handed", &text);
            // The turn's trace context, for an agent that traces: ACP's
            // convention is W3C keys at the root of `_meta`.
            let mut meta = serde_json::Map::new();
            sessiond_telemetry::inject_current(|k, v| {
                meta.insert(k.to_owned(), serde_json::Value::String(v));
            });
            let content = (!text.is_empty())
                .then(|| ContentBlock::Text(TextContent::new(text)))
                .into_iter()
                .chain(blocks)
                .collect();
            let request =
                PromptRequest::new(session, content).meta((!meta.is_empty()).then_some(meta));
            match conn.send_request(request).block_task().await {
                Ok(resp) => {
                    let reason = stop_reason_name(resp.stop_reason);
                    tracing::Span::current().record("acp.stop_reason", reason.as_str());
                    finish_turn(&shared, &tid, &reason, "", resp.usage.as_ref());
                }
                Err(e) => {
                    let err = shared.acp_error("ACP session/prompt", &e);
                    if matches!(err, Error::Unavailable(_)) {
                        // The agent is going away: let the exit watcher end
                        // the turn with the exit status; if stdout closed but
                        // the process lingers, end it.
                        let mut rx = exit_rx.clone();
                        let exited = tokio::time::timeout(
                            Duration::from_secs(3),
                            rx.wait_for(Option::is_some),
                        )
                        .await
                        .is_ok();
                        if !exited {
                            let _ = sys::kill_group(pid, sys::SIGKILL);
                        }
                    }
                    tracing::Span::current().record("acp.stop_reason", "error");
                    finish_turn(&shared, &tid, "error", &err.to_string(), None);
                }
            }
        };
        tokio::spawn(tracing::Instrument::instrument(task, turn_span));
        Ok(Prompted {
            turn_id,
            message_id,
            already_accepted: false,
            turn_ended: false,
            accepted_by: self.shared.updates.instance_id().to_owned(),
            phase: Phase::Accepted,
            end_cursor: 0,
        })
    }

    /// Whether turns are journaled durably, and whether this process
    /// created the journal.
    pub fn journaled(&self) -> (bool, bool) {
        (self.shared.journal.is_durable(), self.shared.journal_fresh)
    }

    /// Test hook: SIGKILLs this process at crash point `name` when asked to
    /// (see [`CrashHook`]).
    fn crash_point(&self, name: &str, text: &str) {
        let Some(hook) = &self.shared.crash_at else {
            return;
        };
        let hit = hook.at == name
            || hook
                .at
                .split_once(':')
                .is_some_and(|(n, t)| n == name && t == text);
        if !hit {
            return;
        }
        if let Some(marker) = &hook.once {
            // create_new: only the first process to get here crashes.
            let created = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(marker)
                .and_then(|f| f.sync_all());
            if created.is_err() {
                return;
            }
        }
        tracing::warn!(
            point = name,
            "crash point reached; killing agentctl (test hook)"
        );
        sys::kill_self();
    }

    /// Answers a pending `ask` permission request with one of its options;
    /// an elicitation with `accept` (and the form's values as a JSON
    /// object in `content_json`), `decline` or `cancel`.
    pub fn respond_permission(
        &self,
        request_id: &str,
        option_id: &str,
        content_json: &str,
    ) -> Result<()> {
        let mut slot = self.shared.slot();
        let Some(ask) = slot.asks.get(request_id) else {
            return Err(Error::NotFound(format!(
                "no permission request {request_id} is waiting (answered, timed out, cancelled, or asked of another agentctl process)"
            )));
        };
        if !ask.options.iter().any(|o| o == option_id) {
            return Err(Error::InvalidArgument(format!(
                "option_id {option_id:?} is not an option of permission request {request_id}; the agent offered: {}",
                ask.options.join(", ")
            )));
        }
        let content = match &ask.form {
            Some(form) if option_id == "accept" => Some(
                crate::elicit::form_values(content_json, form)
                    .map_err(|e| Error::InvalidArgument(format!("content_json: {e}")))?,
            ),
            _ => None,
        };
        let Some(ask) = slot.asks.remove(request_id) else {
            return Ok(());
        };
        let _ = ask.answer.send(Reply {
            option_id: option_id.to_owned(),
            content,
        });
        Ok(())
    }

    /// Sends ACP `session/cancel` for the turn in progress.
    pub fn cancel(&self) -> Result<bool> {
        let mut slot = self.shared.slot();
        let Some(session) = slot.turn.as_ref().map(|t| t.session.clone()) else {
            return Ok(false);
        };
        let conn = slot.connection()?;
        // ACP: a cancelled turn's pending permission requests are answered
        // `cancelled` (dropping them does).
        slot.asks.clear();
        conn.send_notification(CancelNotification::new(session.clone()))
            .map_err(|e| acp_error("ACP session/cancel", &e))?;
        drop(slot);
        // What the cancelled turn runs in terminals ends with it; the agent
        // may still read their output and release them.
        let shared = self.shared.clone();
        tokio::spawn(async move {
            let killed = shared.terminals.kill_session(&session.0).await;
            if killed > 0 {
                tracing::info!(killed, "killed the cancelled turn's terminals");
            }
        });
        Ok(true)
    }

    /// Ends the agent's process group: TERM, then KILL after `grace`.
    pub async fn stop(&self, grace: Duration) -> Option<AgentExit> {
        let (pid, exit_rx, close) = {
            let slot = self.shared.slot();
            match slot.running.as_ref() {
                Some(r) => {
                    // An agent that offers `session/close` is told first, so
                    // it can end the session's work and free what it holds.
                    let close = match (&r.conn, &slot.session) {
                        (Some(conn), Some(session)) if slot.agent_close_session => {
                            Some((conn.clone(), session.clone()))
                        }
                        _ => None,
                    };
                    (r.pid, r.exit_rx.clone(), close)
                }
                None => return slot.exit,
            }
        };
        if let Some((conn, session)) = close {
            let limit = if grace.is_zero() {
                DEFAULT_STOP_GRACE
            } else {
                grace
            }
            .min(CLOSE_LIMIT);
            let sent = conn
                .send_request(CloseSessionRequest::new(session.clone()))
                .block_task();
            match tokio::time::timeout(limit, sent).await {
                Ok(Ok(_)) => tracing::info!(%session, "session closed (ACP session/close)"),
                Ok(Err(e)) => {
                    tracing::warn!(%session, error = %e, "session/close failed; stopping the agent anyway")
                }
                Err(_) => {
                    tracing::warn!(%session, ?limit, "session/close unanswered; stopping the agent anyway")
                }
            }
        }
        let exit = self.stop_pid(pid, exit_rx, grace).await;
        self.shared.terminals.release_all().await;
        exit
    }

    /// Terminals the agent holds (not released).
    pub fn terminals(&self) -> usize {
        self.shared.terminals.count()
    }

    async fn stop_pid(
        &self,
        pid: u32,
        mut exit_rx: watch::Receiver<Option<AgentExit>>,
        grace: Duration,
    ) -> Option<AgentExit> {
        let grace = if grace.is_zero() {
            DEFAULT_STOP_GRACE
        } else {
            grace
        };
        let _ = sys::kill_group(pid, sys::SIGTERM);
        let started = std::time::Instant::now();
        let exited = tokio::time::timeout(grace, exit_rx.wait_for(Option::is_some))
            .await
            .is_ok();
        // The rest of the group gets the rest of the grace too: an agent's
        // leader (a node wrapper) often exits at once while the process
        // doing the work (the Claude Code CLI) is still writing what the
        // last turn said to its own transcript; killed then, it loses it.
        while exited && started.elapsed() < grace && sys::kill_group(pid, 0).is_ok() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // KILL whatever is left of the group, leader or not.
        let _ = sys::kill_group(pid, sys::SIGKILL);
        if !exited {
            let _ = tokio::time::timeout(Duration::from_secs(5), exit_rx.wait_for(Option::is_some))
                .await;
        }
        *exit_rx.borrow()
    }
}

/// Records the agent's exit: state EXITED, the in-flight turn ended with an
/// error, `AgentExited` on the stream. False when a later agent already
/// replaced this one.
fn on_exit(shared: &Shared, generation: u64, exit: AgentExit) -> bool {
    let mut slot = shared.slot();
    if slot.generation != generation {
        return false;
    }
    let running = slot.running.take();
    slot.exit = Some(exit);
    slot.asks.clear();
    slot.replaying = None;
    slot.session = None;
    slot.reopened = None;
    slot.modes = None;
    slot.config = None;
    if let Some(turn) = slot.turn.take() {
        for a in slot.parts.close(&turn.turn_id) {
            shared.updates.push(Kind::Activity(a));
        }
        let usage = slot.usage.turn_ended(None);
        let cursor = shared.updates.push(Kind::TurnEnded(TurnEnded {
            turn_id: turn.turn_id.clone(),
            stop_reason: "error".into(),
            error_message: format!(
                "the agent exited during the turn ({})",
                describe_exit(&exit)
            ),
            usage,
            agent_exited: true,
        }));
        record_ended(shared, &mut slot, &turn.turn_id, cursor);
    }
    // What the agent left of its tree (children it did not wait for) ends
    // with it.
    let marker = std::mem::take(&mut slot.marker);
    slot.set_state(&shared.updates, AgentState::Exited);
    shared
        .updates
        .push(Kind::AgentExited(AgentExited { exit: Some(exit) }));
    drop(slot);
    if !marker.is_empty() && running.is_some() {
        let record = AgentRecord {
            instance: shared.updates.instance_id().to_owned(),
            pid: running.as_ref().map_or(0, |r| r.pid),
            start_time: 0,
            marker,
        };
        let ended = tree::end(&record);
        if ended > 0 {
            tracing::info!(ended, "ended processes the agent left behind");
        }
    }
    drop(running);
    ring(shared);
    true
}

/// Tells the backend the agent exited: one datagram, best effort (a backend
/// that is down or slow finds it at its next liveness check).
fn ring(shared: &Shared) {
    let Some((path, executor_id)) = &shared.doorbell else {
        return;
    };
    let sent = std::os::unix::net::UnixDatagram::unbound().and_then(|s| {
        s.set_nonblocking(true)?;
        s.send_to(executor_id.as_bytes(), path)
    });
    if let Err(e) = sent {
        tracing::debug!(doorbell = %path.display(), error = %e, "could not ring the backend's doorbell");
    }
}

/// The first option of the first kind in `wanted`, or `cancelled`.
fn pick(
    req: &RequestPermissionRequest,
    wanted: &[PermissionOptionKind],
) -> RequestPermissionOutcome {
    let chosen = wanted.iter().find_map(|kind| {
        req.options
            .iter()
            .find(|o| o.kind == *kind)
            .map(|o| o.option_id.clone())
    });
    match chosen {
        Some(id) => RequestPermissionOutcome::Selected(SelectedPermissionOutcome::new(id)),
        None => RequestPermissionOutcome::Cancelled,
    }
}

fn unix_ms(t: std::time::SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Policy `ask`: journals the request (fsync), puts it on the update stream
/// as a `permission` activity part (rev 1, pending), waits for
/// [`AgentManager::respond_permission`] at most the permission timeout
/// (then a reject option, or `cancelled` when the agent offered none), and
/// puts the outcome on the stream (rev 2, complete). A request dropped
/// unanswered (turn cancelled, agent exited) is `cancelled`.
async fn ask(
    shared: &Shared,
    generation: u64,
    req: &RequestPermissionRequest,
) -> RequestPermissionOutcome {
    let request_id = uuid::Uuid::now_v7().to_string();
    let instance = shared.updates.instance_id().to_owned();
    let (tx, rx) = oneshot::channel();
    let (timeout, mut part) = {
        let mut slot = shared.slot();
        if slot.generation != generation {
            return RequestPermissionOutcome::Cancelled;
        }
        let turn_id = slot
            .turn
            .as_ref()
            .map(|t| t.turn_id.clone())
            .unwrap_or_default();
        let now = std::time::SystemTime::now();
        let timeout = slot.permission_timeout;
        let part = activity::permission_requested(
            &turn_id,
            &request_id,
            req,
            unix_ms(now),
            unix_ms(now + timeout),
        );
        // Journal before the backend can know of it: a later agentctl
        // process finds it pending and reports it cancelled.
        let record = crate::journal::PermissionRecord {
            instance: instance.clone(),
            turn_id,
            request_id: request_id.clone(),
            part: part.json.clone(),
        };
        if let Err(e) = shared.journal.permission(&record) {
            tracing::warn!(request_id, error = %e, "could not journal the permission request; refusing it");
            return RequestPermissionOutcome::Cancelled;
        }
        slot.asks.insert(
            request_id.clone(),
            Ask {
                options: req
                    .options
                    .iter()
                    .map(|o| o.option_id.0.to_string())
                    .collect(),
                form: None,
                answer: tx,
            },
        );
        shared.updates.push(Kind::Activity(part.clone()));
        (timeout, part)
    };
    tracing::info!(
        request_id,
        ?timeout,
        "permission request waits for the backend's answer"
    );
    let (outcome, status, reason) = match tokio::time::timeout(timeout, rx).await {
        Ok(Ok(reply)) => (
            RequestPermissionOutcome::Selected(SelectedPermissionOutcome::new(reply.option_id)),
            "selected",
            String::new(),
        ),
        Ok(Err(_)) => (
            RequestPermissionOutcome::Cancelled,
            "cancelled",
            "the turn was cancelled or the agent exited while the request waited".to_owned(),
        ),
        Err(_) => (
            pick(
                req,
                &[
                    PermissionOptionKind::RejectOnce,
                    PermissionOptionKind::RejectAlways,
                ],
            ),
            "timed_out",
            format!("no answer within {}s", timeout.as_secs_f64()),
        ),
    };
    let mut slot = shared.slot();
    slot.asks.remove(&request_id);
    let option_id = match &outcome {
        RequestPermissionOutcome::Selected(s) => Some(s.option_id.0.to_string()),
        _ => None,
    };
    activity::permission_resolved(&mut part, status, option_id.as_deref(), &reason);
    shared.updates.push(Kind::Activity(part));
    if let Err(e) = shared.journal.permission_resolved(&request_id, &instance) {
        tracing::warn!(request_id, error = %e, "could not journal the permission request's end");
    }
    drop(slot);
    tracing::info!(request_id, status, "permission request answered");
    outcome
}

/// An ACP `elicitation/create`, asked of the user whatever the permission
/// policy (a form cannot be filled by a policy): journaled, a `permission`
/// part with options `accept` / `decline` / `cancel` on the stream, then
/// the backend's answer (`RespondPermission`, an accepted form's values in
/// `content_json`), at most the permission timeout (then `cancel`). One
/// dropped unanswered (turn cancelled, agent exited) is `cancel`.
async fn ask_elicitation(
    shared: &Shared,
    generation: u64,
    req: &CreateElicitationRequest,
) -> CreateElicitationResponse {
    let request_id = uuid::Uuid::now_v7().to_string();
    let instance = shared.updates.instance_id().to_owned();
    let (tx, rx) = oneshot::channel();
    let (timeout, mut part) = {
        let mut slot = shared.slot();
        if slot.generation != generation {
            return CreateElicitationResponse::new(ElicitationAction::Cancel);
        }
        let turn_id = slot
            .turn
            .as_ref()
            .map(|t| t.turn_id.clone())
            .unwrap_or_default();
        let now = std::time::SystemTime::now();
        let timeout = slot.permission_timeout;
        let part = activity::elicitation_requested(
            &turn_id,
            &request_id,
            req,
            unix_ms(now),
            unix_ms(now + timeout),
        );
        // Journal before the backend can know of it, as a permission request.
        let record = crate::journal::PermissionRecord {
            instance: instance.clone(),
            turn_id,
            request_id: request_id.clone(),
            part: part.json.clone(),
        };
        if let Err(e) = shared.journal.permission(&record) {
            tracing::warn!(request_id, error = %e, "could not journal the elicitation; cancelling it");
            return CreateElicitationResponse::new(ElicitationAction::Cancel);
        }
        slot.asks.insert(
            request_id.clone(),
            Ask {
                options: vec!["accept".into(), "decline".into(), "cancel".into()],
                form: Some(crate::elicit::form(req)),
                answer: tx,
            },
        );
        shared.updates.push(Kind::Activity(part.clone()));
        (timeout, part)
    };
    tracing::info!(
        request_id,
        ?timeout,
        "elicitation waits for the user's answer"
    );
    let (action, status, option, reason) = match tokio::time::timeout(timeout, rx).await {
        Ok(Ok(reply)) => {
            let action = match reply.option_id.as_str() {
                "accept" => ElicitationAction::Accept(
                    ElicitationAcceptAction::new()
                        .content(reply.content.map(crate::elicit::to_acp)),
                ),
                "decline" => ElicitationAction::Decline,
                _ => ElicitationAction::Cancel,
            };
            (action, "selected", Some(reply.option_id), String::new())
        }
        Ok(Err(_)) => (
            ElicitationAction::Cancel,
            "cancelled",
            None,
            "the turn was cancelled or the agent exited while the question waited".to_owned(),
        ),
        Err(_) => (
            ElicitationAction::Cancel,
            "timed_out",
            Some("cancel".to_owned()),
            format!("no answer within {}s", timeout.as_secs_f64()),
        ),
    };
    let mut slot = shared.slot();
    slot.asks.remove(&request_id);
    activity::permission_resolved(&mut part, status, option.as_deref(), &reason);
    shared.updates.push(Kind::Activity(part));
    if let Err(e) = shared.journal.permission_resolved(&request_id, &instance) {
        tracing::warn!(request_id, error = %e, "could not journal the elicitation's end");
    }
    drop(slot);
    tracing::info!(request_id, status, "elicitation answered");
    CreateElicitationResponse::new(action)
}

/// Marks `turn_id` ended at `cursor`, in memory and in the journal. A failed
/// journal write is logged: the end is on the stream already, and a
/// relaunched agentctl reading "handed" only makes the backend more careful.
fn record_ended(shared: &Shared, slot: &mut Slot, turn_id: &str, cursor: u64) {
    let instance = shared.updates.instance_id();
    slot.set_phase(turn_id, instance, Phase::Ended, cursor);
    if let Err(e) = shared.journal.ended(turn_id, instance, cursor) {
        tracing::warn!(turn_id, error = %e, "could not record the turn's end in the journal");
    }
}

/// Ends `turn_id` if it is still the turn in progress.
fn finish_turn(
    shared: &Shared,
    turn_id: &str,
    stop_reason: &str,
    error: &str,
    tokens: Option<&agent_client_protocol::v1::schema::Usage>,
) {
    let mut slot = shared.slot();
    if slot.turn.as_ref().is_none_or(|t| t.turn_id != turn_id) {
        return;
    }
    slot.turn = None;
    tracing::info!(turn_id, stop_reason, "turn ended");
    for a in slot.parts.close(turn_id) {
        shared.updates.push(Kind::Activity(a));
    }
    let usage = slot.usage.turn_ended(tokens);
    let cursor = shared.updates.push(Kind::TurnEnded(TurnEnded {
        turn_id: turn_id.to_owned(),
        stop_reason: stop_reason.to_owned(),
        error_message: error.to_owned(),
        usage,
        agent_exited: false,
    }));
    record_ended(shared, &mut slot, turn_id, cursor);
    if slot.state == AgentState::Busy {
        slot.set_state(&shared.updates, AgentState::Ready);
    }
}

/// Maps one ACP session update to the stream, if it belongs to the turn in
/// progress; replayed history during `session/load` is dropped.
fn on_session_update(shared: &Shared, generation: u64, n: SessionNotification) {
    let mut slot = shared.slot();
    if slot.generation != generation {
        return;
    }
    if slot.replaying.as_ref() == Some(&n.session_id) {
        slot.replayed += 1;
        // The session's cost so far, told as the history is replayed: the
        // next turn's cost counts from it (a new process's first figure is
        // otherwise all that turn's, helper-35: counted twice).
        if let SessionUpdate::UsageUpdate(u) = &n.update {
            slot.usage.update(u, false);
        }
        return;
    }
    // An update that repeats what the conversation already holds changes
    // nothing and is not a part: most often the agent confirming a mode or
    // options a client just set, which `set_mode` and `set_config_option`
    // put on the stream themselves (the conversation showed it twice).
    let mut repeat = false;
    // Options the agent changed (often with a mode or a model) replace the
    // ones it offered; the update also goes on as a part.
    if let SessionUpdate::ConfigOptionUpdate(u) = &n.update
        && slot.session.as_ref() == Some(&n.session_id)
    {
        repeat = slot.config.as_ref() == Some(&u.config_options);
        slot.config = Some(u.config_options.clone());
    }
    // A mode the agent switched to by itself is the current one from now on
    // (Health reports it), in a turn or between turns.
    if let SessionUpdate::CurrentModeUpdate(u) = &n.update
        && slot.session.as_ref() == Some(&n.session_id)
        && let Some(modes) = slot.modes.as_mut()
    {
        repeat = modes.current_mode_id == u.current_mode_id;
        modes.current_mode_id = u.current_mode_id.clone();
    }
    if repeat {
        tracing::debug!(session = %n.session_id, "a mode or options update that changes nothing: not a part");
        return;
    }
    let turn = slot
        .turn
        .as_ref()
        .filter(|t| t.session == n.session_id)
        .cloned();
    // Usage is the turn's (it comes with its end), not a part of its own.
    if let SessionUpdate::UsageUpdate(u) = &n.update {
        slot.usage.update(u, turn.is_some());
        return;
    }
    let Some(turn) = turn else {
        // Between turns only what describes the session is kept (commands,
        // mode, untyped kinds); a stray chunk or tool call is not.
        match activity::outside_turn(n.update) {
            Some(a) => {
                shared.updates.push(Kind::Activity(a));
            }
            None => {
                tracing::debug!(session = %n.session_id, "session update outside a turn ignored")
            }
        }
        return;
    };
    if let SessionUpdate::AgentMessageChunk(chunk) = &n.update {
        if let ContentBlock::Text(t) = &chunk.content {
            // The reply's text closes a thought being streamed.
            for a in slot.parts.apply(&turn.turn_id, n.update.clone()) {
                shared.updates.push(Kind::Activity(a));
            }
            // A huge chunk goes as several (the backend reads updates of
            // up to 64 MiB; one it cannot read would be sent for ever).
            for piece in activity::pieces(&t.text, MAX_CHUNK_BYTES) {
                shared.updates.push(Kind::MessageChunk(MessageChunk {
                    turn_id: turn.turn_id.clone(),
                    message_id: turn.message_id.clone(),
                    text: piece.to_owned(),
                }));
            }
        }
        return;
    }
    for a in slot.parts.apply(&turn.turn_id, n.update) {
        shared.updates.push(Kind::Activity(a));
    }
}

/// A `session/update` our schema could not parse: kept as an `unparsed`
/// part (of the turn it belongs to, or between turns) instead of being
/// lost, and logged once per method and kind of error. Replayed history is
/// dropped as parsed history is.
fn on_unparsed_update(shared: &Shared, generation: u64, n: &UntypedMessage, error: &str) {
    let mut slot = shared.slot();
    if slot.generation != generation {
        return;
    }
    let session = n.params.get("sessionId").and_then(|v| v.as_str());
    let key = format!("{}: {}", n.method, activity::error_shape(error));
    if slot.unparsed_logged.len() < MAX_UNPARSED_LOGGED && slot.unparsed_logged.insert(key) {
        tracing::warn!(
            method = %n.method,
            error = activity::clip(error, 1024),
            "an update of the agent did not parse; kept raw (logged once per kind of error)"
        );
    }
    if session.is_some() && slot.replaying.as_ref().map(|s| &*s.0) == session {
        slot.replayed += 1;
        return;
    }
    let turn_id = slot
        .turn
        .as_ref()
        .filter(|t| Some(&*t.session.0) == session)
        .map(|t| t.turn_id.clone())
        .unwrap_or_default();
    shared.updates.push(Kind::Activity(activity::unparsed(
        &turn_id, &n.method, &n.params, error,
    )));
}

type Transport = Lines<
    std::pin::Pin<Box<dyn futures::Sink<String, Error = std::io::Error> + Send>>,
    std::pin::Pin<Box<dyn futures::Stream<Item = std::io::Result<String>> + Send>>,
>;

/// ACP over the agent's stdio, one JSON-RPC message per line; every
/// message read is a sign of life. Lines that cannot be messages are
/// dropped and counted (`stdio`), not answered.
fn lines_transport(
    pid: u32,
    stdin: tokio::process::ChildStdin,
    stdout: tokio::process::ChildStdout,
    signs: Arc<Signs>,
) -> Transport {
    struct Reading {
        reader: BufReader<tokio::process::ChildStdout>,
        buf: Vec<u8>,
        noise: stdio::Noise,
        signs: Arc<Signs>,
    }
    let reading = Reading {
        reader: BufReader::new(stdout),
        buf: Vec::new(),
        noise: stdio::Noise::default(),
        signs,
    };
    let incoming = futures::stream::unfold(reading, move |mut r| async move {
        loop {
            match stdio::next_line(&mut r.reader, &mut r.buf, stdio::MAX_MESSAGE_LINE).await {
                Ok(Some(stdio::Line::Text(line))) if stdio::may_be_message(&line) => {
                    r.signs.line();
                    return Some((Ok(line), r));
                }
                Ok(Some(stdio::Line::Text(line))) if line.trim().is_empty() => {}
                Ok(Some(stdio::Line::Text(line))) => match stdio::message_after_noise(&line) {
                    Some((noise, message)) => {
                        r.noise.note(pid, &stdio::Line::Text(noise.to_owned()));
                        r.signs.line();
                        return Some((Ok(message.to_owned()), r));
                    }
                    None => r.noise.note(pid, &stdio::Line::Text(line)),
                },
                Ok(Some(other)) => r.noise.note(pid, &other),
                Ok(None) => return None,
                Err(e) => return Some((Err(e), r)),
            }
        }
    });
    let outgoing = futures::sink::unfold(stdin, |mut stdin, line: String| async move {
        stdin.write_all(line.as_bytes()).await?;
        stdin.write_all(b"\n").await?;
        stdin.flush().await?;
        Ok::<_, std::io::Error>(stdin)
    });
    Lines::new(Box::pin(outgoing) as _, Box::pin(incoming) as _)
}

/// The ACP client: session updates to the stream, and answers to the agent's
/// requests (permission by policy; file system and terminals confined to
/// the workspace).
/// Runs until `close` fires or the connection fails.
async fn run_connection(
    shared: Arc<Shared>,
    generation: u64,
    transport: Transport,
    conn_tx: oneshot::Sender<ConnectionTo<Agent>>,
    close: oneshot::Receiver<()>,
) -> std::result::Result<(), agent_client_protocol::Error> {
    let s_updates = shared.clone();
    let s_perm = shared.clone();
    let s_elicit = shared.clone();
    let s_read = shared.clone();
    let s_term = shared.clone();
    let s_term_out = shared.clone();
    let s_term_wait = shared.clone();
    let s_term_kill = shared.clone();
    let s_term_release = shared.clone();
    let s_write = shared;
    Client
        .v1()
        .name("agentctl")
        .on_receive_notification(
            // Parsed here rather than by the SDK, which would reject an
            // update our schema cannot read and lose it.
            async move |n: UntypedMessage, cx| {
                if n.method != "session/update" {
                    return Ok(Handled::No {
                        message: (n, cx),
                        retry: false,
                    });
                }
                match serde_json::from_value::<SessionNotification>(n.params.clone()) {
                    Ok(update) => on_session_update(&s_updates, generation, update),
                    Err(e) => on_unparsed_update(&s_updates, generation, &n, &e.to_string()),
                }
                Ok(Handled::Yes)
            },
            agent_client_protocol::on_receive_notification!(),
        )
        .on_receive_request(
            async move |req: RequestPermissionRequest, responder, _cx| {
                // Nothing to choose: no user or policy could ever answer it,
                // so the agent hears so at once instead of waiting out the
                // permission timeout (or reading "cancelled", which ACP
                // keeps for a cancelled turn).
                if req.options.is_empty() {
                    tracing::warn!(tool_call = %req.tool_call.tool_call_id.0,
                        "refused a permission request that offers no options");
                    return responder.respond_with_error(agent_client_protocol::Error::new(
                        ErrorCode::INVALID_PARAMS,
                        "session/request_permission must offer at least one option; this one offers none, so nothing can be chosen",
                    ));
                }
                let policy = s_perm.slot().policy;
                let wanted: &[PermissionOptionKind] = match policy {
                    PermissionPolicy::AllowOnce => &[
                        PermissionOptionKind::AllowOnce,
                        PermissionOptionKind::AllowAlways,
                    ],
                    PermissionPolicy::Reject => &[
                        PermissionOptionKind::RejectOnce,
                        PermissionOptionKind::RejectAlways,
                    ],
                    PermissionPolicy::Ask => {
                        // Answered from its own task: the connection keeps
                        // serving the agent (updates, files) meanwhile.
                        let shared = s_perm.clone();
                        tokio::spawn(async move {
                            let outcome = ask(&shared, generation, &req).await;
                            if let Err(e) = responder.respond(RequestPermissionResponse::new(outcome)) {
                                tracing::debug!(error = %e, "could not answer the permission request (agent gone)");
                            }
                        });
                        return Ok(());
                    }
                };
                responder.respond(RequestPermissionResponse::new(pick(&req, wanted)))
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_request(
            async move |req: CreateElicitationRequest, responder, _cx| {
                // Answered from its own task, as a permission request.
                let shared = s_elicit.clone();
                tokio::spawn(async move {
                    let answer = ask_elicitation(&shared, generation, &req).await;
                    if let Err(e) = responder.respond(answer) {
                        tracing::debug!(error = %e, "could not answer the elicitation (agent gone)");
                    }
                });
                Ok(())
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_request(
            async move |req: ReadTextFileRequest, responder, _cx| {
                let path = req.path.to_string_lossy().into_owned();
                let result = s_read.workspace.get().and_then(|ws| ws.read_file(&path, 0)).and_then(|bytes| {
                    String::from_utf8(bytes)
                        .map_err(|_| Error::InvalidArgument(format!("{path} is not UTF-8 text")))
                });
                match result {
                    Ok(text) => {
                        let text = select_lines(&text, req.line, req.limit);
                        responder.respond(ReadTextFileResponse::new(text))
                    }
                    Err(e) => responder.respond_with_error(fs_error(&e)),
                }
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_request(
            async move |req: WriteTextFileRequest, responder, _cx| {
                let path = req.path.to_string_lossy().into_owned();
                match s_write
                    .workspace
                    .get()
                    .and_then(|ws| ws.write_file(&path, req.content.as_bytes(), true))
                {
                    Ok(_) => responder.respond(WriteTextFileResponse::new()),
                    Err(e) => responder.respond_with_error(fs_error(&e)),
                }
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_request(
            async move |req: CreateTerminalRequest, responder, _cx| {
                match create_terminal(&s_term, generation, req) {
                    Ok(id) => responder.respond(CreateTerminalResponse::new(id)),
                    Err(e) => responder.respond_with_error(fs_error(&e)),
                }
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_request(
            async move |req: TerminalOutputRequest, responder, _cx| {
                match s_term_out
                    .terminals
                    .output(&req.session_id.0, &req.terminal_id.0)
                {
                    Ok(o) => responder.respond(
                        TerminalOutputResponse::new(o.output, o.truncated)
                            .exit_status(o.exit.map(exit_status)),
                    ),
                    Err(e) => responder.respond_with_error(fs_error(&e)),
                }
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_request(
            async move |req: WaitForTerminalExitRequest, responder, _cx| {
                // Waited for on its own task: the connection keeps serving
                // the agent (updates, other terminals) meanwhile.
                let shared = s_term_wait.clone();
                tokio::spawn(async move {
                    let r = shared
                        .terminals
                        .wait_for_exit(&req.session_id.0, &req.terminal_id.0)
                        .await;
                    let sent = match r {
                        Ok(e) => responder.respond(WaitForTerminalExitResponse::new(exit_status(e))),
                        Err(e) => responder.respond_with_error(fs_error(&e)),
                    };
                    if let Err(e) = sent {
                        tracing::debug!(error = %e, "could not answer terminal/wait_for_exit (agent gone)");
                    }
                });
                Ok(())
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_request(
            async move |req: KillTerminalRequest, responder, _cx| {
                match s_term_kill
                    .terminals
                    .kill(&req.session_id.0, &req.terminal_id.0)
                    .await
                {
                    Ok(()) => responder.respond(KillTerminalResponse::new()),
                    Err(e) => responder.respond_with_error(fs_error(&e)),
                }
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_request(
            async move |req: ReleaseTerminalRequest, responder, _cx| {
                match s_term_release
                    .terminals
                    .release(&req.session_id.0, &req.terminal_id.0)
                    .await
                {
                    Ok(()) => responder.respond(ReleaseTerminalResponse::new()),
                    Err(e) => responder.respond_with_error(fs_error(&e)),
                }
            },
            agent_client_protocol::on_receive_request!(),
        )
        .connect_with(
            transport,
            async move |cx: ConnectionTo<Agent>| {
                let _ = conn_tx.send(cx);
                let _ = close.await;
                Ok(())
            },
        )
        .await
}

/// `terminal/create` of the current agent: the working directory confined
/// to the workspace, the processes marked as the agent's.
fn create_terminal(shared: &Shared, generation: u64, req: CreateTerminalRequest) -> Result<String> {
    let (turn_id, agent_marker) = {
        let slot = shared.slot();
        if slot.generation != generation || slot.running.is_none() {
            return Err(Error::Unavailable("the agent is gone".into()));
        }
        // Only for the conversation this agentctl serves: a terminal of
        // another would be nobody's (no turn's cancel or stop names it).
        let known = [slot.session.as_ref(), slot.opened.as_ref()];
        if !known.contains(&Some(&req.session_id)) {
            return Err(Error::InvalidArgument(format!(
                "terminal/create: sessionId {:?} is not this agent's conversation",
                req.session_id.0
            )));
        }
        let turn = slot
            .turn
            .as_ref()
            .filter(|t| t.session == req.session_id)
            .map(|t| t.turn_id.clone())
            .unwrap_or_default();
        (turn, slot.marker.clone())
    };
    let ws = shared.workspace.get()?;
    let cwd = match req.cwd.as_ref() {
        Some(dir) => ws.resolve(&dir.to_string_lossy())?,
        None => ws.root().to_path_buf(),
    };
    let cwd_handle = Some(std::sync::Arc::new(ws.open_dir(&cwd)?));
    shared.terminals.create(TerminalSpec {
        session_id: req.session_id.0.to_string(),
        turn_id,
        command: req.command,
        args: req.args,
        env: req.env.into_iter().map(|v| (v.name, v.value)).collect(),
        cwd,
        cwd_handle,
        output_byte_limit: req.output_byte_limit,
        agent_marker,
    })
}

fn exit_status(e: TerminalExit) -> TerminalExitStatus {
    TerminalExitStatus::new()
        .exit_code(e.exit_code)
        .signal(e.signal)
}

fn fs_error(e: &Error) -> agent_client_protocol::Error {
    let code = match e {
        Error::NotFound(_) => ErrorCode::RESOURCE_NOT_FOUND,
        Error::InvalidArgument(_) | Error::PermissionDenied(_) | Error::OutOfRange(_) => {
            ErrorCode::INVALID_PARAMS
        }
        _ => ErrorCode::INTERNAL_ERROR,
    };
    agent_client_protocol::Error::new(code, e.to_string())
}

/// `line` is 1-based; `limit` counts lines.
fn select_lines(text: &str, line: Option<u32>, limit: Option<u32>) -> String {
    if line.is_none() && limit.is_none() {
        return text.to_owned();
    }
    let start = line.map_or(0, |l| l.saturating_sub(1) as usize);
    let take = limit.map_or(usize::MAX, |l| l as usize);
    text.split_inclusive('\n').skip(start).take(take).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines() {
        assert_eq!(select_lines("a\nb\nc\n", Some(2), Some(1)), "b\n");
        assert_eq!(select_lines("a\nb\nc", None, Some(2)), "a\nb\n");
        assert_eq!(select_lines("a\nb", None, None), "a\nb");
        assert_eq!(stop_reason_name(StopReason::EndTurn), "end_turn");
    }
}
