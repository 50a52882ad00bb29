//! The metrics endpoint as an operator and an orchestrator see it: hyper
//! serving `/metrics`, `/livez` and `/readyz`, bounded and not leaking
//! connections, and an exposition that Prometheus' own parser (`promtool`)
//! accepts.

use std::{io::Write, path::Path, process::Command, time::Duration};

use sessiond_proto::sessiond::v1 as pb;
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
    // Prometheus itself asks for OpenMetrics and gets it.
    let mut s = tokio::net::TcpStream::connect(&metrics).await.unwrap();
    s.write_all(
        b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\
          accept: application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5\r\n\r\n",
    )
    .await
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    assert!(
        out.contains("content-type: application/openmetrics-text"),
        "{out}"
    );
    assert!(out.ends_with("# EOF\n"), "{out}");
    let (status, _) = http_get(&metrics, "/nope").await;
    assert!(status.contains(" 404"), "{status}");
}

/// The value of the sample `name{labels}` (labels exactly as rendered), or 0.
fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map(|v| v.trim().parse().unwrap())
        .unwrap_or(0.0)
}

async fn scrape(metrics: &str) -> String {
    let (status, text) = http_get(metrics, "/metrics").await;
    assert!(status.contains(" 200"), "{status}");
    text
}

/// A scrape once every `series` is at least its value (at most 20 s;
/// then the last scrape, for the caller's assertions to show).
async fn scrape_until(metrics: &str, series: &[(&str, f64)]) -> String {
    let mut text = scrape(metrics).await;
    for _ in 0..200 {
        if series.iter().all(|(name, min)| sample(&text, name) >= *min) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        text = scrape(metrics).await;
    }
    text
}

async fn wait_ready(metrics: &str) {
    for _ in 0..1200 {
        if http_get(metrics, "/readyz").await.0.contains(" 200") {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("/readyz never turned 200");
}

/// A scrape taken once the first startup-recovery pass has finished.
async fn recovery_done(metrics: &str) -> String {
    for _ in 0..1200 {
        let text = scrape(metrics).await;
        if sample(&text, "sessiond_recovery_done") == 1.0 {
            return text;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("sessiond_recovery_done never turned 1");
}

async fn wait_state(c: &mut Sessions, task: &str, session: &str, state: pb::SessionState) {
    for _ in 0..600 {
        let s = c
            .get_session(pb::GetSessionRequest {
                task_id: task.into(),
                session_id: session.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .session
            .unwrap();
        if s.state == state as i32 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("session {session} never reached {state:?}");
}

/// Real work moves the operator's counters: a completed turn (timed, first
/// chunk timed), a turn whose agent crashes mid-way (failed turn, agent exit
/// by exit code, the agent restarted), a watch stream, then sessiond and the session's agentctl
/// SIGKILLed and startup recovery relaunching agentctl and resuming the
/// conversation. The last scrape passes `promtool check metrics`.
#[tokio::test]
async fn counters_move_with_turns_crashes_and_recovery() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let config = config_file(
        dir.path(),
        &format!(
            "[[agents]]\nname = \"crashy\"\ncommand = \"{}\"\n\
             env = {{ ACP_DEMO_STATE_DIR = \"{}\", ACP_DEMO_CRASH_MID_TURN = \"1\" }}\n",
            bin("acp-demo-agent").display(),
            dir.path().join("crashy-state").display()
        ),
    );
    let mut server = start(&data, &["--config", &config]);
    let metrics = server.metrics.clone().unwrap();
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "observed").await;

    // A completed turn.
    let good = create_session(&mut c, &task.id, &work, "").await;
    prompt(&mut c, &task.id, &good.id, "hello").await;
    let text = scrape(&metrics).await;
    assert_eq!(
        sample(&text, "sessiond_turns_total{outcome=\"completed\"}"),
        1.0,
        "{text}"
    );
    assert_eq!(
        sample(&text, "sessiond_turn_duration_seconds_count"),
        1.0,
        "{text}"
    );
    assert_eq!(
        sample(&text, "sessiond_turn_first_chunk_seconds_count"),
        1.0,
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            "sessiond_agentctl_launches_total{runtime=\"local_standalone\",kind=\"launch\",outcome=\"ok\"}"
        ),
        1.0,
        "{text}"
    );

    // A watch stream is counted while open.
    let watch = c
        .watch_session(pb::WatchSessionRequest {
            session_id: good.id.clone(),
            after_seq: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let mut open = 0.0;
    for _ in 0..100 {
        open = sample(
            &scrape(&metrics).await,
            "sessiond_watch_streams{scope=\"session\"}",
        );
        if open >= 1.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(open, 1.0);
    drop(watch);

    // A turn whose agent exits mid-way (status 42).
    let bad = create_session(&mut c, &task.id, &work, "crashy").await;
    c.send_message(pb::SendMessageRequest {
        task_id: task.id.clone(),
        session_id: bad.id.clone(),
        content: "crash now".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    // agentctl's `TurnEnded` (stop reason `error`, the agent gone) ends
    // the turn and restarts the agent; its `AgentExited` update, which the
    // exit counter follows, comes after it on the stream, and is counted
    // even when the new agent already runs.
    let text = scrape_until(
        &metrics,
        &[
            ("sessiond_agent_exits_total{cause=\"exit_nonzero\"}", 1.0),
            ("sessiond_agent_restarts_total", 1.0),
        ],
    )
    .await;
    assert_eq!(
        sample(&text, "sessiond_agent_restarts_total"),
        1.0,
        "{text}"
    );
    wait_state(&mut c, &task.id, &bad.id, pb::SessionState::WaitingForInput).await;
    // The restarted agent killed while idle: the exit the doorbell reports
    // is counted once, and restarted.
    let agents = crate::permissions::demo_agents_under(&dir.path().join("crashy-state"));
    assert_eq!(agents.len(), 1, "{agents:?}");
    Command::new("kill")
        .args(["-KILL", &agents[0].to_string()])
        .status()
        .unwrap();
    let text = scrape_until(
        &metrics,
        &[
            ("sessiond_agent_restarts_total", 2.0),
            ("sessiond_agent_exits_total{cause=\"signal\"}", 1.0),
        ],
    )
    .await;
    assert_eq!(
        sample(&text, "sessiond_agent_exits_total{cause=\"signal\"}"),
        1.0,
        "{text}"
    );
    assert_eq!(
        sample(&text, "sessiond_agent_restarts_total"),
        2.0,
        "{text}"
    );
    wait_state(&mut c, &task.id, &bad.id, pb::SessionState::WaitingForInput).await;
    // Cut by the exit: interrupted (its reply kept, retryable), as the
    // session shows it, not failed.
    assert_eq!(
        sample(&text, "sessiond_turns_total{outcome=\"interrupted\"}"),
        1.0,
        "{text}"
    );
    assert_eq!(
        sample(&text, "sessiond_turns_total{outcome=\"failed\"}"),
        0.0,
        "{text}"
    );
    assert_eq!(
        sample(&text, "sessiond_agent_exits_total{cause=\"exit_nonzero\"}"),
        1.0,
        "{text}"
    );

    // kill -9 of sessiond and of every agentctl: recovery relaunches them
    // (generation 2) and resumes the good session's conversation.
    server.kill();
    let pids = agentctl_pids(&data);
    assert_eq!(pids.len(), 2, "{pids:?}");
    for pid in &pids {
        Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .unwrap();
    }
    let server = start(&data, &["--config", &config]);
    let metrics = server.metrics.clone().unwrap();
    wait_ready(&metrics).await;
    // SERVING comes once the workspaces are back; the pass's counters once
    // its agents are resumed too.
    let text = recovery_done(&metrics).await;
    assert!(
        sample(
            &text,
            "sessiond_recovery_executors_total{outcome=\"resumed\"}"
        ) >= 1.0,
        "{text}"
    );
    assert!(
        sample(
            &text,
            "sessiond_agentctl_launches_total{runtime=\"local_standalone\",kind=\"relaunch\",outcome=\"ok\"}"
        ) >= 1.0,
        "{text}"
    );
    assert!(
        sample(&text, "sessiond_agent_resumes_total{outcome=\"resumed\"}") >= 1.0,
        "{text}"
    );
    promtool_check_metrics(&text);
}

/// Method labels are a closed set: calls to paths the server does not serve
/// (unauthenticated, UNAUTHENTICATED; authenticated, UNIMPLEMENTED) all land
/// in one `method="unknown"` bucket, so callers cannot grow `/metrics`.
#[tokio::test]
async fn unknown_method_paths_share_one_label() {
    use crate::web::{grpc_web_request_from, http1};
    let dir = tempfile::tempdir().unwrap();
    let server = start(&dir.path().join("data"), &[]);
    let metrics = server.metrics.clone().unwrap();
    let mut c = sessions(&server).await;
    create_task(&mut c, "known").await;
    let before = scrape(&metrics).await.len();
    for i in 0..300 {
        // Half unauthenticated, half with a valid token.
        let token = (i % 2 == 1).then_some(TOKEN);
        let path = format!("/made.up{i}.Service/Method{i}");
        // Same origin as the console's calls: only the path is made up.
        let origin = format!("http://{}", server.addr);
        let (head, body) = grpc_web_request_from(&server.addr, &origin, &path, token, &[]);
        let r = http1(&server.addr, &head, &body).await;
        let expected = if token.is_some() { "12" } else { "16" };
        assert_eq!(r.header("grpc-status"), Some(expected), "{path}");
    }
    let text = scrape(&metrics).await;
    let methods: std::collections::BTreeSet<&str> = text
        .lines()
        .filter(|l| l.starts_with("sessiond_rpc_duration_seconds_count"))
        .filter_map(|l| l.split("method=\"").nth(1)?.split('"').next())
        .collect();
    assert_eq!(
        methods.into_iter().collect::<Vec<_>>(),
        ["/sessiond.v1.SessionService/CreateTask", "unknown"],
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            "sessiond_rpc_duration_seconds_count{method=\"unknown\",code=\"UNAUTHENTICATED\"}"
        ),
        150.0
    );
    assert_eq!(
        sample(
            &text,
            "sessiond_rpc_duration_seconds_count{method=\"unknown\",code=\"UNIMPLEMENTED\"}"
        ),
        150.0
    );
    // Two more series, not 300: the page stays the size it was, give or take.
    assert!(
        text.len() < before + 8 * 1024,
        "{} -> {}",
        before,
        text.len()
    );
}
