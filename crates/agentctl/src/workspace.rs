//! File operations confined to the workspace root.
//!
//! Every path is resolved by [`Workspace::resolve`]: NUL bytes are refused,
//! `..` is applied lexically and may not climb above the root, the longest
//! existing prefix is canonicalized (following symlinks) and must stay inside
//! the root, and the rest may only name plain components. Files and
//! directories are then opened beneath a descriptor of the root held since
//! [`Workspace::open`] (`sys::open_beneath`: `openat2` with
//! `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS` where the kernel has it, an
//! `O_NOFOLLOW` walk otherwise), so a component swapped for a symlink after
//! the check fails instead of leading outside.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use sessiond_proto::agentctl::v1::{DirEntry, EntryKind};

use crate::{
    error::{Error, Result},
    sys::{self, Resolve},
};

/// Default and maximum size of a file read (16 MiB).
pub const DEFAULT_MAX_READ: u64 = 16 << 20;

/// The workspace root, canonical.
#[derive(Debug, Clone)]
pub struct Workspace {
    root: PathBuf,
    /// The root, opened once: every file call resolves beneath it.
    root_fd: Arc<std::fs::File>,
    resolve: Resolve,
}

impl Workspace {
    /// Opens `root`, which must be an existing directory.
    pub fn open(root: &Path) -> Result<Self> {
        let root = std::fs::canonicalize(root)
            .map_err(|e| Error::io(format!("workspace {}", root.display()), e))?;
        if !root.is_dir() {
            return Err(Error::InvalidArgument(format!(
                "workspace {} is not a directory",
                root.display()
            )));
        }
        let root_fd = std::fs::File::open(&root)
            .map_err(|e| Error::io(format!("workspace {}", root.display()), e))?;
        Ok(Self {
            root,
            root_fd: Arc::new(root_fd),
            resolve: Resolve::Best,
        })
    }

    /// Whether the directory at the root's path is still the one this
    /// workspace opened: a worktree removed and checked out again (by
    /// sessiond, on the agent's relaunch) is a new directory, and the held
    /// descriptor still names the removed one, where every call would fail.
    fn root_now(&self) -> RootNow {
        let Ok(now) = std::fs::metadata(&self.root) else {
            return RootNow::Missing;
        };
        if !now.is_dir() {
            return RootNow::Missing;
        }
        // A removed directory has no links left; its inode number may be
        // reused at once by the one made in its place, so that alone does
        // not tell them apart.
        let same = self.root_fd.metadata().is_ok_and(|held| {
            held.nlink() > 0 && held.dev() == now.dev() && held.ino() == now.ino()
        });
        if same {
            RootNow::Same
        } else {
            RootNow::Replaced
        }
    }

    /// The same workspace resolving with `how` (tests of the fallback).
    pub fn with_resolve(mut self, how: Resolve) -> Self {
        self.resolve = how;
        self
    }

    /// Opens a path [`Workspace::resolve`] answered, beneath the root.
    fn open_resolved(
        &self,
        resolved: &Path,
        what: &str,
        flags: libc::c_int,
        mode: libc::mode_t,
    ) -> Result<std::fs::File> {
        let rel = resolved.strip_prefix(&self.root).map_err(|_| {
            Error::PermissionDenied(format!("{what:?} resolves outside the workspace root"))
        })?;
        sys::open_beneath(self.root_fd.as_fd(), rel, flags, mode, self.resolve)
            .map(std::fs::File::from)
            .map_err(|e| match e.raw_os_error() {
                // A socket, or a FIFO opened for writing with no reader.
                Some(libc::ENXIO) => Error::InvalidArgument(format!(
                    "{what} is not a regular file (a socket, or a FIFO nothing reads)"
                )),
                _ => Error::io(format!("opening {what}"), e),
            })
    }

    /// A handle on a directory [`Workspace::resolve`] answered, opened
    /// beneath the root without following a symlink: a working directory
    /// a child enters by handle, so a component swapped for a symlink after
    /// the check fails here instead of leading outside.
    pub fn open_dir(&self, resolved: &Path) -> Result<std::os::fd::OwnedFd> {
        self.open_resolved(resolved, "cwd", libc::O_PATH | libc::O_DIRECTORY, 0)
            .map(std::os::fd::OwnedFd::from)
    }

    /// The canonical root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Resolves `path` (relative to the root, or absolute inside it) to a
    /// path inside the root whose existing part has no symlinks.
    pub fn resolve(&self, path: &str) -> Result<PathBuf> {
        if path.contains('\0') {
            return Err(Error::InvalidArgument("path contains a NUL byte".into()));
        }
        let p = Path::new(path);
        let joined = if p.is_absolute() {
            p.to_path_buf()
        } else {
            self.root.join(p)
        };
        let mut lexical = PathBuf::new();
        for c in joined.components() {
            match c {
                Component::Prefix(_) | Component::RootDir => lexical.push(c.as_os_str()),
                Component::CurDir => {}
                Component::ParentDir => {
                    if !lexical.pop() || !lexical.starts_with(&self.root) {
                        return Err(self.escape(path));
                    }
                }
                Component::Normal(s) => lexical.push(s),
            }
        }
        if !lexical.starts_with(&self.root) {
            return Err(self.escape(path));
        }
        // Find the longest prefix that exists (without following a final symlink).
        let mut existing = lexical;
        let mut rest: Vec<OsString> = Vec::new();
        loop {
            match std::fs::symlink_metadata(&existing) {
                Ok(_) => break,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    let Some(name) = existing.file_name().map(ToOwned::to_owned) else {
                        return Err(Error::NotFound(format!("{path}: no existing ancestor")));
                    };
                    rest.push(name);
                    existing.pop();
                }
                Err(e) => return Err(Error::io(format!("resolving {path}"), e)),
            }
        }
        let canonical = match std::fs::canonicalize(&existing) {
            Ok(c) => c,
            // A dangling symlink: we cannot tell where it leads once created.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::PermissionDenied(format!(
                    "{path}: refusing a dangling symlink"
                )));
            }
            Err(e) => return Err(Error::io(format!("resolving {path}"), e)),
        };
        if !canonical.starts_with(&self.root) {
            return Err(self.escape(path));
        }
        let mut resolved = canonical;
        for name in rest.into_iter().rev() {
            resolved.push(name);
        }
        Ok(resolved)
    }

    fn escape(&self, path: &str) -> Error {
        Error::PermissionDenied(format!("{path:?} resolves outside the workspace root"))
    }

    /// Path of `abs` relative to the root, for messages and git.
    pub fn relative<'a>(&self, abs: &'a Path) -> &'a Path {
        abs.strip_prefix(&self.root).unwrap_or(abs)
    }

    /// Reads a whole file of at most `max_bytes` (0, or more than
    /// [`DEFAULT_MAX_READ`]: that maximum).
    pub fn read_file(&self, path: &str, max_bytes: u64) -> Result<Vec<u8>> {
        if path.is_empty() {
            return Err(Error::InvalidArgument("path is empty".into()));
        }
        let max = if max_bytes == 0 {
            DEFAULT_MAX_READ
        } else {
            max_bytes.min(DEFAULT_MAX_READ)
        };
        let resolved = self.resolve(path)?;
        // O_NONBLOCK: opening a FIFO must not hang the call.
        let file = self.open_resolved(&resolved, path, libc::O_RDONLY | libc::O_NONBLOCK, 0)?;
        let meta = file
            .metadata()
            .map_err(|e| Error::io(format!("stat {path}"), e))?;
        if meta.is_dir() {
            return Err(Error::InvalidArgument(format!("{path} is a directory")));
        }
        if !meta.is_file() {
            return Err(Error::InvalidArgument(format!(
                "{path} is not a regular file"
            )));
        }
        if meta.len() > max {
            return Err(Error::OutOfRange(format!(
                "{path} is {} bytes, more than the limit of {max}",
                meta.len()
            )));
        }
        let mut content = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
        file.take(max + 1)
            .read_to_end(&mut content)
            .map_err(|e| Error::io(format!("reading {path}"), e))?;
        if content.len() as u64 > max {
            return Err(Error::OutOfRange(format!(
                "{path} grew past the limit of {max} bytes"
            )));
        }
        Ok(content)
    }

    /// Writes (creating or truncating) a file; returns the bytes written.
    pub fn write_file(&self, path: &str, content: &[u8], create_parents: bool) -> Result<u64> {
        if path.is_empty() {
            return Err(Error::InvalidArgument("path is empty".into()));
        }
        let resolved = self.resolve(path)?;
        if resolved == self.root {
            return Err(Error::InvalidArgument(
                "cannot write the workspace root".into(),
            ));
        }
        if let Some(parent) = resolved.parent() {
            if create_parents {
                let rel = parent.strip_prefix(&self.root).unwrap_or(Path::new(""));
                sys::mkdirs_beneath(self.root_fd.as_fd(), rel, self.resolve)
                    .map_err(|e| Error::io(format!("creating parents of {path}"), e))?;
            } else if !parent.is_dir() {
                return Err(Error::NotFound(format!(
                    "parent directory of {path} does not exist (set create_parents)"
                )));
            }
        }
        // Not truncated at open: the file is checked first.
        let mut file = self.open_resolved(
            &resolved,
            path,
            libc::O_WRONLY | libc::O_CREAT | libc::O_NONBLOCK,
            0o644,
        )?;
        let meta = file
            .metadata()
            .map_err(|e| Error::io(format!("stat {path}"), e))?;
        if !meta.is_file() {
            return Err(Error::InvalidArgument(format!(
                "{path} is not a regular file"
            )));
        }
        // A hard link made inside the workspace to a file outside it would
        // be written through; links cannot be told apart, so refuse them all.
        {
            use std::os::unix::fs::MetadataExt;
            if meta.nlink() > 1 {
                return Err(Error::PermissionDenied(format!(
                    "{path} has {} hard links; refusing to write through a hard link",
                    meta.nlink()
                )));
            }
        }
        file.set_len(0)
            .map_err(|e| Error::io(format!("truncating {path}"), e))?;
        file.write_all(content)
            .map_err(|e| Error::io(format!("writing {path}"), e))?;
        Ok(content.len() as u64)
    }

    /// Lists a directory (empty path: the root), sorted by name.
    pub fn list_dir(&self, path: &str) -> Result<Vec<DirEntry>> {
        let resolved = self.resolve(path)?;
        let dir = self.open_resolved(&resolved, path, libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
        // Read through the descriptor (its /proc link names exactly the
        // directory opened beneath the root, whatever was renamed since).
        let rd = std::fs::read_dir(format!(
            "/proc/self/fd/{}",
            std::os::fd::AsRawFd::as_raw_fd(&dir)
        ))
        .map_err(|e| Error::io(format!("listing {path:?}"), e))?;
        let mut entries = Vec::new();
        for entry in rd {
            let entry = entry.map_err(|e| Error::io(format!("listing {path:?}"), e))?;
            // Relative to the open directory, not following a symlink.
            let meta = entry
                .metadata()
                .map_err(|e| Error::io(format!("stat in {path:?}"), e))?;
            let ft = meta.file_type();
            let kind = if ft.is_symlink() {
                EntryKind::Symlink
            } else if ft.is_dir() {
                EntryKind::Dir
            } else if ft.is_file() {
                EntryKind::File
            } else {
                EntryKind::Other
            };
            entries.push(DirEntry {
                name: entry.file_name().to_string_lossy().into_owned(),
                kind: kind as i32,
                size: if ft.is_file() { meta.len() } else { 0 },
            });
        }
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(entries)
    }
}

/// What is at a workspace's root path now ([`Workspace::root_now`]).
enum RootNow {
    Same,
    Replaced,
    Missing,
}

/// The workspace an agentctl serves: fixed when it starts (`--workspace`),
/// or, for an agentctl started with `--worktree-root` only, the worktree
/// sessiond has it create (the `Worktree` call), bound by that call, opened
/// again by a restore (a recreated directory is a new one) and unbound by
/// its removal. Calls that need it meanwhile fail FAILED_PRECONDITION.
#[derive(Debug, Default)]
pub struct WorkspaceSlot(std::sync::RwLock<Option<Arc<Workspace>>>);

impl WorkspaceSlot {
    /// Serving `ws` from the start.
    pub fn fixed(ws: Workspace) -> Self {
        Self(std::sync::RwLock::new(Some(Arc::new(ws))))
    }

    /// No workspace until a worktree is bound.
    pub fn unbound() -> Self {
        Self::default()
    }

    /// The workspace, or FAILED_PRECONDITION when none is bound or its
    /// directory no longer exists. A directory made again at the same path
    /// (a worktree checked out again) is opened and served from then on.
    pub fn get(&self) -> Result<Arc<Workspace>> {
        let ws = self
            .0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
            .ok_or_else(|| {
                Error::FailedPrecondition(
                    "no workspace yet: this agentctl serves the worktree sessiond has it \
                     create or restore (Worktree), and none is bound"
                        .into(),
                )
            })?;
        match ws.root_now() {
            RootNow::Same => Ok(ws),
            RootNow::Missing => Err(Error::FailedPrecondition(format!(
                "the workspace directory {} no longer exists (it was removed); for a \
                 worktree sessiond created, a resume of the session (`sessionctl session \
                 resume`) checks it out again from its branch and brings the agent back \
                 there, as the agent's next launch would",
                ws.root().display()
            ))),
            RootNow::Replaced => {
                let fresh = Workspace::open(ws.root())?.with_resolve(ws.resolve);
                // Only the directory it was given, made again at its path:
                // a link put there leads elsewhere (helper-53 c: outside
                // the worktree roots, where every call then ran).
                if fresh.root() != ws.root() {
                    return Err(Error::FailedPrecondition(format!(
                        "the workspace directory {} was replaced by a link to {}; agentctl \
                         serves only the directory it was given: put it back",
                        ws.root().display(),
                        fresh.root().display()
                    )));
                }
                let fresh = Arc::new(fresh);
                let mut slot = self
                    .0
                    .write()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                // Unless a bind or another call replaced it meanwhile.
                if slot.as_ref().is_some_and(|cur| Arc::ptr_eq(cur, &ws)) {
                    *slot = Some(fresh.clone());
                    tracing::info!(root = %ws.root().display(),
                        "the workspace directory was made again; serving the new one");
                }
                Ok(fresh)
            }
        }
    }

    /// The bound workspace's root, if any.
    pub fn root(&self) -> Option<PathBuf> {
        self.0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map(|w| w.root().to_path_buf())
    }

    /// Serves `ws` from now on.
    pub fn bind(&self, ws: Workspace) {
        *self
            .0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Arc::new(ws));
    }

    /// Serves none.
    pub fn unbind(&self) {
        *self
            .0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup() -> (tempfile::TempDir, Workspace, PathBuf) {
        let base = tempfile::tempdir().expect("tempdir");
        let root = base.path().join("ws");
        let outside = base.path().join("outside");
        std::fs::create_dir_all(&root).expect("mkdir");
        std::fs::create_dir_all(&outside).expect("mkdir");
        std::fs::write(outside.join("secret"), "s").expect("write");
        let ws = Workspace::open(&root).expect("open");
        (base, ws, outside)
    }

    /// A worktree removed under a running agentctl and checked out again
    /// at the same path: meanwhile a clear error, then the new directory
    /// served (the held descriptor named the removed one, so every file
    /// call failed until agentctl restarted).
    #[test]
    fn a_removed_root_is_refused_and_one_made_again_is_served() {
        let base = tempfile::tempdir().expect("tempdir");
        let root = base.path().join("ws");
        std::fs::create_dir_all(&root).expect("mkdir");
        let root = std::fs::canonicalize(&root).expect("canonical");
        std::fs::write(root.join("old"), "o").expect("write");
        let slot = WorkspaceSlot::fixed(Workspace::open(&root).expect("open"));
        assert_eq!(
            slot.get()
                .expect("bound")
                .read_file("old", 0)
                .expect("read"),
            b"o"
        );
        std::fs::remove_dir_all(&root).expect("rm");
        let err = slot.get().expect_err("its directory is gone");
        assert!(
            matches!(&err, Error::FailedPrecondition(m)
                if m.contains("no longer exists") && m.contains(&root.display().to_string())),
            "{err:?}"
        );
        std::fs::create_dir_all(&root).expect("mkdir again");
        std::fs::write(root.join("new"), "n").expect("write");
        let ws = slot.get().expect("the new directory");
        assert_eq!(ws.read_file("new", 0).expect("read"), b"n");
        let names: Vec<String> = ws
            .list_dir("")
            .expect("list")
            .into_iter()
            .map(|e| e.name)
            .collect();
        assert_eq!(names, ["new"]);
        ws.write_file("w.txt", b"w", false).expect("write");
        assert_eq!(std::fs::read(root.join("w.txt")).expect("read back"), b"w");
        // Served from then on, not opened again at every call.
        assert!(Arc::ptr_eq(&ws, &slot.get().expect("bound")));
    }

    /// helper-53 c: the root swapped for a link to another directory was
    /// opened through it and served from there.
    #[test]
    fn a_root_swapped_for_a_link_elsewhere_is_refused() {
        let (base, ws, outside) = setup();
        let root = ws.root().to_path_buf();
        let slot = WorkspaceSlot::fixed(ws);
        std::fs::rename(&root, base.path().join("moved")).expect("move");
        std::os::unix::fs::symlink(&outside, &root).expect("link");
        let err = slot.get().expect_err("a link elsewhere");
        assert!(
            matches!(&err, Error::FailedPrecondition(m) if m.contains("was replaced by a link")),
            "{err:?}"
        );
        // Put back: served again.
        std::fs::remove_file(&root).expect("unlink");
        std::fs::rename(base.path().join("moved"), &root).expect("move back");
        slot.get().expect("its own directory");
    }

    fn denied(r: Result<PathBuf>) -> bool {
        matches!(r, Err(Error::PermissionDenied(_)))
    }

    #[test]
    fn read_limit_is_capped_at_the_documented_maximum() {
        let (_base, ws, _outside) = setup();
        // Sparse: its size is what counts, nothing is read.
        let big = std::fs::File::create(ws.root().join("big")).expect("create");
        big.set_len(DEFAULT_MAX_READ + 1).expect("set_len");
        for asked in [0, DEFAULT_MAX_READ + 1, u64::MAX] {
            match ws.read_file("big", asked) {
                Err(Error::OutOfRange(m)) => {
                    assert!(m.contains(&DEFAULT_MAX_READ.to_string()), "{m}");
                }
                other => panic!("max_bytes {asked}: {:?}", other.map(|v| v.len())),
            }
        }
        std::fs::write(ws.root().join("small"), b"abc").expect("write");
        assert_eq!(ws.read_file("small", u64::MAX).expect("read"), b"abc");
    }

    #[test]
    fn resolve_rules() {
        let (_base, ws, outside) = setup();
        let root = ws.root().to_path_buf();
        assert_eq!(ws.resolve("").expect("root"), root);
        assert_eq!(ws.resolve("a/b").expect("new"), root.join("a/b"));
        assert_eq!(ws.resolve("a/../b").expect("lexical"), root.join("b"));
        assert!(denied(ws.resolve("../outside/secret")));
        assert!(denied(ws.resolve("a/../../x")));
        assert!(denied(
            ws.resolve(&outside.join("secret").to_string_lossy())
        ));
        assert_eq!(
            ws.resolve(&root.join("x").to_string_lossy())
                .expect("abs inside"),
            root.join("x")
        );
        assert!(matches!(ws.resolve("a\0b"), Err(Error::InvalidArgument(_))));
        std::os::unix::fs::symlink(&outside, root.join("out")).expect("symlink");
        assert!(denied(ws.resolve("out/secret")));
        assert!(denied(ws.resolve("out/new-file")));
        assert!(denied(ws.resolve("out")));
        std::os::unix::fs::symlink(outside.join("nope"), root.join("dangling")).expect("symlink");
        assert!(denied(ws.resolve("dangling")));
        std::fs::create_dir(root.join("d")).expect("mkdir");
        std::os::unix::fs::symlink(root.join("d"), root.join("inner")).expect("symlink");
        assert_eq!(ws.resolve("inner/f").expect("inner link"), root.join("d/f"));
    }

    /// The check-then-open race: `d` is a real directory when the path is
    /// resolved, then swapped for a symlink to a directory outside before
    /// the open. Neither resolver follows it, for reading or writing.
    #[test]
    fn a_directory_swapped_for_a_symlink_after_the_check_is_not_followed() {
        for how in [Resolve::Best, Resolve::Walk] {
            let (_base, ws, outside) = setup();
            let ws = ws.with_resolve(how);
            let root = ws.root().to_path_buf();
            std::fs::create_dir(root.join("d")).expect("mkdir");
            std::fs::write(root.join("d/secret"), "inside").expect("write");
            let read = ws.resolve("d/secret").expect("resolve");
            let write = ws.resolve("d/new").expect("resolve");
            std::fs::rename(root.join("d"), root.join("d.old")).expect("rename");
            std::os::unix::fs::symlink(&outside, root.join("d")).expect("symlink");
            let r = ws.open_resolved(&read, "d/secret", libc::O_RDONLY, 0);
            assert!(
                matches!(r, Err(Error::PermissionDenied(_))),
                "{how:?} read: {r:?}"
            );
            let w = ws.open_resolved(&write, "d/new", libc::O_WRONLY | libc::O_CREAT, 0o644);
            assert!(
                matches!(w, Err(Error::PermissionDenied(_))),
                "{how:?} write: {w:?}"
            );
            assert!(!outside.join("new").exists(), "{how:?}: created outside");
            let parents = sys::mkdirs_beneath(ws.root_fd.as_fd(), Path::new("d/x/y"), how);
            assert!(parents.is_err(), "{how:?}: mkdir through the symlink");
            assert!(!outside.join("x").exists(), "{how:?}: created outside");
            // A final component swapped for a symlink is refused too.
            std::fs::write(root.join("f"), "f").expect("write");
            let f = ws.resolve("f").expect("resolve");
            std::fs::remove_file(root.join("f")).expect("rm");
            std::os::unix::fs::symlink(outside.join("secret"), root.join("f")).expect("symlink");
            let r = ws.open_resolved(&f, "f", libc::O_RDONLY, 0);
            assert!(
                matches!(r, Err(Error::PermissionDenied(_))),
                "{how:?}: {r:?}"
            );
        }
        // This kernel (5.6+) has openat2: `Best` used it, not the walk.
        assert!(sys::openat2_in_use(), "openat2 answered ENOSYS");
    }

    /// Both resolvers serve the ordinary calls the same way.
    #[test]
    fn file_calls_work_with_either_resolver() {
        for how in [Resolve::Best, Resolve::Walk] {
            let (_base, ws, outside) = setup();
            let ws = ws.with_resolve(how);
            assert_eq!(ws.write_file("a/b/c.txt", b"abc", true).expect("write"), 3);
            assert_eq!(ws.read_file("a/b/c.txt", 0).expect("read"), b"abc");
            assert_eq!(ws.write_file("a/b/c.txt", b"x", false).expect("rewrite"), 1);
            assert_eq!(ws.read_file("a/./b/../b/c.txt", 0).expect("read"), b"x");
            let names: Vec<String> = ws
                .list_dir("a/b")
                .expect("list")
                .into_iter()
                .map(|e| e.name)
                .collect();
            assert_eq!(names, ["c.txt"]);
            assert_eq!(ws.list_dir("").expect("root").len(), 1);
            std::os::unix::fs::symlink(&outside, ws.root().join("out")).expect("symlink");
            assert!(matches!(
                ws.read_file("out/secret", 0),
                Err(Error::PermissionDenied(_))
            ));
            assert!(matches!(
                ws.write_file("out/new", b"x", true),
                Err(Error::PermissionDenied(_))
            ));
            assert!(!outside.join("new").exists());
        }
    }

    #[test]
    fn special_files_do_not_hang() {
        let (_base, ws, _outside) = setup();
        let status = std::process::Command::new("mkfifo")
            .arg(ws.root().join("fifo"))
            .status()
            .expect("mkfifo");
        assert!(status.success());
        assert!(matches!(
            ws.read_file("fifo", 0),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            ws.write_file("fifo", b"x", false),
            Err(Error::InvalidArgument(_))
        ));
        // A socket: refused as not a regular file (it was INTERNAL).
        let _listener =
            std::os::unix::net::UnixListener::bind(ws.root().join("sock")).expect("bind");
        for result in [
            ws.read_file("sock", 0).map(drop),
            ws.write_file("sock", b"x", false).map(drop),
        ] {
            match result {
                Err(Error::InvalidArgument(m)) => assert!(m.contains("not a regular file"), "{m}"),
                other => panic!("{other:?}"),
            }
        }
        assert!(matches!(
            ws.read_file("", 0),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(ws.list_dir("nope"), Err(Error::NotFound(_))));
    }
}
