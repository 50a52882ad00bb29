//! Settling a turn a restart left RUNNING: at most once (the rule is
//! `sessiond_domain::turn::settle`; docs/decisions/0007-at-most-once-turns.md).

use sessiond_domain::{
    MessageKind, MessageRole, SessionEvent, SessionId, TaskEvent,
    turn::{AgentNow, Redelivered, Redelivery, Settle, SettleFacts},
};
use sessiond_executor::AgentState;
use sessiond_proto::agentctl::v1 as pb;
use sessiond_store::Changeset;

use super::{
    CURSOR_KEY, TURN_GENERATION_KEY, TURN_INSTANCE_KEY, cursor_value, interrupt_turn, pending_turn,
    pump::Pump,
};
use crate::{
    changes::transition,
    error::{Error, Result},
    lease::Fencing,
    manager::SessionManager,
    turn::Turns,
};

impl Pump {
    /// Settles the pending turn once the pump has caught up.
    pub(super) async fn try_settle(&mut self) {
        let caught_up = self.target.is_some_and(|t| self.cursor >= t);
        if !caught_up {
            return;
        }
        let Some(turn) = self.settle.take() else {
            return;
        };
        if let Err(e) = self.settle_pending(&turn).await {
            tracing::warn!(session = %self.session_id, %turn, error = %e, "could not settle the pending turn");
        }
        self.note_settling();
    }

    /// Keeps the manager's `settling` count in step with `settle`.
    pub(super) fn note_settling(&mut self) {
        let now = self.settle.is_some();
        if now == self.settling {
            return;
        }
        self.settling = now;
        count_settling(&self.mgr, self.session_id, now);
    }
}

/// One settler of `session` more (`up`) or fewer in the manager's
/// `settling`, which [`Turns::turn_settled`] waits on.
fn count_settling(mgr: &SessionManager, session: SessionId, up: bool) {
    mgr.inner.settling.send_modify(|settlers| {
        if up {
            *settlers.entry(session).or_default() += 1;
        } else if let Some(n) = settlers.get_mut(&session) {
            *n -= 1;
            if *n == 0 {
                settlers.remove(&session);
            }
        }
    });
}

/// A turn a restart left RUNNING, counted as settling while held: by a
/// recovery from before it shows the agent back (and wakes the calls that
/// wait for it) until the pump it starts, which settles the turn, counts
/// itself. A retry woken in between found the turn RUNNING with no
/// settler yet, and was refused as if a reply were coming (helper-63: two
/// retries both refused, and the turn never ran again).
pub(crate) struct SettlingHold {
    mgr: SessionManager,
    session: SessionId,
}

impl SettlingHold {
    pub(crate) fn new(mgr: &SessionManager, session: SessionId) -> Self {
        count_settling(mgr, session, true);
        Self {
            mgr: mgr.clone(),
            session,
        }
    }
}

impl Drop for SettlingHold {
    fn drop(&mut self) {
        count_settling(&self.mgr, self.session, false);
    }
}

impl Drop for Pump {
    fn drop(&mut self) {
        self.settle = None;
        self.note_settling();
    }
}

impl crate::turn::Turns<'_> {
    /// Waits, at most `limit`, while the session's pump settles a turn a
    /// restart left RUNNING (helper-59 1: a retry right after the agent
    /// came back found the turn RUNNING, and was told to wait for a reply
    /// that never came; the pump ended it interrupted a moment later).
    pub(crate) async fn turn_settled(&self, session: SessionId, limit: std::time::Duration) {
        if !self.inner.settling.borrow().contains_key(&session) {
            return;
        }
        let mut pumps = self.inner.settling.subscribe();
        let _ = tokio::time::timeout(limit, pumps.wait_for(|p| !p.contains_key(&session))).await;
    }
}

impl Pump {
    /// The session is RUNNING turn `turn`, everything agentctl had when the
    /// pump started has been applied, and no `TurnEnded` of the turn came.
    /// The decision table (docs/decisions/0007-at-most-once-turns.md): at
    /// most once; delivered again only when agentctl's journal
    /// proves the prompt never reached an agent; otherwise, when it is not
    /// known whether the agent ran it, the turn ends *interrupted* (the
    /// reply kept as stored, with a note; a system message says so).
    ///
    /// - agentctl not answering, its agent not idle, or updates not all read
    ///   yet (its `latest_cursor` is past ours): wait (a `TurnEnded` may
    ///   still come; this runs again).
    /// - agentctl runs no agent (a remote host restarted its agentctl while
    ///   we ran): as the agent's exit, interrupted and the session ERROR.
    /// - a reply stored for the turn, or agentctl keeps no journal, or its
    ///   journal is fresh while the turn went to another agentctl
    ///   generation: interrupted.
    /// - else Prompt again with the same `turn_id` and `only_if_journaled`:
    ///   - not known to the journal: delivered now (exactly once);
    ///   - accepted by this agentctl process: its `TurnEnded` is on the
    ///     stream ahead of us, wait; or it was lost in a gap: interrupted;
    ///   - handed to an agent by an earlier process: interrupted;
    ///   - refused for lack of a journal: interrupted.
    pub(super) async fn settle_pending(&mut self, turn: &str) -> Result<()> {
        let guard = self.mgr.inner.sessions.lock(self.session_id).await;
        let store = &self.mgr.inner.store;
        let session = store.get_session(self.session_id).await?;
        if pending_turn(&session).as_deref() != Some(turn) {
            return Ok(()); // its TurnEnded came, or the session moved on
        }
        let limit = self.mgr.inner.config.executor_deadline;
        let Ok(Ok(h)) = tokio::time::timeout(limit, self.client.health()).await else {
            return Ok(()); // agentctl not answering: the stream handling decides
        };
        let state = h.agent_state;
        let agent = match state {
            AgentState::None | AgentState::Exited => AgentNow::NoAgent,
            AgentState::Ready => AgentNow::Idle,
            _ => AgentNow::Busy,
        };
        let unread_updates = h.instance_id == self.instance && h.latest_cursor > self.cursor;
        // Messages and the executor are read only when the answer depends on them.
        let reads_messages = agent == AgentNow::Idle && !unread_updates;
        let (user, reply_stored) = if reads_messages {
            let msgs = store.list_messages(self.session_id, 0, u32::MAX).await?;
            let user = msgs
                .iter()
                .find(|m| m.role == MessageRole::User && m.id.to_string() == turn)
                .cloned();
            // Any part of the turn's work counts (a tool call proves the
            // prompt reached the agent); session-wide parts (commands,
            // mode) do not.
            let reply = user.as_ref().is_some_and(|u| {
                msgs.iter().any(|m| {
                    m.role == MessageRole::Agent
                        && m.seq > u.seq
                        && matches!(
                            m.kind,
                            MessageKind::Text
                                | MessageKind::ToolCall
                                | MessageKind::Plan
                                | MessageKind::Thought
                                | MessageKind::Permission
                                | MessageKind::Terminal
                                | MessageKind::Unparsed
                        )
                })
            });
            (user, reply || self.pending.is_some())
        } else {
            (None, false)
        };
        let same_generation = session
            .metadata
            .get(TURN_GENERATION_KEY)
            .is_none_or(|g| g.parse::<i64>().ok() == Some(self.generation));
        let remote = reads_messages
            && store
                .get_executor_for_session(self.session_id)
                .await?
                .is_some_and(|r| r.runtime == sessiond_domain::Runtime::Remote);
        // The agentctl process known alive before the Prompt answers now:
        // it held the address all along, so any Prompt of the turn went to
        // it and its journal (fresh or not) covers the turn.
        let same_instance = !h.instance_id.is_empty()
            && session.metadata.get(TURN_INSTANCE_KEY) == Some(&h.instance_id);
        let facts = SettleFacts {
            agent,
            unread_updates,
            user_message_stored: user.is_some(),
            reply_stored,
            journaled: h.journaled,
            journal_fresh: h.journal_fresh,
            same_instance,
            same_generation,
            remote,
        };
        let user = match sessiond_domain::turn::settle(&facts) {
            Settle::Wait => {
                tracing::debug!(session = %self.session_id, turn, ?state, "pending turn: agent not idle, waiting for its TurnEnded");
                return Ok(());
            }
            Settle::ReadOn => {
                // The turn may have ended after we last looked: read on first.
                self.settle = Some(turn.to_owned());
                self.target = Some(h.latest_cursor);
                return Ok(());
            }
            Settle::AgentExited => {
                // No agent in this agentctl (a remote host restarted its
                // agentctl while we ran): nothing will end the turn, and the
                // agent counts as running until told.
                drop(guard);
                tracing::warn!(session = %self.session_id, turn, ?state,
                    "pending turn: agentctl runs no agent; ending the turn as the agent's exit");
                return self.agent_exited(h.agent_exit.as_ref()).await;
            }
            Settle::Interrupt(why) => {
                drop(guard);
                return self.end_interrupted(turn, why.why()).await;
            }
            Settle::Redeliver => match user {
                Some(user) => user,
                None => return Err(Error::Internal("redelivery without a user message".into())),
            },
        };
        let prompted = self
            .client
            .prompt(pb::PromptRequest {
                text: user.content.clone(),
                turn_id: turn.to_owned(),
                only_if_journaled: true,
                blocks: crate::attachments::stored_blocks(&user.data, &session.worktree.path),
            })
            .await;
        match prompted {
            Ok(r) => {
                let answer = Redelivery {
                    already_accepted: r.already_accepted,
                    by_this_process: r.accepted_by_instance == h.instance_id,
                    turn_ended: r.turn_ended,
                    end_already_read: r.end_cursor <= self.cursor,
                };
                match sessiond_domain::turn::redelivered(&answer) {
                    Redelivered::Delivered => {
                        tracing::info!(session = %self.session_id, turn,
                            "pending turn had not reached an agent (agentctl's journal); delivered it once");
                        Ok(())
                    }
                    Redelivered::WaitForEnd => {
                        // Its TurnEnded is ahead on this live stream (an
                        // agentctl restart or a gap settles again).
                        tracing::info!(session = %self.session_id, turn, ended = r.turn_ended,
                            "pending turn is agentctl's current one; waiting for its TurnEnded");
                        Ok(())
                    }
                    Redelivered::Interrupt(why) => {
                        drop(guard);
                        self.end_interrupted(turn, why.why()).await
                    }
                }
            }
            // A superseded lease: the new owner settles the turn.
            Err(e) if Fencing(&self.mgr).executor_refused(self.session_id, &e) => Ok(()),
            Err(e) if e.failure() == sessiond_executor::Failure::FailedPrecondition => {
                drop(guard);
                self.end_interrupted(turn, &e.answer()).await
            }
            // agentctl is gone, not refusing: the turn stays pending and
            // this stream's failure recovers the session in the background
            // (`agentctl_lost`), which settles the turn.
            Err(e) if Turns(&self.mgr).agentctl_gone(&e, &self.client).await => {
                drop(guard);
                tracing::info!(session = %self.session_id, turn, error = %e,
                    "re-delivery found agentctl gone; left to the lost-agentctl recovery");
                Ok(())
            }
            Err(e) => {
                let e = crate::error::Error::agent("Prompt", &e);
                let reason = format!(
                    "the agent did not accept the message: {e}; resume the session, then send it again"
                );
                let (mut failed, ev) = transition(&session, SessionEvent::Failed, Some(reason))?;
                let why = format!("the agent did not accept the message: {e}");
                let mut change = interrupt_turn(
                    &self.mgr,
                    &session,
                    turn,
                    &why,
                    Changeset::new(),
                    &mut failed,
                )
                .await?
                .update_session(failed);
                if let Some(ev) = ev {
                    change = change.event(self.session_id, ev);
                }
                self.mgr.commit(change).await?;
                self.mgr
                    .inner
                    .metrics
                    .turn_ended(self.session_id, crate::metrics::TurnOutcome::Failed);
                Ok(())
            }
        }
    }

    /// Ends turn `turn` *interrupted*: what is stored of its reply is kept
    /// and completed with [`INTERRUPTED_NOTE`](super::INTERRUPTED_NOTE), a system message saying so
    /// is added (with its `message.added` event), and the session waits for
    /// input. One commit; each message changed once.
    pub(super) async fn end_interrupted(&mut self, turn: &str, why: &str) -> Result<()> {
        if self.pending.is_some() {
            self.flush(false).await?;
        }
        self.pending = None;
        let _guard = self.mgr.inner.sessions.lock(self.session_id).await;
        let store = &self.mgr.inner.store;
        let session = store.get_session(self.session_id).await?;
        if pending_turn(&session).as_deref() != Some(turn) {
            return Ok(());
        }
        let (mut next, ev) = transition(&session, SessionEvent::TurnEnded, None)?;
        let mut change =
            interrupt_turn(&self.mgr, &session, turn, why, Changeset::new(), &mut next).await?;
        next.metadata.insert(
            CURSOR_KEY.into(),
            cursor_value(self.generation, self.cursor, &self.instance),
        );
        if let Some(ev) = ev {
            change = change.event(self.session_id, ev);
        }
        change = change
            .update_session(next)
            .task_event(self.task_id, TaskEvent::ReadyForReview);
        self.mgr.commit(change).await?;
        self.mgr
            .inner
            .metrics
            .turn_ended(self.session_id, crate::metrics::TurnOutcome::Interrupted);
        tracing::warn!(session = %self.session_id, turn, why,
            "pending turn ended interrupted; not sent again (at most once)");
        Ok(())
    }
}
