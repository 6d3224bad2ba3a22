//! The slab as a worker's [`Layout`]: this worker's page-aligned range of slots on every device,
//! the index of the keys it owns, and the slot states that loads and stores move through.
//!
//! ```text
//! store: alloc slot (free list, else CLOCK victim; demoted first with on_evict)
//!        ─► Writing ─► data write(s) ─┬─ after submit: crc32c, table entry ─► page write ─┐
//!                                      └─ data written: index, Valid ─────────────────────┴► ack
//! load:  index ─► pin ─► read ─► (first load after a restart: check crc) ─► unpin
//! ```
//!
//! Nothing here takes a lock on the data path except the write side of the worker's published
//! key set (what `Engine::lookup` reads), touched once per stored or removed block. A slot
//! pinned by a load is never evicted or freed. A store's table entry goes to the device beside
//! its data, not after it: the entry carries the data's crc32c, so an entry that lands before
//! its data (a crash between the two) names a block whose check fails at its first load, and
//! is dropped, never served (see [`super::table`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use crate::io::{IoClass, IoKind, IoRequest};
use crate::job::{JobState, KeyFailure};
use crate::key::Key;
use crate::slab::{Geometry, ENTRIES_PER_PAGE, ENTRY_BYTES};
use crate::worker::{
    own_key, region_buffer, Chunks, Context, Layout, LayoutOp, Removal, Start, Worker, WorkerParams,
};
use crate::Errno;

use super::index::Index;
use super::pages::TablePages;
use super::slots::Slots;
use super::table::Ack;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SlotState {
    Free,
    Writing,
    Valid,
    /// Dropped from the index (checksum failure) but still pinned by loads; freed at last unpin.
    Doomed,
}

#[derive(Clone, Copy)]
pub(super) struct SlotMeta {
    pub state: SlotState,
    pub key: Option<Key>,
    pub pins: u16,
    pub referenced: bool,
    /// The data is known to match `crc` (written by this process, or checked once).
    pub verified: bool,
    pub crc: u32,
    /// Where the table entry of the store writing this slot is.
    pub entry: EntryState,
    /// The sequence number of the store that wrote (or writes) this slot, and of its table
    /// entry: what tells that store from a later store of the same key into the same slot.
    pub seq: u64,
}

/// A store's table entry, while its slot is `Writing`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum EntryState {
    /// Not computed yet (the crc32c is taken after the data write is submitted).
    Unwritten,
    /// In the meta buffer; the store is acknowledged by the page write that carries it.
    Queued,
    /// On the device; the store is acknowledged when its data write completes.
    Durable,
}

impl SlotMeta {
    /// Whether store `seq` is still writing this slot (not failed, and the slot not reused by
    /// a later store of the same key after this one's block was evicted).
    pub fn written_by(&self, seq: u64) -> bool {
        self.state == SlotState::Writing && self.seq == seq
    }
}

pub(super) const FREE_SLOT: SlotMeta = SlotMeta {
    state: SlotState::Free,
    key: None,
    pins: 0,
    referenced: false,
    verified: true,
    crc: 0,
    entry: EntryState::Unwritten,
    seq: 0,
};

/// One worker's share of a slab device: its slots and its range of the slot table.
pub(super) struct DevShare {
    pub geometry: Geometry,
    /// First slot this worker owns; local slot `i` is device slot `first + i`.
    pub first: u64,
    pub slots: Slots,
    /// Byte offset of this device's table range in the meta buffer.
    pub meta_offset: usize,
    /// `devices[i] <path>`, for error messages.
    pub name: String,
}

impl DevShare {
    pub fn first_page(&self) -> u64 {
        self.first / ENTRIES_PER_PAGE as u64
    }

    pub fn slot_offset(&self, local: u32) -> u64 {
        self.geometry.slot_offset(self.first + u64::from(local))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OpKind {
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

pub(crate) struct Op {
    pub kind: OpKind,
    pub job: Option<Arc<JobState>>,
    pub item: u32,
    pub dev: u16,
    pub slot: u32,
    pub block: u32,
    pub chunks: Chunks,
    pub started: Instant,
}

impl Op {
    pub fn new(kind: OpKind) -> Op {
        Op {
            kind,
            job: None,
            item: 0,
            dev: 0,
            slot: 0,
            block: 0,
            chunks: Chunks::NONE,
            started: Instant::now(),
        }
    }
}

impl LayoutOp for Op {
    fn writing(&mut self) -> Option<&mut Chunks> {
        (self.kind == OpKind::Store).then_some(&mut self.chunks)
    }

    fn device(&self) -> usize {
        self.dev as usize
    }
}

/// A store just submitted (`entering`, for `write_entries`) or whose data is on the device
/// (`finalize`, for `finalize_stores`).
pub(super) struct Finished {
    pub d: usize,
    pub local: u32,
    pub item: usize,
    pub block: u32,
    pub job: Arc<JobState>,
    /// The store's sequence number (`SlotMeta::seq`).
    pub seq: u64,
}

/// A slab device as opened (formatted or checked), as the node hands it to every worker. The
/// device names, one per stage: `config::DeviceConfig` (what the config says),
/// `io::OpenedDevice` (what opening it found), `SlabDevice` (this), `DevShare` (one worker's
/// share of it), `files::device::FilesDevice` (a files-layout directory), `DeviceSummary`
/// (what `Engine::info` reports).
pub(crate) struct SlabDevice {
    pub geometry: Geometry,
    /// True if the device was just formatted: its table holds nothing to recover.
    pub fresh: bool,
    /// How errors name it: `devices[i] <path>`.
    pub name: String,
    /// `verify_loads = "always"`: every load checks the block's crc32c, not only a recovered
    /// block's first.
    pub verify_always: bool,
}

pub(crate) struct SlabLayout {
    pub(super) id: usize,
    pub(super) workers: usize,
    pub(super) meta: Arc<crate::io::Region>,
    pub(super) devs: Vec<DevShare>,
    pub(super) index: Index,
    /// The table pages' write-back: which changed, which are being written, the stores each
    /// write acknowledges.
    pub(super) pages: TablePages<Ack>,
    /// Store ops started and not finished.
    pub(super) store_ops: usize,
    /// Stores whose data writes were pushed since the last submit: their entries are written
    /// after it.
    pub(super) entering: Vec<Finished>,
    pub(super) finalize: Vec<Finished>,
    pub(super) seq: u64,
    pub(super) scratch_entry: [u8; ENTRY_BYTES],
    /// Per device: every load checks the crc32c (`verify_loads = "always"`).
    pub(super) verify_always: Vec<bool>,
}

impl SlabLayout {
    /// Worker `id` of `workers`' share of `devices`; `meta` holds its table pages.
    pub fn new(
        id: usize,
        workers: usize,
        meta: Arc<crate::io::Region>,
        devices: &[SlabDevice],
        metrics: &crate::metrics::WorkerMetrics,
    ) -> SlabLayout {
        let mut devs = Vec::with_capacity(devices.len());
        let mut pages_per_dev = Vec::with_capacity(devices.len());
        let mut meta_offset = 0usize;
        let mut capacity = 0usize;
        for (i, d) in devices.iter().enumerate() {
            let r = d.geometry.worker_slots(id, workers);
            let n = (r.end - r.start) as usize;
            metrics
                .dev(i)
                .slots_total
                .store(n as u64, Ordering::Relaxed);
            let pages = n.div_ceil(ENTRIES_PER_PAGE);
            devs.push(DevShare {
                geometry: d.geometry,
                first: r.start,
                slots: Slots::new(n),
                meta_offset,
                name: d.name.clone(),
            });
            pages_per_dev.push(pages);
            meta_offset += pages * crate::slab::TABLE_PAGE_BYTES;
            capacity += n;
        }
        let index = Index::with_capacity(capacity);
        SlabLayout {
            verify_always: devices.iter().map(|d| d.verify_always).collect(),
            id,
            workers,
            meta,
            devs,
            index,
            pages: TablePages::new(&pages_per_dev),
            store_ops: 0,
            entering: Vec::new(),
            finalize: Vec::new(),
            seq: 1,
            scratch_entry: [0; ENTRY_BYTES],
        }
    }

    /// A worker running the slab layout: worker `params.id` of `workers`' share of `devices`,
    /// its slot table copy in `meta`, recovered from the devices; and how many blocks it holds.
    pub fn recovered_worker(
        params: WorkerParams,
        workers: usize,
        meta: Arc<crate::io::Region>,
        devices: &[SlabDevice],
    ) -> Result<(Worker<SlabLayout>, u64), String> {
        let layout = SlabLayout::new(params.id, workers, meta, devices, &params.me.metrics);
        let mut worker = Worker::new(params, layout);
        let (layout, cx) = worker.parts();
        let recovered = layout.recover(cx, devices)?;
        Ok((worker, recovered))
    }
}

impl Layout for SlabLayout {
    type Op = Op;

    fn start_load(&mut self, cx: &mut Context<Op>, job: &Arc<JobState>, item: usize) -> Start {
        let key = job.job.keys[item];
        let block = job.job.blocks[item];
        let Some((d, local)) = self.index.get(&key) else {
            cx.resolve_load(job, item, KeyFailure::Miss);
            return Start::Resolved;
        };
        let dev = &mut self.devs[d as usize];
        // Pinned from here until the read completes (or does not start).
        if !dev.slots.pin_valid(local) {
            cx.resolve_load(job, item, KeyFailure::NotReady);
            return Start::Resolved;
        }
        let offset = dev.slot_offset(local);
        let op = Op {
            job: Some(Arc::clone(job)),
            item: item as u32,
            dev: d,
            slot: local,
            block,
            ..Op::new(OpKind::Load)
        };
        let Some((idx, user_data)) = cx.ops.alloc_load(op, true) else {
            self.devs[d as usize].slots.unpin(local);
            return Start::Blocked;
        };
        let req = IoRequest {
            user_data,
            kind: IoKind::Read,
            device: d,
            offset,
            region: region_buffer(job.region),
            buf: cx.claim_block(job, block, true),
            class: IoClass::Load,
        };
        if !cx.backend().block_queue().push(req) {
            cx.ops.abandon(idx);
            self.devs[d as usize].slots.unpin(local);
            return Start::Blocked;
        }
        Start::Loading
    }

    fn start_store(
        &mut self,
        cx: &mut Context<Op>,
        job: &Arc<JobState>,
        item: usize,
        _retried: bool,
    ) -> Start {
        let key = job.job.keys[item];
        let block = job.job.blocks[item];
        if self.index.contains(&key) {
            // Already stored (or being stored).
            cx.store_present(job, item);
            return Start::Resolved;
        }
        let n = self.devs.len();
        let home = key.device(n);
        // A failed device's stores go to the next device that works.
        let Some(d) = (0..n)
            .map(|i| (home + i) % n)
            .find(|&d| !cx.device_failed(d))
        else {
            cx.store_failed(
                job,
                item,
                KeyFailure::Io(Errno::EIO),
                "every device was marked failed after repeated timeouts".to_owned(),
            );
            return Start::Resolved;
        };
        let Some(local) = self.alloc_slot(cx, d) else {
            if cx.in_flight() > self.pages.in_flight() || cx.demotion_will_free() {
                // A completion may free or unpin a slot, or a demotion give back its staging.
                return Start::Blocked;
            }
            cx.store_failed(job, item, KeyFailure::NoSpace, self.no_space_detail(d));
            return Start::Resolved;
        };
        let Some(idx) = cx.ops.alloc(Op::new(OpKind::Store)) else {
            self.free_slot(d, local);
            return Start::Blocked;
        };
        // The crc32c and the table entry are written once the data write is submitted (see
        // `write_entries`), off the path to the device.
        self.devs[d].slots[local as usize] = SlotMeta {
            state: SlotState::Writing,
            key: Some(key),
            pins: 0,
            referenced: true,
            verified: true,
            crc: 0,
            entry: EntryState::Unwritten,
            seq: self.seq,
        };
        let seq = self.seq;
        self.seq += 1;
        self.index.point(key, (d as u16, local));
        let op = &mut cx.ops[idx as usize];
        op.job = Some(Arc::clone(job));
        op.item = item as u32;
        op.dev = d as u16;
        op.slot = local;
        op.block = block;
        self.store_ops += 1;
        self.entering.push(Finished {
            d,
            local,
            item,
            block,
            job: Arc::clone(job),
            seq,
        });
        cx.begin_writing(idx);
        Start::Started
    }

    fn push_chunk(
        &mut self,
        cx: &mut Context<Op>,
        idx: u32,
        chunk: u16,
        start: u64,
        len: u64,
    ) -> bool {
        let op = &cx.ops[idx as usize];
        let job = op.job.as_ref().expect("a store op has a job");
        let at = op.block as usize * cx.block_bytes() as usize + start as usize;
        let req = IoRequest {
            user_data: cx.ops.user_data(idx, chunk),
            kind: IoKind::Write,
            device: op.dev,
            offset: self.devs[op.dev as usize].slot_offset(op.slot) + start,
            region: region_buffer(job.region),
            buf: cx.claim(job, at, len as usize, false),
            class: IoClass::Store,
        };
        cx.backend().block_queue().push(req)
    }

    fn on_written(
        &mut self,
        cx: &mut Context<Op>,
        idx: u32,
        failure: Option<(KeyFailure, String)>,
    ) {
        self.store_ops -= 1;
        let op = &cx.ops[idx as usize];
        let (d, local, item, block) = (op.dev as usize, op.slot, op.item as usize, op.block);
        let job = op.job.clone().expect("store op has a job");
        cx.metrics()
            .dev(d)
            .store_latency
            .record(op.started.elapsed().as_micros() as u64);
        cx.ops.release(idx);
        if job.is_resolved(item) || cx.device_failed(d) {
            // Failed by its deadline already (the caller was told; its region bytes may be the
            // caller's again), or on a device marked failed since: drop the block.
            self.drop_on_failed_device(cx, d, local, &job, item);
            return;
        }
        match failure {
            None => self.finalize.push(Finished {
                d,
                local,
                item,
                block,
                job,
                seq: self.devs[d].slots[local as usize].seq,
            }),
            Some((reason, detail)) => {
                self.drop_store(d, local);
                // The write's error was logged (once per episode) when its chunk completed.
                cx.store_failed(&job, item, reason, detail);
            }
        }
    }

    fn on_complete(&mut self, cx: &mut Context<Op>, idx: u32, result: i32) {
        match cx.ops[idx as usize].kind {
            OpKind::Load => unreachable!("a load ends with its completion (on_ended)"),
            OpKind::Table { page } => self.on_table_done(cx, idx, page, result),
            OpKind::Demote { staging } => self.on_demote_done(cx, idx, staging, result),
            OpKind::Recover => unreachable!("recovery ops are reaped before the loop starts"),
            OpKind::Store => unreachable!("store writes are the worker's (LayoutOp::writing)"),
        }
    }

    fn on_ended(&mut self, cx: &mut Context<Op>, op: Op, result: i32) {
        debug_assert_eq!(
            op.kind,
            OpKind::Load,
            "only loads end with their completion"
        );
        self.on_load_done(cx, op, result);
    }

    fn touch(&mut self, key: Key) {
        if let Some((d, local)) = self.index.get(&key) {
            self.devs[d as usize].slots[local as usize].referenced = true;
        }
    }

    fn keys(&self) -> Vec<Key> {
        self.index
            .iter()
            .filter(|&(_, (d, local))| {
                self.devs[d as usize].slots[local as usize].state == SlotState::Valid
            })
            .map(|(k, _)| k)
            .collect()
    }

    fn remove(&mut self, cx: &mut Context<Op>, key: Key) -> bool {
        let Some((d, local)) = self.index.get(&key) else {
            return false;
        };
        let slot = &self.devs[d as usize].slots[local as usize];
        if slot.state != SlotState::Valid || slot.pins > 0 {
            return false;
        }
        self.evict(cx, d as usize, local, Removal::Asked);
        true
    }

    fn background(&mut self, cx: &mut Context<Op>) -> bool {
        self.issue_table_writes(cx)
    }

    fn expire_waiting(
        &mut self,
        cx: &mut Context<Op>,
        now: std::time::Instant,
        limit: std::time::Duration,
    ) -> bool {
        SlabLayout::expire_waiting(self, cx, now, limit)
    }

    fn after_submit(&mut self, cx: &mut Context<Op>) {
        if !self.entering.is_empty() {
            self.write_entries(cx);
        }
        if !self.finalize.is_empty() {
            self.finalize_stores(cx);
        }
    }

    fn idle(&self) -> bool {
        self.pages.all_written() && self.entering.is_empty() && self.finalize.is_empty()
    }

    fn overdue_keys(&self, cx: &Context<Op>, idx: u32) -> Vec<(Arc<JobState>, usize, bool)> {
        let op = &cx.ops[idx as usize];
        match op.kind {
            OpKind::Load | OpKind::Store => own_key(op.job.as_ref(), op.item),
            // The stores acknowledged by this page write whose data is written (the page write
            // reads only the meta buffer), and those waiting for the page's next write, which
            // cannot start before this one ends (no op of their own carries a deadline). A
            // store whose data write is still in flight is left to that write's own deadline,
            // which keeps the job's lease while the device may still read the block.
            OpKind::Table { page } => {
                let dev = &self.devs[op.dev as usize];
                let p = self.pages.page((op.dev, page));
                p.committing()
                    .iter()
                    .chain(p.waiting())
                    .filter(|a| !dev.slots[a.local as usize].written_by(a.seq))
                    .map(|a| (Arc::clone(&a.job), a.item, false))
                    .collect()
            }
            OpKind::Recover | OpKind::Demote { .. } => Vec::new(),
        }
    }

    fn device_failed(&mut self, cx: &mut Context<Op>, d: usize) {
        let keys: Vec<(Key, u32)> = self
            .index
            .iter()
            .filter(|&(_, (dev, _))| dev as usize == d)
            .map(|(k, (_, local))| (k, local))
            .collect();
        for &(key, local) in &keys {
            self.unindex(cx, key, d, local);
        }
        let keys: Vec<Key> = keys.into_iter().map(|(k, _)| k).collect();
        if !keys.is_empty() {
            cx.announce_removed(keys);
        }
    }

    fn describe_op(&self, cx: &Context<Op>, idx: u32) -> String {
        let op = &cx.ops[idx as usize];
        let dev = &self.devs[op.dev as usize];
        let what = match op.kind {
            OpKind::Load => format!("load (read of slot {})", op.slot),
            OpKind::Store => format!("store (write of slot {})", op.slot),
            // A timeout of a page write fails the stores it acknowledges: say so.
            OpKind::Table { page } => match self.pages.page((op.dev, page)).committing().len() {
                0 => format!("slot table write (page {page})"),
                n => format!("slot table write (page {page}) acknowledging {n} store(s)"),
            },
            OpKind::Recover => "recovery read of the slot table".to_owned(),
            OpKind::Demote { .. } => format!("demotion read of slot {}", op.slot),
        };
        format!("{}: {what}", dev.name)
    }

    fn device_name(&self, d: usize) -> String {
        self.devs[d].name.clone()
    }

    #[cfg(any(test, feature = "sim"))]
    fn check_quiet(&self, cx: &Context<Op>) -> Result<(), String> {
        if self.store_ops != 0
            || self.pages.in_flight() != 0
            || !self.entering.is_empty()
            || !self.finalize.is_empty()
        {
            return Err(format!(
                "{} stores, {} table writes, {} entries, {} finalizations left",
                self.store_ops,
                self.pages.in_flight(),
                self.entering.len(),
                self.finalize.len()
            ));
        }
        self.pages.check()?;
        if let Some((d, p)) = self.pages.first_unacknowledged() {
            return Err(format!(
                "device {d} table page {p}: stores never acknowledged"
            ));
        }
        for (d, dev) in self.devs.iter().enumerate() {
            for (local, s) in dev.slots.iter().enumerate() {
                if s.pins != 0 || s.state == SlotState::Writing || s.state == SlotState::Doomed {
                    return Err(format!(
                        "device {d} slot {local}: {:?} with {} pins",
                        s.state, s.pins
                    ));
                }
            }
            dev.slots.check().map_err(|e| format!("device {d}: {e}"))?;
        }
        for (key, (d, local)) in self.index.iter() {
            let s = &self.devs[d as usize].slots[local as usize];
            if s.state != SlotState::Valid || s.key != Some(key) {
                return Err(format!("index entry {key:?} names a {:?} slot", s.state));
            }
            if !cx.is_published(&key) {
                return Err(format!("{key:?} is indexed but not published"));
            }
        }
        let published = cx.published_len();
        if published != self.index.len() {
            return Err(format!(
                "{published} keys published but {} indexed",
                self.index.len()
            ));
        }
        Ok(())
    }
}

/// The errno of a failed read, or its byte count, for logs.
pub(super) fn describe_result(result: i32) -> String {
    if result < 0 {
        Errno::from_raw(-result).desc().to_owned()
    } else {
        format!("{result} bytes")
    }
}
