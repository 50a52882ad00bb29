//! Every RPC of SessionService and WorkspaceService with its error paths.

use std::time::Duration;

use sessiond_proto::sessiond::v1 as pb;
use tonic::Code;

use crate::support::*;

const UNKNOWN: &str = "00000000-0000-7000-8000-000000000000";

fn sref(task: &str, session: &str) -> Option<pb::SessionRef> {
    Some(pb::SessionRef {
        task_id: task.into(),
        session_id: session.into(),
    })
}

#[tokio::test]
async fn task_rpcs_and_their_errors() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&dir.path().join("data"), &[]);
    let mut c = sessions(&server).await;

    let a = create_task(&mut c, "  first  ").await;
    assert_eq!(a.title, "first");
    assert_eq!(a.state, pb::TaskState::Todo as i32);
    create_task(&mut c, "second").await;
    create_task(&mut c, "third").await;
    assert_eq!(
        code(
            c.create_task(pb::CreateTaskRequest { title: " ".into() })
                .await
        ),
        Code::InvalidArgument
    );

    let got = c
        .get_task(pb::GetTaskRequest {
            task_id: a.id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .task
        .unwrap();
    assert_eq!(got.id, a.id);
    assert_eq!(
        code(
            c.get_task(pb::GetTaskRequest {
                task_id: "x".into()
            })
            .await
        ),
        Code::InvalidArgument
    );
    assert_eq!(
        code(
            c.get_task(pb::GetTaskRequest {
                task_id: UNKNOWN.into()
            })
            .await
        ),
        Code::NotFound
    );

    // Pagination: 2 + 1.
    let page = c
        .list_tasks(pb::ListTasksRequest {
            page_size: 2,
            page_token: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(page.tasks.len(), 2);
    assert!(!page.next_page_token.is_empty());
    let rest = c
        .list_tasks(pb::ListTasksRequest {
            page_size: 2,
            page_token: page.next_page_token,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(rest.tasks.len(), 1);
    assert!(rest.next_page_token.is_empty());
    assert_eq!(
        code(
            c.list_tasks(pb::ListTasksRequest {
                page_size: 5000,
                page_token: String::new()
            })
            .await
        ),
        Code::InvalidArgument
    );
    assert_eq!(
        code(
            c.list_tasks(pb::ListTasksRequest {
                page_size: 0,
                page_token: "garbage".into()
            })
            .await
        ),
        Code::InvalidArgument
    );

    let profiles = c
        .list_agent_profiles(pb::ListAgentProfilesRequest {})
        .await
        .unwrap()
        .into_inner()
        .profiles;
    let demo = profiles.iter().find(|p| p.name == "demo").unwrap();
    assert!(demo.supports_session_resume);
    assert!(demo.command.ends_with("acp-demo-agent"), "{demo:?}");

    // Docker is not configured here: only the runtimes it can use.
    let runtimes = c
        .list_runtimes(pb::ListRuntimesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        runtimes.runtime_names,
        vec!["local_standalone".to_owned(), "remote".to_owned()]
    );
    assert_eq!(
        runtimes.runtimes,
        vec![
            pb::Runtime::LocalStandalone as i32,
            pb::Runtime::Remote as i32
        ]
    );
}

#[tokio::test]
async fn session_lifecycle_workspace_and_events() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let server = start(&dir.path().join("data"), &[]);
    let mut c = sessions(&server).await;
    let mut w = workspaces(&server).await;

    let task = create_task(&mut c, "lifecycle").await;
    let s = create_session(&mut c, &task.id, &work, "").await;
    assert_eq!(s.state, pb::SessionState::WaitingForInput as i32, "{s:?}");
    assert!(!s.resume_token.is_empty());
    assert_eq!(s.runtime, pb::Runtime::LocalStandalone as i32);

    let got = c
        .get_session(pb::GetSessionRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .session
        .unwrap();
    assert_eq!(got.id, s.id);
    let list = list(&mut c, &task.id).await;
    assert_eq!(list.len(), 1);

    let status = c
        .get_session_status(pb::GetSessionStatusRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(status.executor_status, pb::ExecutorStatus::Ready as i32);
    assert!(status.is_agent_running);
    assert!(status.is_resumable);
    assert!(!status.needs_resume);

    let reply = prompt(&mut c, &task.id, &s.id, "hello").await;
    assert!(
        reply.contains("turn 1") && reply.contains("hello"),
        "{reply}"
    );
    let reply = prompt(&mut c, &task.id, &s.id, "again").await;
    assert!(reply.contains("turn 2"), "{reply}");

    let msgs = c
        .list_messages(pb::ListMessagesRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
            after_seq: 0,
            page_size: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(msgs.messages.len(), 4);
    assert_eq!(msgs.next_after_seq, 0);
    let first = c
        .list_messages(pb::ListMessagesRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
            after_seq: 0,
            page_size: 3,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(first.messages.len(), 3);
    let rest = c
        .list_messages(pb::ListMessagesRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
            after_seq: first.next_after_seq,
            page_size: 3,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(rest.messages.len(), 1);
    assert_eq!(rest.messages[0].role, pb::MessageRole::Agent as i32);

    // WatchSession with after_seq: exactly the events after it, in order,
    // and WatchTask by task_seq.
    let mut all = c
        .watch_session(pb::WatchSessionRequest {
            session_id: s.id.clone(),
            after_seq: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let mut seqs = Vec::new();
    while let Ok(Some(e)) = tokio::time::timeout(Duration::from_millis(500), all.message())
        .await
        .map(Result::unwrap)
    {
        seqs.push(e.seq);
    }
    assert!(seqs.len() >= 8, "{seqs:?}");
    assert_eq!(seqs, (1..=seqs.len() as i64).collect::<Vec<_>>());
    let mut tail = c
        .watch_session(pb::WatchSessionRequest {
            session_id: s.id.clone(),
            after_seq: 5,
        })
        .await
        .unwrap()
        .into_inner();
    let e = tail.message().await.unwrap().unwrap();
    assert_eq!(e.seq, 6);
    assert_eq!(e.session_id, s.id);
    assert_eq!(e.task_id, task.id);
    let mut by_task = c
        .watch_task(pb::WatchTaskRequest {
            task_id: task.id.clone(),
            after_task_seq: 2,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(by_task.message().await.unwrap().unwrap().task_seq, 3);

    // Workspace: files, exec, git.
    let written = w
        .write_file(pb::WriteFileRequest {
            session: sref(&task.id, &s.id),
            path: "dir/a.txt".into(),
            content: b"hello file".to_vec(),
            create_parents: true,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(written.bytes_written, 10);
    let read = w
        .read_file(pb::ReadFileRequest {
            session: sref(&task.id, &s.id),
            path: "dir/a.txt".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(read.content, b"hello file");
    let ls = w
        .list_dir(pb::ListDirRequest {
            session: sref(&task.id, &s.id),
            path: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        ls.entries.iter().any(|e| e.name == "dir" && e.is_dir),
        "{ls:?}"
    );
    assert_eq!(
        code(
            w.read_file(pb::ReadFileRequest {
                session: sref(&task.id, &s.id),
                path: "../outside".into(),
            })
            .await
        ),
        Code::PermissionDenied
    );
    let exec = w
        .exec(pb::ExecRequest {
            session: sref(&task.id, &s.id),
            command: "sh".into(),
            args: vec!["-c".into(), "echo out; echo err >&2; exit 3".into()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(exec.exit_code, Some(3));
    assert_eq!(exec.stdout, b"out\n");
    assert_eq!(exec.stderr, b"err\n");
    let init = w
        .exec(pb::ExecRequest {
            session: sref(&task.id, &s.id),
            command: "git".into(),
            args: vec!["init".into(), "-q".into(), "-b".into(), "main".into()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(init.exit_code, Some(0), "{init:?}");
    let git = w
        .git_status(pb::GitStatusRequest {
            session: sref(&task.id, &s.id),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        git.files
            .iter()
            .any(|f| f.path.starts_with("dir") && f.code == "??"),
        "{git:?}"
    );
    let diff = w
        .git_diff(pb::GitDiffRequest {
            session: sref(&task.id, &s.id),
            staged: false,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(diff.diff, "");

    // Resume of a running session returns it as it is.
    let resumed = c
        .resume_session(pb::ResumeSessionRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .session
        .unwrap();
    assert_eq!(resumed.state, pb::SessionState::WaitingForInput as i32);

    // Stop: CANCELLED (UNSPECIFIED), executor stopped, workspace refused
    // naming the status, resume refused as ended.
    let stopped = c
        .stop_session(pb::StopSessionRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
            outcome: 0,
        })
        .await
        .unwrap()
        .into_inner()
        .session
        .unwrap();
    assert_eq!(stopped.state, pb::SessionState::Cancelled as i32);
    let err = w
        .list_dir(pb::ListDirRequest {
            session: sref(&task.id, &s.id),
            path: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(err.message().contains("stopped"), "{}", err.message());
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
        "session_ended"
    );
    assert_eq!(
        code(
            c.send_message(pb::SendMessageRequest {
                task_id: task.id.clone(),
                session_id: s.id.clone(),
                content: "too late".into(),
                ..Default::default()
            })
            .await
        ),
        Code::FailedPrecondition
    );

    c.delete_session(pb::DeleteSessionRequest {
        task_id: task.id.clone(),
        session_id: s.id.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    assert!(
        agentctl_pids(&server.data_dir).is_empty(),
        "agentctl still runs after delete"
    );

    // Metrics saw the calls.
    let text = scrape(server.metrics.as_deref().unwrap()).await;
    assert!(
        text.contains("method=\"/sessiond.v1.SessionService/CreateSession\",code=\"OK\""),
        "{text}"
    );
    assert!(text.contains("code=\"FAILED_PRECONDITION\""), "{text}");
    // The stopped session was deleted: no longer counted.
    assert!(
        !text.contains("sessiond_sessions{state=\"CANCELLED\"} 1"),
        "{text}"
    );
    assert!(text.contains("sessiond_recovery_done 1"), "{text}");
}

async fn scrape(addr: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    out
}

#[tokio::test]
async fn malformed_unknown_and_foreign_ids() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let server = start(&dir.path().join("data"), &[]);
    let mut c = sessions(&server).await;
    let mut w = workspaces(&server).await;
    let task = create_task(&mut c, "mine").await;
    let other = create_task(&mut c, "other").await;
    let s = create_session(&mut c, &task.id, &work, "demo").await;
    let (t, sid, ot) = (task.id.as_str(), s.id.as_str(), other.id.as_str());

    // Each session-addressed call with: malformed task, malformed session,
    // unknown session, and the session under another task.
    let cases: [(&str, &str, Code); 4] = [
        ("bad", sid, Code::InvalidArgument),
        (t, "bad", Code::InvalidArgument),
        (t, UNKNOWN, Code::NotFound),
        (ot, sid, Code::NotFound),
    ];
    for (task_id, session_id, expected) in cases {
        let (task_id, session_id) = (task_id.to_owned(), session_id.to_owned());
        let what = format!("{task_id}/{session_id}");
        assert_eq!(
            code(
                c.get_session(pb::GetSessionRequest {
                    task_id: task_id.clone(),
                    session_id: session_id.clone()
                })
                .await
            ),
            expected,
            "GetSession {what}"
        );
        assert_eq!(
            code(
                c.get_session_status(pb::GetSessionStatusRequest {
                    task_id: task_id.clone(),
                    session_id: session_id.clone()
                })
                .await
            ),
            expected,
            "GetSessionStatus {what}"
        );
        assert_eq!(
            code(
                c.resume_session(pb::ResumeSessionRequest {
                    task_id: task_id.clone(),
                    session_id: session_id.clone()
                })
                .await
            ),
            expected,
            "ResumeSession {what}"
        );
        assert_eq!(
            code(
                c.send_message(pb::SendMessageRequest {
                    task_id: task_id.clone(),
                    session_id: session_id.clone(),
                    content: "hi".into(),
                    ..Default::default()
                })
                .await
            ),
            expected,
            "SendMessage {what}"
        );
        assert_eq!(
            code(
                c.list_messages(pb::ListMessagesRequest {
                    task_id: task_id.clone(),
                    session_id: session_id.clone(),
                    ..Default::default()
                })
                .await
            ),
            expected,
            "ListMessages {what}"
        );
        assert_eq!(
            code(
                c.stop_session(pb::StopSessionRequest {
                    task_id: task_id.clone(),
                    session_id: session_id.clone(),
                    outcome: 0
                })
                .await
            ),
            expected,
            "StopSession {what}"
        );
        assert_eq!(
            code(
                c.delete_session(pb::DeleteSessionRequest {
                    task_id: task_id.clone(),
                    session_id: session_id.clone(),
                    ..Default::default()
                })
                .await
            ),
            expected,
            "DeleteSession {what}"
        );
        assert_eq!(
            code(
                w.list_dir(pb::ListDirRequest {
                    session: sref(&task_id, &session_id),
                    path: String::new()
                })
                .await
            ),
            expected,
            "ListDir {what}"
        );
        assert_eq!(
            code(
                w.exec(pb::ExecRequest {
                    session: sref(&task_id, &session_id),
                    command: "true".into(),
                    ..Default::default()
                })
                .await
            ),
            expected,
            "Exec {what}"
        );
    }
    // The foreign-task answer does not reveal the session's real task.
    let err = c
        .get_session(pb::GetSessionRequest {
            task_id: ot.into(),
            session_id: sid.into(),
        })
        .await
        .unwrap_err();
    assert!(!err.message().contains(t), "{}", err.message());

    // Task-addressed calls.
    assert_eq!(
        code(
            c.list_sessions(pb::ListSessionsRequest {
                task_id: "x".into()
            })
            .await
        ),
        Code::InvalidArgument
    );
    assert_eq!(
        code(
            c.list_sessions(pb::ListSessionsRequest {
                task_id: UNKNOWN.into()
            })
            .await
        ),
        Code::NotFound
    );
    assert_eq!(
        code(
            c.watch_session(pb::WatchSessionRequest {
                session_id: "x".into(),
                after_seq: 0
            })
            .await
        ),
        Code::InvalidArgument
    );
    assert_eq!(
        code(
            c.watch_session(pb::WatchSessionRequest {
                session_id: UNKNOWN.into(),
                after_seq: 0
            })
            .await
        ),
        Code::NotFound
    );
    assert_eq!(
        code(
            c.watch_session(pb::WatchSessionRequest {
                session_id: sid.into(),
                after_seq: -1
            })
            .await
        ),
        Code::InvalidArgument
    );
    assert_eq!(
        code(
            c.watch_task(pb::WatchTaskRequest {
                task_id: UNKNOWN.into(),
                after_task_seq: 0
            })
            .await
        ),
        Code::NotFound
    );
    assert_eq!(
        code(w.git_status(pb::GitStatusRequest { session: None }).await),
        Code::InvalidArgument
    );

    // CreateSession input errors.
    let mk = |task_id: &str, profile: &str, path: &str, runtime: i32| pb::CreateSessionRequest {
        task_id: task_id.into(),
        agent_profile: profile.into(),
        runtime,
        worktree: Some(pb::Worktree {
            id: String::new(),
            path: path.into(),
            branch: String::new(),
            ..Default::default()
        }),
        ..Default::default()
    };
    let wt = work.display().to_string();
    assert_eq!(
        code(c.create_session(mk(UNKNOWN, "", &wt, 0)).await),
        Code::NotFound
    );
    assert_eq!(
        code(c.create_session(mk(t, "no-such-agent", &wt, 0)).await),
        Code::NotFound
    );
    assert_eq!(
        code(c.create_session(mk(t, "", "relative/path", 0)).await),
        Code::InvalidArgument
    );
    assert_eq!(
        code(c.create_session(mk(t, "", "", 0)).await),
        Code::InvalidArgument
    );
    assert_eq!(
        code(c.create_session(mk(t, "", &wt, 42)).await),
        Code::InvalidArgument
    );
    assert_eq!(
        code(
            c.create_session(mk(t, "", &wt, pb::Runtime::Remote as i32))
                .await
        ),
        Code::InvalidArgument
    );
    let missing = dir.path().join("missing").display().to_string();
    assert_eq!(
        code(c.create_session(mk(t, "", &missing, 0)).await),
        Code::FailedPrecondition
    );
    // Docker is not enabled in this server: its configuration, not a
    // passing outage, so nothing a retry could pass.
    let err = c
        .create_session(mk(t, "", &wt, pb::Runtime::LocalDocker as i32))
        .await
        .expect_err("docker is not enabled");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message()
            .contains("runtime local_docker is not enabled on this server")
            && err.message().contains("--docker-enabled"),
        "{err:?}"
    );
}

#[tokio::test]
async fn oversized_and_empty_messages_are_invalid_argument() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let server = start(&dir.path().join("data"), &["--max-message-bytes", "1000"]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "size").await;
    let s = create_session(&mut c, &task.id, &work, "").await;
    let err = c
        .send_message(pb::SendMessageRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
            content: "x".repeat(1001),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("1000"), "{}", err.message());
    // Far over the limit (and over gRPC's default 4 MiB): still INVALID_ARGUMENT.
    let err = c
        .send_message(pb::SendMessageRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
            content: "y".repeat(3 * 1024 * 1024),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_eq!(
        code(
            c.send_message(pb::SendMessageRequest {
                task_id: task.id.clone(),
                session_id: s.id.clone(),
                content: "  ".into(),
                ..Default::default()
            })
            .await
        ),
        Code::InvalidArgument
    );
    // At the limit it is accepted.
    let reply = prompt(&mut c, &task.id, &s.id, &"z".repeat(1000)).await;
    assert!(reply.contains("turn 1"), "{reply}");
}

#[tokio::test]
async fn unauthenticated_calls_are_refused_health_is_open() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&dir.path().join("data"), &[]);
    for token in [None, Some("wrong-token-0123456789")] {
        let mut c = sessions_with(&server, token).await;
        let err = c
            .list_tasks(pb::ListTasksRequest::default())
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
        let mut w = workspaces_with(&server, token).await;
        assert_eq!(
            code(
                w.git_status(pb::GitStatusRequest {
                    session: sref(UNKNOWN, UNKNOWN)
                })
                .await
            ),
            Code::Unauthenticated
        );
        let mut reflection =
            tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient::new(
                channel(&server.addr).await,
            );
        let req = tonic_reflection::pb::v1::ServerReflectionRequest {
            host: String::new(),
            message_request: Some(
                tonic_reflection::pb::v1::server_reflection_request::MessageRequest::ListServices(
                    String::new(),
                ),
            ),
        };
        assert_eq!(
            code(
                reflection
                    .server_reflection_info(tokio_stream::iter([req]))
                    .await
            ),
            Code::Unauthenticated
        );
    }
    let mut health =
        tonic_health::pb::health_client::HealthClient::new(channel(&server.addr).await);
    health
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap();
    // The right token works.
    sessions(&server)
        .await
        .list_tasks(pb::ListTasksRequest::default())
        .await
        .unwrap();
}

/// A deleted session is gone for every caller: reads and commands answer
/// NOT_FOUND (`not_found`), it leaves ListSessions, and a second delete is
/// NOT_FOUND too. The rows stay in the database as history, unread by the API.
#[tokio::test]
async fn a_deleted_session_answers_not_found() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let server = start(&dir.path().join("data"), &[]);
    let mut c = sessions(&server).await;
    let mut w = workspaces(&server).await;
    let task = create_task(&mut c, "deleted").await;
    let s = create_session(&mut c, &task.id, &work, "").await;
    let kept = create_session(&mut c, &task.id, &work, "").await;
    prompt(&mut c, &task.id, &s.id, "hello").await;

    c.delete_session(pb::DeleteSessionRequest {
        task_id: task.id.clone(),
        session_id: s.id.clone(),
        ..Default::default()
    })
    .await
    .unwrap();

    let not_found = |what: &str, r: Result<(), tonic::Status>| {
        let e = r.expect_err(what);
        assert_eq!(e.code(), Code::NotFound, "{what}: {e:?}");
        assert_eq!(
            e.metadata().get("sessiond-error").unwrap(),
            "not_found",
            "{what}"
        );
        assert!(e.message().contains(&s.id), "{what}: {}", e.message());
    };
    let (t, id) = (task.id.clone(), s.id.clone());
    not_found(
        "GetSession",
        c.get_session(pb::GetSessionRequest {
            task_id: t.clone(),
            session_id: id.clone(),
        })
        .await
        .map(drop),
    );
    not_found(
        "GetSessionStatus",
        c.get_session_status(pb::GetSessionStatusRequest {
            task_id: t.clone(),
            session_id: id.clone(),
        })
        .await
        .map(drop),
    );
    not_found(
        "ListMessages",
        c.list_messages(pb::ListMessagesRequest {
            task_id: t.clone(),
            session_id: id.clone(),
            ..Default::default()
        })
        .await
        .map(drop),
    );
    not_found(
        "WatchSession",
        c.watch_session(pb::WatchSessionRequest {
            session_id: id.clone(),
            after_seq: 0,
        })
        .await
        .map(drop),
    );
    not_found(
        "SendMessage",
        c.send_message(pb::SendMessageRequest {
            task_id: t.clone(),
            session_id: id.clone(),
            content: "still there?".into(),
            ..Default::default()
        })
        .await
        .map(drop),
    );
    not_found(
        "ResumeSession",
        c.resume_session(pb::ResumeSessionRequest {
            task_id: t.clone(),
            session_id: id.clone(),
        })
        .await
        .map(drop),
    );
    not_found(
        "StopSession",
        c.stop_session(pb::StopSessionRequest {
            task_id: t.clone(),
            session_id: id.clone(),
            outcome: 0,
        })
        .await
        .map(drop),
    );
    not_found(
        "ListDir",
        w.list_dir(pb::ListDirRequest {
            session: sref(&t, &id),
            path: String::new(),
        })
        .await
        .map(drop),
    );
    not_found(
        "DeleteSession again",
        c.delete_session(pb::DeleteSessionRequest {
            task_id: t.clone(),
            session_id: id.clone(),
            ..Default::default()
        })
        .await
        .map(drop),
    );
    let listed = c
        .list_sessions(pb::ListSessionsRequest { task_id: t.clone() })
        .await
        .unwrap()
        .into_inner()
        .sessions;
    assert_eq!(
        listed.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
        [kept.id.as_str()]
    );
}

/// Oversized string fields are refused by sessiond itself, naming the field
/// and its limit, before anything reaches agentctl (where a 100 kB mode id
/// failed as FAILED_PRECONDITION) or the database.
#[tokio::test]
async fn oversized_string_fields_are_invalid_argument_naming_field_and_limit() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let server = start(&dir.path().join("data"), &[]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "bounds").await;
    let s = create_session(&mut c, &task.id, &work, "").await;
    let huge = "m".repeat(100_000);
    let check = |what: &str, err: tonic::Status, field: &str, limit: &str| {
        assert_eq!(err.code(), Code::InvalidArgument, "{what}: {err:?}");
        assert!(
            err.message().starts_with(&format!("{field}: 100000 bytes")),
            "{what}: {}",
            err.message()
        );
        assert!(err.message().contains(limit), "{what}: {}", err.message());
    };
    let err = c
        .set_session_mode(pb::SetSessionModeRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
            mode_id: huge.clone(),
        })
        .await
        .unwrap_err();
    check("SetSessionMode", err, "mode_id", "1024 bytes");
    let err = c
        .respond_to_permission(pb::RespondToPermissionRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
            request_id: "r".into(),
            option_id: huge.clone(),
            content_json: String::new(),
        })
        .await
        .unwrap_err();
    check("RespondToPermission", err, "option_id", "1024 bytes");
    let err = c
        .create_session(pb::CreateSessionRequest {
            task_id: task.id.clone(),
            runtime: pb::Runtime::LocalStandalone as i32,
            worktree: Some(pb::Worktree {
                id: String::new(),
                path: work.display().to_string(),
                branch: huge.clone(),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap_err();
    check("CreateSession", err, "worktree.branch", "1024 bytes");
    // The session is untouched and still takes a mode of a sane size.
    let status = c
        .get_session_status(pb::GetSessionStatusRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(status.is_agent_running);
}
