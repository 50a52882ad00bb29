//! Restarts of the binary: health around startup recovery, SIGTERM leaving
//! executors running, and a non-resumable session after a restart.

use std::{process::Command, time::Duration};

use sessiond_proto::sessiond::v1 as pb;
use tonic::Code;
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

use crate::support::*;

async fn wait_serving(server: &Server) {
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
            return;
        }
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
    assert!(
        err.message().contains("cannot be resumed"),
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
