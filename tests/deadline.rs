//! A device that stops answering, on the simulated device: its keys fail with a timeout naming
//! the device and the operation once `io_timeout_ms` passes, the other device of the same
//! worker keeps serving loads and stores meanwhile, the late completions are absorbed when the
//! device answers again (nothing reported twice), a device that keeps timing out is marked
//! failed (its keys are misses, its stores go to the other device), and shutdown gives up
//! waiting after the deadline instead of hanging. The job's blocks are the caller's only once
//! no I/O can reach them: by default its result waits for that; with early results it comes at
//! the deadline carrying a release that is set then. What would break: a load that never
//! returns, a key reported twice, a worker stalled for every device by one, a shutdown that
//! waits forever, blocks handed back while a late read may still land in them.

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvtier::sim::SimStorage;
use kvtier::KeyFailure;

const TIMEOUT_MS: u32 = 50;

/// Submits a load of `ids` into blocks `0..` as job `id` without waiting; returns the blocks.
fn submit_load_of(engine: &kvtier::Engine, id: u64, ids: &[u64]) -> Vec<u32> {
    let blocks: Vec<u32> = (0..ids.len() as u32).collect();
    engine
        .submit_load(kvtier::Job::new(
            id,
            ids.iter().map(|&i| key(i)).collect(),
            blocks.clone(),
        ))
        .expect("submit");
    blocks
}

fn devices_of(ids: &[u64]) -> (Vec<u64>, Vec<u64>) {
    ids.iter().partition(|&&id| key(id).device(2) == 0)
}

/// Two simulated devices owned by one worker (so a hung one must not stall the other), with
/// keys `0..stored` stored; returns the keys on device 0 and on device 1.
fn setup(
    seed: u64,
    blocks: u64,
    stored: u64,
    early: bool,
) -> (
    std::sync::Arc<SimStorage>,
    std::sync::Arc<kvtier::Region>,
    kvtier::Engine,
    Vec<u64>,
    Vec<u64>,
) {
    let sim = SimStorage::new(seed, &[8 << 20, 8 << 20]);
    let mut cfg = sim_config(2, 1);
    cfg.io_timeout_ms = TIMEOUT_MS;
    let region = region(blocks);
    let engine = open_sim(&cfg, &region, &sim);
    engine.set_early_results(early);
    let ids: Vec<u64> = (0..stored).collect();
    assert!(store(&engine, &region, 1, &ids).success);
    let (on_hung, on_live) = devices_of(&ids);
    assert!(
        !on_hung.is_empty() && !on_live.is_empty(),
        "keys on both devices"
    );
    (sim, region, engine, on_hung, on_live)
}

#[test]
fn a_hung_device_fails_its_keys_by_the_deadline_and_the_other_keeps_serving() {
    let (sim, region, engine, on_hung, on_live) = setup(7, 32, 24, true);
    let ids: Vec<u64> = (0..24).collect();

    sim.hang_device(0, true);
    let started = Instant::now();
    let r = load(&engine, &region, 2, &ids);
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(u64::from(TIMEOUT_MS)),
        "failed before the deadline: {waited:?}"
    );
    assert_eq!(r.failures.len(), on_hung.len(), "{r:?}");
    for f in &r.failures {
        assert!(on_hung.contains(&ids[f.key_index]), "{f:?}");
        assert_eq!(f.reason, KeyFailure::Timeout, "{f:?}");
        for part in [
            "devices[0] sim0",
            "load (read of slot",
            "io_timeout_ms = 50",
        ] {
            assert!(
                f.detail.contains(part),
                "`{part}` missing from: {}",
                f.detail
            );
        }
    }
    assert_eq!(engine.stats().io_timeouts, on_hung.len() as u64);
    // The reads are still in flight: the job's blocks stay leased, so the caller cannot hand
    // them to another job, write them or even read them (the loaded ones too) while the
    // device may still land bytes there.
    assert!((0..24).all(|b| region.is_leased(b)), "released too early");
    let live = on_live[0];
    let live_block = ids.iter().position(|&id| id == live).expect("loaded") as u32;
    let early_read = std::panic::catch_unwind(|| holds(&region, live_block, live));
    assert!(
        early_read.is_err(),
        "read a block of a job not yet released"
    );
    let release = r
        .release
        .clone()
        .expect("an early result carries its release");
    assert!(!r.released() && !release.is_released(), "{release:?}");
    assert_eq!((release.job_id(), release.blocks()), (2, 24));
    assert!(
        !release.wait(Some(Duration::from_millis(20))),
        "set while the reads run"
    );
    assert_eq!(engine.stats().blocks_held_by_hung_io, 24);

    // The live device still takes stores and serves them while the other hangs (from blocks
    // the hung reads cannot reach).
    let fresh: Vec<u64> = (100..200)
        .filter(|&id| key(id).device(2) == 1)
        .take(6)
        .collect();
    let blocks: Vec<u32> = (24..24 + fresh.len() as u32).collect();
    assert!(store_into(&engine, &region, 3, &fresh, blocks.clone()).success);
    let r = load_into(&engine, 4, &fresh, blocks.clone());
    assert!(r.success, "{r:?}");
    for (&b, &id) in blocks.iter().zip(&fresh) {
        assert!(holds(&region, b, id));
    }

    // That many timeouts marked the device failed: its keys are misses from now on (until a
    // restart), without waiting for the deadline again.
    assert_eq!(engine.stats().devices_failed, 1);
    // The device answers again: its late completions are absorbed, and no job is reported
    // a second time.
    sim.hang_device(0, false);
    let deadline = Instant::now() + Duration::from_secs(10);
    while engine.stats().inflight_ops > 0 {
        assert!(Instant::now() < deadline, "late completions never arrived");
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut extra = Vec::new();
    assert_eq!(
        engine.poll_finished(&mut extra),
        0,
        "reported twice: {extra:?}"
    );
    // The last late read gave the blocks back, and every read landed in a block still leased.
    assert!(
        (0..24).all(|b| !region.is_leased(b)),
        "a lease outlived its reads"
    );
    assert!(release.wait(Some(Duration::from_secs(10))) && r.released());
    assert_eq!(engine.stats().blocks_held_by_hung_io, 0);
    // Now the caller reads what the live device loaded.
    for (b, id) in ids.iter().enumerate() {
        if on_live.contains(id) {
            assert!(holds(&region, b as u32, *id), "key {id} on the live device");
        }
    }
    assert_eq!(sim.take_strays(), Vec::<String>::new());
    let r = load(&engine, &region, 5, &on_hung);
    assert!(
        r.failures.iter().all(|f| f.reason == KeyFailure::Miss)
            && r.failures.len() == on_hung.len(),
        "{r:?}"
    );
    engine.shutdown();
}

// By default a job whose reads outlive their deadline is reported only once the device
// answers: the caller never sees its blocks while a read may still land there. drain() does
// not wait for it; drain_released() does; the blocks count as held meanwhile.
#[test]
fn by_default_a_timed_out_load_is_reported_once_its_blocks_are_free() {
    let (sim, region, engine, on_hung, on_live) = setup(10, 32, 24, false);
    sim.hang_device(0, true);
    let blocks = submit_load_of(&engine, 2, &on_hung);
    // Past the deadline the keys have failed, but the reads run on: no result yet.
    let started = Instant::now();
    engine.drain();
    assert!(started.elapsed() >= Duration::from_millis(u64::from(TIMEOUT_MS)));
    let mut out = Vec::new();
    assert_eq!(engine.poll_finished(&mut out), 0, "reported early: {out:?}");
    assert_eq!(engine.jobs_in_flight(), 1);
    let held = engine.stats().blocks_held_by_hung_io;
    assert_eq!(held, blocks.len() as u64);
    assert!(blocks.iter().all(|&b| region.is_leased(b)));
    // Other work goes on meanwhile, from blocks the hung reads cannot reach.
    let first = on_hung.len() as u32;
    let r = load_into(
        &engine,
        3,
        &on_live,
        (first..first + on_live.len() as u32).collect(),
    );
    assert!(r.success && r.release.is_none(), "{r:?}");

    sim.hang_device(0, false);
    engine.drain_released();
    assert_eq!(engine.poll_finished(&mut out), 1);
    let r = &out[0];
    assert_eq!(r.id, 2);
    assert!(
        r.release.is_none() && r.released(),
        "free when reported: {r:?}"
    );
    assert_eq!(r.failures.len(), on_hung.len());
    assert!(r.failures.iter().all(|f| f.reason == KeyFailure::Timeout));
    assert!(blocks.iter().all(|&b| !region.is_leased(b)));
    assert_eq!(engine.stats().blocks_held_by_hung_io, 0);
    assert_eq!(sim.take_strays(), Vec::<String>::new());
    assert!(engine.shutdown().clean());
}

// A shutdown that gives up on a hung device reports the job that waited for it, saying its
// blocks are not free, and says what it could not stop.
#[test]
fn shutdown_reports_what_a_hung_device_still_holds() {
    let (sim, region, engine, on_hung, _) = setup(11, 8, 8, false);
    sim.hang_device(0, true);
    let blocks = submit_load_of(&engine, 2, &on_hung);
    engine.drain();
    let report = engine.shutdown();
    assert!(!report.clean(), "{report:?}");
    assert_eq!(report.workers_gave_up, 1, "{report:?}");
    assert_eq!(report.ops_in_flight, on_hung.len(), "{report:?}");
    assert_eq!(report.jobs_held, 1, "{report:?}");
    assert_eq!(report.blocks_held, blocks.len() as u64, "{report:?}");
    assert_eq!(engine.shutdown(), report, "a second call says the same");
    let mut out = Vec::new();
    assert_eq!(engine.poll_finished(&mut out), 1);
    let release = out[0].release.clone().expect("reported with its release");
    assert!(!release.is_released() && !out[0].released());
    assert!(blocks.iter().all(|&b| region.is_leased(b)));
    // The worker was leaked with its backend: lifting the hang reaches nobody, and the blocks
    // stay leased for good.
    sim.hang_device(0, false);
    assert!(!release.wait(Some(Duration::from_millis(50))));
    assert!(blocks.iter().all(|&b| region.is_leased(b)));
}

// A device that can be fenced (a controller driven from user space) is, at a shutdown that
// would otherwise give up on it: the hung I/O fails, no byte of it lands, the job's blocks come
// back and the report is clean, so the caller may free the region.
#[test]
fn shutdown_fences_a_hung_device_that_can_be_fenced_instead_of_leaking() {
    let (sim, region, engine, on_hung, _) = setup(11, 8, 8, false);
    sim.set_fenceable(true);
    sim.hang_device(0, true);
    let blocks = submit_load_of(&engine, 2, &on_hung);
    engine.drain();
    let report = engine.shutdown();
    assert!(report.clean(), "{report:?}");
    assert_eq!(report.workers_gave_up, 0, "{report:?}");
    assert_eq!(
        sim.fences(),
        1,
        "the worker with the hung reads fenced its queue"
    );
    let mut out = Vec::new();
    assert_eq!(engine.poll_finished(&mut out), 1);
    let r = &out[0];
    assert!(r.released(), "free when reported: {r:?}");
    assert_eq!(r.failures.len(), on_hung.len(), "{r:?}");
    assert!(blocks.iter().all(|&b| !region.is_leased(b)));
    // Lifting the hang now reaches nobody: the fenced requests never ran.
    sim.hang_device(0, false);
    assert_eq!(sim.take_strays(), Vec::<String>::new());
    assert!(blocks.iter().all(|&b| !region.is_leased(b)));
}

#[test]
fn shutdown_gives_up_on_a_device_that_never_answers() {
    let (sim, region, engine, on_hung, _) = setup(8, 8, 8, true);
    sim.hang_device(0, true);
    let r = load(&engine, &region, 2, &on_hung);
    assert!(
        r.failures.iter().all(|f| f.reason == KeyFailure::Timeout),
        "{r:?}"
    );
    // The reads are still "in flight" on the hung device: shutdown must return anyway.
    assert!(
        shutdown_returns(engine, Duration::from_secs(30)),
        "shutdown waited for a device that never answers"
    );
    // Lifting the hang now reaches nobody: the worker and its backend were leaked, not freed.
    sim.hang_device(0, false);
}

// A device that keeps timing out is marked failed: its keys are misses at once (no more
// waiting for the deadline), and stores of keys that would go to it land on the other device.
#[test]
fn a_device_that_keeps_timing_out_is_marked_failed_and_stores_go_elsewhere() {
    let (sim, region, engine, on_hung, _) = setup(9, 32, 24, true);
    assert!(on_hung.len() >= 3, "enough keys on device 0: {on_hung:?}");
    sim.hang_device(0, true);
    let r = load(&engine, &region, 2, &on_hung);
    assert!(
        r.failures.iter().all(|f| f.reason == KeyFailure::Timeout),
        "{r:?}"
    );
    let s = engine.stats();
    assert_eq!(s.devices_failed, 1, "{s:?}");
    // Now a miss without waiting: the key is no longer held.
    let blocks: Vec<u32> = (16..16 + on_hung.len() as u32).collect();
    let r = load_into(&engine, 3, &on_hung, blocks);
    assert!(
        r.failures.iter().all(|f| f.reason == KeyFailure::Miss),
        "{r:?}"
    );
    assert!(
        r.elapsed < Duration::from_millis(u64::from(TIMEOUT_MS)),
        "{r:?}"
    );
    // Keys whose home is the failed device are stored on the other one, and load back.
    let homeless: Vec<u64> = (300..400)
        .filter(|&id| key(id).device(2) == 0)
        .take(4)
        .collect();
    let blocks: Vec<u32> = (24..28).collect();
    for (&b, &id) in blocks.iter().zip(&homeless) {
        put(&region, b, id);
    }
    engine
        .submit_store(kvtier::Job::new(
            4,
            homeless.iter().map(|&i| key(i)).collect(),
            blocks.clone(),
        ))
        .expect("submit");
    let r = wait_results(&engine, 1).pop().expect("result");
    assert!(r.success, "{r:?}");
    let r = load_into(&engine, 5, &homeless, blocks.clone());
    assert!(r.success, "{r:?}");
    for (&b, &id) in blocks.iter().zip(&homeless) {
        assert!(holds(&region, b, id));
    }
    sim.hang_device(0, false);
    engine.shutdown();
}

// A store whose data is written but whose slot-table page write cannot be queued (the queue
// refuses it, as a ring full of I/O hung on another device would) has no op of its own to
// carry a deadline: it fails with a timeout naming the table write once io_timeout_ms passes,
// instead of waiting as long as the queue stays full. Its data is still served (the entry may
// reach the device later), and once the queue takes page writes again new stores succeed.
#[test]
fn a_store_whose_table_write_cannot_be_queued_times_out() {
    let (sim, region, engine, _, on_live) = setup(12, 32, 24, false);
    let fresh: Vec<u64> = (500..600)
        .filter(|&id| key(id).device(2) == 1)
        .take(2)
        .collect();
    sim.refuse_table_writes(true);
    for (b, &id) in [24u32, 25].iter().zip(&fresh) {
        put(&region, *b, id);
    }
    let started = Instant::now();
    engine
        .submit_store(kvtier::Job::new(
            2,
            fresh.iter().map(|&i| key(i)).collect(),
            vec![24, 25],
        ))
        .expect("submit");
    let mut out = Vec::new();
    while out.is_empty() && started.elapsed() < Duration::from_secs(5) {
        engine.wait_finished(&mut out, Duration::from_millis(20));
    }
    let waited = started.elapsed();
    // Take page writes again before asserting, so a failure does not also hang the drop.
    sim.refuse_table_writes(false);
    let r = out
        .pop()
        .expect("the store was never reported: no deadline covered it");
    assert!(
        waited >= Duration::from_millis(u64::from(TIMEOUT_MS)),
        "{waited:?}"
    );
    assert_eq!(r.failures.len(), fresh.len(), "{r:?}");
    for f in &r.failures {
        assert_eq!(f.reason, KeyFailure::Timeout, "{f:?}");
        for part in [
            "slot table write",
            "could not be queued",
            "io_timeout_ms = 50",
        ] {
            assert!(
                f.detail.contains(part),
                "`{part}` missing from: {}",
                f.detail
            );
        }
    }
    assert!(r.released(), "no I/O holds the blocks: {r:?}");
    // The data was written and published: it is served.
    let r = load_into(&engine, 3, &fresh, vec![26, 27]);
    assert!(r.success, "{r:?}");
    assert!(holds(&region, 26, fresh[0]) && holds(&region, 27, fresh[1]));
    let more: Vec<u64> = on_live.iter().copied().take(2).collect();
    let r = store_into(&engine, &region, 4, &more, vec![28, 29]);
    assert!(r.success, "{r:?}");
    assert!(engine.shutdown().clean());
}
