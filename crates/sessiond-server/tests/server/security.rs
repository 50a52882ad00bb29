//! The security suite (docs/SECURITY.md): each defence probed as a hostile
//! or careless client would, through real gRPC and gRPC-web (HTTP/1.1)
//! requests against the real `sessiond` with real agentctl processes,
//! asserting the code, the message, and that nothing was written.

use prost::Message as _;
use sessiond_proto::sessiond::v1 as pb;
use tonic::Code;

use crate::support::*;
use crate::web::{frames, grpc_web_request_from, http1};

/// The grpc-status and grpc-message of a gRPC-web answer (headers when the
/// call failed before any message, else the trailer frame).
fn grpc_web_status(r: &crate::web::HttpResponse) -> (String, String) {
    if let Some(status) = r.header("grpc-status") {
        return (
            status.to_owned(),
            r.header("grpc-message").unwrap_or_default().to_owned(),
        );
    }
    let trailers = frames(&r.body)
        .into_iter()
        .find(|(flag, _)| *flag == 0x80)
        .map(|(_, t)| String::from_utf8_lossy(&t).into_owned())
        .unwrap_or_default();
    let field = |name: &str| {
        trailers
            .lines()
            .find_map(|l| {
                l.split_once(':')
                    .filter(|(k, _)| k.trim().eq_ignore_ascii_case(name))
                    .map(|(_, v)| v.trim().to_owned())
            })
            .unwrap_or_default()
    };
    (field("grpc-status"), field("grpc-message"))
}

async fn task_count(server: &Server, token: Option<&str>) -> usize {
    sessions_with(server, token)
        .await
        .list_tasks(pb::ListTasksRequest::default())
        .await
        .unwrap()
        .into_inner()
        .tasks
        .len()
}

fn no_auth_server(dir: &std::path::Path, extra: &[&str]) -> Server {
    let mut args = vec!["--insecure-no-auth"];
    args.extend_from_slice(extra);
    start_with(&dir.join("data"), &args, None, None)
}

#[tokio::test]
async fn drive_by_from_a_foreign_origin_is_refused_preflight_and_call() {
    let dir = tempfile::tempdir().unwrap();
    // The README's first command: no token, default CORS.
    let server = no_auth_server(dir.path(), &[]);

    let preflight = format!(
        "OPTIONS /sessiond.v1.SessionService/CreateTask HTTP/1.1\r\nhost: {}\r\n\
         origin: https://evil.example\r\naccess-control-request-method: POST\r\n\
         access-control-request-headers: content-type,x-grpc-web\r\n\
         connection: close\r\n\r\n",
        server.addr
    );
    let r = http1(&server.addr, &preflight, &[]).await;
    assert_eq!(
        r.header("access-control-allow-origin"),
        None,
        "preflight allowed: {:?}",
        r.headers
    );

    // A page may still fire the POST (or a tool may replay it): refused.
    let create = pb::CreateTaskRequest {
        title: "drive-by".into(),
    }
    .encode_to_vec();
    let (head, body) = grpc_web_request_from(
        &server.addr,
        "https://evil.example",
        "/sessiond.v1.SessionService/CreateTask",
        None,
        &create,
    );
    let r = http1(&server.addr, &head, &body).await;
    let (status, message) = grpc_web_status(&r);
    assert_eq!(status, "7", "{:?} {message}", r.headers);
    assert!(
        message.contains("origin") && message.contains("cors.allowed_origins"),
        "{message}"
    );
    assert_eq!(task_count(&server, None).await, 0, "a task was written");
}

#[tokio::test]
async fn listed_origin_is_allowed_and_others_are_not() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(
        &dir.path().join("data"),
        &["--cors-allowed-origins", "https://console.example"],
    );
    let create = pb::CreateTaskRequest { title: "ok".into() }.encode_to_vec();
    for (origin, want) in [
        ("https://console.example", "0"),
        ("https://evil.example", "7"),
    ] {
        let (head, body) = grpc_web_request_from(
            &server.addr,
            origin,
            "/sessiond.v1.SessionService/CreateTask",
            Some(TOKEN),
            &create,
        );
        let r = http1(&server.addr, &head, &body).await;
        assert_eq!(grpc_web_status(&r).0, want, "{origin}: {:?}", r.headers);
    }
    assert_eq!(task_count(&server, Some(TOKEN)).await, 1);
}

#[tokio::test]
async fn dns_rebinding_host_is_refused_without_auth() {
    let dir = tempfile::tempdir().unwrap();
    let server = no_auth_server(dir.path(), &[]);
    let port = server.addr.rsplit_once(':').unwrap().1.to_owned();
    let list = pb::ListTasksRequest::default().encode_to_vec();
    let call = |host: String| {
        let body = {
            let mut b = vec![0u8];
            b.extend_from_slice(&(list.len() as u32).to_be_bytes());
            b.extend_from_slice(&list);
            b
        };
        let head = format!(
            "POST /sessiond.v1.SessionService/ListTasks HTTP/1.1\r\nhost: {host}\r\n\
             content-type: application/grpc-web+proto\r\nx-grpc-web: 1\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        );
        (head, body)
    };
    let (head, body) = call(format!("rebind.evil.example:{port}"));
    let r = http1(&server.addr, &head, &body).await;
    let (status, message) = grpc_web_status(&r);
    assert_eq!(status, "7", "{:?}", r.headers);
    assert!(
        message.contains("rebind.evil.example") && message.contains("loopback"),
        "{message}"
    );
    for host in [format!("localhost:{port}"), server.addr.clone()] {
        let (head, body) = call(host.clone());
        let r = http1(&server.addr, &head, &body).await;
        assert_eq!(grpc_web_status(&r).0, "0", "{host}: {:?}", r.headers);
    }
}

#[test]
fn insecure_no_auth_conflicts_with_tokens_and_with_any_origin() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().display().to_string();
    let (ok, stderr) = run_sessiond(
        &[
            "serve",
            "--insecure-no-auth",
            "--data-dir",
            &data,
            "--listen",
            "127.0.0.1:0",
        ],
        &[("SESSIOND_API_TOKENS", TOKEN)],
    );
    assert!(!ok);
    assert!(
        stderr.contains("auth.insecure_no_auth: conflicts with auth.tokens"),
        "{stderr}"
    );
    let (ok, stderr) = run_sessiond(
        &[
            "serve",
            "--insecure-no-auth",
            "--cors-allowed-origins",
            "*",
            "--data-dir",
            &data,
            "--listen",
            "127.0.0.1:0",
        ],
        &[],
    );
    assert!(!ok);
    assert!(
        stderr
            .contains("cors.allowed_origins: \"*\" is refused together with auth.insecure_no_auth"),
        "{stderr}"
    );
    assert!(
        !dir.path().join("sessiond.sqlite3").exists(),
        "a refused start wrote a database"
    );
}

#[tokio::test]
async fn tokens_on_the_command_line_draw_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("stderr.log");
    let mut server = start_with(
        &dir.path().join("data"),
        &["--api-tokens", TOKEN],
        None,
        Some(&log),
    );
    assert_eq!(task_count(&server, Some(TOKEN)).await, 0);
    server.terminate();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("--api-tokens puts the API tokens in the process list"),
        "{text}"
    );
    assert!(!text.contains(TOKEN), "the token was logged: {text}");
}

#[tokio::test]
async fn bearer_scheme_is_case_insensitive() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&dir.path().join("data"), &[]);
    for scheme in ["BEARER", "bearer", "BeArEr"] {
        let mut c = sessions_with(&server, None).await;
        let mut req = tonic::Request::new(pb::ListTasksRequest::default());
        req.metadata_mut().insert(
            "authorization",
            format!("{scheme} {TOKEN}").parse().unwrap(),
        );
        c.list_tasks(req)
            .await
            .unwrap_or_else(|e| panic!("{scheme}: {e}"));
    }
}

/// A huge id does not come back in the `grpc-message` header: its size is
/// refused by name (`bounds.rs`), and any message quoting client input is
/// cut (`error::bounded`).
#[tokio::test]
async fn oversized_ids_are_not_echoed() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&dir.path().join("data"), &[]);
    let mut c = sessions(&server).await;
    let huge = "x".repeat(100 * 1024);
    let err = c
        .get_task(pb::GetTaskRequest {
            task_id: huge.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    assert_eq!(
        err.message(),
        "task_id: 102400 bytes is longer than 128 bytes",
        "{} bytes",
        err.message().len()
    );
}

fn session_ref(task: &str, session: &str) -> Option<pb::SessionRef> {
    Some(pb::SessionRef {
        task_id: task.into(),
        session_id: session.into(),
    })
}

/// A server with one live demo session on `work`.
async fn with_session(
    dir: &std::path::Path,
) -> (Server, Sessions, Workspaces, pb::Task, pb::Session) {
    let work = dir.join("work");
    std::fs::create_dir_all(&work).unwrap();
    let server = start(&dir.join("data"), &[]);
    let mut c = sessions(&server).await;
    let w = workspaces(&server).await;
    let task = create_task(&mut c, "security").await;
    let s = create_session(&mut c, &task.id, &work, "").await;
    assert_eq!(s.state, pb::SessionState::WaitingForInput as i32, "{s:?}");
    (server, c, w, task, s)
}

/// Children of every thread of `pid` (the agent is spawned from a worker).
fn children(pid: u32) -> Vec<u32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
        .flat_map(|t| {
            std::fs::read_to_string(t.path().join("children"))
                .unwrap_or_default()
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

fn environ(pid: u32) -> String {
    String::from_utf8_lossy(&std::fs::read(format!("/proc/{pid}/environ")).unwrap())
        .replace('\0', "\n")
}

#[tokio::test]
async fn agentctl_agent_and_exec_get_none_of_sessiond_environment() {
    let dir = tempfile::tempdir().unwrap();
    let (server, _c, mut w, task, s) = with_session(dir.path()).await;
    let out = w
        .exec(pb::ExecRequest {
            session: session_ref(&task.id, &s.id),
            command: "env".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let env = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(env.contains("PATH="), "{env}");
    for leaked in [TOKEN, "SESSIOND_", "AGENTCTL_SECRET"] {
        assert!(!env.contains(leaked), "Exec sees {leaked}: {env}");
    }
    let agentctls = agentctl_pids(&server.data_dir);
    assert_eq!(agentctls.len(), 1, "{agentctls:?}");
    let agentctl_env = environ(agentctls[0]);
    assert!(!agentctl_env.contains(TOKEN), "{agentctl_env}");
    assert!(!agentctl_env.contains("SESSIOND_"), "{agentctl_env}");
    let agents = children(agentctls[0]);
    assert_eq!(agents.len(), 1, "the agent: {agents:?}");
    let agent_env = environ(agents[0]);
    for leaked in [TOKEN, "SESSIOND_", "AGENTCTL_SECRET"] {
        assert!(
            !agent_env.contains(leaked),
            "the agent sees {leaked}: {agent_env}"
        );
    }
    // The profile's own variables do reach it.
    assert!(agent_env.contains("ACP_DEMO_STATE_DIR="), "{agent_env}");
}

#[tokio::test]
async fn state_is_private_to_the_serving_user() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    // Left world-readable by an older version: tightened at start.
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(data.join("stale.txt"), "x").unwrap();
    std::fs::set_permissions(
        data.join("stale.txt"),
        std::fs::Permissions::from_mode(0o644),
    )
    .unwrap();
    let (server, mut c, _w, _task, _s) = with_session(dir.path()).await;
    // A write, so the WAL exists.
    create_task(&mut c, "wal").await;
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&data), 0o700);
    assert_eq!(mode(&data.join("stale.txt")), 0o600);
    for f in [
        "sessiond.sqlite3",
        "sessiond.sqlite3-wal",
        "sessiond.sqlite3-shm",
    ] {
        assert_eq!(mode(&data.join(f)), 0o600, "{f}");
    }
    for sub in ["run", "logs"] {
        assert_eq!(mode(&data.join(sub)), 0o700, "{sub}");
        for entry in std::fs::read_dir(data.join(sub)).unwrap().flatten() {
            if entry.file_type().unwrap().is_file() {
                assert_eq!(mode(&entry.path()), 0o600, "{}", entry.path().display());
            }
        }
    }
    assert!(std::fs::read_dir(data.join("logs")).unwrap().count() > 0);
    assert!(std::fs::read_dir(data.join("run")).unwrap().count() > 0);
    drop(server);
}

/// Whether any process's command line contains `needle`.
fn process_with(needle: &str) -> bool {
    std::fs::read_dir("/proc").unwrap().flatten().any(|e| {
        std::fs::read(e.path().join("cmdline"))
            .map(|c| {
                String::from_utf8_lossy(&c)
                    .replace('\0', " ")
                    .contains(needle)
            })
            .unwrap_or(false)
    })
}

/// Whether no process's command line contains `needle` within 5 s: a
/// SIGKILLed process leaves the process table asynchronously (on a loaded
/// machine, after the call has returned). A survivor — these sleep 30 s
/// and more — is still there.
async fn gone(needle: &str) -> bool {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while process_with(needle) {
        if std::time::Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    true
}

#[tokio::test]
async fn exec_is_bounded_by_its_timeout_even_when_children_escape() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, _c, mut w, task, s) = with_session(dir.path()).await;
    // Leaves the group and keeps stdout open; the call must still end at
    // the deadline, with the output so far, and the escapee must be gone.
    let marker = "31.4159";
    let started = std::time::Instant::now();
    let err = w
        .exec(pb::ExecRequest {
            session: session_ref(&task.id, &s.id),
            command: "sh".into(),
            args: vec![
                "-c".into(),
                // Both durations are unique on the machine: other tests'
                // agents run `sleep 600` of their own.
                format!("setsid sleep {marker} & echo started; sleep {marker}1"),
            ],
            timeout_ms: 2000,
            ..Default::default()
        })
        .await
        .unwrap_err();
    let took = started.elapsed();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err}");
    assert!(err.message().contains("2000 ms"), "{}", err.message());
    assert!(took < std::time::Duration::from_secs(10), "took {took:?}");
    let partial = pb::ExecResponse::decode(err.details()).unwrap();
    assert!(partial.timed_out);
    assert_eq!(partial.stdout, b"started\n");
    assert!(
        gone(&format!("sleep {marker}")).await,
        "the escaped child survived"
    );
    assert!(
        gone(&format!("sleep {marker}1")).await,
        "the command survived"
    );

    // The leader exits at once; its escapee (own session) holds stdout. It
    // carries the call's marker, so it is ended with the call: the call
    // answers with the leader's exit, not at its deadline (`timed_out`).
    let out = w
        .exec(pb::ExecRequest {
            session: session_ref(&task.id, &s.id),
            command: "sh".into(),
            // It waits until the escapee has left the group (its own
            // session), so the leader's exit cannot take it along.
            args: vec![
                "-c".into(),
                format!(
                    "setsid sh -c 'touch escaped; exec sleep {marker}2' & \
                     while [ ! -e escaped ]; do sleep 0.05; done; echo started"
                ),
            ],
            timeout_ms: 60_000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(out.exit_code, Some(0));
    assert!(!out.timed_out);
    assert_eq!(out.stdout, b"started\n");
    assert!(
        gone(&format!("sleep {marker}2")).await,
        "the escaped child survived"
    );

    for (timeout_ms, max_output_bytes, field) in [
        (u64::MAX, 0, "timeout_ms"),
        (400_000_000_000_000, 0, "timeout_ms"),
        (1000, u64::MAX, "max_output_bytes"),
    ] {
        let err = w
            .exec(pb::ExecRequest {
                session: session_ref(&task.id, &s.id),
                command: "true".into(),
                timeout_ms,
                max_output_bytes,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{err}");
        assert!(err.message().starts_with(field), "{}", err.message());
    }
}

#[tokio::test]
async fn git_runs_nothing_the_repository_configures() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, _c, mut w, task, s) = with_session(dir.path()).await;
    let work = dir.path().join("work");
    let git = |args: &[&str]| {
        let st = std::process::Command::new("git")
            .args(args)
            .current_dir(&work)
            .status()
            .unwrap();
        assert!(st.success(), "git {args:?}");
    };
    git(&["init", "-q", "-b", "main"]);
    std::fs::write(work.join("a.txt"), "one\n").unwrap();
    git(&["add", "a.txt"]);
    git(&[
        "-c",
        "user.name=t",
        "-c",
        "user.email=t@t",
        "commit",
        "-qm",
        "one",
    ]);
    std::fs::write(work.join("a.txt"), "two\n").unwrap();
    // What an agent could plant: commands in .git/config and attributes.
    let planted = dir.path().join("planted");
    let touch = |name: &str| format!("touch {}/{name}; cat", planted.display());
    std::fs::create_dir_all(&planted).unwrap();
    git(&["config", "core.fsmonitor", &touch("fsmonitor")]);
    git(&["config", "diff.external", &touch("external")]);
    git(&["config", "core.pager", &touch("pager")]);
    git(&["config", "filter.evil.clean", &touch("clean")]);
    git(&["config", "filter.evil.process", &touch("process")]);
    git(&["config", "diff.evil.textconv", &touch("textconv")]);
    std::fs::write(work.join(".gitattributes"), "* filter=evil diff=evil\n").unwrap();

    let status = w
        .git_status(pb::GitStatusRequest {
            session: session_ref(&task.id, &s.id),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(status.files.iter().any(|f| f.path == "a.txt"), "{status:?}");
    let diff = w
        .git_diff(pb::GitDiffRequest {
            session: session_ref(&task.id, &s.id),
            staged: false,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(diff.diff.contains("+two"), "{}", diff.diff);
    let ran: Vec<_> = std::fs::read_dir(&planted)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(
        ran.is_empty(),
        "repository-configured commands ran: {ran:?}"
    );
}

#[tokio::test]
async fn writes_through_hard_links_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, _c, mut w, task, s) = with_session(dir.path()).await;
    let outside = dir.path().join("outside.txt");
    std::fs::write(&outside, "precious\n").unwrap();
    std::fs::hard_link(&outside, dir.path().join("work/link.txt")).unwrap();
    let err = w
        .write_file(pb::WriteFileRequest {
            session: session_ref(&task.id, &s.id),
            path: "link.txt".into(),
            content: b"overwritten".to_vec(),
            create_parents: false,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err}");
    assert!(err.message().contains("hard link"), "{}", err.message());
    assert_eq!(std::fs::read_to_string(&outside).unwrap(), "precious\n");
}

#[tokio::test]
async fn titles_with_control_characters_are_refused_and_not_stored() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&dir.path().join("data"), &[]);
    let mut c = sessions(&server).await;
    // Control characters, and those that break the line or hide or reorder
    // the text (a right-to-left override, a line separator, a title of
    // zero-width spaces only).
    let bad = [
        "a\0b",
        "red \u{1b}[31m alert",
        "two\nlines",
        "bell\u{7}",
        "invoice \u{202E}fdp.exe",
        "two\u{2028}lines",
        "\u{200B}\u{200B}",
    ];
    for title in bad {
        let err = c
            .create_task(pb::CreateTaskRequest {
                title: title.into(),
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{title:?}: {err}");
        assert!(
            err.message().starts_with("title: contains the character"),
            "{}",
            err.message()
        );
    }
    assert_eq!(task_count(&server, Some(TOKEN)).await, 0);
}

#[tokio::test]
async fn worktrees_outside_the_roots_are_refused_and_nothing_is_stored() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&dir.path().join("data"), &[]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "roots").await;
    let tmp = std::fs::canonicalize(std::env::temp_dir()).unwrap();
    let escape = dir.path().join("work/escape");
    std::fs::create_dir_all(dir.path().join("work")).unwrap();
    std::os::unix::fs::symlink("/etc", &escape).unwrap();
    let up = format!("{}/../../etc", dir.path().display());
    let long = format!("{}/{}", tmp.display(), "x".repeat(5000));
    let file = dir.path().join("work/notes.txt");
    std::fs::write(&file, "a file").unwrap();
    let missing = dir.path().join("work/missing").display().to_string();
    for (path, expect) in [
        (
            missing,
            "No such file or directory (os error 2); create the directory first",
        ),
        (file.display().to_string(), "is not a directory"),
    ] {
        let err = c
            .create_session(in_directory(&task.id, &path))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::FailedPrecondition, "{path}: {err}");
        assert!(err.message().contains(expect), "{path}: {}", err.message());
        assert!(
            !err.message().contains("session"),
            "{path}: {}",
            err.message()
        );
    }
    for (path, expect) in [
        ("/".to_owned(), "outside executors.worktree_roots"),
        ("/etc".to_owned(), "outside executors.worktree_roots"),
        (up, "not normalised"),
        (escape.display().to_string(), "through a symlink"),
        (long, "longer than 4096 bytes"),
    ] {
        let err = c
            .create_session(pb::CreateSessionRequest {
                task_id: task.id.clone(),
                runtime: pb::Runtime::LocalStandalone as i32,
                worktree: Some(pb::Worktree {
                    id: String::new(),
                    path: path.clone(),
                    branch: String::new(),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{path}: {err}");
        assert!(err.message().contains(expect), "{path}: {}", err.message());
    }
    let listed = c
        .list_sessions(pb::ListSessionsRequest {
            task_id: task.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(listed.sessions.is_empty(), "{listed:?}");
    assert!(agentctl_pids(&server.data_dir).is_empty());
}

fn remote_request(task: &str, url: &str) -> pb::CreateSessionRequest {
    pb::CreateSessionRequest {
        task_id: task.into(),
        runtime: pb::Runtime::Remote as i32,
        worktree: Some(pb::Worktree {
            id: String::new(),
            path: "/srv/work".into(),
            branch: String::new(),
            ..Default::default()
        }),
        remote_url: url.into(),
        remote_secret: "remote-secret-0123456789".into(),
        remote_executor_id: "0190b6a4-8f43-7c5e-9a7b-3f1d2c4b5a69".into(),
        ..Default::default()
    }
}

#[tokio::test]
async fn remote_hosts_outside_the_allowed_list_are_refused_undialled_and_not_stored() {
    let dir = tempfile::tempdir().unwrap();
    // A listener on loopback that must never see a connection: the server
    // allows only 10.0.0.0/8 here, so even loopback is not dialled.
    let bait = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    bait.set_nonblocking(true).unwrap();
    let bait_url = format!("http://{}", bait.local_addr().unwrap());
    let server = start(
        &dir.path().join("data"),
        &["--remote-allowed-hosts", "10.0.0.0/8,agents.example.com"],
    );
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "ssrf").await;
    for url in [
        bait_url.as_str(),
        "http://169.254.169.254:80",
        "https://agents.example.com.evil.example:443",
        "http://[::1]:7000",
        "http://user@10.0.0.1:7000",
    ] {
        let err = c
            .create_session(remote_request(&task.id, url))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{url}: {err}");
        assert!(
            err.message().starts_with("remote_url:")
                && (err.message().contains("executors.remote.allowed_hosts")
                    || err.message().contains("user information")),
            "{url}: {}",
            err.message()
        );
    }
    assert!(
        bait.accept().is_err(),
        "sessiond dialled a host it does not allow"
    );
    let listed = c
        .list_sessions(pb::ListSessionsRequest {
            task_id: task.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(listed.sessions.is_empty(), "{listed:?}");

    // The default is loopback only.
    let server = start(&dir.path().join("data2"), &[]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "ssrf default").await;
    let err = c
        .create_session(remote_request(&task.id, "http://10.1.2.3:7000"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    assert!(
        err.message().contains("localhost, 127.0.0.0/8, ::1"),
        "{}",
        err.message()
    );
}

#[tokio::test]
async fn live_sessions_are_capped_and_nothing_is_stored_past_the_cap() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let server = start(&dir.path().join("data"), &["--max-live-sessions", "1"]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "cap").await;
    let first = create_session(&mut c, &task.id, &work, "").await;
    assert_eq!(first.state, pb::SessionState::WaitingForInput as i32);
    let request = pb::CreateSessionRequest {
        task_id: task.id.clone(),
        runtime: pb::Runtime::LocalStandalone as i32,
        worktree: Some(pb::Worktree {
            id: String::new(),
            path: work.display().to_string(),
            branch: String::new(),
            ..Default::default()
        }),
        ..Default::default()
    };
    let err = c.create_session(request.clone()).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
    assert!(
        err.message().contains("limits.max_live_sessions") && err.message().contains("of 1"),
        "{}",
        err.message()
    );
    assert_eq!(
        err.metadata()
            .get("sessiond-error")
            .and_then(|v| v.to_str().ok()),
        Some("limit_reached")
    );
    let listed = c
        .list_sessions(pb::ListSessionsRequest {
            task_id: task.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.sessions.len(), 1, "{listed:?}");
    assert_eq!(agentctl_pids(&server.data_dir).len(), 1);

    // Stopping the first frees its slot.
    c.stop_session(pb::StopSessionRequest {
        task_id: task.id.clone(),
        session_id: first.id.clone(),
        outcome: pb::StopOutcome::Completed as i32,
    })
    .await
    .unwrap();
    let second = c.create_session(request).await.unwrap().into_inner();
    assert_eq!(
        second.session.unwrap().state,
        pb::SessionState::WaitingForInput as i32
    );
}

#[tokio::test]
async fn watch_streams_are_capped_globally_and_per_token() {
    const OTHER: &str = "other-token-0123456789abcdef";
    let dir = tempfile::tempdir().unwrap();
    let both = format!("{TOKEN},{OTHER}");
    let server = start_with(
        &dir.path().join("data"),
        &[
            "--max-watch-streams",
            "3",
            "--max-watch-streams-per-token",
            "2",
        ],
        Some(&both),
        None,
    );
    let mut a = sessions_with(&server, Some(TOKEN)).await;
    let mut b = sessions_with(&server, Some(OTHER)).await;
    let task = create_task(&mut a, "watch").await;
    let watch = |task: &str| pb::WatchTaskRequest {
        task_id: task.into(),
        after_task_seq: 0,
    };
    let a1 = a.watch_task(watch(&task.id)).await.unwrap().into_inner();
    let _a2 = a.watch_task(watch(&task.id)).await.unwrap().into_inner();
    let err = a.watch_task(watch(&task.id)).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
    assert!(
        err.message().contains("limits.max_watch_streams_per_token"),
        "{}",
        err.message()
    );
    let _b1 = b.watch_task(watch(&task.id)).await.unwrap().into_inner();
    let err = b.watch_task(watch(&task.id)).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
    assert!(
        err.message().contains("(limits.max_watch_streams)"),
        "{}",
        err.message()
    );
    // A client that goes away frees its slot (the server sees the reset).
    drop(a1);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        match b.watch_task(watch(&task.id)).await {
            Ok(_) => break,
            Err(e) if e.code() == Code::ResourceExhausted => {
                assert!(std::time::Instant::now() < deadline, "slot not freed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            Err(e) => panic!("{e}"),
        }
    }
}

#[tokio::test]
async fn over_long_paths_and_arguments_are_invalid_argument() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, _c, mut w, task, s) = with_session(dir.path()).await;
    let r = || session_ref(&task.id, &s.id);
    let long_path = "a/".repeat(2100);
    let long_name = "n".repeat(300);
    let read = w
        .read_file(pb::ReadFileRequest {
            session: r(),
            path: long_path.clone(),
        })
        .await
        .unwrap_err();
    let write = w
        .write_file(pb::WriteFileRequest {
            session: r(),
            path: format!("dir/{long_name}"),
            content: b"x".to_vec(),
            create_parents: true,
        })
        .await
        .unwrap_err();
    let list = w
        .list_dir(pb::ListDirRequest {
            session: r(),
            path: long_name.clone(),
        })
        .await
        .unwrap_err();
    let exec = |command: &str, args: Vec<String>, cwd: &str| pb::ExecRequest {
        session: r(),
        command: command.into(),
        args,
        cwd: cwd.into(),
        ..Default::default()
    };
    let big_arg = w
        .exec(exec("echo", vec!["x".repeat(200 * 1024)], ""))
        .await
        .unwrap_err();
    let many_args = w
        .exec(exec("echo", vec!["x".into(); 5000], ""))
        .await
        .unwrap_err();
    let long_cwd = w.exec(exec("pwd", vec![], &long_path)).await.unwrap_err();
    let long_command = w
        .exec(exec(&"c".repeat(5000), vec![], ""))
        .await
        .unwrap_err();
    for (err, field) in [
        (read, "path: "),
        (write, "path: a component of 300 bytes"),
        (list, "path: a component"),
        (big_arg, "args[0]: "),
        (many_args, "args: 5000 arguments"),
        (long_cwd, "cwd: "),
        (long_command, "command: "),
    ] {
        assert_eq!(err.code(), Code::InvalidArgument, "{field}: {err}");
        assert!(
            err.message().starts_with(field),
            "{field}: {}",
            err.message()
        );
    }
    assert!(
        !dir.path().join("work/dir").exists(),
        "a directory was made"
    );
}

#[tokio::test]
async fn numeric_fields_are_range_checked() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, mut c, mut w, task, s) = with_session(dir.path()).await;
    let mut errors: Vec<(&str, tonic::Status)> = Vec::new();
    for page_size in [-1, 1001, i32::MIN, i32::MAX] {
        errors.push((
            "page_size",
            c.list_tasks(pb::ListTasksRequest {
                page_size,
                ..Default::default()
            })
            .await
            .unwrap_err(),
        ));
    }
    errors.push((
        "after_seq",
        c.list_messages(pb::ListMessagesRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
            after_seq: i64::MIN,
            page_size: 0,
        })
        .await
        .unwrap_err(),
    ));
    errors.push((
        "page_size",
        c.list_messages(pb::ListMessagesRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
            after_seq: 0,
            page_size: -5,
        })
        .await
        .unwrap_err(),
    ));
    errors.push((
        "after_seq",
        c.watch_session(pb::WatchSessionRequest {
            session_id: s.id.clone(),
            after_seq: -1,
        })
        .await
        .map(|_| ())
        .unwrap_err(),
    ));
    errors.push((
        "after_task_seq",
        c.watch_task(pb::WatchTaskRequest {
            task_id: task.id.clone(),
            after_task_seq: -1,
        })
        .await
        .map(|_| ())
        .unwrap_err(),
    ));
    errors.push((
        "outcome",
        c.stop_session(pb::StopSessionRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
            outcome: 99,
        })
        .await
        .unwrap_err(),
    ));
    errors.push((
        "runtime",
        c.create_session(pb::CreateSessionRequest {
            task_id: task.id.clone(),
            runtime: 99,
            ..Default::default()
        })
        .await
        .unwrap_err(),
    ));
    for (timeout_ms, max_output_bytes, field) in [
        (u64::MAX, 0, "timeout_ms"),
        (400_000_000_000_000, 0, "timeout_ms"),
        (1000, u64::MAX, "max_output_bytes"),
    ] {
        errors.push((
            field,
            w.exec(pb::ExecRequest {
                session: session_ref(&task.id, &s.id),
                command: "true".into(),
                timeout_ms,
                max_output_bytes,
                ..Default::default()
            })
            .await
            .unwrap_err(),
        ));
    }
    for (field, err) in errors {
        assert_eq!(err.code(), Code::InvalidArgument, "{field}: {err}");
        assert!(err.message().contains(field), "{field}: {}", err.message());
    }
    // The session is untouched.
    let status = c
        .get_session(pb::GetSessionRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .session
        .unwrap();
    assert_eq!(status.state, pb::SessionState::WaitingForInput as i32);
}

#[tokio::test]
async fn a_symlinked_directory_leading_outside_is_refused_for_read_and_write() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, _c, mut w, task, s) = with_session(dir.path()).await;
    let outside = dir.path().join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("secret"), "precious\n").unwrap();
    std::os::unix::fs::symlink(&outside, dir.path().join("work/sub")).unwrap();
    let read = w
        .read_file(pb::ReadFileRequest {
            session: session_ref(&task.id, &s.id),
            path: "sub/secret".into(),
        })
        .await
        .unwrap_err();
    let overwrite = w
        .write_file(pb::WriteFileRequest {
            session: session_ref(&task.id, &s.id),
            path: "sub/secret".into(),
            content: b"overwritten".to_vec(),
            create_parents: false,
        })
        .await
        .unwrap_err();
    let create = w
        .write_file(pb::WriteFileRequest {
            session: session_ref(&task.id, &s.id),
            path: "sub/deeper/new".into(),
            content: b"new".to_vec(),
            create_parents: true,
        })
        .await
        .unwrap_err();
    for (what, err) in [("read", read), ("overwrite", overwrite), ("create", create)] {
        assert_eq!(err.code(), Code::PermissionDenied, "{what}: {err}");
        assert!(
            err.message().contains("outside the workspace"),
            "{what}: {}",
            err.message()
        );
    }
    assert_eq!(
        std::fs::read_to_string(outside.join("secret")).unwrap(),
        "precious\n"
    );
    assert!(
        !outside.join("deeper").exists(),
        "a directory was made outside"
    );
}

/// Certificates made for one test with the `openssl` CLI: a CA, agentctl's
/// server certificate (127.0.0.1, localhost) and sessiond's client
/// certificate signed by it, and an unrelated CA.
pub(crate) struct Pki {
    dir: std::path::PathBuf,
}

impl Pki {
    pub(crate) fn path(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }

    pub(crate) fn new(dir: &std::path::Path) -> Pki {
        let dir = dir.join("pki");
        std::fs::create_dir_all(&dir).unwrap();
        let run = |args: &[&str]| {
            let out = std::process::Command::new("openssl")
                .args(args)
                .current_dir(&dir)
                .output()
                .expect("the openssl CLI (apt-get install openssl)");
            assert!(
                out.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let key = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
        ];
        for ca in ["ca", "other-ca"] {
            let mut args = vec!["req", "-x509"];
            args.extend(key);
            let (k, c, subj) = (
                format!("{ca}.key"),
                format!("{ca}.pem"),
                format!("/CN={ca}"),
            );
            args.extend(["-keyout", &k, "-out", &c, "-days", "2", "-subj", &subj]);
            run(&args);
        }
        for (name, usage) in [("server", "serverAuth"), ("client", "clientAuth")] {
            std::fs::write(
                dir.join(format!("{name}.ext")),
                format!(
                    "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n\
                     keyUsage=critical,digitalSignature\nextendedKeyUsage={usage}\n"
                ),
            )
            .unwrap();
            let mut args = vec!["req"];
            args.extend(key);
            let (k, csr, subj) = (
                format!("{name}.key"),
                format!("{name}.csr"),
                format!("/CN={name}"),
            );
            args.extend(["-keyout", &k, "-out", &csr, "-subj", &subj]);
            run(&args);
            let (pem, ext) = (format!("{name}.pem"), format!("{name}.ext"));
            run(&[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &pem,
                "-days",
                "2",
                "-extfile",
                &ext,
            ]);
        }
        Pki { dir }
    }
}

/// A remote agentctl serving TLS on loopback (requiring a client
/// certificate from `ca.pem`), as a remote host's operator would run it.
struct RemoteAgentctl {
    child: std::process::Child,
    url: String,
    executor_id: String,
    secret: String,
    workspace: std::path::PathBuf,
}

impl Drop for RemoteAgentctl {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn remote_agentctl_tls(dir: &std::path::Path, pki: &Pki) -> RemoteAgentctl {
    use std::io::BufRead;
    let workspace = dir.join("remote-work");
    std::fs::create_dir_all(&workspace).unwrap();
    let executor_id = "0190b6a4-8f43-7c5e-9a7b-3f1d2c4b5a70".to_owned();
    let secret = "remote-tls-secret-0123456789".to_owned();
    let mut child = std::process::Command::new(bin("agentctl"))
        .args(["--executor-id", &executor_id, "--listen", "127.0.0.1:0"])
        .arg("--workspace")
        .arg(&workspace)
        .args(["--idle-timeout", "0"])
        .arg("--journal")
        .arg(dir.join("remote.journal"))
        .args(["--tls-cert", &pki.path("server.pem")])
        .args(["--tls-key", &pki.path("server.key")])
        .args(["--tls-client-ca", &pki.path("ca.pem")])
        .env("AGENTCTL_SECRET", &secret)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("agentctl listening on ")
        .unwrap_or_else(|| panic!("{line:?}"))
        .to_owned();
    RemoteAgentctl {
        child,
        url: format!("https://{addr}"),
        executor_id,
        secret,
        workspace,
    }
}

fn tls_remote_request(task: &str, remote: &RemoteAgentctl) -> pb::CreateSessionRequest {
    pb::CreateSessionRequest {
        task_id: task.into(),
        runtime: pb::Runtime::Remote as i32,
        worktree: Some(pb::Worktree {
            id: String::new(),
            path: remote.workspace.display().to_string(),
            branch: String::new(),
            ..Default::default()
        }),
        remote_url: remote.url.clone(),
        remote_secret: remote.secret.clone(),
        remote_executor_id: remote.executor_id.clone(),
        ..Default::default()
    }
}

/// sessiond's configuration for TLS to remote agentctls.
fn tls_config_file(dir: &std::path::Path, pki: &Pki, ca: &str, client_cert: bool) -> String {
    let path = dir.join(format!("tls-{ca}-{client_cert}.toml"));
    let mut text = format!(
        "[executors.remote]\ntls_ca_file = \"{}\"\n",
        pki.path(&format!("{ca}.pem"))
    );
    if client_cert {
        text.push_str(&format!(
            "tls_client_cert_file = \"{}\"\ntls_client_key_file = \"{}\"\n",
            pki.path("client.pem"),
            pki.path("client.key")
        ));
    }
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

#[tokio::test]
async fn remote_session_over_tls_survives_kill_9_and_recovers_over_tls() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let remote = remote_agentctl_tls(dir.path(), &pki);
    let config = tls_config_file(dir.path(), &pki, "ca", true);
    let data = dir.path().join("data");
    let mut server = start(&data, &["--config", &config]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "tls").await;
    let s = c
        .create_session(tls_remote_request(&task.id, &remote))
        .await
        .unwrap()
        .into_inner()
        .session
        .unwrap();
    assert_eq!(
        s.state,
        pb::SessionState::WaitingForInput as i32,
        "{:?}",
        s.error_message
    );
    let first = prompt(&mut c, &task.id, &s.id, "over tls").await;
    assert!(first.contains("turn 1"), "{first}");

    server.kill();
    let server = start(&data, &["--config", &config]);
    crate::restart::wait_serving(&server).await;
    let mut c = sessions(&server).await;
    let status = c
        .get_session_status(pb::GetSessionStatusRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        status.executor_status,
        pb::ExecutorStatus::Ready as i32,
        "{status:?}"
    );
    assert!(status.is_agent_running, "{status:?}");
    // The same conversation, reached again over TLS.
    let second = prompt(&mut c, &task.id, &s.id, "again").await;
    assert!(second.contains("turn 2"), "{second}");
    // And the workspace calls go through it too.
    let mut w = workspaces(&server).await;
    let out = w
        .exec(pb::ExecRequest {
            session: session_ref(&task.id, &s.id),
            command: "pwd".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        std::fs::canonicalize(&remote.workspace)
            .unwrap()
            .display()
            .to_string()
    );
}

#[tokio::test]
async fn remote_tls_with_a_wrong_ca_or_no_client_certificate_is_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let remote = remote_agentctl_tls(dir.path(), &pki);
    for (ca, client_cert, expect) in [
        ("other-ca", true, "UnknownIssuer"),
        ("ca", false, "client certificate"),
    ] {
        let config = tls_config_file(dir.path(), &pki, ca, client_cert);
        let server = start(
            &dir.path().join(format!("data-{ca}-{client_cert}")),
            &["--config", &config],
        );
        let mut c = sessions(&server).await;
        let task = create_task(&mut c, "bad tls").await;
        let started = std::time::Instant::now();
        let s = c
            .create_session(tls_remote_request(&task.id, &remote))
            .await
            .unwrap()
            .into_inner()
            .session
            .unwrap();
        let message = s.error_message.clone();
        assert_eq!(s.state, pb::SessionState::Error as i32, "{ca}: {s:?}");
        assert!(
            message.contains("TLS with agentctl") && message.contains(expect),
            "{ca} {client_cert}: {message}"
        );
        // Refused at once, not retried until the launch deadline.
        assert!(
            started.elapsed() < std::time::Duration::from_secs(30),
            "{ca}: took {:?}",
            started.elapsed()
        );
    }
}

#[tokio::test]
async fn the_public_port_serves_grpc_over_tls_and_offers_http2() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let server = start(
        &dir.path().join("data"),
        &[
            "--tls-cert",
            &pki.path("server.pem"),
            "--tls-key",
            &pki.path("server.key"),
        ],
    );
    let port = server.addr.rsplit_once(':').unwrap().1.to_owned();
    let ca = std::fs::read(pki.path("ca.pem")).unwrap();
    let channel = tonic::transport::Channel::from_shared(format!("https://localhost:{port}"))
        .unwrap()
        .tls_config(
            tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(&ca)),
        )
        .unwrap()
        .connect()
        .await
        .unwrap();
    let token: tonic::metadata::MetadataValue<_> = format!("Bearer {TOKEN}").parse().unwrap();
    let mut c = sessiond_proto::sessiond::v1::session_service_client::SessionServiceClient::with_interceptor(
        channel,
        move |mut r: tonic::Request<()>| {
            r.metadata_mut().insert("authorization", token.clone());
            Ok(r)
        },
    );
    let task = c
        .create_task(pb::CreateTaskRequest {
            title: "over tls".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .task
        .unwrap();
    assert_eq!(task.title, "over tls");
    // Plain text is not served on a TLS port.
    let plain = tonic::transport::Channel::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect()
        .await;
    if let Ok(ch) = plain {
        let r = sessiond_proto::sessiond::v1::session_service_client::SessionServiceClient::new(ch)
            .list_tasks(pb::ListTasksRequest::default())
            .await;
        assert!(r.is_err(), "plain text answered: {r:?}");
    }
    // A browser offering h2 and http/1.1 gets h2 (no 6-connection limit).
    let out = std::process::Command::new("openssl")
        .args(["s_client", "-connect", &format!("127.0.0.1:{port}")])
        .args(["-alpn", "h2,http/1.1", "-CAfile", &pki.path("ca.pem")])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("ALPN protocol: h2"), "{text}");
    assert!(text.contains("Verify return code: 0 (ok)"), "{text}");
}

/// Waits until the server closes `stream` (EOF or reset); the outer bound
/// only keeps a failing test from hanging.
async fn closed_by_server(name: &str, mut stream: tokio::net::TcpStream) {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(std::time::Duration::from_secs(30), stream.read(&mut buf))
        .await
        .unwrap_or_else(|_| panic!("{name}: still open after 30 s"));
    assert!(matches!(read, Ok(0) | Err(_)), "{name}: {read:?}");
}

/// Slowloris on the API port: a connection that never sends anything, or
/// (with TLS) never finishes its ClientHello, is closed once
/// `handshake_timeout` has passed, while real clients are served beside it.
#[tokio::test]
async fn connections_that_never_speak_are_closed() {
    use std::time::{Duration, Instant};
    use tokio::{io::AsyncWriteExt, net::TcpStream};
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let plain = start(&dir.path().join("plain"), &["--handshake-timeout", "1s"]);
    let tls = start(
        &dir.path().join("tls"),
        &[
            "--tls-cert",
            &pki.path("server.pem"),
            "--tls-key",
            &pki.path("server.key"),
            "--handshake-timeout",
            "1s",
        ],
    );
    let opened = Instant::now();
    let plain_silent = TcpStream::connect(&plain.addr).await.unwrap();
    let tls_silent = TcpStream::connect(&tls.addr).await.unwrap();
    let mut tls_partial = TcpStream::connect(&tls.addr).await.unwrap();
    // The first bytes of a TLS record header (handshake, TLS 1.0), no more.
    tls_partial.write_all(&[0x16, 0x03, 0x01]).await.unwrap();
    // A client that speaks is served meanwhile, and after the timeout.
    let mut c = sessions(&plain).await;
    create_task(&mut c, "served").await;
    closed_by_server("plain, silent", plain_silent).await;
    closed_by_server("tls, silent", tls_silent).await;
    closed_by_server("tls, partial ClientHello", tls_partial).await;
    assert!(
        opened.elapsed() >= Duration::from_millis(900),
        "closed before the timeout: {:?}",
        opened.elapsed()
    );
    create_task(&mut c, "still served").await;
}

/// Slowloris inside a request: an authenticated gRPC-web call whose body
/// stops after its first bytes is ended once `request_body_timeout` passes
/// (the server answers and the connection does not stay held), while other
/// calls are served beside it.
#[tokio::test]
async fn a_request_whose_body_stalls_is_ended() {
    use std::time::{Duration, Instant};
    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::TcpStream,
    };
    let dir = tempfile::tempdir().unwrap();
    let server = start(&dir.path().join("data"), &["--request-body-timeout", "1s"]);
    let mut stalled = TcpStream::connect(&server.addr).await.unwrap();
    let head = format!(
        "POST /sessiond.v1.SessionService/CreateTask HTTP/1.1\r\nhost: {}\r\n\
         content-type: application/grpc-web+proto\r\nx-grpc-web: 1\r\n\
         authorization: Bearer {TOKEN}\r\ncontent-length: 100\r\n\r\n",
        server.addr
    );
    stalled.write_all(head.as_bytes()).await.unwrap();
    // The gRPC frame header says 95 bytes follow; 3 of them come.
    stalled
        .write_all(&[0, 0, 0, 0, 95, 10, 1, b'x'])
        .await
        .unwrap();
    let sent = Instant::now();
    let mut c = sessions(&server).await;
    create_task(&mut c, "served beside it").await;
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(Duration::from_secs(30), stalled.read(&mut buf))
            .await
            .expect("the stalled request is still held after 30 s")
        {
            Ok(0) | Err(_) => break,
            Ok(n) => answer.extend_from_slice(&buf[..n]),
        }
    }
    assert!(
        sent.elapsed() >= Duration::from_millis(900),
        "ended before the timeout: {:?}",
        sent.elapsed()
    );
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 "),
        "{answer}"
    );
    create_task(&mut c, "still served").await;
}

/// Starts `sessiond serve` with exactly `args` (after `serve`), stderr to
/// `log`; returns once it listens. Warnings of the start are logged before
/// the listening line, so they are in `log` by then.
fn start_logged(data_dir: &std::path::Path, args: &[&str], log: &std::path::Path) -> Server {
    use std::io::BufRead;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_sessiond"))
        .arg("serve")
        .args(["--listen", "127.0.0.1:0", "--data-dir"])
        .arg(data_dir)
        .args(args)
        .env("SESSIOND_API_TOKENS", TOKEN)
        .env_remove("SESSIOND_DATABASE_URL")
        .env_remove("SESSIOND_CONFIG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("sessiond listening on ")
        .unwrap_or_else(|| panic!("{line:?}: {}", std::fs::read_to_string(log).unwrap()))
        .to_owned();
    Server {
        child: Some(child),
        addr,
        metrics: None,
        data_dir: data_dir.to_owned(),
    }
}

/// A metrics endpoint reachable from other hosts (it has no authentication)
/// and a TLS private key other local users can read start with a WARN
/// naming the key and what to do; loopback metrics and a 0600 key do not.
#[tokio::test]
async fn exposed_metrics_and_a_readable_tls_key_draw_a_warning() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let key = pki.path("server.key");
    let tls = ["--tls-cert", &pki.path("server.pem"), "--tls-key", &key];
    let warned = |log: &std::path::Path| {
        let text = std::fs::read_to_string(log).unwrap();
        (
            text.lines()
                .any(|l| l.contains("WARN") && l.contains("metrics.listen 0.0.0.0:")),
            text.lines()
                .any(|l| l.contains("WARN") && l.contains("tls.key_file") && l.contains("644")),
        )
    };

    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let log = dir.path().join("exposed.log");
    let exposed = [&tls[..], &["--metrics-listen", "0.0.0.0:0"]].concat();
    let server = start_logged(&dir.path().join("exposed"), &exposed, &log);
    assert_eq!(
        warned(&log),
        (true, true),
        "{}",
        std::fs::read_to_string(&log).unwrap()
    );
    drop(server);

    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    let log = dir.path().join("private.log");
    let private = [&tls[..], &["--metrics-listen", "127.0.0.1:0"]].concat();
    let server = start_logged(&dir.path().join("private"), &private, &log);
    assert_eq!(
        warned(&log),
        (false, false),
        "{}",
        std::fs::read_to_string(&log).unwrap()
    );
    drop(server);
}

/// Allow-lists that amount to "any host" are start errors naming the key,
/// however they are spelled; `/0` and `*` already were.
#[tokio::test]
async fn allow_lists_that_allow_any_host_are_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    for (list, says) in [
        ("0.0.0.0/1,128.0.0.0/1", "together allow every IPv4 address"),
        ("*.com", "top-level domain"),
        ("::ffff:0.0.0.0/96", "every IPv4 address"),
    ] {
        let (ok, stderr) = run_sessiond(
            &[
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "off",
                "--data-dir",
                dir.path().join("data").to_str().unwrap(),
                "--remote-allowed-hosts",
                list,
            ],
            &[("SESSIOND_API_TOKENS", TOKEN)],
        );
        assert!(!ok, "{list}: started");
        assert!(
            stderr.contains("executors.remote.allowed_hosts") && stderr.contains(says),
            "{list}: {stderr}"
        );
    }
}
