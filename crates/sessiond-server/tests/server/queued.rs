//! Messages sent while a turn runs are queued and delivered one turn at a
//! time, in order, each once — also across `kill -9` of sessiond (real
//! sessiond, agentctl and demo agent; the agent's side-effect file records
//! every prompt it ran, a gate file holds its turn).

use std::{path::Path, time::Duration};

use sessiond_proto::sessiond::v1 as pb;
use tonic::Code;

use crate::{restart::wait_serving, support::*};

/// A config with profile `gated`: the demo agent appends each prompt to
/// `side` and then waits while `gate` exists.
fn gated_config(root: &Path, side: &Path, gate: &Path) -> String {
    config_with(root, side, gate, "")
}

/// [`gated_config`] with an agent that behaves like a real one: seconds to
/// start (a runtime loading) and time per message to load its history.
fn heavy_gated_config(root: &Path, side: &Path, gate: &Path) -> String {
    config_with(
        root,
        side,
        gate,
        ", ACP_DEMO_STARTUP_MS = \"1500\", ACP_DEMO_RSS_MB = \"64\", \
         ACP_DEMO_LOAD_MS_PER_MESSAGE = \"50\"",
    )
}

fn config_with(root: &Path, side: &Path, gate: &Path, more_env: &str) -> String {
    let config = root.join("sessiond.toml");
    std::fs::write(
        &config,
        format!(
            "[[agents]]\nname = \"gated\"\ncommand = \"{}\"\n\
             env = {{ ACP_DEMO_STATE_DIR = \"{}\", ACP_DEMO_SIDE_EFFECT_FILE = \"{}\", \
             ACP_DEMO_GATE_FILE = \"{}\"{more_env} }}\n",
            bin("acp-demo-agent").display(),
            root.join("demo-state").display(),
            side.display(),
            gate.display(),
        ),
    )
    .unwrap();
    config.display().to_string()
}

fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

async fn until_lines(path: &Path, n: usize) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while lines(path).len() < n {
        assert!(
            std::time::Instant::now() < deadline,
            "the agent ran {:?}, waiting for {n} prompts",
            lines(path)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn send(task: &str, session: &str, text: &str) -> pb::SendMessageRequest {
    pb::SendMessageRequest {
        task_id: task.into(),
        session_id: session.into(),
        content: text.into(),
        ..Default::default()
    }
}

async fn status(c: &mut Sessions, task: &str, session: &str) -> pb::GetSessionStatusResponse {
    c.get_session_status(pb::GetSessionStatusRequest {
        task_id: task.into(),
        session_id: session.into(),
    })
    .await
    .unwrap()
    .into_inner()
}

fn cancel(task: &str, session: &str, id: &str) -> pb::CancelQueuedMessageRequest {
    pb::CancelQueuedMessageRequest {
        task_id: task.into(),
        session_id: session.into(),
        message_id: id.into(),
    }
}

fn reason(status: &tonic::Status) -> String {
    status
        .metadata()
        .get("sessiond-error")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default()
}

/// The user messages of the session, in order: (id, content).
async fn user_messages(c: &mut Sessions, task: &str, session: &str) -> Vec<(String, String)> {
    c.list_messages(pb::ListMessagesRequest {
        task_id: task.into(),
        session_id: session.into(),
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner()
    .messages
    .into_iter()
    .filter(|m| m.role == pb::MessageRole::User as i32)
    .map(|m| (m.id, m.content))
    .collect()
}

#[tokio::test]
async fn messages_sent_during_a_turn_are_queued_and_delivered_in_order_once() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (side, gate) = (root.join("side.txt"), root.join("gate"));
    let config = gated_config(root, &side, &gate);
    let server = start(&root.join("data"), &["--config", &config]);
    let mut c = sessions(&server).await;
    let work = root.join("work");
    std::fs::create_dir_all(&work).unwrap();
    let task = create_task(&mut c, "queue").await;
    let s = create_session(&mut c, &task.id, &work, "gated").await;

    std::fs::write(&gate, "").unwrap();
    let one = c
        .send_message(send(&task.id, &s.id, "one"))
        .await
        .unwrap()
        .into_inner();
    let one = one.message.expect("a turn started at once");
    until_lines(&side, 1).await;

    // A turn runs: queued, in order, listed in the status.
    let mut queued = Vec::new();
    for text in ["two", "three", "four"] {
        let r = c
            .send_message(send(&task.id, &s.id, text))
            .await
            .unwrap()
            .into_inner();
        assert!(r.message.is_none(), "{r:?}");
        let q = r.queued.expect("queued");
        assert_eq!(q.content, text);
        queued.push(q);
    }
    let st = status(&mut c, &task.id, &s.id).await;
    let listed: Vec<&str> = st
        .queued_messages
        .iter()
        .map(|q| q.content.as_str())
        .collect();
    assert_eq!(listed, ["two", "three", "four"]);

    // Who asks not to queue is refused, and nothing is stored.
    let mut refused = send(&task.id, &s.id, "never");
    refused.no_queue = true;
    let err = c.send_message(refused).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert_eq!(reason(&err), "invalid_state");

    // "three" is taken back; taking it again finds nothing.
    let taken = c
        .cancel_queued_message(cancel(&task.id, &s.id, &queued[1].id))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(taken.cancelled.unwrap().content, "three");
    let err = c
        .cancel_queued_message(cancel(&task.id, &s.id, &queued[1].id))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");

    // The gate opens: "one", then "two", then "four", one turn each.
    std::fs::remove_file(&gate).unwrap();
    turn_end(&mut c, &s.id, &queued[2].id).await;
    assert_eq!(lines(&side), ["one", "two", "four"]);
    let users = user_messages(&mut c, &task.id, &s.id).await;
    assert_eq!(
        users,
        [
            (one.id.clone(), "one".to_owned()),
            (queued[0].id.clone(), "two".to_owned()),
            (queued[2].id.clone(), "four".to_owned()),
        ],
        "each queued message became the user message of its turn, with its id"
    );
    assert!(
        status(&mut c, &task.id, &s.id)
            .await
            .queued_messages
            .is_empty()
    );
    let err = c
        .cancel_queued_message(cancel(&task.id, &s.id, &queued[0].id))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert_eq!(reason(&err), "already_delivered");

    // Watchers saw the queue change as it happened.
    let events = replayed_events(&mut c, &s.id).await;
    let sizes: Vec<usize> = events
        .iter()
        .filter_map(|e| match &e.payload {
            Some(pb::event::Payload::QueueChanged(q)) => Some(q.queued.len()),
            _ => None,
        })
        .collect();
    assert_eq!(
        sizes,
        [1, 2, 3, 2, 1, 0],
        "queued ×3, cancelled, delivered ×2"
    );
}

/// sessiond is killed while a turn runs with a message queued behind it;
/// the turn ends while sessiond is down. The restarted sessiond delivers the
/// queued message once; another `kill -9` after that delivers nothing again.
#[tokio::test]
async fn a_queued_message_survives_kill_9_of_sessiond_and_is_delivered_once() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (side, gate) = (root.join("side.txt"), root.join("gate"));
    let config = gated_config(root, &side, &gate);
    let data = root.join("data");
    let mut server = start(&data, &["--config", &config]);
    let mut c = sessions(&server).await;
    let work = root.join("work");
    std::fs::create_dir_all(&work).unwrap();
    let task = create_task(&mut c, "queue across a crash").await;
    let s = create_session(&mut c, &task.id, &work, "gated").await;

    std::fs::write(&gate, "").unwrap();
    c.send_message(send(&task.id, &s.id, "one"))
        .await
        .unwrap()
        .into_inner()
        .message
        .expect("started");
    until_lines(&side, 1).await;
    let two = c
        .send_message(send(&task.id, &s.id, "two"))
        .await
        .unwrap()
        .into_inner()
        .queued
        .expect("queued");

    server.kill();
    // agentctl and the agent live on: the turn ends while sessiond is down.
    std::fs::remove_file(&gate).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        lines(&side),
        ["one"],
        "nothing delivers while sessiond is down"
    );

    let server = start(&data, &["--config", &config]);
    wait_serving(&server).await;
    let mut c = sessions(&server).await;
    turn_end(&mut c, &s.id, &two.id).await;
    assert_eq!(lines(&side), ["one", "two"]);

    // Again: nothing is queued any more, nothing runs twice.
    drop(server);
    let server = start(&data, &["--config", &config]);
    wait_serving(&server).await;
    let mut c = sessions(&server).await;
    let st = status(&mut c, &task.id, &s.id).await;
    assert!(st.queued_messages.is_empty(), "{st:?}");
    let ran = prompt(&mut c, &task.id, &s.id, "three").await;
    assert!(ran.contains("three"), "{ran}");
    assert_eq!(lines(&side), ["one", "two", "three"]);
    let users: Vec<String> = user_messages(&mut c, &task.id, &s.id)
        .await
        .into_iter()
        .map(|(_, text)| text)
        .collect();
    assert_eq!(users, ["one", "two", "three"]);
}

/// Everything is killed (sessiond, agentctl, the agent in the middle of
/// turn one) with a message queued: after the restart, turn one ends
/// interrupted (never sent again by itself), and the queued message is held
/// behind it, the user deciding: once turn one is retried, the queued
/// message is delivered once to the resumed agent — a heavy one, slow to
/// start and to load its history.
#[tokio::test]
async fn a_queued_message_survives_kill_9_of_everything_and_is_delivered_once() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (side, gate) = (root.join("side.txt"), root.join("gate"));
    let config = heavy_gated_config(root, &side, &gate);
    let data = root.join("data");
    let mut server = start(&data, &["--config", &config]);
    let mut c = sessions(&server).await;
    let work = root.join("work");
    std::fs::create_dir_all(&work).unwrap();
    let task = create_task(&mut c, "queue across kill -9 of everything").await;
    let s = create_session(&mut c, &task.id, &work, "gated").await;

    std::fs::write(&gate, "").unwrap();
    let one = c
        .send_message(send(&task.id, &s.id, "one"))
        .await
        .unwrap()
        .into_inner()
        .message
        .expect("started");
    until_lines(&side, 1).await;
    let two = c
        .send_message(send(&task.id, &s.id, "two"))
        .await
        .unwrap()
        .into_inner()
        .queued
        .expect("queued");

    // sessiond and every agentctl of its data directory (with its agent).
    server.kill_everything();
    drop(server);
    std::fs::remove_file(&gate).unwrap();

    let server = start(&data, &["--config", &config]);
    wait_serving(&server).await;
    let mut c = sessions(&server).await;
    let ended = turn_end(&mut c, &s.id, &one.id).await;
    assert_eq!(ended.stop_reason, "interrupted", "{ended:?}");
    // Held: the agent is back, the queue waits for the user's decision.
    for _ in 0..600 {
        let st = status(&mut c, &task.id, &s.id).await;
        if st.is_agent_running && st.state == pb::SessionState::WaitingForInput as i32 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let st = status(&mut c, &task.id, &s.id).await;
    assert_eq!(st.queued_messages.len(), 1, "{st:?}");
    assert!(st.queue_held, "{st:?}");
    assert_eq!(lines(&side), ["one"], "turn one not re-sent, two held");
    let retried = c
        .retry_turn(pb::RetryTurnRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
            message_id: one.id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .message
        .unwrap();
    turn_end(&mut c, &s.id, &retried.id).await;
    turn_end(&mut c, &s.id, &two.id).await;
    assert_eq!(
        lines(&side),
        ["one", "one", "two"],
        "turn one again on request only, then two once"
    );
    let users: Vec<String> = user_messages(&mut c, &task.id, &s.id)
        .await
        .into_iter()
        .map(|(_, text)| text)
        .collect();
    assert_eq!(users, ["one", "one", "two"]);
}

fn keyed(task: &str, session: &str, text: &str, key: &str) -> pb::SendMessageRequest {
    pb::SendMessageRequest {
        request_id: key.into(),
        ..send(task, session, text)
    }
}

/// A send repeated with its request id answers with what the first did —
/// the turn it started, its queued copy, that copy once delivered — and
/// the agent runs each message once; the same key with another text, or a
/// key too long, is refused and stores nothing.
#[tokio::test]
async fn a_send_repeated_with_its_request_id_is_sent_once() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (side, gate) = (root.join("side.txt"), root.join("gate"));
    let config = gated_config(root, &side, &gate);
    let server = start(&root.join("data"), &["--config", &config]);
    let mut c = sessions(&server).await;
    let work = root.join("work");
    std::fs::create_dir_all(&work).unwrap();
    let task = create_task(&mut c, "request ids").await;
    let s = create_session(&mut c, &task.id, &work, "gated").await;

    std::fs::write(&gate, "").unwrap();
    let mut sent = Vec::new();
    for _ in 0..2 {
        let r = c
            .send_message(keyed(&task.id, &s.id, "one", "key-1"))
            .await
            .unwrap()
            .into_inner();
        sent.push(r.message.expect("the turn, started or found"));
    }
    assert_eq!(sent[0].id, sent[1].id, "{sent:?}");
    until_lines(&side, 1).await;

    // Queued behind the running turn, once.
    let mut queued = Vec::new();
    for _ in 0..2 {
        let r = c
            .send_message(keyed(&task.id, &s.id, "two", "key-2"))
            .await
            .unwrap()
            .into_inner();
        queued.push(r.queued.expect("queued, or found queued"));
    }
    assert_eq!(queued[0].id, queued[1].id, "{queued:?}");
    let st = status(&mut c, &task.id, &s.id).await;
    assert_eq!(st.queued_messages.len(), 1, "{st:?}");

    // The same key for another text is not that message.
    let err = c
        .send_message(keyed(&task.id, &s.id, "not one", "key-1"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("request_id"), "{err:?}");
    let err = c
        .send_message(keyed(&task.id, &s.id, "three", &"k".repeat(129)))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("request_id"), "{err:?}");

    // The gate opens: "one", then "two"; a repeat now finds "two" stored.
    std::fs::remove_file(&gate).unwrap();
    turn_end(&mut c, &s.id, &queued[0].id).await;
    let again = c
        .send_message(keyed(&task.id, &s.id, "two", "key-2"))
        .await
        .unwrap()
        .into_inner();
    let delivered = again.message.expect("the delivered message");
    assert_eq!(delivered.id, queued[0].id);
    assert_eq!(lines(&side), ["one", "two"]);
    let users = user_messages(&mut c, &task.id, &s.id).await;
    assert_eq!(
        users,
        [
            (sent[0].id.clone(), "one".to_owned()),
            (queued[0].id.clone(), "two".to_owned()),
        ]
    );
}

/// sessiond is killed while a keyed message's turn runs (a heavy agent,
/// slow to start and to load its history): the client, which may never
/// have had its answer, sends the same request again to the restarted
/// sessiond and gets the same message; the agent ran it once.
#[tokio::test]
async fn a_keyed_send_repeated_after_kill_9_of_sessiond_runs_once() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (side, gate) = (root.join("side.txt"), root.join("gate"));
    let config = heavy_gated_config(root, &side, &gate);
    let data = root.join("data");
    let mut server = start(&data, &["--config", &config]);
    let mut c = sessions(&server).await;
    let work = root.join("work");
    std::fs::create_dir_all(&work).unwrap();
    let task = create_task(&mut c, "a keyed send across kill -9").await;
    let s = create_session(&mut c, &task.id, &work, "gated").await;

    std::fs::write(&gate, "").unwrap();
    let first = c
        .send_message(keyed(&task.id, &s.id, "one", "key-1"))
        .await
        .unwrap()
        .into_inner()
        .message
        .expect("started");
    until_lines(&side, 1).await;
    server.kill();

    let server = start(&data, &["--config", &config]);
    wait_serving(&server).await;
    let mut c = sessions(&server).await;
    let again = c
        .send_message(keyed(&task.id, &s.id, "one", "key-1"))
        .await
        .unwrap()
        .into_inner()
        .message
        .expect("the running turn's message");
    assert_eq!(again.id, first.id);
    std::fs::remove_file(&gate).unwrap();
    turn_end(&mut c, &s.id, &first.id).await;
    assert_eq!(lines(&side), ["one"], "the agent ran it once");
    let users = user_messages(&mut c, &task.id, &s.id).await;
    assert_eq!(users, [(first.id.clone(), "one".to_owned())]);
}
