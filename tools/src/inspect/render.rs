//! The human-readable report of `kvtier inspect`.

use super::{DeviceReport, FilesDeviceReport, InspectArgs, KeyReport, VerifyReport};
use crate::output;
use crate::output::Table;
use kvtier::Config;
pub(super) fn render_slab(
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
             {} unroutable, {} duplicate",
            d.slot_count,
            output::size(d.slot_bytes),
            d.blocks_stored,
            d.free_slots,
            d.valid_entries,
            d.empty_entries,
            d.torn_entries,
            d.unroutable_entries,
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

pub(super) fn render_files(
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

pub(super) fn render_verify(verify: Option<&VerifyReport>) -> String {
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

pub(super) fn render_keys(keys: &[KeyReport]) -> String {
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
