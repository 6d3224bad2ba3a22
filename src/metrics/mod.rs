//! Counters and latency histograms, written by workers with relaxed atomics and read by
//! [`crate::Engine::stats`] as a snapshot; [`render`] writes a snapshot in the Prometheus text
//! formats and `serve` answers `GET /metrics` (`[metrics] listen`). Nothing here allocates
//! after construction, except snapshots.
//!
//! Where each figure is counted: per device of each worker ([`DeviceMetrics`]: bytes, I/Os,
//! errors by class, timeouts, checksum failures, evictions, per-block latency, capacity), per
//! worker ([`WorkerMetrics`]: block outcomes, queues, recovery), per engine ([`EngineMetrics`]:
//! jobs, job latency, lookups, backpressure) and in the S3 tier ([`S3Metrics`]).

pub mod render;
pub(crate) mod serve;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

use crate::Errno;

/// Log-linear buckets: exact below 16, then 8 sub-buckets per power of two (≤ 12.5 % error).
const SUB_BUCKETS: usize = 8;
const LINEAR: usize = 16;
const BUCKETS: usize = LINEAR + (64 - 4) * SUB_BUCKETS;

/// A latency histogram in microseconds.
pub struct Histogram {
    buckets: Box<[AtomicU64]>,
    sum: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
            sum: AtomicU64::new(0),
        }
    }
}

fn bucket_of(v: u64) -> usize {
    if v < LINEAR as u64 {
        return v as usize;
    }
    let exp = 63 - v.leading_zeros() as usize; // >= 4
    let sub = ((v >> (exp - 3)) & (SUB_BUCKETS as u64 - 1)) as usize;
    LINEAR + (exp - 4) * SUB_BUCKETS + sub
}

/// The smallest value that lands in bucket `b` (reports use the bucket's upper edge instead).
fn bucket_high(b: usize) -> u64 {
    if b < LINEAR {
        return b as u64;
    }
    let exp = (b - LINEAR) / SUB_BUCKETS + 4;
    let sub = ((b - LINEAR) % SUB_BUCKETS) as u64;
    let low = (1u64 << exp) | (sub << (exp - 3));
    low + ((1u64 << (exp - 3)) - 1)
}

impl Histogram {
    pub fn record(&self, micros: u64) {
        self.buckets[bucket_of(micros)].fetch_add(1, Relaxed);
        self.sum.fetch_add(micros, Relaxed);
    }

    pub fn snapshot(&self) -> HistogramSnapshot {
        HistogramSnapshot {
            counts: self.buckets.iter().map(|b| b.load(Relaxed)).collect(),
            sum_us: self.sum.load(Relaxed),
        }
    }
}

/// A copy of a histogram's counts; can be merged and queried.
#[derive(Clone, Debug, Default)]
pub struct HistogramSnapshot {
    counts: Vec<u64>,
    sum_us: u64,
}

impl HistogramSnapshot {
    pub fn merge(&mut self, other: &HistogramSnapshot) {
        if self.counts.is_empty() {
            self.counts = vec![0; BUCKETS];
        }
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.sum_us += other.sum_us;
    }

    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// The sum of every recorded value, microseconds.
    pub fn sum_us(&self) -> u64 {
        self.sum_us
    }

    /// Cumulative counts at `bounds_us` (each must be an exact bucket edge, see
    /// [`EXPORT_BOUNDS_US`]): for each bound, how many values were below it. Exact, since a
    /// bucket never straddles an edge.
    pub fn cumulative_below(&self, bounds_us: &[u64]) -> Vec<u64> {
        let mut out = Vec::with_capacity(bounds_us.len());
        let mut b = 0;
        let mut seen = 0;
        for &bound in bounds_us {
            while b < self.counts.len() && bucket_high(b) < bound {
                seen += self.counts[b];
                b += 1;
            }
            out.push(seen);
        }
        out
    }

    /// The value at quantile `q` (0..=1) in microseconds, as its bucket's upper edge; 0 if empty.
    pub fn quantile(&self, q: f64) -> u64 {
        let total = self.count();
        if total == 0 {
            return 0;
        }
        let rank = ((q.clamp(0.0, 1.0) * total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (b, &n) in self.counts.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return bucket_high(b);
            }
        }
        bucket_high(BUCKETS - 1)
    }
}

/// Histogram bounds exported to Prometheus, microseconds: four per power of two (×1, ×1.25,
/// ×1.5, ×1.75: a quantile read from them is within 25 %), 16 µs to 2^25 µs (33.5 s). Each is a bucket
/// edge of [`Histogram`], so the exported counts are exact.
pub const EXPORT_BOUNDS_US: [u64; 85] = export_bounds();

const fn export_bounds() -> [u64; 85] {
    let mut out = [0u64; 85];
    let mut i = 0;
    while i < 85 {
        let exp = 4 + (i / 4) as u32;
        // (4 + quarter) / 4 of 2^exp.
        out[i] = (1 << exp) + (i as u64 % 4) * (1 << (exp - 2));
        i += 1;
    }
    out
}

/// What kind of I/O error a device answered: a bounded label set for the error counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrClass {
    /// EIO, ENXIO, ENODEV, EBADMSG: the medium or the device failed.
    Io,
    /// ENOSPC, EDQUOT, EFBIG: out of space.
    NoSpace,
    /// EACCES, EPERM, EROFS.
    Permission,
    /// EINVAL, EOPNOTSUPP, EFAULT, EBADF, EOVERFLOW: a request the device or kernel refused.
    Invalid,
    /// EAGAIN, EBUSY, EINTR, ENOMEM, ECANCELED: transient.
    Busy,
    /// Fewer bytes moved than asked.
    Short,
    /// Anything else.
    Other,
}

impl ErrClass {
    pub const ALL: [ErrClass; 7] = [
        ErrClass::Io,
        ErrClass::NoSpace,
        ErrClass::Permission,
        ErrClass::Invalid,
        ErrClass::Busy,
        ErrClass::Short,
        ErrClass::Other,
    ];

    pub fn of(e: Errno) -> ErrClass {
        match e {
            Errno::EIO | Errno::ENXIO | Errno::ENODEV | Errno::EBADMSG => ErrClass::Io,
            Errno::ENOSPC | Errno::EDQUOT | Errno::EFBIG => ErrClass::NoSpace,
            Errno::EACCES | Errno::EPERM | Errno::EROFS => ErrClass::Permission,
            Errno::EINVAL | Errno::EOPNOTSUPP | Errno::EFAULT | Errno::EBADF | Errno::EOVERFLOW => {
                ErrClass::Invalid
            }
            Errno::EAGAIN | Errno::EBUSY | Errno::EINTR | Errno::ENOMEM | Errno::ECANCELED => {
                ErrClass::Busy
            }
            _ => ErrClass::Other,
        }
    }

    /// The class of an I/O result that should have moved `wanted` bytes; `None` if it did.
    pub fn of_result(result: i32, wanted: u64) -> Option<ErrClass> {
        if result < 0 {
            Some(ErrClass::of(Errno::from_raw(-result)))
        } else if (result as u64) < wanted {
            Some(ErrClass::Short)
        } else {
            None
        }
    }

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrClass::Io => "io",
            ErrClass::NoSpace => "no_space",
            ErrClass::Permission => "permission",
            ErrClass::Invalid => "invalid",
            ErrClass::Busy => "busy",
            ErrClass::Short => "short",
            ErrClass::Other => "other",
        }
    }
}

/// One worker's counters on one device (the worker's share of it).
#[derive(Default)]
pub struct DeviceMetrics {
    pub bytes_read: AtomicU64,
    pub bytes_written: AtomicU64,
    /// Block reads completed (one per loaded block).
    pub read_ops: AtomicU64,
    /// Writes completed (one per store chunk).
    pub write_ops: AtomicU64,
    /// I/O errors by [`ErrClass`] (index: position in [`ErrClass::ALL`]).
    pub errors: [AtomicU64; 7],
    /// I/Os that did not complete within `io_timeout_ms` (their keys failed with a timeout).
    pub io_timeouts: AtomicU64,
    pub checksum_failures: AtomicU64,
    pub evictions: AtomicU64,
    /// Blocks removed at the caller's request ([`crate::Engine::remove`]).
    pub removals: AtomicU64,
    /// Files layout: block paths refused because a symlink or a non-regular file (FIFO,
    /// socket, device node, directory) was found there.
    pub files_refused: AtomicU64,
    /// Files layout: lookups' `statx` probes of blocks not indexed here, by answer (a block
    /// another process published, or none).
    pub probes_found: AtomicU64,
    pub probes_absent: AtomicU64,
    /// Blocks stored now.
    pub blocks_stored: AtomicU64,
    /// Blocks the worker's share can hold (0: unbounded, a files directory without a cap).
    pub slots_total: AtomicU64,
    /// Set once this worker marked the device failed (it kept timing out).
    pub failed: AtomicBool,
    /// Per block, from the op's start on the device to its outcome, microseconds.
    pub load_latency: Histogram,
    pub store_latency: Histogram,
}

impl DeviceMetrics {
    pub fn io_error(&self, class: ErrClass) {
        self.errors[class as usize].fetch_add(1, Relaxed);
    }

    /// Counts a failed I/O result (negative errno, or short); true if it failed.
    pub fn count_result(&self, result: i32, wanted: u64) -> bool {
        match ErrClass::of_result(result, wanted) {
            Some(c) => {
                self.io_error(c);
                true
            }
            None => false,
        }
    }
}

/// One worker's counters.
pub struct WorkerMetrics {
    pub loads_ok: AtomicU64,
    pub loads_failed: AtomicU64,
    pub load_misses: AtomicU64,
    pub stores_ok: AtomicU64,
    pub stores_failed: AtomicU64,
    pub stores_skipped_present: AtomicU64,
    pub table_writes: AtomicU64,
    pub queued_loads: AtomicU64,
    pub queued_stores: AtomicU64,
    pub inflight_ops: AtomicU64,
    pub submits: AtomicU64,
    pub wakeups: AtomicU64,
    pub recovered_blocks: AtomicU64,
    pub torn_entries: AtomicU64,
    pub unroutable_entries: AtomicU64,
    /// Evicted blocks read and handed to the S3 tier (`write = "on_evict"`).
    pub demotions: AtomicU64,
    /// Evicted blocks not demoted (no staging slot free, or the read failed).
    pub demotions_dropped: AtomicU64,
    /// One per configured device, in config order.
    pub devices: Box<[DeviceMetrics]>,
}

impl WorkerMetrics {
    pub fn new(devices: usize) -> WorkerMetrics {
        let a = || AtomicU64::new(0);
        WorkerMetrics {
            loads_ok: a(),
            loads_failed: a(),
            load_misses: a(),
            stores_ok: a(),
            stores_failed: a(),
            stores_skipped_present: a(),
            table_writes: a(),
            queued_loads: a(),
            queued_stores: a(),
            inflight_ops: a(),
            submits: a(),
            wakeups: a(),
            recovered_blocks: a(),
            torn_entries: a(),
            unroutable_entries: a(),
            demotions: a(),
            demotions_dropped: a(),
            devices: (0..devices.max(1))
                .map(|_| DeviceMetrics::default())
                .collect(),
        }
    }

    /// Device `d`'s counters.
    pub fn dev(&self, d: usize) -> &DeviceMetrics {
        &self.devices[d]
    }
}

/// The [`EngineMetrics::lookups`] counter of each answer kind.
pub const LOOKUP_HIT_NVME: usize = 0;
pub const LOOKUP_HIT_S3: usize = 1;
pub const LOOKUP_MISS: usize = 2;
pub const LOOKUP_PENDING: usize = 3;

/// Stripes of a [`Striped`] counter set.
const STRIPES: usize = 16;

/// `N` counters that callers on many threads bump at once without sharing a cache line: one
/// line per stripe, each thread counting into the stripe it drew at its first count, the
/// stripes summed when read.
pub struct Striped<const N: usize> {
    stripes: Box<[crossbeam_utils::CachePadded<[AtomicU64; N]>]>,
}

impl<const N: usize> Default for Striped<N> {
    fn default() -> Self {
        Striped {
            stripes: (0..STRIPES)
                .map(|_| {
                    crossbeam_utils::CachePadded::new(std::array::from_fn(|_| AtomicU64::new(0)))
                })
                .collect(),
        }
    }
}

thread_local! {
    /// This thread's stripe, drawn in turn at its first count.
    static STRIPE: usize = {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        NEXT.fetch_add(1, Relaxed) as usize % STRIPES
    };
}

impl<const N: usize> Striped<N> {
    /// Adds `n` to counter `i`.
    pub fn add(&self, i: usize, n: u64) {
        let stripe = STRIPE.with(|s| *s);
        self.stripes[stripe][i].fetch_add(n, Relaxed);
    }

    /// Every counter, summed over the stripes.
    pub fn sums(&self) -> [u64; N] {
        std::array::from_fn(|i| self.stripes.iter().map(|s| s[i].load(Relaxed)).sum())
    }
}

/// The engine's own counters: jobs as callers see them, lookups, admission.
#[derive(Default)]
pub struct EngineMetrics {
    pub load_jobs_ok: AtomicU64,
    pub load_jobs_failed: AtomicU64,
    pub store_jobs_ok: AtomicU64,
    pub store_jobs_failed: AtomicU64,
    /// Blocks (keys) of finished load and store jobs.
    pub load_job_blocks: AtomicU64,
    pub store_job_blocks: AtomicU64,
    /// Submission to result, microseconds.
    pub load_job_latency: Histogram,
    pub store_job_latency: Histogram,
    /// Load jobs that finished while at least one store job was in flight.
    pub load_job_latency_under_stores: Histogram,
    /// Lookup answers by kind ([`LOOKUP_HIT_NVME`] and the others), striped: callers on many
    /// threads count at once.
    pub lookups: Striped<4>,
    /// Submissions refused by `jobs_in_flight_max` and by `queue_blocks_max`.
    pub refused_jobs_in_flight: AtomicU64,
    pub refused_queue_blocks: AtomicU64,
}

/// One device's counters, summed over workers.
#[derive(Clone, Debug, Default)]
pub struct DeviceStats {
    /// As configured.
    pub path: String,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub read_ops: u64,
    pub write_ops: u64,
    /// By [`ErrClass`], in [`ErrClass::ALL`] order.
    pub errors: [u64; 7],
    pub io_timeouts: u64,
    pub checksum_failures: u64,
    pub evictions: u64,
    pub removals: u64,
    pub files_refused: u64,
    pub probes_found: u64,
    pub probes_absent: u64,
    pub blocks_stored: u64,
    pub slots_total: u64,
    /// Workers that marked the device failed.
    pub failed_by: u64,
    pub load_latency_us: HistogramSnapshot,
    pub store_latency_us: HistogramSnapshot,
}

impl DeviceStats {
    fn add(&mut self, m: &DeviceMetrics) {
        let l = |a: &AtomicU64| a.load(Relaxed);
        self.bytes_read += l(&m.bytes_read);
        self.bytes_written += l(&m.bytes_written);
        self.read_ops += l(&m.read_ops);
        self.write_ops += l(&m.write_ops);
        for (e, a) in self.errors.iter_mut().zip(&m.errors) {
            *e += l(a);
        }
        self.io_timeouts += l(&m.io_timeouts);
        self.checksum_failures += l(&m.checksum_failures);
        self.evictions += l(&m.evictions);
        self.removals += l(&m.removals);
        self.files_refused += l(&m.files_refused);
        self.probes_found += l(&m.probes_found);
        self.probes_absent += l(&m.probes_absent);
        self.blocks_stored += l(&m.blocks_stored);
        self.slots_total += l(&m.slots_total);
        self.failed_by += u64::from(m.failed.load(Relaxed));
        self.load_latency_us.merge(&m.load_latency.snapshot());
        self.store_latency_us.merge(&m.store_latency.snapshot());
    }

    pub fn io_errors(&self) -> u64 {
        self.errors.iter().sum()
    }
}

/// CPU time of a process's threads, by class, in seconds (threads alive now: an io_uring worker
/// that exited after idling takes its time with it).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ThreadCpu {
    /// io_uring's kernel threads of this process: `iou-wrk-*` (the writes and file operations
    /// the kernel could not issue inline from a worker's submit) and `iou-sqp-*` (submission
    /// polling). Process-wide: every ring of the process.
    pub io_kernel_seconds: f64,
    /// The S3 tier's reactor threads (`kvtier-s3`); 0 without one.
    pub s3_reactor_seconds: f64,
}

/// One worker's queues and costs now.
#[derive(Clone, Debug, Default)]
pub struct WorkerStats {
    /// The core it is pinned to, if any.
    pub core: Option<usize>,
    pub queued_loads: u64,
    pub queued_stores: u64,
    pub inflight_ops: u64,
    pub submits: u64,
    pub wakeups: u64,
    pub cpu_seconds: f64,
}

/// Jobs as callers see them (the engine's own internal jobs are not counted).
#[derive(Clone, Debug, Default)]
pub struct JobStats {
    pub load_ok: u64,
    pub load_failed: u64,
    pub store_ok: u64,
    pub store_failed: u64,
    pub load_blocks: u64,
    pub store_blocks: u64,
    pub load_latency_us: HistogramSnapshot,
    pub store_latency_us: HistogramSnapshot,
    /// Load jobs that finished while a store job was in flight.
    pub load_latency_under_stores_us: HistogramSnapshot,
    /// Submissions refused (`Error::Backpressure`) by `jobs_in_flight_max`.
    pub refused_jobs_in_flight: u64,
    /// Submissions refused by `queue_blocks_max`.
    pub refused_queue_blocks: u64,
}

/// Lookup answers, per key.
#[derive(Clone, Debug, Default)]
pub struct LookupStats {
    pub hit_nvme: u64,
    pub hit_s3: u64,
    pub miss: u64,
    pub pending: u64,
}

impl EngineMetrics {
    pub fn jobs(&self) -> JobStats {
        let l = |a: &AtomicU64| a.load(Relaxed);
        JobStats {
            load_ok: l(&self.load_jobs_ok),
            load_failed: l(&self.load_jobs_failed),
            store_ok: l(&self.store_jobs_ok),
            store_failed: l(&self.store_jobs_failed),
            load_blocks: l(&self.load_job_blocks),
            store_blocks: l(&self.store_job_blocks),
            load_latency_us: self.load_job_latency.snapshot(),
            store_latency_us: self.store_job_latency.snapshot(),
            load_latency_under_stores_us: self.load_job_latency_under_stores.snapshot(),
            refused_jobs_in_flight: l(&self.refused_jobs_in_flight),
            refused_queue_blocks: l(&self.refused_queue_blocks),
        }
    }

    pub fn lookups(&self) -> LookupStats {
        let [hit_nvme, hit_s3, miss, pending] = self.lookups.sums();
        LookupStats {
            hit_nvme,
            hit_s3,
            miss,
            pending,
        }
    }
}

/// A snapshot of the engine's counters. The flat fields are sums over workers and devices;
/// `devices`, `workers`, `jobs` and `lookups` break them down.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub loads_ok: u64,
    pub loads_failed: u64,
    pub load_misses: u64,
    pub stores_ok: u64,
    pub stores_failed: u64,
    pub stores_skipped_present: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub read_ops: u64,
    pub write_ops: u64,
    pub table_writes: u64,
    pub evictions: u64,
    pub removals: u64,
    pub checksum_failures: u64,
    pub files_refused: u64,
    pub io_timeouts: u64,
    /// Devices marked failed, counted once per worker that marked it.
    pub devices_failed: u64,
    pub io_errors: u64,
    pub queued_loads: u64,
    pub queued_stores: u64,
    pub inflight_ops: u64,
    pub submits: u64,
    pub wakeups: u64,
    /// Blocks currently stored.
    pub blocks_stored: u64,
    /// Slots on all devices.
    pub slots_total: u64,
    pub recovered_blocks: u64,
    pub torn_entries: u64,
    /// Recovered entries dropped because `cores` or the device list changed since they were
    /// written (their keys now route to another worker).
    pub unroutable_entries: u64,
    /// Evicted blocks read and handed to the S3 tier (`write = "on_evict"`).
    pub demotions: u64,
    /// Evicted blocks not demoted (no staging slot free, or the read failed).
    pub demotions_dropped: u64,
    pub jobs_in_flight: u64,
    /// Region blocks of resolved jobs that an I/O still holds (past its deadline, or a store's
    /// write whose key failed first): the caller gets them back when it completes, never if it
    /// does not. `kvtier_blocks_held_by_hung_io`.
    pub blocks_held_by_hung_io: u64,
    /// Jobs whose blocks an I/O gave back after the job had resolved (a held block that came
    /// back): `kvtier_jobs_released_late_total`.
    pub jobs_released_late: u64,
    pub events_dropped: u64,
    /// CPU time used by the worker threads, in seconds.
    pub worker_cpu_seconds: f64,
    /// CPU time of the threads that work for the engine besides its workers; `None` from
    /// `Engine::stats` (which stays cheap: vLLM's tier reads it every step), set by
    /// `Engine::stats_with_threads` and the metrics endpoint, which read `/proc/self/task`.
    pub thread_cpu: Option<ThreadCpu>,
    /// Per-block device latency of loads and stores (push to completion), microseconds.
    pub load_latency_us: HistogramSnapshot,
    pub store_latency_us: HistogramSnapshot,
    /// Per device, in config order (summed over workers).
    pub devices: Vec<DeviceStats>,
    /// Per worker.
    pub workers: Vec<WorkerStats>,
    pub jobs: JobStats,
    pub lookups: LookupStats,
    /// The block size, bytes.
    pub block_bytes: u64,
    /// `slab` or `files`.
    pub layout: &'static str,
    /// The S3 tier's counters; `None` without an `[s3]` section.
    pub s3: Option<S3Stats>,
}

/// Counters of one kind of S3 request.
#[derive(Default)]
pub struct S3OpMetrics {
    /// Attempts sent, retries included.
    pub requests: AtomicU64,
    /// Requests that failed for good (after retries); a HEAD or GET answered 404 is not one.
    pub errors: AtomicU64,
    pub retries: AtomicU64,
    pub bytes: AtomicU64,
    /// Whole operation, retries included, microseconds.
    pub latency: Histogram,
}

impl S3OpMetrics {
    fn snapshot(&self) -> S3OpStats {
        S3OpStats {
            requests: self.requests.load(Relaxed),
            errors: self.errors.load(Relaxed),
            retries: self.retries.load(Relaxed),
            bytes: self.bytes.load(Relaxed),
            latency_us: self.latency.snapshot(),
        }
    }
}

/// The S3 tier's live counters.
#[derive(Default)]
pub struct S3Metrics {
    pub head: S3OpMetrics,
    pub get: S3OpMetrics,
    pub put: S3OpMetrics,
    pub lookup_hits: AtomicU64,
    pub lookup_misses: AtomicU64,
    pub lookup_pending: AtomicU64,
    pub promotions: AtomicU64,
    pub promotions_failed: AtomicU64,
    /// Promotions not started because the workers' queues were full (`queue_blocks_max`): the
    /// load is served from the object store alone.
    pub promotions_skipped: AtomicU64,
    /// Demoted blocks uploaded.
    pub demotions: AtomicU64,
    /// Demoted blocks not uploaded: the upload queue was full, or their crc32c did not match.
    pub demotions_dropped: AtomicU64,
    /// Background uploads (`write_ack = "nvme"`, demotions) that failed after retries.
    pub background_upload_failures: AtomicU64,
    /// `write_ack = "nvme"` blocks not uploaded because the upload queue was full.
    pub uploads_dropped: AtomicU64,
}

impl S3Metrics {
    pub fn snapshot(&self) -> S3Stats {
        let l = |a: &AtomicU64| a.load(Relaxed);
        S3Stats {
            head: self.head.snapshot(),
            get: self.get.snapshot(),
            put: self.put.snapshot(),
            lookup_hits: l(&self.lookup_hits),
            lookup_misses: l(&self.lookup_misses),
            lookup_pending: l(&self.lookup_pending),
            promotions: l(&self.promotions),
            promotions_failed: l(&self.promotions_failed),
            promotions_skipped: l(&self.promotions_skipped),
            demotions: l(&self.demotions),
            demotions_dropped: l(&self.demotions_dropped),
            background_upload_failures: l(&self.background_upload_failures),
            uploads_dropped: l(&self.uploads_dropped),
        }
    }
}

/// A snapshot of one kind of S3 request.
#[derive(Clone, Debug, Default)]
pub struct S3OpStats {
    pub requests: u64,
    pub errors: u64,
    pub retries: u64,
    pub bytes: u64,
    pub latency_us: HistogramSnapshot,
}

/// A snapshot of the S3 tier's counters.
#[derive(Clone, Debug, Default)]
pub struct S3Stats {
    pub head: S3OpStats,
    pub get: S3OpStats,
    pub put: S3OpStats,
    /// Lookup answers given from the S3 tier.
    pub lookup_hits: u64,
    pub lookup_misses: u64,
    pub lookup_pending: u64,
    pub promotions: u64,
    pub promotions_failed: u64,
    /// Promotions not started because the workers' queues were full.
    pub promotions_skipped: u64,
    pub demotions: u64,
    pub demotions_dropped: u64,
    pub background_upload_failures: u64,
    /// `write_ack = "nvme"` blocks not uploaded because the upload queue was full.
    pub uploads_dropped: u64,
}

impl Stats {
    /// Adds worker `m`'s counters (device `d` of `m` into `self.devices[d]`, which must exist).
    pub(crate) fn add(&mut self, m: &WorkerMetrics) {
        let l = |a: &AtomicU64| a.load(Relaxed);
        self.loads_ok += l(&m.loads_ok);
        self.loads_failed += l(&m.loads_failed);
        self.load_misses += l(&m.load_misses);
        self.stores_ok += l(&m.stores_ok);
        self.stores_failed += l(&m.stores_failed);
        self.stores_skipped_present += l(&m.stores_skipped_present);
        self.table_writes += l(&m.table_writes);
        self.queued_loads += l(&m.queued_loads);
        self.queued_stores += l(&m.queued_stores);
        self.inflight_ops += l(&m.inflight_ops);
        self.submits += l(&m.submits);
        self.wakeups += l(&m.wakeups);
        self.recovered_blocks += l(&m.recovered_blocks);
        self.torn_entries += l(&m.torn_entries);
        self.unroutable_entries += l(&m.unroutable_entries);
        self.demotions += l(&m.demotions);
        self.demotions_dropped += l(&m.demotions_dropped);
        if self.devices.len() < m.devices.len() {
            self.devices
                .resize_with(m.devices.len(), DeviceStats::default);
        }
        for (d, dm) in self.devices.iter_mut().zip(m.devices.iter()) {
            d.add(dm);
        }
    }

    /// Fills the flat device sums from `devices` (after every worker was added).
    pub(crate) fn sum_devices(&mut self) {
        for d in &self.devices {
            self.bytes_read += d.bytes_read;
            self.bytes_written += d.bytes_written;
            self.read_ops += d.read_ops;
            self.write_ops += d.write_ops;
            self.io_errors += d.io_errors();
            self.io_timeouts += d.io_timeouts;
            self.checksum_failures += d.checksum_failures;
            self.evictions += d.evictions;
            self.removals += d.removals;
            self.files_refused += d.files_refused;
            self.blocks_stored += d.blocks_stored;
            self.slots_total += d.slots_total;
            self.devices_failed += d.failed_by;
            self.load_latency_us.merge(&d.load_latency_us);
            self.store_latency_us.merge(&d.store_latency_us);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counts from threads that land on different stripes (and on the same one, past 16
    /// threads) sum exactly.
    #[test]
    fn striped_counts_from_many_threads_sum_exactly() {
        let c = Striped::<4>::default();
        std::thread::scope(|s| {
            for t in 0..20u64 {
                let c = &c;
                s.spawn(move || {
                    for _ in 0..1000 {
                        c.add(LOOKUP_MISS, 1);
                        c.add(LOOKUP_HIT_NVME, t);
                    }
                });
            }
        });
        assert_eq!(c.sums(), [1000 * (0..20).sum::<u64>(), 0, 20_000, 0]);
    }

    #[test]
    fn export_bounds_are_bucket_edges_so_cumulative_counts_are_exact() {
        assert_eq!(EXPORT_BOUNDS_US[0], 16);
        assert_eq!(&EXPORT_BOUNDS_US[..5], &[16, 20, 24, 28, 32]);
        assert_eq!(EXPORT_BOUNDS_US[84], 1 << 25);
        for &b in &EXPORT_BOUNDS_US {
            assert_ne!(
                bucket_of(b),
                bucket_of(b - 1),
                "{b} is the low edge of a bucket"
            );
        }
        let h = Histogram::default();
        let values: Vec<u64> = (0..5000u64).map(|i| i * i % 3_000_000).collect();
        for &v in &values {
            h.record(v);
        }
        let s = h.snapshot();
        let below = s.cumulative_below(&EXPORT_BOUNDS_US);
        for (&bound, &n) in EXPORT_BOUNDS_US.iter().zip(&below) {
            let want = values.iter().filter(|&&v| v < bound).count() as u64;
            assert_eq!(n, want, "below {bound} µs");
        }
        assert_eq!(s.sum_us(), values.iter().sum::<u64>());
    }

    #[test]
    fn buckets_are_monotonic_and_cover_values() {
        let mut last = 0;
        for v in [0u64, 1, 15, 16, 17, 100, 1000, 65_535, 1 << 40, u64::MAX] {
            let b = bucket_of(v);
            assert!(b >= last);
            assert!(bucket_high(b) >= v, "v={v} high={}", bucket_high(b));
            last = b;
        }
    }

    #[test]
    fn quantiles_within_bucket_error() {
        let h = Histogram::default();
        for v in 1..=1000u64 {
            h.record(v);
        }
        let s = h.snapshot();
        assert_eq!(s.count(), 1000);
        let p50 = s.quantile(0.5);
        assert!((500..=570).contains(&p50), "p50={p50}");
        let p99 = s.quantile(0.99);
        assert!((990..=1120).contains(&p99), "p99={p99}");
        assert_eq!(HistogramSnapshot::default().quantile(0.5), 0);
    }
}
