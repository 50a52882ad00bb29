//! A turn: one user message and the agent's reply to it, at most once.
//!
//! - `start.rs`: SendMessage, RetryTurn and CancelTurn. The turn's intent
//!   (user message, session RUNNING, its id and the agentctl generation and
//!   instance it goes to) is committed before the Prompt.
//! - `pump.rs`: the per-session update pump storing the agent's reply.
//! - `settle.rs`: a turn left RUNNING by a restart, settled once the pump has
//!   caught up; what to do is [`sessiond_domain::turn::settle`]'s decision.
//! - `queued.rs`: messages sent while a turn runs, delivered in order.
//! - `letters.rs`: messages sent while the agent is brought back, queued
//!   at once by the recovery that holds the session.
//! - `adopt.rs`: a turn agentctl started that the store never recorded
//!   (the backend died between the Prompt and its commit), recorded from
//!   agentctl's `TurnStarted`.
//!
//! The session-metadata keys below are the turn's durable record.

mod adopt;
pub(crate) mod letters;
mod pump;
pub(crate) mod queued;
mod settle;
mod start;

pub(crate) use settle::SettlingHold;
pub(crate) use start::Turns;

use chrono::Utc;
use sessiond_domain::{
    EventPayload, MAX_SESSION_TITLE_CHARS, Message, MessageId, MessageKind, MessageRole, Session,
    SessionState, title_from_text,
};
use sessiond_store::Changeset;

use crate::{error::Result, manager::SessionManager};

/// Session metadata key of the update cursor.
pub(crate) const CURSOR_KEY: &str = "agentctl_cursor";
/// Session metadata key of the turn in progress (the user message id).
pub(crate) const TURN_KEY: &str = "turn_id";
/// Session metadata key of the newest turn the session started (kept after
/// it ends): agentctl naming another as its newest (`last_turn_id`) has a
/// turn the store never recorded, read from its stream before parking.
pub(crate) const LAST_TURN_KEY: &str = "last_turn";
/// Session metadata key of the turn a client cancelled (its id): a
/// restarted backend sends the cancel again and keeps its grace.
pub(crate) const CANCEL_KEY: &str = "cancel_requested";

/// Session metadata key of the last turn (its id) if it ended cancelled:
/// the next turn ending at once with nothing is the stop the cancel left
/// behind (`pump.rs`, `stale`). Replaced or removed at every turn's end.
pub(crate) const CANCELLED_LAST_KEY: &str = "last_turn_cancelled";

/// What a stale stop after a cancel is, in the session's error while the
/// agent restarts and in the turn's end.
pub(crate) const STALE_STOP_WHY: &str =
    "the agent ended a turn before answering it (the stop its cancelled turn left behind)";

/// The system message after a turn that ended with its cancelled
/// predecessor's stop, the agent restarted.
pub(crate) const STALE_STOP_RESTARTED: &str = "the agent ended this turn before answering it, \
with the stop the cancelled turn before it left behind (its later replies would come one turn \
late), so sessiond restarts it and loads the conversation again: send the message again once \
the session is waiting for input";

/// [`STALE_STOP_RESTARTED`] past the restart limit: the agent is stopped.
pub(crate) const STALE_STOP_STOPPED: &str = "the agent ended this turn before answering it, \
with the stop the cancelled turn before it left behind (its later replies would come one turn \
late), and sessiond does not restart it again by itself: resume the session to continue";

/// Appended to a partial reply that a settled turn completes: the prompt had
/// reached the agent, which stopped before it finished, and it is not asked
/// again.
pub(crate) const INTERRUPTED_NOTE: &str = "\n\n[sessiond: this reply was interrupted (the agent stopped before it finished) and the message was not sent again]";

/// Session metadata key of the executor generation a turn was sent to.
pub(crate) const TURN_GENERATION_KEY: &str = "turn_generation";

/// Session metadata key of the agentctl instance last known alive before a
/// turn's Prompt (see [`SessionManager::send_message`]).
pub(crate) const TURN_INSTANCE_KEY: &str = "turn_instance";

/// Session metadata key of the last turn (user message id) if it ended
/// interrupted: the one turn `retry_turn` may run again. Removed when the
/// next turn starts.
pub(crate) const INTERRUPTED_TURN_KEY: &str = sessiond_domain::queue::INTERRUPTED_TURN_KEY;

/// The system message after a turn cancelled on request (CancelTurn).
pub(crate) const TURN_CANCELLED: &str =
    "the turn was cancelled on request; the reply so far is kept as it was when the agent stopped";

/// Written to the conversation when a turn ends without a whole reply and
/// the prompt may have reached the agent: it is not sent again
/// automatically (at most once); the user decides.
pub(crate) const TURN_INTERRUPTED: &str = "the turn was interrupted: the agent may have started working on this message (it may have run tools or changed files) but its reply did not arrive whole, so sessiond did not send it again. Send it again, or retry it, if it should run again.";

/// Appended to [`TURN_INTERRUPTED`] when one message is queued behind the
/// turn: the queue is held until the user decides (`queued.rs`).
pub(crate) const QUEUE_HELD_ONE: &str = " The queued message waits until you retry this turn, or send a \
     new message to go on without it.";

/// The same for several queued messages (after "The N queued messages").
pub(crate) const QUEUE_HELD_MANY: &str =
    "wait until you retry this turn, or send a new message to go on without it.";

/// Whether an agent's error says the agent, still running, no longer has
/// the conversation (or could not open it) because the process under it
/// died: the words of the Claude Code adapter once its CLI died ("Session
/// not found", "process exited unexpectedly", and "Query closed before
/// response received" while a conversation is opened); since 0.101 it
/// forgets the conversation of a CLI that died while idle and answers the
/// next prompt ACP's "Resource not found" naming the session (helper-46 F1).
pub(crate) fn conversation_gone_in_agent(error: &str) -> bool {
    let e = error.to_ascii_lowercase();
    e.contains("session not found")
        || e.contains("process exited unexpectedly")
        || e.contains("query closed before response received")
        || (e.contains("resource not found") && e.contains("sessionid"))
}

/// The stored state of an activity part (`Message::data`):
/// `{"rev": n, "update": <the part as ACP JSON>}`. JSON that does not parse
/// is kept as a string, never dropped.
pub(crate) fn part_data(rev: u64, json: &str) -> String {
    let update = serde_json::from_str::<serde_json::Value>(json)
        .unwrap_or_else(|_| serde_json::Value::String(json.to_owned()));
    serde_json::json!({ "rev": rev, "update": update }).to_string()
}

/// The title an ACP `session_info_update` gives, made one line; `None`
/// for another update or one without a (printable) title.
fn agent_title(json: &str) -> Option<String> {
    let v = serde_json::from_str::<serde_json::Value>(json).ok()?;
    if v.get("sessionUpdate")?.as_str()? != "session_info_update" {
        return None;
    }
    let title = title_from_text(v.get("title")?.as_str()?, MAX_SESSION_TITLE_CHARS);
    (!title.is_empty()).then_some(title)
}

/// The rev of a stored part (0 when it has none).
fn stored_part_rev(data: &str) -> u64 {
    serde_json::from_str::<serde_json::Value>(data)
        .ok()
        .and_then(|v| v.get("rev")?.as_u64())
        .unwrap_or(0)
}

/// `<generation>:<cursor>@<instance>`: a cursor means something only to the
/// agentctl process (instance) that numbered it.
pub(crate) fn cursor_value(generation: i64, cursor: u64, instance: &str) -> String {
    if instance.is_empty() {
        format!("{generation}:{cursor}")
    } else {
        format!("{generation}:{cursor}@{instance}")
    }
}

/// The stored cursor and its agentctl instance if it belongs to
/// `generation`, else `(0, "")`.
pub(crate) fn stored_cursor(session: &Session, generation: i64) -> (u64, String) {
    session
        .metadata
        .get(CURSOR_KEY)
        .and_then(|v| v.split_once(':'))
        .filter(|(g, _)| g.parse::<i64>().ok() == Some(generation))
        .and_then(|(_, rest)| {
            let (c, instance) = rest.split_once('@').unwrap_or((rest, ""));
            Some((c.parse().ok()?, instance.to_owned()))
        })
        .unwrap_or_default()
}

/// The turn a session was running when recovery or a resume takes it up:
/// [`pending_turn`], or the turn of a STARTING session (an explicit resume
/// of a RUNNING session commits STARTING with the turn kept, then brings
/// the agent back; a crash in between leaves it so).
pub(crate) fn turn_in_flight(session: &Session) -> Option<String> {
    matches!(
        session.state,
        SessionState::Running | SessionState::Starting
    )
    .then(|| session.metadata.get(TURN_KEY).cloned())
    .flatten()
}

/// The turn a RUNNING session waits for (its user message id), if any.
pub(crate) fn pending_turn(session: &Session) -> Option<String> {
    (session.state == SessionState::Running)
        .then(|| session.metadata.get(TURN_KEY).cloned())
        .flatten()
}

/// True when no prompt has been answered in the session yet: no user
/// message but the pending turn's (its first message, which an agentctl
/// killed before it took it never delivered: helper-46 F4) and nothing of
/// a reply. The agent then holds nothing of the conversation, so a new one
/// may replace it when its load is refused. Read from the first few
/// messages only (session-wide parts such as the agent's commands may come
/// before any prompt); more than that is taken as prompted.
pub(crate) async fn no_turn_yet(store: &sessiond_store::Store, session: &Session) -> Result<bool> {
    const LOOK: u32 = 8;
    let pending = pending_turn(session);
    let first = store.list_messages(session.id, 0, LOOK).await?;
    if first.len() >= LOOK as usize {
        return Ok(false);
    }
    Ok(first.iter().all(|m| match m.role {
        MessageRole::User => pending.as_deref() == Some(m.id.to_string().as_str()),
        MessageRole::Agent => matches!(
            m.kind,
            MessageKind::AvailableCommands | MessageKind::CurrentMode | MessageKind::Other
        ),
        _ => true,
    }))
}

/// What ends turn `turn` of `session` *interrupted*, added to `change`: the
/// stored, unfinished part of its reply completed with [`INTERRUPTED_NOTE`]
/// (kept, never shortened), its open activity closed (a tool call still
/// pending or in progress as `failed`), a system message saying the turn
/// was interrupted and why (with its `message.added`), and in `next`'s
/// metadata the turn cleared and recorded as the one `retry_turn` may run
/// again. The caller holds the session lock, has flushed (not completed)
/// the reply it was streaming, and adds the state change after this.
pub(crate) async fn interrupt_turn(
    mgr: &SessionManager,
    session: &Session,
    turn: &str,
    why: &str,
    change: Changeset,
    next: &mut Session,
) -> Result<Changeset> {
    cut_turn(mgr, session, turn, Cut::Interrupted(why), change, next).await
}

/// How a turn is cut short by sessiond (not by the agent's own end).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Cut<'a> {
    /// It may have reached the agent and its reply did not arrive whole
    /// (`why`): `interrupted`, the user may retry it.
    Interrupted(&'a str),
    /// The user stopped the session during the turn: `cancelled`.
    Stopped,
    /// The user cancelled the turn, the agent went on, and sessiond
    /// stopped it (`why`): `cancelled`, as a cancel the agent honours.
    CancelEnforced(&'a str),
}

/// Appended to a partial reply whose agent sessiond stopped after it
/// ignored the turn's cancel.
pub(crate) const CANCEL_ENFORCED_NOTE: &str =
    "\n\n[sessiond: the turn was cancelled; the agent did not stop, so sessiond stopped it]";

/// Appended to a partial reply whose session was stopped during its turn.
pub(crate) const STOPPED_NOTE: &str =
    "\n\n[sessiond: the session was stopped before this reply finished]";

/// The system message after a turn the session's stop cut short.
pub(crate) const TURN_STOPPED: &str =
    "the session was stopped before the agent finished this turn; the reply so far is kept";

/// [`interrupt_turn`], or the end of a turn whose session was stopped
/// (`cancelled`, not kept for `retry_turn`).
pub(crate) async fn cut_turn(
    mgr: &SessionManager,
    session: &Session,
    turn: &str,
    cut: Cut<'_>,
    mut change: Changeset,
    next: &mut Session,
) -> Result<Changeset> {
    let msgs = mgr
        .inner
        .store
        .list_messages(session.id, 0, u32::MAX)
        .await?;
    let user_seq = msgs
        .iter()
        .find(|m| m.role == MessageRole::User && m.id.to_string() == turn)
        .map(|m| m.seq);
    let now = Utc::now();
    if let Some(seq) = user_seq {
        for r in msgs.iter().filter(|m| {
            m.role == MessageRole::Agent
                && m.seq > seq
                // Requests are ended below, with their own state.
                && m.kind != MessageKind::Permission
                // A part stored complete may still say it runs: a tool call
                // in progress, a terminal not exited.
                && (!m.complete
                    || (m.kind == MessageKind::ToolCall && failed_tool_call(&m.data) != m.data)
                    || (m.kind == MessageKind::Terminal && released_terminal(&m.data) != m.data))
        }) {
            let mut m = r.clone();
            m.complete = true;
            m.updated_at = now;
            if m.kind == MessageKind::Text {
                let note = match cut {
                    Cut::Interrupted(_) => INTERRUPTED_NOTE,
                    Cut::Stopped => STOPPED_NOTE,
                    Cut::CancelEnforced(_) => CANCEL_ENFORCED_NOTE,
                };
                m.content = format!("{}{note}", r.content);
                change = change.update_message(r.id, m.content.clone(), true);
            } else {
                if m.kind == MessageKind::ToolCall {
                    m.data = failed_tool_call(&r.data);
                }
                if m.kind == MessageKind::Terminal {
                    m.data = released_terminal(&r.data);
                }
                change = change.update_part(r.id, m.content.clone(), m.data.clone(), true);
            }
            change = change.event(session.id, EventPayload::MessageUpdated(m));
        }
    }
    let held = sessiond_domain::queue::queued(&session.metadata).len();
    let (note, stop_reason, error) = match cut {
        Cut::Interrupted(why) => (
            format!(
                "{TURN_INTERRUPTED} ({why}){}",
                match held {
                    0 => String::new(),
                    1 => QUEUE_HELD_ONE.to_owned(),
                    n => format!(" The {n} queued messages {QUEUE_HELD_MANY}"),
                }
            ),
            "interrupted",
            Some(why.to_owned()),
        ),
        Cut::Stopped => (TURN_STOPPED.to_owned(), "cancelled", None),
        Cut::CancelEnforced(why) => (
            format!("{TURN_CANCELLED} ({why})"),
            "cancelled",
            Some(why.to_owned()),
        ),
    };
    // Requests the agent waited on die with the turn.
    let request_reason = match cut {
        Cut::Interrupted(why) => format!("the turn was interrupted: {why}"),
        Cut::Stopped => "the session was stopped".to_owned(),
        Cut::CancelEnforced(_) => "the turn was cancelled".to_owned(),
    };
    change = crate::permission::cancel_open(mgr, session.id, change, &request_reason).await?;
    let note = Message {
        id: MessageId::new(),
        session_id: session.id,
        task_id: session.task_id,
        role: MessageRole::System,
        content: note,
        kind: MessageKind::Text,
        data: String::new(),
        seq: 0,
        complete: true,
        created_at: now,
        updated_at: now,
    };
    change = change
        .add_message(note.clone())
        .event(session.id, EventPayload::MessageAdded(note))
        .event(
            session.id,
            EventPayload::TurnEnded {
                turn_id: turn.to_owned(),
                stop_reason: stop_reason.into(),
                error_message: error,
            },
        );
    end_turn_record(&mut next.metadata);
    next.metadata.insert(LAST_TURN_KEY.into(), turn.to_owned());
    next.metadata.remove(TURN_GENERATION_KEY);
    next.metadata.remove(TURN_INSTANCE_KEY);
    if user_seq.is_some() && matches!(cut, Cut::Interrupted(_)) {
        next.metadata
            .insert(INTERRUPTED_TURN_KEY.into(), turn.to_owned());
    }
    Ok(change)
}

/// The session's turn is over: it is no longer in progress, and it stays
/// the session's newest (a turn recovery found only on agentctl included,
/// so the next recovery does not take it up again).
pub(crate) fn end_turn_record(metadata: &mut std::collections::BTreeMap<String, String>) {
    if let Some(turn) = metadata.remove(TURN_KEY) {
        metadata.insert(LAST_TURN_KEY.into(), turn);
    }
}

/// A tool call's stored state (`{"rev", "update"}`) closed with its turn:
/// still pending (ACP's default when the status is left out) or in
/// progress, it is `failed`, since it will not finish; else it is kept.
fn failed_tool_call(data: &str) -> String {
    let Ok(mut v) = serde_json::from_str::<serde_json::Value>(data) else {
        return data.to_owned();
    };
    if let Some(update) = v.get_mut("update").and_then(|u| u.as_object_mut())
        && matches!(
            update.get("status").and_then(|s| s.as_str()),
            None | Some("pending" | "in_progress")
        )
    {
        update.insert("status".into(), serde_json::Value::String("failed".into()));
        return v.to_string();
    }
    data.to_owned()
}

/// A terminal's stored state (`{"rev", "update"}`, agentctl's JSON with
/// `exitStatus` once it exited) closed with its turn: one that has not
/// exited is `released` (agentctl ends a turn's terminals
/// with it, so nothing will report its exit); else it is kept.
fn released_terminal(data: &str) -> String {
    let Ok(mut v) = serde_json::from_str::<serde_json::Value>(data) else {
        return data.to_owned();
    };
    if let Some(update) = v.get_mut("update").and_then(|u| u.as_object_mut())
        && !update
            .get("exitStatus")
            .is_some_and(serde_json::Value::is_object)
        && update.get("released").and_then(serde_json::Value::as_bool) != Some(true)
    {
        update.insert("released".into(), serde_json::Value::Bool(true));
        return v.to_string();
    }
    data.to_owned()
}

#[cfg(test)]
mod tests {
    use super::{failed_tool_call, released_terminal};

    #[test]
    fn a_running_terminal_is_released_with_its_turn() {
        let running = r#"{"rev":2,"update":{"terminalId":"t","command":"sleep","released":false}}"#;
        let closed: serde_json::Value = serde_json::from_str(&released_terminal(running)).unwrap();
        assert_eq!(closed["update"]["released"], true);
        assert_eq!(closed["update"]["terminalId"], "t");
        assert_eq!(closed["rev"], 2);
        let exited = r#"{"rev":3,"update":{"terminalId":"t","exitStatus":{"exitCode":0}}}"#;
        assert_eq!(released_terminal(exited), exited);
        let released = r#"{"rev":3,"update":{"terminalId":"t","released":true}}"#;
        assert_eq!(released_terminal(released), released);
        assert_eq!(released_terminal("not json"), "not json");
    }

    use super::pump::{MAX_REPLY_BYTES, REPLY_CUT_NOTE, append_capped};

    #[test]
    fn a_reply_is_cut_at_its_limit_on_a_char_boundary_and_says_so() {
        let mut reply = String::new();
        let piece = "é".repeat(1 << 19); // 1 MiB
        let mut grew = 0;
        while append_capped(&mut reply, &piece) {
            grew += 1;
            assert!(grew < 64, "never cut");
        }
        assert!(reply.len() <= MAX_REPLY_BYTES, "{}", reply.len());
        assert!(reply.ends_with(REPLY_CUT_NOTE));
        assert!(reply.len() > MAX_REPLY_BYTES - REPLY_CUT_NOTE.len() - 2);
        // Cut once: later text changes nothing.
        let cut = reply.clone();
        assert!(!append_capped(&mut reply, "more"));
        assert_eq!(reply, cut);
        let mut small = "a".to_owned();
        assert!(append_capped(&mut small, "b"));
        assert_eq!(small, "ab");
    }

    fn status(data: &str) -> Option<String> {
        let v: serde_json::Value = serde_json::from_str(data).unwrap();
        v["update"]["status"].as_str().map(str::to_owned)
    }

    #[test]
    fn a_cut_turn_fails_its_unfinished_tool_calls_and_keeps_finished_ones() {
        let pending = r#"{"rev":2,"update":{"toolCallId":"t","title":"write"}}"#;
        assert_eq!(
            status(&failed_tool_call(pending)).as_deref(),
            Some("failed")
        );
        let running = r#"{"rev":3,"update":{"toolCallId":"t","status":"in_progress"}}"#;
        let failed = failed_tool_call(running);
        assert_eq!(status(&failed).as_deref(), Some("failed"));
        assert!(failed.contains(r#""rev":3"#), "{failed}");
        let done = r#"{"rev":4,"update":{"toolCallId":"t","status":"completed"}}"#;
        assert_eq!(failed_tool_call(done), done);
        assert_eq!(failed_tool_call("not json"), "not json");
    }
}
