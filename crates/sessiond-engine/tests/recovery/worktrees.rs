//! Worktrees sessiond creates from a repository, with real git, real
//! agentctl and the demo agent: isolated per session, recreated from their
//! branch after a crash, never removed with work in them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use sessiond_domain::{
    OutcomeLabel, Runtime, Session, SessionState, Worktree, worktree::RemovalRequest,
};
use sessiond_engine::{ManagerConfig, NewSession, SessionManager, WorktreeSettings};

use crate::support::{Db, World, demo_agents_under, expected_reply, kill_tree, kill9};

fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["-c", "user.name=t", "-c", "user.email=t@example.com"])
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A repository with one commit on `main` holding `notes.txt`.
fn repository(w: &World) -> PathBuf {
    let repo = w.path("repo");
    std::fs::create_dir_all(&repo).unwrap();
    git(&repo, &["init", "-q", "-b", "main"]);
    std::fs::write(repo.join("notes.txt"), "original\n").unwrap();
    git(&repo, &["add", "notes.txt"]);
    git(&repo, &["commit", "-q", "-m", "init"]);
    repo
}

fn config(w: &World) -> ManagerConfig {
    ManagerConfig {
        worktrees: WorktreeSettings {
            dirs: vec![(Runtime::LocalStandalone, w.path("worktrees"))],
            branch_prefix: "sessiond".into(),
            // Where the test's repositories and worktrees live.
            roots: vec![w.dir.path().to_path_buf()],
        },
        ..w.config()
    }
}

fn from_repo(repo: &Path, base: &str) -> Worktree {
    Worktree {
        repository: repo.display().to_string(),
        base: base.into(),
        ..Worktree::default()
    }
}

async fn create(
    w: &World,
    mgr: &SessionManager,
    worktree: Worktree,
) -> Result<Session, sessiond_engine::Error> {
    let s = mgr
        .create_session(NewSession {
            task_id: w.task.id,
            agent_profile_id: w.profile.id,
            runtime: Runtime::LocalStandalone,
            worktree,
            remote: None,
            metadata: BTreeMap::new(),
            mcp_servers: Vec::new(),
        })
        .await?;
    w.track(s.id).await;
    Ok(s)
}

/// Removes a session's worktree directory and its branch, as a user
/// cleaning up by hand would.
pub(crate) fn remove_worktree_and_branch(repo: &Path, s: &Session) {
    std::fs::remove_dir_all(&s.worktree.path).unwrap();
    git(repo, &["worktree", "prune"]);
    git(repo, &["branch", "-D", &s.worktree.branch]);
}

/// The session is ERROR `worktree_branch_missing`, naming its branch, and
/// nothing was made up in its place (no directory, no branch).
pub(crate) async fn assert_branch_missing(
    w: &World,
    mgr: &SessionManager,
    s: &Session,
    repo: &Path,
) {
    let st = w.status(mgr, s.id).await;
    assert_eq!(st.state, SessionState::Error);
    let why = st.error_message.unwrap_or_default();
    assert!(
        why.starts_with("worktree_branch_missing: ") && why.contains(&s.worktree.branch),
        "{why}"
    );
    assert!(!Path::new(&s.worktree.path).exists(), "nothing made up");
    assert!(!branch_exists(repo, &s.worktree.branch));
}

fn branch_exists(repo: &Path, branch: &str) -> bool {
    Command::new("git")
        .arg("-C")
        .arg(repo)
        .args(["rev-parse", "--verify", "--quiet"])
        .arg(format!("refs/heads/{branch}"))
        .output()
        .unwrap()
        .status
        .success()
}

/// Two sessions of one task on one repository each get a worktree on a
/// branch of their own; the same file edited by both agents differs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_sessions_of_one_task_edit_the_same_file_apart() {
    let w = World::new(Db::Sqlite).await;
    let repo = repository(&w);
    let mgr = w.manager_with(config(&w));
    let a = create(&w, &mgr, from_repo(&repo, "main")).await.unwrap();
    let b = create(&w, &mgr, from_repo(&repo, "main")).await.unwrap();
    for s in [&a, &b] {
        assert_eq!(
            s.state,
            SessionState::WaitingForInput,
            "{:?}",
            s.error_message
        );
        assert!(
            s.worktree.branch.starts_with("sessiond/")
                && s.worktree.branch.ends_with("-recovery-test"),
            "{}",
            s.worktree.branch
        );
        assert!(
            s.worktree
                .path
                .starts_with(&w.path("worktrees").display().to_string())
        );
        assert_eq!(s.worktree.base, "main");
        let path = Path::new(&s.worktree.path);
        assert_eq!(
            git(path, &["symbolic-ref", "--short", "HEAD"]),
            s.worktree.branch
        );
        // Stored with the session and its executor.
        let stored = w.store.get_session(s.id).await.unwrap();
        assert_eq!(stored.worktree, s.worktree);
        assert_eq!(w.record(s.id).await.worktree, s.worktree);
    }
    assert_ne!(a.worktree.branch, b.worktree.branch);
    assert_ne!(a.worktree.path, b.worktree.path);

    w.prompt(&mgr, a.id, "/edit notes.txt from a").await;
    w.prompt(&mgr, b.id, "/edit notes.txt from b").await;
    let read = |s: &Session| {
        std::fs::read_to_string(Path::new(&s.worktree.path).join("notes.txt")).unwrap()
    };
    assert_eq!(read(&a), "from a");
    assert_eq!(read(&b), "from b");
    assert_eq!(
        std::fs::read_to_string(repo.join("notes.txt")).unwrap(),
        "original\n",
        "the repository's own working tree is untouched"
    );
    w.finish(&mgr, &[a.id, b.id]).await;
}

/// Everything killed with SIGKILL, then the worktree directory removed:
/// recovery checks it out again from the session's branch (committed work
/// included) before it relaunches the agent, and the conversation goes on.
async fn a_removed_worktree_is_recreated_from_its_branch_after_kill9(db: Db) {
    let w = World::new(db).await;
    let repo = repository(&w);
    let mgr = w.manager_with(config(&w));
    let s = create(&w, &mgr, from_repo(&repo, "main")).await.unwrap();
    let token = s.resume_token.clone().unwrap();
    let path = PathBuf::from(&s.worktree.path);
    w.prompt(&mgr, s.id, "/edit notes.txt committed work").await;
    git(&path, &["commit", "-q", "-am", "work"]);
    let head = git(&path, &["rev-parse", "HEAD"]);

    mgr.shutdown();
    drop(mgr);
    kill_tree(w.record(s.id).await.pid.unwrap()).await;
    std::fs::remove_dir_all(&path).unwrap();

    let mgr = w.manager_with(config(&w));
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::Resumed), 1, "{summary:?}");
    w.track(s.id).await;
    assert!(path.is_dir(), "recreated");
    assert_eq!(
        git(&path, &["symbolic-ref", "--short", "HEAD"]),
        s.worktree.branch
    );
    assert_eq!(git(&path, &["rev-parse", "HEAD"]), head);
    assert_eq!(
        std::fs::read_to_string(path.join("notes.txt")).unwrap(),
        "committed work"
    );
    let st = w.status(&mgr, s.id).await;
    assert_eq!(st.state, SessionState::WaitingForInput);
    let reply = w.prompt(&mgr, s.id, "still there?").await;
    assert_eq!(reply, expected_reply(2, &token, "still there?"));
    w.finish(&mgr, &[s.id]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_worktree_is_recreated_from_its_branch_after_kill9_sqlite() {
    a_removed_worktree_is_recreated_from_its_branch_after_kill9(Db::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_worktree_is_recreated_from_its_branch_after_kill9_postgres() {
    a_removed_worktree_is_recreated_from_its_branch_after_kill9(Db::Postgres).await;
}

/// The worktree removed while its agentctl runs, then the agent killed:
/// sessiond restarts the agent under the same agentctl and checks the
/// worktree out again from its branch; agentctl serves the new directory,
/// so the agent reads and writes files in it (ACP `fs/*`). agentctl used to
/// keep serving the removed directory, every file call failing, until it
/// was itself restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worktree_removed_under_a_live_agentctl_is_served_again_after_the_agents_restart() {
    let w = World::new(Db::Sqlite).await;
    let repo = repository(&w);
    let mgr = w.manager_with(config(&w));
    let s = create(&w, &mgr, from_repo(&repo, "main")).await.unwrap();
    let path = PathBuf::from(&s.worktree.path);
    w.prompt(&mgr, s.id, "/edit notes.txt committed").await;
    git(&path, &["commit", "-q", "-am", "work"]);
    let agentctl = w.record(s.id).await.pid.unwrap();
    let agents = demo_agents_under(agentctl);
    assert_eq!(agents.len(), 1, "one agent under agentctl {agentctl}");
    let seq_before = w.store.last_event_seq(s.id).await.unwrap();

    std::fs::remove_dir_all(&path).unwrap();
    kill9(agents[0]);
    w.wait_agent_back(&mgr, s.id, seq_before).await;
    assert_eq!(
        w.record(s.id).await.pid,
        Some(agentctl),
        "the same agentctl"
    );
    assert!(path.is_dir(), "checked out again");
    let read = w.prompt(&mgr, s.id, "/read notes.txt").await;
    assert!(read.ends_with("\nread: committed"), "{read}");
    let write = w.prompt(&mgr, s.id, "/write new.txt hello").await;
    assert!(write.ends_with("\nwrite: ok"), "{write}");
    assert_eq!(
        std::fs::read_to_string(path.join("new.txt")).unwrap(),
        "hello"
    );
    w.finish(&mgr, &[s.id]).await;
}

/// helper-38 7: after `kill -9` of everything, a plain directory put where
/// the worktree was (the worktree itself removed) was taken for it: the
/// agent ran there, and git calls failed. Recovery sees it is not the
/// worktree: the session goes ERROR saying what is in the way, nothing in
/// it is touched, and once it is moved away a resume checks the worktree
/// out again from its branch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_put_where_the_worktree_was_is_not_taken_for_it() {
    let w = World::new(Db::Sqlite).await;
    let repo = repository(&w);
    let mgr = w.manager_with(config(&w));
    let s = create(&w, &mgr, from_repo(&repo, "main")).await.unwrap();
    let path = PathBuf::from(&s.worktree.path);
    mgr.shutdown();
    drop(mgr);
    kill_tree(w.record(s.id).await.pid.unwrap()).await;
    std::fs::remove_dir_all(&path).unwrap();
    std::fs::create_dir_all(&path).unwrap();
    std::fs::write(path.join("precious.txt"), "mine").unwrap();

    let mgr = w.manager_with(config(&w));
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::ExecutorError), 1, "{summary:?}");
    let st = w.status(&mgr, s.id).await;
    assert_eq!(st.state, SessionState::Error);
    let why = st.error_message.unwrap_or_default();
    assert!(
        why.starts_with("worktree_in_the_way: ")
            && why.contains("is not the worktree of branch")
            && why.contains(&s.worktree.branch),
        "{why}"
    );
    assert!(!st.is_agent_running);
    assert_eq!(
        std::fs::read_to_string(path.join("precious.txt")).unwrap(),
        "mine"
    );

    let moved = PathBuf::from(format!("{}.moved", path.display()));
    std::fs::rename(&path, &moved).unwrap();
    mgr.resume_session(w.task.id, s.id).await.unwrap();
    w.track(s.id).await;
    assert_eq!(
        git(&path, &["symbolic-ref", "--short", "HEAD"]),
        s.worktree.branch
    );
    assert_eq!(
        std::fs::read_to_string(moved.join("precious.txt")).unwrap(),
        "mine"
    );
    let st = w.status(&mgr, s.id).await;
    assert_eq!(st.state, SessionState::WaitingForInput, "{st:?}");
    w.finish(&mgr, &[s.id]).await;
}

/// helper-52 3: a directory swapped for a symlink out of the roots after the
/// create was taken at the next launch of agentctl, so the agent and the
/// workspace calls ran outside `executors.worktree_roots`. Every launch
/// checks it: the session goes ERROR naming it, and nothing runs there;
/// once the directory is back, a resume brings the session back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_swapped_for_a_symlink_out_of_the_roots_is_not_launched_in() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager_with(config(&w));
    // A directory the session shares (a managed worktree swapped so is
    // `worktree_in_the_way` already).
    let s = create(&w, &mgr, w.worktree("shared")).await.unwrap();
    let path = PathBuf::from(&s.worktree.path);
    mgr.shutdown();
    drop(mgr);
    kill_tree(w.record(s.id).await.pid.unwrap()).await;
    let outside = tempfile::tempdir().unwrap();
    let moved = PathBuf::from(format!("{}.moved", path.display()));
    std::fs::rename(&path, &moved).unwrap();
    std::os::unix::fs::symlink(outside.path(), &path).unwrap();

    let mgr = w.manager_with(config(&w));
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.not_back + summary.failed, 1, "{summary:?}");
    let st = w.status(&mgr, s.id).await;
    assert!(!st.is_agent_running, "{st:?}");
    let why = st.error_message.clone().unwrap_or_default();
    assert!(why.contains("outside executors.worktree_roots"), "{st:?}");
    assert!(
        w.record(s.id)
            .await
            .pid
            .is_none_or(|pid| !crate::common::is_running(pid)),
        "an agentctl runs for it"
    );
    assert_eq!(std::fs::read_dir(outside.path()).unwrap().count(), 0);

    std::fs::remove_file(&path).unwrap();
    std::fs::rename(&moved, &path).unwrap();
    mgr.resume_session(w.task.id, s.id).await.unwrap();
    w.track(s.id).await;
    let st = w.status(&mgr, s.id).await;
    assert_eq!(st.state, SessionState::WaitingForInput, "{st:?}");
    w.finish(&mgr, &[s.id]).await;
}

/// Directory and branch both gone: the session goes ERROR naming the
/// branch; nothing is made up from the base in its place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worktree_whose_branch_is_gone_is_an_error_naming_it() {
    let w = World::new(Db::Sqlite).await;
    let repo = repository(&w);
    let mgr = w.manager_with(config(&w));
    let s = create(&w, &mgr, from_repo(&repo, "main")).await.unwrap();
    mgr.shutdown();
    drop(mgr);
    kill_tree(w.record(s.id).await.pid.unwrap()).await;
    remove_worktree_and_branch(&repo, &s);

    let mgr = w.manager_with(config(&w));
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::ExecutorError), 1, "{summary:?}");
    assert_branch_missing(&w, &mgr, &s, &repo).await;
    // An explicit resume says the same.
    let err = mgr.resume_session(w.task.id, s.id).await.unwrap_err();
    assert!(err.to_string().contains(&s.worktree.branch), "{err}");
    assert_branch_missing(&w, &mgr, &s, &repo).await;
    w.finish(&mgr, &[s.id]).await;
}

/// An ERROR session (its agent exited; restarts off) whose worktree and
/// branch are then removed: the explicit resume is refused naming the
/// branch, and the session's message says so from then on, as after a
/// restart, instead of still telling the user to resume it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_refused_for_a_gone_branch_leaves_that_reason_on_the_session() {
    let w = World::new(Db::Sqlite).await;
    let repo = repository(&w);
    let mgr = w.manager_with(ManagerConfig {
        agent_restarts: 0,
        ..config(&w)
    });
    w.listen_and_recover(&mgr).await;
    let s = create(&w, &mgr, from_repo(&repo, "main")).await.unwrap();
    let agentctl = w.record(s.id).await.pid.unwrap();
    let agents = demo_agents_under(agentctl);
    assert_eq!(agents.len(), 1, "one agent under agentctl {agentctl}");
    kill9(agents[0]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while w.status(&mgr, s.id).await.state != SessionState::Error {
        assert!(
            std::time::Instant::now() < deadline,
            "the agent's exit was never noticed: {:?}",
            w.status(&mgr, s.id).await
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let before = w.status(&mgr, s.id).await.error_message.unwrap_or_default();
    assert!(before.contains("resume the session"), "{before}");
    remove_worktree_and_branch(&repo, &s);

    let err = mgr.resume_session(w.task.id, s.id).await.unwrap_err();
    assert!(err.to_string().contains(&s.worktree.branch), "{err}");
    assert_branch_missing(&w, &mgr, &s, &repo).await;
    w.finish(&mgr, &[s.id]).await;
}

/// Delete never loses work: uncommitted files, then commits only the
/// branch holds, refuse it (naming them) and leave everything in place;
/// discard removes the worktree but keeps the unmerged branch; a clean,
/// merged worktree goes with its branch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_keeps_work_and_removes_a_clean_worktree() {
    let w = World::new(Db::Sqlite).await;
    let repo = repository(&w);
    let mgr = w.manager_with(config(&w));
    let s = create(&w, &mgr, from_repo(&repo, "main")).await.unwrap();
    let path = PathBuf::from(&s.worktree.path);
    std::fs::write(path.join("draft.txt"), "unsaved").unwrap();

    let err = mgr.delete_session(w.task.id, s.id).await.unwrap_err();
    assert_eq!(err.kind(), sessiond_engine::ErrorKind::FailedPrecondition);
    let m = err.to_string();
    assert!(
        m.contains("1 file(s) with uncommitted changes (draft.txt)"),
        "{m}"
    );
    assert!(m.contains("discard") && m.contains("keep_worktree"), "{m}");
    assert_eq!(
        std::fs::read_to_string(path.join("draft.txt")).unwrap(),
        "unsaved"
    );
    let still = w.status(&mgr, s.id).await;
    assert_eq!(
        still.state,
        SessionState::WaitingForInput,
        "refused before anything was stopped"
    );

    git(&path, &["add", "draft.txt"]);
    git(&path, &["commit", "-q", "-m", "draft"]);
    let m = mgr
        .delete_session(w.task.id, s.id)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        m.contains(&format!(
            "1 commit(s) found only on branch {}",
            s.worktree.branch
        )),
        "{m}"
    );
    assert!(path.is_dir());

    mgr.delete_session_with(
        w.task.id,
        s.id,
        RemovalRequest {
            discard: true,
            ..RemovalRequest::default()
        },
    )
    .await
    .unwrap();
    assert!(!path.exists(), "worktree removed");
    assert!(
        branch_exists(&repo, &s.worktree.branch),
        "the unmerged branch stays: it was not asked to go"
    );
    let listed = git(&repo, &["worktree", "list", "--porcelain"]);
    assert!(!listed.contains(&s.worktree.path), "{listed}");

    let clean = create(&w, &mgr, from_repo(&repo, "main")).await.unwrap();
    mgr.delete_session(w.task.id, clean.id).await.unwrap();
    assert!(!Path::new(&clean.worktree.path).exists());
    assert!(
        !branch_exists(&repo, &clean.worktree.branch),
        "merged: removed"
    );

    let kept = create(&w, &mgr, from_repo(&repo, "main")).await.unwrap();
    std::fs::write(Path::new(&kept.worktree.path).join("x"), "x").unwrap();
    mgr.delete_session_with(
        w.task.id,
        kept.id,
        RemovalRequest {
            keep: true,
            ..RemovalRequest::default()
        },
    )
    .await
    .unwrap();
    assert!(
        Path::new(&kept.worktree.path).join("x").is_file(),
        "kept as asked"
    );
    assert!(branch_exists(&repo, &kept.worktree.branch));

    // An unmerged branch goes only when asked.
    let asked = create(&w, &mgr, from_repo(&repo, "main")).await.unwrap();
    let path = PathBuf::from(&asked.worktree.path);
    std::fs::write(path.join("notes.txt"), "unmerged\n").unwrap();
    git(&path, &["commit", "-q", "-am", "unmerged"]);
    mgr.delete_session_with(
        w.task.id,
        asked.id,
        RemovalRequest {
            discard: true,
            delete_branch: true,
            ..RemovalRequest::default()
        },
    )
    .await
    .unwrap();
    assert!(!path.exists(), "worktree removed");
    assert!(
        !branch_exists(&repo, &asked.worktree.branch),
        "unmerged, removed as asked"
    );
    w.finish(&mgr, &[]).await;
}

/// Bad input is refused precisely and creates nothing: no session, no
/// directory, no branch.
/// Two deletes of one session at once, one keeping its worktree (with
/// uncommitted work) and one discarding it: they run one after the other,
/// so exactly one succeeds and what it said is what happened; the other
/// finds the session deleted. They used to both check before either
/// removed, so the keep was told it succeeded after the discard had
/// removed the work, and the discard was told NOT_FOUND.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_deletes_at_once_one_keeping_one_discarding_the_work_agree() {
    let w = World::new(Db::Sqlite).await;
    let repo = repository(&w);
    let mgr = w.manager_with(config(&w));
    for round in 0..3 {
        let s = create(&w, &mgr, from_repo(&repo, "main")).await.unwrap();
        let path = PathBuf::from(&s.worktree.path);
        std::fs::write(path.join("draft.txt"), format!("unsaved {round}")).unwrap();
        let keep = RemovalRequest {
            keep: true,
            ..RemovalRequest::default()
        };
        let discard = RemovalRequest {
            discard: true,
            ..RemovalRequest::default()
        };
        let (kept, discarded) = tokio::join!(
            mgr.delete_session_with(w.task.id, s.id, keep),
            mgr.delete_session_with(w.task.id, s.id, discard),
        );
        match (&kept, &discarded) {
            (Ok(()), Err(e)) => {
                assert_eq!(e.kind(), sessiond_engine::ErrorKind::NotFound, "{e}");
                assert_eq!(
                    std::fs::read_to_string(path.join("draft.txt")).unwrap(),
                    format!("unsaved {round}"),
                    "the keep succeeded, so the work is there"
                );
                git(
                    &repo,
                    &["worktree", "remove", "--force", &path.display().to_string()],
                );
            }
            (Err(e), Ok(())) => {
                assert_eq!(e.kind(), sessiond_engine::ErrorKind::NotFound, "{e}");
                assert!(
                    !path.exists(),
                    "the discard succeeded, so the worktree is gone"
                );
            }
            other => panic!("exactly one delete succeeds: {other:?}"),
        }
        let gone = mgr.session_status(w.task.id, s.id).await.unwrap_err();
        assert_eq!(gone.kind(), sessiond_engine::ErrorKind::NotFound, "{gone}");
    }
    w.finish(&mgr, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_creates_nothing() {
    use sessiond_engine::ErrorKind as K;
    let w = World::new(Db::Sqlite).await;
    let repo = repository(&w);
    let mgr = w.manager_with(config(&w));
    let plain = w.path("plain");
    std::fs::create_dir_all(&plain).unwrap();
    git(&repo, &["branch", "taken"]);
    // git cannot keep `feat` beside `feat/a` (helper-38 3).
    git(&repo, &["branch", "feat"]);
    git(&repo, &["branch", "nest/inner"]);

    let cases = [
        (
            from_repo(&plain, "main"),
            K::InvalidArgument,
            "is not a git repository",
        ),
        (
            from_repo(&repo, "nope"),
            K::InvalidArgument,
            "base: \"nope\" is not a branch",
        ),
        (from_repo(&repo, ""), K::InvalidArgument, "base: required"),
        (
            Worktree {
                branch: "taken".into(),
                ..from_repo(&repo, "main")
            },
            K::FailedPrecondition,
            "branch \"taken\" already exists",
        ),
        (
            Worktree {
                branch: "feat/a".into(),
                ..from_repo(&repo, "main")
            },
            K::FailedPrecondition,
            "branch \"feat\" exists",
        ),
        (
            Worktree {
                branch: "nest".into(),
                ..from_repo(&repo, "main")
            },
            K::FailedPrecondition,
            "branch \"nest/inner\" exists",
        ),
    ];
    for (worktree, kind, says) in cases {
        let err = create(&w, &mgr, worktree).await.unwrap_err();
        assert_eq!(err.kind(), kind, "{err}");
        assert!(err.to_string().contains(says), "{err}");
    }
    // A runtime without a worktrees dir cannot create one.
    let bare = w.manager();
    let err = create(&w, &bare, from_repo(&repo, "main"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("executors.worktrees_dir"), "{err}");

    assert!(w.store.list_sessions(w.task.id).await.unwrap().is_empty());
    assert!(
        !w.path("worktrees").exists()
            || std::fs::read_dir(w.path("worktrees"))
                .unwrap()
                .next()
                .is_none()
    );
    let branches = git(&repo, &["branch", "--format=%(refname:short)"]);
    assert_eq!(
        branches.lines().collect::<Vec<_>>(),
        ["feat", "main", "nest/inner", "taken"]
    );
    bare.shutdown();
    w.finish(&mgr, &[]).await;
}

/// Sessions of one task created at once from one repository: each gets its
/// own branch and directory, and git lists every one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_created_at_once_from_one_repository_each_get_their_own() {
    let w = World::new(Db::Sqlite).await;
    let repo = repository(&w);
    let mgr = w.manager_with(config(&w));
    let made = futures::future::join_all((0..4).map(|_| {
        mgr.create_session(NewSession {
            task_id: w.task.id,
            agent_profile_id: w.profile.id,
            runtime: Runtime::LocalStandalone,
            worktree: from_repo(&repo, "main"),
            remote: None,
            metadata: BTreeMap::new(),
            mcp_servers: Vec::new(),
        })
    }))
    .await;
    let mut ids = Vec::new();
    let mut branches = std::collections::BTreeSet::new();
    for s in made {
        let s = s.unwrap();
        w.track(s.id).await;
        assert_eq!(
            s.state,
            SessionState::WaitingForInput,
            "{:?}",
            s.error_message
        );
        assert_eq!(
            git(
                Path::new(&s.worktree.path),
                &["symbolic-ref", "--short", "HEAD"]
            ),
            s.worktree.branch
        );
        branches.insert(s.worktree.branch.clone());
        ids.push(s.id);
    }
    assert_eq!(branches.len(), 4);
    let listed = git(&repo, &["worktree", "list", "--porcelain"]);
    for b in &branches {
        assert!(
            listed.contains(&format!("branch refs/heads/{b}")),
            "{listed}"
        );
    }
    w.finish(&mgr, &ids).await;
}

/// Creates naming one branch at once (helper-38 1): one gets it, the others
/// are refused before anything is stored, so no ERROR session names the
/// winner's branch (whose delete could remove the winner's work).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_naming_one_branch_at_once_one_wins_the_rest_store_nothing() {
    let w = World::new(Db::Sqlite).await;
    let repo = repository(&w);
    let mgr = w.manager_with(config(&w));
    let made = futures::future::join_all((0..4).map(|_| {
        let named = Worktree {
            branch: "race/two".into(),
            ..from_repo(&repo, "main")
        };
        create(&w, &mgr, named)
    }))
    .await;
    let mut won = Vec::new();
    for m in made {
        match m {
            Ok(s) => {
                assert_eq!(s.state, SessionState::WaitingForInput, "{s:?}");
                won.push(s);
            }
            Err(e) => {
                assert_eq!(
                    e.kind(),
                    sessiond_engine::ErrorKind::FailedPrecondition,
                    "{e}"
                );
                assert!(e.to_string().contains("already exists"), "{e}");
            }
        }
    }
    assert_eq!(won.len(), 1, "one create gets the branch");
    let stored = w.store.list_sessions(w.task.id).await.unwrap();
    assert_eq!(
        stored.iter().map(|s| s.id).collect::<Vec<_>>(),
        vec![won[0].id]
    );
    w.finish(&mgr, &[won[0].id]).await;
}

/// helper-38 4 and 10: a base relative to where the repository is now
/// (`HEAD~1`) is kept as the commit it named, so "since the base" does not
/// move (inside the worktree `HEAD~1` is the worktree's own parent); a
/// repository named with a trailing `/`, as its `.git` directory or
/// through a symlink is kept by its one real name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relative_base_is_kept_as_its_commit_and_a_repository_by_one_name() {
    let w = World::new(Db::Sqlite).await;
    let repo = repository(&w);
    std::fs::write(repo.join("notes.txt"), "second\n").unwrap();
    git(&repo, &["commit", "-q", "-am", "second"]);
    let parent = git(&repo, &["rev-parse", "HEAD~1"]);
    let mgr = w.manager_with(config(&w));
    let s = create(
        &w,
        &mgr,
        from_repo(Path::new(&format!("{}/.git/", repo.display())), "HEAD~1"),
    )
    .await
    .unwrap();
    let real = std::fs::canonicalize(&repo).unwrap().display().to_string();
    assert_eq!(s.worktree.base, parent);
    assert_eq!(s.worktree.repository, real);
    let st = w.status(&mgr, s.id).await;
    assert_eq!(
        (st.worktree_base.as_str(), st.worktree_repository.as_str()),
        (parent.as_str(), real.as_str())
    );
    // A branch name stays a name.
    let named = create(&w, &mgr, from_repo(&repo, "main")).await.unwrap();
    assert_eq!(named.worktree.base, "main");
    // A symlink is followed at the create and kept by its target's name,
    // so retargeting it later leads no restore or delete elsewhere
    // (helper-62 1).
    let link = w.path("repo-link");
    std::os::unix::fs::symlink(&repo, &link).unwrap();
    let linked = create(&w, &mgr, from_repo(&link, "main")).await.unwrap();
    assert_eq!(linked.worktree.repository, real);
    w.finish(&mgr, &[s.id, named.id, linked.id]).await;
}

/// helper-38 11: a worktree locked with `git worktree lock` made a delete
/// stop the agent (the session CANCELLED) and only then fail with git's
/// own words; `discard` did not help. A lock is the user's: the delete is
/// refused up front, discard or not, naming the lock, and nothing is
/// stopped; keep_worktree deletes the session and leaves the worktree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_worktree_refuses_the_delete_before_anything_is_stopped() {
    let w = World::new(Db::Sqlite).await;
    let repo = repository(&w);
    let mgr = w.manager_with(config(&w));
    let s = create(&w, &mgr, from_repo(&repo, "main")).await.unwrap();
    git(
        &repo,
        &[
            "worktree",
            "lock",
            "--reason",
            "user lock",
            &s.worktree.path,
        ],
    );
    for discard in [false, true] {
        let asked = RemovalRequest {
            discard,
            ..RemovalRequest::default()
        };
        let err = mgr
            .delete_session_with(w.task.id, s.id, asked)
            .await
            .unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("locked") && text.contains("user lock"),
            "{text}"
        );
        let st = w.status(&mgr, s.id).await;
        assert_eq!(st.state, SessionState::WaitingForInput, "nothing stopped");
        assert!(st.is_agent_running);
    }
    let keep = RemovalRequest {
        keep: true,
        ..RemovalRequest::default()
    };
    mgr.delete_session_with(w.task.id, s.id, keep)
        .await
        .unwrap();
    assert!(Path::new(&s.worktree.path).is_dir(), "kept");
    w.finish(&mgr, &[]).await;
}

/// helper-52 2: a worktree with another branch checked out in it made a
/// delete stop the agent (the session CANCELLED, never to be resumed) and
/// only then fail, telling the user to switch it back. The delete is now
/// refused up front, discard or not, and nothing is stopped; once switched
/// back, it goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worktree_on_another_branch_refuses_the_delete_before_anything_is_stopped() {
    let w = World::new(Db::Sqlite).await;
    let repo = repository(&w);
    let mgr = w.manager_with(config(&w));
    let s = create(&w, &mgr, from_repo(&repo, "main")).await.unwrap();
    let wt = Path::new(&s.worktree.path);
    git(wt, &["checkout", "-q", "-b", "switched"]);
    for discard in [false, true] {
        let asked = RemovalRequest {
            discard,
            ..RemovalRequest::default()
        };
        let err = mgr
            .delete_session_with(w.task.id, s.id, asked)
            .await
            .unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains(&format!("not on branch {}", s.worktree.branch)),
            "{text}"
        );
        let st = w.status(&mgr, s.id).await;
        assert_eq!(st.state, SessionState::WaitingForInput, "nothing stopped");
        assert!(st.is_agent_running);
    }
    git(wt, &["checkout", "-q", &s.worktree.branch]);
    mgr.delete_session(w.task.id, s.id).await.unwrap();
    assert!(!wt.exists(), "removed once switched back");
    w.finish(&mgr, &[]).await;
}

/// helper-41 1: the worktrees directory checked at startup was later a
/// symlink out of the roots (or reached through one: the default dir's
/// parents), and worktrees were made outside them. Each create resolves the
/// directory it is about to make: outside the roots, nothing is created.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worktrees_dir_swapped_for_a_symlink_out_of_the_roots_creates_nothing() {
    let w = World::new(Db::Sqlite).await;
    let repo = repository(&w);
    let outside = tempfile::tempdir().unwrap();
    let mgr = w.manager_with(config(&w));
    let _ = std::fs::remove_dir_all(w.path("worktrees"));
    std::os::unix::fs::symlink(outside.path(), w.path("worktrees")).unwrap();
    let err = create(&w, &mgr, from_repo(&repo, "main"))
        .await
        .unwrap_err();
    assert_eq!(
        err.kind(),
        sessiond_engine::ErrorKind::InvalidArgument,
        "{err}"
    );
    assert!(
        err.to_string().contains("outside executors.worktree_roots"),
        "{err}"
    );
    assert!(w.store.list_sessions(w.task.id).await.unwrap().is_empty());
    assert_eq!(std::fs::read_dir(outside.path()).unwrap().count(), 0);
    assert_eq!(git(&repo, &["branch", "--format=%(refname:short)"]), "main");
    w.finish(&mgr, &[]).await;
}

/// helper-38 6 / helper-41 4: the worktree directory removed while the
/// agent runs: every workspace call failed, and an explicit resume answered
/// success and changed nothing (the agent "was running"). The resume now
/// stops the agent, which works in a directory that is gone, checks the
/// worktree out again from its branch and brings the agent back there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_brings_back_a_worktree_removed_under_a_running_agent() {
    let w = World::new(Db::Sqlite).await;
    let repo = repository(&w);
    let mgr = w.manager_with(config(&w));
    let s = create(&w, &mgr, from_repo(&repo, "main")).await.unwrap();
    let token = s.resume_token.clone().unwrap();
    let path = PathBuf::from(&s.worktree.path);
    w.prompt(&mgr, s.id, "/edit notes.txt committed").await;
    git(&path, &["commit", "-q", "-am", "work"]);
    std::fs::remove_dir_all(&path).unwrap();

    let st = mgr.resume_session(w.task.id, s.id).await.unwrap();
    assert!(path.is_dir(), "checked out again: {st:?}");
    assert_eq!(
        std::fs::read_to_string(path.join("notes.txt")).unwrap(),
        "committed"
    );
    let st = w.status(&mgr, s.id).await;
    assert_eq!(st.state, SessionState::WaitingForInput, "{st:?}");
    assert!(st.is_agent_running, "{st:?}");
    let write = w.prompt(&mgr, s.id, "/write new.txt hello").await;
    assert!(write.ends_with("\nwrite: ok"), "{write}");
    assert_eq!(
        std::fs::read_to_string(path.join("new.txt")).unwrap(),
        "hello"
    );
    let reply = w.prompt(&mgr, s.id, "still there?").await;
    assert!(reply.contains(&token), "{reply}");
    w.finish(&mgr, &[s.id]).await;
}
