//! Session lifecycle, startup recovery, explicit resume, session status and
//! durable event publication: the orchestration of sessiond.
//!
//! Architecture invariant: this crate decides *when* and orchestrates; the
//! decisions themselves are the pure functions of `sessiond-domain`
//! (transitions, [`sessiond_domain::session_status`],
//! [`sessiond_domain::check_resume`], the [`sessiond_domain::Recovery`] step
//! machine), the IO goes through `sessiond-store` (one [`sessiond_store::Changeset`]
//! per state change, its events in the same transaction) and the
//! [`sessiond_executor::Executor`] drivers. It reads no configuration files
//! or environment: [`ManagerConfig`] is passed in.
//!
//! Entry point: [`SessionManager`], the facade; each concept has its own
//! type and file inside (`docs/ARCHITECTURE.md` lists them in their layers).
//! - Lifecycle (`lifecycle.rs`) and turns (`turn/`): [`SessionManager::create_session`],
//!   [`SessionManager::send_message`], [`SessionManager::end_session`],
//!   [`SessionManager::delete_session`]. The agent's streamed reply is stored
//!   by a per-session update pump (`turn/pump.rs`).
//! - Recovery (`recovery.rs`, `recovery/`), through [`SessionManager::recovery`]:
//!   [`RecoveryControl::recover_all`], then background reconnects of remote
//!   hosts. While a pass runs, a call on a session it has not reached
//!   recovers that session first (`recovery/queue.rs`,
//!   [`RecoveryControl::ensure_recovered`]). Liveness checks
//!   ([`RecoveryControl::start_liveness_checks`], started by `recover_all`)
//!   and the orphan-container sweep ([`RecoveryControl::start_orphan_sweep`]),
//!   which acts only after the first recovery pass plus a grace period and
//!   only on positive evidence that no record tracks a container.
//! - Explicit resume (`resume.rs`): [`SessionManager::resume_session`],
//!   single-flight per session.
//! - Replicas sharing one store (`lease.rs`, `replica.rs`), through
//!   [`SessionManager::replica`].
//! - Status and events (`status.rs`, `events.rs`):
//!   [`SessionManager::session_status`], [`SessionManager::watch_session`],
//!   [`SessionManager::watch_task`].
//!
//! Every write of a state change goes through `SessionManager::commit`:
//! commit the changeset, then publish exactly the events it stored.

#![deny(missing_docs)]

pub mod attachments;
mod changes;
mod config;
mod database_seen;
mod error;
mod events;
mod flows;
mod launches;
mod lease;
mod lifecycle;
mod mailboxes;
mod manager;
mod metrics;
mod modes;
mod ops;
mod pass;
mod permission;
mod progress;
mod recovery;
mod replica;
mod restarts;
mod resume;
mod session_mcp;
mod sessions;
mod status;
mod sync;
mod turn;
pub mod usage;
mod worktrees;

pub use attachments::Attachment;
pub use config::{LaunchLimits, ManagerConfig, ReplicaSettings, WorktreeSettings};
pub use error::{Error, ErrorKind, Result};
pub use events::{EventBus, EventStream};
pub use lifecycle::{EndReason, NewSession, RemoteAgentctl};
pub use manager::{SessionManager, Stats};
pub use metrics::{ExitCause, ManagerMetrics, TurnOutcome};
#[cfg(feature = "test-hooks")]
pub use pass::PassGate;
pub use recovery::SweepReport;
pub use recovery::{RecoveryControl, RecoverySummary};
pub use replica::Replica;
pub use sessions::Execution;
pub use turn::queued::{MAX_QUEUED_BYTES, Outgoing, Sent};
