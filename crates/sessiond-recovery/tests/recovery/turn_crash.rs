//! Crash points of one turn on the remote runtime: sessiond is killed
//! during turn two and the host's agentctl (run with `--journal`, kept
//! across its restarts as a host operator would) is killed and restarted at
//! each point of the turn. Points are aimed by the agentctl test hook
//! (`AGENTCTL_TEST_CRASH_AT=<point>:two`) and the demo agent's gates, never
//! by timing:
//!
//! | point | expected end of turn two |
//! |---|---|
//! | sessiond died before its Prompt | delivered once after the restart (provably never reached agentctl) |
//! | agentctl recorded acceptance, Prompt not answered | delivered once (the journal: accepted by a dead process, never handed) |
//! | agentctl recorded it handed, the agent not sent it | interrupted (it may have reached the agent) |
//! | the agent ran its tool call | interrupted; the side effect happened once |
//! | mid-reply (first chunk streamed) | interrupted |
//! | the agent finished, sessiond never read the end | interrupted (the reply died with agentctl's buffer) |
//!
//! Each checks the world: at most one side-effect line per prompt (exactly
//! one for a completed turn), stored replies equal to the agent's own
//! transcript, every user message followed by a complete reply or an
//! interrupted system message, events gap-free with no message content
//! shrinking and no event repeated, no process of the old agentctl
//! (grandchild included) alive, and the conversation continuing.

use std::{
    collections::HashMap,
    path::Path,
    time::{Duration, Instant},
};

use futures::StreamExt;
use sessiond_domain::{
    Event, EventPayload, ExecutorId, MessageRole, OutcomeLabel, Session, SessionState,
};
use sessiond_proto::agentctl::v1::{self as pb, agent_update::Kind};
use sessiond_recovery::RemoteAgentctl;

use crate::{
    pending::{commit_user_message, transcript},
    remote::{RemoteHost, free_port},
    support::{Db, World, expected_reply, is_running},
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Point {
    BeforePrompt,
    AfterAccepted,
    AfterHanded,
    AfterToolCall,
    MidReply,
    AfterFinished,
}

impl Point {
    /// Whether the turn must be delivered (exactly once) after recovery.
    fn delivered(self) -> bool {
        matches!(self, Point::BeforePrompt | Point::AfterAccepted)
    }
}

async fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// Events as a watcher replays them: seqs 1..n without a gap, no event
/// repeated back to back (the same payload twice in one commit), and no
/// message whose content shrinks from one event to the next.
pub(crate) fn assert_events_sound(events: &[Event]) {
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e.seq, i as i64 + 1, "seqs have a gap or repeat");
    }
    for pair in events.windows(2) {
        assert_ne!(
            pair[0].payload, pair[1].payload,
            "the same event twice in a row (seq {})",
            pair[1].seq
        );
    }
    let mut seen: HashMap<String, String> = HashMap::new();
    for e in events {
        if let EventPayload::MessageAdded(m) | EventPayload::MessageUpdated(m) = &e.payload {
            let before = seen.insert(m.id.to_string(), m.content.clone());
            if let Some(before) = before {
                assert!(
                    m.content.starts_with(&before),
                    "message {} shrank or changed at seq {}: {before:?} -> {:?}",
                    m.id,
                    e.seq,
                    m.content
                );
            }
        }
    }
}

/// Every user message ends with a complete agent reply or an interrupted
/// system message; every complete agent reply that is not marked
/// interrupted equals the agent's own reply to that prompt.
fn assert_conversation_whole(w: &World, s: &Session, msgs: &[sessiond_domain::Message]) {
    let turns = transcript(w, s);
    for (i, m) in msgs.iter().enumerate() {
        if m.role != MessageRole::User {
            continue;
        }
        let end = msgs[i + 1..]
            .iter()
            .take_while(|x| x.role != MessageRole::User)
            .collect::<Vec<_>>();
        let replied = end.iter().any(|x| {
            x.role == MessageRole::Agent && x.complete && !x.content.contains("[sessiond:")
        });
        let interrupted = end.iter().any(|x| {
            x.role == MessageRole::System && x.content.starts_with("the turn was interrupted")
        });
        assert!(
            replied ^ interrupted,
            "user message {:?} has neither a whole reply nor an interrupted note (or both): {msgs:?}",
            m.content
        );
        for r in end
            .iter()
            .filter(|x| x.role == MessageRole::Agent && !x.content.contains("[sessiond:"))
        {
            assert!(
                turns
                    .iter()
                    .any(|(p, reply)| p == &m.content && reply == &r.content),
                "stored reply {:?} to {:?} is not the agent's ({turns:?})",
                r.content,
                m.content
            );
        }
    }
}

/// Waits until agentctl has streamed the first reply chunk of turn `turn`.
async fn wait_first_chunk(client: &sessiond_executor::AgentctlClient, turn: &str) {
    let mut stream = client.stream_updates(0, "").await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let next = tokio::time::timeout_at(deadline.into(), stream.next())
            .await
            .expect("no reply chunk streamed")
            .expect("update stream ended")
            .unwrap();
        if let Some(Kind::MessageChunk(c)) = next.kind
            && c.turn_id == turn
        {
            return;
        }
    }
}

async fn remote_restart_at(point: Point) {
    let w = World::new(Db::Sqlite).await;
    let side = w.path("side-effects.txt");
    let gate = w.path("gate");
    let mid_gate = w.path("mid-gate");
    let grandchild = w.path("grandchild.pid");
    let (side_s, gate_s, mid_s, gc_s) = (
        side.display().to_string(),
        gate.display().to_string(),
        mid_gate.display().to_string(),
        grandchild.display().to_string(),
    );
    let profile = w
        .demo_profile(
            "turns",
            &[
                ("ACP_DEMO_SIDE_EFFECT_FILE", side_s.as_str()),
                ("ACP_DEMO_GATE_FILE", gate_s.as_str()),
                ("ACP_DEMO_MID_GATE_FILE", mid_s.as_str()),
                ("ACP_DEMO_EXTRA_CHUNKS", "3"),
                ("ACP_DEMO_GRANDCHILD_PID_FILE", gc_s.as_str()),
            ],
        )
        .await;
    let id = ExecutorId::new();
    let secret = sessiond_executor::fresh_secret();
    let port = free_port();
    let wt = w.worktree("remote");
    let journal = w.path("remote-agentctl.journal");
    let crash_at = match point {
        Point::AfterAccepted => vec![("AGENTCTL_TEST_CRASH_AT", "after-accepted:two")],
        Point::AfterHanded => vec![("AGENTCTL_TEST_CRASH_AT", "after-handed:two")],
        _ => vec![],
    };
    let host = RemoteHost::start_with(
        &w,
        Path::new(&wt.path),
        id,
        &secret,
        port,
        Some(&journal),
        &crash_at,
    )
    .await;
    let mgr = w.manager();
    let remote = RemoteAgentctl {
        executor_id: id,
        url: format!("http://127.0.0.1:{port}"),
        auth_secret: secret.clone(),
    };
    let s = w.create_with(&mgr, "remote", &profile, Some(remote)).await;
    assert_eq!(s.state, SessionState::WaitingForInput, "{s:?}");
    host.track_agent(&w);
    let token = s.resume_token.clone().unwrap();
    w.prompt(&mgr, s.id, "one").await;
    wait_until("the agent's grandchild", || {
        std::fs::read_to_string(&grandchild).is_ok_and(|t| !t.trim().is_empty())
    })
    .await;
    let old_grandchild: u32 = std::fs::read_to_string(&grandchild)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let old_agentctl = host.child.id();
    let old_agents = crate::support::children_of(old_agentctl);
    assert!(is_running(old_grandchild));

    // sessiond dies during turn two: the user message is stored (RUNNING);
    // its Prompt, if it went out, is the one below.
    mgr.shutdown();
    drop(mgr);
    let two = commit_user_message(&w, &s, "two").await;
    let record = w.record(s.id).await;
    let client = w.agentctl(&record);
    let prompt = || {
        let mut raw = client.raw();
        let request = pb::PromptRequest {
            text: "two".into(),
            turn_id: two.id.to_string(),
            ..Default::default()
        };
        async move { raw.prompt(request).await }
    };
    match point {
        Point::BeforePrompt => {}
        Point::AfterAccepted => {
            // agentctl journaled the turn and died before answering.
            assert!(prompt().await.is_err(), "agentctl answered the Prompt");
        }
        Point::AfterHanded => {
            // Answered, unless the crash right after it beat the answer.
            let _ = prompt().await;
        }
        Point::AfterToolCall => {
            std::fs::write(&gate, "").unwrap();
            prompt().await.unwrap();
            wait_until("the tool call", || lines(&side).len() == 2).await;
        }
        Point::MidReply => {
            std::fs::write(&mid_gate, "").unwrap();
            prompt().await.unwrap();
            wait_first_chunk(&client, &two.id.to_string()).await;
        }
        Point::AfterFinished => {
            prompt().await.unwrap();
            wait_until("the agent's reply", || transcript(&w, &s).len() == 2).await;
        }
    }
    // The host's agentctl goes (killed, or by its own crash hook) and is
    // restarted on the same journal; the gates open.
    let mut host = host;
    if matches!(point, Point::AfterAccepted | Point::AfterHanded) {
        let status = host.child.wait().unwrap();
        assert!(
            !status.success(),
            "agentctl crashed at its hook: {status:?}"
        );
    } else {
        crate::support::kill9(old_agentctl);
        let _ = host.child.wait();
    }
    let _ = std::fs::remove_file(&gate);
    let _ = std::fs::remove_file(&mid_gate);
    let host = RemoteHost::start_with(
        &w,
        Path::new(&wt.path),
        id,
        &secret,
        port,
        Some(&journal),
        &[],
    )
    .await;
    // The new agentctl ended the old generation's whole tree before it
    // serves (the grandchild outlived the parent-death signal).
    wait_until("the old agent tree to end", || {
        !is_running(old_grandchild) && old_agents.iter().all(|p| !is_running(*p))
    })
    .await;

    let mgr = w.manager();
    let summary = mgr.recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::Resumed), 1, "{summary:?}");
    host.track_agent(&w);
    w.wait_state(&mgr, s.id, SessionState::WaitingForInput)
        .await;
    let msgs = w.messages(s.id).await;
    let last = msgs.last().unwrap();
    let side_two = lines(&side).iter().filter(|l| *l == "two").count();
    if point.delivered() {
        assert_eq!(last.role, MessageRole::Agent, "{point:?}: {msgs:?}");
        assert_eq!(
            last.content,
            format!("{} [1] [2] [3]", expected_reply(2, &token, "two"))
        );
        assert!(last.complete);
        assert_eq!(side_two, 1, "{point:?}: delivered exactly once");
    } else {
        assert_eq!(last.role, MessageRole::System, "{point:?}: {msgs:?}");
        assert!(last.content.contains("interrupted"), "{last:?}");
        let expected = usize::from(point != Point::AfterHanded);
        assert_eq!(side_two, expected, "{point:?}: at most once");
    }
    let agent_turns = transcript(&w, &s);
    assert_eq!(
        agent_turns.iter().filter(|(p, _)| p == "two").count(),
        usize::from(point.delivered() || point == Point::AfterFinished),
        "{point:?}: {agent_turns:?}"
    );
    assert_conversation_whole(&w, &s, &msgs);
    assert_events_sound(&w.events(s.id).await);

    // The conversation goes on, each prompt still run once.
    w.prompt(&mgr, s.id, "three").await;
    assert_eq!(lines(&side).iter().filter(|l| *l == "three").count(), 1);
    let msgs = w.messages(s.id).await;
    assert_conversation_whole(&w, &s, &msgs);
    assert_events_sound(&w.events(s.id).await);
    mgr.cancel_session(w.task.id, s.id).await.unwrap();
    host.kill().await;
    w.finish(&mgr, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_restart_before_the_prompt_delivers_once() {
    remote_restart_at(Point::BeforePrompt).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_restart_after_acceptance_delivers_once() {
    remote_restart_at(Point::AfterAccepted).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_restart_after_handing_is_interrupted() {
    remote_restart_at(Point::AfterHanded).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_restart_after_the_tool_call_is_interrupted() {
    remote_restart_at(Point::AfterToolCall).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_restart_mid_reply_is_interrupted() {
    remote_restart_at(Point::MidReply).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_restart_after_the_agent_finished_is_interrupted() {
    remote_restart_at(Point::AfterFinished).await;
}

/// Replay after a restart never shrinks a stored reply: sessiond stored
/// three chunks of a reply (the agent holds mid-reply), dies, the agent
/// finishes while it is down, and the restarted backend replays the turn
/// from its first chunk. Nothing shorter than what was stored is written:
/// neither the stored events nor a watcher subscribed across the replay see
/// the reply shrink, and no event repeats. The reply ends whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_after_restart_never_shrinks_a_stored_reply() {
    let w = World::new(Db::Sqlite).await;
    let mid_gate = w.path("mid-gate");
    let mid_s = mid_gate.display().to_string();
    let profile = w
        .demo_profile(
            "mid",
            &[
                ("ACP_DEMO_MID_GATE_FILE", mid_s.as_str()),
                ("ACP_DEMO_MID_GATE_AFTER", "3"),
                ("ACP_DEMO_EXTRA_CHUNKS", "3"),
            ],
        )
        .await;
    let mgr = w.manager();
    let s = w.create_with(&mgr, "mid", &profile, None).await;
    let token = s.resume_token.clone().unwrap();
    w.prompt(&mgr, s.id, "one").await;
    std::fs::write(&mid_gate, "").unwrap();
    let two = mgr.send_message(w.task.id, s.id, "two").await.unwrap();
    // The three chunks before the gate are stored (the pump flushes at
    // most every 50 ms; wait for the store, not for a time).
    let first_three = format!("turn 2 of session {token}: you said \"two\"");
    let deadline = Instant::now() + Duration::from_secs(30);
    let stored = loop {
        let msgs = w.messages(s.id).await;
        if let Some(m) = msgs
            .iter()
            .find(|m| m.role == MessageRole::Agent && m.seq > two.seq)
            && m.content == first_three
        {
            break m.clone();
        }
        assert!(
            Instant::now() < deadline,
            "the partial reply was never stored: {msgs:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(!stored.complete);
    // sessiond dies; the agent finishes its reply while it is down.
    mgr.shutdown();
    drop(mgr);
    std::fs::remove_file(&mid_gate).unwrap();
    wait_until("the agent's reply", || transcript(&w, &s).len() == 2).await;

    let mgr = w.manager();
    let after = w.store.last_event_seq(s.id).await.unwrap();
    let mut watch = mgr.watch_session(s.id, after).await.unwrap();
    let summary = mgr.recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::Reattached), 1, "{summary:?}");
    w.track(s.id).await;
    w.wait_state(&mgr, s.id, SessionState::WaitingForInput)
        .await;
    let whole = format!("{first_three} [1] [2] [3]");
    // What the watcher saw across the replay: the reply only grew.
    let mut seen = Vec::new();
    while let Ok(Some(e)) = tokio::time::timeout(Duration::from_millis(500), watch.next()).await {
        seen.push(e.unwrap());
    }
    for e in &seen {
        if let EventPayload::MessageAdded(m) | EventPayload::MessageUpdated(m) = &e.payload
            && m.id == stored.id
        {
            assert!(
                m.content.starts_with(&first_three),
                "a watcher saw the reply shrink to {:?}",
                m.content
            );
        }
    }
    assert!(
        seen.iter().any(|e| matches!(&e.payload,
            EventPayload::MessageUpdated(m) if m.id == stored.id && m.complete && m.content == whole)),
        "the watcher saw the reply end whole: {seen:?}"
    );
    let msgs = w.messages(s.id).await;
    let reply = msgs.iter().find(|m| m.id == stored.id).unwrap();
    assert_eq!(
        (reply.content.as_str(), reply.complete),
        (whole.as_str(), true)
    );
    assert_conversation_whole(&w, &s, &msgs);
    assert_events_sound(&w.events(s.id).await);
    w.finish(&mgr, &[s.id]).await;
}
