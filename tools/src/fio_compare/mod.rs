//! `kvtier fio-compare`: how close kvtier runs to what the device can do, measured against fio
//! on the same target, block size, queue depth, cores and buffer type.
//!
//! For each cell (workload × block size × queue depth) it alternates fio and kvtier runs,
//! `--pairs` times, and reports the median of the per-pair ratios kvtier / fio: the machines
//! this runs on are noisy (±25 % run to run on a virtual disk), so absolute numbers are only
//! comparable within a pair. Workloads: `load` (fio randread), `store` (fio randwrite) and
//! `mixed` (loads at the queue depth while stores run at the same depth; fio runs a read group
//! and a write group together with no priorities — the baseline kvtier's scheduler must beat).
//!
//! Sameness, and how it is kept:
//! * Target: kvtier's one slab device (a scratch file, `--device`, or the one device of
//!   `--config`). fio gets `offset = geometry.data_offset` and `size = slot_count * slot_bytes`
//!   of the same file: exactly the bytes kvtier's slots occupy.
//! * Queue depth: `kvtier bench` keeps N jobs of one block in flight in total over W workers;
//!   fio runs `numjobs = W`, `iodepth = ceil(N / W)` (more than N in flight in total when W does
//!   not divide N: the table says so). Each fio job is pinned to one of kvtier's worker cores
//!   (`cpus_allowed_policy = split`).
//! * NVMe passthrough: on an NVMe generic device (`/dev/ngXnY`, which kvtier drives by
//!   passthrough) fio runs `ioengine=io_uring_cmd` (NVMe commands, `cmd_type=nvme`) with
//!   `direct=0` on the same LBAs, and the header is cleared and checked by passthrough too.
//! * Kernel path: fio uses io_uring with `direct=1`, `fixedbufs`, `registerfiles`, `hipri` and
//!   `sqthread_poll` as kvtier's config has iopoll/sqpoll, and `iomem=mmaphuge` when kvtier's
//!   region is hugetlb memory (else malloc: kvtier's THP region then has an edge that fio cannot
//!   be given).
//! * Fresh store per kvtier run: fio writes over kvtier's slots (never its header or table), so
//!   each kvtier run first zeroes the slab header; the engine formats a new, empty store, its
//!   `load`/`mixed` runs first store 75 % of the slots (not measured) and then read what they
//!   stored. The bench checks an 8-byte key stamp at both ends of every loaded block.
//! * CPU: kvtier's is its worker threads' CPU time over the measured phase (the caller thread
//!   that submits and checks stamps is reported separately, as `kvtier_caller_cpu_s`); fio's is
//!   usr + sys of its jobs. Both per GiB moved (both directions in `mixed`).
//!
//! What differs by design and stays in the numbers: a kvtier store also checksums its block
//! (crc32c, on the worker) and records it in the slot table (4 KiB page writes besides the data),
//! and may split a block into several writes (`store_chunk_bytes`) while loads wait; kvtier
//! chooses the slots (free ones in order, then CLOCK victims), so its writes often land next to
//! each other where fio's land at random offsets.
//! When kvtier's region is THP and no hugetlb pages are reserved, fio's buffers are 4 KiB pages:
//! the report says so, since on some devices that alone moves the ratio a lot.
//!
//! Guards against numbers that do not measure the device: the target is written once end to
//! end (`fio/fill.fio`) before anything is measured; every I/O is `O_DIRECT` (the engine runs
//! with `direct_io = "required"`), and a file target must be on a filesystem backed by a block
//! device that accepts `O_DIRECT` (tmpfs accepts the flag and buffers anyway). A target that
//! holds data (a kvtier store, a filesystem) is refused unless `--overwrite`; a mounted block
//! device is always refused. The job files are `tools/fio/*.fio`, compiled in; `--show-fio`
//! prints them filled in for this target and exits without measuring.

use crate::stats::{median, median_sorted};
use std::fmt::Write as _;
use std::io::{IsTerminal, Read as _};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use clap::{ArgAction, Args, ValueEnum};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvtier::config::{DeviceConfig, DirectIo, Layout};
use kvtier::slab::{Header, HeaderRead};
use kvtier::Config;
use kvtier_sys::file::{DeviceFile, OpenOptions};
use kvtier_sys::mem::HugePages;
use serde::Serialize;
use serde_json::{json, Value};

use crate::bench::{self, EngineWorkload, WorkloadRow};
use crate::interrupt;
use crate::output::{self, CliError, CliResult, Human, Table};

mod fio;
mod plot;
mod report;
mod target;
mod throttle;

use fio::{fill_job, max_command_bytes, CellPlan, Fio, FioEngine, Prepared, CHECKSUM_JOB_NAME};
use report::{
    fio_result, kvtier_result, render, render_drift, Cell, CellSummary, MixAgainstAlone, Pair,
    SpeedDrift,
};
use target::Target;
use throttle::{Limit, Throttle};

const FILL_JOB: &str = include_str!("../../fio/fill.fio");
const RANDREAD_JOB: &str = include_str!("../../fio/randread.fio");
const RANDWRITE_JOB: &str = include_str!("../../fio/randwrite.fio");
const MIXED_JOB: &str = include_str!("../../fio/mixed.fio");

/// Where the scratch directory goes by default: /tmp is often tmpfs.
const DEFAULT_DIR: &str = "/var/tmp";
/// Size of the scratch slab, and of a `--device` file that does not exist yet.
const SCRATCH_BYTES: u64 = 1 << 30;
/// Bytes of a block device used unless `--size`: the fill writes all of them once.
const BLOCK_DEVICE_BYTES: u64 = 4 << 30;
/// How long a fio run may take beyond its runtime (start-up, layout) before it is killed.
const FIO_SLACK: Duration = Duration::from_mins(2);
/// How long the fill may take per GiB before it is killed (a slow disk writes 50 MiB/s).
const FILL_SECONDS_PER_GIB: u64 = 20;
/// Largest fill request.
const FILL_BS_MAX: u64 = 1 << 20;
/// The ratio the issue asks kvtier to reach; cells below it are flagged.
const RATIO_GOAL: f64 = 0.95;
const GIB: f64 = (1u64 << 30) as f64;
const PAGE_BYTES: usize = 4096;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum WorkloadArg {
    Load,
    Store,
    Mixed,
    All,
}

#[derive(Args)]
pub struct FioCompareArgs {
    /// Engine config (cores, hugepages, scheduler, ...); its one device is the target unless
    /// --device is given. Default: the bench defaults with a scratch slab in --dir.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Where the scratch directory with its 1 GiB slab goes [default: /var/tmp].
    #[arg(long, conflicts_with_all = ["config", "device"])]
    dir: Option<PathBuf>,
    /// Measure this file, block device or NVMe generic device (`/dev/ngXnY`: kvtier by
    /// passthrough, fio with `ioengine=io_uring_cmd`) instead; its contents are destroyed (see
    /// --overwrite). Devices: the first 4 GiB unless --size.
    #[arg(long)]
    device: Option<PathBuf>,
    #[arg(
        long,
        value_parser = bench::parse_size_arg,
        help = "Bytes of the target to use: the size of a file to create, the part of a block \
                device to use [default: 1 GiB for new files, 4 GiB of a block device]"
    )]
    size: Option<u64>,
    #[arg(
        long = "block-size",
        value_name = "SIZE",
        value_parser = bench::parse_size_arg,
        num_args = 1..,
        value_delimiter = ',',
        action = ArgAction::Append,
        default_values = ["2MiB", "256KiB"],
        help = "Block sizes to measure (repeat, or list them)"
    )]
    block_sizes: Vec<u64>,
    #[arg(
        long = "queue-depth",
        value_name = "N",
        num_args = 1..,
        value_delimiter = ',',
        action = ArgAction::Append,
        default_values_t = [8u32, 32],
        value_parser = clap::value_parser!(u32).range(1..=4096),
        help = "Queue depths to measure: blocks in flight in total (per stream); fio's I/Os"
    )]
    queue_depths: Vec<u32>,
    /// kvtier's blocks per job (a divisor of every queue depth): 1 is a job per block, as fio
    /// issues an I/O per block; vLLM's tier submits a job per transfer, of many blocks.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1024))]
    blocks_per_job: u32,
    /// Which workloads to measure.
    #[arg(long, value_enum, default_value = "all")]
    workload: WorkloadArg,
    /// fio/kvtier pairs per cell; the ratios reported are medians over the pairs.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=100))]
    pairs: u32,
    /// Seconds per measured run (each fio run and each kvtier run).
    #[arg(long, default_value_t = 2.5, value_parser = bench::parse_seconds)]
    duration: f64,
    /// Also write the results as JSON to PATH, or to stdout with `-` (the table then goes to
    /// stderr).
    #[arg(long, value_name = "PATH|-")]
    json: Option<String>,
    /// Draw bandwidth, latency and CPU per GiB of every cell side by side into an SVG file.
    #[arg(long, value_name = "PATH.svg")]
    plot: Option<PathBuf>,
    /// Print the fio jobs this run would use, filled in for this target, and exit.
    #[arg(long)]
    show_fio: bool,
    /// Allow a target that holds data (a kvtier store, a filesystem): it is destroyed.
    #[arg(long)]
    overwrite: bool,
    /// Skip the store cells' second fio reference, fio with a crc32c of every block it writes
    /// (the checksum work kvtier does; see `--show-fio`), which each pair otherwise runs.
    #[arg(long)]
    no_fio_checksum: bool,
    #[arg(
        long = "device-limit",
        value_name = "RATE",
        value_parser = throttle::parse_limit,
        num_args = 1..,
        value_delimiter = ',',
        action = ArgAction::Append,
        help = "Run every cell once per limit on the target disk's reads and writes, e.g. \
                `none,1GiB,256MiB` (bytes per second each; `none`: the disk as it is), to see \
                what CPU per GiB does on a slower device. This process and fio move into a \
                cgroup (v2 io.max, else v1 blkio.throttle) for the run; needs root"
    )]
    device_limit: Vec<Limit>,
}

/// One workload of the comparison.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Load,
    Store,
    Mixed,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Load => "load",
            Kind::Store => "store",
            Kind::Mixed => "mixed",
        }
    }

    fn fio_file(self) -> &'static str {
        match self {
            Kind::Load => "randread.fio",
            Kind::Store => "randwrite.fio",
            Kind::Mixed => "mixed.fio",
        }
    }

    fn template(self) -> &'static str {
        match self {
            Kind::Load => RANDREAD_JOB,
            Kind::Store => RANDWRITE_JOB,
            Kind::Mixed => MIXED_JOB,
        }
    }

    fn engine(self) -> EngineWorkload {
        match self {
            Kind::Load => EngineWorkload::Load,
            Kind::Store => EngineWorkload::Store,
            Kind::Mixed => EngineWorkload::Mixed,
        }
    }
}

fn kinds(arg: WorkloadArg) -> Vec<Kind> {
    match arg {
        WorkloadArg::Load => vec![Kind::Load],
        WorkloadArg::Store => vec![Kind::Store],
        WorkloadArg::Mixed => vec![Kind::Mixed],
        WorkloadArg::All => vec![Kind::Load, Kind::Store, Kind::Mixed],
    }
}

pub fn run(args: &FioCompareArgs) -> CliResult<ExitCode> {
    interrupt::install();
    let human = Human::for_json(args.json.as_deref())?;
    for &qd in &args.queue_depths {
        bench::Depth::new(qd, args.blocks_per_job)?;
    }
    let fio_version = fio_version()?;
    let target = Target::resolve(args)?;
    let workdir = tempfile::Builder::new()
        .prefix("kvtier-fio-jobs-")
        .tempdir()
        .map_err(|e| CliError::runtime(format!("creating a directory for fio jobs: {e}")))?;
    let fio = Fio {
        dir: workdir.path().to_path_buf(),
        show_progress: std::io::stderr().is_terminal(),
    };

    let mut block_sizes = args.block_sizes.clone();
    dedup_keep_order(&mut block_sizes);
    let mut queue_depths = args.queue_depths.clone();
    dedup_keep_order(&mut queue_depths);
    let preps = block_sizes
        .iter()
        .map(|&bs| target.prepare(bs, queue_depths.iter().copied().max().unwrap_or(1)))
        .collect::<CliResult<Vec<Prepared>>>()?;
    let device_bytes = preps[0].device_bytes;
    let fill = fill_job(
        &target.path,
        device_bytes,
        preps[0].engine,
        preps[0].max_command_bytes,
    );
    let duration = Duration::from_secs_f64(args.duration);
    let mut plan: Vec<CellPlan> = Vec::new();
    for kind in kinds(args.workload) {
        for prep in &preps {
            for &qd in &queue_depths {
                plan.push(CellPlan::new(
                    kind,
                    prep,
                    qd,
                    duration,
                    !args.no_fio_checksum,
                )?);
            }
        }
    }

    if args.show_fio {
        let mut text = String::new();
        let _ = writeln!(
            text,
            "# {fio_version}; run each job as: fio --output-format=json FILE (the templates, \
             with comments, are tools/fio/*.fio)"
        );
        if target.scratch.is_some() {
            let _ = writeln!(
                text,
                "# the scratch target is removed when this command exits: pass --device PATH \
                 to keep one"
            );
        }
        let _ = writeln!(
            text,
            "\n# ---- fill.fio: the whole target, once, before anything is measured"
        );
        text.push_str(&fill);
        for cell in &plan {
            let _ = writeln!(
                text,
                "\n# ---- {}: {} {} QD {}",
                cell.kind.fio_file(),
                cell.kind.name(),
                output::size(cell.block_bytes),
                cell.queue_depth
            );
            text.push_str(&cell.job);
            if let Some(job) = &cell.checksum_job {
                let _ = writeln!(
                    text,
                    "\n# ---- {CHECKSUM_JOB_NAME}: the same stores with a crc32c of every block \
                     (the reference for kvtier's checksum work; --no-fio-checksum skips it)"
                );
                text.push_str(job);
            }
        }
        human.print(&text);
        if args.json.is_some() {
            tracing::warn!("--show-fio measures nothing: no JSON written");
        }
        return Ok(ExitCode::SUCCESS);
    }

    let first = &preps[0];
    let cores = kvtier_sys::affinity::available_cores();
    let mut intro = output::engine_text(&first.info, &cores);
    let _ = writeln!(
        intro,
        "fio: {fio_version}; {} job(s) per run pinned like kvtier's workers ({}), iomem={}, \
         ioengine={}",
        first.numjobs,
        first.cpus,
        first.iomem,
        first.engine.vars()[0].1
    );
    if let Some(max) = first.max_command_bytes {
        let _ = writeln!(
            intro,
            "NVMe passthrough: one command carries at most {} on this device and neither the \
             kernel nor fio splits one, so fio issues commands of at most that size, with \
             proportionally more in flight (as kvtier cuts its blocks); fio's latencies are per \
             command, kvtier's per block",
            output::size(max)
        );
    }
    if let Some(note) = memory_note(first, &plan_of(&plan)) {
        let _ = writeln!(intro, "{note}");
    }
    eprint!("{intro}");
    eprintln!(
        "writing the target once end to end ({}) before measuring",
        output::size(device_bytes)
    );
    let fill_secs = (device_bytes >> 30).max(1) * FILL_SECONDS_PER_GIB;
    let fill_started = Instant::now();
    fio.run("fill", &fill, Duration::from_secs(fill_secs), "fill")?;
    let fill_seconds = fill_started.elapsed().as_secs_f64();

    // Made after the fill, which runs at the disk's own speed.
    let limits: Vec<Limit> = if args.device_limit.is_empty() {
        vec![None]
    } else {
        args.device_limit.clone()
    };
    let throttle = if args.device_limit.is_empty() {
        None
    } else {
        let t = Throttle::new(&target.path)?;
        eprintln!(
            "device limits {}: {}",
            limits
                .iter()
                .map(|&l| throttle::limit_label(l))
                .collect::<Vec<_>>()
                .join(", "),
            t.describe()
        );
        Some(t)
    };
    let mut cells: Vec<Cell> = Vec::with_capacity(plan.len() * limits.len());
    let total_runs = plan.len() * args.pairs as usize * limits.len();
    let mut done_runs = 0;
    let started = Instant::now();
    let runs = limits
        .iter()
        .flat_map(|&limit| plan.iter().map(move |c| (limit, c)));
    let mut limit_now = None;
    for (limit, cell_plan) in runs {
        if let Some(t) = &throttle {
            if limit_now != Some(limit) {
                t.set(limit)?;
                limit_now = Some(limit);
            }
        }
        let mut cell = Cell {
            plan: cell_plan.clone(),
            device_limit: limit,
            pairs: Vec::new(),
        };
        let mut label = cell.plan.label();
        if throttle.is_some() {
            let _ = write!(label, " at {}", throttle::limit_label(limit));
        }
        let prep = preps
            .iter()
            .find(|p| p.block_bytes == cell.plan.block_bytes)
            .expect("every cell's block size was prepared");
        for pair in 0..args.pairs {
            if interrupt::requested() {
                break;
            }
            let (fio_doc, fio_iomem) =
                fio.run_cell(cell.plan.kind.fio_file(), &cell.plan.job, duration, &label)?;
            if interrupt::requested() {
                break;
            }
            let fio_run = fio_result(&fio_doc, cell.plan.kind)?;
            let fio_crc32c = match &cell.plan.checksum_job {
                Some(job) => {
                    let label = format!("{label} +crc32c");
                    let (doc, _) = fio.run_cell(CHECKSUM_JOB_NAME, job, duration, &label)?;
                    if interrupt::requested() {
                        break;
                    }
                    Some(fio_result(&doc, cell.plan.kind)?)
                }
                None => None,
            };
            target.wipe_header()?;
            let engine = bench::run_engine(
                &prep.config,
                cell.plan.kind.engine(),
                bench::Depth::new(cell.plan.queue_depth, args.blocks_per_job)?,
                duration,
            )?;
            if interrupt::requested() {
                break; // a cut-short run is no sample
            }
            let kv_run = kvtier_result(&engine.rows, cell.plan.kind)?;
            if engine.region_backing != prep.info.region_backing {
                tracing::warn!(
                    prepared = prep.info.region_backing,
                    now = engine.region_backing,
                    "kvtier's region backing changed since fio's buffers were chosen (hugetlb \
                     pool exhausted?): this pair compares different memory"
                );
            }
            done_runs += 1;
            let p = Pair::new(fio_run, fio_crc32c, kv_run, &engine, fio_iomem);
            eprintln!(
                "[{done_runs:>3}/{total_runs}] {label} pair {}/{}: fio {:.2} GiB/s, kvtier {:.2} \
                 GiB/s, ratio {:.2}{}",
                pair + 1,
                args.pairs,
                p.fio.main.gib_per_s,
                p.kvtier.main.gib_per_s,
                p.ratio,
                p.store_ratio
                    .map_or_else(String::new, |r| format!(" (stores {r:.2})")),
            );
            cell.pairs.push(p);
        }
        if !cell.pairs.is_empty() {
            cells.push(cell);
        }
        if interrupt::requested() {
            break;
        }
    }
    drop(throttle);
    if target.scratch.is_none() {
        // Leave no store behind that fio has scribbled over: a rerun needs no --overwrite.
        target.wipe_header()?;
    }

    let summaries: Vec<CellSummary> = cells.iter().map(Cell::summary).collect();
    let mut text = String::new();
    let _ = writeln!(
        text,
        "\nfio-compare: {} on {} ({}), {} pair(s) of {} s per cell{}, {:.0} s in all\n",
        target.path.display(),
        first.info.devices[0].kind,
        output::size(device_bytes),
        args.pairs,
        args.duration,
        if args.blocks_per_job > 1 {
            format!(", kvtier's jobs of {} blocks", args.blocks_per_job)
        } else {
            String::new()
        },
        started.elapsed().as_secs_f64() + fill_seconds
    );
    let mut shown: Vec<Limit> = Vec::new();
    for c in &summaries {
        if shown.contains(&c.device_limit) {
            continue;
        }
        shown.push(c.device_limit);
        if !args.device_limit.is_empty() {
            let _ = writeln!(
                text,
                "device limit: {}",
                throttle::limit_label(c.device_limit)
            );
        }
        text.push_str(&render(&summaries, c.device_limit, first));
        text.push('\n');
    }
    let drifts = SpeedDrift::of(&summaries);
    text.push_str(&render_drift(&drifts));
    if let Some(note) = memory_note(first, &plan_summary(&summaries)) {
        let _ = writeln!(text, "{note}");
    } else {
        let pages_4k = kvtier::Backing::Pages4K.as_str();
        let mismatched = cells
            .iter()
            .flat_map(|c| &c.pairs)
            .filter(|p| (p.fio_iomem == "malloc") != (p.kvtier_region_backing == pages_4k))
            .count();
        if mismatched > 0 {
            let _ = writeln!(
                text,
                "MEMORY DIFFERS in {mismatched} pair(s): fio and kvtier did not both get huge \
                 pages (the hugetlb pool ran dry); see fio_iomem and kvtier_region_backing in \
                 the JSON"
            );
        }
    }
    human.print(&text);

    if let Some(path) = &args.plot {
        plot::draw(path, &summaries)?;
        eprintln!("chart written to {}", path.display());
    }
    if let Some(json_target) = &args.json {
        let value = json!({
            "cells": summaries.iter().map(CellSummary::to_json).collect::<Vec<Value>>(),
            "mixed_against_alone": MixAgainstAlone::of(&summaries)
                .into_iter()
                .map(MixAgainstAlone::to_json)
                .collect::<Vec<Value>>(),
            "cpu_by_device_speed": drifts.iter().map(SpeedDrift::to_json).collect::<Vec<Value>>(),
            "target": {
                "path": target.path.display().to_string(),
                "kind": first.info.devices[0].kind,
                "size_bytes": device_bytes,
                "fill_seconds": fill_seconds,
            },
            "fio": {"version": fio_version, "fill_job": fill},
            "engine": output::engine_json(&first.info, &cores, None),
            "config": first.config.to_toml_string(),
            "run": {
                "pairs": args.pairs,
                "blocks_per_job": args.blocks_per_job,
                "duration_seconds": args.duration,
                "interrupted": interrupt::requested(),
            },
        });
        output::write_json(json_target, &value)?;
    }
    let corrupt: u64 = cells
        .iter()
        .flat_map(|c| &c.pairs)
        .map(|p| p.kvtier_corrupt)
        .sum();
    if corrupt > 0 {
        eprintln!("CORRUPT DATA: {corrupt} loaded block(s) carried another key's stamp");
        return Ok(ExitCode::from(1));
    }
    if interrupt::requested() {
        eprintln!("interrupted: the results above are partial");
        return Ok(ExitCode::from(130));
    }
    Ok(ExitCode::SUCCESS)
}

/// Why fio's buffers are not the kind of memory kvtier's region is, when they are not, and how
/// to make them so: fio can take huge pages only from the hugetlb pool.
fn memory_note(first: &Prepared, plan: &[(Kind, u64, u32, u32)]) -> Option<String> {
    let backing = first.info.region_backing;
    if first.iomem != "malloc" || backing == kvtier::Backing::Pages4K.as_str() {
        return None;
    }
    let hugepage = 2u64 << 20;
    let bytes = plan
        .iter()
        .map(|&(kind, bs, qd, iodepth)| {
            let streams = if kind == Kind::Mixed { 2 } else { 1 };
            let fio = u64::from(first.numjobs) * u64::from(iodepth) * bs * streams;
            let region = (2 * u64::from(qd)).max(16) * bs;
            fio.max(region)
        })
        .max()
        .unwrap_or(0);
    let pages = bytes.div_ceil(hugepage) + 16;
    Some(format!(
        "MEMORY DIFFERS: kvtier's region is {backing} (huge pages), fio's buffers are 4 KiB pages \
         (fio takes huge pages only from the hugetlb pool, which kvtier got none from). Large requests over \
         scattered pages cost the device path more (more segments per request, split \
         requests), so the ratios include that. For a like-for-like run reserve hugetlb pages, \
         which kvtier and fio then both use: echo {pages} > /proc/sys/vm/nr_hugepages"
    ))
}

/// The (workload, block size, queue depth, fio iodepth) of each plan entry.
fn plan_of(plan: &[CellPlan]) -> Vec<(Kind, u64, u32, u32)> {
    plan.iter()
        .map(|c| (c.kind, c.block_bytes, c.queue_depth, c.iodepth))
        .collect()
}

fn plan_summary(cells: &[CellSummary]) -> Vec<(Kind, u64, u32, u32)> {
    cells
        .iter()
        .map(|c| (c.kind, c.block_bytes, c.queue_depth, c.iodepth))
        .collect()
}

fn dedup_keep_order<T: PartialEq + Copy>(v: &mut Vec<T>) {
    let mut seen = Vec::with_capacity(v.len());
    v.retain(|x| {
        if seen.contains(x) {
            false
        } else {
            seen.push(*x);
            true
        }
    });
}

/// `fio --version`, or how to install fio.
fn fio_version() -> CliResult<String> {
    match Command::new("fio").arg("--version").output() {
        Ok(out) if out.status.success() => {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
        }
        Ok(out) => Err(CliError::runtime(format!(
            "`fio --version` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(CliError::runtime(
            "fio is not installed (or not on PATH): install fio: apt-get install -y fio",
        )),
        Err(e) => Err(CliError::runtime(format!("running fio: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::fio::fill_template;
    use super::*;

    #[test]
    fn templates_fill_every_variable() {
        let prep_vars = [
            ("FILENAME", "/dev/x".to_owned()),
            ("OFFSET", "1048576".to_owned()),
            ("SIZE", "2097152".to_owned()),
            ("BS", "262144".to_owned()),
            ("NUMJOBS", "2".to_owned()),
            ("IODEPTH", "4".to_owned()),
            ("CPUS", "0,1".to_owned()),
            ("CPUS_POLICY", "split".to_owned()),
            ("IOMEM", "malloc".to_owned()),
            ("HIPRI", "0".to_owned()),
            ("SQPOLL", "0".to_owned()),
            ("RUNTIME", "5000ms".to_owned()),
            ("IOENGINE", "io_uring".to_owned()),
            ("DIRECT", "1".to_owned()),
        ];
        for kind in [Kind::Load, Kind::Store, Kind::Mixed] {
            let job = fill_template(kind.template(), &prep_vars).expect("fills");
            let lines: Vec<&str> = job.lines().filter(|l| !l.starts_with(';')).collect();
            assert!(lines.iter().all(|l| !l.contains("${")), "{job}");
            for want in [
                "ioengine=io_uring",
                "direct=1",
                "fixedbufs=1",
                "registerfiles=1",
                "offset=1048576",
                "iodepth=4",
                "cpus_allowed=0,1",
            ] {
                assert!(lines.contains(&want), "{want} missing from\n{job}");
            }
        }
        let fill = fill_job(
            Path::new("/dev/x"),
            (1 << 30) + 8192,
            FioEngine::Uring,
            None,
        );
        assert!(fill.contains("bs=8192\n"), "{fill}");
        assert!(
            fill.contains(&format!("size={}\n", (1u64 << 30) + 8192)),
            "{fill}"
        );
        assert!(fill_template("a=${NOPE}", &prep_vars).is_err());
        assert!(fill_template("a=${BS", &prep_vars).is_err());
    }

    /// A cell with these medians: kvtier's main stream (GiB/s, p99 µs) and, for mixed, its
    /// stores (GiB/s); fio's main stream at `fio` GiB/s and p99 100 µs, its stores at half that.
    fn cell(kind: Kind, block: u64, main: (f64, f64), store: Option<f64>, fio: f64) -> CellSummary {
        let run = |gib: f64, p99: f64, store: Option<f64>| report::Run {
            main: report::Stream {
                gib_per_s: gib,
                p50_us: p99 / 2.0,
                p99_us: p99,
            },
            store: store.map(|g| report::Stream {
                gib_per_s: g,
                p50_us: 1.0,
                p99_us: 2.0,
            }),
            cpu_seconds: 1.0,
            gib_moved: 1.0,
            seconds: 1.0,
            sleeps_per_io: None,
        };
        let one = report::Spread::of([1.0]);
        CellSummary {
            kind,
            device_limit: None,
            block_bytes: block,
            queue_depth: 8,
            numjobs: 2,
            iodepth: 4,
            fio: run(fio, 100.0, store.map(|_| fio / 2.0)),
            fio_crc32c: None,
            kvtier: run(main.0, main.1, store),
            fio_cpu_s_per_gib: 1.0,
            fio_crc32c_cpu_s_per_gib: None,
            kvtier_cpu_s_per_gib: 1.0,
            ratio: one,
            store_ratio: None,
            cpu_ratio: one,
            cpu_ratio_crc32c: None,
            ratio_crc32c: None,
            kvtier_thread_cpu: None,
            job: String::new(),
            pairs: Vec::new(),
        }
    }

    #[test]
    fn the_checksum_options_land_in_the_store_section() {
        // CellPlan::new appends them to the filled store job: its last section must be the
        // one job section, and the options must turn on the checksum without a read-back or
        // a refill.
        let last_section = RANDWRITE_JOB
            .lines()
            .rfind(|l| l.starts_with('['))
            .expect("a section");
        assert_eq!(last_section, "[stores]");
        for want in [
            "verify=crc32c",
            "do_verify=0",
            "refill_buffers=0",
            "verify_pattern=",
        ] {
            assert!(
                fio::CHECKSUM_OPTIONS.lines().any(|l| l.starts_with(want)),
                "{want}"
            );
        }
    }

    #[test]
    fn cpu_drift_compares_the_slowest_limit_with_the_fastest() {
        let mib2 = 2 << 20;
        let at = |limit: Limit, kvtier_cpu: f64, fio_cpu: f64| {
            let mut c = cell(Kind::Store, mib2, (1.0, 100.0), None, 1.0);
            c.device_limit = limit;
            c.kvtier_cpu_s_per_gib = kvtier_cpu;
            c.fio_cpu_s_per_gib = fio_cpu;
            c
        };
        let cells = [
            at(Some(256 << 20), 0.09, 0.06),
            at(None, 0.06, 0.03),
            at(Some(1 << 30), 0.07, 0.04),
            // Another cell at one limit only: no drift for it.
            cell(Kind::Load, mib2, (1.0, 100.0), None, 1.0),
        ];
        let drifts = SpeedDrift::of(&cells);
        assert_eq!(drifts.len(), 1);
        let d = &drifts[0];
        let order: Vec<Limit> = d.at.iter().map(|c| c.device_limit).collect();
        assert_eq!(order, [None, Some(1 << 30), Some(256 << 20)]);
        assert!((d.kvtier().expect("kvtier") - 1.5).abs() < 1e-9);
        assert!((d.fio().expect("fio") - 2.0).abs() < 1e-9);
        assert_eq!(d.fio_crc32c(), None);
        let json = d.to_json();
        assert_eq!(json["speeds"].as_array().map(Vec::len), Some(3));
        assert!(render_drift(&drifts).contains("slowest/fastest"));
    }

    #[test]
    fn mixed_cells_against_their_own_load_and_store_cells() {
        let mib2 = 2 << 20;
        let cells = [
            cell(Kind::Load, mib2, (2.0, 1000.0), None, 2.0),
            cell(Kind::Store, mib2, (5.0, 500.0), None, 4.0),
            cell(Kind::Mixed, mib2, (1.7, 2500.0), Some(1.0), 1.0),
            // A mixed cell of another block size has no alone cells: left out.
            cell(Kind::Mixed, 256 << 10, (1.0, 100.0), Some(1.0), 1.0),
        ];
        let mix = MixAgainstAlone::of(&cells);
        assert_eq!(mix.len(), 1, "{mix:?}");
        let m = mix[0];
        assert_eq!((m.block_bytes, m.queue_depth), (mib2, 8));
        assert!((m.kvtier.loads - 0.85).abs() < 1e-9, "{m:?}");
        assert!((m.kvtier.load_p99 - 2.5).abs() < 1e-9, "{m:?}");
        assert!((m.kvtier.stores - 0.2).abs() < 1e-9, "{m:?}");
        // fio: loads 1.0 of 2.0 alone, p99 100 of 100, stores 0.5 of 4.0.
        assert!((m.fio.loads - 0.5).abs() < 1e-9, "{m:?}");
        assert!((m.fio.load_p99 - 1.0).abs() < 1e-9, "{m:?}");
        assert!((m.fio.stores - 0.125).abs() < 1e-9, "{m:?}");
        // p99 2.5x and stores 0.2 miss the goals; within them every goal is met.
        assert!(!m.met());
        let good = MixAgainstAlone::of(&[
            cell(Kind::Load, mib2, (2.0, 1000.0), None, 2.0),
            cell(Kind::Store, mib2, (5.0, 500.0), None, 4.0),
            cell(Kind::Mixed, mib2, (1.7, 2000.0), Some(1.6), 1.0),
        ]);
        assert!(good[0].met(), "{good:?}");
        let json = good[0].to_json();
        assert_eq!(json["kvtier_met_goals"], true);
        assert!((json["kvtier"]["stores"].as_f64().expect("a number") - 0.32).abs() < 1e-9);
    }

    #[test]
    fn every_row_of_a_cell_fills_the_columns_and_the_caller_cpu_is_on_the_first() {
        let mib2 = 2 << 20;
        let mut load = cell(Kind::Load, mib2, (2.0, 1000.0), None, 2.0);
        load.kvtier_thread_cpu = Some(bench::ThreadCpu {
            caller: 0.0042,
            workers: 1.0,
            io_kernel: 0.0,
            s3_reactor: 0.0,
        });
        let mut mixed = cell(Kind::Mixed, mib2, (1.7, 2500.0), Some(1.0), 1.0);
        mixed.store_ratio = Some(report::Spread::of([0.5]));
        let bare = cell(Kind::Store, mib2, (5.0, 500.0), None, 4.0);
        let caller = report::COLUMNS
            .iter()
            .position(|&c| c == "kvtier caller cpu")
            .expect("the caller's column");
        let rows = report::cell_rows(&load);
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].len(), report::COLUMNS.len());
        assert_eq!(rows[0][caller], "0.004");
        // Without thread CPU (an engine that could not read it) the column says so.
        assert_eq!(report::cell_rows(&bare)[0][caller], "-");
        let mut store = bare;
        store.fio_crc32c = Some(store.fio);
        store.fio_crc32c_cpu_s_per_gib = Some(3.0);
        store.ratio_crc32c = Some(report::Spread::of([1.0]));
        store.cpu_ratio_crc32c = Some(report::Spread::of([0.5]));
        let rows = report::cell_rows(&store);
        assert_eq!(rows.len(), 2, "{rows:?}");
        assert_eq!(rows[1][0], "  fio+crc32c");
        assert_eq!(rows[1][report::COLUMNS.len() - 2], "0.50");
        assert_eq!(rows[1][caller], "-");
        assert_eq!(rows[1].len(), report::COLUMNS.len());
        let rows = report::cell_rows(&mixed);
        assert_eq!(rows.len(), 2, "{rows:?}");
        assert_eq!(rows[1][0], "mixed: stores");
        for row in &rows {
            assert_eq!(row.len(), report::COLUMNS.len(), "{row:?}");
        }
        assert_eq!(rows[1][caller], "-");
    }

    #[test]
    fn medians_and_fio_reports() {
        assert!((median([3.0, 1.0, 2.0]) - 2.0).abs() < 1e-12);
        assert!((median([4.0, 1.0, 2.0, 3.0]) - 2.5).abs() < 1e-12);
        assert!(median(std::iter::empty()).abs() < 1e-12);
        let doc = json!({"jobs": [
            {"jobname": "loads", "error": 0, "usr_cpu": 10.0, "sys_cpu": 40.0,
             "job_runtime": 4000, "ctx": 3000,
             "read": {"bw_bytes": 1u64 << 30, "io_bytes": 2u64 << 30, "runtime": 2000,
                      "total_ios": 8000,
                      "lat_ns": {"percentile": {"50.000000": 500_000, "99.000000": 900_000}}}},
            {"jobname": "stores", "error": 0, "usr_cpu": 5.0, "sys_cpu": 5.0,
             "job_runtime": 4000, "ctx": 1000,
             "write": {"bw_bytes": 1u64 << 29, "io_bytes": 1u64 << 30, "runtime": 2000,
                       "total_ios": 2000,
                       "lat_ns": {"percentile": {"50.000000": 1_000_000,
                                                 "99.000000": 3_000_000}}}}
        ]});
        let run = fio_result(&doc, Kind::Mixed).expect("parses");
        assert!((run.main.gib_per_s - 1.0).abs() < 1e-9);
        assert!((run.main.p99_us - 900.0).abs() < 1e-9);
        let store = run.store.expect("store side");
        assert!((store.gib_per_s - 0.5).abs() < 1e-9);
        assert!((run.cpu_seconds - 2.4).abs() < 1e-9, "{}", run.cpu_seconds);
        assert!((run.cpu_s_per_gib() - 0.8).abs() < 1e-9);
        // Context switches of both jobs over the I/Os of both.
        assert_eq!(run.sleeps_per_io, Some(0.4));
        assert!(fio_result(&doc, Kind::Load).is_ok());
        assert!(fio_result(&json!({"jobs": []}), Kind::Load).is_err());
    }
}
