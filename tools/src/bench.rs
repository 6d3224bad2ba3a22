//! `kvtier bench`: a whole-engine load generator that checks every byte it reads back.
//!
//! Phases run one after another on one engine: `store` writes keys `0..N` at the queue depth;
//! `load` reads random stored keys for a duration; `load_alone` is the same, shorter, taken
//! right before `mixed`, where loads run at the queue depth while a stream of new keys
//! (`N..`) is stored at the same depth, evicting old keys once the devices are full.
//!
//! Invariants: a region block belongs to at most one job in flight (blocks come from a free
//! list and return to it only when the job's result arrives), so the bench never touches memory
//! the kernel may be reading or writing; every block's content is a pure function of its key
//! number, so a load is verified byte for byte; each phase ends only when all of its jobs have
//! finished, so no result is attributed to the wrong phase; submission never spins — a full
//! engine queue is answered by waiting for results with a short timeout.
//!
//! `kvtier fio-compare` drives the same phases through [`run_engine`], with [`Check::Stamps`]:
//! the bench then writes and checks only an 8-byte key stamp at both ends of each block (so a
//! load that read nothing or the wrong slot still fails), instead of copying and comparing
//! whole blocks, because fio does no such per-block work and the bench thread shares the
//! cores with the engine's workers.

use crate::rng::{splitmix64, Rng};
use crate::stats::percentile;
use std::collections::VecDeque;
use std::fmt::Write as _;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvtier::config::Layout;
use kvtier::{Config, Engine, Job, JobKind, JobResult, Key, KeyFailure, Lookup, Region};
use kvtier_sys::affinity::thread_cpu_time;
use serde::Serialize;
use serde_json::json;

use crate::interrupt;
use crate::output::{self, CliError, CliResult, Human, Table};

/// Distinct pseudorandom block patterns; a key's content is one of them, stamped with the key.
const PATTERNS: u64 = 16;
/// Seed of the pattern generator and of the load key choice: runs are reproducible.
const SEED: u64 = 0x6b76_7469_6572_0001;
/// How long one wait for results may block before the loop checks its deadline again.
const WAIT: Duration = Duration::from_millis(2);
/// How often the progress bar is redrawn.
const PROGRESS_EVERY: Duration = Duration::from_millis(200);
/// Candidates a load tries before giving up on finding a key the index still holds.
const LOOKUP_TRIES: usize = 8;
/// Share of the devices' slots the store phase fills by default: nothing is evicted.
const FILL_PERCENT: u64 = 75;
const REGION_BLOCKS_MIN: u64 = 16;
/// Latency samples kept per stream and phase (8 MiB); beyond it a uniform reservoir sample is
/// kept, so long runs stay bounded in memory and percentiles stay unbiased.
const LATENCY_SAMPLES_MAX: usize = 1 << 20;
/// Individual failures logged per stream before the rest are only counted.
const FAILURES_LOGGED_MAX: u64 = 5;
/// Poisoning granularity before a load: the first bytes of each page are overwritten, so a page
/// the load did not write fails verification.
const POISON_STRIDE_BYTES: usize = 4096;
/// The `--dir` default: /tmp is often tmpfs, which would measure memory, not a disk.
const DEFAULT_DIR: &str = "/var/tmp";

/// How much of each block the bench writes before a store and checks after a load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Check {
    /// Every byte: the block's whole pattern is copied in and compared (`kvtier bench`).
    Full,
    /// Only the key stamps in the first and last 8 bytes; the rest of each region block holds a
    /// pattern written once (`kvtier fio-compare`).
    Stamps,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Workload {
    Store,
    Load,
    Mixed,
    All,
    /// The S3 tier: PUT/GET throughput next to a plain aws-sdk-s3 loop, and NVMe load latency
    /// under an S3 stream (needs --s3-endpoint/--s3-bucket or an [s3] section).
    Cold,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LayoutArg {
    Slab,
    Files,
}

#[derive(Args)]
pub struct BenchArgs {
    /// Engine config; its devices are used as they are. Default: one 1 GiB slab file (with
    /// --layout files: a directory bounded to 1 GiB) in a fresh scratch directory inside --dir.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Where the scratch directory goes when no --config is given [default: /var/tmp].
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Set every device's layout (files: with a default [files] namespace, model
    /// "kvtier-bench", when the config has none).
    #[arg(long, value_enum)]
    layout: Option<LayoutArg>,
    #[arg(
        long,
        value_enum,
        default_value = "all",
        help = "Which phases to run and report (all = store, load, load_alone + mixed)"
    )]
    workload: Workload,
    #[arg(
        long,
        value_parser = parse_size_arg,
        help = "Block size, e.g. 2MiB or 256KiB (overrides the config's block_size)"
    )]
    block_size: Option<u64>,
    /// Distinct keys the store phase writes [default: 75 % of the devices' slots].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    blocks: Option<u64>,
    /// Jobs of one block each kept in flight per stream.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=8192))]
    queue_depth: u32,
    #[arg(
        long,
        default_value_t = 10.0,
        value_parser = parse_seconds,
        help = "Seconds per timed phase (load, mixed; load_alone runs half of it)"
    )]
    duration: f64,
    /// Serve the engine's metrics on this address while it runs (as `[metrics] listen`; watch
    /// with `kvtier stats --url http://ADDR/metrics`).
    #[arg(long, value_name = "IP:PORT")]
    metrics_listen: Option<std::net::SocketAddr>,
    /// Also write the results as JSON to PATH, or to stdout with `-` (the table then goes to
    /// stderr).
    #[arg(long, value_name = "PATH|-")]
    json: Option<String>,
    /// Keep the scratch directory (with the slab and its config) instead of removing it.
    #[arg(long)]
    keep: bool,
    /// --workload cold: the S3-compatible endpoint, e.g. http://127.0.0.1:8014 (path-style
    /// URLs). Without it, the [s3] section of --config is used.
    #[arg(long, value_name = "URL")]
    s3_endpoint: Option<String>,
    /// --workload cold: the bucket (it must exist).
    #[arg(long, value_name = "NAME")]
    s3_bucket: Option<String>,
    /// --workload cold: static credentials (else AWS_ACCESS_KEY_ID/... and the default chain).
    #[arg(long, value_name = "ID")]
    s3_access_key: Option<String>,
    #[arg(long, value_name = "SECRET")]
    s3_secret_key: Option<String>,
    /// --workload cold: requests in flight, the engine's max_concurrency and the plain loop's
    /// [default: 16, or the config's max_concurrency].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    s3_concurrency: Option<u32>,
    /// Threads that call `lookup` in a loop (64 keys a call, hits and misses) during the store
    /// phase, to show that lookups do not slow stores; their rate is printed.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=64))]
    lookup_threads: u32,
    /// --workload cold: rounds of PUT and GET (engine and plain loop alternate).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    rounds: u32,
}

/// The `[s3]` section `--workload cold` uses: --config's, with the --s3-* flags applied.
fn cold_s3(args: &BenchArgs, config: &mut Config) -> CliResult<()> {
    if args.s3_endpoint.is_none() && args.s3_bucket.is_none() {
        return Ok(());
    }
    let (Some(endpoint), Some(bucket)) = (&args.s3_endpoint, &args.s3_bucket) else {
        return Err(CliError::usage("--s3-endpoint and --s3-bucket go together"));
    };
    let mut text = format!(
        "bucket = {bucket:?}\nendpoint = {endpoint:?}\nforce_path_style = true\nmax_concurrency = {}\n",
        args.s3_concurrency.unwrap_or(16)
    );
    if let (Some(id), Some(secret)) = (&args.s3_access_key, &args.s3_secret_key) {
        let _ = write!(
            text,
            "access_key_id = {id:?}\nsecret_access_key = {secret:?}\n"
        );
    }
    let mut s3: kvtier::config::S3Config = toml_s3(&text)?;
    if let Some(files) = &config.files {
        s3.namespace = files.namespace.clone();
    }
    config.s3 = Some(s3);
    Ok(())
}

fn toml_s3(text: &str) -> CliResult<kvtier::config::S3Config> {
    #[derive(serde::Deserialize)]
    struct Section {
        s3: kvtier::config::S3Config,
    }
    let ns = bench_files_config().namespace;
    let mut groups = String::new();
    for g in &ns.kv_cache_groups {
        let _ = write!(
            groups,
            "[[s3.namespace.kv_cache_groups]]\ntokens_per_block = {}\nlayer_names = {:?}\n",
            g.tokens_per_block, g.layer_names
        );
    }
    let full = format!(
        "[s3]\n{text}[s3.namespace]\nmodel_name = {:?}\ndtype = {:?}\ntokens_per_hash = {}\nblocks_per_file = {}\n{groups}",
        ns.model_name, ns.dtype, ns.tokens_per_hash, ns.blocks_per_file
    );
    let section: Section = toml::from_str(&full)
        .map_err(|e| CliError::usage(format!("the --s3-* flags: {}", e.message())))?;
    Ok(section.s3)
}

pub(crate) fn parse_size_arg(text: &str) -> Result<u64, String> {
    kvtier::config::parse_size(text)
        .map_err(|e| format!("`{text}`: {e} (expected e.g. 4096, 256KiB, \"2 MiB\")"))
}

pub(crate) fn parse_seconds(text: &str) -> Result<f64, String> {
    let secs: f64 = text
        .parse()
        .map_err(|_| format!("`{text}` is not a number of seconds"))?;
    if secs.is_finite() && secs > 0.0 && secs <= 86_400.0 {
        Ok(secs)
    } else {
        Err(format!(
            "`{text}`: expected more than 0 and at most 86400 seconds"
        ))
    }
}

pub fn run(args: &BenchArgs) -> CliResult<ExitCode> {
    interrupt::install();
    let human = Human::for_json(args.json.as_deref())?;
    let scratch = scratch_dir(args)?;
    let config = effective_config(args, scratch.as_ref().map(tempfile::TempDir::path))?;
    if let Some(dir) = &scratch {
        if args.keep {
            let path = dir.path().join("kvtier-bench.toml");
            std::fs::write(&path, config.to_toml_string())
                .map_err(|e| CliError::runtime(format!("writing {}: {e}", path.display())))?;
        }
    }
    let result = if args.workload == Workload::Cold {
        let mut config = config;
        cold_s3(args, &mut config)?;
        if let (Some(s3), Some(c)) = (&mut config.s3, args.s3_concurrency) {
            s3.max_concurrency = c as usize;
        }
        let scratch_path = scratch
            .as_ref()
            .map_or_else(|| PathBuf::from(DEFAULT_DIR), |d| d.path().to_path_buf());
        crate::cold::run(
            &crate::cold::ColdParams {
                scratch: &scratch_path,
                objects: args.blocks.unwrap_or(128),
                rounds: args.rounds as usize,
                latency_seconds: args.duration / 2.0,
                json: args.json.as_deref(),
            },
            &config,
            human,
        )
    } else {
        run_with(args, &config, human)
    };
    if let Some(dir) = scratch {
        if args.keep {
            let path = dir.keep();
            eprintln!(
                "kept {} (inspect it with: kvtier inspect --config {})",
                path.display(),
                path.join("kvtier-bench.toml").display()
            );
        }
        // Otherwise dropping the TempDir removes it, after the engine has shut down.
    }
    result
}

/// The fresh scratch directory, unless the devices come from --config.
fn scratch_dir(args: &BenchArgs) -> CliResult<Option<tempfile::TempDir>> {
    if args.config.is_some() {
        if args.keep {
            tracing::warn!("--keep has nothing to keep: the devices come from --config");
        }
        if let Some(dir) = &args.dir {
            tracing::warn!(dir = %dir.display(), "--dir is ignored: the devices come from --config");
        }
        return Ok(None);
    }
    let parent = args
        .dir
        .clone()
        .unwrap_or_else(|| PathBuf::from(DEFAULT_DIR));
    let dir = tempfile::Builder::new()
        .prefix("kvtier-bench-")
        .tempdir_in(&parent)
        .map_err(|e| {
            CliError::usage(format!(
                "creating a scratch directory in {}: {e}",
                parent.display()
            ))
        })?;
    if kvtier_sys::probe::block_queue_for_path(dir.path()).is_none() {
        tracing::warn!(
            dir = %parent.display(),
            "the scratch directory is not on a block device (tmpfs?): the numbers will not \
             reflect a disk"
        );
    }
    Ok(Some(dir))
}

fn effective_config(args: &BenchArgs, scratch: Option<&Path>) -> CliResult<Config> {
    let mut config = match (&args.config, scratch) {
        (Some(path), _) => Config::from_file(path)?,
        (None, Some(dir)) => Config::bench_default(dir),
        (None, None) => unreachable!("a scratch directory exists whenever --config is absent"),
    };
    if let Some(bytes) = args.block_size {
        config.block_size = bytes;
    }
    if let Some(layout) = args.layout {
        for device in &mut config.devices {
            device.layout = match layout {
                LayoutArg::Slab => Layout::Slab,
                LayoutArg::Files => Layout::Files,
            };
        }
    }
    if matches!(args.layout, Some(LayoutArg::Files)) {
        if let (None, Some(dir)) = (&args.config, scratch) {
            // The default scratch device becomes a directory, under the same capacity bound.
            for device in &mut config.devices {
                device.path = dir.join("kvtier-bench-files");
            }
        }
        if config.files.is_none() {
            config.files = Some(bench_files_config());
        }
    }
    config.region_blocks = (2 * u64::from(args.queue_depth)).max(REGION_BLOCKS_MIN);
    if let Some(addr) = args.metrics_listen {
        config.metrics.listen = Some(addr);
    }
    config.validate()?;
    Ok(config)
}

/// The `[files]` section `--layout files` uses when the config has none: a namespace of the
/// bench's own, so its blocks never mix with a real model's in a shared directory.
fn bench_files_config() -> kvtier::config::FilesConfig {
    let mut namespace = kvtier::files::mapper::Namespace::new("kvtier-bench", "bfloat16", 16, 1);
    namespace.kv_cache_groups = vec![kvtier::files::mapper::KvCacheGroup {
        tokens_per_block: 16,
        layer_names: vec!["layer.0".into()],
    }];
    kvtier::config::FilesConfig::new(namespace)
}

fn run_with(args: &BenchArgs, config: &Config, human: Human) -> CliResult<ExitCode> {
    let region = kvtier::region::allocate(config)?;
    let engine = Engine::open(config, Arc::clone(&region))?;
    let info = engine.info().clone();
    let slots_total: u64 = info.devices.iter().map(|d| d.geometry.slot_count).sum();
    let blocks = args
        .blocks
        .unwrap_or(slots_total * FILL_PERCENT / 100)
        .max(1);
    if blocks > slots_total {
        tracing::warn!(
            blocks,
            slots_total,
            "more keys than slots: the store phase evicts, and loads will miss"
        );
    }
    let block_bytes = usize::try_from(config.block_size)
        .map_err(|_| CliError::usage("block_size does not fit this machine's address space"))?;
    let region_blocks = config.region_blocks.min(info.region_blocks);
    let mut bench = Bench::new(
        &engine,
        &region,
        block_bytes,
        args.queue_depth as usize,
        region_blocks as u32,
        usize::try_from(slots_total).unwrap_or(usize::MAX),
        Check::Full,
    );
    let results = run_phases(&mut bench, args, config, blocks)?;
    engine.drain();
    let final_stats = engine.stats();
    engine.shutdown();
    drop(bench);
    drop(engine);

    let cores = kvtier_sys::affinity::available_cores();
    let mut text = output::engine_text(&info, &cores);
    let _ = writeln!(
        text,
        "run: {blocks} keys stored of {slots_total} slots, queue depth {}, {} s per timed \
         phase; engine totals: {} evictions, {} checksum failures, {} I/O errors\n",
        args.queue_depth,
        args.duration,
        final_stats.evictions,
        final_stats.checksum_failures,
        final_stats.io_errors
    );
    text.push_str(&render(&results));
    human.print(&text);

    if let Some(target) = &args.json {
        let value = json!({
            "results": results,
            "engine": output::engine_json(&info, &cores, Some(&final_stats)),
            "config": config.to_toml_string(),
            "run": {
                "blocks": blocks,
                "slots_total": slots_total,
                "queue_depth": args.queue_depth,
                "block_size": config.block_size,
                "duration_seconds": args.duration,
                "interrupted": interrupt::requested(),
            },
        });
        output::write_json(target, &value)?;
    }
    let corrupt: u64 = results.iter().map(|r| r.corrupt_blocks).sum();
    if corrupt > 0 {
        eprintln!(
            "CORRUPT DATA: {corrupt} loaded block(s) differed from what was stored under their \
             key (details in the log above)"
        );
        return Ok(ExitCode::from(1));
    }
    if interrupt::requested() {
        eprintln!("interrupted: the results above are partial");
        return Ok(ExitCode::from(130));
    }
    Ok(ExitCode::SUCCESS)
}

/// Runs the store phase (always: the others need its keys), then the selected timed phases;
/// returns the rows of the selected workloads.
fn run_phases(
    bench: &mut Bench<'_>,
    args: &BenchArgs,
    config: &Config,
    blocks: u64,
) -> CliResult<Vec<WorkloadRow>> {
    let duration = Duration::from_secs_f64(args.duration);
    let mut results = Vec::new();

    let store_phase = Phase {
        label: "store",
        load: false,
        store: Some(StoreUntil::Key(blocks)),
        duration: None,
    };
    let store = if args.lookup_threads == 0 {
        bench.run_phase(&store_phase)?
    } else {
        let engine = bench.engine;
        let stop = std::sync::atomic::AtomicBool::new(false);
        let looked = std::sync::atomic::AtomicU64::new(0);
        let started = Instant::now();
        let store = std::thread::scope(|s| {
            for t in 0..args.lookup_threads {
                let (stop, looked) = (&stop, &looked);
                s.spawn(move || {
                    let mut rng = Rng::new(SEED ^ u64::from(t));
                    let mut keys = Vec::with_capacity(64);
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        keys.clear();
                        // Half of them among the keys the phase stores, half never stored.
                        keys.extend((0..64).map(|_| key_of(rng.below(2 * blocks))));
                        std::hint::black_box(engine.lookup(&keys));
                        looked.fetch_add(64, std::sync::atomic::Ordering::Relaxed);
                    }
                });
            }
            let r = bench.run_phase(&store_phase);
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            r
        })?;
        let n = looked.load(std::sync::atomic::Ordering::Relaxed);
        eprintln!(
            "lookups during the store phase: {} thread(s), {:.2} M keys/s",
            args.lookup_threads,
            n as f64 / started.elapsed().as_secs_f64() / 1e6
        );
        store
    };
    tracing::info!(
        blocks,
        seconds = format!("{:.2}", store.seconds),
        "store phase done"
    );
    if matches!(args.workload, Workload::Store | Workload::All) {
        results.push(store.row("store", Stream::Store, config, args.queue_depth, false));
    }
    if matches!(args.workload, Workload::Load | Workload::All) && !interrupt::requested() {
        let load = bench.run_phase(&Phase {
            label: "load",
            load: true,
            store: None,
            duration: Some(duration),
        })?;
        results.push(load.row("load", Stream::Load, config, args.queue_depth, false));
    }
    if matches!(args.workload, Workload::Mixed | Workload::All) && !interrupt::requested() {
        let alone = bench.run_phase(&Phase {
            label: "load_alone",
            load: true,
            store: None,
            duration: Some(duration / 2),
        })?;
        results.push(alone.row("load_alone", Stream::Load, config, args.queue_depth, false));
        if interrupt::requested() {
            return Ok(results);
        }
        let mixed = bench.run_phase(&Phase {
            label: "mixed",
            load: true,
            store: Some(StoreUntil::Deadline),
            duration: Some(duration),
        })?;
        results.push(mixed.row("mixed_load", Stream::Load, config, args.queue_depth, true));
        results.push(mixed.row("mixed_store", Stream::Store, config, args.queue_depth, true));
    }
    Ok(results)
}

/// What one engine run of `kvtier fio-compare` measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EngineWorkload {
    /// Fill 75 % of the slots (not measured), then random loads of stored keys: row `load`.
    Load,
    /// New keys stored for the duration, evicting once the device is full: row `store`.
    Store,
    /// Fill, then loads at the queue depth while new keys are stored at the same depth: rows
    /// `mixed_load` and `mixed_store`.
    Mixed,
}

/// The outcome of [`run_engine`].
pub(crate) struct EngineRun {
    /// What backs the region this run allocated (hugetlb, THP, 4 KiB pages).
    pub(crate) region_backing: &'static str,
    /// The measured rows (see [`EngineWorkload`]).
    pub(crate) rows: Vec<WorkloadRow>,
    pub(crate) stats: kvtier::Stats,
}

/// Opens an engine on `config` (its `region_blocks` is set to fit the queue depth), runs one
/// workload for `duration` with stamp checks, shuts the engine down and returns the rows.
pub(crate) fn run_engine(
    config: &Config,
    workload: EngineWorkload,
    queue_depth: u32,
    duration: Duration,
) -> CliResult<EngineRun> {
    let mut config = config.clone();
    config.region_blocks = (2 * u64::from(queue_depth)).max(REGION_BLOCKS_MIN);
    config.validate()?;
    let region = kvtier::region::allocate(&config)?;
    let engine = Engine::open(&config, Arc::clone(&region))?;
    let info = engine.info();
    let region_backing = info.region_backing;
    let slots_total: u64 = info.devices.iter().map(|d| d.geometry.slot_count).sum();
    let block_bytes = usize::try_from(config.block_size)
        .map_err(|_| CliError::usage("block_size does not fit this machine's address space"))?;
    let region_blocks = config.region_blocks.min(info.region_blocks);
    let mut bench = Bench::new(
        &engine,
        &region,
        block_bytes,
        queue_depth as usize,
        region_blocks as u32,
        usize::try_from(slots_total).unwrap_or(usize::MAX),
        Check::Stamps,
    );
    let timed = |label, load, store| Phase {
        label,
        load,
        store,
        duration: Some(duration),
    };
    let mut rows = Vec::new();
    if workload == EngineWorkload::Store {
        let store = bench.run_phase(&timed("store", false, Some(StoreUntil::Deadline)))?;
        rows.push(store.row("store", Stream::Store, &config, queue_depth, false));
    } else {
        let blocks = (slots_total * FILL_PERCENT / 100).max(1);
        bench.run_phase(&Phase {
            label: "fill",
            load: false,
            store: Some(StoreUntil::Key(blocks)),
            duration: None,
        })?;
        if !interrupt::requested() {
            if workload == EngineWorkload::Load {
                let load = bench.run_phase(&timed("load", true, None))?;
                rows.push(load.row("load", Stream::Load, &config, queue_depth, false));
            } else {
                let mixed = bench.run_phase(&timed("mixed", true, Some(StoreUntil::Deadline)))?;
                rows.push(mixed.row("mixed_load", Stream::Load, &config, queue_depth, true));
                rows.push(mixed.row("mixed_store", Stream::Store, &config, queue_depth, true));
            }
        }
    }
    engine.drain();
    let stats = engine.stats();
    engine.shutdown();
    drop(bench);
    Ok(EngineRun {
        region_backing,
        rows,
        stats,
    })
}

/// Opens an engine on `config` with the region [`run_engine`] allocates at `queue_depth`, only
/// to learn what it sets up (device geometry, worker cores, region backing), and shuts it down.
pub(crate) fn engine_info(config: &Config, queue_depth: u32) -> CliResult<kvtier::EngineInfo> {
    let mut config = config.clone();
    config.region_blocks = (2 * u64::from(queue_depth)).max(REGION_BLOCKS_MIN);
    config.validate()?;
    let region = kvtier::region::allocate(&config)?;
    let engine = Engine::open(&config, Arc::clone(&region))?;
    let info = engine.info().clone();
    engine.shutdown();
    Ok(info)
}

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
    pub(crate) verified_blocks: u64,
    pub(crate) corrupt_blocks: u64,
    pub(crate) missed_blocks: u64,
    pub(crate) failed_blocks: u64,
    pub(crate) block_size: u64,
    pub(crate) queue_depth: u32,
    /// The bench thread's own CPU (data generation, verification) over the phase.
    pub(crate) bench_cpu_seconds: f64,
    /// Load candidates skipped because the index no longer held them (evicted).
    pub(crate) lookup_skips: u64,
    /// "workload", or "phase" when cpu figures cover both streams of the mixed phase.
    pub(crate) cpu_scope: &'static str,
}

fn render(rows: &[WorkloadRow]) -> String {
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
    for r in rows.iter().filter(|r| r.lookup_skips > 0) {
        let _ = writeln!(
            text,
            "{}: {} load candidates skipped because the index no longer held them (evicted)",
            r.workload, r.lookup_skips
        );
    }
    text
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stream {
    Load = 0,
    Store = 1,
}

impl Stream {
    fn of(kind: JobKind) -> Stream {
        match kind {
            JobKind::Load => Stream::Load,
            JobKind::Store => Stream::Store,
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum StoreUntil {
    /// Store keys up to this one (exclusive), then the phase ends when they have finished.
    Key(u64),
    /// Store new keys until the phase's deadline.
    Deadline,
}

struct Phase {
    label: &'static str,
    load: bool,
    store: Option<StoreUntil>,
    /// `None`: run until the store stream reaches its last key.
    duration: Option<Duration>,
}

/// What one stream did during one phase.
#[derive(Default)]
struct Tally {
    in_flight: usize,
    ok_blocks: u64,
    bytes: u64,
    verified: u64,
    corrupt: u64,
    missed: u64,
    failed: u64,
    lookup_skips: u64,
    latencies_us: Vec<u64>,
    /// Latencies offered to `latencies_us`, kept or not.
    latencies_seen: u64,
}

impl Tally {
    /// Reservoir sampling (Vitter's algorithm R) over every latency of the phase.
    fn record_latency(&mut self, micros: u64, rng: &mut Rng) {
        self.latencies_seen += 1;
        if self.latencies_us.len() < LATENCY_SAMPLES_MAX {
            self.latencies_us.push(micros);
        } else {
            let slot = rng.next_u64() % self.latencies_seen;
            if let Some(kept) = self.latencies_us.get_mut(slot as usize) {
                *kept = micros;
            }
        }
    }
}

struct PhaseOutcome {
    seconds: f64,
    cpu_seconds: f64,
    bench_cpu_seconds: f64,
    tallies: [Tally; 2],
}

impl PhaseOutcome {
    fn row(
        &self,
        workload: &'static str,
        stream: Stream,
        config: &Config,
        queue_depth: u32,
        shared_phase: bool,
    ) -> WorkloadRow {
        let t = &self.tallies[stream as usize];
        let mut lat = t.latencies_us.clone();
        lat.sort_unstable();
        let phase_bytes: u64 = self.tallies.iter().map(|t| t.bytes).sum();
        let cpu_bytes = if shared_phase { phase_bytes } else { t.bytes };
        let per_s = |v: f64| {
            if self.seconds > 0.0 {
                v / self.seconds
            } else {
                0.0
            }
        };
        WorkloadRow {
            workload,
            bytes: t.bytes,
            seconds: self.seconds,
            gib_per_s: per_s(output::gib(t.bytes)),
            ops_per_s: per_s(t.ok_blocks as f64),
            p50_us: percentile(&lat, 0.50),
            p99_us: percentile(&lat, 0.99),
            p999_us: percentile(&lat, 0.999),
            cpu_seconds: self.cpu_seconds,
            cpu_s_per_gib: (cpu_bytes > 0).then(|| self.cpu_seconds / output::gib(cpu_bytes)),
            verified_blocks: t.verified,
            corrupt_blocks: t.corrupt,
            missed_blocks: t.missed,
            failed_blocks: t.failed,
            block_size: config.block_size,
            queue_depth,
            bench_cpu_seconds: self.bench_cpu_seconds,
            lookup_skips: t.lookup_skips,
            cpu_scope: if shared_phase { "phase" } else { "workload" },
        }
    }
}

/// A job the bench has submitted and not yet seen finish; indexed by its region block.
#[derive(Clone, Copy)]
struct InFlight {
    kind: JobKind,
    key: u64,
    seq: u64,
}

struct Bench<'e> {
    engine: &'e Engine,
    region: &'e Region,
    data: Patterns,
    block_bytes: usize,
    queue_depth: usize,
    free: Vec<u32>,
    in_flight: Vec<Option<InFlight>>,
    next_seq: u64,
    results: Vec<JobResult>,
    rng: Rng,
    /// Keys whose store succeeded, oldest first; loads pick among them.
    pool: VecDeque<u64>,
    /// Bound on `pool`: more keys than slots cannot all be stored.
    pool_max: usize,
    next_store_key: u64,
    show_progress: bool,
}

impl<'e> Bench<'e> {
    fn new(
        engine: &'e Engine,
        region: &'e Region,
        block_bytes: usize,
        queue_depth: usize,
        region_blocks: u32,
        slots_total: usize,
        check: Check,
    ) -> Bench<'e> {
        assert!(
            region_blocks as usize >= 2 * queue_depth,
            "the region holds a block for every job of both streams"
        );
        let data = Patterns::new(block_bytes, check);
        if check == Check::Stamps {
            // Stamps-only stores write just the stamps: give every block real content once.
            for block in 0..region_blocks {
                region.write(block as usize * block_bytes, data.pattern(u64::from(block)));
            }
        }
        Bench {
            engine,
            region,
            data,
            block_bytes,
            queue_depth,
            free: (0..region_blocks).rev().collect(),
            in_flight: vec![None; region_blocks as usize],
            next_seq: 0,
            results: Vec::with_capacity(2 * queue_depth),
            rng: Rng::new(SEED ^ 0x5eed),
            pool: VecDeque::with_capacity(slots_total.min(1 << 20)),
            pool_max: slots_total.max(1),
            next_store_key: 0,
            show_progress: std::io::stderr().is_terminal(),
        }
    }

    fn run_phase(&mut self, phase: &Phase) -> CliResult<PhaseOutcome> {
        let bar = self.progress_bar(phase);
        let cpu_before = self.engine.stats().worker_cpu_seconds;
        let bench_before = thread_cpu_time();
        let start = Instant::now();
        let mut tallies = [Tally::default(), Tally::default()];
        let mut last_draw = start;
        loop {
            let open =
                !interrupt::requested() && phase.duration.is_none_or(|d| start.elapsed() < d);
            if open {
                self.submit_more(phase, &mut tallies)?;
            }
            let in_flight: usize = tallies.iter().map(|t| t.in_flight).sum();
            if in_flight == 0 && (!open || !self.has_work(phase)) {
                break;
            }
            self.engine.wait_finished(&mut self.results, WAIT);
            let mut results = std::mem::take(&mut self.results);
            for r in results.drain(..) {
                self.complete(&r, &mut tallies);
            }
            self.results = results;
            if last_draw.elapsed() >= PROGRESS_EVERY {
                last_draw = Instant::now();
                Bench::draw(&bar, phase, start, &tallies);
            }
        }
        let seconds = start.elapsed().as_secs_f64();
        bar.finish_and_clear();
        Ok(PhaseOutcome {
            seconds,
            cpu_seconds: (self.engine.stats().worker_cpu_seconds - cpu_before).max(0.0),
            bench_cpu_seconds: thread_cpu_time().saturating_sub(bench_before).as_secs_f64(),
            tallies,
        })
    }

    fn has_work(&self, phase: &Phase) -> bool {
        let stores = match phase.store {
            Some(StoreUntil::Key(end)) => self.next_store_key < end,
            Some(StoreUntil::Deadline) => true,
            None => false,
        };
        stores || (phase.load && !self.pool.is_empty())
    }

    /// Tops both streams up to the queue depth, loads first. Stops a stream at backpressure.
    fn submit_more(&mut self, phase: &Phase, tallies: &mut [Tally; 2]) -> CliResult<()> {
        if phase.load {
            let tally = &mut tallies[Stream::Load as usize];
            while tally.in_flight < self.queue_depth {
                let Some(key) = self.pick_load_key(tally) else {
                    break;
                };
                let block = self
                    .free
                    .pop()
                    .expect("the region has a block per job in flight");
                self.data.poison(self.region, self.offset(block));
                if !self.submit(JobKind::Load, key, block)? {
                    self.free.push(block);
                    break;
                }
                tally.in_flight += 1;
            }
        }
        if let Some(until) = phase.store {
            let tally = &mut tallies[Stream::Store as usize];
            while tally.in_flight < self.queue_depth {
                if let StoreUntil::Key(end) = until {
                    if self.next_store_key >= end {
                        break;
                    }
                }
                let key = self.next_store_key;
                let block = self
                    .free
                    .pop()
                    .expect("the region has a block per job in flight");
                self.data.store_into(self.region, self.offset(block), key);
                if !self.submit(JobKind::Store, key, block)? {
                    self.free.push(block);
                    break;
                }
                self.next_store_key += 1;
                tally.in_flight += 1;
            }
        }
        Ok(())
    }

    /// A random stored key the index still holds; candidates it no longer holds leave the pool.
    fn pick_load_key(&mut self, tally: &mut Tally) -> Option<u64> {
        for _ in 0..LOOKUP_TRIES {
            if self.pool.is_empty() {
                return None;
            }
            let i = (self.rng.next_u64() % self.pool.len() as u64) as usize;
            let key = self.pool[i];
            if self.engine.lookup(&[key_of(key)])[0] != Lookup::Miss {
                return Some(key);
            }
            self.pool.remove(i);
            tally.lookup_skips += 1;
        }
        // Give up filtering: load the newest key and count what happens.
        self.pool.back().copied()
    }

    /// `Ok(false)` on backpressure (nothing was queued).
    fn submit(&mut self, kind: JobKind, key: u64, block: u32) -> CliResult<bool> {
        let seq = self.next_seq;
        assert!(
            seq < 1 << 32,
            "job sequence numbers fit the id's upper half"
        );
        let id = (seq << 32) | u64::from(block);
        let job = Job::new(id, vec![key_of(key)], vec![block]);
        let submitted = match kind {
            JobKind::Load => self.engine.submit_load(job),
            JobKind::Store => self.engine.submit_store(job),
        };
        match submitted {
            Ok(()) => {
                self.next_seq += 1;
                let slot = &mut self.in_flight[block as usize];
                assert!(slot.is_none(), "block {block} is already in flight");
                *slot = Some(InFlight { kind, key, seq });
                Ok(true)
            }
            Err(kvtier::Error::Backpressure(why)) => {
                tracing::debug!(%why, "backpressure: waiting for results before resubmitting");
                Ok(false)
            }
            Err(e) => Err(CliError::from(e).context("submitting a job")),
        }
    }

    fn complete(&mut self, r: &JobResult, tallies: &mut [Tally; 2]) {
        let block = (r.id & u64::from(u32::MAX)) as u32;
        let job = self.in_flight[block as usize]
            .take()
            .expect("each result is for a job this bench submitted and has not seen finish");
        assert_eq!(
            job.seq,
            r.id >> 32,
            "result id matches the job in flight on its block"
        );
        let tally = &mut tallies[Stream::of(job.kind) as usize];
        tally.in_flight -= 1;
        let offset = self.offset(block);
        if r.success {
            tally.ok_blocks += 1;
            tally.bytes += r.bytes;
            tally.record_latency(r.elapsed.as_micros() as u64, &mut self.rng);
            match job.kind {
                JobKind::Load => match self.data.first_mismatch(self.region, offset, job.key) {
                    None => tally.verified += 1,
                    Some(at) => {
                        tally.corrupt += 1;
                        tracing::error!(
                            key = job.key,
                            block,
                            first_bad_byte = at,
                            "CORRUPT: loaded block differs from what was stored under this key"
                        );
                    }
                },
                JobKind::Store => {
                    self.pool.push_back(job.key);
                    if self.pool.len() > self.pool_max {
                        self.pool.pop_front();
                    }
                }
            }
        } else {
            let failure = r.failure();
            if job.kind == JobKind::Load && failure.is_some_and(|f| f.reason == KeyFailure::Miss) {
                tally.missed += 1;
            } else {
                tally.failed += 1;
                if tally.failed <= FAILURES_LOGGED_MAX {
                    tracing::warn!(
                        kind = ?job.kind,
                        key = job.key,
                        reason = failure.map_or_else(|| "unknown".into(), |f| f.reason.to_string()),
                        detail = failure.map_or("", |f| f.detail.as_str()),
                        "job failed"
                    );
                }
            }
        }
        self.free.push(block);
    }

    fn offset(&self, block: u32) -> usize {
        block as usize * self.block_bytes
    }

    fn progress_bar(&self, phase: &Phase) -> ProgressBar {
        if !self.show_progress {
            return ProgressBar::hidden();
        }
        let (len, template) = match (phase.duration, phase.store) {
            (Some(d), _) => (
                d.as_millis() as u64,
                "{prefix:>10} [{bar:30}] {elapsed} {msg}",
            ),
            (None, Some(StoreUntil::Key(end))) => (
                end.saturating_sub(self.next_store_key),
                "{prefix:>10} [{bar:30}] {pos}/{len} {msg}",
            ),
            (None, _) => (0, "{prefix:>10} {msg}"),
        };
        let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
        if let Ok(style) = ProgressStyle::with_template(template) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_prefix(phase.label);
        bar
    }

    fn draw(bar: &ProgressBar, phase: &Phase, start: Instant, tallies: &[Tally; 2]) {
        let secs = start.elapsed().as_secs_f64().max(1e-9);
        let rate = |t: &Tally| output::gib(t.bytes) / secs;
        let [load, store] = tallies;
        if phase.duration.is_some() {
            bar.set_position(start.elapsed().as_millis() as u64);
        } else {
            bar.set_position(store.ok_blocks + store.failed);
        }
        let mut msg = String::new();
        if phase.load {
            let _ = write!(msg, "load {:.2} GiB/s ", rate(load));
        }
        if phase.store.is_some() {
            let _ = write!(msg, "store {:.2} GiB/s", rate(store));
        }
        bar.set_message(msg);
    }
}

/// The 36-byte vLLM-shaped key (32-byte hash + group 0) of key number `k`.
fn key_of(k: u64) -> Key {
    let mut state = k ^ SEED;
    let mut hash = [0u8; 32];
    for chunk in hash.chunks_exact_mut(8) {
        chunk.copy_from_slice(&splitmix64(&mut state).to_le_bytes());
    }
    Key::vllm(&hash, 0).expect("a 32-byte hash and a group index fit in a key")
}

/// Block contents: `content(k)` is pattern `k % PATTERNS` with `k` (u64 LE) stamped in its
/// first and last 8 bytes. Patterns live in ordinary memory, generated once. With
/// [`Check::Stamps`] only the stamps are written and checked.
struct Patterns {
    block_bytes: usize,
    contents: Vec<Vec<u8>>,
    check: Check,
}

impl Patterns {
    fn new(block_bytes: usize, check: Check) -> Patterns {
        assert!(
            block_bytes >= POISON_STRIDE_BYTES,
            "blocks are at least one page"
        );
        let mut rng = Rng::new(SEED);
        let patterns = (0..PATTERNS)
            .map(|_| {
                let mut block = vec![0u8; block_bytes];
                for chunk in block.chunks_mut(8) {
                    let word = rng.next_u64().to_le_bytes();
                    chunk.copy_from_slice(&word[..chunk.len()]);
                }
                block
            })
            .collect();
        Patterns {
            block_bytes,
            contents: patterns,
            check,
        }
    }

    fn pattern(&self, k: u64) -> &[u8] {
        &self.contents[(k % PATTERNS) as usize]
    }

    fn store_into(&self, region: &Region, offset: usize, k: u64) {
        let stamp = k.to_le_bytes();
        if self.check == Check::Full {
            region.write(offset, self.pattern(k));
        }
        region.write(offset, &stamp);
        region.write(offset + self.block_bytes - stamp.len(), &stamp);
    }

    /// Overwrites the start of every page of the block, so a load that leaves any page
    /// unwritten (or writes nothing) cannot pass verification on stale content.
    fn poison(&self, region: &Region, offset: usize) {
        if self.check == Check::Stamps {
            region.fill(offset, 8, 0xFF);
            region.fill(offset + self.block_bytes - 8, 8, 0xFF);
            return;
        }
        for page in (0..self.block_bytes).step_by(POISON_STRIDE_BYTES) {
            region.fill(offset + page, 8, 0xFF);
        }
    }

    /// `None` if the block holds exactly `content(k)`, else the first differing byte.
    fn first_mismatch(&self, region: &Region, offset: usize, k: u64) -> Option<usize> {
        let stamp = k.to_le_bytes();
        let pattern = self.pattern(k);
        let n = self.block_bytes;
        region.with_bytes(offset, n, |got| {
            let tail = n - stamp.len();
            let stamps_ok = got[..8] == stamp && got[tail..] == stamp;
            if stamps_ok && (self.check == Check::Stamps || got[8..tail] == pattern[8..tail]) {
                return None;
            }
            if self.check == Check::Stamps {
                return (0..8)
                    .find(|&i| got[i] != stamp[i])
                    .or_else(|| (tail..n).find(|&i| got[i] != stamp[i - tail]));
            }
            (0..n).find(|&i| {
                let want = if i < 8 {
                    stamp[i]
                } else if i >= tail {
                    stamp[i - tail]
                } else {
                    pattern[i]
                };
                got[i] != want
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_distinct_and_vllm_shaped() {
        let a = key_of(1);
        assert_eq!(a.len(), 36);
        assert_ne!(a, key_of(2));
        assert_eq!(a, key_of(1));
    }

    #[test]
    fn contents_verify_only_for_their_own_key() {
        let block = 8192;
        let region =
            Region::allocate(2 * block, kvtier_sys::mem::HugePages::Off).expect("small region");
        let data = Patterns::new(block, Check::Full);
        data.store_into(&region, 0, 5);
        assert_eq!(data.first_mismatch(&region, 0, 5), None);
        assert_eq!(
            data.first_mismatch(&region, 0, 21),
            Some(0),
            "same pattern, other stamp"
        );
        data.poison(&region, block);
        assert!(data.first_mismatch(&region, block, 5).is_some());
        let mut byte = [0u8; 1];
        region.read(block - 100, &mut byte);
        region.write(block - 100, &[!byte[0]]);
        assert_eq!(data.first_mismatch(&region, 0, 5), Some(block - 100));
    }

    #[test]
    fn stamps_check_only_the_ends() {
        let block = 8192;
        let region =
            Region::allocate(block, kvtier_sys::mem::HugePages::Off).expect("small region");
        let data = Patterns::new(block, Check::Stamps);
        data.store_into(&region, 0, 9);
        assert_eq!(data.first_mismatch(&region, 0, 9), None);
        region.write(100, &[1, 2, 3]);
        assert_eq!(
            data.first_mismatch(&region, 0, 9),
            None,
            "the middle is not checked"
        );
        assert_eq!(data.first_mismatch(&region, 0, 10), Some(0));
        data.poison(&region, 0);
        assert_eq!(data.first_mismatch(&region, 0, 9), Some(0));
        data.store_into(&region, 0, 9);
        region.fill(block - 1, 1, 0xAB);
        assert_eq!(data.first_mismatch(&region, 0, 9), Some(block - 1));
    }
}
