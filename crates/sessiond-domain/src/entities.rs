//! The records sessiond keeps. Plain data: the store maps them to rows, the
//! server to protobuf messages.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};

use crate::{
    ids::{AgentProfileId, ExecutorId, MessageId, SessionId, TaskId},
    states::{ExecutorStatus, MessageRole, Runtime, SessionState, TaskState},
};

/// A unit of work on a repository; it has one or more sessions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Task {
    pub id: TaskId,
    pub title: String,
    pub state: TaskState,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// How to start an agent, and whether it claims to resume sessions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentProfile {
    pub id: AgentProfileId,
    /// Unique, human-chosen (e.g. `demo`, `claude-code`).
    pub name: String,
    pub command: String,
    pub args: Vec<String>,
    pub env: BTreeMap<String, String>,
    /// The profile's claim. The agent's own capability answer can only lower it.
    pub supports_session_resume: bool,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// The working tree a session's agent works in.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Worktree {
    pub id: String,
    pub path: String,
    pub branch: String,
}

/// One conversation with one agent, inside one executor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    pub id: SessionId,
    pub task_id: TaskId,
    pub state: SessionState,
    pub agent_profile_id: AgentProfileId,
    /// Id of the current agent execution (the executor id and its generation).
    pub agent_execution_id: Option<String>,
    pub runtime: Runtime,
    pub executor_id: Option<ExecutorId>,
    pub worktree: Worktree,
    /// The agent's token for resuming this conversation (stored in `metadata`).
    pub resume_token: Option<String>,
    /// Other metadata, free-form.
    pub metadata: BTreeMap<String, String>,
    pub error_message: Option<String>,
    /// Grows by one with every write; a writer holding an older value loses.
    pub version: i64,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// A row of `executors_running`: what the backend needs to find, trust and
/// reattach to an executor after it restarts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecutorRecord {
    pub id: ExecutorId,
    pub session_id: SessionId,
    pub task_id: TaskId,
    pub runtime: Runtime,
    pub status: ExecutorStatus,
    pub agentctl_url: Option<String>,
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
    pub supports_session_resume: bool,
    pub supports_workspace_only: bool,
    pub resume_token: Option<String>,
    pub workspace_path: String,
    pub worktree: Worktree,
    pub last_seen_at: Option<DateTime<Utc>>,
    pub error_message: Option<String>,
    /// The backend replica that owns this executor, and until when.
    pub owner_id: Option<String>,
    pub lease_expires_at: Option<DateTime<Utc>>,
    pub version: i64,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

impl ExecutorRecord {
    /// The id of the agent execution this record describes right now.
    pub fn execution_id(&self) -> String {
        format!("{}/{}", self.id, self.generation)
    }
}

/// A message of a session. An agent's streamed reply is one message, added
/// when its first chunk arrives and updated as the rest arrive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub id: MessageId,
    pub session_id: SessionId,
    pub task_id: TaskId,
    pub role: MessageRole,
    pub content: String,
    /// Order within the session, from 1.
    pub seq: i64,
    /// False while the agent is still streaming it.
    pub complete: bool,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}
