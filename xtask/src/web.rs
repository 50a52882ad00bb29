//! The web console in CI: its committed bundle (`crates/sessiond-server/console`,
//! built from `web/` and embedded in the `sessiond` binary) is rebuilt from
//! source and must not differ, and the
//! browser suite drives real headless Chromium (Debian's `chromium`, never a
//! downloaded browser) against a real sessiond.

use std::path::Path;

use anyhow::{Context, bail};

use crate::{command, step};

/// Where vite writes the console's bundle (web/vite.config.ts): inside the
/// crate that embeds it, so `sessiond-server`'s package is self-contained.
const CONSOLE_DIST: &str = "crates/sessiond-server/console";

/// `npm ci` (exactly the lockfile), then `npm run build` (client code
/// generated from `proto`, type check, vite), then
/// [`CONSOLE_DIST`] must be what is committed: a fresh clone's `cargo build`
/// embeds the committed files.
pub fn build_and_check(root: &Path) -> anyhow::Result<()> {
    let web = root.join("web");
    require_node()?;
    let mut ci = command("npm", &["ci", "--no-audit", "--no-fund"]);
    ci.current_dir(&web);
    step("web: npm ci", ci)?;
    let mut build = command("npm", &["run", "build"]);
    build.current_dir(&web);
    step("web: build", build)?;
    let out = command("git", &["status", "--porcelain", "--", CONSOLE_DIST])
        .current_dir(root)
        .output()
        .with_context(|| format!("git status {CONSOLE_DIST}"))?;
    let changed = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() || !changed.trim().is_empty() {
        bail!(
            "{CONSOLE_DIST} differs from a fresh build of web/ (run `npm ci && npm run build` in \
             web/ and commit {CONSOLE_DIST}):\n{changed}"
        );
    }
    Ok(())
}

/// The browser suite (`web/e2e`, node's test runner): real sessiond,
/// agentctl and demo agent from `bin_dir`, Debian's Chromium. The caller
/// runs it (and counts its tests in `ci`'s total).
pub fn browser_suite(root: &Path, bin_dir: &Path) -> std::process::Command {
    let mut test = command(
        "node",
        &[
            "--test",
            "--test-concurrency=1",
            "--test-timeout=600000",
            "e2e/",
        ],
    );
    test.current_dir(root.join("web"))
        .env("SESSIOND_BIN_DIR", bin_dir)
        .env("SESSIOND_E2E_OUT", root.join("target/web-e2e"))
        .env("CHROMIUM", "/usr/bin/chromium");
    test
}

fn require_node() -> anyhow::Result<()> {
    let ok = command("node", &["--version"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        bail!(
            "node (20+) and npm are needed to build and test the web console (web/); install Node.js"
        );
    }
    Ok(())
}
