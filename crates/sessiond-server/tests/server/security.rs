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

#[tokio::test]
async fn malformed_ids_are_echoed_truncated() {
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
    assert!(err.message().len() < 2048, "{} bytes", err.message().len());
    assert!(err.message().contains("truncated"), "{}", err.message());
}
