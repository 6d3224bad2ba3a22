//! The slab layout on a device: a header, a slot table, then fixed-size slots.
//!
//! ```text
//! 0        4 KiB                         data_offset (1 MiB aligned)
//! | header | slot table: 128 B per slot | slot 0 | slot 1 | ... | slot N-1 |
//! ```
//!
//! A slot table entry records the key, length, crc32c of the data and a sequence number. It is
//! written beside the slot's data write (both must complete before the store is acknowledged),
//! so a crash can leave an entry whose data never fully landed, or data whose entry never
//! landed; an entry whose own checksum fails (a torn table write) reads as empty. Entries that
//! survive a restart are therefore *unverified*: their data checksum is checked on the first
//! load, and a block that fails it is dropped, never served.
//! Table pages are 4 KiB and each is owned by exactly one worker (slot ranges are partitioned on
//! page boundaries), so no two workers ever write the same page.

use crate::key::{Key, MAX_KEY_BYTES};

mod evict;
mod index;
pub(crate) mod layout;
mod outcome;
mod pages;
pub(crate) mod prepare;
#[cfg(all(test, feature = "sim"))]
mod scenarios;
mod slots;
pub(crate) mod table;

pub const HEADER_BYTES: u64 = 4096;
pub const ENTRY_BYTES: usize = 128;
pub const TABLE_PAGE_BYTES: usize = 4096;
pub const ENTRIES_PER_PAGE: usize = TABLE_PAGE_BYTES / ENTRY_BYTES;
const DATA_ALIGN_BYTES: u64 = 1 << 20;

const HEADER_MAGIC: &[u8; 8] = b"KVTIERSL";
const HEADER_VERSION: u32 = 1;
const ENTRY_MAGIC: u32 = 0x4b56_5345; // "KVSE"

/// Where everything is on one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub block_bytes: u64,
    pub slot_bytes: u64,
    pub slot_count: u64,
    pub table_offset: u64,
    pub data_offset: u64,
}

impl Geometry {
    /// The largest slab that fits `device_bytes`, with slots of `block_bytes` rounded up to
    /// `align_bytes`. `None` if not even one slot fits.
    pub fn compute(device_bytes: u64, block_bytes: u64, align_bytes: u64) -> Option<Geometry> {
        let slot_bytes = block_bytes.div_ceil(align_bytes) * align_bytes;
        let table_offset = HEADER_BYTES;
        // Start from the upper bound ignoring alignment padding, then step down until it fits.
        let mut slots =
            device_bytes.saturating_sub(table_offset) / (slot_bytes + ENTRY_BYTES as u64);
        while slots > 0 {
            let g = Geometry::with_slots(block_bytes, slot_bytes, slots);
            if g.end() <= device_bytes {
                return Some(g);
            }
            let over = g.end() - device_bytes;
            slots = slots.saturating_sub(over.div_ceil(slot_bytes).max(1));
        }
        None
    }

    fn with_slots(block_bytes: u64, slot_bytes: u64, slot_count: u64) -> Geometry {
        let table_end = HEADER_BYTES + table_bytes(slot_count);
        let data_offset = table_end.div_ceil(DATA_ALIGN_BYTES) * DATA_ALIGN_BYTES;
        Geometry {
            block_bytes,
            slot_bytes,
            slot_count,
            table_offset: HEADER_BYTES,
            data_offset,
        }
    }

    pub fn end(&self) -> u64 {
        self.data_offset + self.slot_count * self.slot_bytes
    }

    pub fn slot_offset(&self, slot: u64) -> u64 {
        debug_assert!(slot < self.slot_count);
        self.data_offset + slot * self.slot_bytes
    }

    pub fn table_pages(&self) -> u64 {
        self.slot_count.div_ceil(ENTRIES_PER_PAGE as u64)
    }

    pub fn table_page_offset(&self, page: u64) -> u64 {
        self.table_offset + page * TABLE_PAGE_BYTES as u64
    }

    /// The slots worker `worker` of `workers` owns: a contiguous range starting on a table page
    /// boundary, so table pages are never shared between workers.
    pub fn worker_slots(&self, worker: usize, workers: usize) -> std::ops::Range<u64> {
        let per = self.pages_per_worker(workers);
        let pages = self.table_pages();
        let first_page = (per * worker as u64).min(pages);
        let end_page = (per * (worker as u64 + 1)).min(pages);
        let start = first_page * ENTRIES_PER_PAGE as u64;
        let end = (end_page * ENTRIES_PER_PAGE as u64).min(self.slot_count);
        start..end.max(start)
    }

    /// The worker (of `workers`) whose range holds `slot`: the inverse of
    /// [`Geometry::worker_slots`].
    pub fn worker_of(&self, slot: u64, workers: usize) -> usize {
        let page = slot / ENTRIES_PER_PAGE as u64;
        (page / self.pages_per_worker(workers).max(1)) as usize
    }

    fn pages_per_worker(&self, workers: usize) -> u64 {
        self.table_pages().div_ceil(workers as u64)
    }
}

/// What recovery makes of one slot table entry: the rule the engine applies when it opens a
/// device (and `kvtier inspect` reports, reading the table before an engine opens it).
#[derive(Debug, PartialEq, Eq)]
pub enum Recovered {
    Empty,
    /// A torn table write: cleared.
    Torn,
    /// A valid entry this engine can never be asked for: written under another worker count
    /// (its key routes to another worker) or another block size. Cleared.
    Unroutable(Entry),
    /// A block this engine holds (if no newer entry for its key turns up).
    Kept(Entry),
}

/// [`Recovered`] for the entry `raw` of a slot that worker `worker` of `workers` owns, in a
/// store of `block_bytes` blocks. The device does not matter: a key lives on its home device
/// unless that one was marked failed when it was stored (then on the next one), and the index
/// maps each key to its slot wherever it is; two entries for one key are settled by their
/// sequence numbers.
pub fn recover_entry(raw: &[u8], worker: usize, workers: usize, block_bytes: u64) -> Recovered {
    match Entry::decode(raw) {
        EntryRead::Empty => Recovered::Empty,
        EntryRead::Torn => Recovered::Torn,
        EntryRead::Valid(e) => {
            if e.key.worker(workers) == worker && u64::from(e.data_len) == block_bytes {
                Recovered::Kept(e)
            } else {
                Recovered::Unroutable(e)
            }
        }
    }
}

/// Bytes of slot table for `slots` slots, whole pages.
pub fn table_bytes(slots: u64) -> u64 {
    slots.div_ceil(ENTRIES_PER_PAGE as u64) * TABLE_PAGE_BYTES as u64
}

/// Whether a header describes a finished format or one interrupted half-way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeaderState {
    Formatting,
    Ready,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub state: HeaderState,
    pub geometry: Geometry,
    /// Random at format time; distinguishes two formats of the same device.
    pub format_id: u64,
}

/// What the first page of a device holds.
#[derive(Debug, PartialEq, Eq)]
pub enum HeaderRead {
    /// All zeros: never formatted.
    Empty,
    /// A valid kvtier header.
    Valid(Header),
    /// Something else: another program's data, or a damaged header.
    Foreign(String),
}

impl Header {
    pub fn encode(&self, page: &mut [u8]) {
        assert!(page.len() >= 128);
        page.fill(0);
        page[0..8].copy_from_slice(HEADER_MAGIC);
        put_u32(page, 8, HEADER_VERSION);
        put_u32(page, 12, u32::from(self.state == HeaderState::Ready));
        let g = &self.geometry;
        put_u64(page, 16, g.block_bytes);
        put_u64(page, 24, g.slot_bytes);
        put_u64(page, 32, g.slot_count);
        put_u64(page, 40, g.table_offset);
        put_u64(page, 48, g.data_offset);
        put_u64(page, 56, self.format_id);
        let crc = crate::checksum::crc32c(&page[0..64]);
        put_u32(page, 64, crc);
    }

    pub fn decode(page: &[u8]) -> HeaderRead {
        if page.iter().all(|&b| b == 0) {
            return HeaderRead::Empty;
        }
        if &page[0..8] != HEADER_MAGIC {
            return HeaderRead::Foreign("no kvtier header (the device holds other data)".into());
        }
        if crate::checksum::crc32c(&page[0..64]) != get_u32(page, 64) {
            return HeaderRead::Foreign("kvtier header checksum mismatch".into());
        }
        let version = get_u32(page, 8);
        if version != HEADER_VERSION {
            return HeaderRead::Foreign(format!(
                "kvtier slab format version {version}, this build reads {HEADER_VERSION}"
            ));
        }
        let state = if get_u32(page, 12) == 1 {
            HeaderState::Ready
        } else {
            HeaderState::Formatting
        };
        let geometry = Geometry {
            block_bytes: get_u64(page, 16),
            slot_bytes: get_u64(page, 24),
            slot_count: get_u64(page, 32),
            table_offset: get_u64(page, 40),
            data_offset: get_u64(page, 48),
        };
        HeaderRead::Valid(Header {
            state,
            geometry,
            format_id: get_u64(page, 56),
        })
    }
}

/// One slot table entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub seq: u64,
    pub data_len: u32,
    pub data_crc: u32,
    pub key: Key,
}

/// What an entry's 128 bytes hold.
#[derive(Debug, PartialEq, Eq)]
pub enum EntryRead {
    Empty,
    Valid(Entry),
    /// Non-zero but failing its checksum or bounds: a torn table write.
    Torn,
}

impl Entry {
    /// Layout: magic u32 | crc32c of bytes 8..128 u32 | seq u64 | data_len u32 | data_crc u32 |
    /// key_len u16 | reserved 6 | key (64) | reserved 32.
    pub fn encode(&self, out: &mut [u8]) {
        assert_eq!(out.len(), ENTRY_BYTES);
        out.fill(0);
        put_u32(out, 0, ENTRY_MAGIC);
        put_u64(out, 8, self.seq);
        put_u32(out, 16, self.data_len);
        put_u32(out, 20, self.data_crc);
        let key = self.key.as_bytes();
        out[24..26].copy_from_slice(&(key.len() as u16).to_le_bytes());
        out[32..32 + key.len()].copy_from_slice(key);
        let crc = crate::checksum::crc32c(&out[8..]);
        put_u32(out, 4, crc);
    }

    pub fn decode(raw: &[u8]) -> EntryRead {
        assert_eq!(raw.len(), ENTRY_BYTES);
        if raw.iter().all(|&b| b == 0) {
            return EntryRead::Empty;
        }
        if get_u32(raw, 0) != ENTRY_MAGIC || crate::checksum::crc32c(&raw[8..]) != get_u32(raw, 4) {
            return EntryRead::Torn;
        }
        let key_len = u16::from_le_bytes([raw[24], raw[25]]) as usize;
        if key_len == 0 || key_len > MAX_KEY_BYTES {
            return EntryRead::Torn;
        }
        let Ok(key) = Key::new(&raw[32..32 + key_len]) else {
            return EntryRead::Torn;
        };
        EntryRead::Valid(Entry {
            seq: get_u64(raw, 8),
            data_len: get_u32(raw, 16),
            data_crc: get_u32(raw, 20),
            key,
        })
    }
}

fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn get_u32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn get_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_fits_and_aligns() {
        let g = Geometry::compute(1 << 30, 2 << 20, 4096).expect("fits");
        assert!(g.end() <= 1 << 30);
        assert_eq!(g.data_offset % DATA_ALIGN_BYTES, 0);
        assert!(g.data_offset >= HEADER_BYTES + table_bytes(g.slot_count));
        assert_eq!(g.slot_count, 511);
        // Odd block size rounds up to the alignment.
        let g = Geometry::compute(64 << 20, 12288, 8192).expect("fits");
        assert_eq!(g.slot_bytes, 16384);
        assert!(g.end() <= 64 << 20);
        assert!(Geometry::compute(1 << 20, 2 << 20, 4096).is_none());
    }

    #[test]
    fn worker_ranges_partition_on_page_boundaries() {
        let g = Geometry::compute(1 << 30, 64 << 10, 4096).expect("fits");
        for workers in 1..=5 {
            let mut next = 0;
            for w in 0..workers {
                let r = g.worker_slots(w, workers);
                assert_eq!(r.start, next, "contiguous");
                assert_eq!(r.start % ENTRIES_PER_PAGE as u64, 0, "page aligned");
                for slot in [
                    r.start,
                    r.start + (r.end - r.start) / 2,
                    r.end.saturating_sub(1),
                ] {
                    if r.contains(&slot) {
                        assert_eq!(g.worker_of(slot, workers), w, "slot {slot} of {workers}");
                    }
                }
                next = r.end;
            }
            assert_eq!(next, g.slot_count, "covers every slot");
        }
    }

    #[test]
    fn recovery_keeps_only_entries_routed_to_the_reading_worker() {
        let key = Key::new(b"recovered key").expect("key");
        let entry = |data_len| Entry {
            seq: 7,
            data_len,
            data_crc: 1,
            key,
        };
        let mut raw = [0u8; ENTRY_BYTES];
        assert_eq!(recover_entry(&raw, 0, 1, 4096), Recovered::Empty);
        entry(4096).encode(&mut raw);
        assert_eq!(
            recover_entry(&raw, 0, 1, 4096),
            Recovered::Kept(entry(4096))
        );
        let w = key.worker(3);
        assert_eq!(
            recover_entry(&raw, w, 3, 4096),
            Recovered::Kept(entry(4096))
        );
        let other_worker = (w + 1) % 3;
        assert_eq!(
            recover_entry(&raw, other_worker, 3, 4096),
            Recovered::Unroutable(entry(4096))
        );
        assert_eq!(
            recover_entry(&raw, 0, 1, 8192),
            Recovered::Unroutable(entry(4096)),
            "another block size"
        );
        raw[40] ^= 1;
        assert_eq!(recover_entry(&raw, 0, 1, 4096), Recovered::Torn);
    }

    #[test]
    fn header_round_trip_and_foreign_detection() {
        let g = Geometry::compute(1 << 30, 2 << 20, 4096).expect("fits");
        let h = Header {
            state: HeaderState::Ready,
            geometry: g,
            format_id: 42,
        };
        let mut page = vec![0u8; 4096];
        assert_eq!(Header::decode(&page), HeaderRead::Empty);
        h.encode(&mut page);
        assert_eq!(Header::decode(&page), HeaderRead::Valid(h));
        page[20] ^= 1;
        assert!(matches!(Header::decode(&page), HeaderRead::Foreign(_)));
        let other = b"not a kvtier device".repeat(10);
        assert!(matches!(Header::decode(&other), HeaderRead::Foreign(_)));
    }

    #[test]
    fn entry_round_trip_and_torn_detection() {
        let key = Key::vllm(&[9u8; 32], 3).expect("key");
        let e = Entry {
            seq: 7,
            data_len: 4096,
            data_crc: 0xdead_beef,
            key,
        };
        let mut raw = [0u8; ENTRY_BYTES];
        assert_eq!(Entry::decode(&raw), EntryRead::Empty);
        e.encode(&mut raw);
        assert_eq!(Entry::decode(&raw), EntryRead::Valid(e));
        for i in [0usize, 5, 9, 40, 127] {
            let mut torn = raw;
            torn[i] ^= 0x10;
            assert_eq!(Entry::decode(&torn), EntryRead::Torn, "flip at byte {i}");
        }
    }
}
