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
use kvtier::{Config, Engine, JobKind, Key, KeyFailure, Lookup, Region};
use kvtier_sys::affinity::thread_cpu_time;
use serde::Serialize;
use serde_json::json;

use crate::interrupt;
use crate::output::{self, CliError, CliResult, Human, Table};

mod driver;
mod patterns;
mod report;

use driver::{key_of, Bench, Phase, StoreUntil, Stream};
use patterns::Patterns;
use report::render;
pub(crate) use report::{ThreadCpu, WorkerIo, WorkloadRow};

/// Distinct pseudorandom block patterns; a key's content is one of them, stamped with the key.
const PATTERNS: u64 = 16;
/// Seed of the pattern generator and of the load key choice: runs are reproducible.
const SEED: u64 = 0x6b76_7469_6572_0001;
/// How long one wait for results may block while a stream waits to submit (see `jobs::Driver`).
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

/// Which keys the lookup threads ask for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
enum LookupKeys {
    /// Half among the keys the store phase writes (stored yet or not), half never stored.
    Mixed,
    /// Only keys whose store has finished: hits, unless a store failed or was evicted.
    Stored,
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
    /// Blocks kept in flight per stream (in jobs of --blocks-per-job blocks).
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=8192))]
    queue_depth: u32,
    /// Blocks (keys) per job: 1 is one job per block, as fio issues one I/O per block; vLLM's
    /// tier submits one job per transfer, of many blocks. The queue depth must be a multiple.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1024))]
    blocks_per_job: u32,
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
    /// Threads that call `lookup` in a loop (64 keys a call) during the store phase, to show
    /// that lookups do not slow stores; their rate and hit fraction are printed (and in the
    /// JSON's `lookups`).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=64))]
    lookup_threads: u32,
    /// Which keys the lookup threads ask for.
    #[arg(long, value_enum, default_value_t = LookupKeys::Mixed)]
    lookup_keys: LookupKeys,
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
    Depth::new(args.queue_depth, args.blocks_per_job)?;
    if args.workload == Workload::Cold && args.blocks_per_job != 1 {
        return Err(CliError::usage(
            "--blocks-per-job applies to the device workloads; --workload cold moves one \
             object per job",
        ));
    }
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
        Depth::new(args.queue_depth, args.blocks_per_job)?,
        region_blocks as u32,
        usize::try_from(slots_total).unwrap_or(usize::MAX),
        Check::Full,
    );
    let (results, lookups) = run_phases(&mut bench, args, config, blocks)?;
    engine.drain();
    let final_stats = engine.stats();
    engine.shutdown();
    drop(bench);
    drop(engine);

    let cores = kvtier_sys::affinity::available_cores();
    let mut text = output::engine_text(&info, &cores);
    let _ = writeln!(
        text,
        "run: {blocks} keys stored of {slots_total} slots, queue depth {}{}, {} s per timed \
         phase; engine totals: {} evictions, {} checksum failures, {} I/O errors\n",
        args.queue_depth,
        Depth::describe_jobs(args.blocks_per_job),
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
            "lookups": lookups,
            "run": {
                "blocks": blocks,
                "slots_total": slots_total,
                "queue_depth": args.queue_depth,
                "blocks_per_job": args.blocks_per_job,
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
) -> CliResult<(Vec<WorkloadRow>, Option<LookupRun>)> {
    let duration = Duration::from_secs_f64(args.duration);
    let mut results = Vec::new();

    let store_phase = Phase {
        label: "store",
        load: false,
        store: Some(StoreUntil::Key(blocks)),
        duration: None,
    };
    let (store, lookups) = if args.lookup_threads == 0 {
        (bench.run_phase(&store_phase)?, None)
    } else {
        let (store, lookups) = lookups_during(bench, args, &store_phase, blocks)?;
        eprintln!("{lookups}");
        (store, Some(lookups))
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
            return Ok((results, lookups));
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
    Ok((results, lookups))
}

/// What the lookup threads of the store phase did.
#[derive(Debug, Serialize)]
struct LookupRun {
    threads: u32,
    keys: LookupKeys,
    keys_per_call: usize,
    /// Keys looked up per second: each thread's keys over its time from its first call to
    /// the end of the store phase, summed over threads.
    keys_per_second: f64,
    hits: u64,
    misses: u64,
    /// Answers neither hit nor miss (a tier that answers later).
    pending: u64,
}

impl std::fmt::Display for LookupRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let all = (self.hits + self.misses + self.pending).max(1) as f64;
        write!(
            f,
            "lookups during the store phase: {} thread(s), {} keys a call, {} keys: {:.2} M keys/s, \
             {:.2} % hits, {:.2} % misses",
            self.threads,
            self.keys_per_call,
            match self.keys {
                LookupKeys::Mixed => "mixed",
                LookupKeys::Stored => "stored",
            },
            self.keys_per_second / 1e6,
            100.0 * self.hits as f64 / all,
            100.0 * self.misses as f64 / all,
        )
    }
}

const LOOKUP_KEYS_PER_CALL: usize = 64;

/// Runs the store phase with `--lookup-threads` threads calling `lookup` beside it.
fn lookups_during(
    bench: &mut Bench<'_>,
    args: &BenchArgs,
    store_phase: &Phase,
    blocks: u64,
) -> CliResult<(driver::PhaseOutcome, LookupRun)> {
    use std::sync::atomic::{AtomicBool, Ordering};
    let engine = bench.engine;
    let finished_below = bench.finished_below();
    let stop = AtomicBool::new(false);
    // The store phase starts once every lookup thread runs.
    let ready = std::sync::Barrier::new(args.lookup_threads as usize + 1);
    let (store, per_thread) = std::thread::scope(|s| {
        let threads: Vec<_> = (0..args.lookup_threads)
            .map(|t| {
                let (stop, finished_below, ready) = (&stop, &finished_below, &ready);
                s.spawn(move || {
                    let mut rng = Rng::new(SEED ^ u64::from(t));
                    let mut keys = Vec::with_capacity(LOOKUP_KEYS_PER_CALL);
                    let mut seen = [0_u64; 3];
                    // From the first call: `stored` keys wait for the first store to finish.
                    let mut first_call = None;
                    ready.wait();
                    while !stop.load(Ordering::Relaxed) {
                        keys.clear();
                        match args.lookup_keys {
                            LookupKeys::Mixed => keys.extend(
                                (0..LOOKUP_KEYS_PER_CALL).map(|_| key_of(rng.below(2 * blocks))),
                            ),
                            LookupKeys::Stored => {
                                let below = finished_below.load(Ordering::Acquire);
                                if below == 0 {
                                    std::thread::yield_now();
                                    continue;
                                }
                                keys.extend(
                                    (0..LOOKUP_KEYS_PER_CALL).map(|_| key_of(rng.below(below))),
                                );
                            }
                        }
                        first_call.get_or_insert_with(Instant::now);
                        for answer in engine.lookup(&keys) {
                            let i = match answer {
                                Lookup::Hit(_) => 0,
                                Lookup::Miss => 1,
                                Lookup::Pending => 2,
                            };
                            seen[i] += 1;
                        }
                    }
                    (seen, first_call.map_or(0.0, |t| t.elapsed().as_secs_f64()))
                })
            })
            .collect();
        ready.wait();
        let r = bench.run_phase(store_phase);
        stop.store(true, Ordering::Relaxed);
        let per_thread: Vec<([u64; 3], f64)> = threads
            .into_iter()
            .map(|t| t.join().expect("a lookup thread panicked"))
            .collect();
        (r, per_thread)
    });
    let store = store?;
    let mut seen = [0_u64; 3];
    let mut keys_per_second = 0.0;
    for (counts, seconds) in &per_thread {
        for (total, n) in seen.iter_mut().zip(counts) {
            *total += n;
        }
        if *seconds > 0.0 {
            keys_per_second += counts.iter().sum::<u64>() as f64 / seconds;
        }
    }
    let [hits, misses, pending] = seen;
    Ok((
        store,
        LookupRun {
            threads: args.lookup_threads,
            keys: args.lookup_keys,
            keys_per_call: LOOKUP_KEYS_PER_CALL,
            keys_per_second,
            hits,
            misses,
            pending,
        },
    ))
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

/// Blocks in flight per stream, in jobs of `per_job` blocks (a divisor of `blocks`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Depth {
    pub(crate) blocks: u32,
    pub(crate) per_job: u32,
}

impl Depth {
    /// `--queue-depth` and `--blocks-per-job`, refused unless the second divides the first.
    pub(crate) fn new(blocks: u32, per_job: u32) -> CliResult<Depth> {
        if per_job == 0 || !blocks.is_multiple_of(per_job) {
            return Err(CliError::usage(format!(
                "--queue-depth {blocks} is not a multiple of --blocks-per-job {per_job}: the \
                 queue depth counts blocks in flight, in jobs of --blocks-per-job blocks"
            )));
        }
        Ok(Depth { blocks, per_job })
    }

    /// ", in jobs of N blocks" where jobs are of more than one block, else nothing.
    pub(crate) fn describe_jobs(per_job: u32) -> String {
        if per_job > 1 {
            format!(", in jobs of {per_job} blocks")
        } else {
            String::new()
        }
    }
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
    depth: Depth,
    duration: Duration,
) -> CliResult<EngineRun> {
    let queue_depth = depth.blocks;
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
        depth,
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
