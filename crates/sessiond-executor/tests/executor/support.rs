use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use sessiond_domain::{ExecutorId, SessionId, TaskId};
use sessiond_executor::{ClientConfig, LaunchSpec, process};

/// The agentctl binary next to this test binary's directory (target/<profile>).
pub fn agentctl_path() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>");
    let path = profile_dir.join("agentctl");
    assert!(
        path.is_file(),
        "{} not found: build it first (`cargo build -p agentctl`, or `cargo xtask ci`)",
        path.display()
    );
    path
}

pub fn spec(workspace: &Path) -> LaunchSpec {
    LaunchSpec {
        executor_id: ExecutorId::new(),
        session_id: SessionId::new(),
        task_id: TaskId::new(),
        workspace_path: workspace.to_owned(),
        generation: 1,
        remote: None,
        image: None,
        lease_epoch: None,
        repository: None,
    }
}

/// Short deadlines so a broken case fails fast.
pub fn client_config() -> ClientConfig {
    ClientConfig {
        connect_timeout: Duration::from_secs(1),
        call_timeout: Duration::from_secs(2),
        ..ClientConfig::default()
    }
}

pub fn is_running(pid: u32) -> bool {
    process::stat(pid).is_some_and(|s| s.is_running())
}

/// Waits until `pid` no longer runs (gone, or a zombie), then asserts it.
pub async fn assert_gone(pid: u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while is_running(pid) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!is_running(pid), "process {pid} is still running");
}

/// An agentctl this test starts itself (what a remote host would run).
pub struct ManualAgentctl {
    pub child: Child,
    pub executor_id: ExecutorId,
    pub secret: String,
    pub port: u16,
}

impl ManualAgentctl {
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Starts agentctl listening on `listen` and waits for its port file.
    pub async fn start(workspace: &Path, listen: &str) -> Self {
        Self::start_as(
            workspace,
            listen,
            ExecutorId::new(),
            sessiond_executor::fresh_secret(),
        )
        .await
    }

    pub async fn start_as(
        workspace: &Path,
        listen: &str,
        executor_id: ExecutorId,
        secret: String,
    ) -> Self {
        let port_file = workspace.join(format!(".port-{executor_id}"));
        let child = Command::new(agentctl_path())
            .args([
                "--executor-id",
                &executor_id.to_string(),
                "--listen",
                listen,
            ])
            .arg("--workspace")
            .arg(workspace)
            .arg("--port-file")
            .arg(&port_file)
            // Exits by itself should a failing test leave it behind.
            .args(["--idle-timeout", "120s"])
            .env("AGENTCTL_SECRET", &secret)
            .env("AGENTCTL_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn agentctl");
        let deadline = Instant::now() + Duration::from_secs(10);
        let port = loop {
            if let Some(port) = std::fs::read_to_string(&port_file)
                .ok()
                .and_then(|s| s.trim().parse().ok())
            {
                break port;
            }
            assert!(Instant::now() < deadline, "agentctl wrote no port file");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        Self {
            child,
            executor_id,
            secret,
            port,
        }
    }

    /// Kills it and asserts that it is gone.
    pub async fn kill(self) {
        let pid = self.child.id();
        drop(self);
        assert_gone(pid).await;
    }
}

impl Drop for ManualAgentctl {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A free loopback port right now (nothing listens on it after this returns).
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr").port()
}

/// Running processes (not zombies) whose command line mentions `needle`.
pub fn pids_mentioning(needle: &str) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(needle))
        })
        .filter(|pid| is_running(*pid))
        .collect()
}
