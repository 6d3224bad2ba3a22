//! A shard: one worker thread, pinned to one core, owning one I/O queue (ring), the index
//! entries of the keys that hash to it, and a page-aligned range of slots on every device.
//!
//! Nothing here takes a lock on the data path except the write side of the shard's published
//! key set (what `Engine::lookup` reads), touched once per stored or removed block.
//!
//! Scheduling (per loop turn): take new work from the channel into a load queue and a store
//! queue; reap completions; fill the ring with loads first (up to `load_inflight_max`); then
//! stores, in chunks of `store_chunk_bytes`, while the bytes of store I/O in flight stay under
//! `store_inflight_max` — or under `store_inflight_max_while_loading` while any load is queued or
//! in flight. One store chunk is always allowed when none is in flight, so stores never starve.
//! Table pages are written after the data they describe has completed.
//!
//! Invariants: an op's memory (a region block or a table page) is not reused before its
//! completion is reaped; a slot pinned by a load is never evicted or freed; the worker exits only
//! when no op is in flight.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Instant;

use crossbeam_channel::Receiver;

use crate::config::SchedulerConfig;
use crate::events::EventSink;
use crate::io::{BufRef, Completion, EventFd, IoBackend, IoClass, IoKind, IoRequest, Region};
use crate::job::{JobKind, JobState, KeyFailure, Shared};
use crate::key::{Key, KeyMap, KeySet};
use crate::metrics::ShardMetrics;
use crate::slab::{Entry, EntryRead, Geometry, ENTRIES_PER_PAGE, ENTRY_BYTES, TABLE_PAGE_BYTES};
use crate::Errno;

/// Buffer indexes in every backend: the primary region and this worker's table copy.
pub(crate) const BUF_REGION: u16 = 0;
pub(crate) const BUF_META: u16 = 1;
/// The demotion staging buffer (`s3.write = "on_evict"` only).
pub(crate) const BUF_STAGING: u16 = 2;

/// An evicted block read into a staging slot, handed to the S3 tier for upload. Dropping it
/// gives the staging slot back to its worker.
pub(crate) struct Demotion {
    pub key: Key,
    pub staging: Arc<Region>,
    pub offset: usize,
    pub len: usize,
    /// The crc32c kept with the block (slot table, or the files layout's xattr): checked before
    /// the upload, so a block corrupted on NVMe is never demoted. `None`: nothing to check.
    pub crc: Option<u32>,
    slot: u32,
    give_back: crossbeam_channel::Sender<u32>,
    /// The worker, woken when the slot comes back (a store may be waiting for it).
    worker: Arc<ShardShared>,
}

impl Drop for Demotion {
    fn drop(&mut self) {
        let _ = self.give_back.send(self.slot);
        self.worker.nudge();
    }
}

/// Where a worker hands demotions; set once the S3 tier is open.
pub(crate) type DemoteSink = Arc<std::sync::OnceLock<Box<dyn Fn(Demotion) + Send + Sync>>>;

/// A worker's demotion state: evicted blocks are read into staging slots before their NVMe
/// slot is reused.
pub(crate) struct Demote {
    pub staging: Arc<Region>,
    pub sink: DemoteSink,
    free: Vec<u32>,
    returned: crossbeam_channel::Receiver<u32>,
    give_back: crossbeam_channel::Sender<u32>,
    in_flight: usize,
    /// Staging slots handed to the S3 tier and not taken back yet.
    handed: usize,
}

impl Demote {
    pub fn new(staging: Arc<Region>, staging_blocks: usize, sink: DemoteSink) -> Demote {
        let (give_back, returned) = crossbeam_channel::unbounded();
        Demote {
            staging,
            sink,
            free: (0..staging_blocks as u32).rev().collect(),
            returned,
            give_back,
            in_flight: 0,
            handed: 0,
        }
    }

    pub(crate) fn take_staging(&mut self) -> Option<u32> {
        self.free.pop().or_else(|| {
            let s = self.returned.try_recv().ok()?;
            self.handed -= 1;
            Some(s)
        })
    }

    /// A staging slot taken but not used.
    pub(crate) fn put_back(&mut self, staging: u32) {
        self.free.push(staging);
    }

    /// A read into `staging` started.
    pub(crate) fn started(&mut self) {
        self.in_flight += 1;
    }

    /// The read into `staging` ended: hands the block to the S3 tier (`Some(key)`), or takes the
    /// staging slot back (`None`: the read failed, or the block must not be demoted).
    pub(crate) fn finished(
        &mut self,
        staging: u32,
        block_bytes: usize,
        demoted: Option<(Key, Option<u32>)>,
        worker: &Arc<ShardShared>,
    ) -> bool {
        self.in_flight -= 1;
        if let (Some((key, crc)), Some(sink)) = (demoted, self.sink.get()) {
            self.handed += 1;
            sink(Demotion {
                key,
                staging: Arc::clone(&self.staging),
                offset: staging as usize * block_bytes,
                len: block_bytes,
                crc,
                slot: staging,
                give_back: self.give_back.clone(),
                worker: Arc::clone(worker),
            });
            true
        } else {
            self.free.push(staging);
            false
        }
    }

    /// The staging slots' receiver, for the worker's sleep check.
    pub(crate) fn returned(&self) -> &crossbeam_channel::Receiver<u32> {
        &self.returned
    }

    /// Whether a staging slot will become free without this worker doing anything: read in
    /// flight, or handed to the S3 tier, which gives it back right after copying it out.
    pub(crate) fn will_free(&self) -> bool {
        self.in_flight > 0 || self.handed > 0
    }
}

/// Largest single read used while recovering the slot table.
const RECOVER_READ_BYTES: usize = 1 << 20;

/// Work for one shard: the indexes of the job's keys that hash to it.
pub(crate) struct Part {
    pub job: Arc<JobState>,
    pub items: Vec<u32>,
}

pub(crate) enum Msg {
    Work(Part),
    /// Mark these keys recently used (the caller served them from its own cache).
    Touch(Vec<Key>),
    Stop,
}

/// The parts of a shard that the engine handle sees.
pub(crate) struct ShardShared {
    pub published: RwLock<KeySet>,
    pub metrics: ShardMetrics,
    pub sleeping: AtomicBool,
    pub wake: Arc<EventFd>,
    pub queued_blocks: AtomicUsize,
    pub tid: AtomicI32,
}

impl ShardShared {
    pub fn new(wake: Arc<EventFd>) -> ShardShared {
        ShardShared {
            published: RwLock::new(KeySet::default()),
            metrics: ShardMetrics::default(),
            sleeping: AtomicBool::new(false),
            wake,
            queued_blocks: AtomicUsize::new(0),
            tid: AtomicI32::new(0),
        }
    }

    /// Wakes the worker if it is (about to be) asleep. Pairs with the fence in `Shard::run`.
    pub fn nudge(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::SeqCst) {
            self.wake.notify();
        }
    }
}

/// A device as one shard sees it.
pub(crate) struct DeviceSpec {
    pub geometry: Geometry,
    /// True if the device was just formatted: its table holds nothing to recover.
    pub fresh: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotState {
    Free,
    Writing,
    Valid,
    /// Dropped from the index (checksum failure) but still pinned by loads; freed at last unpin.
    Doomed,
}

#[derive(Clone, Copy)]
struct SlotMeta {
    state: SlotState,
    key: Option<Key>,
    pins: u16,
    referenced: bool,
    /// The data is known to match `crc` (written by this process, or checked once).
    verified: bool,
    crc: u32,
}

const FREE_SLOT: SlotMeta = SlotMeta {
    state: SlotState::Free,
    key: None,
    pins: 0,
    referenced: false,
    verified: true,
    crc: 0,
};

#[derive(Clone, Copy, Default)]
struct PageState {
    dirty: bool,
    /// Entries changed since the page was last written.
    dirty_entries: u16,
    in_flight: bool,
}

/// A dirty table page is written once this many of its entries changed, or as soon as the worker
/// runs out of work. Batching cuts the table writes of a sequential store stream from about one
/// per block to a few per page; the price is that a crash forgets up to this many recent blocks
/// of a page (they are re-fetched, never served wrong).
const TABLE_BATCH_ENTRIES: u16 = (ENTRIES_PER_PAGE / 2) as u16;

struct Dev {
    geometry: Geometry,
    /// First slot this shard owns; local slot `i` is device slot `first + i`.
    first: u64,
    slots: Vec<SlotMeta>,
    free: Vec<u32>,
    hand: usize,
    /// Byte offset of this device's table range in the meta buffer.
    meta_offset: usize,
    pages: Vec<PageState>,
}

impl Dev {
    fn first_page(&self) -> u64 {
        self.first / ENTRIES_PER_PAGE as u64
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OpKind {
    Load,
    Store,
    Table {
        page: u32,
    },
    Recover,
    /// Reading an evicted slot into staging slot `staging` (`op.dev`, `op.slot` name the slot).
    Demote {
        staging: u32,
    },
}

struct Op {
    kind: OpKind,
    job: Option<Arc<JobState>>,
    item: u32,
    dev: u16,
    slot: u32,
    block: u32,
    chunks_total: u16,
    chunks_issued: u16,
    chunks_done: u16,
    /// Bytes per write of a store (the last one may be shorter).
    chunk_bytes: u64,
    failure: Option<(KeyFailure, String)>,
    started: Instant,
}

impl Op {
    fn new(kind: OpKind) -> Op {
        Op {
            kind,
            job: None,
            item: 0,
            dev: 0,
            slot: 0,
            block: 0,
            chunks_total: 1,
            chunks_issued: 0,
            chunks_done: 0,
            chunk_bytes: 0,
            failure: None,
            started: Instant::now(),
        }
    }
}

impl TableOp for Op {
    fn clear(&mut self) {
        self.job = None;
    }
}

/// What a worker's op must offer its [`OpTable`].
pub(crate) trait TableOp {
    /// Drops what a finished op still holds (its job), so the job is freed when it is done
    /// rather than when the slot is reused.
    fn clear(&mut self);
}

/// A fixed table of in-flight ops addressed by index + generation (never by pointer), shared by
/// the slab and the files workers. `user_data` carries both, and a completion for a released or
/// reused slot is a bug caught by [`OpTable::decode`].
pub(crate) struct OpTable<T> {
    ops: Vec<T>,
    gens: Vec<u32>,
    live: Vec<bool>,
    free: Vec<u32>,
}

impl<T: TableOp> OpTable<T> {
    pub fn new(capacity: usize, make: impl FnMut() -> T) -> OpTable<T> {
        OpTable {
            ops: std::iter::repeat_with(make).take(capacity).collect(),
            gens: vec![0; capacity],
            live: vec![false; capacity],
            free: (0..capacity as u32).rev().collect(),
        }
    }

    /// Takes a free slot, puts `op` in it and returns its index; `None` when all are in use.
    pub fn alloc(&mut self, op: T) -> Option<u32> {
        let idx = self.free.pop()?;
        let i = idx as usize;
        debug_assert!(!self.live[i]);
        self.live[i] = true;
        self.gens[i] = self.gens[i].wrapping_add(1);
        self.ops[i] = op;
        Some(idx)
    }

    pub fn release(&mut self, idx: u32) {
        let i = idx as usize;
        assert!(self.live[i], "op {idx} released twice");
        self.live[i] = false;
        self.ops[i].clear();
        self.free.push(idx);
    }

    pub fn user_data(&self, idx: u32, chunk: u16) -> u64 {
        encode_user_data(idx, self.gens[idx as usize], chunk)
    }

    /// Decodes `user_data`, asserting that it names a live op of the current generation.
    pub fn decode(&self, user_data: u64) -> (u32, u16) {
        let (idx, chunk, gen) = decode_user_data(user_data);
        let i = idx as usize;
        assert!(
            self.live[i] && self.gens[i] == gen,
            "completion for a stale op {idx} gen {gen}"
        );
        (idx, chunk)
    }
}

impl<T> std::ops::Index<usize> for OpTable<T> {
    type Output = T;
    fn index(&self, i: usize) -> &T {
        &self.ops[i]
    }
}

impl<T> std::ops::IndexMut<usize> for OpTable<T> {
    fn index_mut(&mut self, i: usize) -> &mut T {
        &mut self.ops[i]
    }
}

/// An op's `user_data`: generation (32 bits) | chunk (8 bits) | table index (24 bits). Both
/// workers address in-flight ops this way, never by pointer.
pub(crate) fn encode_user_data(idx: u32, gen: u32, chunk: u16) -> u64 {
    debug_assert!(idx < 1 << 24 && chunk < 1 << 8);
    (u64::from(gen) << 32) | (u64::from(chunk) << 24) | u64::from(idx)
}

/// The inverse of [`encode_user_data`]: `(index, chunk, generation)`.
pub(crate) fn decode_user_data(user_data: u64) -> (u32, u16, u32) {
    (
        (user_data & 0xff_ffff) as u32,
        ((user_data >> 24) & 0xff) as u16,
        (user_data >> 32) as u32,
    )
}

/// A queue of parts with a cursor into the front one.
#[derive(Default)]
pub(crate) struct WorkQueue {
    pub parts: VecDeque<Part>,
    pub cursor: usize,
    /// Blocks not yet taken (mirrors the metrics gauge).
    pub blocks: usize,
}

impl WorkQueue {
    pub fn push(&mut self, part: Part) {
        self.blocks += part.items.len();
        self.parts.push_back(part);
    }

    pub fn peek(&self) -> Option<(&Arc<JobState>, usize)> {
        let part = self.parts.front()?;
        Some((&part.job, part.items[self.cursor] as usize))
    }

    /// Moves past the peeked item, which the worker has taken up, and gives back its queue room.
    pub fn take(&mut self, me: &ShardShared) {
        me.queued_blocks.fetch_sub(1, Ordering::AcqRel);
        self.cursor += 1;
        self.blocks -= 1;
        if let Some(part) = self.parts.front() {
            if self.cursor >= part.items.len() {
                self.parts.pop_front();
                self.cursor = 0;
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// Fails every block not yet taken with `KeyFailure::Shutdown`; returns how many.
    pub fn cancel(&mut self, shared: &Shared) -> usize {
        let cursor = self.cursor;
        let parts: Vec<Part> = self.parts.drain(..).collect();
        self.cursor = 0;
        self.blocks = 0;
        let mut n = 0;
        for (i, part) in parts.iter().enumerate() {
            let from = if i == 0 { cursor } else { 0 };
            for &item in &part.items[from..] {
                part.job
                    .fail(shared, item as usize, KeyFailure::Shutdown, String::new());
                n += 1;
            }
        }
        n
    }
}

/// What the worker reports once it has recovered its slots.
#[derive(Clone, Debug)]
pub(crate) struct Ready {
    pub backend: String,
    pub recovered_blocks: u64,
}

pub(crate) struct Shard {
    id: usize,
    workers: usize,
    backend: Box<dyn IoBackend>,
    region: Arc<Region>,
    meta: Arc<Region>,
    rx: Receiver<Msg>,
    shared: Arc<Shared>,
    me: Arc<ShardShared>,
    sched: SchedulerConfig,
    block_bytes: u64,
    chunk_bytes: u64,
    devs: Vec<Dev>,
    index: KeyMap<(u16, u32)>,
    ops: OpTable<Op>,
    loads: WorkQueue,
    stores: WorkQueue,
    /// Store ops with chunks still to issue, oldest first.
    store_issuing: VecDeque<u32>,
    dirty_pages: VecDeque<(u16, u32)>,
    loads_in_flight: usize,
    store_bytes_in_flight: u64,
    table_in_flight: usize,
    /// Store ops started and not finished.
    store_ops: usize,
    finalize: Vec<Finished>,
    finishing_block: u32,
    seq: u64,
    stopping: bool,
    completions: Vec<Completion>,
    scratch_entry: [u8; ENTRY_BYTES],
    error_logs: u32,
    demote: Option<Demote>,
}

/// Bytes of meta buffer a shard needs for its table ranges on `devices`.
pub(crate) fn meta_bytes(devices: &[DeviceSpec], shard: usize, workers: usize) -> usize {
    devices
        .iter()
        .map(|d| {
            let r = d.geometry.worker_slots(shard, workers);
            (r.end - r.start).div_ceil(ENTRIES_PER_PAGE as u64) as usize * TABLE_PAGE_BYTES
        })
        .sum::<usize>()
        .max(TABLE_PAGE_BYTES)
}

pub(crate) struct ShardParams {
    pub id: usize,
    pub workers: usize,
    pub backend: Box<dyn IoBackend>,
    pub region: Arc<Region>,
    pub meta: Arc<Region>,
    pub rx: Receiver<Msg>,
    pub shared: Arc<Shared>,
    pub me: Arc<ShardShared>,
    pub sched: SchedulerConfig,
    pub block_bytes: u64,
    pub ring_entries: usize,
    pub demote: Option<Demote>,
}

impl Shard {
    pub fn new(p: ShardParams, devices: &[DeviceSpec]) -> Shard {
        let mut devs = Vec::with_capacity(devices.len());
        let mut meta_offset = 0usize;
        let mut capacity = 0usize;
        for d in devices {
            let r = d.geometry.worker_slots(p.id, p.workers);
            let n = (r.end - r.start) as usize;
            let pages = n.div_ceil(ENTRIES_PER_PAGE);
            devs.push(Dev {
                geometry: d.geometry,
                first: r.start,
                slots: vec![FREE_SLOT; n],
                free: (0..n as u32).rev().collect(),
                hand: 0,
                meta_offset,
                pages: vec![PageState::default(); pages],
            });
            meta_offset += pages * TABLE_PAGE_BYTES;
            capacity += n;
        }
        // At most 255 chunks per block: the chunk number travels in 8 bits of user_data.
        let chunk_floor = p.block_bytes.div_ceil(255).div_ceil(4096) * 4096;
        let chunk_bytes = p
            .sched
            .store_chunk_bytes
            .max(chunk_floor)
            .min(p.block_bytes);
        let ops_capacity = p.ring_entries * 2 + p.sched.load_inflight_max + 64;
        let total_slots = capacity as u64;
        p.me.metrics
            .slots_total
            .store(total_slots, Ordering::Relaxed);
        let mut index = KeyMap::default();
        index.reserve(capacity);
        Shard {
            id: p.id,
            workers: p.workers,
            backend: p.backend,
            region: p.region,
            meta: p.meta,
            rx: p.rx,
            shared: p.shared,
            me: p.me,
            sched: p.sched,
            block_bytes: p.block_bytes,
            chunk_bytes,
            devs,
            index,
            ops: OpTable::new(ops_capacity, || Op::new(OpKind::Load)),
            loads: WorkQueue::default(),
            stores: WorkQueue::default(),
            store_issuing: VecDeque::new(),
            dirty_pages: VecDeque::new(),
            loads_in_flight: 0,
            store_bytes_in_flight: 0,
            table_in_flight: 0,
            store_ops: 0,
            finalize: Vec::with_capacity(p.ring_entries),
            finishing_block: 0,
            seq: 1,
            stopping: false,
            completions: Vec::with_capacity(p.ring_entries * 2),
            scratch_entry: [0; ENTRY_BYTES],
            error_logs: 0,
            demote: p.demote,
        }
    }

    // ---------------------------------------------------------------------------------------
    // Recovery

    /// Reads this shard's slot table ranges and rebuilds the index from them.
    pub fn recover(&mut self, devices: &[DeviceSpec]) -> Result<Ready, String> {
        let mut pending = 0usize;
        for (d, spec) in devices.iter().enumerate() {
            if spec.fresh || self.devs[d].slots.is_empty() {
                continue;
            }
            let dev = &self.devs[d];
            let total = dev.pages.len() * TABLE_PAGE_BYTES;
            let base = dev.geometry.table_page_offset(dev.first_page());
            let meta_offset = dev.meta_offset;
            let mut done = 0usize;
            while done < total {
                let len = (total - done).min(RECOVER_READ_BYTES);
                let idx = self
                    .ops
                    .alloc(Op::new(OpKind::Recover))
                    .ok_or("op table exhausted")?;
                self.ops[idx as usize].dev = d as u16;
                let req = IoRequest {
                    user_data: self.ops.user_data(idx, 0),
                    kind: IoKind::Read,
                    device: d as u16,
                    offset: base + done as u64,
                    buf: BufRef {
                        region: BUF_META,
                        offset: meta_offset + done,
                        len: len as u32,
                    },
                    class: IoClass::Meta,
                };
                while !self.backend.push(&req) {
                    self.backend.submit(true).map_err(|e| e.to_string())?;
                    pending -= self.reap_recover()?;
                }
                pending += 1;
                done += len;
            }
        }
        while pending > 0 {
            self.backend.submit(true).map_err(|e| e.to_string())?;
            pending -= self.reap_recover()?;
        }
        let mut recovered = 0u64;
        for d in 0..self.devs.len() {
            if !devices[d].fresh {
                recovered += self.rebuild_device(d, devices.len());
            }
        }
        let m = &self.me.metrics;
        m.recovered_blocks.store(recovered, Ordering::Relaxed);
        m.blocks_stored.store(recovered, Ordering::Relaxed);
        Ok(Ready {
            backend: self.backend.describe(),
            recovered_blocks: recovered,
        })
    }

    fn reap_recover(&mut self) -> Result<usize, String> {
        let mut out = std::mem::take(&mut self.completions);
        out.clear();
        self.backend.complete(&mut out);
        let mut n = 0;
        let mut err = None;
        for c in &out {
            let (idx, _) = self.ops.decode(c.user_data);
            if c.result < 0 {
                err = Some(format!(
                    "reading the slot table of device {}: {}",
                    self.ops[idx as usize].dev,
                    Errno::from_raw(-c.result).desc()
                ));
            }
            self.ops.release(idx);
            n += 1;
        }
        self.completions = out;
        err.map_or(Ok(n), Err)
    }

    fn rebuild_device(&mut self, d: usize, devices: usize) -> u64 {
        let mut recovered = 0;
        let mut raw = [0u8; ENTRY_BYTES];
        let n = self.devs[d].slots.len();
        let mut keep: Vec<(Key, u32, u64)> = Vec::new();
        for local in 0..n {
            let off = self.devs[d].meta_offset + local * ENTRY_BYTES;
            self.meta.read(off, &mut raw);
            match Entry::decode(&raw) {
                EntryRead::Empty => {}
                EntryRead::Torn => {
                    self.me.metrics.torn_entries.fetch_add(1, Ordering::Relaxed);
                    self.clear_entry(d, local as u32);
                }
                EntryRead::Valid(e) => {
                    let routed_here =
                        e.key.shard(self.workers) == self.id && e.key.device(devices) == d;
                    if !routed_here || u64::from(e.data_len) != self.block_bytes {
                        // Written under another worker or device count: this worker could
                        // never be asked for it, so the slot is reclaimed.
                        self.me
                            .metrics
                            .unroutable_entries
                            .fetch_add(1, Ordering::Relaxed);
                        self.clear_entry(d, local as u32);
                        continue;
                    }
                    self.seq = self.seq.max(e.seq + 1);
                    if let Some(&(od, os)) = self.index.get(&e.key) {
                        // Two entries for one key: keep the newer.
                        let old_seq = keep.iter().find(|k| k.0 == e.key).map_or(0, |k| k.2);
                        if old_seq >= e.seq {
                            self.clear_entry(d, local as u32);
                            continue;
                        }
                        self.drop_recovered(od as usize, os);
                        recovered -= 1;
                    }
                    let dev = &mut self.devs[d];
                    dev.slots[local] = SlotMeta {
                        state: SlotState::Valid,
                        key: Some(e.key),
                        pins: 0,
                        referenced: false,
                        verified: false,
                        crc: e.data_crc,
                    };
                    self.index.insert(e.key, (d as u16, local as u32));
                    keep.push((e.key, local as u32, e.seq));
                    recovered += 1;
                }
            }
        }
        let dev = &mut self.devs[d];
        dev.free = (0..n as u32)
            .rev()
            .filter(|&s| dev.slots[s as usize].state == SlotState::Free)
            .collect();
        let mut published = self
            .me
            .published
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for (key, _, _) in &keep {
            if self.index.contains_key(key) {
                published.insert(*key);
            }
        }
        recovered
    }

    fn drop_recovered(&mut self, d: usize, local: u32) {
        self.devs[d].slots[local as usize] = FREE_SLOT;
        self.clear_entry(d, local);
    }

    // ---------------------------------------------------------------------------------------
    // Main loop

    pub fn run(mut self) {
        loop {
            let mut progress = self.intake();
            progress |= self.reap();
            progress |= self.issue_loads();
            progress |= self.issue_stores();
            progress |= self.issue_table_writes();
            self.publish_gauges();
            if self.stopping && self.idle() {
                break;
            }
            let returned = self.demote.as_ref().map(Demote::returned);
            let r = submit_or_sleep(self.backend.as_mut(), &self.me, &self.rx, progress, || {
                returned.is_some_and(|r| !r.is_empty())
            });
            if !self.finalize.is_empty() {
                self.finalize_stores();
            }
            if let Err(e) = r {
                // The ring itself failed (not one I/O): nothing can be completed any more
                // without it, so log and keep reaping; a persistent failure is a bug.
                self.log_error(&format!("submit failed: {e}"));
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        self.publish_gauges();
    }

    fn idle(&self) -> bool {
        self.loads.is_empty()
            && self.stores.is_empty()
            && self.store_issuing.is_empty()
            && self.dirty_pages.is_empty()
            && self.finalize.is_empty()
            && self.backend.in_flight() == 0
    }

    fn publish_gauges(&self) {
        let m = &self.me.metrics;
        m.queued_loads
            .store(self.loads.blocks as u64, Ordering::Relaxed);
        m.queued_stores
            .store(self.stores.blocks as u64, Ordering::Relaxed);
        m.inflight_ops
            .store(self.backend.in_flight() as u64, Ordering::Relaxed);
    }

    fn intake(&mut self) -> bool {
        let mut any = false;
        while let Ok(msg) = self.rx.try_recv() {
            any = true;
            match msg {
                Msg::Work(part) => {
                    if self.stopping {
                        self.cancel_part(&part, 0);
                        continue;
                    }
                    match part.job.kind {
                        JobKind::Load => self.loads.push(part),
                        JobKind::Store => self.stores.push(part),
                    }
                }
                Msg::Touch(keys) => {
                    for key in keys {
                        if let Some(&(d, local)) = self.index.get(&key) {
                            self.devs[d as usize].slots[local as usize].referenced = true;
                        }
                    }
                }
                Msg::Stop => self.stop(),
            }
        }
        any
    }

    pub(crate) fn cancel_part(&self, part: &Part, from: usize) {
        for &item in &part.items[from..] {
            self.me.queued_blocks.fetch_sub(1, Ordering::AcqRel);
            part.job.fail(
                &self.shared,
                item as usize,
                KeyFailure::Shutdown,
                String::new(),
            );
        }
    }

    /// Fails everything queued and not yet started; in-flight I/O runs to completion.
    fn stop(&mut self) {
        self.stopping = true;
        let cancelled = self.loads.cancel(&self.shared) + self.stores.cancel(&self.shared);
        self.me.queued_blocks.fetch_sub(cancelled, Ordering::AcqRel);
        // Store ops with unissued chunks stop issuing; they fail once issued chunks complete.
        for i in 0..self.store_issuing.len() {
            let idx = self.store_issuing[i];
            let op = &mut self.ops[idx as usize];
            op.failure
                .get_or_insert((KeyFailure::Shutdown, String::new()));
            op.chunks_total = op.chunks_issued;
        }
        let issuing: Vec<u32> = self.store_issuing.drain(..).collect();
        for idx in issuing {
            let op = &self.ops[idx as usize];
            if op.chunks_done == op.chunks_issued {
                self.finish_store(idx);
            }
        }
    }

    // ---------------------------------------------------------------------------------------
    // Loads

    fn issue_loads(&mut self) -> bool {
        let mut any = false;
        while self.loads_in_flight < self.sched.load_inflight_max {
            let Some((job, item)) = self.loads.peek() else {
                break;
            };
            let job = Arc::clone(job);
            let key = job.job.keys[item];
            let block = job.job.blocks[item];
            let Some(&(d, local)) = self.index.get(&key) else {
                self.loads.take(&self.me);
                self.me.metrics.load_misses.fetch_add(1, Ordering::Relaxed);
                self.me.metrics.loads_failed.fetch_add(1, Ordering::Relaxed);
                self.shared.load_missed(&job, item, String::new());
                any = true;
                continue;
            };
            let slot = self.devs[d as usize].slots[local as usize];
            if slot.state != SlotState::Valid {
                self.loads.take(&self.me);
                self.me.metrics.loads_failed.fetch_add(1, Ordering::Relaxed);
                job.fail(&self.shared, item, KeyFailure::NotReady, String::new());
                any = true;
                continue;
            }
            let Some(idx) = self.ops.alloc(Op::new(OpKind::Load)) else {
                break;
            };
            let dev = &self.devs[d as usize];
            let req = IoRequest {
                user_data: self.ops.user_data(idx, 0),
                kind: IoKind::Read,
                device: d,
                offset: dev.geometry.slot_offset(dev.first + u64::from(local)),
                buf: self.block_buf(block),
                class: IoClass::Load,
            };
            if !self.backend.push(&req) {
                self.ops.release(idx);
                break;
            }
            let op = &mut self.ops[idx as usize];
            op.job = Some(job);
            op.item = item as u32;
            op.dev = d;
            op.slot = local;
            op.block = block;
            let s = &mut self.devs[d as usize].slots[local as usize];
            s.pins += 1;
            s.referenced = true;
            self.loads_in_flight += 1;
            self.loads.take(&self.me);
            any = true;
        }
        any
    }

    fn block_buf(&self, block: u32) -> BufRef {
        BufRef {
            region: BUF_REGION,
            offset: block as usize * self.block_bytes as usize,
            len: self.block_bytes as u32,
        }
    }

    fn on_load_done(&mut self, idx: u32, result: i32) {
        self.loads_in_flight -= 1;
        let op = &self.ops[idx as usize];
        let (d, local, block, item) = (
            op.dev as usize,
            op.slot as usize,
            op.block,
            op.item as usize,
        );
        let job = op.job.clone().expect("load op has a job");
        let latency = op.started.elapsed();
        let me = Arc::clone(&self.me);
        let m = &me.metrics;
        m.read_ops.fetch_add(1, Ordering::Relaxed);
        m.load_latency.record(latency.as_micros() as u64);
        let wanted = self.block_bytes as u32;
        let outcome = if result < 0 {
            m.io_errors.fetch_add(1, Ordering::Relaxed);
            Err((KeyFailure::Io(Errno::from_raw(-result)), String::new()))
        } else if (result as u32) < wanted {
            m.io_errors.fetch_add(1, Ordering::Relaxed);
            Err((
                KeyFailure::ShortIo {
                    done: result as u32,
                    wanted,
                },
                String::new(),
            ))
        } else {
            m.bytes_read.fetch_add(u64::from(wanted), Ordering::Relaxed);
            let slot = self.devs[d].slots[local];
            if slot.verified {
                Ok(())
            } else {
                let crc = region_crc(
                    &self.region,
                    block as usize * wanted as usize,
                    wanted as usize,
                );
                if crc == slot.crc {
                    self.devs[d].slots[local].verified = true;
                    Ok(())
                } else {
                    m.checksum_failures.fetch_add(1, Ordering::Relaxed);
                    self.doom_slot(d, local as u32);
                    Err((
                        KeyFailure::Checksum,
                        format!("stored crc {:08x}, read {crc:08x}", slot.crc),
                    ))
                }
            }
        };
        let s = &mut self.devs[d].slots[local];
        s.pins -= 1;
        if s.pins == 0 && s.state == SlotState::Doomed {
            self.free_slot(d, local as u32);
        }
        self.ops.release(idx);
        match outcome {
            Ok(()) => {
                m.loads_ok.fetch_add(1, Ordering::Relaxed);
                job.succeed(&self.shared, item, u64::from(wanted));
            }
            Err((reason, detail)) => {
                m.loads_failed.fetch_add(1, Ordering::Relaxed);
                job.fail(&self.shared, item, reason, detail);
            }
        }
    }

    /// Removes a bad block from the index now; its slot is freed when the last load unpins it.
    fn doom_slot(&mut self, d: usize, local: u32) {
        let s = &mut self.devs[d].slots[local as usize];
        if s.state != SlotState::Valid {
            return;
        }
        s.state = SlotState::Doomed;
        if let Some(key) = s.key {
            self.unindex(key);
            self.shared_events().push(vec![key], true);
        }
        self.me
            .metrics
            .blocks_stored
            .fetch_sub(1, Ordering::Relaxed);
        self.clear_entry(d, local);
    }

    fn shared_events(&self) -> &EventSink {
        &self.shared.events
    }

    // ---------------------------------------------------------------------------------------
    // Stores

    fn store_cap(&self) -> u64 {
        if self.loads_in_flight > 0 || !self.loads.is_empty() {
            self.sched.store_inflight_max_while_loading
        } else {
            self.sched.store_inflight_max
        }
    }

    fn issue_stores(&mut self) -> bool {
        let mut any = false;
        loop {
            let cap = self.store_cap();
            if self.store_bytes_in_flight > 0 && self.store_bytes_in_flight + self.chunk_bytes > cap
            {
                break;
            }
            let idx = match self.store_issuing.front() {
                Some(&idx) => idx,
                None => match self.start_store() {
                    StoreStart::Op(idx) => {
                        any = true;
                        idx
                    }
                    StoreStart::Resolved => {
                        any = true;
                        continue;
                    }
                    StoreStart::Blocked => break,
                },
            };
            if !self.issue_chunk(idx) {
                break;
            }
            any = true;
        }
        any
    }

    fn start_store(&mut self) -> StoreStart {
        let Some((job, item)) = self.stores.peek() else {
            return StoreStart::Blocked;
        };
        let job = Arc::clone(job);
        let key = job.job.keys[item];
        let block = job.job.blocks[item];
        if self.index.contains_key(&key) {
            // Already stored (or being stored): a cheap no-op success.
            self.stores.take(&self.me);
            self.me
                .metrics
                .stores_skipped_present
                .fetch_add(1, Ordering::Relaxed);
            job.succeed(&self.shared, item, 0);
            return StoreStart::Resolved;
        }
        let d = key.device(self.devs.len());
        let Some(local) = self.alloc_slot(d) else {
            if self.backend.in_flight() > self.table_in_flight
                || self.demote.as_ref().is_some_and(Demote::will_free)
            {
                // A completion may free or unpin a slot, or a demotion give back its staging.
                return StoreStart::Blocked;
            }
            self.stores.take(&self.me);
            self.me
                .metrics
                .stores_failed
                .fetch_add(1, Ordering::Relaxed);
            let detail = if self.devs[d].slots.is_empty() {
                // Slot-table pages (32 slots each) are split between workers: a small device
                // with many workers leaves some of them nothing.
                format!(
                    "device {d}: worker {} has no slots (a device's slots are shared out \
                     between workers in table pages of {} slots); raise the device's \
                     capacity_bytes or use fewer cores",
                    self.id,
                    crate::slab::ENTRIES_PER_PAGE
                )
            } else {
                format!(
                    "device {d}: all {} slots of worker {} are busy",
                    self.devs[d].slots.len(),
                    self.id
                )
            };
            job.fail(&self.shared, item, KeyFailure::NoSpace, detail);
            return StoreStart::Resolved;
        };
        let Some(idx) = self.ops.alloc(Op::new(OpKind::Store)) else {
            self.free_slot(d, local);
            return StoreStart::Blocked;
        };
        // The crc32c is computed after the write completes (see `finalize_stores`), off the
        // path from a completion to the next submission.
        let crc = 0;
        let s = &mut self.devs[d].slots[local as usize];
        *s = SlotMeta {
            state: SlotState::Writing,
            key: Some(key),
            pins: 0,
            referenced: true,
            verified: true,
            crc,
        };
        self.index.insert(key, (d as u16, local));
        let op = &mut self.ops[idx as usize];
        op.job = Some(job);
        op.item = item as u32;
        op.dev = d as u16;
        op.slot = local;
        op.block = block;
        // Split the write only if loads are waiting: then a load never queues behind a whole
        // large block. With no load around, one write per block is cheapest.
        let chunk = if self.loads_in_flight > 0 || !self.loads.is_empty() {
            self.chunk_bytes
        } else {
            self.block_bytes
        };
        op.chunk_bytes = chunk;
        op.chunks_total = self.block_bytes.div_ceil(chunk) as u16;
        self.stores.take(&self.me);
        self.store_issuing.push_back(idx);
        self.store_ops += 1;
        StoreStart::Op(idx)
    }

    /// Issues the next chunk of store op `idx`; false if the ring is full.
    fn issue_chunk(&mut self, idx: u32) -> bool {
        let op = &self.ops[idx as usize];
        let chunk = op.chunks_issued;
        let chunk_bytes = self.ops[idx as usize].chunk_bytes;
        let start = u64::from(chunk) * chunk_bytes;
        let len = chunk_bytes.min(self.block_bytes - start);
        let dev = &self.devs[op.dev as usize];
        let req = IoRequest {
            user_data: self.ops.user_data(idx, chunk),
            kind: IoKind::Write,
            device: op.dev,
            offset: dev.geometry.slot_offset(dev.first + u64::from(op.slot)) + start,
            buf: BufRef {
                region: BUF_REGION,
                offset: op.block as usize * self.block_bytes as usize + start as usize,
                len: len as u32,
            },
            class: IoClass::Store,
        };
        if !self.backend.push(&req) {
            return false;
        }
        let op = &mut self.ops[idx as usize];
        op.chunks_issued += 1;
        self.store_bytes_in_flight += len;
        if op.chunks_issued == op.chunks_total {
            let front = self.store_issuing.pop_front();
            debug_assert_eq!(front, Some(idx));
        }
        true
    }

    fn on_store_chunk_done(&mut self, idx: u32, chunk: u16, result: i32) {
        let chunk_bytes = self.ops[idx as usize].chunk_bytes;
        let start = u64::from(chunk) * chunk_bytes;
        let len = chunk_bytes.min(self.block_bytes - start);
        self.store_bytes_in_flight -= len;
        let m = &self.me.metrics;
        m.write_ops.fetch_add(1, Ordering::Relaxed);
        let failure = if result < 0 {
            m.io_errors.fetch_add(1, Ordering::Relaxed);
            Some((KeyFailure::Io(Errno::from_raw(-result)), String::new()))
        } else if (result as u64) < len {
            m.io_errors.fetch_add(1, Ordering::Relaxed);
            Some((
                KeyFailure::ShortIo {
                    done: result as u32,
                    wanted: len as u32,
                },
                String::new(),
            ))
        } else {
            m.bytes_written.fetch_add(len, Ordering::Relaxed);
            None
        };
        let op = &mut self.ops[idx as usize];
        op.chunks_done += 1;
        if let Some(f) = failure {
            if op.failure.is_none() {
                op.failure = Some(f);
            }
            // Stop issuing the rest of a failed block.
            if op.chunks_issued < op.chunks_total {
                op.chunks_total = op.chunks_issued;
                self.store_issuing.retain(|&i| i != idx);
            }
        }
        let op = &self.ops[idx as usize];
        if op.chunks_done == op.chunks_total && op.chunks_issued == op.chunks_total {
            self.finish_store(idx);
        }
    }

    fn finish_store(&mut self, idx: u32) {
        self.store_ops -= 1;
        let op = &self.ops[idx as usize];
        let (d, local, item) = (op.dev as usize, op.slot, op.item as usize);
        let job = op.job.clone().expect("store op has a job");
        let failure = op.failure.clone();
        self.finishing_block = op.block;
        self.me
            .metrics
            .store_latency
            .record(op.started.elapsed().as_micros() as u64);
        self.ops.release(idx);
        let key = self.devs[d].slots[local as usize]
            .key
            .expect("writing slot has a key");
        match failure {
            None => {
                let block = self.finishing_block;
                self.finalize.push(Finished {
                    d,
                    local,
                    item,
                    block,
                    job,
                });
            }
            Some((reason, detail)) => {
                self.index.remove(&key);
                self.free_slot(d, local);
                self.me
                    .metrics
                    .stores_failed
                    .fetch_add(1, Ordering::Relaxed);
                if let KeyFailure::Io(e) = reason {
                    self.log_error(&format!("store to device {d} failed: {}", e.desc()));
                }
                job.fail(&self.shared, item, reason, detail);
            }
        }
    }

    /// Publishes the stores whose data writes completed: checksum, slot table entry, index,
    /// result. Runs after the ring has been refilled and submitted, so the checksum work never
    /// delays the next I/O.
    fn finalize_stores(&mut self) {
        let finished = std::mem::take(&mut self.finalize);
        for f in &finished {
            let crc = region_crc(
                &self.region,
                f.block as usize * self.block_bytes as usize,
                self.block_bytes as usize,
            );
            let s = &mut self.devs[f.d].slots[f.local as usize];
            s.state = SlotState::Valid;
            s.crc = crc;
            let key = s.key.expect("writing slot has a key");
            self.me
                .published
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(key);
            let seq = self.seq;
            self.seq += 1;
            self.write_entry(
                f.d,
                f.local,
                Some(Entry {
                    seq,
                    data_len: self.block_bytes as u32,
                    data_crc: crc,
                    key,
                }),
            );
            self.me.metrics.stores_ok.fetch_add(1, Ordering::Relaxed);
            self.me
                .metrics
                .blocks_stored
                .fetch_add(1, Ordering::Relaxed);
            f.job.succeed(&self.shared, f.item, self.block_bytes);
        }
        self.finalize = finished;
        self.finalize.clear();
    }

    // ---------------------------------------------------------------------------------------
    // Slots and eviction

    fn alloc_slot(&mut self, d: usize) -> Option<u32> {
        if let Some(s) = self.devs[d].free.pop() {
            return Some(s);
        }
        if self.demote.is_some() {
            return self.demote_for_slot(d);
        }
        let victim = self.clock_victim(d)?;
        self.evict(d, victim);
        self.devs[d].free.pop()
    }

    /// With demotion: starts reading a victim into a staging slot and returns `None` (the store
    /// waits for that read, after which the slot is free). Without a staging slot and with no
    /// demotion in flight (the S3 tier has not copied earlier ones out yet), evicts without
    /// demoting, counted, so a slow object store never stalls NVMe stores.
    fn demote_for_slot(&mut self, d: usize) -> Option<u32> {
        let waiting = self.demote.as_ref().is_some_and(Demote::will_free);
        let staging = self.demote.as_mut().and_then(Demote::take_staging);
        let Some(staging) = staging else {
            if waiting {
                return None;
            }
            let victim = self.clock_victim(d)?;
            self.me
                .metrics
                .demotions_dropped
                .fetch_add(1, Ordering::Relaxed);
            self.evict(d, victim);
            return self.devs[d].free.pop();
        };
        let give_back = |me: &mut Shard| {
            if let Some(m) = me.demote.as_mut() {
                m.free.push(staging);
            }
        };
        let Some(victim) = self.clock_victim(d) else {
            give_back(self);
            return None;
        };
        let Some(idx) = self.ops.alloc(Op::new(OpKind::Demote { staging })) else {
            give_back(self);
            return None;
        };
        let dev = &self.devs[d];
        let req = IoRequest {
            user_data: self.ops.user_data(idx, 0),
            kind: IoKind::Read,
            device: d as u16,
            offset: dev.geometry.slot_offset(dev.first + u64::from(victim)),
            buf: BufRef {
                region: BUF_STAGING,
                offset: staging as usize * self.block_bytes as usize,
                len: self.block_bytes as u32,
            },
            class: IoClass::Store,
        };
        if !self.backend.push(&req) {
            self.ops.release(idx);
            give_back(self);
            return None;
        }
        let op = &mut self.ops[idx as usize];
        op.dev = d as u16;
        op.slot = victim;
        self.devs[d].slots[victim as usize].pins += 1;
        if let Some(m) = self.demote.as_mut() {
            m.started();
        }
        None
    }

    fn on_demote_done(&mut self, idx: u32, staging: u32, result: i32) {
        let op = &self.ops[idx as usize];
        let (d, local) = (op.dev as usize, op.slot);
        self.ops.release(idx);
        let slot = &mut self.devs[d].slots[local as usize];
        slot.pins -= 1;
        let read_ok = result == self.block_bytes as i32;
        let still_valid = slot.state == SlotState::Valid && slot.pins == 0;
        let demoted = slot
            .key
            .filter(|_| read_ok && still_valid)
            .map(|k| (k, Some(slot.crc)));
        let block_bytes = self.block_bytes as usize;
        let me = Arc::clone(&self.me);
        let Some(m) = self.demote.as_mut() else {
            return;
        };
        if m.finished(staging, block_bytes, demoted, &me) {
            self.me.metrics.demotions.fetch_add(1, Ordering::Relaxed);
        } else if !read_ok {
            self.me
                .metrics
                .demotions_dropped
                .fetch_add(1, Ordering::Relaxed);
            self.log_error(&format!(
                "reading evicted slot {local} of device {d} for demotion: {}",
                if result < 0 {
                    Errno::from_raw(-result).desc().to_owned()
                } else {
                    format!("{result} bytes")
                }
            ));
        }
        let slot = self.devs[d].slots[local as usize];
        if slot.state == SlotState::Valid && slot.pins == 0 {
            self.evict(d, local);
        }
    }

    /// CLOCK: the first valid, unpinned slot whose reference bit is clear, clearing bits on the way.
    fn clock_victim(&mut self, d: usize) -> Option<u32> {
        let dev = &mut self.devs[d];
        let n = dev.slots.len();
        for _ in 0..2 * n {
            dev.hand = (dev.hand + 1) % n;
            let s = &mut dev.slots[dev.hand];
            if s.state != SlotState::Valid || s.pins > 0 {
                continue;
            }
            if s.referenced {
                s.referenced = false;
                continue;
            }
            return Some(dev.hand as u32);
        }
        None
    }

    fn evict(&mut self, d: usize, local: u32) {
        let key = self.devs[d].slots[local as usize]
            .key
            .expect("valid slot has a key");
        self.unindex(key);
        self.clear_entry(d, local);
        self.free_slot(d, local);
        self.me.metrics.evictions.fetch_add(1, Ordering::Relaxed);
        self.me
            .metrics
            .blocks_stored
            .fetch_sub(1, Ordering::Relaxed);
        self.shared.events.push(vec![key], true);
    }

    fn unindex(&mut self, key: Key) {
        self.index.remove(&key);
        self.me
            .published
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&key);
    }

    fn free_slot(&mut self, d: usize, local: u32) {
        let dev = &mut self.devs[d];
        dev.slots[local as usize] = FREE_SLOT;
        dev.free.push(local);
    }

    // ---------------------------------------------------------------------------------------
    // Slot table

    fn clear_entry(&mut self, d: usize, local: u32) {
        self.write_entry(d, local, None);
    }

    fn write_entry(&mut self, d: usize, local: u32, entry: Option<Entry>) {
        match entry {
            Some(e) => e.encode(&mut self.scratch_entry),
            None => self.scratch_entry.fill(0),
        }
        let dev = &mut self.devs[d];
        self.meta.write(
            dev.meta_offset + local as usize * ENTRY_BYTES,
            &self.scratch_entry,
        );
        let page = local as usize / ENTRIES_PER_PAGE;
        let p = &mut dev.pages[page];
        p.dirty_entries = p.dirty_entries.saturating_add(1);
        if !p.dirty {
            p.dirty = true;
            if !p.in_flight {
                self.dirty_pages.push_back((d as u16, page as u32));
            }
        }
    }

    /// Writes the dirty table pages that are due: those with enough changed entries, or all of
    /// them once no store is queued or in flight (or the worker is stopping).
    fn issue_table_writes(&mut self) -> bool {
        // "Quiet" means the worker is about to run out of work: no queued jobs and no I/O in
        // flight. A queue-depth-bound store stream keeps I/O in flight, so its pages are
        // written at the batch threshold; the rest are written before the worker sleeps.
        let quiet = self.stopping
            || (self.stores.is_empty()
                && self.loads.is_empty()
                && self.store_issuing.is_empty()
                && self.store_ops == 0
                && self.backend.in_flight() == 0);
        let mut any = false;
        let mut i = 0;
        while i < self.dirty_pages.len() {
            let (d, page) = self.dirty_pages[i];
            if !quiet
                && self.devs[d as usize].pages[page as usize].dirty_entries < TABLE_BATCH_ENTRIES
            {
                i += 1;
                continue;
            }
            let Some(idx) = self.ops.alloc(Op::new(OpKind::Table { page })) else {
                break;
            };
            let dev = &self.devs[d as usize];
            let req = IoRequest {
                user_data: self.ops.user_data(idx, 0),
                kind: IoKind::Write,
                device: d,
                offset: dev
                    .geometry
                    .table_page_offset(dev.first_page() + u64::from(page)),
                buf: BufRef {
                    region: BUF_META,
                    offset: dev.meta_offset + page as usize * TABLE_PAGE_BYTES,
                    len: TABLE_PAGE_BYTES as u32,
                },
                class: IoClass::Meta,
            };
            if !self.backend.push(&req) {
                self.ops.release(idx);
                break;
            }
            self.ops[idx as usize].dev = d;
            self.dirty_pages.remove(i);
            let p = &mut self.devs[d as usize].pages[page as usize];
            p.dirty = false;
            p.dirty_entries = 0;
            p.in_flight = true;
            self.table_in_flight += 1;
            any = true;
        }
        any
    }

    fn on_table_done(&mut self, idx: u32, page: u32, result: i32) {
        let d = self.ops[idx as usize].dev;
        self.ops.release(idx);
        self.table_in_flight -= 1;
        self.me.metrics.table_writes.fetch_add(1, Ordering::Relaxed);
        if usize::try_from(result).ok() != Some(TABLE_PAGE_BYTES) {
            // The entries of this page may not survive a restart; the data is still served now.
            self.me.metrics.io_errors.fetch_add(1, Ordering::Relaxed);
            let why = if result < 0 {
                Errno::from_raw(-result).desc().to_string()
            } else {
                format!("short write {result}")
            };
            self.log_error(&format!("slot table write on device {d} failed: {why}"));
        }
        let p = &mut self.devs[d as usize].pages[page as usize];
        p.in_flight = false;
        if p.dirty {
            self.dirty_pages.push_back((d, page));
        }
    }

    // ---------------------------------------------------------------------------------------

    fn reap(&mut self) -> bool {
        let mut out = std::mem::take(&mut self.completions);
        out.clear();
        self.backend.complete(&mut out);
        let any = !out.is_empty();
        for c in &out {
            let (idx, chunk) = self.ops.decode(c.user_data);
            match self.ops[idx as usize].kind {
                OpKind::Load => self.on_load_done(idx, c.result),
                OpKind::Store => self.on_store_chunk_done(idx, chunk, c.result),
                OpKind::Table { page } => self.on_table_done(idx, page, c.result),
                OpKind::Recover => unreachable!("recovery ops are reaped before the loop starts"),
                OpKind::Demote { staging } => self.on_demote_done(idx, staging, c.result),
            }
        }
        self.completions = out;
        any
    }

    /// Logs an I/O error, at most 20 times per worker and then every 1000th, so a dead device
    /// cannot flood the log.
    fn log_error(&mut self, msg: &str) {
        self.error_logs += 1;
        if self.error_logs <= 20 || self.error_logs % 1000 == 0 {
            tracing::error!(worker = self.id, count = self.error_logs, "{msg}");
        }
    }
}

/// A store whose data is on the device, waiting for `finalize_stores`.
struct Finished {
    d: usize,
    local: u32,
    item: usize,
    block: u32,
    job: Arc<JobState>,
}

enum StoreStart {
    Op(u32),
    Resolved,
    Blocked,
}

/// Counts the CPU time of a thread from `/proc/self/task/<tid>/schedstat` (nanoseconds).
pub(crate) fn thread_cpu_ns(tid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat"))
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

/// Submits what the worker queued; with no `progress` this turn, sleeps in the kernel until a
/// completion or a submitter's wake-up. The sleeping flag and the fence pair with
/// [`ShardShared::nudge`], so a job sent while the worker decides to sleep is never missed.
pub(crate) fn submit_or_sleep(
    backend: &mut dyn IoBackend,
    me: &ShardShared,
    rx: &Receiver<Msg>,
    progress: bool,
    other_work: impl Fn() -> bool,
) -> std::io::Result<()> {
    let mut wait = !progress;
    if wait {
        me.sleeping.store(true, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        // Checked after `sleeping` is set: whoever adds work after this check sees the flag
        // and wakes the ring wait.
        if !rx.is_empty() || other_work() {
            wait = false;
        }
    }
    let r = backend.submit(wait);
    me.sleeping.store(false, Ordering::SeqCst);
    me.metrics.submits.fetch_add(1, Ordering::Relaxed);
    if wait {
        me.metrics.wakeups.fetch_add(1, Ordering::Relaxed);
    }
    r
}

/// crc32c of a range of the primary region.
pub(crate) fn region_crc(region: &Region, offset: usize, len: usize) -> u32 {
    region.with_bytes(offset, len, crc32c::crc32c)
}
