//! `kvtier get` and `kvtier put`: one block copied out of a store into a file, or from a file
//! into a store, through the engine (its index, checksums and capacity accounting), for either
//! layout.
//!
//! Both open the engine with a one-block region and run one one-block job. Invariants: `get`
//! never creates, grows or formats a store (like `inspect`, it requires the store to exist and
//! opens slab devices with `overwrite = false`); `put` opens the config as it is, so a store that
//! does not exist yet is created as any engine user would create it; the output file of `get` is
//! written only when the load succeeded; a block is exactly `block_size` bytes, so `put` refuses
//! any other input size unless `--pad` is given for a shorter one.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use kvtier::config::Layout;
use kvtier::files::mapper::GROUP_INDEX_BYTES;
use kvtier::{Config, Engine, JobKind, JobResult, Key, KeyFailure, Region};

use crate::output::{self, CliError, CliResult};
use crate::{inspect, jobs};

/// Bound on the wait for the one job's result (a block takes milliseconds; this only keeps a
/// wedged device from hanging the command forever).
const JOB_TIMEOUT: Duration = Duration::from_secs(90);

#[derive(Args)]
pub struct GetArgs {
    /// The engine config naming the devices.
    #[arg(long)]
    config: PathBuf,
    /// The full offload key in hex (files layout: the block hash followed by the 4-byte
    /// big-endian group index), as `kvtier inspect --keys` prints it.
    #[arg(long, value_name = "HEX", value_parser = parse_key)]
    key: Key,
    /// Where the block's bytes go (created or replaced).
    #[arg(long, value_name = "PATH")]
    out: PathBuf,
}

#[derive(Args)]
pub struct PutArgs {
    /// The engine config naming the devices.
    #[arg(long)]
    config: PathBuf,
    /// The full offload key in hex (files layout: the block hash followed by the 4-byte
    /// big-endian group index).
    #[arg(long, value_name = "HEX", value_parser = parse_key)]
    key: Key,
    /// The block's bytes: a file of exactly block_size bytes.
    #[arg(long = "in", value_name = "PATH")]
    input: PathBuf,
    /// Accept a file shorter than block_size and zero-pad it to a whole block.
    #[arg(long)]
    pad: bool,
}

fn parse_key(text: &str) -> Result<Key, String> {
    Key::from_hex(text).map_err(|e| e.to_string())
}

/// `kvtier get`: loads the key through the engine and writes the block to `--out`.
pub fn get(args: &GetArgs) -> CliResult<ExitCode> {
    let mut config = Config::from_file(&args.config)?;
    check_key_shape(&config, &args.key)?;
    inspect::require_existing(&config, "get")?;
    // Nothing below may create, grow or reformat a device. (On a block device, a namespace
    // or a VFIO controller, capacity_bytes only bounds the slab: it stays, or the geometry
    // would change.)
    for device in &mut config.devices {
        device.overwrite = false;
        if device.layout == Layout::Slab && device.path.is_file() {
            device.capacity_bytes = None;
        }
    }
    let hex = args.key.to_hex();
    let (region, engine) = open_one_block(&config)?;
    let result = jobs::run_one(&engine, JobKind::Load, args.key, JOB_TIMEOUT)?;
    engine.shutdown();
    drop(engine);
    if !result.success {
        return Err(failed(&hex, "load", &result));
    }
    let block_len = config.block_size as usize;
    region
        .with_bytes(0, block_len, |bytes| std::fs::write(&args.out, bytes))
        .map_err(|e| CliError::runtime(format!("writing {}: {e}", args.out.display())))?;
    println!(
        "key {hex}: {} written to {}",
        output::size(config.block_size),
        args.out.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// `kvtier put`: stores `--in` under the key through the engine.
pub fn put(args: &PutArgs) -> CliResult<ExitCode> {
    let config = Config::from_file(&args.config)?;
    check_key_shape(&config, &args.key)?;
    let block_bytes = config.block_size;
    let block_len = usize::try_from(block_bytes)
        .map_err(|_| CliError::usage("block_size does not fit this machine's address space"))?;
    let input_error =
        |e: std::io::Error| CliError::usage(format!("--in {}: {e}", args.input.display()));
    // Size first, so a wrong (possibly huge) file is refused before it is read.
    let len = std::fs::metadata(&args.input).map_err(input_error)?.len();
    check_size(&args.input, len, block_bytes, args.pad)?;
    let bytes = std::fs::read(&args.input).map_err(input_error)?;
    check_size(&args.input, bytes.len() as u64, block_bytes, args.pad)?;
    let hex = args.key.to_hex();
    let (region, engine) = open_one_block(&config)?;
    region.write(0, &bytes);
    if bytes.len() < block_len {
        region.fill(bytes.len(), block_len - bytes.len(), 0);
    }
    let result = jobs::run_one(&engine, JobKind::Store, args.key, JOB_TIMEOUT)?;
    // Shutting down flushes what the store left to write (the slab's slot table page).
    engine.shutdown();
    drop(engine);
    if !result.success {
        return Err(failed(&hex, "store", &result));
    }
    if result.bytes == 0 {
        println!("key {hex}: already present, not rewritten");
    } else {
        let padded = if bytes.len() < block_len {
            format!(
                " ({} from {}, zero-padded)",
                output::size(bytes.len() as u64),
                args.input.display()
            )
        } else {
            format!(" from {}", args.input.display())
        };
        println!("key {hex}: stored {}{padded}", output::size(block_bytes));
    }
    Ok(ExitCode::SUCCESS)
}

/// A files-layout key names a file only with a block hash before its 4-byte group index.
fn check_key_shape(config: &Config, key: &Key) -> CliResult<()> {
    let files = config
        .devices
        .first()
        .is_some_and(|d| d.layout == Layout::Files);
    if files && key.len() <= GROUP_INDEX_BYTES {
        return Err(CliError::usage(format!(
            "--key {}: {} bytes, but a files-layout key is a block hash followed by the \
             {GROUP_INDEX_BYTES}-byte big-endian group index (more than {GROUP_INDEX_BYTES} bytes)",
            key.to_hex(),
            key.len()
        )));
    }
    Ok(())
}

fn check_size(input: &Path, len: u64, block_bytes: u64, pad: bool) -> CliResult<()> {
    if len == block_bytes || (pad && len < block_bytes) {
        return Ok(());
    }
    let hint = if len < block_bytes {
        " (--pad zero-pads a shorter file)"
    } else {
        ""
    };
    Err(CliError::usage(format!(
        "--in {}: {len} bytes, but block_size is {block_bytes} bytes ({}): a block is exactly \
         block_size bytes{hint}",
        input.display(),
        output::size(block_bytes)
    )))
}

/// The engine on `config` with a region of one block.
fn open_one_block(config: &Config) -> CliResult<(Arc<Region>, Engine)> {
    let mut config = config.clone();
    config.region_blocks = 1;
    config.validate()?;
    let region = kvtier::region::allocate(&config)?;
    let engine = Engine::open(&config, Arc::clone(&region))?;
    Ok((region, engine))
}

/// The error for a failed job: the key and why.
fn failed(hex: &str, what: &str, result: &JobResult) -> CliError {
    match result.failure() {
        Some(f) if f.reason == KeyFailure::Miss => {
            CliError::runtime(format!("key {hex}: not stored"))
        }
        Some(f) if f.detail.is_empty() => {
            CliError::runtime(format!("key {hex}: {what} failed: {}", f.reason))
        }
        Some(f) => CliError::runtime(format!(
            "key {hex}: {what} failed: {} ({})",
            f.reason, f.detail
        )),
        None => CliError::runtime(format!("key {hex}: {what} failed (no reason reported)")),
    }
}
