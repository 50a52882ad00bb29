//! Fencing of stale sessiond replicas: the lease epoch.
//!
//! Several sessiond replicas may share one database; exactly one owns this
//! executor, by a lease whose epoch grows by one on every claim. sessiond
//! sends that epoch on every call (metadata [`LEASE_EPOCH_METADATA`]).
//! agentctl keeps the newest epoch it has seen and refuses any call with an
//! older one (FAILED_PRECONDITION, message starting with [`STALE_EPOCH`]),
//! so a replica that was paused past its lease, and whose executor another
//! replica adopted meanwhile, cannot prompt, cancel, relaunch the agent,
//! answer permissions or touch the workspace once the new owner has made
//! one call.
//!
//! - The newest epoch is persisted (temp file, fsync, rename, fsync of the
//!   directory) before the call that raised it goes on, so a relaunched
//!   agentctl of the same executor (same file) still refuses the old owner.
//! - A call without the header is accepted and never changes the stored
//!   epoch: sessiond with an exclusive (SQLite, single-replica) store has
//!   no one to fence, an older sessiond does not send it, and direct use
//!   with the secret (operators, tests) is not a replica. The secret stays
//!   the authentication; the epoch only orders replicas that hold it.
//! - The check runs when a call arrives, so calls are ordered by arrival: a
//!   stale call that arrived before the new owner's first call ran before
//!   the handover, as it would have without fencing.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use tonic::Status;

use crate::error::{Error, Result};

/// Request metadata carrying the caller's lease epoch.
pub const LEASE_EPOCH_METADATA: &str = "sessiond-lease-epoch";

/// How the refusal of an older epoch begins (sessiond matches on it).
pub const STALE_EPOCH: &str = "stale_epoch";

/// The newest lease epoch seen, and where it is kept.
#[derive(Debug)]
pub struct EpochFence {
    newest: Mutex<Option<i64>>,
    path: Option<PathBuf>,
}

impl EpochFence {
    /// A fence kept in memory only (no state file): a restart forgets it.
    pub fn in_memory() -> Self {
        Self {
            newest: Mutex::new(None),
            path: None,
        }
    }

    /// The fence kept in `path` (read now if it exists). A file that does
    /// not hold one number is an error: guessing could let a stale replica in.
    pub fn open(path: &Path) -> Result<Self> {
        let newest = match std::fs::read_to_string(path) {
            Ok(text) => Some(text.trim().parse::<i64>().map_err(|_| {
                Error::FailedPrecondition(format!(
                    "lease epoch file {} does not hold a number ({:?}); remove it only if no \
                     other sessiond replica may still call this executor",
                    path.display(),
                    text.trim()
                ))
            })?),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => {
                return Err(Error::io(
                    format!("reading lease epoch file {}", path.display()),
                    e,
                ));
            }
        };
        Ok(Self {
            newest: Mutex::new(newest),
            path: Some(path.to_owned()),
        })
    }

    /// The newest epoch seen so far.
    pub fn newest(&self) -> Option<i64> {
        *self
            .newest
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Admits a call carrying `epoch` (`None`: no header): an older epoch
    /// is refused; a newer one is stored (durably, when kept in a file)
    /// before the call is admitted.
    pub fn admit(&self, epoch: Option<i64>) -> std::result::Result<(), Status> {
        let Some(epoch) = epoch else {
            return Ok(());
        };
        // Held while persisting, so two raisers cannot store out of order.
        let mut newest = self
            .newest
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match *newest {
            Some(n) if epoch < n => {
                tracing::warn!(
                    epoch,
                    newest = n,
                    "refused a call of a superseded sessiond replica (stale lease epoch)"
                );
                Err(Status::failed_precondition(format!(
                    "{STALE_EPOCH}: this call carries lease epoch {epoch}, but agentctl has seen \
                     epoch {n}: another sessiond replica owns this executor now"
                )))
            }
            Some(n) if epoch == n => Ok(()),
            _ => {
                if let Some(path) = &self.path {
                    persist(path, epoch).map_err(|e| {
                        Status::unavailable(format!(
                            "cannot record lease epoch {epoch} in {}: {e}",
                            path.display()
                        ))
                    })?;
                }
                tracing::info!(epoch, previous = ?*newest, "newer sessiond lease epoch; older ones are refused from now on");
                *newest = Some(epoch);
                Ok(())
            }
        }
    }

    /// [`Self::admit`] for a request's metadata.
    pub fn admit_metadata(
        &self,
        metadata: &tonic::metadata::MetadataMap,
    ) -> std::result::Result<(), Status> {
        let epoch = match metadata.get(LEASE_EPOCH_METADATA) {
            None => None,
            Some(v) => Some(
                v.to_str()
                    .ok()
                    .and_then(|s| s.trim().parse::<i64>().ok())
                    .filter(|e| *e >= 0)
                    .ok_or_else(|| {
                        Status::invalid_argument(format!(
                            "{LEASE_EPOCH_METADATA} must be a non-negative integer"
                        ))
                    })?,
            ),
        };
        self.admit(epoch)
    }
}

/// Writes `epoch` to `path` atomically and durably: a crash leaves the old
/// number or the new one, never a torn file.
fn persist(path: &Path, epoch: i64) -> std::io::Result<()> {
    let name = path
        .file_name()
        .map_or_else(|| "epoch".into(), |n| n.to_string_lossy().into_owned());
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(format!("{epoch}\n").as_bytes())?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn older_refused_newer_stored_none_accepted() {
        let dir = tempfile::tempdir().expect("ok");
        let path = dir.path().join("lease-epoch");
        let fence = EpochFence::open(&path).expect("ok");
        assert_eq!(fence.newest(), None);
        fence.admit(None).expect("ok");
        fence.admit(Some(3)).expect("ok");
        fence.admit(Some(3)).expect("ok");
        let err = fence.admit(Some(2)).expect_err("refused");
        assert_eq!(err.code(), tonic::Code::FailedPrecondition);
        assert!(err.message().starts_with(STALE_EPOCH), "{}", err.message());
        assert!(
            err.message().contains("epoch 2") && err.message().contains("epoch 3"),
            "{}",
            err.message()
        );
        // No header: accepted, and the stored epoch stays.
        fence.admit(None).expect("ok");
        assert_eq!(fence.newest(), Some(3));
        assert_eq!(std::fs::read_to_string(&path).expect("ok").trim(), "3");
        // A new process of the same executor remembers it.
        let again = EpochFence::open(&path).expect("ok");
        assert_eq!(again.newest(), Some(3));
        assert!(again.admit(Some(1)).is_err());
        again.admit(Some(4)).expect("ok");
        assert_eq!(EpochFence::open(&path).expect("ok").newest(), Some(4));
    }

    #[test]
    fn a_corrupt_file_or_header_is_an_error() {
        let dir = tempfile::tempdir().expect("ok");
        let path = dir.path().join("lease-epoch");
        std::fs::write(&path, "x").expect("ok");
        assert!(EpochFence::open(&path).is_err());
        let fence = EpochFence::in_memory();
        let mut md = tonic::metadata::MetadataMap::new();
        md.insert(LEASE_EPOCH_METADATA, "-1".parse().expect("ok"));
        assert_eq!(
            fence.admit_metadata(&md).expect_err("refused").code(),
            tonic::Code::InvalidArgument
        );
        md.insert(LEASE_EPOCH_METADATA, "7".parse().expect("ok"));
        fence.admit_metadata(&md).expect("ok");
        assert_eq!(fence.newest(), Some(7));
    }
}
