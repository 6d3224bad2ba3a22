//! A `files` device: one directory tree in vLLM's layout, shared with other kvtier processes and
//! with vLLM instances.
//!
//! Opening one creates the namespace directory and writes `config.json` if it is absent (like
//! vLLM, never rewriting it), probes O_DIRECT in the data directory, removes temp files that a
//! crashed writer left (only those older than `temp_grace_secs`, because live writers in other
//! processes have temp files too), and scans every published block to seed the index and its
//! LRU order (from file times).
//!
//! Capacity accounting across processes: every kvtier process on the directory maps one shared
//! counter (`.kvtier-usage` in the data directory) and adds a block's bytes *before* writing it,
//! subtracting them when it removes a file. A store that would push the counter past
//! `capacity_bytes` evicts first and waits for the removals, so the bytes on disk written through
//! kvtier never exceed the bound. Each live process holds `.kvtier-lock` shared; a process that
//! opens the directory and gets the lock exclusively knows it is alone and resets the counter to
//! what its scan found, which repairs any drift a crashed process left. Files written by vLLM
//! itself are counted when a scan sees them, not when vLLM writes them.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use kvtier_sys::shared::{FileLock, SharedCounter};

use crate::config::{DeviceConfig, DirectIo, FilesConfig, SyncMode};
use crate::error::{Error, Result};
use crate::files::mapper::FileMapper;
use crate::key::Key;

/// The xattr holding a block's crc32c (4 bytes, little endian).
pub const CHECKSUM_XATTR: &str = "user.kvtier.crc32c";

/// One published block found by the scan.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ScannedFile {
    pub key: Key,
    /// Last use as far as the file system knows: the later of atime and mtime, in seconds.
    pub last_use_secs: u64,
}

/// What the scan at open found.
#[derive(Clone, Debug, Default)]
pub struct ScanReport {
    pub blocks: u64,
    pub bytes: u64,
    /// `.bin` files whose size is not the block size (left alone, never served).
    pub wrong_size: u64,
    pub temps_removed: u64,
    pub temps_kept: u64,
    /// Whether this process was alone on the directory and reset the shared usage counter.
    pub usage_reset: bool,
}

pub(crate) struct FilesDevice {
    pub mapper: FileMapper,
    pub data_dir: PathBuf,
    pub direct: bool,
    pub capacity_bytes: Option<u64>,
    pub usage: SharedCounter,
    /// Held shared for the device's life (see the module docs).
    _lock: FileLock,
    pub sync: SyncMode,
    pub checksums: bool,
    pub xattr_name: CString,
}

impl FilesDevice {
    pub fn open(
        index: usize,
        cfg: &DeviceConfig,
        files: &FilesConfig,
        block_bytes: u64,
        direct_io: DirectIo,
    ) -> Result<(FilesDevice, Vec<ScannedFile>, ScanReport)> {
        let mapper = FileMapper::new(&cfg.path, &files.namespace);
        let fail = |what: &str, e: &dyn std::fmt::Display| {
            Error::device(&cfg.path, format!("devices[{index}]: {what}: {e}"))
        };
        let base = mapper.base_path();
        std::fs::create_dir_all(&base)
            .map_err(|e| fail(&format!("creating {}", base.display()), &e))?;
        write_config_if_absent(&mapper).map_err(|e| fail("writing config.json", &e))?;
        let data_dir = mapper.data_dir();
        std::fs::create_dir_all(&data_dir)
            .map_err(|e| fail(&format!("creating {}", data_dir.display()), &e))?;
        let direct = match direct_io {
            DirectIo::Off => false,
            DirectIo::Auto | DirectIo::Required => {
                let ok = kvtier_sys::file::probe_o_direct(&data_dir)
                    .map_err(|e| fail("probing O_DIRECT", &e.desc()))?;
                if !ok && direct_io == DirectIo::Required {
                    return Err(Error::device(
                        &data_dir,
                        "the file system refuses O_DIRECT; set direct_io = \"auto\" to fall back to buffered I/O",
                    ));
                }
                if !ok {
                    tracing::warn!(dir = %data_dir.display(), "O_DIRECT refused: the files layout uses buffered I/O here");
                }
                ok
            }
        };
        let lock = FileLock::open(&data_dir.join(".kvtier-lock"))
            .map_err(|e| fail("opening .kvtier-lock", &e.desc()))?;
        let usage = SharedCounter::open(&data_dir.join(".kvtier-usage"))
            .map_err(|e| fail("opening .kvtier-usage", &e.desc()))?;
        let (found, mut report) = scan(
            &mapper,
            &data_dir,
            block_bytes,
            Duration::from_secs(files.temp_grace_secs),
        );
        let alone = lock
            .try_exclusive()
            .map_err(|e| fail("locking .kvtier-lock", &e.desc()))?;
        if alone {
            usage.store(report.bytes);
            report.usage_reset = true;
        }
        lock.shared()
            .map_err(|e| fail("locking .kvtier-lock", &e.desc()))?;
        if let Some(cap) = cfg.capacity_bytes {
            if report.bytes > cap {
                tracing::warn!(
                    dir = %data_dir.display(),
                    bytes = report.bytes,
                    capacity = cap,
                    "the directory already holds more than capacity_bytes: stores evict first"
                );
            }
        } else {
            tracing::warn!(dir = %data_dir.display(), "no capacity_bytes: the files layout grows without bound (like vLLM)");
        }
        let xattr_name = CString::new(CHECKSUM_XATTR).map_err(|e| fail("xattr name", &e))?;
        Ok((
            FilesDevice {
                mapper,
                data_dir,
                direct,
                capacity_bytes: cfg.capacity_bytes,
                usage,
                _lock: lock,
                sync: files.sync,
                checksums: files.checksums,
                xattr_name,
            },
            found,
            report,
        ))
    }

    /// The block file of `key`, if the key has the vLLM shape (hash + 4-byte group).
    pub fn path_of(&self, key: &Key) -> Option<PathBuf> {
        self.mapper.key_path(key.as_bytes())
    }
}

/// Writes `config.json` only if it does not exist (vLLM's rule), atomically so a concurrent
/// opener never reads half a file.
fn write_config_if_absent(mapper: &FileMapper) -> std::io::Result<()> {
    let path = mapper.config_file_path();
    if path.exists() {
        return Ok(());
    }
    let tmp = FileMapper::temp_path(&path, u64::from(std::process::id()));
    std::fs::write(&tmp, mapper.config_json_text())?;
    // A hard link fails with EEXIST if another process won the race; both wrote the same text.
    let linked = std::fs::hard_link(&tmp, &path);
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => Err(e),
        _ => Ok(()),
    }
}

/// Walks `<data_dir>/<hhh>/<hh>_g<g>/` for published blocks and temp files.
fn scan(
    mapper: &FileMapper,
    data_dir: &Path,
    block_bytes: u64,
    grace: Duration,
) -> (Vec<ScannedFile>, ScanReport) {
    let mut found = Vec::new();
    let mut report = ScanReport::default();
    let now = SystemTime::now();
    let Ok(top) = std::fs::read_dir(data_dir) else {
        return (found, report);
    };
    for d1 in top.flatten() {
        if !d1.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let Ok(mid) = std::fs::read_dir(d1.path()) else {
            continue;
        };
        for d2 in mid.flatten() {
            if !d2.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let Ok(files) = std::fs::read_dir(d2.path()) else {
                continue;
            };
            for f in files.flatten() {
                let path = f.path();
                let Ok(meta) = f.metadata() else { continue };
                if !meta.is_file() {
                    continue;
                }
                if FileMapper::is_temp_file_name(&f.file_name()) {
                    let age = meta
                        .modified()
                        .ok()
                        .and_then(|m| now.duration_since(m).ok())
                        .unwrap_or_default();
                    if age >= grace && std::fs::remove_file(&path).is_ok() {
                        report.temps_removed += 1;
                    } else {
                        report.temps_kept += 1;
                        report.bytes += meta.len();
                    }
                    continue;
                }
                let Some(key_bytes) = mapper.parse_block_path(&path) else {
                    continue;
                };
                report.bytes += meta.len();
                if meta.len() != block_bytes {
                    report.wrong_size += 1;
                    continue;
                }
                let Ok(key) = Key::new(&key_bytes) else {
                    continue;
                };
                let secs = |t: std::io::Result<SystemTime>| {
                    t.ok()
                        .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
                        .map_or(0, |d| d.as_secs())
                };
                let last_use_secs = secs(meta.accessed()).max(secs(meta.modified()));
                found.push(ScannedFile { key, last_use_secs });
                report.blocks += 1;
            }
        }
    }
    if report.temps_removed > 0 {
        tracing::info!(dir = %data_dir.display(), removed = report.temps_removed, "removed stale temp files left by a crashed writer");
    }
    (found, report)
}

/// The path as a C string for the ring.
pub(crate) fn c_path(path: &Path) -> CString {
    // Paths built by the mapper never contain NUL bytes.
    CString::new(path.as_os_str().as_bytes()).unwrap_or_default()
}
