//! Session events: every event a client can see is stored first (the outbox).

use std::fmt;

use chrono::{DateTime, Utc};

use crate::{
    entities::Message,
    ids::{ExecutorId, SessionId, TaskId},
    states::{Runtime, SessionState},
};

/// The six event kinds of the seed, with their wire names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventKind {
    AgentctlStarting,
    AgentctlReady,
    AgentctlError,
    StateChanged,
    MessageAdded,
    MessageUpdated,
}

impl EventKind {
    pub const ALL: &'static [EventKind] = &[
        EventKind::AgentctlStarting,
        EventKind::AgentctlReady,
        EventKind::AgentctlError,
        EventKind::StateChanged,
        EventKind::MessageAdded,
        EventKind::MessageUpdated,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            EventKind::AgentctlStarting => "session.agentctl_starting",
            EventKind::AgentctlReady => "session.agentctl_ready",
            EventKind::AgentctlError => "session.agentctl_error",
            EventKind::StateChanged => "session.state_changed",
            EventKind::MessageAdded => "session.message.added",
            EventKind::MessageUpdated => "session.message.updated",
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
