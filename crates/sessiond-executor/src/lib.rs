//! Executors: where an agentctl (and so an agent) runs, behind one trait.
//!
//! [`Executor`] launches, recovers, probes and stops the agentctl of one
//! executor; the three drivers are [`standalone::StandaloneExecutor`] (a local
//! process), [`docker::DockerExecutor`] (a local container, through bollard)
//! and [`remote::RemoteExecutor`] (an agentctl some other host runs). Every
//! driver returns an [`ExecutorHandle`]: the fields the caller persists in
//! `executors_running` (see [`ExecutorHandle::apply_to`]) and hands back to
//! recover, probe or stop that executor later, possibly from another backend
//! process.
//!
//! This crate is the only one that knows OS processes, Docker and the agentctl
//! transport. It reads no configuration: drivers take typed config structs.
//!
//! # Intent before side effect
//!
//! Every launch writes its intent (`executors_running.status =
//! starting`, generation + 1) before it spawns anything. Recovery therefore
//! goes in two phases:
//!
//! 1. [`Executor::probe`] looks at what the handle records and starts
//!    nothing (see [`Probe`]);
//! 2. on [`Probe::NeedsLaunch`] the caller persists the intent with
//!    `handle.generation + 1`, then calls
//!    [`Executor::launch`]`(&handle.relaunch_spec())`; on
//!    [`Probe::NeedsStart`] (a stopped Docker container) it persists the
//!    intent, then calls [`Executor::start`]`(&handle, handle.generation + 1)`.
//!
//! Each built-in driver also has an inherent `recover` doing both phases in
//! one call, for callers that keep no intent record (tools, the drivers'
//! own tests).

#![deny(missing_docs)]

mod cgroup;
mod client;
pub mod docker;
mod error;
pub mod process;
pub mod remote;
pub mod standalone;
pub mod worktree;

use std::{fmt, path::PathBuf, time::Duration};

use async_trait::async_trait;
use sessiond_domain::{ExecutorId, ExecutorRecord, Runtime, SessionId, TaskId};

pub use client::{
    AgentProgress, AgentState, AgentctlClient, BearerAuth, Capabilities, ClientConfig, Health,
    INSTANCE_ID_METADATA, LEASE_EPOCH_METADATA, MAX_MESSAGE_BYTES, RawClient, RecoverAnswer,
    STALE_EPOCH, Support, TlsConfig, WRONG_EXECUTOR, agent_part_failure, default_deadline,
    with_deadline,
};
pub use error::{Error, Failure, Result};
pub use worktree::{BranchCommit, WorktreeAnswer, WorktreeOp, WorktreeTarget};

/// What to launch: one agentctl for one executor, in one workspace.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    /// The executor to launch; agentctl is started with it and proves it in
    /// `Health`.
    pub executor_id: ExecutorId,
    /// The session it serves (labels, logs).
    pub session_id: SessionId,
    /// The task of that session (labels, logs).
    pub task_id: TaskId,
    /// The worktree agentctl serves (host path).
    pub workspace_path: PathBuf,
    /// The generation the caller persisted with its launch intent
    /// (`executors_running.status = starting`) before calling `launch`.
    pub generation: i64,
    /// Address and secret of an agentctl that already runs elsewhere; only the
    /// remote driver uses (and requires) it.
    pub remote: Option<RemoteTarget>,
    /// The image the session's profile asks for; only the Docker driver uses
    /// it (its configured image when `None`).
    pub image: Option<String>,
    /// The launching owner's lease epoch: every agentctl call of the launch
    /// (readiness included) and of the handle returned carries it, so the
    /// new agentctl fences older owners off from its first call (`None`: an
    /// exclusive store, nothing to fence).
    pub lease_epoch: Option<i64>,
    /// The repository of a worktree sessiond created in `workspace_path`;
    /// the Docker driver mounts its git directory too (`None`: a directory
    /// the caller made).
    pub repository: Option<PathBuf>,
}

impl LaunchSpec {
    /// The local drivers mount or serve the worktree: without it there is
    /// nothing to launch into.
    pub(crate) fn require_workspace(&self) -> Result<()> {
        if self.workspace_path.is_dir() {
            return Ok(());
        }
        Err(Error::WorkspaceMissing {
            executor_id: self.executor_id,
            path: self.workspace_path.clone(),
        })
    }
}

/// An agentctl that some other host runs.
#[derive(Clone, PartialEq, Eq)]
pub struct RemoteTarget {
    /// agentctl's address, `http://host:port` or `https://host:port`.
    pub url: String,
    /// The bearer secret that agentctl was started with (never logged).
    pub auth_secret: String,
}

impl fmt::Debug for RemoteTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteTarget")
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

/// Where an executor's agentctl is and how to prove it is ours: everything
/// `executors_running` records about the runtime side of an executor.
#[derive(Clone, PartialEq, Eq)]
pub struct ExecutorHandle {
    /// The executor; agentctl must report it in `Health`.
    pub executor_id: ExecutorId,
    /// The session it serves.
    pub session_id: SessionId,
    /// The task of that session.
    pub task_id: TaskId,
    /// Which driver made it (and must be used to recover, probe or stop it).
    pub runtime: Runtime,
    /// The worktree agentctl serves (host path).
    pub workspace_path: PathBuf,
    /// The generation of this launch (see [`LaunchSpec::generation`]).
    pub generation: i64,
    /// The bearer secret agentctl was started with.
    pub auth_secret: String,
    /// `unix:///<run_dir>/...sock` for local drivers, `http(s)://host:port` for remote.
    pub agentctl_url: String,
    /// The port of a remote `agentctl_url`; `None` for local drivers.
    pub agentctl_port: Option<u16>,
    /// Standalone: agentctl's pid; never trusted without `pid_start_time`.
    pub pid: Option<u32>,
    /// Standalone: the start time of `pid` (`/proc/<pid>/stat` field 22, clock
    /// ticks since boot), which tells our agentctl from a reused pid.
    pub pid_start_time: Option<u64>,
    /// Docker: the container's full id.
    pub container_id: Option<String>,
    /// The owner's lease epoch, sent on every agentctl call of the driver's
    /// clients (`None`: not sent; an exclusive store has no one to fence).
    pub lease_epoch: Option<i64>,
}

impl fmt::Debug for ExecutorHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExecutorHandle")
            .field("executor_id", &self.executor_id)
            .field("session_id", &self.session_id)
            .field("task_id", &self.task_id)
            .field("runtime", &self.runtime)
            .field("workspace_path", &self.workspace_path)
            .field("generation", &self.generation)
            .field("auth_secret", &"<redacted>")
            .field("agentctl_url", &self.agentctl_url)
            .field("agentctl_port", &self.agentctl_port)
            .field("pid", &self.pid)
            .field("pid_start_time", &self.pid_start_time)
            .field("container_id", &self.container_id)
            .field("lease_epoch", &self.lease_epoch)
            .finish()
    }
}

impl ExecutorHandle {
    /// The handle a stored record describes, to recover or stop it.
    pub fn from_record(record: &ExecutorRecord) -> Self {
        Self {
            executor_id: record.id,
            session_id: record.session_id,
            task_id: record.task_id,
            runtime: record.runtime,
            workspace_path: PathBuf::from(&record.workspace_path),
            generation: record.generation,
            auth_secret: record.auth_secret.clone(),
            agentctl_url: record.agentctl_url.clone().unwrap_or_default(),
            agentctl_port: record.agentctl_port,
            pid: record.pid,
            pid_start_time: record.pid_start_time,
            container_id: record.container_id.clone(),
            lease_epoch: Some(record.lease_epoch),
        }
    }

    /// Writes the runtime fields into `record` (url, port, pid, start time,
    /// container id, secret, generation); status and timestamps stay the
    /// caller's business.
    pub fn apply_to(&self, record: &mut ExecutorRecord) {
        record.agentctl_url = Some(self.agentctl_url.clone()).filter(|u| !u.is_empty());
        record.agentctl_port = self.agentctl_port;
        record.pid = self.pid;
        record.pid_start_time = self.pid_start_time;
        record.container_id = self.container_id.clone();
        record.auth_secret = self.auth_secret.clone();
        record.generation = self.generation;
    }

    fn new(spec: &LaunchSpec, runtime: Runtime, auth_secret: String, url: String) -> Self {
        Self {
            executor_id: spec.executor_id,
            session_id: spec.session_id,
            task_id: spec.task_id,
            runtime,
            workspace_path: spec.workspace_path.clone(),
            generation: spec.generation,
            auth_secret,
            agentctl_url: url,
            agentctl_port: None,
            pid: None,
            pid_start_time: None,
            container_id: None,
            lease_epoch: spec.lease_epoch,
        }
    }

    /// The spec to launch this executor anew with the next generation.
    pub fn relaunch_spec(&self) -> LaunchSpec {
        LaunchSpec {
            executor_id: self.executor_id,
            session_id: self.session_id,
            task_id: self.task_id,
            workspace_path: self.workspace_path.clone(),
            generation: self.generation + 1,
            remote: None,
            image: None,
            lease_epoch: self.lease_epoch,
            repository: None,
        }
    }
}

/// How a driver's one-call `recover` (e.g. `StandaloneExecutor::recover`)
/// got the executor back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecoveryAction {
    /// The recorded agentctl was running and proved its identity: nothing was
    /// started, the handle is unchanged.
    Reattached,
    /// The recorded container existed but was stopped; it was started again
    /// (same container, new agentctl process inside).
    Restarted,
    /// A new agentctl was launched (generation + 1) because the recorded one
    /// was gone or could not be trusted.
    Relaunched,
}

/// A recovered executor: its (possibly new) handle and what was done.
#[derive(Debug, Clone)]
pub struct Recovered {
    /// The handle to persist: the recorded one when reattached, a new one
    /// (generation + 1) when restarted or relaunched.
    pub handle: ExecutorHandle,
    /// What was done to get it back.
    pub action: RecoveryAction,
    /// agentctl's `Health` answer after recovery (identity already checked).
    pub health: Health,
}

/// What [`Executor::probe`] found. Probing starts, spawns and signals nothing,
/// with one exception: a standalone agentctl that is provably ours (pid *and*
/// start time match the record) but fails `Health` is hung, and is terminated
/// so that the launch that follows cannot make a second agentctl.
// One value per recovery, moved once: boxing the handle would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum Probe {
    /// The recorded agentctl runs and proved its identity. `handle` is the
    /// recorded one, with what the driver found refreshed (Docker: container
    /// id, port and secret); persist it if it differs.
    Reattachable {
        /// The handle to keep using (and persist if it changed).
        handle: ExecutorHandle,
        /// agentctl's `Health` answer, identity checked; says whether an
        /// agent survived too.
        health: Health,
    },
    /// Nothing usable runs (standalone: the process is gone, its pid was
    /// reused, or it was hung and has been ended). Persist the intent with
    /// generation + 1, then `launch(&handle.relaunch_spec())`.
    NeedsLaunch {
        /// Why the recorded agentctl cannot be used (for logs).
        reason: String,
    },
    /// Docker: the container exists but is stopped (exited, created or
    /// paused). Persist the intent with generation + 1, then
    /// `start(&handle, generation)`.
    NeedsStart {
        /// The container's state (for logs).
        reason: String,
    },
    /// It cannot come back: the container is gone, or the worktree is
    /// missing. The executor goes to `error`, its sessions to `ERROR`.
    Missing {
        /// What is gone; shown to the user.
        reason: String,
    },
}

/// One kind of executor runtime.
///
/// Object safe, so the caller can hold one `Arc<dyn Executor>` per
/// [`Runtime`]. Every method is bounded in time by the driver's configuration.
///
/// Third parties implement it for their own way of running agentctl and
/// hand it to `sessiond_engine::SessionManager::new` (or the server's
/// builder) as the driver of one [`Runtime`]: a runtime of their own name
/// ([`Runtime::Custom`]), or a built-in one whose driver it replaces. The
/// recovery step machine drives it the same way as the built-in drivers,
/// through [`Self::probe`]'s answers for a custom runtime. The
/// `custom_executor` example of `sessiond-server` is a complete driver of a
/// runtime named `wrapper`; the smallest one wraps a built-in driver:
///
/// ```
/// use std::sync::Arc;
///
/// use async_trait::async_trait;
/// use sessiond_domain::Runtime;
/// use sessiond_executor::{
///     AgentctlClient, Executor, ExecutorHandle, LaunchSpec, Probe, Result,
///     standalone::{StandaloneConfig, StandaloneExecutor},
/// };
///
/// /// Logs every launch, then lets the wrapped driver do the work.
/// #[derive(Debug)]
/// struct Logged<E>(E);
///
/// #[async_trait]
/// impl<E: Executor> Executor for Logged<E> {
///     fn runtime(&self) -> Runtime {
///         self.0.runtime()
///     }
///     async fn launch(&self, spec: &LaunchSpec) -> Result<ExecutorHandle> {
///         println!("launching {} (generation {})", spec.executor_id, spec.generation);
///         self.0.launch(spec).await
///     }
///     async fn probe(&self, handle: &ExecutorHandle) -> Result<Probe> {
///         self.0.probe(handle).await
///     }
///     // Without this, the default refuses `Probe::NeedsStart`.
///     async fn start(&self, handle: &ExecutorHandle, generation: i64) -> Result<ExecutorHandle> {
///         self.0.start(handle, generation).await
///     }
///     async fn stop(&self, handle: &ExecutorHandle) -> Result<()> {
///         self.0.stop(handle).await
///     }
///     async fn remove(&self, handle: &ExecutorHandle) -> Result<()> {
///         self.0.remove(handle).await
///     }
///     fn client(&self, handle: &ExecutorHandle) -> Result<AgentctlClient> {
///         self.0.client(handle)
///     }
/// }
///
/// let config = StandaloneConfig::new("/usr/local/bin/agentctl".into(), "/run/sessiond".into());
/// let driver: Arc<dyn Executor> = Arc::new(Logged(StandaloneExecutor::new(config)));
/// assert_eq!(driver.runtime(), Runtime::LocalStandalone);
/// ```
#[async_trait]
pub trait Executor: Send + Sync + fmt::Debug {
    /// The runtime this driver serves.
    fn runtime(&self) -> Runtime;

    /// Whether a launch can reach what this driver runs executors on, asked
    /// before a create stores anything: a session whose engine does not
    /// answer would only be stored to fail. Drivers with nothing to ask
    /// answer `Ok` (the default).
    ///
    /// # Errors
    ///
    /// An error [`Error::is_unavailable`] accepts (Docker:
    /// [`Error::EngineUnavailable`]) when the engine does not answer.
    async fn check_ready(&self) -> Result<()> {
        Ok(())
    }

    /// Starts (or, for remote, connects to) the agentctl of `spec` and returns
    /// once it answered `Health` with the executor's id.
    ///
    /// # Errors
    ///
    /// [`Error::WorkspaceMissing`] (local drivers), [`Error::Spawn`],
    /// [`Error::ExitedEarly`], [`Error::NotReady`] when agentctl did not
    /// become healthy before the driver's deadline, [`Error::Config`] for a
    /// spec the driver cannot run (e.g. remote without [`LaunchSpec::remote`]),
    /// [`Error::Docker`] for engine failures.
    async fn launch(&self, spec: &LaunchSpec) -> Result<ExecutorHandle>;

    /// Looks at the executor of a stored handle without starting anything
    /// (see [`Probe`] for the one exception), so that the caller can persist
    /// its intent before [`Self::launch`] or [`Self::start`].
    ///
    /// # Errors
    ///
    /// Only when the driver cannot tell (e.g. [`Error::Docker`] with the engine
    /// down, [`Error::NotReady`] for a remote host that did not answer before
    /// the deadline); a missing or unusable
    /// executor is a [`Probe`] answer, not an error.
    async fn probe(&self, handle: &ExecutorHandle) -> Result<Probe>;

    /// Starts the existing, stopped runtime of `handle` again (Docker: the
    /// stopped container) and returns once its agentctl answered `Health`;
    /// the returned handle carries `generation`, which the caller persisted
    /// with its intent. Only for [`Probe::NeedsStart`]; drivers that never
    /// answer it refuse.
    async fn start(&self, handle: &ExecutorHandle, generation: i64) -> Result<ExecutorHandle> {
        let _ = generation;
        Err(Error::Config(format!(
            "{:?} executor {} has nothing to start; launch it instead",
            self.runtime(),
            handle.executor_id
        )))
    }

    /// `Health` of the handle's agentctl, checked against its executor id.
    async fn health(&self, handle: &ExecutorHandle) -> Result<Health> {
        self.client(handle)?
            .verify_identity(handle.executor_id)
            .await
    }

    /// The capability probe of the handle's agentctl.
    async fn capabilities(&self, handle: &ExecutorHandle) -> Result<Capabilities> {
        self.client(handle)?.capabilities().await
    }

    /// Stops the executor's runtime (process ended, container stopped, remote
    /// agent stopped); what is needed to start it again stays.
    async fn stop(&self, handle: &ExecutorHandle) -> Result<()>;

    /// Stops the executor and removes what the driver made for it
    /// (container, run directory); idempotent.
    async fn remove(&self, handle: &ExecutorHandle) -> Result<()>;

    /// An authenticated client of the handle's agentctl, with per-call
    /// deadlines and a connect timeout. Does not connect yet.
    fn client(&self, handle: &ExecutorHandle) -> Result<AgentctlClient>;

    /// Performs a worktree operation on the executor's host, through
    /// agentctl there (see [`worktree`]). Drivers that cannot reach the
    /// host's git refuse with FAILED_PRECONDITION: their sessions use a
    /// directory the caller made.
    async fn worktree(&self, target: &WorktreeTarget, op: WorktreeOp) -> Result<WorktreeAnswer> {
        let _ = (target, op);
        Err(Error::Worktree {
            code: tonic::Code::FailedPrecondition,
            message: format!(
                "runtime {} does not create worktrees; pass worktree.path of a directory on its host",
                self.runtime()
            ),
        })
    }

    /// The image a launch asking for `requested` runs, for drivers that run
    /// images (`None` for the others): named in errors about the agent's
    /// command, which must exist in it.
    fn image(&self, requested: Option<&str>) -> Option<String> {
        let _ = requested;
        None
    }
}

/// A fresh bearer secret: 244 random bits from the OS generator, as hex.
pub fn fresh_secret() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

/// Exponential backoff with jitter.
///
/// ```
/// use std::time::Duration;
/// use sessiond_executor::Backoff;
///
/// let b = Backoff { initial: Duration::from_millis(100), max: Duration::from_secs(1) };
/// // Retry 2 waits 100ms * 2^2 = 400ms, jittered into [200ms, 400ms].
/// let d = b.delay(2);
/// assert!(d >= Duration::from_millis(200) && d <= Duration::from_millis(400));
/// // Far retries are capped at `max` (jittered into [500ms, 1s]).
/// assert!(b.delay(40) <= Duration::from_secs(1));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The delay before the first retry (before jitter); default 250 ms.
    pub initial: Duration,
    /// The cap on any delay; default 30 s.
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(250),
            max: Duration::from_secs(30),
        }
    }
}

impl Backoff {
    /// Delay before retry number `attempt` (0-based): `initial * 2^attempt`
    /// capped at `max`, then a random point in its upper half ("equal jitter"),
    /// so many executors reconnecting at once spread out.
    pub fn delay(&self, attempt: u32) -> Duration {
        let base = self
            .initial
            .saturating_mul(2u32.saturating_pow(attempt.min(30)))
            .min(self.max);
        let half = base / 2;
        let random = (uuid::Uuid::new_v4().as_u128() & 0xffff_ffff) as f64 / f64::from(u32::MAX);
        half + half.mul_f64(random)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_with_jitter_and_caps() {
        let b = Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(1),
        };
        for _ in 0..50 {
            let d0 = b.delay(0);
            assert!(
                d0 >= Duration::from_millis(50) && d0 <= Duration::from_millis(100),
                "{d0:?}"
            );
            let d2 = b.delay(2);
            assert!(
                d2 >= Duration::from_millis(200) && d2 <= Duration::from_millis(400),
                "{d2:?}"
            );
            let d9 = b.delay(40);
            assert!(
                d9 >= Duration::from_millis(500) && d9 <= Duration::from_secs(1),
                "{d9:?}"
            );
        }
    }

    #[test]
    fn secrets_are_fresh_and_header_safe() {
        let a = fresh_secret();
        assert_eq!(a.len(), 64);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, fresh_secret());
    }
}
