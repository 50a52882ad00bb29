//! [`SessionManager`]: the state every flow shares, and the small helpers
//! they are built from (single-flight operations, commit-then-publish).
//! What it keeps per session is the per-session record (`sessions.rs`).

use std::{
    collections::HashMap,
    fmt,
    sync::{
        Arc, Mutex as StdMutex,
        atomic::{AtomicU64, Ordering},
    },
};

use futures::{FutureExt, future::BoxFuture};
use sessiond_domain::{
    AgentProcessState, ExecutionView, ExecutorRecord, Runtime, Session, SessionId, SessionStatus,
    TaskId,
};
use sessiond_executor::{AgentctlClient, Executor, ExecutorHandle};
use sessiond_store::{Changeset, Committed, Store};
use tokio::{sync::OwnedMutexGuard, task::AbortHandle};

use crate::{
    config::ManagerConfig,
    error::{Error, Result},
    events::{self, EventBus, EventStream},
    sessions::{Execution, OpKind, OpOutcome, Sessions, SharedOp, StatusEntry},
    sync::lock,
};

/// Counters of what this manager started, for tests and metrics.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub agentctl_launches: AtomicU64,
    pub agent_launches: AtomicU64,
    pub resume_attempts: AtomicU64,
    pub resumed_by_recover: AtomicU64,
}

/// A snapshot of [`SessionManager::stats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Stats {
    /// agentctl processes launched (or containers started, remote connects).
    pub agentctl_launches: u64,
    /// LaunchAgent calls made.
    pub agent_launches: u64,
    /// Agent resume attempts (ResumeSession calls), startup and explicit.
    pub resume_attempts: u64,
    /// Of those, the ones made by one agentctl `Recover` (the agent's
    /// launch and resume in one exchange, within recovery).
    pub resumed_by_recover: u64,
}

pub(crate) struct Inner {
    pub store: Store,
    pub drivers: HashMap<Runtime, Arc<dyn Executor>>,
    pub config: ManagerConfig,
    pub bus: EventBus,
    pub counters: Counters,
    pub metrics: Arc<crate::metrics::ManagerMetrics>,
    /// The per-session records (`sessions.rs`).
    pub(crate) sessions: Sessions,
    /// Agent profiles read once by `recover_all` for its executors (and by
    /// the adoption loop for one burst of adoptions).
    pub(crate) recovery_profiles:
        StdMutex<HashMap<sessiond_domain::AgentProfileId, sessiond_domain::AgentProfile>>,
    /// Held by a create from counting live sessions to committing its
    /// intent, so concurrent creates cannot all slip under the limit.
    pub(crate) create_gate: tokio::sync::Mutex<()>,
    background: StdMutex<Vec<AbortHandle>>,
    next_op: AtomicU64,
    pub liveness_started: std::sync::atomic::AtomicBool,
    /// When this manager (the backend) started: a remote host's reconnect
    /// window is never counted from before it, so an outage of the backend
    /// longer than the window does not use the window up.
    pub started_at: chrono::DateTime<chrono::Utc>,
    /// Becomes true when the first `recover_all` of this manager finished.
    first_recovery: tokio::sync::watch::Sender<bool>,
    /// Becomes true when the first pass has every workspace back (each
    /// executor reattached, relaunched up to its agent's launch, or failed):
    /// the backend serves from then on while agents still relaunch.
    workspaces_back: tokio::sync::watch::Sender<bool>,
    /// Admission of agent launches per host (`launches.rs`).
    pub(crate) launches: crate::launches::LaunchScheduler,
    /// Where each session's agent recovery stands (`progress.rs`).
    pub(crate) agent_recoveries: crate::progress::AgentRecoveries,
    /// The pass's slots held by its recoveries, by session: a recovery
    /// gives its slot back when it starts waiting for a launch, so the
    /// pass's concurrency goes on to reattaches (`recovery.rs`).
    pub(crate) pass_slots: StdMutex<HashMap<SessionId, crate::pass::PassTicket>>,
    /// The startup pass's outcome writer while the pass runs.
    pub(crate) pass_outcomes: StdMutex<Option<crate::pass::Outcomes>>,
    /// Startup recovery's queue (`queue.rs`).
    pub(crate) queue: StdMutex<crate::pass::RecoveryQueue>,
    pub(crate) queue_phase: tokio::sync::watch::Sender<crate::pass::Phase>,
    /// How many calls' recoveries run now (the pass yields to them).
    pub(crate) calls_recovering: tokio::sync::watch::Sender<usize>,
    /// This replica's leases and fencing tokens (`lease.rs`).
    pub(crate) leases: crate::lease::Leases,
    /// Test hook: awaited before each heartbeat (see `gate_heartbeat`).
    pub(crate) heartbeat_gate: StdMutex<Option<crate::pass::PassGate>>,
    /// This replica's lease claims, one at a time (`replica.rs`): a call
    /// never claims again what the adoption loop just claimed.
    pub(crate) claims: tokio::sync::Mutex<()>,
    /// Sessions the adoption loop claimed and has yet to recover
    /// (`replica.rs`): a call on one joins (or starts) its recovery.
    pub(crate) adoptions: StdMutex<HashMap<SessionId, crate::lease::Adoption>>,
}

/// Runs sessions: create, message, stop; recovers them at startup; resumes
/// them on request; answers their status; publishes their events.
///
/// Cheap to clone: all clones share one state. Background work (update
/// pumps, remote reconnects, liveness checks) runs on tokio tasks that
/// [`SessionManager::shutdown`] aborts, leaving executors running, as a
/// backend that stops must.
///
/// Driving a session from Rust (the `drive_sessions` example of this crate
/// is the full, tested version, restart included):
///
/// ```no_run
/// use std::{collections::BTreeMap, sync::Arc};
///
/// use futures::StreamExt;
/// use sessiond_domain::{AgentProfileId, Runtime, TaskId, Worktree};
/// use sessiond_executor::{
///     Executor,
///     standalone::{StandaloneConfig, StandaloneExecutor},
/// };
/// use sessiond_engine::{ManagerConfig, NewSession, SessionManager};
/// use sessiond_store::{Store, StoreOptions};
///
/// # async fn run(task_id: TaskId, profile_id: AgentProfileId)
/// #     -> Result<(), Box<dyn std::error::Error>> {
/// let store = Store::connect("sqlite:///var/lib/sessiond/sessiond.db", StoreOptions::default()).await?;
/// let driver = StandaloneExecutor::new(StandaloneConfig::new(
///     "/usr/local/bin/agentctl".into(),
///     "/run/sessiond".into(),
/// ));
/// let drivers: Vec<Arc<dyn Executor>> = vec![Arc::new(driver)];
/// let manager = SessionManager::new(store, drivers, ManagerConfig::default());
///
/// // After a restart: reattach to, or resume, what ran before.
/// let summary = manager.recover_all().await?;
/// println!("recovered: {:?}", summary.counts);
///
/// let session = manager
///     .create_session(NewSession {
///         task_id,
///         agent_profile_id: profile_id,
///         runtime: Runtime::LocalStandalone,
///         worktree: Worktree {
///             id: "main".into(),
///             path: "/home/me/repo".into(),
///             branch: "main".into(),
///             ..Default::default()
///         },
///         remote: None,
///         metadata: BTreeMap::new(),
///         mcp_servers: Vec::new(),
///     })
///     .await?;
/// let mut events = manager.watch_session(session.id, 0).await?;
/// manager.send_message(task_id, session.id, "hello").await?;
/// while let Some(event) = events.next().await {
///     let event = event?;
///     println!("{} {:?}", event.seq, event.payload);
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct SessionManager {
    pub(crate) inner: Arc<Inner>,
}

impl fmt::Debug for SessionManager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SessionManager")
            .field("store", &self.inner.store)
            .field("runtimes", &self.inner.drivers.keys().collect::<Vec<_>>())
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl SessionManager {
    /// A manager over `store` with one driver per runtime it should serve.
    pub fn new(
        store: Store,
        drivers: impl IntoIterator<Item = Arc<dyn Executor>>,
        config: ManagerConfig,
    ) -> Self {
        let drivers = drivers.into_iter().map(|d| (d.runtime(), d)).collect();
        let metrics = Arc::new(crate::metrics::ManagerMetrics::default());
        let bus = EventBus::with_metrics(config.event_buffer, metrics.watch.clone());
        let launches = crate::launches::LaunchScheduler::new(config.launches);
        let leases = crate::lease::Leases::new(config.replica.exclusive, config.replica.id.clone());
        if !config.replica.exclusive {
            // Other replicas' watchers are woken by what we commit.
            store.announce_events_as(&config.replica.id);
        }
        Self {
            inner: Arc::new(Inner {
                store,
                drivers,
                bus,
                config,
                counters: Counters::default(),
                metrics,
                sessions: Sessions::default(),
                recovery_profiles: StdMutex::default(),
                create_gate: tokio::sync::Mutex::default(),
                background: StdMutex::default(),
                next_op: AtomicU64::new(1),
                liveness_started: std::sync::atomic::AtomicBool::new(false),
                started_at: chrono::Utc::now(),
                first_recovery: tokio::sync::watch::Sender::new(false),
                workspaces_back: tokio::sync::watch::Sender::new(false),
                launches,
                agent_recoveries: crate::progress::AgentRecoveries::default(),
                pass_slots: StdMutex::default(),
                pass_outcomes: StdMutex::default(),
                queue: StdMutex::default(),
                queue_phase: tokio::sync::watch::Sender::new(crate::pass::Phase::Idle),
                calls_recovering: tokio::sync::watch::Sender::new(0),
                leases,
                heartbeat_gate: StdMutex::default(),
                claims: tokio::sync::Mutex::new(()),
                adoptions: StdMutex::default(),
            }),
        }
    }

    /// The store the manager writes through.
    pub fn store(&self) -> &Store {
        &self.inner.store
    }

    /// The runtimes a driver is registered for (built-in and custom), in
    /// order.
    pub fn runtimes(&self) -> Vec<Runtime> {
        let mut runtimes: Vec<Runtime> = self.inner.drivers.keys().copied().collect();
        runtimes.sort();
        runtimes
    }

    /// The configuration it was built with.
    pub fn config(&self) -> &ManagerConfig {
        &self.inner.config
    }

    /// The operator's metric families (turns, agent exits, launches,
    /// resumes, reconnects, watch streams); the server registers them.
    pub fn metrics(&self) -> &crate::metrics::ManagerMetrics {
        &self.inner.metrics
    }

    /// The publisher; `publish` only what was committed.
    pub fn events(&self) -> &EventBus {
        &self.inner.bus
    }

    /// Counters since this manager was built (for tests and benches).
    pub fn stats(&self) -> Stats {
        let c = &self.inner.counters;
        Stats {
            agentctl_launches: c.agentctl_launches.load(Ordering::Relaxed),
            agent_launches: c.agent_launches.load(Ordering::Relaxed),
            resume_attempts: c.resume_attempts.load(Ordering::Relaxed),
            resumed_by_recover: c.resumed_by_recover.load(Ordering::Relaxed),
        }
    }

    /// The executors cache entry of a session, if any.
    pub fn execution(&self, session: SessionId) -> Option<Execution> {
        self.inner.sessions.execution(session)
    }

    /// Stops all background work of this manager (update pumps, reconnects,
    /// liveness checks, operations in flight) and leaves every executor and
    /// agent running: what a backend shutting down (or crashing) does.
    pub fn shutdown(&self) {
        self.inner.sessions.shutdown();
        for h in lock(&self.inner.background).drain(..) {
            h.abort();
        }
    }

    /// Session state and its execution's status, for this session only
    /// (GetSessionStatus).
    ///
    /// Answered from memory: the session row and the profile's claim come
    /// from the status snapshot (loaded from the store on first use, in one
    /// round trip, then replaced by every `SessionManager::commit`), the
    /// execution from the executors cache, or, for a session this manager
    /// never wrote, from the record loaded with the snapshot.
    pub async fn session_status(&self, task: TaskId, session: SessionId) -> Result<SessionStatus> {
        // While an exclusive store's pass loads its executors, answer at
        // once from the records (a live executor is about to be recovered)
        // instead of waiting for the load of all of them.
        let loading = self.answers_while_loading();
        if !loading {
            self.queue_filled().await;
        }
        // Another replica's session changes under us: read what it committed.
        let elsewhere = !crate::replica::Fencing(self).owns(session);
        let (cached, cached_view) = if elsewhere {
            (None, None)
        } else {
            self.inner.sessions.status_and_view(session)
        };
        let snap = match cached {
            Some(e) => e,
            None if elsewhere => self.read_status_inputs(session).await?,
            None => self.load_status_inputs(session).await?,
        };
        let s = &snap.session;
        if s.task_id != task {
            return Err(Error::WrongTask {
                session_id: session,
                requested: task,
                actual: s.task_id,
            });
        }
        let view = cached_view.or(snap.record);
        let status = sessiond_domain::session_status(s, view.as_ref(), snap.profile_claim);
        if !elsewhere
            && let Some(progress) = self.inner.agent_recoveries.view(
                session,
                self.inner.config.max_attempts,
                self.inner.launches.place(session),
            )
            // An ERROR is committed a moment before the last attempt's
            // progress is dropped: it ended the recovery already.
            && !s.state.is_terminal()
            && s.state != sessiond_domain::SessionState::Error
        {
            return Ok(status.agent_recovering(progress));
        }
        let recovering = if loading {
            self.recovering_while_loading(session, view.as_ref())
        } else {
            self.is_recovering(session)
        };
        Ok(if recovering {
            status.recovering()
        } else {
            status
        })
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

    pub(crate) async fn status_of(&self, s: &Session) -> Result<SessionStatus> {
        let profile = self
            .inner
            .store
            .get_agent_profile(s.agent_profile_id)
            .await?;
        let view = match self.execution(s.id) {
            Some(e) => Some(e.view()),
            None => self
                .inner
                .store
                .get_executor_for_session(s.id)
                .await?
                .map(|r| ExecutionView::from_record(&r)),
        };
        Ok(sessiond_domain::session_status(
            s,
            view.as_ref(),
            profile.supports_session_resume,
        ))
    }

    /// The session's events after `after_seq` from the outbox, then live
    /// ones; no gap, no duplicate. Fails at once if the session does not exist.
    pub async fn watch_session(&self, session: SessionId, after_seq: i64) -> Result<EventStream> {
        self.inner.store.get_session(session).await?;
        Ok(events::watch_session(
            self.inner.store.clone(),
            &self.inner.bus,
            session,
            after_seq,
            self.inner.config.replay_page,
        ))
    }

    /// Events of every session of the task after `after_task_seq`, then live.
    pub async fn watch_task(&self, task: TaskId, after_task_seq: i64) -> Result<EventStream> {
        self.inner.store.get_task(task).await?;
        Ok(events::watch_task(
            self.inner.store.clone(),
            &self.inner.bus,
            task,
            after_task_seq,
            self.inner.config.replay_page,
        ))
    }

    // ------------------------------------------------------------ helpers

    pub(crate) async fn session_of_task(
        &self,
        task: TaskId,
        session: SessionId,
    ) -> Result<Session> {
        let s = self.inner.store.get_session(session).await?;
        if s.task_id != task {
            return Err(Error::WrongTask {
                session_id: session,
                requested: task,
                actual: s.task_id,
            });
        }
        Ok(s)
    }

    pub(crate) fn driver(&self, runtime: Runtime) -> Result<Arc<dyn Executor>> {
        self.inner.drivers.get(&runtime).cloned().ok_or_else(|| {
            Error::Unavailable(format!(
                "no executor driver is configured for runtime {runtime}"
            ))
        })
    }

    pub(crate) fn client(&self, record: &ExecutorRecord) -> Result<AgentctlClient> {
        let driver = self.driver(record.runtime)?;
        Ok(self.agentctl(record, &driver)?)
    }

    /// The client of the record's agentctl, made once per address and
    /// secret and then reused (health, capabilities, resume, update pump),
    /// so a session's calls share one HTTP/2 connection instead of opening
    /// one each.
    pub(crate) fn agentctl(
        &self,
        record: &ExecutorRecord,
        driver: &Arc<dyn Executor>,
    ) -> sessiond_executor::Result<AgentctlClient> {
        let url = record.agentctl_url.as_deref().unwrap_or_default();
        let sessions = &self.inner.sessions;
        if let Some(c) = sessions.client(record.session_id, url, &record.auth_secret) {
            // A claim since the client was made: calls carry the new epoch.
            c.raise_lease_epoch(record.lease_epoch);
            return Ok(c);
        }
        let client = driver.client(&ExecutorHandle::from_record(record))?;
        sessions.keep_client(record.session_id, url, &record.auth_secret, client.clone());
        Ok(client)
    }

    /// The cached client of the record's agentctl, if one is cached for the
    /// same address and secret (never creates or caches one).
    pub(crate) fn cached_agentctl(&self, record: &ExecutorRecord) -> Option<AgentctlClient> {
        let url = record.agentctl_url.as_deref().unwrap_or_default();
        self.inner
            .sessions
            .client(record.session_id, url, &record.auth_secret)
    }

    /// This replica: its id, leases, start and handoff.
    pub fn replica(&self) -> crate::replica::Replica<'_> {
        crate::replica::Replica(self)
    }

    /// Whether the session's updates are parked (no pump, no stream open).
    pub fn is_parked(&self, session: SessionId) -> bool {
        self.inner.sessions.is_parked(session)
    }

    /// Commits (fenced by this replica's lease, see
    /// [`SessionManager::store_commit`]) and then publishes what was committed.
    pub(crate) async fn commit(&self, change: Changeset) -> Result<Committed> {
        let committed = crate::replica::Fencing(self)
            .store_commit(change)
            .await
            .map_err(|e| crate::replica::Fencing(self).lease_error(e))?;
        self.after_commit(&committed);
        Ok(committed)
    }

    /// What every commit of this manager is followed by: the cache and the
    /// status snapshot take the stored rows, watchers get the events.
    pub(crate) fn after_commit(&self, committed: &Committed) {
        if let Some(record) = &committed.executor {
            self.inner.sessions.cache_record(record);
        }
        self.inner.sessions.status_committed(committed);
        self.inner.bus.publish(&committed.events);
        if let Some(session) = &committed.session {
            self.queue_after_commit(session);
        }
    }

    /// Serializes state changes of one session within this manager.
    pub(crate) async fn lock_session(&self, session: SessionId) -> OwnedMutexGuard<()> {
        self.inner.sessions.lock_of(session).lock_owned().await
    }

    pub(crate) fn cache_update(&self, session: SessionId, f: impl FnOnce(&mut Execution)) {
        let (was_running, running, queued) = self.inner.sessions.update_execution(session, f);
        // The agent is back: messages queued while it was away can go.
        if running && !was_running && queued {
            self.kick_queue(session);
        }
        // An agent that stopped (or is starting again) takes its modes
        // along; one now running keeps what its conversation's opening
        // answered (`new_conversation`, `load_conversation`).
        if !running {
            self.inner.sessions.forget_modes(session);
        }
    }

    pub(crate) fn cache_remove(&self, session: SessionId) {
        self.inner.sessions.remove_execution(session);
    }

    /// Checks that `session` exists and belongs to `task`, as
    /// [`Self::session_of_task`] does, from the status snapshot when it
    /// holds the session (a session's task never changes, and a removed
    /// session leaves the snapshot): no store read on a call's hot path.
    pub(crate) async fn check_task(&self, task: TaskId, session: SessionId) -> Result<()> {
        let known = crate::replica::Fencing(self).owns(session)
            && self
                .inner
                .sessions
                .status(session)
                .is_some_and(|e| e.session.task_id == task);
        if !known {
            self.session_of_task(task, session).await?;
        }
        Ok(())
    }

    /// Records that a startup recovery pass has finished.
    pub(crate) fn mark_first_recovery_done(&self) {
        self.inner.workspaces_back.send_replace(true);
        self.inner.first_recovery.send_replace(true);
    }

    /// Records that the first pass has every workspace back.
    pub(crate) fn mark_workspaces_back(&self) {
        self.inner.workspaces_back.send_replace(true);
    }

    /// Whether the first startup recovery pass has every executor's
    /// workspace back (reattached, relaunched up to the agent, or failed):
    /// what health reports SERVING on. Agents may still be relaunching;
    /// their sessions show `recovering` with their progress.
    pub fn workspaces_recovered(&self) -> bool {
        *self.inner.workspaces_back.borrow()
    }

    /// Waits until [`Self::workspaces_recovered`].
    pub async fn wait_workspaces_recovered(&self) {
        let mut rx = self.inner.workspaces_back.subscribe();
        let _ = rx.wait_for(|done| *done).await;
    }

    /// Whether a startup recovery pass of this manager has finished.
    pub fn first_recovery_done(&self) -> bool {
        *self.inner.first_recovery.borrow()
    }

    /// Waits until a startup recovery pass of this manager has finished.
    pub(crate) async fn wait_first_recovery(&self) {
        let mut rx = self.inner.first_recovery.subscribe();
        let _ = rx.wait_for(|done| *done).await;
    }

    /// Registers a background task so `shutdown` can end it.
    pub(crate) fn spawn_background<F>(&self, fut: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let h = tokio::spawn(fut);
        let mut bg = lock(&self.inner.background);
        bg.retain(|h| !h.is_finished());
        bg.push(h.abort_handle());
        h
    }

    /// Runs `op` as the one exclusive operation of `session`, or joins the
    /// one already in flight. The operation runs on its own task, so a caller
    /// that goes away does not cut it short. Returns the shared outcome and
    /// the kind of the operation that was joined or started.
    pub(crate) fn single_flight(
        &self,
        session: SessionId,
        kind: OpKind,
        op: BoxFuture<'static, Result<OpOutcome>>,
    ) -> (OpKind, SharedOp) {
        let id = self.inner.next_op.fetch_add(1, Ordering::Relaxed);
        self.inner.sessions.join_or_start(session, id, kind, || {
            let me = self.clone();
            // In the first caller's span: the operation belongs to its trace.
            let task = tokio::spawn(tracing::Instrument::in_current_span(async move {
                let out = op.await;
                me.inner.sessions.end_op(session, id);
                out
            }));
            lock(&self.inner.background).push(task.abort_handle());
            async move {
                task.await
                    .map_err(|e| Error::Internal(format!("session operation ended: {e}")))?
            }
            .boxed()
            .shared()
        })
    }
}
