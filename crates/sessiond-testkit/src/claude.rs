//! The Claude Code ACP adapter (`@zed-industries/claude-agent-acp`, pinned
//! in `tests/claude/package.json`) run offline: where `cargo xtask
//! claude-acp` installed it, the environment that keeps it on loopback, and
//! [`FakeAnthropic`], the fake Messages API (`tests/claude/fake_anthropic.mjs`)
//! it talks to.
//!
//! Nothing here skips: a missing adapter or node is a panic that names the
//! command installing it.

use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::Duration,
};

/// The command that installs the adapter (`cargo xtask ci` runs it too).
pub const INSTALL: &str = "cargo xtask claude-acp";

/// The adapter's entry point, run as `node <entry>`: under
/// `<target>/claude-acp`, the target directory found from the running test
/// binary (`<target>/<profile>/deps/<binary>`).
pub fn adapter_entry() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let target = exe
        .ancestors()
        .find(|p| p.join("claude-acp").is_dir())
        .map(Path::to_path_buf)
        .or_else(|| exe.ancestors().nth(3).map(Path::to_path_buf))
        .expect("the target directory");
    let entry =
        target.join("claude-acp/node_modules/@zed-industries/claude-agent-acp/dist/index.js");
    assert!(
        entry.is_file(),
        "{} not found: the Claude Code ACP adapter is not installed; install it with `{INSTALL}` \
         (`cargo xtask ci` does)",
        entry.display()
    );
    entry
}

/// `node`, as an absolute path (an agent profile's command; agentctl's
/// agents get a plain `PATH`).
pub fn node() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("node"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!("`node` is not on PATH: the claude tests run the adapter under Node 20 or newer")
        })
}

/// The fake Messages API script.
pub fn fake_script() -> PathBuf {
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/claude/fake_anthropic.mjs");
    assert!(script.is_file(), "{} not found", script.display());
    script.canonicalize().expect("canonicalize")
}

/// The adapter's environment: offline against `fake`, with `home` as its
/// HOME (its settings, and the CLI's session files that `session/load`
/// reads back).
pub fn agent_env(fake: &FakeAnthropic, home: &Path) -> Vec<(String, String)> {
    [
        ("HOME", home.display().to_string()),
        ("ANTHROPIC_BASE_URL", fake.base_url()),
        ("ANTHROPIC_API_KEY", "sk-ant-fake-sessiond-test".to_owned()),
        // The CLI refuses to skip permission prompts as root unless told it
        // runs in a sandbox.
        ("IS_SANDBOX", "1".to_owned()),
        ("DISABLE_TELEMETRY", "1".to_owned()),
        ("DISABLE_AUTOUPDATER", "1".to_owned()),
        ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1".to_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

/// The CLI's own transcript of conversation `token` (the JSON lines under
/// `HOME/.claude/projects/` that its `session/load` reads back); empty when
/// there is none yet. The CLI writes a turn there some 50-200 ms after it
/// answered it: a test that stops or kills the agent and then reopens the
/// conversation waits for its turns to be there first.
pub fn transcript(home: &Path, token: &str) -> String {
    fn find(dir: &Path, name: &str) -> Option<PathBuf> {
        for e in std::fs::read_dir(dir).ok()?.flatten() {
            let p = e.path();
            if p.is_dir() {
                if let Some(f) = find(&p, name) {
                    return Some(f);
                }
            } else if p.file_name().is_some_and(|n| n == name) {
                return Some(p);
            }
        }
        None
    }
    find(&home.join(".claude/projects"), &format!("{token}.jsonl"))
        .and_then(|p| std::fs::read_to_string(p).ok())
        .unwrap_or_default()
}

/// The fake Messages API on 127.0.0.1, a child process of the test; killed
/// on drop. Its answers are in `tests/claude/fake_anthropic.mjs`.
#[derive(Debug)]
pub struct FakeAnthropic {
    child: Child,
    port: u16,
    log: PathBuf,
}

/// One request the fake answered (a line of its log).
#[derive(Debug, Clone)]
pub struct Request {
    pub method: String,
    /// With its query (`/v1/messages?beta=true`).
    pub path: String,
    /// Only for `POST /v1/messages`: the tool names it offered (the agent's
    /// own turns offer tools; the CLI's side calls none).
    pub tools: Vec<String>,
    /// The newest prompt of the conversation, when the newest user message
    /// is one (not a tool result).
    pub prompt: Option<String>,
    /// Every user prompt of the conversation, oldest first.
    pub prompts: Vec<String>,
    /// What the fake answered: `{"text": ..}` or `{"tool_use": .., "input": ..}`.
    pub answer: serde_json::Value,
}

impl Request {
    /// A turn of the agent (not a side call of the CLI).
    pub fn is_agent_turn(&self) -> bool {
        self.path.starts_with("/v1/messages")
            && !self.path.contains("count_tokens")
            && !self.tools.is_empty()
    }
}

impl FakeAnthropic {
    /// Starts it with its log in `dir/fake-anthropic.jsonl`; returns once it
    /// listens.
    pub fn start(dir: &Path) -> FakeAnthropic {
        let log = dir.join("fake-anthropic.jsonl");
        let mut child = Command::new(node())
            .arg(fake_script())
            .arg("--log")
            .arg(&log)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the fake Messages API (node)");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the fake Messages API did not say it listens within 60 s");
        let port = line
            .trim()
            .strip_prefix("fake-anthropic listening on ")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("the fake Messages API said {line:?}"));
        FakeAnthropic { child, port, log }
    }

    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Every request so far, in order.
    pub fn requests(&self) -> Vec<Request> {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        text.lines()
            .map(|l| {
                let v: serde_json::Value =
                    serde_json::from_str(l).unwrap_or_else(|e| panic!("fake log line {l:?}: {e}"));
                let strings = |key: &str| {
                    v[key]
                        .as_array()
                        .map(|a| {
                            a.iter()
                                .filter_map(|s| s.as_str().map(str::to_owned))
                                .collect()
                        })
                        .unwrap_or_default()
                };
                Request {
                    method: v["method"].as_str().unwrap_or_default().to_owned(),
                    path: v["path"].as_str().unwrap_or_default().to_owned(),
                    tools: strings("tools"),
                    prompt: v["prompt"].as_str().map(str::to_owned),
                    prompts: strings("prompts"),
                    answer: v["answer"].clone(),
                }
            })
            .collect()
    }

    /// The agent's turns (requests with tools).
    pub fn agent_turns(&self) -> Vec<Request> {
        self.requests()
            .into_iter()
            .filter(Request::is_agent_turn)
            .collect()
    }
}

impl Drop for FakeAnthropic {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Live processes (not zombies) whose command line or environment mentions
/// `marker` (a test's directory: agentctl's `--workspace` or run directory,
/// the agents' HOME), so a test finds the whole agent tree: agentctl, node,
/// the CLI, the tools' shells.
pub fn processes_mentioning(marker: &str) -> Vec<u32> {
    let mut found = Vec::new();
    let me = std::process::id();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == me {
            continue;
        }
        let mentions = |file: &str| {
            std::fs::read(entry.path().join(file))
                .is_ok_and(|b| b.windows(marker.len()).any(|w| w == marker.as_bytes()))
        };
        if (mentions("cmdline") || mentions("environ")) && running(pid) {
            found.push(pid);
        }
    }
    found
}

fn running(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    stat.rsplit_once(") ")
        .and_then(|(_, rest)| rest.chars().next())
        .is_some_and(|s| s != 'Z' && s != 'X')
}
