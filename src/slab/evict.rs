//! Slots of the slab layout: allocation, CLOCK eviction, and demotion of victims to the cold
//! tier (`s3.write = "on_evict"`).

use std::sync::atomic::Ordering;

use crate::io::{IoClass, IoKind, IoRequest};
use crate::key::Key;
use crate::worker::{Context, Demote, Removal, BUF_STAGING};

use super::layout::{describe_result, Op, OpKind, SlabLayout, SlotState};

impl SlabLayout {
    /// A free slot on device `d`: from the free list, else by evicting (with demotion: `None`
    /// while the victim is read out; the store waits for that read).
    pub(super) fn alloc_slot(&mut self, cx: &mut Context<Op>, d: usize) -> Option<u32> {
        if let Some(s) = self.devs[d].slots.take_free() {
            return Some(s);
        }
        if cx.demoting().is_some() {
            return self.demote_for_slot(cx, d);
        }
        let victim = self.clock_victim(d)?;
        self.evict(cx, d, victim, Removal::Evicted);
        self.devs[d].slots.take_free()
    }

    /// With demotion: starts reading a victim into a staging slot and returns `None` (the store
    /// waits for that read, after which the slot is free). Without a staging slot and with no
    /// demotion in flight (the S3 tier has not copied earlier ones out yet), evicts without
    /// demoting, counted, so a slow object store never stalls NVMe stores.
    fn demote_for_slot(&mut self, cx: &mut Context<Op>, d: usize) -> Option<u32> {
        let waiting = cx.demotion_will_free();
        let staging = cx.demote().and_then(Demote::take_staging);
        let Some(staging) = staging else {
            if waiting {
                return None;
            }
            let victim = self.clock_victim(d)?;
            cx.metrics()
                .demotions_dropped
                .fetch_add(1, Ordering::Relaxed);
            self.evict(cx, d, victim, Removal::Evicted);
            return self.devs[d].slots.take_free();
        };
        let give_back = |cx: &mut Context<Op>| {
            if let Some(m) = cx.demote() {
                m.put_back(staging);
            }
        };
        let Some(victim) = self.clock_victim(d) else {
            give_back(cx);
            return None;
        };
        let Some(idx) = cx.ops.alloc(Op::new(OpKind::Demote { staging })) else {
            give_back(cx);
            return None;
        };
        let bytes = cx.block_bytes() as usize;
        let Some(buf) = cx.demoting().and_then(|m| {
            m.staging
                .checkout(staging as usize * bytes, bytes, true)
                .ok()
        }) else {
            unreachable!("a free staging slot is the worker's, unclaimed");
        };
        let req = IoRequest {
            user_data: cx.ops.user_data(idx, 0),
            kind: IoKind::Read,
            device: d as u16,
            offset: self.devs[d].slot_offset(victim),
            region: BUF_STAGING,
            buf,
            class: IoClass::Store,
        };
        if !cx.backend().block_queue().push(req) {
            cx.ops.release(idx);
            give_back(cx);
            return None;
        }
        let op = &mut cx.ops[idx as usize];
        op.dev = d as u16;
        op.slot = victim;
        self.devs[d].slots.pin(victim);
        if let Some(m) = cx.demote() {
            m.started();
        }
        None
    }

    pub(super) fn on_demote_done(
        &mut self,
        cx: &mut Context<Op>,
        idx: u32,
        staging: u32,
        result: i32,
    ) {
        let op = &cx.ops[idx as usize];
        let (d, local) = (op.dev as usize, op.slot);
        cx.ops.release(idx);
        // A slot doomed while this read ran is freed by its last unpin, whichever read that
        // is (a demotion's read once left it doomed for good: the simulator's seed 21365).
        self.devs[d].slots.unpin(local);
        let slot = &self.devs[d].slots[local as usize];
        let read_ok = result == cx.block_bytes() as i32;
        let still_valid = slot.state == SlotState::Valid && slot.pins == 0;
        let demoted = slot
            .key
            .filter(|_| read_ok && still_valid)
            .map(|k| (k, Some(slot.crc)));
        let block_bytes = cx.block_bytes() as usize;
        let me = cx.worker_shared();
        let Some(m) = cx.demote() else {
            return;
        };
        if m.finished(staging, block_bytes, demoted, &me) {
            me.metrics.demotions.fetch_add(1, Ordering::Relaxed);
        } else if !read_ok {
            me.metrics.demotions_dropped.fetch_add(1, Ordering::Relaxed);
            cx.log_error(&format!(
                "reading evicted slot {local} of device {d} for demotion: {}",
                describe_result(result)
            ));
        }
        let slot = self.devs[d].slots[local as usize];
        if slot.state == SlotState::Valid && slot.pins == 0 {
            self.evict(cx, d, local, Removal::Evicted);
        }
    }

    fn clock_victim(&mut self, d: usize) -> Option<u32> {
        self.devs[d].slots.clock_victim()
    }

    /// Frees valid, unpinned slot `local` of device `d`: unpublished, its table entry cleared
    /// (written with the next table page write), a removed event sent.
    pub(super) fn evict(&mut self, cx: &mut Context<Op>, d: usize, local: u32, why: Removal) {
        let key = self.devs[d].slots[local as usize]
            .key
            .expect("valid slot has a key");
        self.unindex(cx, key, d, local);
        self.clear_entry(d, local);
        self.free_slot(d, local);
        let m = cx.metrics().dev(d);
        why.count(m);
        m.blocks_stored.fetch_sub(1, Ordering::Relaxed);
        cx.announce_removed(vec![key]);
    }

    /// Removes `key` from the index and the published keys, if the index names slot `local`
    /// of device `d`: a key stored again elsewhere after this copy was unindexed (its device
    /// was marked failed) belongs to the new copy.
    pub(super) fn unindex(&mut self, cx: &mut Context<Op>, key: Key, d: usize, local: u32) {
        if self.index.unpoint(&key, (d as u16, local)) {
            cx.withdraw_key(&key);
        }
    }

    pub(super) fn free_slot(&mut self, d: usize, local: u32) {
        self.devs[d].slots.free(local);
    }
}
