//! Many caller threads share one engine (it is `Send + Sync`): each submits store and load jobs
//! for its own keys and region blocks at once, through io_uring on a real file, while one
//! collector polls every result. What would break: lost or doubled results under concurrent
//! submits, cross-talk between jobs, a data race in admission accounting.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use common::*;
use kvtier::{Engine, Error, Job, JobKind};

const THREADS: u64 = 4;
const PER_THREAD: u64 = 24;

#[test]
fn engine_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Engine>();
}

#[test]
fn concurrent_submitters_each_get_their_own_results() {
    let dir = scratch_dir();
    let cfg = file_config(&dir.path().join("dev.slab"), 64 << 20, 2);
    let region = region(THREADS * 4);
    let engine = match Engine::open(&cfg, region.clone()) {
        Ok(e) => Arc::new(e),
        Err(Error::Ring(m)) => return kvtier_sys::skip!("io_uring unavailable: {m}"),
        Err(e) => panic!("{e}"),
    };
    // Phase 1: every thread stores its keys, 4 blocks per job, from its own 4 region blocks.
    // Results polled by any thread land in `seen`, so each thread can wait for its own job.
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut handles = Vec::new();
    for t in 0..THREADS {
        let engine = Arc::clone(&engine);
        let region = Arc::clone(&region);
        let seen = Arc::clone(&seen);
        handles.push(std::thread::spawn(move || {
            for j in 0..PER_THREAD / 4 {
                let ids: Vec<u64> = (0..4).map(|i| t * 1000 + j * 4 + i).collect();
                let blocks: Vec<u32> = (0..4).map(|i| (t * 4 + i) as u32).collect();
                for (&b, &id) in blocks.iter().zip(&ids) {
                    put(&region, b, id);
                }
                let id = t * 1000 + j;
                let job = Job::new(id, ids.iter().map(|&i| key(i)).collect(), blocks);
                engine.submit_store(job).expect("submit");
                // The blocks are the job's until its result is out (the region refuses them
                // before): wait for that result, whichever thread polled it.
                loop {
                    let mut got = Vec::new();
                    engine.poll_finished(&mut got);
                    let mut seen = seen.lock().expect("results");
                    seen.extend(got);
                    if seen.iter().any(|r: &kvtier::JobResult| r.id == id) {
                        break;
                    }
                    drop(seen);
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
        }));
    }
    for h in handles {
        h.join().expect("submitter");
    }
    engine.drain();
    let mut results = std::mem::take(&mut *seen.lock().expect("results"));
    engine.poll_finished(&mut results);
    assert_eq!(results.len() as u64, THREADS * PER_THREAD / 4);
    assert!(
        results
            .iter()
            .all(|r| r.success && r.kind == JobKind::Store),
        "{results:?}"
    );
    // Phase 2: concurrent loads, each thread into its own blocks, verified by the collector.
    let mut handles = Vec::new();
    for t in 0..THREADS {
        let engine = Arc::clone(&engine);
        handles.push(std::thread::spawn(move || {
            let ids: Vec<u64> = (0..4).map(|i| t * 1000 + PER_THREAD - 4 + i).collect();
            let blocks: Vec<u32> = (0..4).map(|i| (t * 4 + i) as u32).collect();
            engine
                .submit_load(Job::new(
                    10_000 + t,
                    ids.iter().map(|&i| key(i)).collect(),
                    blocks,
                ))
                .expect("submit");
            (t, ids)
        }));
    }
    let expected: HashMap<u64, Vec<u64>> = handles
        .into_iter()
        .map(|h| {
            let (t, ids) = h.join().expect("loader");
            (10_000 + t, ids)
        })
        .collect();
    let results = wait_results(&engine, THREADS as usize);
    for r in results {
        assert!(r.success, "{r:?}");
        let t = r.id - 10_000;
        for (i, &id) in expected[&r.id].iter().enumerate() {
            assert!(
                holds(&region, (t * 4 + i as u64) as u32, id),
                "thread {t} block {i}"
            );
        }
    }
    assert_eq!(engine.stats().loads_ok, THREADS * 4);
}
