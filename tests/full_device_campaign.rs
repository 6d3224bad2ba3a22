//! The full-device campaign, on the real kernel (root: it mounts small file systems).
//!
//! * Files layout on a small ext4 (a 24 MiB image, loop-mounted) that another tenant keeps
//!   filling and emptying, with `capacity_bytes` far above what the file system holds, so the
//!   file system runs out first: stores either succeed or fail with ENOSPC / no space named in
//!   the detail (after evicting and retrying once); nothing acknowledged is lost (a key is gone
//!   only after its removal event); loads of the rest keep working byte-exact; no temp file is
//!   left and the usage counter matches the bytes on disk.
//! * Slab layout on the smallest slab (16 MiB, about 250 slots): stores evict, concurrent loads keep their slots;
//!   the same checks. And a slab file that does not fit on its file system is refused at open
//!   with the device and the cause named, leaving no file behind.
//!
//! CI: `cargo test -p kvtier --features sim --test full_device_campaign` (200 rounds each).
//! The documented run: `KVTIER_FULL_ROUNDS=5000 cargo test -p kvtier --features sim --test
//! full_device_campaign -- --nocapture`.

mod common;

use std::collections::{BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{disk_bytes, env_u64, holds, key, put, region, scratch_dir, wait_results, BLOCK};
use kvtier::config::{Cores, DeviceConfig, FilesConfig, FirstLookup, Layout, SyncMode};
use kvtier::files::mapper::{FileMapper, KvCacheGroup, Namespace};
use kvtier::sim::Rng;
use kvtier::{Config, Engine, Errno, Job, JobResult, KeyFailure, Region};

fn namespace() -> Namespace {
    let mut ns = Namespace::new("test/model", "float16", 16, 1);
    ns.kv_cache_groups = vec![KvCacheGroup {
        tokens_per_block: 16,
        layer_names: vec!["layer.0".into()],
    }];
    ns
}

/// A small ext4 file system on a loop-mounted image, unmounted on drop.
struct SmallFs {
    point: PathBuf,
    _dir: tempfile::TempDir,
}

impl SmallFs {
    fn mount(mib: u64) -> Option<SmallFs> {
        let dir = scratch_dir();
        let image = dir.path().join("fs.img");
        let point = dir.path().join("mnt");
        std::fs::create_dir(&point).expect("mount point");
        std::fs::File::create(&image)
            .and_then(|f| f.set_len(mib << 20))
            .expect("image");
        let ok = |c: &mut std::process::Command| c.output().is_ok_and(|o| o.status.success());
        if !ok(std::process::Command::new("mkfs.ext4")
            .args(["-q", "-F", "-m", "0"])
            .arg(&image))
        {
            kvtier_sys::skip!("mkfs.ext4 failed or is missing");
            return None;
        }
        if !ok(std::process::Command::new("mount")
            .args(["-o", "loop"])
            .arg(&image)
            .arg(&point))
        {
            kvtier_sys::skip!("cannot loop-mount a file system here (needs root and loop devices)");
            return None;
        }
        Some(SmallFs { point, _dir: dir })
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg(&self.point)
            .status();
    }
}

#[derive(Default)]
struct Tally {
    rounds: u64,
    keys_stored: u64,
    keys_refused_enospc: u64,
    keys_refused_no_space: u64,
    removed: u64,
    loads_ok: u64,
    keys_loaded: u64,
}

/// One engine under fire: `live` holds every acknowledged key without a removal event since.
struct Run {
    engine: Engine,
    region: Arc<Region>,
    rng: Rng,
    next_id: u64,
    next_job: u64,
    live: BTreeSet<u64>,
    tally: Tally,
    /// What the failures said, for the report (one of each reason).
    seen: Vec<String>,
}

/// Region blocks: 0-3 the store, 8-11 the load.
impl Run {
    fn new(engine: Engine, region: Arc<Region>) -> Run {
        Run {
            engine,
            region,
            rng: Rng::new(env_u64("KVTIER_FULL_SEED", 7)),
            next_id: 1,
            next_job: 0,
            live: BTreeSet::new(),
            tally: Tally::default(),
            seen: Vec::new(),
        }
    }

    fn job(&mut self) -> u64 {
        self.next_job += 1;
        self.next_job
    }

    fn take_removals(&mut self) {
        for ev in self.engine.take_events() {
            if ev.removed {
                for k in ev.keys {
                    let id = u64::from_be_bytes(k.as_bytes()[..8].try_into().expect("id"));
                    if self.live.remove(&id) {
                        self.tally.removed += 1;
                    }
                }
            }
        }
    }

    /// A store of 1-4 new keys and a load of up to 4 live keys, submitted together.
    fn round(&mut self, device: &str) {
        self.tally.rounds += 1;
        let n = 1 + self.rng.below(4) as u32;
        let ids: Vec<u64> = (0..u64::from(n)).map(|i| self.next_id + i).collect();
        self.next_id += u64::from(n);
        for (b, &id) in ids.iter().enumerate() {
            put(&self.region, b as u32, id);
        }
        let live: Vec<u64> = self.live.iter().copied().collect();
        let mut want: Vec<u64> = Vec::new();
        for _ in 0..4.min(live.len()) {
            let id = live[self.rng.below(live.len() as u64) as usize];
            if !want.contains(&id) {
                want.push(id);
            }
        }
        for b in 0..want.len() {
            self.region
                .fill((8 + b) * BLOCK as usize, BLOCK as usize, 0xee);
        }
        let (js, jl) = (self.job(), self.job());
        self.engine
            .submit_store(Job::new(
                js,
                ids.iter().map(|&i| key(i)).collect(),
                (0..n).collect(),
            ))
            .expect("submit the store");
        if !want.is_empty() {
            self.engine
                .submit_load(Job::new(
                    jl,
                    want.iter().map(|&i| key(i)).collect(),
                    (8..8 + want.len() as u32).collect(),
                ))
                .expect("submit the load");
        }
        let results = wait_results(&self.engine, 1 + usize::from(!want.is_empty()));
        // The store first: a key it stored may be evicted by its own later keys (a removal
        // event already waiting), which the load's check must see.
        for r in results.iter().filter(|r| r.id == js) {
            self.stored(r, &ids, device);
        }
        for r in results.iter().filter(|r| r.id != js) {
            self.loaded(r, &want);
        }
        self.take_removals();
    }

    fn stored(&mut self, r: &JobResult, ids: &[u64], device: &str) {
        let failed: HashSet<usize> = r.failures.iter().map(|f| f.key_index).collect();
        for f in &r.failures {
            match f.reason {
                KeyFailure::Io(Errno::ENOSPC) => self.tally.keys_refused_enospc += 1,
                KeyFailure::NoSpace => self.tally.keys_refused_no_space += 1,
                _ => panic!("a store on a full device failed otherwise: {f:?}"),
            }
            assert!(
                f.detail.contains(device),
                "the detail names the device {device}: {}",
                f.detail
            );
            let label = format!("{:?}", f.reason);
            if !self.seen.iter().any(|s| s.starts_with(&label)) {
                self.seen.push(format!("{label}: {}", f.detail));
            }
        }
        for (i, &id) in ids.iter().enumerate() {
            if !failed.contains(&i) {
                self.live.insert(id);
                self.tally.keys_stored += 1;
            }
        }
    }

    /// Keys live when the load was submitted: each must load exactly, unless a removal event
    /// for it arrives with this round (the store beside it evicted it first).
    fn loaded(&mut self, r: &JobResult, want: &[u64]) {
        self.take_removals();
        let failed: HashSet<usize> = r.failures.iter().map(|f| f.key_index).collect();
        for (i, &id) in want.iter().enumerate() {
            if failed.contains(&i) {
                let f = r
                    .failures
                    .iter()
                    .find(|f| f.key_index == i)
                    .expect("failure");
                assert!(
                    !self.live.contains(&id) && f.reason == KeyFailure::Miss,
                    "acknowledged key {id} lost (no removal event): {f:?}"
                );
            } else {
                assert!(
                    holds(&self.region, 8 + i as u32, id),
                    "key {id} loaded with wrong bytes"
                );
                self.tally.keys_loaded += 1;
            }
        }
        if r.success {
            self.tally.loads_ok += 1;
        }
    }

    /// Every live key, exactly.
    fn check_all(&mut self) {
        self.take_removals();
        let live: Vec<u64> = self.live.iter().copied().collect();
        for chunk in live.chunks(4) {
            let j = self.job();
            self.engine
                .submit_load(Job::new(
                    j,
                    chunk.iter().map(|&i| key(i)).collect(),
                    (8..8 + chunk.len() as u32).collect(),
                ))
                .expect("submit");
            let r = wait_results(&self.engine, 1).pop().expect("result");
            assert!(r.success, "acknowledged keys lost at the end: {r:?}");
            for (i, &id) in chunk.iter().enumerate() {
                assert!(holds(&self.region, 8 + i as u32, id), "key {id} wrong");
            }
        }
    }

    fn report(&self, what: &str) {
        let t = &self.tally;
        println!(
            "{what}: {} rounds, {} keys stored, {} refused with ENOSPC, {} with no space, {} \
             removed (evicted), {} loads ok ({} keys checked exact), acknowledged lost 0, wrong 0, \
             {} live at the end, all exact",
            t.rounds,
            t.keys_stored,
            t.keys_refused_enospc,
            t.keys_refused_no_space,
            t.removed,
            t.loads_ok,
            t.keys_loaded,
            self.live.len()
        );
        for s in &self.seen {
            println!("  {s}");
        }
    }
}

#[allow(clippy::field_reassign_with_default)] // the files config is built field by field
fn files_config(root: &Path) -> Config {
    let mut c = Config::default();
    c.block_size = BLOCK;
    c.cores = Cores::List(vec![0, 1]);
    let mut d = DeviceConfig::new(root);
    d.layout = Layout::Files;
    // Far above what the file system holds: the file system fills first.
    d.capacity_bytes = Some(1 << 30);
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
    c.events.max = 1 << 16;
    c
}

fn open(cfg: &Config, region: &Arc<Region>) -> Option<Engine> {
    common::open_real(cfg, region)
}

#[test]
fn files_layout_on_a_full_file_system_loses_nothing_acknowledged() {
    let Some(fs) = SmallFs::mount(24) else { return };
    let root = fs.point.join("cache");
    let cfg = files_config(&root);
    let region = region(16);
    let Some(engine) = open(&cfg, &region) else {
        return;
    };
    let rounds = env_u64("KVTIER_FULL_ROUNDS", 200);
    let mut run = Run::new(engine, region);
    // Another tenant. In cycles of 40 rounds: for 25 it grows a file by a MiB now and then
    // (stores then evict to make room); for 15 it takes every byte left (in 64 KiB writes,
    // until ENOSPC), so once evicting has given all of kvtier's room away, stores fail; then it
    // lets go of everything.
    let filler = fs.point.join("tenant");
    let grow = |bytes: usize| {
        let chunk = vec![1u8; 64 << 10];
        let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&filler)
        else {
            return;
        };
        let mut left = bytes;
        while left > 0 && std::io::Write::write_all(&mut f, &chunk).is_ok() {
            left = left.saturating_sub(chunk.len());
        }
        let _ = f.sync_all();
    };
    let refused = |t: &Tally| t.keys_refused_enospc + t.keys_refused_no_space;
    let mut cycle_start = 0;
    for r in 0..rounds {
        match r % 40 {
            0 => {
                cycle_start = refused(&run.tally);
                let _ = std::fs::remove_file(&filler);
            }
            1..=24 if run.rng.below(4) == 0 => grow(1 << 20),
            25..=39 => grow(usize::MAX),
            _ => {}
        }
        run.round(&root.display().to_string());
        // The last round of the taking phase: whether a store was refused yet depends on how
        // the evictions raced (each ENOSPC evicts a batch and retries once, which mostly fits).
        // Keep taking until one is: every round gives some of kvtier's room away, so it runs
        // out within a few hundred rounds at most.
        if r % 40 == 39 {
            for _ in 0..1000 {
                if refused(&run.tally) > cycle_start {
                    break;
                }
                grow(usize::MAX);
                run.round(&root.display().to_string());
            }
        }
    }
    run.check_all();
    run.report("files layout, 24 MiB ext4 with a filling tenant");
    let t = &run.tally;
    assert!(
        t.keys_refused_enospc + t.keys_refused_no_space > 0 && t.removed > 0,
        "the file system never filled: the campaign tested nothing ({} refused ENOSPC, {} \
         refused no space, {} removed)",
        t.keys_refused_enospc,
        t.keys_refused_no_space,
        t.removed
    );
    run.engine.drain();
    let data = FileMapper::new(&root, &namespace()).data_dir();
    let (bytes, temps) = disk_bytes(&data);
    assert_eq!(temps, 0, "temp files left behind");
    let usage = std::fs::read(data.join(".kvtier-usage")).expect("usage counter");
    let counted = u64::from_le_bytes(usage[..8].try_into().expect("8 bytes"));
    assert_eq!(counted, bytes, "usage counter drift");
    run.engine.shutdown();
}

#[test]
fn slab_stores_evict_on_a_small_slab_and_lose_nothing_acknowledged() {
    let dir = scratch_dir();
    let path = dir.path().join("slab");
    // The smallest device: 16 MiB, about 250 slots of 64 KiB.
    let mut cfg = common::file_config(&path, 16 << 20, 1);
    cfg.events.max = 1 << 16;
    let region = region(16);
    let Some(engine) = open(&cfg, &region) else {
        return;
    };
    let mut run = Run::new(engine, region);
    for _ in 0..env_u64("KVTIER_FULL_ROUNDS", 200) {
        run.round(&path.display().to_string());
    }
    run.check_all();
    assert!(run.tally.removed > 0, "the slab never filled");
    run.report("slab layout, a 16 MiB slab");
    run.engine.shutdown();
}

#[test]
fn a_slab_that_does_not_fit_its_file_system_is_refused_and_leaves_no_file() {
    let Some(fs) = SmallFs::mount(24) else { return };
    let path = fs.point.join("slab");
    let cfg = common::file_config(&path, 64 << 20, 1);
    let err = Engine::open(&cfg, region(4))
        .err()
        .expect("a 64 MiB slab on a 24 MiB file system");
    let msg = err.to_string();
    assert!(
        msg.contains(&path.display().to_string())
            && msg.contains("fallocate")
            && msg.contains("No space left on device"),
        "{msg}"
    );
    assert!(!path.exists(), "the refused slab file is left behind");
    // Where it fits, it opens.
    let cfg = common::file_config(&path, 16 << 20, 1);
    let region = region(4);
    let engine = open(&cfg, &region).expect("a 16 MiB slab fits");
    engine.shutdown();
}
