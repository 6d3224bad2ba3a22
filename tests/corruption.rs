//! Corrupt data is never served. A slot whose bytes changed on the device after a restart fails
//! its load with a checksum error, is dropped from the index, counted and reported as removed;
//! a write torn by a simulated crash is never served after the restart either. What would
//! break: trusting recovered entries without checking their data, or keeping a bad block.

mod common;

use common::*;
use kvtier::sim::{Faults, SimStorage};
use kvtier::{Engine, KeyFailure, Lookup, Tier};

/// A device with exactly 4 slots of 64 KiB (1 MiB of header and table, then the slots).
const FOUR_SLOTS: u64 = (1 << 20) + 4 * BLOCK;

#[test]
fn corrupted_slot_is_detected_and_not_served() {
    let sim = SimStorage::new(kvtier::sim::seed_from_env(), &[FOUR_SLOTS]);
    let cfg = sim_config(1, 1);
    let region = region(4);
    let geometry = {
        let engine = open_sim(&cfg, &region, &sim);
        assert_eq!(engine.info().devices[0].geometry.slot_count, 4);
        assert!(store(&engine, &region, 1, &[1]).success);
        engine.info().devices[0].geometry
    };
    // The only stored block is in slot 0 (free slots are handed out lowest first).
    sim.corrupt(0, geometry.slot_offset(0) + 100, 8);
    let engine = open_sim(&cfg, &region, &sim);
    assert_eq!(
        engine.lookup(&[key(1)]),
        vec![Lookup::Hit(Tier::Nvme)],
        "recovered"
    );
    let r = load(&engine, &region, 2, &[1]);
    assert!(!r.success);
    assert_eq!(r.failure().map(|f| f.reason), Some(KeyFailure::Checksum));
    assert_eq!(
        engine.lookup(&[key(1)]),
        vec![Lookup::Miss],
        "dropped after the failure"
    );
    let s = engine.stats();
    assert_eq!(s.checksum_failures, 1);
    assert_eq!(s.blocks_stored, 0);
    let events = engine.take_events();
    assert!(
        events.iter().any(|e| e.removed && e.keys == vec![key(1)]),
        "{events:?}"
    );
    // The slot is usable again, and the key can be stored afresh.
    assert!(store(&engine, &region, 3, &[1]).success);
    assert!(load(&engine, &region, 4, &[1]).success);
    assert!(holds(&region, 0, 1));
}

#[test]
fn a_good_recovered_block_is_verified_once() {
    let sim = SimStorage::new(kvtier::sim::seed_from_env(), &[FOUR_SLOTS]);
    let cfg = sim_config(1, 1);
    let region = region(4);
    {
        let engine = open_sim(&cfg, &region, &sim);
        assert!(store(&engine, &region, 1, &[1, 2]).success);
    }
    let engine = open_sim(&cfg, &region, &sim);
    assert!(load(&engine, &region, 2, &[1, 2]).success);
    assert!(holds(&region, 0, 1) && holds(&region, 1, 2));
    assert_eq!(engine.stats().checksum_failures, 0);
}

#[test]
fn torn_writes_from_a_crash_are_never_served() {
    let base = kvtier::sim::seed_from_env();
    for round in 0..24u64 {
        let seed = base.wrapping_add(round);
        let sim = SimStorage::new(seed, &[FOUR_SLOTS]);
        let cfg = sim_config(1, 1);
        let region = region(4);
        {
            let engine = open_sim(&cfg, &region, &sim);
            assert!(store(&engine, &region, 1, &[0, 1, 2, 3]).success);
            // Crash after 0..3 more writes: the next store (which must evict) tears.
            sim.crash_after_writes(round % 4);
            let r = store(&engine, &region, 2, &[10, 11]);
            assert!(!r.success || round % 4 >= 2, "seed {seed}: {r:?}");
        }
        sim.restart();
        let engine = open_sim(&cfg, &region, &sim);
        for id in [0u64, 1, 2, 3, 10, 11] {
            if engine.lookup(&[key(id)]) != vec![Lookup::Hit(Tier::Nvme)] {
                continue;
            }
            let r = load(&engine, &region, 100 + id, &[id]);
            if r.success {
                assert!(
                    holds(&region, 0, id),
                    "seed {seed}: wrong bytes served for id {id}"
                );
            } else {
                let reason = r.failure().expect("failure").reason;
                assert_eq!(reason, KeyFailure::Checksum, "seed {seed}: id {id}");
            }
        }
    }
}

#[test]
fn foreign_data_on_a_device_is_not_overwritten_without_consent() {
    let sim = SimStorage::new(1, &[FOUR_SLOTS]);
    sim.write_raw(0, 0, b"precious user data that is not a kvtier store");
    let region = region(4);
    let cfg = sim_config(1, 1);
    let err = Engine::open_with(&cfg, region.clone(), sim.clone())
        .err()
        .expect("refused");
    assert!(err.to_string().contains("overwrite = true"), "{err}");
    assert_eq!(&sim.read_raw(0, 0, 8), b"precious");
    let _ = Faults::default();
}

/// `verify_loads = "always"`: a slot whose bytes change on the device while the engine runs,
/// after the block was stored and after it was loaded once, fails its next load with a checksum
/// error and is dropped; the default trusts a block this process stored or verified, and serves
/// what the device returns.
#[test]
fn verify_loads_always_catches_a_flip_after_the_first_load() {
    for always in [false, true] {
        let sim = SimStorage::new(kvtier::sim::seed_from_env(), &[FOUR_SLOTS]);
        let mut cfg = sim_config(1, 1);
        if always {
            cfg.verify_loads = kvtier::config::VerifyLoads::Always;
        }
        let region = region(4);
        let engine = open_sim(&cfg, &region, &sim);
        let geometry = engine.info().devices[0].geometry;
        assert!(store(&engine, &region, 1, &[1]).success);
        assert!(load(&engine, &region, 2, &[1]).success);
        assert!(holds(&region, 0, 1));
        sim.corrupt(0, geometry.slot_offset(0) + 4096, 8);
        let r = load(&engine, &region, 3, &[1]);
        if always {
            assert_eq!(
                r.failure().map(|f| f.reason),
                Some(KeyFailure::Checksum),
                "{r:?}"
            );
            assert_eq!(engine.lookup(&[key(1)]), vec![Lookup::Miss], "dropped");
            assert_eq!(engine.stats().checksum_failures, 1);
        } else {
            assert!(r.success, "the default does not re-check: {r:?}");
            assert!(!holds(&region, 0, 1), "and the flipped bytes arrive");
            assert_eq!(engine.stats().checksum_failures, 0);
        }
    }
}
