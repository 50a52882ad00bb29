//! The records sessiond keeps. Plain data: the store maps them to rows, the
//! server to protobuf messages.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};

use crate::{
    ids::{AgentProfileId, ExecutorId, MessageId, SessionId, TaskId},
    states::{
        ExecutorStatus, MessageKind, MessageRole, PermissionPolicy, Runtime, SessionState,
        TaskState,
    },
};

/// A unit of work on a repository; it has one or more sessions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Task {
    /// The task's id; its sessions carry it as `task_id`.
    pub id: TaskId,
    /// Free text chosen by the user.
    pub title: String,
    /// Where the task is in its lifecycle.
    pub state: TaskState,
    /// When the task was created (UTC, set by the store).
    pub created_at: DateTime<Utc>,
    /// When the task was last written (UTC, set by the store).
    pub updated_at: DateTime<Utc>,
}

/// How long a permission request of policy `ask` waits for a client's
/// answer when the profile does not say: long enough for a person to read
/// a prompt and decide, short enough that an unattended agent is not held
/// for long. Then it is rejected: a tool nobody approved does not run.
pub const DEFAULT_PERMISSION_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// How to start an agent, and whether it claims to resume sessions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentProfile {
    /// The profile's id; sessions refer to it as `agent_profile_id`.
    pub id: AgentProfileId,
    /// Unique, human-chosen (e.g. `demo`, `claude-code`).
    pub name: String,
    /// The ACP agent's program on the host agentctl runs on (absolute, or on
    /// its `PATH`); agentctl starts it and speaks ACP over its stdio.
    pub command: String,
    /// Arguments of `command`.
    pub args: Vec<String>,
    /// Environment variables set for the agent, on top of agentctl's own.
    pub env: BTreeMap<String, String>,
    /// The profile's claim. The agent's own capability answer can only lower it.
    pub supports_session_resume: bool,
    /// How the agent runs in a container (`local_docker`), when that is not
    /// `command`/`args` of the host: an image has its own file system.
    pub container: Option<ContainerAgent>,
    /// ACP auth method agentctl calls `authenticate` with after
    /// `initialize` (e.g. `openai-api-key` for codex-acp); `None`: no call.
    pub auth_method: Option<String>,
    /// How the agent's permission requests are answered.
    pub permission_policy: PermissionPolicy,
    /// Policy `ask`: how long a request waits for an answer before it is
    /// rejected ([`DEFAULT_PERMISSION_TIMEOUT`] unless configured).
    pub permission_timeout: std::time::Duration,
    /// Values of the agent's config options (ACP: its model, ...) set when
    /// a session starts, by option id; each must be one the agent offers.
    pub config_defaults: BTreeMap<String, String>,
    /// MCP servers handed to the agent with every conversation it opens or
    /// reopens. Secret values are references (an environment variable or a
    /// file of sessiond's), resolved when the agent is launched.
    pub mcp_servers: Vec<McpServer>,
    /// When the profile was created (UTC).
    pub created_at: DateTime<Utc>,
    /// When the profile was last changed (UTC).
    pub updated_at: DateTime<Utc>,
}

/// A profile's agent inside a container.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ContainerAgent {
    /// The image to run; the executor's configured image when `None`.
    pub image: Option<String>,
    /// The agent's program in the image (absolute, or on the image's `PATH`).
    pub command: String,
    /// Arguments of `command` (the profile's `args` are not used).
    pub args: Vec<String>,
    /// Added to (and overriding) the profile's `env`.
    pub env: BTreeMap<String, String>,
}

/// What an agent is started with on one runtime.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentCommand {
    /// The program to run.
    pub command: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// The agent's environment (profile's, overridden by the container's).
    pub env: BTreeMap<String, String>,
}

impl AgentProfile {
    /// The agent's command, arguments and environment on `runtime`: the
    /// container's for `local_docker` when the profile names one, else the
    /// profile's own.
    pub fn agent_command(&self, runtime: Runtime) -> AgentCommand {
        match (&self.container, runtime) {
            (Some(c), Runtime::LocalDocker) => {
                let mut env = self.env.clone();
                env.extend(c.env.clone());
                AgentCommand {
                    command: c.command.clone(),
                    args: c.args.clone(),
                    env,
                }
            }
            _ => AgentCommand {
                command: self.command.clone(),
                args: self.args.clone(),
                env: self.env.clone(),
            },
        }
    }

    /// The image a `local_docker` session of this profile asks for, if any.
    pub fn container_image(&self) -> Option<&str> {
        self.container.as_ref().and_then(|c| c.image.as_deref())
    }
}

/// `Clone` for a struct of named fields, whose `clone_from` clones field by
/// field: a copy kept up to date (the engine's cache of executor records)
/// keeps its strings' buffers instead of allocating new ones. The patterns
/// name every field, so a field added to the struct and not here fails to
/// compile.
macro_rules! clone_by_fields {
    ($ty:ident { $($field:ident),* $(,)? }) => {
        impl Clone for $ty {
            #[allow(clippy::clone_on_copy)]
            fn clone(&self) -> Self {
                let $ty { $($field),* } = self;
                $ty { $($field: $field.clone()),* }
            }

            fn clone_from(&mut self, source: &Self) {
                let $ty { $($field),* } = source;
                $(self.$field.clone_from($field);)*
            }
        }
    };
}

/// The working tree a session's agent works in.
#[derive(Debug, PartialEq, Eq, Default)]
pub struct Worktree {
    /// The caller's name for the worktree (opaque to sessiond).
    pub id: String,
    /// Absolute path of the directory, as the executor sees it; the agent's
    /// working directory.
    pub path: String,
    /// The git branch checked out there (informational for a directory the
    /// caller made; the session's own branch when sessiond made it).
    pub branch: String,
    /// The repository sessiond created this worktree from (a path on the
    /// executor's host); empty when the caller made the directory. When set,
    /// sessiond owns the worktree: it recreates it from `branch` when the
    /// directory goes missing and removes it only when nothing would be lost
    /// (see [`crate::worktree`]).
    pub repository: String,
    /// The ref `branch` was created from (diffs and commit lists for review
    /// are against it); empty when the caller made the directory.
    pub base: String,
}

impl Worktree {
    /// sessiond created this worktree (and so owns its directory and branch).
    pub fn is_managed(&self) -> bool {
        !self.repository.is_empty()
    }
}

/// One conversation with one agent, inside one executor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    /// The session's id.
    pub id: SessionId,
    /// The task it belongs to.
    pub task_id: TaskId,
    /// Where the session is in its lifecycle (see [`SessionState::transition`]).
    pub state: SessionState,
    /// The profile its agent is started from.
    pub agent_profile_id: AgentProfileId,
    /// Id of the current agent execution (the executor id and its generation).
    pub agent_execution_id: Option<String>,
    /// Where its executor runs; fixed when the session is created.
    pub runtime: Runtime,
    /// Its executor (`executors_running` row); `None` until one is created.
    pub executor_id: Option<ExecutorId>,
    /// The directory its agent works in.
    pub worktree: Worktree,
    /// What people call it (one line; empty until the first prompt, the
    /// agent or a user names it). Written only through the store's title
    /// writes (see [`TitleSource`]), never by a session update.
    pub title: String,
    /// The agent's token for resuming this conversation (stored in `metadata`).
    pub resume_token: Option<String>,
    /// Other metadata, free-form.
    pub metadata: BTreeMap<String, String>,
    /// Why the session is ERROR, as `"<code>: <what to do>"` (see
    /// [`RecoveryFailure::message`](crate::RecoveryFailure::message)); cleared
    /// when it leaves ERROR.
    pub error_message: Option<String>,
    /// Grows by one with every write; a writer holding an older value loses.
    pub version: i64,
    /// When the session was created (UTC).
    pub created_at: DateTime<Utc>,
    /// When the session was last written (UTC).
    pub updated_at: DateTime<Utc>,
}

/// Who named a session. A title is replaced only by one of the same or a
/// stronger source: the user's beats the agent's, which beats the one taken
/// from the first prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum TitleSource {
    /// The first prompt's text.
    Prompt,
    /// The agent's `session_info_update`.
    Agent,
    /// A person (SetSessionTitle).
    User,
}

impl TitleSource {
    /// As stored.
    pub fn as_str(self) -> &'static str {
        match self {
            TitleSource::Prompt => "prompt",
            TitleSource::Agent => "agent",
            TitleSource::User => "user",
        }
    }
}

/// Longest session title, in characters.
pub const MAX_SESSION_TITLE_CHARS: usize = 200;
/// Longest title taken from a prompt, in characters (an ellipsis marks the cut).
const PROMPT_TITLE_CHARS: usize = 80;

/// A character a one-line title must not hold though it is not a control
/// character: a line or paragraph separator (U+2028, U+2029), or one that
/// reorders or hides text (bidirectional embeddings, overrides and
/// isolates; zero-width spaces and joiners; the byte-order mark), which
/// would make a title read other than it is or look blank.
pub fn is_layout_char(c: char) -> bool {
    matches!(c,
        '\u{2028}' | '\u{2029}'
        | '\u{200B}'..='\u{200F}'
        | '\u{202A}'..='\u{202E}'
        | '\u{2060}'..='\u{2064}'
        | '\u{2066}'..='\u{2069}'
        | '\u{FEFF}')
}

/// Why `title` cannot be a session title a user gives (`None`: it can):
/// a control or layout character ([`is_layout_char`]), or nothing visible.
pub fn user_title_problem(title: &str) -> Option<String> {
    if let Some(c) = title.chars().find(|c| c.is_control() || is_layout_char(*c)) {
        return Some(format!(
            "contains the character {c:?} (U+{:04X}), which breaks the line or hides or \
             reorders text; titles are one line of printable text",
            u32::from(c)
        ));
    }
    if !title.is_empty() && title.chars().all(char::is_whitespace) {
        return Some("has no visible character; an empty title clears it".into());
    }
    None
}

/// A title from free text (a prompt, an agent's title): its first non-blank
/// line, control and layout characters dropped, whitespace collapsed, cut at `max`
/// characters with an ellipsis. Empty when the text has no printable line.
pub fn title_from_text(text: &str, max: usize) -> String {
    let line = text
        .lines()
        .map(|l| {
            l.split(|c: char| c.is_whitespace() || c.is_control() || is_layout_char(c))
                .filter(|w| !w.is_empty())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .find(|l| !l.is_empty())
        .unwrap_or_default();
    if line.chars().count() <= max {
        return line;
    }
    let mut cut: String = line.chars().take(max.saturating_sub(1)).collect();
    cut.truncate(cut.trim_end().len());
    cut.push('…');
    cut
}

/// The title a first prompt gives its session.
pub fn prompt_title(prompt: &str) -> String {
    title_from_text(prompt, PROMPT_TITLE_CHARS)
}

/// A row of `executors_running`: what the backend needs to find, trust and
/// reattach to an executor after it restarts.
#[derive(Debug, PartialEq, Eq)]
pub struct ExecutorRecord {
    /// The executor's id; agentctl reports it in `Health` to prove identity.
    pub id: ExecutorId,
    /// The session it serves (one executor per session).
    pub session_id: SessionId,
    /// The task of that session.
    pub task_id: TaskId,
    /// Where it runs; decides how recovery finds it again.
    pub runtime: Runtime,
    /// Its status (see [`ExecutorStatus::transition`] for the legal moves).
    pub status: ExecutorStatus,
    /// Base URL of agentctl's gRPC endpoint; `None` before the first launch.
    pub agentctl_url: Option<String>,
    /// The port of `agentctl_url` when known separately (remote executors);
    /// informational, `agentctl_url` is what is dialled.
    pub agentctl_port: Option<u16>,
    /// Docker only.
    pub container_id: Option<String>,
    /// Local standalone only; never trusted without `pid_start_time`.
    pub pid: Option<u32>,
    /// Start time of `pid` (clock ticks since boot), to detect PID reuse.
    pub pid_start_time: Option<u64>,
    /// Bearer secret agentctl requires on every call.
    pub auth_secret: String,
    /// Grows by one on every (re)launch; intent is written before the spawn.
    pub generation: i64,
    /// Resume support as last known: the profile's claim, lowered by the
    /// agent's capability probe.
    pub supports_session_resume: bool,
    /// The executor can serve the workspace (shell, files, git) without an
    /// agent running.
    pub supports_workspace_only: bool,
    /// A copy of the session's resume token, used when the session has none.
    pub resume_token: Option<String>,
    /// The workspace directory; recovery uses it when `worktree.path` is empty.
    pub workspace_path: String,
    /// The session's worktree as the executor was launched with it.
    pub worktree: Worktree,
    /// When agentctl last answered a health check.
    pub last_seen_at: Option<DateTime<Utc>>,
    /// Why the executor is `error`, as `"<code>: <what to do>"`.
    pub error_message: Option<String>,
    /// The backend replica that owns this executor, and until when.
    pub owner_id: Option<String>,
    /// When the owner's lease ends unless renewed; another replica may then
    /// claim the executor.
    pub lease_expires_at: Option<DateTime<Utc>>,
    /// The fencing token: grows by one on every claim of the lease. Writes
    /// and agentctl calls of the owner carry it; an older one is refused.
    /// Only the lease operations write it (a new record starts at 0).
    pub lease_epoch: i64,
    /// Grows by one with every write; a writer holding an older value loses.
    pub version: i64,
    /// When the record was created (UTC).
    pub created_at: DateTime<Utc>,
    /// When the record was last written (UTC).
    pub updated_at: DateTime<Utc>,
}

clone_by_fields!(Worktree {
    id,
    path,
    branch,
    repository,
    base,
});

clone_by_fields!(ExecutorRecord {
    id,
    session_id,
    task_id,
    runtime,
    status,
    agentctl_url,
    agentctl_port,
    container_id,
    pid,
    pid_start_time,
    auth_secret,
    generation,
    supports_session_resume,
    supports_workspace_only,
    resume_token,
    workspace_path,
    worktree,
    last_seen_at,
    error_message,
    owner_id,
    lease_expires_at,
    lease_epoch,
    version,
    created_at,
    updated_at,
});

impl ExecutorRecord {
    /// The id of the agent execution this record describes right now:
    /// `"<executor id>/<generation>"`, so every relaunch gets a new one.
    pub fn execution_id(&self) -> String {
        format!("{}/{}", self.id, self.generation)
    }
}

/// A message of a session. An agent's streamed reply is one message, added
/// when its first chunk arrives and updated as the rest arrive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The message's id (for a permission request, also the request's id).
    pub id: MessageId,
    /// The session it belongs to.
    pub session_id: SessionId,
    /// The task of that session.
    pub task_id: TaskId,
    /// Who wrote it.
    pub role: MessageRole,
    /// Text, or a readable summary of an activity part (a tool call's
    /// title, a plan's entries, a thought, ...).
    pub content: String,
    /// Text, or which kind of activity part.
    pub kind: MessageKind,
    /// An activity part's state: the store's JSON envelope
    /// (`{"rev": n, "update": <ACP session/update object>}`); empty for text.
    /// Opaque here: the domain knows no JSON.
    pub data: String,
    /// Order within the session, from 1.
    pub seq: i64,
    /// False while the agent is still streaming it.
    pub complete: bool,
    /// When the message was added (UTC).
    pub created_at: DateTime<Utc>,
    /// When it was last updated (UTC); changes while it streams.
    pub updated_at: DateTime<Utc>,
}

/// The session modes an agent offers for a conversation (ACP session
/// modes, e.g. claude-code-acp's `default`, `acceptEdits`, `plan`), and
/// which one is current.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AgentModes {
    /// The id of the mode in effect (one of `available`).
    pub current: String,
    /// The modes the agent offers, in its order.
    pub available: Vec<AgentMode>,
    /// The session's configuration options (ACP config options: the model,
    /// a reasoning effort, ...), with their current values. Carried with
    /// the modes: both describe the open conversation and change together.
    pub config_options: Vec<ConfigOption>,
}

/// An MCP server a profile gives its agent (ACP `McpServer`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct McpServer {
    /// Its name, as the agent shows it.
    pub name: String,
    /// How the agent reaches it.
    pub transport: McpTransport,
}

/// What is wrong with `url` as an MCP server's endpoint (`http://` or
/// `https://`, a host, a port from 1 to 65535 if one is given, no blank or
/// control character), for a message that names the URL; `None` when
/// nothing is. An agent handed `https://` or `http://:0` fails later, in
/// words of its own.
pub fn http_url_problem(url: &str) -> Option<&'static str> {
    let Some(rest) = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
    else {
        return Some("not an http:// or https:// URL");
    };
    if url.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Some("holds a blank or control character");
    }
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let (host, port) = match host_port.strip_prefix('[') {
        // An IPv6 literal: `[::1]` or `[::1]:8080`.
        Some(v6) => match v6.split_once(']') {
            Some((addr, after)) => (addr, after.strip_prefix(':')),
            None => return Some("has an unclosed [ in its host"),
        },
        None => match host_port.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (host_port, None),
        },
    };
    if host.is_empty() {
        return Some("names no host");
    }
    if let Some(p) = port
        && !p.parse::<u16>().is_ok_and(|p| p > 0)
    {
        return Some("has a port that is not a number from 1 to 65535");
    }
    None
}

/// An MCP server's transport.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum McpTransport {
    /// A process the agent starts.
    Stdio {
        /// The program.
        command: String,
        /// Its arguments.
        args: Vec<String>,
        /// Its environment.
        env: BTreeMap<String, SecretValue>,
    },
    /// Streamable HTTP (the agent must offer `mcpCapabilities.http`).
    Http {
        /// The endpoint.
        url: String,
        /// Headers sent with each request.
        headers: BTreeMap<String, SecretValue>,
    },
    /// Server-sent events (the agent must offer `mcpCapabilities.sse`).
    Sse {
        /// The endpoint.
        url: String,
        /// Headers sent with each request.
        headers: BTreeMap<String, SecretValue>,
    },
}

impl McpTransport {
    /// `stdio`, `http` or `sse`.
    pub fn kind(&self) -> &'static str {
        match self {
            McpTransport::Stdio { .. } => "stdio",
            McpTransport::Http { .. } => "http",
            McpTransport::Sse { .. } => "sse",
        }
    }
}

/// A value of an MCP server's environment or headers: given as is (not a
/// secret: stored with the profile), or read when the agent launches from
/// sessiond's environment or a file, so the secret itself is never stored.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum SecretValue {
    /// The value itself.
    Plain(String),
    /// The value of this environment variable of sessiond.
    Env(String),
    /// The contents of this file (a final newline dropped).
    File(String),
}

/// The values of secret references ([`SecretValue::Env`], `File`) that the
/// binary read at startup, by reference. Never printed: `Debug` shows only
/// how many there are.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secrets(BTreeMap<SecretValue, String>);

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secrets({} values)", self.0.len())
    }
}

impl Secrets {
    /// Records the value of a reference.
    pub fn insert(&mut self, reference: SecretValue, value: String) {
        self.0.insert(reference, value);
    }

    /// The value `v` stands for: itself when plain, else what was read for
    /// the reference (`None`: not read).
    pub fn resolve<'a>(&'a self, v: &'a SecretValue) -> Option<&'a str> {
        match v {
            SecretValue::Plain(s) => Some(s),
            other => self.0.get(other).map(String::as_str),
        }
    }
}

/// One configuration option of an agent's session (ACP
/// `SessionConfigOption`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ConfigOption {
    /// The agent's id for it, used to set it (e.g. `model`).
    pub id: String,
    /// Its human-readable name.
    pub name: String,
    /// What it does (may be empty).
    pub description: String,
    /// `mode`, `model`, `thought_level`, ... (may be empty).
    pub category: String,
    /// `select` (one of `values`) or `boolean` (`true` / `false`).
    pub kind: String,
    /// The value in effect.
    pub current: String,
    /// For `select`: the values it takes.
    pub values: Vec<ConfigValue>,
}

/// One value a `select` configuration option takes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ConfigValue {
    /// The id to set.
    pub value: String,
    /// Its human-readable name.
    pub name: String,
    /// What it means (may be empty).
    pub description: String,
}

impl ConfigOption {
    /// The values `set` may name: a select's value ids, a boolean's two.
    pub fn offered(&self) -> Vec<&str> {
        if self.kind == "boolean" {
            vec!["true", "false"]
        } else {
            self.values.iter().map(|v| v.value.as_str()).collect()
        }
    }
}

/// One session mode an agent offers (ACP `SessionMode`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentMode {
    /// The agent's id for the mode, used to switch to it (e.g. `plan`).
    pub id: String,
    /// Its human-readable name.
    pub name: String,
    /// What it does, as the agent describes it (may be empty).
    pub description: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mcp_urls_need_a_scheme_a_host_and_a_real_port() {
        for ok in [
            "http://127.0.0.1:8080/mcp",
            "https://mcp.example.com",
            "https://user:pw@host/x?y#z",
            "http://[::1]:7000/sse",
            "http://[::1]",
        ] {
            assert_eq!(http_url_problem(ok), None, "{ok}");
        }
        for (bad, why) in [
            ("ftp://h", "not an http"),
            ("https://", "no host"),
            ("http://:0", "no host"),
            ("https://a b", "blank"),
            ("https://h\n", "control"),
            ("http://h:0/x", "port"),
            ("http://h:99999", "port"),
            ("http://h:x", "port"),
            ("http://[::1", "unclosed"),
        ] {
            let problem = http_url_problem(bad).unwrap_or_default();
            assert!(problem.contains(why), "{bad:?}: {problem:?}");
        }
    }

    fn record(secret: &str, branch: &str, error: Option<&str>) -> ExecutorRecord {
        let at = DateTime::<Utc>::from_timestamp(1_700_000_000, 0).expect("valid time");
        ExecutorRecord {
            id: crate::ExecutorId::new(),
            session_id: crate::SessionId::new(),
            task_id: crate::TaskId::new(),
            runtime: Runtime::Remote,
            status: ExecutorStatus::Ready,
            agentctl_url: Some("http://127.0.0.1:7070".into()),
            agentctl_port: Some(7070),
            container_id: None,
            pid: Some(1),
            pid_start_time: Some(2),
            auth_secret: secret.into(),
            generation: 3,
            supports_session_resume: true,
            supports_workspace_only: false,
            resume_token: Some("token".into()),
            workspace_path: "/work/ws".into(),
            worktree: Worktree {
                id: "wt".into(),
                path: "/work/ws".into(),
                branch: branch.into(),
                repository: "/work/repo".into(),
                base: "main".into(),
            },
            last_seen_at: Some(at),
            error_message: error.map(Into::into),
            owner_id: None,
            lease_expires_at: None,
            lease_epoch: 4,
            version: 5,
            created_at: at,
            updated_at: at,
        }
    }

    /// `clone_from` makes an equal copy, and a copy kept up to date keeps
    /// its strings' buffers where the new text fits them.
    #[test]
    fn an_executor_record_cloned_into_another_is_equal_and_keeps_its_buffers() {
        let mut cached = record("secret-one", "feature/one", None);
        let newer = record("secret-two", "feature/two", Some("lost"));
        let secret_at = cached.auth_secret.as_ptr();
        let branch_at = cached.worktree.branch.as_ptr();
        cached.clone_from(&newer);
        assert_eq!(cached, newer);
        assert_eq!(cached.auth_secret.as_ptr(), secret_at);
        assert_eq!(cached.worktree.branch.as_ptr(), branch_at);
        assert_eq!(newer.clone(), newer);
    }

    #[test]
    fn a_title_is_the_first_printable_line_cut_with_an_ellipsis() {
        assert_eq!(
            prompt_title("\n  \n  fix   the\tbuild \nthen more"),
            "fix the build"
        );
        assert_eq!(prompt_title("a\u{1b}[31mred"), "a [31mred");
        assert_eq!(prompt_title(" \n\t"), "");
        // Reordering and invisible characters are dropped.
        assert_eq!(prompt_title("gpj.\u{202E}exe now"), "gpj. exe now");
        assert_eq!(prompt_title("\u{200B}\u{2028}real title"), "real title");
        assert!(user_title_problem("gpj.\u{202E}exe").is_some());
        assert!(user_title_problem("\u{200B}").is_some());
        assert!(user_title_problem("Release notes é").is_none());
        assert!(user_title_problem("").is_none());
        let long = "word ".repeat(40);
        let t = prompt_title(&long);
        assert_eq!(t.chars().count(), 80, "{t}");
        assert!(t.ends_with("word…") || t.ends_with('…'), "{t}");
        assert!(!t.contains(" …"), "{t}");
        assert_eq!(
            title_from_text("é".repeat(300).as_str(), 200)
                .chars()
                .count(),
            200
        );
    }

    fn profile(container: Option<ContainerAgent>) -> AgentProfile {
        AgentProfile {
            id: AgentProfileId::new(),
            name: "p".into(),
            command: "/host/bin/agent".into(),
            args: vec!["--host".into()],
            env: BTreeMap::from([
                ("KEY".to_owned(), "k".to_owned()),
                ("STATE".to_owned(), "/host/state".to_owned()),
            ]),
            supports_session_resume: true,
            container,
            auth_method: None,
            permission_policy: PermissionPolicy::Allow,
            permission_timeout: DEFAULT_PERMISSION_TIMEOUT,
            config_defaults: BTreeMap::new(),
            mcp_servers: Vec::new(),
            created_at: Utc::now(),
            updated_at: Utc::now(),
        }
    }

    #[test]
    fn a_container_command_applies_to_docker_only() {
        let p = profile(Some(ContainerAgent {
            image: Some("img:1".into()),
            command: "/usr/local/bin/agent".into(),
            args: vec!["--in-image".into()],
            env: BTreeMap::from([("STATE".to_owned(), "/run/state".to_owned())]),
        }));
        let docker = p.agent_command(Runtime::LocalDocker);
        assert_eq!(docker.command, "/usr/local/bin/agent");
        assert_eq!(docker.args, ["--in-image"]);
        assert_eq!(docker.env["KEY"], "k", "the profile's env is kept");
        assert_eq!(docker.env["STATE"], "/run/state", "the container's wins");
        for rt in [Runtime::LocalStandalone, Runtime::Remote] {
            let c = p.agent_command(rt);
            assert_eq!(c.command, "/host/bin/agent");
            assert_eq!(c.env["STATE"], "/host/state");
        }
        assert_eq!(p.container_image(), Some("img:1"));
        let plain = profile(None);
        assert_eq!(
            plain.agent_command(Runtime::LocalDocker).command,
            "/host/bin/agent"
        );
        assert_eq!(plain.container_image(), None);
    }
}
