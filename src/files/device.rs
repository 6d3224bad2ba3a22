//! A `files` device: one directory tree in vLLM's layout, shared with other kvtier processes and
//! with vLLM instances.
//!
//! Opening one creates the namespace directory and writes `config.json` if it is absent (like
//! vLLM, never rewriting it), probes O_DIRECT in the data directory, removes temp files that a
//! crashed writer left (only those older than `temp_grace_secs`, because live writers in other
//! processes have temp files too), and scans every published block to seed the index and its
//! LRU order (from file times).
//!
//! Capacity accounting across processes: every kvtier process on the directory updates one shared
//! counter (`.kvtier-usage` in the data directory, `pread`/`pwrite` under a byte-range lock: a
//! file system failing the read fails the store or the open, never the process) and adds a block's bytes *before* writing it,
//! subtracting them when it removes a file. A store that would push the counter past
//! `capacity_bytes` evicts first and waits for the removals, so the bytes on disk written through
//! kvtier never exceed the bound. Each live process holds `.kvtier-lock` shared; a process that
//! opens the directory and gets the lock exclusively knows it is alone and resets the counter to
//! what its scan found, which repairs any drift a crashed process left. Files written by vLLM
//! itself are counted when a scan sees them, not when vLLM writes them.

use std::ffi::{CStr, CString};
use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use kvtier_sys::dir::{self as confined, NodeKind};
use kvtier_sys::shared::{FileLock, SharedCounter};
use kvtier_sys::Errno;

use crate::config::{DeviceConfig, DirectIo, FilesConfig, SyncMode};
use crate::error::{Error, Result};
use crate::files::mapper::FileMapper;
use crate::key::Key;
use crate::worker::Context;

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
    /// The data directory, open: every block path is resolved below it without following a
    /// symlink (module docs of `kvtier_sys::dir`).
    pub dir: OwnedFd,
    /// `[files] file_mode` / `dir_mode`, and whether the umask would strip bits of them (then
    /// kvtier `fchmod`s what it creates).
    pub file_mode: u32,
    pub dir_mode: u32,
    pub chmod_files: bool,
    pub chmod_dirs: bool,
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
    /// Gives `bytes` reserved in the shared usage counter back. A counter the file system
    /// cannot read or write is logged (the bound may then count too much until a process alone
    /// on the directory resets it at open), never fatal.
    pub fn unreserve(&self, cx: &mut Context<super::layout::Op>, bytes: u64) {
        if bytes == 0 {
            return;
        }
        if let Err(e) = self.usage.sub_saturating(bytes) {
            cx.log_error(&format!(
                "{}/.kvtier-usage: giving back {bytes} bytes failed: {}",
                self.data_dir.display(),
                e.desc()
            ));
        }
    }

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
        let (dir_mode, file_mode) = (files.dir_mode, files.file_mode);
        // The configured root is trusted (it may be a symlink); nothing below it is followed.
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(dir_mode)
            .create(&cfg.path)
            .map_err(|e| fail(&format!("creating {}", cfg.path.display()), &e))?;
        let root = confined::open_root(&cfg.path)
            .map_err(|e| fail(&format!("opening {}", cfg.path.display()), &e.desc()))?;
        let below = |path: &Path| -> Result<OwnedFd> {
            let rel = path.strip_prefix(&cfg.path).unwrap_or(path);
            confined::make_dirs_confined(root.as_raw_fd(), rel, dir_mode)
                .map_err(|e| fail(&format!("creating {}", path.display()), &confined_error(e)))
        };
        let base = mapper.base_path();
        let base_dir = below(&base)?;
        write_config_if_absent(&mapper, base_dir.as_raw_fd(), file_mode)
            .map_err(|e| fail("writing config.json", &confined_error(e)))?;
        let data_dir = mapper.data_dir();
        let dir = below(&data_dir)?;
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
        let lock = FileLock::open_in(dir.as_raw_fd(), c".kvtier-lock", file_mode)
            .map_err(|e| fail("opening .kvtier-lock", &confined_error(e)))?;
        let usage = SharedCounter::open_in(dir.as_raw_fd(), c".kvtier-usage", file_mode)
            .map_err(|e| fail("opening .kvtier-usage", &confined_error(e)))?;
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
            usage
                .store(report.bytes)
                .map_err(|e| fail("writing .kvtier-usage", &e.desc()))?;
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
                dir,
                file_mode,
                dir_mode,
                chmod_files: confined::needs_chmod(file_mode),
                chmod_dirs: confined::needs_chmod(dir_mode),
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

    /// `path` (one of this device's block, temp or leaf-directory paths) relative to the data
    /// directory, for the ring's `*at` operations on [`FilesDevice::dir`].
    pub fn rel(&self, path: &Path) -> CString {
        c_path(path.strip_prefix(&self.data_dir).unwrap_or(path))
    }

    pub fn dir_fd(&self) -> RawFd {
        self.dir.as_raw_fd()
    }
}

/// An errno from a confined open or mkdir, said in words (ELOOP and EXDEV are kvtier's refusal
/// of a symlink below the configured root, not a loop).
pub(crate) fn confined_error(e: Errno) -> String {
    match e {
        Errno::ELOOP => "a symlink is in the way below the configured root, and kvtier never \
                         follows symlinks there (ELOOP); remove it"
            .to_owned(),
        Errno::EXDEV => "the path leaves the configured root (EXDEV)".to_owned(),
        Errno::EINVAL => "not a regular file or directory (EINVAL)".to_owned(),
        e => e.desc().to_owned(),
    }
}

/// Writes `config.json` in the base directory `base` only if it does not exist (vLLM's rule),
/// atomically so a concurrent opener never reads half a file, with exactly `mode`.
fn write_config_if_absent(mapper: &FileMapper, base: RawFd, mode: u32) -> Result<(), Errno> {
    let name = c"config.json";
    match confined::kind_at(base, name) {
        Ok((NodeKind::Regular, _)) => return Ok(()),
        Ok(_) => return Err(Errno::EINVAL),
        Err(Errno::ENOENT) => {}
        Err(e) => return Err(e),
    }
    let tmp = CString::new(format!("config.json_{}.tmp", std::process::id()))
        .map_err(|_| Errno::EINVAL)?;
    let flags =
        nix::libc::O_WRONLY | nix::libc::O_CREAT | nix::libc::O_TRUNC | nix::libc::O_NOFOLLOW;
    let fd = confined::open_confined(base, &tmp, flags, mode)?;
    if confined::needs_chmod(mode) {
        confined::fchmod(fd.as_raw_fd(), mode)?;
    }
    let written = std::fs::File::from(fd)
        .write_all(mapper.config_json_text().as_bytes())
        .map_err(|e| Errno::from_raw(e.raw_os_error().unwrap_or(nix::libc::EIO)));
    // A hard link fails with EEXIST if another process won the race; both wrote the same text.
    let linked = written.and_then(|()| link_at(base, &tmp, name));
    unlink_at(base, &tmp);
    match linked {
        Err(Errno::EEXIST) | Ok(()) => Ok(()),
        Err(e) => Err(e),
    }
}

fn link_at(dir: RawFd, from: &CStr, to: &CStr) -> Result<(), Errno> {
    nix::unistd::linkat(Some(dir), from, Some(dir), to, nix::fcntl::AtFlags::empty())
}

fn unlink_at(dir: RawFd, name: &CStr) {
    let _ = nix::unistd::unlinkat(Some(dir), name, nix::unistd::UnlinkatFlags::NoRemoveDir);
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
