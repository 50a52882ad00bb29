//! The states of tasks, sessions and executors, and the runtimes, with the
//! exact string forms the store writes and the API shows (fixed: clients
//! and stored rows depend on them).

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
    /// in `executors_running.status`.
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

/// Where an executor runs: one of the three built-in runtimes, or a runtime
/// a third party registered under a name of its own (an `Executor` driver
/// whose `runtime()` is [`Runtime::Custom`]).
///
/// `Copy` like the other states: a custom name is held inline
/// ([`RuntimeName`]), not on the heap.
///
/// ```
/// use sessiond_domain::Runtime;
///
/// assert_eq!(Runtime::parse("local_docker"), Ok(Runtime::LocalDocker));
/// let vm = Runtime::parse("vm").unwrap();
/// assert!(!vm.is_built_in());
/// assert_eq!(vm.as_str(), "vm");
/// assert!(Runtime::parse("Not A Name").is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Runtime {
    /// agentctl in a Docker container on this host, found again by
    /// container id or label.
    LocalDocker,
    /// agentctl as a local process, found again by pid and its start time.
    LocalStandalone,
    /// agentctl already running on another host, reached by its URL.
    Remote,
    /// A runtime registered by a third party under its own name (a VM, a
    /// Kubernetes pod, ...). Recovery asks its driver (`Executor::probe`)
    /// what became of an executor, then reattaches, starts or relaunches it.
    Custom(RuntimeName),
}

/// What [`Runtime::parse`] and [`RuntimeName::new`] accept besides the
/// built-in names.
const RUNTIME_FORMS: &str = "local_docker local_standalone remote, or a registered runtime's name \
     (1 to 40 characters of a-z, 0-9, '_' and '-')";

impl Runtime {
    /// The built-in runtimes, in declaration order (custom runtimes are
    /// whatever drivers register).
    pub const ALL: &'static [Runtime] = &[
        Runtime::LocalDocker,
        Runtime::LocalStandalone,
        Runtime::Remote,
    ];

    /// The string form the store writes and the API shows (exact case): a
    /// built-in name, or the custom runtime's name.
    pub fn as_str(&self) -> &str {
        match self {
            Runtime::LocalDocker => "local_docker",
            Runtime::LocalStandalone => "local_standalone",
            Runtime::Remote => "remote",
            Runtime::Custom(name) => name.as_str(),
        }
    }

    /// One of the three runtimes sessiond itself drives.
    pub const fn is_built_in(&self) -> bool {
        !matches!(self, Runtime::Custom(_))
    }

    /// The runtime named `value`: a built-in one for its exact name,
    /// otherwise a custom one if `value` is a valid [`RuntimeName`]. Whether
    /// a driver is registered for it is the caller's question.
    ///
    /// # Errors
    ///
    /// [`UnknownValue`], listing the accepted forms, for any other text.
    pub fn parse(value: &str) -> Result<Self, UnknownValue> {
        Ok(match value {
            "local_docker" => Runtime::LocalDocker,
            "local_standalone" => Runtime::LocalStandalone,
            "remote" => Runtime::Remote,
            _ => Runtime::Custom(RuntimeName::new(value)?),
        })
    }
}

impl fmt::Display for Runtime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Runtime {
    type Err = UnknownValue;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

/// The name of a custom runtime: 1 to [`RuntimeName::MAX_LEN`] characters of
/// `a-z`, `0-9`, `_` and `-`, and none of the built-in names. Held inline,
/// so that [`Runtime`] stays `Copy`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RuntimeName {
    // Zero-padded ASCII; `bytes` before `len` so that the order is the
    // names' order.
    bytes: [u8; RuntimeName::MAX_LEN],
    len: u8,
}

impl RuntimeName {
    /// The longest name, in bytes.
    pub const MAX_LEN: usize = 40;

    /// `value` as a custom runtime's name.
    ///
    /// # Errors
    ///
    /// [`UnknownValue`] when `value` is empty, longer than
    /// [`Self::MAX_LEN`], has another character than `a-z 0-9 _ -`, or is a
    /// built-in runtime's name.
    pub fn new(value: &str) -> Result<Self, UnknownValue> {
        let valid = !value.is_empty()
            && value.len() <= Self::MAX_LEN
            && value
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
            && !Runtime::ALL.iter().any(|r| r.as_str() == value);
        if !valid {
            return Err(UnknownValue {
                kind: "runtime",
                value: value.to_owned(),
                expected: RUNTIME_FORMS,
            });
        }
        let mut bytes = [0; Self::MAX_LEN];
        bytes[..value.len()].copy_from_slice(value.as_bytes());
        Ok(Self {
            bytes,
            len: value.len() as u8,
        })
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        // Only ASCII is ever stored (checked by `new`).
        std::str::from_utf8(&self.bytes[..usize::from(self.len)]).unwrap_or_default()
    }
}

impl fmt::Debug for RuntimeName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for RuntimeName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

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
    /// A command the agent runs in an ACP terminal through agentctl: the
    /// command, the tail of its output, its exit; complete once it exited
    /// or was released.
    Terminal => "terminal",
    /// A `session/update` agentctl could not parse, kept raw (bounded) with
    /// the parse error instead of being lost.
    Unparsed => "unparsed",
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
    /// Recovery picks up executors in these statuses (the first step of startup recovery).
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
        let err = Runtime::parse("K8s").unwrap_err();
        assert!(err.to_string().contains("local_docker"), "{err}");
        assert!(err.to_string().contains("registered runtime"), "{err}");
    }

    #[test]
    fn custom_runtime_names_are_checked() {
        for ok in ["vm", "k8s-pod", "a", "wrapper_2", &"x".repeat(40)] {
            let r = Runtime::parse(ok).unwrap();
            assert_eq!(r, Runtime::Custom(RuntimeName::new(ok).unwrap()));
            assert_eq!(r.as_str(), ok);
            assert_eq!(r.to_string(), ok);
            assert!(!r.is_built_in());
        }
        for bad in ["", "VM", "v m", "vm!", "é", &"x".repeat(41)] {
            assert!(Runtime::parse(bad).is_err(), "{bad:?}");
            assert!(RuntimeName::new(bad).is_err(), "{bad:?}");
        }
        // Built-in names are never custom.
        for r in Runtime::ALL {
            assert!(r.is_built_in());
            assert!(RuntimeName::new(r.as_str()).is_err());
        }
        let (a, b) = (
            RuntimeName::new("ab").unwrap(),
            RuntimeName::new("abc").unwrap(),
        );
        assert!(a < b && format!("{a:?}") == "\"ab\"");
    }
}
