//! Moments held open with the engine's test hooks (built with the
//! `failpoints` feature), in process: what a client sees inside a window
//! that is otherwise microseconds wide.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use sessiond_domain::{EventPayload, MessageRole, SessionId, SessionState};

use crate::world::{Rt, World, new_session};

/// A session of `plan` (the world's local profile), created at once.
async fn create(
    w: &World,
    mgr: &sessiond_engine::SessionManager,
    plan: &crate::world::Plan,
) -> sessiond_domain::Session {
    mgr.create_session(new_session(
        w.task.id,
        w.local_profile.id,
        None,
        w.dir.path(),
        plan,
    ))
    .await
    .unwrap()
}

/// Holds every pump that loses its agentctl between the loss's commit and
/// its recovery until the returned sender says `true`.
fn hold_lost_agentctls(mgr: &sessiond_engine::SessionManager) -> tokio::sync::watch::Sender<bool> {
    let (release, released) = tokio::sync::watch::channel(false);
    mgr.recovery().gate_lost_agentctl(Arc::new(move || {
        let mut released = released.clone();
        async move {
            let _ = released.wait_for(|r| *r).await;
        }
        .boxed()
    }));
    release
}

/// Sends `/long story` (a reply streamed for a minute) and waits until its
/// reply began; returns the user message.
async fn long_reply_begun(
    w: &World,
    mgr: &sessiond_engine::SessionManager,
    session: SessionId,
) -> sessiond_domain::Message {
    let long = mgr
        .send_message(w.task.id, session, "/long story")
        .await
        .unwrap();
    wait_message(w, session, "the reply never began", |m| {
        m.role == MessageRole::Agent && m.seq > long.seq
    })
    .await;
    long
}

/// Waits until a message of `session` matches `found`.
async fn wait_message(
    w: &World,
    session: SessionId,
    what: &str,
    found: impl Fn(&sessiond_domain::Message) -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !w
        .store
        .list_messages(session, 0, u32::MAX)
        .await
        .unwrap()
        .iter()
        .any(&found)
    {
        assert!(Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A standalone agentctl killed mid-turn: the pump ends the turn
/// interrupted and recovers the session in the background. Held between
/// the commit that makes the interruption visible and the start of that
/// recovery, the session's status already says its agent is being
/// recovered, so a retry sent the moment a client sees the interruption
/// waits for the recovery and runs the turn again (it used to find no
/// agent and no recovery, and fail).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_agentctls_recovery_is_announced_with_the_interrupted_turn() {
    let w = World::new().await;
    let mgr = w.manager().await;
    mgr.recovery().recover_all().await.unwrap();
    let plan = w.plan("retry", Rt::Standalone).await;
    let s = create(&w, &mgr, &plan).await;
    let release = hold_lost_agentctls(&mgr);
    let long = long_reply_begun(&w, &mgr, s.id).await;
    assert!(w.kill_agentctl(&s).await, "no agentctl to kill");
    wait_message(&w, s.id, "the turn never ended interrupted", |m| {
        m.role == MessageRole::System && m.content.contains("interrupted")
    })
    .await;
    // The pump is held now: the interruption is stored, the recovery has
    // not started.
    let st = mgr.session_status(w.task.id, s.id).await.unwrap();
    assert!(
        st.recovering && st.agent_recovery.is_some(),
        "the interrupted turn is visible but no recovery is announced: {st:?}"
    );
    let retry = tokio::spawn({
        let mgr = mgr.clone();
        let (task, session) = (w.task.id, s.id);
        async move { mgr.retry_turn(task, session, None).await }
    });
    release.send_replace(true);
    let (retried, original) = retry
        .await
        .unwrap()
        .expect("the retry waits for the agent's recovery");
    assert_eq!(original, long.id);
    assert_eq!(retried.content, "/long story");
    // The recovered agent runs it.
    wait_message(&w, s.id, "the retried turn got no reply", |m| {
        m.role == MessageRole::Agent && m.seq > retried.seq
    })
    .await;
    mgr.cancel_turn(w.task.id, s.id).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while mgr.session_status(w.task.id, s.id).await.unwrap().state != SessionState::WaitingForInput
    {
        assert!(Instant::now() < deadline, "the retried turn never ended");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    w.cleanup(&mgr).await;
}

/// A remote host restarts its agentctl while the session's update pump is
/// up (its turn just ended; parking held, so the stream stays open): the new
/// agentctl runs no agent, and nothing says so (no `AgentExited`; liveness
/// skips sessions with a pump). The pump finds it at its idle check, and the
/// agent is relaunched and the conversation resumed by itself, with no
/// message sent; the next message is the conversation's second turn. It used to keep saying
/// "agent running" for as long as the pump lived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_agentctl_restarted_under_a_live_pump_gets_its_agent_back() {
    let w = World::new().await;
    let mgr = w.manager().await;
    mgr.recovery().recover_all().await.unwrap();
    mgr.hold_parking(true);
    let plan = w.plan("pumped", Rt::Remote).await;
    let host = plan.remote.clone().expect("a remote plan names its host");
    let s = create(&w, &mgr, &plan).await;
    let first = mgr.send_message(w.task.id, s.id, "one").await.unwrap();
    wait_message(&w, s.id, "the first turn got no reply", |m| {
        m.role == MessageRole::Agent && m.seq > first.seq && m.content.contains("you said \"one\"")
    })
    .await;
    wait_state(&mgr, &w, s.id, SessionState::WaitingForInput).await;
    assert!(!mgr.is_parked(s.id), "parking is held: the pump stays up");
    let before = last_seq(&w, s.id).await;
    assert!(
        w.restart_remote(&host.executor_id).await,
        "the remote host's agentctl could not be restarted"
    );
    // Restarted by itself: ERROR (the agent gone) -> STARTING -> WAITING,
    // and the status says the agent runs.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let changes: Vec<SessionState> = w
            .store
            .events_after(s.id, before, 10_000)
            .await
            .unwrap()
            .into_iter()
            .filter_map(|e| match e.payload {
                EventPayload::StateChanged { to, .. } => Some(to),
                _ => None,
            })
            .collect();
        let restarted = changes.contains(&SessionState::Starting)
            && changes.last() == Some(&SessionState::WaitingForInput);
        let st = mgr.session_status(w.task.id, s.id).await.unwrap();
        if restarted && st.state == SessionState::WaitingForInput && st.is_agent_running {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the agent was never restarted after its agentctl restarted: {changes:?} {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    mgr.hold_parking(false);
    let second = mgr.send_message(w.task.id, s.id, "two").await.unwrap();
    wait_message(&w, s.id, "the resumed conversation got no reply", |m| {
        m.role == MessageRole::Agent && m.seq > second.seq && m.content.contains("you said \"two\"")
    })
    .await;
    let msgs = w.store.list_messages(s.id, 0, u32::MAX).await.unwrap();
    let reply = msgs
        .iter()
        .rev()
        .find(|m| m.role == MessageRole::Agent)
        .unwrap();
    assert!(
        reply.content.starts_with("turn 2 "),
        "the relaunched agent resumed the conversation: {msgs:?}"
    );
    w.cleanup(&mgr).await;
}

/// The seq of the session's last event.
async fn last_seq(w: &World, s: SessionId) -> i64 {
    w.store
        .events_after(s, 0, 1_000_000)
        .await
        .unwrap()
        .last()
        .map_or(0, |e| e.seq)
}

async fn wait_state(
    mgr: &sessiond_engine::SessionManager,
    w: &World,
    s: SessionId,
    want: SessionState,
) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let st = mgr.session_status(w.task.id, s).await.unwrap();
        if st.state == want {
            return;
        }
        assert!(Instant::now() < deadline, "never {want:?}: {st:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A local agentctl that hangs mid-turn (SIGSTOP) until its stream is
/// given up: the turn is not ended interrupted, as the agent may well go
/// on. Held between the loss's commit and its recovery, the session is
/// still RUNNING its turn with no "interrupted" message; agentctl then
/// resumes (SIGCONT), the recovery reattaches it, and the reply is read
/// on past where it stood, the turn ending once (here by a cancel). It
/// used to end interrupted at the loss and throw the rest of the reply away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_local_agentctl_that_comes_back_keeps_its_turn() {
    let w = World::new().await;
    // Quick keep-alives: the stream of a stopped agentctl fails in seconds.
    let client = sessiond_executor::ClientConfig {
        keep_alive_interval: Duration::from_secs(1),
        ..crate::common::client_config()
    };
    let mgr = sessiond_engine::SessionManager::new(
        w.store.clone(),
        crate::common::local_drivers_with_client(w.dir.path(), &[], client),
        crate::world::manager_config_in(w.dir.path()),
    );
    mgr.recovery().recover_all().await.unwrap();
    let plan = w.plan("hung", Rt::Standalone).await;
    let s = create(&w, &mgr, &plan).await;
    let release = hold_lost_agentctls(&mgr);
    let long = long_reply_begun(&w, &mgr, s.id).await;
    hang_then_resume(&w, &mgr, s.id, &long, release).await;
    w.cleanup(&mgr).await;
}

/// The same hang noticed by liveness first (its `Health` times out long
/// before the stream's keep-alive): the turn is kept as well, and the
/// reply read on to its end once agentctl answers again. Found from
/// outside after the pump's path was fixed: liveness still ended the turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_local_agentctl_found_by_liveness_keeps_its_turn() {
    let w = World::new().await;
    let mgr = sessiond_engine::SessionManager::new(
        w.store.clone(),
        crate::world::drivers(w.dir.path(), None).await,
        sessiond_engine::ManagerConfig {
            liveness_interval: Some(Duration::from_millis(500)),
            ..crate::world::manager_config_in(w.dir.path())
        },
    );
    mgr.recovery().recover_all().await.unwrap();
    let plan = w.plan("hung-liveness", Rt::Standalone).await;
    let s = create(&w, &mgr, &plan).await;
    let release = hold_lost_agentctls(&mgr);
    let long = long_reply_begun(&w, &mgr, s.id).await;
    hang_then_resume(&w, &mgr, s.id, &long, release).await;
    w.cleanup(&mgr).await;
}

/// SIGSTOPs the session's local agentctl while its `/long` reply streams,
/// waits until the loss is committed (the pump or liveness held by
/// [`hold_lost_agentctls`]), checks the turn is still RUNNING with no
/// system message, SIGCONTs and releases; the reply must go on from the
/// same (reattached) agentctl, and a cancel ends the turn once.
async fn hang_then_resume(
    w: &World,
    mgr: &sessiond_engine::SessionManager,
    session: SessionId,
    long: &sessiond_domain::Message,
    release: tokio::sync::watch::Sender<bool>,
) {
    let agentctl = w
        .record(session)
        .await
        .and_then(|r| r.pid)
        .expect("a local agentctl");
    let signal = |sig| {
        rustix::process::kill_process(
            rustix::process::Pid::from_raw(agentctl as i32).unwrap(),
            sig,
        )
    };
    signal(rustix::process::Signal::STOP).unwrap();
    // The loss is committed (the executor recovering), the pump held.
    let deadline = Instant::now() + Duration::from_secs(60);
    while w.record(session).await.unwrap().status != sessiond_domain::ExecutorStatus::Error {
        assert!(
            Instant::now() < deadline,
            "the hung agentctl's stream was never given up"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let msgs = w.store.list_messages(session, 0, u32::MAX).await.unwrap();
    assert!(
        !msgs.iter().any(|m| m.role == MessageRole::System),
        "the turn was ended while its agent may go on: {msgs:?}"
    );
    let st = mgr.session_status(w.task.id, session).await.unwrap();
    assert_eq!(st.state, SessionState::Running, "{st:?}");
    let stood = msgs
        .iter()
        .rev()
        .find(|m| m.role == MessageRole::Agent)
        .unwrap()
        .content
        .len();
    signal(rustix::process::Signal::CONT).unwrap();
    release.send_replace(true);
    // Reattached (the same agentctl process), and the reply goes on.
    wait_message(
        w,
        session,
        "the reply did not go on after agentctl came back",
        |m| m.role == MessageRole::Agent && m.seq > long.seq && m.content.len() > stood + 100,
    )
    .await;
    assert_eq!(
        w.record(session).await.and_then(|r| r.pid),
        Some(agentctl),
        "reattached"
    );
    mgr.cancel_turn(w.task.id, session).await.unwrap();
    wait_state(mgr, w, session, SessionState::WaitingForInput).await;
    let notes: Vec<String> = w
        .store
        .list_messages(session, 0, u32::MAX)
        .await
        .unwrap()
        .into_iter()
        .filter(|m| m.role == MessageRole::System)
        .map(|m| m.content)
        .collect();
    assert!(
        notes.len() == 1 && notes[0].contains("cancelled"),
        "one ending, the cancel: {notes:?}"
    );
}
