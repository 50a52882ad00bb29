use std::time::{Duration, Instant};

use sessiond_domain::{ExecutorStatus, OutcomeLabel, SessionState, TaskState};
use sessiond_proto::agentctl::v1 as pb;

use crate::support::{Db, World, expected_reply, is_running, kill_tree};

/// Restart with agentctl alive: reattached (same pid, nothing launched), no
/// new event, the conversation continues with the next turn.
async fn restart_reattaches(db: Db) {
    let w = World::new(db).await;
    let mgr = w.manager();
    let s = w.create(&mgr, "a").await;
    let token = s.resume_token.clone().unwrap();
    w.prompt(&mgr, s.id, "one").await;
    w.prompt(&mgr, s.id, "two").await;
    let before = w.record(s.id).await;
    let events_before = w.store.last_event_seq(s.id).await.unwrap();
    mgr.shutdown();
    drop(mgr);

    let mgr = w.manager();
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.total, 1);
    assert_eq!(summary.count(OutcomeLabel::Reattached), 1, "{summary:?}");
    assert_eq!(mgr.stats().agentctl_launches, 0);
    assert_eq!(mgr.stats().agent_launches, 0);
    let after = w.record(s.id).await;
    assert_eq!(after.pid, before.pid, "same agentctl process");
    assert_eq!(after.generation, before.generation);
    assert!(
        after.last_seen_at > before.last_seen_at,
        "the reattach stored a fresh last_seen_at"
    );
    assert!(is_running(after.pid.unwrap()));
    // What `sessiond serve` does before SERVING: the session's status inputs
    // come from one batched read, then from memory (and commits).
    assert_eq!(mgr.load_status_snapshot().await.unwrap(), 1);
    assert_eq!(
        mgr.load_status_snapshot().await.unwrap(),
        0,
        "entries present are kept"
    );
    assert_eq!(
        w.store.last_event_seq(s.id).await.unwrap(),
        events_before,
        "a restart that changes nothing publishes nothing"
    );
    let st = w.status(&mgr, s.id).await;
    assert_eq!(st.state, SessionState::WaitingForInput);
    assert_eq!(st.executor_status, Some(ExecutorStatus::Ready));
    assert!(st.is_agent_running);
    assert_eq!(
        w.store.get_task(w.task.id).await.unwrap().state,
        TaskState::Review
    );

    let reply = w.prompt(&mgr, s.id, "three").await;
    assert_eq!(reply, expected_reply(3, &token, "three"));
    w.finish(&mgr, &[s.id]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_reattaches_sqlite() {
    restart_reattaches(Db::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_reattaches_postgres() {
    restart_reattaches(Db::Postgres).await;
}

/// A session is in the status snapshot from its creation on, as one loaded
/// at startup is: its status (and its first turn) come from memory, with
/// no store read. Seen here through a write the manager did not make: the
/// status answered is what the manager committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_created_session_answers_its_status_from_memory() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager();
    let s = w.create(&mgr, "a").await;
    w.write_session(s.id, |stored| {
        stored.error_message = Some("written behind the manager".into());
    })
    .await;
    let st = w.status(&mgr, s.id).await;
    assert_eq!(st.state, SessionState::WaitingForInput);
    assert_eq!(
        st.error_message, None,
        "answered from the snapshot kept since the creation, not read from the store"
    );
    w.finish(&mgr, &[s.id]).await;
}

/// A restart hands nothing over for review that was not handed over
/// before: a session created and never prompted waits for input with its
/// task in progress, and its agent's relaunch and resume after a restart
/// leave the task there (no task write), as a reattach does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_leaves_a_waiting_sessions_task_as_it_was() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager();
    let s = w.create(&mgr, "a").await;
    let task_before = w.store.get_task(w.task.id).await.unwrap();
    assert_eq!(task_before.state, TaskState::InProgress);
    mgr.shutdown();
    drop(mgr);
    kill_tree(w.record(s.id).await.pid.unwrap()).await;

    let mgr = w.manager();
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::Resumed), 1, "{summary:?}");
    w.track(s.id).await;
    assert_eq!(
        w.status(&mgr, s.id).await.state,
        SessionState::WaitingForInput
    );
    let task_after = w.store.get_task(w.task.id).await.unwrap();
    assert_eq!(task_after.state, TaskState::InProgress);
    assert_eq!(task_after.updated_at, task_before.updated_at, "not written");
    w.finish(&mgr, &[s.id]).await;
}

/// ... while a recovery that brings a session to input itself (here one
/// left STARTING by a crash) hands its task over for review.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_that_brings_a_session_to_input_moves_its_task_to_review() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager();
    let s = w.create(&mgr, "a").await;
    mgr.shutdown();
    drop(mgr);
    w.write_session(s.id, |stored| stored.state = SessionState::Starting)
        .await;
    assert_eq!(
        w.store.get_task(w.task.id).await.unwrap().state,
        TaskState::InProgress
    );

    let mgr = w.manager();
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.failed, 0, "{summary:?}");
    w.track(s.id).await;
    assert_eq!(
        w.status(&mgr, s.id).await.state,
        SessionState::WaitingForInput
    );
    assert_eq!(
        w.store.get_task(w.task.id).await.unwrap().state,
        TaskState::Review
    );
    w.finish(&mgr, &[s.id]).await;
}

/// A turn starts from the status snapshot's copy of the session (no store
/// read) when it has one; a copy older than the store (a write this manager
/// did not make) fails the turn start's version check, and the turn starts
/// from the stored session instead: sent once, the other write kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_from_a_stale_status_snapshot_reads_the_session_again() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager();
    let s = w.create(&mgr, "a").await;
    let token = s.resume_token.clone().unwrap();
    w.prompt(&mgr, s.id, "one").await;
    // In the snapshot (since its creation), then changed behind it.
    w.write_session(s.id, |stored| {
        stored
            .metadata
            .insert("written_elsewhere".into(), "kept".into());
    })
    .await;

    let reply = w.prompt(&mgr, s.id, "two").await;
    assert_eq!(reply, expected_reply(2, &token, "two"));
    let after = w.store.get_session(s.id).await.unwrap();
    assert_eq!(
        after.metadata.get("written_elsewhere").map(String::as_str),
        Some("kept")
    );
    let users = w
        .messages(s.id)
        .await
        .into_iter()
        .filter(|m| m.role == sessiond_domain::MessageRole::User && m.content == "two")
        .count();
    assert_eq!(users, 1, "the turn was stored once");
    // From the snapshot again (it holds what the turn committed).
    let reply = w.prompt(&mgr, s.id, "three").await;
    assert_eq!(reply, expected_reply(3, &token, "three"));
    w.finish(&mgr, &[s.id]).await;
}

/// agentctl (and its agent) killed while the backend is down: a new
/// agentctl (generation + 1), the agent resumed from its token via
/// session/load; the conversation continues.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_agentctl_is_relaunched_and_resumed() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager();
    let s = w.create(&mgr, "a").await;
    let token = s.resume_token.clone().unwrap();
    w.prompt(&mgr, s.id, "one").await;
    w.prompt(&mgr, s.id, "two").await;
    mgr.shutdown();
    drop(mgr);
    let old = w.record(s.id).await;
    kill_tree(old.pid.unwrap()).await;

    let mgr = w.manager();
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::Resumed), 1, "{summary:?}");
    assert_eq!(mgr.stats().agentctl_launches, 1);
    assert_eq!(mgr.stats().agent_launches, 1);
    let new = w.record(s.id).await;
    w.track(s.id).await;
    assert_eq!(new.generation, old.generation + 1);
    assert_ne!(new.pid, old.pid);
    assert_eq!(new.status, ExecutorStatus::Ready);
    let st = w.status(&mgr, s.id).await;
    assert_eq!(st.state, SessionState::WaitingForInput);
    assert!(st.is_agent_running);

    let reply = w.prompt(&mgr, s.id, "three").await;
    assert_eq!(reply, expected_reply(3, &token, "three"));
    w.finish(&mgr, &[s.id]).await;
}

/// Our own agentctl hung while the backend was down (SIGSTOPped: alive,
/// pid and start time as recorded, no answer to Health): recovery ends it
/// and launches a new one (generation + 1), the agent is resumed from its
/// token and the conversation continues; the hung process is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_agentctl_is_ended_and_relaunched() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager();
    let s = w.create(&mgr, "hung").await;
    let token = s.resume_token.clone().unwrap();
    w.prompt(&mgr, s.id, "one").await;
    mgr.shutdown();
    drop(mgr);
    let old = w.record(s.id).await;
    let pid = old.pid.unwrap();
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid as i32).unwrap(),
        rustix::process::Signal::STOP,
    )
    .unwrap();

    let mgr = w.manager();
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::Resumed), 1, "{summary:?}");
    assert!(!is_running(pid), "the hung agentctl {pid} was ended");
    assert_eq!(mgr.stats().agentctl_launches, 1);
    let new = w.record(s.id).await;
    w.track(s.id).await;
    assert_eq!(new.generation, old.generation + 1);
    assert_ne!(new.pid, old.pid);
    assert_eq!(new.status, ExecutorStatus::Ready);
    let st = w.status(&mgr, s.id).await;
    assert_eq!(st.state, SessionState::WaitingForInput);
    assert!(st.is_agent_running);
    let reply = w.prompt(&mgr, s.id, "two").await;
    assert_eq!(reply, expected_reply(2, &token, "two"));
    w.finish(&mgr, &[s.id]).await;
}

/// Worktree deleted while down: executor error, session ERROR with the
/// reason, and no agentctl launched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_worktree_is_error_without_launch() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager();
    let s = w.create(&mgr, "gone").await;
    mgr.shutdown();
    drop(mgr);
    let old = w.record(s.id).await;
    kill_tree(old.pid.unwrap()).await;
    std::fs::remove_dir_all(&s.worktree.path).unwrap();

    let mgr = w.manager();
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::ExecutorError), 1, "{summary:?}");
    assert_eq!(mgr.stats().agentctl_launches, 0, "nothing launched");
    let st = w.status(&mgr, s.id).await;
    assert_eq!(st.state, SessionState::Error);
    assert_eq!(st.executor_status, Some(ExecutorStatus::Error));
    let msg = st.error_message.unwrap();
    assert!(msg.starts_with("worktree_missing:"), "{msg}");
    assert!(msg.contains(&s.worktree.path), "{msg}");
    // An explicit resume says why it cannot.
    let err = mgr.resume_session(w.task.id, s.id).await.unwrap_err();
    assert!(
        matches!(err, sessiond_engine::Error::WorktreeMissing { .. }),
        "{err}"
    );
    w.finish(&mgr, &[s.id]).await;
}

/// An agent without loadSession or session/resume (the probe lowers the
/// profile's claim): after losing the agent, the session is ERROR
/// not_resumable, while the workspace (exec, files) works through the
/// relaunched agentctl.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_without_load_session_is_not_resumable_but_workspace_works() {
    let w = World::new(Db::Sqlite).await;
    let profile = w
        .demo_profile(
            "no-load",
            &[
                ("ACP_DEMO_NO_LOAD_SESSION", "1"),
                ("ACP_DEMO_NO_RESUME_SESSION", "1"),
            ],
        )
        .await;
    let mgr = w.manager();
    let s = w.create_with(&mgr, "nl", &profile, None).await;
    assert_eq!(s.state, SessionState::WaitingForInput);
    assert!(
        !w.record(s.id).await.supports_session_resume,
        "probe lowered the claim"
    );
    let st = w.status(&mgr, s.id).await;
    assert!(!st.is_resumable);
    mgr.shutdown();
    drop(mgr);
    kill_tree(w.record(s.id).await.pid.unwrap()).await;

    let mgr = w.manager();
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::NotResumable), 1, "{summary:?}");
    assert_eq!(mgr.stats().agent_launches, 0);
    w.track(s.id).await;
    let st = w.status(&mgr, s.id).await;
    assert_eq!(st.state, SessionState::Error);
    assert_eq!(st.resume_reason.as_str(), "not_resumable");
    assert!(st.error_message.unwrap().starts_with("not_resumable:"));
    assert_eq!(st.executor_status, Some(ExecutorStatus::Ready));
    workspace_works(&w, &mgr, s.id).await;
    let err = mgr.resume_session(w.task.id, s.id).await.unwrap_err();
    assert!(
        matches!(err, sessiond_engine::Error::NotResumable { .. }),
        "{err}"
    );
    assert!(!err.to_string().contains("not_resumable:"), "{err}");
    assert_eq!(
        err.to_string().matches("create a new session").count(),
        1,
        "{err}"
    );
    w.finish(&mgr, &[s.id]).await;
}

/// The agent rejects the token (failing session/load): session ERROR with
/// the reason, executor ready, workspace usable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_token_is_error_but_workspace_usable() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager();
    let s = w.create(&mgr, "rej").await;
    w.prompt(&mgr, s.id, "one").await;
    mgr.shutdown();
    drop(mgr);
    kill_tree(w.record(s.id).await.pid.unwrap()).await;
    // While down, the agent starts failing every session/load.
    w.demo_profile("demo", &[("ACP_DEMO_FAIL_LOAD", "1")]).await;

    let mgr = w.manager();
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::ResumeFailed), 1, "{summary:?}");
    w.track(s.id).await;
    let st = w.status(&mgr, s.id).await;
    assert_eq!(st.state, SessionState::Error);
    let msg = st.error_message.unwrap();
    assert!(msg.starts_with("resume_failed:"), "{msg}");
    assert!(msg.contains("fail session/load"), "{msg}");
    assert_eq!(st.executor_status, Some(ExecutorStatus::Ready));
    assert!(!st.is_agent_running);
    workspace_works(&w, &mgr, s.id).await;
    w.finish(&mgr, &[s.id]).await;
}

/// Writes, reads and runs a command through the session's agentctl.
async fn workspace_works(
    w: &World,
    mgr: &sessiond_engine::SessionManager,
    s: sessiond_domain::SessionId,
) {
    let exec = mgr.execution(s).expect("execution cached");
    let client = w.agentctl(&exec.record);
    client
        .write_file(pb::WriteFileRequest {
            path: "note.txt".into(),
            content: b"still here".to_vec(),
            create_parents: false,
        })
        .await
        .unwrap();
    let read = client
        .read_file(pb::ReadFileRequest {
            path: "note.txt".into(),
            max_bytes: 0,
        })
        .await
        .unwrap();
    assert_eq!(read, b"still here");
    let out = client
        .exec(pb::ExecRequest {
            command: "cat".into(),
            args: vec!["note.txt".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(out.exit_code, Some(0));
    assert_eq!(out.stdout, b"still here");
}

/// Recovery of several sessions at once (bounded concurrency): prints the
/// time it took for both paths (reattach, relaunch + resume).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_of_many_sessions() {
    const N: usize = 6;
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager();
    let mut ids = Vec::new();
    for i in 0..N {
        ids.push(w.create(&mgr, &format!("m{i}")).await.id);
    }
    mgr.shutdown();
    drop(mgr);

    let mgr = w.manager();
    let started = Instant::now();
    let summary = mgr.recovery().recover_all().await.unwrap();
    eprintln!(
        "recovery of {N} live sessions (reattach): {:?}",
        started.elapsed()
    );
    assert_eq!(summary.count(OutcomeLabel::Reattached), N, "{summary:?}");
    mgr.shutdown();
    drop(mgr);

    for id in &ids {
        kill_tree(w.record(*id).await.pid.unwrap()).await;
    }
    let mgr = w.manager();
    let started = Instant::now();
    let summary = mgr.recovery().recover_all().await.unwrap();
    eprintln!(
        "recovery of {N} lost sessions (relaunch + resume): {:?}",
        started.elapsed()
    );
    assert_eq!(summary.count(OutcomeLabel::Resumed), N, "{summary:?}");
    for id in &ids {
        w.track(*id).await;
        assert!(w.status(&mgr, *id).await.is_agent_running);
    }
    w.finish(&mgr, &ids).await;
}

/// A backend killed between LaunchAgent and ResumeSession leaves agentctl
/// with an idle agent that has no conversation open (Health: READY, no ACP
/// session). Recovery must resume it on that agent (no second agent), not
/// reattach to it: a reattached session-less agent fails the next Prompt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_without_open_session_is_resumed_not_reattached() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager();
    let s = w.create(&mgr, "a").await;
    let token = s.resume_token.clone().unwrap();
    w.prompt(&mgr, s.id, "one").await;
    let record = w.record(s.id).await;
    mgr.shutdown();
    drop(mgr);

    // What the dead backend's half-done resume left: a fresh agent, no session.
    let client = w.agentctl(&record);
    client.stop_agent(Duration::from_secs(2)).await.unwrap();
    client
        .launch_agent(pb::LaunchAgentRequest {
            command: w.profile.command.clone(),
            args: w.profile.args.clone(),
            env: w.profile.env.clone().into_iter().collect(),
            profile_supports_session_resume: true,
            initialize_timeout_ms: 10_000,
            ..Default::default()
        })
        .await
        .unwrap();
    let h = client.health().await.unwrap();
    assert_eq!(h.agent_state, sessiond_executor::AgentState::Ready);
    assert!(h.acp_session_id.is_empty(), "no conversation open: {h:?}");

    let mgr = w.manager();
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::Resumed), 1, "{summary:?}");
    assert_eq!(mgr.stats().agentctl_launches, 0);
    assert_eq!(mgr.stats().agent_launches, 0, "the running agent is reused");
    let h = client.health().await.unwrap();
    assert_eq!(
        h.acp_session_id, token,
        "the session's conversation is open"
    );
    let reply = w.prompt(&mgr, s.id, "two").await;
    assert_eq!(reply, expected_reply(2, &token, "two"));
    w.finish(&mgr, &[s.id]).await;
}
