//! Typed ids: a session id can never be passed where a task id is expected.

use std::{fmt, str::FromStr};

use uuid::Uuid;

/// A string that is not a UUID in canonical form.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "malformed {kind} id {value:?}: expected a UUID such as 0190b8c4-7d2a-7c3e-9f00-1a2b3c4d5e6f"
)]
pub struct IdParseError {
    /// Which id was expected, in words (`"task"`, `"session"`, `"agent profile"`, ...).
    pub kind: &'static str,
    /// The text that was given, unchanged.
    pub value: String,
}

macro_rules! typed_id {
    ($(#[$doc:meta])* $name:ident, $kind:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(Uuid);

        impl $name {
            /// A new time-ordered (v7) id.
            pub fn new() -> Self {
                Self(Uuid::now_v7())
            }

            /// Wraps an existing UUID (e.g. one read back from the store); no check
            /// is made, every UUID is a valid id.
            pub const fn from_uuid(uuid: Uuid) -> Self {
                Self(uuid)
            }

            /// The UUID inside, e.g. to bind it as a SQL parameter.
            pub const fn as_uuid(&self) -> &Uuid {
                &self.0
            }

            /// Parses a UUID in any form [`Uuid::try_parse`] accepts (canonical
            /// hyphenated, simple, braced, URN).
            ///
            /// # Errors
            ///
            /// [`IdParseError`], naming this kind of id and the text, when
            /// `value` is not a UUID.
            pub fn parse(value: &str) -> Result<Self, IdParseError> {
                Uuid::try_parse(value).map(Self).map_err(|_| IdParseError {
                    kind: $kind,
                    value: value.to_owned(),
                })
            }
        }

        impl Default for $name {
            fn default() -> Self {
                Self::new()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.hyphenated().fmt(f)
            }
        }

        impl FromStr for $name {
            type Err = IdParseError;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Self::parse(s)
            }
        }
    };
}

typed_id!(/// Identifies a task.
    ///
    /// Every id type is a UUID (v7, time-ordered, when made by `new`) with
    /// its own type, so ids of different records cannot be mixed up. The
    /// text form is the hyphenated UUID, and parsing names the expected kind:
    ///
    /// ```
    /// use sessiond_domain::{SessionId, TaskId};
    ///
    /// let id = TaskId::new();
    /// assert_eq!(id.to_string().parse::<TaskId>(), Ok(id));
    ///
    /// let err = SessionId::parse("not-a-uuid").unwrap_err();
    /// assert_eq!(err.kind, "session");
    /// assert!(err.to_string().starts_with("malformed session id"));
    /// ```
    TaskId, "task");
typed_id!(/// Identifies a session of a task.
    SessionId, "session");
typed_id!(/// Identifies an executor instance (an `executors_running` row).
    ExecutorId, "executor");
typed_id!(/// Identifies an agent profile.
    AgentProfileId, "agent profile");
typed_id!(/// Identifies a message of a session.
    MessageId, "message");

impl MessageId {
    /// The id of the user message a client's idempotency key names in
    /// `session` (SendMessage's `request_id`): the same key gives the same
    /// id, so a retried send finds its first attempt's message, and its
    /// turn (the turn's id is the message's), instead of making another.
    /// A name-based UUID (v5) in the session's namespace: the same key in
    /// two sessions names two messages.
    pub fn for_request(session: SessionId, request_id: &str) -> Self {
        Self(Uuid::new_v5(session.as_uuid(), request_id.as_bytes()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_text() {
        let id = SessionId::new();
        assert_eq!(SessionId::parse(&id.to_string()), Ok(id));
    }

    #[test]
    fn a_request_id_names_one_message_per_session() {
        let (a, b) = (SessionId::new(), SessionId::new());
        let id = MessageId::for_request(a, "req-1");
        assert_eq!(id, MessageId::for_request(a, "req-1"));
        assert_ne!(id, MessageId::for_request(a, "req-2"));
        assert_ne!(id, MessageId::for_request(b, "req-1"));
        assert_eq!(id.as_uuid().get_version_num(), 5);
    }

    #[test]
    fn malformed_id_names_its_kind() {
        let err = TaskId::parse("nope").unwrap_err();
        assert_eq!(err.kind, "task");
        assert!(err.to_string().contains("malformed task id"));
    }
}
