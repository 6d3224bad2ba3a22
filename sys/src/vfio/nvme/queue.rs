//! One I/O queue pair of a [`Controller`]: commands written straight into the submission queue,
//! one doorbell per batch, completions polled by their phase bit.

use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

use super::{
    Controller, Failure, IoCompletion, Sqe, ADMIN_DELETE_CQ, ADMIN_DELETE_SQ, IO_FLUSH, PAGE,
};
use crate::blocks::IoBuf;
use crate::mem::Region;
use crate::nvme::{Opcode, Status};

/// One command in flight: who asked, and the claim on its bytes.
pub(super) struct Slot {
    pub(super) user_data: u64,
    pub(super) _buf: Option<IoBuf>,
}

/// The submission queue is full: nothing was queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueFull;

/// One I/O queue pair, used by one thread: commands written straight into the submission
/// queue, completions polled.
pub struct IoQueue {
    pub(super) ctrl: Controller,
    pub(super) qid: u16,
    pub(super) depth: u16,
    pub(super) sq_at: (std::ptr::NonNull<u8>, u64),
    pub(super) cq_at: (std::ptr::NonNull<u8>, u64),
    pub(super) prp_at: (std::ptr::NonNull<u8>, u64),
    pub(super) tail: u16,
    /// The tail the doorbell last heard.
    pub(super) rung: u16,
    pub(super) head: u16,
    pub(super) phase: bool,
    pub(super) slots: Vec<Option<Slot>>,
    pub(super) free: Vec<u16>,
    pub(super) regions: Vec<(Arc<Region>, u64)>,
    /// The queue was deleted or its controller fenced: its slots were answered.
    pub(super) gone: bool,
    pub(super) register_writes: u64,
}

// SAFETY: the raw pointers are into queue memory the controller keeps mapped while any queue
// holds it (`Inner` owns the `DmaMem`s); one thread at a time uses a queue (`&mut self`).
unsafe impl Send for IoQueue {}

impl std::fmt::Debug for IoQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoQueue")
            .field("qid", &self.qid)
            .field("depth", &self.depth)
            .field("in_flight", &self.in_flight())
            .finish_non_exhaustive()
    }
}

impl IoQueue {
    fn mem_word(at: (std::ptr::NonNull<u8>, u64), offset: usize) -> *mut u32 {
        // SAFETY: callers keep `offset` inside the queue's memory (entry indexes < depth).
        unsafe { at.0.as_ptr().add(offset).cast() }
    }

    /// Commands pushed and not yet reaped.
    pub fn in_flight(&self) -> usize {
        usize::from(self.depth) - self.free.len()
    }

    /// Entries the queue holds (one less than its depth may be in flight).
    pub fn depth(&self) -> u16 {
        self.depth
    }

    /// Queues a read (into the bytes `buf` claims, which must be a claim to write) or a write
    /// of them, `buf.len()` bytes at LBA `slba`, in the region mapped as `region`. The doorbell
    /// rings at the next [`IoQueue::submit`]. Panics if the transfer is longer than
    /// [`ControllerInfo::max_transfer_bytes`], not a whole number of LBAs, not 4-byte aligned,
    /// outside the namespace, or `buf` is not in region `region`. `Err(QueueFull)`: nothing
    /// queued, `buf` dropped.
    pub fn push(
        &mut self,
        user_data: u64,
        op: Opcode,
        slba: u64,
        region: u16,
        buf: IoBuf,
    ) -> Result<(), QueueFull> {
        let info = &self.ctrl.inner.info;
        assert!(
            op != Opcode::Read || buf.device_writes(),
            "an NVMe read into bytes claimed only to be read"
        );
        let len = buf.len();
        assert!(
            len <= info.max_transfer_bytes() && len.is_multiple_of(info.lba_bytes() as usize),
            "a {len}-byte NVMe transfer (whole LBAs of {} bytes, at most {})",
            info.lba_bytes(),
            info.max_transfer_bytes()
        );
        let lbas = (len >> info.lba_shift) as u64;
        assert!(
            slba.checked_add(lbas).is_some_and(|end| end <= info.lbas),
            "LBAs {slba}+{lbas} outside namespace {} of {} LBAs",
            info.nsid,
            info.lbas
        );
        let Some((mapped, base)) = self.regions.get(usize::from(region)) else {
            panic!("region {region} is not mapped on this queue");
        };
        assert!(
            Arc::ptr_eq(mapped, buf.region()),
            "a claim on another region than {region}"
        );
        let iova = base + buf.offset() as u64;
        assert!(iova.is_multiple_of(4), "a transfer at an unaligned offset");
        if self.gone || self.free.len() <= 1 {
            // One entry stays empty: a full ring would look empty to the controller.
            return Err(QueueFull);
        }
        let cid = self.free.pop().expect("a free slot");
        let (prp1, prp2) = self.prps(cid, iova, len);
        let sqe = Sqe::new(op as u8, cid, info.nsid)
            .prp(prp1, prp2)
            // Truncations intended: the start LBA's halves; NLB is zero-based, < 2^16.
            .cdw(10, slba as u32)
            .cdw(11, (slba >> 32) as u32)
            .cdw(12, (lbas - 1) as u32);
        self.write_sqe(&sqe);
        self.slots[usize::from(cid)] = Some(Slot {
            user_data,
            _buf: Some(buf),
        });
        Ok(())
    }

    /// Queues a Flush (the drive's volatile cache to the medium).
    pub fn push_flush(&mut self, user_data: u64) -> Result<(), QueueFull> {
        if self.gone || self.free.len() <= 1 {
            return Err(QueueFull);
        }
        let cid = self.free.pop().expect("a free slot");
        self.write_sqe(&Sqe::new(IO_FLUSH, cid, self.ctrl.inner.info.nsid));
        self.slots[usize::from(cid)] = Some(Slot {
            user_data,
            _buf: None,
        });
        Ok(())
    }

    fn write_sqe(&mut self, sqe: &Sqe) {
        let at = usize::from(self.tail) * 64;
        for (i, w) in sqe.0.iter().enumerate() {
            // SAFETY: entry `tail` < depth of the submission queue's memory; the controller
            // reads it only after the doorbell says so.
            unsafe { Self::mem_word(self.sq_at, at + 4 * i).write_volatile(*w) };
        }
        self.tail = (self.tail + 1) % self.depth;
    }

    /// PRP1 and PRP2 for `len` bytes at `iova`: the second page, or command `cid`'s PRP list.
    fn prps(&self, cid: u16, iova: u64, len: usize) -> (u64, u64) {
        let first = (PAGE - (iova as usize % PAGE)).min(len);
        let rest = len - first;
        if rest == 0 {
            return (iova, 0);
        }
        let second = iova + first as u64;
        if rest <= PAGE {
            return (iova, second);
        }
        let list = usize::from(cid) * PAGE;
        for (i, page) in (0..rest.div_ceil(PAGE)).enumerate() {
            let entry = second + (page * PAGE) as u64;
            assert!(i < PAGE / 8, "a PRP list longer than one page");
            // SAFETY: command `cid`'s own list page, inside the PRP memory (cid < depth).
            unsafe {
                Self::mem_word(self.prp_at, list + 8 * i).write_volatile(entry as u32);
                Self::mem_word(self.prp_at, list + 8 * i + 4).write_volatile((entry >> 32) as u32);
            }
        }
        (iova, self.prp_at.1 + list as u64)
    }

    /// Rings the submission doorbell once for every command pushed since the last call;
    /// whether it rang (false with nothing new to send).
    pub fn submit(&mut self) -> bool {
        if self.tail == self.rung || self.gone {
            return false;
        }
        // The entries (and their PRP lists) are in memory before the controller hears of them.
        fence(Ordering::SeqCst);
        if self
            .ctrl
            .ring(2 * usize::from(self.qid), self.rung, self.tail)
        {
            self.register_writes += 1;
        }
        self.rung = self.tail;
        true
    }

    /// Doorbell register writes so far (with shadow doorbells, fewer than the batches rung).
    pub fn register_writes(&self) -> u64 {
        self.register_writes
    }

    /// Moves every completion the controller has posted into `out` (dropping each command's
    /// claim), rings the head doorbell once, and returns how many. After a fence, every
    /// command still in flight is answered [`Failure::Fenced`].
    pub fn reap(&mut self, out: &mut Vec<IoCompletion>) -> usize {
        if self.ctrl.is_fenced() {
            return self.answer_all(out, Failure::Fenced);
        }
        let mut n = 0;
        let head_before = self.head;
        loop {
            let at = usize::from(self.head) * 16;
            // SAFETY: entry `head` < depth of the completion queue's memory (volatile: the
            // controller writes it).
            let dw3 = unsafe { Self::mem_word(self.cq_at, at + 12).read_volatile() };
            if (dw3 >> 16 & 1 == 1) != self.phase {
                break;
            }
            fence(Ordering::Acquire);
            let cid = (dw3 & 0xffff) as u16;
            let status = (dw3 >> 17) as u16;
            self.head = (self.head + 1) % self.depth;
            if self.head == 0 {
                self.phase = !self.phase;
            }
            let Some(slot) = self.slots.get_mut(usize::from(cid)).and_then(Option::take) else {
                tracing::error!(qid = self.qid, cid, "completion for no command in flight");
                continue;
            };
            self.free.push(cid);
            let result = if Status(status).is_success() {
                Ok(())
            } else {
                Err(Failure::Status(Status(status)))
            };
            out.push(IoCompletion {
                user_data: slot.user_data,
                result,
            });
            n += 1;
        }
        if n > 0
            && self
                .ctrl
                .ring(2 * usize::from(self.qid) + 1, head_before, self.head)
        {
            self.register_writes += 1;
        }
        n
    }

    fn answer_all(&mut self, out: &mut Vec<IoCompletion>, why: Failure) -> usize {
        let mut n = 0;
        for (cid, slot) in self.slots.iter_mut().enumerate() {
            if let Some(slot) = slot.take() {
                out.push(IoCompletion {
                    user_data: slot.user_data,
                    result: Err(why),
                });
                self.free.push(cid as u16);
                n += 1;
            }
        }
        self.gone = true;
        n
    }
}

impl Drop for IoQueue {
    fn drop(&mut self) {
        if self.gone || self.ctrl.is_fenced() {
            return;
        }
        // Deleting the submission queue completes or aborts every command on it before the
        // deletion completes; if it cannot be deleted, the controller is fenced. Either way no
        // DMA can reach the claimed bytes once the slots drop below.
        let qid = u32::from(self.qid);
        let deleted = self
            .ctrl
            .admin(
                Sqe::new(ADMIN_DELETE_SQ, 0, 0).cdw(10, qid),
                "delete I/O submission queue",
            )
            .and_then(|_| {
                self.ctrl.admin(
                    Sqe::new(ADMIN_DELETE_CQ, 0, 0).cdw(10, qid),
                    "delete I/O completion queue",
                )
            });
        if let Err(e) = deleted {
            tracing::error!("{e}; fencing the controller");
            self.ctrl.fence();
        }
        self.slots.clear();
    }
}
