//! `apt-get` that waits for a busy package manager instead of failing.
//!
//! Another `apt-get`/`dpkg` (unattended upgrades, a second provisioning
//! step) holds the dpkg or lists lock for a while; apt's own
//! `DPkg::Lock::Timeout` covers the dpkg lock of `install`, and a run that
//! still fails on a lock is retried until [`LOCK_WAIT`] has passed.

use std::{
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};

/// How long to wait for another package manager to finish.
const LOCK_WAIT: Duration = Duration::from_secs(900);

/// `apt-get <args>` (noninteractive), waiting out a held lock.
pub fn apt_get(args: &[&str]) -> anyhow::Result<()> {
    let started = Instant::now();
    let timeout = format!("DPkg::Lock::Timeout={}", LOCK_WAIT.as_secs());
    loop {
        let mut cmd = Command::new("apt-get");
        cmd.args(["-o", &timeout])
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdin(Stdio::null())
            .stderr(Stdio::piped());
        eprintln!("xtask: ==> {cmd:?}");
        let out = cmd
            .spawn()
            .and_then(|c| c.wait_with_output())
            .with_context(|| format!("cannot start {cmd:?}"))?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        eprint!("{stderr}");
        if out.status.success() {
            return Ok(());
        }
        if !lock_held(&stderr) {
            bail!("apt-get {args:?} failed ({})", out.status);
        }
        if started.elapsed() > LOCK_WAIT {
            bail!(
                "apt-get {args:?}: another package manager held its lock for over {}s",
                LOCK_WAIT.as_secs()
            );
        }
        eprintln!("xtask: another package manager holds the lock; waiting for it");
        std::thread::sleep(Duration::from_secs(5));
    }
}

/// apt's messages for a lock another process holds.
fn lock_held(stderr: &str) -> bool {
    stderr.contains("Could not get lock") || stderr.contains("Unable to acquire the dpkg")
}

#[cfg(test)]
mod tests {
    use super::lock_held;

    #[test]
    fn recognises_a_held_lock() {
        assert!(lock_held(
            "E: Could not get lock /var/lib/dpkg/lock-frontend. It is held by process 4242 (apt-get)\n"
        ));
        assert!(lock_held(
            "E: Unable to acquire the dpkg frontend lock (/var/lib/dpkg/lock-frontend), is another process using it?"
        ));
        assert!(!lock_held("E: Unable to locate package nosuchpackage"));
    }
}
