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
    })
}

/// One fio run and the kvtier run after it.
pub(super) struct Pair {
    pub(super) fio: Run,
    pub(super) kvtier: Run,
    pub(super) ratio: f64,
    pub(super) store_ratio: Option<f64>,
    pub(super) cpu_ratio: f64,
    pub(super) kvtier_caller_cpu_s: f64,
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
            // A mixed phase's two rows carry the same phase-wide caller CPU: count it once.
            kvtier_caller_cpu_s: rows.first().map_or(0.0, |r| r.bench_cpu_seconds),
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
            kvtier,
        }
    }

    pub(super) fn to_json(&self) -> Value {
        json!({
            "fio": self.fio,
            "kvtier": self.kvtier,
            "fio_cpu_s_per_gib": self.fio.cpu_s_per_gib(),
            "kvtier_cpu_s_per_gib": self.kvtier.cpu_s_per_gib(),
            "ratio": self.ratio,
            "store_ratio": self.store_ratio,
            "cpu_ratio": self.cpu_ratio,
            "kvtier_caller_cpu_s": self.kvtier_caller_cpu_s,
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
    pub(super) pairs: Vec<Pair>,
}

/// Medians over a cell's pairs.
pub(super) struct CellSummary {
    pub(super) kind: Kind,
    pub(super) block_bytes: u64,
    pub(super) queue_depth: u32,
    pub(super) numjobs: u32,
    pub(super) iodepth: u32,
    /// Medians of each number over the pairs.
    pub(super) fio: Run,
    pub(super) kvtier: Run,
    pub(super) fio_cpu_s_per_gib: f64,
    pub(super) kvtier_cpu_s_per_gib: f64,
    pub(super) ratio: Spread,
    pub(super) store_ratio: Option<Spread>,
    pub(super) cpu_ratio: Spread,
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
    }
}

impl Cell {
    pub(super) fn summary(&self) -> CellSummary {
        let pairs = &self.pairs;
        let store_ratios: Vec<f64> = pairs.iter().filter_map(|p| p.store_ratio).collect();
        CellSummary {
            kind: self.plan.kind,
            block_bytes: self.plan.block_bytes,
            queue_depth: self.plan.queue_depth,
            numjobs: self.plan.numjobs,
            iodepth: self.plan.iodepth,
            fio: median_run(&pairs.iter().map(|p| &p.fio).collect::<Vec<_>>()),
            kvtier: median_run(&pairs.iter().map(|p| &p.kvtier).collect::<Vec<_>>()),
            fio_cpu_s_per_gib: median(pairs.iter().map(|p| p.fio.cpu_s_per_gib())),
            kvtier_cpu_s_per_gib: median(pairs.iter().map(|p| p.kvtier.cpu_s_per_gib())),
            ratio: Spread::of(pairs.iter().map(|p| p.ratio)),
            store_ratio: (!store_ratios.is_empty()).then(|| Spread::of(store_ratios)),
            cpu_ratio: Spread::of(pairs.iter().map(|p| p.cpu_ratio)),
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
            "fio_store_gib_per_s": store(&self.fio),
            "kvtier_store_gib_per_s": store(&self.kvtier),
            "store_ratio_median": self.store_ratio.map(|s| s.median),
            "fio_store_p50_us": store_lat(&self.fio, false),
            "fio_store_p99_us": store_lat(&self.fio, true),
            "kvtier_store_p50_us": store_lat(&self.kvtier, false),
            "kvtier_store_p99_us": store_lat(&self.kvtier, true),
            "fio_job": self.job,
            "pairs": self.pairs,
        })
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
                o.kind == kind && o.block_bytes == c.block_bytes && o.queue_depth == c.queue_depth
            })
        };
        cells
            .iter()
            .filter(|c| c.kind == Kind::Mixed)
            .filter_map(|c| {
                let (load, store) = (find(Kind::Load, c)?, find(Kind::Store, c)?);
                Some(MixAgainstAlone {
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

pub(super) fn render(cells: &[CellSummary], first: &Prepared) -> String {
    let mut table = Table::new(&[
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
    ]);
    let lat = |s: &Stream| format!("{:.0}/{:.0}", s.p50_us, s.p99_us);
    let spread = |s: &Spread| {
        let flag = if s.median < RATIO_GOAL { " <" } else { "" };
        format!("{:.3} ({:.2}-{:.2}){flag}", s.median, s.min, s.max)
    };
    for c in cells {
        let name = if c.kind == Kind::Mixed {
            "mixed: loads"
        } else {
            c.kind.name()
        };
        table.row(vec![
            name.to_owned(),
            output::size(c.block_bytes),
            c.queue_depth.to_string(),
            format!("{:.3}", c.fio.main.gib_per_s),
            format!("{:.3}", c.kvtier.main.gib_per_s),
            spread(&c.ratio),
            lat(&c.fio.main),
            lat(&c.kvtier.main),
            format!("{:.3}", c.fio_cpu_s_per_gib),
            format!("{:.3}", c.kvtier_cpu_s_per_gib),
            format!("{:.2}", c.cpu_ratio.median),
        ]);
        if let (Some(f), Some(k), Some(r)) = (c.fio.store, c.kvtier.store, c.store_ratio) {
            table.row(vec![
                "mixed: stores".to_owned(),
                output::size(c.block_bytes),
                c.queue_depth.to_string(),
                format!("{:.3}", f.gib_per_s),
                format!("{:.3}", k.gib_per_s),
                format!("{:.3} ({:.2}-{:.2})", r.median, r.min, r.max),
                lat(&f),
                lat(&k),
                "-".into(),
                "-".into(),
                "-".into(),
            ]);
        }
    }
    let mut text = table.to_string();
    let _ = writeln!(
        text,
        "ratio: kvtier / fio bandwidth, median over the pairs (min-max); `<` marks a median \
         below {RATIO_GOAL}.\n\
         cpu s/GiB: fio usr+sys of its jobs, kvtier its worker threads (mixed: both streams; \
         kvtier's caller thread is in the JSON as kvtier_caller_cpu_s); cpu ratio: kvtier / fio, \
         lower is better for kvtier.\n\
         fio ran {} job(s) per stream, iodepth = ceil(QD / {}), cpus_allowed={} ({}), \
         iomem={}; latencies are fio's total (submit to completion) and kvtier's job latency.",
        first.numjobs, first.numjobs, first.cpus, first.cpus_policy, first.iomem
    );
    if cells.iter().any(|c| c.queue_depth % c.numjobs != 0) {
        let _ = writeln!(
            text,
            "note: where QD is not a multiple of {}, fio keeps more I/O in flight than kvtier",
            first.numjobs
        );
    }
    text.push_str(&render_mix(&MixAgainstAlone::of(cells)));
    let below: Vec<String> = cells
        .iter()
        .filter(|c| c.ratio.median < RATIO_GOAL)
        .map(CellSummary::label)
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
