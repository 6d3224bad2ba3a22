//! NVMe passthrough: read and write commands sent straight to a namespace's generic character
//! device (`/dev/ngXnY`), skipping the block layer, while the kernel's driver keeps the device.
//!
//! * [`Namespace::open`] opens `/dev/ngXnY` and learns its geometry: the namespace id (the
//!   `NVME_IOCTL_ID` ioctl), the LBA format and capacity (Identify Namespace) and the maximum
//!   data transfer size (Identify Controller's MDTS). Identify is an admin command, which the
//!   kernel takes only on the controller's device (`/dev/nvmeX`; on `/dev/ngXnY` it answers
//!   ENOTTY) and only from `CAP_SYS_ADMIN`; without it the same facts come from sysfs.
//! * [`Namespace::read_sync`]/[`Namespace::write_sync`] move bytes with the `NVME_IOCTL_IO_CMD`
//!   ioctl (used while opening a slab: headers, formatting); the data path uses
//!   [`crate::ring::Ring::push_nvme`] (`IORING_OP_URING_CMD` with a fixed buffer).
//! * The kernel never splits a passthrough command: one longer than the device's limit fails with
//!   EINVAL. Every transfer here is cut at [`Geometry::max_transfer_bytes`].
//! * A command's completion is 0 (success), `-errno`, or a positive NVMe status field
//!   ([`Status`]), which names what failed and whether retrying can help (the DNR bit).

use std::fmt;
use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::file::{DeviceFile, OpenOptions};
use crate::mem::Region;
use crate::Errno;

/// NVM command set opcodes kvtier sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Opcode {
    Write = 0x01,
    Read = 0x02,
}

impl Opcode {
    pub fn name(self) -> &'static str {
        match self {
            Opcode::Write => "write",
            Opcode::Read => "read",
        }
    }
}

/// `struct nvme_passthru_cmd` / `struct nvme_uring_cmd` of `<linux/nvme_ioctl.h>`: the same 72
/// bytes (the ioctl's `result` is the uring command's reserved word).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Command {
    pub opcode: u8,
    pub flags: u8,
    pub rsvd1: u16,
    pub nsid: u32,
    pub cdw2: u32,
    pub cdw3: u32,
    pub metadata: u64,
    pub addr: u64,
    pub metadata_len: u32,
    pub data_len: u32,
    pub cdw10: u32,
    pub cdw11: u32,
    pub cdw12: u32,
    pub cdw13: u32,
    pub cdw14: u32,
    pub cdw15: u32,
    pub timeout_ms: u32,
    pub result: u32,
}

const _: () = assert!(std::mem::size_of::<Command>() == 72);

impl Command {
    /// A read or write of `lbas` blocks from `slba`, to or from `len` bytes at `addr`.
    pub fn io(op: Opcode, nsid: u32, slba: u64, lbas: u32, addr: u64, len: u32) -> Command {
        assert!(
            (1..=MAX_LBAS_PER_COMMAND).contains(&lbas),
            "an NVMe transfer of {lbas} blocks (1..={MAX_LBAS_PER_COMMAND})"
        );
        Command {
            opcode: op as u8,
            nsid,
            addr,
            data_len: len,
            // Truncations intended: cdw10/11 are the low/high halves of the start LBA.
            cdw10: slba as u32,
            cdw11: (slba >> 32) as u32,
            // Number of logical blocks, zero-based (NLB).
            cdw12: lbas - 1,
            ..Command::default()
        }
    }

    /// The 80-byte command area of a `URING_CMD` SQE.
    pub fn to_sqe_bytes(&self) -> [u8; 80] {
        let mut out = [0_u8; 80];
        let mut at = 0;
        let mut put = |bytes: &[u8]| {
            out[at..at + bytes.len()].copy_from_slice(bytes);
            at += bytes.len();
        };
        put(&[self.opcode, self.flags]);
        put(&self.rsvd1.to_ne_bytes());
        for word in [self.nsid, self.cdw2, self.cdw3] {
            put(&word.to_ne_bytes());
        }
        put(&self.metadata.to_ne_bytes());
        put(&self.addr.to_ne_bytes());
        for word in [
            self.metadata_len,
            self.data_len,
            self.cdw10,
            self.cdw11,
            self.cdw12,
            self.cdw13,
            self.cdw14,
            self.cdw15,
            self.timeout_ms,
            self.result,
        ] {
            put(&word.to_ne_bytes());
        }
        out
    }
}

/// The NLB field of a read or write is 16 bits, zero-based: at most 65536 LBAs per command.
pub const MAX_LBAS_PER_COMMAND: u32 = 1 << 16;

/// `_IOWR('N', 0x80, struct nvme_uring_cmd)`: the `cmd_op` of an I/O `URING_CMD`.
pub const URING_CMD_IO: u32 = ioc_readwrite(0x80);
/// `_IO('N', 0x40)`: the namespace id of an open namespace device.
const IOCTL_ID: libc::c_ulong = (b'N' as libc::c_ulong) << 8 | 0x40;
/// `_IOWR('N', 0x41, struct nvme_passthru_cmd)`: an admin command (controller device only).
const IOCTL_ADMIN_CMD: libc::c_ulong = ioc_readwrite(0x41) as libc::c_ulong;
/// `_IOWR('N', 0x43, struct nvme_passthru_cmd)`: an I/O command on a namespace.
const IOCTL_IO_CMD: libc::c_ulong = ioc_readwrite(0x43) as libc::c_ulong;

const fn ioc_readwrite(nr: u32) -> u32 {
    // _IOC(READ|WRITE = 3, 'N', nr, 72 bytes)
    (3 << 30) | (72 << 16) | ((b'N' as u32) << 8) | nr
}

/// The NVMe status field of a failed command, as the kernel reports it (status code type in
/// bits 8..11, status code in 0..8, More in 13, Do Not Retry in 14).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Status(pub u16);

impl Status {
    pub fn code_type(self) -> u8 {
        ((self.0 >> 8) & 0x7) as u8
    }

    pub fn code(self) -> u8 {
        (self.0 & 0xff) as u8
    }

    /// Whether the command succeeded (status code type and code both 0).
    pub fn is_success(self) -> bool {
        self.code_type() == 0 && self.code() == 0
    }

    /// Do Not Retry: the same command will fail again.
    pub fn dnr(self) -> bool {
        self.0 & 0x4000 != 0
    }

    /// Whether resubmitting the command may succeed (the controller did not set DNR).
    pub fn retryable(self) -> bool {
        !self.dnr()
    }

    /// What the status means, from the NVMe base specification's tables.
    pub fn text(self) -> &'static str {
        match (self.code_type(), self.code()) {
            (0, 0x00) => "success",
            (0, 0x01) => "invalid command opcode",
            (0, 0x02) => "invalid field in command",
            (0, 0x04) => "data transfer error",
            (0, 0x05) => "aborted due to power loss",
            (0, 0x06) => "internal error",
            (0, 0x07) => "command abort requested",
            (0, 0x08) => "command aborted: SQ deleted",
            (0, 0x0b) => "invalid namespace or format",
            (0, 0x15) => "operation denied",
            (0, 0x20) => "namespace is write protected",
            (0, 0x21) => "command interrupted",
            (0, 0x80) => "LBA out of range",
            (0, 0x81) => "capacity exceeded",
            (0, 0x82) => "namespace not ready",
            (0, 0x83) => "reservation conflict",
            (1, 0x80) => "conflicting attributes",
            (1, 0x82) => "write to a read-only range",
            (2, 0x80) => "write fault",
            (2, 0x81) => "unrecovered read error",
            (2, 0x82) => "end-to-end guard check error",
            (2, 0x85) => "compare failure",
            (2, 0x86) => "access denied",
            (2, 0x87) => "deallocated or unwritten logical block",
            (3, _) => "path error",
            (0, _) => "generic command error",
            (1, _) => "command-specific error",
            (2, _) => "media or data integrity error",
            _ => "vendor-specific or unknown error",
        }
    }

    /// The errno the rest of kvtier classifies this status as.
    pub fn errno(self) -> Errno {
        match (self.code_type(), self.code()) {
            (0, 0x01 | 0x02 | 0x0b | 0x80) => Errno::EINVAL,
            (0, 0x81) => Errno::ENOSPC,
            (0, 0x82 | 0x21) => Errno::EAGAIN,
            (0, 0x20) | (1, 0x82) => Errno::EROFS,
            (0, 0x15 | 0x83) | (2, 0x86) => Errno::EACCES,
            _ => Errno::EIO,
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (NVMe status {:#06x}", self.text(), self.0)?;
        if self.dnr() {
            f.write_str(", do not retry")?;
        }
        f.write_str(")")
    }
}

/// How a completed passthrough command went: `res` of its CQE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Done,
    Status(Status),
    Errno(Errno),
}

impl Outcome {
    pub fn from_result(res: i32) -> Outcome {
        match res {
            0 => Outcome::Done,
            // The status field is 15 bits; truncation of anything wider cannot happen.
            r if r > 0 => Outcome::Status(Status(r as u16)),
            r => Outcome::Errno(Errno::from_raw(-r)),
        }
    }
}

/// A failed command, with what it was asked to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommandError {
    pub device: PathBuf,
    pub op: Opcode,
    pub slba: u64,
    pub lbas: u32,
    pub outcome: Outcome,
}

impl CommandError {
    pub fn errno(&self) -> Errno {
        match self.outcome {
            Outcome::Status(s) => s.errno(),
            Outcome::Errno(e) => e,
            Outcome::Done => Errno::EIO,
        }
    }
}

impl fmt::Display for CommandError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "NVMe {} of LBAs {}..{} on {} failed: ",
            self.op.name(),
            self.slba,
            self.slba + u64::from(self.lbas),
            self.device.display()
        )?;
        match self.outcome {
            Outcome::Status(s) => write!(f, "{s}"),
            Outcome::Errno(e) => write!(f, "{} ({e})", e.desc()),
            Outcome::Done => f.write_str("no error reported"),
        }
    }
}

impl std::error::Error for CommandError {}

/// What a namespace looks like to kvtier.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub nsid: u32,
    /// log2 of the LBA size (9 for 512 B, 12 for 4 KiB).
    pub lba_shift: u32,
    /// Namespace size in LBAs.
    pub lbas: u64,
    /// Longest transfer one command may carry: MDTS, the driver's `max_hw_sectors_kb`, and
    /// `max_segments` pages, whichever is least; a multiple of the LBA size.
    pub max_transfer_bytes: u32,
    /// The driver has poll queues (`/sys/block/nvmeXnY/queue/io_poll` is 1): polled rings
    /// complete by polling; without them they silently complete by interrupt.
    pub poll_queues: bool,
    /// Where LBA format and capacity came from: "identify" or "sysfs".
    pub source: &'static str,
    /// The controller device (`/dev/nvmeX`) and the namespace's block device (`/dev/nvmeXnY`).
    pub controller: PathBuf,
    pub block_device: PathBuf,
}

impl Geometry {
    pub fn lba_bytes(&self) -> u32 {
        1 << self.lba_shift
    }

    pub fn size_bytes(&self) -> u64 {
        self.lbas << self.lba_shift
    }
}

/// Whether `path` is an NVMe generic character device (`/dev/ngXnY`), judged by its sysfs
/// class (`/sys/class/nvme-generic`); returns its kernel name (`ngXnY`).
pub fn generic_name(path: &Path) -> Option<String> {
    let meta = std::fs::metadata(path).ok()?;
    if !meta.file_type().is_char_device() {
        return None;
    }
    let rdev = meta.rdev();
    let link = format!("/sys/dev/char/{}:{}", libc::major(rdev), libc::minor(rdev));
    // The device's sysfs directory (under nvme-subsystem with native multipath, else under
    // the controller) is named like the device; the class directory says what it is.
    let target = std::fs::read_link(&link).ok()?;
    let name = target.file_name()?.to_string_lossy().into_owned();
    Path::new("/sys/class/nvme-generic")
        .join(&name)
        .exists()
        .then_some(name)
}

/// The block device of the namespace whose generic device is named `generic` (`ngXnY` ->
/// `/dev/nvmeXnY`), if it exists.
pub fn block_device_of(generic: &str) -> Option<PathBuf> {
    let (_, block) = sibling_names(generic)?;
    let path = PathBuf::from(format!("/dev/{block}"));
    path.exists().then_some(path)
}

/// `ngXnY` -> (`nvmeX`, `nvmeXnY`).
fn sibling_names(generic: &str) -> Option<(String, String)> {
    let rest = generic.strip_prefix("ng")?;
    let (ctrl, ns) = rest.split_once('n')?;
    if ctrl.is_empty()
        || ns.is_empty()
        || !(ctrl.bytes().chain(ns.bytes())).all(|b| b.is_ascii_digit())
    {
        return None;
    }
    Some((format!("nvme{ctrl}"), format!("nvme{ctrl}n{ns}")))
}

/// An open NVMe namespace generic device.
#[derive(Debug)]
pub struct Namespace {
    file: Arc<DeviceFile>,
    geometry: Geometry,
}

impl Namespace {
    /// Opens `path` (`/dev/ngXnY`, read-write) and learns its geometry.
    pub fn open(path: &Path) -> Result<Namespace, String> {
        Namespace::open_with(path, false)
    }

    /// Opens `path` read-only (reads only, e.g. `kvtier inspect`).
    pub fn open_read_only(path: &Path) -> Result<Namespace, String> {
        Namespace::open_with(path, true)
    }

    fn open_with(path: &Path, read_only: bool) -> Result<Namespace, String> {
        let name = generic_name(path)
            .ok_or_else(|| "not an NVMe generic character device (/dev/ngXnY)".to_owned())?;
        let (ctrl, block) =
            sibling_names(&name).ok_or_else(|| format!("cannot tell the controller of {name}"))?;
        let opts = OpenOptions {
            read_only,
            ..OpenOptions::default()
        };
        let file = DeviceFile::open(path, opts).map_err(|e| format!("open: {} ({e})", e.desc()))?;
        // SAFETY: NVME_IOCTL_ID takes no argument and returns the namespace id or -1.
        let nsid = unsafe { libc::ioctl(file.raw_fd(), IOCTL_ID as _) };
        if nsid <= 0 {
            return Err(format!("NVME_IOCTL_ID: {}", Errno::last().desc()));
        }
        let nsid = nsid.cast_unsigned();
        let controller = PathBuf::from(format!("/dev/{ctrl}"));
        let sys = PathBuf::from(format!("/sys/block/{block}"));
        // An answer from Identify is checked and refused when unsafe (the geometry is what
        // keeps the device inside our buffers); only an unavailable Identify falls to sysfs.
        let found = match identify(&controller, nsid) {
            Ok(identified) => identified.checked(&sys),
            Err(why) => {
                tracing::debug!(%why, "NVMe Identify unavailable; reading the geometry from sysfs");
                from_sysfs(&sys)
            }
        };
        let geometry = found.map(|(lba_shift, lbas, mdts)| {
            let limits = SysLimits::read(&sys);
            let max = transfer_limit(lba_shift, mdts, &limits);
            Geometry {
                nsid,
                lba_shift,
                lbas,
                max_transfer_bytes: max,
                poll_queues: limits.io_poll,
                source: if mdts.is_some() { "identify" } else { "sysfs" },
                controller: controller.clone(),
                block_device: PathBuf::from(format!("/dev/{block}")),
            }
        })?;
        Ok(Namespace {
            file: Arc::new(file),
            geometry,
        })
    }

    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    pub fn path(&self) -> &Path {
        self.file.path()
    }

    /// The open device, for registering with a ring.
    pub fn file(&self) -> &Arc<DeviceFile> {
        &self.file
    }

    pub fn raw_fd(&self) -> RawFd {
        self.file.raw_fd()
    }

    /// Checks that passthrough works here end to end: one LBA read by the ioctl (permission:
    /// kernels before 6.2 refuse I/O commands to users without `CAP_SYS_ADMIN`) and one through
    /// an io_uring `URING_CMD` with a fixed buffer (`IORING_URING_CMD_FIXED` arrived in 6.1).
    pub fn check_io(&self) -> Result<(), String> {
        let lba = self.geometry.lba_bytes() as usize;
        let buf = std::sync::Arc::new(
            Region::allocate(lba.max(4096), crate::mem::HugePages::Off)
                .map_err(|e| e.to_string())?,
        );
        self.read_sync(0, &buf, 0, lba).map_err(|e| e.to_string())?;
        let mut ring = crate::ring::Ring::new(&crate::ring::RingConfig {
            entries: 2,
            big_entries: true,
            ..crate::ring::RingConfig::default()
        })
        .map_err(|e| format!("io_uring with 128-byte SQEs: {}", e.desc()))?;
        ring.register_buffers(vec![std::sync::Arc::clone(&buf)], buf.len())
            .map_err(|e| e.to_string())?;
        ring.register_files(vec![std::sync::Arc::clone(&self.file)])
            .map_err(|e| format!("registering {}: {}", self.path().display(), e.desc()))?;
        let one = crate::ring::BufRef {
            region: 0,
            offset: 0,
            len: self.geometry.lba_bytes(),
        };
        // SAFETY: `buf` is this function's own; it is read only after the completion below.
        unsafe {
            ring.push_nvme_raw(
                0,
                0,
                Opcode::Read,
                self.geometry.nsid,
                0,
                self.geometry.lba_shift,
                one,
            )
        }
        .map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        while out.is_empty() {
            ring.submit(1)
                .map_err(|e| format!("io_uring_enter: {}", e.desc()))?;
            ring.complete(&mut out);
        }
        match Outcome::from_result(out[0].result) {
            Outcome::Done => Ok(()),
            Outcome::Status(s) => Err(format!("a URING_CMD read of LBA 0 failed: {s}")),
            Outcome::Errno(e) => Err(format!(
                "a URING_CMD read of LBA 0 with a fixed buffer failed: {} ({e}; needs Linux 6.1+)",
                e.desc()
            )),
        }
    }

    /// Reads `len` bytes at byte `offset` (both LBA multiples) into the region.
    pub fn read_sync(
        &self,
        offset: u64,
        region: &Region,
        region_offset: usize,
        len: usize,
    ) -> Result<(), CommandError> {
        self.transfer_sync(Opcode::Read, offset, region, region_offset, len)
    }

    /// Writes `len` bytes of the region at byte `offset` (both LBA multiples).
    pub fn write_sync(
        &self,
        offset: u64,
        region: &Region,
        region_offset: usize,
        len: usize,
    ) -> Result<(), CommandError> {
        self.transfer_sync(Opcode::Write, offset, region, region_offset, len)
    }

    fn transfer_sync(
        &self,
        op: Opcode,
        offset: u64,
        region: &Region,
        region_offset: usize,
        len: usize,
    ) -> Result<(), CommandError> {
        let g = &self.geometry;
        let lba = u64::from(g.lba_bytes());
        assert!(
            offset.is_multiple_of(lba) && (len as u64).is_multiple_of(lba),
            "NVMe transfer of {len} bytes at {offset} is not a multiple of the {lba}-byte LBA"
        );
        // Held as the region's accessors hold what they copy (panics on a leased block).
        let _held = region.hold(region_offset, len, op == Opcode::Read);
        let base = region.range_ptr(region_offset, len);
        let mut done = 0_usize;
        while done < len {
            let part = (len - done).min(g.max_transfer_bytes as usize);
            let slba = (offset + done as u64) >> g.lba_shift;
            let lbas = (part as u64 >> g.lba_shift) as u32;
            let mut cmd = Command::io(
                op,
                g.nsid,
                slba,
                lbas,
                base.wrapping_add(done) as u64,
                part as u32,
            );
            let fail = |outcome| CommandError {
                device: self.path().to_owned(),
                op,
                slba,
                lbas,
                outcome,
            };
            // SAFETY: the command names `part` bytes inside the region (range_ptr checked the
            // whole range), valid for the ioctl's duration while `region` is borrowed and kept
            // from every other access by `_held`; the kernel reads or writes exactly `data_len`
            // bytes there and writes `cmd.result`.
            let res = unsafe { libc::ioctl(self.raw_fd(), IOCTL_IO_CMD as _, &raw mut cmd) };
            match res {
                0 => {}
                r if r > 0 => return Err(fail(Outcome::Status(Status(r as u16)))),
                _ => return Err(fail(Outcome::Errno(Errno::last()))),
            }
            done += part;
        }
        Ok(())
    }
}

/// (LBA shift, size in LBAs, MDTS in bytes) from Identify Namespace and Identify Controller.
/// What Identify Namespace and Identify Controller say, unchecked.
struct Identified {
    lba_shift: u32,
    lbas: u64,
    /// Metadata bytes per LBA of the namespace's format.
    metadata: u32,
    /// MDTS in bytes (`u64::MAX`: no limit).
    mdts_bytes: u64,
}

impl Identified {
    /// (LBA shift, size in LBAs, MDTS) if kvtier can use this format safely: no metadata, a
    /// sane LBA size, and the same size and LBA as the namespace's sysfs entry where sysfs has
    /// them (a mismatch means `/dev/nvmeX`, chosen by name, described another namespace).
    fn checked(self, sys: &Path) -> Result<(u32, u64, Option<u64>), String> {
        // Metadata per LBA (interleaved or separate) would make the device move more than the
        // data buffer the kernel maps for a command.
        if self.metadata != 0 {
            return Err(format!(
                "the LBA format carries {} bytes of metadata per LBA, which kvtier does not \
                 handle",
                self.metadata
            ));
        }
        if !(9..=16).contains(&self.lba_shift) {
            return Err(format!(
                "Identify Namespace gives an LBA size of 2^{} bytes",
                self.lba_shift
            ));
        }
        if let Ok((shift, sys_lbas, _)) = from_sysfs(sys) {
            if (shift, sys_lbas) != (self.lba_shift, self.lbas) {
                return Err(format!(
                    "Identify disagrees with {}: {} LBAs of {} B against {sys_lbas} of {} B",
                    sys.display(),
                    self.lbas,
                    1_u64 << self.lba_shift,
                    1_u64 << shift
                ));
            }
        }
        Ok((self.lba_shift, self.lbas, Some(self.mdts_bytes)))
    }
}

fn identify(controller: &Path, nsid: u32) -> Result<Identified, String> {
    let ctrl = File::open(controller).map_err(|e| format!("open {}: {e}", controller.display()))?;
    let page = Region::allocate(8192, crate::mem::HugePages::Off).map_err(|e| e.to_string())?;
    let ns = admin_identify(&ctrl, &page, 0, nsid, 0)?;
    let controller_page = admin_identify(&ctrl, &page, 4096, 0, 1)?;
    let nsze = u64::from_le_bytes(ns[0..8].try_into().unwrap_or_default());
    let flbas = ns[26];
    // Bits 0..4 index the LBA format; with more than 16 formats bits 5..7 are the high bits.
    let index = usize::from(flbas & 0xf) | (usize::from(flbas >> 5 & 0x3) << 4);
    let lbaf = u32::from_le_bytes(
        ns[128 + 4 * index..132 + 4 * index]
            .try_into()
            .unwrap_or_default(),
    );
    // MDTS is a power of two in units of the controller's minimum page size; Linux always uses
    // 4 KiB pages with NVMe (NVME_CTRL_PAGE_SIZE). 0 means no limit.
    let mdts = controller_page[77];
    Ok(Identified {
        lba_shift: (lbaf >> 16) & 0xff,
        lbas: nsze,
        metadata: lbaf & 0xffff,
        mdts_bytes: if mdts == 0 {
            u64::MAX
        } else {
            4096_u64 << mdts.min(20)
        },
    })
}

fn admin_identify(
    ctrl: &File,
    page: &Region,
    at: usize,
    nsid: u32,
    cns: u32,
) -> Result<Vec<u8>, String> {
    let addr = page.range_ptr(at, 4096) as u64;
    let mut cmd = Command {
        opcode: 0x06,
        nsid,
        addr,
        data_len: 4096,
        cdw10: cns,
        ..Command::default()
    };
    // SAFETY: the command names 4096 bytes of `page`, alive and unaliased for the ioctl.
    let res = unsafe { libc::ioctl(ctrl.as_raw_fd(), IOCTL_ADMIN_CMD as _, &raw mut cmd) };
    if res < 0 {
        return Err(format!("Identify (CNS {cns}): {}", Errno::last().desc()));
    }
    if res > 0 {
        return Err(format!("Identify (CNS {cns}): {}", Status(res as u16)));
    }
    let mut out = vec![0_u8; 4096];
    page.read(at, &mut out);
    Ok(out)
}

/// The longest transfer of one command: the least of MDTS, the driver's `max_hw_sectors_kb`
/// and `max_segments` 4 KiB pages (a buffer of small pages needs a segment per page; past the
/// limit the kernel would bounce the data through a copy), 128 KiB when none is known, in whole
/// LBAs.
fn transfer_limit(lba_shift: u32, mdts: Option<u64>, limits: &SysLimits) -> u32 {
    let mut max = mdts.unwrap_or(u64::MAX);
    if let Some(hw) = limits.max_hw_bytes {
        max = max.min(hw);
    }
    if let Some(segments) = limits.max_segments {
        max = max.min(segments * 4096);
    }
    if max == u64::MAX {
        max = 128 << 10;
    }
    let lba = 1_u64 << lba_shift;
    // At most 65536 LBAs (the NLB field) and below 4 GiB (the u32 data length).
    let max = max
        .min(u64::from(MAX_LBAS_PER_COMMAND) * lba)
        .min(u64::from(u32::MAX));
    let max = (max / lba * lba).max(lba);
    u32::try_from(max).unwrap_or(u32::MAX)
}

fn sysfs_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// (LBA shift, size in LBAs, no MDTS) from `/sys/block/nvmeXnY`.
fn from_sysfs(sys: &Path) -> Result<(u32, u64, Option<u64>), String> {
    let lba = sysfs_u64(&sys.join("queue/logical_block_size"))
        .ok_or_else(|| format!("cannot read {}/queue/logical_block_size", sys.display()))?;
    let sectors = sysfs_u64(&sys.join("size"))
        .ok_or_else(|| format!("cannot read {}/size", sys.display()))?;
    if sysfs_u64(&sys.join("metadata_bytes")).is_some_and(|m| m != 0) {
        return Err(format!(
            "{}/metadata_bytes is not 0: LBAs with metadata, which kvtier does not handle",
            sys.display()
        ));
    }
    if !lba.is_power_of_two() || !(512..=65536).contains(&lba) {
        return Err(format!(
            "logical block size {lba} is not a power of two in 512..=65536"
        ));
    }
    let shift = lba.trailing_zeros();
    Ok((shift, (sectors * 512) >> shift, None))
}

struct SysLimits {
    max_hw_bytes: Option<u64>,
    max_segments: Option<u64>,
    io_poll: bool,
}

impl SysLimits {
    fn read(sys: &Path) -> SysLimits {
        SysLimits {
            max_hw_bytes: sysfs_u64(&sys.join("queue/max_hw_sectors_kb")).map(|kb| kb << 10),
            max_segments: sysfs_u64(&sys.join("queue/max_segments")),
            io_poll: sysfs_u64(&sys.join("queue/io_poll")) == Some(1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_match_the_kernel_headers() {
        // From <linux/nvme_ioctl.h> on x86-64.
        assert_eq!(URING_CMD_IO, 0xC048_4E80);
        assert_eq!(IOCTL_ADMIN_CMD, 0xC048_4E41);
        assert_eq!(IOCTL_IO_CMD, 0xC048_4E43);
        assert_eq!(IOCTL_ID, 0x4E40);
    }

    #[test]
    fn io_command_layout() {
        let word =
            |b: &[u8], at: usize| u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        let cmd = Command::io(Opcode::Read, 1, 0x1_0000_0002, 8, 0xdead_b000, 4096);
        let b = cmd.to_sqe_bytes();
        assert_eq!(b[0], 0x02);
        assert_eq!(word(&b, 4), 1);
        assert_eq!(
            u64::from(word(&b, 24)) | u64::from(word(&b, 28)) << 32,
            0xdead_b000
        );
        assert_eq!(word(&b, 36), 4096);
        assert_eq!(word(&b, 40), 2, "cdw10: low LBA");
        assert_eq!(word(&b, 44), 1, "cdw11: high LBA");
        assert_eq!(word(&b, 48), 7, "cdw12: NLB - 1");
        assert!(b[72..].iter().all(|&x| x == 0));
    }

    #[test]
    fn statuses_name_the_failure_and_the_retry_rule() {
        let out_of_range = Status(0x4080);
        assert_eq!(out_of_range.text(), "LBA out of range");
        assert!(!out_of_range.retryable());
        assert_eq!(out_of_range.errno(), Errno::EINVAL);
        assert_eq!(
            out_of_range.to_string(),
            "LBA out of range (NVMe status 0x4080, do not retry)"
        );
        let not_ready = Status(0x0082);
        assert!(not_ready.retryable());
        assert_eq!(not_ready.errno(), Errno::EAGAIN);
        assert_eq!(Status(0x0281).text(), "unrecovered read error");
        assert_eq!(Status(0x0281).errno(), Errno::EIO);
        assert_eq!(Outcome::from_result(0), Outcome::Done);
        assert_eq!(Outcome::from_result(0x4080), Outcome::Status(out_of_range));
        assert_eq!(Outcome::from_result(-5), Outcome::Errno(Errno::EIO));
        let err = CommandError {
            device: "/dev/ng0n1".into(),
            op: Opcode::Read,
            slba: 100,
            lbas: 8,
            outcome: Outcome::Status(out_of_range),
        };
        assert_eq!(
            err.to_string(),
            "NVMe read of LBAs 100..108 on /dev/ng0n1 failed: LBA out of range (NVMe status \
             0x4080, do not retry)"
        );
    }

    #[test]
    fn generic_names_map_to_their_controller_and_block_device() {
        assert_eq!(
            sibling_names("ng0n1"),
            Some(("nvme0".to_owned(), "nvme0n1".to_owned()))
        );
        assert_eq!(
            sibling_names("ng12n3"),
            Some(("nvme12".to_owned(), "nvme12n3".to_owned()))
        );
        assert_eq!(sibling_names("ng0"), None);
        assert_eq!(sibling_names("nvme0n1"), None);
        assert_eq!(
            generic_name(Path::new("/dev/null")),
            None,
            "a char device of another class"
        );
        assert_eq!(generic_name(Path::new("/")), None);
    }

    #[test]
    fn geometry_from_sysfs_when_identify_is_not_allowed() {
        let dir = tempfile::tempdir().expect("dir");
        let sys = dir.path();
        std::fs::create_dir_all(sys.join("queue")).expect("queue dir");
        let put = |name: &str, value: &str| std::fs::write(sys.join(name), value).expect(name);
        put("queue/logical_block_size", "4096\n");
        put("size", "1048576\n"); // 512-byte sectors: 512 MiB
        put("queue/max_hw_sectors_kb", "512\n");
        put("queue/max_segments", "33\n");
        put("queue/io_poll", "1\n");
        assert_eq!(from_sysfs(sys), Ok((12, 131_072, None)));
        let limits = SysLimits::read(sys);
        assert_eq!(limits.max_hw_bytes, Some(512 << 10));
        assert_eq!(limits.max_segments, Some(33));
        assert!(limits.io_poll);
        put("queue/logical_block_size", "1000\n");
        let err = from_sysfs(sys).expect_err("not a power of two");
        assert!(err.contains("1000"), "{err}");
        std::fs::remove_file(sys.join("size")).expect("rm");
        assert!(from_sysfs(sys).expect_err("no size").contains("size"));
    }

    #[test]
    fn the_transfer_limit_is_the_least_of_the_device_limits() {
        let limits = |hw: Option<u64>, segments: Option<u64>| SysLimits {
            max_hw_bytes: hw,
            max_segments: segments,
            io_poll: false,
        };
        // QEMU's defaults: MDTS 7 (512 KiB), 512 KiB, 128 segments.
        assert_eq!(
            transfer_limit(9, Some(512 << 10), &limits(Some(512 << 10), Some(128))),
            512 << 10
        );
        // MDTS 5, 33 segments: MDTS wins.
        assert_eq!(
            transfer_limit(12, Some(128 << 10), &limits(Some(128 << 10), Some(33))),
            128 << 10
        );
        // Few segments: 127 pages, rounded down to whole 4 KiB LBAs.
        assert_eq!(
            transfer_limit(12, None, &limits(Some(2 << 20), Some(127))),
            127 * 4096
        );
        // Nothing known: 128 KiB.
        assert_eq!(transfer_limit(9, None, &limits(None, None)), 128 << 10);
        // No MDTS limit (0 in Identify) and large hardware limits: 65536 LBAs at most.
        assert_eq!(
            transfer_limit(12, Some(u64::MAX), &limits(Some(1 << 40), None)),
            256 << 20,
            "65536 LBAs, the NLB field"
        );
        assert_eq!(
            transfer_limit(9, Some(u64::MAX), &limits(Some(64 << 20), None)),
            32 << 20
        );
    }

    #[test]
    fn identify_answers_with_metadata_or_against_sysfs_are_refused() {
        let dir = tempfile::tempdir().expect("dir");
        let sys = dir.path();
        let answer = |metadata, lba_shift, lbas| Identified {
            lba_shift,
            lbas,
            metadata,
            mdts_bytes: 512 << 10,
        };
        // No sysfs entry to compare with: a clean format is taken as it is.
        assert_eq!(
            answer(0, 12, 1000).checked(sys),
            Ok((12, 1000, Some(512 << 10)))
        );
        let err = answer(8, 12, 1000).checked(sys).expect_err("metadata");
        assert!(err.contains("8 bytes of metadata"), "{err}");
        assert!(answer(0, 7, 1000).checked(sys).is_err(), "128-byte LBAs");
        std::fs::create_dir_all(sys.join("queue")).expect("queue dir");
        std::fs::write(sys.join("queue/logical_block_size"), "4096\n").expect("lba");
        std::fs::write(sys.join("size"), "8000\n").expect("size"); // 1000 LBAs of 4 KiB
        assert_eq!(
            answer(0, 12, 1000).checked(sys),
            Ok((12, 1000, Some(512 << 10)))
        );
        let err = answer(0, 9, 8000)
            .checked(sys)
            .expect_err("another namespace");
        assert!(err.contains("disagrees"), "{err}");
    }
}
