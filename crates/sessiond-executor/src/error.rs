//! The one error type of this crate.

use std::{path::PathBuf, time::Duration};

use sessiond_domain::ExecutorId;

/// `Result` with this crate's [`Error`] as the default error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything an executor driver or the agentctl client can fail with.
///
/// Messages name the executor, address or path involved so that a user can act
/// on them; [`Error::is_unavailable`] tells the caller whether waiting and
/// retrying may help.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The driver's configuration or the caller's input cannot work.
    #[error("invalid executor configuration: {0}")]
    Config(String),

    /// The TCP/TLS connection to agentctl could not be made.
    #[error("agentctl at {url} is unreachable: {message}")]
    Unreachable {
        /// agentctl's address.
        url: String,
        /// The transport error.
        message: String,
    },

    /// The TLS handshake with agentctl failed on a certificate (untrusted
    /// issuer, wrong name, a client certificate refused): waiting will not
    /// fix it.
    #[error(
        "TLS with agentctl at {url} failed: {message}; check executors.remote.tls_ca_file, \
         tls_domain_name and the client certificate against agentctl's --tls-* files"
    )]
    Tls {
        /// agentctl's address.
        url: String,
        /// The TLS library's error.
        message: String,
    },

    /// agentctl (or something listening on its address) did not answer in time.
    #[error("agentctl at {url} did not answer {call} within {timeout:?}")]
    Timeout {
        /// agentctl's address.
        url: String,
        /// The agentctl RPC (e.g. `Health`).
        call: &'static str,
        /// The deadline that passed.
        timeout: Duration,
    },

    /// agentctl answered with a gRPC error.
    #[error("agentctl at {url} failed {call}: {status}")]
    Rpc {
        /// agentctl's address.
        url: String,
        /// The agentctl RPC.
        call: &'static str,
        /// agentctl's status, code and message as sent.
        status: Box<tonic::Status>,
    },

    /// agentctl refused the call: it has seen a newer lease epoch than the
    /// one this replica sent, so another replica owns the executor now.
    #[error("agentctl at {url} refused {call} for a superseded lease: {message}")]
    StaleEpoch {
        /// agentctl's address.
        url: String,
        /// The agentctl RPC.
        call: &'static str,
        /// agentctl's message (names the epochs).
        message: String,
    },

    /// agentctl refused the executor's secret.
    #[error("agentctl at {url} rejected the executor secret")]
    Unauthenticated {
        /// agentctl's address.
        url: String,
    },

    /// Something answered at the recorded address, but not the agentctl of
    /// this executor.
    #[error("agentctl at {url} serves executor {actual:?}, not {expected}")]
    IdentityMismatch {
        /// The address that answered.
        url: String,
        /// The executor the handle records.
        expected: ExecutorId,
        /// The executor id it reported instead.
        actual: String,
    },

    /// agentctl did not become healthy before the startup deadline.
    #[error("agentctl for executor {executor_id} not ready within {timeout:?}: {last_error}")]
    NotReady {
        /// The executor being launched or recovered.
        executor_id: ExecutorId,
        /// The driver's ready deadline.
        timeout: Duration,
        /// The last failure seen while waiting.
        last_error: String,
    },

    /// The agentctl binary could not be started.
    #[error("cannot start agentctl {path}: {source}")]
    Spawn {
        /// The agentctl binary.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },

    /// The agentctl process ended before it became healthy.
    #[error("agentctl for executor {executor_id} exited during startup ({status}){log_hint}")]
    ExitedEarly {
        /// The executor being launched.
        executor_id: ExecutorId,
        /// Its exit status.
        status: String,
        /// A suffix telling where agentctl's output is (e.g. which
        /// `docker logs` to read), or empty.
        log_hint: String,
    },

    /// The executor's worktree is gone, so nothing can be launched in it.
    #[error("workspace {path} of executor {executor_id} does not exist")]
    WorkspaceMissing {
        /// The executor.
        executor_id: ExecutorId,
        /// The missing directory.
        path: PathBuf,
    },

    /// Neither the recorded container id nor the executor's label finds a container.
    #[error("no container for executor {executor_id} (looked up id {container_id:?} and label)")]
    ContainerMissing {
        /// The executor.
        executor_id: ExecutorId,
        /// The recorded container id, if any.
        container_id: Option<String>,
    },

    /// The container exists in a state the driver cannot bring back.
    #[error("container {container_id} of executor {executor_id} is {state}")]
    ContainerUnusable {
        /// The executor.
        executor_id: ExecutorId,
        /// The container found.
        container_id: String,
        /// Its Docker state (e.g. `dead`, `removing`).
        state: String,
    },

    /// The Docker engine refused or failed a call.
    #[error("docker engine: {0}")]
    Docker(Box<bollard::errors::Error>),

    /// The Docker engine did not answer its ping: nothing can be launched
    /// there until it does.
    #[error(
        "the Docker engine at {host} does not answer ({message}); start it, or point \
         executors.docker.host (or --docker-host) at one that runs, then try again"
    )]
    EngineUnavailable {
        /// The engine's address (`executors.docker.host`).
        host: String,
        /// The client's error.
        message: String,
    },

    /// A local file operation failed.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done (e.g. `reading CA file`).
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },

    /// Signalling or inspecting a local process failed.
    #[error("process {pid}: {message}")]
    Process {
        /// The process.
        pid: u32,
        /// What failed.
        message: String,
    },

    /// A worktree operation on the executor's host refused or failed (not
    /// a git repository, unknown base, branch or directory taken, branch
    /// gone, ...); `code` says which, `message` what to do.
    #[error("{message}")]
    Worktree {
        /// INVALID_ARGUMENT, ALREADY_EXISTS, FAILED_PRECONDITION, ...
        code: tonic::Code,
        /// What went wrong, naming the repository, branch or directory.
        message: String,
    },

    /// Ending the processes a dead agentctl's agent left failed.
    #[error("could not end the processes of executor {executor_id}: {message}")]
    Reap {
        /// The executor.
        executor_id: ExecutorId,
        /// What failed.
        message: String,
    },
}

/// What a failed agentctl call means to its caller ([`Error::failure`]):
/// callers decide on this, never on gRPC codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Failure {
    /// No answer came: agentctl unreachable, too slow, the connection cut,
    /// or it said it is unavailable. It may be gone; it may pass by itself.
    NoAnswer,
    /// agentctl fenced this replica off: another one holds a newer lease.
    StaleEpoch,
    /// agentctl refused the executor's secret.
    Unauthenticated,
    /// agentctl or its agent refused the request's content.
    InvalidArgument,
    /// What the call names is not there (a conversation, a permission
    /// request the agent no longer waits on).
    NotFound,
    /// Refused in the present state of agentctl or its agent; the answer
    /// says what to change.
    FailedPrecondition,
    /// Failed in a way that another attempt need not repeat (aborted, out
    /// of resources, an internal error of agentctl or its agent).
    Transient,
    /// Any other failure (a TLS or configuration mistake, a refusal of
    /// another kind).
    Other,
}

impl Failure {
    /// What an answer with gRPC status `code` means.
    pub(crate) fn of_code(code: tonic::Code) -> Self {
        use tonic::Code;
        match code {
            Code::Unavailable | Code::DeadlineExceeded | Code::Unknown | Code::Cancelled => {
                Failure::NoAnswer
            }
            Code::Unauthenticated => Failure::Unauthenticated,
            Code::InvalidArgument => Failure::InvalidArgument,
            Code::NotFound => Failure::NotFound,
            Code::FailedPrecondition => Failure::FailedPrecondition,
            Code::Aborted | Code::ResourceExhausted | Code::Internal => Failure::Transient,
            _ => Failure::Other,
        }
    }
}

impl Error {
    /// What this failure means to the caller of an agentctl call.
    pub fn failure(&self) -> Failure {
        match self {
            Error::Unreachable { .. } | Error::Timeout { .. } | Error::NotReady { .. } => {
                Failure::NoAnswer
            }
            Error::StaleEpoch { .. } => Failure::StaleEpoch,
            Error::Unauthenticated { .. } => Failure::Unauthenticated,
            Error::Rpc { status, .. } => Failure::of_code(status.code()),
            _ => Failure::Other,
        }
    }

    /// What agentctl (or its agent) said, without this client's framing:
    /// the status message of an answer, the whole error otherwise.
    pub fn answer(&self) -> String {
        match self {
            Error::Rpc { status, .. } => status.message().to_owned(),
            Error::StaleEpoch { message, .. } => message.clone(),
            other => other.to_string(),
        }
    }

    /// True when agentctl does not know the call (an older agentctl).
    pub fn is_unimplemented(&self) -> bool {
        matches!(self, Error::Rpc { status, .. } if status.code() == tonic::Code::Unimplemented)
    }

    /// True when the failure may go away by itself (host down, agentctl
    /// starting or hung, engine busy): a caller may retry later. False for
    /// failures that need someone to act (bad config, wrong identity, missing
    /// workspace or container).
    pub fn is_unavailable(&self) -> bool {
        match self {
            Error::Unreachable { .. } | Error::Timeout { .. } | Error::NotReady { .. } => true,
            Error::Rpc { status, .. } => matches!(
                status.code(),
                tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Unknown
            ),
            Error::Docker(_) | Error::EngineUnavailable { .. } => true,
            _ => false,
        }
    }
}

impl From<bollard::errors::Error> for Error {
    fn from(err: bollard::errors::Error) -> Self {
        Error::Docker(Box::new(err))
    }
}
