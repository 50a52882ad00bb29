//! The embedding API, in process: a [`Sessiond`] built by the library with
//! a third-party executor driver (`examples/custom_executor/wrapper.rs`)
//! registered for the `local_standalone` runtime, driven from Rust through
//! its session manager, restarted, recovered and resumed — with real
//! agentctl and demo-agent processes, as the built-in drivers are tested.

use std::{sync::Arc, time::Duration};

use sessiond_domain::{MessageKind, MessageRole, Runtime, SessionState, Worktree};
use sessiond_executor::ClientConfig;
use sessiond_recovery::NewSession;
use sessiond_server::{Sessiond, config::FileConfig};

use crate::support::bin;

#[path = "../../examples/custom_executor/wrapper.rs"]
mod wrapper;

use wrapper::{WrapperConfig, WrapperExecutor};

/// The configuration of one embedded sessiond in `dir`, with the demo agent.
fn config(dir: &std::path::Path) -> sessiond_server::config::Config {
    let mut file = FileConfig::parse(&format!(
        r#"
        data_dir = "{data}"
        default_agent = "demo"
        [recovery]
        mode = "on_demand"
        [executors]
        worktree_roots = ["{data}"]
        [[agents]]
        name = "demo"
        command = "{agent}"
        args = ["--state-dir", "{data}/agent-state"]
        "#,
        data = dir.display(),
        agent = bin("acp-demo-agent").display(),
    ))
    .unwrap();
    file.executors.standalone.agentctl_path = Some(bin("agentctl"));
    file.validate_for_embedding().unwrap()
}

/// The third-party driver: agentctl through a wrapper script that logs
/// each launch, so the test sees that this driver (not the built-in one)
/// started every agentctl.
fn driver(dir: &std::path::Path) -> Arc<WrapperExecutor> {
    let script = dir.join("wrap.sh");
    std::fs::write(
        &script,
        format!(
            "echo \"$@\" >> {}\nexec \"$@\"\n",
            dir.join("launches.log").display()
        ),
    )
    .unwrap();
    Arc::new(WrapperExecutor::new(WrapperConfig {
        // Through `sh`: the temporary directory may be mounted noexec.
        wrapper: vec!["/bin/sh".into(), script.display().to_string()],
        agentctl: bin("agentctl"),
        run_dir: dir.join("run"),
        env: vec![("PATH".into(), std::env::var("PATH").unwrap_or_default())],
        client: ClientConfig {
            connect_timeout: Duration::from_secs(2),
            call_timeout: Duration::from_secs(10),
            ..ClientConfig::default()
        },
        startup_timeout: Duration::from_secs(20),
    }))
}

fn launches(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("launches.log"))
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

async fn started(dir: &std::path::Path) -> Sessiond {
    let sessiond = Sessiond::builder(config(dir))
        .executor(driver(dir))
        .build()
        .await
        .unwrap();
    sessiond.start("127.0.0.1:1").await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !sessiond.is_ready() {
        assert!(
            std::time::Instant::now() < deadline,
            "first recovery pass not done"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sessiond
}

/// The agent's last reply once the session waits for input again.
async fn prompt(
    sessiond: &Sessiond,
    task: sessiond_domain::TaskId,
    session: sessiond_domain::SessionId,
    text: &str,
) -> String {
    let manager = sessiond.manager();
    manager.send_message(task, session, text).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let status = manager.session_status(task, session).await.unwrap();
        if status.state == SessionState::WaitingForInput {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "turn did not end: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let messages = sessiond
        .store()
        .list_messages(session, 0, 1000)
        .await
        .unwrap();
    let reply = messages
        .iter()
        .rev()
        .find(|m| m.kind == MessageKind::Text && m.role == MessageRole::Agent)
        .expect("an agent reply");
    assert!(reply.complete, "{reply:?}");
    reply.content.clone()
}

/// Kills agentctl and its agent, as a crash of the machine would.
async fn kill_tree(pid: u32) {
    let mut pids = vec![pid];
    pids.extend(children_of(pid));
    for p in &pids {
        let _ = std::process::Command::new("kill")
            .args(["-9", &p.to_string()])
            .status();
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while pids
        .iter()
        .any(|p| sessiond_executor::process::stat(*p).is_some_and(|s| s.is_running()))
    {
        assert!(
            std::time::Instant::now() < deadline,
            "{pids:?} survived kill -9"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// create → prompt → backend restart with agentctl and agent killed →
/// recovery relaunches through the custom driver (generation 2) → explicit
/// resume loads the conversation → the next reply is the agent's turn 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_executor_is_driven_like_the_built_in_ones() {
    let dir = tempfile::tempdir().unwrap();
    let worktree = dir.path().join("wt");
    std::fs::create_dir_all(&worktree).unwrap();

    let sessiond = started(dir.path()).await;
    let task = sessiond
        .store()
        .create_task(&sessiond_domain::Task {
            id: sessiond_domain::TaskId::new(),
            title: "custom executor".into(),
            state: sessiond_domain::TaskState::Todo,
            created_at: chrono::Utc::now(),
            updated_at: chrono::Utc::now(),
        })
        .await
        .unwrap();
    let profile = sessiond
        .store()
        .get_agent_profile_by_name("demo")
        .await
        .unwrap();
    let session = sessiond
        .manager()
        .create_session(NewSession {
            task_id: task.id,
            agent_profile_id: profile.id,
            runtime: Runtime::LocalStandalone,
            worktree: Worktree {
                id: "wt".into(),
                path: worktree.display().to_string(),
                branch: "main".into(),
            },
            remote: None,
            metadata: Default::default(),
        })
        .await
        .unwrap();
    let token = session
        .resume_token
        .clone()
        .unwrap_or_else(|| panic!("a resume token: {session:?}"));
    assert_eq!(
        launches(dir.path()).len(),
        1,
        "launched through the wrapper"
    );
    let first = sessiond
        .store()
        .get_executor_for_session(session.id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.generation, 1);
    let reply = prompt(&sessiond, task.id, session.id, "one").await;
    assert_eq!(
        reply,
        format!("turn 1 of session {token}: you said \"one\"")
    );

    // Restart: the backend stops (executors keep running), then agentctl
    // and its agent die as in a reboot.
    sessiond.shutdown().await;
    sessiond.release().await;
    kill_tree(first.pid.unwrap()).await;

    let sessiond = started(dir.path()).await;
    let record = sessiond
        .store()
        .get_executor_for_session(session.id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.generation, 2, "relaunched by recovery: {record:?}");
    assert_ne!(record.pid, first.pid);
    assert_eq!(
        launches(dir.path()).len(),
        2,
        "relaunched through the wrapper"
    );
    let status = sessiond
        .manager()
        .session_status(task.id, session.id)
        .await
        .unwrap();
    assert!(
        status.needs_resume,
        "on_demand: the agent waits for a resume: {status:?}"
    );

    let status = sessiond
        .manager()
        .resume_session(task.id, session.id)
        .await
        .unwrap();
    assert!(status.is_agent_running, "{status:?}");
    let reply = prompt(&sessiond, task.id, session.id, "two").await;
    assert_eq!(
        reply,
        format!("turn 2 of session {token}: you said \"two\"")
    );

    // Ending the session stops agentctl through the driver.
    let pid = sessiond
        .store()
        .get_executor_for_session(session.id)
        .await
        .unwrap()
        .unwrap()
        .pid
        .unwrap();
    sessiond
        .manager()
        .complete_session(task.id, session.id)
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while sessiond_executor::process::stat(pid).is_some_and(|s| s.is_running()) {
        assert!(
            std::time::Instant::now() < deadline,
            "agentctl {pid} still runs"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sessiond.shutdown().await;
    sessiond.release().await;
}

/// Direct children of `pid` (from /proc/*/stat field 4).
fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(child) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{child}/stat")) else {
            continue;
        };
        let ppid = stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(pid) {
            out.push(child);
        }
    }
    out
}
