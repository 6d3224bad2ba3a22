//! Per-block access states of a [`Region`]: what makes the region's safe accessors, its
//! leases and the device transfers on them sound together.
//!
//! Once [`Region::guard_blocks`](crate::mem::Region::guard_blocks) has set a block size, every
//! block has a state word, used as a reader-writer lock that never waits:
//! * *shared* holders: a caller's [`read`](crate::mem::Region::read) /
//!   [`with_bytes`](crate::mem::Region::with_bytes) while it runs, and a shared [`Lease`] (a
//!   store job: the device reads the block);
//! * the *exclusive* holder: a caller's [`write`](crate::mem::Region::write) /
//!   [`fill`](crate::mem::Region::fill) while it runs, or an exclusive [`Lease`] (a load job: the
//!   device writes the block).
//!
//! A conflicting access is refused, never waited for: the safe accessors panic (touching a block
//! whose job is in flight is a bug in the caller, like a second `borrow_mut` of a `RefCell`),
//! and taking a lease returns the busy block.
//!
//! Inside an exclusive lease, the word counts who is at the bytes: device transfers that write
//! them, device transfers that read them, the holder's reads ([`Lease::with_bytes`]) and its
//! one write ([`Lease::write`]). A transfer is claimed by an [`IoBuf`] minted from the lease
//! ([`Lease::checkout`]); the ring keeps it until the transfer's completion is reaped, however
//! early the job is reported, and the lease's blocks stay out of the region that long. The
//! holder's accessors refuse bytes a transfer writes (and its write, bytes a transfer reads):
//! no Rust reference ever covers memory the kernel writes. Blocks of a shared lease need no
//! count: nothing may write them.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use crate::mem::Region;

/// The exclusive holder's bit; the bits below it count shared holders.
const EXCLUSIVE: u32 = 1 << 31;
const SHARED_MAX: u32 = EXCLUSIVE - 1;

/// Inside an exclusive lease, the units of the four counts below [`EXCLUSIVE`]: device
/// transfers writing the block, device transfers reading it, the holder's reads (10 bits
/// each), and the holder's write (one bit).
const DEVICE_WRITES: u32 = 1;
const DEVICE_READS: u32 = 1 << 10;
const HOLDER_READS: u32 = 1 << 20;
const HOLDER_WRITES: u32 = 1 << 30;
const COUNT_MAX: u32 = (1 << 10) - 1;

fn count(state: u32, unit: u32) -> u32 {
    if unit == HOLDER_WRITES {
        (state / unit) & 1
    } else {
        (state / unit) & COUNT_MAX
    }
}

/// Who comes to an exclusive lease's bytes, and whom it must not meet there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Visit {
    /// A transfer that writes the bytes: not while the holder reads or writes them.
    DeviceWrites,
    /// A transfer that reads them: not while the holder writes them.
    DeviceReads,
    /// The holder reads them: not while a transfer or the holder writes them.
    HolderReads,
    /// The holder writes them: alone.
    HolderWrites,
    /// The simulated device writes them for a transfer claimed already: not while anyone on
    /// the CPU is at them.
    CopyIn,
    /// The simulated device reads them for a transfer claimed already: not while anyone on
    /// the CPU writes them.
    CopyOut,
}

impl Visit {
    fn unit(self) -> u32 {
        match self {
            Visit::DeviceWrites => DEVICE_WRITES,
            Visit::DeviceReads => DEVICE_READS,
            Visit::HolderReads | Visit::CopyOut => HOLDER_READS,
            Visit::HolderWrites | Visit::CopyIn => HOLDER_WRITES,
        }
    }

    /// The counts that keep this visit out.
    fn excluded_by(self) -> &'static [u32] {
        match self {
            // The device's accesses (claimed, or the simulated device's copies under a claim)
            // keep clear of the holder's.
            Visit::DeviceWrites | Visit::CopyIn => &[HOLDER_READS, HOLDER_WRITES],
            Visit::DeviceReads | Visit::CopyOut => &[HOLDER_WRITES],
            Visit::HolderReads => &[DEVICE_WRITES, HOLDER_WRITES],
            Visit::HolderWrites => &[DEVICE_WRITES, DEVICE_READS, HOLDER_READS, HOLDER_WRITES],
        }
    }

    fn what(unit: u32) -> &'static str {
        match unit {
            DEVICE_WRITES => "a device transfer writes them",
            DEVICE_READS => "a device transfer reads them",
            HOLDER_READS => "the lease's holder is reading them",
            _ => "the lease's holder is writing them",
        }
    }
}

pub(crate) struct Blocks {
    pub(crate) block_bytes: usize,
    states: Box<[AtomicU32]>,
}

/// The block a lease or an access could not take, and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Busy {
    pub block: u32,
    /// It is held exclusively (a load in flight, or a caller writing it); else shared holders
    /// (a store in flight, or a caller reading it) keep an exclusive lease out.
    pub exclusive: bool,
}

impl std::fmt::Display for Busy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "block {} is in use ({}); touch a block only when no job naming it is in flight",
            self.block,
            if self.exclusive {
                "a load job in flight writes it, or another thread is writing it"
            } else {
                "a store job in flight reads it, or another thread is reading it"
            }
        )
    }
}

impl std::error::Error for Busy {}

impl Blocks {
    pub(crate) fn new(block_bytes: usize, blocks: usize) -> Blocks {
        Blocks {
            block_bytes,
            states: (0..blocks).map(|_| AtomicU32::new(0)).collect(),
        }
    }

    /// One state for all of a region (before it has a block size): every offset is block 0.
    pub(crate) fn whole() -> Blocks {
        Blocks::new(usize::MAX, 1)
    }

    /// Counts `visit` in every block of `range`, all of an exclusive lease's, or none and
    /// panics naming the conflict.
    pub(crate) fn visit(&self, range: std::ops::Range<u32>, visit: Visit) {
        let unit = visit.unit();
        for b in range.clone() {
            let state = &self.states[b as usize];
            let mut cur = state.load(Ordering::Relaxed);
            loop {
                debug_assert!(cur & EXCLUSIVE != 0, "block {b} is not leased exclusively");
                let blocker = visit.excluded_by().iter().find(|&&u| count(cur, u) > 0);
                if let Some(&u) = blocker {
                    self.leave(range.start..b, visit);
                    panic!(
                        "block {b} of a lease cannot be reached now: {}",
                        Visit::what(u)
                    );
                }
                if count(cur, unit) >= COUNT_MAX {
                    self.leave(range.start..b, visit);
                    panic!(
                        "block {b} of a lease: more than {COUNT_MAX} visits of one kind at once"
                    );
                }
                match state.compare_exchange_weak(
                    cur,
                    cur + unit,
                    Ordering::Acquire,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => break,
                    Err(now) => cur = now,
                }
            }
        }
    }

    /// [`Blocks::visit`] until the returned guard drops (a panic in the visitor included).
    pub(crate) fn stay(&self, range: std::ops::Range<u32>, visit: Visit) -> Leave<'_> {
        self.visit(range.clone(), visit);
        Leave {
            blocks: self,
            span: range,
            visit,
        }
    }

    /// Undoes [`Blocks::visit`].
    pub(crate) fn leave(&self, range: std::ops::Range<u32>, visit: Visit) {
        for b in range {
            let prev = self.states[b as usize].fetch_sub(visit.unit(), Ordering::Release);
            debug_assert!(
                count(prev, visit.unit()) > 0,
                "block {b}: {visit:?} left twice"
            );
        }
    }

    /// Blocks covered (a tail shorter than a block is in none).
    pub(crate) fn blocks(&self) -> usize {
        self.states.len()
    }

    /// Whether anything (a job's lease, a caller's copy) holds `block` now.
    pub(crate) fn in_use(&self, block: u32) -> bool {
        self.states
            .get(block as usize)
            .is_some_and(|s| s.load(Ordering::Acquire) != 0)
    }

    /// The blocks overlapping `offset..offset + len` (empty for `len == 0`).
    pub(crate) fn span(&self, offset: usize, len: usize) -> std::ops::Range<u32> {
        if len == 0 {
            return 0..0;
        }
        let first = offset / self.block_bytes;
        let last = (offset + len - 1) / self.block_bytes;
        first as u32..(last as u32 + 1).min(self.states.len() as u32)
    }

    fn take(&self, block: u32, exclusive: bool) -> Result<(), Busy> {
        let state = &self.states[block as usize];
        let mut cur = state.load(Ordering::Relaxed);
        loop {
            let next = if exclusive {
                if cur != 0 {
                    return Err(Busy {
                        block,
                        exclusive: cur & EXCLUSIVE != 0,
                    });
                }
                EXCLUSIVE
            } else {
                if cur & EXCLUSIVE != 0 || cur == SHARED_MAX {
                    return Err(Busy {
                        block,
                        exclusive: true,
                    });
                }
                cur + 1
            };
            match state.compare_exchange_weak(cur, next, Ordering::Acquire, Ordering::Relaxed) {
                Ok(_) => return Ok(()),
                Err(now) => cur = now,
            }
        }
    }

    fn give(&self, block: u32, exclusive: bool) {
        let prev = self.states[block as usize]
            .fetch_sub(if exclusive { EXCLUSIVE } else { 1 }, Ordering::Release);
        debug_assert!(
            if exclusive {
                prev == EXCLUSIVE
            } else {
                prev & SHARED_MAX > 0
            },
            "block {block} released without being held"
        );
    }

    /// Takes every block of `blocks` (each once), all or none.
    pub(crate) fn take_all(&self, blocks: &[u32], exclusive: bool) -> Result<(), Busy> {
        for (i, &b) in blocks.iter().enumerate() {
            if let Err(busy) = self.take(b, exclusive) {
                for &done in &blocks[..i] {
                    self.give(done, exclusive);
                }
                return Err(busy);
            }
        }
        Ok(())
    }

    pub(crate) fn give_all(&self, blocks: &[u32], exclusive: bool) {
        for &b in blocks {
            self.give(b, exclusive);
        }
    }

    /// Takes the blocks of `range` for a caller's access of one copy, all or none.
    pub(crate) fn access(&self, range: std::ops::Range<u32>, exclusive: bool) -> Result<(), Busy> {
        for b in range.clone() {
            if let Err(busy) = self.take(b, exclusive) {
                self.give_range(range.start..b, exclusive);
                return Err(busy);
            }
        }
        Ok(())
    }

    pub(crate) fn give_range(&self, range: std::ops::Range<u32>, exclusive: bool) {
        for b in range {
            self.give(b, exclusive);
        }
    }
}

/// Blocks of a region lent to a job: until the lease is released (or dropped) and every
/// [`LeaseHold`] on it is gone, the region's safe accessors refuse them, and no other lease
/// can take them exclusively (nor, if this one is exclusive, at all).
pub struct Lease {
    region: Arc<Region>,
    /// Sorted, each once.
    blocks: Vec<u32>,
    exclusive: bool,
    released: std::sync::atomic::AtomicBool,
    /// The holder's reference (until [`Lease::release`]) plus one per [`LeaseHold`]; the
    /// blocks go back when it reaches 0.
    refs: AtomicU32,
    /// Runs once the blocks went back, when the holder released them while holds were left
    /// ([`Lease::release_when_free`]).
    on_free: std::sync::Mutex<Option<OnFree>>,
}

/// What runs once a lease's blocks went back to the region (see [`Lease::release_when_free`]).
pub type OnFree = Box<dyn FnOnce() + Send>;

/// Keeps a [`Lease`]'s blocks from going back to the region past the holder's release, for an
/// I/O that may still move their bytes (one that outlived its deadline, or a store's write
/// whose key already failed). Dropping it ends the hold.
pub struct LeaseHold(Arc<Lease>);

impl std::fmt::Debug for LeaseHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("LeaseHold").field(&self.0.blocks).finish()
    }
}

impl Drop for LeaseHold {
    fn drop(&mut self) {
        self.0.unref();
    }
}

impl Lease {
    pub(crate) fn new(region: Arc<Region>, blocks: Vec<u32>, exclusive: bool) -> Lease {
        Lease {
            region,
            blocks,
            exclusive,
            released: std::sync::atomic::AtomicBool::new(false),
            refs: AtomicU32::new(1),
            on_free: std::sync::Mutex::new(None),
        }
    }

    pub fn exclusive(&self) -> bool {
        self.exclusive
    }

    /// Distinct blocks held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The holder is done with the blocks (once; later calls and the drop do nothing): they
    /// go back to the region now, or when the last [`LeaseHold`] goes. The holder must not
    /// reach the bytes through the lease afterwards: it panics.
    pub fn release(&self) {
        if !self.released.swap(true, Ordering::AcqRel) {
            self.unref();
        }
    }

    /// Releases the holder's reference as [`Lease::release`] does and says when the blocks are
    /// back: `true` if they went back now (nothing else held them; `on_free` is not called),
    /// else `on_free()` is called once and what it returns runs when the last [`LeaseHold`]
    /// goes (on the thread that drops it; at once if that happened meanwhile). Never, if a
    /// hold is never dropped: an I/O that never completes keeps the blocks for good. A second
    /// release returns whether the blocks are back and calls nothing.
    pub fn release_when_free(&self, on_free: impl FnOnce() -> OnFree) -> bool {
        if self.released.swap(true, Ordering::AcqRel) {
            return self.refs.load(Ordering::Acquire) == 0;
        }
        if self
            .refs
            .compare_exchange(1, 0, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            self.give_back();
            return true;
        }
        *self
            .on_free
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(on_free());
        self.unref();
        false
    }

    /// Whether the blocks went back to the region (released, and no hold left).
    pub fn is_free(&self) -> bool {
        self.refs.load(Ordering::Acquire) == 0
    }

    /// Keeps the blocks past [`Lease::release`] until the returned hold is dropped. `None` if
    /// they already went back (the holder released and no hold was left): there is nothing to
    /// keep then.
    pub fn hold(self: &Arc<Self>) -> Option<LeaseHold> {
        let mut cur = self.refs.load(Ordering::Acquire);
        loop {
            if cur == 0 {
                return None;
            }
            match self
                .refs
                .compare_exchange_weak(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Some(LeaseHold(Arc::clone(self))),
                Err(now) => cur = now,
            }
        }
    }

    fn unref(&self) {
        if self.refs.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.give_back();
            let on_free = self
                .on_free
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take();
            if let Some(f) = on_free {
                f();
            }
        }
    }

    fn give_back(&self) {
        if let Some(g) = self.region.blocks() {
            g.give_all(&self.blocks, self.exclusive);
        }
    }

    /// Panics unless `offset..offset + len` lies in the leased blocks and they have not gone
    /// back (the holder has not released the lease, or a [`LeaseHold`] keeps them: an I/O's
    /// late completion may still check what it moved).
    fn check(&self, offset: usize, len: usize) {
        assert!(
            self.refs.load(Ordering::Acquire) > 0,
            "a released lease was used"
        );
        if let Some(g) = self.region.blocks() {
            for b in g.span(offset, len) {
                assert!(
                    self.blocks.binary_search(&b).is_ok(),
                    "bytes {offset}..{} reach block {b}, which this lease does not hold",
                    offset + len
                );
            }
        }
    }

    /// The holder's read of leased bytes (a checksum after a read landed). Panics unless the
    /// bytes lie in this lease's blocks, not yet gone back, and (an exclusive lease) no device
    /// transfer writes them and no [`Lease::write`] runs on them. On a region without a block
    /// size, the region's own [`Region::with_bytes`].
    pub fn with_bytes<R>(&self, offset: usize, len: usize, f: impl FnOnce(&[u8]) -> R) -> R {
        let Some(g) = self.region.blocks() else {
            return self.region.with_bytes(offset, len, f);
        };
        self.check(offset, len);
        // A shared lease's blocks are written by no one: nothing to count.
        let _stay = self
            .exclusive
            .then(|| g.stay(g.span(offset, len), Visit::HolderReads));
        // SAFETY: the bytes lie in blocks this lease holds (checked), so the region's accessors
        // and other leases cannot write them; a shared lease's blocks are written by no one, an
        // exclusive one's are counted as read by the holder, which keeps transfers that write
        // them and the holder's `write` out until `_leave` drops, after `f`; the slice does not
        // escape `f`.
        f(unsafe { self.region.slice(offset, len) })
    }

    /// The holder's write into leased bytes (an object-store GET landing in its block).
    /// Panics unless the lease is exclusive, the bytes lie in its blocks, not yet gone back,
    /// and no device transfer and no other access of the holder is at them. On a region
    /// without a block size, the region's own [`Region::write`].
    pub fn write(&self, offset: usize, src: &[u8]) {
        assert!(self.exclusive, "writing through a shared lease");
        let Some(g) = self.region.blocks() else {
            return self.region.write(offset, src);
        };
        self.check(offset, src.len());
        let _stay = g.stay(g.span(offset, src.len()), Visit::HolderWrites);
        self.region.copy_in(offset, src);
    }

    /// Mints the claim of one device transfer on `len` bytes at `offset` of the region: one
    /// that writes them (a read from the device; the lease must be exclusive) if
    /// `device_writes`, else one that reads them. The blocks stay out of the region while the
    /// [`IoBuf`] lives, even past the holder's release; the ring keeps it until the transfer's
    /// completion is reaped. `None` if the blocks went back already (nothing to claim).
    /// Panics unless the region has a block size and the bytes lie in this lease's blocks, or
    /// if the holder is at them in a conflicting way (reading bytes the device is to write).
    pub fn checkout(
        self: &Arc<Self>,
        offset: usize,
        len: usize,
        device_writes: bool,
    ) -> Option<IoBuf> {
        let g = self
            .region
            .blocks()
            .expect("a transfer token needs a region with a block size (Region::guard_blocks)");
        assert!(
            !device_writes || self.exclusive,
            "a device read into a shared lease (blocks {:?}): other readers may see it land",
            self.blocks
        );
        assert!(len > 0, "a transfer of no bytes");
        assert!(
            offset
                .checked_add(len)
                .is_some_and(|end| end <= g.block_bytes * g.blocks()),
            "a transfer of {len} bytes at {offset} reaches past the region's last whole block"
        );
        let hold = self.hold()?;
        self.check(offset, len);
        let visit = if device_writes {
            Visit::DeviceWrites
        } else {
            Visit::DeviceReads
        };
        let span = g.span(offset, len);
        if self.exclusive {
            g.visit(span.clone(), visit);
        }
        Some(IoBuf {
            hold,
            offset,
            len,
            visit: self.exclusive.then_some(visit),
            span,
            device_writes,
        })
    }

    /// Whether this lease is on `region`.
    pub fn is_on(&self, region: &Region) -> bool {
        std::ptr::eq(Arc::as_ptr(&self.region), region)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.release();
    }
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("blocks", &self.blocks)
            .field("exclusive", &self.exclusive)
            .field("released", &self.released)
            .finish_non_exhaustive()
    }
}

/// Leaves a [`Blocks::visit`] when dropped ([`Blocks::stay`]).
pub(crate) struct Leave<'a> {
    blocks: &'a Blocks,
    span: std::ops::Range<u32>,
    visit: Visit,
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        self.blocks.leave(self.span.clone(), self.visit);
    }
}

/// One device transfer's claim on bytes of a [`Lease`] ([`Lease::checkout`],
/// [`Region::checkout`]), the token a transfer carries (as tokio-uring's fixed-buffer
/// checkout): not `Clone`, moved into the ring with the transfer
/// ([`Ring::push_read`](crate::ring::Ring::push_read) and the others) and dropped when the
/// ring pops its completion. While it lives, the lease's blocks stay out of the region (its
/// safe accessors refuse them, no other lease takes them) and the holder's accessors refuse
/// the bytes in the ways [`crate::blocks`] lists: no Rust reference covers memory the kernel
/// may write.
///
/// ```compile_fail,E0599
/// // A token names one transfer: it cannot be copied into a second one.
/// fn two(t: kvtier_sys::blocks::IoBuf) -> (kvtier_sys::blocks::IoBuf, kvtier_sys::blocks::IoBuf) {
///     (t.clone(), t)
/// }
/// ```
///
/// ```compile_fail,E0451
/// // Nor made up: only a lease (or a region, for bytes no job holds) mints one.
/// fn forge(hold: kvtier_sys::blocks::LeaseHold) -> kvtier_sys::blocks::IoBuf {
///     kvtier_sys::blocks::IoBuf { hold, offset: 0, len: 4096, visit: None, span: 0..0, device_writes: true }
/// }
/// ```
pub struct IoBuf {
    hold: LeaseHold,
    offset: usize,
    len: usize,
    /// What the transfer counts in the blocks of `span` (an exclusive lease's), until dropped.
    visit: Option<Visit>,
    span: std::ops::Range<u32>,
    device_writes: bool,
}

impl Drop for IoBuf {
    fn drop(&mut self) {
        if let (Some(visit), Some(g)) = (self.visit, self.hold.0.region.blocks()) {
            g.leave(self.span.clone(), visit);
        }
        // Then `hold` drops: the blocks go back if this was the last claim on a released lease.
    }
}

impl std::fmt::Debug for IoBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoBuf")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("device_writes", &self.device_writes)
            .finish_non_exhaustive()
    }
}

impl IoBuf {
    /// Byte offset in the region.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Bytes the transfer moves (never 0).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a token claims at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the device writes the bytes (a read from the device).
    pub fn device_writes(&self) -> bool {
        self.device_writes
    }

    /// The region the bytes are in.
    pub fn region(&self) -> &Arc<Region> {
        &self.hold.0.region
    }

    /// A claim of its own on `len` bytes at `at` within this one (one command of a transfer
    /// cut in several), kept as long as it lives even if this one goes first. Panics if the
    /// bytes are outside this claim.
    #[must_use]
    pub fn part(&self, at: usize, len: usize) -> IoBuf {
        assert!(
            len > 0 && at.checked_add(len).is_some_and(|end| end <= self.len),
            "part {at}+{len} of a {}-byte transfer",
            self.len
        );
        let lease = &self.hold.0;
        let hold = lease.hold().expect("a live token keeps its lease");
        let offset = self.offset + at;
        let span = lease.region.blocks().map_or(0..0, |g| g.span(offset, len));
        if let (Some(visit), Some(g)) = (self.visit, lease.region.blocks()) {
            g.visit(span.clone(), visit);
        }
        IoBuf {
            hold,
            offset,
            len,
            visit: self.visit,
            span,
            device_writes: self.device_writes,
        }
    }

    /// The transfer's bytes as a ring's buffer reference, the region registered as `region`.
    pub fn buf_ref(&self, region: u16) -> crate::ring::BufRef {
        crate::ring::BufRef {
            region,
            offset: self.offset,
            len: u32::try_from(self.len).expect("one transfer moves less than 4 GiB"),
        }
    }

    /// Plays the device for a simulated transfer that writes the bytes: copies `src` to byte
    /// `at` of the claim. Panics unless this is a claim to write and `src` fits, or if the
    /// holder reads or writes the bytes meanwhile (another thread).
    pub fn device_write(&self, at: usize, src: &[u8]) {
        assert!(self.device_writes, "device_write on a claim to read");
        assert!(
            at.checked_add(src.len()).is_some_and(|end| end <= self.len),
            "{} bytes at {at} of a {}-byte transfer",
            src.len(),
            self.len
        );
        let region = self.region();
        let g = region
            .blocks()
            .expect("tokens exist on guarded regions only");
        // An exclusive lease's blocks (a claim to write has one): the copy also excludes the
        // holder's accessors and other simulated copies.
        let _stay = g.stay(g.span(self.offset + at, src.len()), Visit::CopyIn);
        region.copy_in(self.offset + at, src);
    }

    /// Plays the device for a simulated transfer that reads the bytes: copies byte `at` of the
    /// claim on into `dst`. Panics unless `dst` fits.
    pub fn device_read(&self, at: usize, dst: &mut [u8]) {
        assert!(
            at.checked_add(dst.len()).is_some_and(|end| end <= self.len),
            "{} bytes at {at} of a {}-byte transfer",
            dst.len(),
            self.len
        );
        let lease = &self.hold.0;
        let g = lease
            .region
            .blocks()
            .expect("tokens exist on guarded regions only");
        let _stay = lease
            .exclusive
            .then(|| g.stay(g.span(self.offset + at, dst.len()), Visit::CopyOut));
        lease.region.copy_out(self.offset + at, dst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::HugePages;

    fn guarded(blocks: usize) -> Arc<Region> {
        let r = Region::allocate(blocks * 4096, HugePages::Off).expect("allocate");
        r.guard_blocks(4096).expect("guard");
        Arc::new(r)
    }

    #[test]
    fn a_load_lease_refuses_every_other_access_until_released() {
        let r = guarded(4);
        let lease = r.lease(&[1, 1, 2], true).expect("free blocks");
        assert_eq!(
            r.lease(&[2], false).expect_err("held exclusively"),
            Busy {
                block: 2,
                exclusive: true
            }
        );
        assert!(r.lease(&[0, 1], true).is_err(), "all or none");
        let _other = r
            .lease(&[0], true)
            .expect("block 0 was not taken by the failed lease");
        let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut b = [0u8; 8];
            r.read(4096 + 100, &mut b);
        }));
        assert!(read.is_err(), "a caller's read of a leased block panics");
        // The holder reaches its blocks; bytes outside them are refused.
        lease.write(4096, b"landed");
        assert!(lease.with_bytes(4096, 6, |b| b == b"landed"));
        let outside = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            lease.with_bytes(3 * 4096, 8, |_| ());
        }));
        assert!(outside.is_err());
        lease.release();
        let mut b = [0u8; 6];
        r.read(4096, &mut b);
        assert_eq!(&b, b"landed");
        r.write(2 * 4096, b"free again");
    }

    #[test]
    fn store_leases_share_with_reads_and_each_other_not_with_writes() {
        let r = guarded(2);
        let a = r.lease(&[0], false).expect("shared");
        let b = r.lease(&[0], false).expect("shared twice");
        assert_eq!(
            r.with_bytes(0, 16, <[u8]>::len),
            16,
            "reads share with stores"
        );
        assert!(
            r.lease(&[0], true).is_err(),
            "no load into a block being stored"
        );
        let write = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| r.fill(0, 8, 1)));
        assert!(write.is_err(), "no write into a block being stored");
        drop(a);
        assert!(r.lease(&[0], true).is_err(), "one store still holds it");
        drop(b);
        assert!(r.lease(&[0], true).is_ok());
    }

    #[test]
    fn accessors_span_blocks_and_leases_on_unguarded_regions_take_nothing() {
        let r = guarded(3);
        let _l = r.lease(&[2], true).expect("lease");
        r.write(0, &[7u8; 8192]); // blocks 0 and 1
        let across = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            r.write(4096, &[1u8; 8193]); // reaches block 2
        }));
        assert!(across.is_err());
        // The failed write took nothing: block 1 is free.
        r.write(4096, &[2u8; 16]);
        let plain = Arc::new(Region::allocate(8192, HugePages::Off).expect("allocate"));
        let l = plain.lease(&[0], true).expect("no guard: nothing to take");
        plain.write(0, b"ok");
        drop(l);
        assert_eq!(r.guard_blocks(4096), Ok(()));
        assert_eq!(r.guard_blocks(8192), Err(crate::Errno::EBUSY));
    }

    #[test]
    fn a_worker_page_is_claimed_for_its_transfer_only() {
        let r = guarded(2);
        let page = r.checkout(4096, 4096, false).expect("free");
        assert!(r.is_leased(1) && !r.is_leased(0));
        let w = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| r.fill(4096, 8, 1)));
        assert!(
            w.is_err(),
            "the page is not written while the device reads it"
        );
        let mut b = [9u8; 8];
        r.read(4096, &mut b);
        assert_eq!(b, [0; 8], "readers share with the device");
        assert!(
            r.checkout(4096, 8, true).is_err(),
            "no second transfer writes it"
        );
        drop(page);
        assert!(!r.is_leased(1));
        r.fill(4096, 8, 1);
        let plain = Arc::new(Region::allocate(4096, HugePages::Off).expect("allocate"));
        let none = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            plain.checkout(0, 4096, true)
        }));
        assert!(none.is_err(), "no token without a block size");
    }

    #[test]
    fn a_region_without_a_block_size_lets_one_writer_in_at_a_time() {
        let plain = Region::allocate(3 * 4096, HugePages::Off).expect("allocate");
        plain.write(10, b"abc");
        let inside = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            plain.with_bytes(0, 16, |_| plain.fill(2 * 4096, 8, 1));
        }));
        assert!(
            inside.is_err(),
            "a write while a borrow of other bytes lives is refused: without a block size the \
             whole region is one"
        );
        let reads = plain.with_bytes(0, 16, |outer| {
            plain.with_bytes(4096, 8, |inner| outer[10..13] == *b"abc" && inner == [0; 8])
        });
        assert!(reads, "readers share");
        plain.fill(0, 16, 2);
        assert!(
            plain.with_bytes(0, 16, |b| b == [2; 16]),
            "released after each copy"
        );
    }

    #[test]
    fn holds_keep_the_blocks_past_the_release_until_the_last_goes() {
        let r = guarded(2);
        let lease = Arc::new(r.lease(&[0], true).expect("free"));
        let a = lease.hold().expect("held");
        let b = lease.hold().expect("held twice");
        lease.release();
        lease.release();
        assert!(r.is_leased(0), "two holds keep it");
        drop(a);
        assert!(r.is_leased(0), "one hold keeps it");
        assert!(r.lease(&[0], false).is_err());
        drop(b);
        assert!(!r.is_leased(0), "back once the last hold went");
        assert!(lease.hold().is_none(), "nothing left to hold");
        let again = r.lease(&[0], false).expect("free again");
        drop(lease);
        assert!(
            r.is_leased(0),
            "the old lease's drop gives nothing back twice"
        );
        drop(again);
        assert!(!r.is_leased(0));
    }

    #[test]
    fn release_when_free_says_when_the_last_hold_goes() {
        use std::sync::atomic::AtomicUsize;
        let r = guarded(3);
        let quick = r.lease(&[0], true).expect("free");
        let called = Arc::new(AtomicUsize::new(0));
        let c = Arc::clone(&called);
        assert!(
            quick.release_when_free(move || Box::new(move || {
                c.fetch_add(1, Ordering::SeqCst);
            })),
            "nothing held it: back at once"
        );
        assert!(quick.is_free() && !r.is_leased(0));
        assert_eq!(
            called.load(Ordering::SeqCst),
            0,
            "the fast path calls nothing"
        );

        let held = Arc::new(r.lease(&[1, 2], true).expect("free"));
        let io = held.hold().expect("held");
        let c = Arc::clone(&called);
        let region = Arc::clone(&r);
        assert!(!held.release_when_free(move || Box::new(move || {
            // Runs once the blocks are back: a caller woken here may take them at once.
            assert!(!region.is_leased(1) && !region.is_leased(2));
            c.fetch_add(1, Ordering::SeqCst);
        })));
        assert!(r.is_leased(1) && !held.is_free());
        assert_eq!(
            called.load(Ordering::SeqCst),
            0,
            "the I/O still holds the blocks"
        );
        drop(io);
        assert_eq!(called.load(Ordering::SeqCst), 1, "the last hold ran it");
        assert!(held.is_free() && !r.is_leased(2));
        assert!(held.release_when_free(|| unreachable!("released already")));
        assert_eq!(called.load(Ordering::SeqCst), 1, "once");
    }

    #[test]
    fn a_transfer_token_keeps_its_blocks_until_it_is_dropped() {
        let r = guarded(4);
        let load = Arc::new(r.lease(&[1, 2], true).expect("free blocks"));
        let store = Arc::new(r.lease(&[3], false).expect("free block"));
        let into = load.checkout(4096, 2 * 4096, true).expect("held");
        assert_eq!((into.offset(), into.len()), (4096, 2 * 4096));
        assert!(into.device_writes());
        let b = into.buf_ref(0);
        assert_eq!((b.region, b.offset, b.len), (0, 4096, 8192));
        let from = store.checkout(3 * 4096, 100, false).expect("held");
        let wrong = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            store.checkout(3 * 4096, 100, true)
        }));
        assert!(
            wrong.is_err(),
            "a device read into a shared lease is refused"
        );
        let outside = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            load.checkout(0, 4096, true)
        }));
        assert!(outside.is_err(), "bytes outside the lease are refused");
        // The holder cannot read bytes a transfer writes, nor write bytes a transfer reads;
        // the simulated device copies under its claim.
        let holder_reads = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            load.with_bytes(4096, 16, |_| ());
        }));
        assert!(
            holder_reads.is_err(),
            "no reference over bytes the device writes"
        );
        into.device_write(10, b"landed late");
        let mut back = [0u8; 11];
        into.device_read(10, &mut back);
        assert_eq!(&back, b"landed late");
        let part = into.part(4096, 4096);
        assert_eq!((part.offset(), part.len()), (2 * 4096, 4096));
        // The holder's reads and the transfer that writes the bytes exclude each other.
        let other = Arc::new(r.lease(&[0], true).expect("free block"));
        let out = other.checkout(0, 4096, false).expect("held");
        other.with_bytes(0, 8, |_| ());
        let w = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| other.write(0, b"x")));
        assert!(w.is_err(), "no write under bytes the device reads");
        drop(out);
        other.write(0, b"x");
        other.with_bytes(0, 1, |b| assert_eq!(b, b"x"));
        let busy = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            other.with_bytes(0, 8, |_| other.checkout(0, 8, true))
        }));
        assert!(
            busy.is_err(),
            "no transfer writes bytes the holder is reading"
        );
        other
            .checkout(0, 8, true)
            .expect("the failed checkout left nothing behind");
        drop(other);
        // The job is reported: the holder releases, the tokens keep the blocks.
        let freed = Arc::new(AtomicU32::new(0));
        let f = Arc::clone(&freed);
        assert!(!load.release_when_free(|| Box::new(move || {
            f.fetch_add(1, Ordering::SeqCst);
        })));
        store.release();
        assert!(r.is_leased(1) && r.is_leased(2) && r.is_leased(3));
        let late = std::panic::catch_unwind(|| r.fill(4096, 16, 0xAB));
        assert!(
            late.is_err(),
            "a caller cannot write under an in-flight read"
        );
        drop(from);
        assert!(!r.is_leased(3), "the store's write was reaped");
        assert_eq!(freed.load(Ordering::SeqCst), 0);
        drop(into);
        assert_eq!(
            freed.load(Ordering::SeqCst),
            0,
            "a part of the read is still out"
        );
        drop(part);
        assert_eq!(freed.load(Ordering::SeqCst), 1, "the read was reaped");
        assert!(!r.is_leased(1) && !r.is_leased(2));
        assert!(
            load.checkout(4096, 16, true).is_none(),
            "nothing left to claim"
        );
    }
}
