//! The table of a worker's in-flight operations, addressed by index and generation.

use std::time::{Duration, Instant};

use crate::clock::Clock;
use crate::job::JobState;
use kvtier_sys::blocks::LeaseHold;

/// A fixed table of in-flight ops addressed by index + generation (never by pointer), shared by
/// the slab and the files workers. `user_data` carries both, and a completion for a released or
/// reused slot is a bug caught by [`OpTable::decode`].
pub(crate) struct OpTable<T> {
    /// The live ops; a free slot holds none.
    ops: Vec<Option<T>>,
    gens: Vec<u32>,
    free: Vec<u32>,
    /// When each live op started: its deadline counts from here.
    born: Vec<Instant>,
    /// Whether each live op passed its deadline (and was reported).
    overdue: Vec<bool>,
    /// The leases an op holds until it completes (see [`OpTable::hold`]).
    holds: Vec<Vec<LeaseHold>>,
    /// Whether each live op is a load the worker started and counts in flight (until
    /// [`OpTable::take_load`]; `Context::release` ends it).
    load: Vec<bool>,
    /// Whether each live op ends with its one completion: [`OpTable::complete`] frees it and
    /// hands it over by value.
    once: Vec<bool>,
    /// What `born` is read from: the worker's clock (its deadlines and timeout window too).
    clock: Clock,
}

impl<T> OpTable<T> {
    pub fn new(capacity: usize, clock: Clock) -> OpTable<T> {
        OpTable {
            ops: std::iter::repeat_with(|| None).take(capacity).collect(),
            gens: vec![0; capacity],
            free: (0..capacity as u32).rev().collect(),
            born: vec![clock.now(); capacity],
            overdue: vec![false; capacity],
            holds: std::iter::repeat_with(Vec::new).take(capacity).collect(),
            load: vec![false; capacity],
            once: vec![false; capacity],
            clock,
        }
    }

    /// Takes a free slot, puts `op` in it and returns its index; `None` when all are in use.
    pub fn alloc(&mut self, op: T) -> Option<u32> {
        let idx = self.free.pop()?;
        let i = idx as usize;
        debug_assert!(self.ops[i].is_none());
        self.gens[i] = self.gens[i].wrapping_add(1);
        self.ops[i] = Some(op);
        self.born[i] = self.clock.now();
        self.overdue[i] = false;
        self.load[i] = false;
        self.once[i] = false;
        Some(idx)
    }

    /// Allocates `op` as a load the worker started (it counted it in flight, and it counts
    /// until the op ends: [`OpTable::take_load`]); `once`: it ends with its one completion
    /// ([`OpTable::complete`]). Returns its index and the `user_data` of its I/O.
    pub fn alloc_load(&mut self, op: T, once: bool) -> Option<(u32, u64)> {
        let idx = self.alloc(op)?;
        self.load[idx as usize] = true;
        self.once[idx as usize] = once;
        Some((idx, self.user_data(idx, 0)))
    }

    /// Frees load op `idx` before its I/O was queued: it never started, and the worker, which
    /// counted it, ends it.
    pub fn abandon(&mut self, idx: u32) {
        debug_assert!(self.load[idx as usize], "op {idx} is not a load");
        self.load[idx as usize] = false;
        self.release(idx);
    }

    /// Whether op `idx` was a load still counted in flight; it is not from now on.
    pub fn take_load(&mut self, idx: u32) -> bool {
        std::mem::replace(&mut self.load[idx as usize], false)
    }

    /// Frees op `idx`. A load still counted in flight is ended first (`Context::release`).
    pub fn release(&mut self, idx: u32) {
        let i = idx as usize;
        debug_assert!(
            !self.load[i],
            "load op {idx} released while counted in flight: release it with Context::release"
        );
        // What the op held (its job) goes now, not when the slot is reused.
        assert!(self.ops[i].take().is_some(), "op {idx} released twice");
        self.free_slot(idx);
    }

    /// Returns the slot of an op taken out of it to the free list.
    fn free_slot(&mut self, idx: u32) {
        // The kernel is done with the op's buffers: the leases it kept can go.
        self.holds[idx as usize].clear();
        self.free.push(idx);
    }

    /// The worker's time, on the clock the ops' deadlines run on.
    pub fn now(&self) -> Instant {
        self.clock.now()
    }

    /// Marks and returns the live ops older than `limit` at `now` that were not overdue yet.
    pub fn take_overdue(&mut self, now: Instant, limit: Duration) -> Vec<u32> {
        let mut out = Vec::new();
        for i in 0..self.ops.len() {
            if self.ops[i].is_some() && !self.overdue[i] && now.duration_since(self.born[i]) > limit
            {
                self.overdue[i] = true;
                out.push(i as u32);
            }
        }
        out
    }

    /// Whether every live op has passed its deadline (and had its keys failed by it).
    pub fn all_overdue(&self) -> bool {
        self.ops
            .iter()
            .zip(&self.overdue)
            .all(|(op, &o)| op.is_none() || o)
    }

    /// The first live op that `pick` chooses (a scan of the table: for rare paths).
    pub fn find_live(&self, pick: impl Fn(&T) -> bool) -> Option<u32> {
        (0..self.ops.len())
            .find(|&i| self.ops[i].as_ref().is_some_and(&pick))
            .map(|i| i as u32)
    }

    /// Op `idx` keeps `job`'s lease until it is released: an op past its deadline, or a store's
    /// data write whose key failed before it completed (the device may still read or write
    /// the job's blocks).
    pub fn hold(&mut self, idx: u32, job: &JobState) {
        if let Some(hold) = job.hold_lease() {
            self.holds[idx as usize].push(hold);
        }
    }

    /// Ops in use.
    #[cfg(any(test, feature = "sim"))]
    pub fn live(&self) -> usize {
        self.ops.iter().filter(|op| op.is_some()).count()
    }

    /// The indexes of the ops in use.
    #[cfg(any(test, feature = "sim"))]
    pub fn live_indexes(&self) -> Vec<u32> {
        (0..self.ops.len() as u32)
            .filter(|&i| self.ops[i as usize].is_some())
            .collect()
    }

    pub fn user_data(&self, idx: u32, chunk: u16) -> u64 {
        encode_user_data(idx, self.gens[idx as usize], chunk)
    }

    /// Decodes a completion's `user_data` (see [`OpTable::decode`]). An op that ends with its
    /// one completion is freed here and handed over; any other stays live.
    pub fn complete(&mut self, user_data: u64) -> Completed<T> {
        let (idx, chunk) = self.decode(user_data);
        let i = idx as usize;
        if !self.once[i] {
            return Completed::Live { idx, chunk };
        }
        let op = self.ops[i].take().expect("a live op");
        let load = std::mem::replace(&mut self.load[i], false);
        let holds = std::mem::take(&mut self.holds[i]);
        self.free_slot(idx);
        Completed::Ended { op, load, holds }
    }

    /// Decodes `user_data`, asserting that it names a live op of the current generation.
    pub fn decode(&self, user_data: u64) -> (u32, u16) {
        let (idx, chunk, gen) = decode_user_data(user_data);
        let i = idx as usize;
        assert!(
            self.ops[i].is_some() && self.gens[i] == gen,
            "completion for a stale op {idx} gen {gen}"
        );
        (idx, chunk)
    }
}

/// What a completion was for ([`OpTable::complete`]).
pub(crate) enum Completed<T> {
    /// Op `idx`, which goes on (its layout releases it); `chunk`: which write of a store.
    Live { idx: u32, chunk: u16 },
    /// An op that ended with this completion, freed from the table; `load`: it was a load the
    /// worker counted in flight, which ends now. `holds`: the leases the op kept (an op past its
    /// deadline keeps its job's blocks), to drop once its completion is handled, since handling
    /// it may still read them (a checksum).
    Ended {
        op: T,
        load: bool,
        holds: Vec<LeaseHold>,
    },
}

/// A live op by index (a free slot is a bug: it panics).
impl<T> std::ops::Index<usize> for OpTable<T> {
    type Output = T;
    fn index(&self, i: usize) -> &T {
        self.ops[i].as_ref().expect("op index names a live op")
    }
}

impl<T> std::ops::IndexMut<usize> for OpTable<T> {
    fn index_mut(&mut self, i: usize) -> &mut T {
        self.ops[i].as_mut().expect("op index names a live op")
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// An op holding `held` (as an op holds its job), tagged.
    struct Op {
        tag: u32,
        held: Arc<()>,
    }

    fn op(tag: u32) -> Op {
        Op {
            tag,
            held: Arc::new(()),
        }
    }

    fn table(n: usize) -> (OpTable<Op>, Clock) {
        let clock = Clock::manual();
        (OpTable::new(n, clock.clone()), clock)
    }

    /// The table holds as many ops as it was made for; a released slot is reused with a new
    /// generation, what its op held dropped at the release; user_data names the op and its
    /// chunk.
    #[test]
    fn slots_are_reused_under_a_new_generation() {
        let (mut t, _) = table(2);
        let first = op(1);
        let held = Arc::clone(&first.held);
        let a = t.alloc(first).expect("room");
        let b = t.alloc(op(2)).expect("room");
        assert!(t.alloc(op(3)).is_none(), "full");
        assert_eq!(t.live(), 2);
        let ud = t.user_data(a, 5);
        assert_eq!(t.decode(ud), (a, 5));
        assert_eq!(Arc::strong_count(&held), 2);
        t.release(a);
        assert_eq!(
            Arc::strong_count(&held),
            1,
            "a released op drops what it held"
        );
        assert_eq!(t.live_indexes(), [b]);
        let c = t.alloc(op(4)).expect("the slot is free again");
        assert_eq!(c, a, "the freed slot is reused");
        assert_eq!(t[c as usize].tag, 4);
        assert_ne!(t.user_data(c, 5), ud, "a new generation");
        assert_eq!(t.decode(t.user_data(c, 0)), (c, 0));
    }

    /// A completion that names an op released since (an old generation) is a bug: decode
    /// refuses it.
    #[test]
    #[should_panic(expected = "completion for a stale op")]
    fn a_completion_for_a_reused_slot_is_refused() {
        let (mut t, _) = table(1);
        let a = t.alloc(op(1)).expect("room");
        let stale = t.user_data(a, 0);
        t.release(a);
        t.alloc(op(2)).expect("room");
        let _ = t.decode(stale);
    }

    /// A load counts in flight from `alloc_load` until `take_load`, once.
    #[test]
    fn a_load_is_taken_once() {
        let (mut t, _) = table(2);
        let a = t.alloc(op(1)).expect("room");
        assert!(!t.take_load(a), "not a load: allocated as an op");
        t.release(a);
        let (a, ud) = t.alloc_load(op(1), false).expect("room");
        assert_eq!(t.decode(ud), (a, 0), "the user_data of its I/O");
        assert!(t.take_load(a));
        assert!(!t.take_load(a), "taken once");
        t.release(a);
    }

    /// An op that ends with its completion is freed by it and handed over (a load with its
    /// load flag); any other stays live. A load that never started is abandoned, not ended.
    #[test]
    fn an_op_of_one_completion_leaves_the_table_with_it() {
        let (mut t, _) = table(3);
        let first = op(1);
        let held = Arc::clone(&first.held);
        let (once, ud_once) = t.alloc_load(first, true).expect("room");
        let (kept, ud_kept) = t.alloc_load(op(2), false).expect("room");
        match t.complete(ud_once) {
            Completed::Ended { op, load, holds } => {
                assert_eq!(op.tag, 1);
                assert!(holds.is_empty(), "it kept no lease");
                assert!(load, "a load the worker counted");
                assert_eq!(Arc::strong_count(&held), 2, "handed over whole");
                drop(op);
                assert_eq!(Arc::strong_count(&held), 1);
            }
            Completed::Live { .. } => panic!("op {once} ends with its completion"),
        }
        assert_eq!(t.live_indexes(), [kept], "freed by its completion");
        match t.complete(ud_kept) {
            Completed::Live { idx, chunk } => assert_eq!((idx, chunk), (kept, 0)),
            Completed::Ended { .. } => panic!("op {kept} goes on"),
        }
        assert!(t.take_load(kept));
        t.release(kept);
        let (lost, _) = t.alloc_load(op(3), true).expect("room");
        t.abandon(lost);
        assert_eq!(t.live(), 0, "freed without a completion");
    }

    /// Ops past their deadline are reported once each, by age on the table's clock; the table
    /// is all overdue only when every live op is.
    #[test]
    fn overdue_ops_are_reported_once() {
        let (mut t, clock) = table(3);
        let old = t.alloc(op(1)).expect("room");
        clock.advance(Duration::from_millis(10));
        let young = t.alloc(op(2)).expect("room");
        let limit = Duration::from_millis(5);
        assert_eq!(t.take_overdue(t.now(), limit), [old]);
        assert!(!t.all_overdue(), "the young op is not overdue");
        assert!(t.take_overdue(t.now(), limit).is_empty(), "reported once");
        clock.advance(Duration::from_millis(6));
        assert_eq!(t.take_overdue(t.now(), limit), [young]);
        assert!(t.all_overdue());
        t.release(old);
        let fresh = t.alloc(op(3)).expect("room");
        assert!(
            !t.all_overdue(),
            "a new op in a reused slot starts its own deadline"
        );
        assert!(t.take_overdue(t.now(), limit).is_empty());
        assert_eq!(t.find_live(|o| o.tag == 3), Some(fresh));
        assert_eq!(t.find_live(|o| o.tag == 9), None);
    }

    #[test]
    fn user_data_round_trips_at_the_field_limits() {
        for (idx, gen, chunk) in [(0, 0, 0), ((1 << 24) - 1, u32::MAX, 255), (12345, 7, 3)] {
            assert_eq!(
                decode_user_data(encode_user_data(idx, gen, chunk)),
                (idx, chunk, gen)
            );
        }
    }
}
