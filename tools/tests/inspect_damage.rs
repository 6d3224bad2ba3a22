//! `kvtier inspect` over a store with every kind of damage the corruption campaign injects
//! (`tests/corruption_campaign.rs` in the engine checks that the engine never serves them; this
//! checks that the operator's command reports each one). Slab: bit flips and zeroed slots are
//! listed key by key as checksum mismatches, zeroed entries drop their keys (counted as empty),
//! garbled entries are counted as torn, a garbled header is refused with the reason. Files: bit
//! flips, zeroed files and garbled checksum xattrs are listed as checksum mismatches, truncated
//! and lengthened files are counted as wrong-size files and not listed. Every other key is
//! listed as verified, and the command exits 1 with "BAD BLOCKS".

mod common;

use std::collections::BTreeSet;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::Arc;
use std::time::Duration;

use common::kvtier;
use kvtier::files::mapper::FileMapper;
use kvtier::slab::{EntryRead, HeaderRead, ENTRIES_PER_PAGE, ENTRY_BYTES, TABLE_PAGE_BYTES};
use kvtier::{Config, Engine, Job, Key};

const BLOCK: u64 = 64 << 10;
const KEYS: u64 = 64;

fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("kvtier-inspect-damage-")
        .tempdir_in("/var/tmp")
        .expect("a temporary directory in /var/tmp")
}

fn key(n: u64) -> Key {
    let mut hash = [0u8; 32];
    for (i, chunk) in hash.chunks_exact_mut(8).enumerate() {
        chunk.copy_from_slice(&(n * 4 + i as u64 + 1).to_be_bytes());
    }
    Key::vllm(&hash, 0).expect("a vLLM-shaped key")
}

fn content(n: u64) -> Vec<u8> {
    let mut x = n.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..BLOCK)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

const NAMESPACE: &str = "[files.namespace]\nmodel_name = \"test/model\"\ndtype = \"float16\"\n\
    tokens_per_hash = 16\nblocks_per_file = 1\n\n[[files.namespace.kv_cache_groups]]\n\
    tokens_per_block = 16\nlayer_names = [\"layer.0\"]\n";

/// Writes the config and stores keys `0..KEYS` through the library; returns the config path.
fn build(dir: &Path, device: &str) -> PathBuf {
    let config = dir.join("kvtier.toml");
    std::fs::write(
        &config,
        format!(
            "block_size = \"64 KiB\"\ncores = [0]\nregion_blocks = 16\n\n{device}\n{NAMESPACE}"
        ),
    )
    .expect("write config");
    let cfg = Config::from_file(&config).expect("config");
    let region = kvtier::region::allocate(&cfg).expect("region");
    let engine = Engine::open(&cfg, Arc::clone(&region)).expect("open");
    for (j, chunk) in (0..KEYS).collect::<Vec<_>>().chunks(16).enumerate() {
        for (b, &n) in chunk.iter().enumerate() {
            region.write(b * BLOCK as usize, &content(n));
        }
        engine
            .submit_store(Job::new(
                j as u64,
                chunk.iter().map(|&n| key(n)).collect(),
                (0..chunk.len() as u32).collect(),
            ))
            .expect("submit");
        let mut out = Vec::new();
        while out.is_empty() {
            engine.wait_finished(&mut out, Duration::from_millis(100));
        }
        assert!(out[0].success, "{:?}", out[0]);
    }
    engine.shutdown();
    config
}

fn inspect(config: &Path) -> (Output, serde_json::Value) {
    let out = kvtier(&[
        "inspect",
        "--config",
        config.to_str().expect("utf-8"),
        "--keys",
        "--json",
    ]);
    let doc = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}):\n{}\nstderr:\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out, doc)
}

/// Each listed key's checksum status, by test key number.
fn statuses(doc: &serde_json::Value) -> Vec<(u64, String)> {
    let by_hex: Vec<(String, u64)> = (0..KEYS).map(|n| (key(n).to_hex(), n)).collect();
    doc["keys"]
        .as_array()
        .expect("--keys lists keys")
        .iter()
        .map(|k| {
            let hex = k["key"].as_str().expect("hex key");
            let n = by_hex
                .iter()
                .find(|(h, _)| h == hex)
                .unwrap_or_else(|| panic!("a key nobody stored: {hex}"))
                .1;
            (n, k["checksum"].as_str().expect("status").to_owned())
        })
        .collect()
}

/// Every key but `unlisted` is listed: the `bad` ones as checksum mismatches, the rest verified.
fn check_listed(doc: &serde_json::Value, unlisted: &BTreeSet<u64>, bad: &BTreeSet<u64>) {
    let listed = statuses(doc);
    assert_eq!(listed.len() as u64, KEYS - unlisted.len() as u64, "{doc}");
    for (n, status) in &listed {
        assert!(!unlisted.contains(n), "key {n} is listed: {status}");
        let want = if bad.contains(n) {
            "checksum mismatch"
        } else {
            "verified"
        };
        assert_eq!(status, want, "key {n}");
    }
}

fn flip(file: &std::fs::File, offset: u64) {
    let mut b = [0u8; 1];
    file.read_exact_at(&mut b, offset).expect("read");
    file.write_all_at(&[b[0] ^ 0x10], offset).expect("write");
}

/// Where each test key's entry is in the slab's table (entry index = slot).
fn slots(file: &std::fs::File) -> (kvtier::slab::Geometry, Vec<(u64, u64)>) {
    let mut page = vec![0u8; TABLE_PAGE_BYTES];
    file.read_exact_at(&mut page, 0).expect("header");
    let HeaderRead::Valid(h) = kvtier::slab::Header::decode(&page) else {
        panic!("no valid header");
    };
    let g = h.geometry;
    let mut out = Vec::new();
    for p in 0..g.table_pages() {
        file.read_exact_at(&mut page, g.table_page_offset(p))
            .expect("table page");
        for e in 0..ENTRIES_PER_PAGE {
            if let EntryRead::Valid(entry) =
                kvtier::slab::Entry::decode(&page[e * ENTRY_BYTES..(e + 1) * ENTRY_BYTES])
            {
                if let Some(n) = (0..KEYS).find(|&n| key(n) == entry.key) {
                    out.push((n, p * ENTRIES_PER_PAGE as u64 + e as u64));
                }
            }
        }
    }
    (g, out)
}

#[test]
fn inspect_reports_every_kind_of_slab_damage() {
    let dir = scratch();
    let slab = dir.path().join("store.slab");
    let config = build(
        dir.path(),
        &format!(
            "[[devices]]\npath = \"{}\"\ncapacity_bytes = \"16 MiB\"\n",
            slab.display()
        ),
    );
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&slab)
        .expect("slab");
    let (g, map) = slots(&file);
    assert_eq!(map.len() as u64, KEYS);
    let slot_of = |n: u64| map.iter().find(|(k, _)| *k == n).expect("stored").1;
    let entry_at = |n: u64| g.table_offset + slot_of(n) * ENTRY_BYTES as u64;
    let flipped = [3u64, 17, 40, 61];
    let zeroed_slots = [9u64, 50];
    let zeroed_entries = [12u64, 33];
    let garbled_entries = [25u64, 44];
    for &n in &flipped {
        flip(&file, g.slot_offset(slot_of(n)) + n * 1031 % BLOCK);
    }
    for &n in &zeroed_slots {
        file.write_all_at(&vec![0u8; BLOCK as usize], g.slot_offset(slot_of(n)))
            .expect("zero slot");
    }
    for &n in &zeroed_entries {
        file.write_all_at(&[0u8; ENTRY_BYTES], entry_at(n))
            .expect("zero entry");
    }
    for &n in &garbled_entries {
        let garbage: Vec<u8> = (0..ENTRY_BYTES as u64)
            .map(|i| (n * 131 + i * 17) as u8 | 1)
            .collect();
        file.write_all_at(&garbage, entry_at(n)).expect("garble");
    }
    file.sync_all().expect("sync");

    let (out, doc) = inspect(&config);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("BAD BLOCKS"), "{err}");
    let dev = &doc["devices"][0];
    assert_eq!(dev["valid_entries"], KEYS - 4, "{dev}");
    assert_eq!(dev["torn_entries"], 2, "{dev}");
    let bad: BTreeSet<u64> = flipped.iter().chain(&zeroed_slots).copied().collect();
    let gone: BTreeSet<u64> = zeroed_entries
        .iter()
        .chain(&garbled_entries)
        .copied()
        .collect();
    check_listed(&doc, &gone, &bad);
    assert_eq!(doc["verify"]["checksum_failures"], bad.len(), "{doc}");
    assert_eq!(
        doc["verify"]["verified"],
        KEYS - 4 - bad.len() as u64,
        "{doc}"
    );

    // A garbled header: refused with the reason, the device left as it is.
    let before = std::fs::read(&slab).expect("slab bytes");
    flip(&file, 9);
    let out = kvtier(&["inspect", "--config", config.to_str().expect("utf-8")]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("header"), "{err}");
    let after = std::fs::read(&slab).expect("slab bytes");
    assert_eq!(
        before.len(),
        after.len(),
        "inspect never reformats or resizes"
    );
    assert_eq!(
        before[TABLE_PAGE_BYTES..],
        after[TABLE_PAGE_BYTES..],
        "inspect wrote past the header"
    );
}

/// Entries the config no longer routes to the worker that owns their slot (here: the store
/// was written with one worker and is inspected with two) are what the engine's recovery
/// clears; inspect counts them as it does and does not report them stored.
#[test]
fn inspect_agrees_with_recovery_on_unroutable_entries() {
    let dir = scratch();
    let slab = dir.path().join("store.slab");
    let config = build(
        dir.path(),
        &format!(
            "[[devices]]\npath = \"{}\"\ncapacity_bytes = \"16 MiB\"\n",
            slab.display()
        ),
    );
    let file = std::fs::File::open(&slab).expect("slab");
    let (g, map) = slots(&file);
    assert_eq!(map.len() as u64, KEYS);
    let unroutable: BTreeSet<u64> = map
        .iter()
        .filter(|(n, slot)| key(*n).worker(2) != g.worker_of(*slot, 2))
        .map(|(n, _)| *n)
        .collect();
    assert!(
        !unroutable.is_empty() && unroutable.len() < KEYS as usize,
        "the test needs both kinds: {unroutable:?}"
    );
    let text = std::fs::read_to_string(&config).expect("config");
    std::fs::write(&config, text.replace("cores = [0]", "cores = [0, 1]")).expect("config");

    let (out, doc) = inspect(&config);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let dev = &doc["devices"][0];
    let kept = KEYS - unroutable.len() as u64;
    assert_eq!(dev["valid_entries"], KEYS, "{dev}");
    assert_eq!(dev["unroutable_entries"], unroutable.len(), "{dev}");
    assert_eq!(dev["blocks_stored"], kept, "{dev}");
    // The engine inspect opened recovered exactly what the scan said is stored.
    assert_eq!(doc["engine"]["recovered_blocks"], kept, "{doc}");
    assert_eq!(doc["engine"]["blocks_stored"], kept, "{doc}");
    let listed: BTreeSet<u64> = statuses(&doc).into_iter().map(|(n, _)| n).collect();
    assert!(listed.is_disjoint(&unroutable), "{listed:?}");
    assert_eq!(listed.len() as u64, kept);
}

#[test]
fn inspect_reports_every_kind_of_files_damage() {
    let dir = scratch();
    let root = dir.path().join("cache");
    let config = build(
        dir.path(),
        &format!(
            "[[devices]]\npath = \"{}\"\nlayout = \"files\"\ncapacity_bytes = \"64 MiB\"\n",
            root.display()
        ),
    );
    let cfg = Config::from_file(&config).expect("config");
    let mapper = FileMapper::new(&root, &cfg.files.as_ref().expect("files").namespace);
    let open = |n: u64| {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(mapper.key_path(key(n).as_bytes()).expect("path"))
            .expect("block file")
    };
    let flipped = [2u64, 30];
    let zeroed = [7u64];
    let garbled_xattr = [19u64, 51];
    let truncated = [11u64];
    let lengthened = [45u64];
    for &n in &flipped {
        flip(&open(n), n * 977 % BLOCK);
    }
    for &n in &zeroed {
        open(n)
            .write_all_at(&vec![0u8; BLOCK as usize], 0)
            .expect("zero");
    }
    let name = std::ffi::CString::new(kvtier::files::device::CHECKSUM_XATTR).expect("name");
    for &n in &garbled_xattr {
        kvtier_sys::file::fsetxattr(open(n).as_raw_fd(), &name, &0xdead_beef_u32.to_le_bytes())
            .expect("fsetxattr");
    }
    for &n in &truncated {
        open(n).set_len(BLOCK / 3).expect("truncate");
    }
    for &n in &lengthened {
        open(n).set_len(BLOCK + 512).expect("extend");
    }

    let (out, doc) = inspect(&config);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("BAD BLOCKS"), "{err}");
    assert_eq!(doc["devices"][0]["wrong_size_files"], 2, "{doc}");
    let bad: BTreeSet<u64> = flipped
        .iter()
        .chain(&zeroed)
        .chain(&garbled_xattr)
        .copied()
        .collect();
    let wrong_size: BTreeSet<u64> = truncated.iter().chain(&lengthened).copied().collect();
    check_listed(&doc, &wrong_size, &bad);
    assert_eq!(doc["verify"]["checksum_failures"], bad.len(), "{doc}");
}
