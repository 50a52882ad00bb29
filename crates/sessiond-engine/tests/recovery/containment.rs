//! Processes the agent starts are ours to the end: stopping a session
//! whose agentctl was killed (`kill -9`) ends what its heavy agent left
//! running, a `setsid` process and one that also cleared its environment
//! included, in the same backend and in one started afresh.

use std::time::{Duration, Instant};

use sessiond_domain::AgentProfile;

use crate::common::{bin, is_running};
use crate::support::{Db, World};

/// A heavy demo agent whose command first starts two processes that leave
/// its session: one keeping the environment (and so the tree's marker), one
/// clearing it. Their pids land in `<dir>/escaped-{marked,bare}.pid`.
async fn escaping_profile(w: &World) -> AgentProfile {
    let dir = w.dir.path().display().to_string();
    let script = format!(
        "setsid sh -c 'echo $$ > {dir}/escaped-marked.pid; exec sleep 1000' </dev/null >/dev/null 2>&1 & \
         env -i setsid sh -c 'echo $$ > {dir}/escaped-bare.pid; exec sleep 1000' </dev/null >/dev/null 2>&1 & \
         exec {} --state-dir {dir}/agent-state",
        bin("acp-demo-agent").display()
    );
    let args = ["-c".to_owned(), script];
    let heavy = [
        ("ACP_DEMO_STARTUP_MS", "1500"),
        ("ACP_DEMO_BUSY_MS", "300"),
        ("ACP_DEMO_RSS_MB", "16"),
    ];
    w.upsert_profile("escaping", "/bin/sh", &args, &heavy, true)
        .await
}

async fn escaped(w: &World) -> [u32; 2] {
    let read = |name: &str| {
        std::fs::read_to_string(w.path(name))
            .ok()
            .and_then(|t| t.trim().parse::<u32>().ok())
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let (Some(a), Some(b)) = (read("escaped-marked.pid"), read("escaped-bare.pid")) {
            return [a, b];
        }
        assert!(
            Instant::now() < deadline,
            "the agent's escaping processes never started"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn assert_all_gone(pids: &[u32]) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while pids.iter().any(|&p| is_running(p)) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let left: Vec<u32> = pids.iter().copied().filter(|&p| is_running(p)).collect();
    assert!(
        left.is_empty(),
        "processes of the stopped session left: {left:?}"
    );
}

fn kill9(pid: u32) {
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid as i32).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_after_agentctl_kill9_ends_everything_the_agent_started() {
    let w = World::new(Db::Sqlite).await;
    let profile = escaping_profile(&w).await;
    let mgr = w.manager();
    let s = w.create_with(&mgr, "contained", &profile, None).await;
    w.prompt(&mgr, s.id, "one").await;
    let pids = escaped(&w).await;
    let agentctl = w.record(s.id).await.pid.unwrap();
    kill9(agentctl);
    mgr.cancel_session(w.task.id, s.id).await.unwrap();
    assert_all_gone(&pids).await;
    assert!(!is_running(agentctl));
    w.finish(&mgr, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_by_a_restarted_backend_ends_everything_the_agent_started() {
    let w = World::new(Db::Sqlite).await;
    let profile = escaping_profile(&w).await;
    let mgr = w.manager();
    let s = w.create_with(&mgr, "contained", &profile, None).await;
    w.prompt(&mgr, s.id, "one").await;
    let pids = escaped(&w).await;
    // The backend goes away, then agentctl is killed: nothing runs that
    // knows the agent's processes.
    mgr.shutdown();
    drop(mgr);
    let agentctl = w.record(s.id).await.pid.unwrap();
    kill9(agentctl);
    let mgr = w.manager();
    mgr.delete_session(w.task.id, s.id).await.unwrap();
    assert_all_gone(&pids).await;
    w.finish(&mgr, &[]).await;
}

/// helper-39 2: an agentctl launched again (a restart after `kill -9` of
/// it) ended what its predecessor's agent had left that cleared its
/// environment only at the session's stop: the old processes ran beside the
/// new agent. They end before the new agentctl starts now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relaunched_agentctl_starts_after_what_the_old_one_left_ended() {
    let w = World::new(Db::Sqlite).await;
    let profile = escaping_profile(&w).await;
    let mgr = w.manager();
    let s = w.create_with(&mgr, "contained", &profile, None).await;
    w.prompt(&mgr, s.id, "one").await;
    let old = escaped(&w).await;
    for name in ["escaped-marked.pid", "escaped-bare.pid"] {
        std::fs::remove_file(w.path(name)).unwrap();
    }
    mgr.shutdown();
    drop(mgr);
    let agentctl = w.record(s.id).await.pid.unwrap();
    kill9(agentctl);
    let mgr = w.manager();
    mgr.recovery().recover_all().await.unwrap();
    let new = escaped(&w).await;
    assert_all_gone(&old).await;
    assert!(
        new.iter().all(|&p| is_running(p)),
        "the new agent's own run"
    );
    w.prompt(&mgr, s.id, "two").await;
    mgr.cancel_session(w.task.id, s.id).await.unwrap();
    assert_all_gone(&new).await;
    w.finish(&mgr, &[]).await;
}

/// The Docker runtime: the container is the kill domain. The agent's
/// command first leaves a process behind (stopped, so it lives until
/// killed: the image has no `sleep`); agentctl is killed -9 from the host;
/// stopping the session leaves no process of the container on the host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn docker_stop_after_agentctl_kill9_leaves_no_process_of_the_container() {
    use crate::docker_support::{CONTAINER_WORKSPACE, DockerKit, docker_cli};
    let w = World::new(Db::Sqlite).await;
    let kit = DockerKit::new(&w).await;
    let script = format!(
        "sh -c 'echo $$ > {CONTAINER_WORKSPACE}/escaped.pid; kill -STOP $$' </dev/null >/dev/null 2>&1 & \
         exec /usr/local/bin/acp-demo-agent --state-dir {CONTAINER_WORKSPACE}/.agent-state"
    );
    let profile = w
        .upsert_profile(
            "escaping-in-docker",
            "/bin/sh",
            &["-c".to_owned(), script],
            &[],
            true,
        )
        .await;
    let mgr = kit.manager(&w);
    let s = w
        .create_rt(
            &mgr,
            "contained-docker",
            &profile,
            sessiond_domain::Runtime::LocalDocker,
            None,
        )
        .await;
    assert_eq!(
        s.state,
        sessiond_domain::SessionState::WaitingForInput,
        "{:?}",
        s.error_message
    );
    w.prompt(&mgr, s.id, "one").await;
    let escaped = w.path("wt-contained-docker/escaped.pid");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !escaped.is_file() {
        assert!(
            Instant::now() < deadline,
            "the escaping process never started"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let container = kit.one_running(s.id).await;
    // Every process of the container, by its pid on the host.
    let pids: Vec<u32> = docker_cli(&kit.env, &["top", &container.id, "-eo", "pid"])
        .lines()
        .skip(1)
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    assert!(
        pids.len() >= 3,
        "agentctl, the agent and the escaped process: {pids:?}"
    );
    let agentctl: u32 = docker_cli(
        &kit.env,
        &["inspect", "-f", "{{.State.Pid}}", &container.id],
    )
    .trim()
    .parse()
    .unwrap();
    assert!(pids.contains(&agentctl), "{agentctl} in {pids:?}");
    kill9(agentctl);
    mgr.cancel_session(w.task.id, s.id).await.unwrap();
    assert_all_gone(&pids).await;
    for c in kit.containers_of_session(s.id).await {
        assert_ne!(c.state, "running", "{c:?}");
    }
    w.finish(&mgr, &[]).await;
}
