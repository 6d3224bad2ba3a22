//! Inspecting a files-layout directory: the scan, and (with `--verify`) every block file
//! checked against its checksum xattr.

use super::{
    finish, load_all, render_files, require_existing, Checked, FilesDeviceReport, InspectArgs,
    KeyReport, Loaded, Status, VerifyReport, VERIFY_DEPTH,
};
use crate::output::{CliError, CliResult};
use kvtier::files::device::CHECKSUM_XATTR;
use kvtier::files::mapper::FileMapper;
use kvtier::{Config, Engine, Key};
use serde_json::json;
use std::ffi::CString;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
/// Where a key's file is (device, path) and its size, taken before loading: a bad file is
/// removed by its load.
type FileOf = (usize, Option<PathBuf>, Option<u64>);

pub(super) fn run_files(args: &InspectArgs, mut config: Config) -> CliResult<ExitCode> {
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
    let devices = device_reports(&config, &info);
    let mappers: Vec<FileMapper> = config
        .devices
        .iter()
        .map(|d| FileMapper::new(&d.path, &namespace))
        .collect();
    let mut keys = engine.keys();
    keys.sort_unstable_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
    let files: Vec<FileOf> = keys.iter().map(|key| file_of(key, &mappers)).collect();
    let (checked, verify) = if args.no_verify {
        let checked = keys
            .iter()
            .map(|_| Checked::status(Status::NotVerified))
            .collect();
        (checked, None)
    } else {
        let (checked, verify) = verify_files(&engine, &region, &config, &keys, &files)?;
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
    let value = json!({
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
    let text = render_files(args, &config, &devices, keys.len());
    finish(args, value, text, key_reports.as_deref(), verify.as_ref())
}

/// Each directory as the engine's open scan found it.
fn device_reports(config: &Config, info: &kvtier::EngineInfo) -> Vec<FilesDeviceReport> {
    config
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
        .collect()
}

fn file_of(key: &Key, mappers: &[FileMapper]) -> FileOf {
    let device = key.device(mappers.len());
    let path = mappers[device].key_path(key.as_bytes());
    let size = path
        .as_ref()
        .and_then(|p| std::fs::symlink_metadata(p).ok())
        .filter(std::fs::Metadata::is_file)
        .map(|m| m.len());
    (device, path, size)
}

/// Loads every key through the engine and checks each block against its file's xattr.
fn verify_files(
    engine: &Engine,
    region: &kvtier::Region,
    config: &Config,
    keys: &[Key],
    files: &[FileOf],
) -> CliResult<(Vec<Checked>, VerifyReport)> {
    let block_len = config.block_size as usize;
    let targets: Vec<(Key, usize)> = keys.iter().map(|k| (*k, block_len)).collect();
    let loads = load_all(engine, region, block_len, &targets)?;
    let xattr =
        CString::new(CHECKSUM_XATTR).map_err(|e| CliError::runtime(format!("xattr name: {e}")))?;
    let checked: Vec<Checked> = loads
        .outcomes
        .iter()
        .zip(files)
        .zip(keys)
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
    Ok((checked, verify))
}

/// Compares a loaded block's crc32c with its file's xattr, if it has one.
pub(super) fn check_xattr(key: &Key, path: &Path, name: &CString, crc: u32) -> Checked {
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
