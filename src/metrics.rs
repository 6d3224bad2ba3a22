//! Counters and latency histograms, written by workers with relaxed atomics and read by
//! [`crate::Engine::stats`] as a snapshot. Nothing here allocates after construction.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Log-linear buckets: exact below 16, then 8 sub-buckets per power of two (≤ 12.5 % error).
const SUB_BUCKETS: usize = 8;
const LINEAR: usize = 16;
const BUCKETS: usize = LINEAR + (64 - 4) * SUB_BUCKETS;

/// A latency histogram in microseconds.
pub struct Histogram {
    buckets: Box<[AtomicU64]>,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
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
    }

    pub fn snapshot(&self) -> HistogramSnapshot {
        HistogramSnapshot {
            counts: self.buckets.iter().map(|b| b.load(Relaxed)).collect(),
        }
    }
}

/// A copy of a histogram's counts; can be merged and queried.
#[derive(Clone, Debug, Default)]
pub struct HistogramSnapshot {
    counts: Vec<u64>,
}

impl HistogramSnapshot {
    pub fn merge(&mut self, other: &HistogramSnapshot) {
        if self.counts.is_empty() {
            self.counts = vec![0; BUCKETS];
        }
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
    }

    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
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

/// One worker's counters.
#[derive(Default)]
pub struct ShardMetrics {
    pub loads_ok: AtomicU64,
    pub loads_failed: AtomicU64,
    pub load_misses: AtomicU64,
    pub stores_ok: AtomicU64,
    pub stores_failed: AtomicU64,
    pub stores_skipped_present: AtomicU64,
    pub bytes_read: AtomicU64,
    pub bytes_written: AtomicU64,
    pub read_ops: AtomicU64,
    pub write_ops: AtomicU64,
    pub table_writes: AtomicU64,
    pub evictions: AtomicU64,
    pub checksum_failures: AtomicU64,
    /// Files layout: block paths refused because a symlink or a non-regular file (FIFO,
    /// socket, device node, directory) was found there.
    pub files_refused: AtomicU64,
    /// I/Os that did not complete within `io_timeout_ms` (their keys failed with a timeout).
    pub io_timeouts: AtomicU64,
    /// Devices marked failed (each worker marks the devices it saw time out).
    pub devices_failed: AtomicU64,
    pub io_errors: AtomicU64,
    pub queued_loads: AtomicU64,
    pub queued_stores: AtomicU64,
    pub inflight_ops: AtomicU64,
    pub submits: AtomicU64,
    pub wakeups: AtomicU64,
    pub blocks_stored: AtomicU64,
    pub slots_total: AtomicU64,
    pub recovered_blocks: AtomicU64,
    pub torn_entries: AtomicU64,
    pub unroutable_entries: AtomicU64,
    /// Evicted blocks read and handed to the S3 tier (`write = "on_evict"`).
    pub demotions: AtomicU64,
    /// Evicted blocks not demoted (no staging slot free, or the read failed).
    pub demotions_dropped: AtomicU64,
    pub load_latency: Histogram,
    pub store_latency: Histogram,
}

/// A snapshot of the engine's counters, summed over workers.
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
    pub checksum_failures: u64,
    pub files_refused: u64,
    pub io_timeouts: u64,
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
    /// written (their keys now route to another worker or device).
    pub unroutable_entries: u64,
    /// Evicted blocks read and handed to the S3 tier (`write = "on_evict"`).
    pub demotions: u64,
    /// Evicted blocks not demoted (no staging slot free, or the read failed).
    pub demotions_dropped: u64,
    pub jobs_in_flight: u64,
    pub events_dropped: u64,
    /// CPU time used by the worker threads, in seconds.
    pub worker_cpu_seconds: f64,
    /// Per-block device latency of loads and stores (push to completion), microseconds.
    pub load_latency_us: HistogramSnapshot,
    pub store_latency_us: HistogramSnapshot,
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
    pub(crate) fn add(&mut self, m: &ShardMetrics) {
        let l = |a: &AtomicU64| a.load(Relaxed);
        self.loads_ok += l(&m.loads_ok);
        self.loads_failed += l(&m.loads_failed);
        self.load_misses += l(&m.load_misses);
        self.stores_ok += l(&m.stores_ok);
        self.stores_failed += l(&m.stores_failed);
        self.stores_skipped_present += l(&m.stores_skipped_present);
        self.bytes_read += l(&m.bytes_read);
        self.bytes_written += l(&m.bytes_written);
        self.read_ops += l(&m.read_ops);
        self.write_ops += l(&m.write_ops);
        self.table_writes += l(&m.table_writes);
        self.evictions += l(&m.evictions);
        self.checksum_failures += l(&m.checksum_failures);
        self.files_refused += l(&m.files_refused);
        self.io_timeouts += l(&m.io_timeouts);
        self.devices_failed += l(&m.devices_failed);
        self.io_errors += l(&m.io_errors);
        self.queued_loads += l(&m.queued_loads);
        self.queued_stores += l(&m.queued_stores);
        self.inflight_ops += l(&m.inflight_ops);
        self.submits += l(&m.submits);
        self.wakeups += l(&m.wakeups);
        self.blocks_stored += l(&m.blocks_stored);
        self.slots_total += l(&m.slots_total);
        self.recovered_blocks += l(&m.recovered_blocks);
        self.torn_entries += l(&m.torn_entries);
        self.unroutable_entries += l(&m.unroutable_entries);
        self.demotions += l(&m.demotions);
        self.demotions_dropped += l(&m.demotions_dropped);
        self.load_latency_us.merge(&m.load_latency.snapshot());
        self.store_latency_us.merge(&m.store_latency.snapshot());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
