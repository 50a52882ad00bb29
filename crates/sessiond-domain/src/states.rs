//! The states of tasks, sessions and executors, and the runtimes, with the
//! exact string forms of the seed design (these are what the store writes).

use std::fmt;

/// A string that names none of the values of an enum.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {kind} {value:?}; expected one of: {expected}")]
pub struct UnknownValue {
    /// What was being parsed, in words (`"session state"`, `"runtime"`, ...).
    pub kind: &'static str,
    /// The text that was given, unchanged.
    pub value: String,
    /// The accepted string forms, separated by spaces.
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
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The string form the store writes and the API shows (exact case).
            pub const fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }

            /// The value whose [`as_str`](Self::as_str) is `value` (exact,
            /// case-sensitive match).
            ///
            /// # Errors
            ///
            /// [`UnknownValue`], listing the accepted forms, for any other text.
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
    ///
    /// Moves by [`TaskEvent`](crate::TaskEvent)s through
    /// [`TaskState::transition`]; COMPLETED and CANCELLED are terminal.
    TaskState, "task state", {
    /// Created; no agent has worked on it yet.
    Todo => "TODO",
    /// An agent of the task is working (a launch or a new message).
    InProgress => "IN_PROGRESS",
    /// An agent finished a turn or was resumed, and waits for the user to look.
    Review => "REVIEW",
    /// The work is done (terminal).
    Completed => "COMPLETED",
    /// The user gave the task up (terminal).
    Cancelled => "CANCELLED",
});

string_enum!(
    /// Lifecycle of a session (one conversation with one agent).
    ///
    /// Moves by [`SessionEvent`](crate::SessionEvent)s through
    /// [`SessionState::transition`], which documents the legal moves.
    ///
    /// ```
    /// use sessiond_domain::{SessionEvent, SessionState};
    ///
    /// let s = SessionState::Created.transition(SessionEvent::LaunchRequested)?;
    /// assert_eq!(s, SessionState::Starting);
    /// assert_eq!(s.as_str(), "STARTING");
    /// assert_eq!("WAITING_FOR_INPUT".parse(), Ok(SessionState::WaitingForInput));
    /// # Ok::<(), sessiond_domain::IllegalSessionTransition>(())
    /// ```
    SessionState, "session state", {
    /// Recorded, but no agent was launched yet; it has no conversation.
    Created => "CREATED",
    /// The agent is being launched or resumed (or, right after a backend
    /// restart, was being so when the backend stopped).
    Starting => "STARTING",
    /// The agent works on a turn.
    Running => "RUNNING",
    /// The agent is idle and waits for the next message.
    WaitingForInput => "WAITING_FOR_INPUT",
    /// The work is done; nothing runs and nothing is resumed (terminal).
    Completed => "COMPLETED",
    /// The user ended the session (terminal).
    Cancelled => "CANCELLED",
    /// Launch, resume, the agent or its executor failed; the session's
    /// `error_message` says why. Resumed only on explicit request.
    Error => "ERROR",
});

string_enum!(
    /// Status of an executor (agentctl and its workspace).
    ///
    /// Moves by [`ExecutorEvent`](crate::ExecutorEvent)s through
    /// [`ExecutorStatus::transition`]. The string forms are lower case, as
    /// in the seed's `executors_running.status`.
    ExecutorStatus, "executor status", {
    /// A (re)launch intent is written: agentctl is being spawned or has not
    /// answered `Health` yet.
    Starting => "starting",
    /// agentctl answered `Health` with this executor's identity; workspace
    /// access (shell, files, git) works.
    Ready => "ready",
    /// agentctl, its container or its host failed or cannot be found; the
    /// record's `error_message` says why (some errors are retried in the
    /// background, see [`retrying_message`](crate::retrying_message)).
    Error => "error",
    /// Stopped on purpose; nothing runs until a new launch intent.
    Stopped => "stopped",
});

string_enum!(
    /// Where an executor runs.
    Runtime, "runtime", {
    /// agentctl in a Docker container on this host, found again by
    /// container id or label.
    LocalDocker => "local_docker",
    /// agentctl as a local process, found again by pid and its start time.
    LocalStandalone => "local_standalone",
    /// agentctl already running on another host, reached by its URL.
    Remote => "remote",
});

string_enum!(
    /// Author of a message.
    MessageRole, "message role", {
    /// Written by a client (a prompt).
    User => "user",
    /// Produced by the agent (its reply or its activity during a turn).
    Agent => "agent",
    /// Written by sessiond itself (e.g. a note that a turn was interrupted).
    System => "system",
});

string_enum!(
    /// What a message holds: text (a user message, an agent's reply, a
    /// system note), or a part of the agent's activity during a turn (ACP
    /// `session/update` kinds other than the reply's text). Activity parts
    /// keep their state as the agent described it in `Message::data`.
    MessageKind, "message kind", {
    /// Plain text: a prompt, a reply, or a system note.
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
    /// COMPLETED and CANCELLED: nothing runs and nothing will be resumed;
    /// no event moves the session out of them.
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
