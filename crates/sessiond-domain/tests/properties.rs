//! Properties of the pure decisions, over generated states, events and
//! observation streams.

use std::collections::BTreeMap;

use chrono::{TimeZone, Utc};
use proptest::prelude::*;
use sessiond_domain::{
    Action, AgentProcessState, AgentProfileId, EventKind, EventPayload, ExecutionView,
    ExecutorEvent, ExecutorId, ExecutorStatus, MAX_STEPS, Observation, OutcomeLabel, Recovery,
    RecoveryInput, ResumePolicy, ResumeReason, Runtime, Session, SessionEvent, SessionId,
    SessionState, SurvivingAgent, TaskEvent, TaskId, TaskState, Worktree, session_status,
};

fn session_state() -> impl Strategy<Value = SessionState> {
    proptest::sample::select(SessionState::ALL)
}

fn runtime() -> impl Strategy<Value = Runtime> {
    let mut all = Runtime::ALL.to_vec();
    // A registered runtime of a third party's own name.
    all.push(Runtime::parse("vm").expect("a valid runtime name"));
    proptest::sample::select(all)
}

fn agent_process() -> impl Strategy<Value = AgentProcessState> {
    prop_oneof![
        Just(AgentProcessState::NotRunning),
        Just(AgentProcessState::Starting),
        Just(AgentProcessState::Running),
    ]
}

fn token() -> impl Strategy<Value = Option<String>> {
    prop_oneof![
        Just(None),
        Just(Some(String::new())),
        "[a-z0-9-]{1,12}".prop_map(Some)
    ]
}

fn session(state: SessionState, resume_token: Option<String>) -> Session {
    let at = Utc
        .timestamp_opt(1_700_000_000, 0)
        .single()
        .expect("valid time");
    Session {
        id: SessionId::new(),
        task_id: TaskId::new(),
        state,
        agent_profile_id: AgentProfileId::new(),
        agent_execution_id: None,
        runtime: Runtime::LocalStandalone,
        executor_id: None,
        worktree: Worktree::default(),
        title: String::new(),
        resume_token,
        metadata: BTreeMap::new(),
        error_message: None,
        version: 0,
        created_at: at,
        updated_at: at,
    }
}

#[derive(Debug, Clone)]
struct StatusCase {
    state: SessionState,
    token: Option<String>,
    profile: bool,
    execution: Option<(AgentProcessState, Option<bool>, ExecutorStatus, bool)>,
}

fn status_case() -> impl Strategy<Value = StatusCase> {
    (
        session_state(),
        token(),
        any::<bool>(),
        proptest::option::of((
            agent_process(),
            proptest::option::of(any::<bool>()),
            proptest::sample::select(ExecutorStatus::ALL),
            any::<bool>(),
        )),
    )
        .prop_map(|(state, token, profile, execution)| StatusCase {
            state,
            token,
            profile,
            execution,
        })
}

fn status_of(case: &StatusCase) -> (Session, sessiond_domain::SessionStatus) {
    let s = session(case.state, case.token.clone());
    let view = case.execution.map(
        |(agent, probe, executor_status, same_session)| ExecutionView {
            session_id: if same_session { s.id } else { SessionId::new() },
            execution_id: "e/1".into(),
            executor_status,
            agent,
            supports_session_resume: probe,
            retrying: None,
        },
    );
    let status = session_status(&s, view.as_ref(), case.profile);
    (s, status)
}

proptest! {
    #[test]
    fn session_event_sequences_stay_defined(
        start in session_state(),
        events in proptest::collection::vec(proptest::sample::select(SessionEvent::ALL), 0..40),
    ) {
        let mut state = start;
        for event in events {
            let was_terminal = state.is_terminal();
            match state.transition(event) {
                Ok(next) => {
                    prop_assert!(SessionState::ALL.contains(&next));
                    prop_assert!(!was_terminal, "{state} left a terminal state on {event}");
                    state = next;
                }
                Err(err) => {
                    prop_assert_eq!(err.from, state);
                    prop_assert_eq!(err.event, event);
                }
            }
            prop_assert!(!was_terminal || state.is_terminal());
        }
    }

    #[test]
    fn executor_and_task_sequences_stay_defined(
        executor_start in proptest::sample::select(ExecutorStatus::ALL),
        executor_events in proptest::collection::vec(proptest::sample::select(ExecutorEvent::ALL), 0..30),
        task_start in proptest::sample::select(TaskState::ALL),
        task_events in proptest::collection::vec(proptest::sample::select(TaskEvent::ALL), 0..30),
    ) {
        let mut status = executor_start;
        for event in executor_events {
            if let Ok(next) = status.transition(event) {
                prop_assert!(ExecutorStatus::ALL.contains(&next));
                status = next;
            }
        }
        let mut task = task_start;
        for event in task_events {
            let was_terminal = task.is_terminal();
            if let Ok(next) = task.transition(event) {
                prop_assert!(TaskState::ALL.contains(&next));
                prop_assert!(!was_terminal);
                task = next;
            }
        }
    }

    #[test]
    fn status_invariants(case in status_case()) {
        let (s, status) = status_of(&case);
        if !case.profile {
            prop_assert!(!status.is_resumable, "profile without resume support");
        }
        if let Some((_, Some(false), _, true)) = case.execution {
            prop_assert!(!status.is_resumable, "agent denied resume");
        }
        if case.token.as_deref().is_none_or(str::is_empty) {
            prop_assert!(!status.needs_resume, "no token");
            prop_assert!(!status.is_resumable, "no token");
        }
        if status.needs_resume {
            prop_assert!(!status.is_agent_running);
            prop_assert!(status.is_resumable);
            prop_assert!(!s.state.is_terminal());
            // The explicit resume the UI then offers is a legal transition.
            prop_assert!(s.state.transition(SessionEvent::ResumeRequested).is_ok());
        }
        prop_assert_eq!(status.needs_resume, status.resume_reason == ResumeReason::AgentNotRunning);
        if s.state.is_terminal() {
            prop_assert_eq!(status.resume_reason, ResumeReason::SessionEnded);
        }
        if status.is_agent_running && !s.state.is_terminal() {
            prop_assert_eq!(status.resume_reason, ResumeReason::None);
        }
        if let Some((_, _, _, false)) = case.execution {
            prop_assert!(!status.is_agent_running, "another session's execution counted");
            prop_assert_eq!(status.executor_status, None);
        }
    }
}

// ---- recovery ----

#[derive(Debug, Clone)]
struct RecoveryCase {
    input: RecoveryInput,
    /// Per step: pick an observation that fits the action (index into the
    /// fitting ones), or any observation at all.
    choices: Vec<(u8, bool)>,
}

fn recovery_case() -> impl Strategy<Value = RecoveryCase> {
    (
        runtime(),
        session_state(),
        any::<bool>(),
        any::<bool>(),
        token(),
        prop_oneof![Just(ResumePolicy::Startup), Just(ResumePolicy::OnDemand)],
        proptest::option::of(any::<u32>()),
        proptest::collection::vec((any::<u8>(), proptest::bool::weighted(0.15)), 40),
        (1u32..4, 1u32..4, any::<bool>()),
    )
        .prop_map(
            |(
                runtime,
                session_state,
                record,
                profile,
                token,
                policy,
                pid,
                choices,
                (attempt, max, managed),
            )| RecoveryCase {
                input: RecoveryInput {
                    executor_id: ExecutorId::new(),
                    runtime,
                    generation: 1,
                    agentctl_url: Some("http://127.0.0.1:9".into()),
                    container_id: Some("c".into()),
                    pid,
                    pid_start_time: pid.map(u64::from),
                    worktree_path: "/w".into(),
                    worktree_managed: managed,
                    record_supports_session_resume: record,
                    profile_supports_session_resume: profile,
                    resume_token: token.filter(|t| !t.is_empty()),
                    session_state,
                    policy,
                    attempt,
                    max_attempts: max,
                },
                choices,
            },
        )
}

fn failure() -> String {
    "boom".into()
}

fn every_observation() -> Vec<Observation> {
    use Observation as O;
    vec![
        O::WorktreeExists,
        O::WorktreeMissing,
        O::WorktreeUnrecoverable { reason: failure() },
        O::ProcessAlive {
            identity_proven: true,
        },
        O::ProcessAlive {
            identity_proven: false,
        },
        O::ProcessGone,
        O::ContainerRunning,
        O::ContainerStopped,
        O::ContainerMissing,
        O::DockerUnavailable { reason: failure() },
        O::ExecutorReattachable,
        O::ExecutorNeedsStart,
        O::ExecutorNeedsLaunch,
        O::ExecutorMissing { reason: failure() },
        O::RuntimeNotRegistered,
        O::Launched,
        O::HostUnreachable {
            reason: failure(),
            retry_in_background: true,
        },
        O::HostUnreachable {
            reason: failure(),
            retry_in_background: false,
        },
        O::Healthy {
            agent: SurvivingAgent::None,
        },
        O::Healthy {
            agent: SurvivingAgent::Idle,
        },
        O::Healthy {
            agent: SurvivingAgent::Busy,
        },
        O::Unhealthy { reason: failure() },
        O::Capabilities {
            supports_session_resume: true,
        },
        O::Capabilities {
            supports_session_resume: false,
        },
        O::CapabilitiesUnknown,
        O::Applied,
        O::ResumeSucceeded,
        O::ResumeFailed { reason: failure() },
        O::ConversationLost { reason: failure() },
        O::ResumeInterrupted { reason: failure() },
        O::ExecutorStopped,
        O::ActionFailed { reason: failure() },
        O::DeadlineExceeded,
    ]
}

/// Observations a real orchestrator could report after `action`.
fn fitting(action: &Action) -> Vec<Observation> {
    use Observation as O;
    let mut fit = match action {
        Action::CheckWorktree { .. } => vec![
            O::WorktreeExists,
            O::WorktreeMissing,
            O::WorktreeUnrecoverable {
                reason: "branch gone".into(),
            },
        ],
        Action::ProbeProcess { .. } => vec![
            O::ProcessAlive {
                identity_proven: true,
            },
            O::ProcessAlive {
                identity_proven: false,
            },
            O::ProcessGone,
        ],
        Action::LaunchAgentctl { .. } | Action::StartContainer { .. } => vec![O::Launched],
        Action::FindContainer { .. } => vec![
            O::ContainerRunning,
            O::ContainerStopped,
            O::ContainerMissing,
            O::DockerUnavailable { reason: failure() },
        ],
        Action::ProbeExecutor => vec![
            O::ExecutorReattachable,
            O::ExecutorNeedsStart,
            O::ExecutorNeedsLaunch,
            O::ExecutorMissing { reason: failure() },
            O::RuntimeNotRegistered,
        ],
        Action::HealthCheck => vec![
            O::Healthy {
                agent: SurvivingAgent::None,
            },
            O::Healthy {
                agent: SurvivingAgent::Idle,
            },
            O::Healthy {
                agent: SurvivingAgent::Busy,
            },
            O::Unhealthy { reason: failure() },
            O::HostUnreachable {
                reason: failure(),
                retry_in_background: true,
            },
            O::HostUnreachable {
                reason: failure(),
                retry_in_background: false,
            },
        ],
        Action::ProbeCapabilities => vec![
            O::Capabilities {
                supports_session_resume: true,
            },
            O::Capabilities {
                supports_session_resume: false,
            },
            O::CapabilitiesUnknown,
        ],
        Action::MarkExecutorReady { .. } => vec![O::Applied],
        Action::ResumeAgent { .. } | Action::OpenConversation => {
            vec![
                O::ResumeSucceeded,
                O::ResumeFailed { reason: failure() },
                O::ConversationLost { reason: failure() },
                O::ResumeInterrupted { reason: failure() },
            ]
        }
        Action::StopExecutor | Action::EndAgentctl => vec![O::ExecutorStopped],
        Action::Done(_) => vec![],
    };
    fit.push(O::ActionFailed { reason: failure() });
    fit.push(O::DeadlineExceeded);
    fit
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn recovery_terminates_and_respects_resumability(case in recovery_case()) {
        let input = case.input.clone();
        let initial = input.session_state;
        let claims_resume =
            input.record_supports_session_resume && input.profile_supports_session_resume;
        let everything = every_observation();

        let mut recovery = Recovery::new(input.clone());
        let mut action = recovery.start();
        let mut actions = 1;
        let mut probe_denied = false;
        let mut saw_resume_success = false;
        let mut surviving = SurvivingAgent::None;
        let mut events: Vec<EventPayload> = Vec::new();
        let mut choices = case.choices.iter();

        let outcome = loop {
            match &action {
                Action::Done(outcome) => break outcome.clone(),
                Action::ResumeAgent { resume_token } => {
                    prop_assert!(claims_resume && !probe_denied, "resumed a non-resumable session");
                    prop_assert_eq!(Some(resume_token), input.resume_token.as_ref());
                    prop_assert_eq!(input.policy, ResumePolicy::Startup);
                    prop_assert!(initial.is_auto_resumable(), "auto-resumed {}", initial);
                }
                Action::OpenConversation => {
                    // Only for a create that never got its conversation.
                    prop_assert_eq!(initial, SessionState::Starting);
                    prop_assert!(input.resume_token.is_none());
                    prop_assert_eq!(input.policy, ResumePolicy::Startup);
                }
                Action::LaunchAgentctl { event, .. }
                | Action::StartContainer { event, .. }
                | Action::MarkExecutorReady { event } => events.push(event.clone()),
                _ => {}
            }
            // Once the choices run out, the deadline fires.
            let observation = match choices.next() {
                Some(&(index, any)) => {
                    let pool = if any { everything.clone() } else { fitting(&action) };
                    pool[usize::from(index) % pool.len()].clone()
                }
                None => Observation::DeadlineExceeded,
            };
            let noted_before = (surviving, probe_denied, saw_resume_success);
            match &observation {
                Observation::Capabilities { supports_session_resume: false } => probe_denied = true,
                Observation::Healthy { agent } => surviving = *agent,
                Observation::ResumeSucceeded => saw_resume_success = true,
                _ => {}
            }
            match recovery.observe(observation) {
                Ok(next) => {
                    action = next;
                    actions += 1;
                    prop_assert!(actions <= MAX_STEPS, "more than {} actions", MAX_STEPS);
                }
                // Rejected: nothing was accepted, so undo what we noted.
                // (Restored, not cleared: an earlier accepted denial stands.)
                Err(_) => {
                    (surviving, probe_denied, saw_resume_success) = noted_before;
                    continue;
                }
            }
        };
        prop_assert!(recovery.is_done());
        events.extend(outcome.events.iter().cloned());

        // States stay defined, and the session only moves along legal transitions.
        let to = outcome.session_state;
        prop_assert!(SessionState::ALL.contains(&to));
        if to != initial {
            prop_assert!(
                SessionEvent::ALL.iter().any(|&e| initial.transition(e) == Ok(to)),
                "{} -> {} is no transition", initial, to
            );
        }
        if initial.is_terminal() {
            prop_assert_eq!(to, initial);
            prop_assert!(matches!(outcome.executor_status, ExecutorStatus::Stopped | ExecutorStatus::Error));
        }
        if !initial.is_auto_resumable() {
            prop_assert!(to == initial || to == SessionState::Error, "{} became {}", initial, to);
        }

        // A state_changed event exactly when the state changed, naming the change.
        let changes: Vec<_> = events.iter().filter(|e| e.kind() == EventKind::StateChanged).collect();
        if to == initial {
            prop_assert!(changes.is_empty());
        } else {
            prop_assert_eq!(changes.len(), 1);
            let is_this_change = matches!(
                changes[0],
                EventPayload::StateChanged { from, to: t, .. } if *from == initial && *t == to
            );
            prop_assert!(is_this_change);
        }
        prop_assert!(outcome.session_error.is_none() || to == SessionState::Error);

        // Workspace access follows the executor.
        prop_assert_eq!(outcome.workspace_enabled, outcome.executor_status == ExecutorStatus::Ready);
        if outcome.executor_status == ExecutorStatus::Error {
            prop_assert!(outcome.executor_error.is_some());
            prop_assert!(events.iter().any(|e| e.kind() == EventKind::AgentctlError));
        }
        if outcome.workspace_enabled {
            prop_assert!(events.iter().any(|e| e.kind() == EventKind::AgentctlReady));
        }
        // Retried in the background: an unreachable host or engine, or an
        // attempt that broke off with attempts left; the session is kept.
        prop_assert!(
            !outcome.retry_in_background
                || matches!(input.runtime, Runtime::Remote | Runtime::LocalDocker)
                || input.attempt < input.max_attempts
        );
        if outcome.retry_in_background {
            prop_assert_eq!(to, initial);
        }
        if input.attempt < input.max_attempts {
            let gave_up = outcome.error_message().is_some_and(|m| m.starts_with("attempts_exhausted:"));
            prop_assert!(!gave_up, "gave up with attempts left");
        }

        match outcome.label {
            OutcomeLabel::Resumed => {
                prop_assert!(saw_resume_success);
                prop_assert_eq!(to, SessionState::WaitingForInput);
            }
            OutcomeLabel::Opened => {
                prop_assert!(saw_resume_success);
                prop_assert_eq!(initial, SessionState::Starting);
                prop_assert_eq!(to, SessionState::WaitingForInput);
            }
            OutcomeLabel::Reattached => prop_assert!(surviving != SurvivingAgent::None),
            OutcomeLabel::NotResumable => prop_assert!(!claims_resume || probe_denied),
            OutcomeLabel::MissingResumeToken => prop_assert!(input.resume_token.is_none()),
            _ => {}
        }

        // Generations only grow, by one per launch.
        prop_assert!(outcome.generation == input.generation || outcome.generation == input.generation + 1);
    }
}
