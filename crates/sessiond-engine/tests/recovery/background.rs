//! Background work while the backend runs: liveness checks of agentctl and
//! the orphan-container sweep.

use std::time::{Duration, Instant};

use sessiond_domain::{
    EventPayload, ExecutorId, ExecutorStatus, MessageRole, Runtime, SessionId, SessionState,
};
use sessiond_engine::ManagerConfig;
use sessiond_executor::Executor;

use crate::{
    docker_support::{DockerKit, docker_cli},
    support::{Db, World, children_of, expected_reply, kill_tree, kill9},
};

fn with_liveness(w: &World, every: Option<Duration>) -> ManagerConfig {
    ManagerConfig {
        liveness_interval: every,
        ..w.config()
    }
}

/// A healthy executor gets `last_seen_at` refreshed by the liveness checks
/// (which `recover_all` starts), with no event; when its agentctl dies while
/// the backend runs, the executor goes `error` with the `recovering` code and
/// a `session.agentctl_error` event, the session keeps its state, and the
/// background retry brings it back by itself (a new agentctl, the agent
/// resumed): a condition that passes by itself never ends in ERROR.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn liveness_refreshes_last_seen_and_recovers_a_dead_agentctl() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager_with(with_liveness(&w, Some(Duration::from_millis(150))));
    mgr.recovery().recover_all().await.unwrap();
    let s = w.create(&mgr, "live").await;
    let token = s.resume_token.clone().unwrap();
    let first = w.record(s.id).await.last_seen_at.unwrap();
    let seq_before = w.store.last_event_seq(s.id).await.unwrap();

    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = w.record(s.id).await;
        if r.last_seen_at.unwrap() > first {
            assert_eq!(r.status, ExecutorStatus::Ready);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "last_seen_at never refreshed: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        w.store.last_event_seq(s.id).await.unwrap(),
        seq_before,
        "a healthy check publishes nothing"
    );

    let old = w.record(s.id).await;
    kill_tree(old.pid.unwrap()).await;
    // Noticed: executor `error` with the `recovering` code, an event, and
    // the session as it was (never ERROR).
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let r = w.record(s.id).await;
        if r.status == ExecutorStatus::Error || r.generation > old.generation {
            break;
        }
        assert!(Instant::now() < deadline, "dead agentctl never noticed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let events = w.store.events_after(s.id, seq_before, 1000).await.unwrap();
    let lost = events.iter().find_map(|e| match &e.payload {
        EventPayload::AgentctlError { error_message, .. } => Some(error_message.clone()),
        _ => None,
    });
    let lost = lost.unwrap_or_else(|| panic!("no agentctl_error event: {events:?}"));
    assert!(
        lost.starts_with("recovering:") && lost.contains("agentctl stopped answering"),
        "{lost}"
    );
    // Back by itself: a new agentctl, the agent running, the conversation
    // the same one.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let st = w.status(&mgr, s.id).await;
        assert_ne!(st.state, SessionState::Error, "{st:?}");
        let r = w.record(s.id).await;
        if st.is_agent_running && r.status == ExecutorStatus::Ready && r.generation > old.generation
        {
            assert_eq!(st.state, SessionState::WaitingForInput);
            assert!(!st.recovering && st.agent_recovery.is_none(), "{st:?}");
            assert!(r.error_message.is_none(), "{r:?}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "never came back by itself: {st:?} {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    w.track(s.id).await;
    let reply = w.prompt(&mgr, s.id, "still there?").await;
    assert_eq!(reply, expected_reply(1, &token, "still there?"));
    w.finish(&mgr, &[s.id]).await;
}

/// An idle session (WAITING_FOR_INPUT, nothing pending) holds no update
/// stream: its pump is parked after create and again after each turn. When
/// its agent exits while parked, the liveness check finds it (no stream
/// would report it). With agent restarts off: session ERROR with what
/// happened and what to do, a `state_changed` event, executor still
/// `ready`. A resume brings the agent back and the next message starts the
/// pump again and is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_session_is_parked_and_its_agent_exit_is_found_by_liveness() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager_with(ManagerConfig {
        agent_restarts: 0,
        ..with_liveness(&w, Some(Duration::from_millis(150)))
    });
    mgr.recovery().recover_all().await.unwrap();
    let s = w.create(&mgr, "idle").await;
    assert!(mgr.is_parked(s.id), "a new idle session holds no stream");
    mgr.send_message(w.task.id, s.id, "hello").await.unwrap();
    assert!(!mgr.is_parked(s.id), "a turn needs the stream");
    w.wait_state(&mgr, s.id, SessionState::WaitingForInput)
        .await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !mgr.is_parked(s.id) {
        assert!(
            Instant::now() < deadline,
            "the pump never parked after the turn"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(w.messages(s.id).await.len(), 2);
    let seq_before = w.store.last_event_seq(s.id).await.unwrap();

    // The agent (agentctl's child) dies; agentctl stays.
    let agentctl = w.record(s.id).await.pid.unwrap();
    let agents = children_of(agentctl);
    assert!(
        !agents.is_empty(),
        "no agent process under agentctl {agentctl}"
    );
    for pid in agents {
        kill9(pid);
    }
    w.wait_state(&mgr, s.id, SessionState::Error).await;
    let st = w.status(&mgr, s.id).await;
    let msg = st.error_message.clone().unwrap();
    assert!(msg.contains("agent process exited"), "{msg}");
    assert!(msg.contains("resume the session"), "{msg}");
    assert!(!st.is_agent_running);
    assert_eq!(st.executor_status, Some(ExecutorStatus::Ready));
    let events = w.store.events_after(s.id, seq_before, 1000).await.unwrap();
    assert!(
        events.iter().any(|e| matches!(
            e.payload,
            EventPayload::StateChanged {
                to: SessionState::Error,
                ..
            }
        )),
        "{events:?}"
    );

    mgr.resume_session(w.task.id, s.id).await.unwrap();
    w.wait_state(&mgr, s.id, SessionState::WaitingForInput)
        .await;
    mgr.send_message(w.task.id, s.id, "again").await.unwrap();
    w.wait_state(&mgr, s.id, SessionState::WaitingForInput)
        .await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while w.messages(s.id).await.len() < 4 || !w.messages(s.id).await[3].complete {
        assert!(Instant::now() < deadline, "second reply never stored");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    w.finish(&mgr, &[s.id]).await;
}

/// A session never prompted is idle from its creation (its pump parked, no
/// stream open); when its agent dies, agentctl rings the backend's doorbell
/// and sessiond restarts the agent at once, with the liveness checks off:
/// the push is all there is. The session comes back by itself and answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_never_prompted_sessions_agent_exit_is_pushed_through_the_doorbell() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager_with(with_liveness(&w, None));
    w.listen_and_recover(&mgr).await;
    let s = w.create(&mgr, "never-prompted").await;
    assert!(mgr.is_parked(s.id), "a new idle session holds no stream");
    let seq_before = w.store.last_event_seq(s.id).await.unwrap();
    let agentctl = w.record(s.id).await.pid.unwrap();
    let agents = children_of(agentctl);
    assert!(!agents.is_empty(), "no agent under agentctl {agentctl}");
    for pid in agents {
        kill9(pid);
    }
    let st = w.wait_agent_back(&mgr, s.id, seq_before).await;
    assert_eq!(st.executor_status, Some(ExecutorStatus::Ready));
    w.track(s.id).await;

    mgr.send_message(w.task.id, s.id, "after").await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while w.messages(s.id).await.len() < 2 || !w.messages(s.id).await[1].complete {
        assert!(Instant::now() < deadline, "no reply after the restart");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    w.finish(&mgr, &[s.id]).await;
}

/// With the checks off, nothing refreshes `last_seen_at`: the refresh above
/// is the liveness check's doing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn liveness_off_leaves_last_seen_alone() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager_with(with_liveness(&w, None));
    mgr.recovery().recover_all().await.unwrap();
    let s = w.create(&mgr, "off").await;
    let first = w.record(s.id).await.last_seen_at;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(w.record(s.id).await.last_seen_at, first);
    w.finish(&mgr, &[s.id]).await;
}

/// The orphan sweep removes only containers with positive evidence of being
/// untracked: labelled for an executor of one of our sessions with no
/// record, or for a stopped executor that tracks another container. It
/// leaves alone: tracked containers (running or stopped), unlabelled
/// containers, and labelled containers of sessions this store does not
/// know. It does nothing before the first recovery pass. Docker only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn orphan_sweep_removes_only_proven_orphans() {
    let w = World::new(Db::Sqlite).await;
    let kit = DockerKit::new(&w).await;
    let mgr = kit.manager(&w);
    let image = kit.env.image.clone();
    let live = w
        .create_rt(&mgr, "live", &kit.profile, Runtime::LocalDocker, None)
        .await;
    assert_eq!(
        live.state,
        SessionState::WaitingForInput,
        "{:?}",
        live.error_message
    );
    let ended = w
        .create_rt(&mgr, "ended", &kit.profile, Runtime::LocalDocker, None)
        .await;
    mgr.complete_session(w.task.id, ended.id).await.unwrap();
    let ended_rec = w.record(ended.id).await;
    assert_eq!(ended_rec.status, ExecutorStatus::Stopped);
    let live_c = kit.one_running(live.id).await;
    let ended_c = kit.containers_of_session(ended.id).await;
    assert_eq!(ended_c.len(), 1, "stopped container is kept: {ended_c:?}");

    let task = w.task.id.to_string();
    let label = |k: &str, v: &str| format!("--label={k}={v}");
    let create = |name: &str, labels: Vec<String>| {
        let mut args = vec!["create".to_owned(), "--name".to_owned(), name.to_owned()];
        args.extend(labels);
        args.push(image.clone());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        docker_cli(&kit.env, &args)
    };
    let tag = uuid::Uuid::new_v4().simple().to_string();
    // Orphan 1: our session, an executor id with no record.
    let no_record = create(
        &format!("sweep-norecord-{tag}"),
        vec![
            label("sessiond.executor_id", &ExecutorId::new().to_string()),
            label("sessiond.session_id", &ended.id.to_string()),
            label("sessiond.task_id", &task),
        ],
    );
    // Orphan 2: the stopped executor's label, but not the container it tracks.
    let superseded = create(
        &format!("sweep-superseded-{tag}"),
        vec![
            label("sessiond.executor_id", &ended_rec.id.to_string()),
            label("sessiond.session_id", &ended.id.to_string()),
            label("sessiond.task_id", &task),
        ],
    );
    // Kept: the live executor's label, not its container, but it is ready.
    let beside_live = create(
        &format!("sweep-besidelive-{tag}"),
        vec![
            label(
                "sessiond.executor_id",
                &w.record(live.id).await.id.to_string(),
            ),
            label("sessiond.session_id", &live.id.to_string()),
            label("sessiond.task_id", &task),
        ],
    );
    // Kept: a session this store does not know (another installation's).
    let foreign = create(
        &format!("sweep-foreign-{tag}"),
        vec![
            label("sessiond.executor_id", &ExecutorId::new().to_string()),
            label("sessiond.session_id", &SessionId::new().to_string()),
            label("sessiond.task_id", &task),
        ],
    );
    // Kept: no labels of ours at all.
    let unlabelled = create(&format!("sweep-unlabelled-{tag}"), vec![]);

    let report = mgr
        .recovery()
        .sweep_orphan_containers(&kit.driver)
        .await
        .unwrap();
    assert_eq!(
        report.examined, 0,
        "no sweep before the first recovery pass"
    );
    assert!(report.removed.is_empty());

    mgr.recovery().recover_all().await.unwrap();
    let report = mgr
        .recovery()
        .sweep_orphan_containers(&kit.driver)
        .await
        .unwrap();
    let mut removed = report.removed.clone();
    removed.sort();
    let mut expected = vec![no_record.clone(), superseded.clone()];
    expected.sort();
    assert_eq!(removed, expected, "{report:?}");

    let left = docker_cli(&kit.env, &["ps", "-a", "-q", "--no-trunc"]);
    for kept in [
        &live_c.id,
        &ended_c[0].id,
        &beside_live,
        &foreign,
        &unlabelled,
    ] {
        assert!(left.contains(kept.as_str()), "{kept} was removed");
    }
    for gone in [&no_record, &superseded] {
        assert!(!left.contains(gone.as_str()), "{gone} survived");
    }
    // The live session still works.
    let st = w.status(&mgr, live.id).await;
    assert_eq!(st.executor_status, Some(ExecutorStatus::Ready));
    for id in [&beside_live, &foreign, &unlabelled] {
        docker_cli(&kit.env, &["rm", "-f", id]);
    }
    mgr.cancel_session(w.task.id, live.id).await.unwrap();
    mgr.shutdown();
    for s in [live.id, ended.id] {
        let r = w.record(s).await;
        kit.driver
            .remove(&sessiond_executor::ExecutorHandle::from_record(&r))
            .await
            .unwrap();
    }
}

/// The background schedule: nothing is swept during the grace period after
/// the first recovery; then the orphan is removed. Docker only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn orphan_sweep_waits_for_recovery_and_grace() {
    let w = World::new(Db::Sqlite).await;
    let kit = DockerKit::new(&w).await;
    let config = ManagerConfig {
        orphan_sweep_grace: Duration::from_millis(1500),
        orphan_sweep_interval: Some(Duration::from_millis(200)),
        ..w.config()
    };
    let mgr = sessiond_engine::SessionManager::new(
        w.store.clone(),
        crate::docker_support::drivers_with(w.dir.path(), &kit.driver),
        config,
    );
    let ended = w
        .create_rt(&mgr, "ended", &kit.profile, Runtime::LocalDocker, None)
        .await;
    mgr.complete_session(w.task.id, ended.id).await.unwrap();
    let tag = uuid::Uuid::new_v4().simple().to_string();
    let orphan = docker_cli(
        &kit.env,
        &[
            "create",
            "--name",
            &format!("sweep-bg-{tag}"),
            &format!("--label=sessiond.executor_id={}", ExecutorId::new()),
            &format!("--label=sessiond.session_id={}", ended.id),
            &format!("--label=sessiond.task_id={}", w.task.id),
            &kit.env.image,
        ],
    );
    let exists =
        || docker_cli(&kit.env, &["ps", "-a", "-q", "--no-trunc"]).contains(orphan.as_str());
    mgr.recovery().start_orphan_sweep(kit.driver.clone());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(exists(), "swept before the first recovery pass");
    mgr.recovery().recover_all().await.unwrap();
    let recovered_at = Instant::now();
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        exists() || recovered_at.elapsed() >= Duration::from_millis(1500),
        "swept within the grace period"
    );
    let deadline = Instant::now() + Duration::from_secs(15);
    while exists() {
        assert!(Instant::now() < deadline, "orphan never swept");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        kit.containers_of_session(ended.id).await.len(),
        1,
        "the tracked stopped container stays"
    );
    mgr.shutdown();
    let r = w.record(ended.id).await;
    kit.driver
        .remove(&sessiond_executor::ExecutorHandle::from_record(&r))
        .await
        .unwrap();
}

/// agentctl is killed while the backend runs and nothing notices (the
/// session is idle: its pump parked, liveness off); the next message's
/// Prompt finds it gone. The message is stored and the call answers with
/// it: the session is never ERROR, it is recovered in the background (a
/// heavy agent relaunched and resumed) and the turn, which reached no
/// agent (agentctl's journal says so), is delivered then, exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_finds_agentctl_gone_is_delivered_once_it_is_back() {
    let w = World::new(Db::Sqlite).await;
    let (mgr, s) = w.heavy_session("gone").await;
    let token = s.resume_token.clone().unwrap();
    w.prompt(&mgr, s.id, "one").await;
    w.wait_parked(&mgr, s.id).await;
    let old = w.record(s.id).await;
    kill_tree(old.pid.unwrap()).await;

    let sent = mgr
        .send_message(w.task.id, s.id, "lost")
        .await
        .expect("stored, delivered once agentctl is back");
    assert_eq!(sent.content, "lost");
    let st = w.status(&mgr, s.id).await;
    assert_ne!(st.state, SessionState::Error, "{st:?}");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let st = w.status(&mgr, s.id).await;
        assert_ne!(st.state, SessionState::Error, "{st:?}");
        if st.state == SessionState::WaitingForInput
            && st.is_agent_running
            && st.executor_status == Some(ExecutorStatus::Ready)
            && !st.recovering
        {
            break;
        }
        assert!(Instant::now() < deadline, "never came back: {st:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        w.record(s.id).await.generation > old.generation,
        "relaunched"
    );
    w.track(s.id).await;
    // "lost" was the agent's second turn, answered in full, nothing
    // interrupted; the next message is the third.
    let messages = w.store.list_messages(s.id, 0, 100).await.unwrap();
    assert!(
        messages.iter().any(|m| m.role == MessageRole::Agent
            && m.complete
            && m.content == expected_reply(2, &token, "lost")),
        "the kept turn was delivered: {messages:?}"
    );
    assert!(
        !messages.iter().any(|m| m.role == MessageRole::System),
        "no turn was interrupted: {messages:?}"
    );
    let reply = w.prompt(&mgr, s.id, "two").await;
    assert_eq!(reply, expected_reply(3, &token, "two"));
    w.finish(&mgr, &[s.id]).await;
}

/// agentctl dies mid-turn: the turn ends interrupted and the session is
/// recovered in the background (a heavy agent, seconds to start). A retry
/// sent at once, while that recovery runs, waits for it and runs the turn
/// again, instead of finding no agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_right_after_an_interrupted_turn_waits_for_the_recovery() {
    let w = World::new(Db::Sqlite).await;
    let (mgr, s) = w.heavy_session("retry at once").await;
    let long = mgr
        .send_message(w.task.id, s.id, "/long story")
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !w
        .messages(s.id)
        .await
        .iter()
        .any(|m| m.role == MessageRole::Agent && m.seq > long.seq)
    {
        assert!(Instant::now() < deadline, "the reply never began");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let old = w.record(s.id).await;
    kill_tree(old.pid.unwrap()).await;
    // The turn ends interrupted; the agent is not back yet.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !w
        .messages(s.id)
        .await
        .iter()
        .any(|m| m.role == MessageRole::System && m.content.contains("interrupted"))
    {
        assert!(Instant::now() < deadline, "the turn never ended");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Found gone by its process, not after the stream's reconnects.
    let note = w
        .messages(s.id)
        .await
        .into_iter()
        .find(|m| m.role == MessageRole::System && m.content.contains("interrupted"))
        .unwrap();
    assert!(
        note.content
            .contains(&format!("its process {} exited", old.pid.unwrap())),
        "{note:?}"
    );
    let (retried, original) = mgr
        .retry_turn(w.task.id, s.id, None)
        .await
        .expect("the retry waits for the agent's recovery");
    assert_eq!(original, long.id);
    assert_eq!(retried.content, "/long story");
    assert!(
        w.record(s.id).await.generation > old.generation,
        "relaunched"
    );
    mgr.cancel_turn(w.task.id, s.id).await.unwrap();
    w.wait_state(&mgr, s.id, SessionState::WaitingForInput)
        .await;
    w.track(s.id).await;
    w.finish(&mgr, &[s.id]).await;
}

/// An idle session's agentctl killed with SIGKILL (its agent dies with
/// it): no update stream is open and no agent is left to ring the
/// doorbell, so the watch of this host's agentctl processes finds it at
/// once (the liveness round is an hour away here), and the session
/// recovers by itself: a new agentctl, the agent resumed, the conversation
/// going on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_sessions_killed_agentctl_is_found_at_once_and_recovered() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager_with(with_liveness(&w, Some(Duration::from_secs(3600))));
    mgr.recovery().recover_all().await.unwrap();
    let s = w.create(&mgr, "idle").await;
    let token = s.resume_token.clone().unwrap();
    w.prompt(&mgr, s.id, "one").await;
    w.wait_parked(&mgr, s.id).await;
    let old = w.record(s.id).await;
    kill9(old.pid.unwrap());
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = w.record(s.id).await;
        let st = w.status(&mgr, s.id).await;
        if r.pid != old.pid
            && r.status == ExecutorStatus::Ready
            && st.state == SessionState::WaitingForInput
            && st.is_agent_running
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the killed agentctl was not found and recovered: {r:?} {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    w.track(s.id).await;
    let reply = w.prompt(&mgr, s.id, "two").await;
    assert_eq!(reply, expected_reply(2, &token, "two"));
    w.finish(&mgr, &[s.id]).await;
}
