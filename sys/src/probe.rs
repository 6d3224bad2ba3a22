//! Read-only probes of what this machine offers kvtier: `io_uring` opcodes and setup flags,
//! hugetlb and THP, the memlock limit and `CAP_IPC_LOCK`, and the block queue under a path.
//!
//! Used by `kvtier doctor`-style reports and to turn failures into advice. Probes never change
//! system state (the rings they build are closed before returning) and never fail: what cannot
//! be read is reported as unavailable or empty.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use io_uring::opcode;

use crate::ring::{Ring, RingConfig, RingFeatures};

/// What `io_uring` offers on this kernel.
#[derive(Clone, Debug)]
pub struct UringProbe {
    /// A ring could be created.
    pub available: bool,
    /// Why not, if it could not.
    pub error: Option<String>,
    /// Flags a default ring got, plus whether SQPOLL and IOPOLL rings can be built.
    pub features: RingFeatures,
    /// Opcodes kvtier uses, and whether the kernel supports each.
    pub opcodes: Vec<(&'static str, bool)>,
}

const OPCODES: [(&str, u8); 13] = [
    ("ReadFixed", opcode::ReadFixed::CODE),
    ("WriteFixed", opcode::WriteFixed::CODE),
    ("Read", opcode::Read::CODE),
    ("Write", opcode::Write::CODE),
    ("OpenAt", opcode::OpenAt::CODE),
    ("Close", opcode::Close::CODE),
    ("Statx", opcode::Statx::CODE),
    ("RenameAt", opcode::RenameAt::CODE),
    ("UnlinkAt", opcode::UnlinkAt::CODE),
    ("MkDirAt", opcode::MkDirAt::CODE),
    ("Fsync", opcode::Fsync::CODE),
    ("Fallocate", opcode::Fallocate::CODE),
    // NVMe passthrough (5.19+).
    ("UringCmd", opcode::UringCmd80::CODE),
];

/// Builds small rings to find out what `io_uring` supports here.
pub fn probe_uring() -> UringProbe {
    let cfg = RingConfig {
        entries: 8,
        ..RingConfig::default()
    };
    let ring = match Ring::new(&cfg) {
        Ok(ring) => ring,
        Err(errno) => {
            return UringProbe {
                available: false,
                error: Some(format!(
                    "io_uring_setup failed: {errno} ({}); check sysctl kernel.io_uring_disabled, \
                     seccomp profiles (containers) and that the kernel is 5.6 or newer",
                    errno.desc()
                )),
                features: RingFeatures::default(),
                opcodes: OPCODES.iter().map(|&(name, _)| (name, false)).collect(),
            };
        }
    };
    let mut features = ring.features();
    let probe = ring.probe_opcodes();
    drop(ring);
    features.sqpoll = crate::ring::setup_flag_supported(true, false);
    features.iopoll = crate::ring::setup_flag_supported(false, true);
    let opcodes = OPCODES
        .iter()
        .map(|&(name, code)| (name, probe.as_ref().is_ok_and(|p| p.is_supported(code))))
        .collect();
    UringProbe {
        available: true,
        error: probe
            .err()
            .map(|e| format!("IORING_REGISTER_PROBE failed: {e}")),
        features,
        opcodes,
    }
}

/// Huge page pool and THP mode.
#[derive(Clone, Debug)]
pub struct HugePageInfo {
    /// hugetlb pages of the default size reserved (`HugePages_Total`).
    pub total: u64,
    /// Of those, not in use (`HugePages_Free`).
    pub free: u64,
    /// Default hugetlb page size in bytes (`Hugepagesize`).
    pub size_bytes: u64,
    /// The bracketed word of `/sys/kernel/mm/transparent_hugepage/enabled`
    /// (`always`, `madvise`, `never`), or empty if unknown.
    pub thp_mode: String,
}

/// Reads `/proc/meminfo` and the THP mode. Unreadable values are 0 / empty.
pub fn hugepage_info() -> HugePageInfo {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |name: &str| -> u64 {
        meminfo
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    let thp =
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    HugePageInfo {
        total: field("HugePages_Total"),
        free: field("HugePages_Free"),
        size_bytes: field("Hugepagesize").saturating_mul(1024),
        thp_mode: bracketed(&thp).unwrap_or_default(),
    }
}

/// `RLIMIT_MEMLOCK` soft limit in bytes; `None` means unlimited (or unreadable).
pub fn memlock_limit() -> Option<u64> {
    let (soft, _hard) =
        nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_MEMLOCK).ok()?;
    (soft != libc::RLIM_INFINITY).then_some(soft)
}

/// True if the effective capability set holds `CAP_IPC_LOCK` (bit 14 of `CapEff`).
pub fn has_cap_ipc_lock() -> bool {
    const CAP_IPC_LOCK: u32 = 14;
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let hex = s
                .lines()
                .find_map(|l| l.strip_prefix("CapEff:"))?
                .trim()
                .to_owned();
            u64::from_str_radix(&hex, 16).ok()
        })
        .is_some_and(|caps| caps & (1 << CAP_IPC_LOCK) != 0)
}

/// The block queue settings of the disk holding a path.
#[derive(Clone, Debug)]
pub struct BlockQueueInfo {
    /// Kernel name of the whole disk, e.g. `nvme0n1` (the parent of a partition).
    pub device: String,
    /// Active I/O scheduler (`none`, `mq-deadline`, ...).
    pub scheduler: String,
    pub nr_requests: u64,
    pub rotational: bool,
    pub logical_block_size: u64,
    pub max_sectors_kb: u64,
}

/// Finds the block device under `path` (a file on it, or the device node itself) and reads its
/// `queue/` settings from sysfs. `None` for filesystems without a block device (tmpfs,
/// overlay, network) or when sysfs is not readable.
pub fn block_queue_for_path(path: &Path) -> Option<BlockQueueInfo> {
    let meta = std::fs::metadata(path).ok()?;
    let dev = if meta.file_type().is_block_device() {
        meta.rdev()
    } else {
        meta.dev()
    };
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    let mut dir = PathBuf::from(format!("/sys/dev/block/{major}:{minor}"))
        .canonicalize()
        .ok()?;
    if dir.join("partition").exists() {
        dir = dir.parent()?.to_path_buf();
    }
    let queue = dir.join("queue");
    let read = |name: &str| std::fs::read_to_string(queue.join(name)).ok();
    let num = |name: &str| read(name).and_then(|s| s.trim().parse::<u64>().ok());
    let scheduler = read("scheduler")?;
    Some(BlockQueueInfo {
        device: dir.file_name()?.to_string_lossy().into_owned(),
        scheduler: bracketed(&scheduler).unwrap_or_else(|| scheduler.trim().to_owned()),
        nr_requests: num("nr_requests").unwrap_or(0),
        rotational: num("rotational").unwrap_or(0) != 0,
        logical_block_size: num("logical_block_size").unwrap_or(0),
        max_sectors_kb: num("max_sectors_kb").unwrap_or(0),
    })
}

/// The word inside `[...]` in a sysfs choice list like `always [madvise] never`.
fn bracketed(s: &str) -> Option<String> {
    let start = s.find('[')? + 1;
    let end = start + s[start..].find(']')?;
    Some(s[start..end].to_owned())
}

#[cfg(test)]
mod tests {
    //! The probes must run anywhere without failing; on the development machine (Linux 6.x,
    //! root) they also report `io_uring` as available with the fixed-buffer opcodes.
    use super::*;

    #[test]
    fn probes_report_this_machine() {
        let u = probe_uring();
        println!("{u:?}");
        if !u.available {
            crate::skip!("io_uring unavailable: {:?}", u.error);
            return;
        }
        assert!(
            u.opcodes.iter().any(|&(n, ok)| n == "ReadFixed" && ok),
            "{u:?}"
        );
        let h = hugepage_info();
        println!(
            "{h:?} memlock={:?} cap_ipc_lock={}",
            memlock_limit(),
            has_cap_ipc_lock()
        );
        assert!(h.free <= h.total);
        let q = block_queue_for_path(Path::new("/var/tmp"));
        println!("{q:?}");
        assert!(block_queue_for_path(Path::new("/proc/self")).is_none());
    }

    #[test]
    fn bracketed_word() {
        assert_eq!(
            bracketed("always [madvise] never\n").as_deref(),
            Some("madvise")
        );
        assert_eq!(bracketed("none"), None);
    }
}
