//! Real agents as first-class (issue 12): ACP `authenticate` per profile,
//! resuming what exists after kill -9 (a never-prompted conversation the
//! agent did not keep is replaced; one with turns stays ERROR with the
//! truth), cancelling a turn, and failed turns ending at once.

use std::{path::Path, process::Command, time::Duration};

use sessiond_proto::sessiond::v1 as pb;
use tonic::Code;

use crate::support::*;

/// A config file with demo-agent profiles: (name, args, extra TOML lines,
/// extra env entries), their transcripts under `dir/demo-state`.
fn config(dir: &Path, profiles: &[(&str, &[&str], &str, &str)]) -> String {
    let path = dir.join("sessiond.toml");
    let mut text = String::new();
    for (name, args, extra, env) in profiles {
        let args = args
            .iter()
            .map(|a| format!("{a:?}"))
            .collect::<Vec<_>>()
            .join(", ");
        text.push_str(&format!(
            "[[agents]]\nname = \"{name}\"\ncommand = \"{}\"\nargs = [{args}]\n{extra}\n\
             env = {{ ACP_DEMO_STATE_DIR = \"{}\"{env} }}\n",
            bin("acp-demo-agent").display(),
            dir.join("demo-state").display()
        ));
    }
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

fn kill_agentctls(data: &Path) {
    for pid in agentctl_pids(data) {
        Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .unwrap();
    }
}

#[tokio::test]
async fn authenticate_required_configured_and_missing() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let config = config(
        dir.path(),
        &[
            ("codexlike", &["--require-auth"], "", ""),
            (
                "codexauth",
                &["--require-auth"],
                "auth_method = \"demo-token\"",
                ", ACP_DEMO_TOKEN = \"t0ken\"",
            ),
            (
                "codexbad",
                &["--require-auth"],
                "auth_method = \"demo-token\"",
                "",
            ),
        ],
    );
    let server = start(&dir.path().join("data"), &["--config", &config]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "auth").await;

    // Required, none configured: the error names what the agent offers and
    // the profile key to set; the session is ERROR, not hanging.
    let s = create_session(&mut c, &task.id, &work, "codexlike").await;
    assert_eq!(s.state, pb::SessionState::Error as i32, "{s:?}");
    for needle in [
        "demo-token",
        "demo-login",
        "auth_method",
        "requires authentication",
    ] {
        assert!(
            s.error_message.contains(needle),
            "{needle}: {}",
            s.error_message
        );
    }
    assert!(
        !s.error_message.contains("check the profile's command"),
        "{}",
        s.error_message
    );

    // Configured, and the environment the method needs is there.
    let s = create_session(&mut c, &task.id, &work, "codexauth").await;
    assert_eq!(s.state, pb::SessionState::WaitingForInput as i32, "{s:?}");
    let reply = prompt(&mut c, &task.id, &s.id, "hello").await;
    assert!(reply.contains("turn 1"), "{reply}");

    // Configured, but the method fails (its environment is missing): the
    // agent's answer is in the error.
    let s = create_session(&mut c, &task.id, &work, "codexbad").await;
    assert_eq!(s.state, pb::SessionState::Error as i32, "{s:?}");
    assert!(
        s.error_message.contains("ACP_DEMO_TOKEN"),
        "{}",
        s.error_message
    );
}

#[tokio::test]
async fn never_prompted_session_gets_a_new_conversation_after_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    // Stores nothing before the first prompt, as claude-code-acp does.
    let config = config(dir.path(), &[("lazy", &["--lazy-persist"], "", "")]);
    let mut server = start(&data, &["--config", &config]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "lazy").await;
    let fresh = create_session(&mut c, &task.id, &work, "lazy").await;
    let used = create_session(&mut c, &task.id, &work, "lazy").await;
    let lost = create_session(&mut c, &task.id, &work, "lazy").await;
    for s in [&fresh, &used, &lost] {
        assert_eq!(s.state, pb::SessionState::WaitingForInput as i32, "{s:?}");
    }
    assert!(
        prompt(&mut c, &task.id, &used.id, "one")
            .await
            .contains("turn 1")
    );
    assert!(
        prompt(&mut c, &task.id, &lost.id, "one")
            .await
            .contains("turn 1")
    );
    server.kill();
    kill_agentctls(&data);
    // The agent of `lost` loses its transcript while everything is down.
    let transcript = dir
        .path()
        .join("demo-state")
        .join(format!("{}.json", lost.resume_token));
    std::fs::remove_file(&transcript).unwrap();

    let server = start(&data, &["--config", &config]);
    crate::restart::wait_serving(&server).await;
    let mut c = sessions(&server).await;

    // Never prompted: a new conversation, a new token, an event saying so.
    let now = get(&mut c, &task.id, &fresh.id).await;
    assert_eq!(
        now.state,
        pb::SessionState::WaitingForInput as i32,
        "{now:?}"
    );
    assert_ne!(now.resume_token, fresh.resume_token);
    assert!(!now.resume_token.is_empty());
    let replaced: Vec<_> = replayed_events(&mut c, &fresh.id)
        .await
        .into_iter()
        .filter_map(|e| match e.payload {
            Some(pb::event::Payload::ConversationReplaced(r)) => Some((e.kind, r)),
            _ => None,
        })
        .collect();
    assert_eq!(replaced.len(), 1, "{replaced:?}");
    assert_eq!(replaced[0].0, "session.conversation_replaced");
    assert_eq!(replaced[0].1.previous_resume_token, fresh.resume_token);
    assert_eq!(replaced[0].1.resume_token, now.resume_token);
    assert!(
        replaced[0].1.reason.contains("not found"),
        "{:?}",
        replaced[0]
    );
    let reply = prompt(&mut c, &task.id, &fresh.id, "first").await;
    assert!(reply.contains("turn 1"), "{reply}");

    // Prompted and kept by the agent: loaded as before.
    let now = get(&mut c, &task.id, &used.id).await;
    assert_eq!(
        now.state,
        pb::SessionState::WaitingForInput as i32,
        "{now:?}"
    );
    assert_eq!(now.resume_token, used.resume_token);
    assert!(
        prompt(&mut c, &task.id, &used.id, "two")
            .await
            .contains("turn 2")
    );

    // Prompted, and the agent lost it: ERROR resume_failed, saying that
    // another resume fails the same way, and what is left.
    let now = get(&mut c, &task.id, &lost.id).await;
    assert_eq!(now.state, pb::SessionState::Error as i32, "{now:?}");
    assert!(
        now.error_message.starts_with("resume_failed: "),
        "{}",
        now.error_message
    );
    for needle in [
        "no longer has it",
        "fails the same way",
        "create a new session",
    ] {
        assert!(
            now.error_message.contains(needle),
            "{needle}: {}",
            now.error_message
        );
    }
    assert!(
        !now.error_message
            .contains("resume the session to try again"),
        "{}",
        now.error_message
    );
    assert_eq!(now.resume_token, lost.resume_token, "nothing replaced");
    // An explicit resume answers the same truth; SendMessage's hint
    // carries it too instead of a bare "resume first".
    let err = c
        .resume_session(pb::ResumeSessionRequest {
            task_id: task.id.clone(),
            session_id: lost.id.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(
        err.message().contains("no longer has it"),
        "{}",
        err.message()
    );
    let err = c
        .send_message(pb::SendMessageRequest {
            task_id: task.id.clone(),
            session_id: lost.id.clone(),
            content: "again".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(
        err.message().contains("no longer has it"),
        "{}",
        err.message()
    );
    // Its messages stay readable.
    let msgs = c
        .list_messages(pb::ListMessagesRequest {
            task_id: task.id.clone(),
            session_id: lost.id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .messages;
    assert_eq!(msgs.len(), 2, "{msgs:?}");
}

#[tokio::test]
async fn cancel_turn_keeps_the_reply_so_far() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let server = start(&dir.path().join("data"), &[]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "cancel").await;
    let s = create_session(&mut c, &task.id, &work, "").await;

    // Nothing to cancel while waiting for input.
    let err = c
        .cancel_turn(pb::CancelTurnRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("no turn is in progress"), "{err:?}");

    // `/long` streams for a minute; cancel it once part of the reply is in.
    let sent = c
        .send_message(pb::SendMessageRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
            content: "/long".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .message
        .unwrap();
    let mut stream = c
        .watch_session(pb::WatchSessionRequest {
            session_id: s.id.clone(),
            after_seq: 0,
        })
        .await
        .unwrap()
        .into_inner();
    loop {
        let e = tokio::time::timeout(Duration::from_secs(30), stream.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        if let Some(pb::event::Payload::MessageUpdated(pb::MessageUpdated { message: Some(m) })) =
            e.payload
            && m.role == pb::MessageRole::Agent as i32
            && m.content.contains("[3]")
        {
            break;
        }
    }
    let r = c
        .cancel_turn(pb::CancelTurnRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(r.cancelled);
    let end = turn_end(&mut c, &s.id, &sent.id).await;
    assert_eq!(end.stop_reason, "cancelled", "{end:?}");

    let msgs = c
        .list_messages(pb::ListMessagesRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .messages;
    assert_eq!(msgs.len(), 3, "{msgs:?}");
    let reply = &msgs[1];
    assert_eq!(reply.role, pb::MessageRole::Agent as i32);
    assert!(reply.complete, "{reply:?}");
    assert!(reply.content.starts_with("turn 1 "), "{reply:?}");
    assert!(reply.content.contains("[3]"), "the reply so far: {reply:?}");
    assert!(!reply.content.contains("[600]"), "cut short: {reply:?}");
    assert_eq!(msgs[2].role, pb::MessageRole::System as i32);
    assert!(msgs[2].content.contains("cancelled"), "{:?}", msgs[2]);
    let now = get(&mut c, &task.id, &s.id).await;
    assert_eq!(now.state, pb::SessionState::WaitingForInput as i32);

    // The conversation goes on.
    let reply = prompt(&mut c, &task.id, &s.id, "after").await;
    assert!(reply.contains("you said \"after\""), "{reply}");
}

#[tokio::test]
async fn failed_turn_ends_with_its_reason_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let server = start(&dir.path().join("data"), &[]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "fail").await;
    let s = create_session(&mut c, &task.id, &work, "").await;
    let sent = send(&mut c, &task.id, &s.id, "/fail").await;
    let end = turn_end(&mut c, &s.id, &sent.id).await;
    assert_eq!(end.stop_reason, "error", "{end:?}");
    assert!(end.error_message.contains("fails on purpose"), "{end:?}");
    let now = get(&mut c, &task.id, &s.id).await;
    assert_eq!(now.state, pb::SessionState::WaitingForInput as i32);
    let reply = prompt(&mut c, &task.id, &s.id, "next").await;
    assert!(reply.contains("you said \"next\""), "{reply}");
}

#[tokio::test]
async fn session_modes_are_listed_and_set() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let server = start(&dir.path().join("data"), &[]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "modes").await;
    let s = create_session(&mut c, &task.id, &work, "").await;
    let status = |c: &mut Sessions| {
        let mut c = c.clone();
        let (task, session) = (task.id.clone(), s.id.clone());
        async move {
            c.get_session_status(pb::GetSessionStatusRequest {
                task_id: task,
                session_id: session,
            })
            .await
            .unwrap()
            .into_inner()
        }
    };
    let modes = status(&mut c)
        .await
        .modes
        .expect("the demo agent has modes");
    assert_eq!(modes.current_mode_id, "default");
    let ids: Vec<_> = modes.available.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(ids, ["default", "plan"]);
    assert_eq!(modes.available[1].name, "Plan");

    let err = c
        .set_session_mode(pb::SetSessionModeRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
            mode_id: "fast".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("default, plan"), "{err:?}");

    let set = c
        .set_session_mode(pb::SetSessionModeRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
            mode_id: "plan".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .modes
        .unwrap();
    assert_eq!(set.current_mode_id, "plan");
    assert_eq!(status(&mut c).await.modes.unwrap().current_mode_id, "plan");
    // The agent really switched.
    let reply = prompt(&mut c, &task.id, &s.id, "do it").await;
    assert!(reply.contains("plan mode"), "{reply}");

    // A stopped session has no agent to ask: no modes, and no switch.
    c.stop_session(pb::StopSessionRequest {
        task_id: task.id.clone(),
        session_id: s.id.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    assert!(status(&mut c).await.modes.is_none());
    let err = c
        .set_session_mode(pb::SetSessionModeRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
            mode_id: "default".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
}

/// A mode the agent switches to by itself (ACP `current_mode_update`) is
/// the session's current mode in its status, stored as a part of the
/// conversation, and still current after a kill -9 and restart of sessiond.
#[tokio::test]
async fn agent_initiated_mode_change_is_listed_and_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let mut server = start(&data, &[]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "agent modes").await;
    let s = create_session(&mut c, &task.id, &work, "").await;
    async fn current(c: &mut Sessions, task: &str, session: &str) -> String {
        c.get_session_status(pb::GetSessionStatusRequest {
            task_id: task.into(),
            session_id: session.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .modes
        .expect("the demo agent has modes")
        .current_mode_id
    }
    assert_eq!(current(&mut c, &task.id, &s.id).await, "default");

    let reply = prompt(&mut c, &task.id, &s.id, "/mode plan").await;
    assert!(reply.contains("mode: plan"), "{reply}");
    assert_eq!(current(&mut c, &task.id, &s.id).await, "plan");
    let parts: Vec<_> = c
        .list_messages(pb::ListMessagesRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .messages
        .into_iter()
        .filter_map(|m| m.part)
        .collect();
    assert_eq!(
        parts,
        [pb::message::Part::CurrentMode(pb::CurrentModePart {
            mode_id: "plan".into()
        })]
    );

    server.kill();
    let server = start(&data, &[]);
    crate::restart::wait_serving(&server).await;
    let mut c = sessions(&server).await;
    assert_eq!(current(&mut c, &task.id, &s.id).await, "plan");
    // The agent is in that mode, and switches back when asked.
    let reply = prompt(&mut c, &task.id, &s.id, "next").await;
    assert!(reply.contains("plan mode"), "{reply}");
    let set = c
        .set_session_mode(pb::SetSessionModeRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
            mode_id: "default".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .modes
        .unwrap();
    assert_eq!(set.current_mode_id, "default");
    assert_eq!(current(&mut c, &task.id, &s.id).await, "default");
}

/// `executors.idle_timeout` reaches agentctl as documented: "0s" (the
/// default) is agentctl's "never" (`--idle-timeout 0ms`), not its own
/// 30-minute default; another value is passed as it is.
#[tokio::test]
async fn idle_timeout_is_passed_to_agentctl() {
    fn idle_arg(data: &Path) -> String {
        let pids = agentctl_pids(data);
        assert_eq!(pids.len(), 1, "{pids:?}");
        let cmdline = std::fs::read(format!("/proc/{}/cmdline", pids[0])).unwrap();
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let at = args
            .iter()
            .position(|a| a == "--idle-timeout")
            .unwrap_or_else(|| panic!("no --idle-timeout in {args:?}"));
        args[at + 1].clone()
    }
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    for (toml, expected) in [
        ("", "0ms"),
        ("idle_timeout = \"0s\"", "0ms"),
        ("idle_timeout = \"45s\"", "45000ms"),
    ] {
        let data = dir.path().join(format!("data-{expected}-{}", toml.len()));
        let config = dir.path().join(format!("idle-{}.toml", toml.len()));
        std::fs::write(&config, format!("[executors]\n{toml}\n")).unwrap();
        let server = start(&data, &["--config", &config.display().to_string()]);
        let mut c = sessions(&server).await;
        let task = create_task(&mut c, "idle").await;
        let s = create_session(&mut c, &task.id, &work, "").await;
        assert_eq!(s.state, pb::SessionState::WaitingForInput as i32, "{s:?}");
        assert_eq!(idle_arg(&data), expected, "{toml:?}");
    }
}

/// StopSession while a turn runs ends the turn with the session: the reply
/// so far is kept and complete (with a note), a system message says the
/// session was stopped, `session.turn_ended` comes with `cancelled`, so a
/// client waiting for the turn's end stops waiting; nothing stays pending.
#[tokio::test]
async fn stopping_a_session_mid_turn_ends_its_turn() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let server = start(&data, &[]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "stop mid-turn").await;
    let s = create_session(&mut c, &task.id, &work, "").await;
    let sent = send(&mut c, &task.id, &s.id, "/long story").await;
    // The reply has begun.
    wait_for(&mut c, &s.id, |e| match &e.payload {
        Some(pb::event::Payload::MessageAdded(pb::MessageAdded { message: Some(m) }))
            if m.role == pb::MessageRole::Agent as i32
                && m.kind == pb::MessageKind::Text as i32
                && m.seq > sent.seq =>
        {
            Some(())
        }
        _ => None,
    })
    .await;
    let stopped = c
        .stop_session(pb::StopSessionRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .session
        .unwrap();
    assert_eq!(
        stopped.state,
        pb::SessionState::Cancelled as i32,
        "{stopped:?}"
    );
    let end = turn_end(&mut c, &s.id, &sent.id).await;
    assert_eq!(end.stop_reason, "cancelled", "{end:?}");
    // The session's end comes before the end of the turn it cut, as at
    // every turn's end.
    let events = replayed_events(&mut c, &s.id).await;
    let position = |f: &dyn Fn(&pb::event::Payload) -> bool| {
        events
            .iter()
            .position(|e| e.payload.as_ref().is_some_and(f))
            .unwrap_or_else(|| panic!("missing event: {events:?}"))
    };
    let cancelled = position(&|p| {
        matches!(p, pb::event::Payload::StateChanged(c)
            if c.to == pb::SessionState::Cancelled as i32)
    });
    let turn_ended =
        position(&|p| matches!(p, pb::event::Payload::TurnEnded(t) if t.turn_id == sent.id));
    assert!(cancelled < turn_ended, "{events:?}");

    let msgs = messages(&mut c, &task.id, &s.id).await;
    let reply = msgs
        .iter()
        .find(|m| m.role == pb::MessageRole::Agent as i32 && m.seq > sent.seq)
        .expect("the reply so far is kept");
    assert!(reply.complete, "{reply:?}");
    assert!(
        reply.content.contains("the session was stopped"),
        "{reply:?}"
    );
    let last = msgs.last().unwrap();
    assert_eq!(last.role, pb::MessageRole::System as i32, "{msgs:?}");
    assert!(last.content.contains("the session was stopped"), "{last:?}");
    // The turn is over: a retry has nothing to retry.
    let err = c
        .retry_turn(pb::RetryTurnRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
}

/// An agent that says more than one update can carry (a 70 MB chunk; the
/// link to agentctl reads updates of up to 64 MiB) once left the turn
/// RUNNING for good while agentctl sent the update again and again. Now
/// agentctl sends it in pieces, sessiond keeps the first 32 MiB of the
/// reply and says where it was cut, and the session goes on.
#[tokio::test]
async fn a_reply_bigger_than_an_update_is_kept_cut_and_the_session_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let server = start(&data, &[]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "a huge reply").await;
    let s = create_session(&mut c, &task.id, &work, "").await;
    let sent = send(&mut c, &task.id, &s.id, "/big 70000000").await;
    let end = turn_end(&mut c, &s.id, &sent.id).await;
    assert_eq!(end.stop_reason, "end_turn", "{end:?}");
    let msgs = messages(&mut c, &task.id, &s.id).await;
    let reply = msgs
        .iter()
        .find(|m| m.role == pb::MessageRole::Agent as i32 && m.seq > sent.seq)
        .expect("the reply is stored");
    assert!(reply.complete);
    assert!(reply.content.len() <= 32 << 20, "{}", reply.content.len());
    assert!(reply.content.len() > 30 << 20, "{}", reply.content.len());
    assert!(
        reply
            .content
            .ends_with("the agent's further text is not kept]"),
        "{}",
        &reply.content[reply.content.len() - 200..]
    );
    // The session is not stuck behind it.
    let next = prompt(&mut c, &task.id, &s.id, "and now?").await;
    assert!(next.contains("you said \"and now?\""), "{next}");
    // Two cut replies (32 MiB each) do not fit one ListMessages answer that
    // clients can read: the pages hold them apart.
    let sent = send(&mut c, &task.id, &s.id, "/big 40000000").await;
    turn_end(&mut c, &s.id, &sent.id).await;
    let (mut after_seq, mut pages, mut all) = (0, 0, Vec::new());
    loop {
        let page = c
            .list_messages(pb::ListMessagesRequest {
                task_id: task.id.clone(),
                session_id: s.id.clone(),
                after_seq,
                page_size: 1000,
            })
            .await
            .unwrap()
            .into_inner();
        pages += 1;
        let bytes: usize = page.messages.iter().map(|m| m.content.len()).sum();
        assert!(bytes <= 48 << 20, "a page of {bytes} bytes");
        all.extend(page.messages);
        if page.next_after_seq == 0 {
            break;
        }
        after_seq = page.next_after_seq;
    }
    assert!(pages >= 2, "{pages} page(s)");
    let seqs: Vec<i64> = all.iter().map(|m| m.seq).collect();
    assert_eq!(
        seqs,
        (1..=6).collect::<Vec<_>>(),
        "every message once, in order"
    );
}
