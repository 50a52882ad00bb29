//! Docker driver tests: `#[ignore]`d (they need an engine the test harness
//! cannot start) and run explicitly by `cargo xtask ci`, which provides an
//! engine (`DOCKER_HOST`) and the image. Once running, an engine or image
//! that is not there FAILS the test, naming what is missing.

use std::{
    sync::Mutex,
    time::{Duration, Instant},
};

use sessiond_domain::ExecutorId;
use sessiond_executor::{
    Error, Executor, ExecutorHandle, LaunchSpec, Probe, RecoveryAction, Support,
    docker::{
        DockerConfig, DockerExecutor, LABEL_EXECUTOR_ID, LABEL_SESSION_ID, LABEL_TASK_ID,
        container_name,
    },
};
use sessiond_proto::agentctl::v1 as pb;

use crate::support::{client_config, spec};

/// The non-root user the test worktrees belong to, so their containers run as it.
const AGENT_UID: u32 = 1000;

struct Fixture {
    workspace: tempfile::TempDir,
    _run: tempfile::TempDir,
    driver: DockerExecutor,
    /// Removes this test's containers when the fixture is dropped, also
    /// while a failing test unwinds.
    _guard: ContainerGuard,
}

impl Fixture {
    /// A launch spec whose containers the guard will remove.
    fn spec(&self) -> LaunchSpec {
        let spec = spec(self.workspace.path());
        self._guard.track(spec.executor_id);
        spec
    }
}

/// Removes every container labelled with a tracked executor id on drop.
/// Drop cannot await, and the test's runtime may be unwinding, so it uses a
/// thread with a runtime and an engine connection of its own.
struct ContainerGuard {
    host: String,
    executors: Mutex<Vec<ExecutorId>>,
}

impl ContainerGuard {
    fn track(&self, id: ExecutorId) {
        self.executors
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(id);
    }
}

impl Drop for ContainerGuard {
    fn drop(&mut self) {
        let ids = std::mem::take(
            self.executors
                .get_mut()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        if ids.is_empty() {
            return;
        }
        let host = self.host.clone();
        let cleanup = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("cleanup runtime");
            rt.block_on(remove_labelled(&host, &ids))
        });
        match cleanup.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("removing test containers failed: {e}"),
            Err(_) => eprintln!("removing test containers panicked"),
        }
    }
}

async fn remove_labelled(host: &str, ids: &[ExecutorId]) -> Result<(), Error> {
    let config = DockerConfig::new(host, "unused", std::env::temp_dir());
    let driver = DockerExecutor::connect(config).await?;
    for id in ids {
        for c in driver.containers_of(*id).await? {
            let options = bollard::query_parameters::RemoveContainerOptions {
                force: true,
                ..Default::default()
            };
            driver
                .docker()
                .expect("connected")
                .remove_container(&c, Some(options))
                .await
                .map_err(Error::from)?;
        }
    }
    Ok(())
}

/// The engine at `DOCKER_HOST` (else the default socket) with the image;
/// panics naming what is missing when either is not there.
async fn fixture() -> Fixture {
    let host =
        std::env::var("DOCKER_HOST").unwrap_or_else(|_| "unix:///var/run/docker.sock".into());
    let image =
        std::env::var("SESSIOND_DOCKER_IMAGE").unwrap_or_else(|_| "sessiond-agentctl:dev".into());
    let workspace = tempfile::tempdir().expect("workspace");
    // Containers run as the worktree's owner, never as root.
    std::os::unix::fs::chown(workspace.path(), Some(AGENT_UID), Some(AGENT_UID))
        .expect("chown the workspace to the agent's user (the tests run as root)");
    let run = tempfile::tempdir().expect("run dir");
    let mut config = DockerConfig::new(host.clone(), image.clone(), run.path().to_owned());
    config.client = client_config();
    config.stop_grace = Duration::from_secs(2);
    let driver = DockerExecutor::connect(config).await.unwrap_or_else(|e| {
        panic!(
            "no usable Docker engine at {host} ({e}): set DOCKER_HOST to a running dockerd, \
             or run `cargo xtask ci` / `cargo xtask docker-tests`, which start one"
        )
    });
    driver
        .docker()
        .expect("connected")
        .inspect_image(&image)
        .await
        .unwrap_or_else(|e| {
            panic!("image {image} missing ({e}); build it with `cargo xtask docker-image`")
        });
    Fixture {
        workspace,
        _run: run,
        driver,
        _guard: ContainerGuard {
            host,
            executors: Mutex::new(Vec::new()),
        },
    }
}

async fn container_status(f: &Fixture, id: &str) -> String {
    let info = f
        .driver
        .docker()
        .expect("connected")
        .inspect_container(id, None)
        .await
        .expect("inspect");
    info.state
        .and_then(|s| s.status)
        .map(|s| s.to_string())
        .unwrap_or_default()
}

/// Removes the executor's containers and asserts none is left.
async fn cleanup(f: &Fixture, handle: &ExecutorHandle) {
    f.driver.remove(handle).await.expect("remove");
    let left = f
        .driver
        .containers_of(handle.executor_id)
        .await
        .expect("list");
    assert!(left.is_empty(), "containers left behind: {left:?}");
}

#[tokio::test]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn launch_health_capabilities_stop() {
    let f = fixture().await;
    let spec = f.spec();
    let started = Instant::now();
    let handle = f.driver.launch(&spec).await.expect("launch");
    eprintln!("docker launch to healthy: {:?}", started.elapsed());

    let id = handle.container_id.clone().expect("container id");
    let info = f
        .driver
        .docker()
        .expect("connected")
        .inspect_container(&id, None)
        .await
        .expect("inspect");
    assert_eq!(
        info.name.as_deref(),
        Some(format!("/{}", container_name(spec.executor_id)).as_str())
    );
    let labels = info.config.clone().and_then(|c| c.labels).expect("labels");
    assert_eq!(
        labels.get(LABEL_EXECUTOR_ID),
        Some(&spec.executor_id.to_string())
    );
    assert_eq!(
        labels.get(LABEL_SESSION_ID),
        Some(&spec.session_id.to_string())
    );
    assert_eq!(labels.get(LABEL_TASK_ID), Some(&spec.task_id.to_string()));
    // The container is a boundary: no network, the worktree owner's user,
    // no capabilities, no privilege gain, read-only root, a pids limit.
    let config = info.config.clone().expect("config");
    assert_eq!(config.user.as_deref(), Some("1000:1000"));
    assert!(
        !config
            .env
            .unwrap_or_default()
            .iter()
            .any(|e| e.contains(&handle.auth_secret)),
        "the secret is not in the container's environment"
    );
    let host_config = info.host_config.expect("host config");
    assert_eq!(host_config.network_mode.as_deref(), Some("none"));
    assert_eq!(host_config.cap_drop, Some(vec!["ALL".to_owned()]));
    assert_eq!(
        host_config.security_opt,
        Some(vec!["no-new-privileges".to_owned()])
    );
    assert_eq!(host_config.readonly_rootfs, Some(true));
    assert_eq!(host_config.pids_limit, Some(1024));
    assert!(
        handle.agentctl_url.starts_with("unix://") && handle.agentctl_port.is_none(),
        "{}",
        handle.agentctl_url
    );

    let health = f.driver.health(&handle).await.expect("health");
    assert_eq!(health.executor_id, spec.executor_id.to_string());
    let caps = f.driver.capabilities(&handle).await.expect("capabilities");
    assert_eq!(caps.supports_workspace_only, Support::Supported);

    // The worktree is bind-mounted: a file written through agentctl in the
    // container lands on the host, and git runs inside the image.
    let mut raw = f.driver.client(&handle).expect("client").raw();
    raw.write_file(pb::WriteFileRequest {
        path: "from-container.txt".into(),
        content: b"ok".to_vec(),
        create_parents: false,
    })
    .await
    .expect("write");
    assert_eq!(
        std::fs::read(f.workspace.path().join("from-container.txt")).expect("on host"),
        b"ok"
    );
    let exec = raw
        .exec(pb::ExecRequest {
            command: "git".into(),
            args: vec!["--version".into()],
            ..Default::default()
        })
        .await
        .expect("exec git")
        .into_inner();
    assert_eq!(
        exec.exit_code,
        Some(0),
        "git in the image: {}",
        String::from_utf8_lossy(&exec.stderr)
    );

    let started = Instant::now();
    f.driver.stop(&handle).await.expect("stop");
    eprintln!("docker stop: {:?}", started.elapsed());
    assert_eq!(container_status(&f, &id).await, "exited");
    cleanup(&f, &handle).await;
}

#[tokio::test]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn recover_running_container_reattaches() {
    let f = fixture().await;
    let handle = f.driver.launch(&f.spec()).await.expect("launch");
    let started = Instant::now();
    let recovered = f.driver.recover(&handle).await.expect("recover");
    eprintln!("docker recover (running): {:?}", started.elapsed());
    assert_eq!(recovered.action, RecoveryAction::Reattached);
    assert_eq!(recovered.handle, handle, "same container, port and secret");

    // Found by label when the recorded container id is stale.
    let mut stale = handle.clone();
    stale.container_id = Some("0123456789ab".into());
    let by_label = f.driver.recover(&stale).await.expect("recover by label");
    assert_eq!(by_label.handle.container_id, handle.container_id);
    cleanup(&f, &handle).await;
}

#[tokio::test]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn recover_stopped_container_starts_it() {
    let f = fixture().await;
    let handle = f.driver.launch(&f.spec()).await.expect("launch");
    f.driver.stop(&handle).await.expect("stop");
    let id = handle.container_id.clone().expect("id");
    assert_eq!(container_status(&f, &id).await, "exited");

    let started = Instant::now();
    let recovered = f.driver.recover(&handle).await.expect("recover");
    eprintln!(
        "docker recover (stopped -> started): {:?}",
        started.elapsed()
    );
    assert_eq!(recovered.action, RecoveryAction::Restarted);
    assert_eq!(recovered.handle.container_id, handle.container_id);
    assert_eq!(
        recovered.handle.generation,
        handle.generation + 1,
        "a restart is a new generation"
    );
    assert_eq!(container_status(&f, &id).await, "running");
    f.driver
        .health(&recovered.handle)
        .await
        .expect("healthy after start");
    cleanup(&f, &recovered.handle).await;
}

#[tokio::test]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn recover_removed_container_is_an_error() {
    let f = fixture().await;
    let handle = f.driver.launch(&f.spec()).await.expect("launch");
    f.driver.remove(&handle).await.expect("remove");
    let err = f.driver.recover(&handle).await.expect_err("container gone");
    assert!(matches!(err, Error::ContainerMissing { .. }), "{err}");
    cleanup(&f, &handle).await;
}

#[tokio::test]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn concurrent_launches_make_one_container() {
    let f = fixture().await;
    let spec = f.spec();
    let (a, b) = tokio::join!(f.driver.launch(&spec), f.driver.launch(&spec));
    let (a, b) = (a.expect("first launch"), b.expect("second launch"));
    assert_eq!(a.container_id, b.container_id);
    assert_eq!(
        a.auth_secret, b.auth_secret,
        "the loser adopts the winner's secret"
    );
    let containers = f
        .driver
        .containers_of(spec.executor_id)
        .await
        .expect("list");
    assert_eq!(containers.len(), 1, "{containers:?}");
    f.driver.health(&a).await.expect("healthy");
    f.driver.health(&b).await.expect("healthy");
    cleanup(&f, &a).await;
}

#[tokio::test]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn probe_starts_nothing_then_start_carries_the_new_generation() {
    let f = fixture().await;
    let handle = f.driver.launch(&f.spec()).await.expect("launch");
    let id = handle.container_id.clone().expect("id");
    match f.driver.probe(&handle).await.expect("probe running") {
        Probe::Reattachable { handle: h, .. } => assert_eq!(h, handle),
        other => panic!("expected reattachable, got {other:?}"),
    }

    f.driver.stop(&handle).await.expect("stop");
    let probe = f.driver.probe(&handle).await.expect("probe stopped");
    assert!(matches!(probe, Probe::NeedsStart { .. }), "{probe:?}");
    assert_eq!(
        container_status(&f, &id).await,
        "exited",
        "probe started nothing"
    );

    // The caller persisted its intent with generation + 1; now the start.
    let started = f
        .driver
        .start(&handle, handle.generation + 1)
        .await
        .expect("start");
    assert_eq!(started.generation, handle.generation + 1);
    assert_eq!(started.container_id, handle.container_id);
    assert_eq!(container_status(&f, &id).await, "running");
    f.driver
        .health(&started)
        .await
        .expect("healthy after start");

    f.driver.remove(&started).await.expect("remove");
    let probe = f.driver.probe(&started).await.expect("probe removed");
    assert!(matches!(probe, Probe::Missing { .. }), "{probe:?}");
    cleanup(&f, &started).await;
}

/// A test that fails half-way still removes its containers: the guard in
/// the fixture does it when the fixture is dropped during the unwind.
#[tokio::test]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn a_panicking_test_leaves_no_container() {
    let f = fixture().await;
    let host = f._guard.host.clone();
    let driver = f.driver.clone();
    let spec = f.spec();
    let executor_id = spec.executor_id;
    let failed = tokio::spawn(async move {
        let f = f;
        f.driver.launch(&spec).await.expect("launch");
        panic!("a test failing with its container running");
    })
    .await
    .expect_err("the test task panicked");
    assert!(failed.is_panic());
    let left = driver.containers_of(executor_id).await.expect("list");
    assert!(left.is_empty(), "containers left behind: {left:?} ({host})");
}
