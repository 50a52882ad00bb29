//! Running commands in the workspace, bounded in time and output.

use std::collections::HashMap;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt};

use crate::error::{Error, Result};
use crate::{sys, tree};

/// Default timeout of a command (60 s).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// Default output cap per stream (1 MiB).
pub const DEFAULT_MAX_OUTPUT: u64 = 1 << 20;
/// Largest output cap per stream a request may ask for (16 MiB), so both
/// streams together stay well inside one gRPC message.
pub const MAX_OUTPUT: u64 = 16 << 20;

/// Environment variables never passed to anything agentctl starts.
pub const SCRUBBED_ENV: &[&str] = &["AGENTCTL_SECRET"];

/// The environment variable marking every process of one `Exec` call.
pub const MARKER_ENV: &str = "AGENTCTL_EXEC_MARKER";

/// One command to run.
#[derive(Debug, Clone)]
pub struct ExecSpec<'a> {
    /// Program, looked up on PATH when not absolute.
    pub command: &'a str,
    /// Arguments.
    pub args: &'a [String],
    /// Working directory, already confined to the workspace.
    pub cwd: &'a Path,
    /// The same directory, opened beneath the workspace's root: the child
    /// enters it by this handle, so a path component swapped for a symlink
    /// after `cwd` was checked leads nowhere outside.
    pub cwd_handle: Option<&'a std::os::fd::OwnedFd>,
    /// Extra environment.
    pub env: &'a HashMap<String, String>,
    /// Wall-clock limit; the whole process group is killed when it passes.
    pub timeout: Duration,
    /// Bytes kept per stream; the rest is read and dropped.
    pub max_output: u64,
}

/// What a command did.
#[derive(Debug, Clone, Default)]
pub struct ExecOutput {
    /// Exit code; `None` after a timeout or a signal.
    pub exit_code: Option<i32>,
    /// Captured stdout, at most `max_output` bytes.
    pub stdout: Vec<u8>,
    /// Captured stderr, at most `max_output` bytes.
    pub stderr: Vec<u8>,
    /// The timeout passed and the group was killed.
    pub timed_out: bool,
    /// The signal that ended it, when not the timeout's.
    pub signal: Option<i32>,
    /// Stdout had more than `max_output` bytes.
    pub stdout_truncated: bool,
    /// Stderr had more than `max_output` bytes.
    pub stderr_truncated: bool,
    /// Wall-clock duration.
    pub duration: Duration,
}

/// Where a reader keeps what it read, so the caller can take the output so
/// far when the deadline passes while a stream is still open.
#[derive(Debug, Default)]
struct Capture {
    kept: Vec<u8>,
    truncated: bool,
}

type Shared = std::sync::Arc<std::sync::Mutex<Capture>>;

fn take(c: &Shared) -> (Vec<u8>, bool) {
    let mut c = c.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    (std::mem::take(&mut c.kept), c.truncated)
}

async fn read_capped(mut r: impl AsyncRead + Unpin, cap: u64, into: Shared) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let mut c = into
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                let room =
                    usize::try_from(cap.saturating_sub(c.kept.len() as u64)).unwrap_or(usize::MAX);
                let take = n.min(room);
                c.kept.extend_from_slice(&buf[..take]);
                if take < n {
                    c.truncated = true;
                }
            }
        }
    }
}

/// The environment variables passed on from agentctl's own environment to
/// the agent and to commands: enough to find programs and behave (locale,
/// home, temp dir), nothing that could carry a secret. Everything else a
/// child gets is named by the caller (the profile's or the request's env).
pub const BASE_ENV: &[&str] = &[
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ",
    "TMPDIR", "TERM",
];

/// Replaces `cmd`'s environment by [`BASE_ENV`] taken from ours, then `extra`.
pub fn explicit_env(cmd: &mut tokio::process::Command, extra: &HashMap<String, String>) {
    cmd.env_clear();
    for key in BASE_ENV {
        if let Some(v) = std::env::var_os(key) {
            cmd.env(key, v);
        }
    }
    cmd.envs(extra);
    for k in SCRUBBED_ENV {
        cmd.env_remove(k);
    }
}

/// Longest timeout a command may ask for (24 h).
pub const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

/// How long readers get to drain what is buffered once the command's
/// processes are dead.
const DRAIN: Duration = Duration::from_millis(200);

/// Ends a command's process group and everything carrying its marker when
/// dropped armed (the call's future was dropped before it did so itself).
struct Ender {
    pgid: u32,
    marker: Option<String>,
}

impl Drop for Ender {
    fn drop(&mut self) {
        let Some(marker) = self.marker.take() else {
            return;
        };
        let _ = sys::kill_group(self.pgid, sys::SIGKILL);
        // A scan of /proc: off the dropping (async) thread.
        std::thread::spawn(move || tree::end_marked(MARKER_ENV, &marker));
    }
}

pub async fn run(spec: ExecSpec<'_>) -> Result<ExecOutput> {
    if spec.command.is_empty() {
        return Err(Error::InvalidArgument("command is empty".into()));
    }
    if spec.command.contains('\0')
        || spec.args.iter().any(|a| a.contains('\0'))
        || spec
            .env
            .iter()
            .any(|(k, v)| k.contains(['\0', '=']) || k.is_empty() || v.contains('\0'))
    {
        return Err(Error::InvalidArgument(
            "command, arguments and environment must not contain NUL bytes".into(),
        ));
    }
    if spec.timeout.is_zero() || spec.timeout > MAX_TIMEOUT {
        return Err(Error::InvalidArgument(format!(
            "timeout must be between 1 ms and {} ms",
            MAX_TIMEOUT.as_millis()
        )));
    }
    let started = Instant::now();
    let deadline = tokio::time::Instant::now() + spec.timeout;
    let mut cmd = tokio::process::Command::new(spec.command);
    cmd.args(spec.args)
        .current_dir(spec.cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    explicit_env(&mut cmd, spec.env);
    // Inherited by everything the command starts, even what leaves its
    // session (`setsid cmd &`) or closes its output: found and ended when
    // the call ends.
    let marker = uuid::Uuid::new_v4().simple().to_string();
    cmd.env(MARKER_ENV, &marker);
    // Its own session (and so its own process group, id = its pid): no
    // controlling terminal, and one signal reaches everything it starts
    // that does not leave the group on purpose.
    sys::new_session(&mut cmd);
    // A `kill -9` of agentctl ends the command too, as it ends the agent
    // (helper-52 4: it ran on in the worktree until agentctl's relaunch
    // ended its cgroup). What it started itself is left to that cleanup.
    sys::kill_on_parent_death(&mut cmd);
    if let Some(dir) = spec.cwd_handle {
        sys::enter_dir(&mut cmd, dir);
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| Error::io(format!("starting `{}`", spec.command), e))?;
    let pgid = child.id().unwrap_or(0);
    // A call dropped half-way (its caller went away) ends what it started
    // too, not only the leader `kill_on_drop` reaches.
    let mut ender = Ender {
        pgid,
        marker: Some(marker.clone()),
    };
    let out = child.stdout.take();
    let err = child.stderr.take();
    // The pipes' identities, to find processes that escaped the group
    // (`setsid cmd &`) and still hold them.
    let pipes: Vec<u64> = [
        out.as_ref().and_then(sys::fd_inode),
        err.as_ref().and_then(sys::fd_inode),
    ]
    .into_iter()
    .flatten()
    .collect();
    let cap = spec.max_output;
    let (out_buf, err_buf) = (Shared::default(), Shared::default());
    let mut readers = tokio::task::JoinSet::new();
    if let Some(o) = out {
        readers.spawn(read_capped(o, cap, out_buf.clone()));
    }
    if let Some(e) = err {
        readers.spawn(read_capped(e, cap, err_buf.clone()));
    }
    let mut timed_out = false;
    let status = match tokio::time::timeout_at(deadline, child.wait()).await {
        Ok(status) => Some(status.map_err(|e| Error::io("waiting for command", e))?),
        Err(_) => {
            timed_out = true;
            None
        }
    };
    // The leader is gone or out of time: end the rest of its group so the
    // pipes close, and whatever carries the call's marker, so nothing it
    // started outlives the call.
    ender.marker = None;
    let _ = sys::kill_group(pgid, sys::SIGKILL);
    let detached = tokio::task::spawn_blocking(move || tree::end_marked(MARKER_ENV, &marker))
        .await
        .unwrap_or(0);
    if detached > 0 {
        tracing::info!(
            detached,
            "killed processes the command left running outside its group"
        );
    }
    if timed_out {
        let _ = child.wait().await;
    }
    // Output ends when every writer is gone, but never after the deadline:
    // a process that left the group and holds a pipe is killed there.
    let limit = if timed_out {
        tokio::time::Instant::now() + DRAIN
    } else {
        deadline
    };
    let drained = tokio::time::timeout_at(limit, async {
        while readers.join_next().await.is_some() {}
    })
    .await
    .is_ok();
    if !drained {
        timed_out = true;
        let killed = sys::kill_pipe_holders(&pipes);
        if killed > 0 {
            tracing::info!(
                killed,
                "killed processes that left the command's group and held its output"
            );
        }
        let _ = tokio::time::timeout(DRAIN, async {
            while readers.join_next().await.is_some() {}
        })
        .await;
        readers.abort_all();
    }
    // What the readers read so far is in the buffers, finished or not.
    let (stdout, stdout_truncated) = take(&out_buf);
    let (stderr, stderr_truncated) = take(&err_buf);
    Ok(ExecOutput {
        exit_code: status.and_then(|s| s.code()),
        signal: status
            .filter(|_| !timed_out)
            .and_then(|s| std::os::unix::process::ExitStatusExt::signal(&s)),
        stdout,
        stderr,
        timed_out,
        stdout_truncated,
        stderr_truncated,
        duration: started.elapsed(),
    })
}
