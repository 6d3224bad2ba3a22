//! The `kvtier` command: `bench` (whole-engine load generator with data verification),
//! `fio-compare` (kvtier against fio on the same device, in alternating pairs), `probe` (what
//! this host offers the engine, with advice), `inspect` (what a configured store holds, with
//! checksum verification), `get` and `put` (one block out of or into a store, through the
//! engine) and `config-check` (parse, validate and print a config).
//!
//! Exit codes: 0 success; 1 a runtime failure or bad data found (a corrupt block in `bench`, a
//! checksum failure in `inspect`); 2 a usage or config error. Errors print as `error: ...` on
//! stderr with the full message. Logs go to stderr through `tracing` (`-v` for debug, `RUST_LOG`
//! overrides both), so stdout carries only the command's report.

mod bench;
mod block;
mod cold;
mod fio_compare;
mod inspect;
mod interrupt;
mod jobs;
mod live;
mod output;
mod probe;
mod rng;
mod stats;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

use crate::output::{CliError, CliResult};

#[derive(Parser)]
#[command(
    name = "kvtier",
    version,
    about = "kvtier: KV-cache block storage engine tools (bench, fio-compare, probe, inspect, \
             get, put, config-check)"
)]
struct Cli {
    #[arg(
        short,
        long,
        global = true,
        help = "Log at debug level to stderr (RUST_LOG, when set, chooses the filter instead)"
    )]
    verbose: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Measure the engine: stores, verified loads, and loads under concurrent stores.
    Bench(bench::BenchArgs),
    /// Compare kvtier with fio on the same device, block size, queue depth and cores.
    FioCompare(fio_compare::FioCompareArgs),
    #[command(
        about = "Report what this host offers kvtier (io_uring, O_DIRECT, hugepages, memlock, \
                 block queue), with advice"
    )]
    Probe(probe::ProbeArgs),
    /// Show what the configured devices hold and verify every stored block's checksum.
    Inspect(inspect::InspectArgs),
    /// Copy one stored block out to a file, through the engine.
    Get(block::GetArgs),
    /// Store one block from a file of block_size bytes, through the engine.
    Put(block::PutArgs),
    /// A live view of a running engine's metrics endpoint ([metrics] listen): GiB/s per tier,
    /// hit rate, load p50/p99, queues and errors every second.
    Stats(live::StatsArgs),
    /// Parse and validate a config file and print the effective config.
    ConfigCheck {
        /// The TOML config file.
        file: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // fio-compare opens an engine per run: its per-open info lines would drown the progress.
    let engine_level = match cli.command {
        Command::FioCompare(_) => "warn",
        _ => "info",
    };
    init_tracing(cli.verbose, engine_level);
    let outcome = match cli.command {
        Command::Bench(args) => bench::run(&args),
        Command::FioCompare(args) => fio_compare::run(&args),
        Command::Probe(args) => probe::run(&args),
        Command::Inspect(args) => inspect::run(&args),
        Command::Get(args) => block::get(&args),
        Command::Put(args) => block::put(&args),
        Command::Stats(args) => live::run(&args),
        Command::ConfigCheck { file } => config_check(&file),
    };
    match outcome {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err}");
            err.exit_code()
        }
    }
}

/// `RUST_LOG` if set; otherwise kvtier's own crates at info (the engine crates at
/// `engine_level`; all at debug with `-v`), others at warn.
fn init_tracing(verbose: bool, engine_level: &str) {
    let (engine, cli) = if verbose {
        ("debug", "debug")
    } else {
        (engine_level, "info")
    };
    let default = format!("warn,kvtier={engine},kvtier_sys={engine},kvtier_cli={cli}");
    let filter = match std::env::var("RUST_LOG") {
        Ok(spec) if !spec.trim().is_empty() => EnvFilter::try_new(&spec).unwrap_or_else(|e| {
            eprintln!("warning: RUST_LOG={spec:?} is not a valid filter ({e}); using {default}");
            EnvFilter::new(&default)
        }),
        _ => EnvFilter::new(&default),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match std::env::var("KVTIER_LOG_FORMAT").as_deref() {
        // One JSON object per line, for log shippers.
        Ok("json") => builder.json().with_current_span(false).init(),
        other => {
            if let Ok(v) = other {
                if v != "text" {
                    eprintln!(
                        "warning: KVTIER_LOG_FORMAT={v:?}: use \"json\" or \"text\"; using text"
                    );
                }
            }
            builder
                .with_ansi(
                    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none(),
                )
                .with_target(verbose)
                .init();
        }
    }
}

/// `kvtier config-check FILE`: the effective config on stdout, or the error and exit 2.
fn config_check(file: &std::path::Path) -> CliResult<ExitCode> {
    let config = kvtier::Config::from_file(file).map_err(|e| {
        // An unreadable file is not a usage error in the config's content, but it is still
        // the user's to fix (wrong path), so both are exit 2.
        CliError::usage(e.to_string())
    })?;
    print!("{}", config.to_toml_string());
    Ok(ExitCode::SUCCESS)
}
