//! The I/O boundary: what a worker asks of its device queue, at the submit/complete level.
//!
//! Workers run the same scheduler and slab code over any [`IoBackend`]: the io_uring one in
//! production ([`crate::uring`]) and a seeded, fault-injecting simulation in tests
//! (`crate::sim`, feature `sim`). A [`Storage`] opens devices and builds one backend per worker.
//!
//! Invariant every backend keeps: the memory a request's claim ([`IoBuf`]) names may be accessed
//! by the device from `push` until that request's completion is returned by `complete`, and
//! not after; the backend keeps the claim over exactly that interval (the ring drops it as it
//! pops the completion), so the blocks stay leased, and out of every other access, that long.

use std::sync::Arc;

pub use kvtier_sys::blocks::IoBuf;
pub use kvtier_sys::eventfd::EventFd;
pub use kvtier_sys::mem::Region;
pub use kvtier_sys::ring::{BufRef, Completion, FileOp};

use crate::config::{DeviceConfig, DirectIo};
use crate::error::Result;

/// Read from the device into the buffer, or write the buffer to the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoKind {
    Read,
    Write,
}

/// Who the I/O is for; backends map it to an I/O priority.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoClass {
    Load,
    Store,
    Meta,
}

/// One device I/O. `region` indexes the buffers the backend was built with: 0 is the primary
/// region, 1 the worker's metadata buffer, 2 its staging buffer.
#[derive(Debug)]
pub struct IoRequest {
    pub user_data: u64,
    pub kind: IoKind,
    pub device: u16,
    pub offset: u64,
    pub region: u16,
    /// The claim on the bytes moved (a claim to write them for a read), which the backend
    /// keeps until it returns the completion.
    pub buf: IoBuf,
    pub class: IoClass,
}

impl IoRequest {
    /// Bytes moved (a claim is never empty).
    pub fn bytes(&self) -> u32 {
        u32::try_from(self.buf.len()).expect("one transfer moves less than 4 GiB")
    }
}

/// Reads and writes of byte ranges of a device (a file, a block device, an NVMe namespace by
/// passthrough or VFIO): what the slab layout asks of a backend.
pub trait BlockQueue {
    /// Queues one request; `false` if the submission queue is full (nothing queued; the
    /// request, its claim with it, is dropped).
    fn push(&mut self, req: IoRequest) -> bool;
}

/// File-system operations: what the `files` layout asks of a backend.
pub trait FileOpQueue {
    /// Queues a file-system operation; `FileOp::ReadFd` and `FileOp::WriteFd` come with the
    /// claim on their buffer (`buf`, in buffer `region`), kept as [`BlockQueue::push`] keeps a
    /// request's. `false` if the queue is full.
    fn push_file(
        &mut self,
        user_data: u64,
        op: &FileOp<'_>,
        buf: Option<(u16, IoBuf)>,
        class: IoClass,
    ) -> bool;
    /// Whether [`FileOp::SetXattr`] and [`FileOp::GetXattr`] run on this queue (else the
    /// files layout makes those two calls itself).
    fn xattr_ops(&self) -> bool {
        false
    }
    /// The value buffer of a completed [`FileOp::GetXattr`] pushed with `user_data`.
    fn take_file_value(&mut self, user_data: u64) -> Option<Box<[u8]>> {
        let _ = user_data;
        None
    }
}

/// A worker's queue to its devices: a block queue, a file-op queue or both (chosen by the
/// storage from the device config), and what every queue shares: submitting, the worker's
/// sleep, completions, cancellation and the fence.
pub trait IoBackend {
    /// The block queue (the slab layout's); `None` for a backend of file operations only.
    fn blocks(&mut self) -> Option<&mut dyn BlockQueue>;
    /// The file-op queue (the files layout's); `None` for a backend of block I/O only (VFIO,
    /// the simulated slab device). [`Storage::supports_files`] says which a storage builds.
    fn files(&mut self) -> Option<&mut dyn FileOpQueue> {
        None
    }
    /// Asks the device to cancel the request pushed with `user_data` (past its deadline); false
    /// if it cannot be asked (no room, or a backend without cancellation). Best effort: the
    /// request's own completion still arrives, sooner if it could be cancelled, and is the one
    /// that ends it (the memory it names stays the device's until then).
    fn cancel(&mut self, user_data: u64) -> bool {
        let _ = user_data;
        false
    }
    /// Stops the device from touching memory for good (a controller driven from user space:
    /// disabled, bus mastering off), so that requests in flight past their deadline complete as
    /// failed and their memory can be handed back; false where the backend cannot (the kernel
    /// owns the device: the worker then leaks its memory instead).
    fn fence(&mut self) -> bool {
        false
    }
    /// Hands queued requests to the device. With `wait`, blocks until at least one completion
    /// is available or the worker's wake-up event fires.
    fn submit(&mut self, wait: bool) -> std::io::Result<()>;
    /// Calls into the device so far (`io_uring_enter` system calls; a simulated backend's
    /// submits): `kvtier_worker_submits_total`. A submit with nothing to hand over and no wait
    /// may make none.
    fn enters(&self) -> u64;
    /// Times the worker really slept in [`IoBackend::submit`] so far, for a backend whose
    /// waits are not all sleeps (a polled one spins while I/O is in flight); `None`: every
    /// wait is one.
    fn sleeps(&self) -> Option<u64> {
        None
    }
    /// For the simulator's stepped workers, which never block: whether the wait of a
    /// `submit(true)` would have returned by now (a completion ready, the wake-up eventfd
    /// written); the backend moves its own time to the completion as a wait would. Backends
    /// of real devices never run stepped.
    #[cfg(any(test, feature = "sim"))]
    fn sim_wake(&mut self) -> bool {
        true
    }
    /// Appends every available completion to `out`.
    fn complete(&mut self, out: &mut Vec<Completion>);
    /// Requests pushed whose completion has not yet been returned.
    fn in_flight(&self) -> usize;
    /// A one-line description for logs and `Engine::info` (ring flags, or "sim").
    fn describe(&self) -> String;
}

impl dyn IoBackend {
    /// The block queue; panics on a backend without one (the engine gives slab devices only
    /// to storages whose backends have one).
    pub fn block_queue(&mut self) -> &mut dyn BlockQueue {
        self.blocks()
            .expect("the slab layout runs on a backend with a block queue")
    }

    /// The file-op queue; panics on a backend without one (the engine checks
    /// [`Storage::supports_files`] before it opens a files device).
    pub fn file_queue(&mut self) -> &mut dyn FileOpQueue {
        self.files()
            .expect("the files layout runs on a backend with file operations (supports_files)")
    }
}

/// What the engine learns about a device when it opens it.
#[derive(Clone, Debug)]
pub struct OpenedDevice {
    pub path: std::path::PathBuf,
    /// Usable bytes, from offset 0.
    pub size_bytes: u64,
    /// O_DIRECT offset and length alignment (4096 for buffered I/O).
    pub align_bytes: u64,
    /// Whether I/O bypasses the page cache.
    pub direct: bool,
    /// True if the device was created or grown just now (it holds no store yet).
    pub fresh: bool,
    /// "file", "block device" or "sim".
    pub kind: &'static str,
}

/// Settings a backend needs, derived from the config.
#[derive(Clone, Debug)]
pub struct BackendSettings {
    pub ring_entries: u32,
    pub sqpoll: bool,
    pub sqpoll_idle_ms: u32,
    pub iopoll: bool,
    pub ioprio: bool,
    /// Largest registered piece of a buffer; a multiple of the block size, at most 1 GiB.
    pub piece_bytes: usize,
    /// Set when the devices use the `files` layout (file operations on the ring): the bound on
    /// io_uring's kernel workers per ring (`[files] io_wq_workers`).
    pub files_io_wq_workers: Option<u32>,
    /// The longest a backend sleeps waiting for completions while I/O is in flight, so the
    /// worker notices I/O past its deadline.
    pub wait_limit: std::time::Duration,
}

/// Opens devices and builds backends; shared by all workers.
pub trait Storage: Send + Sync {
    /// Opens (creating and preparing if needed) device `index`.
    fn open_device(
        &self,
        index: usize,
        cfg: &DeviceConfig,
        direct: DirectIo,
    ) -> Result<OpenedDevice>;
    /// Whether backends of this storage can run the `files` layout's file operations.
    fn supports_files(&self) -> bool {
        false
    }
    /// Synchronous read, used only while opening (headers, formatting).
    fn read_sync(
        &self,
        device: usize,
        offset: u64,
        buf: &Region,
        buf_offset: usize,
        len: usize,
    ) -> Result<()>;
    /// Synchronous write, used only while opening (headers, formatting).
    fn write_sync(
        &self,
        device: usize,
        offset: u64,
        buf: &Region,
        buf_offset: usize,
        len: usize,
    ) -> Result<()>;
    /// Called once every worker has stopped, before `Engine::shutdown` returns: a storage
    /// whose devices do DMA on their own fences them here, so the caller may free the region.
    fn shutdown(&self) {}
    /// Builds worker `worker`'s backend. Called on the worker's own thread.
    fn backend(
        &self,
        worker: usize,
        buffers: Vec<Arc<Region>>,
        wake: Arc<EventFd>,
        settings: &BackendSettings,
    ) -> Result<Box<dyn IoBackend>>;
}

/// The outcome of an I/O that should have moved `wanted` bytes: a negative result is an errno,
/// a shorter one a short transfer.
pub(crate) fn io_outcome(
    result: i32,
    wanted: u64,
) -> std::result::Result<(), crate::job::KeyFailure> {
    if result < 0 {
        Err(crate::job::KeyFailure::Io(crate::Errno::from_raw(-result)))
    } else if (result as u64) < wanted {
        Err(crate::job::KeyFailure::ShortIo {
            done: result as u32,
            wanted: wanted as u32,
        })
    } else {
        Ok(())
    }
}
