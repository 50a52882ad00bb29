//! The ready-made operations files under `docs/ops/` stay true: the alert
//! rules pass `promtool check rules`, the Grafana dashboard is valid JSON
//! with queries, and every `sessiond_*` metric either file names is one a
//! running `sessiond` really exposes.

use std::{collections::BTreeSet, path::PathBuf, process::Command};

use crate::{
    metrics::{http_get, promtool_check_metrics},
    support::*,
};

fn ops_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/ops")
}

/// `sessiond_*` names in `text` (PromQL, JSON or YAML).
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("sessiond_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.insert(tail[..end].to_owned());
        rest = &tail[end..];
    }
    names
}

/// Every PromQL expression of the dashboard's panels.
fn dashboard_exprs(dashboard: &serde_json::Value) -> Vec<String> {
    let mut exprs = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        let targets = panel["targets"].as_array().expect("panel targets");
        assert!(!targets.is_empty(), "panel without queries: {panel}");
        for t in targets {
            exprs.push(t["expr"].as_str().expect("target expr").to_owned());
        }
    }
    exprs
}

#[tokio::test]
async fn dashboard_and_alert_rules_use_only_exposed_metrics() {
    let rules = ops_dir().join("sessiond-alerts.yml");
    let out = Command::new("promtool")
        .args(["check", "rules"])
        .arg(&rules)
        .output()
        .expect("promtool not found: install Debian's `prometheus` package (cargo xtask ci does)");
    assert!(
        out.status.success(),
        "promtool check rules {}:\n{}{}",
        rules.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(ops_dir().join("sessiond-dashboard.json")).unwrap(),
    )
    .expect("docs/ops/sessiond-dashboard.json is not valid JSON");
    let exprs = dashboard_exprs(&dashboard);
    assert!(exprs.len() >= 10, "{exprs:?}");

    // What a running sessiond exposes (every family, with or without samples).
    let dir = tempfile::tempdir().unwrap();
    let server = start(&dir.path().join("data"), &[]);
    let mut c = sessions(&server).await;
    create_task(&mut c, "ops").await;
    let (status, text) = http_get(server.metrics.as_deref().unwrap(), "/metrics").await;
    assert!(status.contains(" 200"), "{status}");
    promtool_check_metrics(&text);
    let mut exposed = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            exposed.insert(name.to_owned());
            if kind == "histogram" {
                for suffix in ["_bucket", "_sum", "_count"] {
                    exposed.insert(format!("{name}{suffix}"));
                }
            }
        }
    }

    let used_by_dashboard = metric_names(&exprs.join("\n"));
    let used_by_rules = metric_names(&std::fs::read_to_string(&rules).unwrap());
    for (file, used) in [
        ("sessiond-dashboard.json", &used_by_dashboard),
        ("sessiond-alerts.yml", &used_by_rules),
    ] {
        assert!(!used.is_empty(), "{file} names no sessiond metric");
        let unknown: Vec<_> = used.difference(&exposed).collect();
        assert!(
            unknown.is_empty(),
            "docs/ops/{file} uses metrics sessiond does not expose: {unknown:?}\nexposed: {exposed:?}"
        );
    }
}
