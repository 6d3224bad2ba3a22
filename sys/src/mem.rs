//! Memory regions that the kernel reads and writes by DMA: anonymous mappings backed by hugetlb
//! 2 MiB pages, transparent huge pages or 4 KiB pages, or foreign memory wrapped as-is.
//!
//! Invariants: a [`Region`]'s memory is valid, readable and writable from `addr()` to
//! `addr() + len()` for the Region's whole life; an owned Region is zeroed and pre-faulted when
//! [`Region::allocate`] returns, and unmapped exactly once, on drop. Rust code never holds a
//! reference into the memory except through [`Region::slice`] (which is `unsafe`): the safe
//! accessors copy through raw pointers, so that the kernel writing a block by DMA is never
//! aliased by a Rust `&`/`&mut`. Once [`Region::guard_blocks`] gave the region a block size
//! (the engine does at open), every block has an access state ([`crate::blocks`]): the safe
//! accessors refuse (panic on) bytes of a block that a job in flight holds, or that another
//! thread is copying into, and a job cannot take a block a caller is copying. Without that guard
//! (a region no engine uses) the caller must not copy into the same bytes from two threads at
//! once.
//!
//! Memory is mapped with `libc::mmap` directly. hugepage-rs was evaluated and rejected (no
//! errno, no fallback, no page-size choice).

use std::fmt;
use std::ptr::NonNull;
use std::sync::{Arc, OnceLock};

use crate::blocks::{Blocks, Busy, IoBuf, Lease};
use crate::Errno;

const PAGE_4K: usize = 4096;
const HUGE_2M: usize = 2 << 20;
/// sysfs directory of the 2 MiB hugetlb pool (the pool `MAP_HUGE_2MB` draws from).
const HUGETLB_2M_SYSFS: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB";

/// Whether [`Region::allocate`] may, must or must not use huge pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HugePages {
    /// hugetlb 2 MiB pages or an error explaining how to reserve them.
    Required,
    /// hugetlb 2 MiB pages, else transparent huge pages, else 4 KiB pages.
    Auto,
    /// 4 KiB pages only.
    Off,
}

/// What a [`Region`]'s memory is backed by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backing {
    /// hugetlb 2 MiB pages from the reserved pool.
    HugeTlb2M,
    /// Anonymous memory with `MADV_HUGEPAGE`, THP enabled: the kernel uses 2 MiB pages where it
    /// can (best effort, some parts may still be 4 KiB pages).
    Thp,
    /// Anonymous memory with 4 KiB pages.
    Pages4K,
    /// Memory owned by someone else, wrapped by [`Region::from_raw_parts`].
    Foreign,
}

impl Backing {
    /// A short name for logs and reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Backing::HugeTlb2M => "hugetlb-2MiB",
            Backing::Thp => "thp",
            Backing::Pages4K => "4KiB",
            Backing::Foreign => "foreign",
        }
    }
}

impl fmt::Display for Backing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why [`Region::allocate`] failed; `message` names what failed and how to fix it.
#[derive(Debug)]
pub struct AllocError {
    pub errno: Errno,
    pub message: String,
}

impl fmt::Display for AllocError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for AllocError {}

/// A contiguous range of memory usable as an `io_uring` fixed buffer and `O_DIRECT` target.
pub struct Region {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
    /// True if this Region mapped the memory and must unmap it.
    owned: bool,
    /// Per-block access states, once [`Region::guard_blocks`] set a block size.
    blocks: OnceLock<Blocks>,
    /// Until then, one access state for the whole region: the accessors' copies take it
    /// (shared to read, exclusive to write), so two threads never race on its bytes.
    whole: Blocks,
}

// SAFETY: a Region is a pointer and a length to memory valid for its whole life (owned mapping,
// or foreign memory under `from_raw_parts`' contract); nothing in it is tied to a thread.
unsafe impl Send for Region {}
// SAFETY: through `&Region`, safe code reaches the bytes only with the accessors (`read`,
// `write`, `fill`, `with_bytes`), and each takes the access states of what it touches for the
// length of its copy (the blocks' on a guarded region, the whole region's before a block size is
// set) and panics on a conflict: no two threads copy the same byte with one of them writing, and
// none reaches a block a lease holds. A lease's holder reaches its blocks through the lease,
// whose accessors count themselves in the blocks' states against the transfers in flight
// (`crate::blocks`); a device transfer's memory is claimed by an `IoBuf` the ring keeps until
// the completion is reaped. What is left is `unsafe` and says what its caller keeps off the
// bytes: `slice`, and the raw transfers (`Ring::push_read_raw` and the others).
unsafe impl Sync for Region {}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("backing", &self.backing)
            .field("owned", &self.owned)
            .field(
                "guarded_block_bytes",
                &self.blocks.get().map(|b| b.block_bytes),
            )
            .finish_non_exhaustive()
    }
}

impl Region {
    /// Maps `len` bytes of anonymous memory.
    ///
    /// `len` is rounded up to 4 KiB (to 2 MiB for hugetlb and THP). Memory is zeroed and
    /// pre-faulted (`MADV_POPULATE_WRITE`, or a write to every page on kernels without it), so
    /// the first I/O does not pay for page faults. With [`HugePages::Required`] and too few
    /// reserved hugetlb pages the error message includes the exact
    /// `echo N > /proc/sys/vm/nr_hugepages` command that reserves them.
    pub fn allocate(len: usize, huge: HugePages) -> Result<Region, AllocError> {
        if len == 0 {
            return Err(AllocError {
                errno: Errno::EINVAL,
                message: "cannot allocate a memory region of 0 bytes".to_owned(),
            });
        }
        match huge {
            HugePages::Required => map_hugetlb(len).map_err(|errno| hugetlb_error(len, errno)),
            HugePages::Auto => match map_hugetlb(len) {
                Ok(region) => Ok(region),
                Err(errno) => {
                    tracing::debug!(len, %errno, "no hugetlb pages, trying transparent huge pages");
                    map_anonymous(len, true).map_err(|errno| anon_error(len, errno))
                }
            },
            HugePages::Off => map_anonymous(len, false).map_err(|errno| anon_error(len, errno)),
        }
    }

    /// Wraps memory owned by someone else (a GPU runtime's pinned buffer, shared memory).
    /// The memory is not unmapped on drop.
    ///
    /// Returns `Err(EINVAL)` if `ptr` is not 4 KiB aligned, or `len` is 0 or not a multiple of
    /// 4096.
    ///
    /// # Safety
    ///
    /// `ptr..ptr + len` must be valid, readable and writable memory for the Region's whole life
    /// (including while a `Ring` that registered it is alive), and must not be accessed through
    /// Rust references elsewhere while the Region copies into it or the kernel does I/O on it.
    pub unsafe fn from_raw_parts(ptr: *mut u8, len: usize) -> Result<Region, Errno> {
        if len == 0 || !len.is_multiple_of(PAGE_4K) || !(ptr as usize).is_multiple_of(PAGE_4K) {
            return Err(Errno::EINVAL);
        }
        let ptr = NonNull::new(ptr).ok_or(Errno::EINVAL)?;
        Ok(Region {
            ptr,
            len,
            backing: Backing::Foreign,
            owned: false,
            blocks: OnceLock::new(),
            whole: Blocks::whole(),
        })
    }

    /// Length in bytes (after rounding).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false for a Region built by this crate (lengths are at least 4 KiB).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// What the memory is backed by.
    pub fn backing(&self) -> Backing {
        self.backing
    }

    /// Start address, for diagnostics and alignment checks.
    pub fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    /// Gives the region a block size: from now on the safe accessors check each block's
    /// access state, and jobs lease blocks ([`Region::lease`]). Idempotent for the same size;
    /// `EINVAL` for 0 or a size above the region, `EBUSY` if another size was set.
    pub fn guard_blocks(&self, block_bytes: usize) -> Result<(), Errno> {
        if block_bytes == 0 || block_bytes > self.len {
            return Err(Errno::EINVAL);
        }
        let set = self
            .blocks
            .get_or_init(|| Blocks::new(block_bytes, self.len / block_bytes));
        if set.block_bytes == block_bytes {
            Ok(())
        } else {
            Err(Errno::EBUSY)
        }
    }

    /// The first block of `offset..offset + len` that nothing holds now (no lease, no copy),
    /// on a region with a block size; `None` if every block there is held, or the region has
    /// no block size. A device's transfer must only ever reach held blocks.
    pub fn first_unheld(&self, offset: usize, len: usize) -> Option<u32> {
        let g = self.blocks()?;
        g.span(offset, len).find(|&b| !g.in_use(b))
    }

    pub(crate) fn blocks(&self) -> Option<&Blocks> {
        self.blocks.get()
    }

    /// Whether block `block` is held now: by a job in flight (or by one whose I/O outlived its
    /// deadline and may still move its bytes), or by another thread's copy. Always false
    /// without a block size ([`Region::guard_blocks`]).
    pub fn is_leased(&self, block: u32) -> bool {
        self.blocks().is_some_and(|g| g.in_use(block))
    }

    /// Lends `blocks` (block indexes; repeats count once) to a job: shared for a store (the
    /// device reads them), `exclusive` for a load (the device writes them). Until the lease is
    /// released, the safe accessors refuse those blocks. `Err` names a block that a caller's
    /// copy or another lease holds in a conflicting way; nothing is taken then. Without
    /// [`Region::guard_blocks`] the lease takes nothing (and mints no transfer token).
    pub fn lease(self: &Arc<Self>, blocks: &[u32], exclusive: bool) -> Result<Lease, Busy> {
        let mut blocks = blocks.to_vec();
        blocks.sort_unstable();
        blocks.dedup();
        if let Some(g) = self.blocks() {
            let n = (self.len / g.block_bytes) as u32;
            blocks.retain(|&b| b < n);
            g.take_all(&blocks, exclusive)?;
        }
        Ok(Lease::new(Arc::clone(self), blocks, exclusive))
    }

    /// The token of one device transfer on `len` bytes at `offset` of a guarded region that
    /// no job leases (a worker's own pages): leases the blocks they span (exclusively if
    /// `device_writes`) and hands the lease's claim to the token, so the blocks come back
    /// when the token goes. `Err` names a block in use (leased, or a copy running). Panics
    /// without a block size, or if the bytes are outside the region.
    pub fn checkout(
        self: &Arc<Self>,
        offset: usize,
        len: usize,
        device_writes: bool,
    ) -> Result<IoBuf, Busy> {
        let g = self
            .blocks()
            .expect("a transfer token needs a region with a block size (Region::guard_blocks)");
        self.range_ptr(offset, len);
        let blocks: Vec<u32> = g.span(offset, len).collect();
        let lease = Arc::new(self.lease(&blocks, device_writes)?);
        let token = lease
            .checkout(offset, len, device_writes)
            .expect("a lease just taken holds its blocks");
        lease.release();
        Ok(token)
    }

    /// Holds the bytes `offset..offset + len` for one copy (shared to read them, `exclusive`
    /// to write them) until the returned guard drops, or panics naming the conflict: the
    /// blocks' states on a guarded region, the whole region's otherwise.
    pub(crate) fn hold(&self, offset: usize, len: usize, exclusive: bool) -> Held<'_> {
        let g = self.blocks().unwrap_or(&self.whole);
        let range = g.span(offset, len);
        if let Err(busy) = g.access(range.clone(), exclusive) {
            panic!(
                "region bytes {offset}..{}: {busy}",
                offset.saturating_add(len)
            );
        }
        Held {
            blocks: g,
            range,
            exclusive,
        }
    }

    /// Copies `dst.len()` bytes starting at `offset` out of the region.
    ///
    /// Panics if out of range, or (with [`Region::guard_blocks`]) if a load job in flight or
    /// another thread's write holds one of the blocks.
    pub fn read(&self, offset: usize, dst: &mut [u8]) {
        let _held = self.hold(offset, dst.len(), false);
        let src = self.range_ptr(offset, dst.len());
        // SAFETY: `range_ptr` checked that src..src+len lies inside the region, valid for reads
        // for the Region's life; `dst` is a distinct Rust buffer, so the ranges cannot overlap.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
    }

    /// Copies `src` into the region at `offset`.
    ///
    /// Panics if out of range, or (with [`Region::guard_blocks`]) if a job in flight or another
    /// thread's copy holds one of the blocks. Without the guard the caller must not write a
    /// range that I/O is reading or writing.
    pub fn write(&self, offset: usize, src: &[u8]) {
        let _held = self.hold(offset, src.len(), true);
        self.copy_in(offset, src);
    }

    /// [`Region::write`] without the block check, for a lease holder ([`Lease::write`]) or a
    /// transfer's claim ([`IoBuf::device_write`]), which count themselves in the blocks.
    pub(crate) fn copy_in(&self, offset: usize, src: &[u8]) {
        let dst = self.range_ptr(offset, src.len());
        // SAFETY: `range_ptr` checked that dst..dst+len lies inside the region, valid for writes
        // for the Region's life; `src` is a Rust slice and cannot alias region memory, which is
        // never lent out as a Rust reference by safe code.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
    }

    /// [`Region::read`] without the block check, for a transfer's claim ([`IoBuf::device_read`]).
    pub(crate) fn copy_out(&self, offset: usize, dst: &mut [u8]) {
        let src = self.range_ptr(offset, dst.len());
        // SAFETY: `range_ptr` checked that src..src+len lies inside the region, valid for reads
        // for the Region's life; `dst` is a distinct Rust buffer, so the ranges cannot overlap.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
    }

    /// Sets `len` bytes at `offset` to `byte`. Panics as [`Region::write`] does.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) {
        let _held = self.hold(offset, len, true);
        let dst = self.range_ptr(offset, len);
        // SAFETY: `range_ptr` checked that dst..dst+len lies inside the region, valid for writes
        // for the Region's life.
        unsafe { std::ptr::write_bytes(dst, byte, len) };
    }

    /// Borrows `len` bytes at `offset` (for hashing or checksumming without a copy).
    /// Panics if out of range.
    ///
    /// # Safety
    ///
    /// No I/O and no [`Region::write`]/[`Region::fill`] may modify `offset..offset+len` while
    /// the returned slice lives.
    pub unsafe fn slice(&self, offset: usize, len: usize) -> &[u8] {
        let ptr = self.range_ptr(offset, len);
        // SAFETY: the range is inside the region (checked by `range_ptr`), initialized (zeroed
        // at allocation, or foreign memory the caller vouched for) and valid for the lifetime of
        // `&self`; the caller guarantees nothing modifies it while the slice lives.
        unsafe { std::slice::from_raw_parts(ptr, len) }
    }

    /// Calls `f` with the `len` bytes at `offset` (checksumming or comparing without a copy).
    /// Panics as [`Region::read`] does.
    ///
    /// With [`Region::guard_blocks`], the blocks are held shared while `f` runs: no load job
    /// (the kernel writing them) and no other thread's write can reach them meanwhile. Without
    /// the guard the caller must keep I/O and writers off the range.
    pub fn with_bytes<R>(&self, offset: usize, len: usize, f: impl FnOnce(&[u8]) -> R) -> R {
        let _held = self.hold(offset, len, false);
        // SAFETY: in range (checked inside `slice`); the blocks are held shared for the call
        // (or, unguarded, the caller keeps writers off), and the slice does not escape `f`.
        f(unsafe { self.slice(offset, len) })
    }

    /// Pointer to `offset`, after checking that `offset..offset+len` is inside the region.
    /// Panics otherwise: an out-of-range access would be memory corruption, not an error.
    pub(crate) fn range_ptr(&self, offset: usize, len: usize) -> *mut u8 {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len),
            "region access out of range: offset {offset} + len {len} > region len {}",
            self.len
        );
        self.ptr.as_ptr().wrapping_add(offset)
    }
}

/// Blocks held for one accessor copy; given back on drop.
pub(crate) struct Held<'a> {
    blocks: &'a Blocks,
    range: std::ops::Range<u32>,
    exclusive: bool,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.blocks.give_range(self.range.clone(), self.exclusive);
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        // `len` is the mapping length: rounded to 2 MiB for hugetlb (munmap of a hugetlb
        // mapping must cover whole huge pages), to 4 KiB otherwise.
        // SAFETY: the Region owns this mapping (created by `allocate` with exactly this address
        // and length) and is being dropped, so nothing can use the memory afterwards; a Ring that
        // registered it holds an Arc and has unregistered and drained before releasing it.
        let rc = unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        if rc != 0 {
            tracing::error!(
                addr = self.addr(),
                len = self.len,
                errno = %Errno::last(),
                "munmap of a memory region failed; the memory leaks"
            );
        }
    }
}

fn round_up(len: usize, align: usize) -> Option<usize> {
    len.checked_next_multiple_of(align)
}

/// `mmap` of `len` bytes of private anonymous memory with extra `flags`; returns the address.
///
/// Plain `libc::mmap` on purpose: hugepage-rs was evaluated and rejected (no errno, no fallback,
/// no page-size choice).
fn mmap_anonymous(len: usize, flags: libc::c_int) -> Result<NonNull<u8>, Errno> {
    // SAFETY: a new private anonymous mapping at an address the kernel chooses (null hint, no
    // MAP_FIXED) cannot overlap or alter any existing memory.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | flags,
            -1,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(Errno::last());
    }
    NonNull::new(ptr.cast::<u8>()).ok_or(Errno::ENOMEM)
}

/// Unmaps `ptr..ptr+len`, a range this module mapped and nobody else uses.
fn munmap_unused(ptr: *mut u8, len: usize) {
    if len == 0 {
        return;
    }
    // SAFETY: callers pass only ranges of a mapping this module just created and has not handed
    // out (a failed allocation, or the alignment slack around a THP mapping).
    let rc = unsafe { libc::munmap(ptr.cast(), len) };
    if rc != 0 {
        tracing::error!(len, errno = %Errno::last(), "munmap of unused memory failed");
    }
}

/// Faults in every page of a fresh mapping, so that registration and the first I/O do not.
fn populate(ptr: NonNull<u8>, len: usize, page: usize) -> Result<(), Errno> {
    // SAFETY: madvise on a mapping this module owns; POPULATE_WRITE only faults pages in (they
    // stay zero) and does not change the contents.
    let rc = unsafe { libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_POPULATE_WRITE) };
    if rc == 0 {
        return Ok(());
    }
    let errno = Errno::last();
    if errno != Errno::EINVAL {
        // ENOMEM / EFAULT / EHWPOISON: the memory really is not there.
        return Err(errno);
    }
    // Kernel older than 5.14: write a zero to every page (the memory is already zero).
    for offset in (0..len).step_by(page) {
        let p = ptr.as_ptr().wrapping_add(offset);
        // SAFETY: offset < len, so p is inside the fresh mapping, which nobody else can see yet.
        unsafe { p.write_volatile(0) };
    }
    Ok(())
}

/// Maps `len` bytes (rounded up to 2 MiB) from the hugetlb 2 MiB pool.
fn map_hugetlb(len: usize) -> Result<Region, Errno> {
    let map_len = round_up(len, HUGE_2M).ok_or(Errno::ENOMEM)?;
    // Without MAP_NORESERVE the kernel reserves all pages now, so a short pool fails here with
    // ENOMEM instead of with SIGBUS at first touch.
    let ptr = mmap_anonymous(map_len, libc::MAP_HUGETLB | libc::MAP_HUGE_2MB)?;
    if let Err(errno) = populate(ptr, map_len, HUGE_2M) {
        munmap_unused(ptr.as_ptr(), map_len);
        return Err(errno);
    }
    Ok(Region {
        ptr,
        len: map_len,
        backing: Backing::HugeTlb2M,
        owned: true,
        blocks: OnceLock::new(),
        whole: Blocks::whole(),
    })
}

/// Maps `len` bytes of ordinary anonymous memory; with `thp`, 2 MiB aligned and rounded and
/// advised `MADV_HUGEPAGE` (falling back to 4 KiB pages if THP is off or unsupported); without,
/// advised `MADV_NOHUGEPAGE`, so that 4 KiB pages are what backs it even where THP is `always`.
fn map_anonymous(len: usize, thp: bool) -> Result<Region, Errno> {
    let asked_small = !thp;
    let thp = thp && thp_enabled();
    if !thp {
        let map_len = round_up(len, PAGE_4K).ok_or(Errno::ENOMEM)?;
        let ptr = mmap_anonymous(map_len, 0)?;
        if asked_small {
            // SAFETY: madvise on the mapping just created; MADV_NOHUGEPAGE only changes how
            // the kernel backs the range, not its contents. A kernel without THP refuses it
            // (EINVAL), which leaves 4 KiB pages anyway.
            let _ = unsafe { libc::madvise(ptr.as_ptr().cast(), map_len, libc::MADV_NOHUGEPAGE) };
        }
        if let Err(errno) = populate(ptr, map_len, PAGE_4K) {
            munmap_unused(ptr.as_ptr(), map_len);
            return Err(errno);
        }
        return Ok(Region {
            ptr,
            len: map_len,
            backing: Backing::Pages4K,
            owned: true,
            blocks: OnceLock::new(),
            whole: Blocks::whole(),
        });
    }

    // THP needs 2 MiB aligned virtual ranges: map 2 MiB extra and trim both ends.
    let map_len = round_up(len, HUGE_2M).ok_or(Errno::ENOMEM)?;
    let padded = map_len.checked_add(HUGE_2M).ok_or(Errno::ENOMEM)?;
    let raw = mmap_anonymous(padded, 0)?;
    let head = (HUGE_2M - raw.as_ptr() as usize % HUGE_2M) % HUGE_2M;
    let start = raw.as_ptr().wrapping_add(head);
    munmap_unused(raw.as_ptr(), head);
    munmap_unused(start.wrapping_add(map_len), padded - head - map_len);
    let ptr = NonNull::new(start).ok_or(Errno::ENOMEM)?;

    // SAFETY: madvise on the mapping just created; MADV_HUGEPAGE only changes how the kernel
    // backs the range, not its contents.
    let rc = unsafe { libc::madvise(ptr.as_ptr().cast(), map_len, libc::MADV_HUGEPAGE) };
    let backing = if rc == 0 {
        Backing::Thp
    } else {
        tracing::debug!(errno = %Errno::last(), "MADV_HUGEPAGE refused, using 4 KiB pages");
        Backing::Pages4K
    };
    if let Err(errno) = populate(ptr, map_len, PAGE_4K) {
        munmap_unused(ptr.as_ptr(), map_len);
        return Err(errno);
    }
    Ok(Region {
        ptr,
        len: map_len,
        backing,
        owned: true,
        blocks: OnceLock::new(),
        whole: Blocks::whole(),
    })
}

/// True unless `/sys/kernel/mm/transparent_hugepage/enabled` says `[never]` or is absent.
fn thp_enabled() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .is_ok_and(|s| !s.contains("[never]"))
}

fn read_u64(path: &str) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// The message for a failed `HugePages::Required` allocation.
fn hugetlb_error(len: usize, errno: Errno) -> AllocError {
    let needed = round_up(len, HUGE_2M).map_or(u64::MAX, |l| (l / HUGE_2M) as u64);
    let total = read_u64(&format!("{HUGETLB_2M_SYSFS}/nr_hugepages"));
    let free = read_u64(&format!("{HUGETLB_2M_SYSFS}/free_hugepages"));
    let message = match (total, free) {
        (Some(total), Some(free)) => {
            // nr_hugepages is the pool size: grow it by what is missing.
            let target = total
                .saturating_add(needed.saturating_sub(free))
                .max(needed);
            let knob = if crate::probe::hugepage_info().size_bytes == HUGE_2M as u64 {
                "/proc/sys/vm/nr_hugepages".to_owned()
            } else {
                format!("{HUGETLB_2M_SYSFS}/nr_hugepages")
            };
            format!(
                "cannot map {len} bytes of hugetlb 2 MiB pages ({errno}): {needed} pages needed, \
                 {free} free of {total} reserved; reserve them as root with \
                 `echo {target} > {knob}` (or set huge pages to auto/off)"
            )
        }
        _ => format!(
            "cannot map {len} bytes of hugetlb 2 MiB pages ({errno}): this kernel has no 2 MiB \
             hugetlb pool ({HUGETLB_2M_SYSFS} is missing); set huge pages to auto or off"
        ),
    };
    AllocError { errno, message }
}

fn anon_error(len: usize, errno: Errno) -> AllocError {
    AllocError {
        errno,
        message: format!(
            "cannot map and pre-fault {len} bytes of anonymous memory ({errno}): free memory or \
             lower the configured DRAM size (check `ulimit -v` and the cgroup memory limit)"
        ),
    }
}

#[cfg(test)]
mod tests {
    //! Allocation in each page mode, copies in and out, and the argument checks of
    //! `from_raw_parts`. A broken range check or rounding would corrupt memory or panic here.
    use super::*;

    #[test]
    fn off_rounds_to_4k_zeroed_and_copies_round_trip() {
        let r = Region::allocate(10_000, HugePages::Off).expect("allocate 4K pages");
        assert_eq!(r.len(), 12_288);
        assert_eq!(r.backing(), Backing::Pages4K);
        assert_eq!(r.addr() % PAGE_4K, 0);
        let mut buf = vec![0xFF_u8; r.len()];
        r.read(0, &mut buf);
        assert!(buf.iter().all(|&b| b == 0), "fresh memory must be zero");
        r.write(4095, b"hello, kvtier");
        let mut out = [0_u8; 13];
        r.read(4095, &mut out);
        assert_eq!(&out, b"hello, kvtier");
        r.fill(100, 50, 7);
        // SAFETY: no I/O or other writer touches the region in this test.
        let s = unsafe { r.slice(99, 52) };
        assert_eq!(s[0], 0);
        assert!(s[1..51].iter().all(|&b| b == 7));
        assert_eq!(s[51], 0);
    }

    #[test]
    fn auto_gives_2m_rounded_memory() {
        let r = Region::allocate(3 << 20, HugePages::Auto).expect("allocate auto");
        println!("auto backing: {}", r.backing());
        match r.backing() {
            Backing::HugeTlb2M | Backing::Thp => {
                assert_eq!(r.len(), 4 << 20);
                assert_eq!(r.addr() % HUGE_2M, 0);
            }
            Backing::Pages4K => assert!(r.len() >= 3 << 20),
            Backing::Foreign => panic!("allocate never returns foreign memory"),
        }
        r.write(r.len() - 4, &[1, 2, 3, 4]);
        let mut out = [0_u8; 4];
        r.read(r.len() - 4, &mut out);
        assert_eq!(out, [1, 2, 3, 4]);
    }

    #[test]
    fn required_without_pool_explains_how_to_reserve() {
        match Region::allocate(5 << 20, HugePages::Required) {
            Ok(r) => {
                assert_eq!(r.backing(), Backing::HugeTlb2M);
                println!("hugetlb pages are reserved on this machine; error path not exercised");
            }
            Err(e) => {
                println!("{e}");
                assert!(
                    e.to_string().contains("> /proc/sys/vm/nr_hugepages`"),
                    "{e}"
                );
            }
        }
    }

    #[test]
    #[should_panic(expected = "out of range")]
    fn read_out_of_range_panics() {
        let r = Region::allocate(4096, HugePages::Off).expect("allocate");
        let mut buf = [0_u8; 2];
        r.read(4095, &mut buf);
    }

    #[test]
    fn from_raw_parts_checks_alignment_and_length() {
        let backing = Region::allocate(3 * 4096, HugePages::Off).expect("allocate");
        let base = backing.range_ptr(0, backing.len());
        // SAFETY: (for all calls) the memory belongs to `backing`, which outlives the wrappers.
        let misaligned = unsafe { Region::from_raw_parts(base.wrapping_add(512), 4096) };
        assert_eq!(misaligned.err(), Some(Errno::EINVAL));
        // SAFETY: as above.
        let odd_len = unsafe { Region::from_raw_parts(base, 4097) };
        assert_eq!(odd_len.err(), Some(Errno::EINVAL));
        // SAFETY: as above.
        let empty = unsafe { Region::from_raw_parts(base, 0) };
        assert_eq!(empty.err(), Some(Errno::EINVAL));
        // SAFETY: as above.
        let ok = unsafe { Region::from_raw_parts(base.wrapping_add(4096), 8192) }.expect("wrap");
        assert_eq!(ok.backing(), Backing::Foreign);
        ok.write(0, &[9]);
        drop(ok); // must not unmap `backing`'s memory
        let mut out = [0_u8; 1];
        backing.read(4096, &mut out);
        assert_eq!(out, [9]);
    }
}
