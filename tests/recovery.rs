//! Restart recovery: close the engine, reopen it on the same devices, and every stored key is
//! still a hit with equal bytes — on the simulated device and on a real file. Also: a table
//! written by 2 workers is read back by 1. What would break: table writes lost at shutdown,
//! index rebuilt from the wrong offsets, routing changes dropping reachable keys.

mod common;

use common::*;
use kvtier::sim::SimStorage;
use kvtier::{Engine, Lookup, Tier};

#[test]
fn keys_survive_a_restart_on_sim() {
    let sim = SimStorage::new(kvtier::sim::seed_from_env(), &[64 << 20, 32 << 20]);
    let cfg = sim_config(2, 2);
    let region = region(16);
    let ids: Vec<u64> = (0..16).collect();
    {
        let engine = open_sim(&cfg, &region, &sim);
        assert!(store(&engine, &region, 1, &ids).success);
        engine.shutdown();
    }
    let engine = open_sim(&cfg, &region, &sim);
    let info = engine.info();
    assert!(
        info.devices.iter().all(|d| !d.formatted),
        "reopened, not reformatted"
    );
    assert_eq!(
        info.workers.iter().map(|w| w.recovered_blocks).sum::<u64>(),
        16
    );
    let keys: Vec<_> = ids.iter().map(|&i| key(i)).collect();
    assert!(engine
        .lookup(&keys)
        .iter()
        .all(|l| *l == Lookup::Hit(Tier::Nvme)));
    let r = load(&engine, &region, 2, &ids);
    assert!(r.success, "{r:?}");
    for (b, &id) in ids.iter().enumerate() {
        assert!(holds(&region, b as u32, id));
    }
    assert_eq!(engine.stats().checksum_failures, 0);
}

#[test]
fn changing_the_worker_count_keeps_the_store_usable() {
    let sim = SimStorage::new(kvtier::sim::seed_from_env(), &[64 << 20]);
    let region = region(16);
    let ids: Vec<u64> = (0..16).collect();
    {
        let engine = open_sim(&sim_config(1, 2), &region, &sim);
        assert!(store(&engine, &region, 1, &ids).success);
    }
    // One worker now owns every slot: all keys route to it and are recovered.
    let engine = open_sim(&sim_config(1, 1), &region, &sim);
    let r = load(&engine, &region, 2, &ids);
    assert!(r.success, "{r:?}");
    for (b, &id) in ids.iter().enumerate() {
        assert!(holds(&region, b as u32, id));
    }
    // New stores work on the recovered layout.
    assert!(store(&engine, &region, 3, &[100, 101]).success);
}

#[test]
fn keys_survive_a_restart_on_a_real_file() {
    let dir = scratch_dir();
    let path = dir.path().join("dev.slab");
    let cfg = file_config(&path, 64 << 20, 2);
    let region = region(16);
    let ids: Vec<u64> = (0..16).collect();
    {
        let engine = match Engine::open(&cfg, std::sync::Arc::clone(&region)) {
            Ok(e) => e,
            Err(kvtier::Error::Ring(m)) => return kvtier_sys::skip!("io_uring unavailable: {m}"),
            Err(e) => panic!("{e}"),
        };
        assert!(store(&engine, &region, 1, &ids).success);
    }
    let engine = Engine::open(&cfg, std::sync::Arc::clone(&region)).expect("reopen");
    assert!(!engine.info().devices[0].formatted);
    let r = load(&engine, &region, 2, &ids);
    assert!(r.success, "{r:?}");
    for (b, &id) in ids.iter().enumerate() {
        assert!(holds(&region, b as u32, id));
    }
}

#[test]
fn block_size_mismatch_is_refused_unless_overwrite() {
    let sim = SimStorage::new(1, &[64 << 20]);
    let region = region(4);
    drop(open_sim(&sim_config(1, 1), &region, &sim));
    let mut cfg = sim_config(1, 1);
    cfg.block_size = 128 << 10;
    let region2 = kvtier::region::allocate_blocks(128 << 10, 2, kvtier::config::HugePages::Off)
        .expect("region");
    let err = Engine::open_with(&cfg, std::sync::Arc::clone(&region2), sim.clone())
        .err()
        .expect("refused");
    let msg = err.to_string();
    assert!(
        msg.contains("block_size 65536") && msg.contains("overwrite = true"),
        "{msg}"
    );
    cfg.devices[0].overwrite = true;
    let engine = Engine::open_with(&cfg, region2, sim.clone()).expect("reformatted");
    assert!(engine.info().devices[0].formatted);
}

#[test]
fn table_writes_are_batched_and_still_recover_everything() {
    // A stream of stores writes each 4 KiB table page a few times, not once per block, and a
    // clean shutdown still records every block.
    let sim = SimStorage::new(kvtier::sim::seed_from_env(), &[64 << 20]);
    let cfg = sim_config(1, 1);
    let region = region(64);
    {
        let engine = open_sim(&cfg, &region, &sim);
        for j in 0..8u64 {
            let ids: Vec<u64> = (j * 8..j * 8 + 8).collect();
            let blocks: Vec<u32> = (j as u32 * 8..j as u32 * 8 + 8).collect();
            for (&b, &id) in blocks.iter().zip(&ids) {
                put(&region, b, id);
            }
            engine
                .submit_store(kvtier::Job::new(
                    j,
                    ids.iter().map(|&i| key(i)).collect(),
                    blocks,
                ))
                .expect("submit");
        }
        let results = wait_results(&engine, 8);
        assert!(results.iter().all(|r| r.success));
        engine.shutdown();
        let writes = engine.stats().table_writes;
        assert!(
            writes <= 16,
            "{writes} table writes for 64 blocks in 2 pages"
        );
    }
    let engine = open_sim(&cfg, &region, &sim);
    assert_eq!(engine.stats().recovered_blocks, 64);
}
