//! `local_docker`: agentctl inside a local container, through bollard.
//!
//! The container is named `sessiond-<executor_id>` and labelled
//! `sessiond.executor_id`, `sessiond.session_id`, `sessiond.task_id`; the
//! worktree is bind-mounted at [`DockerConfig::container_workspace`] and a
//! per-executor run directory (`<run_dir>/<executor_id>`, mode 0700) at
//! `/run/sessiond`, where agentctl listens on the Unix socket
//! `agentctl.sock`: the backend needs no network to reach it, so the
//! container's network is only what its agent needs ([`DockerConfig::network_mode`],
//! `none` by default; `host` is refused, since a container on the host's
//! network namespace sees every session's and the backend's loopback traffic).
//!
//! **The container is a boundary** (`DockerExecutor::create_body`): it runs
//! as a non-root user (the worktree owner's uid:gid unless configured), with
//! every capability dropped, `no-new-privileges`, a read-only root filesystem
//! (writable: the worktree, the run directory, a tmpfs at `/tmp`), and the
//! configured pids / memory / CPU limits. The secret is never in the
//! container's environment: the driver keeps it in `<run_dir>/<executor_id>.secret`
//! (host only, mode 0600) and, right before each start, puts a copy at
//! `/run/sessiond/secret`, which agentctl reads and unlinks before any agent
//! runs; agentctl is also non-dumpable, so the agent (same user, no
//! capabilities) can read neither the file nor agentctl's memory.
//!
//! **Worktrees sessiond creates** ([`LaunchSpec::repository`]) are made on
//! this host by `agentctl worktree` (as the container's user when the
//! driver runs as root), and mounted at their own path, not at
//! `container_workspace`, together with the repository's git directory at
//! its own path: a linked worktree's `.git` file and the repository's
//! record of it name each other by absolute host path, so git inside the
//! container works only where those paths hold. The repository's `config`
//! and `hooks` are mounted read-only over it: the agent commits through the
//! shared object store, but cannot plant what the user's own git would run.
//!
//! **Launch** creates the container; when the name is taken (a concurrent
//! launch, or a crash between create and persist) it adopts the existing
//! container instead, so one executor never gets two containers. It then
//! starts it and waits for `Health` to answer with the executor id.
//!
//! **Probe** finds the container by the recorded id, then by the
//! `sessiond.executor_id` label, and starts nothing: running → health check
//! ([`Probe::Reattachable`], with the container's current port and secret);
//! exited, created or paused → [`Probe::NeedsStart`]; missing (or the
//! worktree is gone) → [`Probe::Missing`]. **Start** starts (or unpauses) the
//! stopped container, waits for health and returns the handle with the
//! generation the caller recorded with its intent. **Recover** is probe, then
//! start with generation + 1 ([`RecoveryAction::Restarted`]);
//! missing → [`Error::ContainerMissing`]. **Stop** stops the container (it can
//! be recovered later); **remove** removes it, its run directory and its
//! secret.

use std::{
    collections::HashMap,
    os::unix::fs::{MetadataExt, PermissionsExt},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use async_trait::async_trait;
use bollard::{
    API_DEFAULT_VERSION, Docker,
    errors::Error as BollardError,
    models::{ContainerCreateBody, ContainerInspectResponse, ContainerStateStatusEnum, HostConfig},
    query_parameters::{
        CreateContainerOptions, InspectContainerOptions, ListContainersOptions,
        RemoveContainerOptions, StartContainerOptions, StopContainerOptions,
    },
};
use sessiond_domain::{ExecutorId, Runtime};

use crate::{
    AgentctlClient, ClientConfig, Executor, ExecutorHandle, Health, LaunchSpec, Probe, Recovered,
    RecoveryAction, WorktreeAnswer, WorktreeOp, WorktreeTarget,
    error::{Error, Result},
    fresh_secret,
    standalone::{absolute, remove_if_exists, socket_url, write_secret_file},
};

/// Label holding the executor id.
pub const LABEL_EXECUTOR_ID: &str = "sessiond.executor_id";
/// Label holding the session id.
pub const LABEL_SESSION_ID: &str = "sessiond.session_id";
/// Label holding the task id.
pub const LABEL_TASK_ID: &str = "sessiond.task_id";
/// Where the run directory is mounted inside the container.
pub const CONTAINER_RUN_DIR: &str = "/run/sessiond";
/// agentctl's socket, in the run directory.
const SOCKET_NAME: &str = "agentctl.sock";
/// The one-shot copy of the secret agentctl consumes, in the run directory.
const SECRET_NAME: &str = "secret";
/// `HOME` of the agent: in the run directory, so what an agent keeps there
/// (its own session files) survives a container restart.
pub const CONTAINER_HOME: &str = "/run/sessiond/home";

/// How long a create waits for the engine's ping ([`Executor::check_ready`]).
const ENGINE_PING_TIMEOUT: Duration = Duration::from_secs(5);

/// The deterministic container name of an executor.
pub fn container_name(executor_id: ExecutorId) -> String {
    format!("sessiond-{executor_id}")
}

/// Resource limits of an executor's container; `None` leaves the engine default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResourceLimits {
    /// Memory limit in bytes (Docker `--memory`).
    pub memory_bytes: Option<i64>,
    /// CPUs in units of 10^-9 (1.5 CPUs = 1_500_000_000).
    pub nano_cpus: Option<i64>,
    /// Most processes the container may hold (Docker `--pids-limit`);
    /// [`DockerConfig::new`] sets 1024 against fork bombs.
    pub pids_limit: Option<i64>,
}

/// Configuration of the Docker driver.
#[derive(Debug, Clone)]
pub struct DockerConfig {
    /// Engine address: `unix:///path/to/docker.sock` or `tcp://host:port`.
    pub docker_host: String,
    /// Image holding agentctl (and the agents), e.g. `sessiond-agentctl:dev`.
    pub image: String,
    /// agentctl inside the image.
    pub agentctl_path: String,
    /// The container's network: `none` by default (agentctl is reached over
    /// its socket, so only the agent could want a network), a user-defined
    /// network's name, or `bridge`. `host` (and `container:<id>`) is refused.
    pub network_mode: String,
    /// Memory, CPU and process limits of every container.
    pub limits: ResourceLimits,
    /// Where the worktree is mounted inside the container.
    pub container_workspace: String,
    /// `uid[:gid]` to run as inside the container; the worktree owner's
    /// uid:gid when unset. Never root.
    pub user: Option<String>,
    /// Size of the tmpfs at `/tmp` (the root filesystem is read-only).
    pub tmp_size_bytes: u64,
    /// Host directory for per-executor run directories (sockets, secrets,
    /// the agent's `HOME`). Kept short: a socket path has at most 107 bytes.
    pub run_dir: PathBuf,
    /// Passed as `--idle-timeout`.
    pub idle_timeout: Option<Duration>,
    /// Limit for agentctl to answer `Health` after a start.
    pub startup_timeout: Duration,
    /// Between TERM and KILL when stopping the container.
    pub stop_grace: Duration,
    /// Timeout of each Docker API call.
    pub api_timeout: Duration,
    /// How the driver's agentctl clients connect and time out.
    pub client: ClientConfig,
    /// More environment for agentctl in the container (its trace export
    /// settings), beside `HOME`; never its secret.
    pub env: Vec<(String, String)>,
    /// agentctl on this host, which makes and inspects the worktrees
    /// sessiond creates for Docker sessions (`agentctl worktree`); `None`:
    /// Docker sessions name a directory they were given.
    pub host_agentctl: Option<PathBuf>,
    /// The environment of `host_agentctl` (`PATH`, to find git).
    pub host_env: Vec<(String, String)>,
}

impl DockerConfig {
    /// A configuration with the defaults: agentctl at
    /// `/usr/local/bin/agentctl`, network `none`, 1024 pids, worktree at
    /// `/workspace`, 256 MiB `/tmp`, 15 s startup, 5 s stop grace, 30 s per
    /// Docker API call.
    pub fn new(docker_host: impl Into<String>, image: impl Into<String>, run_dir: PathBuf) -> Self {
        Self {
            docker_host: docker_host.into(),
            image: image.into(),
            agentctl_path: "/usr/local/bin/agentctl".into(),
            network_mode: "none".into(),
            limits: ResourceLimits {
                pids_limit: Some(1024),
                ..ResourceLimits::default()
            },
            container_workspace: "/workspace".into(),
            user: None,
            tmp_size_bytes: 256 << 20,
            run_dir,
            idle_timeout: None,
            startup_timeout: Duration::from_secs(15),
            stop_grace: Duration::from_secs(5),
            api_timeout: Duration::from_secs(30),
            client: ClientConfig::default(),
            env: Vec::new(),
            host_agentctl: None,
            host_env: vec![("PATH".into(), "/usr/local/bin:/usr/bin:/bin".into())],
        }
    }
}

/// The Docker driver ([`Runtime::LocalDocker`]): agentctl in one container
/// per executor, named by [`container_name`] and labelled with its ids, the
/// worktree bind-mounted; found again by container id, else by label.
#[derive(Debug, Clone)]
pub struct DockerExecutor {
    /// The negotiated connection, made on first use (see
    /// [`DockerExecutor::engine`]): the driver exists while the engine is
    /// down, and its calls fail as `Error::Docker` until the engine answers.
    negotiated: tokio::sync::OnceCell<Docker>,
    config: DockerConfig,
}

/// A container carrying the `sessiond.executor_id` label, as listed by
/// [`DockerExecutor::labelled_containers`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabelledContainer {
    /// The container's full id.
    pub id: String,
    /// `running`, `exited`, `created`, ... as the engine reports it.
    pub state: String,
    /// All its labels (`sessiond.executor_id`, `sessiond.session_id`, ...).
    pub labels: HashMap<String, String>,
}

impl LabelledContainer {
    /// The value of the `sessiond.executor_id` label.
    pub fn executor_id(&self) -> Option<&str> {
        self.labels.get(LABEL_EXECUTOR_ID).map(String::as_str)
    }

    /// The value of the `sessiond.session_id` label.
    pub fn session_id(&self) -> Option<&str> {
        self.labels.get(LABEL_SESSION_ID).map(String::as_str)
    }
}

/// What the driver needs to know about one container.
#[derive(Debug)]
struct Found {
    id: String,
    status: ContainerStateStatusEnum,
}

impl DockerExecutor {
    /// Connects to the engine and negotiates the API version (the engines
    /// here speak older versions than bollard's default); fails when the
    /// engine does not answer. See [`DockerExecutor::new`] for a driver that
    /// waits for its engine.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a malformed `docker_host`, [`Error::Docker`]
    /// when the engine does not answer.
    pub async fn connect(config: DockerConfig) -> Result<Self> {
        let driver = Self::new(config)?;
        driver.engine().await?;
        Ok(driver)
    }

    /// The driver without contacting the engine (only the address's form
    /// is checked; a socket that is not there yet is fine): the connection
    /// is made and the version negotiated on the first call that reaches
    /// the engine, so a backend starts while Docker is down and its Docker
    /// executors work again once the engine answers.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] when `docker_host` is not `unix://`, `tcp://`,
    /// `http://` or an absolute socket path.
    pub fn new(config: DockerConfig) -> Result<Self> {
        let host = config.docker_host.as_str();
        let known = host.starts_with("unix://")
            || host.starts_with('/')
            || host.starts_with("tcp://")
            || host.starts_with("http://");
        if !known {
            return Err(Error::Config(format!(
                "docker_host {host:?}: expected unix:// or tcp://"
            )));
        }
        Ok(Self {
            negotiated: tokio::sync::OnceCell::new(),
            config,
        })
    }

    /// The engine connection with its negotiated API version; connects and
    /// negotiates on the first call (again after a failure: the engine may
    /// be back).
    pub async fn engine(&self) -> Result<&Docker> {
        self.negotiated
            .get_or_try_init(|| async {
                let timeout = self.config.api_timeout.as_secs().max(1);
                let host = self.config.docker_host.as_str();
                let docker = if host.starts_with("unix://") || host.starts_with('/') {
                    Docker::connect_with_unix(host, timeout, API_DEFAULT_VERSION)?
                } else {
                    Docker::connect_with_http(host, timeout, API_DEFAULT_VERSION)?
                };
                Ok::<_, Error>(docker.negotiate_version().await?)
            })
            .await
    }

    /// The engine connection, for callers that need more than the trait;
    /// `None` until a call reached the engine (always `Some` after
    /// [`DockerExecutor::connect`]).
    pub fn docker(&self) -> Option<&Docker> {
        self.negotiated.get()
    }

    /// Ids of every container (running or not) labelled with `executor_id`.
    pub async fn containers_of(&self, executor_id: ExecutorId) -> Result<Vec<String>> {
        let filters = HashMap::from([(
            "label".to_owned(),
            vec![format!("{LABEL_EXECUTOR_ID}={executor_id}")],
        )]);
        let options = ListContainersOptions {
            all: true,
            filters: Some(filters),
            ..Default::default()
        };
        let list = self.engine().await?.list_containers(Some(options)).await?;
        Ok(list.into_iter().filter_map(|c| c.id).collect())
    }

    /// Every container (running or not) that carries the
    /// `sessiond.executor_id` label, with its labels and state: what an
    /// orphan sweep looks at. Containers without our label are not listed.
    pub async fn labelled_containers(&self) -> Result<Vec<LabelledContainer>> {
        let filters = HashMap::from([("label".to_owned(), vec![LABEL_EXECUTOR_ID.to_owned()])]);
        let options = ListContainersOptions {
            all: true,
            filters: Some(filters),
            ..Default::default()
        };
        let list = self.engine().await?.list_containers(Some(options)).await?;
        Ok(list
            .into_iter()
            .filter_map(|c| {
                let labels = c.labels.unwrap_or_default();
                labels
                    .contains_key(LABEL_EXECUTOR_ID)
                    .then(|| LabelledContainer {
                        id: c.id.unwrap_or_default(),
                        state: c.state.map(|s| s.to_string()).unwrap_or_default(),
                        labels,
                    })
            })
            .filter(|c| !c.id.is_empty())
            .collect())
    }

    /// Removes one container by id (forced; a container that is already
    /// gone is a success). Unlike [`Executor::remove`] it touches no other
    /// container of the same executor and no run directory.
    pub async fn remove_container(&self, container_id: &str) -> Result<()> {
        let options = RemoveContainerOptions {
            force: true,
            v: true,
            ..Default::default()
        };
        match self
            .engine()
            .await?
            .remove_container(container_id, Some(options))
            .await
        {
            Ok(())
            | Err(BollardError::DockerResponseServerError {
                status_code: 404, ..
            }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    fn run_dir(&self, executor_id: ExecutorId) -> PathBuf {
        absolute(&self.config.run_dir).join(executor_id.to_string())
    }

    fn socket(&self, executor_id: ExecutorId) -> PathBuf {
        self.run_dir(executor_id).join(SOCKET_NAME)
    }

    /// The host-only copy of the executor's secret (not mounted).
    fn host_secret_file(&self, executor_id: ExecutorId) -> PathBuf {
        absolute(&self.config.run_dir).join(format!("{executor_id}.secret"))
    }

    fn url(&self, executor_id: ExecutorId) -> Result<String> {
        socket_url(executor_id, &self.socket(executor_id))
    }

    /// The executor's secret: the one already kept for it, else a fresh one.
    /// Published with `link`, which fails when the file exists, so two
    /// concurrent launches of one executor agree on one secret.
    fn executor_secret(&self, executor_id: ExecutorId) -> Result<String> {
        let path = self.host_secret_file(executor_id);
        if let Some(secret) = read_secret(&path)? {
            return Ok(secret);
        }
        let tmp = path.with_extension(format!("secret.{}", uuid::Uuid::new_v4().simple()));
        write_secret_file(&tmp, &fresh_secret())?;
        let linked = std::fs::hard_link(&tmp, &path);
        remove_if_exists(&tmp)?;
        match linked {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(source) => {
                return Err(Error::Io {
                    action: "keeping the executor secret",
                    path,
                    source,
                });
            }
        }
        read_secret(&path)?.ok_or_else(|| Error::Io {
            action: "reading the executor secret",
            path: path.clone(),
            source: std::io::ErrorKind::NotFound.into(),
        })
    }

    /// The secret of a container found by probe or adoption: the kept one,
    /// else what the record says.
    fn secret_of(&self, handle: &ExecutorHandle) -> Result<String> {
        Ok(read_secret(&self.host_secret_file(handle.executor_id))?
            .unwrap_or_else(|| handle.auth_secret.clone()))
    }

    /// `uid:gid` the container runs as: the configured user, else the
    /// worktree's owner. Root is refused: the container is a boundary.
    fn user_for(
        &self,
        executor_id: ExecutorId,
        workspace: &Path,
    ) -> Result<(String, Option<(u32, u32)>)> {
        let (user, ids) = match &self.config.user {
            Some(user) => (user.clone(), parse_ids(user)),
            None => {
                let meta = std::fs::metadata(workspace).map_err(|source| Error::Io {
                    action: "reading the worktree's owner",
                    path: workspace.to_owned(),
                    source,
                })?;
                (
                    format!("{}:{}", meta.uid(), meta.gid()),
                    Some((meta.uid(), meta.gid())),
                )
            }
        };
        let is_root = match ids {
            Some((uid, _)) => uid == 0,
            None => user.split(':').next() == Some("root"),
        };
        if is_root {
            return Err(Error::Config(format!(
                "executor {executor_id}: the container would run as root ({user}{}); containers \
                 never do: chown the worktree to the user the agent should run as, or set \
                 executors.docker.user to a non-root uid:gid",
                if self.config.user.is_none() {
                    format!(", the owner of {}", workspace.display())
                } else {
                    String::new()
                }
            )));
        }
        Ok((user, ids))
    }

    /// Creates the run directory (mode 0700, owned by the container's user
    /// so agentctl can create its socket and unlink the secret there) and
    /// the agent's `HOME` in it.
    fn prepare_run_dir(&self, executor_id: ExecutorId, ids: Option<(u32, u32)>) -> Result<()> {
        let dir = self.run_dir(executor_id);
        let home = dir.join("home");
        for d in [&dir, &home] {
            std::fs::create_dir_all(d).map_err(|source| Error::Io {
                action: "creating run directory",
                path: d.clone(),
                source,
            })?;
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700)).map_err(
                |source| Error::Io {
                    action: "restricting run directory",
                    path: d.clone(),
                    source,
                },
            )?;
            chown_to(d, ids)?;
        }
        Ok(())
    }

    /// Puts the one-shot copy of the secret where agentctl reads (and then
    /// unlinks) it; only right before the container starts, never while an
    /// agent runs.
    fn hand_over_secret(
        &self,
        executor_id: ExecutorId,
        secret: &str,
        ids: Option<(u32, u32)>,
    ) -> Result<()> {
        let path = self.run_dir(executor_id).join(SECRET_NAME);
        write_secret_file(&path, secret)?;
        chown_to(&path, ids)
    }

    /// `git_binds`: the repository's git directory of a worktree sessiond
    /// created, which is then mounted at its own path (see the module
    /// documentation); empty for a directory the caller made.
    fn create_body(
        &self,
        spec: &LaunchSpec,
        user: String,
        git_binds: Vec<String>,
    ) -> ContainerCreateBody {
        let id = spec.executor_id;
        let c = &self.config;
        let workspace = if git_binds.is_empty() {
            c.container_workspace.clone()
        } else {
            spec.workspace_path.display().to_string()
        };
        let mut cmd = vec![
            c.agentctl_path.clone(),
            "--executor-id".into(),
            id.to_string(),
            "--workspace".into(),
            workspace.clone(),
            "--listen".into(),
            format!("unix:{CONTAINER_RUN_DIR}/{SOCKET_NAME}"),
            "--secret-file".into(),
            format!("{CONTAINER_RUN_DIR}/{SECRET_NAME}"),
            "--remove-secret-file".into(),
            // In the run directory on the host: it outlives the container,
            // so a relaunched agentctl knows what the last one did.
            "--journal".into(),
            format!("{CONTAINER_RUN_DIR}/journal"),
        ];
        if let Some(idle) = c.idle_timeout {
            // `0ms` is agentctl's "never"; `None` leaves its own default.
            cmd.extend(["--idle-timeout".into(), format!("{}ms", idle.as_millis())]);
        }

        let labels = HashMap::from([
            (LABEL_EXECUTOR_ID.to_owned(), id.to_string()),
            (LABEL_SESSION_ID.to_owned(), spec.session_id.to_string()),
            (LABEL_TASK_ID.to_owned(), spec.task_id.to_string()),
        ]);
        let mut binds = vec![
            format!("{}:{workspace}", spec.workspace_path.display()),
            format!("{}:{CONTAINER_RUN_DIR}", self.run_dir(id).display()),
        ];
        binds.extend(git_binds);
        let tmpfs = HashMap::from([(
            "/tmp".to_owned(),
            format!("rw,nosuid,nodev,mode=1777,size={}", c.tmp_size_bytes),
        )]);
        ContainerCreateBody {
            image: Some(spec.image.clone().unwrap_or_else(|| c.image.clone())),
            cmd: Some(cmd),
            // Never the secret (a file agentctl unlinks, see above).
            env: Some(
                std::iter::once(format!("HOME={CONTAINER_HOME}"))
                    .chain(c.env.iter().map(|(k, v)| format!("{k}={v}")))
                    .collect(),
            ),
            labels: Some(labels),
            working_dir: Some(workspace),
            user: Some(user),
            host_config: Some(HostConfig {
                network_mode: Some(c.network_mode.clone()),
                binds: Some(binds),
                tmpfs: Some(tmpfs),
                readonly_rootfs: Some(true),
                cap_drop: Some(vec!["ALL".into()]),
                security_opt: Some(vec!["no-new-privileges".into()]),
                memory: c.limits.memory_bytes,
                nano_cpus: c.limits.nano_cpus,
                pids_limit: c.limits.pids_limit,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// The container by id, `None` when the engine does not know it.
    async fn inspect(&self, id_or_name: &str) -> Result<Option<Found>> {
        match self
            .engine()
            .await?
            .inspect_container(id_or_name, None::<InspectContainerOptions>)
            .await
        {
            Ok(info) => Ok(Some(found(info))),
            Err(BollardError::DockerResponseServerError {
                status_code: 404, ..
            }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Recorded id first, then the executor label.
    async fn locate(&self, handle: &ExecutorHandle) -> Result<Option<Found>> {
        if let Some(id) = &handle.container_id
            && let Some(found) = self.inspect(id).await?
        {
            return Ok(Some(found));
        }
        for id in self.containers_of(handle.executor_id).await? {
            if let Some(found) = self.inspect(&id).await? {
                return Ok(Some(found));
            }
        }
        Ok(None)
    }

    async fn start_container(&self, container_id: &str) -> Result<()> {
        // 304 (already started, e.g. by a concurrent launch) is a success for bollard.
        self.engine()
            .await?
            .start_container(container_id, None::<StartContainerOptions>)
            .await?;
        Ok(())
    }

    /// Waits for agentctl in the container to answer `Health` with the
    /// executor id on its socket; `epoch`: the lease epoch to send (a
    /// reattach's first call fences the previous owner off).
    async fn wait_ready(
        &self,
        executor_id: ExecutorId,
        container_id: &str,
        secret: &str,
        epoch: Option<i64>,
    ) -> Result<Health> {
        let started = Instant::now();
        let deadline = started + self.config.startup_timeout;
        let socket = self.socket(executor_id);
        let client = AgentctlClient::new(&self.url(executor_id)?, secret, &self.config.client)?
            .with_lease_epoch(epoch);
        let mut last_error = String::from("no socket yet");
        loop {
            // A socket left by the previous start refuses connections until
            // agentctl replaces it, so it is retried.
            if socket.exists() {
                match client.verify_identity(executor_id).await {
                    Ok(health) => {
                        tracing::info!(%executor_id, container_id,
                            elapsed_ms = started.elapsed().as_millis() as u64, "agentctl in container ready");
                        return Ok(health);
                    }
                    // Another replica owns it now: waiting changes nothing.
                    Err(e @ Error::StaleEpoch { .. }) => return Err(e),
                    Err(e) => last_error = e.to_string(),
                }
            }
            // A container removed (or being removed) while we wait can never
            // answer: say so at once rather than wait out the timeout, so a
            // probe racing a `docker rm -f` reports the container gone.
            match self.inspect(container_id).await? {
                None => {
                    return Err(Error::ContainerMissing {
                        executor_id,
                        container_id: Some(container_id.to_owned()),
                    });
                }
                Some(found)
                    if matches!(
                        found.status,
                        ContainerStateStatusEnum::REMOVING | ContainerStateStatusEnum::DEAD
                    ) =>
                {
                    return Err(Error::ContainerMissing {
                        executor_id,
                        container_id: Some(found.id),
                    });
                }
                Some(found) if found.status == ContainerStateStatusEnum::EXITED => {
                    return Err(Error::ExitedEarly {
                        executor_id,
                        status: format!("container {container_id} is {}", found.status),
                        log_hint: format!("; see `docker logs {container_id}`"),
                    });
                }
                Some(_) => {}
            }
            if Instant::now() >= deadline {
                return Err(Error::NotReady {
                    executor_id,
                    timeout: self.config.startup_timeout,
                    last_error,
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The container named `name` that another launch is creating or has
    /// created. The engine reserves the name before the container can be
    /// inspected, so a concurrent create may need a moment to show up.
    async fn adopt(&self, executor_id: ExecutorId, name: &str) -> Result<Found> {
        let deadline = Instant::now() + self.config.api_timeout;
        loop {
            if let Some(found) = self.inspect(name).await? {
                return Ok(found);
            }
            if Instant::now() >= deadline {
                return Err(Error::ContainerMissing {
                    executor_id,
                    container_id: Some(name.to_owned()),
                });
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Starts (or unpauses) the handle's container, whatever its state, and
    /// waits for its agentctl; the handle returned carries `generation`.
    async fn start_found(
        &self,
        handle: &ExecutorHandle,
        generation: i64,
    ) -> Result<(ExecutorHandle, Health)> {
        let id = handle.executor_id;
        let found = self
            .locate(handle)
            .await?
            .ok_or_else(|| Error::ContainerMissing {
                executor_id: id,
                container_id: handle.container_id.clone(),
            })?;
        match found.status {
            ContainerStateStatusEnum::RUNNING | ContainerStateStatusEnum::RESTARTING => {
                // Started meanwhile (a concurrent recovery): just wait for it.
            }
            ContainerStateStatusEnum::EXITED | ContainerStateStatusEnum::CREATED => {
                tracing::info!(executor_id = %id, container_id = %found.id, status = %found.status, generation, "starting stopped container");
                let (_, ids) = self.user_for(id, &handle.workspace_path)?;
                self.prepare_run_dir(id, ids)?;
                self.hand_over_secret(id, &self.secret_of(handle)?, ids)?;
                self.start_container(&found.id).await?;
            }
            ContainerStateStatusEnum::PAUSED => {
                tracing::info!(executor_id = %id, container_id = %found.id, generation, "unpausing container");
                self.engine().await?.unpause_container(&found.id).await?;
            }
            other => {
                return Err(Error::ContainerUnusable {
                    executor_id: id,
                    container_id: found.id,
                    state: other.to_string(),
                });
            }
        }
        let secret = self.secret_of(handle)?;
        let health = self
            .wait_ready(id, &found.id, &secret, handle.lease_epoch)
            .await?;
        Ok((
            refreshed(handle, found.id, secret, self.url(id)?, generation),
            health,
        ))
    }

    fn handle_for(
        &self,
        spec: &LaunchSpec,
        container_id: String,
        secret: String,
    ) -> Result<ExecutorHandle> {
        let mut handle = ExecutorHandle::new(
            spec,
            Runtime::LocalDocker,
            secret,
            self.url(spec.executor_id)?,
        );
        handle.container_id = Some(container_id);
        Ok(handle)
    }
}

impl DockerExecutor {
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
            Probe::NeedsStart { .. } | Probe::NeedsLaunch { .. } => {
                let (handle, health) = self.start_found(handle, handle.generation + 1).await?;
                Ok(Recovered {
                    handle,
                    action: RecoveryAction::Restarted,
                    health,
                })
            }
            Probe::Missing { .. } if !handle.workspace_path.is_dir() => {
                Err(Error::WorkspaceMissing {
                    executor_id: handle.executor_id,
                    path: handle.workspace_path.clone(),
                })
            }
            Probe::Missing { .. } => Err(Error::ContainerMissing {
                executor_id: handle.executor_id,
                container_id: handle.container_id.clone(),
            }),
        }
    }
}

#[async_trait]
impl Executor for DockerExecutor {
    fn runtime(&self) -> Runtime {
        Runtime::LocalDocker
    }

    /// The engine's `/_ping`, within the API timeout but at most 5 s: a
    /// create waits that long at most for a stopped engine before it is
    /// refused.
    async fn check_ready(&self) -> Result<()> {
        let unavailable = |message: String| Error::EngineUnavailable {
            host: self.config.docker_host.clone(),
            message,
        };
        let limit = self.config.api_timeout.min(ENGINE_PING_TIMEOUT);
        let ping = async { self.engine().await?.ping().await.map_err(Error::from) };
        match tokio::time::timeout(limit, ping).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(Error::Docker(e))) => Err(unavailable(e.to_string())),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(unavailable(format!("no answer within {limit:?}"))),
        }
    }

    async fn launch(&self, spec: &LaunchSpec) -> Result<ExecutorHandle> {
        let id = spec.executor_id;
        spec.require_workspace()?;
        self.url(id)?;
        let (user, ids) = self.user_for(id, &spec.workspace_path)?;
        let git_binds = match &spec.repository {
            Some(repository) => git_dir_binds(id, &spec.workspace_path, repository)?,
            None => Vec::new(),
        };
        self.prepare_run_dir(id, ids)?;
        let name = container_name(id);
        let secret = self.executor_secret(id)?;
        let options = CreateContainerOptions {
            name: Some(name.clone()),
            ..Default::default()
        };
        let container_id = match self
            .engine()
            .await?
            .create_container(Some(options), self.create_body(spec, user, git_binds))
            .await
        {
            Ok(created) => {
                tracing::info!(executor_id = %id, container_id = %created.id, "container created");
                // Ours to start: hand agentctl its secret first.
                self.hand_over_secret(id, &secret, ids)?;
                created.id
            }
            Err(BollardError::DockerResponseServerError {
                status_code: 409, ..
            }) => {
                // Someone created it first: adopt theirs; the kept secret
                // is the one its agentctl gets.
                let found = self.adopt(id, &name).await?;
                tracing::info!(executor_id = %id, container_id = %found.id, "container exists, adopting it");
                found.id
            }
            Err(BollardError::DockerResponseServerError {
                status_code: 404,
                message,
            }) => {
                return Err(Error::Config(format!(
                    "image {:?}: {message} (build it with `cargo xtask docker-image`)",
                    self.config.image
                )));
            }
            Err(e) => return Err(e.into()),
        };
        self.start_container(&container_id).await?;
        self.wait_ready(id, &container_id, &secret, spec.lease_epoch)
            .await?;
        self.handle_for(spec, container_id, secret)
    }

    async fn probe(&self, handle: &ExecutorHandle) -> Result<Probe> {
        let id = handle.executor_id;
        let Some(found) = self.locate(handle).await? else {
            return Ok(Probe::Missing {
                reason: format!(
                    "container {} is gone",
                    handle
                        .container_id
                        .clone()
                        .unwrap_or_else(|| container_name(id))
                ),
            });
        };
        match found.status {
            ContainerStateStatusEnum::RUNNING | ContainerStateStatusEnum::RESTARTING => {
                let secret = self.secret_of(handle)?;
                let health = self
                    .wait_ready(id, &found.id, &secret, handle.lease_epoch)
                    .await?;
                Ok(Probe::Reattachable {
                    handle: refreshed(handle, found.id, secret, self.url(id)?, handle.generation),
                    health,
                })
            }
            ContainerStateStatusEnum::EXITED
            | ContainerStateStatusEnum::CREATED
            | ContainerStateStatusEnum::PAUSED => {
                if !handle.workspace_path.is_dir() {
                    return Ok(Probe::Missing {
                        reason: format!(
                            "the worktree {} is missing",
                            handle.workspace_path.display()
                        ),
                    });
                }
                Ok(Probe::NeedsStart {
                    reason: format!("container {} is {}", found.id, found.status),
                })
            }
            // Being removed (a forced removal marks it so before killing
            // it), or dead (a removal that failed half-way): it can never
            // start again.
            ContainerStateStatusEnum::REMOVING | ContainerStateStatusEnum::DEAD => {
                Ok(Probe::Missing {
                    reason: format!("container {} is {}", found.id, found.status),
                })
            }
            other => Err(Error::ContainerUnusable {
                executor_id: id,
                container_id: found.id,
                state: other.to_string(),
            }),
        }
    }

    async fn start(&self, handle: &ExecutorHandle, generation: i64) -> Result<ExecutorHandle> {
        Ok(self.start_found(handle, generation).await?.0)
    }

    async fn stop(&self, handle: &ExecutorHandle) -> Result<()> {
        let Some(found) = self.locate(handle).await? else {
            return Ok(());
        };
        let t = i32::try_from(self.config.stop_grace.as_secs()).unwrap_or(i32::MAX);
        let options = StopContainerOptions {
            t: Some(t),
            ..Default::default()
        };
        match self
            .engine()
            .await?
            .stop_container(&found.id, Some(options))
            .await
        {
            Ok(())
            | Err(BollardError::DockerResponseServerError {
                status_code: 404, ..
            }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    async fn remove(&self, handle: &ExecutorHandle) -> Result<()> {
        let mut ids = self.containers_of(handle.executor_id).await?;
        ids.extend(handle.container_id.clone());
        ids.sort();
        ids.dedup();
        for id in ids {
            let options = RemoveContainerOptions {
                force: true,
                v: true,
                ..Default::default()
            };
            match self
                .engine()
                .await?
                .remove_container(&id, Some(options))
                .await
            {
                // 409: someone else's removal of it is in progress already.
                Ok(())
                | Err(BollardError::DockerResponseServerError {
                    status_code: 404 | 409,
                    ..
                }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        remove_if_exists(&self.host_secret_file(handle.executor_id))?;
        let dir = self.run_dir(handle.executor_id);
        match std::fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::Io {
                action: "removing run directory",
                path: dir,
                source: e,
            }),
            _ => Ok(()),
        }
    }

    fn client(&self, handle: &ExecutorHandle) -> Result<AgentctlClient> {
        Ok(AgentctlClient::new(
            &handle.agentctl_url,
            &handle.auth_secret,
            &self.config.client,
        )?
        .with_lease_epoch(handle.lease_epoch))
    }

    fn image(&self, requested: Option<&str>) -> Option<String> {
        Some(requested.unwrap_or(&self.config.image).to_owned())
    }

    /// On this host, through `host_agentctl`; as the container's user when
    /// the driver runs as root, so the worktree and what git writes into
    /// the repository belong to the user the agent runs as.
    async fn worktree(&self, target: &WorktreeTarget, op: WorktreeOp) -> Result<WorktreeAnswer> {
        let Some(agentctl) = &self.config.host_agentctl else {
            return Err(Error::Worktree {
                code: tonic::Code::FailedPrecondition,
                message: "the Docker driver has no agentctl on this host to create worktrees \
                          with; pass worktree.path of a directory you made"
                    .into(),
            });
        };
        let as_user = if rustix::process::geteuid().is_root() {
            let ids = self
                .config
                .user
                .as_deref()
                .and_then(parse_ids)
                .filter(|(uid, _)| *uid != 0);
            if ids.is_none() {
                return Err(Error::Worktree {
                    code: tonic::Code::FailedPrecondition,
                    message: "sessiond runs as root, so a Docker session's worktree is made as \
                              the user its container runs as: set executors.docker.user to a \
                              non-root uid:gid (who may write the repository)"
                        .into(),
                });
            }
            ids
        } else {
            None
        };
        let made =
            crate::worktree::run_local(agentctl, &self.config.host_env, target, op, as_user).await;
        match (made, as_user) {
            // The default worktrees directory is in sessiond's own data
            // directory, which that user may not enter (helper-37: every
            // `--repo` create failed, naming no setting).
            (Err(Error::Worktree { code, message }), Some((uid, gid)))
                if message.contains("Permission denied") =>
            {
                Err(Error::Worktree {
                    code,
                    message: format!(
                        "{message}; the worktree is made as the container's user {uid}:{gid}                          (executors.docker.user): give that user a directory it may write in                          executors.docker.worktrees_dir, and the repository"
                    ),
                })
            }
            (made, _) => made,
        }
    }
}

/// The binds that make a linked worktree's git work inside its container:
/// the repository's git directory (which the worktree's `.git` file names
/// through `<git dir>/worktrees/<name>`) at its own path, its `config` and
/// `hooks` read-only. The git directory must lie inside `repository`.
fn git_dir_binds(
    executor_id: ExecutorId,
    workspace: &Path,
    repository: &Path,
) -> Result<Vec<String>> {
    let not_linked = |why: String| {
        Error::Config(format!(
            "executor {executor_id}: {} is not a linked worktree of {}: {why}",
            workspace.display(),
            repository.display()
        ))
    };
    let dot_git = workspace.join(".git");
    let text = std::fs::read_to_string(&dot_git)
        .map_err(|e| not_linked(format!("reading {}: {e}", dot_git.display())))?;
    let gitdir = text
        .trim()
        .strip_prefix("gitdir:")
        .map(|g| PathBuf::from(g.trim()))
        .filter(|g| g.is_absolute())
        .ok_or_else(|| not_linked(format!("{} names no absolute gitdir", dot_git.display())))?;
    let commondir = gitdir.join("commondir");
    let common = std::fs::read_to_string(&commondir)
        .map_err(|e| not_linked(format!("reading {}: {e}", commondir.display())))?;
    let common = crate::worktree::normalise(&gitdir.join(common.trim()));
    let inside = match (
        std::fs::canonicalize(&common),
        std::fs::canonicalize(repository),
    ) {
        (Ok(c), Ok(r)) => c.starts_with(r),
        _ => false,
    };
    if !inside {
        return Err(not_linked(format!(
            "its git directory {} is not inside the repository",
            common.display()
        )));
    }
    let c = common.display();
    let mut binds = vec![format!("{c}:{c}")];
    for part in ["config", "hooks"] {
        let p = common.join(part);
        if p.exists() {
            binds.push(format!("{0}:{0}:ro", p.display()));
        }
    }
    Ok(binds)
}

fn found(info: ContainerInspectResponse) -> Found {
    let status = info
        .state
        .and_then(|s| s.status)
        .unwrap_or(ContainerStateStatusEnum::EMPTY);
    Found {
        id: info.id.unwrap_or_default(),
        status,
    }
}

/// `handle` with what the engine says now.
fn refreshed(
    handle: &ExecutorHandle,
    container_id: String,
    secret: String,
    url: String,
    generation: i64,
) -> ExecutorHandle {
    let mut new = handle.clone();
    new.runtime = Runtime::LocalDocker;
    new.container_id = Some(container_id);
    new.auth_secret = secret;
    new.agentctl_port = None;
    new.agentctl_url = url;
    new.generation = generation;
    new
}

/// The secret kept at `path`, `None` when there is none.
fn read_secret(path: &Path) -> Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(s) if !s.trim().is_empty() => Ok(Some(s.trim().to_owned())),
        Ok(_) => Ok(None),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(Error::Io {
            action: "reading the executor secret",
            path: path.to_owned(),
            source,
        }),
    }
}

/// `uid:gid` (or a bare `uid`, the group then being the same number).
fn parse_ids(user: &str) -> Option<(u32, u32)> {
    let mut parts = user.splitn(2, ':');
    let uid: u32 = parts.next()?.parse().ok()?;
    let gid = match parts.next() {
        Some(g) => g.parse().ok()?,
        None => uid,
    };
    Some((uid, gid))
}

/// Gives `path` to the container's user when we may (we are root, or it is
/// us already); a named user cannot be resolved here and is left alone.
fn chown_to(path: &Path, ids: Option<(u32, u32)>) -> Result<()> {
    let Some((uid, gid)) = ids else {
        return Ok(());
    };
    let meta = std::fs::metadata(path).map_err(|source| Error::Io {
        action: "inspecting",
        path: path.to_owned(),
        source,
    })?;
    if meta.uid() == uid && meta.gid() == gid {
        return Ok(());
    }
    std::os::unix::fs::chown(path, Some(uid), Some(gid)).map_err(|source| Error::Io {
        action: "giving the run directory to the container's user",
        path: path.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_ids_parse() {
        assert_eq!(parse_ids("1000:1001"), Some((1000, 1001)));
        assert_eq!(parse_ids("1000"), Some((1000, 1000)));
        assert_eq!(parse_ids("agent"), None);
        assert_eq!(parse_ids("1000:staff"), None);
    }
}
