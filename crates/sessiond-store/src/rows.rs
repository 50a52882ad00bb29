//! Rows and their mapping to and from domain types. Everything that reads a
//! row checks it: an unknown state or malformed JSON is [`Error::Corrupt`].

use std::collections::BTreeMap;

use diesel::prelude::*;
use serde_json::{Map, Value, json};
use sessiond_domain::{
    AgentProfile, AgentProfileId, ContainerAgent, Event, EventKind, EventPayload, ExecutorId,
    ExecutorRecord, ExecutorStatus, McpServer, McpTransport, Message, MessageId, MessageKind,
    MessageRole, PermissionPolicy, Runtime, SecretValue, Session, SessionId, SessionState, Task,
    TaskId, TaskState, TitleSource, Worktree,
};

use crate::{
    Error, Result,
    conn::Ts,
    schema::{
        agent_profiles, executors_running, session_events, session_messages, task_sessions, tasks,
    },
};

/// The `metadata` key holding a session's resume token.
pub(crate) const RESUME_TOKEN_KEY: &str = "resume_token";

// ---------------------------------------------------------------- tasks

#[derive(Debug, Queryable, Selectable, Insertable)]
#[diesel(table_name = tasks)]
pub(crate) struct TaskRow {
    pub id: String,
    pub title: String,
    pub state: String,
    pub created_at: Ts,
    pub updated_at: Ts,
}

impl TaskRow {
    pub(crate) fn from_domain(t: &Task) -> TaskRow {
        TaskRow {
            id: t.id.to_string(),
            title: t.title.clone(),
            state: t.state.as_str().to_owned(),
            created_at: Ts::new(t.created_at),
            updated_at: Ts::new(t.updated_at),
        }
    }

    pub(crate) fn into_domain(self) -> Result<Task> {
        const E: &str = "task";
        Ok(Task {
            id: TaskId::parse(&self.id).map_err(|e| Error::corrupt(E, &self.id, e))?,
            state: TaskState::parse(&self.state).map_err(|e| Error::corrupt(E, &self.id, e))?,
            title: self.title,
            created_at: self.created_at.0,
            updated_at: self.updated_at.0,
        })
    }
}

// ---------------------------------------------------------------- profiles

#[derive(Debug, Clone, Queryable, Selectable, Insertable)]
#[diesel(table_name = agent_profiles)]
pub(crate) struct ProfileRow {
    pub id: String,
    pub name: String,
    pub command: String,
    pub args: String,
    pub env: String,
    pub supports_session_resume: bool,
    pub created_at: Ts,
    pub updated_at: Ts,
    /// JSON `{image, command, args, env}`; `NULL` when the profile runs in
    /// a container as on the host.
    pub container: Option<String>,
    pub auth_method: Option<String>,
    pub permission_policy: String,
    pub permission_timeout_ms: i64,
    /// JSON object: config option id -> value.
    pub config_defaults: String,
    /// JSON array of MCP servers; secrets as references only.
    pub mcp_servers: String,
}

impl ProfileRow {
    pub(crate) fn from_domain(p: &AgentProfile) -> ProfileRow {
        ProfileRow {
            id: p.id.to_string(),
            name: p.name.clone(),
            command: p.command.clone(),
            args: json!(p.args).to_string(),
            env: json!(p.env).to_string(),
            supports_session_resume: p.supports_session_resume,
            created_at: Ts::new(p.created_at),
            updated_at: Ts::new(p.updated_at),
            container: p.container.as_ref().map(|c| {
                json!({
                    "image": c.image,
                    "command": c.command,
                    "args": c.args,
                    "env": c.env,
                })
                .to_string()
            }),
            auth_method: p.auth_method.clone(),
            permission_policy: p.permission_policy.as_str().to_owned(),
            permission_timeout_ms: i64::try_from(p.permission_timeout.as_millis())
                .unwrap_or(i64::MAX),
            config_defaults: json!(p.config_defaults).to_string(),
            mcp_servers: Value::Array(p.mcp_servers.iter().map(mcp_json).collect()).to_string(),
        }
    }

    pub(crate) fn into_domain(self) -> Result<AgentProfile> {
        const E: &str = "agent profile";
        let corrupt = |e: String| Error::corrupt(E, &self.id, e);
        let args = match parse_json(&self.args).map_err(corrupt)? {
            Value::Array(items) => items
                .into_iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s),
                    other => Err(corrupt(format!("args: {other} is not a string"))),
                })
                .collect::<Result<Vec<_>>>()?,
            other => return Err(corrupt(format!("args: {other} is not an array"))),
        };
        let env = string_map(parse_json(&self.env).map_err(corrupt)?).map_err(corrupt)?;
        let config_defaults = string_map(parse_json(&self.config_defaults).map_err(corrupt)?)
            .map_err(corrupt)?
            .into_iter()
            .collect();
        let container = match &self.container {
            None => None,
            Some(text) => {
                Some(container_agent(parse_json(text).map_err(corrupt)?).map_err(corrupt)?)
            }
        };
        Ok(AgentProfile {
            id: AgentProfileId::parse(&self.id).map_err(|e| corrupt(e.to_string()))?,
            name: self.name,
            command: self.command,
            args,
            env,
            supports_session_resume: self.supports_session_resume,
            container,
            auth_method: self.auth_method.filter(|m| !m.is_empty()),
            permission_policy: PermissionPolicy::parse(&self.permission_policy)
                .map_err(|e| corrupt(e.to_string()))?,
            permission_timeout: std::time::Duration::from_millis(
                u64::try_from(self.permission_timeout_ms).map_err(|_| {
                    corrupt(format!(
                        "permission_timeout_ms {} < 0",
                        self.permission_timeout_ms
                    ))
                })?,
            ),
            config_defaults,
            mcp_servers: match parse_json(&self.mcp_servers).map_err(corrupt)? {
                Value::Array(items) => items
                    .iter()
                    .map(mcp_server)
                    .collect::<std::result::Result<Vec<_>, String>>()
                    .map_err(corrupt)?,
                other => return Err(corrupt(format!("mcp_servers: {other} is not an array"))),
            },
            created_at: self.created_at.0,
            updated_at: self.updated_at.0,
        })
    }
}

// ---------------------------------------------------------------- sessions

#[derive(Debug, Queryable, Selectable, Insertable)]
#[diesel(table_name = task_sessions)]
pub(crate) struct SessionRow {
    pub id: String,
    pub task_id: String,
    pub state: String,
    pub agent_profile_id: String,
    pub agent_execution_id: Option<String>,
    pub runtime: String,
    pub executor_id: Option<String>,
    pub worktree_id: String,
    pub worktree_path: String,
    pub worktree_branch: String,
    pub worktree_repository: String,
    pub worktree_base: String,
    pub metadata: String,
    pub error_message: Option<String>,
    pub version: i64,
    pub created_at: Ts,
    pub updated_at: Ts,
    pub title: String,
    pub title_source: String,
}

/// The columns a session update may change (not its id, task or creation).
#[derive(Debug, AsChangeset)]
#[diesel(table_name = task_sessions, treat_none_as_null = true)]
pub(crate) struct SessionChanges {
    pub state: String,
    pub agent_profile_id: String,
    pub agent_execution_id: Option<String>,
    pub runtime: String,
    pub executor_id: Option<String>,
    pub worktree_id: String,
    pub worktree_path: String,
    pub worktree_branch: String,
    pub worktree_repository: String,
    pub worktree_base: String,
    pub metadata: String,
    pub error_message: Option<String>,
    pub updated_at: Ts,
}

fn session_metadata(s: &Session) -> String {
    let mut map: Map<String, Value> = s
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), Value::String(v.clone())))
        .collect();
    // The typed field wins over a free-form key of the same name.
    map.remove(RESUME_TOKEN_KEY);
    if let Some(token) = &s.resume_token {
        map.insert(RESUME_TOKEN_KEY.to_owned(), Value::String(token.clone()));
    }
    Value::Object(map).to_string()
}

impl SessionRow {
    pub(crate) fn from_domain(s: &Session) -> SessionRow {
        SessionRow {
            id: s.id.to_string(),
            task_id: s.task_id.to_string(),
            state: s.state.as_str().to_owned(),
            agent_profile_id: s.agent_profile_id.to_string(),
            agent_execution_id: s.agent_execution_id.clone(),
            runtime: s.runtime.as_str().to_owned(),
            executor_id: s.executor_id.map(|e| e.to_string()),
            worktree_id: s.worktree.id.clone(),
            worktree_path: s.worktree.path.clone(),
            worktree_branch: s.worktree.branch.clone(),
            worktree_repository: s.worktree.repository.clone(),
            worktree_base: s.worktree.base.clone(),
            metadata: session_metadata(s),
            error_message: s.error_message.clone(),
            version: s.version,
            created_at: Ts::new(s.created_at),
            updated_at: Ts::new(s.updated_at),
            // A title given at creation is the creator's choice.
            title: s.title.clone(),
            title_source: if s.title.is_empty() {
                String::new()
            } else {
                TitleSource::User.as_str().to_owned()
            },
        }
    }

    pub(crate) fn into_domain(self) -> Result<Session> {
        const E: &str = "session";
        let corrupt = |e: String| Error::corrupt(E, &self.id, e);
        let mut metadata = string_map(parse_json(&self.metadata).map_err(corrupt)?)
            .map_err(|e| corrupt(format!("metadata: {e}")))?;
        let resume_token = metadata.remove(RESUME_TOKEN_KEY);
        Ok(Session {
            id: SessionId::parse(&self.id).map_err(|e| corrupt(e.to_string()))?,
            task_id: TaskId::parse(&self.task_id).map_err(|e| corrupt(e.to_string()))?,
            state: SessionState::parse(&self.state).map_err(|e| corrupt(e.to_string()))?,
            agent_profile_id: AgentProfileId::parse(&self.agent_profile_id)
                .map_err(|e| corrupt(e.to_string()))?,
            agent_execution_id: self.agent_execution_id,
            runtime: Runtime::parse(&self.runtime).map_err(|e| corrupt(e.to_string()))?,
            executor_id: self
                .executor_id
                .as_deref()
                .map(ExecutorId::parse)
                .transpose()
                .map_err(|e| corrupt(e.to_string()))?,
            worktree: Worktree {
                id: self.worktree_id,
                path: self.worktree_path,
                branch: self.worktree_branch,
                repository: self.worktree_repository,
                base: self.worktree_base,
            },
            title: self.title,
            resume_token,
            metadata,
            error_message: self.error_message,
            version: self.version,
            created_at: self.created_at.0,
            updated_at: self.updated_at.0,
        })
    }
}

impl SessionChanges {
    pub(crate) fn from_domain(s: &Session, updated_at: Ts) -> SessionChanges {
        let row = SessionRow::from_domain(s);
        SessionChanges {
            state: row.state,
            agent_profile_id: row.agent_profile_id,
            agent_execution_id: row.agent_execution_id,
            runtime: row.runtime,
            executor_id: row.executor_id,
            worktree_id: row.worktree_id,
            worktree_path: row.worktree_path,
            worktree_branch: row.worktree_branch,
            worktree_repository: row.worktree_repository,
            worktree_base: row.worktree_base,
            metadata: row.metadata,
            error_message: row.error_message,
            updated_at,
        }
    }
}

// ---------------------------------------------------------------- executors

/// As a changeset (an update), it writes neither what never changes (id,
/// session, task, creation) nor the lease (owner, expiry, epoch), which only
/// the lease operations write (`replicas.rs`): a writer holding an older
/// copy must not put an expired lease or a former owner back.
#[derive(Debug, Queryable, Selectable, Insertable, AsChangeset)]
#[diesel(table_name = executors_running, treat_none_as_null = true)]
pub(crate) struct ExecutorRow {
    pub id: String,
    #[diesel(skip_update)]
    pub session_id: String,
    #[diesel(skip_update)]
    pub task_id: String,
    pub runtime: String,
    pub status: String,
    pub agentctl_url: Option<String>,
    pub agentctl_port: Option<i32>,
    pub container_id: Option<String>,
    pub pid: Option<i64>,
    pub pid_start_time: Option<i64>,
    pub auth_secret: String,
    pub generation: i64,
    pub supports_session_resume: bool,
    pub supports_workspace_only: bool,
    pub resume_token: Option<String>,
    pub workspace_path: String,
    pub worktree_id: String,
    pub worktree_path: String,
    pub worktree_branch: String,
    pub worktree_repository: String,
    pub worktree_base: String,
    pub last_seen_at: Option<Ts>,
    pub error_message: Option<String>,
    #[diesel(skip_update)]
    pub owner_id: Option<String>,
    #[diesel(skip_update)]
    pub lease_expires_at: Option<Ts>,
    #[diesel(skip_update)]
    pub lease_epoch: i64,
    pub version: i64,
    #[diesel(skip_update)]
    pub created_at: Ts,
    pub updated_at: Ts,
}

impl ExecutorRow {
    pub(crate) fn from_domain(e: &ExecutorRecord) -> Result<ExecutorRow> {
        let pid_start_time = e
            .pid_start_time
            .map(i64::try_from)
            .transpose()
            .map_err(|_| {
                Error::Invalid(format!("executor {}: pid_start_time out of range", e.id))
            })?;
        Ok(ExecutorRow {
            id: e.id.to_string(),
            session_id: e.session_id.to_string(),
            task_id: e.task_id.to_string(),
            runtime: e.runtime.as_str().to_owned(),
            status: e.status.as_str().to_owned(),
            agentctl_url: e.agentctl_url.clone(),
            agentctl_port: e.agentctl_port.map(i32::from),
            container_id: e.container_id.clone(),
            pid: e.pid.map(i64::from),
            pid_start_time,
            auth_secret: e.auth_secret.clone(),
            generation: e.generation,
            supports_session_resume: e.supports_session_resume,
            supports_workspace_only: e.supports_workspace_only,
            resume_token: e.resume_token.clone(),
            workspace_path: e.workspace_path.clone(),
            worktree_id: e.worktree.id.clone(),
            worktree_path: e.worktree.path.clone(),
            worktree_branch: e.worktree.branch.clone(),
            worktree_repository: e.worktree.repository.clone(),
            worktree_base: e.worktree.base.clone(),
            last_seen_at: e.last_seen_at.map(Ts::new),
            error_message: e.error_message.clone(),
            owner_id: e.owner_id.clone(),
            lease_expires_at: e.lease_expires_at.map(Ts::new),
            lease_epoch: e.lease_epoch,
            version: e.version,
            created_at: Ts::new(e.created_at),
            updated_at: Ts::new(e.updated_at),
        })
    }

    pub(crate) fn into_domain(self) -> Result<ExecutorRecord> {
        const E: &str = "executor";
        let corrupt = |e: String| Error::corrupt(E, &self.id, e);
        Ok(ExecutorRecord {
            id: ExecutorId::parse(&self.id).map_err(|e| corrupt(e.to_string()))?,
            session_id: SessionId::parse(&self.session_id).map_err(|e| corrupt(e.to_string()))?,
            task_id: TaskId::parse(&self.task_id).map_err(|e| corrupt(e.to_string()))?,
            runtime: Runtime::parse(&self.runtime).map_err(|e| corrupt(e.to_string()))?,
            status: ExecutorStatus::parse(&self.status).map_err(|e| corrupt(e.to_string()))?,
            agentctl_url: self.agentctl_url,
            agentctl_port: self
                .agentctl_port
                .map(u16::try_from)
                .transpose()
                .map_err(|e| corrupt(format!("agentctl_port: {e}")))?,
            container_id: self.container_id,
            pid: self
                .pid
                .map(u32::try_from)
                .transpose()
                .map_err(|e| corrupt(format!("pid: {e}")))?,
            pid_start_time: self
                .pid_start_time
                .map(u64::try_from)
                .transpose()
                .map_err(|e| corrupt(format!("pid_start_time: {e}")))?,
            auth_secret: self.auth_secret,
            generation: self.generation,
            supports_session_resume: self.supports_session_resume,
            supports_workspace_only: self.supports_workspace_only,
            resume_token: self.resume_token,
            workspace_path: self.workspace_path,
            worktree: Worktree {
                id: self.worktree_id,
                path: self.worktree_path,
                branch: self.worktree_branch,
                repository: self.worktree_repository,
                base: self.worktree_base,
            },
            last_seen_at: self.last_seen_at.map(|t| t.0),
            error_message: self.error_message,
            owner_id: self.owner_id,
            lease_expires_at: self.lease_expires_at.map(|t| t.0),
            lease_epoch: self.lease_epoch,
            version: self.version,
            created_at: self.created_at.0,
            updated_at: self.updated_at.0,
        })
    }
}

// ---------------------------------------------------------------- messages

#[derive(Debug, Queryable, Selectable, Insertable)]
#[diesel(table_name = session_messages)]
pub(crate) struct MessageRow {
    pub id: String,
    pub session_id: String,
    pub task_id: String,
    pub role: String,
    pub content: String,
    pub seq: i64,
    pub complete: bool,
    pub created_at: Ts,
    pub updated_at: Ts,
    pub kind: String,
    pub data: String,
}

impl MessageRow {
    pub(crate) fn from_domain(m: &Message) -> MessageRow {
        MessageRow {
            id: m.id.to_string(),
            session_id: m.session_id.to_string(),
            task_id: m.task_id.to_string(),
            role: m.role.as_str().to_owned(),
            content: m.content.clone(),
            seq: m.seq,
            complete: m.complete,
            created_at: Ts::new(m.created_at),
            updated_at: Ts::new(m.updated_at),
            kind: m.kind.as_str().to_owned(),
            data: m.data.clone(),
        }
    }

    pub(crate) fn into_domain(self) -> Result<Message> {
        const E: &str = "message";
        let corrupt = |e: String| Error::corrupt(E, &self.id, e);
        Ok(Message {
            id: MessageId::parse(&self.id).map_err(|e| corrupt(e.to_string()))?,
            session_id: SessionId::parse(&self.session_id).map_err(|e| corrupt(e.to_string()))?,
            task_id: TaskId::parse(&self.task_id).map_err(|e| corrupt(e.to_string()))?,
            role: MessageRole::parse(&self.role).map_err(|e| corrupt(e.to_string()))?,
            kind: MessageKind::parse(&self.kind).map_err(|e| corrupt(e.to_string()))?,
            data: self.data,
            content: self.content,
            seq: self.seq,
            complete: self.complete,
            created_at: self.created_at.0,
            updated_at: self.updated_at.0,
        })
    }
}

// ---------------------------------------------------------------- events

#[derive(Debug, Queryable, Selectable, Insertable)]
#[diesel(table_name = session_events)]
pub(crate) struct EventRow {
    pub session_id: String,
    pub seq: i64,
    pub task_id: String,
    pub task_seq: i64,
    pub kind: String,
    pub payload: String,
    pub created_at: Ts,
}

impl EventRow {
    pub(crate) fn from_domain(e: &Event) -> EventRow {
        EventRow {
            session_id: e.session_id.to_string(),
            seq: e.seq,
            task_id: e.task_id.to_string(),
            task_seq: e.task_seq,
            kind: e.kind().as_str().to_owned(),
            payload: encode_payload(&e.payload).to_string(),
            created_at: Ts::new(e.created_at),
        }
    }

    pub(crate) fn into_domain(self) -> Result<Event> {
        const E: &str = "event";
        let id = format!("{}#{}", self.session_id, self.seq);
        let corrupt = |e: String| Error::corrupt(E, &id, e);
        let kind = EventKind::parse(&self.kind)
            .ok_or_else(|| corrupt(format!("unknown kind {:?}", self.kind)))?;
        let payload = parse_json(&self.payload)
            .and_then(|v| decode_payload(kind, &v))
            .map_err(corrupt)?;
        Ok(Event {
            session_id: SessionId::parse(&self.session_id).map_err(|e| corrupt(e.to_string()))?,
            task_id: TaskId::parse(&self.task_id).map_err(|e| corrupt(e.to_string()))?,
            seq: self.seq,
            task_seq: self.task_seq,
            payload,
            created_at: self.created_at.0,
        })
    }
}

fn encode_message(m: &Message) -> Value {
    json!({
        "id": m.id.to_string(),
        "session_id": m.session_id.to_string(),
        "task_id": m.task_id.to_string(),
        "role": m.role.as_str(),
        "content": m.content,
        "seq": m.seq,
        "complete": m.complete,
        "kind": m.kind.as_str(),
        "data": m.data,
        "created_at": Ts::new(m.created_at).0.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        "updated_at": Ts::new(m.updated_at).0.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
    })
}

/// The JSON stored in `session_events.payload`; the kind is its own column.
pub(crate) fn encode_payload(p: &EventPayload) -> Value {
    match p {
        EventPayload::AgentctlStarting {
            executor_id,
            runtime,
            generation,
        } => json!({
            "executor_id": executor_id.to_string(),
            "runtime": runtime.as_str(),
            "generation": generation,
        }),
        EventPayload::AgentctlReady {
            executor_id,
            runtime,
            supports_session_resume,
        } => json!({
            "executor_id": executor_id.to_string(),
            "runtime": runtime.as_str(),
            "supports_session_resume": supports_session_resume,
        }),
        EventPayload::AgentctlError {
            executor_id,
            error_message,
        } => json!({
            "executor_id": executor_id.to_string(),
            "error_message": error_message,
        }),
        EventPayload::StateChanged {
            from,
            to,
            error_message,
        } => json!({
            "from": from.as_str(),
            "to": to.as_str(),
            "error_message": error_message,
        }),
        EventPayload::MessageAdded(m) | EventPayload::MessageUpdated(m) => {
            json!({ "message": encode_message(m) })
        }
        EventPayload::TurnEnded {
            turn_id,
            stop_reason,
            error_message,
        } => json!({
            "turn_id": turn_id,
            "stop_reason": stop_reason,
            "error_message": error_message,
        }),
        EventPayload::ConversationReplaced {
            previous_resume_token,
            resume_token,
            reason,
        } => json!({
            "previous_resume_token": previous_resume_token,
            "resume_token": resume_token,
            "reason": reason,
        }),
        EventPayload::PermissionRequested(m) => json!({ "message": encode_message(m) }),
        EventPayload::PermissionResolved {
            request_id,
            outcome,
            option_id,
            reason,
        } => json!({
            "request_id": request_id,
            "outcome": outcome,
            "option_id": option_id,
            "reason": reason,
        }),
        EventPayload::QueueChanged(queued) => json!({
            "queued": queued.iter().map(|q| json!({
                "id": q.id.to_string(),
                "content": q.content,
                "queued_at": Ts::new(q.queued_at).0.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            })).collect::<Vec<_>>(),
        }),
    }
}

fn decode_payload(kind: EventKind, v: &Value) -> Result<EventPayload, String> {
    Ok(match kind {
        EventKind::AgentctlStarting => EventPayload::AgentctlStarting {
            executor_id: parse_field(v, "executor_id", ExecutorId::parse)?,
            runtime: parse_field(v, "runtime", Runtime::parse)?,
            generation: int(v, "generation")?,
        },
        EventKind::AgentctlReady => EventPayload::AgentctlReady {
            executor_id: parse_field(v, "executor_id", ExecutorId::parse)?,
            runtime: parse_field(v, "runtime", Runtime::parse)?,
            // Null: not probed yet.
            supports_session_resume: match v.get("supports_session_resume") {
                None | Some(Value::Null) => None,
                Some(Value::Bool(b)) => Some(*b),
                Some(other) => {
                    return Err(format!(
                        "field \"supports_session_resume\": {other} is not a boolean"
                    ));
                }
            },
        },
        EventKind::AgentctlError => EventPayload::AgentctlError {
            executor_id: parse_field(v, "executor_id", ExecutorId::parse)?,
            error_message: string(v, "error_message")?.to_owned(),
        },
        EventKind::StateChanged => EventPayload::StateChanged {
            from: parse_field(v, "from", SessionState::parse)?,
            to: parse_field(v, "to", SessionState::parse)?,
            error_message: opt_string(v, "error_message")?,
        },
        EventKind::MessageAdded => {
            EventPayload::MessageAdded(decode_message(field(v, "message")?)?)
        }
        EventKind::MessageUpdated => {
            EventPayload::MessageUpdated(decode_message(field(v, "message")?)?)
        }
        EventKind::TurnEnded => EventPayload::TurnEnded {
            turn_id: string(v, "turn_id")?.to_owned(),
            stop_reason: string(v, "stop_reason")?.to_owned(),
            error_message: opt_string(v, "error_message")?,
        },
        EventKind::ConversationReplaced => EventPayload::ConversationReplaced {
            previous_resume_token: string(v, "previous_resume_token")?.to_owned(),
            resume_token: string(v, "resume_token")?.to_owned(),
            reason: string(v, "reason")?.to_owned(),
        },
        EventKind::PermissionRequested => {
            EventPayload::PermissionRequested(decode_message(field(v, "message")?)?)
        }
        EventKind::PermissionResolved => EventPayload::PermissionResolved {
            request_id: string(v, "request_id")?.to_owned(),
            outcome: string(v, "outcome")?.to_owned(),
            option_id: opt_string(v, "option_id")?,
            reason: opt_string(v, "reason")?,
        },
        EventKind::QueueChanged => EventPayload::QueueChanged(
            field(v, "queued")?
                .as_array()
                .ok_or("field \"queued\" is not an array")?
                .iter()
                .map(|q| {
                    Ok(sessiond_domain::QueuedMessage {
                        id: parse_field(q, "id", MessageId::parse)?,
                        content: string(q, "content")?.to_owned(),
                        queued_at: parse_field(q, "queued_at", parse_time)?,
                    })
                })
                .collect::<Result<_, String>>()?,
        ),
    })
}

fn decode_message(v: &Value) -> Result<Message, String> {
    Ok(Message {
        id: parse_field(v, "id", MessageId::parse)?,
        session_id: parse_field(v, "session_id", SessionId::parse)?,
        task_id: parse_field(v, "task_id", TaskId::parse)?,
        role: parse_field(v, "role", MessageRole::parse)?,
        content: string(v, "content")?.to_owned(),
        // Absent in events stored before activity parts existed: text.
        kind: match opt_string(v, "kind")? {
            Some(k) => MessageKind::parse(&k).map_err(|e| e.to_string())?,
            None => MessageKind::Text,
        },
        data: opt_string(v, "data")?.unwrap_or_default(),
        seq: int(v, "seq")?,
        complete: boolean(v, "complete")?,
        created_at: parse_field(v, "created_at", parse_time)?,
        updated_at: parse_field(v, "updated_at", parse_time)?,
    })
}

fn parse_time(s: &str) -> Result<chrono::DateTime<chrono::Utc>, chrono::ParseError> {
    chrono::DateTime::parse_from_rfc3339(s).map(|t| t.with_timezone(&chrono::Utc))
}

// ---------------------------------------------------------------- JSON helpers

fn parse_json(text: &str) -> Result<Value, String> {
    serde_json::from_str(text).map_err(|e| format!("malformed JSON: {e}"))
}

/// A JSON object of strings. Values of other types are kept as their JSON text.
/// A profile's `container` column.
fn container_agent(v: Value) -> Result<ContainerAgent, String> {
    let Value::Object(mut map) = v else {
        return Err(format!("container: {v} is not an object"));
    };
    let image = match map.remove("image") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s),
        Some(other) => return Err(format!("container.image: {other} is not a string")),
    };
    let command = match map.remove("command") {
        Some(Value::String(s)) => s,
        other => return Err(format!("container.command: {other:?} is not a string")),
    };
    let args = match map.remove("args") {
        None => Vec::new(),
        Some(Value::Array(items)) => items
            .into_iter()
            .map(|v| match v {
                Value::String(s) => Ok(s),
                other => Err(format!("container.args: {other} is not a string")),
            })
            .collect::<Result<Vec<_>, String>>()?,
        Some(other) => return Err(format!("container.args: {other} is not an array")),
    };
    let env = match map.remove("env") {
        None => BTreeMap::new(),
        Some(v) => string_map(v).map_err(|e| format!("container.env: {e}"))?,
    };
    Ok(ContainerAgent {
        image,
        command,
        args,
        env,
    })
}

fn secret_json(v: &SecretValue) -> Value {
    match v {
        SecretValue::Plain(s) => json!({ "plain": s }),
        SecretValue::Env(s) => json!({ "env": s }),
        SecretValue::File(s) => json!({ "file": s }),
    }
}

fn secret(v: &Value) -> Result<SecretValue, String> {
    let one = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_owned);
    one("plain")
        .map(SecretValue::Plain)
        .or_else(|| one("env").map(SecretValue::Env))
        .or_else(|| one("file").map(SecretValue::File))
        .ok_or_else(|| format!("mcp value {v} is none of plain, env, file"))
}

fn secrets_json(m: &BTreeMap<String, SecretValue>) -> Value {
    Value::Object(m.iter().map(|(k, v)| (k.clone(), secret_json(v))).collect())
}

fn secrets(v: Option<&Value>) -> Result<BTreeMap<String, SecretValue>, String> {
    match v {
        None => Ok(BTreeMap::new()),
        Some(Value::Object(m)) => m.iter().map(|(k, v)| Ok((k.clone(), secret(v)?))).collect(),
        Some(other) => Err(format!("mcp values {other} are not an object")),
    }
}

/// An MCP server as stored: secret values as references, never resolved.
fn mcp_json(s: &McpServer) -> Value {
    match &s.transport {
        McpTransport::Stdio { command, args, env } => json!({
            "name": s.name, "type": "stdio", "command": command, "args": args,
            "env": secrets_json(env),
        }),
        McpTransport::Http { url, headers } => json!({
            "name": s.name, "type": "http", "url": url, "headers": secrets_json(headers),
        }),
        McpTransport::Sse { url, headers } => json!({
            "name": s.name, "type": "sse", "url": url, "headers": secrets_json(headers),
        }),
    }
}

fn mcp_server(v: &Value) -> Result<McpServer, String> {
    let s = |k: &str| {
        v.get(k)
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| format!("mcp server {v}: no {k}"))
    };
    let transport = match s("type")?.as_str() {
        "stdio" => McpTransport::Stdio {
            command: s("command")?,
            args: v
                .get("args")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(|a| a.as_str().map(str::to_owned))
                .collect(),
            env: secrets(v.get("env"))?,
        },
        "http" => McpTransport::Http {
            url: s("url")?,
            headers: secrets(v.get("headers"))?,
        },
        "sse" => McpTransport::Sse {
            url: s("url")?,
            headers: secrets(v.get("headers"))?,
        },
        other => return Err(format!("mcp server type {other:?}")),
    };
    Ok(McpServer {
        name: s("name")?,
        transport,
    })
}

fn string_map(v: Value) -> Result<BTreeMap<String, String>, String> {
    match v {
        Value::Object(map) => Ok(map
            .into_iter()
            .map(|(k, v)| match v {
                Value::String(s) => (k, s),
                other => (k, other.to_string()),
            })
            .collect()),
        other => Err(format!("{other} is not an object")),
    }
}

fn field<'a>(v: &'a Value, key: &str) -> Result<&'a Value, String> {
    v.get(key).ok_or_else(|| format!("missing field {key:?}"))
}

fn string<'a>(v: &'a Value, key: &str) -> Result<&'a str, String> {
    field(v, key)?
        .as_str()
        .ok_or_else(|| format!("field {key:?} is not a string"))
}

fn opt_string(v: &Value, key: &str) -> Result<Option<String>, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(format!("field {key:?} is not a string")),
    }
}

fn int(v: &Value, key: &str) -> Result<i64, String> {
    field(v, key)?
        .as_i64()
        .ok_or_else(|| format!("field {key:?} is not an integer"))
}

fn boolean(v: &Value, key: &str) -> Result<bool, String> {
    field(v, key)?
        .as_bool()
        .ok_or_else(|| format!("field {key:?} is not a boolean"))
}

fn parse_field<T, E: std::fmt::Display>(
    v: &Value,
    key: &str,
    parse: impl FnOnce(&str) -> Result<T, E>,
) -> Result<T, String> {
    parse(string(v, key)?).map_err(|e| format!("field {key:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message() -> Message {
        let now = crate::conn::now();
        Message {
            id: MessageId::new(),
            session_id: SessionId::new(),
            task_id: TaskId::new(),
            role: MessageRole::Agent,
            content: "hello \"world\"".into(),
            kind: MessageKind::Plan,
            data: r#"{"rev":1,"update":{"entries":[]}}"#.into(),
            seq: 3,
            complete: false,
            created_at: now,
            updated_at: now,
        }
    }

    #[test]
    fn every_payload_round_trips_through_json() {
        let payloads = vec![
            EventPayload::AgentctlStarting {
                executor_id: ExecutorId::new(),
                runtime: Runtime::LocalDocker,
                generation: 7,
            },
            EventPayload::AgentctlReady {
                executor_id: ExecutorId::new(),
                runtime: Runtime::LocalStandalone,
                supports_session_resume: None,
            },
            EventPayload::AgentctlReady {
                executor_id: ExecutorId::new(),
                runtime: Runtime::Remote,
                supports_session_resume: Some(true),
            },
            EventPayload::AgentctlError {
                executor_id: ExecutorId::new(),
                error_message: "gone".into(),
            },
            EventPayload::StateChanged {
                from: SessionState::Running,
                to: SessionState::Error,
                error_message: Some("boom".into()),
            },
            EventPayload::StateChanged {
                from: SessionState::Created,
                to: SessionState::Starting,
                error_message: None,
            },
            EventPayload::MessageAdded(message()),
            EventPayload::MessageUpdated(message()),
            EventPayload::PermissionRequested(message()),
            EventPayload::PermissionResolved {
                request_id: "r".into(),
                outcome: "timed_out".into(),
                option_id: Some("reject".into()),
                reason: Some("no answer".into()),
            },
            EventPayload::PermissionResolved {
                request_id: "r".into(),
                outcome: "cancelled".into(),
                option_id: None,
                reason: None,
            },
            EventPayload::TurnEnded {
                turn_id: "t".into(),
                stop_reason: "cancelled".into(),
                error_message: None,
            },
            EventPayload::TurnEnded {
                turn_id: "t".into(),
                stop_reason: "error".into(),
                error_message: Some("boom".into()),
            },
            EventPayload::ConversationReplaced {
                previous_resume_token: "a".into(),
                resume_token: "b".into(),
                reason: "not found".into(),
            },
            EventPayload::QueueChanged(Vec::new()),
            EventPayload::QueueChanged(vec![sessiond_domain::QueuedMessage {
                id: MessageId::new(),
                content: "next \"one\"".into(),
                queued_at: crate::conn::now(),
            }]),
        ];
        for p in payloads {
            let text = encode_payload(&p).to_string();
            let back = decode_payload(p.kind(), &parse_json(&text).expect("json")).expect("decode");
            assert_eq!(back, p);
        }
    }

    #[test]
    fn unknown_kind_is_corrupt() {
        let row = EventRow {
            session_id: SessionId::new().to_string(),
            seq: 1,
            task_id: TaskId::new().to_string(),
            task_seq: 1,
            kind: "session.nope".into(),
            payload: "{}".into(),
            created_at: Ts::new(crate::conn::now()),
        };
        assert!(matches!(row.into_domain(), Err(Error::Corrupt { .. })));
    }
}
