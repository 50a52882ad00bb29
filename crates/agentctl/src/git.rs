//! `git status` / `git diff` of the workspace through the `git` binary.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use sessiond_proto::agentctl::v1::{GitFileStatus, GitStatusResponse};

use crate::error::{Error, Result};
use crate::exec::{self, ExecSpec};
use crate::workspace::Workspace;

const GIT_TIMEOUT: Duration = Duration::from_secs(60);
const GIT_MAX_OUTPUT: u64 = 32 << 20;

/// Configuration that makes git execute nothing the repository names: the
/// workspace's `.git/config` is written by the agent (or through WriteFile),
/// and a UI polling GitStatus must not run what it planted there. Command
/// line `-c` wins over every config file.
pub(crate) const INERT: &[&str] = &[
    "core.fsmonitor=false",
    "core.hooksPath=/dev/null",
    "core.pager=cat",
    "core.editor=false",
    "core.sshCommand=false",
    "core.askPass=",
    "credential.helper=",
    "diff.external=",
    "protocol.allow=never",
    "uploadpack.packObjectsHook=",
    "gpg.program=false",
    "core.untrackedCache=false",
];

/// The names of filter drivers the repository configures (`filter.<name>.*`):
/// their clean / smudge / process commands would run on status and diff.
async fn filter_drivers(ws: &Workspace, env: &HashMap<String, String>) -> Result<Vec<String>> {
    let args = [
        "config",
        "--null",
        "--name-only",
        "--get-regexp",
        r"^filter\.",
    ]
    .map(String::from);
    let out = exec::run(ExecSpec {
        command: "git",
        args: &args,
        cwd: ws.root(),
        cwd_handle: None,
        env,
        timeout: GIT_TIMEOUT,
        max_output: 1 << 20,
    })
    .await?;
    let names = String::from_utf8_lossy(&out.stdout)
        .split('\0')
        .filter_map(|key| {
            let rest = key.strip_prefix("filter.")?;
            let (name, _) = rest.rsplit_once('.')?;
            Some(name.to_owned())
        })
        .collect::<std::collections::BTreeSet<_>>();
    Ok(names.into_iter().collect())
}

async fn git(ws: &Workspace, args: &[String]) -> Result<Vec<u8>> {
    git_on_index(ws, args, None).await
}

/// [`git`] with `GIT_INDEX_FILE` set to `index` when given: a copy of the
/// worktree's index that a command may change without touching the real one.
async fn git_on_index(ws: &Workspace, args: &[String], index: Option<&Path>) -> Result<Vec<u8>> {
    let mut env = HashMap::new();
    if let Some(index) = index {
        env.insert(
            "GIT_INDEX_FILE".to_owned(),
            index.to_string_lossy().into_owned(),
        );
    }
    // No system-wide config; the user's own (~/.gitconfig) is theirs.
    env.insert("GIT_CONFIG_NOSYSTEM".to_owned(), "1".to_owned());
    env.insert("GIT_PAGER".to_owned(), "cat".to_owned());
    env.insert("GIT_EXTERNAL_DIFF".to_owned(), String::new());
    // Only the workspace itself may be the repository, never a parent of it.
    if let Some(parent) = ws.root().parent() {
        env.insert(
            "GIT_CEILING_DIRECTORIES".to_owned(),
            parent.to_string_lossy().into_owned(),
        );
    }
    env.insert("GIT_OPTIONAL_LOCKS".to_owned(), "0".to_owned());
    env.insert("GIT_TERMINAL_PROMPT".to_owned(), "0".to_owned());
    env.insert("LC_ALL".to_owned(), "C".to_owned());
    let mut full: Vec<String> = Vec::new();
    for setting in INERT {
        full.push("-c".into());
        full.push((*setting).into());
    }
    for name in filter_drivers(ws, &env).await.unwrap_or_default() {
        // A driver without commands passes content through unchanged.
        for key in ["clean", "smudge", "process"] {
            full.push("-c".into());
            full.push(format!("filter.{name}.{key}="));
        }
        full.push("-c".into());
        full.push(format!("filter.{name}.required=false"));
    }
    full.push("--no-pager".into());
    full.extend(args.iter().cloned());
    let out = exec::run(ExecSpec {
        command: "git",
        args: &full,
        cwd: ws.root(),
        cwd_handle: None,
        env: &env,
        timeout: GIT_TIMEOUT,
        max_output: GIT_MAX_OUTPUT,
    })
    .await
    .map_err(|e| match e {
        Error::NotFound(m) => Error::FailedPrecondition(format!("git is not installed: {m}")),
        other => other,
    })?;
    if out.timed_out {
        return Err(Error::DeadlineExceeded(format!(
            "git {} took longer than {GIT_TIMEOUT:?}",
            args.join(" ")
        )));
    }
    if out.exit_code != Some(0) {
        let stderr = String::from_utf8_lossy(&out.stderr);
        // `git diff` says it capitalised, followed by its usage.
        if stderr.to_ascii_lowercase().contains("not a git repository") {
            return Err(Error::FailedPrecondition(format!(
                "workspace {} is not a git repository",
                ws.root().display()
            )));
        }
        return Err(Error::FailedPrecondition(format!(
            "git {} failed: {}",
            args.first().map_or("", String::as_str),
            stderr.trim()
        )));
    }
    if out.stdout_truncated {
        return Err(Error::OutOfRange(format!(
            "git output is larger than {GIT_MAX_OUTPUT} bytes"
        )));
    }
    Ok(out.stdout)
}

/// `git status --porcelain=v1 -b`, parsed.
pub async fn status(ws: &Workspace) -> Result<GitStatusResponse> {
    let args = [
        "status",
        "--porcelain=v1",
        "-b",
        "-z",
        "--untracked-files=all",
    ]
    .map(String::from);
    let out = git(ws, &args).await?;
    Ok(parse_status(&String::from_utf8_lossy(&out)))
}

/// Parses `git status --porcelain=v1 -b -z` output.
pub fn parse_status(out: &str) -> GitStatusResponse {
    let mut resp = GitStatusResponse::default();
    let mut records = out.split('\0').filter(|r| !r.is_empty());
    while let Some(rec) = records.next() {
        if let Some(header) = rec.strip_prefix("## ") {
            resp.branch = parse_branch(header);
            continue;
        }
        let (code, path) = (rec.get(..2).unwrap_or(""), rec.get(3..).unwrap_or(""));
        if code.contains(['R', 'C']) {
            // The original path of a rename or copy follows as its own record.
            records.next();
        }
        resp.files.push(GitFileStatus {
            path: path.to_owned(),
            code: code.to_owned(),
        });
    }
    resp
}

fn parse_branch(header: &str) -> String {
    for prefix in ["No commits yet on ", "Initial commit on "] {
        if let Some(b) = header.strip_prefix(prefix) {
            return b.trim().to_owned();
        }
    }
    if header.starts_with("HEAD (no branch)") {
        return "HEAD".to_owned();
    }
    let end = header
        .find("...")
        .or_else(|| header.find(' '))
        .unwrap_or(header.len());
    header[..end].to_owned()
}

/// `git diff` of the working tree against the index, or of the index against
/// HEAD when `staged`; limited to `paths` when given.
pub async fn diff(ws: &Workspace, staged: bool, paths: &[String]) -> Result<String> {
    let mut args: Vec<String> = ["diff", "--no-color", "--no-ext-diff", "--no-textconv"]
        .map(String::from)
        .to_vec();
    if staged {
        args.push("--cached".into());
    }
    args.push("--".into());
    for p in paths {
        let resolved = ws.resolve(p)?;
        let rel = ws.relative(&resolved);
        args.push(if rel.as_os_str().is_empty() {
            ".".to_owned()
        } else {
            rel.to_string_lossy().into_owned()
        });
    }
    let out = git(ws, &args).await?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// `git diff` of the working tree against the commit where HEAD left
/// `base`: what the worktree's branch changed, committed or not. Files
/// nobody added (that `.gitignore` does not exclude) are in it as new
/// files: they are the session's work too. They are marked intent-to-add
/// in a temporary copy of the index, so the worktree's own index is left
/// as it was.
pub async fn diff_against(ws: &Workspace, base: &str, paths: &[String]) -> Result<String> {
    if base.starts_with('-') || base.contains(['\0', '\n']) {
        return Err(Error::InvalidArgument(format!(
            "base {base:?} is not a ref name"
        )));
    }
    let spec = format!("{base}^{{commit}}");
    let resolved = git(
        ws,
        &[
            "rev-parse".into(),
            "--verify".into(),
            "--quiet".into(),
            spec,
        ],
    )
    .await
    .map_err(|e| match e {
        // A workspace that is no repository (helper-52 8: its `.git` broken)
        // says so, as git-status does; only an unknown ref is the base's fault.
        Error::FailedPrecondition(m) if !m.contains("is not a git repository") => {
            Error::InvalidArgument(format!("base {base:?} is not a ref of the repository"))
        }
        other => other,
    })?;
    let base_commit = String::from_utf8_lossy(&resolved).trim().to_owned();
    let fork = git(ws, &["merge-base".into(), base_commit, "HEAD".into()]).await?;
    let mut pathspec = vec!["--".to_owned()];
    for p in paths {
        let resolved = ws.resolve(p)?;
        let rel = ws.relative(&resolved);
        pathspec.push(if rel.as_os_str().is_empty() {
            ".".to_owned()
        } else {
            rel.to_string_lossy().into_owned()
        });
    }
    if pathspec.len() == 1 {
        pathspec.push(".".to_owned());
    }
    let index = IndexCopy::of(ws).await?;
    let mut add: Vec<String> = vec!["add".into(), "--intent-to-add".into()];
    add.extend(pathspec.iter().cloned());
    git_on_index(ws, &add, Some(&index.0)).await?;
    let mut args: Vec<String> = ["diff", "--no-color", "--no-ext-diff", "--no-textconv"]
        .map(String::from)
        .to_vec();
    args.push(String::from_utf8_lossy(&fork).trim().to_owned());
    args.extend(pathspec);
    let out = git_on_index(ws, &args, Some(&index.0)).await?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// A copy of the worktree's index in the temporary directory, removed
/// when dropped.
struct IndexCopy(PathBuf);

impl IndexCopy {
    async fn of(ws: &Workspace) -> Result<Self> {
        let path = git(
            ws,
            &[
                "rev-parse".into(),
                "--path-format=absolute".into(),
                "--git-path".into(),
                "index".into(),
            ],
        )
        .await?;
        let index = PathBuf::from(String::from_utf8_lossy(&path).trim());
        // Outside the repository, which sessiond changes only through
        // `git worktree` and the session's branch.
        let copy =
            std::env::temp_dir().join(format!("sessiond-diff-index-{}", uuid::Uuid::new_v4()));
        match std::fs::copy(&index, &copy) {
            Ok(_) => {}
            // No index yet (nothing was ever added): git starts an empty one.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(Error::FailedPrecondition(format!(
                    "copying the index {} to {}: {e}",
                    index.display(),
                    copy.display()
                )));
            }
        }
        Ok(Self(copy))
    }
}

impl Drop for IndexCopy {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
        let _ = std::fs::remove_file(self.0.with_extension("lock"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_porcelain() {
        let s = parse_status(
            "## main...origin/main [ahead 1]\0 M a.txt\0?? new file\0R  b\0old b\0A  c\0",
        );
        assert_eq!(s.branch, "main");
        let got: Vec<(&str, &str)> = s
            .files
            .iter()
            .map(|f| (f.code.as_str(), f.path.as_str()))
            .collect();
        assert_eq!(
            got,
            vec![
                (" M", "a.txt"),
                ("??", "new file"),
                ("R ", "b"),
                ("A ", "c")
            ]
        );
        assert_eq!(parse_status("## No commits yet on trunk\0").branch, "trunk");
        assert_eq!(parse_status("## HEAD (no branch)\0").branch, "HEAD");
        assert_eq!(parse_status("## dev\0").branch, "dev");
    }
}
