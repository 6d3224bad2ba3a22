//! A seeded soak on the simulated device with every fault at once: EIO, ENOSPC, short I/O,
//! torn writes, delayed and reordered completions; two workers, two devices, eviction. Then a
//! restart without faults. Invariants checked: each job is reported exactly once; a successful
//! load (or the succeeded prefix of a failed one) holds exactly the stored bytes; after the
//! restart a hit either loads the right bytes or fails its checksum. Replay with
//! KVTIER_SIM_SEED printed at the start.

mod common;

use std::collections::HashMap;

use common::*;
use kvtier::sim::{Faults, Rng, SimStorage};
use kvtier::{Job, JobKind, KeyFailure, Lookup, Tier};

const IDS: u64 = 120;
const JOBS: u64 = 400;
const REGION_BLOCKS: u32 = 48;

#[test]
#[allow(clippy::too_many_lines)] // one soak: setup, the job loop and its checks read best in one place
fn soak_with_faults_never_serves_wrong_bytes() {
    let seed = kvtier::sim::seed_from_env();
    let mut rng = Rng::new(seed);
    // Small devices: ~90 slots in all, fewer than IDS, so eviction runs too.
    let sim = SimStorage::new(seed, &[(1 << 20) + 50 * BLOCK, (1 << 20) + 40 * BLOCK]);
    let mut cfg = sim_config(2, 2);
    cfg.scheduler.store_chunk_bytes = 16 << 10;
    let region = region(u64::from(REGION_BLOCKS));
    let engine = open_sim(&cfg, &region, &sim);
    sim.set_faults(Faults {
        eio_ppm: 20_000,
        enospc_ppm: 10_000,
        short_ppm: 20_000,
        torn_write_ppm: 10_000,
        read_flip_ppm: 0,
        max_delay_rounds: 4,
        reorder: true,
        data_only: false,
    });
    let mut free: Vec<u32> = (0..REGION_BLOCKS).collect();
    let mut pending: HashMap<u64, (JobKind, Vec<u64>, Vec<u32>)> = HashMap::new();
    let mut next = 0u64;
    let mut results = Vec::new();
    let (mut loads_ok, mut partial_checked) = (0, 0);
    while next < JOBS || !pending.is_empty() {
        while next < JOBS && free.len() >= 4 {
            let n = 1 + rng.below(4) as usize;
            let ids: Vec<u64> = (0..n).map(|_| rng.below(IDS)).collect();
            let blocks: Vec<u32> = (0..n).map(|_| free.pop().expect("free block")).collect();
            let kind = if rng.below(2) == 0 {
                JobKind::Store
            } else {
                JobKind::Load
            };
            let job = Job::new(next, ids.iter().map(|&i| key(i)).collect(), blocks.clone());
            match kind {
                JobKind::Store => {
                    for (&b, &id) in blocks.iter().zip(&ids) {
                        put(&region, b, id);
                    }
                    engine.submit_store(job).expect("submit");
                }
                JobKind::Load => engine.submit_load(job).expect("submit"),
            }
            pending.insert(next, (kind, ids, blocks));
            next += 1;
        }
        results.clear();
        engine.wait_finished(&mut results, std::time::Duration::from_millis(100));
        for r in &results {
            let (kind, ids, blocks) = pending
                .remove(&r.id)
                .unwrap_or_else(|| panic!("seed {seed}: job {} reported twice or unknown", r.id));
            assert_eq!(kind, r.kind);
            if kind == JobKind::Load {
                for i in 0..r.succeeded_prefix {
                    assert!(
                        holds(&region, blocks[i], ids[i]),
                        "seed {seed}: job {} key {i} wrong bytes",
                        r.id
                    );
                }
                if r.success {
                    loads_ok += 1;
                } else if r.succeeded_prefix > 0 {
                    partial_checked += 1;
                }
                if let Some(f) = r.failure() {
                    assert_ne!(
                        f.reason,
                        KeyFailure::Checksum,
                        "seed {seed}: blocks written in this run are trusted"
                    );
                }
            }
            free.extend(blocks);
        }
    }
    let s = engine.stats();
    assert!(s.io_errors > 0, "seed {seed}: faults were injected");
    assert!(loads_ok > 0, "seed {seed}: some loads succeeded");
    println!(
        "loads ok {loads_ok}, partial prefixes checked {partial_checked}, evictions {}",
        s.evictions
    );
    engine.shutdown();
    drop(engine);

    sim.restart();
    let engine = open_sim(&cfg, &region, &sim);
    let mut served = 0;
    for id in 0..IDS {
        if engine.lookup(&[key(id)]) != vec![Lookup::Hit(Tier::Nvme)] {
            continue;
        }
        let r = load(&engine, &region, 10_000 + id, &[id]);
        if r.success {
            assert!(
                holds(&region, 0, id),
                "seed {seed}: wrong bytes for id {id} after restart"
            );
            served += 1;
        } else {
            assert_eq!(
                r.failure().expect("failure").reason,
                KeyFailure::Checksum,
                "seed {seed}: id {id}"
            );
        }
    }
    assert!(served > 0, "seed {seed}: something survived the restart");
}

/// Failure isolation: with two devices, one answering every request with EIO leaves the other
/// fully working (loads and stores, byte-exact), its keys fail with the device's errno, the
/// per-device error counters say which device, and once it works again it serves and stores.
#[test]
fn a_failing_device_leaves_the_other_fully_working() {
    let sim = SimStorage::new(11, &[16 << 20, 16 << 20]);
    let cfg = sim_config(2, 2);
    let region = region(64);
    let engine = open_sim(&cfg, &region, &sim);
    let ids: Vec<u64> = (0..32).collect();
    assert!(store(&engine, &region, 1, &ids).success);
    let on = |d: usize| -> Vec<u64> {
        ids.iter()
            .copied()
            .filter(|&i| key(i).device(2) == d)
            .collect()
    };
    let (dev0, dev1) = (on(0), on(1));
    assert!(!dev0.is_empty() && !dev1.is_empty());

    sim.fail_device(0, true);
    // Loads: every key of device 1 arrives byte-exact; every key of device 0 fails with EIO.
    let r = load(&engine, &region, 2, &ids);
    let failed: Vec<u64> = r.failures.iter().map(|f| ids[f.key_index]).collect();
    assert_eq!(failed, dev0, "exactly device 0's keys fail");
    for f in &r.failures {
        assert_eq!(f.reason, KeyFailure::Io(kvtier::Errno::EIO), "{f:?}");
    }
    for (b, &id) in ids.iter().enumerate() {
        if key(id).device(2) == 1 {
            assert!(
                holds(&region, b as u32, id),
                "device 1 key {id} loads byte-exact"
            );
        }
    }
    // Stores: new keys of device 1 are stored and load back; device 0's fail.
    let fresh: Vec<u64> = (100..140).collect();
    let r = store(&engine, &region, 3, &fresh);
    let failed: Vec<u64> = r.failures.iter().map(|f| fresh[f.key_index]).collect();
    let fresh0: Vec<u64> = fresh
        .iter()
        .copied()
        .filter(|&i| key(i).device(2) == 0)
        .collect();
    let fresh1: Vec<u64> = fresh
        .iter()
        .copied()
        .filter(|&i| key(i).device(2) == 1)
        .collect();
    assert_eq!(failed, fresh0, "exactly device 0's stores fail");
    assert!(load(&engine, &region, 4, &fresh1).success);
    for (b, &id) in fresh1.iter().enumerate() {
        assert!(holds(&region, b as u32, id));
    }
    assert_eq!(
        engine.lookup(&fresh0.iter().map(|&i| key(i)).collect::<Vec<_>>()),
        vec![Lookup::Miss; fresh0.len()],
        "a failed store is not a hit"
    );
    // The counters name the device.
    let s = engine.stats();
    assert!(
        s.devices[0].errors[0] >= (dev0.len() + fresh0.len()) as u64,
        "{:?}",
        s.devices[0]
    );
    assert_eq!(s.devices[1].io_errors(), 0);
    let text = engine.metrics_text();
    assert!(text.contains(r#"kvtier_device_errors_total{device="sim1",class="io"} 0"#));
    assert!(!text.contains(r#"kvtier_device_errors_total{device="sim0",class="io"} 0"#));

    // Working again: device 0 stores and serves.
    sim.fail_device(0, false);
    assert!(store(&engine, &region, 5, &fresh0).success);
    assert!(load(&engine, &region, 6, &fresh0).success);
    for (b, &id) in fresh0.iter().enumerate() {
        assert!(holds(&region, b as u32, id));
    }
    // A key whose load failed is served again, or is a miss: never other bytes.
    let r = load(&engine, &region, 7, &dev0);
    for (b, &id) in dev0.iter().enumerate() {
        if !r.failures.iter().any(|f| f.key_index == b) {
            assert!(holds(&region, b as u32, id));
        }
    }
}
