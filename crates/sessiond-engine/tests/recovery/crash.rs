//! A truer crash: the backend runs in a child process (this test binary
//! re-executed) and is killed with SIGKILL.

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    time::Duration,
};

use sessiond_domain::{ExecutorStatus, OutcomeLabel, SessionId, SessionState};
use sessiond_engine::{NewSession, SessionManager};
use sessiond_store::{Store, StoreOptions};

use crate::support::{Db, World, drivers_in, expected_reply, kill9};

const CHILD_ENV: &str = "SESSIOND_RECOVERY_TEST_CHILD";

/// The child backend: recovers, creates a session, sends one message, waits
/// for the reply, prints the session id, then waits to be killed.
// Not a test: `--ignored --exact` runs it in the child process only.
#[ignore = "child-process entry point, not a test"]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_backend() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        panic!(
            "a child-process entry point, not a test: started by backend_killed_with_sigkill with {CHILD_ENV} set"
        );
    };
    let parts: Vec<&str> = spec.split('|').collect();
    let (url, dir, task, profile, worktree) = (parts[0], parts[1], parts[2], parts[3], parts[4]);
    crate::support::init_tracing();
    let store = Store::connect(url, StoreOptions::default()).await.unwrap();
    let mgr = SessionManager::new(
        store.clone(),
        drivers_in(std::path::Path::new(dir)),
        sessiond_engine::ManagerConfig::default(),
    );
    mgr.recovery().recover_all().await.unwrap();
    let task = task.parse().unwrap();
    let s = mgr
        .create_session(NewSession {
            task_id: task,
            agent_profile_id: profile.parse().unwrap(),
            runtime: sessiond_domain::Runtime::LocalStandalone,
            worktree: sessiond_domain::Worktree {
                id: "crash".into(),
                path: worktree.into(),
                branch: "crash".into(),
                ..Default::default()
            },
            remote: None,
            metadata: Default::default(),
            mcp_servers: Vec::new(),
        })
        .await
        .unwrap();
    mgr.send_message(task, s.id, "before the crash")
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let st = mgr.session_status(task, s.id).await.unwrap();
        if st.state == SessionState::WaitingForInput {
            break;
        }
        assert!(
            st.state != SessionState::Error && std::time::Instant::now() < deadline,
            "child: the turn did not end: {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    #[allow(clippy::print_stdout)]
    {
        println!("SESSION {}", s.id);
    }
    tokio::time::sleep(Duration::from_secs(600)).await;
}

/// `kill -9` of the backend after a turn: the next backend reattaches to
/// the same agentctl, and in the process table there is exactly one
/// agentctl for the executor; the conversation continues.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_killed_with_sigkill() {
    let w = World::new(Db::Sqlite).await;
    let url = format!("sqlite://{}", w.path("sessiond.db").display());
    let wt = w.worktree("crash");
    let spec = format!(
        "{url}|{}|{}|{}|{}",
        w.dir.path().display(),
        w.task.id,
        w.profile.id,
        wt.path
    );
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "crash::child_backend",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, spec)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let reading = tokio::task::spawn_blocking(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .find(|l| l.starts_with("SESSION "))
    });
    let line = match tokio::time::timeout(Duration::from_secs(90), reading).await {
        Ok(line) => line.unwrap(),
        Err(_) => None,
    };
    let Some(line) = line else {
        kill9(child.id());
        let _ = child.wait();
        panic!("the child backend printed no session (see its stderr above)");
    };
    let sid: SessionId = line.trim_start_matches("SESSION ").parse().unwrap();
    w.track(sid).await;
    kill9(child.id());
    let _ = child.wait();

    let before = w.record(sid).await;
    let mgr = w.manager();
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::Reattached), 1, "{summary:?}");
    let after = w.record(sid).await;
    assert_eq!(after.pid, before.pid);
    assert_eq!(after.status, ExecutorStatus::Ready);
    assert_eq!(
        agentctls_of(&after.id.to_string()),
        1,
        "exactly one agentctl for the executor"
    );
    let token = w
        .store
        .get_session(sid)
        .await
        .unwrap()
        .resume_token
        .unwrap();
    let reply = w.prompt(&mgr, sid, "after the crash").await;
    assert_eq!(reply, expected_reply(2, &token, "after the crash"));
    w.finish(&mgr, &[sid]).await;
}

fn agentctls_of(executor_id: &str) -> usize {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .filter(|c| {
            let args: Vec<&[u8]> = c.split(|b| *b == 0).collect();
            args.windows(2)
                .any(|w| w[0] == b"--executor-id" && w[1] == executor_id.as_bytes())
        })
        .count()
}
