//! Engine lifecycle: backpressure when queues are full (an explicit error, nothing queued),
//! drain, shutdown with I/O in flight (every job reported once; in-flight I/O completes), and
//! submit after shutdown. What would break: a blocking submit, a lost or doubled result, a
//! worker exiting with I/O in flight, a hang on shutdown.

mod common;

use common::*;
use kvtier::sim::SimStorage;
use std::os::fd::AsRawFd;

use kvtier::{Engine, Error, Job, KeyFailure};

/// Unpauses the simulated device when dropped, so a failing assertion cannot leave the
/// engine's shutdown waiting forever on I/O that never completes.
struct Unpause<'a>(&'a SimStorage);

impl Drop for Unpause<'_> {
    fn drop(&mut self) {
        self.0.pause(false);
    }
}

#[test]
fn full_queue_gives_backpressure_errors() {
    let sim = SimStorage::new(kvtier::sim::seed_from_env(), &[64 << 20]);
    let mut cfg = sim_config(1, 1);
    cfg.queue_blocks_max = 4;
    cfg.scheduler.load_inflight_max = 1;
    let region = region(8);
    let engine = open_sim(&cfg, &region, &sim);
    assert!(store(&engine, &region, 1, &[1]).success);
    sim.record(true);
    sim.pause(true);
    let _unpause = Unpause(&sim);
    engine
        .submit_load(Job::new(2, vec![key(1); 4], vec![0, 1, 2, 3]))
        .expect("fits exactly");
    while sim.take_log().is_empty() {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    // One load is in flight, three are queued: two more blocks exceed queue_blocks_max = 4.
    match engine.submit_load(Job::new(3, vec![key(1); 2], vec![4, 5])) {
        Err(Error::Backpressure(msg)) => assert!(msg.contains("queue_blocks_max = 4"), "{msg}"),
        other => panic!("expected backpressure, got {other:?}"),
    }
    engine
        .submit_load(Job::new(4, vec![key(1)], vec![4]))
        .expect("one more block fits");
    sim.pause(false);
    let mut results = wait_results(&engine, 2);
    results.sort_by_key(|r| r.id);
    assert_eq!(results.iter().map(|r| r.id).collect::<Vec<_>>(), vec![2, 4]);
    assert!(results.iter().all(|r| r.success), "{results:?}");
    assert_eq!(
        engine.poll_finished(&mut Vec::new()),
        0,
        "the refused job left no result"
    );
}

#[test]
fn too_many_jobs_give_backpressure_errors() {
    let sim = SimStorage::new(kvtier::sim::seed_from_env(), &[64 << 20]);
    let mut cfg = sim_config(1, 1);
    cfg.jobs_in_flight_max = 2;
    let region = region(8);
    let engine = open_sim(&cfg, &region, &sim);
    sim.pause(true);
    let _unpause = Unpause(&sim);
    put(&region, 0, 1);
    put(&region, 1, 2);
    engine
        .submit_store(Job::new(1, vec![key(1)], vec![0]))
        .expect("first");
    engine
        .submit_store(Job::new(2, vec![key(2)], vec![1]))
        .expect("second");
    match engine.submit_store(Job::new(3, vec![key(3)], vec![2])) {
        Err(Error::Backpressure(msg)) => assert!(msg.contains("jobs_in_flight_max = 2"), "{msg}"),
        other => panic!("expected backpressure, got {other:?}"),
    }
    sim.pause(false);
    let results = wait_results(&engine, 2);
    assert!(results.iter().all(|r| r.success), "{results:?}");
    engine.drain();
    assert_eq!(engine.jobs_in_flight(), 0);
    engine
        .submit_store(Job::new(3, vec![key(3)], vec![2]))
        .expect("room again");
}

#[test]
fn drain_waits_for_everything_submitted() {
    let sim = SimStorage::new(kvtier::sim::seed_from_env(), &[64 << 20]);
    let mut cfg = sim_config(1, 2);
    cfg.scheduler.store_chunk_bytes = 16 << 10;
    let region = region(32);
    let engine = open_sim(&cfg, &region, &sim);
    sim.set_faults(kvtier::sim::Faults {
        max_delay_rounds: 5,
        reorder: true,
        ..Default::default()
    });
    for j in 0..16u64 {
        put(&region, j as u32 * 2, j * 2);
        put(&region, j as u32 * 2 + 1, j * 2 + 1);
        engine
            .submit_store(Job::new(
                j,
                vec![key(j * 2), key(j * 2 + 1)],
                vec![j as u32 * 2, j as u32 * 2 + 1],
            ))
            .expect("submit");
    }
    engine.drain();
    assert_eq!(engine.jobs_in_flight(), 0);
    let mut out = Vec::new();
    assert_eq!(
        engine.poll_finished(&mut out),
        16,
        "every result is ready after drain"
    );
    assert!(out.iter().all(|r| r.success));
}

#[test]
fn shutdown_with_io_in_flight_reports_every_job_once() {
    let dir = scratch_dir();
    let cfg = file_config(&dir.path().join("dev.slab"), 64 << 20, 2);
    let region = region(64);
    let engine = match Engine::open(&cfg, region.clone()) {
        Ok(e) => e,
        Err(Error::Ring(m)) => return kvtier_sys::skip!("io_uring unavailable: {m}"),
        Err(e) => panic!("{e}"),
    };
    for j in 0..64u64 {
        put(&region, j as u32, j);
        engine
            .submit_store(Job::new(j, vec![key(j)], vec![j as u32]))
            .expect("submit");
    }
    engine.shutdown();
    engine.shutdown(); // idempotent
    let mut out = Vec::new();
    engine.poll_finished(&mut out);
    assert_eq!(out.len(), 64, "every job reported");
    let mut ids: Vec<u64> = out.iter().map(|r| r.id).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 64, "each exactly once");
    for r in &out {
        assert!(
            r.success || r.failure().map(|f| f.reason) == Some(KeyFailure::Shutdown),
            "{r:?}"
        );
    }
    assert!(matches!(
        engine.submit_store(Job::new(99, vec![key(1)], vec![0])),
        Err(Error::Shutdown)
    ));
    assert!(matches!(
        engine.submit_load(Job::new(99, vec![key(1)], vec![0])),
        Err(Error::Shutdown)
    ));
    drop(engine);
    // What was reported stored is really there after a reopen.
    let engine = Engine::open(&cfg, region.clone()).expect("reopen");
    for r in out.iter().filter(|r| r.success) {
        let l = load(&engine, &region, 1000 + r.id, &[r.id]);
        assert!(l.success, "{l:?}");
        assert!(holds(&region, 0, r.id));
    }
}

#[test]
fn an_idle_engine_sleeps_in_the_kernel() {
    // An idle worker must block in io_uring_enter, not spin (foyer#1311): over an idle spell it
    // does not go round its loop at all, and its CPU time stays near zero.
    let dir = scratch_dir();
    let cfg = file_config(&dir.path().join("dev.slab"), 32 << 20, 2);
    let region = region(4);
    let engine = match Engine::open(&cfg, region.clone()) {
        Ok(e) => e,
        Err(Error::Ring(m)) => return kvtier_sys::skip!("io_uring unavailable: {m}"),
        Err(e) => panic!("{e}"),
    };
    assert!(store(&engine, &region, 1, &[1]).success);
    std::thread::sleep(std::time::Duration::from_millis(50));
    let before = engine.stats();
    std::thread::sleep(std::time::Duration::from_millis(500));
    let after = engine.stats();
    assert_eq!(
        after.submits, before.submits,
        "workers went round their loop while idle"
    );
    assert!(
        after.worker_cpu_seconds - before.worker_cpu_seconds < 0.05,
        "idle CPU"
    );
    // And a submit still wakes it.
    assert!(load(&engine, &region, 2, &[1]).success);
    assert!(holds(&region, 0, 1));
}

/// Whether `fd` becomes readable within `ms` milliseconds.
fn readable(fd: std::os::fd::BorrowedFd<'_>, ms: u16) -> bool {
    use nix::poll::{poll, PollFd, PollFlags};
    let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
    poll(&mut fds, ms).expect("poll") == 1
}

#[test]
fn the_result_fd_wakes_a_poll_loop_for_every_result() {
    let sim = SimStorage::new(kvtier::sim::seed_from_env(), &[64 << 20]);
    let cfg = sim_config(1, 1);
    let region = region(8);
    let engine = open_sim(&cfg, &region, &sim);
    // A result published before anyone asked for the eventfd is announced by it too.
    put(&region, 0, 1);
    engine
        .submit_store(Job::new(1, vec![key(1)], vec![0]))
        .expect("submit");
    engine.drain();
    let fd = engine.result_fd().expect("eventfd");
    assert_eq!(
        engine.result_fd().expect("eventfd again").as_raw_fd(),
        fd.as_raw_fd(),
        "one eventfd per engine"
    );
    assert!(readable(fd, 0), "a result was waiting");
    assert!(engine.clear_result_fd() >= 1);
    assert!(!readable(fd, 0), "cleared");
    let mut out = Vec::new();
    assert_eq!(engine.poll_finished(&mut out), 1);
    // Every later result wakes it, each one once it is in poll_finished.
    for job in 2..5_u64 {
        put(&region, 1, job);
        engine
            .submit_store(Job::new(job, vec![key(job)], vec![1]))
            .expect("submit");
        assert!(
            readable(fd, 10_000),
            "job {job}'s result did not wake the fd"
        );
        assert!(engine.clear_result_fd() >= 1);
        out.clear();
        while engine.poll_finished(&mut out) == 0 {
            std::thread::yield_now();
        }
        assert_eq!(out[0].id, job);
        assert!(out[0].success, "{:?}", out[0]);
        assert!(!readable(fd, 0));
    }
    assert_eq!(engine.clear_result_fd(), 0, "nothing pending");
}
