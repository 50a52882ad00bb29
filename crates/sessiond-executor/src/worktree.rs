//! Worktrees sessiond creates for sessions, made and inspected by agentctl
//! on the executor's host (`agentctl worktree ...`): the session's own
//! agentctl serves the worktree as its workspace, so it cannot be the one
//! to create it.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use sessiond_domain::worktree::WorktreeContents;

use crate::error::{Error, Result};

/// The worktree of one session, as paths and refs on the executor's host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorktreeTarget {
    /// The repository it is created from.
    pub repository: String,
    /// The ref its branch starts at.
    pub base: String,
    /// The session's branch.
    pub branch: String,
    /// Its directory.
    pub path: String,
    /// Remote executors: the agentctl on the host that makes it (its
    /// `Worktree` call), with the owner's lease epoch.
    pub agentctl: Option<(crate::RemoteTarget, Option<i64>)>,
}

/// One worktree operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorktreeOp {
    /// Validate everything a create needs, changing nothing.
    Check,
    /// `git worktree add -b`; a directory already there on the session's
    /// branch is adopted.
    Create,
    /// Bring it back: adopt, or check the branch out again when the
    /// directory is missing; a missing branch is an error unless
    /// `never_created` (the create was cut short before it made the branch).
    Restore {
        /// The create never finished.
        never_created: bool,
    },
    /// What removing it would lose.
    State,
    /// Remove the directory (and its registration), and the branch too with
    /// `delete_branch`.
    Remove {
        /// Delete the branch as well.
        delete_branch: bool,
    },
    /// The branch's commits since its base, newest first.
    Commits {
        /// At most this many.
        limit: u32,
    },
    /// The repository's local branches (only `repository` is read).
    Branches,
}

/// One commit of a session's branch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BranchCommit {
    /// Full hash.
    pub sha: String,
    /// First line of the message.
    pub subject: String,
    /// Author name.
    pub author: String,
    /// Author time, seconds since the epoch.
    pub time: i64,
}

/// What a worktree operation answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorktreeAnswer {
    /// Check and Remove: done.
    Done,
    /// Create and Restore: `created`, `adopted` or `recreated`, and the
    /// commit checked out.
    Ensured {
        /// What was done.
        outcome: String,
        /// The commit checked out.
        head: String,
    },
    /// State.
    State(WorktreeContents),
    /// Commits.
    Commits(Vec<BranchCommit>),
    /// Branches: their names, sorted, and the one the repository's own
    /// checkout is on (empty when detached).
    Branches {
        /// Local branch names.
        names: Vec<String>,
        /// HEAD's branch.
        current: String,
    },
}

pub(crate) const WORKTREE_TIMEOUT: Duration = Duration::from_secs(180);

/// Runs `agentctl worktree OP` on this host and reads its one JSON answer;
/// as `as_user` (`uid`, `gid`) when given, which needs root.
pub async fn run_local(
    agentctl: &Path,
    env: &[(String, String)],
    target: &WorktreeTarget,
    op: WorktreeOp,
    as_user: Option<(u32, u32)>,
) -> Result<WorktreeAnswer> {
    let mut cmd = tokio::process::Command::new(agentctl);
    cmd.arg("worktree");
    cmd.args(args(target, op));
    cmd.env_clear();
    cmd.envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    if let Some((uid, gid)) = as_user {
        cmd.uid(uid).gid(gid).current_dir("/");
    }
    cmd.stdin(std::process::Stdio::null());
    cmd.kill_on_drop(true);
    let out = tokio::time::timeout(WORKTREE_TIMEOUT, cmd.output())
        .await
        .map_err(|_| Error::Worktree {
            code: tonic::Code::DeadlineExceeded,
            message: format!(
                "git worktree operation on {} did not finish within {WORKTREE_TIMEOUT:?}",
                target.repository
            ),
        })?
        .map_err(|source| Error::Spawn {
            path: agentctl.to_path_buf(),
            source,
        })?;
    parse(&out.stdout, op).ok_or_else(|| Error::Worktree {
        code: tonic::Code::Internal,
        message: format!(
            "agentctl worktree gave no answer (exit {}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ),
    })?
}

/// `path` with `.` and `..` applied lexically, as the shell's `cd` does
/// (git joins `commondir`, `../..`, to a worktree's git directory; a
/// configured `--data-dir ../data` is taken so too).
pub fn normalise(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// The command-line arguments after `agentctl worktree`.
pub fn args(target: &WorktreeTarget, op: WorktreeOp) -> Vec<String> {
    let mut a = vec![
        op_name(op).to_owned(),
        format!("--repository={}", target.repository),
        format!("--base={}", target.base),
        format!("--branch={}", target.branch),
        format!("--path={}", target.path),
    ];
    match op {
        WorktreeOp::Restore {
            never_created: true,
        } => a.push("--never-created".into()),
        WorktreeOp::Remove {
            delete_branch: true,
        } => a.push("--delete-branch".into()),
        WorktreeOp::Commits { limit } => a.push(format!("--limit={limit}")),
        _ => {}
    }
    a
}

/// The operation's name, as the command and the `Worktree` call take it.
pub fn op_name(op: WorktreeOp) -> &'static str {
    match op {
        WorktreeOp::Check => "check",
        WorktreeOp::Create => "create",
        WorktreeOp::Restore { .. } => "restore",
        WorktreeOp::State => "state",
        WorktreeOp::Remove { .. } => "remove",
        WorktreeOp::Commits { .. } => "commits",
        WorktreeOp::Branches => "branches",
    }
}

/// Reads agentctl's answer: `{"ok": ...}` or `{"error": {"code", "message"}}`.
pub fn parse(stdout: &[u8], op: WorktreeOp) -> Option<Result<WorktreeAnswer>> {
    let line = std::str::from_utf8(stdout).ok()?.lines().last()?;
    let v: serde_json::Value = serde_json::from_str(line).ok()?;
    if let Some(e) = v.get("error") {
        let code = tonic::Code::from_i32(i32::try_from(e.get("code")?.as_i64()?).ok()?);
        let message = e.get("message")?.as_str()?.to_owned();
        return Some(Err(Error::Worktree { code, message }));
    }
    parse_ok(v.get("ok")?, op)
}

/// Reads the `ok` value of an answer (what the `Worktree` call returns).
pub fn parse_ok(ok: &serde_json::Value, op: WorktreeOp) -> Option<Result<WorktreeAnswer>> {
    let s = |k: &str| ok.get(k).and_then(|x| x.as_str()).unwrap_or("").to_owned();
    Some(Ok(match op {
        WorktreeOp::Check | WorktreeOp::Remove { .. } => WorktreeAnswer::Done,
        WorktreeOp::Create | WorktreeOp::Restore { .. } => WorktreeAnswer::Ensured {
            outcome: s("outcome"),
            head: s("head"),
        },
        WorktreeOp::State => WorktreeAnswer::State(WorktreeContents {
            path_exists: ok.get("path_exists")?.as_bool()?,
            branch_exists: ok.get("branch_exists")?.as_bool()?,
            dirty_files: ok
                .get("dirty_files")?
                .as_array()?
                .iter()
                .filter_map(|f| f.as_str().map(str::to_owned))
                .collect(),
            unique_commits: ok.get("unique_commits")?.as_u64()?,
            merged: ok.get("merged")?.as_bool()?,
            // Absent from an older agentctl's answer.
            locked: ok.get("locked").and_then(|l| l.as_str()).map(str::to_owned),
            // Absent from an older agentctl's answer (its removal refuses).
            not_ours: ok
                .get("not_ours")
                .and_then(serde_json::Value::as_bool)
                .unwrap_or(false),
        }),
        WorktreeOp::Branches => WorktreeAnswer::Branches {
            names: ok
                .get("names")?
                .as_array()?
                .iter()
                .filter_map(|n| n.as_str().map(str::to_owned))
                .collect(),
            current: s("current"),
        },
        WorktreeOp::Commits { .. } => WorktreeAnswer::Commits(
            ok.as_array()?
                .iter()
                .filter_map(|c| {
                    Some(BranchCommit {
                        sha: c.get("sha")?.as_str()?.to_owned(),
                        subject: c.get("subject")?.as_str()?.to_owned(),
                        author: c.get("author")?.as_str()?.to_owned(),
                        time: c.get("time")?.as_i64()?,
                    })
                })
                .collect(),
        ),
    }))
}

/// `path` with its symlinks resolved: its longest existing ancestor made
/// canonical, the rest (not made yet) appended as written.
pub fn resolved_path(path: &Path) -> PathBuf {
    let mut existing = path;
    let mut rest = Vec::new();
    loop {
        if let Ok(canonical) = std::fs::canonicalize(existing) {
            return rest.iter().rev().fold(canonical, |p, part| p.join(part));
        }
        match (existing.parent(), existing.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_owned());
                existing = parent;
            }
            _ => return path.to_path_buf(),
        }
    }
}
