//! A Docker engine for the tests, and the agentctl image, with no registry.
//!
//! [`Engine::ensure`] finds a running engine (`DOCKER_HOST`, else the default
//! socket) or starts a private `dockerd`: no bridge network (the machines allow
//! loopback traffic only),
//! no iptables/NAT rules, its own data root, exec root, pid file and socket
//! under a directory of ours. The returned guard stops that dockerd (by its
//! pid) and removes the directory when dropped. Installing `docker.io` is done
//! here too when `dockerd` is missing.
//!
//! [`build_image`] assembles a root filesystem from files of this machine
//! (agentctl, acp-demo-agent, git, a shell, the shared libraries they link and
//! the dynamic loader), and `docker import`s it as [`IMAGE`]. Users with a
//! registry can build the same image from the repository's `Dockerfile`.

use std::{
    collections::BTreeSet,
    fs,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use sessiond_testkit::dockerd;

/// The image the Docker executor tests (and `sessiond` by default) use.
pub const IMAGE: &str = "sessiond-agentctl:dev";

const DEFAULT_SOCKET: &str = "/var/run/docker.sock";

/// A usable Docker engine; stops the dockerd it started when dropped.
#[derive(Debug)]
pub struct Engine {
    host: String,
    owned: Option<OwnedDaemon>,
}

#[derive(Debug)]
struct OwnedDaemon {
    child: Child,
    dir: PathBuf,
}

impl Engine {
    /// `DOCKER_HOST` when set (it must answer), else the default socket when
    /// an engine answers there, else a dockerd of our own. Fails when no
    /// engine can be had.
    pub fn ensure() -> anyhow::Result<Self> {
        if let Some(engine) = Self::running()? {
            return Ok(engine);
        }
        ensure_dockerd_installed()?;
        Self::start_own()
    }

    /// An engine that already runs: `DOCKER_HOST` when set (an error when it
    /// does not answer), else the default socket.
    pub fn running() -> anyhow::Result<Option<Self>> {
        if let Ok(host) = std::env::var("DOCKER_HOST")
            && !host.is_empty()
        {
            if dockerd::answers(&host) {
                eprintln!("xtask: using the Docker engine at DOCKER_HOST={host}");
                return Ok(Some(Self { host, owned: None }));
            }
            bail!("DOCKER_HOST={host} is set but no Docker engine answers there");
        }
        let default = format!("unix://{DEFAULT_SOCKET}");
        if Path::new(DEFAULT_SOCKET).exists() && dockerd::answers(&default) {
            eprintln!("xtask: using the running Docker engine at {default}");
            return Ok(Some(Self {
                host: default,
                owned: None,
            }));
        }
        Ok(None)
    }

    /// `unix:///...` address of the engine, for `DOCKER_HOST`.
    pub fn host(&self) -> &str {
        &self.host
    }

    fn start_own() -> anyhow::Result<Self> {
        // Short path: containerd's sockets live under the exec root and unix
        // socket paths are limited to 108 bytes.
        let dir = std::env::temp_dir().join(format!("sessiond-dockerd-{}", std::process::id()));
        if dir.exists() {
            fs::remove_dir_all(&dir).with_context(|| format!("clearing {}", dir.display()))?;
        }
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let socket = dir.join("docker.sock");
        let host = format!("unix://{}", socket.display());
        let log_path = dir.join("dockerd.log");
        let log = fs::File::create(&log_path).context("creating dockerd.log")?;
        let mut cmd = dockerd::command(&dir, &host).context("dockerd not found")?;
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        eprintln!("xtask: starting {cmd:?}");
        let child = cmd.spawn().context("starting dockerd")?;
        let mut engine = Self {
            host,
            owned: Some(OwnedDaemon { child, dir }),
        };

        let started = Instant::now();
        let deadline = started + Duration::from_secs(60);
        loop {
            if socket.exists() && dockerd::answers(&engine.host) {
                eprintln!(
                    "xtask: dockerd (pid {}) ready at {} in {:.1}s",
                    engine.pid().unwrap_or_default(),
                    engine.host,
                    started.elapsed().as_secs_f64()
                );
                return Ok(engine);
            }
            let exited = match &mut engine.owned {
                Some(own) => own.child.try_wait()?,
                None => None,
            };
            if let Some(status) = exited {
                bail!(
                    "dockerd exited ({status}) before it was ready:\n{}",
                    tail(&log_path, 30)
                );
            }
            if Instant::now() >= deadline {
                bail!("dockerd not ready within 60 s:\n{}", tail(&log_path, 30));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn pid(&self) -> Option<u32> {
        self.owned.as_ref().map(|o| o.child.id())
    }

    /// Stops our dockerd (TERM, then KILL after 30 s) and removes its directory.
    pub fn stop(mut self) -> anyhow::Result<()> {
        self.stop_owned()
    }

    fn stop_owned(&mut self) -> anyhow::Result<()> {
        let Some(mut own) = self.owned.take() else {
            return Ok(());
        };
        let pid = own.child.id();
        if own.child.try_wait()?.is_none() {
            // TERM lets dockerd stop its containers and its containerd.
            let _ = Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(30);
            while own.child.try_wait()?.is_none() {
                if Instant::now() >= deadline {
                    eprintln!("xtask: dockerd (pid {pid}) ignored TERM for 30 s, killing it");
                    own.child.kill()?;
                    own.child.wait()?;
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        eprintln!("xtask: dockerd (pid {pid}) stopped");
        // dockerd leaves its default network namespace (and anything a killed
        // container had) mounted under the exec root.
        dockerd::unmount_under(&own.dir);
        if let Err(e) = fs::remove_dir_all(&own.dir) {
            eprintln!("xtask: could not remove {}: {e}", own.dir.display());
        }
        Ok(())
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if let Err(e) = self.stop_owned() {
            eprintln!("xtask: stopping dockerd: {e:#}");
        }
    }
}

fn on_path(program: &str) -> bool {
    dockerd::find_program(program).is_some()
}

/// Installs Debian's `docker.io` (engine, containerd, runc, CLI) when
/// `dockerd` or the `docker` CLI is missing.
fn ensure_dockerd_installed() -> anyhow::Result<()> {
    if on_path("dockerd") && on_path("docker") {
        return Ok(());
    }
    eprintln!("xtask: dockerd not found, installing docker.io");
    crate::apt::apt_get(&["update", "-q"])?;
    crate::apt::apt_get(&[
        "install",
        "-y",
        "-q",
        "--no-install-recommends",
        "docker.io",
    ])?;
    if !on_path("dockerd") {
        bail!("docker.io installed but dockerd is still not on PATH");
    }
    Ok(())
}

/// Where cargo puts build output for this workspace.
pub fn target_dir(root: &Path) -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) if !dir.is_empty() => root.join(dir),
        _ => root.join("target"),
    }
}

/// Assembles the image's root filesystem and imports it as [`IMAGE`].
/// `bin_dir` holds the built `agentctl` and `acp-demo-agent`.
pub fn build_image(engine: &Engine, bin_dir: &Path) -> anyhow::Result<()> {
    let started = Instant::now();
    let stage = std::env::temp_dir().join(format!("sessiond-rootfs-{}", std::process::id()));
    let tarball = stage.join("rootfs.tar");
    let result = write_rootfs_tar(bin_dir, &tarball).and_then(|()| import(engine, &tarball));
    let _ = fs::remove_dir_all(&stage);
    result?;
    eprintln!(
        "xtask: image {IMAGE} built in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// `docker import`s a root filesystem tarball as [`IMAGE`].
pub fn import(engine: &Engine, tarball: &Path) -> anyhow::Result<()> {
    run(Command::new("docker")
        .args(["-H", engine.host(), "import"])
        .args(["--change", "ENV PATH=/usr/local/bin:/usr/bin:/bin"])
        .args(["--change", "ENV HOME=/root"])
        .args(["--change", "WORKDIR /workspace"])
        .args(["--change", r#"CMD ["/usr/local/bin/agentctl", "--help"]"#])
        .arg(tarball)
        .arg(IMAGE)
        .stdout(Stdio::null()))
}

/// Writes the image's root filesystem as a tarball at `tarball`: agentctl and
/// acp-demo-agent from `bin_dir`, git, `/bin/sh` (dash), the shared libraries
/// they link and the dynamic loader, per `ldd`.
pub fn write_rootfs_tar(bin_dir: &Path, tarball: &Path) -> anyhow::Result<()> {
    let stage = tarball.with_extension("d");
    if stage.exists() {
        fs::remove_dir_all(&stage)?;
    }
    let rootfs = stage.join("rootfs");
    fs::create_dir_all(&rootfs)?;
    let result = assemble(bin_dir, &rootfs, tarball);
    let _ = fs::remove_dir_all(&stage);
    result
}

fn assemble(bin_dir: &Path, rootfs: &Path, tarball: &Path) -> anyhow::Result<()> {
    let git = ["/usr/bin/git", "/usr/local/bin/git"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .context("git not found (install Debian's git)")?;
    let shell = ["/usr/bin/dash", "/bin/dash"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .context("dash not found")?;
    let binaries = [
        (bin_dir.join("agentctl"), "usr/local/bin/agentctl"),
        (
            bin_dir.join("acp-demo-agent"),
            "usr/local/bin/acp-demo-agent",
        ),
        (git, "usr/bin/git"),
        (shell, "bin/sh"),
    ];
    let mut libraries = BTreeSet::new();
    for (src, dest) in &binaries {
        if !src.is_file() {
            bail!(
                "{} not found: build it first (`cargo build --bins`)",
                src.display()
            );
        }
        copy_file(src, &rootfs.join(dest))?;
        libraries.extend(linked_libraries(src)?);
    }
    for lib in &libraries {
        let rel = lib.strip_prefix("/").unwrap_or(lib);
        copy_file(lib, &rootfs.join(rel))?;
    }
    for dir in ["tmp", "root", "workspace", "run/sessiond", "etc"] {
        fs::create_dir_all(rootfs.join(dir))?;
    }
    fs::set_permissions(rootfs.join("tmp"), fs::Permissions::from_mode(0o1777))?;
    fs::write(rootfs.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n")?;
    fs::write(rootfs.join("etc/group"), "root:x:0:\n")?;
    // Worktrees are bind-mounted from the host and owned by its users.
    fs::write(rootfs.join("etc/gitconfig"), "[safe]\n\tdirectory = *\n")?;

    if let Some(parent) = tarball.parent() {
        fs::create_dir_all(parent)?;
    }
    run(Command::new("tar")
        .args(["--numeric-owner", "--owner=0", "--group=0", "-C"])
        .arg(rootfs)
        .arg("-cf")
        .arg(tarball)
        .arg("."))?;
    eprintln!(
        "xtask: root filesystem of {} binaries and {} shared libraries in {}",
        binaries.len(),
        libraries.len(),
        tarball.display()
    );
    Ok(())
}

/// Absolute paths `ldd` lists for `binary`: its shared libraries and loader.
fn linked_libraries(binary: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .context("running ldd")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        // Statically linked binaries make ldd fail; they need nothing.
        if text.contains("not a dynamic executable")
            || String::from_utf8_lossy(&out.stderr).contains("not a dynamic executable")
        {
            return Ok(Vec::new());
        }
        bail!(
            "ldd {} failed: {}",
            binary.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut libs = Vec::new();
    for line in text.lines() {
        if line.contains("not found") {
            bail!(
                "{}: a shared library is missing: {}",
                binary.display(),
                line.trim()
            );
        }
        libs.extend(
            line.split_whitespace()
                .filter(|t| t.starts_with('/'))
                .map(PathBuf::from),
        );
    }
    Ok(libs)
}

/// Copies the file `src` points to (following symlinks), keeping its mode.
fn copy_file(src: &Path, dest: &Path) -> anyhow::Result<()> {
    if let Some(parent) = dest.parent() {
        fs::create_dir_all(parent)?;
    }
    fs::copy(src, dest)
        .with_context(|| format!("copying {} to {}", src.display(), dest.display()))?;
    Ok(())
}

fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd.status().with_context(|| format!("starting {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed ({status})");
    }
    Ok(())
}

fn tail(path: &Path, lines: usize) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
