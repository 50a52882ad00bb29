//! Starting a turn (SendMessage, RetryTurn) and cancelling one: the turn's
//! intent is committed before the Prompt goes out.

use chrono::Utc;
use sessiond_domain::{
    AgentProcessState, EventPayload, ExecutorRecord, ExecutorStatus, Message, MessageId,
    MessageRole, Runtime, Session, SessionEvent, SessionId, SessionState, TaskEvent, TaskId,
    check_resume,
};
use sessiond_proto::agentctl::v1 as pb;
use sessiond_store::Changeset;

use super::{
    INTERRUPTED_TURN_KEY, LAST_TURN_KEY, TURN_GENERATION_KEY, TURN_INSTANCE_KEY, TURN_KEY,
    stored_cursor,
};
use crate::{
    changes::transition,
    error::{Error, Result},
    flows::RecoverFirst,
    lease::Fencing,
    manager::SessionManager,
    metrics::ms,
    ops::Agents,
};

impl SessionManager {
    /// Sends a user message: persists it (`message.added`), session RUNNING,
    /// then prompts the agent. The reply is persisted by the session's update
    /// pump as one agent message; the session returns to WAITING_FOR_INPUT
    /// when the turn ends.
    pub async fn send_message(
        &self,
        task: TaskId,
        session_id: SessionId,
        text: &str,
    ) -> Result<Message> {
        self.send_message_with(task, session_id, text, Vec::new())
            .await
    }

    /// [`Self::send_message`] with attachments after the text (images,
    /// links, worktree files): read and checked (types, sizes, the agent's
    /// `promptCapabilities`) before anything is stored; `text` may then be
    /// empty. Never queued.
    ///
    /// # Errors
    ///
    /// As [`Self::send_message`]; [`Error::InvalidArgument`] naming the
    /// attachment and what is wrong with it.
    pub async fn send_message_with(
        &self,
        task: TaskId,
        session_id: SessionId,
        text: &str,
        attachments: Vec<crate::Attachment>,
    ) -> Result<Message> {
        match Turns(self)
            .send(task, session_id, text, attachments, false, None)
            .await?
        {
            crate::Sent::Started(m) => Ok(m),
            crate::Sent::Queued(_) => Err(Error::Internal("queued without being asked to".into())),
        }
    }

    /// Runs again a turn that ended *interrupted* (a crash left it unknown
    /// whether the agent ran it, so it was not sent again automatically):
    /// the user asks for it explicitly. A new user message with the same
    /// content is stored and prompted as [`SessionManager::send_message`]
    /// does; the interrupted turn stays in the conversation as it ended.
    /// `message`: the interrupted turn's user message (`None`: the session's
    /// last turn). Only the last turn can be retried, once: a turn sent
    /// after it (a retry included) makes it not retryable.
    pub async fn retry_turn(
        &self,
        task: TaskId,
        session_id: SessionId,
        message: Option<MessageId>,
    ) -> Result<(Message, MessageId)> {
        self.to_completion(
            move |m| async move { m.retry_turn_inner(task, session_id, message).await },
        )
        .await
    }

    async fn retry_turn_inner(
        &self,
        task: TaskId,
        session_id: SessionId,
        message: Option<MessageId>,
    ) -> Result<(Message, MessageId)> {
        let early = self.precede_pass(session_id);
        self.check_task(task, session_id).await?;
        // No turn interrupted, and none pending that the agent's coming
        // back could end interrupted: answer now, not once the agent is
        // back (helper-58 F2).
        if self.recovery().bringing_back(session_id).await {
            let stored = self.inner.store.get_session(session_id).await?;
            let settled = stored.state != SessionState::Running
                && !stored.metadata.contains_key(TURN_KEY)
                && !stored.metadata.contains_key(INTERRUPTED_TURN_KEY);
            if settled {
                let msgs = match message {
                    Some(_) => {
                        self.inner
                            .store
                            .list_messages(session_id, 0, u32::MAX)
                            .await?
                    }
                    None => Vec::new(),
                };
                // With no turn interrupted, always the error to answer.
                interrupted_turn_message(session_id, message, None, &msgs)?;
            }
        }
        let _ahead = self.recover_ahead(session_id, early, false).await?;
        Turns(self).wait_agent_recovery(session_id).await;
        // A turn the restart left RUNNING ends interrupted once the pump
        // has caught up: that is the turn to retry.
        Turns(self)
            .turn_settled(session_id, self.inner.config.executor_deadline)
            .await;
        let _guard = self.inner.sessions.lock(session_id).await;
        let session = self.inner.store.get_session(session_id).await?;
        if let Err(e) = Turns(self)
            .check_can_start_turn(&session, "retry a turn")
            .await
        {
            return Err(Fencing(self).unless_lost(session_id, e).await);
        }
        let interrupted = session.metadata.get(INTERRUPTED_TURN_KEY).cloned();
        let msgs = self
            .inner
            .store
            .list_messages(session_id, 0, u32::MAX)
            .await?;
        let original = interrupted_turn_message(session_id, message, interrupted, &msgs)?;
        let message = Turns(self).start_turn(session, &original.content).await?;
        tracing::info!(session = %session_id, retried = %original.id, turn = %message.id,
            "interrupted turn retried on the user's request");
        Ok((message, original.id))
    }

    /// Cancels the session's turn in progress: ACP `session/cancel` through
    /// agentctl. The turn ends on the update stream like any other, with
    /// stop reason `cancelled`: the reply so far is kept (completed), a
    /// system message says the turn was cancelled, and `turn_ended` is
    /// published. Returns false when agentctl had no turn in progress any
    /// more (it ended just before). The session lock is not held: the
    /// update pump takes it to end the turn.
    pub async fn cancel_turn(&self, task: TaskId, session_id: SessionId) -> Result<bool> {
        self.to_completion(move |m| async move { m.cancel_turn_inner(task, session_id).await })
            .await
    }

    async fn cancel_turn_inner(&self, task: TaskId, session_id: SessionId) -> Result<bool> {
        let session = match self.session_of_task(task, session_id).await {
            // No turn was running when the agent went: there is none to
            // cancel while it is brought back (a queued message starts its
            // turn after); say so now, not once it is back (helper-58 F2).
            Ok(found)
                if found.state != SessionState::Running
                    && self.recovery().bringing_back(session_id).await =>
            {
                Ok(found)
            }
            Ok(_) => {
                self.ensure_recovered(session_id).await?;
                self.inner
                    .store
                    .get_session(session_id)
                    .await
                    .map_err(Error::from)
            }
            Err(e) => Err(e),
        };
        // The database away (helper-45 F8): a stop asked for while it is
        // away still reaches the agent, from the session as this manager
        // last committed it; the turn's end is stored once it is back.
        let session = match session {
            Ok(s) => s,
            Err(e) if e.is_store_unavailable() && Fencing(self).owns(session_id) => {
                match self.inner.sessions.status_read(session_id).entry {
                    Some(entry) if entry.session.task_id == task => {
                        tracing::info!(session = %session_id, "cancel while the database is away: from the session as last committed");
                        (*entry.session).clone()
                    }
                    _ => return Err(e),
                }
            }
            Err(e) => return Err(e),
        };
        match session.state {
            SessionState::Running => {}
            s if s.is_terminal() => {
                return Err(Error::SessionEnded {
                    session_id,
                    state: s,
                });
            }
            s => {
                return Err(Error::InvalidState {
                    session_id,
                    state: s,
                    action: "cancel a turn",
                    hint: "no turn is in progress",
                });
            }
        }
        let execution = match self
            .execution(session_id)
            .filter(|e| e.record.status == ExecutorStatus::Ready)
        {
            Some(e) if e.agent == AgentProcessState::Running => Some(e),
            // The cache lags behind an agent just restarted (the stream
            // replays the old agent's state changes before the new one's):
            // agentctl says whether an agent runs.
            Some(e) => {
                let running = match Agents(self).client(&e.record) {
                    Ok(client) => client.health().await.is_ok_and(|h| {
                        matches!(
                            h.agent_state,
                            sessiond_executor::AgentState::Ready
                                | sessiond_executor::AgentState::Busy
                        )
                    }),
                    Err(_) => false,
                };
                running.then_some(e)
            }
            None => None,
        };
        let Some(execution) = execution else {
            return Err(Error::AgentNotRunning {
                session_id,
                hint: "its turn ends as soon as the agent is resumed or found gone".into(),
            });
        };
        let client = Agents(self).client(&execution.record)?;
        let cancelled = client.cancel().await.map_err(|e| {
            Fencing(self).executor_refused(session_id, &e);
            Error::agent("Cancel", &e)
        })?;
        tracing::info!(session = %session_id, cancelled, "turn cancel requested");
        if let Some(turn) = session.metadata.get(TURN_KEY).filter(|_| cancelled) {
            self.remember_cancel(session_id, turn).await;
            self.stop_if_cancel_ignored(session_id, turn.clone(), execution.record);
        }
        Ok(cancelled)
    }

    /// Stores that `turn` was cancelled, so a backend restarted before it
    /// ends sends the cancel again and still stops an agent that ignores
    /// it (`Turns::start_pump`). Best effort: the cancel itself was sent.
    async fn remember_cancel(&self, session_id: SessionId, turn: &str) {
        let _guard = self.inner.sessions.lock(session_id).await;
        let stored = async {
            let mut s = self.inner.store.get_session(session_id).await?;
            if s.state != SessionState::Running
                || s.metadata.get(TURN_KEY).map(String::as_str) != Some(turn)
            {
                return Ok(());
            }
            s.metadata.insert(super::CANCEL_KEY.into(), turn.to_owned());
            self.commit(Changeset::new().update_session(s))
                .await
                .map(drop)
        }
        .await;
        if let Err(e) = stored {
            tracing::warn!(session = %session_id, error = %e, "could not store the turn's cancel");
        }
    }

    /// An agent may ignore `session/cancel` (stuck in a tool that never
    /// looks): if `turn` still runs `cancel_grace` after its cancel, the
    /// agent is stopped. Its exit then ends the turn cancelled, saying
    /// sessiond stopped it, and restarts it with its conversation, as any
    /// exit does (decision 0037). One watch per cancel; a turn that ended, or an
    /// agent replaced meanwhile, is left alone.
    pub(super) fn stop_if_cancel_ignored(
        &self,
        session_id: SessionId,
        turn: String,
        record: ExecutorRecord,
    ) {
        let grace = self.inner.config.cancel_grace;
        let me = self.clone();
        self.spawn_background(async move {
            tokio::time::sleep(grace).await;
            let still = async {
                let _guard = me.inner.sessions.lock(session_id).await;
                let s = me.inner.store.get_session(session_id).await.ok()?;
                let current = me.inner.store.get_executor_for_session(session_id).await.ok()??;
                let same = s.state == SessionState::Running
                    && s.metadata.get(TURN_KEY) == Some(&turn)
                    && current.generation == record.generation
                    && current.status == ExecutorStatus::Ready
                    && Fencing(&me).owns(session_id);
                if same {
                    me.inner.agent_restarts.stopping_after_cancel(session_id, grace);
                }
                same.then_some(current)
            }
            .await;
            let Some(current) = still else {
                return;
            };
            tracing::warn!(session = %session_id, %turn, ?grace,
                "the agent ignored the turn's cancel; stopping it");
            let stopped = match Agents(&me).client(&current) {
                Ok(client) => client.stop_agent(me.inner.config.agent_stop_grace).await,
                Err(e) => {
                    tracing::warn!(session = %session_id, error = %e, "cannot stop the agent");
                    return;
                }
            };
            if let Err(e) = stopped {
                tracing::warn!(session = %session_id, error = %e, "could not stop the agent after its ignored cancel");
            }
        });
    }
}

/// How long a message or a retry waits for a background recovery of the
/// session's agent (a heavy agent takes seconds to start and load its
/// history).
pub(super) const RECOVERY_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Turns: starting one (its intent committed before the Prompt), the
/// update pump that stores the agent's reply, and queued messages.
pub(crate) struct Turns<'m>(pub(crate) &'m crate::manager::SessionManager);

impl std::ops::Deref for Turns<'_> {
    type Target = crate::manager::SessionManager;

    fn deref(&self) -> &Self::Target {
        self.0
    }
}

impl Turns<'_> {
    /// The one path of SendMessage: `queue` puts the message behind a
    /// running turn (or behind messages already waiting) instead of
    /// refusing it. A message with attachments is never queued. It runs to
    /// its end if the caller goes away ([`SessionManager::to_completion`]).
    pub(crate) async fn send(
        &self,
        task: TaskId,
        session_id: SessionId,
        text: &str,
        attachments: Vec<crate::Attachment>,
        queue: bool,
        request_id: Option<&str>,
    ) -> Result<crate::Sent> {
        let (text, request_id) = (text.to_owned(), request_id.map(str::to_owned));
        self.to_completion(move |m| async move {
            Turns(&m)
                .send_inner(
                    task,
                    session_id,
                    &text,
                    attachments,
                    queue,
                    request_id.as_deref(),
                )
                .await
        })
        .await
    }

    async fn send_inner(
        &self,
        task: TaskId,
        session_id: SessionId,
        text: &str,
        attachments: Vec<crate::Attachment>,
        queue: bool,
        request_id: Option<&str>,
    ) -> Result<crate::Sent> {
        if text.trim().is_empty() && attachments.is_empty() {
            return Err(Error::InvalidArgument("the message is empty".into()));
        }
        // Refused before anything reaches the agent: PostgreSQL cannot
        // store it, and the prompt would run unrecorded (helper-50 1).
        if text.contains('\0') {
            return Err(Error::InvalidArgument(
                "the message holds a NUL character (U+0000), which sessiond does not store; \
                 remove it"
                    .into(),
            ));
        }
        if request_id.is_some_and(str::is_empty) {
            return Err(Error::InvalidArgument(
                "request_id: empty; leave it unset, or give a key unique to this message".into(),
            ));
        }
        // A retried send names the message (and turn) its first attempt made.
        let requested = request_id.map(|key| MessageId::for_request(session_id, key));
        let t = std::time::Instant::now();
        let early = self.precede_pass(session_id);
        self.check_task(task, session_id).await?;
        let checked = t.elapsed();
        // `early` goes once the session's workspace is back; `ahead` (if
        // the session needed recovering) then holds the pause for the call.
        // Its agent being brought back, a message that may wait is queued
        // at once, not after the agent's launch and load.
        let queueable = queue && attachments.is_empty();
        // One that cannot be queued, made while the agent is brought back
        // with nothing queued yet, goes before what is queued after it.
        let mut first = None;
        if !queueable && (early.is_some() || self.recovery().is_bringing_back(session_id)) {
            let stored = self.inner.store.get_session(session_id).await?;
            if sessiond_domain::queue::is_empty(&stored.metadata) {
                first = Some(self.inner.mailboxes.goes_first(session_id));
            }
        }
        let mut ahead = self.recover_ahead(session_id, early, queueable).await?;
        let posted = match queueable {
            true => {
                self.post_while_recovering(session_id, text, requested, request_id)
                    .await
            }
            false => None,
        };
        match posted {
            Some(Err(e)) => return Err(Fencing(self).unless_lost(session_id, e).await),
            Some(Ok(sent)) => return Ok(sent),
            None => {}
        }
        ahead.settle().await;
        self.wait_agent_recovery(session_id).await;
        // One that cannot be queued behind a turn a restart left RUNNING
        // goes once that turn's fate is known, as a retry does (a queued
        // one waits in the queue, held if that turn ends interrupted).
        if !queueable {
            self.turn_settled(session_id, self.inner.config.executor_deadline)
                .await;
        }
        let recovered = t.elapsed();
        let _guard = self.inner.sessions.lock(session_id).await;
        let locked = t.elapsed();
        // The status snapshot holds the session as last committed: a plain
        // message to a session waiting for input starts its turn from it,
        // with no store read. A copy older than the store fails the turn
        // start's version check (nothing written, nothing prompted) and the
        // session is read again.
        let snapshot = attachments
            .is_empty()
            .then(|| self.inner.sessions.committed_session(session_id))
            .flatten()
            .filter(|s| {
                s.state == SessionState::WaitingForInput && !crate::turn::queued::queued_ahead(s)
            });
        let sent = async {
            if let (Some(id), Some(key)) = (requested, request_id)
                && let Some(before) = self
                    .sent_before(session_id, id, key, text, &attachments)
                    .await?
            {
                return Ok(before);
            }
            if let Some(s) = snapshot {
                let started = self
                    .start_turn_from(Session::clone(&s), text, requested, Vec::new(), true)
                    .await?;
                if let Some(m) = started {
                    return Ok(crate::Sent::Started(m));
                }
                tracing::debug!(%session_id, "the status snapshot was older than the store; reading the session");
            }
            let session = self.inner.store.get_session(session_id).await?;
            if queue && attachments.is_empty() && crate::turn::queued::waits_behind_a_turn(&session)
            {
                return self
                    .enqueue(session, text, requested)
                    .await
                    .map(crate::Sent::Queued);
            }
            self.check_can_start_turn(&session, "send a message")
                .await?;
            if crate::turn::queued::queued_ahead(&session) && first.is_none() {
                return Err(Error::InvalidState {
                    session_id,
                    state: session.state,
                    action: "send a message without queueing it",
                    hint: "messages queued earlier wait to be delivered first; queue this one too, \
                           or cancel them",
                });
            }
            self.start_turn_as(session, text, requested, attachments)
                .await
                .map(crate::Sent::Started)
        }
        .await;
        if first.take().is_some() {
            // What was queued behind it goes on (after its turn, if it
            // started one).
            drop(_guard);
            crate::flows::QueuedMessages::kick_queue(self.0, session_id);
        }
        // Where a slow call spent its time (availability while recovering).
        tracing::debug!(
            %session_id,
            checked_ms = ms(checked),
            recovered_ms = ms(recovered),
            locked_ms = ms(locked),
            done_ms = ms(t.elapsed()),
            "send_message timing"
        );
        match sent {
            // Lost the lease while the call ran: the new owner is named.
            Err(e) => Err(Fencing(self).unless_lost(session_id, e).await),
            ok => ok,
        }
    }

    /// What an earlier send with the same request id (`key`, naming message
    /// `id`) did, if it did: its stored user message (the turn it started,
    /// or its queued copy delivered since), or its queued copy. The same key
    /// with another text or other attachments is refused: it would not be
    /// that message. A key whose queued message was cancelled is free
    /// again. The caller holds the session lock, so a delivery or a pump's
    /// record is not half done.
    pub(super) async fn sent_before(
        &self,
        session_id: SessionId,
        id: MessageId,
        key: &str,
        text: &str,
        attachments: &[crate::Attachment],
    ) -> Result<Option<crate::Sent>> {
        let reused = || {
            Error::InvalidArgument(format!(
                "request_id {key:?} was already used in this session for a different message \
                 (message {id}: its text or attachments differ); a new message needs a new \
                 request_id"
            ))
        };
        if let Some(m) = self.inner.store.get_message(session_id, id).await? {
            let stored = crate::attachments::of_message_data(&m.data);
            if m.role != MessageRole::User
                || m.content != text
                || !crate::attachments::same_as_asked(&stored, attachments)
            {
                return Err(reused());
            }
            tracing::info!(session = %session_id, message = %id,
                "a send repeated with its request id: answering with the stored message");
            return Ok(Some(crate::Sent::Started(m)));
        }
        let session = self.inner.store.get_session(session_id).await?;
        if session.metadata.get(TURN_KEY) == Some(&id.to_string()) {
            // Recovery found the turn at agentctl only (the first send died
            // between its Prompt and its commit); the pump records it.
            return Err(Error::Unavailable(format!(
                "the message reached the agent and its turn runs (message {id}); sessiond is \
                 recording it from agentctl's stream: send it again with the same request_id \
                 in a moment to get it"
            )));
        }
        let queued = sessiond_domain::queue::queued(&session.metadata)
            .into_iter()
            .find(|q| q.id == id);
        match queued {
            // A queued copy never has attachments.
            Some(q) if q.content != text || !attachments.is_empty() => Err(reused()),
            Some(q) => {
                tracing::info!(session = %session_id, message = %id,
                    "a send repeated with its request id: the message is queued already");
                Ok(Some(crate::Sent::Queued(q)))
            }
            None => Ok(None),
        }
    }

    /// A background recovery is bringing the session's agent back (agentctl
    /// lost, a turn just ended interrupted): a message or a retry waits for
    /// it, at most [`RECOVERY_WAIT`], instead of finding no agent. Taken
    /// before the session lock, which the recovery needs.
    pub(crate) async fn wait_agent_recovery(&self, session_id: SessionId) {
        if self.agent_runs(session_id) {
            return;
        }
        let recoveries = &self.inner.agent_recoveries;
        if !recoveries.wait_done(session_id, RECOVERY_WAIT).await {
            tracing::debug!(session = %session_id, "the agent's recovery goes on; answering from what is known");
        }
    }

    /// Whether the session's executor is ready and its agent runs (as this
    /// manager last saw).
    pub(super) fn agent_runs(&self, session_id: SessionId) -> bool {
        self.execution(session_id).is_some_and(|e| {
            e.record.status == ExecutorStatus::Ready && e.agent == AgentProcessState::Running
        })
    }

    /// The error for a session whose agent does not run, with the hint that
    /// `ResumeSession` agrees with: resume it, or why it cannot be resumed.
    pub(crate) async fn agent_not_running(&self, session: &Session) -> Error {
        let session_id = session.id;
        let why = session
            .error_message
            .as_deref()
            .map(|m| format!(" ({m})"))
            .unwrap_or_default();
        // Brought back by sessiond itself (a Docker engine or a remote host
        // that does not answer, a recovery under way): a resume would be
        // told there is no need (helper-37 D5: the two answers disagreed).
        if let Ok(Some(record)) = self.inner.store.get_executor_for_session(session_id).await
            && self.comes_back_by_itself(&record)
        {
            return Error::AgentNotRunning {
                session_id,
                hint: format!(
                    "sessiond brings it back by itself{}; send the message again once \
                     `session status` no longer says it is recovering",
                    record
                        .error_message
                        .as_deref()
                        .map(|m| format!(" ({m})"))
                        .unwrap_or_default()
                ),
            };
        }
        let hint = match crate::manager::status_of(self, session)
            .await
            .map(|s| check_resume(&s))
        {
            Ok(Err(refused)) => format!("it cannot be resumed{why}: {refused}"),
            _ => format!("resume the session first{why}"),
        };
        Error::AgentNotRunning { session_id, hint }
    }

    /// A turn can start only on a session waiting for input.
    pub(crate) async fn check_can_start_turn(
        &self,
        session: &Session,
        action: &'static str,
    ) -> Result<()> {
        let session_id = session.id;
        match session.state {
            SessionState::WaitingForInput => {}
            s if s.is_terminal() => {
                return Err(Error::SessionEnded {
                    session_id,
                    state: s,
                });
            }
            // A turn left RUNNING with no agent to finish it (a restart
            // under `on_demand` brought the workspace only): waiting never
            // helps, a resume does (helper-44 4).
            SessionState::Running
                if !self.execution(session_id).is_some_and(|e| {
                    e.record.status == ExecutorStatus::Ready
                        && e.agent != AgentProcessState::NotRunning
                }) && !self.inner.agent_recoveries.under_way(session_id) =>
            {
                return Err(self.agent_not_running(session).await);
            }
            SessionState::Running => {
                return Err(Error::InvalidState {
                    session_id,
                    state: session.state,
                    action,
                    hint: "the agent is still working on the previous message; wait for its reply",
                });
            }
            SessionState::Error => return Err(self.agent_not_running(session).await),
            s => {
                return Err(Error::InvalidState {
                    session_id,
                    state: s,
                    action,
                    hint: "wait until the agent is ready",
                });
            }
        }
        Ok(())
    }

    /// Stores user message `text`, session RUNNING, then the Prompt. The
    /// caller holds the session lock and checked the state.
    pub(crate) async fn start_turn(&self, session: Session, text: &str) -> Result<Message> {
        self.start_turn_as(session, text, None, Vec::new()).await
    }

    /// [`Self::start_turn`]; `id`: the user message's (and turn's) id, new
    /// when `None`. A queued message's id takes it off the queue in the
    /// commit that starts the turn, so it is delivered once; a request id's
    /// makes a retried send's turn the same turn.
    pub(crate) async fn start_turn_as(
        &self,
        session: Session,
        text: &str,
        id: Option<MessageId>,
        attachments: Vec<crate::Attachment>,
    ) -> Result<Message> {
        self.start_turn_from(session, text, id, attachments, false)
            .await?
            .ok_or_else(|| Error::Internal("a turn start from the store found it stale".into()))
    }

    /// [`Self::start_turn_as`]. `snapshot`: `session` is the status
    /// snapshot's copy; if the store has a newer version, nothing is
    /// written or prompted and the answer is `None` (read it, try again).
    ///
    /// The turn is held at agentctl (`HoldPrompt`: journaled, not handed to
    /// the agent) while its intent commits, and prompted once the commit is
    /// done: the agent sees it only after both, as before, but the journal's
    /// fsync no longer follows the commit.
    async fn start_turn_from(
        &self,
        session: Session,
        text: &str,
        id: Option<MessageId>,
        attachments: Vec<crate::Attachment>,
        snapshot: bool,
    ) -> Result<Option<Message>> {
        let session_id = session.id;
        let execution = self.execution(session_id);
        let Some(execution) = execution.filter(|e| {
            e.record.status == ExecutorStatus::Ready && e.agent == AgentProcessState::Running
        }) else {
            return Err(self.agent_not_running(&session).await);
        };
        let record = execution.record;
        // Read and checked before anything is stored.
        let attachments = if attachments.is_empty() {
            attachments
        } else {
            crate::attachments::resolve(&Agents(self).client(&record)?, attachments).await?
        };
        let blocks = crate::attachments::blocks(&attachments, &session.worktree.path);

        let now = Utc::now();
        let message = Message {
            id: id.unwrap_or_default(),
            session_id,
            task_id: session.task_id,
            role: MessageRole::User,
            content: text.to_owned(),
            kind: sessiond_domain::MessageKind::Text,
            data: if attachments.is_empty() {
                String::new()
            } else {
                serde_json::json!({"attachments": crate::attachments::to_json(&attachments)})
                    .to_string()
            },
            seq: 0,
            complete: true,
            created_at: now,
            updated_at: now,
        };
        let turn_id = message.id.to_string();
        // The agentctl process last known alive before the Prompt (a parked
        // pump's, else the stored cursor's): if that process still answers
        // after a crash, any Prompt of this turn went to it (one process
        // holds the address), so its journal alone tells whether the turn
        // reached an agent, even a journal it created (fresh).
        let instance = self
            .inner
            .sessions
            .parked_instance(session_id)
            .filter(|i| !i.is_empty())
            .unwrap_or_else(|| stored_cursor(&session, record.generation).1);
        let change = turn_start_change(&session, &message, record.generation, instance.clone())?;
        let client = Agents(self).client(&record)?;
        let request = pb::PromptRequest {
            text: text.to_owned(),
            turn_id: turn_id.clone(),
            blocks,
            ..Default::default()
        };
        // A text turn's Prompt goes out while its intent commits: agentctl
        // journals the turn before its agent sees it and puts it on its
        // stream (`TurnStarted`), from which the pump records a turn whose
        // commit never happened (a crash, a failed commit). A turn with
        // attachments is committed first: the stream does not carry them.
        let pipelined = request.blocks.is_empty();
        if pipelined && !self.inner.sessions.has_pump(session_id) {
            // From the state before this turn: the pump has no pending
            // turn to settle, and reads this one's `TurnStarted`.
            self.start_pump(&session, &record);
        }
        // The client side of agentctl's Prompt span; its trace context
        // travels in the call's metadata.
        let span = tracing::info_span!(
            "agentctl_prompt",
            otel.name = "agentctl.v1.AgentCtlService/Prompt",
            otel.kind = "client",
            rpc.system = "grpc",
            rpc.service = "agentctl.v1.AgentCtlService",
            rpc.method = "Prompt",
            turn_id = %turn_id,
        );
        let prompt = tracing::Instrument::instrument(client.prompt(request), span);
        let (committed, prompted) = if pipelined {
            // Timed from just before the Prompt: its first chunk can beat the reply.
            self.inner.metrics.turn_started(session_id);
            let (committed, prompted) = pipeline(self.commit(change), prompt).await;
            match (committed, prompted) {
                (Ok(c), p) => (c, p),
                (Err(e), Err(_)) => {
                    // Nothing reached the agent, or its stream tells.
                    return match e {
                        Error::Conflict {
                            entity: "session", ..
                        } if snapshot => Ok(None),
                        e => Err(e),
                    };
                }
                (Err(e), Ok(_)) => {
                    let stored = self
                        .record_prompted_turn(session_id, &message, record.generation, instance, e)
                        .await?;
                    tracing::info!(session = %session_id, turn_id = %stored.id,
                        "message sent; the agent's turn started");
                    return Ok(Some(stored));
                }
            }
        } else {
            let committed = self.commit(change).await?;
            if !self.inner.sessions.has_pump(session_id) {
                // From the state before this turn: the turn is prompted just
                // below, the pump has no pending turn to settle.
                self.start_pump(&session, &record);
            }
            // Test-only crash point: the user message and the RUNNING state
            // are committed, the Prompt has not been sent (recovery
            // re-delivers it).
            #[cfg(feature = "failpoints")]
            fail::fail_point!("prompt-after-commit");
            self.inner.metrics.turn_started(session_id);
            (committed, prompt.await)
        };
        let stored = committed
            .messages
            .into_iter()
            .next()
            .ok_or_else(|| Error::Internal("no message".into()))?;
        let running = committed
            .session
            .ok_or_else(|| Error::Internal("no session".into()))?;
        if let Err(failed) = prompted {
            if Fencing(self).executor_refused(session_id, &failed) {
                // Another replica adopted the session: it settles this turn.
                return Err(Fencing(self).not_owner_now(session_id).await);
            }
            let e = Error::agent("Prompt", &failed);
            if self.agentctl_gone(&failed, &client).await {
                // agentctl itself is gone (killed, its container stopped):
                // that passes by itself, so the session is recovered in the
                // background like any lost agentctl, never left in ERROR.
                // The turn stays pending: the recovery settles it by the
                // journal, delivering it once if it reached no agent, so
                // the message is not to be sent again.
                if self
                    .prompt_found_agentctl_gone(&record, &e.to_string())
                    .await?
                {
                    tracing::warn!(session = %session_id, turn_id = %stored.id,
                        "message stored; its turn is delivered once agentctl is back");
                    return Ok(Some(stored));
                }
                return Err(Error::Unavailable(format!(
                    "the message did not reach the agent: its agentctl stopped answering ({e}) \
                     and cannot come back; the turn ended interrupted (see the session's \
                     error)"
                )));
            }
            if let Some(refused_by) = self.no_agent_ran_it(&failed, &client).await {
                // agentctl answers but runs no agent (it restarted unseen,
                // or its agent died with no one to notice): the turn reached
                // no agent. It stays pending, recorded as gone to the process
                // that refused it, whose journal never saw it; the session's
                // recovery relaunches the agent and delivers it once.
                let mut pending = running.clone();
                pending
                    .metadata
                    .insert(super::TURN_INSTANCE_KEY.into(), refused_by);
                self.inner.sessions.stop_pump(session_id);
                self.commit(Changeset::new().update_session(pending))
                    .await?;
                self.cache_update(session_id, |x| x.agent = AgentProcessState::NotRunning);
                tracing::warn!(session = %session_id, turn_id = %stored.id, error = %e,
                    "agentctl runs no agent; relaunching it, the message is delivered once it is up");
                self.spawn_agent_relaunch(session_id, format!("agentctl runs no agent ({e})"));
                return Ok(Some(stored));
            }
            self.inner
                .metrics
                .turn_ended(session_id, crate::metrics::TurnOutcome::Failed);
            let reason = format!(
                "the agent did not accept the message: {e}; resume the session, then send it again"
            );
            // Never silent: the conversation says the turn did not run
            // through (a transport error leaves it unknown whether agentctl
            // took it, so it is not sent again; the user may retry).
            let (mut failed, ev) = transition(&running, SessionEvent::Failed, Some(reason))?;
            let why = format!("the agent did not accept the message: {e}");
            let mut change = crate::turn::interrupt_turn(
                self,
                &running,
                &turn_id,
                &why,
                Changeset::new(),
                &mut failed,
            )
            .await?
            .update_session(failed);
            if let Some(ev) = ev {
                change = change.event(session_id, ev);
            }
            self.commit(change).await?;
            return Err(e);
        }
        tracing::info!(session = %session_id, turn_id = %stored.id, "message sent; the agent's turn started");
        Ok(Some(stored))
    }

    /// A pipelined turn's commit failed (`failed`) but agentctl took its
    /// Prompt: the agent runs a turn the store does not have. A stale
    /// status snapshot (a version conflict) is read again and the turn
    /// committed on it; any other failure is reported, and the pump records
    /// the turn from agentctl's stream (`TurnStarted`) once the store takes
    /// it. The caller holds the session lock.
    async fn record_prompted_turn(
        &self,
        session_id: SessionId,
        message: &Message,
        generation: i64,
        instance: String,
        failed: Error,
    ) -> Result<Message> {
        let stored = || async {
            // Recorded meanwhile from agentctl's stream (by the replica
            // that took the session over, say).
            self.inner.store.get_message(session_id, message.id).await
        };
        let again = async {
            if let Some(m) = stored().await? {
                return Ok(m);
            }
            if !matches!(failed, Error::Conflict { .. }) {
                return Err(failed);
            }
            let fresh = self.inner.store.get_session(session_id).await?;
            if fresh.state != SessionState::WaitingForInput {
                return stored().await?.ok_or(failed);
            }
            let change = turn_start_change(&fresh, message, generation, instance)?;
            let committed = self.commit(change).await?;
            committed
                .messages
                .into_iter()
                .next()
                .ok_or_else(|| Error::Internal("no message".into()))
        }
        .await;
        again.map_err(|e| {
            tracing::warn!(session = %session_id, turn_id = %message.id, error = %e,
                "the agent took the message but storing it failed; the update pump records it");
            // Not the conflict's own advice ("retry"): sending it again
            // would run it twice.
            let why = match e {
                Error::Conflict { .. } => {
                    "the session changed meanwhile: another replica took it over, or its \
                     update pump wrote first"
                        .to_owned()
                }
                e => e.to_string(),
            };
            Error::Unavailable(format!(
                "the message reached the agent, but storing it failed ({why}); sessiond records \
                 it (message {}) from agentctl's stream as soon as the store takes it: read the \
                 session's messages before sending it again (a send with the same request_id \
                 answers with this message instead of sending it twice)",
                message.id
            ))
        })
    }

    /// A failed call came from agentctl being gone rather than from an
    /// answer: no answer came, and `Health` fails as well.
    pub(crate) async fn agentctl_gone(
        &self,
        failed: &sessiond_executor::Error,
        client: &sessiond_executor::AgentctlClient,
    ) -> bool {
        if failed.failure() != sessiond_executor::Failure::NoAnswer {
            return false;
        }
        !matches!(
            tokio::time::timeout(self.inner.config.executor_deadline, client.health()).await,
            Ok(Ok(_))
        )
    }

    /// The Prompt was refused because agentctl runs no agent, as its
    /// `Health` confirms now: the instance that refused it (whose journal
    /// never took the turn), else `None`.
    async fn no_agent_ran_it(
        &self,
        failed: &sessiond_executor::Error,
        client: &sessiond_executor::AgentctlClient,
    ) -> Option<String> {
        if failed.failure() != sessiond_executor::Failure::FailedPrecondition {
            return None;
        }
        let limit = self.inner.config.executor_deadline;
        match tokio::time::timeout(limit, client.health()).await {
            Ok(Ok(h))
                if matches!(
                    h.agent_state,
                    sessiond_executor::AgentState::None | sessiond_executor::AgentState::Exited
                ) && !h.instance_id.is_empty() =>
            {
                Some(h.instance_id)
            }
            _ => None,
        }
    }

    /// The Prompt of a turn just started found agentctl gone: a remote
    /// executor reconnects in the background, a local one is recovered in
    /// the background, and either way the turn stays pending, settled by
    /// agentctl's journal once it is back (delivered once if it reached no
    /// agent, else interrupted; decision 0007). True when the turn is kept;
    /// false when the loss is a verdict (the container gone for good: the
    /// session ERROR, the turn interrupted). The caller holds the session
    /// lock.
    async fn prompt_found_agentctl_gone(
        &self,
        record: &ExecutorRecord,
        reason: &str,
    ) -> Result<bool> {
        let sid = record.session_id;
        tracing::warn!(session = %sid, executor_id = %record.id, %reason,
            "the message's Prompt found agentctl gone; recovering the session in the background");
        self.inner.sessions.stop_pump(sid);
        if record.runtime == Runtime::Remote {
            // The session is left as it is: the turn stays pending.
            self.commit(crate::changes::remote_lost(record, reason)?)
                .await?;
            self.cache_update(sid, |e| e.agent = AgentProcessState::NotRunning);
            self.spawn_reconnect(record.clone());
            return Ok(true);
        }
        let (change, retry) = self
            .agentctl_lost_change(record, reason, crate::flows::TurnInFlight::Settle)
            .await?;
        let committed = self.commit(change).await?;
        self.cache_update(sid, |e| e.agent = AgentProcessState::NotRunning);
        let kept = retry.is_some();
        if let Some(failed) = retry {
            self.spawn_retry(committed.executor.unwrap_or(failed), 0, reason.to_owned());
        }
        Ok(kept)
    }
}

/// The commit that starts turn `message` (a user message, its id the turn
/// id) on `session`, which waits for input (or is RUNNING this very turn,
/// as recovery left a turn it found only on agentctl: no state change
/// then): the message with its
/// `message.added`, the session RUNNING with the turn's durable record
/// (its id, the agentctl generation and `instance` it goes to), the queued
/// copy of the message taken off the queue if it was queued (delivered
/// once), the session named by its first prompt, and the task's
/// `work_started`. Shared by a turn sessiond starts and one it learns
/// about from agentctl's stream.
pub(crate) fn turn_start_change(
    session: &Session,
    message: &Message,
    generation: i64,
    instance: String,
) -> Result<Changeset> {
    let session_id = session.id;
    let turn_id = message.id.to_string();
    let runs_it =
        session.state == SessionState::Running && session.metadata.get(TURN_KEY) == Some(&turn_id);
    let (mut running, ev) = if runs_it {
        (session.clone(), None)
    } else {
        transition(session, SessionEvent::TurnStarted, None)?
    };
    running.metadata.insert(TURN_KEY.into(), turn_id.clone());
    running.metadata.insert(LAST_TURN_KEY.into(), turn_id);
    // Which agentctl generation got the Prompt: after a relaunch, only
    // the journal can tell whether it reached an agent.
    running
        .metadata
        .insert(TURN_GENERATION_KEY.into(), generation.to_string());
    if instance.is_empty() {
        running.metadata.remove(TURN_INSTANCE_KEY);
    } else {
        running.metadata.insert(TURN_INSTANCE_KEY.into(), instance);
    }
    // A new turn: the interrupted one before it can no longer be retried.
    running.metadata.remove(INTERRUPTED_TURN_KEY);
    running.metadata.remove(super::CANCEL_KEY);
    let mut change = Changeset::new();
    if sessiond_domain::queue::remove(&mut running.metadata, message.id).is_some() {
        change = change.event(
            session_id,
            EventPayload::QueueChanged(sessiond_domain::queue::queued(&running.metadata)),
        );
    }
    let mut change = change
        .add_message(message.clone())
        .event(session_id, EventPayload::MessageAdded(message.clone()))
        .update_session(running);
    // The first prompt names an unnamed session, in the same commit.
    let title = sessiond_domain::prompt_title(&message.content);
    if session.title.is_empty() && !title.is_empty() {
        change = change.set_title(session_id, title, sessiond_domain::TitleSource::Prompt);
    }
    if let Some(ev) = ev {
        change = change.event(session_id, ev);
    }
    Ok(change.task_event(session.task_id, TaskEvent::WorkStarted))
}

/// Runs a pipelined turn's commit and Prompt together. With failpoints, a
/// crash test can put them in order: `prompt-after-commit` commits first
/// (a crash there leaves the turn stored and never sent), and
/// `prompt-before-commit` prompts first (a crash there leaves a turn that
/// runs with no record).
async fn pipeline<C, P>(commit: C, prompt: P) -> (C::Output, P::Output)
where
    C: std::future::Future,
    P: std::future::Future,
{
    #[cfg(feature = "failpoints")]
    {
        let armed = |name: &str| fail::list().iter().any(|(n, _)| n == name);
        if armed("prompt-after-commit") {
            let committed = commit.await;
            fail::fail_point!("prompt-after-commit");
            return (committed, prompt.await);
        }
        if armed("prompt-before-commit") {
            let prompted = prompt.await;
            fail::fail_point!("prompt-before-commit");
            return (commit.await, prompted);
        }
    }
    tokio::join!(commit, prompt)
}

/// The user message of the session's interrupted turn that a retry runs
/// again: `message` if it names that turn, else the turn `interrupted`
/// names; an error a user can act on otherwise.
fn interrupted_turn_message(
    session_id: SessionId,
    message: Option<MessageId>,
    interrupted: Option<String>,
    msgs: &[Message],
) -> Result<Message> {
    match (message, interrupted) {
        (Some(m), interrupted) => {
            let Some(found) = msgs.iter().find(|x| x.id == m) else {
                return Err(Error::NotFound {
                    entity: "message",
                    id: format!("{m} (in session {session_id})"),
                });
            };
            if found.role != MessageRole::User {
                return Err(Error::InvalidArgument(format!(
                    "message_id: message {m} is a {} message; name the user message of the interrupted turn",
                    found.role
                )));
            }
            if interrupted.as_deref() != Some(m.to_string().as_str()) {
                return Err(Error::TurnNotInterrupted {
                    session_id,
                    detail: match interrupted {
                        Some(_) => format!(
                            "message {m} is not the session's interrupted turn (only the last turn can be retried)"
                        ),
                        None => format!(
                            "the turn of message {m} did not end interrupted, or a later message was sent"
                        ),
                    },
                });
            }
            Ok(found.clone())
        }
        (None, Some(turn)) => msgs
            .iter()
            .find(|x| x.role == MessageRole::User && x.id.to_string() == turn)
            .cloned()
            .ok_or_else(|| {
                Error::Internal(format!(
                    "interrupted turn {turn} has no stored user message"
                ))
            }),
        (None, None) => Err(Error::TurnNotInterrupted {
            session_id,
            detail: "its last turn did not end interrupted".into(),
        }),
    }
}
