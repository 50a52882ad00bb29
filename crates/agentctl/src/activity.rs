//! The agent's activity during a turn: every ACP `session/update` other than
//! the reply's text becomes an [`Activity`] on the update stream.
//!
//! Each part (a tool call, a run of thought chunks, the turn's plan, any
//! other update) gets a stable UUID, and every later update of a part is
//! sent with its whole state and a higher `rev`: a consumer that replays the
//! stream (a backend restart) keeps the highest rev and never moves a part
//! backwards, and no consumer has to merge `tool_call_update`s itself.

use std::collections::HashMap;

use agent_client_protocol::v1::schema::{
    ContentBlock, SessionUpdate, ToolCall as AcpToolCall, ToolCallStatus, ToolCallUpdate,
};
use sessiond_proto::agentctl::v1::Activity;

/// Kinds on the wire (`Activity.kind`).
pub const TOOL_CALL: &str = "tool_call";
pub const PLAN: &str = "plan";
pub const THOUGHT: &str = "thought";
pub const AVAILABLE_COMMANDS: &str = "available_commands";
pub const CURRENT_MODE: &str = "current_mode";
pub const OTHER: &str = "other";
pub const PERMISSION: &str = "permission";
/// An ACP terminal the agent runs through agentctl (see `terminal`).
pub const TERMINAL: &str = "terminal";
/// A `session/update` our ACP schema could not parse, kept raw (bounded).
pub const UNPARSED: &str = "unparsed";

/// At most this much of an unparseable update's JSON is kept.
pub const MAX_UNPARSED_JSON: usize = 16 * 1024;
/// At most this much of a parse error's text is kept.
const MAX_ERROR: usize = 1024;

/// The longest prefix of `s` of at most `max` bytes that ends on a char
/// boundary.
pub fn clip(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// `s` in pieces of at most `max` bytes (`max` >= 4), each ending on a
/// char boundary; none when `s` is empty.
pub fn pieces(s: &str, max: usize) -> impl Iterator<Item = &str> {
    let mut rest = s;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let head = clip(rest, max.max(4));
        rest = &rest[head.len()..];
        Some(head)
    })
}

/// At most this much of a part's text, and of its JSON, goes into one
/// update: the backend reads updates of up to 64 MiB, and one it cannot
/// read would be sent again and again.
pub const MAX_PART_BYTES: usize = 8 << 20;

/// `a` with its text and JSON cut to [`MAX_PART_BYTES`] (a thought streamed
/// for ever, a tool call carrying a huge file), saying so.
pub fn bounded(mut a: Activity) -> Activity {
    if a.text.len() > MAX_PART_BYTES {
        let total = a.text.len();
        a.text = format!(
            "{}\n[agentctl: cut at {MAX_PART_BYTES} of {total} bytes]",
            clip(&a.text, MAX_PART_BYTES)
        );
    }
    if a.json.len() > MAX_PART_BYTES {
        a.json = serde_json::json!({"truncated": true, "bytes": a.json.len()}).to_string();
    }
    a
}

/// Strings longer than this in a tool call's raw input or output keep
/// their head and tail (a command's output: its end tells most).
const RAW_STRING_MAX: usize = 8 * 1024;
/// A raw input or output still larger than this is kept as its JSON text,
/// cut, under `{"truncated": true, "json": ...}`.
const RAW_MAX: usize = 32 * 1024;

/// The longest suffix of `s` of at most `max` bytes that starts on a char
/// boundary.
fn clip_tail(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut start = s.len() - max;
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}

fn clip_strings(v: &mut serde_json::Value, max: usize) {
    match v {
        serde_json::Value::String(s) if s.len() > max => {
            let head = clip(s, max / 4);
            let tail = clip_tail(s, max - max / 4);
            let cut = s.len() - head.len() - tail.len();
            *s = format!("{head}\n[... {cut} bytes cut ...]\n{tail}");
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(|v| clip_strings(v, max)),
        serde_json::Value::Object(o) => o.values_mut().for_each(|v| clip_strings(v, max)),
        _ => {}
    }
}

/// Bounds the `rawInput` and `rawOutput` of a tool call's JSON (what the
/// agent says a tool was given and gave back: a command, its cwd, exit code
/// and output), which agents send unbounded.
pub fn bound_raw(call: &mut serde_json::Value) {
    for key in ["rawInput", "rawOutput"] {
        if let Some(v) = call.get_mut(key) {
            clip_strings(v, RAW_STRING_MAX);
            let text = v.to_string();
            if text.len() > RAW_MAX {
                *v = serde_json::json!({"truncated": true, "json": clip(&text, RAW_MAX)});
            }
        }
    }
}

/// A tool call as ACP JSON, its raw input and output bounded.
fn tool_json(call: &AcpToolCall) -> String {
    let mut v = serde_json::to_value(call).unwrap_or_else(|_| serde_json::json!({}));
    bound_raw(&mut v);
    v.to_string()
}

/// A notification of `method` whose params did not parse, as a complete
/// part of the turn `turn_id` (empty between turns): `{"sessionUpdate",
/// "method", "error", "json", "truncated"}`, `json` being the params as
/// the agent sent them, cut at [`MAX_UNPARSED_JSON`] bytes. The text is the
/// update's tag and the error, so a reader sees what was lost and why.
pub fn unparsed(turn_id: &str, method: &str, params: &serde_json::Value, error: &str) -> Activity {
    let tag = params
        .pointer("/update/sessionUpdate")
        .and_then(|t| t.as_str())
        .map(|t| clip(t, 64).to_owned())
        .unwrap_or_default();
    let raw = params.to_string();
    let kept = clip(&raw, MAX_UNPARSED_JSON);
    let error = clip(error, MAX_ERROR);
    let json = serde_json::json!({
        "sessionUpdate": tag,
        "method": method,
        "error": error,
        "json": kept,
        "truncated": kept.len() < raw.len(),
    });
    let text = if tag.is_empty() {
        format!("{method}: {error}")
    } else {
        format!("{tag}: {error}")
    };
    Activity {
        complete: true,
        ..activity(turn_id, &new_id(), UNPARSED, 1, text, json.to_string())
    }
}

/// A parse error without where it happened (`at line 1 column 80`), so
/// the same mistake repeated in many updates reads as one.
pub fn error_shape(error: &str) -> &str {
    error.split(" at line ").next().unwrap_or(error)
}

/// A permission request of policy `ask`, pending (rev 1): the ACP request's
/// tool call and options, `status: "pending"`, when it was asked and when
/// its timeout answers it (Unix milliseconds). The part id is the request
/// id the backend answers with.
pub fn permission_requested(
    turn_id: &str,
    request_id: &str,
    req: &agent_client_protocol::v1::schema::RequestPermissionRequest,
    requested_at_ms: u64,
    expires_at_ms: u64,
) -> Activity {
    let title = req.tool_call.fields.title.clone().unwrap_or_default();
    let mut tool_call = serde_json::to_value(&req.tool_call).unwrap_or_default();
    bound_raw(&mut tool_call);
    let json = serde_json::json!({
        "requestId": request_id,
        "turnId": turn_id,
        "toolCall": tool_call,
        "options": req.options,
        "status": "pending",
        "requestedAtMs": requested_at_ms,
        "expiresAtMs": expires_at_ms,
    });
    activity(turn_id, request_id, PERMISSION, 1, title, json.to_string())
}

/// The request resolved (rev 2, complete): `status` is `selected`,
/// `timed_out` or `cancelled`, `optionId` the option the agent was given
/// (none when it was told `cancelled`), `reason` why (timeouts, cancels).
pub fn permission_resolved(
    part: &mut Activity,
    status: &str,
    option_id: Option<&str>,
    reason: &str,
) {
    let mut v: serde_json::Value =
        serde_json::from_str(&part.json).unwrap_or_else(|_| serde_json::json!({}));
    v["status"] = status.into();
    if let Some(o) = option_id {
        v["optionId"] = o.into();
    }
    if !reason.is_empty() {
        v["reason"] = reason.into();
    }
    part.json = v.to_string();
    part.rev = 2;
    part.complete = true;
}

/// A pending request's part rebuilt from its journaled state.
pub fn permission_part(turn_id: &str, request_id: &str, json: String) -> Activity {
    let title = serde_json::from_str::<serde_json::Value>(&json)
        .ok()
        .and_then(|v| v.pointer("/toolCall/title")?.as_str().map(str::to_owned))
        .unwrap_or_default();
    activity(turn_id, request_id, PERMISSION, 1, title, json)
}

/// An ACP `elicitation/create` (a question to the user: a form, or a URL
/// to visit) as a `permission` part (rev 1, pending) whose options are
/// `accept`, `decline` and `cancel`, with the request under `elicitation`
/// (`mode`, `message`, and `requestedSchema` or `url`).
pub fn elicitation_requested(
    turn_id: &str,
    request_id: &str,
    req: &agent_client_protocol::v1::schema::CreateElicitationRequest,
    requested_at_ms: u64,
    expires_at_ms: u64,
) -> Activity {
    let mut elicitation = serde_json::to_value(req).unwrap_or_default();
    clip_strings(&mut elicitation, RAW_STRING_MAX);
    let option =
        |id: &str, name: &str| serde_json::json!({"optionId": id, "name": name, "kind": id});
    let json = serde_json::json!({
        "requestId": request_id,
        "turnId": turn_id,
        "toolCall": {"toolCallId": request_id, "title": req.message},
        "options": [option("accept", "Submit"), option("decline", "Decline"), option("cancel", "Cancel")],
        "elicitation": elicitation,
        "status": "pending",
        "requestedAtMs": requested_at_ms,
        "expiresAtMs": expires_at_ms,
    });
    activity(
        turn_id,
        request_id,
        PERMISSION,
        1,
        req.message.clone(),
        json.to_string(),
    )
}

#[derive(Debug)]
struct ToolPart {
    id: String,
    rev: u64,
    call: AcpToolCall,
}

#[derive(Debug)]
struct TextPart {
    id: String,
    rev: u64,
    text: String,
}

/// The open parts of the turn in progress.
#[derive(Debug, Default)]
pub struct Parts {
    tools: HashMap<String, ToolPart>,
    /// The turn's plan: its last state, sent again complete at the end.
    plan: Option<Activity>,
    /// The thought being streamed; closed by any other update.
    thought: Option<TextPart>,
}

fn new_id() -> String {
    uuid::Uuid::now_v7().to_string()
}

/// ACP JSON of a schema value (they all serialize; `{}` if one ever fails).
macro_rules! json {
    ($v:expr) => {
        serde_json::to_string($v).unwrap_or_else(|_| "{}".into())
    };
}

fn activity(turn_id: &str, id: &str, kind: &str, rev: u64, text: String, json: String) -> Activity {
    Activity {
        turn_id: turn_id.to_owned(),
        part_id: id.to_owned(),
        kind: kind.to_owned(),
        rev,
        text,
        json,
        complete: false,
    }
}

fn finished(status: ToolCallStatus) -> bool {
    matches!(status, ToolCallStatus::Completed | ToolCallStatus::Failed)
}

/// The `sessionUpdate` tag of an update (`usage_update`, ...).
fn tag(update: &SessionUpdate) -> String {
    serde_json::to_value(update)
        .ok()
        .and_then(|v| v.get("sessionUpdate")?.as_str().map(str::to_owned))
        .unwrap_or_else(|| "unknown".into())
}

/// Updates that mean something outside a turn (they describe the session,
/// not the turn): available commands, the mode, anything we do not type.
pub fn outside_turn(update: SessionUpdate) -> Option<Activity> {
    let a = match update {
        SessionUpdate::AvailableCommandsUpdate(u) => activity(
            "",
            &new_id(),
            AVAILABLE_COMMANDS,
            1,
            commands_text(&u.available_commands),
            json!(&u),
        ),
        SessionUpdate::CurrentModeUpdate(u) => activity(
            "",
            &new_id(),
            CURRENT_MODE,
            1,
            u.current_mode_id.to_string(),
            json!(&u),
        ),
        SessionUpdate::UserMessageChunk(_)
        | SessionUpdate::AgentMessageChunk(_)
        | SessionUpdate::AgentThoughtChunk(_)
        | SessionUpdate::ToolCall(_)
        | SessionUpdate::ToolCallUpdate(_)
        | SessionUpdate::Plan(_) => return None,
        other => activity("", &new_id(), OTHER, 1, tag(&other), json!(&other)),
    };
    Some(Activity {
        complete: true,
        ..a
    })
}

fn commands_text(commands: &[agent_client_protocol::v1::schema::AvailableCommand]) -> String {
    commands
        .iter()
        .map(|c| format!("/{}", c.name))
        .collect::<Vec<_>>()
        .join(" ")
}

impl Parts {
    /// The activities one update of the turn `turn_id` makes (none for the
    /// reply's text, which is a `MessageChunk`): the closed thought first
    /// when this update ends a run of thought chunks.
    pub fn apply(&mut self, turn_id: &str, update: SessionUpdate) -> Vec<Activity> {
        let mut out = Vec::new();
        if !matches!(update, SessionUpdate::AgentThoughtChunk(_))
            && let Some(t) = self.thought.take()
        {
            out.push(close_thought(turn_id, t));
        }
        match update {
            SessionUpdate::AgentMessageChunk(_) | SessionUpdate::UserMessageChunk(_) => {}
            SessionUpdate::AgentThoughtChunk(chunk) => {
                let ContentBlock::Text(t) = chunk.content else {
                    return out;
                };
                let part = self.thought.get_or_insert_with(|| TextPart {
                    id: new_id(),
                    rev: 0,
                    text: String::new(),
                });
                part.rev += 1;
                part.text.push_str(&t.text);
                out.push(activity(
                    turn_id,
                    &part.id,
                    THOUGHT,
                    part.rev,
                    part.text.clone(),
                    "{}".into(),
                ));
            }
            SessionUpdate::ToolCall(call) => {
                let key = call.tool_call_id.0.to_string();
                let part = self.tools.entry(key).or_insert_with(|| ToolPart {
                    id: new_id(),
                    rev: 0,
                    call: call.clone(),
                });
                part.rev += 1;
                part.call = call;
                out.push(tool_activity(turn_id, part));
            }
            SessionUpdate::ToolCallUpdate(u) => {
                let key = u.tool_call_id.0.to_string();
                match self.tools.get_mut(&key) {
                    Some(part) => {
                        part.rev += 1;
                        part.call.update(u.fields);
                    }
                    None => {
                        // An update for a call we never saw (allowed by ACP
                        // when the update carries enough to make one).
                        let call =
                            AcpToolCall::try_from(u.clone()).unwrap_or_else(|_| placeholder(u));
                        self.tools.insert(
                            key.clone(),
                            ToolPart {
                                id: new_id(),
                                rev: 1,
                                call,
                            },
                        );
                    }
                }
                if let Some(part) = self.tools.get(&key) {
                    out.push(tool_activity(turn_id, part));
                }
            }
            SessionUpdate::Plan(plan) => {
                let (id, rev) = self
                    .plan
                    .as_ref()
                    .map_or_else(|| (new_id(), 1), |p| (p.part_id.clone(), p.rev + 1));
                let text = plan
                    .entries
                    .iter()
                    .map(|e| format!("[{}] {}", status_name(&e.status), e.content))
                    .collect::<Vec<_>>()
                    .join("\n");
                let a = activity(turn_id, &id, PLAN, rev, text, json!(&plan));
                self.plan = Some(a.clone());
                out.push(a);
            }
            other => {
                if let Some(mut a) = outside_turn(other) {
                    a.turn_id = turn_id.to_owned();
                    out.push(a);
                }
            }
        }
        out
    }

    /// At the turn's end: every part still open, marked complete (a tool
    /// call the agent never finished keeps its last status).
    pub fn close(&mut self, turn_id: &str) -> Vec<Activity> {
        let mut out = Vec::new();
        if let Some(t) = self.thought.take() {
            out.push(close_thought(turn_id, t));
        }
        let mut tools: Vec<ToolPart> = std::mem::take(&mut self.tools).into_values().collect();
        tools.sort_by(|a, b| a.id.cmp(&b.id));
        for mut part in tools {
            if !finished(part.call.status) {
                part.rev += 1;
                let mut a = tool_activity(turn_id, &part);
                a.complete = true;
                out.push(a);
            }
        }
        if let Some(plan) = self.plan.take() {
            out.push(Activity {
                rev: plan.rev + 1,
                complete: true,
                ..plan
            });
        }
        out
    }
}

fn close_thought(turn_id: &str, t: TextPart) -> Activity {
    Activity {
        complete: true,
        ..activity(turn_id, &t.id, THOUGHT, t.rev + 1, t.text, "{}".into())
    }
}

fn placeholder(u: ToolCallUpdate) -> AcpToolCall {
    let mut call = AcpToolCall::new(u.tool_call_id, u.fields.title.clone().unwrap_or_default());
    call.update(u.fields);
    call
}

fn status_name(s: &agent_client_protocol::v1::schema::PlanEntryStatus) -> String {
    serde_json::to_value(s)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

fn tool_activity(turn_id: &str, part: &ToolPart) -> Activity {
    Activity {
        complete: finished(part.call.status),
        ..activity(
            turn_id,
            &part.id,
            TOOL_CALL,
            part.rev,
            part.call.title.clone(),
            tool_json(&part.call),
        )
    }
}

#[cfg(test)]
mod tests {
    use agent_client_protocol::v1::schema::{
        ContentChunk, Plan, PlanEntry, PlanEntryPriority, PlanEntryStatus, TextContent,
        ToolCallUpdateFields,
    };

    use super::*;

    #[test]
    fn text_goes_in_pieces_that_keep_every_char() {
        let text = "héllo wörld".repeat(3);
        let parts: Vec<&str> = pieces(&text, 5).collect();
        assert!(
            parts.iter().all(|p| p.len() <= 5 && !p.is_empty()),
            "{parts:?}"
        );
        assert_eq!(parts.concat(), text);
        assert_eq!(pieces("", 5).count(), 0);
    }

    #[test]
    fn a_part_too_big_for_one_update_is_cut_and_says_so() {
        let a = bounded(Activity {
            text: "t".repeat(MAX_PART_BYTES + 10),
            json: format!("{{\"x\":\"{}\"}}", "j".repeat(MAX_PART_BYTES)),
            ..Activity::default()
        });
        assert!(a.text.len() < MAX_PART_BYTES + 100, "{}", a.text.len());
        assert!(a.text.ends_with(&format!(
            "cut at {MAX_PART_BYTES} of {} bytes]",
            MAX_PART_BYTES + 10
        )));
        let json: serde_json::Value = serde_json::from_str(&a.json).unwrap();
        assert_eq!(json["truncated"], true);
        let small = Activity {
            text: "t".into(),
            json: "{}".into(),
            ..Activity::default()
        };
        assert_eq!(bounded(small.clone()), small);
    }

    fn thought(t: &str) -> SessionUpdate {
        SessionUpdate::AgentThoughtChunk(ContentChunk::new(ContentBlock::Text(TextContent::new(t))))
    }

    #[test]
    fn an_unparsed_update_is_kept_bounded_with_its_error() {
        let params = serde_json::json!({
            "sessionId": "s",
            "update": {"sessionUpdate": "tool_call", "toolCallId": 5, "title": "x".repeat(40_000)},
        });
        let a = unparsed("t", "session/update", &params, "invalid type: integer `5`");
        assert_eq!((a.kind.as_str(), a.rev, a.complete), (UNPARSED, 1, true));
        assert_eq!(a.text, "tool_call: invalid type: integer `5`");
        let v: serde_json::Value = serde_json::from_str(&a.json).unwrap();
        assert_eq!(v["sessionUpdate"], "tool_call");
        assert_eq!(v["method"], "session/update");
        assert_eq!(v["truncated"], true);
        assert_eq!(v["json"].as_str().unwrap().len(), MAX_UNPARSED_JSON);
        assert_eq!(clip("héllo", 2), "h");
        assert_eq!(
            error_shape("invalid type: integer `5`, expected a string at line 1 column 9"),
            "invalid type: integer `5`, expected a string"
        );
    }

    #[test]
    fn raw_input_and_output_are_bounded() {
        let output = format!("{}END", "x".repeat(100_000));
        let call = AcpToolCall::new("c1", "run")
            .raw_input(serde_json::json!({"command": ["bash", "-lc", "ls"], "cwd": "/w"}))
            .raw_output(serde_json::json!({"exit_code": 0, "stdout": output}));
        let v: serde_json::Value = serde_json::from_str(&tool_json(&call)).unwrap();
        assert_eq!(v["rawInput"]["command"][2], "ls", "small values kept");
        assert_eq!(v["rawOutput"]["exit_code"], 0);
        let out = v["rawOutput"]["stdout"].as_str().unwrap();
        assert!(out.len() < RAW_STRING_MAX + 64, "{}", out.len());
        assert!(
            out.ends_with("END") && out.contains("bytes cut"),
            "the tail kept"
        );
        // Many large strings: the whole is cut as text.
        let many: Vec<String> = (0..20).map(|_| "y".repeat(9000)).collect();
        let call = AcpToolCall::new("c2", "run").raw_output(serde_json::json!(many));
        let v: serde_json::Value = serde_json::from_str(&tool_json(&call)).unwrap();
        assert_eq!(v["rawOutput"]["truncated"], true);
        assert_eq!(v["rawOutput"]["json"].as_str().unwrap().len(), RAW_MAX);
    }

    #[test]
    fn tool_call_updates_merge_and_revs_grow() {
        let mut p = Parts::default();
        let a = p.apply(
            "t",
            SessionUpdate::ToolCall(AcpToolCall::new("c1", "Edit a.txt")),
        );
        let b = p.apply(
            "t",
            SessionUpdate::ToolCallUpdate(ToolCallUpdate::new(
                "c1",
                ToolCallUpdateFields::new().status(ToolCallStatus::Completed),
            )),
        );
        assert_eq!((a.len(), b.len()), (1, 1));
        assert_eq!(a[0].part_id, b[0].part_id);
        assert_eq!((a[0].rev, b[0].rev), (1, 2));
        assert!(!a[0].complete && b[0].complete);
        let v: serde_json::Value = serde_json::from_str(&b[0].json).unwrap();
        assert_eq!(v["title"], "Edit a.txt");
        assert_eq!(v["status"], "completed");
        assert!(p.close("t").is_empty(), "a finished call needs no closing");
    }

    #[test]
    fn a_thought_run_is_one_part_closed_by_the_next_update() {
        let mut p = Parts::default();
        let a = p.apply("t", thought("let me "));
        let b = p.apply("t", thought("think"));
        assert_eq!(a[0].part_id, b[0].part_id);
        assert_eq!(b[0].text, "let me think");
        let plan = Plan::new(vec![PlanEntry::new(
            "step",
            PlanEntryPriority::High,
            PlanEntryStatus::Pending,
        )]);
        let c = p.apply("t", SessionUpdate::Plan(plan));
        assert_eq!(c.len(), 2);
        assert_eq!((c[0].kind.as_str(), c[0].complete), (THOUGHT, true));
        assert_eq!(
            (c[1].kind.as_str(), c[1].text.as_str()),
            (PLAN, "[pending] step")
        );
        let d = p.apply("t", thought("again"));
        assert_ne!(d[0].part_id, a[0].part_id, "a new run is a new part");
        let closed = p.close("t");
        assert_eq!(closed.len(), 2, "the thought and the plan");
        assert!(closed.iter().all(|a| a.complete));
        assert_eq!(closed[1].part_id, c[1].part_id);
        assert_eq!(closed[1].rev, c[1].rev + 1);
    }
}
