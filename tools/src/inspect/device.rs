//! Inspecting a slab device read-only: its header, its slot table, and (with `--verify`)
//! every stored block loaded through an engine.

use super::{
    finish, render_slab, Checked, DeviceReport, InspectArgs, KeyReport, Loaded, Loads, Scan,
    Status, Stored, VerifyReport, FAILURES_LOGGED_MAX, TABLE_CHUNK_BYTES, VERIFY_DEPTH,
};
use crate::output;
use crate::output::{CliError, CliResult};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvtier::config::{DeviceConfig, DeviceKind};
use kvtier::key::KeyMap;
use kvtier::slab::{HeaderRead, HeaderState, Recovered};
use kvtier::{slab, Config, Engine, Key, KeyFailure};
use kvtier_sys::file::{DeviceFile, OpenOptions};
use kvtier_sys::mem::{HugePages, Region};
use serde_json::json;
use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;
pub(super) fn run_slab(args: &InspectArgs, mut config: Config) -> CliResult<ExitCode> {
    let (keys, scans) = scan_devices(&config)?;
    // Nothing below may create, grow or reformat a device.
    for device in &mut config.devices {
        // On a block device, a namespace or a VFIO controller it only bounds the slab.
        if device.path.is_file() {
            device.capacity_bytes = None;
        }
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
    let devices = device_reports(&scans, &info);
    let mut list: Vec<(Key, Stored)> = keys.iter().map(|(k, s)| (*k, *s)).collect();
    list.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    let (checked, verify) = if args.no_verify {
        let checked = list
            .iter()
            .map(|_| Checked::status(Status::NotVerified))
            .collect();
        (checked, None)
    } else {
        let (checked, verify) = verify_slots(&engine, &region, &config, &list)?;
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
    let value = json!({
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
    let text = render_slab(args, &config, &devices, &stats);
    finish(args, value, text, key_reports.as_deref(), verify.as_ref())
}

/// Reads every device's slot table (before the engine's open recovers and may clear entries).
fn scan_devices(config: &Config) -> CliResult<(KeyMap<Stored>, Vec<Scan>)> {
    let mut keys: KeyMap<Stored> = KeyMap::default();
    let mut scans = Vec::with_capacity(config.devices.len());
    // The engine's own recovery rule decides what is stored: it needs the worker count this
    // config opens with.
    let workers = config.cores.workers().len();
    for (i, device) in config.devices.iter().enumerate() {
        if device.kind != DeviceKind::Vfio && !device.path.exists() {
            return Err(CliError::usage(format!(
                "devices[{i}].path {} does not exist; inspect never creates devices",
                device.path.display()
            )));
        }
        let scan = scan_device(device, i, config.block_size, workers, &mut keys)
            .map_err(|e| e.context(format!("devices[{i}] {}", device.path.display())))?;
        scans.push(scan);
    }
    Ok((keys, scans))
}

fn device_reports(scans: &[Scan], info: &kvtier::EngineInfo) -> Vec<DeviceReport> {
    scans
        .iter()
        .zip(&info.devices)
        .map(|(scan, d)| {
            let stored = scan.valid - scan.duplicates - scan.unroutable;
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
                unroutable_entries: scan.unroutable,
                duplicate_entries: scan.duplicates,
            }
        })
        .collect()
}

/// Loads every stored key through the engine and checks it against its slot table entry.
fn verify_slots(
    engine: &Engine,
    region: &Region,
    config: &Config,
    list: &[(Key, Stored)],
) -> CliResult<(Vec<Checked>, VerifyReport)> {
    let block_len = config.block_size as usize;
    let targets: Vec<(Key, usize)> = list
        .iter()
        .map(|(k, s)| (*k, (s.data_len as usize).min(block_len)))
        .collect();
    let loads = load_all(engine, region, block_len, &targets)?;
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
    Ok((checked, verify))
}

/// A slab device opened for reading: a file or block device, an NVMe namespace read by
/// passthrough commands (`/dev/ngXnY` has no `read(2)`), or one read by the user-space driver
/// (`kind = "vfio"`).
pub(super) enum SlabReader {
    File(DeviceFile),
    Nvme(kvtier_sys::nvme::Namespace),
    Vfio(Box<kvtier::vfio::SyncDevice>),
}

impl SlabReader {
    pub(super) fn read_exact_at(
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
            SlabReader::Vfio(dev) => dev
                .read_sync(offset, buf, at, len)
                .map_err(|e| e.to_string()),
        }
    }
}

pub(super) fn open_read_only(device: &DeviceConfig) -> CliResult<SlabReader> {
    if device.kind == DeviceKind::Vfio {
        return kvtier::vfio::SyncDevice::open(device)
            .map(|d| SlabReader::Vfio(Box::new(d)))
            .map_err(|e| CliError::runtime(format!("open: {e}")));
    }
    let path = device.path.as_path();
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
pub(super) fn read_geometry(
    file: &SlabReader,
    buf: &Region,
    block_bytes: u64,
) -> CliResult<slab::Geometry> {
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

/// Reads the header and the whole slot table of one device, read-only and buffered, and
/// classifies each entry by the engine's recovery rule ([`slab::recover_entry`]).
pub(super) fn scan_device(
    device_cfg: &DeviceConfig,
    device: usize,
    block_bytes: u64,
    workers: usize,
    keys: &mut KeyMap<Stored>,
) -> CliResult<Scan> {
    let file = open_read_only(device_cfg)?;
    let buf = Region::allocate(TABLE_CHUNK_BYTES, HugePages::Off)
        .map_err(|e| CliError::runtime(e.to_string()))?;
    let geometry = read_geometry(&file, &buf, block_bytes)?;
    let mut scan = Scan {
        slot_count: geometry.slot_count,
        slot_bytes: geometry.slot_bytes,
        valid: 0,
        empty: 0,
        torn: 0,
        unroutable: 0,
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
        let first_slot = at / slab::ENTRY_BYTES as u64;
        buf.with_bytes(0, len, |raw| {
            for (i, entry) in raw.chunks_exact(slab::ENTRY_BYTES).enumerate() {
                let worker = geometry.worker_of(first_slot + i as u64, workers);
                let verdict = slab::recover_entry(entry, worker, workers, block_bytes);
                match verdict {
                    Recovered::Empty => scan.empty += 1,
                    Recovered::Torn => scan.torn += 1,
                    Recovered::Unroutable(_) => {
                        scan.valid += 1;
                        scan.unroutable += 1;
                    }
                    Recovered::Kept(e) => {
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
pub(super) fn load_all(
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
    let mut outcomes: Vec<Option<Loaded>> = (0..targets.len()).map(|_| None).collect();
    let mut bytes = 0u64;
    let mut failures_logged = 0u64;
    let keys: Vec<Key> = targets.iter().map(|(k, _)| *k).collect();
    let blocks: Vec<u32> = (0..VERIFY_DEPTH).collect();
    let seconds = crate::jobs::run_each(
        engine,
        kvtier::JobKind::Load,
        &keys,
        &blocks,
        None,
        |_, _| {},
        |index, block, r| {
            let (key, len) = &targets[index];
            outcomes[index] = Some(if r.success {
                bytes += r.bytes;
                let crc =
                    region.with_bytes(block as usize * block_bytes, *len, kvtier::checksum::crc32c);
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
            bar.inc(1);
            Ok(())
        },
    )
    .map_err(|e| e.context("verifying"))?;
    bar.finish_and_clear();
    let outcomes = outcomes
        .into_iter()
        .map(|o| o.expect("every key's load finished"))
        .collect();
    Ok(Loads {
        outcomes,
        bytes,
        seconds,
    })
}
