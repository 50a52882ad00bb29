//! `cargo xtask <command>`: the project's automation, in Rust rather than shell.
//!
//! - `ci`: everything CI checks: formatting, clippy, build, every test (with a
//!   throwaway PostgreSQL this command starts itself unless `DATABASE_URL` is
//!   set). This is the README's test command and what `.ci/run` calls.
//!   Then the crash tests (failpoints, a 45 s SIGKILL crash loop), which
//!   only a build with sessiond-recovery's `failpoints` feature contains.
//!   The Docker executor tests run against a dockerd it starts unless one
//!   runs (installing `docker.io` when missing), with an image built offline.
//! - `docker-image`: builds the `sessiond-agentctl:dev` image with no registry.
//! - `docker-tests`: only the Docker tests (executor driver, and recovery on
//!   the Docker runtime), with an engine as in `ci`. `ci` runs the same tests
//!   within its one test run, which has `SESSIOND_DOCKER_TESTS=1` and
//!   `DOCKER_HOST` set.
//! - `bench`: the performance figures (see `bench.rs`); writes docs/PERFORMANCE.md.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context, bail};

mod bench;
mod docker;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("ci") => ci(),
        Some("docker-image") => docker_image(&args[1..]),
        Some("docker-tests") => docker_tests(),
        Some("bench") => {
            let root = workspace_root();
            std::env::set_current_dir(&root)?;
            ensure_system_packages()?;
            bench::bench(&root, &args[1..])
        }
        _ => {
            eprintln!(
                "usage: cargo xtask ci | docker-image [--tar <file>] | docker-tests | bench [--quick]"
            );
            bail!("unknown or missing command {:?}", args.first());
        }
    }
}

fn ci() -> anyhow::Result<()> {
    let root = workspace_root();
    std::env::set_current_dir(&root)?;
    ensure_system_packages()?;

    step("fmt", cargo(&["fmt", "--all", "--", "--check"]))?;
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
    // Integration tests run the real binaries (agentctl, acp-demo-agent, sessiond).
    step(
        "build",
        cargo(&["build", "--workspace", "--bins", "--locked"]),
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

    let mut test = if has_nextest() {
        cargo(&[
            "nextest",
            "run",
            "--workspace",
            "--locked",
            "--no-fail-fast",
        ])
    } else {
        eprintln!("xtask: cargo-nextest not found, running cargo test");
        cargo(&["test", "--workspace", "--locked", "--no-fail-fast"])
    };
    test.env("DATABASE_URL", &database_url);
    test.env("SESSIOND_DOCKER_TESTS", "1")
        .env("DOCKER_HOST", engine.host());
    step("test", test)?;
    // The crash tests live in a test binary that exists only with
    // sessiond-recovery's `failpoints` feature, which no build above enables.
    step("crash tests clippy", crash_tests("clippy"))?;
    let mut crash = crash_tests("test");
    crash
        .env("SESSIOND_CRASHLOOP_SECS", "45")
        .env("SESSIOND_DOCKER_TESTS", "1")
        .env("DOCKER_HOST", engine.host());
    step("crash tests", crash)?;
    step(
        "doctest",
        cargo(&["test", "--workspace", "--doc", "--locked"]),
    )?;
    engine.stop()?;
    eprintln!("xtask: ci passed");
    Ok(())
}

/// `cargo <sub>` of sessiond-recovery's `crashloop` test binary with the
/// `failpoints` feature: a crash at each failpoint, and the SIGKILL crash loop
/// (`SESSIOND_CRASHLOOP_SECS` long; a short smoke run when unset).
fn crash_tests(sub: &str) -> Command {
    let mut cmd = cargo(&[
        sub,
        "-p",
        "sessiond-recovery",
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
    test.args(["--", "docker::"]);
    test.env("SESSIOND_DOCKER_TESTS", "1")
        .env("DOCKER_HOST", engine.host());
    step("docker tests", test)?;
    // Recovery on the Docker runtime: kill -9 of the backend, faults while
    // it is down, crashes during recovery, the orphan sweep.
    let mut test = cargo(&[
        "test",
        "-p",
        "sessiond-recovery",
        "--locked",
        "--test",
        "recovery",
    ]);
    test.args(["--", "docker", "orphan_sweep"]);
    test.env("SESSIOND_DOCKER_TESTS", "1")
        .env("DOCKER_HOST", engine.host());
    step("recovery docker tests", test)?;
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
    step("apt-get update", command("apt-get", &["update", "-q"]))?;
    let mut install = command(
        "apt-get",
        &["install", "-y", "-q", "--no-install-recommends"],
    );
    install
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive");
    step("apt-get install", install)
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

fn cargo(args: &[&str]) -> Command {
    command(&cargo_bin(), args)
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
