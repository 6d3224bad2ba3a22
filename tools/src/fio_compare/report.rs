//! Results: fio's and kvtier's numbers per run, pairs and their ratios, cell medians with
//! their spread, and the table.

use super::*;
/// One stream of one run: loads, or stores.
#[derive(Clone, Copy, Debug, Serialize)]
pub(super) struct Stream {
    pub(super) gib_per_s: f64,
    pub(super) p50_us: f64,
    pub(super) p99_us: f64,
}

/// What one run (fio or kvtier) measured.
#[derive(Clone, Copy, Debug, Serialize)]
pub(super) struct Run {
    /// Loads for `load` and `mixed`, stores for `store`.
    pub(super) main: Stream,
    /// The stores of a `mixed` run.
    pub(super) store: Option<Stream>,
    /// CPU seconds over the run (fio: usr + sys of its jobs; kvtier: its worker threads).
    pub(super) cpu_seconds: f64,
    /// GiB moved by every stream of the run.
    pub(super) gib_moved: f64,
    pub(super) seconds: f64,
    /// Times a thread of the run slept per I/O: fio's context switches (`ctx`) over its
    /// I/Os; kvtier's workers' sleeps over their device operations (table pages included).
    /// `None` when the run reports none.
    pub(super) sleeps_per_io: Option<f64>,
}

impl Run {
    pub(super) fn cpu_s_per_gib(&self) -> f64 {
        if self.gib_moved > 0.0 {
            self.cpu_seconds / self.gib_moved
        } else {
            0.0
        }
    }
}

/// fio's report for a job file of `kind`: jobs `loads` (read side) and `stores` (write side),
/// one entry per group (`group_reporting`).
pub(super) fn fio_result(doc: &Value, kind: Kind) -> CliResult<Run> {
    let bad = |what: String| CliError::runtime(format!("fio's JSON report: {what}"));
    let jobs = doc["jobs"]
        .as_array()
        .ok_or_else(|| bad("no `jobs` array".into()))?;
    let mut loads = None;
    let mut stores = None;
    let (mut cpu_seconds, mut bytes, mut seconds) = (0.0, 0.0, 0.0_f64);
    let (mut ctx, mut ios) = (0.0, 0.0);
    for job in jobs {
        let name = job["jobname"].as_str().unwrap_or("?");
        if job["error"].as_i64().unwrap_or(0) != 0 {
            return Err(bad(format!("job {name} reports error {}", job["error"])));
        }
        let num = |v: &Value| v.as_f64().unwrap_or(0.0);
        // usr_cpu/sys_cpu are percentages of job_runtime (ms), which sums a group's jobs.
        cpu_seconds += (num(&job["usr_cpu"]) + num(&job["sys_cpu"])) / 100.0
            * num(&job["job_runtime"])
            / 1000.0;
        let side = match name {
            "loads" => &job["read"],
            "stores" => &job["write"],
            other => return Err(bad(format!("unexpected job {other}"))),
        };
        let pct = |p: &str| num(&side["lat_ns"]["percentile"][p]) / 1000.0;
        let stream = Stream {
            gib_per_s: num(&side["bw_bytes"]) / GIB,
            p50_us: pct("50.000000"),
            p99_us: pct("99.000000"),
        };
        bytes += num(&side["io_bytes"]);
        ios += num(&side["total_ios"]);
        ctx += num(&job["ctx"]);
        seconds = seconds.max(num(&side["runtime"]) / 1000.0);
        if name == "loads" {
            loads = Some(stream);
        } else {
            stores = Some(stream);
        }
    }
    let (main, store) = match kind {
        Kind::Load => (loads, None),
        Kind::Store => (stores, None),
        Kind::Mixed => (loads, Some(stores)),
    };
    let missing = || bad(format!("no results for the {} job", kind.fio_file()));
    let store = match store {
        Some(s) => Some(s.ok_or_else(missing)?),
        None => None,
    };
    Ok(Run {
        main: main.ok_or_else(missing)?,
        store,
        cpu_seconds,
        gib_moved: bytes / GIB,
        seconds,
        sleeps_per_io: (ios > 0.0).then(|| ctx / ios),
    })
}

/// kvtier's rows for `kind` as a [`Run`].
pub(super) fn kvtier_result(rows: &[WorkloadRow], kind: Kind) -> CliResult<Run> {
    let find = |name: &str| {
        rows.iter().find(|r| r.workload == name).ok_or_else(|| {
            CliError::runtime(format!(
                "the engine run produced no {name} row (interrupted?)"
            ))
        })
    };
    let stream = |r: &WorkloadRow| Stream {
        gib_per_s: r.gib_per_s,
        p50_us: r.p50_us as f64,
        p99_us: r.p99_us as f64,
    };
    let (main, store) = match kind {
        Kind::Load => (find("load")?, None),
        Kind::Store => (find("store")?, None),
        Kind::Mixed => (find("mixed_load")?, Some(find("mixed_store")?)),
    };
    let bytes = main.bytes + store.map_or(0, |s| s.bytes);
    Ok(Run {
        main: stream(main),
        store: store.map(stream),
        cpu_seconds: main.cpu_seconds,
        gib_moved: bytes as f64 / GIB,
        seconds: main.seconds,
        sleeps_per_io: main.worker_io.sleeps_per_op(),
    })
}

/// One fio run and the kvtier run after it.
pub(super) struct Pair {
    pub(super) fio: Run,
    /// Store cells: fio's stores with a crc32c of every block (`fio::CHECKSUM_OPTIONS`).
    pub(super) fio_crc32c: Option<Run>,
    pub(super) kvtier: Run,
    pub(super) ratio: f64,
    pub(super) store_ratio: Option<f64>,
    pub(super) cpu_ratio: f64,
    /// kvtier's CPU per GiB over fio-with-crc32c's.
    pub(super) cpu_ratio_crc32c: Option<f64>,
    pub(super) kvtier_caller_cpu_s: f64,
    /// kvtier's CPU per GiB by thread class (caller, workers, io_uring kernel threads, S3).
    pub(super) kvtier_thread_cpu: Option<bench::ThreadCpu>,
    pub(super) kvtier_verified: u64,
    pub(super) kvtier_corrupt: u64,
    pub(super) kvtier_failed: u64,
    pub(super) kvtier_io_errors: u64,
    pub(super) kvtier_checksum_failures: u64,
    pub(super) kvtier_region_backing: &'static str,
    /// What fio's buffers were for this pair (`malloc` when hugetlb memory ran out).
    pub(super) fio_iomem: &'static str,
    /// The engine's I/O counters over the whole run (fill included).
    pub(super) kvtier_engine: Value,
}

impl Pair {
    pub(super) fn new(
        fio: Run,
        fio_crc32c: Option<Run>,
        kvtier: Run,
        engine: &bench::EngineRun,
        fio_iomem: &'static str,
    ) -> Pair {
        let rows = &engine.rows;
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
        let store_ratio = match (kvtier.store, fio.store) {
            (Some(k), Some(f)) => Some(ratio(k.gib_per_s, f.gib_per_s)),
            _ => None,
        };
        Pair {
            ratio: ratio(kvtier.main.gib_per_s, fio.main.gib_per_s),
            store_ratio,
            cpu_ratio: ratio(kvtier.cpu_s_per_gib(), fio.cpu_s_per_gib()),
            cpu_ratio_crc32c: fio_crc32c.map(|f| ratio(kvtier.cpu_s_per_gib(), f.cpu_s_per_gib())),
            // A mixed phase's two rows carry the same phase-wide caller CPU: count it once.
            kvtier_caller_cpu_s: rows.first().map_or(0.0, |r| r.bench_cpu_seconds),
            kvtier_thread_cpu: rows.first().and_then(|r| r.cpu_s_per_gib_by_thread),
            kvtier_verified: rows.iter().map(|r| r.verified_blocks).sum(),
            kvtier_corrupt: rows.iter().map(|r| r.corrupt_blocks).sum(),
            kvtier_failed: rows.iter().map(|r| r.failed_blocks + r.missed_blocks).sum(),
            kvtier_io_errors: engine.stats.io_errors,
            kvtier_checksum_failures: engine.stats.checksum_failures,
            kvtier_region_backing: engine.region_backing,
            fio_iomem,
            kvtier_engine: json!({
                "read_ops": engine.stats.read_ops,
                "write_ops": engine.stats.write_ops,
                "table_writes": engine.stats.table_writes,
                "evictions": engine.stats.evictions,
                "submits": engine.stats.submits,
                "wakeups": engine.stats.wakeups,
                "stores_ok": engine.stats.stores_ok,
                "loads_ok": engine.stats.loads_ok,
                // Push to completion inside the worker (the job latencies add the handoffs).
                "load_device_p50_us": engine.stats.load_latency_us.quantile(0.5),
                "load_device_p99_us": engine.stats.load_latency_us.quantile(0.99),
                "store_device_p50_us": engine.stats.store_latency_us.quantile(0.5),
                "store_device_p99_us": engine.stats.store_latency_us.quantile(0.99),
            }),
            fio,
            fio_crc32c,
            kvtier,
        }
    }

    pub(super) fn to_json(&self) -> Value {
        json!({
            "fio": self.fio,
            "fio_crc32c": self.fio_crc32c,
            "kvtier": self.kvtier,
            "fio_cpu_s_per_gib": self.fio.cpu_s_per_gib(),
            "fio_crc32c_cpu_s_per_gib": self.fio_crc32c.as_ref().map(Run::cpu_s_per_gib),
            "cpu_ratio_crc32c": self.cpu_ratio_crc32c,
            "kvtier_cpu_s_per_gib": self.kvtier.cpu_s_per_gib(),
            "ratio": self.ratio,
            "store_ratio": self.store_ratio,
            "cpu_ratio": self.cpu_ratio,
            "kvtier_caller_cpu_s": self.kvtier_caller_cpu_s,
            "kvtier_cpu_s_per_gib_by_thread": self.kvtier_thread_cpu,
            "kvtier_verified_blocks": self.kvtier_verified,
            "kvtier_corrupt_blocks": self.kvtier_corrupt,
            "kvtier_failed_blocks": self.kvtier_failed,
            "kvtier_io_errors": self.kvtier_io_errors,
            "kvtier_checksum_failures": self.kvtier_checksum_failures,
            "kvtier_region_backing": self.kvtier_region_backing,
            "fio_iomem": self.fio_iomem,
            "kvtier_engine_counters": self.kvtier_engine,
        })
    }
}

pub(super) struct Cell {
    pub(super) plan: CellPlan,
    /// The `--device-limit` it ran under (`None`: the disk as it is).
    pub(super) device_limit: Limit,
    pub(super) pairs: Vec<Pair>,
}

/// Medians over a cell's pairs.
pub(super) struct CellSummary {
    pub(super) kind: Kind,
    pub(super) device_limit: Limit,
    pub(super) block_bytes: u64,
    pub(super) queue_depth: u32,
    pub(super) numjobs: u32,
    pub(super) iodepth: u32,
    /// Medians of each number over the pairs.
    pub(super) fio: Run,
    /// Store cells with the checksum reference: fio's stores with a crc32c of every block.
    pub(super) fio_crc32c: Option<Run>,
    pub(super) kvtier: Run,
    pub(super) fio_cpu_s_per_gib: f64,
    pub(super) fio_crc32c_cpu_s_per_gib: Option<f64>,
    pub(super) kvtier_cpu_s_per_gib: f64,
    pub(super) ratio: Spread,
    pub(super) store_ratio: Option<Spread>,
    pub(super) cpu_ratio: Spread,
    /// kvtier's CPU per GiB over fio-with-crc32c's, per pair.
    pub(super) cpu_ratio_crc32c: Option<Spread>,
    /// kvtier's bandwidth over fio-with-crc32c's, per pair.
    pub(super) ratio_crc32c: Option<Spread>,
    /// Medians over the pairs of kvtier's CPU per GiB by thread class.
    pub(super) kvtier_thread_cpu: Option<bench::ThreadCpu>,
    pub(super) job: String,
    pub(super) pairs: Vec<Value>,
}

/// The median of some values, with their range.
#[derive(Clone, Copy, Debug)]
pub(super) struct Spread {
    pub(super) median: f64,
    pub(super) min: f64,
    pub(super) max: f64,
}

impl Spread {
    pub(super) fn of(values: impl IntoIterator<Item = f64>) -> Spread {
        let mut v: Vec<f64> = values.into_iter().collect();
        v.sort_by(f64::total_cmp);
        Spread {
            median: median_sorted(&v),
            min: v.first().copied().unwrap_or(0.0),
            max: v.last().copied().unwrap_or(0.0),
        }
    }
}

/// The run whose every number is the median of that number over `runs`.
pub(super) fn median_run(runs: &[&Run]) -> Run {
    let m = |f: &dyn Fn(&Run) -> f64| median(runs.iter().map(|r| f(r)));
    let stream = |pick: &dyn Fn(&Run) -> Stream| Stream {
        gib_per_s: m(&|r| pick(r).gib_per_s),
        p50_us: m(&|r| pick(r).p50_us),
        p99_us: m(&|r| pick(r).p99_us),
    };
    let has_store = runs.iter().all(|r| r.store.is_some());
    Run {
        main: stream(&|r| r.main),
        store: has_store.then(|| stream(&|r| r.store.expect("checked above"))),
        cpu_seconds: m(&|r| r.cpu_seconds),
        gib_moved: m(&|r| r.gib_moved),
        seconds: m(&|r| r.seconds),
        sleeps_per_io: runs
            .iter()
            .all(|r| r.sleeps_per_io.is_some())
            .then(|| m(&|r| r.sleeps_per_io.unwrap_or(0.0))),
    }
}

impl Cell {
    pub(super) fn summary(&self) -> CellSummary {
        let pairs = &self.pairs;
        let store_ratios: Vec<f64> = pairs.iter().filter_map(|p| p.store_ratio).collect();
        let crc: Vec<(&Pair, &Run)> = pairs
            .iter()
            .filter_map(|p| p.fio_crc32c.as_ref().map(|f| (p, f)))
            .collect();
        // Only when every pair ran it: medians over a subset would compare other pairs.
        let crc = (!crc.is_empty() && crc.len() == pairs.len()).then_some(crc);
        CellSummary {
            kind: self.plan.kind,
            device_limit: self.device_limit,
            block_bytes: self.plan.block_bytes,
            queue_depth: self.plan.queue_depth,
            numjobs: self.plan.numjobs,
            iodepth: self.plan.iodepth,
            fio: median_run(&pairs.iter().map(|p| &p.fio).collect::<Vec<_>>()),
            kvtier: median_run(&pairs.iter().map(|p| &p.kvtier).collect::<Vec<_>>()),
            fio_cpu_s_per_gib: median(pairs.iter().map(|p| p.fio.cpu_s_per_gib())),
            fio_crc32c: crc
                .as_ref()
                .map(|c| median_run(&c.iter().map(|&(_, f)| f).collect::<Vec<_>>())),
            fio_crc32c_cpu_s_per_gib: crc
                .as_ref()
                .map(|c| median(c.iter().map(|(_, f)| f.cpu_s_per_gib()))),
            cpu_ratio_crc32c: crc
                .as_ref()
                .map(|c| Spread::of(c.iter().filter_map(|(p, _)| p.cpu_ratio_crc32c))),
            ratio_crc32c: crc.as_ref().map(|c| {
                Spread::of(c.iter().map(|(p, f)| {
                    if f.main.gib_per_s > 0.0 {
                        p.kvtier.main.gib_per_s / f.main.gib_per_s
                    } else {
                        0.0
                    }
                }))
            }),
            kvtier_cpu_s_per_gib: median(pairs.iter().map(|p| p.kvtier.cpu_s_per_gib())),
            ratio: Spread::of(pairs.iter().map(|p| p.ratio)),
            store_ratio: (!store_ratios.is_empty()).then(|| Spread::of(store_ratios)),
            cpu_ratio: Spread::of(pairs.iter().map(|p| p.cpu_ratio)),
            kvtier_thread_cpu: {
                let t: Vec<bench::ThreadCpu> =
                    pairs.iter().filter_map(|p| p.kvtier_thread_cpu).collect();
                (!t.is_empty()).then(|| bench::ThreadCpu {
                    caller: median(t.iter().map(|t| t.caller)),
                    workers: median(t.iter().map(|t| t.workers)),
                    io_kernel: median(t.iter().map(|t| t.io_kernel)),
                    s3_reactor: median(t.iter().map(|t| t.s3_reactor)),
                })
            },
            job: self.plan.job.clone(),
            pairs: pairs.iter().map(Pair::to_json).collect(),
        }
    }
}

impl CellSummary {
    pub(super) fn label(&self) -> String {
        format!(
            "{} {} QD{}",
            self.kind.name(),
            output::size(self.block_bytes).replace(' ', ""),
            self.queue_depth
        )
    }

    pub(super) fn to_json(&self) -> Value {
        let store = |r: &Run| r.store.map(|s| s.gib_per_s);
        let store_lat = |r: &Run, p99: bool| r.store.map(|s| if p99 { s.p99_us } else { s.p50_us });
        json!({
            "workload": self.kind.name(),
            "device_limit_bytes_per_s": self.device_limit,
            "block_size": self.block_bytes,
            "queue_depth": self.queue_depth,
            "fio_numjobs": self.numjobs,
            "fio_iodepth": self.iodepth,
            "fio_gib_per_s": self.fio.main.gib_per_s,
            "kvtier_gib_per_s": self.kvtier.main.gib_per_s,
            "ratio_median": self.ratio.median,
            "ratio_min": self.ratio.min,
            "ratio_max": self.ratio.max,
            "fio_p50_us": self.fio.main.p50_us,
            "fio_p99_us": self.fio.main.p99_us,
            "kvtier_p50_us": self.kvtier.main.p50_us,
            "kvtier_p99_us": self.kvtier.main.p99_us,
            "fio_cpu_s_per_gib": self.fio_cpu_s_per_gib,
            "kvtier_cpu_s_per_gib": self.kvtier_cpu_s_per_gib,
            "cpu_ratio_median": self.cpu_ratio.median,
            "fio_crc32c_gib_per_s": self.fio_crc32c.map(|r| r.main.gib_per_s),
            "fio_crc32c_p50_us": self.fio_crc32c.map(|r| r.main.p50_us),
            "fio_crc32c_p99_us": self.fio_crc32c.map(|r| r.main.p99_us),
            "fio_crc32c_cpu_s_per_gib": self.fio_crc32c_cpu_s_per_gib,
            "ratio_crc32c_median": self.ratio_crc32c.map(|s| s.median),
            "cpu_ratio_crc32c_median": self.cpu_ratio_crc32c.map(|s| s.median),
            "cpu_ratio_crc32c_min": self.cpu_ratio_crc32c.map(|s| s.min),
            "cpu_ratio_crc32c_max": self.cpu_ratio_crc32c.map(|s| s.max),
            "fio_store_gib_per_s": store(&self.fio),
            "kvtier_store_gib_per_s": store(&self.kvtier),
            "store_ratio_median": self.store_ratio.map(|s| s.median),
            "fio_store_p50_us": store_lat(&self.fio, false),
            "fio_store_p99_us": store_lat(&self.fio, true),
            "kvtier_store_p50_us": store_lat(&self.kvtier, false),
            "kvtier_store_p99_us": store_lat(&self.kvtier, true),
            "kvtier_cpu_s_per_gib_by_thread": self.kvtier_thread_cpu,
            "fio_sleeps_per_io": self.fio.sleeps_per_io,
            "kvtier_sleeps_per_io": self.kvtier.sleeps_per_io,
            "fio_job": self.job,
            "pairs": self.pairs,
        })
    }
}

/// The line of sleeps per I/O, fio's against kvtier's, for each cell that has both.
fn sleeps_line(text: &mut String, cells: &[&CellSummary]) {
    let sleeps: Vec<String> = cells
        .iter()
        .filter_map(|c| {
            let (f, k) = (c.fio.sleeps_per_io?, c.kvtier.sleeps_per_io?);
            Some(format!(
                "{} {} QD {} {f:.2}/{k:.2}",
                c.kind.name(),
                output::size(c.block_bytes),
                c.queue_depth
            ))
        })
        .collect();
    if !sleeps.is_empty() {
        let _ = writeln!(
            text,
            "sleeps per I/O, fio (context switches)/kvtier (worker sleeps; table pages count as \
             I/O), medians: {}",
            sleeps.join(", ")
        );
    }
}

/// Goals for a mixed cell against the same run's load and store cells: the loads keep at least
/// this share of their rate alone, their p99 at most this multiple of alone, and the stores at
/// least this share of theirs (loads go ahead of stores, but stores must not starve).
const MIX_LOADS_GOAL: f64 = 0.8;
const MIX_LOAD_P99_GOAL: f64 = 2.0;
const MIX_STORES_GOAL: f64 = 0.3;

/// What one tool kept in a mixed cell of its own rates alone (medians over the pairs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Kept {
    /// Loads in the mix / loads alone (GiB/s).
    pub(super) loads: f64,
    /// Loads' p99 in the mix / alone.
    pub(super) load_p99: f64,
    /// Stores in the mix / stores alone (GiB/s).
    pub(super) stores: f64,
}

impl Kept {
    fn of(mixed: &Run, load: &Run, store: &Run) -> Option<Kept> {
        let ratio = |a: f64, b: f64| (b > 0.0).then(|| a / b);
        Some(Kept {
            loads: ratio(mixed.main.gib_per_s, load.main.gib_per_s)?,
            load_p99: ratio(mixed.main.p99_us, load.main.p99_us)?,
            stores: ratio(mixed.store?.gib_per_s, store.main.gib_per_s)?,
        })
    }

    fn to_json(self) -> Value {
        json!({"loads": self.loads, "load_p99": self.load_p99, "stores": self.stores})
    }
}

/// A mixed cell against the load and the store cell of the same block size and queue depth in
/// the same run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct MixAgainstAlone {
    pub(super) device_limit: Limit,
    pub(super) block_bytes: u64,
    pub(super) queue_depth: u32,
    pub(super) kvtier: Kept,
    pub(super) fio: Kept,
}

impl MixAgainstAlone {
    /// One per mixed cell that has both its load and its store cell among `cells`.
    pub(super) fn of(cells: &[CellSummary]) -> Vec<MixAgainstAlone> {
        let find = |kind: Kind, c: &CellSummary| {
            cells.iter().find(|o| {
                o.kind == kind
                    && o.block_bytes == c.block_bytes
                    && o.queue_depth == c.queue_depth
                    && o.device_limit == c.device_limit
            })
        };
        cells
            .iter()
            .filter(|c| c.kind == Kind::Mixed)
            .filter_map(|c| {
                let (load, store) = (find(Kind::Load, c)?, find(Kind::Store, c)?);
                Some(MixAgainstAlone {
                    device_limit: c.device_limit,
                    block_bytes: c.block_bytes,
                    queue_depth: c.queue_depth,
                    kvtier: Kept::of(&c.kvtier, &load.kvtier, &store.kvtier)?,
                    fio: Kept::of(&c.fio, &load.fio, &store.fio)?,
                })
            })
            .collect()
    }

    /// Whether kvtier met the three goals in this cell.
    pub(super) fn met(&self) -> bool {
        let k = &self.kvtier;
        k.loads >= MIX_LOADS_GOAL && k.load_p99 <= MIX_LOAD_P99_GOAL && k.stores >= MIX_STORES_GOAL
    }

    pub(super) fn to_json(self) -> Value {
        json!({
            "device_limit_bytes_per_s": self.device_limit,
            "block_size": self.block_bytes,
            "queue_depth": self.queue_depth,
            "kvtier": self.kvtier.to_json(),
            "fio": self.fio.to_json(),
            "kvtier_met_goals": self.met(),
        })
    }
}

/// The mixed cells against alone, as a table (empty without a mixed cell that has both).
fn render_mix(mix: &[MixAgainstAlone]) -> String {
    if mix.is_empty() {
        return String::new();
    }
    let mut table = Table::new(&[
        "mixed against alone",
        "QD",
        "kvtier loads",
        "kvtier load p99",
        "kvtier stores",
        "fio loads",
        "fio load p99",
        "fio stores",
    ]);
    let flag = |bad: bool| if bad { " <" } else { "" };
    for m in mix {
        let (k, f) = (&m.kvtier, &m.fio);
        table.row(vec![
            output::size(m.block_bytes),
            m.queue_depth.to_string(),
            format!("{:.2}{}", k.loads, flag(k.loads < MIX_LOADS_GOAL)),
            format!("{:.2}x{}", k.load_p99, flag(k.load_p99 > MIX_LOAD_P99_GOAL)),
            format!("{:.2}{}", k.stores, flag(k.stores < MIX_STORES_GOAL)),
            format!("{:.2}", f.loads),
            format!("{:.2}x", f.load_p99),
            format!("{:.2}", f.stores),
        ]);
    }
    let mut text = format!("\n{table}");
    let _ = writeln!(
        text,
        "mixed against alone: each tool's mixed cell over its own load and store cells of \
         this run (medians); kvtier's goals: loads >= {MIX_LOADS_GOAL}, load p99 <= \
         {MIX_LOAD_P99_GOAL}x, stores >= {MIX_STORES_GOAL} (`<` marks a miss)."
    );
    text
}

/// A stream's p50/p99 latency cell, in µs.
fn lat(s: &Stream) -> String {
    format!("{:.0}/{:.0}", s.p50_us, s.p99_us)
}

/// The row under a store row: fio with a crc32c per block, and kvtier against it.
fn checksum_row(c: &CellSummary) -> Option<Vec<String>> {
    let (f, fc, r, cr) = (
        c.fio_crc32c?,
        c.fio_crc32c_cpu_s_per_gib?,
        c.ratio_crc32c?,
        c.cpu_ratio_crc32c?,
    );
    Some(vec![
        "  fio+crc32c".to_owned(),
        output::size(c.block_bytes),
        c.queue_depth.to_string(),
        format!("{:.3}", f.main.gib_per_s),
        format!("{:.3}", c.kvtier.main.gib_per_s),
        format!("{:.3} ({:.2}-{:.2})", r.median, r.min, r.max),
        lat(&f.main),
        lat(&c.kvtier.main),
        format!("{fc:.3}"),
        format!("{:.3}", c.kvtier_cpu_s_per_gib),
        format!("{:.2}", cr.median),
    ])
}

/// The second row of a mixed cell: its stores (bandwidth and latency; CPU is on the loads row,
/// for both streams).
fn mixed_stores_row(c: &CellSummary) -> Option<Vec<String>> {
    let (f, k, r) = (c.fio.store?, c.kvtier.store?, c.store_ratio?);
    let mut row = vec![
        "mixed: stores".to_owned(),
        output::size(c.block_bytes),
        c.queue_depth.to_string(),
        format!("{:.3}", f.gib_per_s),
        format!("{:.3}", k.gib_per_s),
        format!("{:.3} ({:.2}-{:.2})", r.median, r.min, r.max),
        lat(&f),
        lat(&k),
    ];
    row.resize(COLUMNS.len(), "-".to_owned());
    Some(row)
}

/// The main table's columns.
pub(super) const COLUMNS: [&str; 12] = [
    "workload",
    "block",
    "QD",
    "fio GiB/s",
    "kvtier GiB/s",
    "ratio (min-max)",
    "fio p50/p99 µs",
    "kvtier p50/p99 µs",
    "fio cpu s/GiB",
    "kvtier cpu s/GiB",
    "cpu ratio",
    "kvtier caller cpu",
];

/// A cell's rows in the main table: its own, then fio+crc32c's under a store cell, or the
/// stores' under a mixed one. CPU (the caller's too) is on the first row only.
pub(super) fn cell_rows(c: &CellSummary) -> Vec<Vec<String>> {
    let s = &c.ratio;
    let flag = if s.median < RATIO_GOAL { " <" } else { "" };
    let name = if c.kind == Kind::Mixed {
        "mixed: loads"
    } else {
        c.kind.name()
    };
    let mut rows = vec![vec![
        name.to_owned(),
        output::size(c.block_bytes),
        c.queue_depth.to_string(),
        format!("{:.3}", c.fio.main.gib_per_s),
        format!("{:.3}", c.kvtier.main.gib_per_s),
        format!("{:.3} ({:.2}-{:.2}){flag}", s.median, s.min, s.max),
        lat(&c.fio.main),
        lat(&c.kvtier.main),
        format!("{:.3}", c.fio_cpu_s_per_gib),
        format!("{:.3}", c.kvtier_cpu_s_per_gib),
        format!("{:.2}", c.cpu_ratio.median),
        c.kvtier_thread_cpu
            .map_or_else(|| "-".to_owned(), |t| format!("{:.3}", t.caller)),
    ]];
    if let Some(mut row) = checksum_row(c) {
        row.resize(COLUMNS.len(), "-".to_owned());
        rows.push(row);
    }
    rows.extend(mixed_stores_row(c));
    rows
}

/// The table of the cells run at `limit` (every cell when the run had no `--device-limit`).
pub(super) fn render(all: &[CellSummary], limit: Limit, first: &Prepared) -> String {
    let cells: Vec<&CellSummary> = all.iter().filter(|c| c.device_limit == limit).collect();
    let mut table = Table::new(&COLUMNS);
    for &c in &cells {
        for row in cell_rows(c) {
            table.row(row);
        }
    }
    let mut text = table.to_string();
    let _ = writeln!(
        text,
        "ratio: kvtier / fio bandwidth, median over the pairs (min-max); `<` marks a median \
         below {RATIO_GOAL}.\n\
         cpu s/GiB: fio usr+sys of its jobs, kvtier its worker threads (mixed: both streams); \
         cpu ratio: kvtier / fio, lower is better for kvtier. kvtier caller cpu: the CPU per GiB \
         of the thread that submits kvtier's jobs and takes their results (fio does both in its \
         jobs): how long it waits for a result moves CPU between it and the workers (docs/perf.md, \
         \"Issue 35 from end to end\").\n\
         fio+crc32c (under a store row): fio's stores with a crc32c of every block written into \
         its verify header, the checksum work kvtier does (see --show-fio); ratios against it.\n\
         fio ran {} job(s) per stream, iodepth = ceil(QD / {}), cpus_allowed={} ({}), \
         iomem={}; latencies are fio's total (submit to completion) and kvtier's job latency.",
        first.numjobs, first.numjobs, first.cpus, first.cpus_policy, first.iomem
    );
    sleeps_line(&mut text, &cells);
    if cells.iter().any(|c| c.queue_depth % c.numjobs != 0) {
        let _ = writeln!(
            text,
            "note: where QD is not a multiple of {}, fio keeps more I/O in flight than kvtier",
            first.numjobs
        );
    }
    let mix: Vec<MixAgainstAlone> = MixAgainstAlone::of(all)
        .into_iter()
        .filter(|m| m.device_limit == limit)
        .collect();
    text.push_str(&render_mix(&mix));
    let below: Vec<String> = cells
        .iter()
        .filter(|c| c.ratio.median < RATIO_GOAL)
        .map(|c| c.label())
        .collect();
    if !below.is_empty() {
        let _ = writeln!(
            text,
            "below {RATIO_GOAL}x fio: {} (see docs/perf.md for how to profile)",
            below.join(", ")
        );
    }
    text
}

/// One cell (workload, block size, queue depth) at every device limit of the run, fastest
/// first: what CPU per GiB did as the device slowed.
pub(super) struct SpeedDrift<'a> {
    pub(super) at: Vec<&'a CellSummary>,
}

impl<'a> SpeedDrift<'a> {
    /// One per cell measured at more than one limit; limits ordered `None` (the disk as it
    /// is) first, then from the highest rate down.
    pub(super) fn of(cells: &'a [CellSummary]) -> Vec<SpeedDrift<'a>> {
        let mut out: Vec<SpeedDrift<'a>> = Vec::new();
        for c in cells {
            let same = |o: &&CellSummary| {
                o.kind == c.kind && o.block_bytes == c.block_bytes && o.queue_depth == c.queue_depth
            };
            match out.iter_mut().find(|d| same(&d.at[0])) {
                Some(d) => d.at.push(c),
                None => out.push(SpeedDrift { at: vec![c] }),
            }
        }
        out.retain(|d| d.at.len() > 1);
        for d in &mut out {
            d.at.sort_by_key(|c| std::cmp::Reverse(c.device_limit.unwrap_or(u64::MAX)));
        }
        out
    }

    /// CPU per GiB at the slowest limit over the fastest, for `cpu` of a cell.
    fn drift(&self, cpu: impl Fn(&CellSummary) -> Option<f64>) -> Option<f64> {
        let (fast, slow) = (cpu(self.at.first()?)?, cpu(self.at.last()?)?);
        (fast > 0.0).then(|| slow / fast)
    }

    pub(super) fn kvtier(&self) -> Option<f64> {
        self.drift(|c| Some(c.kvtier_cpu_s_per_gib))
    }

    pub(super) fn fio(&self) -> Option<f64> {
        self.drift(|c| Some(c.fio_cpu_s_per_gib))
    }

    pub(super) fn fio_crc32c(&self) -> Option<f64> {
        self.drift(|c| c.fio_crc32c_cpu_s_per_gib)
    }

    pub(super) fn to_json(&self) -> Value {
        let c = self.at[0];
        json!({
            "workload": c.kind.name(),
            "block_size": c.block_bytes,
            "queue_depth": c.queue_depth,
            "speeds": self.at.iter().map(|c| json!({
                "device_limit_bytes_per_s": c.device_limit,
                "fio_gib_per_s": c.fio.main.gib_per_s,
                "kvtier_gib_per_s": c.kvtier.main.gib_per_s,
                "fio_cpu_s_per_gib": c.fio_cpu_s_per_gib,
                "fio_crc32c_cpu_s_per_gib": c.fio_crc32c_cpu_s_per_gib,
                "kvtier_cpu_s_per_gib": c.kvtier_cpu_s_per_gib,
            })).collect::<Vec<Value>>(),
            "kvtier_cpu_drift": self.kvtier(),
            "fio_cpu_drift": self.fio(),
            "fio_crc32c_cpu_drift": self.fio_crc32c(),
        })
    }
}

/// CPU per GiB by device speed: each cell at every limit, and its drift (slowest / fastest).
pub(super) fn render_drift(drifts: &[SpeedDrift<'_>]) -> String {
    if drifts.is_empty() {
        return String::new();
    }
    let mut table = Table::new(&[
        "cpu by device speed",
        "block",
        "QD",
        "device limit",
        "fio GiB/s",
        "kvtier GiB/s",
        "fio cpu s/GiB",
        "fio+crc32c cpu",
        "kvtier cpu s/GiB",
        "cpu ratio",
    ]);
    let opt = |v: Option<f64>, digits: usize| {
        v.map_or_else(|| "-".to_owned(), |v| format!("{v:.digits$}"))
    };
    for d in drifts {
        for c in &d.at {
            table.row(vec![
                c.kind.name().to_owned(),
                output::size(c.block_bytes),
                c.queue_depth.to_string(),
                throttle::limit_label(c.device_limit),
                format!("{:.3}", c.fio.main.gib_per_s),
                format!("{:.3}", c.kvtier.main.gib_per_s),
                format!("{:.3}", c.fio_cpu_s_per_gib),
                opt(c.fio_crc32c_cpu_s_per_gib, 3),
                format!("{:.3}", c.kvtier_cpu_s_per_gib),
                format!("{:.2}", c.cpu_ratio.median),
            ]);
        }
        table.row(vec![
            "  drift".to_owned(),
            String::new(),
            String::new(),
            "slowest/fastest".to_owned(),
            String::new(),
            String::new(),
            opt(d.fio(), 2),
            opt(d.fio_crc32c(), 2),
            opt(d.kvtier(), 2),
            String::new(),
        ]);
    }
    let mut text = format!("\n{table}");
    let _ = writeln!(
        text,
        "drift: CPU per GiB at the slowest device limit over the fastest (1.00: flat); the \
         JSON has it as cpu_by_device_speed."
    );
    text
}
