//! Recovery with agents that behave like real ones: seconds to start, CPU
//! while they do, on a host kept busy. A deadline bounds silence, not
//! work; launches are admitted at the rate the host carries; what can pass
//! by itself is retried, never ERROR.

use std::{
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use sessiond_domain::{
    EventPayload, ExecutorStatus, MessageRole, OutcomeLabel, RecoveryStage, SessionId, SessionState,
};
use sessiond_engine::ManagerConfig;

use crate::support::{Db, World, children_of, demo_agents_under, expected_reply, kill_tree, kill9};

/// How many heavy sessions the burst test recovers (16 in CI; more with
/// `SESSIOND_HEAVY_SESSIONS`).
fn heavy_sessions() -> usize {
    std::env::var("SESSIOND_HEAVY_SESSIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16)
}

/// The demo agent's heavy mode: it sleeps, then burns CPU, before it
/// answers `initialize` (≥ 2 s to relaunch on an idle machine), and its
/// `session/load` takes longer the longer the history is.
const HEAVY: &[(&str, &str)] = &[
    ("ACP_DEMO_STARTUP_MS", "1500"),
    ("ACP_DEMO_BUSY_MS", "600"),
    ("ACP_DEMO_LOAD_MS_PER_MESSAGE", "20"),
];

/// Busy loops, one per core we want to take, ended by pid on drop.
struct Load(Vec<Child>);

impl Load {
    fn start(n: usize) -> Load {
        Load(
            (0..n)
                .map(|_| {
                    Command::new("sh")
                        .args(["-c", "while :; do :; done"])
                        .stdin(Stdio::null())
                        .spawn()
                        .expect("a busy loop")
                })
                .collect(),
        )
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The default recovery settings (the 5 s silence limit, retries, the
/// launch scheduler from the core count), with the test world's stop grace.
fn defaults() -> ManagerConfig {
    ManagerConfig {
        agent_stop_grace: Duration::from_secs(2),
        ..ManagerConfig::default()
    }
}

/// [`defaults`] for an agent held at its start gate: the gated start is
/// silent, and is never cut while a test runs (a wait for it would wait for
/// this deadline at least).
fn patient() -> ManagerConfig {
    ManagerConfig {
        executor_deadline: Duration::from_secs(120),
        ..defaults()
    }
}

/// The startup pass of `mgr`, run in the background; announced first, as
/// `sessiond serve` does before it serves, so that no call slips in before
/// the pass has loaded what it recovers.
fn pass_in_background(
    mgr: &sessiond_engine::SessionManager,
) -> tokio::task::JoinHandle<sessiond_engine::Result<sessiond_engine::RecoverySummary>> {
    mgr.recovery().expect_startup_recovery();
    let mgr = mgr.clone();
    tokio::spawn(async move { mgr.recovery().recover_all().await })
}

/// Heavy agents (each ≥ 2 s to relaunch) on a machine kept busy by two busy
/// loops: after `kill -9` of everything, every session comes back by
/// itself (no call), none is ERROR, the workspaces are back (and the
/// manager serving) before the agents are, and each conversation goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_agents_come_back_by_themselves_on_a_busy_host() {
    let n = heavy_sessions();
    let w = World::new(Db::Sqlite).await;
    let profile = w.demo_profile("heavy", HEAVY).await;
    let mgr = w.manager_with(defaults());
    let names: Vec<String> = (0..n).map(|i| format!("h{i}")).collect();
    let created = futures::future::join_all(
        names
            .iter()
            .map(|name| w.create_with(&mgr, name, &profile, None)),
    )
    .await;
    let ids: Vec<SessionId> = created.iter().map(|s| s.id).collect();
    futures::future::join_all(ids.iter().map(|id| w.prompt(&mgr, *id, "one"))).await;
    mgr.shutdown();
    drop(mgr);
    for id in &ids {
        kill_tree(w.record(*id).await.pid.unwrap()).await;
    }

    let load = Load::start(2);
    let mgr = w.manager_with(defaults());
    let started = Instant::now();
    let pass = pass_in_background(&mgr);
    // Serving once every workspace is back, while agents still relaunch:
    // their sessions say where they stand, their workspaces are usable.
    mgr.recovery().wait_workspaces_recovered().await;
    let serving_after = started.elapsed();
    let mut relaunching = 0;
    for id in &ids {
        let st = w.status(&mgr, *id).await;
        assert_ne!(st.state, SessionState::Error, "{st:?}");
        if let Some(r) = &st.agent_recovery {
            relaunching += 1;
            assert!(st.recovering && !st.needs_resume, "{st:?}");
            assert_eq!(st.executor_status, Some(ExecutorStatus::Ready), "{st:?}");
            if r.stage == RecoveryStage::Queued {
                let (place, of) = r.place.expect("a queued launch has a place");
                assert!(place >= 1 && place <= of, "{r:?}");
            }
        }
    }
    assert!(
        relaunching > 0,
        "serving came after every agent was back ({serving_after:?}): nothing was relaunching"
    );
    let summary = pass.await.unwrap().unwrap();
    let took = started.elapsed();
    drop(load);
    eprintln!(
        "{n} heavy agents on a busy host: serving after {serving_after:?} ({relaunching} still \
         relaunching then), all back after {took:?}; counts {:?}",
        summary.counts
    );
    assert_eq!(summary.count(OutcomeLabel::Resumed), n, "{summary:?}");
    assert_eq!((summary.failed, summary.not_back), (0, 0), "{summary:?}");
    for (i, id) in ids.iter().enumerate() {
        w.track(*id).await;
        let st = w.status(&mgr, *id).await;
        assert_eq!(st.state, SessionState::WaitingForInput, "{st:?}");
        assert!(st.is_agent_running && !st.recovering, "{st:?}");
        assert!(st.agent_recovery.is_none(), "{st:?}");
        let token = created[i].resume_token.clone().unwrap();
        let reply = w.prompt(&mgr, *id, "two").await;
        assert_eq!(reply, expected_reply(2, &token, "two"));
    }
    w.finish(&mgr, &ids).await;
}

/// An agent that says nothing and uses no CPU (held before `initialize`
/// by its start gate) is cut after the silence limit, and the attempt is
/// retried in the background, the status saying so, the session never
/// ERROR meanwhile; once the gate opens, the next attempt brings it back.
/// A gate that never opens ends, after `max_attempts`, in ERROR
/// `attempts_exhausted` naming why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_agent_is_cut_retried_and_comes_back_or_fails_after_its_attempts() {
    let w = World::new(Db::Sqlite).await;
    let (profile_a, gate_a) = w.gated_profile("gated-a").await;
    let (profile_b, gate_b) = w.gated_profile("gated-b").await;
    let config = ManagerConfig {
        executor_deadline: Duration::from_millis(1500),
        max_attempts: 3,
        retry_backoff: sessiond_executor::Backoff {
            initial: Duration::from_millis(300),
            max: Duration::from_millis(600),
        },
        ..defaults()
    };
    let mgr = w.manager_with(config.clone());
    let comes_back = w.create_with(&mgr, "back", &profile_a, None).await;
    let gives_up = w.create_with(&mgr, "gives-up", &profile_b, None).await;
    let token = comes_back.resume_token.clone().unwrap();
    w.prompt(&mgr, comes_back.id, "one").await;
    w.prompt(&mgr, gives_up.id, "one").await;
    mgr.shutdown();
    drop(mgr);
    for s in [&comes_back, &gives_up] {
        kill_tree(w.record(s.id).await.pid.unwrap()).await;
    }

    std::fs::write(&gate_a, b"closed").unwrap();
    std::fs::write(&gate_b, b"closed").unwrap();
    let mgr = w.manager_with(config);
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::Retrying), 2, "{summary:?}");
    assert_eq!(summary.not_back, 2, "{summary:?}");
    // Between attempts: recovering, with why the last attempt broke off;
    // the workspace up and the session as it was.
    let st = w.status(&mgr, comes_back.id).await;
    assert_eq!(st.state, SessionState::WaitingForInput, "{st:?}");
    assert_eq!(st.executor_status, Some(ExecutorStatus::Ready), "{st:?}");
    assert!(st.recovering && !st.needs_resume, "{st:?}");
    let r = st.agent_recovery.clone().expect("recovering");
    assert!(r.attempt >= 2 && r.max_attempts == 3, "{r:?}");
    assert!(
        r.last_error
            .as_deref()
            .is_some_and(|e| e.contains("no sign of life")),
        "{r:?}"
    );

    // The gate of one opens while it is retried: it comes back by itself.
    // The other's never does: ERROR after its third attempt, naming why.
    std::fs::remove_file(&gate_a).unwrap();
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let back = w.status(&mgr, comes_back.id).await;
        let other = w.status(&mgr, gives_up.id).await;
        assert_ne!(back.state, SessionState::Error, "{back:?}");
        // An ERROR ends the recovery: never shown together with progress.
        assert!(
            other.state != SessionState::Error || other.agent_recovery.is_none(),
            "{other:?}"
        );
        if back.is_agent_running
            && back.agent_recovery.is_none()
            && other.state == SessionState::Error
        {
            let why = other.error_message.unwrap_or_default();
            assert!(
                why.starts_with("attempts_exhausted:") && why.contains("3 attempts"),
                "{why}"
            );
            assert_eq!(
                other.executor_status,
                Some(ExecutorStatus::Ready),
                "workspace kept"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not settled: {back:?} / {other:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    w.track(comes_back.id).await;
    let reply = w.prompt(&mgr, comes_back.id, "two").await;
    assert_eq!(reply, expected_reply(2, &token, "two"));
    std::fs::remove_file(&gate_b).unwrap();
    w.finish(&mgr, &[comes_back.id, gives_up.id]).await;
}

/// An agent that starts silently (no output, no CPU: blocked on the
/// network while it starts, say) for longer than the silence limit, which
/// its create allowed: each attempt of a recovery waits twice as long as
/// the one before, so a restart brings it back by itself (it used to be cut
/// the same way at every attempt, then ERROR `attempts_exhausted`). An
/// explicit resume, which a user waits on, waits as long as a create.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_silent_at_start_longer_than_the_limit_comes_back_at_a_later_attempt() {
    let w = World::new(Db::Sqlite).await;
    let profile = w
        .demo_profile("silent-start", &[("ACP_DEMO_STARTUP_MS", "3000")])
        .await;
    // Silence limits of the attempts: 2, 4 and 8 s.
    let config = ManagerConfig {
        executor_deadline: Duration::from_secs(2),
        max_attempts: 3,
        retry_backoff: sessiond_executor::Backoff {
            initial: Duration::from_millis(200),
            max: Duration::from_millis(400),
        },
        ..defaults()
    };
    let mgr = w.manager_with(config.clone());
    let s = w.create_with(&mgr, "silent", &profile, None).await;
    let token = s.resume_token.clone().unwrap();
    w.prompt(&mgr, s.id, "one").await;
    let crash = |mgr: sessiond_engine::SessionManager| {
        let w = &w;
        async move {
            mgr.shutdown();
            drop(mgr);
            kill_tree(w.record(s.id).await.pid.unwrap()).await;
        }
    };
    crash(mgr).await;

    let mgr = w.manager_with(config.clone());
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::Retrying), 1, "{summary:?}");
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let st = w.status(&mgr, s.id).await;
        assert_ne!(st.state, SessionState::Error, "{st:?}");
        if st.is_agent_running && st.agent_recovery.is_none() {
            break;
        }
        assert!(Instant::now() < deadline, "never came back: {st:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    w.track(s.id).await;
    let reply = w.prompt(&mgr, s.id, "two").await;
    assert_eq!(reply, expected_reply(2, &token, "two"));
    crash(mgr).await;

    let on_demand = ManagerConfig {
        resume_policy: sessiond_domain::ResumePolicy::OnDemand,
        ..config
    };
    let mgr = w.manager_with(on_demand);
    mgr.recovery().recover_all().await.unwrap();
    let st = mgr.resume_session(w.task.id, s.id).await.unwrap();
    assert!(st.is_agent_running, "{st:?}");
    w.track(s.id).await;
    let reply = w.prompt(&mgr, s.id, "three").await;
    assert_eq!(reply, expected_reply(3, &token, "three"));
    w.finish(&mgr, &[s.id]).await;
}

/// One line of the demo agent's `calls.log`.
#[derive(Debug, serde::Deserialize)]
struct Call {
    pid: u32,
    method: String,
    session_id: Option<String>,
    replayed: Option<u64>,
}

fn calls(w: &World) -> Vec<Call> {
    std::fs::read_to_string(w.path("agent-state").join("calls.log"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// After `kill -9` of everything, each agent reopens its conversation the
/// way it can: ACP `session/resume` when it offers it (nothing replayed,
/// whether it also offers `session/load` or not), `session/load` otherwise
/// (the history replayed by the agent and dropped by agentctl). Either way
/// nothing stored is duplicated and the conversation goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_is_preferred_to_load_and_nothing_is_stored_twice() {
    let w = World::new(Db::Sqlite).await;
    let both = w.demo_profile("both", &[]).await;
    let resume_only = w
        .demo_profile("resume-only", &[("ACP_DEMO_NO_LOAD_SESSION", "1")])
        .await;
    let load_only = w
        .demo_profile("load-only", &[("ACP_DEMO_NO_RESUME_SESSION", "1")])
        .await;
    let mgr = w.manager_with(defaults());
    let mut sessions = Vec::new();
    for (name, profile, method) in [
        ("both", &both, "session/resume"),
        ("resume-only", &resume_only, "session/resume"),
        ("load-only", &load_only, "session/load"),
    ] {
        let s = w.create_with(&mgr, name, profile, None).await;
        w.prompt(&mgr, s.id, "one").await;
        w.prompt(&mgr, s.id, "two").await;
        sessions.push((s, method));
    }
    let mut stored = Vec::new();
    for (s, _) in &sessions {
        stored.push(w.all_messages(s.id).await.len());
    }
    mgr.shutdown();
    drop(mgr);
    let mut old_pids = Vec::new();
    for (s, _) in &sessions {
        let r = w.record(s.id).await;
        old_pids.push(r.pid.unwrap());
        kill_tree(r.pid.unwrap()).await;
    }

    let mgr = w.manager_with(defaults());
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::Resumed), 3, "{summary:?}");
    let log = calls(&w);
    for (i, (s, method)) in sessions.iter().enumerate() {
        let token = s.resume_token.clone().unwrap();
        let reopened: Vec<&Call> = log
            .iter()
            .filter(|c| {
                c.session_id.as_deref() == Some(token.as_str())
                    && (c.method == "session/resume" || c.method == "session/load")
            })
            .collect();
        assert_eq!(reopened.len(), 1, "{}: reopened once: {reopened:?}", s.id);
        let call = reopened[0];
        assert_eq!(call.method, *method, "{call:?}");
        assert!(
            !old_pids.contains(&call.pid),
            "a new agent process: {call:?}"
        );
        match *method {
            "session/resume" => assert_eq!(call.replayed, Some(0), "{call:?}"),
            _ => assert!(call.replayed.is_some_and(|n| n > 0), "{call:?}"),
        }
        assert_eq!(
            w.all_messages(s.id).await.len(),
            stored[i],
            "{}: nothing stored twice by reopening",
            s.id
        );
        w.track(s.id).await;
        let reply = w.prompt(&mgr, s.id, "three").await;
        assert_eq!(reply, expected_reply(3, &token, "three"));
    }
    let ids: Vec<SessionId> = sessions.iter().map(|(s, _)| s.id).collect();
    w.finish(&mgr, &ids).await;
}

/// The backend dies while a create waits for a slow agent's conversation
/// (agentctl up, the agent still starting, no resume token yet): nothing
/// was said, so recovery opens the conversation by itself and the session
/// comes up WAITING_FOR_INPUT (before: ERROR `missing_resume_token`, for a
/// restart at the wrong moment).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_cut_by_a_crash_comes_up_by_itself() {
    let w = World::new(Db::Sqlite).await;
    let profile = w
        .demo_profile("slow-start", &[("ACP_DEMO_STARTUP_MS", "3000")])
        .await;
    let mgr = w.manager_with(defaults());
    let create = tokio::spawn({
        let mgr = mgr.clone();
        let req = sessiond_engine::NewSession {
            task_id: w.task.id,
            agent_profile_id: profile.id,
            runtime: sessiond_domain::Runtime::LocalStandalone,
            worktree: w.worktree("cut"),
            remote: None,
            metadata: Default::default(),
            mcp_servers: Vec::new(),
        };
        async move { mgr.create_session(req).await }
    });
    // agentctl is up and recorded; the agent is still starting.
    let deadline = Instant::now() + Duration::from_secs(30);
    let session = loop {
        let sessions = w.store.list_sessions(w.task.id).await.unwrap();
        if let Some(s) = sessions.first()
            && let Ok(Some(r)) = w.store.get_executor_for_session(s.id).await
            && r.pid.is_some()
            && r.status == ExecutorStatus::Ready
        {
            break s.clone();
        }
        assert!(Instant::now() < deadline, "agentctl never came up");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // The crash: the create's caller, the backend, agentctl and the agent.
    create.abort();
    mgr.shutdown();
    drop(mgr);
    kill_tree(w.record(session.id).await.pid.unwrap()).await;
    let cut = w.store.get_session(session.id).await.unwrap();
    assert_eq!(cut.state, SessionState::Starting, "{cut:?}");
    assert!(cut.resume_token.is_none(), "{cut:?}");

    let mgr = w.manager_with(defaults());
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::Opened), 1, "{summary:?}");
    assert_eq!((summary.failed, summary.not_back), (0, 0), "{summary:?}");
    w.track(session.id).await;
    let st = w.status(&mgr, session.id).await;
    assert_eq!(st.state, SessionState::WaitingForInput, "{st:?}");
    assert!(st.is_agent_running, "{st:?}");
    let token = w.store.get_session(session.id).await.unwrap().resume_token;
    let token = token.expect("the opened conversation is stored");
    let reply = w.prompt(&mgr, session.id, "one").await;
    assert_eq!(reply, expected_reply(1, &token, "one"));
    w.finish(&mgr, &[session.id]).await;
}

/// A heavy agent (≥ 2 s to start, its history loaded at a cost per
/// message) killed with SIGKILL in the middle of a streaming reply, its
/// agentctl alive: the turn ends interrupted (the reply so far kept and
/// marked, the turn kept for a retry), and sessiond starts a new agent
/// under the same agentctl and resumes the conversation with no call,
/// the session never left in ERROR. A message queued behind the cut turn
/// is held (the user decides whether the turn runs again first); a new
/// message gives the retry up and both are delivered, in order, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heavy_agent_killed_mid_reply_is_restarted_by_itself() {
    let w = World::new(Db::Sqlite).await;
    let profile = w.demo_profile("heavy", HEAVY).await;
    let mgr = w.manager_with(defaults());
    let s = w.create_with(&mgr, "killed", &profile, None).await;
    w.prompt(&mgr, s.id, "one").await;
    let seq_before = w.store.last_event_seq(s.id).await.unwrap();
    mgr.send_message(w.task.id, s.id, "/long").await.unwrap();
    // Killed once its reply is streaming (stored, not complete).
    let two = streaming_then_queued(&w, &mgr, s.id).await;
    let agentctl = w.record(s.id).await.pid.unwrap();
    let agents = children_of(agentctl);
    assert!(!agents.is_empty(), "no agent under agentctl {agentctl}");
    for pid in &agents {
        kill9(*pid);
    }
    let st = w.wait_agent_back(&mgr, s.id, seq_before).await;
    assert_eq!(
        st.queued.iter().map(|q| q.id).collect::<Vec<_>>(),
        [two.id],
        "the queued message is held behind the interrupted turn"
    );
    assert!(st.queue_held, "{st:?}");
    assert_eq!(st.executor_status, Some(ExecutorStatus::Ready), "{st:?}");
    assert_eq!(w.record(s.id).await.pid, Some(agentctl), "agentctl kept");
    let msgs = w.messages(s.id).await;
    assert_eq!(msgs.len(), 5, "{msgs:?}");
    assert!(
        msgs[3].complete && msgs[3].content.contains("interrupted"),
        "{:?}",
        msgs[3]
    );
    assert_eq!(msgs[4].role, MessageRole::System, "{:?}", msgs[4]);
    assert!(
        msgs[4].content.starts_with("the turn was interrupted")
            && msgs[4]
                .content
                .contains("The queued message waits until you retry"),
        "{:?}",
        msgs[4]
    );
    let stored = w.store.get_session(s.id).await.unwrap();
    assert_eq!(
        stored.metadata.get("interrupted_turn"),
        Some(&msgs[2].id.to_string()),
        "the cut turn is kept for a retry"
    );
    let events = w.events(s.id).await;
    assert!(
        !events.iter().any(|e| matches!(
            &e.payload,
            EventPayload::StateChanged { from: SessionState::Error, to, .. } if *to != SessionState::Starting
        )),
        "ERROR only on the way to STARTING: {events:?}"
    );
    w.track(s.id).await;
    // Still held while nobody decides.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(w.messages(s.id).await.len(), 5);
    // A new message goes on without the retry: two, then three.
    assert!(matches!(
        mgr.send_or_queue(w.task.id, s.id, "three").await.unwrap(),
        sessiond_engine::Sent::Queued(_)
    ));
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let msgs = w.messages(s.id).await;
        let st = w.status(&mgr, s.id).await;
        if msgs.len() == 9 && st.state == SessionState::WaitingForInput && msgs[8].complete {
            let users: Vec<&str> = msgs
                .iter()
                .filter(|m| m.role == MessageRole::User)
                .map(|m| m.content.as_str())
                .collect();
            assert_eq!(users, ["one", "/long", "two", "three"], "{msgs:?}");
            assert!(!st.queue_held && st.queued.is_empty(), "{st:?}");
            assert!(msgs[6].content.contains("\"two\""), "{:?}", msgs[6]);
            assert!(msgs[8].content.contains("\"three\""), "{:?}", msgs[8]);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "two and three not answered: {msgs:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    w.finish(&mgr, &[s.id]).await;
}

/// Waits until the session's message `index` is an agent reply that has
/// begun to stream (stored, with text).
async fn wait_reply_streaming(w: &World, s: SessionId, index: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let msgs = w.messages(s).await;
        if msgs
            .get(index)
            .is_some_and(|m| m.role == MessageRole::Agent && !m.content.is_empty())
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "reply {index} never streamed: {msgs:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the session's `/long` reply (its fourth message) streams,
/// then queues "two" behind it.
async fn streaming_then_queued(
    w: &World,
    mgr: &sessiond_engine::SessionManager,
    s: SessionId,
) -> sessiond_domain::QueuedMessage {
    wait_reply_streaming(w, s, 3).await;
    match mgr.send_or_queue(w.task.id, s, "two").await.unwrap() {
        sessiond_engine::Sent::Queued(q) => q,
        other => panic!("not queued behind the running turn: {other:?}"),
    }
}

/// A heavy agent killed mid-reply while sessiond is down (helper-21's
/// first defect): after the restart, recovery finds agentctl alive and the
/// agent gone, and relaunches it; agentctl's `TurnEnded` for the killed
/// turn, read after that, still ends it *interrupted* as it would have
/// with sessiond up (reply kept and marked, retryable, the queue behind it
/// held), never "failed" with the queue sent on, and the exit is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heavy_agent_killed_mid_reply_while_sessiond_is_down_ends_interrupted() {
    let w = World::new(Db::Sqlite).await;
    let profile = w.demo_profile("heavy", HEAVY).await;
    let mgr = w.manager_with(defaults());
    let s = w.create_with(&mgr, "down", &profile, None).await;
    w.prompt(&mgr, s.id, "one").await;
    mgr.send_message(w.task.id, s.id, "/long").await.unwrap();
    let two = streaming_then_queued(&w, &mgr, s.id).await;
    // sessiond goes away (agentctl stays), then the agent is killed.
    mgr.shutdown();
    drop(mgr);
    let agentctl = w.record(s.id).await.pid.unwrap();
    let agents = children_of(agentctl);
    assert!(!agents.is_empty(), "no agent under agentctl {agentctl}");
    for pid in &agents {
        kill9(*pid);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while !children_of(agentctl).is_empty() {
        assert!(Instant::now() < deadline, "agentctl never reaped its agent");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let mgr = w.manager_with(defaults());
    mgr.recovery().recover_all().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let st = loop {
        let st = w.status(&mgr, s.id).await;
        if st.state == SessionState::WaitingForInput && st.is_agent_running && st.queue_held {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "never back with the queue held: {st:?} {:?}",
            w.messages(s.id).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        st.queued.iter().map(|q| q.id).collect::<Vec<_>>(),
        [two.id],
        "{st:?}"
    );
    assert_eq!(w.record(s.id).await.pid, Some(agentctl), "agentctl kept");
    let msgs = w.messages(s.id).await;
    assert_eq!(msgs.len(), 5, "{msgs:?}");
    assert!(
        msgs[3].complete && msgs[3].content.contains("interrupted"),
        "{:?}",
        msgs[3]
    );
    assert!(
        msgs[4].role == MessageRole::System
            && msgs[4].content.starts_with("the turn was interrupted")
            && msgs[4].content.contains("exited")
            && !msgs[4].content.contains("failed"),
        "{:?}",
        msgs[4]
    );
    let mut registry = prometheus_client::registry::Registry::default();
    mgr.metrics().register(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.contains("sessiond_turns_total{outcome=\"interrupted\"} 1\n")
            && !text.contains("sessiond_turns_total{outcome=\"failed\"} 1\n"),
        "{text}"
    );
    // The retry runs /long again (then the held queue): allowed.
    w.track(s.id).await;
    let (retried, _) = mgr
        .retry_turn(w.task.id, s.id, Some(msgs[2].id))
        .await
        .unwrap();
    assert_eq!(retried.content, "/long", "{retried:?}");
    // Cleanup: the retried /long is cancelled, right after the agent's
    // restart (the executors cache may not say yet that it runs; the
    // cancel asks agentctl then: CI saw AgentNotRunning here once).
    mgr.cancel_turn(w.task.id, s.id).await.unwrap();
    w.finish(&mgr, &[s.id]).await;
}

/// The heavy demo agent, deaf to `session/cancel`.
async fn deaf_profile(w: &World) -> sessiond_domain::AgentProfile {
    let mut env = HEAVY.to_vec();
    env.push(("ACP_DEMO_IGNORE_CANCEL", "1"));
    w.demo_profile("deaf", &env).await
}

/// A heavy agent that ignores `session/cancel` (as one stuck in a tool
/// does) keeps its turn going after CancelTurn; once `cancel_grace` has
/// passed, sessiond stops it: the turn ends cancelled, as asked, saying
/// sessiond stopped the agent, and the agent is restarted with its
/// conversation, so the session never stays RUNNING for good and the next
/// message is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heavy_agent_that_ignores_cancel_is_stopped_after_the_grace_and_restarted() {
    let w = World::new(Db::Sqlite).await;
    let profile = deaf_profile(&w).await;
    let mgr = w.manager_with(ManagerConfig {
        cancel_grace: Duration::from_secs(1),
        ..defaults()
    });
    let s = w.create_with(&mgr, "deaf", &profile, None).await;
    let seq_before = w.store.last_event_seq(s.id).await.unwrap();
    mgr.send_message(w.task.id, s.id, "/long").await.unwrap();
    wait_reply_streaming(&w, s.id, 1).await;
    assert!(mgr.cancel_turn(w.task.id, s.id).await.unwrap());
    let st = w.wait_agent_back(&mgr, s.id, seq_before).await;
    assert!(st.error_message.is_none(), "{st:?}");
    let msgs = w.messages(s.id).await;
    assert_eq!(msgs.len(), 3, "{msgs:?}");
    assert!(
        msgs[1].complete
            && msgs[1]
                .content
                .contains("the turn was cancelled; the agent did not stop"),
        "{:?}",
        msgs[1]
    );
    assert!(
        msgs[2]
            .content
            .starts_with("the turn was cancelled on request")
            && msgs[2]
                .content
                .contains("did not end the turn within 1s of its cancel"),
        "{:?}",
        msgs[2]
    );
    let stored = w.store.get_session(s.id).await.unwrap();
    assert!(
        !stored.metadata.contains_key("interrupted_turn"),
        "a cancelled turn is not offered for a retry"
    );
    let ended: Vec<_> = w
        .events(s.id)
        .await
        .into_iter()
        .filter_map(|e| match e.payload {
            EventPayload::TurnEnded { stop_reason, .. } => Some(stop_reason),
            _ => None,
        })
        .collect();
    assert_eq!(
        ended,
        ["cancelled"],
        "one end for the turn, as the user asked"
    );
    w.track(s.id).await;
    let reply = w.prompt(&mgr, s.id, "after").await;
    assert!(reply.contains("after"), "{reply}");
    w.finish(&mgr, &[s.id]).await;
}

/// A cancel the agent ignores survives a restart of the backend
/// (helper-22's A): the new backend sends it again and, the grace passed,
/// stops the agent; the turn ends cancelled, as asked, instead of running
/// on and ending as if complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ignored_cancel_is_still_enforced_after_a_backend_restart() {
    let w = World::new(Db::Sqlite).await;
    let profile = deaf_profile(&w).await;
    // The first backend's grace never passes before it goes away.
    let mgr = w.manager_with(ManagerConfig {
        cancel_grace: Duration::from_secs(3600),
        ..defaults()
    });
    let s = w.create_with(&mgr, "deaf-restart", &profile, None).await;
    mgr.send_message(w.task.id, s.id, "/long").await.unwrap();
    wait_reply_streaming(&w, s.id, 1).await;
    assert!(mgr.cancel_turn(w.task.id, s.id).await.unwrap());
    mgr.shutdown();
    drop(mgr);

    let mgr = w.manager_with(ManagerConfig {
        cancel_grace: Duration::from_secs(1),
        ..defaults()
    });
    mgr.recovery().recover_all().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let ended = loop {
        let ended: Vec<String> = w
            .events(s.id)
            .await
            .into_iter()
            .filter_map(|e| match e.payload {
                EventPayload::TurnEnded { stop_reason, .. } => Some(stop_reason),
                _ => None,
            })
            .collect();
        if !ended.is_empty() {
            break ended;
        }
        assert!(
            Instant::now() < deadline,
            "the cancelled turn never ended: {:?}",
            w.messages(s.id).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(ended, ["cancelled"], "{:?}", w.messages(s.id).await);
    let msgs = w.messages(s.id).await;
    assert!(
        msgs.iter().any(|m| m.role == MessageRole::System
            && m.content
                .contains("did not end the turn within 1s of its cancel")),
        "{msgs:?}"
    );
    w.track(s.id).await;
    w.wait_state(&mgr, s.id, SessionState::WaitingForInput)
        .await;
    let reply = w.prompt(&mgr, s.id, "after").await;
    assert!(reply.contains("after"), "{reply}");
    w.finish(&mgr, &[s.id]).await;
}

/// The agent sessiond restarts after an exit dies again while it starts
/// (a heavy one, seconds to start): that is the restart's launch failing,
/// which recovery retries like any launch, so the session comes back by
/// itself; it never goes ERROR for the second death.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_dies_again_while_restarting_is_retried() {
    let w = World::new(Db::Sqlite).await;
    let profile = w.demo_profile("heavy", HEAVY).await;
    let mgr = w.manager_with(ManagerConfig {
        retry_backoff: sessiond_executor::Backoff {
            initial: Duration::from_millis(200),
            max: Duration::from_secs(1),
        },
        ..defaults()
    });
    let s = w.create_with(&mgr, "twice", &profile, None).await;
    let token = s.resume_token.clone().unwrap();
    w.prompt(&mgr, s.id, "one").await;
    let seq_before = w.store.last_event_seq(s.id).await.unwrap();
    let agentctl = w.record(s.id).await.pid.unwrap();
    let first = children_of(agentctl);
    assert_eq!(first.len(), 1, "one agent under agentctl {agentctl}");
    kill9(first[0]);
    // The restarted agent, killed while it starts (it sleeps 1.5 s first).
    let deadline = Instant::now() + Duration::from_secs(30);
    let second = loop {
        if let Some(p) = children_of(agentctl).into_iter().find(|p| *p != first[0]) {
            break p;
        }
        assert!(Instant::now() < deadline, "no restarted agent appeared");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    kill9(second);
    let st = w.wait_agent_back(&mgr, s.id, seq_before).await;
    assert!(st.error_message.is_none(), "{st:?}");
    let errors = w
        .store
        .events_after(s.id, seq_before, 10_000)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| {
            matches!(
                e.payload,
                EventPayload::StateChanged {
                    to: SessionState::Error,
                    ..
                }
            )
        })
        .count();
    assert_eq!(errors, 1, "ERROR only on the way to the restart");
    w.track(s.id).await;
    let reply = w.prompt(&mgr, s.id, "two").await;
    assert_eq!(reply, expected_reply(2, &token, "two"));
    w.finish(&mgr, &[s.id]).await;
}

/// helper-52 1: after kill -9 of everything, a session whose agent is slow
/// to come back (Claude Code loading a long history; here an agent held at
/// its start gate) has its workspace back at once. SERVING, and a workspace
/// call on the session itself, waited for the agent's launch and resume (33
/// s with a slow history load), which agentctl's `Recover` carried with
/// the health check; now they wait only for agentctl, and the agent's
/// relaunch goes on to bring the conversation back, launched once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_agent_does_not_hold_its_workspace_after_a_restart() {
    let w = World::new(Db::Sqlite).await;
    let (gated, gate) = w.gated_profile("gated").await;
    let config = patient();
    let mgr = w.manager_with(config.clone());
    // `a` loses its agentctl too; `b`'s agentctl survives, its agent not.
    let a = w.create_with(&mgr, "a", &gated, None).await;
    let b = w.create_with(&mgr, "b", &gated, None).await;
    let ids = [a.id, b.id];
    for s in [&a, &b] {
        w.prompt(&mgr, s.id, "one").await;
        std::fs::write(Path::new(&s.worktree.path).join("notes.txt"), b"kept").unwrap();
    }
    mgr.shutdown();
    drop(mgr);
    kill_tree(w.record(a.id).await.pid.unwrap()).await;
    let b_agentctl = w.record(b.id).await.pid.unwrap();
    for agent in demo_agents_under(b_agentctl) {
        kill9(agent);
    }

    std::fs::write(&gate, b"closed").unwrap();
    let mgr = std::sync::Arc::new(w.manager_with(config));
    let pass = pass_in_background(&mgr);
    // The gate stays closed: waiting for the agents would wait for the
    // executor deadline (120 s) at least.
    for id in ids {
        tokio::time::timeout(Duration::from_secs(60), mgr.recovery().ensure_workspace(id))
            .await
            .expect("the workspace call waited for the agent")
            .unwrap();
    }
    tokio::time::timeout(
        Duration::from_secs(60),
        mgr.recovery().wait_workspaces_recovered(),
    )
    .await
    .expect("SERVING waited for the agents");
    assert!(gate.exists(), "the gate opened early");
    for id in ids {
        let st = w.status(&mgr, id).await;
        assert_eq!(st.executor_status, Some(ExecutorStatus::Ready), "{st:?}");
        assert!(st.recovering && !st.is_agent_running, "{st:?}");
        // The workspace answers, through its agentctl.
        let record = w.record(id).await;
        assert_eq!(record.status, ExecutorStatus::Ready);
        let entries = w.agentctl(&record).list_dir(".").await.unwrap();
        assert!(entries.iter().any(|e| e.name == "notes.txt"), "{entries:?}");
    }
    assert_eq!(
        w.record(b.id).await.pid,
        Some(b_agentctl),
        "b's agentctl was replaced"
    );

    open_gate_and_prompt_again(&w, &mgr, &gate, pass, [&a, &b]).await;
    for s in [&a, &b] {
        // One agent was launched for the recovery, not a second one beside it.
        let agentctl = w.record(s.id).await.pid.unwrap();
        assert_eq!(demo_agents_under(agentctl).len(), 1);
    }
    w.finish(&mgr, &ids).await;
}

/// Opens the start gate of two sessions' agents, waits for the pass to
/// resume both, and prompts each once more: the agent answers from the
/// whole history (its second prompt), and the session is tracked.
async fn open_gate_and_prompt_again(
    w: &World,
    mgr: &sessiond_engine::SessionManager,
    gate: &Path,
    pass: tokio::task::JoinHandle<sessiond_engine::Result<sessiond_engine::RecoverySummary>>,
    sessions: [&sessiond_domain::Session; 2],
) {
    std::fs::remove_file(gate).unwrap();
    let summary = pass.await.unwrap().unwrap();
    assert_eq!(summary.count(OutcomeLabel::Resumed), 2, "{summary:?}");
    for s in sessions {
        w.track(s.id).await;
        let token = s.resume_token.clone().unwrap();
        let reply = w.prompt(mgr, s.id, "two").await;
        assert_eq!(reply, expected_reply(2, &token, "two"));
    }
}

/// Two sessions of an agent held at its start gate, each prompted once,
/// then kill -9 of everything and a restart with one launch slot, the
/// gate closed and the pass running in the background: (world, the two
/// sessions, the gate, the new manager, its pass).
async fn two_gated_sessions_restarted() -> (
    World,
    [sessiond_domain::Session; 2],
    std::path::PathBuf,
    std::sync::Arc<sessiond_engine::SessionManager>,
    tokio::task::JoinHandle<sessiond_engine::Result<sessiond_engine::RecoverySummary>>,
) {
    let w = World::new(Db::Sqlite).await;
    let (gated, gate) = w.gated_profile("gated").await;
    let config = ManagerConfig {
        launches: sessiond_engine::LaunchLimits { initial: 1, max: 1 },
        ..patient()
    };
    let mgr = w.manager_with(config.clone());
    let a = w.create_with(&mgr, "a", &gated, None).await;
    let b = w.create_with(&mgr, "b", &gated, None).await;
    for s in [&a, &b] {
        w.prompt(&mgr, s.id, "one").await;
    }
    mgr.shutdown();
    drop(mgr);
    for s in [&a, &b] {
        kill_tree(w.record(s.id).await.pid.unwrap()).await;
    }
    std::fs::write(&gate, b"closed").unwrap();
    let mgr = std::sync::Arc::new(w.manager_with(config));
    let pass = pass_in_background(&mgr);
    (w, [a, b], gate, mgr, pass)
}

/// helper-51 1: after kill -9 of everything, a message to a session whose
/// agent is still coming back (one held at its start gate, one waiting for
/// the host's only launch slot behind it) is queued at once by the
/// recovery that holds the session; it waited for the agent's launch and
/// load (2-39 s with Claude Code). A repeat with the same request id
/// answers the same queued message, and one taken off the queue meanwhile
/// goes at once too. Once the agents are back each queued message is
/// delivered, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_to_a_session_whose_agent_is_coming_back_is_queued_at_once() {
    let (w, [a, b], gate, mgr, pass) = two_gated_sessions_restarted().await;
    let ids = [a.id, b.id];
    let mut queued = Vec::new();
    for id in ids {
        let message = sessiond_engine::Outgoing {
            text: "two".into(),
            queue: true,
            request_id: Some("key-two".into()),
            ..Default::default()
        };
        let send = || mgr.send_outgoing(w.task.id, id, message.clone());
        // The gate stays closed: waiting for the agent would wait for the
        // executor deadline (120 s) at least.
        let first = tokio::time::timeout(Duration::from_secs(30), send())
            .await
            .expect("the send waited for the agent")
            .unwrap();
        let sessiond_engine::Sent::Queued(q) = first else {
            panic!("not queued while the agent comes back: {first:?}");
        };
        let again = tokio::time::timeout(Duration::from_secs(30), send())
            .await
            .expect("the repeat waited for the agent")
            .unwrap();
        match again {
            sessiond_engine::Sent::Queued(r) => assert_eq!(r.id, q.id),
            other => panic!("the repeat is not the queued message: {other:?}"),
        }
        // One more, taken back at once too (helper-57 F1: the unqueue
        // waited for the agent, whose return delivered it first).
        let three = mgr.send_or_queue(w.task.id, id, "three");
        let three = match tokio::time::timeout(Duration::from_secs(30), three).await {
            Ok(Ok(sessiond_engine::Sent::Queued(q))) => q,
            other => panic!("not queued at once: {other:?}"),
        };
        let unqueue = mgr.cancel_queued_message(w.task.id, id, three.id);
        let taken = tokio::time::timeout(Duration::from_secs(30), unqueue)
            .await
            .expect("the unqueue waited for the agent")
            .unwrap();
        assert_eq!(taken.id, three.id);
        let st = w.status(&mgr, id).await;
        assert!(st.recovering && !st.is_agent_running, "{st:?}");
        assert_eq!(
            st.queued.iter().map(|m| m.id).collect::<Vec<_>>(),
            [q.id],
            "{st:?}"
        );
        queued.push(q.id);
    }
    assert!(gate.exists(), "the gate opened early");

    std::fs::remove_file(&gate).unwrap();
    let summary = pass.await.unwrap().unwrap();
    assert_eq!(summary.count(OutcomeLabel::Resumed), 2, "{summary:?}");
    for (s, q) in [&a, &b].into_iter().zip(queued) {
        let token = s.resume_token.clone().unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let msgs = loop {
            let msgs = w.messages(s.id).await;
            if msgs.len() >= 4 && msgs[3].complete {
                break msgs;
            }
            assert!(Instant::now() < deadline, "not delivered: {msgs:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(msgs.len(), 4, "delivered once: {msgs:?}");
        assert_eq!((msgs[2].id, msgs[2].content.as_str()), (q, "two"));
        assert_eq!(msgs[3].content, expected_reply(2, &token, "two"));
        w.wait_state(&mgr, s.id, SessionState::WaitingForInput)
            .await;
        w.track(s.id).await;
    }
    w.finish(&mgr, &ids).await;
}

/// A gated session whose `/long` reply is cut by kill -9 of everything
/// mid-stream, then a new manager whose startup pass brings the agent back,
/// held at its closed start gate. Returns the world, the session, the
/// `/long` message, the gate, the manager and its pass.
async fn long_turn_cut_then_held_at_the_gate() -> (
    World,
    sessiond_domain::Session,
    sessiond_domain::Message,
    std::path::PathBuf,
    std::sync::Arc<sessiond_engine::SessionManager>,
    tokio::task::JoinHandle<sessiond_engine::Result<sessiond_engine::RecoverySummary>>,
) {
    let w = World::new(Db::Sqlite).await;
    let (gated, gate) = w.gated_profile("gated").await;
    let mgr = w.manager_with(patient());
    let s = w.create_with(&mgr, "retried", &gated, None).await;
    w.prompt(&mgr, s.id, "one").await;
    let long = mgr.send_message(w.task.id, s.id, "/long").await.unwrap();
    wait_reply_streaming(&w, s.id, 3).await;
    mgr.shutdown();
    drop(mgr);
    kill_tree(w.record(s.id).await.pid.unwrap()).await;

    std::fs::write(&gate, b"closed").unwrap();
    let mgr = std::sync::Arc::new(w.manager_with(patient()));
    let pass = pass_in_background(&mgr);
    (w, s, long, gate, mgr, pass)
}

/// helper-59 1: kill -9 of everything mid-reply; a retry made while the
/// agent is brought back waited for the agent, then found the turn still
/// RUNNING (its pump had yet to end it interrupted) and was refused, the
/// user told to wait for a reply that never came (5 of 5 runs). It waits
/// for the turn's fate now, and runs it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_while_the_agent_comes_back_runs_the_turn_the_restart_interrupted() {
    let (w, s, long, gate, mgr, pass) = long_turn_cut_then_held_at_the_gate().await;
    let retry = {
        let (mgr, task) = (mgr.clone(), w.task.id);
        tokio::spawn(async move { mgr.retry_turn(task, s.id, None).await })
    };
    let st = w.status(&mgr, s.id).await;
    assert!(st.recovering, "{st:?}");
    std::fs::remove_file(&gate).unwrap();
    let summary = pass.await.unwrap().unwrap();
    assert_eq!(summary.count(OutcomeLabel::Resumed), 1, "{summary:?}");
    let (retried, original) = retry
        .await
        .unwrap()
        .expect("the retry of the interrupted turn");
    assert_eq!((original, retried.content.as_str()), (long.id, "/long"));
    let msgs = w.messages(s.id).await;
    let users: Vec<_> = msgs
        .iter()
        .filter(|m| m.role == MessageRole::User)
        .map(|m| m.content.as_str())
        .collect();
    assert_eq!(users, ["one", "/long", "/long"], "{msgs:?}");
    assert!(
        msgs.iter()
            .any(|m| m.role == MessageRole::System
                && m.content.starts_with("the turn was interrupted")),
        "{msgs:?}"
    );
    // Cleanup: the retried /long is cancelled.
    w.track(s.id).await;
    mgr.cancel_turn(w.task.id, s.id).await.unwrap();
    w.finish(&mgr, &[s.id]).await;
}

/// Two retries made while the agent is brought back after kill -9 of
/// everything mid-reply: one runs the interrupted turn, once; the other is
/// refused, the turn having started again. (helper-63 saw both refused and
/// the turn never run again, when the recovery that brought the agent back
/// was a background retry: `SettlingHold` closes that window. This test
/// joins the pass's recovery instead and does not reach it; the fix was
/// checked with helper-63's script against release binaries.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_retries_while_the_agent_comes_back_run_the_interrupted_turn_once() {
    let (w, s, long, gate, mgr, pass) = long_turn_cut_then_held_at_the_gate().await;
    let retries: Vec<_> = (0..2)
        .map(|_| {
            let (mgr, task) = (mgr.clone(), w.task.id);
            tokio::spawn(async move { mgr.retry_turn(task, s.id, None).await })
        })
        .collect();
    let st = w.status(&mgr, s.id).await;
    assert!(st.recovering, "{st:?}");
    std::fs::remove_file(&gate).unwrap();
    let summary = pass.await.unwrap().unwrap();
    assert_eq!(summary.count(OutcomeLabel::Resumed), 1, "{summary:?}");
    let mut ran = Vec::new();
    let mut refused = Vec::new();
    for retry in retries {
        match retry.await.unwrap() {
            Ok((retried, original)) => ran.push((original, retried.content)),
            Err(e) => refused.push(e.to_string()),
        }
    }
    assert_eq!(ran, [(long.id, "/long".to_owned())], "refused: {refused:?}");
    let msgs = w.messages(s.id).await;
    let users: Vec<_> = msgs
        .iter()
        .filter(|m| m.role == MessageRole::User)
        .map(|m| m.content.as_str())
        .collect();
    assert_eq!(users, ["one", "/long", "/long"], "{msgs:?}");
    w.track(s.id).await;
    mgr.cancel_turn(w.task.id, s.id).await.unwrap();
    w.finish(&mgr, &[s.id]).await;
}

/// helper-58 F2: after kill -9 of everything, a cancel or a retry on a
/// session with no turn in flight, whose agent is still coming back (one
/// held at its start gate, one waiting for the host's only launch slot),
/// waited for the agent and then answered what was known before: no turn
/// in progress, none interrupted. They answer at once now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_or_retry_with_no_turn_answers_while_the_agent_comes_back() {
    let (w, [a, b], gate, mgr, pass) = two_gated_sessions_restarted().await;
    let ids = [a.id, b.id];
    for id in ids {
        // The gate stays closed: waiting for the agent would wait for the
        // executor deadline (120 s) at least.
        let cancel = tokio::time::timeout(Duration::from_secs(30), mgr.cancel_turn(w.task.id, id))
            .await
            .expect("the cancel waited for the agent");
        match cancel {
            Err(sessiond_engine::Error::InvalidState { hint, .. }) => {
                assert_eq!(hint, "no turn is in progress")
            }
            other => panic!("not refused for want of a turn: {other:?}"),
        }
        let retry = mgr.retry_turn(w.task.id, id, None);
        let retry = tokio::time::timeout(Duration::from_secs(30), retry)
            .await
            .expect("the retry waited for the agent");
        assert!(
            matches!(
                retry,
                Err(sessiond_engine::Error::TurnNotInterrupted { .. })
            ),
            "{retry:?}"
        );
        let st = w.status(&mgr, id).await;
        assert!(st.recovering && !st.is_agent_running, "{st:?}");
    }
    assert!(gate.exists(), "the gate opened early");

    open_gate_and_prompt_again(&w, &mgr, &gate, pass, [&a, &b]).await;
    w.finish(&mgr, &ids).await;
}

/// helper-31 D5, helper-34: a stop of a session whose recovery waits for a
/// launch slot (the host's only slot held by another agent that is slow to
/// start) waited for that slot and for its own agent's launch, only to
/// stop it (11 s with Claude Code). Now the stop goes ahead at once: the
/// recovery brings the workspace back and launches nothing
/// (`executor_only`), and the slow one comes back once it starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_during_recovery_does_not_wait_for_a_launch() {
    let (w, [a, b], gate, mgr, pass) = two_gated_sessions_restarted().await;
    let token_a = a.resume_token.clone().unwrap();
    let token_b = b.resume_token.clone().unwrap();
    // One of them holds the slot (its agent waits at the gate), the other
    // waits for the slot: that one is stopped.
    let deadline = Instant::now() + Duration::from_secs(60);
    let (waiting, held) = loop {
        let queued = |st: &sessiond_domain::SessionStatus| {
            st.agent_recovery
                .as_ref()
                .is_some_and(|r| r.stage == RecoveryStage::Queued && r.place.is_some())
        };
        let (sa, sb) = (w.status(&mgr, a.id).await, w.status(&mgr, b.id).await);
        if queued(&sa) {
            break (a.id, (b.id, token_b.clone()));
        }
        if queued(&sb) {
            break (b.id, (a.id, token_a.clone()));
        }
        assert!(Instant::now() < deadline, "none queued: {sa:?} / {sb:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // The gate stays closed throughout the stop: waiting for the slot
    // would wait for the executor deadline (120 s) at least.
    let stopped = tokio::time::timeout(
        Duration::from_secs(30),
        mgr.cancel_session(w.task.id, waiting),
    )
    .await
    .expect("the stop waited for a launch")
    .unwrap();
    assert_eq!(stopped.state, SessionState::Cancelled);
    assert!(gate.exists(), "the gate opened during the stop");
    assert_eq!(w.record(waiting).await.status, ExecutorStatus::Stopped);

    std::fs::remove_file(&gate).unwrap();
    let summary = pass.await.unwrap().unwrap();
    assert_eq!(
        summary.outcome(waiting).cloned(),
        Some(Ok(OutcomeLabel::ExecutorOnly)),
        "{summary:?}"
    );
    assert_eq!(
        summary.outcome(held.0).cloned(),
        Some(Ok(OutcomeLabel::Resumed)),
        "{summary:?}"
    );
    w.track(held.0).await;
    let reply = w.prompt(&mgr, held.0, "two").await;
    assert_eq!(reply, expected_reply(2, &held.1, "two"));
    let mgr = std::sync::Arc::into_inner(mgr).expect("the pass is done");
    w.finish(&mgr, &[held.0, waiting]).await;
}

/// helper-53 a: a stop (or delete) of a session whose agent was being
/// launched and loading its conversation waited for the whole load (40-90
/// s with a slow history), the session lock held by the recovery. The stop
/// now cuts the launch: the agent goes, the session ends at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_during_an_agents_launch_cuts_it() {
    let w = World::new(Db::Sqlite).await;
    let (gated, gate) = w.gated_profile("gated").await;
    let config = patient();
    let mgr = w.manager_with(config.clone());
    let s = w.create_with(&mgr, "stopped", &gated, None).await;
    w.prompt(&mgr, s.id, "one").await;
    mgr.shutdown();
    drop(mgr);
    kill_tree(w.record(s.id).await.pid.unwrap()).await;

    std::fs::write(&gate, b"closed").unwrap();
    let mgr = std::sync::Arc::new(w.manager_with(config));
    let pass = pass_in_background(&mgr);
    // Its agent is being launched (held at the gate).
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let st = w.status(&mgr, s.id).await;
        if st
            .agent_recovery
            .as_ref()
            .is_some_and(|r| r.stage == RecoveryStage::Launching)
        {
            break;
        }
        assert!(Instant::now() < deadline, "never launching: {st:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The gate stays closed: waiting for the launch would wait for the
    // executor deadline (120 s) at least.
    let stopped =
        tokio::time::timeout(Duration::from_secs(30), mgr.cancel_session(w.task.id, s.id))
            .await
            .expect("the stop waited for the agent's launch")
            .unwrap();
    assert_eq!(stopped.state, SessionState::Cancelled);
    assert!(gate.exists(), "the gate opened during the stop");
    let summary = pass.await.unwrap().unwrap();
    assert_eq!(
        summary.outcome(s.id).cloned(),
        Some(Ok(OutcomeLabel::ExecutorOnly)),
        "{summary:?}"
    );
    assert_eq!(w.record(s.id).await.status, ExecutorStatus::Stopped);
    std::fs::remove_file(&gate).unwrap();
    let mgr = std::sync::Arc::into_inner(mgr).expect("the pass is done");
    w.finish(&mgr, &[]).await;
}
