//! The README's run command, for real: `sessiond serve` on a fresh data
//! directory creates the SQLite database and answers a gRPC health check.

use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    time::Duration,
};

use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};
use tonic_reflection::pb::v1::{
    ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
    server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
};

struct Server {
    child: Child,
    addr: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(data_dir: &std::path::Path) -> Server {
    let mut child = Command::new(env!("CARGO_BIN_EXE_sessiond"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--insecure-no-auth",
            "--metrics-listen",
            "off",
            "--data-dir",
        ])
        .arg(data_dir)
        .env_remove("SESSIOND_DATABASE_URL")
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn sessiond");
    let stdout = child.stdout.take().expect("stdout");
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("read the listening line");
    let addr = line
        .trim()
        .strip_prefix("sessiond listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();
    Server { child, addr }
}

async fn channel(server: &Server) -> tonic::transport::Channel {
    tonic::transport::Channel::from_shared(format!("http://{}", server.addr))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// The status once startup recovery's first pass is done (NOT_SERVING
/// until then).
async fn serving_status(server: &Server) -> i32 {
    let mut health = HealthClient::new(channel(server).await);
    let mut watch = health
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    loop {
        let status = tokio::time::timeout(Duration::from_secs(30), watch.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
            .status;
        if status != ServingStatus::NotServing as i32 {
            return status;
        }
    }
}

#[tokio::test]
async fn serve_creates_sqlite_database_and_reports_serving() {
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("data");
    let server = start(&data_dir);
    assert!(
        data_dir.join("sessiond.sqlite3").exists(),
        "the SQLite database was not created"
    );

    assert_eq!(serving_status(&server).await, ServingStatus::Serving as i32);

    let mut reflection = ServerReflectionClient::new(channel(&server).await);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = reflection
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let response = tokio::time::timeout(Duration::from_secs(5), responses.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = response.message_response else {
        panic!("unexpected reflection answer {response:?}");
    };
    let names: Vec<_> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        names.iter().any(|n| n == "grpc.health.v1.Health"),
        "{names:?}"
    );
    assert!(
        names.iter().any(|n| n == "sessiond.v1.SessionService"),
        "{names:?}"
    );
}

#[tokio::test]
async fn restart_reuses_the_same_database() {
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("data");
    drop(start(&data_dir));
    let server = start(&data_dir);
    assert_eq!(serving_status(&server).await, ServingStatus::Serving as i32);
}

#[test]
fn empty_database_url_is_rejected_naming_the_key() {
    let out = Command::new(env!("CARGO_BIN_EXE_sessiond"))
        .args([
            "migrate",
            "--data-dir",
            "/nonexistent-unused",
            "--database-url",
            " ",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("database_url"), "{stderr}");
}

/// helper-50 3: a mistyped PostgreSQL URL served on a new, empty SQLite
/// file of that name (and an unsupported scheme left directories behind):
/// both are configuration errors naming the key, and nothing is created.
#[test]
fn a_mistyped_database_url_is_refused_and_creates_nothing() {
    for url in [
        "postgres//db.example/sessiond",
        "postgres:/x@y/z",
        "mysql://x@y/z",
    ] {
        let dir = tempfile::tempdir().unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_sessiond"))
            .current_dir(dir.path())
            .args(["serve", "--insecure-no-auth", "--listen", "127.0.0.1:0"])
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .args(["--database-url", url])
            .env_remove("SESSIOND_API_TOKENS")
            .env_remove("SESSIOND_CONFIG")
            .output()
            .unwrap();
        assert!(!out.status.success(), "{url}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("database_url"), "{url}: {stderr}");
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert!(left.is_empty(), "{url}: created {left:?}");
    }
}

/// Logs written to a file (not a terminal) carry no ANSI colour codes.
#[test]
fn logs_to_a_file_have_no_colour_codes() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("sessiond.log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_sessiond"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--insecure-no-auth",
            "--metrics-listen",
            "off",
            "--data-dir",
        ])
        .arg(dir.path().join("data"))
        .env_remove("SESSIOND_DATABASE_URL")
        .env_remove("SESSIOND_LOG_JSON")
        .env("SESSIOND_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("spawn sessiond");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    // "accepting calls" is logged right after the listening line; wait for it.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let text = loop {
        let text = std::fs::read_to_string(&log).unwrap();
        if text.contains("accepting calls") || std::time::Instant::now() > deadline {
            break text;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = child.kill();
    let _ = child.wait();
    assert!(text.contains("accepting calls"), "{text}");
    assert!(
        !text.contains('\u{1b}'),
        "colour codes in a log file: {text:?}"
    );
}
