//! The changesets several flows build: a session or an executor moved
//! through the domain's state machines, a remote host lost. Flows commit
//! them through `SessionManager::commit`.

use sessiond_domain::{
    EventPayload, ExecutorEvent, ExecutorRecord, RecoveryFailure, Session, SessionEvent,
};
use sessiond_store::Changeset;

use crate::error::{Error, Result};

/// An executor event applied through the domain's state machine, which every
/// executor status change goes through: an illegal move (a stopped executor
/// turning ready or failed) is refused instead of written.
pub(crate) fn executor_moved(
    record: &ExecutorRecord,
    event: ExecutorEvent,
) -> Result<ExecutorRecord> {
    let mut next = record.clone();
    move_executor(&mut next, event)?;
    Ok(next)
}

/// [`executor_moved`] in place, for a record its holder gives up anyway
/// (no copy); an illegal move leaves it as it was.
pub(crate) fn move_executor(record: &mut ExecutorRecord, event: ExecutorEvent) -> Result<()> {
    record.status = record
        .status
        .transition(event)
        .map_err(|e| Error::Internal(format!("executor {}: {e}", record.id)))?;
    Ok(())
}

/// A session event applied: the new session and, if the state changed, its
/// `state_changed` payload. The error is kept only on ERROR.
pub(crate) fn transition(
    session: &Session,
    event: SessionEvent,
    error: Option<String>,
) -> Result<(Session, Option<EventPayload>)> {
    let to = session
        .state
        .transition(event)
        .map_err(|e| Error::InvalidState {
            session_id: session.id,
            state: e.from,
            action: e.event.as_str(),
            hint: "look at the session's status first",
        })?;
    let mut next = session.clone();
    let error = error.filter(|_| to == sessiond_domain::SessionState::Error);
    next.state = to;
    next.error_message = error.clone();
    let changed = (to != session.state).then_some(EventPayload::StateChanged {
        from: session.state,
        to,
        error_message: error,
    });
    Ok((next, changed))
}

/// The executor's remote host stopped answering: the executor fails with
/// the reconnect code (recovery takes it up again while its window is open).
pub(crate) fn remote_lost(record: &ExecutorRecord, reason: &str) -> Result<Changeset> {
    let failure = RecoveryFailure::Reconnecting {
        url: record.agentctl_url.clone().unwrap_or_default(),
        reason: reason.to_owned(),
    };
    let mut lost = executor_moved(record, ExecutorEvent::Failed)?;
    lost.error_message = Some(failure.message());
    Ok(Changeset::new().update_executor(lost).event(
        record.session_id,
        EventPayload::AgentctlError {
            executor_id: record.id,
            error_message: failure.message(),
        },
    ))
}
