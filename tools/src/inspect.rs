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

use std::ffi::CString;
use std::io::IsTerminal;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvtier::config::Layout;
use kvtier::files::device::CHECKSUM_XATTR;
use kvtier::files::mapper::FileMapper;
use kvtier::key::KeyMap;
use kvtier::slab::{self, EntryRead, HeaderRead, HeaderState};
use kvtier::{Config, Engine, Job, Key, KeyFailure};
use kvtier_sys::file::{DeviceFile, OpenOptions};
use kvtier_sys::mem::{HugePages, Region};
use serde::{Serialize, Serializer};
use serde_json::json;

use crate::output::{self, CliError, CliResult, Human, Table};

/// Region blocks, and so loads in flight, while verifying.
const VERIFY_DEPTH: u32 = 16;
/// Slot table bytes read per call (a multiple of the 4 KiB table page).
const TABLE_CHUNK_BYTES: usize = 1 << 20;
/// How long one wait for results may block.
const WAIT: Duration = Duration::from_millis(5);
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
    /// Distinct keys with a valid entry (the newest entry of a key counts).
    blocks_stored: u64,
    free_slots: u64,
    valid_entries: u64,
    empty_entries: u64,
    torn_entries: u64,
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
        if !device.path.exists() {
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
                let file = open_read_only(&device.path)
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

#[allow(clippy::too_many_lines)] // to be split with the one job driver the CLI commands will share
fn run_slab(args: &InspectArgs, mut config: Config) -> CliResult<ExitCode> {
    let mut keys: KeyMap<Stored> = KeyMap::default();
    let mut scans = Vec::with_capacity(config.devices.len());
    for (i, device) in config.devices.iter().enumerate() {
        if !device.path.exists() {
            return Err(CliError::usage(format!(
                "devices[{i}].path {} does not exist; inspect never creates devices",
                device.path.display()
            )));
        }
        let scan = scan_device(&device.path, i, config.block_size, &mut keys)
            .map_err(|e| e.context(format!("devices[{i}] {}", device.path.display())))?;
        scans.push(scan);
    }
    // Nothing below may create, grow or reformat a device.
    for device in &mut config.devices {
        device.capacity_bytes = None;
        device.overwrite = false;
    }
    config.region_blocks = u64::from(VERIFY_DEPTH);
    config.validate()?;
    tracing::debug!(
        "opening the engine runs recovery: torn entries and entries the configured cores and \
         devices do not route to are cleared on the device"
    );
    let region = kvtier::region::allocate(&config)?;
    let engine = Engine::open(&config, Arc::clone(&region))?;
    let info = engine.info().clone();
    let stats = engine.stats();
    let devices: Vec<DeviceReport> = scans
        .iter()
        .zip(&info.devices)
        .map(|(scan, d)| {
            let stored = scan.valid - scan.duplicates;
            DeviceReport {
                path: d.path.clone(),
                kind: d.kind,
                direct: d.direct,
                size_bytes: d.size_bytes,
                slot_count: scan.slot_count,
                slot_bytes: scan.slot_bytes,
                blocks_stored: stored,
                free_slots: scan.slot_count - stored,
                valid_entries: scan.valid,
                empty_entries: scan.empty,
                torn_entries: scan.torn,
                duplicate_entries: scan.duplicates,
            }
        })
        .collect();
    let mut list: Vec<(Key, Stored)> = keys.iter().map(|(k, s)| (*k, *s)).collect();
    list.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    let block_len = config.block_size as usize;
    let (checked, verify) = if args.no_verify {
        let checked = list
            .iter()
            .map(|_| Checked::status(Status::NotVerified))
            .collect();
        (checked, None)
    } else {
        let targets: Vec<(Key, usize)> = list
            .iter()
            .map(|(k, s)| (*k, (s.data_len as usize).min(block_len)))
            .collect();
        let loads = load_all(&engine, &region, block_len, &targets)?;
        let checked: Vec<Checked> = list
            .iter()
            .zip(&loads.outcomes)
            .map(|((key, stored), loaded)| match loaded {
                Loaded::Ok { crc } if *crc == stored.data_crc => Checked::status(Status::Verified),
                Loaded::Ok { crc } => {
                    tracing::error!(
                        key = %key.to_hex(),
                        "loaded block's crc32c differs from its slot table entry"
                    );
                    Checked {
                        status: Status::CrcMismatch,
                        detail: Some(format!(
                            "slot table crc {:08x}, loaded {crc:08x}",
                            stored.data_crc
                        )),
                    }
                }
                Loaded::Failed { reason, detail } => Checked::failed(*reason, detail),
            })
            .collect();
        let verify = VerifyReport::new(&checked, &loads, "slot tables read from the devices");
        (checked, Some(verify))
    };
    engine.shutdown();
    drop(engine);
    let key_reports: Option<Vec<KeyReport>> = args.keys.then(|| {
        list.iter()
            .zip(checked)
            .map(|((key, stored), c)| KeyReport {
                key: key.to_hex(),
                device: stored.device,
                size_bytes: Some(u64::from(stored.data_len)),
                checksum: c.status,
                detail: c.detail,
            })
            .collect()
    });

    if args.json {
        let mut value = json!({
            "config": args.config.display().to_string(),
            "layout": "slab",
            "block_size": config.block_size,
            "devices": devices,
            "engine": {
                "blocks_stored": stats.blocks_stored,
                "slots_total": stats.slots_total,
                "recovered_blocks": stats.recovered_blocks,
                "torn_entries": stats.torn_entries,
                "workers": info.workers.len(),
                "open_seconds": info.open_seconds,
            },
            "verify": verify,
        });
        if let Some(keys) = &key_reports {
            value["keys"] = json!(keys);
        }
        output::write_json("-", &value)?;
    } else {
        let mut text = render_slab(args, &config, &devices, &stats);
        text.push_str(&render_verify(verify.as_ref()));
        if let Some(keys) = &key_reports {
            text.push_str(&render_keys(keys));
        }
        Human::Stdout.print(&text);
    }
    Ok(exit(verify.as_ref()))
}

#[allow(clippy::too_many_lines)] // to be split with the one job driver the CLI commands will share
fn run_files(args: &InspectArgs, mut config: Config) -> CliResult<ExitCode> {
    require_existing(&config, "inspect")?;
    let namespace = config
        .files
        .as_ref()
        .map(|f| f.namespace.clone())
        .ok_or_else(|| CliError::usage("layout = \"files\" needs a [files] section"))?;
    for device in &mut config.devices {
        device.overwrite = false;
    }
    config.region_blocks = u64::from(VERIFY_DEPTH);
    config.validate()?;
    let region = kvtier::region::allocate(&config)?;
    let engine = Engine::open(&config, Arc::clone(&region))?;
    let info = engine.info().clone();
    let devices: Vec<FilesDeviceReport> = config
        .devices
        .iter()
        .zip(&info.devices)
        .map(|(cfg, d)| {
            let scan = d.files.clone().unwrap_or_default();
            FilesDeviceReport {
                path: cfg.path.clone(),
                data_dir: d.path.clone(),
                kind: d.kind,
                direct: d.direct,
                blocks: scan.blocks,
                bytes: scan.bytes,
                wrong_size_files: scan.wrong_size,
                temps_removed: scan.temps_removed,
                temps_kept: scan.temps_kept,
                usage_reset: scan.usage_reset,
                capacity_bytes: cfg.capacity_bytes,
                slot_count: d.geometry.slot_count,
            }
        })
        .collect();
    let mappers: Vec<FileMapper> = config
        .devices
        .iter()
        .map(|d| FileMapper::new(&d.path, &namespace))
        .collect();
    let mut keys = engine.keys();
    keys.sort_unstable_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
    // Where each key's file is and its size, taken before loading: a bad file is removed.
    let files: Vec<(usize, Option<PathBuf>, Option<u64>)> = keys
        .iter()
        .map(|key| {
            let device = key.device(mappers.len());
            let path = mappers[device].key_path(key.as_bytes());
            let size = path
                .as_ref()
                .and_then(|p| std::fs::symlink_metadata(p).ok())
                .filter(std::fs::Metadata::is_file)
                .map(|m| m.len());
            (device, path, size)
        })
        .collect();
    let block_len = config.block_size as usize;
    let (checked, verify) = if args.no_verify {
        let checked = keys
            .iter()
            .map(|_| Checked::status(Status::NotVerified))
            .collect();
        (checked, None)
    } else {
        let targets: Vec<(Key, usize)> = keys.iter().map(|k| (*k, block_len)).collect();
        let loads = load_all(&engine, &region, block_len, &targets)?;
        let xattr = CString::new(CHECKSUM_XATTR)
            .map_err(|e| CliError::runtime(format!("xattr name: {e}")))?;
        let checked: Vec<Checked> = loads
            .outcomes
            .iter()
            .zip(&files)
            .zip(&keys)
            .map(|((loaded, (_, path, _)), key)| match (loaded, path) {
                (Loaded::Ok { crc }, Some(path)) => check_xattr(key, path, &xattr, *crc),
                (Loaded::Ok { .. }, None) => Checked {
                    status: Status::Error,
                    detail: Some("not a vLLM-shaped key: it has no file path".into()),
                },
                (Loaded::Failed { reason, detail }, _) => Checked::failed(*reason, detail),
            })
            .collect();
        let verify = VerifyReport::new(&checked, &loads, "Engine::keys (the directory scan)");
        (checked, Some(verify))
    };
    let stats = engine.stats();
    engine.shutdown();
    drop(engine);
    let key_reports: Option<Vec<KeyReport>> = args.keys.then(|| {
        keys.iter()
            .zip(&files)
            .zip(checked)
            .map(|((key, (device, _, size)), c)| KeyReport {
                key: key.to_hex(),
                device: *device,
                size_bytes: *size,
                checksum: c.status,
                detail: c.detail,
            })
            .collect()
    });

    if args.json {
        let mut value = json!({
            "config": args.config.display().to_string(),
            "layout": "files",
            "block_size": config.block_size,
            "devices": devices,
            "engine": {
                "blocks_indexed": keys.len(),
                "checksum_failures": stats.checksum_failures,
                "io_errors": stats.io_errors,
                "workers": info.workers.len(),
                "open_seconds": info.open_seconds,
            },
            "verify": verify,
        });
        if let Some(keys) = &key_reports {
            value["keys"] = json!(keys);
        }
        output::write_json("-", &value)?;
    } else {
        let mut text = render_files(args, &config, &devices, keys.len());
        text.push_str(&render_verify(verify.as_ref()));
        if let Some(keys) = &key_reports {
            text.push_str(&render_keys(keys));
        }
        Human::Stdout.print(&text);
    }
    Ok(exit(verify.as_ref()))
}

/// Compares a loaded block's crc32c with its file's xattr, if it has one.
fn check_xattr(key: &Key, path: &Path, name: &CString, crc: u32) -> Checked {
    // Never through a symlink, never blocking on a FIFO planted at the path.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(path);
    let file = match file {
        Ok(f) => f,
        Err(e) => {
            return Checked {
                status: Status::Error,
                detail: Some(format!("reopening {} for its xattr: {e}", path.display())),
            }
        }
    };
    let mut buf = [0u8; 4];
    match kvtier_sys::file::fgetxattr(file.as_raw_fd(), name, &mut buf) {
        Ok(Some(4)) => {
            let want = u32::from_le_bytes(buf);
            if want == crc {
                Checked::status(Status::Verified)
            } else {
                tracing::error!(
                    key = %key.to_hex(),
                    "loaded block's crc32c differs from its file's xattr (checksums off?)"
                );
                Checked {
                    status: Status::CrcMismatch,
                    detail: Some(format!("xattr crc {want:08x}, loaded {crc:08x}")),
                }
            }
        }
        Ok(Some(n)) => Checked {
            status: Status::Error,
            detail: Some(format!("{CHECKSUM_XATTR} holds {n} bytes, not 4")),
        },
        Ok(None) => Checked::status(Status::NoChecksum),
        Err(e) if e == kvtier::Errno::ENOTSUP => Checked::status(Status::NoChecksum),
        Err(e) => Checked {
            status: Status::Error,
            detail: Some(format!("reading {CHECKSUM_XATTR}: {}", e.desc())),
        },
    }
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

/// A slab device opened for reading: a file or block device, or an NVMe namespace read by
/// passthrough commands (`/dev/ngXnY` has no `read(2)`).
enum SlabReader {
    File(DeviceFile),
    Nvme(kvtier_sys::nvme::Namespace),
}

impl SlabReader {
    fn read_exact_at(
        &self,
        offset: u64,
        buf: &Region,
        at: usize,
        len: usize,
    ) -> Result<(), String> {
        match self {
            SlabReader::File(f) => f
                .read_exact_at(offset, buf, at, len)
                .map_err(|e| format!("{} ({e})", e.desc())),
            SlabReader::Nvme(ns) => ns
                .read_sync(offset, buf, at, len)
                .map_err(|e| e.to_string()),
        }
    }
}

fn open_read_only(path: &Path) -> CliResult<SlabReader> {
    if kvtier_sys::nvme::generic_name(path).is_some() {
        return kvtier_sys::nvme::Namespace::open_read_only(path)
            .map(SlabReader::Nvme)
            .map_err(|e| CliError::runtime(format!("open: {e}")));
    }
    let opts = OpenOptions {
        read_only: true,
        ..OpenOptions::default()
    };
    DeviceFile::open(path, opts)
        .map(SlabReader::File)
        .map_err(|e| CliError::runtime(format!("open: {} ({e})", e.desc())))
}

/// Reads a slab device's header into `buf` and returns its geometry if it holds a ready store
/// of `block_bytes` blocks.
fn read_geometry(file: &SlabReader, buf: &Region, block_bytes: u64) -> CliResult<slab::Geometry> {
    let header_bytes = slab::HEADER_BYTES as usize;
    file.read_exact_at(0, buf, 0, header_bytes)
        .map_err(|e| CliError::runtime(format!("reading the header: {e}")))?;
    let header = buf.with_bytes(0, header_bytes, slab::Header::decode);
    let geometry =
        match header {
            HeaderRead::Valid(h) if h.state == HeaderState::Ready => h.geometry,
            HeaderRead::Valid(_) => return Err(CliError::runtime(
                "its format was interrupted (header still says \"formatting\"): it holds no blocks",
            )),
            HeaderRead::Empty => {
                return Err(CliError::runtime(
                    "holds no kvtier store (never formatted); this command never formats",
                ))
            }
            HeaderRead::Foreign(why) => return Err(CliError::runtime(why)),
        };
    if geometry.block_bytes != block_bytes {
        return Err(CliError::usage(format!(
            "formatted for block_size {} but the config says {}: set block_size = \"{}\"",
            geometry.block_bytes,
            block_bytes,
            output::size(geometry.block_bytes)
        )));
    }
    Ok(geometry)
}

/// Reads the header and the whole slot table of one device, read-only and buffered.
fn scan_device(
    path: &Path,
    device: usize,
    block_bytes: u64,
    keys: &mut KeyMap<Stored>,
) -> CliResult<Scan> {
    let file = open_read_only(path)?;
    let buf = Region::allocate(TABLE_CHUNK_BYTES, HugePages::Off)
        .map_err(|e| CliError::runtime(e.to_string()))?;
    let geometry = read_geometry(&file, &buf, block_bytes)?;
    let mut scan = Scan {
        slot_count: geometry.slot_count,
        slot_bytes: geometry.slot_bytes,
        valid: 0,
        empty: 0,
        torn: 0,
        duplicates: 0,
    };
    let table_bytes = geometry.slot_count * slab::ENTRY_BYTES as u64;
    let mut at = 0u64;
    while at < table_bytes {
        let len = (table_bytes - at).min(TABLE_CHUNK_BYTES as u64) as usize;
        // Whole 4 KiB pages: the table is page-padded on the device.
        let read_len = len.next_multiple_of(slab::TABLE_PAGE_BYTES);
        file.read_exact_at(geometry.table_offset + at, &buf, 0, read_len)
            .map_err(|e| CliError::runtime(format!("reading the slot table: {e}")))?;
        buf.with_bytes(0, len, |raw| {
            for entry in raw.chunks_exact(slab::ENTRY_BYTES) {
                match slab::Entry::decode(entry) {
                    EntryRead::Empty => scan.empty += 1,
                    EntryRead::Torn => scan.torn += 1,
                    EntryRead::Valid(e) => {
                        scan.valid += 1;
                        let new = Stored {
                            seq: e.seq,
                            data_len: e.data_len,
                            data_crc: e.data_crc,
                            device,
                        };
                        match keys.get_mut(&e.key) {
                            Some(old) => {
                                scan.duplicates += 1;
                                if new.seq > old.seq {
                                    *old = new;
                                }
                            }
                            None => {
                                keys.insert(e.key, new);
                            }
                        }
                    }
                }
            }
        });
        at += len as u64;
    }
    Ok(scan)
}

/// Loads every key through the engine, `VERIFY_DEPTH` at a time; for each one that arrives,
/// the crc32c of its first `len` bytes (`targets` holds `(key, len)`).
fn load_all(
    engine: &Engine,
    region: &Region,
    block_bytes: usize,
    targets: &[(Key, usize)],
) -> CliResult<Loads> {
    let bar = if std::io::stderr().is_terminal() {
        let bar =
            ProgressBar::with_draw_target(Some(targets.len() as u64), ProgressDrawTarget::stderr());
        if let Ok(style) = ProgressStyle::with_template("    verify [{bar:30}] {pos}/{len} {eta}") {
            bar.set_style(style.progress_chars("=> "));
        }
        bar
    } else {
        ProgressBar::hidden()
    };
    let start = Instant::now();
    let mut outcomes: Vec<Option<Loaded>> = (0..targets.len()).map(|_| None).collect();
    let mut bytes = 0u64;
    let mut failures_logged = 0u64;
    let mut free: Vec<u32> = (0..VERIFY_DEPTH).rev().collect();
    let mut in_flight: Vec<Option<usize>> = vec![None; VERIFY_DEPTH as usize];
    let mut outstanding = 0usize;
    let mut next = 0usize;
    let mut results = Vec::with_capacity(VERIFY_DEPTH as usize);
    while next < targets.len() || outstanding > 0 {
        while next < targets.len() {
            let Some(block) = free.pop() else { break };
            let id = ((next as u64) << 32) | u64::from(block);
            match engine.submit_load(Job::new(id, vec![targets[next].0], vec![block])) {
                Ok(()) => {
                    in_flight[block as usize] = Some(next);
                    next += 1;
                    outstanding += 1;
                }
                Err(kvtier::Error::Backpressure(_)) => {
                    free.push(block);
                    break;
                }
                Err(e) => return Err(CliError::from(e).context("submitting a load")),
            }
        }
        engine.wait_finished(&mut results, WAIT);
        for r in results.drain(..) {
            let block = (r.id & u64::from(u32::MAX)) as u32;
            let index = in_flight[block as usize]
                .take()
                .expect("each result is for a load in flight on its block");
            outstanding -= 1;
            let (key, len) = &targets[index];
            outcomes[index] = Some(if r.success {
                bytes += r.bytes;
                let crc = region.with_bytes(block as usize * block_bytes, *len, crc32c::crc32c);
                Loaded::Ok { crc }
            } else {
                let (reason, detail) = r.failure().map_or_else(
                    || (KeyFailure::InvalidJob, "no failure reported".to_owned()),
                    |f| (f.reason, f.detail.clone()),
                );
                if reason != KeyFailure::Miss && failures_logged < FAILURES_LOGGED_MAX {
                    failures_logged += 1;
                    tracing::error!(key = %key.to_hex(), %reason, %detail, "load failed");
                }
                Loaded::Failed { reason, detail }
            });
            free.push(block);
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    let outcomes = outcomes
        .into_iter()
        .map(|o| o.expect("every key's load finished"))
        .collect();
    Ok(Loads {
        outcomes,
        bytes,
        seconds: start.elapsed().as_secs_f64(),
    })
}

fn render_slab(
    args: &InspectArgs,
    config: &Config,
    devices: &[DeviceReport],
    stats: &kvtier::Stats,
) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "config: {} (slab layout, block_size {})",
        args.config.display(),
        output::size(config.block_size)
    );
    for (i, d) in devices.iter().enumerate() {
        let _ = writeln!(
            s,
            "device {i}: {} ({}, {}, {})",
            d.path.display(),
            d.kind,
            if d.direct { "O_DIRECT" } else { "buffered" },
            output::size(d.size_bytes)
        );
        let _ = writeln!(
            s,
            "  {} slots of {}: {} blocks stored, {} free; entries: {} valid, {} empty, {} torn, \
             {} duplicate",
            d.slot_count,
            output::size(d.slot_bytes),
            d.blocks_stored,
            d.free_slots,
            d.valid_entries,
            d.empty_entries,
            d.torn_entries,
            d.duplicate_entries
        );
    }
    let _ = writeln!(
        s,
        "engine after recovery: {} blocks stored of {} slots, {} recovered, {} torn entries \
         cleared",
        stats.blocks_stored, stats.slots_total, stats.recovered_blocks, stats.torn_entries
    );
    s
}

fn render_files(
    args: &InspectArgs,
    config: &Config,
    devices: &[FilesDeviceReport],
    indexed: usize,
) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "config: {} (files layout, block_size {})",
        args.config.display(),
        output::size(config.block_size)
    );
    for (i, d) in devices.iter().enumerate() {
        let _ = writeln!(
            s,
            "device {i}: {} ({}, {})",
            d.data_dir.display(),
            d.kind,
            if d.direct { "O_DIRECT" } else { "buffered" },
        );
        let bound = match d.capacity_bytes {
            Some(cap) => format!(
                "{} of {} capacity ({:.1} %)",
                output::size(d.bytes),
                output::size(cap),
                d.bytes as f64 * 100.0 / cap.max(1) as f64
            ),
            None => format!("{} used, no capacity bound", output::size(d.bytes)),
        };
        let _ = writeln!(
            s,
            "  {} blocks, {bound}; {} wrong-size files (never served); temp files: {} removed \
             (stale), {} kept (younger than temp_grace_secs){}",
            d.blocks,
            d.wrong_size_files,
            d.temps_removed,
            d.temps_kept,
            if d.usage_reset {
                "; alone on the directory: usage counter reset"
            } else {
                ""
            }
        );
    }
    let _ = writeln!(s, "engine: {indexed} blocks indexed");
    s
}

fn render_verify(verify: Option<&VerifyReport>) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    match verify {
        None => s.push_str("verify: skipped (--no-verify)\n"),
        Some(v) => {
            let rate = if v.seconds > 0.0 {
                output::gib(v.bytes) / v.seconds
            } else {
                0.0
            };
            let _ = writeln!(
                s,
                "verify: {} keys: {} verified, {} without checksum, {} checksum failures, {} crc \
                 mismatches, {} short, {} missing, {} other errors ({:.2} s, {:.2} GiB/s)",
                v.keys,
                v.verified,
                v.no_checksum,
                v.checksum_failures,
                v.crc_mismatches,
                v.short,
                v.missing,
                v.other_errors,
                v.seconds,
                rate
            );
            if v.no_checksum > 0 {
                s.push_str(
                    "  without checksum: files with no crc32c xattr (written by vLLM, or where \
                     user xattrs are refused): loaded, nothing to verify against\n",
                );
            }
            if v.missing > 0 {
                s.push_str(
                    "  missing: listed but not loaded (slab: written with other cores or \
                     devices, or an older duplicate; files: removed since the scan)\n",
                );
            }
            if v.checksum_failures + v.short > 0 {
                s.push_str(
                    "  checksum failures and short blocks are dropped by the engine (a files \
                     block's file is removed)\n",
                );
            }
        }
    }
    s
}

fn render_keys(keys: &[KeyReport]) -> String {
    let mut table = Table::new(&["key", "device", "size", "checksum"]);
    for k in keys {
        table.row(vec![
            k.key.clone(),
            k.device.to_string(),
            k.size_bytes.map_or_else(|| "-".into(), output::size),
            k.checksum.as_str().to_owned(),
        ]);
    }
    format!("keys:\n{table}")
}
