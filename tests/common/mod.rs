//! Shared helpers for the integration tests: engines on the simulated device or on real files,
//! deterministic block contents, and waiting for job results with a bound.
#![allow(dead_code, clippy::field_reassign_with_default)]

pub mod logs;
pub mod proxy;
pub mod s3;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier::config::{Cores, DeviceConfig};
use kvtier::sim::{Rng, SimStorage};
use kvtier::{Config, Engine, Job, JobResult, Key, Region};

pub const BLOCK: u64 = 64 << 10;

/// A config for `devices` simulated devices, `workers` workers and 64 KiB blocks.
pub fn sim_config(devices: usize, workers: usize) -> Config {
    let mut c = Config::default();
    c.block_size = BLOCK;
    c.cores = Cores::List((0..workers).collect());
    c.devices = (0..devices)
        .map(|i| DeviceConfig::new(format!("sim{i}")))
        .collect();
    c.events.enabled = true;
    c
}

/// A config for one real file device at `path` with `capacity` bytes.
pub fn file_config(path: &Path, capacity: u64, workers: usize) -> Config {
    let mut c = Config::default();
    c.block_size = BLOCK;
    c.cores = Cores::List((0..workers).collect());
    let mut d = DeviceConfig::new(path);
    d.capacity_bytes = Some(capacity);
    c.devices = vec![d];
    c.events.enabled = true;
    c
}

pub fn region(blocks: u64) -> Arc<Region> {
    kvtier::region::allocate_blocks(BLOCK, blocks, kvtier::config::HugePages::Off).expect("region")
}

pub fn open_sim(config: &Config, region: &Arc<Region>, sim: &Arc<SimStorage>) -> Engine {
    Engine::open_with(
        config,
        Arc::clone(region),
        Arc::clone(sim) as Arc<dyn kvtier::io::Storage>,
    )
    .expect("engine opens on the simulated device")
}

pub fn key(id: u64) -> Key {
    Key::vllm(&id.to_be_bytes().repeat(4), (id % 3) as u32).expect("key")
}

/// The bytes block `id` holds: a splitmix stream seeded by the id.
pub fn content(id: u64, len: usize) -> Vec<u8> {
    let mut rng = Rng::new(id.wrapping_mul(0x51_7CC1_B727_220A) ^ 0xfeed);
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        v.extend_from_slice(&rng.next_u64().to_le_bytes());
    }
    v.truncate(len);
    v
}

pub fn put(region: &Region, block: u32, id: u64) {
    region.write(
        block as usize * BLOCK as usize,
        &content(id, BLOCK as usize),
    );
}

pub fn holds(region: &Region, block: u32, id: u64) -> bool {
    let mut got = vec![0u8; BLOCK as usize];
    region.read(block as usize * BLOCK as usize, &mut got);
    got == content(id, BLOCK as usize)
}

/// Waits until `n` results have arrived (at most 30 s, then panics with what it has).
pub fn wait_results(engine: &Engine, n: usize) -> Vec<JobResult> {
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while out.len() < n {
        assert!(
            Instant::now() < deadline,
            "timed out: {} of {n} results: {out:?}",
            out.len()
        );
        engine.wait_finished(&mut out, Duration::from_millis(50));
    }
    out
}

/// Stores ids `ids` from region blocks `0..` in one job and returns its result.
pub fn store(engine: &Engine, region: &Region, job: u64, ids: &[u64]) -> JobResult {
    store_into(engine, region, job, ids, (0..ids.len() as u32).collect())
}

/// Stores ids `ids` from the given region blocks (written first) in one job and returns its
/// result.
pub fn store_into(
    engine: &Engine,
    region: &Region,
    job: u64,
    ids: &[u64],
    blocks: Vec<u32>,
) -> JobResult {
    for (b, &id) in blocks.iter().zip(ids) {
        put(region, *b, id);
    }
    engine
        .submit_store(Job::new(job, ids.iter().map(|&i| key(i)).collect(), blocks))
        .expect("submit");
    let mut r = wait_results(engine, 1);
    r.pop().expect("one result")
}

/// Loads ids into region blocks `0..` in one job (after scribbling over them) and returns its
/// result.
pub fn load(engine: &Engine, region: &Region, job: u64, ids: &[u64]) -> JobResult {
    let blocks: Vec<u32> = (0..ids.len() as u32).collect();
    for &b in &blocks {
        region.fill(b as usize * BLOCK as usize, BLOCK as usize, 0xee);
    }
    load_into(engine, job, ids, blocks)
}

/// Loads ids into the given region blocks in one job (without touching them first: they may
/// be leased) and returns its result.
pub fn load_into(engine: &Engine, job: u64, ids: &[u64], blocks: Vec<u32>) -> JobResult {
    engine
        .submit_load(Job::new(job, ids.iter().map(|&i| key(i)).collect(), blocks))
        .expect("submit");
    let mut r = wait_results(engine, 1);
    r.pop().expect("one result")
}

/// Bytes of the block (`.bin`) and temp (`.tmp`) files under a files-layout data directory,
/// and the number of temp files.
/// `engine.lookup(keys)` once no answer is `Pending` any more (the files layout asks its
/// worker about keys it has not indexed; the S3 tier sends HEADs); panics after 10 s.
pub fn settled(engine: &Engine, keys: &[Key]) -> Vec<kvtier::Lookup> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let answers = engine.lookup(keys);
        if !answers.contains(&kvtier::Lookup::Pending) {
            return answers;
        }
        assert!(
            Instant::now() < deadline,
            "lookups still pending after 10 s"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

pub fn disk_bytes(data_dir: &Path) -> (u64, usize) {
    let (mut bytes, mut temps) = (0, 0);
    let mut stack = vec![data_dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "bin" || x == "tmp") {
                bytes += e.metadata().map_or(0, |m| m.len());
                temps += usize::from(p.extension().is_some_and(|x| x == "tmp"));
            }
        }
    }
    (bytes, temps)
}

/// A scratch directory on a disk filesystem (not tmpfs), for real-kernel tests.
pub fn scratch_dir() -> tempfile::TempDir {
    let base = std::env::var("KVTIER_TEST_DIR").unwrap_or_else(|_| "/var/tmp".into());
    tempfile::Builder::new()
        .prefix("kvtier-test")
        .tempdir_in(base)
        .expect("scratch dir")
}

/// Opens an engine on real devices, or `None` (with a message) where io_uring is unavailable.
pub fn open_real(config: &Config, region: &Arc<Region>) -> Option<Engine> {
    match Engine::open(config, Arc::clone(region)) {
        Ok(e) => Some(e),
        Err(kvtier::Error::Ring(m)) => {
            kvtier_sys::skip!("io_uring unavailable: {m}");
            None
        }
        Err(e) => panic!("open: {e}"),
    }
}

/// An integer from the environment variable `name`, or `default`.
pub fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// A loop device, detached on drop (or, while busy, when its last user closes it).
pub struct LoopDevice(pub String);

impl LoopDevice {
    /// `losetup --find --show [--direct-io=on] file`, or why not (not root, no loop devices).
    pub fn attach(file: &Path, direct: bool) -> Result<LoopDevice, String> {
        let mut cmd = std::process::Command::new("losetup");
        cmd.args(["--find", "--show"]);
        if direct {
            cmd.arg("--direct-io=on");
        }
        match cmd.arg(file).output() {
            Ok(o) if o.status.success() => Ok(LoopDevice(
                String::from_utf8_lossy(&o.stdout).trim().to_string(),
            )),
            Ok(o) => Err(format!(
                "losetup failed: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            )),
            Err(e) => Err(format!("losetup unavailable: {e}")),
        }
    }

    pub fn path(&self) -> &Path {
        Path::new(&self.0)
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = std::process::Command::new("losetup")
            .args(["-d", &self.0])
            .status();
    }
}

/// Shuts `engine` down from another thread; true if that returned within `within`.
pub fn shutdown_returns(engine: Engine, within: Duration) -> bool {
    let (tx, rx) = std::sync::mpsc::channel();
    let engine = Arc::new(engine);
    let e = Arc::clone(&engine);
    std::thread::spawn(move || {
        e.shutdown();
        let _ = tx.send(());
    });
    rx.recv_timeout(within).is_ok()
}
