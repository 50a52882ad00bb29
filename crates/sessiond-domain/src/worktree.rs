//! Worktrees sessiond creates for sessions: how their branch is named, and
//! whether deleting a session may remove one without losing work.

use crate::ids::SessionId;

/// The longest slug a branch name gets from a task title.
pub const MAX_SLUG: usize = 40;

/// A branch-name-safe slug of `title`: lowercase ASCII letters and digits,
/// every other run of characters one `-`, at most [`MAX_SLUG`] characters;
/// `session` when nothing is left.
pub fn slug(title: &str) -> String {
    let mut out = String::new();
    for c in title.chars() {
        if out.len() >= MAX_SLUG {
            break;
        }
        if c.is_ascii_alphanumeric() {
            out.push(c.to_ascii_lowercase());
        } else if !out.is_empty() && !out.ends_with('-') {
            out.push('-');
        }
    }
    let trimmed = out.trim_end_matches('-');
    if trimmed.is_empty() {
        "session".to_owned()
    } else {
        trimmed.to_owned()
    }
}

/// The 8 characters of a session id its branch and directory carry: the
/// random end of the UUIDv7 (its start is the creation time, which two
/// sessions made in the same millisecond share).
pub fn short_id(session: SessionId) -> String {
    let simple = session.to_string().replace('-', "");
    simple[simple.len() - 8..].to_owned()
}

/// The branch of a session's worktree: `<prefix>/<short id>-<slug of the
/// task title>`.
pub fn branch_name(prefix: &str, session: SessionId, task_title: &str) -> String {
    let prefix = prefix.trim_matches('/');
    let leaf = format!("{}-{}", short_id(session), slug(task_title));
    if prefix.is_empty() {
        leaf
    } else {
        format!("{prefix}/{leaf}")
    }
}

/// What a worktree holds that removing it would lose, as agentctl found it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorktreeContents {
    /// The directory exists.
    pub path_exists: bool,
    /// The branch exists.
    pub branch_exists: bool,
    /// Files with uncommitted changes (untracked included, ignored not).
    pub dirty_files: Vec<String>,
    /// Commits of the branch that no other branch, tag or remote ref holds.
    pub unique_commits: u64,
    /// The branch's tip is contained in the base.
    pub merged: bool,
    /// `git worktree lock` holds it (with the reason given, maybe empty).
    pub locked: Option<String>,
    /// The directory is there but is not this worktree on its branch any
    /// more (another branch checked out in it, or another repository's).
    pub not_ours: bool,
}

/// What the caller of a delete asked for its worktree.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RemovalRequest {
    /// Remove it even if it holds uncommitted changes or unique commits.
    pub discard: bool,
    /// Leave the worktree and branch where they are.
    pub keep: bool,
    /// Delete the branch too, even when it is not merged into the base.
    pub delete_branch: bool,
}

/// What to do with a worktree when its session is deleted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Removal {
    /// Leave it (asked to keep it).
    Keep,
    /// Remove the directory (if present) and, with `delete_branch`, the branch.
    Remove {
        /// The branch goes too: merged into the base, or asked.
        delete_branch: bool,
    },
    /// Refuse: removing it would lose work. The text names what.
    Refuse(String),
}

/// Never loses work by default: a worktree goes only when it has no
/// uncommitted changes and no commit that lives only on its branch, unless
/// the caller says `discard`; its branch goes only when merged into the
/// base or asked for.
pub fn removal(branch: &str, found: &WorktreeContents, asked: RemovalRequest) -> Removal {
    if asked.keep {
        return Removal::Keep;
    }
    // Someone locked it on purpose: not even a discard overrides that.
    if let Some(reason) = &found.locked {
        return Removal::Refuse(format!(
            "the worktree is locked (git worktree lock{}); unlock it (git worktree unlock \
             <path>) and delete again, or delete with keep_worktree (keeps the worktree and branch)",
            if reason.is_empty() {
                String::new()
            } else {
                format!(": {reason}")
            }
        ));
    }
    // Removing it would take what is not this session's: not even a
    // discard does (agentctl's removal refuses too, but only after the
    // agent was stopped).
    if found.not_ours {
        return Removal::Refuse(format!(
            "the worktree is not on branch {branch} any more (another branch is checked out in \
             it, or it is not this repository's worktree); switch it back (git switch {branch}) \
             and delete again, or delete with keep_worktree (keeps the directory and branch)"
        ));
    }
    if !asked.discard {
        let mut lost = Vec::new();
        if !found.dirty_files.is_empty() {
            let shown: Vec<&str> = found
                .dirty_files
                .iter()
                .take(10)
                .map(String::as_str)
                .collect();
            let more = found.dirty_files.len() - shown.len();
            lost.push(format!(
                "{} file(s) with uncommitted changes ({}{})",
                found.dirty_files.len(),
                shown.join(", "),
                if more > 0 {
                    format!(", and {more} more")
                } else {
                    String::new()
                }
            ));
        }
        if found.unique_commits > 0 {
            lost.push(format!(
                "{} commit(s) found only on branch {branch}",
                found.unique_commits
            ));
        }
        if !lost.is_empty() {
            // Commits are kept by a ref (merge, push, tag); uncommitted
            // changes by a commit or a stash.
            let keep = if found.dirty_files.is_empty() {
                format!(
                    "merge them, push them, or put a branch or tag on them (git branch \
                     keep-work {branch})"
                )
            } else {
                "commit or stash them".to_owned()
            };
            return Removal::Refuse(format!(
                "deleting would lose {}; {keep}, or delete with discard (loses them) or \
                 keep_worktree (keeps the worktree and branch)",
                lost.join(" and ")
            ));
        }
    }
    Removal::Remove {
        delete_branch: found.branch_exists && (asked.delete_branch || found.merged),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slugs_are_branch_safe() {
        assert_eq!(slug("Fix the login bug!"), "fix-the-login-bug");
        assert_eq!(slug("  ..//"), "session");
        assert_eq!(slug("Ünïcode ok"), "n-code-ok");
        assert!(slug(&"x".repeat(100)).len() <= MAX_SLUG);
        assert!(!slug("a b c d e f g h i j k l m n o p q r s t u v w").ends_with('-'));
    }

    #[test]
    fn branch_names_carry_prefix_id_and_slug() {
        let id = SessionId::new();
        let b = branch_name("sessiond/", id, "Add tests");
        assert!(b.starts_with("sessiond/"), "{b}");
        assert!(b.ends_with("-add-tests"), "{b}");
        assert_eq!(b.len(), "sessiond/".len() + 8 + "-add-tests".len());
        assert_eq!(branch_name("", id, "x"), format!("{}-x", short_id(id)));
        assert_ne!(short_id(id), short_id(SessionId::new()));
    }

    fn clean() -> WorktreeContents {
        WorktreeContents {
            path_exists: true,
            branch_exists: true,
            merged: true,
            ..WorktreeContents::default()
        }
    }

    #[test]
    fn a_clean_merged_worktree_goes_with_its_branch() {
        assert_eq!(
            removal("b", &clean(), RemovalRequest::default()),
            Removal::Remove {
                delete_branch: true
            }
        );
    }

    #[test]
    fn a_worktree_on_another_branch_refuses_even_a_discard() {
        let elsewhere = WorktreeContents {
            not_ours: true,
            ..clean()
        };
        for discard in [false, true] {
            let asked = RemovalRequest {
                discard,
                ..RemovalRequest::default()
            };
            match removal("b", &elsewhere, asked) {
                Removal::Refuse(why) => assert!(why.contains("not on branch b"), "{why}"),
                other => panic!("{other:?}"),
            }
        }
        let keep = RemovalRequest {
            keep: true,
            ..RemovalRequest::default()
        };
        assert_eq!(removal("b", &elsewhere, keep), Removal::Keep);
    }

    #[test]
    fn uncommitted_changes_refuse_unless_discarded_or_kept() {
        let dirty = WorktreeContents {
            dirty_files: vec!["a.txt".into(), "b.txt".into()],
            ..clean()
        };
        match removal("b", &dirty, RemovalRequest::default()) {
            Removal::Refuse(m) => assert!(m.contains("2 file(s)") && m.contains("a.txt"), "{m}"),
            other => panic!("{other:?}"),
        }
        let discard = RemovalRequest {
            discard: true,
            ..RemovalRequest::default()
        };
        assert!(matches!(
            removal("b", &dirty, discard),
            Removal::Remove { .. }
        ));
        let keep = RemovalRequest {
            keep: true,
            ..RemovalRequest::default()
        };
        assert_eq!(removal("b", &dirty, keep), Removal::Keep);
    }

    #[test]
    fn a_locked_worktree_is_refused_even_with_discard_and_kept_on_request() {
        let locked = WorktreeContents {
            locked: Some("user lock".into()),
            ..clean()
        };
        for asked in [
            RemovalRequest::default(),
            RemovalRequest {
                discard: true,
                delete_branch: true,
                ..RemovalRequest::default()
            },
        ] {
            match removal("b", &locked, asked) {
                Removal::Refuse(m) => {
                    assert!(m.contains("locked") && m.contains("user lock"), "{m}")
                }
                other => panic!("{other:?}"),
            }
        }
        let keep = RemovalRequest {
            keep: true,
            ..RemovalRequest::default()
        };
        assert_eq!(removal("b", &locked, keep), Removal::Keep);
    }

    #[test]
    fn unique_commits_refuse_and_discard_keeps_an_unmerged_branch() {
        let ahead = WorktreeContents {
            unique_commits: 3,
            merged: false,
            ..clean()
        };
        match removal("s/1", &ahead, RemovalRequest::default()) {
            // Commits alone: kept by a ref, not by a stash (helper-52 16).
            Removal::Refuse(m) => assert!(
                m.contains("3 commit(s)")
                    && m.contains("git branch keep-work s/1")
                    && !m.contains("stash"),
                "{m}"
            ),
            other => panic!("{other:?}"),
        }
        let discard = RemovalRequest {
            discard: true,
            ..RemovalRequest::default()
        };
        // The directory goes; the unmerged branch stays unless asked.
        assert_eq!(
            removal("s/1", &ahead, discard),
            Removal::Remove {
                delete_branch: false
            }
        );
        let both = RemovalRequest {
            discard: true,
            delete_branch: true,
            ..RemovalRequest::default()
        };
        assert_eq!(
            removal("s/1", &ahead, both),
            Removal::Remove {
                delete_branch: true
            }
        );
    }
}
