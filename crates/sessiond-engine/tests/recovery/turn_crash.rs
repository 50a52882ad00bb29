//! Crash points of one turn, for every runtime: sessiond is killed during
//! turn two and agentctl is killed at each point of the turn — the host's
//! agentctl on the remote runtime (run with `--journal`, kept across its
//! restarts as a host operator would, restarted on the same journal), the
//! backend's own agentctl on the standalone and Docker runtimes (relaunched
//! by recovery: a new local process, or the same container started again,
//! its journal in the mounted run directory). Points are aimed by the
//! agentctl test hook (`AGENTCTL_TEST_CRASH_AT=<point>:two`, armed once with
//! `AGENTCTL_TEST_CRASH_ONCE` where the relaunched agentctl inherits it) and
//! the demo agent's gates, never by timing:
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
//! (grandchild included) alive — for Docker, the one container of the
//! session running again, its old processes gone with its PID 1 — and the
//! conversation continuing.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use futures::StreamExt;
use sessiond_domain::{
    Event, EventPayload, MessageRole, OutcomeLabel, Runtime, Session, SessionState,
};
use sessiond_engine::SessionManager;
use sessiond_proto::agentctl::v1::{self as pb, agent_update::Kind};

use crate::{
    common::local_drivers_with,
    docker_support::{CONTAINER_WORKSPACE, DockerKit, demo_profile_in_docker, docker_cli},
    pending::{commit_user_message, transcript, transcript_in},
    remote::{RemoteHost, RemoteSpot},
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
fn assert_conversation_whole(turns: &[(String, String)], msgs: &[sessiond_domain::Message]) {
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

/// Waits until the dead agentctl's agents are gone too (their parent-death
/// signal lands a moment after agentctl dies): a gate opened before would
/// let the old agent finish a turn its agentctl never reported.
async fn wait_agents_gone(agents: &[u32]) {
    wait_until("the old agentctl's agents to die with it", || {
        agents.iter().all(|p| !is_running(*p))
    })
    .await;
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

/// The files through which a test steers the demo agent and reads what it
/// did, under one directory: the test's view (`in_dir(host path)`) and the
/// agent's (the same for a local process, the container's mount for Docker).
struct TurnFiles {
    side: PathBuf,
    gate: PathBuf,
    mid_gate: PathBuf,
    grandchild: PathBuf,
}

impl TurnFiles {
    fn in_dir(dir: &Path) -> TurnFiles {
        TurnFiles {
            side: dir.join("side-effects.txt"),
            gate: dir.join("gate"),
            mid_gate: dir.join("mid-gate"),
            grandchild: dir.join("grandchild.pid"),
        }
    }

    /// The demo agent's environment: a tool call appending to `side`, gates,
    /// a multi-chunk reply and a grandchild process.
    fn agent_env(&self) -> Vec<(&'static str, String)> {
        let s = |p: &Path| p.display().to_string();
        vec![
            ("ACP_DEMO_SIDE_EFFECT_FILE", s(&self.side)),
            ("ACP_DEMO_GATE_FILE", s(&self.gate)),
            ("ACP_DEMO_MID_GATE_FILE", s(&self.mid_gate)),
            ("ACP_DEMO_EXTRA_CHUNKS", "3".into()),
            ("ACP_DEMO_GRANDCHILD_PID_FILE", s(&self.grandchild)),
        ]
    }

    fn grandchild_pid(&self) -> Option<u32> {
        std::fs::read_to_string(&self.grandchild)
            .ok()
            .and_then(|t| t.trim().parse().ok())
    }
}

fn as_refs<'a>(env: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    env.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

impl Point {
    /// agentctl's own crash hook for this point (`AGENTCTL_TEST_CRASH_AT`).
    fn crash_hook(self) -> Option<&'static str> {
        match self {
            Point::AfterAccepted => Some("after-accepted:two"),
            Point::AfterHanded => Some("after-handed:two"),
            _ => None,
        }
    }
}

/// With sessiond down, takes turn "two" (its user message already stored)
/// to `point` through agentctl, as the dead backend's Prompt would have.
async fn send_turn_two(
    point: Point,
    client: &sessiond_executor::AgentctlClient,
    two: &sessiond_domain::Message,
    files: &TurnFiles,
    transcript: impl Fn() -> Vec<(String, String)>,
) {
    let prompt = || {
        let client = client.clone();
        let request = pb::PromptRequest {
            text: "two".into(),
            turn_id: two.id.to_string(),
            ..Default::default()
        };
        async move { client.prompt(request).await }
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
            std::fs::write(&files.gate, "").unwrap();
            prompt().await.unwrap();
            wait_until("the tool call", || lines(&files.side).len() == 2).await;
        }
        Point::MidReply => {
            std::fs::write(&files.mid_gate, "").unwrap();
            prompt().await.unwrap();
            wait_first_chunk(client, &two.id.to_string()).await;
        }
        Point::AfterFinished => {
            prompt().await.unwrap();
            wait_until("the agent's reply", || transcript().len() == 2).await;
        }
    }
}

/// After recovery: turn "two" ended as `point` requires (delivered exactly
/// once, or interrupted with its side effect at most once), the stored
/// conversation and events are sound, and the conversation goes on.
async fn assert_turn_two_ended(
    point: Point,
    w: &World,
    mgr: &sessiond_engine::SessionManager,
    s: &Session,
    side: &Path,
    transcript: impl Fn() -> Vec<(String, String)>,
) {
    let token = s.resume_token.clone().unwrap();
    w.wait_state(mgr, s.id, SessionState::WaitingForInput).await;
    let msgs = w.messages(s.id).await;
    let last = msgs.last().unwrap();
    let side_two = lines(side).iter().filter(|l| *l == "two").count();
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
    let agent_turns = transcript();
    assert_eq!(
        agent_turns.iter().filter(|(p, _)| p == "two").count(),
        usize::from(point.delivered() || point == Point::AfterFinished),
        "{point:?}: {agent_turns:?}"
    );
    assert_conversation_whole(&agent_turns, &msgs);
    assert_events_sound(&w.events(s.id).await);

    // The conversation goes on, each prompt still run once.
    w.prompt(mgr, s.id, "three").await;
    assert_eq!(lines(side).iter().filter(|l| *l == "three").count(), 1);
    let msgs = w.messages(s.id).await;
    assert_conversation_whole(&transcript(), &msgs);
    assert_events_sound(&w.events(s.id).await);
}

/// The remote runtime's turn world: the demo agent steered by the turn
/// files, a host workspace, and where the host's agentctl keeps its journal.
async fn remote_turns() -> (
    World,
    TurnFiles,
    sessiond_domain::AgentProfile,
    RemoteSpot,
    PathBuf,
) {
    let w = World::new(Db::Sqlite).await;
    let files = TurnFiles::in_dir(w.dir.path());
    let env = files.agent_env();
    let profile = w.demo_profile("turns", &as_refs(&env)).await;
    let spot = RemoteSpot::at(&w.worktree("remote").path);
    let journal = w.path("remote-agentctl.journal");
    (w, files, profile, spot, journal)
}

async fn remote_restart_at(point: Point) {
    let (w, files, profile, spot, journal) = remote_turns().await;
    let crash_at: Vec<_> = point
        .crash_hook()
        .map(|at| ("AGENTCTL_TEST_CRASH_AT", at))
        .into_iter()
        .collect();
    let host = RemoteHost::start_with(&w, &spot, Some(&journal), &crash_at).await;
    let mgr = w.manager();
    let s = spot.create(&w, &mgr, &profile, &host).await;
    w.prompt(&mgr, s.id, "one").await;
    wait_until("the agent's grandchild", || {
        files.grandchild_pid().is_some()
    })
    .await;
    let old_grandchild = files.grandchild_pid().unwrap();
    let old_agentctl = host.child.id();
    let old_agents = crate::support::children_of(old_agentctl);
    assert!(is_running(old_grandchild));

    // sessiond dies during turn two: the user message is stored (RUNNING);
    // its Prompt, if it went out, is the one below.
    mgr.shutdown();
    drop(mgr);
    let two = commit_user_message(&w, &s, "two").await;
    let client = w.agentctl(&w.record(s.id).await);
    send_turn_two(point, &client, &two, &files, || transcript(&w, &s)).await;
    // The host's agentctl goes (killed, or by its own crash hook) and is
    // restarted on the same journal; the gates open.
    let mut host = host;
    if point.crash_hook().is_some() {
        let status = host.child.wait().unwrap();
        assert!(
            !status.success(),
            "agentctl crashed at its hook: {status:?}"
        );
    } else {
        crate::support::kill9(old_agentctl);
        let _ = host.child.wait();
    }
    wait_agents_gone(&old_agents).await;
    let _ = std::fs::remove_file(&files.gate);
    let _ = std::fs::remove_file(&files.mid_gate);
    let host = RemoteHost::start_with(&w, &spot, Some(&journal), &[]).await;
    // The new agentctl ended the old generation's whole tree before it
    // serves (the grandchild outlived the parent-death signal).
    wait_until("the old agent tree to end", || {
        !is_running(old_grandchild) && old_agents.iter().all(|p| !is_running(*p))
    })
    .await;

    let mgr = w.manager();
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::Resumed), 1, "{summary:?}");
    host.track_agent(&w);
    assert_turn_two_ended(point, &w, &mgr, &s, &files.side, || transcript(&w, &s)).await;
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

/// The remote host restarts its agentctl (on the same journal) while the
/// backend runs, mid-reply: the pump meets the new agentctl instance, which
/// runs no agent. Nothing can end the turn there any more, so the backend
/// ends it itself, as an agent exit: interrupted, the session ERROR (or,
/// when the pump gave the host up first and the reconnect resumed the
/// agent, settled by the journal: interrupted too), never RUNNING for ever
/// with an agent counted as running. A resume, and the conversation goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_restart_while_the_backend_runs_ends_the_turn() {
    let (w, files, profile, spot, journal) = remote_turns().await;
    let mut host = RemoteHost::start_with(&w, &spot, Some(&journal), &[]).await;
    let mgr = w.manager();
    let s = spot.create(&w, &mgr, &profile, &host).await;
    w.prompt(&mgr, s.id, "one").await;

    // Turn two, held by the agent after its first chunk.
    std::fs::write(&files.mid_gate, "").unwrap();
    let two = mgr.send_message(w.task.id, s.id, "two").await.unwrap();
    let client = w.agentctl(&w.record(s.id).await);
    wait_first_chunk(&client, &two.id.to_string()).await;
    let old_agentctl = host.child.id();
    let old_agents = crate::support::children_of(old_agentctl);
    crate::support::kill9(old_agentctl);
    let _ = host.child.wait();
    wait_agents_gone(&old_agents).await;
    let _ = std::fs::remove_file(&files.mid_gate);
    let host = RemoteHost::start_with(&w, &spot, Some(&journal), &[]).await;

    // The backend ends the turn by itself.
    let deadline = Instant::now() + Duration::from_secs(60);
    let state = loop {
        let st = mgr.session_status(w.task.id, s.id).await.unwrap();
        if st.state != SessionState::Running {
            break st.state;
        }
        assert!(
            Instant::now() < deadline,
            "turn two left RUNNING with no agent to end it: {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let msgs = w.messages(s.id).await;
    let last = msgs.last().unwrap();
    assert_eq!(last.role, MessageRole::System, "{state}: {msgs:?}");
    assert!(last.content.contains("interrupted"), "{last:?}");
    assert!(msgs.iter().all(|m| m.complete), "{msgs:?}");
    if state == SessionState::Error {
        mgr.resume_session(w.task.id, s.id).await.unwrap();
    }
    host.track_agent(&w);
    w.prompt(&mgr, s.id, "three").await;
    assert_eq!(
        lines(&files.side).iter().filter(|l| *l == "three").count(),
        1
    );
    assert_eq!(lines(&files.side).iter().filter(|l| *l == "two").count(), 1);
    let msgs = w.messages(s.id).await;
    assert_conversation_whole(&transcript(&w, &s), &msgs);
    assert_events_sound(&w.events(s.id).await);
    mgr.cancel_session(w.task.id, s.id).await.unwrap();
    host.kill().await;
    w.finish(&mgr, &[]).await;
}

/// sessiond dies with turn two held at the remote host's agentctl
/// (`HoldPrompt`: journaled, not handed), which keeps running: before the
/// turn's commit (`committed` false: no one will ever prompt it) or after
/// it, before the Prompt. The restarted backend delivers a committed held
/// turn exactly once (its Prompt starts the held turn, journaled once);
/// an uncommitted one never reaches the agent, and the conversation goes on.
async fn remote_backend_restart_with_a_held_turn(committed: bool) {
    let (w, files, profile, spot, journal) = remote_turns().await;
    let host = RemoteHost::start_with(&w, &spot, Some(&journal), &[]).await;
    let mgr = w.manager();
    let s = spot.create(&w, &mgr, &profile, &host).await;
    w.prompt(&mgr, s.id, "one").await;
    mgr.shutdown();
    drop(mgr);

    let client = w.agentctl(&w.record(s.id).await);
    let turn_id = if committed {
        let two = commit_user_message(&w, &s, "two").await;
        // As the turn start records it: the agentctl process known alive
        // before the Prompt, whose journal then covers the turn.
        let instance = client.health().await.unwrap().instance_id;
        w.write_session(s.id, |running| {
            running.metadata.insert("turn_instance".into(), instance);
        })
        .await;
        two.id.to_string()
    } else {
        sessiond_domain::MessageId::new().to_string()
    };
    let held = client
        .hold_prompt(pb::PromptRequest {
            text: "two".into(),
            turn_id: turn_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(!held.already_accepted, "{held:?}");
    let journal_lines = |kind: &str| {
        lines(&journal)
            .iter()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["k"] == kind && v["turn"] == turn_id.as_str())
            .count()
    };
    assert_eq!(journal_lines("accepted"), 1);

    let mgr = w.manager();
    mgr.recovery().recover_all().await.unwrap();
    if committed {
        assert_turn_two_ended(Point::BeforePrompt, &w, &mgr, &s, &files.side, || {
            transcript(&w, &s)
        })
        .await;
        assert_eq!(
            journal_lines("accepted"),
            1,
            "the held line served the Prompt"
        );
        assert_eq!(journal_lines("handed"), 1);
    } else {
        w.wait_state(&mgr, s.id, SessionState::WaitingForInput)
            .await;
        w.prompt(&mgr, s.id, "three").await;
        let side = lines(&files.side);
        assert!(
            !side.iter().any(|l| l == "two"),
            "a held turn never committed ran: {side:?}"
        );
        assert_eq!(side.iter().filter(|l| *l == "three").count(), 1);
        assert_eq!(journal_lines("handed"), 0);
        let agent_turns = transcript(&w, &s);
        assert!(
            agent_turns.iter().all(|(p, _)| p != "two"),
            "{agent_turns:?}"
        );
        assert_conversation_whole(&agent_turns, &w.messages(s.id).await);
        assert_events_sound(&w.events(s.id).await);
    }
    mgr.cancel_session(w.task.id, s.id).await.unwrap();
    host.kill().await;
    w.finish(&mgr, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_backend_restart_delivers_a_committed_held_turn_once() {
    remote_backend_restart_with_a_held_turn(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_backend_restart_never_runs_an_uncommitted_held_turn() {
    remote_backend_restart_with_a_held_turn(false).await;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Local {
    Standalone,
    Docker,
}

/// The same crash points for the backend's own executors: sessiond dies
/// during turn two, then agentctl dies at the point (killed, or by its own
/// hook, armed once so the agentctl recovery relaunches does not crash
/// again), and recovery relaunches it on the same journal — a new local
/// process, or the same container started again (its journal is in the
/// mounted run directory).
async fn local_restart_at(rt: Local, point: Point) {
    let w = World::new(Db::Sqlite).await;
    let wt = w.worktree("turns");
    let wt_path = PathBuf::from(&wt.path);
    // The files live in the worktree: the container sees it too.
    let files = TurnFiles::in_dir(&wt_path);
    let (agent_dir, runtime) = match rt {
        Local::Standalone => (wt_path.clone(), Runtime::LocalStandalone),
        Local::Docker => (PathBuf::from(CONTAINER_WORKSPACE), Runtime::LocalDocker),
    };
    let env = TurnFiles::in_dir(&agent_dir).agent_env();
    let crashed = agent_dir.join("crashed").display().to_string();
    let agentctl_env: Vec<(&str, &str)> = point
        .crash_hook()
        .map(|at| {
            [
                ("AGENTCTL_TEST_CRASH_AT", at),
                ("AGENTCTL_TEST_CRASH_ONCE", crashed.as_str()),
            ]
        })
        .into_iter()
        .flatten()
        .collect();
    let (kit, profile, state_dir) = match rt {
        Local::Standalone => (
            None,
            w.demo_profile("turns", &as_refs(&env)).await,
            w.path("agent-state"),
        ),
        Local::Docker => (
            Some(DockerKit::with_agentctl_env(&w, &agentctl_env).await),
            demo_profile_in_docker(&w, "turns", &as_refs(&env)).await,
            wt_path.join(".agent-state"),
        ),
    };
    let manager = || match &kit {
        Some(kit) => kit.manager(&w),
        None => SessionManager::new(
            w.store.clone(),
            local_drivers_with(w.dir.path(), &agentctl_env),
            w.config(),
        ),
    };
    let mgr = manager();
    let s = w.create_rt(&mgr, "turns", &profile, runtime, None).await;
    assert_eq!(s.state, SessionState::WaitingForInput, "{s:?}");
    let transcript = || transcript_in(&state_dir, &s);
    w.prompt(&mgr, s.id, "one").await;
    wait_until("the agent's grandchild", || {
        files.grandchild_pid().is_some()
    })
    .await;
    let before = w.record(s.id).await;
    // The old generation as the world sees it: agentctl, its agent and the
    // agent's grandchild (local), or the container's processes.
    // (A container's agentctl has no host pid on record.)
    let old_agentctl = before.pid.unwrap_or(0);
    let old_agents = match rt {
        Local::Standalone => crate::support::children_of(old_agentctl),
        Local::Docker => Vec::new(),
    };
    let old_tree = match rt {
        Local::Standalone => {
            let grandchild = files.grandchild_pid().unwrap();
            assert!(is_running(grandchild));
            let mut tree = old_agents.clone();
            tree.extend([old_agentctl, grandchild]);
            tree
        }
        Local::Docker => Vec::new(),
    };

    mgr.shutdown();
    drop(mgr);
    let two = commit_user_message(&w, &s, "two").await;
    let client = match &kit {
        Some(kit) => sessiond_executor::Executor::client(
            kit.driver.as_ref(),
            &sessiond_executor::ExecutorHandle::from_record(&before),
        )
        .unwrap(),
        None => w.agentctl(&before),
    };
    send_turn_two(point, &client, &two, &files, transcript).await;
    let agentctl_gone = || async {
        match &kit {
            Some(kit) => kit
                .containers_of_session(s.id)
                .await
                .iter()
                .all(|c| c.state != "running"),
            None => !is_running(old_agentctl),
        }
    };
    if point.crash_hook().is_none() {
        match &kit {
            Some(kit) => {
                let c = kit.one_running(s.id).await;
                docker_cli(&kit.env, &["kill", "--signal", "KILL", &c.id]);
            }
            None => crate::support::kill9(old_agentctl),
        }
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while !agentctl_gone().await {
        assert!(
            Instant::now() < deadline,
            "agentctl never died at {point:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if point.crash_hook().is_some() {
        assert!(wt_path.join("crashed").exists(), "the hook fired, once");
    }
    wait_agents_gone(&old_agents).await;
    let _ = std::fs::remove_file(&files.gate);
    let _ = std::fs::remove_file(&files.mid_gate);

    let mgr = manager();
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::Resumed), 1, "{summary:?}");
    let after = w.record(s.id).await;
    assert_eq!(after.generation, before.generation + 1, "relaunched once");
    match &kit {
        // The relaunched agentctl ended the old generation's whole tree
        // (the grandchild outlived the parent-death signal).
        None => {
            w.track(s.id).await;
            wait_until("the old agent tree to end", || {
                old_tree.iter().all(|p| !is_running(*p))
            })
            .await;
        }
        // The old container's processes died with its PID 1; the same
        // container runs again, alone.
        Some(kit) => {
            let c = kit.one_running(s.id).await;
            assert_eq!(Some(c.id), before.container_id, "the same container");
        }
    }
    assert_turn_two_ended(point, &w, &mgr, &s, &files.side, transcript).await;
    w.finish(&mgr, &[s.id]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_crash_before_the_prompt_delivers_once() {
    local_restart_at(Local::Standalone, Point::BeforePrompt).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_crash_after_acceptance_delivers_once() {
    local_restart_at(Local::Standalone, Point::AfterAccepted).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_crash_after_handing_is_interrupted() {
    local_restart_at(Local::Standalone, Point::AfterHanded).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_crash_after_the_tool_call_is_interrupted() {
    local_restart_at(Local::Standalone, Point::AfterToolCall).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_crash_mid_reply_is_interrupted() {
    local_restart_at(Local::Standalone, Point::MidReply).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_crash_after_the_agent_finished_is_interrupted() {
    local_restart_at(Local::Standalone, Point::AfterFinished).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn docker_crash_before_the_prompt_delivers_once() {
    local_restart_at(Local::Docker, Point::BeforePrompt).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn docker_crash_after_acceptance_delivers_once() {
    local_restart_at(Local::Docker, Point::AfterAccepted).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn docker_crash_after_handing_is_interrupted() {
    local_restart_at(Local::Docker, Point::AfterHanded).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn docker_crash_after_the_tool_call_is_interrupted() {
    local_restart_at(Local::Docker, Point::AfterToolCall).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn docker_crash_mid_reply_is_interrupted() {
    local_restart_at(Local::Docker, Point::MidReply).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn docker_crash_after_the_agent_finished_is_interrupted() {
    local_restart_at(Local::Docker, Point::AfterFinished).await;
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
    let summary = mgr.recovery().recover_all().await.unwrap();
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
    assert_conversation_whole(&transcript(&w, &s), &msgs);
    assert_events_sound(&w.events(s.id).await);
    w.finish(&mgr, &[s.id]).await;
}
