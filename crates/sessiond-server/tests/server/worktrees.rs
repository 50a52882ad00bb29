//! Sessions created from a repository through the public API: the real
//! `sessiond`, agentctl, git and the demo agent.

use std::path::{Path, PathBuf};
use std::process::Command;

use sessiond_proto::sessiond::v1 as pb;

use crate::restart::wait_serving;
use crate::support::{
    Sessions, TOKEN, agentctl_pids, create_task, in_directory, prompt, run_sessiond, sessions,
    start, workspaces,
};

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

fn repository(dir: &Path) -> PathBuf {
    let repo = dir.join("repo");
    std::fs::create_dir_all(&repo).unwrap();
    git(&repo, &["init", "-q", "-b", "main"]);
    std::fs::write(repo.join("notes.txt"), "original\n").unwrap();
    git(&repo, &["add", "notes.txt"]);
    git(&repo, &["commit", "-q", "-m", "init"]);
    repo
}

fn reason(s: &tonic::Status) -> String {
    s.metadata()
        .get("sessiond-error")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default()
}

fn from_repo(task: &str, repo: &Path, base: &str) -> pb::CreateSessionRequest {
    pb::CreateSessionRequest {
        task_id: task.into(),
        runtime: pb::Runtime::LocalStandalone as i32,
        worktree: Some(pb::Worktree {
            repository: repo.display().to_string(),
            base: base.into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The session `req` creates (the call must succeed).
async fn created(c: &mut Sessions, req: pb::CreateSessionRequest) -> pb::Session {
    c.create_session(req)
        .await
        .unwrap()
        .into_inner()
        .session
        .unwrap()
}

/// Create from a repository, see it in the status, review it (diff against
/// the base, the branch's commits), and delete it: refused while it holds
/// work, then removed with its branch when told to discard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_from_a_repository_is_created_reviewed_and_deleted_without_losing_work() {
    let dir = tempfile::tempdir().unwrap();
    let repo = repository(dir.path());
    let data = dir.path().join("data");
    let server = start(&data, &[]);
    let mut c = sessions(&server).await;
    let mut ws = workspaces(&server).await;
    let task = create_task(&mut c, "Fix the login page").await;

    let s = created(&mut c, from_repo(&task.id, &repo, "main")).await;
    assert_eq!(
        s.state,
        pb::SessionState::WaitingForInput as i32,
        "{}",
        s.error_message
    );
    let w = s.worktree.clone().unwrap();
    assert!(
        w.branch.starts_with("sessiond/") && w.branch.ends_with("-fix-the-login-page"),
        "{}",
        w.branch
    );
    assert!(
        Path::new(&w.path).starts_with(data.join("worktrees")),
        "{}",
        w.path
    );
    assert_eq!(
        (w.repository.as_str(), w.base.as_str()),
        (repo.to_str().unwrap(), "main")
    );
    let st = c
        .get_session_status(pb::GetSessionStatusRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.worktree_branch, w.branch);
    assert_eq!(st.worktree_repository, w.repository);
    assert_eq!(st.worktree_base, "main");
    assert_eq!(st.worktree_id, w.id);
    assert_eq!(st.worktree_id.len(), 8, "the session's short id");

    // The agent edits, the work is committed, and one more change waits.
    prompt(
        &mut c,
        &task.id,
        &s.id,
        "/edit notes.txt edited by the agent",
    )
    .await;
    let sref = Some(pb::SessionRef {
        task_id: task.id.clone(),
        session_id: s.id.clone(),
    });
    let committed = ws
        .exec(pb::ExecRequest {
            session: sref.clone(),
            command: "git".into(),
            args: [
                "-c",
                "user.name=t",
                "-c",
                "user.email=t@example.com",
                "commit",
                "-qam",
                "agent edit",
            ]
            .map(String::from)
            .to_vec(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        committed.exit_code,
        Some(0),
        "{}",
        String::from_utf8_lossy(&committed.stderr)
    );
    ws.write_file(pb::WriteFileRequest {
        session: sref.clone(),
        path: "notes.txt".into(),
        content: b"not committed yet".to_vec(),
        ..Default::default()
    })
    .await
    .unwrap();
    // A file nobody added is the session's work too (helper-38 5).
    ws.write_file(pb::WriteFileRequest {
        session: sref.clone(),
        path: "fresh/made.txt".into(),
        content: b"made by the agent".to_vec(),
        create_parents: true,
    })
    .await
    .unwrap();

    let plain = ws
        .git_diff(pb::GitDiffRequest {
            session: sref.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .diff;
    assert!(
        plain.contains("-edited by the agent") && !plain.contains("-original"),
        "{plain}"
    );
    let against_base = ws
        .git_diff(pb::GitDiffRequest {
            session: sref.clone(),
            against_base: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .diff;
    assert!(
        against_base.contains("-original") && against_base.contains("+not committed yet"),
        "everything since the base, committed or not: {against_base}"
    );
    assert!(
        against_base.contains("+++ b/fresh/made.txt")
            && against_base.contains("+made by the agent"),
        "untracked files too: {against_base}"
    );
    assert!(!plain.contains("made by the agent"), "{plain}");
    // The worktree's own index is left as it was: still untracked.
    let status = ws
        .git_status(pb::GitStatusRequest {
            session: sref.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        status
            .files
            .iter()
            .any(|f| f.path == "fresh/made.txt" && f.code == "??"),
        "{status:?}"
    );
    let commits = ws
        .list_branch_commits(pb::ListBranchCommitsRequest {
            session: sref.clone(),
            limit: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (commits.branch.as_str(), commits.base.as_str()),
        (w.branch.as_str(), "main")
    );
    let subjects: Vec<&str> = commits.commits.iter().map(|c| c.subject.as_str()).collect();
    assert_eq!(subjects, ["agent edit"]);

    // Deleting would lose the change and the commit: refused, nothing touched.
    let err = c
        .delete_session(pb::DeleteSessionRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    assert_eq!(reason(&err), "worktree_has_work");
    assert!(
        err.message()
            .contains("2 file(s) with uncommitted changes (notes.txt, fresh/made.txt)")
            && err
                .message()
                .contains(&format!("1 commit(s) found only on branch {}", w.branch)),
        "{}",
        err.message()
    );
    assert_eq!(
        std::fs::read_to_string(Path::new(&w.path).join("notes.txt")).unwrap(),
        "not committed yet"
    );
    let st = c
        .get_session_status(pb::GetSessionStatusRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.state, pb::SessionState::WaitingForInput as i32);

    c.delete_session(pb::DeleteSessionRequest {
        task_id: task.id.clone(),
        session_id: s.id.clone(),
        discard_worktree: true,
        delete_branch: true,
        ..Default::default()
    })
    .await
    .unwrap();
    assert!(!Path::new(&w.path).exists());
    let branches = git(&repo, &["branch", "--format=%(refname:short)"]);
    assert_eq!(branches, "main");
}

/// Bad input: precise codes and messages, and nothing created.
/// A session created to work in another session's worktree (its
/// `worktree.path`): deleting the worktree's own session is refused while
/// the other one runs (even with discard), names it, and removes nothing;
/// keep_worktree or stopping the other one first lets it go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worktree_another_session_works_in_is_not_removed_from_under_it() {
    let dir = tempfile::tempdir().unwrap();
    let repo = repository(dir.path());
    let data = dir.path().join("data");
    let server = start(&data, &[]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "shared worktree").await;
    let owner = created(&mut c, from_repo(&task.id, &repo, "main")).await;
    let path = owner.worktree.clone().unwrap().path;
    let guest = created(&mut c, in_directory(&task.id, &path)).await;
    assert_eq!(guest.state, pb::SessionState::WaitingForInput as i32);
    let delete = |discard_worktree| pb::DeleteSessionRequest {
        task_id: task.id.clone(),
        session_id: owner.id.clone(),
        discard_worktree,
        ..Default::default()
    };
    for discard in [false, true] {
        let err = c.delete_session(delete(discard)).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
        assert_eq!(reason(&err), "worktree_has_work");
        assert!(err.message().contains(&guest.id), "{}", err.message());
        assert!(err.message().contains("keep_worktree"), "{}", err.message());
    }
    assert!(Path::new(&path).join("notes.txt").is_file());
    prompt(&mut c, &task.id, &guest.id, "still here").await;
    c.stop_session(pb::StopSessionRequest {
        task_id: task.id.clone(),
        session_id: guest.id.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    c.delete_session(delete(false)).await.unwrap();
    assert!(!Path::new(&path).exists());
}

/// A worktree git can no longer read (a removal cut short took its `.git`
/// file): a plain delete says how to go on instead of a bare git error, and
/// a delete that keeps the directory goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_removed_worktree_gets_an_error_that_says_how_to_go_on() {
    let dir = tempfile::tempdir().unwrap();
    let repo = repository(dir.path());
    let data = dir.path().join("data");
    let server = start(&data, &[]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "half removed").await;
    let s = created(&mut c, from_repo(&task.id, &repo, "main")).await;
    let path = PathBuf::from(s.worktree.clone().unwrap().path);
    std::fs::remove_file(path.join(".git")).unwrap();
    let delete = |discard_worktree| pb::DeleteSessionRequest {
        task_id: task.id.clone(),
        session_id: s.id.clone(),
        discard_worktree,
        ..Default::default()
    };
    let err = c.delete_session(delete(false)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    assert_eq!(reason(&err), "worktree_has_work");
    assert!(
        err.message().contains("--keep-worktree"),
        "{}",
        err.message()
    );
    assert!(
        err.message().contains("git worktree prune"),
        "{}",
        err.message()
    );
    // Discard cannot prove the directory is still this worktree: refused.
    let err = c.delete_session(delete(true)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("keep_worktree"), "{}", err.message());
    assert!(path.join("notes.txt").is_file(), "nothing removed");
    c.delete_session(pb::DeleteSessionRequest {
        keep_worktree: true,
        ..delete(false)
    })
    .await
    .unwrap();
    assert!(path.join("notes.txt").is_file(), "kept as asked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_repository_input_is_refused_precisely_and_creates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let repo = repository(dir.path());
    git(&repo, &["branch", "taken"]);
    let plain = dir.path().join("plain");
    std::fs::create_dir_all(&plain).unwrap();
    let empty = dir.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    git(&empty, &["init", "-q", "-b", "main"]);
    let data = dir.path().join("data");
    let server = start(&data, &[]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "t").await;

    let mut taken = from_repo(&task.id, &repo, "main");
    taken.worktree.as_mut().unwrap().branch = "taken".into();
    let mut both = from_repo(&task.id, &repo, "main");
    both.worktree.as_mut().unwrap().path = plain.display().to_string();
    // helper-52 5, 7, 13.
    let with = |change: &dyn Fn(&mut pb::Worktree)| {
        let mut req = from_repo(&task.id, &repo, "main");
        change(req.worktree.as_mut().unwrap());
        req
    };
    let long = with(&|w| w.branch = "y".repeat(300));
    let nul = with(&|w| w.branch = "a\0b".into());
    let escape = with(&|w| w.id = "a\nb\x1b[31m".into());
    let at = with(&|w| w.branch = "@".into());
    let bidi = with(&|w| w.branch = "x\u{202e}evil".into());
    let full = with(&|w| w.branch = "refs/heads/zz".into());
    let cases = [
        (
            long,
            tonic::Code::InvalidArgument,
            "worktree.branch: 300 bytes is longer than 240 bytes",
        ),
        (
            nul,
            tonic::Code::InvalidArgument,
            "worktree.branch: contains a control character",
        ),
        (
            escape,
            tonic::Code::InvalidArgument,
            "worktree.id: contains a control character",
        ),
        (
            bidi,
            tonic::Code::InvalidArgument,
            "worktree.branch: contains a bidirectional text control",
        ),
        (
            at,
            tonic::Code::InvalidArgument,
            "is not a branch name sessiond makes",
        ),
        (full, tonic::Code::InvalidArgument, "give the short name"),
        (
            from_repo(&task.id, &plain, "main"),
            tonic::Code::InvalidArgument,
            "is not a git repository",
        ),
        (
            from_repo(&task.id, &repo, "nope"),
            tonic::Code::InvalidArgument,
            "base: \"nope\" is not a branch, tag or commit",
        ),
        (
            from_repo(&task.id, &repo, ""),
            tonic::Code::InvalidArgument,
            "base: required",
        ),
        (
            from_repo(&task.id, &empty, "main"),
            tonic::Code::FailedPrecondition,
            "has no commits yet",
        ),
        (
            taken,
            tonic::Code::AlreadyExists,
            "branch \"taken\" already exists",
        ),
        (
            both,
            tonic::Code::InvalidArgument,
            "worktree.path: must be empty with worktree.repository",
        ),
        (
            from_repo(&task.id, Path::new("/usr/share"), "main"),
            tonic::Code::InvalidArgument,
            "worktree.repository: \"/usr/share\" is outside executors.worktree_roots",
        ),
    ];
    for (req, code, says) in cases {
        let err = c.create_session(req).await.unwrap_err();
        assert_eq!(err.code(), code, "{err:?}");
        assert!(err.message().contains(says), "{}", err.message());
    }
    let listed = c
        .list_sessions(pb::ListSessionsRequest {
            task_id: task.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(listed.sessions.is_empty(), "{listed:?}");
    let made = std::fs::read_dir(data.join("worktrees")).map_or(0, |d| d.count());
    assert_eq!(made, 0);
    assert_eq!(
        git(&repo, &["branch", "--format=%(refname:short)"]),
        "main\ntaken"
    );
}

/// A worktrees dir outside the worktree roots stops `serve` at startup,
/// naming the key.
#[test]
fn a_worktrees_dir_outside_the_roots_is_a_configuration_error() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let (ok, stderr) = run_sessiond(
        &[
            "serve",
            "--data-dir",
            data.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
        ],
        &[
            ("SESSIOND_API_TOKENS", TOKEN),
            ("SESSIOND_WORKTREE_ROOTS", dir.path().to_str().unwrap()),
            ("SESSIOND_WORKTREES_DIR", "/var/tmp/elsewhere"),
        ],
    );
    assert!(!ok);
    assert!(
        stderr.contains(
            "executors.worktrees_dir: /var/tmp/elsewhere is outside executors.worktree_roots"
        ),
        "{stderr}"
    );
}

/// A worktrees dir inside the roots by name but reached through a symlink
/// that leads out of them stops `serve` too (helper-38 2: worktrees were
/// made outside the roots).
#[test]
fn a_worktrees_dir_through_a_symlink_out_of_the_roots_is_a_configuration_error() {
    let dir = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let roots = dir.path().join("roots");
    std::fs::create_dir_all(&roots).unwrap();
    std::os::unix::fs::symlink(outside.path(), roots.join("link")).unwrap();
    let through = roots.join("link").join("worktrees");
    let data = dir.path().join("data");
    let (ok, stderr) = run_sessiond(
        &[
            "serve",
            "--data-dir",
            data.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
        ],
        &[
            ("SESSIOND_API_TOKENS", TOKEN),
            ("SESSIOND_WORKTREE_ROOTS", roots.to_str().unwrap()),
            ("SESSIOND_WORKTREES_DIR", through.to_str().unwrap()),
        ],
    );
    assert!(!ok);
    let resolved = std::fs::canonicalize(outside.path())
        .unwrap()
        .join("worktrees");
    assert!(
        stderr.contains(&format!(
            "executors.worktrees_dir: {} resolves to {} (through a symlink)",
            through.display(),
            resolved.display()
        )),
        "{stderr}"
    );
}

/// The Docker and remote worktrees dirs are checked too: Docker's inside
/// the roots (it is on this host), remote's an absolute path (on the hosts,
/// whose agentctls confine it). Each problem names its key.
#[test]
fn docker_and_remote_worktrees_dirs_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let config = dir.path().join("sessiond.toml");
    std::fs::write(
        &config,
        "[executors.docker]\nenabled = true\nworktrees_dir = \"/var/tmp/elsewhere\"\n\
         [executors.remote]\nworktrees_dir = \"srv/worktrees\"\n",
    )
    .unwrap();
    let (ok, stderr) = run_sessiond(
        &[
            "serve",
            "--config",
            config.to_str().unwrap(),
            "--data-dir",
            data.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
        ],
        &[
            ("SESSIOND_API_TOKENS", TOKEN),
            ("SESSIOND_WORKTREE_ROOTS", dir.path().to_str().unwrap()),
        ],
    );
    assert!(!ok);
    assert!(
        stderr.contains(
            "executors.docker.worktrees_dir: /var/tmp/elsewhere is outside executors.worktree_roots"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains(
            "executors.remote.worktrees_dir: srv/worktrees is not an absolute, normalised path"
        ),
        "{stderr}"
    );
}

/// kill -9 of sessiond and every agentctl, then one session's worktree
/// directory removed and another's directory and branch: after the restart
/// the first is checked out again from its branch and its conversation
/// goes on; the second is ERROR naming its branch, and its workspace calls
/// are refused saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_kill9_a_removed_worktree_comes_back_and_a_lost_branch_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let repo = repository(dir.path());
    let data = dir.path().join("data");
    let mut server = start(&data, &[]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "Two attempts").await;
    let mut made = Vec::new();
    for _ in 0..2 {
        let s = created(&mut c, from_repo(&task.id, &repo, "main")).await;
        assert_eq!(
            s.state,
            pb::SessionState::WaitingForInput as i32,
            "{}",
            s.error_message
        );
        prompt(&mut c, &task.id, &s.id, "hello").await;
        made.push(s);
    }
    let (kept, lost) = (&made[0], &made[1]);
    let kept_w = kept.worktree.clone().unwrap();
    let lost_w = lost.worktree.clone().unwrap();
    git(
        Path::new(&kept_w.path),
        &["commit", "-q", "--allow-empty", "-m", "kept work"],
    );

    server.kill();
    for pid in agentctl_pids(&data) {
        Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .unwrap();
    }
    std::fs::remove_dir_all(&kept_w.path).unwrap();
    std::fs::remove_dir_all(&lost_w.path).unwrap();
    git(&repo, &["worktree", "prune"]);
    git(&repo, &["branch", "-D", &lost_w.branch]);

    let server = start(&data, &[]);
    wait_serving(&server).await;
    let mut c = sessions(&server).await;
    let mut ws = workspaces(&server).await;
    let status = |id: &str| pb::GetSessionStatusRequest {
        task_id: task.id.clone(),
        session_id: id.to_owned(),
    };

    // Recreated from its branch (its commit there), and the agent resumed.
    assert!(Path::new(&kept_w.path).is_dir());
    assert_eq!(
        git(Path::new(&kept_w.path), &["log", "-1", "--format=%s"]),
        "kept work"
    );
    let reply = prompt(&mut c, &task.id, &kept.id, "again").await;
    assert!(reply.contains("turn 2 of session"), "{reply}");

    let st = c
        .get_session_status(status(&lost.id))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.state, pb::SessionState::Error as i32);
    assert!(
        st.error_message.starts_with("worktree_branch_missing: ")
            && st.error_message.contains(&lost_w.branch),
        "{}",
        st.error_message
    );
    let err = ws
        .git_status(pb::GitStatusRequest {
            session: Some(pb::SessionRef {
                task_id: task.id.clone(),
                session_id: lost.id.clone(),
            }),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains(&lost_w.branch), "{}", err.message());
    assert!(
        !Path::new(&lost_w.path).exists(),
        "nothing made up in its place"
    );
}

/// `executors.repositories` is what ListRepositories offers; one outside
/// the worktree roots stops `serve`, naming the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configured_repositories_are_listed_and_checked() {
    let dir = tempfile::tempdir().unwrap();
    let repo = repository(dir.path());
    let data = dir.path().join("data");
    let (ok, stderr) = run_sessiond(
        &[
            "serve",
            "--data-dir",
            data.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
        ],
        &[
            ("SESSIOND_API_TOKENS", TOKEN),
            ("SESSIOND_WORKTREE_ROOTS", dir.path().to_str().unwrap()),
            ("SESSIOND_REPOSITORIES", "/var/tmp/other"),
        ],
    );
    assert!(!ok);
    assert!(
        stderr.contains(
            "executors.repositories[0]: /var/tmp/other is outside executors.worktree_roots"
        ),
        "{stderr}"
    );

    let server = crate::support::start_env(
        &data,
        &[],
        Some(TOKEN),
        None,
        &[("SESSIOND_REPOSITORIES", repo.as_path())],
    );
    let mut c = sessions(&server).await;
    let listed = c
        .list_repositories(pb::ListRepositoriesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.repositories, [repo.display().to_string()]);

    // Its branches, offered as bases; bad repositories are refused precisely.
    git(&repo, &["branch", "feature/x"]);
    let branches = c
        .list_repository_branches(pb::ListRepositoryBranchesRequest {
            repository: repo.display().to_string(),
            runtime: 0,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(branches.branches, ["feature/x", "main"]);
    assert_eq!(branches.current, "main");
    let plain = dir.path().join("plain");
    std::fs::create_dir_all(&plain).unwrap();
    for (repository, runtime, code, says) in [
        (
            "/var/tmp/other".to_owned(),
            0,
            tonic::Code::InvalidArgument,
            "repository: \"/var/tmp/other\" is outside executors.worktree_roots",
        ),
        (
            "relative".to_owned(),
            0,
            tonic::Code::InvalidArgument,
            "repository: \"relative\" is not an absolute path",
        ),
        (
            plain.display().to_string(),
            0,
            tonic::Code::InvalidArgument,
            "is not a git repository",
        ),
        (
            repo.display().to_string(),
            pb::Runtime::Remote as i32,
            tonic::Code::InvalidArgument,
            "remote_url: a remote session needs the http(s):// URL of its agentctl",
        ),
    ] {
        let err = c
            .list_repository_branches(pb::ListRepositoryBranchesRequest {
                repository,
                runtime,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), code, "{err:?}");
        assert!(err.message().contains(says), "{}", err.message());
    }

    // A remote host's, listed by its agentctl (started by its operator with
    // the repository inside its worktree roots), named as for a create.
    let host_dir = dir.path().join("host");
    let host_repo = repository(&host_dir);
    git(&host_repo, &["branch", "feature/remote"]);
    let executor_id = uuid::Uuid::new_v4().to_string();
    let port_file = dir.path().join("host.port");
    let mut host = Command::new(crate::support::bin("agentctl"))
        .args(["--executor-id", &executor_id, "--listen", "127.0.0.1:0"])
        .arg("--worktree-root")
        .arg(&host_dir)
        .arg("--port-file")
        .arg(&port_file)
        .args(["--idle-timeout", "120s"])
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("AGENTCTL_SECRET", "host-secret")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !port_file.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "agentctl wrote no port file"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let url = format!(
        "http://127.0.0.1:{}",
        std::fs::read_to_string(&port_file).unwrap().trim()
    );
    let remote = |repository: &Path, secret: &str| pb::ListRepositoryBranchesRequest {
        repository: repository.display().to_string(),
        runtime: pb::Runtime::Remote as i32,
        remote_url: url.clone(),
        remote_secret: secret.into(),
        remote_executor_id: executor_id.clone(),
    };
    let listed = c
        .list_repository_branches(remote(&host_repo, "host-secret"))
        .await;
    let wrong_secret = c
        .list_repository_branches(remote(&host_repo, "not-the-secret"))
        .await;
    let outside = c
        .list_repository_branches(remote(&repo, "host-secret"))
        .await;
    let _ = host.kill();
    let _ = host.wait();
    let listed = listed.unwrap().into_inner();
    assert_eq!(listed.branches, ["feature/remote", "main"]);
    assert_eq!(listed.current, "main");
    let err = wrong_secret.unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().contains("rejected the executor secret"),
        "{}",
        err.message()
    );
    let err = outside.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(
        err.message()
            .contains("outside this agentctl's worktree roots"),
        "{}",
        err.message()
    );
}
