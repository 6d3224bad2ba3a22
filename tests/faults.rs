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
