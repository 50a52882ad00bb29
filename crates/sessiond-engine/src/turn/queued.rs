//! Messages sent while a turn runs: queued in the session's metadata
//! (`sessiond_domain::queue`), delivered one turn at a time.
//!
//! Delivery is driven by what the session becomes, not by who ended the
//! turn: every commit that leaves a session waiting for input with messages
//! queued, and every moment its agent is seen running again, *kicks* the
//! queue. A kick takes the session lock, reads the session, and starts the
//! first queued message's turn only if the session still waits for input
//! and its agent runs; taking the message off the queue is part of the
//! commit that starts the turn. So concurrent kicks deliver it once, and a
//! crash before that commit leaves it queued for the next kick (recovery
//! commits the session, which kicks). A session that ended drops its queue
//! with a system message saying what was not sent. The queue is held
//! while the last turn is interrupted (it may have run, or not): a retry of
//! it, or a new message, lets it go on.

use chrono::Utc;
use sessiond_domain::{
    EventPayload, Message, MessageId, MessageKind, MessageRole, QueuedMessage, Session, SessionId,
    SessionState, TaskId,
    queue::{self, MAX_QUEUED},
};
use sessiond_store::Changeset;

use super::{INTERRUPTED_TURN_KEY, Turns};
use crate::lease::Fencing;
use crate::{Error, Result, SessionManager};

/// The text of all queued messages of a session, at most (1 MiB): the
/// queue is kept in the session's row.
pub const MAX_QUEUED_BYTES: usize = 1024 * 1024;

/// What SendMessage did with a message.
#[derive(Debug, Clone)]
pub enum Sent {
    /// Its turn started: the stored user message.
    Started(Message),
    /// A turn runs (or messages wait ahead of it): queued.
    Queued(QueuedMessage),
}

/// A user message and what goes with it ([`SessionManager::send_outgoing`]).
#[derive(Debug, Clone, Default)]
pub struct Outgoing {
    /// The text; may be empty when attachments go with it.
    pub text: String,
    /// Images, links and worktree files, after the text. A message with
    /// attachments is never queued.
    pub attachments: Vec<crate::Attachment>,
    /// Queue it while a turn runs (or messages wait) instead of refusing.
    pub queue: bool,
    /// The client's idempotency key: the same key in the same session
    /// names the same message ([`MessageId::for_request`]).
    pub request_id: Option<String>,
}

impl SessionManager {
    /// Sends `text` as [`SessionManager::send_message`] does when the
    /// session waits for input; while a turn runs, or while messages already
    /// wait, queues it instead (delivered in order, once, after the running
    /// turn; kept across restarts). RESOURCE_EXHAUSTED when the queue is
    /// full.
    ///
    /// # Errors
    ///
    /// As [`SessionManager::send_message`], and [`Error::LimitReached`] for a
    /// full queue.
    pub async fn send_or_queue(
        &self,
        task: TaskId,
        session_id: SessionId,
        text: &str,
    ) -> Result<Sent> {
        Turns(self)
            .send(task, session_id, text, Vec::new(), true, None)
            .await
    }

    /// Sends `message` with everything SendMessage can carry: as
    /// [`SessionManager::send_or_queue`] when it may be queued, else as
    /// [`SessionManager::send_message_with`]. With a `request_id`, a send
    /// repeated after an unknown outcome (a lost answer, UNAVAILABLE) does
    /// not send the message twice: it answers with what the first did (the
    /// stored message, or its queued copy), and if the first reached the
    /// agent without being stored, the repeat's turn is that same turn
    /// (agentctl starts a turn id once).
    ///
    /// # Errors
    ///
    /// As [`SessionManager::send_or_queue`]; [`Error::InvalidArgument`] when
    /// the request id was used in this session for another text.
    pub async fn send_outgoing(
        &self,
        task: TaskId,
        session_id: SessionId,
        message: Outgoing,
    ) -> Result<Sent> {
        let queue = message.queue && message.attachments.is_empty();
        Turns(self)
            .send(
                task,
                session_id,
                &message.text,
                message.attachments,
                queue,
                message.request_id.as_deref(),
            )
            .await
    }

    /// Takes queued message `id` off `session_id`'s queue.
    ///
    /// # Errors
    ///
    /// [`Error::NotFound`] when it is not queued, [`Error::AlreadyDelivered`]
    /// when its turn started already.
    pub async fn cancel_queued_message(
        &self,
        task: TaskId,
        session_id: SessionId,
        id: MessageId,
    ) -> Result<QueuedMessage> {
        self.to_completion(move |m| async move {
            m.cancel_queued_message_inner(task, session_id, id).await
        })
        .await
    }

    async fn cancel_queued_message_inner(
        &self,
        task: TaskId,
        session_id: SessionId,
        id: MessageId,
    ) -> Result<QueuedMessage> {
        self.check_task(task, session_id).await?;
        // The session's agent being brought back, the recovery holding the
        // session takes it off (helper-57 F1: it waited for the agent, whose
        // return then delivered it first).
        let taken = match Turns(self).unqueue_while_recovering(session_id, id).await {
            Some(taken) => taken,
            None => {
                let _guard = self.inner.sessions.lock(session_id).await;
                Turns(self).unqueue(session_id, id).await
            }
        };
        match taken {
            Ok((cancelled, _)) => {
                tracing::info!(session = %session_id, message = %id, "queued message cancelled");
                Ok(cancelled)
            }
            Err(e) => Err(Fencing(self).unless_lost(session_id, e).await),
        }
    }
}

impl Turns<'_> {
    /// Takes queued message `id` off the session's queue; returns it and
    /// the session as committed. The caller holds the lock.
    pub(crate) async fn unqueue(
        &self,
        session_id: SessionId,
        id: MessageId,
    ) -> Result<(QueuedMessage, Session)> {
        let session = self.inner.store.get_session(session_id).await?;
        let mut next = session;
        let Some(cancelled) = queue::remove(&mut next.metadata, id) else {
            if self
                .inner
                .store
                .get_message(session_id, id)
                .await?
                .is_some()
            {
                return Err(Error::AlreadyDelivered {
                    session_id,
                    message_id: id,
                });
            }
            return Err(Error::NotFound {
                entity: "queued message",
                id: format!("{id} (in session {session_id})"),
            });
        };
        next.updated_at = Utc::now();
        let queued = queue::queued(&next.metadata);
        let change = Changeset::new()
            .update_session(next)
            .event(session_id, EventPayload::QueueChanged(queued));
        let committed = self.commit(change).await?;
        let session = committed
            .session
            .ok_or_else(|| Error::Internal("the queue's commit wrote no session".into()))?;
        Ok((cancelled, session))
    }
}

/// The session has a turn running, its agent is being started (a create,
/// a restart after the agent exited or lost the conversation, a resume:
/// helper-46 F3), or messages wait ahead: a new message goes to the back of
/// the queue, delivered once the session waits for input.
pub(crate) fn waits_behind_a_turn(session: &Session) -> bool {
    match session.state {
        SessionState::Running | SessionState::Starting => true,
        SessionState::WaitingForInput => !queue::is_empty(&session.metadata),
        _ => false,
    }
}

/// Whether SendMessage without a queue must refuse because messages wait.
pub(crate) fn queued_ahead(session: &Session) -> bool {
    session.state == SessionState::WaitingForInput && !queue::is_empty(&session.metadata)
}

impl Turns<'_> {
    /// Appends `text` to the session's queue, as message `id` (new when
    /// `None`). The caller holds the lock.
    pub(crate) async fn enqueue(
        &self,
        session: Session,
        text: &str,
        id: Option<MessageId>,
    ) -> Result<QueuedMessage> {
        self.enqueue_as(
            session,
            text,
            id,
            "behind the running turn or the messages before it",
        )
        .await
        .map(|(m, _)| m)
    }

    /// [`Self::enqueue`], returning the session as committed too; `why`
    /// it is queued goes to the log.
    pub(crate) async fn enqueue_as(
        &self,
        session: Session,
        text: &str,
        id: Option<MessageId>,
        why: &str,
    ) -> Result<(QueuedMessage, Session)> {
        let session_id = session.id;
        let waiting = queue::queued(&session.metadata);
        if waiting.len() >= MAX_QUEUED {
            return Err(Error::LimitReached {
                limit: "queued messages per session",
                max: MAX_QUEUED,
                what: "queued messages",
                hint: "wait for the queued messages to go to the agent, or take one off the queue \
                       (CancelQueuedMessage; `sessionctl unqueue`)",
            });
        }
        if queue::queued_bytes(&session.metadata) + text.len() > MAX_QUEUED_BYTES {
            return Err(Error::LimitReached {
                limit: "bytes of queued text per session",
                max: MAX_QUEUED_BYTES,
                what: "queued text",
                hint: "wait for the queued messages to go to the agent, or take one off the queue \
                       (CancelQueuedMessage; `sessionctl unqueue`)",
            });
        }
        let entry = QueuedMessage {
            id: id.unwrap_or_default(),
            content: text.to_owned(),
            queued_at: Utc::now(),
        };
        let mut next = session;
        if next.state == SessionState::WaitingForInput {
            // A new message while the queue is held behind an interrupted
            // turn: the user goes on without retrying it.
            next.metadata.remove(INTERRUPTED_TURN_KEY);
        }
        queue::enqueue(&mut next.metadata, &entry);
        next.updated_at = entry.queued_at;
        let queued = queue::queued(&next.metadata);
        let place = queued.len();
        let change = Changeset::new()
            .update_session(next)
            .event(session_id, EventPayload::QueueChanged(queued));
        let committed = self.commit(change).await?;
        tracing::info!(session = %session_id, message = %entry.id, place, "message queued {why}");
        let session = committed
            .session
            .ok_or_else(|| Error::Internal("the queue's commit wrote no session".into()))?;
        Ok((entry, session))
    }

    async fn deliver_queued(&self, session_id: SessionId) -> Result<()> {
        if !Fencing(self).owns(session_id) {
            return Ok(());
        }
        let _guard = self.inner.sessions.lock(session_id).await;
        let session = match self.inner.store.get_session(session_id).await {
            Ok(s) => s,
            Err(sessiond_store::Error::NotFound { .. }) => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        let Some(first) = queue::queued(&session.metadata).into_iter().next() else {
            return Ok(());
        };
        if session.state.is_terminal() {
            return self.drop_queue(session).await;
        }
        let agent_runs = self.execution(session_id).is_some_and(|e| {
            e.record.status == sessiond_domain::ExecutorStatus::Ready
                && e.agent == sessiond_domain::AgentProcessState::Running
        });
        if session.state != SessionState::WaitingForInput || !agent_runs {
            // A later commit, or the agent seen running again, kicks again.
            return Ok(());
        }
        if self.inner.mailboxes.someone_first(session_id) {
            // A send made before these were queued goes first; its end
            // kicks the queue again.
            return Ok(());
        }
        if queue::is_held(&session.metadata) {
            // The last turn ended interrupted: the user decides whether it
            // runs again before what was queued behind it. A retry, or a
            // new message (which gives the retry up), lets the queue go on.
            return Ok(());
        }
        tracing::info!(session = %session_id, message = %first.id, "delivering a queued message");
        self.start_turn_as(session, &first.content, Some(first.id), Vec::new())
            .await
            .map(|_| ())
    }

    /// The session ended with messages queued: they are dropped, and a
    /// system message says which were not sent.
    async fn drop_queue(&self, session: Session) -> Result<()> {
        let session_id = session.id;
        let mut next = session;
        let dropped = queue::clear(&mut next.metadata);
        let now = Utc::now();
        next.updated_at = now;
        let note = Message {
            id: MessageId::new(),
            session_id,
            task_id: next.task_id,
            role: MessageRole::System,
            content: format!(
                "{} queued message(s) were not sent: the session ended ({})",
                dropped.len(),
                next.state
            ),
            kind: MessageKind::Text,
            data: String::new(),
            seq: 0,
            complete: true,
            created_at: now,
            updated_at: now,
        };
        let change = Changeset::new()
            .update_session(next)
            .add_message(note.clone())
            .event(session_id, EventPayload::QueueChanged(Vec::new()))
            .event(session_id, EventPayload::MessageAdded(note));
        self.commit(change).await?;
        Ok(())
    }
}

impl crate::flows::QueuedMessages for SessionManager {
    fn queue_after_commit(&self, session: &Session) {
        if queue::is_empty(&session.metadata) {
            return;
        }
        let deliverable = session.state == SessionState::WaitingForInput;
        if deliverable || session.state.is_terminal() {
            self.kick_queue(session.id);
        }
    }

    fn kick_queue(&self, session_id: SessionId) {
        let me = self.clone();
        self.spawn_background(async move {
            if let Err(e) = Turns(&me).deliver_queued(session_id).await {
                tracing::warn!(session = %session_id, error = %e, "queued message not delivered yet");
            }
        });
    }
}
