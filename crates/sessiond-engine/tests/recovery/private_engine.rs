//! A Docker engine of one test's own: a `dockerd` with its own data and exec
//! roots and no bridge, iptables or NAT (loopback only), which the test may stop
//! and start again without touching the engine every other Docker test
//! shares. The agentctl image is copied into it from the shared engine.

use std::{
    fs,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use sessiond_testkit::dockerd;

use crate::docker_support::DockerEnv;

pub struct PrivateEngine {
    dir: PathBuf,
    pub host: String,
    child: Option<Child>,
}

impl PrivateEngine {
    /// Starts a dockerd under a fresh directory and loads `shared.image`
    /// into it. Panics naming what is missing.
    pub fn start(shared: &DockerEnv) -> PrivateEngine {
        // Short: containerd's sockets live under the exec root, and unix
        // socket paths are limited to 108 bytes.
        let dir = tempfile::Builder::new()
            .prefix("sdk-")
            .tempdir_in("/tmp")
            .expect("a directory for the private dockerd")
            .keep();
        let host = format!("unix://{}", dir.join("docker.sock").display());
        let mut engine = PrivateEngine {
            dir,
            host,
            child: None,
        };
        engine.run_daemon();
        let image_tar = engine.dir.join("image.tar");
        docker(
            &shared.host,
            &["save", "-o"],
            &[image_tar.as_os_str(), shared.image.as_ref()],
        );
        docker(
            &engine.host,
            &["load", "-q", "-i"],
            &[image_tar.as_os_str()],
        );
        let _ = fs::remove_file(&image_tar);
        engine
    }

    /// Starts dockerd on this engine's directories and waits until it answers.
    pub fn run_daemon(&mut self) {
        assert!(self.child.is_none(), "the private dockerd already runs");
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("dockerd.log"))
            .unwrap();
        let child = dockerd::command(&self.dir, &self.host)
            .expect("dockerd not found: install docker.io")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting dockerd (needs docker.io): {e}"));
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(120);
        while !dockerd::answers(&self.host) {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "the private dockerd exited ({status}):\n{}",
                    self.log_tail()
                );
            }
            assert!(
                Instant::now() < deadline,
                "the private dockerd did not answer within 120 s:\n{}",
                self.log_tail()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Stops dockerd as a host's service manager would (TERM: it stops its
    /// containers, then exits) and waits for it.
    pub fn stop_daemon(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(60);
        while child.try_wait().unwrap().is_none() {
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn log_tail(&self) -> String {
        let text = fs::read_to_string(self.dir.join("dockerd.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

impl Drop for PrivateEngine {
    fn drop(&mut self) {
        if self.child.is_some() {
            // Its containers first, so nothing of this test outlives it.
            let _ = Command::new("docker")
                .args(["-H", &self.host, "rm", "-f"])
                .args(container_ids(&self.host))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
        self.stop_daemon();
        dockerd::unmount_under(&self.dir);
        let _ = fs::remove_dir_all(&self.dir);
    }
}

fn container_ids(host: &str) -> Vec<String> {
    Command::new("docker")
        .args(["-H", host, "ps", "-aq"])
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

fn docker(host: &str, args: &[&str], more: &[&std::ffi::OsStr]) {
    let out = Command::new("docker")
        .args(["-H", host])
        .args(args)
        .args(more)
        .output()
        .unwrap_or_else(|e| panic!("running the docker CLI (needs docker.io): {e}"));
    assert!(
        out.status.success(),
        "docker {args:?} {more:?} at {host} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
