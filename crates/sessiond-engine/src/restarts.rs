//! An agent that exits by itself (a crash, an out-of-memory kill) while
//! its agentctl lives is started again and its conversation resumed, as a
//! restart of the backend would: the user clicks nothing. Bounded, so an
//! agent that keeps dying does not run for ever: at most
//! `ManagerConfig::agent_restarts` restarts of a session's agent within
//! [`RESTART_WINDOW`]; the exit after them leaves the session ERROR ("resume
//! the session to continue"), as every exit did before.
//!
//! The restart's intent is the session STARTING, committed with the exit
//! (a turn cut by it ended interrupted in the same commit): a backend
//! killed before the restart ran finds a STARTING session and its startup
//! recovery resumes it. The restart itself is the session's recovery
//! (`Pass::recover_shared`, spawned by recovery's
//! `ExecutorRecovery::spawn_agent_restart`), so a launch that fails is
//! retried as any recovery's is, and an explicit resume meanwhile joins
//! it. The restarts of the window are also stored with the session
//! ([`RESTARTS_KEY`], written in the exit's commit), so a restarted backend
//! keeps counting where the last one stopped.

use std::{
    collections::{HashMap, VecDeque},
    sync::Mutex,
    time::{Duration, Instant},
};

use sessiond_domain::{EventPayload, ResumePolicy, Session, SessionEvent, SessionId, SessionState};

use sessiond_proto::agentctl::v1 as pb;

use crate::{changes::transition, config::ManagerConfig, error::Result, sync::lock};

/// How an agent ended, as its session's error says it: "exit code 1",
/// "signal 9".
pub(crate) fn exit_how(exit: Option<&pb::AgentExit>) -> String {
    match exit {
        Some(pb::AgentExit { code: Some(c), .. }) => format!("exit code {c}"),
        Some(pb::AgentExit {
            signal: Some(s), ..
        }) => format!("signal {s}"),
        _ => "unknown status".into(),
    }
}

/// The window the restart limit counts exits in.
pub(crate) const RESTART_WINDOW: Duration = Duration::from_secs(10 * 60);

/// What an agent's exit does to its session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AfterExit {
    /// Restarted: this is restart `n` of the window.
    Restart(u32),
    /// ERROR; `exhausted` when the window's restarts were used up.
    Error { exhausted: bool },
}

#[derive(Default)]
struct Entry {
    /// When each restart of the window was decided.
    at: VecDeque<Instant>,
    /// A restart was decided and has not finished.
    pending: bool,
    /// A restart was decided for an exit the exit counter has not seen
    /// (its `AgentExited` update may come after the new agent started).
    uncounted: bool,
    /// agentctl's instance and cursor of the last `AgentExited` seen.
    last_exit: Option<(String, u64)>,
    /// sessiond stopped the agent because it went on with a turn past
    /// its cancel's grace: its exit says so.
    stopped_after_cancel: Option<Duration>,
    /// `at` holds the restarts the session's record stored.
    seeded: bool,
}

/// The restarts of agents that exited by themselves, per session.
#[derive(Default)]
pub(crate) struct AgentRestarts(Mutex<HashMap<SessionId, Entry>>);

impl AgentRestarts {
    /// Decides a restart of `session`'s agent at `now`, at most `limit` in
    /// [`RESTART_WINDOW`], and counts it.
    /// `stored`: how long ago each restart the session's record holds
    /// was, which a process that has not counted this session yet starts
    /// from.
    pub(crate) fn admit(
        &self,
        session: SessionId,
        limit: u32,
        now: Instant,
        stored: &[Duration],
    ) -> AfterExit {
        if limit == 0 {
            return AfterExit::Error { exhausted: false };
        }
        let mut all = lock(&self.0);
        let e = all.entry(session).or_default();
        if !e.seeded {
            // The first restart this process decides for the session
            // (its entry may exist already, for an exit's count).
            e.seeded = true;
            let mut at: Vec<Instant> = stored
                .iter()
                .filter(|ago| **ago < RESTART_WINDOW)
                .filter_map(|ago| now.checked_sub(*ago))
                .chain(e.at.iter().copied())
                .collect();
            at.sort();
            e.at = at.into();
        }
        while e
            .at
            .front()
            .is_some_and(|t| now.saturating_duration_since(*t) >= RESTART_WINDOW)
        {
            e.at.pop_front();
        }
        if e.at.len() >= limit as usize {
            return AfterExit::Error { exhausted: true };
        }
        e.at.push_back(now);
        e.pending = true;
        e.uncounted = true;
        AfterExit::Restart(u32::try_from(e.at.len()).unwrap_or(u32::MAX))
    }

    /// Decides a restart of `session`'s agent that is not counted against
    /// the limit ([`restart_uncounted`]); otherwise as [`Self::admit`].
    pub(crate) fn admit_uncounted(&self, session: SessionId) -> AfterExit {
        let mut all = lock(&self.0);
        let e = all.entry(session).or_default();
        e.pending = true;
        e.uncounted = true;
        AfterExit::Restart(0)
    }

    /// How long before `now` each restart of `session`'s window was.
    pub(crate) fn recent(&self, session: SessionId, now: Instant) -> Vec<Duration> {
        lock(&self.0).get(&session).map_or_else(Vec::new, |e| {
            e.at.iter()
                .map(|t| now.saturating_duration_since(*t))
                .collect()
        })
    }

    /// True while a restart of `session`'s agent was decided and has not
    /// finished: an exit seen meanwhile is that agent's, already handled.
    pub(crate) fn pending(&self, session: SessionId) -> bool {
        lock(&self.0).get(&session).is_some_and(|e| e.pending)
    }

    /// Whether the `AgentExited` update at `cursor` of agentctl `instance`
    /// is an exit to count: seen for the first time, and of an agent that
    /// is gone (`gone`) or whose exit decided a restart (the new agent may
    /// already run when the update is read). A replayed update counts once.
    pub(crate) fn count_exit(
        &self,
        session: SessionId,
        instance: &str,
        cursor: u64,
        gone: bool,
    ) -> bool {
        let mut all = lock(&self.0);
        let e = all.entry(session).or_default();
        let first = match &e.last_exit {
            Some((i, c)) => i != instance || cursor > *c,
            None => true,
        };
        if first {
            e.last_exit = Some((instance.to_owned(), cursor));
        }
        let restarted = std::mem::take(&mut e.uncounted);
        first && (gone || restarted)
    }

    /// sessiond stops `session`'s agent because it did not end its turn
    /// within `grace` of the cancel.
    pub(crate) fn stopping_after_cancel(&self, session: SessionId, grace: Duration) {
        lock(&self.0)
            .entry(session)
            .or_default()
            .stopped_after_cancel = Some(grace);
    }

    /// The grace of the cancel after which sessiond stopped `session`'s
    /// agent, once (see [`stopped_after_cancel`]).
    pub(crate) fn take_cancel_stop(&self, session: SessionId) -> Option<Duration> {
        lock(&self.0)
            .get_mut(&session)
            .and_then(|e| e.stopped_after_cancel.take())
    }

    /// The exit of `session`'s agent was counted where it was found (a
    /// liveness check, the doorbell): its `AgentExited` update is not
    /// counted again on account of the restart it decided.
    pub(crate) fn exit_counted(&self, session: SessionId) {
        lock(&self.0).entry(session).or_default().uncounted = false;
    }

    /// The agent of `session` exited while nobody watched (sessiond was
    /// down) and was replaced since: its `AgentExited` update, read with
    /// an agent running, is still an exit to count.
    pub(crate) fn exit_to_count(&self, session: SessionId) {
        lock(&self.0).entry(session).or_default().uncounted = true;
    }

    /// `session` ended, was deleted or went to another replica: nothing of
    /// it is kept (so the map holds only sessions this process runs).
    pub(crate) fn forget(&self, session: SessionId) {
        lock(&self.0).remove(&session);
    }

    /// The restart of `session`'s agent finished (or was not committed).
    pub(crate) fn finished(&self, session: SessionId) {
        if let Some(e) = lock(&self.0).get_mut(&session) {
            e.pending = false;
        }
    }
}

/// Session metadata key of its agent's restarts in the window: their
/// wall-clock times (unix ms), comma-separated.
pub(crate) const RESTARTS_KEY: &str = "agent_restarts_at";

/// How long before `now_ms` each restart a session's `metadata` holds was
/// (unreadable entries and times in the future are left out).
fn stored_restarts(
    metadata: &std::collections::BTreeMap<String, String>,
    now_ms: i64,
) -> Vec<Duration> {
    metadata
        .get(RESTARTS_KEY)
        .map(|v| {
            v.split(',')
                .filter_map(|t| t.trim().parse::<i64>().ok())
                .filter_map(|t| u64::try_from(now_ms - t).ok())
                .map(Duration::from_millis)
                .collect()
        })
        .unwrap_or_default()
}

/// Why an agent sessiond stopped after a cancel it ignored for `grace`
/// is gone, as the session and its turn say it.
pub(crate) fn stopped_after_cancel(grace: Duration) -> String {
    format!(
        "the agent did not end the turn within {}s of its cancel, so sessiond stopped it",
        grace.as_secs_f64()
    )
}

/// The session after its agent exited (`what`: "the agent process exited
/// (exit code 1)"), with the events to commit with it, and whether its
/// agent is to be restarted (then `RecoverFirst::spawn_agent_restart` once
/// committed).
///
/// A RUNNING or WAITING_FOR_INPUT session with a resume token, under the
/// `startup` resume policy, within its restarts: ERROR with `what` and
/// then STARTING (both `state_changed` events, so the exit stays on
/// record). Otherwise ERROR: "resume the session to continue".
pub(crate) fn after_agent_exit(
    config: &ManagerConfig,
    restarts: &AgentRestarts,
    session: &Session,
    what: &str,
) -> Result<(Session, Vec<EventPayload>, AfterExit)> {
    restart_or_error(config, restarts, session, what, true)
}

/// [`after_agent_exit`] for a restart that the user's own action made
/// necessary (a cancel that left the Claude adapter 0.23 out of step): not
/// counted against the restart limit, which is for agents that fail by
/// themselves (helper-48 A: the fourth cancel in ten minutes left the
/// session ERROR).
pub(crate) fn restart_uncounted(
    config: &ManagerConfig,
    restarts: &AgentRestarts,
    session: &Session,
    what: &str,
) -> Result<(Session, Vec<EventPayload>, AfterExit)> {
    restart_or_error(config, restarts, session, what, false)
}

fn restart_or_error(
    config: &ManagerConfig,
    restarts: &AgentRestarts,
    session: &Session,
    what: &str,
    counted: bool,
) -> Result<(Session, Vec<EventPayload>, AfterExit)> {
    let (now, now_ms) = (Instant::now(), chrono::Utc::now().timestamp_millis());
    let decision = if config.resume_policy == ResumePolicy::Startup
        && session.resume_token.is_some()
        && matches!(
            session.state,
            SessionState::Running | SessionState::WaitingForInput
        ) {
        if counted {
            let stored = stored_restarts(&session.metadata, now_ms);
            restarts.admit(session.id, config.agent_restarts, now, &stored)
        } else {
            restarts.admit_uncounted(session.id)
        }
    } else {
        AfterExit::Error { exhausted: false }
    };
    match decision {
        AfterExit::Restart(n) => {
            let why = if counted {
                format!(
                    "{what}; sessiond restarts it and resumes the conversation (restart {n} of \
                     at most {} in {} minutes)",
                    config.agent_restarts,
                    RESTART_WINDOW.as_secs() / 60
                )
            } else {
                format!("{what}; sessiond restarts it and resumes the conversation")
            };
            let (failed, first) = transition(session, SessionEvent::Failed, Some(why))?;
            let (mut starting, second) = transition(&failed, SessionEvent::ResumeRequested, None)?;
            let at: Vec<String> = restarts
                .recent(session.id, now)
                .iter()
                .map(|ago| {
                    (now_ms - i64::try_from(ago.as_millis()).unwrap_or(i64::MAX)).to_string()
                })
                .collect();
            starting.metadata.insert(RESTARTS_KEY.into(), at.join(","));
            Ok((
                starting,
                first.into_iter().chain(second).collect(),
                decision,
            ))
        }
        AfterExit::Error { exhausted } => {
            let why = if exhausted {
                format!(
                    "{what}, after {} restarts in {} minutes; sessiond does not restart it \
                     again by itself: resume the session to continue",
                    config.agent_restarts,
                    RESTART_WINDOW.as_secs() / 60
                )
            } else {
                format!("{what}; resume the session to continue")
            };
            let (failed, ev) = transition(session, SessionEvent::Failed, Some(why))?;
            Ok((failed, ev.into_iter().collect(), decision))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restarts_are_counted_in_their_window() {
        let r = AgentRestarts::default();
        let s = SessionId::new();
        let t0 = Instant::now();
        assert_eq!(r.admit(s, 2, t0, &[]), AfterExit::Restart(1));
        assert!(r.pending(s));
        r.finished(s);
        assert!(!r.pending(s));
        assert_eq!(
            r.admit(s, 2, t0 + Duration::from_secs(60), &[]),
            AfterExit::Restart(2)
        );
        r.finished(s);
        assert_eq!(
            r.admit(s, 2, t0 + Duration::from_secs(120), &[]),
            AfterExit::Error { exhausted: true }
        );
        assert!(!r.pending(s), "an exhausted exit starts nothing");
        // The first restart leaves the window: one more is allowed.
        assert_eq!(
            r.admit(s, 2, t0 + RESTART_WINDOW, &[]),
            AfterExit::Restart(2)
        );
        // Other sessions count apart.
        let other = SessionId::new();
        assert_eq!(r.admit(other, 2, t0, &[]), AfterExit::Restart(1));
        // A forgotten session keeps nothing.
        r.forget(other);
        assert!(!r.pending(other));
        assert!(!lock(&r.0).contains_key(&other));
    }

    #[test]
    fn a_new_process_counts_from_the_restarts_the_session_stored() {
        let r = AgentRestarts::default();
        let s = SessionId::new();
        let now = Instant::now();
        let minute = Duration::from_secs(60);
        // Two restarts in the window, one older than it.
        let stored = [minute, 2 * minute, RESTART_WINDOW + minute];
        assert_eq!(r.admit(s, 3, now, &stored), AfterExit::Restart(3));
        assert_eq!(r.recent(s, now).len(), 3);
        r.finished(s);
        assert_eq!(
            r.admit(s, 3, now, &[]),
            AfterExit::Error { exhausted: true },
            "counted in memory from then on"
        );
        // Stored as wall-clock times and read back.
        let metadata = [(
            RESTARTS_KEY.to_owned(),
            "1000, 61000,junk,999999999".to_owned(),
        )]
        .into_iter()
        .collect();
        assert_eq!(
            stored_restarts(&metadata, 121_000),
            [Duration::from_secs(120), Duration::from_secs(60)]
        );
    }

    #[test]
    fn an_exit_is_counted_once_even_after_its_restart() {
        let r = AgentRestarts::default();
        let s = SessionId::new();
        assert!(r.count_exit(s, "a", 5, true));
        assert!(!r.count_exit(s, "a", 5, true), "a replay");
        assert!(
            !r.count_exit(s, "a", 7, false),
            "an agent running, no restart"
        );
        assert_eq!(r.admit(s, 3, Instant::now(), &[]), AfterExit::Restart(1));
        assert!(
            r.count_exit(s, "a", 9, false),
            "the new agent already runs, but this exit decided its restart"
        );
        assert!(!r.count_exit(s, "a", 9, false));
        assert!(
            r.count_exit(s, "b", 1, true),
            "another agentctl counts anew"
        );
    }

    #[test]
    fn no_restarts_when_the_limit_is_zero() {
        let r = AgentRestarts::default();
        let s = SessionId::new();
        assert_eq!(
            r.admit(s, 0, Instant::now(), &[]),
            AfterExit::Error { exhausted: false }
        );
        assert!(!r.pending(s));
    }
}
