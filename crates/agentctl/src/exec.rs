//! Running commands in the workspace, bounded in time and output.

use std::collections::HashMap;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt};

use crate::error::{Error, Result};
use crate::sys;

/// Default timeout of a command (60 s).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// Default output cap per stream (1 MiB).
pub const DEFAULT_MAX_OUTPUT: u64 = 1 << 20;
/// Largest output cap per stream a request may ask for (16 MiB), so both
/// streams together stay well inside one gRPC message.
pub const MAX_OUTPUT: u64 = 16 << 20;

/// Environment variables never passed to anything agentctl starts.
pub const SCRUBBED_ENV: &[&str] = &["AGENTCTL_SECRET"];

/// One command to run.
#[derive(Debug, Clone)]
pub struct ExecSpec<'a> {
    /// Program, looked up on PATH when not absolute.
    pub command: &'a str,
    /// Arguments.
    pub args: &'a [String],
    /// Working directory, already confined to the workspace.
    pub cwd: &'a Path,
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
    /// Stdout had more than `max_output` bytes.
    pub stdout_truncated: bool,
    /// Stderr had more than `max_output` bytes.
    pub stderr_truncated: bool,
    /// Wall-clock duration.
    pub duration: Duration,
}

async fn read_capped(mut r: impl AsyncRead + Unpin, cap: u64) -> (Vec<u8>, bool) {
    let mut kept = Vec::new();
    let mut truncated = false;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let room =
                    usize::try_from(cap.saturating_sub(kept.len() as u64)).unwrap_or(usize::MAX);
                let take = n.min(room);
                kept.extend_from_slice(&buf[..take]);
                if take < n {
                    truncated = true;
                }
            }
        }
    }
    (kept, truncated)
}

/// Runs a command in its own process group. When the command exits, or the
/// timeout passes, whatever is left of its group is killed, so nothing it
/// started outlives the call.
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
    let started = Instant::now();
    let mut cmd = tokio::process::Command::new(spec.command);
    cmd.args(spec.args)
        .current_dir(spec.cwd)
        .envs(spec.env)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    for k in SCRUBBED_ENV {
        cmd.env_remove(k);
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| Error::io(format!("starting `{}`", spec.command), e))?;
    let pgid = child.id().unwrap_or(0);
    let out = child.stdout.take();
    let err = child.stderr.take();
    let cap = spec.max_output;
    let out_task = tokio::spawn(async move {
        match out {
            Some(o) => read_capped(o, cap).await,
            None => (Vec::new(), false),
        }
    });
    let err_task = tokio::spawn(async move {
        match err {
            Some(e) => read_capped(e, cap).await,
            None => (Vec::new(), false),
        }
    });
    let mut timed_out = false;
    let status = match tokio::time::timeout(spec.timeout, child.wait()).await {
        Ok(status) => Some(status.map_err(|e| Error::io("waiting for command", e))?),
        Err(_) => {
            timed_out = true;
            None
        }
    };
    // The leader is gone or out of time: end the rest of its group so the
    // pipes close and nothing it started lingers.
    let _ = sys::kill_group(pgid, sys::SIGKILL);
    if timed_out {
        let _ = child.wait().await;
    }
    let (stdout, stdout_truncated) = out_task.await.unwrap_or_default();
    let (stderr, stderr_truncated) = err_task.await.unwrap_or_default();
    Ok(ExecOutput {
        exit_code: status.and_then(|s| s.code()),
        stdout,
        stderr,
        timed_out,
        stdout_truncated,
        stderr_truncated,
        duration: started.elapsed(),
    })
}
