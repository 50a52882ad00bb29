//! A third-party executor driver: agentctl started through a wrapper
//! command (`nice -n 5`, `setsid`, `systemd-run --user --scope`, `sudo -u
//! agent`, ... anything that ends by exec'ing the command it is given).
//!
//! It implements [`Executor`] from the outside, with only the public API of
//! `sessiond-executor`: launch, probe (reattach or relaunch), stop,
//! remove, client. It serves a runtime of its own name
//! ([`WrapperConfig::runtime`], e.g. `wrapper`), which clients pick with
//! `CreateSession.runtime_name`. The recovery step machine of
//! `sessiond-engine` drives it exactly as it drives the built-in drivers:
//! it persists the intent (`starting`, generation + 1) before calling
//! [`Executor::launch`], and after a backend restart calls
//! [`Executor::probe`] and then reattaches, or launches anew when the probe
//! says so.
//!
//! Shared by the `custom_executor` example and its integration test
//! (`tests/server/embedding.rs`).

use std::{
    path::{Path, PathBuf},
    process::Stdio,
    time::{Duration, Instant},
};

use async_trait::async_trait;
use sessiond_domain::{ExecutorId, Runtime};
use sessiond_executor::{
    AgentctlClient, ClientConfig, Error, Executor, ExecutorHandle, LaunchSpec, Probe, Result,
    fresh_secret,
    process::{self, OwnedProcess},
};

/// Configuration of [`WrapperExecutor`].
#[derive(Debug, Clone)]
pub struct WrapperConfig {
    /// The runtime it serves: a name of its own (`Runtime::Custom`), or a
    /// built-in runtime whose driver it replaces.
    pub runtime: Runtime,
    /// The wrapper and its arguments; agentctl and its arguments follow.
    pub wrapper: Vec<String>,
    /// The agentctl binary.
    pub agentctl: PathBuf,
    /// Sockets, secrets, journals and logs, one set per executor.
    pub run_dir: PathBuf,
    /// agentctl's whole environment.
    pub env: Vec<(String, String)>,
    /// Client settings for agentctl calls.
    pub client: ClientConfig,
    /// How long a launched agentctl gets to answer `Health`.
    pub startup_timeout: Duration,
}

/// Runs agentctl through [`WrapperConfig::wrapper`], for the runtime
/// [`WrapperConfig::runtime`] names.
#[derive(Debug, Clone)]
pub struct WrapperExecutor {
    config: WrapperConfig,
}

impl WrapperExecutor {
    /// A driver with `config`.
    pub fn new(config: WrapperConfig) -> Self {
        Self { config }
    }

    fn file(&self, id: ExecutorId, ext: &str) -> PathBuf {
        self.config.run_dir.join(format!("{id}.{ext}"))
    }

    /// The recorded agentctl, when that very process (pid and start time)
    /// still runs: a reused pid is never trusted, never signalled.
    fn recorded(handle: &ExecutorHandle) -> Option<OwnedProcess> {
        OwnedProcess::open(handle.pid?, handle.pid_start_time?)
    }

    async fn spawn(&self, spec: &LaunchSpec) -> Result<ExecutorHandle> {
        let id = spec.executor_id;
        if !spec.workspace_path.is_dir() {
            return Err(Error::WorkspaceMissing {
                executor_id: id,
                path: spec.workspace_path.clone(),
            });
        }
        let io = |action: &'static str, path: &Path| {
            let path = path.to_owned();
            move |source| Error::Io {
                action,
                path,
                source,
            }
        };
        std::fs::create_dir_all(&self.config.run_dir)
            .map_err(io("creating", &self.config.run_dir))?;
        let socket = self.file(id, "sock");
        let _ = std::fs::remove_file(&socket);
        let url = format!("unix://{}", socket.display());
        let secret = fresh_secret();
        let secret_file = self.file(id, "secret");
        let _ = std::fs::remove_file(&secret_file);
        {
            use std::{io::Write, os::unix::fs::OpenOptionsExt};
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&secret_file)
                .map_err(io("writing", &secret_file))?;
            f.write_all(secret.as_bytes())
                .map_err(io("writing", &secret_file))?;
        }
        let log = self.file(id, "log");
        let out = std::fs::File::create(&log).map_err(io("creating", &log))?;
        let err = out.try_clone().map_err(io("creating", &log))?;

        let (program, wrapper_args) = self
            .config
            .wrapper
            .split_first()
            .ok_or_else(|| Error::Config("the wrapper command is empty".into()))?;
        let mut cmd = tokio::process::Command::new(program);
        cmd.args(wrapper_args)
            .arg(&self.config.agentctl)
            .arg("--executor-id")
            .arg(id.to_string())
            .arg("--workspace")
            .arg(&spec.workspace_path)
            .arg("--listen")
            .arg(format!("unix:{}", socket.display()))
            .arg("--secret-file")
            .arg(&secret_file)
            .arg("--remove-secret-file")
            .arg("--journal")
            .arg(self.file(id, "journal"))
            .env_clear()
            .envs(self.config.env.iter().map(|(k, v)| (k, v)))
            .current_dir(&spec.workspace_path)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            // Its own process group: it outlives the backend.
            .process_group(0)
            .kill_on_drop(false);
        let mut child = cmd.spawn().map_err(|source| Error::Spawn {
            path: PathBuf::from(program),
            source,
        })?;

        // agentctl says which process it is: with a wrapper that forks, that
        // is not the child we spawned. Its pid and start time identify it
        // after a restart of the backend.
        let client = AgentctlClient::new(&url, &secret, &self.config.client)?;
        let deadline = Instant::now() + self.config.startup_timeout;
        let mut last_error = "no socket yet".to_owned();
        let health = loop {
            if let Ok(Some(status)) = child.try_wait() {
                // A wrapper that forks and exits 0 is fine; anything else is not.
                if !status.success() {
                    let _ = std::fs::remove_file(&secret_file);
                    return Err(Error::ExitedEarly {
                        executor_id: id,
                        status: status.to_string(),
                        log_hint: format!("; see {}", log.display()),
                    });
                }
            }
            if socket.exists() {
                match client.verify_identity(id).await {
                    Ok(health) => break health,
                    Err(e) => last_error = e.to_string(),
                }
            }
            if Instant::now() >= deadline {
                // Whatever we started: end it, nobody will know its secret.
                let _ = child.start_kill();
                let _ = std::fs::remove_file(&secret_file);
                return Err(Error::NotReady {
                    executor_id: id,
                    timeout: self.config.startup_timeout,
                    last_error,
                });
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        };
        let start_time = process::start_time(health.pid).ok_or_else(|| Error::Process {
            pid: health.pid,
            message: "agentctl reported a pid with no /proc entry".into(),
        })?;
        drop(child);
        Ok(ExecutorHandle {
            executor_id: id,
            session_id: spec.session_id,
            task_id: spec.task_id,
            runtime: self.config.runtime,
            workspace_path: spec.workspace_path.clone(),
            generation: spec.generation,
            auth_secret: secret,
            agentctl_url: url,
            agentctl_port: None,
            pid: Some(health.pid),
            pid_start_time: Some(start_time),
            container_id: None,
            // A fresh launch: the owner's epoch is sent once it is recorded.
            lease_epoch: None,
        })
    }
}

#[async_trait]
impl Executor for WrapperExecutor {
    fn runtime(&self) -> Runtime {
        self.config.runtime
    }

    async fn launch(&self, spec: &LaunchSpec) -> Result<ExecutorHandle> {
        self.spawn(spec).await
    }

    async fn probe(&self, handle: &ExecutorHandle) -> Result<Probe> {
        if let Some(proc) = Self::recorded(handle) {
            match self.health(handle).await {
                Ok(health) if Some(health.pid) == handle.pid => {
                    return Ok(Probe::Reattachable {
                        handle: handle.clone(),
                        health,
                    });
                }
                outcome => {
                    // Ours (pid and start time match) but not answering: end
                    // it, so the launch that follows leaves one agentctl.
                    if let Some(start_time) = handle.pid_start_time {
                        proc.terminate(start_time, Duration::from_secs(2)).await?;
                    }
                    if !handle.workspace_path.is_dir() {
                        return Ok(Probe::Missing {
                            reason: format!(
                                "the worktree {} is missing",
                                handle.workspace_path.display()
                            ),
                        });
                    }
                    return Ok(Probe::NeedsLaunch {
                        reason: format!(
                            "the recorded agentctl was hung and has been ended: {outcome:?}"
                        ),
                    });
                }
            }
        }
        if !handle.workspace_path.is_dir() {
            return Ok(Probe::Missing {
                reason: format!(
                    "the worktree {} is missing",
                    handle.workspace_path.display()
                ),
            });
        }
        Ok(Probe::NeedsLaunch {
            reason: "the recorded agentctl is gone".into(),
        })
    }

    async fn stop(&self, handle: &ExecutorHandle) -> Result<()> {
        if let (Some(proc), Some(start_time)) = (Self::recorded(handle), handle.pid_start_time) {
            proc.terminate(start_time, Duration::from_secs(2)).await?;
        }
        Ok(())
    }

    async fn remove(&self, handle: &ExecutorHandle) -> Result<()> {
        self.stop(handle).await?;
        for ext in ["journal", "secret", "sock"] {
            let _ = std::fs::remove_file(self.file(handle.executor_id, ext));
        }
        Ok(())
    }

    fn client(&self, handle: &ExecutorHandle) -> Result<AgentctlClient> {
        AgentctlClient::new(
            &handle.agentctl_url,
            &handle.auth_secret,
            &self.config.client,
        )
    }
}
