//! An NVMe controller driven from user space over VFIO: no kernel on the I/O path.
//!
//! * [`Controller::open`] takes the controller at a PCI address (bound to `vfio-pci`), turns bus
//!   mastering on, disables it (a controller left enabled by a killed process is reset here),
//!   waits `CAP.TO` for `CSTS.RDY`, sets up the admin queue, enables it, and reads Identify
//!   Controller (MDTS, model, serial) and Identify Namespace (LBA format, capacity).
//! * [`Controller::map_region`] maps a [`Region`] for DMA once; [`Controller::create_queue`]
//!   makes one I/O queue pair ([`IoQueue`], interrupts off) for one thread.
//! * [`IoQueue::push`] writes a read or write command straight into the submission queue (its
//!   PRP list in DMA memory the queue owns), [`IoQueue::submit`] rings the doorbell once for
//!   everything pushed since, [`IoQueue::reap`] polls the completion queue by its phase bit and
//!   rings the head doorbell once. No system call and no interrupt on this path.
//! * **Fence.** [`Controller::fence`] (also run when the last handle goes) disables the
//!   controller (`CC.EN = 0`, then `CSTS.RDY = 0` within `CAP.TO`, else a function reset) and
//!   turns bus mastering off, and only then may DMA memory be unmapped or handed back: queues
//!   answer their commands in flight as [`Failure::Fenced`] and drop their claims on the
//!   caller's bytes only after it.
//!
//! The transfer token rule is the ring's: a command carries an [`IoBuf`] that claims its bytes,
//! kept until the completion is reaped or the controller fenced.

use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{Device, Mmio};
use crate::mem::Region;
use crate::nvme::Status;
use crate::Errno;

mod queue;
pub use queue::{IoQueue, QueueFull};

// Controller registers (NVMe base specification, section 3.1).
const REG_CAP: usize = 0x00;
const REG_VS: usize = 0x08;
const REG_CC: usize = 0x14;
const REG_CSTS: usize = 0x1c;
const REG_AQA: usize = 0x24;
const REG_ASQ: usize = 0x28;
const REG_ACQ: usize = 0x30;
const DOORBELLS: usize = 0x1000;

const CC_EN: u32 = 1;
/// 64-byte submission and 16-byte completion entries (log2), 4 KiB pages (MPS 0), NVM command set.
const CC_ENTRY_SIZES: u32 = (6 << 16) | (4 << 20);
const CC_SHN_NORMAL: u32 = 1 << 14;
const CSTS_RDY: u32 = 1;
const CSTS_CFS: u32 = 1 << 1;
const CSTS_SHST_MASK: u32 = 3 << 2;
const CSTS_SHST_DONE: u32 = 2 << 2;

// Admin opcodes.
const ADMIN_DELETE_SQ: u8 = 0x00;
const ADMIN_CREATE_SQ: u8 = 0x01;
const ADMIN_DELETE_CQ: u8 = 0x04;
const ADMIN_CREATE_CQ: u8 = 0x05;
const ADMIN_IDENTIFY: u8 = 0x06;
const ADMIN_SET_FEATURES: u8 = 0x09;
const ADMIN_DOORBELL_BUFFER_CONFIG: u8 = 0x7c;
const FEATURE_NUMBER_OF_QUEUES: u32 = 0x07;
const IO_FLUSH: u8 = 0x00;

const PAGE: usize = 4096;
const ADMIN_DEPTH: u16 = 32;
/// The most I/O queue pairs one controller handle creates (doorbells mapped for them).
pub const MAX_IO_QUEUES: u16 = 64;
/// A command's PRP list is one 4 KiB page (512 entries), so one command moves at most 2 MiB
/// whatever MDTS allows.
const MAX_PRP_TRANSFER: usize = 2 << 20;

/// Zeroed, page-aligned anonymous memory the controller reads and writes by DMA (queues, PRP
/// lists, Identify data), mapped for DMA for as long as the controller lives.
struct DmaMem {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
    iova: u64,
}

// SAFETY: a pointer to a private mapping; every access is a volatile load or store of one value.
unsafe impl Send for DmaMem {}
// SAFETY: as for Send; the controller's queues each write only their own entries.
unsafe impl Sync for DmaMem {}

impl DmaMem {
    fn new(dev: &mut Device, len: usize) -> Result<DmaMem, String> {
        let len = len.next_multiple_of(PAGE);
        // SAFETY: a fresh private anonymous mapping.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(format!(
                "mmap of {len} bytes of queue memory: {}",
                Errno::last()
            ));
        }
        let ptr = std::ptr::NonNull::new(ptr.cast()).expect("mmap never returns NULL");
        // SAFETY: the mapping lives until this DmaMem drops, which the controller does only
        // after the fence and the unmapping (`Inner::drop`).
        match unsafe { dev.map_dma(ptr.as_ptr() as usize, len) } {
            Ok(iova) => Ok(DmaMem { ptr, len, iova }),
            Err(e) => {
                // SAFETY: the mapping made above; the device never saw it.
                unsafe { libc::munmap(ptr.as_ptr().cast(), len) };
                Err(e)
            }
        }
    }

    fn word(&self, offset: usize) -> *mut u32 {
        assert!(
            offset.is_multiple_of(4) && offset + 4 <= self.len,
            "DMA word {offset:#x}"
        );
        // SAFETY: in bounds (checked above).
        unsafe { self.ptr.as_ptr().add(offset).cast() }
    }

    fn read32(&self, offset: usize) -> u32 {
        // SAFETY: an aligned word inside the mapping; the device may write it (volatile).
        unsafe { self.word(offset).read_volatile() }
    }

    fn write32(&self, offset: usize, value: u32) {
        // SAFETY: an aligned word inside the mapping (volatile: the device reads it).
        unsafe { self.word(offset).write_volatile(value) }
    }

    fn bytes(&self, offset: usize, len: usize) -> Vec<u8> {
        (offset..offset + len)
            .step_by(4)
            .flat_map(|o| self.read32(o).to_le_bytes())
            .collect()
    }
}

impl Drop for DmaMem {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// A 64-byte submission queue entry as 16 little-endian dwords.
#[derive(Clone, Copy, Debug, Default)]
struct Sqe([u32; 16]);

impl Sqe {
    fn new(opcode: u8, cid: u16, nsid: u32) -> Sqe {
        let mut s = Sqe::default();
        s.0[0] = u32::from(opcode) | u32::from(cid) << 16;
        s.0[1] = nsid;
        s
    }

    fn prp(mut self, prp1: u64, prp2: u64) -> Sqe {
        // Truncations intended: low and high halves.
        self.0[6] = prp1 as u32;
        self.0[7] = (prp1 >> 32) as u32;
        self.0[8] = prp2 as u32;
        self.0[9] = (prp2 >> 32) as u32;
        self
    }

    fn cdw(mut self, n: usize, value: u32) -> Sqe {
        assert!((10..16).contains(&n));
        self.0[n] = value;
        self
    }
}

/// What Identify Controller and Identify Namespace said, and the registers' limits.
#[derive(Clone, Debug)]
pub struct ControllerInfo {
    pub pci: String,
    pub vendor_id: u16,
    pub model: String,
    pub serial: String,
    pub firmware: String,
    /// NVMe version (VS register), e.g. `1.4.0`.
    pub version: String,
    /// Maximum queue entries supported (CAP.MQES + 1).
    pub max_queue_entries: u32,
    pub doorbell_stride: usize,
    /// CAP.TO: the longest the controller may take to become ready or not ready.
    pub ready_timeout: Duration,
    /// MDTS in bytes (0: no limit).
    pub mdts_bytes: usize,
    /// Namespaces (NN).
    pub namespaces: u32,
    /// The controller offers SGLs for NVM commands (SGLS bits 1:0).
    pub sgls: bool,
    /// The controller offers shadow doorbells (OACS bit 8: Doorbell Buffer Config).
    pub shadow_doorbells: bool,
    /// I/O queue pairs the controller allocated (Set Features: Number of Queues).
    pub io_queues: u16,
    pub nsid: u32,
    pub lba_shift: u32,
    pub lbas: u64,
}

impl ControllerInfo {
    pub fn lba_bytes(&self) -> u32 {
        1 << self.lba_shift
    }

    pub fn size_bytes(&self) -> u64 {
        self.lbas << self.lba_shift
    }

    /// The most one command moves: MDTS, and at most 2 MiB (one PRP list page).
    pub fn max_transfer_bytes(&self) -> usize {
        match self.mdts_bytes {
            0 => MAX_PRP_TRANSFER,
            m => m.min(MAX_PRP_TRANSFER),
        }
    }
}

/// The admin queue, used under the controller's lock.
struct Admin {
    mem: DmaMem,
    tail: u16,
    head: u16,
    phase: bool,
    next_cid: u16,
}

const ADMIN_SQ: usize = 0;
const ADMIN_CQ: usize = PAGE;
const ADMIN_DATA: usize = 2 * PAGE;

struct Inner {
    /// The device; its mappings are undone in `Drop` after the fence.
    dev: Mutex<Device>,
    bar: Mmio,
    admin: Mutex<Admin>,
    info: ControllerInfo,
    fenced: AtomicBool,
    /// Queue memory, freed only after the fence and the unmapping.
    dma: Mutex<Vec<DmaMem>>,
    /// Regions mapped for DMA and their IOVAs; kept alive until after the fence.
    regions: Mutex<Vec<(Arc<Region>, u64)>>,
    queues_made: Mutex<u16>,
    /// Shadow doorbells (Doorbell Buffer Config), where the controller offers them: the shadow
    /// page, then the EventIdx page; `None`: every doorbell is a register write.
    dbbuf: Option<DmaMem>,
}

/// Whether a shadow doorbell moving from `old` to `new` passed the controller's EventIdx
/// (the controller asked to be told when the value moves past it): then the register must be
/// written too. All three are ring indexes (wrapping 16-bit arithmetic, as the specification
/// and Linux's `nvme_dbbuf_need_event` have it).
fn dbbuf_need_event(event_idx: u16, new: u16, old: u16) -> bool {
    new.wrapping_sub(event_idx).wrapping_sub(1) < new.wrapping_sub(old)
}

/// An NVMe controller owned by this process through VFIO. Clones of the handle share it; the
/// last one to go (with the queues, which hold it too) shuts the controller down and fences it.
#[derive(Clone)]
pub struct Controller {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Controller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Controller")
            .field("info", &self.inner.info)
            .field("fenced", &self.inner.fenced.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// Why a command did not succeed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The controller answered with an error status.
    Status(Status),
    /// The controller was fenced with the command in flight: it never completed, and the
    /// device can no longer touch its bytes.
    Fenced,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Status(s) => s.fmt(f),
            Failure::Fenced => f.write_str("controller fenced with the command in flight"),
        }
    }
}

/// One reaped command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IoCompletion {
    pub user_data: u64,
    pub result: Result<(), Failure>,
}

fn wait_for(timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if done() {
            return true;
        }
        if start.elapsed() > timeout {
            return done();
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}

fn ascii(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).trim().to_owned()
}

impl Controller {
    /// Takes the controller at `pci` and opens namespace `nsid` on it. The controller is reset
    /// on the way (whatever state it was left in) and enabled with an admin queue.
    pub fn open(pci: &str, nsid: u32) -> Result<Controller, String> {
        let mut dev = Device::open(pci)?;
        let mut cap = [0_u8; 8];
        dev.read_bar0(REG_CAP as u64, &mut cap)
            .map_err(|e| format!("{pci}: reading CAP: {e}"))?;
        let cap = u64::from_le_bytes(cap);
        let doorbell_stride = 4_usize << ((cap >> 32) & 0xf);
        let bar_len = DOORBELLS + 2 * (usize::from(MAX_IO_QUEUES) + 1) * doorbell_stride;
        let bar = dev.map_bar0(bar_len)?;
        dev.set_bus_master(true)
            .map_err(|e| format!("{pci}: turning bus mastering on: {e}"))?;
        let mpsmin = (cap >> 48) & 0xf;
        if mpsmin != 0 {
            return Err(format!(
                "{pci}: the controller's smallest memory page is {} KiB (CAP.MPSMIN {mpsmin}); \
                 kvtier uses 4 KiB pages",
                4 << mpsmin
            ));
        }
        if (cap >> 37) & 1 == 0 {
            return Err(format!(
                "{pci}: the controller has no NVM command set (CAP.CSS)"
            ));
        }
        let ready_timeout = Duration::from_millis(500 * ((cap >> 24) & 0xff).max(1));
        let mqes = (cap & 0xffff) as u32 + 1;
        let vs = bar.read32(REG_VS);
        let mut info = ControllerInfo {
            pci: pci.to_owned(),
            vendor_id: 0,
            model: String::new(),
            serial: String::new(),
            firmware: String::new(),
            version: format!("{}.{}.{}", vs >> 16, (vs >> 8) & 0xff, vs & 0xff),
            max_queue_entries: mqes,
            doorbell_stride,
            ready_timeout,
            mdts_bytes: 0,
            namespaces: 0,
            sgls: false,
            shadow_doorbells: false,
            io_queues: 0,
            nsid,
            lba_shift: 0,
            lbas: 0,
        };
        disable(&bar, ready_timeout).map_err(|e| format!("{pci}: {e}"))?;
        let mem = DmaMem::new(&mut dev, 3 * PAGE)?;
        enable(&bar, mem.iova, ready_timeout).map_err(|e| format!("{pci}: {e}"))?;
        let inner = Arc::new(Inner {
            dev: Mutex::new(dev),
            bar,
            admin: Mutex::new(Admin {
                mem,
                tail: 0,
                head: 0,
                phase: true,
                next_cid: 0,
            }),
            info,
            fenced: AtomicBool::new(false),
            dma: Mutex::new(Vec::new()),
            regions: Mutex::new(Vec::new()),
            queues_made: Mutex::new(0),
            dbbuf: None,
        });
        let mut ctrl = Controller { inner };
        let ctrl_data = ctrl.identify(1, 0)?;
        let ns_data = ctrl.identify(0, nsid)?;
        let queues = ctrl.admin(
            Sqe::new(ADMIN_SET_FEATURES, 0, 0)
                .cdw(10, FEATURE_NUMBER_OF_QUEUES)
                .cdw(
                    11,
                    u32::from(MAX_IO_QUEUES - 1) << 16 | u32::from(MAX_IO_QUEUES - 1),
                ),
            "set features: number of queues",
        )?;
        info = ctrl.inner.info.clone();
        fill_identify(&mut info, &ctrl_data, &ns_data, queues)
            .map_err(|e| format!("{pci}: {e}"))?;
        let dbbuf = if info.shadow_doorbells {
            ctrl.shadow_doorbells()
        } else {
            None
        };
        let inner = Arc::get_mut(&mut ctrl.inner).expect("no queue exists yet");
        inner.info = info;
        inner.dbbuf = dbbuf;
        Ok(ctrl)
    }

    /// Doorbell Buffer Config: two pages the controller reads the queues' tails and heads from
    /// (and writes its EventIdx values to); `None`, with a warning, if it refuses them.
    fn shadow_doorbells(&self) -> Option<DmaMem> {
        let mem = {
            let mut dev = self.inner.dev.lock().expect("device lock");
            DmaMem::new(&mut dev, 2 * PAGE).ok()?
        };
        let configured = self.admin(
            Sqe::new(ADMIN_DOORBELL_BUFFER_CONFIG, 0, 0).prp(mem.iova, mem.iova + PAGE as u64),
            "doorbell buffer config",
        );
        match configured {
            Ok(_) => Some(mem),
            Err(e) => {
                tracing::warn!("{e}: every doorbell is a register write");
                // Mapped, and the controller may have read it: it goes with the controller.
                self.inner.dma.lock().expect("dma lock").push(mem);
                None
            }
        }
    }

    /// Whether the I/O queues use shadow doorbells.
    pub fn shadow_doorbells_on(&self) -> bool {
        self.inner.dbbuf.is_some()
    }

    /// Writes doorbell `index` (2 × qid for a submission queue's tail, 2 × qid + 1 for a
    /// completion queue's head) from `old` to `value`: in the shadow page, and in the register
    /// only when the controller's EventIdx asks for it (always, without shadow doorbells).
    /// Whether the register was written.
    fn ring(&self, index: usize, old: u16, value: u16) -> bool {
        let offset = index * self.inner.info.doorbell_stride;
        if let Some(db) = &self.inner.dbbuf {
            db.write32(offset, u32::from(value));
            // The new value is visible before the EventIdx is read (the controller reads the
            // shadow after it writes the EventIdx).
            fence(Ordering::SeqCst);
            // Truncation intended: EventIdx values are 16-bit ring indexes.
            let event_idx = db.read32(PAGE + offset) as u16;
            if !dbbuf_need_event(event_idx, value, old) {
                return false;
            }
        }
        self.inner.bar.write32(DOORBELLS + offset, u32::from(value));
        true
    }

    pub fn info(&self) -> &ControllerInfo {
        &self.inner.info
    }

    /// Whether the controller has been fenced.
    pub fn is_fenced(&self) -> bool {
        self.inner.fenced.load(Ordering::Acquire)
    }

    /// Whether CSTS.RDY is set (the controller is enabled and may do DMA).
    pub fn is_ready(&self) -> bool {
        self.inner.bar.read32(REG_CSTS) & CSTS_RDY != 0
    }

    /// Whether the device's bus mastering is on.
    pub fn bus_master(&self) -> Result<bool, Errno> {
        self.inner.dev.lock().expect("device lock").bus_master()
    }

    /// The DMA mappings in place (regions and queue memory).
    pub fn mappings(&self) -> usize {
        self.inner.dev.lock().expect("device lock").mappings().len()
    }

    /// Maps `region` for DMA and returns its id for [`IoQueue::push`] (regions mapped after a
    /// queue was created are not known to it). The controller keeps the region alive until it
    /// is fenced and unmapped.
    pub fn map_region(&self, region: &Arc<Region>) -> Result<u16, String> {
        let mut regions = self.inner.regions.lock().expect("regions lock");
        let id = u16::try_from(regions.len()).map_err(|_| "too many regions".to_owned())?;
        let mut dev = self.inner.dev.lock().expect("device lock");
        // SAFETY: `regions` keeps an `Arc` of the region, so its memory stays mapped until
        // `Inner::drop` has fenced the controller and removed the mapping.
        let iova = unsafe { dev.map_dma(region.addr(), region.len()) }?;
        regions.push((Arc::clone(region), iova));
        Ok(id)
    }

    /// Creates an I/O queue pair of `depth` entries (at most CAP.MQES + 1), completions polled
    /// (interrupts off), for one thread.
    pub fn create_queue(&self, depth: u16) -> Result<IoQueue, String> {
        let info = &self.inner.info;
        if depth < 2 || u32::from(depth) > info.max_queue_entries {
            return Err(format!(
                "queue depth {depth}: the controller takes 2..={} entries per queue",
                info.max_queue_entries
            ));
        }
        let qid = {
            let mut made = self.inner.queues_made.lock().expect("queue count lock");
            if *made >= info.io_queues {
                return Err(format!(
                    "{}: all {} I/O queue pairs are in use",
                    info.pci, info.io_queues
                ));
            }
            *made += 1;
            *made
        };
        let d = usize::from(depth);
        let (sq, cq, prp) = {
            let mut dev = self.inner.dev.lock().expect("device lock");
            (
                DmaMem::new(&mut dev, d * 64)?,
                DmaMem::new(&mut dev, d * 16)?,
                DmaMem::new(&mut dev, d * PAGE)?,
            )
        };
        let size = u32::from(depth - 1) << 16 | u32::from(qid);
        self.admin(
            // Physically contiguous, interrupts off.
            Sqe::new(ADMIN_CREATE_CQ, 0, 0)
                .prp(cq.iova, 0)
                .cdw(10, size)
                .cdw(11, 1),
            "create I/O completion queue",
        )?;
        self.admin(
            Sqe::new(ADMIN_CREATE_SQ, 0, 0)
                .prp(sq.iova, 0)
                .cdw(10, size)
                .cdw(11, u32::from(qid) << 16 | 1),
            "create I/O submission queue",
        )?;
        let regions = self.inner.regions.lock().expect("regions lock").clone();
        let queue = IoQueue {
            ctrl: self.clone(),
            qid,
            depth,
            sq_at: (sq.ptr, sq.iova),
            cq_at: (cq.ptr, cq.iova),
            prp_at: (prp.ptr, prp.iova),
            tail: 0,
            rung: 0,
            head: 0,
            phase: true,
            slots: (0..depth).map(|_| None).collect(),
            free: (0..depth).rev().collect(),
            regions,
            gone: false,
            register_writes: 0,
        };
        let mut dma = self.inner.dma.lock().expect("dma lock");
        dma.extend([sq, cq, prp]);
        Ok(queue)
    }

    /// Disables the controller and turns its DMA off; idempotent. Returns once the device can
    /// no longer touch any memory: `CSTS.RDY` read 0 within `CAP.TO` (else a function reset
    /// was made), and bus mastering is off.
    pub fn fence(&self) {
        self.inner.fence();
    }

    /// Shuts the controller down normally (CC.SHN, so a drive writes its volatile cache back)
    /// and fences it; what the last handle's drop does, for a caller that cannot wait for every
    /// handle to go.
    pub fn close(&self) {
        if !self.is_fenced() {
            self.inner.shutdown_notify();
        }
        self.inner.fence();
    }

    /// A synchronous admin command; its result dword.
    fn admin(&self, sqe: Sqe, what: &str) -> Result<u32, String> {
        let info = &self.inner.info;
        if self.is_fenced() {
            return Err(format!("{}: {what}: the controller is fenced", info.pci));
        }
        self.inner.admin(sqe, what)
    }

    /// Identify with `cns` for namespace `nsid`: the 4 KiB data structure.
    fn identify(&self, cns: u32, nsid: u32) -> Result<Vec<u8>, String> {
        let admin = self.inner.admin.lock().expect("admin lock");
        let data = admin.mem.iova + ADMIN_DATA as u64;
        drop(admin);
        self.admin(
            Sqe::new(ADMIN_IDENTIFY, 0, nsid).prp(data, 0).cdw(10, cns),
            if cns == 1 {
                "identify controller"
            } else {
                "identify namespace"
            },
        )?;
        let admin = self.inner.admin.lock().expect("admin lock");
        Ok(admin.mem.bytes(ADMIN_DATA, PAGE))
    }
}

fn fill_identify(
    info: &mut ControllerInfo,
    ctrl: &[u8],
    ns: &[u8],
    queues: u32,
) -> Result<(), String> {
    let u16_at = |b: &[u8], o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
    let u32_at = |b: &[u8], o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4"));
    let u64_at = |b: &[u8], o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8"));
    info.vendor_id = u16_at(ctrl, 0);
    info.serial = ascii(&ctrl[4..24]);
    info.model = ascii(&ctrl[24..64]);
    info.firmware = ascii(&ctrl[64..72]);
    let mdts = ctrl[77];
    info.mdts_bytes = if mdts == 0 { 0 } else { PAGE << mdts };
    info.shadow_doorbells = u16_at(ctrl, 256) & (1 << 8) != 0;
    info.namespaces = u32_at(ctrl, 516);
    info.sgls = u32_at(ctrl, 536) & 3 != 0;
    // Number of Queues: submission queues allocated in 15:0, completion queues in 31:16,
    // both zero-based.
    let sqs = (queues & 0xffff) + 1;
    let cqs = (queues >> 16) + 1;
    info.io_queues = sqs.min(cqs).min(u32::from(MAX_IO_QUEUES)) as u16;
    if info.nsid == 0 || info.nsid > info.namespaces {
        return Err(format!(
            "namespace {} does not exist (the controller has namespaces 1..={})",
            info.nsid, info.namespaces
        ));
    }
    info.lbas = u64_at(ns, 0);
    if info.lbas == 0 {
        return Err(format!("namespace {} is not active (size 0)", info.nsid));
    }
    let flbas = ns[26];
    let format = usize::from(flbas & 0xf) | usize::from((flbas >> 5) & 0x3) << 4;
    let lbaf = u32_at(ns, 128 + 4 * format);
    if lbaf & 0xffff != 0 {
        return Err(format!(
            "namespace {} is formatted with {} metadata bytes per LBA; kvtier needs a format \
             without metadata",
            info.nsid,
            lbaf & 0xffff
        ));
    }
    info.lba_shift = (lbaf >> 16) & 0xff;
    if !(9..=16).contains(&info.lba_shift) {
        return Err(format!(
            "namespace {}: LBA size 2^{}",
            info.nsid, info.lba_shift
        ));
    }
    Ok(())
}

/// Points the controller at the admin queue at `admin_iova`, sets CC.EN and waits CAP.TO for
/// CSTS.RDY.
fn enable(bar: &Mmio, admin_iova: u64, ready_timeout: Duration) -> Result<(), String> {
    bar.write32(
        REG_AQA,
        u32::from(ADMIN_DEPTH - 1) << 16 | u32::from(ADMIN_DEPTH - 1),
    );
    bar.write64(REG_ASQ, admin_iova + ADMIN_SQ as u64);
    bar.write64(REG_ACQ, admin_iova + ADMIN_CQ as u64);
    bar.write32(REG_CC, CC_ENTRY_SIZES | CC_EN);
    let ready = wait_for(ready_timeout, || {
        bar.read32(REG_CSTS) & (CSTS_RDY | CSTS_CFS) != 0
    });
    let csts = bar.read32(REG_CSTS);
    if !ready || csts & CSTS_CFS != 0 || csts & CSTS_RDY == 0 {
        return Err(format!(
            "the controller did not become ready within CAP.TO {ready_timeout:?} \
                 (CSTS {csts:#x}{})",
            if csts & CSTS_CFS != 0 {
                ", controller fatal status"
            } else {
                ""
            }
        ));
    }
    Ok(())
}

/// Clears CC.EN and waits for CSTS.RDY to read 0.
fn disable(bar: &Mmio, timeout: Duration) -> Result<(), String> {
    let cc = bar.read32(REG_CC);
    if cc & CC_EN != 0 {
        bar.write32(REG_CC, cc & !CC_EN);
    }
    if wait_for(timeout, || bar.read32(REG_CSTS) & CSTS_RDY == 0) {
        Ok(())
    } else {
        Err(format!(
            "the controller stayed ready {timeout:?} (CAP.TO) after CC.EN was cleared \
             (CSTS {:#x})",
            bar.read32(REG_CSTS)
        ))
    }
}

impl Inner {
    fn admin(&self, sqe: Sqe, what: &str) -> Result<u32, String> {
        let pci = &self.info.pci;
        let mut a = self.admin.lock().expect("admin lock");
        let cid = a.next_cid;
        a.next_cid = a.next_cid.wrapping_add(1);
        let mut sqe = sqe;
        sqe.0[0] = (sqe.0[0] & 0xffff) | u32::from(cid) << 16;
        let slot = ADMIN_SQ + usize::from(a.tail) * 64;
        for (i, w) in sqe.0.iter().enumerate() {
            a.mem.write32(slot + 4 * i, *w);
        }
        a.tail = (a.tail + 1) % ADMIN_DEPTH;
        // The entry is in memory before the controller hears of it.
        fence(Ordering::SeqCst);
        self.bar.write32(DOORBELLS, u32::from(a.tail));
        let cqe = ADMIN_CQ + usize::from(a.head) * 16;
        let phase = a.phase;
        let arrived = wait_for(self.info.ready_timeout.max(Duration::from_secs(5)), || {
            (a.mem.read32(cqe + 12) >> 16 & 1 == 1) == phase
        });
        if !arrived {
            return Err(format!(
                "{pci}: {what}: no completion within the admin timeout"
            ));
        }
        fence(Ordering::Acquire);
        let dw0 = a.mem.read32(cqe);
        let dw3 = a.mem.read32(cqe + 12);
        a.head = (a.head + 1) % ADMIN_DEPTH;
        if a.head == 0 {
            a.phase = !a.phase;
        }
        self.bar
            .write32(DOORBELLS + self.info.doorbell_stride, u32::from(a.head));
        let status = Status((dw3 >> 17) as u16);
        if !status.is_success() {
            return Err(format!("{pci}: {what}: {status}"));
        }
        Ok(dw0)
    }

    fn fence(&self) {
        if self.fenced.swap(true, Ordering::AcqRel) {
            return;
        }
        let dev = self.dev.lock().expect("device lock");
        if let Err(e) = disable(&self.bar, self.info.ready_timeout) {
            tracing::warn!(pci = %self.info.pci, "{e}; resetting the function");
            if let Err(e) = dev.reset() {
                tracing::error!(pci = %self.info.pci, "function reset failed: {e}");
            }
        }
        if let Err(e) = dev.set_bus_master(false) {
            tracing::error!(pci = %self.info.pci, "turning bus mastering off failed: {e}");
        }
    }

    /// A normal shutdown (CC.SHN), so a drive with a volatile cache writes it back; bounded
    /// by CAP.TO.
    fn shutdown_notify(&self) {
        let cc = self.bar.read32(REG_CC);
        if cc & CC_EN == 0 {
            return;
        }
        self.bar.write32(REG_CC, cc | CC_SHN_NORMAL);
        let done = wait_for(self.info.ready_timeout, || {
            self.bar.read32(REG_CSTS) & CSTS_SHST_MASK == CSTS_SHST_DONE
        });
        if !done {
            tracing::warn!(pci = %self.info.pci, "shutdown notification not acknowledged within CAP.TO");
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if !self.fenced.load(Ordering::Acquire) {
            self.shutdown_notify();
        }
        self.fence();
        // Only now, with no DMA possible, do the mappings go, then the memory behind them.
        let dev = self.dev.get_mut().expect("device lock");
        let iovas: Vec<u64> = dev.mappings().iter().map(|m| m.iova).collect();
        for iova in iovas {
            if let Err(e) = dev.unmap_dma(iova) {
                tracing::error!(pci = %self.info.pci, "{e}");
            }
        }
        self.dma.get_mut().expect("dma lock").clear();
        self.regions.get_mut().expect("regions lock").clear();
    }
}

#[cfg(test)]
mod tests {
    use super::dbbuf_need_event;

    #[test]
    fn a_shadow_doorbell_rings_the_register_only_past_the_event_index() {
        // The controller saw tail 5 (EventIdx 5): moving 5 -> 6 passes it.
        assert!(dbbuf_need_event(5, 6, 5));
        // It asked to hear at 9: moving 5 -> 7 does not reach it, 5 -> 10 passes it.
        assert!(!dbbuf_need_event(9, 7, 5));
        assert!(dbbuf_need_event(9, 10, 5));
        // Across the wrap of the 16-bit index.
        assert!(dbbuf_need_event(0xffff, 1, 0xfffe));
        assert!(!dbbuf_need_event(3, 1, 0xfffe));
        // No movement never rings.
        assert!(!dbbuf_need_event(5, 5, 5));
    }
}
