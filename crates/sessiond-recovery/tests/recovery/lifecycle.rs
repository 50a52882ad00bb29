use sessiond_domain::{
    EventKind, EventPayload, ExecutorStatus, MessageRole, SessionState, TaskState,
};

use crate::support::{Db, World, assert_consecutive, expected_reply};

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

/// The agent crashing in the middle of a turn puts the session in ERROR
/// with a message that says what happened and what to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_exit_mid_turn_is_error() {
    let w = World::new(Db::Sqlite).await;
    let crashing = w
        .demo_profile("crash", &[("ACP_DEMO_CRASH_MID_TURN", "1")])
        .await;
    let mgr = w.manager();
    let s = w.create_with(&mgr, "crash", &crashing, None).await;
    mgr.send_message(w.task.id, s.id, "boom").await.unwrap();
    w.wait_state(&mgr, s.id, SessionState::Error).await;
    let st = w.status(&mgr, s.id).await;
    let msg = st.error_message.unwrap();
    assert!(msg.contains("exit"), "{msg}");
    assert!(msg.contains("resume the session"), "{msg}");
    assert!(!st.is_agent_running);
    assert!(
        st.needs_resume,
        "an exited agent with a token can be resumed"
    );
    // The partial reply is one complete message.
    let msgs = w.messages(s.id).await;
    assert_eq!(msgs.len(), 2);
    assert!(msgs[1].complete);
    assert_consecutive(&w.events(s.id).await, 1);
    w.finish(&mgr, &[s.id]).await;
}

/// A profile whose command does not exist: the session is ERROR with an
/// actionable message; the executor (workspace) is still usable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_profile_is_error_with_message() {
    let w = World::new(Db::Sqlite).await;
    let now = chrono::Utc::now();
    let broken = w
        .store
        .upsert_agent_profile(&sessiond_domain::AgentProfile {
            id: sessiond_domain::AgentProfileId::new(),
            name: "broken".into(),
            command: "/nonexistent/agent".into(),
            args: vec![],
            env: Default::default(),
            supports_session_resume: true,
            container: None,
            created_at: now,
            updated_at: now,
        })
        .await
        .unwrap();
    let mgr = w.manager();
    let s = w.create_with(&mgr, "broken", &broken, None).await;
    assert_eq!(s.state, SessionState::Error);
    let msg = s.error_message.unwrap();
    assert!(
        msg.contains("broken") && msg.contains("create a new session"),
        "{msg}"
    );
    assert_eq!(w.record(s.id).await.status, ExecutorStatus::Ready);
    w.finish(&mgr, &[s.id]).await;
}
