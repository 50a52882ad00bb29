use std::{
    os::unix::fs::{MetadataExt, PermissionsExt},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use sessiond_executor::{
    Error, Executor, ExecutorHandle, Probe, RecoveryAction, Support,
    process::{self, OwnedProcess},
    standalone::{StandaloneConfig, StandaloneExecutor},
};
use sessiond_proto::agentctl::v1 as pb;

use crate::support::{
    agentctl_path, assert_gone, client_config, is_running, pids_mentioning, spec,
};

struct Fixture {
    workspace: tempfile::TempDir,
    run: tempfile::TempDir,
    driver: StandaloneExecutor,
}

fn fixture() -> Fixture {
    let workspace = tempfile::tempdir().expect("workspace");
    let run = tempfile::tempdir().expect("run dir");
    let mut config = StandaloneConfig::new(agentctl_path(), run.path().to_owned());
    config.log_dir = Some(run.path().to_owned());
    config.client = client_config();
    // A failing test may leave its agentctl behind; it then exits by itself.
    config.idle_timeout = Some(Duration::from_secs(120));
    config.stop_grace = Duration::from_secs(1);
    Fixture {
        workspace,
        run,
        driver: StandaloneExecutor::new(config),
    }
}

fn pid_of(handle: &ExecutorHandle) -> u32 {
    handle.pid.expect("standalone handle has a pid")
}

#[tokio::test]
async fn launch_health_capabilities_stop() {
    let f = fixture();
    let spec = spec(f.workspace.path());
    let started = Instant::now();
    let handle = f.driver.launch(&spec).await.expect("launch");
    eprintln!("standalone launch to healthy: {:?}", started.elapsed());

    let pid = pid_of(&handle);
    assert!(is_running(pid));
    assert_eq!(handle.pid_start_time, process::start_time(pid));
    assert_eq!(handle.generation, 1);
    // A Unix socket in the run directory, only for our user; no TCP port.
    let socket = f.run.path().join(format!("{}.sock", spec.executor_id));
    assert_eq!(handle.agentctl_url, format!("unix://{}", socket.display()));
    assert_eq!(handle.agentctl_port, None);
    let mode = std::fs::metadata(&socket)
        .expect("socket")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "socket mode {mode:o}");
    assert_eq!(
        listening_tcp_inodes_of(pid),
        0,
        "agentctl listens on no TCP port"
    );
    assert_eq!(handle.auth_secret.len(), 64);
    // The secret file was consumed, and agentctl's environment and memory
    // are closed to processes of its own user (it is non-dumpable).
    assert!(
        !f.run
            .path()
            .join(format!("{}.secret", spec.executor_id))
            .exists(),
        "agentctl unlinks its secret file"
    );
    let environ = std::fs::metadata(format!("/proc/{pid}/environ")).expect("environ");
    assert_eq!(
        environ.uid(),
        0,
        "a non-dumpable process's /proc files are root's"
    );

    let health = f.driver.health(&handle).await.expect("health");
    assert_eq!(health.executor_id, spec.executor_id.to_string());
    assert_eq!(health.pid, pid);

    let caps = f.driver.capabilities(&handle).await.expect("capabilities");
    assert_eq!(caps.supports_workspace_only, Support::Supported);
    assert_eq!(
        caps.supports_session_resume,
        Support::Unknown,
        "no agent launched yet"
    );

    // The client is authenticated and serves the workspace.
    let mut raw = f.driver.client(&handle).expect("client").raw();
    raw.write_file(pb::WriteFileRequest {
        path: "hello.txt".into(),
        content: b"hi".to_vec(),
        create_parents: false,
    })
    .await
    .expect("write through agentctl");
    assert_eq!(
        std::fs::read(f.workspace.path().join("hello.txt")).expect("file on disk"),
        b"hi"
    );

    // Own process group: a signal to the backend's group does not reach it.
    let pgid = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    let pgid: u32 = pgid[pgid.rfind(')').expect(")") + 2..]
        .split_whitespace()
        .nth(2)
        .expect("pgrp")
        .parse()
        .expect("num");
    assert_eq!(pgid, pid, "agentctl leads its own process group");

    let started = Instant::now();
    f.driver.stop(&handle).await.expect("stop");
    eprintln!("standalone stop: {:?}", started.elapsed());
    assert_gone(pid).await;
    assert!(matches!(f.driver.health(&handle).await, Err(e) if e.is_unavailable()));
    f.driver.remove(&handle).await.expect("remove");
    drop(f.run);
}

#[tokio::test]
async fn wrong_secret_or_identity_is_refused() {
    let f = fixture();
    let handle = f
        .driver
        .launch(&spec(f.workspace.path()))
        .await
        .expect("launch");

    let mut wrong_secret = handle.clone();
    wrong_secret.auth_secret = sessiond_executor::fresh_secret();
    let err = f
        .driver
        .health(&wrong_secret)
        .await
        .expect_err("wrong secret");
    assert!(matches!(err, Error::Unauthenticated { .. }), "{err}");

    let mut wrong_id = handle.clone();
    wrong_id.executor_id = sessiond_domain::ExecutorId::new();
    let err = f
        .driver
        .health(&wrong_id)
        .await
        .expect_err("other executor");
    assert!(matches!(err, Error::IdentityMismatch { .. }), "{err}");

    f.driver.stop(&handle).await.expect("stop");
    assert_gone(pid_of(&handle)).await;
}

#[tokio::test]
async fn recover_reattaches_to_a_live_agentctl() {
    let f = fixture();
    let handle = f
        .driver
        .launch(&spec(f.workspace.path()))
        .await
        .expect("launch");

    let started = Instant::now();
    let recovered = f.driver.recover(&handle).await.expect("recover");
    eprintln!("standalone recover (reattach): {:?}", started.elapsed());
    assert_eq!(recovered.action, RecoveryAction::Reattached);
    assert_eq!(
        recovered.handle, handle,
        "same pid, port, secret and generation"
    );
    assert!(is_running(pid_of(&handle)));

    f.driver.stop(&handle).await.expect("stop");
    assert_gone(pid_of(&handle)).await;
}

#[tokio::test]
async fn recover_relaunches_a_killed_agentctl() {
    let f = fixture();
    let handle = f
        .driver
        .launch(&spec(f.workspace.path()))
        .await
        .expect("launch");
    let old_pid = pid_of(&handle);
    let own = OwnedProcess::open(old_pid, handle.pid_start_time.expect("start time"))
        .expect("our process");
    own.signal(rustix::process::Signal::KILL).expect("kill -9");
    assert_gone(old_pid).await;

    let started = Instant::now();
    let recovered = f.driver.recover(&handle).await.expect("recover");
    eprintln!("standalone recover (relaunch): {:?}", started.elapsed());
    assert_eq!(recovered.action, RecoveryAction::Relaunched);
    assert_eq!(recovered.handle.generation, handle.generation + 1);
    let new_pid = pid_of(&recovered.handle);
    assert_ne!(new_pid, old_pid);
    assert_ne!(
        recovered.handle.auth_secret, handle.auth_secret,
        "a fresh secret per launch"
    );
    assert_eq!(recovered.health.pid, new_pid);
    f.driver
        .health(&recovered.handle)
        .await
        .expect("new agentctl healthy");

    f.driver.stop(&recovered.handle).await.expect("stop");
    assert_gone(new_pid).await;
}

#[tokio::test]
async fn recover_neither_trusts_nor_signals_a_reused_pid() {
    let f = fixture();
    let handle = f
        .driver
        .launch(&spec(f.workspace.path()))
        .await
        .expect("launch");
    let agentctl_pid = pid_of(&handle);
    f.driver.stop(&handle).await.expect("stop");
    assert_gone(agentctl_pid).await;

    // An unrelated process now holds the recorded pid (start time differs).
    let mut stranger = Command::new("sleep")
        .arg("300")
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn sleep");
    let stranger_pid = stranger.id();
    let mut record = handle.clone();
    record.pid = Some(stranger_pid);
    assert_ne!(process::start_time(stranger_pid), record.pid_start_time);

    // stop must leave it alone...
    f.driver
        .stop(&record)
        .await
        .expect("stop on a foreign pid is a no-op");
    // ...and so must recover, which launches a new agentctl instead.
    let recovered = f.driver.recover(&record).await.expect("recover");
    assert_eq!(recovered.action, RecoveryAction::Relaunched);
    let new_pid = pid_of(&recovered.handle);
    assert_ne!(new_pid, stranger_pid);
    assert_eq!(recovered.health.executor_id, handle.executor_id.to_string());

    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        stranger.try_wait().expect("try_wait").is_none(),
        "the unrelated process was signalled"
    );
    assert!(is_running(stranger_pid));

    f.driver.stop(&recovered.handle).await.expect("stop");
    assert_gone(new_pid).await;
    stranger.kill().expect("kill sleep");
    stranger.wait().expect("reap sleep");
    assert_gone(stranger_pid).await;
}

#[tokio::test]
async fn recover_fails_when_the_worktree_is_gone() {
    let f = fixture();
    let handle = f
        .driver
        .launch(&spec(f.workspace.path()))
        .await
        .expect("launch");
    f.driver.stop(&handle).await.expect("stop");
    assert_gone(pid_of(&handle)).await;

    let mut record = handle.clone();
    record.workspace_path = f.workspace.path().join("deleted-worktree");
    let err = f.driver.recover(&record).await.expect_err("no worktree");
    assert!(matches!(err, Error::WorkspaceMissing { .. }), "{err}");
}

#[tokio::test]
async fn probe_starts_nothing_and_tells_what_is_needed() {
    let f = fixture();
    let handle = f
        .driver
        .launch(&spec(f.workspace.path()))
        .await
        .expect("launch");
    let id = handle.executor_id.to_string();
    let pid = pid_of(&handle);

    // Alive and ours: reattachable, the same handle.
    match f.driver.probe(&handle).await.expect("probe") {
        Probe::Reattachable { handle: h, health } => {
            assert_eq!(h, handle);
            assert_eq!(health.pid, pid);
        }
        other => panic!("expected reattachable, got {other:?}"),
    }
    assert_eq!(pids_mentioning(&id), vec![pid], "probe spawned nothing");

    // Killed: the probe says "launch", and launches nothing itself, so the
    // caller can persist its intent (generation + 1) first.
    let own = OwnedProcess::open(pid, handle.pid_start_time.expect("start")).expect("ours");
    own.signal(rustix::process::Signal::KILL).expect("kill -9");
    assert_gone(pid).await;
    let probe = f.driver.probe(&handle).await.expect("probe");
    assert!(matches!(probe, Probe::NeedsLaunch { .. }), "{probe:?}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(pids_mentioning(&id).is_empty(), "probe launched something");

    // The caller's second phase.
    let relaunched = f
        .driver
        .launch(&handle.relaunch_spec())
        .await
        .expect("launch after intent");
    assert_eq!(relaunched.generation, handle.generation + 1);
    f.driver.health(&relaunched).await.expect("healthy");
    // A stand-alone executor has nothing to `start`.
    let err = f
        .driver
        .start(&handle, handle.generation + 1)
        .await
        .expect_err("nothing to start");
    assert!(matches!(err, Error::Config(_)), "{err}");

    // The worktree is gone: missing, nothing launched.
    let mut gone = relaunched.clone();
    gone.workspace_path = f.workspace.path().join("deleted-worktree");
    gone.pid = None;
    let probe = f.driver.probe(&gone).await.expect("probe");
    assert!(matches!(probe, Probe::Missing { .. }), "{probe:?}");

    f.driver.stop(&relaunched).await.expect("stop");
    assert_gone(pid_of(&relaunched)).await;
    assert!(pids_mentioning(&id).is_empty());
}

#[tokio::test]
async fn probe_ends_our_hung_agentctl_but_not_a_stranger() {
    let f = fixture();
    let handle = f
        .driver
        .launch(&spec(f.workspace.path()))
        .await
        .expect("launch");
    let pid = pid_of(&handle);
    let start_time = handle.pid_start_time.expect("start time");

    // A stranger holding the recorded pid is left alone.
    let mut stranger = Command::new("sleep")
        .arg("300")
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn sleep");
    let mut foreign = handle.clone();
    foreign.pid = Some(stranger.id());
    let probe = f.driver.probe(&foreign).await.expect("probe");
    assert!(matches!(probe, Probe::NeedsLaunch { .. }), "{probe:?}");
    assert!(stranger.try_wait().expect("try_wait").is_none());
    // Even one started in the same clock tick as our agentctl (start times
    // count in 10 ms ticks): it is not agentctl for this executor.
    foreign.pid_start_time = process::start_time(stranger.id());
    let probe = f.driver.probe(&foreign).await.expect("probe");
    assert!(matches!(probe, Probe::NeedsLaunch { .. }), "{probe:?}");
    assert!(stranger.try_wait().expect("try_wait").is_none());

    // Ours, but hung (stopped): it accepts connections and never answers.
    let own = OwnedProcess::open(pid, start_time).expect("ours");
    own.signal(rustix::process::Signal::STOP).expect("stop it");
    let probe = f.driver.probe(&handle).await.expect("probe");
    assert!(matches!(probe, Probe::NeedsLaunch { .. }), "{probe:?}");
    assert_gone(pid).await;
    assert!(
        pids_mentioning(&handle.executor_id.to_string()).is_empty(),
        "probe launched something"
    );

    stranger.kill().expect("kill sleep");
    stranger.wait().expect("reap sleep");
}

#[tokio::test]
async fn an_abandoned_launch_leaves_no_agentctl() {
    let f = fixture();
    let spec = spec(f.workspace.path());
    let id = spec.executor_id.to_string();
    {
        let mut launch = Box::pin(f.driver.launch(&spec));
        // One poll spawns agentctl and then waits for its port file.
        assert!(futures::poll!(launch.as_mut()).is_pending());
        // The spawn has returned, but the kernel may not have set up the new
        // program's arguments yet (/proc/PID/cmdline is empty for a moment
        // after exec releases the parent): look again for a while.
        let mut pids = pids_mentioning(&id);
        for _ in 0..100 {
            if !pids.is_empty() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
            pids = pids_mentioning(&id);
        }
        assert_eq!(pids.len(), 1, "spawned: {pids:?}");
        // The caller gives up (its deadline passed): the future is dropped.
        drop(launch);
        assert_gone(pids[0]).await;
    }
    assert!(pids_mentioning(&id).is_empty());
}

/// Sockets of `pid` that are listening TCP sockets (from /proc/net/tcp{,6}).
fn listening_tcp_inodes_of(pid: u32) -> usize {
    let mut listening = std::collections::HashSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        for line in std::fs::read_to_string(table)
            .unwrap_or_default()
            .lines()
            .skip(1)
        {
            let cols: Vec<&str> = line.split_whitespace().collect();
            // st == 0A: LISTEN; column 9 is the inode.
            if cols.get(3) == Some(&"0A")
                && let Some(inode) = cols.get(9)
            {
                listening.insert(format!("socket:[{inode}]"));
            }
        }
    }
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fds of agentctl")
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|target| listening.contains(&target.display().to_string()))
        .count()
}

/// A launch carries the owner's lease epoch from its first (readiness)
/// call: the new agentctl refuses an older owner at once, before the
/// launching replica has made any call of its own through the handle.
#[tokio::test]
async fn a_launch_fences_older_owners_from_its_readiness_call() {
    let f = fixture();
    let mut spec = spec(f.workspace.path());
    spec.lease_epoch = Some(7);
    let handle = f.driver.launch(&spec).await.expect("launch");
    assert_eq!(handle.lease_epoch, Some(7), "the handle keeps the epoch");
    let mut older = handle.clone();
    older.lease_epoch = Some(6);
    let err = f.driver.health(&older).await.expect_err("older epoch");
    assert!(matches!(err, Error::StaleEpoch { .. }), "{err}");
    f.driver
        .health(&handle)
        .await
        .expect("the launcher's epoch");

    // A relaunch keeps carrying the handle's epoch.
    let own = OwnedProcess::open(pid_of(&handle), handle.pid_start_time.expect("start time"))
        .expect("our process");
    own.signal(rustix::process::Signal::KILL).expect("kill -9");
    assert_gone(pid_of(&handle)).await;
    let mut newer = handle.clone();
    newer.lease_epoch = Some(9);
    let recovered = f.driver.recover(&newer).await.expect("relaunch");
    assert_eq!(recovered.action, RecoveryAction::Relaunched);
    let mut stale = recovered.handle.clone();
    stale.lease_epoch = Some(8);
    let err = f.driver.health(&stale).await.expect_err("older epoch");
    assert!(matches!(err, Error::StaleEpoch { .. }), "{err}");
    f.driver.stop(&recovered.handle).await.expect("stop");
    assert_gone(pid_of(&recovered.handle)).await;
}

/// The agent starts a process that leaves its session (`setsid`), then
/// agentctl is killed with `kill -9`: nothing of agentctl remains to end
/// that process, yet stopping the executor ends it (through the journal's
/// record of the agent's tree and the marker its processes inherit).
#[tokio::test]
async fn stop_after_agentctl_kill9_ends_what_the_agent_detached() {
    let f = fixture();
    let handle = f
        .driver
        .launch(&spec(f.workspace.path()))
        .await
        .expect("launch");
    let detached = launch_agent_after(&f, &handle, "setsid", "detached.pid").await;
    assert!(is_running(detached));
    let agentctl = pid_of(&handle);
    OwnedProcess::open(agentctl, handle.pid_start_time.expect("start time"))
        .expect("our process")
        .signal(rustix::process::Signal::KILL)
        .expect("kill -9");
    assert_gone(agentctl).await;
    assert!(
        is_running(detached),
        "the detached process outlives a killed agentctl (nothing else ends it)"
    );

    f.driver.stop(&handle).await.expect("stop");
    assert_gone(detached).await;
}

/// Where the host allows a cgroup v2 per executor (this test requires it,
/// as the CI machines do): agentctl runs in its own group, and a process
/// that left its session AND cleared its environment (so no marker finds
/// it) is still ended when the executor stops after agentctl's `kill -9`.
#[tokio::test]
async fn the_executor_cgroup_ends_even_a_process_that_cleared_its_environment() {
    let f = fixture();
    let handle = f
        .driver
        .launch(&spec(f.workspace.path()))
        .await
        .expect("launch");
    let agentctl = pid_of(&handle);
    let own_group = std::fs::read_to_string(format!("/proc/{agentctl}/cgroup")).unwrap_or_default();
    let record = f.run.path().join(format!("{}.cgroup", handle.executor_id));
    assert!(
        record.is_file(),
        "no cgroup v2 for the executor: this host has no writable cgroup2 mount \
         (needed for this test; agentctl's cgroup: {own_group})"
    );
    let group = std::fs::read_to_string(&record).expect("record");
    assert!(
        own_group
            .lines()
            .any(|l| l.starts_with("0::")
                && l.ends_with(&format!("/sessiond/{}", handle.executor_id))),
        "agentctl is in the executor's group {group}: {own_group}"
    );
    let escaped = launch_agent_after(&f, &handle, "env -i setsid", "escaped.pid").await;
    OwnedProcess::open(agentctl, handle.pid_start_time.expect("start time"))
        .expect("our process")
        .signal(rustix::process::Signal::KILL)
        .expect("kill -9");
    assert_gone(agentctl).await;
    assert!(is_running(escaped), "nothing else ends it");

    f.driver.stop(&handle).await.expect("stop");
    assert_gone(escaped).await;
    assert!(
        !std::path::Path::new(group.trim()).exists(),
        "the group {group} is removed"
    );
    assert!(!record.exists(), "and its record");
}

/// Launches the demo agent behind `/bin/sh -c`, which first starts
/// `sleep 1000` through `detach` (e.g. `setsid`) with its output closed;
/// returns that process's pid once it runs.
async fn launch_agent_after(
    f: &Fixture,
    handle: &ExecutorHandle,
    detach: &str,
    pidfile: &str,
) -> u32 {
    let pidfile = f.workspace.path().join(pidfile);
    let demo = agentctl_path().with_file_name("acp-demo-agent");
    let script = format!(
        "{detach} sh -c 'echo $$ > {}; exec sleep 1000' </dev/null >/dev/null 2>&1 & exec {}",
        pidfile.display(),
        demo.display()
    );
    f.driver
        .client(handle)
        .expect("client")
        .launch_agent(pb::LaunchAgentRequest {
            command: "/bin/sh".into(),
            args: vec!["-c".into(), script],
            ..Default::default()
        })
        .await
        .expect("agent launched");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(pid) = std::fs::read_to_string(&pidfile)
            .ok()
            .and_then(|t| t.trim().parse().ok())
        {
            return pid;
        }
        assert!(
            Instant::now() < deadline,
            "the detached process never started"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
