//! What `serve` needs to be one replica among several: who it is (a stable
//! id), and that nobody else uses what must be its alone.
//!
//! Exclusive use is an OS lock (`flock`) on a file, held for the process's
//! life: the kernel drops it when the process dies, however it dies, so
//! a restart after `kill -9` is never refused and no stale heartbeat or pid
//! has to be waited out or guessed about (a pid in a database row can be
//! reused; a heartbeat needs a TTL before it means anything).
//! - SQLite: `<database>.lock` beside the database file. SQLite serves one
//!   sessiond: two would both recover, pump and relaunch every executor.
//! - PostgreSQL: `<data_dir>/sessiond.lock`. The replica id is kept in the
//!   data directory, so two processes on one data directory would be one
//!   replica twice; each replica needs its own.

use std::{
    fs::{File, OpenOptions},
    io::{Read, Seek, Write},
    os::unix::fs::{DirBuilderExt, OpenOptionsExt},
    path::{Path, PathBuf},
};

use anyhow::{Context, bail};

use crate::config::{Config, check_replica_id};

/// Held for the life of the process: dropping it releases the lock.
#[derive(Debug)]
pub struct InstanceLock {
    _file: File,
}

/// Takes the lock that keeps a second sessiond off this one's store (see
/// the module docs); the error names the holder and what to do.
pub fn lock_instance(config: &Config) -> anyhow::Result<Option<InstanceLock>> {
    if config.database_url.starts_with("postgres") {
        let path = config.data_dir.join("sessiond.lock");
        return lock_file(&path, |holder| {
            format!(
                "data_dir: {} is in use by another sessiond{holder}; every replica needs a data \
                 directory of its own (it keeps the replica id, agentctl sockets and logs)",
                config.data_dir.display()
            )
        })
        .map(Some);
    }
    let target = sessiond_store::parse_database_url(&config.database_url)
        .map(|(_, t)| t)
        .unwrap_or_else(|_| config.database_url.clone());
    if target.contains(":memory:") || target.contains("mode=memory") {
        return Ok(None);
    }
    let db = target.strip_prefix("file:").unwrap_or(&target);
    let db = db.split('?').next().unwrap_or(db);
    let path = PathBuf::from(format!("{db}.lock"));
    lock_file(&path, |holder| {
        format!(
            "database_url: the SQLite database {db} is in use by another sessiond{holder}; SQLite \
             serves one sessiond at a time: stop the other one, or use PostgreSQL to run several \
             replicas"
        )
    })
    .map(Some)
}

/// How long a start waits for a lock held by another process before it
/// names the holder and gives up.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

fn lock_file(path: &Path, refused: impl Fn(String) -> String) -> anyhow::Result<InstanceLock> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        // Private from the start: the data directory is usually this one.
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(parent)
            .with_context(|| format!("cannot create {}", parent.display()))?;
    }
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("cannot open the lock file {}", path.display()))?;
    // A holder killed a moment ago keeps the lock until the kernel has torn
    // it down: a restart right after `kill -9` waits for that, briefly.
    let deadline = std::time::Instant::now() + LOCK_WAIT;
    let mut locked = file.try_lock();
    while matches!(locked, Err(std::fs::TryLockError::WouldBlock))
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_millis(50));
        locked = file.try_lock();
    }
    match locked {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut pid = String::new();
            let _ = file.read_to_string(&mut pid);
            let pid = pid.trim();
            let holder = if pid.is_empty() {
                String::new()
            } else {
                format!(" (pid {pid}, holding {})", path.display())
            };
            bail!("{}", refused(holder));
        }
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(e).with_context(|| format!("cannot lock {}", path.display()));
        }
    }
    // Who holds it, for the next one's error message.
    file.set_len(0)?;
    file.rewind()?;
    write!(file, "{}", std::process::id())?;
    file.flush()?;
    Ok(InstanceLock { _file: file })
}

/// The configured replica id, else the one kept in `<data_dir>/replica-id`,
/// else a new one (`<hostname>-<8 hex>`) written there: stable across
/// restarts, so a restarted replica takes its own executors back at once.
pub fn replica_id(config: &Config) -> anyhow::Result<String> {
    if let Some(id) = &config.replica.id {
        return Ok(id.clone());
    }
    let path = config.data_dir.join("replica-id");
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let id = text.trim().to_owned();
            check_replica_id(&id).map_err(|e| {
                anyhow::anyhow!(
                    "{}: the replica id {id:?} {e}; fix or remove it",
                    path.display()
                )
            })?;
            Ok(id)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let host: String = hostname()
                .chars()
                .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
                .take(40)
                .collect();
            let suffix = uuid::Uuid::new_v4().simple().to_string();
            let id = format!(
                "{}-{}",
                if host.is_empty() { "sessiond" } else { &host },
                &suffix[..8]
            );
            let mut f = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
                .with_context(|| format!("data_dir: cannot create {}", path.display()))?;
            writeln!(f, "{id}")?;
            f.sync_all()?;
            Ok(id)
        }
        Err(e) => Err(e).with_context(|| format!("data_dir: cannot read {}", path.display())),
    }
}

/// This host's name (empty when the kernel does not say).
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_default()
}
