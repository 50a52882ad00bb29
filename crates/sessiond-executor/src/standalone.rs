//! `local_standalone`: agentctl as a local process of this machine.
//!
//! **Launch** spawns agentctl (in its own process group, so signals aimed at
//! the backend's group do not reach it and it outlives the backend) listening
//! on the Unix socket `<run_dir>/<executor_id>.sock` (mode 0600; no TCP port
//! at all), with a fresh secret in `<run_dir>/<executor_id>.secret` (mode
//! 0600) that agentctl reads and unlinks before any agent runs. It waits for
//! `Health` to answer with the executor id and records pid, process start
//! time, socket URL and secret.
//!
//! A launch is cancel-safe: if its future is dropped after the spawn and
//! before it returned the handle (the caller's deadline passed, the caller
//! went away), the new agentctl is killed (through a pidfd, so never another
//! process), since nobody would ever learn its secret.
//!
//! **Probe** reports [`Probe::Reattachable`] (same pid, nothing restarted)
//! when the recorded pid runs, its start time equals the recorded one, and
//! `Health` with the recorded secret answers with the executor id and pid.
//! Otherwise [`Probe::NeedsLaunch`] (the caller persists its intent, then
//! launches with generation + 1), or [`Probe::Missing`] when the worktree is
//! gone. A pid whose start time does not match belongs to some other process:
//! it is never signalled and never trusted. A process that does match but
//! fails `Health` is ours and hung: probe terminates it (the only thing probe
//! ever signals), so one executor never has two agentctls. **Recover** is
//! probe followed by that launch.

use std::{
    os::unix::fs::OpenOptionsExt,
    path::{Path, PathBuf},
    process::Stdio,
    time::{Duration, Instant},
};

use async_trait::async_trait;
use sessiond_domain::{ExecutorId, Runtime};

use crate::{
    AgentctlClient, ClientConfig, Executor, ExecutorHandle, LaunchSpec, Probe, Recovered,
    RecoveryAction, cgroup,
    error::{Error, Result},
    fresh_secret,
    process::{self, OwnedProcess},
};

/// Configuration of the standalone driver.
#[derive(Debug, Clone)]
pub struct StandaloneConfig {
    /// The agentctl binary; see [`default_agentctl_path`].
    pub agentctl_path: PathBuf,
    /// Directory for per-executor runtime files (`<executor_id>.sock`, the
    /// socket; `<executor_id>.secret`, gone once agentctl read it). Kept
    /// short: a socket path has at most 107 bytes.
    pub run_dir: PathBuf,
    /// When set, agentctl's stdout and stderr go to `<log_dir>/<executor_id>.log`.
    pub log_dir: Option<PathBuf>,
    /// Passed as `--idle-timeout` (seconds): agentctl exits on its own after so
    /// long without backend contact.
    pub idle_timeout: Option<Duration>,
    /// Limit for a launched agentctl to answer `Health`.
    pub startup_timeout: Duration,
    /// Between TERM and KILL when stopping.
    pub stop_grace: Duration,
    /// How the driver's agentctl clients connect and time out.
    pub client: ClientConfig,
    /// agentctl's whole environment (its secret travels in a file): never the
    /// backend's own, which holds its API tokens and database URL. The
    /// binary picks the variables (see `sessiond serve`).
    pub env: Vec<(String, String)>,
    /// Each executor in a cgroup v2 of its own, killed whole on stop, where
    /// the host allows it (see `cgroup`); without one (or with `false`),
    /// the agent's tree is found by the marker its processes inherit.
    pub cgroups: bool,
}

/// The backend's datagram socket in the run directory that every local
/// agentctl rings (with its executor id) when its agent exits; see
/// [`StandaloneConfig::doorbell_path`].
pub const DOORBELL_FILE: &str = "doorbell.sock";

impl StandaloneConfig {
    /// Where agentctl rings when its agent exits: an idle session holds no
    /// update stream, so this is how its agent's exit reaches the backend
    /// at once. Nobody listening is fine (the liveness check finds it).
    pub fn doorbell_path(&self) -> PathBuf {
        self.run_dir.join(DOORBELL_FILE)
    }

    /// A configuration with the defaults: no log files, no idle timeout,
    /// 10 s startup, 5 s stop grace, and an environment of only a plain `PATH`.
    pub fn new(agentctl_path: PathBuf, run_dir: PathBuf) -> Self {
        Self {
            agentctl_path,
            run_dir,
            log_dir: None,
            idle_timeout: None,
            startup_timeout: Duration::from_secs(10),
            stop_grace: Duration::from_secs(5),
            client: ClientConfig::default(),
            env: vec![("PATH".into(), "/usr/local/bin:/usr/bin:/bin".into())],
            cgroups: true,
        }
    }
}

/// Where agentctl is by default: next to the running executable, else on
/// `PATH`. For binaries building a [`StandaloneConfig`].
pub fn default_agentctl_path() -> Option<PathBuf> {
    let beside = std::env::current_exe().ok()?.parent()?.join("agentctl");
    if beside.is_file() {
        return Some(beside);
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join("agentctl"))
        .find(|p| p.is_file())
}

/// The standalone driver ([`Runtime::LocalStandalone`]): agentctl as a
/// child process on this host, serving a Unix socket in the run directory;
/// found again after a restart by pid and start time (see the module docs).
#[derive(Debug, Clone)]
pub struct StandaloneExecutor {
    config: StandaloneConfig,
}

impl StandaloneExecutor {
    /// The driver; it touches nothing until the first call.
    pub fn new(config: StandaloneConfig) -> Self {
        Self { config }
    }

    fn socket(&self, id: ExecutorId) -> PathBuf {
        absolute(&self.config.run_dir).join(format!("{id}.sock"))
    }

    fn secret_file(&self, id: ExecutorId) -> PathBuf {
        absolute(&self.config.run_dir).join(format!("{id}.secret"))
    }

    /// agentctl's turn journal: kept across agentctl relaunches of the
    /// executor (that is its point), removed with the executor.
    fn journal_file(&self, id: ExecutorId) -> PathBuf {
        self.config.run_dir.join(format!("{id}.journal"))
    }

    /// Where the executor's cgroup is recorded (its path, one line).
    fn cgroup_record(&self, id: ExecutorId) -> PathBuf {
        self.config.run_dir.join(format!("{id}.cgroup"))
    }

    /// The executor's cgroup, created and recorded before agentctl starts
    /// (intent first: a backend killed right after the spawn still finds
    /// it); `None` where the host allows none.
    fn prepare_cgroup(&self, id: ExecutorId) -> Option<PathBuf> {
        if !self.config.cgroups {
            return None;
        }
        let group = cgroup::create(&cgroup::base()?, &id.to_string())?;
        let record = self.cgroup_record(id);
        // Private like everything in the run directory.
        let written = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&record)
            .and_then(|mut f| {
                use std::io::Write;
                f.write_all(group.display().to_string().as_bytes())
            });
        if let Err(e) = written {
            tracing::warn!(executor_id = %id, error = %e, path = %record.display(), "cannot record the executor's cgroup; running without one");
            return None;
        }
        Some(group)
    }

    /// Kills and removes the executor's recorded cgroup, if it has one.
    async fn kill_cgroup(&self, id: ExecutorId) -> Result<()> {
        let record = self.cgroup_record(id);
        let Ok(text) = std::fs::read_to_string(&record) else {
            return Ok(());
        };
        let group = PathBuf::from(text.trim());
        let limit = self.config.stop_grace + Duration::from_secs(5);
        if !cgroup::kill(&group, limit).await {
            return Err(Error::Reap {
                executor_id: id,
                message: format!(
                    "processes are still in its cgroup {} after {limit:?}",
                    group.display()
                ),
            });
        }
        remove_if_exists(&record)
    }

    fn log_file(&self, id: ExecutorId) -> Option<PathBuf> {
        self.config
            .log_dir
            .as_ref()
            .map(|d| d.join(format!("{id}.log")))
    }

    fn output(&self, id: ExecutorId) -> Result<(Stdio, Stdio)> {
        let Some(path) = self.log_file(id) else {
            return Ok((Stdio::null(), Stdio::null()));
        };
        let io_err = |source| Error::Io {
            action: "opening agentctl log",
            path: path.clone(),
            source,
        };
        // Only this user reads agentctl's log.
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&path)
            .map_err(io_err)?;
        let second = file.try_clone().map_err(io_err)?;
        Ok((Stdio::from(file), Stdio::from(second)))
    }

    async fn spawn(&self, spec: &LaunchSpec) -> Result<ExecutorHandle> {
        let id = spec.executor_id;
        spec.require_workspace()?;
        let run_dir = &self.config.run_dir;
        std::fs::create_dir_all(run_dir).map_err(|source| Error::Io {
            action: "creating run directory",
            path: run_dir.clone(),
            source,
        })?;
        let socket = self.socket(id);
        let url = socket_url(id, &socket)?;
        remove_if_exists(&socket)?;
        let secret = fresh_secret();
        let secret_file = self.secret_file(id);
        write_secret_file(&secret_file, &secret)?;
        let (stdout, stderr) = self.output(id)?;
        // What an earlier agentctl of this executor left in its cgroup ends
        // before the new one starts beside it: a process that cleared its
        // environment escapes the new agentctl's reap of its predecessor's
        // tree, and would go on working in the worktree (helper-39 2).
        if let Err(e) = self.kill_cgroup(id).await {
            tracing::warn!(executor_id = %id, error = %e,
                "what the previous agentctl left could not all be ended; launching anyway");
        }
        let group = self.prepare_cgroup(id);

        let mut cmd = tokio::process::Command::new(&self.config.agentctl_path);
        cmd.arg("--executor-id")
            .arg(id.to_string())
            .arg("--workspace")
            .arg(&spec.workspace_path)
            .arg("--listen")
            .arg(format!("unix:{}", socket.display()))
            .arg("--secret-file")
            .arg(&secret_file)
            .arg("--remove-secret-file")
            .arg("--journal")
            .arg(self.journal_file(id))
            .arg("--doorbell")
            .arg(self.config.doorbell_path())
            // Only what the config names: never sessiond's own environment
            // (the secret travels in the file above, not in the environment).
            .env_clear()
            .envs(self.config.env.iter().map(|(k, v)| (k, v)))
            .current_dir(&spec.workspace_path)
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            // Own process group: outlives the backend and its terminal's signals.
            .process_group(0)
            .kill_on_drop(false);
        if let Some(idle) = self.config.idle_timeout {
            // `0ms` is agentctl's "never"; `None` leaves its own default.
            cmd.arg("--idle-timeout")
                .arg(format!("{}ms", idle.as_millis()));
        }

        let started = Instant::now();
        let mut child = cmd.spawn().map_err(|source| Error::Spawn {
            path: self.config.agentctl_path.clone(),
            source,
        })?;
        let pid = child.id().ok_or_else(|| Error::ExitedEarly {
            executor_id: id,
            status: "exited before its pid was read".into(),
            log_hint: String::new(),
        })?;
        // Our unreaped child: its /proc entry cannot be another process yet.
        let start_time = process::start_time(pid).ok_or_else(|| Error::Process {
            pid,
            message: "no /proc entry right after spawn".into(),
        })?;
        // From here on, leaving this function without the handle (an error,
        // or this future being dropped) ends the child.
        let mut guard = SpawnGuard(OwnedProcess::open(pid, start_time));
        // Before it can start anything: agentctl starts no process until we
        // call it, so everything it ever starts is born in the group.
        if let Some(group) = &group
            && let Err(e) = cgroup::enter(group, pid)
        {
            tracing::warn!(executor_id = %id, error = %e, group = %group.display(), "cannot move agentctl into its cgroup; running without one");
            let _ = remove_if_exists(&self.cgroup_record(id));
        }

        let deadline = started + self.config.startup_timeout;
        let mut last_error = String::from("no socket yet");
        let client = AgentctlClient::new(&url, &secret, &self.config.client)?
            .with_lease_epoch(spec.lease_epoch);
        let ready = loop {
            if let Ok(Some(status)) = child.try_wait() {
                let log_hint = self
                    .log_file(id)
                    .map(|p| format!("; see {}", p.display()))
                    .unwrap_or_default();
                let _ = remove_if_exists(&secret_file);
                return Err(Error::ExitedEarly {
                    executor_id: id,
                    status: status.to_string(),
                    log_hint,
                });
            }
            if socket.exists() {
                // Retried until the deadline: the socket may be a stale one
                // nobody listens on until agentctl replaces it.
                match client.verify_identity(id).await {
                    Ok(_) => break true,
                    Err(e) => last_error = e.to_string(),
                }
            }
            if Instant::now() >= deadline {
                break false;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        };
        if !ready {
            // Started by us a moment ago, and the pidfd pins it: safe to end.
            if let Some(proc) = guard.0.take() {
                let _ = proc.terminate(start_time, self.config.stop_grace).await;
            }
            let _ = child.try_wait();
            let _ = remove_if_exists(&secret_file);
            return Err(Error::NotReady {
                executor_id: id,
                timeout: self.config.startup_timeout,
                last_error,
            });
        }
        // Launched: the handle goes to the caller, the process lives on.
        guard.disarm();
        // Dropping the tokio child does not kill it; the runtime reaps it once
        // it exits while this process still lives.
        drop(child);
        tracing::info!(
            executor_id = %id, pid, %url, generation = spec.generation,
            elapsed_ms = started.elapsed().as_millis() as u64, "agentctl launched"
        );
        let mut handle = ExecutorHandle::new(spec, Runtime::LocalStandalone, secret, url);
        handle.pid = Some(pid);
        handle.pid_start_time = Some(start_time);
        Ok(handle)
    }

    /// Runs `agentctl --reap` on the executor's journal: every agent process
    /// tree an agentctl of this executor recorded, and all its processes
    /// (found by the marker they inherit, `setsid` or not), is ended.
    async fn reap(&self, handle: &ExecutorHandle) -> Result<()> {
        let journal = self.journal_file(handle.executor_id);
        if !journal.exists() {
            return Ok(());
        }
        let mut cmd = tokio::process::Command::new(&self.config.agentctl_path);
        cmd.arg("--reap")
            .arg("--executor-id")
            .arg(handle.executor_id.to_string())
            .arg("--workspace")
            .arg(&handle.workspace_path)
            .arg("--journal")
            .arg(&journal)
            .env_clear()
            .envs(self.config.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true);
        let spawn_err = |source| Error::Spawn {
            path: self.config.agentctl_path.clone(),
            source,
        };
        let out = tokio::time::timeout(self.config.startup_timeout, cmd.output())
            .await
            .map_err(|_| Error::Reap {
                executor_id: handle.executor_id,
                message: format!(
                    "agentctl --reap on {} did not finish within {:?}",
                    journal.display(),
                    self.config.startup_timeout
                ),
            })?
            .map_err(spawn_err)?;
        if !out.status.success() {
            return Err(Error::Reap {
                executor_id: handle.executor_id,
                message: format!(
                    "agentctl --reap on {} failed ({}): {}",
                    journal.display(),
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            });
        }
        let ended = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        if ended != "0" {
            tracing::info!(executor_id = %handle.executor_id, ended, "ended processes of a dead agentctl's agent");
        }
        Ok(())
    }

    /// The recorded agentctl, if that very process still runs.
    /// The recorded agentctl, if it still runs: pid and start time match, and
    /// its arguments name this executor. The start time counts in 10 ms
    /// ticks, so two processes started in one tick share it; the executor id
    /// tells them apart.
    fn recorded_process(handle: &ExecutorHandle) -> Option<OwnedProcess> {
        let proc = OwnedProcess::open(handle.pid?, handle.pid_start_time?)?;
        process::has_arguments(
            proc.pid(),
            &["--executor-id", &handle.executor_id.to_string()],
        )
        .then_some(proc)
    }
}

/// Kills a freshly spawned agentctl unless [`Self::disarm`] was called: a
/// launch that does not return its handle (error, or its future dropped) must
/// not leave an agentctl nobody knows the secret of. The pidfd was opened
/// while the process was our unreaped child, so the signal cannot reach
/// another process.
struct SpawnGuard(Option<OwnedProcess>);

impl SpawnGuard {
    fn disarm(&mut self) {
        self.0 = None;
    }
}

impl Drop for SpawnGuard {
    fn drop(&mut self) {
        if let Some(proc) = self.0.take() {
            tracing::warn!(
                pid = proc.pid(),
                "agentctl launch abandoned before it completed; killing the new agentctl"
            );
            // KILL, not TERM: Drop cannot wait for a grace period, and a
            // brand-new agentctl has no agent to stop yet.
            let _ = proc.signal(rustix::process::Signal::KILL);
        }
    }
}

impl StandaloneExecutor {
    /// Brings the executor of a stored handle back in one call: `probe`,
    /// then `start` or `launch` with generation + 1 as the probe says.
    /// Writes no intent: the session manager, which records one, uses the
    /// two phases itself; this is for a driver used on its own.
    pub async fn recover(&self, handle: &ExecutorHandle) -> Result<Recovered> {
        match self.probe(handle).await? {
            Probe::Reattachable { handle, health } => Ok(Recovered {
                handle,
                action: RecoveryAction::Reattached,
                health,
            }),
            Probe::Missing { .. } => Err(Error::WorkspaceMissing {
                executor_id: handle.executor_id,
                path: handle.workspace_path.clone(),
            }),
            Probe::NeedsLaunch { .. } | Probe::NeedsStart { .. } => {
                let new = self.spawn(&handle.relaunch_spec()).await?;
                let health = self.health(&new).await?;
                Ok(Recovered {
                    handle: new,
                    action: RecoveryAction::Relaunched,
                    health,
                })
            }
        }
    }
}

#[async_trait]
impl Executor for StandaloneExecutor {
    fn runtime(&self) -> Runtime {
        Runtime::LocalStandalone
    }

    async fn launch(&self, spec: &LaunchSpec) -> Result<ExecutorHandle> {
        self.spawn(spec).await
    }

    async fn probe(&self, handle: &ExecutorHandle) -> Result<Probe> {
        let id = handle.executor_id;
        if let Some(proc) = Self::recorded_process(handle) {
            match self.health(handle).await {
                Ok(health) if health.pid == 0 || Some(health.pid) == handle.pid => {
                    tracing::info!(executor_id = %id, pid = proc.pid(), "recorded agentctl runs and proved its identity");
                    return Ok(Probe::Reattachable {
                        handle: handle.clone(),
                        health,
                    });
                }
                // Not hung: it answered that another replica owns it now.
                // Ending it would kill the new owner's agentctl.
                Err(e @ Error::StaleEpoch { .. }) => return Err(e),
                outcome => {
                    // pid and start time match: this is the process we started,
                    // but it does not answer as it should. End it, so that the
                    // launch that follows leaves exactly one agentctl.
                    let reason = match outcome {
                        Ok(h) => format!("Health reports pid {}", h.pid),
                        Err(e) => e.to_string(),
                    };
                    tracing::warn!(executor_id = %id, pid = proc.pid(), %reason, "recorded agentctl unhealthy, ending it");
                    if let Some(start_time) = handle.pid_start_time {
                        proc.terminate(start_time, self.config.stop_grace).await?;
                    }
                    if !handle.workspace_path.is_dir() {
                        return Ok(Probe::Missing {
                            reason: missing_worktree(handle),
                        });
                    }
                    return Ok(Probe::NeedsLaunch {
                        reason: format!(
                            "the recorded agentctl (pid {}) was hung and has been ended: {reason}",
                            proc.pid()
                        ),
                    });
                }
            }
        }
        if !handle.workspace_path.is_dir() {
            return Ok(Probe::Missing {
                reason: missing_worktree(handle),
            });
        }
        let reason = match handle.pid {
            Some(pid) => format!(
                "the recorded agentctl (pid {pid}) is gone, or its pid now belongs to another process"
            ),
            None => "no agentctl process is recorded".to_owned(),
        };
        tracing::info!(executor_id = %id, %reason, "agentctl needs a launch");
        Ok(Probe::NeedsLaunch { reason })
    }

    async fn stop(&self, handle: &ExecutorHandle) -> Result<()> {
        if let (Some(proc), Some(start_time)) =
            (Self::recorded_process(handle), handle.pid_start_time)
        {
            proc.terminate(start_time, self.config.stop_grace).await?;
        }
        // A live agentctl ended its agent's tree as it stopped; a dead one
        // (kill -9, OOM) could not, and what the agent started (`setsid`
        // included) still runs: end it through the journal's record, and
        // the cgroup catches what even cleared its environment.
        self.reap(handle).await?;
        self.kill_cgroup(handle.executor_id).await
    }

    async fn remove(&self, handle: &ExecutorHandle) -> Result<()> {
        self.stop(handle).await?;
        remove_if_exists(&self.journal_file(handle.executor_id))?;
        // agentctl's lease epoch, kept beside its journal.
        let mut epoch = self.journal_file(handle.executor_id).into_os_string();
        epoch.push(".epoch");
        remove_if_exists(&PathBuf::from(epoch))?;
        remove_if_exists(&self.secret_file(handle.executor_id))?;
        remove_if_exists(&self.socket(handle.executor_id))
    }

    async fn worktree(
        &self,
        target: &crate::WorktreeTarget,
        op: crate::WorktreeOp,
    ) -> Result<crate::WorktreeAnswer> {
        crate::worktree::run_local(
            &self.config.agentctl_path,
            &self.config.env,
            target,
            op,
            None,
        )
        .await
    }

    fn client(&self, handle: &ExecutorHandle) -> Result<AgentctlClient> {
        Ok(AgentctlClient::new(
            &handle.agentctl_url,
            &handle.auth_secret,
            &self.config.client,
        )?
        .with_lease_epoch(handle.lease_epoch))
    }
}

fn missing_worktree(handle: &ExecutorHandle) -> String {
    format!(
        "the worktree {} is missing",
        handle.workspace_path.display()
    )
}

/// `path` made absolute against the current directory (agentctl and the
/// URL must not depend on where they are resolved).
pub(crate) fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_owned())
}

/// The longest Unix socket path Linux accepts (`sun_path` minus its NUL).
const MAX_SOCKET_PATH: usize = 107;

/// `unix://<socket>`, or a configuration error naming the path when it is
/// too long to bind.
pub(crate) fn socket_url(executor_id: ExecutorId, socket: &Path) -> Result<String> {
    let len = socket.as_os_str().len();
    if len > MAX_SOCKET_PATH {
        return Err(Error::Config(format!(
            "executor {executor_id}: the agentctl socket {} is {len} bytes long, more than \
             the {MAX_SOCKET_PATH} a Unix socket path may have; configure a shorter run directory",
            socket.display()
        )));
    }
    Ok(format!("unix://{}", socket.display()))
}

/// Writes `secret` to `path`, readable by its owner only, replacing any
/// older file there.
pub(crate) fn write_secret_file(path: &Path, secret: &str) -> Result<()> {
    use std::{io::Write, os::unix::fs::OpenOptionsExt};
    remove_if_exists(path)?;
    let io_err = |source| Error::Io {
        action: "writing agentctl secret",
        path: path.to_owned(),
        source,
    };
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(io_err)?;
    file.write_all(secret.as_bytes()).map_err(io_err)?;
    Ok(())
}

pub(crate) fn remove_if_exists(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::Io {
            action: "removing",
            path: path.to_owned(),
            source: e,
        }),
        _ => Ok(()),
    }
}
