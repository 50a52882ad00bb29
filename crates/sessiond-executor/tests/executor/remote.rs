use std::time::{Duration, Instant};

use sessiond_domain::ExecutorId;
use sessiond_executor::{
    AgentctlClient, Backoff, Error, Executor, ExecutorHandle, LaunchSpec, RecoveryAction,
    RemoteTarget, Support,
    remote::{RemoteConfig, RemoteExecutor},
};

use crate::support::{ManualAgentctl, client_config, free_port, spec};

fn driver(backoff: Backoff, ready_deadline: Duration) -> RemoteExecutor {
    RemoteExecutor::new(RemoteConfig {
        client: client_config(),
        backoff,
        ready_deadline,
        ..RemoteConfig::default()
    })
}

fn remote_spec(workspace: &std::path::Path, agentctl: &ManualAgentctl, url: String) -> LaunchSpec {
    let mut spec = spec(workspace);
    spec.executor_id = agentctl.executor_id;
    spec.remote = Some(RemoteTarget {
        url,
        auth_secret: agentctl.secret.clone(),
    });
    spec
}

#[tokio::test]
async fn launch_health_capabilities_stop() {
    let workspace = tempfile::tempdir().expect("workspace");
    let agentctl = ManualAgentctl::start(workspace.path(), "127.0.0.1:0").await;
    let driver = driver(Backoff::default(), Duration::from_secs(5));

    let spec = remote_spec(workspace.path(), &agentctl, agentctl.url());
    let handle = driver.launch(&spec).await.expect("launch connects");
    assert_eq!(handle.agentctl_url, agentctl.url());
    assert_eq!(handle.agentctl_port, Some(agentctl.port));
    assert_eq!(
        (handle.pid, handle.container_id.as_deref()),
        (None, None),
        "nothing launched"
    );

    let health = driver.health(&handle).await.expect("health");
    assert_eq!(health.pid, agentctl.child.id());
    let caps = driver.capabilities(&handle).await.expect("capabilities");
    assert_eq!(caps.supports_workspace_only, Support::Supported);

    let recovered = driver.recover(&handle).await.expect("recover");
    assert_eq!(recovered.action, RecoveryAction::Reattached);

    // Stop ends the agent; agentctl belongs to the remote host and keeps running.
    driver.stop(&handle).await.expect("stop");
    driver
        .health(&handle)
        .await
        .expect("agentctl still serves after stop");

    // Without a target there is nothing to connect to.
    let err = driver
        .launch(&crate::support::spec(workspace.path()))
        .await
        .expect_err("no url");
    assert!(matches!(err, Error::Config(_)), "{err}");

    agentctl.kill().await;
}

#[tokio::test]
async fn recovers_from_a_stored_record() {
    let workspace = tempfile::tempdir().expect("workspace");
    let agentctl = ManualAgentctl::start(workspace.path(), "127.0.0.1:0").await;
    let driver = driver(Backoff::default(), Duration::from_secs(5));

    let mut stored = record(&agentctl, &agentctl.url(), workspace.path());
    let handle = ExecutorHandle::from_record(&stored);
    let recovered = driver.recover(&handle).await.expect("recover");
    assert_eq!(recovered.action, RecoveryAction::Reattached);
    assert_eq!(
        recovered.health.executor_id,
        agentctl.executor_id.to_string()
    );

    let before = stored.clone();
    recovered.handle.apply_to(&mut stored);
    assert_eq!(stored, before, "a reattach changes nothing in the record");

    agentctl.kill().await;
}

#[tokio::test]
async fn retries_with_backoff_until_the_host_listens() {
    let workspace = tempfile::tempdir().expect("workspace");
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    // The record names this agentctl; its host brings it up 2 s after the
    // driver began trying.
    let (executor_id, secret) = (ExecutorId::new(), sessiond_executor::fresh_secret());

    let path = workspace.path().to_owned();
    let late_secret = secret.clone();
    let late = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(2)).await;
        ManualAgentctl::start_as(
            &path,
            &format!("127.0.0.1:{port}"),
            executor_id,
            late_secret,
        )
        .await
    });

    let backoff = Backoff {
        initial: Duration::from_millis(250),
        max: Duration::from_secs(1),
    };
    let driver = driver(backoff, Duration::from_secs(10));
    let mut spec = spec(workspace.path());
    spec.executor_id = executor_id;
    spec.remote = Some(RemoteTarget {
        url: url.clone(),
        auth_secret: secret,
    });

    let started = Instant::now();
    let handle = driver
        .launch(&spec)
        .await
        .expect("ready within the backoff");
    let waited = started.elapsed();
    eprintln!("remote unreachable for 2 s, ready after {waited:?}");
    assert!(
        waited >= Duration::from_secs(2),
        "cannot be ready before the host listens: {waited:?}"
    );
    // One backoff step (at most 1 s) after the host came up, plus its startup.
    assert!(waited < Duration::from_secs(5), "took {waited:?}");
    driver.health(&handle).await.expect("healthy");

    late.await.expect("late agentctl").kill().await;
}

#[tokio::test]
async fn a_listener_that_never_answers_fails_within_the_deadline() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    // Accepts every connection and holds it open without a byte in reply.
    let sink = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let url = format!("http://127.0.0.1:{port}");
    let mut config = client_config();
    config.call_timeout = Duration::from_millis(500);

    // A single call: bounded by the call deadline.
    let client = AgentctlClient::new(&url, "secret", &config).expect("client");
    let started = Instant::now();
    let err = client.health().await.expect_err("no answer");
    let took = started.elapsed();
    eprintln!("silent listener, one call: {err} after {took:?}");
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(took < Duration::from_millis(1500), "{took:?}");

    // The raw client carries the same deadline.
    let started = Instant::now();
    let status = client
        .raw()
        .health(sessiond_proto::agentctl::v1::HealthRequest {})
        .await
        .expect_err("no answer");
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "raw call took {:?}: {status}",
        started.elapsed()
    );

    // The driver: retried with backoff, then an error once the deadline passes.
    let driver = RemoteExecutor::new(RemoteConfig {
        client: config,
        backoff: Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_millis(400),
        },
        ready_deadline: Duration::from_secs(2),
        ..RemoteConfig::default()
    });
    let mut spec = spec(std::path::Path::new("/"));
    spec.remote = Some(RemoteTarget {
        url,
        auth_secret: "secret".into(),
    });
    let started = Instant::now();
    let err = driver.launch(&spec).await.expect_err("never ready");
    let took = started.elapsed();
    eprintln!("silent listener, driver: {err} after {took:?}");
    assert!(matches!(err, Error::NotReady { .. }), "{err}");
    assert!(took < Duration::from_secs(3), "{took:?}");

    sink.abort();
}

#[tokio::test]
async fn a_wrong_secret_fails_at_once_instead_of_retrying() {
    let workspace = tempfile::tempdir().expect("workspace");
    let agentctl = ManualAgentctl::start(workspace.path(), "127.0.0.1:0").await;
    let driver = driver(Backoff::default(), Duration::from_secs(30));
    let mut spec = remote_spec(workspace.path(), &agentctl, agentctl.url());
    spec.remote.as_mut().expect("target").auth_secret = "wrong".into();
    let started = Instant::now();
    let err = driver.launch(&spec).await.expect_err("wrong secret");
    assert!(matches!(err, Error::Unauthenticated { .. }), "{err}");
    assert!(started.elapsed() < Duration::from_secs(5));
    agentctl.kill().await;
}

fn record(
    agentctl: &ManualAgentctl,
    url: &str,
    workspace: &std::path::Path,
) -> sessiond_domain::ExecutorRecord {
    let now = chrono::Utc::now();
    sessiond_domain::ExecutorRecord {
        id: agentctl.executor_id,
        session_id: sessiond_domain::SessionId::new(),
        task_id: sessiond_domain::TaskId::new(),
        runtime: sessiond_domain::Runtime::Remote,
        status: sessiond_domain::ExecutorStatus::Ready,
        agentctl_url: Some(url.to_owned()),
        agentctl_port: Some(agentctl.port),
        container_id: None,
        pid: None,
        pid_start_time: None,
        auth_secret: agentctl.secret.clone(),
        generation: 3,
        supports_session_resume: true,
        supports_workspace_only: true,
        resume_token: None,
        workspace_path: workspace.display().to_string(),
        worktree: sessiond_domain::Worktree {
            id: "w".into(),
            path: workspace.display().to_string(),
            branch: "main".into(),
            ..Default::default()
        },
        last_seen_at: None,
        error_message: None,
        owner_id: None,
        lease_expires_at: None,
        lease_epoch: 0,
        version: 1,
        created_at: now,
        updated_at: now,
    }
}
