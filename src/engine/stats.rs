//! What `Engine::stats`, `Engine::metrics_text` and the metrics endpoint read: the counters of
//! every worker, the engine and the cold tier, shared so the endpoint's thread can take a
//! snapshot without the engine handle.

use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

use crate::cold::ColdTier;
use crate::config::{Derived, DeviceConfig, Layout};
use crate::job::Shared;
use crate::metrics::{Stats, ThreadCpu, WorkerStats};
use crate::route::Router;
use crate::worker::{self, WorkerShared};

pub(crate) struct StatsSource {
    /// Each worker and the core it runs on.
    pub workers: Vec<(Arc<WorkerShared>, Option<usize>)>,
    pub shared: Arc<Shared>,
    /// Set once the cold tier is open.
    pub cold: OnceLock<Arc<dyn ColdTier>>,
    /// The configured device paths, in config order.
    pub devices: Vec<String>,
    /// Files layout: each directory's bound in blocks (`capacity_bytes`), if it has one. The
    /// workers share a directory's bound rather than splitting it, so it is not theirs to count.
    pub files_capacity_blocks: Vec<Option<u64>>,
    pub block_bytes: u64,
    pub layout: &'static str,
}

impl crate::metrics::serve::StatsSnapshot for StatsSource {
    fn stats(&self) -> Stats {
        self.stats_with_threads()
    }
}

impl StatsSource {
    pub fn new(
        router: &Router,
        cores: &[Option<usize>],
        shared: &Arc<Shared>,
        devices: &[DeviceConfig],
        derived: &Derived,
    ) -> StatsSource {
        StatsSource {
            workers: router
                .workers
                .iter()
                .zip(cores)
                .map(|(h, c)| (Arc::clone(&h.1), *c))
                .collect(),
            shared: Arc::clone(shared),
            cold: OnceLock::new(),
            devices: devices
                .iter()
                .map(|d| d.path.display().to_string())
                .collect(),
            files_capacity_blocks: devices
                .iter()
                .map(|d| {
                    (d.layout == Layout::Files)
                        .then_some(d.capacity_bytes)
                        .flatten()
                        .map(|c| c / derived.block_bytes)
                })
                .collect(),
            block_bytes: derived.block_bytes,
            layout: match derived.layout {
                Layout::Files => "files",
                Layout::Slab => "slab",
            },
        }
    }

    /// [`StatsSource::stats`] and the CPU of the engine's other threads (a scan of
    /// `/proc/self/task`: for the endpoint and the benches, not for every step of a caller).
    pub fn stats_with_threads(&self) -> Stats {
        let mut s = self.stats();
        let (io_kernel, s3) = thread_class_cpu_ns();
        s.thread_cpu = Some(ThreadCpu {
            io_kernel_seconds: io_kernel as f64 / 1e9,
            s3_reactor_seconds: s3 as f64 / 1e9,
        });
        s
    }

    /// A snapshot of every counter now.
    pub fn stats(&self) -> Stats {
        let mut s = Stats {
            block_bytes: self.block_bytes,
            layout: self.layout,
            ..Stats::default()
        };
        for (w, core) in &self.workers {
            s.add(&w.metrics);
            let tid = w.tid.load(Ordering::Acquire);
            let cpu = if tid > 0 {
                worker::shared::thread_cpu_ns(tid) as f64 / 1e9
            } else {
                0.0
            };
            s.worker_cpu_seconds += cpu;
            let m = &w.metrics;
            let l = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
            s.workers.push(WorkerStats {
                core: *core,
                queued_loads: l(&m.queued_loads),
                queued_stores: l(&m.queued_stores),
                inflight_ops: l(&m.inflight_ops),
                submits: l(&m.submits),
                wakeups: l(&m.wakeups),
                cpu_seconds: cpu,
            });
        }
        s.devices.truncate(self.devices.len().max(1));
        for ((d, path), cap) in s
            .devices
            .iter_mut()
            .zip(&self.devices)
            .zip(&self.files_capacity_blocks)
        {
            d.path.clone_from(path);
            if let Some(cap) = cap {
                d.slots_total = *cap;
            }
        }
        s.sum_devices();
        s.jobs = self.shared.metrics.jobs();
        s.lookups = self.shared.metrics.lookups();
        s.jobs_in_flight = self.shared.jobs_in_flight.load(Ordering::Acquire) as u64;
        s.blocks_held_by_hung_io = self.shared.held.blocks();
        s.jobs_released_late = self.shared.held.released_late();
        s.s3 = self.cold.get().map(|c| c.stats());
        s.events_dropped = self.shared.events.dropped();
        s
    }
}

/// CPU time (ns) of this process's threads other than the engine's own: io_uring's kernel
/// threads (`iou-wrk-*`, `iou-sqp-*`) and the S3 tier's reactor (`kvtier-s3`), by their names
/// in `/proc/self/task/*/comm`.
fn thread_class_cpu_ns() -> (u64, u64) {
    let (mut io_kernel, mut s3) = (0, 0);
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return (0, 0);
    };
    for task in tasks.flatten() {
        let Some(tid) = task.file_name().to_str().and_then(|t| t.parse().ok()) else {
            continue;
        };
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        let class = if comm.starts_with("iou-wrk-") || comm.starts_with("iou-sqp-") {
            &mut io_kernel
        } else if comm.starts_with(crate::cold::REACTOR_THREAD) {
            &mut s3
        } else {
            continue;
        };
        *class += worker::shared::thread_cpu_ns(tid);
    }
    (io_kernel, s3)
}
