//! A turn pending across a backend restart: "never lose a message".
//!
//! - The agent answered while the backend was down: the reply is stored
//!   before the session is WAITING_FOR_INPUT again, so the next user message
//!   always comes after it in the store.
//! - The user message was stored (session RUNNING) but the backend died
//!   before its Prompt reached agentctl: recovery (or an explicit resume)
//!   delivers it, and it is answered exactly once.
//! - A partial reply is stored for the pending turn and the agent is gone:
//!   the prompt reached the agent once, so it is not sent again; the reply is
//!   completed with a note.

use std::time::{Duration, Instant};

use chrono::Utc;
use sessiond_domain::{
    EventPayload, Message, MessageId, MessageRole, OutcomeLabel, ResumePolicy, Session,
    SessionState,
};
use sessiond_engine::{Error, ErrorKind, SessionManager};
use sessiond_store::Changeset;

use crate::support::{Db, World, expected_reply, kill_tree};

/// The agent's transcript of `s`: (prompt, reply) per turn.
pub(crate) fn transcript(w: &World, s: &Session) -> Vec<(String, String)> {
    transcript_in(&w.path("agent-state"), s)
}

/// The transcript of `s` kept by a demo agent whose state dir is `state_dir`.
pub(crate) fn transcript_in(state_dir: &std::path::Path, s: &Session) -> Vec<(String, String)> {
    let token = s.resume_token.clone().unwrap();
    let path = state_dir.join(format!("{token}.json"));
    let Ok(text) = std::fs::read_to_string(path) else {
        return Vec::new();
    };
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["turns"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|t| {
            (
                t["prompt"].as_str().unwrap().to_owned(),
                t["reply"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

async fn wait_transcript(w: &World, s: &Session, turns: usize) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while transcript(w, s).len() < turns {
        assert!(
            Instant::now() < deadline,
            "the agent never ran turn {turns}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What `send_message` commits before its Prompt: the user message and the
/// session RUNNING that turn. Returns the message.
pub(crate) async fn commit_user_message(w: &World, s: &Session, text: &str) -> Message {
    let s = w.store.get_session(s.id).await.unwrap();
    assert_eq!(s.state, SessionState::WaitingForInput);
    let now = Utc::now();
    let m = Message {
        id: MessageId::new(),
        session_id: s.id,
        task_id: s.task_id,
        role: MessageRole::User,
        content: text.into(),
        kind: sessiond_domain::MessageKind::Text,
        data: String::new(),
        seq: 0,
        complete: true,
        created_at: now,
        updated_at: now,
    };
    let mut running = s.clone();
    running.state = SessionState::Running;
    running.metadata.insert("turn_id".into(), m.id.to_string());
    w.store
        .commit(
            Changeset::new()
                .add_message(m.clone())
                .event(s.id, EventPayload::MessageAdded(m.clone()))
                .update_session(running)
                .event(
                    s.id,
                    EventPayload::StateChanged {
                        from: SessionState::WaitingForInput,
                        to: SessionState::Running,
                        error_message: None,
                    },
                ),
        )
        .await
        .unwrap();
    m
}

/// (role, content) of every stored message, in order.
async fn conversation(w: &World, s: &Session) -> Vec<(MessageRole, String)> {
    w.messages(s.id)
        .await
        .into_iter()
        .map(|m| (m.role, m.content))
        .collect()
}

/// Whenever the session is seen WAITING_FOR_INPUT, the reply to `text`
/// (turn `n`) is already stored, complete, right after its prompt. Waits
/// for WAITING_FOR_INPUT.
async fn assert_reply_before_waiting(
    w: &World,
    mgr: &SessionManager,
    s: &Session,
    n: usize,
    text: &str,
) {
    let token = s.resume_token.clone().unwrap();
    w.wait_state(mgr, s.id, SessionState::WaitingForInput).await;
    let msgs = w.messages(s.id).await;
    let u = msgs
        .iter()
        .position(|m| m.role == MessageRole::User && m.content == text)
        .expect("the user message is stored");
    let reply = msgs.get(u + 1).expect("a reply after it");
    assert_eq!(reply.role, MessageRole::Agent);
    assert_eq!(reply.content, expected_reply(n, &token, text));
    assert!(reply.complete);
}

/// The agent answered while the backend was down (agentctl buffered the
/// reply): after the restart the session stays RUNNING (no event) until the
/// replayed reply is stored, then goes WAITING_FOR_INPUT; a message sent as
/// soon as the session accepts one is stored after that reply.
async fn reply_given_while_down_is_stored_before_the_next_message(db: Db) {
    let w = World::new(db).await;
    let profile = w
        .demo_profile("slow", &[("ACP_DEMO_CHUNK_DELAY_MS", "200")])
        .await;
    let mgr = w.manager();
    let s = w.create_with(&mgr, "a", &profile, None).await;
    w.prompt(&mgr, s.id, "one").await;
    mgr.send_message(w.task.id, s.id, "two").await.unwrap();
    // The backend dies before the reply is stored.
    mgr.shutdown();
    drop(mgr);
    assert!(
        !w.messages(s.id)
            .await
            .iter()
            .any(|m| m.role == MessageRole::Agent && m.content.contains("two")),
        "the reply was stored before the crash; the test needs a slower turn"
    );
    wait_transcript(&w, &s, 2).await;
    let seq_before = w.store.last_event_seq(s.id).await.unwrap();

    let mgr = w.manager();
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::Reattached), 1, "{summary:?}");
    // Send as soon as the session takes a message.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let st = w.status(&mgr, s.id).await;
        if st.state == SessionState::WaitingForInput {
            // Seen WAITING: the reply is there.
            let msgs = w.messages(s.id).await;
            assert_eq!(
                msgs.last().map(|m| (m.role, m.complete)),
                Some((MessageRole::Agent, true)),
                "WAITING_FOR_INPUT before the reply was stored: {msgs:?}"
            );
        }
        match mgr.send_message(w.task.id, s.id, "three").await {
            Ok(_) => break,
            Err(e) => {
                assert!(Instant::now() < deadline, "never accepted: {e}");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }
    w.wait_state(&mgr, s.id, SessionState::WaitingForInput)
        .await;
    let token = s.resume_token.clone().unwrap();
    let expected: Vec<(MessageRole, String)> = ["one", "two", "three"]
        .iter()
        .enumerate()
        .flat_map(|(i, t)| {
            [
                (MessageRole::User, (*t).to_owned()),
                (MessageRole::Agent, expected_reply(i + 1, &token, t)),
            ]
        })
        .collect();
    assert_eq!(conversation(&w, &s).await, expected);
    // The restart itself published no state change: RUNNING stayed RUNNING
    // until the replayed TurnEnded; the reply's events come before it.
    let events: Vec<EventPayload> = w
        .events(s.id)
        .await
        .into_iter()
        .filter(|e| e.seq > seq_before)
        .map(|e| e.payload)
        .collect();
    let first_state = events
        .iter()
        .position(|p| matches!(p, EventPayload::StateChanged { .. }))
        .unwrap();
    assert!(
        matches!(
            events[first_state],
            EventPayload::StateChanged {
                from: SessionState::Running,
                to: SessionState::WaitingForInput,
                ..
            }
        ),
        "{events:?}"
    );
    assert!(
        events[..first_state]
            .iter()
            .any(|p| matches!(p, EventPayload::MessageAdded(m) | EventPayload::MessageUpdated(m) if m.role == MessageRole::Agent && m.complete)),
        "the reply is stored before the turn ends: {events:?}"
    );
    assert_eq!(transcript(&w, &s).len(), 3);
    w.finish(&mgr, &[s.id]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reply_given_while_down_is_stored_before_the_next_message_sqlite() {
    reply_given_while_down_is_stored_before_the_next_message(Db::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reply_given_while_down_is_stored_before_the_next_message_postgres() {
    reply_given_while_down_is_stored_before_the_next_message(Db::Postgres).await;
}

/// The user message is stored, the backend died before its Prompt: the same
/// agentctl (reattached) gets it after the restart, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undelivered_message_is_delivered_after_a_reattach() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager();
    let s = w.create(&mgr, "a").await;
    let token = s.resume_token.clone().unwrap();
    w.prompt(&mgr, s.id, "one").await;
    mgr.shutdown();
    drop(mgr);
    commit_user_message(&w, &s, "two").await;

    let mgr = w.manager();
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::Reattached), 1, "{summary:?}");
    assert_reply_before_waiting(&w, &mgr, &s, 2, "two").await;
    assert_eq!(
        transcript(&w, &s)
            .iter()
            .map(|(p, _)| p.as_str())
            .collect::<Vec<_>>(),
        ["one", "two"],
        "the agent got the message exactly once"
    );
    // A second restart changes nothing: the turn is over.
    mgr.shutdown();
    drop(mgr);
    let mgr = w.manager();
    mgr.recovery().recover_all().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(transcript(&w, &s).len(), 2);
    let reply = w.prompt(&mgr, s.id, "three").await;
    assert_eq!(reply, expected_reply(3, &token, "three"));
    assert_eq!(conversation(&w, &s).await.len(), 6);
    w.finish(&mgr, &[s.id]).await;
}

/// A message queued behind a turn whose end was committed just before the
/// backend died, the delivery not yet made: the session is idle with a
/// queue nothing held. The restarted backend delivers it by itself, once
/// (an outside campaign found it waiting for the user's next message).
async fn queued_behind_an_ended_turn_then_restart(db: Db) {
    let w = World::new(db).await;
    let mgr = w.manager();
    let s = w.create(&mgr, "a").await;
    w.prompt(&mgr, s.id, "one").await;
    mgr.shutdown();
    drop(mgr);
    let mut idle = w.store.get_session(s.id).await.unwrap();
    assert_eq!(idle.state, SessionState::WaitingForInput);
    sessiond_domain::queue::enqueue(
        &mut idle.metadata,
        &sessiond_domain::queue::QueuedMessage {
            id: MessageId::new(),
            content: "two".into(),
            queued_at: Utc::now(),
        },
    );
    w.store
        .commit(Changeset::new().update_session(idle))
        .await
        .unwrap();

    let mgr = w.manager();
    mgr.recovery().recover_all().await.unwrap();
    wait_transcript(&w, &s, 2).await;
    assert_reply_before_waiting(&w, &mgr, &s, 2, "two").await;
    let after = w.store.get_session(s.id).await.unwrap();
    assert!(
        sessiond_domain::queue::is_empty(&after.metadata),
        "{:?}",
        after.metadata
    );
    assert_eq!(
        transcript(&w, &s)
            .iter()
            .map(|(p, _)| p.as_str())
            .collect::<Vec<_>>(),
        ["one", "two"],
        "delivered once"
    );
    w.finish(&mgr, &[s.id]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_queued_behind_an_ended_turn_is_delivered_after_a_restart() {
    queued_behind_an_ended_turn_then_restart(Db::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_queued_behind_an_ended_turn_is_delivered_after_a_restart_postgres() {
    queued_behind_an_ended_turn_then_restart(Db::Postgres).await;
}

/// The same, with agentctl and agent killed while the backend was down: the
/// new agentctl (session/load) gets the message, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undelivered_message_is_delivered_after_a_relaunch() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager();
    let s = w.create(&mgr, "a").await;
    w.prompt(&mgr, s.id, "one").await;
    mgr.shutdown();
    drop(mgr);
    commit_user_message(&w, &s, "two").await;
    kill_tree(w.record(s.id).await.pid.unwrap()).await;

    let mgr = w.manager();
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::Resumed), 1, "{summary:?}");
    w.track(s.id).await;
    assert_reply_before_waiting(&w, &mgr, &s, 2, "two").await;
    assert_eq!(transcript(&w, &s).len(), 2);
    assert_eq!(conversation(&w, &s).await.len(), 4);
    w.finish(&mgr, &[s.id]).await;
}

/// Startup recovery on demand leaves the agent down (session RUNNING, the
/// message pending); the explicit resume delivers it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explicit_resume_delivers_the_pending_message() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager();
    let s = w.create(&mgr, "a").await;
    w.prompt(&mgr, s.id, "one").await;
    mgr.shutdown();
    drop(mgr);
    commit_user_message(&w, &s, "two").await;
    kill_tree(w.record(s.id).await.pid.unwrap()).await;

    let mut config = w.config();
    config.resume_policy = ResumePolicy::OnDemand;
    let mgr = w.manager_with(config);
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::ExecutorOnly), 1, "{summary:?}");
    w.track(s.id).await;
    assert_eq!(w.status(&mgr, s.id).await.state, SessionState::Running);
    assert_eq!(transcript(&w, &s).len(), 1);
    // No agent to finish the turn: a send says to resume, not to wait
    // (helper-44 4).
    let refused = mgr
        .send_message(w.task.id, s.id, "meanwhile")
        .await
        .unwrap_err();
    assert!(
        matches!(refused, sessiond_engine::Error::AgentNotRunning { .. })
            && refused.to_string().contains("resume"),
        "{refused}"
    );

    let st = mgr.resume_session(w.task.id, s.id).await.unwrap();
    assert!(st.is_agent_running, "{st:?}");
    assert_reply_before_waiting(&w, &mgr, &s, 2, "two").await;
    assert_eq!(transcript(&w, &s).len(), 2);
    assert_eq!(conversation(&w, &s).await.len(), 4);
    w.finish(&mgr, &[s.id]).await;
}

/// A partial reply is stored for the pending turn and agentctl with its
/// agent died: the prompt had reached the agent, so it is not sent again;
/// the partial reply is completed with a note and the session takes the
/// next message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_reply_is_completed_not_asked_again() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager();
    let s = w.create(&mgr, "a").await;
    let token = s.resume_token.clone().unwrap();
    w.prompt(&mgr, s.id, "one").await;
    mgr.shutdown();
    drop(mgr);
    commit_user_message(&w, &s, "two").await;
    let now = Utc::now();
    let partial = Message {
        id: MessageId::new(),
        session_id: s.id,
        task_id: s.task_id,
        role: MessageRole::Agent,
        content: "turn 2 ".into(),
        kind: sessiond_domain::MessageKind::Text,
        data: String::new(),
        seq: 0,
        complete: false,
        created_at: now,
        updated_at: now,
    };
    w.store
        .commit(
            Changeset::new()
                .add_message(partial.clone())
                .event(s.id, EventPayload::MessageAdded(partial.clone())),
        )
        .await
        .unwrap();
    kill_tree(w.record(s.id).await.pid.unwrap()).await;

    let mgr = w.manager();
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::Resumed), 1, "{summary:?}");
    w.track(s.id).await;
    w.wait_state(&mgr, s.id, SessionState::WaitingForInput)
        .await;
    let msgs = w.messages(s.id).await;
    assert_eq!(msgs.len(), 5, "{msgs:?}");
    let reply = &msgs[3];
    assert_eq!(reply.id, partial.id);
    assert!(reply.complete);
    assert!(
        reply.content.starts_with("turn 2 ") && reply.content.contains("interrupted"),
        "{reply:?}"
    );
    let note = &msgs[4];
    assert_eq!(note.role, MessageRole::System);
    assert!(note.content.contains("interrupted"), "{note:?}");
    assert_eq!(transcript(&w, &s).len(), 1, "the prompt was not run again");
    let reply = w.prompt(&mgr, s.id, "three").await;
    assert_eq!(reply, expected_reply(2, &token, "three"));
    w.finish(&mgr, &[s.id]).await;
}

/// Defect 1 of the crash campaign: sessiond died right after its Prompt
/// reached agentctl, the agent ran the turn (its tool call wrote to the
/// worktree), then agentctl was killed while sessiond was down. The
/// relaunched agentctl's journal says the turn was handed to an agent, so
/// recovery does not deliver it again: the turn ends *interrupted* (a system
/// message and its event), the side effect happened once, and the next
/// message works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_handed_to_a_killed_agentctl_is_interrupted_not_run_again() {
    let w = World::new(Db::Sqlite).await;
    let side = w.path("side-effects.txt");
    let (mgr, s, _) = interrupt_second_turn(&w, &side).await;
    w.prompt(&mgr, s.id, "three").await;
    assert_eq!(
        std::fs::read_to_string(&side).unwrap().lines().count(),
        3,
        "the next message runs once"
    );
    w.finish(&mgr, &[s.id]).await;
}

/// A session (demo agent with a side-effect file) answers "one"; then
/// sessiond dies right after its Prompt of "two" reached agentctl, the
/// agent runs the turn, agentctl is killed while sessiond is down, and the
/// restarted backend ends turn "two" interrupted. Returns the new manager,
/// the session and the user message "two".
async fn interrupt_second_turn(
    w: &World,
    side: &std::path::Path,
) -> (SessionManager, Session, Message) {
    let side_s = side.to_string_lossy().into_owned();
    let profile = w
        .demo_profile("side", &[("ACP_DEMO_SIDE_EFFECT_FILE", side_s.as_str())])
        .await;
    let mgr = w.manager();
    let s = w.create_with(&mgr, "a", &profile, None).await;
    w.prompt(&mgr, s.id, "one").await;
    let err = mgr.retry_turn(w.task.id, s.id, None).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::FailedPrecondition, "{err}");
    assert!(matches!(err, Error::TurnNotInterrupted { .. }), "{err}");
    mgr.shutdown();
    drop(mgr);
    let m = commit_user_message(w, &s, "two").await;
    let record = w.record(s.id).await;
    let p = w
        .agentctl(&record)
        .prompt(sessiond_proto::agentctl::v1::PromptRequest {
            text: "two".into(),
            turn_id: m.id.to_string(),
            ..Default::default()
        })
        .await
        .expect("prompt");
    assert!(!p.already_accepted);
    wait_transcript(w, &s, 2).await;
    kill_tree(record.pid.unwrap()).await;

    let mgr = w.manager();
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::Resumed), 1, "{summary:?}");
    w.track(s.id).await;
    w.wait_state(&mgr, s.id, SessionState::WaitingForInput)
        .await;
    let msgs = w.messages(s.id).await;
    let last = msgs.last().unwrap();
    assert_eq!(last.role, MessageRole::System, "{msgs:?}");
    assert!(last.content.contains("interrupted"), "{last:?}");
    assert!(
        w.events(s.id).await.iter().any(|e| matches!(
            &e.payload,
            EventPayload::MessageAdded(x) if x.id == last.id
        )),
        "the interruption has its event"
    );
    assert_eq!(transcript(w, &s).len(), 2, "the prompt was not run again");
    // Operators see it among the turns by outcome.
    let mut registry = prometheus_client::registry::Registry::default();
    mgr.metrics().register(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.contains("sessiond_turns_total{outcome=\"interrupted\"} 1\n"),
        "{text}"
    );
    let lines = std::fs::read_to_string(side).unwrap();
    assert_eq!(lines.lines().collect::<Vec<_>>(), ["one", "two"]);
    (mgr, s, m)
}

/// An interrupted turn runs again only when the user retries it: a new user
/// message with the same content, answered once; the retry cannot be
/// repeated, and only the interrupted turn (named or the last) qualifies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_turn_runs_again_only_when_retried() {
    let w = World::new(Db::Sqlite).await;
    let side = w.path("side-effects.txt");
    let (mgr, s, two) = interrupt_second_turn(&w, &side).await;
    let token = s.resume_token.clone().unwrap();
    let msgs = w.messages(s.id).await;
    let one = msgs.iter().find(|m| m.content == "one").unwrap().id;
    let reply_one = msgs
        .iter()
        .find(|m| m.role == MessageRole::Agent)
        .unwrap()
        .id;

    let not_it = mgr
        .retry_turn(w.task.id, s.id, Some(one))
        .await
        .unwrap_err();
    assert!(
        matches!(not_it, Error::TurnNotInterrupted { .. }),
        "{not_it}"
    );
    let agent = mgr
        .retry_turn(w.task.id, s.id, Some(reply_one))
        .await
        .unwrap_err();
    assert_eq!(agent.kind(), ErrorKind::InvalidArgument, "{agent}");
    let unknown = mgr
        .retry_turn(w.task.id, s.id, Some(MessageId::new()))
        .await
        .unwrap_err();
    assert_eq!(unknown.kind(), ErrorKind::NotFound, "{unknown}");
    assert_eq!(
        std::fs::read_to_string(&side).unwrap().lines().count(),
        2,
        "refused retries ran nothing"
    );

    let (retry, retried) = mgr.retry_turn(w.task.id, s.id, Some(two.id)).await.unwrap();
    assert_eq!(retried, two.id);
    assert_ne!(retry.id, two.id, "a new user message");
    assert_eq!(
        (retry.role, retry.content.as_str()),
        (MessageRole::User, "two")
    );
    w.wait_state(&mgr, s.id, SessionState::WaitingForInput)
        .await;
    let msgs = w.messages(s.id).await;
    let last = msgs.last().unwrap();
    assert_eq!(last.role, MessageRole::Agent, "{msgs:?}");
    assert!(last.complete);
    assert_eq!(last.content, expected_reply(3, &token, "two"));
    assert_eq!(msgs[msgs.len() - 2].id, retry.id);
    assert_eq!(transcript(&w, &s).len(), 3);
    let lines = std::fs::read_to_string(&side).unwrap();
    assert_eq!(lines.lines().collect::<Vec<_>>(), ["one", "two", "two"]);

    // Once: neither the named turn nor "the last turn" can run again.
    for m in [Some(two.id), None] {
        let again = mgr.retry_turn(w.task.id, s.id, m).await.unwrap_err();
        assert!(matches!(again, Error::TurnNotInterrupted { .. }), "{again}");
    }
    assert_eq!(std::fs::read_to_string(&side).unwrap().lines().count(), 3);
    w.finish(&mgr, &[s.id]).await;
}

/// A session in ERROR whose metadata still names a pending turn, with no
/// agent running (what versions before every path to ERROR ended its turn
/// left behind; here written to the store as they wrote it: turn two's
/// user message, the first part of its reply, then the session ERROR and
/// its executor `error`, so no recovery pass loads it). Startup recovery
/// ends that turn interrupted in one commit (the partial reply marked, the
/// system message, `turn_ended`, the turn cleared and kept for RetryTurn),
/// the session staying ERROR; a second start changes nothing; and the
/// session resumes and continues.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_turn_in_an_error_session_is_settled_at_startup() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager();
    let s = w.create(&mgr, "stale").await;
    w.prompt(&mgr, s.id, "one").await;
    mgr.shutdown();
    drop(mgr);
    let rec = w.record(s.id).await;
    kill_tree(rec.pid.unwrap()).await;

    let two = commit_user_message(&w, &s, "two").await;
    let now = Utc::now();
    let partial = Message {
        id: MessageId::new(),
        session_id: s.id,
        task_id: s.task_id,
        role: MessageRole::Agent,
        content: "the first part".into(),
        kind: sessiond_domain::MessageKind::Text,
        data: String::new(),
        seq: 0,
        complete: false,
        created_at: now,
        updated_at: now,
    };
    let running = w.store.get_session(s.id).await.unwrap();
    let mut failed = running.clone();
    failed.state = SessionState::Error;
    failed.error_message = Some("agentctl stopped answering (an old version)".into());
    let mut rec = w.record(s.id).await;
    rec.status = sessiond_domain::ExecutorStatus::Error;
    rec.error_message = Some("agentctl stopped answering (an old version)".into());
    w.store
        .commit(
            Changeset::new()
                .add_message(partial.clone())
                .event(s.id, EventPayload::MessageAdded(partial.clone()))
                .update_session(failed)
                .update_executor(rec),
        )
        .await
        .unwrap();
    let stale = w.store.get_session(s.id).await.unwrap();
    assert_eq!(stale.metadata.get("turn_id"), Some(&two.id.to_string()));

    let mgr = w.manager();
    mgr.recovery().recover_all().await.unwrap();
    let after = w.store.get_session(s.id).await.unwrap();
    assert_eq!(after.state, SessionState::Error, "{after:?}");
    assert!(
        !after.metadata.contains_key("turn_id"),
        "the stale turn is cleared: {after:?}"
    );
    assert_eq!(
        after.metadata.get("interrupted_turn"),
        Some(&two.id.to_string()),
        "kept for RetryTurn: {after:?}"
    );
    let msgs = w.messages(s.id).await;
    let reply = msgs.iter().find(|m| m.id == partial.id).unwrap();
    assert!(
        reply.complete
            && reply.content.starts_with("the first part")
            && reply.content.contains("interrupted"),
        "the partial reply is marked, not completed as if whole: {reply:?}"
    );
    let last = msgs.last().unwrap();
    assert_eq!(last.role, MessageRole::System, "{msgs:?}");
    assert!(
        last.content.starts_with("the turn was interrupted"),
        "{last:?}"
    );
    let ended: Vec<_> = w
        .events(s.id)
        .await
        .into_iter()
        .filter_map(|e| match e.payload {
            EventPayload::TurnEnded {
                turn_id,
                stop_reason,
                ..
            } => Some((turn_id, stop_reason)),
            _ => None,
        })
        .collect();
    assert!(
        ended.contains(&(two.id.to_string(), "interrupted".to_owned())),
        "{ended:?}"
    );

    // Idempotent: another start writes nothing more.
    let seq = w.store.last_event_seq(s.id).await.unwrap();
    let count = msgs.len();
    mgr.shutdown();
    drop(mgr);
    let mgr = w.manager();
    mgr.recovery().recover_all().await.unwrap();
    assert_eq!(w.store.last_event_seq(s.id).await.unwrap(), seq);
    assert_eq!(w.messages(s.id).await.len(), count);

    // The session resumes and the conversation goes on.
    let st = mgr.resume_session(w.task.id, s.id).await.unwrap();
    assert!(st.is_agent_running, "{st:?}");
    w.track(s.id).await;
    assert_eq!(st.state, SessionState::WaitingForInput, "{st:?}");
    w.prompt(&mgr, s.id, "three").await;
    w.finish(&mgr, &[s.id]).await;
}
