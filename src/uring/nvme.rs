//! The NVMe passthrough device: opening `/dev/ngXnY` (or falling back to its block device),
//! and the ring as a queue of NVMe commands (`URING_CMD`) for [`crate::commands`], which cuts
//! requests into them at the transfer limit (the kernel never splits a passthrough command; a
//! longer one is EINVAL).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvtier_sys::nvme::{block_device_of, Namespace, Opcode};
use kvtier_sys::ring::Ring;

use crate::commands::CommandQueue;
use crate::config::{DeviceConfig, DeviceKind};
use crate::io::IoBuf;

/// Where a device path leads.
pub(super) enum Located {
    /// Use passthrough on this namespace.
    Passthrough(Arc<Namespace>),
    /// Use this path through the block layer (files and block devices, or the fallback).
    Kernel(PathBuf),
}

/// Decides how to open `cfg.path`: passthrough for an NVMe generic device (or for a namespace's
/// block device with `kind = "nvme"`), the block device for `kind = "block"`, and the block
/// device again, with one warning, when passthrough is unavailable: no permission, or a kernel
/// whose io_uring cannot run `URING_CMD` with fixed buffers ([`Namespace::check_io`] tries one
/// read both ways).
pub(super) fn locate(cfg: &DeviceConfig) -> Result<Located, String> {
    let path = cfg.path.as_path();
    let generic = kvtier_sys::nvme::generic_name(path);
    let generic_path = match (cfg.kind, &generic) {
        (DeviceKind::Vfio, _) => {
            return Err(
                "kind = \"vfio\" devices are driven from user space, not through the kernel \
                 (the engine opens them with its VFIO storage)"
                    .to_owned(),
            )
        }
        (DeviceKind::Block, Some(name)) => {
            return block_device_of(name).map(Located::Kernel).ok_or_else(|| {
                format!("kind = \"block\" but the block device of {name} is unknown")
            });
        }
        (DeviceKind::Block | DeviceKind::Auto, None) => {
            return Ok(Located::Kernel(path.to_path_buf()))
        }
        (DeviceKind::Auto | DeviceKind::Nvme, Some(_)) => path.to_path_buf(),
        (DeviceKind::Nvme, None) => match generic_sibling(path) {
            Some(generic) => generic,
            // A namespace's block device whose generic device is missing (kernels before 5.13
            // have none): the block device it is.
            None if is_namespace_block_device(path) => {
                tracing::warn!(
                    device = %path.display(),
                    "kind = \"nvme\" but this namespace has no generic device /dev/ngXnY \
                     (Linux 5.13+): using the block device with O_DIRECT; `kvtier probe` says \
                     what passthrough needs"
                );
                return Ok(Located::Kernel(path.to_path_buf()));
            }
            None => {
                return Err(
                    "kind = \"nvme\" needs an NVMe namespace: its generic device \
                            /dev/ngXnY or its block device /dev/nvmeXnY"
                        .to_owned(),
                )
            }
        },
    };
    let fallback = |why: String| {
        // The kernel's name, not the path's (which may be a symlink such as /dev/disk/by-id/...).
        let name = kvtier_sys::nvme::generic_name(&generic_path).unwrap_or_default();
        let block = block_device_of(&name).ok_or_else(|| {
            format!(
                "NVMe passthrough on {} is unavailable ({why}) and its block device is unknown",
                generic_path.display()
            )
        })?;
        tracing::warn!(
            device = %generic_path.display(),
            fallback = %block.display(),
            "NVMe passthrough unavailable ({why}): using the block device with O_DIRECT; \
             `kvtier probe` says what passthrough needs"
        );
        Ok(Located::Kernel(block))
    };
    match Namespace::open(&generic_path).and_then(|ns| ns.check_io().map(|()| ns)) {
        Ok(ns) => Ok(Located::Passthrough(Arc::new(ns))),
        Err(why) => fallback(why),
    }
}

/// `/dev/nvmeXnY` -> `/dev/ngXnY`, if that generic device exists.
fn generic_sibling(path: &Path) -> Option<PathBuf> {
    let canonical = std::fs::canonicalize(path).ok()?;
    let name = canonical.file_name()?.to_str()?;
    let rest = name.strip_prefix("nvme")?;
    let generic = PathBuf::from(format!("/dev/ng{rest}"));
    kvtier_sys::nvme::generic_name(&generic).map(|_| generic)
}

/// Whether `path` is an NVMe namespace's block device (`nvmeXnY`, by its sysfs entry).
fn is_namespace_block_device(path: &Path) -> bool {
    let Ok(canonical) = std::fs::canonicalize(path) else {
        return false;
    };
    let is_block = std::fs::metadata(&canonical)
        .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_block_device(&m.file_type()));
    let name = canonical
        .file_name()
        .map(|n| n.to_string_lossy().into_owned());
    is_block
        && name.is_some_and(|n| {
            n.starts_with("nvme") && Path::new("/sys/block").join(&n).join("nsid").exists()
        })
}

impl CommandQueue for Ring {
    /// Never more commands in flight than the completion queue holds: an overflowing queue
    /// keeps completions in kernel memory, and loses them if that allocation fails.
    fn has_room(&self) -> bool {
        self.sq_space_left() > 0 && self.in_flight() < self.completion_capacity()
    }

    fn push_command(
        &mut self,
        user_data: u64,
        device: u16,
        op: Opcode,
        nsid: u32,
        slba: u64,
        lba_shift: u32,
        region: u16,
        buf: IoBuf,
    ) -> bool {
        let file = u32::from(device);
        self.push_nvme(user_data, file, op, nsid, slba, lba_shift, region, buf)
            .is_ok()
    }
}
