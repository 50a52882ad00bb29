//! A session's status (GetSessionStatus), answered from memory: the
//! per-session record's status snapshot and executions cache, filled from
//! the store once and replaced by every commit; while startup recovery has
//! not finished with a session, its status says so.

use std::sync::Arc;

use sessiond_domain::{
    AgentModes, AgentProcessState, ExecutionView, SessionId, SessionStatus, TaskId,
};

use crate::{
    error::{Error, Result},
    lease::Fencing,
    manager::SessionManager,
    recovery::queue::Queue,
    sessions::{CachedModes, StatusEntry, StatusRead},
};

impl SessionManager {
    /// Session state and its execution's status, for this session only
    /// (GetSessionStatus).
    ///
    /// Answered from memory: the session row and the profile's claim come
    /// from the status snapshot (loaded from the store on first use, in one
    /// round trip, then replaced by every `SessionManager::commit`), the
    /// execution from the executors cache, or, for a session this manager
    /// never wrote, from the record loaded with the snapshot.
    pub async fn session_status(&self, task: TaskId, session: SessionId) -> Result<SessionStatus> {
        Ok(Status(self).read(task, session).await?.0)
    }

    /// [`Self::session_status`] and [`Self::session_modes`] in one read
    /// (GetSessionStatus): a running agent's modes come from the cache the
    /// status was read from, with no second lookup; an agent whose modes
    /// are not cached is asked, as `session_modes` asks it, for at most
    /// 250 ms: a status never waits on an agentctl that does not
    /// answer (hung, or its host paused). The question goes on in the
    /// background, one per session at a time, and its answer is kept for
    /// the next calls; meanwhile the status has no modes.
    pub async fn session_status_and_modes(
        &self,
        task: TaskId,
        session: SessionId,
    ) -> Result<(SessionStatus, Option<AgentModes>)> {
        let (status, modes) = Status(self).read(task, session).await?;
        let modes = match modes {
            CachedModes::Known(modes) => modes,
            CachedModes::NoAgent => None,
            // Boxed, as the store reads below: the rare slow paths would
            // otherwise size every status call's future (moved per poll).
            CachedModes::Ask => Box::pin(self.ask_modes(task, session)).await?,
        };
        Ok((status, modes))
    }

    /// `session_modes` on a task of its own (one per session at a time),
    /// waited for at most [`MODES_WAIT`].
    async fn ask_modes(&self, task: TaskId, session: SessionId) -> Result<Option<AgentModes>> {
        if !crate::sync::lock(&self.inner.modes_asked).insert(session) {
            return Ok(None); // asked already; its answer is kept when it comes
        }
        /// Ends the question however its task ends.
        struct Asked(SessionManager, SessionId);
        impl Drop for Asked {
            fn drop(&mut self) {
                crate::sync::lock(&self.0.inner.modes_asked).remove(&self.1);
            }
        }
        let asked = Asked(self.clone(), session);
        let asked = tokio::spawn(async move { asked.0.session_modes(task, session).await });
        match tokio::time::timeout(MODES_WAIT, asked).await {
            Ok(Ok(modes)) => modes,
            Ok(Err(_)) | Err(_) => Ok(None),
        }
    }

    /// Loads the status snapshot of every session with a live (not
    /// `stopped`) executor record in one store call, so GetSessionStatus answers them from memory from
    /// the first call (`sessiond serve` runs it after startup recovery,
    /// before reporting SERVING). A session committed or removed while this
    /// reads is left to load on its first call; an entry already present is
    /// kept (it is at least as new). Returns how many entries it added.
    pub async fn load_status_snapshot(&self) -> Result<usize> {
        if !self.inner.sessions.begin_status_load() {
            return Ok(0); // another load is running; it fills the same entries
        }
        let read = self.inner.store.managed_session_status_inputs().await;
        let entries = read.as_ref().ok().map(|rows| {
            rows.iter()
                .map(|(s, claim, r)| crate::sessions::status_entry(s.clone(), *claim, r.as_ref()))
                .collect()
        });
        let added = self.inner.sessions.end_status_load(entries);
        read?;
        Ok(added)
    }
}

/// How long a status waits for an agent's modes that are not cached (a
/// healthy agentctl answers in about a millisecond).
const MODES_WAIT: std::time::Duration = std::time::Duration::from_millis(250);

/// How a session's status is read: from the snapshot, or from the store
/// once.
pub(crate) struct Status<'m>(pub(crate) &'m crate::manager::SessionManager);

impl std::ops::Deref for Status<'_> {
    type Target = crate::manager::SessionManager;

    fn deref(&self) -> &Self::Target {
        self.0
    }
}

impl Status<'_> {
    /// A session's status, and its agent's modes as far as the cache
    /// knows them.
    async fn read(&self, task: TaskId, session: SessionId) -> Result<(SessionStatus, CachedModes)> {
        // While an exclusive store's pass loads its executors, answer at
        // once from the records (a live executor is about to be recovered)
        // instead of waiting for the load of all of them.
        let loading = Queue(self).answers_while_loading();
        if !loading {
            Queue(self).queue_filled().await;
        }
        // Another replica's session changes under us: read what it committed.
        let elsewhere = !Fencing(self).owns(session);
        let read = if elsewhere {
            StatusRead {
                modes: CachedModes::Ask,
                ..StatusRead::default()
            }
        } else {
            self.inner.sessions.status_read(session)
        };
        let snap = match read.entry {
            Some(e) => e,
            None if elsewhere => Box::pin(Status(self).read_status_inputs(session)).await?,
            None => Box::pin(Status(self).load_status_inputs(session)).await?,
        };
        let s = &snap.session;
        if s.task_id != task {
            return Err(Error::WrongTask {
                session_id: session,
                requested: task,
                actual: s.task_id,
            });
        }
        let view = read.view.or(snap.record);
        let status = sessiond_domain::session_status_with(
            s,
            view.as_ref(),
            snap.profile_claim,
            snap.metadata,
        );
        if !elsewhere
            && let Some(progress) = self.inner.agent_recoveries.view(
                session,
                self.inner.config.max_attempts,
                || self.inner.launches.place(session),
            )
            // An ERROR is committed a moment before the last attempt's
            // progress is dropped: it ended the recovery already.
            && !s.state.is_terminal()
            && s.state != sessiond_domain::SessionState::Error
        {
            return Ok((status.agent_recovering(progress), read.modes));
        }
        let recovering = if loading {
            Queue(self).recovering_while_loading(session, view.as_ref())
        } else {
            Queue(self).is_recovering(session)
        };
        let status = if recovering {
            status.recovering()
        } else {
            status
        };
        Ok((status, read.modes))
    }

    /// A session's status inputs as stored now, not kept (a session another
    /// replica owns). Whether its agent runs is not stored: it is taken as
    /// running while a live lease holder keeps the executor ready and the
    /// session live, since that owner moves the session to ERROR when its
    /// agent exits (pump, liveness check). Exact only on the owner.
    async fn read_status_inputs(&self, session: SessionId) -> Result<StatusEntry> {
        let (s, profile_claim, record) = self.inner.store.session_status_inputs(session).await?;
        let record = record.map(|r| {
            let mut view = ExecutionView::from_record(&r);
            let held =
                r.owner_id.is_some() && r.lease_expires_at.is_some_and(|t| t > chrono::Utc::now());
            if held
                && r.status == sessiond_domain::ExecutorStatus::Ready
                && matches!(
                    s.state,
                    sessiond_domain::SessionState::Running
                        | sessiond_domain::SessionState::WaitingForInput
                )
            {
                view.agent = AgentProcessState::Running;
            }
            view
        });
        Ok(StatusEntry {
            metadata: sessiond_domain::MetadataStatus::of(&s),
            session: Arc::new(s),
            profile_claim,
            record,
        })
    }

    /// Reads a session's status inputs from the store and keeps them in the
    /// snapshot, unless a commit or removal of any session happened while
    /// reading (then what was read is answered once and not kept).
    async fn load_status_inputs(&self, session: SessionId) -> Result<StatusEntry> {
        let generation = self.inner.sessions.status_generation();
        let (s, profile_claim, record) = self.inner.store.session_status_inputs(session).await?;
        let (_, entry) = crate::sessions::status_entry(s, profile_claim, record.as_ref());
        Ok(self.inner.sessions.keep_loaded(session, generation, entry))
    }
}
