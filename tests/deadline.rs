//! A device that stops answering, on the simulated device: its keys fail with a timeout naming
//! the device and the operation once `io_timeout_ms` passes, the other device of the same
//! worker keeps serving loads and stores meanwhile, the late completions are absorbed when the
//! device answers again (nothing reported twice), and shutdown gives up waiting after the
//! deadline instead of hanging. What would break: a load that never returns, a key reported
//! twice, a worker stalled for every device by one, a shutdown that waits forever.

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvtier::sim::SimStorage;
use kvtier::KeyFailure;

const TIMEOUT_MS: u32 = 50;

fn devices_of(ids: &[u64]) -> (Vec<u64>, Vec<u64>) {
    ids.iter().partition(|&&id| key(id).device(2) == 0)
}

#[test]
fn a_hung_device_fails_its_keys_by_the_deadline_and_the_other_keeps_serving() {
    let sim = SimStorage::new(7, &[8 << 20, 8 << 20]);
    // One worker owns both devices: the hung one must not stall the other.
    let mut cfg = sim_config(2, 1);
    cfg.io_timeout_ms = TIMEOUT_MS;
    let region = region(32);
    let engine = open_sim(&cfg, &region, &sim);
    let ids: Vec<u64> = (0..24).collect();
    assert!(store(&engine, &region, 1, &ids).success);
    let (on_hung, on_live) = devices_of(&ids);
    assert!(
        !on_hung.is_empty() && !on_live.is_empty(),
        "keys on both devices"
    );

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
    for (b, id) in ids.iter().enumerate() {
        if on_live.contains(id) {
            assert!(holds(&region, b as u32, *id), "key {id} on the live device");
        }
    }
    assert_eq!(engine.stats().io_timeouts, on_hung.len() as u64);

    // The live device still takes stores and serves them while the other hangs.
    let fresh: Vec<u64> = (100..200)
        .filter(|&id| key(id).device(2) == 1)
        .take(6)
        .collect();
    assert!(store(&engine, &region, 3, &fresh).success);
    let r = load(&engine, &region, 4, &fresh);
    assert!(r.success, "{r:?}");
    for (b, &id) in fresh.iter().enumerate() {
        assert!(holds(&region, b as u32, id));
    }

    // The device answers again: its late completions are absorbed (each job was reported
    // once: nothing more arrives) and its keys load normally.
    sim.hang_device(0, false);
    let r = load(&engine, &region, 5, &on_hung);
    assert!(r.success, "{r:?}");
    for (b, &id) in on_hung.iter().enumerate() {
        assert!(holds(&region, b as u32, id));
    }
    let mut extra = Vec::new();
    assert_eq!(
        engine.poll_finished(&mut extra),
        0,
        "reported twice: {extra:?}"
    );
    engine.shutdown();
}

#[test]
fn shutdown_gives_up_on_a_device_that_never_answers() {
    let sim = SimStorage::new(8, &[8 << 20, 8 << 20]);
    let mut cfg = sim_config(2, 1);
    cfg.io_timeout_ms = TIMEOUT_MS;
    let region = region(8);
    let engine = open_sim(&cfg, &region, &sim);
    let ids: Vec<u64> = (0..8).collect();
    assert!(store(&engine, &region, 1, &ids).success);
    let (on_hung, _) = devices_of(&ids);
    sim.hang_device(0, true);
    let r = load(&engine, &region, 2, &on_hung);
    assert!(
        r.failures.iter().all(|f| f.reason == KeyFailure::Timeout),
        "{r:?}"
    );
    // The reads are still "in flight" on the hung device: shutdown must return anyway.
    let (tx, rx) = std::sync::mpsc::channel();
    let engine = std::sync::Arc::new(engine);
    let e = std::sync::Arc::clone(&engine);
    std::thread::spawn(move || {
        e.shutdown();
        let _ = tx.send(());
    });
    assert!(
        rx.recv_timeout(Duration::from_secs(30)).is_ok(),
        "shutdown waited for a device that never answers"
    );
    // Lifting the hang now reaches nobody: the worker and its backend were leaked, not freed.
    sim.hang_device(0, false);
}
