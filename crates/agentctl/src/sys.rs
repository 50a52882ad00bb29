//! The only place agentctl calls libc directly: signalling a process group,
//! tying the agent's life to agentctl's, the clock tick of CPU times, and
//! keeping inherited descriptors from its children.
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

/// Marks every descriptor from 3 up close-on-exec: one that agentctl's
/// parent left open without the flag (a shell's, a harness's pipe) must
/// not reach the agent, its terminals and Exec's children. agentctl's own
/// descriptors carry the flag already. An old kernel (no `close_range`)
/// changes nothing.
pub fn keep_inherited_descriptors_from_children() {
    // SAFETY: close_range takes integers; with CLOSE_RANGE_CLOEXEC it only
    // sets a flag on descriptors of this process, closing none.
    unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3 as libc::c_uint,
            libc::c_uint::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        );
    }
}

/// Makes the child `cmd` spawns enter the directory `dir` (an open handle)
/// just before it execs, whatever its path names by then.
pub fn enter_dir(cmd: &mut tokio::process::Command, dir: &std::os::fd::OwnedFd) {
    use std::os::fd::AsRawFd;
    let raw = dir.as_raw_fd();
    // SAFETY: the closure runs in the forked child before exec and calls
    // only `fchdir`, an async-signal-safe system call, on a descriptor the
    // parent keeps open until the spawn returned (the caller borrows it for
    // that long); on failure it reads `errno`.
    unsafe {
        cmd.pre_exec(move || {
            if libc::fchdir(raw) != 0 {
                return Err(io::Error::last_os_error());
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
///
/// The child also starts with every signal at its default action and none
/// blocked, as a service manager starts a service: a signal ignored by
/// whoever started sessiond (`nohup` ignores SIGHUP, a background job of a
/// shell SIGINT and SIGQUIT) would otherwise stay ignored through `exec`,
/// and the agent's and the commands' own `kill -HUP` would do nothing.
pub fn new_session(cmd: &mut tokio::process::Command) {
    // SAFETY: `setsid`, `sigprocmask` and `sigaction` are async-signal-safe
    // system calls; the sigset and the sigaction are the child's own stack
    // values; on failure only `errno` is read. Nothing of the parent's
    // memory is touched.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(io::Error::last_os_error());
            }
            let mut none: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut none);
            if libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut()) != 0 {
                return Err(io::Error::last_os_error());
            }
            let mut default: libc::sigaction = std::mem::zeroed();
            default.sa_sigaction = libc::SIG_DFL;
            // SIGKILL and SIGSTOP refuse (and need no) reset; the real-time
            // signals are reset too.
            for sig in 1..=64 {
                if sig != libc::SIGKILL && sig != libc::SIGSTOP {
                    libc::sigaction(sig, &default, std::ptr::null_mut());
                }
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

/// Clock ticks per second, the unit of CPU times in `/proc/<pid>/stat`
/// (`sysconf(_SC_CLK_TCK)`; 100 on Linux, also when sysconf fails).
pub fn clock_ticks_per_sec() -> u64 {
    static TICKS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        // SAFETY: sysconf takes an integer and reads no memory of ours.
        let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        u64::try_from(t).ok().filter(|&t| t > 0).unwrap_or(100)
    })
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

/// How [`open_beneath`] resolves a path below a directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolve {
    /// `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` where the kernel has
    /// it (5.6+), else the walk.
    Best,
    /// One `openat(O_NOFOLLOW)` per component (the fallback; tests pick it).
    Walk,
}

/// Set once `openat2` answered ENOSYS (an old kernel, or a seccomp filter
/// that does not know it): every later call walks.
static NO_OPENAT2: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether [`Resolve::Best`] uses `openat2` (false once it answered ENOSYS).
pub fn openat2_in_use() -> bool {
    !NO_OPENAT2.load(std::sync::atomic::Ordering::Relaxed)
}

fn c_path(p: &std::path::Path) -> io::Result<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(p.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

fn check(fd: libc::c_int) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    if fd < 0 {
        Err(io::Error::last_os_error())
    } else {
        // SAFETY: the kernel just returned this descriptor to us; nobody
        // else owns it.
        Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
    }
}

fn openat(
    dir: std::os::fd::BorrowedFd<'_>,
    name: &std::ffi::CStr,
    flags: libc::c_int,
    mode: libc::mode_t,
) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::AsRawFd;
    // SAFETY: `dir` is a live descriptor and `name` a NUL-terminated string
    // that outlives the call.
    check(unsafe {
        libc::openat(
            dir.as_raw_fd(),
            name.as_ptr(),
            flags | libc::O_CLOEXEC,
            libc::c_uint::from(mode),
        )
    })
}

/// Opens `rel` (plain components only, empty for `dir` itself) beneath
/// `dir` with `flags`, never following a symlink on the way or at the end
/// and never leaving `dir`: a component swapped for a symlink after the
/// caller checked the path fails with ELOOP (or EXDEV), so nothing outside
/// is opened. `mode` applies with `O_CREAT`.
pub fn open_beneath(
    dir: std::os::fd::BorrowedFd<'_>,
    rel: &std::path::Path,
    flags: libc::c_int,
    mode: libc::mode_t,
    how: Resolve,
) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::AsRawFd;
    use std::path::Component;
    let mut names = Vec::new();
    for c in rel.components() {
        match c {
            Component::Normal(n) => names.push(c_path(std::path::Path::new(n))?),
            Component::CurDir => {}
            _ => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "only plain path components may be opened beneath a directory",
                ));
            }
        }
    }
    if how == Resolve::Best && !NO_OPENAT2.load(std::sync::atomic::Ordering::Relaxed) {
        let path = if names.is_empty() {
            c"."
        } else {
            &*c_path(rel)?
        };
        // The kernel's `struct open_how` (libc's is non-exhaustive).
        #[repr(C)]
        struct OpenHow {
            flags: u64,
            mode: u64,
            resolve: u64,
        }
        let open_how = OpenHow {
            flags: (flags | libc::O_CLOEXEC | libc::O_NOFOLLOW) as u64,
            mode: if flags & libc::O_CREAT != 0 {
                u64::from(mode)
            } else {
                0
            },
            resolve: libc::RESOLVE_BENEATH
                | libc::RESOLVE_NO_SYMLINKS
                | libc::RESOLVE_NO_MAGICLINKS,
        };
        // SAFETY: openat2 reads `open_how` (of the size passed) and the
        // NUL-terminated path, both alive for the call.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                dir.as_raw_fd(),
                path.as_ptr(),
                &raw const open_how,
                std::mem::size_of::<OpenHow>(),
            )
        };
        match check(libc::c_int::try_from(fd).unwrap_or(-1)) {
            Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
                NO_OPENAT2.store(true, std::sync::atomic::Ordering::Relaxed);
            }
            // A seccomp filter that refuses unknown calls with EPERM (or an
            // immutable file): the walk is as safe, and answers for itself.
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => {}
            done => return done,
        }
    }
    // The walk: each intermediate directory opened with O_NOFOLLOW and
    // checked to be a directory, the next looked up relative to it.
    let Some((last, parents)) = names.split_last() else {
        return openat(dir, c".", flags | libc::O_NOFOLLOW, mode);
    };
    let mut held: Option<std::os::fd::OwnedFd> = None;
    for name in parents {
        let at = held.as_ref().map_or(dir, std::os::fd::AsFd::as_fd);
        let next = openat(at, name, libc::O_PATH | libc::O_NOFOLLOW, 0)?;
        let meta = std::fs::File::from(next.try_clone()?).metadata()?;
        if meta.file_type().is_symlink() {
            return Err(io::Error::from_raw_os_error(libc::ELOOP));
        }
        if !meta.is_dir() {
            return Err(io::Error::from_raw_os_error(libc::ENOTDIR));
        }
        held = Some(next);
    }
    let at = held.as_ref().map_or(dir, std::os::fd::AsFd::as_fd);
    openat(at, last, flags | libc::O_NOFOLLOW, mode)
}

/// Creates the directories of `rel` beneath `dir` that do not exist
/// (`mkdir -p`), never following a symlink (each step is [`open_beneath`]).
pub fn mkdirs_beneath(
    dir: std::os::fd::BorrowedFd<'_>,
    rel: &std::path::Path,
    how: Resolve,
) -> io::Result<()> {
    let mut so_far = std::path::PathBuf::new();
    for c in rel.components() {
        so_far.push(c);
        let parent = so_far.parent().unwrap_or(std::path::Path::new(""));
        let at = open_beneath(dir, parent, libc::O_PATH | libc::O_DIRECTORY, 0, how)?;
        let name = c_path(std::path::Path::new(c.as_os_str()))?;
        // SAFETY: `at` is a live descriptor and `name` NUL-terminated.
        let rc =
            unsafe { libc::mkdirat(std::os::fd::AsRawFd::as_raw_fd(&at), name.as_ptr(), 0o755) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EEXIST) {
                return Err(e);
            }
        }
    }
    Ok(())
}
