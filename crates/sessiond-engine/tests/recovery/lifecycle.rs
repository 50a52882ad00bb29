use std::time::{Duration, Instant};

use sessiond_domain::{
    EventKind, EventPayload, ExecutorStatus, MessageRole, SessionState, TaskState,
};
use sessiond_engine::ManagerConfig;

use crate::support::{
    Db, World, assert_consecutive, demo_agents_under, expected_reply, is_running, kill9,
};

/// Create a session, prompt it: the reply is one agent message (added once,
/// then updated), the session goes RUNNING then WAITING_FOR_INPUT, every
/// event is in the outbox with gap-free seqs.
async fn create_prompt_reply(db: Db) {
    let w = World::new(db).await;
    let mgr = w.manager();
    let s = w.create(&mgr, "a").await;
    assert_eq!(
        s.state,
        SessionState::WaitingForInput,
        "{:?}",
        s.error_message
    );
    let token = s
        .resume_token
        .clone()
        .expect("resume token stored in the session");
    let record = w.record(s.id).await;
    assert_eq!(record.status, ExecutorStatus::Ready);
    assert_eq!(record.generation, 1);
    assert_eq!(record.resume_token.as_deref(), Some(token.as_str()));
    assert!(record.supports_session_resume);

    let st = w.status(&mgr, s.id).await;
    assert!(st.is_agent_running && st.is_resumable && !st.needs_resume);
    assert_eq!(st.executor_status, Some(ExecutorStatus::Ready));

    let reply = w.prompt(&mgr, s.id, "hello").await;
    assert_eq!(reply, expected_reply(1, &token, "hello"));
    let reply = w.prompt(&mgr, s.id, "again").await;
    assert_eq!(reply, expected_reply(2, &token, "again"));

    let msgs = w.messages(s.id).await;
    let roles: Vec<_> = msgs.iter().map(|m| m.role).collect();
    assert_eq!(
        roles,
        [
            MessageRole::User,
            MessageRole::Agent,
            MessageRole::User,
            MessageRole::Agent
        ]
    );
    assert_eq!(
        w.store.get_task(w.task.id).await.unwrap().state,
        TaskState::Review
    );

    let events = w.events(s.id).await;
    assert_consecutive(&events, 1);
    let agent_msg = msgs[1].id;
    let added = events
        .iter()
        .filter(|e| matches!(&e.payload, EventPayload::MessageAdded(m) if m.id == agent_msg))
        .count();
    assert_eq!(added, 1, "the reply is added once");
    let last_update = events
        .iter()
        .rev()
        .find_map(|e| match &e.payload {
            EventPayload::MessageUpdated(m) if m.id == agent_msg => Some(m.clone()),
            _ => None,
        })
        .expect("the reply was updated");
    assert!(last_update.complete);
    let states: Vec<_> = events
        .iter()
        .filter_map(|e| match e.payload {
            EventPayload::StateChanged { to, .. } => Some(to),
            _ => None,
        })
        .collect();
    assert_eq!(
        states,
        [
            SessionState::Starting,
            SessionState::WaitingForInput,
            SessionState::Running,
            SessionState::WaitingForInput,
            SessionState::Running,
            SessionState::WaitingForInput
        ]
    );
    let kinds: Vec<_> = events.iter().take(4).map(|e| e.kind()).collect();
    assert_eq!(
        kinds,
        [
            EventKind::StateChanged,
            EventKind::AgentctlStarting,
            EventKind::AgentctlReady,
            EventKind::StateChanged
        ]
    );

    // Complete: agent and agentctl end, executor stopped.
    let done = mgr.complete_session(w.task.id, s.id).await.unwrap();
    assert_eq!(done.state, SessionState::Completed);
    assert_eq!(w.record(s.id).await.status, ExecutorStatus::Stopped);
    w.procs.assert_all_gone().await;
    let st = w.status(&mgr, s.id).await;
    assert_eq!(st.resume_reason.as_str(), "session_ended");
    w.finish(&mgr, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_prompt_reply_sqlite() {
    create_prompt_reply(Db::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_prompt_reply_postgres() {
    create_prompt_reply(Db::Postgres).await;
}

/// The agent crashing in the middle of a turn ends the turn interrupted
/// (the partial reply kept and marked, a system message, the turn kept for
/// a retry) and sessiond restarts the agent by itself, its conversation
/// resumed; within `agent_restarts` (1 here) only: the next crash leaves
/// the session ERROR, saying what happened and what to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_exit_mid_turn_is_interrupted_and_restarted_within_its_limit() {
    let w = World::new(Db::Sqlite).await;
    let crashing = w
        .demo_profile("crash", &[("ACP_DEMO_CRASH_MID_TURN", "1")])
        .await;
    let mgr = w.manager_with(ManagerConfig {
        agent_restarts: 1,
        ..w.config()
    });
    let s = w.create_with(&mgr, "crash", &crashing, None).await;
    let seq_before = w.store.last_event_seq(s.id).await.unwrap();
    mgr.send_message(w.task.id, s.id, "boom").await.unwrap();
    let st = w.wait_agent_back(&mgr, s.id, seq_before).await;
    assert!(st.error_message.is_none(), "{st:?}");
    // The partial reply is one message, kept as streamed and marked
    // interrupted (never passed off as whole); a system message says the
    // turn was interrupted, so nothing ends silently, and it can be retried.
    let msgs = w.messages(s.id).await;
    assert_eq!(msgs.len(), 3, "{msgs:?}");
    assert!(msgs[1].complete);
    assert!(
        msgs[1].content.starts_with("turn 1 ") && msgs[1].content.contains("interrupted"),
        "{:?}",
        msgs[1]
    );
    assert_eq!(msgs[2].role, sessiond_domain::MessageRole::System);
    assert!(
        msgs[2].content.starts_with("the turn was interrupted"),
        "{:?}",
        msgs[2]
    );
    assert!(msgs[2].content.contains("exit"), "{:?}", msgs[2]);
    assert_eq!(
        w.store
            .get_session(s.id)
            .await
            .unwrap()
            .metadata
            .get("interrupted_turn"),
        Some(&msgs[0].id.to_string())
    );

    // The second crash is past the limit: ERROR, resumable by hand.
    mgr.send_message(w.task.id, s.id, "boom again")
        .await
        .unwrap();
    w.wait_state(&mgr, s.id, SessionState::Error).await;
    let st = w.status(&mgr, s.id).await;
    let msg = st.error_message.clone().unwrap();
    assert!(msg.contains("exit"), "{msg}");
    assert!(msg.contains("after 1 restarts"), "{msg}");
    assert!(msg.contains("resume the session"), "{msg}");
    assert!(!st.is_agent_running);
    assert!(
        st.needs_resume,
        "an exited agent with a token can be resumed"
    );
    let resumed = mgr.resume_session(w.task.id, s.id).await.unwrap();
    assert!(resumed.is_agent_running, "{resumed:?}");
    assert_consecutive(&w.events(s.id).await, 1);
    w.finish(&mgr, &[s.id]).await;
}

/// The restart limit holds across a restart of the backend (helper-22's
/// B): the restarts of the window are stored with the session, so a new
/// process does not start counting afresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_restart_limit_holds_across_a_backend_restart() {
    let w = World::new(Db::Sqlite).await;
    let crashing = w
        .demo_profile("crash", &[("ACP_DEMO_CRASH_MID_TURN", "1")])
        .await;
    let config = ManagerConfig {
        agent_restarts: 1,
        ..w.config()
    };
    let mgr = w.manager_with(config.clone());
    let s = w.create_with(&mgr, "limit", &crashing, None).await;
    let seq_before = w.store.last_event_seq(s.id).await.unwrap();
    mgr.send_message(w.task.id, s.id, "boom").await.unwrap();
    w.wait_agent_back(&mgr, s.id, seq_before).await;
    let stored = w.store.get_session(s.id).await.unwrap();
    assert!(
        stored.metadata.contains_key("agent_restarts_at"),
        "{:?}",
        stored.metadata
    );
    mgr.shutdown();
    drop(mgr);

    let mgr = w.manager_with(config);
    mgr.recovery().recover_all().await.unwrap();
    w.wait_state(&mgr, s.id, SessionState::WaitingForInput)
        .await;
    mgr.send_message(w.task.id, s.id, "boom again")
        .await
        .unwrap();
    w.wait_state(&mgr, s.id, SessionState::Error).await;
    let msg = w.status(&mgr, s.id).await.error_message.unwrap_or_default();
    assert!(msg.contains("after 1 restarts"), "{msg}");
    w.track(s.id).await;
    w.finish(&mgr, &[s.id]).await;
}

/// An agent silent at its start (no output, no CPU) fails its create after the silence limit with agentctl's
/// own words, not as a call that "did not answer within" a deadline that
/// never passed (helper-21 #3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_whose_agent_stays_silent_says_so() {
    let w = World::new(Db::Sqlite).await;
    // Says nothing, uses no CPU.
    let profile = w
        .upsert_profile("silent", "sleep", &["600".into()], &[], true)
        .await;
    let mgr = w.manager_with(ManagerConfig {
        agent_initialize_timeout: Duration::from_millis(1500),
        ..w.config()
    });
    let s = mgr
        .create_session(w.new_session("silent", &profile))
        .await
        .unwrap();
    w.track(s.id).await;
    assert_eq!(s.state, SessionState::Error, "{s:?}");
    let msg = s.error_message.clone().unwrap_or_default();
    assert!(
        msg.contains("no sign of life") && !msg.contains("did not answer LaunchAgent within"),
        "{msg}"
    );
    w.finish(&mgr, &[s.id]).await;
}

/// A profile whose command does not exist: the session is ERROR with an
/// actionable message; the executor (workspace) is still usable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_profile_is_error_with_message() {
    let w = World::new(Db::Sqlite).await;
    let broken = w
        .upsert_profile("broken", "/nonexistent/agent", &[], &[], true)
        .await;
    let mgr = w.manager();
    let s = w.create_with(&mgr, "broken", &broken, None).await;
    assert_eq!(s.state, SessionState::Error);
    let msg = s.error_message.unwrap();
    assert!(
        msg.contains("broken") && msg.contains("create a new session"),
        "{msg}"
    );
    // Its agentctl is stopped: it would hold a live slot for a session
    // that never had a conversation.
    assert_eq!(w.record(s.id).await.status, ExecutorStatus::Stopped);
    w.finish(&mgr, &[s.id]).await;
}

/// An MCP server given with the create request that the agent cannot take
/// (the demo agent offers no http): the session is ERROR naming the server
/// as the request's to drop, not telling the user to fix the profile; its
/// agentctl is stopped (the session never had a conversation), so it takes
/// no live slot: under `max_live_sessions = 1` the next create is admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_server_of_the_request_the_agent_cannot_take_is_named_as_the_requests() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager_with(ManagerConfig {
        max_live_sessions: Some(1),
        ..w.config()
    });
    let s = mgr
        .create_session(sessiond_engine::NewSession {
            task_id: w.task.id,
            agent_profile_id: w.profile.id,
            runtime: sessiond_domain::Runtime::LocalStandalone,
            worktree: w.worktree("mcp"),
            remote: None,
            metadata: Default::default(),
            mcp_servers: vec![sessiond_domain::McpServer {
                name: "web".into(),
                transport: sessiond_domain::McpTransport::Http {
                    url: "https://mcp.example.invalid/web".into(),
                    headers: Default::default(),
                },
            }],
        })
        .await
        .unwrap();
    w.track(s.id).await;
    assert_eq!(s.state, SessionState::Error);
    let msg = s.error_message.unwrap();
    assert!(
        msg.contains("mcpCapabilities.http")
            && msg.contains("\"web\" came with this create request")
            && !msg.contains("fix the agent profile"),
        "{msg}"
    );
    let record = w.record(s.id).await;
    assert_eq!(record.status, sessiond_domain::ExecutorStatus::Stopped);
    let pid = record.pid.expect("agentctl's pid");
    assert!(!is_running(pid), "agentctl {pid} still runs");
    let next = w.create(&mgr, "after-refusal").await;
    assert_eq!(next.state, SessionState::WaitingForInput);
    w.finish(&mgr, &[s.id, next.id]).await;
}

/// An idle agent killed with SIGKILL (its agentctl lives on): agentctl
/// pushes the exit (no liveness poll is involved), and sessiond starts a
/// new agent under the same agentctl that continues the same conversation,
/// with no call: the exit stays on record as ERROR (what happened, and
/// that sessiond restarts it) followed by STARTING. An explicit resume
/// while it runs joins it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_agent_killed_is_restarted_and_resumed_by_itself_sqlite() {
    idle_agent_killed_is_restarted_and_resumed_by_itself(Db::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_agent_killed_is_restarted_and_resumed_by_itself_postgres() {
    idle_agent_killed_is_restarted_and_resumed_by_itself(Db::Postgres).await;
}

async fn idle_agent_killed_is_restarted_and_resumed_by_itself(db: Db) {
    let w = World::new(db).await;
    let mgr = w.manager();
    let s = w.create(&mgr, "idle").await;
    let token = s.resume_token.clone().unwrap();
    w.prompt(&mgr, s.id, "one").await;
    let seq_before = w.store.last_event_seq(s.id).await.unwrap();
    let agentctl = w.record(s.id).await.pid.unwrap();
    let agents = demo_agents_under(agentctl);
    assert_eq!(agents.len(), 1, "one agent under agentctl {agentctl}");
    assert!(w.status(&mgr, s.id).await.is_agent_running);

    kill9(agents[0]);
    let st = w.wait_agent_back(&mgr, s.id, seq_before).await;
    assert_eq!(st.executor_status, Some(ExecutorStatus::Ready), "{st:?}");
    assert_eq!(w.record(s.id).await.pid, Some(agentctl), "agentctl kept");
    assert!(is_running(agentctl));
    let now = demo_agents_under(agentctl);
    assert_eq!(now.len(), 1, "one agent again: {now:?}");
    assert_ne!(now[0], agents[0], "a new agent process");
    w.track(s.id).await;
    // Nothing to resume any more: the explicit call answers as it is.
    let resumed = mgr.resume_session(w.task.id, s.id).await.unwrap();
    assert!(resumed.is_agent_running, "{resumed:?}");
    let reply = w.prompt(&mgr, s.id, "two").await;
    assert_eq!(reply, expected_reply(2, &token, "two"));
    w.finish(&mgr, &[s.id]).await;
}

/// GetSessionStatus shows the agent's session modes without asking
/// agentctl on every call: the answer that opened the conversation is
/// kept until the modes may have changed — a mode set through the manager
/// (its answer kept), or a mode the agent switched to by itself
/// (`current_mode_update`, seen by the update pump). Proved by stopping
/// agentctl (SIGSTOP) before the first calls: asked, it could not answer
/// (no modes); kept, the calls have them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_modes_are_kept_until_they_change() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager();
    let s = w.create(&mgr, "modes").await;
    let current =
        |m: Option<sessiond_domain::AgentModes>| m.expect("the demo agent has modes").current;
    let agentctl = w
        .record(s.id)
        .await
        .pid
        .expect("a standalone agentctl has a pid");
    let signal = |sig: &str| crate::remote::signal(agentctl, sig);
    signal("-STOP");
    let first = mgr.session_modes(w.task.id, s.id).await;
    let second = mgr.session_modes(w.task.id, s.id).await;
    signal("-CONT");
    assert_eq!(current(first.unwrap()), "default", "kept from NewSession");
    assert_eq!(current(second.unwrap()), "default", "kept from NewSession");

    let set = mgr.set_session_mode(w.task.id, s.id, "plan").await.unwrap();
    assert_eq!(set.current, "plan");
    let modes = mgr.session_modes(w.task.id, s.id).await.unwrap();
    assert_eq!(current(modes), "plan", "a mode set is shown at once");
    // The agent switches by itself during a turn.
    let reply = w.prompt(&mgr, s.id, "/mode default").await;
    assert!(reply.contains("mode: default"), "{reply}");
    let modes = mgr.session_modes(w.task.id, s.id).await.unwrap();
    assert_eq!(current(modes), "default", "the agent's own switch is shown");
    w.finish(&mgr, &[s.id]).await;
}

/// helper-49 1: a mode set through one client (a tab, sessionctl) reached
/// no other: agents seldom announce a mode the client set, and an idle
/// session's pump is parked. agentctl puts it on the session's stream and
/// the pump reads it at once: a `current_mode` part every watcher sees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mode_set_reaches_every_watcher_of_an_idle_session() {
    let w = World::new(Db::Sqlite).await;
    let profile = w
        .demo_profile("quiet", &[("ACP_DEMO_QUIET_MODE_SET", "1")])
        .await;
    let mgr = w.manager();
    let s = w.create_with(&mgr, "mode-watch", &profile, None).await;
    w.prompt(&mgr, s.id, "one").await;
    // Idle: its pump parks.
    let deadline = Instant::now() + Duration::from_secs(30);
    while mgr.has_update_pump(s.id) {
        assert!(
            Instant::now() < deadline,
            "the idle session's pump never parked"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let set = mgr.set_session_mode(w.task.id, s.id, "plan").await.unwrap();
    assert_eq!(set.current, "plan");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let modes: Vec<_> = w
            .all_messages(s.id)
            .await
            .into_iter()
            .filter(|m| m.kind == sessiond_domain::MessageKind::CurrentMode)
            .collect();
        if let Some(m) = modes.first() {
            assert_eq!(m.content, "plan");
            assert_eq!(modes.len(), 1, "one part for one mode set: {modes:?}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no watcher heard of the mode set"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // An agent that announces the mode it was set to (the demo agent
    // does, before its answer) makes no second part: the conversation
    // showed "mode: plan" twice.
    let loud = w.create(&mgr, "mode-announced").await;
    w.prompt(&mgr, loud.id, "one").await;
    let set = mgr
        .set_session_mode(w.task.id, loud.id, "plan")
        .await
        .unwrap();
    assert_eq!(set.current, "plan");
    // A turn after the set: the agent's announcement came before it on the
    // same connection, so it is stored by the time the turn's reply is.
    w.prompt(&mgr, loud.id, "two").await;
    let modes: Vec<_> = w
        .all_messages(loud.id)
        .await
        .into_iter()
        .filter(|m| m.kind == sessiond_domain::MessageKind::CurrentMode)
        .collect();
    assert_eq!(
        modes.iter().map(|m| m.content.as_str()).collect::<Vec<_>>(),
        ["plan"],
        "one part for one mode set the agent also announced"
    );
    w.finish(&mgr, &[s.id, loud.id]).await;
}

/// GetSessionStatus never waits on an agentctl that does not answer: once
/// the agent switched its mode by itself its modes are not cached, and
/// with agentctl stopped (SIGSTOP) each status answers without them, well
/// inside the agentctl call's deadline (5 s here) it used to wait on every
/// call; once agentctl answers again, the question asked in the background
/// is kept and the status has them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_status_does_not_wait_for_a_hung_agentctls_modes() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager();
    let s = w.create(&mgr, "hung-modes").await;
    let agentctl = w.record(s.id).await.pid.unwrap();
    let reply = w.prompt(&mgr, s.id, "/mode plan").await;
    assert!(reply.contains("mode: plan"), "{reply}");
    let signal = |sig: &str| crate::remote::signal(agentctl, sig);
    signal("-STOP");
    for _ in 0..3 {
        let answered = tokio::time::timeout(
            Duration::from_secs(4),
            mgr.session_status_and_modes(w.task.id, s.id),
        )
        .await;
        let (st, modes) = answered
            .expect("the status waited on the stopped agentctl")
            .unwrap();
        assert_eq!(st.state, SessionState::WaitingForInput);
        assert!(modes.is_none(), "{modes:?}");
    }
    signal("-CONT");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, modes) = mgr.session_status_and_modes(w.task.id, s.id).await.unwrap();
        if modes.is_some() {
            break;
        }
        assert!(Instant::now() < deadline, "the modes never came back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    w.finish(&mgr, &[s.id]).await;
}

/// A turn cut while its terminal runs (the agent killed mid-command): the
/// terminal's part says it was released and its tool call failed; they
/// used to say "running" and "in progress" for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminal_cut_with_its_turn_is_not_left_running() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager();
    w.listen_and_recover(&mgr).await;
    let s = w.create(&mgr, "terminal-cut").await;
    let agentctl = w.record(s.id).await.pid.unwrap();
    let seq = w.store.last_event_seq(s.id).await.unwrap();
    let user = mgr
        .send_message(w.task.id, s.id, "/terminal sleep 7781")
        .await
        .unwrap();
    let parts = |kind: sessiond_domain::MessageKind| {
        let w = &w;
        async move {
            w.store
                .list_messages(s.id, 0, u32::MAX)
                .await
                .unwrap()
                .into_iter()
                .filter(|m| m.seq > user.seq && m.kind == kind)
                .map(|m| serde_json::from_str::<serde_json::Value>(&m.data).unwrap())
                .collect::<Vec<_>>()
        }
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while parts(sessiond_domain::MessageKind::Terminal)
        .await
        .is_empty()
    {
        assert!(Instant::now() < deadline, "the terminal never showed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    kill9(demo_agents_under(agentctl)[0]);
    w.wait_agent_back(&mgr, s.id, seq).await;
    let terminals = parts(sessiond_domain::MessageKind::Terminal).await;
    assert!(
        terminals.iter().all(|t| t["update"]["released"] == true),
        "{terminals:?}"
    );
    let calls = parts(sessiond_domain::MessageKind::ToolCall).await;
    assert!(!calls.is_empty());
    assert!(
        calls.iter().all(|c| c["update"]["status"] == "failed"),
        "{calls:?}"
    );
    w.finish(&mgr, &[s.id]).await;
}

/// The second restart of an agent within the window waits the retry
/// backoff first; meanwhile the status says the session recovers by
/// itself (waiting to retry), not that it needs a resume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_waiting_its_backoff_shows_as_recovering() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager_with(ManagerConfig {
        retry_backoff: sessiond_executor::Backoff {
            initial: Duration::from_secs(3),
            max: Duration::from_secs(3),
        },
        ..w.config()
    });
    w.listen_and_recover(&mgr).await;
    let s = w.create(&mgr, "backoff").await;
    let agentctl = w.record(s.id).await.pid.unwrap();
    let seq = w.store.last_event_seq(s.id).await.unwrap();
    kill9(demo_agents_under(agentctl)[0]);
    w.wait_agent_back(&mgr, s.id, seq).await;
    let seq = w.store.last_event_seq(s.id).await.unwrap();
    kill9(demo_agents_under(agentctl)[0]);
    let deadline = Instant::now() + Duration::from_secs(10);
    let waiting = loop {
        let st = w.status(&mgr, s.id).await;
        if st.state == SessionState::Starting {
            break st;
        }
        assert!(Instant::now() < deadline, "no second restart: {st:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(waiting.recovering && !waiting.needs_resume, "{waiting:?}");
    assert_eq!(
        waiting.agent_recovery.as_ref().map(|r| r.stage),
        Some(sessiond_domain::RecoveryStage::WaitingToRetry),
        "{waiting:?}"
    );
    w.wait_agent_back(&mgr, s.id, seq).await;
    w.track(s.id).await;
    w.finish(&mgr, &[s.id]).await;
}

/// helper-39 10: an agent that exits as it starts was reported as "agentctl
/// at ... is unreachable: ... the agent's connection closed": agentctl was
/// reached, and the agent's exit status was what the user needed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_exits_at_start_is_reported_with_its_exit_status() {
    let w = World::new(Db::Sqlite).await;
    let args = ["-c".to_owned(), "echo starting >&2; exit 3".to_owned()];
    let profile = w.upsert_profile("exits", "/bin/sh", &args, &[], true).await;
    let mgr = w.manager();
    let s = w.create_with(&mgr, "exits", &profile, None).await;
    assert_eq!(s.state, SessionState::Error, "{s:?}");
    let why = s.error_message.clone().unwrap_or_default();
    assert!(
        why.contains("the agent exited during ACP initialize (exit code 3)"),
        "{why}"
    );
    assert!(!why.contains("unreachable"), "{why}");
    w.finish(&mgr, &[]).await;
}

/// helper-40 1: the Claude Code adapter whose CLI died lives on, and every
/// prompt then fails "Session not found", while the session showed healthy
/// and a resume changed nothing. A turn failing so has sessiond relaunch
/// the agent, which loads the conversation again: the next message works
/// and the history is there. (The demo agent fails its prompts the same
/// way while a file exists.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_lost_its_conversation_is_relaunched_and_loads_it() {
    lost_conversation_relaunched(false, "Session not found").await;
}

/// helper-46 F1: the adapter 0.101 forgets the conversation of a CLI that
/// died while idle and answers every prompt ACP's -32002 "Resource not
/// found" naming the session: the session was stuck for good, its resume
/// a no-op. Taken as the lost conversation above.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_forgot_the_session_is_relaunched_and_loads_it() {
    lost_conversation_relaunched(true, "Resource not found").await;
}

async fn lost_conversation_relaunched(not_found: bool, says: &str) {
    let w = World::new(Db::Sqlite).await;
    let lost = w.path("lost-session");
    let form = if not_found { "true" } else { "false" };
    let profile = w
        .demo_profile(
            "forgets",
            &[
                ("ACP_DEMO_LOST_SESSION_FILE", lost.to_str().unwrap()),
                ("ACP_DEMO_LOST_SESSION_NOT_FOUND", form),
            ],
        )
        .await;
    let mgr = w.manager();
    let s = w.create_with(&mgr, "forgets", &profile, None).await;
    let token = s.resume_token.clone().unwrap();
    w.prompt(&mgr, s.id, "one").await;
    let agentctl = w.record(s.id).await.pid.unwrap();
    let before = demo_agents_under(agentctl);

    std::fs::write(&lost, "").unwrap();
    mgr.send_message(w.task.id, s.id, "two").await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let msgs = w.messages(s.id).await;
        if msgs
            .last()
            .is_some_and(|m| m.role == MessageRole::System && m.content.contains(says))
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the failed turn never ended: {msgs:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    std::fs::remove_file(&lost).unwrap();

    // Back by itself: another agent process under the same agentctl.
    w.wait_new_agent(&mgr, s.id, agentctl, &before).await;
    // Watchers saw it: the session went STARTING (saying why) and came back,
    // and the failed turn's note says to send the message again.
    let changes: Vec<_> = w
        .events(s.id)
        .await
        .into_iter()
        .filter_map(|e| match e.payload {
            EventPayload::StateChanged {
                to, error_message, ..
            } => Some((to, error_message)),
            _ => None,
        })
        .collect();
    let lost_at = changes
        .iter()
        .position(|(to, why)| {
            *to == SessionState::Error
                && why
                    .as_deref()
                    .is_some_and(|m| m.contains("the agent lost the conversation"))
        })
        .unwrap_or_else(|| panic!("no restart announced: {changes:?}"));
    assert_eq!(
        changes[lost_at + 1..]
            .iter()
            .map(|(to, _)| *to)
            .take(2)
            .collect::<Vec<_>>(),
        [SessionState::Starting, SessionState::WaitingForInput],
        "{changes:?}"
    );
    let notes = w.messages(s.id).await;
    assert!(
        notes
            .iter()
            .any(|m| m.role == MessageRole::System && m.content.contains("send the message again")),
        "{notes:?}"
    );
    let reply = w.prompt(&mgr, s.id, "three").await;
    assert_eq!(reply, expected_reply(2, &token, "three"));
    w.track(s.id).await;
    w.finish(&mgr, &[s.id]).await;
}

/// helper-40 3, helper-43 1: agentctl or the agent killed while the agent
/// started (the create still waiting on it) left the session ERROR for
/// good, blaming the profile. Such a kill passes by itself: the create
/// brings the session up through recovery and answers it WAITING.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agentctl_killed_while_the_agent_starts_does_not_fail_the_create() {
    killed_while_the_agent_starts(Killed::Agentctl).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_killed_while_it_starts_does_not_fail_the_create() {
    killed_while_the_agent_starts(Killed::Agent).await;
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Killed {
    Agentctl,
    Agent,
}

async fn killed_while_the_agent_starts(killed: Killed) {
    let w = World::new(Db::Sqlite).await;
    let (gated, gate) = w.gated_profile("gated").await;
    std::fs::write(&gate, b"closed").unwrap();
    let mgr = w.manager();
    let create = {
        let (mgr, req) = (mgr.clone(), w.new_session("lost", &gated));
        tokio::spawn(async move { mgr.create_session(req).await })
    };
    // The agent waits at its gate: agentctl is up and recorded.
    let deadline = Instant::now() + Duration::from_secs(60);
    let (first, agent) = loop {
        let sessions = w.store.list_sessions(w.task.id).await.unwrap();
        if let Some(s) = sessions.first()
            && let Some(r) = w.store.get_executor_for_session(s.id).await.unwrap()
            && r.status == ExecutorStatus::Ready
            && let Some(pid) = r.pid
            && let [agent] = demo_agents_under(pid)[..]
        {
            break (r, agent);
        }
        assert!(Instant::now() < deadline, "the agent never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let victim = match killed {
        Killed::Agentctl => first.pid.unwrap(),
        Killed::Agent => agent,
    };
    kill9(victim);
    while is_running(victim) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    std::fs::remove_file(&gate).unwrap();

    let s = create.await.unwrap().expect("the create answers");
    w.track(s.id).await;
    assert_eq!(
        s.state,
        SessionState::WaitingForInput,
        "{killed:?}: {:?}",
        s.error_message
    );
    let token = s.resume_token.clone().expect("a conversation was opened");
    let record = w.record(s.id).await;
    assert_eq!(record.status, ExecutorStatus::Ready, "{record:?}");
    if killed == Killed::Agentctl {
        assert!(record.generation > first.generation, "{record:?}");
        assert_ne!(record.pid, first.pid, "a new agentctl");
    }
    let reply = w.prompt(&mgr, s.id, "hello").await;
    assert_eq!(reply, expected_reply(1, &token, "hello"));
    w.finish(&mgr, &[s.id]).await;
}

/// helper-44 9: a relative (or NUL-holding) worktree path reached the
/// engine from an embedder and was answered "no longer exists" for a
/// session never stored. It is refused as input, and nothing is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worktree_path_that_is_not_absolute_is_refused_as_input() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager();
    for path in ["relative/dir", "/tmp/with\0nul"] {
        let mut req = w.new_session("refused", &w.profile);
        req.worktree.path = path.to_owned();
        let err = mgr.create_session(req).await.unwrap_err();
        assert!(
            matches!(&err, sessiond_engine::Error::InvalidArgument(m) if m.contains("not an absolute path")),
            "{path:?}: {err}"
        );
    }
    assert!(w.store.list_sessions(w.task.id).await.unwrap().is_empty());
    w.finish(&mgr, &[]).await;
}

/// helper-45 F1: past the restart limit, an agent that lost its
/// conversation was left running (a live adapter over a dead CLI): the
/// session said to resume, and the resume found the agent running and
/// changed nothing. The agent is stopped; the resume brings it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_restart_limit_a_lost_conversation_comes_back_on_resume() {
    let w = World::new(Db::Sqlite).await;
    let lost = w.path("lost-session");
    let profile = w
        .demo_profile(
            "forgets",
            &[("ACP_DEMO_LOST_SESSION_FILE", lost.to_str().unwrap())],
        )
        .await;
    let mgr = w.manager_with(ManagerConfig {
        agent_restarts: 0,
        ..w.config()
    });
    let s = w.create_with(&mgr, "forgets", &profile, None).await;
    let token = s.resume_token.clone().unwrap();
    w.prompt(&mgr, s.id, "one").await;

    std::fs::write(&lost, "").unwrap();
    mgr.send_message(w.task.id, s.id, "two").await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let st = loop {
        let st = w.status(&mgr, s.id).await;
        if st.state == SessionState::Error && !st.is_agent_running && st.needs_resume {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "the agent that lost the conversation was left running: {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        st.error_message
            .as_deref()
            .is_some_and(|m| m.contains("resume the session")),
        "{st:?}"
    );
    let notes = w.messages(s.id).await;
    assert!(
        notes.last().is_some_and(|m| m.role == MessageRole::System
            && m.content.contains("resume the session to continue")),
        "{notes:?}"
    );
    std::fs::remove_file(&lost).unwrap();

    let resumed = mgr.resume_session(w.task.id, s.id).await.unwrap();
    assert!(resumed.is_agent_running, "{resumed:?}");
    let reply = w.prompt(&mgr, s.id, "three").await;
    assert_eq!(reply, expected_reply(2, &token, "three"));
    w.track(s.id).await;
    w.finish(&mgr, &[s.id]).await;
}

/// helper-43 2, helper-45 F4: after a cancel, the Claude Code adapter
/// (0.23) ends the next turn at once with the stop the cancelled turn left
/// behind, and every later reply comes one turn late (the demo agent does
/// the same with `ACP_DEMO_STALE_STOP_AFTER_CANCEL`). That turn's empty
/// end restarts the agent, which loads the conversation in step: the note
/// says to send the message again, and the next replies are their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_stop_after_a_cancel_restarts_the_agent_in_step() {
    let w = World::new(Db::Sqlite).await;
    let profile = w
        .demo_profile("stale", &[("ACP_DEMO_STALE_STOP_AFTER_CANCEL", "1")])
        .await;
    let mgr = w.manager();
    let s = w.create_with(&mgr, "stale", &profile, None).await;
    let token = s.resume_token.clone().unwrap();
    w.prompt(&mgr, s.id, "one").await;
    let agentctl = w.record(s.id).await.pid.unwrap();

    // More cancels than the restart limit (3 in 10 minutes): the restarts
    // they need are the user's doing, not counted (helper-48 A: the fourth
    // left the session ERROR).
    for round in 0..4 {
        let before = demo_agents_under(agentctl);
        let long = mgr.send_message(w.task.id, s.id, "/long").await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !w
            .messages(s.id)
            .await
            .iter()
            .any(|m| m.role == MessageRole::Agent && m.seq > long.seq && m.content.contains("[1]"))
        {
            assert!(
                Instant::now() < deadline,
                "round {round}: the long reply never began"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(mgr.cancel_turn(w.task.id, s.id).await.unwrap());
        w.wait_state(&mgr, s.id, SessionState::WaitingForInput)
            .await;

        // The stale stop: the turn ends at once, and the agent is restarted.
        let two = mgr.send_message(w.task.id, s.id, "two").await.unwrap();
        w.wait_new_agent(&mgr, s.id, agentctl, &before).await;
        let msgs = w.messages(s.id).await;
        assert!(
            msgs.last()
                .is_some_and(|m| m.role == MessageRole::System
                    && m.content.contains("send the message again")),
            "round {round}: {msgs:?}"
        );
        // Clients see a failed turn, not the agent's `end_turn` (helper-46
        // F3: `sessionctl send` exited 0 with nothing answered).
        let ended = w
            .events(s.id)
            .await
            .into_iter()
            .find_map(|e| match e.payload {
                EventPayload::TurnEnded {
                    turn_id,
                    stop_reason,
                    ..
                } if turn_id == two.id.to_string() => Some(stop_reason),
                _ => None,
            });
        assert_eq!(ended.as_deref(), Some("error"), "round {round}");
        w.wait_state(&mgr, s.id, SessionState::WaitingForInput)
            .await;
    }
    // In step again: each reply answers its own prompt.
    let reply = w.prompt(&mgr, s.id, "three").await;
    assert_eq!(reply, expected_reply(2, &token, "three"));
    let reply = w.prompt(&mgr, s.id, "four").await;
    assert_eq!(reply, expected_reply(3, &token, "four"));
    w.track(s.id).await;
    w.finish(&mgr, &[s.id]).await;
}

/// helper-46 F4: agentctl killed between the create and the first message
/// of an agent that stores nothing before its first prompt (Claude Code,
/// codex): the first message found agentctl gone, the relaunched agent
/// could not load the never-prompted conversation, and the session ended
/// ERROR `resume_failed` for good (the message never reached any agent). A
/// new conversation now replaces it, and the message is delivered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agentctl_killed_before_the_first_message_loses_nothing() {
    let w = World::new(Db::Sqlite).await;
    let profile = w
        .demo_profile("lazy", &[("ACP_DEMO_LAZY_PERSIST", "true")])
        .await;
    let mgr = w.manager();
    let s = w.create_with(&mgr, "lazy", &profile, None).await;
    let old = w.record(s.id).await;
    crate::support::kill_tree(old.pid.unwrap()).await;

    let sent = mgr.send_message(w.task.id, s.id, "first").await;
    assert!(sent.is_ok(), "{sent:?}");
    let deadline = Instant::now() + Duration::from_secs(60);
    let reply = loop {
        let st = w.status(&mgr, s.id).await;
        assert_ne!(st.state, SessionState::Error, "{st:?}");
        let msgs = w.messages(s.id).await;
        if st.state == SessionState::WaitingForInput
            && let Some(m) = msgs.iter().find(|m| {
                m.role == MessageRole::Agent && m.kind == sessiond_domain::MessageKind::Text
            })
        {
            let users = msgs.iter().filter(|m| m.role == MessageRole::User).count();
            assert_eq!(users, 1, "{msgs:?}");
            break m.content.clone();
        }
        assert!(
            Instant::now() < deadline,
            "the first message was never answered: {st:?} {msgs:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let now = w.store.get_session(s.id).await.unwrap();
    let token = now.resume_token.clone().unwrap();
    assert_ne!(Some(&token), s.resume_token.as_ref(), "not replaced");
    assert_eq!(reply, expected_reply(1, &token, "first"));
    assert!(
        w.events(s.id)
            .await
            .iter()
            .any(|e| matches!(e.payload, EventPayload::ConversationReplaced { .. })),
        "no ConversationReplaced event"
    );
    let reply = w.prompt(&mgr, s.id, "second").await;
    assert_eq!(reply, expected_reply(2, &token, "second"));
    w.track(s.id).await;
    w.finish(&mgr, &[s.id]).await;
}

/// helper-50 1: PostgreSQL refuses NUL (U+0000) in text. A reply holding
/// one (the agent read a binary file) failed every write of its turn,
/// which stayed RUNNING for good; a user message holding one reached the
/// agent and was never stored. The agent's NULs are stored as U+FFFD, and
/// a message with one is refused before anything reaches the agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nul_in_text_neither_sticks_a_turn_nor_reaches_the_agent_unstored() {
    let w = World::new(Db::Postgres).await;
    let profile = w.demo_profile("plain", &[]).await;
    let mgr = w.manager();
    let s = w.create_with(&mgr, "nul", &profile, None).await;
    let file = std::path::Path::new(&s.worktree.path).join("nul.txt");
    std::fs::write(&file, b"before\0after").unwrap();

    let reply = w
        .prompt(&mgr, s.id, &format!("/read {}", file.display()))
        .await;
    assert!(reply.contains("read: before\u{FFFD}after"), "{reply}");
    w.wait_state(&mgr, s.id, SessionState::WaitingForInput)
        .await;

    let before = w.all_messages(s.id).await.len();
    let err = mgr.send_message(w.task.id, s.id, "a\0b").await.unwrap_err();
    assert_eq!(
        err.kind(),
        sessiond_engine::ErrorKind::InvalidArgument,
        "{err}"
    );
    assert!(err.to_string().contains("NUL"), "{err}");
    assert_eq!(w.all_messages(s.id).await.len(), before, "nothing stored");
    let token = s.resume_token.clone().unwrap();
    let next = w.prompt(&mgr, s.id, "after").await;
    assert_eq!(next, expected_reply(2, &token, "after"));
    w.track(s.id).await;
    w.finish(&mgr, &[s.id]).await;
}
