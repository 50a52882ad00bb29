//! The core of sessiond: ids, entities, states, and the pure functions that
//! decide transitions, session status and startup recovery.
//!
//! Architecture invariant: no IO, no async runtime, no serialization derives.
//! The store maps these types to rows and the server to protobuf messages.

#![deny(missing_docs)]

pub mod entities;
pub mod events;
pub mod ids;
pub mod queue;
pub mod recovery;
pub mod states;
pub mod status;
pub mod transitions;
pub mod turn;
pub mod usage;
pub mod worktree;

pub use entities::{
    AgentCommand, AgentMode, AgentModes, AgentProfile, ConfigOption, ConfigValue, ContainerAgent,
    DEFAULT_PERMISSION_TIMEOUT, ExecutorRecord, MAX_SESSION_TITLE_CHARS, McpServer, McpTransport,
    Message, SecretValue, Secrets, Session, Task, TitleSource, Worktree, http_url_problem,
    is_layout_char, prompt_title, title_from_text, user_title_problem,
};
pub use events::{Event, EventKind, EventPayload};
pub use ids::{AgentProfileId, ExecutorId, IdParseError, MessageId, SessionId, TaskId};
pub use queue::QueuedMessage;
pub use recovery::{
    Action, MAX_STEPS, Observation, OutcomeLabel, Recovery, RecoveryFailure, RecoveryInput,
    RecoveryOutcome, ResumePolicy, SurvivingAgent, UnexpectedObservation,
};
pub use states::{
    ExecutorStatus, MessageKind, MessageRole, PermissionPolicy, Runtime, RuntimeName, SessionState,
    TaskState, UnknownValue,
};
pub use status::{
    AgentProcessState, AgentRecovery, ExecutionView, MetadataStatus, RecoveryStage, ResumeReason,
    ResumeRefused, SessionStatus, check_resume, retrying_message, session_status,
    session_status_with,
};
pub use transitions::{
    ExecutorEvent, IllegalExecutorTransition, IllegalSessionTransition, IllegalTaskTransition,
    IllegalTransition, SessionEvent, TaskEvent,
};
pub use usage::{Cost, TurnUsage, UsageTotals};
