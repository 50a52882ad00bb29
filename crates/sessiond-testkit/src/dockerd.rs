//! A private `dockerd` for tests: how to start one the way these machines
//! allow (no bridge network, no iptables, NAT or forwarding: loopback
//! traffic only), whether one answers, and the mounts it leaves behind.
//! Used by `cargo xtask` (the suite's shared engine) and by the tests that
//! stop and start an engine of their own.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

/// `dockerd` with its own data root, exec root, pid file and socket under
/// `dir`, serving `host` (`unix://...`). Output and stdin are the caller's.
pub fn command(dir: &Path, host: &str) -> Option<Command> {
    let mut cmd = Command::new(find_program("dockerd")?);
    cmd.args([
        "--bridge=none",
        "--iptables=false",
        "--ip6tables=false",
        "--ip-forward=false",
        "--ip-masq=false",
    ])
    .arg("--data-root")
    .arg(dir.join("data"))
    .arg("--exec-root")
    .arg(dir.join("exec"))
    .arg("--pidfile")
    .arg(dir.join("dockerd.pid"))
    .arg("-H")
    .arg(host);
    Some(cmd)
}

/// An engine answers at `host` (through the `docker` CLI).
pub fn answers(host: &str) -> bool {
    Command::new("docker")
        .args(["-H", host, "version", "--format", "{{.Server.APIVersion}}"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `program` on `PATH`, or in the sbin directories a non-login root shell
/// may lack on its `PATH`.
pub fn find_program(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/bin", "/sbin"].map(PathBuf::from))
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
}

/// Unmounts what a stopped dockerd left mounted under `dir` (its default
/// network namespace, a killed container's mounts), deepest first.
pub fn unmount_under(dir: &Path) {
    for point in mounts_under(dir) {
        let _ = Command::new("umount").arg("-l").arg(&point).status();
    }
}

/// Mount points at or below `dir`, deepest first.
fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let mut points: Vec<PathBuf> = text
        .lines()
        .filter_map(|line| line.split_whitespace().nth(1))
        // /proc/self/mounts escapes spaces as \040; our paths have none.
        .map(PathBuf::from)
        .filter(|p| p.starts_with(dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    points.dedup();
    points
}
