//! Liveness: every `liveness_interval`, each ready executor's agentctl is
//! asked for its `Health`; a healthy one gets `last_seen_at` refreshed, one
//! that stops answering is lost (its session goes ERROR, or a remote host is
//! reconnected in the background). The doorbell (`doorbell.rs`) asks one
//! executor at once when its agent exits; a watch of this host's agentctl
//! processes asks one at once when it dies while its session is idle.

use chrono::Utc;
use futures::StreamExt;
use sessiond_domain::{
    AgentProcessState, ExecutorId, ExecutorRecord, ExecutorStatus, Runtime, SessionState,
};
use sessiond_executor::{AgentState, ExecutorHandle, Health};
use sessiond_store::{Changeset, Heartbeat};

use crate::error::{Error, Result};
use crate::flows::TurnInFlight;
use crate::lease::Fencing;
use crate::ops::Agents;
use crate::recovery::ExecutorRecovery;
use crate::restarts::{AfterExit, after_agent_exit, exit_how};

/// How many executors the liveness check asks at once.
const LIVENESS_CONCURRENCY: usize = 16;

/// How often the agentctl processes of this host's idle sessions are
/// looked at (`/proc`): a dead one is checked at once instead of at the
/// next liveness round.
const PID_WATCH_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// The periodic liveness check of ready executors, and the check of one.
pub(crate) struct Liveness<'m>(pub(crate) &'m crate::manager::SessionManager);

impl std::ops::Deref for Liveness<'_> {
    type Target = crate::manager::SessionManager;

    fn deref(&self) -> &Self::Target {
        self.0
    }
}

impl Liveness<'_> {
    /// Starts the periodic liveness check of ready executors (every
    /// `liveness_interval`, if set): a healthy one gets `last_seen_at`
    /// updated (no event); one that stops answering goes `error` with a
    /// `session.agentctl_error` event, and a live session goes ERROR.
    /// `recover_all` calls it once recovery is done; calling it again is a
    /// no-op.
    pub(crate) fn start_liveness_checks(&self) {
        let Some(every) = self.inner.config.liveness_interval else {
            return;
        };
        if self
            .inner
            .liveness_started
            .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            return;
        }
        self.watch_local_agentctls();
        let me = self.0.clone();
        self.spawn_background(async move {
            loop {
                tokio::time::sleep(every).await;
                let ready: Vec<(ExecutorRecord, bool)> = me.inner.sessions.executions(|e| {
                    (e.record.status == ExecutorStatus::Ready)
                        .then(|| (e.record.clone(), e.agent == AgentProcessState::Running))
                });
                let seen: Vec<Heartbeat> = futures::stream::iter(ready)
                    .map(|(record, agent_running)| {
                        let me = me.clone();
                        async move {
                            let session = record.session_id;
                            let seen = Liveness(&me).check_liveness(record, agent_running)
                                .await
                                .unwrap_or_else(|e| {
                                    tracing::debug!(error = %e, "liveness check could not be recorded");
                                    None
                                })?;
                            // Fenced like every other write of the owner: a
                            // replica resumed after a pause does not mark
                            // seen what another one adopted meanwhile.
                            Some(Heartbeat {
                                executor: seen.0,
                                generation: seen.1,
                                fence: Fencing(&me).fence(session),
                            })
                        }
                    })
                    .buffer_unordered(LIVENESS_CONCURRENCY)
                    .filter_map(futures::future::ready)
                    .collect()
                    .await;
                // The healthy ones' heartbeats, a few transactions for the
                // whole round instead of one commit per executor.
                for chunk in seen.chunks(500) {
                    match me.inner.store.touch_executors(chunk.to_vec(), Utc::now()).await {
                        Ok(touched) => {
                            for (fence, e) in touched.lost {
                                Fencing(&me).lease_lost(fence.session, fence.epoch, "store", &e.to_string());
                            }
                        }
                        Err(e) => {
                            tracing::debug!(error = %e, "liveness heartbeats could not be recorded");
                        }
                    }
                }
            }
        });
    }

    /// An idle session's local agentctl that dies says nothing: no update
    /// stream is open to break (a session with a pump finds out from its
    /// stream), and its agent, which would ring the doorbell, dies with it.
    /// Every [`PID_WATCH_EVERY`], the recorded agentctl process (pid and
    /// start time) of each ready standalone executor without a pump is
    /// looked up in `/proc`; one that is gone is checked at once
    /// ([`Liveness::check_liveness`]: agentctl lost, recovered in the
    /// background), so the status does not say `ready` for up to a whole
    /// liveness interval.
    fn watch_local_agentctls(&self) {
        let me = self.0.clone();
        self.spawn_background(async move {
            loop {
                tokio::time::sleep(PID_WATCH_EVERY).await;
                let gone: Vec<(ExecutorRecord, bool)> = me.inner.sessions.executions(|e| {
                    let r = &e.record;
                    let dead = r.status == ExecutorStatus::Ready
                        && crate::ops::local_agentctl_gone(r).is_some();
                    dead.then(|| (r.clone(), e.agent == AgentProcessState::Running))
                });
                for (record, agent_running) in gone {
                    if me.inner.sessions.has_pump(record.session_id) {
                        continue; // its update stream reports the loss
                    }
                    tracing::info!(session = %record.session_id, executor = %record.id,
                        pid = ?record.pid, "an idle session's agentctl process is gone; checking it now");
                    if let Err(e) = Liveness(&me).check_liveness(record, agent_running).await {
                        tracing::debug!(error = %e, "agentctl check could not be recorded");
                    }
                }
            }
        });
    }

    /// `Health` of the record's agentctl, identity checked, with the agent's
    /// exit. Uses the session's cached client when one is open (a pump runs),
    /// else a client of its own that is dropped afterwards, so a parked
    /// session keeps no connection between checks.
    async fn liveness_health(&self, record: &ExecutorRecord) -> Result<Health> {
        // The answer carries the agent's modes: kept, so a change the agent
        // made while no pump read shows within one check.
        let (_, modes_stamp) = self.inner.sessions.cached_modes(record.session_id, "");
        let client = match Agents(self).cached_agentctl(record) {
            Some(c) => c,
            None => Agents(self)
                .driver(record.runtime)?
                .client(&ExecutorHandle::from_record(record))?,
        };
        let h = client
            .health()
            .await
            .map_err(|e| Error::agent("Health", &e))?;
        if h.executor_id != record.id.to_string() {
            return Err(Error::Unavailable(format!(
                "the agentctl at {} is executor {:?}, not {}",
                client.url(),
                h.executor_id,
                record.id
            )));
        }
        if matches!(h.agent_state, AgentState::Ready | AgentState::Busy) {
            self.inner.sessions.remember_modes(
                record.session_id,
                record.execution_id(),
                modes_stamp,
                h.modes.as_ref().map(crate::ops::agent_modes),
            );
        }
        Ok(h)
    }

    /// One liveness check. agentctl answering refreshes `last_seen_at`
    /// (returned as a heartbeat for the round's batched write when nothing
    /// else is to be done); not answering puts the executor in `error` (and a
    /// live session in ERROR). agentctl answering that its agent exited (or
    /// that it has none) while the cache knew the agent running and no
    /// update pump runs (a parked, idle session: no stream would report the
    /// exit) is what the pump's `AgentExited` handling does: the session goes
    /// ERROR with what happened and what to do, and the agent counts as not
    /// running.
    pub(crate) async fn check_liveness(
        &self,
        record: ExecutorRecord,
        agent_running: bool,
    ) -> Result<Option<(ExecutorId, i64)>> {
        let limit = self.inner.config.executor_deadline;
        let health = tokio::time::timeout(limit, self.liveness_health(&record)).await;
        let gone = |h: &Health| matches!(h.agent_state, AgentState::Exited | AgentState::None);
        // The common case: it answered and its agent is as the cache knows
        // it. The heartbeat's write checks status and generation itself.
        if let Ok(Ok(h)) = &health
            && !(agent_running && gone(h))
        {
            return Ok(Some((record.id, record.generation)));
        }
        let _guard = self.inner.sessions.lock(record.session_id).await;
        let current = self.inner.store.get_executor(record.id).await?;
        if current.status != ExecutorStatus::Ready || current.generation != record.generation {
            return Ok(None);
        }
        let failure = match &health {
            Ok(Ok(_)) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(_) => Some("Health did not answer in time".to_owned()),
        };
        let mut next = current.clone();
        let Some(reason) = failure else {
            next.last_seen_at = Some(Utc::now());
            let mut change = Changeset::new().update_executor(next);
            let mut exited = None;
            if agent_running
                && health.as_ref().is_ok_and(|h| h.as_ref().is_ok_and(gone))
                && !self.inner.sessions.has_pump(record.session_id)
                && self
                    .execution(record.session_id)
                    .is_some_and(|e| e.agent == AgentProcessState::Running)
            {
                // Confirmed under the lock (nothing can launch an agent meanwhile).
                if let Ok(Ok(h)) = tokio::time::timeout(limit, self.liveness_health(&record)).await
                    && gone(&h)
                {
                    exited = Some(h.agent_exit.unwrap_or_default());
                }
            }
            let mut restart = AfterExit::Error { exhausted: false };
            if let Some(exit) = &exited {
                let session = self.inner.store.get_session(record.session_id).await?;
                if !self.exit_belongs_to_recovery(&session)
                    && matches!(
                        session.state,
                        SessionState::Starting
                            | SessionState::Running
                            | SessionState::WaitingForInput
                    )
                {
                    self.inner
                        .metrics
                        .agent_exited(crate::metrics::ExitCause::of(exit.code, exit.signal));
                    let what = format!("the agent process exited ({})", exit_how(Some(exit)));
                    let (mut s, events, decided) = after_agent_exit(
                        &self.inner.config,
                        &self.inner.agent_restarts,
                        &session,
                        &what,
                    )?;
                    restart = decided;
                    // Counted here: its `AgentExited` update, read later by
                    // a pump, is not counted again.
                    self.inner.agent_restarts.exit_counted(session.id);
                    s.metadata.remove(crate::turn::TURN_KEY);
                    change = change.update_session(s);
                    for ev in events {
                        change = change.event(record.session_id, ev);
                    }
                }
                tracing::info!(session = %record.session_id, "liveness: the idle session's agent exited");
            }
            let committed = self.commit(change).await;
            // Before the restart starts: its recovery announces itself at
            // once, and a status read meanwhile must not pair it with a
            // running agent.
            if committed.is_ok() && exited.is_some() {
                self.cache_update(record.session_id, |e| {
                    e.agent = AgentProcessState::NotRunning
                });
            }
            ExecutorRecovery(self).spawn_agent_restart(
                record.session_id,
                restart,
                committed.is_ok(),
            );
            committed?;
            return Ok(None);
        };
        if record.runtime == Runtime::Remote {
            self.commit(crate::changes::remote_lost(&current, &reason)?)
                .await?;
            self.inner.sessions.stop_pump(record.session_id);
            self.cache_update(record.session_id, |e| {
                e.agent = AgentProcessState::NotRunning
            });
            ExecutorRecovery(self).spawn_reconnect(current);
            return Ok(None);
        }
        // A turn in flight ends interrupted only when agentctl's process is
        // known gone; one that may still run (hung, paused) keeps it pending
        // for the recovery to settle, as the pump does (decision 0007).
        let turn = if crate::ops::local_agentctl_gone(&current).is_some() {
            TurnInFlight::Interrupt
        } else {
            TurnInFlight::Settle
        };
        let (change, retry) = ExecutorRecovery(self)
            .agentctl_lost_change(&current, &reason, turn)
            .await?;
        let committed = self.commit(change).await?;
        self.inner.sessions.stop_pump(record.session_id);
        self.cache_update(record.session_id, |e| {
            e.agent = AgentProcessState::NotRunning
        });
        // A test's hold between the commit and the recovery's start.
        let gate = crate::sync::lock(&self.inner.lost_agentctl_gate).clone();
        if let Some(gate) = gate {
            gate().await;
        }
        if let Some(failed) = retry {
            ExecutorRecovery(self).spawn_retry(committed.executor.unwrap_or(failed), 0, reason);
        }
        Ok(None)
    }
}
