//! Checks of the house's shape that `cargo xtask ci` runs before building:
//!
//! - **Layering.** Each crate may depend (outside its tests) only on the
//!   workspace crates below it: domain at the bottom (no IO, no async
//!   runtime, no serialization or database derives), store and executor on
//!   it, the engine (`sessiond-engine`) on those, the server on the
//!   engine; the CLI and agentctl speak only the wire contracts; test
//!   support never ships in a production crate.
//! - **Self-contained docs.** What the code and docs cite is in the
//!   repository: no path or name of a document kept outside it; every
//!   relative link of the markdown leads to a file (and heading) that
//!   exists (`links.rs`).
//! - **A codemap one reads in one sitting.** `docs/ARCHITECTURE.md` stays
//!   under [`ARCHITECTURE_MAX_BYTES`]; decisions go to `docs/decisions/`.
//! - **No import loop of more than two files** inside a crate, beyond the
//!   ones `xtask/house-allow-loops.txt` lists and that may only shrink
//!   (`loops.rs`).
//! - **Typed agentctl calls.** Only `sessiond-executor` uses the generated
//!   agentctl client (`AgentctlClient::raw`); every other crate calls the
//!   typed methods, which choose the deadline and say what a failure means.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, bail};

mod links;
mod loops;

/// The codemap's budget: a newcomer reads it in about twenty minutes.
pub const ARCHITECTURE_MAX_BYTES: usize = 35_000;

/// Workspace crates each crate may use outside its tests (dev-dependencies
/// are free). A crate missing here may use none.
const ALLOWED: &[(&str, &[&str])] = &[
    ("sessiond-domain", &[]),
    ("sessiond-proto", &[]),
    ("sessiond-telemetry", &[]),
    ("sessiond-testkit", &[]),
    ("acp-demo-agent", &[]),
    ("sessiond-store", &["sessiond-domain"]),
    ("sessiond-executor", &["sessiond-domain", "sessiond-proto"]),
    (
        "sessiond-engine",
        &[
            "sessiond-domain",
            "sessiond-proto",
            "sessiond-store",
            "sessiond-executor",
        ],
    ),
    (
        "sessiond-server",
        &[
            "sessiond-domain",
            "sessiond-proto",
            "sessiond-store",
            "sessiond-executor",
            "sessiond-engine",
            "sessiond-telemetry",
        ],
    ),
    ("sessiond-cli", &["sessiond-proto"]),
    ("agentctl", &["sessiond-proto", "sessiond-telemetry"]),
    // Tools, not shipped in a library: they drive everything.
    (
        "sessiond-bench",
        &[
            "sessiond-domain",
            "sessiond-proto",
            "sessiond-store",
            "sessiond-executor",
            "sessiond-engine",
            "sessiond-testkit",
        ],
    ),
    ("xtask", &["sessiond-testkit"]),
];

/// External crates the pure domain crate must not use: it holds the rules,
/// not the IO or the encodings.
const DOMAIN_FORBIDDEN: &[&str] = &[
    "tokio",
    "serde",
    "serde_json",
    "prost",
    "tonic",
    "diesel",
    "bollard",
    "reqwest",
    "hyper",
];

/// Names of documents that live outside the repository; citing them leaves
/// a reader who cloned the project with nothing to follow.
const OUTSIDE_DOCS: &[&str] = &[
    "../shared",
    "DESIGN.md",
    "CONVENTIONS.md",
    "session-resumption-lld",
    "DESIGN §",
    "seed §",
    "the seed's",
    "seed \"",
    "(seed:",
    "seed Startup",
    "seed Session",
    "seed steps",
    "design card",
];

/// Checks the layering of `cargo metadata`, the docs' citations and links,
/// the codemap's size and the crates' import loops.
pub fn check(root: &Path) -> anyhow::Result<()> {
    let mut problems = layering(root)?;
    let files = tracked_files(root)?;
    problems.extend(citations(root, &files));
    problems.extend(markdown_links(root, &files));
    problems.extend(architecture_size(root)?);
    problems.extend(loops::check(root)?);
    problems.extend(raw_agentctl_calls(root, &files));
    if !problems.is_empty() {
        bail!("the house is out of shape:\n  {}", problems.join("\n  "));
    }
    Ok(())
}

fn layering(root: &Path) -> anyhow::Result<Vec<String>> {
    let out = std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["metadata", "--format-version", "1", "--no-deps", "--locked"])
        .current_dir(root)
        .output()
        .context("cargo metadata")?;
    if !out.status.success() {
        bail!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).context("cargo metadata")?;
    Ok(layering_of(&meta))
}

/// The layering problems of a `cargo metadata` document.
fn layering_of(meta: &serde_json::Value) -> Vec<String> {
    let allowed: BTreeMap<&str, &[&str]> = ALLOWED.iter().copied().collect();
    let packages = meta["packages"].as_array().cloned().unwrap_or_default();
    let ours: Vec<String> = packages
        .iter()
        .filter_map(|p| p["name"].as_str().map(str::to_owned))
        .collect();
    let mut problems = Vec::new();
    for p in &packages {
        let name = p["name"].as_str().unwrap_or_default();
        let deps = p["dependencies"].as_array().cloned().unwrap_or_default();
        let may = allowed.get(name).copied().unwrap_or(&[]);
        if !allowed.contains_key(name) {
            problems.push(format!(
                "crate {name} has no place in the layering (xtask/src/house.rs ALLOWED)"
            ));
        }
        for d in &deps {
            let dep = d["name"].as_str().unwrap_or_default();
            // Dev-dependencies (tests) are free; build and normal ones are not.
            if d["kind"].as_str() == Some("dev") {
                continue;
            }
            if ours.iter().any(|o| o == dep) && !may.contains(&dep) {
                problems.push(format!(
                    "crate {name} depends on {dep}, which its layer may not use (allowed: {})",
                    if may.is_empty() {
                        "none".to_owned()
                    } else {
                        may.join(", ")
                    }
                ));
            }
            if name == "sessiond-domain" && DOMAIN_FORBIDDEN.contains(&dep) {
                problems.push(format!(
                    "sessiond-domain depends on {dep}: the domain holds pure rules, no IO or encodings"
                ));
            }
        }
    }
    problems
}

/// The files git tracks, relative to `root`.
fn tracked_files(root: &Path) -> anyhow::Result<Vec<String>> {
    let out = std::process::Command::new("git")
        .args(["ls-files", "-z"])
        .current_dir(root)
        .output()
        .context("git ls-files")?;
    if !out.status.success() {
        bail!(
            "git ls-files failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .split('\0')
        .filter(|f| !f.is_empty())
        .map(str::to_owned)
        .collect())
}

fn markdown_links(root: &Path, files: &[String]) -> Vec<String> {
    let mut problems = Vec::new();
    for file in files.iter().filter(|f| links::checked(f)) {
        let Ok(text) = std::fs::read_to_string(root.join(file)) else {
            continue;
        };
        problems.extend(links::check_file(root, file, &text));
    }
    problems
}

fn architecture_size(root: &Path) -> anyhow::Result<Vec<String>> {
    let path = root.join("docs/ARCHITECTURE.md");
    let len = std::fs::metadata(&path)
        .with_context(|| path.display().to_string())?
        .len();
    Ok(size_problem("docs/ARCHITECTURE.md", len as usize))
}

/// The codemap's size problem, if it is over budget.
fn size_problem(file: &str, len: usize) -> Vec<String> {
    if len <= ARCHITECTURE_MAX_BYTES {
        return Vec::new();
    }
    vec![format!(
        "{file} is {len} bytes, over its {ARCHITECTURE_MAX_BYTES}: keep it a codemap (where things are, invariants) and move rationale to docs/decisions/"
    )]
}

fn citations(root: &Path, files: &[String]) -> Vec<String> {
    let mut problems = Vec::new();
    for file in files {
        let file = file.as_str();
        let checked = [
            ".md", ".rs", ".toml", ".proto", ".ts", ".tsx", ".mjs", ".sql", ".yaml",
        ]
        .iter()
        .any(|ext| file.ends_with(ext));
        // This file names the documents it looks for.
        if !checked || file == "xtask/src/house.rs" || file.starts_with("web/src/gen/") {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(root.join(file)) else {
            continue;
        };
        problems.extend(citations_in(file, &text));
    }
    problems
}

/// Where the generated agentctl client may be used: the crate that wraps it.
const RAW_CLIENT_HOME: &str = "crates/sessiond-executor/";

fn raw_agentctl_calls(root: &Path, files: &[String]) -> Vec<String> {
    let mut problems = Vec::new();
    for file in files {
        // This file names the call it looks for.
        if !file.ends_with(".rs")
            || file.starts_with(RAW_CLIENT_HOME)
            || file == "xtask/src/house.rs"
        {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(root.join(file)) else {
            continue;
        };
        problems.extend(raw_calls_in(file, &text));
    }
    problems
}

/// Lines of `text` that call the generated agentctl client.
fn raw_calls_in(file: &str, text: &str) -> Vec<String> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| line.contains(".raw()"))
        .map(|(i, _)| {
            format!(
                "{file}:{}: calls AgentctlClient::raw outside {RAW_CLIENT_HOME}: use (or add) a typed method of AgentctlClient",
                i + 1
            )
        })
        .collect()
}

/// Lines of `text` that cite a document outside the repository.
fn citations_in(file: &str, text: &str) -> Vec<String> {
    text.lines()
        .enumerate()
        .filter_map(|(i, line)| {
            let name = OUTSIDE_DOCS.iter().find(|n| line.contains(*n))?;
            Some(format!(
                "{file}:{}: cites {name:?}, a document outside the repository (say it in our own words, or cite a file in the repository)",
                i + 1
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn package(name: &str, deps: &[(&str, Option<&str>)]) -> serde_json::Value {
        serde_json::json!({
            "name": name,
            "dependencies": deps.iter().map(|(d, kind)| serde_json::json!({"name": d, "kind": kind})).collect::<Vec<_>>(),
        })
    }

    #[test]
    fn a_crate_using_a_layer_above_it_is_reported_and_tests_are_free() {
        let meta = serde_json::json!({"packages": [
            package("sessiond-domain", &[("tokio", None)]),
            package("sessiond-store", &[("sessiond-domain", None), ("sessiond-engine", None), ("sessiond-testkit", Some("dev"))]),
            package("sessiond-engine", &[("sessiond-store", None)]),
            package("sessiond-testkit", &[]),
            package("newcomer", &[]),
        ]});
        let problems = layering_of(&meta);
        assert_eq!(problems.len(), 3, "{problems:#?}");
        assert!(
            problems[0].contains("sessiond-domain depends on tokio"),
            "{problems:#?}"
        );
        assert!(
            problems[1].contains("crate sessiond-store depends on sessiond-engine"),
            "{problems:#?}"
        );
        assert!(
            problems[2].contains("crate newcomer has no place"),
            "{problems:#?}"
        );
    }

    #[test]
    fn raw_agentctl_calls_are_reported_with_their_line() {
        let text = "let h = client.health().await?;\nlet r = client\n    .raw()\n    .prompt(p);\n";
        assert_eq!(
            raw_calls_in("crates/sessiond-engine/src/x.rs", text),
            vec!["crates/sessiond-engine/src/x.rs:3: calls AgentctlClient::raw outside crates/sessiond-executor/: use (or add) a typed method of AgentctlClient".to_owned()]
        );
    }

    #[test]
    fn the_codemap_over_its_budget_is_reported() {
        assert!(size_problem("docs/ARCHITECTURE.md", ARCHITECTURE_MAX_BYTES).is_empty());
        let problems = size_problem("docs/ARCHITECTURE.md", ARCHITECTURE_MAX_BYTES + 1);
        assert_eq!(problems.len(), 1);
        assert!(
            problems[0].starts_with("docs/ARCHITECTURE.md is 35001 bytes, over its 35000"),
            "{problems:#?}"
        );
    }

    #[test]
    fn citations_of_outside_documents_are_reported_with_their_line() {
        let text = "ok\nsee DESIGN.md section 3\nthe RNG seed is printed\n(seed {seed}) seed: 42\n/// Startup recovery (seed \"Startup Flow\")\n";
        assert_eq!(
            citations_in("a.rs", text),
            vec![
                "a.rs:2: cites \"DESIGN.md\", a document outside the repository (say it in our own words, or cite a file in the repository)".to_owned(),
                "a.rs:5: cites \"seed \\\"\", a document outside the repository (say it in our own words, or cite a file in the repository)".to_owned(),
            ]
        );
    }
}
