//! The production I/O: real files and block devices, one io_uring per worker with the region
//! and the worker's table buffer registered as fixed buffers and every device as a registered
//! file.
//!
//! Device preparation lives here too: a file that does not exist is created, fallocated and
//! written once end to end, because reads of fallocated-but-unwritten extents return zeros
//! without touching the disk (they would fake every benchmark) and O_DIRECT writes into
//! unwritten extents are several times slower than overwrites.

use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::sync::{Arc, RwLock};

use kvtier_sys::file::{DeviceFile, FileKind, OpenOptions};
use kvtier_sys::nvme::Namespace;
use kvtier_sys::ring::{ioprio, IoprioClass, RingConfig};

use crate::config::{DeviceConfig, DirectIo};
use crate::error::{Error, Result};
use crate::io::{BackendSettings, EventFd, IoBackend, OpenedDevice, Region, Storage};
use crate::Errno;

/// Bytes written per call while pre-writing a new file.
const PREWRITE_CHUNK_BYTES: usize = 8 << 20;

mod backend;
mod nvme;

use backend::{build_ring, iopoll_reads_work, UringBackend};

/// An open device: a file or block device, or an NVMe namespace driven by passthrough.
#[derive(Clone)]
struct Opened {
    file: Arc<DeviceFile>,
    nvme: Option<Arc<Namespace>>,
}

/// Devices opened through the kernel.
#[derive(Default)]
pub struct KernelStorage {
    devices: RwLock<Vec<Option<Opened>>>,
}

impl KernelStorage {
    fn device(&self, index: usize) -> Result<Opened> {
        self.devices
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(index)
            .and_then(Clone::clone)
            .ok_or_else(|| Error::Worker(format!("device {index} is not open")))
    }

    fn keep(&self, index: usize, opened: Opened) {
        let mut devices = self
            .devices
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if devices.len() <= index {
            devices.resize(index + 1, None);
        }
        devices[index] = Some(opened);
    }

    /// `read_sync`/`write_sync`: by passthrough commands on an NVMe namespace, else `pread` /
    /// `pwrite` loops.
    fn transfer_sync(
        &self,
        write: bool,
        device: usize,
        offset: u64,
        buf: &Region,
        buf_offset: usize,
        len: usize,
    ) -> Result<()> {
        let d = self.device(device)?;
        if let Some(ns) = &d.nvme {
            let done = if write {
                ns.write_sync(offset, buf, buf_offset, len)
            } else {
                ns.read_sync(offset, buf, buf_offset, len)
            };
            return done.map_err(|e| Error::device(ns.path(), e.to_string()));
        }
        let done = if write {
            d.file.write_all_at(offset, buf, buf_offset, len)
        } else {
            d.file.read_exact_at(offset, buf, buf_offset, len)
        };
        done.map_err(|e| {
            let what = if write { "write" } else { "read" };
            Error::device(
                d.file.path(),
                errno_msg(&format!("{what} {len} bytes at {offset}"), e),
            )
        })
    }

    /// Opens an NVMe namespace for passthrough: the slab occupies its LBAs from 0 (up to
    /// `capacity_bytes` if set).
    fn open_passthrough(
        &self,
        index: usize,
        cfg: &DeviceConfig,
        ns: Arc<Namespace>,
    ) -> OpenedDevice {
        let g = ns.geometry().clone();
        let mut size = g.size_bytes();
        if let Some(cap) = cfg.capacity_bytes {
            size = size.min(cap);
        }
        tracing::info!(
            device = %cfg.path.display(),
            nsid = g.nsid,
            lba_bytes = g.lba_bytes(),
            lbas = g.lbas,
            max_transfer_bytes = g.max_transfer_bytes,
            poll_queues = g.poll_queues,
            geometry = g.source,
            "NVMe passthrough device"
        );
        self.keep(
            index,
            Opened {
                file: Arc::clone(ns.file()),
                nvme: Some(ns),
            },
        );
        OpenedDevice {
            path: cfg.path.clone(),
            size_bytes: size,
            align_bytes: u64::from(g.lba_bytes()).max(512),
            direct: true,
            fresh: false,
            kind: "nvme passthrough",
        }
    }

    /// Opens a file or block device at `path` for the block layer (O_DIRECT), creating and
    /// pre-writing a missing or short slab file.
    #[allow(clippy::too_many_lines)] // file and block device checks, each with its own message
    fn open_kernel(
        &self,
        index: usize,
        path: &Path,
        cfg: &DeviceConfig,
        direct: DirectIo,
    ) -> Result<OpenedDevice> {
        let meta = std::fs::metadata(path);
        let mut fresh = false;
        let file = match meta {
            Ok(m) if m.file_type().is_block_device() => open_file(path, false, direct)?,
            Ok(m) if m.is_file() => {
                let f = open_file(path, false, direct)?;
                let size = m.len();
                if let Some(cap) = cfg.capacity_bytes {
                    if cap > size {
                        tracing::info!(path = %path.display(), from = size, to = cap, "growing device file and pre-writing the new part");
                        if let Err(e) = f.fallocate(cap) {
                            if e != Errno::EOPNOTSUPP {
                                return Err(Error::device(
                                    path,
                                    errno_msg(&format!("fallocate {cap} bytes"), e),
                                ));
                            }
                        }
                        prewrite(&f, size, cap)?;
                        fresh = true;
                    }
                }
                f
            }
            Ok(_) => {
                return Err(Error::device(path, "not a regular file or a block device"));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let Some(cap) = cfg.capacity_bytes else {
                    return Err(Error::device(
                        path,
                        format!("does not exist; set devices[{index}].capacity_bytes to create it"),
                    ));
                };
                if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                    // Missing parents are owner-only, like the slab file (0600) itself.
                    std::os::unix::fs::DirBuilderExt::mode(
                        std::fs::DirBuilder::new().recursive(true),
                        0o700,
                    )
                    .create(parent)
                    .map_err(|e| {
                        Error::device(path, format!("creating {}: {e}", parent.display()))
                    })?;
                }
                let f = open_file(path, true, direct)?;
                tracing::info!(path = %path.display(), bytes = cap, "creating device file: fallocate, then one pre-write pass");
                match f.fallocate(cap) {
                    Ok(()) => {}
                    Err(Errno::EOPNOTSUPP) => {
                        f.set_len(cap)
                            .map_err(|e| Error::device(path, errno_msg("set_len", e)))?;
                    }
                    Err(e) => {
                        let _ = std::fs::remove_file(path);
                        return Err(Error::device(
                            path,
                            errno_msg(&format!("fallocate {cap} bytes"), e),
                        ));
                    }
                }
                if let Err(e) = prewrite(&f, 0, cap) {
                    let _ = std::fs::remove_file(path);
                    return Err(e);
                }
                fresh = true;
                f
            }
            Err(e) => return Err(Error::device(path, format!("stat: {e}"))),
        };
        let mut size = file
            .size_bytes()
            .map_err(|e| Error::device(path, errno_msg("size", e)))?;
        if file.kind() == FileKind::BlockDevice {
            if let Some(cap) = cfg.capacity_bytes {
                size = size.min(cap);
            }
        }
        let align = if file.is_direct() {
            match file.dio_alignment() {
                Some(a) => u64::from(a.offset_align.max(a.mem_align)).max(512),
                None => u64::from(file.logical_block_bytes().unwrap_or(512)).max(512),
            }
        } else {
            512
        };
        let direct_ok = file.is_direct();
        let kind = match file.kind() {
            FileKind::BlockDevice => "block device",
            FileKind::Regular => "file",
            FileKind::NvmeGeneric => unreachable!("NVMe generic devices open as passthrough"),
        };
        self.keep(
            index,
            Opened {
                file: Arc::new(file),
                nvme: None,
            },
        );
        Ok(OpenedDevice {
            path: path.to_path_buf(),
            size_bytes: size,
            align_bytes: align,
            direct: direct_ok,
            fresh,
            kind,
        })
    }
}

fn errno_msg(what: &str, e: Errno) -> String {
    format!("{what}: {} ({e})", e.desc())
}

fn open_file(path: &Path, create: bool, direct: DirectIo) -> Result<DeviceFile> {
    let want_direct = direct != DirectIo::Off;
    let opts = OpenOptions {
        create,
        direct: want_direct,
        read_only: false,
    };
    match DeviceFile::open(path, opts) {
        Ok(f) => Ok(f),
        Err(Errno::EINVAL) if want_direct && direct == DirectIo::Auto => {
            tracing::warn!(
                path = %path.display(),
                "the filesystem refuses O_DIRECT: falling back to buffered I/O (direct_io = \"auto\"); \
                 loads and stores now go through the page cache"
            );
            DeviceFile::open(path, OpenOptions { create, direct: false, read_only: false })
                .map_err(|e| Error::device(path, errno_msg("open", e)))
        }
        Err(Errno::EINVAL) if want_direct => Err(Error::device(
            path,
            "the filesystem refuses O_DIRECT (ramfs, some FUSE and network filesystems do); \
             set direct_io = \"auto\" to fall back to buffered I/O, or use a path on ext4/xfs/a block device",
        )),
        Err(e) => Err(Error::device(path, errno_msg("open", e))),
    }
}

/// Writes zeros over `[from, to)` so that later reads hit real, written extents.
fn prewrite(file: &DeviceFile, from: u64, to: u64) -> Result<()> {
    let zeros = Region::allocate(PREWRITE_CHUNK_BYTES, kvtier_sys::mem::HugePages::Off)
        .map_err(|e| Error::Memory(e.to_string()))?;
    let mut at = from;
    while at < to {
        let len = (to - at).min(PREWRITE_CHUNK_BYTES as u64) as usize;
        file.write_all_at(at, &zeros, 0, len)
            .map_err(|e| Error::device(file.path(), errno_msg("pre-writing", e)))?;
        at += len as u64;
    }
    Ok(())
}

impl Storage for KernelStorage {
    fn supports_files(&self) -> bool {
        true
    }

    fn open_device(
        &self,
        index: usize,
        cfg: &DeviceConfig,
        direct: DirectIo,
    ) -> Result<OpenedDevice> {
        match nvme::locate(cfg).map_err(|m| Error::device(&cfg.path, m))? {
            nvme::Located::Passthrough(ns) => Ok(self.open_passthrough(index, cfg, ns)),
            nvme::Located::Kernel(path) => {
                let mut info = self.open_kernel(index, &path, cfg, direct)?;
                info.path.clone_from(&cfg.path);
                Ok(info)
            }
        }
    }

    fn read_sync(
        &self,
        device: usize,
        offset: u64,
        buf: &Region,
        buf_offset: usize,
        len: usize,
    ) -> Result<()> {
        self.transfer_sync(false, device, offset, buf, buf_offset, len)
    }

    fn write_sync(
        &self,
        device: usize,
        offset: u64,
        buf: &Region,
        buf_offset: usize,
        len: usize,
    ) -> Result<()> {
        self.transfer_sync(true, device, offset, buf, buf_offset, len)
    }

    fn backend(
        &self,
        _worker: usize,
        buffers: Vec<Arc<Region>>,
        wake: Arc<EventFd>,
        settings: &BackendSettings,
    ) -> Result<Box<dyn IoBackend>> {
        let opened: Vec<Opened> = {
            let guard = self
                .devices
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            guard.iter().flatten().cloned().collect()
        };
        let files: Vec<Arc<DeviceFile>> = opened.iter().map(|d| Arc::clone(&d.file)).collect();
        let passthrough = crate::commands::Commands::new(
            opened
                .iter()
                .map(|d| {
                    d.nvme.as_ref().map(|ns| crate::commands::Device {
                        path: ns.path().to_path_buf(),
                        geometry: ns.geometry().clone(),
                    })
                })
                .collect(),
        );
        let ring_config = RingConfig {
            entries: settings.ring_entries,
            sqpoll: settings.sqpoll,
            sqpoll_idle_ms: settings.sqpoll_idle_ms,
            iopoll: settings.iopoll,
            // Passthrough commands need 128-byte SQEs; every other op fits in them too.
            big_entries: passthrough.any(),
        };
        let mut ring = build_ring(&ring_config, &buffers, &files, settings.piece_bytes)?;
        if settings.files_io_wq_workers.is_some() && !ring.supports_file_ops() {
            return Err(Error::Ring(
                "the files layout needs io_uring openat, close, renameat, unlinkat and fsync \
                 (Linux 5.15 or later)"
                    .into(),
            ));
        }
        if let Some(bound) = settings.files_io_wq_workers {
            // A block write that creates a file's data runs to completion in one of the ring's
            // kernel workers: their number bounds the stores in flight (docs/perf.md).
            match ring.set_io_wq_bounded(bound) {
                Ok(was) => tracing::debug!(was, now = bound, "io-wq workers"),
                Err(e) => tracing::warn!(
                    errno = %e,
                    "[files] io_wq_workers = {bound}: the kernel refused the bound; its default \
                     (4 per CPU) applies"
                ),
            }
        }
        if ring.features().iopoll && !iopoll_reads_work(&ring_config, &files, &opened) {
            // Some devices accept an IOPOLL ring but fail every polled read (EOPNOTSUPP, no
            // poll queues): fall back rather than fail every load.
            tracing::warn!(
                "iopoll = true but this device cannot poll completions: using interrupts"
            );
            drop(ring);
            let fallback = RingConfig {
                iopoll: false,
                ..ring_config
            };
            ring = build_ring(&fallback, &buffers, &files, settings.piece_bytes)?;
        }
        if ring.features().iopoll {
            for ns in opened.iter().filter_map(|d| d.nvme.as_ref()) {
                if !ns.geometry().poll_queues {
                    tracing::warn!(
                        device = %ns.path().display(),
                        "iopoll = true but the NVMe driver has no poll queues \
                         (/sys/block/<ns>/queue/io_poll is 0): its commands complete by \
                         interrupt; load the driver with nvme.poll_queues=N to poll them"
                    );
                }
            }
        }
        let (load_prio, store_prio) = if settings.ioprio {
            (ioprio(IoprioClass::Be, 0), ioprio(IoprioClass::Be, 7))
        } else {
            (0, 0)
        };
        Ok(Box::new(UringBackend::new(
            ring,
            wake,
            (load_prio, store_prio),
            settings.wait_limit,
            passthrough,
        )))
    }
}

/// Whether `path` is a block device (for the CLI and tests).
pub fn is_block_device(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.file_type().is_block_device())
}
