//! The user-space NVMe device: a controller taken from the kernel through VFIO
//! ([`kvtier_sys::vfio::nvme`]) carrying the slab on a namespace's LBAs, as passthrough does,
//! with no kernel on the I/O path.
//!
//! * [`VfioStorage`] opens each `kind = "vfio"` device's controller once (reset, admin queue,
//!   Identify), keeps one small queue pair and a 2 MiB bounce buffer for the synchronous reads and
//!   writes of opening (headers, formatting), and maps each worker's buffers (the primary region
//!   once, shared) for DMA.
//! * Each worker gets one I/O queue pair per controller ([`VfioBackend`]); requests are cut into
//!   commands at the transfer limit and retried by status as for passthrough
//!   ([`crate::commands`]). Doorbells ring once per submit; completions are polled: an idle
//!   worker sleeps on its eventfd, a worker with I/O in flight polls its completion queues.
//! * Fence: a worker that gives up on I/O past its deadline at a stop fences the controller
//!   (disabled, bus mastering off) instead of leaking its memory, and [`Storage::shutdown`]
//!   fences every controller before the engine's shutdown returns, so the caller may free the
//!   region then. A killed process is fenced by the kernel (`vfio-pci` resets the function
//!   when the device is closed).

use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use kvtier_sys::mem::HugePages;
use kvtier_sys::nvme::{Geometry, Opcode};
use kvtier_sys::vfio::nvme::{Controller, Failure, IoCompletion, IoQueue};

use crate::commands::{CommandQueue, Commands, Device};
use crate::config::{DeviceConfig, DirectIo};
use crate::error::{Error, Result};
use crate::io::{
    BackendSettings, BlockQueue, Completion, EventFd, IoBackend, IoBuf, IoRequest, OpenedDevice,
    Region, Storage,
};

/// The bounce buffer of the synchronous transfers made while opening.
const BOUNCE_BYTES: usize = 2 << 20;
/// How long a synchronous transfer may take.
const SYNC_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a worker with I/O in flight polls for a completion before it looks at its queues.
const POLL_SPIN: Duration = Duration::from_micros(50);

struct SyncIo {
    queue: IoQueue,
    bounce: Arc<Region>,
    bounce_id: u16,
}

/// One opened controller and namespace.
struct Opened {
    path: PathBuf,
    ctrl: Controller,
    geometry: Geometry,
    sync: Mutex<SyncIo>,
    /// Regions mapped for DMA on this controller, with their ids.
    mapped: Mutex<Vec<(Arc<Region>, u16)>>,
}

impl Opened {
    /// The controller's id of `region`, mapping it the first time.
    fn region_id(&self, region: &Arc<Region>) -> Result<u16> {
        let mut mapped = self.mapped.lock().expect("mapped lock");
        if let Some((_, id)) = mapped.iter().find(|(r, _)| Arc::ptr_eq(r, region)) {
            return Ok(*id);
        }
        let id = self
            .ctrl
            .map_region(region)
            .map_err(|e| Error::device(&self.path, e))?;
        mapped.push((Arc::clone(region), id));
        Ok(id)
    }

    /// Moves `len` bytes between `buf` at `buf_offset` and byte `offset` of the namespace,
    /// through the bounce buffer, waiting for each piece.
    fn transfer_sync(
        &self,
        write: bool,
        offset: u64,
        buf: &Region,
        buf_offset: usize,
        len: usize,
    ) -> Result<()> {
        let g = &self.geometry;
        let lba = u64::from(g.lba_bytes());
        if !offset.is_multiple_of(lba) || !(len as u64).is_multiple_of(lba) {
            return Err(Error::device(
                &self.path,
                format!("{len} bytes at {offset}: not whole {lba}-byte LBAs"),
            ));
        }
        let mut sync = self.sync.lock().expect("sync lock");
        let mut done = 0;
        while done < len {
            let n = (len - done).min(BOUNCE_BYTES);
            if write {
                buf.with_bytes(buf_offset + done, n, |src| sync.bounce.write(0, src));
            }
            self.sync_piece(&mut sync, write, offset + done as u64, n)?;
            if !write {
                let mut tmp = vec![0; n];
                sync.bounce.read(0, &mut tmp);
                buf.write(buf_offset + done, &tmp);
            }
            done += n;
        }
        Ok(())
    }

    fn sync_piece(&self, sync: &mut SyncIo, write: bool, offset: u64, len: usize) -> Result<()> {
        let g = &self.geometry;
        let op = if write { Opcode::Write } else { Opcode::Read };
        let whole = sync
            .bounce
            .checkout(0, len, !write)
            .expect("the bounce buffer is the opener's alone");
        let max = g.max_transfer_bytes as usize;
        let mut at = 0;
        let mut parts = 0;
        while at < len {
            let n = max.min(len - at);
            let slba = (offset + at as u64) >> g.lba_shift;
            if sync
                .queue
                .push(parts, op, slba, sync.bounce_id, whole.part(at, n))
                .is_err()
            {
                return Err(Error::device(&self.path, "the controller is fenced"));
            }
            at += n;
            parts += 1;
        }
        drop(whole);
        sync.queue.submit();
        let start = Instant::now();
        let mut out = Vec::new();
        while (out.len() as u64) < parts {
            sync.queue.reap(&mut out);
            if start.elapsed() > SYNC_TIMEOUT {
                // The bytes stay claimed by the queue; fencing hands them back safely.
                self.ctrl.fence();
                sync.queue.reap(&mut out);
                return Err(Error::device(
                    &self.path,
                    format!("no completion within {SYNC_TIMEOUT:?}; the controller was fenced"),
                ));
            }
            std::hint::spin_loop();
        }
        if let Some(failed) = out.iter().find_map(|c| c.result.err()) {
            let what = if write { "write" } else { "read" };
            return Err(Error::device(
                &self.path,
                format!("NVMe {what} of {len} bytes at byte {offset}: {failed}"),
            ));
        }
        Ok(())
    }
}

/// One VFIO device opened for synchronous transfers only (`kvtier inspect` reads the slot
/// table with it): the controller is taken, reset and given back when this drops.
pub struct SyncDevice(Opened);

impl SyncDevice {
    /// Takes the controller of a `kind = "vfio"` device.
    pub fn open(cfg: &DeviceConfig) -> Result<SyncDevice> {
        open_controller(cfg)
            .map(SyncDevice)
            .map_err(|e| Error::device(&cfg.path, e))
    }

    /// Reads `len` bytes at byte `offset` of the namespace into `buf` at `at` (whole LBAs).
    pub fn read_sync(&self, offset: u64, buf: &Region, at: usize, len: usize) -> Result<()> {
        self.0.transfer_sync(false, offset, buf, at, len)
    }

    /// The namespace's size in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.0.geometry.size_bytes()
    }
}

/// Devices driven through VFIO.
#[derive(Default)]
pub struct VfioStorage {
    devices: RwLock<Vec<Option<Arc<Opened>>>>,
}

impl VfioStorage {
    fn device(&self, index: usize) -> Result<Arc<Opened>> {
        self.devices
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(index)
            .and_then(Clone::clone)
            .ok_or_else(|| Error::Worker(format!("device {index} is not open")))
    }
}

fn open_controller(cfg: &DeviceConfig) -> std::result::Result<Opened, String> {
    let pci = cfg.pci.as_deref().ok_or("kind = \"vfio\" needs pci")?;
    let ctrl = Controller::open(pci, cfg.nsid)?;
    let info = ctrl.info().clone();
    let bounce = Region::allocate(BOUNCE_BYTES, HugePages::Off).map_err(|e| e.to_string())?;
    bounce
        .guard_blocks(BOUNCE_BYTES)
        .map_err(|e| format!("bounce buffer: {e}"))?;
    let bounce = Arc::new(bounce);
    let bounce_id = ctrl.map_region(&bounce)?;
    let queue = ctrl.create_queue(16)?;
    let geometry = Geometry {
        nsid: info.nsid,
        lba_shift: info.lba_shift,
        lbas: info.lbas,
        max_transfer_bytes: u32::try_from(info.max_transfer_bytes()).unwrap_or(u32::MAX),
        poll_queues: true,
        source: "identify (vfio)",
        controller: PathBuf::from(format!("/sys/bus/pci/devices/{pci}")),
        block_device: PathBuf::new(),
    };
    tracing::info!(
        pci,
        nsid = info.nsid,
        model = %info.model,
        serial = %info.serial,
        version = %info.version,
        lba_bytes = info.lba_bytes(),
        lbas = info.lbas,
        max_transfer_bytes = info.max_transfer_bytes(),
        max_queue_entries = info.max_queue_entries,
        io_queues = info.io_queues,
        "NVMe controller taken through VFIO"
    );
    Ok(Opened {
        path: cfg.path.clone(),
        ctrl,
        geometry,
        sync: Mutex::new(SyncIo {
            queue,
            bounce,
            bounce_id,
        }),
        mapped: Mutex::new(Vec::new()),
    })
}

impl Storage for VfioStorage {
    fn open_device(
        &self,
        index: usize,
        cfg: &DeviceConfig,
        _direct: DirectIo,
    ) -> Result<OpenedDevice> {
        let opened = open_controller(cfg).map_err(|e| Error::device(&cfg.path, e))?;
        let g = &opened.geometry;
        let mut size = g.size_bytes();
        if let Some(cap) = cfg.capacity_bytes {
            size = size.min(cap);
        }
        let info = OpenedDevice {
            path: cfg.path.clone(),
            size_bytes: size,
            align_bytes: u64::from(g.lba_bytes()).max(512),
            direct: true,
            fresh: false,
            kind: "nvme vfio",
        };
        let mut devices = self
            .devices
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if devices.len() <= index {
            devices.resize(index + 1, None);
        }
        devices[index] = Some(Arc::new(opened));
        Ok(info)
    }

    fn read_sync(
        &self,
        device: usize,
        offset: u64,
        buf: &Region,
        buf_offset: usize,
        len: usize,
    ) -> Result<()> {
        self.device(device)?
            .transfer_sync(false, offset, buf, buf_offset, len)
    }

    fn write_sync(
        &self,
        device: usize,
        offset: u64,
        buf: &Region,
        buf_offset: usize,
        len: usize,
    ) -> Result<()> {
        self.device(device)?
            .transfer_sync(true, offset, buf, buf_offset, len)
    }

    fn backend(
        &self,
        _worker: usize,
        buffers: Vec<Arc<Region>>,
        wake: Arc<EventFd>,
        settings: &BackendSettings,
    ) -> Result<Box<dyn IoBackend>> {
        let opened: Vec<Arc<Opened>> = {
            let guard = self
                .devices
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            guard.iter().flatten().cloned().collect()
        };
        let mut queues = Vec::with_capacity(opened.len());
        let mut region_ids = Vec::with_capacity(opened.len());
        for dev in &opened {
            // Mapped before the queue is made: a queue knows the regions mapped until then.
            let ids = buffers
                .iter()
                .map(|b| dev.region_id(b))
                .collect::<Result<Vec<u16>>>()?;
            let mqes = dev.ctrl.info().max_queue_entries;
            let depth = u16::try_from(settings.ring_entries.clamp(2, mqes)).unwrap_or(u16::MAX);
            let queue = dev
                .ctrl
                .create_queue(depth)
                .map_err(|e| Error::device(&dev.path, e))?;
            queues.push(queue);
            region_ids.push(ids);
        }
        let commands = Commands::new(
            opened
                .iter()
                .map(|d| {
                    Some(Device {
                        path: d.path.clone(),
                        geometry: d.geometry.clone(),
                    })
                })
                .collect(),
        );
        Ok(Box::new(VfioBackend {
            queues: Queues {
                pairs: queues,
                region_ids,
                doorbells: 0,
            },
            controllers: opened.iter().map(|d| d.ctrl.clone()).collect(),
            commands,
            wake,
            wait_limit: settings.wait_limit,
            reaped: Vec::new(),
            sleeps: 0,
            raw: Vec::new(),
        }))
    }

    fn shutdown(&self) {
        let devices = std::mem::take(
            &mut *self
                .devices
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        for dev in devices.into_iter().flatten() {
            // Even if a worker that gave up still holds a queue (and so the controller), the
            // device is off the memory the caller may free once shutdown returns.
            dev.ctrl.close();
        }
    }
}

/// A worker's queue pairs, by device index, and its buffers' region ids on each controller.
struct Queues {
    pairs: Vec<IoQueue>,
    region_ids: Vec<Vec<u16>>,
    /// Submission doorbells rung: the "calls into the device" of this backend.
    doorbells: u64,
}

impl Queues {
    fn reap(&mut self, out: &mut Vec<IoCompletion>) -> usize {
        self.pairs.iter_mut().map(|q| q.reap(out)).sum()
    }
}

impl CommandQueue for Queues {
    fn has_room(&self) -> bool {
        // Whether the device the next command goes to has room is asked by the push; here,
        // whether any could take one.
        self.pairs
            .iter()
            .any(|q| q.in_flight() + 1 < usize::from(q.depth()))
    }

    fn push_command(
        &mut self,
        user_data: u64,
        device: u16,
        op: Opcode,
        _nsid: u32,
        slba: u64,
        _lba_shift: u32,
        region: u16,
        buf: IoBuf,
    ) -> bool {
        let d = usize::from(device);
        let id = self.region_ids[d][usize::from(region)];
        self.pairs[d].push(user_data, op, slba, id, buf).is_ok()
    }
}

/// A worker's backend on VFIO controllers: one polled queue pair per controller.
pub(crate) struct VfioBackend {
    queues: Queues,
    controllers: Vec<Controller>,
    commands: Commands,
    wake: Arc<EventFd>,
    wait_limit: Duration,
    /// Completions polled while waiting, not yet handed to the worker.
    reaped: Vec<IoCompletion>,
    /// Idle sleeps on the eventfd (polling with I/O in flight is not one).
    sleeps: u64,
    raw: Vec<Completion>,
}

impl BlockQueue for VfioBackend {
    fn push(&mut self, req: IoRequest) -> bool {
        self.commands.push(&mut self.queues, req)
    }
}

impl IoBackend for VfioBackend {
    fn blocks(&mut self) -> Option<&mut dyn BlockQueue> {
        Some(self)
    }

    fn submit(&mut self, wait: bool) -> std::io::Result<()> {
        self.commands.flush(&mut self.queues);
        for q in &mut self.queues.pairs {
            if q.submit() {
                self.queues.doorbells += 1;
            }
        }
        if !wait {
            return Ok(());
        }
        if self.commands.requests() == 0 {
            // Idle: sleep until a submitter writes the eventfd.
            self.wake.wait_timeout(self.wait_limit);
            self.sleeps += 1;
            return Ok(());
        }
        // I/O in flight: poll for a while, then let the worker look at its queues.
        let start = Instant::now();
        while self.queues.reap(&mut self.reaped) == 0 && start.elapsed() < POLL_SPIN {
            std::hint::spin_loop();
        }
        Ok(())
    }

    fn enters(&self) -> u64 {
        self.queues.doorbells
    }

    fn sleeps(&self) -> Option<u64> {
        Some(self.sleeps)
    }

    fn complete(&mut self, out: &mut Vec<Completion>) {
        self.queues.reap(&mut self.reaped);
        for c in self.reaped.drain(..) {
            let result = match c.result {
                Ok(()) => 0,
                // The status field is 15 bits: always a positive i32.
                Err(Failure::Status(s)) => i32::from(s.0),
                Err(Failure::Fenced) => -(crate::Errno::ECANCELED as i32),
            };
            self.raw.push(Completion {
                user_data: c.user_data,
                result,
            });
        }
        self.commands.complete(&mut self.queues, &mut self.raw, out);
    }

    fn in_flight(&self) -> usize {
        self.commands.requests()
    }

    fn fence(&mut self) -> bool {
        for c in &self.controllers {
            c.fence();
        }
        true
    }

    fn describe(&self) -> String {
        let queues: Vec<String> = self
            .controllers
            .iter()
            .zip(&self.queues.pairs)
            .map(|(c, q)| format!("{} depth {}", c.info().pci, q.depth()))
            .collect();
        format!("vfio [{}, polled]", queues.join(", "))
    }
}
