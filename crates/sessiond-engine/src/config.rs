//! Typed configuration of the session manager. Binaries build it; this crate
//! reads no files and no environment.

use std::time::Duration;

use sessiond_domain::ResumePolicy;
use sessiond_executor::Backoff;

/// How sessions are run and recovered.
#[derive(Debug, Clone)]
pub struct ManagerConfig {
    /// What the profiles' MCP secret references stand for, read by the
    /// binary at startup; sent to agentctl at each launch, never stored.
    pub mcp_secrets: sessiond_domain::Secrets,
    /// Auto-resume at startup, or only on an explicit resume.
    pub resume_policy: ResumePolicy,
    /// How many executors startup recovery works on at once.
    pub recovery_concurrency: usize,
    /// The silence limit of recovery. Each step of an executor's recovery
    /// (a call to agentctl or to the runtime's driver) that does not answer
    /// within it is cut, so one hung agentctl cannot hold the others; an
    /// agent's launch and resume are cut only when agentctl's `Health` has
    /// shown no sign of life of the agent (a line written, CPU used, history
    /// replayed) for this long. A cut attempt is retried (`max_attempts`).
    pub executor_deadline: Duration,
    /// An agent's launch and resume are cut after this long even while the
    /// agent shows signs of life (a load that never ends).
    pub resume_cap: Duration,
    /// Attempts at an executor's recovery before its session goes ERROR for
    /// a cause that can pass by itself (silence, an agent that exited while
    /// loading, agentctl failing to start). Verdicts (not resumable, the
    /// conversation lost, the container gone) are ERROR at once. 1: no retry.
    pub max_attempts: u32,
    /// Delays between those attempts (with jitter).
    pub retry_backoff: Backoff,
    /// Restarts of an agent that exited by itself while its agentctl
    /// lives (its conversation resumed, under the `startup` resume policy)
    /// within ten minutes, per session; the exit after them leaves the
    /// session ERROR. 0: an exit always does.
    pub agent_restarts: u32,
    /// How many agent launches (a new agent process and its resume) run at
    /// once per host; reattaches are not limited by it.
    pub launches: LaunchLimits,
    /// How long an unreachable remote host keeps being retried in the
    /// background, counted from when it was last seen.
    pub remote_retry_window: Duration,
    /// Delays between background reconnect attempts.
    pub remote_backoff: Backoff,
    /// agentctl's silence limit for the agent's ACP `initialize` on
    /// LaunchAgent (`initialize_timeout_ms`): cut when the agent shows no
    /// sign of life for this long, however long it works.
    pub agent_initialize_timeout: Duration,
    /// Between TERM and KILL when an agent is stopped.
    pub agent_stop_grace: Duration,
    /// How long a cancelled turn may go on: an agent that has not ended
    /// the turn this long after `CancelTurn` (it ignores `session/cancel`)
    /// is stopped, the turn ends cancelled, saying so, and the agent is
    /// restarted with its conversation (`agent_restarts`).
    pub cancel_grace: Duration,
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
    /// Where and how sessiond creates a worktree for a session that names a
    /// repository instead of a directory.
    pub worktrees: WorktreeSettings,
}

/// Worktrees sessiond creates from a repository.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorktreeSettings {
    /// Per runtime, the directory on the executor's host new worktrees go
    /// in (`<dir>/<short id>-<slug>`); a runtime without one cannot create
    /// worktrees. The binary checks they lie inside the worktree roots.
    pub dirs: Vec<(sessiond_domain::Runtime, std::path::PathBuf)>,
    /// The first part of every branch sessiond creates
    /// (`<prefix>/<short id>-<slug>`).
    pub branch_prefix: String,
    /// The directories worktrees on this host must stay inside
    /// (`executors.worktree_roots`): a create whose worktree directory
    /// resolves outside them, through a symlink made at any time, is
    /// refused. Empty: not checked.
    pub roots: Vec<std::path::PathBuf>,
}

impl WorktreeSettings {
    /// Where `path` really is on this host when that is outside the roots
    /// (a symlink on the way leads out); `None` when inside, or when no
    /// roots are set (not checked).
    pub(crate) fn outside_roots(&self, path: &std::path::Path) -> Option<std::path::PathBuf> {
        if self.roots.is_empty() {
            return None;
        }
        let resolved = sessiond_executor::worktree::resolved_path(path);
        let inside = self.roots.iter().any(|r| {
            resolved.starts_with(r)
                || std::fs::canonicalize(r).is_ok_and(|c| resolved.starts_with(c))
        });
        (!inside).then_some(resolved)
    }

    /// The roots as an error names them.
    pub(crate) fn listed_roots(&self) -> String {
        self.roots
            .iter()
            .map(|r| r.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl Default for WorktreeSettings {
    fn default() -> Self {
        Self {
            dirs: Vec::new(),
            branch_prefix: "sessiond".into(),
            roots: Vec::new(),
        }
    }
}

impl WorktreeSettings {
    /// Where `runtime` creates worktrees, if it does.
    pub fn dir(&self, runtime: sessiond_domain::Runtime) -> Option<&std::path::Path> {
        self.dirs
            .iter()
            .find(|(r, _)| *r == runtime)
            .map(|(_, d)| d.as_path())
    }
}

/// Admission of agent launches per host (see `launches.rs`): the limit
/// starts at `initial` and adapts to measured launch times (additive
/// increase while launches stay near the fastest seen and the host is not
/// overloaded, halved when one is slow or cut), within `1..=max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LaunchLimits {
    /// The starting limit; 0: the number of CPU cores of this host.
    pub initial: usize,
    /// The most it grows to; 0: four times `initial`.
    pub max: usize,
}

impl LaunchLimits {
    /// The starting limit, `initial` or the core count.
    pub fn start(&self) -> usize {
        if self.initial > 0 {
            self.initial
        } else {
            std::thread::available_parallelism().map_or(2, usize::from)
        }
    }

    /// The ceiling, `max` or four times the starting limit.
    pub fn ceiling(&self) -> usize {
        if self.max > 0 {
            self.max.max(self.start())
        } else {
            self.start() * 4
        }
    }
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
            resume_cap: Duration::from_secs(15 * 60),
            max_attempts: 5,
            retry_backoff: Backoff {
                initial: Duration::from_secs(1),
                max: Duration::from_secs(60),
            },
            agent_restarts: 3,
            launches: LaunchLimits::default(),
            remote_retry_window: Duration::from_secs(15 * 60),
            remote_backoff: Backoff::default(),
            agent_initialize_timeout: Duration::from_secs(30),
            agent_stop_grace: Duration::from_secs(3),
            cancel_grace: Duration::from_secs(15),
            message_flush_interval: Duration::from_millis(50),
            event_buffer: 1024,
            replay_page: 500,
            liveness_interval: Some(Duration::from_secs(30)),
            orphan_sweep_grace: Duration::from_secs(120),
            orphan_sweep_interval: Some(Duration::from_secs(15 * 60)),
            max_live_sessions: None,
            replica: ReplicaSettings::default(),
            mcp_secrets: sessiond_domain::Secrets::default(),
            worktrees: WorktreeSettings::default(),
        }
    }
}
