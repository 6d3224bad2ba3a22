//! A [`Stats`] snapshot as Prometheus text (version 0.0.4) or OpenMetrics text, encoded by
//! `prometheus-client` (names, escaping, `_total`/`_bucket` suffixes and `# EOF` are the
//! crate's). Every family is `kvtier_*`, in base units (bytes, seconds); label sets are bounded
//! by the config (devices, workers) or by fixed lists (ops, error classes, answers).
//!
//! The families, with their labels (see `docs/metrics.md` for what each means):
//!
//! | family | type | labels |
//! |---|---|---|
//! | `kvtier_info` | info | `version`, `layout`, `block_bytes` |
//! | `kvtier_jobs_total` | counter | `op` (load, store), `result` (ok, failed) |
//! | `kvtier_job_blocks_total` | counter | `op` |
//! | `kvtier_job_seconds` | histogram | `op` |
//! | `kvtier_load_job_under_stores_seconds` | histogram | |
//! | `kvtier_jobs_in_flight` | gauge | |
//! | `kvtier_blocks_held_by_hung_io` | gauge | |
//! | `kvtier_jobs_released_late_total` | counter | |
//! | `kvtier_backpressure_refusals_total` | counter | `limit` |
//! | `kvtier_lookups_total` | counter | `answer` (hit_nvme, hit_s3, miss, pending) |
//! | `kvtier_blocks_total` | counter | `op`, `result` (ok, failed, miss, present) |
//! | `kvtier_moved_bytes_total` | counter | `tier` (nvme, s3), `op` (load, store) |
//! | `kvtier_device_bytes_total`, `kvtier_device_ios_total` | counter | `device`, `op` (read, write) |
//! | `kvtier_device_io_seconds` | histogram | `device`, `op` (load, store), per block |
//! | `kvtier_device_errors_total` | counter | `device`, `class` |
//! | `kvtier_device_timeouts_total`, `..._checksum_failures_total`, `..._evictions_total`, `..._removals_total`, `..._refused_total` | counter | `device` |
//! | `kvtier_device_probes_total` | counter | `device`, `result` (found, absent) |
//! | `kvtier_device_failed` | gauge | `device` |
//! | `kvtier_device_used_bytes`, `kvtier_device_capacity_bytes` | gauge | `device` |
//! | `kvtier_worker_queued_blocks` | gauge | `worker`, `op` |
//! | `kvtier_worker_inflight_ios` | gauge | `worker` |
//! | `kvtier_worker_cpu_seconds_total`, `..._submits_total`, `..._wakeups_total` | counter | `worker` |
//! | `kvtier_thread_cpu_seconds_total` | counter | `class` (io_kernel, s3_reactor) |
//! | `kvtier_table_writes_total`, `kvtier_events_dropped_total` | counter | |
//! | `kvtier_recovered_blocks`, `kvtier_recovery_dropped_entries` | gauge | (`reason`) |
//! | `kvtier_demotions_total` | counter | `result` (read, dropped) |
//! | `kvtier_s3_requests_total`, `..._errors_total`, `..._retries_total` | counter | `op` (head, get, put) |
//! | `kvtier_s3_request_seconds` | histogram | `op` |
//! | `kvtier_s3_promotions_total` | counter | `result` (ok, failed, skipped) |
//! | `kvtier_s3_demotions_total` | counter | `result` (uploaded, dropped) |
//! | `kvtier_s3_uploads_dropped_total`, `kvtier_s3_background_upload_failures_total` | counter | |

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

use super::{ErrClass, HistogramSnapshot, Stats, EXPORT_BOUNDS_US};

/// Which text format to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// The Prometheus text format, version 0.0.4 (what `promtool` and most scrapers read).
    Prometheus,
    /// OpenMetrics 1.0 text (ends with `# EOF`).
    OpenMetrics,
}

impl Format {
    /// The `Content-Type` of a response in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Prometheus => prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }
}

/// `stats` as text in `format` (the snapshot moves into the collector: no copy).
pub fn render(stats: Stats, format: Format) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Snapshot(stats)));
    let mut out = String::new();
    let r = match format {
        Format::Prometheus => {
            prometheus_client::encoding::prometheus_text::encode(&mut out, &registry)
        }
        Format::OpenMetrics => prometheus_client::encoding::text::encode(&mut out, &registry),
    };
    r.expect("encoding into a String cannot fail");
    out
}

#[derive(Debug)]
struct Snapshot(Stats);

/// A histogram snapshot in seconds, at [`EXPORT_BOUNDS_US`].
struct Hist<'a>(&'a HistogramSnapshot);

impl EncodeMetric for Hist<'_> {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let below = self.0.cumulative_below(&EXPORT_BOUNDS_US);
        let count = self.0.count();
        let mut buckets = Vec::with_capacity(EXPORT_BOUNDS_US.len() + 1);
        let mut prev = 0;
        for (&bound, &n) in EXPORT_BOUNDS_US.iter().zip(&below) {
            buckets.push((bound as f64 / 1e6, n - prev));
            prev = n;
        }
        buckets.push((f64::INFINITY, count - prev));
        encoder.encode_histogram::<NoLabelSet>(self.0.sum_us() as f64 / 1e6, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

type Labels = Vec<(&'static str, String)>;

/// Writes families; each call is one family with its series.
struct Out<'a> {
    enc: DescriptorEncoder<'a>,
}

impl Out<'_> {
    fn family<M: EncodeMetric>(
        &mut self,
        name: &str,
        help: &str,
        unit: Option<&Unit>,
        series: &[(Labels, M)],
    ) -> Result<(), std::fmt::Error> {
        let Some(first) = series.first() else {
            return Ok(());
        };
        let kind = first.1.metric_type();
        let mut fam = self.enc.encode_descriptor(name, help, unit, kind)?;
        for (labels, m) in series {
            m.encode(fam.encode_family(labels)?)?;
        }
        Ok(())
    }

    fn counters(
        &mut self,
        name: &str,
        help: &str,
        unit: Option<&Unit>,
        series: Vec<(Labels, u64)>,
    ) -> Result<(), std::fmt::Error> {
        let series = series
            .into_iter()
            .map(|(l, v)| (l, ConstCounter::new(v)))
            .collect::<Vec<_>>();
        self.family(name, help, unit, &series)
    }

    fn counter(&mut self, name: &str, help: &str, v: u64) -> Result<(), std::fmt::Error> {
        self.counters(name, help, None, vec![(Vec::new(), v)])
    }

    fn gauges(
        &mut self,
        name: &str,
        help: &str,
        unit: Option<&Unit>,
        series: Vec<(Labels, i64)>,
    ) -> Result<(), std::fmt::Error> {
        let series = series
            .into_iter()
            .map(|(l, v)| (l, ConstGauge::new(v)))
            .collect::<Vec<_>>();
        self.family(name, help, unit, &series)
    }

    fn hists(
        &mut self,
        name: &str,
        help: &str,
        series: Vec<(Labels, &HistogramSnapshot)>,
    ) -> Result<(), std::fmt::Error> {
        let series = series
            .into_iter()
            .map(|(l, h)| (l, Hist(h)))
            .collect::<Vec<_>>();
        self.family(name, help, Some(&Unit::Seconds), &series)
    }
}

fn l1(k: &'static str, v: impl Into<String>) -> Labels {
    vec![(k, v.into())]
}

fn l2(k1: &'static str, v1: impl Into<String>, k2: &'static str, v2: impl Into<String>) -> Labels {
    vec![(k1, v1.into()), (k2, v2.into())]
}

fn gauge(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl Collector for Snapshot {
    fn encode(&self, enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = &self.0;
        let mut o = Out { enc };
        {
            let info = prometheus_client::metrics::info::Info::new(vec![
                ("version", env!("CARGO_PKG_VERSION").to_owned()),
                ("layout", s.layout.to_owned()),
                ("block_bytes", s.block_bytes.to_string()),
            ]);
            let e = o.enc.encode_descriptor(
                "kvtier",
                "The engine: its version, device layout and block size.",
                None,
                MetricType::Info,
            )?;
            info.encode(e)?;
        }
        jobs(&mut o, s)?;
        blocks(&mut o, s)?;
        devices(&mut o, s)?;
        device_state(&mut o, s)?;
        workers(&mut o, s)?;
        s3(&mut o, s)
    }
}

fn jobs(o: &mut Out, s: &Stats) -> Result<(), std::fmt::Error> {
    let j = &s.jobs;
    o.counters(
        "kvtier_jobs",
        "Jobs finished, by operation and result (a job fails if any of its blocks failed).",
        None,
        vec![
            (l2("op", "load", "result", "ok"), j.load_ok),
            (l2("op", "load", "result", "failed"), j.load_failed),
            (l2("op", "store", "result", "ok"), j.store_ok),
            (l2("op", "store", "result", "failed"), j.store_failed),
        ],
    )?;
    o.counters(
        "kvtier_job_blocks",
        "Blocks (keys) in the jobs finished.",
        None,
        vec![
            (l1("op", "load"), j.load_blocks),
            (l1("op", "store"), j.store_blocks),
        ],
    )?;
    o.hists(
        "kvtier_job",
        "Job latency, submission to result.",
        vec![
            (l1("op", "load"), &j.load_latency_us),
            (l1("op", "store"), &j.store_latency_us),
        ],
    )?;
    o.hists(
        "kvtier_load_job_under_stores",
        "Latency of the load jobs that finished while a store job was in flight.",
        vec![(Vec::new(), &j.load_latency_under_stores_us)],
    )?;
    o.gauges(
        "kvtier_jobs_in_flight",
        "Jobs submitted whose result is not published yet.",
        None,
        vec![(Vec::new(), gauge(s.jobs_in_flight))],
    )?;
    o.gauges(
        "kvtier_blocks_held_by_hung_io",
        "Region blocks of resolved jobs that an I/O still holds (past its deadline): the \
         caller gets them back when it completes.",
        None,
        vec![(Vec::new(), gauge(s.blocks_held_by_hung_io))],
    )?;
    o.counter(
        "kvtier_jobs_released_late",
        "Jobs whose region blocks an I/O gave back after the job had resolved.",
        s.jobs_released_late,
    )?;
    o.counters(
        "kvtier_backpressure_refusals",
        "Submissions refused with a backpressure error (nothing queued), by the limit hit.",
        None,
        vec![
            (l1("limit", "jobs_in_flight_max"), j.refused_jobs_in_flight),
            (l1("limit", "queue_blocks_max"), j.refused_queue_blocks),
        ],
    )?;
    let k = &s.lookups;
    o.counters(
        "kvtier_lookups",
        "Keys looked up, by answer.",
        None,
        vec![
            (l1("answer", "hit_nvme"), k.hit_nvme),
            (l1("answer", "hit_s3"), k.hit_s3),
            (l1("answer", "miss"), k.miss),
            (l1("answer", "pending"), k.pending),
        ],
    )
}

fn blocks(o: &mut Out, s: &Stats) -> Result<(), std::fmt::Error> {
    o.counters(
        "kvtier_blocks",
        "Blocks loaded from and stored to the NVMe tier, by result (a miss is also failed; \
         present: a store skipped, the block was held already).",
        None,
        vec![
            (l2("op", "load", "result", "ok"), s.loads_ok),
            (l2("op", "load", "result", "failed"), s.loads_failed),
            (l2("op", "load", "result", "miss"), s.load_misses),
            (l2("op", "store", "result", "ok"), s.stores_ok),
            (l2("op", "store", "result", "failed"), s.stores_failed),
            (
                l2("op", "store", "result", "present"),
                s.stores_skipped_present,
            ),
        ],
    )?;
    let mut bytes = vec![
        (l2("tier", "nvme", "op", "load"), s.bytes_read),
        (l2("tier", "nvme", "op", "store"), s.bytes_written),
    ];
    if let Some(c) = &s.s3 {
        bytes.push((l2("tier", "s3", "op", "load"), c.get.bytes));
        bytes.push((l2("tier", "s3", "op", "store"), c.put.bytes));
    }
    o.counters(
        "kvtier_moved",
        "Bytes moved between the region and each tier.",
        Some(&Unit::Bytes),
        bytes,
    )?;
    o.counter(
        "kvtier_table_writes",
        "Slab slot-table pages written.",
        s.table_writes,
    )?;
    o.counter(
        "kvtier_events_dropped",
        "Block events dropped because nobody took them (events.max).",
        s.events_dropped,
    )?;
    o.gauges(
        "kvtier_recovered_blocks",
        "Blocks found on the devices when the engine opened.",
        None,
        vec![(Vec::new(), gauge(s.recovered_blocks))],
    )?;
    o.gauges(
        "kvtier_recovery_dropped_entries",
        "Slot-table entries dropped when the engine opened: torn (a write cut by a crash), or \
         unroutable (the worker count changed).",
        None,
        vec![
            (l1("reason", "torn"), gauge(s.torn_entries)),
            (l1("reason", "unroutable"), gauge(s.unroutable_entries)),
        ],
    )?;
    o.counters(
        "kvtier_demotions",
        "Evicted blocks read for the S3 tier (s3.write = \"on_evict\"), or evicted without.",
        None,
        vec![
            (l1("result", "read"), s.demotions),
            (l1("result", "dropped"), s.demotions_dropped),
        ],
    )
}

/// The device families about its I/O.
fn devices(o: &mut Out, s: &Stats) -> Result<(), std::fmt::Error> {
    let dev = |d: &super::DeviceStats| d.path.clone();
    let mut rw = Vec::new();
    let mut ios = Vec::new();
    for d in &s.devices {
        rw.push((l2("device", dev(d), "op", "read"), d.bytes_read));
        rw.push((l2("device", dev(d), "op", "write"), d.bytes_written));
        ios.push((l2("device", dev(d), "op", "read"), d.read_ops));
        ios.push((l2("device", dev(d), "op", "write"), d.write_ops));
    }
    o.counters(
        "kvtier_device",
        "Bytes read from and written to each device (block data; slot-table pages not included).",
        Some(&Unit::Bytes),
        rw,
    )?;
    o.counters(
        "kvtier_device_ios",
        "I/Os completed on each device: block reads, and store chunk writes.",
        None,
        ios,
    )?;
    let mut lat = Vec::new();
    for d in &s.devices {
        lat.push((l2("device", dev(d), "op", "load"), &d.load_latency_us));
        lat.push((l2("device", dev(d), "op", "store"), &d.store_latency_us));
    }
    o.hists(
        "kvtier_device_io",
        "Per block: from its first I/O on the device to its outcome (a load's read and \
         checksum; a store's data written).",
        lat,
    )?;
    let mut errors = Vec::new();
    for d in &s.devices {
        for (c, &n) in ErrClass::ALL.iter().zip(&d.errors) {
            errors.push((l2("device", dev(d), "class", c.as_str()), n));
        }
    }
    o.counters(
        "kvtier_device_errors",
        "I/O errors on each device by class (io: EIO and the like; no_space; permission; \
         invalid; busy; short: fewer bytes than asked; other).",
        None,
        errors,
    )?;
    Ok(())
}

/// The device families about its health and capacity.
fn device_state(o: &mut Out, s: &Stats) -> Result<(), std::fmt::Error> {
    let dev = |d: &super::DeviceStats| d.path.clone();
    let per = |f: &dyn Fn(&super::DeviceStats) -> u64| -> Vec<(Labels, u64)> {
        s.devices
            .iter()
            .map(|d| (l1("device", dev(d)), f(d)))
            .collect()
    };
    o.counters(
        "kvtier_device_timeouts",
        "I/Os past io_timeout_ms on each device (their keys failed).",
        None,
        per(&|d| d.io_timeouts),
    )?;
    o.counters(
        "kvtier_device_checksum_failures",
        "Blocks read whose crc32c did not match (dropped, never served).",
        None,
        per(&|d| d.checksum_failures),
    )?;
    o.counters(
        "kvtier_device_evictions",
        "Blocks evicted to make room.",
        None,
        per(&|d| d.evictions),
    )?;
    o.counters(
        "kvtier_device_removals",
        "Blocks removed at the caller's request (Engine::remove).",
        None,
        per(&|d| d.removals),
    )?;
    o.counters(
        "kvtier_device_refused",
        "Files layout: block paths refused (a symlink or a non-regular file was there).",
        None,
        per(&|d| d.files_refused),
    )?;
    o.counters(
        "kvtier_device_probes",
        "Files layout: statx probes of blocks not indexed here (lookups), by result: found (a \
         block another process published, now indexed) or absent.",
        None,
        s.devices
            .iter()
            .flat_map(|d| {
                [
                    (l2("device", dev(d), "result", "found"), d.probes_found),
                    (l2("device", dev(d), "result", "absent"), d.probes_absent),
                ]
            })
            .collect(),
    )?;
    o.gauges(
        "kvtier_device_failed",
        "1 once the device was marked failed (it kept timing out): its keys are misses.",
        None,
        s.devices
            .iter()
            .map(|d| (l1("device", dev(d)), i64::from(d.failed_by > 0)))
            .collect(),
    )?;
    o.gauges(
        "kvtier_device_used",
        "Bytes of blocks stored on each device.",
        Some(&Unit::Bytes),
        s.devices
            .iter()
            .map(|d| (l1("device", dev(d)), gauge(d.blocks_stored * s.block_bytes)))
            .collect(),
    )?;
    o.gauges(
        "kvtier_device_capacity",
        "Bytes of blocks each device can hold (absent: a files directory without a cap).",
        Some(&Unit::Bytes),
        s.devices
            .iter()
            .filter(|d| d.slots_total > 0)
            .map(|d| (l1("device", dev(d)), gauge(d.slots_total * s.block_bytes)))
            .collect(),
    )
}

fn workers(o: &mut Out, s: &Stats) -> Result<(), std::fmt::Error> {
    let w = |i: usize| i.to_string();
    let mut queued = Vec::new();
    for (i, x) in s.workers.iter().enumerate() {
        queued.push((l2("worker", w(i), "op", "load"), gauge(x.queued_loads)));
        queued.push((l2("worker", w(i), "op", "store"), gauge(x.queued_stores)));
    }
    o.gauges(
        "kvtier_worker_queued_blocks",
        "Blocks queued on each worker, not yet started.",
        None,
        queued,
    )?;
    o.gauges(
        "kvtier_worker_inflight_ios",
        "I/Os each worker has in flight on its ring.",
        None,
        s.workers
            .iter()
            .enumerate()
            .map(|(i, x)| (l1("worker", w(i)), gauge(x.inflight_ops)))
            .collect(),
    )?;
    let cpu: Vec<_> = s
        .workers
        .iter()
        .enumerate()
        .map(|(i, x)| (l1("worker", w(i)), ConstCounter::new(x.cpu_seconds)))
        .collect();
    o.family(
        "kvtier_worker_cpu",
        "CPU time used by each worker thread.",
        Some(&Unit::Seconds),
        &cpu,
    )?;
    if let Some(t) = s.thread_cpu {
        o.family(
            "kvtier_thread_cpu",
            "CPU time of the process's threads besides the workers, by class: io_uring's \
             kernel threads (io_kernel) and the S3 tier's reactor (s3_reactor); threads alive \
             now.",
            Some(&Unit::Seconds),
            &[
                (
                    l1("class", "io_kernel"),
                    ConstCounter::new(t.io_kernel_seconds),
                ),
                (
                    l1("class", "s3_reactor"),
                    ConstCounter::new(t.s3_reactor_seconds),
                ),
            ],
        )?;
    }
    o.counters(
        "kvtier_worker_submits",
        "io_uring_enter system calls (submitting or waiting), per worker.",
        None,
        s.workers
            .iter()
            .enumerate()
            .map(|(i, x)| (l1("worker", w(i)), x.submits))
            .collect(),
    )?;
    o.counters(
        "kvtier_worker_wakeups",
        "Times each worker was woken from sleep.",
        None,
        s.workers
            .iter()
            .enumerate()
            .map(|(i, x)| (l1("worker", w(i)), x.wakeups))
            .collect(),
    )
}

fn s3(o: &mut Out, s: &Stats) -> Result<(), std::fmt::Error> {
    let Some(c) = &s.s3 else {
        return Ok(());
    };
    let ops = [("head", &c.head), ("get", &c.get), ("put", &c.put)];
    let each = |f: &dyn Fn(&super::S3OpStats) -> u64| -> Vec<(Labels, u64)> {
        ops.iter().map(|(n, x)| (l1("op", *n), f(x))).collect()
    };
    o.counters(
        "kvtier_s3_requests",
        "Requests sent to the object store, retries included.",
        None,
        each(&|x| x.requests),
    )?;
    o.counters(
        "kvtier_s3_errors",
        "Requests that failed for good, after retries (a HEAD or GET answered 404 is not one).",
        None,
        each(&|x| x.errors),
    )?;
    o.counters(
        "kvtier_s3_retries",
        "Requests retried.",
        None,
        each(&|x| x.retries),
    )?;
    o.hists(
        "kvtier_s3_request",
        "Whole object-store operations, retries included.",
        ops.iter()
            .map(|(n, x)| (l1("op", *n), &x.latency_us))
            .collect(),
    )?;
    o.counters(
        "kvtier_s3_promotions",
        "Blocks loaded from the object store and stored on NVMe (ok, failed), or not stored \
         because the workers' queues were full (skipped).",
        None,
        vec![
            (l1("result", "ok"), c.promotions),
            (l1("result", "failed"), c.promotions_failed),
            (l1("result", "skipped"), c.promotions_skipped),
        ],
    )?;
    o.counters(
        "kvtier_s3_demotions",
        "Evicted blocks uploaded, or dropped (upload queue full, or their crc32c did not match).",
        None,
        vec![
            (l1("result", "uploaded"), c.demotions),
            (l1("result", "dropped"), c.demotions_dropped),
        ],
    )?;
    o.counter(
        "kvtier_s3_uploads_dropped",
        "write_ack = \"nvme\" blocks not uploaded because the upload queue was full.",
        c.uploads_dropped,
    )?;
    o.counter(
        "kvtier_s3_background_upload_failures",
        "Background uploads (write_ack = \"nvme\", demotions) that failed after retries.",
        c.background_upload_failures,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{DeviceStats, Histogram, WorkerStats};

    fn sample() -> Stats {
        let h = Histogram::default();
        for v in [10u64, 100, 1000, 10_000] {
            h.record(v);
        }
        let mut d = DeviceStats {
            path: "/dev/nvme0n1".into(),
            bytes_read: 4096,
            slots_total: 10,
            blocks_stored: 3,
            load_latency_us: h.snapshot(),
            ..DeviceStats::default()
        };
        d.errors[ErrClass::Io as usize] = 2;
        Stats {
            loads_ok: 7,
            block_bytes: 4096,
            layout: "slab",
            devices: vec![d],
            workers: vec![WorkerStats::default(); 2],
            ..Stats::default()
        }
    }

    #[test]
    fn prometheus_text_has_families_labels_and_exact_histogram() {
        let text = render(sample(), Format::Prometheus);
        for line in [
            "kvtier_blocks_total{op=\"load\",result=\"ok\"} 7",
            "kvtier_device_errors_total{device=\"/dev/nvme0n1\",class=\"io\"} 2",
            "kvtier_device_bytes_total{device=\"/dev/nvme0n1\",op=\"read\"} 4096",
            "kvtier_device_capacity_bytes{device=\"/dev/nvme0n1\"} 40960",
            "kvtier_device_used_bytes{device=\"/dev/nvme0n1\"} 12288",
            "kvtier_worker_inflight_ios{worker=\"1\"} 0",
            // 10 µs is below the first bound (16 µs); 100 below 128; 1000 below 1024.
            "kvtier_device_io_seconds_bucket{device=\"/dev/nvme0n1\",op=\"load\",le=\"1.6e-05\"} 1",
            "kvtier_device_io_seconds_bucket{device=\"/dev/nvme0n1\",op=\"load\",le=\"0.000128\"} 2",
            "kvtier_device_io_seconds_bucket{device=\"/dev/nvme0n1\",op=\"load\",le=\"0.001024\"} 3",
            "kvtier_device_io_seconds_bucket{device=\"/dev/nvme0n1\",op=\"load\",le=\"+Inf\"} 4",
            "kvtier_device_io_seconds_count{device=\"/dev/nvme0n1\",op=\"load\"} 4",
            "kvtier_device_io_seconds_sum{device=\"/dev/nvme0n1\",op=\"load\"} 0.01111",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
        assert!(
            !text.contains("kvtier_s3_"),
            "no S3 families without an S3 tier"
        );
        assert!(!text.contains("# EOF"));
    }

    #[test]
    fn openmetrics_text_ends_with_eof_and_escapes_labels() {
        let mut s = sample();
        s.devices[0].path = "/data/a \"b\"\\c".into();
        let text = render(s, Format::OpenMetrics);
        assert!(text.ends_with("# EOF\n"));
        assert!(
            text.contains(r#"device="/data/a \"b\"\\c""#),
            "label value escaped: {text}"
        );
        assert!(text.contains("# TYPE kvtier_device_io_seconds histogram"));
        assert!(text.contains("# UNIT kvtier_device_io_seconds seconds"));
    }

    #[test]
    fn files_directory_without_cap_has_no_capacity_series() {
        let mut s = sample();
        s.devices[0].slots_total = 0;
        let text = render(s, Format::Prometheus);
        assert!(!text.contains("kvtier_device_capacity_bytes{"));
        assert!(text.contains("kvtier_device_used_bytes{"));
    }
}
