//! The one error type of this crate. The server maps each variant to a gRPC
//! code in one place (see [`Error::kind`]).

use std::sync::Arc;

use sessiond_domain::{MessageId, SessionId, SessionState, TaskId};

/// `Result` with this crate's [`Error`] as the default error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The class of an [`Error`], for the server's mapping to status codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// NOT_FOUND.
    NotFound,
    /// INVALID_ARGUMENT.
    InvalidArgument,
    /// FAILED_PRECONDITION: the request does not fit the session's state.
    FailedPrecondition,
    /// ABORTED: a concurrent writer won; retry.
    Aborted,
    /// UNAVAILABLE: an executor, agent or the database cannot be reached now.
    Unavailable,
    /// RESOURCE_EXHAUSTED: a configured limit is reached.
    ResourceExhausted,
    /// INTERNAL.
    Internal,
}

/// Everything the session lifecycle, recovery and resume can fail with.
///
/// Cheap to clone (sources are shared), so one resume attempt can hand the
/// same outcome to every caller that joined it.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A task, session, agent profile or executor does not exist.
    #[error("{entity} {id} not found")]
    NotFound {
        /// What was looked up (`task`, `session`, `agent profile`, ...).
        entity: &'static str,
        /// The id that was asked for.
        id: String,
    },

    /// The session exists but belongs to another task.
    #[error("session {session_id} belongs to task {actual}, not to task {requested}")]
    WrongTask {
        /// The session.
        session_id: SessionId,
        /// The task the caller named.
        requested: TaskId,
        /// The task the session belongs to.
        actual: TaskId,
    },

    /// The agent cannot resume this session (profile or agent says so).
    #[error("session {session_id} cannot be resumed: {reason}")]
    NotResumable {
        /// The session.
        session_id: SessionId,
        /// Why, and what to do instead.
        reason: String,
    },

    /// Resume is supported but the agent never gave a token.
    #[error(
        "session {session_id} has no resume token (the agent never opened a conversation); create a new session"
    )]
    MissingResumeToken {
        /// The session.
        session_id: SessionId,
    },

    /// The session's worktree directory is gone.
    #[error("worktree {path} of session {session_id} no longer exists; create a new session")]
    WorktreeMissing {
        /// The session.
        session_id: SessionId,
        /// The missing directory.
        path: String,
    },

    /// Deleting the session would remove a worktree holding work (files
    /// with uncommitted changes, commits no other ref holds).
    #[error("worktree {path} of session {session_id} was kept: {what}")]
    WorktreeHasWork {
        /// The session.
        session_id: SessionId,
        /// The worktree's directory.
        path: String,
        /// What would be lost, and how to go on.
        what: String,
    },

    /// A create asks for a built-in runtime this server does not run
    /// (Docker not enabled): retrying cannot help, the configuration must
    /// change.
    #[error("runtime {runtime} is not enabled on this server{how}; enabled runtimes: {enabled}")]
    RuntimeNotEnabled {
        /// The runtime asked for, by name.
        runtime: String,
        /// How to enable it, when the engine knows (`local_docker`).
        how: &'static str,
        /// The runtimes this server runs, comma-separated.
        enabled: String,
    },

    /// The session is COMPLETED or CANCELLED.
    #[error("session {session_id} has ended ({state}); create a new session")]
    SessionEnded {
        /// The session.
        session_id: SessionId,
        /// COMPLETED or CANCELLED.
        state: SessionState,
    },

    /// The request does not fit the session's current state.
    #[error("session {session_id} is {state}: cannot {action}; {hint}")]
    InvalidState {
        /// The session.
        session_id: SessionId,
        /// Its current state.
        state: SessionState,
        /// What was asked (e.g. `send a message`).
        action: &'static str,
        /// What to do instead.
        hint: &'static str,
    },

    /// RetryTurn on a session whose last turn did not end interrupted.
    #[error(
        "session {session_id}: no interrupted turn to retry: {detail}; send a new message instead"
    )]
    TurnNotInterrupted {
        /// The session.
        session_id: SessionId,
        /// How its last turn ended instead.
        detail: String,
    },

    /// RespondToPermission names a request the session does not have.
    #[error(
        "session {session_id} has no permission request {request_id}; pending ones are listed in the session's status"
    )]
    PermissionNotFound {
        /// The session.
        session_id: SessionId,
        /// The request id given.
        request_id: String,
    },

    /// RespondToPermission on a request that no longer waits.
    #[error("permission request {request_id} no longer waits for an answer: {detail}")]
    PermissionResolved {
        /// The request.
        request_id: String,
        /// How it was resolved (answered, timed out, cancelled).
        detail: String,
    },

    /// No agent runs for the session (it exited, or was never resumed).
    /// `hint` agrees with what `ResumeSession` would answer.
    #[error("the agent of session {session_id} is not running; {hint}")]
    AgentNotRunning {
        /// The session.
        session_id: SessionId,
        /// What to do: resume, or create a new session.
        hint: String,
    },

    /// An executor driver or the agentctl transport failed.
    #[error("{0}")]
    Executor(Arc<sessiond_executor::Error>),

    /// agentctl answered an agent call (LaunchAgent, NewSession, ResumeSession,
    /// Prompt, ...) with an error.
    #[error("agent call {call} failed ({failure:?}): {message}")]
    Agent {
        /// The agentctl RPC.
        call: &'static str,
        /// What the failure means (from the agentctl client); decides the
        /// [`ErrorKind`].
        failure: sessiond_executor::Failure,
        /// agentctl's message.
        message: String,
    },

    /// An attempt to resume the session failed; the session is ERROR with
    /// this reason.
    #[error("resuming session {session_id} failed: {reason}")]
    ResumeFailed {
        /// The session.
        session_id: SessionId,
        /// Why; also the session's `error_message`.
        reason: String,
    },

    /// Someone else changed the record since it was read.
    #[error("{entity} {id} was changed concurrently; retry")]
    Conflict {
        /// What was written (`session`, `executor`, ...).
        entity: &'static str,
        /// Its id.
        id: String,
    },

    /// A needed service is not available (no driver for a runtime, host down).
    #[error("unavailable: {0}")]
    Unavailable(String),

    /// Another replica owns the session's executor: only it may act on it.
    /// Retryable: send the call to `address`, or retry here (ownership may
    /// be moving after that replica stopped).
    #[error(
        "session {session_id} is served by replica {owner}{}; send the call there, or retry: \
         if that replica is gone, another one takes the session over within {ttl_secs}s",
        at_address(.address)
    )]
    NotOwner {
        /// The session.
        session_id: SessionId,
        /// The owning replica's id.
        owner: String,
        /// Where that replica serves clients; empty when unknown.
        address: String,
        /// The lease TTL: how long a takeover takes at most if it is gone.
        ttl_secs: u64,
    },

    /// The caller's input cannot work.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// The queued message was delivered already: its turn started.
    #[error(
        "message {message_id} of session {session_id} was delivered already: its turn started \
         (cancel the turn with CancelTurn instead)"
    )]
    AlreadyDelivered {
        /// The session.
        session_id: SessionId,
        /// The queued message (now the turn's user message).
        message_id: MessageId,
    },

    /// A configured limit is reached (`limit` is its configuration key).
    #[error("{what}: the limit of {max} ({limit}) is reached; {hint}")]
    LimitReached {
        /// The configuration key of the limit.
        limit: &'static str,
        /// Its value.
        max: usize,
        /// What would exceed it (e.g. `live sessions`).
        what: &'static str,
        /// What to do.
        hint: &'static str,
    },

    /// The database failed.
    #[error("store: {0}")]
    Store(Arc<sessiond_store::Error>),

    /// A bug or a broken invariant.
    #[error("internal error: {0}")]
    Internal(String),
}

fn at_address(address: &str) -> String {
    if address.is_empty() {
        String::new()
    } else {
        format!(" at {address}")
    }
}

impl Error {
    /// The class of this error, which the server maps to a gRPC code:
    /// precondition failures of the session's state are
    /// [`ErrorKind::FailedPrecondition`], anything waiting may fix (a host
    /// down, another replica owning the session, a pool exhausted) is
    /// [`ErrorKind::Unavailable`].
    ///
    /// ```
    /// use sessiond_domain::{SessionId, SessionState};
    /// use sessiond_engine::{Error, ErrorKind};
    ///
    /// let ended = Error::SessionEnded { session_id: SessionId::new(), state: SessionState::Completed };
    /// assert_eq!(ended.kind(), ErrorKind::FailedPrecondition);
    /// assert!(ended.to_string().ends_with("create a new session"));
    ///
    /// let elsewhere = Error::NotOwner {
    ///     session_id: SessionId::new(),
    ///     owner: "replica-b".into(),
    ///     address: "10.0.0.2:50051".into(),
    ///     ttl_secs: 10,
    /// };
    /// assert_eq!(elsewhere.kind(), ErrorKind::Unavailable, "retryable");
    /// ```
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::NotFound { .. } | Error::PermissionNotFound { .. } => ErrorKind::NotFound,
            Error::InvalidArgument(_) => ErrorKind::InvalidArgument,
            Error::WrongTask { .. }
            | Error::NotResumable { .. }
            | Error::MissingResumeToken { .. }
            | Error::WorktreeMissing { .. }
            | Error::WorktreeHasWork { .. }
            | Error::RuntimeNotEnabled { .. }
            | Error::SessionEnded { .. }
            | Error::InvalidState { .. }
            | Error::AgentNotRunning { .. }
            | Error::TurnNotInterrupted { .. }
            | Error::AlreadyDelivered { .. }
            | Error::PermissionResolved { .. }
            | Error::ResumeFailed { .. } => ErrorKind::FailedPrecondition,
            Error::Conflict { .. } => ErrorKind::Aborted,
            Error::Unavailable(_) | Error::NotOwner { .. } => ErrorKind::Unavailable,
            Error::LimitReached { .. } => ErrorKind::ResourceExhausted,
            Error::Executor(e) if e.is_unavailable() => ErrorKind::Unavailable,
            Error::Executor(e) => match &**e {
                sessiond_executor::Error::Worktree {
                    code: tonic::Code::InvalidArgument,
                    ..
                } => ErrorKind::InvalidArgument,
                sessiond_executor::Error::Worktree {
                    code: tonic::Code::Internal,
                    ..
                } => ErrorKind::Internal,
                // Another replica owns the executor now: retry there.
                sessiond_executor::Error::StaleEpoch { .. } => ErrorKind::Unavailable,
                _ => ErrorKind::FailedPrecondition,
            },
            Error::Agent { failure, .. } => match failure {
                sessiond_executor::Failure::NoAnswer => ErrorKind::Unavailable,
                sessiond_executor::Failure::InvalidArgument => ErrorKind::InvalidArgument,
                _ => ErrorKind::FailedPrecondition,
            },
            Error::Store(e) => match &**e {
                e if e.is_unavailable() => ErrorKind::Unavailable,
                sessiond_store::Error::Invalid(_) => ErrorKind::InvalidArgument,
                _ => ErrorKind::Internal,
            },
            Error::Internal(_) => ErrorKind::Internal,
        }
    }

    /// The call did not reach its peer, or its answer did not come back (a
    /// transport failure), as opposed to an answer that is an error.
    /// The store could not be reached (the database is down, or the
    /// connection was lost): nothing was written, and a retry may succeed.
    pub(crate) fn is_store_unavailable(&self) -> bool {
        matches!(self, Error::Store(e) if e.is_unavailable())
    }

    pub(crate) fn is_transport(&self) -> bool {
        match self {
            Error::Unavailable(_) => true,
            Error::Executor(e) => e.is_unavailable(),
            Error::Agent { failure, .. } => *failure == sessiond_executor::Failure::NoAnswer,
            _ => false,
        }
    }

    /// An agent call (`call`) that failed: what it means, and agentctl's
    /// own words.
    pub(crate) fn agent(call: &'static str, e: &sessiond_executor::Error) -> Error {
        Error::Agent {
            call,
            failure: e.failure(),
            message: e.answer(),
        }
    }
}

impl From<sessiond_store::Error> for Error {
    fn from(e: sessiond_store::Error) -> Self {
        match e {
            sessiond_store::Error::NotFound { entity, id } => Error::NotFound { entity, id },
            sessiond_store::Error::Conflict { entity, id, .. } => Error::Conflict { entity, id },
            // Normally turned into `NotOwner` by the manager (which knows
            // the TTL); retryable either way.
            e @ sessiond_store::Error::LeaseLost { .. } => {
                Error::Unavailable(format!("{e}; retry: the session's new owner serves it"))
            }
            other => Error::Store(Arc::new(other)),
        }
    }
}

impl From<sessiond_executor::Error> for Error {
    fn from(e: sessiond_executor::Error) -> Self {
        Error::Executor(Arc::new(e))
    }
}
