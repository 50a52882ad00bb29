//! Local process identity: a pid is trusted only together with its start time.
//!
//! Linux reuses pids, so "process 4242 is alive" says nothing about whether it
//! is the agentctl we started. `/proc/<pid>/stat` field 22 (start time in clock
//! ticks since boot) tells two processes with one pid apart; signals go through
//! a pidfd opened *before* the start time is checked, so the process checked is
//! the process signalled.

use std::{
    os::fd::OwnedFd,
    time::{Duration, Instant},
};

use rustix::process::{Pid, PidfdFlags, Signal, pidfd_open, pidfd_send_signal};

use crate::error::{Error, Result};

/// A process as `/proc` shows it right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    /// Field 3: R, S, D, Z (zombie), T, X (dead), ...
    pub state: char,
    /// Field 22: start time in clock ticks after boot.
    pub start_time: u64,
}

impl ProcStat {
    /// Running in any sense: not a zombie waiting to be reaped, not dead.
    pub fn is_running(&self) -> bool {
        !matches!(self.state, 'Z' | 'X' | 'x')
    }
}

/// Reads `/proc/<pid>/stat`; `None` when no such process exists.
pub fn stat(pid: u32) -> Option<ProcStat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&text)
}

/// Parses the text of `/proc/<pid>/stat`. The command name (field 2) is in
/// parentheses and may itself hold spaces and parentheses, so fields are
/// counted from the last `)`.
pub fn parse_stat(text: &str) -> Option<ProcStat> {
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    // `fields` now stands after field 3; field 22 is 19 further on.
    let start_time = fields.nth(18)?.parse().ok()?;
    Some(ProcStat { state, start_time })
}

/// The start time of `pid`, for recording next to it right after a spawn.
pub fn start_time(pid: u32) -> Option<u64> {
    stat(pid).map(|s| s.start_time)
}

/// True when `pid` runs and is the process that started at `start_time`.
pub fn is_same_running(pid: u32, start_time: u64) -> bool {
    stat(pid).is_some_and(|s| s.is_running() && s.start_time == start_time)
}

/// True when `pid`'s command line holds `args` one after the other (checked
/// after opening a pidfd, so it is the same process that is then signalled).
pub fn has_arguments(pid: u32, args: &[&str]) -> bool {
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let argv: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
    argv.windows(args.len())
        .any(|w| w.iter().zip(args).all(|(a, b)| *a == b.as_bytes()))
}

/// A handle on the process `(pid, start_time)` that stays bound to it: `None`
/// when that process no longer runs (whatever now holds the pid).
pub struct OwnedProcess {
    pid: u32,
    fd: OwnedFd,
}

impl std::fmt::Debug for OwnedProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedProcess")
            .field("pid", &self.pid)
            .finish()
    }
}

impl OwnedProcess {
    /// Binds to `pid` if it is the process that started at `start_time` and
    /// still runs; `None` otherwise (gone, a zombie, or a reused pid).
    pub fn open(pid: u32, start_time: u64) -> Option<Self> {
        let raw = Pid::from_raw(i32::try_from(pid).ok()?)?;
        // Open first, check second: if the pid was reused before the open, the
        // start time differs and we drop the fd; if the process ends after the
        // open, the fd refers to the dead process and signals fail harmlessly.
        let fd = pidfd_open(raw, PidfdFlags::empty()).ok()?;
        is_same_running(pid, start_time).then_some(Self { pid, fd })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Sends `signal` through the pidfd, so it can only reach this process;
    /// a process that has ended meanwhile counts as signalled.
    ///
    /// # Errors
    ///
    /// [`Error::Process`] when the kernel refuses (e.g. permission).
    pub fn signal(&self, signal: Signal) -> Result<()> {
        match pidfd_send_signal(&self.fd, signal) {
            Ok(()) | Err(rustix::io::Errno::SRCH) => Ok(()),
            Err(e) => Err(Error::Process {
                pid: self.pid,
                message: format!("signal: {e}"),
            }),
        }
    }

    fn has_ended(&self, start_time: u64) -> bool {
        !is_same_running(self.pid, start_time)
    }

    /// TERM, then KILL when the process is still running after `grace`.
    /// Returns once it has ended (or became a zombie for its parent to reap).
    pub async fn terminate(&self, start_time: u64, grace: Duration) -> Result<()> {
        self.signal(Signal::TERM)?;
        if self.wait_ended(start_time, grace).await {
            return Ok(());
        }
        tracing::warn!(
            pid = self.pid,
            ?grace,
            "agentctl ignored TERM, sending KILL"
        );
        self.signal(Signal::KILL)?;
        if self.wait_ended(start_time, Duration::from_secs(5)).await {
            Ok(())
        } else {
            Err(Error::Process {
                pid: self.pid,
                message: "still running after KILL".into(),
            })
        }
    }

    async fn wait_ended(&self, start_time: u64, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            if self.has_ended(start_time) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_field_22_after_a_tricky_command_name() {
        let line = "4242 (a) b (c)) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 3 0 987654 1000 10 18446744073709551615";
        assert_eq!(
            parse_stat(line),
            Some(ProcStat {
                state: 'S',
                start_time: 987_654
            })
        );
    }

    #[test]
    fn rejects_truncated_text() {
        assert_eq!(parse_stat("4242 (x) S 1 2 3"), None);
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn reads_this_process() {
        let me = stat(std::process::id()).expect("own /proc entry");
        assert!(me.is_running());
        assert!(me.start_time > 0);
        assert!(is_same_running(std::process::id(), me.start_time));
        assert!(!is_same_running(std::process::id(), me.start_time + 1));
    }

    #[test]
    fn zombies_do_not_count_as_running() {
        assert!(
            !ProcStat {
                state: 'Z',
                start_time: 1
            }
            .is_running()
        );
        assert!(
            ProcStat {
                state: 'S',
                start_time: 1
            }
            .is_running()
        );
    }
}
