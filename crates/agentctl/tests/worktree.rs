//! `agentctl worktree ...`, the one-shot command sessiond creates, restores,
//! inspects and removes session worktrees with: real git, the real binary.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;

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

/// A temporary directory holding `repo`, a repository with one commit on
/// `main`.
fn repository() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    std::fs::create_dir_all(&repo).unwrap();
    git(&repo, &["init", "-q", "-b", "main"]);
    git(&repo, &["commit", "-q", "--allow-empty", "-m", "init"]);
    (dir, repo)
}

/// Runs `agentctl worktree OP` and returns its one JSON answer.
fn worktree(op: &str, repo: &Path, branch: &str, path: &Path, extra: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_agentctl"))
        .args(["worktree", op])
        .arg(format!("--repository={}", repo.display()))
        .args(["--base=main", &format!("--branch={branch}")])
        .arg(format!("--path={}", path.display()))
        .args(extra)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// A repository whose config names a smudge filter and whose hooks
/// directory has a post-checkout hook, each leaving a marker when run:
/// neither runs when sessiond checks out a worktree (they could have been
/// planted by an agent through its own worktree).
#[test]
fn checkouts_run_no_hook_or_filter_the_repository_names() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    std::fs::create_dir_all(&repo).unwrap();
    git(&repo, &["init", "-q", "-b", "main"]);
    std::fs::write(repo.join("a.txt"), "content\n").unwrap();
    std::fs::write(repo.join(".gitattributes"), "*.txt filter=planted\n").unwrap();
    git(&repo, &["add", "."]);
    git(&repo, &["commit", "-q", "-m", "init"]);
    let filter_marker = dir.path().join("filter-ran");
    let hook_marker = dir.path().join("hook-ran");
    git(
        &repo,
        &[
            "config",
            "filter.planted.smudge",
            &format!("sh -c 'touch {}; cat'", filter_marker.display()),
        ],
    );
    let hook = repo.join(".git/hooks/post-checkout");
    std::fs::write(
        &hook,
        format!("#!/bin/sh\ntouch {}\n", hook_marker.display()),
    )
    .unwrap();
    std::fs::set_permissions(&hook, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();

    let path = dir.path().join("wts/one");
    let made = worktree("create", &repo, "s/one", &path, &[]);
    assert_eq!(made["ok"]["outcome"], "created", "{made}");
    assert_eq!(
        std::fs::read_to_string(path.join("a.txt")).unwrap(),
        "content\n"
    );
    // Removed behind sessiond's back, then restored from the branch.
    std::fs::remove_dir_all(&path).unwrap();
    let back = worktree("restore", &repo, "s/one", &path, &[]);
    assert_eq!(back["ok"]["outcome"], "recreated", "{back}");
    assert!(!filter_marker.exists(), "the planted filter ran");
    assert!(!hook_marker.exists(), "the planted hook ran");
}

/// What each operation answers, with the codes sessiond maps to statuses.
#[test]
fn answers_and_refusals() {
    let (dir, repo) = repository();
    let path = dir.path().join("wts/one");
    assert_eq!(
        worktree("check", &repo, "s/one", &path, &[])["ok"],
        serde_json::json!({})
    );
    assert_eq!(
        worktree("create", &repo, "s/one", &path, &[])["ok"]["outcome"],
        "created"
    );
    // Created again (a create repeated after a crash): adopted.
    assert_eq!(
        worktree("create", &repo, "s/one", &path, &[])["ok"]["outcome"],
        "adopted"
    );

    // A directory that is not the session's worktree: ALREADY_EXISTS (6).
    let foreign = dir.path().join("wts/foreign");
    std::fs::create_dir_all(&foreign).unwrap();
    let refused = worktree("create", &repo, "s/two", &foreign, &[]);
    assert_eq!(refused["error"]["code"], 6, "{refused}");
    // The branch taken: ALREADY_EXISTS; no base: INVALID_ARGUMENT (3).
    let taken = worktree("check", &repo, "s/one", &dir.path().join("wts/x"), &[]);
    assert_eq!(taken["error"]["code"], 6, "{taken}");
    let not_repo = worktree("check", dir.path(), "s/x", &dir.path().join("wts/y"), &[]);
    assert_eq!(not_repo["error"]["code"], 3, "{not_repo}");

    // State: a dirty file and a commit of its own.
    std::fs::write(path.join("new.txt"), "x").unwrap();
    git(&path, &["commit", "-q", "--allow-empty", "-m", "mine"]);
    let st = worktree("state", &repo, "s/one", &path, &[]);
    assert_eq!(
        st["ok"]["dirty_files"],
        serde_json::json!(["new.txt"]),
        "{st}"
    );
    assert_eq!(st["ok"]["unique_commits"], 1, "{st}");
    assert_eq!(st["ok"]["merged"], false, "{st}");
    let commits = worktree("commits", &repo, "s/one", &path, &[]);
    assert_eq!(commits["ok"][0]["subject"], "mine", "{commits}");
    // The base branch renamed away: FAILED_PRECONDITION (9) naming it, not
    // git's "unknown revision" (helper-41 8).
    git(&repo, &["branch", "-m", "main", "trunk"]);
    let lost = worktree("commits", &repo, "s/one", &path, &[]);
    assert_eq!(lost["error"]["code"], 9, "{lost}");
    let said = lost["error"]["message"].as_str().unwrap_or_default();
    assert!(said.contains("base \"main\" is no longer"), "{lost}");
    git(&repo, &["branch", "-m", "trunk", "main"]);

    // Remove with the branch: the foreign directory stays untouched.
    assert_eq!(
        worktree("remove", &repo, "s/one", &path, &["--delete-branch"])["ok"],
        serde_json::json!({})
    );
    assert!(!path.exists() && foreign.is_dir());
    assert_eq!(git(&repo, &["branch", "--format=%(refname:short)"]), "main");
}

/// A create whose caller died goes on (its git runs to the end); the next
/// operation on the same worktree, a restore by the restarted caller, waits
/// for it instead of taking its half-made directory for someone else's.
#[test]
fn an_operation_waits_for_one_in_flight_on_the_same_worktree() {
    use std::io::BufRead;
    let (dir, repo) = repository();
    let path = dir.path().join("wts/one");
    let spec = agentctl::worktree::Spec {
        repository: repo.clone(),
        base: "main".into(),
        branch: "s/one".into(),
        path: path.clone(),
    };
    // The create in flight: it holds the worktree's lock, and git has made
    // the directory but not checked anything out yet.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let in_flight = rt
        .block_on(agentctl::worktree::lock(&spec, &|| {}))
        .unwrap();
    std::fs::create_dir_all(&path).unwrap();

    let mut restore = Command::new(env!("CARGO_BIN_EXE_agentctl"))
        .args(["worktree", "restore", "--never-created"])
        .arg(format!("--repository={}", repo.display()))
        .args(["--base=main", "--branch=s/one"])
        .arg(format!("--path={}", path.display()))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Its first word on stderr: it waits (without the lock it answers at
    // once, ALREADY_EXISTS, and says nothing there).
    let mut stderr = std::io::BufReader::new(restore.stderr.take().unwrap());
    let mut line = String::new();
    stderr.read_line(&mut line).unwrap();
    if !line.contains("waiting for another operation") {
        let out = restore.wait_with_output().unwrap();
        panic!(
            "the restore did not wait for the create in flight: stderr {line:?}, answer {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    // The create finishes, and its holder ends.
    git(
        &repo,
        &[
            "worktree",
            "add",
            "--no-track",
            "-b",
            "s/one",
            path.to_str().unwrap(),
            "main",
        ],
    );
    drop(in_flight);
    let out = restore.wait_with_output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(answer["ok"]["outcome"], "adopted", "{answer}");
}

/// Sessions created from one repository at once: every create succeeds.
/// git's own `worktree add` reads the other worktrees' admin directories
/// and fails on one another `add` is making at that moment ("failed to read
/// .git/worktrees/NAME/commondir"; about half of 30 concurrent plain
/// `git worktree add`s fail so), so agentctl runs them one at a time per
/// repository.
#[test]
fn creates_from_one_repository_at_once_all_succeed() {
    let (dir, repo) = repository();
    let creates: Vec<_> = (0..24)
        .map(|i| {
            Command::new(env!("CARGO_BIN_EXE_agentctl"))
                .args(["worktree", "create"])
                .arg(format!("--repository={}", repo.display()))
                .arg("--base=main")
                .arg(format!("--branch=s/{i}"))
                .arg(format!(
                    "--path={}",
                    dir.path().join(format!("wts/{i}")).display()
                ))
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (i, create) in creates.into_iter().enumerate() {
        let out = create.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "create {i} failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let answer: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(answer["ok"]["outcome"], "created", "{answer}");
    }
    let listed = git(&repo, &["worktree", "list", "--porcelain"]);
    assert_eq!(
        listed.matches("branch refs/heads/s/").count(),
        24,
        "{listed}"
    );
}

/// Leaves the worktree at `path` of `repo` as a `git worktree add` killed
/// mid-checkout does: git's entry still `locked` "initializing", a file
/// not checked out yet.
fn cut_short(repo: &Path, path: &Path) {
    for entry in std::fs::read_dir(repo.join(".git/worktrees")).unwrap() {
        std::fs::write(entry.unwrap().path().join("locked"), "initializing").unwrap();
    }
    std::fs::remove_file(path.join("a.txt")).unwrap();
}

/// A `git worktree add` killed before it finished left a half-made
/// directory: restore and create remove it with git's entry and check the
/// branch out again, whole, instead of refusing the directory as someone
/// else's or adopting a partial checkout.
#[test]
fn an_add_cut_short_is_removed_and_made_again() {
    let (dir, repo) = repository();
    std::fs::write(repo.join("a.txt"), "a").unwrap();
    git(&repo, &["add", "a.txt"]);
    git(&repo, &["commit", "-q", "-m", "a"]);
    let path = dir.path().join("wts/cut");
    assert_eq!(
        worktree("create", &repo, "s/cut", &path, &[])["ok"]["outcome"],
        "created"
    );

    cut_short(&repo, &path);
    let restored = worktree("restore", &repo, "s/cut", &path, &[]);
    assert_eq!(restored["ok"]["outcome"], "recreated", "{restored}");
    assert_eq!(std::fs::read_to_string(path.join("a.txt")).unwrap(), "a");

    // A create repeated after the cut: the branch the add made is checked out.
    cut_short(&repo, &path);
    let created = worktree("create", &repo, "s/cut", &path, &[]);
    assert_eq!(created["ok"]["outcome"], "created", "{created}");
    assert_eq!(std::fs::read_to_string(path.join("a.txt")).unwrap(), "a");
    let listed = git(&repo, &["worktree", "list", "--porcelain"]);
    assert_eq!(
        listed.matches("branch refs/heads/s/cut").count(),
        1,
        "{listed}"
    );
    assert!(!listed.contains("locked"), "{listed}");
}

/// A `git worktree add -b` killed while it wrote the branch's ref left
/// `refs/heads/<branch>.lock`: every later create failed "cannot lock
/// ref" (the crash loop saw a session go ERROR for good). The lock of the
/// session's own branch, with no add of its path running, is removed and
/// the create goes through.
#[test]
fn a_ref_lock_left_by_a_killed_add_does_not_block_the_create() {
    let (dir, repo) = repository();
    let path = dir.path().join("wts/locked");
    let lock = repo.join(".git/refs/heads/s/locked.lock");
    std::fs::create_dir_all(lock.parent().unwrap()).unwrap();
    std::fs::write(&lock, "").unwrap();
    let created = worktree("create", &repo, "s/locked", &path, &[]);
    assert_eq!(created["ok"]["outcome"], "created", "{created}");
    assert!(!lock.exists());
    assert_eq!(git(&path, &["branch", "--show-current"]), "s/locked");
}

/// helper-41 2: a `git worktree add` whose checkout failed (there: a full
/// disk) left the branch it had made, so the create could not be made
/// again, and its error held every line git printed. Here the base holds
/// a file whose name is too long for the file system (a tree made with
/// `git mktree`; no checkout can write it): the branch goes with the
/// failure, and the error is cut to its start and end.
#[test]
fn a_failed_checkout_leaves_no_branch_and_a_short_error() {
    let (dir, repo) = repository();
    let long = "a".repeat(300);
    let blob = {
        let out = Command::new("git")
            .arg("-C")
            .arg(&repo)
            .args(["hash-object", "-w", "--stdin"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        out.stdin.as_ref().unwrap().write_all(b"x\n").unwrap();
        let done = out.wait_with_output().unwrap();
        String::from_utf8_lossy(&done.stdout).trim().to_owned()
    };
    // Many entries, each failing: git prints a line per file.
    let mut tree = String::new();
    for i in 0..200 {
        tree.push_str(&format!("100644 blob {blob}\t{long}{i}\n"));
    }
    let tree_id = {
        let out = Command::new("git")
            .arg("-C")
            .arg(&repo)
            .arg("mktree")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        out.stdin
            .as_ref()
            .unwrap()
            .write_all(tree.as_bytes())
            .unwrap();
        let done = out.wait_with_output().unwrap();
        String::from_utf8_lossy(&done.stdout).trim().to_owned()
    };
    let commit = git(
        &repo,
        &["commit-tree", &tree_id, "-p", "main", "-m", "long names"],
    );
    git(&repo, &["branch", "unwritable", &commit]);

    let path = dir.path().join("wts/one");
    let out = Command::new(env!("CARGO_BIN_EXE_agentctl"))
        .args(["worktree", "create"])
        .arg(format!("--repository={}", repo.display()))
        .args(["--base=unwritable", "--branch=s/failed"])
        .arg(format!("--path={}", path.display()))
        .output()
        .unwrap();
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let message = answer["error"]["message"].as_str().unwrap_or_default();
    assert!(!message.is_empty(), "{answer}");
    assert!(message.len() < 4096, "{} bytes: {message}", message.len());
    let branches = git(&repo, &["branch", "--format=%(refname:short)"]);
    assert!(!branches.contains("s/failed"), "{branches}");
}
