//! Explicit resume (docs/decisions/0012-resuming-a-conversation.md): validate, then one
//! attempt per session however many callers ask (single-flight, shared with
//! a startup or background recovery of the same session).
//!
//! Executor resume and agent resume are separate: when agentctl
//! is healthy but the agent cannot be resumed, the session goes ERROR and the
//! executor stays `ready`, so shell, files and git keep working. The executor
//! goes `error` only when agentctl itself could not be brought back.
//!
//! agentctl is brought back the way startup recovery does it: a Docker
//! executor is probed first (probing starts nothing), then the intent is
//! written, then the container is started (or launched); a standalone one
//! is relaunched after its intent. See [`Plan`].

use std::path::Path;

use chrono::Utc;
use futures::FutureExt;
use sessiond_domain::{
    AgentProcessState, EventPayload, ExecutorEvent, ExecutorRecord, ExecutorStatus, OutcomeLabel,
    RecoveryFailure, ResumeRefused, Runtime, Session, SessionEvent, SessionId, SessionStatus,
    TaskEvent, TaskId, check_resume,
};
use sessiond_executor::{ExecutorHandle, Probe};
use sessiond_store::Changeset;

use crate::{
    error::{Error, Result},
    manager::{SessionManager, executor_moved, transition},
    ops::{Resumed, load_refused, probe_verdict, recorded_process_alive},
    sessions::{OpKind, OpOutcome},
    turn::turn_in_flight,
};

/// How an explicit resume brings agentctl back, decided before anything is
/// written: only `Launch` and `Start` have side effects, and both run after
/// their intent (executor `starting`, generation + 1) is committed.
#[derive(Debug)]
enum Plan {
    /// agentctl answers as recorded.
    Healthy,
    /// Docker: the container runs and its agentctl answers; adopt what the
    /// probe found (port, secret), same generation.
    Reattach(Box<ExecutorHandle>),
    /// Docker: the container exists but is stopped; start it.
    Start,
    /// A new agentctl: a process (standalone) or a container (docker).
    Launch,
    /// Nothing can bring it back now (remote host down, engine unreachable).
    Unavailable(String),
    /// Docker: the container no longer exists; nothing ever will.
    Gone,
}

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
        let s = self.session_of_task(task, session).await?;
        // Not recovered yet since the restart: recovery first (it may well
        // resume the agent itself), then decide.
        self.ensure_recovered(session).await?;
        if let Some((kind, fut)) = self.inner.sessions.inflight(session) {
            let out = fut.await;
            if let Some(answer) = self.joined_answer(task, session, kind, out).await {
                return answer;
            }
        }
        let s = self.inner.store.get_session(s.id).await?;
        if !self.validate_resume(&s).await? {
            // The agent is running or being started. If an attempt began
            // after the check above, its outcome is the answer every caller
            // shares; otherwise read the session again, as that attempt
            // (if any) left it.
            if let Some((kind, fut)) = self.inner.sessions.inflight(session) {
                let out = fut.await;
                if let Some(answer) = self.joined_answer(task, session, kind, out).await {
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
                me.resume_attempt(session)
                    .await
                    .map(|s| OpOutcome::Resume(Box::new(s)))
            }
            .boxed(),
        );
        let out = fut.await;
        match self.joined_answer(task, session, kind, out).await {
            Some(answer) => answer,
            None => self.session_status(task, session).await,
        }
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
        let status = self.status_of(s).await?;
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
            let driver = self.driver(s.runtime)?;
            let anew = self.restore_worktree(&driver, s).await?;
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

    /// The one resume attempt of a session.
    async fn resume_attempt(&self, session_id: SessionId) -> Result<SessionStatus> {
        let _guard = self.lock_session(session_id).await;
        let store = &self.inner.store;
        let session = store.get_session(session_id).await?;
        if !self.validate_resume(&session).await? {
            return self.status_of(&session).await;
        }
        // An ERROR session may still name a turn an older version left
        // pending: it ends interrupted before the resume, never carried
        // into the resumed session.
        let session = self.settle_stale_turn(session).await?;
        let profile = crate::session_mcp::with_session_servers(
            store.get_agent_profile(session.agent_profile_id).await?,
            &session.metadata,
        );
        let Some(mut record) = store.get_executor_for_session(session_id).await? else {
            return Err(Error::InvalidState {
                session_id,
                state: session.state,
                action: "resume",
                hint: "the session has no executor any more; create a new session",
            });
        };
        let Some(token) = session.resume_token.clone() else {
            return Err(Error::MissingResumeToken { session_id });
        };
        // A turn the session was RUNNING: once the agent is back the session
        // returns to RUNNING and its update pump settles the turn
        // (re-delivering a prompt that never reached the agent).
        let turn = turn_in_flight(&session);
        let pending = turn.is_some();
        let no_turn_yet = self.no_turn_yet(&session).await?;
        let driver = self.driver(record.runtime)?;
        let limit = self.inner.config.executor_deadline;

        // Is the recorded agentctl alive, ours and answering?
        let handle = ExecutorHandle::from_record(&record);
        let process_ok = recorded_process_alive(&record).unwrap_or(true);
        let health = if process_ok && !record.auth_secret.is_empty() {
            Some(tokio::time::timeout(limit, driver.health(&handle)).await)
        } else {
            None
        };
        let healthy = matches!(health, Some(Ok(Ok(_))));
        // A remote host that does not answer at all (not one that answers
        // wrongly), inside its reconnect window (counted from its last sign
        // of life, never from before this backend's start): reconnected in
        // the background like a blip, not failed (see `reconnect_instead`).
        let reconnect = (record.runtime == Runtime::Remote
            && crate::recovery::window_open(
                &record,
                self.inner.config.remote_retry_window,
                Utc::now(),
                self.inner.started_at,
            ))
        .then(|| match &health {
            Some(Err(_)) => Some(format!("Health did not answer within {limit:?}")),
            Some(Ok(Err(e))) if e.is_unavailable() => Some(e.to_string()),
            _ => None,
        })
        .flatten();
        let plan = if healthy {
            Plan::Healthy
        } else {
            match record.runtime {
                Runtime::Remote => Plan::Unavailable(format!(
                    "remote agentctl at {} does not answer{}",
                    record.agentctl_url.as_deref().unwrap_or("?"),
                    match &health {
                        Some(Ok(Err(e))) => format!(" ({e})"),
                        Some(Err(_)) => format!(" within {limit:?}"),
                        _ => String::new(),
                    }
                )),
                Runtime::LocalStandalone => Plan::Launch,
                // Probe starts nothing: what it finds decides whether an
                // intent is written and which side effect follows it.
                Runtime::LocalDocker | Runtime::Custom(_) => {
                    match tokio::time::timeout(limit, driver.probe(&handle)).await {
                        Ok(Ok(Probe::Reattachable { handle, .. })) => {
                            Plan::Reattach(Box::new(handle))
                        }
                        Ok(Ok(Probe::NeedsStart { .. })) => Plan::Start,
                        Ok(Ok(Probe::NeedsLaunch { .. })) => Plan::Launch,
                        Ok(Ok(Probe::Missing { .. }))
                        | Ok(Err(sessiond_executor::Error::ContainerMissing { .. })) => Plan::Gone,
                        Ok(Err(e)) => Plan::Unavailable(e.to_string()),
                        Err(_) if record.runtime == Runtime::LocalDocker => Plan::Unavailable(
                            format!("the Docker engine did not answer within {limit:?}"),
                        ),
                        Err(_) => Plan::Unavailable(format!(
                            "the {} driver's probe did not answer within {limit:?}",
                            record.runtime
                        )),
                    }
                }
            }
        };

        // Intent: session STARTING and, if agentctl must be (re)started, the
        // executor `starting` with generation + 1, in one transaction.
        let (starting, ev) = transition(&session, SessionEvent::ResumeRequested, None)?;
        let mut change = Changeset::new();
        let mut relaunch_generation = None;
        if matches!(plan, Plan::Launch | Plan::Start) {
            let generation = record.generation + 1;
            relaunch_generation = Some(generation);
            let mut intent = executor_moved(&record, ExecutorEvent::LaunchIntent)?;
            intent.generation = generation;
            intent.error_message = None;
            change = change.update_executor(intent).event(
                session_id,
                EventPayload::AgentctlStarting {
                    executor_id: record.id,
                    runtime: record.runtime,
                    generation,
                },
            );
        }
        let mut starting = starting;
        if let Some(g) = relaunch_generation {
            starting.agent_execution_id = Some(format!("{}/{g}", record.id));
        }
        change = change.update_session(starting);
        if let Some(ev) = ev {
            change = change.event(session_id, ev);
        }
        let committed = self.commit(change).await?;
        let mut session = committed
            .session
            .ok_or_else(|| Error::Internal("no session".into()))?;
        if let Some(r) = committed.executor {
            record = r;
        }
        self.cache_update(session_id, |e| e.agent = AgentProcessState::Starting);
        // Test-only crash point: the resume's intent (session STARTING, a
        // RUNNING session's turn kept) is committed, nothing else ran.
        #[cfg(feature = "failpoints")]
        fail::fail_point!("resume-after-intent");

        // Executor.
        let executor = async {
            let handle = match (&plan, relaunch_generation) {
                (Plan::Healthy, _) => None,
                (Plan::Unavailable(reason), _) => {
                    return Err(Error::Unavailable(reason.clone()));
                }
                (Plan::Gone, _) => {
                    return Err(Error::NotResumable {
                        session_id,
                        reason: ResumeRefused::ExecutorGone.to_string(),
                    });
                }
                // The container runs and answers (at another port, say):
                // same generation, nothing was started.
                (Plan::Reattach(found), _) => Some((**found).clone()),
                (Plan::Start, Some(generation)) => {
                    let current = ExecutorHandle::from_record(&record);
                    match tokio::time::timeout(limit * 2, driver.start(&current, generation)).await
                    {
                        Ok(r) => Some(r?),
                        Err(_) => {
                            return Err(Error::Unavailable(format!(
                                "the container did not start within {:?}",
                                limit * 2
                            )));
                        }
                    }
                }
                (Plan::Launch, Some(generation)) => {
                    if recorded_process_alive(&record) == Some(true) {
                        // Ours (pid and start time match) but not answering: end it.
                        self.end_stray_agentctls(&record).await;
                    }
                    match self
                        .launch_agentctl(&record, &profile, generation, limit * 2)
                        .await
                    {
                        Some(r) => Some(r?),
                        None => {
                            return Err(Error::Unavailable(format!(
                                "agentctl did not start within {:?}",
                                limit * 2
                            )));
                        }
                    }
                }
                (Plan::Start | Plan::Launch, None) => {
                    return Err(Error::Internal("a relaunch without its intent".into()));
                }
            };
            // A remote host's agentctl restarted serves no worktree until
            // it restores it (its directory is not ours to look at).
            if record.runtime == Runtime::Remote && session.worktree.is_managed() {
                self.restore_worktree(&driver, &session).await?;
            }
            if let Some(handle) = handle {
                let mut r = record.clone();
                handle.apply_to(&mut r);
                record = self
                    .commit(Changeset::new().update_executor(r))
                    .await?
                    .executor
                    .ok_or_else(|| Error::Internal("no executor".into()))?;
            }
            let caps = driver
                .capabilities(&ExecutorHandle::from_record(&record))
                .await
                .ok();
            Ok::<_, Error>(caps.and_then(|c| probe_verdict(c.supports_session_resume)))
        }
        .await;

        let probe = match executor {
            Ok(p) => p,
            Err(_) if matches!(plan, Plan::Unavailable(_)) && reconnect.is_some() => {
                let reason = reconnect.unwrap_or_default();
                return Err(self.reconnect_instead(&session, &record, &reason).await?);
            }
            Err(e) => {
                let gone = matches!(plan, Plan::Gone);
                let reason = if gone {
                    // Said as recovery says it, so the status (not
                    // resumable) and the message agree.
                    self.remove_gone_executor(&driver, &ExecutorHandle::from_record(&record))
                        .await;
                    RecoveryFailure::ContainerMissing.message()
                } else {
                    format!("agentctl could not be started: {e}; resume the session to try again")
                };
                let mut failed = executor_moved(&record, ExecutorEvent::Failed)?;
                failed.error_message = Some(reason.clone());
                let (mut s2, ev) =
                    transition(&session, SessionEvent::Failed, Some(reason.clone()))?;
                let change = self
                    .interrupt_pending(&session, turn.as_deref(), &reason, &mut s2)
                    .await?;
                let mut change = change
                    .update_executor(failed)
                    .event(
                        session_id,
                        EventPayload::AgentctlError {
                            executor_id: record.id,
                            error_message: reason.clone(),
                        },
                    )
                    .update_session(s2);
                if let Some(ev) = ev {
                    change = change.event(session_id, ev);
                }
                self.commit(change).await?;
                self.cache_update(session_id, |e| e.agent = AgentProcessState::NotRunning);
                if gone {
                    return Err(e);
                }
                return Err(Error::ResumeFailed { session_id, reason });
            }
        };

        // Executor ready: workspace access on, whatever the agent does next.
        if record.status != ExecutorStatus::Ready || record.last_seen_at.is_none() {
            let was_ready = record.status == ExecutorStatus::Ready;
            let mut ready = executor_moved(&record, ExecutorEvent::Healthy)?;
            ready.error_message = None;
            ready.last_seen_at = Some(Utc::now());
            let mut change = Changeset::new().update_executor(ready);
            if !was_ready {
                change = change.event(
                    session_id,
                    EventPayload::AgentctlReady {
                        executor_id: record.id,
                        runtime: record.runtime,
                        supports_session_resume: if profile.supports_session_resume
                            && record.supports_session_resume
                        {
                            probe
                        } else {
                            Some(false)
                        },
                    },
                );
            }
            record = self
                .commit(change)
                .await?
                .executor
                .ok_or_else(|| Error::Internal("no executor".into()))?;
        }
        self.cache_update(session_id, |e| {
            e.agent = AgentProcessState::Starting;
            e.probe = probe;
        });

        // Agent: a launch slot of its host first (a caller waits: ahead of
        // background launches), then the launch and resume, cut only when
        // the agent stays silent (see `until_silent`).
        self.inner
            .agent_recoveries
            .enter(session_id, sessiond_domain::RecoveryStage::Queued);
        let permit = self
            .inner
            .launches
            .acquire(
                crate::launches::host_of(&record),
                session_id,
                crate::launches::Priority::Call,
            )
            .await;
        let began = std::time::Instant::now();
        let resumed = self
            .until_silent(
                &record,
                self.resume_agent(&record, &profile, &token, no_turn_yet),
            )
            .await
            .unwrap_or_else(|silence| Err(Error::Unavailable(silence)));
        permit.finish(match &resumed {
            Ok(_) => crate::launches::Ended::Up(began.elapsed()),
            Err(_) => crate::launches::Ended::Neutral,
        });
        // A user took over: any background retry of this session is moot.
        self.inner.agent_recoveries.clear(session_id);
        match resumed {
            Ok(resumed) => {
                let event = if pending {
                    SessionEvent::AgentFoundBusy
                } else {
                    SessionEvent::Resumed
                };
                let (mut s2, ev) = transition(&session, event, None)?;
                let mut token = token;
                let mut replaced = None;
                if let Resumed::Replaced {
                    token: new_token,
                    reason,
                } = resumed
                {
                    tracing::info!(session = %session_id, reason = %reason,
                        "resume: the agent had not kept the unprompted conversation; a new one replaces it");
                    s2.resume_token = Some(new_token.clone());
                    replaced = Some(EventPayload::ConversationReplaced {
                        previous_resume_token: token,
                        resume_token: new_token.clone(),
                        reason,
                    });
                    token = new_token;
                }
                let mut change = Changeset::new().update_session(s2);
                if let Some(ev) = replaced {
                    change = change.event(session_id, ev);
                }
                if let Some(ev) = ev {
                    change = change.event(session_id, ev);
                }
                if record.resume_token.as_deref() != Some(token.as_str()) {
                    let mut r = record.clone();
                    r.resume_token = Some(token.clone());
                    change = change.update_executor(r);
                }
                if !pending {
                    change = change.task_event(session.task_id, TaskEvent::ReadyForReview);
                }
                let committed = self.commit(change).await?;
                session = committed.session.unwrap_or(session);
                if let Some(r) = committed.executor {
                    record = r;
                }
                self.cache_update(session_id, |e| e.agent = AgentProcessState::Running);
                self.attach_updates(&session, &record);
                self.status_of(&session).await
            }
            Err(e) => {
                // The host went away after its Health (inside its window:
                // it was seen a moment ago): reconnected, not failed.
                if crate::recovery::window_open(
                    &record,
                    self.inner.config.remote_retry_window,
                    Utc::now(),
                    self.inner.started_at,
                ) && let Some(reason) = self.remote_host_gone(&record, Some(&e)).await
                {
                    return Err(self.reconnect_instead(&session, &record, &reason).await?);
                }
                self.stop_agent_quietly(&record).await;
                let reason = if load_refused(&e) {
                    // Another try fails the same way: say so.
                    RecoveryFailure::ConversationLost {
                        reason: e.to_string(),
                    }
                    .message()
                } else {
                    format!("resuming the agent failed: {e}; resume the session to try again")
                };
                let (mut s2, ev) =
                    transition(&session, SessionEvent::Failed, Some(reason.clone()))?;
                let change = self
                    .interrupt_pending(&session, turn.as_deref(), &reason, &mut s2)
                    .await?;
                let mut change = change.update_session(s2);
                if let Some(ev) = ev {
                    change = change.event(session_id, ev);
                }
                self.commit(change).await?;
                self.cache_update(session_id, |e| e.agent = AgentProcessState::NotRunning);
                Err(Error::ResumeFailed { session_id, reason })
            }
        }
    }
}

impl SessionManager {
    /// An explicit resume found the remote host unreachable (a transport
    /// failure, inside its reconnect window): treated as the blip the
    /// liveness check finds, not as a failed resume. The executor goes
    /// `error` with the `reconnecting:` code, so the background reconnect
    /// (started here) and a restart's recovery both take it up; the session
    /// keeps the resume's intent (STARTING, a RUNNING session's turn kept),
    /// so the recovery that reaches the host resumes it without another
    /// call, or, if the window closes first, fails it and ends its turn
    /// interrupted in the same commit. The caller answers UNAVAILABLE with
    /// the returned error, which says so.
    async fn reconnect_instead(
        &self,
        session: &Session,
        record: &ExecutorRecord,
        reason: &str,
    ) -> Result<Error> {
        let current = self.inner.store.get_executor(record.id).await?;
        let change = if current.status == ExecutorStatus::Error {
            // Reconnecting already (a restart or the liveness check found
            // it): only the message is refreshed.
            let mut r = current.clone();
            r.error_message = Some(
                RecoveryFailure::Reconnecting {
                    url: record.agentctl_url.clone().unwrap_or_default(),
                    reason: reason.to_owned(),
                }
                .message(),
            );
            Changeset::new().update_executor(r)
        } else {
            crate::recovery::remote_lost(&current, reason)?
        };
        let committed = self.commit(change).await?;
        let record = committed.executor.unwrap_or(current);
        self.inner.sessions.stop_pump(session.id);
        self.inner.sessions.cache_record(&record);
        self.cache_update(session.id, |e| e.agent = AgentProcessState::NotRunning);
        self.spawn_reconnect(record.clone());
        tracing::warn!(session = %session.id, executor_id = %record.id, reason,
            "resume: the remote host is unreachable; reconnecting in the background");
        Ok(Error::Unavailable(format!(
            "remote executor {} is unreachable ({reason}); reconnecting in the background: \
             the session resumes by itself once the host answers (for up to {:?} after it was \
             last seen), no need to call again",
            record.agentctl_url.as_deref().unwrap_or("?"),
            self.inner.config.remote_retry_window
        )))
    }

    /// The session was RUNNING `turn` when the resume began and now goes
    /// ERROR without its agent: no pump will settle that turn, so it ends
    /// interrupted in the same commit as the failure (see
    /// `turn::interrupt_turn`). Nothing to add without a pending turn.
    async fn interrupt_pending(
        &self,
        session: &Session,
        turn: Option<&str>,
        why: &str,
        next: &mut Session,
    ) -> Result<Changeset> {
        let Some(turn) = turn else {
            return Ok(Changeset::new());
        };
        let change =
            crate::turn::interrupt_turn(self, session, turn, why, Changeset::new(), next).await?;
        self.inner
            .metrics
            .turn_ended(session.id, crate::metrics::TurnOutcome::Interrupted);
        tracing::warn!(session = %session.id, turn, why,
            "resume failed: the pending turn ended interrupted");
        Ok(change)
    }
}
