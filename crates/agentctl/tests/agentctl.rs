//! agentctl end to end: the real `agentctl` binary, the real `acp-demo-agent`,
//! a real tonic client over loopback.
//!
//! Every test works under its own temporary directory, and every process it
//! starts carries that directory on its command line (`--workspace`,
//! `--state-dir`), so the harness can prove nothing is left behind and kill
//! whatever is.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use sessiond_proto::agentctl::v1::agent_ctl_service_client::AgentCtlServiceClient;
use sessiond_proto::agentctl::v1::agent_update::Kind;
use sessiond_proto::agentctl::v1::*;
use tokio::io::{AsyncBufReadExt, BufReader};
use tonic::Code;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

const SECRET: &str = "test-secret-0123456789";
const WAIT: Duration = Duration::from_secs(20);

type Client = AgentCtlServiceClient<InterceptedService<Channel, Bearer>>;

#[derive(Clone)]
struct Bearer(Option<String>);

impl Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut()
                .insert("authorization", v.parse().expect("header value"));
        }
        Ok(req)
    }
}

fn agentctl_exe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_agentctl"))
}

/// `acp-demo-agent` sits next to `agentctl` in the target directory; build it
/// when it is not there yet (e.g. `cargo test -p agentctl` on a fresh tree).
fn demo_agent_exe() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let exe = agentctl_exe()
                .parent()
                .expect("target dir")
                .join("acp-demo-agent");
            if !exe.exists() {
                let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
                let status = std::process::Command::new(cargo)
                    .args(["build", "-p", "acp-demo-agent"])
                    .status();
                assert!(
                    exe.exists(),
                    "{} is missing and building it failed ({status:?}); run `cargo build -p acp-demo-agent` first",
                    exe.display()
                );
            }
            exe
        })
        .clone()
}

/// One test's world: a temporary base with `ws/` (the workspace), `state/`
/// (the demo agent's transcripts) and `outside/` (must stay untouched).
struct Harness {
    base: tempfile::TempDir,
    /// A shell command run before agentctl is exec'd in its place (what
    /// a parent leaves: ignored signals, open descriptors).
    before_exec: Option<&'static str>,
}

impl Harness {
    fn new() -> Self {
        let base = tempfile::Builder::new()
            .prefix("agentctl-test-")
            .tempdir()
            .expect("tempdir");
        for d in ["ws", "state", "outside"] {
            std::fs::create_dir_all(base.path().join(d)).expect("mkdir");
        }
        std::fs::write(base.path().join("outside/secret.txt"), "top secret").expect("write");
        Self {
            base,
            before_exec: None,
        }
    }

    fn ws(&self) -> PathBuf {
        self.base.path().join("ws")
    }

    fn outside(&self) -> PathBuf {
        self.base.path().join("outside")
    }

    fn marker(&self) -> String {
        self.base.path().to_string_lossy().into_owned()
    }

    async fn spawn(&self, extra: &[&str]) -> Ctl {
        self.spawn_env(extra, &[]).await
    }

    async fn spawn_env(&self, extra: &[&str], env: &[(&str, &str)]) -> Ctl {
        let ws = self.ws();
        self.spawn_at(&["--workspace".as_ref(), ws.as_os_str()], extra, env)
            .await
    }

    /// `place`: `--workspace DIR`, or `--worktree-root DIR` (a remote host's).
    async fn spawn_at(
        &self,
        place: &[&std::ffi::OsStr],
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Ctl {
        let port_file = self.base.path().join("agentctl.port");
        let log = std::fs::File::create(self.base.path().join("agentctl.log")).expect("log");
        let mut cmd = match self.before_exec {
            Some(before) => {
                let mut sh = tokio::process::Command::new("sh");
                sh.arg("-c")
                    .arg(format!("{before}; exec \"$0\" \"$@\""))
                    .arg(agentctl_exe());
                sh
            }
            None => tokio::process::Command::new(agentctl_exe()),
        };
        let mut child = cmd
            .arg("--executor-id")
            .arg("exec-test")
            .args(place)
            .arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--port-file")
            .arg(&port_file)
            .args(extra)
            .envs(env.iter().copied())
            .env("AGENTCTL_SECRET", SECRET)
            .env("AGENTCTL_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .expect("spawn agentctl");
        let pid = child.id().expect("pid");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(WAIT, lines.next_line())
            .await
            .expect("agentctl printed nothing")
            .expect("read stdout")
            .expect("agentctl closed stdout");
        let addr = line
            .strip_prefix("agentctl listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .to_owned();
        let port: u16 = std::fs::read_to_string(&port_file)
            .expect("port file")
            .trim()
            .parse()
            .expect("port number");
        assert!(
            addr.ends_with(&format!(":{port}")),
            "{addr} vs port file {port}"
        );
        Ctl { child, pid, addr }
    }

    fn demo(&self, claim: bool, env: &[(&str, &str)]) -> LaunchAgentRequest {
        LaunchAgentRequest {
            command: demo_agent_exe().to_string_lossy().into_owned(),
            args: vec![
                "--state-dir".into(),
                self.base
                    .path()
                    .join("state")
                    .to_string_lossy()
                    .into_owned(),
            ],
            env: env
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect::<HashMap<_, _>>(),
            profile_supports_session_resume: claim,
            initialize_timeout_ms: 20_000,
            ..Default::default()
        }
    }

    /// Processes (not zombies) whose command line mentions this test's base.
    fn leftovers(&self) -> Vec<u32> {
        let marker = self.marker();
        let mut found = Vec::new();
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return found;
        };
        for entry in dir.flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
                continue;
            };
            if !String::from_utf8_lossy(&cmdline).contains(&marker) {
                continue;
            }
            if is_zombie(pid) {
                continue;
            }
            found.push(pid);
        }
        found
    }

    /// Waits until nothing this test started is alive.
    async fn assert_no_leftovers(&self) {
        let deadline = Instant::now() + WAIT;
        loop {
            let left = self.leftovers();
            if left.is_empty() {
                return;
            }
            assert!(Instant::now() < deadline, "processes left behind: {left:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        // Whatever a failed test left running dies with it.
        for pid in self.leftovers() {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
    }
}

fn is_zombie(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return true;
    };
    // The state follows the parenthesised command name.
    stat.rsplit_once(") ")
        .and_then(|(_, rest)| rest.chars().next())
        .is_none_or(|s| s == 'Z' || s == 'X')
}

fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists() && !is_zombie(pid)
}

async fn wait_dead(pid: u32) {
    let deadline = Instant::now() + WAIT;
    while alive(pid) {
        assert!(Instant::now() < deadline, "pid {pid} still alive");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

struct Ctl {
    child: tokio::process::Child,
    pid: u32,
    addr: String,
}

impl Ctl {
    async fn client_with(&self, auth: Option<String>) -> Client {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", self.addr))
            .expect("endpoint")
            .connect()
            .await
            .expect("connect");
        AgentCtlServiceClient::with_interceptor(channel, Bearer(auth))
    }

    async fn client(&self) -> Client {
        self.client_with(Some(format!("Bearer {SECRET}"))).await
    }

    fn signal(&self, sig: &str) {
        let status = std::process::Command::new("kill")
            .args([sig, &self.pid.to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
    }

    async fn wait_exit(&mut self) -> std::process::ExitStatus {
        tokio::time::timeout(WAIT, self.child.wait())
            .await
            .expect("agentctl did not exit")
            .expect("wait")
    }

    /// SIGTERM, and agentctl must exit 0.
    async fn shutdown(mut self) {
        self.signal("-TERM");
        let status = self.wait_exit().await;
        assert_eq!(status.code(), Some(0), "agentctl exit status {status:?}");
    }
}

/// A live update stream.
struct Stream {
    inner: tonic::Streaming<AgentUpdate>,
}

impl Stream {
    async fn open(client: &mut Client, after: u64) -> Self {
        let inner = client
            .stream_updates(StreamUpdatesRequest {
                after_cursor: after,
            })
            .await
            .expect("stream_updates")
            .into_inner();
        Self { inner }
    }

    async fn next(&mut self) -> AgentUpdate {
        tokio::time::timeout(WAIT, self.inner.message())
            .await
            .expect("no update in time")
            .expect("stream error")
            .expect("stream ended")
    }

    /// Reads until `pred` holds for an update; returns everything read.
    async fn until(&mut self, pred: impl Fn(&AgentUpdate) -> bool) -> Vec<AgentUpdate> {
        let mut seen = Vec::new();
        loop {
            let u = self.next().await;
            let done = pred(&u);
            seen.push(u);
            if done {
                return seen;
            }
        }
    }

    async fn until_turn_end(&mut self, turn_id: &str) -> Vec<AgentUpdate> {
        self.until(|u| matches!(&u.kind, Some(Kind::TurnEnded(t)) if t.turn_id == turn_id))
            .await
    }
}

fn reply_text(updates: &[AgentUpdate], message_id: &str) -> (String, usize) {
    let chunks: Vec<&str> = updates
        .iter()
        .filter_map(|u| match &u.kind {
            Some(Kind::MessageChunk(c)) if c.message_id == message_id => Some(c.text.as_str()),
            _ => None,
        })
        .collect();
    (chunks.concat(), chunks.len())
}

fn turn_end(updates: &[AgentUpdate]) -> TurnEnded {
    updates
        .iter()
        .find_map(|u| match &u.kind {
            Some(Kind::TurnEnded(t)) => Some(t.clone()),
            _ => None,
        })
        .expect("TurnEnded")
}

async fn prompt(client: &mut Client, stream: &mut Stream, text: &str) -> (String, TurnEnded) {
    let resp = client
        .prompt(PromptRequest {
            text: text.into(),
            turn_id: String::new(),
            ..Default::default()
        })
        .await
        .expect("prompt")
        .into_inner();
    let updates = stream.until_turn_end(&resp.turn_id).await;
    // The turn is on the stream, with its text, ahead of its reply.
    let started = updates
        .iter()
        .position(|u| matches!(&u.kind, Some(Kind::TurnStarted(t)) if t.turn_id == resp.turn_id))
        .unwrap_or_else(|| panic!("no TurnStarted: {updates:?}"));
    let Some(Kind::TurnStarted(t)) = &updates[started].kind else {
        unreachable!()
    };
    assert_eq!(
        (t.text.as_str(), t.earlier_instance),
        (text, false),
        "{t:?}"
    );
    assert!(
        updates[..started]
            .iter()
            .all(|u| !matches!(&u.kind, Some(Kind::MessageChunk(c)) if c.turn_id == resp.turn_id)),
        "a chunk before its TurnStarted: {updates:?}"
    );
    let (reply, chunks) = reply_text(&updates, &resp.message_id);
    let end = turn_end(&updates);
    if end.stop_reason == "end_turn" {
        assert!(chunks >= 3, "reply in {chunks} chunks: {updates:?}");
    }
    (reply, end)
}

/// Launches the agent and opens a conversation: its resume token.
async fn launch_and_open(client: &mut Client, launch: LaunchAgentRequest) -> String {
    client.launch_agent(launch).await.expect("launch");
    client
        .new_session(NewSessionRequest {})
        .await
        .expect("session")
        .into_inner()
        .resume_token
}

async fn health(client: &mut Client) -> HealthResponse {
    client
        .health(HealthRequest {})
        .await
        .expect("health")
        .into_inner()
}

async fn caps(client: &mut Client) -> CapabilitiesResponse {
    client
        .capabilities(CapabilitiesRequest {})
        .await
        .expect("capabilities")
        .into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn launch_prompt_stop_relaunch_resume_continues_conversation() {
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;

    let hl = health(&mut c).await;
    assert_eq!(hl.executor_id, "exec-test");
    assert_eq!(hl.agent_state(), AgentState::None);
    assert_eq!(hl.pid, ctl.pid);
    let cp = caps(&mut c).await;
    assert_eq!(cp.supports_session_resume(), Capability::Unknown);
    assert_eq!(cp.supports_workspace_only(), Capability::Supported);
    // Nothing to prompt yet.
    let err = c
        .prompt(PromptRequest {
            text: "x".into(),
            turn_id: String::new(),
            ..Default::default()
        })
        .await
        .expect_err("no agent");
    assert_eq!(err.code(), Code::FailedPrecondition);

    let mut stream = Stream::open(&mut c, 0).await;
    let launched = c
        .launch_agent(h.demo(true, &[]))
        .await
        .expect("launch")
        .into_inner();
    assert!(launched.agent_load_session);
    assert_eq!(launched.agent_name, "acp-demo-agent");
    let first_pid = launched.agent_pid;
    assert!(alive(first_pid));
    assert_eq!(health(&mut c).await.agent_state(), AgentState::Ready);
    assert_eq!(
        health(&mut c).await.acp_session_id,
        "",
        "launched: no conversation open yet"
    );
    assert_eq!(
        caps(&mut c).await.supports_session_resume(),
        Capability::Supported
    );
    let again = c
        .launch_agent(h.demo(true, &[]))
        .await
        .expect_err("second launch");
    assert_eq!(again.code(), Code::FailedPrecondition);

    let token = c
        .new_session(NewSessionRequest {})
        .await
        .expect("new session")
        .into_inner()
        .resume_token;
    assert!(!token.is_empty());
    assert_eq!(health(&mut c).await.acp_session_id, token);
    let (r1, e1) = prompt(&mut c, &mut stream, "hello").await;
    assert_eq!(e1.stop_reason, "end_turn");
    assert_eq!(r1, format!("turn 1 of session {token}: you said \"hello\""));
    let (r2, _) = prompt(&mut c, &mut stream, "second").await;
    assert_eq!(
        r2,
        format!("turn 2 of session {token}: you said \"second\"")
    );

    let stopped = c
        .stop_agent(StopAgentRequest { grace_ms: 2000 })
        .await
        .expect("stop")
        .into_inner();
    assert!(stopped.exit.is_some());
    wait_dead(first_pid).await;
    let hl = health(&mut c).await;
    assert_eq!(hl.agent_state(), AgentState::Exited);
    assert_eq!(
        hl.acp_session_id, "",
        "the conversation ended with the agent"
    );
    assert!(hl.agent_exit.is_some());
    stream
        .until(|u| matches!(u.kind, Some(Kind::AgentExited(_))))
        .await;

    // A new agent process, the same conversation, reloaded by
    // `session/load` (the agent offers no `session/resume`).
    let relaunched = c
        .launch_agent(h.demo(true, &[("ACP_DEMO_NO_RESUME_SESSION", "1")]))
        .await
        .expect("relaunch")
        .into_inner();
    assert_ne!(relaunched.agent_pid, first_pid);
    let before = health(&mut c).await;
    assert_eq!(before.agent_state(), AgentState::Ready);
    let resumed = c
        .resume_session(ResumeSessionRequest {
            resume_token: token.clone(),
        })
        .await
        .expect("resume")
        .into_inner();
    assert_eq!(resumed.resume_token, token);
    assert_eq!(resumed.method(), ResumeMethod::Load);
    assert_eq!(resumed.replayed, 4, "two turns, a prompt and a reply each");
    let resp = c
        .prompt(PromptRequest {
            text: "third".into(),
            turn_id: "my-turn-3".into(),
            ..Default::default()
        })
        .await
        .expect("prompt")
        .into_inner();
    assert_eq!(resp.turn_id, "my-turn-3");
    let updates = stream.until_turn_end("my-turn-3").await;
    // The two replayed turns were not re-emitted: every chunk seen since the
    // relaunch belongs to the new turn.
    for u in &updates {
        if let Some(Kind::MessageChunk(m)) = &u.kind {
            assert_eq!(m.turn_id, "my-turn-3", "replayed history leaked: {u:?}");
            assert_eq!(m.message_id, resp.message_id);
        }
    }
    // The agent did replay both turns (prompt + reply each) during the load.
    let log = std::fs::read_to_string(h.base.path().join("agentctl.log")).expect("log");
    assert!(
        log.lines()
            .any(|l| l.contains("session/load done") && l.contains("replayed=4")),
        "no replay recorded in the log:\n{log}"
    );
    let (r3, _) = reply_text(&updates, &resp.message_id);
    assert_eq!(r3, format!("turn 3 of session {token}: you said \"third\""));

    // An unknown token is refused by the agent with a clear error.
    let err = c
        .resume_session(ResumeSessionRequest {
            resume_token: "no-such-session".into(),
        })
        .await
        .expect_err("unknown token");
    assert_eq!(err.code(), Code::NotFound, "{err:?}");

    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

/// Prompt is idempotent by `turn_id`: the same id again (while the turn
/// runs, after it ended, after the agent was relaunched in the same agentctl)
/// starts nothing and answers with the first call's ids; the agent answers
/// the prompt once. A new id still starts a turn.
/// helper-34 D1: a backend killed while (or just after) the agent opened
/// its conversation asks `NewSession` again, and the Claude Code adapter
/// kept a CLI process for each conversation. agentctl answers with the
/// conversation it opened as long as nobody prompted it; once prompted, a
/// `NewSession` opens another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_session_asked_again_before_a_prompt_answers_the_same_conversation() {
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    let mut stream = Stream::open(&mut c, 0).await;
    let launched = c
        .launch_agent(h.demo(true, &[]))
        .await
        .expect("launch")
        .into_inner();
    let open = async |c: &mut Client| {
        c.new_session(NewSessionRequest {})
            .await
            .expect("session")
            .into_inner()
            .resume_token
    };
    let first = open(&mut c).await;
    let again = open(&mut c).await;
    assert_eq!(again, first, "a second conversation for the same request");
    let (reply, _) = prompt(&mut c, &mut stream, "hello").await;
    assert!(reply.contains("hello"), "{reply}");
    let after_a_turn = open(&mut c).await;
    assert_ne!(
        after_a_turn, first,
        "a prompted conversation is not reopened as new"
    );
    let news = calls_of(&h, launched.agent_pid)
        .into_iter()
        .filter(|(m, _)| m == "session/new")
        .count();
    assert_eq!(news, 2, "session/new calls the agent got");
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_is_idempotent_by_turn_id() {
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    let mut stream = Stream::open(&mut c, 0).await;
    // Slow chunks, so the duplicate arrives while the turn runs.
    let token = launch_and_open(&mut c, h.demo(true, &[("ACP_DEMO_CHUNK_DELAY_MS", "300")])).await;
    let req = || PromptRequest {
        text: "only once".into(),
        turn_id: "turn-a".into(),
        ..Default::default()
    };
    let first = c.prompt(req()).await.expect("prompt").into_inner();
    assert_eq!(first.turn_id, "turn-a");
    assert!(!first.already_accepted);
    // While it runs.
    let dup = c.prompt(req()).await.expect("duplicate").into_inner();
    assert_eq!(
        (dup.turn_id.as_str(), dup.message_id.as_str()),
        ("turn-a", first.message_id.as_str())
    );
    assert!(dup.already_accepted && !dup.turn_ended, "{dup:?}");
    // Empty text is fine for a known turn: nothing is started anyway.
    let dup = c
        .prompt(PromptRequest {
            text: String::new(),
            turn_id: "turn-a".into(),
            ..Default::default()
        })
        .await
        .expect("duplicate without text")
        .into_inner();
    assert!(dup.already_accepted);
    let updates = stream.until_turn_end("turn-a").await;
    let (reply, _) = reply_text(&updates, &first.message_id);
    assert_eq!(
        reply,
        format!("turn 1 of session {token}: you said \"only once\"")
    );
    assert_eq!(health(&mut c).await.agent_state(), AgentState::Ready);
    // After it ended.
    let latest = health(&mut c).await.latest_cursor;
    // The TurnEnded, then the agent's state going back to READY.
    let ready = stream
        .until(|u| matches!(u.kind, Some(Kind::StateChanged(_))))
        .await;
    assert_eq!(latest, ready.last().unwrap().cursor, "latest_cursor");
    assert_eq!(latest, updates.last().unwrap().cursor + 1);
    let dup = c.prompt(req()).await.expect("duplicate").into_inner();
    assert!(dup.already_accepted && dup.turn_ended, "{dup:?}");
    assert_eq!(dup.message_id, first.message_id);
    assert_eq!(health(&mut c).await.agent_state(), AgentState::Ready);
    assert_eq!(
        health(&mut c).await.latest_cursor,
        latest,
        "nothing happened"
    );

    // Another agent of the same agentctl: the turn is still known.
    c.stop_agent(StopAgentRequest { grace_ms: 2000 })
        .await
        .expect("stop");
    c.launch_agent(h.demo(true, &[])).await.expect("relaunch");
    c.resume_session(ResumeSessionRequest {
        resume_token: token.clone(),
    })
    .await
    .expect("resume");
    let dup = c.prompt(req()).await.expect("duplicate").into_inner();
    assert!(dup.already_accepted && dup.turn_ended, "{dup:?}");
    // A new turn id starts a turn, numbered after the single first one.
    let next = c
        .prompt(PromptRequest {
            text: "next".into(),
            turn_id: "turn-b".into(),
            ..Default::default()
        })
        .await
        .expect("prompt")
        .into_inner();
    assert!(!next.already_accepted);
    let updates = stream.until_turn_end("turn-b").await;
    let (reply, _) = reply_text(&updates, &next.message_id);
    assert_eq!(
        reply,
        format!("turn 2 of session {token}: you said \"next\"")
    );
    // The agent's transcript holds "only once" exactly once.
    let transcript =
        std::fs::read_to_string(h.base.path().join("state").join(format!("{token}.json")))
            .expect("transcript");
    assert_eq!(
        transcript.matches("only once").count(),
        2,
        "prompt + reply: {transcript}"
    );

    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_agentctl_process_resumes_the_conversation() {
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    let mut stream = Stream::open(&mut c, 0).await;
    c.launch_agent(h.demo(true, &[])).await.expect("launch");
    let token = c
        .new_session(NewSessionRequest {})
        .await
        .expect("session")
        .into_inner()
        .resume_token;
    prompt(&mut c, &mut stream, "before restart").await;
    drop(stream);
    ctl.shutdown().await;
    h.assert_no_leftovers().await;

    // As after a backend restart with a standalone executor: a new agentctl,
    // a new agent, the recorded token.
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    let mut stream = Stream::open(&mut c, 0).await;
    c.launch_agent(h.demo(true, &[])).await.expect("launch");
    c.resume_session(ResumeSessionRequest {
        resume_token: token.clone(),
    })
    .await
    .expect("resume");
    let (reply, _) = prompt(&mut c, &mut stream, "after restart").await;
    assert_eq!(
        reply,
        format!("turn 2 of session {token}: you said \"after restart\"")
    );
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_without_load_session_cannot_resume_but_workspace_works() {
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    c.launch_agent(h.demo(
        true,
        &[
            ("ACP_DEMO_NO_LOAD_SESSION", "1"),
            ("ACP_DEMO_NO_RESUME_SESSION", "1"),
        ],
    ))
    .await
    .expect("launch");
    let cp = caps(&mut c).await;
    assert_eq!(cp.supports_session_resume(), Capability::Unsupported);
    assert_eq!(cp.agent_load_session, Some(false));
    assert_eq!(cp.agent_resume_session, Some(false));
    assert!(cp.profile_claims_session_resume);
    let err = c
        .resume_session(ResumeSessionRequest {
            resume_token: "anything".into(),
        })
        .await
        .expect_err("resume must fail");
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(err.message().contains("loadSession"), "{}", err.message());

    // Workspace calls keep working.
    c.write_file(WriteFileRequest {
        path: "notes.txt".into(),
        content: b"hi".to_vec(),
        create_parents: false,
    })
    .await
    .expect("write");
    let read = c
        .read_file(ReadFileRequest {
            path: "notes.txt".into(),
            max_bytes: 0,
        })
        .await
        .expect("read")
        .into_inner();
    assert_eq!(read.content, b"hi");
    // Past what ReadFile returns: refused, the file left as it was.
    let err = c
        .write_file(WriteFileRequest {
            path: "notes.txt".into(),
            content: vec![b'x'; (16 << 20) + 1],
            create_parents: false,
        })
        .await
        .expect_err("a write ReadFile could not read back");
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("at most 16777216 bytes"), "{err:?}");
    assert_eq!(
        std::fs::read(h.ws().join("notes.txt")).expect("kept"),
        b"hi"
    );
    let out = c
        .exec(ExecRequest {
            command: "cat".into(),
            args: vec!["notes.txt".into()],
            ..Default::default()
        })
        .await
        .expect("exec")
        .into_inner();
    assert_eq!(out.stdout, b"hi");
    let list = c
        .list_dir(ListDirRequest {
            path: String::new(),
        })
        .await
        .expect("list")
        .into_inner();
    assert!(list.entries.iter().any(|e| e.name == "notes.txt"));

    // A profile that does not claim resume lowers a capable agent too.
    c.stop_agent(StopAgentRequest { grace_ms: 0 })
        .await
        .expect("stop");
    c.launch_agent(h.demo(false, &[])).await.expect("launch");
    let cp = caps(&mut c).await;
    assert_eq!(cp.supports_session_resume(), Capability::Unsupported);
    assert_eq!(cp.agent_load_session, Some(true));

    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_load_is_a_clear_error_and_workspace_stays_usable() {
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    c.launch_agent(h.demo(true, &[("ACP_DEMO_FAIL_LOAD", "true")]))
        .await
        .expect("launch");
    let err = c
        .resume_session(ResumeSessionRequest {
            resume_token: "some-token".into(),
        })
        .await
        .expect_err("load rejected");
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(
        err.message().contains("session/load") && err.message().contains("configured to fail"),
        "{}",
        err.message()
    );
    let out = c
        .exec(ExecRequest {
            command: "echo".into(),
            args: vec!["still here".into()],
            ..Default::default()
        })
        .await
        .expect("exec")
        .into_inner();
    assert_eq!(out.stdout, b"still here\n");
    // And the agent itself still works with a new session.
    let mut stream = Stream::open(&mut c, 0).await;
    let token = c
        .new_session(NewSessionRequest {})
        .await
        .expect("new session")
        .into_inner()
        .resume_token;
    let (reply, _) = prompt(&mut c, &mut stream, "after").await;
    assert_eq!(
        reply,
        format!("turn 1 of session {token}: you said \"after\"")
    );
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

async fn expect_unauthenticated(c: &mut Client, label: &str) {
    macro_rules! check {
        ($name:literal, $call:expr) => {
            match $call.await {
                Ok(_) => panic!("{label}: {} succeeded without a valid secret", $name),
                Err(s) => assert_eq!(s.code(), Code::Unauthenticated, "{label}: {}: {s:?}", $name),
            }
        };
    }
    check!("Health", c.health(HealthRequest {}));
    check!("Capabilities", c.capabilities(CapabilitiesRequest {}));
    check!(
        "LaunchAgent",
        c.launch_agent(LaunchAgentRequest {
            command: "sh".into(),
            ..Default::default()
        })
    );
    check!("NewSession", c.new_session(NewSessionRequest {}));
    check!(
        "ResumeSession",
        c.resume_session(ResumeSessionRequest {
            resume_token: "t".into()
        })
    );
    check!(
        "Prompt",
        c.prompt(PromptRequest {
            text: "x".into(),
            turn_id: String::new(),
            ..Default::default()
        })
    );
    check!("Cancel", c.cancel(CancelRequest {}));
    check!("StopAgent", c.stop_agent(StopAgentRequest { grace_ms: 0 }));
    check!(
        "StreamUpdates",
        c.stream_updates(StreamUpdatesRequest { after_cursor: 0 })
    );
    check!(
        "Exec",
        c.exec(ExecRequest {
            command: "touch".into(),
            args: vec!["pwned".into()],
            ..Default::default()
        })
    );
    check!(
        "ReadFile",
        c.read_file(ReadFileRequest {
            path: "x".into(),
            max_bytes: 0
        })
    );
    check!(
        "WriteFile",
        c.write_file(WriteFileRequest {
            path: "pwned2".into(),
            content: vec![],
            create_parents: false
        })
    );
    check!(
        "ListDir",
        c.list_dir(ListDirRequest {
            path: String::new()
        })
    );
    check!("GitStatus", c.git_status(GitStatusRequest {}));
    check!(
        "GitDiff",
        c.git_diff(GitDiffRequest {
            staged: false,
            paths: vec![],
            ..Default::default()
        })
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_needs_the_secret() {
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    for (label, auth) in [
        ("missing", None),
        ("wrong", Some("Bearer not-the-secret".to_owned())),
        (
            "prefix",
            Some(format!("Bearer {}", &SECRET[..SECRET.len() - 1])),
        ),
        ("longer", Some(format!("Bearer {SECRET}x"))),
        ("no scheme", Some(SECRET.to_owned())),
        ("basic", Some(format!("Basic {SECRET}"))),
    ] {
        let mut c = ctl.client_with(auth).await;
        expect_unauthenticated(&mut c, label).await;
    }
    assert!(!h.ws().join("pwned").exists());
    assert!(!h.ws().join("pwned2").exists());
    // The scheme is case-insensitive; the secret is not.
    let mut ok = ctl.client_with(Some(format!("bearer {SECRET}"))).await;
    health(&mut ok).await;
    let log = std::fs::read_to_string(h.base.path().join("agentctl.log")).expect("log");
    assert!(!log.contains(SECRET), "the secret was logged");
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paths_outside_the_workspace_are_refused() {
    let h = Harness::new();
    let ws = h.ws();
    let outside = h.outside();
    std::os::unix::fs::symlink(&outside, ws.join("out-dir")).expect("symlink");
    std::os::unix::fs::symlink(outside.join("secret.txt"), ws.join("out-file")).expect("symlink");
    std::os::unix::fs::symlink(outside.join("created.txt"), ws.join("dangling")).expect("symlink");
    std::fs::create_dir(ws.join("sub")).expect("mkdir");
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    let abs_secret = outside.join("secret.txt").to_string_lossy().into_owned();

    for path in [
        "../outside/secret.txt",
        "sub/../../outside/secret.txt",
        abs_secret.as_str(),
        "out-dir/secret.txt",
        "out-file",
    ] {
        let err = c
            .read_file(ReadFileRequest {
                path: path.into(),
                max_bytes: 0,
            })
            .await
            .expect_err(path);
        assert_eq!(err.code(), Code::PermissionDenied, "read {path}: {err:?}");
    }
    let abs_new = outside.join("new.txt").to_string_lossy().into_owned();
    for path in [
        "../outside/new.txt",
        abs_new.as_str(),
        "out-dir/new.txt",
        "out-dir/deeper/new.txt",
        "out-file",
        "dangling",
    ] {
        let err = c
            .write_file(WriteFileRequest {
                path: path.into(),
                content: b"pwned".to_vec(),
                create_parents: true,
            })
            .await
            .expect_err(path);
        assert_eq!(err.code(), Code::PermissionDenied, "write {path}: {err:?}");
    }
    for path in ["..", "out-dir", "../outside"] {
        let err = c
            .list_dir(ListDirRequest { path: path.into() })
            .await
            .expect_err(path);
        assert_eq!(err.code(), Code::PermissionDenied, "list {path}: {err:?}");
    }
    let err = c
        .exec(ExecRequest {
            command: "pwd".into(),
            cwd: "../outside".into(),
            ..Default::default()
        })
        .await
        .expect_err("exec cwd");
    assert_eq!(err.code(), Code::PermissionDenied);
    let err = c
        .git_diff(GitDiffRequest {
            staged: false,
            paths: vec!["../outside".into()],
            ..Default::default()
        })
        .await
        .expect_err("diff path");
    assert_eq!(err.code(), Code::PermissionDenied);
    for path in ["a\0b", "sub/\0"] {
        let err = c
            .read_file(ReadFileRequest {
                path: path.into(),
                max_bytes: 0,
            })
            .await
            .expect_err("nul");
        assert_eq!(err.code(), Code::InvalidArgument);
        let err = c
            .write_file(WriteFileRequest {
                path: path.into(),
                content: vec![],
                create_parents: true,
            })
            .await
            .expect_err("nul");
        assert_eq!(err.code(), Code::InvalidArgument);
    }
    // Nothing outside changed.
    let mut names: Vec<String> = std::fs::read_dir(&outside)
        .expect("read outside")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, vec!["secret.txt"]);
    assert_eq!(
        std::fs::read_to_string(outside.join("secret.txt")).expect("secret"),
        "top secret"
    );

    // What is inside works, including an absolute path inside the root and
    // `..` that stays inside.
    c.write_file(WriteFileRequest {
        path: "sub/deep/er/f.txt".into(),
        content: b"inside".to_vec(),
        create_parents: true,
    })
    .await
    .expect("write inside");
    let abs_inside = ws.canonicalize().expect("canon").join("sub/deep/er/f.txt");
    let read = c
        .read_file(ReadFileRequest {
            path: abs_inside.to_string_lossy().into_owned(),
            max_bytes: 0,
        })
        .await
        .expect("read abs inside")
        .into_inner();
    assert_eq!(read.content, b"inside");
    let read = c
        .read_file(ReadFileRequest {
            path: "sub/deep/../deep/er/f.txt".into(),
            max_bytes: 0,
        })
        .await
        .expect("read dotdot inside")
        .into_inner();
    assert_eq!(read.content, b"inside");
    let err = c
        .read_file(ReadFileRequest {
            path: "sub/deep/er/f.txt".into(),
            max_bytes: 3,
        })
        .await
        .expect_err("too large");
    assert_eq!(err.code(), Code::OutOfRange);
    let err = c
        .write_file(WriteFileRequest {
            path: "nodir/f.txt".into(),
            content: vec![],
            create_parents: false,
        })
        .await
        .expect_err("no parent");
    assert_eq!(err.code(), Code::NotFound);
    let list = c
        .list_dir(ListDirRequest {
            path: String::new(),
        })
        .await
        .expect("list root")
        .into_inner();
    let kinds: HashMap<String, EntryKind> = list
        .entries
        .iter()
        .map(|e| (e.name.clone(), e.kind()))
        .collect();
    assert_eq!(kinds.get("sub"), Some(&EntryKind::Dir));
    assert_eq!(kinds.get("out-dir"), Some(&EntryKind::Symlink));
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_file_requests_are_confined_and_permissions_answered() {
    let h = Harness::new();
    std::fs::write(h.ws().join("inside.txt"), "inside text").expect("write");
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    let mut stream = Stream::open(&mut c, 0).await;
    c.launch_agent(h.demo(true, &[])).await.expect("launch");
    c.new_session(NewSessionRequest {}).await.expect("session");
    let ws = h.ws().canonicalize().expect("canon");
    let outside = h.outside().canonicalize().expect("canon");

    let (r, _) = prompt(
        &mut c,
        &mut stream,
        &format!("/read {}", ws.join("inside.txt").display()),
    )
    .await;
    assert!(r.ends_with("read: inside text"), "{r}");
    let (r, _) = prompt(
        &mut c,
        &mut stream,
        &format!("/read {}", outside.join("secret.txt").display()),
    )
    .await;
    assert!(r.contains("read failed"), "{r}");
    assert!(!r.contains("top secret"), "{r}");
    let (r, _) = prompt(
        &mut c,
        &mut stream,
        &format!("/read {}/../outside/secret.txt", ws.display()),
    )
    .await;
    assert!(r.contains("read failed"), "{r}");
    let (r, _) = prompt(
        &mut c,
        &mut stream,
        &format!("/write {} pwned", outside.join("x.txt").display()),
    )
    .await;
    assert!(r.contains("write failed"), "{r}");
    assert!(!outside.join("x.txt").exists());
    let (r, _) = prompt(
        &mut c,
        &mut stream,
        &format!("/write {} agent-wrote", ws.join("new/file.txt").display()),
    )
    .await;
    assert!(r.ends_with("write: ok"), "{r}");
    assert_eq!(
        std::fs::read_to_string(ws.join("new/file.txt")).expect("written"),
        "agent-wrote"
    );
    let (r, _) = prompt(&mut c, &mut stream, "/permission").await;
    assert!(r.ends_with("permission: allow"), "{r}");
    // Tool calls reach the stream.
    let resp = c
        .prompt(PromptRequest {
            text: "/tool".into(),
            turn_id: String::new(),
            ..Default::default()
        })
        .await
        .expect("prompt")
        .into_inner();
    let updates = stream.until_turn_end(&resp.turn_id).await;
    let statuses: Vec<String> = updates
        .iter()
        .filter_map(|u| match &u.kind {
            Some(Kind::Activity(a)) if a.kind == "tool_call" => {
                let call: serde_json::Value = serde_json::from_str(&a.json).expect("ACP JSON");
                (call["toolCallId"] == "demo-tool-1")
                    .then(|| call["status"].as_str().unwrap_or("").to_owned())
            }
            _ => None,
        })
        .collect();
    assert_eq!(statuses, vec!["in_progress", "completed"]);
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_timeout_output_cap_exit_code_and_cwd() {
    let h = Harness::new();
    std::fs::create_dir(h.ws().join("sub")).expect("mkdir");
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;

    let started = Instant::now();
    let out = c
        .exec(ExecRequest {
            command: "sh".into(),
            args: vec![
                "-c".into(),
                "echo $$ > group.pid; sleep 30 & sleep 30; echo never".into(),
            ],
            timeout_ms: 500,
            ..Default::default()
        })
        .await
        .expect("exec")
        .into_inner();
    assert!(out.timed_out);
    assert_eq!(out.exit_code, None);
    assert!(started.elapsed() < Duration::from_secs(15));
    assert!(out.duration_ms >= 500);
    let pgid: u32 = std::fs::read_to_string(h.ws().join("group.pid"))
        .expect("pid file")
        .trim()
        .parse()
        .expect("pid");
    // The whole group is gone, the background sleep included.
    let deadline = Instant::now() + WAIT;
    loop {
        let members = group_members(pgid);
        if members.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "group {pgid} survived: {members:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let out = c
        .exec(ExecRequest {
            command: "sh".into(),
            args: vec!["-c".into(), "head -c 100000 /dev/zero; echo err >&2".into()],
            max_output_bytes: 1000,
            ..Default::default()
        })
        .await
        .expect("exec")
        .into_inner();
    assert_eq!(out.exit_code, Some(0));
    assert_eq!(out.stdout.len(), 1000);
    assert!(out.stdout_truncated);
    assert_eq!(out.stderr, b"err\n");
    assert!(!out.stderr_truncated);

    let out = c
        .exec(ExecRequest {
            command: "sh".into(),
            args: vec![
                "-c".into(),
                "pwd; echo $AGENTCTL_SECRET; echo $FOO; exit 7".into(),
            ],
            cwd: "sub".into(),
            env: HashMap::from([("FOO".to_owned(), "bar".to_owned())]),
            ..Default::default()
        })
        .await
        .expect("exec")
        .into_inner();
    assert_eq!(out.exit_code, Some(7));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].ends_with("/ws/sub"), "{text}");
    assert_eq!(lines[1], "", "the secret leaked into exec's environment");
    assert_eq!(lines[2], "bar");

    let err = c
        .exec(ExecRequest {
            command: "definitely-not-a-command-xyz".into(),
            ..Default::default()
        })
        .await
        .expect_err("missing command");
    assert_eq!(err.code(), Code::NotFound);
    // A missing cwd is named as the cwd, not blamed on the command.
    let err = c
        .exec(ExecRequest {
            command: "pwd".into(),
            cwd: "nope".into(),
            ..Default::default()
        })
        .await
        .expect_err("missing cwd");
    assert_eq!(err.code(), Code::NotFound);
    assert!(
        err.message().contains("cwd \"nope\" is not a directory"),
        "{}",
        err.message()
    );
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

/// helper-39 7: a session stopped during a long Exec waited for agentctl's
/// 5 s drain, and the caller saw a broken connection. agentctl stopping
/// ends the command at once and answers the call with why.
#[tokio::test]
async fn agentctl_stopping_ends_a_running_exec_and_says_why() {
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    let call = tokio::spawn(async move {
        c.exec(ExecRequest {
            command: "sh".into(),
            args: vec!["-c".into(), "echo $$ > long.pid; exec sleep 300".into()],
            timeout_ms: 600_000,
            ..Default::default()
        })
        .await
    });
    let pid_file = h.ws().join("long.pid");
    let deadline = std::time::Instant::now() + WAIT;
    let pid: u32 = loop {
        if let Some(pid) = std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|t| t.trim().parse().ok())
        {
            break pid;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the command never started"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    ctl.shutdown().await;
    let err = call.await.expect("join").expect_err("ended");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().contains("agentctl is stopping"),
        "{}",
        err.message()
    );
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists()
            || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|s| s.contains(") Z ")),
        "the command still runs"
    );
}

/// helper-39 5: Exec checked its cwd, then started the command by path: a
/// directory swapped for a symlink in between ran the command outside the
/// workspace (3 of 150 calls). The command enters the directory it checked,
/// by handle: whatever wins the race, nothing runs outside.
#[tokio::test]
async fn exec_cwd_swapped_for_a_symlink_never_runs_outside() {
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    let dir = h.ws().join("d");
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::create_dir_all(h.outside()).expect("mkdir outside");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let swapper = {
        let (dir, outside, stop) = (dir.clone(), h.outside(), stop.clone());
        std::thread::spawn(move || {
            let aside = dir.with_file_name("d.real");
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = std::fs::rename(&dir, &aside);
                let _ = std::os::unix::fs::symlink(&outside, &dir);
                std::thread::yield_now();
                let _ = std::fs::remove_file(&dir);
                let _ = std::fs::rename(&aside, &dir);
                std::thread::yield_now();
            }
        })
    };
    let outside = std::fs::canonicalize(h.outside()).expect("canonical");
    let mut ran = 0;
    for _ in 0..150 {
        let out = c
            .exec(ExecRequest {
                command: "sh".into(),
                args: vec!["-c".into(), "pwd -P".into()],
                cwd: "d".into(),
                ..Default::default()
            })
            .await;
        if let Ok(out) = out {
            let text = String::from_utf8_lossy(&out.get_ref().stdout).into_owned();
            assert!(
                !text.trim().starts_with(outside.to_str().expect("utf-8")),
                "ran outside the workspace: {text}"
            );
            ran += 1;
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    swapper.join().expect("swapper");
    assert!(ran > 0, "no call ran at all");
    ctl.shutdown().await;
}

fn group_members(pgid: u32) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("proc").flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let Some((_, rest)) = stat.rsplit_once(") ") else {
            continue;
        };
        let fields: Vec<&str> = rest.split(' ').collect();
        // state ppid pgrp ...
        if fields.get(2).and_then(|p| p.parse::<u32>().ok()) == Some(pgid)
            && fields.first() != Some(&"Z")
        {
            found.push(pid);
        }
    }
    found
}

fn git(ws: &Path, args: &[&str]) {
    let status = std::process::Command::new("git")
        .args([
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@example.com",
            "-c",
            "init.defaultBranch=main",
        ])
        .args(args)
        .current_dir(ws)
        .stdout(Stdio::null())
        .status()
        .expect("git");
    assert!(status.success(), "git {args:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn git_status_and_diff_in_a_fresh_repository() {
    let h = Harness::new();
    let ws = h.ws();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;

    // Not a repository (and a repository above it must not count).
    let err = c
        .git_status(GitStatusRequest {})
        .await
        .expect_err("non-git");
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(
        err.message().contains("not a git repository"),
        "{}",
        err.message()
    );
    let err = c
        .git_diff(GitDiffRequest {
            staged: false,
            paths: vec![],
            ..Default::default()
        })
        .await
        .expect_err("non-git");
    assert_eq!(err.code(), Code::FailedPrecondition);
    // Said as for status, not with git's usage text (`git diff` outside a
    // repository prints "Not a git repository" and its whole usage).
    assert!(
        err.message().ends_with("is not a git repository"),
        "{}",
        err.message()
    );
    // Against a base too, not "base is not a ref" (helper-52 8).
    let err = c
        .git_diff(GitDiffRequest {
            base: "main".into(),
            ..Default::default()
        })
        .await
        .expect_err("non-git");
    assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
    assert!(
        err.message().ends_with("is not a git repository"),
        "{}",
        err.message()
    );

    git(&ws, &["init", "-q", "-b", "main"]);
    let st = c
        .git_status(GitStatusRequest {})
        .await
        .expect("status")
        .into_inner();
    assert_eq!(st.branch, "main");
    assert!(st.files.is_empty());

    std::fs::write(ws.join("tracked.txt"), "one\n").expect("write");
    git(&ws, &["add", "tracked.txt"]);
    git(&ws, &["commit", "-q", "-m", "init"]);
    std::fs::write(ws.join("tracked.txt"), "one\ntwo\n").expect("write");
    std::fs::write(ws.join("staged.txt"), "s\n").expect("write");
    git(&ws, &["add", "staged.txt"]);
    std::fs::create_dir(ws.join("dir")).expect("mkdir");
    std::fs::write(ws.join("dir/untracked file.txt"), "u\n").expect("write");

    let st = c
        .git_status(GitStatusRequest {})
        .await
        .expect("status")
        .into_inner();
    assert_eq!(st.branch, "main");
    let mut files: Vec<(String, String)> = st.files.into_iter().map(|f| (f.code, f.path)).collect();
    files.sort();
    assert_eq!(
        files,
        vec![
            (" M".to_owned(), "tracked.txt".to_owned()),
            ("??".to_owned(), "dir/untracked file.txt".to_owned()),
            ("A ".to_owned(), "staged.txt".to_owned()),
        ]
    );
    let diff = c
        .git_diff(GitDiffRequest {
            staged: false,
            paths: vec![],
            ..Default::default()
        })
        .await
        .expect("diff")
        .into_inner()
        .diff;
    assert!(diff.contains("+two"), "{diff}");
    assert!(!diff.contains("staged.txt"), "{diff}");
    let staged = c
        .git_diff(GitDiffRequest {
            staged: true,
            paths: vec![],
            ..Default::default()
        })
        .await
        .expect("diff")
        .into_inner()
        .diff;
    assert!(staged.contains("+s"), "{staged}");
    assert!(!staged.contains("+two"), "{staged}");
    let limited = c
        .git_diff(GitDiffRequest {
            staged: true,
            paths: vec!["tracked.txt".into()],
            ..Default::default()
        })
        .await
        .expect("diff")
        .into_inner()
        .diff;
    assert!(limited.is_empty(), "{limited}");
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_crash_mid_turn_is_reported_on_the_stream_and_in_health() {
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    let mut stream = Stream::open(&mut c, 0).await;
    let launched = c
        .launch_agent(h.demo(true, &[("ACP_DEMO_CRASH_MID_TURN", "1")]))
        .await
        .expect("launch")
        .into_inner();
    c.new_session(NewSessionRequest {}).await.expect("session");
    let resp = c
        .prompt(PromptRequest {
            text: "boom".into(),
            turn_id: "t-crash".into(),
            ..Default::default()
        })
        .await
        .expect("prompt")
        .into_inner();
    let updates = stream
        .until(|u| matches!(u.kind, Some(Kind::AgentExited(_))))
        .await;
    let (partial, _) = reply_text(&updates, &resp.message_id);
    assert!(partial.starts_with("turn 1"), "{partial}");
    let end = turn_end(&updates);
    assert_eq!(end.turn_id, "t-crash");
    assert_eq!(end.stop_reason, "error");
    assert!(end.error_message.contains("exit"), "{}", end.error_message);
    let exited = updates
        .iter()
        .find_map(|u| match &u.kind {
            Some(Kind::AgentExited(e)) => e.exit,
            _ => None,
        })
        .expect("exit");
    assert_eq!(exited.code, Some(42));
    assert!(updates.iter().any(|u| matches!(&u.kind,
        Some(Kind::StateChanged(s)) if s.state() == AgentState::Exited)));
    let hl = health(&mut c).await;
    assert_eq!(hl.agent_state(), AgentState::Exited);
    assert_eq!(hl.agent_exit.and_then(|e| e.code), Some(42));
    wait_dead(launched.agent_pid).await;
    let err = c
        .prompt(PromptRequest {
            text: "again".into(),
            turn_id: String::new(),
            ..Default::default()
        })
        .await
        .expect_err("agent gone");
    assert_eq!(err.code(), Code::FailedPrecondition);

    // An agent that crashes between turns: the turn ends normally, then the
    // exit is reported.
    c.launch_agent(h.demo(true, &[("ACP_DEMO_CRASH_AFTER_PROMPTS", "1")]))
        .await
        .expect("relaunch");
    c.new_session(NewSessionRequest {}).await.expect("session");
    let (_, end) = prompt(&mut c, &mut stream, "once").await;
    assert_eq!(end.stop_reason, "end_turn");
    let updates = stream
        .until(|u| matches!(u.kind, Some(Kind::AgentExited(_))))
        .await;
    assert!(updates.iter().any(|u| matches!(&u.kind,
        Some(Kind::AgentExited(e)) if e.exit.and_then(|x| x.code) == Some(43))));
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_ends_the_turn_as_cancelled() {
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    let mut stream = Stream::open(&mut c, 0).await;
    c.launch_agent(h.demo(true, &[("ACP_DEMO_CHUNK_DELAY_MS", "1500")]))
        .await
        .expect("launch");
    c.new_session(NewSessionRequest {}).await.expect("session");
    assert!(
        !c.cancel(CancelRequest {})
            .await
            .expect("cancel")
            .into_inner()
            .cancelled
    );
    let resp = c
        .prompt(PromptRequest {
            text: "slow".into(),
            turn_id: String::new(),
            ..Default::default()
        })
        .await
        .expect("prompt")
        .into_inner();
    stream
        .until(|u| matches!(u.kind, Some(Kind::MessageChunk(_))))
        .await;
    assert_eq!(health(&mut c).await.agent_state(), AgentState::Busy);
    let busy = c
        .prompt(PromptRequest {
            text: "overlap".into(),
            turn_id: String::new(),
            ..Default::default()
        })
        .await
        .expect_err("busy");
    assert_eq!(busy.code(), Code::FailedPrecondition);
    assert!(
        c.cancel(CancelRequest {})
            .await
            .expect("cancel")
            .into_inner()
            .cancelled
    );
    let updates = stream.until_turn_end(&resp.turn_id).await;
    assert_eq!(turn_end(&updates).stop_reason, "cancelled");
    let ready = stream
        .until(|u| matches!(&u.kind, Some(Kind::StateChanged(s)) if s.state() == AgentState::Ready))
        .await;
    assert!(!ready.is_empty());
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

fn cursors(updates: &[AgentUpdate]) -> Vec<u64> {
    updates.iter().map(|u| u.cursor).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnecting_consumer_sees_every_update_once_and_gap_when_too_old() {
    let h = Harness::new();
    let ctl = h.spawn(&["--update-buffer", "16"]).await;
    let mut c = ctl.client().await;
    c.launch_agent(h.demo(true, &[("ACP_DEMO_CHUNK_DELAY_MS", "100")]))
        .await
        .expect("launch");
    c.new_session(NewSessionRequest {}).await.expect("session");
    let first = c
        .prompt(PromptRequest {
            text: "one".into(),
            turn_id: "t1".into(),
            ..Default::default()
        })
        .await
        .expect("prompt")
        .into_inner();

    // A consumer reads a little, goes away mid-turn, and comes back.
    let mut seen = Vec::new();
    let mut s = Stream::open(&mut c, 0).await;
    for _ in 0..3 {
        seen.push(s.next().await);
    }
    drop(s);
    let last = seen.last().expect("seen").cursor;
    let mut s = Stream::open(&mut c, last).await;
    seen.extend(s.until_turn_end("t1").await);
    drop(s);
    // Back again, while the next turn streams live.
    let last = seen.last().expect("seen").cursor;
    c.prompt(PromptRequest {
        text: "two".into(),
        turn_id: "t2".into(),
        ..Default::default()
    })
    .await
    .expect("prompt");
    let mut s = Stream::open(&mut c, last).await;
    seen.extend(
        s.until(|u| matches!(u.kind, Some(Kind::MessageChunk(_))))
            .await,
    );
    drop(s);
    let last = seen.last().expect("seen").cursor;
    let mut s = Stream::open(&mut c, last).await;
    seen.extend(s.until_turn_end("t2").await);
    seen.extend(
        s.until(
            |u| matches!(&u.kind, Some(Kind::StateChanged(st)) if st.state() == AgentState::Ready),
        )
        .await,
    );
    drop(s);

    let got = cursors(&seen);
    let expected: Vec<u64> = (1..=got.len() as u64).collect();
    assert_eq!(got, expected, "every update exactly once, in order");
    assert!(seen.iter().all(|u| !matches!(u.kind, Some(Kind::Gap(_)))));
    let (reply, _) = reply_text(&seen, &first.message_id);
    assert!(reply.starts_with("turn 1 "), "{reply}");
    // A fresh read from 0 sees the same updates.
    let mut s = Stream::open(&mut c, 0).await;
    let mut again = Vec::new();
    for _ in 0..got.len() {
        again.push(s.next().await);
    }
    assert_eq!(again, seen);
    drop(s);

    // Push the early updates out of the 16-entry buffer.
    let mut s = Stream::open(&mut c, got.len() as u64).await;
    for t in ["t3", "t4", "t5"] {
        c.prompt(PromptRequest {
            text: t.into(),
            turn_id: t.into(),
            ..Default::default()
        })
        .await
        .expect("prompt");
        s.until_turn_end(t).await;
    }
    let latest = s
        .until(
            |u| matches!(&u.kind, Some(Kind::StateChanged(st)) if st.state() == AgentState::Ready),
        )
        .await
        .last()
        .expect("update")
        .cursor;
    drop(s);
    let oldest = latest - 15;
    let mut s = Stream::open(&mut c, 2).await;
    let gap = s.next().await;
    match &gap.kind {
        Some(Kind::Gap(g)) => {
            assert_eq!(g.requested_after, 2);
            assert_eq!(g.next_cursor, oldest);
        }
        other => panic!("expected a gap, got {other:?}"),
    }
    assert_eq!(s.next().await.cursor, oldest);
    drop(s);
    // 0 means "from the start": updates were dropped, so a gap first, then
    // whatever is still buffered.
    let mut s = Stream::open(&mut c, 0).await;
    match s.next().await.kind {
        Some(Kind::Gap(g)) => {
            assert_eq!(g.requested_after, 0);
            assert_eq!(g.next_cursor, oldest);
        }
        other => panic!("expected a gap, got {other:?}"),
    }
    assert_eq!(s.next().await.cursor, oldest);
    drop(s);
    // A cursor from another agentctl process (ahead of ours) is a gap too.
    let mut s = Stream::open(&mut c, latest + 100).await;
    match s.next().await.kind {
        Some(Kind::Gap(g)) => assert_eq!(g.next_cursor, latest + 1),
        other => panic!("expected a gap, got {other:?}"),
    }
    drop(s);
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_initialize_times_out_and_the_agent_is_stopped() {
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    let mut req = h.demo(true, &[("ACP_DEMO_START_DELAY_MS", "10000")]);
    req.initialize_timeout_ms = 300;
    let err = c.launch_agent(req).await.expect_err("timeout");
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
    assert_eq!(health(&mut c).await.agent_state(), AgentState::Exited);
    assert_eq!(
        caps(&mut c).await.supports_session_resume(),
        Capability::Unknown
    );
    // Only agentctl itself is left.
    let deadline = Instant::now() + WAIT;
    while h.leftovers() != vec![ctl.pid] {
        assert!(
            Instant::now() < deadline,
            "agent survived: {:?}",
            h.leftovers()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A slow start within the deadline works.
    let mut req = h.demo(true, &[("ACP_DEMO_START_DELAY_MS", "300")]);
    req.initialize_timeout_ms = 15_000;
    c.launch_agent(req).await.expect("slow but in time");
    let err = c
        .launch_agent(LaunchAgentRequest::default())
        .await
        .expect_err("empty command");
    assert_eq!(err.code(), Code::InvalidArgument);
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orphaned_agentctl_exits_after_idle_timeout_and_stops_its_agent() {
    let h = Harness::new();
    let mut ctl = h.spawn(&["--idle-timeout", "1500ms"]).await;
    let agent_pid = {
        let mut c = ctl.client().await;
        c.launch_agent(h.demo(true, &[]))
            .await
            .expect("launch")
            .into_inner()
            .agent_pid
    };
    // The backend is gone: no more calls.
    let started = Instant::now();
    let status = ctl.wait_exit().await;
    assert_eq!(status.code(), Some(0));
    assert!(started.elapsed() >= Duration::from_millis(1000));
    wait_dead(agent_pid).await;
    h.assert_no_leftovers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_stream_counts_as_contact_and_calls_reset_the_idle_clock() {
    let h = Harness::new();
    let mut ctl = h.spawn(&["--idle-timeout", "3s"]).await;
    let mut c = ctl.client().await;
    // Calls every 300 ms keep it alive well past the timeout.
    for _ in 0..15 {
        health(&mut c).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // So does an open update stream.
    let s = Stream::open(&mut c, 0).await;
    tokio::time::sleep(Duration::from_millis(4500)).await;
    health(&mut c).await;
    drop(s);
    drop(c);
    let status = ctl.wait_exit().await;
    assert_eq!(status.code(), Some(0));
    h.assert_no_leftovers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_the_agent_and_exits_cleanly() {
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    let mut stream = Stream::open(&mut c, 0).await;
    let agent_pid = c
        .launch_agent(h.demo(true, &[]))
        .await
        .expect("launch")
        .into_inner()
        .agent_pid;
    c.new_session(NewSessionRequest {}).await.expect("session");
    prompt(&mut c, &mut stream, "hi").await;
    // An open stream must not hold the shutdown up.
    ctl.shutdown().await;
    wait_dead(agent_pid).await;
    h.assert_no_leftovers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secret_from_file_and_bad_configuration() {
    let h = Harness::new();
    let secret_file = h.base.path().join("secret");
    std::fs::write(&secret_file, "file-secret\n").expect("write");
    let mut child = tokio::process::Command::new(agentctl_exe())
        .args([
            "--executor-id",
            "e2",
            "--listen",
            "127.0.0.1:0",
            "--workspace",
        ])
        .arg(h.ws())
        .arg("--secret-file")
        .arg(&secret_file)
        .env_remove("AGENTCTL_SECRET")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn");
    let pid = child.id().expect("pid");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let line = tokio::time::timeout(WAIT, lines.next_line())
        .await
        .expect("line")
        .expect("read")
        .expect("some line");
    let addr = line
        .strip_prefix("agentctl listening on ")
        .expect("prefix")
        .to_owned();
    let ctl = Ctl { child, pid, addr };
    let mut ok = ctl.client_with(Some("Bearer file-secret".into())).await;
    assert_eq!(health(&mut ok).await.executor_id, "e2");
    let mut bad = ctl.client_with(Some(format!("Bearer {SECRET}"))).await;
    assert_eq!(
        bad.health(HealthRequest {})
            .await
            .expect_err("wrong")
            .code(),
        Code::Unauthenticated
    );
    ctl.shutdown().await;

    // No secret, or a workspace that does not exist: refuse to start.
    for (env_secret, ws) in [
        (None, h.ws()),
        (Some(SECRET), h.base.path().join("missing")),
    ] {
        let mut cmd = std::process::Command::new(agentctl_exe());
        cmd.args(["--executor-id", "e3", "--workspace"])
            .arg(&ws)
            .env_remove("AGENTCTL_SECRET")
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(s) = env_secret {
            cmd.env("AGENTCTL_SECRET", s);
        }
        let status = cmd.status().expect("run");
        assert!(!status.success());
    }
    h.assert_no_leftovers().await;
}

/// Opt-in interoperability check with a real ACP agent, e.g.
/// `AGENTCTL_REAL_AGENT="claude-code-acp" cargo test -p agentctl --test agentctl -- --ignored real_agent`.
/// It needs the agent installed (and credentials for the prompt part), so it
/// is not part of the default run; asked for without the variable, it fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real ACP agent: set AGENTCTL_REAL_AGENT"]
async fn real_agent_smoke() {
    let cmdline = std::env::var("AGENTCTL_REAL_AGENT")
        .expect("set AGENTCTL_REAL_AGENT to the agent command line, e.g. `claude-code-acp`");
    let mut words = cmdline.split_whitespace().map(str::to_owned);
    let command = words.next().expect("empty AGENTCTL_REAL_AGENT");
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    let launched = c
        .launch_agent(LaunchAgentRequest {
            command,
            args: words.collect(),
            env: HashMap::new(),
            profile_supports_session_resume: true,
            initialize_timeout_ms: 60_000,
            ..Default::default()
        })
        .await
        .expect("launch")
        .into_inner();
    println!("launched: {launched:?}");
    let cp = caps(&mut c).await;
    assert_ne!(cp.supports_session_resume(), Capability::Unknown);
    println!("capabilities: {cp:?}");
    match c.new_session(NewSessionRequest {}).await {
        Ok(r) => {
            let token = r.into_inner().resume_token;
            println!("new session: {token}");
            if std::env::var_os("AGENTCTL_REAL_AGENT_PROMPT").is_some() {
                let mut stream = Stream::open(&mut c, 0).await;
                let (reply, end) =
                    prompt(&mut c, &mut stream, "Reply with the single word: pong").await;
                println!("reply: {reply:?} ({end:?})");
            }
        }
        Err(e) => println!("new session refused (credentials?): {e:?}"),
    }
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

/// A stream whose cursor names the agentctl instance it came from.
async fn open_stream_of(client: &mut Client, after: u64, instance: &str) -> Stream {
    let mut req = tonic::Request::new(StreamUpdatesRequest {
        after_cursor: after,
    });
    req.metadata_mut()
        .insert("agentctl-instance-id", instance.parse().expect("ascii"));
    let inner = client
        .stream_updates(req)
        .await
        .expect("stream_updates")
        .into_inner();
    Stream { inner }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cursor_from_another_agentctl_process_starts_with_a_gap() {
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    let first_instance = health(&mut c).await.instance_id;
    assert_eq!(first_instance.len(), 32, "{first_instance:?}");
    c.launch_agent(h.demo(true, &[])).await.expect("launch");
    let mut s = Stream::open(&mut c, 0).await;
    let before = s
        .until(
            |u| matches!(&u.kind, Some(Kind::StateChanged(st)) if st.state() == AgentState::Ready),
        )
        .await;
    drop(s);
    assert!(before.iter().all(|u| u.instance_id == first_instance));
    let old_cursor = before.last().expect("updates").cursor;
    ctl.shutdown().await;

    // agentctl restarts (a container restart, a remote host restarting it):
    // cursors start at 1 again.
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    let instance = health(&mut c).await.instance_id;
    assert_ne!(instance, first_instance, "a fresh instance id per process");
    c.launch_agent(h.demo(true, &[])).await.expect("launch");
    let mut s = Stream::open(&mut c, 0).await;
    let now = s
        .until(
            |u| matches!(&u.kind, Some(Kind::StateChanged(st)) if st.state() == AgentState::Ready),
        )
        .await;
    drop(s);
    assert!(now.len() as u64 >= old_cursor, "{now:?}");

    // The backend's old cursor would skip this process's first updates; with
    // its instance named it gets a gap and then everything buffered.
    let mut s = open_stream_of(&mut c, old_cursor, &first_instance).await;
    match s.next().await.kind {
        Some(Kind::Gap(g)) => {
            assert_eq!(g.requested_after, old_cursor);
            assert_eq!(g.next_cursor, 1);
        }
        other => panic!("expected a gap, got {other:?}"),
    }
    let mut replayed = Vec::new();
    for _ in 0..now.len() {
        replayed.push(s.next().await);
    }
    assert_eq!(replayed, now, "everything buffered, from cursor 1");
    drop(s);

    // Naming this very instance keeps the plain cursor rules.
    let mut s = open_stream_of(&mut c, 1, &instance).await;
    assert_eq!(s.next().await, now[1]);
    drop(s);
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

/// A process that ignores TERM, HUP and PIPE (only the kernel's
/// parent-death signal can end it once agentctl is SIGKILLed), `$0` the
/// test's marker so the harness finds it.
fn stubborn(marker: String) -> (String, Vec<String>) {
    let script = "trap '' TERM HUP PIPE; while :; do sleep 1; done";
    ("sh".into(), vec!["-c".into(), script.into(), marker])
}

/// Waits for the marked process `start` has agentctl run, SIGKILLs
/// agentctl, and checks that process dies with it.
async fn dies_with_a_sigkilled_agentctl<F, Fut>(what: &str, start: F)
where
    F: FnOnce(Client, String) -> Fut,
    Fut: std::future::Future + Send + 'static,
    Fut::Output: Send,
{
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let c = ctl.client().await;
    let call = tokio::spawn(start(c, h.marker()));
    let deadline = Instant::now() + WAIT;
    let child = loop {
        let others: Vec<u32> = h
            .leftovers()
            .into_iter()
            .filter(|p| *p != ctl.pid)
            .collect();
        if let Some(pid) = others.first() {
            break *pid;
        }
        assert!(Instant::now() < deadline, "the {what} did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    ctl.signal("-KILL");
    let started = Instant::now();
    while alive(child) {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{what} {child} outlived its SIGKILLed agentctl"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = call.await;
    h.assert_no_leftovers().await;
}

/// helper-52 4: a command Exec runs ends with a `kill -9` of agentctl, as
/// the agent does; it ran on in the worktree until agentctl's relaunch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exec_command_dies_with_a_sigkilled_agentctl() {
    dies_with_a_sigkilled_agentctl("command", |mut c, marker| async move {
        let (command, args) = stubborn(marker);
        c.exec(ExecRequest {
            command,
            args,
            timeout_ms: 600_000,
            ..Default::default()
        })
        .await
    })
    .await;
}

/// An "agent" that never answers ACP and ignores its stdin closing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_dies_with_a_sigkilled_agentctl() {
    dies_with_a_sigkilled_agentctl("agent", |mut c, marker| async move {
        let (command, args) = stubborn(marker);
        c.launch_agent(LaunchAgentRequest {
            command,
            args,
            initialize_timeout_ms: 60_000,
            ..Default::default()
        })
        .await
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_larger_than_4_mib_go_both_ways() {
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl
        .client()
        .await
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20);
    let content: Vec<u8> = (0..10u32 << 20).map(|i| (i % 251) as u8).collect();
    let written = c
        .write_file(WriteFileRequest {
            path: "big.bin".into(),
            content: content.clone(),
            create_parents: false,
        })
        .await
        .expect("a 10 MiB write is accepted")
        .into_inner();
    assert_eq!(written.bytes_written, content.len() as u64);
    let read = c
        .read_file(ReadFileRequest {
            path: "big.bin".into(),
            max_bytes: u64::MAX,
        })
        .await
        .expect("a 10 MiB read is sent")
        .into_inner();
    assert!(read.content == content, "content differs");
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authenticate_missing_unknown_failing_and_configured() {
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;

    // Required but not configured: the launch works (many agents offer
    // methods they do not need), the first session call names the offered
    // methods and the profile key.
    let launched = c
        .launch_agent(h.demo(true, &[("ACP_DEMO_REQUIRE_AUTH", "1")]))
        .await
        .expect("launch")
        .into_inner();
    let offered: Vec<&str> = launched
        .auth_methods
        .iter()
        .map(|m| m.id.as_str())
        .collect();
    assert_eq!(offered, ["demo-token", "demo-login"]);
    assert_eq!(launched.authenticated_with, "");
    let err = c
        .new_session(NewSessionRequest {})
        .await
        .expect_err("auth required");
    assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
    for needle in [
        "requires authentication",
        "demo-token",
        "demo-login",
        "auth_method",
    ] {
        assert!(
            err.message().contains(needle),
            "{needle}: {}",
            err.message()
        );
    }
    c.stop_agent(StopAgentRequest { grace_ms: 0 })
        .await
        .expect("stop");

    // A method the agent does not offer.
    let mut req = h.demo(true, &[("ACP_DEMO_REQUIRE_AUTH", "1")]);
    req.auth_method = "api-key".into();
    let err = c.launch_agent(req).await.expect_err("not offered");
    assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
    assert!(
        err.message().contains("\"api-key\" is not offered")
            && err.message().contains("demo-token"),
        "{}",
        err.message()
    );
    assert_eq!(health(&mut c).await.agent_state(), AgentState::Exited);

    // Offered, but the environment it needs is missing: authenticate fails.
    let mut req = h.demo(true, &[("ACP_DEMO_REQUIRE_AUTH", "1")]);
    req.auth_method = "demo-token".into();
    let err = c.launch_agent(req).await.expect_err("authenticate fails");
    assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
    assert!(
        err.message().contains("authenticate") && err.message().contains("ACP_DEMO_TOKEN"),
        "{}",
        err.message()
    );

    // Configured with its environment: authenticated, sessions and prompts work.
    let mut req = h.demo(
        true,
        &[("ACP_DEMO_REQUIRE_AUTH", "1"), ("ACP_DEMO_TOKEN", "t0ken")],
    );
    req.auth_method = "demo-token".into();
    let launched = c.launch_agent(req).await.expect("launch").into_inner();
    assert_eq!(launched.authenticated_with, "demo-token");
    let mut stream = Stream::open(&mut c, 0).await;
    let token = c
        .new_session(NewSessionRequest {})
        .await
        .expect("new session after authenticate")
        .into_inner()
        .resume_token;
    let (reply, _) = prompt(&mut c, &mut stream, "hello").await;
    assert_eq!(
        reply,
        format!("turn 1 of session {token}: you said \"hello\"")
    );
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permission_policy_comes_from_the_launch_request() {
    let h = Harness::new();
    // agentctl's own default allows; the launch asks to deny.
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    let mut req = h.demo(true, &[]);
    req.permission_policy = PermissionPolicy::Deny as i32;
    c.launch_agent(req).await.expect("launch");
    let mut stream = Stream::open(&mut c, 0).await;
    c.new_session(NewSessionRequest {}).await.expect("session");
    let (reply, _) = prompt(&mut c, &mut stream, "/permission").await;
    assert!(reply.ends_with("permission: reject"), "{reply}");
    c.stop_agent(StopAgentRequest { grace_ms: 0 })
        .await
        .expect("stop");

    let mut req = h.demo(true, &[]);
    req.permission_policy = PermissionPolicy::Unspecified as i32;
    c.launch_agent(req).await.expect("launch");
    c.new_session(NewSessionRequest {}).await.expect("session");
    let (reply, _) = prompt(&mut c, &mut stream, "/permission").await;
    assert!(reply.ends_with("permission: allow"), "{reply}");
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

fn lines_of(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

async fn wait_lines(path: &Path, n: usize) {
    let deadline = Instant::now() + WAIT;
    while lines_of(path).len() < n {
        assert!(
            Instant::now() < deadline,
            "{} never had {n} lines",
            path.display()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Launches the demo agent with `env` and resumes conversation `token`.
async fn launch_and_resume(c: &mut Client, h: &Harness, env: &[(&str, &str)], token: &str) {
    c.launch_agent(h.demo(true, env)).await.expect("launch");
    c.resume_session(ResumeSessionRequest {
        resume_token: token.to_owned(),
    })
    .await
    .expect("resume");
}

fn turn_prompt(text: &str, turn: &str, only_if_journaled: bool) -> PromptRequest {
    PromptRequest {
        text: text.into(),
        turn_id: turn.into(),
        only_if_journaled,
        blocks: Vec::new(),
    }
}

/// The turn journal across `kill -9` of agentctl, at each agentctl-side
/// point of a turn, with an agent whose tool call appends a line to a
/// worktree file before it replies and which runs a grandchild process:
///
/// - killed after the turn was handed to the agent (the agent held at a gate
///   right after its side effect): a relaunched agentctl reading the journal
///   answers a re-sent Prompt `already_accepted` by the dead instance, phase
///   HANDED, and starts nothing (the side effect stays at one line);
/// - the dead agent's grandchild (which PDEATHSIG does not reach) is ended
///   by the relaunched agentctl before it serves;
/// - killed after recording acceptance, before Prompt returned (crash hook):
///   the turn never reached an agent, so the relaunched agentctl delivers it
///   once;
/// - without a journal, `only_if_journaled` refuses and starts nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turn_journal_survives_agentctl_kill9_and_old_trees_are_ended() {
    let h = Harness::new();
    let journal = h.base.path().join("exec.journal");
    let journal_arg = journal.to_string_lossy().into_owned();
    let side = h.ws().join("side-effects.txt");
    let gate = h.base.path().join("gate");
    let gc_file = h.base.path().join("grandchild.pid");
    let side_s = side.to_string_lossy().into_owned();
    let gate_s = gate.to_string_lossy().into_owned();
    let gc_s = gc_file.to_string_lossy().into_owned();
    let agent_env = [
        ("ACP_DEMO_SIDE_EFFECT_FILE", side_s.as_str()),
        ("ACP_DEMO_GATE_FILE", gate_s.as_str()),
        ("ACP_DEMO_GRANDCHILD_PID_FILE", gc_s.as_str()),
    ];

    // 1. Handed to the agent, which ran its tool call; then kill -9.
    let ctl = h.spawn(&["--journal", &journal_arg]).await;
    let mut c = ctl.client().await;
    let first = health(&mut c).await;
    assert!(first.journaled && first.journal_fresh, "{first:?}");
    let token = launch_and_open(&mut c, h.demo(true, &agent_env)).await;
    std::fs::write(&gate, "").unwrap();
    let p = c
        .prompt(turn_prompt("one", "t1", true))
        .await
        .expect("prompt")
        .into_inner();
    assert!(!p.already_accepted);
    assert_eq!(p.accepted_by_instance, first.instance_id);
    wait_lines(&side, 1).await;
    wait_lines(&gc_file, 1).await;
    let gc: u32 = lines_of(&gc_file)[0]
        .trim()
        .parse()
        .expect("grandchild pid");
    assert!(alive(gc));
    let mut ctl = ctl;
    ctl.signal("-KILL");
    ctl.wait_exit().await;
    // PDEATHSIG ended the agent, not its grandchild.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(alive(gc), "the grandchild outlives a SIGKILLed agentctl");
    std::fs::remove_file(&gate).unwrap();

    // 2. Relaunched on the same journal: the old tree ends first; the turn is
    // known as handed by the dead instance and is not run again.
    let ctl = h.spawn(&["--journal", &journal_arg]).await;
    wait_dead(gc).await;
    let mut c = ctl.client().await;
    let second = health(&mut c).await;
    assert!(second.journaled && !second.journal_fresh, "{second:?}");
    assert_ne!(second.instance_id, first.instance_id);
    assert_eq!(second.last_turn_id, "t1", "known from the journal");
    // The turn the dead process handed to its agent is reported, with its
    // text, for a backend that never recorded it.
    let first_update = Stream::open(&mut c, 0).await.next().await;
    match first_update.kind {
        Some(Kind::TurnStarted(t)) => {
            assert_eq!(
                (
                    t.turn_id.as_str(),
                    t.text.as_str(),
                    t.earlier_instance,
                    t.ended
                ),
                ("t1", "one", true, false),
                "{t:?}"
            );
        }
        other => panic!("expected the orphan turn first: {other:?}"),
    }
    launch_and_resume(&mut c, &h, &agent_env[..1], &token).await;
    let again = c
        .prompt(turn_prompt("one", "t1", true))
        .await
        .expect("prompt again")
        .into_inner();
    assert!(again.already_accepted, "{again:?}");
    assert_eq!(again.accepted_by_instance, first.instance_id);
    assert_eq!(again.phase, TurnPhase::Handed as i32);
    assert!(!again.turn_ended);
    let mut stream = Stream::open(&mut c, 0).await;
    let (reply, end) = prompt(&mut c, &mut stream, "two").await;
    assert_eq!(end.stop_reason, "end_turn");
    assert!(reply.contains("you said \"two\""), "{reply}");
    assert_eq!(lines_of(&side), ["one", "two"], "each prompt ran once");
    drop(stream);

    // 3. Crash after acceptance was recorded, before Prompt returned.
    ctl.shutdown().await;
    let ctl = h
        .spawn_env(
            &["--journal", &journal_arg],
            &[("AGENTCTL_TEST_CRASH_AT", "after-accepted")],
        )
        .await;
    let mut c = ctl.client().await;
    launch_and_resume(&mut c, &h, &agent_env[..1], &token).await;
    let lost = c.prompt(turn_prompt("three", "t3", true)).await;
    assert!(lost.is_err(), "agentctl died before answering: {lost:?}");
    let mut ctl = ctl;
    ctl.wait_exit().await;
    assert_eq!(lines_of(&side).len(), 2, "the agent never got it");
    let ctl = h.spawn(&["--journal", &journal_arg]).await;
    let mut c = ctl.client().await;
    launch_and_resume(&mut c, &h, &agent_env[..1], &token).await;
    let delivered = c
        .prompt(turn_prompt("three", "t3", true))
        .await
        .expect("prompt")
        .into_inner();
    assert!(!delivered.already_accepted, "{delivered:?}");
    wait_lines(&side, 3).await;
    // Only accepted by the dead process: it reached no agent and is not
    // reported as an earlier process's turn; it starts now, once.
    let seen = Stream::open(&mut c, 0).await.until_turn_end("t3").await;
    let starts: Vec<(String, bool)> = seen
        .iter()
        .filter_map(|u| match &u.kind {
            Some(Kind::TurnStarted(t)) => Some((t.turn_id.clone(), t.earlier_instance)),
            _ => None,
        })
        .collect();
    assert_eq!(starts, [("t3".to_owned(), false)], "{seen:?}");
    ctl.shutdown().await;

    // 4. No journal: a re-send that needs one starts nothing.
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    assert!(!health(&mut c).await.journaled);
    launch_and_resume(&mut c, &h, &agent_env[..1], &token).await;
    let refused = c
        .prompt(turn_prompt("four", "t4", true))
        .await
        .expect_err("no journal");
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert_eq!(lines_of(&side).len(), 3);
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

/// The journal lines of `kind` ("accepted", "handed") for `turn`.
fn journal_lines(journal: &Path, kind: &str, turn: &str) -> usize {
    lines_of(journal)
        .iter()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["k"] == kind && v["turn"] == turn)
        .count()
}

/// `HoldPrompt` (the backend's turn-start commit overlapping agentctl's
/// journal write), with an agent whose tool call appends each prompt to a
/// worktree file:
///
/// - a held turn is journaled accepted, leaves the agent idle and reaches
///   it only when a Prompt names it, which writes no second accepted line
///   and answers with the held message id; holding it again changes nothing;
/// - a held turn no Prompt names is replaced by the next turn and reaches no
///   agent; a Prompt naming it later starts it as a new turn;
/// - a held turn outlives `kill -9` of agentctl as "accepted, never handed":
///   the relaunched agentctl delivers it once when prompted;
/// - without a journal, or without a turn id, nothing is held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_turn_reaches_the_agent_only_when_prompted() {
    let h = Harness::new();
    let journal = h.base.path().join("exec.journal");
    let journal_arg = journal.to_string_lossy().into_owned();
    let side = h.ws().join("side-effects.txt");
    let side_s = side.to_string_lossy().into_owned();
    let agent_env = [("ACP_DEMO_SIDE_EFFECT_FILE", side_s.as_str())];

    let ctl = h.spawn(&["--journal", &journal_arg]).await;
    let mut c = ctl.client().await;
    let token = launch_and_open(&mut c, h.demo(true, &agent_env)).await;
    let mut stream = Stream::open(&mut c, 0).await;

    // 1. Held: journaled, nothing handed, the agent idle.
    let held = c
        .hold_prompt(turn_prompt("one", "t1", false))
        .await
        .expect("hold")
        .into_inner();
    assert!(!held.already_accepted, "{held:?}");
    assert_eq!(held.phase, TurnPhase::Accepted as i32);
    assert_eq!(journal_lines(&journal, "accepted", "t1"), 1);
    let again = c
        .hold_prompt(turn_prompt("one", "t1", false))
        .await
        .expect("hold again")
        .into_inner();
    assert_eq!(
        again.message_id, held.message_id,
        "holding again holds the same turn"
    );
    assert_eq!(health(&mut c).await.agent_state, AgentState::Ready as i32);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(lines_of(&side).is_empty(), "a held turn reaches no agent");
    assert_eq!(journal_lines(&journal, "handed", "t1"), 0);

    // 2. Prompted: started from the journal line already written.
    let started = c
        .prompt(turn_prompt("one", "t1", true))
        .await
        .expect("prompt")
        .into_inner();
    assert!(!started.already_accepted, "{started:?}");
    assert_eq!(started.message_id, held.message_id);
    let updates = stream.until_turn_end("t1").await;
    assert_eq!(turn_end(&updates).stop_reason, "end_turn");
    assert_eq!(lines_of(&side), ["one"]);
    assert_eq!(
        journal_lines(&journal, "accepted", "t1"),
        1,
        "not journaled twice"
    );
    assert_eq!(journal_lines(&journal, "handed", "t1"), 1);
    let late = c
        .hold_prompt(turn_prompt("one", "t1", false))
        .await
        .expect("hold a started turn")
        .into_inner();
    assert!(
        late.already_accepted,
        "a started turn holds nothing: {late:?}"
    );

    // 3. Replaced by the next turn; a late Prompt starts it as a new turn.
    c.hold_prompt(turn_prompt("two", "t2", false))
        .await
        .expect("hold t2");
    c.prompt(turn_prompt("three", "t3", true))
        .await
        .expect("prompt t3");
    stream.until_turn_end("t3").await;
    assert_eq!(
        lines_of(&side),
        ["one", "three"],
        "the replaced turn never ran"
    );
    c.prompt(turn_prompt("two", "t2", true))
        .await
        .expect("prompt t2");
    stream.until_turn_end("t2").await;
    assert_eq!(lines_of(&side), ["one", "three", "two"]);
    assert_eq!(journal_lines(&journal, "accepted", "t2"), 2);
    drop(stream);

    // 4. Held, then kill -9: accepted and never handed, so delivered once.
    c.hold_prompt(turn_prompt("four", "t4", false))
        .await
        .expect("hold t4");
    let mut ctl = ctl;
    ctl.signal("-KILL");
    ctl.wait_exit().await;
    let ctl = h.spawn(&["--journal", &journal_arg]).await;
    let mut c = ctl.client().await;
    launch_and_resume(&mut c, &h, &agent_env, &token).await;
    let delivered = c
        .prompt(turn_prompt("four", "t4", true))
        .await
        .expect("prompt t4")
        .into_inner();
    assert!(!delivered.already_accepted, "{delivered:?}");
    wait_lines(&side, 4).await;
    assert_eq!(lines_of(&side), ["one", "three", "two", "four"]);
    let refused = c
        .hold_prompt(turn_prompt("five", "", false))
        .await
        .expect_err("no turn id");
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    ctl.shutdown().await;

    // 5. No journal: nothing to hold.
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    launch_and_resume(&mut c, &h, &agent_env, &token).await;
    let refused = c
        .hold_prompt(turn_prompt("six", "t6", false))
        .await
        .expect_err("no journal");
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

/// The `permission` activity parts of `updates` (rev, parsed JSON).
fn permission_parts(updates: &[AgentUpdate]) -> Vec<(u64, serde_json::Value)> {
    updates
        .iter()
        .filter_map(|u| match &u.kind {
            Some(Kind::Activity(a)) if a.kind == "permission" => {
                Some((a.rev, serde_json::from_str(&a.json).expect("part JSON")))
            }
            _ => None,
        })
        .collect()
}

fn ask_launch(h: &Harness, timeout_ms: u64) -> LaunchAgentRequest {
    let mut req = h.demo(true, &[]);
    req.permission_policy = PermissionPolicy::Ask as i32;
    req.permission_timeout_ms = timeout_ms;
    req
}

/// A permission request that offers no options is refused at once with
/// INVALID_PARAMS under every policy: it never reaches the stream (no user
/// could answer it) and never waits out the permission timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permission_request_without_options_is_refused_at_once() {
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    // An hour of timeout: a request that waited would fail the test.
    launch_and_open(&mut c, ask_launch(&h, 3_600_000)).await;
    let mut stream = Stream::open(&mut c, 0).await;
    let resp = c
        .prompt(turn_prompt("/permission-none", "t1", false))
        .await
        .expect("prompt")
        .into_inner();
    let updates = stream.until_turn_end(&resp.turn_id).await;
    let (reply, _) = reply_text(&updates, &resp.message_id);
    assert!(
        reply.contains("permission: refused: ") && reply.contains("at least one option"),
        "{reply}"
    );
    assert!(permission_parts(&updates).is_empty(), "{updates:?}");
    // The same under a policy that answers by itself.
    c.stop_agent(StopAgentRequest { grace_ms: 0 })
        .await
        .expect("stop");
    launch_and_open(&mut c, h.demo(true, &[])).await;
    let (reply, _) = prompt(&mut c, &mut stream, "/permission-none").await;
    assert!(reply.contains("permission: refused: "), "{reply}");
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

/// Policy ASK: the request goes on the stream (journaled first) and waits
/// for RespondPermission (unknown request NOT_FOUND, foreign option
/// INVALID_ARGUMENT); an allowed edit is written; an unanswered one times
/// out with the agent's reject option; a cancelled turn cancels it; and a
/// request pending when agentctl is SIGKILLed is reported cancelled by the
/// next agentctl process on the same journal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ask_policy_waits_for_an_answer_times_out_and_is_journaled() {
    let h = Harness::new();
    let journal = h.base.path().join("exec.journal");
    let journal_arg = journal.to_string_lossy().into_owned();
    let ctl = h.spawn(&["--journal", &journal_arg]).await;
    let mut c = ctl.client().await;
    let token = launch_and_open(&mut c, ask_launch(&h, 60_000)).await;
    let mut stream = Stream::open(&mut c, 0).await;

    // Asked: pending, with the tool call, the options and its deadline.
    c.prompt(turn_prompt("/edit a.txt one", "t1", false))
        .await
        .expect("prompt");
    let seen = stream
        .until(|u| matches!(&u.kind, Some(Kind::Activity(a)) if a.kind == "permission"))
        .await;
    let (rev, part) = permission_parts(&seen).pop().unwrap();
    assert_eq!(rev, 1);
    assert_eq!(part["status"], "pending");
    assert_eq!(part["turnId"], "t1");
    assert_eq!(part["toolCall"]["title"], "write a.txt");
    assert_eq!(part["options"][0]["optionId"], "allow");
    assert_eq!(part["options"][1]["kind"], "reject_once");
    assert_eq!(
        part["expiresAtMs"].as_u64().unwrap() - part["requestedAtMs"].as_u64().unwrap(),
        60_000
    );
    let request = part["requestId"].as_str().unwrap().to_owned();
    assert!(
        std::fs::read_to_string(&journal)
            .unwrap()
            .contains(&request),
        "journaled before it was sent"
    );
    assert!(!h.ws().join("a.txt").exists());
    let err = c
        .respond_permission(RespondPermissionRequest {
            request_id: "nope".into(),
            option_id: "allow".into(),
            content_json: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    let err = c
        .respond_permission(RespondPermissionRequest {
            request_id: request.clone(),
            option_id: "sometimes".into(),
            content_json: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("allow, reject"), "{err:?}");
    c.respond_permission(RespondPermissionRequest {
        request_id: request.clone(),
        option_id: "allow".into(),
        content_json: String::new(),
    })
    .await
    .expect("answer");
    let seen = stream.until_turn_end("t1").await;
    let (rev, part) = permission_parts(&seen).pop().unwrap();
    assert_eq!(rev, 2);
    assert_eq!(
        (part["status"].as_str(), part["optionId"].as_str()),
        (Some("selected"), Some("allow"))
    );
    assert_eq!(
        std::fs::read_to_string(h.ws().join("a.txt")).unwrap(),
        "one"
    );
    // Answered: no longer waiting.
    let err = c
        .respond_permission(RespondPermissionRequest {
            request_id: request.clone(),
            option_id: "allow".into(),
            content_json: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");

    // Cancelling the turn cancels its request.
    c.prompt(turn_prompt("/edit c.txt three", "t2", false))
        .await
        .expect("prompt");
    stream
        .until(|u| matches!(&u.kind, Some(Kind::Activity(a)) if a.kind == "permission"))
        .await;
    assert!(
        c.cancel(CancelRequest {})
            .await
            .expect("cancel")
            .into_inner()
            .cancelled
    );
    let seen = stream.until_turn_end("t2").await;
    let (rev, part) = permission_parts(&seen).pop().unwrap();
    assert_eq!((rev, part["status"].as_str()), (2, Some("cancelled")));
    assert!(!h.ws().join("c.txt").exists());

    // Pending when agentctl is SIGKILLed: the next process reports it.
    c.prompt(turn_prompt("/edit d.txt four", "t3", false))
        .await
        .expect("prompt");
    let seen = stream
        .until(|u| matches!(&u.kind, Some(Kind::Activity(a)) if a.kind == "permission"))
        .await;
    let dead = permission_parts(&seen).pop().unwrap().1["requestId"]
        .as_str()
        .unwrap()
        .to_owned();
    drop(stream);
    let mut ctl = ctl;
    ctl.signal("-KILL");
    ctl.wait_exit().await;
    let ctl = h.spawn(&["--journal", &journal_arg]).await;
    let mut c = ctl.client().await;
    let mut stream = Stream::open(&mut c, 0).await;
    let seen = stream
        .until(|u| matches!(&u.kind, Some(Kind::Activity(a)) if a.kind == "permission"))
        .await;
    let (rev, part) = permission_parts(&seen).pop().unwrap();
    assert_eq!(part["requestId"], dead.as_str());
    assert_eq!((rev, part["status"].as_str()), (2, Some("cancelled")));
    assert!(
        part["reason"].as_str().unwrap().contains("agentctl exited"),
        "{part}"
    );
    assert!(!h.ws().join("d.txt").exists());

    // Timeout: the agent's reject option, and the tool does not run.
    c.launch_agent(ask_launch(&h, 300)).await.expect("launch");
    c.resume_session(ResumeSessionRequest {
        resume_token: token,
    })
    .await
    .expect("resume");
    let (reply, end) = prompt(&mut c, &mut stream, "/edit b.txt two").await;
    assert_eq!(end.stop_reason, "end_turn");
    assert!(reply.contains("not allowed (reject)"), "{reply}");
    assert!(!h.ws().join("b.txt").exists());
    drop(stream);
    let mut stream = Stream::open(&mut c, 0).await;
    let seen = stream.until_turn_end(&end.turn_id).await;
    let (rev, part) = permission_parts(&seen).pop().unwrap();
    assert_eq!(rev, 2);
    assert_eq!(
        (part["status"].as_str(), part["optionId"].as_str()),
        (Some("timed_out"), Some("reject"))
    );
    assert!(
        part["reason"]
            .as_str()
            .unwrap()
            .contains("no answer within"),
        "{part}"
    );
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

/// `request` carrying sessiond's lease epoch `epoch`.
fn epoch<T>(request: T, epoch: i64) -> tonic::Request<T> {
    let mut r = tonic::Request::new(request);
    r.metadata_mut().insert(
        "sessiond-lease-epoch",
        epoch.to_string().parse().expect("ok"),
    );
    r
}

fn assert_stale(status: &tonic::Status, sent: i64, newest: i64) {
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    let m = status.message();
    assert!(m.starts_with("stale_epoch"), "{m}");
    assert!(
        m.contains(&format!("epoch {sent}")) && m.contains(&format!("epoch {newest}")),
        "{m}"
    );
}

/// Fencing: agentctl keeps the newest lease epoch it has seen and refuses
/// calls carrying an older one (prompt, launch, exec, health alike) before
/// they act; calls without the header are accepted and lower nothing; the
/// newest epoch is in `<journal>.epoch` and a relaunched agentctl (kill -9,
/// same journal) still refuses the old one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn older_lease_epochs_are_refused_across_an_agentctl_restart() {
    let h = Harness::new();
    let journal = h.base.path().join("exec.journal");
    let journal_arg = journal.to_string_lossy().into_owned();
    let epoch_file = h.base.path().join("exec.journal.epoch");
    let side = h.ws().join("side-effects.txt");
    let side_s = side.to_string_lossy().into_owned();
    let agent_env = [("ACP_DEMO_SIDE_EFFECT_FILE", side_s.as_str())];

    let ctl = h.spawn(&["--journal", &journal_arg]).await;
    let mut c = ctl.client().await;
    // The first owner (epoch 1) launches the agent and prompts once.
    c.launch_agent(epoch(h.demo(true, &agent_env), 1))
        .await
        .expect("launch");
    c.new_session(epoch(NewSessionRequest {}, 1))
        .await
        .expect("session");
    c.prompt(epoch(turn_prompt("one", "t1", false), 1))
        .await
        .expect("prompt");
    wait_lines(&side, 1).await;
    assert_eq!(
        std::fs::read_to_string(&epoch_file).expect("ok").trim(),
        "1",
        "persisted"
    );

    // Another replica adopts (epoch 2): its first call fences epoch 1 off.
    health(&mut c).await; // no header: accepted, lowers nothing
    c.health(epoch(HealthRequest {}, 2))
        .await
        .expect("health at 2");
    assert_eq!(
        std::fs::read_to_string(&epoch_file).expect("ok").trim(),
        "2"
    );
    let err = c
        .prompt(epoch(turn_prompt("stale", "t2", false), 1))
        .await
        .expect_err("refused");
    assert_stale(&err, 1, 2);
    let err = c
        .exec(epoch(
            ExecRequest {
                command: "touch".into(),
                args: vec!["stale-exec".into()],
                ..Default::default()
            },
            1,
        ))
        .await
        .expect_err("refused");
    assert_stale(&err, 1, 2);
    assert!(!h.ws().join("stale-exec").exists());
    let err = c
        .cancel(epoch(CancelRequest {}, 0))
        .await
        .expect_err("refused");
    assert_stale(&err, 0, 2);
    assert_eq!(lines_of(&side), ["one"], "the stale prompt never ran");
    // Without the header: accepted; the stored epoch stays 2.
    health(&mut c).await;
    assert_eq!(
        std::fs::read_to_string(&epoch_file).expect("ok").trim(),
        "2"
    );
    // A malformed epoch is a bad request, not a pass.
    let mut bad = tonic::Request::new(HealthRequest {});
    bad.metadata_mut()
        .insert("sessiond-lease-epoch", "two".parse().expect("ok"));
    assert_eq!(
        c.health(bad).await.expect_err("refused").code(),
        Code::InvalidArgument
    );

    // kill -9 and relaunch on the same journal: epoch 2 is remembered.
    let mut ctl = ctl;
    ctl.signal("-KILL");
    ctl.wait_exit().await;
    let ctl = h.spawn(&["--journal", &journal_arg]).await;
    let mut c = ctl.client().await;
    let err = c
        .launch_agent(epoch(h.demo(true, &agent_env), 1))
        .await
        .expect_err("refused");
    assert_stale(&err, 1, 2);
    c.launch_agent(epoch(h.demo(true, &agent_env), 2))
        .await
        .expect("launch at 2");
    c.new_session(epoch(NewSessionRequest {}, 3))
        .await
        .expect("session at 3");
    let err = c
        .prompt(epoch(turn_prompt("stale", "t3", false), 2))
        .await
        .expect_err("refused");
    assert_stale(&err, 2, 3);
    c.prompt(epoch(turn_prompt("two", "t4", false), 3))
        .await
        .expect("prompt at 3");
    wait_lines(&side, 2).await;
    assert_eq!(lines_of(&side), ["one", "two"]);
    assert_eq!(
        std::fs::read_to_string(&epoch_file).expect("ok").trim(),
        "3"
    );
    ctl.shutdown().await;
}

/// The calls the demo agent (or the Python agent) logged to its
/// `calls.log`, of process `pid`: (method, replayed).
fn calls_of(h: &Harness, pid: u32) -> Vec<(String, Option<u64>)> {
    let path = h.base.path().join("state/calls.log");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("a JSON line"))
        .filter(|v| v["pid"].as_u64() == Some(u64::from(pid)))
        .map(|v| {
            (
                v["method"].as_str().unwrap_or_default().to_owned(),
                v["replayed"].as_u64(),
            )
        })
        .collect()
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

/// A heavy agent (it holds 64 MiB and computes for 1.5 s of CPU time
/// before it reads stdin, as a Node runtime starting does) shows signs of
/// life in Health while LaunchAgent waits for it, before it answered
/// anything on ACP: its stderr lines count and its CPU time grows (never
/// back). After the launch the counts include the busy time and the
/// initialize answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_shows_a_heavy_launch_working() {
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    let idle = health(&mut c).await;
    assert_eq!((idle.agent_activity, idle.agent_cpu_ms), (0, 0));

    let req = h.demo(
        true,
        &[("ACP_DEMO_BUSY_MS", "1500"), ("ACP_DEMO_RSS_MB", "64")],
    );
    let mut launcher = c.clone();
    let started = Instant::now();
    let launch = tokio::spawn(async move { launcher.launch_agent(req).await });
    // (activity, cpu) of every Health answered while the agent was starting.
    let mut starting = Vec::new();
    while !launch.is_finished() {
        let hl = health(&mut c).await;
        if hl.agent_state() == AgentState::Starting {
            starting.push((hl.agent_activity, hl.agent_cpu_ms));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let launched = launch.await.expect("join").expect("launch").into_inner();
    let took = started.elapsed();
    assert!(
        starting.iter().any(|&(lines, _)| lines >= 1),
        "no stderr line counted while starting: {starting:?}"
    );
    let cpu: Vec<u64> = starting.iter().map(|&(_, cpu)| cpu).collect();
    assert!(
        cpu.windows(2).any(|w| w[1] > w[0]),
        "CPU time did not grow while starting: {starting:?}"
    );
    assert!(
        cpu.windows(2).all(|w| w[1] >= w[0]),
        "CPU time went back: {starting:?}"
    );
    // Three stderr lines (memory, busy, started) and the initialize answer;
    // stderr is read on its own, so wait for the last line to be counted.
    let deadline = Instant::now() + WAIT;
    let after = loop {
        let hl = health(&mut c).await;
        if hl.agent_activity >= 4 {
            break hl;
        }
        assert!(Instant::now() < deadline, "activity stays at {hl:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(after.agent_state(), AgentState::Ready);
    assert!(
        after.agent_cpu_ms >= 1500,
        "the agent computed for 1.5 s: {after:?}"
    );
    assert!(
        after.agent_cpu_wait_ms.is_some(),
        "no wait for a CPU counted (/proc/PID/schedstat): {after:?}"
    );
    assert!(!after.resuming);
    let rss = rss_kib(launched.agent_pid);
    assert!(rss >= 64 * 1024, "agent RSS {rss} KiB");
    eprintln!(
        "heavy launch: {} ms, {} Health samples while starting (last {:?}), then activity {} cpu {} ms rss {} MiB",
        took.as_millis(),
        starting.len(),
        starting.last(),
        after.agent_activity,
        after.agent_cpu_ms,
        rss / 1024
    );
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

/// ResumeSession reopens a conversation by ACP `session/resume` when the
/// agent offers it (nothing replayed), by `session/load` when it does not
/// (the history replayed and dropped, Health saying so while it runs), and
/// by `session/load` when the agent offers resume but refuses it as an
/// unknown method. The agent's `calls.log` shows the call each process got.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_prefers_session_resume_and_loads_otherwise() {
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    let mut stream = Stream::open(&mut c, 0).await;
    c.launch_agent(h.demo(true, &[])).await.expect("launch");
    let cp = caps(&mut c).await;
    assert_eq!(cp.supports_session_resume(), Capability::Supported);
    assert_eq!(cp.agent_load_session, Some(true));
    assert_eq!(cp.agent_resume_session, Some(true));
    let token = c
        .new_session(NewSessionRequest {})
        .await
        .expect("new session")
        .into_inner()
        .resume_token;
    prompt(&mut c, &mut stream, "one").await;
    prompt(&mut c, &mut stream, "two").await;

    // Offered: session/resume, nothing replayed.
    let stop = StopAgentRequest { grace_ms: 2000 };
    c.stop_agent(stop).await.expect("stop");
    let pid = c
        .launch_agent(h.demo(true, &[]))
        .await
        .expect("relaunch")
        .into_inner()
        .agent_pid;
    let resumed = c
        .resume_session(ResumeSessionRequest {
            resume_token: token.clone(),
        })
        .await
        .expect("resume")
        .into_inner();
    assert_eq!(resumed.method(), ResumeMethod::Resume);
    assert_eq!(resumed.replayed, 0);
    assert_eq!(
        calls_of(&h, pid),
        vec![
            ("initialize".to_owned(), None),
            ("session/resume".to_owned(), Some(0))
        ]
    );
    let (reply, _) = prompt(&mut c, &mut stream, "three").await;
    assert_eq!(
        reply,
        format!("turn 3 of session {token}: you said \"three\"")
    );

    // Not offered: session/load, each of the 6 messages after 150 ms of
    // CPU time; Health shows the resume and the replay in progress.
    c.stop_agent(stop).await.expect("stop");
    let pid = c
        .launch_agent(h.demo(
            true,
            &[
                ("ACP_DEMO_NO_RESUME_SESSION", "1"),
                ("ACP_DEMO_LOAD_MS_PER_MESSAGE", "150"),
            ],
        ))
        .await
        .expect("relaunch")
        .into_inner()
        .agent_pid;
    let cp = caps(&mut c).await;
    assert_eq!(cp.supports_session_resume(), Capability::Supported);
    assert_eq!(cp.agent_resume_session, Some(false));
    let mut resumer = c.clone();
    let request = ResumeSessionRequest {
        resume_token: token.clone(),
    };
    let resume = tokio::spawn(async move { resumer.resume_session(request).await });
    let mut during = Vec::new();
    while !resume.is_finished() {
        let hl = health(&mut c).await;
        during.push((hl.resuming, hl.replayed));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let resumed = resume.await.expect("join").expect("resume").into_inner();
    assert_eq!(resumed.method(), ResumeMethod::Load);
    assert_eq!(
        resumed.replayed, 6,
        "three turns, a prompt and a reply each"
    );
    assert_eq!(
        calls_of(&h, pid),
        vec![
            ("initialize".to_owned(), None),
            ("session/load".to_owned(), Some(6))
        ]
    );
    assert!(
        during.iter().any(|&(r, n)| r && (1..6).contains(&n)),
        "no replay in progress seen in Health: {during:?}"
    );
    let after = health(&mut c).await;
    assert_eq!((after.resuming, after.replayed), (false, 0));
    let (reply, _) = prompt(&mut c, &mut stream, "four").await;
    assert_eq!(
        reply,
        format!("turn 4 of session {token}: you said \"four\"")
    );

    // Offered but refused as an unknown method: session/load.
    c.stop_agent(stop).await.expect("stop");
    let pid = c
        .launch_agent(h.demo(true, &[("ACP_DEMO_REFUSE_RESUME", "1")]))
        .await
        .expect("relaunch")
        .into_inner()
        .agent_pid;
    assert_eq!(caps(&mut c).await.agent_resume_session, Some(true));
    let resumed = c
        .resume_session(ResumeSessionRequest {
            resume_token: token.clone(),
        })
        .await
        .expect("resume")
        .into_inner();
    assert_eq!(resumed.method(), ResumeMethod::Load);
    assert_eq!(resumed.replayed, 8);
    assert_eq!(
        calls_of(&h, pid),
        vec![
            ("initialize".to_owned(), None),
            ("session/load".to_owned(), Some(8))
        ]
    );
    // Nothing replayed reached the stream: the next chunks are the turn's.
    let resp = c
        .prompt(PromptRequest {
            text: "five".into(),
            turn_id: "turn-5".into(),
            ..Default::default()
        })
        .await
        .expect("prompt")
        .into_inner();
    for u in stream.until_turn_end("turn-5").await {
        if let Some(Kind::MessageChunk(m)) = &u.kind {
            assert_eq!(
                m.message_id, resp.message_id,
                "replayed history leaked: {u:?}"
            );
        }
    }
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

/// An agent that offers `session/resume` and not `session/load` is
/// resumable, and resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_only_agent_is_resumable() {
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    let mut stream = Stream::open(&mut c, 0).await;
    let resume_only = [("ACP_DEMO_NO_LOAD_SESSION", "1")];
    let launched = c
        .launch_agent(h.demo(true, &resume_only))
        .await
        .expect("launch")
        .into_inner();
    assert!(!launched.agent_load_session);
    let cp = caps(&mut c).await;
    assert_eq!(cp.supports_session_resume(), Capability::Supported);
    assert_eq!(cp.agent_load_session, Some(false));
    assert_eq!(cp.agent_resume_session, Some(true));
    let token = c
        .new_session(NewSessionRequest {})
        .await
        .expect("new session")
        .into_inner()
        .resume_token;
    prompt(&mut c, &mut stream, "before").await;
    c.stop_agent(StopAgentRequest { grace_ms: 2000 })
        .await
        .expect("stop");

    let pid = c
        .launch_agent(h.demo(true, &resume_only))
        .await
        .expect("relaunch")
        .into_inner()
        .agent_pid;
    let resumed = c
        .resume_session(ResumeSessionRequest {
            resume_token: token.clone(),
        })
        .await
        .expect("resume")
        .into_inner();
    assert_eq!(resumed.method(), ResumeMethod::Resume);
    assert_eq!(resumed.replayed, 0);
    assert_eq!(health(&mut c).await.acp_session_id, token);
    assert_eq!(
        calls_of(&h, pid),
        vec![
            ("initialize".to_owned(), None),
            ("session/resume".to_owned(), Some(0))
        ]
    );
    let (reply, _) = prompt(&mut c, &mut stream, "after").await;
    assert_eq!(
        reply,
        format!("turn 2 of session {token}: you said \"after\"")
    );
    // An unknown conversation is the agent's "not found".
    let err = c
        .resume_session(ResumeSessionRequest {
            resume_token: "no-such-session".into(),
        })
        .await
        .expect_err("unknown token");
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

/// The initialize limit bounds the agent's silence, not its work: an agent
/// that computes for 3 s of CPU time before it reads stdin is waited for
/// with a limit of 1 s, an agent that sleeps (no output, no CPU time) is
/// cut after 1 s of that and stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initialize_waits_while_the_agent_works_and_cuts_it_when_silent() {
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;

    let mut req = h.demo(true, &[("ACP_DEMO_BUSY_MS", "3000")]);
    req.initialize_timeout_ms = 1000;
    let started = Instant::now();
    c.launch_agent(req)
        .await
        .expect("a busy agent is waited for");
    let took = started.elapsed();
    // 3 s of CPU time on one thread take at least 3 s: longer than the limit.
    assert!(took >= Duration::from_secs(3), "{took:?}");
    let hl = health(&mut c).await;
    assert_eq!(hl.agent_state(), AgentState::Ready);
    assert!(hl.agent_cpu_ms >= 3000, "{hl:?}");
    eprintln!(
        "busy agent launched in {} ms with a 1000 ms silence limit (cpu {} ms)",
        took.as_millis(),
        hl.agent_cpu_ms
    );
    c.stop_agent(StopAgentRequest { grace_ms: 2000 })
        .await
        .expect("stop");

    let mut req = h.demo(true, &[("ACP_DEMO_STARTUP_MS", "60000")]);
    req.initialize_timeout_ms = 1000;
    let started = Instant::now();
    let err = c
        .launch_agent(req)
        .await
        .expect_err("a silent agent is cut");
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
    assert!(
        err.message().contains("no sign of life for 1000 ms"),
        "{}",
        err.message()
    );
    eprintln!(
        "silent agent cut after {} ms",
        started.elapsed().as_millis()
    );
    assert_eq!(health(&mut c).await.agent_state(), AgentState::Exited);
    let deadline = Instant::now() + WAIT;
    while h.leftovers() != vec![ctl.pid] {
        assert!(
            Instant::now() < deadline,
            "agent survived: {:?}",
            h.leftovers()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

/// The interop agent on the Python ACP SDK with `--resume-only`
/// (`sessionCapabilities.resume`, `loadSession: false`) is resumable and
/// resumed by `session/resume` in a new process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the Python ACP SDK's virtualenv (cargo xtask interop-venv): run by cargo xtask ci"]
async fn a_python_sdk_agent_offering_only_resume_is_resumed() {
    let target = agentctl_exe()
        .parent()
        .and_then(Path::parent)
        .expect("target dir")
        .to_path_buf();
    let python = target.join("interop-venv/bin/python3");
    assert!(
        python.is_file(),
        "{} not found: make the virtualenv with `cargo xtask interop-venv`",
        python.display()
    );
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/interop/python_agent.py");
    assert!(script.is_file(), "{} not found", script.display());
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    let req = LaunchAgentRequest {
        command: python.to_string_lossy().into_owned(),
        args: vec![
            script.to_string_lossy().into_owned(),
            "--state-dir".into(),
            h.base.path().join("state").to_string_lossy().into_owned(),
            "--resume-only".into(),
        ],
        profile_supports_session_resume: true,
        initialize_timeout_ms: 20_000,
        ..Default::default()
    };
    c.launch_agent(req.clone()).await.expect("launch");
    let cp = caps(&mut c).await;
    assert_eq!(cp.supports_session_resume(), Capability::Supported);
    assert_eq!(cp.agent_load_session, Some(false));
    assert_eq!(cp.agent_resume_session, Some(true));
    let token = c
        .new_session(NewSessionRequest {})
        .await
        .expect("new session")
        .into_inner()
        .resume_token;
    c.stop_agent(StopAgentRequest { grace_ms: 2000 })
        .await
        .expect("stop");
    let pid = c
        .launch_agent(req)
        .await
        .expect("relaunch")
        .into_inner()
        .agent_pid;
    let resumed = c
        .resume_session(ResumeSessionRequest {
            resume_token: token.clone(),
        })
        .await
        .expect("resume")
        .into_inner();
    assert_eq!(resumed.method(), ResumeMethod::Resume);
    assert_eq!(resumed.replayed, 0);
    assert_eq!(health(&mut c).await.acp_session_id, token);
    assert_eq!(
        calls_of(&h, pid),
        vec![
            ("initialize".to_owned(), None),
            ("session/resume".to_owned(), Some(0))
        ]
    );
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

/// A command that detaches a process from its session (`setsid`, output
/// closed, so neither the group kill nor the pipe holders reach it) and
/// exits: nothing it started outlives the call.
/// Signals ignored by whoever started agentctl (as `nohup` and a shell's
/// background job leave them) are not passed on to what Exec runs: its
/// command starts with every signal at its default action.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_commands_start_with_default_signal_actions() {
    let mut h = Harness::new();
    h.before_exec = Some("trap '' HUP QUIT");
    let ctl = h.spawn(&[]).await;
    let ignored_of = |status: &str| {
        let line = status
            .lines()
            .find(|l| l.starts_with("SigIgn:"))
            .expect("SigIgn line");
        u64::from_str_radix(line["SigIgn:".len()..].trim(), 16).expect("hex mask")
    };
    let bit = |sig: i32| 1u64 << (sig - 1);
    let agentctl_status =
        std::fs::read_to_string(format!("/proc/{}/status", ctl.pid)).expect("agentctl status");
    assert_ne!(
        ignored_of(&agentctl_status) & bit(libc::SIGHUP),
        0,
        "the test must start agentctl with SIGHUP ignored"
    );
    let mut c = ctl.client().await;
    let out = c
        .exec(ExecRequest {
            command: "cat".into(),
            args: vec!["/proc/self/status".into()],
            ..Default::default()
        })
        .await
        .expect("exec")
        .into_inner();
    let ignored = ignored_of(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(
        ignored & (bit(libc::SIGHUP) | bit(libc::SIGQUIT)),
        0,
        "{ignored:x}"
    );
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_children_get_no_descriptor_agentctl_inherited() {
    // helper-39 9: a descriptor agentctl's parent left open (no
    // close-on-exec) reached the agent and every Exec and terminal.
    let mut h = Harness::new();
    h.before_exec = Some("exec 7</dev/null");
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    let out = c
        .exec(ExecRequest {
            command: "ls".into(),
            args: vec!["/proc/self/fd".into()],
            ..Default::default()
        })
        .await
        .expect("exec")
        .into_inner();
    assert_eq!(out.exit_code, Some(0));
    let fds = String::from_utf8_lossy(&out.stdout).into_owned();
    // 0-2, and ls's own handle on the directory it lists.
    assert!(
        fds.lines()
            .all(|fd| fd.parse::<u32>().is_ok_and(|n| n <= 3)),
        "{fds}"
    );
}

#[tokio::test]
async fn exec_leaves_nothing_running_even_what_left_its_session() {
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    let out = c
        .exec(ExecRequest {
            command: "sh".into(),
            args: vec![
                "-c".into(),
                // The pause gives the child time to detach before the shell exits.
                "setsid sleep 42 >/dev/null 2>&1 </dev/null & echo $! > detached.pid; sleep 0.5; echo started"
                    .into(),
            ],
            ..Default::default()
        })
        .await
        .expect("exec")
        .into_inner();
    assert_eq!(out.exit_code, Some(0));
    assert_eq!(out.stdout, b"started\n");
    let pid: u32 = std::fs::read_to_string(h.ws().join("detached.pid"))
        .expect("pid file")
        .trim()
        .parse()
        .expect("pid");
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = stat
        .rsplit(')')
        .next()
        .and_then(|r| r.split_whitespace().next());
    assert!(
        state.is_none() || state == Some("Z"),
        "the detached sleep {pid} outlived the call: {stat}"
    );
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

/// An Exec whose caller goes away (the call cancelled, the backend killed)
/// ends everything the command started, not only the command: the shell's
/// `sleep` once kept running on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exec_its_caller_dropped_leaves_nothing_running() {
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    let call = tokio::spawn(async move {
        c.exec(ExecRequest {
            command: "sh".into(),
            args: vec![
                "-c".into(),
                "echo $$ > sh.pid; sleep 31 & echo $! > sleep.pid; wait; echo done > done.txt"
                    .into(),
            ],
            ..Default::default()
        })
        .await
    });
    let pid_of = |name: &str| -> Option<u32> {
        std::fs::read_to_string(h.ws().join(name))
            .ok()
            .and_then(|s| s.trim().parse().ok())
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let sleep = loop {
        if let Some(pid) = pid_of("sleep.pid") {
            break pid;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the command did not start"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(alive(sleep));
    call.abort();
    let _ = call.await;
    wait_dead(sleep).await;
    if let Some(sh) = pid_of("sh.pid") {
        wait_dead(sh).await;
    }
    assert!(!h.ws().join("done.txt").exists());
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

/// An update the agent sends that our ACP schema cannot parse (the demo
/// agent's `/unparsed`: a tool call whose id is a number) is not lost: it
/// reaches the stream as a complete `unparsed` part of the turn, with the
/// parse error and the raw JSON, the turn goes on, and the log names the
/// method and the error once however often it comes.
#[tokio::test]
async fn an_update_that_does_not_parse_is_kept_raw_and_logged_once() {
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    let mut stream = Stream::open(&mut c, 0).await;
    c.launch_agent(h.demo(true, &[])).await.expect("launch");
    c.new_session(NewSessionRequest {}).await.expect("session");
    let mut parts = Vec::new();
    for _ in 0..2 {
        let resp = c
            .prompt(PromptRequest {
                text: "/unparsed".into(),
                ..Default::default()
            })
            .await
            .expect("prompt")
            .into_inner();
        let updates = stream.until_turn_end(&resp.turn_id).await;
        assert_eq!(turn_end(&updates).stop_reason, "end_turn");
        let (reply, _) = reply_text(&updates, &resp.message_id);
        assert!(reply.ends_with("unparsed: sent"), "{reply:?}");
        let raw: Vec<Activity> = updates
            .iter()
            .filter_map(|u| match &u.kind {
                Some(Kind::Activity(a)) if a.kind == "unparsed" => Some(a.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(raw.len(), 1, "{updates:?}");
        assert_eq!(raw[0].turn_id, resp.turn_id);
        assert!(raw[0].complete);
        parts.push(raw[0].clone());
    }
    assert_ne!(parts[0].part_id, parts[1].part_id, "one part per update");
    let v: serde_json::Value = serde_json::from_str(&parts[0].json).expect("json");
    assert_eq!(v["method"], "session/update");
    assert_eq!(v["sessionUpdate"], "tool_call");
    assert!(
        v["error"]
            .as_str()
            .unwrap_or_default()
            .contains("invalid type"),
        "{v}"
    );
    let sent: serde_json::Value =
        serde_json::from_str(v["json"].as_str().expect("raw json")).expect("the raw params");
    assert_eq!(sent["update"]["toolCallId"], 7, "{v}");
    assert!(
        parts[0].text.starts_with("tool_call: invalid type"),
        "{:?}",
        parts[0].text
    );
    ctl.shutdown().await;
    let log = std::fs::read_to_string(h.base.path().join("agentctl.log")).expect("log");
    let warned = log
        .lines()
        .filter(|l| l.contains("did not parse") && l.contains("session/update"))
        .count();
    assert_eq!(warned, 1, "logged once:\n{log}");
    assert!(!log.contains("Invalid params"), "{log}");
    h.assert_no_leftovers().await;
}

fn git_in(dir: &Path, args: &[&str]) {
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["-c", "user.name=t", "-c", "user.email=t@example.com"])
        .args(args)
        .output()
        .expect("git");
    assert!(out.status.success(), "git {args:?}: {out:?}");
}

/// A remote host's agentctl started with `--worktree-root` and no
/// workspace: workspace calls wait for a worktree; `Worktree` works only
/// inside its roots (a symlink out of one included) and for one worktree;
/// create binds it, remove unbinds it.
#[tokio::test]
async fn worktree_call_binds_one_worktree_inside_the_roots() {
    let h = Harness::new();
    let root = h.base.path().join("root");
    let repo = root.join("repo");
    std::fs::create_dir_all(&repo).expect("mkdir");
    git_in(&repo, &["init", "-q", "-b", "main"]);
    std::fs::write(repo.join("a.txt"), "a\n").expect("write");
    git_in(&repo, &["add", "."]);
    git_in(&repo, &["commit", "-q", "-m", "init"]);
    std::os::unix::fs::symlink(h.outside(), root.join("out")).expect("symlink");
    let ctl = h
        .spawn_at(&["--worktree-root".as_ref(), root.as_os_str()], &[], &[])
        .await;
    let mut c = ctl.client().await;
    let req = |op: &str, path: &Path| WorktreeRequest {
        op: op.into(),
        repository: repo.display().to_string(),
        base: "main".into(),
        branch: "s/one".into(),
        path: path.display().to_string(),
        ..Default::default()
    };

    let err = c.git_status(GitStatusRequest {}).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(
        err.message().contains("no workspace yet"),
        "{}",
        err.message()
    );
    // Health says so, for a backend that would start an agent here.
    assert_eq!(health(&mut c).await.workspace_root.as_deref(), Some(""));
    for (path, says) in [
        (
            root.join("out/wt"),
            "outside this agentctl's worktree roots",
        ),
        (
            h.outside().join("wt"),
            "outside this agentctl's worktree roots",
        ),
        (root.clone(), "outside this agentctl's worktree roots"),
        (root.join("a/../wt"), "is not an absolute, normalised path"),
    ] {
        let err = c.worktree(req("create", &path)).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{path:?}: {err:?}");
        assert!(err.message().contains(says), "{}", err.message());
    }
    assert_eq!(std::fs::read_dir(h.outside()).expect("ls").count(), 1);

    let wt = root.join("wt/one");
    std::fs::create_dir_all(root.join("wt")).expect("mkdir");
    let made = c
        .worktree(req("create", &wt))
        .await
        .expect("create")
        .into_inner();
    let v: serde_json::Value = serde_json::from_str(&made.json).expect("json");
    assert_eq!(v["outcome"], "created", "{v}");
    let st = c
        .git_status(GitStatusRequest {})
        .await
        .expect("status")
        .into_inner();
    assert_eq!(st.branch, "s/one");
    let served = health(&mut c).await.workspace_root.expect("workspace_root");
    assert_eq!(
        Path::new(&served),
        std::fs::canonicalize(&wt).expect("canonical")
    );
    let err = c
        .worktree(req("create", &root.join("wt/two")))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(
        err.message().contains("serves the worktree"),
        "{}",
        err.message()
    );

    c.worktree(req("remove", &wt)).await.expect("remove");
    assert!(!wt.exists());
    let err = c.git_status(GitStatusRequest {}).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert_eq!(health(&mut c).await.workspace_root.as_deref(), Some(""));
}

/// The `initialize` lines of every agent process in `calls.log`: one per
/// agent launched.
fn launches(h: &Harness) -> usize {
    let path = h.base.path().join("state/calls.log");
    std::fs::read_to_string(&path)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("\"initialize\""))
        .count()
}

fn recover_request(h: &Harness, generation: i64, token: &str) -> RecoverRequest {
    RecoverRequest {
        executor_id: "exec-test".into(),
        generation,
        launch: Some(h.demo(true, &[])),
        resume_token: token.into(),
    }
}

/// A conversation with one turn, its agent stopped (as after a crash of
/// the agent or a restart of the host's agent): the state recovery finds.
async fn stopped_conversation(h: &Harness, c: &mut Client) -> String {
    let mut stream = Stream::open(c, 0).await;
    c.launch_agent(h.demo(true, &[])).await.expect("launch");
    let token = c
        .new_session(NewSessionRequest {})
        .await
        .expect("new session")
        .into_inner()
        .resume_token;
    prompt(c, &mut stream, "one").await;
    c.stop_agent(StopAgentRequest { grace_ms: 2000 })
        .await
        .expect("stop");
    token
}

/// Recover with a launch and a token, no agent running: the health and
/// capabilities as the call arrived, the agent launched and the
/// conversation reopened (`session/resume`), all in one call. The same
/// call again (a backend that crashed after sending it) launches nothing
/// and reopens nothing: it answers the first call's result as DUPLICATE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recover_launches_and_resumes_once() {
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    let token = stopped_conversation(&h, &mut c).await;
    assert_eq!(launches(&h), 1);

    let first = c
        .recover(recover_request(&h, 3, &token))
        .await
        .expect("recover")
        .into_inner();
    let arrived = first.health.expect("health");
    assert_eq!(arrived.executor_id, "exec-test");
    assert_eq!(
        arrived.agent_state(),
        AgentState::Exited,
        "as the call arrived"
    );
    assert!(first.capabilities.is_some());
    let agent = first.agent.expect("agent part");
    assert_eq!(agent.outcome(), RecoverOutcome::Done, "{agent:?}");
    let pid = agent.launched.as_ref().expect("launched").agent_pid;
    let resumed = agent.resumed.clone().expect("resumed");
    assert_eq!(resumed.resume_token, token);
    assert_eq!(resumed.method(), ResumeMethod::Resume);
    assert_eq!(
        calls_of(&h, pid),
        vec![
            ("initialize".to_owned(), None),
            ("session/resume".to_owned(), Some(0))
        ]
    );
    let now = health(&mut c).await;
    assert_eq!(now.agent_state(), AgentState::Ready);
    assert_eq!(now.acp_session_id, token);

    let again = c
        .recover(recover_request(&h, 3, &token))
        .await
        .expect("recover again")
        .into_inner();
    let arrived = again.health.expect("health");
    assert_eq!(arrived.agent_state(), AgentState::Ready);
    let dup = again.agent.expect("agent part");
    assert_eq!(dup.outcome(), RecoverOutcome::Duplicate, "{dup:?}");
    assert_eq!(dup.launched.expect("launched").agent_pid, pid);
    assert_eq!(dup.resumed, Some(resumed));
    assert_eq!(launches(&h), 2, "one launch for the two calls");
    assert_eq!(calls_of(&h, pid).len(), 2, "nothing reopened twice");
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

/// Two Recover calls at once (two replicas, or a retry racing the first)
/// run one after the other: one agent, one reopening.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_recovers_start_one_agent() {
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    let token = stopped_conversation(&h, &mut c).await;
    let (mut a, mut b) = (c.clone(), c.clone());
    let (ra, rb) = (
        recover_request(&h, 1, &token),
        recover_request(&h, 1, &token),
    );
    let (x, y) = tokio::join!(a.recover(ra), b.recover(rb));
    let mut outcomes = [x, y].map(|r| {
        r.expect("recover")
            .into_inner()
            .agent
            .expect("agent")
            .outcome()
    });
    outcomes.sort_by_key(|o| *o as i32);
    assert_eq!(outcomes, [RecoverOutcome::Done, RecoverOutcome::Duplicate]);
    assert_eq!(
        launches(&h),
        2,
        "the first conversation's agent and one more"
    );
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

/// A ResumeSession of the conversation a Recover is reopening (a second
/// backend, restarted during the first one's slow load, that saw the agent
/// running) waits for that reopening and answers it: the agent loads the
/// history once. Asked again afterwards, it answers at once, still without
/// the agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_of_the_conversation_being_reopened_does_not_reopen_it_twice() {
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    let token = stopped_conversation(&h, &mut c).await;
    let mut slow = recover_request(&h, 1, &token);
    slow.launch = Some(h.demo(
        true,
        &[
            ("ACP_DEMO_NO_RESUME_SESSION", "1"),
            ("ACP_DEMO_LOAD_MS_PER_MESSAGE", "300"),
        ],
    ));
    let mut recovering = c.clone();
    let first = tokio::spawn(async move { recovering.recover(slow).await });
    let deadline = Instant::now() + WAIT;
    while !health(&mut c).await.resuming {
        assert!(Instant::now() < deadline, "the load never began");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let second = c
        .resume_session(ResumeSessionRequest {
            resume_token: token.clone(),
        })
        .await
        .expect("resume during the load")
        .into_inner();
    let done = first.await.expect("join").expect("recover").into_inner();
    let agent = done.agent.expect("agent part");
    assert_eq!(agent.outcome(), RecoverOutcome::Done, "{agent:?}");
    let pid = agent.launched.expect("launched").agent_pid;
    assert_eq!(
        agent.resumed.as_ref(),
        Some(&second),
        "the load's own answer"
    );
    assert_eq!(second.method(), ResumeMethod::Load);
    let again = c
        .resume_session(ResumeSessionRequest {
            resume_token: token.clone(),
        })
        .await
        .expect("resume once loaded")
        .into_inner();
    assert_eq!(again, second);
    let reopened: Vec<_> = calls_of(&h, pid)
        .into_iter()
        .map(|(method, _)| method)
        .collect();
    assert_eq!(reopened, ["initialize", "session/load"], "one load");
    assert!(
        c.resume_session(ResumeSessionRequest {
            resume_token: "another-conversation".into(),
        })
        .await
        .is_err(),
        "another token is asked of the agent (which knows no such conversation)"
    );
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

/// A Recover that asks for health only answers at once while another
/// Recover launches a slow agent (a backend restarted during its
/// predecessor's launch): it sees the agent STARTING, and the launch goes
/// on to its end. It used to wait behind the launch, past the new
/// backend's deadline, which then ended this live agentctl as hung.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_health_only_recover_does_not_wait_for_a_launch_in_flight() {
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    let token = stopped_conversation(&h, &mut c).await;
    let mut slow = recover_request(&h, 1, &token);
    slow.launch = Some(h.demo(true, &[("ACP_DEMO_STARTUP_MS", "4000")]));
    let mut launching = c.clone();
    let first = tokio::spawn(async move { launching.recover(slow).await });
    let deadline = Instant::now() + WAIT;
    while health(&mut c).await.agent_state() != AgentState::Starting {
        assert!(Instant::now() < deadline, "the slow launch never began");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let quick = c
        .recover(RecoverRequest {
            executor_id: "exec-test".into(),
            generation: 1,
            launch: None,
            resume_token: String::new(),
        })
        .await
        .expect("health-only recover")
        .into_inner();
    assert!(!first.is_finished(), "answered while the launch runs");
    assert_eq!(
        quick.health.expect("health").agent_state(),
        AgentState::Starting
    );
    assert_eq!(
        quick.agent.expect("agent part").outcome(),
        RecoverOutcome::NotAsked
    );
    let done = first.await.expect("join").expect("recover").into_inner();
    assert_eq!(
        done.agent.expect("agent part").outcome(),
        RecoverOutcome::Done
    );
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

/// An agent already running (or starting) is left alone: no launch, no
/// reopening, the outcome SKIPPED; a call without launch is NOT_ASKED and
/// answers health and capabilities only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recover_leaves_a_running_agent_alone() {
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    c.launch_agent(h.demo(true, &[])).await.expect("launch");
    let token = c
        .new_session(NewSessionRequest {})
        .await
        .expect("new session")
        .into_inner()
        .resume_token;
    for asked in [token.as_str(), "another-conversation"] {
        let r = c
            .recover(recover_request(&h, 1, asked))
            .await
            .expect("recover")
            .into_inner();
        assert_eq!(r.health.expect("health").agent_state(), AgentState::Ready);
        assert_eq!(
            r.agent.expect("agent").outcome(),
            RecoverOutcome::Skipped,
            "{asked}"
        );
    }
    let only_health = c
        .recover(RecoverRequest {
            executor_id: "exec-test".into(),
            generation: 1,
            ..Default::default()
        })
        .await
        .expect("recover")
        .into_inner();
    assert_eq!(
        only_health.agent.expect("agent").outcome(),
        RecoverOutcome::NotAsked
    );
    assert_eq!(
        only_health
            .capabilities
            .expect("caps")
            .supports_session_resume(),
        Capability::Supported
    );
    assert_eq!(launches(&h), 1, "no second agent");
    let now = health(&mut c).await;
    assert_eq!(now.acp_session_id, token, "nothing reopened");
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

/// Refused before anything happens: an older lease epoch (another replica
/// owns the executor now), an older generation (the executor was
/// relaunched since), another executor's id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recover_refuses_stale_epochs_generations_and_other_executors() {
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    let token = stopped_conversation(&h, &mut c).await;
    c.health(epoch(HealthRequest {}, 2))
        .await
        .expect("epoch 2 seen");
    let err = c
        .recover(epoch(recover_request(&h, 1, &token), 1))
        .await
        .expect_err("stale epoch");
    assert_stale(&err, 1, 2);

    c.recover(RecoverRequest {
        executor_id: "exec-test".into(),
        generation: 5,
        ..Default::default()
    })
    .await
    .expect("generation 5");
    let err = c
        .recover(recover_request(&h, 4, &token))
        .await
        .expect_err("stale generation");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().starts_with("stale_generation"), "{err:?}");

    let mut other = recover_request(&h, 5, &token);
    other.executor_id = "exec-other".into();
    let err = c.recover(other).await.expect_err("another executor");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().starts_with("wrong_executor") && err.message().contains("exec-other"),
        "{err:?}"
    );
    assert_eq!(launches(&h), 1, "none of them launched an agent");
    assert_eq!(health(&mut c).await.agent_state(), AgentState::Exited);
    ctl.shutdown().await;
    h.assert_no_leftovers().await;
}

/// Peak resident memory of `pid` (`VmHWM`), in KiB.
fn peak_rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

/// An agent that writes a flood of lines that are not ACP messages to its
/// stdout before it speaks ACP (3 million, as `print` debugging in a loop
/// would), then a banner with no line end, to which its first message is
/// glued: agentctl drops the noise unanswered and says so in a few log
/// lines, and takes the message after the banner;
/// its memory stays small (each used to be answered with a parse error
/// that an agent not reading stdin left queued: gigabytes), and the agent
/// then opens its conversation and answers a prompt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_flooding_stdout_with_noise_costs_no_memory_and_still_works() {
    let h = Harness::new();
    let ctl = h.spawn(&[]).await;
    let mut c = ctl.client().await;
    let mut launch = h.demo(true, &[]);
    let demo = std::mem::replace(&mut launch.command, "sh".into());
    let mut args = vec![
        "-c".to_owned(),
        "yes 'Loading, please wait...' | head -n 3000000; printf 'Ready. '; \
         exec \"$0\" \"$@\""
            .to_owned(),
        demo,
    ];
    args.append(&mut launch.args);
    launch.args = args;
    launch.initialize_timeout_ms = 60_000;
    let before = peak_rss_kib(ctl.pid);
    c.launch_agent(launch).await.expect("launch");
    c.new_session(NewSessionRequest {})
        .await
        .expect("new session");
    let mut stream = Stream::open(&mut c, 0).await;
    let (reply, _) = prompt(&mut c, &mut stream, "hello").await;
    assert!(reply.contains("hello"), "{reply}");

    let peak = peak_rss_kib(ctl.pid);
    assert!(
        peak < before + 100 * 1024,
        "agentctl's peak memory grew from {before} KiB to {peak} KiB"
    );
    let log = std::fs::read_to_string(h.base.path().join("agentctl.log")).expect("log");
    let noise: Vec<&str> = log.lines().filter(|l| l.contains("to stdout")).collect();
    assert!(
        (1..=40).contains(&noise.len()),
        "{} log lines about the noise: {:?}",
        noise.len(),
        &noise[..noise.len().min(3)]
    );
    assert!(
        log.contains("Loading, please wait..."),
        "an excerpt is shown"
    );
}
