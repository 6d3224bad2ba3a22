//! State shared by every kvtier process that works on one directory: a [`SharedCounter`] (a u64
//! at offset 0 of a small file, read and written with `pread`/`pwrite` under a byte-range lock)
//! and a [`FileLock`] (`flock(2)`) that tells a process whether it is alone.
//!
//! Invariants: a `SharedCounter` never maps its file: the directory may sit on a file system
//! kvtier does not control (FUSE, NFS), where a failing read of a mapped page would kill the
//! whole process with SIGBUS; a failing `pread` is an error the caller reports. A `FileLock`'s
//! descriptor stays open for the lock's whole life, so the `flock` lock it holds (if any) lives
//! exactly as long and is released when the `FileLock` is dropped or the process dies.

use std::ffi::{CStr, CString};
use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::{Mutex, PoisonError};

use crate::{errno_of, Errno};

/// Size a counter file is grown to (older kvtier versions mapped one page of it).
pub const COUNTER_FILE_BYTES: usize = 4096;

/// The counter's bytes: a native-endian u64 at offset 0.
const COUNTER_BYTES: usize = 8;

/// A u64 counter in a small file, shared by several processes on one directory (and several
/// handles in one process).
///
/// Every read-modify-write holds an open-file-description lock (`F_OFD_SETLKW`) on the
/// file, which excludes every other handle in any process, and this handle's own
/// mutex, which excludes the other threads using it (they share its open file description).
/// The value is read with `pread` and written with `pwrite`, so an I/O error (a FUSE or network
/// file system failing a read) is an `Err`, never a signal. Writing the file by other means is
/// outside the contract.
#[derive(Debug)]
pub struct SharedCounter {
    file: File,
    /// Serializes this handle's updates: its threads share one open file description, which
    /// the OFD lock does not exclude from itself.
    local: Mutex<()>,
}

impl SharedCounter {
    /// [`SharedCounter::open_in`] the directory of `path`, mode 0600.
    pub fn open(path: &Path) -> Result<SharedCounter, Errno> {
        let (dir, name) = split(path)?;
        SharedCounter::open_in(dir.as_raw_fd(), &name, 0o600)
    }

    /// Opens the counter file `name` in the directory `dir` (never following a symlink:
    /// ELOOP; anything but a regular file is EINVAL), creating it (with exactly `mode`, value
    /// 0) if missing and growing it to [`COUNTER_FILE_BYTES`] if shorter (growing never changes
    /// the counter, so processes racing to create it agree), and reads the counter once, so a
    /// file system that cannot serve it fails the open.
    pub fn open_in(dir: RawFd, name: &CStr, mode: u32) -> Result<SharedCounter, Errno> {
        let file = open_regular(dir, name, mode)?;
        let len = file.metadata().map_err(|e| errno_of(&e))?.len();
        if len < COUNTER_FILE_BYTES as u64 {
            file.set_len(COUNTER_FILE_BYTES as u64)
                .map_err(|e| errno_of(&e))?;
        }
        let counter = SharedCounter {
            file,
            local: Mutex::new(()),
        };
        counter.load()?;
        Ok(counter)
    }

    /// The value now.
    pub fn load(&self) -> Result<u64, Errno> {
        self.update(|v| v)
    }

    /// Adds `n` (wrapping on overflow) and returns the previous value.
    pub fn fetch_add(&self, n: u64) -> Result<u64, Errno> {
        self.update(|v| v.wrapping_add(n))
    }

    /// Subtracts `n` but never goes below 0; returns the previous value.
    pub fn sub_saturating(&self, n: u64) -> Result<u64, Errno> {
        self.update(|v| v.saturating_sub(n))
    }

    pub fn store(&self, n: u64) -> Result<(), Errno> {
        self.update(|_| n).map(|_| ())
    }

    /// Replaces the value `v` by `f(v)` atomically with respect to every other handle and
    /// thread; returns `v`. Writes nothing when `f(v) == v`.
    fn update(&self, f: impl FnOnce(u64) -> u64) -> Result<u64, Errno> {
        let _local = self.local.lock().unwrap_or_else(PoisonError::into_inner);
        self.ofd_lock(libc::F_WRLCK as libc::c_short)?;
        let result = self.read_modify_write(f);
        let unlocked = self.ofd_lock(libc::F_UNLCK as libc::c_short);
        let prev = result?;
        unlocked?;
        Ok(prev)
    }

    fn read_modify_write(&self, f: impl FnOnce(u64) -> u64) -> Result<u64, Errno> {
        let mut buf = [0u8; COUNTER_BYTES];
        let n = self.file.read_at(&mut buf, 0).map_err(|e| errno_of(&e))?;
        if n != COUNTER_BYTES {
            // The file is never shorter than a page (see open_in): someone truncated it.
            return Err(Errno::EIO);
        }
        let prev = u64::from_ne_bytes(buf);
        let next = f(prev);
        if next != prev {
            self.file
                .write_all_at(&next.to_ne_bytes(), 0)
                .map_err(|e| errno_of(&e))?;
        }
        Ok(prev)
    }

    /// `F_OFD_SETLKW` of `kind` (write lock, or unlock) over the whole file (`l_len` 0: to its
    /// end, however long), retried on EINTR.
    fn ofd_lock(&self, kind: libc::c_short) -> Result<(), Errno> {
        // SAFETY: an all-zero flock is a valid value of this plain C struct: l_start and l_len
        // 0 (the whole file), l_pid 0 (as OFD locks require).
        let mut lock: libc::flock = unsafe { std::mem::zeroed() };
        lock.l_type = kind;
        lock.l_whence = libc::SEEK_SET as libc::c_short;
        loop {
            // SAFETY: fcntl reads `lock`, a live, initialized flock; the fd is owned by self.
            let rc =
                unsafe { libc::fcntl(self.file.as_raw_fd(), libc::F_OFD_SETLKW, &raw mut lock) };
            if rc == 0 {
                return Ok(());
            }
            match Errno::last() {
                Errno::EINTR => {}
                e => return Err(e),
            }
        }
    }
}

/// An `flock(2)` lock file: every live process holds it shared; a process that gets it
/// exclusive knows it is alone.
///
/// Locks belong to the open file description, so two `FileLock`s on one path conflict even in
/// one process, and a lock dies with its `FileLock` (or its process). Converting a held lock is
/// not atomic on Linux: the old lock is removed before the new one is tried, so a
/// [`FileLock::try_exclusive`] that fails while this handle held the lock shared leaves it
/// holding *nothing*, and for that moment another process may find itself alone. Ask for
/// exclusive before taking shared (start-up, recovery), or only when giving up the lock
/// anyway (shutdown). Downgrading exclusive to shared with [`FileLock::shared`] never lets
/// another process in between.
#[derive(Debug)]
pub struct FileLock {
    file: File,
}

impl FileLock {
    /// [`FileLock::open_in`] the directory of `path`, mode 0600.
    pub fn open(path: &Path) -> Result<FileLock, Errno> {
        let (dir, name) = split(path)?;
        FileLock::open_in(dir.as_raw_fd(), &name, 0o600)
    }

    /// Opens (creating, with exactly `mode`, if missing) the lock file `name` in the directory
    /// `dir`, never following a symlink (ELOOP; anything but a regular file is EINVAL); holds no
    /// lock yet.
    pub fn open_in(dir: RawFd, name: &CStr, mode: u32) -> Result<FileLock, Errno> {
        Ok(FileLock {
            file: open_regular(dir, name, mode)?,
        })
    }

    /// `LOCK_EX | LOCK_NB`: `Ok(true)` if this handle now holds the lock exclusive (no other
    /// open file description holds it), `Ok(false)` if another holds it (see the type's note on
    /// conversions: a shared lock held by this handle is then lost).
    pub fn try_exclusive(&self) -> Result<bool, Errno> {
        self.try_lock(libc::LOCK_EX)
    }

    /// `LOCK_SH`: waits until no one holds the lock exclusive, then holds it shared. Converts an
    /// exclusive lock held by this handle.
    pub fn shared(&self) -> Result<(), Errno> {
        self.flock(libc::LOCK_SH)
    }

    /// `LOCK_SH | LOCK_NB`: `Ok(false)` if another handle holds the lock exclusive.
    pub fn try_shared(&self) -> Result<bool, Errno> {
        self.try_lock(libc::LOCK_SH)
    }

    fn try_lock(&self, operation: libc::c_int) -> Result<bool, Errno> {
        match self.flock(operation | libc::LOCK_NB) {
            Ok(()) => Ok(true),
            Err(Errno::EWOULDBLOCK) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// `flock(2)`, retried on EINTR (a signal while waiting for a blocking lock).
    fn flock(&self, operation: libc::c_int) -> Result<(), Errno> {
        let fd = self.file.as_raw_fd();
        loop {
            // SAFETY: flock takes no pointers; `fd` is owned by self and open.
            let rc = unsafe { libc::flock(fd, operation) };
            if rc == 0 {
                return Ok(());
            }
            match Errno::last() {
                Errno::EINTR => {}
                e => return Err(e),
            }
        }
    }
}

/// Opens (or creates with exactly `mode`) the regular file `name` in `dir`, read-write,
/// without following symlinks and without blocking on a FIFO.
fn open_regular(dir: RawFd, name: &CStr, mode: u32) -> Result<File, Errno> {
    let flags = libc::O_RDWR | libc::O_CREAT | libc::O_NONBLOCK | libc::O_NOCTTY;
    let fd = crate::dir::open_confined(dir, name, flags, mode)?;
    if crate::dir::fd_kind(fd.as_raw_fd())? != crate::dir::NodeKind::Regular {
        return Err(Errno::EINVAL);
    }
    if crate::dir::needs_chmod(mode) {
        crate::dir::fchmod(fd.as_raw_fd(), mode)?;
    }
    Ok(File::from(fd))
}

/// The parent directory of `path` (opened) and its file name.
fn split(path: &Path) -> Result<(std::os::fd::OwnedFd, CString), Errno> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let name = path.file_name().ok_or(Errno::EINVAL)?;
    let name =
        CString::new(std::os::unix::ffi::OsStrExt::as_bytes(name)).map_err(|_| Errno::EINVAL)?;
    Ok((crate::dir::open_root(parent)?, name))
}

#[cfg(test)]
mod tests {
    //! Two handles on one counter file in one process (the cross-process case runs in
    //! tests/file_ops.rs with a child process) and several handles on one lock file. A failure
    //! means processes on one directory would disagree on the counter, or a process could
    //! wrongly believe it is alone.
    use super::*;

    fn tempdir() -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix("kvtier-sys-shared-")
            .tempdir_in("/var/tmp")
            .expect("tempdir in /var/tmp")
    }

    #[test]
    fn two_handles_see_each_others_updates() {
        let tmp = tempdir();
        let path = tmp.path().join("counter");
        let a = SharedCounter::open(&path).expect("open a");
        let b = SharedCounter::open(&path).expect("open b");
        assert_eq!(
            std::fs::metadata(&path).expect("stat").len(),
            COUNTER_FILE_BYTES as u64
        );
        assert_eq!((a.load(), b.load()), (Ok(0), Ok(0)));
        assert_eq!(a.fetch_add(5), Ok(0));
        assert_eq!(b.load(), Ok(5));
        b.store(10).expect("store");
        assert_eq!(a.load(), Ok(10));
        assert_eq!(a.sub_saturating(3), Ok(10));
        assert_eq!(b.load(), Ok(7));
        assert_eq!(b.sub_saturating(100), Ok(7));
        assert_eq!(a.load(), Ok(0));
        assert_eq!(a.sub_saturating(1), Ok(0));
        assert_eq!(b.load(), Ok(0));
        b.fetch_add(42).expect("add");
        drop((a, b));
        // The value lives in the file: a later process finds it.
        let c = SharedCounter::open(&path).expect("reopen");
        assert_eq!(c.load(), Ok(42));
    }

    #[test]
    fn concurrent_updates_through_two_handles_are_atomic() {
        let tmp = tempdir();
        let path = tmp.path().join("counter");
        let counters = [
            SharedCounter::open(&path).expect("open a"),
            SharedCounter::open(&path).expect("open b"),
        ];
        counters[0].store(1_000_000).expect("store");
        std::thread::scope(|s| {
            for t in 0..4 {
                let c = &counters[t % 2];
                s.spawn(move || {
                    for _ in 0..20_000 {
                        c.fetch_add(3).expect("add");
                        c.sub_saturating(1).expect("sub");
                    }
                });
            }
        });
        assert_eq!(counters[1].load(), Ok(1_000_000 + 4 * 20_000 * 2));
    }

    #[test]
    fn open_file_descriptions_conflict_even_in_one_process() {
        let tmp = tempdir();
        let path = tmp.path().join("lock");
        let a = FileLock::open(&path).expect("open a");
        let b = FileLock::open(&path).expect("open b");
        a.shared().expect("a shared");
        assert_eq!(
            b.try_exclusive(),
            Ok(false),
            "b exclusive while a holds shared"
        );
        assert_eq!(b.try_shared(), Ok(true));
        drop(b);
        // a alone: exclusive, then a downgrade that a third handle cannot slip into.
        assert_eq!(a.try_exclusive(), Ok(true));
        let c = FileLock::open(&path).expect("open c");
        assert_eq!(
            c.try_shared(),
            Ok(false),
            "c shared while a holds exclusive"
        );
        a.shared().expect("a downgrade");
        assert_eq!(c.try_exclusive(), Ok(false));
        assert_eq!(c.try_shared(), Ok(true));
        // Linux drops the shared lock of a failed upgrade (documented on FileLock): after it,
        // and once c is gone, a newcomer finds itself alone although a is still open.
        assert_eq!(a.try_exclusive(), Ok(false));
        drop(c);
        let d = FileLock::open(&path).expect("open d");
        assert_eq!(
            d.try_exclusive(),
            Ok(true),
            "a kept a lock after a failed upgrade"
        );
    }
}
