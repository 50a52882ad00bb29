//! Drives a session from Rust, without gRPC and without the server crate:
//! create → prompt → watch → restart → resume → prompt again.
//!
//! ```text
//! cargo build -p agentctl -p acp-demo-agent
//! cargo run -p sessiond-engine --example drive_sessions
//! ```
//!
//! It uses the real agentctl and the demo ACP agent found beside this
//! example's directory (`target/debug`), or the paths given as
//! `--agentctl PATH --agent PATH`. The "restart" is what a backend restart
//! after a host reboot looks like: the session manager is dropped and the
//! agentctl killed; a new manager over the same store recovers the
//! executor (a new agentctl, generation 2), and with the on-demand resume
//! policy the agent's conversation comes back only when asked for
//! (`resume_session`: ACP `session/load`). The second reply proves that
//! the agent continued the same conversation. `cargo xtask ci` runs it.

use std::{collections::BTreeMap, path::PathBuf, sync::Arc, time::Duration};

use chrono::Utc;
use futures::StreamExt;
use sessiond_domain::{
    AgentProfile, AgentProfileId, EventPayload, MessageRole, ResumePolicy, Runtime, SessionState,
    Task, TaskId, TaskState, Worktree,
};
use sessiond_engine::{ManagerConfig, NewSession, SessionManager};
use sessiond_executor::{
    Executor,
    standalone::{StandaloneConfig, StandaloneExecutor},
};
use sessiond_store::{Store, StoreOptions};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let (agentctl, agent) = binaries()?;
    let dir = tempfile::tempdir()?;
    let store = Store::connect(
        &format!("sqlite://{}", dir.path().join("sessiond.db").display()),
        StoreOptions::default(),
    )
    .await?;
    let now = Utc::now();
    let task = store
        .create_task(&Task {
            id: TaskId::new(),
            title: "driven from Rust".into(),
            state: TaskState::Todo,
            created_at: now,
            updated_at: now,
        })
        .await?;
    let profile = store
        .upsert_agent_profile(&AgentProfile {
            id: AgentProfileId::new(),
            name: "demo".into(),
            command: agent.display().to_string(),
            args: vec![
                "--state-dir".into(),
                dir.path().join("agent-state").display().to_string(),
            ],
            env: BTreeMap::new(),
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
        .await?;
    let worktree = dir.path().join("worktree");
    std::fs::create_dir_all(&worktree)?;

    // One driver per runtime the manager serves; here only local processes.
    let drivers = || -> Vec<Arc<dyn Executor>> {
        let mut config = StandaloneConfig::new(agentctl.clone(), dir.path().join("run"));
        config.log_dir = Some(dir.path().join("run"));
        vec![Arc::new(StandaloneExecutor::new(config))]
    };
    let config = ManagerConfig {
        // Startup recovery restores workspaces; agents come back on request.
        resume_policy: ResumePolicy::OnDemand,
        ..ManagerConfig::default()
    };

    // Create: agentctl launched, the agent started, its ACP session opened.
    let manager = SessionManager::new(store.clone(), drivers(), config.clone());
    let session = manager
        .create_session(NewSession {
            task_id: task.id,
            agent_profile_id: profile.id,
            runtime: Runtime::LocalStandalone,
            worktree: Worktree {
                id: "main".into(),
                path: worktree.display().to_string(),
                branch: "main".into(),
                ..Default::default()
            },
            remote: None,
            metadata: BTreeMap::new(),
            mcp_servers: Vec::new(),
        })
        .await?;
    say(format!(
        "created session {} ({})",
        session.id, session.state
    ));

    // Watch from the start, then prompt; the turn's end comes on the stream.
    let mut events = manager.watch_session(session.id, 0).await?;
    manager
        .send_message(task.id, session.id, "hello from Rust")
        .await?;
    let first = reply_of_turn(&mut events).await?;
    say(format!("reply 1: {first}"));
    assert!(first.starts_with("turn 1 of session "), "{first}");
    drop(events);

    // Restart: the manager goes away (executors outlive it), and so does
    // agentctl with its agent, as after a reboot.
    manager.shutdown();
    drop(manager);
    let record = store
        .get_executor_for_session(session.id)
        .await?
        .ok_or("the session has no executor record")?;
    let pid = record
        .pid
        .ok_or("the standalone executor recorded no pid")?;
    kill_tree(pid).await?;
    say(format!("backend restarted; agentctl {pid} killed"));

    let manager = SessionManager::new(store.clone(), drivers(), config);
    let summary = manager.recovery().recover_all().await?;
    say(format!("startup recovery: {:?}", summary.counts));
    let status = manager.session_status(task.id, session.id).await?;
    assert!(status.needs_resume, "after the restart: {status:?}");

    // Resume: a new agent loads the conversation (ACP session/load).
    let status = manager.resume_session(task.id, session.id).await?;
    assert!(status.is_agent_running, "after resume: {status:?}");
    say(format!(
        "resumed: {} ({:?})",
        status.state, status.resume_reason
    ));

    let mut events = manager
        .watch_session(
            session.id,
            store.events_after(session.id, 0, 100_000).await?.len() as i64,
        )
        .await?;
    manager
        .send_message(task.id, session.id, "still there?")
        .await?;
    let second = reply_of_turn(&mut events).await?;
    say(format!("reply 2: {second}"));
    // The same conversation: the agent counts this as its second turn.
    assert!(second.starts_with("turn 2 of session "), "{second}");

    // End it: agentctl and the agent stop.
    let ended = manager.complete_session(task.id, session.id).await?;
    assert_eq!(ended.state, SessionState::Completed);
    manager.shutdown();
    say("drive_sessions: ok".into());
    Ok(())
}

/// The agent's reply of the turn in progress, from the watch stream: the
/// last agent message seen when the turn ends.
async fn reply_of_turn(events: &mut sessiond_engine::EventStream) -> Result<String, BoxError> {
    let mut reply = String::new();
    loop {
        let event = tokio::time::timeout(Duration::from_secs(30), events.next())
            .await
            .map_err(|_| "no event for 30 s")?
            .ok_or("the watch stream ended")??;
        match &event.payload {
            EventPayload::MessageAdded(m) | EventPayload::MessageUpdated(m)
                if m.role == MessageRole::Agent =>
            {
                reply.clone_from(&m.content);
            }
            EventPayload::TurnEnded {
                stop_reason,
                error_message,
                ..
            } => {
                if stop_reason != "end_turn" {
                    return Err(format!("turn ended {stop_reason}: {error_message:?}").into());
                }
                return Ok(reply);
            }
            _ => {}
        }
    }
}

/// agentctl and the demo agent: the flags, else beside `target/<profile>/examples`.
fn binaries() -> Result<(PathBuf, PathBuf), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .map(PathBuf::from)
    };
    let exe = std::env::current_exe()?;
    let target = exe
        .parent()
        .and_then(|examples| examples.parent())
        .ok_or("cannot find the target directory")?;
    let agentctl = flag("--agentctl").unwrap_or_else(|| target.join("agentctl"));
    let agent = flag("--agent").unwrap_or_else(|| target.join("acp-demo-agent"));
    for path in [&agentctl, &agent] {
        if !path.is_file() {
            return Err(format!(
                "{} not found: run `cargo build -p agentctl -p acp-demo-agent` first",
                path.display()
            )
            .into());
        }
    }
    Ok((agentctl, agent))
}

/// Kills agentctl and its agent (its direct children) as a crash of the
/// machine would, and waits until they are gone.
async fn kill_tree(pid: u32) -> Result<(), BoxError> {
    let mut pids = vec![pid];
    for entry in std::fs::read_dir("/proc")?.flatten() {
        let Some(child) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{child}/stat")) else {
            continue;
        };
        // Field 4, after the parenthesised command name.
        let ppid = stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(pid) {
            pids.push(child);
        }
    }
    for p in &pids {
        std::process::Command::new("kill")
            .args(["-9", &p.to_string()])
            .status()?;
    }
    for _ in 0..500 {
        let alive = pids.iter().any(|p| {
            std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|s| {
                !s.rsplit(')')
                    .next()
                    .is_some_and(|r| r.trim_start().starts_with('Z'))
            })
        });
        if !alive {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Err(format!("processes {pids:?} survived kill -9").into())
}

#[allow(clippy::print_stdout)]
fn say(line: String) {
    println!("{line}");
}
