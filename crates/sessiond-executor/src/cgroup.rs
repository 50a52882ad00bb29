//! A cgroup v2 per standalone executor: one kill domain holding agentctl,
//! its agent and everything they start, which the backend can end by itself
//! (`cgroup.kill`) even when agentctl is dead and a process left its
//! session, cleared its environment or was reparented to init.
//!
//! The group is `<sessiond's own cgroup>/sessiond/<executor id>` on the
//! cgroup2 mount, and its path is recorded in `<run_dir>/<executor id>.cgroup`
//! before agentctl starts (a later backend, in another cgroup, finds it
//! there). Where the host does not allow it (no cgroup2 mount, no write
//! access: a container, an undelegated systemd unit) the executor runs
//! without one and is contained by its journal's marker instead
//! (`agentctl --reap`); see docs/decisions/0023-executor-identity-and-containment.md.

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

/// Where new executor cgroups go: `None` when this host has no writable
/// cgroup2 hierarchy for us.
pub(crate) fn base() -> Option<PathBuf> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    // Fields: ... mount point (5th) ... " - " fstype source options.
    let mount = mountinfo.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        (right.split_whitespace().next()? == "cgroup2")
            .then(|| left.split_whitespace().nth(4).map(PathBuf::from))?
    })?;
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let own = own.lines().find_map(|l| l.strip_prefix("0::"))?;
    let base = mount.join(own.trim_start_matches('/')).join("sessiond");
    std::fs::create_dir_all(&base).ok()?;
    prune(&base);
    Some(base)
}

/// An empty group older than any launch in progress: its agentctl exited
/// (idle timeout, crash) and nobody stopped the executor.
const ABANDONED_AFTER: Duration = Duration::from_secs(600);

/// Removes the abandoned groups under `base`, so they do not pile up. An
/// executor launched again later gets a new one; a stop finds none and
/// has nothing to kill.
fn prune(base: &Path) {
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        let old = e
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > ABANDONED_AFTER);
        let empty = std::fs::read_to_string(path.join("cgroup.events"))
            .is_ok_and(|ev| ev.lines().any(|l| l == "populated 0"));
        if old && empty {
            // Fails harmlessly if a process entered it meanwhile.
            let _ = remove_tree(&path);
        }
    }
}

/// Creates the executor's group under `base`; `None` when the host refuses.
pub(crate) fn create(base: &Path, name: &str) -> Option<PathBuf> {
    let group = base.join(name);
    match std::fs::create_dir(&group) {
        Ok(()) => Some(group),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Some(group),
        Err(e) => {
            tracing::debug!(group = %group.display(), error = %e, "no cgroup for the executor");
            None
        }
    }
}

/// Moves `pid` into `group`.
pub(crate) fn enter(group: &Path, pid: u32) -> std::io::Result<()> {
    std::fs::write(group.join("cgroup.procs"), pid.to_string())
}

/// Processes in `group` (its own, not its children's).
fn members(group: &Path) -> Vec<u32> {
    std::fs::read_to_string(group.join("cgroup.procs"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// Kills every process in `group` and its child groups, waits (up to
/// `limit`) until none is left, and removes the groups. True when it is gone
/// (or never existed).
pub(crate) async fn kill(group: &Path, limit: Duration) -> bool {
    if !group.is_dir() {
        return true;
    }
    let deadline = Instant::now() + limit;
    loop {
        // `cgroup.kill` (Linux 5.14) kills the whole subtree, forks racing it
        // included; before it, each member is killed by pid, which cannot hit
        // another process: a pid stays listed until its process is reaped.
        if std::fs::write(group.join("cgroup.kill"), "1").is_err() {
            for pid in members(group) {
                if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
                    let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                }
            }
        }
        if remove_tree(group) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Removes `group` and its child groups, deepest first; false while any
/// still holds a process.
fn remove_tree(group: &Path) -> bool {
    if let Ok(entries) = std::fs::read_dir(group) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) && !remove_tree(&e.path()) {
                return false;
            }
        }
    }
    match std::fs::remove_dir(group) {
        Ok(()) => true,
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
    }
}
