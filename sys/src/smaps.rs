//! How much of a span of this process's memory is mapped with huge pages: sampled with the
//! `PAGEMAP_SCAN` ioctl of `/proc/self/pagemap` (Linux 6.7+), else read from `/proc/self/smaps`.
//!
//! Reading smaps walks the page tables of every mapping of the process, about 27 ms per GiB of
//! memory resident in 4 KiB pages on the test machine: seconds for a large vLLM buffer. The scan
//! walks only 64 windows of 2 MiB spread over the span.
//!
//! Why it matters: the kernel builds a fixed buffer's I/O vectors from its pages. A block held
//! in 4 KiB pages goes to the device as one segment per page (512 for 2 MiB, split across
//! several requests), one held in a 2 MiB page as one segment. On the virtio disk of the
//! project's test machine, stores from 4 KiB-page memory ran at about half the rate of stores
//! from huge pages (docs/perf.md, "The primary region's pages"). The engine cannot choose the
//! pages of a region the caller owns (vLLM's `/dev/shm` mapping), so it reports them.

use std::io;

/// Bytes of a span, how many are resident, and how many of those are mapped by huge pages.
/// Counts of a mapping the span covers in part are taken pro rata.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HugeMapped {
    /// Bytes of the span inside mappings (the span's length unless part of it is unmapped).
    pub bytes: u64,
    /// Of those, resident bytes (`Rss`; hugetlb mappings count whole). Pages not yet touched
    /// are not resident, and their page size is not known yet.
    pub resident_bytes: u64,
    /// Of the resident bytes, those mapped by huge pages: whole hugetlb mappings; in other
    /// mappings the PMD-mapped transparent huge pages (`AnonHugePages`, `ShmemPmdMapped`,
    /// `FilePmdMapped`).
    pub huge_bytes: u64,
}

impl HugeMapped {
    /// The huge share of the resident bytes, in percent; `None` when none is resident.
    pub fn percent(&self) -> Option<f64> {
        (self.resident_bytes > 0)
            .then(|| 100.0 * self.huge_bytes as f64 / self.resident_bytes as f64)
    }
}

/// [`HugeMapped`] of `addr..addr + len` in this process: sampled (see [`sample`]) where the
/// kernel has `PAGEMAP_SCAN`, else counted from `/proc/self/smaps`.
pub fn huge_mapped(addr: usize, len: usize) -> io::Result<HugeMapped> {
    match sample(addr, len) {
        Ok(m) => Ok(m),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTTY | libc::EINVAL)) => {
            from_smaps(addr, len)
        }
        Err(e) => Err(e),
    }
}

/// [`HugeMapped`] of `addr..addr + len` from `/proc/self/smaps` (whole mappings, pro rata).
pub fn from_smaps(addr: usize, len: usize) -> io::Result<HugeMapped> {
    let text = std::fs::read_to_string("/proc/self/smaps")?;
    Ok(parse(&text, addr as u64, len as u64))
}

/// Windows [`sample`] scans, and their size.
const SAMPLE_WINDOWS: u64 = 64;
const WINDOW_BYTES: u64 = 2 << 20;

/// [`HugeMapped`] of `addr..addr + len` estimated from up to 64 windows of 2 MiB spread evenly
/// over it (the whole span when it is smaller), with `PAGEMAP_SCAN`. `bytes` is the span's
/// length. Errors: `ENOTTY` or `EINVAL` where the kernel lacks the ioctl (before 6.7).
pub fn sample(addr: usize, len: usize) -> io::Result<HugeMapped> {
    let pagemap = std::fs::File::open("/proc/self/pagemap")?;
    let (start, end) = (addr as u64, addr as u64 + len as u64);
    let mut windows = Vec::new();
    if len as u64 <= SAMPLE_WINDOWS * WINDOW_BYTES {
        windows.push((start, end));
    } else {
        let step = (end - start) / SAMPLE_WINDOWS;
        for i in 0..SAMPLE_WINDOWS {
            let lo = (start + i * step).next_multiple_of(WINDOW_BYTES).min(end);
            windows.push((lo, (lo + WINDOW_BYTES).min(end)));
        }
    }
    let (mut scanned, mut present, mut huge) = (0_u64, 0_u64, 0_u64);
    for (lo, hi) in windows {
        scanned += hi - lo;
        for (region_bytes, categories) in crate::pagemap::scan(&pagemap, lo, hi)? {
            if categories & crate::pagemap::PAGE_IS_PRESENT != 0 {
                present += region_bytes;
                if categories & crate::pagemap::PAGE_IS_HUGE != 0 {
                    huge += region_bytes;
                }
            }
        }
    }
    let scale =
        |n: u64| (u128::from(n) * u128::from(len as u64) / u128::from(scanned.max(1))) as u64;
    Ok(HugeMapped {
        bytes: len as u64,
        resident_bytes: scale(present),
        huge_bytes: scale(huge),
    })
}

/// One mapping of an smaps listing, as far as it has been read.
#[derive(Default)]
struct Vma {
    start: u64,
    end: u64,
    kernel_page_kib: u64,
    rss_kib: u64,
    pmd_kib: u64,
}

impl Vma {
    /// What this mapping adds for the span `lo..hi`.
    fn add_to(&self, lo: u64, hi: u64, out: &mut HugeMapped) {
        let overlap = hi.min(self.end).saturating_sub(lo.max(self.start));
        if overlap == 0 {
            return;
        }
        out.bytes += overlap;
        if self.kernel_page_kib >= 2048 {
            // hugetlb: always resident once mapped (reserved), never counted in Rss.
            out.resident_bytes += overlap;
            out.huge_bytes += overlap;
            return;
        }
        let len = self.end - self.start;
        let share = |kib: u64| {
            let bytes = (kib * 1024).min(len);
            (u128::from(bytes) * u128::from(overlap) / u128::from(len)) as u64
        };
        let resident = share(self.rss_kib);
        out.resident_bytes += resident;
        out.huge_bytes += share(self.pmd_kib).min(resident);
    }
}

/// Parses an smaps listing for the span `addr..addr + len`.
fn parse(text: &str, addr: u64, len: u64) -> HugeMapped {
    let (lo, hi) = (addr, addr.saturating_add(len));
    let mut out = HugeMapped::default();
    let mut vma: Option<Vma> = None;
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let Some(first) = words.next() else {
            continue;
        };
        if let Some((start, end)) = mapping_range(first) {
            if let Some(v) = vma.take() {
                v.add_to(lo, hi, &mut out);
            }
            vma = Some(Vma {
                start,
                end,
                ..Vma::default()
            });
            continue;
        }
        let (Some(v), Some(kib)) = (vma.as_mut(), words.next().and_then(|w| w.parse().ok())) else {
            continue;
        };
        match first {
            "KernelPageSize:" => v.kernel_page_kib = kib,
            "Rss:" => v.rss_kib = kib,
            "AnonHugePages:" | "ShmemPmdMapped:" | "FilePmdMapped:" => v.pmd_kib += kib,
            _ => {}
        }
    }
    if let Some(v) = vma {
        v.add_to(lo, hi, &mut out);
    }
    out
}

/// `start-end` of a mapping's header line (hex addresses), else `None`.
fn mapping_range(word: &str) -> Option<(u64, u64)> {
    let (start, end) = word.split_once('-')?;
    let start = u64::from_str_radix(start, 16).ok()?;
    let end = u64::from_str_radix(end, 16).ok()?;
    (start < end).then_some((start, end))
}

#[cfg(test)]
#[allow(clippy::float_cmp)] // the percents compared are exact: 0, 50 and 100
mod tests {
    use super::*;

    fn vma(range: &str, kernel_page: u64, rss: u64, anon: u64, shmem: u64) -> String {
        format!(
            "{range} rw-s 00000000 00:28 5    /dev/shm/x\nSize: 65536 kB\n\
             KernelPageSize:     {kernel_page} kB\nMMUPageSize: {kernel_page} kB\n\
             Rss: {rss} kB\nAnonHugePages: {anon} kB\nShmemPmdMapped: {shmem} kB\n\
             FilePmdMapped: 0 kB\nVmFlags: rd wr sh mr mw me ms\n"
        )
    }

    // 64 MiB mappings, all resident unless said: 4 KiB pages; PMD-mapped shmem; half
    // anonymous THP; hugetlb (Rss 0, as the kernel shows it); half resident, none huge.
    fn listing() -> String {
        [
            vma("100000000-104000000", 4, 65536, 0, 0),
            vma("200000000-204000000", 4, 65536, 0, 65536),
            vma("300000000-304000000", 4, 65536, 32768, 0),
            vma("400000000-404000000", 2048, 0, 0, 0),
            vma("500000000-504000000", 4, 32768, 0, 0),
        ]
        .concat()
    }

    const MIB: u64 = 1 << 20;

    fn mapped(bytes: u64, resident: u64, huge: u64) -> HugeMapped {
        HugeMapped {
            bytes: bytes * MIB,
            resident_bytes: resident * MIB,
            huge_bytes: huge * MIB,
        }
    }

    #[test]
    fn whole_mappings() {
        let text = listing();
        let at = |a: u64| parse(&text, a, 64 * MIB);
        assert_eq!(at(0x1_0000_0000), mapped(64, 64, 0));
        assert_eq!(at(0x2_0000_0000), mapped(64, 64, 64));
        assert_eq!(at(0x3_0000_0000), mapped(64, 64, 32));
        assert_eq!(at(0x4_0000_0000), mapped(64, 64, 64));
        assert_eq!(at(0x5_0000_0000), mapped(64, 32, 0));
        assert_eq!(at(0x1_0000_0000).percent(), Some(0.0));
        assert_eq!(at(0x3_0000_0000).percent(), Some(50.0));
        assert_eq!(at(0x4_0000_0000).percent(), Some(100.0));
    }

    #[test]
    fn part_of_a_mapping_counts_pro_rata() {
        let text = listing();
        let got = parse(&text, 0x3_0000_0000 + 16 * MIB, 16 * MIB);
        assert_eq!(got, mapped(16, 16, 8));
    }

    #[test]
    fn a_span_across_mappings_and_holes() {
        // The last 32 MiB of the shmem mapping, then the hole up to 0x3_00.. (not counted):
        // the span ends inside the hole.
        let text = listing();
        assert_eq!(
            parse(&text, 0x2_0000_0000 + 32 * MIB, 64 * MIB),
            mapped(32, 32, 32)
        );
        // All five mappings and the holes between them.
        assert_eq!(
            parse(&text, 0x1_0000_0000, 0x4_0400_0000 + 64 * MIB),
            mapped(320, 288, 160)
        );
        assert_eq!(parse(&text, 0x9_0000_0000, MIB), HugeMapped::default());
        assert_eq!(HugeMapped::default().percent(), None);
    }

    #[test]
    fn sampling_agrees_with_smaps() {
        // A 4 KiB-page mapping, touched: none of it huge, all of it resident, both ways.
        let len = 64 << 20;
        let region =
            crate::mem::Region::allocate(len, crate::mem::HugePages::Off).expect("a 64 MiB region");
        let by_smaps = from_smaps(region.addr(), len).expect("/proc/self/smaps");
        assert_eq!(by_smaps, mapped(64, 64, 0));
        match sample(region.addr(), len) {
            Ok(got) => assert_eq!(got, mapped(64, 64, 0)),
            Err(e) => println!("SKIP: no PAGEMAP_SCAN here: {e}"),
        }
        // hugetlb, where reserved: all of it huge, both ways.
        if let Ok(huge) = crate::mem::Region::allocate(4 << 20, crate::mem::HugePages::Required) {
            assert_eq!(
                from_smaps(huge.addr(), 4 << 20).expect("smaps"),
                mapped(4, 4, 4)
            );
            if let Ok(got) = sample(huge.addr(), 4 << 20) {
                assert_eq!(got, mapped(4, 4, 4));
            }
        }
    }

    #[test]
    fn this_process() {
        // Touched heap memory of this process: found, whole, resident.
        let v = vec![1u8; 17 * 4096];
        let addr = (v.as_ptr() as usize).next_multiple_of(4096);
        let got = huge_mapped(addr, 4096).expect("/proc/self/smaps");
        assert_eq!(got.bytes, 4096);
        assert!(
            got.resident_bytes > 0 && got.huge_bytes <= got.resident_bytes,
            "{got:?}"
        );
        std::hint::black_box(&v);
    }
}
