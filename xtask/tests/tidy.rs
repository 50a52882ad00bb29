//! Repository hygiene checks that guard the architecture (the layering in
//! docs/ARCHITECTURE.md, "Layers").

use std::process::Command;

/// `sessiond-domain` has no IO runtime and no serialization: nothing in its
/// normal dependency graph may be one of these crates.
#[test]
fn domain_has_no_io_or_serialization_dependencies() {
    const FORBIDDEN: &[&str] = &[
        "tokio",
        "async-std",
        "serde",
        "serde_json",
        "prost",
        "tonic",
        "diesel",
        "bollard",
        "sqlx",
        "hyper",
    ];
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let out = Command::new(cargo)
        .args([
            "tree",
            "-p",
            "sessiond-domain",
            "-e",
            "normal",
            "--prefix",
            "none",
            "--locked",
        ])
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .expect("run cargo tree");
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tree = String::from_utf8_lossy(&out.stdout);
    assert!(
        tree.contains("sessiond-domain"),
        "unexpected cargo tree output:\n{tree}"
    );
    let offending: Vec<&str> = tree
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| FORBIDDEN.contains(name))
        .collect();
    assert!(
        offending.is_empty(),
        "sessiond-domain depends on {offending:?}:\n{tree}"
    );
}
