//! What both test binaries (`recovery`, `crashloop`) need of the machine:
//! the built binaries, the process table, and the local drivers. Included by
//! each with `#[path]` (a directory module, so cargo builds no third binary).

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use sessiond_executor::{
    ClientConfig, Executor, process,
    remote::{RemoteConfig, RemoteExecutor},
    standalone::{StandaloneConfig, StandaloneExecutor},
};

/// target/<profile>/<name>, beside the directory of this test binary.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let path = exe.parent().and_then(Path::parent).unwrap().join(name);
    assert!(
        path.is_file(),
        "{} not found: build it first with `cargo build -p agentctl -p acp-demo-agent`",
        path.display()
    );
    path
}

/// Quick agentctl calls: a test waits seconds, not minutes, for a dead one.
pub fn client_config() -> ClientConfig {
    ClientConfig {
        connect_timeout: Duration::from_secs(1),
        call_timeout: Duration::from_secs(5),
        ..ClientConfig::default()
    }
}

/// The standalone and remote drivers of a world whose directory is `dir`.
pub fn local_drivers(dir: &Path) -> Vec<Arc<dyn Executor>> {
    local_drivers_with(dir, &[])
}

/// [`local_drivers`] whose local agentctls get `agentctl_env` too (test hooks).
pub fn local_drivers_with(dir: &Path, agentctl_env: &[(&str, &str)]) -> Vec<Arc<dyn Executor>> {
    local_drivers_with_client(dir, agentctl_env, client_config())
}

/// [`local_drivers_with`] whose agentctl clients use `client` (a test
/// that must see a hung agentctl's stream fail within seconds).
pub fn local_drivers_with_client(
    dir: &Path,
    agentctl_env: &[(&str, &str)],
    client: ClientConfig,
) -> Vec<Arc<dyn Executor>> {
    let mut sc = StandaloneConfig::new(bin("agentctl"), dir.join("run"));
    sc.env.extend(
        agentctl_env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
    );
    sc.log_dir = Some(dir.join("run"));
    // A safety net: an agentctl a failed test leaves behind ends itself.
    sc.idle_timeout = Some(Duration::from_secs(300));
    sc.stop_grace = Duration::from_secs(2);
    sc.client = client.clone();
    let rc = RemoteConfig {
        client,
        ready_deadline: Duration::from_secs(5),
        stop_grace: Duration::from_secs(2),
        ..RemoteConfig::default()
    };
    vec![
        Arc::new(StandaloneExecutor::new(sc)),
        Arc::new(RemoteExecutor::new(rc)),
    ]
}

pub fn kill9(pid: u32) {
    let _ = std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status();
}

pub fn is_running(pid: u32) -> bool {
    process::stat(pid).is_some_and(|s| s.is_running())
}

/// Direct children of `pid` (from /proc/*/stat field 4).
pub fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(child) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{child}/stat")) else {
            continue;
        };
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            continue;
        };
        let ppid = rest
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(pid) {
            out.push(child);
        }
    }
    out
}
