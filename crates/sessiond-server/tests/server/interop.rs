//! Interop with a second ACP implementation: an agent written on the Python
//! `agent-client-protocol` SDK from PyPI (`tests/interop/python_agent.py`,
//! in the virtualenv `cargo xtask ci` makes under `target/`), driven by the
//! real sessiond and agentctl. Create, a prompt whose tool call asks
//! permission first, kill -9 of sessiond, agentctl and the agent, a restart
//! that really goes through `session/load` in a new agent process, and a
//! prompt that continues the conversation, with permission policies allow,
//! deny and ask (answered through RespondToPermission); the agent's own
//! mode switch; the protocol-version check of its `initialize` answer.
//!
//! `#[ignore]`d because a plain test run may lack the virtualenv; `cargo
//! xtask ci` makes it and runs them (`cargo xtask interop-venv` makes it
//! alone). Run without it, they fail naming it: never a pass by skipping.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use sessiond_proto::sessiond::v1::{self as pb, message::Part, tool_call_content::Content};

use crate::support::*;

/// The virtualenv's interpreter, beside the build's target directory.
fn python() -> PathBuf {
    let target = Path::new(env!("CARGO_BIN_EXE_sessiond"))
        .parent()
        .and_then(Path::parent)
        .unwrap();
    let python = target.join("interop-venv/bin/python3");
    assert!(
        python.is_file(),
        "{} not found: the Python ACP SDK's virtualenv is missing; make it with \
         `cargo xtask interop-venv` (`cargo xtask ci` does)",
        python.display()
    );
    python
}

fn agent_script() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/interop/python_agent.py");
    assert!(script.is_file(), "{} not found", script.display());
    script.canonicalize().unwrap()
}

/// A config with Python-agent profiles: (name, extra agent args, extra TOML
/// lines); the agent's state in `dir/py-state`.
fn config(dir: &Path, profiles: &[(&str, &[&str], &str)]) -> String {
    let (python, script) = (python(), agent_script());
    let state = dir.join("py-state");
    let mut text = String::new();
    for (name, extra_args, extra) in profiles {
        let mut args = vec![
            script.display().to_string(),
            "--state-dir".into(),
            state.display().to_string(),
        ];
        args.extend(extra_args.iter().map(|a| (*a).to_owned()));
        let args = args
            .iter()
            .map(|a| format!("{a:?}"))
            .collect::<Vec<_>>()
            .join(", ");
        text.push_str(&format!(
            "[[agents]]\nname = \"{name}\"\ncommand = \"{}\"\nargs = [{args}]\n{extra}\n",
            python.display()
        ));
    }
    let path = dir.join("sessiond.toml");
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

/// One line of the agent's `calls.log`.
#[derive(Debug, Clone)]
struct Call {
    pid: u32,
    method: String,
    session_id: String,
    replayed: Option<u64>,
}

fn calls(dir: &Path) -> Vec<Call> {
    let text = std::fs::read_to_string(dir.join("py-state/calls.log")).unwrap_or_default();
    text.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            Call {
                pid: u32::try_from(v["pid"].as_u64().unwrap()).unwrap(),
                method: v["method"].as_str().unwrap().to_owned(),
                session_id: v["session_id"].as_str().unwrap_or_default().to_owned(),
                replayed: v["replayed"].as_u64(),
            }
        })
        .collect()
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "))
}

/// kill -9 of sessiond, its agentctls and so the agent (parent-death
/// signal), until `agent` is gone; then sessiond again on the same data
/// and config, once it serves. The killed server stays the caller's: its
/// drop would end the new server's agentctls.
async fn kill_all_and_restart(
    server: &mut Server,
    data: &Path,
    config: &str,
    agent: u32,
) -> Server {
    server.kill();
    for pid in agentctl_pids(data) {
        Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while alive(agent) {
        assert!(Instant::now() < deadline, "agent {agent} still alive");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let server = start(data, &["--config", config]);
    crate::restart::wait_serving(&server).await;
    server
}

async fn list(c: &mut Sessions, task: &str, session: &str) -> Vec<pb::Message> {
    c.list_messages(pb::ListMessagesRequest {
        task_id: task.into(),
        session_id: session.into(),
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner()
    .messages
}

async fn current_mode(c: &mut Sessions, task: &str, session: &str) -> Option<String> {
    c.get_session_status(pb::GetSessionStatusRequest {
        task_id: task.into(),
        session_id: session.into(),
    })
    .await
    .unwrap()
    .into_inner()
    .modes
    .map(|m| m.current_mode_id)
}

/// The session's first `session.agentctl_ready` event (a replay).
async fn first_agentctl_ready(c: &mut Sessions, session: &str) -> pb::AgentctlReady {
    wait_for(c, session, |e| match &e.payload {
        Some(pb::event::Payload::AgentctlReady(r)) => Some(r.clone()),
        _ => None,
    })
    .await
}

/// The tool call part of `m`, which must be one.
fn tool_call(m: &pb::Message) -> &pb::ToolCallPart {
    assert_eq!(m.kind, pb::MessageKind::ToolCall as i32, "{m:?}");
    match &m.part {
        Some(Part::ToolCall(t)) => t,
        other => panic!("no tool call part: {other:?}"),
    }
}

/// Checks a stored tool call of the Python agent: id, kind, final status,
/// its result text, the location in the worktree.
fn assert_tool(m: &pb::Message, id: &str, status: &str, result: &str, work: &Path) {
    let t = tool_call(m);
    assert_eq!(m.role, pb::MessageRole::Agent as i32);
    assert!(m.complete, "{m:?}");
    assert_eq!(m.content, "append to interop.txt");
    assert_eq!(
        (
            t.tool_call_id.as_str(),
            t.tool_kind.as_str(),
            t.status.as_str()
        ),
        (id, "edit", status),
        "{t:?}"
    );
    assert_eq!(
        t.content
            .iter()
            .map(|c| c.content.clone())
            .collect::<Vec<_>>(),
        vec![Some(Content::Text(result.into()))]
    );
    assert_eq!(
        t.locations,
        vec![pb::ToolCallLocation {
            path: work.join("interop.txt").display().to_string(),
            line: None
        }]
    );
}

fn assert_text(m: &pb::Message, role: pb::MessageRole, content: &str) {
    assert_eq!(
        (m.role, m.kind, m.content.as_str(), m.complete),
        (role as i32, pb::MessageKind::Text as i32, content, true),
        "{m:?}"
    );
}

#[tokio::test]
#[ignore = "needs the Python ACP SDK's virtualenv: run by cargo xtask ci"]
async fn python_sdk_agent_tool_call_permission_kill_9_and_session_load() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let work = dir.path().join("work").canonicalize_or_create();
    let config = config(
        dir.path(),
        &[
            ("py", &[], ""),
            ("pydeny", &[], "permission_policy = \"deny\""),
        ],
    );
    let mut server = start(&data, &["--config", &config]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "interop").await;

    let s = create_session(&mut c, &task.id, &work, "py").await;
    assert_eq!(s.state, pb::SessionState::WaitingForInput as i32, "{s:?}");
    let new = calls(dir.path());
    let first = new
        .iter()
        .find(|c| c.method == "session/new")
        .expect("the agent got session/new")
        .clone();
    assert_eq!(first.session_id, s.resume_token, "the ACP session id");
    // agentctl was ready before the agent was probed: its event does not
    // claim resume support yet.
    let ready = first_agentctl_ready(&mut c, &s.id).await;
    assert_eq!(ready.supports_session_resume, None, "{ready:?}");

    // A turn whose tool call asks permission first; policy allow: the tool
    // runs (its side effect is in the worktree) and says so.
    let reply = prompt(&mut c, &task.id, &s.id, "hello").await;
    assert_eq!(reply, "turn 1: you said \"hello\" (tool: allowed)");
    assert_eq!(
        std::fs::read_to_string(work.join("interop.txt")).unwrap(),
        "hello\n"
    );
    // The agent switches its own mode: the session's status says so.
    let reply = prompt(&mut c, &task.id, &s.id, "/mode plan").await;
    assert!(reply.ends_with("(mode: plan) [plan mode]"), "{reply}");
    assert_eq!(
        current_mode(&mut c, &task.id, &s.id).await.as_deref(),
        Some("plan")
    );
    let before = list(&mut c, &task.id, &s.id).await;
    assert_eq!(before.len(), 6, "{before:#?}");
    assert_text(&before[0], pb::MessageRole::User, "hello");
    assert_tool(
        &before[1],
        "py-tool-1",
        "completed",
        "appended 1 line",
        &work,
    );
    assert_text(
        &before[2],
        pb::MessageRole::Agent,
        "turn 1: you said \"hello\" (tool: allowed)",
    );
    assert_text(&before[3], pb::MessageRole::User, "/mode plan");
    assert_eq!(
        before[4].part,
        Some(Part::CurrentMode(pb::CurrentModePart {
            mode_id: "plan".into()
        }))
    );

    // kill -9 of sessiond, its agentctls and so the agent (parent-death
    // signal): only `session/load` in a new agent process can go on.
    let server = kill_all_and_restart(&mut server, &data, &config, first.pid).await;
    let mut c = sessions(&server).await;
    let now = get(&mut c, &task.id, &s.id).await;
    assert_eq!(
        now.state,
        pb::SessionState::WaitingForInput as i32,
        "{now:?}"
    );
    assert_eq!(now.resume_token, s.resume_token, "the same conversation");
    let load = calls(dir.path())
        .into_iter()
        .find(|c| c.method == "session/load" && c.session_id == s.resume_token)
        .expect("the agent got session/load");
    assert_ne!(load.pid, first.pid, "a new agent process loaded it");
    // Its whole history: two prompts, the tool call, two replies.
    assert_eq!(load.replayed, Some(5), "{load:?}");
    // The mode the agent chose survives with it (its load answer).
    assert_eq!(
        current_mode(&mut c, &task.id, &s.id).await.as_deref(),
        Some("plan")
    );
    // The replayed history is not stored again.
    assert_eq!(list(&mut c, &task.id, &s.id).await, before);

    // The conversation goes on: the agent counts the loaded turns.
    let reply = prompt(&mut c, &task.id, &s.id, "again").await;
    assert_eq!(
        reply,
        "turn 3: you said \"again\" (tool: allowed) [plan mode]"
    );
    assert_eq!(
        std::fs::read_to_string(work.join("interop.txt")).unwrap(),
        "hello\nagain\n"
    );
    let after = list(&mut c, &task.id, &s.id).await;
    assert_eq!(after.len(), 9, "{after:#?}");
    assert_eq!(after[..6], before[..]);
    assert_text(&after[6], pb::MessageRole::User, "again");
    assert_tool(
        &after[7],
        "py-tool-3",
        "completed",
        "appended 1 line",
        &work,
    );
    assert_text(
        &after[8],
        pb::MessageRole::Agent,
        "turn 3: you said \"again\" (tool: allowed) [plan mode]",
    );

    // Policy deny: agentctl picks the agent's reject option; no side effect.
    let denied_work = dir.path().join("denied").canonicalize_or_create();
    let d = create_session(&mut c, &task.id, &denied_work, "pydeny").await;
    let reply = prompt(&mut c, &task.id, &d.id, "nope").await;
    assert_eq!(reply, "turn 1: you said \"nope\" (tool: rejected)");
    assert!(!denied_work.join("interop.txt").exists());
    let msgs = list(&mut c, &task.id, &d.id).await;
    assert_eq!(msgs.len(), 3, "{msgs:#?}");
    assert_tool(
        &msgs[1],
        "py-tool-1",
        "failed",
        "permission rejected",
        &denied_work,
    );
}

/// The SDK's check of the agent's `initialize` answer is agentctl's own
/// error, not "the agent answered -32600".
#[tokio::test]
#[ignore = "needs the Python ACP SDK's virtualenv: run by cargo xtask ci"]
async fn an_agent_of_another_protocol_version_is_agentctls_error() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work").canonicalize_or_create();
    let config = config(dir.path(), &[("pyv2", &["--protocol-version", "2"], "")]);
    let server = start(&dir.path().join("data"), &["--config", &config]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "version").await;
    let s = create_session(&mut c, &task.id, &work, "pyv2").await;
    assert_eq!(s.state, pb::SessionState::Error as i32, "{s:?}");
    for needle in [
        "agentctl speaks ACP protocol version 1",
        "negotiated 2",
        "use a version of the agent that speaks ACP v1",
    ] {
        assert!(
            s.error_message.contains(needle),
            "{needle}: {}",
            s.error_message
        );
    }
    for wrong in ["-32600", "agent answered", "check the profile's command"] {
        assert!(
            !s.error_message.contains(wrong),
            "{wrong}: {}",
            s.error_message
        );
    }
    assert!(
        calls(dir.path()).iter().any(|c| c.method == "initialize"),
        "the agent was asked"
    );
}

/// The `permission.requested` of turn `turn` (its user message id).
async fn permission_requested(
    c: &mut Sessions,
    session: &str,
    turn: &str,
) -> pb::PermissionRequest {
    wait_for(c, session, |e| match &e.payload {
        Some(pb::event::Payload::PermissionRequested(pb::PermissionRequested {
            request: Some(r),
        })) if r.turn_id == turn => Some(r.clone()),
        _ => None,
    })
    .await
}

/// Sends `text` to a session of policy `ask`, answers the agent's
/// permission request with `option` through RespondToPermission once it is
/// asked, and returns the reply.
async fn prompt_and_answer(
    c: &mut Sessions,
    task: &str,
    session: &str,
    text: &str,
    option: &str,
) -> (pb::PermissionRequest, String) {
    let sent = send(c, task, session, text).await;
    let asked = permission_requested(c, session, &sent.id).await;
    c.respond_to_permission(pb::RespondToPermissionRequest {
        task_id: task.into(),
        session_id: session.into(),
        request_id: asked.request_id.clone(),
        option_id: option.into(),
        content_json: String::new(),
    })
    .await
    .unwrap();
    // The turn ends; the reply is the agent text after the user message.
    let end = turn_end(c, session, &sent.id).await;
    assert_eq!(end.stop_reason, "end_turn", "{end:?}");
    let reply = list(c, task, session)
        .await
        .into_iter()
        .rfind(|m| {
            m.role == pb::MessageRole::Agent as i32 && m.kind == pb::MessageKind::Text as i32
        })
        .expect("a reply");
    assert!(reply.seq > sent.seq, "{reply:?}");
    (asked, reply.content)
}

/// Policy `ask` with the Python agent: its `session/request_permission`
/// reaches the API as `permission.requested` (its tool call, its options)
/// and the option chosen through RespondToPermission is what the agent
/// gets: allowed before a kill -9 of everything, rejected after the
/// restart and `session/load`.
#[tokio::test]
#[ignore = "needs the Python ACP SDK's virtualenv: run by cargo xtask ci"]
async fn python_sdk_agent_permission_answered_through_respond_to_permission() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let work = dir.path().join("work").canonicalize_or_create();
    let config = config(dir.path(), &[("pyask", &[], "permission_policy = \"ask\"")]);
    let mut server = start(&data, &["--config", &config]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "interop ask").await;
    let s = create_session(&mut c, &task.id, &work, "pyask").await;
    assert_eq!(s.state, pb::SessionState::WaitingForInput as i32, "{s:?}");

    let (asked, reply) = prompt_and_answer(&mut c, &task.id, &s.id, "asked", "allow").await;
    let tool = asked.tool_call.as_ref().expect("the tool call asked about");
    assert_eq!(
        (tool.tool_call_id.as_str(), tool.title.as_str()),
        ("py-tool-1", "append to interop.txt"),
        "{asked:?}"
    );
    let options: Vec<_> = asked
        .options
        .iter()
        .map(|o| (o.option_id.as_str(), o.name.as_str(), o.kind.as_str()))
        .collect();
    assert_eq!(
        options,
        [
            ("allow", "Allow", "allow_once"),
            ("reject", "Reject", "reject_once")
        ]
    );
    assert_eq!(reply, "turn 1: you said \"asked\" (tool: allowed)");
    assert_eq!(
        std::fs::read_to_string(work.join("interop.txt")).unwrap(),
        "asked\n"
    );
    let first = calls(dir.path())
        .into_iter()
        .find(|c| c.method == "session/new")
        .unwrap();

    let server = kill_all_and_restart(&mut server, &data, &config, first.pid).await;
    let mut c = sessions(&server).await;

    let (_, reply) = prompt_and_answer(&mut c, &task.id, &s.id, "again", "reject").await;
    assert_eq!(reply, "turn 2: you said \"again\" (tool: rejected)");
    assert_eq!(
        std::fs::read_to_string(work.join("interop.txt")).unwrap(),
        "asked\n"
    );
    assert!(
        calls(dir.path())
            .iter()
            .any(|c| c.method == "session/load" && c.pid != first.pid),
        "loaded by a new agent process"
    );
    // Both requests are in the conversation with the option given.
    let answered: Vec<_> = list(&mut c, &task.id, &s.id)
        .await
        .into_iter()
        .filter_map(|m| match m.part {
            Some(Part::Permission(p)) => Some((p.status, p.option_id)),
            _ => None,
        })
        .collect();
    assert_eq!(
        answered,
        [
            ("selected".to_owned(), "allow".to_owned()),
            ("selected".to_owned(), "reject".to_owned())
        ]
    );
}

trait CanonicalizeOrCreate {
    fn canonicalize_or_create(self) -> PathBuf;
}

impl CanonicalizeOrCreate for PathBuf {
    /// Creates the directory and returns its canonical path (agentctl
    /// reports paths canonical).
    fn canonicalize_or_create(self) -> PathBuf {
        std::fs::create_dir_all(&self).unwrap();
        self.canonicalize().unwrap()
    }
}

/// An agent that offers ACP `session/resume` but not `session/load` (the
/// Python SDK agent with `--resume-only`) is resumable: after `kill -9` of
/// sessiond, agentctl and the agent, the restarted backend brings the
/// session back by itself through `session/resume` in a new agent process,
/// with nothing replayed, and the conversation goes on.
#[tokio::test]
#[ignore = "needs the Python ACP SDK's virtualenv: run by cargo xtask ci"]
async fn python_sdk_agent_offering_only_session_resume_recovers_after_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let work = dir.path().join("work").canonicalize_or_create();
    let config = config(dir.path(), &[("pyresume", &["--resume-only"], "")]);
    let mut server = start(&data, &["--config", &config]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "resume-only").await;
    let s = create_session(&mut c, &task.id, &work, "pyresume").await;
    assert_eq!(s.state, pb::SessionState::WaitingForInput as i32, "{s:?}");
    let first = calls(dir.path())
        .into_iter()
        .find(|c| c.method == "session/new")
        .expect("the agent got session/new");
    let reply = prompt(&mut c, &task.id, &s.id, "hello").await;
    assert_eq!(reply, "turn 1: you said \"hello\" (tool: allowed)");
    let before = list(&mut c, &task.id, &s.id).await;

    let server = kill_all_and_restart(&mut server, &data, &config, first.pid).await;
    let mut c = sessions(&server).await;
    let now = get(&mut c, &task.id, &s.id).await;
    assert_eq!(
        now.state,
        pb::SessionState::WaitingForInput as i32,
        "{now:?}"
    );
    let log = calls(dir.path());
    assert!(
        !log.iter().any(|c| c.method == "session/load"),
        "never loaded: {log:?}"
    );
    let resumed = log
        .iter()
        .find(|c| c.method == "session/resume" && c.session_id == s.resume_token)
        .unwrap_or_else(|| panic!("the agent got session/resume: {log:?}"));
    assert_ne!(resumed.pid, first.pid, "a new agent process resumed it");
    assert!(resumed.replayed.unwrap_or(0) == 0, "{resumed:?}");
    assert_eq!(
        list(&mut c, &task.id, &s.id).await,
        before,
        "nothing stored twice"
    );
    let reply = prompt(&mut c, &task.id, &s.id, "again").await;
    assert_eq!(reply, "turn 2: you said \"again\" (tool: allowed)");
}

/// The terminal parts stored for a session, by terminal id.
async fn terminals(c: &mut Sessions, task: &str, session: &str) -> Vec<pb::TerminalPart> {
    list(c, task, session)
        .await
        .into_iter()
        .filter_map(|m| match m.part {
            Some(Part::Terminal(t)) => {
                assert_eq!(m.kind, pb::MessageKind::Terminal as i32, "{}", m.id);
                Some(t)
            }
            _ => None,
        })
        .collect()
}

/// Reads a pid a terminal's command wrote to `path`, once it is there.
async fn pid_file(path: &Path) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(pid) = std::fs::read_to_string(path)
            .ok()
            .and_then(|t| t.trim().parse().ok())
        {
            return pid;
        }
        assert!(
            Instant::now() < deadline,
            "{} never written",
            path.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn assert_dead(pids: &[u32]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while pids.iter().any(|&p| alive(p)) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let left: Vec<u32> = pids.iter().copied().filter(|&p| alive(p)).collect();
    assert!(left.is_empty(), "still running: {left:?}");
}

/// The `(NOTE)` of a Python agent reply: what the client answered.
fn note(reply: &str) -> &str {
    let start = reply.find("\" (").map_or(0, |i| i + 3);
    reply[start..].strip_suffix(')').unwrap_or(&reply[start..])
}

/// ACP terminals with the Python agent: agentctl runs the agent's
/// `terminal/*` calls (create, output, wait_for_exit, kill, release) in
/// the worktree, bounded by the agent's output limit; each terminal is a
/// stored part its tool call names; a terminal keeps running across kill -9
/// of sessiond (it belongs to agentctl); kill ends what it started,
/// `setsid` included; and after kill -9 of agentctl, stopping the session
/// ends a terminal still running and its detached child.
#[tokio::test]
#[ignore = "needs the Python ACP SDK's virtualenv: run by cargo xtask ci"]
async fn python_sdk_agent_terminals_run_in_the_worktree_and_end_with_the_session() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let work = dir.path().join("work").canonicalize_or_create();
    let config = config(
        dir.path(),
        &[("pyterm", &["--terminal-output-limit", "4096"], "")],
    );
    let mut server = start(&data, &["--config", &config]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "terminals").await;
    let s = create_session(&mut c, &task.id, &work, "pyterm").await;
    assert_eq!(s.state, pb::SessionState::WaitingForInput as i32, "{s:?}");

    // Run to the end: both streams, the exit code, the worktree as cwd.
    let reply = prompt(
        &mut c,
        &task.id,
        &s.id,
        "/terminal echo out; echo err >&2; pwd; exit 3",
    )
    .await;
    let n = note(&reply);
    assert!(n.starts_with("exit 3: "), "{reply}");
    for want in ["out", "err", &work.display().to_string()] {
        assert!(n.contains(want), "{want} in {reply}");
    }
    let parts = terminals(&mut c, &task.id, &s.id).await;
    assert_eq!(parts.len(), 1, "{parts:#?}");
    let first = &parts[0];
    assert_eq!(
        (
            first.command.as_str(),
            first.exit_code,
            first.exited,
            first.released
        ),
        ("sh", Some(3), true, true),
        "{first:?}"
    );
    assert_eq!(first.cwd, work.display().to_string());
    assert!(
        first.output.contains("out") && first.output.contains("err"),
        "{first:?}"
    );
    // Its tool call names it, so a viewer can show the output with it.
    let msgs = list(&mut c, &task.id, &s.id).await;
    let call = msgs
        .iter()
        .find(|m| m.kind == pb::MessageKind::ToolCall as i32)
        .map(tool_call)
        .expect("the terminal's tool call");
    assert_eq!(
        call.content
            .iter()
            .map(|c| c.content.clone())
            .collect::<Vec<_>>(),
        vec![Some(Content::TerminalId(first.terminal_id.clone()))]
    );

    // The agent's output limit: the oldest output goes first.
    let reply = prompt(&mut c, &task.id, &s.id, "/terminal seq 1 3000").await;
    let out = note(&reply).strip_prefix("exit 0: ").expect(&reply);
    assert!(out.len() <= 4096, "{} bytes kept", out.len());
    assert!(out.trim_end().ends_with("\n3000"), "{out}");
    assert!(!out.starts_with("1\n2\n"), "the beginning was dropped");

    // A terminal of another conversation is nobody's: refused (helper-39 3).
    let reply = prompt(&mut c, &task.id, &s.id, "/terminal-foreign sleep 1000").await;
    assert!(
        note(&reply).contains("is not this agent's conversation"),
        "{reply}"
    );

    // A terminal left running, with a child that left its session.
    let reply = prompt(
        &mut c,
        &task.id,
        &s.id,
        "/terminal-start setsid sleep 1000 </dev/null >/dev/null 2>&1 & echo $! > bg.pid; echo $$ > fg.pid; echo started; exec sleep 1001",
    )
    .await;
    assert!(note(&reply).starts_with("terminal started "), "{reply}");
    let (fg, bg) = (
        pid_file(&work.join("fg.pid")).await,
        pid_file(&work.join("bg.pid")).await,
    );
    assert!(alive(fg) && alive(bg));

    // kill -9 of sessiond: the terminal is agentctl's, it runs on, and the
    // restarted sessiond reaches it through the same agent.
    server.kill();
    let server = start(&data, &["--config", &config]);
    crate::restart::wait_serving(&server).await;
    let mut c = sessions(&server).await;
    assert!(alive(fg) && alive(bg), "the terminal outlives sessiond");
    let reply = prompt(&mut c, &task.id, &s.id, "/terminal-output").await;
    assert_eq!(note(&reply), "running: started\n", "{reply}");

    // kill ends everything it started; the exit is then known.
    let reply = prompt(&mut c, &task.id, &s.id, "/terminal-kill").await;
    assert_eq!(note(&reply), "killed", "{reply}");
    assert_dead(&[fg, bg]).await;
    let reply = prompt(&mut c, &task.id, &s.id, "/terminal-wait").await;
    assert_eq!(note(&reply), "signal SIGKILL", "{reply}");
    let reply = prompt(&mut c, &task.id, &s.id, "/terminal-release").await;
    assert_eq!(note(&reply), "released", "{reply}");
    let reply = prompt(&mut c, &task.id, &s.id, "/terminal-output").await;
    assert!(note(&reply).starts_with("error: "), "{reply}");
    let parts = terminals(&mut c, &task.id, &s.id).await;
    let killed = parts.last().unwrap();
    assert_eq!(
        (killed.exited, killed.signal.as_str(), killed.released),
        (true, "SIGKILL", true),
        "{killed:?}"
    );
    assert!(killed.output.starts_with("started"), "{killed:?}");

    // Cancelling the turn kills what its terminal runs: the agent's wait
    // ends with the signal.
    let sent = c
        .send_message(pb::SendMessageRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
            content: "/terminal echo $$ > cancel.pid; exec sleep 1002".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .message
        .unwrap();
    let running = pid_file(&work.join("cancel.pid")).await;
    c.cancel_turn(pb::CancelTurnRequest {
        task_id: task.id.clone(),
        session_id: s.id.clone(),
    })
    .await
    .unwrap();
    assert_dead(&[running]).await;
    turn_end(&mut c, &s.id, &sent.id).await;

    // A terminal still running when agentctl is killed -9: stopping the
    // session ends it and its detached child with the agent.
    std::fs::remove_file(work.join("fg.pid")).unwrap();
    std::fs::remove_file(work.join("bg.pid")).unwrap();
    let reply = prompt(
        &mut c,
        &task.id,
        &s.id,
        "/terminal-start setsid sleep 1000 </dev/null >/dev/null 2>&1 & echo $! > bg.pid; echo $$ > fg.pid; exec sleep 1001",
    )
    .await;
    assert!(note(&reply).starts_with("terminal started "), "{reply}");
    let (fg, bg) = (
        pid_file(&work.join("fg.pid")).await,
        pid_file(&work.join("bg.pid")).await,
    );
    let agent = calls(dir.path())
        .iter()
        .rfind(|c| c.method == "session/prompt")
        .unwrap()
        .pid;
    for pid in agentctl_pids(&data) {
        Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .unwrap();
    }
    c.stop_session(pb::StopSessionRequest {
        task_id: task.id.clone(),
        session_id: s.id.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    assert_dead(&[fg, bg, agent]).await;
}

/// Stop and delete tell an agent that offers ACP `session/close` (the
/// Python SDK agent with `--close`) to close the session before its process
/// ends: its log has the close, for the session's own conversation, from
/// the process that ran it, and that process is gone afterwards. An agent
/// that does not offer it is not sent one.
#[tokio::test]
#[ignore = "needs the Python ACP SDK's virtualenv: run by cargo xtask ci"]
async fn python_sdk_agent_gets_session_close_on_stop_and_delete() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let work = dir.path().join("work").canonicalize_or_create();
    let config = config(
        dir.path(),
        &[("pyclose", &["--close"], ""), ("pyplain", &[], "")],
    );
    let server = start(&data, &["--config", &config]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "close").await;
    let new_of = |token: &str| {
        calls(dir.path())
            .into_iter()
            .find(|c| c.method == "session/new" && c.session_id == token)
            .expect("the agent got session/new")
    };
    let closes = |token: &str| {
        calls(dir.path())
            .into_iter()
            .filter(|c| c.method == "session/close" && c.session_id == token)
            .collect::<Vec<_>>()
    };
    let wait_dead = |pid: u32| async move {
        let deadline = Instant::now() + Duration::from_secs(30);
        while alive(pid) {
            assert!(Instant::now() < deadline, "agent {pid} still alive");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };

    // Stop.
    let stopped = create_session(&mut c, &task.id, &work, "pyclose").await;
    let reply = prompt(&mut c, &task.id, &stopped.id, "hello").await;
    assert_eq!(reply, "turn 1: you said \"hello\" (tool: allowed)");
    let agent = new_of(&stopped.resume_token);
    c.stop_session(pb::StopSessionRequest {
        task_id: task.id.clone(),
        session_id: stopped.id.clone(),
        outcome: 0,
    })
    .await
    .unwrap();
    let closed = closes(&stopped.resume_token);
    assert_eq!(closed.len(), 1, "{:?}", calls(dir.path()));
    assert_eq!(
        closed[0].pid, agent.pid,
        "closed by the process that ran it"
    );
    wait_dead(agent.pid).await;

    // Delete.
    let deleted = create_session(&mut c, &task.id, &work, "pyclose").await;
    let agent = new_of(&deleted.resume_token);
    c.delete_session(pb::DeleteSessionRequest {
        task_id: task.id.clone(),
        session_id: deleted.id.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    let closed = closes(&deleted.resume_token);
    assert_eq!(closed.len(), 1, "{:?}", calls(dir.path()));
    assert_eq!(closed[0].pid, agent.pid);
    wait_dead(agent.pid).await;

    // Not offered: not sent.
    let plain = create_session(&mut c, &task.id, &work, "pyplain").await;
    let agent = new_of(&plain.resume_token);
    c.stop_session(pb::StopSessionRequest {
        task_id: task.id.clone(),
        session_id: plain.id.clone(),
        outcome: 0,
    })
    .await
    .unwrap();
    wait_dead(agent.pid).await;
    assert!(closes(&plain.resume_token).is_empty());
}

/// `(id, current value, values)` of each config option GetSessionStatus
/// lists.
async fn config_of(
    c: &mut Sessions,
    task: &str,
    session: &str,
) -> Vec<(String, String, Vec<String>)> {
    c.get_session_status(pb::GetSessionStatusRequest {
        task_id: task.into(),
        session_id: session.into(),
    })
    .await
    .unwrap()
    .into_inner()
    .config_options
    .into_iter()
    .map(|o| {
        (
            o.id,
            o.current_value,
            o.values.into_iter().map(|v| v.value).collect(),
        )
    })
    .collect()
}

fn owned(rows: &[(&str, &str, &[&str])]) -> Vec<(String, String, Vec<String>)> {
    rows.iter()
        .map(|(id, current, values)| {
            (
                (*id).to_owned(),
                (*current).to_owned(),
                values.iter().map(|v| (*v).to_owned()).collect(),
            )
        })
        .collect()
}

/// Config options (the Python SDK agent with `--config`: `model` and
/// `effort`): GetSessionStatus lists them with their values from the
/// session/new answer; SetSessionConfigOption sets one (the agent gets
/// `session/set_config_option`) and refuses an option or a value the agent
/// does not offer, naming what it offers; a change the agent makes itself
/// (`config_option_update`) shows; and after kill -9 of everything the
/// conversation reloaded in a new agent process keeps them.
#[tokio::test]
#[ignore = "needs the Python ACP SDK's virtualenv: run by cargo xtask ci"]
async fn python_sdk_agent_config_options_listed_set_and_kept_across_recovery() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let work = dir.path().join("work").canonicalize_or_create();
    let config = config(dir.path(), &[("pyconfig", &["--config"], "")]);
    let mut server = start(&data, &["--config", &config]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "config").await;
    let s = create_session(&mut c, &task.id, &work, "pyconfig").await;
    let models: &[&str] = &["small", "large"];
    let efforts: &[&str] = &["low", "high"];
    assert_eq!(
        config_of(&mut c, &task.id, &s.id).await,
        owned(&[("model", "small", models), ("effort", "low", efforts)])
    );

    let set = |config_id: &str, value: &str| pb::SetSessionConfigOptionRequest {
        task_id: task.id.clone(),
        session_id: s.id.clone(),
        config_id: config_id.into(),
        value: value.into(),
    };
    let answer = c
        .set_session_config_option(set("model", "large"))
        .await
        .unwrap()
        .into_inner();
    let model = answer
        .config_options
        .iter()
        .find(|o| o.id == "model")
        .unwrap();
    assert_eq!(
        (
            model.current_value.as_str(),
            model.category.as_str(),
            model.r#type.as_str()
        ),
        ("large", "model", "select")
    );
    assert!(
        calls(dir.path())
            .iter()
            .any(|c| c.method == "session/set_config_option"),
        "the agent was asked"
    );
    let err = c
        .set_session_config_option(set("model", "huge"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("it offers small, large"), "{err:?}");
    let err = c
        .set_session_config_option(set("colour", "red"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().contains("its options are model, effort"),
        "{err:?}"
    );
    let reply = prompt(&mut c, &task.id, &s.id, "hello").await;
    assert_eq!(
        reply,
        "turn 1: you said \"hello\" (tool: allowed) [model: large]"
    );
    // The agent changes one itself.
    let reply = prompt(&mut c, &task.id, &s.id, "/config effort high").await;
    assert!(reply.contains("(config: effort=high)"), "{reply}");
    let expected = owned(&[("model", "large", models), ("effort", "high", efforts)]);
    assert_eq!(config_of(&mut c, &task.id, &s.id).await, expected);

    // kill -9 of everything: recovery reloads the conversation in a new
    // agent process, which answers the values it kept.
    let first = calls(dir.path())
        .into_iter()
        .find(|c| c.method == "session/new")
        .unwrap();
    let server = kill_all_and_restart(&mut server, &data, &config, first.pid).await;
    let mut c = sessions(&server).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let now = get(&mut c, &task.id, &s.id).await;
        if now.state == pb::SessionState::WaitingForInput as i32
            && calls(dir.path())
                .iter()
                .any(|c| c.method == "session/load" && c.pid != first.pid)
        {
            break;
        }
        assert!(Instant::now() < deadline, "never reloaded: {now:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(config_of(&mut c, &task.id, &s.id).await, expected);
}

/// A profile's `config` defaults are set when a session starts (the agent
/// gets `session/set_config_option` right after `session/new`); a value the
/// agent does not offer fails the create, naming the values it offers.
#[tokio::test]
#[ignore = "needs the Python ACP SDK's virtualenv: run by cargo xtask ci"]
async fn python_sdk_agent_profile_config_defaults_apply_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let work = dir.path().join("work").canonicalize_or_create();
    let config = config(
        dir.path(),
        &[
            (
                "pylarge",
                &["--config"],
                "config = { model = \"large\", effort = \"high\" }",
            ),
            ("pyhuge", &["--config"], "config = { model = \"huge\" }"),
        ],
    );
    let server = start(&data, &["--config", &config]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "defaults").await;
    let s = create_session(&mut c, &task.id, &work, "pylarge").await;
    assert_eq!(s.state, pb::SessionState::WaitingForInput as i32, "{s:?}");
    let models: &[&str] = &["small", "large"];
    let efforts: &[&str] = &["low", "high"];
    assert_eq!(
        config_of(&mut c, &task.id, &s.id).await,
        owned(&[("model", "large", models), ("effort", "high", efforts)])
    );
    let sets = calls(dir.path())
        .into_iter()
        .filter(|c| c.method == "session/set_config_option" && c.session_id == s.resume_token)
        .count();
    assert_eq!(sets, 2);

    // The create answers the session in ERROR with the reason, as for any
    // agent that cannot start a conversation.
    let bad = create_session(&mut c, &task.id, &work, "pyhuge").await;
    assert_eq!(bad.state, pb::SessionState::Error as i32, "{bad:?}");
    let message = bad.error_message;
    assert!(
        message.contains("model = huge") && message.contains("it offers small, large"),
        "{message}"
    );
}

/// Every byte under `dir` (the database and its WAL included).
fn all_bytes(dir: &Path) -> Vec<u8> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(all_bytes(&path));
        } else if let Ok(bytes) = std::fs::read(&path) {
            out.extend(bytes);
        }
    }
    out
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}

/// A profile's MCP servers reach the agent on session/new and, after kill
/// -9 of everything, on the session/load that reopens the conversation,
/// their secrets read from sessiond's environment and from a file; the
/// secrets are in neither the database nor the API nor sessiond's log. An
/// http server given to an agent whose `mcpCapabilities` lack http fails
/// the create, naming it.
#[tokio::test]
#[ignore = "needs the Python ACP SDK's virtualenv: run by cargo xtask ci"]
async fn python_sdk_agent_gets_the_profiles_mcp_servers_with_their_secrets() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let work = dir.path().join("work").canonicalize_or_create();
    let token = "tok-3f9a1c-secret";
    let header = "Bearer hdr-77b2e0-secret";
    let header_file = dir.path().join("docs-header");
    std::fs::write(&header_file, format!("{header}\n")).unwrap();
    let servers = format!(
        "[[agents.mcp_servers]]\nname = \"tools\"\ncommand = \"mcp-tools\"\nargs = [\"--ro\"]\n\
         env = {{ MODE = \"ro\", TOKEN = {{ env = \"SESSIOND_TEST_MCP_TOKEN\" }} }}\n\
         [[agents.mcp_servers]]\nname = \"docs\"\ntype = \"http\"\nurl = \"https://mcp.example/docs\"\n\
         headers = {{ Authorization = {{ file = \"{}\" }} }}\n",
        header_file.display()
    );
    let config = config(
        dir.path(),
        &[
            ("pymcp", &["--mcp-http"], &servers),
            ("pynohttp", &[], &servers),
        ],
    );
    let log = dir.path().join("sessiond.log");
    let envs: &[(&str, &Path)] = &[("SESSIOND_TEST_MCP_TOKEN", Path::new(token))];
    let mut server = start_env(&data, &["--config", &config], Some(TOKEN), Some(&log), envs);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "mcp").await;
    let s = create_session(&mut c, &task.id, &work, "pymcp").await;
    assert_eq!(s.state, pb::SessionState::WaitingForInput as i32, "{s:?}");
    let expected = serde_json::json!([
        {"name": "tools", "type": "stdio", "command": "mcp-tools",
         "values": {"MODE": "ro", "TOKEN": token}},
        {"name": "docs", "type": "http", "url": "https://mcp.example/docs",
         "values": {"Authorization": header}},
    ]);
    let logged = |method: &str| -> Vec<serde_json::Value> {
        std::fs::read_to_string(dir.path().join("py-state/calls.log"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|v| v["method"] == method && v["session_id"] == s.resume_token.as_str())
            .collect()
    };
    assert_eq!(logged("session/new")[0]["mcp"], expected);

    // No agent without http: the create says why.
    let bad = create_session(&mut c, &task.id, &work, "pynohttp").await;
    assert_eq!(bad.state, pb::SessionState::Error as i32, "{bad:?}");
    assert!(
        bad.error_message.contains("mcpCapabilities.http") && bad.error_message.contains("docs"),
        "{}",
        bad.error_message
    );

    // Recovery reopens the conversation with them.
    let reply = prompt(&mut c, &task.id, &s.id, "hello").await;
    assert!(reply.starts_with("turn 1"), "{reply}");
    server.kill();
    for pid in agentctl_pids(&data) {
        Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .unwrap();
    }
    let mut server = start_env(&data, &["--config", &config], Some(TOKEN), Some(&log), envs);
    crate::restart::wait_serving(&server).await;
    let mut c = sessions(&server).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while logged("session/load").is_empty() {
        assert!(Instant::now() < deadline, "never reloaded");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(logged("session/load")[0]["mcp"], expected);

    // Never stored, shown or logged: the references only.
    let profiles = format!(
        "{:?}",
        c.list_agent_profiles(pb::ListAgentProfilesRequest {})
            .await
            .unwrap()
            .into_inner()
    );
    server.kill();
    let stored = all_bytes(&data);
    assert!(
        contains(&stored, "SESSIOND_TEST_MCP_TOKEN"),
        "the reference is stored"
    );
    let log_text = std::fs::read_to_string(&log).unwrap();
    for secret in [token, "hdr-77b2e0"] {
        assert!(!contains(&stored, secret), "{secret} in the database");
        assert!(
            !profiles.contains(secret),
            "{secret} in the API: {profiles}"
        );
        assert!(!log_text.contains(secret), "{secret} in sessiond's log");
    }
}

/// CreateSession adds MCP servers for one session: after the profile's,
/// on session/new and (after kill -9 of everything) on session/load, a
/// reference resolved from what the configuration names, never stored in
/// clear; a reference the configuration does not name, or a name the
/// profile has, is INVALID_ARGUMENT and creates nothing.
#[tokio::test]
#[ignore = "needs the Python ACP SDK's virtualenv: run by cargo xtask ci"]
async fn python_sdk_agent_gets_a_sessions_own_mcp_servers() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let work = dir.path().join("work").canonicalize_or_create();
    let token = "tok-5d1e7b-secret";
    let servers = "[[agents.mcp_servers]]\nname = \"tools\"\ncommand = \"mcp-tools\"\n\
         env = { TOKEN = { env = \"SESSIOND_TEST_MCP_TOKEN\" } }\n";
    let config = config(dir.path(), &[("pymcp", &["--mcp-http"], servers)]);
    let envs: &[(&str, &Path)] = &[("SESSIOND_TEST_MCP_TOKEN", Path::new(token))];
    let mut server = start_env(&data, &["--config", &config], Some(TOKEN), None, envs);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "session mcp").await;
    let value = |v: pb::secret_ref::Source| pb::SecretRef { source: Some(v) };
    let extra = |name: &str, env: Vec<(&str, pb::secret_ref::Source)>| pb::McpServerSpec {
        name: name.into(),
        r#type: "stdio".into(),
        command: "mcp-extra".into(),
        args: vec!["-v".into()],
        env: env
            .into_iter()
            .map(|(k, v)| (k.to_owned(), value(v)))
            .collect(),
        ..Default::default()
    };
    let create = |servers: Vec<pb::McpServerSpec>| pb::CreateSessionRequest {
        task_id: task.id.clone(),
        agent_profile: "pymcp".into(),
        runtime: pb::Runtime::LocalStandalone as i32,
        worktree: Some(pb::Worktree {
            path: work.display().to_string(),
            ..Default::default()
        }),
        mcp_servers: servers,
        ..Default::default()
    };
    use pb::secret_ref::Source;
    for (servers, says) in [
        (
            vec![extra("extra", vec![("HOME", Source::Env("HOME".into()))])],
            "not a secret the configuration names",
        ),
        (vec![extra("tools", vec![])], "the name is taken"),
        (vec![extra("bad name", vec![])], "name: up to 64 letters"),
        (
            vec![pb::McpServerSpec {
                command: "ftp://x".into(),
                ..extra("url", vec![])
            }],
            "looks like a URL",
        ),
        // helper-35: only the scheme was checked.
        (
            vec![pb::McpServerSpec {
                r#type: "http".into(),
                command: String::new(),
                url: "http://:0".into(),
                ..extra("nohost", vec![])
            }],
            "url \"http://:0\": names no host",
        ),
        (
            vec![pb::McpServerSpec {
                r#type: "http".into(),
                command: String::new(),
                url: "https://a b".into(),
                ..extra("blank", vec![])
            }],
            "holds a blank",
        ),
        (
            vec![extra("eq", vec![("A=B", Source::Value("v".into()))])],
            "is not a variable name",
        ),
        (
            vec![pb::McpServerSpec {
                command: "mcp\0x".into(),
                ..extra("nul", vec![])
            }],
            "NUL",
        ),
        (
            (0..33).map(|i| extra(&format!("s{i}"), vec![])).collect(),
            "33 given, at most 32",
        ),
    ] {
        let err = c.create_session(create(servers)).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
        assert!(err.message().contains(says), "{says}: {}", err.message());
    }
    let s = c
        .create_session(create(vec![extra(
            "extra",
            vec![
                ("PLAIN", Source::Value("p".into())),
                ("TOKEN", Source::Env("SESSIOND_TEST_MCP_TOKEN".into())),
            ],
        )]))
        .await
        .unwrap()
        .into_inner()
        .session
        .unwrap();
    assert_eq!(s.state, pb::SessionState::WaitingForInput as i32, "{s:?}");
    let expected = serde_json::json!([
        {"name": "tools", "type": "stdio", "command": "mcp-tools", "values": {"TOKEN": token}},
        {"name": "extra", "type": "stdio", "command": "mcp-extra", "values": {"PLAIN": "p", "TOKEN": token}},
    ]);
    let logged = |method: &str| -> Vec<serde_json::Value> {
        std::fs::read_to_string(dir.path().join("py-state/calls.log"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|v| v["method"] == method && v["session_id"] == s.resume_token.as_str())
            .collect()
    };
    assert_eq!(logged("session/new")[0]["mcp"], expected);
    let reply = prompt(&mut c, &task.id, &s.id, "hello").await;
    assert!(reply.starts_with("turn 1"), "{reply}");

    server.kill();
    for pid in agentctl_pids(&data) {
        Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .unwrap();
    }
    server = start_env(&data, &["--config", &config], Some(TOKEN), None, envs);
    crate::restart::wait_serving(&server).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while logged("session/load").is_empty() {
        assert!(Instant::now() < deadline, "never reloaded");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(logged("session/load")[0]["mcp"], expected);
    server.kill();
    let stored = all_bytes(&data);
    assert!(
        contains(&stored, "mcp-extra"),
        "the session's servers are stored"
    );
    assert!(!contains(&stored, token), "the secret is not stored");
}
