//! Recovery with a real third-party agent: N sessions of the Claude Code ACP
//! adapter (node, then the Claude Code CLI, then the tools' shells, under
//! real agentctl processes) against the fake Messages API
//! (`sessiond_testkit::claude`), a kill -9 of everything, and a restart that
//! must bring every session back by itself.
//!
//! `#[ignore]`d because a plain test run may lack the adapter; `cargo xtask
//! ci` installs it and runs this (`cargo xtask claude-acp` installs it
//! alone). Run without it, it fails naming it: never a pass by skipping.

use std::time::{Duration, Instant};

use chrono::Utc;
use sessiond_domain::{
    AgentProfile, AgentProfileId, ExecutorStatus, MessageRole, PermissionPolicy, SessionId,
    SessionState,
};
use sessiond_engine::{ManagerConfig, SessionManager};
use sessiond_testkit::claude::{self, FakeAnthropic};

use crate::support::{Db, World, kill9};

/// Sessions by default; `SESSIOND_CLAUDE_SESSIONS` sets another count (32
/// for a local stress run).
const SESSIONS: usize = 8;

/// Overall limits: what they catch is a session that never settles, so they
/// are generous; every wait ends as soon as its condition holds.
const TURN_LIMIT: Duration = Duration::from_secs(180);
const RECOVERY_LIMIT: Duration = Duration::from_secs(600);

fn sessions() -> usize {
    match std::env::var("SESSIOND_CLAUDE_SESSIONS") {
        Ok(n) => n
            .parse()
            .unwrap_or_else(|_| panic!("SESSIOND_CLAUDE_SESSIONS={n:?}: a number of sessions")),
        Err(_) => SESSIONS,
    }
}

/// A profile of the adapter with its own HOME (the CLI keeps its settings
/// and session files there; sessions never share one, so two CLIs never
/// write one `~/.claude.json` at once).
async fn claude_profile(w: &World, fake: &FakeAnthropic, name: &str) -> AgentProfile {
    let home = w.path(&format!("home-{name}"));
    std::fs::create_dir_all(&home).unwrap();
    let now = Utc::now();
    w.store
        .upsert_agent_profile(&AgentProfile {
            id: AgentProfileId::new(),
            name: format!("claude-{name}"),
            command: claude::node().display().to_string(),
            args: vec![claude::adapter_entry().display().to_string()],
            env: claude::agent_env(fake, &home).into_iter().collect(),
            supports_session_resume: true,
            container: None,
            auth_method: None,
            permission_policy: PermissionPolicy::Allow,
            permission_timeout: sessiond_domain::DEFAULT_PERMISSION_TIMEOUT,
            config_defaults: Default::default(),
            mcp_servers: Vec::new(),
            created_at: now,
            updated_at: now,
        })
        .await
        .unwrap()
}

/// Sends `text` and waits (by state, up to [`TURN_LIMIT`]) for the turn to
/// end; returns the agent's reply.
async fn prompt(w: &World, mgr: &SessionManager, session: SessionId, text: &str) -> String {
    let before = w.messages(session).await.len();
    mgr.send_message(w.task.id, session, text).await.unwrap();
    let deadline = Instant::now() + TURN_LIMIT;
    loop {
        let st = w.status(mgr, session).await;
        let msgs = w.messages(session).await;
        if st.state == SessionState::WaitingForInput && msgs.len() == before + 2 {
            let reply = msgs.last().unwrap();
            assert_eq!(reply.role, MessageRole::Agent);
            assert!(reply.complete, "reply complete after the turn");
            return reply.content.clone();
        }
        assert!(
            st.state != SessionState::Error,
            "session {session}: {text:?} ended in ERROR: {:?}",
            st.error_message
        );
        assert!(
            Instant::now() < deadline,
            "session {session}: {text:?} did not end within {TURN_LIMIT:?}: {} {:?}",
            st.state,
            st.error_message
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every process of this world but the fake API: agentctls (their run
/// directory), the agents and what they started (their HOME).
fn world_processes(marker: &str, fake: &FakeAnthropic) -> Vec<u32> {
    let mut pids = claude::processes_mentioning(marker);
    pids.retain(|p| *p != fake.pid());
    pids
}

/// Kills whatever of the world still runs when the test ends (a failed test
/// included): the world's own guard knows agentctl and the demo agent, not
/// the CLI and its shells.
struct KillTree(String);

impl Drop for KillTree {
    fn drop(&mut self) {
        for pid in claude::processes_mentioning(&self.0) {
            kill9(pid);
        }
    }
}

/// N sessions of the real adapter, each one tool turn in, all killed with
/// kill -9 (the manager dropped, every agentctl, node, CLI and shell at
/// once); a new manager's startup recovery must bring every one back to
/// WAITING_FOR_INPUT by itself, none ERROR, and each continues its
/// conversation (the model's request carries the earlier prompt). Waits go by
/// the sessions' states, with overall limits of minutes, never by a fixed
/// sleep; the manager runs the production defaults (`ManagerConfig::default()`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the Claude Code ACP adapter: run by cargo xtask ci (cargo xtask claude-acp installs it)"]
async fn claude_sessions_come_back_after_kill9_of_everything() {
    // Before anything starts: a missing adapter fails here, naming the fix.
    claude::adapter_entry();
    let n = sessions();
    let w = World::new(Db::Sqlite).await;
    let fake = FakeAnthropic::start(w.dir.path());
    let marker = w.dir.path().display().to_string();
    let _kill_tree = KillTree(marker.clone());
    let mgr = w.manager_with(ManagerConfig::default());

    let started = Instant::now();
    let mut ids = Vec::new();
    let mut tokens = Vec::new();
    for i in 0..n {
        let profile = claude_profile(&w, &fake, &i.to_string()).await;
        let s = w.create_with(&mgr, &format!("c{i}"), &profile, None).await;
        assert_eq!(
            s.state,
            SessionState::WaitingForInput,
            "{:?}",
            s.error_message
        );
        ids.push(s.id);
        tokens.push(s.resume_token.clone().expect("a resume token"));
    }
    let created = started.elapsed();
    let mut replies = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let reply = prompt(&w, &mgr, *id, &format!("write notes.txt hello-{i}")).await;
        assert!(
            reply.starts_with("claude-fake: tool toolu_fake_") && reply.contains(" done ("),
            "session {i}: {reply:?}"
        );
        assert_eq!(
            std::fs::read_to_string(w.path(&format!("wt-c{i}/notes.txt"))).unwrap(),
            format!("hello-{i}")
        );
        replies.push(reply);
    }
    let prompted = started.elapsed();
    // Every turn is in its CLI's transcript before the crash: the CLI writes
    // it some 50-200 ms after it answered, and a conversation killed before
    // that is not there for `session/load` to reopen (the agent's loss,
    // which no recovery can undo).
    let deadline = Instant::now() + TURN_LIMIT;
    for (i, (token, reply)) in tokens.iter().zip(&replies).enumerate() {
        let home = w.path(&format!("home-{i}"));
        while !claude::transcript(&home, token).contains(reply.as_str()) {
            assert!(
                Instant::now() < deadline,
                "session {i}: the CLI's transcript never held its reply"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let tool_turns = fake
        .agent_turns()
        .iter()
        .filter(|r| r.answer["tool_use"] == "Bash")
        .count();
    assert_eq!(tool_turns, n, "one Bash tool call per session");

    // The crash: the backend's manager goes, then every process at once.
    mgr.shutdown();
    drop(mgr);
    let victims = world_processes(&marker, &fake);
    assert!(
        victims.len() >= 3 * n,
        "agentctl, node and the CLI of {n} sessions: {victims:?}"
    );
    for pid in &victims {
        kill9(*pid);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while !world_processes(&marker, &fake).is_empty() {
        assert!(
            Instant::now() < deadline,
            "survived kill -9: {:?}",
            world_processes(&marker, &fake)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The restart: what `sessiond serve` does before SERVING, nothing more;
    // and a message to the first session while its agent comes back (queued
    // at once by its recovery, or sent if the agent was back already).
    let mgr = w.manager_with(ManagerConfig::default());
    let restarted = Instant::now();
    mgr.recovery().expect_startup_recovery();
    let pass = {
        let mgr = mgr.clone();
        tokio::spawn(async move { mgr.recovery().recover_all().await })
    };
    const EARLY: &str = "sent while the agent comes back";
    let early = tokio::time::timeout(RECOVERY_LIMIT, mgr.send_or_queue(w.task.id, ids[0], EARLY))
        .await
        .expect("the early send never returned")
        .unwrap();
    let early_in = restarted.elapsed();
    let summary = pass.await.unwrap().unwrap();
    let pass = restarted.elapsed();
    eprintln!(
        "claude recovery: the early send answered {} after {early_in:?}",
        match early {
            sessiond_engine::Sent::Queued(_) => "queued",
            sessiond_engine::Sent::Started(_) => "started",
        }
    );
    // Settled: each session is back (waiting, its agent running on a ready
    // executor) or has a verdict (ERROR, or ended). Anything else (STARTING,
    // a retry in the background) is waited for, up to the overall limit.
    let back = |st: &sessiond_domain::SessionStatus| {
        st.state == SessionState::WaitingForInput
            && st.is_agent_running
            && st.executor_status == Some(ExecutorStatus::Ready)
    };
    let deadline = restarted + RECOVERY_LIMIT;
    let states = loop {
        let mut states = Vec::new();
        for id in &ids {
            states.push(w.status(&mgr, *id).await);
        }
        let settled = states.iter().all(|st| {
            back(st)
                || matches!(
                    st.state,
                    SessionState::Error | SessionState::Completed | SessionState::Cancelled
                )
        });
        if settled || Instant::now() >= deadline {
            break states;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let settled_in = restarted.elapsed();
    eprintln!(
        "claude recovery, {n} sessions: created in {created:?}, one tool turn each by {prompted:?}; \
         recover_all {pass:?}, all settled in {settled_in:?}; outcomes {:?}",
        summary.counts
    );
    let bad: Vec<String> = states
        .iter()
        .filter(|st| !back(st))
        .map(|st| {
            format!(
                "{} {} (executor {:?}, agent running: {}): {:?}",
                st.session_id, st.state, st.executor_status, st.is_agent_running, st.error_message
            )
        })
        .collect();
    assert!(
        bad.is_empty(),
        "{} of {n} sessions not back to WAITING_FOR_INPUT {settled_in:?} after the restart \
         (summary {summary:?}):\n{}",
        bad.len(),
        bad.join("\n")
    );

    // The early message reached the model once, with the history, and its
    // reply is stored after it.
    let msgs = w.messages(ids[0]).await;
    let at = msgs
        .iter()
        .position(|m| m.role == MessageRole::User && m.content == EARLY)
        .unwrap_or_else(|| panic!("the early message is not stored: {msgs:?}"));
    assert_eq!(
        msgs.get(at + 1).map(|m| m.content.as_str()),
        Some(format!("claude-fake: you said \"{EARLY}\" (2 user messages)").as_str()),
        "{msgs:?}"
    );
    let asked = fake
        .agent_turns()
        .iter()
        .filter(|r| r.prompt.as_deref() == Some(EARLY))
        .count();
    assert_eq!(asked, 1, "the early message reached the model once");

    // Each conversation goes on where it was.
    for (i, id) in ids.iter().enumerate() {
        w.track(*id).await;
        let text = format!("after the restart {i}");
        let reply = prompt(&w, &mgr, *id, &text).await;
        let earlier = if i == 0 { 3 } else { 2 };
        assert_eq!(
            reply,
            format!("claude-fake: you said \"{text}\" ({earlier} user messages)"),
            "session {i}"
        );
    }
    let resumed = started.elapsed();
    eprintln!("claude recovery, {n} sessions: a next turn on each by {resumed:?}");
    // What GetSessionStatus lists of each recovered conversation: the
    // adapter's config options, its model among them.
    for id in &ids {
        let modes = mgr
            .session_modes(w.task.id, *id)
            .await
            .unwrap()
            .expect("the adapter's modes and options");
        assert!(
            modes
                .config_options
                .iter()
                .any(|o| o.category == "model" && !o.values.is_empty()),
            "{modes:?}"
        );
    }

    w.finish(&mgr, &ids).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !world_processes(&marker, &fake).is_empty() {
        assert!(
            Instant::now() < deadline,
            "processes left: {:?}",
            world_processes(&marker, &fake)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(fake);
}

/// The parent pid of `pid` (`/proc/PID/stat`), if it runs.
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit(')')
        .next()?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// helper-40 1, with the real adapter: its CLI killed alone (the adapter,
/// node, lives on: what the out-of-memory killer does to the largest
/// process) left every later prompt failing "Session not found" while the
/// session looked healthy. The failed turn has sessiond relaunch the agent,
/// which loads the conversation again: the next message works and the
/// model sees the history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the Claude Code ACP adapter: run by cargo xtask ci (cargo xtask claude-acp installs it)"]
async fn claude_session_whose_cli_died_under_a_live_adapter_comes_back() {
    claude::adapter_entry();
    let w = World::new(Db::Sqlite).await;
    let fake = FakeAnthropic::start(w.dir.path());
    let marker = w.dir.path().display().to_string();
    let _kill_tree = KillTree(marker.clone());
    let mgr = w.manager_with(ManagerConfig::default());
    let profile = claude_profile(&w, &fake, "cli").await;
    let s = w.create_with(&mgr, "cli", &profile, None).await;
    assert_eq!(
        s.state,
        SessionState::WaitingForInput,
        "{:?}",
        s.error_message
    );
    let token = s.resume_token.clone().expect("a resume token");
    let first = prompt(&w, &mgr, s.id, "hello before").await;
    assert!(first.ends_with("(1 user messages)"), "{first}");
    let home = w.path("home-cli");
    let deadline = Instant::now() + TURN_LIMIT;
    // (Quoted as JSON there: looked for by its unquoted end.)
    while !claude::transcript(&home, &token).contains("(1 user messages)") {
        assert!(
            Instant::now() < deadline,
            "the transcript never held the reply"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The CLI: the child of the adapter, which is agentctl's child.
    let agentctl = w.record(s.id).await.pid.unwrap();
    let world = world_processes(&marker, &fake);
    let adapter = *world
        .iter()
        .find(|p| parent_of(**p) == Some(agentctl))
        .expect("the adapter under agentctl");
    let cli = *world
        .iter()
        .find(|p| parent_of(**p) == Some(adapter))
        .expect("the CLI under the adapter");
    kill9(cli);
    while std::path::Path::new(&format!("/proc/{cli}")).exists() && parent_of(cli).is_some() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The next message fails in the adapter; sessiond brings the agent back.
    let before = w.messages(s.id).await.len();
    mgr.send_message(w.task.id, s.id, "while the cli is dead")
        .await
        .unwrap();
    let deadline = Instant::now() + TURN_LIMIT;
    loop {
        let st = w.status(&mgr, s.id).await;
        let msgs = w.messages(s.id).await;
        if msgs.len() > before + 1
            && st.state == SessionState::WaitingForInput
            && st.is_agent_running
            && !st.recovering
            && parent_of(adapter).is_none()
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not back: {st:?} {:?}",
            msgs.last()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    w.track(s.id).await;
    let reply = prompt(&w, &mgr, s.id, "hello after").await;
    assert_eq!(
        reply, "claude-fake: you said \"hello after\" (2 user messages)",
        "the history was loaded again"
    );
    w.finish(&mgr, &[s.id]).await;
    drop(fake);
}
