//! The Claude Code ACP adapter (`@zed-industries/claude-agent-acp`, which
//! runs the Claude Code CLI of `@anthropic-ai/claude-agent-sdk` under node)
//! that the claude tests run offline against a fake Messages API
//! (`tests/claude/fake_anthropic.mjs`): `npm ci` of the committed
//! `tests/claude/package.json` and `package-lock.json` into
//! `target/claude-acp`. Quick when it is there: a stamp holds the lock file it
//! was installed from, and the adapter's installed version must be the pinned
//! one.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context, bail};

use crate::{docker, step};

/// Where the install lives under the target directory; the tests look for
/// `<target>/claude-acp/node_modules/@zed-industries/claude-agent-acp`.
const DIR: &str = "claude-acp";
const PACKAGE: &str = "@zed-industries/claude-agent-acp";

/// Installs (or checks) the pinned adapter; returns its entry point.
pub fn ensure_claude_acp(root: &Path) -> anyhow::Result<PathBuf> {
    let source = root.join("tests/claude");
    let manifest = fs::read_to_string(source.join("package.json"))
        .with_context(|| format!("reading {}", source.join("package.json").display()))?;
    let lock = fs::read_to_string(source.join("package-lock.json"))
        .with_context(|| format!("reading {}", source.join("package-lock.json").display()))?;
    let pinned = pinned_version(&manifest)?;
    let dir = docker::target_dir(root).join(DIR);
    let package = dir.join("node_modules").join(PACKAGE);
    let entry = package.join("dist/index.js");
    let stamp = dir.join("sessiond-package-lock.json");
    if fs::read_to_string(&stamp).is_ok_and(|s| s == lock)
        && installed_version(&package).as_deref() == Some(pinned.as_str())
        && entry.is_file()
    {
        eprintln!(
            "xtask: {} {pinned} is installed in {}",
            PACKAGE,
            dir.display()
        );
        return Ok(entry);
    }
    for tool in ["node", "npm"] {
        if !runs(tool) {
            bail!(
                "`{tool}` is needed to install {PACKAGE} for the claude tests (Node 20 or newer with npm)"
            );
        }
    }
    let _ = fs::remove_file(&stamp);
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    fs::write(dir.join("package.json"), &manifest)?;
    fs::write(dir.join("package-lock.json"), &lock)?;
    // `npm ci`: exactly the lock file's packages (it removes node_modules
    // first); no install scripts, none of the packages needs one.
    let mut ci = Command::new("npm");
    ci.args([
        "ci",
        "--no-audit",
        "--no-fund",
        "--ignore-scripts",
        "--loglevel=error",
        "--prefix",
    ])
    .arg(&dir)
    .stdin(Stdio::null());
    step(&format!("claude-acp: npm ci {PACKAGE}@{pinned}"), ci)?;
    match installed_version(&package) {
        Some(v) if v == pinned && entry.is_file() => {}
        other => bail!(
            "after npm ci, {} holds {PACKAGE} {other:?} (want {pinned}, with dist/index.js)",
            dir.display()
        ),
    }
    fs::write(&stamp, lock).with_context(|| format!("writing {}", stamp.display()))?;
    Ok(entry)
}

/// The exact version `tests/claude/package.json` pins the adapter at.
fn pinned_version(manifest: &str) -> anyhow::Result<String> {
    let v: serde_json::Value =
        serde_json::from_str(manifest).context("tests/claude/package.json")?;
    let version = v["dependencies"][PACKAGE]
        .as_str()
        .with_context(|| format!("tests/claude/package.json has no dependency {PACKAGE}"))?;
    if !version.chars().all(|c| c.is_ascii_digit() || c == '.') {
        bail!("tests/claude/package.json: pin {PACKAGE} to an exact version, not {version:?}");
    }
    Ok(version.to_owned())
}

fn installed_version(package: &Path) -> Option<String> {
    let text = fs::read_to_string(package.join("package.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v["version"].as_str().map(str::to_owned)
}

fn runs(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[cfg(test)]
mod tests {
    use super::pinned_version;

    /// The committed manifest pins one exact version, and the lock file
    /// resolves that very version.
    #[test]
    fn the_adapter_is_pinned_exactly() {
        let root = crate::workspace_root().join("tests/claude");
        let manifest = std::fs::read_to_string(root.join("package.json")).unwrap();
        let pinned = pinned_version(&manifest).unwrap();
        let lock: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(root.join("package-lock.json")).unwrap())
                .unwrap();
        assert_eq!(
            lock["packages"]["node_modules/@zed-industries/claude-agent-acp"]["version"],
            pinned.as_str(),
            "package-lock.json is stale: run `npm install --package-lock-only` in tests/claude"
        );
        assert_eq!(
            lock["packages"][""]["dependencies"]["@zed-industries/claude-agent-acp"],
            pinned.as_str()
        );
    }
}
