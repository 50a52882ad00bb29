//! Starting the real `sessiond` binary and talking to it over loopback.
//! agentctl and acp-demo-agent must be built beside it
//! (`cargo build -p agentctl -p acp-demo-agent`, as `cargo xtask ci` does).

use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use sessiond_proto::sessiond::v1::{
    self as pb, session_service_client::SessionServiceClient,
    workspace_service_client::WorkspaceServiceClient,
};
use tonic::{
    metadata::{Ascii, MetadataValue},
    service::{Interceptor, interceptor::InterceptedService},
    transport::Channel,
};

pub const TOKEN: &str = "test-token-0123456789abcdef";

pub fn bin(name: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_BIN_EXE_sessiond"))
        .parent()
        .unwrap()
        .join(name);
    assert!(
        path.is_file(),
        "{} not found: build it first with `cargo build -p agentctl -p acp-demo-agent`",
        path.display()
    );
    path
}

/// A running `sessiond serve`; killed (SIGKILL) on drop, with every agentctl
/// it started (found by its data directory in their command lines).
pub struct Server {
    pub child: Option<Child>,
    pub addr: String,
    pub metrics: Option<String>,
    pub data_dir: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
        for pid in agentctl_pids(&self.data_dir) {
            let _ = Command::new("kill")
                .args(["-CONT", &pid.to_string()])
                .status();
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
    }
}

impl Server {
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// `kill -9` of sessiond, every agentctl of its data directory and
    /// everything they started, returning once none of them runs code any
    /// more. A test that opens a gate afterwards knows no agent passes it:
    /// an agent's own `PR_SET_PDEATHSIG` fires only when the agentctl thread
    /// that spawned it exits, which can come after agentctl's main thread
    /// already shows as a zombie.
    pub fn kill_everything(&mut self) {
        self.kill();
        let agentctls = agentctl_pids(&self.data_dir);
        let mut doomed = agentctls.clone();
        for pid in &agentctls {
            doomed.extend(descendants(*pid));
        }
        for pid in &doomed {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while let Some(pid) = doomed.iter().find(|pid| runs(**pid)) {
            assert!(
                std::time::Instant::now() < deadline,
                "process {pid} outlived kill -9"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM, then wait for a clean exit.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().unwrap();
        Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .unwrap();
        child.wait().unwrap()
    }
}

/// Every descendant of `pid`. A process's children are listed per thread
/// (`/proc/PID/task/TID/children`): agentctl spawns its agent from a tokio
/// worker thread, so the main thread's list alone misses it.
pub fn descendants(pid: u32) -> Vec<u32> {
    let mut found = Vec::new();
    let mut todo = vec![pid];
    while let Some(parent) = todo.pop() {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{parent}/task")) else {
            continue;
        };
        for task in tasks.flatten() {
            let children =
                std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
            for child in children
                .split_whitespace()
                .filter_map(|c| c.parse::<u32>().ok())
            {
                if !found.contains(&child) {
                    found.push(child);
                    todo.push(child);
                }
            }
        }
    }
    found
}

/// Whether `pid` can still run code: it exists and none of its threads has
/// ended yet (a thread group shows its leader as a zombie while the other
/// threads are still exiting, so every thread is looked at).
fn runs(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().any(|task| {
        std::fs::read_to_string(task.path().join("stat")).is_ok_and(|stat| {
            let state = stat.rsplit(')').next().unwrap_or("").trim_start();
            !(state.starts_with('Z') || state.starts_with('X'))
        })
    })
}

/// Pids of agentctl processes whose command line mentions `data_dir`.
/// SIGKILLs every agentctl of `data_dir` (their agents die with them) and
/// waits until none is left.
pub async fn kill_agentctls_and_wait(data_dir: &Path) {
    for pid in agentctl_pids(data_dir) {
        std::process::Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .unwrap();
    }
    for _ in 0..400 {
        if agentctl_pids(data_dir).is_empty() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    panic!("old agentctls still alive: {:?}", agentctl_pids(data_dir));
}

pub fn agentctl_pids(data_dir: &Path) -> Vec<u32> {
    let needle = data_dir.display().to_string();
    let mut pids = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return pids;
    };
    for entry in entries.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains("agentctl") && cmdline.contains(&needle) {
            // Skip zombies: they are gone already.
            let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
            if !stat.contains(") Z ") {
                pids.push(pid);
            }
        }
    }
    pids
}

/// Starts `sessiond serve` on a free loopback port with `TOKEN`, metrics on
/// a free port, the given extra arguments, and waits for its listening line.
pub fn start(data_dir: &Path, extra: &[&str]) -> Server {
    start_with(data_dir, extra, Some(TOKEN), None)
}

/// As [`start`], with the given API token (none: the caller passes
/// `--insecure-no-auth`) and stderr to `stderr` when given.
pub fn start_with(
    data_dir: &Path,
    extra: &[&str],
    token: Option<&str>,
    stderr: Option<&Path>,
) -> Server {
    start_env(data_dir, extra, token, stderr, &[])
}

/// As [`start_with`], with extra environment variables.
pub fn start_env(
    data_dir: &Path,
    extra: &[&str],
    token: Option<&str>,
    stderr: Option<&Path>,
    envs: &[(&str, &Path)],
) -> Server {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sessiond"));
    match token {
        Some(t) => cmd.env("SESSIOND_API_TOKENS", t),
        None => cmd.env_remove("SESSIOND_API_TOKENS"),
    };
    if let Some(path) = stderr {
        cmd.stderr(std::fs::File::create(path).unwrap());
    }
    cmd.args([
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
    ])
    .arg("--data-dir")
    .arg(data_dir)
    .args(extra)
    // Tests keep their worktrees in temporary directories.
    .env(
        "SESSIOND_WORKTREE_ROOTS",
        std::fs::canonicalize(std::env::temp_dir()).unwrap(),
    )
    .env_remove("SESSIOND_DATABASE_URL")
    .env_remove("SESSIOND_CONFIG")
    .env("SESSIOND_LOG", "info,sessiond=debug")
    .stdout(Stdio::piped());
    // The caller's variables win over the defaults above.
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("spawn sessiond");
    let stdout = child.stdout.take().expect("stdout");
    let mut reader = BufReader::new(stdout);
    let mut line = String::new();
    reader
        .read_line(&mut line)
        .expect("read the listening line");
    let addr = line
        .trim()
        .strip_prefix("sessiond listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();
    let mut second = String::new();
    reader
        .read_line(&mut second)
        .expect("read the metrics line");
    let metrics = second
        .trim()
        .strip_prefix("sessiond metrics on ")
        .map(str::to_owned);
    Server {
        child: Some(child),
        addr,
        metrics,
        data_dir: data_dir.to_owned(),
    }
}

/// Runs `sessiond` with `args` to completion (for configuration errors).
pub fn run_sessiond(args: &[&str], envs: &[(&str, &str)]) -> (bool, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sessiond"));
    cmd.args(args)
        .env_remove("SESSIOND_API_TOKENS")
        .env_remove("SESSIOND_CONFIG");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[derive(Clone)]
pub struct Bearer(Option<MetadataValue<Ascii>>);

impl Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

pub type Sessions = SessionServiceClient<InterceptedService<Channel, Bearer>>;
pub type Workspaces = WorkspaceServiceClient<InterceptedService<Channel, Bearer>>;

pub async fn channel(addr: &str) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// A health `Watch` (of the server as a whole) opened on `addr`, and the
/// status it answered first.
pub async fn health_watch(
    addr: &str,
) -> (
    tonic::Streaming<tonic_health::pb::HealthCheckResponse>,
    tonic_health::pb::health_check_response::ServingStatus,
) {
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel(addr).await);
    let mut watch = health
        .watch(tonic_health::pb::HealthCheckRequest::default())
        .await
        .unwrap()
        .into_inner();
    let first = watch.message().await.unwrap().unwrap();
    (watch, first.status())
}

pub fn bearer(token: Option<&str>) -> Bearer {
    Bearer(token.map(|t| format!("Bearer {t}").parse().unwrap()))
}

pub async fn sessions(server: &Server) -> Sessions {
    sessions_with(server, Some(TOKEN)).await
}

/// A client of the server at `addr`, with `TOKEN`.
pub async fn sessions_at(addr: &str) -> Sessions {
    SessionServiceClient::with_interceptor(channel(addr).await, bearer(Some(TOKEN)))
}

/// A client of the server at `addr`, with `TOKEN`, or why it could not
/// connect (a replica killed a moment ago).
pub async fn try_sessions_at(addr: &str) -> Result<Sessions, tonic::transport::Error> {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await?;
    Ok(SessionServiceClient::with_interceptor(
        channel,
        bearer(Some(TOKEN)),
    ))
}

pub async fn sessions_with(server: &Server, token: Option<&str>) -> Sessions {
    SessionServiceClient::with_interceptor(channel(&server.addr).await, bearer(token))
        .max_decoding_message_size(64 * 1024 * 1024)
}

pub async fn workspaces(server: &Server) -> Workspaces {
    workspaces_with(server, Some(TOKEN)).await
}

pub async fn workspaces_with(server: &Server, token: Option<&str>) -> Workspaces {
    WorkspaceServiceClient::with_interceptor(channel(&server.addr).await, bearer(token))
}

pub async fn create_task(c: &mut Sessions, title: &str) -> pb::Task {
    c.create_task(pb::CreateTaskRequest {
        title: title.into(),
    })
    .await
    .unwrap()
    .into_inner()
    .task
    .unwrap()
}

pub async fn create_session(
    c: &mut Sessions,
    task: &str,
    worktree: &Path,
    profile: &str,
) -> pb::Session {
    c.create_session(pb::CreateSessionRequest {
        agent_profile: profile.into(),
        ..in_directory(task, &worktree.display().to_string())
    })
    .await
    .unwrap()
    .into_inner()
    .session
    .unwrap()
}

/// A CreateSession of a local standalone session of the default profile
/// working in the existing directory `path`.
pub fn in_directory(task: &str, path: &str) -> pb::CreateSessionRequest {
    pb::CreateSessionRequest {
        task_id: task.into(),
        runtime: pb::Runtime::LocalStandalone as i32,
        worktree: Some(pb::Worktree {
            path: path.into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Sends `text` to a session waiting for input: the user message its turn
/// started with.
pub async fn send(c: &mut Sessions, task: &str, session: &str, text: &str) -> pb::Message {
    c.send_message(pb::SendMessageRequest {
        task_id: task.into(),
        session_id: session.into(),
        content: text.into(),
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner()
    .message
    .unwrap()
}

/// The session as stored (GetSession).
/// The task's sessions, as ListSessions answers.
pub async fn list(c: &mut Sessions, task: &str) -> Vec<pb::Session> {
    c.list_sessions(pb::ListSessionsRequest {
        task_id: task.into(),
    })
    .await
    .unwrap()
    .into_inner()
    .sessions
}

pub async fn get(c: &mut Sessions, task: &str, session: &str) -> pb::Session {
    c.get_session(pb::GetSessionRequest {
        task_id: task.into(),
        session_id: session.into(),
    })
    .await
    .unwrap()
    .into_inner()
    .session
    .unwrap()
}

/// The session's title as stored.
pub async fn title(c: &mut Sessions, task: &str, session: &str) -> String {
    get(c, task, session).await.title
}

/// The session's messages, oldest first (up to 1,000).
pub async fn messages(c: &mut Sessions, task: &str, session: &str) -> Vec<pb::Message> {
    c.list_messages(pb::ListMessagesRequest {
        task_id: task.into(),
        session_id: session.into(),
        page_size: 1000,
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner()
    .messages
}

/// Sends `text` and waits (through WatchSession) for the agent's complete
/// reply; returns its content.
pub async fn prompt(c: &mut Sessions, task: &str, session: &str, text: &str) -> String {
    let sent = send(c, task, session, text).await;
    let mut stream = c
        .watch_session(pb::WatchSessionRequest {
            session_id: session.into(),
            after_seq: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let mut reply = None;
    while let Ok(Some(event)) = tokio::time::timeout(Duration::from_secs(30), stream.message())
        .await
        .unwrap()
    {
        match event.payload {
            Some(pb::event::Payload::MessageUpdated(pb::MessageUpdated { message: Some(m) }))
            | Some(pb::event::Payload::MessageAdded(pb::MessageAdded { message: Some(m) }))
                if m.role == pb::MessageRole::Agent as i32
                    && m.kind == pb::MessageKind::Text as i32
                    && m.seq > sent.seq
                    && m.complete =>
            {
                reply = Some(m.content);
                break;
            }
            _ => {}
        }
    }
    // The turn ends (WAITING_FOR_INPUT) right after the reply is complete.
    for _ in 0..200 {
        let s = c
            .get_session(pb::GetSessionRequest {
                task_id: task.into(),
                session_id: session.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .session
            .unwrap();
        if s.state == pb::SessionState::WaitingForInput as i32 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    reply.expect("the agent's reply")
}

pub fn code<T: std::fmt::Debug>(result: Result<T, tonic::Status>) -> tonic::Code {
    match result {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(status) => status.code(),
    }
}

/// WatchSession from the first event (the stored replay, then live).
pub async fn watch_from_start(c: &mut Sessions, session: &str) -> tonic::Streaming<pb::Event> {
    c.watch_session(pb::WatchSessionRequest {
        session_id: session.into(),
        after_seq: 0,
    })
    .await
    .unwrap()
    .into_inner()
}

/// Follows WatchSession from the start until `pick` returns something.
pub async fn wait_for<T>(
    c: &mut Sessions,
    session: &str,
    mut pick: impl FnMut(&pb::Event) -> Option<T>,
) -> T {
    let mut stream = watch_from_start(c, session).await;
    loop {
        let e = tokio::time::timeout(Duration::from_secs(60), stream.message())
            .await
            .expect("the event within 60 s")
            .unwrap()
            .expect("stream open");
        if let Some(t) = pick(&e) {
            return t;
        }
    }
}

/// Waits for the `turn_ended` of turn `turn` (its user message id).
pub async fn turn_end(c: &mut Sessions, session: &str, turn: &str) -> pb::TurnEnded {
    wait_for(c, session, |e| match &e.payload {
        Some(pb::event::Payload::TurnEnded(t)) if t.turn_id == turn => Some(t.clone()),
        _ => None,
    })
    .await
}

/// Every stored event of the session so far (WatchSession's replay).
pub async fn replayed_events(c: &mut Sessions, session: &str) -> Vec<pb::Event> {
    let mut stream = watch_from_start(c, session).await;
    let mut out = Vec::new();
    // The replay comes at once; the tail then stays quiet.
    while let Ok(Ok(Some(e))) =
        tokio::time::timeout(Duration::from_millis(500), stream.message()).await
    {
        out.push(e);
    }
    out
}
