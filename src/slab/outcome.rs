//! What happens when a slab load or store completes: a load's length and checksum checks and
//! its report, a slot doomed by a failed write; and a store's checksum and table entry,
//! computed once its data write is submitted (so they never delay I/O) and written beside it.

use super::table::Ack;
use crate::io::io_outcome;
use crate::job::{JobState, KeyFailure};
use crate::slab::ENTRIES_PER_PAGE;
use crate::worker::shared::block_crc;
use crate::worker::Context;
use crate::Errno;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::layout::{EntryState, Finished, Op, SlabLayout, SlotMeta, SlotState};

impl SlabLayout {
    /// Load `op` completed with `result`: its block checked where it must be (the first read
    /// after a restart, or `verify = "always"`), its slot unpinned, the key reported.
    pub(super) fn on_load_done(&mut self, cx: &mut Context<Op>, op: Op, result: i32) {
        let (d, local) = (op.dev as usize, op.slot);
        let job = op.job.expect("a load op has a job");
        let wanted = cx.block_bytes();
        let outcome = match io_outcome(result, wanted) {
            Err(reason) => Err((
                reason,
                format!(
                    "{}: load (read of slot {local}): {}",
                    self.devs[d].name,
                    match reason {
                        KeyFailure::Io(e) => e.desc().to_owned(),
                        _ => format!("short read ({result} of {wanted} bytes)"),
                    }
                ),
            )),
            Ok(()) => Ok(()),
        };
        let slot = self.devs[d].slots.end_read(local);
        let outcome = outcome.and_then(|()| self.check_read(cx, d, local, &slot, &job, op.block));
        let name = &self.devs[d].name;
        cx.load_done(
            &job,
            op.item as usize,
            d,
            op.started,
            (result, wanted),
            outcome,
            name,
        );
    }

    /// The checksum of a block just read into `job`'s `block` from slot `local` (`slot`: as
    /// the read found it), where it must be checked: a block that does not match is doomed.
    fn check_read(
        &mut self,
        cx: &mut Context<Op>,
        d: usize,
        local: u32,
        slot: &SlotMeta,
        job: &Arc<JobState>,
        block: u32,
    ) -> Result<(), (KeyFailure, String)> {
        if slot.verified && !self.verify_always[d] {
            return Ok(());
        }
        let wanted = cx.block_bytes() as usize;
        let crc = block_crc(job, cx.region_of(job), block as usize * wanted, wanted);
        if crc != slot.crc {
            cx.metrics()
                .dev(d)
                .checksum_failures
                .fetch_add(1, Ordering::Relaxed);
            self.doom_slot(cx, d, local);
            return Err((
                KeyFailure::Checksum,
                format!("stored crc {:08x}, read {crc:08x}", slot.crc),
            ));
        }
        let s = &mut self.devs[d].slots[local as usize];
        if s.state == SlotState::Valid && s.crc == slot.crc {
            s.verified = true;
        }
        Ok(())
    }

    /// Removes a bad block from the index now; its slot is freed now if no read holds it, else
    /// when the last one unpins it.
    pub(super) fn doom_slot(&mut self, cx: &mut Context<Op>, d: usize, local: u32) {
        let s = &mut self.devs[d].slots[local as usize];
        if s.state != SlotState::Valid {
            return;
        }
        s.state = SlotState::Doomed;
        if let Some(key) = s.key {
            self.unindex(cx, key, d, local);
            cx.announce_removed(vec![key]);
        }
        cx.metrics()
            .dev(d)
            .blocks_stored
            .fetch_sub(1, Ordering::Relaxed);
        self.clear_entry(d, local);
        if self.devs[d].slots[local as usize].pins == 0 {
            self.free_slot(d, local);
        }
    }

    /// Why a store found no slot on device `d`.
    pub(super) fn no_space_detail(&self, d: usize) -> String {
        if self.devs[d].slots.is_empty() {
            // Slot-table pages (32 slots each) are split between workers: a small device
            // with many workers leaves some of them nothing.
            format!(
                "device {d}: worker {} has no slots (a device's slots are shared out \
                 between workers in table pages of {} slots); raise the device's \
                 capacity_bytes or use fewer cores",
                self.id, ENTRIES_PER_PAGE
            )
        } else {
            format!(
                "device {d}: all {} slots of worker {} are busy",
                self.devs[d].slots.len(),
                self.id
            )
        }
    }

    /// Drops a store whose data write completed on a device marked failed (or after its
    /// deadline failed the key) and fails its key, if still open, with EIO.
    pub(super) fn drop_on_failed_device(
        &mut self,
        cx: &mut Context<Op>,
        d: usize,
        local: u32,
        job: &Arc<JobState>,
        item: usize,
    ) {
        self.drop_store(d, local);
        let detail = format!("{} was marked failed", self.devs[d].name);
        cx.store_failed(job, item, KeyFailure::Io(Errno::EIO), detail);
    }

    /// Takes back a store whose write failed or outlived its job: the slot is freed, and its
    /// table entry cleared if it was written (it names data that never fully landed).
    pub(super) fn drop_store(&mut self, d: usize, local: u32) {
        let s = self.devs[d].slots[local as usize];
        let key = s.key.expect("writing slot has a key");
        // Unless the key was stored again elsewhere meanwhile (this store's device was marked
        // failed, which unindexed it, and a later store of the key went to another device).
        self.index.unpoint(&key, (d as u16, local));
        if s.entry != EntryState::Unwritten {
            self.clear_entry(d, local);
        }
        self.free_slot(d, local);
    }

    /// Writes the table entries of the stores whose data writes were just submitted: the
    /// crc32c of the block, the entry in the meta buffer, and the store's acknowledgement
    /// queued on the entry's page, whose write then runs beside the data write. Runs after the
    /// ring was submitted, so the checksum never delays the data on its way to the device.
    pub(super) fn write_entries(&mut self, cx: &mut Context<Op>) {
        let entering = std::mem::take(&mut self.entering);
        for f in &entering {
            let s = self.devs[f.d].slots[f.local as usize];
            // A store that failed before its entry was written (a push error, a deadline) has
            // been reported and its slot freed, maybe reused by a later store.
            if f.job.is_resolved(f.item) || !s.written_by(f.seq) || s.entry != EntryState::Unwritten
            {
                continue;
            }
            self.write_store_entry(cx, f);
        }
        self.entering = entering;
        self.entering.clear();
    }

    fn write_store_entry(&mut self, cx: &Context<Op>, f: &Finished) {
        let block_bytes = cx.block_bytes();
        let crc = block_crc(
            &f.job,
            cx.region_of(&f.job),
            f.block as usize * block_bytes as usize,
            block_bytes as usize,
        );
        let s = &mut self.devs[f.d].slots[f.local as usize];
        s.crc = crc;
        s.entry = EntryState::Queued;
        let key = s.key.expect("writing slot has a key");
        let seq = f.seq;
        self.write_entry(
            f.d,
            f.local,
            Some(crate::slab::Entry {
                seq,
                data_len: block_bytes as u32,
                data_crc: crc,
                key,
            }),
        );
        self.ack_after_entry(
            cx,
            f.d,
            f.local,
            Ack {
                job: Arc::clone(&f.job),
                item: f.item,
                local: f.local,
                seq: f.seq,
            },
        );
    }

    /// Publishes the stores whose data writes completed: the slot is valid and its key
    /// indexed. A store is acknowledged here if its table entry is already on the device,
    /// else by the entry's page write (`on_table_done`).
    pub(super) fn finalize_stores(&mut self, cx: &mut Context<Op>) {
        let finished = std::mem::take(&mut self.finalize);
        for f in &finished {
            if cx.device_failed(f.d) {
                // Marked failed since the data write completed (its keys were unindexed then):
                // the block is dropped, as `on_written` drops one that completes later.
                self.drop_on_failed_device(cx, f.d, f.local, &f.job, f.item);
                continue;
            }
            if self.devs[f.d].slots[f.local as usize].entry == EntryState::Unwritten {
                // Completed before `write_entries` ran.
                self.write_store_entry(cx, f);
            }
            let s = &mut self.devs[f.d].slots[f.local as usize];
            s.state = SlotState::Valid;
            let durable = s.entry == EntryState::Durable;
            let key = s.key.expect("writing slot has a key");
            cx.publish_key(&key);
            cx.metrics()
                .dev(f.d)
                .blocks_stored
                .fetch_add(1, Ordering::Relaxed);
            if durable {
                cx.store_succeeded(&f.job, f.item, cx.block_bytes());
            }
        }
        self.finalize = finished;
        self.finalize.clear();
    }
}
