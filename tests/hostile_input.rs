//! Hostile input never panics: seeded random bytes and mutations of valid encodings fed to the
//! slot-table entry and header decoders, the config parser, the namespace (TOML and JSON), keys
//! from hex and bytes, and the block-path and object-name parsers. Each must return a value or
//! a clear error. The decoders must also reject every single-bit change of a valid encoding or
//! decode it to exactly what was encoded (the checksums cover every byte they read). A panic is
//! caught and reported with the input that caused it. `KVTIER_FUZZ_CASES` sets the cases per
//! target (default 20000); `KVTIER_FUZZ_SEED` the seed.

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};

use common::env_u64;
use kvtier::files::mapper::{FileMapper, KvCacheGroup, Namespace};
use kvtier::sim::Rng;
use kvtier::slab::{
    Entry, EntryRead, Geometry, Header, HeaderRead, HeaderState, ENTRY_BYTES, TABLE_PAGE_BYTES,
};
use kvtier::{Config, Key};

fn cases() -> u64 {
    env_u64("KVTIER_FUZZ_CASES", 20_000)
}

fn seed() -> u64 {
    env_u64("KVTIER_FUZZ_SEED", 0x0F_0222)
}

/// Runs `f` on `input`; a panic fails the test naming the target and the input.
fn no_panic<T: std::fmt::Debug + ?Sized>(target: &str, input: &T, f: impl FnOnce()) {
    assert!(
        catch_unwind(AssertUnwindSafe(f)).is_ok(),
        "{target} panicked on {input:?}"
    );
}

/// `base` with a few random changes: bytes flipped, set, inserted or removed.
fn mutate(rng: &mut Rng, base: &[u8]) -> Vec<u8> {
    let mut v = base.to_vec();
    for _ in 0..=rng.below(4) {
        let at = if v.is_empty() {
            0
        } else {
            rng.below(v.len() as u64) as usize
        };
        match rng.below(4) {
            0 if !v.is_empty() => v[at] ^= 1 << rng.below(8),
            1 if !v.is_empty() => v[at] = rng.below(256) as u8,
            2 => v.insert(at, rng.below(256) as u8),
            _ if !v.is_empty() => {
                v.remove(at);
            }
            _ => v.push(rng.below(256) as u8),
        }
    }
    v
}

fn random_bytes(rng: &mut Rng, max: u64) -> Vec<u8> {
    (0..rng.below(max + 1))
        .map(|_| rng.below(256) as u8)
        .collect()
}

#[test]
fn slot_table_entries_decode_or_reject_never_panic() {
    let mut rng = Rng::new(seed());
    let entry = Entry {
        seq: 42,
        data_len: 65536,
        data_crc: 0xDEAD_BEEF,
        key: Key::vllm(&[7; 32], 2).expect("key"),
    };
    let mut valid = [0u8; ENTRY_BYTES];
    entry.encode(&mut valid);
    assert_eq!(Entry::decode(&valid), EntryRead::Valid(entry));
    for _ in 0..cases() {
        let mut raw = [0u8; ENTRY_BYTES];
        if rng.below(2) == 0 {
            for b in &mut raw {
                *b = rng.below(256) as u8;
            }
        } else {
            raw = valid;
            let bit = rng.below(ENTRY_BYTES as u64 * 8) as usize;
            raw[bit / 8] ^= 1 << (bit % 8);
            no_panic("Entry::decode", &raw[..], || {
                let read = Entry::decode(&raw);
                assert!(
                    read == EntryRead::Torn || read == EntryRead::Valid(entry),
                    "a one-bit change decoded as {read:?}"
                );
            });
            continue;
        }
        no_panic("Entry::decode", &raw[..], || {
            let _ = Entry::decode(&raw);
        });
    }
}

#[test]
fn headers_decode_or_reject_never_panic() {
    let mut rng = Rng::new(seed() ^ 1);
    let header = Header {
        state: HeaderState::Ready,
        geometry: Geometry {
            block_bytes: 65536,
            slot_bytes: 65536,
            slot_count: 1000,
            table_offset: 4096,
            data_offset: 1 << 20,
        },
        format_id: 99,
    };
    let mut valid = vec![0u8; TABLE_PAGE_BYTES];
    header.encode(&mut valid);
    assert_eq!(Header::decode(&valid), HeaderRead::Valid(header));
    for _ in 0..cases() {
        let mut page = valid.clone();
        if rng.below(2) == 0 {
            for b in &mut page[..128] {
                *b = rng.below(256) as u8;
            }
        } else {
            // Bits 0..68 are the header and its crc; later bytes are not read.
            let bit = rng.below(68 * 8) as usize;
            page[bit / 8] ^= 1 << (bit % 8);
        }
        no_panic("Header::decode", &page[..128], || {
            match Header::decode(&page) {
                HeaderRead::Valid(h) => assert_eq!(h, header, "a changed header decoded as valid"),
                HeaderRead::Foreign(why) => assert!(!why.is_empty()),
                HeaderRead::Empty => panic!("a non-zero page read as empty"),
            }
        });
    }
}

#[test]
fn config_text_parses_or_names_the_problem_never_panics() {
    let mut rng = Rng::new(seed() ^ 2);
    let example = include_str!("../kvtier.example.toml");
    // The example with its commented sections switched on, so [files] and [s3] are fed too.
    let full: String = example
        .lines()
        .map(|l| l.strip_prefix("# ").unwrap_or(l))
        .filter(|l| l.starts_with('[') || l.contains(" = ") || l.is_empty())
        .collect::<Vec<_>>()
        .join("\n");
    for _ in 0..cases() / 4 {
        let base = if rng.below(2) == 0 { example } else { &full };
        let text = String::from_utf8_lossy(&mutate(&mut rng, base.as_bytes())).into_owned();
        no_panic("Config::from_toml_str", &text, || {
            if let Err(e) = Config::from_toml_str(&text) {
                assert!(!e.to_string().is_empty());
            }
        });
    }
}

#[test]
fn namespaces_keys_and_paths_from_hostile_text_never_panic() {
    let mut rng = Rng::new(seed() ^ 3);
    let mut ns = Namespace::new("org/model", "bfloat16", 16, 1);
    ns.kv_cache_groups = vec![KvCacheGroup {
        tokens_per_block: 16,
        layer_names: vec!["layer.0".into()],
    }];
    let json = serde_json::to_string(&ns).expect("json");
    let toml_text = toml::to_string(&ns).expect("toml");
    let mapper = FileMapper::new(std::path::Path::new("/cache"), &ns);
    let valid_path = mapper
        .block_path(&[0xAB; 32], 1)
        .to_string_lossy()
        .into_owned();
    let valid_object = FileMapper::object_key("kv", &ns, &[0xCD; 32], 0);
    let valid_hex = Key::vllm(&[0x11; 32], 3).expect("key").to_hex();
    for _ in 0..cases() / 2 {
        let j = String::from_utf8_lossy(&mutate(&mut rng, json.as_bytes())).into_owned();
        no_panic("Namespace from JSON", &j, || {
            let _ = serde_json::from_str::<Namespace>(&j);
        });
        let t = String::from_utf8_lossy(&mutate(&mut rng, toml_text.as_bytes())).into_owned();
        no_panic("Namespace from TOML", &t, || {
            let _ = toml::from_str::<Namespace>(&t);
        });
        let hex = String::from_utf8_lossy(&mutate(&mut rng, valid_hex.as_bytes())).into_owned();
        no_panic("Key::from_hex", &hex, || {
            if let Ok(k) = Key::from_hex(&hex) {
                assert_eq!(Key::from_hex(&k.to_hex()).expect("round trip"), k);
            }
        });
        let bytes = random_bytes(&mut rng, 80);
        no_panic("Key::new", &bytes, || {
            let _ = Key::new(&bytes);
        });
        let p = String::from_utf8_lossy(&mutate(&mut rng, valid_path.as_bytes())).into_owned();
        no_panic("FileMapper::parse_block_path", &p, || {
            if let Some(key) = mapper.parse_block_path(std::path::Path::new(&p)) {
                assert!(!key.is_empty());
            }
        });
        let o = String::from_utf8_lossy(&mutate(&mut rng, valid_object.as_bytes())).into_owned();
        no_panic("FileMapper::parse_object_name", &o, || {
            let _ = mapper.parse_object_name(&o);
        });
    }
}
