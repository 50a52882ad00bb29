//! The database goes away while agents work (PostgreSQL behind a proxy the
//! test cuts), and comes back: nothing the agents did meanwhile is lost.

use std::time::{Duration, Instant};

use sessiond_domain::{MessageRole, SessionState};

use crate::support::{World, expected_reply};

/// helper-42 1: a turn that ended while PostgreSQL was down was read past
/// and never stored: the session stayed RUNNING (its reply unfinished, the
/// queue stuck) until sessiond restarted. The pump now reads the agent's
/// updates again from the stored cursor once the database answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_that_ends_while_the_database_is_down_is_stored_once_it_is_back() {
    let (w, proxy) = World::postgres_through_proxy().await;
    // The agent holds its answer after its last (third) chunk while the
    // gate exists: the whole reply is stored before the database goes, and
    // only the turn's end comes while it is away.
    let gate = w.path("mid-gate");
    let profile = w
        .demo_profile(
            "held",
            &[
                ("ACP_DEMO_MID_GATE_FILE", gate.to_str().unwrap()),
                ("ACP_DEMO_MID_GATE_AFTER", "3"),
            ],
        )
        .await;
    let mgr = w.manager();
    let s = w.create_with(&mgr, "outage", &profile, None).await;
    let token = s.resume_token.clone().unwrap();
    w.prompt(&mgr, s.id, "one").await;

    std::fs::write(&gate, b"closed").unwrap();
    mgr.send_message(w.task.id, s.id, "two").await.unwrap();
    let whole = expected_reply(2, &token, "two");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !w
        .messages(s.id)
        .await
        .last()
        .is_some_and(|m| m.role == MessageRole::Agent && m.content == whole)
    {
        assert!(Instant::now() < deadline, "the reply was never stored");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    proxy.cut();
    let seen = proxy.refused();
    std::fs::remove_file(&gate).unwrap();
    // The turn ends; sessiond tries to store its end (a connection refused
    // since the agent went on: nothing else of this test uses the store).
    let deadline = Instant::now() + Duration::from_secs(60);
    while proxy.refused() == seen {
        assert!(Instant::now() < deadline, "nothing tried the database");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    proxy.restore();

    // The turn's end is stored: the reply complete, the session waiting.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let msgs = w.messages(s.id).await;
        let st = w.status(&mgr, s.id).await;
        if st.state == SessionState::WaitingForInput
            && msgs
                .last()
                .is_some_and(|m| m.complete && m.content == whole)
        {
            let users = msgs.iter().filter(|m| m.role == MessageRole::User).count();
            assert_eq!(users, 2, "{msgs:?}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the turn's end was never stored: {st:?} {msgs:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let reply = w.prompt(&mgr, s.id, "three").await;
    assert_eq!(reply, expected_reply(3, &token, "three"));
    w.track(s.id).await;
    w.finish(&mgr, &[s.id]).await;
}

/// The database goes away in the middle of a reply (its chunks stored in
/// part) and stays away past the turn's end: once it is back the reply is
/// stored whole, each chunk once, and the session takes the next message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_cut_by_a_database_outage_is_stored_whole_once() {
    let (w, proxy) = World::postgres_through_proxy().await;
    let profile = w
        .demo_profile(
            "slow",
            &[
                ("ACP_DEMO_CHUNK_DELAY_MS", "150"),
                ("ACP_DEMO_EXTRA_CHUNKS", "8"),
            ],
        )
        .await;
    let mgr = w.manager();
    let s = w.create_with(&mgr, "mid-reply", &profile, None).await;
    let token = s.resume_token.clone().unwrap();
    let extras = " [1] [2] [3] [4] [5] [6] [7] [8]";
    let agentctl = w.agentctl(&w.record(s.id).await);

    mgr.send_message(w.task.id, s.id, "one").await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while w.messages(s.id).await.len() < 2 {
        assert!(Instant::now() < deadline, "the reply never began");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    proxy.cut();
    let seen = proxy.refused();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let h = agentctl.health().await.unwrap();
        if h.agent_state == sessiond_executor::AgentState::Ready && proxy.refused() > seen {
            break;
        }
        assert!(Instant::now() < deadline, "the turn never ended: {h:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    proxy.restore();

    let whole = format!("{}{extras}", expected_reply(1, &token, "one"));
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let msgs = w.messages(s.id).await;
        let st = w.status(&mgr, s.id).await;
        if st.state == SessionState::WaitingForInput && msgs.last().is_some_and(|m| m.complete) {
            assert_eq!(msgs.len(), 2, "{msgs:?}");
            assert_eq!(msgs[1].content, whole, "{msgs:?}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the turn's end was never stored: {st:?} {msgs:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let reply = w.prompt(&mgr, s.id, "two").await;
    assert_eq!(
        reply,
        format!("{}{extras}", expected_reply(2, &token, "two"))
    );
    w.track(s.id).await;
    w.finish(&mgr, &[s.id]).await;
}

/// helper-45 F2: the database went away while a create waited for its
/// agent (the session and agentctl stored, the conversation not): the
/// create answered UNAVAILABLE and the session stayed STARTING until a
/// restart. The create now answers the session, which comes up by itself
/// once the database is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_cut_by_a_database_outage_comes_up_once_it_is_back() {
    let (w, proxy) = World::postgres_through_proxy().await;
    let (gated, gate) = w.gated_profile("gated").await;
    std::fs::write(&gate, b"closed").unwrap();
    let mgr = w.manager();
    let create = {
        let (mgr, req) = (mgr.clone(), w.new_session("cut", &gated));
        tokio::spawn(async move { mgr.create_session(req).await })
    };
    // agentctl is up and stored; the agent waits at its gate.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let sessions = w.store.list_sessions(w.task.id).await.unwrap();
        if let Some(s) = sessions.first()
            && let Some(r) = w.store.get_executor_for_session(s.id).await.unwrap()
            && r.status == sessiond_domain::ExecutorStatus::Ready
        {
            break;
        }
        assert!(Instant::now() < deadline, "agentctl never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    proxy.cut();
    std::fs::remove_file(&gate).unwrap();
    // The conversation opens; storing it fails.
    let s = create
        .await
        .unwrap()
        .expect("the stored session is answered, not UNAVAILABLE");
    assert_eq!(s.state, SessionState::Starting, "{s:?}");
    proxy.restore();

    let deadline = Instant::now() + Duration::from_secs(60);
    let st = loop {
        let st = w.status(&mgr, s.id).await;
        if st.state == SessionState::WaitingForInput && st.is_agent_running {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "the session never came up: {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let token = w.store.get_session(s.id).await.unwrap().resume_token;
    let token = token.unwrap_or_else(|| panic!("no conversation stored: {st:?}"));
    let reply = w.prompt(&mgr, s.id, "hello").await;
    assert_eq!(reply, expected_reply(1, &token, "hello"));
    w.track(s.id).await;
    w.finish(&mgr, &[s.id]).await;
}

/// helper-45 F8: a cancel while the database was away was refused
/// UNAVAILABLE and the turn ran on. It now reaches the agent (from the
/// session as last committed); the cancelled turn's end is stored once the
/// database is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_while_the_database_is_down_stops_the_turn() {
    let (w, proxy) = World::postgres_through_proxy().await;
    let profile = w.demo_profile("plain", &[]).await;
    let mgr = w.manager();
    let s = w.create_with(&mgr, "cancel-outage", &profile, None).await;
    let token = s.resume_token.clone().unwrap();
    let agentctl = w.agentctl(&w.record(s.id).await);

    // `/long`: 600 chunks 100 ms apart, a minute unless cancelled.
    mgr.send_message(w.task.id, s.id, "/long").await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while w.messages(s.id).await.len() < 2 {
        assert!(Instant::now() < deadline, "the reply never began");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    proxy.cut();
    let cancelled = mgr.cancel_turn(w.task.id, s.id).await;
    assert!(matches!(cancelled, Ok(true)), "{cancelled:?}");
    // The agent ended its turn while the database is still away.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let h = agentctl.health().await.unwrap();
        if h.agent_state == sessiond_executor::AgentState::Ready {
            break;
        }
        assert!(Instant::now() < deadline, "the turn runs on: {h:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    proxy.restore();

    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let msgs = w.messages(s.id).await;
        let st = w.status(&mgr, s.id).await;
        if st.state == SessionState::WaitingForInput {
            let reply = msgs.iter().rev().find(|m| m.role == MessageRole::Agent);
            assert!(
                reply.is_some_and(|m| !m.content.contains("[600]")),
                "the turn ran to its end: {msgs:?}"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the cancelled turn's end was never stored: {st:?} {msgs:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The demo agent numbers the turns it finished: the cancelled one is
    // not among them.
    let reply = w.prompt(&mgr, s.id, "after").await;
    assert_eq!(reply, expected_reply(1, &token, "after"));
    w.track(s.id).await;
    w.finish(&mgr, &[s.id]).await;
}
