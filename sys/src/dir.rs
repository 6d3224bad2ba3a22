//! Directory trees that may be shared with other users: every path below a root is resolved
//! without following a symlink, and nothing kvtier creates gets more permissions than asked.
//!
//! The root itself is opened normally (it may be a symlink, as `/dev/disk/by-id/...` paths and
//! mount points often are); everything below it goes through `openat2` with
//! [`RESOLVE_CONFINED`], so a symlink planted anywhere in a path
//! fails with ELOOP instead of redirecting kvtier, and `..` cannot climb out (EXDEV). The ring
//! does the same for the engine's per-block opens ([`FileOp::OpenAt`](crate::ring::FileOp)
//! with `confined`); these are the synchronous calls for setup (open, scan) and for checks on
//! an fd the ring opened.

use std::ffi::{CStr, CString};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path};

use crate::ring::RESOLVE_CONFINED;
use crate::Errno;

/// The type of a file system node, from `st_mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeKind {
    Regular,
    Directory,
    Symlink,
    Fifo,
    Socket,
    CharDevice,
    BlockDevice,
}

impl NodeKind {
    fn of(mode: libc::mode_t) -> NodeKind {
        match mode & libc::S_IFMT {
            libc::S_IFREG => NodeKind::Regular,
            libc::S_IFDIR => NodeKind::Directory,
            libc::S_IFLNK => NodeKind::Symlink,
            libc::S_IFIFO => NodeKind::Fifo,
            libc::S_IFSOCK => NodeKind::Socket,
            libc::S_IFCHR => NodeKind::CharDevice,
            _ => NodeKind::BlockDevice,
        }
    }

    /// How an error message names it ("a symlink", "a FIFO", ...).
    pub fn describe(self) -> &'static str {
        match self {
            NodeKind::Regular => "a regular file",
            NodeKind::Directory => "a directory",
            NodeKind::Symlink => "a symlink",
            NodeKind::Fifo => "a FIFO",
            NodeKind::Socket => "a socket",
            NodeKind::CharDevice => "a character device",
            NodeKind::BlockDevice => "a block device",
        }
    }
}

/// Opens the directory `path` (following symlinks: this is the trusted root) read-only.
pub fn open_root(path: &Path) -> Result<OwnedFd, Errno> {
    let c = c_string(path)?;
    // SAFETY: `c` is NUL-terminated and outlives the call; the result is a new fd or -1.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    owned(fd)
}

/// `openat2(dir, path, {flags | O_CLOEXEC, mode, RESOLVE_CONFINED})`: ELOOP if any component
/// of `path` is a symlink, EXDEV if it would leave `dir`.
pub fn open_confined(dir: RawFd, path: &CStr, flags: i32, mode: u32) -> Result<OwnedFd, Errno> {
    let flags = flags | libc::O_CLOEXEC;
    let creates = flags & (libc::O_CREAT | libc::O_TMPFILE) != 0;
    // SAFETY: an all-zero `open_how` is a valid value of this plain C struct.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = u64::from(flags.cast_unsigned());
    how.mode = if creates { u64::from(mode) } else { 0 };
    how.resolve = RESOLVE_CONFINED;
    // SAFETY: `path` is NUL-terminated and `how` a live `open_how` of the size passed; the
    // kernel reads both during the call only. The result is a new fd or -1.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir,
            path.as_ptr(),
            &raw const how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    owned(i32::try_from(fd).unwrap_or(-1))
}

/// Creates every missing directory of the relative `path` below `root` with `mode` (made exact
/// with `fchmod` when the process umask would strip bits of it), never following a symlink,
/// and returns the last one opened read-only. A symlink or a non-directory on the way is ELOOP
/// or ENOTDIR; an absolute path or `..` is EINVAL.
pub fn make_dirs_confined(root: RawFd, path: &Path, mode: u32) -> Result<OwnedFd, Errno> {
    let mut current: Option<OwnedFd> = None;
    for part in path.components() {
        let Component::Normal(name) = part else {
            if part == Component::CurDir {
                continue;
            }
            return Err(Errno::EINVAL);
        };
        let name = c_string(Path::new(name))?;
        let at = current.as_ref().map_or(root, AsRawFd::as_raw_fd);
        // SAFETY: `name` is NUL-terminated and outlives the call.
        let created = unsafe { libc::mkdirat(at, name.as_ptr(), mode) } == 0;
        if !created && Errno::last() != Errno::EEXIST {
            return Err(Errno::last());
        }
        let fd = open_confined(at, &name, libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
        if created && needs_chmod(mode) {
            fchmod(fd.as_raw_fd(), mode)?;
        }
        current = Some(fd);
    }
    match current {
        Some(fd) => Ok(fd),
        // An empty path names the root itself.
        None => open_confined(root, c".", libc::O_RDONLY | libc::O_DIRECTORY, 0),
    }
}

/// The type of the open file `fd` (`fstat`).
pub fn fd_kind(fd: RawFd) -> Result<NodeKind, Errno> {
    fd_stat(fd).map(|(kind, _)| kind)
}

/// The type and size in bytes of the open file `fd` (`fstat`).
pub fn fd_stat(fd: RawFd) -> Result<(NodeKind, u64), Errno> {
    // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a live, writable `stat`; the kernel writes it during the call only.
    if unsafe { libc::fstat(fd, &raw mut st) } != 0 {
        return Err(Errno::last());
    }
    Ok((
        NodeKind::of(st.st_mode),
        u64::try_from(st.st_size).unwrap_or(0),
    ))
}

/// The type of `path` below `dir` without following its last component (`fstatat` with
/// `AT_SYMLINK_NOFOLLOW`), and its size in bytes.
pub fn kind_at(dir: RawFd, path: &CStr) -> Result<(NodeKind, u64), Errno> {
    // SAFETY: as in `fd_kind`.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is NUL-terminated, `st` live and writable, both during the call only.
    let rc = unsafe { libc::fstatat(dir, path.as_ptr(), &raw mut st, libc::AT_SYMLINK_NOFOLLOW) };
    if rc != 0 {
        return Err(Errno::last());
    }
    Ok((
        NodeKind::of(st.st_mode),
        u64::try_from(st.st_size).unwrap_or(0),
    ))
}

/// `fchmod(fd, mode)`.
pub fn fchmod(fd: RawFd, mode: u32) -> Result<(), Errno> {
    // SAFETY: plain syscall on an fd; no memory is passed.
    if unsafe { libc::fchmod(fd, mode) } == 0 {
        Ok(())
    } else {
        Err(Errno::last())
    }
}

/// `fchmodat(dir, name, mode, 0)` for a directory kvtier just created under `dir`.
pub fn chmod_at(dir: RawFd, name: &CStr, mode: u32) -> Result<(), Errno> {
    // SAFETY: `name` is NUL-terminated and outlives the call.
    if unsafe { libc::fchmodat(dir, name.as_ptr(), mode, 0) } == 0 {
        Ok(())
    } else {
        Err(Errno::last())
    }
}

/// Whether the process umask strips bits of `mode`, so a created file or directory needs an
/// explicit `fchmod` to get exactly `mode`. The umask is read from `/proc/self/status` (it
/// cannot be read without changing it otherwise); if that fails, any group or other bit counts.
pub fn needs_chmod(mode: u32) -> bool {
    static UMASK: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
    let umask = *UMASK.get_or_init(|| {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let line = status.lines().find(|l| l.starts_with("Umask:"))?;
        u32::from_str_radix(line["Umask:".len()..].trim(), 8).ok()
    });
    match umask {
        Some(mask) => mode & mask != 0,
        None => mode & 0o077 != 0,
    }
}

fn c_string(path: &Path) -> Result<CString, Errno> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| Errno::EINVAL)
}

fn owned(fd: i32) -> Result<OwnedFd, Errno> {
    if fd < 0 {
        return Err(Errno::last());
    }
    // SAFETY: `fd` was just returned by the kernel as a new descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn make_dirs_confined_creates_with_exact_mode_and_refuses_symlinks() {
        let tmp = tempfile::tempdir().expect("setup");
        let root = open_root(tmp.path()).expect("setup");
        let leaf = make_dirs_confined(root.as_raw_fd(), Path::new("a/b"), 0o750).expect("setup");
        assert_eq!(
            fd_kind(leaf.as_raw_fd()).expect("setup"),
            NodeKind::Directory
        );
        for d in ["a", "a/b"] {
            let mode = std::fs::metadata(tmp.path().join(d))
                .expect("setup")
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o750, "{d}");
        }
        // Existing directories are reused.
        make_dirs_confined(root.as_raw_fd(), Path::new("a/b"), 0o750).expect("setup");

        let elsewhere = tempfile::tempdir().expect("setup");
        std::os::unix::fs::symlink(elsewhere.path(), tmp.path().join("link")).expect("setup");
        let err =
            make_dirs_confined(root.as_raw_fd(), Path::new("link/c"), 0o700).expect_err("refused");
        assert_eq!(err, Errno::ELOOP);
        assert!(!elsewhere.path().join("c").exists(), "followed the symlink");
        assert_eq!(
            make_dirs_confined(root.as_raw_fd(), Path::new("../x"), 0o700).expect_err("refused"),
            Errno::EINVAL
        );
    }

    #[test]
    fn open_confined_refuses_a_symlink_at_any_component() {
        let tmp = tempfile::tempdir().expect("setup");
        let secret = tmp.path().join("secret");
        std::fs::write(&secret, b"x").expect("setup");
        std::fs::create_dir(tmp.path().join("d")).expect("setup");
        std::fs::write(tmp.path().join("d/ok"), b"y").expect("setup");
        std::os::unix::fs::symlink(&secret, tmp.path().join("d/leaf")).expect("setup");
        std::os::unix::fs::symlink(tmp.path().join("d"), tmp.path().join("dirlink"))
            .expect("setup");
        let root = open_root(tmp.path()).expect("setup");
        let r = root.as_raw_fd();
        let fd = open_confined(r, c"d/ok", libc::O_RDONLY, 0).expect("setup");
        assert_eq!(fd_kind(fd.as_raw_fd()).expect("setup"), NodeKind::Regular);
        assert_eq!(
            open_confined(r, c"d/leaf", libc::O_RDONLY, 0).expect_err("refused"),
            Errno::ELOOP
        );
        assert_eq!(
            open_confined(r, c"dirlink/ok", libc::O_RDONLY, 0).expect_err("refused"),
            Errno::ELOOP
        );
        assert_eq!(
            open_confined(r, c"../etc", libc::O_RDONLY, 0).expect_err("refused"),
            Errno::EXDEV
        );
        assert_eq!(kind_at(r, c"d/leaf").expect("setup").0, NodeKind::Symlink);
        assert_eq!(kind_at(r, c"d/ok").expect("setup"), (NodeKind::Regular, 1));
    }
}
