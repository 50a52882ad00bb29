//! Permission policy `ask` end to end (issue 12): the real sessiond binary,
//! real agentctl processes and the demo agent's `/edit PATH TEXT`, which
//! asks permission before it writes PATH and writes only when allowed.
//! Asked → answered (allow: the file is written; reject: it is not), the
//! timeout's default outcome, a restart of sessiond (SIGTERM and kill -9)
//! while agentctl waits, agentctl killed while a request waits, and every
//! bad RespondToPermission input. Kills are aimed at a stored
//! `permission.requested` event, never after a sleep.

use std::{path::Path, process::Command};

use sessiond_proto::sessiond::v1 as pb;
use tonic::Code;

use crate::support::*;

/// A config with one demo-agent profile `asker` of policy `ask`.
fn config(dir: &Path, timeout: Option<&str>) -> String {
    let path = dir.join("sessiond.toml");
    let timeout = timeout
        .map(|t| format!("permission_timeout = \"{t}\"\n"))
        .unwrap_or_default();
    std::fs::write(
        &path,
        format!(
            "[[agents]]\nname = \"asker\"\ncommand = \"{}\"\npermission_policy = \"ask\"\n{timeout}\
             env = {{ ACP_DEMO_STATE_DIR = \"{}\" }}\n",
            bin("acp-demo-agent").display(),
            dir.join("demo-state").display()
        ),
    )
    .unwrap();
    path.display().to_string()
}

/// The `permission.requested` of turn `turn` (the user message id).
async fn requested(c: &mut Sessions, session: &str, turn: &str) -> pb::PermissionRequest {
    wait_for(c, session, |e| match &e.payload {
        Some(pb::event::Payload::PermissionRequested(pb::PermissionRequested {
            request: Some(r),
        })) if r.turn_id == turn => {
            assert_eq!(e.kind, "session.permission.requested");
            Some(r.clone())
        }
        _ => None,
    })
    .await
}

async fn resolved(c: &mut Sessions, session: &str, request: &str) -> pb::PermissionResolved {
    wait_for(c, session, |e| match &e.payload {
        Some(pb::event::Payload::PermissionResolved(r)) if r.request_id == request => {
            assert_eq!(e.kind, "session.permission.resolved");
            Some(r.clone())
        }
        _ => None,
    })
    .await
}

async fn respond(
    c: &mut Sessions,
    task: &str,
    session: &str,
    request: &str,
    option: &str,
) -> Result<pb::RespondToPermissionResponse, tonic::Status> {
    c.respond_to_permission(pb::RespondToPermissionRequest {
        task_id: task.into(),
        session_id: session.into(),
        request_id: request.into(),
        option_id: option.into(),
        content_json: String::new(),
    })
    .await
    .map(tonic::Response::into_inner)
}

async fn pending(c: &mut Sessions, task: &str, session: &str) -> Vec<pb::PermissionRequest> {
    c.get_session_status(pb::GetSessionStatusRequest {
        task_id: task.into(),
        session_id: session.into(),
    })
    .await
    .unwrap()
    .into_inner()
    .pending_permissions
}

/// The agent's text replies after user message `after`.
fn replies(msgs: &[pb::Message], after: &pb::Message) -> Vec<String> {
    msgs.iter()
        .filter(|m| {
            m.role == pb::MessageRole::Agent as i32
                && m.kind == pb::MessageKind::Text as i32
                && m.seq > after.seq
        })
        .map(|m| m.content.clone())
        .collect()
}

fn count_kind(events: &[pb::Event], kind: &str, request: &str) -> usize {
    events
        .iter()
        .filter(|e| {
            e.kind == kind
                && match &e.payload {
                    Some(pb::event::Payload::PermissionRequested(p)) => {
                        p.request.as_ref().is_some_and(|r| r.request_id == request)
                    }
                    Some(pb::event::Payload::PermissionResolved(r)) => r.request_id == request,
                    _ => false,
                }
        })
        .count()
}

async fn gauge(server: &Server) -> f64 {
    let text = crate::metrics::http_get(server.metrics.as_ref().unwrap(), "/metrics")
        .await
        .1;
    text.lines()
        .find_map(|l| l.strip_prefix("sessiond_permission_requests_pending "))
        .map(|v| v.trim().parse().unwrap())
        .expect("the gauge is exported")
}

#[tokio::test]
async fn ask_answered_allow_runs_the_tool_and_reject_does_not() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let config = config(dir.path(), None);
    let server = start(&dir.path().join("data"), &["--config", &config]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "ask").await;
    let s = create_session(&mut c, &task.id, &work, "asker").await;
    assert_eq!(s.state, pb::SessionState::WaitingForInput as i32, "{s:?}");
    assert_eq!(gauge(&server).await, 0.0);

    // Asked: the event carries the tool call and the agent's options.
    let sent = send(&mut c, &task.id, &s.id, "/edit notes.txt hello").await;
    let req = requested(&mut c, &s.id, &sent.id).await;
    assert_eq!(req.status, "pending");
    let tool = req.tool_call.clone().unwrap();
    assert_eq!(tool.title, "write notes.txt");
    let options: Vec<_> = req
        .options
        .iter()
        .map(|o| (o.option_id.as_str(), o.kind.as_str()))
        .collect();
    assert_eq!(
        options,
        [("allow", "allow_once"), ("reject", "reject_once")]
    );
    let (asked, expires) = (req.requested_at.unwrap(), req.expires_at.unwrap());
    assert_eq!(expires.seconds - asked.seconds, 300, "the 5-minute default");
    // Nothing ran yet; the session shows the request; the gauge counts it.
    assert!(!work.join("notes.txt").exists());
    let listed = pending(&mut c, &task.id, &s.id).await;
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].request_id, req.request_id);
    assert_eq!(gauge(&server).await, 1.0);

    // Bad inputs, each with its code; the request still waits.
    let other = "0190f3b4-0000-7000-8000-000000000000".to_owned();
    let err = respond(&mut c, &task.id, &s.id, &other, "allow")
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    assert!(err.message().contains(&other), "{err:?}");
    let err = respond(&mut c, &task.id, &s.id, "not-an-id", "allow")
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    let err = respond(&mut c, &task.id, &s.id, &req.request_id, "maybe")
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(
        err.message()
            .contains("allow (allow_once), reject (reject_once)"),
        "{err:?}"
    );
    // A request of this session named under another task is not found.
    let other_task = create_task(&mut c, "other").await;
    let err = respond(&mut c, &other_task.id, &s.id, &req.request_id, "allow")
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    assert_eq!(pending(&mut c, &task.id, &s.id).await.len(), 1);

    // Allowed: the tool runs, the turn ends normally.
    let answered = respond(&mut c, &task.id, &s.id, &req.request_id, "allow")
        .await
        .unwrap();
    assert_eq!(answered.request.unwrap().request_id, req.request_id);
    let r = resolved(&mut c, &s.id, &req.request_id).await;
    assert_eq!(
        (r.outcome.as_str(), r.option_id.as_str()),
        ("selected", "allow")
    );
    let end = turn_end(&mut c, &s.id, &sent.id).await;
    assert_eq!(end.stop_reason, "end_turn", "{end:?}");
    assert_eq!(
        std::fs::read_to_string(work.join("notes.txt")).unwrap(),
        "hello"
    );
    let msgs = messages(&mut c, &task.id, &s.id).await;
    let reply = replies(&msgs, &sent);
    assert_eq!(reply.len(), 1, "{reply:?}");
    assert!(reply[0].contains("edit: written"), "{reply:?}");
    let part = msgs
        .iter()
        .find(|m| m.id == req.request_id)
        .expect("the request is a message of the conversation");
    assert_eq!(part.kind, pb::MessageKind::Permission as i32);
    assert!(part.complete);
    match &part.part {
        Some(pb::message::Part::Permission(p)) => {
            assert_eq!(
                (p.status.as_str(), p.option_id.as_str()),
                ("selected", "allow")
            );
        }
        other => panic!("{other:?}"),
    }
    // Answered already: FAILED_PRECONDITION; nothing pending any more.
    let err = respond(&mut c, &task.id, &s.id, &req.request_id, "reject")
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("answered already"), "{err:?}");
    assert!(pending(&mut c, &task.id, &s.id).await.is_empty());
    assert_eq!(gauge(&server).await, 0.0);

    // Rejected: the tool does not run and the reply says so.
    let sent = send(&mut c, &task.id, &s.id, "/edit other.txt nope").await;
    let req = requested(&mut c, &s.id, &sent.id).await;
    respond(&mut c, &task.id, &s.id, &req.request_id, "reject")
        .await
        .unwrap();
    let end = turn_end(&mut c, &s.id, &sent.id).await;
    assert_eq!(end.stop_reason, "end_turn", "{end:?}");
    assert!(!work.join("other.txt").exists(), "rejected: not written");
    let reply = replies(&messages(&mut c, &task.id, &s.id).await, &sent);
    assert!(reply[0].contains("not allowed (reject)"), "{reply:?}");
    let r = resolved(&mut c, &s.id, &req.request_id).await;
    assert_eq!(
        (r.outcome.as_str(), r.option_id.as_str()),
        ("selected", "reject")
    );
}

#[tokio::test]
async fn unanswered_request_times_out_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let config = config(dir.path(), Some("1s"));
    let server = start(&dir.path().join("data"), &["--config", &config]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "timeout").await;
    let s = create_session(&mut c, &task.id, &work, "asker").await;
    let sent = send(&mut c, &task.id, &s.id, "/edit late.txt x").await;
    let req = requested(&mut c, &s.id, &sent.id).await;
    let (asked, expires) = (req.requested_at.unwrap(), req.expires_at.unwrap());
    let ms = (expires.seconds - asked.seconds) * 1000
        + i64::from(expires.nanos - asked.nanos) / 1_000_000;
    assert_eq!(ms, 1000, "the profile's timeout");
    // The default outcome: the agent's reject option, with an event.
    let r = resolved(&mut c, &s.id, &req.request_id).await;
    assert_eq!(r.outcome, "timed_out", "{r:?}");
    assert_eq!(r.option_id, "reject", "{r:?}");
    assert!(r.reason.contains("no answer within"), "{r:?}");
    let end = turn_end(&mut c, &s.id, &sent.id).await;
    assert_eq!(end.stop_reason, "end_turn", "{end:?}");
    assert!(!work.join("late.txt").exists());
    let reply = replies(&messages(&mut c, &task.id, &s.id).await, &sent);
    assert!(reply[0].contains("not allowed (reject)"), "{reply:?}");
    let err = respond(&mut c, &task.id, &s.id, &req.request_id, "allow")
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("timed out"), "{err:?}");
    assert!(pending(&mut c, &task.id, &s.id).await.is_empty());
}

/// A backend restart while agentctl waits: the request is listed again,
/// WatchSession replays its event, and answering it after the restart
/// completes the turn exactly once. SIGTERM, then kill -9.
#[tokio::test]
async fn pending_request_survives_a_backend_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let config = config(dir.path(), None);
    let mut server = start(&data, &["--config", &config]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "restart").await;
    let s = create_session(&mut c, &task.id, &work, "asker").await;
    let agentctls = agentctl_pids(&data);
    assert_eq!(agentctls.len(), 1);

    for (round, kill9) in [(1, false), (2, true)] {
        let file = format!("f{round}.txt");
        let sent = send(&mut c, &task.id, &s.id, &format!("/edit {file} r{round}")).await;
        let req = requested(&mut c, &s.id, &sent.id).await;
        if kill9 {
            server.kill();
        } else {
            assert!(server.terminate().success());
        }
        // The old value's drop would end the agentctls under `data`.
        std::mem::forget(std::mem::replace(
            &mut server,
            start(&data, &["--config", &config]),
        ));
        crate::restart::wait_serving(&server).await;
        c = sessions(&server).await;
        assert_eq!(agentctl_pids(&data), agentctls, "agentctl still waits");

        let listed = pending(&mut c, &task.id, &s.id).await;
        assert_eq!(listed.len(), 1, "round {round}: {listed:?}");
        assert_eq!(listed[0].request_id, req.request_id);
        assert_eq!(listed[0].status, "pending");
        let events = replayed_events(&mut c, &s.id).await;
        assert_eq!(
            count_kind(&events, "session.permission.requested", &req.request_id),
            1,
            "replayed once"
        );
        assert!(!work.join(&file).exists());

        respond(&mut c, &task.id, &s.id, &req.request_id, "allow")
            .await
            .unwrap();
        let end = turn_end(&mut c, &s.id, &sent.id).await;
        assert_eq!(end.stop_reason, "end_turn", "round {round}: {end:?}");
        assert_eq!(
            std::fs::read_to_string(work.join(&file)).unwrap(),
            format!("r{round}")
        );
        // Exactly once: one reply, one end, one resolution.
        let msgs = messages(&mut c, &task.id, &s.id).await;
        let reply = replies(&msgs, &sent);
        assert_eq!(reply.len(), 1, "round {round}: {reply:?}");
        assert!(reply[0].contains("edit: written"), "{reply:?}");
        let events = replayed_events(&mut c, &s.id).await;
        assert_eq!(
            count_kind(&events, "session.permission.resolved", &req.request_id),
            1
        );
        let ends = events
            .iter()
            .filter(|e| {
                matches!(&e.payload, Some(pb::event::Payload::TurnEnded(t)) if t.turn_id == sent.id)
            })
            .count();
        assert_eq!(ends, 1, "round {round}");
        assert!(pending(&mut c, &task.id, &s.id).await.is_empty());
    }
}

/// agentctl dies while a request waits: the request is cancelled (event),
/// the turn ends interrupted, and answering it is refused.
#[tokio::test]
async fn agentctl_killed_while_a_request_waits_cancels_it() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let config = config(dir.path(), None);
    let server = start(&data, &["--config", &config]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "agentctl dies").await;
    let s = create_session(&mut c, &task.id, &work, "asker").await;
    let sent = send(&mut c, &task.id, &s.id, "/edit gone.txt x").await;
    let req = requested(&mut c, &s.id, &sent.id).await;
    for pid in agentctl_pids(&data) {
        Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .unwrap();
    }
    let r = resolved(&mut c, &s.id, &req.request_id).await;
    assert_eq!(r.outcome, "cancelled", "{r:?}");
    assert!(!r.reason.is_empty(), "{r:?}");
    let end = turn_end(&mut c, &s.id, &sent.id).await;
    assert_eq!(end.stop_reason, "interrupted", "{end:?}");
    assert!(!work.join("gone.txt").exists());
    let err = respond(&mut c, &task.id, &s.id, &req.request_id, "allow")
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("cancelled"), "{err:?}");
    let msgs = messages(&mut c, &task.id, &s.id).await;
    let part = msgs.iter().find(|m| m.id == req.request_id).unwrap();
    assert!(part.complete, "{part:?}");
    match &part.part {
        Some(pb::message::Part::Permission(p)) => assert_eq!(p.status, "cancelled"),
        other => panic!("{other:?}"),
    }
    // The tool call that waited on the answer ends with its turn: failed,
    // not pending for ever.
    let calls: Vec<_> = msgs
        .iter()
        .filter_map(|m| match &m.part {
            Some(pb::message::Part::ToolCall(t)) if m.seq > sent.seq => Some((m.complete, t)),
            _ => None,
        })
        .collect();
    assert!(
        !calls.is_empty(),
        "the agent reported its tool call: {msgs:?}"
    );
    for (complete, t) in calls {
        assert!(complete, "{t:?}");
        assert_eq!(t.status, "failed", "{t:?}");
    }
}

/// Pids of the demo agents whose environment names `dir` (their state dir).
pub(crate) fn demo_agents_under(dir: &Path) -> Vec<u32> {
    let needle = dir.display().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let pid = e.file_name().to_string_lossy().parse::<u32>().ok()?;
            let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
            let env = std::fs::read(e.path().join("environ")).ok()?;
            (String::from_utf8_lossy(&cmd).contains("acp-demo-agent")
                && String::from_utf8_lossy(&env).contains(&needle))
            .then_some(pid)
        })
        .collect()
}

/// The agent (not agentctl) dies while a request waits: cancelled, with
/// its event, and the turn ends interrupted.
#[tokio::test]
async fn agent_exit_while_a_request_waits_cancels_it() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let config = config(dir.path(), None);
    let server = start(&dir.path().join("data"), &["--config", &config]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "agent dies").await;
    let s = create_session(&mut c, &task.id, &work, "asker").await;
    let sent = send(&mut c, &task.id, &s.id, "/edit dead.txt x").await;
    let req = requested(&mut c, &s.id, &sent.id).await;
    let agents = demo_agents_under(&dir.path().join("demo-state"));
    assert_eq!(agents.len(), 1, "{agents:?}");
    Command::new("kill")
        .args(["-KILL", &agents[0].to_string()])
        .status()
        .unwrap();
    let r = resolved(&mut c, &s.id, &req.request_id).await;
    assert_eq!(r.outcome, "cancelled", "{r:?}");
    let end = turn_end(&mut c, &s.id, &sent.id).await;
    assert_eq!(end.stop_reason, "interrupted", "{end:?}");
    assert!(!work.join("dead.txt").exists());
    assert!(pending(&mut c, &task.id, &s.id).await.is_empty());
    let events = replayed_events(&mut c, &s.id).await;
    assert_eq!(
        count_kind(&events, "session.permission.resolved", &req.request_id),
        1,
        "resolved once (sessiond's cancel and agentctl's are one)"
    );
}

/// Answers by kind: `allow`, `allow-always`, `reject` name the option of
/// that kind the agent offered, whatever its id (the demo agent's
/// `/edit-codex` offers Codex's `approved`, `approved-for-session`,
/// `abort`); its ids still work; a kind it does not offer is
/// INVALID_ARGUMENT listing what it offers.
#[tokio::test]
async fn answers_by_kind_map_onto_the_offered_option() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let config = config(dir.path(), None);
    let server = start(&dir.path().join("data"), &["--config", &config]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "kinds").await;
    let s = create_session(&mut c, &task.id, &work, "asker").await;

    for (answer, chosen, written) in [
        ("allow", "approved", true),
        ("allow-always", "approved-for-session", true),
        ("reject", "abort", false),
        ("approved", "approved", true),
    ] {
        let file = format!("{answer}.txt");
        let sent = send(&mut c, &task.id, &s.id, &format!("/edit-codex {file} x")).await;
        let req = requested(&mut c, &s.id, &sent.id).await;
        if answer == "allow" {
            let err = respond(&mut c, &task.id, &s.id, &req.request_id, "reject-always")
                .await
                .unwrap_err();
            assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
            assert!(
                err.message().contains(
                    "approved (allow_once), approved-for-session (allow_always), abort (reject_once)"
                ),
                "{err:?}"
            );
        }
        respond(&mut c, &task.id, &s.id, &req.request_id, answer)
            .await
            .unwrap();
        let r = resolved(&mut c, &s.id, &req.request_id).await;
        assert_eq!(
            (r.outcome.as_str(), r.option_id.as_str()),
            ("selected", chosen),
            "{answer}"
        );
        turn_end(&mut c, &s.id, &sent.id).await;
        assert_eq!(work.join(&file).exists(), written, "{answer}");
    }
}

async fn answer_form(
    c: &mut Sessions,
    task: &str,
    session: &str,
    request: &str,
    option: &str,
    values: &str,
) -> Result<pb::RespondToPermissionResponse, tonic::Status> {
    c.respond_to_permission(pb::RespondToPermissionRequest {
        task_id: task.into(),
        session_id: session.into(),
        request_id: request.into(),
        option_id: option.into(),
        content_json: values.into(),
    })
    .await
    .map(tonic::Response::into_inner)
}

/// The agent asks the user a question (ACP `elicitation/create`, the demo
/// agent's `/ask FIELD...`): it is a pending request with its form, answered
/// with the form's values (checked: required fields, value types), or
/// declined; the agent gets exactly the answer.
#[tokio::test]
async fn an_elicitation_is_asked_answered_with_its_form_or_declined() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let config = config(dir.path(), None);
    let server = start(&data, &["--config", &config]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "questions").await;
    let s = create_session(&mut c, &task.id, &work, "asker").await;

    let sent = send(&mut c, &task.id, &s.id, "/ask name city").await;
    let req = requested(&mut c, &s.id, &sent.id).await;
    let q = req.elicitation.clone().expect("an elicitation");
    assert_eq!(q.mode, "form");
    assert_eq!(q.message, "The demo agent asks");
    let schema: serde_json::Value = serde_json::from_str(&q.requested_schema_json).unwrap();
    assert_eq!(schema["required"], serde_json::json!(["name", "city"]));
    let options: Vec<&str> = req.options.iter().map(|o| o.option_id.as_str()).collect();
    assert_eq!(options, ["accept", "decline", "cancel"]);
    let listed = pending(&mut c, &task.id, &s.id).await;
    assert_eq!(listed.len(), 1);
    assert!(listed[0].elicitation.is_some());

    // Values that do not fill the form are refused; the question still waits.
    for (values, says) in [
        (r#"{"name":"Ada"}"#, "\"city\""),
        (r#"{"name":"Ada","city":{"x":1}}"#, "\"city\""),
        ("not json", "content_json"),
        ("[]", "object"),
        // The schema's types, and only its fields.
        (r#"{"name":true,"city":"x"}"#, "wants a string"),
        (r#"{"name":"Ada","city":"x","age":3}"#, "no field \"age\""),
    ] {
        let err = answer_form(&mut c, &task.id, &s.id, &req.request_id, "accept", values)
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{values}: {err:?}");
        assert!(err.message().contains(says), "{values}: {}", err.message());
        assert_eq!(
            err.message().matches("invalid argument").count(),
            1,
            "{values}: {}",
            err.message()
        );
    }
    assert_eq!(pending(&mut c, &task.id, &s.id).await.len(), 1);

    answer_form(
        &mut c,
        &task.id,
        &s.id,
        &req.request_id,
        "accept",
        r#"{"name":"Ada","city":"Paris"}"#,
    )
    .await
    .unwrap();
    let end = turn_end(&mut c, &s.id, &sent.id).await;
    assert_eq!(end.stop_reason, "end_turn", "{end:?}");
    let msgs = messages(&mut c, &task.id, &s.id).await;
    let reply = replies(&msgs, &sent).join("");
    assert!(
        reply.contains(r#"answer: accept {"city":"Paris","name":"Ada"}"#),
        "{reply}"
    );
    let r = resolved(&mut c, &s.id, &req.request_id).await;
    assert_eq!(
        (r.outcome.as_str(), r.option_id.as_str()),
        ("selected", "accept")
    );

    let sent = send(&mut c, &task.id, &s.id, "/ask").await;
    let req = requested(&mut c, &s.id, &sent.id).await;
    answer_form(&mut c, &task.id, &s.id, &req.request_id, "decline", "")
        .await
        .unwrap();
    turn_end(&mut c, &s.id, &sent.id).await;
    let msgs = messages(&mut c, &task.id, &s.id).await;
    assert!(
        replies(&msgs, &sent).join("").contains("answer: decline"),
        "{msgs:?}"
    );
}

/// A question pending across `kill -9` of sessiond is listed again and
/// answered once; one pending when agentctl dies is cancelled.
#[tokio::test]
async fn a_pending_elicitation_survives_kill_9_of_sessiond_and_dies_with_agentctl() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let config = config(dir.path(), None);
    let mut server = start(&data, &["--config", &config]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "question across a crash").await;
    let s = create_session(&mut c, &task.id, &work, "asker").await;

    let sent = send(&mut c, &task.id, &s.id, "/ask name").await;
    let req = requested(&mut c, &s.id, &sent.id).await;
    server.kill();
    // The old value's drop would end the agentctls under `data`.
    std::mem::forget(std::mem::replace(
        &mut server,
        start(&data, &["--config", &config]),
    ));
    crate::restart::wait_serving(&server).await;
    let mut c = sessions(&server).await;
    let listed = pending(&mut c, &task.id, &s.id).await;
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].request_id, req.request_id);
    assert!(listed[0].elicitation.is_some());
    answer_form(
        &mut c,
        &task.id,
        &s.id,
        &req.request_id,
        "accept",
        r#"{"name":"Bo"}"#,
    )
    .await
    .unwrap();
    turn_end(&mut c, &s.id, &sent.id).await;
    let err = answer_form(
        &mut c,
        &task.id,
        &s.id,
        &req.request_id,
        "accept",
        r#"{"name":"X"}"#,
    )
    .await
    .unwrap_err();
    assert_eq!(
        err.code(),
        Code::FailedPrecondition,
        "answered once: {err:?}"
    );
    let msgs = messages(&mut c, &task.id, &s.id).await;
    let reply = replies(&msgs, &sent);
    assert_eq!(reply.len(), 1, "{reply:?}");
    assert!(
        reply[0].contains(r#"answer: accept {"name":"Bo"}"#),
        "{reply:?}"
    );

    // agentctl dies while a question waits: cancelled, the turn interrupted.
    let sent = send(&mut c, &task.id, &s.id, "/ask name").await;
    let req = requested(&mut c, &s.id, &sent.id).await;
    for pid in agentctl_pids(&data) {
        Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .unwrap();
    }
    let r = resolved(&mut c, &s.id, &req.request_id).await;
    assert_eq!(r.outcome, "cancelled", "{r:?}");
    let end = turn_end(&mut c, &s.id, &sent.id).await;
    assert_eq!(end.stop_reason, "interrupted", "{end:?}");
}
