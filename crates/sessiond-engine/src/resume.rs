//! Explicit resume (docs/decisions/0012-resuming-a-conversation.md): validate, then one
//! attempt per session however many callers ask (single-flight, shared with
//! a startup or background recovery of the same session).
//!
//! Executor resume and agent resume are separate: when agentctl
//! is healthy but the agent cannot be resumed, the session goes ERROR and the
//! executor stays `ready`, so shell, files and git keep working. The executor
//! goes `error` only when agentctl itself could not be brought back.
//!
//! After its intent (session STARTING, a RUNNING session's turn kept), a
//! resume is a recovery of the session: the domain's `Recovery` step
//! machine decides, as after a restart (`recovery.rs`, lane `Resume`: the
//! agent is resumed whatever the resume policy, in one attempt); the
//! outcome is the caller's answer.

use std::path::Path;

use futures::FutureExt;
use sessiond_domain::{
    AgentProcessState, OutcomeLabel, RecoveryFailure, ResumeRefused, Runtime, Session,
    SessionEvent, SessionId, SessionState, SessionStatus, TaskId, check_resume,
};
use sessiond_executor::ExecutorHandle;
use sessiond_store::Changeset;

use crate::{
    changes::transition,
    error::{Error, Result},
    flows::RecoverFirst,
    manager::SessionManager,
    ops::Agents,
    recovery::ExecutorRecovery,
    recovery::Pass,
    sessions::{OpKind, OpOutcome},
    worktrees::Worktrees,
};

impl SessionManager {
    /// Resumes a session on request. Concurrent calls (and a call racing a
    /// recovery of the same session) share one attempt and its outcome.
    ///
    /// Validation errors, in order: [`Error::NotFound`], [`Error::WrongTask`],
    /// [`Error::SessionEnded`], [`Error::NotResumable`],
    /// [`Error::MissingResumeToken`], [`Error::WorktreeMissing`]. A session
    /// whose agent already runs is returned as it is. A remote host that
    /// does not answer (inside its reconnect window) is
    /// [`Error::Unavailable`]: the reconnect goes on in the background and
    /// resumes the session by itself once the host answers.
    pub async fn resume_session(&self, task: TaskId, session: SessionId) -> Result<SessionStatus> {
        self.to_completion(move |m| async move { m.resume_session_inner(task, session).await })
            .await
    }

    async fn resume_session_inner(
        &self,
        task: TaskId,
        session: SessionId,
    ) -> Result<SessionStatus> {
        let s = self.session_of_task(task, session).await?;
        // Not recovered yet since the restart: recovery first (it may well
        // resume the agent itself), then decide.
        self.ensure_recovered(session).await?;
        if let Some((kind, fut)) = self.inner.sessions.inflight(session) {
            let out = fut.await;
            if let Some(answer) = Resume(self).joined_answer(task, session, kind, out).await {
                return answer;
            }
        }
        let s = self.inner.store.get_session(s.id).await?;
        if Resume(self).worktree_gone_under_its_agent(&s) {
            return Resume(self).bring_back_worktree_and_agent(task, &s).await;
        }
        if !Resume(self).validate_resume(&s).await? {
            // The agent is running or being started. If an attempt began
            // after the check above, its outcome is the answer every caller
            // shares; otherwise read the session again, as that attempt
            // (if any) left it.
            if let Some((kind, fut)) = self.inner.sessions.inflight(session) {
                let out = fut.await;
                if let Some(answer) = Resume(self).joined_answer(task, session, kind, out).await {
                    return answer;
                }
            }
            return self.session_status(task, session).await;
        }
        let me = self.clone();
        let (kind, fut) = self.single_flight(
            session,
            OpKind::Resume,
            async move {
                Resume(&me)
                    .resume_attempt(session)
                    .await
                    .map(|s| OpOutcome::Resume(Box::new(s)))
            }
            .boxed(),
        );
        let out = fut.await;
        match Resume(self).joined_answer(task, session, kind, out).await {
            Some(answer) => answer,
            None => self.session_status(task, session).await,
        }
    }
}

/// An explicit resume (ResumeSession): validated, its intent committed,
/// then driven through the same recovery as startup's.
pub(crate) struct Resume<'m>(pub(crate) &'m crate::manager::SessionManager);

impl std::ops::Deref for Resume<'_> {
    type Target = crate::manager::SessionManager;

    fn deref(&self) -> &Self::Target {
        self.0
    }
}

impl Resume<'_> {
    /// The session's agent runs (or is being started) in a worktree sessiond
    /// made on this host whose directory is gone: the agent works in a
    /// directory that no longer exists, and each workspace call fails.
    fn worktree_gone_under_its_agent(&self, s: &Session) -> bool {
        s.runtime == Runtime::LocalStandalone
            && s.worktree.is_managed()
            && s.metadata
                .contains_key(crate::worktrees::WORKTREE_CREATED_KEY)
            && !s.state.is_terminal()
            && !Path::new(&s.worktree.path).is_dir()
            && self
                .execution(s.id)
                .is_some_and(|e| e.agent != AgentProcessState::NotRunning)
    }

    /// Stops the agent and has recovery check the worktree out again from
    /// its branch and bring the agent back there, as it does after the
    /// agent's own exit (helper-38 6); answers once that is done (or the
    /// agent's start allowance passed: the status then says it recovers).
    async fn bring_back_worktree_and_agent(
        &self,
        task: TaskId,
        s: &Session,
    ) -> Result<SessionStatus> {
        if let Some(record) = self.inner.store.get_executor_for_session(s.id).await? {
            Agents(self).stop_agent_quietly(&record).await;
        }
        self.spawn_agent_relaunch(
            s.id,
            "its worktree directory was removed; it is checked out again from its branch".into(),
        );
        let deadline = tokio::time::Instant::now() + self.inner.config.agent_initialize_timeout;
        while self.recovery().is_bringing_back(s.id) && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        self.session_status(task, s.id).await
    }

    /// What a caller who joined an operation answers: the resume's outcome,
    /// or a recovery's when that recovery tried the agent. `None`: the
    /// recovery did not try the agent, decide anew.
    async fn joined_answer(
        &self,
        task: TaskId,
        session: SessionId,
        kind: OpKind,
        out: Result<OpOutcome>,
    ) -> Option<Result<SessionStatus>> {
        match (kind, out) {
            (_, Ok(OpOutcome::Resume(status))) => Some(Ok(*status)),
            (OpKind::Resume, Err(e)) => Some(Err(e)),
            (_, Ok(OpOutcome::Recovery(label))) => match label {
                label if label.agent_back() => Some(self.session_status(task, session).await),
                OutcomeLabel::ResumeFailed => {
                    let reason = match self.inner.store.get_session(session).await {
                        Ok(s) => s.error_message.unwrap_or_default(),
                        Err(e) => return Some(Err(e.into())),
                    };
                    Some(Err(Error::ResumeFailed {
                        session_id: session,
                        reason,
                    }))
                }
                _ => None,
            },
            (OpKind::Recovery, Err(_)) => None,
        }
    }

    /// True when a resume should run; false when the agent already runs (or
    /// is being started). Errors name what makes the session unresumable.
    async fn validate_resume(&self, s: &Session) -> Result<bool> {
        let status = crate::manager::status_of(self, s).await?;
        let go = match check_resume(&status) {
            Ok(go) => go,
            Err(ResumeRefused::SessionEnded(state)) => {
                return Err(Error::SessionEnded {
                    session_id: s.id,
                    state,
                });
            }
            Err(refused @ (ResumeRefused::NotResumable | ResumeRefused::ExecutorGone)) => {
                return Err(Error::NotResumable {
                    session_id: s.id,
                    reason: refused.to_string(),
                });
            }
            Err(ResumeRefused::MissingResumeToken) => {
                return Err(Error::MissingResumeToken { session_id: s.id });
            }
        };
        // A remote host's is restored once its agentctl answers (below).
        if go
            && s.worktree.is_managed()
            && s.runtime != Runtime::Remote
            && !Path::new(&s.worktree.path).is_dir()
        {
            // Ours: recreated from its branch, or refused naming the branch.
            let driver = Agents(self).driver(s.runtime)?;
            let anew = match Worktrees(self).restore_worktree(&driver, s).await {
                Ok(anew) => anew,
                Err(e) => {
                    if e.kind() == crate::ErrorKind::FailedPrecondition {
                        self.record_unrecoverable_worktree(s, &e).await;
                    }
                    return Err(e);
                }
            };
            if anew
                && s.runtime == Runtime::LocalDocker
                && let Some(record) = self.inner.store.get_executor_for_session(s.id).await?
            {
                // Its container has the removed directory mounted.
                driver.stop(&ExecutorHandle::from_record(&record)).await?;
            }
        }
        if go && s.runtime != Runtime::Remote && !Path::new(&s.worktree.path).is_dir() {
            return Err(Error::WorktreeMissing {
                session_id: s.id,
                path: s.worktree.path.clone(),
            });
        }
        Ok(go)
    }

    /// A resume refused because an ERROR session's worktree cannot be
    /// brought back (its branch is gone): its message says so from now on,
    /// as startup recovery's does, instead of still telling the user to
    /// resume. Optimistic (the version read): a session changed meanwhile
    /// keeps what it has.
    async fn record_unrecoverable_worktree(&self, s: &Session, e: &Error) {
        if s.state != SessionState::Error {
            return;
        }
        let reason = RecoveryFailure::WorktreeUnrecoverable {
            reason: e.to_string(),
        }
        .message();
        if s.error_message.as_deref() == Some(reason.as_str()) {
            return;
        }
        let recorded = async {
            let (next, ev) = transition(s, SessionEvent::Failed, Some(reason))?;
            let mut change = Changeset::new().update_session(next);
            if let Some(ev) = ev {
                change = change.event(s.id, ev);
            }
            self.commit(change).await
        }
        .await;
        if let Err(e) = recorded {
            tracing::debug!(session = %s.id, error = %e, "could not record the worktree's failure");
        }
    }

    /// The one resume attempt of a session.
    async fn resume_attempt(&self, session_id: SessionId) -> Result<SessionStatus> {
        let guard = self.inner.sessions.lock(session_id).await;
        let store = &self.inner.store;
        let session = store.get_session(session_id).await?;
        if !self.validate_resume(&session).await? {
            return crate::manager::status_of(self, &session).await;
        }
        // An ERROR session may still name a turn an older version left
        // pending: it ends interrupted before the resume, never carried
        // into the resumed session.
        let session = Pass(self).settle_stale_turn(session).await?;
        let Some(record) = store.get_executor_for_session(session_id).await? else {
            return Err(Error::InvalidState {
                session_id,
                state: session.state,
                action: "resume",
                hint: "the session has no executor any more; create a new session",
            });
        };
        if session.resume_token.is_none() {
            return Err(Error::MissingResumeToken { session_id });
        }
        // Intent: session STARTING (a RUNNING session's turn kept). From
        // here it is recovery's: the step machine brings agentctl back and
        // resumes the agent, as after a restart, and a crash from here on
        // is finished by the next recovery the same way.
        let (starting, ev) = transition(&session, SessionEvent::ResumeRequested, None)?;
        let mut change = Changeset::new().update_session(starting);
        if let Some(ev) = ev {
            change = change.event(session_id, ev);
        }
        self.commit(change).await?;
        self.cache_update(session_id, |e| e.agent = AgentProcessState::Starting);
        // Test-only crash point: the resume's intent (session STARTING, a
        // RUNNING session's turn kept) is committed, nothing else ran.
        #[cfg(feature = "failpoints")]
        fail::fail_point!("resume-after-intent");
        drop(guard);

        let label = ExecutorRecovery(self)
            .recover_one((&record).into(), crate::pass::Lane::Resume, None)
            .await?;
        // A user took over: any background retry of this session is moot.
        if label != OutcomeLabel::Retrying {
            self.inner.agent_recoveries.clear(session_id);
        }
        let session = store.get_session(session_id).await?;
        let record = store.get_executor_for_session(session_id).await?;
        let executor_error = record.as_ref().and_then(|r| r.error_message.clone());
        let reason = || {
            session
                .error_message
                .clone()
                .or_else(|| executor_error.clone())
                .unwrap_or_else(|| format!("recovery ended {label}"))
        };
        match label {
            OutcomeLabel::Resumed
            | OutcomeLabel::Opened
            | OutcomeLabel::Reattached
            | OutcomeLabel::ExecutorOnly => crate::manager::status_of(self, &session).await,
            OutcomeLabel::Retrying => {
                let remote = record
                    .as_ref()
                    .is_some_and(|r| r.runtime == Runtime::Remote);
                let (how, until) = if remote {
                    (
                        "reconnecting",
                        format!(
                            " (for up to {:?} after the host was last seen)",
                            self.inner.config.remote_retry_window
                        ),
                    )
                } else {
                    ("retrying", String::new())
                };
                Err(Error::Unavailable(format!(
                    "{}; {how} in the background: the session resumes by itself once it \
                     answers{until}, no need to call again",
                    executor_error.unwrap_or_else(|| "the executor does not answer".into()),
                )))
            }
            OutcomeLabel::ExecutorError
                if executor_error
                    .as_deref()
                    .is_some_and(|m| m.starts_with(RecoveryFailure::ContainerMissing.code())) =>
            {
                if let Some(record) = &record {
                    let driver = Agents(self).driver(record.runtime)?;
                    ExecutorRecovery(self)
                        .remove_gone_executor(&driver, &ExecutorHandle::from_record(record))
                        .await;
                }
                Err(Error::NotResumable {
                    session_id,
                    reason: ResumeRefused::ExecutorGone.to_string(),
                })
            }
            // The stored error is `not_resumable: <this text>`: the code
            // once, in the status's reason, not again inside the message.
            OutcomeLabel::NotResumable => Err(Error::NotResumable {
                session_id,
                reason: ResumeRefused::NotResumable.to_string(),
            }),
            OutcomeLabel::MissingResumeToken => Err(Error::MissingResumeToken { session_id }),
            OutcomeLabel::Stopped => Err(Error::SessionEnded {
                session_id,
                state: session.state,
            }),
            OutcomeLabel::ExecutorError | OutcomeLabel::ResumeFailed => Err(Error::ResumeFailed {
                session_id,
                reason: reason(),
            }),
        }
    }
}
