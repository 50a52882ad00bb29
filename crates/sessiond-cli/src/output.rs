//! Readable text and `--json` output of every result.

use std::io::Write;

use serde_json::{Value, json};
use sessiond_proto::sessiond::v1 as pb;

#[derive(Debug, Clone, Copy)]
pub struct Out {
    pub json: bool,
    pub quiet: bool,
}

fn ts(t: Option<&prost_types::Timestamp>) -> String {
    t.and_then(|t| chrono::DateTime::from_timestamp(t.seconds, t.nanos.max(0) as u32))
        .map(|d| d.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
        .unwrap_or_default()
}

/// `SESSION_STATE_WAITING_FOR_INPUT` -> `WAITING_FOR_INPUT`.
fn short(name: &str, prefix: &str) -> String {
    name.strip_prefix(prefix).unwrap_or(name).to_owned()
}

fn task_state(v: i32) -> String {
    pb::TaskState::try_from(v).map_or(v.to_string(), |s| short(s.as_str_name(), "TASK_STATE_"))
}
fn session_state(v: i32) -> String {
    pb::SessionState::try_from(v)
        .map_or(v.to_string(), |s| short(s.as_str_name(), "SESSION_STATE_"))
}
fn executor_status(v: i32) -> String {
    pb::ExecutorStatus::try_from(v).map_or(v.to_string(), |s| {
        short(s.as_str_name(), "EXECUTOR_STATUS_").to_lowercase()
    })
}
/// The runtime's name as the server sent it (a custom runtime's is only
/// there), else the enum's.
fn runtime(v: i32, name: &str) -> String {
    if !name.is_empty() {
        return name.to_owned();
    }
    pb::Runtime::try_from(v).map_or(v.to_string(), |s| {
        short(s.as_str_name(), "RUNTIME_").to_lowercase()
    })
}
fn role(v: i32) -> String {
    pb::MessageRole::try_from(v).map_or(v.to_string(), |s| {
        short(s.as_str_name(), "MESSAGE_ROLE_").to_lowercase()
    })
}
fn resume_reason(v: i32) -> String {
    pb::ResumeReason::try_from(v).map_or(v.to_string(), |s| {
        short(s.as_str_name(), "RESUME_REASON_").to_lowercase()
    })
}

/// A server-provided string made safe for a terminal: control characters
/// (escape sequences, NUL, newlines) and bidirectional overrides are shown
/// escaped, never interpreted.
pub fn printable(text: &str) -> String {
    escaped(text, |_| false)
}

/// Text an agent or a user wrote (a reply, a message, an error), made safe
/// for a terminal as [`printable`], keeping its lines and tabs: an agent's
/// reply cannot move the cursor, retitle the window, reach the clipboard
/// or hide a line.
pub fn text(text: &str) -> String {
    escaped(text, |c| c == '\n' || c == '\t')
}

/// Whether `c` reorders text on display (Unicode bidirectional controls).
fn is_bidi_control(c: char) -> bool {
    matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

fn escaped(text: &str, keep: impl Fn(char) -> bool) -> String {
    let unsafe_char = |c: char| (c.is_control() || is_bidi_control(c)) && !keep(c);
    if !text.chars().any(unsafe_char) {
        return text.to_owned();
    }
    text.chars()
        .map(|c| {
            if unsafe_char(c) {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

fn task_json(t: &pb::Task) -> Value {
    let mut v = json!({
        "id": t.id, "title": t.title, "state": task_state(t.state),
        "created_at": ts(t.created_at.as_ref()), "updated_at": ts(t.updated_at.as_ref()),
    });
    if let Some(u) = &t.usage {
        v["usage"] = usage_json(u);
    }
    v
}

fn usage_json(u: &pb::UsageTotals) -> Value {
    json!({
        "turns": u.turns, "input_tokens": u.input_tokens, "output_tokens": u.output_tokens,
        "thought_tokens": u.thought_tokens, "cached_read_tokens": u.cached_read_tokens,
        "cached_write_tokens": u.cached_write_tokens, "total_tokens": u.total_tokens,
        "costs": u.costs.iter().map(|c| json!({"amount": c.amount, "currency": c.currency})).collect::<Vec<_>>(),
    })
}

fn turn_usage_json(u: &pb::TurnUsage) -> Value {
    json!({
        "input_tokens": u.input_tokens, "output_tokens": u.output_tokens,
        "thought_tokens": u.thought_tokens, "cached_read_tokens": u.cached_read_tokens,
        "cached_write_tokens": u.cached_write_tokens, "total_tokens": u.total_tokens,
        "context_used": u.context_used, "context_size": u.context_size,
        "cost": u.cost.as_ref().map(|c| json!({"amount": c.amount, "currency": c.currency})),
    })
}

fn costs_text(costs: &[pb::Cost]) -> String {
    costs
        .iter()
        .map(|c| format!("{} {}", trim_amount(c.amount), c.currency))
        .collect::<Vec<_>>()
        .join(" + ")
}

/// An amount with up to 4 decimals, trailing zeros dropped.
fn trim_amount(a: f64) -> String {
    let s = format!("{a:.4}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s.is_empty() {
        "0".into()
    } else {
        s.to_owned()
    }
}

/// `3 turns, 450 tokens (300 in, 150 out), cost 0.75 USD`.
pub fn usage_line(u: &pb::UsageTotals) -> String {
    if u.turns == 0 {
        return "none reported".into();
    }
    let mut parts = vec![
        format!("{} in", u.input_tokens),
        format!("{} out", u.output_tokens),
    ];
    if u.thought_tokens > 0 {
        parts.push(format!("{} thought", u.thought_tokens));
    }
    if u.cached_read_tokens + u.cached_write_tokens > 0 {
        parts.push(format!(
            "{} cache read, {} cache write",
            u.cached_read_tokens, u.cached_write_tokens
        ));
    }
    let mut line = format!(
        "{} turn{}, {} tokens ({})",
        u.turns,
        if u.turns == 1 { "" } else { "s" },
        u.total_tokens,
        parts.join(", ")
    );
    if !u.costs.is_empty() {
        line.push_str(&format!(", cost {}", costs_text(&u.costs)));
    }
    line
}

/// The short form for lists: `450 tok 0.75 USD`, `-` when none.
fn usage_short(u: Option<&pb::UsageTotals>) -> String {
    match u.filter(|u| u.turns > 0) {
        None => "-".into(),
        Some(u) if u.costs.is_empty() => format!("{} tok", u.total_tokens),
        Some(u) => format!("{} tok {}", u.total_tokens, costs_text(&u.costs)),
    }
}

/// `[usage] 150 tokens (100 in, 50 out), context 2000/200000, cost 0.25 USD`.
pub fn turn_usage_line(u: &pb::TurnUsage) -> String {
    let mut parts = Vec::new();
    let tokens = u
        .total_tokens
        .unwrap_or(u.input_tokens.unwrap_or(0) + u.output_tokens.unwrap_or(0));
    if u.total_tokens.is_some() || u.input_tokens.is_some() || u.output_tokens.is_some() {
        parts.push(format!(
            "{tokens} tokens ({} in, {} out)",
            u.input_tokens.unwrap_or(0),
            u.output_tokens.unwrap_or(0)
        ));
    }
    if let (Some(used), Some(size)) = (u.context_used, u.context_size) {
        parts.push(format!("context {used}/{size}"));
    }
    if let Some(c) = &u.cost {
        parts.push(format!("cost {}", costs_text(std::slice::from_ref(c))));
    }
    format!("[usage] {}", parts.join(", "))
}

fn session_json(s: &pb::Session) -> Value {
    let w = s.worktree.clone().unwrap_or_default();
    json!({
        "id": s.id, "task_id": s.task_id, "state": session_state(s.state),
        "agent_profile_id": s.agent_profile_id, "runtime": runtime(s.runtime, &s.runtime_name),
        "worktree": {"id": w.id, "path": w.path, "branch": w.branch,
                     "repository": w.repository, "base": w.base},
        "executor_id": s.executor_id, "agent_execution_id": s.agent_execution_id,
        "resume_token": s.resume_token, "error_message": s.error_message,
        "version": s.version,
        "created_at": ts(s.created_at.as_ref()), "updated_at": ts(s.updated_at.as_ref()),
        "usage": s.usage.as_ref().map(usage_json), "title": s.title,
        "recovering": s.recovering,
    })
}

pub fn message_json(m: &pb::Message) -> Value {
    let mut v = json!({
        "id": m.id, "session_id": m.session_id, "task_id": m.task_id,
        "role": role(m.role), "content": m.content, "seq": m.seq, "complete": m.complete,
        "created_at": ts(m.created_at.as_ref()), "updated_at": ts(m.updated_at.as_ref()),
        "kind": kind_name(m.kind),
    });
    if let Some(part) = part_json(m) {
        v["part"] = part;
    }
    if let Some(u) = &m.usage {
        v["usage"] = turn_usage_json(u);
    }
    v
}

/// True for text (a user message, a reply, a system note); false for the
/// agent's activity parts (tool calls, plans, thoughts, ...).
pub fn is_text(m: &pb::Message) -> bool {
    matches!(
        pb::MessageKind::try_from(m.kind),
        Ok(pb::MessageKind::Text | pb::MessageKind::Unspecified) | Err(_)
    )
}

fn kind_name(k: i32) -> &'static str {
    match pb::MessageKind::try_from(k) {
        Ok(pb::MessageKind::ToolCall) => "tool_call",
        Ok(pb::MessageKind::Plan) => "plan",
        Ok(pb::MessageKind::Thought) => "thought",
        Ok(pb::MessageKind::AvailableCommands) => "available_commands",
        Ok(pb::MessageKind::CurrentMode) => "current_mode",
        Ok(pb::MessageKind::Other) => "other",
        Ok(pb::MessageKind::Permission) => "permission",
        Ok(pb::MessageKind::Terminal) => "terminal",
        Ok(pb::MessageKind::Unparsed) => "unparsed",
        _ => "text",
    }
}

fn part_json(m: &pb::Message) -> Option<Value> {
    use pb::message::Part;
    use pb::tool_call_content::Content;
    Some(match m.part.as_ref()? {
        Part::ToolCall(t) => json!({
            "tool_call_id": t.tool_call_id, "title": t.title, "tool_kind": t.tool_kind,
            "status": t.status,
            "content": t.content.iter().map(|c| match &c.content {
                Some(Content::Text(s)) => json!({"text": s}),
                Some(Content::Diff(d)) => json!({"diff": {"path": d.path, "old_text": d.old_text, "new_text": d.new_text}}),
                Some(Content::TerminalId(id)) => json!({"terminal_id": id}),
                Some(Content::OtherJson(s)) => json!({"other_json": s}),
                None => Value::Null,
            }).collect::<Vec<_>>(),
            "locations": t.locations.iter().map(|l| json!({"path": l.path, "line": l.line})).collect::<Vec<_>>(),
            "raw_input": raw_json(&t.raw_input_json), "raw_output": raw_json(&t.raw_output_json),
        }),
        Part::Plan(p) => json!({"entries": p.entries.iter().map(|e| json!({
            "content": e.content, "priority": e.priority, "status": e.status,
        })).collect::<Vec<_>>()}),
        Part::AvailableCommands(c) => json!({"commands": c.commands.iter().map(|c| json!({
            "name": c.name, "description": c.description, "input_hint": c.input_hint,
        })).collect::<Vec<_>>()}),
        Part::CurrentMode(c) => json!({"mode_id": c.mode_id}),
        Part::Other(r) => json!({"update_kind": r.update_kind, "json": r.json}),
        Part::Permission(p) => permission_json(p),
        Part::Terminal(t) => json!({
            "terminal_id": t.terminal_id, "command": t.command, "args": t.args, "cwd": t.cwd,
            "output": t.output, "truncated": t.truncated, "exit_code": t.exit_code,
            "signal": t.signal, "exited": t.exited, "released": t.released,
        }),
        Part::Unparsed(u) => json!({
            "update_kind": u.update_kind, "method": u.method, "error": u.error,
            "json": u.json, "truncated": u.truncated,
        }),
    })
}

/// How a terminal stands: `running`, `exit 0`, `signal SIGKILL`.
fn terminal_state(t: &pb::TerminalPart) -> String {
    match (t.exited, t.exit_code, t.signal.as_str()) {
        (false, _, _) if t.released => "released".into(),
        (false, _, _) => "running".into(),
        (true, Some(code), _) => format!("exit {code}"),
        (true, None, "") => "exited".into(),
        (true, None, sig) => format!("signal {sig}"),
    }
}

fn permission_json(p: &pb::PermissionRequest) -> Value {
    json!({
        "request_id": p.request_id, "turn_id": p.turn_id,
        "title": p.tool_call.as_ref().map(|t| t.title.clone()).unwrap_or_default(),
        "options": p.options.iter().map(|o| json!({
            "option_id": o.option_id, "name": o.name, "kind": o.kind,
        })).collect::<Vec<_>>(),
        "status": p.status, "option_id": p.option_id,
        "expires_at": ts(p.expires_at.as_ref()),
    })
}

/// `write notes.txt: allow (allow_once), reject (reject_once)`.
fn permission_line(p: &pb::PermissionRequest) -> String {
    if let Some(e) = &p.elicitation {
        let what = match e.mode.as_str() {
            "url" => format!("visit {}", e.url),
            _ => format!("fill the form {}", e.requested_schema_json),
        };
        return format!(
            "{} ({what}; answer accept --values JSON, decline or cancel)",
            e.message
        );
    }
    let title = p.tool_call.as_ref().map_or("", |t| t.title.as_str());
    let options: Vec<String> = p
        .options
        .iter()
        .map(|o| format!("{} ({})", o.option_id, o.kind))
        .collect();
    format!("{title}: {}", options.join(", "))
}

/// Output lines of a terminal an activity line shows.
const TERMINAL_LINES: usize = 10;

/// A part's raw JSON text as JSON (null when empty, a string if it does
/// not parse).
fn raw_json(text: &str) -> Value {
    if text.is_empty() {
        return Value::Null;
    }
    serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_owned()))
}

/// Text of a tool's raw output: a string, content blocks' texts, or the
/// first output-like field of an object (agents name them differently).
fn output_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Array(items) => {
            let texts: Vec<&str> = items
                .iter()
                .filter_map(|i| i.get("text").and_then(Value::as_str))
                .collect();
            (!texts.is_empty()).then(|| texts.join("\n"))
        }
        Value::Object(o) => {
            for key in ["formatted_output", "aggregated_output", "output", "stdout"] {
                if let Some(s) = o.get(key).and_then(Value::as_str) {
                    let mut out = s.to_owned();
                    if let Some(err) = o.get("stderr").and_then(Value::as_str)
                        && key == "stdout"
                        && !err.is_empty()
                    {
                        out.push_str(err);
                    }
                    return Some(out);
                }
            }
            o.get("content").and_then(output_text)
        }
        _ => None,
    }
}

/// What a tool call's raw input and output say it did, as lines: the
/// command and where it ran, its exit code, the last lines of its output
/// (other raw input as compact JSON).
fn tool_detail(t: &pb::ToolCallPart) -> Vec<String> {
    let mut lines = Vec::new();
    let input = raw_json(&t.raw_input_json);
    let command = match input.get("command") {
        Some(Value::String(c)) => Some(c.clone()),
        Some(Value::Array(parts)) => Some(
            parts
                .iter()
                .map(|p| p.as_str().map_or_else(|| p.to_string(), str::to_owned))
                .collect::<Vec<_>>()
                .join(" "),
        ),
        _ => None,
    };
    match command {
        Some(c) => {
            let mut line = format!("$ {c}");
            if let Some(cwd) = input.get("cwd").and_then(Value::as_str) {
                line.push_str(&format!("  (in {cwd})"));
            }
            lines.push(line);
        }
        None if !input.is_null() && input != json!({}) => {
            let text = input.to_string();
            let cut: String = text.chars().take(200).collect();
            let more = if cut.len() < text.len() { "..." } else { "" };
            lines.push(format!("input {cut}{more}"));
        }
        None => {}
    }
    let output = raw_json(&t.raw_output_json);
    let exit = ["exit_code", "exitCode"]
        .iter()
        .find_map(|k| output.get(*k)?.as_i64());
    if let Some(code) = exit {
        lines.push(format!("exit {code}"));
    }
    if let Some(text) = output_text(&output) {
        let all: Vec<&str> = text.lines().collect();
        let shown = &all[all.len().saturating_sub(TERMINAL_LINES)..];
        if shown.len() < all.len() {
            lines.push("...".into());
        }
        lines.extend(shown.iter().map(|l| (*l).to_owned()));
    }
    lines
}

/// One line for an activity part, as `send` prints it while the turn
/// streams and `messages` lists it: `[tool edit] write notes.txt: completed`.
pub fn activity_line(m: &pb::Message) -> String {
    use pb::message::Part;
    match m.part.as_ref() {
        Some(Part::ToolCall(t)) => {
            let mut line = format!("[tool {}] {}: {}", t.tool_kind, t.title, t.status);
            for c in &t.content {
                if let Some(pb::tool_call_content::Content::Diff(d)) = &c.content {
                    line.push_str(&format!(" (diff {})", d.path));
                }
            }
            // Tool output is the agent's; control characters shown escaped.
            for l in tool_detail(t) {
                line.push_str("\n  ");
                line.push_str(&printable(&l));
            }
            line
        }
        Some(Part::Plan(p)) => {
            let mut line = "[plan]".to_owned();
            for e in &p.entries {
                line.push_str(&format!("\n  [{}] {}", e.status, e.content));
            }
            line
        }
        Some(Part::AvailableCommands(_)) => format!("[commands] {}", m.content),
        Some(Part::CurrentMode(c)) => format!("[mode] {}", c.mode_id),
        Some(Part::Other(r)) => format!("[{}]", r.update_kind),
        Some(Part::Unparsed(u)) => {
            let what = if u.update_kind.is_empty() {
                &u.method
            } else {
                &u.update_kind
            };
            format!("[unparsed {what}] {}", u.error)
        }
        Some(Part::Terminal(t)) => {
            // The command and how it ended, then the output's last lines.
            let mut line = format!("[terminal] {}: {}", m.content, terminal_state(t));
            let lines: Vec<&str> = t.output.lines().collect();
            let shown = &lines[lines.len().saturating_sub(TERMINAL_LINES)..];
            if shown.len() < lines.len() || t.truncated {
                line.push_str("\n  ...");
            }
            for l in shown {
                line.push_str("\n  ");
                line.push_str(l);
            }
            line
        }
        Some(Part::Permission(p)) => {
            let title = p.tool_call.as_ref().map_or("", |t| t.title.as_str());
            match p.option_id.as_str() {
                "" => format!("[permission] {title}: {}", p.status),
                o => format!("[permission] {title}: {} {o}", p.status),
            }
        }
        None => format!("[{}] {}", kind_name(m.kind), m.content),
    }
}

fn event_json(e: &pb::Event) -> Value {
    use pb::event::Payload;
    let payload = match &e.payload {
        Some(Payload::AgentctlStarting(p)) => json!({
            "executor_id": p.executor_id, "runtime": runtime(p.runtime, &p.runtime_name), "generation": p.generation,
        }),
        Some(Payload::AgentctlReady(p)) => json!({
            "executor_id": p.executor_id, "runtime": runtime(p.runtime, &p.runtime_name),
            "supports_session_resume": p.supports_session_resume,
        }),
        Some(Payload::AgentctlError(p)) => json!({
            "executor_id": p.executor_id, "error_message": p.error_message,
        }),
        Some(Payload::StateChanged(p)) => json!({
            "from": session_state(p.from), "to": session_state(p.to),
            "error_message": p.error_message,
        }),
        Some(Payload::MessageAdded(p)) => json!({"message": p.message.as_ref().map(message_json)}),
        Some(Payload::MessageUpdated(p)) => {
            json!({"message": p.message.as_ref().map(message_json)})
        }
        Some(Payload::TurnEnded(p)) => json!({
            "turn_id": p.turn_id, "stop_reason": p.stop_reason, "error_message": p.error_message,
        }),
        Some(Payload::ConversationReplaced(p)) => json!({
            "previous_resume_token": p.previous_resume_token,
            "resume_token": p.resume_token, "reason": p.reason,
        }),
        Some(Payload::PermissionRequested(p)) => {
            json!({"request": p.request.as_ref().map(permission_json)})
        }
        Some(Payload::PermissionResolved(p)) => json!({
            "request_id": p.request_id, "outcome": p.outcome,
            "option_id": p.option_id, "reason": p.reason,
        }),
        Some(Payload::QueueChanged(p)) => json!({
            "queued": p.queued.iter().map(queued_json).collect::<Vec<_>>(),
        }),
        None => Value::Null,
    };
    json!({
        "session_id": e.session_id, "task_id": e.task_id, "seq": e.seq, "task_seq": e.task_seq,
        "kind": e.kind, "created_at": ts(e.created_at.as_ref()), "payload": payload,
    })
}

fn queued_json(q: &pb::QueuedMessage) -> Value {
    json!({"id": q.id, "content": q.content, "queued_at": ts(q.queued_at.as_ref())})
}

fn modes_json(m: &pb::SessionModes) -> Value {
    json!({
        "current_mode_id": m.current_mode_id,
        "available": m.available.iter().map(|a| json!({
            "id": a.id, "name": a.name, "description": a.description,
        })).collect::<Vec<_>>(),
    })
}

fn config_json(o: &pb::ConfigOption) -> Value {
    json!({
        "id": o.id, "name": o.name, "description": o.description, "category": o.category,
        "type": o.r#type, "current_value": o.current_value,
        "values": o.values.iter().map(|v| json!({
            "value": v.value, "name": v.name, "description": v.description,
        })).collect::<Vec<_>>(),
    })
}

/// `model = large (of small, large)`.
fn config_line(o: &pb::ConfigOption) -> String {
    let offered: Vec<&str> = if o.r#type == "boolean" {
        vec!["true", "false"]
    } else {
        o.values.iter().map(|v| v.value.as_str()).collect()
    };
    format!("{} = {} (of {})", o.id, o.current_value, offered.join(", "))
}

/// `plan (of default, plan)`: the current mode first, then every mode.
fn modes_line(m: &pb::SessionModes) -> String {
    let all: Vec<&str> = m.available.iter().map(|a| a.id.as_str()).collect();
    format!("{} (of {})", m.current_mode_id, all.join(", "))
}

fn one_line(text: &str, max: usize) -> String {
    let flat: String = text
        .chars()
        .map(|c| if c == '\n' { ' ' } else { c })
        .collect();
    if flat.chars().count() > max {
        format!("{}…", flat.chars().take(max).collect::<String>())
    } else {
        flat
    }
}

#[allow(clippy::print_stdout)]
impl Out {
    fn print_json(&self, v: Value) {
        println!("{v}");
    }

    pub fn created_task(&self, t: Option<&pb::Task>) {
        let Some(t) = t else { return };
        if self.json {
            self.print_json(task_json(t));
        } else if self.quiet {
            println!("{}", t.id);
        } else {
            println!("created task {} ({})", t.id, printable(&t.title));
        }
    }

    pub fn tasks(&self, tasks: &[pb::Task]) {
        if self.json {
            self.print_json(Value::Array(tasks.iter().map(task_json).collect()));
            return;
        }
        if tasks.is_empty() {
            println!("no tasks");
            return;
        }
        println!("{:<36}  {:<11}  TITLE", "ID", "STATE");
        for t in tasks {
            println!(
                "{:<36}  {:<11}  {}",
                t.id,
                task_state(t.state),
                printable(&t.title)
            );
            // GetTask totals its sessions' usage (a list does not).
            if let Some(u) = &t.usage {
                println!("  usage: {}", usage_line(u));
            }
        }
    }

    pub fn created_session(&self, s: Option<&pb::Session>) {
        let Some(s) = s else { return };
        if self.json {
            self.print_json(session_json(s));
        } else if self.quiet {
            println!("{}", s.id);
        } else {
            println!(
                "created session {} ({}, {})",
                s.id,
                session_state(s.state),
                runtime(s.runtime, &s.runtime_name)
            );
            if let Some(w) = s.worktree.as_ref().filter(|w| !w.repository.is_empty()) {
                println!(
                    "  worktree {} on branch {} (from {} at {})",
                    w.path, w.branch, w.repository, w.base
                );
            }
            if !s.error_message.is_empty() {
                println!("  error: {}", s.error_message);
            }
        }
    }

    /// One session (create, get, stop): a JSON object with `--json`.
    pub fn session(&self, session: Option<&pb::Session>) {
        match (self.json, session) {
            (true, Some(s)) => self.print_json(session_json(s)),
            _ => self.sessions(session.map(std::slice::from_ref).unwrap_or_default()),
        }
    }

    /// A list of sessions: a JSON array with `--json`, whatever its length.
    pub fn sessions(&self, sessions: &[pb::Session]) {
        if self.json {
            let v: Vec<Value> = sessions.iter().map(session_json).collect();
            self.print_json(Value::Array(v));
            return;
        }
        if sessions.is_empty() {
            println!("no sessions");
            return;
        }
        // A session being brought back shows the state it returns to,
        // marked: its recorded state is not yet what runs.
        let width = if sessions.iter().any(|s| s.recovering) {
            30
        } else {
            17
        };
        println!(
            "{:<36}  {:<width$}  {:<16}  {:<20}  {:<30}  ERROR",
            "ID", "STATE", "RUNTIME", "USAGE", "TITLE"
        );
        for s in sessions {
            let mut state = session_state(s.state);
            if s.recovering {
                state.push_str(" (recovering)");
            }
            println!(
                "{:<36}  {:<width$}  {:<16}  {:<20}  {:<30}  {}",
                s.id,
                state,
                runtime(s.runtime, &s.runtime_name),
                usage_short(s.usage.as_ref()),
                one_line(&s.title, 30),
                one_line(&s.error_message, 60)
            );
        }
    }

    pub fn status(&self, s: &pb::GetSessionStatusResponse) {
        if self.json {
            self.print_json(json!({
                "session_id": s.session_id, "task_id": s.task_id,
                "state": session_state(s.state), "agent_profile_id": s.agent_profile_id,
                "executor_status": executor_status(s.executor_status),
                "agent_execution_id": s.agent_execution_id, "runtime": runtime(s.runtime, &s.runtime_name),
                "is_agent_running": s.is_agent_running, "is_resumable": s.is_resumable,
                "needs_resume": s.needs_resume, "resume_reason": resume_reason(s.resume_reason),
                "worktree_path": s.worktree_path, "worktree_branch": s.worktree_branch,
                "worktree_id": s.worktree_id, "worktree_repository": s.worktree_repository,
                "worktree_base": s.worktree_base,
                "error_message": s.error_message, "recovering": s.recovering,
                "agent_recovery": s.agent_recovery.as_ref().map(|r| json!({
                    "stage": recovery_stage(r.stage), "queue_position": r.queue_position,
                    "queue_length": r.queue_length, "attempt": r.attempt,
                    "max_attempts": r.max_attempts, "last_error": r.last_error,
                    "retry_in_ms": r.retry_in_ms, "replayed": r.replayed,
                })),
                "modes": s.modes.as_ref().map(modes_json),
                "config_options": s.config_options.iter().map(config_json).collect::<Vec<_>>(),
                "pending_permissions": s.pending_permissions.iter().map(permission_json).collect::<Vec<_>>(),
                "usage": s.usage.as_ref().map(usage_json),
                "queued_messages": s.queued_messages.iter().map(queued_json).collect::<Vec<_>>(),
                "queue_held": s.queue_held,
            }));
            return;
        }
        println!("session           {}", s.session_id);
        if let Some(r) = &s.agent_recovery {
            println!("recovering        {}", agent_recovery_line(r));
        } else if s.recovering {
            // The fields below are from before the restart until then.
            println!("recovering        true (the backend is recovering this session)");
        }
        println!("task              {}", s.task_id);
        println!("state             {}", session_state(s.state));
        println!("executor          {}", executor_status(s.executor_status));
        println!("runtime           {}", runtime(s.runtime, &s.runtime_name));
        println!("agent running     {}", s.is_agent_running);
        println!("resumable         {}", s.is_resumable);
        println!("needs resume      {}", s.needs_resume);
        // Unspecified while its agent runs or starts: nothing to resume.
        if s.resume_reason != pb::ResumeReason::Unspecified as i32 {
            println!("resume reason     {}", resume_reason(s.resume_reason));
        }
        println!("execution         {}", s.agent_execution_id);
        println!(
            "worktree          {} {}",
            s.worktree_path, s.worktree_branch
        );
        if !s.worktree_repository.is_empty() {
            println!(
                "repository        {} (base {}, worktree id {})",
                s.worktree_repository, s.worktree_base, s.worktree_id
            );
        }
        if !s.error_message.is_empty() {
            println!("error             {}", s.error_message);
        }
        if let Some(m) = &s.modes {
            println!("modes             {}", modes_line(m));
        }
        for o in &s.config_options {
            println!("config            {}", config_line(o));
        }
        if let Some(u) = &s.usage {
            println!("usage             {}", usage_line(u));
        }
        for p in &s.pending_permissions {
            println!(
                "permission        {} asks: {}",
                p.request_id,
                permission_line(p)
            );
        }
        for q in &s.queued_messages {
            println!("queued            {} {}", q.id, one_line(&q.content, 80));
        }
        if s.queue_held {
            println!(
                "queue             held: the last turn was interrupted; `sessionctl retry` runs it \
                 again first, a new message goes on without it"
            );
        }
    }

    /// A message SendMessage queued behind the running turn.
    pub fn queued(&self, q: &pb::QueuedMessage) {
        if self.json {
            self.print_json(json!({"queued": queued_json(q)}));
        } else {
            eprintln!(
                "message {} is queued: it goes to the agent once the session waits for input \
                 (after the running turn, or once the agent is up), after the messages queued \
                 before it; if that turn ends interrupted, the queue waits for `sessionctl \
                 retry` or a new message (`sessionctl unqueue` takes it back)",
                q.id
            );
        }
    }

    /// A queued message taken back.
    pub fn unqueued(&self, q: &pb::QueuedMessage) {
        if self.json {
            self.print_json(json!({"cancelled": queued_json(q)}));
        } else {
            println!(
                "message {} is off the queue: {}",
                q.id,
                one_line(&q.content, 80)
            );
        }
    }

    pub fn permission_answered(&self, p: &pb::PermissionRequest, option_id: &str) {
        if self.json {
            self.print_json(json!({"request": permission_json(p), "answered": option_id}));
        } else {
            println!("permission request {} answered {option_id}", p.request_id);
        }
    }

    pub fn titled(&self, s: Option<&pb::Session>) {
        let Some(s) = s else { return };
        if self.json {
            self.print_json(session_json(s));
        } else if s.title.is_empty() {
            println!("session {} has no title", s.id);
        } else {
            println!("session {} titled {:?}", s.id, s.title);
        }
    }

    pub fn modes(&self, session_id: &str, m: &pb::SessionModes) {
        if self.json {
            self.print_json(json!({"session_id": session_id, "modes": modes_json(m)}));
        } else {
            println!("session {session_id} mode {}", modes_line(m));
        }
    }

    pub fn config_options(&self, session_id: &str, options: &[pb::ConfigOption]) {
        if self.json {
            self.print_json(json!({
                "session_id": session_id,
                "config_options": options.iter().map(config_json).collect::<Vec<_>>(),
            }));
        } else {
            for o in options {
                println!("session {session_id} config {}", config_line(o));
            }
        }
    }

    pub fn deleted(&self, id: &str) {
        if self.json {
            self.print_json(json!({"deleted": id}));
        } else {
            println!("deleted session {id}");
        }
    }

    pub fn cancelled(&self, session_id: &str, cancelled: bool) {
        if self.json {
            self.print_json(json!({"session_id": session_id, "cancelled": cancelled}));
        } else if cancelled {
            println!(
                "cancel requested for the turn of session {session_id}; the reply so far is kept"
            );
        } else {
            println!("session {session_id} had no turn in progress any more (it had just ended)");
        }
    }

    pub fn messages(&self, messages: &[pb::Message]) {
        if self.json {
            self.print_json(Value::Array(messages.iter().map(message_json).collect()));
            return;
        }
        for m in messages {
            let more = if m.complete { "" } else { " …" };
            if is_text(m) {
                println!("[{}] {}: {}{more}", m.seq, role(m.role), text(&m.content));
                if let Some(u) = &m.usage {
                    println!("    {}", turn_usage_line(u));
                }
            } else {
                println!(
                    "[{}] {}: {}{more}",
                    m.seq,
                    role(m.role),
                    text(&activity_line(m))
                );
            }
        }
    }

    /// One event; `by_task`: numbered by its `task_seq`, the cursor a
    /// task's watch resumes from (`--after-seq`).
    pub fn event(&self, e: &pb::Event, by_task: bool) {
        use pb::event::Payload;
        if self.json {
            self.print_json(event_json(e));
            return;
        }
        let detail = match &e.payload {
            Some(Payload::AgentctlStarting(p)) => {
                format!("executor {} generation {}", p.executor_id, p.generation)
            }
            Some(Payload::AgentctlReady(p)) => format!(
                "executor {} ({}), resume {}",
                p.executor_id,
                runtime(p.runtime, &p.runtime_name),
                match p.supports_session_resume {
                    Some(true) => "supported",
                    Some(false) => "unsupported",
                    None => "not known until the agent starts",
                }
            ),
            Some(Payload::AgentctlError(p)) => {
                format!("executor {}: {}", p.executor_id, p.error_message)
            }
            Some(Payload::StateChanged(p)) => {
                let mut s = format!("{} -> {}", session_state(p.from), session_state(p.to));
                if !p.error_message.is_empty() {
                    s.push_str(&format!(" ({})", p.error_message));
                }
                s
            }
            Some(Payload::MessageAdded(pb::MessageAdded { message }))
            | Some(Payload::MessageUpdated(pb::MessageUpdated { message })) => {
                message.as_ref().map_or(String::new(), |m| {
                    format!(
                        "[{}] {}: {}",
                        m.seq,
                        role(m.role),
                        one_line(&m.content, 100)
                    )
                })
            }
            Some(Payload::TurnEnded(p)) => {
                let mut s = format!("turn {}: {}", p.turn_id, p.stop_reason);
                if !p.error_message.is_empty() {
                    s.push_str(&format!(" ({})", p.error_message));
                }
                s
            }
            Some(Payload::ConversationReplaced(p)) => format!(
                "new conversation {} replaces {} ({})",
                p.resume_token, p.previous_resume_token, p.reason
            ),
            Some(Payload::PermissionRequested(p)) => {
                p.request.as_ref().map_or(String::new(), |r| {
                    format!("{} asks: {}", r.request_id, permission_line(r))
                })
            }
            Some(Payload::PermissionResolved(p)) => {
                let mut s = format!("{}: {}", p.request_id, p.outcome);
                if !p.option_id.is_empty() {
                    s.push_str(&format!(" {}", p.option_id));
                }
                if !p.reason.is_empty() {
                    s.push_str(&format!(" ({})", p.reason));
                }
                s
            }
            Some(Payload::QueueChanged(p)) => match p.queued.len() {
                0 => "queue empty".to_owned(),
                n => format!("{n} queued, next {}", p.queued[0].id),
            },
            None => String::new(),
        };
        // The id's last characters: its random part (a UUIDv7 begins with
        // its time, the same for sessions created in the same minute).
        let label = e
            .session_id
            .get(e.session_id.len().saturating_sub(8)..)
            .unwrap_or(&e.session_id);
        println!(
            "{:>5}  {}  {:<28} {}",
            if by_task { e.task_seq } else { e.seq },
            label,
            e.kind,
            printable(&detail)
        );
        crate::stdout::ended(std::io::stdout().flush());
    }

    pub fn replicas(&self, r: &pb::ListReplicasResponse) {
        let now = chrono::Utc::now();
        let age_ms = |t: Option<&prost_types::Timestamp>| {
            t.and_then(|t| chrono::DateTime::from_timestamp(t.seconds, t.nanos.max(0) as u32))
                .map(|d| (now - d).num_milliseconds().max(0))
        };
        if self.json {
            self.print_json(Value::Array(
                r.replicas
                    .iter()
                    .map(|x| {
                        json!({
                            "id": x.id, "address": x.address, "hostname": x.hostname,
                            "pid": x.pid, "live": x.live, "owned_executors": x.owned_executors,
                            "heartbeat_age_ms": age_ms(x.heartbeat_at.as_ref()),
                            "started_at": ts(x.started_at.as_ref()),
                            "lease_ttl_ms": x.lease_ttl_ms, "self": x.id == r.self_id,
                        })
                    })
                    .collect(),
            ));
            return;
        }
        println!(
            "{:<28}  {:<22}  {:<5}  {:>9}  {:>8}",
            "ID", "ADDRESS", "LIVE", "HEARTBEAT", "EXECUTORS"
        );
        for x in &r.replicas {
            let age = age_ms(x.heartbeat_at.as_ref()).map_or_else(
                || "-".to_owned(),
                |ms| format!("{:.1}s ago", ms as f64 / 1000.0),
            );
            let me = if x.id == r.self_id { " *" } else { "" };
            println!(
                "{:<28}  {:<22}  {:<5}  {:>9}  {:>8}",
                format!("{}{me}", x.id),
                x.address,
                if x.live { "yes" } else { "no" },
                age,
                x.owned_executors
            );
        }
    }

    pub fn profiles(&self, profiles: &[pb::AgentProfile]) {
        if self.json {
            self.print_json(Value::Array(
                profiles
                    .iter()
                    .map(|p| {
                        json!({
                            "id": p.id, "name": p.name, "command": p.command, "args": p.args,
                            "supports_session_resume": p.supports_session_resume,
                        })
                    })
                    .collect(),
            ));
            return;
        }
        println!("{:<16}  {:<6}  COMMAND", "NAME", "RESUME");
        for p in profiles {
            println!(
                "{:<16}  {:<6}  {} {}",
                p.name,
                p.supports_session_resume,
                p.command,
                p.args.join(" ")
            );
        }
    }

    pub fn exec(&self, r: &pb::ExecResponse) {
        if self.json {
            self.print_json(json!({
                "exit_code": r.exit_code, "timed_out": r.timed_out, "signal": r.signal,
                "stdout": String::from_utf8_lossy(&r.stdout),
                "stderr": String::from_utf8_lossy(&r.stderr),
                "stdout_truncated": r.stdout_truncated, "stderr_truncated": r.stderr_truncated,
            }));
            return;
        }
        crate::stdout::ended(std::io::stdout().write_all(&r.stdout));
        let _ = std::io::stderr().write_all(&r.stderr);
        for (cut, stream) in [
            (r.stdout_truncated, "stdout"),
            (r.stderr_truncated, "stderr"),
        ] {
            if cut {
                eprintln!(
                    "sessionctl: the command's {stream} was cut at {} bytes; the rest was dropped \
                     (--max-output-bytes keeps up to 16 MiB)",
                    if stream == "stdout" {
                        r.stdout.len()
                    } else {
                        r.stderr.len()
                    }
                );
            }
        }
        if r.timed_out {
            eprintln!("sessionctl: the command timed out");
        }
        if let Some(signal) = r.signal {
            eprintln!("sessionctl: the command was killed by signal {signal}");
        }
    }

    pub fn file(&self, path: &str, content: &[u8]) {
        if self.json {
            self.print_json(json!({"path": path, "content": String::from_utf8_lossy(content)}));
        } else {
            crate::stdout::ended(std::io::stdout().write_all(content));
        }
    }

    pub fn entries(&self, entries: &[pb::DirEntry]) {
        if self.json {
            self.print_json(Value::Array(
                entries
                    .iter()
                    .map(|e| json!({"name": e.name, "is_dir": e.is_dir, "size": e.size}))
                    .collect(),
            ));
            return;
        }
        for e in entries {
            if e.is_dir {
                println!("{:>10}  {}/", "-", e.name);
            } else {
                println!("{:>10}  {}", e.size, e.name);
            }
        }
    }

    pub fn git_status(&self, r: &pb::GitStatusResponse) {
        if self.json {
            self.print_json(json!({
                "branch": r.branch,
                "files": r.files.iter().map(|f| json!({"path": f.path, "code": f.code})).collect::<Vec<_>>(),
            }));
            return;
        }
        println!("## {}", r.branch);
        for f in &r.files {
            println!("{:>2} {}", f.code, f.path);
        }
    }

    pub fn commits(&self, r: &pb::ListBranchCommitsResponse) {
        if self.json {
            self.print_json(json!({
                "branch": r.branch, "base": r.base,
                "commits": r.commits.iter().map(|c| json!({
                    "sha": c.sha, "subject": c.subject, "author": c.author, "time": c.time,
                })).collect::<Vec<_>>(),
            }));
            return;
        }
        if r.commits.is_empty() {
            println!("no commits on {} since {}", r.branch, r.base);
            return;
        }
        for c in &r.commits {
            let short = c.sha.get(..12).unwrap_or(&c.sha);
            println!("{short}  {}  ({})", c.subject, c.author);
        }
    }

    pub fn git_diff(&self, diff: &str) {
        if self.json {
            self.print_json(json!({"diff": diff}));
        } else {
            print!("{diff}");
        }
    }
}

fn recovery_stage(stage: i32) -> &'static str {
    match pb::RecoveryStage::try_from(stage) {
        Ok(pb::RecoveryStage::Queued) => "queued",
        Ok(pb::RecoveryStage::Launching) => "launching",
        Ok(pb::RecoveryStage::Resuming) => "resuming",
        Ok(pb::RecoveryStage::WaitingToRetry) => "waiting_to_retry",
        _ => "unknown",
    }
}

/// One line of where an agent's recovery stands, e.g. `queued, 3 of 12
/// waiting for a launch slot (attempt 1 of 5)`.
fn agent_recovery_line(r: &pb::AgentRecovery) -> String {
    let mut line = match pb::RecoveryStage::try_from(r.stage) {
        Ok(pb::RecoveryStage::Queued) => format!(
            "queued, {} of {} waiting for a launch slot",
            r.queue_position, r.queue_length
        ),
        Ok(pb::RecoveryStage::Launching) => "launching the agent".to_owned(),
        Ok(pb::RecoveryStage::Resuming) if r.replayed > 0 => {
            format!(
                "resuming the conversation ({} updates replayed)",
                r.replayed
            )
        }
        Ok(pb::RecoveryStage::Resuming) => "resuming the conversation".to_owned(),
        Ok(pb::RecoveryStage::WaitingToRetry) => {
            format!("retrying in {:.1} s", r.retry_in_ms as f64 / 1000.0)
        }
        _ => "in progress".to_owned(),
    };
    line.push_str(&format!(" (attempt {} of {})", r.attempt, r.max_attempts));
    if !r.last_error.is_empty() {
        line.push_str(&format!("; last attempt: {}", one_line(&r.last_error, 120)));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::{pb, printable, text, tool_detail};

    #[test]
    fn a_tool_call_shows_its_command_exit_and_output() {
        // Codex: the command as argv with its cwd; exit code and output.
        let codex = pb::ToolCallPart {
            raw_input_json: r#"{"command":["bash","-lc","ls"],"cwd":"/w"}"#.into(),
            raw_output_json: r#"{"exit_code":2,"stdout":"a\nb\n","stderr":"oops\n"}"#.into(),
            ..Default::default()
        };
        assert_eq!(
            tool_detail(&codex),
            ["$ bash -lc ls  (in /w)", "exit 2", "a", "b", "oops"]
        );
        // Claude Code: a command string; the output as content blocks.
        let claude = pb::ToolCallPart {
            raw_input_json: r#"{"command":"printf hi","description":"say hi"}"#.into(),
            raw_output_json: r#"[{"type":"text","text":"hi\u001b[0m"}]"#.into(),
            ..Default::default()
        };
        assert_eq!(tool_detail(&claude), ["$ printf hi", "hi\u{1b}[0m"]);
        // Other input as JSON; nothing at all when nothing was given.
        let read = pb::ToolCallPart {
            raw_input_json: r#"{"path":"a.txt"}"#.into(),
            ..Default::default()
        };
        assert_eq!(tool_detail(&read), [r#"input {"path":"a.txt"}"#]);
        assert!(tool_detail(&pb::ToolCallPart::default()).is_empty());
    }

    #[test]
    fn control_characters_are_shown_escaped() {
        assert_eq!(printable("plain title"), "plain title");
        assert_eq!(printable("a\u{1b}[31mred\0\n"), "a\\u{1b}[31mred\\u{0}\\n");
        assert_eq!(printable("a\u{202e}b"), "a\\u{202e}b");
        // A reply keeps its lines and tabs, nothing else.
        assert_eq!(
            text("line\tone\nesc \u{1b}[31mred\u{7} cr\r\u{2066}"),
            "line\tone\nesc \\u{1b}[31mred\\u{7} cr\\r\\u{2066}"
        );
    }
}
