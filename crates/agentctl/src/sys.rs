//! The only place agentctl calls libc directly: signalling a process group,
//! and tying the agent's life to agentctl's.
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

/// Makes the kernel send `SIGKILL` to the child `cmd` spawns when the thread
/// that spawned it ends (`PR_SET_PDEATHSIG`), so an agent does not outlive an
/// agentctl that was killed without the chance to stop it (`kill -9`, OOM).
/// The agent runs in its own process group, so nothing else would reach it.
///
/// Caveat: "parent" means the spawning *thread*, not the process. agentctl
/// spawns the agent from an async task, which runs on a tokio worker thread of
/// the multi-threaded runtime; those threads live as long as the runtime, i.e.
/// as long as agentctl. Spawning from a `spawn_blocking` thread (which tokio
/// ends after a while idle) or from inside `block_in_place` would kill the
/// agent early, so callers must not do that.
///
/// If agentctl already died between `fork` and the `prctl` (the signal is
/// then never sent), the child notices that its parent changed and fails the
/// spawn instead of running unsupervised.
pub fn kill_on_parent_death(cmd: &mut tokio::process::Command) {
    // Read before fork: in the child, `getppid` must still be this process.
    let parent = libc::pid_t::try_from(std::process::id()).unwrap_or(0);
    // SAFETY: the closure runs in the forked child before exec, where only
    // async-signal-safe functions may be called. It calls `prctl` and
    // `getppid` (both plain system calls) and, on failure, reads `errno`
    // through `last_os_error` / builds an `io::Error` from a raw code, which
    // neither allocates nor takes locks. It touches no memory of the parent
    // beyond the copied `parent` integer.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

/// Marks agentctl non-dumpable (`PR_SET_DUMPABLE` 0): its `/proc/<pid>`
/// files (`environ`, `mem`, `fd`, ...) become root's and `ptrace` is refused
/// to processes without `CAP_SYS_PTRACE`, so the agent and the commands it
/// runs — the same user, and in a container with no capabilities — cannot
/// read the secret out of agentctl's environment or memory. The agent gets
/// the ordinary flag back when it execs its own program.
pub fn forbid_inspection() -> io::Result<()> {
    // SAFETY: prctl with PR_SET_DUMPABLE takes integers only and changes a
    // flag of this process; no memory is passed.
    let rc = unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0 as libc::c_ulong, 0, 0, 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Runs the child `cmd` spawns as the leader of a new session (and process
/// group), so its whole tree can be told apart from agentctl's: every
/// descendant that does not call `setsid` itself keeps that session id.
pub fn new_session(cmd: &mut tokio::process::Command) {
    // SAFETY: `setsid` is an async-signal-safe system call; on failure only
    // `errno` is read. Nothing of the parent's memory is touched.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// The inode of the pipe (or file) behind `fd`.
pub fn fd_inode(fd: &impl std::os::fd::AsRawFd) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .ok()
        .map(|m| m.ino())
}

/// SIGKILLs every other process that holds one of the pipes `inodes` open
/// (found through `/proc/*/fd`); returns how many it signalled. This reaches
/// what a command started and detached from its group (`setsid cmd &`) as
/// long as it still holds the command's output.
pub fn kill_pipe_holders(inodes: &[u64]) -> usize {
    if inodes.is_empty() {
        return 0;
    }
    let wanted: Vec<String> = inodes.iter().map(|i| format!("pipe:[{i}]")).collect();
    let me = std::process::id();
    let mut killed = 0;
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return 0;
    };
    for entry in procs.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if pid == me || pid <= 1 {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        let holds = fds.flatten().any(|fd| {
            std::fs::read_link(fd.path())
                .is_ok_and(|target| wanted.iter().any(|w| target.as_os_str() == w.as_str()))
        });
        if holds && let Ok(pid) = libc::pid_t::try_from(pid) {
            // SAFETY: kill takes two integers; pid > 1 and not our own.
            if unsafe { libc::kill(pid, libc::SIGKILL) } == 0 {
                killed += 1;
            }
        }
    }
    killed
}

/// Sends SIGKILL to ourselves: the test hook for crash points (see
/// `AgentManager::crash_point`).
pub fn kill_self() -> ! {
    // SAFETY: plain system calls on our own pid.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
        // Still here: we are PID 1 of a container, which its own signals
        // cannot kill. Exit at once, running nothing (no destructors, no
        // flush): to the journal and the backend it is the same death.
        libc::_exit(137)
    }
}

/// Sends `signal` to one process.
pub fn kill_pid(pid: u32, signal: i32) -> io::Result<()> {
    let pid = libc::pid_t::try_from(pid)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "pid too large"))?;
    if pid <= 1 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "refusing to signal pid 0 or 1",
        ));
    }
    // SAFETY: kill takes two integers; pid > 1 rules out groups and init.
    if unsafe { libc::kill(pid, signal) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}
