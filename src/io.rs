//! The I/O boundary: what a worker asks of its device queue, at the submit/complete level.
//!
//! Workers run the same scheduler and slab code over any [`IoBackend`]: the io_uring one in
//! production ([`crate::uring`]) and a seeded, fault-injecting simulation in tests
//! (`crate::sim`, feature `sim`). A [`Storage`] opens devices and builds one backend per worker.
//!
//! Invariant every backend keeps: the memory named by a request's [`BufRef`] may be accessed by
//! the device from `push` until that request's completion is returned by `complete`, and not
//! after. The worker keeps the block pinned over exactly that interval.

use std::sync::Arc;

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

/// One device I/O. `buf.region` indexes the buffers the backend was built with: 0 is the
/// primary region, 1 the worker's metadata buffer.
#[derive(Clone, Copy, Debug)]
pub struct IoRequest {
    pub user_data: u64,
    pub kind: IoKind,
    pub device: u16,
    pub offset: u64,
    pub buf: BufRef,
    pub class: IoClass,
}

/// A worker's queue to its devices.
pub trait IoBackend {
    /// Queues one request; `false` if the submission queue is full (nothing queued).
    fn push(&mut self, req: &IoRequest) -> bool;
    /// Queues a file-system operation (the `files` layout). Backends that cannot do them are
    /// never given a `files` device (see [`Storage::supports_files`]).
    fn push_file(&mut self, user_data: u64, op: &FileOp<'_>, class: IoClass) -> bool {
        let _ = (user_data, op, class);
        unreachable!("this backend has no file operations; the engine checks supports_files")
    }
    /// Whether [`FileOp::SetXattr`] and [`FileOp::GetXattr`] run on this backend (else the
    /// files layout makes those two calls itself).
    fn xattr_ops(&self) -> bool {
        false
    }
    /// The value buffer of a completed [`FileOp::GetXattr`] pushed with `user_data`.
    fn take_file_value(&mut self, user_data: u64) -> Option<Box<[u8]>> {
        let _ = user_data;
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
    /// Hands queued requests to the device. With `wait`, blocks until at least one completion
    /// is available or the worker's wake-up event fires.
    fn submit(&mut self, wait: bool) -> std::io::Result<()>;
    /// Appends every available completion to `out`.
    fn complete(&mut self, out: &mut Vec<Completion>);
    /// Requests pushed whose completion has not yet been returned.
    fn in_flight(&self) -> usize;
    /// A one-line description for logs and `Engine::info` (ring flags, or "sim").
    fn describe(&self) -> String;
}

/// What the engine learns about a device when it opens it.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
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

/// How the engine sets up the region's blocks ([`Storage::region_guard`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegionGuard {
    /// [`Region::guard_blocks`]: leases, and accessors that refuse leased blocks.
    Enforce,
    /// [`Region::track_blocks`]: leases only. For a simulated device, which plays the kernel
    /// by copying through the accessors itself (and checks that a job holds the blocks).
    Track,
}

/// Opens devices and builds backends; shared by all workers.
pub trait Storage: Send + Sync {
    /// Opens (creating and preparing if needed) device `index`.
    fn open_device(&self, index: usize, cfg: &DeviceConfig, direct: DirectIo)
        -> Result<DeviceInfo>;
    /// Whether backends of this storage can run the `files` layout's file operations.
    fn supports_files(&self) -> bool {
        false
    }
    /// How the engine guards the region's blocks: jobs lease their blocks, and with
    /// [`RegionGuard::Enforce`] the region's safe accessors also refuse leased ones.
    fn region_guard(&self) -> RegionGuard {
        RegionGuard::Enforce
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
    /// Builds worker `worker`'s backend. Called on the worker's own thread.
    fn backend(
        &self,
        worker: usize,
        buffers: Vec<Arc<Region>>,
        wake: Arc<EventFd>,
        settings: &BackendSettings,
    ) -> Result<Box<dyn IoBackend>>;
}
