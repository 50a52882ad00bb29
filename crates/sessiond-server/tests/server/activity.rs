//! The agent's activity in the API: every ACP `session/update` kind the demo
//! agent's `/activity` sends becomes a typed message part, streamed by
//! WatchSession, listed by ListMessages, and the same after a kill -9 and a
//! restart of sessiond (stored, replayed by seq).

use std::time::Duration;

use sessiond_proto::sessiond::v1::{self as pb, message::Part, tool_call_content::Content};

use crate::metrics::http_get;
use crate::support::*;

/// The session's events from `after_seq` until the turn after user message
/// `user_seq` ends (the state goes back to WAITING_FOR_INPUT).
async fn turn_events(c: &mut Sessions, session: &str, user_seq: i64) -> Vec<pb::Event> {
    let mut stream = c
        .watch_session(pb::WatchSessionRequest {
            session_id: session.into(),
            after_seq: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let mut events = Vec::new();
    let mut in_turn = false;
    loop {
        let e = tokio::time::timeout(Duration::from_secs(60), stream.message())
            .await
            .expect("the turn ended in time")
            .unwrap()
            .expect("stream open");
        match &e.payload {
            Some(pb::event::Payload::MessageAdded(pb::MessageAdded { message: Some(m) }))
                if m.seq == user_seq =>
            {
                in_turn = true;
            }
            Some(pb::event::Payload::StateChanged(sc))
                if in_turn && sc.to == pb::SessionState::WaitingForInput as i32 =>
            {
                events.push(e);
                return events;
            }
            _ => {}
        }
        events.push(e);
    }
}

async fn list(c: &mut Sessions, task: &str, session: &str) -> Vec<pb::Message> {
    c.list_messages(pb::ListMessagesRequest {
        task_id: task.into(),
        session_id: session.into(),
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner()
    .messages
}

fn of_kind(msgs: &[pb::Message], kind: pb::MessageKind) -> Vec<&pb::Message> {
    msgs.iter().filter(|m| m.kind == kind as i32).collect()
}

/// Checks every part `/activity` makes, as stored (complete, typed).
fn assert_activity_parts(msgs: &[pb::Message]) {
    let tools = of_kind(msgs, pb::MessageKind::ToolCall);
    assert_eq!(tools.len(), 1, "{msgs:#?}");
    let t = tools[0];
    assert!(t.complete);
    assert_eq!(t.role, pb::MessageRole::Agent as i32);
    assert_eq!(t.content, "edit notes.txt");
    let Some(Part::ToolCall(call)) = &t.part else {
        panic!("no tool call part: {t:?}")
    };
    assert_eq!(call.tool_call_id, "demo-edit-1");
    assert_eq!(call.tool_kind, "edit");
    assert_eq!(call.status, "completed", "the update merged in");
    let contents: Vec<_> = call.content.iter().map(|c| c.content.clone()).collect();
    assert_eq!(
        contents,
        vec![
            Some(Content::Text("edited 1 line".into())),
            Some(Content::Diff(pb::FileDiff {
                path: "notes.txt".into(),
                old_text: Some("old line".into()),
                new_text: "new line".into(),
            })),
        ]
    );
    assert_eq!(
        call.locations,
        vec![pb::ToolCallLocation {
            path: "notes.txt".into(),
            line: Some(3)
        }]
    );
    assert!(t.part_rev >= 2, "created, then updated: {t:?}");

    let thoughts = of_kind(msgs, pb::MessageKind::Thought);
    assert_eq!(thoughts.len(), 1, "{msgs:#?}");
    assert_eq!(thoughts[0].content, "thinking about it");
    assert!(thoughts[0].complete);

    let plans = of_kind(msgs, pb::MessageKind::Plan);
    assert_eq!(plans.len(), 1);
    assert!(plans[0].complete, "closed at the turn's end");
    let Some(Part::Plan(plan)) = &plans[0].part else {
        panic!("no plan part: {:?}", plans[0])
    };
    assert_eq!(
        plan.entries,
        vec![
            pb::PlanEntry {
                content: "read the file".into(),
                priority: "high".into(),
                status: "completed".into()
            },
            pb::PlanEntry {
                content: "edit the file".into(),
                priority: "medium".into(),
                status: "in_progress".into()
            },
        ]
    );

    let commands = of_kind(msgs, pb::MessageKind::AvailableCommands);
    assert_eq!(commands.len(), 1);
    let Some(Part::AvailableCommands(cmds)) = &commands[0].part else {
        panic!("no commands part: {:?}", commands[0])
    };
    assert_eq!(
        cmds.commands
            .iter()
            .map(|c| (c.name.as_str(), c.description.as_str()))
            .collect::<Vec<_>>(),
        [
            ("tool", "report a tool call"),
            ("activity", "report every kind of activity")
        ]
    );

    let modes = of_kind(msgs, pb::MessageKind::CurrentMode);
    assert_eq!(modes.len(), 1);
    assert_eq!(
        modes[0].part,
        Some(Part::CurrentMode(pb::CurrentModePart {
            mode_id: "plan".into()
        }))
    );

    // A kind sessiond does not type is kept whole, not dropped.
    let other = of_kind(msgs, pb::MessageKind::Other);
    assert_eq!(other.len(), 1);
    let Some(Part::Other(raw)) = &other[0].part else {
        panic!("no raw part: {:?}", other[0])
    };
    assert_eq!(raw.update_kind, "session_info_update");
    let v: serde_json::Value = serde_json::from_str(&raw.json).unwrap();
    assert_eq!(v["title"], "demo session", "{v}");

    // The reply is still one text message, after the activity.
    let replies: Vec<_> = msgs
        .iter()
        .filter(|m| {
            m.role == pb::MessageRole::Agent as i32 && m.kind == pb::MessageKind::Text as i32
        })
        .collect();
    assert_eq!(replies.len(), 1, "{msgs:#?}");
    assert!(
        replies[0].content.ends_with("activity: sent"),
        "{:?}",
        replies[0]
    );
}

/// The last state of each message in an event list.
fn last_states(events: &[pb::Event]) -> Vec<pb::Message> {
    let mut out: Vec<pb::Message> = Vec::new();
    for e in events {
        if let Some(
            pb::event::Payload::MessageAdded(pb::MessageAdded { message: Some(m) })
            | pb::event::Payload::MessageUpdated(pb::MessageUpdated { message: Some(m) }),
        ) = &e.payload
        {
            match out.iter_mut().find(|x| x.id == m.id) {
                Some(x) => *x = m.clone(),
                None => out.push(m.clone()),
            }
        }
    }
    out.sort_by_key(|m| m.seq);
    out
}

#[tokio::test]
async fn every_update_kind_is_stored_streamed_and_replayed_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let mut server = start(&data, &[]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "activity").await;
    let s = create_session(&mut c, &task.id, &work, "").await;

    let sent = send(&mut c, &task.id, &s.id, "/activity").await;
    let live = turn_events(&mut c, &s.id, sent.seq).await;
    // Streamed as typed parts: each kind arrives as message.added with its
    // part (tool call: then message.updated as it progresses).
    let streamed = last_states(&live);
    assert_activity_parts(&streamed);
    let added_tool = live.iter().find_map(|e| match &e.payload {
        Some(pb::event::Payload::MessageAdded(pb::MessageAdded { message: Some(m) }))
            if m.kind == pb::MessageKind::ToolCall as i32 =>
        {
            Some(m.clone())
        }
        _ => None,
    });
    let added_tool = added_tool.expect("a message.added for the tool call");
    match &added_tool.part {
        Some(Part::ToolCall(t)) => assert_eq!(t.status, "in_progress", "first state"),
        other => panic!("{other:?}"),
    }
    // Listed as stored: the same as the stream's last states.
    let stored = list(&mut c, &task.id, &s.id).await;
    assert_activity_parts(&stored);
    assert_eq!(
        stored,
        streamed
            .iter()
            .filter(|m| stored.iter().any(|x| x.id == m.id))
            .cloned()
            .collect::<Vec<_>>()
    );
    let last_seq = live.last().unwrap().seq;

    // kill -9, restart: the same parts, the same events by seq.
    server.kill();
    let server = start(&data, &[]);
    let mut c = sessions(&server).await;
    let after = list(&mut c, &task.id, &s.id).await;
    assert_eq!(after, stored, "stored parts survive the restart unchanged");
    let mut replay = c
        .watch_session(pb::WatchSessionRequest {
            session_id: s.id.clone(),
            after_seq: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let mut replayed = Vec::new();
    while replayed.len() < live.len() {
        let e = tokio::time::timeout(Duration::from_secs(30), replay.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        if e.seq > last_seq {
            break;
        }
        replayed.push(e);
    }
    assert_eq!(replayed, live, "the replay is the stream, event for event");

    // The next turn's activity streams after the restart too.
    let sent = send(&mut c, &task.id, &s.id, "/tool").await;
    let next = turn_events(&mut c, &s.id, sent.seq).await;
    let tool = last_states(&next)
        .into_iter()
        .find(|m| m.kind == pb::MessageKind::ToolCall as i32 && m.seq > sent.seq)
        .expect("the second turn's tool call");
    match &tool.part {
        Some(Part::ToolCall(t)) => {
            assert_eq!(
                (t.tool_call_id.as_str(), t.status.as_str()),
                ("demo-tool-1", "completed")
            );
        }
        other => panic!("{other:?}"),
    }
}

/// The agent's command list is the session's, not a turn's: a second
/// `available_commands_update` (agents send one on every `session/load`)
/// replaces the stored message (`message.updated`, same id and seq) instead
/// of adding another.
#[tokio::test]
async fn available_commands_replace_the_stored_list() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let server = start(&dir.path().join("data"), &[]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "commands").await;
    let s = create_session(&mut c, &task.id, &work, "").await;

    let sent = send(&mut c, &task.id, &s.id, "/activity").await;
    turn_events(&mut c, &s.id, sent.seq).await;
    let first = of_kind(
        &list(&mut c, &task.id, &s.id).await,
        pb::MessageKind::AvailableCommands,
    )
    .into_iter()
    .cloned()
    .collect::<Vec<_>>();
    assert_eq!(first.len(), 1, "{first:?}");

    let sent = send(&mut c, &task.id, &s.id, "/activity").await;
    let events = turn_events(&mut c, &s.id, sent.seq).await;
    // The second turn's events: from its user message on.
    let start = events
        .iter()
        .position(|e| {
            matches!(
                &e.payload,
                Some(pb::event::Payload::MessageAdded(pb::MessageAdded { message: Some(m) }))
                    if m.id == sent.id
            )
        })
        .expect("the second turn's user message");
    let events = &events[start..];
    let stored = list(&mut c, &task.id, &s.id).await;
    let now = of_kind(&stored, pb::MessageKind::AvailableCommands);
    assert_eq!(now.len(), 1, "one command list per session: {now:?}");
    assert_eq!(
        (now[0].id.as_str(), now[0].seq),
        (first[0].id.as_str(), first[0].seq)
    );
    assert!(
        events.iter().any(|e| matches!(
            &e.payload,
            Some(pb::event::Payload::MessageUpdated(pb::MessageUpdated { message: Some(m) }))
                if m.id == first[0].id
        )),
        "the second list is streamed as message.updated of the first"
    );
    assert!(
        !events.iter().any(|e| matches!(
            &e.payload,
            Some(pb::event::Payload::MessageAdded(pb::MessageAdded { message: Some(m) }))
                if m.kind == pb::MessageKind::AvailableCommands as i32
        )),
        "the second turn added a command list"
    );
    // The other parts of the second turn are new messages as before.
    assert_eq!(of_kind(&stored, pb::MessageKind::ToolCall).len(), 2);
}

/// The counter's value in a `/metrics` exposition.
fn unparsed_counter(text: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix("sessiond_agent_updates_unparsed_total "))
        .unwrap_or_else(|| panic!("no unparsed counter in:\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

/// An update the agent sends that agentctl cannot parse (the demo agent's
/// `/unparsed`) is stored as a part of kind UNPARSED with its method, tag,
/// error and raw JSON, counted once in the metric, and still there after a
/// kill -9 and restart of sessiond, whose replay counts nothing.
#[tokio::test]
async fn an_update_that_does_not_parse_is_stored_raw_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let mut server = start(&data, &[]);
    let metrics = server.metrics.clone().unwrap();
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "unparsed").await;
    let s = create_session(&mut c, &task.id, &work, "").await;

    let sent = send(&mut c, &task.id, &s.id, "/unparsed").await;
    turn_events(&mut c, &s.id, sent.seq).await;
    let stored = list(&mut c, &task.id, &s.id).await;
    let raw = of_kind(&stored, pb::MessageKind::Unparsed);
    assert_eq!(raw.len(), 1, "{stored:?}");
    assert!(raw[0].complete && raw[0].seq > sent.seq);
    match &raw[0].part {
        Some(Part::Unparsed(u)) => {
            assert_eq!(
                (u.method.as_str(), u.update_kind.as_str()),
                ("session/update", "tool_call")
            );
            assert!(u.error.contains("invalid type"), "{u:?}");
            assert!(!u.truncated);
            let sent: serde_json::Value = serde_json::from_str(&u.json).unwrap();
            assert_eq!(sent["update"]["toolCallId"], 7);
        }
        other => panic!("{other:?}"),
    }
    let reply = stored.last().unwrap();
    assert!(reply.content.ends_with("unparsed: sent"), "{reply:?}");
    assert_eq!(unparsed_counter(&http_get(&metrics, "/metrics").await.1), 1);

    server.kill();
    let server = start(&data, &[]);
    let metrics = server.metrics.clone().unwrap();
    let mut c = sessions(&server).await;
    // A turn after the restart: the pump has read everything before it.
    let sent = send(&mut c, &task.id, &s.id, "hello").await;
    turn_events(&mut c, &s.id, sent.seq).await;
    let after = list(&mut c, &task.id, &s.id).await;
    assert_eq!(of_kind(&after, pb::MessageKind::Unparsed).len(), 1);
    assert_eq!(unparsed_counter(&http_get(&metrics, "/metrics").await.1), 0);
}
