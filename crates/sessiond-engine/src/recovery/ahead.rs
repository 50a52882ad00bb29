//! One round trip per executor: the health check as agentctl's `Recover`.
//!
//! The step machine still decides every step; what changes is how many
//! exchanges its steps cost. Before the health check the machine is asked
//! what it would do if agentctl answered "healthy, no agent"
//! ([`sessiond_domain::Recovery::resume_after_health`]); when that is a
//! resume and a launch slot of the host is free now, the `Recover` call
//! carries the launch and the token, and agentctl does them only if no
//! agent is there. The capabilities it answers serve the probe step, and
//! the agent part serves the resume step, so the machine sees the same
//! observations in the same order as with one call per step. Whatever the
//! engine commits before an agent's launch it has committed before the
//! health check already (a relaunched agentctl's intent); marking the
//! executor ready writes nothing for an executor recorded `ready` (the
//! outcome carries it), and is the same step otherwise. An agentctl
//! without `Recover` (UNIMPLEMENTED) gets the calls one by one.

use std::{sync::Arc, time::Duration, time::Instant};

use sessiond_domain::{AgentProcessState, RecoveryStage, SurvivingAgent};
use sessiond_executor::{Capabilities, Executor, Health};
use sessiond_proto::agentctl::v1 as pb;

use super::ExecutorRecovery;
use super::Run;
use crate::{
    error::{Error, Result},
    launches::{Ended, LaunchPermit, host_of},
    ops::Agents,
    ops::{Resumed, load_refused, surviving_agent},
};

/// What a `Recover` brought beyond the health, for the steps after it.
#[derive(Default)]
pub(super) struct Ahead {
    /// This agentctl does not know `Recover`: one call per step.
    pub(super) unsupported: bool,
    /// The conversation the machine resumes after a "no agent" health
    /// check (asked just before the check).
    pub(super) intent: Option<String>,
    /// `Capabilities` as the health check saw them, for the probe step.
    pub(super) caps: Option<Capabilities>,
    /// The agent part, for the resume step.
    pub(super) agent: Option<AgentAhead>,
}

/// An agent part that was asked for.
pub(super) struct AgentAhead {
    token: String,
    answer: Answer,
    permit: Option<LaunchPermit>,
    began: Instant,
}

/// What became of an agent part.
enum Answer {
    /// agentctl's answer.
    Given(Box<pb::RecoverAgent>),
    /// No sign of life for the silence limit while agentctl launched the
    /// agent or reopened the conversation (agentctl itself answers).
    Cut(String),
    /// Still running: the agent takes its time, and the health check
    /// answered on its own so that the workspace is not held up by it.
    Pending(tokio::task::JoinHandle<Launched>),
}

/// A `Recover` that carries a launch, as watched for signs of life.
type Launched =
    std::result::Result<sessiond_executor::Result<sessiond_executor::RecoverAnswer>, String>;

/// How long a health check that carries an agent's launch waits for the
/// whole `Recover` before it asks agentctl's health alone: a quick agent
/// (most relaunches) costs one round trip; a slow one (Claude Code loading
/// a long history takes seconds) gives the workspace back after this.
const WORKSPACE_FIRST: Duration = Duration::from_millis(500);

impl AgentAhead {
    /// It did (or tried) what the resume step of `token` asks: launched,
    /// or found launched, and reopened `token`, or failed doing so, or was
    /// cut; not an agent part that found an agent there.
    pub(super) fn serves(&self, token: Option<&str>) -> bool {
        token == Some(self.token.as_str())
            && match &self.answer {
                Answer::Given(a) => matches!(
                    a.outcome(),
                    pb::RecoverOutcome::Done
                        | pb::RecoverOutcome::Duplicate
                        | pb::RecoverOutcome::Failed
                ),
                Answer::Cut(_) => true,
                // Settled first (`settle`); it serves if it launched.
                Answer::Pending(_) => true,
            }
    }

    /// Stops waiting for a launch still running: its task ends (the
    /// agent, if agentctl started it, is the caller's to stop).
    pub(super) fn abandon(&self) {
        if let Answer::Pending(task) = &self.answer {
            task.abort();
        }
    }

    /// Its agent's launch still runs (see [`Self::settle`]).
    pub(super) fn is_pending(&self) -> bool {
        matches!(self.answer, Answer::Pending(_))
    }

    /// Waits for a [`Answer::Pending`] part to end, as the steps after the
    /// health check would have waited for it inside the check.
    pub(super) async fn settle(&mut self) {
        let Answer::Pending(task) = &mut self.answer else {
            return;
        };
        self.answer = match task.await {
            Ok(Ok(Ok(a))) => Answer::Given(Box::new(a.agent)),
            Ok(Ok(Err(e))) => Answer::Cut(format!("agentctl's Recover failed: {e}")),
            Ok(Err(silence)) => Answer::Cut(silence),
            Err(e) => Answer::Cut(format!("the agent's launch did not finish: {e}")),
        };
    }

    /// The launch slot it held, and when the launch began.
    pub(super) fn take_permit(&mut self) -> (Option<LaunchPermit>, Instant) {
        (self.permit.take(), self.began)
    }
}

/// The health check's answer: `Err(())` when it did not come in time.
pub(super) type Checked = std::result::Result<sessiond_executor::Result<Health>, ()>;

impl ExecutorRecovery<'_> {
    /// The health check of `run` as one `Recover`; `None` when this
    /// agentctl does not know the call (the caller asks `Health` instead).
    pub(super) async fn health_ahead(
        &self,
        run: &mut Run,
        driver: &Arc<dyn Executor>,
        remaining: Duration,
    ) -> Option<Checked> {
        let intent = run.ahead.intent.take();
        if run.ahead.unsupported {
            return None;
        }
        let client = match Agents(self).agentctl(&run.record, driver) {
            Ok(c) => c,
            Err(e) => return Some(Ok(Err(e))),
        };
        let sid = run.session.id;
        let mut request = pb::RecoverRequest {
            generation: run.record.generation,
            ..Default::default()
        };
        // The launch rides along only with a slot free now: waiting for one
        // would hold up the workspace's return (the resume step waits).
        let mut permit = None;
        if let Some(token) = &intent
            && let Ok(launch) = Agents(self).launch_request(&run.profile, run.record.runtime)
            && let Some(p) = self.inner.launches.try_acquire(host_of(&run.record))
        {
            request.launch = Some(launch);
            request.resume_token.clone_from(token);
            permit = Some(p);
        }
        let began = Instant::now();
        let answer = if let Some(p) = permit.take() {
            self.inner
                .agent_recoveries
                .enter(sid, RecoveryStage::Launching);
            let mut launched = {
                let me = self.0.clone();
                let record = run.record.clone();
                let silence = run.agent_silence;
                let client = client.clone();
                tokio::spawn(async move {
                    let call = client.recover(record.id, request);
                    ExecutorRecovery(&me)
                        .until_silent(&record, silence, call)
                        .await
                })
            };
            let joined = match tokio::time::timeout(WORKSPACE_FIRST, &mut launched).await {
                Ok(joined) => joined,
                Err(_) => {
                    // The agent takes its time: agentctl's health alone
                    // gives the workspace back now (helper-52 1: a slow
                    // agent's resume held it, and SERVING, for 33 s).
                    let health =
                        tokio::time::timeout(remaining, client.verify_identity(run.record.id))
                            .await
                            .map_err(|_| ());
                    match &health {
                        Ok(Ok(h))
                            if surviving_agent(h, intent.as_deref()) == SurvivingAgent::None =>
                        {
                            if let Some(token) = intent {
                                run.ahead.agent = Some(AgentAhead {
                                    token,
                                    answer: Answer::Pending(launched),
                                    permit: Some(p),
                                    began,
                                });
                                return Some(health);
                            }
                            launched.await
                        }
                        // The agent is up: its answer is on its way.
                        Ok(Ok(_)) => launched.await,
                        _ => {
                            launched.abort();
                            p.finish_seen(
                                Ended::Cut,
                                self.inner.agent_recoveries.take_cpu_wait(sid),
                            );
                            return Some(health);
                        }
                    }
                }
            };
            let joined =
                joined.unwrap_or_else(|e| Err(format!("the agent's launch did not finish: {e}")));
            match joined {
                Ok(a) => (a, Some(p)),
                Err(silence) => {
                    // agentctl may be fine and only the agent silent: a
                    // plain health check tells, and the resume step then
                    // ends the cut launch as its own calls would have.
                    let health =
                        tokio::time::timeout(remaining, client.verify_identity(run.record.id))
                            .await
                            .map_err(|_| ());
                    // (If the agent came up meanwhile, its health shows it:
                    // a reattach, nothing left to cut.)
                    let cut_agent = match &health {
                        Ok(Ok(h)) => surviving_agent(h, intent.as_deref()) == SurvivingAgent::None,
                        _ => false,
                    };
                    if let Some(token) = intent.filter(|_| cut_agent) {
                        run.ahead.agent = Some(AgentAhead {
                            token,
                            answer: Answer::Cut(silence),
                            permit: Some(p),
                            began,
                        });
                    } else {
                        p.finish_seen(Ended::Cut, self.inner.agent_recoveries.take_cpu_wait(sid));
                    }
                    return Some(health);
                }
            }
        } else {
            let call = client.recover(run.record.id, request);
            match tokio::time::timeout(remaining, call).await {
                Ok(a) => (a, None),
                Err(_) => return Some(Err(())),
            }
        };
        match answer {
            (Err(e), _) if e.is_unimplemented() => {
                tracing::debug!(executor_id = %run.record.id,
                    "agentctl does not know Recover: one call per recovery step");
                run.ahead.unsupported = true;
                None
            }
            (Err(e), _) => Some(Ok(Err(e))),
            (Ok(a), permit) => {
                run.ahead.caps = Some(a.capabilities);
                if let Some(token) = intent
                    && permit.is_some()
                {
                    run.ahead.agent = Some(AgentAhead {
                        token,
                        answer: Answer::Given(Box::new(a.agent)),
                        permit,
                        began,
                    });
                }
                Some(Ok(Ok(a.health)))
            }
        }
    }

    /// What an agent part that [`AgentAhead::serves`] the resume step did,
    /// as the step's own calls would have answered it. Called after the
    /// step marked the agent starting (which forgets modes), so the modes
    /// the reopening answered are kept under a fresh stamp.
    pub(super) async fn resumed_ahead(
        &self,
        run: &mut Run,
        ahead: AgentAhead,
    ) -> Result<std::result::Result<Result<Resumed>, String>> {
        let a = match &ahead.answer {
            Answer::Given(a) => a,
            Answer::Cut(silence) => return Ok(Err(silence.clone())),
            Answer::Pending(_) => {
                return Err(Error::Internal(
                    "an agent part still running was taken for a resume".into(),
                ));
            }
        };
        let (_, stamp) = self.inner.sessions.cached_modes(run.session.id, "");
        let counters = &self.inner.counters;
        let relaxed = std::sync::atomic::Ordering::Relaxed;
        let result =
            match a.outcome() {
                pb::RecoverOutcome::Done | pb::RecoverOutcome::Duplicate => {
                    counters.agent_launches.fetch_add(1, relaxed);
                    counters.resume_attempts.fetch_add(1, relaxed);
                    counters.resumed_by_recover.fetch_add(1, relaxed);
                    self.inner.metrics.resume(true);
                    self.inner.sessions.remember_modes(
                        run.session.id,
                        run.record.execution_id(),
                        stamp,
                        a.resumed
                            .as_ref()
                            .and_then(|r| r.modes.as_ref())
                            .map(crate::ops::agent_modes),
                    );
                    Ok(Resumed::Loaded)
                }
                pb::RecoverOutcome::Failed => {
                    counters.agent_launches.fetch_add(1, relaxed);
                    let call = if a.failed_call == "ResumeSession" {
                        counters.resume_attempts.fetch_add(1, relaxed);
                        counters.resumed_by_recover.fetch_add(1, relaxed);
                        self.inner.metrics.resume(false);
                        "ResumeSession"
                    } else {
                        "LaunchAgent"
                    };
                    let (_, failure, message) = sessiond_executor::agent_part_failure(a)
                        .unwrap_or(("", sessiond_executor::Failure::Other, ""));
                    let e = Error::Agent {
                        call,
                        failure,
                        message: message.to_owned(),
                    };
                    // (Read only then: a store read per executor otherwise.)
                    if load_refused(&e)
                        && crate::turn::no_turn_yet(&self.inner.store, &run.session).await?
                    {
                        match Agents(self).client(&run.record) {
                            Ok(client) => {
                                Agents(self)
                                    .replace_conversation(&client, &run.record, e.to_string())
                                    .await
                            }
                            Err(e) => Err(e),
                        }
                    } else {
                        Err(e)
                    }
                }
                // Not one that serves the step (see `serves`).
                _ => {
                    return Err(Error::Internal(
                        "an agent part that did nothing was taken for a resume".into(),
                    ));
                }
            };
        Ok(Ok(result))
    }

    /// The resume step's launch and resume as one `Recover` (its launch
    /// slot held), when the health check did not carry them. `None` when
    /// agentctl does not know the call or found an agent there: the step
    /// makes its calls.
    pub(super) async fn resume_in_one_call(
        &self,
        run: &mut Run,
        token: &str,
    ) -> Option<std::result::Result<Result<Resumed>, String>> {
        if run.ahead.unsupported {
            return None;
        }
        let client = Agents(self).client(&run.record).ok()?;
        let launch = Agents(self)
            .launch_request(&run.profile, run.record.runtime)
            .ok()?;
        let request = pb::RecoverRequest {
            generation: run.record.generation,
            launch: Some(launch),
            resume_token: token.to_owned(),
            ..Default::default()
        };
        let call = client.recover(run.record.id, request);
        let answer = match ExecutorRecovery(self)
            .until_silent(&run.record, run.agent_silence, call)
            .await
        {
            Err(silence) => return Some(Err(silence)),
            Ok(Err(e)) if e.is_unimplemented() => {
                run.ahead.unsupported = true;
                return None;
            }
            Ok(Err(e)) => return Some(Ok(Err(e.into()))),
            Ok(Ok(a)) => a.agent,
        };
        let ahead = AgentAhead {
            token: token.to_owned(),
            answer: Answer::Given(Box::new(answer)),
            permit: None,
            began: Instant::now(),
        };
        if !ahead.serves(Some(token)) {
            return None;
        }
        Some(
            self.resumed_ahead(run, ahead)
                .await
                .unwrap_or_else(|e| Ok(Err(e))),
        )
    }

    /// Before the outcome: an agent the health check launched that no step
    /// took up (the machine went elsewhere) is stopped, as one call per
    /// step would never have started it.
    pub(super) async fn drop_unused_agent(&self, run: &mut Run) {
        let Some(ahead) = run.ahead.agent.take() else {
            return;
        };
        let mut ahead = ahead;
        ahead.settle().await;
        let launched = match &ahead.answer {
            Answer::Given(a) => matches!(
                a.outcome(),
                pb::RecoverOutcome::Done | pb::RecoverOutcome::Failed
            ),
            Answer::Cut(_) => true,
            // (Settled above; were it not, its agent is stopped all the same.)
            Answer::Pending(_) => true,
        };
        if launched {
            tracing::info!(session = %run.session.id, executor_id = %run.record.id,
                "recovery: stopping the agent the health check launched, which the outcome does not use");
            Agents(self).stop_agent_quietly(&run.record).await;
            self.cache_update(run.session.id, |e| e.agent = AgentProcessState::NotRunning);
        }
    }
}
