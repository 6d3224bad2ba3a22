//! A simulated device for tests: in-memory disks behind the same [`IoBackend`] interface as the
//! ring, with faults drawn from a seed.
//!
//! Faults: EIO, ENOSPC, short reads and writes, torn writes (part of the data lands, the write
//! fails), reads that deliver a flipped bit, completion delays measured in submit rounds, and
//! reordering of completions. A crash
//! is modelled by [`SimStorage::crash_after_writes`]: after N more writes, every write tears and
//! fails, as if power went out with them in flight; reopening a new engine on the same storage
//! (after [`SimStorage::restart`]) then sees exactly what had landed. Data moves at completion
//! time, so a read never sees a write that has not completed, and a reordered completion is a
//! reordered effect. Every pushed request is logged, in push order, for scheduling tests.
//!
//! Durability: with [`SimStorage::track_durability`] every completed write is journaled as
//! not yet durable (the slab never syncs, so nothing after open is); [`SimStorage::power_loss`]
//! then keeps, drops, tears or misdirects each of them, drawn from a seed, as a device's
//! volatile cache may at power loss. [`cluster`] steps workers on these devices from one thread,
//! so a seed replays the schedule too.
//!
//! Set `KVTIER_SIM_SEED` to replay a failing seed; [`seed_from_env`] prints the seed in use.

pub mod cluster;
pub mod files;
pub mod object_store;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::config::{DeviceConfig, DirectIo};
use crate::error::{Error, Result};
use crate::io::{
    BackendSettings, BufRef, Completion, DeviceInfo, EventFd, IoBackend, IoClass, IoKind,
    IoRequest, Region, Storage,
};
use crate::Errno;

/// Fault rates, in parts per million of I/Os, and timing.
#[derive(Clone, Copy, Debug, Default)]
pub struct Faults {
    pub eio_ppm: u32,
    pub enospc_ppm: u32,
    pub short_ppm: u32,
    pub torn_write_ppm: u32,
    /// A read that succeeds delivers one bit flipped (the device's copy is intact: a
    /// transient error on the way, which only a checksum on every load catches).
    pub read_flip_ppm: u32,
    /// Completions are delayed by up to this many submit rounds.
    pub max_delay_rounds: u32,
    /// Completions available together are returned in random order.
    pub reorder: bool,
    /// Faults apply to data I/O only (not to the slot table), if true.
    pub data_only: bool,
}

/// One pushed request, as the device saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogEntry {
    pub worker: usize,
    pub kind: IoKind,
    pub class: IoClass,
    pub device: u16,
    pub offset: u64,
    pub len: u32,
}

/// Deterministic 64-bit generator (splitmix64).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    fn hit(&mut self, ppm: u32) -> bool {
        ppm > 0 && self.below(1_000_000) < u64::from(ppm)
    }
}

/// The seed for a simulation test: `KVTIER_SIM_SEED` if set, else time-based. Printed, so a
/// failing test's output says how to replay it.
pub fn seed_from_env() -> u64 {
    let seed = std::env::var("KVTIER_SIM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    println!("sim seed = {seed} (replay with KVTIER_SIM_SEED={seed})");
    seed
}

struct Disk {
    bytes: Mutex<Vec<u8>>,
}

/// In-memory devices shared by every worker's simulated backend.
pub struct SimStorage {
    state: Arc<State>,
}

struct State {
    seed: u64,
    align_bytes: u64,
    disks: Vec<Disk>,
    faults: Mutex<Faults>,
    /// Writes left before the simulated crash; `u64::MAX` = no crash planned.
    writes_until_crash: AtomicU64,
    crashed: AtomicBool,
    paused: AtomicBool,
    /// Devices (bit i = device i) that accept requests and never complete them.
    hung: AtomicU64,
    /// Devices (bit i = device i) that answer every request with EIO.
    failing: AtomicU64,
    log: Mutex<Vec<LogEntry>>,
    log_enabled: AtomicBool,
    /// Completed writes not yet durable, oldest first (`None`: not tracking).
    journal: Mutex<Option<Vec<Undo>>>,
    /// Reads delivered with a flipped bit (`Faults::read_flip_ppm`).
    read_flips: AtomicU64,
}

/// A completed write not yet durable: where it went and the bytes it replaced.
struct Undo {
    dev: usize,
    offset: u64,
    old: Vec<u8>,
}

/// What [`SimStorage::power_loss`] did with the writes that were not durable.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PowerLoss {
    pub kept: u64,
    pub dropped: u64,
    pub torn: u64,
    pub misdirected: u64,
}

impl SimStorage {
    /// Disks of the given sizes, zero-filled, with no faults.
    pub fn new(seed: u64, sizes_bytes: &[u64]) -> Arc<SimStorage> {
        Arc::new(SimStorage {
            state: Arc::new(State {
                seed,
                align_bytes: 4096,
                disks: sizes_bytes
                    .iter()
                    .map(|&n| Disk {
                        bytes: Mutex::new(vec![0; n as usize]),
                    })
                    .collect(),
                faults: Mutex::new(Faults::default()),
                writes_until_crash: AtomicU64::new(u64::MAX),
                crashed: AtomicBool::new(false),
                paused: AtomicBool::new(false),
                hung: AtomicU64::new(0),
                failing: AtomicU64::new(0),
                log: Mutex::new(Vec::new()),
                log_enabled: AtomicBool::new(false),
                journal: Mutex::new(None),
                read_flips: AtomicU64::new(0),
            }),
        })
    }

    pub fn set_faults(&self, faults: Faults) {
        *self
            .state
            .faults
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = faults;
    }

    /// Reads delivered with a flipped bit so far.
    pub fn read_flips(&self) -> u64 {
        self.state.read_flips.load(Ordering::SeqCst)
    }

    /// Makes `device` stop answering (`true`: requests are accepted and never complete) or
    /// answer again (its held requests then complete, in order).
    pub fn hang_device(&self, device: usize, hung: bool) {
        let bit = 1u64 << device;
        if hung {
            self.state.hung.fetch_or(bit, Ordering::SeqCst);
        } else {
            self.state.hung.fetch_and(!bit, Ordering::SeqCst);
        }
    }

    /// Makes `device` answer every request (data and slot table) with EIO, or work again.
    pub fn fail_device(&self, device: usize, failing: bool) {
        let bit = 1u64 << device;
        if failing {
            self.state.failing.fetch_or(bit, Ordering::SeqCst);
        } else {
            self.state.failing.fetch_and(!bit, Ordering::SeqCst);
        }
    }

    /// After `n` more writes complete normally, every write tears and fails.
    pub fn crash_after_writes(&self, n: u64) {
        self.state.writes_until_crash.store(n, Ordering::SeqCst);
    }

    pub fn crashed(&self) -> bool {
        self.state.crashed.load(Ordering::SeqCst)
    }

    /// Clears the crash and the faults: the disks keep whatever landed.
    pub fn restart(&self) {
        self.state.crashed.store(false, Ordering::SeqCst);
        self.state
            .writes_until_crash
            .store(u64::MAX, Ordering::SeqCst);
        self.set_faults(Faults::default());
    }

    /// Starts (or stops) journaling completed writes as not yet durable; see
    /// [`SimStorage::power_loss`].
    pub fn track_durability(&self, on: bool) {
        *self
            .state
            .journal
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = on.then(Vec::new);
    }

    /// Power goes out: every journaled write is, drawn from `seed`, kept (45 %), dropped (30 %:
    /// its old bytes come back), torn (20 %: a random run of its sectors reverts) or misdirected
    /// (5 %: it reverts where it was aimed and lands at another sector of the same disk).
    /// Undone newest first, so a write dropped under a later kept one may take part of that one
    /// with it: harsher than a real cache, never kinder. The journal is cleared.
    pub fn power_loss(&self, seed: u64) -> PowerLoss {
        let journal = self
            .state
            .journal
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default();
        let mut rng = Rng::new(seed);
        let mut out = PowerLoss::default();
        for undo in journal.into_iter().rev() {
            let mut d = self.state.disks[undo.dev]
                .bytes
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let start = undo.offset as usize;
            let len = undo.old.len();
            let sectors = (len / 512).max(1);
            match rng.below(100) {
                0..45 => out.kept += 1,
                45..75 => {
                    d[start..start + len].copy_from_slice(&undo.old);
                    out.dropped += 1;
                }
                75..95 => {
                    let a = rng.below(sectors as u64) as usize * 512;
                    let b =
                        (a + (rng.below((sectors - a / 512) as u64) as usize + 1) * 512).min(len);
                    d[start + a..start + b].copy_from_slice(&undo.old[a..b]);
                    out.torn += 1;
                }
                _ => {
                    let new = d[start..start + len].to_vec();
                    d[start..start + len].copy_from_slice(&undo.old);
                    let slots = (d.len() - len) / 512;
                    let to = rng.below(slots as u64 + 1) as usize * 512;
                    d[to..to + len].copy_from_slice(&new);
                    out.misdirected += 1;
                }
            }
        }
        out
    }

    /// While paused, no I/O completes (requests are still accepted and logged).
    pub fn pause(&self, on: bool) {
        self.state.paused.store(on, Ordering::SeqCst);
    }

    /// Starts (or stops) recording pushed requests; `take_log` returns them in push order.
    pub fn record(&self, on: bool) {
        self.state.log_enabled.store(on, Ordering::SeqCst);
    }

    pub fn take_log(&self) -> Vec<LogEntry> {
        std::mem::take(
            &mut *self
                .state
                .log
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    /// Puts entries back at the front of the log (to peek without consuming).
    pub fn restore_log(&self, entries: &[LogEntry]) {
        let mut log = self
            .state
            .log
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let rest = std::mem::take(&mut *log);
        log.extend_from_slice(entries);
        log.extend(rest);
    }

    /// Flips every byte in `[offset, offset + len)` of disk `dev` (silent corruption).
    pub fn corrupt(&self, dev: usize, offset: u64, len: usize) {
        let mut d = self.state.disks[dev]
            .bytes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for b in &mut d[offset as usize..offset as usize + len] {
            *b ^= 0xff;
        }
    }

    pub fn read_raw(&self, dev: usize, offset: u64, len: usize) -> Vec<u8> {
        let d = self.state.disks[dev]
            .bytes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        d[offset as usize..offset as usize + len].to_vec()
    }

    pub fn write_raw(&self, dev: usize, offset: u64, data: &[u8]) {
        let mut d = self.state.disks[dev]
            .bytes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        d[offset as usize..offset as usize + data.len()].copy_from_slice(data);
    }

    fn copy(
        &self,
        dev: usize,
        kind: IoKind,
        offset: u64,
        region: &Region,
        buf: BufRef,
        len: usize,
    ) {
        self.state.copy(dev, kind, offset, region, buf, len);
    }
}

impl State {
    fn copy(
        &self,
        dev: usize,
        kind: IoKind,
        offset: u64,
        region: &Region,
        buf: BufRef,
        len: usize,
    ) {
        let mut d = self.disks[dev]
            .bytes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let range = offset as usize..offset as usize + len;
        match kind {
            IoKind::Read => region.write(buf.offset, &d[range]),
            IoKind::Write => {
                if let Some(journal) = self
                    .journal
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .as_mut()
                {
                    journal.push(Undo {
                        dev,
                        offset,
                        old: d[range.clone()].to_vec(),
                    });
                }
                region.read(buf.offset, &mut d[range]);
            }
        }
    }
}

impl Storage for SimStorage {
    fn guards_region(&self) -> bool {
        false
    }

    fn open_device(
        &self,
        index: usize,
        cfg: &DeviceConfig,
        direct: DirectIo,
    ) -> Result<DeviceInfo> {
        let disk = self.state.disks.get(index).ok_or_else(|| {
            Error::device(
                &cfg.path,
                format!("the simulation has {} disks", self.state.disks.len()),
            )
        })?;
        let size = disk
            .bytes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len() as u64;
        Ok(DeviceInfo {
            path: cfg.path.clone(),
            size_bytes: size,
            align_bytes: self.state.align_bytes,
            direct: direct != DirectIo::Off,
            fresh: false,
            kind: "sim",
        })
    }

    fn read_sync(
        &self,
        device: usize,
        offset: u64,
        buf: &Region,
        buf_offset: usize,
        len: usize,
    ) -> Result<()> {
        let b = BufRef {
            region: 0,
            offset: buf_offset,
            len: len as u32,
        };
        self.copy(device, IoKind::Read, offset, buf, b, len);
        Ok(())
    }

    fn write_sync(
        &self,
        device: usize,
        offset: u64,
        buf: &Region,
        buf_offset: usize,
        len: usize,
    ) -> Result<()> {
        let b = BufRef {
            region: 0,
            offset: buf_offset,
            len: len as u32,
        };
        self.copy(device, IoKind::Write, offset, buf, b, len);
        Ok(())
    }

    fn backend(
        &self,
        worker: usize,
        buffers: Vec<Arc<Region>>,
        wake: Arc<EventFd>,
        settings: &BackendSettings,
    ) -> Result<Box<dyn IoBackend>> {
        Ok(Box::new(SimBackend {
            state: Arc::clone(&self.state),
            worker,
            buffers,
            wake,
            rng: Rng::new(self.state.seed ^ (worker as u64).wrapping_mul(0xA24B_AED4_963E_E407)),
            queued: Vec::new(),
            pending: Vec::new(),
            round: 0,
            sq_entries: settings.ring_entries as usize,
        }))
    }
}

struct Pending {
    req: IoRequest,
    due: u64,
}

struct SimBackend {
    state: Arc<State>,
    worker: usize,
    buffers: Vec<Arc<Region>>,
    wake: Arc<EventFd>,
    rng: Rng,
    queued: Vec<IoRequest>,
    pending: Vec<Pending>,
    round: u64,
    sq_entries: usize,
}

impl SimBackend {
    fn faults(&self) -> Faults {
        *self
            .state
            .faults
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Performs the request's data movement and decides its result.
    fn execute(&mut self, req: &IoRequest) -> i32 {
        let f = self.faults();
        let len = req.buf.len as usize;
        let region = Arc::clone(&self.buffers[req.buf.region as usize]);
        let dev = req.device as usize;
        let faulty = !(f.data_only && req.class == IoClass::Meta);
        if self.state.failing.load(Ordering::SeqCst) & (1u64 << dev) != 0 {
            return -(Errno::EIO as i32);
        }
        if req.kind == IoKind::Write {
            if self.state.crashed.load(Ordering::SeqCst) {
                return self.tear(req, &region);
            }
            let left = self.state.writes_until_crash.load(Ordering::SeqCst);
            if left != u64::MAX {
                if left == 0 {
                    self.state.crashed.store(true, Ordering::SeqCst);
                    return self.tear(req, &region);
                }
                self.state
                    .writes_until_crash
                    .store(left - 1, Ordering::SeqCst);
            }
        }
        if faulty {
            if self.rng.hit(f.eio_ppm) {
                return -(Errno::EIO as i32);
            }
            if req.kind == IoKind::Write && self.rng.hit(f.enospc_ppm) {
                return -(Errno::ENOSPC as i32);
            }
            if req.kind == IoKind::Write && self.rng.hit(f.torn_write_ppm) {
                return self.tear(req, &region);
            }
            if len > 512 && self.rng.hit(f.short_ppm) {
                let short = (self.rng.below(len as u64 / 512) * 512) as usize;
                self.state
                    .copy(dev, req.kind, req.offset, &region, req.buf, short);
                return i32::try_from(short).expect("I/O sizes fit i32");
            }
        }
        self.state
            .copy(dev, req.kind, req.offset, &region, req.buf, len);
        if faulty && req.kind == IoKind::Read && len > 0 && self.rng.hit(f.read_flip_ppm) {
            let at = req.buf.offset + self.rng.below(len as u64) as usize;
            let mut byte = [0u8];
            region.read(at, &mut byte);
            byte[0] ^= 1 << self.rng.below(8);
            region.write(at, &byte);
            self.state.read_flips.fetch_add(1, Ordering::SeqCst);
        }
        i32::try_from(len).expect("I/O sizes fit i32")
    }

    /// Lands a random prefix of a write (in 512-byte sectors) and fails it.
    fn tear(&mut self, req: &IoRequest, region: &Region) -> i32 {
        let sectors = u64::from(req.buf.len) / 512;
        let landed = (self.rng.below(sectors + 1) * 512) as usize;
        self.state.copy(
            req.device as usize,
            IoKind::Write,
            req.offset,
            region,
            req.buf,
            landed,
        );
        -(Errno::EIO as i32)
    }
}

impl IoBackend for SimBackend {
    fn push(&mut self, req: &IoRequest) -> bool {
        if self.queued.len() + self.pending.len() >= self.sq_entries * 2 {
            return false;
        }
        let r = &self.buffers[req.buf.region as usize];
        assert!(
            req.buf.offset + req.buf.len as usize <= r.len(),
            "request outside its buffer"
        );
        if self.state.log_enabled.load(Ordering::SeqCst) {
            self.state
                .log
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(LogEntry {
                    worker: self.worker,
                    kind: req.kind,
                    class: req.class,
                    device: req.device,
                    offset: req.offset,
                    len: req.buf.len,
                });
        }
        self.queued.push(*req);
        true
    }

    fn submit(&mut self, wait: bool) -> std::io::Result<()> {
        self.round += 1;
        let max_delay = u64::from(self.faults().max_delay_rounds);
        for req in self.queued.drain(..) {
            let delay = if max_delay == 0 {
                0
            } else {
                self.rng.below(max_delay + 1)
            };
            self.pending.push(Pending {
                req,
                due: self.round + delay,
            });
        }
        if !wait {
            return Ok(());
        }
        let hung = self.state.hung.load(Ordering::SeqCst);
        let all_hung = self
            .pending
            .iter()
            .all(|p| hung & (1u64 << p.req.device) != 0);
        if self.state.paused.load(Ordering::SeqCst) || all_hung {
            // Nothing can complete: sleep until woken (bounded, so pause can be lifted).
            self.wake
                .wait_timeout(Duration::from_millis(if self.pending.is_empty() {
                    100
                } else {
                    1
                }));
            return Ok(());
        }
        // Waiting: jump time to the earliest due completion.
        let earliest = self
            .pending
            .iter()
            .filter(|p| hung & (1u64 << p.req.device) == 0)
            .map(|p| p.due)
            .min()
            .unwrap_or(self.round);
        self.round = self.round.max(earliest);
        Ok(())
    }

    fn complete(&mut self, out: &mut Vec<Completion>) {
        if self.state.paused.load(Ordering::SeqCst) {
            return;
        }
        let f = self.faults();
        let round = self.round;
        let hung = self.state.hung.load(Ordering::SeqCst);
        let (ready, rest): (Vec<Pending>, Vec<Pending>) = self
            .pending
            .drain(..)
            .partition(|p| p.due <= round && hung & (1u64 << p.req.device) == 0);
        self.pending = rest;
        let mut ready: Vec<IoRequest> = ready.into_iter().map(|p| p.req).collect();
        if f.reorder {
            for i in (1..ready.len()).rev() {
                let j = self.rng.below(i as u64 + 1) as usize;
                ready.swap(i, j);
            }
        }
        for req in ready {
            let result = self.execute(&req);
            out.push(Completion {
                user_data: req.user_data,
                result,
            });
        }
    }

    fn in_flight(&self) -> usize {
        self.queued.len() + self.pending.len()
    }

    fn describe(&self) -> String {
        format!("sim (seed {})", self.state.seed)
    }
}
