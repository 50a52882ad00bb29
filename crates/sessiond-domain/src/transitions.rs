//! The state machines of sessions, executors and tasks.
//!
//! Each machine is a total function `(state, event) -> Result<state, IllegalTransition>`:
//! every pair is either a legal move to a state of `ALL` or a typed error
//! naming both. Self-loops are legal where an event can be repeated
//! harmlessly (a second resume request while starting, a health check of a
//! ready executor); callers publish `session.state_changed` only when the
//! state actually changed.
//!
//! Error messages and generations are data of the records, not of the
//! machines: the caller writes them next to the new state.

use std::fmt;

use crate::states::{ExecutorStatus, SessionState, TaskState};

/// An event that is not allowed in the current state.
///
/// The server maps it to `FAILED_PRECONDITION`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{event} is not allowed in state {from}")]
pub struct IllegalTransition<S, E>
where
    S: fmt::Display + fmt::Debug,
    E: fmt::Display + fmt::Debug,
{
    /// The state the machine was in (unchanged by the refused event).
    pub from: S,
    /// The event that is not allowed there.
    pub event: E,
}

/// A refused [`SessionState::transition`].
pub type IllegalSessionTransition = IllegalTransition<SessionState, SessionEvent>;
/// A refused [`ExecutorStatus::transition`].
pub type IllegalExecutorTransition = IllegalTransition<ExecutorStatus, ExecutorEvent>;
/// A refused [`TaskState::transition`].
pub type IllegalTaskTransition = IllegalTransition<TaskState, TaskEvent>;

macro_rules! event_enum {
    ($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$vdoc])* $variant),+
        }

        impl $name {
            /// Every event, in the column order of the transition table.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The event's name in logs and in [`IllegalTransition`] messages.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

event_enum!(
    /// What happens to a session. See [`SessionState::transition`] for the table.
    SessionEvent {
        /// Launch the agent: first launch, or a new launch after an error.
        LaunchRequested => "launch_requested",
        /// The agent answered and opened a new conversation.
        AgentReady => "agent_ready",
        /// A user message started a turn.
        TurnStarted => "turn_started",
        /// The agent finished its turn.
        TurnEnded => "turn_ended",
        /// Bring the agent back from its `resume_token` (explicit, or automatic
        /// after a restart that lost the agent process).
        ResumeRequested => "resume_requested",
        /// The agent is back and idle: loaded from its token, or found alive
        /// and idle by recovery.
        Resumed => "resumed",
        /// Recovery found the agent alive in the middle of a turn.
        AgentFoundBusy => "agent_found_busy",
        /// Launch, resume, the agent or its executor failed.
        Failed => "failed",
        /// The work of the session is done.
        Completed => "completed",
        /// The user ended the session.
        Cancelled => "cancelled",
    }
);

event_enum!(
    /// What happens to an executor. See [`ExecutorStatus::transition`] for the table.
    ExecutorEvent {
        /// The intent to (re)launch agentctl was written, with generation + 1,
        /// before anything is spawned.
        LaunchIntent => "launch_intent",
        /// agentctl answered Health with the right identity.
        Healthy => "healthy",
        /// agentctl, its container or its host failed or cannot be found.
        Failed => "failed",
        /// agentctl was stopped on purpose.
        Stopped => "stopped",
    }
);

event_enum!(
    /// What happens to a task. See [`TaskState::transition`] for the table.
    TaskEvent {
        /// An agent of the task started working (launch or a new message).
        WorkStarted => "work_started",
        /// An agent of the task waits for the user to look, e.g. after a
        /// successful resume (the task moves to REVIEW).
        ReadyForReview => "ready_for_review",
        /// The task's work is done.
        Completed => "completed",
        /// The user gave the task up.
        Cancelled => "cancelled",
    }
);

impl SessionState {
    /// The session state machine.
    ///
    /// | from \ event      | launch | agent_ready | turn_started | turn_ended | resume_requested | resumed | agent_found_busy | failed | completed | cancelled |
    /// |-------------------|--------|-------------|--------------|------------|------------------|---------|------------------|--------|-----------|-----------|
    /// | CREATED           | STARTING | -         | -            | -          | -                | -       | -                | ERROR  | -         | CANCELLED |
    /// | STARTING          | -      | WAITING     | -            | -          | STARTING         | WAITING | RUNNING          | ERROR  | -         | CANCELLED |
    /// | RUNNING           | -      | -           | -            | WAITING    | STARTING         | WAITING | RUNNING          | ERROR  | COMPLETED | CANCELLED |
    /// | WAITING_FOR_INPUT | -      | -           | RUNNING      | -          | STARTING         | WAITING | RUNNING          | ERROR  | COMPLETED | CANCELLED |
    /// | ERROR             | STARTING | -         | -            | -          | STARTING         | -       | -                | ERROR  | COMPLETED | CANCELLED |
    /// | COMPLETED         | -      | -           | -            | -          | -                | -       | -                | -      | -         | -         |
    /// | CANCELLED         | -      | -           | -            | -          | -                | -       | -                | -      | -         | -         |
    ///
    /// (`WAITING` is `WAITING_FOR_INPUT`, `-` is an [`IllegalTransition`].)
    ///
    /// Why:
    /// - `resume_requested` is legal from STARTING, RUNNING and WAITING_FOR_INPUT
    ///   because after a backend crash those states may describe an agent that
    ///   no longer runs; from ERROR it is the user's explicit resume. A CREATED
    ///   session has no conversation to resume: launch it.
    /// - `resumed` and `agent_found_busy` are how recovery puts a surviving or
    ///   resumed agent back without passing through STARTING, so a session that
    ///   looks the same after a restart produces no event.
    /// - `failed` from ERROR stays ERROR (a second failure while already failed).
    /// - COMPLETED and CANCELLED are terminal.
    ///
    /// # Errors
    ///
    /// [`IllegalTransition`] naming the state and the event for every `-`
    /// cell; the state is unchanged.
    ///
    /// ```
    /// use sessiond_domain::{SessionEvent as E, SessionState as S};
    ///
    /// // A launch, a turn, and a resume after the agent was lost.
    /// let s = S::Created.transition(E::LaunchRequested)?;
    /// let s = s.transition(E::AgentReady)?;
    /// let s = s.transition(E::TurnStarted)?;
    /// assert_eq!(s, S::Running);
    /// assert_eq!(s.transition(E::ResumeRequested)?, S::Starting);
    ///
    /// // Ended sessions stay ended.
    /// let err = S::Completed.transition(E::ResumeRequested).unwrap_err();
    /// assert_eq!(err.to_string(), "resume_requested is not allowed in state COMPLETED");
    /// # Ok::<(), sessiond_domain::IllegalSessionTransition>(())
    /// ```
    pub fn transition(self, event: SessionEvent) -> Result<SessionState, IllegalSessionTransition> {
        use SessionEvent as E;
        use SessionState as S;
        let next = match (self, event) {
            (S::Completed | S::Cancelled, _) => None,
            (S::Created | S::Error, E::LaunchRequested) => Some(S::Starting),
            (S::Starting, E::AgentReady) => Some(S::WaitingForInput),
            (S::WaitingForInput, E::TurnStarted) => Some(S::Running),
            (S::Running, E::TurnEnded) => Some(S::WaitingForInput),
            (S::Starting | S::Running | S::WaitingForInput | S::Error, E::ResumeRequested) => {
                Some(S::Starting)
            }
            (S::Starting | S::Running | S::WaitingForInput, E::Resumed) => Some(S::WaitingForInput),
            (S::Starting | S::Running | S::WaitingForInput, E::AgentFoundBusy) => Some(S::Running),
            (_, E::Failed) => Some(S::Error),
            (S::Running | S::WaitingForInput | S::Error, E::Completed) => Some(S::Completed),
            (_, E::Cancelled) => Some(S::Cancelled),
            _ => None,
        };
        next.ok_or(IllegalTransition { from: self, event })
    }

    /// States startup recovery resumes automatically
    /// (docs/decisions/0006-recovery-decision-table.md). ERROR is resumed
    /// only on explicit request; CREATED never ran an agent.
    pub const fn is_auto_resumable(self) -> bool {
        matches!(
            self,
            SessionState::Starting | SessionState::Running | SessionState::WaitingForInput
        )
    }
}

impl ExecutorEvent {
    /// The event whose legal outcome is `status` (the recovery decision table
    /// names target statuses; applying this event checks the move is legal).
    pub const fn reaching(status: ExecutorStatus) -> ExecutorEvent {
        match status {
            ExecutorStatus::Starting => ExecutorEvent::LaunchIntent,
            ExecutorStatus::Ready => ExecutorEvent::Healthy,
            ExecutorStatus::Error => ExecutorEvent::Failed,
            ExecutorStatus::Stopped => ExecutorEvent::Stopped,
        }
    }
}

impl ExecutorStatus {
    /// The executor state machine.
    ///
    /// | from \ event | launch_intent | healthy | failed | stopped |
    /// |--------------|---------------|---------|--------|---------|
    /// | starting     | starting      | ready   | error  | stopped |
    /// | ready        | starting      | ready   | error  | stopped |
    /// | error        | starting      | ready   | error  | stopped |
    /// | stopped      | starting      | -       | -      | stopped |
    ///
    /// A launch intent is legal from every status: it is how a crashed launch,
    /// a lost process or a stopped executor gets a new generation. `error ->
    /// ready` is a remote host answering again during background reconnect.
    /// Nothing runs in a stopped executor, so it cannot turn healthy or fail.
    ///
    /// # Errors
    ///
    /// [`IllegalTransition`] for the two `-` cells (`stopped` + `healthy` or
    /// `failed`).
    ///
    /// ```
    /// use sessiond_domain::{ExecutorEvent, ExecutorStatus};
    ///
    /// // A remote host answering again during background reconnect.
    /// assert_eq!(
    ///     ExecutorStatus::Error.transition(ExecutorEvent::Healthy),
    ///     Ok(ExecutorStatus::Ready)
    /// );
    /// // A stopped executor runs nothing: it must be relaunched first.
    /// assert!(ExecutorStatus::Stopped.transition(ExecutorEvent::Healthy).is_err());
    /// assert_eq!(
    ///     ExecutorStatus::Stopped.transition(ExecutorEvent::LaunchIntent),
    ///     Ok(ExecutorStatus::Starting)
    /// );
    /// ```
    pub fn transition(
        self,
        event: ExecutorEvent,
    ) -> Result<ExecutorStatus, IllegalExecutorTransition> {
        use ExecutorEvent as E;
        use ExecutorStatus as S;
        let next = match (self, event) {
            (_, E::LaunchIntent) => Some(S::Starting),
            (_, E::Stopped) => Some(S::Stopped),
            (S::Stopped, E::Healthy | E::Failed) => None,
            (_, E::Healthy) => Some(S::Ready),
            (_, E::Failed) => Some(S::Error),
        };
        next.ok_or(IllegalTransition { from: self, event })
    }
}

impl TaskState {
    /// COMPLETED and CANCELLED: no event moves the task out of them.
    pub const fn is_terminal(self) -> bool {
        matches!(self, TaskState::Completed | TaskState::Cancelled)
    }

    /// The task state machine.
    ///
    /// | from \ event | work_started | ready_for_review | completed | cancelled |
    /// |--------------|--------------|------------------|-----------|-----------|
    /// | TODO         | IN_PROGRESS  | -                | COMPLETED | CANCELLED |
    /// | IN_PROGRESS  | IN_PROGRESS  | REVIEW           | COMPLETED | CANCELLED |
    /// | REVIEW       | IN_PROGRESS  | REVIEW           | COMPLETED | CANCELLED |
    /// | COMPLETED    | -            | -                | -         | -         |
    /// | CANCELLED    | -            | -                | -         | -         |
    ///
    /// Several sessions of one task report work and reviews independently, so
    /// both are idempotent. A TODO task has had no agent work to review.
    ///
    /// # Errors
    ///
    /// [`IllegalTransition`] for every `-` cell; the state is unchanged.
    pub fn transition(self, event: TaskEvent) -> Result<TaskState, IllegalTaskTransition> {
        use TaskEvent as E;
        use TaskState as S;
        let next = match (self, event) {
            (S::Completed | S::Cancelled, _) => None,
            (_, E::WorkStarted) => Some(S::InProgress),
            (S::InProgress | S::Review, E::ReadyForReview) => Some(S::Review),
            (S::Todo, E::ReadyForReview) => None,
            (_, E::Completed) => Some(S::Completed),
            (_, E::Cancelled) => Some(S::Cancelled),
        };
        next.ok_or(IllegalTransition { from: self, event })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use SessionEvent as E;
    use SessionState as S;

    /// The expected session table, written out row by row in the order of
    /// `SessionEvent::ALL`, independently of the `match` above.
    fn expected_session(from: S) -> [Option<S>; 10] {
        const X: Option<S> = None;
        let st = Some(S::Starting);
        let wfi = Some(S::WaitingForInput);
        let run = Some(S::Running);
        let err = Some(S::Error);
        let done = Some(S::Completed);
        let can = Some(S::Cancelled);
        match from {
            //                launch agent_ready turn_st turn_end resume_req resumed busy failed completed cancelled
            S::Created => [st, X, X, X, X, X, X, err, X, can],
            S::Starting => [X, wfi, X, X, st, wfi, run, err, X, can],
            S::Running => [X, X, X, wfi, st, wfi, run, err, done, can],
            S::WaitingForInput => [X, X, run, X, st, wfi, run, err, done, can],
            S::Error => [st, X, X, X, st, X, X, err, done, can],
            S::Completed | S::Cancelled => [X; 10],
        }
    }

    #[test]
    fn session_events_are_listed_in_table_order() {
        assert_eq!(
            E::ALL,
            &[
                E::LaunchRequested,
                E::AgentReady,
                E::TurnStarted,
                E::TurnEnded,
                E::ResumeRequested,
                E::Resumed,
                E::AgentFoundBusy,
                E::Failed,
                E::Completed,
                E::Cancelled,
            ]
        );
    }

    #[test]
    fn session_table_every_state_and_event() {
        let mut checked = 0;
        for &from in S::ALL {
            let row = expected_session(from);
            for (i, &event) in E::ALL.iter().enumerate() {
                let got = from.transition(event);
                match row[i] {
                    Some(to) => assert_eq!(got, Ok(to), "{from} + {event}"),
                    None => assert_eq!(
                        got,
                        Err(IllegalTransition { from, event }),
                        "{from} + {event} must be illegal"
                    ),
                }
                checked += 1;
            }
        }
        assert_eq!(checked, 7 * 10);
    }

    #[test]
    fn executor_table_every_status_and_event() {
        use ExecutorEvent as Ev;
        use ExecutorStatus as X;
        let expected = |from: X, event: Ev| -> Option<X> {
            match (from, event) {
                (_, Ev::LaunchIntent) => Some(X::Starting),
                (_, Ev::Stopped) => Some(X::Stopped),
                (X::Stopped, _) => None,
                (_, Ev::Healthy) => Some(X::Ready),
                (_, Ev::Failed) => Some(X::Error),
            }
        };
        // The closure restates the table; pin a few rows literally as well.
        assert_eq!(X::Starting.transition(Ev::Healthy), Ok(X::Ready));
        assert_eq!(X::Error.transition(Ev::Healthy), Ok(X::Ready));
        assert_eq!(X::Ready.transition(Ev::LaunchIntent), Ok(X::Starting));
        assert!(X::Stopped.transition(Ev::Healthy).is_err());
        assert!(X::Stopped.transition(Ev::Failed).is_err());
        let mut checked = 0;
        for &from in X::ALL {
            for &event in Ev::ALL {
                match expected(from, event) {
                    Some(to) => assert_eq!(from.transition(event), Ok(to), "{from} + {event}"),
                    None => assert_eq!(
                        from.transition(event),
                        Err(IllegalTransition { from, event })
                    ),
                }
                checked += 1;
            }
        }
        assert_eq!(checked, 4 * 4);
    }

    #[test]
    fn task_table_every_state_and_event() {
        use TaskEvent as Ev;
        use TaskState as T;
        let expected = |from: T| -> [Option<T>; 4] {
            const X: Option<T> = None;
            let prog = Some(T::InProgress);
            let review = Some(T::Review);
            let done = Some(T::Completed);
            let can = Some(T::Cancelled);
            match from {
                //                 work  review  completed cancelled
                T::Todo => [prog, X, done, can],
                T::InProgress => [prog, review, done, can],
                T::Review => [prog, review, done, can],
                T::Completed | T::Cancelled => [X; 4],
            }
        };
        assert_eq!(
            Ev::ALL,
            &[
                Ev::WorkStarted,
                Ev::ReadyForReview,
                Ev::Completed,
                Ev::Cancelled
            ]
        );
        let mut checked = 0;
        for &from in T::ALL {
            for (i, &event) in Ev::ALL.iter().enumerate() {
                match expected(from)[i] {
                    Some(to) => assert_eq!(from.transition(event), Ok(to), "{from} + {event}"),
                    None => assert_eq!(
                        from.transition(event),
                        Err(IllegalTransition { from, event })
                    ),
                }
                checked += 1;
            }
        }
        assert_eq!(checked, 5 * 4);
    }

    #[test]
    fn illegal_transition_names_state_and_event() {
        let err = S::Completed.transition(E::ResumeRequested).unwrap_err();
        assert_eq!(
            err.to_string(),
            "resume_requested is not allowed in state COMPLETED"
        );
    }

    #[test]
    fn auto_resumable_states_follow_design() {
        let auto: Vec<_> = S::ALL
            .iter()
            .copied()
            .filter(|s| s.is_auto_resumable())
            .collect();
        assert_eq!(auto, [S::Starting, S::Running, S::WaitingForInput]);
    }
}
