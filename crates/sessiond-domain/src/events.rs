//! Session events: every event a client can see is stored first (the outbox).

use std::fmt;

use chrono::{DateTime, Utc};

use crate::{
    entities::Message,
    ids::{ExecutorId, SessionId, TaskId},
    states::{Runtime, SessionState},
};

/// The event kinds, with their wire names: the six of the seed, then the
/// end of every turn, a conversation the agent had lost, replaced, and a
/// permission request of policy `ask` asked and resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventKind {
    AgentctlStarting,
    AgentctlReady,
    AgentctlError,
    StateChanged,
    MessageAdded,
    MessageUpdated,
    TurnEnded,
    ConversationReplaced,
    PermissionRequested,
    PermissionResolved,
}

impl EventKind {
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
    ];

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
        }
    }

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
    AgentctlStarting {
        executor_id: ExecutorId,
        runtime: Runtime,
        generation: i64,
    },
    AgentctlReady {
        executor_id: ExecutorId,
        runtime: Runtime,
        /// `None` while the agent has not been probed yet (agentctl is up,
        /// the agent not launched): the claim alone proves nothing.
        supports_session_resume: Option<bool>,
    },
    AgentctlError {
        executor_id: ExecutorId,
        error_message: String,
    },
    StateChanged {
        from: SessionState,
        to: SessionState,
        error_message: Option<String>,
    },
    MessageAdded(Message),
    MessageUpdated(Message),
    /// A turn ended, however: `stop_reason` is the agent's (ACP
    /// `end_turn`, `max_tokens`, `max_turn_requests`, `refusal`,
    /// `cancelled`), or `error` (the turn failed, `error_message` says why)
    /// or `interrupted` (its end is unknown: the agent or agentctl died).
    TurnEnded {
        /// The id of the user message that started the turn.
        turn_id: String,
        stop_reason: String,
        error_message: Option<String>,
    },
    /// The agent could not load a conversation that had no turn yet (agents
    /// that store nothing before the first prompt); a new one replaced it.
    ConversationReplaced {
        previous_resume_token: String,
        resume_token: String,
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
}

impl EventPayload {
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
        }
    }
}

/// A stored event. `seq` is per session and `task_seq` per task; both start
/// at 1 and have no gaps, so they serve as resumable cursors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub session_id: SessionId,
    pub task_id: TaskId,
    pub seq: i64,
    pub task_seq: i64,
    pub payload: EventPayload,
    pub created_at: DateTime<Utc>,
}

impl Event {
    pub const fn kind(&self) -> EventKind {
        self.payload.kind()
    }
}
