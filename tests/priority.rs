//! Loads overtake queued stores. With the simulated device paused, a large store job fills the
//! store budget and then queues; a load submitted afterwards must reach the device before the
//! queued store chunks do, and while it is pending the stores in flight stay under
//! `store_inflight_max_while_loading`. Observed through the device's request log (order), not
//! through timing. What would break: a single FIFO queue, or a store cap that ignores loads.

mod common;

use common::*;
use kvtier::io::{IoClass, IoKind};
use kvtier::sim::SimStorage;
use kvtier::Job;

#[test]
fn loads_overtake_queued_stores() {
    let seed = kvtier::sim::seed_from_env();
    let sim = SimStorage::new(seed, &[64 << 20]);
    let mut cfg = sim_config(1, 1);
    cfg.scheduler.store_chunk_bytes = 16 << 10;
    cfg.scheduler.store_inflight_max = 256 << 10; // 4 whole blocks
    cfg.scheduler.store_inflight_max_while_loading = 16 << 10; // 1 chunk
    let region = region(40);
    let engine = open_sim(&cfg, &region, &sim);
    // Something to load later.
    assert!(store(&engine, &region, 1, &[1000, 1001]).success);

    sim.record(true);
    sim.pause(true);
    let ids: Vec<u64> = (0..32).collect();
    for (b, &id) in ids.iter().enumerate() {
        put(&region, b as u32 + 8, id);
    }
    let blocks: Vec<u32> = (8..40).collect();
    engine
        .submit_store(Job::new(2, ids.iter().map(|&i| key(i)).collect(), blocks))
        .expect("submit");
    // Let the worker fill its store budget: with no load around it writes whole blocks, so 4
    // block writes are then in flight and stuck.
    wait_for(|| sim_log_writes(&sim) >= 4);
    engine
        .submit_load(Job::new(3, vec![key(1000), key(1001)], vec![0, 1]))
        .expect("submit");
    wait_for(|| sim_log_reads(&sim) >= 2);
    sim.pause(false);
    let results = wait_results(&engine, 2);
    assert!(results.iter().all(|r| r.success), "{results:?}");
    assert!(holds(&region, 0, 1000) && holds(&region, 1, 1001));

    let log = sim.take_log();
    let data: Vec<_> = log.iter().filter(|e| e.class != IoClass::Meta).collect();
    let first_load = data
        .iter()
        .position(|e| e.kind == IoKind::Read)
        .expect("a load was issued");
    // Only the 4 block writes issued before the load arrived precede it: nothing queued
    // behind the store budget got ahead of the load.
    assert_eq!(first_load, 4, "log: {data:?}");
    assert_eq!(
        data[first_load + 1].kind,
        IoKind::Read,
        "both loads go before more stores"
    );
    let writes: Vec<u32> = data
        .iter()
        .filter(|e| e.kind == IoKind::Write)
        .map(|e| e.len)
        .collect();
    assert!(
        writes[..4].iter().all(|&l| l == 64 << 10),
        "whole blocks with no load around"
    );
    assert_eq!(
        writes.iter().map(|&l| u64::from(l)).sum::<u64>(),
        32 * (64 << 10)
    );
}

#[test]
fn stores_keep_a_minimum_share_under_constant_loads() {
    // Loads never stop arriving, yet the store job completes: one store chunk is always allowed.
    let seed = kvtier::sim::seed_from_env();
    let sim = SimStorage::new(seed, &[64 << 20]);
    let mut cfg = sim_config(1, 1);
    cfg.scheduler.store_chunk_bytes = 16 << 10;
    cfg.scheduler.store_inflight_max_while_loading = 16 << 10;
    let region = region(24);
    let engine = open_sim(&cfg, &region, &sim);
    assert!(store(&engine, &region, 1, &[500]).success);
    sim.record(true);
    // Loads are already waiting when the store job arrives.
    sim.pause(true);
    engine
        .submit_load(Job::new(99, vec![key(500)], vec![0]))
        .expect("submit");
    wait_for(|| sim_log_reads(&sim) >= 1);
    let ids: Vec<u64> = (0..16).collect();
    for (b, &id) in ids.iter().enumerate() {
        put(&region, b as u32 + 8, id);
    }
    engine
        .submit_store(Job::new(
            2,
            ids.iter().map(|&i| key(i)).collect(),
            (8..24).collect(),
        ))
        .expect("submit");
    std::thread::sleep(std::time::Duration::from_millis(10));
    sim.pause(false);
    let mut done = Vec::new();
    let mut next_load = 100;
    let mut loads_outstanding = 0;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !done.iter().any(|r: &kvtier::JobResult| r.id == 2) {
        assert!(std::time::Instant::now() < deadline, "stores starved");
        while loads_outstanding < 4 {
            engine
                .submit_load(Job::new(
                    next_load,
                    vec![key(500)],
                    vec![(next_load % 8) as u32],
                ))
                .expect("submit");
            next_load += 1;
            loads_outstanding += 1;
        }
        let before = done.len();
        engine.wait_finished(&mut done, std::time::Duration::from_millis(20));
        loads_outstanding -= done[before..].iter().filter(|r| r.id >= 100).count();
    }
    assert!(done.iter().find(|r| r.id == 2).is_some_and(|r| r.success));
    engine.drain();
    // Stores started while loads were waiting were split into store_chunk_bytes writes.
    let chunked = sim
        .take_log()
        .iter()
        .filter(|e| e.kind == IoKind::Write && e.class == IoClass::Store && e.len == 16 << 10)
        .count();
    assert!(chunked > 0, "no chunked store writes under constant loads");
}

fn sim_log_writes(sim: &SimStorage) -> usize {
    peek_log(sim)
        .iter()
        .filter(|e| e.kind == IoKind::Write && e.class == IoClass::Store)
        .count()
}

fn sim_log_reads(sim: &SimStorage) -> usize {
    peek_log(sim)
        .iter()
        .filter(|e| e.kind == IoKind::Read)
        .count()
}

fn peek_log(sim: &SimStorage) -> Vec<kvtier::sim::LogEntry> {
    let log = sim.take_log();
    sim.restore_log(&log);
    log
}

fn wait_for(mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !cond() {
        assert!(
            std::time::Instant::now() < deadline,
            "condition not reached"
        );
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}
