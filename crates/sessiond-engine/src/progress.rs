//! Where each session's agent recovery stands: [`AgentRecoveries`].
//!
//! From the moment recovery asks for a launch slot for a session's agent
//! until the agent is back (or the session goes ERROR), the session has an
//! entry here: its stage, the attempt, why the previous one broke off, and
//! when the next one starts. GetSessionStatus shows it (`recovering`, with
//! the place in the launch queue the scheduler knows), and a background
//! retry reads the attempt number from it. It lives in memory: a restarted
//! backend starts every session's count afresh.

use std::{
    collections::HashMap,
    sync::Mutex,
    time::{Duration, Instant},
};

use sessiond_domain::{AgentRecovery, RecoveryStage, SessionId};

use crate::{
    launches::CpuWait,
    sync::{Held, Holds, lock},
};

#[derive(Debug, Clone)]
struct Entry {
    stage: RecoveryStage,
    attempt: u32,
    last_error: Option<String>,
    retry_at: Option<Instant>,
    replayed: u64,
    /// The launch in flight's wait for a CPU, as last read.
    cpu_wait: Option<CpuWait>,
}

/// The agent recoveries under way, per session.
#[derive(Default)]
pub(crate) struct AgentRecoveries {
    entries: Mutex<HashMap<SessionId, Entry>>,
    /// Woken each time a recovery is done with a session.
    done: tokio::sync::Notify,
    /// Sessions a stop or delete is ending (how many at once): their
    /// recovery launches no agent (see [`Self::withdraw`]).
    withdrawn: Holds<SessionId>,
    /// Woken at each [`Self::withdraw`].
    withdrawing: tokio::sync::Notify,
}

impl AgentRecoveries {
    /// The attempt a recovery of `session` starting now is (1 when none is
    /// under way).
    pub(crate) fn attempt(&self, session: SessionId) -> u32 {
        lock(&self.entries)
            .get(&session)
            .map_or(1, |e| e.attempt.max(1))
    }

    /// `session`'s agent recovery is at `stage` (created at its attempt).
    pub(crate) fn enter(&self, session: SessionId, stage: RecoveryStage) {
        let mut entries = lock(&self.entries);
        let e = entries.entry(session).or_insert(Entry {
            stage,
            attempt: 1,
            last_error: None,
            retry_at: None,
            replayed: 0,
            cpu_wait: None,
        });
        e.stage = stage;
        if stage != RecoveryStage::WaitingToRetry {
            e.retry_at = None;
        }
    }

    /// The agent replayed `replayed` history updates so far.
    pub(crate) fn replayed(&self, session: SessionId, replayed: u64) {
        if let Some(e) = lock(&self.entries).get_mut(&session) {
            e.replayed = replayed;
        }
    }

    /// Attempt `attempt` broke off (`reason`); the next one starts after `delay`.
    pub(crate) fn retry_after(
        &self,
        session: SessionId,
        attempt: u32,
        reason: String,
        delay: Duration,
    ) {
        let mut entries = lock(&self.entries);
        let e = entries.entry(session).or_insert(Entry {
            stage: RecoveryStage::WaitingToRetry,
            attempt,
            last_error: None,
            retry_at: None,
            replayed: 0,
            cpu_wait: None,
        });
        e.stage = RecoveryStage::WaitingToRetry;
        e.attempt = attempt.saturating_add(1);
        e.last_error = Some(reason);
        e.retry_at = Some(Instant::now() + delay);
        e.replayed = 0;
        e.cpu_wait = None;
    }

    /// The agent being launched for `session` has waited `wait` for a CPU
    /// so far (agentctl's count), read while it starts.
    pub(crate) fn saw_cpu_wait(&self, session: SessionId, wait: CpuWait) {
        if let Some(e) = lock(&self.entries).get_mut(&session) {
            e.cpu_wait = Some(wait);
        }
    }

    /// The last [`Self::saw_cpu_wait`] of `session`'s launch, taken: what
    /// its launch slot is freed with.
    pub(crate) fn take_cpu_wait(&self, session: SessionId) -> Option<CpuWait> {
        lock(&self.entries)
            .get_mut(&session)
            .and_then(|e| e.cpu_wait.take())
    }

    /// A stop or delete is ending `session`: while the returned guard
    /// lives, a recovery of it that has not launched its agent yet does not
    /// (it ends with the workspace back and the agent down), and one that
    /// waits for a launch slot stops waiting. The stop waits for the
    /// recovery (it holds the session's lock) and then ends the session
    /// and its executor; launching an agent only to stop it cost a real
    /// agent's whole start (helper-34: a stop during recovery took 11 s).
    pub(crate) fn withdraw(&self, session: SessionId) -> Held<'_, SessionId> {
        let held = self.withdrawn.hold(session);
        self.withdrawing.notify_waiters();
        held
    }

    /// Whether a stop or delete is ending `session` ([`Self::withdraw`]).
    pub(crate) fn is_withdrawn(&self, session: SessionId) -> bool {
        self.withdrawn.is_held(session)
    }

    /// Resolves once a stop or delete is ending `session`.
    pub(crate) async fn withdrawn(&self, session: SessionId) {
        loop {
            // Registered before the look, so a `withdraw` in between wakes it.
            let woken = self.withdrawing.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            if self.is_withdrawn(session) {
                return;
            }
            woken.await;
        }
    }

    /// Recovery is done with `session` (its agent is back, or it failed for
    /// good, or a user took over).
    pub(crate) fn clear(&self, session: SessionId) {
        lock(&self.entries).remove(&session);
        self.done.notify_waiters();
    }

    /// True while a recovery of `session`'s agent is under way (launching,
    /// resuming, queued for a slot, or waiting to retry).
    pub(crate) fn under_way(&self, session: SessionId) -> bool {
        lock(&self.entries).contains_key(&session)
    }

    /// Waits until no recovery is under way for `session`, at most `limit`;
    /// true when none is (any more).
    pub(crate) async fn wait_done(&self, session: SessionId, limit: Duration) -> bool {
        let until = tokio::time::Instant::now() + limit;
        loop {
            // Registered before the look, so a `clear` in between wakes it.
            let done = self.done.notified();
            tokio::pin!(done);
            done.as_mut().enable();
            if !lock(&self.entries).contains_key(&session) {
                return true;
            }
            if tokio::time::timeout_at(until, done).await.is_err() {
                return false;
            }
        }
    }

    /// What status shows of `session`'s agent recovery; `place` tells where it
    /// waits for a launch slot, if it does.
    pub(crate) fn view(
        &self,
        session: SessionId,
        max_attempts: u32,
        place: impl FnOnce() -> Option<(usize, usize)>,
    ) -> Option<AgentRecovery> {
        let e = lock(&self.entries).get(&session).cloned()?;
        let to_u32 = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        // Asked only of a queued recovery (it scans the launch queues).
        let place = if e.stage == RecoveryStage::Queued {
            place()
        } else {
            None
        };
        // Queued but in no queue: its slot was just granted.
        let stage = match (e.stage, place) {
            (RecoveryStage::Queued, None) => RecoveryStage::Launching,
            (stage, _) => stage,
        };
        Some(AgentRecovery {
            stage,
            place: place.map(|(p, n)| (to_u32(p), to_u32(n))),
            attempt: e.attempt,
            max_attempts,
            last_error: e.last_error,
            retry_in: e
                .retry_at
                .map(|at| at.saturating_duration_since(Instant::now())),
            replayed: e.replayed,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_follows_its_attempts_until_cleared() {
        let p = AgentRecoveries::default();
        let s = SessionId::new();
        assert_eq!(p.attempt(s), 1);
        assert!(p.view(s, 5, || None).is_none());
        p.enter(s, RecoveryStage::Queued);
        let v = p.view(s, 5, || Some((3, 7))).expect("entry");
        assert_eq!(
            (v.stage, v.place, v.attempt),
            (RecoveryStage::Queued, Some((3, 7)), 1)
        );
        p.enter(s, RecoveryStage::Resuming);
        p.replayed(s, 12);
        let v = p.view(s, 5, || Some((1, 1))).expect("entry");
        assert_eq!((v.place, v.replayed), (None, 12), "no place once launched");
        p.enter(s, RecoveryStage::Queued);
        let v = p.view(s, 5, || None).expect("entry");
        assert_eq!(
            v.stage,
            RecoveryStage::Launching,
            "granted: no longer queued"
        );
        p.retry_after(s, 1, "silent".into(), Duration::from_secs(60));
        assert_eq!(p.attempt(s), 2);
        let v = p.view(s, 5, || None).expect("entry");
        assert_eq!(v.stage, RecoveryStage::WaitingToRetry);
        assert_eq!(v.last_error.as_deref(), Some("silent"));
        assert!(v.retry_in.is_some_and(|d| d > Duration::from_secs(50)));
        p.enter(s, RecoveryStage::Queued);
        assert_eq!(p.attempt(s), 2, "the attempt stays until cleared");
        assert!(p.view(s, 5, || None).expect("entry").retry_in.is_none());
        p.clear(s);
        assert_eq!(p.attempt(s), 1);
        assert!(p.view(s, 5, || None).is_none());
    }
}
