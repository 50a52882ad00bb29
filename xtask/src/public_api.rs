//! The public-API snapshot of the library crates, on stable Rust (no
//! rustdoc JSON): every `pub` declaration line in their `src/` (items,
//! fields, re-exports; `pub(crate)` and test modules left out), one line
//! each, prefixed with its file, checked in as `docs/public-api.txt`.
//!
//! The test `public_api_matches_the_snapshot` fails when the listing
//! differs, so a removed, renamed or re-typed public item (a one-line
//! signature or field) cannot land unnoticed; an intended change is
//! recorded with `cargo xtask public-api` and shows in review as a diff of
//! that file. It does not see: enum variants, the lines of a signature
//! after its first, trait impls (`Debug`, `From`, ...), generic bounds in
//! `where` clauses, and whether a `pub` item in a private module is
//! reachable at all — a semver checker would; this is the cheap guard.

use std::path::{Path, PathBuf};

use crate::LIBRARY_CRATES;

/// Where the snapshot is kept.
pub fn snapshot_path(root: &Path) -> PathBuf {
    root.join("docs/public-api.txt")
}

/// The listing of the library crates' public declarations.
pub fn listing(root: &Path) -> anyhow::Result<String> {
    let mut out = String::from(
        "# Public API of the library crates: `cargo xtask public-api` writes this file;\n\
         # xtask's test public_api_matches_the_snapshot compares it (see xtask/src/public_api.rs).\n",
    );
    for krate in LIBRARY_CRATES {
        let src = root.join("crates").join(krate).join("src");
        let mut files = Vec::new();
        collect(&src, &mut files)?;
        files.sort();
        for file in files {
            let text = std::fs::read_to_string(&file)?;
            let rel = file.strip_prefix(root)?.display().to_string();
            for line in public_lines(&text) {
                out.push_str(&format!("{rel}: {line}\n"));
            }
        }
    }
    Ok(out)
}

fn collect(dir: &Path, files: &mut Vec<PathBuf>) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            collect(&path, files)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    Ok(())
}

/// Marks an item that exists only in builds with the `test-hooks` feature
/// (off by default): not part of the public API.
const TEST_HOOK: &str = "#[cfg(feature = \"test-hooks\")]";

/// The `pub` declaration lines of one file, normalised, up to its test
/// module, without those under [`TEST_HOOK`].
fn public_lines(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut lines = text.lines().peekable();
    let mut test_hook = false;
    while let Some(line) = lines.next() {
        let t = line.trim();
        if t == "#[cfg(test)]"
            && lines
                .peek()
                .is_some_and(|next| next.trim_start().starts_with("mod "))
        {
            break;
        }
        if t == TEST_HOOK {
            test_hook = true;
            continue;
        }
        // The marker covers the item it is on (other attributes may sit
        // between them).
        if t.starts_with("#[") || t.starts_with("//") {
            continue;
        }
        if std::mem::take(&mut test_hook) || !t.starts_with("pub ") {
            continue;
        }
        let mut decl = t.split_whitespace().collect::<Vec<_>>().join(" ");
        for tail in [" {", " {}", " = {", ";"] {
            if let Some(stripped) = decl.strip_suffix(tail) {
                decl = stripped.to_owned();
            }
        }
        out.push(decl);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn public_api_matches_the_snapshot() {
        let root = crate::workspace_root();
        let now = listing(&root).unwrap();
        let stored = std::fs::read_to_string(snapshot_path(&root)).unwrap_or_default();
        if now != stored {
            let added: Vec<&str> = now
                .lines()
                .filter(|l| !stored.lines().any(|s| s == *l))
                .collect();
            let removed: Vec<&str> = stored
                .lines()
                .filter(|l| !now.lines().any(|n| n == *l))
                .collect();
            panic!(
                "the public API of the library crates changed; if that is intended, run \
                 `cargo xtask public-api` and commit docs/public-api.txt\n\
                 removed or changed:\n  {}\nadded or changed:\n  {}",
                removed.join("\n  "),
                added.join("\n  ")
            );
        }
    }

    #[test]
    fn listing_takes_pub_lines_and_skips_tests_and_crate_visibility() {
        let text = "pub struct A {\n    pub x: u32,\n    y: u8,\n}\npub(crate) fn hidden() {}\n\
                    pub   async fn f(a: u32) -> u32 {\n#[cfg(test)]\nmod tests {\n    pub fn t() {}\n}\n";
        assert_eq!(
            public_lines(text),
            vec![
                "pub struct A",
                "pub x: u32,",
                "pub async fn f(a: u32) -> u32"
            ]
        );
    }

    #[test]
    fn listing_skips_test_hooks() {
        let text = "#[cfg(feature = \"test-hooks\")]\n#[must_use]\npub fn gate() {}\npub fn kept() {}\n\
                    #[cfg(feature = \"test-hooks\")]\nfn private() {}\npub fn also_kept() {}\n";
        assert_eq!(
            public_lines(text),
            vec!["pub fn kept()", "pub fn also_kept()"]
        );
    }
}
