//! The parts of a worker that the engine handle and other threads see, and the worker's sleep.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Receiver;
use crossbeam_utils::CachePadded;

use crate::io::{EventFd, IoBackend, Region};
use crate::job::JobState;
use crate::metrics::WorkerMetrics;
use crate::worker::published::PublishedKeys;
use crate::worker::queue::Msg;
use crate::worker::unindexed::UnindexedView;

/// The parts of a worker that the engine handle sees. `sleeping` (written by the worker, read by
/// every submitter) and `queued_blocks` (written by both) sit on cache lines of their own, so
/// neither bounces the line the other one or the metrics live on.
pub(crate) struct WorkerShared {
    pub published: Arc<PublishedKeys>,
    pub metrics: WorkerMetrics,
    pub sleeping: CachePadded<AtomicBool>,
    pub wake: Arc<EventFd>,
    pub queued_blocks: CachePadded<AtomicUsize>,
    pub tid: AtomicI32,
    /// The files layout: what the worker learnt of keys it has not indexed, which another
    /// process may have published (`Msg::Probe` asks the worker; a `statx` on its ring
    /// answers). Callers read it without a lock; the worker alone writes it.
    pub unindexed: UnindexedView,
    /// Questions sent to the worker (`Msg::Probe`) and not answered yet: callers ask no more
    /// past [`PROBES_OUTSTANDING_MAX`] (they answer Miss), so the worker's queue is bounded.
    pub probes_outstanding: AtomicUsize,
}

/// Lookups' questions a worker may have outstanding.
pub(crate) const PROBES_OUTSTANDING_MAX: usize = 4096;

impl WorkerShared {
    /// A worker's shared parts; its metrics count `devices` devices.
    pub fn new(wake: Arc<EventFd>, devices: usize) -> WorkerShared {
        WorkerShared {
            published: Arc::new(PublishedKeys::default()),
            metrics: WorkerMetrics::new(devices),
            sleeping: CachePadded::new(AtomicBool::new(false)),
            wake,
            queued_blocks: CachePadded::new(AtomicUsize::new(0)),
            tid: AtomicI32::new(0),
            probes_outstanding: AtomicUsize::new(0),
            unindexed: UnindexedView::new(
                crate::config::FilesConfig::DEFAULT_LOOKUP_CACHE_MAX,
                Duration::from_millis(crate::config::FilesConfig::DEFAULT_LOOKUP_TTL_MS),
                crate::clock::Clock::default(),
            ),
        }
    }

    /// Bounds the answers kept for keys not indexed: at most `max`, asked again after `ttl` on
    /// `clock` (the monotonic clock; the simulator's own).
    #[must_use]
    pub fn with_lookup_cache(
        mut self,
        max: usize,
        ttl: Duration,
        clock: crate::clock::Clock,
    ) -> WorkerShared {
        self.unindexed = UnindexedView::new(max, ttl, clock);
        self
    }

    /// Wakes the worker if it is (about to be) asleep. Pairs with the fence in
    /// [`ready_to_sleep`]. The first nudge of a sleep clears the flag and writes the eventfd;
    /// the ones after it, before the worker is up again, see the flag clear and skip the system
    /// call: the worker drains its whole queue when it wakes, so their work is not missed.
    pub fn nudge(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::SeqCst) && self.sleeping.swap(false, Ordering::SeqCst) {
            self.wake.notify();
        }
    }
}

/// Counts the CPU time of a thread from `/proc/self/task/<tid>/schedstat` (nanoseconds).
pub(crate) fn thread_cpu_ns(tid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat"))
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

/// Whether the worker may sleep in its next submit: not if its turn moved anything, nor if
/// work is queued (its channel, or `other_work`). When it may, the sleeping flag is set first
/// and the queues checked after it, so whoever adds work after the check sees the flag and
/// wakes the wait ([`WorkerShared::nudge`]); [`awake`] clears it.
pub(crate) fn ready_to_sleep(
    me: &WorkerShared,
    rx: &Receiver<Msg>,
    progress: bool,
    other_work: impl Fn() -> bool,
) -> bool {
    if progress {
        return false;
    }
    me.sleeping.store(true, Ordering::SeqCst);
    std::sync::atomic::fence(Ordering::SeqCst);
    rx.is_empty() && !other_work()
}

/// After the submit that [`ready_to_sleep`] prepared (`waited`: it was allowed to sleep): the
/// flag cleared, the ring's enters and sleeps counted.
pub(crate) fn awake(backend: &dyn IoBackend, me: &WorkerShared, waited: bool) {
    me.sleeping.store(false, Ordering::SeqCst);
    me.metrics
        .submits
        .store(backend.enters(), Ordering::Relaxed);
    match backend.sleeps() {
        Some(slept) => me.metrics.wakeups.store(slept, Ordering::Relaxed),
        None if waited => {
            me.metrics.wakeups.fetch_add(1, Ordering::Relaxed);
        }
        None => {}
    }
}

/// crc32c of `len` bytes at `offset` of the primary region, in a block of `job`: read through
/// the job's lease when it holds one (a load's blocks are held exclusively, so only the lease
/// reaches them), else through the region.
pub(crate) fn block_crc(job: &JobState, region: &Region, offset: usize, len: usize) -> u32 {
    match job.lease() {
        Some(lease) => lease.with_bytes(offset, len, crate::checksum::crc32c),
        None => region.with_bytes(offset, len, crate::checksum::crc32c),
    }
}
