//! Creating sessions, sending messages, ending and deleting sessions.

use std::{collections::BTreeMap, path::Path};

use chrono::Utc;
use sessiond_domain::worktree::{Removal, RemovalRequest};
use sessiond_domain::{
    AgentMode, AgentModes, AgentProcessState, AgentProfileId, ConfigOption, ConfigValue,
    EventPayload, ExecutorEvent, ExecutorId, ExecutorRecord, ExecutorStatus, Message, MessageId,
    MessageRole, Runtime, Session, SessionEvent, SessionId, SessionState, TaskEvent, TaskId,
    Worktree, check_resume,
};
use sessiond_executor::ExecutorHandle;
use sessiond_proto::agentctl::v1 as pb;
use sessiond_store::Changeset;

use crate::{
    error::{Error, Result},
    manager::{SessionManager, executor_moved, transition},
    ops::probe_verdict,
    pump::{
        CURSOR_KEY, INTERRUPTED_TURN_KEY, TURN_GENERATION_KEY, TURN_INSTANCE_KEY, TURN_KEY,
        cursor_value, stored_cursor,
    },
    worktrees::WORKTREE_CREATED_KEY,
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
    /// With `max_live_sessions` set: refuses when that many executors are
    /// already `starting` or `ready`, else holds the create gate until the
    /// caller's intent is committed (which counts it).
    async fn admit_live_session(&self) -> Result<Option<tokio::sync::MutexGuard<'_, ()>>> {
        let Some(max) = self.inner.config.max_live_sessions else {
            return Ok(None);
        };
        let gate = self.inner.create_gate.lock().await;
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

    /// Creates a session and starts its agent: intent first (session
    /// STARTING, executor `starting` generation 1, events), then agentctl,
    /// capability probe, LaunchAgent, NewSession (its id is the
    /// `resume_token`), session WAITING_FOR_INPUT.
    ///
    /// Input errors are returned before anything is written. Once the
    /// session exists, a failure is not an `Err`: the session is returned in
    /// ERROR with an `error_message` saying what to do.
    pub async fn create_session(&self, req: NewSession) -> Result<Session> {
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
        // runtime this server does not run (Docker disabled) stays
        // UNAVAILABLE, as it always was.
        if !req.runtime.is_built_in() && !self.inner.drivers.contains_key(&req.runtime) {
            return Err(Error::InvalidArgument(format!(
                "runtime {}: no executor driver is registered for it; registered runtimes: {}",
                req.runtime,
                self.runtimes()
                    .iter()
                    .map(Runtime::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        self.driver(req.runtime)?;
        let session_id = SessionId::new();
        let mut req = req;
        let managed = req.worktree.is_managed();
        if managed {
            // Before anything is stored: a repository, base, branch or
            // directory that cannot work creates nothing.
            if req.runtime == Runtime::Remote && req.remote.is_none() {
                return Err(Error::InvalidArgument(
                    "a remote session needs the agentctl URL and secret of its host".into(),
                ));
            }
            self.plan_worktree(
                &mut req.worktree,
                req.runtime,
                session_id,
                &task.title,
                req.remote.as_ref(),
            )
            .await?;
        } else if req.worktree.path.is_empty() {
            return Err(Error::InvalidArgument("worktree path is empty".into()));
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
        let _guard = self.lock_session(session_id).await;
        let gate = self.admit_live_session().await?;

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
        self.new_lease(&mut record);
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
        let committed = store.create_session_with(&created, change).await?;
        // After the commit: a heartbeat never sees it owned before the row exists.
        self.mark_owned(
            session_id,
            committed.executor.as_ref().map_or(0, |e| e.lease_epoch),
        );
        drop(gate);
        self.after_commit(&committed);
        let mut session = committed
            .session
            .ok_or_else(|| Error::Internal("no session".into()))?;
        let mut record = committed
            .executor
            .ok_or_else(|| Error::Internal("no executor".into()))?;

        // The worktree, now that its intent is stored: a crash from here on
        // leaves a session whose recovery finishes (or adopts) it.
        if managed {
            // Test-only crash point: the intent is stored, git has made
            // nothing yet (recovery makes the worktree from the base).
            #[cfg(feature = "failpoints")]
            fail::fail_point!("create-before-worktree");
            if let Err(e) = self.make_worktree(&session).await {
                let reason = format!(
                    "could not create the worktree: {e}; delete this session and create a new one"
                );
                return self.fail_create(session, record, reason, true).await;
            }
            // Test-only crash point: the worktree exists, the session does
            // not say so yet (recovery adopts it).
            #[cfg(feature = "failpoints")]
            fail::fail_point!("create-after-worktree");
            let mut made = session.clone();
            made.metadata
                .insert(WORKTREE_CREATED_KEY.into(), "true".into());
            session = self
                .commit(Changeset::new().update_session(made))
                .await?
                .session
                .ok_or_else(|| Error::Internal("no session".into()))?;
        }

        // agentctl.
        let limit = self.inner.config.executor_deadline * 4;
        let handle = match self.launch_agentctl(&record, &profile, 1, limit).await {
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
                return self.fail_create(session, record, reason, true).await;
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
        let client = self.client(&record)?;
        self.cache_update(session_id, |e| e.agent = AgentProcessState::Starting);
        let opened = async {
            self.ensure_agent(&client, &profile, req.runtime).await?;
            let probe = client
                .capabilities()
                .await
                .ok()
                .and_then(|c| probe_verdict(c.supports_session_resume));
            let token = self.new_conversation(&client, &record).await?;
            Ok::<_, Error>((probe, token))
        }
        .await;
        // Test-only crash point: the agent opened the conversation, its
        // token is not stored yet (recovery adopts agentctl's).
        #[cfg(feature = "failpoints")]
        fail::fail_point!("create-after-conversation");
        let (probe, token) = match opened {
            Ok(v) => v,
            Err(e) => {
                self.stop_agent_quietly(&record).await;
                let agent = profile.agent_command(req.runtime);
                let image = self
                    .driver(req.runtime)
                    .ok()
                    .and_then(|d| d.image(profile.container_image()));
                // agentctl's FAILED_PRECONDITION answers already say what to
                // change (auth method, protocol version); anything else is
                // most likely the profile's command or environment.
                let precondition = matches!(
                    &e,
                    Error::Agent {
                        code: tonic::Code::FailedPrecondition,
                        ..
                    }
                );
                let reason = match image {
                    _ if precondition => format!(
                        "the agent of profile {:?} could not start a conversation: {e}; \
                         fix the agent profile as described, then create a new session",
                        profile.name
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
                return self.fail_create(session, record, reason, false).await;
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
        self.attach_updates(&session, &record);
        Ok(session)
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
        match self
            .send(task, session_id, text, attachments, false)
            .await?
        {
            crate::Sent::Started(m) => Ok(m),
            crate::Sent::Queued(_) => Err(Error::Internal("queued without being asked to".into())),
        }
    }

    /// The one path of SendMessage: `queue` puts the message behind a
    /// running turn (or behind messages already waiting) instead of
    /// refusing it. A message with attachments is never queued.
    pub(crate) async fn send(
        &self,
        task: TaskId,
        session_id: SessionId,
        text: &str,
        attachments: Vec<crate::Attachment>,
        queue: bool,
    ) -> Result<crate::Sent> {
        if text.trim().is_empty() && attachments.is_empty() {
            return Err(Error::InvalidArgument("the message is empty".into()));
        }
        let t = std::time::Instant::now();
        let early = self.precede_pass(session_id);
        self.check_task(task, session_id).await?;
        let checked = t.elapsed();
        let _ahead = self.recover_ahead(session_id).await?;
        // `_ahead` (if the session needed recovering) now holds the pause.
        drop(early);
        let recovered = t.elapsed();
        let _guard = self.lock_session(session_id).await;
        let locked = t.elapsed();
        let sent = async {
            let session = self.inner.store.get_session(session_id).await?;
            if queue
                && attachments.is_empty()
                && crate::message_queue::waits_behind_a_turn(&session)
            {
                return self.enqueue(session, text).await.map(crate::Sent::Queued);
            }
            self.check_can_start_turn(&session, "send a message")
                .await?;
            if crate::message_queue::queued_ahead(&session) {
                return Err(Error::InvalidState {
                    session_id,
                    state: session.state,
                    action: "send a message without queueing it",
                    hint: "messages queued earlier wait to be delivered first; queue this one too, \
                           or cancel them",
                });
            }
            self.start_turn_as(session, text, None, attachments)
                .await
                .map(crate::Sent::Started)
        }
        .await;
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
            Err(e) => Err(self.unless_lost(session_id, e).await),
            ok => ok,
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
        let early = self.precede_pass(session_id);
        self.check_task(task, session_id).await?;
        let _ahead = self.recover_ahead(session_id).await?;
        drop(early);
        let _guard = self.lock_session(session_id).await;
        let session = self.inner.store.get_session(session_id).await?;
        if let Err(e) = self.check_can_start_turn(&session, "retry a turn").await {
            return Err(self.unless_lost(session_id, e).await);
        }
        let interrupted = session.metadata.get(INTERRUPTED_TURN_KEY).cloned();
        let msgs = self
            .inner
            .store
            .list_messages(session_id, 0, u32::MAX)
            .await?;
        let original = match (message, interrupted) {
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
                found.clone()
            }
            (None, Some(turn)) => msgs
                .iter()
                .find(|x| x.role == MessageRole::User && x.id.to_string() == turn)
                .cloned()
                .ok_or_else(|| {
                    Error::Internal(format!(
                        "interrupted turn {turn} has no stored user message"
                    ))
                })?,
            (None, None) => {
                return Err(Error::TurnNotInterrupted {
                    session_id,
                    detail: "its last turn did not end interrupted".into(),
                });
            }
        };
        let message = self.start_turn(session, &original.content).await?;
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
        self.session_of_task(task, session_id).await?;
        self.ensure_recovered(session_id).await?;
        let session = self.inner.store.get_session(session_id).await?;
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
        let Some(execution) = self.execution(session_id).filter(|e| {
            e.record.status == ExecutorStatus::Ready && e.agent == AgentProcessState::Running
        }) else {
            return Err(Error::AgentNotRunning {
                session_id,
                hint: "its turn ends as soon as the agent is resumed or found gone".into(),
            });
        };
        let client = self.client(&execution.record)?;
        let answer = client
            .raw()
            .cancel(pb::CancelRequest {})
            .await
            .map_err(|s| {
                self.agentctl_refused(session_id, &s);
                Error::agent("Cancel", &s)
            })?
            .into_inner();
        tracing::info!(session = %session_id, cancelled = answer.cancelled, "turn cancel requested");
        Ok(answer.cancelled)
    }

    /// The session modes the session's agent offers (ACP session modes),
    /// read live from agentctl; `None` when the agent runs without modes,
    /// does not run, or does not answer.
    pub async fn session_modes(
        &self,
        task: TaskId,
        session_id: SessionId,
    ) -> Result<Option<AgentModes>> {
        self.check_task(task, session_id).await?;
        let Some(execution) = self.execution(session_id).filter(|e| {
            e.record.status == ExecutorStatus::Ready && e.agent == AgentProcessState::Running
        }) else {
            return Ok(None);
        };
        let execution_id = execution.record.execution_id();
        let (cached, stamp) = self.cached_modes(session_id, &execution_id);
        if let Some(modes) = cached {
            return Ok(modes);
        }
        let Ok(client) = self.client(&execution.record) else {
            return Ok(None);
        };
        // Not kept when the agent did not answer: the next call asks again.
        let Ok(health) = client.raw().health(pb::HealthRequest {}).await else {
            return Ok(None);
        };
        let modes = health.into_inner().modes.map(|m| agent_modes(&m));
        self.remember_modes(session_id, execution_id, stamp, modes.clone());
        Ok(modes)
    }

    /// Switches the session's agent to session mode `mode_id` (ACP
    /// `session/set_mode`); returns the modes with it current. The agent
    /// must run (WAITING_FOR_INPUT or RUNNING: ACP allows a switch during
    /// a turn). INVALID_ARGUMENT names the modes when `mode_id` is not one.
    pub async fn set_session_mode(
        &self,
        task: TaskId,
        session_id: SessionId,
        mode_id: &str,
    ) -> Result<AgentModes> {
        if mode_id.trim().is_empty() {
            return Err(Error::InvalidArgument("mode_id: must not be empty".into()));
        }
        self.session_of_task(task, session_id).await?;
        self.ensure_recovered(session_id).await?;
        let session = self.inner.store.get_session(session_id).await?;
        match session.state {
            SessionState::WaitingForInput | SessionState::Running => {}
            s if s.is_terminal() => {
                return Err(Error::SessionEnded {
                    session_id,
                    state: s,
                });
            }
            SessionState::Error => return Err(self.agent_not_running(&session).await),
            s => {
                return Err(Error::InvalidState {
                    session_id,
                    state: s,
                    action: "set the session mode",
                    hint: "wait until the agent is ready",
                });
            }
        }
        let Some(execution) = self.execution(session_id).filter(|e| {
            e.record.status == ExecutorStatus::Ready && e.agent == AgentProcessState::Running
        }) else {
            return Err(self.agent_not_running(&session).await);
        };
        let client = self.client(&execution.record)?;
        self.forget_modes(session_id);
        let (_, stamp) = self.cached_modes(session_id, "");
        let modes = client
            .raw()
            .set_mode(pb::SetModeRequest {
                mode_id: mode_id.to_owned(),
            })
            .await
            .map_err(|s| Error::agent("SetMode", &s))?
            .into_inner()
            .modes
            .unwrap_or_default();
        tracing::info!(session = %session_id, mode_id, "session mode set");
        let modes = agent_modes(&modes);
        self.remember_modes(
            session_id,
            execution.record.execution_id(),
            stamp,
            Some(modes.clone()),
        );
        Ok(modes)
    }

    /// Sets config option `config_id` of the session's agent to `value`
    /// (ACP `session/set_config_option`); returns the modes and options as
    /// the agent answered. The agent must run, as for a mode. An option or
    /// a value the agent does not offer is INVALID_ARGUMENT naming what it
    /// offers.
    pub async fn set_session_config_option(
        &self,
        task: TaskId,
        session_id: SessionId,
        config_id: &str,
        value: &str,
    ) -> Result<AgentModes> {
        if config_id.trim().is_empty() {
            return Err(Error::InvalidArgument(
                "config_id: must not be empty".into(),
            ));
        }
        self.session_of_task(task, session_id).await?;
        self.ensure_recovered(session_id).await?;
        let session = self.inner.store.get_session(session_id).await?;
        match session.state {
            SessionState::WaitingForInput | SessionState::Running => {}
            s if s.is_terminal() => {
                return Err(Error::SessionEnded {
                    session_id,
                    state: s,
                });
            }
            SessionState::Error => return Err(self.agent_not_running(&session).await),
            s => {
                return Err(Error::InvalidState {
                    session_id,
                    state: s,
                    action: "set a config option",
                    hint: "wait until the agent is ready",
                });
            }
        }
        let Some(execution) = self.execution(session_id).filter(|e| {
            e.record.status == ExecutorStatus::Ready && e.agent == AgentProcessState::Running
        }) else {
            return Err(self.agent_not_running(&session).await);
        };
        // Checked here first, so the answer names what the agent offers
        // without a round trip to it.
        if let Some(modes) = self.session_modes(task, session_id).await? {
            check_config_value(&modes, config_id, value)?;
        }
        let client = self.client(&execution.record)?;
        self.forget_modes(session_id);
        let (_, stamp) = self.cached_modes(session_id, "");
        let modes = client
            .raw()
            .set_config_option(pb::SetConfigOptionRequest {
                config_id: config_id.to_owned(),
                value: value.to_owned(),
            })
            .await
            .map_err(|s| match s.code() {
                tonic::Code::InvalidArgument => Error::InvalidArgument(s.message().to_owned()),
                _ => Error::agent("SetConfigOption", &s),
            })?
            .into_inner()
            .modes
            .unwrap_or_default();
        tracing::info!(session = %session_id, config_id, value, "config option set");
        let modes = agent_modes(&modes);
        self.remember_modes(
            session_id,
            execution.record.execution_id(),
            stamp,
            Some(modes.clone()),
        );
        Ok(modes)
    }

    /// The error for a session whose agent does not run, with the hint that
    /// `ResumeSession` agrees with: resume it, or why it cannot be resumed.
    async fn agent_not_running(&self, session: &Session) -> Error {
        let session_id = session.id;
        let why = session
            .error_message
            .as_deref()
            .map(|m| format!(" ({m})"))
            .unwrap_or_default();
        let hint = match self.status_of(session).await.map(|s| check_resume(&s)) {
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

    /// [`Self::start_turn`]; `from_queue`: the queued message this turn
    /// delivers, taken off the queue in the commit that starts the turn
    /// (its id becomes the user message's), so it is delivered once.
    pub(crate) async fn start_turn_as(
        &self,
        session: Session,
        text: &str,
        from_queue: Option<MessageId>,
        attachments: Vec<crate::Attachment>,
    ) -> Result<Message> {
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
            crate::attachments::resolve(&self.client(&record)?, attachments).await?
        };
        let blocks = crate::attachments::blocks(&attachments, &session.worktree.path);

        let now = Utc::now();
        let message = Message {
            id: from_queue.unwrap_or_default(),
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
        let (mut running, ev) = transition(&session, SessionEvent::TurnStarted, None)?;
        running.metadata.insert(TURN_KEY.into(), turn_id.clone());
        // Which agentctl generation got the Prompt: after a relaunch, only
        // the journal can tell whether it reached an agent.
        running
            .metadata
            .insert(TURN_GENERATION_KEY.into(), record.generation.to_string());
        // The agentctl process last known alive before the Prompt (a parked
        // pump's, else the stored cursor's): if that process still answers
        // after a crash, any Prompt of this turn went to it (one process
        // holds the address), so its journal alone tells whether the turn
        // reached an agent, even a journal it created (fresh).
        let instance = self
            .parked_instance(session_id)
            .filter(|i| !i.is_empty())
            .unwrap_or_else(|| stored_cursor(&session, record.generation).1);
        if instance.is_empty() {
            running.metadata.remove(TURN_INSTANCE_KEY);
        } else {
            running.metadata.insert(TURN_INSTANCE_KEY.into(), instance);
        }
        // A new turn: the interrupted one before it can no longer be retried.
        running.metadata.remove(INTERRUPTED_TURN_KEY);
        let mut change = Changeset::new();
        if let Some(id) = from_queue {
            sessiond_domain::queue::remove(&mut running.metadata, id);
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
        let title = sessiond_domain::prompt_title(text);
        if session.title.is_empty() && !title.is_empty() {
            change = change.set_title(session_id, title, sessiond_domain::TitleSource::Prompt);
        }
        if let Some(ev) = ev {
            change = change.event(session_id, ev);
        }
        change = change.task_event(session.task_id, TaskEvent::WorkStarted);
        let committed = self.commit(change).await?;
        tracing::debug!(%session_id, "turn start committed; prompting");
        let stored = committed
            .messages
            .into_iter()
            .next()
            .ok_or_else(|| Error::Internal("no message".into()))?;
        let running = committed
            .session
            .ok_or_else(|| Error::Internal("no session".into()))?;
        if !self.has_pump(session_id) {
            // From the state before this turn: the turn is prompted just
            // below, the pump has no pending turn to settle.
            self.start_pump(&session, &record);
        }
        // Test-only crash point: the user message and the RUNNING state are
        // committed, the Prompt has not been sent (recovery re-delivers it).
        #[cfg(feature = "failpoints")]
        fail::fail_point!("prompt-after-commit");

        let client = self.client(&record)?;
        // Timed from just before the Prompt: its first chunk can beat the reply.
        self.inner.metrics.turn_started(session_id);
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
        let prompted = tracing::Instrument::instrument(
            client.raw().prompt(pb::PromptRequest {
                text: text.to_owned(),
                turn_id: turn_id.clone(),
                blocks,
                ..Default::default()
            }),
            span,
        )
        .await;
        if let Err(status) = prompted {
            if self.agentctl_refused(session_id, &status) {
                // Another replica adopted the session: it settles this turn.
                return Err(self.not_owner_now(session_id).await);
            }
            let e = Error::agent("Prompt", &status);
            if self.agentctl_gone(&status, &client).await {
                // agentctl itself is gone (killed, its container stopped):
                // that passes by itself, so the session is recovered in the
                // background like any lost agentctl, never left in ERROR.
                self.prompt_found_agentctl_gone(&record, &e.to_string())
                    .await?;
                return Err(Error::Unavailable(format!(
                    "the message did not reach the agent: its agentctl stopped answering ({e}); \
                     the session recovers by itself: send the message again once it is back \
                     (`sessionctl session status` shows when)"
                )));
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
            let mut change = crate::pump::interrupt_turn(
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
        Ok(stored)
    }

    /// A failed call's `status` came from agentctl being gone rather than
    /// from an answer: a transport failure, and `Health` fails as well.
    pub(crate) async fn agentctl_gone(
        &self,
        status: &tonic::Status,
        client: &sessiond_executor::AgentctlClient,
    ) -> bool {
        if !matches!(
            status.code(),
            tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
        ) {
            return false;
        }
        let mut raw = client.raw();
        let health = raw.health(pb::HealthRequest {});
        !matches!(
            tokio::time::timeout(self.inner.config.executor_deadline, health).await,
            Ok(Ok(_))
        )
    }

    /// The Prompt of a turn just started found agentctl gone. As when the
    /// update pump loses it: a remote executor reconnects in the background
    /// (the turn stays pending, settled at most once when the host is back);
    /// a local one is recovered in the background, the turn ended
    /// interrupted (whether agentctl took it is unknown, so it is not sent
    /// again). The caller holds the session lock.
    async fn prompt_found_agentctl_gone(
        &self,
        record: &ExecutorRecord,
        reason: &str,
    ) -> Result<()> {
        let sid = record.session_id;
        tracing::warn!(session = %sid, executor_id = %record.id, %reason,
            "the message's Prompt found agentctl gone; recovering the session in the background");
        self.stop_pump(sid);
        if record.runtime == Runtime::Remote {
            self.commit(crate::recovery::remote_lost(record, reason)?)
                .await?;
            self.cache_update(sid, |e| e.agent = AgentProcessState::NotRunning);
            self.spawn_reconnect(record.clone());
            return Ok(());
        }
        let (change, retry) = self.agentctl_lost_change(record, reason).await?;
        let committed = self.commit(change).await?;
        self.cache_update(sid, |e| e.agent = AgentProcessState::NotRunning);
        if let Some(failed) = retry {
            self.spawn_retry(committed.executor.unwrap_or(failed), 0, reason.to_owned());
        }
        Ok(())
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
        self.session_of_task(task, session_id).await?;
        self.ensure_recovered(session_id).await?;
        let _guard = self.lock_session(session_id).await;
        let session = self.inner.store.get_session(session_id).await?;
        let session = if session.state.is_terminal() {
            session
        } else {
            let event = match reason {
                EndReason::Completed => SessionEvent::Completed,
                EndReason::Cancelled => SessionEvent::Cancelled,
            };
            let (ended, ev) = transition(&session, event, None)?;
            // The agent is stopped: a request it waits on is never answered.
            let mut change = crate::permission::cancel_open(
                self,
                session_id,
                Changeset::new(),
                "the session was stopped",
            )
            .await?
            .update_session(ended);
            if let Some(ev) = ev {
                change = change.event(session_id, ev);
            }
            self.commit(change)
                .await?
                .session
                .ok_or_else(|| Error::Internal("no session".into()))?
        };
        self.stop_pump(session_id);
        if let Some(record) = self
            .inner
            .store
            .get_executor_for_session(session_id)
            .await?
            && record.status != ExecutorStatus::Stopped
        {
            self.stop_executor(record).await?;
        }
        self.cache_remove(session_id);
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

    /// Stops the agent and the executor and records `stopped`. A failure
    /// leaves the record as it was, so the next recovery stops it.
    async fn stop_executor(&self, record: ExecutorRecord) -> Result<()> {
        let driver = self.driver(record.runtime)?;
        let handle = ExecutorHandle::from_record(&record);
        if !record.auth_secret.is_empty() {
            self.stop_agent_quietly(&record).await;
        }
        if let Err(e) = driver.stop(&handle).await {
            tracing::warn!(executor_id = %record.id, error = %e, "could not stop executor; recovery will retry");
            return Err(e.into());
        }
        let stopped = executor_moved(&record, ExecutorEvent::Stopped)?;
        self.commit(Changeset::new().update_executor(stopped))
            .await?;
        Ok(())
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
        let session = self.session_of_task(task, session_id).await?;
        // Taken now: a remote host's agentctl is named by the executor
        // record, which goes before the worktree does.
        let managed = match session.worktree.is_managed() {
            true => Some(self.worktree_target(&session).await?),
            false => None,
        };
        // Checked before the agent is stopped, so a refusal changes nothing;
        // and again once it is stopped, as the agent may have written since.
        if let Some(t) = &managed {
            self.worktree_removal(&session, t, asked).await?;
        }
        if let Err(e) = self
            .end_session(task, session_id, EndReason::Cancelled)
            .await
        {
            tracing::warn!(session = %session_id, error = %e, "ending the session before delete failed; removing anyway");
        }
        let _guard = self.lock_session(session_id).await;
        if let Some(record) = self
            .inner
            .store
            .get_executor_for_session(session_id)
            .await?
        {
            // Fenced twice: before the removal (a replica resumed after a
            // pause does not remove what another one adopted) and with the
            // delete itself.
            let fence = self.fence(session_id);
            if let Some(f) = &fence {
                let checked = self.inner.store.check_lease(f.clone()).await;
                self.fenced_result(f, checked)?;
            }
            let driver = self.driver(record.runtime)?;
            driver.remove(&ExecutorHandle::from_record(&record)).await?;
            let deleted = self
                .inner
                .store
                .delete_executor(record.id, fence.clone())
                .await;
            match &fence {
                Some(f) => self.fenced_result(f, deleted)?,
                None => deleted?,
            };
        }
        if let Some(t) = &managed {
            match self.worktree_removal(&session, t, asked).await? {
                Removal::Remove { delete_branch } => {
                    self.remove_worktree(&session, t, delete_branch).await?;
                }
                Removal::Keep | Removal::Refuse(_) => {}
            }
        }
        // Last: a delete that failed above leaves the session readable, so
        // the caller sees why and can delete again.
        self.inner.store.mark_session_deleted(session_id).await?;
        // No executor row, no lease: later writes need no fence.
        self.forget_lease(session_id);
        self.cache_remove(session_id);
        Ok(())
    }
}

/// INVALID_ARGUMENT unless the agent offers option `config_id` with
/// `value`, naming what it offers.
pub(crate) fn check_config_value(modes: &AgentModes, config_id: &str, value: &str) -> Result<()> {
    let Some(o) = modes.config_options.iter().find(|o| o.id == config_id) else {
        let ids: Vec<&str> = modes.config_options.iter().map(|o| o.id.as_str()).collect();
        return Err(Error::InvalidArgument(format!(
            "config_id: the agent has no config option {config_id:?}; its options are {}",
            if ids.is_empty() {
                "none".to_owned()
            } else {
                ids.join(", ")
            }
        )));
    };
    let offered = o.offered();
    if offered.contains(&value) {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "value: the agent does not offer {value:?} for config option {config_id}; it offers {}",
            offered.join(", ")
        )))
    }
}

pub(crate) fn agent_modes(m: &pb::SessionModes) -> AgentModes {
    AgentModes {
        current: m.current_mode_id.clone(),
        available: m
            .available
            .iter()
            .map(|m| AgentMode {
                id: m.id.clone(),
                name: m.name.clone(),
                description: m.description.clone(),
            })
            .collect(),
        config_options: m
            .config_options
            .iter()
            .map(|o| ConfigOption {
                id: o.id.clone(),
                name: o.name.clone(),
                description: o.description.clone(),
                category: o.category.clone(),
                kind: o.r#type.clone(),
                current: o.current_value.clone(),
                values: o
                    .values
                    .iter()
                    .map(|v| ConfigValue {
                        value: v.value.clone(),
                        name: v.name.clone(),
                        description: v.description.clone(),
                    })
                    .collect(),
            })
            .collect(),
    }
}

/// Milliseconds, for timing fields of debug events.
pub(crate) fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
