//! Agent process trees and how to end one for certain.
//!
//! An agent runs as the leader of its own session, with a random marker in
//! its environment (`AGENTCTL_AGENT_MARKER`) that every descendant inherits.
//! A process belongs to a tree when its environment carries the tree's
//! marker: proof that survives the leader's death and pid reuse (a bare pid,
//! or a session id whose leader is gone, proves nothing). Descendants that
//! scrub their environment are still found through the session id while the
//! leader lives with its recorded start time.

use crate::journal::AgentRecord;
use crate::sys;

/// The environment variable holding a tree's marker.
pub const MARKER_ENV: &str = "AGENTCTL_AGENT_MARKER";

/// Start time of `pid` (clock ticks after boot) and its session id.
pub fn stat(pid: u32) -> Option<(u64, u32)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may contain
    // anything; field 3 (state) is the first after ") ".
    let rest = &text[text.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    if fields.first() == Some(&"Z") || fields.first() == Some(&"X") {
        return None;
    }
    let sid = fields.get(3)?.parse().ok()?;
    let start = fields.get(19)?.parse().ok()?;
    Some((start, sid))
}

/// `pid`'s environment holds `name=value`.
fn has_marker(pid: u32, name: &str, value: &str) -> bool {
    let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else {
        return false;
    };
    let want = format!("{name}={value}");
    env.split(|b| *b == 0).any(|kv| kv == want.as_bytes())
}

/// SIGKILLs every process whose environment holds `name=value` (a marker
/// given to a process and inherited by all it starts, `setsid` or not),
/// until none is left: a process may fork while the scan runs. Returns how
/// many were killed.
pub fn end_marked(name: &str, value: &str) -> usize {
    let me = std::process::id();
    let mut killed = 0;
    // Bounded: each round kills what it finds, so only a fork racing the
    // scan needs another.
    for _ in 0..8 {
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return killed;
        };
        let found: Vec<u32> = dir
            .flatten()
            .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()))
            .filter(|&pid| pid != me && pid > 1)
            .filter(|&pid| stat(pid).is_some() && has_marker(pid, name, value))
            .collect();
        if found.is_empty() {
            break;
        }
        for &pid in &found {
            if sys::kill_pid(pid, sys::SIGKILL).is_ok() {
                killed += 1;
            }
        }
    }
    killed
}

/// Live processes of the tree `a`.
pub fn members(a: &AgentRecord) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let leader_alive = stat(a.pid).is_some_and(|(st, _)| st == a.start_time);
    let me = std::process::id();
    dir.flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()))
        .filter(|&pid| pid != me)
        .filter(|&pid| {
            let Some((_, sid)) = stat(pid) else {
                return false;
            };
            (!a.marker.is_empty() && has_marker(pid, MARKER_ENV, &a.marker))
                || (leader_alive && sid == a.pid)
        })
        .collect()
}

/// SIGKILLs every live process of the tree `a`; returns how many were found.
pub fn end(a: &AgentRecord) -> usize {
    let found = members(a);
    for &pid in &found {
        let _ = sys::kill_pid(pid, sys::SIGKILL);
    }
    found.len()
}

/// The fields of `/proc/<pid>/stat` after the command name (which is in
/// parentheses and may contain anything): index 0 is field 3 (state).
fn stat_fields(pid: u32) -> Option<Vec<u64>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &text[text.rfind(')')? + 2..];
    Some(
        rest.split_whitespace()
            .map(|f| f.parse().unwrap_or(0))
            .collect(),
    )
}

/// CPU time of `pid` in clock ticks: user + system of the process and of
/// the children it reaped (`utime stime cutime cstime`, fields 14 to 17),
/// so a tree's total does not drop when a child ends and is waited for.
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    let f = stat_fields(pid)?;
    Some(f.get(11..15)?.iter().sum())
}

/// Time `pid`'s main thread has spent runnable but waiting for a CPU, in
/// nanoseconds (the second field of `/proc/<pid>/schedstat`); `None` when
/// the kernel keeps no such count or `pid` is gone.
pub fn run_delay_ns(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/schedstat")).ok()?;
    text.split_whitespace().nth(1)?.parse().ok()
}

/// `pid` and its live descendants, from the kernel's `children` lists
/// (`/proc/<pid>/task/<tid>/children`); `None` when the kernel keeps none
/// (built without `CONFIG_PROC_CHILDREN`) or `pid` is gone.
pub fn descendants(pid: u32) -> Option<Vec<u32>> {
    if !std::path::Path::new(&format!("/proc/{pid}/task/{pid}/children")).exists() {
        return None;
    }
    let mut found = vec![pid];
    let mut i = 0;
    // Bounded: a process tree of an agent is small, and pid reuse between
    // two reads must not make the walk loop.
    while i < found.len() && found.len() < 4096 {
        let p = found[i];
        i += 1;
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else {
            continue;
        };
        for task in tasks.flatten() {
            let Ok(text) = std::fs::read_to_string(task.path().join("children")) else {
                continue;
            };
            for child in text.split_whitespace().filter_map(|c| c.parse().ok()) {
                if !found.contains(&child) {
                    found.push(child);
                }
            }
        }
    }
    Some(found)
}

/// What a tree of processes has used of the CPU so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpuUse {
    /// CPU time, in milliseconds (see [`cpu_ticks`]).
    pub cpu_ms: u64,
    /// Time spent runnable but waiting for a CPU, in milliseconds (see
    /// [`run_delay_ns`]); `None` when no process of the tree has a count.
    pub wait_ms: Option<u64>,
}

/// What the tree `a` has used of the CPU ([`CpuUse`]), read in one walk:
/// the leader and its descendants, or, where the kernel lists no children
/// or the leader is gone, the processes carrying the tree's marker
/// ([`members`]). Zero when nothing is found. A total that drops (a
/// process ended) is kept from going backwards by [`crate::signs::Signs`].
pub fn cpu_use(a: &AgentRecord) -> CpuUse {
    let pids = descendants(a.pid).unwrap_or_else(|| members(a));
    let ticks: u64 = pids.iter().filter_map(|&p| cpu_ticks(p)).sum();
    let mut delays = pids.iter().filter_map(|&p| run_delay_ns(p)).peekable();
    let wait_ms = delays
        .peek()
        .is_some()
        .then(|| delays.sum::<u64>() / 1_000_000);
    CpuUse {
        cpu_ms: ticks.saturating_mul(1000) / sys::clock_ticks_per_sec(),
        wait_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_of_this_process_grows_while_it_computes() {
        let me = std::process::id();
        assert!(descendants(me).is_some_and(|d| d.first() == Some(&me)));
        let record = AgentRecord {
            instance: String::new(),
            pid: me,
            start_time: 0,
            marker: String::new(),
        };
        let before = cpu_use(&record).cpu_ms;
        // Spin until the kernel has charged at least two more ticks.
        let mut x = 0u64;
        while cpu_use(&record).cpu_ms < before + 20 {
            for i in 0..100_000u64 {
                x = std::hint::black_box(x.wrapping_add(i));
            }
        }
        assert!(cpu_use(&record).cpu_ms >= before + 20);
    }

    #[test]
    fn cpu_wait_of_this_process_is_counted_and_never_drops() {
        let me = std::process::id();
        let record = AgentRecord {
            instance: String::new(),
            pid: me,
            start_time: 0,
            marker: String::new(),
        };
        // Linux keeps the count (`CONFIG_SCHED_INFO`, on in every
        // distribution kernel): a machine without it fails here, naming it.
        let first = cpu_use(&record)
            .wait_ms
            .expect("/proc/self/schedstat: the kernel keeps no run-queue delay");
        assert!(cpu_use(&record).wait_ms.unwrap() >= first);
        let gone = AgentRecord {
            pid: u32::MAX - 1,
            ..record
        };
        assert_eq!(cpu_use(&gone), CpuUse::default());
    }
}
