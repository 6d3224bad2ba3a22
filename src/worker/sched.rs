//! The scheduler of one worker, as one pure type: how many loads may be in flight, how many store
//! bytes may be, and how a store's block is cut into writes. It performs no I/O and reads no
//! clock; the worker asks it before every push and tells it about every completion.
//!
//! Policy:
//! * loads first: up to `load_inflight_max` reads in flight, always tried before any store;
//! * store bytes in flight stay under `store_inflight_max`, or under the smaller
//!   `store_inflight_max_while_loading` while any load is queued or in flight;
//! * the stores' guaranteed share: one store write may always be issued when none is in flight,
//!   so a load stream never starves stores;
//! * a store is one write per block when no load waits (cheapest), and chunks of
//!   `store_chunk_bytes` when loads wait (so a load never queues behind a whole large block).
//!   A block has at most 255 chunks (the chunk number travels in 8 bits of `user_data`).

use crate::config::{SchedulerConfig, MAX_STORE_CHUNKS};
use crate::job::KeyFailure;

#[derive(Clone, Debug)]
pub(crate) struct Scheduler {
    load_inflight_max: usize,
    store_inflight_max: u64,
    store_inflight_max_while_loading: u64,
    chunk_bytes: u64,
    block_bytes: u64,
    loads_in_flight: usize,
    store_bytes_in_flight: u64,
}

impl Scheduler {
    /// `chunk_bytes`: the derived store chunk ([`crate::config::Derived::store_chunk_bytes`]).
    pub fn new(cfg: &SchedulerConfig, block_bytes: u64, chunk_bytes: u64) -> Scheduler {
        debug_assert!(block_bytes.div_ceil(chunk_bytes) <= MAX_STORE_CHUNKS);
        Scheduler {
            load_inflight_max: cfg.load_inflight_max,
            store_inflight_max: cfg.store_inflight_max,
            store_inflight_max_while_loading: cfg.store_inflight_max_while_loading,
            chunk_bytes,
            block_bytes,
            loads_in_flight: 0,
            store_bytes_in_flight: 0,
        }
    }

    /// Ops a worker's table needs: every SQE and CQE slot of the ring, every load, and room for
    /// table and trailing (close) ops.
    pub fn ops_capacity(&self, ring_entries: usize) -> usize {
        ring_entries * 2 + self.load_inflight_max + 64
    }

    pub fn block_bytes(&self) -> u64 {
        self.block_bytes
    }

    /// The bytes of a store chunk while loads wait.
    pub fn chunk_bytes(&self) -> u64 {
        self.chunk_bytes
    }

    /// Counts one more load in flight if the cap allows; false, with nothing counted, if not.
    /// A load counted here that does not start after all is ended at once.
    pub fn start_load(&mut self) -> bool {
        let room = self.loads_in_flight < self.load_inflight_max;
        self.loads_in_flight += usize::from(room);
        room
    }

    pub fn load_ended(&mut self) {
        debug_assert!(self.loads_in_flight > 0, "a load ended that never started");
        self.loads_in_flight -= 1;
    }

    #[cfg(any(test, feature = "sim"))]
    pub fn loads_in_flight(&self) -> usize {
        self.loads_in_flight
    }

    /// Whether any load is in flight or (`loads_queued`) waiting in the queue.
    pub fn loads_waiting(&self, loads_queued: bool) -> bool {
        self.loads_in_flight > 0 || loads_queued
    }

    /// The store bytes allowed in flight now.
    pub fn store_cap(&self, loads_queued: bool) -> u64 {
        if self.loads_waiting(loads_queued) {
            self.store_inflight_max_while_loading
        } else {
            self.store_inflight_max
        }
    }

    /// Whether a store write of `bytes` may be issued now (always, when none is in flight).
    pub fn may_issue_store(&self, bytes: u64, loads_queued: bool) -> bool {
        self.store_bytes_in_flight == 0
            || self.store_bytes_in_flight + bytes <= self.store_cap(loads_queued)
    }

    /// The write plan of a store that starts writing now.
    pub fn plan_store(&self, loads_queued: bool) -> Chunks {
        let len = if self.loads_waiting(loads_queued) {
            self.chunk_bytes
        } else {
            self.block_bytes
        };
        Chunks {
            len,
            total: self.block_bytes.div_ceil(len) as u16,
            issued: 0,
            done: 0,
            failure: None,
        }
    }

    pub fn store_issued(&mut self, bytes: u64) {
        self.store_bytes_in_flight += bytes;
    }

    pub fn store_done(&mut self, bytes: u64) {
        debug_assert!(self.store_bytes_in_flight >= bytes);
        self.store_bytes_in_flight -= bytes;
    }

    #[cfg(any(test, feature = "sim"))]
    pub fn store_bytes_in_flight(&self) -> u64 {
        self.store_bytes_in_flight
    }
}

/// How one store's block is written: `total` writes of `len` bytes (the last may be shorter),
/// how many are issued and done, and the first failure.
#[derive(Clone, Debug)]
pub(crate) struct Chunks {
    pub len: u64,
    pub total: u16,
    pub issued: u16,
    pub done: u16,
    pub failure: Option<(KeyFailure, String)>,
}

impl Chunks {
    /// The plan of an op that writes no data (yet).
    pub const NONE: Chunks = Chunks {
        len: 0,
        total: 0,
        issued: 0,
        done: 0,
        failure: None,
    };

    /// Byte range `(start, len)` of chunk `chunk` within a block of `block_bytes`.
    pub fn range(&self, chunk: u16, block_bytes: u64) -> (u64, u64) {
        let start = u64::from(chunk) * self.len;
        (start, self.len.min(block_bytes - start))
    }

    pub fn all_issued(&self) -> bool {
        self.issued >= self.total
    }

    /// Every chunk that will be issued has been, and all of them completed.
    pub fn finished(&self) -> bool {
        self.issued == self.total && self.done == self.total
    }

    /// Stops issuing the rest (after a failure, or at shutdown); true if chunks were left.
    pub fn cut(&mut self) -> bool {
        let left = self.issued < self.total;
        self.total = self.issued;
        left
    }

    /// Records a failure; the first one is the one reported.
    pub fn fail(&mut self, reason: KeyFailure, detail: String) {
        self.failure.get_or_insert((reason, detail));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn sched(block: u64, chunk: u64) -> Scheduler {
        let chunk = crate::config::store_chunk_bytes(chunk, block);
        Scheduler::new(
            &SchedulerConfig {
                load_inflight_max: 2,
                store_inflight_max: 4 * MIB,
                store_inflight_max_while_loading: MIB,
                store_chunk_bytes: chunk,
                ioprio: true,
            },
            block,
            chunk,
        )
    }

    #[test]
    fn loads_are_capped_in_flight() {
        let mut s = sched(2 * MIB, 256 << 10);
        assert!(s.start_load());
        assert!(s.start_load());
        assert!(!s.start_load(), "the cap is 2");
        assert_eq!(s.loads_in_flight(), 2, "a refused start counts nothing");
        s.load_ended();
        assert_eq!(s.loads_in_flight(), 1);
        assert!(s.start_load());
        assert_eq!(s.loads_in_flight(), 2);
    }

    #[test]
    fn store_cap_shrinks_while_loads_wait() {
        let mut s = sched(2 * MIB, 256 << 10);
        assert_eq!(s.store_cap(false), 4 * MIB);
        assert_eq!(s.store_cap(true), MIB);
        assert!(s.start_load());
        assert_eq!(
            s.store_cap(false),
            MIB,
            "a load in flight counts as waiting"
        );
        s.load_ended();
        assert_eq!(s.store_cap(false), 4 * MIB);
    }

    #[test]
    fn one_store_write_is_always_allowed() {
        let mut s = sched(8 * MIB, 256 << 10);
        // Larger than either cap, but nothing is in flight: the guaranteed share.
        assert!(s.may_issue_store(8 * MIB, true));
        s.store_issued(8 * MIB);
        assert!(!s.may_issue_store(4096, false));
        s.store_done(8 * MIB);
        assert_eq!(s.store_bytes_in_flight(), 0);
        assert!(s.may_issue_store(8 * MIB, false));
    }

    #[test]
    fn store_bytes_stay_under_the_cap() {
        let mut s = sched(2 * MIB, 256 << 10);
        s.store_issued(3 * MIB);
        assert!(s.may_issue_store(MIB, false), "3 + 1 MiB fits 4 MiB");
        assert!(!s.may_issue_store(MIB + 1, false));
        assert!(
            !s.may_issue_store(256 << 10, true),
            "1 MiB cap while loading"
        );
    }

    #[test]
    fn whole_block_writes_unless_loads_wait() {
        let s = sched(2 * MIB, 256 << 10);
        let whole = s.plan_store(false);
        assert_eq!((whole.len, whole.total), (2 * MIB, 1));
        let chunked = s.plan_store(true);
        assert_eq!((chunked.len, chunked.total), (256 << 10, 8));
        assert_eq!(chunked.range(7, 2 * MIB), (7 * (256 << 10), 256 << 10));
    }

    #[test]
    fn chunks_are_bounded_and_aligned() {
        // 255 chunks at most: a 4 KiB chunk of a 2 GiB block is raised to a 4 KiB multiple.
        let s = sched(2048 * MIB, 4096);
        let plan = s.plan_store(true);
        assert!(plan.total <= 255, "{} chunks", plan.total);
        assert_eq!(s.chunk_bytes() % 4096, 0);
        // A chunk never exceeds the block; the last chunk of an uneven split is shorter.
        let s = sched(MIB + 4096, 4 * MIB);
        assert_eq!(s.chunk_bytes(), MIB + 4096);
        let s = sched(MIB + 4096, 512 << 10);
        let plan = s.plan_store(true);
        assert_eq!(plan.total, 3);
        assert_eq!(plan.range(2, MIB + 4096), (MIB, 4096));
    }

    #[test]
    fn cutting_a_store_stops_its_issue_and_keeps_the_first_failure() {
        let s = sched(2 * MIB, 256 << 10);
        let mut c = s.plan_store(true);
        c.issued = 3;
        c.done = 2;
        c.fail(KeyFailure::Shutdown, String::new());
        c.fail(KeyFailure::Checksum, "later".into());
        assert!(c.cut());
        assert!(c.all_issued());
        assert!(!c.finished(), "one issued chunk still in flight");
        c.done += 1;
        assert!(c.finished());
        assert!(matches!(c.failure, Some((KeyFailure::Shutdown, _))));
        assert!(!c.cut(), "nothing left to cut");
    }
}
