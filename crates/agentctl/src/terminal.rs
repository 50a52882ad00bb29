//! ACP terminals: commands the agent runs through agentctl
//! (`terminal/create`, `terminal/output`, `terminal/wait_for_exit`,
//! `terminal/kill`, `terminal/release`).
//!
//! A terminal belongs to agentctl, not to the backend, so it lives on while
//! sessiond restarts. Its processes carry the agent's tree marker (they end
//! with the agent and are reaped by agentctl's successor on the same
//! journal, like the agent's own children) and a marker of their own (a
//! `kill`, `release`, cancel or stop ends everything the command started,
//! `setsid` included). The working directory is confined to the workspace
//! like `Exec`'s. Output is one stream (stdout and stderr interleaved, as a
//! terminal shows them), bounded by the agent's `outputByteLimit`: the
//! oldest bytes go first, cut at a character boundary. Its tail is also
//! published as an activity part of kind `terminal`, a few times a second
//! while it changes and once more, complete, when the command exits, so
//! sessiond stores and streams it without asking.

use std::collections::HashMap;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use sessiond_proto::agentctl::v1::{Activity, agent_update::Kind};
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::{Notify, watch};

use crate::activity;
use crate::error::{Error, Result};
use crate::exec::explicit_env;
use crate::updates::UpdateLog;
use crate::{sys, tree};

/// The environment variable marking every process of one terminal.
pub const MARKER_ENV: &str = "AGENTCTL_TERMINAL_MARKER";
/// Output kept when the agent names no `outputByteLimit` (1 MiB).
pub const DEFAULT_OUTPUT_LIMIT: usize = 1 << 20;
/// Largest `outputByteLimit` honoured (16 MiB); a larger one is capped.
pub const MAX_OUTPUT_LIMIT: usize = 16 << 20;
/// Terminals one agentctl keeps at once (released ones do not count).
pub const MAX_TERMINALS: usize = 64;
/// The tail of the output the published part carries (64 KiB): what
/// sessiond stores and shows; the agent reads up to its own limit.
pub const PUBLISHED_TAIL: usize = 64 << 10;
/// How often a running terminal's part is published at most.
const PUBLISH_EVERY: Duration = Duration::from_millis(200);
/// Every this many bytes of output published for one terminal, the pause
/// between its parts doubles (up to [`PUBLISH_AT_MOST_EVERY`]): each part
/// carries the whole tail, and sessiond stores every part, so a terminal
/// that prints for long would otherwise cost storage without bound.
const PUBLISH_BUDGET_STEP: usize = 1 << 20;
/// The longest pause between two parts of a running terminal.
const PUBLISH_AT_MOST_EVERY: Duration = Duration::from_secs(30);

/// The pause after a terminal's parts carried `published` bytes in all.
fn publish_pause(published: usize) -> Duration {
    let doublings = u32::try_from(published / PUBLISH_BUDGET_STEP)
        .unwrap_or(u32::MAX)
        .min(16);
    PUBLISH_EVERY
        .saturating_mul(1 << doublings)
        .min(PUBLISH_AT_MOST_EVERY)
}

/// How long readers may drain the pipes once the command has exited (a
/// background child may hold them open).
const DRAIN: Duration = Duration::from_millis(200);

/// How a terminal's command ended.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TerminalExit {
    /// Its exit code; `None` when a signal ended it.
    pub exit_code: Option<u32>,
    /// The signal that ended it (`SIGKILL`, ...).
    pub signal: Option<String>,
}

/// What `terminal/create` asks for.
#[derive(Debug, Clone, Default)]
pub struct TerminalSpec {
    /// The ACP session it belongs to.
    pub session_id: String,
    /// The turn in progress, if any (the part's `turn_id`).
    pub turn_id: String,
    /// Program, looked up on PATH when not absolute.
    pub command: String,
    /// Arguments.
    pub args: Vec<String>,
    /// Extra environment.
    pub env: HashMap<String, String>,
    /// Working directory, already confined to the workspace.
    pub cwd: PathBuf,
    /// The same directory opened beneath the workspace's root, entered by
    /// handle (see `exec::ExecSpec::cwd_handle`).
    pub cwd_handle: Option<std::sync::Arc<std::os::fd::OwnedFd>>,
    /// The agent's `outputByteLimit`.
    pub output_byte_limit: Option<u64>,
    /// The marker of the agent's process tree (see [`tree`]).
    pub agent_marker: String,
}

/// A snapshot of a terminal's output.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TerminalOutput {
    /// The retained output, lossily decoded as UTF-8.
    pub output: String,
    /// Bytes were dropped from the beginning to respect the limit.
    pub truncated: bool,
    /// Set once the command has exited.
    pub exit: Option<TerminalExit>,
}

#[derive(Debug, Default)]
struct Buffer {
    bytes: Vec<u8>,
    truncated: bool,
}

impl Buffer {
    /// Appends, then drops the oldest bytes beyond `limit`, cutting at a
    /// character boundary so the rest still decodes.
    fn append(&mut self, data: &[u8], limit: usize) {
        self.bytes.extend_from_slice(data);
        if self.bytes.len() > limit {
            let mut cut = self.bytes.len() - limit;
            while cut < self.bytes.len() && (self.bytes[cut] & 0b1100_0000) == 0b1000_0000 {
                cut += 1;
            }
            self.bytes.drain(..cut);
            self.truncated = true;
        }
    }

    /// The last `max` bytes, from a character boundary.
    fn tail(&self, max: usize) -> (&[u8], bool) {
        if self.bytes.len() <= max {
            return (&self.bytes, self.truncated);
        }
        let mut cut = self.bytes.len() - max;
        while cut < self.bytes.len() && (self.bytes[cut] & 0b1100_0000) == 0b1000_0000 {
            cut += 1;
        }
        (&self.bytes[cut..], true)
    }
}

#[derive(Debug)]
struct Terminal {
    id: String,
    session_id: String,
    turn_id: String,
    command: String,
    args: Vec<String>,
    cwd: String,
    pgid: u32,
    marker: String,
    limit: usize,
    output: Mutex<Buffer>,
    exit: watch::Sender<Option<TerminalExit>>,
    /// Output arrived or the command ended: the publisher wakes.
    changed: Notify,
    /// The part's revision, from 1.
    rev: Mutex<u64>,
    /// The agent released it: it is gone from the table, its part says so.
    released: AtomicBool,
}

impl Terminal {
    fn buffer(&self) -> MutexGuard<'_, Buffer> {
        self.output
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn snapshot(&self) -> TerminalOutput {
        let b = self.buffer();
        TerminalOutput {
            output: String::from_utf8_lossy(&b.bytes).into_owned(),
            truncated: b.truncated,
            exit: self.exit.borrow().clone(),
        }
    }

    /// Puts the part sessiond stores on the update stream: the command, the
    /// output's tail, the exit, whether it was released. Revisions are
    /// taken and pushed under one lock, so the stream never carries a
    /// later state under a lower revision.
    /// Publishes the terminal's part; answers the bytes of output it carried.
    fn publish(&self, updates: &UpdateLog) -> usize {
        let (tail, truncated) = {
            let b = self.buffer();
            let (t, cut) = b.tail(PUBLISHED_TAIL);
            (String::from_utf8_lossy(t).into_owned(), cut)
        };
        let tail_len = tail.len();
        let exit = self.exit.borrow().clone();
        let mut rev = self
            .rev
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *rev += 1;
        let released = self.released.load(Ordering::SeqCst);
        let json = serde_json::json!({
            "terminalId": self.id,
            "command": self.command,
            "args": self.args,
            "cwd": self.cwd,
            "output": tail,
            "truncated": truncated,
            "exitStatus": exit.as_ref().map(|e| serde_json::json!({
                "exitCode": e.exit_code,
                "signal": e.signal,
            })),
            "released": released,
        });
        let mut line = self.command.clone();
        for a in &self.args {
            line.push(' ');
            line.push_str(a);
        }
        updates.push(Kind::Activity(Activity {
            turn_id: self.turn_id.clone(),
            part_id: self.id.clone(),
            kind: activity::TERMINAL.to_owned(),
            rev: *rev,
            text: line,
            json: json.to_string(),
            complete: exit.is_some() || released,
        }));
        tail_len
    }

    /// Ends every process of the terminal: its group, then whatever carries
    /// its marker (what left the group with `setsid`).
    async fn kill(&self) {
        let _ = sys::kill_group(self.pgid, sys::SIGKILL);
        let marker = self.marker.clone();
        let killed = tokio::task::spawn_blocking(move || tree::end_marked(MARKER_ENV, &marker))
            .await
            .unwrap_or(0);
        if killed > 0 {
            tracing::info!(terminal = %self.id, killed, "killed processes the terminal's command left outside its group");
        }
    }
}

/// The terminals of one agentctl, by id.
#[derive(Debug)]
pub struct Terminals {
    updates: Arc<UpdateLog>,
    live: Mutex<HashMap<String, Arc<Terminal>>>,
}

fn not_found(id: &str) -> Error {
    Error::NotFound(format!(
        "terminal {id:?} (unknown, released, or of another session)"
    ))
}

impl Terminals {
    /// No terminals yet; parts go to `updates`.
    pub fn new(updates: Arc<UpdateLog>) -> Self {
        Self {
            updates,
            live: Mutex::new(HashMap::new()),
        }
    }

    fn live(&self) -> MutexGuard<'_, HashMap<String, Arc<Terminal>>> {
        self.live
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn get(&self, session_id: &str, id: &str) -> Result<Arc<Terminal>> {
        self.live()
            .get(id)
            .filter(|t| t.session_id == session_id)
            .cloned()
            .ok_or_else(|| not_found(id))
    }

    /// How many terminals are held (not released).
    pub fn count(&self) -> usize {
        self.live().len()
    }

    /// Starts the command; returns the terminal id at once (ACP: the
    /// command runs in the background).
    pub fn create(&self, spec: TerminalSpec) -> Result<String> {
        if spec.command.is_empty() {
            return Err(Error::InvalidArgument("terminal command is empty".into()));
        }
        if spec.command.contains('\0')
            || spec.args.iter().any(|a| a.contains('\0'))
            || spec
                .env
                .iter()
                .any(|(k, v)| k.is_empty() || k.contains(['\0', '=']) || v.contains('\0'))
        {
            return Err(Error::InvalidArgument(
                "terminal command, arguments and environment must not contain NUL bytes (or `=` in a name)".into(),
            ));
        }
        if self.count() >= MAX_TERMINALS {
            return Err(Error::OutOfRange(format!(
                "{MAX_TERMINALS} terminals are open; release one first"
            )));
        }
        let limit = spec.output_byte_limit.map_or(DEFAULT_OUTPUT_LIMIT, |l| {
            usize::try_from(l)
                .unwrap_or(usize::MAX)
                .min(MAX_OUTPUT_LIMIT)
        });
        let marker = uuid::Uuid::new_v4().simple().to_string();
        let mut cmd = tokio::process::Command::new(&spec.command);
        cmd.args(&spec.args)
            .current_dir(&spec.cwd)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        explicit_env(&mut cmd, &spec.env);
        cmd.env(MARKER_ENV, &marker);
        if !spec.agent_marker.is_empty() {
            cmd.env(tree::MARKER_ENV, &spec.agent_marker);
        }
        // Its own session: no controlling terminal, one group to signal.
        sys::new_session(&mut cmd);
        // Ends with agentctl, as the agent does (see `exec`).
        sys::kill_on_parent_death(&mut cmd);
        if let Some(dir) = &spec.cwd_handle {
            sys::enter_dir(&mut cmd, dir);
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| Error::io(format!("starting terminal command `{}`", spec.command), e))?;
        let pgid = child.id().unwrap_or(0);
        let id = uuid::Uuid::now_v7().to_string();
        let term = Arc::new(Terminal {
            id: id.clone(),
            session_id: spec.session_id,
            turn_id: spec.turn_id,
            command: spec.command,
            args: spec.args,
            cwd: spec.cwd.to_string_lossy().into_owned(),
            pgid,
            marker,
            limit,
            output: Mutex::new(Buffer::default()),
            exit: watch::channel(None).0,
            changed: Notify::new(),
            rev: Mutex::new(0),
            released: AtomicBool::new(false),
        });
        term.publish(&self.updates);
        let mut readers = tokio::task::JoinSet::new();
        if let Some(o) = child.stdout.take() {
            readers.spawn(read_into(o, term.clone()));
        }
        if let Some(e) = child.stderr.take() {
            readers.spawn(read_into(e, term.clone()));
        }
        // The waiter owns the child (the only place it is reaped), then
        // lets the readers drain and publishes the exit.
        let waiter = term.clone();
        tokio::spawn(async move {
            let exit = match child.wait().await {
                Ok(status) => TerminalExit {
                    exit_code: status.code().and_then(|c| u32::try_from(c).ok()),
                    signal: status.signal().map(signal_name),
                },
                Err(e) => {
                    tracing::warn!(terminal = %waiter.id, error = %e, "waiting for terminal command failed");
                    TerminalExit::default()
                }
            };
            let _ = tokio::time::timeout(DRAIN, async {
                while readers.join_next().await.is_some() {}
            })
            .await;
            readers.detach_all();
            waiter.exit.send_replace(Some(exit));
            waiter.changed.notify_one();
        });
        let publisher = term.clone();
        let updates = self.updates.clone();
        tokio::spawn(async move {
            let mut exit = publisher.exit.subscribe();
            let mut published = 0usize;
            loop {
                tokio::select! {
                    () = publisher.changed.notified() => {}
                    _ = exit.wait_for(Option::is_some) => {}
                }
                let done = exit.borrow().is_some();
                if publisher.released.load(Ordering::SeqCst) {
                    break;
                }
                published = published.saturating_add(publisher.publish(&updates));
                if done {
                    break;
                }
                // The exit is published at once, whatever the pause.
                tokio::select! {
                    () = tokio::time::sleep(publish_pause(published)) => {}
                    _ = exit.wait_for(Option::is_some) => {}
                }
            }
        });
        self.live().insert(id.clone(), term);
        tracing::info!(terminal = %id, pgid, "terminal started");
        Ok(id)
    }

    /// The output so far and, once exited, how the command ended.
    pub fn output(&self, session_id: &str, id: &str) -> Result<TerminalOutput> {
        Ok(self.get(session_id, id)?.snapshot())
    }

    /// Waits until the command exits.
    pub async fn wait_for_exit(&self, session_id: &str, id: &str) -> Result<TerminalExit> {
        let term = self.get(session_id, id)?;
        let mut exit = term.exit.subscribe();
        let done = exit
            .wait_for(Option::is_some)
            .await
            .map_err(|_| Error::Unavailable(format!("terminal {id:?} was dropped")))?;
        Ok(done.clone().unwrap_or_default())
    }

    /// Kills the command and everything it started; the terminal stays
    /// readable until released.
    pub async fn kill(&self, session_id: &str, id: &str) -> Result<()> {
        self.get(session_id, id)?.kill().await;
        Ok(())
    }

    /// Kills what still runs and forgets the terminal.
    pub async fn release(&self, session_id: &str, id: &str) -> Result<()> {
        let term = self.get(session_id, id)?;
        self.live().remove(id);
        term.released.store(true, Ordering::SeqCst);
        term.kill().await;
        term.publish(&self.updates);
        Ok(())
    }

    /// Kills every terminal of `session_id` (a cancelled turn); they stay
    /// readable until released.
    pub async fn kill_session(&self, session_id: &str) -> usize {
        let terms: Vec<Arc<Terminal>> = self
            .live()
            .values()
            .filter(|t| t.session_id == session_id && t.exit.borrow().is_none())
            .cloned()
            .collect();
        for t in &terms {
            t.kill().await;
        }
        terms.len()
    }

    /// Kills and releases every terminal (the agent stops or exits).
    pub async fn release_all(&self) -> usize {
        let terms: Vec<Arc<Terminal>> = self.live().drain().map(|(_, t)| t).collect();
        for t in &terms {
            t.released.store(true, Ordering::SeqCst);
            t.kill().await;
            t.publish(&self.updates);
        }
        terms.len()
    }
}

async fn read_into(mut r: impl AsyncRead + Unpin, term: Arc<Terminal>) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                term.buffer().append(&buf[..n], term.limit);
                term.changed.notify_one();
            }
        }
    }
}

fn signal_name(sig: i32) -> String {
    let name = match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGABRT => "SIGABRT",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        _ => return format!("signal {sig}"),
    };
    name.to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_terminal_that_prints_long_is_published_less_often() {
        assert_eq!(publish_pause(0), PUBLISH_EVERY);
        assert_eq!(publish_pause(PUBLISH_BUDGET_STEP - 1), PUBLISH_EVERY);
        assert_eq!(publish_pause(PUBLISH_BUDGET_STEP), PUBLISH_EVERY * 2);
        assert_eq!(publish_pause(3 * PUBLISH_BUDGET_STEP), PUBLISH_EVERY * 8);
        assert_eq!(publish_pause(usize::MAX), PUBLISH_AT_MOST_EVERY);
        // Bytes stored for a terminal printing 64 KiB tails for an hour:
        // bounded by the pauses, not by how fast it prints.
        let (mut stored, mut t) = (0usize, Duration::ZERO);
        while t < Duration::from_secs(3600) {
            stored += PUBLISHED_TAIL;
            t += publish_pause(stored);
        }
        assert!(stored < 16 << 20, "{stored} bytes");
    }

    #[test]
    fn the_oldest_bytes_go_first_at_a_character_boundary() {
        let mut b = Buffer::default();
        b.append(b"abc", 4);
        assert!(!b.truncated);
        b.append("dé".as_bytes(), 4); // "abcdé": 6 bytes, é is 2
        assert!(b.truncated);
        assert_eq!(String::from_utf8(b.bytes.clone()).unwrap(), "cdé");
        // Cutting inside é moves past it.
        let mut c = Buffer::default();
        c.append("aéb".as_bytes(), 2);
        assert_eq!(String::from_utf8(c.bytes.clone()).unwrap(), "b");
        let (tail, cut) = b.tail(3);
        assert_eq!(std::str::from_utf8(tail).unwrap(), "dé");
        assert!(cut);
        // `outputByteLimit: 0` keeps nothing (helper-39 8: it kept 1 byte).
        let mut none = Buffer::default();
        none.append(b"abc\n", 0);
        assert!(none.bytes.is_empty() && none.truncated);
    }
}
