//! Session events: every event a client can see is stored first (the outbox).

use std::fmt;

use chrono::{DateTime, Utc};

use crate::{
    entities::Message,
    ids::{ExecutorId, SessionId, TaskId},
    states::{Runtime, SessionState},
};

/// The event kinds, with their wire names: the six every session has
/// (agentctl starting / ready / error, state and message changes), then the
/// end of every turn, a conversation the agent had lost, replaced, and a
/// permission request of policy `ask` asked and resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// `session.agentctl_starting`: a (re)launch of agentctl began.
    AgentctlStarting,
    /// `session.agentctl_ready`: agentctl answered and the workspace is usable.
    AgentctlReady,
    /// `session.agentctl_error`: the executor failed.
    AgentctlError,
    /// `session.state_changed`: the session's state changed.
    StateChanged,
    /// `session.message.added`: a message was added.
    MessageAdded,
    /// `session.message.updated`: a message changed (streamed text, a tool
    /// call's progress, completion).
    MessageUpdated,
    /// `session.turn_ended`: a turn ended, however it ended.
    TurnEnded,
    /// `session.conversation_replaced`: a lost, empty conversation was replaced.
    ConversationReplaced,
    /// `session.permission.requested`: the agent waits for a permission answer.
    PermissionRequested,
    /// `session.permission.resolved`: a permission request stopped waiting.
    PermissionResolved,
    /// `session.queue_changed`: a message was queued, delivered or cancelled.
    QueueChanged,
}

impl EventKind {
    /// Every kind, in declaration order.
    pub const ALL: &'static [EventKind] = &[
        EventKind::AgentctlStarting,
        EventKind::AgentctlReady,
        EventKind::AgentctlError,
        EventKind::StateChanged,
        EventKind::MessageAdded,
        EventKind::MessageUpdated,
        EventKind::TurnEnded,
        EventKind::ConversationReplaced,
        EventKind::PermissionRequested,
        EventKind::PermissionResolved,
        EventKind::QueueChanged,
    ];

    /// The wire name, as stored and as clients filter on
    /// (e.g. `session.message.added`).
    pub const fn as_str(self) -> &'static str {
        match self {
            EventKind::AgentctlStarting => "session.agentctl_starting",
            EventKind::AgentctlReady => "session.agentctl_ready",
            EventKind::AgentctlError => "session.agentctl_error",
            EventKind::StateChanged => "session.state_changed",
            EventKind::MessageAdded => "session.message.added",
            EventKind::MessageUpdated => "session.message.updated",
            EventKind::TurnEnded => "session.turn_ended",
            EventKind::ConversationReplaced => "session.conversation_replaced",
            EventKind::PermissionRequested => "session.permission.requested",
            EventKind::PermissionResolved => "session.permission.resolved",
            EventKind::QueueChanged => "session.queue_changed",
        }
    }

    /// The kind whose wire name is `value`; `None` for any other text.
    ///
    /// ```
    /// use sessiond_domain::EventKind;
    ///
    /// assert_eq!(EventKind::parse("session.turn_ended"), Some(EventKind::TurnEnded));
    /// assert_eq!(EventKind::TurnEnded.to_string(), "session.turn_ended");
    /// assert_eq!(EventKind::parse("turn_ended"), None);
    /// ```
    pub fn parse(value: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|k| k.as_str() == value)
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What an event says. The kind follows from the variant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventPayload {
    /// A launch intent was written: agentctl is being (re)started.
    AgentctlStarting {
        /// The executor being launched.
        executor_id: ExecutorId,
        /// Where it runs.
        runtime: Runtime,
        /// The new generation (one more than before this launch).
        generation: i64,
    },
    /// agentctl answered `Health` with the right identity: shell, files and
    /// git work from now on, whatever the agent does.
    AgentctlReady {
        /// The executor that is ready.
        executor_id: ExecutorId,
        /// Where it runs.
        runtime: Runtime,
        /// `None` while the agent has not been probed yet (agentctl is up,
        /// the agent not launched): the claim alone proves nothing.
        supports_session_resume: Option<bool>,
    },
    /// The executor failed (launch, health, container, host).
    AgentctlError {
        /// The executor that failed.
        executor_id: ExecutorId,
        /// `"<code>: <what to do>"`, as stored on the record.
        error_message: String,
    },
    /// The session moved from one state to another (never a self-loop).
    StateChanged {
        /// The state before.
        from: SessionState,
        /// The state now.
        to: SessionState,
        /// The session's error when `to` is ERROR, else `None`.
        error_message: Option<String>,
    },
    /// A message was added: a prompt, the first chunk of a reply, an
    /// activity part, a system note.
    MessageAdded(Message),
    /// A message changed: the whole message as it is now (not a delta).
    MessageUpdated(Message),
    /// A turn ended, however: `stop_reason` is the agent's (ACP
    /// `end_turn`, `max_tokens`, `max_turn_requests`, `refusal`,
    /// `cancelled`), or `error` (the turn failed, `error_message` says why)
    /// or `interrupted` (its end is unknown: the agent or agentctl died).
    TurnEnded {
        /// The id of the user message that started the turn.
        turn_id: String,
        /// How it ended (see above).
        stop_reason: String,
        /// Why, when `stop_reason` is `error` or `interrupted`.
        error_message: Option<String>,
    },
    /// The agent could not load a conversation that had no turn yet (agents
    /// that store nothing before the first prompt); a new one replaced it.
    ConversationReplaced {
        /// The token the agent could not load.
        previous_resume_token: String,
        /// The new conversation's token, now the session's resume token.
        resume_token: String,
        /// The agent's error when loading the old one.
        reason: String,
    },
    /// The agent asks permission (policy `ask`) and waits for an answer:
    /// the request's message (kind `Permission`, its data the request).
    PermissionRequested(Message),
    /// A permission request stopped waiting.
    PermissionResolved {
        /// The request's id (= its message's id).
        request_id: String,
        /// `selected`, `timed_out` or `cancelled`.
        outcome: String,
        /// The option the agent was given, if any.
        option_id: Option<String>,
        /// Why (timeouts and cancels).
        reason: Option<String>,
    },
    /// The session's queue of messages waiting for the running turn
    /// changed (one queued, delivered or cancelled): the whole queue as it
    /// is now, oldest first.
    QueueChanged(Vec<crate::QueuedMessage>),
}

impl EventPayload {
    /// The kind this payload is published as.
    pub const fn kind(&self) -> EventKind {
        match self {
            EventPayload::AgentctlStarting { .. } => EventKind::AgentctlStarting,
            EventPayload::AgentctlReady { .. } => EventKind::AgentctlReady,
            EventPayload::AgentctlError { .. } => EventKind::AgentctlError,
            EventPayload::StateChanged { .. } => EventKind::StateChanged,
            EventPayload::MessageAdded(_) => EventKind::MessageAdded,
            EventPayload::MessageUpdated(_) => EventKind::MessageUpdated,
            EventPayload::TurnEnded { .. } => EventKind::TurnEnded,
            EventPayload::ConversationReplaced { .. } => EventKind::ConversationReplaced,
            EventPayload::PermissionRequested(_) => EventKind::PermissionRequested,
            EventPayload::PermissionResolved { .. } => EventKind::PermissionResolved,
            EventPayload::QueueChanged(_) => EventKind::QueueChanged,
        }
    }
}

/// A stored event. `seq` is per session and `task_seq` per task; both start
/// at 1 and have no gaps, so they serve as resumable cursors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The session the event is about.
    pub session_id: SessionId,
    /// The task of that session.
    pub task_id: TaskId,
    /// Position in the session's stream, from 1, without gaps: watch a
    /// session from `seq + 1` to miss nothing.
    pub seq: i64,
    /// Position in the task's stream (all its sessions), from 1, without gaps.
    pub task_seq: i64,
    /// What happened.
    pub payload: EventPayload,
    /// When the event was stored (UTC).
    pub created_at: DateTime<Utc>,
}

impl Event {
    /// The payload's kind.
    pub const fn kind(&self) -> EventKind {
        self.payload.kind()
    }
}
