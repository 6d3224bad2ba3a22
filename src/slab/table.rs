//! The slot table as one worker keeps it: an in-memory copy of its table pages (the meta
//! buffer, registered with the ring), written back page by page beside the data they describe,
//! and read at open to rebuild the index (recovery).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::io::{IoClass, IoKind, IoRequest};
use crate::job::{JobState, KeyFailure};
use crate::slab::{Entry, Recovered, ENTRIES_PER_PAGE, ENTRY_BYTES, TABLE_PAGE_BYTES};
use crate::worker::{Context, BUF_META};
use crate::Errno;

use super::layout::{EntryState, Op, OpKind, SlabDevice, SlabLayout, SlotMeta, SlotState};

/// A store to acknowledge once the table page holding its entry is on the device (and its data
/// write has completed: the two run side by side).
#[derive(Clone)]
pub(crate) struct Ack {
    pub job: Arc<JobState>,
    pub item: usize,
    /// The slot the store writes, and the store's sequence number there (a later store of the
    /// same key may reuse the slot once this one's block was evicted).
    pub local: u32,
    pub seq: u64,
}

/// A dirty table page with no store waiting on it (evictions, removals) is written once this
/// many of its entries changed, or as soon as the worker runs out of work. A page that holds a
/// new store's entry is written at once, beside the store's data write, unless a write of it is
/// in flight: then the entries that arrive meanwhile share the next write (group commit). A
/// store is acknowledged only once both its data and its entry are on the device, so a crash of
/// the process never forgets an acknowledged block.
const TABLE_BATCH_ENTRIES: u16 = (ENTRIES_PER_PAGE / 2) as u16;

/// Largest single read used while recovering the slot table.
const RECOVER_READ_BYTES: usize = 1 << 20;

/// Bytes of meta buffer worker `worker` needs for its table ranges on `devices`.
pub(crate) fn meta_bytes(devices: &[SlabDevice], worker: usize, workers: usize) -> usize {
    devices
        .iter()
        .map(|d| {
            let r = d.geometry.worker_slots(worker, workers);
            (r.end - r.start).div_ceil(ENTRIES_PER_PAGE as u64) as usize * TABLE_PAGE_BYTES
        })
        .sum::<usize>()
        .max(TABLE_PAGE_BYTES)
}

impl SlabLayout {
    pub(super) fn clear_entry(&mut self, d: usize, local: u32) {
        self.write_entry(d, local, None);
    }

    /// Queues `ack` for when the table page holding entry `local` of device `d` is written.
    pub(super) fn ack_after_entry(&mut self, cx: &Context<Op>, d: usize, local: u32, ack: Ack) {
        let page = (local as usize / ENTRIES_PER_PAGE) as u32;
        self.pages.wait((d as u16, page), ack, cx.ops.now());
    }

    /// Fails, with a timeout, the stores whose data is written and whose entry has waited
    /// longer than `limit` for a table page write that could not be queued (no write of the
    /// page in flight, whose own deadline would cover them): the ring or the op table is full
    /// of I/O that does not complete. Their data stays served until a restart (the entry may
    /// still reach the device later). True if any failed.
    pub(super) fn expire_waiting(
        &mut self,
        cx: &mut Context<Op>,
        now: std::time::Instant,
        limit: std::time::Duration,
    ) -> bool {
        let mut any = false;
        for (d, page) in self.pages.overdue(now, limit) {
            let dev = &self.devs[d as usize];
            // A store whose data write is still in flight stays: that write's deadline
            // covers it (and keeps its lease while the device may read the block).
            let failing = self.pages.expire((d, page), now, |a| {
                dev.slots[a.local as usize].written_by(a.seq)
            });
            let detail = format!(
                "{}: the slot table write (page {page}) could not be queued within \
                 io_timeout_ms = {} (the ring is full of I/O that has not completed); the \
                 block may not survive a restart",
                dev.name,
                limit.as_millis()
            );
            for a in failing {
                if !a.job.is_resolved(a.item) {
                    cx.store_failed(&a.job, a.item, KeyFailure::Timeout, detail.clone());
                    any = true;
                }
            }
        }
        any
    }

    pub(super) fn write_entry(&mut self, d: usize, local: u32, entry: Option<Entry>) {
        match entry {
            Some(e) => e.encode(&mut self.scratch_entry),
            None => self.scratch_entry.fill(0),
        }
        let at = self.devs[d].meta_offset + local as usize * ENTRY_BYTES;
        let page = (local as usize / ENTRIES_PER_PAGE) as u32;
        if self.pages.changed((d as u16, page), at, self.scratch_entry) {
            self.meta.write(at, &self.scratch_entry);
        }
    }

    /// Writes the dirty table pages that are due: those with enough changed entries, or all of
    /// them once no store is queued or in flight (or the worker is stopping).
    pub(super) fn issue_table_writes(&mut self, cx: &mut Context<Op>) -> bool {
        // "Quiet" means the worker is about to run out of work: no queued jobs and no I/O in
        // flight. A queue-depth-bound store stream keeps I/O in flight, so its pages are
        // written at the batch threshold; the rest are written before the worker sleeps.
        let quiet = cx.stopping() || (self.store_ops == 0 && cx.quiet());
        let mut any = false;
        let mut from = 0;
        while let Some(i) = self.pages.next_due(from, quiet, TABLE_BATCH_ENTRIES) {
            let (d, page) = self.pages.queued()[i];
            let Some(idx) = cx.ops.alloc(Op::new(OpKind::Table { page })) else {
                break;
            };
            let dev = &self.devs[d as usize];
            let at = dev.meta_offset + page as usize * TABLE_PAGE_BYTES;
            let req = IoRequest {
                user_data: cx.ops.user_data(idx, 0),
                kind: IoKind::Write,
                device: d,
                offset: dev
                    .geometry
                    .table_page_offset(dev.first_page() + u64::from(page)),
                region: BUF_META,
                buf: self
                    .meta
                    .checkout(at, TABLE_PAGE_BYTES, false)
                    .expect("a page not in flight is the worker's, unclaimed"),
                class: IoClass::Meta,
            };
            if !cx.backend().block_queue().push(req) {
                cx.ops.release(idx);
                break;
            }
            cx.ops[idx as usize].dev = d;
            self.pages.start(i);
            // The page left the queue: the next due one is at `i` or after.
            from = i;
            any = true;
        }
        any
    }

    pub(super) fn on_table_done(&mut self, cx: &mut Context<Op>, idx: u32, page: u32, result: i32) {
        let d = cx.ops[idx as usize].dev;
        cx.ops.release(idx);
        cx.metrics().table_writes.fetch_add(1, Ordering::Relaxed);
        // The device is done reading the page (its claim went with the completion): the
        // entries changed meanwhile go in now.
        let (acks, deferred) = self.pages.written((d, page));
        for (at, entry) in deferred {
            self.meta.write(at, &entry);
        }
        if usize::try_from(result).ok() == Some(TABLE_PAGE_BYTES) {
            for a in &acks {
                if a.job.is_resolved(a.item) {
                    continue;
                }
                let s = &mut self.devs[d as usize].slots[a.local as usize];
                if s.written_by(a.seq) {
                    // The data write is still in flight: it acknowledges the store.
                    s.entry = EntryState::Durable;
                } else {
                    // The data is written (the slot may have been evicted since).
                    cx.store_succeeded(&a.job, a.item, cx.block_bytes());
                }
            }
        } else {
            // The entries of this page may not survive a restart: their stores fail (the data
            // is still served until then, and a later write of the page may save them).
            cx.metrics()
                .dev(d as usize)
                .count_result(result, TABLE_PAGE_BYTES as u64);
            let (reason, why) = if result < 0 {
                let e = Errno::from_raw(-result);
                (KeyFailure::Io(e), e.desc().to_string())
            } else {
                (
                    KeyFailure::ShortIo {
                        done: result as u32,
                        wanted: TABLE_PAGE_BYTES as u32,
                    },
                    format!("short write {result}"),
                )
            };
            let name = &self.devs[d as usize].name;
            let detail = format!("{name}: slot table write (page {page}) failed: {why}");
            cx.device_error(d as usize, &detail);
            for a in &acks {
                if self.devs[d as usize].slots[a.local as usize].written_by(a.seq)
                    && !a.job.is_resolved(a.item)
                {
                    // Its data write is still in flight, reading the caller's block: the job's
                    // lease stays until that write completes (it then drops the slot).
                    let local = a.local;
                    let writing = cx.ops.find_live(|op| {
                        matches!(op.kind, OpKind::Store)
                            && op.dev == d
                            && op.slot == local
                            && op.item as usize == a.item
                            && op.job.as_ref().is_some_and(|j| Arc::ptr_eq(j, &a.job))
                    });
                    if let Some(w) = writing {
                        cx.ops.hold(w, &a.job);
                    }
                }
                cx.store_failed(&a.job, a.item, reason, detail.clone());
            }
        }
    }

    // ---------------------------------------------------------------------------------------
    // Recovery

    /// Reads this worker's slot table ranges and rebuilds the index from them; returns how many
    /// blocks it holds.
    pub fn recover(&mut self, cx: &mut Context<Op>, devices: &[SlabDevice]) -> Result<u64, String> {
        let mut pending = 0usize;
        for (d, spec) in devices.iter().enumerate() {
            if spec.fresh || self.devs[d].slots.is_empty() {
                continue;
            }
            let dev = &self.devs[d];
            let total = dev.slots.len().div_ceil(ENTRIES_PER_PAGE) * TABLE_PAGE_BYTES;
            let base = dev.geometry.table_page_offset(dev.first_page());
            let meta_offset = dev.meta_offset;
            let mut done = 0usize;
            while done < total {
                let len = (total - done).min(RECOVER_READ_BYTES);
                let idx = cx
                    .ops
                    .alloc(Op::new(OpKind::Recover))
                    .ok_or("op table exhausted")?;
                cx.ops[idx as usize].dev = d as u16;
                let user_data = cx.ops.user_data(idx, 0);
                let request = || IoRequest {
                    user_data,
                    kind: IoKind::Read,
                    device: d as u16,
                    offset: base + done as u64,
                    region: BUF_META,
                    buf: self
                        .meta
                        .checkout(meta_offset + done, len, true)
                        .expect("the table pages are read once each, at recovery"),
                    class: IoClass::Meta,
                };
                while !cx.backend().block_queue().push(request()) {
                    cx.backend().submit(true).map_err(|e| e.to_string())?;
                    pending -= reap_recover(cx)?;
                }
                pending += 1;
                done += len;
            }
        }
        while pending > 0 {
            cx.backend().submit(true).map_err(|e| e.to_string())?;
            pending -= reap_recover(cx)?;
        }
        for (d, device) in devices.iter().enumerate().take(self.devs.len()) {
            if !device.fresh {
                self.rebuild_device(cx, d);
            }
        }
        // What the index holds once every device is read: each key once, the newer of two
        // entries (which may be on different devices).
        let mut per_device = vec![0u64; self.devs.len()];
        for (key, (d, _)) in self.index.iter() {
            per_device[usize::from(d)] += 1;
            cx.publish_key(&key);
        }
        for (d, &n) in per_device.iter().enumerate() {
            cx.metrics()
                .dev(d)
                .blocks_stored
                .store(n, Ordering::Relaxed);
        }
        let recovered = per_device.iter().sum();
        cx.metrics()
            .recovered_blocks
            .store(recovered, Ordering::Relaxed);
        Ok(recovered)
    }

    /// Rebuilds device `d`'s slots and index entries from its table (the keys are published
    /// once every device is read).
    fn rebuild_device(&mut self, cx: &Context<Op>, d: usize) {
        let mut raw = [0u8; ENTRY_BYTES];
        let n = self.devs[d].slots.len();
        let me = cx.worker_shared();
        let m = &me.metrics;
        for local in 0..n {
            let off = self.devs[d].meta_offset + local * ENTRY_BYTES;
            self.meta.read(off, &mut raw);
            match super::recover_entry(&raw, self.id, self.workers, cx.block_bytes()) {
                Recovered::Empty => {}
                Recovered::Torn => {
                    m.torn_entries.fetch_add(1, Ordering::Relaxed);
                    self.clear_entry(d, local as u32);
                }
                Recovered::Unroutable(_) => {
                    // Written under another worker count (or block size): this worker could
                    // never be asked for it, so the slot is reclaimed.
                    m.unroutable_entries.fetch_add(1, Ordering::Relaxed);
                    self.clear_entry(d, local as u32);
                }
                Recovered::Kept(e) => {
                    self.seq = self.seq.max(e.seq + 1);
                    if let Some((od, os)) = self.index.get(&e.key) {
                        // Two entries for one key (on this device, or on one read before: a
                        // device marked failed keeps its entries, and the key was stored
                        // again elsewhere): keep the newer, by sequence number.
                        let old_seq = self.devs[od as usize].slots[os as usize].seq;
                        if old_seq >= e.seq {
                            self.clear_entry(d, local as u32);
                            continue;
                        }
                        self.index.unpoint(&e.key, (od, os));
                        self.drop_recovered(od as usize, os);
                    }
                    self.devs[d].slots[local] = SlotMeta {
                        state: SlotState::Valid,
                        key: Some(e.key),
                        pins: 0,
                        referenced: false,
                        verified: false,
                        crc: e.data_crc,
                        entry: EntryState::Durable,
                        seq: e.seq,
                    };
                    self.index.point(e.key, (d as u16, local as u32));
                }
            }
        }
        self.devs[d].slots.rebuild_free_list();
    }

    /// Frees a recovered slot whose entry lost to a newer one: back on its device's free list
    /// (that device's list may be rebuilt already), its table entry cleared.
    fn drop_recovered(&mut self, d: usize, local: u32) {
        self.devs[d].slots.free(local);
        self.clear_entry(d, local);
    }
}

fn reap_recover(cx: &mut Context<Op>) -> Result<usize, String> {
    let mut out = Vec::new();
    cx.backend().complete(&mut out);
    let mut n = 0;
    let mut err = None;
    for c in &out {
        let (idx, _) = cx.ops.decode(c.user_data);
        if c.result < 0 {
            err = Some(format!(
                "reading the slot table of device {}: {}",
                cx.ops[idx as usize].dev,
                Errno::from_raw(-c.result).desc()
            ));
        }
        cx.ops.release(idx);
        n += 1;
    }
    err.map_or(Ok(n), Err)
}
