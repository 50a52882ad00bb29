//! The startup recovery pass's shared state, kept by the manager: the
//! queue of executors the pass loaded (each waiting, or claimed with its
//! shared outcome), who runs a recovery (its lane), the pass's slots and
//! its count of workspaces not back yet, and its outcome writer's handle.
//! The pass itself is `recovery.rs`; the queue's rules are `queue.rs`.

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
};

use futures::future::{BoxFuture, Shared};
use sessiond_domain::{ExecutorId, ExecutorRecord, OutcomeLabel, Session, SessionId};
use sessiond_store::{Changeset, Committed, Yield};
use tokio::sync::{mpsc, oneshot};

use crate::error::Result;

/// The shared outcome of one claimed recovery.
pub(crate) type SharedRecovery = Shared<BoxFuture<'static, Result<OutcomeLabel>>>;

/// A future the pass awaits before it claims each executor (a test hook:
/// holds the pass open at a known point; calls still claim).
pub type PassGate = Arc<dyn Fn() -> BoxFuture<'static, ()> + Send + Sync>;

/// Which executor a recovery is for: all it needs to start, since it reads
/// the record itself under the session's lock (a caller's copy may be
/// stale), so nobody copies a whole record to hand it one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ExecutorKey {
    pub(crate) id: ExecutorId,
    pub(crate) session_id: SessionId,
}

impl From<&ExecutorRecord> for ExecutorKey {
    fn from(record: &ExecutorRecord) -> Self {
        ExecutorKey {
            id: record.id,
            session_id: record.session_id,
        }
    }
}

pub(crate) enum Queued {
    /// Not claimed yet: the executor the pass loaded.
    Waiting(ExecutorKey),
    /// Being recovered (or recovered) in this pass; the pass's own claims
    /// carry the flag that makes their store calls give way to calls'.
    Claimed(SharedRecovery, Option<Yield>),
}

/// Where the queue stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// No pass announced or running: nothing waits for the queue.
    Idle,
    /// A pass is announced or loading its executors: wait for `Filled`.
    Loading,
    /// The pass's executors are in the queue.
    Filled,
}

#[derive(Default)]
pub(crate) struct RecoveryQueue {
    pub entries: HashMap<SessionId, Queued>,
    pub gate: Option<PassGate>,
    /// Off: the pass recovers in its own order and calls are not
    /// prioritised (the benchmark's baseline).
    pub off: bool,
}

/// What a claim found.
pub(crate) enum Claim {
    /// This caller started the recovery.
    Started(SharedRecovery),
    /// Someone else had: join its outcome.
    Joined(SharedRecovery),
}

/// Who runs a recovery. The machine has few cores and one database writer:
/// while a call waits for its session's recovery, the pass's recoveries
/// stop between steps (`Pass` yields to `Call`), so the call's one
/// recovery does not queue behind the pass's `concurrency` others at every
/// lock and connection. Background reconnects are `Other` and never wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lane {
    Pass,
    Call,
    /// An explicit resume: a call whose agent is resumed whatever the
    /// resume policy says, in one attempt (the caller gets the answer).
    Resume,
    Other,
}

/// A pass recovery's hold on the pass: one of its `concurrency` slots and
/// its share of the workspaces not back yet. Dropped (both given back) when
/// the recovery starts waiting for an agent launch, or when it ends.
pub(crate) struct PassTicket {
    pub(crate) _slot: tokio::sync::OwnedSemaphorePermit,
    pub(crate) pending: Arc<PendingWorkspaces>,
    pub(crate) ramp: Arc<Ramp>,
}

impl Drop for PassTicket {
    fn drop(&mut self) {
        self.pending.one_back();
        self.ramp.one_done();
    }
}

/// The pass's slow start: it begins with a few slots, and each recovery
/// that gives its slot back adds one more until the pass's concurrency is
/// reached (the count doubles per round, as TCP's slow start does). Fast
/// recoveries open the pass within a few milliseconds; slow ones (a
/// loaded host, a call arriving right after the restart) keep the burst of
/// new agentctl connections small while it matters, at no cost in time.
pub(crate) struct Ramp {
    slots: Arc<tokio::sync::Semaphore>,
    /// Slots still to add before the pass runs at its concurrency.
    left: std::sync::atomic::AtomicUsize,
}

impl Ramp {
    /// The pass's slots, `first` of them open now, `concurrency` in the end.
    pub(crate) fn new(first: usize, concurrency: usize) -> Arc<Self> {
        let first = first.clamp(1, concurrency.max(1));
        Arc::new(Self {
            slots: Arc::new(tokio::sync::Semaphore::new(first)),
            left: std::sync::atomic::AtomicUsize::new(concurrency.max(1) - first),
        })
    }

    pub(crate) fn slots(&self) -> Arc<tokio::sync::Semaphore> {
        self.slots.clone()
    }

    fn one_done(&self) {
        use std::sync::atomic::Ordering;
        let took = self
            .left
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        if took.is_ok() {
            self.slots.add_permits(1);
        }
    }
}

/// How many of the pass's executors do not have their workspace back yet;
/// the last one back runs `all_back`.
pub(crate) struct PendingWorkspaces {
    pub(crate) left: std::sync::atomic::AtomicUsize,
    pub(crate) all_back: Box<dyn Fn() + Send + Sync>,
}

impl PendingWorkspaces {
    fn one_back(&self) {
        if self.left.fetch_sub(1, std::sync::atomic::Ordering::AcqRel) == 1 {
            (self.all_back)();
        }
    }
}

/// One outcome commit for the pass's writer, and where its result goes.
pub(crate) type OutcomeCommit = (Changeset, oneshot::Sender<Result<Committed>>);

/// One re-read for the pass's reader, and where its answer goes.
pub(crate) type RecordRead = (
    ExecutorId,
    oneshot::Sender<Result<(ExecutorRecord, Session)>>,
);

/// The pass's outcome writer and record reader (`recovery/batch.rs`);
/// cloned into each recovery of the pass.
#[derive(Clone)]
pub(crate) struct Outcomes {
    pub(crate) tx: mpsc::UnboundedSender<OutcomeCommit>,
    pub(crate) reads: mpsc::UnboundedSender<RecordRead>,
}

/// A call's precedence over the pass: while one is held, the pass's
/// recoveries pause between steps; dropping it ends the precedence.
pub(crate) struct CallRecovery(pub(crate) tokio::sync::watch::Sender<usize>);

impl Drop for CallRecovery {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// What [`RecoverFirst::recover_ahead`](crate::flows::RecoverFirst::recover_ahead)
/// leaves a call: the pass's pause for the rest of the call, or the
/// session's recovery still running (its agent's launch) when the call
/// asked to go on once the workspace is back.
#[derive(Default)]
pub(crate) struct Ahead {
    pause: Option<CallRecovery>,
    rest: Option<(
        tokio::task::JoinHandle<()>,
        tokio::sync::watch::Sender<usize>,
    )>,
}

impl Ahead {
    /// The pass paused by `pause` for the rest of the call.
    pub(crate) fn paused(pause: Option<CallRecovery>) -> Ahead {
        Ahead { pause, rest: None }
    }

    /// The recovery `rest` goes on; the pass is paused (through `calls`)
    /// only once it is done ([`Self::settle`]).
    pub(crate) fn left(
        rest: tokio::task::JoinHandle<()>,
        calls: tokio::sync::watch::Sender<usize>,
    ) -> Ahead {
        Ahead {
            pause: None,
            rest: Some((rest, calls)),
        }
    }

    /// Waits for the recovery left running, if one was, then pauses the
    /// pass for the rest of the call: waiting for an agent's launch holds
    /// no pause (helper-57 F3: it held SERVING back).
    pub(crate) async fn settle(&mut self) {
        if let Some((rest, calls)) = self.rest.take() {
            let _ = rest.await;
            calls.send_modify(|n| *n += 1);
            self.pause = Some(CallRecovery(calls));
        }
    }
}

/// The sessions whose recovery, still running, has their workspace back
/// (the executor marked ready; the agent may still be relaunching): a
/// workspace call waits for this, not for the agent (helper-52 1: a file
/// read after a restart waited 33 s for a slow agent's resume).
#[derive(Default)]
pub(crate) struct WorkspacesReady {
    marked: std::sync::Mutex<HashSet<SessionId>>,
    changed: tokio::sync::Notify,
}

impl WorkspacesReady {
    /// `session`'s recovery marked its executor ready.
    pub(crate) fn mark(&self, session: SessionId) {
        crate::sync::lock(&self.marked).insert(session);
        self.changed.notify_waiters();
    }

    /// `session`'s recovery ended (its outcome answers from now on).
    pub(crate) fn forget(&self, session: SessionId) {
        crate::sync::lock(&self.marked).remove(&session);
    }

    /// Until `session`'s running recovery has its workspace back.
    pub(crate) async fn wait(&self, session: SessionId) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if crate::sync::lock(&self.marked).contains(&session) {
                return;
            }
            changed.await;
        }
    }
}
