//! [`Context`]: the parts of a worker a layout acts through (its ring, op table, scheduler and
//! queues), and the reporting every layout shares: load and store outcomes, device errors and
//! timeouts, the rate-limited error log.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::io::{IoBackend, IoBuf, Region};
use crate::job::{JobState, KeyFailure, Shared};
use crate::metrics::WorkerMetrics;

use super::{
    Demote, LayoutOp, OpTable, Part, Publisher, Scheduler, Unindexed, WorkQueue, WorkerShared,
};
use crate::config::FirstLookup;
use crate::key::Key;

/// The parts of a worker a layout acts through. Its op table is the layout's own (`O` is the
/// layout's op type); the rest is the worker's, reached through the methods below.
pub(crate) struct Context<O> {
    pub(super) id: usize,
    pub(super) backend: Box<dyn IoBackend>,
    /// The node's regions, by `RegionId`: a job's blocks are in its client's.
    pub(super) regions: Vec<Arc<Region>>,
    pub(super) shared: Arc<Shared>,
    pub(super) me: Arc<WorkerShared>,
    pub ops: OpTable<O>,
    pub(super) sched: Scheduler,
    pub(super) block_bytes: u64,
    pub(super) loads: WorkQueue,
    pub(super) stores: WorkQueue,
    /// Stores to try once more after evicting (ENOSPC), ahead of new ones.
    pub(super) retry: VecDeque<(Arc<JobState>, usize)>,
    /// Store ops with chunks still to issue, oldest first.
    pub(super) store_issuing: VecDeque<u32>,
    pub(super) stopping: bool,
    pub(super) demote: Option<Demote>,
    /// Publishes the keys this worker holds to callers (`Engine::lookup`).
    pub(super) publisher: Publisher,
    /// The files layout's answers for keys not indexed, published to callers.
    pub(super) unindexed: Unindexed,
    /// `io_timeout_ms`: the deadline of every op, from its start.
    pub(super) io_timeout: Duration,
    /// Devices marked failed (bit d), after repeated timeouts.
    pub(super) failed: u64,
    /// Recent timeouts per device, oldest first (for marking a device failed).
    pub(super) timeouts: Vec<VecDeque<Instant>>,
    pub(super) error_log: crate::logs::RateLimit,
}

/// A device with this many timeouts within [`FAILURE_WINDOW_DEADLINES`] deadlines is marked
/// failed.
pub(super) const FAIL_AFTER_TIMEOUTS: usize = 3;
pub(super) const FAILURE_WINDOW_DEADLINES: u32 = 10;

impl<O: LayoutOp> Context<O> {
    /// The questions to put to the devices for `keys` that lookups asked about (each with its
    /// generation): one per key until its answer, however many lookups asked meanwhile. Keys
    /// already asked about leave the callers' count of outstanding questions here.
    pub fn questions(&mut self, keys: Vec<Key>, first: FirstLookup) -> Vec<(Key, u64)> {
        let asked = keys.len();
        let out: Vec<(Key, u64)> = keys
            .into_iter()
            .filter_map(|k| self.unindexed.question(k, first).map(|g| (k, g)))
            .collect();
        self.me
            .probes_outstanding
            .fetch_sub(asked - out.len(), Ordering::AcqRel);
        out
    }

    /// The device's I/O queues: where a layout pushes its reads, writes and file operations.
    pub fn backend(&mut self) -> &mut (dyn IoBackend + 'static) {
        &mut *self.backend
    }

    /// Operations pushed and not completed.
    pub fn in_flight(&self) -> usize {
        self.backend.in_flight()
    }

    /// The size of every block.
    pub fn block_bytes(&self) -> u64 {
        self.block_bytes
    }

    /// The worker's counters.
    pub fn metrics(&self) -> &WorkerMetrics {
        &self.me.metrics
    }

    /// What other threads see of the worker (held where its counters are needed across
    /// changes to the context).
    pub fn worker_shared(&self) -> Arc<WorkerShared> {
        Arc::clone(&self.me)
    }

    /// The worker is stopping: no new work, what is left is drained.
    pub fn stopping(&self) -> bool {
        self.stopping
    }

    /// No load or store waits to be issued, no store has chunks left to issue, and no I/O is
    /// in flight.
    pub fn quiet(&self) -> bool {
        self.stores.is_empty()
            && self.loads.is_empty()
            && self.store_issuing.is_empty()
            && self.backend.in_flight() == 0
    }

    /// Store `item` of `job` is tried once more (after evicting), ahead of new stores.
    pub fn retry_store(&mut self, job: Arc<JobState>, item: usize) {
        self.retry.push_back((job, item));
    }

    /// Makes `key` visible to lookups (stored or found here).
    pub fn publish_key(&mut self, key: &Key) {
        self.publisher.insert(key);
    }

    /// Withdraws `key` from lookups.
    pub fn withdraw_key(&mut self, key: &Key) {
        self.publisher.remove(key);
    }

    /// Whether `key` is visible to lookups (a layout's own check).
    #[cfg(any(test, feature = "sim"))]
    pub fn is_published(&self, key: &Key) -> bool {
        self.publisher.contains(key)
    }

    /// How many keys are visible to lookups (a layout's own check).
    #[cfg(any(test, feature = "sim"))]
    pub fn published_len(&self) -> usize {
        self.publisher.len()
    }

    /// The block event stream: `keys` left this tier.
    pub fn announce_removed(&self, keys: Vec<Key>) {
        self.shared.events.push(keys, true);
    }

    /// Fails `item` of `job` for `reason` without I/O.
    pub fn fail_item(&self, job: &JobState, item: usize, reason: KeyFailure) {
        job.fail(&self.shared, item, reason, String::new());
    }

    /// The files layout's answers for keys it has not indexed.
    pub fn unindexed(&mut self) -> &mut Unindexed {
        &mut self.unindexed
    }

    /// A question lookups sent was taken off the worker's queue (answered, dropped or started).
    pub fn question_taken(&self) {
        self.me.probes_outstanding.fetch_sub(1, Ordering::AcqRel);
    }

    /// Demotion to the cold tier (`s3.write = "on_evict"`), if configured.
    pub fn demote(&mut self) -> Option<&mut Demote> {
        self.demote.as_mut()
    }

    /// Demotion's staging slots, if configured.
    pub fn demoting(&self) -> Option<&Demote> {
        self.demote.as_ref()
    }

    /// Whether a demotion in flight will free a staging slot (so waiting for one is worth it).
    pub fn demotion_will_free(&self) -> bool {
        self.demote.as_ref().is_some_and(Demote::will_free)
    }

    /// The worker gives up waiting for I/O past its deadline at a stop: counted for
    /// `Engine::shutdown`'s report (the worker, its ring and the region are leaked).
    pub fn give_up(&self) {
        self.shared.workers_gave_up.fetch_add(1, Ordering::AcqRel);
        self.shared
            .ops_given_up
            .fetch_add(self.backend.in_flight(), Ordering::AcqRel);
    }

    /// The claim of one transfer on `len` bytes at `offset` of the primary region, in blocks of
    /// `job` (a claim to write them if `device_writes`: a read from the device). The backend
    /// keeps it until it returns the transfer's completion, so the blocks stay leased that
    /// long, however early the job is reported. Panics if the bytes are not the job's.
    pub fn claim(&self, job: &JobState, offset: usize, len: usize, device_writes: bool) -> IoBuf {
        let lease = job
            .lease()
            .expect("a job whose blocks reach a device holds a lease on them");
        debug_assert!(lease.is_on(self.region_of(job)));
        lease
            .checkout(offset, len, device_writes)
            .expect("a job's blocks went back while an op of it was still issuing")
    }

    /// The region `job`'s blocks are in.
    pub fn region_of(&self, job: &JobState) -> &Arc<Region> {
        &self.regions[usize::from(job.region)]
    }

    /// The claim on job block `block`, whole.
    pub fn claim_block(&self, job: &JobState, block: u32, device_writes: bool) -> IoBuf {
        let bytes = self.block_bytes as usize;
        self.claim(job, block as usize * bytes, bytes, device_writes)
    }

    /// Ends load op `idx` in the scheduler now, if it is still counted (an op that goes on as
    /// something else ends its load early); nothing for any other op.
    pub fn end_load(&mut self, idx: u32) {
        if self.ops.take_load(idx) {
            self.sched.load_ended();
        }
    }

    /// Frees op `idx`, ending the load it was, if any: the worker ends what it started, so a
    /// layout never has to remember to.
    pub fn release(&mut self, idx: u32) {
        self.end_load(idx);
        self.ops.release(idx);
    }

    /// Store `idx` is ready to write its data: plans its chunks and queues it for issue.
    pub fn begin_writing(&mut self, idx: u32) {
        let plan = self.sched.plan_store(!self.loads.is_empty());
        let chunks = self.ops[idx as usize]
            .writing()
            .expect("a store that begins writing is in its write step");
        *chunks = plan;
        self.store_issuing.push_back(idx);
    }

    /// A load's read from device `d` completed with `result` (of `wanted` bytes) and the key's
    /// `outcome` (the read's, or its checksum's): counts the read, records the device's health
    /// (a failed read is the device's error, a checksum that does not match is not; `name`
    /// names the device in the log) and reports the key.
    #[allow(clippy::too_many_arguments)]
    pub fn load_done(
        &self,
        job: &Arc<JobState>,
        item: usize,
        d: usize,
        started: Instant,
        (result, wanted): (i32, u64),
        outcome: Result<(), (KeyFailure, String)>,
        name: &str,
    ) {
        let m = self.me.metrics.dev(d);
        m.read_ops.fetch_add(1, Ordering::Relaxed);
        if let Err((KeyFailure::Io(_) | KeyFailure::ShortIo { .. }, detail)) = &outcome {
            m.count_result(result, wanted);
            self.device_error(d, detail);
        } else {
            m.bytes_read.fetch_add(wanted, Ordering::Relaxed);
            self.device_ok(d, || name.to_owned());
        }
        self.report_load(job, item, d, started, outcome);
    }

    /// Reports a load's outcome and records its latency on device `device`.
    pub fn report_load(
        &self,
        job: &Arc<JobState>,
        item: usize,
        device: usize,
        started: Instant,
        outcome: Result<(), (KeyFailure, String)>,
    ) {
        if job.is_resolved(item) {
            // Completed after its deadline failed it: already reported.
            return;
        }
        let m = &self.me.metrics;
        m.dev(device)
            .load_latency
            .record(started.elapsed().as_micros() as u64);
        match outcome {
            Ok(()) => {
                m.loads_ok.fetch_add(1, Ordering::Relaxed);
                job.succeed(&self.shared, item, self.block_bytes);
            }
            Err((KeyFailure::Miss, detail)) => {
                m.loads_failed.fetch_add(1, Ordering::Relaxed);
                self.shared.load_missed(job, item, detail);
            }
            Err((reason, detail)) => {
                m.loads_failed.fetch_add(1, Ordering::Relaxed);
                job.fail(&self.shared, item, reason, detail);
            }
        }
    }

    /// A load answered without I/O: a miss (falls back to the cold tier) or a failure.
    pub fn resolve_load(&self, job: &Arc<JobState>, item: usize, reason: KeyFailure) {
        let m = &self.me.metrics;
        m.loads_failed.fetch_add(1, Ordering::Relaxed);
        if reason == KeyFailure::Miss {
            m.load_misses.fetch_add(1, Ordering::Relaxed);
            self.shared.load_missed(job, item, String::new());
        } else {
            job.fail(&self.shared, item, reason, String::new());
        }
    }

    pub fn store_succeeded(&self, job: &Arc<JobState>, item: usize, bytes: u64) {
        if job.is_resolved(item) {
            return;
        }
        self.me.metrics.stores_ok.fetch_add(1, Ordering::Relaxed);
        job.succeed(&self.shared, item, bytes);
    }

    pub fn store_failed(
        &self,
        job: &Arc<JobState>,
        item: usize,
        reason: KeyFailure,
        detail: String,
    ) {
        if job.is_resolved(item) {
            return;
        }
        self.me
            .metrics
            .stores_failed
            .fetch_add(1, Ordering::Relaxed);
        job.fail(&self.shared, item, reason, detail);
    }

    /// A stored key already present: a cheap no-op success.
    pub fn store_present(&self, job: &Arc<JobState>, item: usize) {
        self.me
            .metrics
            .stores_skipped_present
            .fetch_add(1, Ordering::Relaxed);
        job.succeed(&self.shared, item, 0);
    }

    /// Whether device `d` was marked failed (it kept timing out).
    pub fn device_failed(&self, d: usize) -> bool {
        d < 64 && self.failed & (1 << d) != 0
    }

    /// Counts a timeout on device `d`; true if that marks it failed now.
    pub(super) fn count_timeout(&mut self, d: usize) -> bool {
        if self.device_failed(d) || d >= 64 {
            return false;
        }
        if self.timeouts.len() <= d {
            self.timeouts.resize_with(d + 1, VecDeque::new);
        }
        let now = self.ops.now();
        let window = self.io_timeout * FAILURE_WINDOW_DEADLINES;
        let recent = &mut self.timeouts[d];
        recent.push_back(now);
        while recent
            .front()
            .is_some_and(|&t| now.duration_since(t) > window)
        {
            recent.pop_front();
        }
        if recent.len() < FAIL_AFTER_TIMEOUTS {
            return false;
        }
        self.failed |= 1 << d;
        self.me.metrics.dev(d).failed.store(true, Ordering::Relaxed);
        true
    }

    /// An I/O error on device `d` (counted by the caller): logged if it is the first since an
    /// I/O on the device last succeeded (one line per episode, engine-wide), else only counted.
    pub fn device_error(&self, d: usize, what: &str) {
        if self.shared.device_health.error(d) {
            if let Some(suppressed) = self.error_log.admit() {
                tracing::error!(
                    worker = self.id,
                    device = d,
                    suppressed,
                    "{what}. Further I/O errors on this device are counted \
                     (kvtier_device_errors_total) and fail their keys, but are not logged until \
                     an I/O on it succeeds again; its other keys and the other devices keep serving"
                );
            }
        }
    }

    /// A successful I/O on device `d`: logs the end of an error episode (`name` is asked only
    /// then).
    pub fn device_ok(&self, d: usize, name: impl FnOnce() -> String) {
        if let Some(errors) = self.shared.device_health.ok(d) {
            tracing::info!(
                worker = self.id,
                device = d,
                "{}: I/O succeeds again after {errors} error{}",
                name(),
                if errors == 1 { "" } else { "s" }
            );
        }
    }

    /// Logs an I/O error, at most 10 per 10 s per worker, so a dead device cannot flood the
    /// log; a line after some were held back says how many (`suppressed`).
    pub fn log_error(&mut self, msg: &str) {
        if let Some(suppressed) = self.error_log.admit() {
            tracing::error!(worker = self.id, suppressed, "{msg}");
        }
    }

    pub(super) fn idle(&self) -> bool {
        self.loads.is_empty()
            && self.stores.is_empty()
            && self.retry.is_empty()
            && self.store_issuing.is_empty()
            && self.backend.in_flight() == 0
    }

    pub(super) fn update_gauges(&self) {
        let m = &self.me.metrics;
        m.queued_loads
            .store(self.loads.blocks() as u64, Ordering::Relaxed);
        m.queued_stores
            .store(self.stores.blocks() as u64, Ordering::Relaxed);
        m.inflight_ops
            .store(self.backend.in_flight() as u64, Ordering::Relaxed);
    }

    /// Stops: fails every queued block and retry; returns the stores that were still issuing
    /// chunks (the caller cuts them).
    pub(super) fn cancel_queued(&mut self) -> Vec<u32> {
        self.stopping = true;
        let cancelled = self.loads.cancel(&self.shared) + self.stores.cancel(&self.shared);
        self.me.queued_blocks.fetch_sub(cancelled, Ordering::AcqRel);
        for (job, item) in self.retry.drain(..) {
            job.fail(&self.shared, item, KeyFailure::Shutdown, String::new());
        }
        self.store_issuing.drain(..).collect()
    }

    pub(super) fn cancel_part(&self, part: &Part) {
        // Queue room first, so a caller that sees the failure can submit again at once.
        self.me
            .queued_blocks
            .fetch_sub(part.items.len(), Ordering::AcqRel);
        part.fail_from(0, &self.shared);
    }
}
