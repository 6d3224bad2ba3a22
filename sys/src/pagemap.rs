//! The `PAGEMAP_SCAN` ioctl of `/proc/self/pagemap` (Linux 6.7+): which pages of a range of
//! this process are present, and which of them are mapped by huge pages, without walking any
//! other mapping.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// Page categories (`PAGE_IS_*` of `linux/fs.h`).
pub const PAGE_IS_PRESENT: u64 = 1 << 3;
pub const PAGE_IS_HUGE: u64 = 1 << 6;

/// `struct page_region`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct PageRegion {
    start: u64,
    end: u64,
    categories: u64,
}

/// `struct pm_scan_arg`.
#[repr(C)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

/// `_IOWR('f', 16, struct pm_scan_arg)`.
const PAGEMAP_SCAN: libc::c_ulong = (3 << 30)
    | ((std::mem::size_of::<PmScanArg>() as libc::c_ulong) << 16)
    | ((b'f' as libc::c_ulong) << 8)
    | 16;

/// Runs of pages of `start..end` (page aligned) with their categories (present, huge), as
/// `(bytes, categories)`; pages not present are left out.
pub fn scan(pagemap: &File, start: u64, end: u64) -> io::Result<Vec<(u64, u64)>> {
    let mut out = Vec::new();
    let mut regions = [PageRegion::default(); 32];
    let mut at = start;
    while at < end {
        let mut arg = PmScanArg {
            size: std::mem::size_of::<PmScanArg>() as u64,
            flags: 0,
            start: at,
            end,
            walk_end: 0,
            vec: regions.as_mut_ptr() as u64,
            vec_len: regions.len() as u64,
            max_pages: 0,
            category_inverted: 0,
            category_mask: 0,
            category_anyof_mask: PAGE_IS_PRESENT,
            return_mask: PAGE_IS_PRESENT | PAGE_IS_HUGE,
        };
        // SAFETY: `arg` is a valid pm_scan_arg whose `vec` points at `regions`, which lives
        // across the call and has room for `vec_len` entries; the kernel writes only those and
        // `arg` itself.
        let n = unsafe { libc::ioctl(pagemap.as_raw_fd(), PAGEMAP_SCAN as _, &mut arg) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        for r in &regions[..n as usize] {
            out.push((r.end - r.start, r.categories));
        }
        if arg.walk_end <= at {
            break;
        }
        at = arg.walk_end;
    }
    Ok(out)
}
