//! Domain <-> `sessiond.v1` conversions. The domain knows nothing of
//! protobuf; this module is the only place the two meet.

use chrono::{DateTime, Utc};
use sessiond_domain::{
    AgentModes, AgentProfile, Event, EventPayload, ExecutorStatus, Message, MessageKind,
    MessageRole, ResumeReason, Runtime, Session, SessionState, SessionStatus, Task, TaskState,
    UsageTotals, Worktree,
};
use sessiond_proto::sessiond::v1 as pb;

pub fn timestamp(t: DateTime<Utc>) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: t.timestamp(),
        nanos: t.timestamp_subsec_nanos() as i32,
    }
}

pub fn task_state(s: TaskState) -> pb::TaskState {
    match s {
        TaskState::Todo => pb::TaskState::Todo,
        TaskState::InProgress => pb::TaskState::InProgress,
        TaskState::Review => pb::TaskState::Review,
        TaskState::Completed => pb::TaskState::Completed,
        TaskState::Cancelled => pb::TaskState::Cancelled,
    }
}

pub fn session_state(s: SessionState) -> pb::SessionState {
    match s {
        SessionState::Created => pb::SessionState::Created,
        SessionState::Starting => pb::SessionState::Starting,
        SessionState::Running => pb::SessionState::Running,
        SessionState::WaitingForInput => pb::SessionState::WaitingForInput,
        SessionState::Completed => pb::SessionState::Completed,
        SessionState::Cancelled => pb::SessionState::Cancelled,
        SessionState::Error => pb::SessionState::Error,
    }
}

pub fn executor_status(s: ExecutorStatus) -> pb::ExecutorStatus {
    match s {
        ExecutorStatus::Starting => pb::ExecutorStatus::Starting,
        ExecutorStatus::Ready => pb::ExecutorStatus::Ready,
        ExecutorStatus::Error => pb::ExecutorStatus::Error,
        ExecutorStatus::Stopped => pb::ExecutorStatus::Stopped,
    }
}

pub fn runtime(r: Runtime) -> pb::Runtime {
    match r {
        Runtime::LocalDocker => pb::Runtime::LocalDocker,
        Runtime::LocalStandalone => pb::Runtime::LocalStandalone,
        Runtime::Remote => pb::Runtime::Remote,
        Runtime::Custom(_) => pb::Runtime::Custom,
    }
}

/// The runtime a request names by its enum `value` and its `name`
/// (`runtime_name`): `None` when neither does (the caller's default
/// applies); `Err` for a number that names no runtime, an invalid name,
/// RUNTIME_CUSTOM without a name, or two that disagree. Whether a driver is
/// registered for it is the manager's question.
pub fn runtime_from(value: i32, name: &str) -> Result<Option<Runtime>, String> {
    let by_value = match pb::Runtime::try_from(value) {
        Ok(pb::Runtime::Unspecified) => None,
        Ok(pb::Runtime::LocalDocker) => Some(Runtime::LocalDocker),
        Ok(pb::Runtime::LocalStandalone) => Some(Runtime::LocalStandalone),
        Ok(pb::Runtime::Remote) => Some(Runtime::Remote),
        Ok(pb::Runtime::Custom) if name.is_empty() => {
            return Err("runtime_name: RUNTIME_CUSTOM needs the runtime's name".into());
        }
        Ok(pb::Runtime::Custom) => None,
        Err(_) => return Err(format!("runtime: {value} is not a sessiond.v1.Runtime")),
    };
    if name.is_empty() {
        return Ok(by_value);
    }
    let by_name = Runtime::parse(name).map_err(|e| format!("runtime_name: {e}"))?;
    match by_value {
        Some(r) if r != by_name => Err(format!(
            "runtime_name: {by_name:?} names another runtime than runtime {}",
            runtime(r).as_str_name()
        )),
        _ if value == pb::Runtime::Custom as i32 && by_name.is_built_in() => Err(format!(
            "runtime_name: {name} is a built-in runtime; use its own enum value, not RUNTIME_CUSTOM"
        )),
        _ => Ok(Some(by_name)),
    }
}

pub fn role(r: MessageRole) -> pb::MessageRole {
    match r {
        MessageRole::User => pb::MessageRole::User,
        MessageRole::Agent => pb::MessageRole::Agent,
        MessageRole::System => pb::MessageRole::System,
    }
}

pub fn resume_reason(r: ResumeReason) -> pb::ResumeReason {
    match r {
        ResumeReason::None => pb::ResumeReason::Unspecified,
        ResumeReason::AgentNotRunning => pb::ResumeReason::AgentNotRunning,
        ResumeReason::NotResumable => pb::ResumeReason::NotResumable,
        ResumeReason::MissingResumeToken => pb::ResumeReason::MissingResumeToken,
        ResumeReason::SessionEnded => pb::ResumeReason::SessionEnded,
        // The public enum has no value of its own for it (yet): "cannot be
        // resumed", with `error_message` (`container_missing: ...`) saying why.
        ResumeReason::ExecutorGone => pb::ResumeReason::NotResumable,
    }
}

pub fn task(t: &Task) -> pb::Task {
    pb::Task {
        id: t.id.to_string(),
        title: t.title.clone(),
        state: task_state(t.state) as i32,
        created_at: Some(timestamp(t.created_at)),
        updated_at: Some(timestamp(t.updated_at)),
        usage: None,
    }
}

pub fn profile(p: &AgentProfile) -> pb::AgentProfile {
    pb::AgentProfile {
        id: p.id.to_string(),
        name: p.name.clone(),
        command: p.command.clone(),
        args: p.args.clone(),
        supports_session_resume: p.supports_session_resume,
        auth_method: p.auth_method.clone().unwrap_or_default(),
        permission_policy: p.permission_policy.as_str().to_owned(),
        permission_timeout_ms: u64::try_from(p.permission_timeout.as_millis()).unwrap_or(u64::MAX),
    }
}

pub fn worktree(w: &Worktree) -> pb::Worktree {
    pb::Worktree {
        id: w.id.clone(),
        path: w.path.clone(),
        branch: w.branch.clone(),
        repository: w.repository.clone(),
        base: w.base.clone(),
    }
}

pub fn session(s: &Session) -> pb::Session {
    pb::Session {
        id: s.id.to_string(),
        task_id: s.task_id.to_string(),
        state: session_state(s.state) as i32,
        agent_profile_id: s.agent_profile_id.to_string(),
        runtime: runtime(s.runtime) as i32,
        runtime_name: s.runtime.to_string(),
        worktree: Some(worktree(&s.worktree)),
        executor_id: s.executor_id.map(|e| e.to_string()).unwrap_or_default(),
        agent_execution_id: s.agent_execution_id.clone().unwrap_or_default(),
        resume_token: s.resume_token.clone().unwrap_or_default(),
        error_message: s.error_message.clone().unwrap_or_default(),
        version: s.version,
        created_at: Some(timestamp(s.created_at)),
        updated_at: Some(timestamp(s.updated_at)),
        usage: Some(usage_totals(&UsageTotals::from_metadata(&s.metadata))),
        title: s.title.clone(),
        recovering: false,
    }
}

pub fn message(m: &Message) -> pb::Message {
    pb::Message {
        id: m.id.to_string(),
        session_id: m.session_id.to_string(),
        task_id: m.task_id.to_string(),
        role: role(m.role) as i32,
        content: m.content.clone(),
        seq: m.seq,
        complete: m.complete,
        created_at: Some(timestamp(m.created_at)),
        updated_at: Some(timestamp(m.updated_at)),
        kind: message_kind(m.kind) as i32,
        part: parts::part(m.kind, &m.data),
        part_rev: parts::rev(&m.data),
        usage: (m.role == sessiond_domain::MessageRole::User)
            .then(|| sessiond_engine::usage::of_message_data(&m.data))
            .flatten()
            .map(|u| turn_usage(&u)),
        attachments: if m.role == sessiond_domain::MessageRole::User {
            sessiond_engine::attachments::of_message_data(&m.data)
                .iter()
                .map(attachment)
                .collect()
        } else {
            Vec::new()
        },
    }
}

pub fn attachment(a: &sessiond_engine::Attachment) -> pb::Attachment {
    use pb::attachment::Kind;
    use sessiond_engine::Attachment as A;
    pb::Attachment {
        kind: Some(match a {
            A::Image {
                mime_type,
                data,
                path,
            } => Kind::Image(pb::ImageAttachment {
                mime_type: mime_type.clone(),
                data: data.clone(),
                path: path.clone().unwrap_or_default(),
            }),
            A::Link {
                uri,
                name,
                mime_type,
            } => Kind::Link(pb::LinkAttachment {
                uri: uri.clone(),
                name: name.clone(),
                mime_type: mime_type.clone().unwrap_or_default(),
            }),
            A::File { path, .. } => Kind::File(pb::FileAttachment { path: path.clone() }),
        }),
    }
}

/// The API's attachments as the engine takes them; INVALID_ARGUMENT for an
/// empty one.
pub fn attachments_in(list: &[pb::Attachment]) -> Result<Vec<sessiond_engine::Attachment>, String> {
    use pb::attachment::Kind;
    use sessiond_engine::Attachment as A;
    list.iter()
        .enumerate()
        .map(|(i, a)| match &a.kind {
            Some(Kind::Image(img)) => match (img.data.is_empty(), img.path.is_empty()) {
                (false, true) => Ok(A::Image {
                    mime_type: img.mime_type.clone(),
                    data: img.data.clone(),
                    path: None,
                }),
                (true, false) => Ok(A::Image {
                    mime_type: img.mime_type.clone(),
                    data: Vec::new(),
                    path: Some(img.path.clone()),
                }),
                (true, true) => Err(format!(
                    "attachments[{i}]: the image is empty: give its bytes (data; an empty \
                     file has none) or a path in the worktree"
                )),
                (false, false) => Err(format!(
                    "attachments[{i}]: an image needs either its bytes (data) or a worktree path, not both"
                )),
            },
            Some(Kind::Link(l)) => Ok(A::Link {
                uri: l.uri.clone(),
                name: l.name.clone(),
                mime_type: (!l.mime_type.is_empty()).then(|| l.mime_type.clone()),
            }),
            Some(Kind::File(f)) => Ok(A::File {
                path: f.path.clone(),
                contents: Vec::new(),
            }),
            None => Err(format!("attachments[{i}]: empty attachment")),
        })
        .collect()
}

fn message_kind(k: MessageKind) -> pb::MessageKind {
    match k {
        MessageKind::Text => pb::MessageKind::Text,
        MessageKind::ToolCall => pb::MessageKind::ToolCall,
        MessageKind::Plan => pb::MessageKind::Plan,
        MessageKind::Thought => pb::MessageKind::Thought,
        MessageKind::AvailableCommands => pb::MessageKind::AvailableCommands,
        MessageKind::CurrentMode => pb::MessageKind::CurrentMode,
        MessageKind::Other => pb::MessageKind::Other,
        MessageKind::Permission => pb::MessageKind::Permission,
        MessageKind::Terminal => pb::MessageKind::Terminal,
        MessageKind::Unparsed => pb::MessageKind::Unparsed,
    }
}

/// A permission request from its message (kind `Permission`).
pub fn permission_request(m: &Message) -> pb::PermissionRequest {
    parts::permission(&m.id.to_string(), &m.data)
}

/// Activity parts: the stored envelope (`{"rev": n, "update": <ACP JSON>}`,
/// written by the update pump) to typed proto parts. ACP's JSON is the
/// agent's word: a field missing or of another type reads as empty, never
/// as an error (what an agent sent is still shown).
mod parts {
    use pb::message::Part;
    use serde_json::Value;
    use sessiond_domain::MessageKind;
    use sessiond_proto::sessiond::v1 as pb;

    fn envelope(data: &str) -> Option<Value> {
        serde_json::from_str(data).ok()
    }

    pub(super) fn rev(data: &str) -> u64 {
        envelope(data)
            .and_then(|v| v.get("rev")?.as_u64())
            .unwrap_or(0)
    }

    fn s(v: &Value, key: &str) -> String {
        v.get(key)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    }

    fn json_text(v: Option<&Value>) -> String {
        match v {
            None | Some(Value::Null) => String::new(),
            Some(v) => v.to_string(),
        }
    }

    fn list<'a>(v: &'a Value, key: &str) -> impl Iterator<Item = &'a Value> {
        v.get(key).and_then(Value::as_array).into_iter().flatten()
    }

    pub(super) fn part(kind: MessageKind, data: &str) -> Option<Part> {
        let u = envelope(data)?.get("update")?.clone();
        Some(match kind {
            MessageKind::Text | MessageKind::Thought => return None,
            MessageKind::ToolCall => Part::ToolCall(tool_call(&u)),
            MessageKind::Plan => Part::Plan(pb::PlanPart {
                entries: list(&u, "entries")
                    .map(|e| pb::PlanEntry {
                        content: s(e, "content"),
                        priority: s(e, "priority"),
                        status: s(e, "status"),
                    })
                    .collect(),
            }),
            MessageKind::AvailableCommands => Part::AvailableCommands(pb::AvailableCommandsPart {
                commands: list(&u, "availableCommands")
                    .map(|c| pb::AvailableCommand {
                        name: s(c, "name"),
                        description: s(c, "description"),
                        input_hint: c.get("input").map(|i| s(i, "hint")).unwrap_or_default(),
                    })
                    .collect(),
            }),
            MessageKind::CurrentMode => Part::CurrentMode(pb::CurrentModePart {
                mode_id: s(&u, "currentModeId"),
            }),
            MessageKind::Other => Part::Other(pb::RawPart {
                update_kind: s(&u, "sessionUpdate"),
                json: u.to_string(),
            }),
            MessageKind::Permission => Part::Permission(permission_of(&u)),
            MessageKind::Terminal => Part::Terminal(terminal_of(&u)),
            MessageKind::Unparsed => Part::Unparsed(pb::UnparsedPart {
                update_kind: s(&u, "sessionUpdate"),
                method: s(&u, "method"),
                error: s(&u, "error"),
                json: s(&u, "json"),
                truncated: u.get("truncated").and_then(Value::as_bool).unwrap_or(false),
            }),
        })
    }

    /// agentctl's JSON of a terminal (`terminalId`, `command`, `args`,
    /// `cwd`, `output`, `truncated`, `exitStatus`, `released`).
    fn terminal_of(u: &Value) -> pb::TerminalPart {
        let exit = u.get("exitStatus").filter(|e| e.is_object());
        pb::TerminalPart {
            terminal_id: s(u, "terminalId"),
            command: s(u, "command"),
            args: list(u, "args")
                .filter_map(|a| a.as_str().map(str::to_owned))
                .collect(),
            cwd: s(u, "cwd"),
            output: s(u, "output"),
            truncated: u.get("truncated").and_then(Value::as_bool).unwrap_or(false),
            exit_code: exit
                .and_then(|e| e.get("exitCode")?.as_u64())
                .and_then(|c| u32::try_from(c).ok()),
            signal: exit.map(|e| s(e, "signal")).unwrap_or_default(),
            exited: exit.is_some(),
            released: u.get("released").and_then(Value::as_bool).unwrap_or(false),
        }
    }

    /// The request's id is its message's id; the rest is agentctl's JSON
    /// (`requestId`, `turnId`, `toolCall`, `options`, `status`, `optionId`,
    /// `requestedAtMs`, `expiresAtMs`).
    pub(super) fn permission(id: &str, data: &str) -> pb::PermissionRequest {
        let mut p = envelope(data)
            .and_then(|v| v.get("update").cloned())
            .map(|u| permission_of(&u))
            .unwrap_or_default();
        p.request_id = id.to_owned();
        p
    }

    fn ms_timestamp(v: &Value, key: &str) -> Option<prost_types::Timestamp> {
        let ms = i64::try_from(v.get(key)?.as_u64()?).ok()?;
        Some(prost_types::Timestamp {
            seconds: ms.div_euclid(1000),
            nanos: i32::try_from(ms.rem_euclid(1000) * 1_000_000).ok()?,
        })
    }

    fn permission_of(u: &Value) -> pb::PermissionRequest {
        pb::PermissionRequest {
            request_id: s(u, "requestId"),
            turn_id: s(u, "turnId"),
            tool_call: u.get("toolCall").map(tool_call),
            options: list(u, "options")
                .map(|o| pb::PermissionOption {
                    option_id: s(o, "optionId"),
                    name: s(o, "name"),
                    kind: s(o, "kind"),
                })
                .collect(),
            status: Some(s(u, "status"))
                .filter(|k| !k.is_empty())
                .unwrap_or_else(|| "pending".into()),
            option_id: s(u, "optionId"),
            requested_at: ms_timestamp(u, "requestedAtMs"),
            expires_at: ms_timestamp(u, "expiresAtMs"),
            elicitation: u.get("elicitation").map(|e| pb::Elicitation {
                mode: s(e, "mode"),
                message: s(e, "message"),
                requested_schema_json: json_text(e.get("requestedSchema")),
                url: s(e, "url"),
            }),
        }
    }

    fn tool_call(u: &Value) -> pb::ToolCallPart {
        use pb::tool_call_content::Content;
        pb::ToolCallPart {
            tool_call_id: s(u, "toolCallId"),
            title: s(u, "title"),
            // ACP leaves out the defaults (kind other, status pending).
            tool_kind: Some(s(u, "kind"))
                .filter(|k| !k.is_empty())
                .unwrap_or_else(|| "other".into()),
            status: Some(s(u, "status"))
                .filter(|k| !k.is_empty())
                .unwrap_or_else(|| "pending".into()),
            content: list(u, "content")
                .map(|c| {
                    let content = match c.get("type").and_then(Value::as_str) {
                        Some("diff") => Content::Diff(pb::FileDiff {
                            path: s(c, "path"),
                            old_text: c.get("oldText").and_then(Value::as_str).map(str::to_owned),
                            new_text: s(c, "newText"),
                        }),
                        Some("terminal") => Content::TerminalId(s(c, "terminalId")),
                        Some("content")
                            if c.pointer("/content/type").and_then(Value::as_str)
                                == Some("text") =>
                        {
                            Content::Text(
                                c.pointer("/content/text")
                                    .and_then(Value::as_str)
                                    .unwrap_or_default()
                                    .to_owned(),
                            )
                        }
                        _ => Content::OtherJson(c.to_string()),
                    };
                    pb::ToolCallContent {
                        content: Some(content),
                    }
                })
                .collect(),
            locations: list(u, "locations")
                .map(|l| pb::ToolCallLocation {
                    path: s(l, "path"),
                    line: l
                        .get("line")
                        .and_then(Value::as_u64)
                        .and_then(|n| u32::try_from(n).ok()),
                })
                .collect(),
            raw_input_json: json_text(u.get("rawInput")),
            raw_output_json: json_text(u.get("rawOutput")),
        }
    }
}

pub fn status(s: SessionStatus) -> pb::GetSessionStatusResponse {
    pb::GetSessionStatusResponse {
        session_id: s.session_id.to_string(),
        task_id: s.task_id.to_string(),
        state: session_state(s.state) as i32,
        agent_profile_id: s.agent_profile_id.to_string(),
        executor_status: s
            .executor_status
            .map_or(pb::ExecutorStatus::Unspecified, executor_status)
            as i32,
        agent_execution_id: s.agent_execution_id.unwrap_or_default(),
        runtime: runtime(s.runtime) as i32,
        runtime_name: s.runtime.to_string(),
        is_agent_running: s.is_agent_running,
        is_resumable: s.is_resumable,
        needs_resume: s.needs_resume,
        resume_reason: resume_reason(s.resume_reason) as i32,
        worktree_path: s.worktree_path,
        worktree_branch: s.worktree_branch,
        worktree_id: s.worktree_id,
        worktree_repository: s.worktree_repository,
        worktree_base: s.worktree_base,
        error_message: s.error_message.unwrap_or_default(),
        recovering: s.recovering,
        modes: None,
        pending_permissions: Vec::new(),
        agent_recovery: s.agent_recovery.as_ref().map(agent_recovery),
        usage: Some(usage_totals(&s.usage)),
        config_options: Vec::new(),
        queued_messages: s.queued.iter().map(queued_message).collect(),
        queue_held: s.queue_held,
    }
}

pub fn queued_message(q: &sessiond_domain::QueuedMessage) -> pb::QueuedMessage {
    pb::QueuedMessage {
        id: q.id.to_string(),
        content: q.content.clone(),
        queued_at: Some(timestamp(q.queued_at)),
    }
}

pub fn usage_totals(u: &UsageTotals) -> pb::UsageTotals {
    pb::UsageTotals {
        turns: u.turns,
        input_tokens: u.input_tokens,
        output_tokens: u.output_tokens,
        thought_tokens: u.thought_tokens,
        cached_read_tokens: u.cached_read_tokens,
        cached_write_tokens: u.cached_write_tokens,
        total_tokens: u.total_tokens,
        costs: u
            .costs
            .iter()
            .map(|(currency, amount)| pb::Cost {
                amount: *amount,
                currency: currency.clone(),
            })
            .collect(),
    }
}

fn turn_usage(u: &sessiond_domain::TurnUsage) -> pb::TurnUsage {
    pb::TurnUsage {
        input_tokens: u.input_tokens,
        output_tokens: u.output_tokens,
        thought_tokens: u.thought_tokens,
        cached_read_tokens: u.cached_read_tokens,
        cached_write_tokens: u.cached_write_tokens,
        total_tokens: u.total_tokens,
        context_used: u.context_used,
        context_size: u.context_size,
        cost: u.cost.as_ref().map(|c| pb::Cost {
            amount: c.amount,
            currency: c.currency.clone(),
        }),
    }
}

fn agent_recovery(r: &sessiond_domain::AgentRecovery) -> pb::AgentRecovery {
    use sessiond_domain::RecoveryStage as S;
    let (queue_position, queue_length) = r.place.unwrap_or((0, 0));
    pb::AgentRecovery {
        stage: match r.stage {
            S::Queued => pb::RecoveryStage::Queued,
            S::Launching => pb::RecoveryStage::Launching,
            S::Resuming => pb::RecoveryStage::Resuming,
            S::WaitingToRetry => pb::RecoveryStage::WaitingToRetry,
        } as i32,
        queue_position,
        queue_length,
        attempt: r.attempt,
        max_attempts: r.max_attempts,
        last_error: r.last_error.clone().unwrap_or_default(),
        retry_in_ms: r
            .retry_in
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        replayed: r.replayed,
    }
}

pub fn modes(m: &AgentModes) -> pb::SessionModes {
    pb::SessionModes {
        current_mode_id: m.current.clone(),
        available: m
            .available
            .iter()
            .map(|m| pb::SessionMode {
                id: m.id.clone(),
                name: m.name.clone(),
                description: m.description.clone(),
            })
            .collect(),
    }
}

pub fn config_options(m: &AgentModes) -> Vec<pb::ConfigOption> {
    m.config_options
        .iter()
        .map(|o| pb::ConfigOption {
            id: o.id.clone(),
            name: o.name.clone(),
            description: o.description.clone(),
            category: o.category.clone(),
            r#type: o.kind.clone(),
            current_value: o.current.clone(),
            values: o
                .values
                .iter()
                .map(|v| pb::ConfigValue {
                    value: v.value.clone(),
                    name: v.name.clone(),
                    description: v.description.clone(),
                })
                .collect(),
        })
        .collect()
}

pub fn event(e: &Event) -> pb::Event {
    use pb::event::Payload;
    let payload = match &e.payload {
        EventPayload::AgentctlStarting {
            executor_id,
            runtime: r,
            generation,
        } => Payload::AgentctlStarting(pb::AgentctlStarting {
            executor_id: executor_id.to_string(),
            runtime: runtime(*r) as i32,
            runtime_name: r.to_string(),
            generation: *generation,
        }),
        EventPayload::AgentctlReady {
            executor_id,
            runtime: r,
            supports_session_resume,
        } => Payload::AgentctlReady(pb::AgentctlReady {
            executor_id: executor_id.to_string(),
            runtime: runtime(*r) as i32,
            runtime_name: r.to_string(),
            supports_session_resume: *supports_session_resume,
        }),
        EventPayload::AgentctlError {
            executor_id,
            error_message,
        } => Payload::AgentctlError(pb::AgentctlError {
            executor_id: executor_id.to_string(),
            error_message: error_message.clone(),
        }),
        EventPayload::StateChanged {
            from,
            to,
            error_message,
        } => Payload::StateChanged(pb::StateChanged {
            from: session_state(*from) as i32,
            to: session_state(*to) as i32,
            error_message: error_message.clone().unwrap_or_default(),
        }),
        EventPayload::MessageAdded(m) => Payload::MessageAdded(pb::MessageAdded {
            message: Some(message(m)),
        }),
        EventPayload::MessageUpdated(m) => Payload::MessageUpdated(pb::MessageUpdated {
            message: Some(message(m)),
        }),
        EventPayload::TurnEnded {
            turn_id,
            stop_reason,
            error_message,
        } => Payload::TurnEnded(pb::TurnEnded {
            turn_id: turn_id.clone(),
            stop_reason: stop_reason.clone(),
            error_message: error_message.clone().unwrap_or_default(),
        }),
        EventPayload::ConversationReplaced {
            previous_resume_token,
            resume_token,
            reason,
        } => Payload::ConversationReplaced(pb::ConversationReplaced {
            previous_resume_token: previous_resume_token.clone(),
            resume_token: resume_token.clone(),
            reason: reason.clone(),
        }),
        EventPayload::PermissionRequested(m) => {
            Payload::PermissionRequested(pb::PermissionRequested {
                request: Some(permission_request(m)),
            })
        }
        EventPayload::PermissionResolved {
            request_id,
            outcome,
            option_id,
            reason,
        } => Payload::PermissionResolved(pb::PermissionResolved {
            request_id: request_id.clone(),
            outcome: outcome.clone(),
            option_id: option_id.clone().unwrap_or_default(),
            reason: reason.clone().unwrap_or_default(),
        }),
        EventPayload::QueueChanged(queued) => Payload::QueueChanged(pb::QueueChanged {
            queued: queued.iter().map(queued_message).collect(),
        }),
    };
    pb::Event {
        session_id: e.session_id.to_string(),
        task_id: e.task_id.to_string(),
        seq: e.seq,
        task_seq: e.task_seq,
        kind: e.kind().as_str().to_owned(),
        created_at: Some(timestamp(e.created_at)),
        payload: Some(payload),
    }
}

/// A replica row as the API shows it, live as of `now`.
pub fn replica(r: &sessiond_store::ReplicaInfo, now: DateTime<Utc>) -> pb::Replica {
    pb::Replica {
        id: r.id.clone(),
        address: r.address.clone(),
        hostname: r.hostname.clone(),
        pid: r.pid,
        started_at: Some(timestamp(r.started_at)),
        heartbeat_at: Some(timestamp(r.heartbeat_at)),
        live: r.is_live(now),
        owned_executors: r.owned_executors,
        lease_ttl_ms: i64::try_from(r.lease_ttl.as_millis()).unwrap_or(i64::MAX),
    }
}

/// CreateSession's MCP servers as the engine takes them.
pub fn mcp_servers_in(
    list: &[pb::McpServerSpec],
) -> Result<Vec<sessiond_domain::McpServer>, String> {
    use pb::secret_ref::Source;
    use sessiond_domain::{McpServer, McpTransport, SecretValue};
    let values = |i: usize, field: &str, m: &std::collections::HashMap<String, pb::SecretRef>| {
        m.iter()
            .map(|(k, v)| {
                let v = match &v.source {
                    Some(Source::Value(x)) => SecretValue::Plain(x.clone()),
                    Some(Source::Env(x)) => SecretValue::Env(x.clone()),
                    Some(Source::File(x)) => SecretValue::File(x.clone()),
                    None => {
                        return Err(format!(
                            "mcp_servers[{i}].{field}[{k:?}]: give a value, an env or a file"
                        ));
                    }
                };
                Ok((k.clone(), v))
            })
            .collect::<Result<std::collections::BTreeMap<_, _>, String>>()
    };
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let transport = match m.r#type.as_str() {
                "stdio" | "" => McpTransport::Stdio {
                    command: m.command.clone(),
                    args: m.args.clone(),
                    env: values(i, "env", &m.env)?,
                },
                "http" => McpTransport::Http {
                    url: m.url.clone(),
                    headers: values(i, "headers", &m.headers)?,
                },
                "sse" => McpTransport::Sse {
                    url: m.url.clone(),
                    headers: values(i, "headers", &m.headers)?,
                },
                other => {
                    return Err(format!(
                        "mcp_servers[{i}].type: {other:?} is not stdio, http or sse"
                    ));
                }
            };
            Ok(McpServer {
                name: m.name.clone(),
                transport,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_image_attachment_says_what_it_lacks() {
        let image = |data: &[u8], path: &str| pb::Attachment {
            kind: Some(pb::attachment::Kind::Image(pb::ImageAttachment {
                data: data.to_vec(),
                path: path.into(),
                ..Default::default()
            })),
        };
        let empty = attachments_in(&[image(b"", "")]).unwrap_err();
        assert!(empty.contains("the image is empty"), "{empty}");
        let both = attachments_in(&[image(b"x", "a.png")]).unwrap_err();
        assert!(both.contains("not both"), "{both}");
        assert!(attachments_in(&[image(b"x", "")]).is_ok());
    }

    #[test]
    fn every_state_maps_to_its_proto_name() {
        for s in SessionState::ALL {
            let name = session_state(*s).as_str_name();
            assert_eq!(name, format!("SESSION_STATE_{}", s.as_str()));
        }
        for s in TaskState::ALL {
            assert_eq!(
                task_state(*s).as_str_name(),
                format!("TASK_STATE_{}", s.as_str())
            );
        }
        for s in ExecutorStatus::ALL {
            assert_eq!(
                executor_status(*s).as_str_name(),
                format!("EXECUTOR_STATUS_{}", s.as_str().to_uppercase())
            );
        }
        for r in Runtime::ALL {
            assert_eq!(
                runtime(*r).as_str_name(),
                format!("RUNTIME_{}", r.as_str().to_uppercase())
            );
            assert_eq!(runtime_from(runtime(*r) as i32, ""), Ok(Some(*r)));
            assert_eq!(runtime_from(0, r.as_str()), Ok(Some(*r)));
            assert_eq!(runtime_from(runtime(*r) as i32, r.as_str()), Ok(Some(*r)));
            assert!(runtime_from(pb::Runtime::Custom as i32, r.as_str()).is_err());
        }
        let vm = Runtime::parse("vm").unwrap();
        assert_eq!(runtime(vm), pb::Runtime::Custom);
        assert_eq!(runtime_from(pb::Runtime::Custom as i32, "vm"), Ok(Some(vm)));
        assert_eq!(runtime_from(0, "vm"), Ok(Some(vm)));
        for (value, name) in [
            (pb::Runtime::Custom as i32, ""),
            (pb::Runtime::Remote as i32, "vm"),
            (pb::Runtime::Remote as i32, "local_docker"),
            (0, "Not a name"),
        ] {
            let err = runtime_from(value, name).unwrap_err();
            assert!(err.starts_with("runtime_name: "), "{err}");
        }
        assert_eq!(
            resume_reason(ResumeReason::ExecutorGone),
            pb::ResumeReason::NotResumable
        );
        for r in ResumeReason::ALL {
            if *r != ResumeReason::None {
                assert_eq!(
                    resume_reason(*r).as_str_name(),
                    format!("RESUME_REASON_{}", r.as_str().to_uppercase())
                );
            }
        }
        assert_eq!(runtime_from(0, ""), Ok(None));
        assert!(runtime_from(99, "").is_err());
    }
}
