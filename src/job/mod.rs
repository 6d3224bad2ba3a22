//! Jobs, their per-key outcomes and their results.
//!
//! A job names keys and primary-region blocks in parallel lists. The engine splits it by worker;
//! each worker resolves its keys (loaded, stored, or failed with a [`KeyFailure`]) and the last
//! resolution publishes exactly one [`JobResult`]. A failed load reports how many keys *in job
//! order* loaded before the first failure (vLLM's `successful_keys` prefix semantics).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use kvtier_sys::blocks::{Lease, LeaseHold};

use crate::events::EventSink;
use crate::key::Key;
use crate::metrics::EngineMetrics;
use crate::Errno;
use release::{Held, Park, Release};
use sink::{ClientId, Sinks};

pub mod release;
pub(crate) mod sink;

/// A job's caller-chosen identifier.
pub type JobId = u64;

/// Index of a block in the primary region.
pub type BlockId = u32;

/// Which of a node's regions a client's blocks are in (0: the engine's primary region).
pub(crate) type RegionId = u16;

/// "Store blocks `blocks[i]` under `keys[i]`" or "load `keys[i]` into `blocks[i]`".
#[derive(Clone, Debug, Default)]
pub struct Job {
    pub id: JobId,
    pub keys: Vec<Key>,
    pub blocks: Vec<BlockId>,
}

impl Job {
    pub fn new(id: JobId, keys: Vec<Key>, blocks: Vec<BlockId>) -> Job {
        Job { id, keys, blocks }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobKind {
    Load,
    Store,
}

/// Why one key of a job failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyFailure {
    /// The key is not stored (a load of an unknown or evicted key).
    Miss,
    /// The key's store has not completed yet.
    NotReady,
    /// The device returned an error.
    Io(Errno),
    /// The device moved fewer bytes than asked.
    ShortIo { done: u32, wanted: u32 },
    /// The stored data does not match its checksum; the block was dropped.
    Checksum,
    /// No slot could be freed for a store.
    NoSpace,
    /// The engine shut down before the key was processed.
    Shutdown,
    /// The job itself is malformed (block id out of range, list lengths differ).
    InvalidJob,
    /// The object store failed the request after the configured retries (or it timed out);
    /// the detail names the operation, the object and the cause.
    Remote,
    /// Files layout: a symlink or a non-regular file (FIFO, socket, device node, directory),
    /// or a file longer than a block, is at the block's path; kvtier never follows, reads or
    /// removes it. The detail names the path.
    Refused,
    /// The device did not complete the key's I/O within `io_timeout_ms`; the detail names the
    /// device and the operation. The I/O may still be in flight: the job's region blocks stay
    /// leased (`Region::is_leased`) until the device answers, so nothing it may still write is
    /// handed back early.
    Timeout,
}

impl std::fmt::Display for KeyFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeyFailure::Miss => write!(f, "not stored"),
            KeyFailure::NotReady => write!(f, "store still in progress"),
            KeyFailure::Io(e) => write!(f, "I/O error: {}", e.desc()),
            KeyFailure::ShortIo { done, wanted } => {
                write!(f, "short I/O: {done} of {wanted} bytes")
            }
            KeyFailure::Checksum => write!(f, "checksum mismatch (block dropped)"),
            KeyFailure::NoSpace => write!(f, "no free slot"),
            KeyFailure::Shutdown => write!(f, "engine shut down"),
            KeyFailure::InvalidJob => write!(f, "invalid job"),
            KeyFailure::Remote => write!(f, "object store request failed"),
            KeyFailure::Refused => write!(f, "refused: not a regular file"),
            KeyFailure::Timeout => write!(f, "I/O timed out"),
        }
    }
}

/// The first failure of a job, by key position.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobFailure {
    pub key_index: usize,
    pub reason: KeyFailure,
    pub detail: String,
}

/// What happened to a job; reported exactly once by `poll_finished`.
#[derive(Clone, Debug)]
pub struct JobResult {
    pub id: JobId,
    pub kind: JobKind,
    /// True only if every key succeeded.
    pub success: bool,
    pub keys_total: usize,
    /// Keys, in job order, that succeeded before the first failure (all of them on success).
    pub succeeded_prefix: usize,
    /// Every failed key, in key order (one entry per key at most); see [`JobResult::failure`].
    pub failures: Vec<JobFailure>,
    /// Bytes moved between the region and the device.
    pub bytes: u64,
    /// From submission to the last key's resolution.
    pub elapsed: Duration,
    /// `None`: the job's region blocks were the caller's again when this result was reported
    /// (the default). `Some` only where the caller opted in to early results
    /// ([`Engine::set_early_results`](crate::Engine::set_early_results)), or from a shutdown
    /// that could not stop an I/O: the blocks are the caller's once it is set (see
    /// [`crate::release`]).
    pub release: Option<Release>,
    /// The node's client that submitted the job, whose sink receives this.
    pub(crate) client: ClientId,
}

impl JobResult {
    /// Whether the job's region blocks are the caller's again now.
    pub fn released(&self) -> bool {
        self.release.as_ref().is_none_or(Release::is_released)
    }

    /// A write-through store's result: its NVMe half's (`self`) with each key's upload outcome
    /// added (`Ok(bytes)`, or the failure), one failure per key (the NVMe half's, if it failed
    /// too, comes first). The S3 tier and the simulated object store report through it.
    #[cfg_attr(not(any(feature = "s3", feature = "sim")), allow(dead_code))] // the cold tiers'
    pub(crate) fn with_uploads(
        mut self,
        uploads: impl IntoIterator<Item = (usize, std::result::Result<u64, (KeyFailure, String)>)>,
    ) -> JobResult {
        for (i, r) in uploads {
            match r {
                Ok(n) => self.bytes += n,
                Err((reason, detail)) if !self.failures.iter().any(|f| f.key_index == i) => {
                    self.failures.push(JobFailure {
                        key_index: i,
                        reason,
                        detail,
                    });
                }
                Err(_) => {}
            }
        }
        self.failures.sort_by_key(|f| f.key_index);
        self.success = self.failures.is_empty();
        self.succeeded_prefix = self
            .failures
            .first()
            .map_or(self.keys_total, |f| f.key_index);
        self
    }
    /// The first failure by key position, if any.
    pub fn failure(&self) -> Option<&JobFailure> {
        self.failures.first()
    }

    /// vLLM's `successful_keys`: `None` when every key shares the job's fate or none loaded.
    pub fn successful_keys(&self) -> Option<usize> {
        if self.success || self.succeeded_prefix == 0 {
            None
        } else {
            Some(self.succeeded_prefix)
        }
    }
}

/// Where a load whose key the NVMe tier turned out not to hold goes instead of failing as a
/// miss (the S3 tier, when configured).
pub(crate) type MissFallback = Box<dyn Fn(&Arc<JobState>, usize) + Send + Sync>;

/// State shared by the engine handle and every worker.
pub(crate) struct Shared {
    /// Where each client's results go.
    pub sinks: Sinks,
    pub jobs_in_flight: AtomicUsize,
    pub idle_lock: Mutex<()>,
    pub idle: Condvar,
    pub events: EventSink,
    /// Set once the S3 tier is open.
    pub miss_fallback: std::sync::OnceLock<MissFallback>,
    /// Jobs, lookups and admission, as callers see them.
    pub metrics: EngineMetrics,
    /// Store jobs admitted and not yet finished (for the load latency under stores).
    pub store_jobs_in_flight: AtomicUsize,
    /// Which devices are failing their I/O now, for one log line per episode.
    pub device_health: crate::logs::DeviceHealth,
    /// Jobs resolved whose blocks an I/O still holds (see [`crate::release`]).
    pub held: Held,
    /// Report such jobs at once, with a release to wait on (else when their blocks are free).
    pub early_results: AtomicBool,
    /// Workers that stopped with I/O still in flight past its deadline, and those ops.
    pub workers_gave_up: AtomicUsize,
    pub ops_given_up: AtomicUsize,
    /// This, for what runs when a lease's last hold goes.
    this: std::sync::Weak<Shared>,
}

impl Shared {
    /// State for a new node, with no client yet ([`Sinks::register`]).
    pub fn new(events: EventSink) -> Arc<Shared> {
        Arc::new_cyclic(|this| Shared {
            sinks: Sinks::default(),
            jobs_in_flight: AtomicUsize::new(0),
            idle_lock: Mutex::new(()),
            idle: Condvar::new(),
            events,
            miss_fallback: std::sync::OnceLock::new(),
            metrics: EngineMetrics::default(),
            store_jobs_in_flight: AtomicUsize::new(0),
            device_health: crate::logs::DeviceHealth::default(),
            held: Held::default(),
            early_results: AtomicBool::new(false),
            workers_gave_up: AtomicUsize::new(0),
            ops_given_up: AtomicUsize::new(0),
            this: this.clone(),
        })
    }

    /// A load's key is not in the NVMe tier: ask the next tier, or fail the key as a miss. This
    /// catches a key evicted (or removed by another process) between `lookup` or submission
    /// and the worker reaching it.
    pub fn load_missed(&self, job: &Arc<JobState>, index: usize, detail: String) {
        if job.is_resolved(index) {
            // Failed by its deadline already: no fallback writes into its block any more.
            return;
        }
        match self.miss_fallback.get() {
            Some(fallback) if job.kind == JobKind::Load => fallback(job, index),
            _ => job.fail(self, index, KeyFailure::Miss, detail),
        }
    }

    /// Counts a caller's job as it finishes: outcome, blocks, latency.
    fn count_job(&self, r: &JobResult) {
        let m = &self.metrics;
        let us = r.elapsed.as_micros() as u64;
        let (ok, failed, blocks, latency) = match r.kind {
            JobKind::Load => (
                &m.load_jobs_ok,
                &m.load_jobs_failed,
                &m.load_job_blocks,
                &m.load_job_latency,
            ),
            JobKind::Store => (
                &m.store_jobs_ok,
                &m.store_jobs_failed,
                &m.store_job_blocks,
                &m.store_job_latency,
            ),
        };
        if r.success { ok } else { failed }.fetch_add(1, Ordering::Relaxed);
        blocks.fetch_add(r.keys_total as u64, Ordering::Relaxed);
        latency.record(us);
        match r.kind {
            JobKind::Load if self.store_jobs_in_flight.load(Ordering::Relaxed) > 0 => {
                m.load_job_latency_under_stores.record(us);
            }
            JobKind::Store => {
                self.store_jobs_in_flight.fetch_sub(1, Ordering::Relaxed);
            }
            JobKind::Load => {}
        }
    }

    /// Hands a result to whoever waits for it: the internal job's `then`, or the caller.
    pub fn deliver(&self, result: JobResult, then: Option<Then>) {
        match then {
            Some(then) => then(result),
            None => self.finish(result),
        }
    }

    /// Releases `lease`, the job's own, and reports `result` when its blocks are the caller's
    /// again: now if no I/O holds them; else once the last hold goes (or at once, with a
    /// release to wait on, if the caller asked for early results).
    pub(crate) fn release_then_deliver(
        &self,
        lease: &Lease,
        result: JobResult,
        then: Option<Then>,
    ) {
        let id = result.id;
        let early = then.is_none() && self.early_results.load(Ordering::Relaxed);
        let mut parked = Some((result, then));
        let mut release = None;
        let free_now = lease.release_when_free(|| {
            let park = if early {
                Park::Early
            } else {
                let (r, then) = parked.take().expect("parked once");
                Park::Wait(r, then)
            };
            let (ticket, r) = self.held.park(park, id, lease.len());
            release = Some(r);
            if !early {
                // drain() may be waiting for this job: it now waits for the device only.
                let _guard = self
                    .idle_lock
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                self.idle.notify_all();
            }
            let this = self.this.clone();
            Box::new(move || {
                if let Some(shared) = this.upgrade() {
                    if let Some((r, then)) = shared.held.freed(ticket) {
                        shared.deliver(r, then);
                    }
                }
            })
        });
        if let Some((mut r, then)) = parked {
            if !free_now {
                r.release = release;
            }
            self.deliver(r, then);
        }
    }

    /// Reports every result still waiting for its blocks, each with its unset release (a
    /// shutdown whose workers gave up on I/O that may still reach them).
    pub fn report_held(&self) {
        for (r, then) in self.held.take_waiting() {
            self.deliver(r, then);
        }
    }

    /// Jobs in flight, not counting those resolved and waiting only for an I/O to free their
    /// blocks.
    pub fn jobs_unresolved(&self) -> usize {
        self.jobs_in_flight
            .load(Ordering::Acquire)
            .saturating_sub(self.held.waiting())
    }

    pub fn finish(&self, result: JobResult) {
        self.count_job(&result);
        self.sinks.deliver(result);
        if self.jobs_in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            let _guard = self
                .idle_lock
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            self.idle.notify_all();
        }
    }
}

/// What an internal job does with its result instead of reporting it to the caller.
pub(crate) type Then = Box<dyn FnOnce(JobResult) + Send>;

/// One job in flight, shared by the workers that hold its keys.
pub(crate) struct JobState {
    pub kind: JobKind,
    pub job: Job,
    pub submitted: Instant,
    remaining: AtomicUsize,
    /// Every key failure so far (at most one per key; bounded by the job's length).
    failures: Mutex<Vec<JobFailure>>,
    bytes: AtomicU64,
    /// The region blocks this job holds (`Region::lease`): released when the job publishes its
    /// result, unless borrowed from the caller's job this one serves (a promotion).
    /// An I/O that may still move the blocks' bytes after the result (past its deadline, or a
    /// store's write whose key failed) keeps them with [`JobState::hold_lease`], borrowed or not.
    lease: Option<Arc<Lease>>,
    owns_lease: bool,
    /// Which keys are resolved: the first outcome of a key counts, a later one (an I/O that
    /// completed after its deadline failed the key) is ignored.
    resolved: Box<[AtomicBool]>,
    /// Set for the engine's own jobs (a promotion's store, the NVMe half of a write-through
    /// store): their result goes here, not to `poll_finished`, and they are not counted in
    /// `jobs_in_flight` (the caller's job they serve is).
    then: Mutex<Option<Then>>,
    /// The client whose sink receives the result.
    client: ClientId,
    /// The node region the job's blocks are in (its client's).
    pub region: RegionId,
}

impl JobState {
    pub fn new(kind: JobKind, job: Job) -> JobState {
        let n = job.keys.len();
        JobState {
            kind,
            job,
            submitted: Instant::now(),
            remaining: AtomicUsize::new(n),
            failures: Mutex::new(Vec::new()),
            bytes: AtomicU64::new(0),
            lease: None,
            owns_lease: false,
            resolved: (0..n).map(|_| AtomicBool::new(false)).collect(),
            then: Mutex::new(None),
            client: 0,
            region: 0,
        }
    }

    /// The job of `client` (0 until set), whose blocks are in node region `region`: its
    /// result goes to that client's sink.
    #[must_use]
    pub fn for_client(mut self, client: ClientId, region: RegionId) -> JobState {
        self.client = client;
        self.region = region;
        self
    }

    /// Whether key `index` has its outcome already.
    pub fn is_resolved(&self, index: usize) -> bool {
        self.resolved[index].load(Ordering::Acquire)
    }

    /// Keeps the job's blocks (its own lease, or the one it borrows) past the publication of
    /// the result, for an I/O that may still move their bytes, until the hold is dropped (when
    /// the I/O completes; never, if it never does). `None` without a lease, or if the blocks
    /// went back already.
    pub fn hold_lease(&self) -> Option<LeaseHold> {
        self.lease.as_ref().and_then(Lease::hold)
    }

    /// Holds `lease` and releases it when the result is published.
    pub fn with_lease(mut self, lease: Arc<Lease>) -> JobState {
        self.lease = Some(lease);
        self.owns_lease = true;
        self
    }

    /// An internal job (its result goes to `then`) working on blocks of the caller's job
    /// `parent` (a promotion storing the block a load just landed): under `parent`'s lease
    /// (released by `parent`) and in `parent`'s region, where those blocks are.
    #[cfg_attr(not(any(feature = "s3", feature = "sim")), allow(dead_code))]
    pub fn serving(parent: &JobState, kind: JobKind, job: Job, then: Then) -> JobState {
        let mut state =
            JobState::internal(kind, job, then).borrowing_lease(parent.lease().cloned());
        state.region = parent.region;
        state
    }

    /// Works under the lease of the caller's job it serves (released by that job).
    pub fn borrowing_lease(mut self, lease: Option<Arc<Lease>>) -> JobState {
        self.lease = lease;
        self.owns_lease = false;
        self
    }

    /// The job's lease on its region blocks (none on an unguarded region, or for a store whose
    /// lease the write-through upload holds).
    pub fn lease(&self) -> Option<&Arc<Lease>> {
        self.lease.as_ref()
    }

    /// An internal job whose result is handed to `then` (see the field).
    pub fn internal(kind: JobKind, job: Job, then: Then) -> JobState {
        let state = JobState::new(kind, job);
        *state
            .then
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(then);
        state
    }

    /// Records that key `index` succeeded after moving `bytes`.
    pub fn succeed(&self, shared: &Shared, index: usize, bytes: u64) {
        debug_assert!(index < self.job.keys.len());
        if self.resolved[index].swap(true, Ordering::AcqRel) {
            return;
        }
        if bytes > 0 {
            self.bytes.fetch_add(bytes, Ordering::Relaxed);
        }
        self.resolve(shared);
    }

    /// Records that key `index` failed.
    pub fn fail(&self, shared: &Shared, index: usize, reason: KeyFailure, detail: String) {
        if self.resolved[index].swap(true, Ordering::AcqRel) {
            return;
        }
        self.failures
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(JobFailure {
                key_index: index,
                reason,
                detail,
            });
        self.resolve(shared);
    }

    /// Fails the whole job before any of it was queued (a malformed job).
    pub fn fail_whole(&self, shared: &Shared, index: usize, reason: KeyFailure, detail: String) {
        *self
            .failures
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = vec![JobFailure {
            key_index: index,
            reason,
            detail,
        }];
        self.report(shared);
    }

    fn resolve(&self, shared: &Shared) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.report(shared);
        }
    }

    /// Reports the result of a job with no keys left to resolve (also used for empty jobs):
    /// to its client's sink, or held until its blocks are free.
    pub fn report(&self, shared: &Shared) {
        let mut failures = std::mem::take(
            &mut *self
                .failures
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        failures.sort_by_key(|f| f.key_index);
        let total = self.job.keys.len();
        let success = failures.is_empty();
        if success && self.kind == JobKind::Store && shared.events.enabled() {
            shared.events.push(self.job.keys.clone(), false);
        }
        let result = JobResult {
            id: self.job.id,
            kind: self.kind,
            success,
            keys_total: total,
            succeeded_prefix: failures.first().map_or(total, |f| f.key_index),
            failures,
            bytes: self.bytes.load(Ordering::Relaxed),
            elapsed: self.submitted.elapsed(),
            release: None,
            client: self.client,
        };
        let then = self
            .then
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        // The lease goes back before anyone can see the result (the caller may touch the
        // blocks then); while an I/O that may still move their bytes holds it, the result
        // waits (or says so).
        match (self.owns_lease, &self.lease) {
            (true, Some(lease)) => shared.release_then_deliver(lease, result, then),
            _ => shared.deliver(result, then),
        }
    }
}
