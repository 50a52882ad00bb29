//! Configuration errors through the binary: each names its key.

use crate::support::*;

#[test]
fn serving_without_a_token_must_be_asked_for() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().display().to_string();
    let (ok, stderr) = run_sessiond(&["serve", "--data-dir", &data], &[]);
    assert!(!ok);
    assert!(stderr.contains("auth.tokens: no API token"), "{stderr}");
}

/// The binary registers only the built-in drivers: a custom default
/// runtime is a valid name, but `serve` stops at startup saying that no
/// driver serves it, before it listens or opens the store. An invalid name
/// is a configuration error naming its key.
#[test]
fn a_custom_default_runtime_needs_an_embedder() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().display().to_string();
    let (ok, stderr) = run_sessiond(
        &[
            "serve",
            "--data-dir",
            &data,
            "--listen",
            "127.0.0.1:0",
            "--default-runtime",
            "vm",
        ],
        &[("SESSIOND_API_TOKENS", TOKEN)],
    );
    assert!(!ok);
    assert!(
        stderr.contains("executors.default_runtime: no executor driver is registered for vm")
            && stderr.contains("the sessiond binary drives only the built-in runtimes"),
        "{stderr}"
    );
    assert!(
        !dir.path().join("sessiond.sqlite3").exists(),
        "store not opened"
    );
    let (ok, stderr) = run_sessiond(
        &[
            "serve",
            "--data-dir",
            &data,
            "--default-runtime",
            "Not A Name",
        ],
        &[("SESSIOND_API_TOKENS", TOKEN)],
    );
    assert!(!ok);
    assert!(stderr.contains("executors.default_runtime:"), "{stderr}");
}

#[test]
fn insecure_mode_refuses_a_non_loopback_address() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().display().to_string();
    let (ok, stderr) = run_sessiond(
        &[
            "serve",
            "--data-dir",
            &data,
            "--insecure-no-auth",
            "--listen",
            "0.0.0.0:0",
        ],
        &[],
    );
    assert!(!ok);
    assert!(
        stderr.contains("auth.insecure_no_auth: refuses"),
        "{stderr}"
    );
}

#[test]
fn config_file_errors_name_their_keys_and_env_overrides_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("sessiond.toml");
    std::fs::write(
        &file,
        "[executors.docker]\nenabled = true\nimage = \"\"\n[recovery]\nmode = \"sometimes\"\n",
    )
    .unwrap();
    let data = dir.path().display().to_string();
    let config = file.display().to_string();
    let (ok, stderr) = run_sessiond(
        &["serve", "--data-dir", &data, "--config", &config],
        &[("SESSIOND_API_TOKENS", TOKEN)],
    );
    assert!(!ok);
    assert!(
        stderr.contains("executors.docker.image: must not be empty"),
        "{stderr}"
    );
    assert!(stderr.contains("recovery.mode:"), "{stderr}");
    // The environment wins over the file.
    let (ok, stderr) = run_sessiond(
        &["serve", "--data-dir", &data, "--config", &config],
        &[
            ("SESSIOND_API_TOKENS", TOKEN),
            ("SESSIOND_DOCKER_ENABLED", "false"),
            ("SESSIOND_RECOVERY_MODE", "on_demand"),
            ("SESSIOND_LISTEN", "not-an-address"),
        ],
    );
    assert!(!ok);
    assert!(!stderr.contains("executors.docker.image"), "{stderr}");
    assert!(!stderr.contains("recovery.mode"), "{stderr}");
    assert!(stderr.contains("listen: \"not-an-address\""), "{stderr}");
}

#[test]
fn unknown_keys_in_the_file_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("sessiond.toml");
    std::fs::write(&file, "[recovery]\nconcurency = 4\n").unwrap();
    let (ok, stderr) = run_sessiond(
        &["serve", "--config", &file.display().to_string()],
        &[("SESSIOND_API_TOKENS", TOKEN)],
    );
    assert!(!ok);
    assert!(stderr.contains("concurency"), "{stderr}");
}
