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
//! volatile cache may at power loss. `backend` is one worker's queue to these devices.
//!
//! Beside it: [`files`], the files layout's operations on a scratch directory with the same
//! faults and a durability journal of its own, and [`object_store`], a simulated cold tier.
//! [`cluster`] steps workers on either, and the object store, from one thread, so a seed
//! replays the schedule too.
//!
//! Set `KVTIER_SIM_SEED` to replay a failing seed; [`seed_from_env`] prints the seed in use.

mod backend;
pub mod cluster;
pub mod files;
pub mod object_store;
#[cfg(test)]
pub(crate) mod scenario;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::config::{DeviceConfig, DirectIo};
use crate::error::{Error, Result};
use crate::io::{
    BackendSettings, EventFd, IoBackend, IoBuf, IoClass, IoKind, OpenedDevice, Region, Storage,
};
use backend::SimBackend;

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

thread_local! {
    /// The trace of the simulation running on this thread ([`trace`]).
    static TRACE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Folds `values` into this thread's trace: what a stepped simulation does, in order (the
/// worker drawn and whether it moved, every request pushed and every completion with its
/// result, every job result). Two runs of one seed have equal traces ([`take_trace`]) or did
/// not replay. Threads of a real engine on simulated devices fold into their own, unread.
pub(crate) fn trace(values: &[u64]) {
    TRACE.with(|t| {
        let mut h = t.get();
        for &v in values {
            // FNV-1a's multiply over whole words, then a finaliser's mix: order-sensitive.
            h = (h ^ v).wrapping_mul(0x0000_0100_0000_01B3);
            h ^= h >> 29;
        }
        t.set(h);
    });
}

/// This thread's trace since the last take, and a fresh one from here.
pub fn take_trace() -> u64 {
    TRACE.with(|t| t.replace(0))
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
    /// Whether the queue refuses slot-table page writes (as a ring full of other I/O would).
    meta_refused: AtomicBool,
    /// Whether backends can fence their devices (as a controller driven from user space can).
    fenceable: AtomicBool,
    /// Backend fences so far.
    fences: AtomicU64,
    log: Mutex<Vec<LogEntry>>,
    log_enabled: AtomicBool,
    /// Completed writes not yet durable, oldest first (`None`: not tracking).
    journal: Mutex<Option<Vec<Undo>>>,
    /// Reads delivered with a flipped bit (`Faults::read_flip_ppm`).
    read_flips: AtomicU64,
    /// Device copies that reached a region block no job held (see [`SimStorage::take_strays`]).
    strays: Strays,
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
                meta_refused: AtomicBool::new(false),
                fenceable: AtomicBool::new(false),
                fences: AtomicU64::new(0),
                log: Mutex::new(Vec::new()),
                log_enabled: AtomicBool::new(false),
                journal: Mutex::new(None),
                read_flips: AtomicU64::new(0),
                strays: Strays::default(),
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

    /// The device copies so far that reached a block of the region that no job's
    /// lease held: a load's bytes landing in a block handed back to the caller, or a store
    /// reading one. Each names the device, the direction and the block. The engine must never
    /// cause one: a job's blocks stay leased until its last I/O completes, even past its
    /// deadline.
    pub fn take_strays(&self) -> Vec<String> {
        self.state.strays.take()
    }

    /// Reads delivered with a flipped bit so far.
    pub fn read_flips(&self) -> u64 {
        self.state.read_flips.load(Ordering::SeqCst)
    }

    /// Lets the workers' queues fence their devices (`IoBackend::fence`: every request in
    /// flight, hung or not, completes with ECANCELED without touching memory, and the queue
    /// takes no more), as a controller driven from user space can be disabled; by default they
    /// cannot, as the kernel's ring cannot.
    pub fn set_fenceable(&self, fenceable: bool) {
        self.state.fenceable.store(fenceable, Ordering::SeqCst);
    }

    /// How many times a worker fenced its queue.
    pub fn fences(&self) -> u64 {
        self.state.fences.load(Ordering::SeqCst)
    }

    /// Makes every worker's queue refuse slot-table page writes (`true`: `push` answers "full"
    /// for them, as a ring full of I/O that does not complete would) or take them again.
    pub fn refuse_table_writes(&self, refused: bool) {
        self.state.meta_refused.store(refused, Ordering::SeqCst);
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

    /// Clears the crash and the faults, hung and failing devices included (a power cycle):
    /// the disks keep whatever landed.
    pub fn restart(&self) {
        self.state.crashed.store(false, Ordering::SeqCst);
        self.state.hung.store(0, Ordering::SeqCst);
        self.state.failing.store(0, Ordering::SeqCst);
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
}

/// Where a simulated transfer's bytes are: a request's claim (the device's own access), or a
/// region for the synchronous reads and writes while opening (through its accessors).
pub(crate) enum Memory<'a> {
    Claim(&'a IoBuf),
    Region(&'a Region, usize),
}

impl Memory<'_> {
    fn region(&self) -> &Region {
        match self {
            Memory::Claim(b) => b.region(),
            Memory::Region(r, _) => r,
        }
    }

    fn offset(&self) -> usize {
        match self {
            Memory::Claim(b) => b.offset(),
            Memory::Region(_, at) => *at,
        }
    }

    /// The device writes `src` at byte `at` of the transfer.
    pub(crate) fn land(&self, at: usize, src: &[u8]) {
        match self {
            Memory::Claim(b) => b.device_write(at, src),
            Memory::Region(r, off) => r.write(off + at, src),
        }
    }

    /// The device reads the transfer's bytes from `at` on into `dst`.
    pub(crate) fn fetch(&self, at: usize, dst: &mut [u8]) {
        match self {
            Memory::Claim(b) => b.device_read(at, dst),
            Memory::Region(r, off) => r.read(off + at, dst),
        }
    }
}

impl State {
    fn copy(&self, dev: usize, kind: IoKind, offset: u64, mem: &Memory<'_>, len: usize) {
        let mut d = self.disks[dev]
            .bytes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let range = offset as usize..offset as usize + len;
        if let Memory::Claim(_) = mem {
            self.strays
                .check(mem.region(), mem.offset(), len, kind, || {
                    format!("device {dev}")
                });
        }
        match kind {
            IoKind::Read => mem.land(0, &d[range]),
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
                mem.fetch(0, &mut d[range]);
            }
        }
    }
}

/// The simulated devices' transfers that reached a region block no job held: the engine hands
/// a block back to its caller only once no I/O can move its bytes any more.
#[derive(Default)]
pub(crate) struct Strays(Mutex<Vec<String>>);

impl Strays {
    /// Records the transfer of `len` bytes at `offset` of `region` (`kind`: a read lands
    /// there, a write reads there) if it reaches a block no lease holds; `who` names the
    /// device or file.
    pub(crate) fn check(
        &self,
        region: &Region,
        offset: usize,
        len: usize,
        kind: IoKind,
        who: impl FnOnce() -> String,
    ) {
        if let Some(block) = region.first_unheld(offset, len) {
            let what = match kind {
                IoKind::Read => "a read landed in",
                IoKind::Write => "a write read",
            };
            self.0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(format!(
                    "{}: {what} region block {block}, which no job held",
                    who()
                ));
        }
    }

    pub(crate) fn take(&self) -> Vec<String> {
        std::mem::take(
            &mut *self
                .0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }
}

impl Storage for SimStorage {
    fn open_device(
        &self,
        index: usize,
        cfg: &DeviceConfig,
        direct: DirectIo,
    ) -> Result<OpenedDevice> {
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
        Ok(OpenedDevice {
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
        let mem = Memory::Region(buf, buf_offset);
        self.state.copy(device, IoKind::Read, offset, &mem, len);
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
        let mem = Memory::Region(buf, buf_offset);
        self.state.copy(device, IoKind::Write, offset, &mem, len);
        Ok(())
    }

    fn backend(
        &self,
        worker: usize,
        buffers: Vec<Arc<Region>>,
        wake: Arc<EventFd>,
        settings: &BackendSettings,
    ) -> Result<Box<dyn IoBackend>> {
        Ok(Box::new(SimBackend::new(
            Arc::clone(&self.state),
            worker,
            buffers,
            wake,
            settings.ring_entries as usize,
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::HugePages;
    use crate::io::{BlockQueue, Completion, IoRequest};
    use std::sync::Arc;

    /// A simulated transfer moves bytes only under its claim, which keeps the job's blocks
    /// until the completion is returned, however early the job lets go of its lease.
    #[test]
    fn a_transfer_lands_in_its_claim_and_frees_it_at_its_completion() {
        let storage = SimStorage::new(1, &[1 << 20]);
        storage.write_raw(0, 8192, b"on the disk");
        let region = crate::region::allocate_blocks(4096, 4, HugePages::Off).expect("memory");
        region.guard_blocks(4096).expect("a block size");
        let wake = Arc::new(EventFd::new().expect("an eventfd"));
        let mut backend = SimBackend::new(
            Arc::clone(&storage.state),
            0,
            vec![Arc::clone(&region)],
            wake,
            8,
        );
        let load = Arc::new(region.lease(&[1], true).expect("free"));
        let req = IoRequest {
            user_data: 1,
            kind: IoKind::Read,
            device: 0,
            offset: 8192,
            region: 0,
            buf: load.checkout(4096, 4096, true).expect("held"),
            class: IoClass::Load,
        };
        assert!(backend.push(req));
        // The job gives up on it (a deadline): its blocks stay with the transfer.
        load.release();
        assert!(region.is_leased(1));
        let late = std::panic::catch_unwind(|| region.fill(4096, 16, 0xAB));
        assert!(late.is_err(), "the caller cannot reuse the block yet");
        backend.submit(true).expect("submit");
        let mut done: Vec<Completion> = Vec::new();
        backend.complete(&mut done);
        assert_eq!((done.len(), done[0].result), (1, 4096));
        assert!(!region.is_leased(1), "the completion let the block go");
        let mut got = [0u8; 11];
        region.read(4096, &mut got);
        assert_eq!(&got, b"on the disk");
        assert!(storage.take_strays().is_empty());
    }
}
