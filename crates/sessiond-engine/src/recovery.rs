//! Startup recovery (docs/decisions/0006-recovery-decision-table.md): every executor in
//! `starting`/`ready` is driven through the domain's [`Recovery`] step
//! machine with the real drivers, under bounded concurrency and a deadline
//! per executor; unreachable remote hosts are retried in the background.
//!
//! Decision on remote executors that are `error` while reconnecting: the
//! domain marks them `error` (with the `reconnecting:` code) and the store's
//! `load_recoverable_executors` only returns `starting`/`ready`. A restart
//! during the reconnect window must not forget them, so [`RecoveryControl::recover_all`]
//! also loads remote executors in `error` whose message carries the
//! `reconnecting` code and whose window is still open. The window is counted
//! from the later of the host's last sign of life (`last_seen_at`, else the
//! record's last update) and this backend's start: a backend that was down
//! longer than the window still retries for a whole window.

use std::{
    collections::BTreeMap,
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use chrono::Utc;
use futures::{FutureExt, StreamExt};
use sessiond_domain::{
    Action, AgentProcessState, AgentProfile, EventPayload, ExecutorEvent, ExecutorRecord,
    ExecutorStatus, MessageId, Observation, OutcomeLabel, Recovery, RecoveryFailure, RecoveryInput,
    RecoveryOutcome, RecoveryStage, Runtime, Session, SessionId, SessionState, SurvivingAgent,
    TaskEvent,
};
use sessiond_executor::{AgentState, ExecutorHandle, Probe};
use sessiond_store::{Changeset, Store, Yield};

use crate::{
    changes::{executor_moved, move_executor},
    error::{Error, Result},
    flows::TurnInFlight,
    launches::{Ended, Priority, host_of},
    lease::Fencing,
    manager::SessionManager,
    ops::Agents,
    ops::{Resumed, load_refused, probe_verdict, surviving_agent},
    pass::{
        CallRecovery, Claim, ExecutorKey, Lane, Outcomes, PassTicket, PendingWorkspaces, Ramp,
        SharedRecovery,
    },
    recovery::doorbell::Doorbell,
    recovery::liveness::Liveness,
    recovery::queue::Queue,
    recovery::sweep::Sweep,
    restarts::AfterExit,
    sessions::{OpKind, OpOutcome},
    turn::Turns,
    turn::letters,
    turn::{pending_turn, turn_in_flight},
    worktrees::Worktrees,
};

mod ahead;
mod doorbell;
mod sweep;

pub use sweep::SweepReport;
mod batch;
pub(crate) mod liveness;
pub(crate) mod queue;

/// Executors the pass reads at once (see `load_recoverable`).
const LOAD_PAGE: u32 = 1_000;

/// The recoveries the pass starts with (see [`Ramp`]). Started all at once,
/// `concurrency` recoveries open that many agentctl connections in the
/// same instant, and a call arriving then (users come back right after a
/// restart) waits behind that burst.
const RAMP_FIRST: usize = 8;

/// The error code (message prefix) of an executor whose remote host is being
/// reconnected in the background.
const RECONNECTING: &str = "reconnecting:";

/// The error code of a Docker executor whose engine did not answer; retried
/// in the background until the engine answers (no window: an engine comes
/// back when someone starts it).
const DOCKER_UNAVAILABLE: &str = "docker_unavailable:";
/// The prefix of [`RecoveryFailure::RuntimeNotRegistered`]'s message.
const RUNTIME_NOT_REGISTERED: &str = "runtime_not_registered:";

/// The error code (message prefix) of an executor whose recovery broke off
/// for a reason that can pass by itself, retried in the background.
const RECOVERING: &str = "recovering:";

/// What startup recovery did.
#[derive(Debug, Clone, Default)]
pub struct RecoverySummary {
    /// Executors looked at.
    pub total: usize,
    /// Executors per outcome label (`resumed`, `reattached`, ...).
    pub counts: BTreeMap<&'static str, usize>,
    /// Executors whose recovery failed on something other than the executor
    /// (the database, a bug); their records are unchanged.
    pub failed: usize,
    /// Sessions the pass left without their agent back, each logged as a
    /// WARN line with its reason: in ERROR (not resumable, no token, the
    /// resume or the executor failed) or still retried in the background.
    pub not_back: usize,
    /// Time until every workspace was back (what SERVING waits for);
    /// agents may have relaunched after it, until `duration`.
    pub workspaces_back: Duration,
    /// Each session and how its recovery ended.
    pub outcomes: Vec<(SessionId, Result<OutcomeLabel, String>)>,
    /// Wall time of the pass.
    pub duration: Duration,
}

impl RecoverySummary {
    /// How many executors ended with `label`.
    pub fn count(&self, label: OutcomeLabel) -> usize {
        self.counts.get(label.as_str()).copied().unwrap_or(0)
    }

    /// How `session`'s recovery ended (`Err`: the error that stopped it);
    /// `None` when the pass did not look at it.
    pub fn outcome(&self, session: SessionId) -> Option<&Result<OutcomeLabel, String>> {
        self.outcomes
            .iter()
            .find(|(s, _)| *s == session)
            .map(|(_, o)| o)
    }
}

/// One executor of the pass: recovered by the pass, or by a call that
/// claimed it first (awaited once the pass is through).
enum PassResult {
    Done(Result<OutcomeLabel>),
    Claimed(SharedRecovery),
}

/// Aborts its task when dropped: a spawned pass ends with the call that
/// awaits it.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Runs `f` when dropped.
struct Guard<F: FnMut()>(F);

impl<F: FnMut()> Drop for Guard<F> {
    fn drop(&mut self) {
        (self.0)();
    }
}

fn scopeguard<F: FnMut()>(f: F) -> Guard<F> {
    Guard(f)
}

/// Mutable state of one executor's recovery.
struct Run {
    record: ExecutorRecord,
    session: Session,
    profile: Arc<AgentProfile>,
    agent: SurvivingAgent,
    /// The agent's state as the last `Health` of this recovery saw it, if
    /// no agentctl was (re)started since (lets the resume skip a second
    /// `Health`).
    agent_state: Option<AgentState>,
    probe: Option<bool>,
    started_as: ExecutorStatus,
    /// `record.last_seen_at` was refreshed in memory only (the executor was
    /// `ready` already, so nothing else changed): the outcome commit writes it.
    seen_unsaved: bool,
    /// The session had no resume token and its surviving agent holds an open
    /// conversation: that conversation's id became the token (in memory; the
    /// outcome commit writes it to the session and the executor).
    adopted_token: bool,
    /// The agent could not load the session's never-prompted conversation
    /// and a new one replaced it (the token is in `session` and `record`
    /// with `adopted_token`): this event goes with the outcome.
    replaced: Option<EventPayload>,
    /// What the health check's `Recover` answered for later steps.
    ahead: ahead::Ahead,
    /// The pass's outcome writer, for a pass recovery no caller waits on.
    outcomes: Option<Outcomes>,
    /// agentctl's newest turn (and the agentctl instance) when it is not
    /// the session's newest: a turn the store never recorded (the backend
    /// died between its Prompt and its commit) is on agentctl's stream.
    unrecorded_turn: Option<(String, String)>,
    /// How long the agent's launch and resume may show no sign of life
    /// before this attempt is cut (`ExecutorRecovery::agent_silence`).
    agent_silence: Duration,
    /// A call's recovery pauses the pass until its workspace is back; the
    /// agent's launch after it does not (helper-54 F1: a send before
    /// SERVING held SERVING back 3-4 s), its launch slot goes first anyway.
    pausing: Option<CallRecovery>,
}

/// A remote host stopped answering while the backend runs (a network blip,
/// the host restarting): the executor goes `error` with the `reconnecting:`
/// code and the session keeps its state — the status shows the reconnect —
/// and the background reconnect ([`ExecutorRecovery::spawn_reconnect`]) runs
/// recovery when the host answers again, which reattaches or resumes without
/// a user call. The caller then spawns that reconnect.
/// Whether an executor in `error` is still retried in the background (a
/// remote host reconnecting inside its window, a Docker engine that did not
/// answer), so recovery takes it up like a live one.
pub(crate) fn retried_in_background(
    r: &ExecutorRecord,
    drivers: &std::collections::HashMap<Runtime, Arc<dyn sessiond_executor::Executor>>,
    config: &crate::ManagerConfig,
    started_at: chrono::DateTime<Utc>,
) -> bool {
    let code = |c: &str| r.error_message.as_deref().is_some_and(|m| m.starts_with(c));
    if r.status == ExecutorStatus::Error && code(RECOVERING) {
        return drivers.contains_key(&r.runtime);
    }
    r.status == ExecutorStatus::Error
        && match r.runtime {
            Runtime::Remote => {
                drivers.contains_key(&Runtime::Remote)
                    && code(RECONNECTING)
                    && window_open(r, config.remote_retry_window, Utc::now(), started_at)
            }
            Runtime::LocalDocker => {
                drivers.contains_key(&Runtime::LocalDocker) && code(DOCKER_UNAVAILABLE)
            }
            Runtime::LocalStandalone => false,
            // Parked while no driver served it: taken up again once one does.
            Runtime::Custom(_) => drivers.contains_key(&r.runtime) && code(RUNTIME_NOT_REGISTERED),
        }
}

/// The session's agent is back (resumed, opened, reattached), or recovery was not
/// to bring it back (the policy, an ended session): nothing to report.
fn agent_back_or_left_alone(label: OutcomeLabel) -> bool {
    label.agent_back() || matches!(label, OutcomeLabel::ExecutorOnly | OutcomeLabel::Stopped)
}

/// An agent's launch or resume failed in a way load or a passing fault can
/// cause (the agent exited while starting, agentctl or the agent did not
/// answer), as opposed to a verdict (the agent refused, authentication, a
/// bad profile): another attempt may succeed.
fn passes_by_itself(e: &Error) -> bool {
    match e {
        Error::Agent {
            failure, message, ..
        } => {
            matches!(
                failure,
                sessiond_executor::Failure::NoAnswer | sessiond_executor::Failure::Transient
            ) && !message.contains("requires authentication")
        }
        other => other.is_transport(),
    }
}

/// The executor's error while its lost agentctl is recovered in the
/// background (code `recovering`).
pub(crate) fn lost_agentctl_recovering(reason: &str) -> String {
    format!(
        "{RECOVERING} agentctl stopped answering ({reason}); the session recovers by itself, \
         retrying in the background"
    )
}

/// The background reconnect window of a remote executor is still open:
/// counted from its last sign of life, but never from before the backend
/// started (its own outage must not use the window up).
pub(crate) fn window_open(
    record: &ExecutorRecord,
    window: Duration,
    now: chrono::DateTime<Utc>,
    backend_started: chrono::DateTime<Utc>,
) -> bool {
    let since = record
        .last_seen_at
        .unwrap_or(record.updated_at)
        .max(backend_started);
    let window = chrono::Duration::from_std(window).unwrap_or(chrono::Duration::MAX);
    since + window > now
}

impl SessionManager {
    /// Recovery: the startup pass, a call's recovery of its session ahead
    /// of the pass, liveness checks, the doorbell and the orphan sweep.
    pub fn recovery(&self) -> RecoveryControl<'_> {
        RecoveryControl(self)
    }
}

impl crate::flows::RecoverFirst for SessionManager {
    async fn ensure_recovered(&self, session: SessionId) -> Result<()> {
        Queue(self).ensure_recovered(session).await
    }

    fn comes_back_by_itself(&self, record: &ExecutorRecord) -> bool {
        self.inner.agent_recoveries.under_way(record.session_id)
            || retried_in_background(
                record,
                &self.inner.drivers,
                &self.inner.config,
                self.inner.started_at,
            )
    }

    async fn recover_ahead(
        &self,
        session: SessionId,
        arrival: Option<CallRecovery>,
        leave: bool,
    ) -> Result<crate::pass::Ahead> {
        Queue(self).recover_ahead(session, arrival, leave).await
    }

    fn precede_pass(&self, session: SessionId) -> Option<CallRecovery> {
        Queue(self).precede_pass(session)
    }

    fn spawn_retry(&self, record: ExecutorRecord, attempt: u32, reason: String) {
        ExecutorRecovery(self).spawn_retry(record, attempt, reason)
    }

    fn spawn_reconnect(&self, record: ExecutorRecord) {
        ExecutorRecovery(self).spawn_reconnect(record)
    }

    fn spawn_agent_restart(&self, session: SessionId, decision: AfterExit, committed: bool) {
        ExecutorRecovery(self).spawn_agent_restart(session, decision, committed)
    }

    fn spawn_agent_relaunch(&self, session: SessionId, reason: String) {
        ExecutorRecovery(self).spawn_agent_relaunch(session, reason)
    }

    async fn relaunch_now(&self, session: SessionId, reason: String) {
        ExecutorRecovery(self).relaunch_now(session, reason).await
    }

    fn recover_once_store_answers(&self, session: SessionId, reason: String) {
        ExecutorRecovery(self).recover_once_store_answers(session, reason)
    }

    async fn agentctl_lost_change(
        &self,
        record: &ExecutorRecord,
        reason: &str,
        turn: TurnInFlight,
    ) -> Result<(Changeset, Option<ExecutorRecord>)> {
        ExecutorRecovery(self)
            .agentctl_lost_change(record, reason, turn)
            .await
    }
}

/// Recovery of a manager's sessions ([`SessionManager::recovery`]): the
/// startup pass and its queue, liveness checks of ready executors, the
/// doorbell agents ring when they exit, and the orphan-container sweep.
#[derive(Clone, Copy)]
pub struct RecoveryControl<'m>(&'m SessionManager);

impl std::fmt::Debug for RecoveryControl<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecoveryControl")
            .field("first_recovery_done", &self.first_recovery_done())
            .finish()
    }
}

impl RecoveryControl<'_> {
    /// Recovers every executor that was live when the backend stopped. Meant
    /// to run before the server reports SERVING. Logs one summary line.
    pub async fn recover_all(&self) -> Result<RecoverySummary> {
        Pass(self.0).recover_all().await
    }

    /// Announces that a startup recovery pass is about to run: from now
    /// until its queue is filled, status and calls on sessions wait for it
    /// (`sessiond serve` calls this before it starts serving, so that no
    /// call slips in before the pass has loaded what it will recover).
    pub fn expect_startup_recovery(&self) {
        Queue(self.0).expect_startup_recovery()
    }

    /// Holds the recovery pass before it claims each executor until `gate`
    /// resolves; calls on sessions still claim theirs. For tests that must
    /// observe the API while a pass is under way at a known point.
    #[cfg(feature = "test-hooks")]
    pub fn gate_recovery_pass(&self, gate: crate::pass::PassGate) {
        Queue(self.0).gate_recovery_pass(gate)
    }

    /// Holds a pump (or a liveness check) that found its agentctl lost,
    /// after it committed the loss and before it starts the background
    /// recovery, until `gate` resolves. For tests that must observe what a
    /// client sees in that moment.
    #[cfg(feature = "test-hooks")]
    pub fn gate_lost_agentctl(&self, gate: crate::pass::PassGate) {
        *crate::sync::lock(&self.0.inner.lost_agentctl_gate) = Some(gate);
    }

    /// Whether calls jump the recovery queue (on by default). Off, a pass
    /// recovers strictly in its own order and a call on a session not yet
    /// recovered is answered from what is recorded: only the benchmark
    /// turns it off, to measure what the queue costs.
    pub fn set_recovery_priority(&self, on: bool) {
        Queue(self.0).set_recovery_priority(on)
    }

    /// Whether startup recovery has yet to finish with `session`.
    pub fn is_recovering(&self, session: SessionId) -> bool {
        Queue(self.0).is_recovering(session)
    }

    /// Whether sessiond is bringing `session` back now: startup recovery
    /// has yet to finish with it, or its agent's recovery (a relaunch and
    /// resume after its agentctl or agent was lost) is under way.
    pub fn is_bringing_back(&self, session: SessionId) -> bool {
        Queue(self.0).is_recovering(session) || self.0.inner.agent_recoveries.under_way(session)
    }

    /// [`Self::is_bringing_back`], once an announced pass has loaded what
    /// it recovers (until then it is not known whether `session` is in it).
    pub(crate) async fn bringing_back(&self, session: SessionId) -> bool {
        Queue(self.0).queue_filled().await;
        self.is_bringing_back(session)
    }

    /// Resolves once sessiond no longer brings `session` back
    /// ([`Self::is_bringing_back`] false), or after `limit`.
    pub(crate) async fn brought_back(&self, session: SessionId, limit: Duration) {
        let until = tokio::time::Instant::now() + limit;
        let _ = tokio::time::timeout_at(until, Queue(self.0).recovered(session)).await;
        let left = until.saturating_duration_since(tokio::time::Instant::now());
        self.0.inner.agent_recoveries.wait_done(session, left).await;
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
    /// recovered here; one another replica holds is [`Error::NotOwner`].
    pub async fn ensure_recovered(&self, session: SessionId) -> Result<()> {
        Queue(self.0).ensure_recovered(session).await
    }

    /// [`Self::ensure_recovered`] for a workspace call (shell, files, git):
    /// waits only until the session's workspace is back (its executor
    /// marked ready), not for its agent's relaunch and resume, which go on.
    ///
    /// # Errors
    ///
    /// As [`Self::ensure_recovered`].
    pub async fn ensure_workspace(&self, session: SessionId) -> Result<()> {
        Queue(self.0).ensure_workspace(session).await
    }

    /// Whether the first startup recovery pass has every executor's
    /// workspace back (reattached, relaunched up to the agent, or failed):
    /// what health reports SERVING on. Agents may still be relaunching;
    /// their sessions show `recovering` with their progress.
    pub fn workspaces_recovered(&self) -> bool {
        Pass(self.0).workspaces_recovered()
    }

    /// Waits until [`Self::workspaces_recovered`].
    pub async fn wait_workspaces_recovered(&self) {
        Pass(self.0).wait_workspaces_recovered().await
    }

    /// Whether a startup recovery pass of this manager has finished.
    pub fn first_recovery_done(&self) -> bool {
        Pass(self.0).first_recovery_done()
    }

    /// Starts the periodic liveness check of ready executors (every
    /// `liveness_interval`, if set): a healthy one gets `last_seen_at`
    /// updated (no event); one that stops answering goes `error` with a
    /// `session.agentctl_error` event, and a live session goes ERROR.
    /// `recover_all` calls it once recovery is done; calling it again is a
    /// no-op.
    pub fn start_liveness_checks(&self) {
        Liveness(self.0).start_liveness_checks()
    }

    /// Listens on the datagram socket `path` (replacing a stale one, mode
    /// 0600) and checks an executor at once each time its agentctl rings.
    /// Runs until the manager shuts down.
    pub fn listen_doorbell(&self, path: &Path) -> std::io::Result<()> {
        Doorbell(self.0).listen_doorbell(path)
    }

    /// One pass of the orphan sweep over the containers of `docker`'s
    /// engine. Refuses to run (returns an empty report) until the first
    /// startup recovery pass of this manager has finished.
    pub async fn sweep_orphan_containers(
        &self,
        docker: &sessiond_executor::docker::DockerExecutor,
    ) -> Result<crate::SweepReport> {
        Sweep(self.0).sweep_orphan_containers(docker).await
    }

    /// Runs the orphan sweep in the background: first
    /// [`ManagerConfig::orphan_sweep_grace`](crate::ManagerConfig) after the
    /// first startup recovery pass has finished, then every
    /// `orphan_sweep_interval` (if set). [`SessionManager::shutdown`] ends it.
    pub fn start_orphan_sweep(&self, docker: Arc<sessiond_executor::docker::DockerExecutor>) {
        Sweep(self.0).start_orphan_sweep(docker)
    }
}

/// The startup recovery pass: loads every live executor, settles turns a
/// restart left running, and recovers each executor once (through the
/// queue, so a call may claim one first).
pub(crate) struct Pass<'m>(pub(crate) &'m crate::manager::SessionManager);

impl std::ops::Deref for Pass<'_> {
    type Target = crate::manager::SessionManager;

    fn deref(&self) -> &Self::Target {
        self.0
    }
}

impl Pass<'_> {
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
    pub(crate) fn workspaces_recovered(&self) -> bool {
        *self.inner.workspaces_back.borrow()
    }

    /// Waits until [`Self::workspaces_recovered`].
    pub(crate) async fn wait_workspaces_recovered(&self) {
        let mut rx = self.inner.workspaces_back.subscribe();
        let _ = rx.wait_for(|done| *done).await;
    }

    /// Whether a startup recovery pass of this manager has finished.
    pub(crate) fn first_recovery_done(&self) -> bool {
        *self.inner.first_recovery.borrow()
    }

    /// Waits until a startup recovery pass of this manager has finished.
    pub(crate) async fn wait_first_recovery(&self) {
        let mut rx = self.inner.first_recovery.subscribe();
        let _ = rx.wait_for(|done| *done).await;
    }

    /// Recovers every executor that was live when the backend stopped. Meant
    /// to run before the server reports SERVING. Logs one summary line.
    pub(crate) async fn recover_all(&self) -> Result<RecoverySummary> {
        // One trace per pass, one child span per executor.
        let span = tracing::info_span!(
            "startup_recovery",
            executors = tracing::field::Empty,
            failed = tracing::field::Empty,
        );
        // Run as a task of the runtime, not inside the caller's future: the
        // pass wakes its driver once per executor (a pass slot freed, an
        // outcome in), and a caller that is the runtime's `block_on` thread
        // (`sessiond serve`, the bench) would be a third thread woken on
        // every one of them, beside the workers that run the recoveries.
        let me = self.0.clone();
        let pass = tokio::spawn(tracing::Instrument::instrument(
            async move { Pass(&me).recover_all_inner().await },
            span.clone(),
        ));
        let mut pass = AbortOnDrop(pass);
        let summary = match (&mut pass.0).await {
            Ok(summary) => summary?,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => return Err(crate::error::Error::Internal(format!("recovery pass: {e}"))),
        };
        span.record("executors", summary.total);
        span.record("failed", summary.failed);
        Ok(summary)
    }

    async fn recover_all_inner(&self) -> Result<RecoverySummary> {
        let started = Instant::now();
        // Calls wait for the queue from here until it is filled, and nothing
        // waits once the pass ends, however it ends.
        Queue(self).expect_startup_recovery();
        let _closed = scopeguard(|| Queue(self).close_queue());
        *crate::sync::lock(&self.inner.pass_outcomes) = Some(batch::start(self));
        let _written = scopeguard(|| {
            crate::sync::lock(&self.inner.pass_outcomes).take();
        });
        let store = &self.inner.store;
        let mut records = self.load_recoverable().await?;
        // Failed executors come back when their failure passes by itself
        // (a remote host, the Docker engine), or when an explicit resume's
        // intent (session STARTING) was cut off: that resume is finished.
        let resuming: std::collections::HashSet<SessionId> = store
            .list_session_ids_in_state(SessionState::Starting)
            .await?
            .into_iter()
            .collect();
        // Read whatever drivers are registered: a custom runtime's executors
        // parked while its driver was missing come back under any manager
        // (helper-44 1: one with no remote or Docker driver never read them).
        let failed = store
            .list_executors_with_status(vec![ExecutorStatus::Error])
            .await?;
        records.extend(failed.into_iter().filter(|r| {
            r.status == ExecutorStatus::Error
                && (resuming.contains(&r.session_id)
                    || retried_in_background(
                        r,
                        &self.inner.drivers,
                        &self.inner.config,
                        self.inner.started_at,
                    ))
        }));
        // With other replicas: only what this one could claim (its own from
        // before a restart, free or expired leases); the rest is theirs.
        let records = Fencing(self).claim_records(records).await?;
        let total = records.len();
        // Profiles are written before the manager serves: read them all once
        // instead of once per executor.
        match store.list_agent_profiles().await {
            Ok(all) => {
                *crate::sync::lock(&self.inner.recovery_profiles) =
                    all.into_iter().map(|p| (p.id, Arc::new(p))).collect();
            }
            Err(e) => tracing::debug!(error = %e, "profiles not preloaded"),
        }
        let queued = Queue(self).fill_queue(&records);
        // Only which executor, for its span: each recovery reads its
        // record again under its session's lock.
        let records: Vec<_> = records
            .into_iter()
            .map(|r| (ExecutorKey::from(&r), r.runtime, r.status))
            .collect();
        tracing::debug!(
            executors = total,
            took_ms = crate::metrics::ms(started.elapsed()),
            "recovery queue filled"
        );
        let gate = Queue(self).pass_gate();
        let concurrency = self.inner.config.recovery_concurrency.max(1);
        // The pass's concurrency bounds reattaches and the steps up to an
        // agent's launch; a recovery waiting for a launch slot (or running
        // its launch) gives its pass slot back (see `PassTicket`).
        let ramp = Ramp::new(RAMP_FIRST, concurrency);
        let slots = ramp.slots();
        let workspaces_back = Arc::new(std::sync::Mutex::new(None::<Duration>));
        let pending = Arc::new(PendingWorkspaces {
            left: std::sync::atomic::AtomicUsize::new(total),
            all_back: Box::new({
                let me = self.0.clone();
                let at = workspaces_back.clone();
                move || {
                    *crate::sync::lock(&at) = Some(started.elapsed());
                    // The pass's, not the span of the recovery that came last.
                    tracing::info!(
                        parent: None,
                        took_ms = crate::metrics::ms(started.elapsed()),
                        "startup recovery: every workspace is back; serving while agents relaunch"
                    );
                    Pass(&me).mark_workspaces_back();
                }
            }),
        });
        if total == 0 {
            self.mark_workspaces_back();
        }
        let passed: Vec<(SessionId, PassResult)> = futures::stream::iter(records)
            .map(|(executor, runtime, status)| {
                let me = self.0.clone();
                let gate = gate.clone();
                let slots = slots.clone();
                let ramp = ramp.clone();
                let pending = pending.clone();
                let span = tracing::info_span!(
                    "recover_executor",
                    executor_id = %executor.id,
                    session_id = %executor.session_id,
                    runtime = runtime.as_str(),
                    status = status.as_str(),
                    outcome = tracing::field::Empty,
                );
                tracing::Instrument::instrument(
                    async move {
                        if let Some(gate) = gate {
                            gate().await;
                        }
                        let session = executor.session_id;
                        let ticket = match slots.acquire_owned().await {
                            Ok(slot) => PassTicket {
                                _slot: slot,
                                pending,
                                ramp,
                            },
                            Err(_) => unreachable!("the pass's semaphore is never closed"),
                        };
                        // A call on the session may have claimed it already:
                        // its outcome is counted once the pass is through.
                        let claim = queued
                            .then(|| Queue(&me).claim(session, Lane::Pass))
                            .flatten();
                        if let Some(Claim::Joined(fut)) = claim {
                            drop(ticket);
                            return (session, PassResult::Claimed(fut));
                        }
                        crate::sync::lock(&me.inner.pass_slots).insert(session, ticket);
                        let result = match claim {
                            Some(Claim::Started(fut)) => fut.await,
                            _ => Pass(&me).recover_shared(executor).await,
                        };
                        let ticket = crate::sync::lock(&me.inner.pass_slots).remove(&session);
                        drop(ticket);
                        let outcome = match &result {
                            Ok(label) => label.as_str(),
                            Err(_) => "failed",
                        };
                        tracing::Span::current().record("outcome", outcome);
                        (session, PassResult::Done(result))
                    },
                    span,
                )
            })
            .buffer_unordered(total.max(1))
            .collect()
            .await;
        let mut results = Vec::with_capacity(passed.len());
        for (session, r) in passed {
            results.push((
                session,
                match r {
                    PassResult::Done(r) => r,
                    PassResult::Claimed(fut) => fut.await,
                },
            ));
        }
        crate::sync::lock(&self.inner.recovery_profiles).clear();

        let mut summary = RecoverySummary {
            total,
            ..RecoverySummary::default()
        };
        for (session, result) in results {
            match result {
                Ok(label) => {
                    *summary.counts.entry(label.as_str()).or_default() += 1;
                    if !agent_back_or_left_alone(label) {
                        summary.not_back += 1;
                    }
                }
                Err(ref e) => {
                    summary.failed += 1;
                    tracing::error!(%session, error = %e, "recovery of session failed");
                }
            }
            summary
                .outcomes
                .push((session, result.map_err(|e| e.to_string())));
        }
        summary.duration = started.elapsed();
        summary.workspaces_back = crate::sync::lock(&workspaces_back).unwrap_or(summary.duration);
        let counts = summary
            .counts
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ");
        let summary_line = if counts.is_empty() {
            "nothing to recover".to_owned()
        } else {
            counts
        };
        if summary.failed + summary.not_back > 0 {
            // Each of them had its WARN line with the reason (`finish`).
            tracing::warn!(
                total = summary.total,
                failed = summary.failed + summary.not_back,
                not_back = summary.not_back,
                errors = summary.failed,
                workspaces_back_ms = summary.workspaces_back.as_millis() as u64,
                duration_ms = summary.duration.as_millis() as u64,
                "startup recovery done, {} session(s) not back: {summary_line}",
                summary.failed + summary.not_back,
            );
        } else {
            tracing::info!(
                total = summary.total,
                failed = 0,
                workspaces_back_ms = summary.workspaces_back.as_millis() as u64,
                duration_ms = summary.duration.as_millis() as u64,
                "startup recovery done: {summary_line}"
            );
        }
        self.settle_stale_turns().await;
        self.mark_first_recovery_done();
        Liveness(self).start_liveness_checks();
        Ok(summary)
    }

    /// Turns left pending in ERROR sessions by versions that did not end
    /// them when the session failed: no pump settles a turn of a session
    /// that is not RUNNING, so each is ended interrupted here (see
    /// [`Self::settle_stale_turn`]). After the pass, so the agents it found
    /// running are known; sessions another replica owns are left to it.
    /// Best effort: a failure is logged and the next start tries again.
    async fn settle_stale_turns(&self) {
        let stale = match self
            .inner
            .store
            .list_sessions_with_metadata_key(SessionState::Error, crate::turn::TURN_KEY.to_owned())
            .await
        {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "could not look for turns left pending in ERROR sessions");
                return;
            }
        };
        for session in stale {
            let id = session.id;
            if !Fencing(self).owns(id) {
                continue;
            }
            let _guard = self.inner.sessions.lock(id).await;
            let settled = match self.inner.store.get_session(id).await {
                Ok(s) => self.settle_stale_turn(s).await.map(|_| ()),
                Err(e) => Err(e.into()),
            };
            if let Err(e) = settled {
                tracing::warn!(session = %id, error = %e, "could not end a turn left pending in an ERROR session");
            }
        }
    }

    /// A session in ERROR whose metadata still names a pending turn, with no
    /// agent running (written before every path to ERROR ended its turn):
    /// the turn ends interrupted as `finish` ends it (partial reply marked,
    /// the system message, `turn_ended`, the turn cleared and kept for
    /// RetryTurn) in one commit; the session stays ERROR. Idempotent: a
    /// session without such a turn is returned unchanged, and the commit
    /// clears it. The caller holds the session lock.
    pub(crate) async fn settle_stale_turn(&self, session: Session) -> Result<Session> {
        let Some(turn) = session.metadata.get(crate::turn::TURN_KEY).cloned() else {
            return Ok(session);
        };
        if session.state != SessionState::Error
            || self
                .execution(session.id)
                .is_some_and(|e| e.agent == AgentProcessState::Running)
        {
            return Ok(session);
        }
        let why = format!(
            "the session is in ERROR ({}) and no agent runs this turn",
            session
                .error_message
                .as_deref()
                .unwrap_or("no reason recorded")
        );
        let mut next = session.clone();
        let change =
            crate::turn::interrupt_turn(self, &session, &turn, &why, Changeset::new(), &mut next)
                .await?;
        let committed = self.commit(change.update_session(next)).await?;
        self.inner
            .metrics
            .turn_ended(session.id, crate::metrics::TurnOutcome::Interrupted);
        tracing::warn!(session = %session.id, %turn,
            "a turn left pending in an ERROR session ended interrupted");
        Ok(committed.session.unwrap_or(session))
    }

    /// Every executor the pass must look at (`starting` or `ready`), read
    /// page by page: between two pages a call that arrived meanwhile goes
    /// first (reading and decoding 10,000 records is CPU the call's own
    /// recovery would otherwise share). Only those created before the pass
    /// began: what a call creates meanwhile is that call's.
    async fn load_recoverable(&self) -> Result<Vec<ExecutorRecord>> {
        let until = Utc::now();
        let mut records: Vec<ExecutorRecord> = Vec::new();
        loop {
            let after = records.last().map(|r| (r.created_at, r.id));
            let t = Instant::now();
            let page = self
                .inner
                .store
                .load_recoverable_executors_page(until, after, LOAD_PAGE)
                .await?;
            let full = page.len() == LOAD_PAGE as usize;
            records.extend(page);
            let read = t.elapsed();
            if !full {
                tracing::debug!(
                    loaded = records.len(),
                    read_ms = crate::metrics::ms(read),
                    "recovery load: last page read"
                );
                return Ok(records);
            }
            let paused = Queue(self).yield_to_calls().await;
            tracing::debug!(
                loaded = records.len(),
                read_ms = crate::metrics::ms(read),
                paused_ms = crate::metrics::ms(paused),
                "recovery load: page read"
            );
        }
    }

    /// Recovers one executor as the session's exclusive operation (an
    /// explicit resume arriving meanwhile joins it).
    pub(crate) async fn recover_shared(&self, executor: ExecutorKey) -> Result<OutcomeLabel> {
        self.recover_shared_in(executor, Lane::Other).await
    }

    /// [`Self::recover_shared`] in a lane: a call's recovery goes ahead of
    /// the pass's (see [`Lane`]).
    pub(crate) async fn recover_shared_in(
        &self,
        executor: ExecutorKey,
        lane: Lane,
    ) -> Result<OutcomeLabel> {
        self.recover_shared_with(executor, lane, None).await
    }

    /// [`Self::recover_shared_in`]; with `yielding`, the recovery's store
    /// calls give way to everyone else's while the flag is set (the pass's
    /// recoveries: see `sessiond_store::Store::yielding`).
    pub(crate) async fn recover_shared_with(
        &self,
        executor: ExecutorKey,
        lane: Lane,
        yielding: Option<Yield>,
    ) -> Result<OutcomeLabel> {
        self.start_shared(executor, lane, yielding).await
    }

    /// Starts the session's recovery now as its single flight (or joins the
    /// operation in flight), on the single flight's own task; the returned
    /// future only waits for the outcome. So a claim of the queue starts
    /// the recovery at once without a task of its own to start it from.
    pub(crate) fn start_shared(
        &self,
        executor: ExecutorKey,
        lane: Lane,
        yielding: Option<Yield>,
    ) -> impl Future<Output = Result<OutcomeLabel>> + Send + 'static {
        let me = self.0.clone();
        let session = executor.session_id;
        // Each arm builds the recovery inside its await: a `run` local
        // would stay in this future beside the copy the arm awaits.
        let op = async move {
            let recovery = ExecutorRecovery(&me);
            match yielding {
                Some(flag) => {
                    let flagged = Some(flag.clone());
                    Store::yielding(flag, recovery.recover_one(executor, lane, flagged)).await
                }
                None => recovery.recover_one(executor, lane, None).await,
            }
            .map(OpOutcome::Recovery)
        };
        let (_, fut) = self.single_flight(session, OpKind::Recovery, op.boxed());
        async move {
            match fut.await? {
                OpOutcome::Recovery(label) => Ok(label),
                // An explicit resume was running; it did the work.
                OpOutcome::Resume(status) => Ok(if status.is_agent_running {
                    OutcomeLabel::Resumed
                } else {
                    OutcomeLabel::ExecutorOnly
                }),
            }
        }
    }
}

/// One executor's recovery, driven through the domain's step machine: its
/// intent, each step's call, its outcome commit; and its retries and
/// reconnects in the background.
pub(crate) struct ExecutorRecovery<'m>(pub(crate) &'m crate::manager::SessionManager);

impl std::ops::Deref for ExecutorRecovery<'_> {
    type Target = crate::manager::SessionManager;

    fn deref(&self) -> &Self::Target {
        self.0
    }
}

impl ExecutorRecovery<'_> {
    pub(crate) async fn recover_one(
        &self,
        executor: ExecutorKey,
        lane: Lane,
        yielding: Option<Yield>,
    ) -> Result<OutcomeLabel> {
        let call = matches!(lane, Lane::Call | Lane::Resume);
        let pausing = call.then(|| Queue(self).call_recovery_started());
        // A pass recovery a call joined (promoted) no longer pauses for calls.
        let pauses = || lane == Lane::Pass && yielding.as_ref().is_none_or(Yield::is_yielding);
        if pauses() {
            Queue(self).yield_to_calls().await;
        }
        let began = Instant::now();
        let _guard = self.inner.sessions.lock(executor.session_id).await;
        // However it ends, a workspace call waits on its outcome from then.
        let _ready_until_done = scopeguard(|| {
            self.inner.workspaces_ready.forget(executor.session_id);
        });
        if call {
            tracing::debug!(
                session_id = %executor.session_id,
                at_ms = crate::metrics::ms(began.elapsed()),
                "call's recovery: session locked"
            );
        }
        let store = &self.inner.store;
        // Re-read under the lock: the caller's copy may be stale. The
        // pass's own recoveries read in groups.
        let grouped = pauses()
            .then(|| crate::sync::lock(&self.inner.pass_outcomes).clone())
            .flatten();
        let (record, session) = match &grouped {
            Some(outcomes) => batch::read(outcomes, self, executor.id).await?,
            None => store.get_executor_and_session(executor.id).await?,
        };
        // Only the lease holder recovers (its lease may have gone to another
        // replica since this recovery was queued).
        Fencing(self).ensure_owner(&record)?;
        let preloaded = crate::sync::lock(&self.inner.recovery_profiles)
            .get(&session.agent_profile_id)
            .cloned();
        let profile = match preloaded {
            Some(p) => p,
            None => Arc::new(store.get_agent_profile(session.agent_profile_id).await?),
        };
        let profile = crate::session_mcp::with_session_servers(profile, &session.metadata);
        if call {
            tracing::debug!(
                session_id = %record.session_id,
                at_ms = crate::metrics::ms(began.elapsed()),
                "call's recovery: records read"
            );
        }
        let input_attempt = self.inner.agent_recoveries.attempt(session.id);
        let input = if lane == Lane::Resume {
            RecoveryInput::new(
                &record,
                &session,
                profile.supports_session_resume,
                sessiond_domain::ResumePolicy::Startup,
            )
        } else {
            RecoveryInput::new(
                &record,
                &session,
                profile.supports_session_resume,
                self.inner.config.resume_policy,
            )
            .attempt(input_attempt, self.inner.config.max_attempts)
        };
        let retry = record.runtime == Runtime::Remote
            && window_open(
                &record,
                self.inner.config.remote_retry_window,
                Utc::now(),
                self.inner.started_at,
            );
        let mut machine = Recovery::new(input);
        let mut deadline;
        let mut run = Run {
            started_as: record.status,
            record,
            session,
            profile,
            agent: SurvivingAgent::None,
            agent_state: None,
            probe: None,
            seen_unsaved: false,
            adopted_token: false,
            replaced: None,
            ahead: ahead::Ahead::default(),
            outcomes: None,
            unrecorded_turn: None,
            agent_silence: self.agent_silence(lane == Lane::Resume, input_attempt),
            pausing,
        };
        let mut action = machine.start();
        // Open from the agent's launch to the recovery's end.
        let mut mailbox = None;
        // A call waits on this recovery (its own, or a pass recovery it
        // joined, which no longer yields): its agent's launch goes first.
        let priority = || {
            let joined = lane == Lane::Pass && yielding.as_ref().is_some_and(|y| !y.is_yielding());
            if call || joined {
                Priority::Call
            } else {
                Priority::Background
            }
        };
        loop {
            if pauses() {
                Queue(self).yield_to_calls().await;
            }
            // A deadline bounds silence: each step has the whole limit to
            // answer (an agent's launch and resume are watched for signs
            // of life instead: `until_silent`).
            deadline = Instant::now() + self.inner.config.executor_deadline;
            if action == Action::HealthCheck {
                // No launch rides on the health check of a session a stop
                // or delete is ending.
                run.ahead.intent = machine.resume_after_health().filter(|_| {
                    !self
                        .inner
                        .agent_recoveries
                        .is_withdrawn(executor.session_id)
                });
            }
            let observation = match action {
                Action::Done(outcome) => {
                    let label = outcome.label;
                    let attempt = machine.input().attempt;
                    ExecutorRecovery(self).drop_unused_agent(&mut run).await;
                    if pauses() {
                        run.outcomes = crate::sync::lock(&self.inner.pass_outcomes).clone();
                    }
                    Box::pin(self.finish(run, outcome, attempt)).await?;
                    return Ok(label);
                }
                // The agent's launch and resume take as long as the agent
                // does: messages sent meanwhile are queued at once (the
                // step writes no session, so the letters' commits do not
                // race one of its own).
                action @ (Action::ResumeAgent { .. } | Action::OpenConversation) => {
                    let mailbox =
                        mailbox.get_or_insert_with(|| self.inner.mailboxes.open(run.session.id));
                    let mut latest = None;
                    let step = self.perform(&mut run, action, deadline, retry, priority());
                    let observed = letters::serve_during(self, mailbox, &mut latest, step).await?;
                    if let Some(latest) = latest {
                        letters::carry_queue(latest, &mut run.session);
                    }
                    observed
                }
                // Each step boxes its own future (`perform`): a recovery's
                // future stays a few KiB instead of tens, which every move
                // of it would copy.
                action => {
                    self.perform(&mut run, action, deadline, retry, priority())
                        .await?
                }
            };
            if call {
                tracing::debug!(
                    session_id = %run.record.session_id,
                    at_ms = crate::metrics::ms(began.elapsed()),
                    ?observation,
                    "call's recovery: step done"
                );
            }
            action = machine
                .observe(observation)
                .map_err(|e| Error::Internal(e.to_string()))?;
        }
    }

    /// A stop or delete came while the agent was being launched or its
    /// conversation loaded: the agent goes (the session is ending), and the
    /// recovery ends with the workspace back and no agent, as if the launch
    /// had never begun.
    async fn launch_withdrawn(&self, run: &Run) -> Observation {
        let sid = run.session.id;
        tracing::info!(session = %sid, executor_id = %run.record.id,
            "recovery: a stop or delete came during the agent's launch; the launch is cut");
        Agents(self).stop_agent_quietly(&run.record).await;
        self.cache_update(sid, |e| e.agent = AgentProcessState::NotRunning);
        Observation::ResumeWithdrawn
    }

    /// Performs one action of the machine and reports what it saw.
    ///
    /// Each step that waits runs in a box of its own, allocated at its own
    /// size: one box for the whole match would be the size of the largest
    /// step (several KiB) for every step, allocated and copied each time.
    async fn perform(
        &self,
        run: &mut Run,
        action: Action,
        deadline: Instant,
        retry_in_background: bool,
        priority: Priority,
    ) -> Result<Observation> {
        let remaining = deadline.saturating_duration_since(Instant::now());
        let timed_out = remaining.is_zero();
        Ok(match action {
            Action::CheckWorktree { path } => Box::pin(async move {
                Ok::<_, Error>({
                    // A remote host's directory is not ours to look at: its
                    // agentctl adopts or recreates it, and serves it again.
                    let here = run.record.runtime != Runtime::Remote;
                    let managed = run.session.worktree.is_managed();
                    // A create cut short may have left its `agentctl worktree`
                    // running (it outlives a killed sessiond): the directory it
                    // makes is whole only once the restore below adopted it,
                    // which waits for that operation.
                    let made = run
                        .session
                        .metadata
                        .contains_key(crate::worktrees::WORKTREE_CREATED_KEY);
                    // A made worktree whose directory is there but is not
                    // it any more (a plain directory, another clone: the
                    // agent would work in it unknowing) goes to the restore
                    // below, which names what is in the way (helper-38 7).
                    let ours = !managed
                        || crate::worktrees::may_be_linked_worktree(
                            Path::new(&path),
                            Path::new(&run.session.worktree.repository),
                        );
                    if here && (made || !managed) && ours && Path::new(&path).is_dir() {
                        Observation::WorktreeExists
                    } else if managed {
                        // Ours: check it out again from its branch before the
                        // agent is relaunched in it. Bounded by the driver, not
                        // by the silence limit: a large checkout is work.
                        let driver = Agents(self).driver(run.record.runtime)?;
                        match Worktrees(self)
                            .restore_worktree(&driver, &run.session)
                            .await
                        {
                            Ok(anew) => {
                                // A container still running has the removed
                                // directory mounted, not the new one: stopped,
                                // it is started again on the new one.
                                if anew && run.record.runtime == Runtime::LocalDocker {
                                    let handle = ExecutorHandle::from_record(&run.record);
                                    if let Err(e) = driver.stop(&handle).await {
                                        tracing::warn!(executor_id = %run.record.id, error = %e,
                                            "could not stop the container of a recreated worktree");
                                    }
                                }
                                // Written with the outcome (a session whose
                                // create was cut short leaves STARTING).
                                run.session.metadata.insert(
                                    crate::worktrees::WORKTREE_CREATED_KEY.into(),
                                    "true".into(),
                                );
                                Observation::WorktreeExists
                            }
                            // A remote host that stopped answering says
                            // nothing about the branch.
                            Err(e)
                                if run.record.runtime == Runtime::Remote
                                    && e.kind() == crate::ErrorKind::Unavailable =>
                            {
                                Observation::HostUnreachable {
                                    reason: e.to_string(),
                                    retry_in_background,
                                }
                            }
                            // Something else stands at the directory.
                            Err(Error::Executor(x))
                                if matches!(
                                    &*x,
                                    sessiond_executor::Error::Worktree {
                                        code: tonic::Code::AlreadyExists,
                                        ..
                                    }
                                ) =>
                            {
                                Observation::WorktreeInTheWay {
                                    reason: format!(
                                        "{x}; sessiond leaves it as it is: move it away and \
                                         resume the session (the worktree is checked out again \
                                         from its branch), or delete the session with \
                                         keep_worktree"
                                    ),
                                }
                            }
                            Err(e) => Observation::WorktreeUnrecoverable {
                                reason: e.to_string(),
                            },
                        }
                    } else {
                        Observation::WorktreeMissing
                    }
                })
            })
            .await?,
            Action::ProbeProcess {
                pid,
                pid_start_time,
            } => match (sessiond_executor::process::stat(pid), pid_start_time) {
                (Some(st), Some(recorded)) if st.is_running() => Observation::ProcessAlive {
                    identity_proven: st.start_time == recorded,
                },
                (Some(st), None) if st.is_running() => Observation::ProcessAlive {
                    identity_proven: false,
                },
                _ => Observation::ProcessGone,
            },
            Action::LaunchAgentctl { generation, event } => Box::pin(async move {
                Ok::<_, Error>({
                    run.agent_state = None;
                    self.write_intent(run, generation, event).await?;
                    if timed_out {
                        return Ok(Observation::DeadlineExceeded);
                    }
                    match Agents(self)
                        .launch_agentctl(&run.record, &run.profile, generation, remaining)
                        .await
                    {
                        None => Observation::DeadlineExceeded,
                        Some(Err(e)) => Observation::ActionFailed {
                            reason: e.to_string(),
                        },
                        Some(Ok(handle)) => {
                            self.persist_handle(run, &handle).await?;
                            Observation::Launched
                        }
                    }
                })
            })
            .await?,
            Action::FindContainer { .. } => Box::pin(async move {
                Ok::<_, Error>({
                    if timed_out {
                        return Ok(Observation::DeadlineExceeded);
                    }
                    // `probe` starts nothing, so the intent of a start is written
                    // before `start` (Action::StartContainer).
                    let driver = Agents(self).driver(run.record.runtime)?;
                    let handle = ExecutorHandle::from_record(&run.record);
                    let Some(probed) = self.probe_recorded(run, &driver, &handle, remaining).await?
                    else {
                        return Ok(Observation::DeadlineExceeded);
                    };
                    match probed {
                        Ok(Probe::Reattachable { .. }) => Observation::ContainerRunning,
                        Ok(Probe::NeedsStart { .. }) => Observation::ContainerStopped,
                        Ok(Probe::Missing { .. } | Probe::NeedsLaunch { .. })
                        | Err(sessiond_executor::Error::ContainerMissing { .. }) => {
                            // Gone for good (the container, not the worktree
                            // a stopped one mounts): what the driver kept for it
                            // (run directory, secret) goes too.
                            if Path::new(&run.record.workspace_path).is_dir() {
                                self.remove_gone_executor(&driver, &handle).await;
                            }
                            Observation::ContainerMissing
                        }
                        Err(e) => Observation::DockerUnavailable {
                            reason: e.to_string(),
                        },
                    }
                })
            })
            .await?,
            Action::ProbeExecutor => Box::pin(async move {
                Ok::<_, Error>({
                    // A custom runtime: its driver says what became of the
                    // executor; `probe` starts nothing, so the intent of a start
                    // or launch is written before it (StartContainer,
                    // LaunchAgentctl).
                    let Ok(driver) = Agents(self).driver(run.record.runtime) else {
                        tracing::warn!(session = %run.session.id, executor_id = %run.record.id,
                            runtime = %run.record.runtime,
                            "recovery: no executor driver is registered for this runtime");
                        return Ok(Observation::RuntimeNotRegistered);
                    };
                    if timed_out {
                        return Ok(Observation::DeadlineExceeded);
                    }
                    let handle = ExecutorHandle::from_record(&run.record);
                    let Some(probed) = self.probe_recorded(run, &driver, &handle, remaining).await?
                    else {
                        return Ok(Observation::DeadlineExceeded);
                    };
                    match probed {
                        Ok(Probe::Reattachable { .. }) => Observation::ExecutorReattachable,
                        Ok(Probe::NeedsStart { .. }) => Observation::ExecutorNeedsStart,
                        Ok(Probe::NeedsLaunch { .. }) => Observation::ExecutorNeedsLaunch,
                        Ok(Probe::Missing { reason }) => Observation::ExecutorMissing { reason },
                        Err(e) => Observation::ActionFailed {
                            reason: e.to_string(),
                        },
                    }
                })
            })
            .await?,
            Action::StartContainer { generation, event } => Box::pin(async move {
                Ok::<_, Error>({
                    run.agent_state = None;
                    self.write_intent(run, generation, event).await?;
                    #[cfg(feature = "failpoints")]
                    fail::fail_point!("launch-after-intent");
                    if timed_out {
                        return Ok(Observation::DeadlineExceeded);
                    }
                    let driver = Agents(self).driver(run.record.runtime)?;
                    let handle = ExecutorHandle::from_record(&run.record);
                    match tokio::time::timeout(remaining, driver.start(&handle, generation)).await {
                        Err(_) => Observation::DeadlineExceeded,
                        Ok(Err(e)) => Observation::ActionFailed {
                            reason: e.to_string(),
                        },
                        Ok(Ok(started)) => {
                            #[cfg(feature = "failpoints")]
                            fail::fail_point!("launch-after-spawn");
                            self.persist_handle(run, &started).await?;
                            Observation::Launched
                        }
                    }
                })
            })
            .await?,
            Action::HealthCheck => Box::pin(async move {
                Ok::<_, Error>({
                    if timed_out {
                        return Ok(Observation::DeadlineExceeded);
                    }
                    let driver = Agents(self).driver(run.record.runtime)?;
                    let id = run.record.id;
                    let (_, modes_stamp) = self.inner.sessions.cached_modes(run.session.id, "");
                    let checked = match Box::pin(self.health_ahead(run, &driver, remaining)).await {
                        Some(checked) => checked,
                        None => {
                            let health = async {
                                Agents(self)
                                    .agentctl(&run.record, &driver)?
                                    .verify_identity(id)
                                    .await
                            };
                            tokio::time::timeout(remaining, health)
                                .await
                                .map_err(|_| ())
                        }
                    };
                    match checked {
                        Err(()) => Observation::DeadlineExceeded,
                        Ok(Ok(health)) => {
                            // Test-only crash point: agentctl proved it is alive
                            // and ours (a reattach), nothing of it is written yet.
                            #[cfg(feature = "failpoints")]
                            fail::fail_point!("recovery-after-reattach");
                            run.agent = surviving_agent(&health, run.session.resume_token.as_deref());
                            run.unrecorded_turn = (!health.last_turn_id.is_empty()
                                && run.session.metadata.get(crate::turn::LAST_TURN_KEY)
                                    != Some(&health.last_turn_id))
                            .then(|| (health.last_turn_id.clone(), health.instance_id.clone()));
                            if run.agent != SurvivingAgent::None
                                && run.session.resume_token.is_none()
                                && !health.acp_session_id.is_empty()
                            {
                                // A create died between the agent's `session/new`
                                // and storing its id: the conversation agentctl
                                // holds is the one that create opened. Without
                                // adopting it the session would run on, unable
                                // ever to be resumed.
                                tracing::info!(session = %run.session.id, executor_id = %run.record.id,
                                    "recovery: adopting the surviving agent's conversation as the resume token");
                                run.session.resume_token = Some(health.acp_session_id.clone());
                                run.record.resume_token = Some(health.acp_session_id.clone());
                                run.adopted_token = true;
                            }
                            if run.agent != SurvivingAgent::None {
                                // A reattached agent's modes, for GetSessionStatus
                                // (a resume keeps its load's answer instead).
                                self.inner.sessions.remember_modes(
                                    run.session.id,
                                    run.record.execution_id(),
                                    modes_stamp,
                                    health.modes.as_ref().map(crate::ops::agent_modes),
                                );
                            }
                            // An agent still reopening its conversation (a
                            // predecessor's resume, found by a restart of
                            // sessiond alone) is waited for as a launch is,
                            // holding a launch slot (helper-57 F4: two such
                            // loads ran beside two new launches at a limit of 2).
                            run.agent_state = Some(match health.agent_state {
                                AgentState::Ready if health.progress.resuming => {
                                    AgentState::Starting
                                }
                                state => state,
                            });
                            Observation::Healthy { agent: run.agent }
                        }
                        // Not hung: agentctl serves a newer owner. Never
                        // "end the hung agentctl" here: that would kill the
                        // new owner's. This replica stops acting on it.
                        Ok(Err(e)) if Fencing(self).executor_refused(run.session.id, &e) => {
                            return Err(Fencing(self).not_owner_now(run.session.id).await);
                        }
                        Ok(Err(e)) if e.is_unavailable() => Observation::HostUnreachable {
                            reason: e.to_string(),
                            retry_in_background,
                        },
                        Ok(Err(e)) => Observation::Unhealthy {
                            reason: e.to_string(),
                        },
                    }
                })
            })
            .await?,
            Action::ProbeCapabilities => Box::pin(async move {
                Ok::<_, Error>({
                    if timed_out {
                        return Ok(Observation::DeadlineExceeded);
                    }
                    let driver = Agents(self).driver(run.record.runtime)?;
                    let seen = run.ahead.caps.take();
                    let caps = async {
                        match seen {
                            Some(caps) => Ok(caps),
                            None => {
                                Agents(self)
                                    .agentctl(&run.record, &driver)?
                                    .capabilities()
                                    .await
                            }
                        }
                    };
                    match tokio::time::timeout(remaining, caps).await {
                        Ok(Ok(caps)) => match probe_verdict(caps.supports_session_resume) {
                            Some(v) => {
                                run.probe = Some(v);
                                Observation::Capabilities {
                                    supports_session_resume: v,
                                }
                            }
                            None => Observation::CapabilitiesUnknown,
                        },
                        Ok(Err(e)) => Observation::ActionFailed {
                            reason: e.to_string(),
                        },
                        Err(_) => Observation::CapabilitiesUnknown,
                    }
                })
            })
            .await?,
            Action::MarkExecutorReady { event } => Box::pin(async move {
                Ok::<_, Error>({
                    self.mark_ready(run, event).await?;
                    Observation::Applied
                })
            })
            .await?,
            Action::ResumeAgent { .. } | Action::OpenConversation => Box::pin(async move {
                Ok::<_, Error>({
                    // `None`: open the conversation an interrupted create never got.
                    let resume_token = match action {
                        Action::ResumeAgent { resume_token } => Some(resume_token),
                        _ => None,
                    };
                    let sid = run.session.id;
                    // Waiting for a launch is not the pass's work: its slot goes
                    // on to the reattaches behind this one, and a call's
                    // pause of the pass ends with its workspace back.
                    let ticket = crate::sync::lock(&self.inner.pass_slots).remove(&sid);
                    drop(ticket);
                    drop(run.pausing.take());
                    let mut ahead = run.ahead.agent.take();
                    // A launch the health check left running is waited for
                    // here, where the agent is (the workspace is back); its
                    // stage moved on meanwhile (launching, resuming).
                    let settled_late = ahead.as_ref().is_some_and(|a| a.is_pending());
                    // A stop or delete meanwhile cuts the launch: it waited
                    // for the whole load (helper-53 a: 40-90 s).
                    let withdrawn = || self.inner.agent_recoveries.withdrawn(sid);
                    if let Some(a) = ahead.as_mut() {
                        let settled = tokio::select! {
                            () = a.settle() => true,
                            () = withdrawn() => false,
                        };
                        if !settled {
                            if let Some(a) = ahead.take() {
                                a.abandon();
                            }
                            return Ok(ExecutorRecovery(self).launch_withdrawn(run).await);
                        }
                    }
                    let mut ahead = ahead.filter(|a| a.serves(resume_token.as_deref()));
                    let agent_up =
                        matches!(run.agent_state, Some(AgentState::Ready | AgentState::Busy));
                    // A stop or delete came first: no agent is launched (or
                    // reopened) only to be stopped. One the health check's
                    // `Recover` launched already is taken as it is.
                    if ahead.is_none() && self.inner.agent_recoveries.is_withdrawn(sid) {
                        return Ok(Observation::ResumeWithdrawn);
                    }
                    let (permit, began) = match ahead.as_mut() {
                        Some(a) => a.take_permit(),
                        None => {
                            self.inner
                                .agent_recoveries
                                .enter(sid, RecoveryStage::Queued);
                            // A new agent process waits for a launch slot of its
                            // host; an agent that survived only reopens its
                            // conversation.
                            let permit = if agent_up {
                                None
                            } else {
                                let slot = self.inner.launches.acquire(
                                    host_of(&run.record),
                                    sid,
                                    priority,
                                );
                                tokio::select! {
                                    permit = slot => Some(permit),
                                    () = self.inner.agent_recoveries.withdrawn(sid) => {
                                        return Ok(Observation::ResumeWithdrawn);
                                    }
                                }
                            };
                            (permit, Instant::now())
                        }
                    };
                    if !settled_late {
                        self.inner
                            .agent_recoveries
                            .enter(sid, RecoveryStage::Launching);
                    }
                    self.cache_update(sid, |e| e.agent = AgentProcessState::Starting);
                    let mut seen = run.agent_state.take();
                    let attempted = match ahead {
                        Some(a) => Some(ExecutorRecovery(self).resumed_ahead(run, a).await?),
                        None => match (&resume_token, agent_up) {
                            (Some(token), false) => {
                                let recovery = ExecutorRecovery(self);
                                let one = tokio::select! {
                                    one = recovery.resume_in_one_call(run, token) => Some(one),
                                    () = withdrawn() => None,
                                };
                                let Some(one) = one else {
                                    return Ok(ExecutorRecovery(self).launch_withdrawn(run).await);
                                };
                                // Not done by it: the agent's state is asked anew.
                                seen = seen.filter(|_| one.is_some());
                                one
                            }
                            _ => None,
                        },
                    };
                    let attempted = match attempted {
                        Some(result) => result,
                        None => {
                            let no_turn_yet =
                                crate::turn::no_turn_yet(&self.inner.store, &run.session).await?;
                            let attempt = async {
                                match &resume_token {
                                    Some(token) => {
                                        Agents(self)
                                            .resume_agent_seen(
                                                &run.record,
                                                &run.profile,
                                                token,
                                                seen,
                                                no_turn_yet,
                                            )
                                            .await
                                    }
                                    None => {
                                        Agents(self)
                                            .open_conversation_seen(&run.record, &run.profile, seen)
                                            .await
                                    }
                                }
                            };
                            let attempted = tokio::select! {
                                r = Box::pin(self.until_silent(&run.record, run.agent_silence, attempt)) => Some(r),
                                () = withdrawn() => None,
                            };
                            let Some(attempted) = attempted else {
                                return Ok(ExecutorRecovery(self).launch_withdrawn(run).await);
                            };
                            attempted
                        }
                    };
                    let (observation, ended) = match attempted {
                        Ok(Ok(resumed)) => {
                            match resumed {
                                Resumed::Loaded => {}
                                Resumed::Replaced { token, reason } => {
                                    tracing::info!(session = %sid, reason = %reason,
                                        "recovery: the agent had not kept the unprompted conversation; a new one replaces it");
                                    run.session.resume_token = Some(token.clone());
                                    run.record.resume_token = Some(token.clone());
                                    run.adopted_token = true;
                                    run.replaced = Some(EventPayload::ConversationReplaced {
                                        previous_resume_token: resume_token.unwrap_or_default(),
                                        resume_token: token,
                                        reason,
                                    });
                                }
                                Resumed::Opened { token } => {
                                    tracing::info!(session = %sid,
                                        "recovery: the session's create was interrupted before the agent's conversation; opened it");
                                    run.session.resume_token = Some(token.clone());
                                    run.record.resume_token = Some(token);
                                    run.adopted_token = true;
                                }
                            }
                            (Observation::ResumeSucceeded, Ended::Up(began.elapsed()))
                        }
                        Ok(Err(e)) => {
                            // The remote host went away after its Health: the
                            // host's failure, reconnected like any other.
                            if let Some(reason) = self.remote_host_gone(&run.record, Some(&e)).await {
                                self.cache_update(sid, |e| e.agent = AgentProcessState::NotRunning);
                                return Ok(Observation::HostUnreachable {
                                    reason,
                                    retry_in_background,
                                });
                            }
                            Agents(self).stop_agent_quietly(&run.record).await;
                            self.cache_update(sid, |e| e.agent = AgentProcessState::NotRunning);
                            if load_refused(&e) {
                                let reason = e.to_string();
                                (Observation::ConversationLost { reason }, Ended::Neutral)
                            } else if passes_by_itself(&e) {
                                let reason = e.to_string();
                                (Observation::ResumeInterrupted { reason }, Ended::Cut)
                            } else {
                                let reason = e.to_string();
                                (Observation::ResumeFailed { reason }, Ended::Neutral)
                            }
                        }
                        Err(silence) => {
                            self.cache_update(sid, |e| e.agent = AgentProcessState::NotRunning);
                            if let Some(reason) = self.remote_host_gone(&run.record, None).await {
                                return Ok(Observation::HostUnreachable {
                                    reason,
                                    retry_in_background,
                                });
                            }
                            tracing::warn!(session = %sid, executor_id = %run.record.id,
                                took_ms = crate::metrics::ms(began.elapsed()), %silence,
                                "recovery: the agent's launch or resume was cut");
                            Agents(self).stop_agent_quietly(&run.record).await;
                            (
                                Observation::ResumeInterrupted { reason: silence },
                                Ended::Cut,
                            )
                        }
                    };
                    let cpu_wait = self.inner.agent_recoveries.take_cpu_wait(sid);
                    if let Some(permit) = permit {
                        permit.finish_seen(ended, cpu_wait);
                    }
                    observation
                })
            })
            .await?,
            Action::StopExecutor => Box::pin(async move {
                Ok::<_, Error>({
                    let driver = Agents(self).driver(run.record.runtime)?;
                    let handle = ExecutorHandle::from_record(&run.record);
                    let limit = remaining.max(Duration::from_secs(1));
                    if let Ok(client) = driver.client(&handle) {
                        let _ = tokio::time::timeout(
                            limit,
                            client.stop_agent(self.inner.config.agent_stop_grace),
                        )
                        .await;
                    }
                    stopped_within(&driver, &handle, limit, "stopping").await
                })
            })
            .await?,
            Action::EndAgentctl => Box::pin(async move {
                Ok::<_, Error>({
                    // The recorded agentctl is ours (pid + start time) and did not
                    // answer Health: a hung process. `stop` verifies the start
                    // time again, sends TERM, then KILL (which also ends a
                    // SIGSTOPped one); the launch that follows leaves exactly one.
                    tracing::warn!(session = %run.session.id, executor_id = %run.record.id,
                        pid = ?run.record.pid, "recovery: our agentctl is hung, ending it to relaunch");
                    let driver = Agents(self).driver(run.record.runtime)?;
                    let handle = ExecutorHandle::from_record(&run.record);
                    let limit =
                        remaining.max(Duration::from_secs(1)) + self.inner.config.agent_stop_grace;
                    stopped_within(&driver, &handle, limit, "ending the hung agentctl").await
                })
            })
            .await?,
            Action::Done(_) => {
                return Err(Error::Internal("Done is handled by the caller".into()));
            }
        })
    }

    /// A call to a remote executor's agentctl failed (`failure`; `None`: it
    /// did not finish in time): did its host go away? Only a transport
    /// failure can mean that (any answer of agentctl or its agent says the
    /// host is there), and only if `Health` now fails in transport too, so
    /// an agent that refuses a resume stays the agent's failure. `Some`:
    /// the host does not answer, and why.
    pub(crate) async fn remote_host_gone(
        &self,
        record: &ExecutorRecord,
        failure: Option<&Error>,
    ) -> Option<String> {
        if record.runtime != Runtime::Remote || !failure.is_none_or(Error::is_transport) {
            return None;
        }
        let driver = Agents(self).driver(record.runtime).ok()?;
        let handle = ExecutorHandle::from_record(record);
        let limit = self
            .inner
            .config
            .executor_deadline
            .min(Duration::from_secs(5));
        let confirmed = match tokio::time::timeout(limit, driver.health(&handle)).await {
            Err(_) => format!("Health did not answer within {limit:?}"),
            Ok(Err(e)) if e.is_unavailable() => e.to_string(),
            Ok(_) => return None,
        };
        let reason = match failure {
            Some(e) => format!("{e}; {confirmed}"),
            None => format!("the call did not finish in time; {confirmed}"),
        };
        tracing::info!(executor_id = %record.id, %reason, "the remote host went away during the resume");
        Some(reason)
    }

    /// Removes what a driver kept for an executor whose container no longer
    /// exists (its run directory and secret), best effort: the session is
    /// told to create a new one either way, and a leftover is only disk.
    pub(crate) async fn remove_gone_executor(
        &self,
        driver: &Arc<dyn sessiond_executor::Executor>,
        handle: &ExecutorHandle,
    ) {
        let limit = self.inner.config.executor_deadline;
        match tokio::time::timeout(limit, driver.remove(handle)).await {
            Ok(Ok(())) => {
                tracing::info!(executor_id = %handle.executor_id,
                    "container gone; its run directory is removed");
            }
            Ok(Err(e)) => tracing::warn!(executor_id = %handle.executor_id, error = %e,
                "container gone; could not remove its run directory"),
            Err(_) => tracing::warn!(executor_id = %handle.executor_id,
                "container gone; removing its run directory did not finish in time"),
        }
    }

    /// What an executor whose agentctl stopped answering is told. A Docker
    /// executor whose container is gone for good is said so (and its
    /// leftovers removed) at once, not after a resume finds out: the status
    /// then says "not resumable" with the same words.
    pub(crate) async fn lost_agentctl_message(
        &self,
        record: &ExecutorRecord,
        reason: &str,
    ) -> String {
        if record.runtime == Runtime::LocalDocker
            && Path::new(&record.workspace_path).is_dir()
            && let Ok(driver) = Agents(self).driver(record.runtime)
        {
            let handle = ExecutorHandle::from_record(record);
            let limit = self.inner.config.executor_deadline;
            let probed = tokio::time::timeout(limit, driver.probe(&handle)).await;
            tracing::debug!(executor_id = %record.id, ?probed, "agentctl lost: the container probed");
            if matches!(
                probed,
                Ok(Ok(Probe::Missing { .. }))
                    | Ok(Err(sessiond_executor::Error::ContainerMissing { .. }))
            ) {
                self.remove_gone_executor(&driver, &handle).await;
                return sessiond_domain::RecoveryFailure::ContainerMissing.message();
            }
        }
        format!("agentctl stopped answering ({reason}); resume the session to try again")
    }

    /// agentctl of `record` (a `ready` executor) stopped answering
    /// (`reason`): what to commit, and the executor record to retry when it
    /// can pass by itself. The caller holds the session lock.
    ///
    /// A condition that passes by itself must not end in ERROR: the
    /// executor goes `error` with the `recovering` code and the session
    /// keeps its state, a turn in flight ending interrupted (RUNNING goes
    /// to WAITING_FOR_INPUT) or, with [`TurnInFlight::Settle`], kept
    /// pending; the caller then spawns the retry, which runs recovery (a
    /// stopped container is started, a dead agentctl relaunched, the agent
    /// resumed, a kept turn settled). Only a container gone for good is a
    /// verdict: executor `error` and the session ERROR, as before.
    pub(crate) async fn agentctl_lost_change(
        &self,
        record: &ExecutorRecord,
        reason: &str,
        turn_in_flight: TurnInFlight,
    ) -> Result<(Changeset, Option<ExecutorRecord>)> {
        let sid = record.session_id;
        let verdict = self.lost_agentctl_message(record, reason).await;
        let gone = verdict.starts_with(RecoveryFailure::ContainerMissing.code());
        let keep_turn = turn_in_flight == TurnInFlight::Settle && !gone;
        let message = if gone {
            verdict
        } else {
            lost_agentctl_recovering(reason)
        };
        let mut failed = executor_moved(record, ExecutorEvent::Failed)?;
        failed.error_message = Some(message.clone());
        let mut change = Changeset::new().update_executor(failed.clone()).event(
            sid,
            EventPayload::AgentctlError {
                executor_id: record.id,
                error_message: message.clone(),
            },
        );
        let session = self.inner.store.get_session(sid).await?;
        if !session.state.is_terminal() && session.state != SessionState::Error {
            let turn = pending_turn(&session).filter(|_| !keep_turn);
            let (mut next, event) = if gone {
                crate::changes::transition(
                    &session,
                    sessiond_domain::SessionEvent::Failed,
                    Some(message),
                )?
            } else if session.state == SessionState::Running && turn.is_some() {
                crate::changes::transition(
                    &session,
                    sessiond_domain::SessionEvent::TurnEnded,
                    None,
                )?
            } else {
                (session.clone(), None)
            };
            if let Some(turn) = &turn {
                let why = format!("agentctl stopped answering during the turn ({reason})");
                change = crate::turn::interrupt_turn(self, &session, turn, &why, change, &mut next)
                    .await?;
                self.inner
                    .metrics
                    .turn_ended(sid, crate::metrics::TurnOutcome::Interrupted);
            }
            if turn.is_some() || event.is_some() {
                change = change.update_session(next);
            }
            if let Some(event) = event {
                change = change.event(sid, event);
            }
        }
        if gone {
            tracing::warn!(session = %sid, executor_id = %record.id, %reason,
                "agentctl stopped answering and its container is gone: the session is ERROR");
        } else {
            tracing::warn!(session = %sid, executor_id = %record.id, %reason,
                "agentctl stopped answering: recovering the session in the background");
        }
        Ok((change, (!gone).then_some(failed)))
    }

    /// The launch intent: executor `starting` with the new generation and
    /// its `agentctl_starting` event, in one transaction, before any spawn.
    async fn write_intent(
        &self,
        run: &mut Run,
        generation: i64,
        event: EventPayload,
    ) -> Result<()> {
        let mut record = executor_moved(&run.record, ExecutorEvent::LaunchIntent)?;
        record.generation = generation;
        record.error_message = None;
        let mut session = run.session.clone();
        session.agent_execution_id = Some(record.execution_id());
        let committed = self
            .commit(
                Changeset::new()
                    .update_executor(record)
                    .update_session(session)
                    .event(run.session.id, event),
            )
            .await?;
        run.record = committed
            .executor
            .ok_or_else(|| Error::Internal("no executor".into()))?;
        run.session = committed
            .session
            .ok_or_else(|| Error::Internal("no session".into()))?;
        Ok(())
    }

    /// The driver's probe of `handle` within `remaining` (`None`: no answer
    /// in time). An executor found reattachable somewhere else than
    /// recorded (a new port, a new container) is recorded there first.
    async fn probe_recorded(
        &self,
        run: &mut Run,
        driver: &Arc<dyn sessiond_executor::Executor>,
        handle: &ExecutorHandle,
        remaining: Duration,
    ) -> Result<Option<std::result::Result<Probe, sessiond_executor::Error>>> {
        let Ok(probed) = tokio::time::timeout(remaining, driver.probe(handle)).await else {
            return Ok(None);
        };
        if let Ok(Probe::Reattachable { handle: found, .. }) = &probed
            && found != handle
        {
            self.persist_handle(run, found).await?;
        }
        Ok(Some(probed))
    }

    /// Records where the freshly started agentctl is (pid, port, secret).
    async fn persist_handle(&self, run: &mut Run, handle: &ExecutorHandle) -> Result<()> {
        let mut record = run.record.clone();
        handle.apply_to(&mut record);
        let committed = self
            .commit(Changeset::new().update_executor(record))
            .await?;
        run.record = committed
            .executor
            .ok_or_else(|| Error::Internal("no executor".into()))?;
        Ok(())
    }

    /// Executor `ready` (workspace access on), the execution in the cache.
    /// `agentctl_ready` is published only when the status really changes, so
    /// a restart that finds everything as it was produces no event.
    async fn mark_ready(&self, run: &mut Run, event: EventPayload) -> Result<()> {
        let changed = run.record.status != ExecutorStatus::Ready;
        let resumes = run.record.supports_session_resume && run.probe != Some(false);
        if !changed
            && run.record.error_message.is_none()
            && resumes == run.record.supports_session_resume
        {
            // Already `ready` as stored: nothing to write before the next
            // step (a crash here finds the same row); the fresh
            // `last_seen_at` goes with the outcome, one commit instead of two.
            move_executor(&mut run.record, ExecutorEvent::Healthy)?;
            run.record.last_seen_at = Some(Utc::now());
            self.inner.sessions.cache_record(&run.record);
            run.seen_unsaved = true;
        } else {
            let mut record = executor_moved(&run.record, ExecutorEvent::Healthy)?;
            record.error_message = None;
            record.last_seen_at = Some(Utc::now());
            record.supports_session_resume = resumes;
            let mut change = Changeset::new().update_executor(record);
            if changed {
                change = change.event(run.session.id, event);
            }
            let committed = self.commit(change).await?;
            run.record = committed
                .executor
                .ok_or_else(|| Error::Internal("no executor".into()))?;
            run.seen_unsaved = false;
        }
        // Test-only crash point: executor `ready` is stored, the next step
        // (agent resume, or the outcome) has not run.
        #[cfg(feature = "failpoints")]
        fail::fail_point!("recovery-after-ready");
        let agent = match run.agent {
            SurvivingAgent::Idle | SurvivingAgent::Busy => AgentProcessState::Running,
            SurvivingAgent::None => AgentProcessState::NotRunning,
        };
        let probe = run.probe;
        self.cache_update(run.session.id, |e| {
            e.agent = agent;
            e.probe = probe;
        });
        self.inner.workspaces_ready.mark(run.session.id);
        Ok(())
    }

    /// Persists the outcome with its events; syncs the cache; starts the
    /// update pump or the background reconnect.
    ///
    /// A session that was RUNNING a turn (`turn_id` stored) and whose agent
    /// is back stays RUNNING, with no event, whatever the machine's outcome
    /// says (WAITING_FOR_INPUT for an idle agent): its update pump first
    /// stores what agentctl buffered while the backend was down, and the
    /// turn's `TurnEnded` (or the pump settling the turn, which re-delivers
    /// a prompt that never reached the agent) moves it on. So the next user
    /// message can never be stored before the reply to this one.
    async fn finish(&self, mut run: Run, mut outcome: RecoveryOutcome, attempt: u32) -> Result<()> {
        let sid = run.session.id;
        let agent_back = outcome.label.agent_back();
        let mut unrecorded = run
            .unrecorded_turn
            .take()
            .filter(|_| agent_back && run.session.state == SessionState::WaitingForInput);
        if let Some((turn, _)) = &unrecorded {
            // `last_turn` is only the newest turn this version started; a
            // turn stored otherwise (re-delivered, an older version) is
            // found by its message.
            let stored = match uuid::Uuid::try_parse(turn) {
                Ok(id) => self
                    .inner
                    .store
                    .get_message(sid, MessageId::from_uuid(id))
                    .await?
                    .is_some(),
                Err(_) => true, // not a turn sessiond started
            };
            if stored {
                unrecorded = None;
            }
        }
        let runs_unrecorded = unrecorded.is_some();
        if let Some((turn, instance)) = unrecorded {
            // agentctl has a turn the store never recorded (the backend died
            // between its Prompt and its commit): the session is RUNNING it
            // from here, so no message is sent before it, and the pump
            // records its user message from agentctl's stream and settles it
            // as any pending turn.
            tracing::warn!(session = %sid, %turn,
                "recovery: agentctl has a turn the store never recorded; the session runs it");
            let m = &mut run.session.metadata;
            m.insert(crate::turn::TURN_KEY.into(), turn);
            m.insert(
                crate::turn::TURN_GENERATION_KEY.into(),
                outcome.generation.to_string(),
            );
            m.insert(crate::turn::TURN_INSTANCE_KEY.into(), instance);
            m.remove(crate::turn::INTERRUPTED_TURN_KEY);
        }
        let turn = turn_in_flight(&run.session);
        // Settling from here until the pump started below counts itself.
        let _settling =
            (agent_back && turn.is_some()).then(|| crate::turn::SettlingHold::new(self, sid));
        if agent_back && turn.is_some() {
            outcome.session_state = SessionState::Running;
            outcome.session_error = None;
            outcome
                .events
                .retain(|e| !matches!(e, EventPayload::StateChanged { .. }));
            if run.session.state != SessionState::Running {
                // A resume of the RUNNING session died after its intent
                // (STARTING): RUNNING again, so the pump settles the turn.
                outcome.events.push(EventPayload::StateChanged {
                    from: run.session.state,
                    to: SessionState::Running,
                    error_message: None,
                });
            }
        }
        if runs_unrecorded {
            outcome.session_state = SessionState::Running;
            outcome.session_error = None;
            outcome
                .events
                .retain(|e| !matches!(e, EventPayload::StateChanged { .. }));
            outcome.events.push(EventPayload::StateChanged {
                from: run.session.state,
                to: SessionState::Running,
                error_message: None,
            });
        }
        // The run's record becomes the outcome's (no copy: the run ends here).
        let (status_was, generation_was) = (run.record.status, run.record.generation);
        let mut record = run.record;
        move_executor(
            &mut record,
            ExecutorEvent::reaching(outcome.executor_status),
        )?;
        let error_message = outcome.executor_error.as_ref().map(|f| f.message());
        let record_changed = run.seen_unsaved
            || run.adopted_token
            || record.status != status_was
            || error_message != record.error_message
            || outcome.generation != generation_was;
        record.error_message = error_message;
        record.generation = outcome.generation;
        let mut change = Changeset::new();
        // The session leaves RUNNING without its agent back (executor
        // failed, the host's reconnect window closed, the agent's resume
        // failed, ...): no pump will ever settle its pending turn, so it
        // ends interrupted here, in the same commit as the state change (a
        // crash leaves either both or neither).
        let mut settled = None;
        if !agent_back
            && outcome.session_state == SessionState::Error
            && let Some(turn) = turn
        {
            let mut next = run.session.clone();
            let why = match (&outcome.session_error, &outcome.executor_error) {
                (Some(f), _) | (None, Some(f)) => f.message(),
                (None, None) => format!("recovery ended {}", outcome.label),
            };
            change =
                crate::turn::interrupt_turn(self, &run.session, &turn, &why, change, &mut next)
                    .await?;
            settled = Some((turn, next.metadata));
        }
        // What the commit writes moves into it (and comes back in
        // `committed`); what it does not write is kept here.
        let kept_record = if record_changed {
            change = change.update_executor(record);
            None
        } else {
            Some(record)
        };
        let was = run.session.state;
        let task = run.session.task_id;
        let mut kept_session = None;
        if outcome.session_state != was || run.adopted_token || settled.is_some() {
            let mut session = run.session;
            session.state = outcome.session_state;
            session.error_message = outcome.session_error.as_ref().map(|f| f.message());
            if let Some((_, metadata)) = &mut settled {
                session.metadata = std::mem::take(metadata);
            }
            change = change.update_session(session);
        } else {
            kept_session = Some(run.session);
        }
        if let Some(event) = run.replaced.take().filter(|_| agent_back) {
            change = change.event(sid, event);
        }
        for event in outcome.events.iter().cloned() {
            change = change.event(sid, event);
        }
        // Only a recovery that itself brings the session to input (a start or
        // a turn it ended, an error resumed) has work to hand over for
        // review; a session that was waiting already leaves its task as the
        // user or its last turn left it, so a restart changes nothing there.
        if agent_back
            && outcome.session_state != SessionState::Running
            && outcome.session_state != was
        {
            change = change.task_event(task, TaskEvent::ReadyForReview);
        }
        let committed = match &run.outcomes {
            Some(outcomes) => batch::commit(outcomes, self, change).await?,
            None => self.commit(change).await?,
        };
        // A record the commit wrote is in the cache already (`after_commit`).
        let cached = kept_record.is_none();
        let record = committed
            .executor
            .or(kept_record)
            .ok_or_else(|| Error::Internal("the outcome's commit returned no executor".into()))?;
        tracing::debug!(session = %sid, executor_id = %record.id, label = %outcome.label,
            started_as = %run.started_as, "executor recovered");
        if let Some((turn, _)) = &settled {
            self.inner
                .metrics
                .turn_ended(sid, crate::metrics::TurnOutcome::Interrupted);
            tracing::warn!(session = %sid, %turn, label = %outcome.label,
                "pending turn ended interrupted: the session left RUNNING without its agent");
        }

        if outcome.executor_status == ExecutorStatus::Error {
            // Nothing of ours may keep running for an executor in error
            // (e.g. a live agentctl whose worktree was deleted).
            Agents(self).end_stray_agentctls(&record).await;
        }
        match outcome.executor_status {
            ExecutorStatus::Stopped => self.inner.sessions.remove_execution(sid),
            _ => {
                if !cached {
                    self.inner.sessions.cache_record(&record);
                }
                if agent_back {
                    self.cache_update(sid, |e| e.agent = AgentProcessState::Running);
                } else if outcome.label != OutcomeLabel::ExecutorOnly {
                    self.cache_update(sid, |e| e.agent = AgentProcessState::NotRunning);
                }
            }
        }
        let back = agent_back_or_left_alone(outcome.label);
        let reason = outcome
            .session_error
            .as_ref()
            .or(outcome.executor_error.as_ref());
        self.inner.metrics.recovery_outcome(
            outcome.label.as_str(),
            reason.filter(|_| !back).map(|f| f.code()),
        );
        match reason {
            Some(RecoveryFailure::Recovering { reason, .. }) if outcome.retry_in_background => {
                tracing::warn!(session = %sid, executor_id = %record.id, attempt,
                    max_attempts = self.inner.config.max_attempts, %reason,
                    "recovery: the session is not back yet; retrying in the background");
                self.spawn_retry(record.clone(), attempt, reason.clone());
            }
            _ if outcome.retry_in_background => {
                tracing::warn!(session = %sid, executor_id = %record.id,
                    reason = %outcome.error_message().unwrap_or_default(),
                    "recovery: the executor is unreachable; retrying in the background");
                self.inner.agent_recoveries.clear(sid);
                self.spawn_reconnect(record.clone());
            }
            _ => {
                if !back {
                    tracing::warn!(session = %sid, executor_id = %record.id,
                        label = %outcome.label,
                        reason = %outcome.error_message().unwrap_or_default(),
                        "recovery: the session's agent is not back");
                }
                self.inner.agent_recoveries.clear(sid);
            }
        }
        if agent_back || (outcome.workspace_enabled && run.agent != SurvivingAgent::None) {
            let Some(session) = committed.session.filter(|s| s.id == sid).or(kept_session) else {
                return Err(Error::Internal(
                    "the outcome's commit returned no session".into(),
                ));
            };
            if run.agent == SurvivingAgent::Busy {
                Turns(self).start_pump(&session, &record);
            } else {
                Turns(self).attach_updates(&session, &record);
            }
            // Messages queued behind a turn that ended just before the
            // backend died (its end committed, the delivery not yet made):
            // nothing else kicks an idle session's queue after a restart.
            if agent_back
                && session.state == SessionState::WaitingForInput
                && !sessiond_domain::queue::is_empty(&session.metadata)
            {
                crate::flows::QueuedMessages::kick_queue(self.0, sid);
            }
        }
        Ok(())
    }

    /// How long an agent's launch and resume may stay silent before an
    /// attempt is cut: `executor_deadline` at the first attempt of a
    /// recovery, doubling with each attempt after it, up to what a create
    /// allows the same agent (`agent_initialize_timeout`); that much at
    /// once for an explicit resume (`explicit`), which a user waits on and
    /// does not retry by itself. An agent that starts silently for longer
    /// than the first limit (blocked on the network while it starts) comes
    /// back at a later attempt instead of never.
    pub(crate) fn agent_silence(&self, explicit: bool, attempt: u32) -> Duration {
        let config = &self.inner.config;
        let most = config
            .executor_deadline
            .max(config.agent_initialize_timeout);
        if explicit {
            return most;
        }
        let doublings = attempt.saturating_sub(1).min(16);
        config
            .executor_deadline
            .saturating_mul(1 << doublings)
            .min(most)
    }

    /// Runs `work` (an agent's launch and resume) while watching agentctl's
    /// `Health` of `record` for the agent's signs of life: a line written,
    /// CPU used, history replayed, its state moving. `Err(why)` when none
    /// showed (or agentctl did not answer) for `silence` (see
    /// [`Self::agent_silence`]), or the attempt's cap (`resume_cap`)
    /// passed; `work` is dropped then.
    pub(crate) async fn until_silent<T>(
        &self,
        record: &ExecutorRecord,
        silence: Duration,
        work: impl std::future::Future<Output = T>,
    ) -> std::result::Result<T, String> {
        /// CPU time that counts as a sign of life since the last one, in
        /// a silence limit of `executor_deadline`: more than an idle
        /// runtime's timers use in it.
        const CPU_SIGN_MS: u64 = 50;
        // A longer limit (a later attempt) takes proportionally more: the
        // same idle timers add up over it, and would read as life for ever.
        let deadline_ms = self.inner.config.executor_deadline.as_millis().max(1);
        let cpu_sign_ms =
            u64::try_from(u128::from(CPU_SIGN_MS) * silence.as_millis() / deadline_ms)
                .unwrap_or(u64::MAX)
                .max(CPU_SIGN_MS);
        let cap = self.inner.config.resume_cap;
        let poll = (silence / 5).clamp(Duration::from_millis(100), Duration::from_secs(2));
        let sid = record.session_id;
        let client = Agents(self).client(record).ok();
        tokio::pin!(work);
        let began = Instant::now();
        let mut last_sign = None;
        let mut cpu_mark = 0u64;
        let mut wait_mark = 0u64;
        let mut last_progress = Instant::now();
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + poll, poll);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                done = &mut work => return Ok(done),
                _ = ticker.tick() => {}
            }
            let health = match &client {
                Some(c) => tokio::time::timeout(poll.max(Duration::from_secs(1)), c.health())
                    .await
                    .ok()
                    .and_then(|h| h.ok()),
                None => None,
            };
            if let Some(h) = health {
                let p = h.progress;
                let sign = (p.activity, p.replayed, p.resuming, h.agent_state as i32);
                // Waiting for a CPU is a sign of life too: a crowded host's
                // agent is not hung.
                let waited = p.cpu_wait_ms.unwrap_or(0);
                if last_sign != Some(sign)
                    || p.cpu_ms >= cpu_mark.saturating_add(cpu_sign_ms)
                    || waited >= wait_mark.saturating_add(cpu_sign_ms)
                {
                    last_sign = Some(sign);
                    cpu_mark = p.cpu_ms;
                    wait_mark = waited;
                    last_progress = Instant::now();
                }
                if let Some(w) = p.cpu_wait_ms {
                    self.inner.agent_recoveries.saw_cpu_wait(
                        sid,
                        crate::launches::CpuWait {
                            waited: Duration::from_millis(w),
                            over: began.elapsed(),
                        },
                    );
                }
                let stage = if p.resuming {
                    RecoveryStage::Resuming
                } else {
                    RecoveryStage::Launching
                };
                self.inner.agent_recoveries.enter(sid, stage);
                self.inner.agent_recoveries.replayed(sid, p.replayed);
            }
            let quiet = last_progress.elapsed();
            if quiet >= silence {
                return Err(format!(
                    "no sign of life from the agent for {} ms (agentctl's Health showed no line \
                     written, no CPU used, nothing replayed)",
                    quiet.as_millis()
                ));
            }
            if began.elapsed() >= cap {
                return Err(format!(
                    "the agent was not up after {} s, the cap of one attempt",
                    cap.as_secs()
                ));
            }
        }
    }

    /// Runs the next attempt of an executor's recovery after a delay
    /// (backoff with jitter), once attempt `attempt` broke off for `reason`:
    /// the session shows it (`recovering`, waiting to retry) meanwhile. Does
    /// nothing when the executor moved on in between (an explicit resume, a
    /// stop) or another replica holds it now.
    pub(crate) fn spawn_retry(&self, record: ExecutorRecord, attempt: u32, reason: String) {
        let session = record.session_id;
        if !self.inner.sessions.start_retrying(session) {
            return;
        }
        let delay = self
            .inner
            .config
            .retry_backoff
            .delay(attempt.saturating_sub(1));
        self.inner
            .agent_recoveries
            .retry_after(session, attempt, reason, delay);
        let me = self.0.clone();
        self.spawn_background(async move {
            tokio::time::sleep(delay).await;
            me.inner.sessions.stop_retrying(session);
            let current = match me.inner.store.get_executor(record.id).await {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(%session, error = %e, "retry: cannot read the executor");
                    me.inner.agent_recoveries.clear(session);
                    return;
                }
            };
            let still_ours = Fencing(&me).owns(session)
                && current.generation == record.generation
                && current
                    .error_message
                    .as_deref()
                    .is_some_and(|m| m.starts_with(RECOVERING));
            if !still_ours {
                me.inner.agent_recoveries.clear(session);
                return;
            }
            match Pass(&me).recover_shared((&current).into()).await {
                Ok(label) => {
                    tracing::info!(%session, %label, attempt = attempt + 1, "retry: recovery ran");
                }
                Err(e) => {
                    me.inner.agent_recoveries.clear(session);
                    tracing::warn!(%session, error = %e, "retry: recovery failed");
                }
            }
        });
    }

    /// Runs the restart `restarts::after_agent_exit` decided, once its
    /// commit is in (`committed`; a commit that failed decided nothing):
    /// the session's recovery, in the background, after a delay that grows
    /// with the restarts of the window (none for the first).
    pub(crate) fn spawn_agent_restart(
        &self,
        session: SessionId,
        decision: AfterExit,
        committed: bool,
    ) {
        let AfterExit::Restart(n) = decision else {
            return;
        };
        if !committed {
            self.inner.agent_restarts.finished(session);
            return;
        }
        // Test-only crash point: the restart's intent (the session
        // STARTING) is committed, the restart has not run.
        #[cfg(feature = "failpoints")]
        fail::fail_point!("agent-restart-after-intent");
        self.inner.metrics.agent_restarted();
        let delay = match n {
            0 | 1 => Duration::ZERO,
            n => self.inner.config.retry_backoff.delay(n - 2),
        };
        if !delay.is_zero() {
            // The status says so meanwhile (`recovering`, waiting to retry),
            // and a message or a retry waits for it.
            self.inner.agent_recoveries.retry_after(
                session,
                0,
                format!(
                    "the agent exited; restart {n} of {}",
                    self.inner.config.agent_restarts
                ),
                delay,
            );
        }
        let me = self.0.clone();
        self.spawn_background(async move {
            tokio::time::sleep(delay).await;
            let outcome = ExecutorRecovery(&me).recover_announced(session).await;
            me.inner.agent_restarts.finished(session);
            match outcome {
                Ok(Some(label)) => {
                    tracing::info!(%session, %label, restart = n, "agent restart: recovery ran");
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(%session, error = %e, "agent restart: recovery failed");
                }
            }
        });
    }

    /// The recovery of `session` that a background task announced in
    /// `agent_recoveries`: run now, unless another replica holds the
    /// session or it has no executor (`None`); the announcement is taken
    /// back unless it ran (a recovery that ran clears it itself).
    async fn recover_announced(&self, session: SessionId) -> Result<Option<OutcomeLabel>> {
        let outcome = async {
            if !Fencing(self).owns(session) {
                return Ok(None); // another replica holds it now
            }
            let Some(record) = self.inner.store.get_executor_for_session(session).await? else {
                return Ok(None);
            };
            Pass(self).recover_shared((&record).into()).await.map(Some)
        }
        .await;
        if !matches!(outcome, Ok(Some(_))) {
            self.inner.agent_recoveries.clear(session);
        }
        outcome
    }

    /// Recovers `session` in the background at once: its agentctl answers
    /// but runs no agent (a restarted remote agentctl a parked session did
    /// not notice). Announced first, so a message or a retry meanwhile
    /// waits for it and the status says `recovering`.
    pub(crate) fn spawn_agent_relaunch(&self, session: SessionId, reason: String) {
        self.inner
            .agent_recoveries
            .retry_after(session, 0, reason, Duration::ZERO);
        let me = self.0.clone();
        self.spawn_background(async move { ExecutorRecovery(&me).run_relaunch(session).await });
    }

    /// [`Self::spawn_agent_relaunch`] on the caller's task, waited for.
    pub(crate) async fn relaunch_now(&self, session: SessionId, reason: String) {
        self.inner
            .agent_recoveries
            .retry_after(session, 0, reason, Duration::ZERO);
        self.run_relaunch(session).await
    }

    /// See `flows::RecoverFirst::recover_once_store_answers`. A session
    /// that was never stored (the outage came first) is left alone.
    pub(crate) fn recover_once_store_answers(&self, session: SessionId, reason: String) {
        let me = self.0.clone();
        self.spawn_background(async move {
            let mut pause = Duration::from_millis(500);
            loop {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(10));
                match me.inner.store.get_session(session).await {
                    Ok(_) => break,
                    Err(e) if e.is_unavailable() => {}
                    Err(_) => return,
                }
            }
            tracing::info!(%session, %reason, "the database answers again; recovering the session");
            ExecutorRecovery(&me).relaunch_now(session, reason).await;
        });
    }

    /// The announced relaunch's recovery; one that could not run is logged
    /// (its retries, if any, are scheduled already).
    async fn run_relaunch(&self, session: SessionId) {
        match self.recover_announced(session).await {
            Ok(Some(label)) => {
                tracing::info!(%session, %label, "agent relaunch: recovery ran");
            }
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(%session, error = %e, "agent relaunch: recovery failed");
            }
        }
    }

    /// Keeps trying an unreachable remote host in the background, with
    /// backoff, while its window is open; runs recovery again when it answers
    /// (or once more when the window closes, which marks it failed). A
    /// Docker executor whose engine was down is retried the same way until
    /// the engine answers, with no window.
    pub(crate) fn spawn_reconnect(&self, record: ExecutorRecord) {
        let session = record.session_id;
        if !self.inner.sessions.start_retrying(session) {
            return;
        }
        let me = self.0.clone();
        self.spawn_background(async move {
            let backoff = me.inner.config.remote_backoff;
            let window = me.inner.config.remote_retry_window;
            let mut attempt = 0u32;
            loop {
                tokio::time::sleep(backoff.delay(attempt)).await;
                attempt = attempt.saturating_add(1);
                if !Fencing(&me).owns(session) {
                    break; // another replica holds it now
                }
                let current = match me.inner.store.get_executor(record.id).await {
                    Ok(r) => r,
                    Err(e) if e.is_not_found() => break,
                    Err(e) => {
                        tracing::warn!(%session, error = %e, "reconnect: cannot read executor");
                        continue;
                    }
                };
                if current.status != ExecutorStatus::Error {
                    break; // someone else (an explicit resume) brought it back
                }
                let docker = current.runtime == Runtime::LocalDocker;
                let open =
                    docker || window_open(&current, window, Utc::now(), me.inner.started_at);
                let handle = ExecutorHandle::from_record(&current);
                let answers = match Agents(&me).driver(current.runtime) {
                    // Any answer of the engine about the container will do:
                    // recovery then starts it, or fails it as missing.
                    Ok(d) if docker => matches!(
                        d.probe(&handle).await,
                        Ok(_) | Err(sessiond_executor::Error::ContainerMissing { .. })
                    ),
                    Ok(d) => match d.health(&handle).await {
                        Ok(_) => true,
                        Err(e) => {
                            ExecutorRecovery(&me).note_reconnect_failure(&current, &e).await;
                            false
                        }
                    },
                    Err(_) => false,
                };
                me.inner.metrics.reconnect_attempt(answers);
                if !answers && open {
                    tracing::debug!(%session, attempt, "executor still unreachable");
                    continue;
                }
                me.inner.sessions.stop_retrying(session);
                // A `retrying` outcome starts a fresh reconnect loop itself.
                match Pass(&me).recover_shared((&current).into()).await {
                    Ok(label) => {
                        tracing::info!(%session, %label, attempts = attempt, "background reconnect: recovery ran");
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(%session, error = %e, "reconnect: recovery failed");
                        return;
                    }
                }
            }
            me.inner.sessions.stop_retrying(session);
        });
    }
}

impl ExecutorRecovery<'_> {
    /// A reconnect attempt failed: the executor's message says why now
    /// (written only when the reason changed). A host that came back with
    /// a rotated secret, or as another executor, said "Connection refused"
    /// from its first failure for as long as the window stayed open.
    async fn note_reconnect_failure(&self, current: &ExecutorRecord, e: &sessiond_executor::Error) {
        let message = RecoveryFailure::Reconnecting {
            url: current.agentctl_url.clone().unwrap_or_default(),
            reason: e.to_string(),
        }
        .message();
        if current.error_message.as_deref() == Some(message.as_str()) {
            return;
        }
        let mut next = current.clone();
        next.error_message = Some(message.clone());
        let change = Changeset::new().update_executor(next).event(
            current.session_id,
            EventPayload::AgentctlError {
                executor_id: current.id,
                error_message: message,
            },
        );
        // Optimistic (the version read): a recovery that moved it wins.
        if let Err(e) = self.commit(change).await {
            tracing::debug!(session = %current.session_id, error = %e, "reconnect: could not record why");
        }
    }
}

/// The executor stopped through its driver within `limit`, as the step
/// machine observes it; `what` names the step in the timeout's reason.
async fn stopped_within(
    driver: &Arc<dyn sessiond_executor::Executor>,
    handle: &ExecutorHandle,
    limit: Duration,
    what: &str,
) -> Observation {
    match tokio::time::timeout(limit, driver.stop(handle)).await {
        Ok(Ok(())) => Observation::ExecutorStopped,
        Ok(Err(e)) => Observation::ActionFailed {
            reason: e.to_string(),
        },
        Err(_) => Observation::ActionFailed {
            reason: format!("{what} did not finish in time"),
        },
    }
}
