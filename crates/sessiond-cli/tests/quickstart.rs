//! The README quickstart, step by step, through the `sessiond` and
//! `sessionctl` binaries: start the server; create a task and a session with
//! the demo agent; send a prompt; kill the server (SIGTERM, as `kill %1`);
//! start it again; see the session resumed on its own and the conversation
//! continue.
//!
//! The only differences from the README are environment: a private data
//! directory and HOME, a free port instead of 50051 and no metrics endpoint,
//! so the test runs beside others. Needs every binary built
//! (`cargo build --bins`, as `cargo xtask ci` does).

#![allow(clippy::unwrap_used)]

use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    time::{Duration, Instant},
};

struct Env {
    home: tempfile::TempDir,
    addr: String,
    token: String,
    task: Option<String>,
}

fn bin(name: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_BIN_EXE_sessionctl"))
        .parent()
        .unwrap()
        .join(name);
    assert!(
        path.is_file(),
        "{} not found: build every binary first (`cargo build --bins`)",
        path.display()
    );
    path
}

impl Env {
    fn new() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        Self {
            home: tempfile::tempdir().unwrap(),
            addr: format!("127.0.0.1:{port}"),
            // As `od -An -N16 -tx1 /dev/urandom | tr -d ' \n'` would make.
            token: uuid_like(),
            task: None,
        }
    }

    fn apply(&self, cmd: &mut Command) {
        let path = format!(
            "{}:{}",
            bin("sessiond").parent().unwrap().display(),
            std::env::var("PATH").unwrap_or_default()
        );
        cmd.env("HOME", self.home.path())
            .env("PATH", path)
            .env_remove("XDG_DATA_HOME")
            .env_remove("SESSIOND_CONFIG")
            .env_remove("SESSIOND_DATABASE_URL")
            .env("SESSIOND_LISTEN", &self.addr)
            .env("SESSIOND_ADDR", &self.addr)
            .env("SESSIOND_METRICS_LISTEN", "off")
            .env("SESSIOND_TOKEN", &self.token)
            .env("SESSIOND_LOG", "warn");
        match &self.task {
            Some(t) => cmd.env("SESSIOND_TASK", t),
            None => cmd.env_remove("SESSIOND_TASK"),
        };
    }

    /// `SESSIOND_API_TOKENS=$SESSIOND_TOKEN sessiond serve &`, until its
    /// listening line.
    /// A server started in a fresh home, a task titled `title` (the
    /// default one of later calls) and a demo-agent session working in
    /// `<home>/<dir>`: (env, that directory, the server, the session id).
    fn with_session(dir: &str, title: &str) -> (Self, PathBuf, Served, String) {
        let mut env = Env::new();
        let scratch = env.home.path().join(dir);
        std::fs::create_dir_all(&scratch).unwrap();
        let server = env.serve();
        env.sessionctl(&["health", "--wait"], &scratch);
        let task = env
            .sessionctl(&["task", "create", title, "-q"], &scratch)
            .trim()
            .to_owned();
        env.task = Some(task);
        let session = env
            .sessionctl(&["session", "create", "-q"], &scratch)
            .trim()
            .to_owned();
        (env, scratch, server, session)
    }

    fn serve(&self) -> Served {
        self.serve_with(&[])
    }

    /// [`Env::serve`] with more environment (e.g. the Docker executor's).
    fn serve_with(&self, extra: &[(&str, &str)]) -> Served {
        self.serve_in(&std::env::current_dir().unwrap(), extra)
    }

    /// [`Env::serve_with`], started in `cwd`.
    fn serve_in(&self, cwd: &Path, extra: &[(&str, &str)]) -> Served {
        self.serve_after(cwd, extra, None)
    }

    /// [`Env::serve_in`], `before` (a shell command) run first by the shell
    /// that then execs sessiond: what a parent leaves it (open descriptors).
    fn serve_after(&self, cwd: &Path, extra: &[(&str, &str)], before: Option<&str>) -> Served {
        let mut cmd = match before {
            Some(before) => {
                let mut sh = Command::new("sh");
                sh.arg("-c")
                    .arg(format!("{before}; exec sessiond \"$@\""))
                    .arg("sh");
                sh
            }
            None => Command::new("sessiond"),
        };
        self.apply(&mut cmd);
        cmd.current_dir(cwd).envs(extra.iter().copied());
        cmd.arg("serve")
            .env("SESSIOND_API_TOKENS", &self.token)
            .stdout(Stdio::piped());
        let mut child = cmd.spawn().unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), format!("sessiond listening on {}", self.addr));
        Served(Some(child))
    }

    fn sessionctl(&self, args: &[&str], cwd: &Path) -> String {
        let mut cmd = Command::new("sessionctl");
        self.apply(&mut cmd);
        let Output {
            status,
            stdout,
            stderr,
        } = cmd.args(args).current_dir(cwd).output().unwrap();
        let stdout = String::from_utf8_lossy(&stdout).into_owned();
        assert!(
            status.success(),
            "sessionctl {args:?} failed: {}\n{stdout}",
            String::from_utf8_lossy(&stderr)
        );
        stdout
    }
}

impl Env {
    /// Starts `sessionctl args` in `cwd` with its stdio piped, for a test
    /// that feeds it, reads it while it runs, or kills it.
    fn spawn_sessionctl(&self, args: &[&str], cwd: &Path) -> Child {
        let mut cmd = Command::new("sessionctl");
        self.apply(&mut cmd);
        cmd.args(args)
            .current_dir(cwd)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }

    /// Runs `sessionctl args` expecting it to fail; returns its stdout,
    /// stderr and how long it took.
    fn sessionctl_fails(&self, args: &[&str], cwd: &Path) -> (String, String, Duration) {
        let mut cmd = Command::new("sessionctl");
        self.apply(&mut cmd);
        let started = Instant::now();
        let Output {
            status,
            stdout,
            stderr,
        } = cmd.args(args).current_dir(cwd).output().unwrap();
        let took = started.elapsed();
        let stdout = String::from_utf8_lossy(&stdout).into_owned();
        let stderr = String::from_utf8_lossy(&stderr).into_owned();
        assert!(
            !status.success(),
            "sessionctl {args:?} succeeded:\n{stdout}\n{stderr}"
        );
        (stdout, stderr, took)
    }
}

fn uuid_like() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{:032x}", nanos ^ (u128::from(std::process::id()) << 64))
}

/// A `sessiond serve` child, killed when dropped still running (a test
/// that panics must not leave its server behind).
struct Served(Option<Child>);

impl std::ops::Deref for Served {
    type Target = Child;
    fn deref(&self) -> &Child {
        self.0.as_ref().expect("served")
    }
}

impl std::ops::DerefMut for Served {
    fn deref_mut(&mut self) -> &mut Child {
        self.0.as_mut().expect("served")
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some(child) = &mut self.0
            && child.try_wait().ok().flatten().is_none()
        {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Every agentctl a test started lives under its home: ended with the
/// test, whether it passed or panicked.
impl Drop for Env {
    fn drop(&mut self) {
        for pid in agentctls_under(self.home.path()) {
            let _ = Command::new("kill").args(["-KILL", &pid]).status();
        }
    }
}

fn terminate(mut served: Served) {
    let mut child = served.0.take().expect("served");
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(child.wait().unwrap().success());
}

/// Every agentctl whose command line mentions `dir`, for cleanup.
fn agentctls_under(dir: &Path) -> Vec<String> {
    let needle = dir.display().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let pid = e.file_name().to_string_lossy().parse::<u32>().ok()?;
            let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            (cmd.contains("agentctl") && cmd.contains(&needle)).then(|| pid.to_string())
        })
        .collect()
}

/// helper-41 3: a descriptor sessiond's parent left open (a supervisor's
/// lock file) reached every agentctl, which outlives sessiond and kept it:
/// `flock` could not start sessiond again. None reaches agentctl now.
#[test]
fn agentctl_gets_no_descriptor_that_sessiond_inherited() {
    let mut env = Env::new();
    let scratch = env.home.path().join("fds");
    std::fs::create_dir_all(&scratch).unwrap();
    let marker = env.home.path().join("inherited-lock");
    std::fs::write(&marker, "").unwrap();
    let server = env.serve_after(
        &std::env::current_dir().unwrap(),
        &[],
        Some(&format!("exec 9<'{}'", marker.display())),
    );
    env.sessionctl(&["health", "--wait"], &scratch);
    let task = env
        .sessionctl(&["task", "create", "fds", "-q"], &scratch)
        .trim()
        .to_owned();
    env.task = Some(task);
    env.sessionctl(&["session", "create", "-q"], &scratch);
    let agentctls = agentctls_under(env.home.path());
    assert_eq!(agentctls.len(), 1, "{agentctls:?}");
    let held: Vec<String> = std::fs::read_dir(format!("/proc/{}/fd", agentctls[0]))
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .map(|t| t.display().to_string())
        .collect();
    assert!(
        !held.iter().any(|t| t == &marker.display().to_string()),
        "agentctl holds sessiond's inherited descriptor: {held:?}"
    );
    terminate(server);
    for pid in agentctls_under(env.home.path()) {
        let _ = Command::new("kill").args(["-KILL", &pid]).status();
    }
}

#[test]
fn readme_quickstart_story() {
    let mut env = Env::new();
    let scratch = env.home.path().join("quickstart");
    std::fs::create_dir_all(&scratch).unwrap();

    // 1. Start the server and wait until it has recovered (nothing yet).
    let server = env.serve();
    env.sessionctl(&["health", "--wait"], &scratch);

    // 2. A task and a session with the demo agent, in the scratch directory.
    let task = env
        .sessionctl(&["task", "create", "Try sessiond", "-q"], &scratch)
        .trim()
        .to_owned();
    env.task = Some(task.clone());
    let session = env
        .sessionctl(&["session", "create", "-q"], &scratch)
        .trim()
        .to_owned();
    assert_eq!(session.len(), 36, "{session:?}");

    // 3. A prompt; the reply streams to stdout.
    let reply = env.sessionctl(&["send", &session, "hello"], &scratch);
    assert!(
        reply.contains("turn 1") && reply.contains("you said \"hello\""),
        "{reply}"
    );
    // A reply's terminal controls are shown, not obeyed; its lines stay.
    let reply = env.sessionctl(&["send", &session, "bell\u{7} \u{1b}[31mred"], &scratch);
    assert!(reply.contains("bell\\u{7} \\u{1b}[31mred"), "{reply:?}");
    assert!(!reply.contains('\u{1b}'), "{reply:?}");

    // Without a token: the server's refusal, and where the token goes.
    let mut anonymous = Command::new("sessionctl");
    env.apply(&mut anonymous);
    let refused = anonymous
        .env_remove("SESSIOND_TOKEN")
        .args(["session", "list"])
        .current_dir(&scratch)
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("Unauthenticated"), "{stderr}");
    assert!(stderr.contains("SESSIOND_TOKEN"), "{stderr}");

    // 4. Kill the server; the agent keeps running.
    terminate(server);
    assert_eq!(agentctls_under(env.home.path()).len(), 1);

    // 5. Start again: the session is back on its own.
    let server = env.serve();
    assert!(
        env.sessionctl(&["health", "--wait"], &scratch)
            .contains("SERVING")
    );
    let status = env.sessionctl(&["session", "status", &session], &scratch);
    assert!(status.contains("WAITING_FOR_INPUT"), "{status}");
    assert!(status.contains("executor          ready"), "{status}");
    assert!(status.contains("agent running     true"), "{status}");

    // 6. The conversation continues where it was.
    let reply = env.sessionctl(&["send", &session, "are you still there?"], &scratch);
    assert!(reply.contains("turn 3"), "{reply}");
    let messages = env.sessionctl(&["messages", &session], &scratch);
    assert_eq!(messages.lines().count(), 6, "{messages}");
    assert!(messages.contains("[1] user: hello"), "{messages}");
    assert!(!messages.contains('\u{1b}'), "{messages:?}");
    assert!(messages.contains("[6] agent: turn 3"), "{messages}");

    // --json output of the same data.
    // A list is an array whatever its length; one session is an object.
    let json = env.sessionctl(&["--json", "session", "list"], &scratch);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v.as_array().map(Vec::len), Some(1), "{json}");
    assert_eq!(v[0]["id"], session.as_str(), "{json}");
    assert_eq!(v[0]["state"], "WAITING_FOR_INPUT");
    let json = env.sessionctl(&["--json", "session", "get", &session], &scratch);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["id"], session.as_str(), "{json}");

    // Workspace access through the CLI.
    std::fs::write(scratch.join("notes.txt"), "quickstart\n").unwrap();
    let cat = env.sessionctl(&["workspace", "cat", &session, "notes.txt"], &scratch);
    assert_eq!(cat, "quickstart\n");
    let ls = env.sessionctl(&["workspace", "ls", &session], &scratch);
    assert!(ls.contains("notes.txt"), "{ls}");
    let out = env.sessionctl(
        &["workspace", "exec", &session, "--", "echo", "hi"],
        &scratch,
    );
    assert_eq!(out, "hi\n");

    // Clean up: stop the session (its agentctl exits), then the server.
    env.sessionctl(&["session", "stop", &session], &scratch);
    terminate(server);
    for pid in agentctls_under(env.home.path()) {
        let _ = Command::new("kill").args(["-KILL", &pid]).status();
    }
}

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

/// The README's worktree step: in a git repository, `session create --repo`
/// makes the session an isolated worktree on a branch of its own; the
/// agent's edit shows in `git-diff --base` and not in the repository;
/// `session delete` keeps the work until told to discard it.
#[test]
fn readme_worktree_story() {
    let mut env = Env::new();
    let repo = env.home.path().join("src/myproject");
    std::fs::create_dir_all(&repo).unwrap();
    git(&repo, &["init", "-q", "-b", "main"]);
    std::fs::write(repo.join("notes.txt"), "original\n").unwrap();
    git(&repo, &["add", "notes.txt"]);
    git(&repo, &["commit", "-q", "-m", "init"]);
    let server = env.serve();
    env.sessionctl(&["health", "--wait"], &repo);
    let task = env
        .sessionctl(&["task", "create", "Try worktrees", "-q"], &repo)
        .trim()
        .to_owned();
    env.task = Some(task);

    let session = env
        .sessionctl(&["session", "create", "--repo", "-q"], &repo)
        .trim()
        .to_owned();
    assert_eq!(session.len(), 36, "{session:?}");
    let status = env.sessionctl(&["session", "status", &session], &repo);
    let short = &session.replace('-', "")[24..];
    let branch = format!("sessiond/{short}-try-worktrees");
    assert!(status.contains(&branch), "{status}");
    assert!(
        status.contains(&format!("repository        {} (base main", repo.display())),
        "{status}"
    );
    let worktree = env.home.path().join(format!(
        ".local/share/sessiond/worktrees/{short}-try-worktrees"
    ));
    assert!(worktree.is_dir(), "{status}");

    // `--repo` from inside that worktree names the main repository (which
    // outlives the worktree), the worktree's branch as the base.
    let nested = env
        .sessionctl(&["session", "create", "--repo", "-q"], &worktree)
        .trim()
        .to_owned();
    let status = env.sessionctl(&["session", "status", &nested], &repo);
    assert!(
        status.contains(&format!(
            "repository        {} (base {branch}",
            repo.display()
        )),
        "{status}"
    );
    env.sessionctl(&["session", "delete", &nested], &repo);

    // A bare repository is its own top (helper-38 8: "must be run in a
    // work tree").
    let bare = env.home.path().join("src/myproject.git");
    git(
        env.home.path(),
        &[
            "clone",
            "--bare",
            "-q",
            repo.to_str().unwrap(),
            bare.to_str().unwrap(),
        ],
    );
    let from_bare = env
        .sessionctl(&["session", "create", "--repo", "-q"], &bare)
        .trim()
        .to_owned();
    let status = env.sessionctl(&["session", "status", &from_bare], &repo);
    assert!(
        status.contains(&format!("repository        {} (base main", bare.display())),
        "{status}"
    );
    env.sessionctl(&["session", "delete", &from_bare], &repo);
    // The repository named by its `.git` directory (helper-41 7).
    let from_dot_git = env
        .sessionctl(&["session", "create", "--repo", "-q"], &repo.join(".git"))
        .trim()
        .to_owned();
    let status = env.sessionctl(&["session", "status", &from_dot_git], &repo);
    assert!(
        status.contains(&format!("repository        {} (base main", repo.display())),
        "{status}"
    );
    env.sessionctl(&["session", "delete", &from_dot_git], &repo);

    env.sessionctl(&["send", &session, "/edit notes.txt from the agent"], &repo);
    let diff = env.sessionctl(&["workspace", "git-diff", "--base", &session], &repo);
    assert!(
        diff.contains("-original") && diff.contains("+from the agent"),
        "{diff}"
    );
    assert_eq!(
        std::fs::read_to_string(repo.join("notes.txt")).unwrap(),
        "original\n",
        "the repository's own checkout is untouched"
    );
    let commits = env.sessionctl(&["workspace", "commits", &session], &repo);
    assert!(
        commits.contains(&format!("no commits on {branch} since main")),
        "{commits}"
    );

    let (_, stderr, _) = env.sessionctl_fails(&["session", "delete", &session], &repo);
    assert!(
        stderr.contains("1 file(s) with uncommitted changes (notes.txt)"),
        "{stderr}"
    );
    assert!(worktree.join("notes.txt").is_file(), "nothing lost");
    env.sessionctl(&["session", "delete", "--discard", &session], &repo);
    assert!(!worktree.exists());
    // Merged into main (no commits of its own): the branch went too.
    assert_eq!(git(&repo, &["branch", "--format=%(refname:short)"]), "main");

    terminate(server);
    for pid in agentctls_under(env.home.path()) {
        let _ = Command::new("kill").args(["-KILL", &pid]).status();
    }
}

/// `sessiond serve --data-dir data`: a relative data directory is the
/// server's working directory's, though agentctl runs in the session's
/// directory (it once looked for its run files there and exited).
#[test]
fn a_relative_data_dir_is_taken_from_where_the_server_started() {
    let mut env = Env::new();
    let scratch = env.home.path().join("project");
    std::fs::create_dir_all(&scratch).unwrap();
    let server = env.serve_in(env.home.path(), &[("SESSIOND_DATA_DIR", "state")]);
    env.sessionctl(&["health", "--wait"], &scratch);
    let task = env.sessionctl(&["task", "create", "relative", "-q"], &scratch);
    env.task = Some(task.trim().to_owned());
    let session = env.sessionctl(&["session", "create", "-q"], &scratch);
    let reply = env.sessionctl(&["send", session.trim(), "hello"], &scratch);
    assert!(reply.contains("you said \"hello\""), "{reply}");
    assert!(env.home.path().join("state/sessiond.sqlite3").is_file());
    assert!(!scratch.join("state").exists());
    terminate(server);
    for pid in agentctls_under(env.home.path()) {
        let _ = Command::new("kill").args(["-KILL", &pid]).status();
    }
}

/// `sessionctl task list | head -1`: a reader that leaves early ends
/// sessionctl quietly (SIGPIPE, as for any Unix tool), never with a panic
/// on stderr. The pipe's read end is closed before sessionctl writes.
#[test]
fn output_into_a_closed_pipe_ends_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let env = Env::new();
    let scratch = env.home.path().join("pipe");
    std::fs::create_dir_all(&scratch).unwrap();
    let server = env.serve();
    env.sessionctl(&["health", "--wait"], &scratch);
    for i in 0..3 {
        env.sessionctl(&["task", "create", &format!("task {i}"), "-q"], &scratch);
    }
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let mut cmd = Command::new("sessionctl");
    env.apply(&mut cmd);
    let out = cmd
        .args(["task", "list"])
        .current_dir(&scratch)
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(out.status.signal(), Some(13), "{:?}: {stderr}", out.status);
    terminate(server);
}

/// `send` ends at once, with a non-zero exit and the system message, when
/// the turn fails, the agent crashes in the middle of it, or it is
/// cancelled (never after its timeout: 120 s given, each ends in well under
/// 60 s); `send` and `resume` agree about what to do next; `session create`
/// exits non-zero when the new session is ERROR.
#[test]
fn sessionctl_stops_at_once_on_failed_interrupted_and_cancelled_turns() {
    let mut env = Env::new();
    let scratch = env.home.path().join("turns");
    std::fs::create_dir_all(&scratch).unwrap();
    let config = env.home.path().join("sessiond.toml");
    let demo = bin("acp-demo-agent");
    let state = env.home.path().join("demo-state");
    std::fs::write(
        &config,
        format!(
            "[[agents]]\nname = \"crashy\"\ncommand = \"{}\"\nargs = [\"--crash-mid-turn\", \"1\"]\n\
             env = {{ ACP_DEMO_STATE_DIR = \"{}\" }}\n\
             [[agents]]\nname = \"locked\"\ncommand = \"{}\"\nargs = [\"--require-auth\"]\n",
            demo.display(),
            state.display(),
            demo.display()
        ),
    )
    .unwrap();
    let config = config.display().to_string();
    let server = env.serve_with(&[("SESSIOND_CONFIG", &config)]);
    env.sessionctl(&["health", "--wait"], &scratch);
    let task = env
        .sessionctl(&["task", "create", "turns", "-q"], &scratch)
        .trim()
        .to_owned();
    env.task = Some(task);

    // An ERROR session is not a success.
    let (stdout, stderr, _) =
        env.sessionctl_fails(&["session", "create", "--agent", "locked"], &scratch);
    assert!(stdout.contains("ERROR"), "{stdout}");
    assert!(stderr.contains("is ERROR"), "{stderr}");
    assert!(stderr.contains("auth_method"), "{stderr}");

    // A failed turn (the agent answers the prompt with an error).
    let session = env
        .sessionctl(&["session", "create", "-q"], &scratch)
        .trim()
        .to_owned();
    let (_, stderr, took) = env.sessionctl_fails(
        &["send", &session, "/fail", "--timeout-secs", "120"],
        &scratch,
    );
    assert!(took < Duration::from_secs(60), "{took:?}");
    assert!(stderr.contains("the turn ended error"), "{stderr}");
    assert!(stderr.contains("fails on purpose"), "{stderr}");
    // The session goes on.
    let reply = env.sessionctl(&["send", &session, "next"], &scratch);
    assert!(reply.contains("you said \"next\""), "{reply}");

    // A cancelled turn: `send` of a long turn, cancelled from another shell.
    let mut cmd = Command::new("sessionctl");
    env.apply(&mut cmd);
    let started = Instant::now();
    let send = cmd
        .args(["send", &session, "/long", "--timeout-secs", "120"])
        .current_dir(&scratch)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until part of the reply is stored, then cancel.
    loop {
        let m = env.sessionctl(&["messages", &session], &scratch);
        // [1] /fail, [2] its system note, [3] next, [4] reply, [5] /long.
        if m.contains("[6] agent: turn 2 ") {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(50), "{m}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = env.sessionctl(&["cancel", &session], &scratch);
    assert!(out.contains("cancel requested"), "{out}");
    let out = send.wait_with_output().unwrap();
    let took = started.elapsed();
    assert!(!out.status.success());
    assert!(took < Duration::from_secs(60), "{took:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // `/fail` stored no turn in the agent: `next` was its turn 1.
    assert!(stdout.contains("turn 2 "), "the reply so far: {stdout}");
    assert!(stderr.contains("the turn ended cancelled"), "{stderr}");
    let (_, stderr, _) = env.sessionctl_fails(&["cancel", &session], &scratch);
    assert!(stderr.contains("no turn is in progress"), "{stderr}");

    // The agent crashes in the middle of the turn: interrupted, at once.
    let crashy = env
        .sessionctl(&["session", "create", "--agent", "crashy", "-q"], &scratch)
        .trim()
        .to_owned();
    let (stdout, stderr, took) = env.sessionctl_fails(
        &["send", &crashy, "boom", "--timeout-secs", "120"],
        &scratch,
    );
    assert!(took < Duration::from_secs(60), "{took:?}");
    assert!(stdout.contains("turn 1 "), "the partial reply: {stdout}");
    assert!(stderr.contains("the turn ended interrupted"), "{stderr}");
    // The agent is restarted by itself, its conversation resumed; an
    // explicit resume meanwhile joins that, or answers as it is.
    let resumed = env.sessionctl(&["session", "resume", &crashy], &scratch);
    assert!(resumed.contains("WAITING_FOR_INPUT"), "{resumed}");
    let status = env.sessionctl(&["session", "status", &crashy], &scratch);
    assert!(status.contains("WAITING_FOR_INPUT"), "{status}");

    // Session modes: listed in the status, switched with `mode`.
    let status = env.sessionctl(&["session", "status", &session], &scratch);
    assert!(
        status.contains("modes             default (of default, plan)"),
        "{status}"
    );
    let out = env.sessionctl(&["mode", &session, "plan"], &scratch);
    assert!(out.contains("mode plan (of default, plan)"), "{out}");
    let (_, stderr, _) = env.sessionctl_fails(&["mode", &session, "fast"], &scratch);
    assert!(stderr.contains("default, plan"), "{stderr}");

    env.sessionctl(&["session", "stop", &session], &scratch);
    env.sessionctl(&["session", "stop", &crashy], &scratch);
    terminate(server);
    for pid in agentctls_under(env.home.path()) {
        let _ = Command::new("kill").args(["-KILL", &pid]).status();
    }
}

/// `send` prints the agent's activity on stderr as it streams (each change
/// of a part: the tool call pending, then completed), the reply on stdout;
/// `messages` lists the same parts.
#[test]
fn send_prints_tool_calls_and_plans_as_they_stream() {
    let (env, scratch, server, session) = Env::with_session("activity", "activity");

    let mut cmd = Command::new("sessionctl");
    env.apply(&mut cmd);
    let out = cmd
        .args(["send", &session, "/activity"])
        .current_dir(&scratch)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("activity: sent"), "the reply: {stdout}");
    assert!(
        !stdout.contains("[tool"),
        "activity stays off stdout: {stdout}"
    );
    let started = stderr
        .find("[tool edit] edit notes.txt: in_progress")
        .unwrap_or_else(|| panic!("the tool call as it started: {stderr}"));
    let done = stderr
        .find("[tool edit] edit notes.txt: completed (diff notes.txt)")
        .unwrap_or_else(|| panic!("the tool call completed: {stderr}"));
    assert!(started < done, "{stderr}");
    assert!(
        stderr.contains("[plan]\n  [completed] read the file\n  [in_progress] edit the file"),
        "{stderr}"
    );
    assert!(stderr.contains("[thought] thinking about it"), "{stderr}");
    assert!(stderr.contains("[mode] plan"), "{stderr}");

    let messages = env.sessionctl(&["messages", &session], &scratch);
    assert!(
        messages.contains("[tool edit] edit notes.txt: completed (diff notes.txt)"),
        "{messages}"
    );

    // A command's raw input and output (what Codex reports, and only
    // there): the command and its cwd, the exit code, the output's end.
    let ran = "[tool execute] run the tests: failed\n  $ sh -c make test  (in /demo/work)\n  \
               exit 3\n  ...\n  test 1992 ok\n";
    let mut cmd = Command::new("sessionctl");
    env.apply(&mut cmd);
    let out = cmd
        .args(["send", &session, "/run"])
        .current_dir(&scratch)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains(ran), "{stderr}");
    assert!(
        stderr.contains("test 2000 ok\n  FAILED: 2 tests\n"),
        "{stderr}"
    );
    let messages = env.sessionctl(&["messages", &session], &scratch);
    assert!(messages.contains(ran), "{messages}");
    let json = env.sessionctl(&["messages", &session, "--json"], &scratch);
    let tool = json
        .lines()
        .chain(std::iter::once(json.as_str()))
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .flat_map(|v| match v {
            serde_json::Value::Array(a) => a,
            v => vec![v],
        })
        .find(|m| m.to_string().contains("demo-run-1"))
        .unwrap_or_else(|| panic!("the tool call in --json: {json}"));
    let raw = tool.to_string();
    assert!(
        raw.contains("\"exit_code\":3") && raw.contains("bytes cut"),
        "{raw}"
    );
    assert!(raw.len() < 16 * 1024, "stored bounded: {} bytes", raw.len());

    env.sessionctl(&["session", "stop", &session], &scratch);
    terminate(server);
    for pid in agentctls_under(env.home.path()) {
        let _ = Command::new("kill").args(["-KILL", &pid]).status();
    }
}

#[test]
fn watch_resumes_from_the_last_seq_after_the_server_restarts() {
    let (env, scratch, server, session) = Env::with_session("w", "watch");
    env.sessionctl(&["send", &session, "one"], &scratch);

    // A watcher that outlives a server restart.
    let mut cmd = Command::new("sessionctl");
    env.apply(&mut cmd);
    let mut watcher = cmd
        .args(["--json", "watch", "--session", &session])
        .current_dir(&scratch)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::<i64>::new()));
    let reader = {
        let lines = lines.clone();
        let stdout = watcher.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let v: serde_json::Value = serde_json::from_str(&line.unwrap()).unwrap();
                lines.lock().unwrap().push(v["seq"].as_i64().unwrap());
            }
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(800));
    let before_restart = lines.lock().unwrap().len();
    assert!(before_restart > 0);
    terminate(server);
    let server = env.serve();
    env.sessionctl(&["health", "--wait"], &scratch);
    env.sessionctl(&["send", &session, "two"], &scratch);
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let _ = watcher.kill();
    let _ = watcher.wait();
    reader.join().unwrap();
    let seqs = lines.lock().unwrap().clone();
    assert!(seqs.len() > before_restart + 3, "{seqs:?}");
    assert_eq!(
        seqs,
        (1..=seqs.len() as i64).collect::<Vec<_>>(),
        "no gap, no duplicate"
    );

    env.sessionctl(&["session", "stop", &session], &scratch);
    terminate(server);
    for pid in agentctls_under(env.home.path()) {
        let _ = Command::new("kill").args(["-KILL", &pid]).status();
    }
}

/// `send S -` reads the prompt from stdin: one longer than a command line
/// can carry (helper-21 #11) reaches the agent whole.
#[test]
fn send_reads_a_long_prompt_from_stdin() {
    let (env, scratch, server, session) = Env::with_session("i", "stdin");
    let prompt = format!("{}END", "x".repeat(300 * 1024));
    let mut child = env.spawn_sessionctl(&["send", &session, "-"], &scratch);
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), prompt.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("xxxxEND\""),
        "{}",
        &stdout[..stdout.len().min(200)]
    );
    terminate(server);
}

/// `watch --task` numbers its lines by `task_seq`, the cursor its
/// `--after-seq` takes, and labels sessions by their ids' random tail
/// (helper-21 #6).
#[test]
fn a_task_watch_numbers_lines_by_the_cursor_it_resumes_from() {
    let (env, scratch, server, first) = Env::with_session("t", "task-watch");
    env.sessionctl(&["send", &first, "one"], &scratch);
    let second = env
        .sessionctl(&["session", "create", "-q"], &scratch)
        .trim()
        .to_owned();
    env.sessionctl(&["send", &second, "two"], &scratch);
    let task = env.task.clone().unwrap();
    // Lines of `watch --task` up to the first of `until`'s session.
    let lines_until = |extra: &[&str], until: &str| {
        let args = [&["watch", "--task", task.as_str()][..], extra].concat();
        let mut child = env.spawn_sessionctl(&args, &scratch);
        let mut got = Vec::new();
        for line in BufReader::new(child.stdout.take().unwrap()).lines() {
            let line = line.unwrap();
            let label = line.split_whitespace().nth(1).unwrap().to_owned();
            got.push((
                line.split_whitespace()
                    .next()
                    .unwrap()
                    .parse::<i64>()
                    .unwrap(),
                label,
            ));
            if got.last().unwrap().1 == until[until.len() - 8..] {
                break;
            }
        }
        let _ = child.kill();
        let _ = child.wait();
        got
    };
    let lines = lines_until(&[], &second);
    let numbers: Vec<i64> = lines.iter().map(|(n, _)| *n).collect();
    assert_eq!(
        numbers,
        (1..=lines.len() as i64).collect::<Vec<_>>(),
        "{lines:?}"
    );
    assert_eq!(lines[0].1, first[first.len() - 8..], "{lines:?}");
    // Resuming from the last line of the first session: the second's next.
    let from = (lines.len() - 1).to_string();
    let after = lines_until(&["--after-seq", &from], &second);
    assert_eq!(after, lines[lines.len() - 1..], "{after:?}");
    terminate(server);
}

/// A `send` waiting behind the running turn ends as soon as its queued
/// message will not be sent: taken off the queue (`unqueue`), or dropped
/// as the session is stopped, saying so; never waits out its timeout
/// (helper-21 #2).
#[test]
fn a_waiting_send_whose_queued_message_will_not_be_sent_ends_saying_so() {
    let (env, scratch, server, session) = Env::with_session("q", "queue");
    env.sessionctl(&["send", "--no-wait", &session, "/long story"], &scratch);
    let waiting_send_to = |session: &str, text: &str| {
        let mut child = env.spawn_sessionctl(
            &["--json", "send", "--timeout-secs", "90", session, text],
            &scratch,
        );
        let mut line = String::new();
        BufReader::new(child.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        let v: serde_json::Value = serde_json::from_str(&line).expect(&line);
        let id = v["queued"]["id"].as_str().expect("queued").to_owned();
        (child, id)
    };
    let waiting_send = |text: &str| waiting_send_to(&session, text);
    let ended = |child: Child| {
        let out = child.wait_with_output().unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };

    let (child, id) = waiting_send("first");
    env.sessionctl(&["unqueue", &session, &id], &scratch);
    let stderr = ended(child);
    assert!(
        stderr.contains(&format!("your queued message {id} was not sent"))
            && stderr.contains("taken off the queue"),
        "{stderr}"
    );

    let (child, id) = waiting_send("second");
    env.sessionctl(&["session", "stop", &session], &scratch);
    let stderr = ended(child);
    assert!(
        stderr.contains(&format!("your queued message {id} was not sent"))
            && stderr.contains("the session ended"),
        "{stderr}"
    );

    // Held behind a turn its agent's death interrupted: said at once too.
    let session = env
        .sessionctl(&["session", "create", "-q"], &scratch)
        .trim()
        .to_owned();
    env.sessionctl(&["send", "--no-wait", &session, "/long story"], &scratch);
    let (child, id) = waiting_send_to(&session, "third");
    let agentctls = agentctls_under(env.home.path());
    assert_eq!(agentctls.len(), 1, "{agentctls:?}");
    // Its agent: a child of whichever of agentctl's threads spawned it.
    let mut agents = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{}/task", agentctls[0])).unwrap() {
        let children = std::fs::read_to_string(task.unwrap().path().join("children"));
        agents.extend(
            children
                .unwrap_or_default()
                .split_whitespace()
                .map(str::to_owned),
        );
    }
    assert!(
        !agents.is_empty(),
        "no agent under agentctl {}",
        agentctls[0]
    );
    for pid in &agents {
        Command::new("kill").args(["-KILL", pid]).status().unwrap();
    }
    let stderr = ended(child);
    assert!(
        stderr.contains(&format!(
            "before your queued message {id} ended interrupted"
        )) && stderr.contains("sessionctl retry"),
        "{stderr}"
    );
    terminate(server);
}

/// A session of a demo agent whose start waits at a gate file, after a
/// turn, a stop of sessiond, a kill of its agentctl and a start again
/// with the gate closed: sessiond is bringing its agent back, held at the
/// gate. `agent_env`: more of the agent's environment (TOML pairs).
/// Returns the server, the session, the gate and the working directory.
fn held_back_at_its_gate(env: &mut Env, agent_env: &str) -> (Served, String, PathBuf, PathBuf) {
    let scratch = env.home.path().join("back");
    std::fs::create_dir_all(&scratch).unwrap();
    let config = env.home.path().join("sessiond.toml");
    let gate = env.home.path().join("start-gate");
    std::fs::write(
        &config,
        format!(
            "[recovery]\nexecutor_deadline = \"120s\"\n\
             [[agents]]\nname = \"gated\"\ncommand = \"{}\"\n\
             env = {{ ACP_DEMO_STATE_DIR = \"{}\", ACP_DEMO_START_GATE_FILE = \"{}\"{agent_env} }}\n",
            bin("acp-demo-agent").display(),
            env.home.path().join("demo-state").display(),
            gate.display()
        ),
    )
    .unwrap();
    let config = config.display().to_string();
    let server = env.serve_with(&[("SESSIOND_CONFIG", &config)]);
    env.sessionctl(&["health", "--wait"], &scratch);
    let task = env
        .sessionctl(&["task", "create", "back", "-q"], &scratch)
        .trim()
        .to_owned();
    env.task = Some(task);
    let session = env
        .sessionctl(&["session", "create", "--agent", "gated", "-q"], &scratch)
        .trim()
        .to_owned();
    env.sessionctl(&["send", &session, "one"], &scratch);

    // sessiond stops, its agentctl is killed (the agent with it): the
    // restart relaunches the agent, which waits at the gate.
    terminate(server);
    for pid in agentctls_under(env.home.path()) {
        Command::new("kill").args(["-KILL", &pid]).status().unwrap();
    }
    std::fs::write(&gate, b"closed").unwrap();
    let server = env.serve_with(&[("SESSIOND_CONFIG", &config)]);
    env.sessionctl(&["health", "--wait"], &scratch);
    (server, session, gate, scratch)
}

/// After a restart, a `send` to a session whose agent sessiond is still
/// bringing back (held at its start gate) is queued at once. If the agent
/// then cannot come back (it refuses to reopen the conversation), the
/// waiting `send` ends saying the message stays queued for a resume; it
/// does not wait out its timeout.
#[test]
fn a_send_queued_while_the_agent_comes_back_ends_when_it_cannot() {
    let mut env = Env::new();
    let (server, session, gate, scratch) =
        held_back_at_its_gate(&mut env, ", ACP_DEMO_FAIL_LOAD = \"1\"");
    let mut send = env.spawn_sessionctl(
        &["--json", "send", "--timeout-secs", "90", &session, "two"],
        &scratch,
    );
    let mut line = String::new();
    BufReader::new(send.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    let v: serde_json::Value = serde_json::from_str(&line).expect(&line);
    let id = v["queued"]["id"].as_str().expect("queued").to_owned();
    assert!(gate.exists(), "queued while the agent waits at its gate");

    std::fs::remove_file(&gate).unwrap();
    let out = send.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "the session went ERROR before your queued message {id} was sent"
        )) && stderr.contains("stays queued")
            && stderr.contains("session resume"),
        "{stderr}"
    );
    let status = env.sessionctl(&["--json", "session", "status", &session], &scratch);
    assert!(status.contains(&id), "still queued: {status}");

    env.sessionctl(&["session", "stop", &session], &scratch);
    terminate(server);
    for pid in agentctls_under(env.home.path()) {
        let _ = Command::new("kill").args(["-KILL", &pid]).status();
    }
}

/// `--timeout-secs` bounds a `send` whose call waits for the session's
/// agent (held at its start gate after a restart), saying so; the send,
/// received by sessiond, still goes once the agent is back (helper-60 F2:
/// the call's wait was not bounded, and a client that gave up dropped it).
#[test]
fn a_send_timeout_bounds_the_wait_for_an_agent_and_the_send_still_goes() {
    let mut env = Env::new();
    let (server, session, gate, scratch) = held_back_at_its_gate(&mut env, "");
    // Not queueable: the call waits for the agent.
    let (_, stderr, _) = env.sessionctl_fails(
        &["send", "--no-queue", "--timeout-secs", "2", &session, "two"],
        &scratch,
    );
    assert!(
        stderr.contains("timed out after 2 s before sessiond answered")
            && stderr.contains("--request-id"),
        "{stderr}"
    );
    assert!(gate.exists(), "answered while the agent waits at its gate");

    std::fs::remove_file(&gate).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let msgs = env.sessionctl(&["messages", &session], &scratch);
        if msgs.contains("you said \"two\"") {
            break;
        }
        assert!(Instant::now() < deadline, "the send did not go: {msgs}");
        std::thread::sleep(Duration::from_millis(100));
    }
    env.sessionctl(&["session", "stop", &session], &scratch);
    terminate(server);
    for pid in agentctls_under(env.home.path()) {
        let _ = Command::new("kill").args(["-KILL", &pid]).status();
    }
}

/// `--worktree ../x` names the directory beside the working one: the
/// server, which refuses `.` and `..` in a path, gets its plain path
/// (helper-62 3: "is not normalised").
#[test]
fn a_worktree_named_with_dot_dot_is_the_directory_it_names() {
    let (env, scratch, server, _) = Env::with_session("dots", "dots");
    let beside = env.home.path().join("beside");
    std::fs::create_dir_all(&beside).unwrap();
    let session = env
        .sessionctl(
            &["session", "create", "--worktree", "./../beside", "-q"],
            &scratch,
        )
        .trim()
        .to_owned();
    let status = env.sessionctl(&["--json", "session", "status", &session], &scratch);
    let v: serde_json::Value = serde_json::from_str(status.trim()).expect(&status);
    assert_eq!(v["worktree_path"], beside.display().to_string(), "{status}");
    env.sessionctl(&["session", "stop", &session], &scratch);
    terminate(server);
}

/// A call cut off by sessiond's death says what happened and that its
/// outcome is unknown, not a bare "transport error (Unknown)".
#[test]
fn a_call_cut_off_by_a_dying_server_says_its_outcome_is_unknown() {
    let (env, scratch, mut server, session) = Env::with_session("x", "cut");
    let marker = scratch.join("exec-started");
    let script = format!("touch {}; sleep 60", marker.display());
    let exec = env.spawn_sessionctl(
        &["workspace", "exec", &session, "--", "sh", "-c", &script],
        &scratch,
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while !marker.exists() {
        assert!(Instant::now() < deadline, "the exec never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    server.kill().unwrap();
    server.wait().unwrap();
    let out = exec.wait_with_output().unwrap();
    for pid in agentctls_under(env.home.path()) {
        let _ = Command::new("kill").args(["-KILL", &pid]).status();
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "the connection to sessiond at {} was lost during the call",
            env.addr
        )) && stderr.contains("whether the call took effect is unknown"),
        "{stderr}"
    );
    assert!(!stderr.contains("(Unknown)"), "{stderr}");
}

/// `send --request-id` run again answers with the first run's message
/// (its id) and the agent runs it once; the key with another text is
/// refused, saying why.
#[test]
fn a_send_repeated_with_its_request_id_runs_once() {
    let (env, scratch, server, session) = Env::with_session("k", "keyed");
    let send_keyed = |text: &str| -> serde_json::Value {
        let out = env.sessionctl(
            &[
                "--json",
                "send",
                "--no-wait",
                "--request-id",
                "key-1",
                &session,
                text,
            ],
            &scratch,
        );
        let v: serde_json::Value = serde_json::from_str(out.trim()).expect(&out);
        v[0].clone()
    };
    let first = send_keyed("hello once");
    let again = send_keyed("hello once");
    assert_eq!(first["role"], "user", "{first}");
    assert_eq!(first["id"], again["id"], "{first} {again}");
    let (_, stderr, _) = env.sessionctl_fails(
        &["send", "--request-id", "key-1", &session, "not the same"],
        &scratch,
    );
    assert!(
        stderr.contains("request_id") && stderr.contains("different message"),
        "{stderr}"
    );
    // The next message is the agent's second turn: the first ran once.
    let reply = env.sessionctl(&["send", &session, "next"], &scratch);
    assert!(
        reply.contains("turn 2") && reply.contains("you said \"next\""),
        "{reply}"
    );
    terminate(server);
}

/// `send` follows its turn through a restart of sessiond: the reply keeps
/// streaming to stdout once sessiond is back (from where it was, nothing
/// twice), and the turn's end still ends the command.
#[test]
fn send_follows_its_turn_through_a_restart() {
    let (env, scratch, server, session) = Env::with_session("s", "follow");

    // A reply that streams for a minute, followed by `send`.
    let mut cmd = Command::new("sessionctl");
    env.apply(&mut cmd);
    let mut send = cmd
        .args(["send", &session, "/long story"])
        .current_dir(&scratch)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let shown = std::sync::Arc::new(std::sync::Mutex::new(Vec::<u8>::new()));
    let reader = {
        let shown = shown.clone();
        let mut stdout = send.stdout.take().unwrap();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            loop {
                match std::io::Read::read(&mut stdout, &mut buf) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => shown.lock().unwrap().extend_from_slice(&buf[..n]),
                }
            }
        })
    };
    let grown_past = |n: usize| {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let len = shown.lock().unwrap().len();
            if len > n {
                return len;
            }
            assert!(
                Instant::now() < deadline,
                "the reply stopped at {len} bytes"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let before = grown_past(0);
    terminate(server);
    let server = env.serve();
    env.sessionctl(&["health", "--wait"], &scratch);
    // More of the reply arrives through the new stream, then the turn ends.
    let after_restart = shown.lock().unwrap().len();
    grown_past(after_restart.max(before));
    env.sessionctl(&["cancel", &session], &scratch);
    let status = send.wait().unwrap();
    reader.join().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(send.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert!(!status.success(), "a cancelled turn is an error: {stderr}");
    assert!(stderr.contains("reconnecting"), "{stderr}");
    assert!(stderr.contains("cancelled"), "{stderr}");
    // What was printed is the stored reply's beginning: nothing twice.
    let printed = String::from_utf8(shown.lock().unwrap().clone()).unwrap();
    let stored = env.sessionctl(&["--json", "messages", &session], &scratch);
    let v: serde_json::Value = serde_json::from_str(&stored).unwrap();
    let reply = v
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["role"] == "AGENT" || m["role"] == "agent")
        .map(|m| m["content"].as_str().unwrap().to_owned())
        .unwrap_or_else(|| panic!("{stored}"));
    assert!(
        reply.starts_with(printed.trim_end()),
        "printed {printed:?}\nstored {reply:?}"
    );

    env.sessionctl(&["session", "stop", &session], &scratch);
    terminate(server);
    for pid in agentctls_under(env.home.path()) {
        let _ = Command::new("kill").args(["-KILL", &pid]).status();
    }
}

/// A profile with permission policy `ask`: `send --approve` allows the
/// agent's tool call (the file is written), `send --deny` rejects it (not
/// written, the reply says so), `send` with no terminal and no flag stops
/// at once naming the request and how to answer it, `session status` lists
/// it, `sessionctl permission` answers it, and on a terminal `send` asks.
#[test]
fn sessionctl_answers_permission_requests() {
    let mut env = Env::new();
    let scratch = env.home.path().join("perm");
    std::fs::create_dir_all(&scratch).unwrap();
    let config = env.home.path().join("sessiond.toml");
    std::fs::write(
        &config,
        format!(
            "[[agents]]\nname = \"asker\"\ncommand = \"{}\"\npermission_policy = \"ask\"\n\
             env = {{ ACP_DEMO_STATE_DIR = \"{}\" }}\n",
            bin("acp-demo-agent").display(),
            env.home.path().join("demo-state").display()
        ),
    )
    .unwrap();
    let config = config.display().to_string();
    let server = env.serve_with(&[("SESSIOND_CONFIG", &config)]);
    env.sessionctl(&["health", "--wait"], &scratch);
    let task = env
        .sessionctl(&["task", "create", "permissions", "-q"], &scratch)
        .trim()
        .to_owned();
    env.task = Some(task);
    let session = env
        .sessionctl(&["session", "create", "--agent", "asker", "-q"], &scratch)
        .trim()
        .to_owned();

    // --approve: allowed, the tool runs; the tool call and the request are
    // printed as they stream.
    let mut cmd = Command::new("sessionctl");
    env.apply(&mut cmd);
    let out = cmd
        .args(["send", &session, "/edit yes.txt approved", "--approve"])
        .current_dir(&scratch)
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("edit: written"), "{stdout}");
    assert!(stderr.contains("[tool edit] write yes.txt"), "{stderr}");
    assert!(
        stderr.contains("[permission] write yes.txt: pending"),
        "{stderr}"
    );
    assert!(stderr.contains("[permission] selected allow"), "{stderr}");
    assert_eq!(
        std::fs::read_to_string(scratch.join("yes.txt")).unwrap(),
        "approved"
    );

    // --deny: rejected, not run, and the reply says so.
    let reply = env.sessionctl(
        &["send", &session, "/edit no.txt denied", "--deny"],
        &scratch,
    );
    assert!(reply.contains("not allowed (reject)"), "{reply}");
    assert!(!scratch.join("no.txt").exists());

    // No terminal, no flag: it stops at once instead of hanging.
    let (_, stderr, took) =
        env.sessionctl_fails(&["send", &session, "/edit later.txt x"], &scratch);
    assert!(took < Duration::from_secs(60), "{took:?}");
    assert!(stderr.contains("stdin is not a terminal"), "{stderr}");
    assert!(stderr.contains("--approve or --deny"), "{stderr}");
    // The request still waits: listed, and answered from another command.
    let status = env.sessionctl(&["session", "status", &session], &scratch);
    let line = status
        .lines()
        .find(|l| l.starts_with("permission "))
        .unwrap_or_else(|| panic!("{status}"));
    assert!(
        line.contains("write later.txt: allow (allow_once), reject (reject_once)"),
        "{line}"
    );
    let request = line.split_whitespace().nth(1).unwrap().to_owned();
    assert!(stderr.contains(&request), "{stderr}");
    let (_, err, _) = env.sessionctl_fails(&["permission", &session, &request, "maybe"], &scratch);
    assert!(
        err.contains("it offers: allow (allow_once), reject (reject_once)"),
        "{err}"
    );
    let out = env.sessionctl(&["permission", &session, &request, "allow"], &scratch);
    assert!(
        out.contains(&format!("permission request {request} answered allow")),
        "{out}"
    );
    let started = Instant::now();
    while !env
        .sessionctl(&["session", "status", &session], &scratch)
        .contains("WAITING_FOR_INPUT")
    {
        assert!(started.elapsed() < Duration::from_secs(60));
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        std::fs::read_to_string(scratch.join("later.txt")).unwrap(),
        "x"
    );
    let (_, err, _) = env.sessionctl_fails(&["permission", &session, &request, "allow"], &scratch);
    assert!(err.contains("answered already"), "{err}");

    // On a terminal (`script` gives it one), `send` asks; "2" is reject.
    let mut cmd = Command::new("script");
    env.apply(&mut cmd);
    let line = format!("sessionctl send {session} '/edit tty.txt t'; echo exit=$?");
    let mut child = cmd
        .args(["-qec", &line, "/dev/null"])
        .current_dir(&scratch)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Typed ahead: the terminal holds the line until `send` asks. stdin
    // stays open until `script` is done (its end would end the session).
    let mut stdin = child.stdin.take().unwrap();
    {
        use std::io::Write;
        stdin.write_all(b"2\n").unwrap();
    }
    let out = child.wait_with_output().unwrap();
    drop(stdin);
    let tty = String::from_utf8_lossy(&out.stdout);
    assert!(
        tty.contains("the agent asks permission: write tty.txt"),
        "{tty}"
    );
    assert!(tty.contains("2) Reject [reject_once]"), "{tty}");
    assert!(tty.contains("not allowed (reject)"), "{tty}");
    assert!(tty.contains("exit=0"), "{tty}");
    assert!(!scratch.join("tty.txt").exists());

    env.sessionctl(&["session", "stop", &session], &scratch);
    terminate(server);
    for pid in agentctls_under(env.home.path()) {
        let _ = Command::new("kill").args(["-KILL", &pid]).status();
    }
}

/// The Docker engine and image `cargo xtask ci` provides; a test that needs
/// them fails naming what is missing.
fn docker_env() -> (String, String) {
    let host = std::env::var("DOCKER_HOST").unwrap_or_else(|_| {
        panic!("DOCKER_HOST is not set: run `cargo xtask ci` or `cargo xtask docker-tests`")
    });
    let image =
        std::env::var("SESSIOND_DOCKER_IMAGE").unwrap_or_else(|_| "sessiond-agentctl:dev".into());
    (host, image)
}

/// `sessionctl session create --runtime local_docker` with the default
/// (`demo`) profile: its container command starts in the default image,
/// answers, and its conversation survives a container stop (resume loads it
/// from the agent's HOME in the run directory). A profile that names only a
/// host command fails at create, the error naming the profile, the image
/// and the command.
#[test]
#[ignore = "needs Docker: run by cargo xtask ci"]
fn docker_session_with_the_default_profile() {
    let (host, image) = docker_env();
    let mut env = Env::new();
    let scratch = env.home.path().join("dk");
    std::fs::create_dir_all(&scratch).unwrap();
    // Containers run as the worktree's owner, never as root (the tests run
    // as root).
    std::os::unix::fs::chown(&scratch, Some(1000), Some(1000)).unwrap();
    let config = env.home.path().join("sessiond.toml");
    std::fs::write(
        &config,
        "[[agents]]\nname = \"host-only\"\ncommand = \"/opt/host-only/agent\"\n",
    )
    .unwrap();
    let server = env.serve_with(&[
        ("SESSIOND_CONFIG", config.to_str().unwrap()),
        ("SESSIOND_DOCKER_ENABLED", "true"),
        ("SESSIOND_DOCKER_HOST", &host),
        ("SESSIOND_DOCKER_IMAGE", &image),
    ]);
    env.sessionctl(&["health", "--wait"], &scratch);
    let task = env
        .sessionctl(&["task", "create", "Docker", "-q"], &scratch)
        .trim()
        .to_owned();
    env.task = Some(task);

    let session = env
        .sessionctl(
            &["session", "create", "--runtime", "local_docker", "-q"],
            &scratch,
        )
        .trim()
        .to_owned();
    let status = env.sessionctl(&["session", "status", &session], &scratch);
    assert!(status.contains("WAITING_FOR_INPUT"), "{status}");
    let reply = env.sessionctl(&["send", &session, "hello"], &scratch);
    assert!(
        reply.contains("turn 1") && reply.contains("you said \"hello\""),
        "{reply}"
    );
    // The server stops, the container too; the next server starts the
    // container again and a new agent in it loads the conversation.
    terminate(server);
    let docker = |args: &[&str]| {
        let out = Command::new("docker")
            .args(args)
            .env("DOCKER_HOST", &host)
            .output()
            .unwrap();
        assert!(out.status.success(), "docker {args:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    let label = format!("label=sessiond.session_id={session}");
    let container = docker(&["ps", "-q", "--filter", &label]);
    assert!(!container.is_empty(), "the session's container runs");
    docker(&["stop", "-t", "1", &container]);
    let server = env.serve_with(&[
        ("SESSIOND_CONFIG", config.to_str().unwrap()),
        ("SESSIOND_DOCKER_ENABLED", "true"),
        ("SESSIOND_DOCKER_HOST", &host),
        ("SESSIOND_DOCKER_IMAGE", &image),
    ]);
    env.sessionctl(&["health", "--wait"], &scratch);
    let status = env.sessionctl(&["session", "status", &session], &scratch);
    assert!(status.contains("WAITING_FOR_INPUT"), "{status}");
    let reply = env.sessionctl(&["send", &session, "again"], &scratch);
    assert!(reply.contains("turn 2"), "{reply}");

    // The session is created but ERROR: `session create` prints its id and
    // exits non-zero with the reason.
    let (stdout, stderr, _) = env.sessionctl_fails(
        &[
            "session",
            "create",
            "--runtime",
            "local_docker",
            "--agent",
            "host-only",
            "-q",
        ],
        &scratch,
    );
    let failed = stdout.trim().to_owned();
    assert!(
        stderr.contains("was created but is ERROR"),
        "{stdout}\n{stderr}"
    );
    let status = env.sessionctl(&["session", "status", &failed], &scratch);
    assert!(status.contains("ERROR"), "{status}");
    for part in [
        "profile \"host-only\"",
        &format!("image {image:?}"),
        "command \"/opt/host-only/agent\"",
    ] {
        assert!(status.contains(part), "the error names {part}: {status}");
    }

    for s in [&session, &failed] {
        env.sessionctl(&["session", "delete", s], &scratch);
    }
    terminate(server);
}

/// Usage and cost through sessionctl: `send` prints the turn's usage once,
/// after the reply (never `[usage_update]` lines in the middle of it),
/// `session status`, `session list` and `task get` show the totals, and
/// `messages` the turn's usage under its prompt.
#[test]
fn sessionctl_shows_usage_and_cost() {
    let mut env = Env::new();
    let scratch = env.home.path().join("usage");
    std::fs::create_dir_all(&scratch).unwrap();
    let config = env.home.path().join("sessiond.toml");
    std::fs::write(
        &config,
        format!(
            "[[agents]]\nname = \"metered\"\ncommand = \"{}\"\n\
             env = {{ ACP_DEMO_STATE_DIR = \"{}\", ACP_DEMO_USAGE = \"1\" }}\n",
            bin("acp-demo-agent").display(),
            env.home.path().join("demo-state").display()
        ),
    )
    .unwrap();
    let config = config.display().to_string();
    let server = env.serve_with(&[("SESSIOND_CONFIG", &config)]);
    env.sessionctl(&["health", "--wait"], &scratch);
    let task = env
        .sessionctl(&["task", "create", "usage", "-q"], &scratch)
        .trim()
        .to_owned();
    env.task = Some(task.clone());
    let session = env
        .sessionctl(&["session", "create", "--agent", "metered", "-q"], &scratch)
        .trim()
        .to_owned();

    for text in ["one", "two"] {
        let mut cmd = Command::new("sessionctl");
        env.apply(&mut cmd);
        let out = cmd
            .args(["send", &session, text])
            .current_dir(&scratch)
            .output()
            .unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(out.status.success(), "{stdout}\n{stderr}");
        assert!(!stdout.contains("usage") && !stderr.contains("usage_update"));
        assert_eq!(
            stderr
                .matches("[usage] 150 tokens (100 in, 50 out), context ")
                .count(),
            1,
            "{stderr}"
        );
        assert!(stderr.contains("/200000, cost 0.25 USD\n"), "{stderr}");
    }
    let status = env.sessionctl(&["session", "status", &session], &scratch);
    assert!(
        status.contains("usage             2 turns, 300 tokens (200 in, 100 out), cost 0.5 USD"),
        "{status}"
    );
    let list = env.sessionctl(&["session", "list"], &scratch);
    assert!(list.contains("300 tok 0.5 USD"), "{list}");
    let got = env.sessionctl(&["task", "get", &task], &scratch);
    assert!(
        got.contains("usage: 2 turns, 300 tokens (200 in, 100 out), cost 0.5 USD"),
        "{got}"
    );
    let messages = env.sessionctl(&["messages", &session], &scratch);
    assert_eq!(
        messages.matches("    [usage] 150 tokens").count(),
        2,
        "{messages}"
    );
    // stdout and stderr in one file (helper-51 5): the usage line starts a
    // line of its own, it ran on after the reply's text.
    let both = scratch.join("both.txt");
    let file = std::fs::File::create(&both).unwrap();
    let mut cmd = Command::new("sessionctl");
    env.apply(&mut cmd);
    let status = cmd
        .args(["send", &session, "third"])
        .current_dir(&scratch)
        .stdout(file.try_clone().unwrap())
        .stderr(file)
        .status()
        .unwrap();
    let text = std::fs::read_to_string(&both).unwrap();
    assert!(status.success(), "{text}");
    assert!(text.contains("\n[usage] 150 tokens"), "{text:?}");
    assert!(text.ends_with(" USD\n"), "{text:?}");

    env.sessionctl(&["session", "stop", &session], &scratch);
    terminate(server);
    for pid in agentctls_under(env.home.path()) {
        let _ = Command::new("kill").args(["-KILL", &pid]).status();
    }
}

/// A question the agent asks while `send` waits: the command the hint
/// prints answers it as printed, from a shell that has no default task.
#[test]
fn the_printed_answer_to_an_agents_question_works_as_printed() {
    let (env, scratch, server, session) = Env::with_session("ask", "questions");
    let mut send = env.spawn_sessionctl(&["send", &session, "/ask city"], &scratch);
    drop(send.stdin.take()); // not a terminal: the hint is printed
    let mut stderr = BufReader::new(send.stderr.take().unwrap());
    let mut hint = String::new();
    while !hint.contains("[question]") {
        hint.clear();
        assert!(
            stderr.read_line(&mut hint).unwrap() > 0,
            "send ended without asking"
        );
    }
    let printed = hint
        .split('`')
        .nth(1)
        .unwrap_or_else(|| panic!("no command in {hint:?}"));
    let args: Vec<String> = printed
        .split_whitespace()
        .skip(1) // sessionctl
        .map(|a| {
            if a == "JSON" {
                r#"{"city":"Lisbon"}"#.to_owned()
            } else {
                a.to_owned()
            }
        })
        .collect();
    let mut answer = Command::new("sessionctl");
    env.apply(&mut answer);
    let out = answer
        .env_remove("SESSIOND_TASK")
        .args(&args)
        .current_dir(&scratch)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the printed `{printed}` failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = send.wait_with_output().unwrap();
    let reply = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{reply}");
    assert!(reply.contains("Lisbon"), "{reply}");
    terminate(server);
}

/// `workspace exec` whose output is longer than what is kept says so on
/// stderr and exits 3 (it used to print the first 1 MiB and exit 0);
/// `--max-output-bytes` keeps more.
#[test]
fn a_cut_exec_output_is_said_and_is_not_a_success() {
    let (env, scratch, server, session) = Env::with_session("exec", "exec");
    let script = "head -c 2000000 /dev/zero | tr '\\0' a; echo; echo END";
    let run = |extra: &[&str]| {
        let mut cmd = Command::new("sessionctl");
        env.apply(&mut cmd);
        let mut args = vec!["workspace", "exec", &session];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--", "sh", "-c", script]);
        cmd.args(&args).current_dir(&scratch).output().unwrap()
    };
    let cut = run(&[]);
    let stderr = String::from_utf8_lossy(&cut.stderr);
    assert_eq!(cut.status.code(), Some(3), "{stderr}");
    assert_eq!(cut.stdout.len(), 1 << 20);
    assert!(
        stderr.contains("stdout was cut at 1048576 bytes"),
        "{stderr}"
    );
    let whole = run(&["--max-output-bytes", "4000000"]);
    assert!(
        whole.status.success(),
        "{}",
        String::from_utf8_lossy(&whole.stderr)
    );
    assert!(String::from_utf8_lossy(&whole.stdout).ends_with("\nEND\n"));
    // Past its timeout: the output so far is printed (it was dropped), the
    // exit is 124 as timeout(1)'s.
    let mut cmd = Command::new("sessionctl");
    env.apply(&mut cmd);
    let timed_out = cmd
        .args(["workspace", "exec", &session, "--timeout-ms", "1500", "--"])
        .args(["sh", "-c", "echo partial; echo oops >&2; sleep 100"])
        .current_dir(&scratch)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&timed_out.stderr);
    assert_eq!(timed_out.status.code(), Some(124), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&timed_out.stdout), "partial\n");
    assert!(
        stderr.contains("oops") && stderr.contains("ran past its timeout"),
        "{stderr}"
    );
    // Killed by a signal: 128 + its number, as a shell says it, and named
    // (helper-52 6: it exited 124, as if it had timed out).
    let mut cmd = Command::new("sessionctl");
    env.apply(&mut cmd);
    let killed = cmd
        .args(["workspace", "exec", &session, "--"])
        .args(["sh", "-c", "echo hi; kill -TERM $$"])
        .current_dir(&scratch)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&killed.stderr);
    assert_eq!(killed.status.code(), Some(128 + 15), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&killed.stdout), "hi\n");
    assert!(stderr.contains("killed by signal 15"), "{stderr}");
    terminate(server);
}

/// A server that hangs up on every connection (here, a listener that
/// closes each at once; in the field, a TLS port called over plain HTTP):
/// `health --wait` says what failed and exits 1, never killed by SIGPIPE
/// when a write meets the closed socket (it used to exit 141 with nothing
/// said).
#[test]
fn a_server_that_hangs_up_is_an_error_not_a_silent_sigpipe() {
    use std::os::unix::process::ExitStatusExt;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            // Read the client's first bytes, so its next write meets a
            // socket closed after them.
            let mut first = [0u8; 64];
            let _ = std::io::Read::read(&mut stream, &mut first);
            drop(stream);
        }
    });
    for _ in 0..3 {
        let out = Command::new(bin("sessionctl"))
            .args(["--addr", &format!("http://{addr}"), "health", "--wait"])
            .args(["--timeout-secs", "2"])
            .env_remove("SESSIOND_ADDR")
            .env_remove("SESSIOND_TOKEN")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.signal(), None, "{:?}: {stderr}", out.status);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains("error"), "{stderr}");
    }
}

/// sessiond serving TLS with a self-signed certificate whose
/// `basicConstraints` are `constraints`: (the server, the certificate's
/// directory, its `https://` address, the certificate's path).
fn serving_tls(env: &Env, constraints: &str) -> (Served, PathBuf, String, String) {
    let dir = env.home.path().join("tls");
    std::fs::create_dir_all(&dir).unwrap();
    let (cert, key) = self_signed(&dir, constraints);
    let server = env.serve_with(&[
        ("SESSIOND_TLS_CERT", cert.to_str().unwrap()),
        ("SESSIOND_TLS_KEY", key.to_str().unwrap()),
    ]);
    let https = format!("https://{}", env.addr);
    (server, dir, https, cert.display().to_string())
}

/// A self-signed certificate for localhost and its key, in `dir`, with
/// `basicConstraints` `constraints`.
fn self_signed(dir: &Path, constraints: &str) -> (PathBuf, PathBuf) {
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    let made = Command::new("openssl")
        .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
        .args(["ec_paramgen_curve:prime256v1", "-nodes", "-days", "2"])
        .args(["-subj", "/CN=localhost"])
        .args(["-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"])
        .args([
            "-addext",
            &format!("basicConstraints=critical,{constraints}"),
        ])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .expect("the openssl CLI (apt-get install openssl)");
    assert!(made.status.success(), "{made:?}");
    (cert, key)
}

/// helper-59 6: a server certificate that is a CA (what `openssl req
/// -x509` makes by default) is refused by TLS as the server's own; the
/// error (rustls' `CaUsedAsEndEntity`) now comes with how to make one.
#[test]
fn a_ca_certificate_serving_tls_is_refused_with_how_to_make_one() {
    let env = Env::new();
    let (server, dir, https, ca) = serving_tls(&env, "CA:TRUE");
    let (_, stderr, _) =
        env.sessionctl_fails(&["--addr", &https, "--ca-file", &ca, "task", "list"], &dir);
    assert!(
        stderr.contains("CaUsedAsEndEntity")
            && stderr.contains("basicConstraints=critical,CA:FALSE"),
        "{stderr}"
    );
    terminate(server);
}

/// sessionctl against a sessiond serving TLS: an `https://` address with
/// `--ca-file` (here the server's self-signed certificate) works; without
/// it the error says what to pass; a plain `http://` address to the TLS
/// port gets a hint to use https (it could not be used at all before).
#[test]
fn sessionctl_speaks_tls_with_a_ca_file() {
    let env = Env::new();
    let (server, dir, https, ca) = serving_tls(&env, "CA:FALSE");
    let health = env.sessionctl(
        &["--addr", &https, "--ca-file", &ca, "health", "--wait"],
        &dir,
    );
    assert_eq!(health.trim(), "SERVING");
    let made = env.sessionctl(
        &[
            "--addr",
            &https,
            "--ca-file",
            &ca,
            "task",
            "create",
            "tls",
            "-q",
        ],
        &dir,
    );
    assert!(!made.trim().is_empty());
    let (_, stderr, _) = env.sessionctl_fails(&["--addr", &https, "task", "list"], &dir);
    assert!(stderr.contains("--ca-file"), "{stderr}");
    let (_, stderr, _) = env.sessionctl_fails(&["health"], &dir);
    assert!(stderr.contains("use an https:// address"), "{stderr}");
    terminate(server);
}
