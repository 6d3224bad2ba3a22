//! `kvtier inspect`: what the configured slab devices hold, and whether every stored block
//! still matches its checksum.
//!
//! Two views are reported. First the on-device view, read directly from each device's header
//! and slot table before the engine opens it (valid, empty, torn and duplicate entries); then
//! the engine's view after recovery (`Engine::stats`). Verification loads every key found in
//! the slot tables through the engine (which checks the crc32c of recovered blocks on their
//! first load) and checks the crc32c of what arrived against the table entry once more.
//!
//! Invariants: inspect never creates, grows or formats a device — devices must exist, hold a
//! ready kvtier header with the config's block size, and are opened with `overwrite = false`
//! and no `capacity_bytes`. Caveat: opening the engine runs its recovery, which clears torn
//! entries and entries that the configured cores and devices no longer route to, so inspect
//! with the `cores` the store was written with (a read-only open is not in the library yet).

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvtier::config::Layout;
use kvtier::key::KeyMap;
use kvtier::slab::{self, EntryRead, HeaderRead, HeaderState};
use kvtier::{Config, Engine, Job, Key, KeyFailure};
use kvtier_sys::file::{DeviceFile, OpenOptions};
use kvtier_sys::mem::{HugePages, Region};
use serde::Serialize;
use serde_json::json;

use crate::output::{self, CliError, CliResult, Human};

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
}

/// What one device's slot table holds, read before the engine opens it.
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

#[derive(Serialize, Default)]
struct VerifyReport {
    keys: u64,
    ok: u64,
    /// The engine refused the block: its data does not match the stored crc32c.
    checksum_failures: u64,
    /// The engine returned the block but its crc32c differs from the slot table entry.
    crc_mismatches: u64,
    /// The key is in a slot table but the engine did not recover it.
    missing: u64,
    other_errors: u64,
    bytes: u64,
    seconds: f64,
    /// Where the key list came from.
    key_source: &'static str,
}

impl VerifyReport {
    fn bad(&self) -> u64 {
        self.checksum_failures + self.crc_mismatches + self.other_errors
    }
}

/// A key found in a slot table, with what its entry says about the data.
#[derive(Clone, Copy)]
struct Stored {
    seq: u64,
    data_len: u32,
    data_crc: u32,
}

struct Scan {
    slot_count: u64,
    slot_bytes: u64,
    valid: u64,
    empty: u64,
    torn: u64,
    duplicates: u64,
}

pub fn run(args: &InspectArgs) -> CliResult<ExitCode> {
    let mut config = Config::from_file(&args.config)?;
    let mut keys: KeyMap<Stored> = KeyMap::default();
    let mut scans = Vec::with_capacity(config.devices.len());
    for (i, device) in config.devices.iter().enumerate() {
        if device.layout != Layout::Slab {
            return Err(CliError::usage(format!(
                "devices[{i}] ({}): inspect reads slab devices only",
                device.path.display()
            )));
        }
        if !device.path.exists() {
            return Err(CliError::usage(format!(
                "devices[{i}].path {} does not exist; inspect never creates devices",
                device.path.display()
            )));
        }
        let scan = scan_device(&device.path, config.block_size, &mut keys)
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
    let verify = if args.no_verify {
        None
    } else {
        Some(verify(&engine, &region, config.block_size, &keys)?)
    };
    engine.shutdown();
    drop(engine);

    if args.json {
        let value = json!({
            "config": args.config.display().to_string(),
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
        output::write_json("-", &value)?;
    } else {
        Human::Stdout.print(&render(args, &config, &devices, &stats, verify.as_ref()));
    }
    match verify {
        Some(v) if v.bad() > 0 => {
            eprintln!(
                "BAD BLOCKS: {} checksum failure(s), {} crc mismatch(es), {} other error(s)",
                v.checksum_failures, v.crc_mismatches, v.other_errors
            );
            Ok(ExitCode::from(1))
        }
        _ => Ok(ExitCode::SUCCESS),
    }
}

/// Reads the header and the whole slot table of one device, read-only and buffered.
fn scan_device(path: &Path, block_bytes: u64, keys: &mut KeyMap<Stored>) -> CliResult<Scan> {
    let opts = OpenOptions {
        read_only: true,
        ..OpenOptions::default()
    };
    let file = DeviceFile::open(path, opts)
        .map_err(|e| CliError::runtime(format!("open: {} ({e})", e.desc())))?;
    let buf = Region::allocate(TABLE_CHUNK_BYTES, HugePages::Off)
        .map_err(|e| CliError::runtime(e.to_string()))?;
    let header_bytes = slab::HEADER_BYTES as usize;
    file.read_exact_at(0, &buf, 0, header_bytes)
        .map_err(|e| CliError::runtime(format!("reading the header: {} ({e})", e.desc())))?;
    let header = buf.with_bytes(0, header_bytes, slab::Header::decode);
    let geometry =
        match header {
            HeaderRead::Valid(h) if h.state == HeaderState::Ready => h.geometry,
            HeaderRead::Valid(_) => return Err(CliError::runtime(
                "its format was interrupted (header still says \"formatting\"): it holds no blocks",
            )),
            HeaderRead::Empty => {
                return Err(CliError::runtime(
                    "holds no kvtier store (never formatted); inspect never formats",
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
            .map_err(|e| {
                CliError::runtime(format!("reading the slot table: {} ({e})", e.desc()))
            })?;
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

/// Loads every key through the engine, `VERIFY_DEPTH` at a time, and checks what arrives.
fn verify(
    engine: &Engine,
    region: &Region,
    block_bytes: u64,
    keys: &KeyMap<Stored>,
) -> CliResult<VerifyReport> {
    let list: Vec<(Key, Stored)> = keys.iter().map(|(k, s)| (*k, *s)).collect();
    let block_len = block_bytes as usize;
    let mut report = VerifyReport {
        keys: list.len() as u64,
        key_source: "slot tables read from the devices (no Engine::keys yet)",
        ..VerifyReport::default()
    };
    let bar = if std::io::stderr().is_terminal() {
        let bar =
            ProgressBar::with_draw_target(Some(list.len() as u64), ProgressDrawTarget::stderr());
        if let Ok(style) = ProgressStyle::with_template("    verify [{bar:30}] {pos}/{len} {eta}") {
            bar.set_style(style.progress_chars("=> "));
        }
        bar
    } else {
        ProgressBar::hidden()
    };
    let start = Instant::now();
    let mut free: Vec<u32> = (0..VERIFY_DEPTH).rev().collect();
    let mut in_flight: Vec<Option<usize>> = vec![None; VERIFY_DEPTH as usize];
    let mut outstanding = 0usize;
    let mut next = 0usize;
    let mut results = Vec::with_capacity(VERIFY_DEPTH as usize);
    while next < list.len() || outstanding > 0 {
        while next < list.len() {
            let Some(block) = free.pop() else { break };
            let id = ((next as u64) << 32) | u64::from(block);
            match engine.submit_load(Job::new(id, vec![list[next].0], vec![block])) {
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
            let (key, stored) = &list[index];
            if r.success {
                report.bytes += r.bytes;
                let len = (stored.data_len as usize).min(block_len);
                let crc = region.with_bytes(block as usize * block_len, len, crc32c::crc32c);
                if crc == stored.data_crc {
                    report.ok += 1;
                } else {
                    report.crc_mismatches += 1;
                    tracing::error!(key = %key.to_hex(), "loaded block's crc32c differs from its slot table entry");
                }
            } else {
                let failure = r.failure.as_ref();
                let reason = failure.map(|f| f.reason);
                match reason {
                    Some(KeyFailure::Checksum) => report.checksum_failures += 1,
                    Some(KeyFailure::Miss) => report.missing += 1,
                    _ => report.other_errors += 1,
                }
                if reason != Some(KeyFailure::Miss)
                    && report.checksum_failures + report.other_errors <= FAILURES_LOGGED_MAX
                {
                    tracing::error!(
                        key = %key.to_hex(),
                        reason = reason.map_or_else(|| "unknown".into(), |r| r.to_string()),
                        detail = failure.map_or("", |f| f.detail.as_str()),
                        "load failed"
                    );
                }
            }
            free.push(block);
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    report.seconds = start.elapsed().as_secs_f64();
    Ok(report)
}

fn render(
    args: &InspectArgs,
    config: &Config,
    devices: &[DeviceReport],
    stats: &kvtier::Stats,
    verify: Option<&VerifyReport>,
) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "config: {} (block_size {})",
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
                "verify: {} keys: {} ok, {} checksum failures, {} crc mismatches, {} missing, \
                 {} other errors ({:.2} s, {:.2} GiB/s)",
                v.keys,
                v.ok,
                v.checksum_failures,
                v.crc_mismatches,
                v.missing,
                v.other_errors,
                v.seconds,
                rate
            );
            if v.missing > 0 {
                s.push_str(
                    "  missing: in a slot table but not recovered by the engine (written with \
                     other cores or devices, or an older duplicate)\n",
                );
            }
        }
    }
    s
}
