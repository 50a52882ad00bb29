//! The states of tasks, sessions and executors, and the runtimes, with the
//! exact string forms of the seed design (these are what the store writes).

use std::fmt;

/// A string that names none of the values of an enum.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {kind} {value:?}; expected one of: {expected}")]
pub struct UnknownValue {
    pub kind: &'static str,
    pub value: String,
    pub expected: &'static str,
}

macro_rules! string_enum {
    ($(#[$doc:meta])* $name:ident, $kind:literal, { $($(#[$vdoc:meta])* $variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $name {
            $($(#[$vdoc])* $variant),+
        }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            pub const fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }

            pub fn parse(value: &str) -> Result<Self, UnknownValue> {
                match value {
                    $($text => Ok($name::$variant),)+
                    _ => Err(UnknownValue {
                        kind: $kind,
                        value: value.to_owned(),
                        expected: concat!($($text, " "),+),
                    }),
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl std::str::FromStr for $name {
            type Err = UnknownValue;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Self::parse(s)
            }
        }
    };
}

string_enum!(
    /// Lifecycle of a task.
    TaskState, "task state", {
    Todo => "TODO",
    InProgress => "IN_PROGRESS",
    Review => "REVIEW",
    Completed => "COMPLETED",
    Cancelled => "CANCELLED",
});

string_enum!(
    /// Lifecycle of a session (one conversation with one agent).
    SessionState, "session state", {
    Created => "CREATED",
    Starting => "STARTING",
    /// The agent works on a turn.
    Running => "RUNNING",
    /// The agent is idle and waits for the next message.
    WaitingForInput => "WAITING_FOR_INPUT",
    Completed => "COMPLETED",
    Cancelled => "CANCELLED",
    Error => "ERROR",
});

string_enum!(
    /// Status of an executor (agentctl and its workspace).
    ExecutorStatus, "executor status", {
    Starting => "starting",
    Ready => "ready",
    Error => "error",
    Stopped => "stopped",
});

string_enum!(
    /// Where an executor runs.
    Runtime, "runtime", {
    LocalDocker => "local_docker",
    LocalStandalone => "local_standalone",
    Remote => "remote",
});

string_enum!(
    /// Author of a message.
    MessageRole, "message role", {
    User => "user",
    Agent => "agent",
    System => "system",
});

string_enum!(
    /// What a message holds: text (a user message, an agent's reply, a
    /// system note), or a part of the agent's activity during a turn (ACP
    /// `session/update` kinds other than the reply's text). Activity parts
    /// keep their state as the agent described it in `Message::data`.
    MessageKind, "message kind", {
    Text => "text",
    /// ACP `tool_call`, with every later `tool_call_update` merged in.
    ToolCall => "tool_call",
    /// ACP `plan` (each plan update replaces the whole plan).
    Plan => "plan",
    /// ACP `agent_thought_chunk`s in a row, as one text.
    Thought => "thought",
    /// ACP `available_commands_update`.
    AvailableCommands => "available_commands",
    /// ACP `current_mode_update`.
    CurrentMode => "current_mode",
    /// Any other `session/update` kind, kept as the agent sent it.
    Other => "other",
    /// A permission request of policy `ask` (ACP
    /// `session/request_permission`): incomplete while it waits.
    Permission => "permission",
});

string_enum!(
    /// How agentctl answers the agent's permission requests for a profile.
    PermissionPolicy, "permission policy", {
    /// Pick the agent's allow option.
    Allow => "allow",
    /// Pick the agent's reject option (or cancel the request).
    Deny => "deny",
    /// Ask a client (`RespondToPermission`), at most the profile's
    /// permission timeout; then the agent's reject option.
    Ask => "ask",
});

impl SessionState {
    /// COMPLETED and CANCELLED: nothing runs and nothing will be resumed.
    pub const fn is_terminal(self) -> bool {
        matches!(self, SessionState::Completed | SessionState::Cancelled)
    }
}

impl ExecutorStatus {
    /// Recovery picks up executors in these statuses (seed Startup Flow step 1).
    pub const RECOVERABLE: &'static [ExecutorStatus] =
        &[ExecutorStatus::Starting, ExecutorStatus::Ready];
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn string_forms_round_trip() {
        for s in SessionState::ALL {
            assert_eq!(SessionState::parse(s.as_str()), Ok(*s));
        }
        for k in MessageKind::ALL {
            assert_eq!(MessageKind::parse(k.as_str()), Ok(*k));
        }
        for s in ExecutorStatus::ALL {
            assert_eq!(ExecutorStatus::parse(s.as_str()), Ok(*s));
        }
        for r in Runtime::ALL {
            assert_eq!(Runtime::parse(r.as_str()), Ok(*r));
        }
        for t in TaskState::ALL {
            assert_eq!(TaskState::parse(t.as_str()), Ok(*t));
        }
    }

    #[test]
    fn seed_string_forms() {
        assert_eq!(SessionState::WaitingForInput.as_str(), "WAITING_FOR_INPUT");
        assert_eq!(ExecutorStatus::Ready.as_str(), "ready");
        assert_eq!(Runtime::LocalStandalone.as_str(), "local_standalone");
    }

    #[test]
    fn unknown_value_lists_the_expected_ones() {
        let err = Runtime::parse("k8s").unwrap_err();
        assert!(err.to_string().contains("local_docker"));
    }
}
