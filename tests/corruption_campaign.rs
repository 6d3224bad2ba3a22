//! Corruption campaign on real files: blocks are stored on a slab file and in a files-layout
//! directory, the engine is shut down, seeded damage is done to the bytes at rest — bit flips
//! and zeroed slots, zeroed or garbled slot-table entries and pages, a garbled header; flipped,
//! truncated, zeroed and resized block files and garbled checksum xattrs — and the store is
//! reopened and every key loaded. Every damaged block must be detected (not served), every
//! served byte must be right, and every undamaged block must still be served. Each target
//! prints one line with the figures. `KVTIER_CORRUPT_ROUNDS` sets the rounds (default 4, what
//! CI runs); `KVTIER_CORRUPT_SEED` the seed.
#![allow(clippy::field_reassign_with_default)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::FileExt;
use std::path::Path;

use common::*;
use kvtier::config::{Cores, DeviceConfig, FilesConfig, Layout};
use kvtier::files::mapper::{FileMapper, KvCacheGroup, Namespace};
use kvtier::sim::Rng;
use kvtier::slab::{EntryRead, HeaderRead, ENTRIES_PER_PAGE, ENTRY_BYTES, TABLE_PAGE_BYTES};
use kvtier::{Config, Engine, KeyFailure};

const KEYS: u64 = 192;
const DAMAGES: usize = 24;
const REGION_BLOCKS: u64 = 32;

fn rounds() -> u64 {
    env_u64("KVTIER_CORRUPT_ROUNDS", 4)
}

fn seed() -> u64 {
    env_u64("KVTIER_CORRUPT_SEED", 0xC0_2417)
}

fn namespace() -> Namespace {
    let mut ns = Namespace::new("corruption/campaign", "float16", 16, 1);
    ns.kv_cache_groups = vec![KvCacheGroup {
        tokens_per_block: 16,
        layer_names: vec!["layer.0".into()],
    }];
    ns
}

fn slab_config(path: &Path) -> Config {
    file_config(path, 4 * KEYS * BLOCK, 2)
}

fn files_config(path: &Path) -> Config {
    let mut c = Config::default();
    c.block_size = BLOCK;
    c.cores = Cores::List(vec![0, 1]);
    let mut d = DeviceConfig::new(path);
    d.layout = Layout::Files;
    c.devices = vec![d];
    c.files = Some(FilesConfig::new(namespace()));
    c
}

/// Stores keys `base..base + KEYS` and shuts the engine down.
fn fill(cfg: &Config, base: u64) {
    let region = region(REGION_BLOCKS);
    let engine = Engine::open(cfg, region.clone()).expect("open");
    let ids: Vec<u64> = (base..base + KEYS).collect();
    for (j, chunk) in ids.chunks(REGION_BLOCKS as usize).enumerate() {
        let r = store(&engine, &region, j as u64, chunk);
        assert!(r.success, "{r:?}");
    }
    engine.shutdown();
}

/// What a reopen and a load of every key found.
#[derive(Default, Debug)]
struct Tally {
    injected: BTreeMap<&'static str, u64>,
    damaged: u64,
    detected: u64,
    wrong: u64,
    intact_served: u64,
    intact_lost: u64,
    reasons: BTreeMap<String, u64>,
}

/// Loads every key and classifies it against the `damaged` set.
fn check(cfg: &Config, base: u64, damaged: &BTreeSet<u64>, tally: &mut Tally) {
    let region = region(REGION_BLOCKS);
    let engine = Engine::open(cfg, region.clone()).expect("reopen");
    let ids: Vec<u64> = (base..base + KEYS).collect();
    for (j, chunk) in ids.chunks(REGION_BLOCKS as usize).enumerate() {
        let r = load(&engine, &region, j as u64, chunk);
        for (i, &id) in chunk.iter().enumerate() {
            let failure = r.failures.iter().find(|f| f.key_index == i);
            match failure {
                None if !holds(&region, i as u32, id) => tally.wrong += 1,
                None if damaged.contains(&id) => {
                    println!("damaged key {id} served (with the right bytes?)");
                    tally.wrong += 1;
                }
                None => tally.intact_served += 1,
                Some(f) if damaged.contains(&id) => {
                    tally.detected += 1;
                    let reason = match f.reason {
                        KeyFailure::Checksum => "checksum",
                        KeyFailure::ShortIo { .. } => "short",
                        KeyFailure::Miss => "absent",
                        KeyFailure::Refused => "refused",
                        _ => "other",
                    };
                    *tally.reasons.entry(reason.to_owned()).or_default() += 1;
                }
                Some(f) => {
                    println!("intact key {id} lost: {f:?}");
                    tally.intact_lost += 1;
                }
            }
        }
    }
    tally.damaged += damaged.len() as u64;
    engine.shutdown();
}

fn flip_bit(file: &std::fs::File, offset: u64, rng: &mut Rng) {
    let mut b = [0u8; 1];
    file.read_exact_at(&mut b, offset).expect("read");
    b[0] ^= 1 << rng.below(8);
    file.write_all_at(&b, offset).expect("write");
}

/// Where each key's entry and slot are on a slab file (decoded from its header and table).
fn slab_map(file: &std::fs::File) -> (kvtier::slab::Geometry, BTreeMap<[u8; 36], u64>) {
    let mut page = vec![0u8; TABLE_PAGE_BYTES];
    file.read_exact_at(&mut page, 0).expect("header");
    let HeaderRead::Valid(h) = kvtier::slab::Header::decode(&page) else {
        panic!("no valid header");
    };
    let g = h.geometry;
    let mut slots = BTreeMap::new();
    for p in 0..g.table_pages() {
        file.read_exact_at(&mut page, g.table_page_offset(p))
            .expect("table page");
        for e in 0..ENTRIES_PER_PAGE {
            let raw = &page[e * ENTRY_BYTES..(e + 1) * ENTRY_BYTES];
            if let EntryRead::Valid(entry) = kvtier::slab::Entry::decode(raw) {
                let mut k = [0u8; 36];
                k.copy_from_slice(&entry.key.as_bytes()[..36]);
                slots.insert(k, p * ENTRIES_PER_PAGE as u64 + e as u64);
            }
        }
    }
    (g, slots)
}

fn key36(id: u64) -> [u8; 36] {
    let mut k = [0u8; 36];
    k.copy_from_slice(&key(id).as_bytes()[..36]);
    k
}

#[test]
fn corruption_campaign_slab_file() {
    let dir = scratch_dir();
    let path = dir.path().join("slab");
    let mut rng = Rng::new(seed());
    let mut tally = Tally::default();
    for round in 0..rounds() {
        let _ = std::fs::remove_file(&path);
        let cfg = slab_config(&path);
        let base = round * 1000;
        fill(&cfg, base);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .expect("slab file");
        let (g, slots) = slab_map(&file);
        let slot_of = |id: u64| slots[&key36(id)];
        let id_at =
            |slot: u64| (base..base + KEYS).find(|&id| slots.get(&key36(id)) == Some(&slot));
        let mut damaged = BTreeSet::new();
        for _ in 0..DAMAGES {
            let id = base + rng.below(KEYS);
            let slot = slot_of(id);
            let entry_at = g.table_offset + slot * ENTRY_BYTES as u64;
            let class = match rng.below(5) {
                0 => {
                    flip_bit(&file, g.slot_offset(slot) + rng.below(BLOCK), &mut rng);
                    "bit flip in a slot"
                }
                1 => {
                    let zeros = vec![0u8; BLOCK as usize];
                    file.write_all_at(&zeros, g.slot_offset(slot))
                        .expect("zero");
                    "zeroed slot"
                }
                2 => {
                    file.write_all_at(&[0u8; ENTRY_BYTES], entry_at)
                        .expect("zero");
                    "zeroed table entry"
                }
                3 => {
                    let garbage: Vec<u8> = (0..ENTRY_BYTES).map(|_| rng.below(256) as u8).collect();
                    file.write_all_at(&garbage, entry_at).expect("garble");
                    "garbled table entry"
                }
                _ => {
                    // The whole page: every key whose entry is on it is damaged.
                    let page = slot / ENTRIES_PER_PAGE as u64;
                    let zeros = vec![0u8; TABLE_PAGE_BYTES];
                    file.write_all_at(&zeros, g.table_page_offset(page))
                        .expect("zero page");
                    let first = page * ENTRIES_PER_PAGE as u64;
                    damaged.extend((first..first + ENTRIES_PER_PAGE as u64).filter_map(&id_at));
                    "zeroed table page"
                }
            };
            damaged.insert(id);
            *tally.injected.entry(class).or_default() += 1;
        }
        file.sync_all().expect("sync");
        drop(file);
        check(&cfg, base, &damaged, &mut tally);

        // A garbled header: the device is refused, with the reason, and never reformatted.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .expect("slab file");
        flip_bit(&file, rng.below(64), &mut rng);
        *tally.injected.entry("garbled header").or_default() += 1;
        let err = Engine::open(&cfg, region(2))
            .err()
            .expect("a garbled header is refused");
        assert!(
            err.to_string().contains("header") || err.to_string().contains("other data"),
            "{err}"
        );
        tally.detected += 1;
        tally.damaged += 1;
    }
    report("slab file", &tally);
}

#[test]
fn corruption_campaign_files_directory() {
    let dir = scratch_dir();
    let root = dir.path().join("files");
    let mut rng = Rng::new(seed() ^ 0xF11E);
    let mut tally = Tally::default();
    let xattr = std::ffi::CString::new(kvtier::files::device::CHECKSUM_XATTR).expect("name");
    for round in 0..rounds() {
        let _ = std::fs::remove_dir_all(&root);
        let cfg = files_config(&root);
        let base = round * 1000;
        fill(&cfg, base);
        let mapper = FileMapper::new(&root, &namespace());
        let mut damaged = BTreeSet::new();
        for _ in 0..DAMAGES {
            // One damage per file (a truncated file has no byte left to flip).
            let id = loop {
                let id = base + rng.below(KEYS);
                if !damaged.contains(&id) {
                    break id;
                }
            };
            let path = mapper.key_path(key(id).as_bytes()).expect("path");
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .expect("block file");
            let class = match rng.below(5) {
                0 => {
                    flip_bit(&file, rng.below(BLOCK), &mut rng);
                    "bit flip in a block file"
                }
                1 => {
                    file.set_len(rng.below(BLOCK)).expect("truncate");
                    "truncated block file"
                }
                2 => {
                    file.write_all_at(&vec![0u8; BLOCK as usize], 0)
                        .expect("zero");
                    "zeroed block file"
                }
                3 => {
                    file.set_len(BLOCK + 1 + rng.below(4096)).expect("extend");
                    "block file of the wrong size"
                }
                _ => {
                    use std::os::fd::AsRawFd;
                    let value = (rng.next_u64() as u32).to_le_bytes();
                    kvtier_sys::file::fsetxattr(file.as_raw_fd(), &xattr, &value)
                        .expect("fsetxattr");
                    "garbled checksum xattr"
                }
            };
            damaged.insert(id);
            *tally.injected.entry(class).or_default() += 1;
        }
        check(&cfg, base, &damaged, &mut tally);
    }
    report("files directory", &tally);
}

fn report(name: &str, t: &Tally) {
    println!(
        "corruption campaign {name}: {} rounds, damage injected {:?}, {} blocks damaged, {} \
         detected and not served {:?}, {} served wrong, {} intact blocks served, {} intact \
         blocks lost",
        rounds(),
        t.injected,
        t.damaged,
        t.detected,
        t.reasons,
        t.wrong,
        t.intact_served,
        t.intact_lost
    );
    assert_eq!(t.wrong, 0, "{t:?}");
    assert_eq!(t.detected, t.damaged, "damage not detected: {t:?}");
    assert_eq!(t.intact_lost, 0, "{t:?}");
}
