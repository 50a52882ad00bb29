//! agentctl with a real third-party agent: the Claude Code ACP adapter
//! (`@zed-industries/claude-agent-acp`, the version pinned in
//! `tests/claude/package.json`) under node, which runs the Claude Code CLI,
//! which talks to a fake Anthropic Messages API on loopback
//! (`tests/claude/fake_anthropic.mjs`, see `sessiond_testkit::claude`).
//! Nothing leaves the machine.
//!
//! `#[ignore]`d because a plain test run may lack the adapter; `cargo xtask
//! ci` installs it and runs them (`cargo xtask claude-acp` installs it
//! alone). Run without it, they fail naming it: never a pass by skipping.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use sessiond_proto::agentctl::v1::agent_ctl_service_client::AgentCtlServiceClient;
use sessiond_proto::agentctl::v1::agent_update::Kind;
use sessiond_proto::agentctl::v1::*;
use sessiond_testkit::claude::{self, FakeAnthropic};
use tokio::io::{AsyncBufReadExt, BufReader};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

const SECRET: &str = "claude-test-secret-0123456789";
/// Waits for progress of a real agent on a loaded machine: generous, since a
/// hang is what it catches, not slowness.
const WAIT: Duration = Duration::from_secs(120);

type Client = AgentCtlServiceClient<InterceptedService<Channel, Bearer>>;

#[derive(Clone)]
struct Bearer;

impl Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        req.metadata_mut()
            .insert("authorization", format!("Bearer {SECRET}").parse().unwrap());
        Ok(req)
    }
}

/// One agentctl over `base/ws`, its log in `base/agentctl.log`.
struct Ctl {
    child: tokio::process::Child,
    client: Client,
}

impl Ctl {
    async fn spawn(base: &Path) -> Ctl {
        let log = std::fs::File::create(base.join("agentctl.log")).unwrap();
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_agentctl"))
            .args(["--executor-id", "exec-claude", "--listen", "127.0.0.1:0"])
            .arg("--workspace")
            .arg(base.join("ws"))
            .env("AGENTCTL_SECRET", SECRET)
            .env("AGENTCTL_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let line = tokio::time::timeout(WAIT, lines.next_line())
            .await
            .expect("agentctl printed nothing")
            .unwrap()
            .expect("agentctl closed stdout");
        let addr = line
            .strip_prefix("agentctl listening on ")
            .unwrap()
            .to_owned();
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let client = AgentCtlServiceClient::with_interceptor(channel, Bearer);
        Ctl { child, client }
    }

    async fn shutdown(mut self) {
        let pid = self.child.id().unwrap();
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status();
        let status = tokio::time::timeout(WAIT, self.child.wait())
            .await
            .expect("agentctl did not exit")
            .unwrap();
        assert_eq!(status.code(), Some(0), "agentctl exit status {status:?}");
    }
}

/// The live update stream, read until a turn ends.
struct Stream(tonic::Streaming<AgentUpdate>);

impl Stream {
    async fn next(&mut self) -> AgentUpdate {
        tokio::time::timeout(WAIT, self.0.message())
            .await
            .expect("no update within the wait")
            .expect("stream error")
            .expect("stream ended")
    }

    async fn until(&mut self, done: impl Fn(&AgentUpdate) -> bool) -> Vec<AgentUpdate> {
        let mut seen = Vec::new();
        loop {
            let u = self.next().await;
            let stop = done(&u);
            seen.push(u);
            if stop {
                return seen;
            }
        }
    }
}

/// A turn: its reply text, how it ended, and every update it produced.
struct Turn {
    reply: String,
    end: TurnEnded,
    updates: Vec<AgentUpdate>,
}

async fn prompt(c: &mut Client, stream: &mut Stream, text: &str) -> Turn {
    let resp = c
        .prompt(PromptRequest {
            text: text.into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let updates = stream
        .until(|u| matches!(&u.kind, Some(Kind::TurnEnded(t)) if t.turn_id == resp.turn_id))
        .await;
    let reply = updates
        .iter()
        .filter_map(|u| match &u.kind {
            Some(Kind::MessageChunk(m)) => {
                assert_eq!(m.turn_id, resp.turn_id, "a chunk of another turn: {u:?}");
                Some(m.text.as_str())
            }
            _ => None,
        })
        .collect::<String>();
    let Some(Kind::TurnEnded(end)) = updates.last().unwrap().kind.clone() else {
        unreachable!()
    };
    Turn {
        reply,
        end,
        updates,
    }
}

fn launch_request(fake: &FakeAnthropic, home: &Path) -> LaunchAgentRequest {
    LaunchAgentRequest {
        command: claude::node().display().to_string(),
        args: vec![claude::adapter_entry().display().to_string()],
        env: claude::agent_env(fake, home).into_iter().collect(),
        profile_supports_session_resume: true,
        initialize_timeout_ms: WAIT.as_millis() as u64,
        permission_policy: PermissionPolicy::Allow as i32,
        mcp_servers: vec![mcp_probe(home)],
        ..Default::default()
    }
}

/// A stdio MCP server that records how it was started (its arguments and
/// the value of `PROBE_TOKEN`) in `<home>/mcp-probe.log`, answers
/// `initialize` and lists no tools: proof of what the agent was given.
fn mcp_probe(home: &Path) -> McpServer {
    let script = home.join("mcp-probe.py");
    std::fs::write(
        &script,
        r#"import json, os, sys
with open(os.environ["PROBE_LOG"], "a") as f:
    f.write(json.dumps({"argv": sys.argv[1:], "token": os.environ.get("PROBE_TOKEN")}) + "\n")
for line in sys.stdin:
    msg = json.loads(line)
    if "id" not in msg:
        continue
    method = msg.get("method")
    if method == "initialize":
        result = {"protocolVersion": msg["params"].get("protocolVersion", "2024-11-05"),
                  "capabilities": {"tools": {}}, "serverInfo": {"name": "probe", "version": "1"}}
    elif method == "tools/list":
        result = {"tools": []}
    else:
        result = {}
    sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": result}) + "\n")
    sys.stdout.flush()
"#,
    )
    .unwrap();
    McpServer {
        name: "probe".into(),
        r#type: "stdio".into(),
        command: "python3".into(),
        args: vec![script.display().to_string(), "--from-profile".into()],
        env: [
            (
                "PROBE_LOG".to_owned(),
                home.join("mcp-probe.log").display().to_string(),
            ),
            ("PROBE_TOKEN".to_owned(), "t0ken".to_owned()),
        ]
        .into_iter()
        .collect(),
        ..Default::default()
    }
}

/// Processes of the agent's tree (node, the CLI, the tools' shells): every
/// one has the test's HOME in its environment.
fn agent_tree(home: &Path) -> Vec<u32> {
    claude::processes_mentioning(&home.display().to_string())
}

async fn wait_no_agent_tree(home: &Path) {
    let deadline = Instant::now() + WAIT;
    loop {
        let left = agent_tree(home);
        if left.is_empty() {
            return;
        }
        assert!(Instant::now() < deadline, "agent processes left: {left:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the CLI's transcript of `token` holds `text`.
async fn wait_transcript(home: &Path, token: &str, text: &str) {
    let deadline = Instant::now() + WAIT;
    while !claude::transcript(home, token).contains(text) {
        assert!(
            Instant::now() < deadline,
            "the CLI's transcript of {token} never held {text:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn dirs() -> (tempfile::TempDir, PathBuf) {
    let base = tempfile::Builder::new()
        .prefix("agentctl-claude-")
        .tempdir()
        .unwrap();
    for d in ["ws", "home"] {
        std::fs::create_dir_all(base.path().join(d)).unwrap();
    }
    let home = base.path().join("home");
    (base, home)
}

/// The whole life of one conversation with the real adapter through
/// agentctl: launch (ACP initialize), a new session, a prompt that makes the
/// CLI run its Bash tool (permission policy allow; the file really appears
/// in the workspace), a text turn, StopAgent (the whole tree ends), a new
/// agent process that reopens the conversation from its token, and a third
/// turn whose request to the model carries the two earlier prompts: the CLI
/// really loaded the conversation, it did not start a new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the Claude Code ACP adapter: run by cargo xtask ci (cargo xtask claude-acp installs it)"]
async fn claude_acp_tool_turn_stop_relaunch_resume() {
    // Before anything starts: a missing adapter fails here, naming the fix.
    claude::adapter_entry();
    let (base, home) = dirs();
    let fake = FakeAnthropic::start(base.path());
    let ctl = Ctl::spawn(base.path()).await;
    let mut c = ctl.client.clone();
    let mut stream = Stream(
        c.stream_updates(StreamUpdatesRequest { after_cursor: 0 })
            .await
            .unwrap()
            .into_inner(),
    );

    let started = Instant::now();
    let launched = c
        .launch_agent(launch_request(&fake, &home))
        .await
        .unwrap()
        .into_inner();
    let first_launch = started.elapsed();
    assert_eq!(launched.agent_name, "@zed-industries/claude-agent-acp");
    assert!(launched.agent_load_session, "{launched:?}");
    let first_pid = launched.agent_pid;
    let opened = c
        .new_session(NewSessionRequest {})
        .await
        .unwrap()
        .into_inner();
    let token = opened.resume_token;
    assert!(!token.is_empty());
    // Its config options, the model among them, with their values.
    let options = opened.modes.map(|m| m.config_options).unwrap_or_default();
    let model = options
        .iter()
        .find(|o| o.category == "model")
        .unwrap_or_else(|| panic!("no model option: {options:?}"));
    assert_eq!(
        (model.id.as_str(), model.r#type.as_str()),
        ("model", "select")
    );
    assert!(
        model.values.iter().any(|v| v.value == model.current_value),
        "{model:?}"
    );

    // A tool turn: the fake answers with a Bash tool_use, the CLI asks
    // permission (allowed), runs it in the workspace, sends the result back,
    // and the fake answers with text naming the tool call.
    let t1 = prompt(&mut c, &mut stream, "write notes.txt hello").await;
    assert_eq!(t1.end.stop_reason, "end_turn", "{:?}", t1.end);
    assert_eq!(
        std::fs::read_to_string(base.path().join("ws/notes.txt")).unwrap(),
        "hello"
    );
    let turns = fake.agent_turns();
    assert_eq!(
        turns.len(),
        2,
        "the prompt, then the tool result: {turns:?}"
    );
    assert_eq!(turns[0].prompt.as_deref(), Some("write notes.txt hello"));
    assert_eq!(turns[0].answer["tool_use"], "Bash", "{turns:?}");
    let tool_id = turns[0].answer["id"].as_str().unwrap().to_owned();
    assert!(turns[1].prompt.is_none(), "a tool result: {:?}", turns[1]);
    assert!(
        t1.reply
            .starts_with(&format!("claude-fake: tool {tool_id} done")),
        "{:?}",
        t1.reply
    );
    // agentctl saw the tool call, and its end.
    let tool_call = t1
        .updates
        .iter()
        .filter_map(|u| match &u.kind {
            Some(Kind::Activity(a)) if a.kind == "tool_call" && a.complete => Some(a),
            _ => None,
        })
        .next_back()
        .unwrap_or_else(|| panic!("no completed tool call: {:?}", t1.updates));
    let json: serde_json::Value = serde_json::from_str(&tool_call.json).unwrap();
    assert_eq!(json["toolCallId"], tool_id.as_str(), "{json}");
    assert_eq!(json["status"], "completed", "{json}");
    // What the tool did is kept: the command it ran and what it gave back.
    assert!(
        json["rawInput"]["command"]
            .as_str()
            .is_some_and(|c| c.contains("notes.txt")),
        "{json}"
    );
    assert!(!json["rawOutput"].is_null(), "{json}");

    // The MCP server the launch named was started by the agent with what
    // it was given.
    // The CLI connects its MCP servers beside the session's start.
    let deadline = Instant::now() + WAIT;
    while !home.join("mcp-probe.log").exists() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let probe = std::fs::read_to_string(home.join("mcp-probe.log")).unwrap_or_default();
    let first: serde_json::Value = serde_json::from_str(probe.lines().next().unwrap_or("null"))
        .unwrap_or_else(|e| panic!("mcp-probe.log {probe:?}: {e}"));
    assert_eq!(
        first["argv"],
        serde_json::json!(["--from-profile"]),
        "{probe}"
    );
    assert_eq!(first["token"], "t0ken", "{probe}");

    // Every update of the tool turn parsed: none rejected by the ACP
    // layer (`Invalid params`), none kept raw.
    assert!(
        !t1.updates
            .iter()
            .any(|u| matches!(&u.kind, Some(Kind::Activity(a)) if a.kind == "unparsed")),
        "{:?}",
        t1.updates
    );
    let log = std::fs::read_to_string(base.path().join("agentctl.log")).unwrap();
    assert!(
        !log.contains("Invalid params") && !log.contains("did not parse"),
        "{log}"
    );

    // The turn's usage, as the adapter reports it: the prompt answer's
    // tokens, the context after the turn, its cost.
    let usage = t1.end.usage.clone().expect("the tool turn's usage");
    assert!(
        usage.input_tokens.is_some() && usage.total_tokens.is_some(),
        "{usage:?}"
    );
    assert!(usage.context_size.is_some_and(|s| s > 0), "{usage:?}");
    assert!(
        usage.cost_amount.is_some_and(|a| a > 0.0) && usage.cost_currency == "USD",
        "{usage:?}"
    );

    let t2 = prompt(&mut c, &mut stream, "how are you").await;
    assert_eq!(t2.end.stop_reason, "end_turn");
    assert_eq!(
        t2.reply,
        "claude-fake: you said \"how are you\" (2 user messages)"
    );
    // Its cost is its own, not the adapter's running total.
    let second = t2.end.usage.clone().expect("the text turn's usage");
    assert!(
        second.cost_amount < second.session_cost_amount
            && second.session_cost_amount > usage.session_cost_amount,
        "{usage:?} then {second:?}"
    );

    // The turn is in the CLI's transcript before the stop: the CLI writes
    // it some 50-200 ms after it answered the turn, and a stop (or a crash)
    // before that loses the turn from the conversation `session/load`
    // reopens (or loses the whole conversation after a first turn).
    wait_transcript(&home, &token, "(2 user messages)").await;

    // Stop: the agent and everything it started end (node and the CLI at
    // least, found by the HOME in their environment).
    let tree = agent_tree(&home);
    assert!(
        tree.contains(&first_pid) && tree.len() >= 2,
        "the agent's tree {tree:?} (node {first_pid} and the CLI)"
    );
    c.stop_agent(StopAgentRequest { grace_ms: 5000 })
        .await
        .unwrap();
    stream
        .until(|u| matches!(u.kind, Some(Kind::AgentExited(_))))
        .await;
    wait_no_agent_tree(&home).await;

    // A new agent process reopens the conversation.
    let started = Instant::now();
    let relaunched = c
        .launch_agent(launch_request(&fake, &home))
        .await
        .unwrap()
        .into_inner();
    let relaunch = started.elapsed();
    assert_ne!(relaunched.agent_pid, first_pid);
    let resumed = c
        .resume_session(ResumeSessionRequest {
            resume_token: token.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    let reopen = started.elapsed();
    assert_eq!(resumed.resume_token, token);
    eprintln!(
        "claude-acp: first launch (initialize) {first_launch:?}; relaunch {relaunch:?}, \
         + reopen ({:?}, {} replayed) = {reopen:?}",
        resumed.method(),
        resumed.replayed
    );

    let t3 = prompt(&mut c, &mut stream, "and now").await;
    assert_eq!(t3.end.stop_reason, "end_turn");
    assert_eq!(
        t3.reply,
        "claude-fake: you said \"and now\" (3 user messages)"
    );
    let last = fake.agent_turns().pop().unwrap();
    assert_eq!(
        last.prompts,
        ["write notes.txt hello", "how are you", "and now"],
        "the model saw the whole conversation"
    );

    ctl.shutdown().await;
    wait_no_agent_tree(&home).await;
    drop(fake);
    drop(base);
}
