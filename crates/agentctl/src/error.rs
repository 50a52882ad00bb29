//! agentctl's error type, and its one mapping to gRPC status codes.

use tonic::{Code, Status};

/// Everything an agentctl operation can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Malformed input: a NUL byte, an empty required field, a bad value.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The path resolves outside the workspace root.
    #[error("permission denied: {0}")]
    PermissionDenied(String),
    /// The file, directory, session or command does not exist.
    #[error("not found: {0}")]
    NotFound(String),
    /// The call does not fit the current state (no agent, turn in progress,
    /// no `loadSession`, not a git repository, ...).
    #[error("failed precondition: {0}")]
    FailedPrecondition(String),
    /// What the call would create exists already (a branch, a directory).
    #[error("already exists: {0}")]
    AlreadyExists(String),
    /// A size limit was exceeded.
    #[error("out of range: {0}")]
    OutOfRange(String),
    /// The agent did not answer in time.
    #[error("deadline exceeded: {0}")]
    DeadlineExceeded(String),
    /// The agent is gone or its connection broke.
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// The agent answered with an error.
    #[error("agent error: {0}")]
    Agent(String),
    /// Anything else, with context.
    #[error("{context}: {source}")]
    Io {
        /// What agentctl was doing.
        context: String,
        /// The OS error.
        source: std::io::Error,
    },
}

/// `Result` with agentctl's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The message without the code's name in front (the code travels apart).
    pub fn detail(&self) -> String {
        match self {
            Self::InvalidArgument(m)
            | Self::PermissionDenied(m)
            | Self::NotFound(m)
            | Self::FailedPrecondition(m)
            | Self::AlreadyExists(m)
            | Self::OutOfRange(m)
            | Self::DeadlineExceeded(m)
            | Self::Unavailable(m)
            | Self::Agent(m) => m.clone(),
            Self::Io { .. } => self.to_string(),
        }
    }

    /// Wraps an IO error with what was being done, mapping the kinds that
    /// have a precise meaning.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        let context = context.into();
        match source.kind() {
            std::io::ErrorKind::NotFound => Self::NotFound(format!("{context}: {source}")),
            std::io::ErrorKind::PermissionDenied => {
                Self::PermissionDenied(format!("{context}: {source}"))
            }
            std::io::ErrorKind::IsADirectory
            | std::io::ErrorKind::NotADirectory
            | std::io::ErrorKind::InvalidInput
            | std::io::ErrorKind::InvalidFilename
            | std::io::ErrorKind::ArgumentListTooLong => {
                // ENAMETOOLONG / E2BIG: the caller's input is too long.
                Self::InvalidArgument(format!("{context}: {source}"))
            }
            // EXDEV from openat2(RESOLVE_BENEATH): the path left the root.
            _ if source.raw_os_error() == Some(libc::EXDEV) => {
                Self::PermissionDenied(format!("{context}: resolves outside the workspace root"))
            }
            _ if source.raw_os_error() == Some(libc::ELOOP) => {
                Self::PermissionDenied(format!("{context}: refusing to follow a symlink"))
            }
            _ => Self::Io { context, source },
        }
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        let code = match &e {
            Error::InvalidArgument(_) => Code::InvalidArgument,
            Error::PermissionDenied(_) => Code::PermissionDenied,
            Error::NotFound(_) => Code::NotFound,
            Error::FailedPrecondition(_) | Error::Agent(_) => Code::FailedPrecondition,
            Error::OutOfRange(_) => Code::OutOfRange,
            Error::AlreadyExists(_) => Code::AlreadyExists,
            Error::DeadlineExceeded(_) => Code::DeadlineExceeded,
            Error::Unavailable(_) => Code::Unavailable,
            Error::Io { .. } => Code::Internal,
        };
        Status::new(code, e.to_string())
    }
}
