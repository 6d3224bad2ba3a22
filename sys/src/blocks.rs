//! Per-block access states of a [`Region`]: what makes the region's safe
//! accessors sound while I/O runs on some of its blocks.
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
//! and taking a lease returns the busy block. The holder of a lease reaches the leased bytes
//! through it ([`Lease::with_bytes`], [`Lease::write`]), at times it knows no I/O is running on
//! them (after the completion), which is the engine's own invariant.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use crate::mem::Region;

/// The exclusive holder's bit; the bits below it count shared holders.
const EXCLUSIVE: u32 = 1 << 31;
const SHARED_MAX: u32 = EXCLUSIVE - 1;

pub(crate) struct Blocks {
    pub(crate) block_bytes: usize,
    /// Whether the safe accessors take and check blocks (a guard), or only leases are recorded
    /// ([`Region::track_blocks`](crate::mem::Region::track_blocks)).
    pub(crate) enforced: bool,
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
    pub(crate) fn new(block_bytes: usize, blocks: usize, enforced: bool) -> Blocks {
        Blocks {
            block_bytes,
            enforced,
            states: (0..blocks).map(|_| AtomicU32::new(0)).collect(),
        }
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

    /// The holder's read of leased bytes (a checksum after a read landed).
    pub fn with_bytes<R>(&self, offset: usize, len: usize, f: impl FnOnce(&[u8]) -> R) -> R {
        self.check(offset, len);
        // SAFETY: the bytes lie in blocks this lease holds, so no caller access and no other
        // exclusive lease can reach them; the holder calls this only when no I/O it started
        // is running on them (the engine's invariant), and the slice does not escape `f`.
        f(unsafe { self.region.slice(offset, len) })
    }

    /// The holder's write into leased bytes (an object-store GET landing in its block).
    /// Panics unless the lease is exclusive.
    pub fn write(&self, offset: usize, src: &[u8]) {
        assert!(self.exclusive, "writing through a shared lease");
        self.check(offset, src.len());
        self.region.copy_in(offset, src);
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
    fn accessors_span_blocks_and_unguarded_regions_check_nothing() {
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
        assert_eq!(
            r.track_blocks(4096),
            Err(crate::Errno::EBUSY),
            "guarded already"
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
    fn a_tracked_region_records_leases_and_lets_accessors_through() {
        let r = Region::allocate(3 * 4096, HugePages::Off).expect("allocate");
        r.track_blocks(4096).expect("track");
        let r = Arc::new(r);
        assert_eq!(
            r.guard_blocks(4096),
            Err(crate::Errno::EBUSY),
            "tracked already"
        );
        assert_eq!(r.first_unheld(0, 3 * 4096), Some(0));
        let load = r.lease(&[1, 2], true).expect("free blocks");
        let store = r.lease(&[0], false).expect("free block");
        assert!(r.lease(&[2], false).is_err(), "leases still conflict");
        assert!(r.is_leased(1) && r.is_leased(0));
        assert_eq!(r.first_unheld(4096, 2 * 4096), None, "both held");
        // A simulated device copies through the accessors while the lease holds the block.
        r.write(4096, b"dma");
        assert!(load.with_bytes(4096, 3, |b| b == b"dma"));
        drop(store);
        assert_eq!(
            r.first_unheld(0, 8192),
            Some(0),
            "the store's block is back"
        );
        load.release();
        assert_eq!(r.first_unheld(4096 + 10, 4096), Some(1));
        assert!(!r.is_leased(2));
        let plain = Region::allocate(4096, HugePages::Off).expect("allocate");
        assert_eq!(
            plain.first_unheld(0, 4096),
            None,
            "no block size: nothing to say"
        );
    }
}
