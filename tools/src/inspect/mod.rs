//! `kvtier inspect`: what the configured devices hold, and whether every stored block still
//! matches its checksum, for either layout.
//!
//! Slab devices are reported twice. First the on-device view, read directly from each device's
//! header and slot table before the engine opens it (valid, empty, torn and duplicate entries);
//! then the engine's view after recovery (`Engine::stats`). Verification loads every key found in
//! the slot tables through the engine (which checks the crc32c of recovered blocks on their
//! first load) and checks the crc32c of what arrived against the table entry once more.
//!
//! Files devices are reported from the scan the engine runs at open (blocks, bytes, wrong-size
//! files, temp files removed or kept). Verification loads every key the engine indexed
//! (`Engine::keys`) through the engine, which checks a file's crc32c xattr when it has one and
//! removes a file that is short or fails it; the crc32c of what arrived is then compared with the
//! xattr once more, which also tells a verified block from one stored without a checksum (by
//! vLLM, or on a file system without user xattrs).
//!
//! Invariants: inspect never creates, grows or formats a store — slab devices must exist, hold a
//! ready kvtier header with the config's block size, and are opened with `overwrite = false` and
//! no `capacity_bytes`; a files device's namespace directory must exist already. Caveat: opening
//! the engine is not read-only (the library has no read-only open yet). Slab recovery clears
//! torn entries and entries that the configured cores and devices no longer route to, so inspect
//! with the `cores` the store was written with; the files scan removes temp files older than
//! `temp_grace_secs` and, when no other process has the directory open, resets the shared usage
//! counter; and a load that finds a short or corrupt file removes it.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use kvtier::config::Layout;
use kvtier::files::mapper::FileMapper;
use kvtier::slab::{self};
use kvtier::{Config, KeyFailure};
use kvtier_sys::mem::{HugePages, Region};
use serde::{Serialize, Serializer};

use crate::output::{CliError, CliResult};

mod device;
mod directory;
mod render;

use device::{load_all, open_read_only, read_geometry, run_slab};
use directory::run_files;
use render::{render_files, render_keys, render_slab, render_verify};

/// Region blocks, and so loads in flight, while verifying.
const VERIFY_DEPTH: u32 = 16;
/// Slot table bytes read per call (a multiple of the 4 KiB table page).
const TABLE_CHUNK_BYTES: usize = 1 << 20;
/// Failed keys logged individually before the rest are only counted.
const FAILURES_LOGGED_MAX: u64 = 10;

#[derive(Args)]
pub struct InspectArgs {
    #[arg(
        long,
        help = "The engine config naming the devices (its block_size must match theirs)"
    )]
    config: PathBuf,
    /// Print one JSON object on stdout instead of the report.
    #[arg(long)]
    json: bool,
    /// Skip loading every block to verify its checksum.
    #[arg(long)]
    no_verify: bool,
    /// Also list every stored key (hex) with its size and checksum status.
    #[arg(long)]
    keys: bool,
}

/// What one slab device's slot table holds, read before the engine opens it.
#[derive(Serialize)]
struct DeviceReport {
    path: PathBuf,
    kind: &'static str,
    direct: bool,
    size_bytes: u64,
    slot_count: u64,
    slot_bytes: u64,
    /// Distinct keys with a valid entry the engine keeps at open (the newest entry of a key
    /// counts; unroutable entries do not).
    blocks_stored: u64,
    free_slots: u64,
    valid_entries: u64,
    empty_entries: u64,
    torn_entries: u64,
    /// Valid entries whose keys this config routes to another worker (or that hold
    /// another block size): the engine clears them at open, as it does torn ones.
    unroutable_entries: u64,
    /// Older entries of a key that has a newer one; recovery drops them.
    duplicate_entries: u64,
}

/// What one files device's directory held when the engine scanned it at open.
#[derive(Serialize)]
struct FilesDeviceReport {
    /// The device's configured path (the shared root directory).
    path: PathBuf,
    /// The namespace's data directory under it, where the block files are.
    data_dir: PathBuf,
    kind: &'static str,
    direct: bool,
    /// Block files of the right size: what the engine indexed.
    blocks: u64,
    /// Bytes of every block file and kept temp file found (the directory's usage at open).
    bytes: u64,
    /// `.bin` files whose size is not block_size: never served, left alone.
    wrong_size_files: u64,
    /// Temp files older than temp_grace_secs, left by a crashed writer, removed at open.
    temps_removed: u64,
    /// Younger temp files, possibly a live writer's in another process.
    temps_kept: u64,
    /// No other process had the directory open, so the shared usage counter was reset to
    /// `bytes`.
    usage_reset: bool,
    /// The capacity bound; `null` when the directory grows without bound.
    capacity_bytes: Option<u64>,
    /// Blocks the bound holds; 0 when unbounded.
    slot_count: u64,
}

/// A key's checksum status after verification.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    /// Loaded, and the crc32c of what arrived matches the stored checksum.
    Verified,
    /// Files only: loaded, but the file has no checksum xattr to verify against.
    NoChecksum,
    /// The engine refused the block: its data does not match the stored crc32c (a files block
    /// is removed).
    ChecksumMismatch,
    /// The engine returned the block, but its crc32c differs from the slot table entry or
    /// xattr (an engine running with `checksums = false` does not check).
    CrcMismatch,
    /// Fewer bytes than a block arrived (a files block is removed).
    Short,
    /// Listed, but the engine no longer had it when loaded.
    Missing,
    Error,
    /// `--no-verify`.
    NotVerified,
}

impl Status {
    fn as_str(self) -> &'static str {
        match self {
            Status::Verified => "verified",
            Status::NoChecksum => "no checksum",
            Status::ChecksumMismatch => "checksum mismatch",
            Status::CrcMismatch => "crc mismatch",
            Status::Short => "short",
            Status::Missing => "missing",
            Status::Error => "error",
            Status::NotVerified => "not verified",
        }
    }

    fn of_failure(reason: KeyFailure) -> Status {
        match reason {
            KeyFailure::Checksum => Status::ChecksumMismatch,
            KeyFailure::ShortIo { .. } => Status::Short,
            KeyFailure::Miss => Status::Missing,
            _ => Status::Error,
        }
    }
}

impl Serialize for Status {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// One line of `--keys`.
#[derive(Serialize)]
struct KeyReport {
    key: String,
    device: usize,
    /// Slab: the slot table entry's data length; files: the file's size (`null` if it is gone).
    size_bytes: Option<u64>,
    checksum: Status,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<String>,
}

#[derive(Serialize, Default)]
struct VerifyReport {
    keys: u64,
    /// Loaded without a problem: `verified` + `no_checksum`.
    ok: u64,
    /// Loaded, and the crc32c of what arrived matches the stored checksum.
    verified: u64,
    /// Files only: loaded, but without a checksum xattr to verify against.
    no_checksum: u64,
    /// The engine refused the block: its data does not match the stored crc32c.
    checksum_failures: u64,
    /// The engine returned the block but its crc32c differs from the slot table entry (slab)
    /// or the xattr (files with `checksums = false`).
    crc_mismatches: u64,
    /// Fewer bytes than a block arrived (a short file; the engine removed it).
    short: u64,
    /// The key is listed but the engine did not load it (slab: not recovered; files: removed
    /// since the scan).
    missing: u64,
    other_errors: u64,
    bytes: u64,
    seconds: f64,
    /// Where the key list came from.
    key_source: &'static str,
}

impl VerifyReport {
    fn new(checked: &[Checked], loads: &Loads, key_source: &'static str) -> VerifyReport {
        let mut report = VerifyReport {
            keys: checked.len() as u64,
            bytes: loads.bytes,
            seconds: loads.seconds,
            key_source,
            ..VerifyReport::default()
        };
        for c in checked {
            match c.status {
                Status::Verified => report.verified += 1,
                Status::NoChecksum => report.no_checksum += 1,
                Status::ChecksumMismatch => report.checksum_failures += 1,
                Status::CrcMismatch => report.crc_mismatches += 1,
                Status::Short => report.short += 1,
                Status::Missing => report.missing += 1,
                Status::Error => report.other_errors += 1,
                Status::NotVerified => {}
            }
        }
        report.ok = report.verified + report.no_checksum;
        report
    }

    fn bad(&self) -> u64 {
        self.checksum_failures + self.crc_mismatches + self.short + self.other_errors
    }
}

/// A key found in a slot table, with what its entry says about the data.
#[derive(Clone, Copy)]
struct Stored {
    seq: u64,
    data_len: u32,
    data_crc: u32,
    device: usize,
}

struct Scan {
    slot_count: u64,
    slot_bytes: u64,
    valid: u64,
    empty: u64,
    torn: u64,
    /// Valid entries the engine would clear at open: their keys route to another worker or
    /// device under this config (cores or the device list changed), or another block size.
    unroutable: u64,
    duplicates: u64,
}

/// What loading one key through the engine gave.
enum Loaded {
    /// The crc32c of the bytes its checksum covers.
    Ok {
        crc: u32,
    },
    Failed {
        reason: KeyFailure,
        detail: String,
    },
}

struct Loads {
    outcomes: Vec<Loaded>,
    bytes: u64,
    seconds: f64,
}

/// A key's verification result.
struct Checked {
    status: Status,
    detail: Option<String>,
}

impl Checked {
    fn status(status: Status) -> Checked {
        Checked {
            status,
            detail: None,
        }
    }

    fn failed(reason: KeyFailure, detail: &str) -> Checked {
        Checked {
            status: Status::of_failure(reason),
            detail: Some(if detail.is_empty() {
                reason.to_string()
            } else {
                format!("{reason}: {detail}")
            }),
        }
    }
}

pub fn run(args: &InspectArgs) -> CliResult<ExitCode> {
    let config = Config::from_file(&args.config)?;
    if config
        .devices
        .first()
        .is_some_and(|d| d.layout == Layout::Files)
    {
        run_files(args, config)
    } else {
        run_slab(args, config)
    }
}

/// Fails unless every device already holds a store for `config`: a slab device with a ready
/// header of the config's block size, a files device with its namespace directory. Nothing is
/// created or written. `command` names the caller in messages.
pub(crate) fn require_existing(config: &Config, command: &str) -> CliResult<()> {
    for (i, device) in config.devices.iter().enumerate() {
        if device.kind != kvtier::config::DeviceKind::Vfio && !device.path.exists() {
            return Err(CliError::usage(format!(
                "devices[{i}].path {} does not exist; {command} never creates devices",
                device.path.display()
            )));
        }
        match device.layout {
            Layout::Files => {
                files_data_dir(config, i)?;
            }
            Layout::Slab => {
                let file = open_read_only(device)
                    .map_err(|e| e.context(format!("devices[{i}] {}", device.path.display())))?;
                let buf = Region::allocate(slab::HEADER_BYTES as usize, HugePages::Off)
                    .map_err(|e| CliError::runtime(e.to_string()))?;
                read_geometry(&file, &buf, config.block_size)
                    .map_err(|e| e.context(format!("devices[{i}] {}", device.path.display())))?;
            }
        }
    }
    Ok(())
}

/// The data directory of files device `index`, which must exist.
fn files_data_dir(config: &Config, index: usize) -> CliResult<PathBuf> {
    let device = &config.devices[index];
    let files = config.files.as_ref().ok_or_else(|| {
        CliError::usage("layout = \"files\" needs a [files] section with [files.namespace]")
    })?;
    let data_dir = FileMapper::new(&device.path, &files.namespace).data_dir();
    if !data_dir.is_dir() {
        return Err(CliError::runtime(format!(
            "devices[{index}] {}: no namespace directory {} for this [files.namespace], so \
             nothing is stored under it (check model_name, dtype and the other namespace \
             fields); this command never creates one",
            device.path.display(),
            data_dir.display()
        )));
    }
    Ok(data_dir)
}

/// The end of every inspect report: the JSON document `value` (with the keys added) or the
/// text `text` (with the verification and the keys appended), then the exit code.
fn finish(
    args: &InspectArgs,
    mut value: serde_json::Value,
    mut text: String,
    key_reports: Option<&[KeyReport]>,
    verify: Option<&VerifyReport>,
) -> CliResult<ExitCode> {
    if args.json {
        if let Some(keys) = key_reports {
            value["keys"] = serde_json::json!(keys);
        }
        crate::output::write_json("-", &value)?;
    } else {
        text.push_str(&render_verify(verify));
        if let Some(keys) = key_reports {
            text.push_str(&render_keys(keys));
        }
        crate::output::Human::Stdout.print(&text);
    }
    Ok(exit(verify))
}

fn exit(verify: Option<&VerifyReport>) -> ExitCode {
    match verify {
        Some(v) if v.bad() > 0 => {
            eprintln!(
                "BAD BLOCKS: {} checksum failure(s), {} crc mismatch(es), {} short, {} other \
                 error(s)",
                v.checksum_failures, v.crc_mismatches, v.short, v.other_errors
            );
            ExitCode::from(1)
        }
        _ => ExitCode::SUCCESS,
    }
}
