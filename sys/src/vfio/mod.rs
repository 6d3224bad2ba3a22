//! VFIO: a PCI device taken from the kernel and driven from user space (type1 IOMMU containers).
//!
//! * [`Device::open`] opens the device at a PCI address bound to `vfio-pci`: its IOMMU group
//!   (`/dev/vfio/<group>`, which must be viable: every device in it bound to `vfio-pci` or to no
//!   driver), a container (`/dev/vfio/vfio`) with the type1v2 IOMMU, the device's fd, BAR 0
//!   mapped for register access, and the IOVA ranges the IOMMU accepts.
//! * [`Device::map_dma`] pins memory and maps it into the device's IOMMU domain at an IOVA the
//!   device allocates from those ranges (a bump allocator, 2 MiB aligned), so the IOVA fits the
//!   IOMMU's address width whatever the virtual address is; [`Device::unmap_dma`] undoes it.
//! * [`Device::set_bus_master`] turns the device's DMA on and off (PCI command register): off is
//!   the last word of a fence, since a device without bus mastering issues no DMA at all.
//!
//! The kernel's own guarantee, when a process dies with a device open: closing the device fd
//! makes `vfio-pci` clear bus mastering and reset the function before the container's mappings
//! go, so a killed process leaves no DMA running into freed memory.
//!
//! [`nvme`] drives an NVMe controller over this.

pub mod nvme;

use std::ffi::CString;
use std::fs;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::ptr::NonNull;

use crate::Errno;

/// `<linux/vfio.h>`: every VFIO ioctl is `_IO(';', 100 + n)`.
const fn vfio_io(n: u64) -> u64 {
    (b';' as u64) << 8 | (100 + n)
}
const VFIO_GET_API_VERSION: u64 = vfio_io(0);
const VFIO_CHECK_EXTENSION: u64 = vfio_io(1);
const VFIO_SET_IOMMU: u64 = vfio_io(2);
const VFIO_GROUP_GET_STATUS: u64 = vfio_io(3);
const VFIO_GROUP_SET_CONTAINER: u64 = vfio_io(4);
const VFIO_GROUP_GET_DEVICE_FD: u64 = vfio_io(6);
const VFIO_DEVICE_GET_REGION_INFO: u64 = vfio_io(8);
const VFIO_DEVICE_RESET: u64 = vfio_io(11);
const VFIO_IOMMU_GET_INFO: u64 = vfio_io(12);
const VFIO_IOMMU_MAP_DMA: u64 = vfio_io(13);
const VFIO_IOMMU_UNMAP_DMA: u64 = vfio_io(14);

const VFIO_API_VERSION: i32 = 0;
const VFIO_TYPE1V2_IOMMU: u64 = 3;
const VFIO_GROUP_FLAGS_VIABLE: u32 = 1;
const VFIO_REGION_INFO_FLAG_MMAP: u32 = 1 << 2;
const VFIO_PCI_BAR0_REGION_INDEX: u32 = 0;
const VFIO_PCI_CONFIG_REGION_INDEX: u32 = 7;
const VFIO_IOMMU_INFO_CAPS: u32 = 1 << 1;
const VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE: u16 = 1;
const VFIO_DMA_MAP_FLAG_READ: u32 = 1;
const VFIO_DMA_MAP_FLAG_WRITE: u32 = 1 << 1;

/// PCI configuration space: the command register and its bits.
const PCI_COMMAND: u64 = 0x04;
const PCI_COMMAND_MEMORY: u16 = 1 << 1;
const PCI_COMMAND_MASTER: u16 = 1 << 2;
const PCI_COMMAND_INTX_DISABLE: u16 = 1 << 10;

/// IOVAs are handed out 2 MiB aligned (a hugetlb page maps as one IOMMU entry), from here up:
/// IOVA 0 is left unused, so a zeroed address field never names mapped memory.
const IOVA_ALIGN: u64 = 2 << 20;

#[repr(C)]
struct GroupStatus {
    argsz: u32,
    flags: u32,
}

#[repr(C)]
#[derive(Default)]
struct RegionInfo {
    argsz: u32,
    flags: u32,
    index: u32,
    cap_offset: u32,
    size: u64,
    offset: u64,
}

#[repr(C)]
struct DmaMap {
    argsz: u32,
    flags: u32,
    vaddr: u64,
    iova: u64,
    size: u64,
}

#[repr(C)]
struct DmaUnmap {
    argsz: u32,
    flags: u32,
    iova: u64,
    size: u64,
}

/// `ioctl(fd, request, arg)`, the request and argument as VFIO defines them.
///
/// # Safety
///
/// `arg` must be what `request` expects: a value, or a pointer to a structure of the size its
/// `argsz` says, valid for the call.
unsafe fn ioctl(fd: RawFd, request: u64, arg: libc::c_ulong) -> Result<i32, Errno> {
    // SAFETY: the caller passes the argument `request` expects.
    let r = unsafe { libc::ioctl(fd, request as libc::Ioctl, arg) };
    if r < 0 {
        Err(Errno::last())
    } else {
        Ok(r)
    }
}

fn open_rw(path: &str) -> Result<OwnedFd, Errno> {
    let c = CString::new(path).map_err(|_| Errno::EINVAL)?;
    let fd = crate::fd::open_at(libc::AT_FDCWD, &c, libc::O_RDWR | libc::O_CLOEXEC, 0)?;
    // SAFETY: `open_at` returned a fresh descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A PCI address as sysfs spells it (`0000:01:00.0`): domain, bus, device and function in hex.
pub fn check_pci_address(pci: &str) -> Result<(), String> {
    let ok = pci.len() == 12
        && pci.char_indices().all(|(i, c)| match i {
            4 | 7 => c == ':',
            10 => c == '.',
            _ => c.is_ascii_hexdigit(),
        });
    if ok {
        Ok(())
    } else {
        Err(format!(
            "PCI address {pci:?} is not of the form DDDD:BB:DD.F (e.g. \"0000:01:00.0\"; \
             `lspci -D` or `kvtier probe` lists them)"
        ))
    }
}

/// The driver a PCI device is bound to (`nvme`, `vfio-pci`), if any.
pub fn pci_driver(pci: &str) -> Option<String> {
    let link = fs::read_link(format!("/sys/bus/pci/devices/{pci}/driver")).ok()?;
    Some(link.file_name()?.to_string_lossy().into_owned())
}

/// The IOMMU group of a PCI device, if the kernel put it in one (an IOMMU is on).
pub fn pci_iommu_group(pci: &str) -> Option<u32> {
    let link = fs::read_link(format!("/sys/bus/pci/devices/{pci}/iommu_group")).ok()?;
    link.file_name()?.to_str()?.parse().ok()
}

/// An NVMe controller on the PCI bus (class 01:08:02), as sysfs describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PciNvme {
    pub pci: String,
    /// The driver bound to it (`nvme`, `vfio-pci`), if any.
    pub driver: Option<String>,
    /// Its IOMMU group, if an IOMMU is on.
    pub iommu_group: Option<u32>,
    /// Its namespaces' block devices (`nvme0n1`) while the kernel's driver holds it.
    pub namespaces: Vec<String>,
    /// Mount points of file systems on those namespaces or their partitions.
    pub mounted: Vec<String>,
}

/// Every NVMe controller on the PCI bus, by address.
pub fn nvme_controllers() -> Vec<PciNvme> {
    let Ok(entries) = fs::read_dir("/sys/bus/pci/devices") else {
        return Vec::new();
    };
    let mounts = fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let mut out: Vec<PciNvme> = entries
        .flatten()
        .filter_map(|e| {
            let pci = e.file_name().to_string_lossy().into_owned();
            let class = fs::read_to_string(e.path().join("class")).ok()?;
            (class.trim() == "0x010802").then_some(pci)
        })
        .map(|pci| {
            let namespaces = controller_namespaces(&pci);
            let mounted = mounts
                .lines()
                .filter_map(|line| {
                    let mut f = line.split_whitespace();
                    let (dev, at) = (f.next()?, f.next()?);
                    let name = dev.strip_prefix("/dev/")?;
                    namespaces
                        .iter()
                        .any(|ns| {
                            name == ns
                                || name
                                    .strip_prefix(ns.as_str())
                                    .is_some_and(|p| p.starts_with('p'))
                        })
                        .then(|| format!("{at} ({dev})"))
                })
                .collect();
            PciNvme {
                driver: pci_driver(&pci),
                iommu_group: pci_iommu_group(&pci),
                namespaces,
                mounted,
                pci,
            }
        })
        .collect();
    out.sort_by(|a, b| a.pci.cmp(&b.pci));
    out
}

/// The namespaces (`nvmeXnY`) of the controller at `pci`, from sysfs.
fn controller_namespaces(pci: &str) -> Vec<String> {
    let mut out = Vec::new();
    let Ok(ctrls) = fs::read_dir(format!("/sys/bus/pci/devices/{pci}/nvme")) else {
        return out;
    };
    for ctrl in ctrls.flatten() {
        let Ok(entries) = fs::read_dir(ctrl.path()) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("nvme") && e.path().join("nsid").exists() {
                out.push(name);
            }
        }
    }
    out.sort();
    out
}

/// Memory-mapped device registers (a BAR): 32- and 64-bit volatile accesses only.
pub struct Mmio {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: an Mmio is a pointer to device registers mapped for its whole life; register accesses
// are single volatile loads and stores, which any thread may make.
unsafe impl Send for Mmio {}
// SAFETY: as for Send: no access forms a Rust reference to the registers.
unsafe impl Sync for Mmio {}

impl Mmio {
    fn at(&self, offset: usize, size: usize) -> *mut u8 {
        assert!(
            offset.is_multiple_of(size) && offset + size <= self.len,
            "register {offset:#x} ({size} bytes) outside the {}-byte mapping",
            self.len
        );
        // SAFETY: in bounds of the mapping (checked above).
        unsafe { self.ptr.as_ptr().add(offset) }
    }

    // `at` checked the alignment the cast needs.
    #[allow(clippy::cast_ptr_alignment)]
    pub fn read32(&self, offset: usize) -> u32 {
        // SAFETY: `at` checked the register is inside the mapping and aligned.
        unsafe { self.at(offset, 4).cast::<u32>().read_volatile() }
    }

    #[allow(clippy::cast_ptr_alignment)]
    pub fn write32(&self, offset: usize, value: u32) {
        // SAFETY: `at` checked the register is inside the mapping and aligned.
        unsafe { self.at(offset, 4).cast::<u32>().write_volatile(value) }
    }

    /// A 64-bit register as two 32-bit reads, low half first (what the NVMe specification
    /// allows hosts without 64-bit MMIO).
    pub fn read64(&self, offset: usize) -> u64 {
        u64::from(self.read32(offset)) | u64::from(self.read32(offset + 4)) << 32
    }

    /// A 64-bit register as two 32-bit writes, low half first.
    pub fn write64(&self, offset: usize, value: u64) {
        // Truncation intended: the low half.
        self.write32(offset, value as u32);
        self.write32(offset + 4, (value >> 32) as u32);
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Mmio {
    fn drop(&mut self) {
        // SAFETY: ptr/len are the mapping made in `Device::map_bar0`, unmapped once here.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// One DMA mapping: `len` bytes at virtual address `vaddr`, seen by the device at `iova`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mapping {
    pub vaddr: usize,
    pub iova: u64,
    pub len: usize,
}

/// A PCI device opened through VFIO, with its container and group.
pub struct Device {
    pci: String,
    // Field order is drop order: the device fd closes before its group, the group before its
    // container (the kernel resets the device on the first close).
    fd: OwnedFd,
    _group: OwnedFd,
    container: OwnedFd,
    group_number: u32,
    config_offset: u64,
    bar0_offset: u64,
    bar0_size: u64,
    bar0_mmap: bool,
    /// IOVA ranges the IOMMU accepts (inclusive ends), and the next free IOVA.
    ranges: Vec<(u64, u64)>,
    next_iova: u64,
    mappings: Vec<Mapping>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("pci", &self.pci)
            .field("group", &self.group_number)
            .field("bar0_size", &self.bar0_size)
            .field("iova_ranges", &self.ranges)
            .field("mappings", &self.mappings.len())
            .finish_non_exhaustive()
    }
}

impl Device {
    /// Opens the device at `pci` (bound to `vfio-pci`). Errors say what is missing and how to
    /// fix it (the binding, the group's other devices, the permissions on `/dev/vfio/<group>`).
    pub fn open(pci: &str) -> Result<Device, String> {
        check_pci_address(pci)?;
        if !Path::new(&format!("/sys/bus/pci/devices/{pci}")).exists() {
            return Err(format!(
                "no PCI device {pci} (`kvtier probe` lists NVMe controllers)"
            ));
        }
        let group_number = check_binding(pci)?;
        let container = open_rw("/dev/vfio/vfio")
            .map_err(|e| format!("/dev/vfio/vfio: {e} (modprobe vfio-pci)"))?;
        // SAFETY: VFIO_GET_API_VERSION takes no argument.
        let version = unsafe { ioctl(container.as_raw_fd(), VFIO_GET_API_VERSION, 0) }
            .map_err(|e| format!("VFIO_GET_API_VERSION: {e}"))?;
        if version != VFIO_API_VERSION {
            return Err(format!(
                "VFIO API version {version}, kvtier speaks {VFIO_API_VERSION}"
            ));
        }
        // SAFETY: VFIO_CHECK_EXTENSION takes the extension number by value.
        let type1 = unsafe {
            ioctl(
                container.as_raw_fd(),
                VFIO_CHECK_EXTENSION,
                VFIO_TYPE1V2_IOMMU as _,
            )
        }
        .unwrap_or(0);
        if type1 != 1 {
            return Err(
                "the kernel's VFIO has no type1v2 IOMMU (modprobe vfio_iommu_type1)".into(),
            );
        }
        let group_path = format!("/dev/vfio/{group_number}");
        let group = open_rw(&group_path).map_err(|e| {
            format!(
                "{group_path}: {e} (the IOMMU group of {pci}: run as root or give this user \
                 the device node; a group is open in one process at a time)"
            )
        })?;
        let mut status = GroupStatus {
            argsz: std::mem::size_of::<GroupStatus>() as u32,
            flags: 0,
        };
        // SAFETY: VFIO_GROUP_GET_STATUS fills a `struct vfio_group_status` of `argsz` bytes.
        unsafe {
            ioctl(
                group.as_raw_fd(),
                VFIO_GROUP_GET_STATUS,
                &raw mut status as _,
            )
        }
        .map_err(|e| format!("VFIO_GROUP_GET_STATUS on {group_path}: {e}"))?;
        if status.flags & VFIO_GROUP_FLAGS_VIABLE == 0 {
            return Err(format!(
                "IOMMU group {group_number} of {pci} is not viable: every device in \
                 /sys/kernel/iommu_groups/{group_number}/devices must be bound to vfio-pci or to \
                 no driver"
            ));
        }
        let container_fd = container.as_raw_fd();
        // SAFETY: VFIO_GROUP_SET_CONTAINER takes a pointer to the container's fd.
        unsafe {
            ioctl(
                group.as_raw_fd(),
                VFIO_GROUP_SET_CONTAINER,
                &raw const container_fd as _,
            )
        }
        .map_err(|e| format!("VFIO_GROUP_SET_CONTAINER: {e}"))?;
        // SAFETY: VFIO_SET_IOMMU takes the IOMMU type by value.
        unsafe { ioctl(container_fd, VFIO_SET_IOMMU, VFIO_TYPE1V2_IOMMU as _) }
            .map_err(|e| format!("VFIO_SET_IOMMU (type1v2): {e}"))?;
        let name = CString::new(pci).map_err(|_| "PCI address with a NUL byte".to_owned())?;
        // SAFETY: VFIO_GROUP_GET_DEVICE_FD takes a NUL-terminated device name.
        let raw = unsafe {
            ioctl(
                group.as_raw_fd(),
                VFIO_GROUP_GET_DEVICE_FD,
                name.as_ptr() as _,
            )
        }
        .map_err(|e| format!("VFIO_GROUP_GET_DEVICE_FD {pci}: {e}"))?;
        // SAFETY: the ioctl returned a fresh descriptor nothing else owns.
        let device = unsafe { OwnedFd::from_raw_fd(raw) };
        let config = region_info(&device, VFIO_PCI_CONFIG_REGION_INDEX)
            .map_err(|e| format!("{pci}: config space region: {e}"))?;
        let bar0 = region_info(&device, VFIO_PCI_BAR0_REGION_INDEX)
            .map_err(|e| format!("{pci}: BAR 0 region: {e}"))?;
        if bar0.size == 0 {
            return Err(format!("{pci} has no BAR 0"));
        }
        let ranges = iova_ranges(container_fd).map_err(|e| format!("VFIO_IOMMU_GET_INFO: {e}"))?;
        Ok(Device {
            pci: pci.to_owned(),
            fd: device,
            _group: group,
            container,
            group_number,
            config_offset: config.offset,
            bar0_offset: bar0.offset,
            bar0_size: bar0.size,
            bar0_mmap: bar0.flags & VFIO_REGION_INFO_FLAG_MMAP != 0,
            ranges,
            next_iova: IOVA_ALIGN,
            mappings: Vec::new(),
        })
    }

    pub fn pci(&self) -> &str {
        &self.pci
    }

    pub fn group(&self) -> u32 {
        self.group_number
    }

    /// The IOVA ranges the IOMMU accepts (inclusive ends).
    pub fn iova_ranges(&self) -> &[(u64, u64)] {
        &self.ranges
    }

    /// The DMA mappings made and not yet undone.
    pub fn mappings(&self) -> &[Mapping] {
        &self.mappings
    }

    pub fn bar0_size(&self) -> u64 {
        self.bar0_size
    }

    /// Reads `buf.len()` bytes of BAR 0 at `offset` through the device fd (before it is mapped).
    pub fn read_bar0(&self, offset: u64, buf: &mut [u8]) -> Result<(), Errno> {
        let n = crate::fd::pread(self.fd.as_raw_fd(), buf, self.bar0_offset + offset)?;
        if n == buf.len() {
            Ok(())
        } else {
            Err(Errno::EIO)
        }
    }

    /// Maps the first `len` bytes of BAR 0 (rounded up to 4 KiB) for register access.
    pub fn map_bar0(&self, len: usize) -> Result<Mmio, String> {
        if !self.bar0_mmap {
            return Err(format!(
                "{}: BAR 0 cannot be memory-mapped through VFIO",
                self.pci
            ));
        }
        let len = len.next_multiple_of(4096).min(self.bar0_size as usize);
        // SAFETY: a fresh shared mapping of the device's BAR region; the kernel checks the
        // offset and length against the region.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                self.fd.as_raw_fd(),
                libc::off_t::try_from(self.bar0_offset).map_err(|_| "BAR 0 offset".to_owned())?,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(format!(
                "{}: mmap of BAR 0 ({len} bytes): {}",
                self.pci,
                Errno::last()
            ));
        }
        let ptr = NonNull::new(ptr.cast()).ok_or_else(|| "mmap returned NULL".to_owned())?;
        Ok(Mmio { ptr, len })
    }

    fn config_read16(&self, offset: u64) -> Result<u16, Errno> {
        let mut b = [0_u8; 2];
        crate::fd::pread(self.fd.as_raw_fd(), &mut b, self.config_offset + offset)?;
        Ok(u16::from_le_bytes(b))
    }

    fn config_write16(&self, offset: u64, value: u16) -> Result<(), Errno> {
        let b = value.to_le_bytes();
        crate::fd::pwrite(self.fd.as_raw_fd(), &b, self.config_offset + offset)?;
        Ok(())
    }

    /// Turns the device's memory decoding and DMA (bus mastering) on, legacy interrupts off;
    /// or DMA off (`false`): from then on the device issues no memory transaction.
    pub fn set_bus_master(&self, on: bool) -> Result<(), Errno> {
        let cmd = self.config_read16(PCI_COMMAND)?;
        let cmd = if on {
            cmd | PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER | PCI_COMMAND_INTX_DISABLE
        } else {
            cmd & !PCI_COMMAND_MASTER
        };
        self.config_write16(PCI_COMMAND, cmd)
    }

    /// Whether bus mastering is on (PCI command register).
    pub fn bus_master(&self) -> Result<bool, Errno> {
        Ok(self.config_read16(PCI_COMMAND)? & PCI_COMMAND_MASTER != 0)
    }

    /// A function-level (or bus) reset through VFIO, where the device supports one.
    pub fn reset(&self) -> Result<(), Errno> {
        // SAFETY: VFIO_DEVICE_RESET takes no argument.
        unsafe { ioctl(self.fd.as_raw_fd(), VFIO_DEVICE_RESET, 0) }.map(|_| ())
    }

    /// Maps `len` bytes at `vaddr` for DMA in both directions and returns the IOVA the device
    /// sees them at. The kernel pins the pages (counted against `RLIMIT_MEMLOCK`).
    ///
    /// # Safety
    ///
    /// `vaddr..vaddr + len` must stay mapped until [`Device::unmap_dma`] has removed the mapping
    /// (or the device is dropped) and the device can no longer reach it: DMA into it must be
    /// expected from the moment the device is told its IOVA.
    pub unsafe fn map_dma(&mut self, vaddr: usize, len: usize) -> Result<u64, String> {
        if len == 0 || !len.is_multiple_of(4096) || !vaddr.is_multiple_of(4096) {
            return Err(format!(
                "DMA mapping of {len} bytes at {vaddr:#x}: not 4 KiB aligned"
            ));
        }
        let iova = self.alloc_iova(len as u64)?;
        let map = DmaMap {
            argsz: std::mem::size_of::<DmaMap>() as u32,
            flags: VFIO_DMA_MAP_FLAG_READ | VFIO_DMA_MAP_FLAG_WRITE,
            vaddr: vaddr as u64,
            iova,
            size: len as u64,
        };
        // SAFETY: VFIO_IOMMU_MAP_DMA reads a `struct vfio_iommu_type1_dma_map` of `argsz`
        // bytes; the caller keeps the memory mapped while the mapping lives.
        unsafe {
            ioctl(
                self.container.as_raw_fd(),
                VFIO_IOMMU_MAP_DMA,
                &raw const map as _,
            )
        }
        .map_err(|e| {
            let hint = if e == Errno::ENOMEM {
                " (pinned memory counts against `ulimit -l`: raise it or run as root)"
            } else {
                ""
            };
            format!("VFIO_IOMMU_MAP_DMA of {len} bytes at IOVA {iova:#x}: {e}{hint}")
        })?;
        self.next_iova = iova + (len as u64).next_multiple_of(IOVA_ALIGN);
        self.mappings.push(Mapping { vaddr, iova, len });
        Ok(iova)
    }

    /// Removes the mapping at `iova`: the device's accesses there fault from now on.
    pub fn unmap_dma(&mut self, iova: u64) -> Result<(), String> {
        let Some(i) = self.mappings.iter().position(|m| m.iova == iova) else {
            return Err(format!("no DMA mapping at IOVA {iova:#x}"));
        };
        let m = self.mappings[i];
        let unmap = DmaUnmap {
            argsz: std::mem::size_of::<DmaUnmap>() as u32,
            flags: 0,
            iova: m.iova,
            size: m.len as u64,
        };
        // SAFETY: VFIO_IOMMU_UNMAP_DMA reads a `struct vfio_iommu_type1_dma_unmap`.
        unsafe {
            ioctl(
                self.container.as_raw_fd(),
                VFIO_IOMMU_UNMAP_DMA,
                &raw const unmap as _,
            )
        }
        .map_err(|e| format!("VFIO_IOMMU_UNMAP_DMA at IOVA {iova:#x}: {e}"))?;
        self.mappings.swap_remove(i);
        Ok(())
    }

    /// The next 2 MiB aligned IOVA range of `len` bytes inside one of the IOMMU's ranges.
    fn alloc_iova(&self, len: u64) -> Result<u64, String> {
        for &(start, end) in &self.ranges {
            let at = self.next_iova.max(start).next_multiple_of(IOVA_ALIGN);
            if at.checked_add(len - 1).is_some_and(|last| last <= end) {
                return Ok(at);
            }
        }
        Err(format!(
            "the IOMMU of {} has no room for {len} bytes of DMA at or above IOVA {:#x} \
             (its ranges: {}); its address width is too small for kvtier's region",
            self.pci,
            self.next_iova,
            self.ranges
                .iter()
                .map(|(s, e)| format!("{s:#x}..={e:#x}"))
                .collect::<Vec<_>>()
                .join(", ")
        ))
    }
}

/// The IOMMU group of the device at `pci`, after checking that `vfio-pci` holds it.
fn check_binding(pci: &str) -> Result<u32, String> {
    match pci_driver(pci).as_deref() {
        Some("vfio-pci") => {}
        other => {
            return Err(format!(
                "PCI device {pci} is bound to {}, not vfio-pci: as root, \
                     `echo {pci} > /sys/bus/pci/devices/{pci}/driver/unbind; \
                     echo vfio-pci > /sys/bus/pci/devices/{pci}/driver_override; \
                     echo {pci} > /sys/bus/pci/drivers_probe` (modprobe vfio-pci first)",
                other.map_or_else(|| "no driver".to_owned(), |d| format!("driver {d}"))
            ))
        }
    }
    pci_iommu_group(pci).ok_or_else(|| {
        format!(
            "PCI device {pci} is in no IOMMU group: boot with the IOMMU on \
                 (intel_iommu=on or amd_iommu=on)"
        )
    })
}

fn region_info(device: &OwnedFd, index: u32) -> Result<RegionInfo, Errno> {
    let mut info = RegionInfo {
        argsz: std::mem::size_of::<RegionInfo>() as u32,
        index,
        ..RegionInfo::default()
    };
    // SAFETY: VFIO_DEVICE_GET_REGION_INFO fills a `struct vfio_region_info` of `argsz` bytes
    // (capabilities past it are only written when argsz leaves room for them).
    unsafe {
        ioctl(
            device.as_raw_fd(),
            VFIO_DEVICE_GET_REGION_INFO,
            &raw mut info as _,
        )
    }?;
    Ok(info)
}

/// The IOVA ranges of the container's IOMMU (the IOVA range capability of
/// `VFIO_IOMMU_GET_INFO`); without the capability (kernels before 5.4), the 39 bits every
/// VT-d and AMD-Vi IOMMU has.
fn iova_ranges(container: RawFd) -> Result<Vec<(u64, u64)>, Errno> {
    // struct vfio_iommu_type1_info: argsz, flags, iova_pgsizes (u64), cap_offset, pad; then
    // the capability chain, into a buffer big enough for it.
    let mut buf = vec![0_u64; 512];
    let bytes = (buf.len() * 8) as u32;
    buf[0] = u64::from(bytes);
    // SAFETY: VFIO_IOMMU_GET_INFO fills at most `argsz` bytes (the whole buffer).
    unsafe { ioctl(container, VFIO_IOMMU_GET_INFO, buf.as_mut_ptr() as _) }?;
    let raw: Vec<u8> = buf.iter().flat_map(|w| w.to_ne_bytes()).collect();
    let u32_at = |o: usize| u32::from_ne_bytes(raw[o..o + 4].try_into().expect("4 bytes"));
    let u64_at = |o: usize| u64::from_ne_bytes(raw[o..o + 8].try_into().expect("8 bytes"));
    let flags = u32_at(4);
    let mut ranges = Vec::new();
    if flags & VFIO_IOMMU_INFO_CAPS != 0 {
        let mut at = u32_at(16) as usize;
        while at != 0 && at + 16 <= raw.len() {
            let id = u16::from_ne_bytes([raw[at], raw[at + 1]]);
            let next = u32_at(at + 4) as usize;
            if id == VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE {
                let n = u32_at(at + 8) as usize;
                for i in 0..n {
                    let o = at + 16 + i * 16;
                    if o + 16 > raw.len() {
                        break;
                    }
                    ranges.push((u64_at(o), u64_at(o + 8)));
                }
            }
            at = next;
        }
    }
    if ranges.is_empty() {
        ranges.push((0, (1 << 39) - 1));
    }
    Ok(ranges)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_addresses_are_checked() {
        assert!(check_pci_address("0000:01:00.0").is_ok());
        assert!(check_pci_address("0000:af:1f.7").is_ok());
        for bad in [
            "01:00.0",
            "0000-01:00.0",
            "0000:01:00:0",
            "0000:01:00.0 ",
            "/dev/nvme0",
        ] {
            let err = check_pci_address(bad).expect_err(bad);
            assert!(err.contains(bad) && err.contains("DDDD:BB:DD.F"), "{err}");
        }
    }

    #[test]
    fn ioctl_numbers_match_the_kernel_header() {
        // <linux/vfio.h>: VFIO_GET_API_VERSION is _IO(';', 100) = 0x3b64.
        assert_eq!(VFIO_GET_API_VERSION, 0x3b64);
        assert_eq!(VFIO_IOMMU_MAP_DMA, 0x3b71);
        assert_eq!(VFIO_IOMMU_UNMAP_DMA, 0x3b72);
        assert_eq!(VFIO_DEVICE_RESET, 0x3b6f);
    }

    #[test]
    fn a_missing_device_is_named() {
        let err = Device::open("ffff:ff:1f.7").expect_err("no such device");
        assert!(err.contains("no PCI device ffff:ff:1f.7"), "{err}");
    }
}
