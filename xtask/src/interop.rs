//! The virtualenv of the interop test agent (`tests/interop/python_agent.py`,
//! written on the Python `agent-client-protocol` SDK): `target/interop-venv`,
//! with the pinned `tests/interop/requirements.txt`. Quick when it is there:
//! a stamp holds the requirements it was made from, and the SDK must import.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context, bail};

use crate::{apt, docker, step};

/// Where the venv lives under the target directory; the interop test looks
/// for `<target>/interop-venv/bin/python3`.
const VENV: &str = "interop-venv";

/// Makes (or checks) the venv; returns its interpreter.
pub fn ensure_venv(root: &Path) -> anyhow::Result<PathBuf> {
    let requirements = root.join("tests/interop/requirements.txt");
    let wanted = fs::read_to_string(&requirements)
        .with_context(|| format!("reading {}", requirements.display()))?;
    let venv = docker::target_dir(root).join(VENV);
    let python = venv.join("bin/python3");
    let stamp = venv.join("sessiond-requirements.txt");
    if fs::read_to_string(&stamp).is_ok_and(|s| s == wanted) && imports_sdk(&python) {
        eprintln!("xtask: {} is up to date", venv.display());
        return Ok(python);
    }
    let base = base_python()?;
    step(
        "interop venv",
        command(&base, &["-m", "venv", "--clear"], &[venv.as_os_str()]),
    )?;
    step(
        "interop venv: pip install",
        command(
            python.as_os_str(),
            &[
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "--no-input",
                "-r",
            ],
            &[requirements.as_os_str()],
        ),
    )?;
    if !imports_sdk(&python) {
        bail!(
            "{} cannot import the ACP SDK (`acp`) after installing {}",
            python.display(),
            requirements.display()
        );
    }
    fs::write(&stamp, wanted).with_context(|| format!("writing {}", stamp.display()))?;
    Ok(python)
}

/// A Python 3 that can make a venv (`venv` and `ensurepip`); Debian's
/// `python3-venv` is installed when none can.
fn base_python() -> anyhow::Result<PathBuf> {
    let candidates = ["/usr/bin/python3", "python3"];
    let usable = |p: &str| {
        Command::new(p)
            .args(["-c", "import venv, ensurepip"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if let Some(p) = candidates.iter().find(|p| usable(p)) {
        return Ok(PathBuf::from(p));
    }
    eprintln!("xtask: no Python 3 with venv; installing python3-venv");
    apt::apt_get(&["update", "-q"])?;
    apt::apt_get(&[
        "install",
        "-y",
        "-q",
        "--no-install-recommends",
        "python3",
        "python3-venv",
    ])?;
    if usable(candidates[0]) {
        return Ok(PathBuf::from(candidates[0]));
    }
    bail!("python3-venv is installed but /usr/bin/python3 still cannot make a venv")
}

fn imports_sdk(python: &Path) -> bool {
    python.is_file()
        && Command::new(python)
            .args(["-c", "import acp, acp.schema"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
}

fn command(
    program: impl AsRef<std::ffi::OsStr>,
    args: &[&str],
    paths: &[&std::ffi::OsStr],
) -> Command {
    let mut cmd = Command::new(program);
    cmd.args(args).args(paths).stdin(Stdio::null());
    cmd
}
