//! The per-session record: what this manager keeps in memory about each
//! session, in one map behind one lock ([`Sessions`]). Leases live with the
//! replica's leases (`replica.rs`), a recovery pass's slots with the pass.
//!
//! Every method holds the lock only for its own short, synchronous step and
//! calls nothing that takes it again.

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex as StdMutex, MutexGuard},
};

use futures::future::{BoxFuture, Shared};
use sessiond_domain::{
    AgentModes, AgentProcessState, ExecutionView, ExecutorRecord, MetadataStatus, Session,
    SessionId,
};
use sessiond_executor::AgentctlClient;
use sessiond_store::Committed;
use tokio::task::AbortHandle;

use crate::error::Result;

/// What the in-memory executors cache knows of one session's execution.
#[derive(Debug, Clone)]
pub struct Execution {
    /// The executor record as last written by this manager.
    pub record: ExecutorRecord,
    /// The agent process as last seen (Health, the update stream, or our own calls).
    pub agent: AgentProcessState,
    /// The capability probe's answer, once the agent answered `initialize`.
    pub probe: Option<bool>,
    /// `record.execution_id()` and the generation it was formatted for:
    /// every status read needs it, formatting it each time costs more
    /// than the rest of the read.
    formatted_id: (sessiond_domain::ExecutorId, i64, String),
}

impl Execution {
    fn new(record: ExecutorRecord) -> Execution {
        let formatted_id = (record.id, record.generation, record.execution_id());
        Execution {
            record,
            agent: AgentProcessState::NotRunning,
            probe: None,
            formatted_id,
        }
    }

    /// [`ExecutorRecord::execution_id`] of the record.
    pub fn execution_id(&self) -> String {
        let (id, generation, formatted) = &self.formatted_id;
        if *id == self.record.id && *generation == self.record.generation {
            formatted.clone()
        } else {
            self.record.execution_id()
        }
    }

    /// Formats the execution id again if the record moved on.
    fn keep_id(&mut self) {
        let (id, generation, _) = &self.formatted_id;
        if *id != self.record.id || *generation != self.record.generation {
            self.formatted_id = (
                self.record.id,
                self.record.generation,
                self.record.execution_id(),
            );
        }
    }

    /// What [`sessiond_domain::session_status`] needs of it; the probe's
    /// answer, when known, stands for the record's resume flag.
    pub fn view(&self) -> ExecutionView {
        ExecutionView {
            session_id: self.record.session_id,
            execution_id: self.execution_id(),
            executor_status: self.record.status,
            agent: self.agent,
            supports_session_resume: self.probe.or(Some(self.record.supports_session_resume)),
            retrying: sessiond_domain::retrying_message(&self.record),
        }
    }
}

/// What `GetSessionStatus` reads of one session, kept in memory.
#[derive(Debug, Clone)]
pub(crate) struct StatusEntry {
    /// The session row as last committed (or loaded).
    pub session: Arc<Session>,
    /// Its metadata's part of a status, parsed once per version instead of
    /// at every status read.
    pub metadata: MetadataStatus,
    /// The agent profile's `supports_session_resume` (profiles are written
    /// at startup, before the manager serves).
    pub profile_claim: bool,
    /// The executor record as loaded or last committed; the executors cache
    /// wins over it when it knows the session.
    pub record: Option<ExecutionView>,
}

/// [`Sessions::status_read`]'s answer.
#[derive(Debug, Default)]
pub(crate) struct StatusRead {
    pub entry: Option<StatusEntry>,
    pub view: Option<ExecutionView>,
    pub modes: CachedModes,
}

/// A session's agent modes as the cache knows them.
#[derive(Debug, Default)]
pub(crate) enum CachedModes {
    /// No agent runs on a ready executor: it has no modes to show.
    #[default]
    NoAgent,
    /// Its agent runs; these are its modes (`None`: it has none).
    Known(Option<AgentModes>),
    /// Its agent runs and its modes are not cached: ask it.
    Ask,
}

/// Where a parked update pump stopped reading: the next pump of the session
/// continues from `cursor` if the executor is still at `generation` and its
/// agentctl still the process `instance` (empty: not known).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Parked {
    pub generation: i64,
    pub cursor: u64,
    pub instance: String,
}

/// The result of one exclusive operation on a session, shared by everyone
/// who joined it.
#[derive(Debug, Clone)]
pub(crate) enum OpOutcome {
    /// Startup or background recovery ended with this label.
    Recovery(sessiond_domain::OutcomeLabel),
    /// An explicit resume ended with this status.
    Resume(Box<sessiond_domain::SessionStatus>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OpKind {
    Recovery,
    Resume,
}

pub(crate) type SharedOp = Shared<BoxFuture<'static, Result<OpOutcome>>>;

struct Inflight {
    id: u64,
    kind: OpKind,
    fut: SharedOp,
}

/// The agent's session modes as last read, good for the execution it was
/// read from (`ExecutorRecord::execution_id`). Each drop stamps the slot
/// (and a removed record counts in `modes_removals`), so an answer read
/// before a drop is not kept after it.
#[derive(Default)]
struct ModesSlot {
    stamp: u64,
    value: Option<(String, Option<AgentModes>)>,
}

/// Where the modes cache stood when an answer was asked for.
pub(crate) type ModesStamp = (u64, u64);

/// Everything kept in memory about one session.
#[derive(Default)]
struct SessionRecord {
    /// The executors cache entry.
    execution: Option<Execution>,
    /// The status snapshot entry (see [`Sessions::begin_status_load`]).
    status: Option<StatusEntry>,
    /// The agent's session modes, so a status call does not ask agentctl
    /// every time. Dropped whenever what it reflects may have changed (the
    /// agent stopped or is starting, the session left the cache, the agent
    /// reported a mode change, a mode is being set).
    modes: ModesSlot,
    /// The agentctl client and the (url, secret) it was made for.
    client: Option<(String, String, AgentctlClient)>,
    /// Where the parked update pump stopped (idle, no stream open).
    parked: Option<Parked>,
    /// Serializes state changes of the session within this manager.
    lock: Option<Arc<tokio::sync::Mutex<()>>>,
    /// Serializes deletes of the session: each checks what it would remove
    /// and removes it, or finds the session deleted, whole.
    removal: Option<Arc<tokio::sync::Mutex<()>>>,
    /// The exclusive operation (recovery or resume) in flight.
    inflight: Option<Inflight>,
    /// The update pump's task.
    pump: Option<AbortHandle>,
    /// A background retry or reconnect of the session's executor runs.
    retrying: bool,
}

#[derive(Default)]
struct Table {
    records: HashMap<SessionId, SessionRecord>,
    /// Moves whenever a commit or removal could make an in-flight status
    /// load stale; such a load is then not kept.
    status_generation: u64,
    /// While the status snapshot loads: the sessions a commit or removal
    /// touched meanwhile, whose rows it must not keep.
    priming: Option<HashSet<SessionId>>,
    modes_next: u64,
    modes_removals: u64,
}

impl Table {
    fn record(&mut self, session: SessionId) -> &mut SessionRecord {
        self.records.entry(session).or_default()
    }

    /// A commit or removal of `session` that an in-flight load may predate.
    fn status_missed(&mut self, session: SessionId) {
        self.status_generation += 1;
        if let Some(touched) = &mut self.priming {
            touched.insert(session);
        }
    }

    fn modes_stamp(&self, session: SessionId) -> ModesStamp {
        (
            self.modes_removals,
            self.records.get(&session).map_or(0, |r| r.modes.stamp),
        )
    }
}

/// The per-session records of one manager.
#[derive(Default)]
pub(crate) struct Sessions {
    table: StdMutex<Table>,
}

impl Sessions {
    fn table(&self) -> MutexGuard<'_, Table> {
        self.table
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    // ------------------------------------------------------ executions

    /// The executors cache entry of a session, if any.
    pub fn execution(&self, session: SessionId) -> Option<Execution> {
        self.table()
            .records
            .get(&session)
            .and_then(|r| r.execution.clone())
    }

    /// The cached executions `pick` keeps, in no order.
    pub fn executions<T>(&self, mut pick: impl FnMut(&Execution) -> Option<T>) -> Vec<T> {
        self.table()
            .records
            .values()
            .filter_map(|r| r.execution.as_ref().and_then(&mut pick))
            .collect()
    }

    /// Keeps the cache's record current (the agent and probe are kept).
    pub fn cache_record(&self, record: &ExecutorRecord) {
        let mut t = self.table();
        let r = t.record(record.session_id);
        match &mut r.execution {
            Some(e) => {
                // In place: the cached copy's strings keep their buffers.
                e.record.clone_from(record);
                e.keep_id();
            }
            None => r.execution = Some(Execution::new(record.clone())),
        }
    }

    /// Applies `f` to the session's cached execution, if any. Returns
    /// whether the agent ran before and after, and whether the session has
    /// messages queued (from the status snapshot).
    pub fn update_execution(
        &self,
        session: SessionId,
        f: impl FnOnce(&mut Execution),
    ) -> (bool, bool, bool) {
        let mut t = self.table();
        let Some(r) = t.records.get_mut(&session) else {
            return (false, false, false);
        };
        let Some(e) = &mut r.execution else {
            return (false, false, false);
        };
        let was = e.agent == AgentProcessState::Running;
        f(e);
        e.keep_id();
        let now = e.agent == AgentProcessState::Running;
        let queued = r
            .status
            .as_ref()
            .is_some_and(|s| !sessiond_domain::queue::is_empty(&s.session.metadata));
        (was, now, queued)
    }

    /// The session left the cache: its execution, modes, client, parked
    /// position and status entry go.
    pub fn remove_execution(&self, session: SessionId) {
        let mut t = self.table();
        t.modes_removals += 1;
        if let Some(r) = t.records.get_mut(&session) {
            r.execution = None;
            r.modes = ModesSlot::default();
            r.client = None;
            r.parked = None;
            r.status = None;
        }
        t.status_missed(session);
    }

    // ------------------------------------------------------ status snapshot

    /// The session's status entry, if the snapshot holds it.
    pub fn status(&self, session: SessionId) -> Option<StatusEntry> {
        self.table()
            .records
            .get(&session)
            .and_then(|r| r.status.clone())
    }

    /// What a status read needs of one session, in one look: the status
    /// entry, the cached execution's view, and the agent's modes as cached
    /// for that execution.
    pub fn status_read(&self, session: SessionId) -> StatusRead {
        let t = self.table();
        let Some(r) = t.records.get(&session) else {
            return StatusRead::default();
        };
        let view = r.execution.as_ref().map(Execution::view);
        let modes = match (&r.execution, &view) {
            (Some(e), Some(v))
                if e.record.status == sessiond_domain::ExecutorStatus::Ready
                    && e.agent == AgentProcessState::Running =>
            {
                match r.modes.value.as_ref() {
                    Some((execution, modes)) if *execution == v.execution_id => {
                        CachedModes::Known(modes.clone())
                    }
                    _ => CachedModes::Ask,
                }
            }
            _ => CachedModes::NoAgent,
        };
        StatusRead {
            entry: r.status.clone(),
            view,
            modes,
        }
    }

    /// The status generation a load starts at (see [`Self::keep_loaded`]).
    pub fn status_generation(&self) -> u64 {
        self.table().status_generation
    }

    /// Keeps `entry`, read from the store since `generation`, unless a
    /// commit or removal happened meanwhile; returns what to answer.
    pub fn keep_loaded(
        &self,
        session: SessionId,
        generation: u64,
        entry: StatusEntry,
    ) -> StatusEntry {
        let mut t = self.table();
        if t.status_generation != generation {
            return entry;
        }
        t.record(session).status.get_or_insert(entry).clone()
    }

    /// Keeps the status entry of a session just created (its first
    /// commit: the session, its executor's intent, its profile's claim), so
    /// its first calls answer from memory as a loaded session's do. An
    /// entry already there is at least as new and stays.
    pub fn status_created(&self, (session, entry): (SessionId, StatusEntry)) {
        let mut t = self.table();
        t.record(session).status.get_or_insert(entry);
    }

    /// Keeps the status snapshot current after a commit (called before the
    /// commit returns, so a status read after it never sees older state).
    pub fn status_committed(&self, committed: &Committed) {
        if committed.session.is_none() && committed.executor.is_none() {
            return;
        }
        // Parsed and copied before the lock, which every status read takes.
        let session = committed
            .session
            .as_ref()
            .map(|s| (Arc::new(s.clone()), MetadataStatus::of(s)));
        let mut t = self.table();
        // A session not in the snapshot: a load racing with this commit
        // must not keep what it read before it.
        if let Some((s, metadata)) = session {
            match t.records.get_mut(&s.id).and_then(|r| r.status.as_mut()) {
                Some(e) if s.version >= e.session.version => {
                    e.metadata = metadata;
                    e.session = s;
                }
                Some(_) => {}
                None => t.status_missed(s.id),
            }
        }
        if let Some(r) = &committed.executor {
            match t
                .records
                .get_mut(&r.session_id)
                .and_then(|x| x.status.as_mut())
            {
                Some(e) => e.record = Some(ExecutionView::from_record(r)),
                None => t.status_missed(r.session_id),
            }
        }
    }

    /// Starts a load of the whole snapshot; false if one is running.
    pub fn begin_status_load(&self) -> bool {
        let mut t = self.table();
        if t.priming.is_some() {
            return false;
        }
        t.priming = Some(HashSet::new());
        true
    }

    /// Ends a load of the whole snapshot with what it read (`None`: the
    /// read failed); an entry already present, or a session committed
    /// meanwhile, is kept as it is. Returns how many entries it added.
    pub fn end_status_load(&self, read: Option<Vec<(SessionId, StatusEntry)>>) -> usize {
        let mut t = self.table();
        let touched = t.priming.take().unwrap_or_default();
        let mut added = 0;
        for (session, entry) in read.unwrap_or_default() {
            if touched.contains(&session) {
                continue;
            }
            let r = t.record(session);
            if r.status.is_none() {
                r.status = Some(entry);
                added += 1;
            }
        }
        added
    }

    // ------------------------------------------------------ agent modes

    /// The modes cached for `session`'s agent in `execution`, with the
    /// stamp to keep a fresh answer under.
    pub fn cached_modes(
        &self,
        session: SessionId,
        execution: &str,
    ) -> (Option<Option<AgentModes>>, ModesStamp) {
        let t = self.table();
        let hit = t
            .records
            .get(&session)
            .and_then(|r| r.modes.value.as_ref())
            .filter(|(e, _)| e == execution)
            .map(|(_, m)| m.clone());
        (hit, t.modes_stamp(session))
    }

    /// Keeps `modes`, read from `session`'s agent in `execution`, unless
    /// they may have changed since `stamp`.
    pub fn remember_modes(
        &self,
        session: SessionId,
        execution: String,
        stamp: ModesStamp,
        modes: Option<AgentModes>,
    ) {
        let mut t = self.table();
        if t.modes_stamp(session) == stamp {
            t.record(session).modes.value = Some((execution, modes));
        }
    }

    /// `session`'s agent modes may have changed: ask it next time.
    pub fn forget_modes(&self, session: SessionId) {
        let mut t = self.table();
        t.modes_next += 1;
        let stamp = t.modes_next;
        t.record(session).modes = ModesSlot { stamp, value: None };
    }

    // ------------------------------------------------------ agentctl clients

    /// The session's cached client if it was made for `url` and `secret`.
    pub fn client(&self, session: SessionId, url: &str, secret: &str) -> Option<AgentctlClient> {
        self.table()
            .records
            .get(&session)
            .and_then(|r| r.client.as_ref())
            .filter(|(u, s, _)| u == url && s == secret)
            .map(|(_, _, c)| c.clone())
    }

    /// Keeps `client` as the session's, made for `url` and `secret`.
    pub fn keep_client(&self, session: SessionId, url: &str, secret: &str, client: AgentctlClient) {
        self.table().record(session).client = Some((url.to_owned(), secret.to_owned(), client));
    }

    /// Drops the session's cached agentctl client: once no call in flight
    /// holds a clone, its HTTP/2 connection closes.
    pub fn evict_client(&self, session: SessionId) {
        if let Some(r) = self.table().records.get_mut(&session) {
            r.client = None;
        }
    }

    // ------------------------------------------------------ update pumps

    /// Records where a parked pump stopped (see [`Parked`]).
    pub fn set_parked(&self, session: SessionId, parked: Parked) {
        self.table().record(session).parked = Some(parked);
    }

    /// The session row as this manager last committed or loaded it (the
    /// status snapshot), if the snapshot holds it. It may be older than the
    /// store (another writer, another replica): a write based on it is
    /// version-checked.
    pub fn committed_session(&self, session: SessionId) -> Option<Arc<Session>> {
        self.table()
            .records
            .get(&session)
            .and_then(|r| r.status.as_ref())
            .map(|e| e.session.clone())
    }

    /// The agentctl instance a parked session's cursor belongs to.
    pub fn parked_instance(&self, session: SessionId) -> Option<String> {
        self.table()
            .records
            .get(&session)
            .and_then(|r| r.parked.as_ref())
            .map(|p| p.instance.clone())
    }

    /// Takes the parked position of a session, if any.
    pub fn take_parked(&self, session: SessionId) -> Option<Parked> {
        self.table()
            .records
            .get_mut(&session)
            .and_then(|r| r.parked.take())
    }

    /// Whether the session's updates are parked.
    pub fn is_parked(&self, session: SessionId) -> bool {
        self.table()
            .records
            .get(&session)
            .is_some_and(|r| r.parked.is_some())
    }

    /// Makes `handle` the session's pump, aborting the one it replaces.
    pub fn set_pump(&self, session: SessionId, handle: AbortHandle) {
        let old = self.table().record(session).pump.replace(handle);
        if let Some(old) = old {
            old.abort();
        }
    }

    /// Aborts and forgets the session's pump.
    pub fn stop_pump(&self, session: SessionId) {
        let old = self
            .table()
            .records
            .get_mut(&session)
            .and_then(|r| r.pump.take());
        if let Some(old) = old {
            old.abort();
        }
    }

    /// Forgets the session's pump without aborting it (the pump itself,
    /// ending).
    pub fn forget_pump(&self, session: SessionId) {
        if let Some(r) = self.table().records.get_mut(&session) {
            r.pump = None;
        }
    }

    /// Whether the session has a pump that has not finished.
    pub fn has_pump(&self, session: SessionId) -> bool {
        self.table()
            .records
            .get(&session)
            .and_then(|r| r.pump.as_ref())
            .is_some_and(|h| !h.is_finished())
    }

    /// Forgets the session's pump if it is the calling task (a newer pump
    /// that replaced it stays).
    pub fn remove_own_pump(&self, session: SessionId) {
        let Some(me) = tokio::task::try_id() else {
            return;
        };
        if let Some(r) = self.table().records.get_mut(&session)
            && r.pump.as_ref().map(AbortHandle::id) == Some(me)
        {
            r.pump = None;
        }
    }

    // ------------------------------------------------------ locks, operations

    /// The session's state-change lock.
    /// Locks `session`'s state changes within this manager (one at a time).
    pub async fn lock(&self, session: SessionId) -> tokio::sync::OwnedMutexGuard<()> {
        self.lock_of(session).lock_owned().await
    }

    /// Held for the whole of one delete of `session` (see
    /// `SessionRecord::removal`).
    pub async fn removal_lock(&self, session: SessionId) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = self
            .table()
            .record(session)
            .removal
            .get_or_insert_with(Default::default)
            .clone();
        lock.lock_owned().await
    }

    pub fn lock_of(&self, session: SessionId) -> Arc<tokio::sync::Mutex<()>> {
        self.table()
            .record(session)
            .lock
            .get_or_insert_with(Default::default)
            .clone()
    }

    /// The operation in flight for `session`, if any.
    pub fn inflight(&self, session: SessionId) -> Option<(OpKind, SharedOp)> {
        self.table()
            .records
            .get(&session)
            .and_then(|r| r.inflight.as_ref())
            .map(|op| (op.kind, op.fut.clone()))
    }

    /// Joins the session's operation in flight, or makes `start(id)` it.
    pub fn join_or_start(
        &self,
        session: SessionId,
        id: u64,
        kind: OpKind,
        start: impl FnOnce() -> SharedOp,
    ) -> (OpKind, SharedOp) {
        let mut t = self.table();
        let r = t.record(session);
        if let Some(existing) = &r.inflight {
            return (existing.kind, existing.fut.clone());
        }
        let fut = start();
        r.inflight = Some(Inflight {
            id,
            kind,
            fut: fut.clone(),
        });
        (kind, fut)
    }

    /// Operation `id` of the session ended.
    pub fn end_op(&self, session: SessionId, id: u64) {
        if let Some(r) = self.table().records.get_mut(&session)
            && r.inflight.as_ref().is_some_and(|o| o.id == id)
        {
            r.inflight = None;
        }
    }

    /// Marks a background retry of the session's executor as running;
    /// false if one already runs.
    pub fn start_retrying(&self, session: SessionId) -> bool {
        let mut t = self.table();
        !std::mem::replace(&mut t.record(session).retrying, true)
    }

    /// The session's background retry ended.
    pub fn stop_retrying(&self, session: SessionId) {
        if let Some(r) = self.table().records.get_mut(&session) {
            r.retrying = false;
        }
    }

    /// Aborts every pump and forgets every operation in flight (shutdown).
    pub fn shutdown(&self) {
        let mut t = self.table();
        for r in t.records.values_mut() {
            if let Some(h) = r.pump.take() {
                h.abort();
            }
            r.inflight = None;
        }
    }
}

/// Makes a status snapshot entry (the form `end_status_load` takes).
pub(crate) fn status_entry(
    session: Session,
    profile_claim: bool,
    record: Option<&ExecutorRecord>,
) -> (SessionId, StatusEntry) {
    (
        session.id,
        StatusEntry {
            metadata: MetadataStatus::of(&session),
            session: Arc::new(session),
            profile_claim,
            record: record.map(ExecutionView::from_record),
        },
    )
}
