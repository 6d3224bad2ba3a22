//! The seam between the worker and a device layout: what a layout does (start a load or a
//! store, take a completion, evict, recover), what its op offers the worker, and what starting
//! a key did.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::job::{JobState, KeyFailure};
use crate::key::Key;

use super::{Chunks, Context};

/// Why a layout frees a stored key (slab slot, or file): for the metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Removal {
    /// To make room.
    Evicted,
    /// The caller asked ([`crate::Engine::remove`]).
    Asked,
}

impl Removal {
    /// Counts one on device metrics `m` (`evictions` or `removals`).
    pub(crate) fn count(self, m: &crate::metrics::DeviceMetrics) {
        match self {
            Removal::Evicted => &m.evictions,
            Removal::Asked => &m.removals,
        }
        .fetch_add(1, Ordering::Relaxed);
    }
}

/// What starting a load or a store did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Start {
    /// I/O was queued for a store's key.
    Started,
    /// I/O was queued for a load's key, in an op allocated with `OpTable::alloc_load`: the load
    /// the worker counted in flight as it took the key ends when the op does (its release,
    /// [`Context::end_load`], or its one completion).
    Loading,
    /// The key was answered without I/O (a miss, already stored, a clear failure).
    Resolved,
    /// No room now (ring, op table, space being freed): try again next turn.
    Blocked,
}

/// What a layout's op offers the worker.
pub(crate) trait LayoutOp {
    /// The chunk plan of a store whose data write is under way; `None` for any other op or step.
    fn writing(&mut self) -> Option<&mut Chunks>;

    /// The device the op runs on.
    fn device(&self) -> usize;
}

/// What a device layout does; the worker does the rest. Every method runs on the worker thread
/// and must not block (I/O goes through `cx.backend()`).
pub(crate) trait Layout {
    type Op: LayoutOp;

    /// Starts loading `item` of `job` into its region block.
    fn start_load(&mut self, cx: &mut Context<Self::Op>, job: &Arc<JobState>, item: usize)
        -> Start;

    /// Starts storing `item` of `job`; `retried`: a second try after evicting (ENOSPC). A store
    /// that is ready to write its data calls [`Context::begin_writing`].
    fn start_store(
        &mut self,
        cx: &mut Context<Self::Op>,
        job: &Arc<JobState>,
        item: usize,
        retried: bool,
    ) -> Start;

    /// Pushes the write of bytes `start..start + len` of store `idx`'s block (chunk `chunk`);
    /// false if the submission queue is full.
    fn push_chunk(
        &mut self,
        cx: &mut Context<Self::Op>,
        idx: u32,
        chunk: u16,
        start: u64,
        len: u64,
    ) -> bool;

    /// Every chunk of store `idx` completed (`failure`: the first that failed, or the stop).
    fn on_written(
        &mut self,
        cx: &mut Context<Self::Op>,
        idx: u32,
        failure: Option<(KeyFailure, String)>,
    );

    /// A completion of any op that is not a store's data write and goes on after it.
    fn on_complete(&mut self, cx: &mut Context<Self::Op>, idx: u32, result: i32);

    /// The completion that ended `op`, one allocated to end with it (`OpTable::alloc_load` with
    /// `once`), already freed from the table and handed over.
    fn on_ended(&mut self, cx: &mut Context<Self::Op>, op: Self::Op, result: i32);

    /// The caller used `key`: keep it longer.
    fn touch(&mut self, key: Key);

    /// Every key stored (published) now.
    fn keys(&self) -> Vec<Key>;

    /// Removes `key` if it is stored and no I/O is reading it: unpublished and its slot or
    /// file freed as an eviction frees it (without demotion to the cold tier), a removed event
    /// sent. False when it is not stored here or busy.
    fn remove(&mut self, cx: &mut Context<Self::Op>, key: Key) -> bool;

    /// Finds out whether `keys` (not indexed here) are on the devices, and answers in
    /// `cx.unindexed` (each with its question's generation); a key found is indexed and
    /// published. Only the files layout is asked; by default every key is absent.
    fn probe(&mut self, cx: &mut Context<Self::Op>, keys: Vec<(Key, u64)>) {
        for (key, generation) in keys {
            cx.unindexed
                .answer(key, generation, crate::verdicts::Verdict::Absent);
            cx.me.probes_outstanding.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Pushes what earlier found the submission queue full; true if anything moved.
    fn unstall(&mut self, cx: &mut Context<Self::Op>) -> bool {
        let _ = cx;
        false
    }

    /// The layout's own work after loads and stores were issued (table pages); true if any.
    fn background(&mut self, cx: &mut Context<Self::Op>) -> bool {
        let _ = cx;
        false
    }

    /// Runs after each submit: work that must not delay the next I/O (checksums of finished
    /// stores).
    fn after_submit(&mut self, cx: &mut Context<Self::Op>) {
        let _ = cx;
    }

    /// Whether the layout has nothing left to do (the worker may exit when stopping).
    fn idle(&self) -> bool;

    /// Names op `idx` for an error message: the device (path) and the operation.
    fn describe_op(&self, cx: &Context<Self::Op>, idx: u32) -> String;

    /// Names device `d` for a log line (`devices[d]` and its path).
    fn device_name(&self, d: usize) -> String;

    /// The callers' keys that op `idx`, past its deadline, keeps waiting: each with whether the
    /// op may still move bytes of its region block (then the job's lease is held until the op
    /// completes). Empty for the layout's own I/O that no key waits on.
    fn overdue_keys(&self, cx: &Context<Self::Op>, idx: u32) -> Vec<(Arc<JobState>, usize, bool)>;

    /// Fails (`KeyFailure::Timeout`) what waited longer than `limit` with no op of its own to
    /// carry a deadline (the slab's stores whose table page write could not be queued); true
    /// if any key failed. Nothing by default.
    fn expire_waiting(
        &mut self,
        cx: &mut Context<Self::Op>,
        now: Instant,
        limit: Duration,
    ) -> bool {
        let _ = (cx, now, limit);
        false
    }

    /// Device `d` was marked failed (`cx.device_failed(d)` is true from now on): its keys
    /// become misses; new stores go elsewhere or fail.
    fn device_failed(&mut self, cx: &mut Context<Self::Op>, d: usize);

    /// For the simulator, once the worker is idle: what the layout would have leaked.
    #[cfg(any(test, feature = "sim"))]
    fn check_quiet(&self, cx: &Context<Self::Op>) -> Result<(), String>;
}
