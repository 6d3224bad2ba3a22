//! Criterion micro-benchmarks of kvtier's hot paths, through the public API only.
//!
//! Pure functions: key construction (xxh3 of the key bytes) and routing (`Key::worker`,
//! `Key::device`), slot-table entry encode/decode, slab geometry, and crc32c (kvtier's and the
//! `crc32c` crate's) of a 256 KiB and a 2 MiB block (what a worker computes for every stored
//! block, and for the first load of a recovered one), both over a block in cache and over blocks
//! from a pool past the cache, beside a plain read of those bytes. Index, slot allocation,
//! eviction and the caller/worker handoff are reachable only through the engine, so those run on
//! one worker over the simulated device (`kvtier::sim::SimStorage`, which copies bytes in
//! memory): an empty job (admission and the result channel, no worker), a load that misses
//! (caller -> worker -> caller, no I/O), a lookup of 1000 stored keys and of one (alone, and beside a
//! second caller), a store + load of one
//! 64 KiB block, and stores into a full device (each one evicts); and, on one files-layout
//! worker over the simulated files (`kvtier::sim::SimFiles`), lookups of 1000 keys it has not
//! indexed and found absent (alone, and beside a second caller).
//!
//! `cargo bench --bench core` measures (about 2 s per benchmark); `cargo test --all-targets`
//! runs each benchmark once, in criterion's test mode, so they keep building and working.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, Throughput};
use kvtier::config::{Cores, DeviceConfig, FilesConfig, HugePages, Layout};
use kvtier::files::mapper::{KvCacheGroup, Namespace};
use kvtier::sim::files::SimFiles;
use kvtier::sim::SimStorage;
use kvtier::slab::{Entry, Geometry, ENTRY_BYTES};
use kvtier::{Config, Engine, Job, JobResult, Key, Lookup, Region};

/// Block size of the engine benchmarks.
const BLOCK: u64 = 64 << 10;
/// Region blocks of the engine benchmarks: a few jobs in flight at most.
const REGION_BLOCKS: u64 = 16;
/// Keys stored for the lookup benchmark.
const LOOKUP_KEYS: u64 = 1000;
/// How long one benchmark waits for one job before it declares the engine stuck.
const JOB_TIMEOUT: Duration = Duration::from_secs(10);
/// One-block jobs submitted back to back by the admission benchmarks, each on a block of its
/// own (a load leases its block exclusively): the whole region.
const ADMIT_BATCH: u64 = REGION_BLOCKS;

/// The 36-byte vLLM-shaped key of number `n`.
fn key(n: u64) -> Key {
    let mut hash = [0u8; 32];
    for (i, chunk) in hash.chunks_exact_mut(8).enumerate() {
        chunk.copy_from_slice(&(n ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)).to_le_bytes());
    }
    Key::vllm(&hash, 0).expect("a 32-byte hash makes a valid key")
}

fn keys_and_routing(c: &mut Criterion) {
    let mut g = c.benchmark_group("key");
    let hash = [7u8; 32];
    g.bench_function("vllm_new_36B", |b| {
        b.iter(|| Key::vllm(black_box(&hash), black_box(3)).expect("valid key"));
    });
    let k = key(42);
    g.bench_function("route_shard_and_device", |b| {
        b.iter(|| {
            let k = black_box(&k);
            (k.worker(black_box(2)), k.device(black_box(3)))
        });
    });
    g.finish();
}

fn slot_table(c: &mut Criterion) {
    let mut g = c.benchmark_group("slab");
    let entry = Entry {
        seq: 123_456,
        data_len: 2 << 20,
        data_crc: 0xdead_beef,
        key: key(9),
    };
    let mut raw = [0u8; ENTRY_BYTES];
    g.bench_function("entry_encode", |b| {
        b.iter(|| black_box(&entry).encode(black_box(&mut raw)));
    });
    entry.encode(&mut raw);
    g.bench_function("entry_decode", |b| {
        b.iter(|| Entry::decode(black_box(&raw)));
    });
    g.bench_function("geometry_1TiB_2MiB", |b| {
        b.iter(|| Geometry::compute(black_box(1 << 40), black_box(2 << 20), black_box(4096)));
    });
    g.finish();
}

fn checksums(c: &mut Criterion) {
    let mut g = c.benchmark_group("crc32c");
    for (name, len) in [("256KiB", 256usize << 10), ("2MiB", 2 << 20)] {
        let block: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
        g.throughput(Throughput::Bytes(len as u64));
        // kvtier's block checksum, and the `crc32c` crate it replaced (same values).
        g.bench_function(format!("{name}/kvtier"), |b| {
            b.iter(|| kvtier::checksum::crc32c(black_box(&block)));
        });
        g.bench_function(format!("{name}/crc32c-crate"), |b| {
            b.iter(|| crc32c::crc32c(black_box(&block)));
        });
    }
    g.finish();
}

/// Bytes of the pool the cold benchmarks walk: well past any last-level cache, so every block
/// comes from memory, as a block the device just wrote or read does.
const COLD_POOL_BYTES: usize = 256 << 20;

/// The checksum over blocks not in cache, beside a plain read of the same bytes (one load per
/// 64-byte line, the least a pass over memory costs). Each iteration takes the next block of the
/// pool, so the walk wraps only after the whole pool.
fn checksums_cold(c: &mut Criterion) {
    let pool: Vec<u8> = (0..COLD_POOL_BYTES).map(|i| (i * 31 % 251) as u8).collect();
    let mut g = c.benchmark_group("crc32c_cold");
    for (name, len) in [("256KiB", 256usize << 10), ("2MiB", 2 << 20)] {
        g.throughput(Throughput::Bytes(len as u64));
        let mut next = 0;
        g.bench_function(format!("{name}/kvtier"), |b| {
            b.iter(|| kvtier::checksum::crc32c(black_box(cold_block(&pool, &mut next, len))));
        });
        g.bench_function(format!("{name}/read_lines"), |b| {
            b.iter(|| {
                let bytes = cold_block(&pool, &mut next, len);
                (0..bytes.len()).step_by(64).fold(0u8, |x, i| x ^ bytes[i])
            });
        });
    }
    g.finish();
}

/// The block of `len` bytes after the one `next` names, wrapping at the pool's end.
fn cold_block<'a>(pool: &'a [u8], next: &mut usize, len: usize) -> &'a [u8] {
    *next = (*next + 1) % (pool.len() / len);
    &pool[*next * len..][..len]
}

/// One engine with one worker on a simulated device of `device_bytes`.
struct SimEngine {
    engine: Engine,
    region: Arc<Region>,
    results: Vec<JobResult>,
    next_id: u64,
}

impl SimEngine {
    fn new(device_bytes: u64) -> SimEngine {
        let core = kvtier_sys::affinity::available_cores()
            .first()
            .copied()
            .unwrap_or(0);
        let config = Config {
            block_size: BLOCK,
            cores: Cores::List(vec![core]),
            region_blocks: REGION_BLOCKS,
            devices: vec![DeviceConfig::new("sim0")],
            ..Config::default()
        };
        let region = kvtier::region::allocate_blocks(BLOCK, REGION_BLOCKS, HugePages::Off)
            .expect("a small region");
        region.fill(0, region.len(), 0x5a);
        let sim = SimStorage::new(1, &[device_bytes]);
        let engine = Engine::open_with(&config, Arc::clone(&region), sim)
            .expect("the engine opens on the simulated device");
        SimEngine {
            engine,
            region,
            results: Vec::with_capacity(4),
            next_id: 0,
        }
    }

    /// Waits for `count` results of jobs already submitted, and drops them.
    fn collect(&mut self, count: usize) {
        let deadline = Instant::now() + JOB_TIMEOUT;
        let mut got = 0;
        while got < count {
            self.results.clear();
            self.engine
                .wait_finished(&mut self.results, Duration::from_millis(100));
            got += self.results.len();
            assert!(Instant::now() < deadline, "jobs did not finish in 10 s");
        }
        self.results.clear();
    }

    /// Submits one job and waits for its result.
    fn run(&mut self, store: bool, keys: Vec<Key>, blocks: Vec<u32>) -> JobResult {
        self.next_id += 1;
        let job = Job::new(self.next_id, keys, blocks);
        let submitted = if store {
            self.engine.submit_store(job)
        } else {
            self.engine.submit_load(job)
        };
        submitted.expect("one job at a time never meets backpressure");
        let deadline = Instant::now() + JOB_TIMEOUT;
        loop {
            if let Some(r) = self.results.pop() {
                return r;
            }
            self.engine
                .wait_finished(&mut self.results, Duration::from_millis(100));
            assert!(Instant::now() < deadline, "a job did not finish in 10 s");
        }
    }

    fn store(&mut self, k: Key) -> JobResult {
        self.run(true, vec![k], vec![0])
    }

    fn load(&mut self, k: Key) -> JobResult {
        self.run(false, vec![k], vec![1])
    }
}

/// The time `iters` calls of `mine` take while another thread calls `other` without pause.
fn beside_another_caller<T, U>(
    iters: u64,
    mine: impl Fn() -> T,
    other: impl Fn() -> U + Sync,
) -> Duration {
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                black_box(other());
            }
        });
        let started = Instant::now();
        for _ in 0..iters {
            black_box(mine());
        }
        let took = started.elapsed();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        took
    })
}

/// Lookups of stored keys: 1000 a call, one a call, and one a call beside a second caller.
fn lookups(g: &mut BenchmarkGroup<'_, WallTime>) {
    let mut e = SimEngine::new((LOOKUP_KEYS + 64) * BLOCK + (8 << 20));
    for n in 0..LOOKUP_KEYS {
        assert!(e.store(key(n)).success, "filling the index");
    }
    let keys: Vec<Key> = (0..LOOKUP_KEYS).map(key).collect();
    g.throughput(Throughput::Elements(LOOKUP_KEYS));
    g.bench_function("lookup_1000_hits", |b| {
        b.iter(|| e.engine.lookup(black_box(&keys)));
    });
    // One key a call: what a call costs besides the probe (picking up each worker's table).
    g.throughput(Throughput::Elements(1));
    g.bench_function("lookup_1_hit", |b| {
        b.iter(|| e.engine.lookup(black_box(&keys[..1])));
    });
    // The same while another thread looks up without pause (two callers: what they share).
    g.bench_function("lookup_1_hit_beside_another_caller", |b| {
        b.iter_custom(|iters| {
            beside_another_caller(
                iters,
                || e.engine.lookup(black_box(&keys[..1])),
                || e.engine.lookup(black_box(&keys[1..2])),
            )
        });
    });
    drop(e);
}

/// Lookups of keys the files layout has not indexed and found absent (answers its worker
/// recorded for `files.lookup_ttl_ms`, read by the caller without a lock), alone and beside a
/// second caller asking about other absent keys.
fn lookups_unindexed(g: &mut BenchmarkGroup<'_, WallTime>) {
    let core = kvtier_sys::affinity::available_cores()
        .first()
        .copied()
        .unwrap_or(0);
    let dir = tempfile::tempdir().expect("a scratch directory");
    let mut device = DeviceConfig::new(dir.path());
    device.layout = Layout::Files;
    let mut namespace = Namespace::new("bench/model", "float16", 16, 1);
    namespace.kv_cache_groups = vec![KvCacheGroup {
        tokens_per_block: 16,
        layer_names: vec!["layer.0".into()],
    }];
    let mut files = FilesConfig::new(namespace);
    files.lookup_ttl_ms = 3_600_000;
    let config = Config {
        block_size: BLOCK,
        cores: Cores::List(vec![core]),
        region_blocks: REGION_BLOCKS,
        devices: vec![device],
        files: Some(files),
        ..Config::default()
    };
    let region = kvtier::region::allocate_blocks(BLOCK, REGION_BLOCKS, HugePages::Off)
        .expect("a small region");
    let engine = Engine::open_with(&config, region, SimFiles::new(1))
        .expect("the engine opens on the simulated files");
    let absent: Vec<Key> = (0..2 * LOOKUP_KEYS).map(|n| key(1 << 40 | n)).collect();
    // The first lookup sends every key to the worker, whose statx finds none.
    assert!(engine.lookup(&absent).iter().all(|l| *l == Lookup::Miss));
    let deadline = Instant::now() + JOB_TIMEOUT;
    while engine.stats().devices[0].probes_absent < 2 * LOOKUP_KEYS {
        assert!(
            Instant::now() < deadline,
            "the probes did not finish in 10 s"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let (mine, other) = absent.split_at(LOOKUP_KEYS as usize);
    g.throughput(Throughput::Elements(LOOKUP_KEYS));
    g.bench_function("lookup_1000_unindexed_absent", |b| {
        b.iter(|| engine.lookup(black_box(mine)));
    });
    g.bench_function("lookup_1000_unindexed_absent_beside_another_caller", |b| {
        b.iter_custom(|iters| {
            beside_another_caller(
                iters,
                || engine.lookup(black_box(mine)),
                || engine.lookup(black_box(other)),
            )
        });
    });
    drop(engine);
}

fn engine_on_sim(c: &mut Criterion) {
    let mut g = c.benchmark_group("engine_sim");

    let mut e = SimEngine::new(64 << 20);
    g.bench_function("handoff_empty_job", |b| {
        b.iter(|| e.run(false, Vec::new(), Vec::new()));
    });
    // The caller's side of a one-block job alone: `submit_load` / `submit_store` timed, the
    // results collected outside the timing (issue 12: admission <= 2 us of caller CPU a job).
    let mut next_key = 1u64 << 40;
    for store in [false, true] {
        let name = if store {
            "admit_one_block_store"
        } else {
            "admit_one_block_load"
        };
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                let mut left = iters;
                while left > 0 {
                    let batch = left.min(ADMIT_BATCH);
                    let started = Instant::now();
                    for block in 0..batch as u32 {
                        next_key += 1;
                        e.next_id += 1;
                        let job = Job::new(e.next_id, vec![key(next_key)], vec![block]);
                        let submitted = if store {
                            e.engine.submit_store(job)
                        } else {
                            e.engine.submit_load(job)
                        };
                        submitted.expect("a batch fits the queue");
                    }
                    timed += started.elapsed();
                    e.collect(batch as usize);
                    left -= batch;
                }
                timed
            });
        });
    }
    let absent = key(u64::MAX);
    g.bench_function("handoff_load_miss", |b| {
        b.iter(|| {
            let r = e.load(absent);
            assert!(!r.success, "the key was never stored");
        });
    });
    drop(e);

    lookups(&mut g);
    lookups_unindexed(&mut g);

    // Enough slots that most iterations store into a free slot; the device wraps into
    // evictions only after tens of thousands of iterations.
    let mut e = SimEngine::new(256 << 20);
    let mut n = 0u64;
    g.throughput(Throughput::Bytes(2 * BLOCK));
    g.bench_function("store_then_load_64KiB", |b| {
        b.iter(|| {
            n += 1;
            assert!(e.store(key(n)).success, "store");
            assert!(e.load(key(n)).success, "load");
        });
    });
    drop(e);

    // A device of a few dozen slots, full before measuring: every store evicts one block.
    let mut e = SimEngine::new(4 << 20);
    let mut n = 0u64;
    let slots = e.engine.info().devices[0].geometry.slot_count;
    while n < 2 * slots {
        n += 1;
        assert!(e.store(key(n)).success, "filling the device");
    }
    let evictions_before = e.engine.stats().evictions;
    g.throughput(Throughput::Bytes(BLOCK));
    g.bench_function("store_evicting_64KiB", |b| {
        b.iter(|| {
            n += 1;
            assert!(e.store(key(n)).success, "store");
        });
    });
    assert!(
        e.engine.stats().evictions > evictions_before,
        "stores into the full device evicted"
    );
    assert_eq!(e.region.len() as u64, REGION_BLOCKS * BLOCK);
    drop(e);
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500))
        .sample_size(30);
    targets = keys_and_routing, slot_table, checksums, checksums_cold, engine_on_sim
}
criterion_main!(benches);
