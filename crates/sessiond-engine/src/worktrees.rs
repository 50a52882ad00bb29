//! Worktrees sessiond creates for sessions that name a repository: planned
//! and checked before anything is stored, created after the session's
//! intent is committed, brought back before an agent is relaunched in
//! them, and removed with the session only when nothing would be lost.

use std::path::Path;
use std::sync::Arc;

use sessiond_domain::{
    Runtime, Session, SessionId, Worktree,
    worktree::{Removal, RemovalRequest, branch_name, removal, short_id, slug},
};
use sessiond_executor::{Executor, RemoteTarget, WorktreeAnswer, WorktreeOp, WorktreeTarget};

use crate::{
    error::{Error, Result},
    lifecycle::RemoteAgentctl,
    manager::SessionManager,
    ops::Agents,
};

/// Session metadata: `true` once the worktree's branch and directory were
/// made. Until then a restore may create them from the base (the create was
/// cut short); after, a missing branch is lost work and said so.
pub(crate) const WORKTREE_CREATED_KEY: &str = "worktree_created";
/// Metadata key set on a session whose create could not make its
/// worktree: what its worktree names is not its own, and a delete leaves it.
pub(crate) const WORKTREE_NOT_MADE_KEY: &str = "worktree_not_made";

/// Whether `base` names a commit relative to where a repository is now
/// (`HEAD`, `HEAD~1`, `main^`, `@{upstream}`, `FETCH_HEAD`): kept as
/// written, it would mean another commit later, and inside the worktree
/// its own HEAD. Branch, tag and commit names are kept as written.
pub(crate) fn base_moves(base: &str) -> bool {
    base == "@"
        || base.contains(['~', '^', ':'])
        || base.contains("@{")
        || (base.ends_with("HEAD") && base.chars().all(|c| c.is_ascii_uppercase() || c == '_'))
}

/// Whether the directory at `path`, which exists on this host, may still be
/// the linked worktree sessiond made there from `repository`, read from
/// git's files alone (no git run; recovery asks it of every such session):
/// `path/.git` names an admin directory under the repository's git
/// directory, which names `path/.git` back. False only when that is known
/// not to hold: a directory put there by hand, another repository's clone.
/// A repository that cannot be read answers true (the restore, or the
/// agent, says what is wrong then).
pub(crate) fn may_be_linked_worktree(path: &Path, repository: &Path) -> bool {
    let dot_git = path.join(".git");
    let Ok(text) = std::fs::read_to_string(&dot_git) else {
        // No `.git` file: nothing of git's (or a clone's own directory).
        return false;
    };
    let Some(admin) = text
        .lines()
        .find_map(|l| l.strip_prefix("gitdir:"))
        .map(|g| path.join(g.trim()))
    else {
        return false;
    };
    let points_back = std::fs::read_to_string(admin.join("gitdir"))
        .ok()
        .and_then(|back| std::fs::canonicalize(back.trim()).ok())
        .zip(std::fs::canonicalize(&dot_git).ok())
        .is_some_and(|(back, ours)| back == ours);
    if !points_back {
        return false;
    }
    match (
        std::fs::canonicalize(&admin),
        std::fs::canonicalize(repository),
    ) {
        // Under `repository/.git` (or a bare repository itself); a
        // repository that is a linked worktree keeps its admin elsewhere.
        (Ok(admin), Ok(repository)) => {
            admin.starts_with(&repository) || !repository.join(".git").is_dir()
        }
        _ => true,
    }
}

/// `agentctl`: a remote session's host agentctl, which makes its worktree.
pub(crate) fn target(
    w: &Worktree,
    agentctl: Option<(RemoteTarget, Option<i64>)>,
) -> WorktreeTarget {
    WorktreeTarget {
        repository: w.repository.clone(),
        base: w.base.clone(),
        branch: w.branch.clone(),
        path: w.path.clone(),
        agentctl,
    }
}

impl SessionManager {
    /// The commits of a session's branch since its base, newest first.
    pub async fn branch_commits(
        &self,
        task: sessiond_domain::TaskId,
        session_id: SessionId,
        limit: u32,
    ) -> Result<Vec<sessiond_executor::BranchCommit>> {
        let s = self.session_of_task(task, session_id).await?;
        if !s.worktree.is_managed() {
            return Err(Error::InvalidState {
                session_id,
                state: s.state,
                action: "list its branch's commits",
                hint: "its worktree is a directory the caller made, with no base recorded",
            });
        }
        match Agents(self)
            .driver(s.runtime)?
            .worktree(
                &Worktrees(self).worktree_target(&s).await?,
                WorktreeOp::Commits { limit },
            )
            .await?
        {
            WorktreeAnswer::Commits(c) => Ok(c),
            other => Err(Error::Internal(format!(
                "agentctl answered a commit list with {other:?}"
            ))),
        }
    }

    /// The local branches of `repository` on `runtime`'s host (what a new
    /// session's worktree can start from), and the one its checkout is on.
    /// A remote host's are listed by its agentctl, `remote`, which the
    /// caller names as for a session it creates there.
    pub async fn repository_branches(
        &self,
        runtime: Runtime,
        repository: &str,
        remote: Option<&RemoteAgentctl>,
    ) -> Result<(Vec<String>, String)> {
        let agentctl = match (runtime, remote) {
            (Runtime::Remote, None) => {
                return Err(Error::InvalidArgument(
                    "runtime remote: name the host's agentctl (its URL, secret and executor id) \
                     to list its repository's branches"
                        .into(),
                ));
            }
            (Runtime::Remote, Some(r)) => Some((
                {
                    self.check_remote_host(r, false).await?;
                    RemoteTarget {
                        url: r.url.clone(),
                        auth_secret: r.auth_secret.clone(),
                    }
                },
                None,
            )),
            _ => None,
        };
        let t = WorktreeTarget {
            repository: repository.to_owned(),
            base: String::new(),
            branch: String::new(),
            path: String::new(),
            agentctl,
        };
        match Agents(self)
            .driver(runtime)?
            .worktree(&t, WorktreeOp::Branches)
            .await?
        {
            WorktreeAnswer::Branches { names, current } => Ok((names, current)),
            other => Err(Error::Internal(format!(
                "agentctl answered a branch list with {other:?}"
            ))),
        }
    }
}

impl SessionManager {
    /// A remote host's agentctl that a call names (URL, secret, executor
    /// id), checked before anything reaches it: one that answers as
    /// another executor is refused (INVALID_ARGUMENT), as a worktree made
    /// through it would bind that host to a session it does not serve, and
    /// the right session could not be created there after it. Any other
    /// failure (unreachable, secret, TLS) is left to the call, which
    /// reports it as before. With `serves_own_workspace` (a session in a
    /// directory of the host's, not a worktree made for it), a host that
    /// serves no workspace is refused too (INVALID_ARGUMENT): its agent
    /// could not start, and the session would be stored ERROR with its
    /// executor id taken.
    pub(crate) async fn check_remote_host(
        &self,
        remote: &RemoteAgentctl,
        serves_own_workspace: bool,
    ) -> Result<()> {
        // Only the address, secret and identity matter to the client; the
        // session and task are not known yet.
        let handle = sessiond_executor::ExecutorHandle {
            executor_id: remote.executor_id,
            session_id: SessionId::new(),
            task_id: sessiond_domain::TaskId::new(),
            runtime: Runtime::Remote,
            workspace_path: std::path::PathBuf::new(),
            generation: 0,
            auth_secret: remote.auth_secret.clone(),
            agentctl_url: remote.url.clone(),
            agentctl_port: None,
            pid: None,
            pid_start_time: None,
            container_id: None,
            lease_epoch: None,
        };
        let client = Agents(self).driver(Runtime::Remote)?.client(&handle)?;
        match client.verify_identity(remote.executor_id).await {
            Ok(health) if serves_own_workspace && health.workspace_root.as_deref() == Some("") => {
                Err(Error::InvalidArgument(format!(
                    "remote session without --repo: the agentctl at {} serves no workspace: it was started with \
                     --worktree-root only, so a session there needs a worktree sessiond \
                     makes for it (--repo DIR --base REF, paths on that host); or start \
                     that agentctl with --workspace DIR",
                    remote.url
                )))
            }
            Ok(_) => Ok(()),
            Err(sessiond_executor::Error::IdentityMismatch { url, actual, .. }) => {
                Err(Error::InvalidArgument(format!(
                    "remote executor id: the agentctl at {url} serves executor {actual}, not {}; \
                     name the executor id it was started with (--executor-id), or the URL of \
                     that executor's host",
                    remote.executor_id
                )))
            }
            Err(_) => Ok(()),
        }
    }
}

/// A session's git worktree on its executor's host: planned and created
/// with the session, restored from its branch by recovery, removed only
/// when nothing would be lost.
pub(crate) struct Worktrees<'m>(pub(crate) &'m crate::manager::SessionManager);

impl std::ops::Deref for Worktrees<'_> {
    type Target = crate::manager::SessionManager;

    fn deref(&self) -> &Self::Target {
        self.0
    }
}

impl Worktrees<'_> {
    /// The worktree of `s` as its driver takes it: for a remote session,
    /// with the host's agentctl its executor record names.
    pub(crate) async fn worktree_target(&self, s: &Session) -> Result<WorktreeTarget> {
        let agentctl = if s.runtime == Runtime::Remote {
            let record = self
                .inner
                .store
                .get_executor_for_session(s.id)
                .await?
                .ok_or_else(|| {
                    Error::Internal(format!(
                        "remote session {} has no executor record naming its host",
                        s.id
                    ))
                })?;
            Some((
                RemoteTarget {
                    url: record.agentctl_url.clone().unwrap_or_default(),
                    auth_secret: record.auth_secret.clone(),
                },
                Some(record.lease_epoch),
            ))
        } else {
            None
        };
        Ok(target(&s.worktree, agentctl))
    }

    /// Fills in the branch, directory and id of a worktree to create for a
    /// new session and has agentctl check, changing nothing, that it can
    /// be made: a repository, an existing base, a free branch and directory.
    pub(crate) async fn plan_worktree(
        &self,
        w: &mut Worktree,
        runtime: Runtime,
        session_id: SessionId,
        task_title: &str,
        remote: Option<&RemoteAgentctl>,
    ) -> Result<()> {
        if !w.path.is_empty() {
            return Err(Error::InvalidArgument(
                "worktree.path and repository exclude each other: name a repository \
                 (sessiond creates the worktree) or the path of a directory you made"
                    .into(),
            ));
        }
        if w.base.trim().is_empty() {
            return Err(Error::InvalidArgument(
                "base: required with a repository (the branch, tag or commit to start from, such as main)"
                    .into(),
            ));
        }
        if !Path::new(&w.repository).is_absolute() {
            return Err(Error::InvalidArgument(format!(
                "repository: {:?} is not an absolute path on the executor's host",
                w.repository
            )));
        }
        // One name per repository (helper-38 10): no trailing `/`, and the
        // repository rather than its `.git` directory. On this host (the
        // local runtimes), its real path: a symlink is followed once, now, where the create
        // checks where it leads; kept, a later restore or delete would
        // follow it wherever it pointed by then (helper-62 1).
        let mut repository: std::path::PathBuf = Path::new(&w.repository).components().collect();
        if matches!(runtime, Runtime::LocalStandalone | Runtime::LocalDocker)
            && let Ok(real) = std::fs::canonicalize(&repository)
        {
            repository = real;
        }
        if repository.file_name().is_some_and(|n| n == ".git") {
            repository.pop();
        }
        w.repository = repository.display().to_string();
        let settings = &self.inner.config.worktrees;
        let dir = settings.dir(runtime).ok_or_else(|| {
            Error::InvalidArgument(if runtime == Runtime::LocalStandalone {
                format!(
                    "runtime {runtime} has no executors.worktrees_dir, so it cannot create \
                     worktrees; configure one inside executors.worktree_roots, or pass \
                     worktree.path of a directory you made"
                )
            } else if runtime == Runtime::Remote {
                format!(
                    "runtime {runtime} has no executors.remote.worktrees_dir (the directory \
                     on remote hosts their agentctls make worktrees in), so it cannot create \
                     worktrees; configure one, or pass worktree.path of a directory on the host"
                )
            } else {
                format!(
                    "runtime {runtime} has no worktrees directory, so it cannot create \
                     worktrees; configure one (executors.docker.worktrees_dir for \
                     local_docker), or pass worktree.path of a directory on its host"
                )
            })
        })?;
        if w.branch.is_empty() {
            w.branch = branch_name(&settings.branch_prefix, session_id, task_title);
        }
        w.path = dir
            .join(format!("{}-{}", short_id(session_id), slug(task_title)))
            .display()
            .to_string();
        // On this host, where the directory really is: a symlink on the way
        // (the default dir's parents, or the dir swapped after the start)
        // must not lead out of the roots (helper-41 1).
        if runtime != Runtime::Remote
            && let Some(resolved) = settings.outside_roots(Path::new(&w.path))
        {
            return Err(Error::InvalidArgument(format!(
                "the worktree directory {} resolves to {} (through a symlink), outside \
                 executors.worktree_roots ({}); nothing was created: point the worktrees \
                 directory at one inside the roots",
                w.path,
                resolved.display(),
                settings.listed_roots()
            )));
        }
        if w.id.is_empty() {
            w.id = short_id(session_id);
        }
        let agentctl = remote.map(|r| {
            (
                RemoteTarget {
                    url: r.url.clone(),
                    auth_secret: r.auth_secret.clone(),
                },
                None,
            )
        });
        Agents(self)
            .driver(runtime)?
            .worktree(&target(w, agentctl), WorktreeOp::Check)
            .await?;
        Ok(())
    }

    /// Makes the planned worktree (the session's intent is committed);
    /// the commit it checked out, when agentctl says.
    pub(crate) async fn make_worktree(&self, s: &Session) -> Result<Option<String>> {
        let made = Agents(self)
            .driver(s.runtime)?
            .worktree(&self.worktree_target(s).await?, WorktreeOp::Create)
            .await?;
        Ok(match made {
            WorktreeAnswer::Ensured { head, .. } if !head.is_empty() => Some(head),
            _ => None,
        })
    }

    /// Brings back the directory of a session's worktree before an agent
    /// is launched in it: adopted when present, recreated from its branch
    /// when not. The error names the branch when it is gone. True when it
    /// was checked out anew.
    pub(crate) async fn restore_worktree(
        &self,
        driver: &Arc<dyn Executor>,
        s: &Session,
    ) -> Result<bool> {
        let never_created = !s.metadata.contains_key(WORKTREE_CREATED_KEY);
        let answer = driver
            .worktree(
                &self.worktree_target(s).await?,
                WorktreeOp::Restore { never_created },
            )
            .await?;
        match answer {
            WorktreeAnswer::Ensured { outcome, head } => {
                tracing::info!(session = %s.id, branch = %s.worktree.branch, %outcome, %head,
                    "worktree restored");
                Ok(outcome != "adopted")
            }
            _ => Ok(false),
        }
    }

    /// Decides what a delete does with a session's worktree, from what
    /// agentctl finds in it now. `Err` when removing it would lose work (or
    /// it cannot be inspected) and the caller did not say discard or keep.
    /// Refuses to remove `s`'s worktree while another session that has not
    /// ended works in it (created with `worktree.path` inside it): deleting
    /// one session must not pull the directory from under another, whatever
    /// `discard` says. `keep` removes nothing, so it is always allowed.
    pub(crate) async fn refuse_if_shared(&self, s: &Session, asked: RemovalRequest) -> Result<()> {
        if asked.keep || s.worktree.path.is_empty() {
            return Ok(());
        }
        let others: Vec<String> = self
            .inner
            .store
            .list_sessions_in_directory(s.worktree.path.clone())
            .await?
            .into_iter()
            .filter(|o| o.id != s.id && !o.state.is_terminal())
            .map(|o| format!("{} ({})", o.id, o.state))
            .collect();
        if others.is_empty() {
            return Ok(());
        }
        Err(Error::WorktreeHasWork {
            session_id: s.id,
            path: s.worktree.path.clone(),
            what: format!(
                "session{} {} still work{} in it; stop or delete {} first, or delete this \
                 session with keep_worktree (--keep-worktree) to leave the directory",
                if others.len() == 1 { "" } else { "s" },
                others.join(", "),
                if others.len() == 1 { "s" } else { "" },
                if others.len() == 1 { "it" } else { "them" },
            ),
        })
    }

    pub(crate) async fn worktree_removal(
        &self,
        s: &Session,
        t: &WorktreeTarget,
        asked: RemovalRequest,
    ) -> Result<Removal> {
        if asked.keep {
            return Ok(Removal::Keep);
        }
        let driver = Agents(self).driver(s.runtime)?;
        let found = match driver.worktree(t, WorktreeOp::State).await {
            Ok(WorktreeAnswer::State(found)) => found,
            Ok(other) => {
                return Err(Error::Internal(format!(
                    "agentctl answered a worktree state with {other:?}"
                )));
            }
            // The repository itself may be gone: nothing to inspect, and
            // discarding was asked for.
            Err(_) if asked.discard => {
                return Ok(Removal::Remove {
                    delete_branch: asked.delete_branch,
                });
            }
            // agentctl answered, but git cannot read the worktree (a
            // removal cut short leaves a directory that is no worktree any
            // more): say how to go on.
            Err(e) if !e.is_unavailable() => {
                return Err(Error::WorktreeHasWork {
                    session_id: s.id,
                    path: s.worktree.path.clone(),
                    what: format!(
                        "its state cannot be read ({e}); if an earlier delete was cut short, \
                         delete again with keep_worktree (--keep-worktree), then remove what is \
                         left of the directory by hand (`git worktree prune` in the repository \
                         drops git's entry; its branch stays)"
                    ),
                });
            }
            Err(e) => return Err(e.into()),
        };
        match removal(&s.worktree.branch, &found, asked) {
            Removal::Refuse(what) => Err(Error::WorktreeHasWork {
                session_id: s.id,
                path: s.worktree.path.clone(),
                what,
            }),
            decided => Ok(decided),
        }
    }

    /// Removes a session's worktree as decided.
    pub(crate) async fn remove_worktree(
        &self,
        s: &Session,
        t: &WorktreeTarget,
        delete_branch: bool,
    ) -> Result<()> {
        Agents(self)
            .driver(s.runtime)?
            .worktree(t, WorktreeOp::Remove { delete_branch })
            .await?;
        Ok(())
    }
}
