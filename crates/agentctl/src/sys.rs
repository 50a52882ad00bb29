//! The only place agentctl calls libc directly: signalling a process group.
#![allow(unsafe_code)]

use std::io;

/// `SIGTERM`, re-exported so callers need not depend on libc.
pub const SIGTERM: i32 = libc::SIGTERM;
/// `SIGKILL`, re-exported so callers need not depend on libc.
pub const SIGKILL: i32 = libc::SIGKILL;

/// Sends `signal` to every process in the group `pgid`.
///
/// Refuses group ids 0 and 1 (our own group and init's), so a bad value can
/// never signal agentctl itself or the whole machine. A group that no longer
/// exists is reported as `ErrorKind::NotFound`.
pub fn kill_group(pgid: u32, signal: i32) -> io::Result<()> {
    let pgid = libc::pid_t::try_from(pgid)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "process group id too large"))?;
    if pgid <= 1 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "refusing to signal process group 0 or 1",
        ));
    }
    // SAFETY: killpg takes two integers and has no memory-safety
    // preconditions; pgid > 1 rules out "own group" and "every process".
    let rc = unsafe { libc::killpg(pgid, signal) };
    if rc == 0 {
        Ok(())
    } else {
        let err = io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::ESRCH) {
            Err(io::Error::new(
                io::ErrorKind::NotFound,
                "no such process group",
            ))
        } else {
            Err(err)
        }
    }
}
