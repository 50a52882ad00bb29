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
use sessiond_domain::{Runtime, Session, SessionId, TaskId};
use sessiond_executor::Executor;
use sessiond_store::{Changeset, Committed, Store};
use tokio::task::AbortHandle;

use crate::{
    config::ManagerConfig,
    error::{Error, Result},
    events::{self, EventBus, EventStream},
    flows::QueuedMessages,
    lease::Fencing,
    sessions::{Execution, OpKind, OpOutcome, Sessions, SharedOp},
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
    /// Shared: each recovery holds its profile, which few of them change.
    pub(crate) recovery_profiles:
        StdMutex<HashMap<sessiond_domain::AgentProfileId, Arc<sessiond_domain::AgentProfile>>>,
    /// Held by a create from counting live sessions to committing its
    /// intent, so concurrent creates cannot all slip under the limit.
    pub(crate) create_gate: tokio::sync::Mutex<()>,
    /// Held by a create that names its worktree's branch, from its check
    /// that the branch is free until `git worktree add` made it: two such
    /// creates (of one branch) would both pass the check, and the loser's
    /// ERROR session would name the winner's branch (helper-38 1).
    /// Branches sessiond names carry the session's id and never clash.
    pub(crate) named_branch_gate: tokio::sync::Mutex<()>,
    background: StdMutex<Vec<AbortHandle>>,
    next_op: AtomicU64,
    pub liveness_started: std::sync::atomic::AtomicBool,
    /// When this manager (the backend) started: a remote host's reconnect
    /// window is never counted from before it, so an outage of the backend
    /// longer than the window does not use the window up.
    pub started_at: chrono::DateTime<chrono::Utc>,
    /// Becomes true when the first `recover_all` of this manager finished.
    pub(crate) first_recovery: tokio::sync::watch::Sender<bool>,
    /// Becomes true when the first pass has every workspace back (each
    /// executor reattached, relaunched up to its agent's launch, or failed):
    /// the backend serves from then on while agents still relaunch.
    pub(crate) workspaces_back: tokio::sync::watch::Sender<bool>,
    /// Admission of agent launches per host (`launches.rs`).
    pub(crate) launches: crate::launches::LaunchScheduler,
    /// Where each session's agent recovery stands (`progress.rs`).
    pub(crate) agent_recoveries: crate::progress::AgentRecoveries,
    /// Messages sent to sessions whose agent is brought back (`turn/letters.rs`).
    pub(crate) mailboxes: crate::mailboxes::Mailboxes,
    /// Sessions whose pump has a turn a restart left RUNNING to settle, by
    /// the pumps that have (`turn/settle.rs`): a call that would start a
    /// turn waits for its fate instead of finding it RUNNING.
    pub(crate) settling: tokio::sync::watch::Sender<HashMap<SessionId, usize>>,
    /// Restarts of agents that exited by themselves (`restarts.rs`).
    pub(crate) agent_restarts: crate::restarts::AgentRestarts,
    /// The pass's slots held by its recoveries, by session: a recovery
    /// gives its slot back when it starts waiting for a launch, so the
    /// pass's concurrency goes on to reattaches (`recovery.rs`).
    pub(crate) pass_slots: StdMutex<HashMap<SessionId, crate::pass::PassTicket>>,
    /// Sessions whose running recovery has their workspace back.
    pub(crate) workspaces_ready: crate::pass::WorkspacesReady,
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
    /// Whether the database answered this replica lately (see
    /// `database_seen::DatabaseSeen`): adoption waits while it does not.
    pub(crate) database_seen: StdMutex<crate::database_seen::DatabaseSeen>,
    /// Wakes the adoption loop: another replica released its leases.
    pub(crate) adoption_wake: tokio::sync::Notify,
    /// Test hook: awaited by a pump that recorded a lost agentctl, before
    /// it starts the background recovery (see `gate_lost_agentctl`).
    pub(crate) lost_agentctl_gate: StdMutex<Option<crate::pass::PassGate>>,
    /// Test hook: while set, idle pumps do not park (see `hold_parking`).
    pub(crate) parking_held: std::sync::atomic::AtomicBool,
    /// This replica's lease claims, one at a time (`replica.rs`): a call
    /// never claims again what the adoption loop just claimed.
    pub(crate) claims: tokio::sync::Mutex<()>,
    /// Sessions whose agent's modes a status is asking for now
    /// (`status.rs`): one question per session at a time.
    pub(crate) modes_asked: StdMutex<std::collections::HashSet<SessionId>>,
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
/// let summary = manager.recovery().recover_all().await?;
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
                named_branch_gate: tokio::sync::Mutex::default(),
                background: StdMutex::default(),
                next_op: AtomicU64::new(1),
                liveness_started: std::sync::atomic::AtomicBool::new(false),
                started_at: chrono::Utc::now(),
                first_recovery: tokio::sync::watch::Sender::new(false),
                workspaces_back: tokio::sync::watch::Sender::new(false),
                launches,
                agent_recoveries: crate::progress::AgentRecoveries::default(),
                mailboxes: crate::mailboxes::Mailboxes::default(),
                settling: tokio::sync::watch::Sender::new(HashMap::new()),
                agent_restarts: crate::restarts::AgentRestarts::default(),
                pass_slots: StdMutex::default(),
                workspaces_ready: crate::pass::WorkspacesReady::default(),
                pass_outcomes: StdMutex::default(),
                queue: StdMutex::default(),
                queue_phase: tokio::sync::watch::Sender::new(crate::pass::Phase::Idle),
                calls_recovering: tokio::sync::watch::Sender::new(0),
                leases,
                heartbeat_gate: StdMutex::default(),
                database_seen: StdMutex::default(),
                adoption_wake: tokio::sync::Notify::new(),
                lost_agentctl_gate: StdMutex::default(),
                parking_held: std::sync::atomic::AtomicBool::new(false),
                claims: tokio::sync::Mutex::new(()),
                modes_asked: StdMutex::default(),
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

    /// Names a session ([`Store::set_session_title`]: the title is a column
    /// no session update writes) and keeps this manager's status snapshot
    /// of it current: a turn started from the snapshot names an untitled
    /// session by its prompt, so it must see a title cleared here. Only the
    /// owner's snapshot is kept, so `sessiond serve` calls this on the
    /// session's owner (SetSessionTitle is forwarded like any command).
    /// Returns the session as stored, and whether the title was written.
    pub async fn set_session_title(
        &self,
        session: SessionId,
        title: String,
        source: sessiond_domain::TitleSource,
    ) -> Result<(Session, bool)> {
        self.to_completion(move |m| async move {
            m.set_session_title_inner(session, title, source).await
        })
        .await
    }

    async fn set_session_title_inner(
        &self,
        session: SessionId,
        title: String,
        source: sessiond_domain::TitleSource,
    ) -> Result<(Session, bool)> {
        let (stored, written) = self
            .inner
            .store
            .set_session_title(session, title, source)
            .await?;
        self.inner.sessions.status_committed(&Committed {
            session: Some(stored.clone()),
            ..Committed::default()
        });
        Ok((stored, written))
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

    /// Whether the session's update pump runs now: reading its agent's
    /// updates over an open stream (an idle session's is parked, holding
    /// no stream and no connection).
    pub fn has_update_pump(&self, session: SessionId) -> bool {
        self.inner.sessions.has_pump(session)
    }

    /// While `held`, an idle session's update pump stays up instead of
    /// parking (it still does everything else at its idle check). For
    /// tests that must act on a session whose stream is open.
    #[cfg(feature = "test-hooks")]
    pub fn hold_parking(&self, held: bool) {
        self.inner
            .parking_held
            .store(held, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the session's updates are parked (no pump, no stream open).
    pub fn is_parked(&self, session: SessionId) -> bool {
        self.inner.sessions.is_parked(session)
    }

    /// Commits (fenced by this replica's lease, see
    /// [`Fencing::store_commit`](crate::lease::Fencing::store_commit)) and then publishes what was committed.
    pub(crate) async fn commit(&self, change: Changeset) -> Result<Committed> {
        let committed = Fencing(self)
            .store_commit(change)
            .await
            .map_err(|e| Fencing(self).lease_error(e))?;
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

    /// Checks that `session` exists and belongs to `task`, as
    /// [`Self::session_of_task`] does, from the status snapshot when it
    /// holds the session (a session's task never changes, and a removed
    /// session leaves the snapshot): no store read on a call's hot path.
    pub(crate) async fn check_task(&self, task: TaskId, session: SessionId) -> Result<()> {
        let known = Fencing(self).owns(session)
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

    /// True when an agent exit seen on STARTING `session` belongs to the
    /// work bringing its agent up (a restart decided by an earlier exit, a
    /// recovery launching or waiting to retry, an explicit resume): that
    /// work decides, with its own retries, not the exit.
    pub(crate) fn exit_belongs_to_recovery(&self, session: &Session) -> bool {
        session.state == sessiond_domain::SessionState::Starting
            && (self.inner.agent_restarts.pending(session.id)
                || self.inner.agent_recoveries.under_way(session.id)
                || self.inner.sessions.inflight(session.id).is_some())
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

    /// Runs a call's `work` on a task of its own and waits for it. A caller
    /// that goes away mid-call (a client's deadline or closed connection
    /// drops the handler's future, as does an embedder's `timeout`) would
    /// otherwise cut the work between a commit and what must follow it:
    /// the status snapshot and the events, a turn's Prompt, an agent's
    /// stop. The work ends as if the caller had stayed; a shutdown of the
    /// manager ends it with the rest of its work, as a crash would, for the
    /// next start to recover.
    pub(crate) async fn to_completion<T, W>(
        &self,
        work: impl FnOnce(SessionManager) -> W,
    ) -> Result<T>
    where
        W: Future<Output = Result<T>> + Send + 'static,
        T: Send + 'static,
    {
        let work = tracing::Instrument::in_current_span(work(self.clone()));
        match self.spawn_background(work).await {
            Ok(done) => done,
            Err(e) if e.is_cancelled() => Err(Error::Unavailable(
                "sessiond stopped before the call finished; what it had done is recovered at \
                 its next start"
                    .into(),
            )),
            Err(e) => Err(Error::Internal(format!("the call's task failed: {e}"))),
        }
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

/// A session's status from its record, the executions cache (else the
/// store) and its profile's resume claim: what explicit resume and a
/// refused turn answer with.
pub(crate) async fn status_of(
    manager: &SessionManager,
    s: &Session,
) -> Result<sessiond_domain::SessionStatus> {
    let profile = manager
        .inner
        .store
        .get_agent_profile(s.agent_profile_id)
        .await?;
    let view = match manager.execution(s.id) {
        Some(e) => Some(e.view()),
        None => manager
            .inner
            .store
            .get_executor_for_session(s.id)
            .await?
            .map(|r| sessiond_domain::ExecutionView::from_record(&r)),
    };
    Ok(sessiond_domain::session_status(
        s,
        view.as_ref(),
        profile.supports_session_resume,
    ))
}
