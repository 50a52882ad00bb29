//! WatchMany: several sessions' and tasks' streams in one call (what the
//! console's tabs share, on a browser's six HTTP/1.1 connections per host).

use std::time::{Duration, Instant};

use sessiond_proto::sessiond::v1 as pb;
use tonic::Code;

use crate::support::*;

/// Events of each target arrive under its index, from its cursor; a
/// deleted session ends alone (NOT_FOUND) and the others go on.
#[tokio::test]
async fn targets_are_followed_apart_and_end_apart() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&dir.path().join("data"), &[]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "many").await;
    let (wa, wb) = (dir.path().join("a"), dir.path().join("b"));
    std::fs::create_dir_all(&wa).unwrap();
    std::fs::create_dir_all(&wb).unwrap();
    let a = create_session(&mut c, &task.id, &wa, "").await;
    let b = create_session(&mut c, &task.id, &wb, "").await;
    prompt(&mut c, &task.id, &a.id, "one").await;

    let target = |session: &str, task: &str, after: i64| pb::WatchTarget {
        session_id: session.into(),
        task_id: task.into(),
        after,
    };
    let mut stream = c
        .watch_many(pb::WatchManyRequest {
            targets: vec![
                target(&a.id, "", 0),
                target(&b.id, "", 0),
                target("", &task.id, 0),
            ],
        })
        .await
        .unwrap()
        .into_inner();
    prompt(&mut c, &task.id, &b.id, "two").await;
    c.delete_session(pb::DeleteSessionRequest {
        task_id: task.id.clone(),
        session_id: a.id.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    prompt(&mut c, &task.id, &b.id, "three").await;

    // Until both b's stream and the task's have b's second turn's end (its
    // turn "three"), and a's target ended.
    let mut seen: [Vec<pb::Event>; 3] = Default::default();
    let mut ended = None;
    let deadline = Instant::now() + Duration::from_secs(60);
    let b_turns = |events: &[pb::Event]| {
        events
            .iter()
            .filter(|e| {
                e.session_id == b.id && matches!(&e.payload, Some(pb::event::Payload::TurnEnded(_)))
            })
            .count()
    };
    while b_turns(&seen[2]) < 2 || b_turns(&seen[1]) < 2 || ended.is_none() {
        let left = deadline.saturating_duration_since(Instant::now());
        let answer = tokio::time::timeout(left, stream.message())
            .await
            .expect("the stream stalled")
            .unwrap()
            .expect("the stream ended");
        let i = answer.target as usize;
        match (answer.event, answer.ended) {
            (Some(e), None) => seen[i].push(e),
            (None, Some(end)) => {
                assert_eq!(i, 0, "{end:?}");
                ended = Some(end);
            }
            other => panic!("neither an event nor an end: {other:?}"),
        }
    }
    let end = ended.expect("the deleted session's target never ended");
    assert_eq!(end.code, Code::NotFound as i32, "{end:?}");
    // Each session target has only its session's events, in order, once.
    for (i, s) in [(0, &a.id), (1, &b.id)] {
        assert!(!seen[i].is_empty());
        assert!(seen[i].iter().all(|e| &e.session_id == s));
        assert!(
            seen[i].windows(2).all(|w| w[1].seq == w[0].seq + 1),
            "{i}: a gap or a repeat"
        );
        assert_eq!(seen[i][0].seq, 1);
    }
    assert_eq!(b_turns(&seen[1]), 2);
    assert!(seen[2].windows(2).all(|w| w[1].task_seq > w[0].task_seq));
    assert!(seen[2].iter().any(|e| e.session_id == a.id));

    // A cursor is honoured: b from its last seq replays nothing.
    let last = seen[1].last().unwrap().seq;
    let mut again = c
        .watch_many(pb::WatchManyRequest {
            targets: vec![target(&b.id, "", last)],
        })
        .await
        .unwrap()
        .into_inner();
    prompt(&mut c, &task.id, &b.id, "four").await;
    let next = tokio::time::timeout(Duration::from_secs(30), again.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(next.event.unwrap().seq, last + 1);
}

/// A target that ended gives its watch-stream slot back while the call
/// goes on (helper-50 5: it was held until the call ended).
#[tokio::test]
async fn an_ended_target_frees_its_slot() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(
        &dir.path().join("data"),
        &["--max-watch-streams-per-token", "2"],
    );
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "slots").await;
    let (wa, wb) = (dir.path().join("a"), dir.path().join("b"));
    std::fs::create_dir_all(&wa).unwrap();
    std::fs::create_dir_all(&wb).unwrap();
    let a = create_session(&mut c, &task.id, &wa, "").await;
    let b = create_session(&mut c, &task.id, &wb, "").await;
    let target = |session: &str| pb::WatchTarget {
        session_id: session.into(),
        ..Default::default()
    };
    let mut stream = c
        .watch_many(pb::WatchManyRequest {
            targets: vec![target(&a.id), target(&b.id)],
        })
        .await
        .unwrap()
        .into_inner();
    let watch_b = pb::WatchSessionRequest {
        session_id: b.id.clone(),
        after_seq: 0,
    };
    let err = c.watch_session(watch_b.clone()).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
    c.delete_session(pb::DeleteSessionRequest {
        task_id: task.id.clone(),
        session_id: a.id.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let answer = tokio::time::timeout(left, stream.message())
            .await
            .expect("a's target never ended")
            .unwrap()
            .expect("the call ended");
        if answer.ended.is_some() {
            assert_eq!(answer.target, 0);
            break;
        }
    }
    // The slot is given back as the target's stream ends, in the server's
    // own time after the answer went out.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match c.watch_session(watch_b.clone()).await {
            Ok(_) => break,
            Err(e) if e.code() == Code::ResourceExhausted && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("the ended target kept its slot: {e}"),
        }
    }
    // The call goes on for b.
    prompt(&mut c, &task.id, &b.id, "still here").await;
    let next = tokio::time::timeout(Duration::from_secs(30), stream.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(next.target, 1);
}

/// Bad targets are refused as input, naming the target.
#[tokio::test]
async fn bad_targets_are_invalid_arguments() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&dir.path().join("data"), &[]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "bad").await;
    let cases = [
        (vec![], "targets: 0 given"),
        (
            vec![pb::WatchTarget::default()],
            "targets[0]: give exactly one of session_id and task_id",
        ),
        (
            vec![pb::WatchTarget {
                session_id: "nope".into(),
                ..Default::default()
            }],
            "targets[0].session_id",
        ),
        (
            vec![pb::WatchTarget {
                task_id: task.id.clone(),
                after: -1,
                ..Default::default()
            }],
            "targets[0].after: must not be negative",
        ),
        (
            vec![
                pb::WatchTarget {
                    task_id: task.id.clone(),
                    ..Default::default()
                };
                65
            ],
            "targets: 65 given",
        ),
    ];
    for (targets, says) in cases {
        let err = c
            .watch_many(pb::WatchManyRequest { targets })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
        assert!(err.message().contains(says), "{says}: {}", err.message());
    }
}
