//! The bench's report: one row per phase, as a table and as JSON.

use super::*;
/// One row of the report and of the JSON `results` array.
#[derive(Serialize)]
pub(crate) struct WorkloadRow {
    pub(crate) workload: &'static str,
    pub(crate) bytes: u64,
    pub(crate) seconds: f64,
    pub(crate) gib_per_s: f64,
    pub(crate) ops_per_s: f64,
    pub(crate) p50_us: u64,
    pub(crate) p99_us: u64,
    pub(crate) p999_us: u64,
    /// Engine worker CPU over the phase (for mixed rows: the whole mixed phase).
    pub(crate) cpu_seconds: f64,
    /// `null` when nothing was moved.
    pub(crate) cpu_s_per_gib: Option<f64>,
    /// io_uring's kernel threads of this process over the phase (`Stats::thread_cpu`).
    pub(crate) io_kernel_cpu_seconds: f64,
    /// The S3 tier's reactor threads over the phase.
    pub(crate) s3_cpu_seconds: f64,
    /// CPU per GiB moved, by thread class; `null` when nothing was moved.
    pub(crate) cpu_s_per_gib_by_thread: Option<ThreadCpu>,
    pub(crate) verified_blocks: u64,
    pub(crate) corrupt_blocks: u64,
    pub(crate) missed_blocks: u64,
    pub(crate) failed_blocks: u64,
    pub(crate) block_size: u64,
    pub(crate) queue_depth: u32,
    /// The bench thread's own CPU (data generation, verification) over the phase.
    pub(crate) bench_cpu_seconds: f64,
    /// The workers' device operations, enters and sleeps over the phase (mixed rows: the
    /// whole mixed phase).
    pub(crate) worker_io: WorkerIo,
    /// Load candidates skipped because the index no longer held them (evicted).
    pub(crate) lookup_skips: u64,
    /// "workload", or "phase" when cpu figures cover both streams of the mixed phase.
    pub(crate) cpu_scope: &'static str,
}

/// What the workers did per device operation over a phase. A sleep is a wait in the kernel
/// for a completion or a submitter's wake-up; on a virtual machine each costs the thread that
/// sleeps several µs of CPU when it wakes (docs/perf.md, "Load CPU per GiB"), which fio's
/// context switches per I/O (fio-compare) measure on fio's side.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub(crate) struct WorkerIo {
    /// Data reads and writes and slot-table page writes.
    pub(crate) device_ops: u64,
    /// `io_uring_enter` calls.
    pub(crate) enters: u64,
    pub(crate) sleeps: u64,
}

impl WorkerIo {
    /// Sleeps per device operation; `None` without operations.
    pub(crate) fn sleeps_per_op(&self) -> Option<f64> {
        (self.device_ops > 0).then(|| self.sleeps as f64 / self.device_ops as f64)
    }

    /// `io_uring_enter` calls per device operation; `None` without operations.
    pub(crate) fn enters_per_op(&self) -> Option<f64> {
        (self.device_ops > 0).then(|| self.enters as f64 / self.device_ops as f64)
    }
}

/// CPU per GiB by the class of thread that spent it.
#[derive(Clone, Copy, Debug, Serialize)]
pub(crate) struct ThreadCpu {
    /// The thread that submits jobs and takes their results (here: the bench's, which also
    /// writes and checks the blocks' data).
    pub(crate) caller: f64,
    /// The engine's worker threads.
    pub(crate) workers: f64,
    /// io_uring's kernel threads (`iou-wrk-*`, `iou-sqp-*`) of this process.
    pub(crate) io_kernel: f64,
    /// The S3 tier's reactor threads.
    pub(crate) s3_reactor: f64,
}

pub(super) fn render(rows: &[WorkloadRow]) -> String {
    let mut table = Table::new(&[
        "workload",
        "GiB/s",
        "blocks/s",
        "p50 µs",
        "p99 µs",
        "p99.9 µs",
        "cpu s",
        "cpu s/GiB",
        "bench cpu s",
        "verified",
        "corrupt",
        "missed",
        "failed",
        "seconds",
    ]);
    for r in rows {
        table.row(vec![
            r.workload.to_owned(),
            format!("{:.3}", r.gib_per_s),
            format!("{:.1}", r.ops_per_s),
            r.p50_us.to_string(),
            r.p99_us.to_string(),
            r.p999_us.to_string(),
            format!("{:.2}", r.cpu_seconds),
            r.cpu_s_per_gib
                .map_or_else(|| "-".into(), |v| format!("{v:.3}")),
            format!("{:.2}", r.bench_cpu_seconds),
            r.verified_blocks.to_string(),
            r.corrupt_blocks.to_string(),
            r.missed_blocks.to_string(),
            r.failed_blocks.to_string(),
            format!("{:.2}", r.seconds),
        ]);
    }
    let mut text = table.to_string();
    text.push_str(
        "cpu s: engine worker threads over the phase (mixed rows: the whole mixed phase, loads \
         and stores together); bench cpu s: the bench thread (copying and verifying data)\n",
    );
    for r in rows {
        if let Some(t) = r.cpu_s_per_gib_by_thread {
            let _ = writeln!(
                text,
                "{} cpu s/GiB by thread: caller {:.3}, workers {:.3}, io_uring kernel threads \
                 {:.3}, S3 reactor {:.3}",
                r.workload, t.caller, t.workers, t.io_kernel, t.s3_reactor
            );
        }
    }
    // A mixed phase's rows share one phase's counts: print them once.
    let mut last = None;
    for r in rows {
        if last.replace(r.worker_io) == Some(r.worker_io) {
            continue;
        }
        if let (Some(enters), Some(sleeps)) =
            (r.worker_io.enters_per_op(), r.worker_io.sleeps_per_op())
        {
            let _ = writeln!(
                text,
                "{} per device op (reads, writes, table pages): workers' io_uring_enter calls \
                 {enters:.2}, sleeps {sleeps:.2}",
                r.workload
            );
        }
    }
    for r in rows.iter().filter(|r| r.lookup_skips > 0) {
        let _ = writeln!(
            text,
            "{}: {} load candidates skipped because the index no longer held them (evicted)",
            r.workload, r.lookup_skips
        );
    }
    text
}
