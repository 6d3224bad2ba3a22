//! A full device evicts (CLOCK) to make room, emits removal events, and never evicts a block
//! that a load is reading. What would break: stores failing on a full device, evicting a
//! pinned slot (the load would read another key's bytes), missing events.

mod common;

use common::*;
use kvtier::sim::SimStorage;
use kvtier::{Job, Lookup, Tier};

const FOUR_SLOTS: u64 = (1 << 20) + 4 * BLOCK;

#[test]
fn full_device_evicts_and_emits_removal_events() {
    let sim = SimStorage::new(kvtier::sim::seed_from_env(), &[FOUR_SLOTS]);
    let region = region(8);
    let engine = open_sim(&sim_config(1, 1), &region, &sim);
    assert!(store(&engine, &region, 1, &[0, 1, 2, 3]).success);
    let stored = engine.take_events();
    assert_eq!(stored.len(), 1);
    assert!(!stored[0].removed && stored[0].keys.len() == 4);
    assert!(store(&engine, &region, 2, &[4, 5]).success);
    let s = engine.stats();
    assert_eq!(s.evictions, 2);
    assert_eq!(s.blocks_stored, 4);
    let events = engine.take_events();
    let removed: Vec<_> = events
        .iter()
        .filter(|e| e.removed)
        .flat_map(|e| e.keys.clone())
        .collect();
    assert_eq!(removed.len(), 2, "{events:?}");
    let all: Vec<u64> = (0..6).collect();
    let hits = engine.lookup(&all.iter().map(|&i| key(i)).collect::<Vec<_>>());
    assert_eq!(
        hits.iter()
            .filter(|l| **l == Lookup::Hit(Tier::Nvme))
            .count(),
        4
    );
    for (id, l) in all.iter().zip(&hits) {
        let evicted = removed.contains(&key(*id));
        assert_eq!(*l == Lookup::Miss, evicted, "id {id}");
        if !evicted {
            assert!(load(&engine, &region, 10 + id, &[*id]).success);
            assert!(holds(&region, 0, *id));
        }
    }
}

#[test]
fn a_block_being_loaded_is_not_evicted() {
    let sim = SimStorage::new(kvtier::sim::seed_from_env(), &[FOUR_SLOTS]);
    let region = region(8);
    let engine = open_sim(&sim_config(1, 1), &region, &sim);
    assert!(store(&engine, &region, 1, &[0, 1, 2, 3]).success);
    sim.pause(true);
    sim.record(true);
    region.fill(0, BLOCK as usize, 0);
    engine
        .submit_load(Job::new(2, vec![key(2)], vec![0]))
        .expect("submit");
    while sim.take_log().is_empty() {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    // Four new keys need four slots; only three are evictable while key 2 is being read.
    for (n, id) in (10..14u64).enumerate() {
        put(&region, 4 + n as u32 % 4, id);
    }
    engine
        .submit_store(Job::new(3, (10..13).map(key).collect(), vec![4, 5, 6]))
        .expect("submit");
    std::thread::sleep(std::time::Duration::from_millis(20));
    sim.pause(false);
    let results = wait_results(&engine, 2);
    assert!(results.iter().all(|r| r.success), "{results:?}");
    assert!(holds(&region, 0, 2), "the pinned block was not overwritten");
    assert_eq!(engine.lookup(&[key(2)]), vec![Lookup::Hit(Tier::Nvme)]);
    let gone = engine.lookup(&[key(0), key(1), key(3)]);
    assert!(gone.iter().all(|l| *l == Lookup::Miss), "{gone:?}");
}

/// `Engine::touch` gives a block CLOCK's second chance: after one eviction has cleared every
/// reference bit, touching all survivors but one makes that one the next victim. Run once per
/// survivor, so a touch that did nothing would pick the wrong victim in at least two runs.
#[test]
fn touched_blocks_outlive_untouched_ones() {
    for untouched in 0..3 {
        let sim = SimStorage::new(kvtier::sim::seed_from_env(), &[FOUR_SLOTS]);
        let region = region(8);
        let engine = open_sim(&sim_config(1, 1), &region, &sim);
        assert!(store(&engine, &region, 1, &[0, 1, 2, 3]).success);
        assert!(store(&engine, &region, 2, &[4]).success);
        let keys: Vec<_> = (0..4).map(key).collect();
        let survivors: Vec<u64> = (0..4)
            .filter(|&i| engine.lookup(&[keys[i as usize]])[0] == Lookup::Hit(Tier::Nvme))
            .collect();
        assert_eq!(survivors.len(), 3, "one of 0..4 was evicted");
        let keep: Vec<_> = survivors
            .iter()
            .enumerate()
            .filter(|(n, _)| *n != untouched)
            .map(|(_, &i)| key(i))
            .collect();
        engine.touch(&keep);
        engine.touch(&[key(99)]); // not held: ignored
        assert!(store(&engine, &region, 3, &[5]).success);
        let victim = survivors[untouched];
        assert_eq!(
            engine.lookup(&[key(victim)]),
            vec![Lookup::Miss],
            "run {untouched}"
        );
        for k in &keep {
            assert_eq!(
                engine.lookup(&[*k]),
                vec![Lookup::Hit(Tier::Nvme)],
                "run {untouched}"
            );
        }
        engine.shutdown();
        engine.touch(&keep); // after shutdown: a no-op, not a panic
    }
}

/// A device too small to give every worker a slot-table page (32 slots): the keys of a worker
/// without slots fail with a message that says why and what to change, the others store.
#[test]
fn a_worker_without_slots_says_how_to_fix_it() {
    let sim = SimStorage::new(kvtier::sim::seed_from_env(), &[FOUR_SLOTS]);
    let region = region(8);
    let engine = open_sim(&sim_config(1, 2), &region, &sim);
    let r = store(&engine, &region, 1, &[0, 1, 2, 3, 4, 5, 6, 7]);
    assert!(!r.success);
    assert!(
        r.failures.len() < 8,
        "the worker with slots stored its keys: {r:?}"
    );
    for f in &r.failures {
        assert_eq!(f.reason, kvtier::KeyFailure::NoSpace);
        assert!(
            f.detail.contains("has no slots")
                && f.detail
                    .contains("raise the device's capacity_bytes or use fewer cores"),
            "{}",
            f.detail
        );
    }
}

/// `Engine::remove` frees what it removes at once (no eviction needed for the next stores),
/// says per key whether it removed it, sends removed events, and a reopen does not bring a
/// removed key back (its table entry was cleared on the device).
#[test]
fn removed_blocks_are_gone_their_slots_reused_and_they_stay_gone_after_a_reopen() {
    let sim = SimStorage::new(kvtier::sim::seed_from_env(), &[FOUR_SLOTS]);
    let region = region(8);
    {
        let engine = open_sim(&sim_config(1, 1), &region, &sim);
        assert!(store(&engine, &region, 1, &[0, 1, 2, 3]).success);
        engine.take_events();
        assert_eq!(
            engine.remove(&[key(1), key(3), key(99), key(1)]),
            vec![true, true, false, false],
            "held, held, never stored, already removed"
        );
        assert_eq!(
            engine.lookup(&[key(0), key(1), key(2), key(3)]),
            vec![
                Lookup::Hit(Tier::Nvme),
                Lookup::Miss,
                Lookup::Hit(Tier::Nvme),
                Lookup::Miss
            ]
        );
        let removed: Vec<_> = engine
            .take_events()
            .into_iter()
            .filter(|e| e.removed)
            .flat_map(|e| e.keys)
            .collect();
        assert_eq!(removed, vec![key(1), key(3)]);
        let s = engine.stats();
        assert_eq!((s.removals, s.evictions, s.blocks_stored), (2, 0, 2));
        // The two freed slots take two new blocks without evicting anything.
        assert!(store(&engine, &region, 2, &[4, 5]).success);
        assert_eq!(engine.stats().evictions, 0);
        let r = load(&engine, &region, 3, &[0, 2, 4, 5]);
        assert!(r.success, "{r:?}");
        for (b, id) in [0u64, 2, 4, 5].into_iter().enumerate() {
            assert!(holds(&region, b as u32, id));
        }
        engine.shutdown();
        assert_eq!(engine.remove(&[key(0)]), vec![false], "after shutdown");
    }
    let engine = open_sim(&sim_config(1, 1), &region, &sim);
    assert_eq!(
        engine.lookup(&(0..6).map(key).collect::<Vec<_>>()),
        [true, false, true, false, true, true]
            .into_iter()
            .map(|held| if held {
                Lookup::Hit(Tier::Nvme)
            } else {
                Lookup::Miss
            })
            .collect::<Vec<_>>()
    );
}

/// A block a load is reading is not removed (its slot cannot be reused under the read); once
/// the load is done it is.
#[test]
fn a_block_being_read_is_not_removed_until_the_read_ends() {
    let sim = SimStorage::new(kvtier::sim::seed_from_env(), &[FOUR_SLOTS]);
    let region = region(8);
    let engine = open_sim(&sim_config(1, 1), &region, &sim);
    assert!(store(&engine, &region, 1, &[7]).success);
    sim.record(true);
    sim.pause(true);
    engine
        .submit_load(Job::new(2, vec![key(7)], vec![3]))
        .expect("submit");
    while sim.take_log().is_empty() {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(engine.remove(&[key(7)]), vec![false], "pinned by the load");
    sim.pause(false);
    let r = wait_results(&engine, 1).pop().expect("result");
    assert!(r.success, "{r:?}");
    assert!(holds(&region, 3, 7));
    assert_eq!(engine.remove(&[key(7)]), vec![true]);
    assert_eq!(engine.lookup(&[key(7)]), vec![Lookup::Miss]);
}
