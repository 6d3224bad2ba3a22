//! The NVMe passthrough device: opening `/dev/ngXnY` (or falling back to its block device),
//! and the backend's bookkeeping for passthrough requests.
//!
//! A worker request for a passthrough device becomes one or more `URING_CMD` commands of at
//! most the device's transfer limit (the kernel never splits them; a longer one is EINVAL). All
//! parts carry the request's `user_data` (unique among the worker's requests in flight), and the
//! request completes when its last part does: with its full length, or with the first failure.
//! A failure whose NVMe status allows a retry (no DNR bit) resubmits the whole request, up to
//! [`TRIES`] times: re-reading or re-writing a part that succeeded is harmless.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kvtier_sys::nvme::{CommandError, Geometry, Namespace, Opcode, Outcome};
use kvtier_sys::ring::Ring;

use crate::config::{DeviceConfig, DeviceKind};
use crate::io::{BufRef, Completion, IoKind, IoRequest};
use crate::logs::RateLimit;

/// Attempts per request when the device's status allows retrying.
pub(super) const TRIES: u8 = 3;

/// What a device path resolves to.
pub(super) enum Resolved {
    /// Use passthrough on this namespace.
    Passthrough(Arc<Namespace>),
    /// Use this path through the block layer (files and block devices, or the fallback).
    Kernel(PathBuf),
}

/// Decides how to open `cfg.path`: passthrough for an NVMe generic device (or for a namespace's
/// block device with `kind = "nvme"`), the block device for `kind = "block"`, and the block
/// device again, with one warning, when passthrough is unavailable.
pub(super) fn resolve(cfg: &DeviceConfig, uring_cmd: bool) -> Result<Resolved, String> {
    let path = cfg.path.as_path();
    let generic = kvtier_sys::nvme::generic_name(path);
    let generic_path = match (cfg.kind, &generic) {
        (DeviceKind::Block, Some(name)) => {
            return block_sibling(name).map(Resolved::Kernel).ok_or_else(|| {
                format!("kind = \"block\" but the block device of {name} is unknown")
            });
        }
        (DeviceKind::Block | DeviceKind::Auto, None) => {
            return Ok(Resolved::Kernel(path.to_path_buf()))
        }
        (DeviceKind::Auto | DeviceKind::Nvme, Some(_)) => path.to_path_buf(),
        (DeviceKind::Nvme, None) => generic_sibling(path).ok_or_else(|| {
            "kind = \"nvme\" needs an NVMe namespace: its generic device /dev/ngXnY or its \
             block device /dev/nvmeXnY"
                .to_owned()
        })?,
    };
    let fallback = |why: String| {
        let name = generic_path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let block = block_sibling(&name).ok_or_else(|| {
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
        Ok(Resolved::Kernel(block))
    };
    if !uring_cmd {
        return fallback("this kernel's io_uring has no URING_CMD (Linux 5.19+)".to_owned());
    }
    match Namespace::open(&generic_path) {
        Ok(ns) => Ok(Resolved::Passthrough(Arc::new(ns))),
        Err(why) => fallback(why),
    }
}

/// `ngXnY` -> `/dev/nvmeXnY`, if that block device exists.
fn block_sibling(generic: &str) -> Option<PathBuf> {
    let rest = generic.strip_prefix("ng")?;
    let block = PathBuf::from(format!("/dev/nvme{rest}"));
    block.exists().then_some(block)
}

/// `/dev/nvmeXnY` -> `/dev/ngXnY`, if that generic device exists.
fn generic_sibling(path: &Path) -> Option<PathBuf> {
    let canonical = std::fs::canonicalize(path).ok()?;
    let name = canonical.file_name()?.to_str()?;
    let rest = name.strip_prefix("nvme")?;
    let generic = PathBuf::from(format!("/dev/ng{rest}"));
    kvtier_sys::nvme::generic_name(&generic).map(|_| generic)
}

/// A passthrough device as the backend sees it.
#[derive(Clone, Debug)]
pub(super) struct Device {
    pub path: PathBuf,
    pub geometry: Geometry,
}

/// A request in flight on a passthrough device.
struct Pending {
    req: IoRequest,
    /// Parts whose completion has not been reaped.
    left: u32,
    /// The first failure among the parts of this attempt.
    failed: Option<Outcome>,
    tries: u8,
}

/// The backend's passthrough bookkeeping (one per ring).
pub(super) struct Passthrough {
    /// By device index; `None` for devices that go through the block layer.
    devices: Vec<Option<Device>>,
    pending: HashMap<u64, Pending>,
    /// Parts pushed on the ring whose completion has not been reaped.
    pub parts_in_ring: usize,
    /// Requests to resubmit (a retry found the submission queue full).
    resubmit: Vec<u64>,
    log: RateLimit,
}

impl Passthrough {
    pub fn new(devices: Vec<Option<Device>>) -> Passthrough {
        Passthrough {
            devices,
            pending: HashMap::new(),
            parts_in_ring: 0,
            resubmit: Vec::new(),
            log: RateLimit::new(10, Duration::from_secs(10)),
        }
    }

    pub fn any(&self) -> bool {
        self.devices.iter().any(Option::is_some)
    }

    pub fn owns(&self, device: u16) -> bool {
        self.devices
            .get(usize::from(device))
            .is_some_and(Option::is_some)
    }

    /// Requests in flight (pending, including those waiting for resubmission).
    pub fn requests(&self) -> usize {
        self.pending.len()
    }

    /// Pushes every part of `req` (a request for a passthrough device), or nothing if the
    /// submission queue lacks room for all of them.
    pub fn push(&mut self, ring: &mut Ring, req: &IoRequest) -> bool {
        let parts = self.parts(req);
        if ring.sq_space_left() < parts.len() {
            return false;
        }
        self.push_parts(ring, req, &parts);
        self.pending.insert(
            req.user_data,
            Pending {
                req: *req,
                left: parts.len() as u32,
                failed: None,
                tries: 1,
            },
        );
        true
    }

    /// (start LBA, LBAs, buffer) of each command of `req`.
    fn parts(&self, req: &IoRequest) -> Vec<(u64, u32, BufRef)> {
        let Some(Some(dev)) = self.devices.get(usize::from(req.device)) else {
            unreachable!(
                "Passthrough::push for device {} it does not own",
                req.device
            );
        };
        let g = &dev.geometry;
        let lba = u64::from(g.lba_bytes());
        assert!(
            req.offset % lba == 0 && u64::from(req.buf.len) % lba == 0,
            "I/O of {} bytes at {} on {} is not a multiple of its {lba}-byte LBA",
            req.buf.len,
            req.offset,
            dev.path.display()
        );
        let mut out = Vec::new();
        let mut done = 0_u32;
        while done < req.buf.len {
            let len = (req.buf.len - done).min(g.max_transfer_bytes);
            out.push((
                (req.offset + u64::from(done)) >> g.lba_shift,
                len >> g.lba_shift,
                BufRef {
                    region: req.buf.region,
                    offset: req.buf.offset + done as usize,
                    len,
                },
            ));
            done += len;
        }
        out
    }

    fn push_parts(&mut self, ring: &mut Ring, req: &IoRequest, parts: &[(u64, u32, BufRef)]) {
        let nsid = self.devices[usize::from(req.device)]
            .as_ref()
            .map_or(0, |d| d.geometry.nsid);
        let op = match req.kind {
            IoKind::Read => Opcode::Read,
            IoKind::Write => Opcode::Write,
        };
        for &(slba, lbas, buf) in parts {
            let pushed = ring.push_nvme(
                req.user_data,
                u32::from(req.device),
                op,
                nsid,
                slba,
                lbas,
                buf,
            );
            // The caller checked there is room for every part.
            assert!(
                pushed.is_ok(),
                "submission queue full after checking its room"
            );
            self.parts_in_ring += 1;
        }
    }

    /// Resubmits requests whose retry found the queue full; call before submitting.
    pub fn flush_resubmits(&mut self, ring: &mut Ring) {
        while let Some(&user_data) = self.resubmit.last() {
            let Some(p) = self.pending.get(&user_data) else {
                self.resubmit.pop();
                continue;
            };
            let req = p.req;
            let parts = self.parts(&req);
            if ring.sq_space_left() < parts.len() {
                return;
            }
            self.resubmit.pop();
            self.push_parts(ring, &req, &parts);
            if let Some(p) = self.pending.get_mut(&user_data) {
                p.left = parts.len() as u32;
            }
        }
    }

    /// Folds the parts among `raw` into request completions, appended to `out`; every other
    /// completion is passed through unchanged. Retryable failures are resubmitted.
    pub fn complete(
        &mut self,
        ring: &mut Ring,
        raw: &mut Vec<Completion>,
        out: &mut Vec<Completion>,
    ) {
        for c in raw.drain(..) {
            let Some(p) = self.pending.get_mut(&c.user_data) else {
                out.push(c);
                continue;
            };
            self.parts_in_ring -= 1;
            p.left -= 1;
            let outcome = Outcome::from_result(c.result);
            if outcome != Outcome::Done && p.failed.is_none() {
                p.failed = Some(outcome);
            }
            if p.left > 0 {
                continue;
            }
            let retry = match p.failed {
                Some(Outcome::Status(s)) => s.retryable() && p.tries < TRIES,
                _ => false,
            };
            if retry {
                p.tries += 1;
                p.failed = None;
                self.resubmit.push(c.user_data);
                continue;
            }
            let Some(p) = self.pending.remove(&c.user_data) else {
                continue;
            };
            out.push(self.finish(&p));
        }
        self.flush_resubmits(ring);
    }

    fn finish(&self, p: &Pending) -> Completion {
        let Some(failed) = p.failed else {
            return Completion {
                user_data: p.req.user_data,
                // Block-sized transfers: far below 2 GiB.
                result: i32::try_from(p.req.buf.len).unwrap_or(i32::MAX),
            };
        };
        let dev = self.devices[usize::from(p.req.device)].as_ref();
        let (path, shift) = dev.map_or((PathBuf::new(), 9), |d| {
            (d.path.clone(), d.geometry.lba_shift)
        });
        let err = CommandError {
            device: path,
            op: match p.req.kind {
                IoKind::Read => Opcode::Read,
                IoKind::Write => Opcode::Write,
            },
            slba: p.req.offset >> shift,
            lbas: p.req.buf.len >> shift,
            outcome: failed,
        };
        if let Some(suppressed) = self.log.admit() {
            tracing::error!(tries = p.tries, suppressed, "{err}");
        }
        Completion {
            user_data: p.req.user_data,
            result: -(err.errno() as i32),
        }
    }
}
