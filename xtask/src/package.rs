//! The library crates' packages build from their tarballs alone: every file
//! a build script or an `include_*!` / `embed_migrations!` reads (the
//! protos, the migrations, the console bundle) must be inside the crate.
//!
//! `cargo package` can verify that itself, but it compiles each package in
//! its own one-crate workspace: without this workspace's profiles and with
//! each crate's own feature set, so every dependency is compiled again, once
//! per crate — minutes per crate here (proto 4.7 min, executor 6 min on a
//! loaded 2-core machine). Instead the tarballs `cargo package --no-verify`
//! wrote are unpacked side by side into one throwaway workspace (the same
//! lockfile and profiles, the sessiond crates patched to the unpacked
//! copies, so nothing outside a tarball is on any path) and `cargo check`ed
//! there against the shared target directory: the build scripts run, the
//! macros that read files expand, every crate type-checks, and the
//! dependencies checked before are reused.

use std::path::Path;

use anyhow::{Context, bail};

use crate::{LIBRARY_CRATES, cargo, command, step};

/// Unpacks `target/package/<crate>-<version>.crate` of every library crate
/// into `target/package-check/` and checks them as one workspace.
pub fn check_tarballs(root: &Path, target: &Path) -> anyhow::Result<()> {
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).context("Cargo.toml")?;
    let version = workspace_version(&manifest)?;
    let dir = target.join("package-check");
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut members = Vec::new();
    for krate in LIBRARY_CRATES {
        let name = format!("{krate}-{version}");
        let tarball = target.join("package").join(format!("{name}.crate"));
        if !tarball.is_file() {
            bail!(
                "{} is missing: package the library crates first",
                tarball.display()
            );
        }
        // `-m`: the files get the time of unpacking, not the fixed 2006
        // stamp `cargo package` writes, so a reused target directory sees
        // the sources as changed and never checks an older build.
        let mut untar = command("tar", &["-xmzf"]);
        untar.arg(&tarball).arg("-C").arg(&dir);
        step(&format!("unpack {name}"), untar)?;
        members.push(((*krate).to_owned(), name));
    }
    std::fs::write(dir.join("Cargo.toml"), check_manifest(&manifest, &members))?;
    std::fs::copy(root.join("Cargo.lock"), dir.join("Cargo.lock")).context("Cargo.lock")?;
    let mut check = cargo(&["check", "--workspace", "--offline", "--manifest-path"]);
    check
        .arg(dir.join("Cargo.toml"))
        .env("CARGO_TARGET_DIR", target);
    step("the library crates build from their tarballs", check)
}

/// `[workspace.package] version` of the root manifest.
fn workspace_version(manifest: &str) -> anyhow::Result<String> {
    let mut in_package = false;
    for line in manifest.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_package = line == "[workspace.package]";
        } else if in_package && let Some(v) = line.strip_prefix("version") {
            let v = v
                .trim_start()
                .trim_start_matches('=')
                .trim()
                .trim_matches('"');
            return Ok(v.to_owned());
        }
    }
    bail!("Cargo.toml has no [workspace.package] version")
}

/// The throwaway workspace: the unpacked packages as members, each sessiond
/// crate patched to its unpacked copy (the packaged manifests ask the
/// registry for them), and the root manifest's `[profile.*]` sections, so
/// the dependencies' artifacts of the main build are reused.
fn check_manifest(root_manifest: &str, members: &[(String, String)]) -> String {
    let mut out = String::from(
        "# Written by `cargo xtask ci` (xtask/src/package.rs): the library crates'\n\
         # packages, unpacked, as one workspace.\n[workspace]\nresolver = \"3\"\nmembers = [\n",
    );
    for (_, dir) in members {
        out.push_str(&format!("    {dir:?},\n"));
    }
    out.push_str("]\n\n[patch.crates-io]\n");
    for (krate, dir) in members {
        out.push_str(&format!("{krate} = {{ path = {dir:?} }}\n"));
    }
    let mut in_profile = false;
    for line in root_manifest.lines() {
        if line.trim_start().starts_with('[') {
            in_profile = line.trim_start().starts_with("[profile.");
            if in_profile {
                out.push('\n');
            }
        }
        if in_profile {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROOT: &str = "[workspace]\nmembers = [\"crates/*\"]\n\n[workspace.package]\n\
        version = \"0.3.1\"\nedition = \"2024\"\n\n[workspace.dependencies]\nx = \"1\"\n\n\
        [profile.dev]\ndebug = \"line-tables-only\"\n\n[profile.dev.package.\"*\"]\ndebug = false\n";

    #[test]
    fn reads_the_workspace_version() {
        assert_eq!(workspace_version(ROOT).unwrap(), "0.3.1");
        assert!(workspace_version("[package]\nversion = \"1.0.0\"\n").is_err());
    }

    #[test]
    fn the_check_workspace_patches_every_crate_and_keeps_the_profiles() {
        let members = [
            ("a".to_owned(), "a-0.3.1".to_owned()),
            ("b".to_owned(), "b-0.3.1".to_owned()),
        ];
        let m = check_manifest(ROOT, &members);
        assert!(
            m.contains("members = [\n    \"a-0.3.1\",\n    \"b-0.3.1\",\n]"),
            "{m}"
        );
        assert!(
            m.contains("a = { path = \"a-0.3.1\" }\nb = { path = \"b-0.3.1\" }"),
            "{m}"
        );
        assert!(
            m.contains("[profile.dev]\ndebug = \"line-tables-only\""),
            "{m}"
        );
        assert!(
            m.contains("[profile.dev.package.\"*\"]\ndebug = false"),
            "{m}"
        );
        assert!(!m.contains("[workspace.dependencies]"), "{m}");
    }
}
