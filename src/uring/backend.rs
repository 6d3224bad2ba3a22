//! A worker's io_uring backend: data I/O on registered files and buffers, file operations for
//! the files layout, NVMe passthrough requests cut into commands ([`super::nvme`]), and the
//! worker's sleep (an eventfd read on its own ring, or on an IOPOLL ring a `poll(2)` on the
//! eventfd while idle).

use std::sync::Arc;

use kvtier_sys::file::DeviceFile;
use kvtier_sys::ring::{Ring, RingConfig};

use super::{errno_msg, Opened};
use crate::commands::Commands;
use crate::error::{Error, Result};
use crate::io::{
    BlockQueue, Completion, EventFd, FileOp, FileOpQueue, IoBackend, IoBuf, IoClass, IoKind,
    IoRequest, Region,
};

pub(super) fn build_ring(
    config: &RingConfig,
    buffers: &[Arc<Region>],
    files: &[Arc<DeviceFile>],
    piece_bytes: usize,
) -> Result<Ring> {
    let mut ring =
        Ring::new(config).map_err(|e| Error::Ring(errno_msg("setting up the ring", e)))?;
    ring.register_buffers(buffers.to_vec(), piece_bytes)
        .map_err(|e| Error::Memory(e.to_string()))?;
    if !files.is_empty() {
        ring.register_files(files.to_vec())
            .map_err(|e| Error::Ring(errno_msg("registering device files", e)))?;
    }
    Ok(ring)
}

/// Reads the first 4 KiB (one LBA of a passthrough device) of device 0 on a ring of its own
/// built with `config` (polled), into a scratch buffer of its own, and reports whether the
/// polled read succeeded. A read that never completes keeps only the scratch buffer (the
/// ring's drop leaks what the kernel may still write), never one of the worker's.
pub(super) fn iopoll_reads_work(
    config: &RingConfig,
    files: &[Arc<DeviceFile>],
    devices: &[Opened],
) -> bool {
    const SCRATCH: usize = 64 << 10;
    let Some(first) = devices.first() else {
        return true;
    };
    let Ok(scratch) = Region::allocate(SCRATCH, kvtier_sys::mem::HugePages::Off) else {
        return false;
    };
    let scratch = Arc::new(scratch);
    if scratch.guard_blocks(SCRATCH).is_err() {
        return false;
    }
    let Ok(mut ring) = build_ring(config, &[Arc::clone(&scratch)], files, SCRATCH) else {
        return false;
    };
    let ring = &mut ring;
    let claim = |len: u32| {
        scratch
            .checkout(0, len as usize, true)
            .expect("the scratch buffer is this probe's alone")
    };
    let pushed = if let Some(ns) = &first.nvme {
        let g = ns.geometry();
        ring.push_nvme(
            0,
            0,
            kvtier_sys::nvme::Opcode::Read,
            g.nsid,
            0,
            g.lba_shift,
            0,
            claim(g.lba_bytes()),
        )
    } else {
        ring.push_read(0, 0, 0, 0, claim(4096), 0)
    };
    if pushed.is_err() || ring.submit(1).is_err() {
        return false;
    }
    let mut out = Vec::new();
    for _ in 0..10_000 {
        ring.complete(&mut out);
        if let Some(c) = out.first() {
            // Passthrough answers 0 on success, a positive NVMe status on failure.
            return if first.nvme.is_some() {
                c.result == 0
            } else {
                c.result >= 0
            };
        }
        if ring.submit(1).is_err() {
            return false;
        }
    }
    false
}

/// `user_data` of the wake-up read; never handed to the worker.
const WAKE_USER_DATA: u64 = u64::MAX;

pub(super) struct UringBackend {
    ring: Ring,
    wake: Arc<EventFd>,
    /// Whether the eventfd read is in flight.
    armed: bool,
    load_prio: u16,
    store_prio: u16,
    /// The longest sleep while I/O is in flight (the worker checks deadlines between).
    wait_limit: std::time::Duration,
    /// Requests for NVMe passthrough devices, split into commands at the transfer limit;
    /// `None` when no device is one (a plain file or block device's I/O never looks).
    passthrough: Option<Commands>,
    /// Completions straight off the ring, before passthrough parts are folded into requests.
    raw: Vec<Completion>,
    /// The kernel runs FSETXATTR/FGETXATTR (5.19+).
    xattr_ops: bool,
}

impl UringBackend {
    pub(super) fn new(
        ring: Ring,
        wake: Arc<EventFd>,
        (load_prio, store_prio): (u16, u16),
        wait_limit: std::time::Duration,
        passthrough: Commands,
    ) -> UringBackend {
        UringBackend {
            xattr_ops: ring.supports_xattr_ops(),
            ring,
            wake,
            armed: false,
            load_prio,
            store_prio,
            wait_limit,
            passthrough: passthrough.any().then_some(passthrough),
            raw: Vec::new(),
        }
    }
}

impl BlockQueue for UringBackend {
    fn push(&mut self, req: IoRequest) -> bool {
        let prio = match req.class {
            IoClass::Load => self.load_prio,
            IoClass::Store | IoClass::Meta => self.store_prio,
        };
        if let Some(commands) = self.passthrough.as_mut().filter(|c| c.owns(req.device)) {
            // NVMe passthrough has no I/O priority of its own; loads still go first through
            // the worker's scheduler.
            return commands.push(&mut self.ring, req);
        }
        let file = u32::from(req.device);
        let (user_data, offset, region) = (req.user_data, req.offset, req.region);
        match req.kind {
            IoKind::Read => self
                .ring
                .push_read(user_data, file, offset, region, req.buf, prio)
                .is_ok(),
            IoKind::Write => self
                .ring
                .push_write(user_data, file, offset, region, req.buf, prio)
                .is_ok(),
        }
    }
}

impl FileOpQueue for UringBackend {
    fn push_file(
        &mut self,
        user_data: u64,
        op: &FileOp<'_>,
        buf: Option<(u16, IoBuf)>,
        class: IoClass,
    ) -> bool {
        let prio = match class {
            IoClass::Load => self.load_prio,
            IoClass::Store | IoClass::Meta => self.store_prio,
        };
        match buf {
            Some((region, buf)) => self.ring.push_file_io(user_data, op, region, buf, prio),
            None => self.ring.push_file_op(user_data, op, prio),
        }
        .is_ok()
    }

    fn xattr_ops(&self) -> bool {
        self.xattr_ops
    }

    fn take_file_value(&mut self, user_data: u64) -> Option<Box<[u8]>> {
        self.ring.take_value(user_data)
    }
}

impl IoBackend for UringBackend {
    fn blocks(&mut self) -> Option<&mut dyn BlockQueue> {
        Some(self)
    }

    fn files(&mut self) -> Option<&mut dyn FileOpQueue> {
        Some(self)
    }

    fn cancel(&mut self, user_data: u64) -> bool {
        self.ring.push_cancel(user_data).is_ok()
    }

    fn submit(&mut self, wait: bool) -> std::io::Result<()> {
        if let Some(commands) = &mut self.passthrough {
            commands.flush(&mut self.ring);
        }
        if self.ring.features().iopoll {
            // An IOPOLL ring cannot read the eventfd and reaps only what an enter polls for
            // (submit(0) polls once): it may return with no completion, and the worker loops;
            // an idle worker sleeps on the eventfd instead.
            let idle = wait && self.in_flight() == 0;
            let res = self.ring.submit(0);
            if idle {
                self.wake.wait_timeout(self.wait_limit);
            }
            return res
                .map(|_| ())
                .map_err(|e| std::io::Error::from_raw_os_error(e as i32));
        }
        if wait && !self.armed {
            // Sleep in the kernel until an I/O completes or a submitter writes the eventfd.
            if self
                .ring
                .push_eventfd_read(WAKE_USER_DATA, &self.wake)
                .is_ok()
            {
                self.armed = true;
            }
        }
        let submitted = if wait && self.in_flight() > 0 {
            self.ring.submit_wait_timeout(1, self.wait_limit)
        } else {
            self.ring.submit(usize::from(wait))
        };
        submitted
            .map(|_| ())
            .map_err(|e| std::io::Error::from_raw_os_error(e as i32))
    }

    fn enters(&self) -> u64 {
        self.ring.enters()
    }

    fn complete(&mut self, out: &mut Vec<Completion>) {
        let start = out.len();
        if let Some(commands) = &mut self.passthrough {
            self.ring.complete(&mut self.raw);
            commands.complete(&mut self.ring, &mut self.raw, out);
        } else {
            self.ring.complete(out);
        }
        let before = out.len();
        out.retain(|c| c.user_data != WAKE_USER_DATA);
        if out.len() != before {
            self.armed = false;
        }
        debug_assert!(out.len() >= start);
    }

    fn in_flight(&self) -> usize {
        let (parts, requests) = self
            .passthrough
            .as_ref()
            .map_or((0, 0), |c| (c.parts_in_ring, c.requests()));
        self.ring.in_flight() - usize::from(self.armed) - parts + requests
    }

    fn describe(&self) -> String {
        let f = self.ring.features();
        let mut flags = Vec::new();
        if f.single_issuer {
            flags.push("SINGLE_ISSUER");
        }
        if f.defer_taskrun {
            flags.push("DEFER_TASKRUN");
        }
        if f.coop_taskrun {
            flags.push("COOP_TASKRUN");
        }
        if f.sqpoll {
            flags.push("SQPOLL");
        }
        if f.iopoll {
            flags.push("IOPOLL");
        }
        if self.ring.big_entries() {
            flags.push("SQE128|CQE32");
        }
        format!("io_uring [{}]", flags.join("|"))
    }
}

impl Drop for UringBackend {
    /// Completes the wake-up read before the ring goes away, so the ring is never dropped with
    /// an operation in flight (the worker only exits once its data I/O has all completed).
    fn drop(&mut self) {
        let mut sink = Vec::new();
        for _ in 0..1000 {
            if !self.armed {
                break;
            }
            self.wake.notify();
            if self.ring.submit(1).is_err() {
                break;
            }
            self.complete(&mut sink);
        }
    }
}
