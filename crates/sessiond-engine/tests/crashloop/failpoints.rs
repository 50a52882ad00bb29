//! One crash per failpoint: the child backend SIGKILLs itself at the point
//! (the test asserts it got there), a clean backend starts on the same store
//! and world, and the world must have converged (`World::assert_converged`,
//! strict: no message may be left undelivered or stored out of order), with
//! every conversation that existed before the crash continuing at the right
//! turn.
//!
//! Sessions on every runtime: standalone, remote, and Docker when enabled.

use std::time::{Duration, Instant};

use sessiond_domain::{
    ExecutorStatus, MessageId, MessageKind, MessageRole, OutcomeLabel, Runtime, Session,
    SessionState,
};
use sessiond_engine::{ErrorKind, Outgoing, Sent};

use crate::world::{Db, Mode, NAME_KEY, Rt, World};

fn name(rt: Rt) -> &'static str {
    match rt {
        Rt::Standalone => "standalone",
        Rt::Docker => "docker",
        Rt::Remote => "remote",
    }
}

/// One session per runtime, each with `messages` turns, created by a child
/// backend that is then `kill -9`ed.
async fn sessions_before_crash(w: &World, messages: usize) -> Vec<Session> {
    let mut plans = Vec::new();
    for rt in w.runtimes() {
        plans.push(w.plan(name(rt), rt).await);
    }
    let mut c = w.spawn_child("setup", Mode::Create { plans, messages }, None);
    let created = c.wait_for("CREATED", Duration::from_secs(120)).await;
    if !created {
        c.kill9();
        panic!("the setup backend created no sessions\n{}", c.log_tail());
    }
    let _ = c.kill9();
    let sessions = w.sessions().await;
    for s in &sessions {
        assert_eq!(s.state, SessionState::WaitingForInput, "{s:?}");
    }
    sessions
}

/// Clean start after the crash, then the checks against the world; returns
/// how many sessions answered a new prompt at the right turn.
async fn restart_and_check(w: &World) -> usize {
    restart_and_count(w).await.0
}

/// [`restart_and_check`], also returning how many turns ended interrupted.
async fn restart_and_count(w: &World) -> (usize, usize) {
    let mgr = w.manager().await;
    let summary = mgr.recovery().recover_all().await.unwrap();
    eprintln!("clean start: {:?}", summary.counts);
    for s in w.sessions().await {
        assert_ne!(s.state, SessionState::Starting, "left STARTING: {s:?}");
    }
    w.settle(Duration::from_secs(30)).await;
    let converged = w.converged(&mgr).await;
    let prompted = w.prompt_all(&mgr).await;
    w.assert_converged(&mgr).await;
    eprintln!(
        "converged: {}; {prompted} conversations continued",
        converged.line
    );
    w.cleanup(&mgr).await;
    (prompted, converged.interrupted)
}

/// A crash inside `create_session`, one child per runtime.
async fn crash_in_create(fp: &str) {
    let w = World::new().await;
    // One child per runtime. Each backend recovers before it creates, so
    // the session the previous one left STARTING is recovered by the next,
    // the last one by the clean start below.
    for rt in w.runtimes() {
        let plan = w.plan(name(rt), rt).await;
        let mut c = w.spawn_child(
            &format!("create-{}", name(rt)),
            Mode::Create {
                plans: vec![plan],
                messages: 1,
            },
            Some(&format!("{fp}=kill")),
        );
        let status = c.wait_exit(Duration::from_secs(90)).await;
        c.assert_killed_by_failpoint(status, fp);
        let crashed = w
            .sessions()
            .await
            .into_iter()
            .find(|s| s.worktree.id == name(rt))
            .expect("the crashed backend stored the session");
        assert_eq!(
            crashed.state,
            SessionState::Starting,
            "the crash left {crashed:?}"
        );
        let r = w.record(crashed.id).await.unwrap();
        assert_eq!(r.status, ExecutorStatus::Starting, "the intent row: {r:?}");
        if fp == "launch-after-intent" {
            assert!(
                r.pid.is_none() && r.container_id.is_none(),
                "nothing spawned was recorded: {r:?}"
            );
        }
    }
    let mgr_check = w.manager().await;
    let summary = mgr_check.recovery().recover_all().await.unwrap();
    eprintln!("clean start: {:?}", summary.counts);
    // The agent never opened a conversation: nothing was said, so recovery
    // opens one and the session comes up (never STARTING, never ERROR for
    // a restart at the wrong moment) — unless its container was never
    // created: then the executor is in error and the session ERROR.
    for s in w.sessions().await {
        let r = w.record(s.id).await.unwrap();
        if fp == "launch-after-intent" && s.runtime == Runtime::LocalDocker {
            assert_eq!(s.state, SessionState::Error, "{s:?}");
            assert_eq!(r.status, ExecutorStatus::Error, "{s:?} {r:?}");
        } else {
            assert_eq!(s.state, SessionState::WaitingForInput, "{s:?}");
            assert!(s.resume_token.is_some(), "the opened conversation: {s:?}");
            assert_eq!(r.status, ExecutorStatus::Ready, "{s:?} {r:?}");
        }
    }
    let line = w.assert_converged(&mgr_check).await;
    eprintln!("converged: {line}");
    w.cleanup(&mgr_check).await;
}

/// A crash inside startup recovery; `kill_executors`: agentctls were killed
/// (containers stopped) while the backend was down, so recovery relaunches.
async fn crash_in_recovery(fp: &str, kill_executors: bool) {
    let w = World::new().await;
    let sessions = sessions_before_crash(&w, 2).await;
    if kill_executors {
        for s in &sessions {
            w.kill_executor(s).await;
        }
    }
    let mut c = w.spawn_child("recover", Mode::Recover, Some(&format!("{fp}=kill")));
    let status = c.wait_exit(Duration::from_secs(90)).await;
    c.assert_killed_by_failpoint(status, fp);
    let prompted = restart_and_check(&w).await;
    assert_eq!(
        prompted,
        sessions.len(),
        "every conversation continues after the clean start"
    );
}

/// A crash inside a recovery a call claimed ahead of the startup pass (the
/// pass is held before it takes up anything, so every recovery running is a
/// call's): as safe as one inside the pass.
async fn crash_in_prioritised_recovery(fp: &str, kill_executors: bool) {
    let w = World::new().await;
    let sessions = sessions_before_crash(&w, 2).await;
    if kill_executors {
        for s in &sessions {
            w.kill_executor(s).await;
        }
    }
    let mut c = w.spawn_child(
        "prioritised",
        Mode::RecoverPrioritised,
        Some(&format!("{fp}=kill")),
    );
    let status = c.wait_exit(Duration::from_secs(90)).await;
    c.assert_killed_by_failpoint(status, fp);
    assert!(c.has("PRIORITISING"), "{:?}", c.lines());
    let prompted = restart_and_check(&w).await;
    assert_eq!(
        prompted,
        sessions.len(),
        "every conversation continues after the clean start"
    );
}

/// Relaunch intent written by a call's recovery (ahead of the pass),
/// nothing spawned: the next recovery launches exactly one agentctl.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn launch_after_intent_in_prioritised_recovery() {
    crash_in_prioritised_recovery("launch-after-intent", true).await;
}

/// Executor `ready` committed by a call's recovery after a relaunch, agent
/// not resumed yet: the next recovery reattaches and resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_after_ready_in_prioritised_recovery() {
    crash_in_prioritised_recovery("recovery-after-ready", true).await;
}

/// Intent row written (session STARTING, executor `starting`), nothing
/// spawned: recovery launches the one agentctl; the session, which has no
/// conversation yet, goes ERROR.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn launch_after_intent_in_create() {
    crash_in_create("launch-after-intent").await;
}

/// Relaunch intent written during recovery, nothing spawned: the next
/// recovery launches exactly one agentctl (starts the container) and resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn launch_after_intent_in_recovery() {
    crash_in_recovery("launch-after-intent", true).await;
}

/// agentctl spawned (container created and started), its pid/container not
/// saved: the next recovery ends the unrecorded agentctl (adopts the
/// container by label) so one runs per session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn launch_after_spawn_in_create() {
    crash_in_create("launch-after-spawn").await;
}

/// The same crash during a recovery relaunch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn launch_after_spawn_in_recovery() {
    crash_in_recovery("launch-after-spawn", true).await;
}

/// agentctl proved alive and ours (reattach), nothing written: the next
/// recovery reattaches to the same process, nothing is relaunched twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_after_reattach() {
    crash_in_recovery("recovery-after-reattach", false).await;
}

/// Executor `ready` committed after a relaunch, agent not resumed yet: the
/// next recovery reattaches to that agentctl and resumes the agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_after_ready_after_relaunch() {
    crash_in_recovery("recovery-after-ready", true).await;
}

/// Executor `ready` on a reattach (already `ready` as stored, so nothing is
/// rewritten before this point; its `last_seen_at` goes with the outcome),
/// outcome not written yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_after_ready_after_reattach() {
    crash_in_recovery("recovery-after-ready", false).await;
}

/// One session per runtime, each sent two messages by a child backend
/// that SIGKILLs itself at failpoint `fp` on the second message of the
/// `rt` session. Returns the world and its sessions as the crash left them.
async fn crash_at_second_message(fp: &str, rt: Rt, db: Db) -> (World, Vec<Session>) {
    let w = World::on(db).await;
    let mut plans = Vec::new();
    for rt in w.runtimes() {
        plans.push(w.plan(name(rt), rt).await);
    }
    // Each session gets two messages in turn, in the order of
    // `runtimes()`: hit 2k+2 is the second message of session k.
    let k = w.runtimes().iter().position(|r| *r == rt).unwrap();
    let mut c = w.spawn_child(
        "send",
        Mode::Create { plans, messages: 2 },
        Some(&format!("{fp}=kill@{}", 2 * k + 2)),
    );
    let status = c.wait_exit(Duration::from_secs(120)).await;
    c.assert_killed_by_failpoint(status, fp);
    let sessions = w.sessions().await;
    assert_eq!(sessions.len(), w.runtimes().len());
    (w, sessions)
}

/// The backend dies after committing a user message (session RUNNING) and
/// before its Prompt; `kill_executors`: agentctls are killed too (containers
/// stopped) while it is down. After the restart the message is delivered
/// and answered exactly once: the reattached agentctl, or the relaunched one
/// with the conversation loaded, gets the Prompt with the same turn id.
async fn crash_between_commit_and_prompt(kill_executors: bool, rt: Rt) {
    let (w, sessions) = crash_at_second_message("prompt-after-commit", rt, Db::from_env()).await;
    let pending: Vec<&Session> = sessions
        .iter()
        .filter(|s| s.state == SessionState::Running)
        .collect();
    assert_eq!(
        pending.len(),
        1,
        "one message was stored, not sent: {sessions:?}"
    );
    let p = pending[0];
    assert_eq!(p.runtime, rt.runtime(), "{p:?}");
    let mut msgs = w.store.list_messages(p.id, 0, 1000).await.unwrap();
    msgs.retain(|m| m.kind == sessiond_domain::MessageKind::Text);
    assert_eq!(msgs.len(), 3, "message 1, its reply, message 2: {msgs:?}");
    assert_eq!(w.transcript(p).len(), 1, "the agent never got message 2");
    if kill_executors {
        for s in &sessions {
            w.kill_executor(s).await;
        }
    }
    let (prompted, interrupted) = restart_and_count(&w).await;
    assert_eq!(
        prompted,
        sessions.len(),
        "every conversation continues after the clean start"
    );
    // The Prompt provably never reached agentctl (its journal does not
    // know the turn; on a remote host, the agentctl known alive before it
    // still answers): delivered, not interrupted.
    assert_eq!(
        interrupted, 0,
        "a turn that never reached agentctl was interrupted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_after_commit() {
    crash_between_commit_and_prompt(false, Rt::Standalone).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_after_commit_executors_killed() {
    crash_between_commit_and_prompt(true, Rt::Standalone).await;
}

/// The pending turn is the remote session's, whose agentctl created its
/// journal at its start (fresh) and still runs: that journal alone proves
/// the turn never reached it, so it is delivered once, not interrupted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_after_commit_remote() {
    crash_between_commit_and_prompt(false, Rt::Remote).await;
}

/// The backend dies after agentctl took a message's Prompt and before the
/// turn's commit (the two run together); `kill_executors`: agentctls are
/// killed too while it is down. The agent got the message (agentctl
/// journaled it first), the store did not: after the restart the turn is
/// recorded from agentctl's stream (`TurnStarted`) once, with its reply
/// when agentctl lived, or ended interrupted when its agentctl died with
/// the turn's end; the converged check finds every turn the agent ran
/// stored once, and nothing run twice.
async fn crash_between_prompt_and_commit(kill_executors: bool, rt: Rt, db: Db) {
    let (w, sessions) = crash_at_second_message("prompt-before-commit", rt, db).await;
    let p = sessions
        .iter()
        .find(|s| s.runtime == rt.runtime())
        .expect("the crashed session");
    assert_eq!(
        p.state,
        SessionState::WaitingForInput,
        "nothing stored: {p:?}"
    );
    let mut msgs = w.store.list_messages(p.id, 0, 1000).await.unwrap();
    msgs.retain(|m| m.kind == sessiond_domain::MessageKind::Text);
    assert_eq!(msgs.len(), 2, "message 1 and its reply only: {msgs:?}");
    if kill_executors {
        // Once the agent has the message (agentctl handed it over).
        let got_it = async {
            while w.transcript(p).len() < 2 {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(60), got_it)
            .await
            .expect("the agent got message 2");
        for s in &sessions {
            w.kill_executor(s).await;
        }
    }
    let (prompted, interrupted) = restart_and_count(&w).await;
    assert_eq!(
        prompted,
        sessions.len(),
        "every conversation continues after the clean start"
    );
    let mut msgs = w.store.list_messages(p.id, 0, 1000).await.unwrap();
    msgs.retain(|m| m.kind == sessiond_domain::MessageKind::Text);
    let users = msgs
        .iter()
        .filter(|m| m.role == sessiond_domain::MessageRole::User)
        .count();
    assert_eq!(
        users, 3,
        "message 2 recorded once, then the new one: {msgs:?}"
    );
    if !kill_executors {
        assert_eq!(interrupted, 0, "agentctl kept the whole turn: {msgs:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_before_commit() {
    crash_between_prompt_and_commit(false, Rt::Standalone, Db::from_env()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_before_commit_executors_killed() {
    crash_between_prompt_and_commit(true, Rt::Standalone, Db::from_env()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_before_commit_remote() {
    crash_between_prompt_and_commit(false, Rt::Remote, Db::from_env()).await;
}

/// The same on PostgreSQL, whatever `SESSIOND_CRASHLOOP_STORE` says: the
/// turn's commit and the reply's first chunk (one statement there) are
/// other statements than on SQLite.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_before_commit_postgres() {
    crash_between_prompt_and_commit(false, Rt::Standalone, Db::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_before_commit_executors_killed_postgres() {
    crash_between_prompt_and_commit(true, Rt::Standalone, Db::Postgres).await;
}

/// The backend dies between message 2's Prompt and its commit: its client
/// never had an answer, and sends it again with its request id once the
/// backend is back. The answer is the turn the agent ran (the same message
/// id), and the agent ran it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_before_commit_then_the_same_request() {
    let rt = Rt::Standalone;
    let (w, sessions) = crash_at_second_message("prompt-before-commit", rt, Db::from_env()).await;
    let p = sessions
        .iter()
        .find(|s| s.runtime == rt.runtime())
        .expect("the crashed session");
    // The crashed child keyed each message by its text.
    let key = format!("{} message 2", p.metadata[NAME_KEY]);
    let mgr = w.manager().await;
    mgr.recovery().recover_all().await.unwrap();
    let again = || Outgoing {
        text: key.clone(),
        request_id: Some(key.clone()),
        ..Outgoing::default()
    };
    // UNAVAILABLE while the pump records the turn recovery found at
    // agentctl only; the same request is safe to send again.
    let deadline = Instant::now() + Duration::from_secs(60);
    let sent = loop {
        match mgr.send_outgoing(w.task.id, p.id, again()).await {
            Ok(sent) => break sent,
            Err(e) if e.kind() == ErrorKind::Unavailable && Instant::now() < deadline => {
                eprintln!("sent again: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("sending message 2 again: {e}"),
        }
    };
    let Sent::Started(m) = sent else {
        panic!("message 2 was queued instead of found: {sent:?}");
    };
    assert_eq!(m.id, MessageId::for_request(p.id, &key), "{m:?}");
    assert_eq!(m.content, key);
    w.settle(Duration::from_secs(30)).await;
    let session = w.store.get_session(p.id).await.unwrap();
    let ran: Vec<_> = w
        .transcript(&session)
        .into_iter()
        .filter(|(prompt, _)| *prompt == key)
        .collect();
    assert_eq!(ran.len(), 1, "the agent ran message 2 once: {ran:?}");
    let users: Vec<String> = w
        .store
        .list_messages(p.id, 0, 1000)
        .await
        .unwrap()
        .into_iter()
        .filter(|m| m.role == MessageRole::User && m.kind == MessageKind::Text)
        .map(|m| m.content)
        .collect();
    assert_eq!(users.iter().filter(|u| **u == key).count(), 1, "{users:?}");
    assert_eq!(users.len(), 2, "message 1 and message 2 only: {users:?}");
    w.assert_converged(&mgr).await;
    w.cleanup(&mgr).await;
}

/// The agent opened the conversation (agentctl holds its id), the backend
/// died before storing it as the session's resume token: the next recovery
/// adopts agentctl's conversation as the token, so the session is not left
/// WAITING_FOR_INPUT without one (a session that could never be resumed,
/// and whose agent transcript nobody could name).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_after_conversation() {
    let fp = "create-after-conversation";
    let w = World::new().await;
    for rt in w.runtimes() {
        let plan = w.plan(name(rt), rt).await;
        let mut c = w.spawn_child(
            &format!("create-{}", name(rt)),
            Mode::Create {
                plans: vec![plan],
                messages: 1,
            },
            Some(&format!("{fp}=kill")),
        );
        let status = c.wait_exit(Duration::from_secs(90)).await;
        c.assert_killed_by_failpoint(status, fp);
        let crashed = w
            .sessions()
            .await
            .into_iter()
            .find(|s| s.worktree.id == name(rt))
            .expect("the crashed backend stored the session");
        assert_eq!(crashed.state, SessionState::Starting, "{crashed:?}");
        assert_eq!(crashed.resume_token, None, "{crashed:?}");
    }
    let mgr = w.manager().await;
    let summary = mgr.recovery().recover_all().await.unwrap();
    eprintln!("clean start: {:?}", summary.counts);
    for s in w.sessions().await {
        assert_eq!(s.state, SessionState::WaitingForInput, "{s:?}");
        let token = s
            .resume_token
            .clone()
            .unwrap_or_else(|| panic!("no resume token adopted: {s:?}"));
        let r = w.record(s.id).await.unwrap();
        assert_eq!(r.status, ExecutorStatus::Ready, "{r:?}");
        assert_eq!(r.resume_token.as_deref(), Some(token.as_str()), "{r:?}");
        let status = mgr.session_status(w.task.id, s.id).await.unwrap();
        assert!(status.is_agent_running, "{status:?}");
    }
    let line = w.assert_converged(&mgr).await;
    let prompted = w.prompt_all(&mgr).await;
    w.assert_converged(&mgr).await;
    assert_eq!(
        prompted,
        w.runtimes().len(),
        "every conversation takes its first turn in the conversation it opened"
    );
    eprintln!("converged: {line}; {prompted} conversations continued");
    w.cleanup(&mgr).await;
}

/// A remote session's turn cut with the backend (its reply's first part
/// stored, incomplete), its host down while the backend is down and staying
/// down until recovery gives it up: the failure the 45 s crash loop hit once
/// (seed 1796148656580911481: a RUNNING turn left neither completed nor
/// interrupted, its executor `error` and skipped by every later start).
/// `window`: the remote reconnect window of the clean start. Zero: the
/// startup pass itself finds the host unreachable past its window and fails
/// the executor. A few seconds: the pass keeps the turn pending (executor
/// `error` with `reconnecting:`, session RUNNING) and the background
/// reconnect gives the host up when the window closes. Either way the turn
/// ends interrupted (the system message, the partial reply marked, no turn
/// left in the session's metadata) in the commit that fails the executor,
/// and once the host is back a resume continues the conversation.
async fn remote_turn_cut_host_given_up(window: Duration) {
    let w = World::new().await;
    let plan = w.plan(name(Rt::Remote), Rt::Remote).await;
    let executor_id = plan.remote.as_ref().unwrap().executor_id.clone();
    // Hit 1: the first reply's first chunk; hit 2: the second one's.
    let mut c = w.spawn_child(
        "turn",
        Mode::Create {
            plans: vec![plan],
            messages: 2,
        },
        Some("reply-after-first-chunk=kill@2"),
    );
    let status = c.wait_exit(Duration::from_secs(120)).await;
    c.assert_killed_by_failpoint(status, "reply-after-first-chunk");
    let s = w.sessions().await.pop().expect("the session");
    assert_eq!(s.state, SessionState::Running, "{s:?}");
    assert!(s.metadata.contains_key("turn_id"), "{s:?}");
    let partial = w
        .store
        .list_messages(s.id, 0, 1000)
        .await
        .unwrap()
        .into_iter()
        .rfind(|m| m.kind == sessiond_domain::MessageKind::Text)
        .unwrap();
    assert!(
        partial.role == sessiond_domain::MessageRole::Agent && !partial.complete,
        "the second reply's first part, incomplete: {partial:?}"
    );

    // The host goes down with the backend and stays down.
    assert!(w.stop_remote(&executor_id));
    let config = sessiond_engine::ManagerConfig {
        remote_retry_window: window,
        ..crate::world::manager_config_in(w.dir.path())
    };
    let mgr = sessiond_engine::SessionManager::new(
        w.store.clone(),
        crate::world::drivers(w.dir.path(), w.docker_host()).await,
        config,
    );
    let summary = mgr.recovery().recover_all().await.unwrap();
    eprintln!("clean start, host down: {:?}", summary.counts);
    if window.is_zero() {
        assert_eq!(summary.count(OutcomeLabel::ExecutorError), 1, "{summary:?}");
    } else {
        assert_eq!(summary.count(OutcomeLabel::Retrying), 1, "{summary:?}");
        // Inside the window the turn stays pending for the reconnect.
        let s = w.store.get_session(s.id).await.unwrap();
        assert_eq!(s.state, SessionState::Running, "{s:?}");
        let r = w.record(s.id).await.unwrap();
        assert!(
            r.status == ExecutorStatus::Error
                && r.error_message
                    .as_deref()
                    .is_some_and(|m| m.starts_with("reconnecting:")),
            "{r:?}"
        );
        // The background reconnect gives the host up once the window closes.
        let deadline = std::time::Instant::now() + window + Duration::from_secs(60);
        loop {
            let r = w.record(s.id).await.unwrap();
            if !r
                .error_message
                .as_deref()
                .is_some_and(|m| m.starts_with("reconnecting:"))
            {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the reconnect never gave the host up: {r:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let s = w.store.get_session(s.id).await.unwrap();
    let r = w.record(s.id).await.unwrap();
    assert_eq!(r.status, ExecutorStatus::Error, "{r:?}");
    assert_eq!(s.state, SessionState::Error, "{s:?}");
    assert!(
        !s.metadata.contains_key("turn_id"),
        "the turn is left pending in a session that is no longer RUNNING: {s:?}"
    );
    let msgs = w.store.list_messages(s.id, 0, 1000).await.unwrap();
    let told = msgs.iter().any(|m| {
        m.role == sessiond_domain::MessageRole::System
            && m.seq > partial.seq
            && m.content.starts_with("the turn was interrupted")
    });
    assert!(told, "no message says the turn was interrupted: {msgs:?}");

    // The host is back (the world checks expect its agentctl): an explicit
    // resume, and the conversation goes on.
    assert!(w.start_remote_again(&executor_id).await);
    let converged = w.converged(&mgr).await;
    assert_eq!(converged.interrupted, 1, "{}", converged.line);
    let st = mgr.resume_session(w.task.id, s.id).await.unwrap();
    assert!(st.is_agent_running, "{st:?}");
    let prompted = w.prompt_all(&mgr).await;
    assert_eq!(prompted, 1, "the conversation continues after the resume");
    let line = w.assert_converged(&mgr).await;
    eprintln!("converged: {line}");
    w.cleanup(&mgr).await;
}

/// [`remote_turn_cut_host_given_up`]: the startup pass gives the host up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reply_after_first_chunk_remote_host_gone() {
    remote_turn_cut_host_given_up(Duration::ZERO).await;
}

/// [`remote_turn_cut_host_given_up`]: the background reconnect gives it up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reply_after_first_chunk_remote_reconnect_gives_up() {
    remote_turn_cut_host_given_up(Duration::from_secs(3)).await;
}

/// An explicit resume of a RUNNING remote session (its host down, the turn
/// pending for the reconnect) dies right after its intent: the session is
/// STARTING with the turn kept. The next recovery, the host back, brings
/// the agent back and must settle that turn (RUNNING again, its pump
/// decides: interrupted here, the earlier agentctl process had it), not
/// resume the session to WAITING_FOR_INPUT with the turn left unsettled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_after_intent_of_a_running_remote_session() {
    let w = World::new().await;
    let plan = w.plan(name(Rt::Remote), Rt::Remote).await;
    let executor_id = plan.remote.as_ref().unwrap().executor_id.clone();
    let mut c = w.spawn_child(
        "turn",
        Mode::Create {
            plans: vec![plan],
            messages: 2,
        },
        Some("reply-after-first-chunk=kill@2"),
    );
    let status = c.wait_exit(Duration::from_secs(120)).await;
    c.assert_killed_by_failpoint(status, "reply-after-first-chunk");
    assert!(w.stop_remote(&executor_id));
    let mut c = w.spawn_child("resume", Mode::Resume, Some("resume-after-intent=kill"));
    let status = c.wait_exit(Duration::from_secs(120)).await;
    c.assert_killed_by_failpoint(status, "resume-after-intent");
    let s = w.sessions().await.pop().expect("the session");
    assert_eq!(s.state, SessionState::Starting, "{s:?}");
    assert!(s.metadata.contains_key("turn_id"), "{s:?}");
    assert!(w.start_remote_again(&executor_id).await);
    let (prompted, interrupted) = restart_and_count(&w).await;
    assert_eq!(prompted, 1, "the conversation continues");
    assert_eq!(interrupted, 1, "the cut turn ends interrupted");
}

/// The backend dies right after `git worktree add`, before the session says
/// its worktree was made: the next start adopts the directory on its
/// branch (no second worktree, no orphan, nothing tripping a later create)
/// and the session comes up in it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_after_worktree() {
    let fp = "create-after-worktree";
    let w = World::new().await;
    let plan = w.plan("standalone", Rt::Standalone).await;
    let mut c = w.spawn_child(
        "create-standalone",
        Mode::Create {
            plans: vec![plan],
            messages: 1,
        },
        Some(&format!("{fp}=kill")),
    );
    let status = c.wait_exit(Duration::from_secs(90)).await;
    c.assert_killed_by_failpoint(status, fp);
    let crashed = w
        .sessions()
        .await
        .into_iter()
        .find(|s| s.worktree.id == "standalone")
        .expect("the crashed backend stored the session");
    assert_eq!(crashed.state, SessionState::Starting, "{crashed:?}");
    assert!(
        !crashed.metadata.contains_key("worktree_created"),
        "the crash came before it was recorded: {crashed:?}"
    );
    let path = std::path::PathBuf::from(&crashed.worktree.path);
    assert!(path.is_dir(), "git made the worktree: {crashed:?}");
    assert_eq!(
        crate::world::listed_worktrees(w.dir.path()),
        [(
            crashed.worktree.path.clone(),
            crashed.worktree.branch.clone()
        )]
    );

    let mgr = w.manager().await;
    let summary = mgr.recovery().recover_all().await.unwrap();
    eprintln!("clean start: {:?}", summary.counts);
    let s = w.store.get_session(crashed.id).await.unwrap();
    assert_eq!(s.state, SessionState::WaitingForInput, "{s:?}");
    assert_eq!(s.worktree, crashed.worktree, "the same worktree, adopted");
    assert_eq!(
        s.metadata.get("worktree_created").map(String::as_str),
        Some("true"),
        "recorded now: a branch lost later is named, not made up from the base"
    );
    let line = w.assert_converged(&mgr).await;
    let prompted = w.prompt_all(&mgr).await;
    assert_eq!(prompted, 1);
    w.assert_converged(&mgr).await;
    eprintln!("converged: {line}");
    w.cleanup(&mgr).await;
}

/// The backend dies after the session's intent is stored and before git
/// made anything: the next start makes the worktree from the base (the
/// branch never existed, so nothing is reported lost) and records it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_before_worktree() {
    let fp = "create-before-worktree";
    let w = World::new().await;
    let plan = w.plan("standalone", Rt::Standalone).await;
    let mut c = w.spawn_child(
        "create-standalone",
        Mode::Create {
            plans: vec![plan],
            messages: 1,
        },
        Some(&format!("{fp}=kill")),
    );
    let status = c.wait_exit(Duration::from_secs(90)).await;
    c.assert_killed_by_failpoint(status, fp);
    let crashed = w
        .sessions()
        .await
        .into_iter()
        .find(|s| s.worktree.id == "standalone")
        .expect("the crashed backend stored the session");
    assert_eq!(crashed.state, SessionState::Starting, "{crashed:?}");
    assert!(!crashed.worktree.branch.is_empty() && !crashed.worktree.path.is_empty());
    assert!(
        !std::path::Path::new(&crashed.worktree.path).exists(),
        "git made nothing"
    );
    assert!(crate::world::listed_worktrees(w.dir.path()).is_empty());

    let mgr = w.manager().await;
    let summary = mgr.recovery().recover_all().await.unwrap();
    eprintln!("clean start: {:?}", summary.counts);
    let s = w.store.get_session(crashed.id).await.unwrap();
    assert_eq!(s.state, SessionState::WaitingForInput, "{s:?}");
    assert_eq!(s.worktree, crashed.worktree, "made where the intent said");
    assert_eq!(
        s.metadata.get("worktree_created").map(String::as_str),
        Some("true"),
        "{s:?}"
    );
    let line = w.assert_converged(&mgr).await;
    assert_eq!(w.prompt_all(&mgr).await, 1);
    w.assert_converged(&mgr).await;
    eprintln!("converged: {line}");
    w.cleanup(&mgr).await;
}

/// An explicit resume of a session whose executor failed for good (here a
/// remote host found unreachable after its window closed, so nothing
/// retries it in the background) dies right after its intent: the session
/// is STARTING, its executor still `error`. The next start must finish that
/// resume (the host is back: the conversation continues), never leave the
/// session STARTING because its executor's failure alone would not be
/// taken up again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_after_intent_of_a_failed_executor() {
    let w = World::new().await;
    let plan = w.plan(name(Rt::Remote), Rt::Remote).await;
    let executor_id = plan.remote.as_ref().unwrap().executor_id.clone();
    let mut c = w.spawn_child(
        "create",
        Mode::Create {
            plans: vec![plan],
            messages: 1,
        },
        None,
    );
    assert!(
        c.wait_for("CREATED", Duration::from_secs(120)).await,
        "the session was created: {:?}",
        c.lines()
    );
    let _ = c.kill9();
    assert!(w.stop_remote(&executor_id));
    // Failed for good, as a recovery past the host's window leaves it.
    let s = w.sessions().await.pop().expect("the session");
    let mut r = w.record(s.id).await.expect("its executor");
    r.status = ExecutorStatus::Error;
    r.error_message = Some(
        sessiond_domain::RecoveryFailure::HostUnreachable {
            url: r.agentctl_url.clone().unwrap_or_default(),
            reason: "the test says so".into(),
        }
        .message(),
    );
    w.store
        .commit(sessiond_store::Changeset::new().update_executor(r))
        .await
        .unwrap();
    assert!(w.start_remote_again(&executor_id).await);
    let mut c = w.spawn_child("resume", Mode::Resume, Some("resume-after-intent=kill"));
    let status = c.wait_exit(Duration::from_secs(120)).await;
    c.assert_killed_by_failpoint(status, "resume-after-intent");
    let s = w.sessions().await.pop().expect("the session");
    assert_eq!(s.state, SessionState::Starting, "{s:?}");
    assert_eq!(
        w.record(s.id).await.map(|r| r.status),
        Some(ExecutorStatus::Error),
        "the intent touches only the session"
    );
    let (prompted, _) = restart_and_count(&w).await;
    assert_eq!(
        prompted, 1,
        "the resume was finished: the conversation continues"
    );
}

/// An idle agent exits by itself (agentctl alive): its exit's commit holds
/// the restart's intent (ERROR, then STARTING) before the restart runs. A
/// backend killed right there leaves the session STARTING, and the next
/// start resumes it: the agent is back and the conversation goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_restart_after_intent() {
    let w = World::new().await;
    let sessions = sessions_before_crash(&w, 1).await;
    let mut c = w.spawn_child(
        "restart",
        Mode::Recover,
        Some("agent-restart-after-intent=kill"),
    );
    if !c.wait_for("RECOVERED", Duration::from_secs(120)).await {
        c.kill9();
        panic!("the backend did not recover\n{}", c.log_tail());
    }
    let s = sessions
        .iter()
        .find(|s| s.runtime == Runtime::LocalStandalone)
        .unwrap();
    let agentctl = w.record(s.id).await.unwrap().pid.unwrap();
    let agents = crate::world::children_of(agentctl);
    assert!(!agents.is_empty(), "no agent under agentctl {agentctl}");
    for pid in agents {
        crate::world::kill9(pid);
    }
    let status = c.wait_exit(Duration::from_secs(60)).await;
    c.assert_killed_by_failpoint(status, "agent-restart-after-intent");
    let stored = w.store.get_session(s.id).await.unwrap();
    assert_eq!(stored.state, SessionState::Starting, "{stored:?}");
    assert_eq!(
        restart_and_check(&w).await,
        sessions.len(),
        "every conversation continues, the restarted one included"
    );
}
