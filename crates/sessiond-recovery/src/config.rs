//! Typed configuration of the session manager. Binaries build it; this crate
//! reads no files and no environment.

use std::time::Duration;

use sessiond_domain::ResumePolicy;
use sessiond_executor::Backoff;

/// How sessions are run and recovered.
#[derive(Debug, Clone)]
pub struct ManagerConfig {
    /// Auto-resume at startup, or only on an explicit resume (DESIGN §4).
    pub resume_policy: ResumePolicy,
    /// How many executors startup recovery works on at once.
    pub recovery_concurrency: usize,
    /// Each executor's recovery must finish within this; past it the executor
    /// (or its agent) is reported as failed, so one hung agentctl cannot hold
    /// the others.
    pub executor_deadline: Duration,
    /// How long an unreachable remote host keeps being retried in the
    /// background, counted from when it was last seen.
    pub remote_retry_window: Duration,
    /// Delays between background reconnect attempts.
    pub remote_backoff: Backoff,
    /// Deadline for the agent to answer ACP `initialize` on LaunchAgent.
    pub agent_initialize_timeout: Duration,
    /// Between TERM and KILL when an agent is stopped.
    pub agent_stop_grace: Duration,
    /// A streamed agent reply is written at most this often while it grows.
    pub message_flush_interval: Duration,
    /// Capacity of the live event channel; a slower subscriber re-reads the
    /// store instead of losing events.
    pub event_buffer: usize,
    /// Events read from the store per page when replaying to a subscriber.
    pub replay_page: u32,
    /// How often running executors are health-checked (`None`: never). An
    /// executor that stops answering goes `error` with an event.
    pub liveness_interval: Option<Duration>,
    /// The orphan-container sweep runs this long after the first startup
    /// recovery pass (so launches and recoveries in flight have written
    /// their records).
    pub orphan_sweep_grace: Duration,
    /// Then again every this long (`None`: once).
    pub orphan_sweep_interval: Option<Duration>,
    /// At most this many sessions with a live executor (`starting` or
    /// `ready`); a create past it is refused before anything is stored
    /// (`None`: no limit).
    pub max_live_sessions: Option<usize>,
    /// This process as one replica of several on one database.
    pub replica: ReplicaSettings,
}

/// Who this replica is and how it holds executors (see `replicas.rs`).
#[derive(Debug, Clone)]
pub struct ReplicaSettings {
    /// Unique among the replicas of one database; stable across restarts
    /// so a restarted replica takes its own executors back at once.
    pub id: String,
    /// A lease not renewed for this long is expired and its executor is
    /// adopted by another replica; heartbeats run every third of it.
    pub lease_ttl: Duration,
    /// The store is this process's alone (SQLite, locked by the binary):
    /// claims take every lease whatever it says, and nothing is adopted in
    /// the background (there is nobody to adopt from).
    pub exclusive: bool,
}

impl Default for ReplicaSettings {
    fn default() -> Self {
        Self {
            id: "single".into(),
            lease_ttl: Duration::from_secs(15),
            exclusive: true,
        }
    }
}

impl Default for ManagerConfig {
    fn default() -> Self {
        Self {
            resume_policy: ResumePolicy::Startup,
            recovery_concurrency: 64,
            executor_deadline: Duration::from_secs(5),
            remote_retry_window: Duration::from_secs(15 * 60),
            remote_backoff: Backoff::default(),
            agent_initialize_timeout: Duration::from_secs(30),
            agent_stop_grace: Duration::from_secs(3),
            message_flush_interval: Duration::from_millis(50),
            event_buffer: 1024,
            replay_page: 500,
            liveness_interval: Some(Duration::from_secs(30)),
            orphan_sweep_grace: Duration::from_secs(120),
            orphan_sweep_interval: Some(Duration::from_secs(15 * 60)),
            max_live_sessions: None,
            replica: ReplicaSettings::default(),
        }
    }
}
