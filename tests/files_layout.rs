//! The `files` layout: vLLM 0.33.0's file-system tier layout, byte for byte and path for path,
//! plus what vLLM lacks — an in-memory index, checksums in an xattr, a capacity bound with LRU
//! eviction shared by processes, crash cleanup of temp files, ENOSPC handling. All through real
//! io_uring file operations on a scratch directory. What would break: a path or config.json
//! that vLLM would not find, a header in the file, serving a short or corrupt file, temp files
//! left behind, the bound exceeded.
#![allow(clippy::field_reassign_with_default, clippy::needless_range_loop)]

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use common::*;
use kvtier::config::{Cores, DeviceConfig, FilesConfig, FirstLookup, Layout, SyncMode};
use kvtier::files::mapper::{FileMapper, KvCacheGroup, Namespace};
use kvtier::{Config, Engine, Key, KeyFailure, Lookup, Tier};

fn namespace() -> Namespace {
    let mut ns = Namespace::new("test/model", "float16", 16, 1);
    ns.kv_cache_groups = vec![KvCacheGroup {
        tokens_per_block: 16,
        layer_names: vec!["layer.0".into()],
    }];
    ns
}

fn files_config(root: &Path, capacity: Option<u64>) -> Config {
    let mut c = Config::default();
    c.block_size = BLOCK;
    c.cores = Cores::List(vec![0, 1]);
    let mut d = DeviceConfig::new(root);
    d.layout = Layout::Files;
    d.capacity_bytes = capacity;
    c.devices = vec![d];
    c.files = Some(FilesConfig {
        namespace: namespace(),
        sync: SyncMode::None,
        temp_grace_secs: 600,
        checksums: true,
        file_mode: FilesConfig::DEFAULT_FILE_MODE,
        dir_mode: FilesConfig::DEFAULT_DIR_MODE,
        first_lookup: FirstLookup::Miss,
        lookup_cache_max: FilesConfig::DEFAULT_LOOKUP_CACHE_MAX,
        lookup_ttl_ms: FilesConfig::DEFAULT_LOOKUP_TTL_MS,
        io_wq_workers: FilesConfig::DEFAULT_IO_WQ_WORKERS,
        stores_opening: FilesConfig::DEFAULT_STORES_OPENING,
    });
    c.events.enabled = true;
    c
}

fn mapper(root: &Path) -> FileMapper {
    FileMapper::new(root, &namespace())
}

fn path_of(root: &Path, id: u64) -> PathBuf {
    mapper(root)
        .key_path(key(id).as_bytes())
        .expect("vLLM-shaped key")
}

fn open(cfg: &Config, region: &std::sync::Arc<kvtier::Region>) -> Option<Engine> {
    open_real(cfg, region)
}

/// Bytes of `.bin` and `.tmp` files under the data directory of `root`, and the temp files.
fn disk_bytes(root: &Path) -> (u64, usize) {
    common::disk_bytes(&mapper(root).data_dir())
}

#[test]
fn blocks_land_at_vllm_paths_with_raw_bytes_and_round_trip() {
    let dir = scratch_dir();
    let cfg = files_config(dir.path(), Some(64 << 20));
    let region = region(16);
    let Some(engine) = open(&cfg, &region) else {
        return;
    };
    let ids: Vec<u64> = (0..12).collect();
    let r = store(&engine, &region, 1, &ids);
    assert!(r.success, "{r:?}");
    for &id in &ids {
        let bytes = std::fs::read(path_of(dir.path(), id)).expect("block file at the vLLM path");
        assert_eq!(
            bytes,
            content(id, BLOCK as usize),
            "file holds exactly the block, no header"
        );
    }
    let m = mapper(dir.path());
    let text = std::fs::read_to_string(m.config_file_path()).expect("config.json");
    assert_eq!(text, m.config_json_text());
    assert!(
        m.data_dir().to_string_lossy().contains("test_model_"),
        "{}",
        m.data_dir().display()
    );
    let r = load(&engine, &region, 2, &ids);
    assert!(r.success, "{r:?}");
    for (b, &id) in ids.iter().enumerate() {
        assert!(holds(&region, b as u32, id));
    }
    assert_eq!(disk_bytes(dir.path()).1, 0, "no temp files left");
    // Storing a key whose file exists is a skipped success: the file is not rewritten.
    let before = std::fs::metadata(path_of(dir.path(), 3))
        .and_then(|m| m.modified())
        .expect("mtime");
    let r = store(&engine, &region, 3, &[3]);
    assert!(r.success && r.bytes == 0, "{r:?}");
    let after = std::fs::metadata(path_of(dir.path(), 3))
        .and_then(|m| m.modified())
        .expect("mtime");
    assert_eq!(before, after);
    let events = engine.take_events();
    assert!(events.iter().any(|e| !e.removed && e.keys.len() == 12));
}

#[test]
fn a_directory_written_by_vllm_is_read_and_crash_leftovers_cleaned() {
    let dir = scratch_dir();
    // Hand-build what vLLM would leave: block files with raw bytes and no xattr, config.json,
    // an old temp file from a crashed writer and a fresh one from a live writer.
    let m = mapper(dir.path());
    for id in 100..105u64 {
        let p = path_of(dir.path(), id);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(&p, content(id, BLOCK as usize)).expect("write");
    }
    std::fs::create_dir_all(m.base_path()).expect("base");
    std::fs::write(m.config_file_path(), m.config_json_text()).expect("config.json");
    let stale = FileMapper::temp_path(&path_of(dir.path(), 100), 42);
    std::fs::write(&stale, b"half a block").expect("stale tmp");
    let old = SystemTime::now() - Duration::from_hours(1);
    std::fs::File::options()
        .write(true)
        .open(&stale)
        .and_then(|f| f.set_modified(old))
        .expect("age it");
    let fresh = FileMapper::temp_path(&path_of(dir.path(), 101), 43);
    std::fs::write(&fresh, b"being written").expect("fresh tmp");

    let cfg = files_config(dir.path(), Some(64 << 20));
    let region = region(8);
    let Some(engine) = open(&cfg, &region) else {
        return;
    };
    let report = engine.info().devices[0]
        .files
        .clone()
        .expect("files report");
    assert_eq!(report.blocks, 5);
    assert_eq!(report.temps_removed, 1);
    assert_eq!(report.temps_kept, 1);
    assert!(
        !stale.exists() && fresh.exists(),
        "only the stale temp file is removed"
    );
    let ids: Vec<u64> = (100..105).collect();
    let keys: Vec<_> = ids.iter().map(|&i| key(i)).collect();
    assert!(engine
        .lookup(&keys)
        .iter()
        .all(|l| *l == Lookup::Hit(Tier::Nvme)));
    let r = load(&engine, &region, 1, &ids);
    assert!(r.success, "{r:?}");
    for (b, &id) in ids.iter().enumerate() {
        assert!(holds(&region, b as u32, id), "vLLM's bytes for {id}");
    }
}

#[test]
fn a_block_published_by_another_writer_after_open_is_found() {
    let dir = scratch_dir();
    let cfg = files_config(dir.path(), None);
    let region = region(4);
    let Some(engine) = open(&cfg, &region) else {
        return;
    };
    // Not indexed: a miss at once (files.first_lookup = "miss"), and the worker is asked (a
    // statx on its ring), never a syscall on this thread.
    assert_eq!(engine.lookup(&[key(7)]), vec![Lookup::Miss]);
    let p = path_of(dir.path(), 7);
    std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
    std::fs::write(&p, content(7, BLOCK as usize)).expect("write");
    // The "absent" answer is served for files.lookup_ttl_ms while the worker asks again.
    wait_until(|| engine.lookup(&[key(7)]) == vec![Lookup::Hit(Tier::Nvme)]);
    let r = load(&engine, &region, 1, &[7]);
    assert!(r.success, "{r:?}");
    assert!(holds(&region, 0, 7));
}

// With first_lookup = "pending", keys not indexed are Pending while their worker is asked (a
// statx on its ring), a bounded number at a time: past the bound they are misses without
// asking; every question is answered; a file of another size is not a block; an absent answer
// is asked again after lookup_ttl_ms, and a block published in between is then found.
#[test]
fn lookups_of_keys_not_indexed_are_bounded_and_settle() {
    let dir = scratch_dir();
    let mut cfg = files_config(dir.path(), None);
    let files = cfg.files.as_mut().expect("files");
    files.lookup_ttl_ms = 50;
    files.first_lookup = FirstLookup::Pending;
    let region = region(4);
    let Some(engine) = open(&cfg, &region) else {
        return;
    };
    let keys: Vec<Key> = (0..20_000u64).map(|i| key(0x4000 + i)).collect();
    let first = engine.lookup(&keys);
    let pending = first.iter().filter(|l| **l == Lookup::Pending).count();
    let missed = first.iter().filter(|l| **l == Lookup::Miss).count();
    assert_eq!(pending + missed, keys.len(), "only Pending or Miss");
    assert!(
        (1..=2 * 4096).contains(&pending),
        "{pending} asked: at most 4096 per worker"
    );
    assert!(settled(&engine, &keys).iter().all(|l| *l == Lookup::Miss));
    // A file one byte short of a block, and a block, published by someone else.
    let short = path_of(dir.path(), 0x4000);
    let good = path_of(dir.path(), 0x4001);
    for (p, len) in [(&short, BLOCK as usize - 1), (&good, BLOCK as usize)] {
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(p, content(0x4000, len)).expect("write");
    }
    wait_until(|| engine.lookup(&[keys[1]]) == vec![Lookup::Hit(Tier::Nvme)]);
    let d = &engine.stats().devices[0];
    assert_eq!(d.probes_found, 1, "one block was found by a probe");
    assert!(
        d.probes_absent >= pending as u64,
        "{} absent",
        d.probes_absent
    );
    assert!(
        engine
            .metrics_text()
            .contains("kvtier_device_probes_total{device="),
        "the probes are exported"
    );
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        settled(&engine, &[keys[0]]),
        vec![Lookup::Miss],
        "not a block"
    );
    // Every question was answered: new keys are asked again.
    let again: Vec<Key> = (0..100u64).map(|i| key(0x9000_0000 + i)).collect();
    assert!(engine.lookup(&again).iter().all(|l| *l == Lookup::Pending));
    assert!(settled(&engine, &again).iter().all(|l| *l == Lookup::Miss));
}

#[test]
fn a_short_file_fails_its_load_keeps_the_prefix_and_is_removed() {
    let dir = scratch_dir();
    let cfg = files_config(dir.path(), None);
    let region = region(4);
    let Some(engine) = open(&cfg, &region) else {
        return;
    };
    assert!(store(&engine, &region, 1, &[1, 2, 3]).success);
    let p3 = path_of(dir.path(), 3);
    std::fs::File::options()
        .write(true)
        .open(&p3)
        .and_then(|f| f.set_len(BLOCK / 2))
        .expect("truncate");
    let r = load(&engine, &region, 2, &[1, 2, 3]);
    assert!(!r.success);
    assert_eq!(r.successful_keys(), Some(2));
    assert!(
        matches!(
            r.failure().map(|f| f.reason),
            Some(KeyFailure::ShortIo { .. })
        ),
        "{r:?}"
    );
    assert!(holds(&region, 0, 1) && holds(&region, 1, 2));
    wait_until(|| !p3.exists());
    assert_eq!(engine.lookup(&[key(3)]), vec![Lookup::Miss]);
    assert!(path_of(dir.path(), 1).exists(), "good files are kept");
}

#[test]
fn a_corrupt_full_size_file_is_caught_by_its_checksum() {
    let dir = scratch_dir();
    let cfg = files_config(dir.path(), None);
    let region = region(4);
    let Some(engine) = open(&cfg, &region) else {
        return;
    };
    assert!(store(&engine, &region, 1, &[1]).success);
    let p = path_of(dir.path(), 1);
    let mut bytes = std::fs::read(&p).expect("read");
    bytes[1000] ^= 0xff;
    // Rewrite in place (keeps the inode and its xattr).
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .and_then(|mut f| {
            use std::io::Write;
            f.write_all(&bytes)
        })
        .expect("corrupt");
    let r = load(&engine, &region, 2, &[1]);
    if r.success {
        // The file system keeps no xattrs: nothing to check against (like vLLM).
        kvtier_sys::skip!("no user xattrs on this file system");
        return;
    }
    assert_eq!(
        r.failure().map(|f| f.reason),
        Some(KeyFailure::Checksum),
        "{r:?}"
    );
    wait_until(|| !p.exists());
    assert_eq!(engine.stats().checksum_failures, 1);
}

#[test]
fn the_capacity_bound_holds_under_a_long_store_stream() {
    let dir = scratch_dir();
    let capacity = 16u64 << 20; // 256 blocks of 64 KiB
    let cfg = files_config(dir.path(), Some(capacity));
    let region = region(8);
    let Some(engine) = open(&cfg, &region) else {
        return;
    };
    let mut next = 0u64;
    for job in 0..100u64 {
        let ids: Vec<u64> = (next..next + 8).collect();
        next += 8;
        let r = store(&engine, &region, job, &ids);
        assert!(r.success, "job {job}: {r:?}");
        let (bytes, _) = disk_bytes(dir.path());
        assert!(
            bytes <= capacity,
            "job {job}: {bytes} bytes on disk > {capacity}"
        );
    }
    let s = engine.stats();
    assert!(s.evictions >= 800 - 256, "evictions {}", s.evictions);
    let removed: usize = engine
        .take_events()
        .iter()
        .filter(|e| e.removed)
        .map(|e| e.keys.len())
        .sum();
    assert_eq!(removed as u64, s.evictions);
    // The most recent blocks are the ones kept.
    let r = load(&engine, &region, 1000, &[next - 1, next - 2]);
    assert!(r.success, "{r:?}");
    assert_eq!(
        engine.lookup(&[key(0)]),
        vec![Lookup::Miss],
        "the oldest was evicted"
    );
}

/// `stores_opening = 1`: one store per worker prepares (opens its temp file, makes its
/// directories, sets its checksum) at a time, the others wait their turn; every block still
/// lands whole, through the ENOENT-then-mkdir path of new directories as much as through
/// existing ones, and no temp file is left.
#[test]
fn stores_prepared_one_at_a_time_all_land() {
    let dir = scratch_dir();
    let mut cfg = files_config(dir.path(), None);
    cfg.files.as_mut().expect("files").stores_opening = 1;
    let region = region(32);
    let Some(engine) = open(&cfg, &region) else {
        return;
    };
    let ids: Vec<u64> = (0..32).collect();
    let r = store(&engine, &region, 1, &ids);
    assert!(r.success && r.bytes == 32 * BLOCK, "{r:?}");
    for &id in &ids {
        let bytes = std::fs::read(path_of(dir.path(), id)).expect("block file");
        assert_eq!(bytes, content(id, BLOCK as usize), "block {id}");
    }
    assert_eq!(disk_bytes(dir.path()).1, 0, "no temp files left");
    // Reloaded over other contents: the bytes come from the files.
    let again: Vec<u64> = (100..132).collect();
    assert!(store(&engine, &region, 2, &again).success);
    let r = load(&engine, &region, 3, &ids);
    assert!(r.success, "{r:?}");
    for (b, &id) in ids.iter().enumerate() {
        assert!(holds(&region, b as u32, id), "block {id}");
    }
}

#[test]
fn sync_data_stores_round_trip() {
    let dir = scratch_dir();
    let mut cfg = files_config(dir.path(), None);
    cfg.files.as_mut().expect("files").sync = SyncMode::Data;
    let region = region(4);
    let Some(engine) = open(&cfg, &region) else {
        return;
    };
    assert!(store(&engine, &region, 1, &[1, 2]).success);
    assert!(load(&engine, &region, 2, &[1, 2]).success);
    assert!(holds(&region, 0, 1) && holds(&region, 1, 2));
}

#[test]
fn enospc_fails_cleanly_and_loads_keep_working() {
    let dir = scratch_dir();
    let point = dir.path().join("small");
    std::fs::create_dir_all(&point).expect("mkdir");
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=2m", "tmpfs"])
        .arg(&point)
        .status()
        .is_ok_and(|s| s.success());
    if !mounted {
        return kvtier_sys::skip!("cannot mount a small tmpfs here (needs root)");
    }
    let _umount = Umount(point.clone());
    let cfg = files_config(&point, Some(64 << 20));
    let region = region(8);
    let Some(engine) = open(&cfg, &region) else {
        return;
    };
    assert!(store(&engine, &region, 1, &[1]).success);
    // Fill the file system with something that is not ours to evict.
    let filler = point.join("filler");
    let _ = std::fs::write(&filler, vec![0u8; 2 << 20]);
    let ids: Vec<u64> = (10..14).collect();
    let r = store(&engine, &region, 2, &ids);
    // Evicting block 1 makes room for one block at most: that cannot hold four.
    assert!(
        !r.success,
        "stores cannot all succeed on a full file system: {r:?}"
    );
    let f = r.failure().expect("failure");
    assert!(
        matches!(
            f.reason,
            KeyFailure::Io(kvtier::Errno::ENOSPC) | KeyFailure::NoSpace
        ),
        "{f:?}"
    );
    wait_until(|| disk_bytes(&point).1 == 0);
    // Room again: loads and stores work.
    std::fs::remove_file(&filler).expect("rm filler");
    assert!(store(&engine, &region, 3, &[20]).success);
    assert!(load(&engine, &region, 4, &[20]).success);
    assert!(holds(&region, 0, 20));
}

struct Umount(PathBuf);

impl Drop for Umount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

const CHILD_ENV: &str = "KVTIER_FILES_CHILD_DIR";

/// Entry point for the second process of `two_processes_share_one_directory`.
#[test]
fn child_process_entry() {
    let Ok(root) = std::env::var(CHILD_ENV) else {
        return;
    };
    run_sharer(Path::new(&root), 1);
}

fn run_sharer(root: &Path, who: u64) {
    let cfg = files_config(root, Some(16 << 20));
    let region = region(8);
    let engine = Engine::open(&cfg, region.clone()).expect("open");
    // Overlapping keys: both processes store 0..48, then load all of them back.
    for j in 0..12u64 {
        let ids: Vec<u64> = (j * 4..j * 4 + 4).collect();
        let r = store(&engine, &region, who * 1000 + j, &ids);
        assert!(r.success, "process {who}: {r:?}");
    }
    for j in 0..12u64 {
        let ids: Vec<u64> = (j * 4..j * 4 + 4).collect();
        let r = load(&engine, &region, who * 2000 + j, &ids);
        for i in 0..r.succeeded_prefix {
            assert!(
                holds(&region, i as u32, ids[i]),
                "process {who}: wrong bytes for {}",
                ids[i]
            );
        }
        assert!(r.success, "process {who}: {r:?}");
    }
}

#[test]
fn two_processes_share_one_directory() {
    let dir = scratch_dir();
    // Create the namespace first so both processes agree on it from the start.
    drop(open(&files_config(dir.path(), Some(16 << 20)), &region(2)));
    let exe = std::env::current_exe().expect("test binary");
    // The child's output is captured (and shown only if it fails), so its test runner's
    // summary line does not mix with this one's.
    let child = std::process::Command::new(exe)
        .args([
            "--exact",
            "child_process_entry",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, dir.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn the second process");
    run_sharer(dir.path(), 0);
    let out = child.wait_with_output().expect("child");
    assert!(
        out.status.success(),
        "the second process failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("1 passed"),
        "the child ran its entry"
    );
    let (bytes, temps) = disk_bytes(dir.path());
    assert_eq!(temps, 0);
    assert_eq!(bytes, 48 * BLOCK, "each key stored once");
}

fn wait_until(mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(
            std::time::Instant::now() < deadline,
            "condition not reached"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn files_layout_config_is_checked() {
    let text = "[[devices]]\npath = \"/x\"\nlayout = \"files\"\n";
    let msg = Config::from_toml_str(text)
        .expect_err("needs [files]")
        .to_string();
    assert!(msg.contains("files") && msg.contains("[files]"), "{msg}");
    let text = "[[devices]]\npath = \"/x\"\nlayout = \"files\"\n[files]\nsync = \"always\"\n[files.namespace]\nmodel_name = \"m\"\ndtype = \"float16\"\ntokens_per_hash = 16\nblocks_per_file = 1\nkv_cache_groups = []\n";
    let msg = Config::from_toml_str(text)
        .expect_err("bad sync")
        .to_string();
    assert!(
        msg.contains("files.sync") && msg.contains("always"),
        "{msg}"
    );
    let good = text.replace("\"always\"", "\"data\"");
    let cfg = Config::from_toml_str(&good).expect("valid");
    assert_eq!(cfg.files.expect("files").sync, SyncMode::Data);
}

/// The only failure of `r`, which must be a refusal naming `what`.
fn assert_refused(r: &kvtier::JobResult, what: &str) {
    let f = r
        .failure()
        .unwrap_or_else(|| panic!("expected a refusal: {r:?}"));
    assert_eq!(f.reason, KeyFailure::Refused, "{r:?}");
    assert!(
        f.detail.contains(what),
        "`{what}` missing from: {}",
        f.detail
    );
}

fn empty_dir(path: &Path) -> bool {
    std::fs::read_dir(path).expect("read_dir").next().is_none()
}

// A symlink planted at a block path or at any directory below the root, and a FIFO, a socket
// or a directory at a block path, are refused with a reason and counted: never followed, never
// read, never blocking, and no byte of what a symlink points at reaches the region. Stores
// through a planted directory symlink fail and create nothing at its target.
#[test]
fn symlinks_and_non_regular_files_below_the_root_are_refused_never_followed() {
    use std::os::unix::fs::symlink;
    let dir = scratch_dir();
    let outside = scratch_dir();
    let cfg = files_config(dir.path(), None);
    let region = region(4);
    let Some(engine) = open(&cfg, &region) else {
        return;
    };
    // What a followed symlink would serve: a block-sized file elsewhere, other bytes.
    let secret = outside.path().join("secret.bin");
    std::fs::write(&secret, content(999, BLOCK as usize)).expect("secret");
    let plant = |id: u64| {
        let p = path_of(dir.path(), id);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        p
    };

    symlink(&secret, plant(1)).expect("symlink");
    assert_eq!(
        engine.lookup(&[key(1)]),
        vec![Lookup::Miss],
        "a symlink is not a block"
    );
    let r = load(&engine, &region, 1, &[1]);
    assert_refused(&r, "symlink");
    assert!(!holds(&region, 0, 999), "the symlink's target was served");

    nix::unistd::mkfifo(&plant(2), nix::sys::stat::Mode::from_bits_truncate(0o600))
        .expect("mkfifo");
    assert_refused(&load(&engine, &region, 2, &[2]), "a FIFO");
    std::fs::create_dir(plant(3)).expect("dir at a block path");
    assert_refused(&load(&engine, &region, 3, &[3]), "a directory");
    // Bound at a short path (SUN_LEN) and renamed into place: the socket node moves with it.
    let short = std::env::temp_dir().join(format!("kvtier-sock-{}", std::process::id()));
    let socket = std::os::unix::net::UnixListener::bind(&short).expect("socket");
    std::fs::rename(&short, plant(4)).expect("move the socket");
    assert_refused(&load(&engine, &region, 4, &[4]), "a socket");
    drop(socket);

    // A stored block whose leaf directory is then swapped for a symlink to a copy of it.
    let a = 0x2220_0000_0000_0000;
    assert!(store(&engine, &region, 5, &[a]).success);
    let leaf = path_of(dir.path(), a).parent().expect("leaf").to_path_buf();
    let moved = outside.path().join("moved");
    std::fs::rename(&leaf, &moved).expect("move the leaf out");
    symlink(&moved, &leaf).expect("symlink the leaf");
    assert_refused(&load(&engine, &region, 6, &[a]), "symlink");

    assert!(
        !holds(&region, 0, a),
        "served through a symlinked directory"
    );

    // A store below a symlinked <hhh> fails and makes nothing at the symlink's target.
    let b = 0x3330_0000_0000_0000;
    let top = path_of(dir.path(), b)
        .ancestors()
        .nth(2)
        .expect("<hhh>")
        .to_path_buf();
    let target = outside.path().join("target");
    std::fs::create_dir(&target).expect("target");
    symlink(&target, &top).expect("symlink <hhh>");
    let r = store(&engine, &region, 7, &[b]);
    let f = r
        .failure()
        .unwrap_or_else(|| panic!("store through a symlink: {r:?}"));
    assert!(f.detail.contains("symlink"), "{}", f.detail);
    assert!(empty_dir(&target), "created something through the symlink");

    // Five loads (symlink, FIFO, directory, socket, symlinked leaf) and one store.
    assert_eq!(engine.stats().files_refused, 6);
    // Nothing hostile was removed or altered; the secret is intact.
    assert!(std::fs::symlink_metadata(path_of(dir.path(), 1)).is_ok_and(|m| m.is_symlink()));
    assert_eq!(
        std::fs::read(&secret).expect("secret"),
        content(999, BLOCK as usize)
    );
    // Ordinary keys still round-trip.
    assert!(store(&engine, &region, 8, &[10, 11]).success);
    assert!(load(&engine, &region, 9, &[10, 11]).success);
}

fn mode_of(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::symlink_metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o7777
}

// Everything kvtier creates in a files directory is owner-only by default, and exactly the
// configured modes when set, whatever the umask takes away.
#[test]
fn files_and_directories_get_exactly_the_configured_modes() {
    for (file_mode, dir_mode) in [(0o600, 0o700), (0o660, 0o770), (0o644, 0o755)] {
        let dir = scratch_dir();
        let mut cfg = files_config(dir.path(), None);
        let files = cfg.files.as_mut().expect("files");
        (files.file_mode, files.dir_mode) = (file_mode, dir_mode);
        let region = region(4);
        let Some(engine) = open(&cfg, &region) else {
            return;
        };
        assert!(store(&engine, &region, 1, &[1, 2]).success);
        let m = mapper(dir.path());
        let block = path_of(dir.path(), 1);
        for p in [
            block.clone(),
            m.config_file_path(),
            m.data_dir().join(".kvtier-usage"),
            m.data_dir().join(".kvtier-lock"),
        ] {
            assert_eq!(mode_of(&p), file_mode, "{}", p.display());
        }
        for p in [
            m.base_path(),
            m.data_dir(),
            block.parent().expect("leaf").to_path_buf(),
            block.ancestors().nth(2).expect("<hhh>").to_path_buf(),
        ] {
            assert_eq!(mode_of(&p), dir_mode, "{}", p.display());
        }
        engine.shutdown();
    }
}

#[test]
fn removed_blocks_lose_their_files_and_stay_gone_after_a_reopen() {
    let dir = scratch_dir();
    let cfg = files_config(dir.path(), Some(64 << 20));
    let region = region(16);
    {
        let Some(engine) = open(&cfg, &region) else {
            return;
        };
        let ids: Vec<u64> = (0..6).collect();
        assert!(store(&engine, &region, 1, &ids).success);
        let (bytes_before, _) = disk_bytes(dir.path());
        engine.take_events();
        assert_eq!(
            engine.remove(&[key(2), key(4), key(50)]),
            vec![true, true, false]
        );
        assert_eq!(
            engine.lookup(&[key(2), key(4), key(5)]),
            vec![Lookup::Miss, Lookup::Miss, Lookup::Hit(Tier::Nvme)]
        );
        // The unlinks run on the workers' rings: wait for them.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while (path_of(dir.path(), 2).exists() || path_of(dir.path(), 4).exists())
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(!path_of(dir.path(), 2).exists() && !path_of(dir.path(), 4).exists());
        assert!(path_of(dir.path(), 5).exists());
        assert_eq!(disk_bytes(dir.path()).0, bytes_before - 2 * BLOCK);
        let removed: Vec<_> = engine
            .take_events()
            .into_iter()
            .filter(|e| e.removed)
            .flat_map(|e| e.keys)
            .collect();
        assert_eq!(removed.len(), 2);
        assert_eq!(engine.stats().removals, 2);
        engine.shutdown();
    }
    let Some(engine) = open(&cfg, &region) else {
        return;
    };
    let found = engine.lookup(&(0..6).map(key).collect::<Vec<_>>());
    assert_eq!(
        found,
        [true, true, false, true, false, true]
            .into_iter()
            .map(|held| if held {
                Lookup::Hit(Tier::Nvme)
            } else {
                Lookup::Miss
            })
            .collect::<Vec<_>>()
    );
}
