//! One `io_uring` instance per worker thread, moving blocks between registered [`Region`]s and
//! registered [`DeviceFile`]s with `READ_FIXED`/`WRITE_FIXED`, and running the file-system
//! operations of the one-file-per-block layout ([`FileOp`]: open, read, write, fsync, close,
//! rename, unlink, mkdir) so that a worker never blocks its ring on a syscall.
//!
//! Invariants:
//! * Memory the kernel may touch stays alive until its completion has been reaped: the ring
//!   holds an `Arc` to every registered region and file and to every eventfd it reads, and owns
//!   the 8-byte buffer of eventfd reads and a copy of every path of a queued [`FileOp`]; `Drop`
//!   first drains every in-flight operation (cancelling what can be cancelled), then unregisters
//!   buffers and files, and only then releases them. If draining fails, the memory is leaked
//!   rather than freed under the kernel.
//! * A path copy is freed only once a completion with its `user_data` has been popped *and* the
//!   kernel has consumed its SQE (see `PathStore`), so even a `user_data` reused against the
//!   contract cannot free a path the kernel has yet to read.
//! * `in_flight` counts every SQE pushed whose CQE has not been popped by [`Ring::complete`].
//! * A fixed-buffer operation lies inside one registered piece of one region (checked on push;
//!   a violation panics, because it would let the kernel write outside the region).
//! * A ring is used only by the thread that created it (`SINGLE_ISSUER` and `DEFER_TASKRUN`
//!   require it), so `Ring` is neither `Send` nor `Sync`.

#[cfg(debug_assertions)]
use std::collections::HashMap;
use std::fmt;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use io_uring::{opcode, squeue, types};

use queues::Queues;

mod file_op;
mod queues;
mod setup;

pub(crate) use setup::setup_flag_supported;

use file_op::PathStore;
pub use file_op::{FileOp, StatxInfo, AT_FDCWD, RENAME_NOREPLACE, RESOLVE_CONFINED};

use crate::blocks::IoBuf;
use crate::eventfd::EventFd;
use crate::file::DeviceFile;
use crate::mem::Region;
use crate::{errno_of, Errno};

/// Largest registered buffer piece the kernel accepts (one iovec).
pub const MAX_PIECE_BYTES: usize = 1 << 30;
/// Largest number of registered buffer pieces the kernel accepts (`IORING_MAX_REG_BUFFERS`).
pub const MAX_BUFFERS: usize = 1 << 14;

/// `user_data` reserved by the ring for its cancel SQEs ([`Ring::push_cancel`], and the
/// cancel-everything one `Drop` pushes): their CQEs are consumed by [`Ring::complete`], so a
/// caller must not push anything else with it. (`u64::MAX` stays the caller's: kvtier's
/// backend tags its wake-up read with it.)
pub const CANCEL_USER_DATA: u64 = u64::MAX - 1;
/// `Drop` waits at most this long per round, then re-notifies eventfds...
const DRAIN_WAIT: Duration = Duration::from_millis(100);
/// ...for at most this many rounds before it gives up and leaks the memory (60 s).
const DRAIN_ROUNDS: u32 = 600;

/// How to build a [`Ring`].
#[derive(Clone, Debug)]
pub struct RingConfig {
    /// Submission queue entries (the completion queue gets twice as many).
    pub entries: u32,
    /// Ask for a kernel submission thread (costs a core while busy).
    pub sqpoll: bool,
    /// Idle time before the SQPOLL thread sleeps.
    pub sqpoll_idle_ms: u32,
    /// Ask for polled completions (needs a device with poll queues).
    pub iopoll: bool,
    /// 128-byte SQEs and 32-byte CQEs (`SQE128 | CQE32`), which NVMe passthrough commands
    /// need ([`Ring::push_nvme`]); ordinary operations work on such a ring too.
    pub big_entries: bool,
}

impl Default for RingConfig {
    fn default() -> Self {
        RingConfig {
            entries: 256,
            sqpoll: false,
            sqpoll_idle_ms: 1000,
            iopoll: false,
            big_entries: false,
        }
    }
}

/// The setup flags a [`Ring`] actually got from the kernel.
// One bool per kernel setup flag, mirroring the flags word: an enum would not be clearer.
#[allow(clippy::struct_excessive_bools)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RingFeatures {
    pub single_issuer: bool,
    pub defer_taskrun: bool,
    pub coop_taskrun: bool,
    pub sqpoll: bool,
    pub iopoll: bool,
}

impl fmt::Display for RingFeatures {
    /// `+`-separated flag names, e.g. `single_issuer+defer_taskrun+coop_taskrun`, or `none`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = [
            (self.single_issuer, "single_issuer"),
            (self.defer_taskrun, "defer_taskrun"),
            (self.coop_taskrun, "coop_taskrun"),
            (self.sqpoll, "sqpoll"),
            (self.iopoll, "iopoll"),
        ];
        let on: Vec<&str> = names.iter().filter(|(b, _)| *b).map(|(_, n)| *n).collect();
        if on.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&on.join("+"))
        }
    }
}

/// A byte range of a registered region. `region` indexes the Vec given to
/// [`Ring::register_buffers`]. A description only: the transfers that take one
/// ([`Ring::push_read_raw`] and the other `_raw` pushes) are `unsafe`, and their caller proves
/// that nothing else reaches the bytes meanwhile. The safe pushes take a transfer token
/// ([`IoBuf`](crate::blocks::IoBuf)) instead, which is the proof.
///
/// ```compile_fail,E0133
/// # use kvtier_sys::ring::{BufRef, Ring};
/// // A raw transfer is unsafe: safe code cannot aim the kernel at bytes it did not claim.
/// fn late_read(ring: &mut Ring, buf: BufRef) {
///     let _ = ring.push_read_raw(1, 0, 0, buf, 0);
/// }
/// ```
///
/// ```compile_fail,E0308
/// # use kvtier_sys::ring::{BufRef, Ring};
/// // The safe read takes a claim, not a description of bytes (the hole before claims).
/// fn late_read(ring: &mut Ring, buf: BufRef) {
///     let _ = ring.push_read(1, 0, 0, 0, buf, 0);
/// }
/// ```
#[derive(Clone, Copy, Debug)]
pub struct BufRef {
    pub region: u16,
    pub offset: usize,
    pub len: u32,
}

/// One reaped completion.
#[derive(Clone, Copy, Debug)]
pub struct Completion {
    pub user_data: u64,
    /// Bytes transferred, or `-errno`.
    pub result: i32,
}

/// The transfer tokens of a ring's operations in flight, by `user_data` (a transfer cut into
/// several commands shares one, so a `user_data` may hold several).
#[derive(Default)]
pub(crate) struct Claims {
    one: std::collections::HashMap<u64, IoBuf>,
    /// Further tokens under a `user_data` that `one` holds already.
    more: Vec<(u64, IoBuf)>,
}

impl Claims {
    pub(crate) fn with_capacity(n: usize) -> Claims {
        Claims {
            one: std::collections::HashMap::with_capacity(n),
            more: Vec::new(),
        }
    }

    pub(crate) fn keep(&mut self, user_data: u64, buf: IoBuf) {
        if let std::collections::hash_map::Entry::Vacant(v) = self.one.entry(user_data) {
            v.insert(buf);
        } else {
            self.more.push((user_data, buf));
        }
    }

    /// Drops one token of `user_data` (a completion of it was popped); none if it has none.
    pub(crate) fn release(&mut self, user_data: u64) {
        if self.one.remove(&user_data).is_none() {
            return;
        }
        if let Some(at) = self.more.iter().position(|(u, _)| *u == user_data) {
            let (_, next) = self.more.swap_remove(at);
            self.one.insert(user_data, next);
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.one.is_empty()
    }
}

/// The submission queue has no free entry; nothing was queued. Submit, then retry.
#[derive(Debug)]
pub struct SqFull;

impl fmt::Display for SqFull {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("io_uring submission queue is full; submit before pushing more")
    }
}

impl std::error::Error for SqFull {}

/// Why [`Ring::register_buffers`] failed; `message` names what failed and how to fix it.
#[derive(Debug)]
pub struct RegisterError {
    pub errno: Errno,
    pub message: String,
}

impl fmt::Display for RegisterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for RegisterError {}

/// Shift of the class in an I/O priority value (`IOPRIO_CLASS_SHIFT`).
pub const IOPRIO_CLASS_SHIFT: u16 = 13;

/// I/O scheduling class (`ioprio_set(2)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoprioClass {
    /// No priority: the submitting task's priority applies.
    None,
    /// Real time; needs `CAP_SYS_NICE` or `CAP_SYS_ADMIN`, else the CQE carries -EPERM.
    Rt,
    /// Best effort.
    Be,
    /// Only when the disk is otherwise idle.
    Idle,
}

/// Raw ioprio value for an SQE: `class << 13 | level`. `IoprioClass::None` gives 0 (the kernel
/// refuses a level without a class). Panics if `level > 7`.
pub fn ioprio(class: IoprioClass, level: u8) -> u16 {
    assert!(level < 8, "ioprio level {level} out of range 0..=7");
    let class = match class {
        IoprioClass::None => return 0,
        IoprioClass::Rt => 1,
        IoprioClass::Be => 2,
        IoprioClass::Idle => 3,
    };
    (class << IOPRIO_CLASS_SHIFT) | u16::from(level)
}

/// An `io_uring` instance with registered buffers and files. Use it only on the thread that
/// created it.
pub struct Ring {
    // Declared first so that the ring fd closes before the Arcs below are released.
    uring: Queues,
    features: RingFeatures,
    /// SQEs pushed whose CQE has not been popped.
    in_flight: usize,
    /// `io_uring_enter` calls made by [`Ring::submit`] and [`Ring::submit_wait_timeout`].
    enters: u64,
    /// Registered regions; `first_piece[i]` is the kernel buffer index of region i's first
    /// piece. Empty until `register_buffers`.
    regions: Vec<Arc<Region>>,
    first_piece: Vec<u16>,
    piece_bytes: usize,
    buffers_registered: bool,
    files: Vec<Arc<DeviceFile>>,
    files_registered: bool,
    /// Every eventfd a read was pushed for, kept open until Drop has drained.
    eventfds: Vec<Arc<EventFd>>,
    /// 8-byte target of eventfd reads, from `Box::into_raw`. The kernel writes it (possibly for
    /// several reads at once); Rust never reads it; freed in Drop after draining.
    sink: NonNull<u64>,
    /// SQEs pushed since the ring was built. The kernel consumes them in order, so the first
    /// `pushed - sq.len()` have been consumed.
    pushed: u64,
    /// Path copies of queued file operations.
    paths: PathStore,
    /// The transfer tokens of operations in flight, dropped as their completions are popped.
    claims: Claims,
    /// Debug builds: in-flight operations per `user_data`, to assert that `push_file_op` gets a
    /// unique one.
    #[cfg(debug_assertions)]
    live_user_data: HashMap<u64, u32>,
    /// `SINGLE_ISSUER/DEFER_TASKRUN` tie the ring to its creating thread.
    _not_send: PhantomData<*mut ()>,
}

impl fmt::Debug for Ring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ring")
            .field("features", &self.features)
            .field("in_flight", &self.in_flight)
            .field("regions", &self.regions.len())
            .field("files", &self.files.len())
            .field("paths", &self.paths.len())
            .finish_non_exhaustive()
    }
}

impl Ring {
    /// The setup flags the kernel accepted.
    pub fn features(&self) -> RingFeatures {
        self.features
    }

    /// `io_uring_enter` system calls made to submit or wait so far.
    pub fn enters(&self) -> u64 {
        self.enters
    }

    /// Queues a `READ_FIXED` from byte `offset` of registered file `file` into the bytes `buf`
    /// claims, in the region registered as `region`. The ring keeps `buf` until it pops the
    /// completion, so the claimed blocks stay leased, and out of reach of every Rust access,
    /// for as long as the kernel may write them. Panics if `buf` is not a claim to write (see
    /// [`crate::blocks::Lease::checkout`]), or is not in region `region`, and as
    /// [`Ring::push_read_raw`] on a bad buffer or file. `Err(SqFull)`: nothing queued, `buf`
    /// dropped.
    pub fn push_read(
        &mut self,
        user_data: u64,
        file: u32,
        offset: u64,
        region: u16,
        buf: IoBuf,
        ioprio: u16,
    ) -> Result<(), SqFull> {
        assert!(
            buf.device_writes(),
            "a read into bytes claimed only to be read"
        );
        let raw = self.claimed(region, &buf);
        // SAFETY: `buf` claims the bytes for a transfer that writes them: the region's blocks
        // are leased exclusively and the lease's own accessors refuse them while the claim
        // lives; the ring keeps the claim until the completion is popped.
        unsafe { self.push_read_raw(user_data, file, offset, raw, ioprio) }?;
        self.claims.keep(user_data, buf);
        Ok(())
    }

    /// Queues a `WRITE_FIXED` of the bytes `buf` claims (in the region registered as
    /// `region`) to byte `offset` of registered file `file`; the ring keeps `buf` until it
    /// pops the completion. Panics as [`Ring::push_read`] does (any claim serves).
    pub fn push_write(
        &mut self,
        user_data: u64,
        file: u32,
        offset: u64,
        region: u16,
        buf: IoBuf,
        ioprio: u16,
    ) -> Result<(), SqFull> {
        let raw = self.claimed(region, &buf);
        // SAFETY: `buf` claims the bytes for a transfer: nothing writes them while it lives
        // (leased blocks refuse the region's writers; the lease's writer waits for the claim),
        // and the ring keeps it until the completion is popped.
        unsafe { self.push_write_raw(user_data, file, offset, raw, ioprio) }?;
        self.claims.keep(user_data, buf);
        Ok(())
    }

    /// [`Ring::push_nvme_raw`] on the bytes `buf` claims (a claim to write for a read), in the
    /// region registered as `region`; the ring keeps `buf` until it pops the completion.
    #[allow(clippy::too_many_arguments)]
    pub fn push_nvme(
        &mut self,
        user_data: u64,
        file: u32,
        op: crate::nvme::Opcode,
        nsid: u32,
        slba: u64,
        lba_shift: u32,
        region: u16,
        buf: IoBuf,
    ) -> Result<(), SqFull> {
        assert!(
            op != crate::nvme::Opcode::Read || buf.device_writes(),
            "an NVMe read into bytes claimed only to be read"
        );
        let raw = self.claimed(region, &buf);
        // SAFETY: as in `push_read` / `push_write`, by `op`.
        unsafe { self.push_nvme_raw(user_data, file, op, nsid, slba, lba_shift, raw) }?;
        self.claims.keep(user_data, buf);
        Ok(())
    }

    /// The raw buffer of `buf`, after checking that region `region` is the claim's.
    pub(crate) fn claimed(&self, region: u16, buf: &IoBuf) -> BufRef {
        let Some(registered) = self.regions.get(usize::from(region)) else {
            panic!(
                "a claim names region {region} but {} regions are registered",
                self.regions.len()
            );
        };
        assert!(
            Arc::ptr_eq(registered, buf.region()),
            "a claim on another region than the one registered as {region}"
        );
        buf.buf_ref(region)
    }

    /// Queues a `READ_FIXED` of `buf.len` bytes at byte `offset` of registered file `file` into
    /// `buf`. `ioprio` is the raw SQE priority (see [`ioprio`]; 0 = none).
    ///
    /// Panics if `buf` is empty, outside its region, straddles a registered piece or names an
    /// unregistered region, or if `file` is not registered. `Err(SqFull)` if the SQ has no room
    /// (nothing queued).
    ///
    /// # Safety
    ///
    /// From this call until [`Ring::complete`] has returned the op's completion (or the ring
    /// is dropped), the kernel writes the bytes `buf` names, whatever else runs: nothing may
    /// read or write them meanwhile, neither through a Rust reference nor through the region's
    /// accessors or another transfer. [`Ring::push_read`] is this with the proof: a transfer
    /// token ([`IoBuf`](crate::blocks::IoBuf)) the ring keeps until then.
    pub unsafe fn push_read_raw(
        &mut self,
        user_data: u64,
        file: u32,
        offset: u64,
        buf: BufRef,
        ioprio: u16,
    ) -> Result<(), SqFull> {
        let (ptr, index) = self.fixed_buf(buf);
        let fd = self.fixed_file(file);
        let entry = opcode::ReadFixed::new(fd, ptr, buf.len, index)
            .offset(offset)
            .ioprio(ioprio)
            .build()
            .user_data(user_data);
        // SAFETY: the buffer lies inside one registered piece of a region this ring keeps alive
        // until Drop has drained every CQE (checked by fixed_buf); the file is registered; the
        // caller keeps every other access off the buffer until the completion (this fn's
        // contract).
        unsafe { self.push_entry(&entry) }
    }

    /// Queues a `WRITE_FIXED` of `buf` to byte `offset` of registered file `file`. Same rules
    /// as [`Ring::push_read_raw`].
    ///
    /// # Safety
    ///
    /// Until the op's completion is returned by [`Ring::complete`] (or the ring is dropped),
    /// the kernel reads the bytes `buf` names: nothing may write them meanwhile (a Rust
    /// `&mut`, the region's accessors, a transfer that writes them).
    pub unsafe fn push_write_raw(
        &mut self,
        user_data: u64,
        file: u32,
        offset: u64,
        buf: BufRef,
        ioprio: u16,
    ) -> Result<(), SqFull> {
        let (ptr, index) = self.fixed_buf(buf);
        let fd = self.fixed_file(file);
        let entry = opcode::WriteFixed::new(fd, ptr.cast_const(), buf.len, index)
            .offset(offset)
            .ioprio(ioprio)
            .build()
            .user_data(user_data);
        // SAFETY: the buffer lies inside one registered piece of a region this ring keeps alive
        // until Drop has drained every CQE (checked by fixed_buf); the file is registered; the
        // caller keeps every other access off the buffer until the completion (this fn's
        // contract).
        unsafe { self.push_entry(&entry) }
    }

    /// Queues an NVMe passthrough read or write (`URING_CMD` with `IORING_URING_CMD_FIXED`) on
    /// registered file `file`, an NVMe generic device with LBAs of `1 << lba_shift` bytes: the
    /// whole of the fixed buffer `buf` (a multiple of the LBA, at most
    /// [`crate::nvme::MAX_LBAS_PER_COMMAND`] LBAs) from LBA `slba` of namespace `nsid`. The
    /// block count is derived from `buf`, so the device never moves more than `buf` holds. The ring
    /// must have been built with [`RingConfig::big_entries`]. The completion's `result` is 0,
    /// `-errno`, or a positive NVMe status ([`crate::nvme::Outcome::from_result`]).
    // Every argument is one field of the NVMe command; a struct would only rename them.
    ///
    /// # Safety
    ///
    /// As [`Ring::push_read_raw`] for [`Opcode::Read`](crate::nvme::Opcode::Read) (the kernel
    /// writes `buf`), as [`Ring::push_write_raw`] for a write (it reads `buf`).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn push_nvme_raw(
        &mut self,
        user_data: u64,
        file: u32,
        op: crate::nvme::Opcode,
        nsid: u32,
        slba: u64,
        lba_shift: u32,
        buf: BufRef,
    ) -> Result<(), SqFull> {
        assert!(
            self.uring.is_big(),
            "push_nvme on a ring built without big_entries (128-byte SQEs)"
        );
        assert!(
            (9..=16).contains(&lba_shift) && buf.len.is_multiple_of(1 << lba_shift),
            "NVMe command of {} bytes with {}-byte LBAs",
            buf.len,
            1_u64 << lba_shift.min(63)
        );
        let lbas = buf.len >> lba_shift;
        let (ptr, index) = self.fixed_buf(buf);
        let fd = self.fixed_file(file);
        let cmd = crate::nvme::Command::io(op, nsid, slba, lbas, ptr as u64, buf.len);
        let entry = opcode::UringCmd80::new(fd, crate::nvme::URING_CMD_IO)
            .cmd(cmd.to_sqe_bytes())
            .buf_index(Some(index))
            .build()
            .user_data(user_data);
        // SAFETY: the command's data range is `buf`, which lies inside one registered piece of
        // a region this ring keeps alive until Drop has drained every CQE (checked by
        // fixed_buf), and the kernel maps it through that registered buffer (CMD_FIXED); the
        // 80-byte command itself is copied into the SQE; the file is registered; the caller
        // keeps every other access off the buffer until the completion (this fn's contract).
        unsafe { self.push_entry_big(&entry) }
    }

    /// Queues an 8-byte read of `efd` into a buffer the ring owns; its CQE (result 8) arrives
    /// with `user_data` once someone calls [`EventFd::notify`]. Used to wake a worker sleeping
    /// in [`Ring::submit`]. The ring keeps the eventfd open until it is dropped. (An IOPOLL ring
    /// cannot poll an eventfd: there the CQE carries an error instead of waiting.)
    pub fn push_eventfd_read(&mut self, user_data: u64, efd: &Arc<EventFd>) -> Result<(), SqFull> {
        let entry = opcode::Read::new(types::Fd(efd.raw_fd()), self.sink.as_ptr().cast(), 8)
            .build()
            .user_data(user_data);
        // SAFETY: the read writes 8 bytes into `sink`, which is only freed after Drop drained
        // every CQE; the eventfd's Arc is kept (below, before anything can be submitted) so the
        // fd number cannot be closed and reused while the read is queued.
        let res = unsafe { self.push_entry(&entry) };
        if res.is_ok() && !self.eventfds.iter().any(|e| Arc::ptr_eq(e, efd)) {
            self.eventfds.push(Arc::clone(efd));
        }
        res
    }

    /// Queues `IORING_OP_ASYNC_CANCEL` of every operation pushed with `target` as its
    /// `user_data` (an op past its deadline). What can be cancelled (work blocked in io_uring's
    /// kernel workers: a file operation waiting on a hung file system) completes soon with
    /// `-ECANCELED` or `-EINTR`; I/O already on a device cannot be and completes as it would
    /// have. Either way the target's own CQE still arrives and is the one that ends it; the
    /// cancel's own completion is consumed here, never returned by [`Ring::complete`].
    pub fn push_cancel(&mut self, target: u64) -> Result<(), SqFull> {
        debug_assert_ne!(target, CANCEL_USER_DATA);
        let entry = opcode::AsyncCancel::new(target)
            .build()
            .user_data(CANCEL_USER_DATA);
        // SAFETY: a cancel SQE references no memory.
        unsafe { self.push_entry(&entry) }
    }

    /// Submits all queued SQEs and waits until at least `min(wait_nr, in_flight())`
    /// completions are available (0 = don't wait). EINTR is retried; EBUSY/EAGAIN (completion
    /// queue full) returns `Ok(0)` so that the caller reaps. Returns the number submitted.
    pub fn submit(&mut self, wait_nr: usize) -> Result<usize, Errno> {
        // Waiting for more completions than can ever arrive would sleep forever.
        let want = wait_nr.min(self.in_flight);
        loop {
            self.enters += 1;
            match self.uring.submit_and_wait(want) {
                Ok(n) => return Ok(n),
                Err(e) => match errno_of(&e) {
                    Errno::EINTR => {}
                    Errno::EBUSY | Errno::EAGAIN => return Ok(0),
                    errno => return Err(errno),
                },
            }
        }
    }

    /// [`Ring::submit`], but waits at most `timeout` for the completions (`Ok(0)` then).
    /// Needs `IORING_FEAT_EXT_ARG` (Linux 5.11); without it, waits without a bound.
    pub fn submit_wait_timeout(
        &mut self,
        wait_nr: usize,
        timeout: std::time::Duration,
    ) -> Result<usize, Errno> {
        if !self.uring.params().is_feature_ext_arg() {
            return self.submit(wait_nr);
        }
        let want = wait_nr.min(self.in_flight);
        let ts = types::Timespec::new()
            .sec(timeout.as_secs())
            .nsec(timeout.subsec_nanos());
        let args = types::SubmitArgs::new().timespec(&ts);
        loop {
            self.enters += 1;
            match self.uring.submit_with_args(want, &args) {
                Ok(n) => return Ok(n),
                Err(e) => match errno_of(&e) {
                    Errno::EINTR => {}
                    Errno::ETIME | Errno::EBUSY | Errno::EAGAIN => return Ok(0),
                    errno => return Err(errno),
                },
            }
        }
    }

    /// Pops every available completion into `out`.
    pub fn complete(&mut self, out: &mut Vec<Completion>) {
        let before = out.len();
        self.uring.drain_completions(out);
        let reaped = out.len() - before;
        assert!(
            reaped <= self.in_flight,
            "io_uring returned {reaped} completions with only {} operations in flight",
            self.in_flight
        );
        self.in_flight -= reaped;
        #[cfg(debug_assertions)]
        for c in &out[before..] {
            if let Some(n) = self.live_user_data.get_mut(&c.user_data) {
                *n -= 1;
                if *n == 0 {
                    self.live_user_data.remove(&c.user_data);
                }
            }
        }
        if !self.claims.is_empty() {
            // The kernel is done with these bytes: their blocks may go back (and a result that
            // waited for them be delivered) before the caller even sees the completions.
            for c in &out[before..] {
                self.claims.release(c.user_data);
            }
        }
        if !self.paths.is_empty() {
            for c in &out[before..] {
                self.paths.retire(c.user_data);
            }
            let consumed = self.pushed - self.uring.sq_len_capacity().0 as u64;
            self.paths.release(consumed);
        }
        if out[before..]
            .iter()
            .any(|c| c.user_data == CANCEL_USER_DATA)
        {
            // A cancel's own answer: the cancelled op's CQE is what its owner waits for. (What
            // `out` held before this call never carries it: it came from here.)
            out.retain(|c| c.user_data != CANCEL_USER_DATA);
        }
    }

    /// Bounds io_uring's kernel worker threads of this ring that run *bounded* work (reads and
    /// writes of regular files the kernel could not issue without blocking, such as writes that
    /// extend a file) to `bounded` at once; the unbounded ones (opens, renames, xattrs) keep
    /// their limit. Returns the previous bound. Linux 5.15 or later.
    pub fn set_io_wq_bounded(&mut self, bounded: u32) -> Result<u32, Errno> {
        let mut limits = [bounded, 0];
        self.uring
            .submitter()
            .register_iowq_max_workers(&mut limits)
            .map_err(|e| errno_of(&e))?;
        Ok(limits[0])
    }

    /// Operations pushed (queued or submitted) whose completion has not been popped.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Free entries in the submission queue.
    pub fn sq_space_left(&self) -> usize {
        let (len, capacity) = self.uring.sq_len_capacity();
        capacity - len
    }

    /// The kernel's opcode support table (`IORING_REGISTER_PROBE`, 5.6+).
    pub(crate) fn probe_opcodes(&self) -> Result<io_uring::Probe, Errno> {
        let mut probe = io_uring::Probe::new();
        self.uring.register_probe(&mut probe)?;
        Ok(probe)
    }

    /// Pushes one SQE and counts it in flight.
    ///
    /// # Safety
    ///
    /// Every address in `entry` must stay valid (and the fd open) until its CQE is popped;
    /// this ring guarantees that for memory it keeps until Drop has drained.
    unsafe fn push_entry(&mut self, entry: &squeue::Entry) -> Result<(), SqFull> {
        // SAFETY: the caller guarantees the entry's memory outlives the operation.
        unsafe { self.uring.push(entry) }.map_err(|()| SqFull)?;
        self.count_pushed(entry.get_user_data());
        Ok(())
    }

    /// [`Ring::push_entry`] for a 128-byte entry (a ring built with `big_entries`).
    ///
    /// # Safety
    ///
    /// As for `push_entry`.
    unsafe fn push_entry_big(&mut self, entry: &squeue::Entry128) -> Result<(), SqFull> {
        // SAFETY: the caller guarantees the entry's memory outlives the operation.
        unsafe { self.uring.push_big(entry) }.map_err(|()| SqFull)?;
        self.count_pushed(entry.get_user_data());
        Ok(())
    }

    /// Bookkeeping of one pushed SQE.
    fn count_pushed(&mut self, user_data: u64) {
        self.in_flight += 1;
        self.pushed += 1;
        #[cfg(debug_assertions)]
        {
            *self.live_user_data.entry(user_data).or_insert(0) += 1;
        }
        #[cfg(not(debug_assertions))]
        let _ = user_data;
    }

    /// Entries of the completion queue.
    pub fn completion_capacity(&self) -> usize {
        self.uring.params().cq_entries() as usize
    }

    /// Whether the ring has 128-byte SQEs (and can take [`Ring::push_nvme`]).
    pub fn big_entries(&self) -> bool {
        self.uring.is_big()
    }

    /// Address and kernel buffer index of `buf`, after the bounds checks that keep the kernel
    /// inside the registered memory.
    fn fixed_buf(&self, buf: BufRef) -> (*mut u8, u16) {
        let Some(region) = self.regions.get(usize::from(buf.region)) else {
            panic!(
                "BufRef names region {} but {} regions are registered",
                buf.region,
                self.regions.len()
            );
        };
        assert!(buf.len > 0, "zero-length I/O on {buf:?}");
        let len = buf.len as usize;
        let ptr = region.range_ptr(buf.offset, len);
        let piece = buf.offset / self.piece_bytes;
        let last = (buf.offset + len - 1) / self.piece_bytes;
        assert!(
            piece == last,
            "BufRef {buf:?} straddles registered pieces of {} bytes",
            self.piece_bytes
        );
        // Cannot overflow: register_buffers checked the total piece count fits.
        let index = self.first_piece[usize::from(buf.region)] + piece as u16;
        (ptr, index)
    }

    fn fixed_file(&self, file: u32) -> types::Fixed {
        assert!(
            (file as usize) < self.files.len(),
            "file index {file} but {} files are registered",
            self.files.len()
        );
        types::Fixed(file)
    }

    /// Waits for at least one completion or `timeout`; Ok on completion or timeout.
    fn wait_one(&mut self, timeout: Duration) -> Result<(), Errno> {
        let res = if self.uring.params().is_feature_ext_arg() {
            let ts = types::Timespec::from(timeout);
            let args = types::SubmitArgs::new().timespec(&ts);
            self.uring.submit_with_args(1, &args)
        } else {
            self.uring.submit_and_wait(1)
        };
        match res.map_err(|e| errno_of(&e)) {
            Ok(_) | Err(Errno::ETIME | Errno::EINTR | Errno::EBUSY | Errno::EAGAIN) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Waits until every operation in flight has completed. Returns false if that could not be
    /// established (the kernel may still use the memory).
    fn drain(&mut self) -> bool {
        if self.in_flight == 0 {
            return true;
        }
        let start = Instant::now();
        let initial = self.in_flight;
        tracing::warn!(
            in_flight = initial,
            "io_uring ring dropped with I/O in flight; cancelling and waiting before releasing \
             its memory"
        );
        // Cancel everything cancellable: a pending eventfd read would otherwise never finish.
        // Disk I/O already issued is not cancellable and completes normally. CANCEL_ANY needs
        // 5.19; older kernels answer -EINVAL and the eventfd notify below does the job.
        let cancel = opcode::AsyncCancel2::new(types::CancelBuilder::any())
            .build()
            .user_data(CANCEL_USER_DATA);
        if self.sq_space_left() == 0 {
            let _ = self.submit(0);
        }
        // SAFETY: a cancel SQE references no memory.
        let _ = unsafe { self.push_entry(&cancel) };
        let mut scratch = Vec::new();
        for round in 0..DRAIN_ROUNDS {
            if let Err(errno) = self.wait_one(DRAIN_WAIT) {
                tracing::error!(%errno, in_flight = self.in_flight, "io_uring drain failed");
                return false;
            }
            scratch.clear();
            self.complete(&mut scratch);
            if self.in_flight == 0 {
                tracing::warn!(
                    waited_ms = start.elapsed().as_millis() as u64,
                    drained = initial,
                    "io_uring ring drained"
                );
                return true;
            }
            if round % 10 == 0 {
                for efd in &self.eventfds {
                    efd.notify();
                }
            }
        }
        tracing::error!(in_flight = self.in_flight, "io_uring drain timed out");
        false
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        if !self.drain() {
            // The kernel may still write into the regions or the sink: leak them (they stay
            // mapped) rather than free memory under it. Closing the ring fd makes the kernel
            // cancel and release its own references once the operations end.
            tracing::error!(
                regions = self.regions.len(),
                "leaking io_uring buffers: operations may still be in flight"
            );
            for region in self.regions.drain(..) {
                std::mem::forget(region);
            }
            std::mem::forget(std::mem::take(&mut self.paths));
            // Their blocks stay leased for good: the kernel may still write them.
            std::mem::forget(std::mem::take(&mut self.claims));
            return;
        }
        let submitter = self.uring.submitter();
        if self.buffers_registered {
            // Must happen before the regions are unmapped, or pinned (huge) pages leak.
            if let Err(e) = submitter.unregister_buffers() {
                tracing::error!(errno = %errno_of(&e), "io_uring unregister_buffers failed");
            }
        }
        if self.files_registered {
            if let Err(e) = submitter.unregister_files() {
                tracing::error!(errno = %errno_of(&e), "io_uring unregister_files failed");
            }
        }
        // SAFETY: `sink` came from Box::leak in `with`, is freed only here, and no operation
        // that writes it is in flight any more (drain succeeded).
        drop(unsafe { Box::from_raw(self.sink.as_ptr()) });
        // The path copies go with the fields, after this: nothing in flight reads them any more.
    }
}
