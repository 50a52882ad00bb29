//! Startup recovery's queue: the API answers while the pass runs, and a
//! call on a session the pass has not reached yet recovers that session at
//! once instead of waiting for the whole pass.
//!
//! `recover_all` puts every executor it loaded in the queue (`Waiting`)
//! before it recovers any. Whoever comes first — the pass, in its order, or
//! a call on the session ([`RecoveryControl::ensure_recovered`](crate::RecoveryControl::ensure_recovered)) — *claims*
//! the entry: the recovery starts on a task of its own (the same
//! `recover_shared` the pass runs: per-session single-flight, intent before
//! side effect), and the entry holds its shared outcome (`Claimed`), which
//! everyone else joins. So each executor is recovered once per pass, never
//! twice at once, and a claimed one does not use a slot of the pass's
//! bounded concurrency. The pass waits for the claimed ones at its end and
//! counts them in its summary; then the queue is emptied. While a call's
//! recovery runs, the pass's recoveries pause between steps (their
//! deadlines extended by the pause), so the call does not queue behind the
//! pass's `concurrency` others for the database and the CPU.
//!
//! The pass's own recoveries run with a `sessiond_store::Yield` flag: their
//! store calls give way to everyone else's (SQLite's write turn, two pool
//! connections kept free), and a call that joins one promotes it. A call
//! that waited for a recovery keeps the pass paused between steps until it
//! is answered (`recover_ahead`, at most [`MAX_PAUSE`] at a time), so its
//! own writes and `Prompt` do not compete with the pass either.
//!
//! While a session is in the queue and its recovery has not ended,
//! [`SessionManager::session_status`](crate::SessionManager::session_status) says `recovering`. Between the moment
//! a backend announces a pass ([`RecoveryControl::expect_startup_recovery`](crate::RecoveryControl::expect_startup_recovery),
//! before it serves) and the moment the queue is filled, nothing waits on an
//! exclusive store (SQLite, where the pass takes every live executor):
//! status answers from the records (a `starting` / `ready` executor is one
//! the pass is about to recover: `recovering`), and a call on such a session
//! claims its recovery at once (`claim_while_loading`); the pass, once
//! filled, joins it. With other replicas the pass first claims leases, so
//! status and calls wait for the queue there.

use futures::FutureExt;
use sessiond_domain::{ExecutorRecord, ExecutorStatus, SessionId};
use sessiond_store::Yield;

use crate::{
    error::Result,
    flows::Ownership,
    lease::Fencing,
    pass::{
        Ahead, CallRecovery, Claim, ExecutorKey, Lane, PassGate, Phase, Queued, SharedRecovery,
    },
    recovery::Pass,
    sync::lock,
};

/// The longest the pass's recoveries pause at once for calls.
pub(crate) const MAX_PAUSE: std::time::Duration = std::time::Duration::from_secs(1);

/// Startup recovery's queue: claims of its executors by the pass or by a
/// call, the pass's gate and pauses, and what status says meanwhile.
pub(crate) struct Queue<'m>(pub(crate) &'m crate::manager::SessionManager);

impl std::ops::Deref for Queue<'_> {
    type Target = crate::manager::SessionManager;

    fn deref(&self) -> &Self::Target {
        self.0
    }
}

impl Queue<'_> {
    /// Announces that a startup recovery pass is about to run: from now
    /// until its queue is filled, status and calls on sessions wait for it
    /// (`sessiond serve` calls this before it starts serving, so that no
    /// call slips in before the pass has loaded what it will recover).
    pub(crate) fn expect_startup_recovery(&self) {
        if !lock(&self.inner.queue).off {
            self.inner.queue_phase.send_replace(Phase::Loading);
        }
    }

    /// Holds the recovery pass before it claims each executor until `gate`
    /// resolves; calls on sessions still claim theirs. For tests that must
    /// observe the API while a pass is under way at a known point.
    #[cfg(feature = "test-hooks")]
    pub(crate) fn gate_recovery_pass(&self, gate: PassGate) {
        lock(&self.inner.queue).gate = Some(gate);
    }

    /// Whether calls jump the recovery queue (on by default). Off, a pass
    /// recovers strictly in its own order and a call on a session not yet
    /// recovered is answered from what is recorded: only the benchmark
    /// turns it off, to measure what the queue costs.
    pub(crate) fn set_recovery_priority(&self, on: bool) {
        lock(&self.inner.queue).off = !on;
    }

    /// Whether startup recovery has yet to finish with `session`.
    pub(crate) fn is_recovering(&self, session: SessionId) -> bool {
        match lock(&self.inner.queue).entries.get(&session) {
            Some(Queued::Waiting(_)) => true,
            Some(Queued::Claimed(f, _)) => f.peek().is_none(),
            None => false,
        }
    }

    /// Resolves once this pass's recovery of `session` has ended (at once
    /// when it is not queued, or ended already).
    pub(crate) async fn recovered(&self, session: SessionId) {
        let claimed = match lock(&self.inner.queue).entries.get(&session) {
            Some(Queued::Claimed(f, _)) if f.peek().is_none() => Some(f.clone()),
            _ => None,
        };
        if let Some(f) = claimed {
            let _ = f.await;
        }
    }

    /// Waits until the announced pass has filled its queue.
    pub(crate) async fn queue_filled(&self) {
        let mut rx = self.inner.queue_phase.subscribe();
        let _ = rx.wait_for(|p| *p != Phase::Loading).await;
    }

    /// A call on `session` is about to act on it: if startup recovery has
    /// not finished with it, recover it now (ahead of the pass) or join the
    /// recovery under way, and wait for that one session only. Whatever the
    /// recovery decided is then in the store and the caches; a recovery that
    /// failed leaves the records as they were, and the caller's own checks
    /// answer.
    ///
    /// With other replicas, the session's executor must then be this
    /// replica's: one whose lease is free or expired is claimed and
    /// recovered here; one another replica holds is
    /// [`Error::NotOwner`](crate::error::Error::NotOwner).
    pub(crate) async fn ensure_recovered(&self, session: SessionId) -> Result<()> {
        self.recover_ahead(session, None, false).await.map(drop)
    }

    /// [`Self::ensure_recovered`] for a call that goes on to use the
    /// session at once (`SendMessage`, `RetryTurn`): when it waited for a
    /// recovery, the returned guard keeps the pass paused between its steps
    /// until the call is done (at most [`MAX_PAUSE`] at a time), so the rest
    /// of the call (its writes, its `Prompt`) does not compete with the
    /// pass's `concurrency` recoveries either.
    ///
    /// `leave`: return once the workspace is back; the rest of the recovery
    /// (the agent's launch) goes on in a task of its own, which
    /// [`Ahead::settle`] waits for before it pauses the pass.
    pub(crate) async fn recover_ahead(
        &self,
        session: SessionId,
        arrival: Option<CallRecovery>,
        leave: bool,
    ) -> Result<Ahead> {
        // A call during the pass's load (exclusive store: the pass takes
        // every live executor) starts its session's recovery now instead of
        // waiting for the load of all the others.
        let early = self.claim_while_loading(session).await?;
        if early.is_none() {
            self.queue_filled().await;
        }
        let claim = early.or_else(|| self.claim(session, Lane::Call));
        let mut ahead = Ahead::default();
        if let Some(Claim::Started(mut fut) | Claim::Joined(mut fut)) = claim {
            // The pass pauses for it until its workspace is back; its
            // agent's launch does not hold the pass (and SERVING) up: its
            // launch slot goes first (helper-54 F1).
            let pausing = self.call_recovery_started();
            // A caller waits on it now: its agent's launch goes first.
            self.inner.launches.promote(session);
            let mut done = None;
            tokio::select! {
                r = &mut fut => done = Some(r),
                () = self.inner.workspaces_ready.wait(session) => {}
            }
            drop(pausing);
            drop(arrival);
            let report = move |r: Result<_>| {
                if let Err(e) = r {
                    tracing::debug!(%session, error = %e, "prioritised recovery failed");
                }
            };
            let finished = done.is_some();
            match done {
                Some(r) => report(r),
                // The agent's part goes on by itself; a message that may
                // wait is queued by it meanwhile (`turn/letters.rs`).
                None if leave => {
                    let rest = tokio::spawn(async move { report(fut.await) });
                    ahead = Ahead::left(rest, self.inner.calls_recovering.clone());
                }
                None => report(fut.await),
            }
            // The rest of the call (its writes, its Prompt) goes first again.
            if !leave || finished {
                ahead = Ahead::paused(Some(self.call_recovery_started()));
            }
        }
        self.ensure_owned(session).await?;
        Ok(ahead)
    }

    /// [`Self::ensure_recovered`] up to the workspace: returns once the
    /// session's recovery marked its executor ready (or ended), and leaves
    /// the recovery running (driven by a task of its own, since a recovery
    /// this call started is polled by nobody else until the pass's end).
    pub(crate) async fn ensure_workspace(&self, session: SessionId) -> Result<()> {
        let early = self.claim_while_loading(session).await?;
        if early.is_none() {
            self.queue_filled().await;
        }
        let claim = early.or_else(|| self.claim(session, Lane::Call));
        if let Some(Claim::Started(fut) | Claim::Joined(fut)) = claim {
            let _ahead = self.call_recovery_started();
            self.inner.launches.promote(session);
            let outcome = tokio::spawn(fut);
            tokio::select! {
                done = outcome => {
                    if let Ok(Err(e)) = done {
                        tracing::debug!(%session, error = %e, "prioritised recovery failed");
                    }
                }
                () = self.inner.workspaces_ready.wait(session) => {
                    tracing::debug!(%session, "workspace back; the agent's recovery goes on");
                }
            }
        }
        self.ensure_owned(session).await
    }

    /// While an announced pass of an exclusive store loads its executors:
    /// if `session`'s executor is live (`starting` or `ready`, which the
    /// pass will recover), claim it for this call; the pass, once its queue
    /// is filled, joins this recovery instead of running its own.
    async fn claim_while_loading(&self, session: SessionId) -> Result<Option<Claim>> {
        if !Fencing(self).exclusive() || *self.inner.queue_phase.borrow() != Phase::Loading {
            return Ok(None);
        }
        let Some(record) = self.inner.store.get_executor_for_session(session).await? else {
            return Ok(None);
        };
        if !matches!(
            record.status,
            ExecutorStatus::Starting | ExecutorStatus::Ready
        ) {
            return Ok(None);
        }
        let mut queue = lock(&self.inner.queue);
        if queue.off || *self.inner.queue_phase.borrow() != Phase::Loading {
            return Ok(None);
        }
        if let Some(Queued::Claimed(f, _)) = queue.entries.get(&session) {
            return Ok(Some(Claim::Joined(f.clone())));
        }
        let fut = self.start_claimed((&record).into(), Lane::Call);
        queue
            .entries
            .insert(session, Queued::Claimed(fut.clone(), None));
        Ok(Some(Claim::Started(fut)))
    }

    /// The answer of `session_status` on `recovering` while the pass of an
    /// exclusive store is loading: the executor the status shows is live,
    /// so the pass is about to recover it (unless a call already did).
    pub(crate) fn recovering_while_loading(
        &self,
        session: SessionId,
        view: Option<&sessiond_domain::ExecutionView>,
    ) -> bool {
        let queue = lock(&self.inner.queue);
        if let Some(entry) = queue.entries.get(&session) {
            return match entry {
                Queued::Waiting(_) => true,
                Queued::Claimed(f, _) => f.peek().is_none(),
            };
        }
        *self.inner.queue_phase.borrow() == Phase::Loading
            && view.is_some_and(|v| {
                matches!(
                    v.executor_status,
                    ExecutorStatus::Starting | ExecutorStatus::Ready
                )
            })
    }

    /// Whether status may answer without waiting for the queue: an
    /// exclusive store's pass is loading (see `recovering_while_loading`).
    pub(crate) fn answers_while_loading(&self) -> bool {
        Fencing(self).exclusive() && *self.inner.queue_phase.borrow() == Phase::Loading
    }

    /// Claims `session`'s queue entry: starts its recovery if it is still
    /// waiting, else hands out the one under way. `None`: not queued.
    pub(crate) fn claim(&self, session: SessionId, lane: Lane) -> Option<Claim> {
        let mut queue = lock(&self.inner.queue);
        let entry = queue.entries.get_mut(&session)?;
        if let Queued::Claimed(f, flag) = entry {
            if lane == Lane::Call
                && let Some(flag) = flag
            {
                // A call now waits for this pass recovery: it stops
                // giving way (it is the call's recovery too).
                flag.promote();
            }
            return Some(Claim::Joined(f.clone()));
        }
        // Waiting: the entry becomes its recovery's claim; the queue stays
        // locked throughout.
        let Queued::Waiting(executor) = *entry else {
            return None;
        };
        let (fut, flag) = self.start_recovery(executor, lane);
        *entry = Queued::Claimed(fut.clone(), flag);
        Some(Claim::Started(fut))
    }

    fn start_claimed(&self, executor: ExecutorKey, lane: Lane) -> SharedRecovery {
        self.start_recovery(executor, lane).0
    }

    /// Starts a claimed recovery now, as its session's single flight (whose
    /// own task runs it, in the claimer's span, so a caller that goes away
    /// does not cut it short); the pass's own claims yield to calls' store
    /// work (the flag, kept in the entry). Called with the queue locked:
    /// the single flight's table is locked after it, never before.
    fn start_recovery(&self, executor: ExecutorKey, lane: Lane) -> (SharedRecovery, Option<Yield>) {
        let flag = (lane == Lane::Pass).then(Yield::new);
        let fut: SharedRecovery = Pass(self)
            .start_shared(executor, lane, flag.clone())
            .boxed()
            .shared();
        (fut, flag)
    }

    /// Fills the queue with the pass's executors; returns whether calls are
    /// prioritised in this pass.
    pub(crate) fn fill_queue(&self, records: &[ExecutorRecord]) -> bool {
        let mut queue = lock(&self.inner.queue);
        if queue.off {
            return false;
        }
        // Not cleared: a call may have claimed its session during the load
        // (`claim_while_loading`); `close_queue` empties it after a pass.
        queue.entries.reserve(records.len());
        for r in records {
            queue
                .entries
                .entry(r.session_id)
                .or_insert_with(|| Queued::Waiting(r.into()));
        }
        drop(queue);
        self.inner.queue_phase.send_replace(Phase::Filled);
        true
    }

    /// The pass is over (or failed before filling its queue): nothing is
    /// waited for any more.
    pub(crate) fn close_queue(&self) {
        lock(&self.inner.queue).entries.clear();
        self.inner.queue_phase.send_replace(Phase::Idle);
    }

    pub(crate) fn pass_gate(&self) -> Option<PassGate> {
        lock(&self.inner.queue).gate.clone()
    }

    /// A call that goes on to use `session` at once (`SendMessage`,
    /// `RetryTurn`) has arrived while startup recovery may still have to
    /// recover it: the pass pauses between its steps from now on, not only
    /// once the call's own recovery starts, so the call's first reads and
    /// its recovery do not share the CPU and the store with recoveries the
    /// pass starts meanwhile. `None` when no pass runs or the session is
    /// done with; the caller drops the guard once [`Self::recover_ahead`]
    /// has answered (which holds the pause on if it recovered the session).
    pub(crate) fn precede_pass(&self, session: SessionId) -> Option<CallRecovery> {
        let phase = *self.inner.queue_phase.borrow();
        let waits = match phase {
            Phase::Idle => false,
            // Not known yet whether the pass takes it; no pass recovery
            // runs while it loads, so the pause costs nothing meanwhile.
            Phase::Loading => true,
            Phase::Filled => self.is_recovering(session),
        };
        waits.then(|| self.call_recovery_started())
    }

    /// A call's recovery is running: the pass waits (see [`Lane`]) until
    /// the returned guard is dropped.
    pub(crate) fn call_recovery_started(&self) -> CallRecovery {
        self.inner.calls_recovering.send_modify(|n| *n += 1);
        CallRecovery(self.inner.calls_recovering.clone())
    }

    /// Waits while a call's recovery runs; returns how long it waited.
    pub(crate) async fn yield_to_calls(&self) -> std::time::Duration {
        if *self.inner.calls_recovering.borrow() == 0 {
            return std::time::Duration::ZERO;
        }
        let t = std::time::Instant::now();
        let mut rx = self.inner.calls_recovering.subscribe();
        // Bounded: a call that holds its precedence long (a slow agent)
        // slows the pass down to one step per pause, never stops it.
        let _ = tokio::time::timeout(MAX_PAUSE, rx.wait_for(|n| *n == 0)).await;
        t.elapsed()
    }
}
