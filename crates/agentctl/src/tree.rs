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

fn has_marker(pid: u32, marker: &str) -> bool {
    let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else {
        return false;
    };
    let want = format!("{MARKER_ENV}={marker}");
    env.split(|b| *b == 0).any(|kv| kv == want.as_bytes())
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
            (!a.marker.is_empty() && has_marker(pid, &a.marker)) || (leader_alive && sid == a.pid)
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
