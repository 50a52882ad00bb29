//! `cargo xtask bench [args]`: builds the release binaries the benchmark
//! drives (sessiond, agentctl, acp-demo-agent, sessiond-bench) and runs
//! `sessiond-bench`, which prints its table and writes docs/PERFORMANCE.md.
//! Extra arguments go to `sessiond-bench` (e.g. `--quick`, `--sizes 100,1000`,
//! `--no-postgres`, `--only-burst`; `--help` lists them); `--out -` writes
//! no file.

use std::path::Path;

use crate::{cargo, command, docker, step};

pub fn bench(root: &Path, args: &[String]) -> anyhow::Result<()> {
    // `-p sessiond-proto`: a package named on the command line is built with
    // its default features, as every member is by a plain `cargo build
    // --release`; left out, it is only a dependency with `client` and
    // `server`, which changes its hash and that of every crate above it, so
    // this build and a plain one would each rebuild the workspace's crates
    // after the other. With it, both resolve the same units (compare
    // `cargo build --release --bins --unit-graph -Z unstable-options`).
    step(
        "build (release)",
        cargo(&[
            "build",
            "--release",
            "--locked",
            "-p",
            "sessiond-proto",
            "-p",
            "sessiond-server",
            "-p",
            "agentctl",
            "-p",
            "acp-demo-agent",
            "-p",
            "sessiond-bench",
            "--bins",
        ]),
    )?;
    let bin_dir = docker::target_dir(root).join("release");
    let mut run = command(&bin_dir.join("sessiond-bench").display().to_string(), &[]);
    let mut shown = String::from("cargo xtask bench");
    for a in args {
        shown.push(' ');
        shown.push_str(a);
    }
    let writes_file = !args.iter().any(|a| a == "--out");
    run.args(args)
        .arg("--bin-dir")
        .arg(&bin_dir)
        .env("SESSIOND_BENCH_COMMAND", &shown);
    if writes_file {
        run.arg("--out").arg(root.join("docs/PERFORMANCE.md"));
    }
    step("bench", run)
}
