//! Blocking system calls on raw descriptors: the same operations the ring's [`FileOp`]s run,
//! made one call at a time. The simulator's files backend runs a worker's file operations
//! through these, on a real directory, at the moment it completes them.
//!
//! Every function takes the descriptor as a plain number owned by the caller (as the ring's
//! file operations do): a closed or reused number is an `EBADF` or an operation on another
//! file, never memory unsafety, since no memory outlives a call.
//!
//! [`FileOp`]: crate::ring::FileOp

use std::ffi::CStr;
use std::os::fd::RawFd;

use crate::Errno;

fn check(rc: libc::c_int) -> Result<(), Errno> {
    if rc == 0 {
        Ok(())
    } else {
        Err(Errno::last())
    }
}

fn count(rc: libc::ssize_t) -> Result<usize, Errno> {
    usize::try_from(rc).map_err(|_| Errno::last())
}

/// `openat(dir, path, flags | O_CLOEXEC, mode)`; the new descriptor is the caller's to close.
pub fn open_at(dir: RawFd, path: &CStr, flags: i32, mode: u32) -> Result<RawFd, Errno> {
    // SAFETY: `path` is NUL-terminated and read during the call only; the result is an fd or -1.
    let fd = unsafe { libc::openat(dir, path.as_ptr(), flags | libc::O_CLOEXEC, mode) };
    if fd < 0 {
        Err(Errno::last())
    } else {
        Ok(fd)
    }
}

/// `pread(fd, buf, offset)`: bytes read.
pub fn pread(fd: RawFd, buf: &mut [u8], offset: u64) -> Result<usize, Errno> {
    let offset = libc::off_t::try_from(offset).map_err(|_| Errno::EINVAL)?;
    // SAFETY: `buf` is a live, writable slice of the length passed; written during the call only.
    count(unsafe { libc::pread(fd, buf.as_mut_ptr().cast(), buf.len(), offset) })
}

/// `pwrite(fd, buf, offset)`: bytes written.
pub fn pwrite(fd: RawFd, buf: &[u8], offset: u64) -> Result<usize, Errno> {
    let offset = libc::off_t::try_from(offset).map_err(|_| Errno::EINVAL)?;
    // SAFETY: `buf` is a live slice of the length passed; read during the call only.
    count(unsafe { libc::pwrite(fd, buf.as_ptr().cast(), buf.len(), offset) })
}

/// `ftruncate(fd, len)`.
pub fn truncate(fd: RawFd, len: u64) -> Result<(), Errno> {
    let len = libc::off_t::try_from(len).map_err(|_| Errno::EINVAL)?;
    // SAFETY: plain syscall on an fd; no memory is passed.
    check(unsafe { libc::ftruncate(fd, len) })
}

/// `fdatasync(fd)` if `data_only`, else `fsync(fd)`.
pub fn sync(fd: RawFd, data_only: bool) -> Result<(), Errno> {
    // SAFETY: plain syscalls on an fd; no memory is passed.
    check(unsafe {
        if data_only {
            libc::fdatasync(fd)
        } else {
            libc::fsync(fd)
        }
    })
}

/// `close(fd)`.
pub fn close(fd: RawFd) -> Result<(), Errno> {
    // SAFETY: plain syscall on an fd the caller owns and gives up here.
    check(unsafe { libc::close(fd) })
}

/// `renameat2(dir, from, dir, to, flags)`.
pub fn rename_at(dir: RawFd, from: &CStr, to: &CStr, flags: u32) -> Result<(), Errno> {
    // SAFETY: both paths are NUL-terminated and read during the call only.
    check(unsafe { libc::renameat2(dir, from.as_ptr(), dir, to.as_ptr(), flags) })
}

/// `unlinkat(dir, path, 0)`.
pub fn unlink_at(dir: RawFd, path: &CStr) -> Result<(), Errno> {
    // SAFETY: `path` is NUL-terminated and read during the call only.
    check(unsafe { libc::unlinkat(dir, path.as_ptr(), 0) })
}

/// `statx(dir, path, AT_SYMLINK_NOFOLLOW, STATX_TYPE | STATX_SIZE)`, synchronously: the bytes
/// the kernel wrote, as [`crate::ring::FileOp::Statx`] hands them over (read them with
/// [`crate::ring::StatxInfo::parse`]).
pub fn statx_at(dir: RawFd, path: &CStr) -> Result<Box<[u8]>, Errno> {
    let mut st = std::mem::MaybeUninit::<libc::statx>::zeroed();
    // SAFETY: `path` is NUL-terminated and `st` is a writable statx, both live for the call.
    check(unsafe {
        libc::statx(
            dir,
            path.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
            libc::STATX_TYPE | libc::STATX_SIZE,
            st.as_mut_ptr(),
        )
    })?;
    let bytes = std::mem::size_of::<libc::statx>();
    // SAFETY: zeroed and then filled by the kernel: `bytes` initialised bytes, read only while
    // `st` lives.
    let raw = unsafe { std::slice::from_raw_parts(st.as_ptr().cast::<u8>(), bytes) };
    Ok(raw.into())
}

/// `mkdirat(dir, path, mode)`.
pub fn mkdir_at(dir: RawFd, path: &CStr, mode: u32) -> Result<(), Errno> {
    // SAFETY: `path` is NUL-terminated and read during the call only.
    check(unsafe { libc::mkdirat(dir, path.as_ptr(), mode) })
}

/// The device and inode numbers of the open file `fd` (`fstat`): which file a number names.
pub fn identity(fd: RawFd) -> Result<(u64, u64), Errno> {
    // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a live, writable `stat`; the kernel writes it during the call only.
    check(unsafe { libc::fstat(fd, &raw mut st) })?;
    Ok((st.st_dev, st.st_ino))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    /// Each call against a scratch directory: create, write, read back, sync, rename with and
    /// without NOREPLACE, truncate, unlink, mkdir, and the errors of each.
    #[test]
    fn calls_move_bytes_and_report_errnos() {
        let dir = tempfile::tempdir().expect("a scratch directory");
        let root = crate::dir::open_root(dir.path()).expect("open the directory");
        let d = root.as_raw_fd();
        let fd =
            open_at(d, c"a", libc::O_RDWR | libc::O_CREAT | libc::O_EXCL, 0o600).expect("created");
        assert_eq!(
            open_at(d, c"a", libc::O_RDWR | libc::O_CREAT | libc::O_EXCL, 0o600),
            Err(Errno::EEXIST)
        );
        assert_eq!(pwrite(fd, b"hello", 3), Ok(5));
        let mut buf = [0u8; 8];
        assert_eq!(pread(fd, &mut buf, 0), Ok(8));
        assert_eq!(&buf, b"\0\0\0hello");
        sync(fd, true).expect("fdatasync");
        sync(fd, false).expect("fsync");
        let id = identity(fd).expect("fstat");
        truncate(fd, 4).expect("ftruncate");
        assert_eq!(pread(fd, &mut buf, 0), Ok(4));
        close(fd).expect("closed");
        assert_eq!(close(fd), Err(Errno::EBADF));
        assert_eq!(identity(fd), Err(Errno::EBADF));

        rename_at(d, c"a", c"b", 0).expect("renamed");
        let fd = open_at(d, c"b", libc::O_RDONLY, 0).expect("opened");
        assert_eq!(identity(fd), Ok(id), "the same file under its new name");
        close(fd).expect("closed");
        let fd = open_at(d, c"c", libc::O_WRONLY | libc::O_CREAT, 0o600).expect("created");
        close(fd).expect("closed");
        assert_eq!(
            rename_at(d, c"c", c"b", libc::RENAME_NOREPLACE),
            Err(Errno::EEXIST)
        );
        unlink_at(d, c"c").expect("unlinked");
        assert_eq!(unlink_at(d, c"c"), Err(Errno::ENOENT));
        mkdir_at(d, c"sub", 0o700).expect("mkdir");
        assert_eq!(mkdir_at(d, c"sub", 0o700), Err(Errno::EEXIST));
        assert_eq!(
            open_at(d, c"missing/x", libc::O_RDONLY, 0),
            Err(Errno::ENOENT)
        );
    }
}
