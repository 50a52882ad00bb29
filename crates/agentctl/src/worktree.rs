//! Git worktrees sessiond owns: created from a repository on this host,
//! recreated from their branch when the directory went missing, inspected
//! before removal so no work is lost, and removed.
//!
//! These run before a session's agentctl serves anything (its workspace is
//! the worktree itself), so they are reached through the one-shot command
//! `agentctl worktree ...` on the executor's host (see `main.rs`), which
//! prints one JSON object. Every change is confined to the repository's
//! `git worktree` list and the session's own branch.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;

use crate::error::{Error, Result};
use crate::exec::{self, ExecSpec};

const GIT_TIMEOUT: Duration = Duration::from_secs(120);

/// The worktree of one session.
#[derive(Debug, Clone)]
pub struct Spec {
    /// The repository it belongs to (its main working tree or a bare repository).
    pub repository: PathBuf,
    /// The ref it was branched from.
    pub base: String,
    /// The session's own branch (short name, without `refs/heads/`).
    pub branch: String,
    /// Where it is checked out.
    pub path: PathBuf,
}

/// What [`create`] or [`restore`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// A new branch and directory.
    Created,
    /// The directory was there already, on the session's branch: kept.
    Adopted,
    /// The directory was missing; it was checked out again from the branch.
    Recreated,
}

/// What was found and done.
#[derive(Debug, Clone, Serialize)]
pub struct Ensured {
    /// What happened.
    pub outcome: Outcome,
    /// The commit checked out.
    pub head: String,
}

/// What a worktree holds that its removal would lose.
#[derive(Debug, Clone, Default, Serialize)]
pub struct State {
    /// The directory exists.
    pub path_exists: bool,
    /// The branch exists in the repository.
    pub branch_exists: bool,
    /// Files with uncommitted changes (untracked ones included, ignored ones not).
    pub dirty_files: Vec<String>,
    /// Commits of the branch no other branch, tag or remote ref holds.
    pub unique_commits: u64,
    /// The branch's tip is contained in the base.
    pub merged: bool,
    /// The branch's tip; empty when it does not exist.
    pub head: String,
    /// `git worktree lock` holds the worktree: its reason (maybe empty).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub locked: Option<String>,
    /// The directory is there but is not this worktree on its branch any
    /// more ([`remove`] would refuse it): a delete refuses before it stops
    /// anything.
    pub not_ours: bool,
}

/// One commit of the branch since its base.
#[derive(Debug, Clone, Serialize)]
pub struct Commit {
    /// Full hash.
    pub sha: String,
    /// First line of the message.
    pub subject: String,
    /// Author name.
    pub author: String,
    /// Author time, seconds since the epoch.
    pub time: i64,
}

/// Runs git with settings that keep it from executing anything the
/// repository configures: the agent can write the repository's config
/// through its worktree, and these run as sessiond's user (a checkout runs
/// hooks and filter drivers). Filters pass content through unchanged, as in
/// the workspace's git calls.
async fn git(cwd: &Path, args: &[&str]) -> Result<exec::ExecOutput> {
    let mut env = HashMap::new();
    env.insert("GIT_CONFIG_NOSYSTEM".to_owned(), "1".to_owned());
    env.insert("GIT_TERMINAL_PROMPT".to_owned(), "0".to_owned());
    env.insert("LC_ALL".to_owned(), "C".to_owned());
    let mut full: Vec<String> = Vec::new();
    for setting in crate::git::INERT {
        full.push("-c".into());
        full.push((*setting).into());
    }
    for name in filter_drivers(cwd, &env).await {
        for key in ["clean", "smudge", "process"] {
            full.push("-c".into());
            full.push(format!("filter.{name}.{key}="));
        }
        full.push("-c".into());
        full.push(format!("filter.{name}.required=false"));
    }
    full.extend(args.iter().map(|a| (*a).to_owned()));
    let out = exec::run(ExecSpec {
        command: "git",
        args: &full,
        cwd,
        cwd_handle: None,
        env: &env,
        timeout: GIT_TIMEOUT,
        max_output: 4 << 20,
    })
    .await
    .map_err(|e| match e {
        // A working directory that is gone fails the start the same way.
        Error::NotFound(m) if !cwd.is_dir() => {
            Error::FailedPrecondition(format!("{} does not exist (any more): {m}", cwd.display()))
        }
        Error::NotFound(m) => Error::FailedPrecondition(format!("git is not installed: {m}")),
        other => other,
    })?;
    if out.timed_out {
        return Err(Error::DeadlineExceeded(format!(
            "git {} took longer than {GIT_TIMEOUT:?}",
            args.join(" ")
        )));
    }
    Ok(out)
}

/// The filter drivers the configuration seen from `cwd` names; none when
/// `cwd` is no repository (or git fails: the call itself then says why).
async fn filter_drivers(cwd: &Path, env: &HashMap<String, String>) -> Vec<String> {
    let mut args: Vec<String> = Vec::new();
    for setting in crate::git::INERT {
        args.push("-c".into());
        args.push((*setting).into());
    }
    args.extend(
        [
            "config",
            "--null",
            "--name-only",
            "--get-regexp",
            r"^filter\.",
        ]
        .map(String::from),
    );
    let Ok(out) = exec::run(ExecSpec {
        command: "git",
        args: &args,
        cwd,
        cwd_handle: None,
        env,
        timeout: GIT_TIMEOUT,
        max_output: 1 << 20,
    })
    .await
    else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .split('\0')
        .filter_map(|key| {
            let (name, _) = key.strip_prefix("filter.")?.rsplit_once('.')?;
            Some(name.to_owned())
        })
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect()
}

/// git that must succeed; its stdout, trimmed.
async fn git_ok(cwd: &Path, args: &[&str]) -> Result<String> {
    let out = git(cwd, args).await?;
    if out.exit_code != Some(0) {
        return Err(Error::FailedPrecondition(format!(
            "git {} failed: {}",
            args.join(" "),
            shortened(String::from_utf8_lossy(&out.stderr).trim())
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// git's error output as an error message keeps: its start (the first
/// errors) and its end (the `fatal:` line), not every line of a checkout
/// that failed on each file (a full disk: some 19,000 lines; helper-41 2).
fn shortened(stderr: &str) -> String {
    const HEAD: usize = 2048;
    const TAIL: usize = 1024;
    if stderr.len() <= HEAD + TAIL {
        return stderr.to_owned();
    }
    let mut head = HEAD;
    while !stderr.is_char_boundary(head) {
        head -= 1;
    }
    let mut tail = stderr.len() - TAIL;
    while !stderr.is_char_boundary(tail) {
        tail += 1;
    }
    format!(
        "{} … ({} bytes not shown) … {}",
        &stderr[..head],
        tail - head,
        &stderr[tail..]
    )
}

/// `git worktree ARGS` in `repository`, one at a time per repository.
/// git does not guard its worktree list against itself: an `add` reads
/// every other worktree's admin directory, and fails ("failed to read
/// .git/worktrees/NAME/commondir") on one another `add` is making at that
/// moment, as two sessions created from one repository at once would do.
async fn worktree_git(repository: &Path, args: &[&str]) -> Result<String> {
    let common = common_dir(repository).await?;
    let _held = hold(&locks_dir(&common)?.join("repository.lock"), &|| {}).await?;
    let mut full = vec!["worktree"];
    full.extend_from_slice(args);
    git_ok(repository, &full).await
}

fn path_str(p: &Path) -> Result<&str> {
    p.to_str()
        .ok_or_else(|| Error::InvalidArgument(format!("{} is not valid UTF-8", p.display())))
}

/// The repository's common git directory, canonical; INVALID_ARGUMENT when
/// `repository` is not a git repository.
async fn common_dir(repository: &Path) -> Result<PathBuf> {
    if !repository.is_dir() {
        return Err(Error::InvalidArgument(format!(
            "repository: {} is not a directory on the executor's host",
            repository.display()
        )));
    }
    let out = git(
        repository,
        &["rev-parse", "--path-format=absolute", "--git-common-dir"],
    )
    .await?;
    if out.exit_code != Some(0) {
        return Err(Error::InvalidArgument(format!(
            "repository: {} is not a git repository (git init it, or name the directory that holds .git)",
            repository.display()
        )));
    }
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    std::fs::canonicalize(&dir).map_err(|e| Error::io(format!("resolving {}", dir.display()), e))
}

async fn branch_tip(repository: &Path, branch: &str) -> Result<Option<String>> {
    let refname = format!("refs/heads/{branch}");
    let out = git(repository, &["rev-parse", "--verify", "--quiet", &refname]).await?;
    Ok((out.exit_code == Some(0)).then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned()))
}

/// A branch that `branch` would have to sit beside as a file and a
/// directory of one name (`feat` for `feat/a`, or `feat/a/b` for
/// `feat/a`), which git refuses: the first found.
async fn nested_branch(repository: &Path, branch: &str) -> Result<Option<String>> {
    let mut prefix = String::new();
    for part in branch.split('/') {
        if !prefix.is_empty() {
            if branch_tip(repository, &prefix).await?.is_some() {
                return Ok(Some(prefix));
            }
            prefix.push('/');
        }
        prefix.push_str(part);
    }
    let under = format!("refs/heads/{branch}/");
    let out = git(
        repository,
        &[
            "for-each-ref",
            "--count=1",
            "--format=%(refname:short)",
            &under,
        ],
    )
    .await?;
    let found = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    Ok((out.exit_code == Some(0) && !found.is_empty()).then_some(found))
}

async fn resolve_base(repository: &Path, base: &str) -> Result<String> {
    if base.is_empty() || base.starts_with('-') {
        return Err(Error::InvalidArgument(format!(
            "base: {base:?} is not a ref name (a branch, tag or commit such as main)"
        )));
    }
    let spec = format!("{base}^{{commit}}");
    let out = git(repository, &["rev-parse", "--verify", "--quiet", &spec]).await?;
    if out.exit_code != Some(0) {
        // A repository made by `git init` and never committed to has no
        // commit a worktree could start from, whatever the base is called.
        let head = git(repository, &["rev-parse", "--verify", "--quiet", "HEAD"]).await?;
        if head.exit_code != Some(0) {
            return Err(Error::FailedPrecondition(format!(
                "repository {} has no commits yet, so a worktree has nothing to start from: \
                 commit something first (for example `git commit --allow-empty -m init`)",
                repository.display()
            )));
        }
        return Err(Error::InvalidArgument(format!(
            "base: {base:?} is not a branch, tag or commit of {} (fetch it, or name an existing one)",
            repository.display()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

async fn check_branch_name(repository: &Path, branch: &str) -> Result<()> {
    let out = git(repository, &["check-ref-format", "--branch", branch]).await?;
    if out.exit_code != Some(0) || branch.starts_with('-') {
        return Err(Error::InvalidArgument(format!(
            "branch: {branch:?} is not a valid branch name"
        )));
    }
    Ok(())
}

/// Whether `path` is a worktree of the repository (common dir `common`)
/// with `branch` checked out.
async fn is_ours(path: &Path, common: &Path, branch: &str) -> Result<bool> {
    let out = git(
        path,
        &["rev-parse", "--path-format=absolute", "--git-common-dir"],
    )
    .await?;
    if out.exit_code != Some(0) {
        return Ok(false);
    }
    let theirs = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if std::fs::canonicalize(&theirs).ok().as_deref() != Some(common) {
        return Ok(false);
    }
    let top = git_ok(path, &["rev-parse", "--show-toplevel"]).await?;
    if std::fs::canonicalize(&top).ok() != std::fs::canonicalize(path).ok() {
        return Ok(false);
    }
    let head = git(path, &["symbolic-ref", "--quiet", "--short", "HEAD"]).await?;
    Ok(head.exit_code == Some(0) && String::from_utf8_lossy(&head.stdout).trim() == branch)
}

/// One entry of `git worktree list --porcelain`.
struct Listed {
    path: PathBuf,
    branch: Option<String>,
    prunable: bool,
    /// `locked`, with its reason (maybe empty).
    locked: Option<String>,
}

async fn list(repository: &Path) -> Result<Vec<Listed>> {
    let out = worktree_git(repository, &["list", "--porcelain"]).await?;
    let mut all = Vec::new();
    for block in out.split("\n\n") {
        let mut entry = Listed {
            path: PathBuf::new(),
            branch: None,
            prunable: false,
            locked: None,
        };
        for line in block.lines() {
            if let Some(p) = line.strip_prefix("worktree ") {
                entry.path = PathBuf::from(p);
            } else if let Some(b) = line.strip_prefix("branch refs/heads/") {
                entry.branch = Some(b.to_owned());
            } else if line.starts_with("prunable") {
                entry.prunable = true;
            } else if let Some(reason) = line.strip_prefix("locked") {
                entry.locked = Some(reason.trim().to_owned());
            }
        }
        if !entry.path.as_os_str().is_empty() {
            all.push(entry);
        }
    }
    Ok(all)
}

/// Checks what [`create`] needs without changing anything: a repository,
/// an existing base, a free branch name and a free directory.
pub async fn check(spec: &Spec) -> Result<()> {
    common_dir(&spec.repository).await?;
    check_branch_name(&spec.repository, &spec.branch).await?;
    resolve_base(&spec.repository, &spec.base).await?;
    if branch_tip(&spec.repository, &spec.branch).await?.is_some() {
        return Err(Error::AlreadyExists(format!(
            "branch {:?} already exists in {}; name another branch (or, for a generated name, another branch prefix) or delete that one",
            spec.branch,
            spec.repository.display()
        )));
    }
    if let Some(other) = nested_branch(&spec.repository, &spec.branch).await? {
        return Err(Error::AlreadyExists(format!(
            "branch {:?} cannot be made in {}: branch {other:?} exists, and git cannot keep a \
             branch and another one inside its name (a/b beside a); name another branch",
            spec.branch,
            spec.repository.display()
        )));
    }
    if spec.path.symlink_metadata().is_ok() {
        return Err(Error::AlreadyExists(format!(
            "worktree directory {} already exists; remove it or pick another worktrees_dir",
            spec.path.display()
        )));
    }
    Ok(())
}

/// Creates the branch from the base and checks it out at the path
/// (`git worktree add --no-track -b BRANCH PATH BASE`). A directory already
/// there on the session's branch of this repository is adopted, so a create
/// repeated after a crash finishes instead of failing.
pub async fn create(spec: &Spec) -> Result<Ensured> {
    let common = common_dir(&spec.repository).await?;
    check_branch_name(&spec.repository, &spec.branch).await?;
    let cut_short = spec.path.symlink_metadata().is_ok()
        && settle_unfinished_add(spec, &common).await? == Unfinished::Cleared;
    if let Some(ensured) = adopt(spec, &common).await? {
        return Ok(ensured);
    }
    let base_commit = resolve_base(&spec.repository, &spec.base).await?;
    if branch_tip(&spec.repository, &spec.branch).await?.is_some() {
        if cut_short {
            // The add cut short had made the branch already: check it out.
            make_parent(&spec.path)?;
            worktree_git(
                &spec.repository,
                &["add", path_str(&spec.path)?, &spec.branch],
            )
            .await?;
            let head = git_ok(&spec.path, &["rev-parse", "HEAD"]).await?;
            return Ok(Ensured {
                outcome: Outcome::Created,
                head,
            });
        }
        return Err(Error::AlreadyExists(format!(
            "branch {:?} already exists in {}; name another branch (or, for a generated name, another branch prefix) or delete that one",
            spec.branch,
            spec.repository.display()
        )));
    }
    clear_stale_ref_lock(spec, &common)?;
    make_parent(&spec.path)?;
    let path = path_str(&spec.path)?;
    let added = worktree_git(
        &spec.repository,
        &["add", "--no-track", "-b", &spec.branch, path, &spec.base],
    )
    .await;
    if let Err(e) = added {
        drop_unused_branch(spec, &base_commit).await;
        return Err(e);
    }
    let head = git_ok(&spec.path, &["rev-parse", "HEAD"]).await?;
    Ok(Ensured {
        outcome: Outcome::Created,
        head,
    })
}

/// A `git worktree add -b` killed while it wrote the branch's ref leaves
/// the ref's lock file, and every later add fails "cannot lock ref …:
/// File exists" (the crash loop: a session ERROR for good). The branch is
/// this session's own and does not exist yet: with no add of its path
/// running, that lock is the dead git's, and goes.
fn clear_stale_ref_lock(spec: &Spec, common: &Path) -> Result<()> {
    let lock = common
        .join("refs/heads")
        .join(format!("{}.lock", spec.branch));
    if lock.symlink_metadata().is_err() || git_add_running(&spec.path) {
        return Ok(());
    }
    tracing::warn!(lock = %lock.display(), "a git worktree add of this session's branch was cut short; removing the ref lock it left");
    match std::fs::remove_file(&lock) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(Error::io(format!("removing {}", lock.display()), e))
        }
        _ => Ok(()),
    }
}

/// After a `git worktree add -b` that failed: git may have made the branch
/// before the checkout failed (a full disk, a directory it may not write).
/// The branch goes when it is still at the base and no worktree has it
/// checked out, so it holds nothing and a create can be made again
/// (helper-41 2); otherwise it is left as it is.
async fn drop_unused_branch(spec: &Spec, base_commit: &str) {
    let at_base = matches!(
        branch_tip(&spec.repository, &spec.branch).await,
        Ok(Some(tip)) if tip == base_commit
    );
    if !at_base {
        return;
    }
    let checked_out = match list(&spec.repository).await {
        Ok(all) => all
            .iter()
            .any(|e| e.branch.as_deref() == Some(spec.branch.as_str())),
        Err(_) => true,
    };
    if checked_out {
        return;
    }
    match git_ok(&spec.repository, &["branch", "-D", "--", &spec.branch]).await {
        Ok(_) => tracing::info!(branch = %spec.branch,
            "the failed worktree add's branch was removed (still at its base)"),
        Err(e) => tracing::warn!(branch = %spec.branch, error = %e,
            "could not remove the failed worktree add's branch"),
    }
}

/// Brings a session's worktree back: adopted when present, checked out
/// again from its branch when the directory is missing. A missing branch is
/// FAILED_PRECONDITION naming it, unless `never_created` (the create was cut
/// short before the branch existed), when it is created from the base.
pub async fn restore(spec: &Spec, never_created: bool) -> Result<Ensured> {
    let common = common_dir(&spec.repository).await?;
    if let Some(ensured) = adopt(spec, &common).await? {
        return Ok(ensured);
    }
    if branch_tip(&spec.repository, &spec.branch).await?.is_none() {
        if never_created {
            return create(spec).await;
        }
        return Err(Error::FailedPrecondition(format!(
            "branch {:?} no longer exists in {}, so worktree {} cannot be recreated; \
             restore the branch (git branch {} <commit>) and resume, or delete the session",
            spec.branch,
            spec.repository.display(),
            spec.path.display(),
            spec.branch
        )));
    }
    let mut registered_here = false;
    for entry in list(&spec.repository).await? {
        if entry.branch.as_deref() != Some(spec.branch.as_str()) {
            continue;
        }
        if entry.path == spec.path {
            registered_here = true;
        } else if !entry.prunable {
            return Err(Error::FailedPrecondition(format!(
                "branch {:?} is checked out at {}, which may hold the session's work (a worktree \
                 moved there?): move it back to {} (git worktree move) and resume; remove it only \
                 if it holds nothing you need",
                spec.branch,
                entry.path.display(),
                spec.path.display()
            )));
        }
    }
    make_parent(&spec.path)?;
    let path = path_str(&spec.path)?;
    if registered_here {
        // Our own stale registration (the directory was deleted): clear it,
        // and only it.
        worktree_git(&spec.repository, &["remove", "--force", path]).await?;
    }
    worktree_git(&spec.repository, &["add", path, &spec.branch]).await?;
    let head = git_ok(&spec.path, &["rev-parse", "HEAD"]).await?;
    Ok(Ensured {
        outcome: Outcome::Recreated,
        head,
    })
}

async fn adopt(spec: &Spec, common: &Path) -> Result<Option<Ensured>> {
    if spec.path.symlink_metadata().is_err() {
        return Ok(None);
    }
    if settle_unfinished_add(spec, common).await? == Unfinished::Cleared {
        return Ok(None);
    }
    if !is_ours(&spec.path, common, &spec.branch).await? {
        return Err(Error::AlreadyExists(format!(
            "{} exists and is not the worktree of branch {:?} of {}; remove it or pick another worktrees_dir",
            spec.path.display(),
            spec.branch,
            spec.repository.display()
        )));
    }
    let head = git_ok(&spec.path, &["rev-parse", "HEAD"]).await?;
    Ok(Some(Ensured {
        outcome: Outcome::Adopted,
        head,
    }))
}

/// What [`settle_unfinished_add`] found.
#[derive(Debug, PartialEq, Eq)]
enum Unfinished {
    /// No `git worktree add` of this path is unfinished (any more).
    None,
    /// One was killed before it finished: its directory and git's entry
    /// for it are gone now, so the path is free.
    Cleared,
}

/// A `git worktree add` of `spec`'s path that has not finished: git marks
/// its entry `locked` "initializing" until the checkout is whole. One still
/// running (its agentctl killed, its git in a session of its own carrying
/// on) is waited for; one whose git is gone left a half-made directory,
/// which is removed with the entry, so the operation starts again instead
/// of taking it for someone else's, or for a whole checkout.
async fn settle_unfinished_add(spec: &Spec, common: &Path) -> Result<Unfinished> {
    let deadline = tokio::time::Instant::now() + GIT_TIMEOUT;
    loop {
        let Some(entry) = unfinished_entry(spec, common) else {
            return Ok(Unfinished::None);
        };
        if !git_add_running(&spec.path) || tokio::time::Instant::now() >= deadline {
            tracing::warn!(path = %spec.path.display(), "a git worktree add of this path was cut short; removing what it left and starting again");
            for dir in [&spec.path, &entry] {
                if let Err(e) = std::fs::remove_dir_all(dir)
                    && e.kind() != std::io::ErrorKind::NotFound
                {
                    return Err(Error::io(format!("removing {}", dir.display()), e));
                }
            }
            return Ok(Unfinished::Cleared);
        }
        tokio::time::sleep(LOCK_POLL).await;
    }
}

/// git's entry (`<common>/worktrees/<id>`) of an add of `spec`'s path that
/// has not finished.
fn unfinished_entry(spec: &Spec, common: &Path) -> Option<PathBuf> {
    let ours = std::fs::canonicalize(&spec.path).ok()?.join(".git");
    std::fs::read_dir(common.join("worktrees"))
        .ok()?
        .flatten()
        .map(|e| e.path())
        .find(|entry| {
            let read = |name: &str| std::fs::read_to_string(entry.join(name)).unwrap_or_default();
            read("locked").trim() == "initializing" && Path::new(read("gitdir").trim()) == ours
        })
}

/// Whether a `git worktree add` naming `path` runs on this host.
fn git_add_running(path: &Path) -> bool {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return false;
    };
    let wanted = path.as_os_str().as_encoded_bytes();
    procs.flatten().any(|p| {
        let Ok(cmdline) = std::fs::read(p.path().join("cmdline")) else {
            return false;
        };
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        args.first().is_some_and(|a| a.ends_with(b"git"))
            && args
                .windows(2)
                .any(|w| w == [&b"worktree"[..], &b"add"[..]])
            && args.contains(&wanted)
    })
}

fn make_parent(path: &Path) -> Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .map_err(|e| Error::io(format!("creating {}", parent.display()), e))?;
    }
    Ok(())
}

/// What removing the worktree (and its branch) would lose.
pub async fn state(spec: &Spec) -> Result<State> {
    let common = common_dir(&spec.repository).await?;
    let mut state = State {
        path_exists: spec.path.is_dir(),
        ..State::default()
    };
    if state.path_exists {
        state.not_ours = !is_ours(&spec.path, &common, &spec.branch).await?;
        state.locked = list(&spec.repository)
            .await?
            .into_iter()
            .find(|e| e.path == spec.path)
            .and_then(|e| e.locked);
        let args = [
            "status",
            "--porcelain=v1",
            "-z",
            "--untracked-files=all",
            "--ignore-submodules=none",
        ];
        let out = git(&spec.path, &args).await?;
        if out.exit_code != Some(0) {
            return Err(Error::FailedPrecondition(format!(
                "git status in {} failed: {}",
                spec.path.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        // Untrimmed: each record starts with its two-letter code, a space
        // included (" M notes.txt").
        let parsed = crate::git::parse_status(&String::from_utf8_lossy(&out.stdout));
        state.dirty_files = parsed.files.into_iter().map(|f| f.path).collect();
    }
    if let Some(tip) = branch_tip(&spec.repository, &spec.branch).await? {
        state.branch_exists = true;
        state.head = tip;
        let exclude = format!("--exclude={}", spec.branch);
        let count = git_ok(
            &spec.repository,
            &[
                "rev-list",
                "--count",
                &format!("refs/heads/{}", spec.branch),
                "--not",
                &exclude,
                "--branches",
                "--tags",
                "--remotes",
            ],
        )
        .await?;
        state.unique_commits = count.parse().unwrap_or(u64::MAX);
        let base = format!("{}^{{commit}}", spec.base);
        let merged = git(
            &spec.repository,
            &[
                "merge-base",
                "--is-ancestor",
                &format!("refs/heads/{}", spec.branch),
                &base,
            ],
        )
        .await?;
        state.merged = merged.exit_code == Some(0);
    }
    Ok(state)
}

/// Removes the worktree (whatever it holds: the caller checked [`state`]
/// or was told to discard) and, with `delete_branch`, the branch. Only this
/// worktree's registration is pruned; a directory that is not this
/// worktree is never touched.
pub async fn remove(spec: &Spec, delete_branch: bool) -> Result<()> {
    let common = common_dir(&spec.repository).await?;
    let path = path_str(&spec.path)?;
    if spec.path.symlink_metadata().is_ok() {
        if !is_ours(&spec.path, &common, &spec.branch).await? {
            return Err(Error::FailedPrecondition(format!(
                "{} is not on branch {:?} any more (checked out elsewhere, or not this repository's worktree); \
                 it was left alone: switch it back, or delete the session with keep_worktree",
                spec.path.display(),
                spec.branch
            )));
        }
        worktree_git(&spec.repository, &["remove", "--force", path]).await?;
    } else if list(&spec.repository)
        .await?
        .iter()
        .any(|e| e.path == spec.path)
    {
        worktree_git(&spec.repository, &["remove", "--force", path]).await?;
    }
    if delete_branch && branch_tip(&spec.repository, &spec.branch).await?.is_some() {
        git_ok(&spec.repository, &["branch", "-D", "--", &spec.branch]).await?;
    }
    Ok(())
}

/// The branch's commits since its base (`base..branch`), newest first.
pub async fn commits(spec: &Spec, limit: u32) -> Result<Vec<Commit>> {
    common_dir(&spec.repository).await?;
    // A base branch deleted since the create: say so, not git's "unknown
    // revision" (helper-41 8).
    let base = format!("{}^{{commit}}", spec.base);
    let found = git(
        &spec.repository,
        &["rev-parse", "--verify", "--quiet", &base],
    )
    .await?;
    if found.exit_code != Some(0) {
        return Err(Error::FailedPrecondition(format!(
            "the session's base {:?} is no longer a branch, tag or commit of {} (deleted since \
             the session was created?): recreate it to list the commits since it, or review \
             the branch {:?} with git directly",
            spec.base,
            spec.repository.display(),
            spec.branch
        )));
    }
    let range = format!("{}..refs/heads/{}", spec.base, spec.branch);
    let max = format!("--max-count={}", limit.max(1));
    let out = git_ok(
        &spec.repository,
        &["log", &max, "--format=%H%x1f%s%x1f%an%x1f%at%x1e", &range],
    )
    .await?;
    Ok(out
        .split('\x1e')
        .filter_map(|rec| {
            let mut f = rec.trim().split('\x1f');
            Some(Commit {
                sha: f.next().filter(|s| !s.is_empty())?.to_owned(),
                subject: f.next()?.to_owned(),
                author: f.next()?.to_owned(),
                time: f.next()?.parse().ok()?,
            })
        })
        .collect())
}

/// The repository's branches, and the one its own checkout is on.
#[derive(Debug, Clone, Serialize)]
pub struct Branches {
    /// Local branch names, sorted.
    pub names: Vec<String>,
    /// The branch HEAD names; empty when detached.
    pub current: String,
}

/// The repository's local branches (what a new worktree can start from).
pub async fn branches(repository: &Path) -> Result<Branches> {
    common_dir(repository).await?;
    let out = git_ok(
        repository,
        &["for-each-ref", "--format=%(refname:short)", "refs/heads/"],
    )
    .await?;
    let mut names: Vec<String> = out
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect();
    names.sort();
    let current = git(repository, &["symbolic-ref", "--quiet", "--short", "HEAD"])
        .await
        .ok()
        .filter(|o| o.exit_code == Some(0))
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    Ok(Branches { names, current })
}

/// Held while a create, restore or remove changes the worktree at one
/// path. An operation whose caller died (a sessiond killed in the middle of
/// a create) goes on with its git; the next caller's operation on the same
/// worktree (the restarted sessiond's recovery) waits for it instead of
/// racing it: seeing its half-made directory as someone else's, or having
/// the directory removed under its feet by git's cleanup. An advisory lock
/// (`flock`) on a file in the repository's git directory, one per worktree
/// path, released when its holder ends, however it ends.
#[derive(Debug)]
pub struct PathLock {
    _file: std::fs::File,
}

/// How often a waiting operation tries the lock again.
const LOCK_POLL: Duration = Duration::from_millis(20);

/// Takes the lock of `spec`'s worktree, waiting for an operation on it in
/// flight; `waiting` is called once if it has to wait.
pub async fn lock(spec: &Spec, waiting: &(dyn Fn() + Sync)) -> Result<PathLock> {
    let common = common_dir(&spec.repository).await?;
    let path = std::path::absolute(&spec.path).unwrap_or_else(|_| spec.path.clone());
    let file = locks_dir(&common)?.join(format!(
        "{:016x}.lock",
        fnv1a(path.as_os_str().as_encoded_bytes())
    ));
    hold(&file, waiting).await
}

/// The directory of sessiond's lock files in a repository's git directory.
fn locks_dir(common: &Path) -> Result<PathBuf> {
    let dir = common.join("sessiond-worktree-locks");
    std::fs::create_dir_all(&dir)
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    Ok(dir)
}

/// Takes the `flock` of `file`, waiting while another process holds it;
/// `waiting` is called once if it has to wait.
async fn hold(file: &Path, waiting: &(dyn Fn() + Sync)) -> Result<PathLock> {
    let handle = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(file)
        .map_err(|e| Error::io(format!("opening {}", file.display()), e))?;
    let mut told = false;
    loop {
        match handle.try_lock() {
            Ok(()) => return Ok(PathLock { _file: handle }),
            Err(std::fs::TryLockError::WouldBlock) => {
                if !told {
                    waiting();
                    told = true;
                }
                tokio::time::sleep(LOCK_POLL).await;
            }
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(Error::io(format!("locking {}", file.display()), e));
            }
        }
    }
}

/// FNV-1a, 64 bits: a lock file's name from its worktree's path, the same
/// in every agentctl version.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Runs operation `op` (`check`, `create`, ...) and answers what
/// `agentctl worktree OP` prints under `ok`. The operations that change the
/// worktree hold its [`PathLock`]; `waiting` is called when one has to wait
/// for another operation on the same worktree first.
pub async fn run(
    op: &str,
    spec: &Spec,
    never_created: bool,
    delete_branch: bool,
    limit: u32,
    waiting: &(dyn Fn() + Sync),
) -> Result<serde_json::Value> {
    let _held = match op {
        "create" | "restore" | "remove" => Some(lock(spec, waiting).await?),
        _ => None,
    };
    Ok(match op {
        "check" => check(spec).await.map(|()| serde_json::json!({}))?,
        "create" => serde_json::json!(create(spec).await?),
        "restore" => serde_json::json!(restore(spec, never_created).await?),
        "state" => serde_json::json!(state(spec).await?),
        "remove" => remove(spec, delete_branch)
            .await
            .map(|()| serde_json::json!({}))?,
        "commits" => serde_json::json!(commits(spec, limit).await?),
        "branches" => serde_json::json!(branches(&spec.repository).await?),
        other => {
            return Err(Error::InvalidArgument(format!(
                "op: {other:?} is not check, create, restore, state, remove, commits or branches"
            )));
        }
    })
}
