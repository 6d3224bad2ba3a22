//! The region's blocks belong to the jobs that name them while those jobs are in flight: a
//! load job cannot take a block a caller is reading (or name one block twice), the caller's
//! safe accessors work again once the result is out, and a store shares its blocks with
//! readers. Real kernel and file (the simulated device turns the guard off: it copies through
//! the region itself).

mod common;

use common::*;
use kvtier::{Engine, Error, Job, KeyFailure};

fn open(dir: &std::path::Path, blocks: u64) -> Option<(Engine, std::sync::Arc<kvtier::Region>)> {
    let cfg = file_config(&dir.join("dev.slab"), 64 << 20, 1);
    let region = region(blocks);
    match Engine::open(&cfg, region.clone()) {
        Ok(e) => Some((e, region)),
        Err(Error::Ring(m)) => {
            kvtier_sys::skip!("io_uring unavailable: {m}");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn a_load_cannot_take_a_block_a_caller_is_reading() {
    let dir = scratch_dir();
    let Some((engine, region)) = open(dir.path(), 4) else {
        return;
    };
    assert!(store(&engine, &region, 1, &[10, 11]).success);
    let at = 2 * BLOCK as usize;
    region.with_bytes(at, BLOCK as usize, |_| {
        engine
            .submit_load(Job::new(2, vec![key(10)], vec![2]))
            .expect("accepted, then failed");
    });
    let r = wait_results(&engine, 1).remove(0);
    let f = r.failure().expect("refused");
    assert_eq!(f.reason, KeyFailure::InvalidJob);
    assert!(f.detail.contains("block 2 is in use"), "{}", f.detail);
    // Afterwards the block is free for a load again, and for the caller once it reported.
    let r = load(&engine, &region, 3, &[10]);
    assert!(r.success, "{r:?}");
    assert!(holds(&region, 0, 10));
    region.fill(0, BLOCK as usize, 0);
}

#[test]
fn a_store_shares_its_blocks_with_a_reader() {
    let dir = scratch_dir();
    let Some((engine, region)) = open(dir.path(), 4) else {
        return;
    };
    put(&region, 1, 42);
    region.with_bytes(BLOCK as usize, BLOCK as usize, |_| {
        engine
            .submit_store(Job::new(1, vec![key(42)], vec![1]))
            .expect("submit");
        engine.drain();
    });
    let r = wait_results(&engine, 1).remove(0);
    assert!(r.success, "{r:?}");
    assert!(load(&engine, &region, 2, &[42]).success);
    assert!(holds(&region, 0, 42));
}

#[test]
fn a_load_naming_a_block_twice_is_refused() {
    let dir = scratch_dir();
    let Some((engine, region)) = open(dir.path(), 4) else {
        return;
    };
    assert!(store(&engine, &region, 1, &[1, 2]).success);
    engine
        .submit_load(Job::new(2, vec![key(1), key(2)], vec![3, 3]))
        .expect("accepted, then failed");
    let r = wait_results(&engine, 1).remove(0);
    let f = r.failure().expect("refused");
    assert_eq!((f.reason, f.key_index), (KeyFailure::InvalidJob, 1));
    assert!(f.detail.contains("appears twice"), "{}", f.detail);
    // A store may name a block twice (both keys get its bytes).
    put(&region, 0, 7);
    engine
        .submit_store(Job::new(3, vec![key(7), key(8)], vec![0, 0]))
        .expect("submit");
    assert!(wait_results(&engine, 1)[0].success);
}
