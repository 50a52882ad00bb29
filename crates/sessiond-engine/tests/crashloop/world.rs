//! The world a crash test owns (store, directories, profiles, remote hosts,
//! Docker), the child backend it runs, and the checks against the world.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    io::{BufRead, BufReader},
    os::unix::process::ExitStatusExt,
    path::{Path, PathBuf},
    process::{Command, ExitStatus, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use bollard::query_parameters::{
    InspectContainerOptions, ListContainersOptions, RemoveContainerOptions, StopContainerOptions,
};
use chrono::Utc;
use serde::{Deserialize, Serialize};
use sessiond_domain::{
    AgentProfile, AgentProfileId, ExecutorId, ExecutorRecord, ExecutorStatus, MessageRole, Runtime,
    Session, SessionId, SessionState, Task, TaskId, TaskState, Worktree,
};
use sessiond_engine::{ManagerConfig, NewSession, RemoteAgentctl, SessionManager};
use sessiond_executor::{
    Backoff, Executor,
    docker::{CONTAINER_HOME, DockerConfig, DockerExecutor, LABEL_SESSION_ID, LABEL_TASK_ID},
    process,
};
use sessiond_store::{Store, StoreOptions};

pub const CHILD_ENV: &str = "SESSIOND_CRASHLOOP_CHILD";
/// Metadata key naming a planned session, so a restarted backend knows it.
pub const NAME_KEY: &str = "crashloop.name";
pub const IMAGE: &str = "sessiond-agentctl:dev";
/// The demo agent's side-effect file, relative to each worktree.
pub const SIDE_EFFECT_FILE: &str = "side-effects.txt";
/// What the demo agent's extra chunks add to every reply.
pub const REPLY_TAIL: &str = " [1] [2] [3]";
/// How an interrupted turn's partial reply is marked (pump's INTERRUPTED_NOTE).
const INTERRUPTED_MARK: &str = "[sessiond: this reply was interrupted";

pub use crate::common::{bin, children_of, is_running, kill9};

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "sessiond_engine=info,sessiond_executor=info".into()),
        )
        .with_writer(std::io::stderr)
        .try_init();
}

/// What the child backend is told (JSON in [`CHILD_ENV`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChildSpec {
    pub db_url: String,
    pub dir: PathBuf,
    pub task: String,
    pub local_profile: String,
    pub docker_profile: Option<String>,
    pub docker_host: Option<String>,
    pub mode: Mode,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Mode {
    /// Create these sessions (no recovery first) and send `messages` to each;
    /// print `CRASHLOOP CREATED`, then wait to be killed.
    Create { plans: Vec<Plan>, messages: usize },
    /// Recover, print `CRASHLOOP RECOVERED`, wait to be killed.
    Recover,
    /// Start the recovery pass but hold it before it takes up any executor
    /// (a gate that never opens), print `CRASHLOOP PRIORITISING`, and
    /// recover every session through a call (`ensure_recovered`): each
    /// recovery is a call's, run ahead of the pass.
    RecoverPrioritised,
    /// Recover, then an explicit resume of every session whose status
    /// says it needs one; print `CRASHLOOP RESUMED`, wait to be killed.
    Resume,
    /// Recover, then keep the planned sessions alive and busy until killed.
    Loop { plans: Vec<Plan> },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Plan {
    pub name: String,
    pub runtime: Rt,
    pub remote: Option<RemoteSpec>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Rt {
    Standalone,
    Docker,
    Remote,
}

impl Rt {
    pub fn runtime(self) -> Runtime {
        match self {
            Rt::Standalone => Runtime::LocalStandalone,
            Rt::Docker => Runtime::LocalDocker,
            Rt::Remote => Runtime::Remote,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RemoteSpec {
    pub executor_id: String,
    pub url: String,
    pub secret: String,
}

pub fn manager_config() -> ManagerConfig {
    ManagerConfig {
        executor_deadline: Duration::from_secs(10),
        remote_retry_window: Duration::from_secs(120),
        remote_backoff: Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_millis(800),
        },
        agent_initialize_timeout: Duration::from_secs(10),
        agent_stop_grace: Duration::from_secs(2),
        ..ManagerConfig::default()
    }
}

/// [`manager_config`] for a world in `dir`: its standalone and remote
/// sessions get their worktree from the world's repository, under
/// `<dir>/worktrees` (a remote one made by its host's agentctl), its
/// Docker sessions from the agent user's repository, under
/// `<dir>/worktrees-docker`.
pub fn manager_config_in(dir: &Path) -> ManagerConfig {
    ManagerConfig {
        worktrees: sessiond_engine::WorktreeSettings {
            dirs: vec![
                (Runtime::LocalStandalone, dir.join("worktrees")),
                (Runtime::Remote, dir.join("worktrees")),
                (Runtime::LocalDocker, docker_worktrees(dir)),
            ],
            branch_prefix: "crash".into(),
            roots: Vec::new(),
        },
        ..manager_config()
    }
}

/// The git repository of a world in `dir` that its standalone and remote
/// sessions are created from.
pub fn repository(dir: &Path) -> PathBuf {
    dir.join("repo")
}

/// The user Docker containers run as; the Docker sessions' repository and
/// worktrees are its (git in the container refuses a repository of root's).
const AGENT_UID: u32 = 1000;

/// The repository of the world in `dir` that its Docker sessions are
/// created from, owned by [`AGENT_UID`].
pub fn docker_repository(dir: &Path) -> PathBuf {
    dir.join("repo-docker")
}

/// Where the Docker sessions' worktrees go, owned by [`AGENT_UID`].
fn docker_worktrees(dir: &Path) -> PathBuf {
    dir.join("worktrees-docker")
}

/// Runs as root on repositories and worktrees of the agent's user too:
/// `safe.directory` lets it read them (it changes nothing in them).
fn git(dir: &Path, args: &[&str]) -> String {
    try_git(dir, args).unwrap_or_else(|e| panic!("{e}"))
}

/// [`git`], with its failure as a message (for a check to report).
fn try_git(dir: &Path, args: &[&str]) -> Result<String, String> {
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["-c", "user.name=crash", "-c", "user.email=crash@localhost"])
        .args(["-c", "safe.directory=*"])
        .args(args)
        .output()
        .unwrap();
    if !out.status.success() {
        return Err(format!(
            "git {args:?} in {}: {}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// git's exit code (`None`: killed), for questions it answers with it.
fn git_status(dir: &Path, args: &[&str]) -> Option<i32> {
    Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["-c", "safe.directory=*"])
        .args(args)
        .status()
        .unwrap()
        .code()
}

fn init_repository(repo: &Path) {
    std::fs::create_dir_all(repo).unwrap();
    git(repo, &["init", "-q", "-b", "main"]);
    std::fs::write(repo.join("README.md"), "crash test\n").unwrap();
    git(repo, &["add", "README.md"]);
    git(repo, &["commit", "-q", "-m", "init"]);
}

/// The Docker sessions' repository and worktrees directory, the agent
/// user's; the world's directory opened for that user to pass through
/// (the host agentctl that makes their worktrees runs as it).
fn init_docker_repository(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711)).unwrap();
    init_repository(&docker_repository(dir));
    std::fs::create_dir_all(docker_worktrees(dir)).unwrap();
    for path in [docker_repository(dir), docker_worktrees(dir)] {
        let status = Command::new("chown")
            .args(["-R", &format!("{AGENT_UID}:{AGENT_UID}")])
            .arg(&path)
            .status()
            .unwrap();
        assert!(status.success(), "chown {}", path.display());
    }
}

/// The worktrees git lists for the world's (standalone and remote)
/// repository, its own checkout left out; and for each, the branch
/// checked out.
pub fn listed_worktrees(dir: &Path) -> Vec<(String, String)> {
    listed_worktrees_of(&repository(dir))
}

/// [`listed_worktrees`] of repository `repo`.
pub fn listed_worktrees_of(repo: &Path) -> Vec<(String, String)> {
    let out = git(repo, &["worktree", "list", "--porcelain"]);
    let main = repo.display().to_string();
    out.split("\n\n")
        .filter_map(|block| {
            let path = block.lines().find_map(|l| l.strip_prefix("worktree "))?;
            let branch = block
                .lines()
                .find_map(|l| l.strip_prefix("branch refs/heads/"))
                .unwrap_or("");
            (path != main).then(|| (path.to_owned(), branch.to_owned()))
        })
        .collect()
}

/// The drivers of a world whose directory is `dir` (the parent's and the
/// child's are the same).
pub async fn drivers(dir: &Path, docker_host: Option<&str>) -> Vec<Arc<dyn Executor>> {
    let mut out = crate::common::local_drivers(dir);
    if let Some(host) = docker_host {
        out.push(Arc::new(docker_driver(host, dir).await));
    }
    out
}

async fn docker_driver(host: &str, dir: &Path) -> DockerExecutor {
    let mut dc = DockerConfig::new(host, IMAGE, dir.join("docker-run"));
    // The tests run as root: the worktrees are made by this host's
    // agentctl as the user the containers run as.
    dc.user = Some(format!("{AGENT_UID}:{AGENT_UID}"));
    dc.host_agentctl = Some(bin("agentctl"));
    dc.idle_timeout = Some(Duration::from_secs(300));
    dc.stop_grace = Duration::from_secs(2);
    dc.startup_timeout = Duration::from_secs(20);
    dc.client = crate::common::client_config();
    DockerExecutor::connect(dc).await.unwrap_or_else(|e| {
        panic!("SESSIOND_DOCKER_TESTS=1 but the engine at {host} is unusable: {e}")
    })
}

/// The Docker engine, when `SESSIOND_DOCKER_TESTS=1`. With the switch set, a
/// missing engine or image fails the test; without it Docker is left out.
pub async fn docker_from_env(dir: &Path) -> Option<(String, DockerExecutor)> {
    if std::env::var("SESSIOND_DOCKER_TESTS").as_deref() != Ok("1") {
        eprintln!(
            "crashloop: Docker sessions left out (set SESSIOND_DOCKER_TESTS=1 and DOCKER_HOST; `cargo xtask ci` does)"
        );
        return None;
    }
    let host =
        std::env::var("DOCKER_HOST").unwrap_or_else(|_| "unix:///var/run/docker.sock".into());
    let driver = docker_driver(&host, dir).await;
    if let Err(e) = driver
        .docker()
        .expect("connected")
        .inspect_image(IMAGE)
        .await
    {
        panic!(
            "SESSIOND_DOCKER_TESTS=1 but the image {IMAGE} is missing at {host} ({e}); build it with `cargo xtask docker-image`"
        );
    }
    Some((host, driver))
}

/// An agentctl the test starts itself, standing for one a remote host runs.
pub struct RemoteHost {
    pub spec: RemoteSpec,
    pub child: std::process::Child,
    /// What a restart needs: the same port, worktree root and journal.
    port: u16,
    root: PathBuf,
}

pub struct World {
    pub dir: tempfile::TempDir,
    pub db_url: String,
    pub store: Store,
    pub task: Task,
    pub local_profile: AgentProfile,
    pub docker_profile: Option<AgentProfile>,
    pub docker: Option<(String, DockerExecutor)>,
    pub remotes: Mutex<Vec<RemoteHost>>,
    /// The world's database when its store is PostgreSQL; dropped last.
    _postgres: Option<sessiond_testkit::postgres::TestDatabase>,
}

/// Which store a world keeps its records in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Db {
    /// A file in the world's directory.
    Sqlite,
    /// A database of its own on PostgreSQL (`DATABASE_URL`'s server, else
    /// a throwaway cluster of this test process).
    Postgres,
}

impl Db {
    /// `SESSIOND_CRASHLOOP_STORE` (`sqlite`, the default, or `postgres`).
    pub fn from_env() -> Db {
        match std::env::var("SESSIOND_CRASHLOOP_STORE").as_deref() {
            Err(_) | Ok("sqlite") => Db::Sqlite,
            Ok("postgres") => Db::Postgres,
            Ok(other) => {
                panic!("SESSIOND_CRASHLOOP_STORE: {other:?} is neither sqlite nor postgres")
            }
        }
    }
}

impl World {
    /// A world on the store `SESSIOND_CRASHLOOP_STORE` names.
    pub async fn new() -> World {
        World::on(Db::from_env()).await
    }

    pub async fn on(db: Db) -> World {
        init_tracing();
        let mut dir = tempfile::tempdir().unwrap();
        if std::env::var_os("SESSIOND_CRASHLOOP_KEEP").is_some() {
            // A rare failure is read from the children's logs afterwards.
            dir.disable_cleanup(true);
            eprintln!("crash test: world kept at {}", dir.path().display());
        }
        let (db_url, postgres) = match db {
            Db::Sqlite => (
                format!("sqlite://{}", dir.path().join("sessiond.db").display()),
                None,
            ),
            Db::Postgres => {
                let database =
                    tokio::task::spawn_blocking(sessiond_testkit::postgres::test_database)
                        .await
                        .unwrap();
                eprintln!(
                    "crash test: store on PostgreSQL, database {}",
                    database.name()
                );
                (database.url().to_owned(), Some(database))
            }
        };
        let store = Store::connect(&db_url, StoreOptions::default())
            .await
            .unwrap();
        let now = Utc::now();
        let task = store
            .create_task(&Task {
                id: TaskId::new(),
                title: "crash test".into(),
                state: TaskState::Todo,
                created_at: now,
                updated_at: now,
            })
            .await
            .unwrap();
        init_repository(&repository(dir.path()));
        let state_dir = dir.path().join("agent-state").display().to_string();
        let local_profile = profile(
            &store,
            "demo-local",
            bin("acp-demo-agent").display().to_string(),
            state_dir,
        )
        .await;
        let docker = docker_from_env(dir.path()).await;
        if docker.is_some() {
            init_docker_repository(dir.path());
        }
        let docker_profile = match docker {
            Some(_) => Some(
                // Its state in its HOME, the executor's run directory: the
                // worktree is mounted at its own path, and holds only
                // what the agent writes there on purpose.
                profile(
                    &store,
                    "demo-docker",
                    "/usr/local/bin/acp-demo-agent".into(),
                    format!("{CONTAINER_HOME}/.agent-state"),
                )
                .await,
            ),
            None => None,
        };
        World {
            dir,
            db_url,
            store,
            task,
            local_profile,
            docker_profile,
            docker,
            remotes: Mutex::new(Vec::new()),
            _postgres: postgres,
        }
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    pub fn has_docker(&self) -> bool {
        self.docker.is_some()
    }

    pub fn docker_host(&self) -> Option<&str> {
        self.docker.as_ref().map(|(h, _)| h.as_str())
    }

    pub async fn manager(&self) -> SessionManager {
        SessionManager::new(
            self.store.clone(),
            drivers(self.dir.path(), self.docker_host()).await,
            manager_config_in(self.dir.path()),
        )
    }

    /// A plan for a session named `name` on `rt`; for remote, starts its agentctl.
    pub async fn plan(&self, name: &str, rt: Rt) -> Plan {
        let remote = match rt {
            // Its host's agentctl makes the session's worktree under the
            // world's directory, where the repository is.
            Rt::Remote => Some(self.start_remote(self.dir.path()).await),
            _ => None,
        };
        Plan {
            name: name.into(),
            runtime: rt,
            remote,
        }
    }

    /// The runtimes this run covers, in order.
    pub fn runtimes(&self) -> Vec<Rt> {
        let mut v = vec![Rt::Standalone, Rt::Remote];
        if self.has_docker() {
            v.push(Rt::Docker);
        }
        v
    }

    async fn start_remote(&self, root: &Path) -> RemoteSpec {
        let id = ExecutorId::new();
        let secret = sessiond_executor::fresh_secret();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let spec = RemoteSpec {
            executor_id: id.to_string(),
            url: format!("http://127.0.0.1:{port}"),
            secret,
        };
        let child = self.spawn_remote(&spec, port, root).await;
        self.remotes.lock().unwrap().push(RemoteHost {
            spec: spec.clone(),
            child,
            port,
            root: root.to_owned(),
        });
        spec
    }

    /// Starts the host's agentctl for `spec`, as its operator would: no
    /// workspace, worktrees under `root`; waits for its port file.
    async fn spawn_remote(&self, spec: &RemoteSpec, port: u16, root: &Path) -> std::process::Child {
        let id = &spec.executor_id;
        let port_file = self.path(&format!("remote-{id}.port"));
        let _ = std::fs::remove_file(&port_file);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.path(&format!("remote-{id}.log")))
            .unwrap();
        let child = Command::new(bin("agentctl"))
            .args(["--executor-id", id])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .arg("--worktree-root")
            .arg(root)
            .arg("--port-file")
            .arg(&port_file)
            .args(["--idle-timeout", "300s"])
            // The host operator's journal, as every agentctl should have
            // (docs/decisions/0007-at-most-once-turns.md): a restarted remote agentctl
            // answers from it.
            .arg("--journal")
            .arg(self.path(&format!("remote-{id}.journal")))
            .env("AGENTCTL_SECRET", &spec.secret)
            .env("AGENTCTL_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !port_file.exists() {
            assert!(
                Instant::now() < deadline,
                "remote agentctl wrote no port file"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        child
    }

    /// The remote host of executor `executor_id` restarts its agentctl:
    /// SIGKILL (its agent dies with it; the new one ends the old tree),
    /// then the same command on the same port and journal.
    pub async fn restart_remote(&self, executor_id: &str) -> bool {
        self.stop_remote(executor_id) && self.start_remote_again(executor_id).await
    }

    /// The remote host of executor `executor_id` goes down: its agentctl
    /// is SIGKILLed and not started again (until [`Self::start_remote_again`]).
    pub fn stop_remote(&self, executor_id: &str) -> bool {
        let mut remotes = self.remotes.lock().unwrap();
        let Some(r) = remotes
            .iter_mut()
            .find(|r| r.spec.executor_id == executor_id)
        else {
            return false;
        };
        // Not reaped yet: the pid is still this child's.
        if matches!(r.child.try_wait(), Ok(None)) {
            kill9(r.child.id());
        }
        let _ = r.child.wait();
        true
    }

    /// The remote host of executor `executor_id` starts its agentctl again:
    /// the same command on the same port and journal.
    pub async fn start_remote_again(&self, executor_id: &str) -> bool {
        let found = {
            let remotes = self.remotes.lock().unwrap();
            let Some(r) = remotes.iter().find(|r| r.spec.executor_id == executor_id) else {
                return false;
            };
            (r.spec.clone(), r.port, r.root.clone())
        };
        let child = self.spawn_remote(&found.0, found.1, &found.2).await;
        let mut remotes = self.remotes.lock().unwrap();
        if let Some(r) = remotes
            .iter_mut()
            .find(|r| r.spec.executor_id == executor_id)
        {
            r.child = child;
        }
        true
    }

    pub fn spec(&self, mode: Mode) -> ChildSpec {
        ChildSpec {
            db_url: self.db_url.clone(),
            dir: self.dir.path().to_owned(),
            task: self.task.id.to_string(),
            local_profile: self.local_profile.id.to_string(),
            docker_profile: self.docker_profile.as_ref().map(|p| p.id.to_string()),
            docker_host: self.docker_host().map(str::to_owned),
            mode,
        }
    }

    /// Starts a child backend; its stderr goes to `<dir>/logs/<tag>.log`.
    pub fn spawn_child(&self, tag: &str, mode: Mode, failpoints: Option<&str>) -> ChildBackend {
        let logs = self.path("logs");
        std::fs::create_dir_all(&logs).unwrap();
        let log = logs.join(format!("{tag}.log"));
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "--exact",
            "child::child_backend",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, serde_json::to_string(&self.spec(mode)).unwrap())
        .env_remove("FAILPOINTS")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap());
        if let Some(fp) = failpoints {
            cmd.env("FAILPOINTS", fp);
        }
        let mut child = cmd.spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let lines = Arc::new(Mutex::new(Vec::<String>::new()));
        let sink = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                // libtest prints `test child::child_backend ... ` without a
                // newline before the test's own output.
                if let Some(at) = line.find("CRASHLOOP ") {
                    sink.lock().unwrap().push(line[at..].to_owned());
                }
            }
        });
        ChildBackend {
            child,
            lines,
            log,
            tag: tag.into(),
        }
    }

    pub async fn sessions(&self) -> Vec<Session> {
        self.store.list_sessions(self.task.id).await.unwrap()
    }

    pub async fn record(&self, s: SessionId) -> Option<ExecutorRecord> {
        self.store.get_executor_for_session(s).await.unwrap()
    }

    /// Kills the agentctl of a local session (and its agent) as a crash of
    /// it would; Docker: stops the container.
    pub async fn kill_executor(&self, s: &Session) {
        let r = self.record(s.id).await.unwrap();
        match r.runtime {
            Runtime::LocalStandalone => {
                let pid = r.pid.unwrap();
                let kids = children_of(pid);
                kill9(pid);
                for k in kids {
                    kill9(k);
                }
                let deadline = Instant::now() + Duration::from_secs(10);
                while is_running(pid) && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            Runtime::LocalDocker => {
                let (_, d) = self.docker.as_ref().unwrap();
                d.docker()
                    .expect("connected")
                    .stop_container(
                        r.container_id.as_deref().unwrap(),
                        Some(StopContainerOptions {
                            t: Some(1),
                            ..Default::default()
                        }),
                    )
                    .await
                    .unwrap();
            }
            Runtime::Remote => {}
            Runtime::Custom(_) => panic!("the crash loop makes no custom runtime"),
        }
    }

    /// Kills the agentctl of session `s` as a crash would: a standalone
    /// one by its recorded pid (identity checked; its agent dies with it),
    /// a remote one restarted by its host (same port and journal). Docker
    /// executors are left alone. Returns whether one was killed.
    pub async fn kill_agentctl(&self, s: &Session) -> bool {
        let Some(r) = self.record(s.id).await else {
            return false;
        };
        match r.runtime {
            Runtime::LocalStandalone => match (r.pid, r.pid_start_time) {
                (Some(pid), Some(st)) if process::is_same_running(pid, st) => {
                    kill9(pid);
                    true
                }
                _ => false,
            },
            Runtime::Remote => self.restart_remote(&r.id.to_string()).await,
            Runtime::LocalDocker => false,
            Runtime::Custom(_) => panic!("the crash loop makes no custom runtime"),
        }
    }

    /// Removes what the test made: sessions (their executors), remote
    /// agentctls, every container labelled with the task, stray processes.
    pub async fn cleanup(&self, mgr: &SessionManager) {
        for s in self.sessions().await {
            // The agents leave files in their worktrees (side effects the
            // loop counts): the end of a test discards them.
            let everything = sessiond_domain::worktree::RemovalRequest {
                discard: true,
                delete_branch: true,
                ..Default::default()
            };
            if let Err(e) = mgr
                .delete_session_with(self.task.id, s.id, everything)
                .await
            {
                eprintln!("cleanup: deleting session {} failed: {e}", s.id);
            }
        }
        mgr.shutdown();
        for mut r in std::mem::take(&mut *self.remotes.lock().unwrap()) {
            let kids = children_of(r.child.id());
            let _ = r.child.kill();
            let _ = r.child.wait();
            for k in kids {
                kill9(k);
            }
        }
        self.remove_containers().await;
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.strays().is_empty() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let strays = self.strays();
        if !strays.is_empty() {
            let cmdlines = proc_cmdlines();
            let left: Vec<String> = strays
                .iter()
                .map(|p| {
                    let cmd = cmdlines
                        .iter()
                        .find(|(q, _)| q == p)
                        .map(|(_, c)| c.as_str())
                        .unwrap_or("?");
                    format!("pid {p}: {}", clip(cmd, 200))
                })
                .collect();
            fail(&summary(
                "processes of this test left after the sessions were deleted",
                &left,
                "",
            ));
        }
    }

    async fn remove_containers(&self) {
        let Some((_, d)) = &self.docker else { return };
        for id in self
            .containers_labelled(LABEL_TASK_ID, &self.task.id.to_string())
            .await
        {
            let _ = d
                .docker()
                .expect("connected")
                .remove_container(
                    &id.0,
                    Some(RemoveContainerOptions {
                        force: true,
                        ..Default::default()
                    }),
                )
                .await;
        }
    }

    /// Containers (id, running) carrying `label=value`.
    pub async fn containers_labelled(&self, label: &str, value: &str) -> Vec<(String, bool)> {
        let Some((_, d)) = &self.docker else {
            return Vec::new();
        };
        let filters = HashMap::from([("label".to_owned(), vec![format!("{label}={value}")])]);
        let list = d
            .docker()
            .expect("connected")
            .list_containers(Some(ListContainersOptions {
                all: true,
                filters: Some(filters),
                ..Default::default()
            }))
            .await
            .unwrap();
        let mut out = Vec::new();
        for c in list {
            let Some(id) = c.id else { continue };
            let running = d
                .docker()
                .expect("connected")
                .inspect_container(&id, None::<InspectContainerOptions>)
                .await
                .ok()
                .and_then(|i| i.state)
                .and_then(|s| s.running)
                .unwrap_or(false);
            out.push((id, running));
        }
        out
    }

    /// agentctl and agent processes whose command line names this world's
    /// directory (started for this test, host side).
    pub fn strays(&self) -> Vec<u32> {
        let marker = self.dir.path().display().to_string();
        proc_cmdlines()
            .into_iter()
            .filter(|(pid, text)| {
                (text.contains("agentctl") || text.contains("acp-demo-agent"))
                    && text.contains(&marker)
                    && is_running(*pid)
            })
            .map(|(pid, _)| pid)
            .collect()
    }

    /// Where the demo agent keeps the transcript of conversation `token`.
    fn transcript_path(&self, s: &Session, token: &str) -> PathBuf {
        match s.runtime {
            // The container's HOME is `home` in the executor's run
            // directory on this host.
            Runtime::LocalDocker => self
                .path("docker-run")
                .join(s.executor_id.map(|e| e.to_string()).unwrap_or_default())
                .join("home/.agent-state")
                .join(format!("{token}.json")),
            _ => self.path("agent-state").join(format!("{token}.json")),
        }
    }

    /// What the checker finds where the transcript of `s` should be.
    fn transcript_diagnosis(&self, s: &Session, r: &ExecutorRecord) -> String {
        let Some(token) = &s.resume_token else {
            return format!(
                "no transcript read: the session has no resume token (executor's: {:?})",
                r.resume_token
            );
        };
        let path = self.transcript_path(s, token);
        let dir = path.parent().map(Path::to_owned).unwrap_or_default();
        let listing: Vec<String> = match std::fs::read_dir(&dir) {
            Ok(entries) => entries
                .flatten()
                .map(|e| {
                    let meta = e.metadata().ok();
                    format!(
                        "{} ({} bytes)",
                        e.file_name().to_string_lossy(),
                        meta.map(|m| m.len()).unwrap_or(0)
                    )
                })
                .collect(),
            Err(e) => vec![format!("unreadable: {e}")],
        };
        let read = match std::fs::read_to_string(&path) {
            Ok(text) => format!("{} bytes", text.len()),
            Err(e) => format!("not readable: {e}"),
        };
        format!(
            "transcript of token {token} (executor's token {:?}) at {}: {read}; {} holds {listing:?}",
            r.resume_token,
            path.display(),
            dir.display()
        )
    }

    pub fn transcript(&self, s: &Session) -> Vec<(String, String)> {
        let Some(token) = &s.resume_token else {
            return Vec::new();
        };
        let Ok(text) = std::fs::read_to_string(self.transcript_path(s, token)) else {
            return Vec::new();
        };
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        v["turns"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .map(|t| {
                (
                    t["prompt"].as_str().unwrap_or_default().to_owned(),
                    t["reply"].as_str().unwrap_or_default().to_owned(),
                )
            })
            .collect()
    }

    /// Waits until no session is RUNNING or STARTING (turns in flight end).
    pub async fn settle(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let busy: Vec<Session> = self
                .sessions()
                .await
                .into_iter()
                .filter(|s| matches!(s.state, SessionState::Running | SessionState::Starting))
                .collect();
            if busy.is_empty() {
                return;
            }
            if Instant::now() >= deadline {
                let mut stuck = Vec::new();
                for s in &busy {
                    stuck.push(self.who(s).await);
                }
                fail(&summary(
                    &format!("sessions did not settle within {within:?}"),
                    &stuck,
                    &self.states_line().await,
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A session for a failure message: its plan's name, id, runtime,
    /// state (with why, for ERROR), and its executor's status.
    pub async fn who(&self, s: &Session) -> String {
        let name = s.metadata.get(NAME_KEY).map(String::as_str).unwrap_or("?");
        let executor = match self.record(s.id).await {
            Some(r) => format!(
                "executor {} gen {}{}",
                r.status,
                r.generation,
                r.error_message
                    .as_deref()
                    .map(|e| format!(" ({})", clip(e, 80)))
                    .unwrap_or_default()
            ),
            None => "no executor record".to_owned(),
        };
        let why = match (s.state, s.error_message.as_deref()) {
            (SessionState::Error, Some(e)) => format!(" ({})", clip(e, 80)),
            _ => String::new(),
        };
        let host = match s.runtime {
            Runtime::Remote => self.remote_host_state(s).await,
            _ => String::new(),
        };
        format!(
            "{name} {} {} {}{why}, {executor}{host}",
            s.id, s.runtime, s.state
        )
    }

    /// For a remote session's failure message: whether its host's agentctl
    /// process still runs, and the last lines of its log (the evidence when
    /// a host does not answer at the end).
    async fn remote_host_state(&self, s: &Session) -> String {
        let Some(r) = self.record(s.id).await else {
            return String::new();
        };
        let id = r.id.to_string();
        let process = {
            let mut remotes = self.remotes.lock().unwrap();
            match remotes.iter_mut().find(|h| h.spec.executor_id == id) {
                Some(h) => match h.child.try_wait() {
                    Ok(None) => format!("host agentctl {} running", h.child.id()),
                    Ok(Some(status)) => format!("host agentctl {} exited: {status}", h.child.id()),
                    Err(e) => format!("host agentctl {}: {e}", h.child.id()),
                },
                None => return String::new(),
            }
        };
        let log =
            std::fs::read_to_string(self.path(&format!("remote-{id}.log"))).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(4).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        format!(
            "; {process}; its log ends: {}",
            clip(&tail.join(" | "), 600)
        )
    }

    /// One line: how many sessions are in each state, and which are not
    /// waiting for input.
    pub async fn states_line(&self) -> String {
        let sessions = self.sessions().await;
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        for s in &sessions {
            *counts.entry(s.state.to_string()).or_default() += 1;
        }
        let others: Vec<String> = sessions
            .iter()
            .filter(|s| s.state != SessionState::WaitingForInput)
            .map(|s| {
                let why = s
                    .error_message
                    .as_deref()
                    .map(|e| format!(" ({})", clip(e, 160)))
                    .unwrap_or_default();
                format!(
                    "{} {} {}{why}",
                    s.metadata.get(NAME_KEY).map(String::as_str).unwrap_or("?"),
                    s.id,
                    s.state
                )
            })
            .collect();
        format!(
            "{} sessions, states {counts:?}; not waiting: [{}]",
            sessions.len(),
            others.join(", ")
        )
    }

    /// The convergence checks, against the world, all strict: among them,
    /// every stored user message reached the agent exactly once (a crash
    /// between storing a message and prompting the agent included), and
    /// every reply is stored before the next user message. Returns a
    /// one-line summary.
    pub async fn assert_converged(&self, mgr: &SessionManager) -> String {
        self.converged(mgr).await.line
    }

    /// [`World::assert_converged`], with the counts.
    pub async fn converged(&self, mgr: &SessionManager) -> Converged {
        let mut failures = Vec::new();
        let mut states: BTreeMap<String, usize> = BTreeMap::new();
        let mut undelivered = 0usize;
        let mut interrupted = 0usize;
        let mut out_of_order = 0usize;
        let mut turns_total = 0usize;
        let mut side_effects = 0usize;
        let mut lost_ends = 0usize;
        let remote_ids: HashSet<String> = self
            .remotes
            .lock()
            .unwrap()
            .iter()
            .map(|r| r.spec.executor_id.clone())
            .collect();
        let cmdlines = proc_cmdlines();
        for s in self.sessions().await {
            let name = s.metadata.get(NAME_KEY).cloned().unwrap_or_default();
            let who = format!("session {name} ({}, {})", s.id, s.runtime);
            *states.entry(s.state.to_string()).or_default() += 1;
            if s.state == SessionState::Starting {
                failures.push(format!("{who} is left STARTING"));
            }
            // Executor against the world.
            let Some(r) = self.record(s.id).await else {
                failures.push(format!("{who} has no executor record"));
                continue;
            };
            // Every failure names the session's state and its executor's,
            // so a rare one tells which recovery path left it so.
            let who = format!(
                "{who}, {} with executor {} {:?}",
                s.state, r.status, r.error_message
            );
            if r.status == ExecutorStatus::Starting {
                failures.push(format!("{who}: executor left `starting`"));
            }
            let agentctls: Vec<u32> = cmdlines
                .iter()
                .filter(|(_, c)| {
                    c.contains("agentctl") && c.contains(&format!("--executor-id {}", r.id))
                })
                .map(|(p, _)| *p)
                .filter(|p| is_running(*p))
                .collect();
            let live = r.status == ExecutorStatus::Ready;
            match r.runtime {
                Runtime::LocalStandalone => {
                    if live {
                        if agentctls.len() != 1 {
                            failures.push(format!(
                                "{who}: {} agentctl processes, expected 1: {agentctls:?}",
                                agentctls.len()
                            ));
                        }
                        let same = matches!((r.pid, r.pid_start_time), (Some(p), Some(st)) if process::is_same_running(p, st));
                        if !same {
                            failures.push(format!(
                                "{who}: the recorded agentctl (pid {:?}, start {:?}) does not run",
                                r.pid, r.pid_start_time
                            ));
                        }
                    } else if !agentctls.is_empty() {
                        failures.push(format!(
                            "{who}: executor {} but agentctls run: {agentctls:?}",
                            r.status
                        ));
                    }
                }
                Runtime::LocalDocker => {
                    let cs = self
                        .containers_labelled(LABEL_SESSION_ID, &s.id.to_string())
                        .await;
                    if cs.len() > 1 {
                        failures.push(format!("{who}: {} containers: {cs:?}", cs.len()));
                    }
                    if live {
                        let ok = cs.len() == 1
                            && cs[0].1
                            && r.container_id.as_deref() == Some(cs[0].0.as_str());
                        if !ok {
                            failures.push(format!(
                                "{who}: recorded container {:?} is not the one running: {cs:?}",
                                r.container_id
                            ));
                        }
                        if agentctls.len() != 1 {
                            failures.push(format!(
                                "{who}: {} agentctl processes in its container, expected 1",
                                agentctls.len()
                            ));
                        }
                    } else if cs.iter().any(|c| c.1) {
                        failures.push(format!(
                            "{who}: executor {} but its container runs",
                            r.status
                        ));
                    }
                }
                Runtime::Remote => {
                    if !remote_ids.contains(&r.id.to_string()) {
                        failures.push(format!("{who}: not the remote host the test started"));
                    }
                    if agentctls.len() != 1 {
                        failures.push(format!(
                            "{who}: {} remote agentctls, expected the 1 the test started",
                            agentctls.len()
                        ));
                    }
                }
                Runtime::Custom(_) => failures.push(format!("{who}: a custom runtime")),
            }
            if live && r.runtime != Runtime::LocalDocker {
                for a in &agentctls {
                    let agents = children_of(*a)
                        .into_iter()
                        .filter(|k| is_running(*k))
                        .count();
                    if agents > 1 {
                        failures.push(format!("{who}: agentctl {a} runs {agents} agents"));
                    }
                }
            }
            if live {
                let status = mgr.session_status(self.task.id, s.id).await.unwrap();
                if status.executor_status != Some(ExecutorStatus::Ready) {
                    failures.push(format!(
                        "{who}: status API says executor {:?}",
                        status.executor_status
                    ));
                }
            }

            // Events: per-session seqs 1..n without a gap or a repeat.
            let events = self.store.events_after(s.id, 0, 1_000_000).await.unwrap();
            for (i, e) in events.iter().enumerate() {
                if e.seq != i as i64 + 1 {
                    failures.push(format!(
                        "{who}: event #{i} has seq {} (seqs {:?})",
                        e.seq,
                        events.iter().map(|e| e.seq).collect::<Vec<_>>()
                    ));
                    break;
                }
            }

            // Messages: the store against the agent's transcript.
            let mut msgs = self.store.list_messages(s.id, 0, 100_000).await.unwrap();
            // The conversation's text; the side effect's tool call parts
            // are the agent's activity, not turns.
            msgs.retain(|m| m.kind == sessiond_domain::MessageKind::Text);
            let turns = self.transcript(&s);
            turns_total += turns.len();
            if turns.is_empty() && msgs.iter().any(|m| m.role == MessageRole::Agent) {
                // Say where the checker looked and what is there, so a
                // mismatch of token or path is told apart from lost turns.
                failures.push(format!("{who}: {}", self.transcript_diagnosis(&s, &r)));
            }
            let mut seen = HashSet::new();
            for m in msgs.iter().filter(|m| m.role == MessageRole::User) {
                if !seen.insert(m.content.clone()) {
                    failures.push(format!("{who}: user message {:?} stored twice", m.content));
                }
            }
            let mut seen = HashSet::new();
            for (p, _) in &turns {
                if !seen.insert(p.clone()) {
                    failures.push(format!("{who}: the agent got prompt {p:?} twice"));
                }
            }
            // Side effects: the agent's tool call ran at most once per
            // prompt, and exactly once for every turn it finished.
            let side = std::fs::read_to_string(Path::new(&s.worktree.path).join(SIDE_EFFECT_FILE))
                .unwrap_or_default();
            let mut runs: HashMap<&str, usize> = HashMap::new();
            for line in side.lines() {
                *runs.entry(line).or_default() += 1;
            }
            side_effects += side.lines().count();
            for (p, n) in &runs {
                if *n > 1 {
                    failures.push(format!("{who}: the tool call of {p:?} ran {n} times"));
                }
            }
            for (p, _) in &turns {
                if runs.get(p.as_str()).copied().unwrap_or(0) != 1 {
                    failures.push(format!(
                        "{who}: the agent finished {p:?} but its tool call ran {} times",
                        runs.get(p.as_str()).copied().unwrap_or(0)
                    ));
                }
            }
            // The turn of user message `seq` ended interrupted: a system
            // message says so before the next user message.
            let interrupted_after = |seq: i64| {
                msgs.iter()
                    .skip_while(|m| m.seq <= seq)
                    .take_while(|m| m.role != MessageRole::User)
                    .any(|m| {
                        m.role == MessageRole::System
                            && m.content.starts_with("the turn was interrupted")
                    })
            };
            // Every turn of the agent is stored once: its prompt as one user
            // message, its reply as one complete agent message after it (or,
            // when the reply died with agentctl's buffer, the turn says it
            // was interrupted).
            let mut delivered = HashSet::new();
            let mut answers = HashSet::new();
            for (p, expected) in &turns {
                let Some(u) = msgs
                    .iter()
                    .find(|m| m.role == MessageRole::User && m.content == *p)
                else {
                    failures.push(format!(
                        "{who}: the agent answered {p:?}, which the store does not have"
                    ));
                    continue;
                };
                delivered.insert(u.seq);
                let whole = msgs
                    .iter()
                    .any(|m| m.role == MessageRole::Agent && m.content == *expected);
                if !whole && interrupted_after(u.seq) {
                    // Interrupted after the agent finished (its end lost
                    // with a killed agentctl): told, not re-run. A partial
                    // reply kept for it must be the start of the agent's.
                    for m in msgs
                        .iter()
                        .skip_while(|m| m.seq <= u.seq)
                        .take_while(|m| m.role != MessageRole::User)
                        .filter(|m| {
                            m.role == MessageRole::Agent && m.content.contains(INTERRUPTED_MARK)
                        })
                    {
                        let kept = m.content.split("\n\n[sessiond:").next().unwrap_or("");
                        if !expected.starts_with(kept) {
                            failures.push(format!(
                                "{who}: partial reply {:?} is not the start of the agent's {expected:?}",
                                m.content
                            ));
                        }
                    }
                    lost_ends += 1;
                    interrupted += 1;
                    continue;
                }
                let replies: Vec<_> = msgs
                    .iter()
                    .filter(|m| m.role == MessageRole::Agent && m.content == *expected)
                    .collect();
                match replies.as_slice() {
                    [r] if r.complete && r.seq > u.seq => {
                        answers.insert(r.seq);
                        let later_user = msgs
                            .iter()
                            .any(|m| m.role == MessageRole::User && m.seq > u.seq && m.seq < r.seq);
                        if later_user {
                            out_of_order += 1;
                            failures.push(format!(
                                "{who}: the reply to {p:?} (seq {}) is stored after a later user message",
                                r.seq
                            ));
                        }
                    }
                    [] => failures.push(format!(
                        "{who}: the agent answered {p:?} but no complete reply is stored (lost)"
                    )),
                    many => failures.push(format!(
                        "{who}: the reply to {p:?} is stored {} times or misplaced: {:?}",
                        many.len(),
                        many.iter().map(|m| (m.seq, m.complete)).collect::<Vec<_>>()
                    )),
                }
            }
            for m in &msgs {
                match m.role {
                    // At most once: a turn that may have reached an agent
                    // is not re-sent but ends with an explicit "interrupted"
                    // system message, which is a valid end for a user message.
                    MessageRole::User
                        if !delivered.contains(&m.seq)
                            && msgs.iter().any(|s| {
                                s.role == MessageRole::System
                                    && s.seq > m.seq
                                    && s.content.starts_with("the turn was interrupted")
                            }) =>
                    {
                        interrupted += 1;
                    }
                    MessageRole::User if !delivered.contains(&m.seq) => {
                        undelivered += 1;
                        failures.push(format!(
                            "{who}: stored user message {:?} (seq {}) never reached the agent",
                            m.content, m.seq
                        ));
                    }
                    // A partial reply of an interrupted turn, marked so.
                    MessageRole::Agent
                        if !answers.contains(&m.seq) && m.content.contains(INTERRUPTED_MARK) => {}
                    MessageRole::Agent if !answers.contains(&m.seq) => failures.push(format!(
                        "{who}: agent message seq {} (complete: {}) is no turn of the agent: {:?}",
                        m.seq, m.complete, m.content
                    )),
                    _ => {}
                }
            }
        }
        // Worktrees sessiond made, on every runtime: none lost (each
        // session's directory is there, on its branch, which exists, and
        // git lists it), none orphaned (no worktree git lists and no
        // directory under a worktrees root that no session records).
        let mut repos = vec![repository(self.dir.path())];
        if self.has_docker() {
            repos.push(docker_repository(self.dir.path()));
        }
        let listed: Vec<(String, String)> =
            repos.iter().flat_map(|r| listed_worktrees_of(r)).collect();
        let sessions = self.sessions().await;
        for s in sessions.iter() {
            let who = format!(
                "session {} ({}, {}, {})",
                s.metadata.get(NAME_KEY).map(String::as_str).unwrap_or("?"),
                s.id,
                s.runtime,
                s.state
            );
            if !s.worktree.is_managed() {
                failures.push(format!(
                    "{who}: not created from a repository: {:?}",
                    s.worktree
                ));
                continue;
            }
            let branch_gone = s
                .error_message
                .as_deref()
                .is_some_and(|e| e.starts_with("worktree_branch_missing"));
            if branch_gone {
                failures.push(format!(
                    "{who}: its branch went missing: {:?}",
                    s.error_message
                ));
                continue;
            }
            let repo = Path::new(&s.worktree.repository);
            let branch_ref = format!("refs/heads/{}", s.worktree.branch);
            if git_status(repo, &["show-ref", "--verify", "--quiet", &branch_ref]) != Some(0) {
                failures.push(format!(
                    "{who}: branch {} is gone from {}",
                    s.worktree.branch, s.worktree.repository
                ));
            }
            let path = Path::new(&s.worktree.path);
            if !path.is_dir() {
                failures.push(format!("{who}: worktree {} is lost", s.worktree.path));
            } else {
                match try_git(path, &["symbolic-ref", "--short", "HEAD"]) {
                    Ok(head) if head == s.worktree.branch => {}
                    Ok(head) => failures.push(format!(
                        "{who}: worktree {} is on {head:?}, not on {}",
                        s.worktree.path, s.worktree.branch
                    )),
                    Err(e) => failures.push(format!(
                        "{who}: worktree {} is no checkout of {}: {e}",
                        s.worktree.path, s.worktree.branch
                    )),
                }
            }
            if !listed
                .iter()
                .any(|(p, b)| *p == s.worktree.path && *b == s.worktree.branch)
            {
                failures.push(format!(
                    "{who}: git does not list worktree {}",
                    s.worktree.path
                ));
            }
        }
        for (path, branch) in &listed {
            if !sessions.iter().any(|s| s.worktree.path == *path) {
                failures.push(format!(
                    "orphaned worktree {path} on {branch}: no session owns it"
                ));
            }
        }
        let mut roots = vec![self.path("worktrees")];
        if self.has_docker() {
            roots.push(docker_worktrees(self.dir.path()));
        }
        for root in roots {
            for entry in std::fs::read_dir(&root).into_iter().flatten().flatten() {
                let path = entry.path().display().to_string();
                if !sessions.iter().any(|s| s.worktree.path == path) {
                    failures.push(format!(
                        "orphaned directory {path} in a worktrees root: no session records it"
                    ));
                }
            }
        }
        if !failures.is_empty() {
            // In full on stdout (shown with the failed test), then short.
            println!("the world did not converge:\n  {}", failures.join("\n  "));
            fail(&summary(
                "the world did not converge",
                &failures,
                &self.states_line().await,
            ));
        }
        Converged {
            line: format!(
                "states {states:?}, {turns_total} agent turns matched, {side_effects} tool-call side effects (none repeated), {undelivered} stored user messages never reached the agent, {interrupted} ended interrupted (not re-sent; {lost_ends} of them after the agent finished, the end lost with its agentctl), {out_of_order} replies stored after a later user message"
            ),
            interrupted,
        }
    }

    /// Every session whose agent runs answers one more prompt, numbered after
    /// its transcript: the conversation continues where the agent left it.
    pub async fn prompt_all(&self, mgr: &SessionManager) -> usize {
        let mut n = 0;
        for s in self.sessions().await {
            if s.state != SessionState::WaitingForInput {
                continue;
            }
            let st = mgr.session_status(self.task.id, s.id).await.unwrap();
            if !st.is_agent_running {
                continue;
            }
            let before = self.transcript(&s).len();
            let text = format!("after the crashes {}", s.id);
            if let Err(e) = mgr.send_message(self.task.id, s.id, &text).await {
                let now = self.store.get_session(s.id).await.unwrap();
                fail(&format!(
                    "a prompt after the crashes was refused: {e}\n  {}\n  {}",
                    self.who(&now).await,
                    self.states_line().await
                ));
            }
            self.settle(Duration::from_secs(30)).await;
            let mut msgs = self.store.list_messages(s.id, 0, 100_000).await.unwrap();
            // The conversation's text; the side effect's tool call parts
            // are the agent's activity, not turns.
            msgs.retain(|m| m.kind == sessiond_domain::MessageKind::Text);
            let last = msgs.last().unwrap();
            let token = s.resume_token.clone().unwrap();
            let expected = format!(
                "turn {} of session {token}: you said \"{text}\"{REPLY_TAIL}",
                before + 1
            );
            if last.content != expected {
                let now = self.store.get_session(s.id).await.unwrap();
                fail(&format!(
                    "the conversation did not continue at the right turn: the last message is {:?} (seq {}, {}), expected {expected:?}\n  {}",
                    clip(&last.content, 200),
                    last.seq,
                    last.role,
                    self.who(&now).await
                ));
            }
            n += 1;
        }
        n
    }
}

impl Drop for World {
    /// A failed test may leave processes and containers: end every agentctl
    /// and agent naming this world's directory, remove labelled containers.
    fn drop(&mut self) {
        for pid in self.strays() {
            kill9(pid);
        }
        for r in self.remotes.get_mut().unwrap().iter_mut() {
            let _ = r.child.kill();
            let _ = r.child.wait();
        }
        if let Some((host, _)) = &self.docker {
            let host = host.clone();
            let task = self.task.id.to_string();
            let _ = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async move {
                    let d = bollard::Docker::connect_with_unix(
                        host.trim_start_matches("unix://"),
                        30,
                        bollard::API_DEFAULT_VERSION,
                    )?
                    .negotiate_version()
                    .await?;
                    let filters = HashMap::from([(
                        "label".to_owned(),
                        vec![format!("{LABEL_TASK_ID}={task}")],
                    )]);
                    let list = d
                        .list_containers(Some(ListContainersOptions {
                            all: true,
                            filters: Some(filters),
                            ..Default::default()
                        }))
                        .await?;
                    for c in list.into_iter().filter_map(|c| c.id) {
                        let _ = d
                            .remove_container(
                                &c,
                                Some(RemoveContainerOptions {
                                    force: true,
                                    ..Default::default()
                                }),
                            )
                            .await;
                    }
                    Ok::<_, bollard::errors::Error>(())
                })
            })
            .join();
        }
    }
}

/// The agents' switches. With `SESSIOND_CRASHLOOP_HEAVY` set, they also
/// behave like real ones: 1.5 s to start, CPU spent starting and per
/// stored message loaded, so kills land in the middle of slow launches.
fn agent_env() -> BTreeMap<String, String> {
    let mut env = BTreeMap::from([
        ("ACP_DEMO_SIDE_EFFECT_FILE".into(), SIDE_EFFECT_FILE.into()),
        ("ACP_DEMO_EXTRA_CHUNKS".into(), "3".into()),
        ("ACP_DEMO_CHUNK_DELAY_MS".into(), "30".into()),
    ]);
    if std::env::var_os("SESSIOND_CRASHLOOP_HEAVY").is_some() {
        env.extend([
            ("ACP_DEMO_STARTUP_MS".into(), "1500".into()),
            ("ACP_DEMO_BUSY_MS".into(), "300".into()),
            ("ACP_DEMO_RSS_MB".into(), "16".into()),
            ("ACP_DEMO_LOAD_MS_PER_MESSAGE".into(), "10".into()),
        ]);
    }
    env
}

async fn profile(store: &Store, name: &str, command: String, state_dir: String) -> AgentProfile {
    let now = Utc::now();
    store
        .upsert_agent_profile(&AgentProfile {
            id: AgentProfileId::new(),
            name: name.into(),
            command,
            args: vec!["--state-dir".into(), state_dir],
            // Every turn first makes a tool call with a side effect (one
            // line in the worktree, counted by the checks), then replies in
            // slow chunks, so kills land inside turns.
            env: agent_env(),
            supports_session_resume: true,
            container: None,
            auth_method: None,
            permission_policy: sessiond_domain::PermissionPolicy::Allow,
            permission_timeout: sessiond_domain::DEFAULT_PERMISSION_TIMEOUT,
            config_defaults: Default::default(),
            mcp_servers: Vec::new(),
            created_at: now,
            updated_at: now,
        })
        .await
        .unwrap()
}

/// What `create_session` needs for `plan`.
pub fn new_session(
    task: TaskId,
    local: AgentProfileId,
    docker: Option<AgentProfileId>,
    dir: &Path,
    plan: &Plan,
) -> NewSession {
    // Every session comes from a repository (sessiond makes its
    // worktree): Docker ones from the agent user's.
    let repo = match plan.runtime {
        Rt::Docker => docker_repository(dir),
        Rt::Standalone | Rt::Remote => repository(dir),
    };
    let worktree = Worktree {
        id: plan.name.clone(),
        repository: repo.display().to_string(),
        base: "main".into(),
        ..Default::default()
    };
    NewSession {
        task_id: task,
        agent_profile_id: match plan.runtime {
            Rt::Docker => docker.unwrap(),
            _ => local,
        },
        runtime: plan.runtime.runtime(),
        worktree,
        remote: plan.remote.as_ref().map(|r| RemoteAgentctl {
            executor_id: r.executor_id.parse().unwrap(),
            url: r.url.clone(),
            auth_secret: r.secret.clone(),
        }),
        metadata: BTreeMap::from([(NAME_KEY.to_owned(), plan.name.clone())]),
        mcp_servers: Vec::new(),
    }
}

/// A child backend and the marker lines it printed.
pub struct ChildBackend {
    pub child: std::process::Child,
    lines: Arc<Mutex<Vec<String>>>,
    pub log: PathBuf,
    pub tag: String,
}

impl ChildBackend {
    pub fn has(&self, marker: &str) -> bool {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .any(|l| l.starts_with(&format!("CRASHLOOP {marker}")))
    }

    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// Waits for `marker`; false when the child exited first or time ran out.
    pub async fn wait_for(&mut self, marker: &str, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        loop {
            if self.has(marker) {
                return true;
            }
            if self.child.try_wait().unwrap().is_some() {
                // Its last lines may still be in the pipe.
                tokio::time::sleep(Duration::from_millis(100)).await;
                return self.has(marker);
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits for the child to exit on its own (a failpoint killed it).
    pub async fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                tokio::time::sleep(Duration::from_millis(100)).await;
                return st;
            }
            if Instant::now() >= deadline {
                self.kill9();
                panic!(
                    "child backend {} did not die within {within:?}; lines {:?}\n{}",
                    self.tag,
                    self.lines(),
                    self.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// `kill -9` of the backend. Panics when it had already exited on its own
    /// (a panic in the child is a failure, not a crash we asked for).
    pub fn kill9(&mut self) -> ExitStatus {
        let early = self.child.try_wait().unwrap();
        kill9(self.child.id());
        let st = self.child.wait().unwrap();
        if let Some(early) = early {
            assert_eq!(
                early.signal(),
                Some(9),
                "child backend {} exited on its own ({early}) before it was killed\n{}",
                self.tag,
                self.log_tail()
            );
        }
        st
    }

    pub fn assert_killed_by_failpoint(&self, status: ExitStatus, name: &str) {
        assert_eq!(
            status.signal(),
            Some(9),
            "child backend {} ended with {status}, not SIGKILL\n{}",
            self.tag,
            self.log_tail()
        );
        assert!(
            self.has(&format!("FAILPOINT {name}")),
            "child backend {} died without hitting failpoint {name}: {:?}\n{}",
            self.tag,
            self.lines(),
            self.log_tail()
        );
    }

    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let from = lines.len().saturating_sub(40);
        format!(
            "--- last lines of {} ---\n{}",
            self.log.display(),
            lines[from..].join("\n")
        )
    }
}

/// Fails the test with `summary`, which must be short: a CI log shows only
/// the tail of a run. libtest prints a failed test's captured output (and
/// its panic message) only after the whole binary ends, behind the other
/// tests' output, so the summary is also written straight to the process's
/// stderr, uncaptured, where it lands right before the `... FAILED` line.
pub fn fail(summary: &str) -> ! {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "CRASH TEST FAILED: {summary}");
    panic!("{summary}");
}

/// `text` cut to `most` characters, marked when cut.
pub fn clip(text: &str, most: usize) -> String {
    match text.char_indices().nth(most) {
        Some((at, _)) => format!("{}...", &text[..at]),
        None => text.to_owned(),
    }
}

/// At most this many violations go into a failure's summary (the rest
/// are counted, and listed in full on the test's stdout before it).
const SUMMARY_VIOLATIONS: usize = 12;

/// The short failure summary of `violations`: how many, the first few
/// (each clipped), then `context` (e.g. the states of the sessions).
pub fn summary(title: &str, violations: &[String], context: &str) -> String {
    let mut out = format!("{title}: {} violation(s)", violations.len());
    for v in violations.iter().take(SUMMARY_VIOLATIONS) {
        out.push_str("\n  - ");
        out.push_str(&clip(v, 300));
    }
    if violations.len() > SUMMARY_VIOLATIONS {
        out.push_str(&format!(
            "\n  ... and {} more (listed in full above)",
            violations.len() - SUMMARY_VIOLATIONS
        ));
    }
    if !context.is_empty() {
        out.push_str("\n  ");
        out.push_str(context);
    }
    out
}

/// What [`World::converged`] found.
pub struct Converged {
    pub line: String,
    /// User messages whose turn ended interrupted (not re-sent).
    pub interrupted: usize,
}

/// (pid, command line with spaces) of every process.
pub fn proc_cmdlines() -> Vec<(u32, String)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if let Ok(c) = std::fs::read(format!("/proc/{pid}/cmdline")) {
            let text = String::from_utf8_lossy(&c).replace('\0', " ");
            out.push((pid, text));
        }
    }
    out
}
