use sessiond_domain::{EventKind, EventPayload, SessionState};

use crate::support::{Db, World, assert_consecutive, collect_until, expected_reply};

fn turn_done(e: &sessiond_domain::Event) -> bool {
    matches!(
        e.payload,
        EventPayload::StateChanged {
            to: SessionState::WaitingForInput,
            from: SessionState::Running,
            ..
        }
    )
}

/// WatchSession with a cursor replays what is stored after it and then
/// tails live events, with no gap and no duplicate, across a restart.
async fn watch_replays_then_tails(db: Db) {
    let w = World::new(db).await;
    let mgr = w.manager();
    let s = w.create(&mgr, "w").await;
    let token = s.resume_token.clone().unwrap();

    // A subscriber from the start sees the first turn live.
    let mut live = mgr.watch_session(s.id, 0).await.unwrap();
    mgr.send_message(w.task.id, s.id, "one").await.unwrap();
    let first = collect_until(&mut live, turn_done).await;
    assert_consecutive(&first, 1);
    let cursor = 3; // a client that saw only the first three events
    drop(live);

    // Backend restart.
    mgr.shutdown();
    drop(mgr);
    let mgr = w.manager();
    mgr.recovery().recover_all().await.unwrap();

    // Reconnect with the cursor: replay 4.., then the next turn live.
    let mut again = mgr.watch_session(s.id, cursor).await.unwrap();
    // The first replayed event arrives before the second turn starts.
    let mut seen = collect_until(&mut again, |_| true).await;
    mgr.send_message(w.task.id, s.id, "two").await.unwrap();
    w.wait_state(&mgr, s.id, SessionState::WaitingForInput)
        .await;
    let last = w.store.last_event_seq(s.id).await.unwrap();
    seen.extend(collect_until(&mut again, |e| e.seq == last).await);
    assert_consecutive(&seen, cursor + 1);
    let stored = w.events(s.id).await;
    assert_eq!(seen.last().unwrap().seq, stored.last().unwrap().seq);
    assert_eq!(&stored[cursor as usize..], &seen[..]);
    let reply = w.messages(s.id).await.last().unwrap().content.clone();
    assert_eq!(reply, expected_reply(2, &token, "two"));

    // The task stream carries the same events in task_seq order.
    let mut task_stream = mgr.watch_task(w.task.id, 0).await.unwrap();
    let last_task_seq = w.store.last_task_event_seq(w.task.id).await.unwrap();
    let all = collect_until(&mut task_stream, |e| e.task_seq == last_task_seq).await;
    for (i, e) in all.iter().enumerate() {
        assert_eq!(e.task_seq, i as i64 + 1);
    }
    w.finish(&mgr, &[s.id]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_replays_then_tails_sqlite() {
    watch_replays_then_tails(Db::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_replays_then_tails_postgres() {
    watch_replays_then_tails(Db::Postgres).await;
}

/// A replay of large events (each 3 MB, as a long reply's updates carry
/// the whole message) comes in pages bounded in bytes, and every stored
/// event arrives in order without waiting for a new one, on the session's
/// stream and on the task's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_of_large_events_comes_whole_in_bounded_pages() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager();
    let s = w.create(&mgr, "big").await;
    let big = "x".repeat(3 << 20);
    for _ in 0..4 {
        w.store
            .commit(sessiond_store::Changeset::new().event(
                s.id,
                EventPayload::AgentctlError {
                    executor_id: sessiond_domain::ExecutorId::new(),
                    error_message: big.clone(),
                },
            ))
            .await
            .unwrap();
    }
    let last = w.store.last_event_seq(s.id).await.unwrap();
    let mut stream = mgr.watch_session(s.id, 0).await.unwrap();
    let seen = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        collect_until(&mut stream, |e| e.seq == last),
    )
    .await
    .expect("the whole replay, with no new event to wake it");
    assert_consecutive(&seen, 1);
    let last_task_seq = w.store.last_task_event_seq(w.task.id).await.unwrap();
    let mut task_stream = mgr.watch_task(w.task.id, 0).await.unwrap();
    let all = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        collect_until(&mut task_stream, |e| e.task_seq == last_task_seq),
    )
    .await
    .expect("the whole task replay");
    assert_eq!(all.len() as i64, last_task_seq);
    w.finish(&mgr, &[s.id]).await;
}

/// Two sessions of one task: own executions, own statuses, own event
/// streams; ending one leaves the other running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_sessions_of_one_task_stay_independent() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager();
    let a = w.create(&mgr, "a").await;
    let b = w.create(&mgr, "b").await;
    let ra = w.record(a.id).await;
    let rb = w.record(b.id).await;
    assert_ne!(ra.id, rb.id);
    assert_ne!(ra.pid, rb.pid);

    let mut watch_b = mgr.watch_session(b.id, 0).await.unwrap();
    assert_eq!(mgr.events().watched(), (1, 0), "one channel, B's");
    let reply = w.prompt(&mgr, a.id, "for a").await;
    assert_eq!(
        reply,
        expected_reply(1, a.resume_token.as_deref().unwrap(), "for a")
    );
    assert!(w.messages(b.id).await.is_empty());
    let sa = w.status(&mgr, a.id).await;
    let sb = w.status(&mgr, b.id).await;
    assert_eq!(
        sa.agent_execution_id.as_deref(),
        Some(ra.execution_id().as_str())
    );
    assert_eq!(
        sb.agent_execution_id.as_deref(),
        Some(rb.execution_id().as_str())
    );

    // B's stream holds B's events only.
    let last_b = w.store.last_event_seq(b.id).await.unwrap();
    let seen = collect_until(&mut watch_b, |e| e.seq == last_b).await;
    assert!(seen.iter().all(|e| e.session_id == b.id));
    assert!(!seen.iter().any(|e| e.kind() == EventKind::MessageAdded));

    // A loses its agentctl; B is unaffected.
    mgr.cancel_session(w.task.id, a.id).await.unwrap();
    let sa = w.status(&mgr, a.id).await;
    let sb = w.status(&mgr, b.id).await;
    assert!(!sa.is_agent_running);
    assert!(sb.is_agent_running);
    assert_eq!(sb.state, SessionState::WaitingForInput);
    w.prompt(&mgr, b.id, "for b").await;
    drop(watch_b);
    assert_eq!(
        mgr.events().watched(),
        (0, 0),
        "the last watcher removes its channel"
    );
    w.finish(&mgr, &[b.id]).await;
}

/// A watch of a session that is then deleted hands out what was
/// committed, then ends with NOT_FOUND instead of staying open silently
/// (helper-21 #7).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_of_a_deleted_session_ends_saying_so() {
    use futures::StreamExt as _;
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager();
    let s = w.create(&mgr, "gone").await;
    w.prompt(&mgr, s.id, "one").await;
    let mut watch = mgr.watch_session(s.id, 0).await.unwrap();
    mgr.delete_session(w.task.id, s.id).await.unwrap();
    let last = w.store.last_event_seq(s.id).await.unwrap_or_default();
    let mut seqs = Vec::new();
    let end = loop {
        // Bounds a failure (a stream left open) only.
        let next = tokio::time::timeout(std::time::Duration::from_secs(60), watch.next())
            .await
            .expect("the watch stayed open after the delete");
        match next {
            Some(Ok(e)) => seqs.push(e.seq),
            Some(Err(e)) => break e,
            None => panic!("ended without saying why, after {seqs:?}"),
        }
    };
    assert_eq!(end.kind(), sessiond_engine::ErrorKind::NotFound, "{end}");
    assert!(seqs.len() as i64 >= last.min(1), "{seqs:?}");
    assert_eq!(seqs, (1..=seqs.len() as i64).collect::<Vec<_>>());
    assert!(watch.next().await.is_none());
    assert_eq!(mgr.events().watched(), (0, 0));
    w.finish(&mgr, &[]).await;
}

/// 1,000 events committed while a subscriber disconnects and reconnects at
/// random points with its last seq (and lags behind a tiny live buffer): it
/// sees seq 1..=1000 exactly once, in order.
async fn thousand_events_with_reconnects(db: Db) {
    use futures::StreamExt;
    use sessiond_store::Changeset;
    let w = World::new(db).await;
    let mgr = w.manager_with(sessiond_engine::ManagerConfig {
        event_buffer: 16,
        replay_page: 64,
        ..w.config()
    });
    let now = chrono::Utc::now();
    let session = sessiond_domain::Session {
        id: sessiond_domain::SessionId::new(),
        task_id: w.task.id,
        state: SessionState::WaitingForInput,
        agent_profile_id: w.profile.id,
        agent_execution_id: None,
        runtime: sessiond_domain::Runtime::LocalStandalone,
        executor_id: None,
        worktree: w.worktree("events"),
        title: String::new(),
        resume_token: None,
        metadata: Default::default(),
        error_message: None,
        version: 1,
        created_at: now,
        updated_at: now,
    };
    let (session, _) = w.store.create_session(&session, vec![]).await.unwrap();
    let sid = session.id;
    const N: i64 = 1000;

    let writer = {
        let store = w.store.clone();
        let bus = mgr.events().clone();
        tokio::spawn(async move {
            let mut written = 0;
            while written < N {
                let batch = 1 + (random() % 5) as i64;
                let mut change = Changeset::new();
                for _ in 0..batch.min(N - written) {
                    change = change.event(
                        sid,
                        EventPayload::StateChanged {
                            from: SessionState::Running,
                            to: SessionState::WaitingForInput,
                            error_message: None,
                        },
                    );
                }
                let c = store.commit(change).await.unwrap();
                written += c.events.len() as i64;
                bus.publish(&c.events);
                if random().is_multiple_of(4) {
                    tokio::task::yield_now().await;
                }
            }
        })
    };

    let mut seen = Vec::new();
    let mut last = 0;
    let mut reconnects = 0;
    while last < N {
        let mut stream = mgr.watch_session(sid, last).await.unwrap();
        let take = 1 + random() % 120;
        for _ in 0..take {
            let e = tokio::time::timeout(std::time::Duration::from_secs(10), stream.next())
                .await
                .expect("stalled")
                .expect("ended")
                .unwrap();
            assert_eq!(e.seq, last + 1, "no gap, no duplicate");
            last = e.seq;
            seen.push(e.seq);
            if last == N {
                break;
            }
        }
        reconnects += 1;
    }
    writer.await.unwrap();
    assert_eq!(seen, (1..=N).collect::<Vec<_>>());
    eprintln!("1000 events seen exactly once across {reconnects} connections");
    w.finish(&mgr, &[]).await;
}

fn random() -> u64 {
    (uuid::Uuid::new_v4().as_u128() & 0xffff_ffff) as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_events_with_reconnects_sqlite() {
    thousand_events_with_reconnects(Db::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_events_with_reconnects_postgres() {
    thousand_events_with_reconnects(Db::Postgres).await;
}
