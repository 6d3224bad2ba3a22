//! State shared by every kvtier process that works on one directory: a [`SharedCounter`] (a u64
//! in a small file mapped `MAP_SHARED`) and a [`FileLock`] (`flock(2)`) that tells a process
//! whether it is alone.
//!
//! Invariants: a `SharedCounter`'s mapping stays mapped for the counter's whole life and is
//! touched only through one `AtomicU64` at offset 0; kvtier never shrinks the file below
//! [`COUNTER_FILE_BYTES`] (a shorter file would turn accesses into SIGBUS). A `FileLock`'s
//! descriptor stays open for the lock's whole life, so the `flock` lock it holds (if any) lives
//! exactly as long and is released when the `FileLock` is dropped or the process dies.

use std::ffi::{CStr, CString};
use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::{errno_of, Errno};

/// Size of a counter file and of its mapping: one page.
pub const COUNTER_FILE_BYTES: usize = 4096;

/// A u64 counter in a small file mapped `MAP_SHARED`, so that several processes on one directory
/// (and several mappings in one process) share it.
///
/// Why cross-process atomics are sound here: every mapping of the file, in any process, maps
/// the same physical page (the file's page-cache page); atomic read-modify-writes are
/// `lock`-prefixed instructions on x86-64 (LSE or LL/SC on aarch64), which are coherent on
/// physical memory whatever virtual address or process issues them; the counter is 8-aligned
/// (offset 0 of a page-aligned mapping) as `AtomicU64` requires, and `AtomicU64` is always
/// lock-free (never a lock in one process's memory). Every user of the file goes through
/// `SharedCounter`, so no access is non-atomic; writing the file with write(2) or truncating it
/// is outside the contract.
#[derive(Debug)]
pub struct SharedCounter {
    /// Start of a `COUNTER_FILE_BYTES` read-write shared mapping, unmapped only on drop.
    counter: NonNull<AtomicU64>,
}

// SAFETY: the mapping belongs to the process, not to a thread, and lives as long as the
// SharedCounter.
unsafe impl Send for SharedCounter {}
// SAFETY: `&SharedCounter` only allows atomic operations on the mapped counter.
unsafe impl Sync for SharedCounter {}

impl SharedCounter {
    /// [`SharedCounter::open_in`] the directory of `path`, mode 0600.
    pub fn open(path: &Path) -> Result<SharedCounter, Errno> {
        let (dir, name) = split(path)?;
        SharedCounter::open_in(dir.as_raw_fd(), &name, 0o600)
    }

    /// Opens the counter file `name` in the directory `dir` (never following a symlink:
    /// ELOOP; anything but a regular file is EINVAL), creating it (with exactly `mode`, value
    /// 0) if missing and growing it to [`COUNTER_FILE_BYTES`] if shorter (growing never changes
    /// the counter, so processes racing to create it agree), and maps it.
    pub fn open_in(dir: RawFd, name: &CStr, mode: u32) -> Result<SharedCounter, Errno> {
        let file = open_regular(dir, name, mode)?;
        let len = file.metadata().map_err(|e| errno_of(&e))?.len();
        if len < COUNTER_FILE_BYTES as u64 {
            file.set_len(COUNTER_FILE_BYTES as u64)
                .map_err(|e| errno_of(&e))?;
        }
        let fd = file.as_raw_fd();
        // SAFETY: a new shared mapping of the file's first page at an address the kernel chooses
        // (null hint, no MAP_FIXED) cannot overlap or alter any existing memory.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                COUNTER_FILE_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(Errno::last());
        }
        // The mapping holds its own reference to the file: `file` may close now.
        let counter = NonNull::new(ptr.cast::<AtomicU64>()).ok_or(Errno::ENOMEM)?;
        Ok(SharedCounter { counter })
    }

    fn atomic(&self) -> &AtomicU64 {
        // SAFETY: `counter` is the start of a live read-write mapping of COUNTER_FILE_BYTES
        // (page-aligned, so 8-aligned) that is unmapped only when self is dropped, and the
        // bytes are only ever accessed atomically (see the type's documentation).
        unsafe { self.counter.as_ref() }
    }

    pub fn load(&self) -> u64 {
        self.atomic().load(Ordering::Acquire)
    }

    /// Adds `n` (wrapping on overflow) and returns the previous value.
    pub fn fetch_add(&self, n: u64) -> u64 {
        self.atomic().fetch_add(n, Ordering::AcqRel)
    }

    /// Subtracts `n` but never goes below 0 (a compare-and-swap loop); returns the previous
    /// value.
    pub fn sub_saturating(&self, n: u64) -> u64 {
        let update = |v: u64| Some(v.saturating_sub(n));
        // The closure never returns None, so fetch_update cannot fail; both arms carry the
        // previous value.
        match self
            .atomic()
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, update)
        {
            Ok(prev) | Err(prev) => prev,
        }
    }

    pub fn store(&self, n: u64) {
        self.atomic().store(n, Ordering::Release);
    }
}

impl Drop for SharedCounter {
    fn drop(&mut self) {
        // SAFETY: the mapping was created by `open` with exactly this address and length, is
        // unmapped only here, and no reference into it outlives `&self`.
        let rc = unsafe { libc::munmap(self.counter.as_ptr().cast(), COUNTER_FILE_BYTES) };
        if rc != 0 {
            tracing::error!(errno = %Errno::last(), "munmap of a shared counter failed");
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
    //! Two mappings of one counter file in one process (the cross-process case runs in
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
    fn two_mappings_see_each_others_updates() {
        let tmp = tempdir();
        let path = tmp.path().join("counter");
        let a = SharedCounter::open(&path).expect("open a");
        let b = SharedCounter::open(&path).expect("open b");
        assert_eq!(
            std::fs::metadata(&path).expect("stat").len(),
            COUNTER_FILE_BYTES as u64
        );
        assert_eq!((a.load(), b.load()), (0, 0));
        assert_eq!(a.fetch_add(5), 0);
        assert_eq!(b.load(), 5);
        b.store(10);
        assert_eq!(a.load(), 10);
        assert_eq!(a.sub_saturating(3), 10);
        assert_eq!(b.load(), 7);
        assert_eq!(b.sub_saturating(100), 7);
        assert_eq!(a.load(), 0);
        assert_eq!(a.sub_saturating(1), 0);
        assert_eq!(b.load(), 0);
        b.fetch_add(42);
        drop((a, b));
        // The value lives in the file: a later process finds it.
        let c = SharedCounter::open(&path).expect("reopen");
        assert_eq!(c.load(), 42);
    }

    #[test]
    fn concurrent_updates_through_two_mappings_are_atomic() {
        let tmp = tempdir();
        let path = tmp.path().join("counter");
        let counters = [
            SharedCounter::open(&path).expect("open a"),
            SharedCounter::open(&path).expect("open b"),
        ];
        counters[0].store(1_000_000);
        std::thread::scope(|s| {
            for t in 0..4 {
                let c = &counters[t % 2];
                s.spawn(move || {
                    for _ in 0..20_000 {
                        c.fetch_add(3);
                        c.sub_saturating(1);
                    }
                });
            }
        });
        assert_eq!(counters[1].load(), 1_000_000 + 4 * 20_000 * 2);
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
