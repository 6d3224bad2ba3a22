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

const FILL_JOB: &str = include_str!("../fio/fill.fio");
const RANDREAD_JOB: &str = include_str!("../fio/randread.fio");
const RANDWRITE_JOB: &str = include_str!("../fio/randwrite.fio");
const MIXED_JOB: &str = include_str!("../fio/mixed.fio");

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
        help = "Queue depths to measure: jobs of one block in flight in total (per stream)"
    )]
    queue_depths: Vec<u32>,
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
    /// Draw bandwidth and latency of every cell side by side into an SVG file.
    #[arg(long, value_name = "PATH.svg")]
    plot: Option<PathBuf>,
    /// Print the fio jobs this run would use, filled in for this target, and exit.
    #[arg(long)]
    show_fio: bool,
    /// Allow a target that holds data (a kvtier store, a filesystem): it is destroyed.
    #[arg(long)]
    overwrite: bool,
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
                plan.push(CellPlan::new(kind, prep, qd, duration)?);
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

    let mut cells: Vec<Cell> = Vec::with_capacity(plan.len());
    let total_runs = plan.len() * args.pairs as usize;
    let mut done_runs = 0;
    let started = Instant::now();
    for cell_plan in plan {
        let mut cell = Cell {
            plan: cell_plan,
            pairs: Vec::new(),
        };
        let label = cell.plan.label();
        let prep = preps
            .iter()
            .find(|p| p.block_bytes == cell.plan.block_bytes)
            .expect("every cell's block size was prepared");
        for pair in 0..args.pairs {
            if interrupt::requested() {
                break;
            }
            let (fio_doc, fio_iomem) = fio.run_cell(&cell.plan, duration, &label)?;
            if interrupt::requested() {
                break;
            }
            let fio_run = fio_result(&fio_doc, cell.plan.kind)?;
            target.wipe_header()?;
            let engine = bench::run_engine(
                &prep.config,
                cell.plan.kind.engine(),
                cell.plan.queue_depth,
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
            let p = Pair::new(fio_run, kv_run, &engine, fio_iomem);
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
    if target.scratch.is_none() {
        // Leave no store behind that fio has scribbled over: a rerun needs no --overwrite.
        target.wipe_header()?;
    }

    let summaries: Vec<CellSummary> = cells.iter().map(Cell::summary).collect();
    let mut text = String::new();
    let _ = writeln!(
        text,
        "\nfio-compare: {} on {} ({}), {} pair(s) of {} s per cell, {:.0} s in all\n",
        target.path.display(),
        first.info.devices[0].kind,
        output::size(device_bytes),
        args.pairs,
        args.duration,
        started.elapsed().as_secs_f64() + fill_seconds
    );
    text.push_str(&render(&summaries, first));
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

/// The device both fio and kvtier measure, and the engine config that uses it.
struct Target {
    /// The engine config of every run, but for `block_size`.
    config: Config,
    path: PathBuf,
    /// The default scratch directory, removed on drop (after every engine has shut down).
    scratch: Option<tempfile::TempDir>,
}

impl Target {
    fn resolve(args: &FioCompareArgs) -> CliResult<Target> {
        let mut config = match &args.config {
            Some(path) => Config::from_file(path)?,
            None => Config::default(),
        };
        let mut scratch = None;
        let mut device = if let Some(path) = &args.device {
            let mut d = DeviceConfig::new(path);
            d.capacity_bytes = match (args.size, std::fs::metadata(path)) {
                (Some(size), _) => Some(size),
                (None, Ok(m))
                    if m.file_type().is_block_device()
                        || FioEngine::of(path) == FioEngine::UringCmd =>
                {
                    Some(BLOCK_DEVICE_BYTES)
                }
                (None, Ok(_)) => None,
                (None, Err(_)) => Some(SCRATCH_BYTES),
            };
            d
        } else if args.config.is_some() {
            if config.devices.len() != 1 {
                return Err(CliError::usage(format!(
                    "--config: fio-compare measures one device, the config has {}; give one \
                     [[devices]] entry or pick one with --device",
                    config.devices.len()
                )));
            }
            let mut d = config.devices[0].clone();
            if args.size.is_some() {
                d.capacity_bytes = args.size;
            } else if d.capacity_bytes.is_none()
                && (std::fs::metadata(&d.path).is_ok_and(|m| m.file_type().is_block_device())
                    || FioEngine::of(&d.path) == FioEngine::UringCmd)
            {
                d.capacity_bytes = Some(BLOCK_DEVICE_BYTES);
            }
            d
        } else {
            let parent = args
                .dir
                .clone()
                .unwrap_or_else(|| PathBuf::from(DEFAULT_DIR));
            let dir = tempfile::Builder::new()
                .prefix("kvtier-fio-compare-")
                .tempdir_in(&parent)
                .map_err(|e| {
                    CliError::usage(format!(
                        "creating a scratch directory in {}: {e}",
                        parent.display()
                    ))
                })?;
            let mut d = DeviceConfig::new(dir.path().join("kvtier-fio-compare.slab"));
            d.capacity_bytes = Some(args.size.unwrap_or(SCRATCH_BYTES));
            scratch = Some(dir);
            d
        };
        let path = device.path.clone();
        check_target(&path, scratch.is_none(), args.overwrite)?;
        // fio overwrites the slots between kvtier runs, and each kvtier run formats afresh.
        device.overwrite = true;
        device.layout = Layout::Slab;
        config.devices = vec![device];
        config.direct_io = DirectIo::Required;
        config.validate()?;
        Ok(Target {
            config,
            path,
            scratch,
        })
    }

    /// Opens the engine once at block size `bs` (creating and pre-writing a new file, formatting
    /// the slab) to learn the slots' byte range, the workers' cores and the region's backing.
    fn prepare(&self, bs: u64, queue_depth_max: u32) -> CliResult<Prepared> {
        let mut config = self.config.clone();
        config.block_size = bs;
        config.validate()?;
        self.wipe_header()?;
        let info = bench::engine_info(&config, queue_depth_max)
            .map_err(|e| e.context(format!("opening the engine at block size {bs}")))?;
        let dev = &info.devices[0];
        if !dev.direct {
            return Err(CliError::runtime(format!(
                "{}: the engine did not open it with O_DIRECT",
                dev.path.display()
            )));
        }
        let g = dev.geometry;
        // fio goes the way kvtier went: passthrough when kvtier opened the generic device by
        // passthrough (not after a fallback, and not `kind = "nvme"` on the block device's
        // path, where fio runs io_uring on that block device: the same LBAs).
        let engine = if dev.kind == "nvme passthrough" {
            FioEngine::of(&dev.path)
        } else {
            FioEngine::Uring
        };
        let cores: Vec<usize> = info.workers.iter().filter_map(|w| w.core).collect();
        let pinned = cores.len() == info.workers.len() && info.workers.iter().all(|w| w.pinned);
        let (cpus, cpus_policy) = if pinned {
            (join(&cores), "split")
        } else {
            tracing::warn!(
                "kvtier's workers are not all pinned: fio's jobs share the available cores"
            );
            (join(&kvtier_sys::affinity::available_cores()), "shared")
        };
        let iomem = if info.region_backing == kvtier::Backing::HugeTlb2M.as_str() {
            "mmaphuge"
        } else {
            "malloc"
        };
        Ok(Prepared {
            block_bytes: bs,
            data_offset: g.data_offset,
            data_bytes: g.slot_count * g.slot_bytes,
            device_bytes: dev.size_bytes,
            numjobs: info.workers.len().max(1) as u32,
            cpus,
            cpus_policy,
            iomem,
            hipri: u8::from(config.iopoll),
            sqpoll: u8::from(config.sqpoll),
            engine,
            max_command_bytes: (engine == FioEngine::UringCmd)
                .then(|| max_command_bytes(&dev.path))
                .flatten(),
            config,
            info,
        })
    }

    /// Zeroes the slab header (if the target exists), so that the next engine open formats a
    /// new, empty store instead of recovering entries whose slots fio has overwritten.
    fn wipe_header(&self) -> CliResult<()> {
        if !self.path.exists() {
            return Ok(());
        }
        if FioEngine::of(&self.path) == FioEngine::UringCmd {
            let ns = kvtier_sys::nvme::Namespace::open(&self.path).map_err(|e| {
                CliError::runtime(format!(
                    "{}: opening to clear the header: {e}",
                    self.path.display()
                ))
            })?;
            let page = kvtier::Region::allocate(PAGE_BYTES, HugePages::Off)
                .map_err(|e| CliError::runtime(e.to_string()))?;
            return ns
                .write_sync(0, &page, 0, PAGE_BYTES)
                .map_err(|e| CliError::runtime(format!("clearing the slab header: {e}")));
        }
        let fail = |what: &str, e: kvtier::Errno| {
            CliError::runtime(format!(
                "{}: {what} the slab header: {} ({e})",
                self.path.display(),
                e.desc()
            ))
        };
        let file = DeviceFile::open(
            &self.path,
            OpenOptions {
                create: false,
                direct: true,
                read_only: false,
            },
        )
        .map_err(|e| fail("opening to clear", e))?;
        let page = kvtier::Region::allocate(PAGE_BYTES, HugePages::Off)
            .map_err(|e| CliError::runtime(e.to_string()))?;
        file.write_all_at(0, &page, 0, PAGE_BYTES)
            .map_err(|e| fail("clearing", e))?;
        file.sync_data().map_err(|e| fail("syncing", e))
    }
}

/// Refuses targets whose numbers would not be the device's, or whose data would be lost
/// without being asked.
fn check_target(path: &Path, may_hold_data: bool, overwrite: bool) -> CliResult<()> {
    let meta = std::fs::metadata(path).ok();
    let is_block = meta
        .as_ref()
        .is_some_and(|m| m.file_type().is_block_device());
    if FioEngine::of(path) == FioEngine::UringCmd {
        // An NVMe generic device: no filesystem and no mount of its own; its block device
        // (the same namespace) must not be mounted.
        // From the kernel's name (ngXnY -> nvmeXnY), without opening anything, so the check
        // cannot be skipped by a device that fails to open.
        let block = kvtier_sys::nvme::generic_name(path)
            .and_then(|name| kvtier_sys::nvme::block_device_of(&name));
        if let Some(block) = block {
            if let Some(mount) = mounted(&block) {
                return Err(CliError::usage(format!(
                    "{} is mounted through {} ({mount}): fio-compare writes over the whole \
                     namespace",
                    path.display(),
                    block.display()
                )));
            }
        }
    } else if is_block {
        if let Some(mount) = mounted(path) {
            return Err(CliError::usage(format!(
                "{} is mounted ({mount}): fio-compare writes over the whole device; use an \
                 unmounted device, or --dir for a scratch file",
                path.display()
            )));
        }
    } else {
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let refuse = |why: String| {
            CliError::usage(format!(
                "{}: {why}; fio-compare would measure memory, not a disk. Use a directory on \
                 a disk (ext4, xfs), e.g. --dir /var/tmp",
                dir.display()
            ))
        };
        match kvtier_sys::file::probe_o_direct(dir) {
            Ok(true) => {}
            Ok(false) => {
                return Err(refuse(
                    "the filesystem refuses O_DIRECT (or silently buffers it)".into(),
                ))
            }
            Err(e) => {
                return Err(CliError::usage(format!(
                    "{}: cannot probe O_DIRECT: {} ({e})",
                    dir.display(),
                    e.desc()
                )))
            }
        }
        if kvtier_sys::probe::block_queue_for_path(dir).is_none() {
            return Err(refuse(
                "not on a block device (tmpfs accepts O_DIRECT and buffers anyway)".into(),
            ));
        }
    }
    if may_hold_data && meta.is_some() && !overwrite {
        if let Some(what) = holds_data(path)? {
            return Err(CliError::usage(format!(
                "{} {what}; fio-compare writes over all of it. Pass --overwrite to destroy it, \
                 or use --dir for a scratch file",
                path.display()
            )));
        }
    }
    Ok(())
}

/// What the first page of `path` says it holds; `None` when it is all zeros.
fn holds_data(path: &Path) -> CliResult<Option<String>> {
    let mut page = vec![0u8; PAGE_BYTES];
    if FioEngine::of(path) == FioEngine::UringCmd {
        let fail = |e: String| CliError::runtime(format!("{}: {e}", path.display()));
        let ns = kvtier_sys::nvme::Namespace::open_read_only(path).map_err(fail)?;
        let buf = kvtier::Region::allocate(PAGE_BYTES, HugePages::Off)
            .map_err(|e| CliError::runtime(e.to_string()))?;
        ns.read_sync(0, &buf, 0, PAGE_BYTES)
            .map_err(|e| fail(e.to_string()))?;
        buf.read(0, &mut page);
        return Ok(describe_first_page(&page));
    }
    let mut file = std::fs::File::open(path)
        .map_err(|e| CliError::runtime(format!("{}: {e}", path.display())))?;
    let mut got = 0;
    while got < page.len() {
        match file.read(&mut page[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(CliError::runtime(format!("{}: {e}", path.display()))),
        }
    }
    Ok(describe_first_page(&page))
}

fn describe_first_page(page: &[u8]) -> Option<String> {
    match Header::decode(page) {
        HeaderRead::Empty => None,
        HeaderRead::Valid(_) => Some("holds a kvtier store".to_owned()),
        HeaderRead::Foreign(why) => Some(format!("holds other data ({why})")),
    }
}

/// The mount entry using block device `path` or one of its partitions, if any.
fn mounted(path: &Path) -> Option<String> {
    let dev = path.canonicalize().ok()?;
    let dev = dev.to_str()?;
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    mounts.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let (source, point) = (fields.next()?, fields.next()?);
        let source = Path::new(source)
            .canonicalize()
            .ok()
            .and_then(|p| p.to_str().map(str::to_owned))?;
        source
            .starts_with(dev)
            .then(|| format!("{source} on {point}"))
    })
}

fn join(cores: &[usize]) -> String {
    cores
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// What one block size looks like on the target, learned by opening the engine once.
struct Prepared {
    block_bytes: u64,
    /// The engine config of every kvtier run at this block size.
    config: Config,
    info: kvtier::EngineInfo,
    data_offset: u64,
    data_bytes: u64,
    device_bytes: u64,
    numjobs: u32,
    cpus: String,
    cpus_policy: &'static str,
    iomem: &'static str,
    hipri: u8,
    sqpoll: u8,
    /// fio's engine and `direct`: `io_uring` and 1, or `io_uring_cmd` and 0 on an NVMe generic
    /// device (passthrough, as kvtier drives it).
    engine: FioEngine,
    /// With `io_uring_cmd`: the device's transfer limit. The kernel never splits a passthrough
    /// command and fio does not either, so fio runs commands of this size with as many more in
    /// flight: the same commands and bytes in flight that kvtier issues for its blocks.
    max_command_bytes: Option<u64>,
}

/// How fio reaches the target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FioEngine {
    /// `ioengine=io_uring`, `direct=1`: files and block devices.
    Uring,
    /// `ioengine=io_uring_cmd` (NVMe passthrough, `cmd_type=nvme`), `direct=0`: `/dev/ngXnY`.
    UringCmd,
}

impl FioEngine {
    fn of(path: &Path) -> FioEngine {
        if kvtier_sys::nvme::generic_name(path).is_some() {
            FioEngine::UringCmd
        } else {
            FioEngine::Uring
        }
    }

    fn vars(self) -> [(&'static str, String); 2] {
        match self {
            FioEngine::Uring => [("IOENGINE", "io_uring".into()), ("DIRECT", "1".into())],
            FioEngine::UringCmd => [("IOENGINE", "io_uring_cmd".into()), ("DIRECT", "0".into())],
        }
    }
}

/// A cell to measure, with its fio job filled in.
struct CellPlan {
    kind: Kind,
    block_bytes: u64,
    queue_depth: u32,
    numjobs: u32,
    iodepth: u32,
    job: String,
}

impl CellPlan {
    fn new(
        kind: Kind,
        prep: &Prepared,
        queue_depth: u32,
        runtime: Duration,
    ) -> CliResult<CellPlan> {
        let mut iodepth = queue_depth.div_ceil(prep.numjobs);
        let mut fio_bs = prep.block_bytes;
        if let Some(max) = prep.max_command_bytes.filter(|&m| m < prep.block_bytes) {
            let per_block = u32::try_from(prep.block_bytes.div_ceil(max)).unwrap_or(u32::MAX);
            iodepth = iodepth.saturating_mul(per_block);
            fio_bs = max;
        }
        let vars = [
            ("FILENAME", prep.info.devices[0].path.display().to_string()),
            ("OFFSET", prep.data_offset.to_string()),
            ("SIZE", prep.data_bytes.to_string()),
            ("BS", fio_bs.to_string()),
            ("NUMJOBS", prep.numjobs.to_string()),
            ("IODEPTH", iodepth.to_string()),
            ("CPUS", prep.cpus.clone()),
            ("CPUS_POLICY", prep.cpus_policy.to_owned()),
            ("IOMEM", prep.iomem.to_owned()),
            ("HIPRI", prep.hipri.to_string()),
            ("SQPOLL", prep.sqpoll.to_string()),
            // fio reads time values with a unit suffix; kvtier runs exactly as long.
            ("RUNTIME", format!("{}ms", runtime.as_millis().max(1))),
        ];
        let vars: Vec<(&str, String)> = vars.into_iter().chain(prep.engine.vars()).collect();
        let job = fill_template(kind.template(), &vars)
            .map_err(|e| CliError::runtime(format!("tools/fio/{}: {e}", kind.fio_file())))?;
        let job = strip_comments(&job);
        Ok(CellPlan {
            kind,
            block_bytes: prep.block_bytes,
            queue_depth,
            numjobs: prep.numjobs,
            iodepth,
            job,
        })
    }

    fn label(&self) -> String {
        format!(
            "{} {} QD {}",
            self.kind.name(),
            output::size(self.block_bytes),
            self.queue_depth
        )
    }
}

/// The fill job: the whole target once, sequentially, in the largest power-of-two request
/// (at most 1 MiB) that divides its size.
fn fill_job(
    path: &Path,
    device_bytes: u64,
    engine: FioEngine,
    max_command_bytes: Option<u64>,
) -> String {
    let bytes = device_bytes / PAGE_BYTES as u64 * PAGE_BYTES as u64;
    let mut bs = (1u64 << bytes.trailing_zeros().min(63)).min(FILL_BS_MAX);
    if let Some(max) = max_command_bytes {
        // Powers of two both: the fill's request stays a divisor of the size.
        bs = bs.min(1 << max.ilog2());
    }
    let vars = [
        ("FILENAME", path.display().to_string()),
        ("SIZE", bytes.to_string()),
        ("BS", bs.to_string()),
    ];
    let vars: Vec<(&str, String)> = vars.into_iter().chain(engine.vars()).collect();
    strip_comments(
        &fill_template(FILL_JOB, &vars)
            .expect("fill.fio uses only FILENAME, SIZE, BS, IOENGINE and DIRECT"),
    )
}

/// The transfer limit of an NVMe generic device (what one passthrough command may carry);
/// `None` for anything else.
fn max_command_bytes(path: &Path) -> Option<u64> {
    if FioEngine::of(path) != FioEngine::UringCmd {
        return None;
    }
    kvtier_sys::nvme::Namespace::open_read_only(path)
        .ok()
        .map(|ns| u64::from(ns.geometry().max_transfer_bytes))
}

/// The job without its `;` comment lines (the templates' documentation), as it is run.
fn strip_comments(job: &str) -> String {
    let mut out = String::with_capacity(job.len());
    for line in job.lines().filter(|l| !l.trim_start().starts_with(';')) {
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// Replaces every `${NAME}` in `template` by its value; an unknown or unclosed name is an error,
/// so a template and this code cannot drift apart silently.
fn fill_template(template: &str, vars: &[(&str, String)]) -> Result<String, String> {
    let mut out = String::with_capacity(template.len() + 64);
    let mut rest = template;
    while let Some(at) = rest.find("${") {
        out.push_str(&rest[..at]);
        let after = &rest[at + 2..];
        let end = after
            .find('}')
            .ok_or_else(|| format!("unclosed ${{ in `{}`", &rest[at..]))?;
        let name = &after[..end];
        // Comment lines describe the variables by name; only job lines are filled in.
        let line_start = out.rfind('\n').map_or(0, |i| i + 1);
        if out[line_start..].trim_start().starts_with(';') {
            out.push_str(&rest[at..=at + 2 + end]);
        } else {
            let value = vars
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v)
                .ok_or_else(|| format!("unknown variable ${{{name}}}"))?;
            out.push_str(value);
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// Runs fio job files in a private directory.
struct Fio {
    dir: PathBuf,
    show_progress: bool,
}

impl Fio {
    /// Runs `job` (expected to take about `runtime`) and returns fio's JSON report.
    fn run(&self, name: &str, job: &str, runtime: Duration, label: &str) -> CliResult<Value> {
        let job_path = self.dir.join(name);
        let out_path = self.dir.join(format!("{name}.json"));
        let err_path = self.dir.join(format!("{name}.stderr"));
        let io = |what: &str, p: &Path, e: std::io::Error| {
            CliError::runtime(format!("{what} {}: {e}", p.display()))
        };
        std::fs::write(&job_path, job).map_err(|e| io("writing", &job_path, e))?;
        let stderr = std::fs::File::create(&err_path).map_err(|e| io("creating", &err_path, e))?;
        let _ = std::fs::remove_file(&out_path);
        let mut child = Command::new("fio")
            .arg("--output-format=json")
            .arg(format!("--output={}", out_path.display()))
            .arg(&job_path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .map_err(|e| CliError::runtime(format!("starting fio: {e}")))?;
        let bar = self.progress_bar(label, runtime);
        let started = Instant::now();
        let limit = runtime + FIO_SLACK;
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) if started.elapsed() > limit => {
                    let _ = child.kill();
                    let _ = child.wait();
                    bar.finish_and_clear();
                    return Err(CliError::runtime(format!(
                        "fio ({name}) did not finish within {} s; killed",
                        limit.as_secs()
                    )));
                }
                Ok(None) => {
                    bar.set_position(started.elapsed().as_millis() as u64);
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => return Err(CliError::runtime(format!("waiting for fio: {e}"))),
            }
        };
        bar.finish_and_clear();
        let errors = std::fs::read_to_string(&err_path).unwrap_or_default();
        if !status.success() && !interrupt::requested() {
            return Err(CliError::runtime(format!(
                "fio failed ({status}) on this job:\n{job}\nfio said:\n{}",
                errors.trim()
            )));
        }
        let text = std::fs::read_to_string(&out_path).map_err(|e| io("reading", &out_path, e))?;
        // fio may put notes before the JSON document.
        let json_text = text.find('{').map_or(text.as_str(), |at| &text[at..]);
        serde_json::from_str(json_text).map_err(|e| {
            CliError::runtime(format!(
                "fio's report ({}) is not JSON: {e}; fio said: {}",
                out_path.display(),
                errors.trim()
            ))
        })
    }

    /// Runs a cell's job; returns fio's report and the `iomem` it ran with. A job asking for
    /// hugetlb memory that fails is run once more with `iomem=malloc`, with a warning: the
    /// hugetlb pool is shared with everything else on the host and may run dry between runs.
    fn run_cell(
        &self,
        plan: &CellPlan,
        runtime: Duration,
        label: &str,
    ) -> CliResult<(Value, &'static str)> {
        const HUGE: &str = "iomem=mmaphuge\n";
        let name = plan.kind.fio_file();
        match self.run(name, &plan.job, runtime, label) {
            Ok(doc) if plan.job.contains(HUGE) => Ok((doc, "mmaphuge")),
            Ok(doc) => Ok((doc, "malloc")),
            Err(e) if plan.job.contains(HUGE) && !interrupt::requested() => {
                tracing::warn!(
                    "fio failed with hugetlb buffers (is the pool exhausted?); running this one \
                     with iomem=malloc, so this pair compares different memory: {e}"
                );
                let job = plan.job.replace(HUGE, "iomem=malloc\n");
                Ok((self.run(name, &job, runtime, label)?, "malloc"))
            }
            Err(e) => Err(e),
        }
    }

    fn progress_bar(&self, label: &str, runtime: Duration) -> ProgressBar {
        if !self.show_progress {
            return ProgressBar::hidden();
        }
        let bar = ProgressBar::with_draw_target(
            Some(runtime.as_millis() as u64),
            ProgressDrawTarget::stderr(),
        );
        if let Ok(style) = ProgressStyle::with_template("{prefix:>10} [{bar:30}] {elapsed} {msg}") {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_prefix("fio");
        bar.set_message(label.to_owned());
        bar
    }
}

/// One stream of one run: loads, or stores.
#[derive(Clone, Copy, Debug, Serialize)]
struct Stream {
    gib_per_s: f64,
    p50_us: f64,
    p99_us: f64,
}

/// What one run (fio or kvtier) measured.
#[derive(Clone, Copy, Debug, Serialize)]
struct Run {
    /// Loads for `load` and `mixed`, stores for `store`.
    main: Stream,
    /// The stores of a `mixed` run.
    store: Option<Stream>,
    /// CPU seconds over the run (fio: usr + sys of its jobs; kvtier: its worker threads).
    cpu_seconds: f64,
    /// GiB moved by every stream of the run.
    gib_moved: f64,
    seconds: f64,
}

impl Run {
    fn cpu_s_per_gib(&self) -> f64 {
        if self.gib_moved > 0.0 {
            self.cpu_seconds / self.gib_moved
        } else {
            0.0
        }
    }
}

/// fio's report for a job file of `kind`: jobs `loads` (read side) and `stores` (write side),
/// one entry per group (`group_reporting`).
fn fio_result(doc: &Value, kind: Kind) -> CliResult<Run> {
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
fn kvtier_result(rows: &[WorkloadRow], kind: Kind) -> CliResult<Run> {
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
struct Pair {
    fio: Run,
    kvtier: Run,
    ratio: f64,
    store_ratio: Option<f64>,
    cpu_ratio: f64,
    kvtier_caller_cpu_s: f64,
    kvtier_verified: u64,
    kvtier_corrupt: u64,
    kvtier_failed: u64,
    kvtier_io_errors: u64,
    kvtier_checksum_failures: u64,
    kvtier_region_backing: &'static str,
    /// What fio's buffers were for this pair (`malloc` when hugetlb memory ran out).
    fio_iomem: &'static str,
    /// The engine's I/O counters over the whole run (fill included).
    kvtier_engine: Value,
}

impl Pair {
    fn new(fio: Run, kvtier: Run, engine: &bench::EngineRun, fio_iomem: &'static str) -> Pair {
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

    fn to_json(&self) -> Value {
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

struct Cell {
    plan: CellPlan,
    pairs: Vec<Pair>,
}

/// Medians over a cell's pairs.
struct CellSummary {
    kind: Kind,
    block_bytes: u64,
    queue_depth: u32,
    numjobs: u32,
    iodepth: u32,
    /// Medians of each number over the pairs.
    fio: Run,
    kvtier: Run,
    fio_cpu_s_per_gib: f64,
    kvtier_cpu_s_per_gib: f64,
    ratio: Spread,
    store_ratio: Option<Spread>,
    cpu_ratio: Spread,
    job: String,
    pairs: Vec<Value>,
}

/// The median of some values, with their range.
#[derive(Clone, Copy, Debug)]
struct Spread {
    median: f64,
    min: f64,
    max: f64,
}

impl Spread {
    fn of(values: impl IntoIterator<Item = f64>) -> Spread {
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
fn median_run(runs: &[&Run]) -> Run {
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
    fn summary(&self) -> CellSummary {
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
    fn label(&self) -> String {
        format!(
            "{} {} QD{}",
            self.kind.name(),
            output::size(self.block_bytes).replace(' ', ""),
            self.queue_depth
        )
    }

    fn to_json(&self) -> Value {
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

fn render(cells: &[CellSummary], first: &Prepared) -> String {
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

/// The SVG chart: bandwidth (left) and latency (right) of every cell, fio beside kvtier.
mod plot {
    use std::path::Path;

    use plotters::coord::ranged1d::{SegmentValue, SegmentedCoord};
    use plotters::coord::types::{RangedCoordf64, RangedCoordusize};
    use plotters::coord::Shift;
    use plotters::prelude::*;
    use plotters::style::text_anchor::{HPos, Pos, VPos};

    use super::CellSummary;
    use crate::output::{CliError, CliResult};

    const FIO: RGBColor = RGBColor(120, 120, 120);
    const FIO_LIGHT: RGBColor = RGBColor(205, 205, 205);
    const KVTIER: RGBColor = RGBColor(31, 119, 180);
    const KVTIER_LIGHT: RGBColor = RGBColor(166, 206, 227);
    const HEIGHT: u32 = 620;
    const BAR_GAP_PX: u32 = 3;

    pub(super) fn draw(path: &Path, cells: &[CellSummary]) -> CliResult<()> {
        let panel = (220 + 70 * cells.len() as u32).clamp(520, 1600);
        let root = SVGBackend::new(path, (2 * panel, HEIGHT)).into_drawing_area();
        draw_on(&root, cells)
            .map_err(|e| CliError::runtime(format!("drawing the chart {}: {e}", path.display())))?;
        root.present()
            .map_err(|e| CliError::runtime(format!("writing {}: {e}", path.display())))
    }

    type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

    fn draw_on(root: &DrawingArea<SVGBackend<'_>, Shift>, cells: &[CellSummary]) -> Result<()> {
        root.fill(&WHITE)?;
        let (left, right) = root.split_horizontally(root.dim_in_pixel().0 / 2);
        let labels: Vec<String> = cells.iter().map(CellSummary::label).collect();
        // A segmented range over integers holds both ends: 0..n-1 makes n slots.
        let n = cells.len().max(1);

        let bw_max = cells
            .iter()
            .map(|c| c.fio.main.gib_per_s.max(c.kvtier.main.gib_per_s))
            .fold(0.0_f64, f64::max)
            .max(0.1);
        let mut chart = ChartBuilder::on(&left)
            .caption(
                "bandwidth (GiB/s; mixed: the loads; label: kvtier / fio)",
                ("sans-serif", 18),
            )
            .margin(12)
            .x_label_area_size(110)
            .y_label_area_size(60)
            .build_cartesian_2d((0..n - 1).into_segmented(), 0.0..bw_max * 1.18)?;
        mesh(&mut chart, "GiB/s")?;
        x_labels(root, &chart, &labels)?;
        chart
            .draw_series(
                cells
                    .iter()
                    .enumerate()
                    .map(|(i, c)| half_bar(i, true, c.fio.main.gib_per_s, FIO)),
            )?
            .label("fio")
            .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], FIO.filled()));
        chart
            .draw_series(
                cells
                    .iter()
                    .enumerate()
                    .map(|(i, c)| half_bar(i, false, c.kvtier.main.gib_per_s, KVTIER)),
            )?
            .label("kvtier")
            .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], KVTIER.filled()));
        let ratio_style = TextStyle::from(("sans-serif", 13).into_font())
            .pos(Pos::new(HPos::Center, VPos::Bottom));
        chart.draw_series(cells.iter().enumerate().map(|(i, c)| {
            let top = c.fio.main.gib_per_s.max(c.kvtier.main.gib_per_s);
            Text::new(
                format!("{:.2}x", c.ratio.median),
                (SegmentValue::CenterOf(i), top + bw_max * 0.02),
                ratio_style.clone(),
            )
        }))?;
        legend(&mut chart)?;

        let lat_max = cells
            .iter()
            .map(|c| c.fio.main.p99_us.max(c.kvtier.main.p99_us))
            .fold(0.0_f64, f64::max)
            .max(1.0);
        let mut chart = ChartBuilder::on(&right)
            .caption(
                "latency (µs; mixed: the loads; light bar: p99, dark bar: p50)",
                ("sans-serif", 18),
            )
            .margin(12)
            .x_label_area_size(110)
            .y_label_area_size(70)
            .build_cartesian_2d((0..n - 1).into_segmented(), 0.0..lat_max * 1.3)?;
        mesh(&mut chart, "µs")?;
        x_labels(root, &chart, &labels)?;
        chart
            .draw_series(cells.iter().enumerate().flat_map(|(i, c)| {
                [
                    half_bar(i, true, c.fio.main.p99_us, FIO_LIGHT),
                    half_bar(i, true, c.fio.main.p50_us, FIO),
                ]
            }))?
            .label("fio")
            .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], FIO.filled()));
        chart
            .draw_series(cells.iter().enumerate().flat_map(|(i, c)| {
                [
                    half_bar(i, false, c.kvtier.main.p99_us, KVTIER_LIGHT),
                    half_bar(i, false, c.kvtier.main.p50_us, KVTIER),
                ]
            }))?
            .label("kvtier")
            .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], KVTIER.filled()));
        legend(&mut chart)?;
        Ok(())
    }

    type Chart<'a, 'b> = ChartContext<
        'a,
        SVGBackend<'b>,
        Cartesian2d<SegmentedCoord<RangedCoordusize>, RangedCoordf64>,
    >;

    /// Axes and grid; the x labels are drawn by [`x_labels`] (the mesh would center rotated
    /// labels on the axis, half hidden behind the bars).
    fn mesh(chart: &mut Chart<'_, '_>, y: &str) -> Result<()> {
        let y_label = |v: &f64| {
            if *v >= 10.0 {
                format!("{v:.0}")
            } else {
                format!("{v:.1}")
            }
        };
        chart
            .configure_mesh()
            .disable_x_mesh()
            .light_line_style(TRANSPARENT)
            // Not 0: plotters then searches for key points forever.
            .x_labels(1)
            .x_label_formatter(&|_| String::new())
            .y_labels(8)
            .y_label_formatter(&y_label)
            .y_desc(y)
            .draw()?;
        Ok(())
    }

    /// Each cell's label, read top to bottom under its pair of bars.
    fn x_labels(
        root: &DrawingArea<SVGBackend<'_>, Shift>,
        chart: &Chart<'_, '_>,
        labels: &[String],
    ) -> Result<()> {
        let style = TextStyle::from(("sans-serif", 13).into_font())
            .transform(FontTransform::Rotate90)
            .pos(Pos::new(HPos::Left, VPos::Center));
        for (i, label) in labels.iter().enumerate() {
            let (x, y) = chart.backend_coord(&(SegmentValue::CenterOf(i), 0.0));
            root.draw(&Text::new(label.as_str(), (x, y + 8), style.clone()))?;
        }
        Ok(())
    }

    fn legend<'b>(chart: &mut Chart<'b, 'b>) -> Result<()> {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
        Ok(())
    }

    /// The left (fio) or right (kvtier) half of cell `i`'s slot, from 0 to `value`.
    fn half_bar(
        i: usize,
        left: bool,
        value: f64,
        color: RGBColor,
    ) -> Rectangle<(SegmentValue<usize>, f64)> {
        let (from, to) = if left {
            (SegmentValue::Exact(i), SegmentValue::CenterOf(i))
        } else {
            (SegmentValue::CenterOf(i), SegmentValue::Exact(i + 1))
        };
        let mut bar = Rectangle::new([(from, value), (to, 0.0)], color.filled());
        if left {
            bar.set_margin(0, 0, 3 * BAR_GAP_PX, 0);
        } else {
            bar.set_margin(0, 0, 0, 3 * BAR_GAP_PX);
        }
        bar
    }
}

#[cfg(test)]
mod tests {
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

    #[test]
    fn medians_and_fio_reports() {
        assert!((median([3.0, 1.0, 2.0]) - 2.0).abs() < 1e-12);
        assert!((median([4.0, 1.0, 2.0, 3.0]) - 2.5).abs() < 1e-12);
        assert!(median(std::iter::empty()).abs() < 1e-12);
        let doc = json!({"jobs": [
            {"jobname": "loads", "error": 0, "usr_cpu": 10.0, "sys_cpu": 40.0,
             "job_runtime": 4000,
             "read": {"bw_bytes": 1u64 << 30, "io_bytes": 2u64 << 30, "runtime": 2000,
                      "lat_ns": {"percentile": {"50.000000": 500_000, "99.000000": 900_000}}}},
            {"jobname": "stores", "error": 0, "usr_cpu": 5.0, "sys_cpu": 5.0,
             "job_runtime": 4000,
             "write": {"bw_bytes": 1u64 << 29, "io_bytes": 1u64 << 30, "runtime": 2000,
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
        assert!(fio_result(&doc, Kind::Load).is_ok());
        assert!(fio_result(&json!({"jobs": []}), Kind::Load).is_err());
    }
}
