//! `cargo xtask <command>`: the project's automation, in Rust rather than shell.
//!
//! - `ci`: everything CI checks: formatting, clippy, build, every test (with a
//!   throwaway PostgreSQL this command starts itself unless `DATABASE_URL` is
//!   set). This is the README's test command and what `.ci/run` calls.
//!   Then the crash tests (failpoints, a 45 s SIGKILL crash loop, and a 30 s
//!   one with heavy agents), which only a build with sessiond-engine's
//!   `failpoints` feature contains.
//!   The Docker tests (`#[ignore]`d, so a plain test run never counts them as
//!   passed) run explicitly, against a dockerd it starts unless one runs
//!   (installing `docker.io` when missing), with an image built offline.
//!   It builds and runs the library crates' examples (`EXAMPLES`), builds
//!   their API docs with warnings as errors and packages them (dry run),
//!   checking that each package builds from its tarball alone.
//!   Its last line is `N passed, N failed` over every test it ran.
//! - `docker-image`: builds the `sessiond-agentctl:dev` image with no registry.
//! - `house`: the layering of the crates, the docs' citations and links,
//!   the codemap's size and import loops inside crates (see `house.rs`;
//!   `ci` runs it).
//! - `docker-tests`: only the Docker tests (executor driver with the
//!   container boundary probe, recovery on the Docker runtime, sessionctl's
//!   Docker session), with an engine as in `ci`. `ci` runs the same tests
//!   within its one test run, which has `DOCKER_HOST` set.
//! - `interop-venv`: only the virtualenv of the interop test's Python ACP
//!   agent (`target/interop-venv`, from `tests/interop/requirements.txt`),
//!   which `ci` and `soak` make too (its test is `#[ignore]`d, run by `ci`).
//! - `claude-acp`: only the Claude Code ACP adapter the claude tests run
//!   (`target/claude-acp`, `npm ci` of `tests/claude/package-lock.json`),
//!   which `ci` and `soak` install too (its tests are `#[ignore]`d, run by `ci`).
//! - `soak [--runs N]`: the test suites of `ci` N times (3) under CPU load
//!   (a busy loop per core), reporting each run's failures: the flake check.
//! - `packages`: only the library crates' API docs, their packages and
//!   the check that each builds from its tarball (as in `ci`).
//! - `public-api`: rewrites docs/public-api.txt, the public-API snapshot of
//!   the library crates that xtask's test compares (see `public_api.rs`).
//! - `bench`: the performance figures (see `bench.rs`); writes docs/PERFORMANCE.md.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context, bail};

mod apt;
mod bench;
mod claude_acp;
#[cfg(test)]
mod compose;
mod docker;
mod house;
mod interop;
mod package;
mod public_api;
mod web;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("ci") => ci(),
        Some("docker-image") => docker_image(&args[1..]),
        Some("docker-tests") => docker_tests(),
        Some("house") => house::check(&workspace_root()),
        Some("soak") => soak(&args[1..]),
        Some("public-api") => {
            let root = workspace_root();
            std::fs::write(
                public_api::snapshot_path(&root),
                public_api::listing(&root)?,
            )?;
            eprintln!("xtask: wrote docs/public-api.txt");
            Ok(())
        }
        Some("interop-venv") => interop::ensure_venv(&workspace_root()).map(|_| ()),
        Some("claude-acp") => claude_acp::ensure_claude_acp(&workspace_root()).map(|_| ()),
        Some("packages") => {
            std::env::set_current_dir(workspace_root())?;
            library_docs_and_packages()
        }
        Some("bench") => {
            let root = workspace_root();
            std::env::set_current_dir(&root)?;
            ensure_system_packages()?;
            bench::bench(&root, &args[1..])
        }
        _ => {
            eprintln!(
                "usage: cargo xtask ci | docker-image [--tar <file>] | docker-tests | house | interop-venv | claude-acp | soak [--runs N] | bench [--quick] | public-api | packages"
            );
            bail!("unknown or missing command {:?}", args.first());
        }
    }
}

fn ci() -> anyhow::Result<()> {
    let root = workspace_root();
    std::env::set_current_dir(&root)?;
    ensure_system_packages()?;
    // The interop test's agent runs on the Python ACP SDK.
    interop::ensure_venv(&root)?;
    // The claude tests run the Claude Code ACP adapter (node, from npm).
    claude_acp::ensure_claude_acp(&root)?;

    step("fmt", cargo(&["fmt", "--all", "--", "--check"]))?;
    eprintln!("xtask: ==> house: layering, citations, links, loops");
    house::check(&root)?;
    step(
        "clippy",
        cargo(&[
            "clippy",
            "--workspace",
            "--all-targets",
            "--locked",
            "--",
            "-D",
            "warnings",
        ]),
    )?;
    // The console's bundle first: `sessiond` embeds it (crates/sessiond-server/console).
    web::build_and_check(&root)?;
    // Integration tests run the real binaries (agentctl, acp-demo-agent, sessiond).
    step(
        "build",
        cargo(&["build", "--workspace", "--bins", "--locked"]),
    )?;
    examples()?;
    library_docs_and_packages()?;
    let mut tally = Tally::default();
    tally.run(
        "web: browser suite",
        web::browser_suite(&root, &docker::target_dir(&root).join("debug")),
    )?;
    // The Docker executor tests run for real: an engine (ours unless one runs;
    // stopped when `engine` drops) and the agentctl image built offline.
    let engine = docker::Engine::ensure().context("a Docker engine for the Docker tests")?;
    docker::build_image(&engine, &docker::target_dir(&root).join("debug"))?;

    let (database_url, _cluster) = match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => {
            eprintln!("xtask: using DATABASE_URL from the environment for the Postgres suite");
            (url, None)
        }
        _ => {
            let cluster = sessiond_testkit::postgres::try_start_cluster()
                .map_err(anyhow::Error::msg)
                .context("starting a throwaway PostgreSQL for the Postgres suite")?;
            (cluster.url().to_owned(), Some(cluster))
        }
    };

    test_suites(&mut tally, engine.host(), &database_url)?;
    engine.stop()?;
    // The last line: every test this command ran, over all the runs above.
    eprintln!("{} passed, {} failed", tally.passed, tally.failed);
    if !tally.failed_steps.is_empty() {
        bail!("failed: {}", tally.failed_steps.join(", "));
    }
    Ok(())
}

/// Every test `ci` runs after its browser suite: the workspace (the
/// `#[ignore]`d Docker tests included), the crash tests, the doctests.
fn test_suites(tally: &mut Tally, docker_host: &str, database_url: &str) -> anyhow::Result<()> {
    // Every test, the `#[ignore]`d ones that need Docker included; the
    // child-process entry points and the opt-in tests are ignored too and
    // never run here.
    let mut test = if has_nextest() {
        let mut cmd = cargo(&[
            "nextest",
            "run",
            "--workspace",
            "--locked",
            "--no-fail-fast",
            "--run-ignored",
            "all",
        ]);
        let children = CHILD_ENTRY_POINTS
            .iter()
            .chain(OPT_IN.iter())
            .map(|t| format!("test(={t})"))
            .collect::<Vec<_>>()
            .join(" | ");
        cmd.args(["-E", &format!("not ({children})")]);
        cmd
    } else {
        eprintln!("xtask: cargo-nextest not found, running cargo test");
        let mut cmd = cargo(&["test", "--workspace", "--locked", "--no-fail-fast"]);
        cmd.args(["--", "--include-ignored"]);
        for t in CHILD_ENTRY_POINTS.iter().chain(OPT_IN.iter()) {
            cmd.args(["--skip", t]);
        }
        cmd
    };
    test.env("DATABASE_URL", database_url);
    test.env("SESSIOND_DOCKER_TESTS", "1")
        .env("DOCKER_HOST", docker_host);
    tally.run("test", test)?;
    // The crash tests live in a test binary that exists only with
    // sessiond-engine's `failpoints` feature, which no build above enables.
    step("crash tests clippy", crash_tests("clippy"))?;
    let mut crash = crash_tests("test");
    crash
        .env("SESSIOND_CRASHLOOP_SECS", "45")
        .env("DATABASE_URL", database_url)
        .env("SESSIOND_DOCKER_TESTS", "1")
        .env("DOCKER_HOST", docker_host);
    tally.run("crash tests", crash)?;
    // Every crash test again with the world's store on PostgreSQL, whose
    // statements (a turn's, a first chunk's) differ from SQLite's.
    let mut on_postgres = crash_tests("test");
    on_postgres
        .env("SESSIOND_CRASHLOOP_STORE", "postgres")
        .env("SESSIOND_CRASHLOOP_SECS", "30")
        .env("DATABASE_URL", database_url)
        .env("SESSIOND_DOCKER_TESTS", "1")
        .env("DOCKER_HOST", docker_host);
    tally.run("crash tests, PostgreSQL", on_postgres)?;
    // The crash loop again with agents that start as slowly as real ones,
    // so kills land in the middle of launches and creates.
    let mut heavy = crash_tests("test");
    heavy
        .args(["crash_loop"])
        .env("SESSIOND_CRASHLOOP_SECS", "30")
        .env("SESSIOND_CRASHLOOP_HEAVY", "1")
        .env("SESSIOND_DOCKER_TESTS", "1")
        .env("DOCKER_HOST", docker_host);
    tally.run("crash loop, heavy agents", heavy)?;
    tally.run(
        "doctest",
        cargo(&["test", "--workspace", "--doc", "--locked"]),
    )
}

/// The library crates' examples: every one built, and run (each asserts
/// what it shows, with real agentctl and demo-agent processes where it
/// starts sessions; they find the binaries `build` made beside them).
const EXAMPLES: &[(&str, &str)] = &[
    ("sessiond-server", "embed_tonic"),
    ("sessiond-server", "custom_executor"),
    ("sessiond-engine", "drive_sessions"),
];

fn examples() -> anyhow::Result<()> {
    step(
        "examples: build",
        cargo(&["build", "--workspace", "--examples", "--locked"]),
    )?;
    for (package, example) in EXAMPLES {
        step(
            &format!("example {example}"),
            cargo(&["run", "--locked", "-q", "-p", package, "--example", example]),
        )?;
    }
    Ok(())
}

/// The crates other Rust services embed (publishable; see docs/EMBEDDING.md).
const LIBRARY_CRATES: &[&str] = &[
    "sessiond-domain",
    "sessiond-proto",
    "sessiond-store",
    "sessiond-executor",
    "sessiond-engine",
    "sessiond-telemetry",
    "sessiond-server",
];

/// The library crates' API docs with every rustdoc warning an error (a
/// broken or private intra-doc link fails), and each library crate packaged
/// as `cargo publish` would (`cargo package --workspace`, which resolves the
/// unpublished sessiond crates among themselves). `--no-verify`, because
/// cargo's own verification rebuilds every dependency once per crate;
/// [`package::check_tarballs`] then checks that the tarballs build, in one
/// workspace that reuses the main build's dependencies.
fn library_docs_and_packages() -> anyhow::Result<()> {
    let mut doc = cargo(&["doc", "--no-deps", "--locked"]);
    for c in LIBRARY_CRATES {
        doc.args(["-p", c]);
    }
    doc.env("RUSTDOCFLAGS", "-D warnings");
    step("docs", doc)?;
    let mut package = cargo(&[
        "package",
        "--workspace",
        "--no-verify",
        "--locked",
        "--allow-dirty",
    ]);
    for member in workspace_members()? {
        if !LIBRARY_CRATES.contains(&member.as_str()) {
            package.args(["--exclude", &member]);
        }
    }
    step("package the library crates", package)?;
    let root = workspace_root();
    package::check_tarballs(&root, &docker::target_dir(&root))
}

/// The workspace's package names (the directories of `crates/`, and xtask).
fn workspace_members() -> anyhow::Result<Vec<String>> {
    let mut members = vec!["xtask".to_owned()];
    for entry in std::fs::read_dir(workspace_root().join("crates"))? {
        let entry = entry?;
        if entry.path().join("Cargo.toml").is_file() {
            members.push(entry.file_name().to_string_lossy().into_owned());
        }
    }
    Ok(members)
}

/// `soak [--runs N]`: the suites of [`test_suites`] N times in a row (3 by
/// default) while one busy loop per core competes for the CPU at the tests'
/// own priority, to find tests that depend on timing. Prints each run's
/// counts and the tests that failed; fails when any did.
fn soak(args: &[String]) -> anyhow::Result<()> {
    let runs: u32 = match args {
        [] => 3,
        [flag, n] if flag == "--runs" => n.parse().context("--runs N")?,
        _ => bail!("usage: cargo xtask soak [--runs N]"),
    };
    let root = workspace_root();
    std::env::set_current_dir(&root)?;
    ensure_system_packages()?;
    interop::ensure_venv(&root)?;
    claude_acp::ensure_claude_acp(&root)?;
    step(
        "build",
        cargo(&["build", "--workspace", "--bins", "--locked"]),
    )?;
    let engine = docker::Engine::ensure().context("a Docker engine for the Docker tests")?;
    docker::build_image(&engine, &docker::target_dir(&root).join("debug"))?;
    let cluster = sessiond_testkit::postgres::try_start_cluster()
        .map_err(anyhow::Error::msg)
        .context("starting a throwaway PostgreSQL for the Postgres suite")?;
    let load = BusyLoops::start()?;
    let mut results = Vec::new();
    for run in 1..=runs {
        eprintln!(
            "xtask: soak run {run}/{runs} under {} busy loops",
            load.0.len()
        );
        let mut tally = Tally::default();
        test_suites(&mut tally, engine.host(), cluster.url())?;
        results.push(tally);
    }
    drop(load);
    engine.stop()?;
    let mut flaky = 0;
    for (i, t) in results.iter().enumerate() {
        eprintln!(
            "xtask: soak run {}: {} passed, {} failed{}",
            i + 1,
            t.passed,
            t.failed,
            if t.failed_tests.is_empty() {
                String::new()
            } else {
                format!(" ({})", t.failed_tests.join(", "))
            }
        );
        flaky += t.failed;
    }
    eprintln!("{flaky} failed over {runs} runs under load");
    if flaky > 0 {
        bail!("{flaky} test failures under load");
    }
    Ok(())
}

/// One `sh` busy loop per core; killed (by pid) when dropped. Each loop also
/// ends by itself once xtask is gone (`kill -0 $PPID` fails), so a soak
/// interrupted by a signal leaves no loop spinning.
struct BusyLoops(Vec<std::process::Child>);

impl BusyLoops {
    fn start() -> anyhow::Result<BusyLoops> {
        let cores = std::thread::available_parallelism().map_or(2, usize::from);
        let mut loops = Vec::with_capacity(cores);
        for _ in 0..cores {
            loops.push(
                Command::new("sh")
                    .args(["-c", "while kill -0 $PPID 2>/dev/null; do :; done"])
                    .spawn()
                    .context("starting a busy loop")?,
            );
        }
        Ok(BusyLoops(loops))
    }
}

impl Drop for BusyLoops {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Test functions that are child-process entry points of crash tests (this
/// test binary re-executed), `#[ignore]`d so that no run reports them as
/// tests; the tests that start them pass `--ignored --exact`.
const CHILD_ENTRY_POINTS: [&str; 2] = ["crash::child_backend", "kill9::backend_process"];

/// `#[ignore]`d tests that need what CI cannot have (a third-party agent with
/// its credentials, named by `AGENTCTL_REAL_AGENT`); run by hand.
const OPT_IN: [&str; 1] = ["real_agent_smoke"];

/// Tests passed and failed over the test runs of one `ci`.
#[derive(Debug, Default)]
struct Tally {
    passed: u64,
    failed: u64,
    failed_steps: Vec<String>,
    /// nextest's `FAIL [..] crate::binary test` lines, for `soak`'s report.
    failed_tests: Vec<String>,
}

impl Tally {
    /// Runs a test command to the end (a failure does not stop `ci` before
    /// the other test runs), passing its output through and counting from
    /// its summary lines (nextest's `Summary`, libtest's `test result:`,
    /// node's test runner's `# pass N` / `# fail N`).
    fn run(&mut self, name: &str, mut cmd: Command) -> anyhow::Result<()> {
        use std::io::{BufRead, BufReader, Write};
        eprintln!("xtask: ==> {name}: {cmd:?}");
        let started = Instant::now();
        let mut child = cmd
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .with_context(|| format!("{name}: cannot start {cmd:?}"))?;
        let stdout = child.stdout.take().context("child stdout")?;
        let stderr = child.stderr.take().context("child stderr")?;
        let out = std::thread::spawn(move || {
            let mut counts = Counts::default();
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                counts.add(&line);
                let mut o = std::io::stdout().lock();
                let _ = writeln!(o, "{line}");
            }
            counts
        });
        let mut counts = Counts::default();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            counts.add(&line);
            eprintln!("{line}");
        }
        let status = child.wait()?;
        let from_stdout = out
            .join()
            .map_err(|_| anyhow::anyhow!("{name}: output reader panicked"))?;
        let counts = counts.merge(from_stdout);
        eprintln!(
            "xtask: <== {name}: {status} in {:.1}s ({} passed, {} failed)",
            started.elapsed().as_secs_f64(),
            counts.passed,
            counts.failed
        );
        self.passed += counts.passed;
        self.failed += counts.failed;
        self.failed_tests
            .extend(counts.failed_tests.iter().map(|t| format!("{name}: {t}")));
        if !status.success() {
            self.failed_steps.push(name.to_owned());
            if counts.failed == 0 {
                // It failed without a test failing (a build error): say so in
                // the total as one failure rather than as nothing.
                self.failed += 1;
            }
        }
        Ok(())
    }
}

/// Counts read from one test run's summary lines.
#[derive(Debug, Default, PartialEq)]
struct Counts {
    passed: u64,
    failed: u64,
    /// A nextest summary was seen (it already totals the run, so libtest
    /// lines inside failing tests' output are not added again).
    nextest: bool,
    /// Names from nextest's `FAIL [time] (i/n) name` and libtest's
    /// `test name ... FAILED` lines, each once.
    failed_tests: Vec<String>,
}

impl Counts {
    fn add(&mut self, line: &str) {
        let line = line.trim();
        let failed = line
            .strip_prefix("FAIL [")
            .or_else(|| line.strip_prefix("TIMEOUT ["))
            .and_then(|rest| rest.split_once("] "))
            .map(|(_, name)| match name.split_once(") ") {
                Some((progress, name)) if progress.starts_with('(') => name,
                _ => name,
            })
            .or_else(|| {
                line.strip_prefix("test ")
                    .and_then(|rest| rest.strip_suffix(" ... FAILED"))
            });
        // nextest replays a failed test's output, libtest's own `FAILED`
        // line included: the short name of an entry already there.
        if let Some(name) = failed
            && !self
                .failed_tests
                .iter()
                .any(|n| n == name || n.ends_with(&format!(" {name}")))
        {
            self.failed_tests.push(name.to_owned());
        }
        // nextest: "Summary [  12.3s] 250 tests run: 248 passed (1 slow), 2 failed, 3 skipped"
        if let Some(i) = line.find(" run: ")
            && line.starts_with("Summary")
        {
            let (mut passed, mut failed) = (0, 0);
            for part in line[i + 6..].split(", ") {
                let mut words = part.split_whitespace();
                let n: u64 = words.next().and_then(|n| n.parse().ok()).unwrap_or(0);
                match words.next() {
                    Some("passed") => passed += n,
                    Some("failed" | "timed") => failed += n,
                    _ => {}
                }
            }
            self.passed = passed;
            self.failed = failed;
            self.nextest = true;
            return;
        }
        // libtest: "test result: ok. 5 passed; 0 failed; 1 ignored; ..."
        if self.nextest {
            return;
        }
        // node --test (tap or spec reporter): "# pass 5", "ℹ fail 0".
        for prefix in ["# ", "ℹ "] {
            if let Some(rest) = line.strip_prefix(prefix) {
                let mut words = rest.split_whitespace();
                let (what, n) = (
                    words.next(),
                    words.next().and_then(|n| n.parse::<u64>().ok()),
                );
                match (what, n, words.next()) {
                    (Some("pass"), Some(n), None) => self.passed += n,
                    (Some("fail" | "cancelled"), Some(n), None) => self.failed += n,
                    _ => {}
                }
            }
        }
        if let Some(rest) = line.strip_prefix("test result: ") {
            for part in rest.split(';') {
                let words: Vec<&str> = part.split_whitespace().collect();
                let (n, what) = match words.as_slice() {
                    [.., n, what] => (n.parse::<u64>().unwrap_or(0), *what),
                    _ => continue,
                };
                match what {
                    "passed" => self.passed += n,
                    "failed" => self.failed += n,
                    _ => {}
                }
            }
        }
    }

    fn merge(mut self, other: Counts) -> Counts {
        for name in other.failed_tests {
            if !self.failed_tests.contains(&name) {
                self.failed_tests.push(name);
            }
        }
        if other.nextest && !self.nextest {
            self.passed = other.passed;
            self.failed = other.failed;
            self.nextest = true;
        } else if !self.nextest {
            self.passed += other.passed;
            self.failed += other.failed;
        }
        self
    }
}

/// `cargo <sub>` of sessiond-engine's `crashloop` test binary with the
/// `failpoints` feature: a crash at each failpoint, and the SIGKILL crash loop
/// (`SESSIOND_CRASHLOOP_SECS` long; a short smoke run when unset).
fn crash_tests(sub: &str) -> Command {
    let mut cmd = cargo(&[
        sub,
        "-p",
        "sessiond-engine",
        "--features",
        "failpoints",
        "--locked",
        "--test",
        "crashloop",
    ]);
    if sub == "clippy" {
        cmd.args(["--", "-D", "warnings"]);
    }
    cmd
}

/// Builds agentctl and acp-demo-agent and imports them as the image
/// `sessiond-agentctl:dev` into the running engine, or with `--tar <file>`
/// writes the root filesystem tarball (for `docker import`) without an engine.
fn docker_image(args: &[String]) -> anyhow::Result<()> {
    let tar = match args {
        [] => None,
        [flag, path] if flag == "--tar" => Some(std::env::current_dir()?.join(path)),
        _ => bail!("usage: cargo xtask docker-image [--tar <file>]"),
    };
    let root = workspace_root();
    std::env::set_current_dir(&root)?;
    step(
        "build",
        cargo(&[
            "build",
            "-p",
            "agentctl",
            "-p",
            "acp-demo-agent",
            "--bins",
            "--locked",
        ]),
    )?;
    let bin_dir = docker::target_dir(&root).join("debug");
    if let Some(tar) = tar {
        return docker::write_rootfs_tar(&bin_dir, &tar);
    }
    let Some(engine) = docker::Engine::running()? else {
        bail!(
            "no Docker engine runs (DOCKER_HOST unset, nothing at /var/run/docker.sock). Start one, e.g. \
             `dockerd --bridge=none --iptables=false --ip-forward=false --ip-masq=false &`, \
             or write a tarball with `cargo xtask docker-image --tar rootfs.tar`"
        );
    };
    docker::build_image(&engine, &bin_dir)
}

/// Just the Docker executor tests, against an engine provided as in `ci`.
fn docker_tests() -> anyhow::Result<()> {
    let root = workspace_root();
    std::env::set_current_dir(&root)?;
    step(
        "build",
        cargo(&[
            "build",
            "-p",
            "agentctl",
            "-p",
            "acp-demo-agent",
            // `boundary-probe`, run inside a container by the boundary test.
            "-p",
            "sessiond-testkit",
            // sessiond and sessionctl for the CLI's Docker session test.
            "-p",
            "sessiond-server",
            "-p",
            "sessiond-cli",
            "--bins",
            "--locked",
        ]),
    )?;
    let engine = docker::Engine::ensure().context("a Docker engine for the Docker tests")?;
    docker::build_image(&engine, &docker::target_dir(&root).join("debug"))?;
    let mut test = cargo(&[
        "test",
        "-p",
        "sessiond-executor",
        "--locked",
        "--test",
        "executor",
    ]);
    test.args(["--", "docker::", "--include-ignored"]);
    test.env("SESSIOND_DOCKER_TESTS", "1")
        .env("DOCKER_HOST", engine.host());
    step("docker tests", test)?;
    // Recovery on the Docker runtime: kill -9 of the backend, faults while
    // it is down, crashes during recovery, the orphan sweep.
    let mut test = cargo(&[
        "test",
        "-p",
        "sessiond-engine",
        "--locked",
        "--test",
        "recovery",
    ]);
    test.args(["--", "docker", "orphan_sweep", "--include-ignored"]);
    test.env("SESSIOND_DOCKER_TESTS", "1")
        .env("DOCKER_HOST", engine.host());
    step("recovery docker tests", test)?;
    // `sessionctl session create --runtime local_docker` with the default profile.
    let mut test = cargo(&[
        "test",
        "-p",
        "sessiond-cli",
        "--locked",
        "--test",
        "quickstart",
    ]);
    test.args(["--", "docker", "--include-ignored"]);
    test.env("DOCKER_HOST", engine.host());
    step("sessionctl docker test", test)?;
    engine.stop()
}

/// Installs what the build and tests need when it is missing (fresh machine).
fn ensure_system_packages() -> anyhow::Result<()> {
    let wanted = [
        ("/usr/lib/postgresql/15/bin/initdb", "postgresql-15"),
        ("/usr/include/postgresql/libpq-fe.h", "libpq-dev"),
        ("/usr/bin/git", "git"),
        // promtool validates the metrics exposition and docs/ops/ alert rules.
        ("/usr/bin/promtool", "prometheus"),
        // The web console's browser suite (never a browser downloaded by npm).
        ("/usr/bin/chromium", "chromium"),
        // The TLS tests make their certificates with the openssl CLI.
        ("/usr/bin/openssl", "openssl"),
    ];
    let missing: Vec<&str> = wanted
        .iter()
        .filter(|(path, _)| !Path::new(path).exists())
        .map(|(_, pkg)| *pkg)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("xtask: installing missing packages: {}", missing.join(" "));
    apt::apt_get(&["update", "-q"])?;
    let mut install = vec!["install", "-y", "-q", "--no-install-recommends"];
    install.extend(&missing);
    apt::apt_get(&install)
}

fn has_nextest() -> bool {
    Command::new(cargo_bin())
        .args(["nextest", "--version"])
        .output()
        .map(|out| out.status.success())
        .unwrap_or(false)
}

fn step(name: &str, mut cmd: Command) -> anyhow::Result<()> {
    eprintln!("xtask: ==> {name}: {cmd:?}");
    let started = Instant::now();
    let status = cmd
        .status()
        .with_context(|| format!("{name}: cannot start {cmd:?}"))?;
    eprintln!(
        "xtask: <== {name}: {status} in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    if !status.success() {
        bail!("{name} failed ({status})");
    }
    Ok(())
}

/// `cargo ARGS` in the environment of a plain `cargo` from a shell.
///
/// `cargo xtask` is `cargo run`, which gives this process the package
/// variables of xtask itself (`CARGO_MANIFEST_DIR`, `CARGO_PKG_NAME`, ...).
/// Inherited by a nested cargo, they are what it compares the
/// `rerun-if-env-changed` of build scripts against: ring's names
/// `CARGO_MANIFEST_DIR` and `CARGO_PKG_*`, so its build script ran again
/// and ring, rustls, tonic and every crate above them were rebuilt after
/// each switch between `cargo xtask ...` and a plain `cargo build`.
fn cargo(args: &[&str]) -> Command {
    let mut cmd = command(&cargo_bin(), args);
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(is_cargo_run_variable) {
            cmd.env_remove(name);
        }
    }
    cmd
}

/// The variables `cargo run` sets for the program it runs (beside `CARGO`,
/// which names the same cargo, and the library path).
fn is_cargo_run_variable(name: &str) -> bool {
    name.starts_with("CARGO_PKG_")
        || name.starts_with("CARGO_MANIFEST_")
        || matches!(
            name,
            "CARGO_CRATE_NAME" | "CARGO_BIN_NAME" | "CARGO_PRIMARY_PACKAGE"
        )
}

fn command(program: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(program);
    cmd.args(args);
    cmd
}

fn cargo_bin() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned())
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::Counts;

    /// A nested cargo sees none of xtask's own package variables (they
    /// made it rebuild ring and everything above it; see `cargo`).
    #[test]
    fn nested_cargo_gets_no_package_variables() {
        let cmd = super::cargo(&["build"]);
        let removed: Vec<_> = cmd
            .get_envs()
            .filter(|(_, v)| v.is_none())
            .map(|(k, _)| k.to_string_lossy().into_owned())
            .collect();
        // `cargo test` gives this test the same variables `cargo run` gives xtask.
        for name in ["CARGO_MANIFEST_DIR", "CARGO_PKG_NAME", "CARGO_PKG_VERSION"] {
            assert!(std::env::var_os(name).is_some(), "{name} not set by cargo");
            assert!(
                removed.iter().any(|r| r == name),
                "{name} kept: {removed:?}"
            );
        }
        assert!(!removed.iter().any(|r| r == "PATH" || r == "CARGO_HOME"));
    }

    fn count(lines: &[&str]) -> (u64, u64) {
        let mut c = Counts::default();
        for l in lines {
            c.add(l);
        }
        (c.passed, c.failed)
    }

    #[test]
    fn counts_nextest_summaries() {
        assert_eq!(
            count(&[
                "     Summary [  81.201s] 312 tests run: 310 passed (2 slow), 2 failed, 4 skipped"
            ]),
            (310, 2)
        );
        assert_eq!(
            count(&["Summary [   1.0s] 3 tests run: 1 passed, 1 failed, 1 timed out, 0 skipped"]),
            (1, 2)
        );
        // A failing test's output replayed after the summary adds nothing.
        assert_eq!(
            count(&[
                "Summary [   1.0s] 2 tests run: 2 passed, 0 skipped",
                "test result: ok. 9 passed; 0 failed; 0 ignored",
            ]),
            (2, 0)
        );
    }

    #[test]
    fn counts_node_test_runner_summaries() {
        assert_eq!(
            count(&[
                "# tests 6",
                "# suites 1",
                "# pass 5",
                "# fail 1",
                "# cancelled 0"
            ]),
            (5, 1)
        );
        assert_eq!(count(&["ℹ pass 3", "ℹ fail 0"]), (3, 0));
    }

    #[test]
    fn names_failed_tests_once() {
        let mut c = Counts::default();
        for l in [
            "        FAIL [   1.716s] (1/6) sessiond-engine::recovery turn_crash::a",
            "        PASS [   0.822s] (2/6) sessiond-engine::recovery turn_crash::b",
            "     TIMEOUT [  60.001s] sessiond-server::server security::c",
            "        FAIL [   1.716s] sessiond-engine::recovery turn_crash::a",
            "test turn_crash::a ... FAILED",
            "test crash::d ... FAILED",
            "test crash::e ... ok",
        ] {
            c.add(l);
        }
        assert_eq!(
            c.failed_tests,
            [
                "sessiond-engine::recovery turn_crash::a",
                "sessiond-server::server security::c",
                "crash::d"
            ]
        );
    }

    #[test]
    fn counts_libtest_results() {
        assert_eq!(
            count(&[
                "test result: ok. 5 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.01s",
                "test result: FAILED. 3 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out",
                "test result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out",
            ]),
            (8, 2)
        );
    }
}
