//! Registers a third-party executor driver ([`wrapper::WrapperExecutor`]:
//! agentctl started through a wrapper command) with an embedded sessiond
//! under a runtime of its own name, `wrapper`, and runs one session on it.
//!
//! ```text
//! cargo build -p agentctl -p acp-demo-agent
//! cargo run -p sessiond-server --example custom_executor [-- WRAPPER ARGS...]
//! ```
//!
//! The wrapper defaults to `nice -n 5`; `systemd-run --user --scope` or
//! `sudo -u agent` work the same where they are available. Sessions created
//! with the runtime `wrapper` (`CreateSession.runtime_name = "wrapper"` over
//! gRPC, `Runtime::parse("wrapper")` from Rust) run through it: launched,
//! recovered after a restart, resumed and stopped by the same recovery step
//! machine as the built-in drivers (the restart is exercised by the test
//! `embedding::custom_runtime_is_driven_like_the_built_in_ones`).
//! `cargo xtask ci` runs it.

mod wrapper;

use std::{sync::Arc, time::Duration};

use sessiond_domain::{
    MessageKind, MessageRole, Runtime, SessionState, Task, TaskId, TaskState, Worktree,
};
use sessiond_engine::NewSession;
use sessiond_server::{Sessiond, config::FileConfig};
use wrapper::{WrapperConfig, WrapperExecutor};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut wrapper: Vec<String> = std::env::args().skip(1).collect();
    if wrapper.is_empty() {
        wrapper = vec!["nice".into(), "-n".into(), "5".into()];
    }
    // agentctl and the demo agent beside target/<profile>/examples.
    let exe = std::env::current_exe()?;
    let target = exe
        .parent()
        .and_then(|examples| examples.parent())
        .ok_or("cannot find the target directory")?;
    let (agentctl, agent) = (target.join("agentctl"), target.join("acp-demo-agent"));
    for path in [&agentctl, &agent] {
        if !path.is_file() {
            return Err(format!(
                "{} not found: run `cargo build -p agentctl -p acp-demo-agent` first",
                path.display()
            )
            .into());
        }
    }

    let dir = tempfile::tempdir()?;
    let config = FileConfig::parse(&format!(
        r#"
        data_dir = "{data}"
        default_agent = "demo"
        [executors]
        worktree_roots = ["{data}"]
        [[agents]]
        name = "demo"
        command = "{agent}"
        args = ["--state-dir", "{data}/agent-state"]
        "#,
        data = dir.path().display(),
        agent = agent.display(),
    ))?
    .validate_for_embedding()?;

    // The registration: this driver serves a runtime of its own name. A
    // name is 1 to 40 characters of a-z, 0-9, '_' and '-', and not a
    // built-in runtime's (which would replace that runtime's driver).
    let runtime = Runtime::parse("wrapper")?;
    let driver = WrapperExecutor::new(WrapperConfig {
        runtime,
        wrapper,
        agentctl,
        run_dir: dir.path().join("run"),
        env: vec![("PATH".into(), "/usr/local/bin:/usr/bin:/bin".into())],
        client: sessiond_executor::ClientConfig::default(),
        startup_timeout: Duration::from_secs(20),
    });
    let sessiond = Sessiond::builder(config)
        .executor(Arc::new(driver))
        .build()
        .await?;
    sessiond.start("127.0.0.1:0").await?;
    while !sessiond.is_ready() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let manager = sessiond.manager();
    let now = chrono::Utc::now();
    let task = sessiond
        .store()
        .create_task(&Task {
            id: TaskId::new(),
            title: "custom executor".into(),
            state: TaskState::Todo,
            created_at: now,
            updated_at: now,
        })
        .await?;
    let worktree = dir.path().join("wt");
    std::fs::create_dir_all(&worktree)?;
    let profile = sessiond.store().get_agent_profile_by_name("demo").await?;
    let session = manager
        .create_session(NewSession {
            task_id: task.id,
            agent_profile_id: profile.id,
            runtime,
            worktree: Worktree {
                id: "wt".into(),
                path: worktree.display().to_string(),
                branch: "main".into(),
                ..Default::default()
            },
            remote: None,
            metadata: Default::default(),
            mcp_servers: Vec::new(),
        })
        .await?;
    manager.send_message(task.id, session.id, "hello").await?;
    for _ in 0..3000 {
        if manager.session_status(task.id, session.id).await?.state == SessionState::WaitingForInput
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let reply = sessiond
        .store()
        .list_messages(session.id, 0, 100)
        .await?
        .into_iter()
        .rev()
        .find(|m| m.kind == MessageKind::Text && m.role == MessageRole::Agent && m.complete)
        .ok_or("no reply within 60 s")?;
    let record = sessiond
        .store()
        .get_executor_for_session(session.id)
        .await?
        .ok_or("no executor record")?;
    #[allow(clippy::print_stdout)]
    {
        println!(
            "runtime {}: agentctl pid {:?} via the wrapper; reply: {}",
            record.runtime, record.pid, reply.content
        );
    }
    manager.complete_session(task.id, session.id).await?;
    sessiond.shutdown().await;
    sessiond.release().await;
    #[allow(clippy::print_stdout)]
    {
        println!("custom_executor: ok");
    }
    Ok(())
}
