//! How much of a span of this process's memory is mapped with huge pages, from
//! `/proc/self/smaps`.
//!
//! Why it matters: the kernel builds a fixed buffer's I/O vectors from its pages. A block held
//! in 4 KiB pages goes to the device as one segment per page (512 for 2 MiB, split across
//! several requests), one held in a 2 MiB page as one segment. On the virtio disk of the
//! project's test machine, stores from 4 KiB-page memory ran at about half the rate of stores
//! from huge pages (docs/perf.md, "The primary region's pages"). The engine cannot choose the
//! pages of a region the caller owns (vLLM's `/dev/shm` mapping), so it reports them.

use std::io;

/// Bytes of a span and how many of them are mapped by huge pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HugeMapped {
    /// Bytes of the span inside mappings (the span's length unless part of it is unmapped).
    pub bytes: u64,
    /// Of those, bytes mapped by huge pages: whole hugetlb mappings; in other mappings the
    /// PMD-mapped transparent huge pages (`AnonHugePages`, `ShmemPmdMapped`, `FilePmdMapped`),
    /// pro rata when the span covers part of a mapping.
    pub huge_bytes: u64,
}

impl HugeMapped {
    /// The huge share in percent (0 for an empty span).
    pub fn percent(&self) -> f64 {
        if self.bytes == 0 {
            0.0
        } else {
            100.0 * self.huge_bytes as f64 / self.bytes as f64
        }
    }
}

/// [`HugeMapped`] of `addr..addr + len` in this process.
pub fn huge_mapped(addr: usize, len: usize) -> io::Result<HugeMapped> {
    let text = std::fs::read_to_string("/proc/self/smaps")?;
    Ok(parse(&text, addr as u64, len as u64))
}

/// One mapping of an smaps listing, as far as it has been read.
#[derive(Default)]
struct Vma {
    start: u64,
    end: u64,
    kernel_page_kib: u64,
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
        let huge = if self.kernel_page_kib >= 2048 {
            overlap
        } else {
            let len = self.end - self.start;
            let pmd = (self.pmd_kib * 1024).min(len);
            (u128::from(pmd) * u128::from(overlap) / u128::from(len)) as u64
        };
        out.huge_bytes += huge;
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
#[allow(clippy::float_cmp)] // the percents compared are exactly 0 and 100
mod tests {
    use super::*;

    fn vma(range: &str, kernel_page: u64, anon: u64, shmem: u64) -> String {
        format!(
            "{range} rw-s 00000000 00:28 5    /dev/shm/x\nSize: 65536 kB\n\
             KernelPageSize:     {kernel_page} kB\nMMUPageSize: {kernel_page} kB\n\
             Rss: 65536 kB\nAnonHugePages: {anon} kB\nShmemPmdMapped: {shmem} kB\n\
             FilePmdMapped: 0 kB\nVmFlags: rd wr sh mr mw me ms\n"
        )
    }

    // 64 MiB mappings: one of 4 KiB pages, one PMD-mapped shmem, one half anonymous THP, one
    // hugetlb.
    fn listing() -> String {
        [
            vma("100000000-104000000", 4, 0, 0),
            vma("200000000-204000000", 4, 0, 65536),
            vma("300000000-304000000", 4, 32768, 0),
            vma("400000000-404000000", 2048, 0, 0),
        ]
        .concat()
    }

    const MIB: u64 = 1 << 20;

    #[test]
    fn whole_mappings() {
        let text = listing();
        let at = |a: u64| parse(&text, a, 64 * MIB);
        assert_eq!(
            at(0x1_0000_0000),
            HugeMapped {
                bytes: 64 * MIB,
                huge_bytes: 0
            }
        );
        assert_eq!(
            at(0x2_0000_0000),
            HugeMapped {
                bytes: 64 * MIB,
                huge_bytes: 64 * MIB
            }
        );
        assert_eq!(
            at(0x3_0000_0000),
            HugeMapped {
                bytes: 64 * MIB,
                huge_bytes: 32 * MIB
            }
        );
        assert_eq!(
            at(0x4_0000_0000),
            HugeMapped {
                bytes: 64 * MIB,
                huge_bytes: 64 * MIB
            }
        );
        assert_eq!(at(0x4_0000_0000).percent(), 100.0);
        assert_eq!(at(0x1_0000_0000).percent(), 0.0);
    }

    #[test]
    fn part_of_a_mapping_counts_pro_rata() {
        let text = listing();
        let got = parse(&text, 0x3_0000_0000 + 16 * MIB, 16 * MIB);
        assert_eq!(
            got,
            HugeMapped {
                bytes: 16 * MIB,
                huge_bytes: 8 * MIB
            }
        );
    }

    #[test]
    fn a_span_across_mappings_and_holes() {
        // The last 32 MiB of the shmem mapping, the 0x2_04.. hole up to 0x3_00.., not counted,
        // and nothing else: the span ends inside the hole.
        let text = listing();
        let got = parse(&text, 0x2_0000_0000 + 32 * MIB, 64 * MIB);
        assert_eq!(
            got,
            HugeMapped {
                bytes: 32 * MIB,
                huge_bytes: 32 * MIB
            }
        );
        assert_eq!(parse(&text, 0x9_0000_0000, MIB), HugeMapped::default());
        assert_eq!(HugeMapped::default().percent(), 0.0);
    }

    #[test]
    fn this_process() {
        // A 4 KiB-page mapping of this process: found, whole, and not huge.
        let len = 16 * 4096;
        let v = vec![1u8; len + 4096];
        let addr = (v.as_ptr() as usize).next_multiple_of(4096);
        let got = huge_mapped(addr, 4096).expect("/proc/self/smaps");
        assert_eq!(got.bytes, 4096);
        assert!(got.huge_bytes <= got.bytes);
    }
}
