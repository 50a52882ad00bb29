//! What a module asks of a module above it, as traits on
//! `SessionManager` that the answering module implements: the asking
//! module depends on this file, not on the one above, so the engine's
//! modules stay in layers with no import loop. A call on a session first
//! has it recovered (`recovery`); a lost agentctl, and an agent that
//! exited, are handed to recovery's background retries; recovery makes sure this replica owns what it
//! recovers (`replica`).

use std::future::Future;

use sessiond_domain::{ExecutorRecord, Session, SessionId};
use sessiond_store::Changeset;

use crate::{
    error::Result,
    pass::{Ahead, CallRecovery},
    restarts::AfterExit,
};

/// Recovery's side of a call (implemented in `recovery`).
pub(crate) trait RecoverFirst {
    /// If startup recovery has not finished with `session`, recover it now
    /// (ahead of the pass) or join the recovery under way; see
    /// `RecoveryControl::ensure_recovered`.
    fn ensure_recovered(&self, session: SessionId) -> impl Future<Output = Result<()>> + Send;

    /// As [`Self::ensure_recovered`], keeping the pass paused (between its
    /// steps) while the returned hold lives, so the call's own writes do not
    /// compete with it. `arrival` ([`Self::precede_pass`]) is let go with
    /// the recovery's own pause, once the workspace is back: the agent's
    /// launch does not hold the pass up.
    ///
    /// `leave`: return once the workspace is back, leaving the agent's
    /// relaunch running ([`Ahead::settle`] waits for it); a message that
    /// may be queued is queued by that recovery meanwhile.
    fn recover_ahead(
        &self,
        session: SessionId,
        arrival: Option<CallRecovery>,
        leave: bool,
    ) -> impl Future<Output = Result<Ahead>> + Send;

    /// Pauses the pass while the call on `session` runs, if the pass may
    /// still take that session.
    fn precede_pass(&self, session: SessionId) -> Option<CallRecovery>;

    /// Whether sessiond brings the agent of `record`'s session back by
    /// itself: its recovery is under way or waits to retry, or its executor
    /// is retried in the background (a Docker engine or a remote host that
    /// does not answer).
    fn comes_back_by_itself(&self, record: &ExecutorRecord) -> bool;

    /// Retries a lost agentctl in the background (`attempt` so far).
    fn spawn_retry(&self, record: ExecutorRecord, attempt: u32, reason: String);

    /// Reconnects a remote host that stopped answering, in the background.
    fn spawn_reconnect(&self, record: ExecutorRecord);

    /// Restarts the agent of `session` in the background, when its exit's
    /// commit (`committed`) decided so (`restarts::after_agent_exit`).
    fn spawn_agent_restart(&self, session: SessionId, decision: AfterExit, committed: bool);

    /// Recovers `session` in the background now (its agent relaunched and
    /// its conversation resumed, a pending turn settled), the status saying
    /// so meanwhile: its agentctl answers but runs no agent.
    fn spawn_agent_relaunch(&self, session: SessionId, reason: String);

    /// Recovers `session` in the background once the store answers again:
    /// a call the database's outage cut short (a create, a stop) left it
    /// between two writes, as a crash would, and no restart may come.
    fn recover_once_store_answers(&self, session: SessionId, reason: String);

    /// [`Self::spawn_agent_relaunch`], waited for: the caller holds no lock
    /// of `session` and answers with what the recovery left.
    fn relaunch_now(&self, session: SessionId, reason: String) -> impl Future<Output = ()> + Send;

    /// What a lost agentctl of `record` changes (its executor, the session,
    /// a turn in flight as `turn` says), and the record to retry in the
    /// background if the loss may pass.
    fn agentctl_lost_change(
        &self,
        record: &ExecutorRecord,
        reason: &str,
        turn: TurnInFlight,
    ) -> impl Future<Output = Result<(Changeset, Option<ExecutorRecord>)>> + Send;
}

/// What a lost agentctl does to the session's turn in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TurnInFlight {
    /// Ends it interrupted: the agent may have been working on it.
    Interrupt,
    /// Keeps it pending (the session RUNNING) for the recovery that brings
    /// agentctl back to settle by its journal (decision 0007): the turn's
    /// own Prompt found agentctl gone, so it is delivered once if it never
    /// reached an agent. A loss that is a verdict (the container gone for
    /// good) still ends it interrupted.
    Settle,
}

/// This replica's side of a session's lease (implemented in `replica`).
pub(crate) trait Ownership {
    /// With other replicas, makes `session`'s executor this replica's (a
    /// free or expired lease is claimed, an adoption under way joined), or
    /// answers `Error::NotOwner`.
    fn ensure_owned(&self, session: SessionId) -> impl Future<Output = Result<()>> + Send;
}

/// Queued messages' side of a commit (implemented in `turn`).
pub(crate) trait QueuedMessages {
    /// After a commit: `session` may have a queued message to deliver now
    /// (or a queue to drop, if it ended).
    fn queue_after_commit(&self, session: &Session);

    /// Delivers the first queued message of `session_id` (or drops the
    /// queue of an ended session) on a task of its own, if it can now.
    fn kick_queue(&self, session_id: SessionId);
}
