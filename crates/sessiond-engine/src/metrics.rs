//! What an operator of an agent backend watches, as `prometheus-client`
//! families: the manager updates them where things happen (turns in the
//! update pump, launches and resumes in `ops.rs`, reconnects in
//! `recovery.rs`, watch streams in `events.rs`); the server registers them
//! in its registry ([`ManagerMetrics::register`]) and serves them.
//!
//! Every label is a closed set of short words (never an id), so the number
//! of series is fixed whatever the number of sessions.
//!
//! Turn outcomes are the four an operator asks about: `completed`,
//! `cancelled`, `failed` (the agent reported an error, exited mid-turn, or
//! did not accept the prompt), `interrupted` (a turn the backend lost to a
//! crash, recorded by whoever settles it: [`ManagerMetrics::turn_ended`]
//! takes any [`TurnOutcome`]). Turn duration and time to the first agent
//! chunk are measured from the Prompt this process sent; a turn that
//! started before a restart is counted but not timed.

use std::{
    collections::HashMap,
    sync::{Mutex, PoisonError},
    time::Instant,
};

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};
use sessiond_domain::{Runtime, SessionId};

/// Turn durations: seconds to an hour.
const TURN_BUCKETS: &[f64] = &[
    0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
];
/// Time to the first chunk: mostly the model's latency.
const FIRST_CHUNK_BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// How a turn ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TurnOutcome {
    /// The agent ended the turn itself (`end_turn`, `max_tokens`, `refusal`, ...).
    Completed,
    /// A client cancelled it.
    Cancelled,
    /// The agent reported an error, or refused the prompt.
    Failed,
    /// Cut short, its reply kept and marked, for `RetryTurn`: the backend
    /// lost it to a crash (settled after recovery), or the agent exited
    /// under it.
    Interrupted,
}

impl TurnOutcome {
    /// The `outcome` label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            TurnOutcome::Completed => "completed",
            TurnOutcome::Cancelled => "cancelled",
            TurnOutcome::Failed => "failed",
            TurnOutcome::Interrupted => "interrupted",
        }
    }

    /// From ACP's stop reason as agentctl reports it in `TurnEnded`.
    pub fn from_stop_reason(stop_reason: &str) -> Self {
        match stop_reason {
            "error" => TurnOutcome::Failed,
            "cancelled" => TurnOutcome::Cancelled,
            _ => TurnOutcome::Completed,
        }
    }
}

/// Why an agent process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitCause {
    /// Exit code 0.
    Exited,
    /// A non-zero exit code.
    Failed,
    /// Ended by a signal (a crash, the OOM killer, kill -9).
    Signal,
    /// agentctl reported neither a code nor a signal.
    Unknown,
}

impl ExitCause {
    /// The `cause` label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            ExitCause::Exited => "exit_zero",
            ExitCause::Failed => "exit_nonzero",
            ExitCause::Signal => "signal",
            ExitCause::Unknown => "unknown",
        }
    }

    /// The cause of an exit with this exit code or signal, as agentctl
    /// reports them (a code wins when both are set).
    pub fn of(code: Option<i32>, signal: Option<i32>) -> Self {
        match (code, signal) {
            (Some(0), _) => ExitCause::Exited,
            (Some(_), _) => ExitCause::Failed,
            (None, Some(_)) => ExitCause::Signal,
            (None, None) => ExitCause::Unknown,
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ByLabels {
    by: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CurrencyLabels {
    currency: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CauseLabels {
    cause: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LaunchLabels {
    // A built-in runtime's name or a registered one's.
    runtime: String,
    /// `launch` (a new session) or `relaunch` (recovery or resume: generation > 1).
    kind: &'static str,
    outcome: &'static str,
}

/// An executor recovery's outcome (`OutcomeLabel`) and, when the session is
/// not back, the failure's code (`RecoveryFailure::code`; `none` otherwise).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RecoveryLabels {
    outcome: &'static str,
    reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ScopeLabels {
    scope: &'static str,
}

type HistogramFn = fn() -> Histogram;

/// Turn clocks of this process, by session.
#[derive(Debug)]
struct TurnClock {
    started: Instant,
    first_chunk: bool,
}

/// The manager's metric families; one per [`crate::SessionManager`].
#[derive(Debug)]
pub struct ManagerMetrics {
    turns: Family<OutcomeLabels, Counter>,
    turn_seconds: Histogram,
    first_chunk_seconds: Histogram,
    agent_exits: Family<CauseLabels, Counter>,
    resumes: Family<OutcomeLabels, Counter>,
    launches: Family<LaunchLabels, Counter>,
    reconnects: Family<OutcomeLabels, Counter>,
    recoveries: Family<RecoveryLabels, Counter>,
    fenced: Family<ByLabels, Counter>,
    unparsed: Counter,
    agent_restarts: Counter,
    tokens: Family<KindLabels, Counter>,
    cost: Family<CurrencyLabels, Counter<f64, std::sync::atomic::AtomicU64>>,
    pub(crate) watch: WatchMetrics,
    clocks: Mutex<HashMap<SessionId, TurnClock>>,
}

/// The event bus's share: streams open and their lag.
#[derive(Debug, Clone, Default)]
pub(crate) struct WatchMetrics {
    streams: Family<ScopeLabels, Gauge>,
    /// Sum over open streams of (newest seq seen committed − last seq handed
    /// to the client).
    pub(crate) lag: Gauge,
}

impl WatchMetrics {
    pub(crate) fn opened(&self, session_scope: bool) {
        self.streams.get_or_create(&scope(session_scope)).inc();
    }

    pub(crate) fn closed(&self, session_scope: bool) {
        self.streams.get_or_create(&scope(session_scope)).dec();
    }
}

fn scope(session_scope: bool) -> ScopeLabels {
    ScopeLabels {
        scope: if session_scope { "session" } else { "task" },
    }
}

impl Default for ManagerMetrics {
    fn default() -> Self {
        let turn: HistogramFn = || Histogram::new(TURN_BUCKETS.iter().copied());
        let first: HistogramFn = || Histogram::new(FIRST_CHUNK_BUCKETS.iter().copied());
        let me = Self {
            turns: Family::default(),
            turn_seconds: turn(),
            first_chunk_seconds: first(),
            agent_exits: Family::default(),
            resumes: Family::default(),
            launches: Family::default(),
            reconnects: Family::default(),
            recoveries: Family::default(),
            fenced: Family::default(),
            unparsed: Counter::default(),
            agent_restarts: Counter::default(),
            tokens: Family::default(),
            cost: Family::default(),
            watch: WatchMetrics::default(),
            clocks: Mutex::default(),
        };
        // Every outcome listed from the start (at 0), so `rate()` and
        // alerts see a series before its first event.
        for o in [
            TurnOutcome::Completed,
            TurnOutcome::Cancelled,
            TurnOutcome::Failed,
            TurnOutcome::Interrupted,
        ] {
            drop(me.turns.get_or_create(&OutcomeLabels {
                outcome: o.as_str(),
            }));
        }
        for c in [
            ExitCause::Exited,
            ExitCause::Failed,
            ExitCause::Signal,
            ExitCause::Unknown,
        ] {
            drop(
                me.agent_exits
                    .get_or_create(&CauseLabels { cause: c.as_str() }),
            );
        }
        for outcome in ["resumed", "failed"] {
            drop(me.resumes.get_or_create(&OutcomeLabels { outcome }));
        }
        for outcome in [
            "resumed",
            "opened",
            "reattached",
            "executor_only",
            "stopped",
        ] {
            drop(me.recoveries.get_or_create(&RecoveryLabels {
                outcome,
                reason: "none",
            }));
        }
        for outcome in ["reachable", "unreachable"] {
            drop(me.reconnects.get_or_create(&OutcomeLabels { outcome }));
        }
        for by in ["store", "agentctl"] {
            drop(me.fenced.get_or_create(&ByLabels { by }));
        }
        for s in [true, false] {
            drop(me.watch.streams.get_or_create(&scope(s)));
        }
        for runtime in Runtime::ALL {
            for kind in ["launch", "relaunch"] {
                for outcome in ["ok", "failed", "timeout"] {
                    drop(me.launches.get_or_create(&LaunchLabels {
                        runtime: runtime.to_string(),
                        kind,
                        outcome,
                    }));
                }
            }
        }
        me
    }
}

impl ManagerMetrics {
    /// Adds these families to `registry` (the server's).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "sessiond_turns",
            "Agent turns ended, by outcome (completed, cancelled, failed, interrupted)",
            self.turns.clone(),
        );
        registry.register(
            "sessiond_fenced_actions",
            "Writes (by=store) and agentctl calls (by=agentctl) refused because this replica's \
             lease epoch was superseded: it was paused past its lease and another replica \
             adopted the session",
            self.fenced.clone(),
        );
        registry.register(
            "sessiond_turn_duration_seconds",
            "Time from the Prompt to the end of the turn (turns prompted by this process)",
            self.turn_seconds.clone(),
        );
        registry.register(
            "sessiond_turn_first_chunk_seconds",
            "Time from the Prompt to the agent's first reply chunk",
            self.first_chunk_seconds.clone(),
        );
        registry.register(
            "sessiond_agent_exits",
            "Agent processes that ended, by cause (exit_zero, exit_nonzero, signal, unknown)",
            self.agent_exits.clone(),
        );
        registry.register(
            "sessiond_agent_resumes",
            "Conversations loaded into an agent (ACP session/load), by outcome",
            self.resumes.clone(),
        );
        registry.register(
            "sessiond_agentctl_launches",
            "agentctl launches (new sessions) and relaunches (recovery, resume), by runtime and outcome",
            self.launches.clone(),
        );
        registry.register(
            "sessiond_remote_reconnect_attempts",
            "Background reconnect attempts to unreachable remote agentctls, by outcome",
            self.reconnects.clone(),
        );
        registry.register(
            "sessiond_recovery_outcomes",
            "Executor recoveries (startup, background retries, reconnects), by outcome (resumed, \
             reattached, retrying, resume_failed, ...) and, when the session is not back, the \
             reason's code (recovering, attempts_exhausted, not_resumable, ...; none otherwise)",
            self.recoveries.clone(),
        );
        registry.register(
            "sessiond_agent_updates_unparsed",
            "Agent session updates agentctl could not parse, stored raw (kind unparsed)",
            self.unparsed.clone(),
        );
        registry.register(
            "sessiond_agent_restarts",
            "Agents that exited by themselves and were started again with their conversation resumed",
            self.agent_restarts.clone(),
        );
        registry.register(
            "sessiond_agent_tokens",
            "Tokens agents reported for their turns, by kind (input, output, thought, \
             cached_read, cached_write)",
            self.tokens.clone(),
        );
        registry.register(
            "sessiond_agent_cost",
            "What agents reported their turns cost, by currency (or unit, e.g. credits)",
            self.cost.clone(),
        );
        registry.register(
            "sessiond_watch_streams",
            "WatchSession / WatchTask streams open, by scope",
            self.watch.streams.clone(),
        );
        registry.register(
            "sessiond_outbox_lag_events",
            "Events committed to the outbox but not yet delivered, summed over open watch streams",
            self.watch.lag.clone(),
        );
    }

    /// An executor's recovery ended with `outcome`; `reason` is the
    /// failure's code when the session is not back.
    pub(crate) fn recovery_outcome(&self, outcome: &'static str, reason: Option<&'static str>) {
        self.recoveries
            .get_or_create(&RecoveryLabels {
                outcome,
                reason: reason.unwrap_or("none"),
            })
            .inc();
    }

    /// An update agentctl could not parse was stored (once per part: a
    /// replay after a restart stores nothing and counts nothing).
    pub(crate) fn unparsed_update(&self) {
        self.unparsed.inc();
    }

    pub(crate) fn agent_restarted(&self) {
        self.agent_restarts.inc();
    }

    /// A turn's usage was stored (once per turn: in the commit that ended it).
    pub(crate) fn turn_usage(&self, u: &sessiond_domain::TurnUsage) {
        for (kind, n) in [
            ("input", u.input_tokens),
            ("output", u.output_tokens),
            ("thought", u.thought_tokens),
            ("cached_read", u.cached_read_tokens),
            ("cached_write", u.cached_write_tokens),
        ] {
            if let Some(n) = n {
                self.tokens.get_or_create(&KindLabels { kind }).inc_by(n);
            }
        }
        if let Some(c) = &u.cost {
            // The currency comes from the agent: a short code, or `other`,
            // so the number of series stays bounded.
            let ok = !c.currency.is_empty()
                && c.currency.len() <= 10
                && c.currency.chars().all(|ch| ch.is_ascii_alphanumeric());
            let currency = if ok {
                c.currency.clone()
            } else {
                "other".into()
            };
            self.cost
                .get_or_create(&CurrencyLabels { currency })
                .inc_by(c.amount);
        }
    }

    /// The Prompt of a turn was accepted by agentctl.
    pub(crate) fn turn_started(&self, session: SessionId) {
        lock(&self.clocks).insert(
            session,
            TurnClock {
                started: Instant::now(),
                first_chunk: false,
            },
        );
    }

    /// An agent reply chunk arrived; the first of a timed turn is observed.
    pub(crate) fn chunk(&self, session: SessionId) {
        let mut clocks = lock(&self.clocks);
        if let Some(c) = clocks.get_mut(&session)
            && !c.first_chunk
        {
            c.first_chunk = true;
            self.first_chunk_seconds
                .observe(c.started.elapsed().as_secs_f64());
        }
    }

    /// A turn ended with `outcome` (timed when this process prompted it).
    pub fn turn_ended(&self, session: SessionId, outcome: TurnOutcome) {
        self.turns
            .get_or_create(&OutcomeLabels {
                outcome: outcome.as_str(),
            })
            .inc();
        if let Some(c) = lock(&self.clocks).remove(&session) {
            self.turn_seconds.observe(c.started.elapsed().as_secs_f64());
        }
    }

    pub(crate) fn agent_exited(&self, cause: ExitCause) {
        self.agent_exits
            .get_or_create(&CauseLabels {
                cause: cause.as_str(),
            })
            .inc();
    }

    pub(crate) fn resume(&self, ok: bool) {
        self.resumes
            .get_or_create(&OutcomeLabels {
                outcome: if ok { "resumed" } else { "failed" },
            })
            .inc();
    }

    /// `generation` > 1 is a relaunch; `outcome` is `ok`, `failed` or `timeout`.
    pub(crate) fn launch(&self, runtime: Runtime, generation: i64, outcome: &'static str) {
        self.launches
            .get_or_create(&LaunchLabels {
                runtime: runtime.to_string(),
                kind: if generation > 1 { "relaunch" } else { "launch" },
                outcome,
            })
            .inc();
    }

    /// A write or agentctl call of this replica was refused for a lease
    /// epoch it no longer holds (`by`: `store` or `agentctl`).
    pub(crate) fn fenced(&self, by: &'static str) {
        self.fenced.get_or_create(&ByLabels { by }).inc();
    }

    pub(crate) fn reconnect_attempt(&self, reachable: bool) {
        self.reconnects
            .get_or_create(&OutcomeLabels {
                outcome: if reachable {
                    "reachable"
                } else {
                    "unreachable"
                },
            })
            .inc();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Milliseconds, for timing fields of debug events.
pub(crate) fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_and_causes_are_bounded_words() {
        assert_eq!(
            TurnOutcome::from_stop_reason("end_turn"),
            TurnOutcome::Completed
        );
        assert_eq!(
            TurnOutcome::from_stop_reason("max_tokens"),
            TurnOutcome::Completed
        );
        assert_eq!(
            TurnOutcome::from_stop_reason("cancelled"),
            TurnOutcome::Cancelled
        );
        assert_eq!(TurnOutcome::from_stop_reason("error"), TurnOutcome::Failed);
        assert_eq!(ExitCause::of(Some(0), None), ExitCause::Exited);
        assert_eq!(ExitCause::of(Some(3), None), ExitCause::Failed);
        assert_eq!(ExitCause::of(None, Some(9)), ExitCause::Signal);
        assert_eq!(ExitCause::of(None, None), ExitCause::Unknown);
    }

    #[test]
    fn a_timed_turn_observes_first_chunk_and_duration_once() {
        let m = ManagerMetrics::default();
        let s = SessionId::new();
        m.turn_started(s);
        m.chunk(s);
        m.chunk(s);
        m.turn_ended(s, TurnOutcome::Completed);
        // A turn this process did not prompt is counted, not timed.
        m.turn_ended(SessionId::new(), TurnOutcome::Failed);
        let mut registry = Registry::default();
        m.register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains("sessiond_turns_total{outcome=\"completed\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("sessiond_turns_total{outcome=\"failed\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("sessiond_turns_total{outcome=\"interrupted\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("sessiond_turn_first_chunk_seconds_count 1"),
            "{text}"
        );
        assert!(
            text.contains("sessiond_turn_duration_seconds_count 1"),
            "{text}"
        );
    }
}
