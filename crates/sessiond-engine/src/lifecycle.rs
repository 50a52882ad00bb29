//! Creating sessions, sending messages, ending and deleting sessions.

use std::{collections::BTreeMap, path::Path};

use chrono::Utc;
use sessiond_domain::worktree::{Removal, RemovalRequest};
use sessiond_domain::{
    AgentProcessState, AgentProfileId, EventPayload, ExecutorEvent, ExecutorId, ExecutorRecord,
    ExecutorStatus, Runtime, Session, SessionEvent, SessionId, SessionState, TaskEvent, TaskId,
    Worktree,
};
use sessiond_executor::ExecutorHandle;
use sessiond_store::Changeset;

use crate::{
    changes::{executor_moved, transition},
    error::{Error, Result},
    flows::RecoverFirst,
    lease::Fencing,
    manager::SessionManager,
    ops::Agents,
    ops::probe_verdict,
    turn::Turns,
    turn::{CURSOR_KEY, Cut, cursor_value, cut_turn, pending_turn},
    worktrees::Worktrees,
    worktrees::{WORKTREE_CREATED_KEY, WORKTREE_NOT_MADE_KEY},
};

/// What [`SessionManager::create_session`] needs.
#[derive(Debug, Clone)]
pub struct NewSession {
    /// The task the session belongs to; it must exist and not have ended.
    pub task_id: TaskId,
    /// The profile the agent is started from; it must exist.
    pub agent_profile_id: AgentProfileId,
    /// Where the executor runs; the manager needs a driver for it.
    pub runtime: Runtime,
    /// The working tree the agent works in (a host path for local runtimes,
    /// a path on the remote host for `remote`).
    pub worktree: Worktree,
    /// Remote only: the agentctl that host runs.
    pub remote: Option<RemoteAgentctl>,
    /// Free-form metadata stored with the session.
    pub metadata: BTreeMap<String, String>,
    /// MCP servers this session's agent gets besides its profile's (on
    /// every launch: new, load, resume). Their values may be plain (stored
    /// as given: not for secrets) or references to secrets the
    /// configuration names (read at startup); references are stored, never
    /// the values.
    pub mcp_servers: Vec<sessiond_domain::McpServer>,
}

/// An agentctl another host runs for a new remote session: it was started
/// with `executor_id` and `auth_secret`, and listens at `url`.
#[derive(Clone)]
pub struct RemoteAgentctl {
    /// The executor id agentctl was started with (`--executor-id`); the new
    /// executor record gets this id, and `Health` must report it.
    pub executor_id: ExecutorId,
    /// agentctl's address, `http://host:port` or `https://host:port`.
    pub url: String,
    /// The bearer secret agentctl was started with (never logged).
    pub auth_secret: String,
}

impl std::fmt::Debug for RemoteAgentctl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteAgentctl")
            .field("executor_id", &self.executor_id)
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

/// How a session ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndReason {
    /// The work is done: COMPLETED.
    Completed,
    /// The user stopped it: CANCELLED.
    Cancelled,
}

impl SessionManager {
    /// Creates a session and starts its agent: intent first (session
    /// STARTING, executor `starting` generation 1, events), then agentctl,
    /// capability probe, LaunchAgent, NewSession (its id is the
    /// `resume_token`), session WAITING_FOR_INPUT.
    ///
    /// Input errors are returned before anything is written. Once the
    /// session exists, a failure is not an `Err`: the session is returned in
    /// ERROR with an `error_message` saying what to do.
    pub async fn create_session(&self, req: NewSession) -> Result<Session> {
        self.to_completion(move |m| async move { m.create_session_inner(req).await })
            .await
    }

    async fn create_session_inner(&self, req: NewSession) -> Result<Session> {
        let mut stored = Stored::default();
        let created = self.create_session_stored(req, &mut stored).await;
        match (created, stored) {
            // The database went away after the session was stored (helper-45
            // F2: such sessions stayed STARTING until a restart): it comes up
            // through recovery once the database answers, as after a crash.
            (
                Err(e),
                Stored {
                    id: Some(id),
                    session,
                },
            ) if e.is_store_unavailable() => {
                self.recover_once_store_answers(
                    id,
                    "the database was unavailable while the session was created".into(),
                );
                match session {
                    Some(s) => Ok(s),
                    None => Err(Error::Unavailable(format!(
                        "the database became unavailable while session {id} was being stored \
                         ({e}); if it was stored, it comes up by itself once the database \
                         answers (look for it before you create another)"
                    ))),
                }
            }
            (created, _) => created,
        }
    }

    async fn create_session_stored(&self, req: NewSession, out: &mut Stored) -> Result<Session> {
        let store = &self.inner.store;
        let task = store.get_task(req.task_id).await?;
        if task.state.is_terminal() {
            return Err(Error::InvalidArgument(format!(
                "task {} is {}; sessions cannot be added to it",
                task.id, task.state
            )));
        }
        let profile = store.get_agent_profile(req.agent_profile_id).await?;
        crate::session_mcp::check(&profile, &req.mcp_servers, &self.inner.config.mcp_secrets)?;
        // The agent gets the session's own servers after the profile's.
        let mut profile = profile;
        profile.mcp_servers.extend(req.mcp_servers.iter().cloned());
        // A custom name nothing serves is the caller's mistake; a built-in
        // runtime this server does not run (Docker disabled) is its
        // configuration's: FAILED_PRECONDITION, which no retry passes.
        if !self.inner.drivers.contains_key(&req.runtime) {
            let enabled = self
                .runtimes()
                .iter()
                .map(Runtime::to_string)
                .collect::<Vec<_>>()
                .join(", ");
            if !req.runtime.is_built_in() {
                return Err(Error::InvalidArgument(format!(
                    "runtime {}: no executor driver is registered for it; registered runtimes: {enabled}",
                    req.runtime,
                )));
            }
            return Err(Error::RuntimeNotEnabled {
                runtime: req.runtime.to_string(),
                how: if req.runtime == Runtime::LocalDocker {
                    " (start sessiond with --docker-enabled, or set executors.docker.enabled = true)"
                } else {
                    ""
                },
                enabled,
            });
        }
        // An engine that does not answer (Docker stopped) refuses the create
        // as UNAVAILABLE, with nothing stored: a retry once it runs works.
        Agents(self).driver(req.runtime)?.check_ready().await?;
        let session_id = SessionId::new();
        let mut req = req;
        if let (Runtime::Remote, Some(remote)) = (req.runtime, req.remote.as_ref()) {
            // Before anything reaches it (a worktree made through it would
            // bind the host to this session).
            self.check_remote_host(remote, !req.worktree.is_managed())
                .await?;
        }
        let managed = req.worktree.is_managed();
        // Until the worktree is made (below): see `named_branch_gate`.
        let named_branch = (managed && !req.worktree.branch.is_empty())
            .then(|| self.inner.named_branch_gate.lock());
        let _named_branch = match named_branch {
            Some(gate) => Some(gate.await),
            None => None,
        };
        if managed {
            // Before anything is stored: a repository, base, branch or
            // directory that cannot work creates nothing.
            if req.runtime == Runtime::Remote && req.remote.is_none() {
                return Err(Error::InvalidArgument(
                    "a remote session needs the agentctl URL and secret of its host".into(),
                ));
            }
            Worktrees(self)
                .plan_worktree(
                    &mut req.worktree,
                    req.runtime,
                    session_id,
                    &task.title,
                    req.remote.as_ref(),
                )
                .await?;
        } else if req.worktree.path.is_empty() {
            return Err(Error::InvalidArgument("worktree path is empty".into()));
        } else if !Path::new(&req.worktree.path).is_absolute() || req.worktree.path.contains('\0') {
            // The server checks it too; an embedder's caller may not
            // (helper-44 9: such a path was "no longer exists" of a session
            // that was never stored).
            return Err(Error::InvalidArgument(format!(
                "worktree path {:?} is not an absolute path",
                req.worktree.path
            )));
        }
        if req.runtime == Runtime::Remote && req.remote.is_none() {
            return Err(Error::InvalidArgument(
                "a remote session needs the agentctl URL and secret of its host".into(),
            ));
        }
        if !managed && req.runtime != Runtime::Remote && !Path::new(&req.worktree.path).is_dir() {
            return Err(Error::WorktreeMissing {
                session_id,
                path: req.worktree.path.clone(),
            });
        }

        let now = Utc::now();
        let executor_id = req
            .remote
            .as_ref()
            .map_or_else(ExecutorId::new, |r| r.executor_id);
        let created = Session {
            id: session_id,
            task_id: req.task_id,
            state: SessionState::Created,
            agent_profile_id: profile.id,
            agent_execution_id: None,
            runtime: req.runtime,
            executor_id: Some(executor_id),
            worktree: req.worktree.clone(),
            title: String::new(),
            resume_token: None,
            metadata: {
                let mut m = req.metadata.clone();
                if !req.mcp_servers.is_empty() {
                    m.insert(
                        crate::session_mcp::KEY.to_owned(),
                        crate::session_mcp::to_metadata(&req.mcp_servers),
                    );
                }
                m
            },
            error_message: None,
            version: 1,
            created_at: now,
            updated_at: now,
        };
        let _guard = self.inner.sessions.lock(session_id).await;
        let gate = Lifecycle(self).admit_live_session().await?;

        // The session and its intent, in one transaction before anything is
        // spawned: no crash leaves a CREATED session that recovery, which
        // starts from executor rows, would never see.
        let record = ExecutorRecord {
            id: executor_id,
            session_id,
            task_id: req.task_id,
            runtime: req.runtime,
            status: ExecutorStatus::Starting,
            agentctl_url: req.remote.as_ref().map(|r| r.url.clone()),
            agentctl_port: None,
            container_id: None,
            pid: None,
            pid_start_time: None,
            auth_secret: req
                .remote
                .as_ref()
                .map(|r| r.auth_secret.clone())
                .unwrap_or_default(),
            generation: 1,
            supports_session_resume: profile.supports_session_resume,
            supports_workspace_only: true,
            resume_token: None,
            workspace_path: req.worktree.path.clone(),
            worktree: req.worktree.clone(),
            last_seen_at: None,
            error_message: None,
            owner_id: None,
            lease_expires_at: None,
            lease_epoch: 0,
            version: 1,
            created_at: now,
            updated_at: now,
        };
        let mut record = record;
        Fencing(self).new_lease(&mut record);
        let (mut starting, ev) = transition(&created, SessionEvent::LaunchRequested, None)?;
        starting.agent_execution_id = Some(record.execution_id());
        let mut change = Changeset::new()
            .update_session(starting)
            .insert_executor(record.clone());
        if let Some(ev) = ev {
            change = change.event(session_id, ev);
        }
        change = change.event(
            session_id,
            EventPayload::AgentctlStarting {
                executor_id,
                runtime: req.runtime,
                generation: 1,
            },
        );
        change = change.task_event(req.task_id, TaskEvent::WorkStarted);
        out.id = Some(session_id);
        let committed = store.create_session_with(&created, change).await?;
        // After the commit: a heartbeat never sees it owned before the row exists.
        Fencing(self).mark_owned(
            session_id,
            committed.executor.as_ref().map_or(0, |e| e.lease_epoch),
        );
        drop(gate);
        if let Some(s) = &committed.session {
            self.inner
                .sessions
                .status_created(crate::sessions::status_entry(
                    s.clone(),
                    profile.supports_session_resume,
                    committed.executor.as_ref(),
                ));
        }
        self.after_commit(&committed);
        let mut session = committed
            .session
            .ok_or_else(|| Error::Internal("no session".into()))?;
        let mut record = committed
            .executor
            .ok_or_else(|| Error::Internal("no executor".into()))?;
        out.session = Some(session.clone());

        // The worktree, now that its intent is stored: a crash from here on
        // leaves a session whose recovery finishes (or adopts) it.
        if managed {
            // Test-only crash point: the intent is stored, git has made
            // nothing yet (recovery makes the worktree from the base).
            #[cfg(feature = "failpoints")]
            fail::fail_point!("create-before-worktree");
            let made = Worktrees(self).make_worktree(&session).await;
            if let Err(e) = made {
                let reason = format!(
                    "could not create the worktree: {e}; delete this session and create a new one"
                );
                // Its branch and directory may be another's (a branch made
                // meanwhile by hand): a delete of this session leaves them.
                let mut session = session;
                session
                    .metadata
                    .insert(WORKTREE_NOT_MADE_KEY.into(), "true".into());
                return Lifecycle(self)
                    .fail_create(session, record, reason, true)
                    .await;
            }
            drop(_named_branch);
            // Test-only crash point: the worktree exists, the session does
            // not say so yet (recovery adopts it).
            #[cfg(feature = "failpoints")]
            fail::fail_point!("create-after-worktree");
            let mut done = session.clone();
            done.metadata
                .insert(WORKTREE_CREATED_KEY.into(), "true".into());
            // A base relative to where the repository is now (HEAD~1) is
            // kept as the commit it named, so the review's "since the base"
            // stays that commit (helper-38 4).
            if let (Ok(Some(head)), true) =
                (&made, crate::worktrees::base_moves(&session.worktree.base))
            {
                done.worktree.base = head.clone();
            }
            session = self
                .commit(Changeset::new().update_session(done))
                .await?
                .session
                .ok_or_else(|| Error::Internal("no session".into()))?;
        }

        // agentctl.
        let limit = self.inner.config.executor_deadline * 4;
        let handle = match Agents(self)
            .launch_agentctl(&record, &profile, 1, limit)
            .await
        {
            Some(Ok(h)) => h,
            failed => {
                let reason = match failed {
                    Some(Err(e)) => format!(
                        "could not start agentctl: {e}; check the executor configuration and create a new session"
                    ),
                    _ => format!(
                        "agentctl did not start within {limit:?}; check the executor and create a new session"
                    ),
                };
                let failed = Lifecycle(self)
                    .fail_create(session, record.clone(), reason, true)
                    .await?;
                // What the failed launch left here (a container created but
                // never started, its run directory and secret) goes now, not
                // at the session's delete (helper-37: `Created` containers
                // and run directories of failed creates). A remote host's
                // agentctl is not ours to remove.
                if record.runtime != Runtime::Remote
                    && let Ok(driver) = Agents(self).driver(record.runtime)
                    && let Err(e) = driver.remove(&ExecutorHandle::from_record(&record)).await
                {
                    tracing::warn!(session = %session_id, error = %e,
                        "could not remove what a failed agentctl launch left; the session's delete removes it");
                }
                return Ok(failed);
            }
        };
        let mut ready = executor_moved(&record, ExecutorEvent::Healthy)?;
        handle.apply_to(&mut ready);
        ready.last_seen_at = Some(Utc::now());
        // The agent is not launched yet, so nothing is known about resume
        // unless the profile already rules it out.
        let ready_event = EventPayload::AgentctlReady {
            executor_id,
            runtime: req.runtime,
            supports_session_resume: (!profile.supports_session_resume).then_some(false),
        };
        record = self
            .commit(
                Changeset::new()
                    .update_executor(ready)
                    .event(session_id, ready_event),
            )
            .await?
            .executor
            .ok_or_else(|| Error::Internal("no executor".into()))?;

        // Agent and conversation.
        let client = Agents(self).client(&record)?;
        self.cache_update(session_id, |e| e.agent = AgentProcessState::Starting);
        let opened = async {
            Agents(self)
                .ensure_agent(&client, &profile, req.runtime)
                .await?;
            let probe = client
                .capabilities()
                .await
                .ok()
                .and_then(|c| probe_verdict(c.supports_session_resume));
            let token = Agents(self).new_conversation(&client, &record).await?;
            Ok::<_, Error>((probe, token))
        }
        .await;
        // Test-only crash point: the agent opened the conversation, its
        // token is not stored yet (recovery adopts agentctl's).
        #[cfg(feature = "failpoints")]
        fail::fail_point!("create-after-conversation");
        // Killed under the start (agentctl, the agent, or the process under
        // an adapter; the out-of-memory killer's pick): nothing the profile
        // could fix, and it passes by itself. Recovery brings the session up
        // as after a crash here (helper-40 3, helper-43 1: such a session
        // was ERROR for good, the profile blamed).
        let killed = match &opened {
            Err(e) => Lifecycle(self).killed_while_starting(&client, e).await,
            Ok(_) => None,
        };
        if let Some(what) = killed {
            drop(_guard);
            Agents(self).stop_agent_quietly(&record).await;
            self.relaunch_now(session_id, format!("{what} while the agent started"))
                .await;
            return Ok(store.get_session(session_id).await?);
        }
        let (probe, token) = match opened {
            Ok(v) => v,
            Err(e) => {
                Agents(self).stop_agent_quietly(&record).await;
                let agent = profile.agent_command(req.runtime);
                let image = Agents(self)
                    .driver(req.runtime)
                    .ok()
                    .and_then(|d| d.image(profile.container_image()));
                // agentctl's FAILED_PRECONDITION answers already say what to
                // change (auth method, protocol version); anything else is
                // most likely the profile's command or environment.
                let precondition = matches!(
                    &e,
                    Error::Agent {
                        failure: sessiond_executor::Failure::FailedPrecondition,
                        ..
                    }
                );
                let reason = match image {
                    _ if precondition => format!(
                        "the agent of profile {:?} could not start a conversation: {e}; {}",
                        profile.name,
                        what_to_fix(&e.to_string(), &req.mcp_servers)
                    ),
                    // The command must exist in the image, not on the host.
                    Some(image) => format!(
                        "the agent of profile {:?} could not start in image {image:?} (command {:?}): {e}; \
                         the command must exist in the image: set the profile's container command \
                         (or image), then create a new session",
                        profile.name, agent.command
                    ),
                    None => format!(
                        "the agent of profile {:?} could not start a conversation (command {:?}): {e}; \
                         check the profile's command and env, then create a new session",
                        profile.name, agent.command
                    ),
                };
                let failed = Lifecycle(self)
                    .fail_create(session, record.clone(), reason, false)
                    .await?;
                // The session never had a conversation, and the answer says
                // to create a new one: its agentctl keeps nothing worth a
                // live slot (helper-35: refused creates filled
                // `max_live_sessions`). A stop that fails leaves the record
                // for the next recovery, which stops an ERROR session's
                // executor as well.
                if let Err(e) = Lifecycle(self).stop_executor(record).await {
                    tracing::warn!(session = %session_id, error = %e,
                        "could not stop the executor of a session whose agent could not start");
                }
                return Ok(failed);
            }
        };
        let (mut waiting, ev) = transition(&session, SessionEvent::AgentReady, None)?;
        waiting.resume_token = Some(token.clone());
        waiting
            .metadata
            .insert(CURSOR_KEY.into(), cursor_value(record.generation, 0, ""));
        let mut r = record.clone();
        r.resume_token = Some(token);
        r.supports_session_resume = profile.supports_session_resume && probe != Some(false);
        let mut change = Changeset::new().update_session(waiting).update_executor(r);
        if let Some(ev) = ev {
            change = change.event(session_id, ev);
        }
        let committed = self.commit(change).await?;
        session = committed.session.unwrap_or(session);
        if let Some(r) = committed.executor {
            record = r;
        }
        self.cache_update(session_id, |e| {
            e.agent = AgentProcessState::Running;
            e.probe = probe;
        });
        Turns(self).attach_updates(&session, &record);
        Ok(session)
    }

    /// Ends a session: COMPLETED or CANCELLED first (so a crash from here on
    /// is finished by recovery's StopExecutor), then the agent and the
    /// executor are stopped per runtime (remote: the agent only) and the
    /// executor is marked `stopped`. Ending an ended session returns it.
    pub async fn end_session(
        &self,
        task: TaskId,
        session_id: SessionId,
        reason: EndReason,
    ) -> Result<Session> {
        self.to_completion(
            move |m| async move { m.end_session_inner(task, session_id, reason).await },
        )
        .await
    }

    async fn end_session_inner(
        &self,
        task: TaskId,
        session_id: SessionId,
        reason: EndReason,
    ) -> Result<Session> {
        let ended = self.end_session_now(task, session_id, reason).await;
        if let Err(e) = &ended
            && e.is_store_unavailable()
        {
            // Ended or not, and its executor stopped or not (helper-45 F3:
            // a session CANCELLED with its agent running): recovery, once
            // the database answers, stops an ended session's executor.
            self.recover_once_store_answers(
                session_id,
                "the database was unavailable while the session was ended".into(),
            );
        }
        ended
    }

    async fn end_session_now(
        &self,
        task: TaskId,
        session_id: SessionId,
        reason: EndReason,
    ) -> Result<Session> {
        self.session_of_task(task, session_id).await?;
        // A recovery under way brings the workspace back but launches no
        // agent only for it to be stopped here.
        let _withdrawn = self.inner.agent_recoveries.withdraw(session_id);
        self.ensure_recovered(session_id).await?;
        let _guard = self.inner.sessions.lock(session_id).await;
        // First: a reply the pump streams is not written after the turn's
        // end below.
        self.inner.sessions.stop_pump(session_id);
        let session = self.inner.store.get_session(session_id).await?;
        let already_ended = session.state.is_terminal();
        let session = if already_ended {
            session
        } else {
            let event = match reason {
                EndReason::Completed => SessionEvent::Completed,
                EndReason::Cancelled => SessionEvent::Cancelled,
            };
            let (mut ended, ev) = transition(&session, event, None)?;
            // The state change first, as every turn's end has it: watchers
            // see the session end, then the turn it cut.
            let first = match ev {
                Some(ev) => Changeset::new().event(session_id, ev),
                None => Changeset::new(),
            };
            // The agent is stopped: a turn it runs ends with the session
            // (its reply so far kept, `turn_ended` cancelled), and a request
            // it waits on is never answered.
            let change = match pending_turn(&session) {
                Some(turn) => {
                    self.inner
                        .metrics
                        .turn_ended(session_id, crate::metrics::TurnOutcome::Cancelled);
                    cut_turn(self, &session, &turn, Cut::Stopped, first, &mut ended).await?
                }
                None => {
                    crate::permission::cancel_open(
                        self,
                        session_id,
                        first,
                        "the session was stopped",
                    )
                    .await?
                }
            };
            let change = change.update_session(ended);
            match self.commit(change).await {
                Ok(c) => c
                    .session
                    .ok_or_else(|| Error::Internal("no session".into()))?,
                Err(e) => {
                    // Nothing ended: the session's pump goes on.
                    if let Ok(Some(record)) =
                        self.inner.store.get_executor_for_session(session_id).await
                        && record.status == ExecutorStatus::Ready
                    {
                        Turns(self).start_pump(&session, &record);
                    }
                    return Err(e);
                }
            }
        };
        if let Some(record) = self
            .inner
            .store
            .get_executor_for_session(session_id)
            .await?
            && record.status != ExecutorStatus::Stopped
            // Its reconnect loop stops it once the host answers.
            && !(already_ended && remote_stop_pending(&record).is_some())
        {
            Lifecycle(self).stop_executor(record).await?;
        }
        self.inner.sessions.remove_execution(session_id);
        self.inner.agent_restarts.forget(session_id);
        Ok(session)
    }

    /// Completes a session (COMPLETED).
    pub async fn complete_session(&self, task: TaskId, session: SessionId) -> Result<Session> {
        self.end_session(task, session, EndReason::Completed).await
    }

    /// Cancels a session (CANCELLED).
    pub async fn cancel_session(&self, task: TaskId, session: SessionId) -> Result<Session> {
        self.end_session(task, session, EndReason::Cancelled).await
    }

    /// Deletes a session: ends it (CANCELLED) if it has not ended, removes
    /// the executor (container removed, files of the driver removed;
    /// remote: agent stopped) and its record, then marks the session
    /// deleted, after which every read and command on it is NOT_FOUND. The
    /// session row, its messages and events stay in the store as history
    /// (and in the task's event stream, which is gap-free by task seq).
    pub async fn delete_session(&self, task: TaskId, session_id: SessionId) -> Result<()> {
        self.delete_session_with(task, session_id, RemovalRequest::default())
            .await
    }

    /// [`Self::delete_session`], saying what to do with a worktree sessiond
    /// created for the session: by default it is removed only when it holds
    /// no uncommitted change and no commit that no other ref holds, and its
    /// branch only when merged into the base; otherwise nothing is deleted
    /// and the error names what would be lost. `asked.discard` removes it
    /// anyway, `asked.keep` leaves worktree and branch alone,
    /// `asked.delete_branch` deletes the branch even when not merged.
    pub async fn delete_session_with(
        &self,
        task: TaskId,
        session_id: SessionId,
        asked: RemovalRequest,
    ) -> Result<()> {
        self.to_completion(move |m| async move {
            m.delete_session_with_inner(task, session_id, asked).await
        })
        .await
    }

    async fn delete_session_with_inner(
        &self,
        task: TaskId,
        session_id: SessionId,
        asked: RemovalRequest,
    ) -> Result<()> {
        // One delete at a time: two with opposite requests (keep, discard)
        // each checked the worktree before either removed it, and a keep
        // was told it succeeded after the other removed the work.
        let _removal = self.inner.sessions.removal_lock(session_id).await;
        let session = self.session_of_task(task, session_id).await?;
        // From here: the worktree checks below may recover the session
        // first, which must not launch its agent (see `end_session`).
        let _withdrawn = self.inner.agent_recoveries.withdraw(session_id);
        // Taken now: a remote host's agentctl is named by the executor
        // record, which goes before the worktree does.
        // A worktree its create failed to make is not this session's to
        // remove (its branch may be another session's).
        let managed = match session.worktree.is_managed()
            && !session.metadata.contains_key(WORKTREE_NOT_MADE_KEY)
        {
            true => Some(Worktrees(self).worktree_target(&session).await?),
            false => None,
        };
        // Checked before the agent is stopped, so a refusal changes nothing;
        // and again once it is stopped, as the agent may have written since.
        if let Some(t) = &managed {
            Worktrees(self).refuse_if_shared(&session, asked).await?;
            Worktrees(self).worktree_removal(&session, t, asked).await?;
        }
        if let Err(e) = self
            .end_session(task, session_id, EndReason::Cancelled)
            .await
        {
            tracing::warn!(session = %session_id, error = %e, "ending the session before delete failed; removing anyway");
        }
        let _guard = self.inner.sessions.lock(session_id).await;
        if let Some(record) = self
            .inner
            .store
            .get_executor_for_session(session_id)
            .await?
        {
            // A remote host that did not answer the stop just now: its agent
            // still runs, and removing the record would leave nothing to
            // stop it by. Said at once rather than after another deadline.
            if let Some(why) = remote_stop_pending(&record) {
                return Err(Error::Unavailable(format!(
                    "session {session_id} is ended, but its remote host at {} does not answer, \
                     so its agent is not stopped yet ({why}); delete the session again once the \
                     host answers (sessiond stops the agent by itself then)",
                    record
                        .agentctl_url
                        .as_deref()
                        .unwrap_or("its recorded address")
                )));
            }
            // Fenced twice: before the removal (a replica resumed after a
            // pause does not remove what another one adopted) and with the
            // delete itself.
            let fence = Fencing(self).fence(session_id);
            if let Some(f) = &fence {
                let checked = self.inner.store.check_lease(f.clone()).await;
                Fencing(self).fenced_result(f, checked)?;
            }
            let driver = Agents(self).driver(record.runtime)?;
            driver.remove(&ExecutorHandle::from_record(&record)).await?;
            let deleted = self
                .inner
                .store
                .delete_executor(record.id, fence.clone())
                .await;
            match &fence {
                Some(f) => Fencing(self).fenced_result(f, deleted)?,
                None => deleted?,
            };
        }
        if let Some(t) = &managed {
            match Worktrees(self).worktree_removal(&session, t, asked).await? {
                Removal::Remove { delete_branch } => {
                    Worktrees(self)
                        .remove_worktree(&session, t, delete_branch)
                        .await?;
                }
                Removal::Keep | Removal::Refuse(_) => {}
            }
        }
        // Last: a delete that failed above leaves the session readable, so
        // the caller sees why and can delete again.
        self.inner.store.mark_session_deleted(session_id).await?;
        self.inner.bus.close_session(session_id);
        // No executor row, no lease: later writes need no fence.
        Fencing(self).forget_lease(session_id);
        self.inner.sessions.remove_execution(session_id);
        self.inner.agent_restarts.forget(session_id);
        Ok(())
    }
}

/// How far a create got: the id it stores the session under (set before
/// the insert), and the session once the insert is known to have been
/// stored.
#[derive(Default)]
struct Stored {
    id: Option<SessionId>,
    session: Option<Session>,
}

/// The steps of creating and ending a session that its public calls share.
pub(crate) struct Lifecycle<'m>(pub(crate) &'m crate::manager::SessionManager);

impl std::ops::Deref for Lifecycle<'_> {
    type Target = crate::manager::SessionManager;

    fn deref(&self) -> &Self::Target {
        self.0
    }
}

impl<'m> Lifecycle<'m> {
    /// With `max_live_sessions` set: refuses when that many executors are
    /// already `starting` or `ready`, else holds the create gate until the
    /// caller's intent is committed (which counts it).
    async fn admit_live_session(&self) -> Result<Option<tokio::sync::MutexGuard<'m, ()>>> {
        let Some(max) = self.inner.config.max_live_sessions else {
            return Ok(None);
        };
        let gate = self.0.inner.create_gate.lock().await;
        let live: i64 = self
            .inner
            .store
            .count_executors_by_runtime_and_status()
            .await?
            .into_iter()
            .filter(|(_, status, _)| {
                matches!(status, ExecutorStatus::Starting | ExecutorStatus::Ready)
            })
            .map(|(_, _, n)| n)
            .sum();
        if usize::try_from(live).unwrap_or(usize::MAX) >= max {
            return Err(Error::LimitReached {
                limit: "limits.max_live_sessions",
                max,
                what: "live sessions",
                hint: "stop or delete a session, or raise the limit",
            });
        }
        Ok(Some(gate))
    }

    /// What killed the start whose conversation failed with `e`, if it
    /// was killed rather than refused: agentctl gone, the agent ended by a
    /// signal, or the process under an adapter gone (`None`: the profile's
    /// command, environment or answer is the likelier cause).
    async fn killed_while_starting(
        &self,
        client: &sessiond_executor::AgentctlClient,
        e: &Error,
    ) -> Option<String> {
        if crate::turn::conversation_gone_in_agent(&e.to_string()) {
            return Some(format!("the agent lost the conversation ({e})"));
        }
        let said = e.to_string();
        // agentctl's own verdict (an agent silent past its limit, which it
        // ended) is the profile's to fix; only an agent whose connection
        // closed under the call may have been killed by someone else.
        let cut_off = said.contains("connection closed") || said.contains("exited during");
        match client.health().await {
            Err(_) => Some(format!("agentctl went away ({e})")),
            Ok(_) if !cut_off => None,
            Ok(h) => h
                .agent_exit
                .and_then(|x| x.signal)
                .filter(|_| h.agent_state == sessiond_executor::AgentState::Exited)
                .map(|signal| format!("the agent was killed by signal {signal}")),
        }
    }

    async fn fail_create(
        &self,
        session: Session,
        record: ExecutorRecord,
        reason: String,
        executor_failed: bool,
    ) -> Result<Session> {
        tracing::warn!(session = %session.id, %reason, "session could not start");
        let (failed, ev) = transition(&session, SessionEvent::Failed, Some(reason.clone()))?;
        let mut change = Changeset::new().update_session(failed);
        if executor_failed {
            let mut r = executor_moved(&record, ExecutorEvent::Failed)?;
            r.error_message = Some(reason.clone());
            change = change.update_executor(r).event(
                session.id,
                EventPayload::AgentctlError {
                    executor_id: record.id,
                    error_message: reason,
                },
            );
        }
        if let Some(ev) = ev {
            change = change.event(session.id, ev);
        }
        let committed = self.commit(change).await?;
        self.cache_update(session.id, |e| e.agent = AgentProcessState::NotRunning);
        committed
            .session
            .ok_or_else(|| Error::Internal("no session".into()))
    }

    /// Stops the agent and the executor and records `stopped`. A failure
    /// leaves the record as it was, so the next recovery stops it; except
    /// a remote host that does not answer: the session's end is recorded
    /// already, so the call succeeds, and the executor is recorded `error`
    /// with a reconnect loop that stops the agent once the host answers
    /// (recovering an ended session stops its executor).
    async fn stop_executor(&self, record: ExecutorRecord) -> Result<()> {
        let driver = Agents(self).driver(record.runtime)?;
        let handle = ExecutorHandle::from_record(&record);
        // The remote driver's stop is this same `StopAgent`: asking twice
        // only doubles the wait on a host that does not answer.
        if !record.auth_secret.is_empty() && record.runtime != Runtime::Remote {
            Agents(self).stop_agent_quietly(&record).await;
        }
        if let Err(e) = driver.stop(&handle).await {
            if record.runtime == Runtime::Remote && e.is_unavailable() {
                tracing::warn!(executor_id = %record.id, error = %e,
                    "the remote agent could not be stopped yet; stopping it once its host answers");
                let mut failed = executor_moved(&record, ExecutorEvent::Failed)?;
                // `reconnecting:`: the status shows it while the loop runs.
                failed.error_message = Some(format!(
                    "reconnecting: the session ended, its agent could not be stopped yet ({e}); \
                     sessiond stops it once its host answers again"
                ));
                let committed = self
                    .commit(Changeset::new().update_executor(failed.clone()))
                    .await?;
                self.spawn_reconnect(committed.executor.unwrap_or(failed));
                return Ok(());
            }
            tracing::warn!(executor_id = %record.id, error = %e, "could not stop executor; recovery will retry");
            return Err(e.into());
        }
        let stopped = executor_moved(&record, ExecutorEvent::Stopped)?;
        self.commit(Changeset::new().update_executor(stopped))
            .await?;
        Ok(())
    }
}

/// Why the agent of a remote executor is not stopped yet, while a
/// reconnect loop waits for its host to answer (the executor `error`,
/// `reconnecting:`).
fn remote_stop_pending(record: &ExecutorRecord) -> Option<&str> {
    (record.runtime == Runtime::Remote && record.status == ExecutorStatus::Error)
        .then_some(record.error_message.as_deref())
        .flatten()
        .filter(|m| m.starts_with("reconnecting:"))
}

/// What a user changes after agentctl refused to open a conversation
/// (FAILED_PRECONDITION, which says why): an MCP server of the create
/// request that the agent cannot take is the request's to drop, not the
/// profile's to fix.
fn what_to_fix(refusal: &str, request_servers: &[sessiond_domain::McpServer]) -> String {
    let named = request_servers
        .iter()
        .find(|s| refusal.contains("MCP server") && refusal.contains(&format!("{:?}", s.name)));
    match named {
        Some(s) => format!(
            "the MCP server {:?} came with this create request: create the session without it, \
             or with an agent profile whose agent takes it",
            s.name
        ),
        None => "fix the agent profile as described, then create a new session".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_mcp_server_of_the_request_is_the_requests_to_drop() {
        let web = sessiond_domain::McpServer {
            name: "web".into(),
            transport: sessiond_domain::McpTransport::Http {
                url: "https://example.com/mcp".into(),
                headers: Default::default(),
            },
        };
        let refusal = "the agent does not take MCP servers over http (its mcpCapabilities.http \
                       is false), and the session's MCP servers (its profile's, or its create \
                       request's) include \"web\": remove that server or use an agent that offers it";
        let fix = super::what_to_fix(refusal, std::slice::from_ref(&web));
        assert!(
            fix.contains("\"web\" came with this create request"),
            "{fix}"
        );
        assert!(super::what_to_fix(refusal, &[]).contains("fix the agent profile"));
        let other = "no auth method the agent offers is configured";
        assert!(super::what_to_fix(other, &[web]).contains("fix the agent profile"));
    }
}
