//! Partial load failures follow vLLM's semantics: the job fails, and it reports how many keys
//! in job order loaded before the first failure (`successful_keys`), with the earlier blocks'
//! bytes in place. What would break: reporting in completion order instead of job order, or
//! treating the job as all-or-nothing.

mod common;

use common::*;
use kvtier::sim::SimStorage;
use kvtier::KeyFailure;

#[test]
fn missing_last_key_reports_prefix_of_two() {
    let sim = SimStorage::new(kvtier::sim::seed_from_env(), &[64 << 20]);
    let region = region(8);
    let engine = open_sim(&sim_config(1, 2), &region, &sim);
    assert!(store(&engine, &region, 1, &[1, 2]).success);
    let r = load(&engine, &region, 2, &[1, 2, 3]);
    assert!(!r.success);
    assert_eq!(r.succeeded_prefix, 2);
    assert_eq!(r.successful_keys(), Some(2));
    let f = r.failure().expect("failure");
    assert_eq!((f.key_index, f.reason), (2, KeyFailure::Miss));
    assert!(
        holds(&region, 0, 1) && holds(&region, 1, 2),
        "loaded prefix is intact"
    );
}

#[test]
fn missing_first_key_reports_no_successful_keys() {
    let sim = SimStorage::new(kvtier::sim::seed_from_env(), &[64 << 20]);
    let region = region(8);
    let engine = open_sim(&sim_config(1, 2), &region, &sim);
    assert!(store(&engine, &region, 1, &[2, 3]).success);
    let r = load(&engine, &region, 2, &[1, 2, 3]);
    assert!(!r.success);
    assert_eq!(r.succeeded_prefix, 0);
    assert_eq!(
        r.successful_keys(),
        None,
        "vLLM reports None for an empty prefix"
    );
    assert_eq!(r.failure().expect("failure").key_index, 0);
}

#[test]
fn failure_in_the_middle_wins_over_later_failures() {
    let sim = SimStorage::new(kvtier::sim::seed_from_env(), &[64 << 20]);
    let region = region(8);
    let engine = open_sim(&sim_config(1, 2), &region, &sim);
    assert!(store(&engine, &region, 1, &[1, 3, 5]).success);
    let r = load(&engine, &region, 2, &[1, 3, 4, 5, 6]);
    assert!(!r.success);
    assert_eq!(r.succeeded_prefix, 2, "{r:?}");
    assert_eq!(r.failure().expect("failure").key_index, 2);
    assert_eq!(r.bytes, 3 * BLOCK, "bytes count every block that moved");
}

#[test]
fn device_error_fails_the_key_and_keeps_the_block() {
    // An EIO on load is transient: the job fails but the block stays stored (like vLLM, which
    // leaves the file alone on a read error).
    let sim = SimStorage::new(kvtier::sim::seed_from_env(), &[64 << 20]);
    let region = region(8);
    let engine = open_sim(&sim_config(1, 1), &region, &sim);
    assert!(store(&engine, &region, 1, &[7]).success);
    sim.set_faults(kvtier::sim::Faults {
        eio_ppm: 1_000_000,
        data_only: true,
        ..Default::default()
    });
    let r = load(&engine, &region, 2, &[7]);
    assert!(!r.success);
    assert_eq!(
        r.failure().expect("failure").reason,
        KeyFailure::Io(kvtier::Errno::EIO)
    );
    sim.set_faults(kvtier::sim::Faults::default());
    assert_eq!(
        engine.lookup(&[key(7)]),
        vec![kvtier::Lookup::Hit(kvtier::Tier::Nvme)]
    );
    assert!(load(&engine, &region, 3, &[7]).success);
    assert!(holds(&region, 0, 7));
}
