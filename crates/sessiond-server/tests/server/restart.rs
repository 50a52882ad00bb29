//! Restarts of the binary: health around startup recovery, SIGTERM leaving
//! executors running, and a non-resumable session after a restart.

use std::{process::Command, time::Duration};

use sessiond_proto::sessiond::v1 as pb;
use tonic::Code;
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

use crate::support::*;

pub(crate) async fn wait_serving(server: &Server) {
    let mut health = HealthClient::new(channel(&server.addr).await);
    let mut watch = health
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    loop {
        let status = tokio::time::timeout(Duration::from_secs(60), watch.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
            .status;
        if status == ServingStatus::Serving as i32 {
            break;
        }
    }
    wait_agents_back(server).await;
}

/// SERVING comes once every workspace is back; agents that relaunch follow
/// behind it. Waits until no session says `recovering` any more (the tests
/// that call [`wait_serving`] then look at agents), at most two minutes. A
/// server this test client cannot list (another token) is left to the
/// test's own checks.
async fn wait_agents_back(server: &Server) {
    let mut c = sessions(server).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    'poll: loop {
        let Ok(tasks) = c
            .list_tasks(pb::ListTasksRequest {
                page_size: 1000,
                page_token: String::new(),
            })
            .await
        else {
            return;
        };
        for task in tasks.into_inner().tasks {
            let Ok(list) = c
                .list_sessions(pb::ListSessionsRequest {
                    task_id: task.id.clone(),
                })
                .await
            else {
                return;
            };
            for s in list.into_inner().sessions {
                let Ok(st) = c
                    .get_session_status(pb::GetSessionStatusRequest {
                        task_id: task.id.clone(),
                        session_id: s.id.clone(),
                    })
                    .await
                else {
                    continue;
                };
                if st.into_inner().recovering {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "session {} still recovering two minutes after SERVING",
                        s.id
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue 'poll;
                }
            }
        }
        return;
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

#[tokio::test]
async fn health_is_not_serving_until_startup_recovery_is_done() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let mut server = start(&data, &[]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "health").await;
    let s = create_session(&mut c, &task.id, &work, "").await;
    server.kill();

    // A hung agentctl (stopped, its socket still open) holds recovery for
    // its deadline: long enough to see NOT_SERVING first.
    let pids = agentctl_pids(&data);
    assert_eq!(pids.len(), 1, "{pids:?}");
    Command::new("kill")
        .args(["-STOP", &pids[0].to_string()])
        .status()
        .unwrap();
    let server = start(&data, &["--recovery-executor-deadline", "3s"]);
    let mut health = HealthClient::new(channel(&server.addr).await);
    let mut watch = health
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = watch.message().await.unwrap().unwrap().status;
    assert_eq!(first, ServingStatus::NotServing as i32);
    let per_service = health
        .check(HealthCheckRequest {
            service: "sessiond.v1.SessionService".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .status;
    assert_eq!(per_service, ServingStatus::NotServing as i32);
    Command::new("kill")
        .args(["-CONT", &pids[0].to_string()])
        .status()
        .unwrap();
    let next = tokio::time::timeout(Duration::from_secs(60), watch.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap()
        .status;
    assert_eq!(next, ServingStatus::Serving as i32);
    // The API answered all along; the session's status is well defined.
    let mut c = sessions(&server).await;
    let st = status(&mut c, &task.id, &s.id).await;
    assert_eq!(st.session_id, s.id);
}

/// helper-60 F1: an open health Watch held a SIGTERM's stop for the whole
/// shutdown grace (10 s by default; here 600 s). It ends with the
/// shutdown now, after saying NOT_SERVING.
#[tokio::test]
async fn an_open_health_watch_does_not_hold_the_shutdown() {
    use tonic_health::pb::health_check_response::ServingStatus;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("sessiond.toml");
    std::fs::write(&config, "shutdown_grace = \"600s\"\n").unwrap();
    let mut server = start(
        &dir.path().join("data"),
        &["--config", config.to_str().unwrap()],
    );
    let (_watch, first) = health_watch(&server.addr).await;
    assert!(
        [ServingStatus::Serving, ServingStatus::NotServing].contains(&first),
        "{first:?}"
    );
    let stopped = tokio::task::spawn_blocking(move || server.terminate());
    let exit = tokio::time::timeout(Duration::from_secs(120), stopped)
        .await
        .expect("the shutdown waited for the health Watch")
        .unwrap();
    assert!(exit.success(), "{exit:?}");
}

#[tokio::test]
async fn sigterm_leaves_executors_running_and_the_next_start_reattaches() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let mut server = start(&data, &[]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "graceful").await;
    let s = create_session(&mut c, &task.id, &work, "").await;
    assert!(
        prompt(&mut c, &task.id, &s.id, "one")
            .await
            .contains("turn 1")
    );
    // A live stream does not hold the shutdown.
    let mut open_stream = c
        .watch_task(pb::WatchTaskRequest {
            task_id: task.id.clone(),
            after_task_seq: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let before = agentctl_pids(&data);
    assert_eq!(before.len(), 1);
    let exit = server.terminate();
    assert!(exit.success(), "{exit:?}");
    // A stream cut by the shutdown ends with UNAVAILABLE, never OK, so a
    // client does not mistake it for a finished one and resubscribes.
    let cut = loop {
        match open_stream.message().await {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the shutdown ended the watch stream with OK"),
            Err(status) => break status,
        }
    };
    assert_eq!(cut.code(), Code::Unavailable, "{cut:?}");
    assert_eq!(
        cut.metadata().get("sessiond-error").unwrap(),
        "shutting_down"
    );
    assert_eq!(
        agentctl_pids(&data),
        before,
        "agentctl must survive the shutdown"
    );

    let server = start(&data, &[]);
    wait_serving(&server).await;
    let mut c = sessions(&server).await;
    let st = status(&mut c, &task.id, &s.id).await;
    assert_eq!(st.state, pb::SessionState::WaitingForInput as i32, "{st:?}");
    assert_eq!(st.executor_status, pb::ExecutorStatus::Ready as i32);
    assert!(st.is_agent_running);
    assert_eq!(agentctl_pids(&data), before, "reattached, not relaunched");
    let reply = prompt(&mut c, &task.id, &s.id, "two").await;
    assert!(reply.contains("turn 2"), "{reply}");
}

#[tokio::test]
async fn non_resumable_session_after_restart_keeps_its_workspace() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let config = dir.path().join("sessiond.toml");
    std::fs::write(
        &config,
        format!(
            "[[agents]]\nname = \"forgetful\"\ncommand = \"{}\"\nargs = [\"--no-load-session\"]\n\
             supports_session_resume = false\nenv = {{ ACP_DEMO_STATE_DIR = \"{}\" }}\n",
            bin("acp-demo-agent").display(),
            dir.path().join("demo-state").display()
        ),
    )
    .unwrap();
    let config = config.display().to_string();
    let mut server = start(&data, &["--config", &config]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "forgetful").await;
    let s = create_session(&mut c, &task.id, &work, "forgetful").await;
    assert_eq!(s.state, pb::SessionState::WaitingForInput as i32, "{s:?}");
    prompt(&mut c, &task.id, &s.id, "remember me").await;
    server.kill();
    // The agent is gone too (its agentctl killed): it would need a resume.
    for pid in agentctl_pids(&data) {
        Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .unwrap();
    }

    let server = start(&data, &["--config", &config]);
    wait_serving(&server).await;
    let mut c = sessions(&server).await;
    let st = status(&mut c, &task.id, &s.id).await;
    assert_eq!(st.state, pb::SessionState::Error as i32, "{st:?}");
    assert!(!st.is_resumable);
    assert_eq!(st.resume_reason, pb::ResumeReason::NotResumable as i32);
    assert!(st.error_message.contains("not_resumable"), "{st:?}");
    assert_eq!(st.executor_status, pb::ExecutorStatus::Ready as i32);

    let err = c
        .resume_session(pb::ResumeSessionRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert_eq!(
        err.metadata().get("sessiond-error").unwrap(),
        "not_resumable"
    );
    // What to do, said once; the code is in the metadata, not the text.
    assert!(
        err.message().contains("cannot be resumed")
            && err.message().matches("create a new session").count() == 1
            && !err.message().contains("not_resumable"),
        "{}",
        err.message()
    );

    // Workspace access survives the agent.
    let mut w = workspaces(&server).await;
    let out = w
        .exec(pb::ExecRequest {
            session: Some(pb::SessionRef {
                task_id: task.id.clone(),
                session_id: s.id.clone(),
            }),
            command: "echo".into(),
            args: vec!["still here".into()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(out.stdout, b"still here\n");
}

/// The Docker runtime configured but no engine answers (its socket is not
/// there) when `sessiond serve` starts: the backend starts anyway, reaches
/// SERVING after recovering the standalone session, and that session's
/// conversation continues.
#[tokio::test]
async fn docker_engine_down_at_start_does_not_stop_the_backend() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let mut server = start(&data, &[]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "no engine").await;
    let s = create_session(&mut c, &task.id, &work, "").await;
    assert!(
        prompt(&mut c, &task.id, &s.id, "one")
            .await
            .contains("turn 1")
    );
    server.kill();

    let host = format!("unix://{}", dir.path().join("no-engine.sock").display());
    let server = start(&data, &["--docker-enabled", "--docker-host", &host]);
    wait_serving(&server).await;
    let mut c = sessions(&server).await;
    let st = status(&mut c, &task.id, &s.id).await;
    assert_eq!(st.executor_status, pb::ExecutorStatus::Ready as i32);
    assert!(st.is_agent_running);
    assert!(
        prompt(&mut c, &task.id, &s.id, "two")
            .await
            .contains("turn 2")
    );
}

async fn health_of(server: &Server) -> i32 {
    HealthClient::new(channel(&server.addr).await)
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .status
}

/// The API answers while startup recovery runs. The pass is held before it
/// takes up any executor by `SESSIOND_TEST_RECOVERY_GATE` (a file: a marker,
/// not a timed guess): both sessions say `recovering` while health is
/// NOT_SERVING; a SendMessage on one of them recovers that one at once
/// (agentctl relaunched, conversation resumed) and is answered before the
/// pass ends, while the other is still untouched; when the pass goes on,
/// the first is not recovered a second time (same agentctl process, same
/// generation) and health turns SERVING.
#[tokio::test]
async fn a_call_jumps_the_recovery_queue_while_health_is_not_serving() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let (wa, wb) = (dir.path().join("a"), dir.path().join("b"));
    std::fs::create_dir_all(&wa).unwrap();
    std::fs::create_dir_all(&wb).unwrap();
    let mut server = start(&data, &[]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "queue").await;
    let a = create_session(&mut c, &task.id, &wa, "").await;
    let b = create_session(&mut c, &task.id, &wb, "").await;
    assert!(
        prompt(&mut c, &task.id, &a.id, "one")
            .await
            .contains("turn 1")
    );
    // Backend and every agentctl (their agents die with them) gone: each
    // session's recovery must relaunch agentctl and resume the agent.
    server.kill();
    kill_agentctls_and_wait(&data).await;

    let gate = dir.path().join("recovery-gate");
    std::fs::write(&gate, b"").unwrap();
    let log = dir.path().join("sessiond.log");
    let server = start_env(
        &data,
        &[],
        Some(TOKEN),
        Some(&log),
        &[("SESSIOND_TEST_RECOVERY_GATE", gate.as_path())],
    );
    let mut c = sessions(&server).await;
    for s in [&a, &b] {
        let st = status(&mut c, &task.id, &s.id).await;
        assert!(st.recovering, "{st:?}");
        assert_eq!(st.executor_status, pb::ExecutorStatus::Starting as i32);
        assert!(!st.is_agent_running && !st.needs_resume, "{st:?}");
        assert_eq!(st.state, pb::SessionState::WaitingForInput as i32);
    }
    assert_eq!(health_of(&server).await, ServingStatus::NotServing as i32);
    let (ok, out, _) = sessionctl(&server, &["session", "status", "--task", &task.id, &b.id]);
    assert!(ok && out.contains("recovering        true"), "{out}");
    // The list and a get say so too, with the state recorded before.
    let (ok, out, _) = sessionctl(&server, &["session", "list", "--task", &task.id]);
    assert!(
        ok && out.matches("WAITING_FOR_INPUT (recovering)").count() == 2,
        "{out}"
    );
    assert!(get(&mut c, &task.id, &b.id).await.recovering);

    // A message to A: recovered ahead of the held pass, and answered.
    let reply = prompt(&mut c, &task.id, &a.id, "two").await;
    assert!(reply.contains("turn 2"), "{reply}");
    let st_a = status(&mut c, &task.id, &a.id).await;
    assert!(!st_a.recovering && st_a.is_agent_running, "{st_a:?}");
    assert!(status(&mut c, &task.id, &b.id).await.recovering);
    let listed = list(&mut c, &task.id).await;
    let recovering = |id: &str| listed.iter().find(|s| s.id == id).unwrap().recovering;
    assert!(!recovering(&a.id) && recovering(&b.id), "{listed:?}");
    assert_eq!(health_of(&server).await, ServingStatus::NotServing as i32);
    let only_a = agentctl_pids(&data);
    assert_eq!(only_a.len(), 1, "only A's agentctl runs: {only_a:?}");

    std::fs::remove_file(&gate).unwrap();
    wait_serving(&server).await;
    let st_b = status(&mut c, &task.id, &b.id).await;
    assert!(!st_b.recovering && st_b.is_agent_running, "{st_b:?}");
    assert!(!get(&mut c, &task.id, &b.id).await.recovering);
    let after = status(&mut c, &task.id, &a.id).await;
    assert_eq!(
        after.agent_execution_id, st_a.agent_execution_id,
        "A recovered twice"
    );
    let pids = agentctl_pids(&data);
    assert_eq!(pids.len(), 2, "{pids:?}");
    assert!(
        pids.contains(&only_a[0]),
        "A's agentctl was replaced: {only_a:?} -> {pids:?}"
    );
    assert!(
        prompt(&mut c, &task.id, &a.id, "three")
            .await
            .contains("turn 3")
    );
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("startup recovery done"), "{text}");
}

/// The reason a status carries in `sessiond-error`.
fn reason(status: &tonic::Status) -> &str {
    status
        .metadata()
        .get("sessiond-error")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

/// `sessionctl` against `server`: (success, stdout, stderr).
fn sessionctl(server: &Server, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(bin("sessionctl"))
        .args(["--addr", &format!("http://{}", server.addr)])
        .args(["--token", TOKEN])
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A turn whose agent ran its tool call when sessiond and agentctl were
/// both killed ends interrupted after the restart (at most once: the
/// relaunched agentctl's journal says an earlier process handed it to the
/// agent). RetryTurn — over gRPC and `sessionctl retry` — runs it again only
/// when asked, once, with precise codes for every refusal.
#[tokio::test]
async fn an_interrupted_turn_is_retried_only_on_request() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let side = dir.path().join("side-effects.txt");
    let gate = dir.path().join("gate");
    let config = dir.path().join("sessiond.toml");
    std::fs::write(
        &config,
        format!(
            "[[agents]]\nname = \"side\"\ncommand = \"{}\"\n\
             env = {{ ACP_DEMO_STATE_DIR = \"{}\", ACP_DEMO_SIDE_EFFECT_FILE = \"{}\", \
             ACP_DEMO_GATE_FILE = \"{}\" }}\n",
            bin("acp-demo-agent").display(),
            dir.path().join("demo-state").display(),
            side.display(),
            gate.display(),
        ),
    )
    .unwrap();
    let config = config.display().to_string();
    let lines = || {
        std::fs::read_to_string(&side)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let mut server = start(&data, &["--config", &config]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "retry").await;
    let s = create_session(&mut c, &task.id, &work, "side").await;
    assert_eq!(s.state, pb::SessionState::WaitingForInput as i32, "{s:?}");
    prompt(&mut c, &task.id, &s.id, "one").await;
    let retry = |message_id: &str| pb::RetryTurnRequest {
        task_id: task.id.clone(),
        session_id: s.id.clone(),
        message_id: message_id.into(),
    };

    // Nothing was interrupted: nothing to retry.
    let err = c.retry_turn(retry("")).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert_eq!(reason(&err), "turn_not_interrupted", "{err:?}");
    let (ok, _, stderr) = sessionctl(&server, &["retry", "--task", &task.id, &s.id]);
    assert!(!ok && stderr.contains("no interrupted turn"), "{stderr}");

    // Turn two: the agent runs its tool call, then holds at the gate.
    std::fs::write(&gate, "").unwrap();
    let two = c
        .send_message(pb::SendMessageRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
            content: "two".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .message
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while lines().len() < 2 {
        assert!(std::time::Instant::now() < deadline, "no tool call");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let err = c.retry_turn(retry(&two.id)).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert_eq!(reason(&err), "invalid_state", "a turn is running: {err:?}");

    // sessiond and agentctl with its agent die; the gate opens only once
    // the agent is gone (one that outlived agentctl for a moment would pass
    // the open gate and finish turn two in its own transcript).
    assert_eq!(agentctl_pids(&data).len(), 1);
    let agents = descendants(agentctl_pids(&data)[0]);
    assert!(!agents.is_empty(), "agentctl's agent was not found");
    server.kill_everything();
    std::fs::remove_file(&gate).unwrap();

    let server = start(&data, &["--config", &config]);
    wait_serving(&server).await;
    let mut c = sessions(&server).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let note = loop {
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
        let st = status(&mut c, &task.id, &s.id).await;
        let last = msgs.last().unwrap().clone();
        if st.state == pb::SessionState::WaitingForInput as i32
            && last.role == pb::MessageRole::System as i32
        {
            break last;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "turn two never ended interrupted: {st:?} {msgs:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(note.content.contains("interrupted"), "{note:?}");
    assert_eq!(lines(), ["one", "two"], "not run again by itself");

    let err = c.retry_turn(retry("not-an-id")).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    let err = c
        .retry_turn(retry("0190b8c4-7d2a-7c3e-9f00-1a2b3c4d5e6f"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    assert_eq!(lines(), ["one", "two"], "refusals ran nothing");

    // The user retries it with sessionctl: it runs once more.
    let (ok, stdout, stderr) = sessionctl(
        &server,
        &["retry", "--task", &task.id, &s.id, "--message-id", &two.id],
    );
    assert!(ok, "sessionctl retry failed: {stderr}\n{stdout}");
    // The killed agent never finished turn two (its transcript has one
    // turn): the retry is its second.
    assert!(
        stdout.contains("turn 2 of session") && stdout.contains("you said \"two\""),
        "{stdout}"
    );
    assert_eq!(lines(), ["one", "two", "two"]);

    // Once only.
    let err = c.retry_turn(retry(&two.id)).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert_eq!(reason(&err), "turn_not_interrupted", "{err:?}");
    let err = c.retry_turn(retry("")).await.unwrap_err();
    assert_eq!(reason(&err), "turn_not_interrupted", "{err:?}");
    assert_eq!(lines(), ["one", "two", "two"]);
}
