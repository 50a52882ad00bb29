//! Worktrees sessiond creates for Docker sessions, with real git on the
//! host, the private dockerd and the demo agent in its container: isolated
//! per session with git working inside the container, recreated from
//! their branch after everything was killed, never removed with work in
//! them. `#[ignore]`d: `cargo xtask ci` / `docker-tests` run them.

use std::collections::BTreeMap;
use std::os::unix::{fs::PermissionsExt, process::CommandExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use sessiond_domain::{
    AgentProfile, OutcomeLabel, Runtime, Session, SessionState, Worktree, worktree::RemovalRequest,
};
use sessiond_engine::{ManagerConfig, NewSession, SessionManager, WorktreeSettings};
use sessiond_executor::{Executor, ExecutorHandle, docker::CONTAINER_HOME};

use crate::docker_support::{
    DockerKit, docker_cli, docker_config, docker_driver_from, drivers_with,
};
use crate::support::{Db, World, expected_reply};

/// The user the containers run as; the repository and worktrees are its.
const AGENT: u32 = 1000;

/// git as the agent's user (the tests run as root; the repository is the
/// agent's, and root's git would leave files it cannot write).
fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["-c", "user.name=t", "-c", "user.email=t@example.com"])
        .args(args)
        .env_remove("HOME")
        .uid(AGENT)
        .gid(AGENT)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn chown_all(path: &Path) {
    let status = Command::new("chown")
        .args(["-R", &format!("{AGENT}:{AGENT}")])
        .arg(path)
        .status()
        .unwrap();
    assert!(status.success());
}

/// A repository of the agent's user with one commit on `main` holding
/// `notes.txt`, and the worktrees directory; the world's directory is
/// opened for it to pass through.
fn repository(w: &World) -> PathBuf {
    std::fs::set_permissions(w.dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let repo = w.path("repo");
    std::fs::create_dir_all(&repo).unwrap();
    std::fs::create_dir_all(w.path("worktrees")).unwrap();
    chown_all(&repo);
    chown_all(&w.path("worktrees"));
    git(&repo, &["init", "-q", "-b", "main"]);
    std::fs::write(repo.join("notes.txt"), "original\n").unwrap();
    chown_all(&repo);
    git(&repo, &["add", "notes.txt"]);
    git(&repo, &["commit", "-q", "-m", "init"]);
    repo
}

/// The Docker driver runs as root here, so its containers (and the git
/// that makes their worktrees) run as the configured user.
async fn kit(w: &World) -> (DockerKit, Arc<dyn Executor>, AgentProfile) {
    let kit = DockerKit::new(w).await;
    let mut config = docker_config(&kit.env, w.dir.path(), &[]);
    config.user = Some(format!("{AGENT}:{AGENT}"));
    config.host_agentctl = Some(crate::common::bin("agentctl"));
    let driver: Arc<dyn Executor> = docker_driver_from(&kit.env, config).await;
    // The agent's state in its HOME (the run directory): the worktree holds
    // only what the agent writes there on purpose.
    let args = [
        "--state-dir".to_owned(),
        format!("{CONTAINER_HOME}/.agent-state"),
    ];
    let profile = w
        .upsert_profile(
            "demo-in-docker-home",
            "/usr/local/bin/acp-demo-agent",
            &args,
            &[],
            true,
        )
        .await;
    (kit, driver, profile)
}

fn manager(w: &World, kit: &DockerKit, driver: &Arc<dyn Executor>) -> SessionManager {
    let mut drivers = drivers_with(w.dir.path(), &kit.driver);
    drivers.retain(|d| d.runtime() != Runtime::LocalDocker);
    drivers.push(driver.clone());
    SessionManager::new(
        w.store.clone(),
        drivers,
        ManagerConfig {
            worktrees: WorktreeSettings {
                dirs: vec![(Runtime::LocalDocker, w.path("worktrees"))],
                branch_prefix: "sessiond".into(),
                roots: Vec::new(),
            },
            ..w.config()
        },
    )
}

fn from_repo(repo: &Path) -> Worktree {
    Worktree {
        repository: repo.display().to_string(),
        base: "main".into(),
        ..Worktree::default()
    }
}

async fn create(w: &World, mgr: &SessionManager, profile: &AgentProfile, repo: &Path) -> Session {
    let s = mgr
        .create_session(NewSession {
            task_id: w.task.id,
            agent_profile_id: profile.id,
            runtime: Runtime::LocalDocker,
            worktree: from_repo(repo),
            remote: None,
            metadata: BTreeMap::new(),
            mcp_servers: Vec::new(),
        })
        .await
        .unwrap();
    assert_eq!(
        s.state,
        SessionState::WaitingForInput,
        "{:?}",
        s.error_message
    );
    s
}

/// `git status` by the agentctl in the session's container.
async fn branch_seen_in_container(w: &World, driver: &Arc<dyn Executor>, s: &Session) -> String {
    let handle = ExecutorHandle::from_record(&w.record(s.id).await);
    driver
        .client(&handle)
        .unwrap()
        .git_status()
        .await
        .unwrap_or_else(|e| panic!("git in the container of {}: {e}", s.id))
        .branch
}

fn branch_exists(repo: &Path, branch: &str) -> bool {
    !git(repo, &["branch", "--list", branch]).is_empty()
}

/// Two Docker sessions of one task on one repository: each container works
/// in its own worktree, on its own branch, with git working inside it; the
/// same file edited by both agents differs, the repository's is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn docker_sessions_of_one_task_edit_the_same_file_apart() {
    let w = World::new(Db::Sqlite).await;
    let repo = repository(&w);
    let (kit, driver, profile) = kit(&w).await;
    let mgr = manager(&w, &kit, &driver);
    let a = create(&w, &mgr, &profile, &repo).await;
    let b = create(&w, &mgr, &profile, &repo).await;
    assert_ne!(a.worktree.branch, b.worktree.branch);
    for s in [&a, &b] {
        assert!(
            s.worktree
                .path
                .starts_with(&w.path("worktrees").display().to_string()),
            "{}",
            s.worktree.path
        );
        assert_eq!(
            branch_seen_in_container(&w, &driver, s).await,
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
    // A commit made inside the container lands on the session's branch.
    let ha = ExecutorHandle::from_record(&w.record(a.id).await);
    let out = driver
        .client(&ha)
        .unwrap()
        .exec(sessiond_proto::agentctl::v1::ExecRequest {
            command: "git".into(),
            args: [
                "-c",
                "user.name=a",
                "-c",
                "user.email=a@example.com",
                "commit",
                "-qam",
                "from a",
            ]
            .map(String::from)
            .to_vec(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(
        out.exit_code,
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        git(&repo, &["log", "-1", "--format=%s", &a.worktree.branch]),
        "from a"
    );
    assert_eq!(git(&repo, &["log", "-1", "--format=%s", "main"]), "init");
    mgr.delete_session_with(
        w.task.id,
        a.id,
        RemovalRequest {
            discard: true,
            ..RemovalRequest::default()
        },
    )
    .await
    .unwrap();
    mgr.delete_session_with(
        w.task.id,
        b.id,
        RemovalRequest {
            discard: true,
            ..RemovalRequest::default()
        },
    )
    .await
    .unwrap();
    assert!(kit.containers_of_session(a.id).await.is_empty());
    w.finish(&mgr, &[]).await;
}

/// The backend dropped, the container killed with SIGKILL (agentctl and
/// agent with it), then the worktree directory removed: recovery checks it
/// out again from the session's branch, committed work included, before it
/// starts the container, and the agent resumes its conversation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn docker_removed_worktree_is_recreated_from_its_branch_after_kill9() {
    let w = World::new(Db::Sqlite).await;
    let repo = repository(&w);
    let (kit, driver, profile) = kit(&w).await;
    let mgr = manager(&w, &kit, &driver);
    let s = create(&w, &mgr, &profile, &repo).await;
    let token = s.resume_token.clone().unwrap();
    let path = PathBuf::from(&s.worktree.path);
    w.prompt(&mgr, s.id, "/edit notes.txt committed work").await;
    git(&path, &["commit", "-q", "-am", "work"]);
    let head = git(&path, &["rev-parse", "HEAD"]);

    mgr.shutdown();
    drop(mgr);
    let container = kit.one_running(s.id).await;
    docker_cli(&kit.env, &["kill", "--signal", "KILL", &container.id]);
    std::fs::remove_dir_all(&path).unwrap();

    let mgr = manager(&w, &kit, &driver);
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::Resumed), 1, "{summary:?}");
    assert!(path.is_dir(), "recreated");
    assert_eq!(git(&path, &["rev-parse", "HEAD"]), head);
    assert_eq!(
        std::fs::read_to_string(path.join("notes.txt")).unwrap(),
        "committed work"
    );
    let again = kit.one_running(s.id).await;
    assert_eq!(again.id, container.id, "the same container, started again");
    assert_eq!(
        branch_seen_in_container(&w, &driver, &s).await,
        s.worktree.branch
    );
    let reply = w.prompt(&mgr, s.id, "still there?").await;
    assert_eq!(reply, expected_reply(2, &token, "still there?"));
    assert_eq!(
        std::fs::read_to_string(path.join("notes.txt")).unwrap(),
        "committed work",
        "the agent works in the recreated directory"
    );
    let err = mgr.delete_session(w.task.id, s.id).await.unwrap_err();
    assert!(
        err.to_string().contains("1 commit(s) found only on branch"),
        "{err}"
    );
    w.finish(&mgr, &[s.id]).await;
}

/// Directory and branch both gone while everything was down: recovery
/// puts the session in ERROR naming the branch without starting its
/// container, nothing is made up from the base, and an explicit resume
/// says the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn docker_worktree_whose_branch_is_gone_is_an_error_naming_it() {
    let w = World::new(Db::Sqlite).await;
    let repo = repository(&w);
    let (kit, driver, profile) = kit(&w).await;
    let mgr = manager(&w, &kit, &driver);
    let s = create(&w, &mgr, &profile, &repo).await;
    mgr.shutdown();
    drop(mgr);
    let container = kit.one_running(s.id).await;
    docker_cli(&kit.env, &["kill", "--signal", "KILL", &container.id]);
    std::fs::remove_dir_all(&s.worktree.path).unwrap();
    git(&repo, &["worktree", "prune"]);
    git(&repo, &["branch", "-D", &s.worktree.branch]);

    let mgr = manager(&w, &kit, &driver);
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::ExecutorError), 1, "{summary:?}");
    let branch_missing = |st: &sessiond_domain::SessionStatus| {
        st.state == SessionState::Error
            && st.error_message.as_deref().is_some_and(|why| {
                why.starts_with("worktree_branch_missing: ") && why.contains(&s.worktree.branch)
            })
    };
    let st = w.status(&mgr, s.id).await;
    assert!(branch_missing(&st), "{st:?}");
    assert!(!Path::new(&s.worktree.path).exists(), "nothing made up");
    assert!(!branch_exists(&repo, &s.worktree.branch));
    assert!(
        kit.containers_of_session(s.id)
            .await
            .iter()
            .all(|c| c.state != "running"),
        "no container started on a worktree that is not there"
    );

    let err = mgr.resume_session(w.task.id, s.id).await.unwrap_err();
    assert!(err.to_string().contains(&s.worktree.branch), "{err}");
    let st = w.status(&mgr, s.id).await;
    assert!(branch_missing(&st), "{st:?}");
    assert!(!Path::new(&s.worktree.path).exists(), "nothing made up");
    assert!(!branch_exists(&repo, &s.worktree.branch));
    w.finish(&mgr, &[]).await;
}

/// Delete never loses work in a Docker session's worktree: uncommitted
/// files refuse it with the container left running; discard removes the
/// worktree and its container but keeps the unmerged branch; a clean,
/// merged worktree goes with its branch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn docker_delete_keeps_work_and_removes_a_clean_worktree() {
    let w = World::new(Db::Sqlite).await;
    let repo = repository(&w);
    let (kit, driver, profile) = kit(&w).await;
    let mgr = manager(&w, &kit, &driver);
    let s = create(&w, &mgr, &profile, &repo).await;
    let path = PathBuf::from(&s.worktree.path);
    w.prompt(&mgr, s.id, "/edit draft.txt unsaved").await;

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
    kit.one_running(s.id).await;

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
    assert!(kit.containers_of_session(s.id).await.is_empty());
    assert!(
        branch_exists(&repo, &s.worktree.branch),
        "the unmerged branch stays"
    );

    let clean = create(&w, &mgr, &profile, &repo).await;
    mgr.delete_session(w.task.id, clean.id).await.unwrap();
    assert!(!Path::new(&clean.worktree.path).exists());
    assert!(
        !branch_exists(&repo, &clean.worktree.branch),
        "merged: removed"
    );
    let listed = git(&repo, &["worktree", "list", "--porcelain"]);
    assert!(!listed.contains(&clean.worktree.path), "{listed}");

    // An unmerged branch goes only when asked.
    let asked = create(&w, &mgr, &profile, &repo).await;
    let path = PathBuf::from(&asked.worktree.path);
    w.prompt(&mgr, asked.id, "/edit notes.txt unmerged").await;
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
    assert!(kit.containers_of_session(asked.id).await.is_empty());
    assert!(
        !branch_exists(&repo, &asked.worktree.branch),
        "unmerged, removed as asked"
    );
    w.finish(&mgr, &[]).await;
}
