//! End-to-end tests of the operator commands `put`, `get` and `inspect --keys` on both layouts,
//! run as a user would run the built `kvtier` binary. Each builds a small store in its own
//! temporary directory under /var/tmp (not /tmp, which may be tmpfs and refuse `O_DIRECT` and
//! user xattrs) and checks exit codes, output and the bytes on disk. They catch: a round trip
//! that changes bytes, a miss or a wrong-size input that does not fail clearly, a files store
//! whose keys inspect cannot list, a block written without a checksum (as vLLM writes them)
//! reported as verified or as bad, and a corrupt file that inspect does not flag.

mod common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Output;

use common::kvtier;

use kvtier::files::mapper::FileMapper;
use kvtier::{Config, Key};

const BLOCK: usize = 64 * 1024;

fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("kvtier-files-cli-test-")
        .tempdir_in("/var/tmp")
        .expect("a temporary directory in /var/tmp")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn json_stdout(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}):\n{}\nstderr:\n{}",
            stdout(out),
            stderr(out)
        )
    })
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("temporary paths are UTF-8")
}

/// A files-layout config in `dir`, with its device directory `dir/cache`.
fn files_config(dir: &Path) -> PathBuf {
    let config = dir.join("files.toml");
    let text = format!(
        "block_size = \"64 KiB\"\n\n[[devices]]\npath = \"{}\"\nlayout = \"files\"\n\
         capacity_bytes = \"64 MiB\"\n\n[files.namespace]\nmodel_name = \"test/model\"\n\
         dtype = \"float16\"\ntokens_per_hash = 16\nblocks_per_file = 1\n\n\
         [[files.namespace.kv_cache_groups]]\ntokens_per_block = 16\n\
         layer_names = [\"layer.0\"]\n",
        path_str(&dir.join("cache"))
    );
    std::fs::write(&config, text).expect("write config");
    config
}

/// A slab config in `dir`: one 16 MiB slab file, created by the first `put`.
fn slab_config(dir: &Path) -> PathBuf {
    let config = dir.join("slab.toml");
    let text = format!(
        "block_size = \"64 KiB\"\n\n[[devices]]\npath = \"{}\"\ncapacity_bytes = \"16 MiB\"\n",
        path_str(&dir.join("store.slab"))
    );
    std::fs::write(&config, text).expect("write config");
    config
}

/// The vLLM-shaped key (32-byte hash, group 0) of test key number `n`.
fn key(n: u64) -> Key {
    let mut hash = [0u8; 32];
    for (i, chunk) in hash.chunks_exact_mut(8).enumerate() {
        chunk.copy_from_slice(&(n.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i as u64).to_le_bytes());
    }
    Key::vllm(&hash, 0).expect("a vLLM key")
}

/// `len` pseudorandom bytes that depend on `seed`.
fn content(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Writes `bytes` to a file in `dir` and puts it under key `n`; returns the command's output.
fn put(dir: &Path, config: &Path, n: u64, bytes: &[u8], extra: &[&str]) -> Output {
    let input = dir.join(format!("in-{n}.bin"));
    std::fs::write(&input, bytes).expect("write input");
    let hex = key(n).to_hex();
    let mut args = vec![
        "put",
        "--config",
        path_str(config),
        "--key",
        &hex,
        "--in",
        path_str(&input),
    ];
    args.extend_from_slice(extra);
    kvtier(&args)
}

fn put_ok(dir: &Path, config: &Path, n: u64, bytes: &[u8]) {
    let out = put(dir, config, n, bytes, &[]);
    assert!(out.status.success(), "put {n}: {}", stderr(&out));
}

/// Gets key `n` into a file; returns the output and the file's path.
fn get(dir: &Path, config: &Path, n: u64) -> (Output, PathBuf) {
    let out_path = dir.join(format!("out-{n}.bin"));
    let out = kvtier(&[
        "get",
        "--config",
        path_str(config),
        "--key",
        &key(n).to_hex(),
        "--out",
        path_str(&out_path),
    ]);
    (out, out_path)
}

/// The file that holds key `n` in the files store of `config`.
fn block_file(config: &Path, n: u64) -> PathBuf {
    let config = Config::from_file(config).expect("config parses");
    let files = config.files.expect("a [files] section");
    FileMapper::new(&config.devices[0].path, &files.namespace)
        .key_path(key(n).as_bytes())
        .expect("a vLLM-shaped key has a path")
}

/// The `--keys` entry of key `n` in an `inspect --json` document.
fn key_entry(doc: &serde_json::Value, n: u64) -> &serde_json::Value {
    let hex = key(n).to_hex();
    doc["keys"]
        .as_array()
        .expect("keys array")
        .iter()
        .find(|k| k["key"] == hex.as_str())
        .unwrap_or_else(|| panic!("key {hex} not listed in {doc}"))
}

// put stores exactly the file's bytes at the vLLM path, get returns them byte for byte, and a
// second put of the same key is a skipped success.
#[test]
fn files_put_then_get_round_trips_exactly() {
    let dir = scratch();
    let config = files_config(dir.path());
    let bytes = content(1, BLOCK);
    let out = put(dir.path(), &config, 1, &bytes, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("stored"), "{}", stdout(&out));
    assert_eq!(
        std::fs::read(block_file(&config, 1)).expect("block file at the vLLM path"),
        bytes,
        "the file holds exactly the block"
    );
    let (out, got) = get(dir.path(), &config, 1);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(std::fs::read(got).expect("get wrote --out"), bytes);

    let out = put(dir.path(), &config, 1, &content(2, BLOCK), &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("already present"), "{}", stdout(&out));
    let (out, got) = get(dir.path(), &config, 1);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        std::fs::read(got).expect("get wrote --out"),
        bytes,
        "unchanged"
    );
}

// A key that is not stored is a runtime error (exit 1) naming the key, and no output file is
// left; a key that is not hex is a usage error (exit 2).
#[test]
fn get_of_a_missing_key_fails_naming_it() {
    let dir = scratch();
    let config = files_config(dir.path());
    put_ok(dir.path(), &config, 1, &content(1, BLOCK));
    let (out, out_path) = get(dir.path(), &config, 2);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains(&key(2).to_hex()), "{err}");
    assert!(err.contains("not stored"), "{err}");
    assert!(!out_path.exists(), "no output for a miss");

    let out = kvtier(&[
        "get",
        "--config",
        path_str(&config),
        "--key",
        "xyz",
        "--out",
        path_str(&out_path),
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("xyz"), "{}", stderr(&out));
}

// A block file must be exactly block_size bytes: the error names both sizes; --pad accepts a
// shorter file and stores it zero-padded, but never a longer one.
#[test]
fn put_of_a_wrong_size_file_fails_naming_both_sizes() {
    let dir = scratch();
    let config = files_config(dir.path());
    let short = content(3, 1000);
    let out = put(dir.path(), &config, 3, &short, &[]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("1000") && err.contains(&BLOCK.to_string()),
        "{err}"
    );
    assert!(err.contains("--pad"), "{err}");
    let out = put(dir.path(), &config, 3, &content(3, BLOCK + 1), &["--pad"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains(&(BLOCK + 1).to_string()),
        "{}",
        stderr(&out)
    );

    let out = put(dir.path(), &config, 3, &short, &["--pad"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let (out, got) = get(dir.path(), &config, 3);
    assert!(out.status.success(), "{}", stderr(&out));
    let mut want = short;
    want.resize(BLOCK, 0);
    assert_eq!(std::fs::read(got).expect("get wrote --out"), want);
}

// inspect --keys lists every key put (checksum verified from the xattr) and a file written by
// hand at the mapper path, as vLLM writes them, without an xattr ("no checksum", not an error).
#[test]
fn files_inspect_lists_keys_with_checksum_status() {
    let dir = scratch();
    let config = files_config(dir.path());
    for n in 1..=3 {
        put_ok(dir.path(), &config, n, &content(n, BLOCK));
    }
    let by_hand = block_file(&config, 4);
    std::fs::create_dir_all(by_hand.parent().expect("group directory")).expect("mkdir");
    std::fs::write(&by_hand, content(4, BLOCK)).expect("write a block file like vLLM");

    let out = kvtier(&["inspect", "--config", path_str(&config), "--keys", "--json"]);
    assert!(
        out.status.success(),
        "exit {:?}\n{}",
        out.status,
        stderr(&out)
    );
    let doc = json_stdout(&out);
    assert_eq!(doc["layout"], "files", "{doc}");
    assert_eq!(doc["devices"][0]["blocks"], 4, "{doc}");
    assert_eq!(doc["devices"][0]["kind"], "directory", "{doc}");
    assert_eq!(doc["verify"]["keys"], 4, "{doc}");
    assert_eq!(doc["verify"]["verified"], 3, "{doc}");
    assert_eq!(doc["verify"]["no_checksum"], 1, "{doc}");
    assert_eq!(doc["verify"]["checksum_failures"], 0, "{doc}");
    assert_eq!(doc["keys"].as_array().expect("keys").len(), 4, "{doc}");
    for n in 1..=3 {
        let entry = key_entry(&doc, n);
        assert_eq!(entry["checksum"], "verified", "{entry}");
        assert_eq!(entry["size_bytes"], BLOCK, "{entry}");
    }
    assert_eq!(key_entry(&doc, 4)["checksum"], "no checksum", "{doc}");
    assert!(by_hand.exists(), "a file without a checksum is kept");

    // The human report lists the keys too.
    let out = kvtier(&["inspect", "--config", path_str(&config), "--keys"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains(&key(4).to_hex()) && text.contains("no checksum"),
        "{text}"
    );
}

// A byte flipped in place (the xattr stays) is a checksum mismatch: inspect reports exactly
// one, exits 1, and the engine removed the file; the other key still verifies.
#[test]
fn files_inspect_flags_a_corrupt_file() {
    let dir = scratch();
    let config = files_config(dir.path());
    put_ok(dir.path(), &config, 1, &content(1, BLOCK));
    put_ok(dir.path(), &config, 2, &content(2, BLOCK));
    let victim = block_file(&config, 2);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&victim)
        .expect("open the block file");
    let mut byte = [0u8; 1];
    file.read_exact_at(&mut byte, 1234).expect("read a byte");
    file.write_all_at(&[!byte[0]], 1234).expect("flip it");
    drop(file);

    let out = kvtier(&["inspect", "--config", path_str(&config), "--keys", "--json"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let doc = json_stdout(&out);
    assert_eq!(doc["verify"]["checksum_failures"], 1, "{doc}");
    assert_eq!(doc["verify"]["verified"], 1, "{doc}");
    assert_eq!(key_entry(&doc, 2)["checksum"], "checksum mismatch", "{doc}");
    assert_eq!(key_entry(&doc, 1)["checksum"], "verified", "{doc}");
    assert!(stderr(&out).contains("BAD BLOCKS"), "{}", stderr(&out));
    assert!(!victim.exists(), "the corrupt file is removed");
}

// The same commands on a slab store: put creates it, get round-trips, a miss fails, and
// inspect --keys lists the keys with their sizes, verified against the slot table.
#[test]
fn slab_put_get_inspect() {
    let dir = scratch();
    let config = slab_config(dir.path());
    let one = content(11, BLOCK);
    put_ok(dir.path(), &config, 1, &one);
    put_ok(dir.path(), &config, 2, &content(12, BLOCK));
    let (out, got) = get(dir.path(), &config, 1);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(std::fs::read(got).expect("get wrote --out"), one);
    let (out, _) = get(dir.path(), &config, 3);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains(&key(3).to_hex()), "{}", stderr(&out));

    let out = kvtier(&["inspect", "--config", path_str(&config), "--keys", "--json"]);
    assert!(
        out.status.success(),
        "exit {:?}\n{}",
        out.status,
        stderr(&out)
    );
    let doc = json_stdout(&out);
    assert_eq!(doc["layout"], "slab", "{doc}");
    assert_eq!(doc["verify"]["keys"], 2, "{doc}");
    assert_eq!(doc["verify"]["verified"], 2, "{doc}");
    for n in 1..=2 {
        let entry = key_entry(&doc, n);
        assert_eq!(entry["checksum"], "verified", "{entry}");
        assert_eq!(entry["size_bytes"], BLOCK, "{entry}");
    }
}

// get never creates a store: on a config whose slab file does not exist it fails with a usage
// error and leaves nothing behind.
#[test]
fn get_never_creates_a_store() {
    let dir = scratch();
    let config = slab_config(dir.path());
    let (out, _) = get(dir.path(), &config, 1);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("does not exist"), "{}", stderr(&out));
    assert!(!dir.path().join("store.slab").exists());
}
