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

/// What a process of the agent's user sees from inside its container (run
/// through agentctl's `Exec`, as the agent's own commands are), with a
/// second session's container beside it and a TCP port on the host standing
/// for sessiond's API: no raw or packet socket (no sniffing), no interface
/// but the container's own loopback, neither the host port nor the other
/// session's agentctl reachable, agentctl's secret readable nowhere (its
/// environment, the handed-over file, its memory), and a non-root user with
/// no capabilities and `no-new-privileges`.
#[tokio::test]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn agent_container_is_a_boundary() {
    let f = fixture().await;
    let handle = f.driver.launch(&f.spec()).await.expect("launch");
    let other = f
        .driver
        .launch(&f.spec())
        .await
        .expect("launch a second session");

    // The probe goes in through the worktree (the image stays as shipped).
    let probe = crate::support::agentctl_path().with_file_name("boundary-probe");
    assert!(
        probe.is_file(),
        "{} not found: build it first (`cargo build --workspace --bins`)",
        probe.display()
    );
    let inside = f.workspace.path().join("boundary-probe");
    std::fs::copy(&probe, &inside).expect("copy the probe into the worktree");
    // A port on every address of the host, as sessiond's API (and, before
    // agentctl moved to a socket, every executor's agentctl) listens.
    let api = std::net::TcpListener::bind("0.0.0.0:0").expect("host listener");
    api.set_nonblocking(true).expect("nonblocking");
    let port = api.local_addr().expect("addr").port();
    let mut targets = vec![format!("127.0.0.1:{port}")];
    // The host's own address on its default route, when it has one.
    if let Ok(udp) = std::net::UdpSocket::bind("0.0.0.0:0")
        && udp.connect("192.0.2.1:9").is_ok()
        && let Ok(addr) = udp.local_addr()
        && !addr.ip().is_loopback()
    {
        targets.push(format!("{}:{port}", addr.ip()));
    }
    let other_socket = other.agentctl_url.trim_start_matches("unix://").to_owned();
    assert!(
        std::path::Path::new(&other_socket).exists(),
        "the second session's socket {other_socket} is on the host"
    );
    let other_in_container = format!("/run/sessiond/../{}/agentctl.sock", other.executor_id);
    let mut args = Vec::new();
    for t in &targets {
        args.extend(["--connect".to_owned(), t.clone()]);
    }
    for p in [&other_socket, &other_in_container] {
        args.extend(["--connect-unix".to_owned(), p.clone()]);
    }
    for p in ["/proc/1/environ", "/run/sessiond/secret", "/proc/1/mem"] {
        args.extend(["--read".to_owned(), p.to_owned()]);
    }

    let out = f
        .driver
        .client(&handle)
        .expect("client")
        .exec(pb::ExecRequest {
            command: "/workspace/boundary-probe".into(),
            args,
            ..Default::default()
        })
        .await
        .expect("exec the probe");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!("what the probe saw from inside the container:\n{text}");
    assert_eq!(
        out.exit_code,
        Some(0),
        "probe: {text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let seen: std::collections::HashMap<&str, &str> =
        text.lines().filter_map(|l| l.split_once('=')).collect();
    let get = |k: &str| *seen.get(k).unwrap_or_else(|| panic!("no {k} in {text}"));

    let ids = format!("{AGENT_UID} {AGENT_UID} {AGENT_UID} {AGENT_UID}");
    assert_eq!(get("uid"), ids, "the worktree owner, not root: {text}");
    assert_eq!(get("gid"), ids, "{text}");
    for caps in ["cap_eff", "cap_prm", "cap_bnd"] {
        assert_eq!(get(caps), "0000000000000000", "no capabilities: {text}");
    }
    assert_eq!(get("no_new_privs"), "1", "{text}");
    assert!(
        get("af_packet").starts_with("refused"),
        "no sniffing: {text}"
    );
    assert!(get("raw_inet").starts_with("refused"), "{text}");
    assert_eq!(get("interfaces"), "lo", "network `none`: {text}");
    for t in &targets {
        assert!(
            get(&format!("connect:{t}")).starts_with("failed"),
            "the host's port {t} is out of reach: {text}"
        );
    }
    assert!(
        matches!(api.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "nothing reached the host port"
    );
    for p in [&other_socket, &other_in_container] {
        assert!(
            get(&format!("connect:{p}")).starts_with("failed"),
            "the other session's agentctl is out of reach: {text}"
        );
    }
    for p in ["/proc/1/environ", "/run/sessiond/secret", "/proc/1/mem"] {
        assert!(
            get(&format!("read:{p}")).starts_with("failed"),
            "the agent's user cannot read agentctl's secret through {p}: {text}"
        );
    }
    assert!(
        !get("env_keys").split(' ').any(|k| k.contains("SECRET")),
        "no secret in the environment: {text}"
    );
    // The secret is nowhere in what the probe printed, and agentctl still
    // answers with it: the handover worked.
    assert!(!text.contains(&handle.auth_secret));
    f.driver.health(&handle).await.expect("healthy");
    cleanup(&f, &other).await;
    cleanup(&f, &handle).await;
}

/// Every call of a launch carries the owner's lease epoch, the readiness
/// check included, and so does the readiness check of a restarted
/// container: the agentctl refuses an older owner from its first call.
#[tokio::test]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn launch_and_restart_readiness_carry_the_lease_epoch() {
    let f = fixture().await;
    let mut spec = f.spec();
    spec.lease_epoch = Some(7);
    let handle = f.driver.launch(&spec).await.expect("launch");
    assert_eq!(handle.lease_epoch, Some(7));
    let mut older = handle.clone();
    older.lease_epoch = Some(6);
    let err = f.driver.health(&older).await.expect_err("older epoch");
    assert!(matches!(err, Error::StaleEpoch { .. }), "{err}");

    f.driver.stop(&handle).await.expect("stop");
    let mut newer = handle.clone();
    newer.lease_epoch = Some(9);
    let recovered = f.driver.recover(&newer).await.expect("restart");
    assert_eq!(recovered.action, RecoveryAction::Restarted);
    let mut stale = recovered.handle.clone();
    stale.lease_epoch = Some(8);
    let err = f.driver.health(&stale).await.expect_err("older epoch");
    assert!(matches!(err, Error::StaleEpoch { .. }), "{err}");
    f.driver
        .health(&recovered.handle)
        .await
        .expect("the restarting owner's epoch");
    cleanup(&f, &recovered.handle).await;
}
