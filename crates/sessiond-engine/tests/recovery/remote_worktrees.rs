//! Worktrees sessiond creates for remote sessions, with real git, real
//! agentctls standing for remote hosts (started with `--worktree-root`
//! and no workspace, as an operator would) and the demo agent: each host's
//! agentctl makes the session's worktree through its `Worktree` call and
//! serves it; recreated from its branch after everything was killed,
//! never removed with work in it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sessiond_domain::{
    OutcomeLabel, Runtime, Session, SessionState, Worktree, worktree::RemovalRequest,
};
use sessiond_engine::{ManagerConfig, NewSession, SessionManager, WorktreeSettings};
use sessiond_executor::process;

use crate::remote::{RemoteHost, RemoteSpot};
use crate::support::{Db, World, bin, expected_reply};

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

/// The "remote host's" directory: its repository (one commit on `main`
/// holding `notes.txt`) and where its worktrees go.
fn host_dir(w: &World) -> (PathBuf, PathBuf) {
    let host = w.path("host");
    let repo = host.join("repo");
    std::fs::create_dir_all(&repo).unwrap();
    std::fs::create_dir_all(host.join("worktrees")).unwrap();
    git(&repo, &["init", "-q", "-b", "main"]);
    std::fs::write(repo.join("notes.txt"), "original\n").unwrap();
    git(&repo, &["add", "notes.txt"]);
    git(&repo, &["commit", "-q", "-m", "init"]);
    (host, repo)
}

/// The host's agentctl for `spot`, as its operator starts it: no
/// workspace, worktrees allowed under `root`.
async fn start_host(w: &World, spot: &RemoteSpot, root: &Path) -> RemoteHost {
    let port_file = w.path(&format!("remote-{}.port", spot.port));
    let _ = std::fs::remove_file(&port_file);
    let child = Command::new(bin("agentctl"))
        .args(["--executor-id", &spot.id.to_string()])
        .args(["--listen", &format!("127.0.0.1:{}", spot.port)])
        .arg("--worktree-root")
        .arg(root)
        .arg("--port-file")
        .arg(&port_file)
        .args(["--idle-timeout", "300s"])
        .env("AGENTCTL_SECRET", &spot.secret)
        .env("AGENTCTL_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    w.procs
        .add(child.id(), process::start_time(child.id()).unwrap());
    let deadline = Instant::now() + Duration::from_secs(10);
    while !port_file.exists() {
        assert!(Instant::now() < deadline, "agentctl wrote no port file");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    RemoteHost { child }
}

fn manager(w: &World, host: &Path) -> SessionManager {
    w.manager_with(ManagerConfig {
        worktrees: WorktreeSettings {
            dirs: vec![(Runtime::Remote, host.join("worktrees"))],
            branch_prefix: "sessiond".into(),
            roots: Vec::new(),
        },
        ..w.config()
    })
}

async fn create(
    w: &World,
    mgr: &SessionManager,
    spot: &RemoteSpot,
    repo: &Path,
) -> Result<Session, sessiond_engine::Error> {
    let s = mgr
        .create_session(NewSession {
            task_id: w.task.id,
            agent_profile_id: w.profile.id,
            runtime: Runtime::Remote,
            worktree: Worktree {
                repository: repo.display().to_string(),
                base: "main".into(),
                ..Worktree::default()
            },
            remote: Some(spot.agentctl()),
            metadata: BTreeMap::new(),
            mcp_servers: Vec::new(),
        })
        .await?;
    assert_eq!(
        s.state,
        SessionState::WaitingForInput,
        "{:?}",
        s.error_message
    );
    Ok(s)
}

fn branch_exists(repo: &Path, branch: &str) -> bool {
    !git(repo, &["branch", "--list", branch]).is_empty()
}

/// Two remote sessions of one task on one repository of their host: each
/// host agentctl makes and serves its own worktree on its own branch; the
/// same file edited by both agents differs. An agentctl serves one
/// worktree, and only inside its roots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_sessions_of_one_task_edit_the_same_file_apart() {
    let w = World::new(Db::Sqlite).await;
    let (root, repo) = host_dir(&w);
    let (sa, sb) = (RemoteSpot::at(""), RemoteSpot::at(""));
    let (ha, hb) = (
        start_host(&w, &sa, &root).await,
        start_host(&w, &sb, &root).await,
    );
    let mgr = manager(&w, &root);
    let a = create(&w, &mgr, &sa, &repo).await.unwrap();
    let b = create(&w, &mgr, &sb, &repo).await.unwrap();
    ha.track_agent(&w);
    hb.track_agent(&w);
    assert_ne!(a.worktree.branch, b.worktree.branch);
    for s in [&a, &b] {
        assert!(
            s.worktree
                .path
                .starts_with(&root.join("worktrees").display().to_string())
        );
        assert_eq!(
            git(
                Path::new(&s.worktree.path),
                &["symbolic-ref", "--short", "HEAD"]
            ),
            s.worktree.branch
        );
    }
    w.prompt(&mgr, a.id, "/edit notes.txt from a").await;
    w.prompt(&mgr, b.id, "/edit notes.txt from b").await;
    let read = |s: &Session| {
        std::fs::read_to_string(Path::new(&s.worktree.path).join("notes.txt")).unwrap()
    };
    assert_eq!(read(&a), "from a");
    assert_eq!(read(&b), "from b");
    assert_eq!(
        std::fs::read_to_string(repo.join("notes.txt")).unwrap(),
        "original\n"
    );

    // A third session on a's agentctl: it already serves a's worktree.
    let err = create(&w, &mgr, &sa, &repo).await.unwrap_err();
    assert_eq!(err.kind(), sessiond_engine::ErrorKind::FailedPrecondition);
    assert!(err.to_string().contains("serves the worktree"), "{err}");
    // A repository outside the host agentctl's roots.
    let sc = RemoteSpot::at("");
    let hc = start_host(&w, &sc, &root.join("worktrees")).await;
    let err = create(&w, &mgr, &sc, &repo).await.unwrap_err();
    assert_eq!(err.kind(), sessiond_engine::ErrorKind::InvalidArgument);
    assert!(
        err.to_string()
            .contains("outside this agentctl's worktree roots"),
        "{err}"
    );

    for s in [&a, &b] {
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
        assert!(!Path::new(&s.worktree.path).exists());
    }
    for h in [ha, hb, hc] {
        h.kill().await;
    }
    w.finish(&mgr, &[]).await;
}

/// A create that names a host's agentctl with another executor id than
/// the one it serves is refused before anything reaches the host: nothing
/// stored, no worktree or branch made there; the create with the right id
/// then works (the wrong one used to make a worktree through that
/// agentctl first, which then refused to serve any other).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_create_naming_another_executor_is_refused_before_anything_is_made() {
    let w = World::new(Db::Sqlite).await;
    let (root, repo) = host_dir(&w);
    let spot = RemoteSpot::at("");
    let host = start_host(&w, &spot, &root).await;
    let mgr = manager(&w, &root);
    let wrong = RemoteSpot {
        id: sessiond_domain::ExecutorId::new(),
        secret: spot.secret.clone(),
        port: spot.port,
        workspace: spot.workspace.clone(),
    };
    let branches_before = git(&repo, &["branch", "--list"]);
    let err = create(&w, &mgr, &wrong, &repo).await.unwrap_err();
    assert_eq!(
        err.kind(),
        sessiond_engine::ErrorKind::InvalidArgument,
        "{err}"
    );
    assert!(
        err.to_string()
            .contains(&format!("serves executor {}", spot.id)),
        "{err}"
    );
    assert!(w.store.list_sessions(w.task.id).await.unwrap().is_empty());
    assert_eq!(
        git(&repo, &["branch", "--list"]),
        branches_before,
        "no branch made"
    );
    let s = create(&w, &mgr, &spot, &repo).await.unwrap();
    host.track_agent(&w);
    mgr.cancel_session(w.task.id, s.id).await.unwrap();
    host.kill().await;
    w.finish(&mgr, &[s.id]).await;
}

/// A session in a directory of its host (no `--repo`) on a host whose
/// agentctl serves no workspace (`--worktree-root` only) is refused before
/// anything is stored: its agent could not start there, and an ERROR
/// session would keep the executor id taken. A worktree session on the
/// same host then works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_directory_session_on_a_host_without_a_workspace_is_refused_before_it_is_stored() {
    let w = World::new(Db::Sqlite).await;
    let (root, repo) = host_dir(&w);
    let spot = RemoteSpot::at("");
    let host = start_host(&w, &spot, &root).await;
    let mgr = manager(&w, &root);
    let err = mgr
        .create_session(NewSession {
            task_id: w.task.id,
            agent_profile_id: w.profile.id,
            runtime: Runtime::Remote,
            worktree: Worktree {
                path: root.join("worktrees").display().to_string(),
                ..Worktree::default()
            },
            remote: Some(spot.agentctl()),
            metadata: BTreeMap::new(),
            mcp_servers: Vec::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(
        err.kind(),
        sessiond_engine::ErrorKind::InvalidArgument,
        "{err}"
    );
    let message = err.to_string();
    assert!(
        message.contains("serves no workspace") && message.contains("--repo"),
        "{message}"
    );
    assert!(w.store.list_sessions(w.task.id).await.unwrap().is_empty());
    let s = create(&w, &mgr, &spot, &repo).await.unwrap();
    host.track_agent(&w);
    mgr.cancel_session(w.task.id, s.id).await.unwrap();
    host.kill().await;
    w.finish(&mgr, &[s.id]).await;
}

/// Everything killed with SIGKILL (backend, the host's agentctl and its
/// agent), the worktree directory removed, the host's agentctl started
/// again by its operator with no workspace: recovery has it check the
/// worktree out again from its branch and serve it, and the agent resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_removed_worktree_is_recreated_from_its_branch_after_kill9() {
    let w = World::new(Db::Sqlite).await;
    let (root, repo) = host_dir(&w);
    let spot = RemoteSpot::at("");
    let host = start_host(&w, &spot, &root).await;
    let mgr = manager(&w, &root);
    let s = create(&w, &mgr, &spot, &repo).await.unwrap();
    host.track_agent(&w);
    let token = s.resume_token.clone().unwrap();
    let path = PathBuf::from(&s.worktree.path);
    w.prompt(&mgr, s.id, "/edit notes.txt committed work").await;
    git(&path, &["commit", "-q", "-am", "work"]);
    let head = git(&path, &["rev-parse", "HEAD"]);

    mgr.shutdown();
    drop(mgr);
    host.kill().await;
    std::fs::remove_dir_all(&path).unwrap();
    let host = start_host(&w, &spot, &root).await;

    let mgr = manager(&w, &root);
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::Resumed), 1, "{summary:?}");
    host.track_agent(&w);
    assert!(path.is_dir(), "recreated");
    assert_eq!(git(&path, &["rev-parse", "HEAD"]), head);
    assert_eq!(
        std::fs::read_to_string(path.join("notes.txt")).unwrap(),
        "committed work"
    );
    let reply = w.prompt(&mgr, s.id, "still there?").await;
    assert_eq!(reply, expected_reply(2, &token, "still there?"));
    // The agent works in the recreated directory.
    w.prompt(&mgr, s.id, "/edit notes.txt after").await;
    assert_eq!(
        std::fs::read_to_string(path.join("notes.txt")).unwrap(),
        "after"
    );
    mgr.cancel_session(w.task.id, s.id).await.unwrap();
    host.kill().await;
    w.finish(&mgr, &[s.id]).await;
}

/// Directory and branch both gone on the host: the session goes ERROR
/// naming the branch, and nothing is made up from the base.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_worktree_whose_branch_is_gone_is_an_error_naming_it() {
    let w = World::new(Db::Sqlite).await;
    let (root, repo) = host_dir(&w);
    let spot = RemoteSpot::at("");
    let host = start_host(&w, &spot, &root).await;
    let mgr = manager(&w, &root);
    let s = create(&w, &mgr, &spot, &repo).await.unwrap();
    host.track_agent(&w);
    mgr.shutdown();
    drop(mgr);
    host.kill().await;
    crate::worktrees::remove_worktree_and_branch(&repo, &s);
    let host = start_host(&w, &spot, &root).await;

    let mgr = manager(&w, &root);
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::ExecutorError), 1, "{summary:?}");
    crate::worktrees::assert_branch_missing(&w, &mgr, &s, &repo).await;
    // An explicit resume reaches the host's agentctl, which cannot bring
    // the worktree back: the same verdict, naming the branch, not a launch
    // failure.
    let err = mgr.resume_session(w.task.id, s.id).await.unwrap_err();
    assert!(err.to_string().contains(&s.worktree.branch), "{err}");
    crate::worktrees::assert_branch_missing(&w, &mgr, &s, &repo).await;
    host.kill().await;
    w.finish(&mgr, &[]).await;
}

/// Delete never loses work on a remote host: uncommitted files refuse it;
/// discard removes the worktree but keeps the unmerged branch; a clean,
/// merged worktree goes with its branch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_delete_keeps_work_and_removes_a_clean_worktree() {
    let w = World::new(Db::Sqlite).await;
    let (root, repo) = host_dir(&w);
    let spot = RemoteSpot::at("");
    let host = start_host(&w, &spot, &root).await;
    let mgr = manager(&w, &root);
    let s = create(&w, &mgr, &spot, &repo).await.unwrap();
    host.track_agent(&w);
    let path = PathBuf::from(&s.worktree.path);
    std::fs::write(path.join("draft.txt"), "unsaved").unwrap();

    let err = mgr.delete_session(w.task.id, s.id).await.unwrap_err();
    assert_eq!(err.kind(), sessiond_engine::ErrorKind::FailedPrecondition);
    assert!(
        err.to_string()
            .contains("1 file(s) with uncommitted changes (draft.txt)"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(path.join("draft.txt")).unwrap(),
        "unsaved"
    );
    assert_eq!(
        w.status(&mgr, s.id).await.state,
        SessionState::WaitingForInput,
        "refused before anything was stopped"
    );

    git(&path, &["add", "draft.txt"]);
    git(&path, &["commit", "-q", "-m", "draft"]);
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
    assert!(branch_exists(&repo, &s.worktree.branch), "unmerged: kept");
    host.kill().await;

    // A clean one on a fresh host agentctl goes with its merged branch.
    let spot = RemoteSpot::at("");
    let host = start_host(&w, &spot, &root).await;
    let clean = create(&w, &mgr, &spot, &repo).await.unwrap();
    host.track_agent(&w);
    mgr.delete_session(w.task.id, clean.id).await.unwrap();
    assert!(!Path::new(&clean.worktree.path).exists());
    assert!(
        !branch_exists(&repo, &clean.worktree.branch),
        "merged: removed"
    );
    let listed = git(&repo, &["worktree", "list", "--porcelain"]);
    assert!(!listed.contains(&clean.worktree.path), "{listed}");
    host.kill().await;

    // An unmerged branch goes only when asked.
    let spot = RemoteSpot::at("");
    let host = start_host(&w, &spot, &root).await;
    let asked = create(&w, &mgr, &spot, &repo).await.unwrap();
    host.track_agent(&w);
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
    host.kill().await;
    w.finish(&mgr, &[]).await;
}
