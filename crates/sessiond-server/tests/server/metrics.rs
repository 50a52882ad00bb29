//! The metrics endpoint as an operator and an orchestrator see it: hyper
//! serving `/metrics`, `/livez` and `/readyz`, bounded and not leaking
//! connections, and an exposition that Prometheus' own parser (`promtool`)
//! accepts.

use std::{io::Write, path::Path, process::Command, time::Duration};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::*;

/// One `GET` on a fresh connection; the status line and the body.
pub async fn http_get(addr: &str, path: &str) -> (String, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    let status = head.lines().next().unwrap_or_default().to_owned();
    (status, body.to_owned())
}

/// `promtool check metrics` on `text`; panics with its output when it
/// rejects the exposition (or is missing: `cargo xtask ci` installs it).
pub fn promtool_check_metrics(text: &str) {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool not found: install Debian's `prometheus` package (cargo xtask ci does)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics rejected the exposition:\n{}{}\n---\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

fn config_file(dir: &Path, body: &str) -> String {
    let path = dir.join("sessiond.toml");
    std::fs::write(&path, body).unwrap();
    path.display().to_string()
}

/// Polls `cond` every 100 ms until it holds or `limit` passes.
async fn eventually(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    while tokio::time::Instant::now() < deadline {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cond()
}

/// 1,000 clients connect and say nothing: `/metrics` still answers at once
/// (each is served on its own task, up to `metrics.max_connections`), and
/// the server closes the silent ones after `metrics.idle_timeout` while the
/// clients still hold them: its open descriptors fall back to where they
/// were, so idle connections leak no task and no socket.
#[tokio::test]
async fn metrics_answer_beside_1000_idle_connections_which_are_then_closed() {
    let dir = tempfile::tempdir().unwrap();
    let config = config_file(
        dir.path(),
        "[metrics]\nmax_connections = 1500\nidle_timeout = \"2s\"\n",
    );
    let server = start(&dir.path().join("data"), &["--config", &config]);
    let metrics = server.metrics.clone().unwrap();
    let pid = server.child.as_ref().unwrap().id();

    // Ready once startup recovery is done (nothing to recover here).
    let mut ready = false;
    for _ in 0..600 {
        if http_get(&metrics, "/readyz").await.0.contains(" 200") {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ready, "/readyz never turned 200");
    let baseline = open_fds(pid);

    let mut idle = Vec::with_capacity(1000);
    for _ in 0..1000 {
        idle.push(tokio::net::TcpStream::connect(&metrics).await.unwrap());
    }
    let (status, body) = http_get(&metrics, "/metrics").await;
    assert!(status.contains(" 200"), "{status}");
    assert!(body.contains("sessiond_recovery_done 1"), "{body}");
    let (status, _) = http_get(&metrics, "/livez").await;
    assert!(status.contains(" 200"), "{status}");
    assert!(
        open_fds(pid) >= baseline + 900,
        "the idle connections were not accepted: {} fds, baseline {baseline}",
        open_fds(pid)
    );

    // The server hangs up on them (hyper's header-read timeout): we still
    // hold our ends, so only the server side can have closed.
    assert!(
        eventually(Duration::from_secs(120), || open_fds(pid) <= baseline + 10).await,
        "idle connections not closed by the server: {} fds open, baseline {baseline}",
        open_fds(pid)
    );
    let (status, _) = http_get(&metrics, "/metrics").await;
    assert!(status.contains(" 200"), "{status}");
    drop(idle);
}

/// The exposition after real calls parses with Prometheus' own parser,
/// and the probes answer as an orchestrator expects.
#[tokio::test]
async fn exposition_passes_promtool_and_probes_answer() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&dir.path().join("data"), &[]);
    let metrics = server.metrics.clone().unwrap();
    let mut c = sessions(&server).await;
    create_task(&mut c, "scraped").await;
    let mut ready = false;
    for _ in 0..600 {
        if http_get(&metrics, "/readyz").await.0.contains(" 200") {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ready, "/readyz never turned 200");
    let (status, text) = http_get(&metrics, "/metrics").await;
    assert!(status.contains(" 200"), "{status}");
    assert!(
        text.contains("method=\"/sessiond.v1.SessionService/CreateTask\",code=\"OK\""),
        "{text}"
    );
    promtool_check_metrics(&text);
    let (status, _) = http_get(&metrics, "/nope").await;
    assert!(status.contains(" 404"), "{status}");
}
