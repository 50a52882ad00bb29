//! The one place where errors become `tonic::Status`.
//!
//! | error                                              | code                |
//! |----------------------------------------------------|---------------------|
//! | malformed id, bad enum, empty/oversized input       | INVALID_ARGUMENT    |
//! | unknown task / session / profile                    | NOT_FOUND           |
//! | session addressed under another task                | NOT_FOUND (proto)   |
//! | not resumable, no token, worktree gone, ended,      | FAILED_PRECONDITION |
//! | wrong state, agent not running, resume failed,      | (message = reason)  |
//! | retry of a turn that did not end interrupted        |                     |
//! | executor not ready for a workspace call             | FAILED_PRECONDITION |
//! | concurrent writer won                               | ABORTED             |
//! | a configured limit (live sessions, watch streams)   | RESOURCE_EXHAUSTED  |
//! | Exec past its timeout (details: output so far)      | DEADLINE_EXCEEDED   |
//! | executor/agent/database unreachable, no driver      | UNAVAILABLE         |
//! | a database connection lost mid-call                 | (`database_unavailable`: `retry-after-ms`) |
//! | session owned by another replica and not forwarded  | UNAVAILABLE         |
//! | (`not_owner`), or its owner not answering           | (`retry-after-ms`)  |
//! | (`ownership_moving`)                                |                     |
//! | a forwarded call: the owner's own status, unchanged |                     |
//! | anything else                                       | INTERNAL (logged)   |
//!
//! Every status also carries `sessiond-error` metadata: a stable, machine-
//! readable reason (`not_found`, `not_resumable`, `executor_not_ready`, ...)
//! so clients need not parse messages.

use sessiond_domain::{ExecutorStatus, IdParseError, SessionId, TaskId};
use tonic::{Code, Status};

/// The metadata key of the machine-readable reason (exposed to browsers).
pub const ERROR_METADATA: &str = "sessiond-error";

/// With `not_owner`: the replica that serves the session, and its address.
pub const OWNER_METADATA: &str = "sessiond-owner";
pub const OWNER_ADDRESS_METADATA: &str = "sessiond-owner-address";

/// Longest message a status carries: messages quote client input (ids,
/// paths), and an unbounded `grpc-message` header would turn a client's
/// mistake into a RESOURCE_EXHAUSTED on its side.
pub const MAX_MESSAGE_BYTES: usize = 1024;

/// When a call that failed for want of the database may be retried: about
/// when the store next tries to connect (`sessiond-store`'s fail-fast
/// checkout while the database is down).
pub const DATABASE_RETRY_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

/// The store error behind `e` when it means the database is unreachable or
/// the connection was lost mid-call (retryable), not a verdict on the call.
fn database_unavailable(e: &ApiError) -> Option<&sessiond_store::Error> {
    let store = match e {
        ApiError::Store(x) => x,
        ApiError::Recovery(sessiond_engine::Error::Store(x)) => &**x,
        _ => return None,
    };
    store.is_unavailable().then_some(store)
}

/// Cuts `message` to [`MAX_MESSAGE_BYTES`] on a character boundary, saying so.
pub fn bounded(mut message: String) -> String {
    if message.len() > MAX_MESSAGE_BYTES {
        let mut end = MAX_MESSAGE_BYTES;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
        message.push_str("… (truncated)");
    }
    message
}

/// Everything a handler can fail with.
#[derive(Debug)]
pub enum ApiError {
    InvalidArgument(String),
    NotFound(String),
    /// A create names a directory on this host that is missing or not a
    /// directory (`worktree_missing`).
    WorktreeMissing(String),
    /// A configured limit is reached; the message names its key.
    LimitReached(String),
    /// A workspace call on a session whose executor is not ready.
    ExecutorNotReady {
        session_id: SessionId,
        status: Option<ExecutorStatus>,
        detail: Option<String>,
    },
    Recovery(sessiond_engine::Error),
    Store(sessiond_store::Error),
    Executor(sessiond_executor::Error),
    /// agentctl answered a proxied workspace call with this status.
    Agentctl(Status),
    /// Another replica owns the session and this one does not forward the
    /// call (hop guard, or forwarding off); `note` says why.
    NotOwner {
        error: sessiond_engine::Error,
        retry_after: std::time::Duration,
        note: Option<String>,
    },
    /// The owner did not answer a forwarded call: ownership is moving.
    OwnershipMoving {
        session: SessionId,
        owner: String,
        address: String,
        retry_after: std::time::Duration,
        cause: String,
    },
    /// The owner answered a forwarded call with this status: passed on as is.
    Forwarded(Status),
    /// The owner refused the caller's credentials on a forwarded call.
    OwnerRefused {
        owner: String,
        status: Status,
    },
    /// Exec ran past its timeout; its process group was killed. `output`
    /// is the encoded `ExecResponse` with the output so far (status details).
    CommandTimedOut {
        command: String,
        timeout_ms: u64,
        output: Vec<u8>,
    },
}

pub type ApiResult<T> = Result<T, ApiError>;

impl ApiError {
    pub fn invalid(message: impl Into<String>) -> Self {
        ApiError::InvalidArgument(message.into())
    }

    /// A session that exists but belongs to another task is reported as not
    /// found, so ids of other tasks are not revealed.
    pub fn session_not_in_task(session: SessionId, task: TaskId) -> Self {
        ApiError::NotFound(format!("session {session} not found in task {task}"))
    }
}

impl From<IdParseError> for ApiError {
    fn from(e: IdParseError) -> Self {
        ApiError::InvalidArgument(e.to_string())
    }
}

impl From<sessiond_engine::Error> for ApiError {
    fn from(e: sessiond_engine::Error) -> Self {
        ApiError::Recovery(e)
    }
}

impl From<sessiond_store::Error> for ApiError {
    fn from(e: sessiond_store::Error) -> Self {
        ApiError::Store(e)
    }
}

impl From<sessiond_executor::Error> for ApiError {
    fn from(e: sessiond_executor::Error) -> Self {
        ApiError::Executor(e)
    }
}

fn store_code(e: &sessiond_store::Error) -> (Code, &'static str) {
    use sessiond_store::Error as E;
    match e {
        E::NotFound { .. } => (Code::NotFound, "not_found"),
        E::Conflict { .. } => (Code::Aborted, "conflict"),
        E::AlreadyExists { .. } => (Code::AlreadyExists, "already_exists"),
        E::Invalid(_) => (Code::InvalidArgument, "invalid_argument"),
        E::Pool(_) | E::ConnectionLost(_) => (Code::Unavailable, "database_unavailable"),
        E::LeaseLost { .. } => (Code::Unavailable, "lease_lost"),
        _ => (Code::Internal, "internal"),
    }
}

fn executor_code(e: &sessiond_executor::Error) -> (Code, &'static str) {
    if let sessiond_executor::Error::Worktree { code, .. } = e {
        // agentctl's verdict on the repository, base, branch or directory.
        return match code {
            c @ (Code::InvalidArgument
            | Code::AlreadyExists
            | Code::FailedPrecondition
            | Code::NotFound
            | Code::DeadlineExceeded
            | Code::PermissionDenied) => (*c, "worktree"),
            _ => (Code::Internal, "worktree"),
        };
    }
    if matches!(e, sessiond_executor::Error::StaleEpoch { .. }) {
        // Another replica adopted the session: retry, it serves it now.
        return (Code::Unavailable, "stale_epoch");
    }
    if e.is_unavailable() {
        (Code::Unavailable, "executor_unavailable")
    } else {
        (Code::FailedPrecondition, "executor_failed")
    }
}

fn recovery_code(e: &sessiond_engine::Error) -> (Code, &'static str) {
    use sessiond_engine::{Error as E, ErrorKind as K};
    let reason = match e {
        E::NotFound { .. } => "not_found",
        E::WrongTask { .. } => "not_found",
        E::NotResumable { .. } => "not_resumable",
        E::MissingResumeToken { .. } => "missing_resume_token",
        E::WorktreeMissing { .. } => "worktree_missing",
        E::WorktreeHasWork { .. } => "worktree_has_work",
        E::RuntimeNotEnabled { .. } => "runtime_not_enabled",
        E::SessionEnded { .. } => "session_ended",
        E::InvalidState { .. } => "invalid_state",
        E::AgentNotRunning { .. } => "agent_not_running",
        E::TurnNotInterrupted { .. } => "turn_not_interrupted",
        E::AlreadyDelivered { .. } => "already_delivered",
        E::PermissionNotFound { .. } => "permission_not_found",
        E::PermissionResolved { .. } => "permission_resolved",
        E::ResumeFailed { .. } => "resume_failed",
        E::Conflict { .. } => "conflict",
        E::Unavailable(_) => "unavailable",
        E::NotOwner { .. } => "not_owner",
        E::InvalidArgument(_) => "invalid_argument",
        E::LimitReached { .. } => "limit_reached",
        E::Executor(x) => return executor_code(x),
        E::Agent { .. } => "agent_failed",
        E::Store(x) => return store_code(x),
        _ => "internal",
    };
    // The proto documents a session of another task as NOT_FOUND.
    if matches!(e, E::WrongTask { .. }) {
        return (Code::NotFound, reason);
    }
    let code = match e.kind() {
        K::NotFound => Code::NotFound,
        K::InvalidArgument => Code::InvalidArgument,
        K::FailedPrecondition => Code::FailedPrecondition,
        K::Aborted => Code::Aborted,
        K::Unavailable => Code::Unavailable,
        K::ResourceExhausted => Code::ResourceExhausted,
        K::Internal => Code::Internal,
    };
    (code, reason)
}

/// Codes agentctl may answer a workspace call with that mean the same to
/// our caller; anything else is our problem, not theirs.
fn agentctl_code(status: &Status) -> (Code, &'static str) {
    if status.code() == Code::FailedPrecondition
        && status.message().starts_with(sessiond_executor::STALE_EPOCH)
    {
        // agentctl fenced this replica off: another one owns the session.
        return (Code::Unavailable, "stale_epoch");
    }
    match status.code() {
        c @ (Code::InvalidArgument
        | Code::NotFound
        | Code::OutOfRange
        | Code::PermissionDenied
        | Code::AlreadyExists
        | Code::FailedPrecondition
        | Code::DeadlineExceeded
        | Code::ResourceExhausted) => (c, "workspace"),
        Code::Unavailable | Code::Cancelled => (Code::Unavailable, "executor_unavailable"),
        _ => (Code::Internal, "agentctl_failed"),
    }
}

impl From<ApiError> for Status {
    fn from(e: ApiError) -> Status {
        let (code, reason, message) = match &e {
            ApiError::Forwarded(status) => return status.clone(),
            ApiError::NotOwner { error, note, .. } => {
                let mut m = error.to_string();
                if let Some(n) = note {
                    m.push(' ');
                    m.push_str(n);
                }
                (Code::Unavailable, "not_owner", m)
            }
            ApiError::OwnershipMoving {
                session,
                owner,
                address,
                retry_after,
                cause,
            } => (
                Code::Unavailable,
                "ownership_moving",
                format!(
                    "session {session} is owned by replica {owner} ({address}), which did not \
                     answer: {cause}; ownership is moving (when its lease runs out another \
                     replica takes the session over): retry in {} ms",
                    retry_after.as_millis()
                ),
            ),
            ApiError::OwnerRefused { owner, status } => (
                status.code(),
                "owner_refused_credentials",
                format!(
                    "replica {owner}, which owns this session, refused the call's credentials \
                     ({}); every replica must accept the same auth.tokens",
                    status.message()
                ),
            ),
            ApiError::InvalidArgument(m) => (Code::InvalidArgument, "invalid_argument", m.clone()),
            ApiError::NotFound(m) => (Code::NotFound, "not_found", m.clone()),
            ApiError::WorktreeMissing(m) => {
                (Code::FailedPrecondition, "worktree_missing", m.clone())
            }
            ApiError::LimitReached(m) => (Code::ResourceExhausted, "limit_reached", m.clone()),
            ApiError::ExecutorNotReady {
                session_id,
                status,
                detail,
            } => {
                let status = status.map_or("absent", |s| s.as_str());
                let mut m = format!(
                    "the executor of session {session_id} is {status}; workspace calls need it ready"
                );
                if let Some(d) = detail.as_deref().filter(|d| !d.is_empty()) {
                    m.push_str(&format!(" ({d})"));
                }
                (Code::FailedPrecondition, "executor_not_ready", m)
            }
            ApiError::Recovery(x) => {
                let (c, r) = recovery_code(x);
                let m = match x {
                    sessiond_engine::Error::WrongTask {
                        session_id,
                        requested,
                        ..
                    } => format!("session {session_id} not found in task {requested}"),
                    other => other.to_string(),
                };
                (c, r, m)
            }
            ApiError::Store(x) => {
                let (c, r) = store_code(x);
                (c, r, x.to_string())
            }
            ApiError::Executor(x) => {
                let (c, r) = executor_code(x);
                (c, r, x.to_string())
            }
            ApiError::Agentctl(s) => {
                let (c, r) = agentctl_code(s);
                (c, r, s.message().to_owned())
            }
            ApiError::CommandTimedOut {
                command,
                timeout_ms,
                ..
            } => (
                Code::DeadlineExceeded,
                "command_timed_out",
                format!(
                    "{command:?} ran past its timeout of {timeout_ms} ms and was killed with \
                     everything it started; the output so far is in the status details \
                     (an ExecResponse)"
                ),
            ),
        };
        if code == Code::Internal {
            tracing::error!(error = %message, "internal error");
        }
        let unavailable_db = database_unavailable(&e);
        let message = match unavailable_db {
            Some(x) => format!(
                "the database is unavailable ({x}); nothing was changed unless the call had \
                 completed: retry in {} ms",
                DATABASE_RETRY_AFTER.as_millis()
            ),
            None => message,
        };
        let mut status = match &e {
            ApiError::CommandTimedOut { output, .. } => Status::with_details(
                code,
                bounded(message),
                tonic::codegen::Bytes::from(output.clone()),
            ),
            _ => Status::new(code, bounded(message)),
        };
        if let Ok(v) = reason.parse() {
            status.metadata_mut().insert(ERROR_METADATA, v);
        }
        // Where to send the call instead (a client or balancer may retry
        // there), and when a retry may find the session served.
        let moving = match &e {
            ApiError::Recovery(sessiond_engine::Error::NotOwner { owner, address, .. }) => {
                Some((owner, address, crate::forward::RETRY_SOON))
            }
            ApiError::NotOwner {
                error: sessiond_engine::Error::NotOwner { owner, address, .. },
                retry_after,
                ..
            }
            | ApiError::OwnershipMoving {
                owner,
                address,
                retry_after,
                ..
            } => Some((owner, address, *retry_after)),
            _ => None,
        };
        if unavailable_db.is_some()
            && let Ok(v) = DATABASE_RETRY_AFTER.as_millis().to_string().parse()
        {
            status
                .metadata_mut()
                .insert(crate::forward::RETRY_AFTER_MS, v);
        }
        if let Some((owner, address, retry_after)) = moving {
            for (key, value) in [(OWNER_METADATA, owner), (OWNER_ADDRESS_METADATA, address)] {
                if let Ok(v) = value.parse() {
                    status.metadata_mut().insert(key, v);
                }
            }
            let ms = retry_after.as_millis().max(1).to_string();
            if let Ok(v) = ms.parse() {
                status
                    .metadata_mut()
                    .insert(crate::forward::RETRY_AFTER_MS, v);
            }
        }
        status
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(e: ApiError) -> (Code, String) {
        let s = Status::from(e);
        let reason = s
            .metadata()
            .get("sessiond-error")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        (s.code(), reason)
    }

    #[test]
    fn long_messages_are_cut() {
        let s = Status::from(ApiError::invalid(format!("bad id {}", "é".repeat(100_000))));
        assert!(s.message().len() <= MAX_MESSAGE_BYTES + 20);
        assert!(s.message().ends_with("(truncated)"));
    }

    /// A lost connection or an unreachable database is UNAVAILABLE
    /// `database_unavailable` with when to retry, however it reached the
    /// API (the store directly, or through the manager).
    #[test]
    fn a_lost_database_is_unavailable_with_retry_advice() {
        let lost = || {
            sessiond_store::Error::ConnectionLost(Box::new(std::io::Error::other(
                "terminating connection due to administrator command",
            )))
        };
        let refused =
            sessiond_store::Error::Pool(Box::new(std::io::Error::other("connection refused")));
        for e in [
            ApiError::Store(lost()),
            ApiError::Store(refused),
            ApiError::Recovery(sessiond_engine::Error::Store(std::sync::Arc::new(lost()))),
        ] {
            let s = Status::from(e);
            assert_eq!(s.code(), Code::Unavailable, "{s:?}");
            assert_eq!(
                s.metadata().get(ERROR_METADATA).unwrap(),
                "database_unavailable"
            );
            assert_eq!(
                s.metadata().get(crate::forward::RETRY_AFTER_MS).unwrap(),
                "1000"
            );
            assert!(s.message().contains("retry in 1000 ms"), "{}", s.message());
        }
    }

    #[test]
    fn mapping_table() {
        let sid = SessionId::new();
        let tid = TaskId::new();
        use sessiond_engine::Error as R;
        assert_eq!(
            code(SessionId::parse("x").unwrap_err().into()).0,
            Code::InvalidArgument
        );
        assert_eq!(
            code(
                R::NotFound {
                    entity: "session",
                    id: sid.to_string()
                }
                .into()
            ),
            (Code::NotFound, "not_found".into())
        );
        let wrong = Status::from(ApiError::from(R::WrongTask {
            session_id: sid,
            requested: tid,
            actual: TaskId::new(),
        }));
        assert_eq!(wrong.code(), Code::NotFound);
        assert!(wrong.message().contains(&tid.to_string()));
        assert_eq!(
            code(
                R::NotResumable {
                    session_id: sid,
                    reason: "not_resumable".into()
                }
                .into()
            ),
            (Code::FailedPrecondition, "not_resumable".into())
        );
        assert_eq!(
            code(R::Unavailable("down".into()).into()).0,
            Code::Unavailable
        );
        let not_ready = Status::from(ApiError::ExecutorNotReady {
            session_id: sid,
            status: Some(ExecutorStatus::Error),
            detail: Some("host down".into()),
        });
        assert_eq!(not_ready.code(), Code::FailedPrecondition);
        assert!(
            not_ready.message().contains("is error"),
            "{}",
            not_ready.message()
        );
        assert_eq!(
            code(ApiError::Agentctl(Status::unauthenticated("secret"))).0,
            Code::Internal
        );
        assert_eq!(
            code(ApiError::Agentctl(Status::not_found("no such file"))).0,
            Code::NotFound
        );
    }
}
